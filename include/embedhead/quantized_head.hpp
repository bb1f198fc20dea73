// embedhead: an int8 LM head for decoding -- W stored as int8 rows with one float scale per row
// (quantized_embedding.hpp's scheme), streamed once per call with float accumulation:
//
//   logits[n, v] = scale_v * sum_k h[n, k] * float(Q[v, k])  (+ b[v])
//
// Decoding is bandwidth-bound (the float decode path reads W at about the speed of reading
// memory), so a quarter of the bytes makes it up to 4x faster; bench/RESULTS.md has the figures
// and the accuracy beside them (compare_heads, below, and embedhead-inspect's --compare-head).
// The quantization error of a logit is at most sum_k |h[n, k]| * scale_v / 2 (each code within
// half a step of its value) plus float rounding; tests/quantized_head_test.cpp checks that bound.
//
// The sequence of a logit (fixed, so that a token's logits are the same bits in any batch): the
// sum over k in runs of 4 SIMD packets (4 x 16 floats with AVX-512, 4 x 8 with AVX2, 4 x 1
// without either), each of the 4 running packet sums taking one packet per run with a
// multiply-add in increasing k; then ((p0 + p1) + (p2 + p3)) reduced across its lanes by halves;
// then the k beyond the last whole run, one multiply-add each in increasing k; then
// logit = scale_v * sum, or with a bias the multiply-add logit = scale_v * sum + b[v]. A
// multiply-add is fused (one rounding) where the target has FMA (int8_head_fuses(): x86 with
// AVX-512 or -mfma, AArch64), a product and a sum rounded apart otherwise; each is written out as
// std::fma or as two statements the target cannot fuse, never left to the compiler's contraction
// (GCC's default in GNU mode fused the last step on some paths of one build and not others). It
// depends on d and the build's instruction set only: a token's logits are the same bits for any
// N (a token's sums never mix with another's), any thread count and any chunking; a build for
// another instruction set may round differently.
//
// Tied heads: the table can be the embedding's own QuantizedEmbedding (one int8 table, shared by
// pointer), or quantized from a float W of its own.
#ifndef EMBEDHEAD_QUANTIZED_HEAD_HPP
#define EMBEDHEAD_QUANTIZED_HEAD_HPP

#include "detail/checks.hpp"
#include "detail/parallel.hpp"
#include "errors.hpp"
#include "quantized_embedding.hpp"
#include "types.hpp"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <sstream>

