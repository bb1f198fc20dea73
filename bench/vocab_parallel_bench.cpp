// The vocabulary-parallel LM head and loss, and the vocabulary-parallel lookup, under mpirun: run
// it with -np 1 and -np 2 and compare (see bench/RESULTS.md for the commands).
//
//   FusedStep/V/d/N      VocabParallelFusedHeadLoss::forward_backward: the shard's logits by blocks,
//                        two small all-reduces of row statistics, dh all-reduced (N d floats)
//   UnfusedStep/V/d/N    VocabParallelOutputProjection::forward into the local [N, V/R] logits,
//                        vocab_parallel_cross_entropy_forward_backward in place, then backward
//   LookupForward/V/d/N  VocabParallelEmbedding::forward: gather the owned rows, all-reduce N d
//
// Counters (per rank): GFLOP/s over this rank's GEMM flops (fused 8 N (V/R) d, unfused 6 N (V/R) d);
// shard_MiB, the W shard; logits_MiB, what the loss holds beyond inputs and gradients (unfused: the
// local [N, V/R] logits; fused: one [N, vocab_block] block); full_logits_MiB, the [N, V] logits a
// single process would hold unfused, for comparison; allreduce_MiB, the bytes each step all-reduces
// (fused: N row maxima and 2N sums in double, and dh's N d floats; unfused: the maxima in float).
// Every rank runs the same fixed number of iterations (bench/mpi_gbench_main.hpp). Before timing,
// the fused loss is checked against the unfused one on every rank.
#include "bench_support.hpp"  // first: its pragma must precede every other include

#include "mpi_gbench_main.hpp"

#include <embedhead/embedhead.hpp>

#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>

