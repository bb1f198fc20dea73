// embedhead: absolute position embeddings added to token embeddings.
//
// Positions are given in one of two ways (x = token embeddings [B*T, d], token n = b*T + t):
//   a `start` offset     pos(b, t) = start + t              (the same for every row)
//   positions [B, T]     pos(b, t) = positions(b, t)        (per row: left padding, packed documents)
//
//   forward   out[b*T + t] = x[b*T + t] + P[pos(b, t)]
//   backward  dx = dout (the identity, nothing to compute);
//             dP[p] += sum over the tokens n with pos = p of dout[n]   (learned table only)
//
// LearnedPositionEmbedding holds a trainable P [T_max, d] (GPT-2's wpe). The sinusoidal one holds
// a fixed P computed once (Vaswani et al. 2017, section 3.5). `start` is the position of the
// first token, for incremental decoding; positions start .. start+T-1 must lie in [0, T_max).
// positions [B, T] is a TokenIds view (int32 or int64, any strides: a row-major IdMatrix, a block
// of a longer matrix); every position must lie in [0, T_max). positions_from_attention_mask
// derives them from a 0/1 attention mask [B, T] with Hugging Face's rule (cumsum(mask) - 1 on real
// tokens, 1 on pads).
#ifndef EMBEDHEAD_POSITION_EMBEDDING_HPP
#define EMBEDHEAD_POSITION_EMBEDDING_HPP

#include "detail/checks.hpp"
#include "detail/kernels.hpp"
#include "init.hpp"
#include "parameter.hpp"
#include "scatter_workspace.hpp"
#include "token_ids.hpp"
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

namespace detail {

// x [N, d] with N = positions.size(), P [T_max, d] -> out [N, d]: out[n] = x[n] + P[positions(b, t)]
// for n = b*T + t. Checks everything before writing: shape_error if x or out is not [B*T, d],
// index_error for the first position (row-major order) outside [0, T_max), naming its (b, t).
template <typename Scalar, typename Id>
void add_position_rows(const ConstMatrixRef<Scalar>& x, const ConstMatrixRef<Scalar>& P,
                       const TypedTokenIds<Id>& positions, MatrixRef<Scalar> out, const char* where) {
  const Index T = positions.cols(), N = positions.size(), d = P.cols();
  detail::check_shape(where, "x", x, N, d);
  detail::check_shape(where, "out", out, N, d);
  detail::check_ids(where, positions, P.rows(), "position");
  for (Index b = 0; b < positions.rows(); ++b)
    for (Index t = 0; t < T; ++t) out.row(b * T + t) = x.row(b * T + t) + P.row(static_cast<Index>(positions(b, t)));
}

}  // namespace detail

// x [B*T, d], P [T_max, d], positions [B, T] -> out [B*T, d]: out[b*T + t] = x[b*T + t] +
// P[positions(b, t)]. out may be x (in place). \throws shape_error if x or out is not [B*T, d];
// index_error for a position outside [0, T_max) (the first in row-major order, with its (b, t),
// its value and the range). Nothing written on throw.
template <typename Scalar>
void add_position_rows(const ConstMatrixRef<Scalar>& x, const ConstMatrixRef<Scalar>& P, TokenIds positions,
                       MatrixRef<Scalar> out) {
  positions.visit([&](const auto& typed) { detail::add_position_rows<Scalar>(x, P, typed, out, "add_position_rows"); });
}

// Hugging Face's pad position: positions_from_attention_mask gives pads this position, as
// transformers' generation code does (`position_ids.masked_fill_(attention_mask == 0, 1)`).
inline constexpr Index kPadPosition = 1;

