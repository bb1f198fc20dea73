// The LM head's forward GEMM in bf16 through oneDNN (include/embedhead/backends/onednn_head.hpp) beside
// the fp32 head, GPT-2 shape N = 1024, d = 768, V = 50257, bias included, in one binary:
//
//   HeadFp32/threads:T        OutputProjection::forward: logits = h W^T + b, all fp32 (the default
//                             GEMM backend: the packed kernel, or Eigen's with EMBEDHEAD_GEMM_EIGEN)
//   OneDnnHeadBf16/threads:T  OneDnnHead::forward: h fp32 (rounded to bf16 inside, included in
//                             the time), W bf16 [V, d] read in place, fp32 accumulation and logits
//
//   FusedStepFp32/threads:T   FusedHeadLoss::forward_backward, all fp32 (the default backend, default options:
//                             the token-chunk plan), bias included
//   FusedStepBf16/threads:T   the same step in bf16 mixed precision: W rounded to bf16 (to_bf16, in
//                             the time: once a step, as a trainer does from its float master
//                             weights), then fused_head_loss_forward_backward with the bf16 W, its
//                             products on oneDNN (gemm::MixedBackend), dW, db, dh and loss in float
//
// FLOPS counts 2 N V d per head call and 6 N V d per fused step. T = 1 and 2 OpenMP threads (the library and oneDNN
// both follow omp_set_num_threads); wall-clock time. Before timing, the oneDNN logits are checked against the double
// product of the bf16 inputs, and the fp32 ones against the fp32 inputs, on probe entries. Set ONEDNN_VERBOSE=1 to see
// the kernel oneDNN dispatches (e.g. brg:avx512_core_bf16).
#include "bench_support.hpp"  // first: its pragma must precede every other include

#include "gbench_main.hpp"

#include <embedhead/backends/onednn_head.hpp>
#include <embedhead/embedhead.hpp>

#include <benchmark/benchmark.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <cmath>
#include <string>
#include <utility>

