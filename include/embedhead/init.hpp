// embedhead: the random number generator and weight initialisation.
//
// Rng is counter-based: draw number i of a stream is a pure function mix(seed, i) (SplitMix64's
// finaliser applied to a Weyl sequence, Steele et al. 2014). So a stream is reproducible from
// (seed, counter) alone, any element can be computed without the ones before it (a later
// threaded fill gives the same bits as a sequential one), and saving or restoring the state is
// two integers. Normal draws use Box-Muller on two uniforms; results are identical on every
// platform whose libm log/cos/sqrt round the same way (glibc on x86-64 does).
#ifndef EMBEDHEAD_INIT_HPP
#define EMBEDHEAD_INIT_HPP

#include "detail/checks.hpp"
#include "types.hpp"

#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <type_traits>

namespace embedhead {

class Rng {
 public:
  explicit Rng(std::uint64_t seed = 0) : seed_(seed), key_(finalise(seed)) {}

  std::uint64_t seed() const { return seed_; }
  // Number of 64-bit draws taken so far; with seed() it is the whole state.
  std::uint64_t counter() const { return counter_; }
  void set_counter(std::uint64_t counter) { counter_ = counter; }
  void advance(std::uint64_t draws) { counter_ += draws; }

  // Draw `index` of this stream, independent of the counter.
  std::uint64_t bits_at(std::uint64_t index) const { return finalise(key_ + (index + 1) * kGolden); }
  // Uniform in [0, 1) with 53 random bits, from draw `index`.
  double uniform_at(std::uint64_t index) const { return static_cast<double>(bits_at(index) >> 11) * 0x1.0p-53; }
  // Standard normal from draws `index` and `index + 1` (Box-Muller; 1 - u keeps log away from 0).
  double normal_at(std::uint64_t index) const {
    const double u1 = 1.0 - uniform_at(index);
    const double u2 = uniform_at(index + 1);
    const double two_pi = 6.283185307179586476925286766559;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(two_pi * u2);
  }

  std::uint64_t next_bits() { return bits_at(counter_++); }
  double uniform() { return uniform_at(counter_++); }
  double normal() {
    const double z = normal_at(counter_);
    counter_ += 2;
    return z;
  }

 private:
  static constexpr std::uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
  static std::uint64_t finalise(std::uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }

  std::uint64_t seed_;
  std::uint64_t key_;  // the seed hashed once, so nearby seeds give unrelated streams
  std::uint64_t counter_ = 0;
};

namespace detail {

// The largest |Rng::normal_at| there is: u1 = 2^-53 and cos = +-1 give sqrt(-2 ln 2^-53) =
// 8.571674..., rounded up here.
inline constexpr double kMaxNormalDraw = 8.5717;

// std, the standard deviation of N(0, std^2) values drawn in double and rounded to Scalar, already
// checked in double (>= 0 or > 0, finite): throws value_error if the largest draw, kMaxNormalDraw
// std, overflows Scalar (std outside [0, max / 8.5717]: 3.97e37 in float, 2.1e307 in double), or,
// unless zero_allowed, if std rounds to 0 in Scalar (every value would be 0, not a draw).
template <typename Scalar>
void check_draw_std(const char* where, const char* what, double std, bool zero_allowed) {
  const double largest = static_cast<double>(std::numeric_limits<Scalar>::max()) / kMaxNormalDraw;
  if (std > largest) {
    std::ostringstream message;
    message << where << ": " << what << " = " << std << " outside " << (zero_allowed ? "[0, " : "(0, ") << largest
            << "] in " << scalar_name<Scalar>() << ": its largest draw, " << kMaxNormalDraw
            << " standard deviations, would overflow (the largest finite " << scalar_name<Scalar>() << " is "
            << static_cast<double>(std::numeric_limits<Scalar>::max()) << ")";
    throw value_error(message.str());
  }
  if (!zero_allowed) check_in_scalar<Scalar>(where, what, std, "(0, inf)");
}

// A layer's init_std: finite and > 0, checked in Scalar as check_draw_std.
template <typename Scalar>
void check_init_std(const char* where, const char* what, double std) {
  check_positive(where, what, std);
  check_draw_std<Scalar>(where, what, std, /*zero_allowed=*/false);
}

}  // namespace detail

// W [rows, cols] <- N(0, std^2), element (r, c) from draws counter + 2*(r*cols + c) and the next
// one; advances rng by 2*rows*cols draws. Each value is drawn in double, then rounded to Scalar.
// \pre std > 0 and finite, and so in Scalar: not 0 there, and every draw finite there (std at most
// Scalar's largest value / 8.5717, the largest |normal| Rng draws). \throws value_error otherwise
// (W and rng unchanged).
template <typename Scalar>
void init_normal(MatrixRef<Scalar> W, double std, Rng& rng) {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");
  detail::check_init_std<Scalar>("init_normal", "std", std);
  const std::uint64_t base = rng.counter();
  const Index cols = W.cols();
  for (Index r = 0; r < W.rows(); ++r)
    for (Index c = 0; c < cols; ++c)
      W(r, c) = static_cast<Scalar>(std * rng.normal_at(base + 2 * static_cast<std::uint64_t>(r * cols + c)));
  rng.advance(2 * static_cast<std::uint64_t>(W.size()));
}

}  // namespace embedhead

#endif  // EMBEDHEAD_INIT_HPP
