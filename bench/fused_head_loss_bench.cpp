// The LM-head training step, fused and unfused, at GPT-2 shape (N = 1024 tokens, d = 768,
// V = 50257), on 1 and 2 OpenMP threads (when built with OpenMP).
//
//   UnfusedStep/threads:T          OutputProjection::forward into [N, V] logits, then
//                                  cross_entropy_forward_backward in place, then backward
//   FusedStep/plan:P/size:S/threads:T
//                                  FusedHeadLoss::forward_backward: P = 0 vocab_blocks with
//                                  vocab_block S (0: auto), P = 1 token_chunks of S tokens,
//                                  P = 2 automatic (the default options)
//   FusedEval/threads:T            FusedHeadLoss::forward (the loss only, no gradient)
//   Score/what:W/threads:T         score_head (head_scores.hpp) on the same h, W, b and targets:
//                                  W = 0 the given tokens' log-probs, 1 also entropy and top-5,
//                                  2 all of that at temperature 0.7 (raw and processed), 3 the
//                                  same with the processed log-probs only (raw_logprob off) --
//                                  issue 17's target: at most 1.1x FusedEval's time
//   FusedSweep/N/V/d/threads:T     the default fused step from 1k to 16k tokens and 32k to 262k
//                                  rows, and Gemma's V = 256,000, d = 2048 (BM_FusedSweep); select
//                                  with --benchmark_filter=FusedSweep, skip with -FusedSweep
//   BreakEven/N/V/d/form:F         the default fused step (F = 1) against the unfused one (F = 0:
//                                  output_projection_forward, cross_entropy_forward_backward in
//                                  place, output_projection_backward) at small and awkward shapes
//                                  (N < d, V ~ d, few tokens): where the fused loss would not pay
//                                  (PyTorch: chunking pays when N >= d and V > d), its automatic
//                                  plan must cost no more than the unfused step
//
// Counters: GFLOP/s over the GEMM flops each form does (unfused and token chunks 6 N V d,
// vocab_blocks 8 N V d as it recomputes the logits, FusedEval 2 N V d), and extra_MB, the memory
// each form needs beyond inputs and gradients: the [N, V] logits for the unfused step, the
// [N, vocab_block] block or the [tokens, V] chunk of logits for the fused one (no token is ignored
// here, so h and dh are used in place), with extra_pct its share of the logits' size. Before timing, the fused loss and
// gradients are checked against the unfused ones.
#include "bench_support.hpp"  // first: its pragma must precede every other include

#include "gbench_main.hpp"

#include <embedhead/embedhead.hpp>

#include <benchmark/benchmark.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <array>
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

// plan 0: vocab_blocks with vocab_block = size (0: automatic); plan 1: token_chunks of size tokens
// (memory_budget = size rows of logits); plan 2: automatic (the default options).
void BM_FusedStep(benchmark::State& state) {
  embedhead::FusedHeadLossOptions options;
  const std::int64_t plan = state.range(0), size = state.range(1);
  if (plan == 0) {
    options.plan = embedhead::FusedPlan::vocab_blocks;
    options.vocab_block = size;
  } else if (plan == 1) {
    options.plan = embedhead::FusedPlan::token_chunks;
    options.memory_budget = size * kV * static_cast<Index>(sizeof(float));
  }
  set_threads(state, static_cast<int>(state.range(2)));
  Problem& p = problem();
  embedhead::FusedHeadLoss<float> fused(options);
  // One untimed step first: the layer's workspace (the chunk of logits) is allocated there, not in
  // the timed loop (a step may be the only timed iteration).
  p.head.zero_grad();
  benchmark::DoNotOptimize(fused.forward_backward(p.head, p.h, p.targets, p.dh).loss);
  for (auto _ : state) {
    p.head.zero_grad();
    benchmark::DoNotOptimize(fused.forward_backward(p.head, p.h, p.targets, p.dh).loss);
  }
  const Index chunk = embedhead::detail::fused_token_chunk(options, kN, kV, sizeof(float));
  const Index block = embedhead::detail::fused_vocab_block(options.vocab_block, kV);
  state.counters["tokens"] = static_cast<double>(chunk);
  state.counters["block"] = chunk > 0 ? 0.0 : static_cast<double>(block);
  // GFLOP/s over what the plan computes: 6 N V d in token chunks, 8 N V d in two passes.
  add_counters(state, (chunk > 0 ? 6.0 : 8.0) * kN * kV * kD,
               static_cast<double>(chunk > 0 ? chunk * kV : kN * block) * sizeof(float));
}

