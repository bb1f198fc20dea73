// The main() of the google-benchmark suites that run under mpirun (vocab_parallel_bench,
// data_parallel_bench):
//
//   int main(int argc, char** argv) { return bench_support::run_mpi_benchmarks(argc, argv, register_benchmarks); }
//
// Every rank runs every benchmark and the collectives inside must line up, so each benchmark must
// fix its iteration count (->Iterations(n)): google benchmark's own choice of iterations comes from
// each rank's timing and would differ between ranks. Only rank 0 prints (and writes
// --benchmark_out); the others run with reporters that discard everything. Each benchmark should
// use ->UseRealTime(): the wall time of a step that waits on the other ranks is what counts.
#ifndef EMBEDHEAD_BENCH_MPI_GBENCH_MAIN_HPP
#define EMBEDHEAD_BENCH_MPI_GBENCH_MAIN_HPP

#include "bench_support.hpp"  // first: its pragma must precede every other include

#include <benchmark/benchmark.h>

#include <embedhead/parallel/mpi_communicator.hpp>

#include <Eigen/Core>

#include <string>
#include <vector>

namespace bench_support {

// Discards the reports of the ranks other than 0.
class SilentReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

// The world communicator of the benchmarks (valid inside run_mpi_benchmarks).
inline embedhead::Communicator& world() {
  static embedhead::MpiCommunicator communicator;
  return communicator;
}

inline int run_mpi_benchmarks(int argc, char** argv, void (*register_benchmarks)()) {
  embedhead::MpiEnvironment mpi(argc, argv);
  embedhead::Communicator& comm = world();
  register_benchmarks();
  // Ranks other than 0 drop --benchmark_out*: they must not open (and truncate) rank 0's file.
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i)
    if (comm.rank() == 0 || i == 0 || std::string(argv[i]).rfind("--benchmark_out", 0) != 0) args.push_back(argv[i]);
  int args_count = static_cast<int>(args.size());
  args.push_back(nullptr);
  benchmark::Initialize(&args_count, args.data());
  if (benchmark::ReportUnrecognizedArguments(args_count, args.data())) return 1;
  benchmark::AddCustomContext("mpi ranks", std::to_string(comm.size()));
  benchmark::AddCustomContext("eigen", std::to_string(EIGEN_WORLD_VERSION) + "." + std::to_string(EIGEN_MAJOR_VERSION) +
                                           "." + std::to_string(EIGEN_MINOR_VERSION) + ", " +
                                           Eigen::SimdInstructionSetsInUse());
  if (comm.rank() == 0) {
    benchmark::RunSpecifiedBenchmarks();
  } else {
    SilentReporter display;
    benchmark::RunSpecifiedBenchmarks(&display);
  }
  benchmark::Shutdown();
  return 0;
}

}  // namespace bench_support

#endif  // EMBEDHEAD_BENCH_MPI_GBENCH_MAIN_HPP
