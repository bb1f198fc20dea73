// embedhead: absolute position embeddings added to token embeddings.
//
//   forward   out[b*T + t] = x[b*T + t] + P[start + t]      (x = token embeddings [B*T, d])
//   backward  dx = dout (the identity, nothing to compute);
//             dP[start + t] += sum_b dout[b*T + t]          (learned table only)
//
// LearnedPositionEmbedding holds a trainable P [T_max, d] (GPT-2's wpe). The sinusoidal one holds
// a fixed P computed once (Vaswani et al. 2017, section 3.5). `start` is the position of the
// first token, for incremental decoding; positions start .. start+T-1 must lie in [0, T_max).
#ifndef EMBEDHEAD_POSITION_EMBEDDING_HPP
#define EMBEDHEAD_POSITION_EMBEDDING_HPP

#include "detail/checks.hpp"
#include "init.hpp"
#include "parameter.hpp"
#include "types.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <sstream>
#include <type_traits>
#include <utility>
#include <vector>

namespace embedhead {

namespace detail {
// Throws unless the matrix `what` is [B*T, d] and positions start .. start+T-1 lie in [0, T_max).
// T = 0 is an empty range and passes whatever start is.
inline void check_positions(const char* where, const char* what, Index x_rows, Index x_cols, Index B, Index T,
                            Index start, Index T_max, Index d) {
  if (B < 0 || T < 0 || (T > 0 && B > std::numeric_limits<Index>::max() / T)) {
    std::ostringstream message;
    message << where << ": B = " << B << ", T = " << T << " must be >= 0 with B*T representable";
    throw value_error(message.str());
  }
  if (x_rows != B * T || x_cols != d) throw_shape(where, what, x_rows, x_cols, B * T, d);
  // Written as start > T_max - T (not start + T > T_max) so a huge start cannot overflow past it.
  if (T > 0 && (start < 0 || T > T_max || start > T_max - T)) {
    const Index bad = start < 0 ? start : std::max(start, T_max);  // the first position outside the table
    std::ostringstream message;
    message << where << ": position " << bad << " (start " << start << ", T " << T << ") outside [0, " << T_max
            << "); the table has T_max = " << T_max << " rows";
    throw index_error(message.str());
  }
}
}  // namespace detail

// x [B*T, d], P [T_max, d] -> out [B*T, d]: out[b*T + t] = x[b*T + t] + P[start + t].
// out may be x itself (in place). \throws shape_error if x or out is not [B*T, d]; index_error if
// a position falls outside [0, T_max); value_error if B or T < 0. Nothing written on throw.
namespace detail {

template <typename Scalar>
void add_position_rows(const ConstMatrixRef<Scalar>& x, const ConstMatrixRef<Scalar>& P, Index B, Index T, Index start,
                       MatrixRef<Scalar> out, const char* where) {
  detail::check_positions(where, "x", x.rows(), x.cols(), B, T, start, P.rows(), P.cols());
  detail::check_shape(where, "out", out, B * T, P.cols());
  for (Index b = 0; b < B; ++b)
    for (Index t = 0; t < T; ++t) out.row(b * T + t) = x.row(b * T + t) + P.row(start + t);
}

}  // namespace detail

// The function documented above; its errors name add_position_rows.
// Layers call detail::add_position_rows with their own name instead.
template <typename Scalar>
void add_position_rows(const ConstMatrixRef<Scalar>& x, const ConstMatrixRef<Scalar>& P, Index B, Index T, Index start,
                       MatrixRef<Scalar> out) {
  detail::add_position_rows<Scalar>(x, P, B, T, start, out, "add_position_rows");
}

struct LearnedPositionOptions {
  double init_std = 0.02;  // P ~ N(0, init_std^2); GPT-2's original code used 0.01 for wpe
  std::uint64_t seed = 1;  // differs from TokenEmbeddingOptions' default so the tables differ
};

template <typename Scalar>
class LearnedPositionEmbedding {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");

