// Under-trained tokens, found from the weights alone.
//
// A byte-level bigram model (logits = E[x_t] W^T + b predicts x_{t+1}; E and W untied, V = 256
// byte ids) is trained with plain SGD on examples/data/corpus.txt. The corpus uses only a few
// dozen of the 256 bytes: every other id is a token that never occurs in training, exactly known
// from the byte counts of the train split. Their rows of E never receive a gradient, so with
// sparse SGD and no weight decay they stay bit for bit at their initialisation (checked below);
// their rows of W receive only the softmax's push-down (p_v h for every position), all in much
// the same direction. That is the situation of glitch tokens such as SolidGoldMagikarp in a real
// vocabulary.
//
// The trained layers are saved with save_checkpoint (Llama names, untied, F32), and
// undertrained_scores ranks the tokens of E and of W, once by the simple indicator (ascending
// distance to the centroid) and once by the Magikarp score given 4 of the unseen ids as
// known-unused (those 4 are then excluded from the evaluation). Reported: precision at
// |unseen|, the fraction of the top |unseen| ids that are really unseen (chance: |unseen| / V).
//
// Usage: undertrained_tokens <corpus.txt> [--quick] [--out PREFIX]
//   --quick   fewer steps (for ctest)
//   --out     where to write PREFIX.safetensors, PREFIX.vocab (one token per line), PREFIX.unseen
//             and PREFIX.known (comma-separated ids) for embedhead-inspect; default
//             "undertrained_tokens" in the working directory
#include <embedhead/analysis/geometry.hpp>
#include <embedhead/embedhead.hpp>
#include <embedhead/io/checkpoint.hpp>

#include "corpus.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace embedhead;
using Ids = IdMatrix<std::int32_t>;

constexpr Index kV = 256;  // every byte value is a token id

struct Settings {
  Index d = 32, B = 16, T = 32;
  int steps = 3000;
  float lr = 2.0f;
  double init_std = 0.02;  // the usual N(0, 0.02^2) (GPT-2, Llama): unseen rows stay small
  std::uint64_t seed = 7;
};

// Fraction of the first n ids of `ranking` (skipping `excluded`) that are in `relevant`, with n =
// the number of relevant ids not excluded.
// The ids ranked in the top n that are not relevant are appended to *misses.
double precision_at_relevant(const std::vector<Index>& ranking, const std::vector<bool>& relevant,
                             const std::vector<bool>& excluded, Index* n_out, std::vector<Index>* misses) {
  Index n = 0;
  for (Index v = 0; v < kV; ++v) n += relevant[static_cast<std::size_t>(v)] && !excluded[static_cast<std::size_t>(v)];
  Index taken = 0, hits = 0;
  for (const Index v : ranking) {
    if (taken == n) break;
    if (excluded[static_cast<std::size_t>(v)]) continue;
    ++taken;
    hits += relevant[static_cast<std::size_t>(v)];
    if (!relevant[static_cast<std::size_t>(v)]) misses->push_back(v);
  }
  *n_out = n;
  return static_cast<double>(hits) / static_cast<double>(n);
}

std::string byte_token(int byte) {
  if (byte > 0x20 && byte < 0x7F) return std::string(1, static_cast<char>(byte));
  char buffer[8];
  std::snprintf(buffer, sizeof buffer, "<0x%02X>", byte);  // Llama's byte-fallback spelling
  return buffer;
}

// "0-9, 11-31, 33-38" from sorted ids.
std::string ranges(const std::vector<Index>& ids) {
  std::string out;
  for (std::size_t i = 0; i < ids.size();) {
    std::size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
    out += (out.empty() ? "" : ", ") + std::to_string(ids[i]) + (j > i ? "-" + std::to_string(ids[j]) : "");
    i = j + 1;
  }
  return out;
}

void write_ids(const std::string& path, const std::vector<Index>& ids) {
  std::ofstream out(path);
  for (std::size_t i = 0; i < ids.size(); ++i) out << (i ? "," : "") << ids[i];
  out << '\n';
  if (!out) throw std::runtime_error("cannot write '" + path + "'");
}

