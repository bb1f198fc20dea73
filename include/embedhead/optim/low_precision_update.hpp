// embedhead: how an optimizer writes a bf16 / fp16 parameter (Parameter<Storage, float>): the one
// seam where every optimizer's float update of a row meets the storage.
//
// For a low-precision parameter each row the update reads is widened to float,
//   x = float(w_r)                 (nearest, stochastic)
//   x = float(w_r) + c_r           (kahan: c the float compensation buffer, [V, d])
// updated in float exactly as a float parameter's row (the same formulas, the state in float), and
// written back once, element by element, by the optimizer's LowPrecisionUpdate mode:
//   nearest     w = round-to-nearest-even(x): an update below half a unit in the last place of
//               Storage (ulp) is lost, every step (bf16 has 8 significant bits: a weight of 1
//               moves only by steps of at least 2^-8).
//   stochastic  w = up with probability (x - down) / (up - down), else down (down <= x <= up the
//               two neighbouring Storage values; x itself when representable), so E[w] = x: small
//               updates survive in expectation. The uniform draw of element (r, j) of the
//               parameter registered k-th (0-based, registration order), written at its own step
//               count t, is draw ((t - 1) rows + r) cols + j (mod 2^64) of the Rng whose seed is
//               Rng(seed).bits_at(k): a function of (seed, k, t, r, j) only, so the bits do not
//               depend on the thread count, on which other rows were touched or in what order.
//               Beyond the largest finite Storage value (nearest gives inf) it rounds as nearest.
//   kahan       w = round-to-nearest-even(x), c = x - float(w) (exact in float), so float(w) + c is
//               the float update's x bit for bit: the trajectory of float(w) + c is the float
//               parameter's. c is optimizer state ("kahan_compensation", [rows, cols], zero at
//               first use), saved, restored and resized as the other buffers.
// A float (or double) parameter is updated in place as before, whatever the mode. Cost per row the
// update reads: O(d) to widen and to round, plus one Rng draw per element (stochastic).
#ifndef EMBEDHEAD_OPTIM_LOW_PRECISION_UPDATE_HPP
#define EMBEDHEAD_OPTIM_LOW_PRECISION_UPDATE_HPP

#include "../errors.hpp"
#include "../init.hpp"
#include "../parameter.hpp"
#include "../types.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <type_traits>
#include <vector>

namespace embedhead {

enum class LowPrecisionUpdate { nearest, stochastic, kahan };

// How an optimizer writes its low-precision parameters (see the header); seed keys the stochastic
// rounding's draws.
struct LowPrecisionUpdateOptions {
  LowPrecisionUpdate mode = LowPrecisionUpdate::stochastic;
  std::uint64_t seed = 0;
};

inline const char* low_precision_update_name(LowPrecisionUpdate mode) {
  switch (mode) {
    case LowPrecisionUpdate::nearest: return "nearest";
    case LowPrecisionUpdate::stochastic: return "stochastic";
    case LowPrecisionUpdate::kahan: return "kahan";
  }
  return "unknown";
}

namespace detail {

inline constexpr const char* kKahanBuffer = "kahan_compensation";

// \throws value_error unless mode is one of LowPrecisionUpdate's values (naming it and them).
inline void check_low_precision_update(const char* where, LowPrecisionUpdate mode) {
  const int value = static_cast<int>(mode);
  if (value >= 0 && value <= 2) return;
  std::ostringstream message;
  message << where << ": LowPrecisionUpdate mode = " << value
          << " is not one of nearest (0), stochastic (1), kahan (2); nothing was changed";
  throw value_error(message.str());
}

template <typename Storage>
std::uint16_t storage_bits(Storage s) {
  static_assert(sizeof(Storage) == 2, "a 16-bit storage type");
  std::uint16_t bits = 0;
  std::memcpy(&bits, static_cast<const void*>(&s), sizeof bits);
  return bits;
}
template <typename Storage>
Storage storage_from_bits(std::uint16_t bits) {
  Storage s;
  std::memcpy(static_cast<void*>(&s), &bits, sizeof bits);  // a 16-bit pattern, whatever Storage's members
  return s;
}

// x rounded to Storage stochastically with the uniform u in [0, 1): up with probability
// (x - down) / (up - down). Exact values, NaN, infinities and values beyond the largest finite
// Storage value round as Storage(x) (nearest).
template <typename Storage>
Storage round_stochastic(float x, double u) {
  const Storage nearest(x);
  const float n = static_cast<float>(nearest);
  if (n == x || !std::isfinite(n)) return nearest;
  // The other neighbour: one Storage ulp from `nearest` toward x. Sign-magnitude: the raw bits + 1
  // move away from zero, - 1 toward it (nearest = -0 for a tiny negative x, so + 1 is fine there).
  const std::uint16_t bits = storage_bits(nearest);
  const Storage other = storage_from_bits<Storage>(std::fabs(n) < std::fabs(x) ? bits + 1 : bits - 1);
  const float o = static_cast<float>(other);
  const Storage down = n < o ? nearest : other, up = n < o ? other : nearest;
  const double lo = static_cast<double>(static_cast<float>(down)), hi = static_cast<double>(static_cast<float>(up));
  return u < (static_cast<double>(x) - lo) / (hi - lo) ? up : down;
}

}  // namespace detail

// The rows of one parameter's value as an optimizer's update sees them: row(i) -> a float row to
// update in place, store(i) writes it back (see the header). For a Scalar parameter row(i) is the
// value's row itself and store(i) does nothing; for a low-precision one row(i) widens into a
// scratch row (one row at a time: store(i) before the next row(i)) and store(i) rounds it.
// i numbers the rows as the optimizer state does: the value's row i, or with a row mask
// (Parameter::set_trainable_rows) the i-th trainable row, trainable_rows()[i]. The Kahan
// compensation is a state buffer (row i); a stochastic draw is keyed by the value's row.
template <typename Scalar>
class ValueRows {
 public:
  using Row = Eigen::Map<Eigen::Array<Scalar, 1, Eigen::Dynamic>>;

