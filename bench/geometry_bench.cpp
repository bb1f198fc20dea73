// Embedding geometry (analysis/geometry.hpp), on 1 and 2 OpenMP threads when built with OpenMP:
//
//   EigenGemm/threads:T       the plain Eigen product S [Q, V] = queries [Q, d] E^T at the
//                             neighbour search's shape (Q = 1000, d = 768, V = 50257): the "GEMM
//                             peak" reference, with Eigen's own threading on T threads
//   Neighbours/threads:T      nearest_neighbours, top-10 by cosine for the same 1000 queries:
//                             GFLOP/s = 2 Q V d / time, and vs_gemm = that / EigenGemm's rate on
//                             the same thread count (measured just before, in this binary; both
//                             timed with steady_clock around the benchmark loop)
//   Summary/threads:T         summarize_table of a synthetic float table V = 256,000, d = 2048
//                             (2 GiB; 8 components, 20 iterations) in seconds, with extra_MiB =
//                             the peak resident memory during the call above the resident memory
//                             before it (VmHWM after resetting it through /proc/self/clear_refs;
//                             see peak_extra_bytes)
//
// Every benchmark checks its result before timing: neighbours against double-precision brute force
// for a few queries, the summary's statistics against direct computations in double.
#include "bench_support.hpp"  // first: its pragma must precede every other include

#include "gbench_main.hpp"

#include "../tests/reference/naive.hpp"

#include <embedhead/analysis/geometry.hpp>

#include <benchmark/benchmark.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace {

using embedhead::Index;
using embedhead::RowMatrix;
using bench_support::fail;
using bench_support::number;

constexpr const char* kProgram = "geometry_bench";
constexpr Index kV = 50257, kD = 768, kQ = 1000, kK = 10;
constexpr Index kBigV = 256000, kBigD = 2048;
constexpr double kFlops = 2.0 * kQ * kV * kD;

using bench_support::set_threads;

struct Problem {
  RowMatrix<float> E = RowMatrix<float>(kV, kD);
  RowMatrix<float> queries = RowMatrix<float>(kQ, kD);
  Problem() {
    bench_support::fill_uniform(E, 1);
    // A shared offset, as in trained tables (anisotropy), so that cosine differs from dot.
    E.rowwise() += RowMatrix<float>::Constant(1, kD, 0.2f).row(0);
    bench_support::fill_uniform(queries, 2);
  }
};
Problem& problem() {
  static Problem p;
  return p;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Seconds per EigenGemm iteration, by thread count, for the vs_gemm ratio.
std::map<int, double>& gemm_seconds() {
  static std::map<int, double> seconds;
  return seconds;
}

void check_neighbours() {
  Problem& p = problem();
  const std::vector<Index> probes = {0, 1, 499, 998, 999};
  RowMatrix<float> sample(static_cast<Index>(probes.size()), kD);
  for (std::size_t i = 0; i < probes.size(); ++i) sample.row(static_cast<Index>(i)) = p.queries.row(probes[i]);
  const embedhead::Neighbours got = embedhead::nearest_neighbours<float>(p.E, p.queries, kK);
  RowMatrix<Index> ids;
  RowMatrix<double> scores;
  naive::top_k(p.E, sample, kK, true, {}, ids, scores);
  for (std::size_t i = 0; i < probes.size(); ++i)
    for (Index r = 0; r < kK; ++r) {
      const Index q = probes[i], id = got.ids(q, r);
      const double expected = scores(static_cast<Index>(i), r);
      // float GEMM of 768 terms, cosine in [-1, 1]: 1e-5 is ~100 float ulps of the score.
      if (!(std::abs(got.scores(q, r) - expected) <= 1e-5))
        fail(kProgram, "query " + std::to_string(q) + " rank " + std::to_string(r) + ": score " +
                           number(got.scores(q, r)) + ", brute force " + number(expected));
      if (id != ids(static_cast<Index>(i), r) &&
          !(std::abs(naive::cosine(p.queries.row(q), p.E.row(id)) - expected) <= 1e-5))
        fail(kProgram, "query " + std::to_string(q) + " rank " + std::to_string(r) + ": id " + std::to_string(id) +
                           ", brute force " + std::to_string(ids(static_cast<Index>(i), r)));
    }
}

void BM_EigenGemm(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  set_threads(state, threads);
  Problem& p = problem();
  RowMatrix<float> S(kQ, kV);
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    S.noalias() = p.queries * p.E.transpose();
    benchmark::DoNotOptimize(S.data());
    benchmark::ClobberMemory();
  }
  gemm_seconds()[threads] = seconds_since(start) / static_cast<double>(state.iterations());
  state.counters["GFLOP/s"] = benchmark::Counter(kFlops * static_cast<double>(state.iterations()) * 1e-9,
                                                 benchmark::Counter::kIsRate);
}

void BM_Neighbours(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  set_threads(state, threads);
  Problem& p = problem();
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    embedhead::Neighbours n = embedhead::nearest_neighbours<float>(p.E, p.queries, kK);
    benchmark::DoNotOptimize(n.ids.data());
    benchmark::ClobberMemory();
  }
  const double seconds = seconds_since(start) / static_cast<double>(state.iterations());
  if (gemm_seconds().count(threads)) state.counters["vs_gemm"] = gemm_seconds()[threads] / seconds;
  state.counters["GFLOP/s"] = benchmark::Counter(kFlops * static_cast<double>(state.iterations()) * 1e-9,
                                                 benchmark::Counter::kIsRate);
}

