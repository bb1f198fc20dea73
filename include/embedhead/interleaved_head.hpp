// embedhead: a bf16 LM head for decoding, its table stored interleaved by 16 rows so that the decode
// reads one contiguous stream per 16 rows and transposes nothing:
//
//   P[g][k][j] = bf16(W[16 g + j, k])       g < V / 16, k < d, j < 16   (the last V mod 16 rows
//                                                                      stay row-major)
//   logits[n, v] = sum_k h[n, k] float(W[v, k])  (+ b[v])
//
// Each logit by the decode sequence of detail/gemm_packed.hpp (multiply-adds in increasing k from
// zero in each block of kPackedDepth = 256, fused where the build fuses; the block sums added in
// order; then the bias), so within a build the logits are the float head's on float(W) bit for bit
// (the decode kernel, packed_gemm and the fused loss's on the same rounded W), for any N and thread
// count (tested in the portable and the -march=native builds). Like the float head's, the bits
// depend on whether the build's multiply-add is fused.
//
// Why a layout of its own: the row-major bf16 head (LowPrecisionOutputProjection) decodes by
// reading 16 rows side by side and transposing them in registers. That is 16 streams of W at a
// row's stride, which at d = 2048 is exactly 4 KiB: all 16 fall in one L1 set, and the bf16 decode
// ran at 1.55x the float decode on an AMD EPYC (Zen 5) against 1.92x at d = 768 (bench/RESULTS.md).
// Here the 16 rows' values at k are one 32-byte load, widened exactly, and four groups from four
// segments of the vocabulary are read at once for one or two tokens (two groups for more): four
// sequential streams, which is what kept an Intel Xeon's memory busy (one stream of consecutive
// rows left the int8 head at about half the float decode's bandwidth; quantized_head.hpp).
// Interleaving rows so that SIMD lanes load them without shuffles is how llama.cpp's CPU backend
// repacks quantized weights (ggml-cpu/repack.cpp: blocks of 4 or 8 interleaved rows,
// block_q4_0x4 / block_q4_0x8); this is the same idea for bf16 rows.
//
// The table is an inference copy: building it from a LowPrecisionOutputProjection's W holds both
// while both live (2 V d bytes each); no gradient, no tying (a lookup needs the rows row-major).
#ifndef EMBEDHEAD_INTERLEAVED_HEAD_HPP
#define EMBEDHEAD_INTERLEAVED_HEAD_HPP

#include "detail/checks.hpp"
#include "detail/gemm.hpp"
#include "detail/parallel.hpp"
#include "errors.hpp"
#include "low_precision.hpp"
#include "types.hpp"

#include <Eigen/Core>

#include <algorithm>
#include <vector>

