// The sampling chain (sampling.hpp) at N = 1 beside the decode GEMV that produces its logits, in
// one binary so the ratio holds on a noisy machine (issue 17's target: the chain at most 5 % of
// the GEMV):
//
//   DecodeGemv            output_projection_decode: h [1, d] -> logits [1, V] = h W^T, one pass
//                         over W [V, d] (2 GiB of float: the bandwidth-bound decode step)
//   Chain/hf_top_k        sample_tokens with every step but allowed_ids, HF's order: 8 logit
//                         biases, repetition penalty 1.1, frequency 0.2 and presence 0.1 over a
//                         history of 512 tokens, 4 banned ids, temperature 0.8, top_k 50, top_p 0.9,
//                         min_p 0.05, typical_p 0.95; and the sampled token's raw and processed
//                         log-probs
//   Chain/no_top_k        the same without top-k: top-p, min-p and typical each run over the whole
//                         vocabulary (the chain's worst case)
//   Chain/temperature     temperature 0.8 alone, then the draw over all V tokens
//   RawLogProbs           raw_log_probs of the row (log_softmax into a second row)
//
// Shape: V = 256,000, d = 2048 (Gemma), N = 1, float, one thread (nothing here is threaded). The
// logits are the GEMV's own, from W ~ U(-0.05, 0.05) and h ~ U(-1, 1), so a row's softmax is
// fairly flat: top-p keeps tens of thousands of tokens, the costly case for the selections.
// Before timing the binary checks the GEMV against a double dot product on sampled rows and that
// each chain's sampled token survives the chain as a naive full sort decides it (top-k, and the
// -inf mask), and stops with an error otherwise. Each chain's row shows gemv_ms (the GEMV's wall
// time, mean of 3 passes after its own benchmark) and pct_of_gemv (the chain's mean wall time per
// call as a percentage of it). Run DecodeGemv first (the default order) for those counters.
#include "bench_support.hpp"

#include <embedhead/output_projection.hpp>
#include <embedhead/sampling.hpp>

#include "gbench_main.hpp"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

namespace {

using embedhead::Index;
using embedhead::RowMatrix;
using embedhead::SamplingOptions;

constexpr char kProgram[] = "sampling_bench";
constexpr Index kV = 256000, kD = 2048;

struct Problem {
  RowMatrix<float> W, h, bias, logits, out;
  embedhead::IdMatrix<std::int32_t> history;
  std::vector<embedhead::TokenIds> views;
  Problem() : W(kV, kD), h(1, kD), bias(0, 1), logits(1, kV), out(1, kV) {
    bench_support::fill_uniform(W, 3, 0.05);
    bench_support::fill_uniform(h, 4, 1.0);
    history = bench_support::random_ids(512, kV, 5);  // [1, 512]
    views.emplace_back(history);
    embedhead::output_projection_decode<float>(h, W, bias, logits);
  }
};

Problem& problem() {
  static Problem p;
  return p;
}

SamplingOptions chain(const std::string& name) {
  SamplingOptions o;
  o.temperature = 0.8;
  if (name == "temperature") return o;
  for (Index i = 0; i < 8; ++i) o.logit_bias.push_back({i * 1000 + 7, i % 2 ? 1.5 : -2.0});
  o.repetition_penalty = 1.1;
  o.frequency_penalty = 0.2;
  o.presence_penalty = 0.1;
  o.banned_ids = {0, 1, 2, 3};
  if (name == "hf_top_k") o.top_k = 50;
  o.top_p = 0.9;
  o.min_p = 0.05;
  o.typical_p = 0.95;
  return o;
}

const std::vector<std::string> kChains = {"hf_top_k", "no_top_k", "temperature"};

void check() {
  Problem& p = problem();
  for (const Index r : {Index{0}, Index{1}, kV / 2 + 3, kV - 1}) {
    double dot = 0;
    for (Index c = 0; c < kD; ++c) dot += static_cast<double>(p.h(0, c)) * static_cast<double>(p.W(r, c));
    if (std::fabs(dot - static_cast<double>(p.logits(0, r))) > 1e-4)
      bench_support::fail(kProgram, "logit " + std::to_string(r) + " = " + bench_support::number(p.logits(0, r)) +
                                        ", a double dot product gives " + bench_support::number(dot));
  }
  const embedhead::Rng rng(11);
  for (const std::string& name : kChains) {
    const SamplingOptions o = chain(name);
    embedhead::process_logits<float>(p.logits, o, p.views, p.out);
    for (std::uint64_t draw = 0; draw < 20; ++draw) {
      const embedhead::SampledTokens s = embedhead::sample_tokens<float>(p.logits, o, p.views, rng, draw);
      const Index t = s.tokens[0];
      if (!(p.out(0, t) > -std::numeric_limits<float>::infinity()))
        bench_support::fail(kProgram, name + ": sampled token " + std::to_string(t) + " was removed by the chain");
      if (o.top_k) {
        // The processed row's k-th largest value by a full sort (the check may sort).
        std::vector<float> sorted(p.out.data(), p.out.data() + kV);
        std::sort(sorted.begin(), sorted.end(), std::greater<float>());
        if (p.out(0, t) < sorted[static_cast<std::size_t>(*o.top_k - 1)])
          bench_support::fail(kProgram, name + ": sampled token " + std::to_string(t) + " is outside the top k");
      }
    }
  }
}

double& gemv_seconds() {
  static double seconds = 0;
  return seconds;
}

void BM_DecodeGemv(benchmark::State& state) {
  Problem& p = problem();
  for (auto _ : state) {
    embedhead::output_projection_decode<float>(p.h, p.W, p.bias, p.logits);
    benchmark::DoNotOptimize(p.logits.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * kV * kD * static_cast<std::int64_t>(sizeof(float)));
  // The GEMV's time for the chains' pct_of_gemv counters (wall clock, mean of 3 passes).
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 3; ++i) embedhead::output_projection_decode<float>(p.h, p.W, p.bias, p.logits);
  gemv_seconds() = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / 3;
}

void BM_Chain(benchmark::State& state, const std::string& name) {
  Problem& p = problem();
  const SamplingOptions o = chain(name);
  const embedhead::Rng rng(12);
  std::uint64_t draw = 0;
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    const embedhead::SampledTokens s = embedhead::sample_tokens<float>(p.logits, o, p.views, rng, draw++);
    benchmark::DoNotOptimize(s.tokens.data());
    benchmark::ClobberMemory();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  state.SetBytesProcessed(state.iterations() * kV * static_cast<std::int64_t>(sizeof(float)));
  state.counters["gemv_ms"] = gemv_seconds() * 1e3;
  if (gemv_seconds() > 0 && state.iterations() > 0)
    state.counters["pct_of_gemv"] = 100.0 * seconds / static_cast<double>(state.iterations()) / gemv_seconds();
}

void BM_RawLogProbs(benchmark::State& state) {
  Problem& p = problem();
  for (auto _ : state) {
    embedhead::raw_log_probs<float>(p.logits, p.out);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * 2 * kV * static_cast<std::int64_t>(sizeof(float)));
}

void register_benchmarks() {
  check();
  benchmark::RegisterBenchmark("DecodeGemv", BM_DecodeGemv)->Unit(benchmark::kMillisecond);
  for (const std::string& name : kChains)
    benchmark::RegisterBenchmark(("Chain/" + name).c_str(), BM_Chain, name)->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("RawLogProbs", BM_RawLogProbs)->Unit(benchmark::kMillisecond);
}

}  // namespace

int main(int argc, char** argv) { return bench_support::run_benchmarks(argc, argv, register_benchmarks); }
