// One optimizer step on an embedding table of V rows, d = 768, whose gradient touches 2,000
// distinct rows (a batch of a few thousand tokens), for V = 32,768, 50,257, 131,072 and 262,144.
//
//   LazyAdamStep/V:…   LazyAdam: touched rows only -- should stay flat as V grows
//   AdagradStep/V:…    Adagrad: touched rows only
//   RowWiseAdagradStep/V:…  row-wise Adagrad (FBGEMM's): touched rows only, one accumulator per row
//   SGDStep/V:…        plain SGD: touched rows only
//   AdamWStep/V:…      exact AdamW: every row's moments and value -- grows with V
//   AdamWStepTrainableRows/V:…  exact AdamW on a table of V rows of which only the 2,000 touched
//                      ones are trainable (Parameter::set_trainable_rows): state and work of
//                      2,000 rows; compare with AdamWStep/V:2000, a table of those 2,000 rows
//   AdamWRowsInPlace/V:…  the floor for that layout: the same arithmetic as a bare loop over the
//                      same scattered rows of the V-row table (k-row moments), no optimizer
//   …/cold:1           the same with the caches flushed before each step (a 256 MiB buffer written,
//                      untimed), as in training, where forward and backward passes come between
//                      steps: a 2,000-row table no longer stays in the last-level cache
//
// Counters: rows_per_s (rows the step had to visit), GB/s over the bytes the step must stream
// (AdamW: value, m and v read and written for all V rows; lazy ones: those of the touched rows
// plus the gradient rows); state_MiB, the size of the optimizer's buffers (LazyAdam and AdamW: m
// and v, 2 V d floats; Adagrad: V d; RowWiseAdagrad: V; SGD: none), not a measured peak RSS. Before
// timing, LazyAdam's and RowWiseAdagrad's first steps are checked against their formulas.
#include "bench_support.hpp"  // first: its pragma must precede every other include

#include "gbench_main.hpp"

#include <embedhead/optim/adagrad.hpp>
#include <embedhead/optim/adamw.hpp>
#include <embedhead/optim/lazy_adam.hpp>
#include <embedhead/optim/optimizer.hpp>
#include <embedhead/optim/rowwise_adagrad.hpp>
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
    // t = 1, SparseAdam: m = 0.1 g, v = 0.001 g^2, step size lr sqrt(0.001) / 0.1.
    const double s = std::sqrt(1e-3), expected = before(r, j) - 1e-3 * s * g / (s * std::abs(g) + 1e-8);
    if (std::abs(t.p->value()(r, j) - expected) > 1e-6)
      bench_support::fail(kProgram, "LazyAdam first step differs from lr sqrt(1 - b2) g / (sqrt(1 - b2) |g| + eps)");
  }
  Index untouched = 0;
  while (std::binary_search(t.rows.begin(), t.rows.end(), untouched)) ++untouched;
  if (t.p->value().row(untouched) != before.row(untouched))
    bench_support::fail(kProgram, "LazyAdam moved an untouched row");
}

// One RowWiseAdagrad step on a fresh table: p_r - lr g_r / (sqrt(mean g_r^2) + eps) on a touched
// row; an untouched row stays.
void check_rowwise_adagrad() {
  Table t(4096);
  const RowMatrix<float> before = t.p->value();
  embedhead::RowWiseAdagrad<float> adagrad({}, {t.p});
  t.set_gradient();
  adagrad.step();
  const Index r = t.rows[0];
  double square = 0;
  for (Index j = 0; j < kD; ++j) square += static_cast<double>(t.grad_rows(0, j)) * t.grad_rows(0, j);
  const double denominator = std::sqrt(square / kD) + 1e-8;
  for (Index j = 0; j < kD; ++j) {
    const double expected = before(r, j) - 1e-2 * t.grad_rows(0, j) / denominator;
    if (std::abs(t.p->value()(r, j) - expected) > 1e-6)
      bench_support::fail(kProgram, "RowWiseAdagrad first step differs from lr g / (sqrt(mean g^2) + eps)");
  }
  Index untouched = 0;
  while (std::binary_search(t.rows.begin(), t.rows.end(), untouched)) ++untouched;
  if (t.p->value().row(untouched) != before.row(untouched))
    bench_support::fail(kProgram, "RowWiseAdagrad moved an untouched row");
}

