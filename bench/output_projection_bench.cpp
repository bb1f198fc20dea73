// The LM head's GEMMs in GFLOP/s, at GPT-2 shape (N = 1024 tokens, d = 768, V = 50257, float):
//
//   HeadForward    OutputProjection::forward: logits [N, V] = h [N, d] W^T + b.   2*N*V*d flops
//   HeadBackward   OutputProjection::backward: dh = dlogits W (written),
//                  dW += dlogits^T h, db += column sums (accumulated).           4*N*V*d flops
//                  zero_grad is outside the loop: after the first dense contribution it is one
//                  V*d memset (154 MB), under 2% of a backward, and would blur the GFLOP/s.
//   FmaPeak        16 independent chains of packet FMAs: one core's FMA peak, the limit of the above
//   EigenGemm      plain Eigen products in the same binary, as baselines:
//                    square 2048^3 (C = A B): the measured single-core GEMM peak;
//                    head shape (h W^T with plain matrices): what the forward costs without the
//                    library, so HeadForward / EigenGemm is the library's overhead.
//
// FLOPS counts multiply-adds as 2 flops and is a rate (benchmark prints e.g. 80G/s = 80 GFLOP/s).
// Single-threaded: built without OpenMP, so Eigen's GEMM runs on one thread. One forward is
// 79 GFLOP (about a second), so each benchmark runs only a few iterations.

// bench_support.hpp comes first, before any other include: it sets the pragma that silences
// GCC bug 105593's false -Wmaybe-uninitialized, which must precede the intrinsic headers.
#include "bench_support.hpp"

#include <embedhead/embedhead.hpp>

#include "gbench_main.hpp"

#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace {

using embedhead::Index;
using embedhead::OutputProjection;
using embedhead::RowMatrix;
using bench_support::fail;
using bench_support::fill_uniform;
using bench_support::number;

constexpr char kProgram[] = "output_projection_bench";  // names this binary in fail() messages

constexpr Index kTokens = 1024, kDim = 768, kVocab = 50257;

// A float result against the same dot product in double. The worst-case rounding bound of a float
// sum of n products, n * 2^-24 * sum |products|, would accept almost anything at n = 50257. For
// products of random sign, as here, the error stays near 2^-24 * sum |products| (measured: at most
// half of that over all probes), so a tolerance of 16 times that cannot trip on a correct result,
// while a wrong index, a lost transpose, a missing bias or a 0.1% error in dh does.
template <typename Terms>
void check_dot(float got, Index length, const Terms& terms, const std::string& what) {
  double exact = 0, magnitude = 0;
  for (Index i = 0; i < length; ++i) {
    const double term = terms(i);
    exact += term;
    magnitude += std::abs(term);
  }
  const double tolerance = 16 * std::ldexp(1.0, -24) * magnitude + 1e-30;
  if (!(std::abs(static_cast<double>(got) - exact) <= tolerance))
    fail(kProgram,
         what + " = " + number(got) + ", expected " + number(exact) + " (tolerance " + number(tolerance) + ")");
}

// Entries checked: the four corners and a few inside.
std::vector<std::pair<Index, Index>> probes(Index rows, Index cols) {
  return {{0, 0}, {0, cols - 1}, {rows - 1, 0}, {rows - 1, cols - 1}, {rows / 3, cols / 2}, {rows / 2, cols / 7}};
}

// The untied GPT-2 head with a non-zero bias (the default init leaves it at zero, which would
// hide a missing bias add), built once: its normal init draws 38.6 M numbers.
OutputProjection<float>& head() {
  static OutputProjection<float> instance = [] {
    OutputProjection<float> h(kVocab, kDim);
    fill_uniform(h.bias()->value(), 11, 0.1);
    return h;
  }();
  return instance;
}

struct Inputs {
  RowMatrix<float> h = RowMatrix<float>(kTokens, kDim);
  RowMatrix<float> dlogits = RowMatrix<float>(kTokens, kVocab);
};

// h ~ U(-1, 1); dlogits ~ U(-1, 1) / N, the size of (softmax - one_hot) / N.
const Inputs& inputs() {
  static const Inputs instance = [] {
    Inputs in;
    fill_uniform(in.h, 12);
    fill_uniform(in.dlogits, 13, 1.0 / kTokens);
    return in;
  }();
  return instance;
}

