// embedhead internal: helpers shared by the backward passes. No API promise.
#ifndef EMBEDHEAD_DETAIL_KERNELS_HPP
#define EMBEDHEAD_DETAIL_KERNELS_HPP

#include "../scatter_workspace.hpp"
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
void gather_tokens(const TypedTokenIds<Id>& ids, const RowOf& row_of, Index row_length, const Write& write,
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
void sort_tokens_by_id(const TypedTokenIds<Id>& ids, Index skip_id, ScatterWorkspace& ws) {
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
