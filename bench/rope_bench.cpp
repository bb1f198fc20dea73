// RoPE's forward and backward kernels (rope.hpp) beside a memcpy of the same bytes, in one binary
// so the ratio holds on a noisy machine:
//
//   Memcpy                      std::memcpy of x [N, H*head_dim] into a second buffer, split in one
//                               contiguous share per thread: one read and one write of x's bytes,
//                               the floor for any pass over x.
//   RopeForward/<pairing>       rope_forward in place on x, positions 0 .. T-1 per batch row
//   RopeBackward/<pairing>      rope_backward in place (the gradient)
//   RopeForwardOut/<pairing>    rope_forward from x into a second buffer (the memcpy's traffic)
//
// Shape: N = 8192 tokens (B = 8 rows of T = 1024) x 32 heads x head_dim 128, float: 128 MiB of x,
// and a table of 1024 positions x 128 floats (the table rows add 512 bytes per token, 3 %). Bytes
// processed = 2 * x's bytes (a read and a write) for all four, so their bytes_per_second compare
// directly. 1 and 2 threads when built with OpenMP. Before timing, the binary checks that the
// kernels agree with a naive double rotation on sampled rows and that the outputs of 1 and 2
// threads are bit-identical, and stops with an error otherwise.
#include "bench_support.hpp"

#include <embedhead/rope.hpp>

#include "gbench_main.hpp"

#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

namespace {

using embedhead::Index;
using embedhead::RopePairing;
using embedhead::RopeTable;
using embedhead::RowMatrix;

constexpr char kProgram[] = "rope_bench";
constexpr Index kB = 8, kT = 1024, kH = 32, kHeadDim = 128;
constexpr Index kN = kB * kT;

struct Problem {
  RowMatrix<float> x0, x, out;
  RopeTable<float> half{kHeadDim, kHeadDim, RopePairing::half_split, kT,
                        embedhead::rope_default_frequencies(kHeadDim, 10000.0)};
  RopeTable<float> inter{kHeadDim, kHeadDim, RopePairing::interleaved, kT,
                         embedhead::rope_default_frequencies(kHeadDim, 10000.0)};
  Problem() : x0(kN, kH * kHeadDim), x(kN, kH * kHeadDim), out(kN, kH * kHeadDim) {
    bench_support::fill_uniform(x0, 7);
    x = x0;
    out.setZero();
  }
  const RopeTable<float>& table(RopePairing pairing) const { return pairing == RopePairing::half_split ? half : inter; }
};

Problem& problem() {
  static Problem p;
  return p;
}

// Naive double rotation of row n, head h, pair i of x0 at position n % T, against the kernel's y.
void check_against_naive(const Problem& p, const RowMatrix<float>& y, RopePairing pairing, bool inverse) {
  const Index half = kHeadDim / 2;
  for (const Index n : {Index{0}, Index{1}, kT - 1, kN / 2 + 3, kN - 1})
    for (const Index h : {Index{0}, kH - 1})
      for (Index i = 0; i < half; i += 7) {
        const double theta = std::pow(10000.0, -2.0 * static_cast<double>(i) / static_cast<double>(kHeadDim));
        const double angle = (inverse ? -1.0 : 1.0) * static_cast<double>(n % kT) * theta;
        const Index u = pairing == RopePairing::half_split ? i : 2 * i;
        const Index v = pairing == RopePairing::half_split ? i + half : 2 * i + 1;
        const double xu = p.x0(n, h * kHeadDim + u), xv = p.x0(n, h * kHeadDim + v);
        const double yu = xu * std::cos(angle) - xv * std::sin(angle);
        const double yv = xv * std::cos(angle) + xu * std::sin(angle);
        if (std::abs(y(n, h * kHeadDim + u) - yu) > 1e-5 || std::abs(y(n, h * kHeadDim + v) - yv) > 1e-5)
          bench_support::fail(kProgram, "row " + std::to_string(n) + ", head " + std::to_string(h) + ", pair " +
                                            std::to_string(i) + " differs from the naive rotation");
      }
}

void check() {
  Problem& p = problem();
  for (const RopePairing pairing : {RopePairing::half_split, RopePairing::interleaved}) {
    for (const bool inverse : {false, true}) {
      RowMatrix<float> one, two;
      for (const int threads : {1, 2}) {
#ifdef _OPENMP
        omp_set_num_threads(threads);
#else
        if (threads == 2) continue;
#endif
        RowMatrix<float> y = p.x0;
        if (inverse)
          embedhead::rope_backward(p.table(pairing), y, kH, kT, 0);
        else
          embedhead::rope_forward(p.table(pairing), y, kH, kT, 0);
        (threads == 1 ? one : two) = std::move(y);
      }
      check_against_naive(p, one, pairing, inverse);
      if (two.size() != 0 && std::memcmp(one.data(), two.data(), sizeof(float) * static_cast<std::size_t>(one.size())))
        bench_support::fail(kProgram, "1 and 2 threads give different bits");
    }
  }
}

void set_bytes(benchmark::State& state) {
  state.SetBytesProcessed(state.iterations() * 2 * kN * kH * kHeadDim * static_cast<std::int64_t>(sizeof(float)));
}

void BM_Memcpy(benchmark::State& state) {
  Problem& p = problem();
  bench_support::set_threads(state, static_cast<int>(state.range(0)));
  const int threads = static_cast<int>(state.range(0));
  const std::size_t count = static_cast<std::size_t>(p.x.size());
  for (auto _ : state) {
    // One memcpy per thread over its contiguous share (as the kernels split their rows).
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static, 1)
#endif
    for (int t = 0; t < threads; ++t) {
      const std::size_t begin = count * static_cast<std::size_t>(t) / static_cast<std::size_t>(threads);
      const std::size_t end = count * static_cast<std::size_t>(t + 1) / static_cast<std::size_t>(threads);
      std::memcpy(p.out.data() + begin, p.x.data() + begin, sizeof(float) * (end - begin));
    }
    benchmark::ClobberMemory();
  }
  set_bytes(state);
}