// Writes 256 MiB, so that nothing of a step's data is left in the caches.
void flush_caches() {
  static std::vector<float> buffer(64 << 20);
  for (float& x : buffer) x += 1.0f;
  benchmark::DoNotOptimize(buffer.data());
  benchmark::ClobberMemory();
}

template <typename Optimizer>
void run_step(benchmark::State& state, Optimizer& optimizer, Table& table, double rows_visited, double bytes_per_step,
              double state_floats, bool cold = false) {
  table.set_gradient();
  optimizer.step();  // first step allocates the state
  for (auto _ : state) {
    if (cold) {
      state.PauseTiming();
      flush_caches();
      state.ResumeTiming();
    }
    optimizer.step();  // the same gradient each time: the cost does not depend on its values
    benchmark::ClobberMemory();
  }
  state.counters["rows_per_s"] = benchmark::Counter(rows_visited * static_cast<double>(state.iterations()),
                                                    benchmark::Counter::kIsRate);
  state.counters["GB/s"] = benchmark::Counter(bytes_per_step * static_cast<double>(state.iterations()) * 1e-9,
                                              benchmark::Counter::kIsRate);
  state.counters["state_MiB"] = state_floats * sizeof(float) / (1024.0 * 1024.0);
}

constexpr double kRowBytes = kD * sizeof(float);

void BM_LazyAdamStep(benchmark::State& state) {
  Table table(state.range(0));
  embedhead::LazyAdam<float> adam(embedhead::LazyAdam<float>::lazy_defaults(), {table.p});
  const double V = static_cast<double>(state.range(0));
  run_step(state, adam, table, kTouched, kTouched * kRowBytes * 7, 2 * V * kD);  // g; p, m, v read + written
}

void BM_AdagradStep(benchmark::State& state) {
  Table table(state.range(0));
  embedhead::Adagrad<float> adagrad(embedhead::AdagradOptions{}, {table.p});
  const double V = static_cast<double>(state.range(0));
  run_step(state, adagrad, table, kTouched, kTouched * kRowBytes * 5, V * kD);  // g; p, G read + written
}

void BM_RowWiseAdagradStep(benchmark::State& state) {
  Table table(state.range(0));
  embedhead::RowWiseAdagrad<float> adagrad({}, {table.p});
  const double V = static_cast<double>(state.range(0));
  run_step(state, adagrad, table, kTouched, kTouched * kRowBytes * 3, V);  // g; p read + written (G: 1 float a row)
}

void BM_SGDStep(benchmark::State& state) {
  Table table(state.range(0));
  embedhead::SGD<float> sgd(embedhead::SGDOptions{}, {table.p});
  run_step(state, sgd, table, kTouched, kTouched * kRowBytes * 3, 0);  // g; p read + written
}

void BM_AdamWStep(benchmark::State& state) {
  const Index V = state.range(0);
  Table table(V);
  embedhead::AdamW<float> adam(embedhead::AdamOptions{}, {table.p});
  run_step(state, adam, table, static_cast<double>(V), static_cast<double>(V) * kRowBytes * 6 + kTouched * kRowBytes,
           2.0 * static_cast<double>(V) * kD, state.range(1) != 0);
}

// The table's touched rows made its trainable rows: AdamW's state and step cover those k rows.
void BM_AdamWStepTrainableRows(benchmark::State& state) {
  Table table(state.range(0));
  table.p->set_trainable_rows(table.rows);
  embedhead::AdamW<float> adam(embedhead::AdamOptions{}, {table.p});
  run_step(state, adam, table, kTouched, kTouched * kRowBytes * 7, 2.0 * kTouched * kD,  // g; p, m, v read + written
           state.range(1) != 0);
}

