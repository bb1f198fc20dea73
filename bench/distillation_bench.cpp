// Distillation against a teacher (distillation.hpp) beside the student-only fused head loss, at
// N = 512 tokens, d = d_T = 768, V = 32768, in float, on 1 and 2 OpenMP threads (when built with
// OpenMP). Issue 18's target: teacher-head forward KL (loss, dh, dW) in at most 2.2x the
// student-only fused step's time.
//
//   Student/plan:P/threads:T       fused_head_loss_forward_backward (class-index targets): P = 0
//                                  vocab_blocks (8 N V d flops), P = 1 automatic (here token
//                                  chunks of all 512 tokens, 6 N V d)
//   Distill/what:W/threads:T/plan:P
//                                  W = 0 teacher head, forward KL; 1 teacher head, reverse KL; 2 cached dense
//                                  log-probs, forward KL (reading [N, V]); 3 teacher head, forward KL with the
//                                  teacher's gradients; all at T = 2. P = 0 automatic (here token chunks of 256
//                                  tokens: 8 N V d flops for W = 0 and 1, 6 N V d for 2, 12 N V d for 3), P = 1
//                                  vocab_blocks (704 rows: 12, 8 and 16 N V d)
//
// Counter extra_MiB: the workspace's buffers after the call (the logits blocks and their rows' sums).
#include "bench_support.hpp"  // first: its pragma must precede every other include

#include "gbench_main.hpp"

#include <embedhead/embedhead.hpp>

#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using embedhead::Index;
using embedhead::RowMatrix;

constexpr Index kN = 512, kD = 768, kV = 32768;

struct Problem {
  RowMatrix<float> h = RowMatrix<float>(kN, kD), W = RowMatrix<float>(kV, kD);
  RowMatrix<float> hT = RowMatrix<float>(kN, kD), WT = RowMatrix<float>(kV, kD);
  RowMatrix<float> dh = RowMatrix<float>(kN, kD), dW = RowMatrix<float>::Zero(kV, kD);
  RowMatrix<float> dhT = RowMatrix<float>(kN, kD), dWT = RowMatrix<float>::Zero(kV, kD);
  RowMatrix<float> logq = RowMatrix<float>(kN, kV);
  embedhead::IdMatrix<std::int32_t> targets = bench_support::random_ids(kN, kV, 5);
  Problem() {
    bench_support::fill_uniform(h, 3, 1.0);
    bench_support::fill_uniform(W, 4, 0.05);
    bench_support::fill_uniform(hT, 5, 1.0);
    bench_support::fill_uniform(WT, 6, 0.05);
    // The teacher's log-probs, from its logits.
    const RowMatrix<float> u = hT * WT.transpose();
    for (Index n = 0; n < kN; ++n) {
      const float m = u.row(n).maxCoeff();
      const float lse = m + std::log((u.row(n).array() - m).exp().sum());
      logq.row(n) = u.row(n).array() - lse;
    }
  }
};

Problem& problem() {
  static Problem p;
  return p;
}

void BM_Student(benchmark::State& state) {
  bench_support::set_threads(state, static_cast<int>(state.range(1)));
  Problem& p = problem();
  embedhead::FusedHeadLossOptions options;
  options.plan = state.range(0) == 0 ? embedhead::FusedPlan::vocab_blocks : embedhead::FusedPlan::automatic;
  embedhead::FusedHeadLossWorkspace<float> ws;
  RowMatrix<float> none(0, 1);
  auto step = [&] {
    return embedhead::fused_head_loss_forward_backward<float>(p.h, p.W, none, p.targets, p.dh, p.dW, none, ws, options)
        .loss;
  };
  benchmark::DoNotOptimize(step());  // allocates the workspace
  for (auto _ : state) benchmark::DoNotOptimize(step());
  state.counters["extra_MiB"] = static_cast<double>(ws.logits.capacity() * sizeof(float)) / (1 << 20);
}

void BM_Distill(benchmark::State& state) {
  bench_support::set_threads(state, static_cast<int>(state.range(1)));
  Problem& p = problem();
  const std::int64_t what = state.range(0);
  embedhead::DistillationOptions options;
  options.temperature = 2.0;
  options.plan = state.range(2) == 0 ? embedhead::FusedPlan::automatic : embedhead::FusedPlan::vocab_blocks;
  options.divergence = what == 1 ? embedhead::Divergence::reverse_kl : embedhead::Divergence::forward_kl;
  embedhead::DistillationWorkspace<float> ws;
  RowMatrix<float> none(0, 0);
  auto step = [&] {
    if (what == 2)
      return embedhead::distill_logprobs_forward_backward<float>(p.h, p.W, none, p.logq, p.dh, p.dW, none, ws, options)
          .loss;
    if (what == 3)
      return embedhead::distill_head_forward_backward<float>(p.h, p.W, none, p.hT, p.WT, none, p.dh, p.dW, none, p.dhT,
                                                             p.dWT, none, ws, options)
          .loss;
    return embedhead::distill_head_forward_backward<float>(p.h, p.W, none, p.hT, p.WT, none, p.dh, p.dW, none, none,
                                                           none, none, ws, options)
        .loss;
  };
  benchmark::DoNotOptimize(step());
  for (auto _ : state) benchmark::DoNotOptimize(step());
  state.counters["extra_MiB"] = static_cast<double>((ws.student.capacity() + ws.teacher.capacity()) * sizeof(float)) /
                                (1 << 20);
}

void register_benchmarks() {
  for (const std::int64_t t : bench_support::thread_counts()) {
    for (const std::int64_t plan : {0, 1})
      benchmark::RegisterBenchmark("Student", BM_Student)
          ->Args({plan, t})
          ->ArgNames({"plan", "threads"})
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    for (const std::int64_t what : {0, 1, 2, 3})
      for (const std::int64_t plan : {0, 1})
        benchmark::RegisterBenchmark("Distill", BM_Distill)
            ->Args({what, t, plan})
            ->ArgNames({"what", "threads", "plan"})
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
  }
}

}  // namespace

int main(int argc, char** argv) { return bench_support::run_benchmarks(argc, argv, register_benchmarks); }
