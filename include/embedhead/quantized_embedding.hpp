// embedhead: an int8 token table with one float scale per row, for inference lookup.
//
//   build    scale_v = max_j |E[v, j]| / 127,  Q[v, j] = round(E[v, j] / scale_v) clamped to
//            [-127, 127]  (an all-zero row gets scale 0 and Q = 0; where 127 * scale_v would
//            overflow, for max_j |E[v, j]| near FLT_MAX, scale_v is the float just below, so every
//            dequantized value of a finite table is finite)
//            Where amax / 127 is below the smallest normal float (amax < 127 FLT_MIN, about
//            1.5e-36), a subnormal has fewer significant bits and amax / 127 may round down, or to
//            0: scale_v is then rounded up instead, to the smallest float with 127 scale_v >= amax
//            (never 0 for a non-zero row), so that the bound below holds for such rows too.
//   lookup   out[b*T + t] = scale_v * float(Q[v])  with v = ids(b, t)
//
// Symmetric per-row ("per-channel") absmax quantization: a row dequantizes with an error of at
// most scale_v / 2 per element (plus float rounding), subnormal rows included (their absmax entry
// may then map to less than 127: 190 * 2^-149 has scale 2^-148 and code 95, exact), and the table
// takes V*d bytes plus V floats, a quarter of float's. This is the scheme of CTranslate2's int8
// weights (one scale per output row, 127 / amax, stored as its inverse;
// https://opennmt.net/CTranslate2/quantization.html) and of ggml's Q8_0 blocks (d = amax / 127,
// q = round(x / d); ggml.c quantize_row_q8_0), here with one block per row. -128 is never
// produced, so the range is symmetric and -q is always valid.
//
// Only the gathered rows are dequantized; there is no backward (the table is for inference).
#ifndef EMBEDHEAD_QUANTIZED_EMBEDDING_HPP
#define EMBEDHEAD_QUANTIZED_EMBEDDING_HPP

#include "detail/checks.hpp"
#include "detail/kernels.hpp"
#include "detail/parallel.hpp"
#include "types.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>

namespace embedhead {

// ---- the lookup, on views ----

// Q int8 [V, d], scales float [V, 1], ids [B, T] -> out float [B*T, d]:
// out[b*T + t] = scales[v] * float(Q[v]), v = ids(b, t). Same id checks, messages, prefetching and
// OpenMP threading as embedding_forward (bit-identical for any thread count).
// \pre out aliases neither Q nor scales. \throws shape_error if scales is not [V, 1] or out is not
// [B*T, d]; index_error for an id outside [0, V) (the first in row-major order, with its (b, t)).
// Nothing written on throw. Cost: B*T*d conversions and multiplies; no allocation.
namespace detail {

template <typename Id>
void quantized_embedding_forward(const ConstMatrixRef<std::int8_t>& Q, const ConstMatrixRef<float>& scales,
                                 const TypedTokenIds<Id>& ids, MatrixRef<float> out, const char* where) {
  const Index V = Q.rows(), d = Q.cols(), N = ids.size();
  detail::check_shape(where, "scales", scales, V, 1);
  detail::check_shape(where, "out", out, N, d);
  detail::check_ids(where, ids, V);
  if (N == 0) return;  // also keeps T = 0 out of gather_tokens' divisions
  detail::gather_tokens(
      ids, [&](Index v) { return Q.row(v).data(); }, d,
      [&](Index n, Index v) {
        const std::int8_t* q = Q.row(v).data();
        const float s = scales(v, 0);
        float* o = out.row(n).data();
        for (Index j = 0; j < d; ++j) o[j] = s * static_cast<float>(q[j]);
      },
      [] {});
}

}  // namespace detail

// The function documented above; its errors name quantized_embedding_forward.
// Layers call detail::quantized_embedding_forward with their own name instead.
inline void quantized_embedding_forward(const ConstMatrixRef<std::int8_t>& Q, const ConstMatrixRef<float>& scales,
                                        TokenIds ids, MatrixRef<float> out) {
  ids.visit([&](const auto& typed) {
    detail::quantized_embedding_forward(Q, scales, typed, out, "quantized_embedding_forward");
  });
}

// ---- the table ----

class QuantizedEmbedding {
 public:
  // E float [V, d] -> Q int8 [V, d] and scales float [V, 1] as in the header comment.
  // \throws value_error if V or d < 1, or if an entry is NaN or infinite (naming it and its
  // (row, col)). Cost O(V*d); allocates V*d bytes + V floats.
  explicit QuantizedEmbedding(const ConstMatrixRef<float>& E)
      : values_((check(E), RowMatrix<std::int8_t>(E.rows(), E.cols()))), scales_(E.rows(), 1) {
    for (Index v = 0; v < E.rows(); ++v) {
      const float amax = E.row(v).cwiseAbs().maxCoeff();
      float scale = amax / 127.0f;
      // Every code's value scale * q (|q| <= 127) must be finite: amax / 127 rounded up makes
      // 127 * scale overflow for amax near FLT_MAX (FLT_MAX / 127 * 127 = +inf in float). The
      // float below it gives 127 * scale < amax, so a finite row never dequantizes to +-inf.
      if (!std::isfinite(127.0f * scale)) scale = std::nextafter(scale, 0.0f);
      // A subnormal (or zero) quotient rounded down: one float up, the least with 127 scale >= amax
      // (127 * scale is exact in double).
      if (scale < std::numeric_limits<float>::min() && 127.0 * static_cast<double>(scale) < static_cast<double>(amax))
        scale = std::nextafter(scale, std::numeric_limits<float>::infinity());
      scales_(v, 0) = scale;
      for (Index j = 0; j < E.cols(); ++j) {
        // round() of x / scale, not x * (1 / scale): one rounding fewer. |x| <= amax, so the
        // quotient is within [-127, 127] up to a rounding; the clamp makes that exact.
        const float q = scale == 0.0f ? 0.0f : std::round(E(v, j) / scale);
        values_(v, j) = static_cast<std::int8_t>(std::clamp(q, -127.0f, 127.0f));
      }
    }
  }