namespace embedhead {
namespace detail {

// Rows per interleaved group (the layout, whatever the build's SIMD width).
constexpr Index kInterleavedRows = 16;

// Tokens [0, T) of h against G groups of 16 rows (w[g]: the group's [d][16] values) -> logits at
// out[g] + t * ldl + j (j < 16), plus bias[g][j] when bias[g] is not null, by the sequence at the
// top of this file. The groups' sums run side by side and never mix. Values up to prefetch_end
// are prefetched a few cache lines ahead of each stream.
template <int G, int T>
void interleaved_groups(const float* h, Index ldh, const Eigen::bfloat16* const (&w)[G], Index d,
                        const float* const (&bias)[G], float* const (&out)[G], Index ldl,
                        const Eigen::bfloat16* prefetch_end) {
  using Tile = gemm::PackedTile<float>;
  using Packet = Tile::Packet;
  constexpr int L = Tile::lanes;
  static_assert(L <= kInterleavedRows && kInterleavedRows % L == 0, "a group is a whole number of packets");
  constexpr int kPackets = static_cast<int>(kInterleavedRows) / L;
  constexpr Index kAhead = 64 * kInterleavedRows;  // 64 values of k: 2 KiB ahead of each stream
  using namespace Eigen::internal;
  Index last[G];  // the last value of the table from w[g]: the prefetches stay inside it
  for (int g = 0; g < G; ++g) last[g] = static_cast<Index>(prefetch_end - w[g]) - 1;
  constexpr int kSums = G * T * kPackets;  // sum (g, t, p) at (g * T + t) * kPackets + p
  Packet c[kSums];
  for (int i = 0; i < kSums; ++i) c[i] = pset1<Packet>(0.0f);
  for (Index k0 = 0; k0 < d; k0 += gemm::kPackedDepth) {
    const Index k1 = std::min(d, k0 + gemm::kPackedDepth);
    Packet s[kSums];
    for (int i = 0; i < kSums; ++i) s[i] = pset1<Packet>(0.0f);
    auto step = [&](Index k) {
      Packet hk[T];
      for (int t = 0; t < T; ++t) hk[t] = pset1<Packet>(h[t * ldh + k]);
      for (int g = 0; g < G; ++g)
        for (int p = 0; p < kPackets; ++p) {
          const Packet wk = gemm::load_widened<float>(w[g] + k * kInterleavedRows + p * L);
          for (int t = 0; t < T; ++t) {
            Packet& sum = s[(g * T + t) * kPackets + p];
            sum = gemm::packed_madd(hk[t], wk, sum);
          }
        }
    };
    Index k = k0;
    for (; k + 2 <= k1; k += 2) {  // a cache line (32 bf16) per two values of k, prefetched ahead
      for (int g = 0; g < G; ++g) prefetch(w[g] + std::min(k * kInterleavedRows + kAhead, last[g]));
      step(k);
      step(k + 1);
    }
    if (k < k1) step(k);
    for (int i = 0; i < kSums; ++i) c[i] = k0 == 0 ? s[i] : padd(c[i], s[i]);
  }
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < T; ++t)
      for (int p = 0; p < kPackets; ++p) {
        Packet x = c[(g * T + t) * kPackets + p];
        if (bias[g]) x = padd(x, ploadu<Packet>(bias[g] + p * L));
        pstoreu(out[g] + t * ldl + p * L, x);
      }
}

// Tokens [0, N) against G groups (w, bias and out as in interleaved_groups), at most kT tokens at a
// time: the groups' values read from memory for the first kT tokens, from cache for the next.
template <int G, int kT>
void interleaved_batches(const float* h, Index ldh, Index N, const Eigen::bfloat16* const (&w)[G], Index d,
                         const float* const (&bias)[G], float* const (&out)[G], Index ldl,
                         const Eigen::bfloat16* prefetch_end) {
  for (Index t0 = 0; t0 < N; t0 += kT) {
    float* out_t[G];
    for (int g = 0; g < G; ++g) out_t[g] = out[g] + t0 * ldl;
    const float* ht = h + t0 * ldh;
    const Index T = std::min<Index>(kT, N - t0);
    if constexpr (kT == 1) {
      interleaved_groups<G, 1>(ht, ldh, w, d, bias, out_t, ldl, prefetch_end);
    } else if constexpr (kT == 2) {
      if (T == 2)
        interleaved_groups<G, 2>(ht, ldh, w, d, bias, out_t, ldl, prefetch_end);
      else
        interleaved_groups<G, 1>(ht, ldh, w, d, bias, out_t, ldl, prefetch_end);
    } else {
      static_assert(kT == 4, "batches of 1, 2 or 4 tokens");
      switch (T) {
        case 1: interleaved_groups<G, 1>(ht, ldh, w, d, bias, out_t, ldl, prefetch_end); break;
        case 2: interleaved_groups<G, 2>(ht, ldh, w, d, bias, out_t, ldl, prefetch_end); break;
        case 3: interleaved_groups<G, 3>(ht, ldh, w, d, bias, out_t, ldl, prefetch_end); break;
        default: interleaved_groups<G, 4>(ht, ldh, w, d, bias, out_t, ldl, prefetch_end); break;
      }
    }
  }
}

// Tokens [0, N) against groups [g0, g1) of the table P: the range cut into G equal segments (the
// groups left over after them one at a time), one group of each segment at a time, kT tokens at a
// time.
template <int G, int kT>
void interleaved_range(const float* h, Index ldh, Index N, const Eigen::bfloat16* P, Index d, const float* bias,
                       float* logits, Index ldl, Index g0, Index g1, const Eigen::bfloat16* prefetch_end) {
  const Index group_values = kInterleavedRows * d, segment = (g1 - g0) / G;
  auto group_at = [&](Index g, const Eigen::bfloat16*& w, const float*& b, float*& out) {
    w = P + g * group_values;
    b = bias ? bias + g * kInterleavedRows : nullptr;
    out = logits + g * kInterleavedRows;
  };
  for (Index i = 0; i < segment; ++i) {
    const Eigen::bfloat16* w[G];
    const float* b[G];
    float* out[G];
    for (int s = 0; s < G; ++s) group_at(g0 + s * segment + i, w[s], b[s], out[s]);
    interleaved_batches<G, kT>(h, ldh, N, w, d, b, out, ldl, prefetch_end);
  }
  for (Index g = g0 + G * segment; g < g1; ++g) {
    const Eigen::bfloat16* w[1];
    const float* b[1];
    float* out[1];
    group_at(g, w[0], b[0], out[0]);
    interleaved_batches<1, kT>(h, ldh, N, w, d, b, out, ldl, prefetch_end);
  }
}

// Tokens [0, N) against groups [g0, g1): one token four groups (four streams) at a time, two tokens
// four groups at a time, more tokens two groups and four tokens at a time.
inline void interleaved_tokens(const float* h, Index ldh, Index N, const Eigen::bfloat16* P, Index d, const float* bias,
                               float* logits, Index ldl, Index g0, Index g1, const Eigen::bfloat16* prefetch_end) {
  if (N == 1) return interleaved_range<4, 1>(h, ldh, N, P, d, bias, logits, ldl, g0, g1, prefetch_end);
  if (N == 2) return interleaved_range<4, 2>(h, ldh, N, P, d, bias, logits, ldl, g0, g1, prefetch_end);
  interleaved_range<2, 4>(h, ldh, N, P, d, bias, logits, ldl, g0, g1, prefetch_end);
}

}  // namespace detail

