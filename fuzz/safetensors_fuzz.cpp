// libFuzzer target for the safetensors reader (include/embedhead/io/safetensors.hpp) and the
// checkpoint readers built on it (include/embedhead/io/checkpoint.hpp).
//
// Every input is handed to SafetensorsFile::from_bytes. When it parses, every tensor of a
// convertible dtype is read as a float table (numel <= 2^20, so a zero-sized dimension cannot make
// a huge matrix) and scanned by first_non_finite; the file is then given to from_pretrained (when a
// token-table name is present) and read_optimizer_state (when its metadata is present). The
// library may reject an input only with its documented exceptions: format_error, shape_error,
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

template <typename F>
void expect_only_library_errors(F&& f) {
  try {
    f();
  } catch (const embedhead::format_error&) {
  } catch (const embedhead::shape_error&) {
  } catch (const embedhead::value_error&) {
  } catch (const std::exception& e) {
    std::fprintf(stderr, "safetensors_fuzz: unexpected exception: %s\n", e.what());
    std::abort();
  } catch (...) {
    std::fprintf(stderr, "safetensors_fuzz: unexpected non-std exception\n");
    std::abort();
  }
}

void exercise(const embedhead::SafetensorsFile& file) {
  for (const auto& t : file.tensors()) {
    if (!embedhead::is_convertible(t.dtype) || t.numel() > kMaxNumel) continue;
    expect_only_library_errors([&] {
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
    expect_only_library_errors([&] {
      const auto names = embedhead::hugging_face_names(embedhead::guess_model_family(file), &file);
      const auto layers = embedhead::from_pretrained<float>(file, names);
      (void)layers;
    });
  }
  if (file.metadata().count("optimizer") != 0) {
    expect_only_library_errors([&] { (void)embedhead::read_optimizer_state<float>(file); });
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  expect_only_library_errors([&] { exercise(embedhead::SafetensorsFile::from_bytes(data, size, "fuzz")); });
  return 0;
}
