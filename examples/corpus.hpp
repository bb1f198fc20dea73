// The byte-level corpus shared by the training examples: each distinct byte of the file gets an
// id in byte order; the last 10% of the bytes are held out. Plus the unigram reference point.
#ifndef EMBEDHEAD_EXAMPLES_CORPUS_HPP
#define EMBEDHEAD_EXAMPLES_CORPUS_HPP

#include <embedhead/types.hpp>

#include <array>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace examples {

using embedhead::Index;

// The corpus as token ids: each distinct byte gets an id in byte order.
struct Corpus {
  std::vector<unsigned char> alphabet;  // id -> byte
  std::array<int, 256> id_of{};         // byte -> id, -1 if absent
  std::vector<std::int32_t> train, held_out;
  Index V() const { return static_cast<Index>(alphabet.size()); }
};

inline Corpus load_corpus(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) throw std::runtime_error("cannot open corpus '" + path + "': " + std::strerror(errno));
  std::string text;
  try {
    text.assign(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
  } catch (const std::exception& e) {  // libstdc++ throws from the stream buffer, e.g. for a directory
    throw std::runtime_error("cannot read corpus '" + path + "': " + e.what());
  }
  if (file.bad()) throw std::runtime_error("cannot read corpus '" + path + "'");
  // Both splits need enough tokens for a window of T + 1 and a meaningful held-out estimate.
  if (text.size() < 2000)
    throw std::runtime_error("corpus '" + path + "' has " + std::to_string(text.size()) +
                             " bytes; at least 2000 are needed");
  Corpus corpus;
  std::array<bool, 256> seen{};
  for (const char c : text) seen[static_cast<unsigned char>(c)] = true;
  corpus.id_of.fill(-1);
  for (int byte = 0; byte < 256; ++byte)
    if (seen[byte]) {
      corpus.id_of[byte] = static_cast<int>(corpus.alphabet.size());
      corpus.alphabet.push_back(static_cast<unsigned char>(byte));
    }
  // The last 10% of the bytes are held out.
  const std::size_t cut = text.size() - text.size() / 10;
  for (std::size_t i = 0; i < text.size(); ++i)
    (i < cut ? corpus.train : corpus.held_out).push_back(corpus.id_of[static_cast<unsigned char>(text[i])]);
  return corpus;
}

// Entropy of the train split's byte frequencies, and the held-out cross-entropy under them.
inline std::pair<double, double> unigram_baseline(const Corpus& c) {
  std::vector<double> count(static_cast<std::size_t>(c.V()), 0.0);
  for (const auto x : c.train) count[static_cast<std::size_t>(x)] += 1;
  const double n = static_cast<double>(c.train.size());
  double entropy = 0;
  for (const double k : count)
    if (k > 0) entropy -= k / n * std::log(k / n);
  double held = 0;
  const double alpha = 0.1;  // bytes that never occur in train still get a little mass
  for (const auto x : c.held_out)
    held -= std::log((count[static_cast<std::size_t>(x)] + alpha) / (n + alpha * static_cast<double>(c.V())));
  return {entropy, held / static_cast<double>(c.held_out.size())};
}

}  // namespace examples

#endif  // EMBEDHEAD_EXAMPLES_CORPUS_HPP