namespace embedhead {
namespace detail {

// Whether the int8 head's multiply-adds are fused (one rounding): where the target has FMA (GCC and
// clang define __FP_FAST_FMAF wherever fmaf is one instruction: POWER, s390x, RISC-V, ...).
constexpr bool int8_head_fuses() {
#if defined(__FMA__) || defined(__AVX512F__) || defined(__ARM_FEATURE_FMA) || defined(__FP_FAST_FMAF)
  return true;
#else
  return false;
#endif
}

// a * b + c by the build's rule (int8_head_fuses()), never left to contraction.
inline float int8_head_madd(float a, float b, float c) {
  if constexpr (int8_head_fuses()) {
    return std::fma(a, b, c);
  } else {
    const float product = a * b;  // no FMA on this target: nothing can fuse the two roundings
    return product + c;
  }
}

// The packet operations of the int8 head's kernel for the build's widest instruction set.
#if defined(__AVX512F__)
struct Int8HeadLanes {
  using Packet = __m512;
  static constexpr Index lanes = 16;
  static Packet zero() { return _mm512_setzero_ps(); }
  static Packet codes(const std::int8_t* q) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
  }
  static Packet load(const float* p) { return _mm512_loadu_ps(p); }
  static Packet madd(Packet a, Packet b, Packet c) { return _mm512_fmadd_ps(a, b, c); }
  static Packet add(Packet a, Packet b) { return _mm512_add_ps(a, b); }
  static float reduce(Packet a) {
    // A fixed tree: halves added until one lane is left.
    const __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    const __m128 a4 = _mm_add_ps(_mm256_castps256_ps128(a8), _mm256_extractf128_ps(a8, 1));
    const __m128 a2 = _mm_add_ps(a4, _mm_movehl_ps(a4, a4));
    return _mm_cvtss_f32(_mm_add_ss(a2, _mm_shuffle_ps(a2, a2, 1)));
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Int8HeadLanes {
  using Packet = __m256;
  static constexpr Index lanes = 8;
  static Packet zero() { return _mm256_setzero_ps(); }
  static Packet codes(const std::int8_t* q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
  }
  static Packet load(const float* p) { return _mm256_loadu_ps(p); }
  static Packet madd(Packet a, Packet b, Packet c) { return _mm256_fmadd_ps(a, b, c); }
  static Packet add(Packet a, Packet b) { return _mm256_add_ps(a, b); }
  static float reduce(Packet a) {
    const __m128 a4 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 a2 = _mm_add_ps(a4, _mm_movehl_ps(a4, a4));
    return _mm_cvtss_f32(_mm_add_ss(a2, _mm_shuffle_ps(a2, a2, 1)));
  }
};
#else
struct Int8HeadLanes {
  using Packet = float;
  static constexpr Index lanes = 1;
  static Packet zero() { return 0.0f; }
  static Packet codes(const std::int8_t* q) { return static_cast<float>(*q); }
  static Packet load(const float* p) { return *p; }
  static Packet madd(Packet a, Packet b, Packet c) { return int8_head_madd(a, b, c); }
  static Packet add(Packet a, Packet b) { return a + b; }
  static float reduce(Packet a) { return a; }
};
#endif

// Tokens [0, kTokens) of h against kRows rows of Q (q[r], d codes each) -> out[r * kTokens + t] =
// sum_k h[t, k] q[r][k], each by the sequence at the top of this file (without the scale). The
// rows' sums run side by side, instruction by instruction, and never mix.
template <int kRows, int kTokens>
inline void int8_rows_dots(const float* h, Index ldh, const std::int8_t* const* q, Index d, float* out) {
  using L = Int8HeadLanes;
  constexpr Index kRun = 4 * L::lanes;
  const Index body = d - d % kRun;
  typename L::Packet acc[kRows][kTokens][4];
  for (int r = 0; r < kRows; ++r)
    for (int t = 0; t < kTokens; ++t)
      for (int u = 0; u < 4; ++u) acc[r][t][u] = L::zero();
  for (Index k = 0; k < body; k += kRun)
    for (int u = 0; u < 4; ++u) {
      typename L::Packet hk[kTokens];
      for (int t = 0; t < kTokens; ++t) hk[t] = L::load(h + t * ldh + k + u * L::lanes);
      for (int r = 0; r < kRows; ++r) {
        const typename L::Packet w = L::codes(q[r] + k + u * L::lanes);
        for (int t = 0; t < kTokens; ++t) acc[r][t][u] = L::madd(w, hk[t], acc[r][t][u]);
      }
    }
  for (int r = 0; r < kRows; ++r)
    for (int t = 0; t < kTokens; ++t) {
      const auto& a = acc[r][t];
      float sum = L::reduce(L::add(L::add(a[0], a[1]), L::add(a[2], a[3])));
      for (Index k = body; k < d; ++k) sum = int8_head_madd(h[t * ldh + k], static_cast<float>(q[r][k]), sum);
      out[r * kTokens + t] = sum;
    }
}

// The rows' common part: logits [N, V] of the head over Q, scales and bias (strides as named).
struct Int8Head {
  const float* h;
  Index ldh;
  const std::int8_t* Q;
  Index ldq, d;
  const float* scales;
  Index lds;
  const float* bias;
  Index ldb;
  float* logits;
  Index ldl;

  // logits[t0 + t, v] = scale_v dots[t] (+ b[v]) for t < tokens.
  void store(Index v, Index t0, Index tokens, const float* dots) const {
    const float scale = scales[v * lds];
    for (Index t = 0; t < tokens; ++t)
      logits[(t0 + t) * ldl + v] = bias ? int8_head_madd(scale, dots[t], bias[v * ldb]) : scale * dots[t];
  }
};

// One or two tokens (decoding): rows [v0, v1) cut into kRows equal segments (the last rows, fewer
// than kRows, one by one after them), and one row of each segment read at a time: kRows streams
// of Q instead of one. One stream of consecutive rows left the int8 head at about half the float
// decode's bandwidth on an Intel Xeon (bench/RESULTS.md); four gave it 1.3-1.6x the speed. Only the
// order rows are visited in changes, not a logit's sequence.
template <int kRows, int kTokens>
inline void int8_head_rows_segmented(const Int8Head& head, Index v0, Index v1) {
  const Index segment = (v1 - v0) / kRows;
  float dots[kRows * kTokens];
  const std::int8_t* q[kRows];
  for (Index i = 0; i < segment; ++i) {
    for (int r = 0; r < kRows; ++r) q[r] = head.Q + (v0 + r * segment + i) * head.ldq;
    int8_rows_dots<kRows, kTokens>(head.h, head.ldh, q, head.d, dots);
    for (int r = 0; r < kRows; ++r) head.store(v0 + r * segment + i, 0, kTokens, dots + r * kTokens);
  }
  for (Index v = v0 + kRows * segment; v < v1; ++v) {
    q[0] = head.Q + v * head.ldq;
    int8_rows_dots<1, kTokens>(head.h, head.ldh, q, head.d, dots);
    head.store(v, 0, kTokens, dots);
  }
}

// logits [N, V] for rows [v0, v1) of Q. One or two tokens: int8_head_rows_segmented. More: each row
// read from memory once for the first 4 tokens (the next rows prefetched), from cache for the next.
inline void int8_head_rows(const float* h, Index ldh, Index N, const std::int8_t* Q, Index ldq, Index d,
                           const float* scales, Index lds, const float* bias, Index ldb, float* logits, Index ldl,
                           Index v0, Index v1) {
  const Int8Head head{h, ldh, Q, ldq, d, scales, lds, bias, ldb, logits, ldl};
  if (N == 1) return int8_head_rows_segmented<4, 1>(head, v0, v1);
  if (N == 2) return int8_head_rows_segmented<2, 2>(head, v0, v1);
  constexpr Index kPrefetchRows = 8;
  float dots[4];
  for (Index v = v0; v < v1; ++v) {
    const std::int8_t* q[1] = {Q + v * ldq};
#if defined(__GNUC__) || defined(__clang__)
    if (v + kPrefetchRows < v1)
      for (Index k = 0; k < d; k += 64) __builtin_prefetch(q[0] + kPrefetchRows * ldq + k);
#endif
    for (Index t0 = 0; t0 < N; t0 += 4) {
      const Index group = std::min<Index>(4, N - t0);
      const float* ht = h + t0 * ldh;
      switch (group) {
        case 1: int8_rows_dots<1, 1>(ht, ldh, q, d, dots); break;
        case 2: int8_rows_dots<1, 2>(ht, ldh, q, d, dots); break;
        case 3: int8_rows_dots<1, 3>(ht, ldh, q, d, dots); break;
        default: int8_rows_dots<1, 4>(ht, ldh, q, d, dots); break;
      }
      head.store(v, t0, group, dots);
    }
  }
}

}  // namespace detail

// h float [N, d], Q int8 [V, d], scales float [V, 1], bias float [V, 1] or empty -> logits float
// [N, V] = scale_v * (h Q^T)[:, v] (+ b[v]), by the sequence at the top of this file. Rows of Q go
// to OpenMP threads in ranges; a token's logits are the same bits for any N and thread count.
// Meant for decoding (small N: one read of Q for up to 4 tokens at a time); any N works.
// \pre logits aliases none of the inputs. \throws shape_error on any shape mismatch (nothing
// written). Cost: N V d multiply-adds, one read of Q per call (its rows again from cache for
// every 4 tokens beyond the first 4).
inline void quantized_head_forward(const ConstMatrixRef<float>& h, const ConstMatrixRef<std::int8_t>& Q,
                                   const ConstMatrixRef<float>& scales, const ConstMatrixRef<float>& bias,
                                   MatrixRef<float> logits) {
  const char* where = "quantized_head_forward";
  const Index N = h.rows(), d = h.cols(), V = Q.rows();
  if (Q.cols() != d) detail::throw_shape(where, "Q", Q.rows(), Q.cols(), V, d);
  detail::check_shape(where, "scales", scales, V, 1);
  if (bias.size() != 0) detail::check_shape(where, "bias", bias, V, 1);
  detail::check_shape(where, "logits", logits, N, V);
  if (N == 0 || V == 0) return;
  const Index min_rows = std::max<Index>(64, (Index{1} << 16) / std::max<Index>(1, d));
  detail::parallel_ranges(V, min_rows, [&](Index v0, Index v1) {
    detail::int8_head_rows(h.data(), h.outerStride(), N, Q.data(), Q.outerStride(), d, scales.data(),
                           scales.outerStride(), bias.size() != 0 ? bias.data() : nullptr,
                           bias.size() != 0 ? bias.outerStride() : 0, logits.data(), logits.outerStride(), v0, v1);
  });
}

// The int8 head as a layer for inference: a QuantizedEmbedding table (its own, or the embedding's
// when tied: one table, shared) and an optional float bias. No backward.
class QuantizedOutputProjection {
 public:
  // W float [V, d] quantized here (QuantizedEmbedding's rule), bias float [V, 1] or empty.
  // \throws as QuantizedEmbedding (non-finite W), shape_error for a bias of another shape.
  explicit QuantizedOutputProjection(const ConstMatrixRef<float>& W,
                                     const ConstMatrixRef<float>& bias = RowMatrix<float>(0, 1))
      : QuantizedOutputProjection(std::make_shared<const QuantizedEmbedding>(W), bias) {}
  // Tied: the table itself (e.g. the token embedding's), shared, never copied.
  // \throws value_error for a null table; shape_error for a bias that is neither empty nor [V, 1].
  explicit QuantizedOutputProjection(std::shared_ptr<const QuantizedEmbedding> table,
                                     const ConstMatrixRef<float>& bias = RowMatrix<float>(0, 1))
      : table_(std::move(table)), bias_(bias) {
    if (!table_) throw value_error("QuantizedOutputProjection: table is null");
    if (bias_.size() != 0) detail::check_shape("QuantizedOutputProjection", "bias", bias_, table_->vocab_size(), 1);
  }

