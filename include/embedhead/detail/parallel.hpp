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

}  // namespace detail
}  // namespace embedhead

#endif  // EMBEDHEAD_DETAIL_PARALLEL_HPP