  // A Scalar parameter, updated in place. `ids`: the value rows of the state's rows (a row mask's
  // ids), or null for every row.
  explicit ValueRows(Parameter<Scalar>& p, const Index* ids = nullptr)
      : cols_(p.cols()), ids_(ids), full_(p.value().data()) {}
  // A low-precision parameter written by `mode`; `stream` keyed for this parameter (stochastic),
  // t its step count for this write, `compensation` [state rows, cols] (kahan), `scratch` >= cols,
  // `ids` as above.
  template <typename Storage>
  ValueRows(Parameter<Storage, Scalar>& p, LowPrecisionUpdate mode, const Rng& stream, std::int64_t t,
            RowMatrix<Scalar>* compensation, Scalar* scratch, const Index* ids = nullptr)
      : cols_(p.cols()),
        rows_(p.rows()),
        ids_(ids),
        mode_(mode),
        stream_(stream),
        t_(t),
        compensation_(compensation),
        scratch_(scratch) {
    if constexpr (std::is_same_v<Storage, Eigen::bfloat16>)
      bf16_ = p.value().data();
    else
      fp16_ = p.value().data();
  }

  Index cols() const { return cols_; }
  // Whether the value is stored in a 16-bit type.
  bool low_precision() const { return full_ == nullptr; }

  // -> state row i (the value's row value_row(i)) [1, cols] in Scalar, to update in place;
  // store(i) after.
  Row row(Index i) {
    const Index r = value_row(i);
    if (full_) return Row(full_ + r * cols_, cols_);
    if (bf16_)
      widen(bf16_ + r * cols_, i);
    else
      widen(fp16_ + r * cols_, i);
    return Row(scratch_, cols_);
  }
  // Writes state row i (as updated through row(i)) back to the storage.
  void store(Index i) {
    if (full_) return;
    if (bf16_)
      narrow(bf16_ + value_row(i) * cols_, i);
    else
      narrow(fp16_ + value_row(i) * cols_, i);
  }
  // The value's row of state row i.
  Index value_row(Index i) const { return ids_ ? ids_[i] : i; }

 private:
  template <typename Storage>
  void widen(const Storage* w, Index i) {
    for (Index j = 0; j < cols_; ++j) scratch_[j] = static_cast<Scalar>(w[j]);
    if (mode_ == LowPrecisionUpdate::kahan)
      for (Index j = 0; j < cols_; ++j) scratch_[j] += (*compensation_)(i, j);
  }
  template <typename Storage>
  void narrow(Storage* w, Index i) {
    const Index r = value_row(i);
    switch (mode_) {
      case LowPrecisionUpdate::nearest:
        for (Index j = 0; j < cols_; ++j) w[j] = Storage(static_cast<float>(scratch_[j]));
        return;
      case LowPrecisionUpdate::stochastic: {
        const std::uint64_t first = (static_cast<std::uint64_t>(t_ - 1) * static_cast<std::uint64_t>(rows_) +
                                     static_cast<std::uint64_t>(r)) *
                                    static_cast<std::uint64_t>(cols_);
        for (Index j = 0; j < cols_; ++j)
          w[j] = detail::round_stochastic<Storage>(static_cast<float>(scratch_[j]),
                                                   stream_.uniform_at(first + static_cast<std::uint64_t>(j)));
        return;
      }
      case LowPrecisionUpdate::kahan:
        for (Index j = 0; j < cols_; ++j) {
          w[j] = Storage(static_cast<float>(scratch_[j]));
          (*compensation_)(i, j) = scratch_[j] - static_cast<Scalar>(w[j]);
        }
        return;
    }
  }

  Index cols_ = 0, rows_ = 0;
  const Index* ids_ = nullptr;  // a row mask's ids: state row i is the value's row ids_[i]
  Scalar* full_ = nullptr;
  Eigen::bfloat16* bf16_ = nullptr;
  Eigen::half* fp16_ = nullptr;
  LowPrecisionUpdate mode_ = LowPrecisionUpdate::nearest;
  Rng stream_{0};
  std::int64_t t_ = 0;
  RowMatrix<Scalar>* compensation_ = nullptr;
  Scalar* scratch_ = nullptr;
};

}  // namespace embedhead

#endif  // EMBEDHEAD_OPTIM_LOW_PRECISION_UPDATE_HPP