namespace {

using embedhead::Index;
using embedhead::RowMatrix;

constexpr const char* kProgram = "vocab_parallel_bench";
constexpr double kMiB = 1024.0 * 1024.0;

struct HeadProblem {
  Index V, d, N;
  embedhead::VocabParallelOutputProjection<float> head;
  RowMatrix<float> h;
  embedhead::IdMatrix<std::int32_t> targets;
  RowMatrix<float> local_logits, dh;
  HeadProblem(Index V_, Index d_, Index N_)
      : V(V_),
        d(d_),
        N(N_),
        head(V_, d_, bench_support::world(), embedhead::OutputProjectionOptions{false, 0.02, 2}),
        h(N_, d_),
        targets(bench_support::random_ids(N_, V_, 5)),
        dh(N_, d_) {
    bench_support::fill_uniform(h, 3, 1.0);
  }
};

void set_memory_counters(benchmark::State& state, const HeadProblem& p, double logits_bytes, double allreduce_bytes) {
  const Index rows = p.head.shard().rows();
  state.counters["ranks"] = bench_support::world().size();
  state.counters["shard_MiB"] = static_cast<double>(rows * p.d) * sizeof(float) / kMiB;
  state.counters["logits_MiB"] = logits_bytes / kMiB;
  state.counters["full_logits_MiB"] = static_cast<double>(p.N * p.V) * sizeof(float) / kMiB;
  state.counters["allreduce_MiB"] = allreduce_bytes / kMiB;
}

double unfused_step(HeadProblem& p) {
  p.head.forward(p.h, p.local_logits);
  const double loss = embedhead::vocab_parallel_cross_entropy_forward_backward<float>(bench_support::world(), p.V,
                                                                                      p.local_logits, p.targets,
                                                                                      p.local_logits)
                          .loss;
  p.head.backward(p.h, p.local_logits, p.dh);
  return loss;
}

void BM_FusedStep(benchmark::State& state) {
  HeadProblem p(state.range(0), state.range(1), state.range(2));
  embedhead::VocabParallelFusedHeadLoss<float> loss;
  // Check once against the unfused path before timing.
  p.local_logits.resize(p.N, p.head.shard().rows());
  const double reference = unfused_step(p);
  p.head.zero_grad();
  const double fused = loss.forward_backward(p.head, p.h, p.targets, p.dh).loss;
  if (!(std::abs(fused - reference) <= 1e-5 * std::abs(reference)))
    bench_support::fail(kProgram, "fused loss " + bench_support::number(fused) + " vs unfused " +
                                      bench_support::number(reference));
  p.local_logits.resize(0, 0);  // the fused step does not need it
  for (auto _ : state) {
    p.head.zero_grad();
    benchmark::DoNotOptimize(loss.forward_backward(p.head, p.h, p.targets, p.dh).loss);
  }
  const Index rows = p.head.shard().rows();
  const Index block = embedhead::detail::fused_vocab_block(0, rows);  // as the loss picks it on a shard
  set_memory_counters(state, p, static_cast<double>(p.N * block) * sizeof(float),
                      static_cast<double>(p.N * p.d) * sizeof(float) + 3.0 * static_cast<double>(p.N) * sizeof(double));
  state.counters["GFLOP/s"] = benchmark::Counter(8.0 * p.N * rows * p.d * 1e-9 * state.iterations(),
                                                 benchmark::Counter::kIsRate);
}

void BM_UnfusedStep(benchmark::State& state) {
  HeadProblem p(state.range(0), state.range(1), state.range(2));
  const Index rows = p.head.shard().rows();
  p.local_logits.resize(p.N, rows);
  for (auto _ : state) {
    p.head.zero_grad();
    benchmark::DoNotOptimize(unfused_step(p));
  }
  set_memory_counters(state, p, static_cast<double>(p.N * rows) * sizeof(float),
                      static_cast<double>(p.N * p.d) * sizeof(float) +
                          static_cast<double>(p.N) * (sizeof(float) + 2 * sizeof(double)));
  state.counters["GFLOP/s"] = benchmark::Counter(6.0 * p.N * rows * p.d * 1e-9 * state.iterations(),
                                                 benchmark::Counter::kIsRate);
}

void BM_LookupForward(benchmark::State& state) {
  const Index V = state.range(0), d = state.range(1), N = state.range(2);
  embedhead::VocabParallelEmbedding<float> embedding(V, d, bench_support::world());
  const auto ids = bench_support::random_ids(N, V, 7);
  RowMatrix<float> out(N, d);
  for (auto _ : state) {
    embedding.forward(ids, out);
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["ranks"] = bench_support::world().size();
  state.counters["shard_MiB"] = static_cast<double>(embedding.shard().rows() * d) * sizeof(float) / kMiB;
  state.counters["allreduce_MiB"] = static_cast<double>(N * d) * sizeof(float) / kMiB;
  state.SetBytesProcessed(static_cast<std::int64_t>(N * d) * static_cast<std::int64_t>(sizeof(float)) *
                          state.iterations());
}

void register_benchmarks() {
  // GPT-2 124M's head (V = 50257, d = 768) on 512 tokens; Gemma's (V = 256000, d = 2048) on 128.
  benchmark::RegisterBenchmark("FusedStep", BM_FusedStep)
      ->Args({50257, 768, 512})
      ->Iterations(3)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("UnfusedStep", BM_UnfusedStep)
      ->Args({50257, 768, 512})
      ->Iterations(3)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("FusedStep", BM_FusedStep)
      ->Args({256000, 2048, 128})
      ->Iterations(1)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("UnfusedStep", BM_UnfusedStep)
      ->Args({256000, 2048, 128})
      ->Iterations(1)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("LookupForward", BM_LookupForward)
      ->Args({256000, 2048, 1024})
      ->Iterations(20)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("LookupForward", BM_LookupForward)
      ->Args({50257, 768, 8192})
      ->Iterations(20)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
}

}  // namespace

int main(int argc, char** argv) { return bench_support::run_mpi_benchmarks(argc, argv, register_benchmarks); }
