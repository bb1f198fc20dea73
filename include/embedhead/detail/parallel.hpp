// embedhead internal: optional OpenMP threading with results that do not depend on the number of
// threads. No API promise.
//
// The library is threaded only when the including program is compiled with OpenMP (-fopenmp, or
// linking CMake's OpenMP::OpenMP_CXX); otherwise everything runs on the calling thread. Work is
// split so that each output element is computed by exactly one thread in the same order as the
// sequential code, so results are bit-identical for any thread count.
#ifndef EMBEDHEAD_DETAIL_PARALLEL_HPP
#define EMBEDHEAD_DETAIL_PARALLEL_HPP

#include "../types.hpp"

#include <algorithm>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace embedhead {
namespace detail {

// Calls body(begin, end) on contiguous ranges that cover [0, count) exactly once: one range per
// thread when OpenMP is on and count >= 2 * min_per_thread, else body(0, count) on this thread.
// body must not throw (the callers check every input first).
template <typename Body>
void parallel_ranges(Index count, Index min_per_thread, const Body& body) {
#ifdef _OPENMP
  const int threads = omp_get_max_threads();
  if (threads > 1 && count >= 2 * min_per_thread && !omp_in_parallel()) {
#pragma omp parallel num_threads(threads)
    {
      const Index n = omp_get_num_threads(), i = omp_get_thread_num();
      body(count * i / n, count * (i + 1) / n);
    }
    return;
  }
#else
  (void)min_per_thread;
#endif
  body(Index{0}, count);
}

// The number of threads parallel_chunks(count, chunk, threaded, ...) runs its chunks on: more than
// one only with OpenMP, threaded = true, at least two chunks and more than one thread available,
// outside a parallel region; else 1 (the calling thread).
inline Index chunk_threads(Index count, Index chunk, bool threaded) {
#ifdef _OPENMP
  const Index chunks = count > 0 ? (count + chunk - 1) / chunk : 0;
  const Index threads = std::min<Index>(omp_get_max_threads(), chunks);
  if (threaded && threads > 1 && !omp_in_parallel()) return threads;
#else
  (void)count;
  (void)chunk;
  (void)threaded;
#endif
  return 1;
}

// Calls body(begin, end, slot) once for every chunk [k * chunk, min((k + 1) * chunk, count)),
// k = 0, 1, ...: the chunk boundaries depend on count and chunk only, never on the number of
// threads, so when body's arithmetic for a chunk depends only on that chunk, the result is
// bit-identical for any thread count and with or without OpenMP. With chunk_threads(count, chunk,
// threaded) > 1 the chunks are handed out to that many OpenMP threads one at a time as they
// finish (dynamic schedule: a thread slowed by other work on the machine takes fewer chunks);
// otherwise they run in order on the calling thread. slot, in [0, chunk_threads(...)), is the
// running thread's index (0 on the calling thread), for per-thread scratch. Not threaded again
// when already inside a parallel region. body must not throw.
template <typename Body>
void parallel_chunks_slotted(Index count, Index chunk, bool threaded, const Body& body) {
  const Index chunks = count > 0 ? (count + chunk - 1) / chunk : 0;
#ifdef _OPENMP
  const int threads = static_cast<int>(chunk_threads(count, chunk, threaded));
  if (threads > 1) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (Index k = 0; k < chunks; ++k)
      body(k * chunk, std::min(count, (k + 1) * chunk), static_cast<Index>(omp_get_thread_num()));
    return;
  }
#else
  (void)threaded;
#endif
  for (Index k = 0; k < chunks; ++k) body(k * chunk, std::min(count, (k + 1) * chunk), Index{0});
}

// parallel_chunks_slotted with body(begin, end).
template <typename Body>
void parallel_chunks(Index count, Index chunk, bool threaded, const Body& body) {
  parallel_chunks_slotted(count, chunk, threaded, [&](Index begin, Index end, Index) { body(begin, end); });
}

// Calls body(i) for i in [0, count), handed out to the OpenMP threads one at a time as they
// finish (a thread slowed by other work on the machine takes fewer). Which thread runs body(i)
// does not change what body(i) computes. With more than one thread the region is entered even
// for one piece.
template <typename Body>
void parallel_blocks(Index count, const Body& body) {
#ifdef _OPENMP
  if (omp_get_max_threads() > 1 && !omp_in_parallel()) {
#pragma omp parallel for schedule(dynamic, 1)
    for (Index i = 0; i < count; ++i) body(i);
    return;
  }
#endif
  for (Index i = 0; i < count; ++i) body(i);
}

}  // namespace detail
}  // namespace embedhead

#endif  // EMBEDHEAD_DETAIL_PARALLEL_HPP