namespace {

using embedhead::Index;
using embedhead::OutputProjection;
using embedhead::RowMatrix;
using bench_support::fail;
using bench_support::number;

constexpr char kProgram[] = "onednn_head_bench";
constexpr Index kN = 1024, kD = 768, kV = 50257;

struct Problem {
  OutputProjection<float> head{kV, kD};
  RowMatrix<float> h = RowMatrix<float>(kN, kD);
  embedhead::IdMatrix<std::int32_t> targets = embedhead::IdMatrix<std::int32_t>(kN, 1);
  RowMatrix<float> dh = RowMatrix<float>(kN, kD);
  RowMatrix<embedhead::bfloat16> W_bf16;
  RowMatrix<float> logits = RowMatrix<float>(kN, kV);
  embedhead::OneDnnHead onednn;
  Problem() {
    bench_support::fill_uniform(h, 12);
    bench_support::fill_uniform(head.bias()->value(), 11, 0.1);
    W_bf16 = embedhead::to_bf16(static_cast<const OutputProjection<float>&>(head).weight().value());
    for (Index n = 0; n < kN; ++n) targets(n, 0) = static_cast<std::int32_t>((n * 7919) % kV);
  }
};

Problem& problem() {
  static Problem p;
  return p;
}

void set_threads(benchmark::State& state) {
#ifdef _OPENMP
  omp_set_num_threads(static_cast<int>(state.range(0)));
#else
  if (state.range(0) != 1) state.SkipWithError("built without OpenMP: one thread only");
#endif
}

// logits(n, v) against sum_j h(n, j) W(v, j) + b(v) in double, tolerance scale * sum |terms|.
template <typename HAt, typename WAt>
void check_probes(const char* what, const HAt& h_at, const WAt& W_at, double scale) {
  Problem& p = problem();
  const auto b = static_cast<const OutputProjection<float>&>(p.head).bias()->value();
  const std::pair<Index, Index> probes[] = {{0, 0},           {0, kV - 1},      {kN - 1, 0},
                                            {kN - 1, kV - 1}, {kN / 3, kV / 2}, {kN / 2, kV / 7}};
  for (const auto& probe : probes) {
    const Index n = probe.first, v = probe.second;
    double exact = b(v, 0), magnitude = std::abs(exact);
    for (Index j = 0; j < kD; ++j) {
      const double term = h_at(n, j) * W_at(v, j);
      exact += term;
      magnitude += std::abs(term);
    }
    if (!(std::abs(p.logits(n, v) - exact) <= scale * magnitude))
      fail(kProgram, std::string(what) + ": logits(" + std::to_string(n) + ", " + std::to_string(v) +
                         ") = " + number(p.logits(n, v)) + ", expected " + number(exact));
  }
}

void BM_HeadFp32(benchmark::State& state) {
  Problem& p = problem();
  set_threads(state);
  p.head.forward(p.h, p.logits);
  const auto W = static_cast<const OutputProjection<float>&>(p.head).weight().value();
  check_probes(
      "HeadFp32", [&](Index n, Index j) { return double{p.h(n, j)}; },
      [&](Index v, Index j) { return double{W(v, j)}; }, 16 * std::ldexp(1.0, -24));
  for (auto _ : state) {
    p.head.forward(p.h, p.logits);
    benchmark::DoNotOptimize(p.logits.data());
    benchmark::ClobberMemory();
  }
  state.counters["FLOPS"] = benchmark::Counter(2.0 * kN * kV * kD, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_OneDnnHeadBf16(benchmark::State& state) {
  Problem& p = problem();
  set_threads(state);
  const auto b = static_cast<const OutputProjection<float>&>(p.head).bias()->value();
  p.onednn.forward(p.h, p.W_bf16, b, p.logits);
  const auto as_float = [](embedhead::bfloat16 x) { return double{static_cast<float>(x)}; };
  check_probes(
      "OneDnnHeadBf16", [&](Index n, Index j) { return as_float(embedhead::bfloat16(p.h(n, j))); },
      [&](Index v, Index j) { return as_float(p.W_bf16(v, j)); }, 2.0 * (kD + 2) * std::ldexp(1.0, -24));
  for (auto _ : state) {
    p.onednn.forward(p.h, p.W_bf16, b, p.logits);
    benchmark::DoNotOptimize(p.logits.data());
    benchmark::ClobberMemory();
  }
  state.counters["FLOPS"] = benchmark::Counter(2.0 * kN * kV * kD, benchmark::Counter::kIsIterationInvariantRate);
}

// The fused step, fp32 then bf16; before timing, the bf16 loss against the fp32 one (bf16 inputs:
// the logits move by about 2^-8 of their terms, the loss far less; 1e-3 relative is a loose bound
// that still catches a wrong product) and dh's relative Frobenius error below 2^-6.
struct FusedSteps {
  embedhead::FusedHeadLoss<float> fp32;
  embedhead::FusedHeadLossWorkspace<float> workspace;
  double fp32_loss = 0;
  RowMatrix<float> fp32_dh;
};
FusedSteps& fused_steps() {
  static FusedSteps steps;
  return steps;
}

double bf16_step(Problem& p, FusedSteps& steps) {
  auto& weight = p.head.weight();
  auto& bias = *p.head.bias();
  // Into the bf16 W made at construction: no allocation in the step.
  embedhead::to_bf16(static_cast<const OutputProjection<float>&>(p.head).weight().value(), p.W_bf16);
  auto dW = weight.grad().dense_accumulator();
  auto db = bias.grad().dense_accumulator();
  const auto b = static_cast<const OutputProjection<float>&>(p.head).bias()->value();
  return embedhead::fused_head_loss_forward_backward(p.h, p.W_bf16, b, p.targets, p.dh, dW, db, steps.workspace).loss;
}

void BM_FusedStepFp32(benchmark::State& state) {
  Problem& p = problem();
  FusedSteps& steps = fused_steps();
  set_threads(state);
  for (auto _ : state) {
    p.head.zero_grad();
    benchmark::DoNotOptimize(steps.fp32.forward_backward(p.head, p.h, p.targets, p.dh).loss);
  }
  state.counters["FLOPS"] = benchmark::Counter(6.0 * kN * kV * kD, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_FusedStepBf16(benchmark::State& state) {
  Problem& p = problem();
  FusedSteps& steps = fused_steps();
  set_threads(state);
  if (steps.fp32_dh.size() == 0) {
    p.head.zero_grad();
    steps.fp32_loss = steps.fp32.forward_backward(p.head, p.h, p.targets, p.dh).loss;
    steps.fp32_dh = p.dh;
  }
  p.head.zero_grad();
  const double loss = bf16_step(p, steps);
  if (!(std::abs(loss - steps.fp32_loss) <= 1e-3 * std::abs(steps.fp32_loss)))
    fail(kProgram, "FusedStepBf16: loss " + number(loss) + ", the fp32 step's " + number(steps.fp32_loss));
  const double dh_error = (p.dh - steps.fp32_dh).norm() / steps.fp32_dh.norm();
  if (!(dh_error <= std::ldexp(1.0, -6)))
    fail(kProgram, "FusedStepBf16: dh's relative error against the fp32 step " + number(dh_error));
  for (auto _ : state) {
    p.head.zero_grad();
    benchmark::DoNotOptimize(bf16_step(p, steps));
  }
  state.counters["FLOPS"] = benchmark::Counter(6.0 * kN * kV * kD, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(embedhead::detail::gemm::OneDnnBackend::kernel_name());
}

void register_benchmarks() {
  // Each pair side by side, on 1 then 2 threads.
  const std::pair<const char*, void (*)(benchmark::State&)> pairs[][2] = {{{"HeadFp32", BM_HeadFp32},
                                                                           {"OneDnnHeadBf16", BM_OneDnnHeadBf16}},
                                                                          {{"FusedStepFp32", BM_FusedStepFp32},
                                                                           {"FusedStepBf16", BM_FusedStepBf16}}};
  for (const auto& pair : pairs)
    for (const int threads : {1, 2})
      for (const auto& benchmark : pair)
        benchmark::RegisterBenchmark(benchmark.first, benchmark.second)
            ->Arg(threads)
            ->ArgName("threads")
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond);
}

}  // namespace

int main(int argc, char** argv) { return bench_support::run_benchmarks(argc, argv, register_benchmarks); }