int run(int argc, char** argv) {
  Settings s;
  std::string corpus_path, prefix = "undertrained_tokens";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick")
      s.steps = 600;
    else if (a == "--out" && i + 1 < argc)
      prefix = argv[++i];
    else if (corpus_path.empty() && a[0] != '-')
      corpus_path = a;
    else {
      std::fprintf(stderr, "usage: %s <corpus.txt> [--quick] [--out PREFIX]\n", argv[0]);
      return 2;
    }
  }
  if (corpus_path.empty()) {
    std::fprintf(stderr, "usage: %s <corpus.txt> [--quick] [--out PREFIX]\n", argv[0]);
    return 2;
  }

  // The train split as byte ids (examples::Corpus numbers the distinct bytes; map them back).
  const examples::Corpus corpus = examples::load_corpus(corpus_path);
  std::vector<std::int32_t> text;
  for (const auto id : corpus.train) text.push_back(corpus.alphabet[static_cast<std::size_t>(id)]);
  std::array<long, kV> count{};
  for (const auto b : text) ++count[static_cast<std::size_t>(b)];
  std::vector<Index> unseen;
  std::vector<bool> is_unseen(kV, false);
  for (Index v = 0; v < kV; ++v)
    if (count[static_cast<std::size_t>(v)] == 0) {
      unseen.push_back(v);
      is_unseen[static_cast<std::size_t>(v)] = true;
    }
  const Index n_unseen = static_cast<Index>(unseen.size());
  std::printf("vocabulary: V = %ld byte ids; the train split (%zu bytes) uses %ld of them\n", static_cast<long>(kV),
              text.size(), static_cast<long>(kV - n_unseen));
  std::printf("unseen ids (never an input or a target in training): %ld: %s\n", static_cast<long>(n_unseen),
              ranges(unseen).c_str());

  // ---- the model: untied, E [V, d], W [V, d], b [V] ----
  TokenEmbeddingOptions eo;
  eo.init_std = s.init_std;
  eo.seed = s.seed;
  OutputProjectionOptions ho;
  ho.init_std = s.init_std;
  ho.seed = s.seed + 1;
  TokenEmbedding<float> embedding(kV, s.d, eo);
  OutputProjection<float> head(kV, s.d, ho);
  const RowMatrix<float> E0 = embedding.weight().value();
  std::vector<std::shared_ptr<Parameter<float>>> parameters = {embedding.weight_ptr()};
  for (const auto& p : head.parameters()) parameters.push_back(p);

  // ---- plain SGD, lr decaying linearly to 0; only touched rows move (no weight decay) ----
  const Index N = s.B * s.T;
  Ids ids(s.B, s.T), targets(s.B, s.T);
  RowMatrix<float> h(N, s.d), logits(N, kV), dlogits(N, kV), dh(N, s.d);
  CrossEntropyLoss<float> loss;
  Rng window_rng(s.seed + 100);
  const std::uint64_t last_start = text.size() - static_cast<std::size_t>(s.T) - 1;
  double loss_sum = 0;
  for (int step = 0; step < s.steps; ++step) {
    for (Index b = 0; b < s.B; ++b) {
      const std::size_t start = static_cast<std::size_t>(window_rng.next_bits() % (last_start + 1));
      for (Index t = 0; t < s.T; ++t) {
        ids(b, t) = text[start + static_cast<std::size_t>(t)];
        targets(b, t) = text[start + static_cast<std::size_t>(t) + 1];
      }
    }
    for (const auto& p : parameters) p->zero_grad();
    embedding.forward(ids, h);
    head.forward(h, logits);
    const double l = loss.forward_backward(logits, targets, dlogits).loss;
    if (step >= s.steps - 100) loss_sum += l;
    head.backward(h, dlogits, dh);
    embedding.backward(ids, dh);
    const float lr = s.lr * (1.0f - static_cast<float>(step) / static_cast<float>(s.steps));
    for (const auto& p : parameters) {
      const RowGradient<float>& g = p->grad();
      auto W = p->value();
      for (Index i = 0; i < g.num_touched(); ++i)
        W.row(g.touched_rows()[static_cast<std::size_t>(i)]) -= lr * g.touched_row(i);
    }
  }
  std::printf("trained %d SGD steps of %ld tokens: mean batch loss over the last 100 steps %.4f nats (log V = %.4f)\n",
              s.steps, static_cast<long>(N), loss_sum / std::min(100, s.steps), std::log(static_cast<double>(kV)));

  const RowMatrix<float>& E = embedding.weight().value();
  Index unchanged = 0;
  for (const Index v : unseen) unchanged += (E.row(v).array() == E0.row(v).array()).all();
  std::printf("rows of E of unseen ids still bit-identical to their initial values: %ld of %ld\n",
              static_cast<long>(unchanged), static_cast<long>(n_unseen));

  // ---- save, for embedhead-inspect ----
  save_checkpoint<float>(prefix + ".safetensors", hugging_face_names(ModelFamily::llama), embedding, &head);
  {
    std::ofstream vocab(prefix + ".vocab");
    for (int b = 0; b < kV; ++b) vocab << byte_token(b) << '\n';
  }
  // Four known-unused ids, spread over the unseen ones (as a model's reserved tokens would be).
  const std::vector<Index> known = {unseen[0], unseen[static_cast<std::size_t>(n_unseen / 3)],
                                    unseen[static_cast<std::size_t>(2 * n_unseen / 3)], unseen.back()};
  write_ids(prefix + ".unseen", unseen);
  write_ids(prefix + ".known", known);
  std::printf(
      "wrote %s.safetensors (model.embed_tokens.weight, lm_head.weight, lm_head.bias), %s.vocab, %s.unseen, "
      "%s.known\n",
      prefix.c_str(), prefix.c_str(), prefix.c_str(), prefix.c_str());

  // ---- rank and score ----
  std::vector<bool> none(kV, false), known_mask(kV, false);
  for (const Index v : known) known_mask[static_cast<std::size_t>(v)] = true;
  std::printf(
      "\nprecision at n = |unseen| (the fraction of the n top-ranked ids that are unseen; chance = n / V),\n"
      "and the seen bytes ranked among them, with their count in the %zu training bytes:\n",
      text.size());
  std::printf("  %-10s %-36s %4s %9s %6s  %s\n", "matrix", "indicator", "n", "precision", "chance",
              "seen bytes in the top n");
  const auto line = [&](const char* matrix, const char* indicator, const std::vector<Index>& ranking,
                        const std::vector<bool>& excluded, Index candidates) {
    Index n = 0;
    std::vector<Index> misses;
    const double p = precision_at_relevant(ranking, is_unseen, excluded, &n, &misses);
    std::string seen;
    for (const Index v : misses)
      seen += (seen.empty() ? "" : " ") + byte_token(static_cast<int>(v)) + "(" +
              std::to_string(count[static_cast<std::size_t>(v)]) + ")";
    std::printf("  %-10s %-36s %4ld %9.3f %6.3f  %s\n", matrix, indicator, static_cast<long>(n), p,
                static_cast<double>(n) / static_cast<double>(candidates), seen.c_str());
  };
  for (const bool use_head : {false, true}) {
    const RowMatrix<float>& M = use_head ? head.weight().value() : E;
    const char* matrix = use_head ? "W (head)" : "E (table)";
    line(matrix, "ascending centroid distance", undertrained_scores<float>(M).ranking, none, kV);
    line(matrix, "Magikarp, 4 known-unused excluded", undertrained_scores<float>(M, known).ranking, known_mask, kV - 4);
  }
  std::printf(
      "\ninspect it: embedhead-inspect %s.safetensors --vocab %s.vocab --unused-file %s.known --top %ld "
      "--html report.html\n",
      prefix.c_str(), prefix.c_str(), prefix.c_str(), static_cast<long>(n_unseen - 4));
  if (unchanged != n_unseen) {
    std::fprintf(stderr, "undertrained_tokens: error: %ld unseen rows of E changed in training\n",
                 static_cast<long>(n_unseen - unchanged));
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "undertrained_tokens: error: %s\n", e.what());
    return 1;
  }
}
