// embedhead internal: argument checks that build the library's error messages.
// No API promise; the exception types are public in errors.hpp.
#ifndef EMBEDHEAD_DETAIL_CHECKS_HPP
#define EMBEDHEAD_DETAIL_CHECKS_HPP

#include "../errors.hpp"
#include "../types.hpp"

#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>

namespace embedhead {
namespace detail {

[[noreturn]] inline void throw_shape(const char* where, const char* what, Index rows, Index cols, Index expected_rows,
                                     Index expected_cols) {
  std::ostringstream message;
  message << where << ": " << what << " has shape [" << rows << ", " << cols << "], expected [" << expected_rows << ", "
          << expected_cols << "]";
  throw shape_error(message.str());
}

// Throws shape_error unless m is [rows, cols].
template <typename Matrix>
void check_shape(const char* where, const char* what, const Matrix& m, Index rows, Index cols) {
  if (m.rows() != rows || m.cols() != cols) throw_shape(where, what, m.rows(), m.cols(), rows, cols);
}

// Throws value_error unless value >= 1 (table sizes V, d, T_max).
inline void check_size(const char* where, const char* what, Index value) {
  if (value < 1) {
    std::ostringstream message;
    message << where << ": " << what << " = " << value << " outside [1, inf)";
    throw value_error(message.str());
  }
}

// Throws value_error unless lo <= value <= hi (token counts of the decode path).
inline void check_range(const char* where, const char* what, Index value, Index lo, Index hi) {
  if (value < lo || value > hi) {
    std::ostringstream message;
    message << where << ": " << what << " = " << value << " outside [" << lo << ", " << hi << "]";
    throw value_error(message.str());
  }
}

// Throws value_error unless value is finite and > 0 (init standard deviations).
inline void check_positive(const char* where, const char* what, double value) {
  if (!(value > 0.0) || !std::isfinite(value)) {
    std::ostringstream message;
    message << where << ": " << what << " = " << value << " outside (0, inf)";
    throw value_error(message.str());
  }
}

template <typename Scalar>
constexpr const char* scalar_name() {
  if constexpr (std::is_same_v<Scalar, float>)
    return "float";
  else if constexpr (std::is_same_v<Scalar, double>)
    return "double";
  else
    return "long double";
}

// An option validated in double but used as Scalar must stay what it was once rounded to Scalar,
// the type its arithmetic runs in: otherwise eps = 1e-50, positive in double, is 0 in float
// (sqrt(v) + eps = 0 and 0 / 0 in Adam), and 1e300, finite in double, is inf in float. Throws
// value_error if `value` (finite, already checked in double against `range`) exceeds Scalar's
// largest finite value (it would round to +-inf), or, with reject_underflow, is non-zero but
// rounds to 0 in Scalar. The message names the value, the range, the type and its limit. For
// Scalar = double (or wider) nothing can change and nothing is checked.
template <typename Scalar>
void check_in_scalar(const char* where, const char* what, double value, const char* range,
                     bool reject_underflow = true) {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");
  if constexpr (sizeof(Scalar) < sizeof(double)) {
    const double largest = static_cast<double>(std::numeric_limits<Scalar>::max());
    // Compared before any conversion: a double beyond the float range is not converted at all.
    const bool overflows = std::fabs(value) > largest;
    const bool underflows = !overflows && reject_underflow && value != 0.0 && static_cast<Scalar>(value) == Scalar(0);
    if (!overflows && !underflows) return;
    std::ostringstream message;
    message << where << ": " << what << " = " << value << " outside " << range << " in " << scalar_name<Scalar>()
            << ": it rounds to " << (overflows ? "inf" : "0") << " (the "
            << (overflows ? "largest finite " : "smallest positive ") << scalar_name<Scalar>() << " is "
            << (overflows ? largest : static_cast<double>(std::numeric_limits<Scalar>::denorm_min())) << ")";
    throw value_error(message.str());
  } else {
    (void)where, (void)what, (void)value, (void)range, (void)reject_underflow;
  }
}

// Throws value_error unless 0 <= p <= 1 (NaN fails too).
inline void check_probability(const char* where, const char* what, double p) {
  if (!(p >= 0.0 && p <= 1.0)) {
    std::ostringstream message;
    message << where << ": " << what << " = " << p << " outside [0, 1]";
    throw value_error(message.str());
  }
}

// Throws index_error unless every id in the [B, T] matrix lies in [0, V). The message gives the
// first bad id in row-major order with its (b, t) position, e.g.
//   TokenEmbedding::forward: id 50257 at (b=1, t=3) outside [0, 50257)
template <typename Id>
void check_ids(const char* where, const TypedTokenIds<Id>& ids, Index V, const char* what = "id") {
  for (Index b = 0; b < ids.rows(); ++b) {
    for (Index t = 0; t < ids.cols(); ++t) {
      const Id id = ids(b, t);
      if (id < 0 || static_cast<Index>(id) >= V) {
        std::ostringstream message;
        message << where << ": " << what << " " << static_cast<long long>(id) << " at (b=" << b << ", t=" << t
                << ") outside [0, " << V << ")";
        throw index_error(message.str());
      }
    }
  }
}

// The first column j < cols of row r of m whose value is NaN or infinite, or -1. Float and double
// rows are scanned vectorised first (allFinite); other types (bf16) one value at a time.
template <typename Matrix>
Index first_nonfinite_column(const Matrix& m, Index r, Index cols) {
  using T = typename Matrix::Scalar;
  if constexpr (std::is_floating_point_v<T>)
    if (m.row(r).head(cols).allFinite()) return -1;
  for (Index j = 0; j < cols; ++j)
    if (!(Eigen::numext::isfinite)(m(r, j))) return j;
  return -1;
}

// Throws value_error for a non-finite input under error_if_nonfinite, e.g.
//   cross_entropy: logit nan at n=2 (b=0, t=2), column 4, outside the finite numbers (error_if_nonfinite)
// place is everything between "at " and " outside".
template <typename T>
[[noreturn]] void throw_nonfinite(const char* where, const char* what, const T& value, const std::string& place) {
  std::ostringstream message;
  if constexpr (std::is_floating_point_v<T>)
    message << where << ": " << what << " " << value;
  else
    message << where << ": " << what << " " << static_cast<float>(value);
  message << " at " << place << " outside the finite numbers (error_if_nonfinite)";
  throw value_error(message.str());
}

}  // namespace detail
}  // namespace embedhead

#endif  // EMBEDHEAD_DETAIL_CHECKS_HPP
