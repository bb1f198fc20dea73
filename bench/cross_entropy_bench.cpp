// Softmax cross-entropy on GPT-2 sized logits [N = 1024, V = 50257] (206 MB of floats):
//
//   CrossEntropyForwardBackward  cross_entropy_forward_backward: loss and dlogits [N, V]
//                                (max, exp into dlogits, rescale: three passes over a row).
//   CrossEntropyForward          cross_entropy: the loss only (max, then sum of exp).
//
// bytes_per_second counts the logits read once (N*V*4 bytes per call), so it reads as "logits
// processed per second"; the forward-backward also writes and re-reads dlogits. items = rows.
// Logits are uniform in [-8, 8), targets uniform over [0, V). Single-threaded.

// bench_support.hpp comes first, before any other include: it sets the pragma that silences
// GCC bug 105593's false -Wmaybe-uninitialized, which must precede the intrinsic headers.
#include "bench_support.hpp"

#include <embedhead/embedhead.hpp>

#include "../tests/reference/naive.hpp"
#include "gbench_main.hpp"

#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>

namespace {

using embedhead::CrossEntropyResult;
using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::RowMatrix;
using bench_support::fail;
using bench_support::number;

constexpr char kProgram[] = "cross_entropy_bench";  // names this binary in fail() messages

constexpr Index kRows = 1024, kVocab = 50257;

struct Problem {
  RowMatrix<float> logits = RowMatrix<float>(kRows, kVocab);
  IdMatrix<std::int32_t> targets = IdMatrix<std::int32_t>(1, kRows);
  double expected_sum = 0;  // naive summed loss, in double
};

// Built once and shared by both benchmarks; the naive loss is computed here, once.
const Problem& problem() {
  static const Problem instance = [] {
    Problem p;
    const embedhead::Rng rng(5);
    for (Index i = 0; i < p.logits.size(); ++i)
      p.logits.data()[i] = static_cast<float>(16.0 * rng.uniform_at(static_cast<std::uint64_t>(i)) - 8.0);
    std::mt19937 engine(9);
    std::uniform_int_distribution<std::int32_t> target(0, static_cast<std::int32_t>(kVocab - 1));
    for (Index n = 0; n < kRows; ++n) p.targets(0, n) = target(engine);
    Index count = 0;
    p.expected_sum = naive::cross_entropy_sum(p.logits, p.targets, -100, count);
    if (count != kRows) fail(kProgram, "naive reference counted " + std::to_string(count) + " rows");
    return p;
  }();
  return instance;
}

// Each row's loss is about 16 (log-sum-exp ~ log(V) + log((e^8 - e^-8) / 16), minus a logit of
// mean 0); float log-sum-exp over 50257 terms is good to a few 1e-6 per row, so 1e-4 per row is
// safe, while a wrong target or a lost term moves a row's loss by far more.
void check_loss(const CrossEntropyResult& result, const char* what) {
  const Problem& p = problem();
  if (result.count != kRows) fail(kProgram, std::string(what) + ": count " + std::to_string(result.count));
  if (!(std::abs(result.sum - p.expected_sum) <= 1e-4 * kRows))
    fail(kProgram, std::string(what) + ": loss sum " + number(result.sum) + ", naive " + number(p.expected_sum));
  if (!(std::abs(result.loss - p.expected_sum / kRows) <= 1e-4))
    fail(kProgram,
         std::string(what) + ": mean loss " + number(result.loss) + ", naive " + number(p.expected_sum / kRows));
}

// dlogits rows against (softmax - one_hot) / N computed in double.
void check_dlogits(const RowMatrix<float>& dlogits) {
  const Problem& p = problem();
  for (const Index n : {Index{0}, kRows / 2, kRows - 1}) {
    double m = -INFINITY, sum = 0;
    for (Index v = 0; v < kVocab; ++v) m = std::max(m, double{p.logits(n, v)});
    for (Index v = 0; v < kVocab; ++v) sum += std::exp(double{p.logits(n, v)} - m);
    for (Index v = 0; v < kVocab; ++v) {
      const double expected = (std::exp(double{p.logits(n, v)} - m) / sum - (v == p.targets(0, n) ? 1.0 : 0.0)) / kRows;
      if (!(std::abs(dlogits(n, v) - expected) <= 1e-4 * std::abs(expected) + 1e-12))
        fail(kProgram, "dlogits(" + std::to_string(n) + ", " + std::to_string(v) + ") = " + number(dlogits(n, v)) +
                           ", expected " + number(expected));
    }
  }
}

void set_counters(benchmark::State& state) {
  state.SetItemsProcessed(state.iterations() * kRows);
  state.SetBytesProcessed(state.iterations() * kRows * kVocab * static_cast<Index>(sizeof(float)));
}

void BM_CrossEntropyForwardBackward(benchmark::State& state) {
  const Problem& p = problem();
  RowMatrix<float> dlogits(kRows, kVocab);
  check_loss(embedhead::cross_entropy_forward_backward<float>(p.logits, p.targets, dlogits), "forward_backward");
  check_dlogits(dlogits);
  for (auto _ : state) {
    const CrossEntropyResult result = embedhead::cross_entropy_forward_backward<float>(p.logits, p.targets, dlogits);
    benchmark::DoNotOptimize(result);
    benchmark::DoNotOptimize(dlogits.data());
    benchmark::ClobberMemory();
  }
  set_counters(state);
}

void BM_CrossEntropyForward(benchmark::State& state) {
  const Problem& p = problem();
  check_loss(embedhead::cross_entropy<float>(p.logits, p.targets), "forward");
  for (auto _ : state) {
    const CrossEntropyResult result = embedhead::cross_entropy<float>(p.logits, p.targets);
    benchmark::DoNotOptimize(result);
    benchmark::ClobberMemory();
  }
  set_counters(state);
}

void register_benchmarks() {
  benchmark::RegisterBenchmark("CrossEntropyForwardBackward", BM_CrossEntropyForwardBackward)
      ->Args({kRows, kVocab})
      ->ArgNames({"N", "V"})
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("CrossEntropyForward", BM_CrossEntropyForward)
      ->Args({kRows, kVocab})
      ->ArgNames({"N", "V"})
      ->Unit(benchmark::kMillisecond);
}

}  // namespace

int main(int argc, char** argv) { return bench_support::run_benchmarks(argc, argv, register_benchmarks); }
