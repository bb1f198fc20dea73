// Data-parallel gradient exchange: the sparse path (all-gather of ids and rows) against the dense
// one (densify + all-reduce of V*d), at Gemma's vocabulary (V = 256000, d = 2048, float: a dense
// gradient is 2 GiB), for touched fractions 0.1 %, 1 %, 10 %, 50 %, 75 % and 100 % of the rows on every
// rank (each rank its own random rows, so they overlap as random sets do); beside a memcpy of the
// sparse payload's bytes.
//
//   mpirun -np 1 build/bench-dp/bench/data_parallel_bench
//   mpirun -np 2 --allow-run-as-root --oversubscribe build/bench-dp/bench/data_parallel_bench
//
// Every rank runs every benchmark for the same fixed number of iterations (a collective inside a
// timed loop must be entered the same number of times everywhere); only rank 0 reports. Each
// iteration's time is the slowest rank's (barrier, exchange, all-reduce max of the elapsed time),
// set as manual time. Between iterations, untimed, every rank refills its gradient with its k rows
// (sparse), as a backward pass would. One untimed warm-up exchange first allocates the dense
// buffer and the sparse path's GradientExchangeWorkspace (both reused, as in a training loop's
// steady state), and checks the sums (rows hold rank + 1, so the
// expected sum is exact).
//
// Counters (rank 0's view): k = rows per rank, ratio = the byte model's sum_r k_r (d*4 + 8) /
// (V d 4) (automatic picks dense above GradientExchangeOptions::dense_threshold), sent_MiB = this
// rank's payload, union = touched rows after the exchange; bytes_per_second = sent bytes / time.

// bench_support.hpp comes first: its pragma must precede every other include.
#include "bench_support.hpp"

#include <embedhead/parallel/data_parallel.hpp>
#include "mpi_gbench_main.hpp"

#include <embedhead/parallel/mpi_communicator.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace {

using embedhead::GradientExchange;
using embedhead::GradientExchangeOptions;
using embedhead::GradientExchangeResult;
using embedhead::Index;
using embedhead::Parameter;

constexpr char kProgram[] = "data_parallel_bench";
constexpr Index kV = 256000, kD = 2048;
constexpr int kIterations = 3;

// Rank r's k touched rows: a random sample without replacement, sorted (seeded by r).
std::vector<Index> sample_rows(int r, Index k) {
  std::vector<Index> all(static_cast<std::size_t>(kV));
  std::iota(all.begin(), all.end(), Index{0});
  std::mt19937_64 gen(1234 + static_cast<std::uint64_t>(r));
  for (Index i = 0; i < k; ++i) {
    std::uniform_int_distribution<Index> pick(i, kV - 1);
    std::swap(all[static_cast<std::size_t>(i)], all[static_cast<std::size_t>(pick(gen))]);
  }
  all.resize(static_cast<std::size_t>(k));
  std::sort(all.begin(), all.end());
  return all;
}

Index rows_for(std::int64_t permille) { return std::max<Index>(1, kV * permille / 1000); }

// zero_grad + a backward's worth of rows: rank r's k rows, each holding r + 1.
void refill(Parameter<float>& p, const std::vector<Index>& ids, std::vector<Index>& slots, int rank) {
  p.zero_grad();
  p.grad().touch_rows(ids.data(), static_cast<Index>(ids.size()), slots.data());
  for (std::size_t j = 0; j < ids.size(); ++j) p.grad().slot_row(slots[j]).setConstant(static_cast<float>(rank + 1));
}

