// One optimizer step on an embedding table of V rows, d = 768, whose gradient touches 2,000
// distinct rows (a batch of a few thousand tokens), for V = 32,768, 50,257, 131,072 and 262,144.
//
//   LazyAdamStep/V:…   LazyAdam: touched rows only -- should stay flat as V grows
//   AdagradStep/V:…    Adagrad: touched rows only
//   SGDStep/V:…        plain SGD: touched rows only
//   AdamWStep/V:…      exact AdamW: every row's moments and value -- grows with V
//
// Counters: rows_per_s (rows the step had to visit), GB/s over the bytes the step must stream
// (AdamW: value, m and v read and written for all V rows; lazy ones: those of the touched rows
// plus the gradient rows). Before timing, one step of each is checked against a direct
// computation of its formula on a few rows.
#include "bench_support.hpp"  // first: its pragma must precede every other include

#include "gbench_main.hpp"

#include <embedhead/optim/adagrad.hpp>
#include <embedhead/optim/adamw.hpp>
#include <embedhead/optim/lazy_adam.hpp>
#include <embedhead/optim/optimizer.hpp>
#include <embedhead/optim/sgd.hpp>

#include <benchmark/benchmark.h>

#include <cmath>
#include <memory>
#include <random>
#include <vector>

namespace {

using embedhead::Index;
using embedhead::Parameter;
using embedhead::RowMatrix;

constexpr const char* kProgram = "optimizer_bench";
constexpr Index kD = 768, kTouched = 2000;

// A table and a sparse gradient over kTouched distinct random rows.
struct Table {
  std::shared_ptr<Parameter<float>> p;
  std::vector<Index> rows;
  RowMatrix<float> grad_rows;
  explicit Table(Index V) : p(std::make_shared<Parameter<float>>(V, kD, "E")), grad_rows(kTouched, kD) {
    bench_support::fill_uniform(p->value(), 7, 0.02);
    bench_support::fill_uniform(grad_rows, 8, 1e-3);
    std::mt19937 engine(9);
    std::vector<Index> all(static_cast<std::size_t>(V));
    for (Index i = 0; i < V; ++i) all[static_cast<std::size_t>(i)] = i;
    std::shuffle(all.begin(), all.end(), engine);
    rows.assign(all.begin(), all.begin() + kTouched);
    std::sort(rows.begin(), rows.end());
  }
  void set_gradient() {
    p->zero_grad();
    std::vector<Index> slots(rows.size());
    p->grad().touch_rows(rows.data(), kTouched, slots.data());
    for (Index i = 0; i < kTouched; ++i) p->grad().slot_row(slots[static_cast<std::size_t>(i)]) = grad_rows.row(i);
  }
};

// One LazyAdam step on a fresh table equals the formula on a touched row; an untouched row stays.
void check_lazy_adam() {
  Table t(4096);
  const RowMatrix<float> before = t.p->value();
  embedhead::LazyAdam<float> adam(embedhead::LazyAdam<float>::lazy_defaults(), {t.p});
  t.set_gradient();
  adam.step();
  const Index r = t.rows[0];
  for (Index j = 0; j < kD; ++j) {
    const double g = t.grad_rows(0, j);
    // t = 1: m_hat = g, v_hat = g^2 -> the step is lr g / (|g| + eps).
    const double expected = before(r, j) - 1e-3 * g / (std::abs(g) + 1e-8);
    if (std::abs(t.p->value()(r, j) - expected) > 1e-6)
      bench_support::fail(kProgram, "LazyAdam first step differs from lr g / (|g| + eps)");
  }
  Index untouched = 0;
  while (std::binary_search(t.rows.begin(), t.rows.end(), untouched)) ++untouched;
  if (t.p->value().row(untouched) != before.row(untouched))
    bench_support::fail(kProgram, "LazyAdam moved an untouched row");
}

template <typename Optimizer>
void run_step(benchmark::State& state, Optimizer& optimizer, Table& table, double rows_visited, double bytes_per_step) {
  table.set_gradient();
  optimizer.step();  // first step allocates the state
  for (auto _ : state) {
    optimizer.step();  // the same gradient each time: the cost does not depend on its values
    benchmark::ClobberMemory();
  }
  state.counters["rows_per_s"] = benchmark::Counter(rows_visited * static_cast<double>(state.iterations()),
                                                    benchmark::Counter::kIsRate);
  state.counters["GB/s"] = benchmark::Counter(bytes_per_step * static_cast<double>(state.iterations()) * 1e-9,
                                              benchmark::Counter::kIsRate);
}

constexpr double kRowBytes = kD * sizeof(float);

void BM_LazyAdamStep(benchmark::State& state) {
  Table table(state.range(0));
  embedhead::LazyAdam<float> adam(embedhead::LazyAdam<float>::lazy_defaults(), {table.p});
  run_step(state, adam, table, kTouched, kTouched * kRowBytes * 7);  // g; p, m, v read + written
}

void BM_AdagradStep(benchmark::State& state) {
  Table table(state.range(0));
  embedhead::Adagrad<float> adagrad(embedhead::AdagradOptions{}, {table.p});
  run_step(state, adagrad, table, kTouched, kTouched * kRowBytes * 5);  // g; p, G read + written
}

void BM_SGDStep(benchmark::State& state) {
  Table table(state.range(0));
  embedhead::SGD<float> sgd(embedhead::SGDOptions{}, {table.p});
  run_step(state, sgd, table, kTouched, kTouched * kRowBytes * 3);  // g; p read + written
}

void BM_AdamWStep(benchmark::State& state) {
  const Index V = state.range(0);
  Table table(V);
  embedhead::AdamW<float> adam(embedhead::AdamOptions{}, {table.p});
  run_step(state, adam, table, static_cast<double>(V), static_cast<double>(V) * kRowBytes * 6 + kTouched * kRowBytes);
}

void register_benchmarks() {
  check_lazy_adam();
  for (const std::int64_t V : {32768, 50257, 131072, 262144}) {
    benchmark::RegisterBenchmark("LazyAdamStep", BM_LazyAdamStep)->Arg(V)->ArgName("V")->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark("AdagradStep", BM_AdagradStep)->Arg(V)->ArgName("V")->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark("SGDStep", BM_SGDStep)->Arg(V)->ArgName("V")->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark("AdamWStep", BM_AdamWStep)->Arg(V)->ArgName("V")->Unit(benchmark::kMillisecond);
  }
}

}  // namespace

int main(int argc, char** argv) { return bench_support::run_benchmarks(argc, argv, register_benchmarks); }