// The bf16 head in the interleaved layout, for inference: the table (V d bf16 values) and an
// optional float bias. No backward.
class InterleavedBf16Head {
 public:
  // W float [V, d] rounded to bf16 (nearest, ties to even: convert_table's rule), bias float [V, 1]
  // or empty. \throws value_error if V or d is 0 or a finite value overflows bf16 (naming it and
  // its (row, col)); shape_error for a bias of another shape.
  explicit InterleavedBf16Head(const ConstMatrixRef<float>& W,
                               const ConstMatrixRef<float>& bias = RowMatrix<float>(0, 1))
      : InterleavedBf16Head(rounded(W), bias) {}
  // W bf16 [V, d] (e.g. a LowPrecisionOutputProjection's weight().value()), copied into the layout.
  // \throws value_error if V or d is 0; shape_error for a bias of another shape.
  explicit InterleavedBf16Head(const ConstMatrixRef<Eigen::bfloat16>& W,
                               const ConstMatrixRef<float>& bias = RowMatrix<float>(0, 1))
      : V_(W.rows()), d_(W.cols()), bias_(static_cast<std::size_t>(bias.size())) {
    detail::check_size(kWhere, "V", V_);
    detail::check_size(kWhere, "d", d_);
    if (bias.size() != 0) detail::check_shape(kWhere, "bias", bias, V_, 1);
    if (bias.size() != 0)
      for (Index v = 0; v < V_; ++v) bias_[static_cast<std::size_t>(v)] = bias(v, 0);
    const Index R = detail::kInterleavedRows, groups = V_ / R;
    table_.resize(static_cast<std::size_t>(V_ * d_));
    for (Index g = 0; g < groups; ++g)
      for (Index k = 0; k < d_; ++k)
        for (Index j = 0; j < R; ++j) table_[static_cast<std::size_t>((g * d_ + k) * R + j)] = W(g * R + j, k);
    for (Index v = groups * R; v < V_; ++v)
      for (Index k = 0; k < d_; ++k) table_[static_cast<std::size_t>(v * d_ + k)] = W(v, k);
  }