// After an exchange: every row v must hold the sum of (r + 1) over the ranks touching v.
void check_sums(const Parameter<float>& p, Index k) {
  const int R = bench_support::world().size();
  std::vector<float> expected(static_cast<std::size_t>(kV), 0.0f);
  for (int r = 0; r < R; ++r)
    for (Index v : sample_rows(r, k)) expected[static_cast<std::size_t>(v)] += static_cast<float>(r + 1);
  const auto& g = p.grad();
  for (Index i = 0; i < g.num_touched(); ++i) {
    const Index v = g.touched_rows()[static_cast<std::size_t>(i)];
    const auto row = g.touched_row(i);
    if (row(0) != expected[static_cast<std::size_t>(v)] || row(kD - 1) != expected[static_cast<std::size_t>(v)])
      bench_support::fail(kProgram, "row " + std::to_string(v) + " holds " + std::to_string(row(0)) + ", expected " +
                                        std::to_string(expected[static_cast<std::size_t>(v)]));
  }
  for (Index v = 0; v < kV; ++v)
    if (expected[static_cast<std::size_t>(v)] != 0.0f &&
        !std::binary_search(g.touched_rows().begin(), g.touched_rows().end(), v))
      bench_support::fail(kProgram, "row " + std::to_string(v) + " missing from the union");
}

// The slowest rank's seconds since `start` (a collective).
double slowest(std::chrono::steady_clock::time_point start) {
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  bench_support::world().all_reduce_max(&seconds, 1);
  return seconds;
}

void barrier() {
  std::int64_t token = 0;
  bench_support::world().all_reduce_sum(&token, 1);
}

void BM_exchange(benchmark::State& state, GradientExchange mode) {
  const int me = bench_support::world().rank(), R = bench_support::world().size();
  const Index k = rows_for(state.range(0));
  const std::vector<Index> ids = sample_rows(me, k);
  std::vector<Index> slots(ids.size());
  auto p = std::make_unique<Parameter<float>>(kV, kD);
  GradientExchangeOptions options;
  options.mode = mode;
  refill(*p, ids, slots, me);
  embedhead::GradientExchangeWorkspace<float> work;  // kept across steps, as a training loop would
  GradientExchangeResult result = embedhead::all_reduce_gradient(*p, bench_support::world(), options,
                                                                 &work);  // warm-up
  check_sums(*p, k);
  for (auto _ : state) {
    refill(*p, ids, slots, me);
    barrier();
    const auto start = std::chrono::steady_clock::now();
    result = embedhead::all_reduce_gradient(*p, bench_support::world(), options, &work);
    benchmark::ClobberMemory();
    state.SetIterationTime(slowest(start));
  }
  state.counters["k"] = static_cast<double>(k);
  state.counters["ratio"] = static_cast<double>(R) * static_cast<double>(k) * (kD * 4.0 + 8.0) / (kV * kD * 4.0);
  state.counters["sent_MiB"] = static_cast<double>(result.bytes_sent) / (1 << 20);
  state.counters["union"] = static_cast<double>(result.union_rows);
  state.counters["ranks"] = R;
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * result.bytes_sent);
}

// A memcpy of the sparse payload's bytes, k (d*4 + 8), on every rank at once.
void BM_memcpy(benchmark::State& state) {
  const Index k = rows_for(state.range(0));
  const std::size_t bytes = static_cast<std::size_t>(k) * (kD * 4 + 8);
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  for (auto _ : state) {
    barrier();
    const auto start = std::chrono::steady_clock::now();
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
    state.SetIterationTime(slowest(start));
  }
  state.counters["k"] = static_cast<double>(k);
  state.counters["sent_MiB"] = static_cast<double>(bytes) / (1 << 20);
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes));
}

void register_benchmarks() {
  for (std::int64_t permille : {1, 10, 100, 500, 750, 1000}) {
    benchmark::RegisterBenchmark("exchange/sparse", BM_exchange, GradientExchange::sparse)
        ->Arg(permille)
        ->Iterations(kIterations)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("exchange/dense", BM_exchange, GradientExchange::dense)
        ->Arg(permille)
        ->Iterations(kIterations)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("memcpy_payload", BM_memcpy)
        ->Arg(permille)
        ->Iterations(kIterations)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
}

}  // namespace

int main(int argc, char** argv) { return bench_support::run_mpi_benchmarks(argc, argv, register_benchmarks); }