  Index vocab_size() const { return values_.rows(); }
  Index dim() const { return values_.cols(); }
  // Q [V, d] and scales [V, 1], read-only (they are built together).
  const RowMatrix<std::int8_t>& values() const { return values_; }
  const RowMatrix<float>& scales() const { return scales_; }
  // The entries of the table it stands for, V*d (the V scales are quantization data, not
  // parameters). The layer contract's read-only part only: this table is inference-only, so it has
  // no Parameter, gradient, zero_grad or frozen flag -- rounding to the int8 grid has no useful
  // gradient, and training it would need a float master table (quantization-aware training), which
  // is TokenEmbedding<float> followed by QuantizedEmbedding(E) again.
  Index parameter_count() const { return values_.size(); }
  // Bytes held: V*d int8 values + V float scales.
  Index bytes() const {
    return values_.size() * static_cast<Index>(sizeof(std::int8_t)) +
           scales_.size() * static_cast<Index>(sizeof(float));
  }

  // ids [B, T] -> out float [B*T, d]. See quantized_embedding_forward.
  void forward(TokenIds ids, MatrixRef<float> out) const {
    ids.visit([&](const auto& typed) { forward_into(typed, out); });
  }
  RowMatrix<float> forward(TokenIds ids) const {
    return ids.visit([&](const auto& typed) { return forward_new(typed); });
  }

  // -> the whole dequantized table float [V, d] (tests, export). Cost O(V*d), allocates it.
  RowMatrix<float> dequantize() const {
    RowMatrix<float> out(vocab_size(), dim());
    for (Index v = 0; v < vocab_size(); ++v) out.row(v) = scales_(v, 0) * values_.row(v).cast<float>();
    return out;
  }

 private:
  static int check(const ConstMatrixRef<float>& E) {
    detail::check_size("QuantizedEmbedding", "V", E.rows());
    detail::check_size("QuantizedEmbedding", "d", E.cols());
    for (Index r = 0; r < E.rows(); ++r) {
      const Index c = detail::first_nonfinite_column(E, r, E.cols());
      if (c < 0) continue;
      std::ostringstream message;
      message << "QuantizedEmbedding: value " << E(r, c) << " at (" << r << ", " << c
              << ") is not finite; only finite tables can be quantized";
      throw value_error(message.str());
    }
    return 0;
  }
  template <typename Id>
  void forward_into(const TypedTokenIds<Id>& ids, MatrixRef<float> out) const {
    detail::quantized_embedding_forward<Id>(values_, scales_, ids, out, "QuantizedEmbedding::forward");
  }
  template <typename Id>
  RowMatrix<float> forward_new(const TypedTokenIds<Id>& ids) const {
    detail::check_ids("QuantizedEmbedding::forward", ids, vocab_size());  // before allocating
    RowMatrix<float> out(ids.size(), dim());
    forward_into(ids, out);
    return out;
  }

  RowMatrix<std::int8_t> values_;
  RowMatrix<float> scales_;
};

}  // namespace embedhead

#endif  // EMBEDHEAD_QUANTIZED_EMBEDDING_HPP