 public:
  // Move-only, like TokenEmbedding: a copy would silently share the parameters.
  LearnedPositionEmbedding(const LearnedPositionEmbedding&) = delete;
  LearnedPositionEmbedding& operator=(const LearnedPositionEmbedding&) = delete;
  LearnedPositionEmbedding(LearnedPositionEmbedding&&) noexcept = default;
  LearnedPositionEmbedding& operator=(LearnedPositionEmbedding&&) noexcept = default;

  // A new table P [T_max, d] drawn from N(0, init_std^2) with Rng(seed).
  // \throws value_error if T_max or d < 1 or init_std is not in (0, inf), also in Scalar (see
  // init_normal).
  LearnedPositionEmbedding(Index T_max, Index d, const LearnedPositionOptions& options = {})
      : weight_(make_weight(T_max, d, options)) {
    Rng rng(options.seed);
    init_normal<Scalar>(weight_->value(), options.init_std, rng);
  }

  // Wraps an existing parameter (e.g. loaded weights) as P [T_max, d], values untouched.
  // \throws value_error if weight is null.
  explicit LearnedPositionEmbedding(std::shared_ptr<Parameter<Scalar>> weight) : weight_(std::move(weight)) {
    if (!weight_) throw value_error("LearnedPositionEmbedding: weight is a null shared_ptr<Parameter>");
  }

  Index max_positions() const { return weight_->rows(); }
  Index dim() const { return weight_->cols(); }
  Parameter<Scalar>& weight() { return *weight_; }
  const Parameter<Scalar>& weight() const { return *weight_; }
  const std::shared_ptr<Parameter<Scalar>>& weight_ptr() const { return weight_; }
  // -> {weight_ptr()}: the one parameter (no bias).
  std::vector<std::shared_ptr<Parameter<Scalar>>> parameters() const { return {weight_}; }
  Index parameter_count() const { return weight_->size(); }
  // weight().frozen() / set_frozen(): see Parameter.
  bool frozen() const { return weight_->frozen(); }
  void set_frozen(bool frozen) { weight_->set_frozen(frozen); }

  // x [B*T, d] -> out [B*T, d] = x + P[start + t]; out may be x. See add_position_rows.
  void forward(const ConstMatrixRef<Scalar>& x, Index B, Index T, MatrixRef<Scalar> out, Index start = 0) const {
    detail::add_position_rows<Scalar>(x, weight_->value(), B, T, start, out, "LearnedPositionEmbedding::forward");
  }
  RowMatrix<Scalar> forward(const ConstMatrixRef<Scalar>& x, Index B, Index T, Index start = 0) const {
    detail::check_positions("LearnedPositionEmbedding::forward", "x", x.rows(), x.cols(), B, T, start, max_positions(),
                            dim());
    RowMatrix<Scalar> out(x.rows(), x.cols());
    forward(x, B, T, out, start);
    return out;
  }

  // dout [B*T, d] -> weight().grad() rows start .. start+T-1 += sum over b of dout[b*T + t].
  // The gradient for x is dout itself. Rows are summed over b in increasing order, so the result
  // is bit-identical to the plain loop `for b, t: dP[start+t] += dout[b*T+t]`.
  // A frozen table (weight().set_frozen(true)) takes nothing, after the same checks.
  // \throws as forward; the gradient is unchanged on throw. Cost O(B*T*d); touches T rows.
  void backward(const ConstMatrixRef<Scalar>& dout, Index B, Index T, Index start = 0) {
    detail::check_positions("LearnedPositionEmbedding::backward", "dout", dout.rows(), dout.cols(), B, T, start,
                            max_positions(), dim());
    if (B == 0 || weight_->frozen()) return;  // no tokens, or frozen: no row is touched
    positions_.resize(static_cast<std::size_t>(T));
    slots_.resize(static_cast<std::size_t>(T));
    std::iota(positions_.begin(), positions_.end(), start);
    auto& dP = weight_->grad();
    dP.touch_rows(positions_.data(), T, slots_.data());
    for (Index t = 0; t < T; ++t) {
      auto dP_row = dP.slot_row(slots_[static_cast<std::size_t>(t)]);
      for (Index b = 0; b < B; ++b) dP_row += dout.row(b * T + t);
    }
  }

  void zero_grad() { weight_->zero_grad(); }