void BM_FusedEval(benchmark::State& state) {
  set_threads(state, static_cast<int>(state.range(0)));
  Problem& p = problem();
  embedhead::FusedHeadLoss<float> fused;
  benchmark::DoNotOptimize(fused.forward(p.head, p.h, p.targets).loss);  // untimed: allocates the workspace
  for (auto _ : state) benchmark::DoNotOptimize(fused.forward(p.head, p.h, p.targets).loss);
  const Index chunk = embedhead::detail::fused_token_chunk(fused.options(), kN, kV, sizeof(float));
  const Index block = embedhead::detail::fused_vocab_block(0, kV);
  add_counters(state, 2.0 * kN * kV * kD, static_cast<double>(chunk > 0 ? chunk * kV : kN * block) * sizeof(float));
}

void BM_Score(benchmark::State& state) {
  set_threads(state, static_cast<int>(state.range(1)));
  Problem& p = problem();
  embedhead::HeadScoreOptions options;
  if (state.range(0) >= 1) options.entropy = true, options.top_k = 5;
  if (state.range(0) >= 2) options.temperature = 0.7;
  if (state.range(0) == 3) options.raw_logprob = false;
  const auto W = static_cast<const embedhead::Parameter<float>&>(p.head.weight()).value();
  const RowMatrix<float> no_bias(0, 1);  // the problem's head has none, as FusedEval's
  for (auto _ : state) benchmark::DoNotOptimize(embedhead::score_head<float>(p.h, W, no_bias, p.targets, options));
  const Index chunk = std::min<Index>(kN, embedhead::detail::kScoreTokenChunk);
  add_counters(state, 2.0 * kN * kV * kD,
               static_cast<double>(chunk * embedhead::detail::fused_vocab_block(0, kV)) * sizeof(float));
}

// How the fused step's cost grows: N tokens (1k..16k) and V (32k..262k) at d = 768, and the
// Gemma-sized head (V = 256,000, d = 2048), with the default options (automatic plan). Counters:
// ps_per_NVd, the time per N V d (flat when the time is linear in N V d), plan_tokens (the token
// chunk, 0 for vocabulary blocks) and extra_MiB, the workspace's bytes after the step (the logits
// chunk or block; flat in N for token chunks, since the chunk is fixed by the budget).
void BM_FusedSweep(benchmark::State& state) {
  const Index N = state.range(0), V = state.range(1), d = state.range(2);
  set_threads(state, static_cast<int>(state.range(3)));
  RowMatrix<float> h(N, d), W(V, d), dh(N, d), dW = RowMatrix<float>::Zero(V, d), no_bias(0, 1), no_db(0, 1);
  bench_support::fill_uniform(h, 11, 1.0);
  bench_support::fill_uniform(W, 12, 0.02);
  const IdMatrix<std::int32_t> targets = bench_support::random_ids(N, V, 13);
  embedhead::FusedHeadLossWorkspace<float> ws;
  // Each point is timed once (iterations:1): its first call would also allocate the workspace.
  benchmark::DoNotOptimize(
      embedhead::fused_head_loss_forward_backward<float>(h, W, no_bias, targets, dh, dW, no_db, ws).loss);
  for (auto _ : state)
    benchmark::DoNotOptimize(
        embedhead::fused_head_loss_forward_backward<float>(h, W, no_bias, targets, dh, dW, no_db, ws).loss);
  const embedhead::FusedHeadLossOptions options;
  state.counters["ps_per_NVd"] = benchmark::Counter(static_cast<double>(N) * V * d * 1e-12,
                                                    benchmark::Counter::kIsIterationInvariantRate |
                                                        benchmark::Counter::kInvert);
  state.counters["plan_tokens"] = static_cast<double>(
      embedhead::detail::fused_token_chunk(options, N, V, sizeof(float)));
  const double bytes = static_cast<double>(ws.logits.capacity() * sizeof(float) + ws.hidden.capacity() * sizeof(float) +
                                           ws.dhidden.capacity() * sizeof(float));
  state.counters["extra_MiB"] = bytes / (1 << 20);
}

