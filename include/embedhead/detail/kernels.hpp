// embedhead internal: helpers shared by the backward passes. No API promise.
#ifndef EMBEDHEAD_DETAIL_KERNELS_HPP
#define EMBEDHEAD_DETAIL_KERNELS_HPP

#include "../types.hpp"
#include "parallel.hpp"

#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <utility>
#include <vector>

namespace embedhead {

// Scratch space for embedding_backward, reused across calls so the steady state allocates
// nothing. Its contents are internal; a default-constructed one is always valid.
struct ScatterWorkspace {
  std::vector<std::pair<Index, Index>> order;  // (id, token position n), sorted
  std::vector<Index> unique_ids;               // sorted distinct ids of `order`
  std::vector<Index> slots;                    // gradient slot of each unique id
  std::vector<unsigned char> fresh;            // 1 where that slot is new to the gradient
  std::vector<std::size_t> run_begin;          // unique id u's tokens: order[run_begin[u], run_begin[u+1])
};

namespace detail {

// How many tokens ahead the lookup asks for a table row, and how much of it (in bytes):
// tuned on the project's machine (see bench/RESULTS.md); the hardware prefetcher takes over
// within a row once its first lines are in flight.
constexpr Index kPrefetchDistance = 8;
constexpr Index kPrefetchBytes = 512;

// Below these sizes a second thread costs more than it saves (tokens for the lookup, distinct
// rows for the backward); only used when the program is built with OpenMP.
constexpr Index kTokensPerThread = 256;
constexpr Index kRowsPerThread = 64;

// The LM head's GEMMs run as fixed chunks (see output_projection.hpp), each one sequential Eigen
// GEMM, so the arithmetic of every output element is fixed by the shapes alone. Tuned on the
// project's machine at GPT-2 shape (bench/RESULTS.md):
//   kHeadVocabChunk   rows of W (columns of logits, rows of dW and db) per chunk
//   kHeadTokenChunk   rows of dh (tokens) per chunk of dh = dlogits W, a sum over all of V
// and below kHeadMinFlops (2 N V d) the chunks run on the calling thread.
constexpr Index kHeadVocabChunk = 1024;
constexpr Index kHeadTokenChunk = 256;
constexpr double kHeadMinFlops = 4.0e6;

// The decode path (output_projection_decode) handles 1 to kDecodeMaxTokens tokens in one pass
// over W; kDecodeVocabChunk rows of W per chunk, threaded from kDecodeMinElements = V d.
constexpr Index kDecodeMaxTokens = 8;
constexpr Index kDecodeVocabChunk = 1024;
constexpr Index kDecodeMinElements = Index{1} << 18;

// C [M, N] += A [M, K] B [K, N] on the calling thread, C row-major with row stride ldc; A and B
// are given by data pointer, outer stride and storage order (AOrder, BOrder: Eigen::RowMajor or
// Eigen::ColMajor), so transposed operands are views, not copies. This is the product Eigen's own
// `C.noalias() += A * B` runs, called directly with no parallel info: built with OpenMP, Eigen
// would otherwise split a large product over its own threads, and both its split and its cache
// blocking (which fixes the summation order) would then depend on the thread count. Packing
// buffers go on the stack up to EIGEN_STACK_ALLOCATION_LIMIT and on the heap above, as in Eigen.
// Uses Eigen 3.3/3.4's internal general_matrix_matrix_product (no API promise from Eigen).
template <typename Scalar, int AOrder, int BOrder>
void gemm_add(Index M, Index N, Index K, const Scalar* A, Index lda, const Scalar* B, Index ldb, Scalar* C,
              Index ldc) {
  if (M == 0 || N == 0 || K == 0) return;
  using Product = Eigen::internal::general_matrix_matrix_product<Index, Scalar, AOrder, false, Scalar, BOrder, false,
                                                                 Eigen::RowMajor, 1>;
  Eigen::internal::gemm_blocking_space<Eigen::RowMajor, Scalar, Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::Dynamic>
      blocking(M, N, K, 1, true);
  Product::run(M, N, K, A, lda, B, ldb, C, 1, ldc, Scalar(1), blocking, nullptr);
}

// Decode kernel for a fixed number of tokens: for v in [v0, v1),
//   logits[t * ldl + v] = sum_j h[t * ldh + j] W[v * ldw + j] (+ bias[v * ldb]),  t < kTokens.
// Each row of W is loaded once, one SIMD packet at a time (16 floats with AVX-512), and multiplied
// into the kTokens running packet sums while it is in a register (fused multiply-adds with h read
// from L1), so W streams from memory once for all the tokens. Raw Eigen packets rather than
// Eigen::Array objects: GCC keeps an array of packets in registers, while an array of 16-float
// Arrays was spilled to the stack in some inlining contexts (store and reload every step). The
// summation order -- packet-wide running sums, Eigen's fixed reduction of the packet, the scalar
// tail, then the bias -- depends on d and the build's packet width only: a logit does not depend
// on v0, v1, the thread, nor on the other tokens of the call.
//
// While reading row v it prefetches row v + kDecodePrefetchRows, one cache line per 64 bytes
// read, spread over the loop: with 4 or 8 tokens the FMAs leave the hardware prefetcher too little
// lead. Tried on the project's machine (GFLOP/s over a 154 MB W, 8 tokens): no prefetch 12-14,
// a whole row prefetched at once 16-29, spread over the loop 36-39 for 1 to 8 rows ahead.
constexpr Index kDecodePrefetchRows = 4;

template <int kTokens, typename Scalar>
void decode_tokens(const Scalar* h, Index ldh, const Scalar* W, Index ldw, Index d, const Scalar* bias, Index ldb,
                   Scalar* logits, Index ldl, Index v0, Index v1) {
  using Packet = typename Eigen::internal::packet_traits<Scalar>::type;
  constexpr Index kLanes = Eigen::internal::packet_traits<Scalar>::size;
  constexpr Index kLineStep = std::max<Index>(kLanes, 64 / static_cast<Index>(sizeof(Scalar)));
  const Index body = d - d % kLanes;
  for (Index v = v0; v < v1; ++v) {
    const Scalar* w = W + v * ldw;
    const Scalar* ahead = W + std::min(v + kDecodePrefetchRows, v1 - 1) * ldw;  // stays inside the chunk
    Packet acc[kTokens];
    for (int t = 0; t < kTokens; ++t) acc[t] = Eigen::internal::pset1<Packet>(Scalar(0));
    for (Index j = 0; j < body; j += kLanes) {
#if defined(__GNUC__) || defined(__clang__)
      if (j % kLineStep == 0) __builtin_prefetch(ahead + j);  // once per cache line
#endif
      const Packet wj = Eigen::internal::ploadu<Packet>(w + j);
      for (int t = 0; t < kTokens; ++t)
        acc[t] = Eigen::internal::pmadd(wj, Eigen::internal::ploadu<Packet>(h + t * ldh + j), acc[t]);
    }
    for (int t = 0; t < kTokens; ++t) {
      Scalar tail(0);
      for (Index j = body; j < d; ++j) tail += w[j] * h[t * ldh + j];
      Scalar sum = Eigen::internal::predux(acc[t]) + tail;
      if (bias) sum += bias[v * ldb];
      logits[t * ldl + v] = sum;
    }
  }
}

// decode_tokens with the token count as a run-time value in [1, kDecodeMaxTokens].
template <typename Scalar>
void decode_rows(Index tokens, const Scalar* h, Index ldh, const Scalar* W, Index ldw, Index d, const Scalar* bias,
                 Index ldb, Scalar* logits, Index ldl, Index v0, Index v1) {
  static_assert(kDecodeMaxTokens == 8, "the switch below lists 1 ... kDecodeMaxTokens");
  switch (tokens) {
    case 1: return decode_tokens<1>(h, ldh, W, ldw, d, bias, ldb, logits, ldl, v0, v1);
    case 2: return decode_tokens<2>(h, ldh, W, ldw, d, bias, ldb, logits, ldl, v0, v1);
    case 3: return decode_tokens<3>(h, ldh, W, ldw, d, bias, ldb, logits, ldl, v0, v1);
    case 4: return decode_tokens<4>(h, ldh, W, ldw, d, bias, ldb, logits, ldl, v0, v1);
    case 5: return decode_tokens<5>(h, ldh, W, ldw, d, bias, ldb, logits, ldl, v0, v1);
    case 6: return decode_tokens<6>(h, ldh, W, ldw, d, bias, ldb, logits, ldl, v0, v1);
    case 7: return decode_tokens<7>(h, ldh, W, ldw, d, bias, ldb, logits, ldl, v0, v1);
    case 8: return decode_tokens<8>(h, ldh, W, ldw, d, bias, ldb, logits, ldl, v0, v1);
    default: return;  // unreachable: the callers check the range
  }
}

// Above this many output bytes the lookup writes its rows with non-temporal (streaming) stores:
// an output that large does not stay in the caches anyway, and ordinary stores would first read
// every destination line from memory (read-for-ownership), doubling the write traffic. glibc's
// memcpy makes the same switch at a size of the same order (a fraction of the L3).
constexpr Index kStreamingBytes = Index{16} << 20;

// dst[0, d) = src[0, d) with streaming stores where the instruction set has them for Scalar
// (SSE2 / AVX / AVX-512, float and double), ordinary stores for the unaligned head and tail and
// otherwise. The values written are the same as std::copy_n's; call stream_fence() before another
// thread may read them.
template <typename Scalar>
inline void copy_row_streaming(const Scalar* src, Scalar* dst, Index d) {
#if defined(__AVX512F__)
  constexpr std::uintptr_t kAlign = 64;
#elif defined(__AVX__)
  constexpr std::uintptr_t kAlign = 32;
#elif defined(__SSE2__)
  constexpr std::uintptr_t kAlign = 16;
#else
  constexpr std::uintptr_t kAlign = 0;
#endif
  if constexpr (kAlign != 0 && (std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>)) {
    constexpr Index kLanes = static_cast<Index>(kAlign / sizeof(Scalar));
    Index j = 0;
    while (j < d && reinterpret_cast<std::uintptr_t>(dst + j) % kAlign != 0) dst[j] = src[j], ++j;
    for (; j + kLanes <= d; j += kLanes) {
      if constexpr (std::is_same_v<Scalar, float>) {
#if defined(__AVX512F__)
        _mm512_stream_ps(dst + j, _mm512_loadu_ps(src + j));
#elif defined(__AVX__)
        _mm256_stream_ps(dst + j, _mm256_loadu_ps(src + j));
#elif defined(__SSE2__)
        _mm_stream_ps(dst + j, _mm_loadu_ps(src + j));
#endif
      } else {
#if defined(__AVX512F__)
        _mm512_stream_pd(dst + j, _mm512_loadu_pd(src + j));
#elif defined(__AVX__)
        _mm256_stream_pd(dst + j, _mm256_loadu_pd(src + j));
#elif defined(__SSE2__)
        _mm_stream_pd(dst + j, _mm_loadu_pd(src + j));
#endif
      }
    }
    for (; j < d; ++j) dst[j] = src[j];
  } else {
    std::copy_n(src, d, dst);
  }
}

// Orders this thread's streaming stores before anything it does next (and before a barrier lets
// other threads read them).
inline void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// Hints the CPU to start loading the first kPrefetchBytes of a row; no effect on results.
template <typename Scalar>
inline void prefetch_row(const Scalar* row, Index d) {
#if defined(__GNUC__) || defined(__clang__)
  const char* bytes = reinterpret_cast<const char*>(row);
  const Index length = std::min<Index>(d * static_cast<Index>(sizeof(Scalar)), kPrefetchBytes);
  for (Index offset = 0; offset < length; offset += 64) __builtin_prefetch(bytes + offset);
#else
  (void)row;
  (void)d;
#endif
}

// The token loop of every lookup: calls write(n, v) for each token n = b*T + t of ids [B, T] (N
// = B*T >= 1 tokens), v = ids(b, t), in contiguous ranges of tokens spread over the OpenMP
// threads (each n is written by one thread only), then finish() at the end of each range. While
// it is at token n it asks the CPU for the table row of token n + kPrefetchDistance (row_of(v),
// `row_length` scalars long): rows of a large table come from DRAM in random order, and asking a
// few tokens ahead hides that latency (about 1.4x faster at V = 50257, d = 768, N = 8192).
template <typename Id, typename RowOf, typename Write, typename Finish>
void gather_tokens(const ConstIdRef<Id>& ids, const RowOf& row_of, Index row_length, const Write& write,
                   const Finish& finish) {
  const Index N = ids.size(), T = ids.cols();
  parallel_ranges(N, kTokensPerThread, [&](Index begin, Index end) {
    const Index ahead_end = std::min(end + kPrefetchDistance, N);
    // (b, t) walks the range; (ahead_b, ahead_t) walks kPrefetchDistance tokens ahead of it.
    Index b = begin / T, t = begin % T;
    Index ahead = std::min(begin + kPrefetchDistance, ahead_end);
    Index ahead_b = ahead / T, ahead_t = ahead % T;
    for (Index n = begin; n < end; ++n) {
      if (ahead < ahead_end) {
        prefetch_row(row_of(static_cast<Index>(ids(ahead_b, ahead_t))), row_length);
        ++ahead;
        if (++ahead_t == T) ahead_t = 0, ++ahead_b;
      }
      write(n, static_cast<Index>(ids(b, t)));
      if (++t == T) t = 0, ++b;
    }
    finish();
  });
}

// ids [B, T] -> ws.order = (id, n) for every token n = b*T + t whose id != skip_id, sorted by id
// and, within an id, by n; ws.unique_ids = the distinct ids. Sorting by (id, n) fixes the order
// in which repeats are summed, so the result does not depend on threads or runs.
template <typename Id>
void sort_tokens_by_id(const ConstIdRef<Id>& ids, Index skip_id, ScatterWorkspace& ws) {
  ws.order.clear();
  ws.order.reserve(static_cast<std::size_t>(ids.size()));
  const Index T = ids.cols();
  for (Index b = 0; b < ids.rows(); ++b)
    for (Index t = 0; t < T; ++t) {
      const Index id = static_cast<Index>(ids(b, t));
      if (id != skip_id) ws.order.emplace_back(id, b * T + t);
    }
  std::sort(ws.order.begin(), ws.order.end());
  ws.unique_ids.clear();
  ws.run_begin.clear();
  for (std::size_t i = 0; i < ws.order.size(); ++i)
    if (ws.unique_ids.empty() || ws.unique_ids.back() != ws.order[i].first) {
      ws.unique_ids.push_back(ws.order[i].first);
      ws.run_begin.push_back(i);
    }
  ws.run_begin.push_back(ws.order.size());
  ws.slots.resize(ws.unique_ids.size());
  ws.fresh.resize(ws.unique_ids.size());
}

}  // namespace detail
}  // namespace embedhead

#endif  // EMBEDHEAD_DETAIL_KERNELS_HPP
