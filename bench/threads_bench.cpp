// Lookup and sparse backward on 1 and 2 OpenMP threads (built with OpenMP when CMake finds it).
//
//   Lookup/threads:T          TokenEmbedding::forward, GPT-2 shape, N = 8192 random ids
//   SparseBackward/threads:T  zero_grad + TokenEmbedding::backward, same shape
//
// Before timing, the 2-thread results are checked bit-identical to the 1-thread ones.
#include "bench_support.hpp"  // first: its pragma must precede every other include

#include "gbench_main.hpp"

#include <embedhead/embedhead.hpp>

#include <benchmark/benchmark.h>
#include <omp.h>

#include <cstring>

namespace {

using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::RowMatrix;
using embedhead::TokenEmbedding;

constexpr const char* kProgram = "threads_bench";
constexpr Index kV = 50257, kD = 768, kN = 8192;

struct Problem {
  TokenEmbedding<float> embedding{kV, kD};
  IdMatrix<std::int32_t> ids = bench_support::random_ids(kN, kV, 1);
  RowMatrix<float> dout = RowMatrix<float>(kN, kD);
  RowMatrix<float> out = RowMatrix<float>(kN, kD);
  Problem() { bench_support::fill_uniform(dout, 2); }
};

Problem& problem() {
  static Problem p;
  return p;
}

// Runs the lookup and backward with `threads` threads and returns (output, dense gradient).
std::pair<RowMatrix<float>, RowMatrix<float>> run_once(int threads) {
  Problem& p = problem();
  omp_set_num_threads(threads);
  p.embedding.forward(p.ids, p.out);
  p.embedding.zero_grad();
  p.embedding.backward(p.ids, p.dout);
  return {p.out, p.embedding.weight().grad().to_dense()};
}

void check_thread_counts_agree() {
  const auto one = run_once(1), two = run_once(2);
  const auto same = [](const RowMatrix<float>& a, const RowMatrix<float>& b) {
    return std::memcmp(a.data(), b.data(), sizeof(float) * static_cast<std::size_t>(a.size())) == 0;
  };
  if (!same(one.first, two.first)) bench_support::fail(kProgram, "lookup differs between 1 and 2 threads");
  if (!same(one.second, two.second)) bench_support::fail(kProgram, "backward differs between 1 and 2 threads");
}

void BM_Lookup(benchmark::State& state) {
  Problem& p = problem();
  omp_set_num_threads(static_cast<int>(state.range(0)));
  for (auto _ : state) {
    p.embedding.forward(p.ids, p.out);
    benchmark::DoNotOptimize(p.out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * kN * kD * static_cast<std::int64_t>(sizeof(float)));
}

void BM_SparseBackward(benchmark::State& state) {
  Problem& p = problem();
  omp_set_num_threads(static_cast<int>(state.range(0)));
  for (auto _ : state) {
    p.embedding.zero_grad();
    p.embedding.backward(p.ids, p.dout);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * kN * kD * static_cast<std::int64_t>(sizeof(float)));
}

void register_benchmarks() {
  check_thread_counts_agree();
  for (const int threads : {1, 2}) {
    benchmark::RegisterBenchmark("Lookup", BM_Lookup)->Arg(threads)->ArgName("threads")->UseRealTime()->Unit(
        benchmark::kMillisecond);
    benchmark::RegisterBenchmark("SparseBackward", BM_SparseBackward)
        ->Arg(threads)
        ->ArgName("threads")
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
}

}  // namespace

int main(int argc, char** argv) { return bench_support::run_benchmarks(argc, argv, register_benchmarks); }