// VmRSS / VmHWM of this process in bytes, from /proc/self/status (0 where unavailable).
std::int64_t status_bytes(const std::string& key) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.compare(0, key.size() + 1, key + ":") == 0) return std::stoll(line.substr(key.size() + 1)) * 1024;
  return 0;
}
// Resets VmHWM to the current RSS (Linux >= 4.0: "5" to /proc/self/clear_refs); false if refused.
bool reset_peak() {
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
  clear.flush();
  return static_cast<bool>(clear);
}

RowMatrix<float>& big_table() {
  static RowMatrix<float> E = [] {
    RowMatrix<float> m(kBigV, kBigD);
    bench_support::fill_uniform(m, 3);
    return m;
  }();
  return E;
}

void check_summary(const embedhead::TableSummary& s, const RowMatrix<float>& E) {
  // Norms of a few rows, the centroid's norm and the total variance, directly in double; the
  // first component's variance as its Rayleigh quotient (one more pass); orthonormal directions.
  for (const Index v : {Index{0}, kBigV / 2, kBigV - 1}) {
    const double n = E.row(v).cast<double>().norm();
    if (!(std::abs(s.norms[v] - n) <= 1e-12 * n)) fail(kProgram, "summary: norm of row " + std::to_string(v));
  }
  Eigen::VectorXd mean = Eigen::VectorXd::Zero(kBigD);
  for (Index v = 0; v < kBigV; ++v) mean += E.row(v).cast<double>().transpose();
  mean /= static_cast<double>(kBigV);
  if (!(std::abs(s.centroid_norm - mean.norm()) <= 1e-9 * std::max(1.0, mean.norm())))
    fail(kProgram, "summary: centroid norm " + number(s.centroid_norm) + " vs " + number(mean.norm()));
  double total = 0, along = 0;
  const Eigen::VectorXd w = s.pcs.directions.row(0).transpose();
  for (Index v = 0; v < kBigV; ++v) {
    const Eigen::VectorXd x = E.row(v).cast<double>().transpose() - mean;
    total += x.squaredNorm();
    along += x.dot(w) * x.dot(w);
  }
  total /= static_cast<double>(kBigV);
  along /= static_cast<double>(kBigV);
  if (!(std::abs(s.pcs.total_variance - total) <= 1e-9 * total))
    fail(kProgram, "summary: total variance " + number(s.pcs.total_variance) + " vs " + number(total));
  if (!(std::abs(s.pcs.variances[0] - along) <= 1e-5 * along))
    fail(kProgram, "summary: first variance " + number(s.pcs.variances[0]) + " vs Rayleigh quotient " + number(along));
  const Eigen::MatrixXd gram = s.pcs.directions * s.pcs.directions.transpose();
  if (!((gram - Eigen::MatrixXd::Identity(gram.rows(), gram.cols())).cwiseAbs().maxCoeff() <= 1e-10))
    fail(kProgram, "summary: directions not orthonormal");
  for (Index j = 1; j < s.pcs.variances.size(); ++j)
    if (s.pcs.variances[j] > s.pcs.variances[j - 1]) fail(kProgram, "summary: variances not descending");
}

void BM_Summary(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  set_threads(state, threads);
  const RowMatrix<float>& E = big_table();
  static bool checked = false;
  double peak_extra = 0;
  for (auto _ : state) {
    const bool reset = reset_peak();
    const std::int64_t before = status_bytes("VmRSS");
    const embedhead::TableSummary s = embedhead::summarize_table<float>(E);
    const std::int64_t peak = status_bytes("VmHWM");
    peak_extra = reset ? static_cast<double>(peak - before) : -1.0;
    if (!checked) {
      state.PauseTiming();
      check_summary(s, E);
      checked = true;
      state.ResumeTiming();
    }
    benchmark::DoNotOptimize(s.norms.data());
  }
  state.counters["extra_MiB"] = peak_extra / (1 << 20);
  state.counters["table_MiB"] = static_cast<double>(E.size()) * sizeof(float) / (1 << 20);
}

void register_benchmarks() {
  check_neighbours();
  const std::vector<std::int64_t> threads = bench_support::thread_counts();
  for (const std::int64_t t : threads) {
    benchmark::RegisterBenchmark("EigenGemm", BM_EigenGemm)
        ->Arg(t)
        ->ArgName("threads")
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark("Neighbours", BM_Neighbours)
        ->Arg(t)
        ->ArgName("threads")
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  }
  for (const std::int64_t t : threads)
    benchmark::RegisterBenchmark("Summary", BM_Summary)
        ->Arg(t)
        ->ArgName("threads")
        ->Unit(benchmark::kSecond)
        ->UseRealTime()
        ->Iterations(1);
}

}  // namespace

int main(int argc, char** argv) { return bench_support::run_benchmarks(argc, argv, register_benchmarks); }
