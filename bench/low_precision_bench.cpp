// Low-precision tables at GPT-2 shape (V = 50257, d = 768), each beside its float baseline:
//
//   Lookup/float   TokenEmbedding<float>::forward, N = 8192 ids: N rows of d floats copied
//   Lookup/bf16    LowPrecisionEmbedding<bfloat16>::forward: N rows of d bf16 read, widened to float
//   Lookup/fp16    the same with Eigen::half
//   Lookup/int8    QuantizedEmbedding::forward: N rows of d int8 read, times the row's scale
//   Memcpy         one contiguous memcpy of the same N*d floats the lookups write
//   Head/float     OutputProjection<float>::forward, h [1024, d] -> logits [1024, V] = h W^T + b
//   Head/bf16      LowPrecisionOutputProjection<bfloat16>::forward: W converted 256 rows at a time
//                  into a float tile, one float GEMM per tile
//   Head/fp16      the same with Eigen::half
//   EigenBf16Gemm  Eigen's GEMM directly on bfloat16 matrices (h and W both bf16), N = 64, beside
//                  Head/float at N = 64: the reason the head converts to float tiles instead
//
// Bytes processed for the lookups and memcpy = N*d*sizeof(float) (the output), so their rates
// compare directly; the table bytes read differ (4, 2, 2 and 1 per value). The heads report FLOPS
// (2 N V d, multiply-adds as 2 flops). Single-threaded: built without OpenMP.
// Every kernel is checked once against a reference before it is timed.

// GCC 12 also reports a false -Wuninitialized (bug 105593 again, the undefined operand of
// _mm512_cvtepu16_epi32) in Eigen's AVX-512 bf16 reduction, which only BM_EigenBf16Gemm's plain
// bf16 product instantiates; like bench_support.hpp's pragma it must precede the intrinsic headers.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

// bench_support.hpp comes first, before any other include: it sets the pragma that silences
// GCC bug 105593's false -Wmaybe-uninitialized, which must precede the intrinsic headers.
#include "bench_support.hpp"

#include <embedhead/embedhead.hpp>

#include "gbench_main.hpp"

#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace {

using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::Parameter;
using embedhead::RowMatrix;
using bench_support::fail;
using bench_support::fill_uniform;
using bench_support::number;
using bench_support::random_ids;

constexpr char kProgram[] = "low_precision_bench";
constexpr Index kVocab = 50257, kDim = 768, kLookupTokens = 8192, kHeadTokens = 1024, kBf16GemmTokens = 64;

// The float table E [V, d], uniform in [-1, 1), built once (38.6 M values).
const std::shared_ptr<Parameter<float>>& float_table() {
  static const std::shared_ptr<Parameter<float>> table = [] {
    auto p = std::make_shared<Parameter<float>>(kVocab, kDim, "E");
    fill_uniform(p->value(), 1);
    return p;
  }();
  return table;
}
const Eigen::Map<const RowMatrix<float>> E() { return static_cast<const Parameter<float>&>(*float_table()).value(); }

template <typename Storage>
const RowMatrix<Storage>& low_table() {
  static const RowMatrix<Storage> table = embedhead::convert_table<Storage>(E());
  return table;
}

const IdMatrix<std::int32_t>& ids() {
  static const IdMatrix<std::int32_t> value = random_ids(kLookupTokens, kVocab, 42);
  return value;
}

void set_lookup_counters(benchmark::State& state) {
  state.SetItemsProcessed(state.iterations() * kLookupTokens);
  state.SetBytesProcessed(state.iterations() * kLookupTokens * kDim * static_cast<Index>(sizeof(float)));
}