  Index vocab_size() const { return V_; }
  Index dim() const { return d_; }
  bool has_bias() const { return !bias_.empty(); }
  // Bytes held: V d bf16 values and the bias.
  Index bytes() const {
    return static_cast<Index>(table_.size() * sizeof(Eigen::bfloat16) + bias_.size() * sizeof(float));
  }
  // The table back in rows: bf16 [V, d] (O(V d), for checks and saving).
  RowMatrix<Eigen::bfloat16> weight() const {
    const Index R = detail::kInterleavedRows, groups = V_ / R;
    RowMatrix<Eigen::bfloat16> W(V_, d_);
    for (Index v = 0; v < V_; ++v)
      for (Index k = 0; k < d_; ++k)
        W(v, k) = v < groups * R ? table_[static_cast<std::size_t>(((v / R) * d_ + k) * R + v % R)]
                                 : table_[static_cast<std::size_t>(v * d_ + k)];
    return W;
  }

  // h float [N, d] -> logits float [N, V] by the sequence at the top of this file; rows of the
  // table to OpenMP threads in ranges of groups (from V d = kDecodeMinElements, as the float
  // decode). Any N: each group read from memory once for the first four tokens, from cache for the
  // next. \pre logits aliases no input. \throws shape_error (nothing written).
  void forward(const ConstMatrixRef<float>& h, MatrixRef<float> logits) const {
    if (h.cols() != d_) detail::throw_shape(kForward, "h", h.rows(), h.cols(), h.rows(), d_);
    const Index N = h.rows();
    detail::check_shape(kForward, "logits", logits, N, V_);
    if (N == 0) return;
    const Index R = detail::kInterleavedRows, groups = V_ / R;
    const Eigen::bfloat16* P = table_.data();
    const Eigen::bfloat16* end = P + groups * R * d_;
    const float* bias = bias_.empty() ? nullptr : bias_.data();
    auto body = [&](Index g0, Index g1) {
      detail::interleaved_tokens(h.data(), h.outerStride(), N, P, d_, bias, logits.data(), logits.outerStride(), g0, g1,
                                 end);
    };
    if (V_ * d_ >= detail::kDecodeMinElements)
      detail::parallel_ranges(groups, 1, body);
    else
      body(0, groups);
    // The rows after the last group (stored row-major from end): the decode kernel, by the same
    // sequence, 1 .. kDecodeMaxTokens tokens at a time.
    const Index rest = V_ - groups * R;
    for (Index t0 = 0; rest > 0 && t0 < N; t0 += detail::kDecodeMaxTokens)
      detail::decode_rows<float, Eigen::bfloat16>(std::min(detail::kDecodeMaxTokens, N - t0),
                                                  h.data() + t0 * h.outerStride(), h.outerStride(), end, d_, d_,
                                                  bias ? bias + groups * R : nullptr, 1,
                                                  logits.data() + t0 * logits.outerStride() + groups * R,
                                                  logits.outerStride(), 0, rest);
  }
  RowMatrix<float> forward(const ConstMatrixRef<float>& h) const {
    if (h.cols() != d_) detail::throw_shape(kForward, "h", h.rows(), h.cols(), h.rows(), d_);
    RowMatrix<float> logits(h.rows(), V_);
    forward(h, logits);
    return logits;
  }

 private:
  static constexpr const char* kWhere = "InterleavedBf16Head";
  static constexpr const char* kForward = "InterleavedBf16Head::forward";

  static RowMatrix<Eigen::bfloat16> rounded(const ConstMatrixRef<float>& W) {
    RowMatrix<Eigen::bfloat16> out(W.rows(), W.cols());
    detail::convert_table<Eigen::bfloat16>(W, out, kWhere);
    return out;
  }

  Index V_, d_;
  std::vector<float> bias_;
  std::vector<Eigen::bfloat16> table_;
};

}  // namespace embedhead

#endif  // EMBEDHEAD_INTERLEAVED_HEAD_HPP
