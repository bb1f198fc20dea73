// libFuzzer target for the safetensors reader (include/embedhead/io/safetensors.hpp) and the
// checkpoint readers built on it (include/embedhead/io/checkpoint.hpp).
//
// Every input is handed to SafetensorsFile::from_bytes. When it parses, every tensor of a
// convertible dtype is read as a float table (numel <= 2^20, so a zero-sized dimension cannot make
// a huge matrix) and scanned by first_non_finite; the file is then given to from_pretrained (when a
// token-table name is present) and read_optimizer_state (when its metadata is present). Each call
// may reject an input only with the exceptions its documentation lists: from_bytes and
// read_optimizer_state format_error; read format_error and shape_error; from_pretrained those and
// value_error. Any other exception, a sanitizer report (ASan, UBSan), an Eigen assertion (the
// build keeps assertions on), a leak, a timeout or running out of memory is a finding.
#include <embedhead/io/checkpoint.hpp>
#include <embedhead/io/optimizer_state.hpp>
#include <embedhead/io/safetensors.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>

namespace {

// Largest tensor converted per input; bigger ones are still parsed and validated.
constexpr std::uint64_t kMaxNumel = std::uint64_t{1} << 20;

// Runs f; an exception of one of the Documented types is a rejected input, anything else a finding.
template <typename... Documented, typename F>
void expect_only(const char* call, F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    if ((... || (dynamic_cast<const Documented*>(&e) != nullptr))) return;
    std::fprintf(stderr, "safetensors_fuzz: %s threw an undocumented exception: %s\n", call, e.what());
    std::abort();
  } catch (...) {
    std::fprintf(stderr, "safetensors_fuzz: %s threw a non-std exception\n", call);
    std::abort();
  }
}

using embedhead::format_error;
using embedhead::shape_error;
using embedhead::value_error;

void exercise(const embedhead::SafetensorsFile& file) {
  for (const auto& t : file.tensors()) {
    if (!embedhead::is_convertible(t.dtype) || t.numel() > kMaxNumel) continue;
    expect_only<format_error, shape_error>("read", [&] {
      const embedhead::RowMatrix<float> table = file.read<float>(t.name);
      const std::int64_t bad = file.first_non_finite(t);
      // Cross-check the two: a non-finite source value stays non-finite in float.
      if (bad >= 0 && std::isfinite(table.data()[bad])) {
        std::fprintf(stderr, "safetensors_fuzz: first_non_finite = %lld but the float value is finite\n",
                     static_cast<long long>(bad));
        std::abort();
      }
    });
  }
  if (file.contains("wte.weight") || file.contains("transformer.wte.weight") ||
      file.contains("model.embed_tokens.weight")) {
    expect_only<format_error, shape_error, value_error>("from_pretrained", [&] {
      const auto names = embedhead::hugging_face_names(embedhead::guess_model_family(file), &file);
      const auto layers = embedhead::from_pretrained<float>(file, names);
      (void)layers;
    });
  }
  if (file.metadata().count("optimizer") != 0) {
    expect_only<format_error>("read_optimizer_state", [&] { (void)embedhead::read_optimizer_state<float>(file); });
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // (exercise catches what the calls on a valid file throw: what escapes here is from_bytes's.)
  expect_only<format_error>("from_bytes",
                            [&] { exercise(embedhead::SafetensorsFile::from_bytes(data, size, "fuzz")); });
  return 0;
}