// The floor for that layout: the same AdamW arithmetic written as a bare loop over the same
// 2,000 scattered rows of the V-row table, with [k, d] moments and the gradient rows of the
// RowGradient -- no optimizer, no bookkeeping. AdamWStepTrainableRows / this = what the library
// adds over the memory traffic of updating k rows in place at V.
void BM_AdamWRowsInPlace(benchmark::State& state) {
  Table table(state.range(0));
  table.set_gradient();
  const bool cold = state.range(1) != 0;
  RowMatrix<float> m = RowMatrix<float>::Zero(kTouched, kD), v = RowMatrix<float>::Zero(kTouched, kD);
  const embedhead::RowGradient<float>& g = table.p->grad();
  const float b1 = 0.9f, b2 = 0.999f, decay = 1.0f - 1e-3f * 0.01f;
  std::int64_t t = 0;
  auto step = [&] {
    ++t;
    const float step_size = static_cast<float>(1e-3 / (1.0 - std::pow(0.9, static_cast<double>(t))));
    const float bias2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(0.999, static_cast<double>(t))));
    using Row = Eigen::Map<Eigen::Array<float, 1, Eigen::Dynamic>>;
    for (Index i = 0; i < kTouched; ++i) {
      Row x(table.p->value().data() + table.rows[static_cast<std::size_t>(i)] * kD, kD);
      const Eigen::Map<const Eigen::Array<float, 1, Eigen::Dynamic>> grad(g.touched_row(i).data(), kD);
      Row mi(m.data() + i * kD, kD), vi(v.data() + i * kD, kD);
      mi = b1 * mi + (1.0f - b1) * grad;
      vi = b2 * vi + (1.0f - b2) * grad.square();
      x = x * decay - step_size * mi / (vi.sqrt() / bias2_sqrt + 1e-8f);
    }
  };
  step();
  for (auto _ : state) {
    if (cold) {
      state.PauseTiming();
      flush_caches();
      state.ResumeTiming();
    }
    step();
    benchmark::ClobberMemory();
  }
  state.counters["rows_per_s"] = benchmark::Counter(kTouched * static_cast<double>(state.iterations()),
                                                    benchmark::Counter::kIsRate);
  state.counters["GB/s"] = benchmark::Counter(kTouched * kRowBytes * 7 * static_cast<double>(state.iterations()) * 1e-9,
                                              benchmark::Counter::kIsRate);
  state.counters["state_MiB"] = 2.0 * kTouched * kD * sizeof(float) / (1024.0 * 1024.0);
}

void register_benchmarks() {
  check_lazy_adam();
  check_rowwise_adagrad();
  for (const std::int64_t V : {32768, 50257, 131072, 262144}) {
    benchmark::RegisterBenchmark("LazyAdamStep", BM_LazyAdamStep)->Arg(V)->ArgName("V")->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark("AdagradStep", BM_AdagradStep)->Arg(V)->ArgName("V")->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark("RowWiseAdagradStep", BM_RowWiseAdagradStep)
        ->Arg(V)
        ->ArgName("V")
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark("SGDStep", BM_SGDStep)->Arg(V)->ArgName("V")->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark("AdamWStep", BM_AdamWStep)
        ->Args({V, 0})
        ->ArgNames({"V", "cold"})
        ->Unit(benchmark::kMillisecond);
    for (const std::int64_t cold : {0, 1})
      benchmark::RegisterBenchmark("AdamWStepTrainableRows", BM_AdamWStepTrainableRows)
          ->Args({V, cold})
          ->ArgNames({"V", "cold"})
          ->Unit(benchmark::kMicrosecond);
  }
  for (const std::int64_t V : {32768, 262144})
    for (const std::int64_t cold : {0, 1})
      benchmark::RegisterBenchmark("AdamWRowsInPlace", BM_AdamWRowsInPlace)
          ->Args({V, cold})
          ->ArgNames({"V", "cold"})
          ->Unit(benchmark::kMicrosecond);
  // The cost of the k = 2,000 rows alone: a table of just those rows, every one touched.
  for (const std::int64_t cold : {0, 1})
    benchmark::RegisterBenchmark("AdamWStep", BM_AdamWStep)
        ->Args({kTouched, cold})
        ->ArgNames({"V", "cold"})
        ->Unit(benchmark::kMicrosecond);
}

}  // namespace

int main(int argc, char** argv) { return bench_support::run_benchmarks(argc, argv, register_benchmarks); }