  Index vocab_size() const { return table_->vocab_size(); }
  Index dim() const { return table_->dim(); }
  bool has_bias() const { return bias_.size() != 0; }
  const QuantizedEmbedding& table() const { return *table_; }
  const std::shared_ptr<const QuantizedEmbedding>& shared_table() const { return table_; }
  const RowMatrix<float>& bias() const { return bias_; }
  // Bytes held: V d codes, V scales, and the bias (a shared table counts here too).
  Index bytes() const { return table_->bytes() + static_cast<Index>(bias_.size() * sizeof(float)); }

  // h [N, d] -> logits [N, V] (quantized_head_forward). \throws shape_error (nothing written).
  void forward(const ConstMatrixRef<float>& h, MatrixRef<float> logits) const {
    quantized_head_forward(h, table_->values(), table_->scales(), bias_, logits);
  }
  RowMatrix<float> forward(const ConstMatrixRef<float>& h) const {
    if (h.cols() != dim()) detail::throw_shape("quantized_head_forward", "h", h.rows(), h.cols(), h.rows(), dim());
    RowMatrix<float> logits(h.rows(), vocab_size());
    forward(h, logits);
    return logits;
  }

 private:
  std::shared_ptr<const QuantizedEmbedding> table_;
  RowMatrix<float> bias_;
};

}  // namespace embedhead

#endif  // EMBEDHEAD_QUANTIZED_HEAD_HPP
