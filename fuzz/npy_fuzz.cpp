// libFuzzer target for the .npy reader (include/embedhead/io/npy.hpp).
//
// Every input is handed to load_npy_from_bytes<float> and load_npy_from_bytes<double>, the parser
// and conversion load_npy runs on a file's bytes. The only documented rejection is format_error;
// any other exception, a sanitizer report (ASan, UBSan), an Eigen assertion (the build keeps
// assertions on), a leak, a timeout or running out of memory is a finding. When an input parses,
// the two reads are cross-checked: the same shape, and every float value equal to the double one
// rounded to float (exact for '<f4', round to nearest-even for '<f8'), NaN for NaN. The float read
// alone may refuse an input the double read accepts: exactly when a finite '<f8' value would
// become an infinity in float.
#include <embedhead/io/npy.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>

namespace {

[[noreturn]] void finding(const char* what) {
  std::fprintf(stderr, "npy_fuzz: %s\n", what);
  std::abort();
}

// Runs f; false when it threw format_error (a rejected input), aborts on anything else.
template <typename F>
bool accepted(F&& f) {
  try {
    f();
    return true;
  } catch (const embedhead::format_error&) {
    return false;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "npy_fuzz: unexpected exception: %s\n", e.what());
    std::abort();
  } catch (...) {
    finding("unexpected non-std exception");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  embedhead::RowMatrix<float> as_float;
  embedhead::RowMatrix<double> as_double;
  const bool float_ok = accepted([&] { as_float = embedhead::load_npy_from_bytes<float>(data, size, "fuzz"); });
  const bool double_ok = accepted([&] { as_double = embedhead::load_npy_from_bytes<double>(data, size, "fuzz"); });
  if (float_ok && !double_ok) finding("the float read accepts an input the double read refuses");
  if (!double_ok) return 0;
  if (!float_ok) {
    for (embedhead::Index i = 0; i < as_double.size(); ++i) {
      const double d = as_double.data()[i];
      if (std::isfinite(d) && !std::isfinite(static_cast<float>(d))) return 0;  // the documented refusal
    }
    finding("the float read refuses an input the double read accepts, with no value beyond float's range");
  }
  if (as_float.rows() != as_double.rows() || as_float.cols() != as_double.cols())
    finding("the float and double reads have different shapes");
  for (embedhead::Index i = 0; i < as_float.size(); ++i) {
    const float f = as_float.data()[i];
    const double d = as_double.data()[i];
    if (std::isnan(f) != std::isnan(d) || (!std::isnan(f) && f != static_cast<float>(d)))
      finding("a float value is not the double value rounded to float");
  }
  return 0;
}
