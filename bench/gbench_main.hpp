// The main() of the google-benchmark suites in bench/, as a function each suite calls:
//
//   int main(int argc, char** argv) { return bench_support::run_benchmarks(argc, argv, register_benchmarks); }
//
// Separate from bench_support.hpp so that tour.cpp, which does not link google benchmark, never
// includes <benchmark/benchmark.h>.
#ifndef EMBEDHEAD_BENCH_GBENCH_MAIN_HPP
#define EMBEDHEAD_BENCH_GBENCH_MAIN_HPP

#include "bench_support.hpp"  // first: its pragma must precede every other include

#include <benchmark/benchmark.h>

#include <Eigen/Core>
#include <embedhead/gemm_backend.hpp>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <cstdint>
#include <string>
#include <vector>

namespace bench_support {

// The thread counts a suite registers: 1 and 2 when built with OpenMP, else 1.
inline std::vector<std::int64_t> thread_counts() {
#ifdef _OPENMP
  return {1, 2};
#else
  return {1};
#endif
}

// Sets the OpenMP thread count for a benchmark; without OpenMP only 1 is possible.
inline void set_threads(benchmark::State& state, int threads) {
#ifdef _OPENMP
  (void)state;
  omp_set_num_threads(threads);
#else
  if (threads != 1) state.SkipWithError("built without OpenMP");
#endif
}

// Registers the suite's benchmarks, then runs those selected on the command line. Defaults to
// --benchmark_min_time=0.2 (0.2 s per benchmark, so each suite takes a few minutes); the default
// is put first, so a --benchmark_min_time on the command line, parsed later, overrides it. The
// report's context gains an "eigen" line: version, SIMD sets in use and thread count. Returns the
// process exit status: 1 for unrecognised arguments, else 0.
inline int run_benchmarks(int argc, char** argv, void (*register_benchmarks)()) {
  register_benchmarks();
  static char default_min_time[] = "--benchmark_min_time=0.2";
  std::vector<char*> args(argv, argv + argc);
  args.insert(args.begin() + (argc > 0 ? 1 : 0), default_min_time);
  int args_count = static_cast<int>(args.size());
  args.push_back(nullptr);
  benchmark::Initialize(&args_count, args.data());
  if (benchmark::ReportUnrecognizedArguments(args_count, args.data())) return 1;
  benchmark::AddCustomContext("eigen", std::to_string(EIGEN_WORLD_VERSION) + "." + std::to_string(EIGEN_MAJOR_VERSION) +
                                           "." + std::to_string(EIGEN_MINOR_VERSION) + ", " +
                                           Eigen::SimdInstructionSetsInUse() + ", " +
                                           std::to_string(Eigen::nbThreads()) + " thread(s)");
  const embedhead::GemmBackendInfo gemm = embedhead::gemm_backend();
  benchmark::AddCustomContext("gemm", gemm.name + ", kernels: " + gemm.kernels +
                                          (gemm.warning.empty() ? "" : ", WARNING: " + gemm.warning));
  benchmark::AddCustomContext("gemm_bf16", gemm.bf16);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace bench_support

#endif  // EMBEDHEAD_BENCH_GBENCH_MAIN_HPP