// form 0: the unfused step on free functions; form 1: fused_head_loss_forward_backward with the
// default options (automatic plan). Counters: GFLOP/s over 6 N V d, plan_tokens (the fused
// step's token chunk; N: one chunk, the unfused computation itself; 0: vocabulary blocks).
void BM_BreakEven(benchmark::State& state) {
  const Index N = state.range(0), V = state.range(1), d = state.range(2);
  const bool fused = state.range(3) != 0;
  RowMatrix<float> h(N, d), W(V, d), dh(N, d), dW = RowMatrix<float>::Zero(V, d), no_bias(0, 1), no_db(0, 1);
  RowMatrix<float> logits(fused ? 0 : N, V);
  bench_support::fill_uniform(h, 21, 1.0);
  bench_support::fill_uniform(W, 22, 0.02);
  const IdMatrix<std::int32_t> targets = bench_support::random_ids(N, V, 23);
  embedhead::FusedHeadLossWorkspace<float> ws;
  auto step = [&] {
    if (fused)
      return embedhead::fused_head_loss_forward_backward<float>(h, W, no_bias, targets, dh, dW, no_db, ws).loss;
    embedhead::output_projection_forward<float>(h, W, no_bias, logits);
    const double loss = embedhead::cross_entropy_forward_backward<float>(logits, targets, logits).loss;
    embedhead::output_projection_backward<float>(h, W, logits, dh, dW, no_db);
    return loss;
  };
  benchmark::DoNotOptimize(step());  // untimed: allocates the workspace
  for (auto _ : state) benchmark::DoNotOptimize(step());
  state.counters["GFLOP/s"] = benchmark::Counter(6.0 * N * V * d * static_cast<double>(state.iterations()) * 1e-9,
                                                 benchmark::Counter::kIsRate);
  state.counters["plan_tokens"] = static_cast<double>(
      embedhead::detail::fused_token_chunk(embedhead::FusedHeadLossOptions{}, N, V, sizeof(float)));
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
    auto step = [&](std::int64_t plan, std::int64_t size) {
      benchmark::RegisterBenchmark("FusedStep", BM_FusedStep)
          ->Args({plan, size, t})
          ->ArgNames({"plan", "size", "threads"})
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    };
    step(2, 0);  // automatic
    for (const std::int64_t block : {0, 512, 2048}) step(0, block);
    for (const std::int64_t tokens : {32, 64, 128, 256, 512}) step(1, tokens);
    benchmark::RegisterBenchmark("FusedEval", BM_FusedEval)
        ->Arg(t)
        ->ArgName("threads")
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    for (const std::int64_t what : {0, 1, 2, 3})
      benchmark::RegisterBenchmark("Score", BM_Score)
          ->Args({what, t})
          ->ArgNames({"what", "threads"})
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
  }
  // The sweep on the most threads only: each point is one step of 0.4 to 5 TFLOP.
  const std::int64_t most = threads.back();
  auto sweep = [&](std::int64_t N, std::int64_t V, std::int64_t d) {
    benchmark::RegisterBenchmark("FusedSweep", BM_FusedSweep)
        ->Args({N, V, d, most})
        ->ArgNames({"N", "V", "d", "threads"})
        ->Unit(benchmark::kMillisecond)
        ->Iterations(1)
        ->UseRealTime();
  };
  for (const std::int64_t N : {1024, 4096, 16384}) sweep(N, kV, kD);
  for (const std::int64_t V : {32768, 131072, 262144}) sweep(4096, V, kD);
  // Below and around the break-even shape, on the most threads: fused (1) beside unfused (0).
  for (const auto& shape : std::vector<std::array<std::int64_t, 3>>{{16, 50257, 768},
                                                                    {64, 4096, 256},
                                                                    {64, 32768, 1024},
                                                                    {512, 4096, 1024},
                                                                    {512, 32768, 256},
                                                                    {2048, 8192, 2048},
                                                                    {2048, 32768, 1024}})
    for (const std::int64_t form : {0, 1})
      benchmark::RegisterBenchmark("BreakEven", BM_BreakEven)
          ->Args({shape[0], shape[1], shape[2], form})
          ->ArgNames({"N", "V", "d", "form"})
          ->Unit(benchmark::kMillisecond)
          ->MinTime(0.2)
          ->UseRealTime();
  sweep(1024, 256000, 2048);  // Gemma's head
}

}  // namespace

int main(int argc, char** argv) { return bench_support::run_benchmarks(argc, argv, register_benchmarks); }