void set_flops(benchmark::State& state, double flops) {
  state.counters["FLOPS"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
}

constexpr double kHeadFlops = 2.0 * kTokens * kVocab * kDim;

void BM_HeadForward(benchmark::State& state) {
  const OutputProjection<float>& lm_head = head();
  const auto W = lm_head.weight().value();
  const auto b = lm_head.bias()->value();
  const RowMatrix<float>& h = inputs().h;
  RowMatrix<float> logits(kTokens, kVocab);
  lm_head.forward(h, logits);
  for (const auto& probe : probes(kTokens, kVocab)) {
    const Index n = probe.first, v = probe.second;  // not a structured binding: C++17 lambdas cannot capture one
    check_dot(
        logits(n, v) - b(v, 0), kDim, [&](Index j) { return double{h(n, j)} * W(v, j); },
        "forward: logits(" + std::to_string(n) + ", " + std::to_string(v) + ") - b");
  }
  for (auto _ : state) {
    lm_head.forward(h, logits);
    benchmark::DoNotOptimize(logits.data());
    benchmark::ClobberMemory();
  }
  set_flops(state, kHeadFlops);
  state.SetItemsProcessed(state.iterations() * kTokens);
}

void BM_HeadBackward(benchmark::State& state) {
  OutputProjection<float>& lm_head = head();
  const auto W = static_cast<const OutputProjection<float>&>(lm_head).weight().value();
  const Inputs& in = inputs();
  RowMatrix<float> dh(kTokens, kDim);
  // One backward from zero gradients, checked against double dot products.
  lm_head.zero_grad();
  lm_head.backward(in.h, in.dlogits, dh);
  const auto& dW = lm_head.weight().grad();
  const auto& db = lm_head.bias()->grad();
  if (!dW.is_dense() || dW.num_touched() != kVocab)
    fail(kProgram, "backward: dW is not a dense gradient over all V rows");
  for (const auto& probe : probes(kTokens, kDim)) {
    const Index n = probe.first, j = probe.second;
    check_dot(
        dh(n, j), kVocab, [&](Index v) { return double{in.dlogits(n, v)} * W(v, j); },
        "backward: dh(" + std::to_string(n) + ", " + std::to_string(j) + ")");
  }
  for (const auto& probe : probes(kVocab, kDim)) {
    const Index v = probe.first, j = probe.second;
    check_dot(
        dW.touched_row(v)(j), kTokens, [&](Index n) { return double{in.dlogits(n, v)} * in.h(n, j); },
        "backward: dW(" + std::to_string(v) + ", " + std::to_string(j) + ")");
    check_dot(
        db.touched_row(v)(0), kTokens, [&](Index n) { return double{in.dlogits(n, v)}; },
        "backward: db(" + std::to_string(v) + ")");
  }
  for (auto _ : state) {
    lm_head.backward(in.h, in.dlogits, dh);
    benchmark::DoNotOptimize(dh.data());
    benchmark::DoNotOptimize(dW.touched_row(0).data());
    benchmark::ClobberMemory();
  }
  lm_head.zero_grad();
  set_flops(state, 2 * kHeadFlops);
  state.SetItemsProcessed(state.iterations() * kTokens);
}

// args: M, K, N -> C [M, N] = A [M, K] B [K, N], all row-major, as the library's matrices.
// Square 2048^3 is the peak reference; (1024, 768, 50257) with B = W^T is the head's forward.
void BM_EigenGemm(benchmark::State& state) {
  const Index M = state.range(0), K = state.range(1), N = state.range(2);
  const bool head_shape = state.range(3) != 0;
  RowMatrix<float> A(M, K), C(M, N);
  fill_uniform(A, 21);
  // For the head shape, store B as W [N, K] and multiply by its transpose, exactly as the head.
  RowMatrix<float> B = head_shape ? RowMatrix<float>(N, K) : RowMatrix<float>(K, N);
  fill_uniform(B, 22, 0.05);
  auto multiply = [&] {
    if (head_shape)
      C.noalias() = A * B.transpose();
    else
      C.noalias() = A * B;
  };
  multiply();
  for (const auto& probe : probes(M, N)) {
    const Index m = probe.first, n = probe.second;
    check_dot(
        C(m, n), K, [&](Index k) { return double{A(m, k)} * (head_shape ? B(n, k) : B(k, n)); },
        "EigenGemm: C(" + std::to_string(m) + ", " + std::to_string(n) + ")");
  }
  for (auto _ : state) {
    multiply();
    benchmark::DoNotOptimize(C.data());
    benchmark::ClobberMemory();
  }
  set_flops(state, 2.0 * static_cast<double>(M) * static_cast<double>(K) * static_cast<double>(N));
}

// One core's FMA peak (bench_support::fma_peak_kernel): HeadForward / FmaPeak is the head's share of it.
void BM_FmaPeak(benchmark::State& state) {
  float sink = 0;
  double flops = 0;
  for (auto _ : state) flops = bench_support::fma_peak_kernel(1 << 24, &sink);
  benchmark::DoNotOptimize(sink);
  set_flops(state, flops);
}

void register_benchmarks() {
  benchmark::RegisterBenchmark("FmaPeak", BM_FmaPeak)->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("EigenGemm/square", BM_EigenGemm)
      ->Args({2048, 2048, 2048, 0})
      ->ArgNames({"M", "K", "N", "transposed_B"})
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("EigenGemm/head_shape", BM_EigenGemm)
      ->Args({kTokens, kDim, kVocab, 1})
      ->ArgNames({"M", "K", "N", "transposed_B"})
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("HeadForward", BM_HeadForward)
      ->Args({kTokens, kDim, kVocab})
      ->ArgNames({"N", "d", "V"})
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("HeadBackward", BM_HeadBackward)
      ->Args({kTokens, kDim, kVocab})
      ->ArgNames({"N", "d", "V"})
      ->Unit(benchmark::kMillisecond);
}

}  // namespace

int main(int argc, char** argv) { return bench_support::run_benchmarks(argc, argv, register_benchmarks); }