template <typename Layer>
void time_lookup(benchmark::State& state, const Layer& layer, RowMatrix<float>& out) {
  for (auto _ : state) {
    layer.forward(ids(), out);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  set_lookup_counters(state);
}

void BM_LookupFloat(benchmark::State& state) {
  const embedhead::TokenEmbedding<float> layer(float_table());
  RowMatrix<float> out(kLookupTokens, kDim);
  layer.forward(ids(), out);
  for (Index n = 0; n < kLookupTokens; ++n)
    if (out.row(n) != E().row(ids()(0, n)))
      fail(kProgram, "Lookup/float: row " + std::to_string(n) + " differs from E[id]");
  time_lookup(state, layer, out);
}

template <typename Storage>
void BM_LookupLow(benchmark::State& state) {
  const embedhead::LowPrecisionEmbedding<Storage> layer(low_table<Storage>());
  RowMatrix<float> out(kLookupTokens, kDim);
  layer.forward(ids(), out);
  // Exact: every output is a widened table value. Also within half a unit of E's rounding.
  for (Index n = 0; n < kLookupTokens; ++n) {
    const Index v = ids()(0, n);
    if (out.row(n) != low_table<Storage>().row(v).template cast<float>())
      fail(kProgram, "Lookup/low: row " + std::to_string(n) + " differs from float(E_low[" + std::to_string(v) + "])");
    if (!out.row(n).isApprox(E().row(v), 1e-2f))
      fail(kProgram, "Lookup/low: row " + std::to_string(n) + " is not E[" + std::to_string(v) + "] rounded");
  }
  time_lookup(state, layer, out);
}

void BM_LookupInt8(benchmark::State& state) {
  static const embedhead::QuantizedEmbedding table(E());
  RowMatrix<float> out(kLookupTokens, kDim);
  table.forward(ids(), out);
  for (Index n = 0; n < kLookupTokens; ++n) {
    const Index v = ids()(0, n);
    const float scale = table.scales()(v, 0);
    for (Index j = 0; j < kDim; ++j)
      if (!(std::abs(out(n, j) - E()(v, j)) <= scale / 2 * 1.0001f + 1e-6f))
        fail(kProgram, "Lookup/int8: out(" + std::to_string(n) + ", " + std::to_string(j) + ") = " + number(out(n, j)) +
                           " is more than scale/2 from E = " + number(E()(v, j)));
  }
  time_lookup(state, table, out);
}

void BM_Memcpy(benchmark::State& state) {
  const RowMatrix<float> gathered = embedhead::TokenEmbedding<float>(float_table()).forward(ids());
  RowMatrix<float> copy(kLookupTokens, kDim);
  const std::size_t bytes = static_cast<std::size_t>(kLookupTokens * kDim) * sizeof(float);
  std::memcpy(copy.data(), gathered.data(), bytes);
  if (copy != gathered) fail(kProgram, "Memcpy: copy differs");
  for (auto _ : state) {
    std::memcpy(copy.data(), gathered.data(), bytes);
    benchmark::DoNotOptimize(copy.data());
    benchmark::ClobberMemory();
  }
  set_lookup_counters(state);
}

// ---- head ----

const RowMatrix<float>& hidden() {
  static const RowMatrix<float> h = [] {
    RowMatrix<float> m(kHeadTokens, kDim);
    fill_uniform(m, 7);
    return m;
  }();
  return h;
}
const RowMatrix<float>& bias() {
  static const RowMatrix<float> b = [] {
    RowMatrix<float> m(kVocab, 1);
    fill_uniform(m, 11, 0.1);
    return m;
  }();
  return b;
}

// logits(n, v) against the dot product in double over W_float (the float, or widened, weights):
// tolerance 16 * 2^-24 * sum |terms|, as in output_projection_bench.cpp.
template <typename WeightAt>
void check_logits(const RowMatrix<float>& logits, const WeightAt& W, const std::string& what) {
  const std::pair<Index, Index> probes[] = {{0, 0},
                                            {0, kVocab - 1},
                                            {kHeadTokens - 1, 0},
                                            {kHeadTokens - 1, kVocab - 1},
                                            {kHeadTokens / 3, kVocab / 2},
                                            {kHeadTokens / 2, 255},
                                            {5, 256}};
  for (const auto& [n, v] : probes) {
    double exact = bias()(v, 0), magnitude = std::abs(bias()(v, 0));
    for (Index k = 0; k < kDim; ++k) {
      const double term = static_cast<double>(hidden()(n, k)) * W(v, k);
      exact += term;
      magnitude += std::abs(term);
    }
    const double tolerance = 16 * std::ldexp(1.0, -24) * magnitude + 1e-30;
    if (!(std::abs(logits(n, v) - exact) <= tolerance))
      fail(kProgram, what + ": logits(" + std::to_string(n) + ", " + std::to_string(v) + ") = " + number(logits(n, v)) +
                         ", expected " + number(exact));
  }
}

void set_head_counters(benchmark::State& state, Index N) {
  state.counters["FLOPS"] = benchmark::Counter(2.0 * static_cast<double>(N) * kVocab * kDim,
                                               benchmark::Counter::kIsIterationInvariantRate);
}

// N = 1024, or 64 to compare with EigenBf16Gemm at the same shape.
void BM_HeadFloat(benchmark::State& state, Index N) {
  auto b = std::make_shared<Parameter<float>>(kVocab, 1, "b");
  b->value() = bias();
  const embedhead::OutputProjection<float> head(float_table(), b);
  const RowMatrix<float> h = hidden().topRows(N);
  RowMatrix<float> logits(N, kVocab);
  head.forward(h, logits);
  if (N == kHeadTokens)
    check_logits(
        logits, [](Index v, Index k) { return static_cast<double>(E()(v, k)); }, "Head/float");
  else if (logits.topRows(N) != head.forward(hidden()).topRows(N))
    fail(kProgram, "Head/float: N = " + std::to_string(N) + " rows differ from the first rows at N = 1024");
  for (auto _ : state) {
    head.forward(h, logits);
    benchmark::DoNotOptimize(logits.data());
    benchmark::ClobberMemory();
  }
  set_head_counters(state, N);
}

template <typename Storage>
void BM_HeadLow(benchmark::State& state) {
  embedhead::LowPrecisionOutputProjection<Storage> head(low_table<Storage>(), bias());
  RowMatrix<float> logits(kHeadTokens, kVocab);
  head.forward(hidden(), logits);
  check_logits(
      logits, [](Index v, Index k) { return static_cast<double>(low_table<Storage>()(v, k)); }, "Head/low");
  for (auto _ : state) {
    head.forward(hidden(), logits);
    benchmark::DoNotOptimize(logits.data());
    benchmark::ClobberMemory();
  }
  set_head_counters(state, kHeadTokens);
}

void BM_EigenBf16Gemm(benchmark::State& state) {
  const RowMatrix<Eigen::bfloat16> h = hidden().topRows(kBf16GemmTokens).cast<Eigen::bfloat16>();
  const RowMatrix<Eigen::bfloat16>& W = low_table<Eigen::bfloat16>();
  RowMatrix<Eigen::bfloat16> logits(kBf16GemmTokens, kVocab);
  logits.noalias() = h * W.transpose();
  // Loose check (bf16 accumulation): one entry against float.
  const float expected = h.row(3).cast<float>().dot(W.row(1000).cast<float>());
  if (!(std::abs(static_cast<float>(logits(3, 1000)) - expected) <= 0.05f * (1 + std::abs(expected))))
    fail(kProgram, "EigenBf16Gemm: logits(3, 1000) = " + number(static_cast<float>(logits(3, 1000))) + ", expected " +
                       number(expected));
  for (auto _ : state) {
    logits.noalias() = h * W.transpose();
    benchmark::DoNotOptimize(logits.data());
    benchmark::ClobberMemory();
  }
  set_head_counters(state, kBf16GemmTokens);
}

void register_benchmarks() {
  const auto lookup = [](const char* name, void (*fn)(benchmark::State&)) {
    benchmark::RegisterBenchmark(name, fn)->Unit(benchmark::kMicrosecond);
  };
  lookup("Lookup/float/V=50257/d=768/N=8192", BM_LookupFloat);
  lookup("Lookup/bf16/V=50257/d=768/N=8192", BM_LookupLow<Eigen::bfloat16>);
  lookup("Lookup/fp16/V=50257/d=768/N=8192", BM_LookupLow<Eigen::half>);
  lookup("Lookup/int8/V=50257/d=768/N=8192", BM_LookupInt8);
  lookup("Memcpy/d=768/N=8192", BM_Memcpy);
  const auto head = [](const char* name, void (*fn)(benchmark::State&)) {
    benchmark::RegisterBenchmark(name, fn)->Unit(benchmark::kMillisecond);
  };
  benchmark::RegisterBenchmark("Head/float/N=1024/d=768/V=50257", BM_HeadFloat, kHeadTokens)
      ->Unit(benchmark::kMillisecond);
  head("Head/bf16/N=1024/d=768/V=50257", BM_HeadLow<Eigen::bfloat16>);
  head("Head/fp16/N=1024/d=768/V=50257", BM_HeadLow<Eigen::half>);
  benchmark::RegisterBenchmark("Head/float/N=64/d=768/V=50257", BM_HeadFloat, kBf16GemmTokens)
      ->Unit(benchmark::kMillisecond);
  head("EigenBf16Gemm/N=64/d=768/V=50257", BM_EigenBf16Gemm);
}

}  // namespace

int main(int argc, char** argv) { return bench_support::run_benchmarks(argc, argv, register_benchmarks); }