// mask [B, T] (int32 or int64; 1 = real token, 0 = pad) -> positions [B, T] (int64):
//   positions(b, t) = mask(b, 0) + ... + mask(b, t) - 1   where mask(b, t) = 1
//   positions(b, t) = pad_position                       where mask(b, t) = 0
// Hugging Face's rule (GPT-2, Llama, ... in transformers' generation code: position_ids =
// attention_mask.cumsum(-1) - 1, then masked_fill_(attention_mask == 0, 1)), so a left-padded row
// [0, 0, 1, 1, 1] gets [1, 1, 0, 1, 2]: its real tokens take positions 0, 1, 2, as the sequence
// run alone with start = 0 does. Pads get pad_position, by default kPadPosition = 1, HF's value,
// so the positions (and a model's outputs at pads) match HF's; pass 0 for a table of one row
// (T_max = 1). A pad's position is a real row of the table, never -1, so pads index inside any
// table with more than pad_position rows; their outputs are meant to be masked out downstream.
// For a decoding step, take the last columns of the full mask's positions (a block is a TokenIds).
// \throws value_error for a mask value other than 0 or 1 (the first in row-major order, naming
// its (b, t) and the value), or pad_position < 0.
inline IdMatrix<std::int64_t> positions_from_attention_mask(TokenIds mask, Index pad_position = kPadPosition) {
  const char* where = "positions_from_attention_mask";
  if (pad_position < 0) {
    std::ostringstream message;
    message << where << ": pad_position = " << pad_position << " must be >= 0 (a row of the table)";
    throw value_error(message.str());
  }
  return mask.visit([&](const auto& m) {
    IdMatrix<std::int64_t> positions(m.rows(), m.cols());
    for (Index b = 0; b < m.rows(); ++b) {
      std::int64_t count = 0;  // real tokens in mask(b, 0 .. t)
      for (Index t = 0; t < m.cols(); ++t) {
        const auto value = m(b, t);
        if (value == 1) {
          positions(b, t) = count++;
        } else if (value == 0) {
          positions(b, t) = static_cast<std::int64_t>(pad_position);
        } else {
          std::ostringstream message;
          message << where << ": mask value " << static_cast<long long>(value) << " at (b=" << b << ", t=" << t
                  << ") is not 0 (pad) or 1 (token)";
          throw value_error(message.str());
        }
      }
    }
    return positions;
  });
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

  // x [B*T, d], positions [B, T] -> out [B*T, d] = x + P[positions(b, t)]; out may be x. See
  // add_position_rows (positions).
  void forward(const ConstMatrixRef<Scalar>& x, TokenIds positions, MatrixRef<Scalar> out) const {
    positions.visit([&](const auto& typed) {
      detail::add_position_rows<Scalar>(x, weight_->value(), typed, out, "LearnedPositionEmbedding::forward");
    });
  }
  RowMatrix<Scalar> forward(const ConstMatrixRef<Scalar>& x, TokenIds positions) const {
    // Checked before allocating, so a bad call throws before any allocation.
    positions.visit([&](const auto& typed) {
      detail::check_shape("LearnedPositionEmbedding::forward", "x", x, typed.size(), dim());
      detail::check_ids("LearnedPositionEmbedding::forward", typed, max_positions(), "position");
    });
    RowMatrix<Scalar> out(x.rows(), x.cols());
    forward(x, positions, out);
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
      if (slots_[static_cast<std::size_t>(t)] == RowGradient<Scalar>::kNoSlot) continue;  // not a trainable row
      auto dP_row = dP.slot_row(slots_[static_cast<std::size_t>(t)]);
      for (Index b = 0; b < B; ++b) dP_row += dout.row(b * T + t);
    }
  }

  // positions [B, T], dout [B*T, d] -> weight().grad()[p] += sum over the tokens n = b*T + t
  // with positions(b, t) = p of dout[n]; only the rows of positions present are touched. The
  // tokens are sorted by (position, n) and each row's tokens summed in increasing n, so the result
  // is bit-identical to the plain loop `for n: dP[pos_n] += dout[n]` on every run (one thread; the
  // order does not depend on anything but the positions). The gradient for x is dout itself.
  // A frozen table takes nothing, after the same checks.
  // \throws shape_error if dout is not [B*T, d]; index_error for a position outside [0, T_max)
  // (with its (b, t)); the gradient is unchanged on throw. Cost O(N log N + N*d), N = B*T.
  void backward(const ConstMatrixRef<Scalar>& dout, TokenIds positions) {
    positions.visit([&](const auto& typed) { backward_impl(typed, dout); });
  }

  void zero_grad() { weight_->zero_grad(); }

 private:
  static std::shared_ptr<Parameter<Scalar>> make_weight(Index T_max, Index d, const LearnedPositionOptions& options) {
    detail::check_size("LearnedPositionEmbedding", "T_max", T_max);
    detail::check_size("LearnedPositionEmbedding", "d", d);
    detail::check_init_std<Scalar>("LearnedPositionEmbedding", "init_std", options.init_std);
    return std::make_shared<Parameter<Scalar>>(T_max, d, "position_embedding.weight");
  }

  template <typename Id>
  void backward_impl(const TypedTokenIds<Id>& positions, const ConstMatrixRef<Scalar>& dout) {
    const char* where = "LearnedPositionEmbedding::backward";
    detail::check_shape(where, "dout", dout, positions.size(), dim());
    detail::check_ids(where, positions, max_positions(), "position");
    if (positions.size() == 0 || weight_->frozen()) return;  // no tokens, or frozen: no row is touched
    detail::sort_tokens_by_id(positions, -1, workspace_);    // -1: no position is skipped
    const Index k = static_cast<Index>(workspace_.unique_ids.size());
    auto& dP = weight_->grad();
    dP.touch_rows(workspace_.unique_ids.data(), k, workspace_.slots.data());  // new rows start at zero
    for (std::size_t u = 0; u < static_cast<std::size_t>(k); ++u) {
      if (workspace_.slots[u] == RowGradient<Scalar>::kNoSlot) continue;  // not a trainable row
      auto dP_row = dP.slot_row(workspace_.slots[u]);
      for (std::size_t i = workspace_.run_begin[u]; i < workspace_.run_begin[u + 1]; ++i)
        dP_row += dout.row(workspace_.order[i].second);
    }
  }

  std::shared_ptr<Parameter<Scalar>> weight_;
  std::vector<Index> positions_, slots_;  // backward scratch, reused
  ScatterWorkspace workspace_;            // backward (positions) scratch, reused
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

  // x [B*T, d], positions [B, T] -> out [B*T, d] = x + P[positions(b, t)]; out may be x. See
  // add_position_rows (positions). No backward here either: the gradient for x is dout.
  void forward(const ConstMatrixRef<Scalar>& x, TokenIds positions, MatrixRef<Scalar> out) const {
    positions.visit([&](const auto& typed) {
      detail::add_position_rows<Scalar>(x, table_, typed, out, "SinusoidalPositionEmbedding::forward");
    });
  }
  RowMatrix<Scalar> forward(const ConstMatrixRef<Scalar>& x, TokenIds positions) const {
    positions.visit([&](const auto& typed) {
      detail::check_shape("SinusoidalPositionEmbedding::forward", "x", x, typed.size(), dim());
      detail::check_ids("SinusoidalPositionEmbedding::forward", typed, max_positions(), "position");
    });
    RowMatrix<Scalar> out(x.rows(), x.cols());
    forward(x, positions, out);
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