 private:
  static std::shared_ptr<Parameter<Scalar>> make_weight(Index T_max, Index d, const LearnedPositionOptions& options) {
    detail::check_size("LearnedPositionEmbedding", "T_max", T_max);
    detail::check_size("LearnedPositionEmbedding", "d", d);
    detail::check_init_std<Scalar>("LearnedPositionEmbedding", "init_std", options.init_std);
    return std::make_shared<Parameter<Scalar>>(T_max, d, "position_embedding.weight");
  }

  std::shared_ptr<Parameter<Scalar>> weight_;
  std::vector<Index> positions_, slots_;  // backward scratch, reused
};

enum class SinusoidLayout {
  // Vaswani et al. 2017: P[p, 2i] = sin(p * w_i), P[p, 2i+1] = cos(p * w_i), w_i = 10000^(-2i/d).
  interleaved,
  // tensor2tensor's get_timing_signal_1d, also CTranslate2: P[p] = [sin(p * w) | cos(p * w)] with
  // w_i = 10000^(-i / max(d/2 - 1, 1)) for i < d/2; a last zero column when d is odd.
  concatenated,
};

template <typename Scalar>
class SinusoidalPositionEmbedding {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");

 public:
  // P [T_max, d], computed in double and rounded to Scalar. \throws value_error if T_max or d < 1.
  SinusoidalPositionEmbedding(Index T_max, Index d, SinusoidLayout layout = SinusoidLayout::interleaved)
      : table_(make_table(T_max, d, layout)), layout_(layout) {}

  Index max_positions() const { return table_.rows(); }
  Index dim() const { return table_.cols(); }
  SinusoidLayout layout() const { return layout_; }
  const RowMatrix<Scalar>& table() const { return table_; }
  Index parameter_count() const { return 0; }

  // x [B*T, d] -> out [B*T, d] = x + P[start + t]; out may be x. See add_position_rows.
  // There is no parameter, so there is no backward: the gradient for x is dout.
  void forward(const ConstMatrixRef<Scalar>& x, Index B, Index T, MatrixRef<Scalar> out, Index start = 0) const {
    detail::add_position_rows<Scalar>(x, table_, B, T, start, out, "SinusoidalPositionEmbedding::forward");
  }
  RowMatrix<Scalar> forward(const ConstMatrixRef<Scalar>& x, Index B, Index T, Index start = 0) const {
    detail::check_positions("SinusoidalPositionEmbedding::forward", "x", x.rows(), x.cols(), B, T, start,
                            max_positions(), dim());
    RowMatrix<Scalar> out(x.rows(), x.cols());
    forward(x, B, T, out, start);
    return out;
  }

 private:
  static RowMatrix<Scalar> make_table(Index T_max, Index d, SinusoidLayout layout) {
    detail::check_size("SinusoidalPositionEmbedding", "T_max", T_max);
    detail::check_size("SinusoidalPositionEmbedding", "d", d);
    RowMatrix<Scalar> P = RowMatrix<Scalar>::Zero(T_max, d);
    const double log_base = std::log(10000.0);
    for (Index p = 0; p < T_max; ++p) {
      if (layout == SinusoidLayout::interleaved) {
        for (Index j = 0; j < d; ++j) {
          const Index i = j / 2;
          const double angle = static_cast<double>(p) *
                               std::exp(-log_base * static_cast<double>(2 * i) / static_cast<double>(d));
          P(p, j) = static_cast<Scalar>(j % 2 == 0 ? std::sin(angle) : std::cos(angle));
        }
      } else {
        const Index half = d / 2;
        const double increment = log_base / static_cast<double>(std::max<Index>(half - 1, 1));
        for (Index i = 0; i < half; ++i) {
          const double angle = static_cast<double>(p) * std::exp(-increment * static_cast<double>(i));
          P(p, i) = static_cast<Scalar>(std::sin(angle));
          P(p, half + i) = static_cast<Scalar>(std::cos(angle));
        }
      }
    }
    return P;
  }

  RowMatrix<Scalar> table_;
  SinusoidLayout layout_;
};

}  // namespace embedhead

#endif  // EMBEDHEAD_POSITION_EMBEDDING_HPP
