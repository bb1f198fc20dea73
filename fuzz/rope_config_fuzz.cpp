// libFuzzer target for the Hugging Face config.json reader (include/embedhead/io/rope_config.hpp).
//
// Every input is handed to parse_rope_config as text. The only documented rejection is
// format_error; any other exception, a sanitizer report (ASan, UBSan), a leak, a timeout or
// running out of memory is a finding. When an input parses, the result is checked against what
// the header promises: rotary_dim = int(head_dim * partial_rotary_factor), even and >= 2; the type
// one of the six; rope_frequencies at seq_len 0 throws nothing and gives rotary_dim / 2 finite,
// non-negative frequencies and a finite, positive attention factor. At longer sequence lengths
// (the regime switches of dynamic NTK and LongRoPE) only dynamic NTK may refuse, with
// value_error, when its scaled base overflows.
#include <embedhead/io/rope_config.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

namespace {

[[noreturn]] void finding(const char* what) {
  std::fprintf(stderr, "rope_config_fuzz: %s\n", what);
  std::abort();
}

void check_frequencies(const embedhead::RopeConfig& config, embedhead::Index seq_len) {
  embedhead::RopeFrequencies f;
  try {
    f = embedhead::rope_frequencies(config, seq_len);
  } catch (const embedhead::value_error& e) {
    if (seq_len == 0 || config.rope_type != "dynamic") {
      std::fprintf(stderr, "rope_config_fuzz: rope_frequencies(seq_len = %lld) refused a parsed config: %s\n",
                   static_cast<long long>(seq_len), e.what());
      std::abort();
    }
    return;
  }
  if (static_cast<embedhead::Index>(f.inv_freq.size()) != config.rotary_dim / 2)
    finding("rope_frequencies gave a number of frequencies other than rotary_dim / 2");
  for (const double x : f.inv_freq)
    if (!std::isfinite(x) || x < 0.0) finding("a frequency is negative or not finite");
  if (!std::isfinite(f.attention_factor) || !(f.attention_factor > 0.0))
    finding("the attention factor is not finite and positive");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  embedhead::RopeConfig config;
  try {
    config = embedhead::parse_rope_config(text);
  } catch (const embedhead::format_error&) {
    return 0;  // the documented rejection
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rope_config_fuzz: unexpected exception: %s\n", e.what());
    std::abort();
  } catch (...) {
    finding("unexpected non-std exception");
  }
  const std::string& type = config.rope_type;
  if (type != "default" && type != "linear" && type != "dynamic" && type != "yarn" && type != "longrope" &&
      type != "llama3")
    finding("a parsed config has a type outside the six");
  if (config.head_dim < 1) finding("a parsed config has head_dim < 1");
  if (config.rotary_dim < 2 || config.rotary_dim % 2 != 0) finding("a parsed config has an odd or short rotary_dim");
  if (config.rotary_dim !=
      static_cast<embedhead::Index>(static_cast<double>(config.head_dim) * config.partial_rotary_factor))
    finding("rotary_dim is not int(head_dim * partial_rotary_factor)");
  try {
    check_frequencies(config, 0);
    check_frequencies(config, 1);
    if (config.original_max_position_embeddings)
      check_frequencies(config, *config.original_max_position_embeddings + 1);
    if (config.max_position_embeddings) check_frequencies(config, 2 * *config.max_position_embeddings);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rope_config_fuzz: unexpected exception from rope_frequencies: %s\n", e.what());
    std::abort();
  }
  return 0;
}