// Forward (or backward) in place. The rotation is applied to the same buffer again and again: a
// rotation keeps norms, so the values stay in range.
template <bool Inverse>
void BM_RopeInPlace(benchmark::State& state, RopePairing pairing) {
  Problem& p = problem();
  bench_support::set_threads(state, static_cast<int>(state.range(0)));
  const RopeTable<float>& table = p.table(pairing);
  for (auto _ : state) {
    if (Inverse)
      embedhead::rope_backward(table, p.x, kH, kT, 0);
    else
      embedhead::rope_forward(table, p.x, kH, kT, 0);
    benchmark::ClobberMemory();
  }
  set_bytes(state);
}

void BM_RopeForwardOut(benchmark::State& state, RopePairing pairing) {
  Problem& p = problem();
  bench_support::set_threads(state, static_cast<int>(state.range(0)));
  const RopeTable<float>& table = p.table(pairing);
  for (auto _ : state) {
    embedhead::rope_forward(table, p.x, kH, kT, 0, p.out);
    benchmark::ClobberMemory();
  }
  set_bytes(state);
}

void register_benchmarks() {
  check();
  for (const std::int64_t threads : bench_support::thread_counts()) {
    benchmark::RegisterBenchmark("Memcpy", BM_Memcpy)->Arg(threads)->ArgName("threads")->UseRealTime();
    for (const RopePairing pairing : {RopePairing::half_split, RopePairing::interleaved}) {
      const std::string name = pairing == RopePairing::half_split ? "half_split" : "interleaved";
      benchmark::RegisterBenchmark(("RopeForward/" + name).c_str(), BM_RopeInPlace<false>, pairing)
          ->Arg(threads)
          ->ArgName("threads")
          ->UseRealTime();
      benchmark::RegisterBenchmark(("RopeBackward/" + name).c_str(), BM_RopeInPlace<true>, pairing)
          ->Arg(threads)
          ->ArgName("threads")
          ->UseRealTime();
      benchmark::RegisterBenchmark(("RopeForwardOut/" + name).c_str(), BM_RopeForwardOut, pairing)
          ->Arg(threads)
          ->ArgName("threads")
          ->UseRealTime();
    }
  }
}

}  // namespace

int main(int argc, char** argv) { return bench_support::run_benchmarks(argc, argv, register_benchmarks); }
