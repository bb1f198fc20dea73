// The LM-head training step, fused and unfused, at GPT-2 shape (N = 1024 tokens, d = 768,
// V = 50257), on 1 and 2 OpenMP threads (when built with OpenMP).
//
//   UnfusedStep/threads:T          OutputProjection::forward into [N, V] logits, then
//                                  cross_entropy_forward_backward in place, then backward
//   FusedStep/block:B/threads:T    FusedHeadLoss::forward_backward with vocab_block B (0: auto)
//   FusedEval/threads:T            FusedHeadLoss::forward (the loss only, no gradient)
//
// Counters: GFLOP/s over the GEMM flops each form does (unfused 6 N V d, fused 8 N V d as it
// recomputes the logits, FusedEval 2 N V d), and extra_MB,
// the memory each form needs beyond inputs and gradients: the [N, V] logits for the unfused
// step, the [N, vocab_block] block of logits for the fused one (no token is ignored here, so h
// and dh are used in place), with extra_pct its share of the logits' size. Before timing, the fused loss and gradients
// are checked against the unfused ones.
#include "bench_support.hpp"  // first: its pragma must precede every other include

#include "gbench_main.hpp"

#include <embedhead/embedhead.hpp>

#include <benchmark/benchmark.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <cmath>
#include <string>

namespace {

using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::RowMatrix;

constexpr const char* kProgram = "fused_head_loss_bench";
constexpr Index kV = 50257, kD = 768, kN = 1024;

struct Problem {
  embedhead::OutputProjection<float> head{kV, kD, embedhead::OutputProjectionOptions{false, 0.02, 2}};
  RowMatrix<float> h = RowMatrix<float>(kN, kD);
  IdMatrix<std::int32_t> targets = bench_support::random_ids(kN, kV, 5);
  RowMatrix<float> logits = RowMatrix<float>(kN, kV);
  RowMatrix<float> dh = RowMatrix<float>(kN, kD);
  Problem() { bench_support::fill_uniform(h, 3, 1.0); }
};

Problem& problem() {
  static Problem p;
  return p;
}

using bench_support::set_threads;

double unfused_step(Problem& p) {
  p.head.forward(p.h, p.logits);
  const double loss = embedhead::cross_entropy_forward_backward<float>(p.logits, p.targets, p.logits).loss;
  p.head.backward(p.h, p.logits, p.dh);
  return loss;
}

void check_fused_against_unfused() {
  Problem& p = problem();
  p.head.zero_grad();
  const double expected = unfused_step(p);
  const RowMatrix<float> dh_expected = p.dh, dW_expected = p.head.weight().grad().to_dense();
  p.head.zero_grad();
  embedhead::FusedHeadLoss<float> fused;
  const double actual = fused.forward_backward(p.head, p.h, p.targets, p.dh).loss;
  const auto relative = [](const RowMatrix<float>& a, const RowMatrix<float>& b) {
    return static_cast<double>((a - b).cwiseAbs().maxCoeff() / std::max(b.cwiseAbs().maxCoeff(), 1e-30f));
  };
  if (std::abs(actual - expected) > 1e-5 * std::abs(expected))
    bench_support::fail(kProgram, "fused loss " + bench_support::number(actual) + " vs unfused " +
                                      bench_support::number(expected));
  if (relative(p.dh, dh_expected) > 1e-4) bench_support::fail(kProgram, "fused dh differs from the unfused one");
  if (relative(p.head.weight().grad().to_dense(), dW_expected) > 1e-4)
    bench_support::fail(kProgram, "fused dW differs from the unfused one");
  p.head.zero_grad();
}

void add_counters(benchmark::State& state, double flops_per_step, double extra_bytes) {
  const double logits_bytes = static_cast<double>(kN) * kV * sizeof(float);
  state.counters["GFLOP/s"] = benchmark::Counter(flops_per_step * static_cast<double>(state.iterations()) * 1e-9,
                                                 benchmark::Counter::kIsRate);
  state.counters["extra_MB"] = extra_bytes / 1e6;
  state.counters["extra_pct"] = 100.0 * extra_bytes / logits_bytes;
}

void BM_UnfusedStep(benchmark::State& state) {
  set_threads(state, static_cast<int>(state.range(0)));
  Problem& p = problem();
  for (auto _ : state) {
    p.head.zero_grad();
    benchmark::DoNotOptimize(unfused_step(p));
  }
  add_counters(state, 6.0 * kN * kV * kD, static_cast<double>(kN) * kV * sizeof(float));
}

void BM_FusedStep(benchmark::State& state) {
  embedhead::FusedHeadLossOptions options;
  options.vocab_block = state.range(0);
  set_threads(state, static_cast<int>(state.range(1)));
  Problem& p = problem();
  embedhead::FusedHeadLoss<float> fused(options);
  for (auto _ : state) {
    p.head.zero_grad();
    benchmark::DoNotOptimize(fused.forward_backward(p.head, p.h, p.targets, p.dh).loss);
  }
  const Index block = embedhead::detail::fused_vocab_block(options.vocab_block, kV);
  state.counters["block"] = static_cast<double>(block);
  add_counters(state, 8.0 * kN * kV * kD, static_cast<double>(kN) * block * sizeof(float));
}

void BM_FusedEval(benchmark::State& state) {
  set_threads(state, static_cast<int>(state.range(0)));
  Problem& p = problem();
  embedhead::FusedHeadLoss<float> fused;
  for (auto _ : state) benchmark::DoNotOptimize(fused.forward(p.head, p.h, p.targets).loss);
  const Index block = embedhead::detail::fused_vocab_block(0, kV);
  add_counters(state, 2.0 * kN * kV * kD, static_cast<double>(kN) * block * sizeof(float));
}

void register_benchmarks() {
  check_fused_against_unfused();
  const std::vector<std::int64_t> threads = bench_support::thread_counts();
  for (const std::int64_t t : threads) {
    benchmark::RegisterBenchmark("UnfusedStep", BM_UnfusedStep)
        ->Arg(t)
        ->ArgName("threads")
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    for (const std::int64_t block : {0, 256, 512, 2048, 4096})
      benchmark::RegisterBenchmark("FusedStep", BM_FusedStep)
          ->Args({block, t})
          ->ArgNames({"block", "threads"})
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    benchmark::RegisterBenchmark("FusedEval", BM_FusedEval)
        ->Arg(t)
        ->ArgName("threads")
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  }
}

}  // namespace

int main(int argc, char** argv) { return bench_support::run_benchmarks(argc, argv, register_benchmarks); }
