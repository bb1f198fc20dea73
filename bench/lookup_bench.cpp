// Token embedding forward (a row gather) beside its two baselines, in one binary so ratios hold:
//
//   OneHotGemm  out = one_hot(ids) [N, V] * E [V, d]: the textbook formula, N*V*d multiply-adds.
//               The one-hot matrix is built once, outside the loop; only the GEMM is timed.
//   Lookup      TokenEmbedding::forward: N rows of d floats copied, O(N*d), independent of V.
//   Memcpy      one contiguous std::memcpy of the same N*d floats (the rows already gathered in
//               order): the floor for any gather of that many bytes.
//
// Shapes: V in {1000, 32000, 50257}, d in {64, 768, 4096}; N = 64 tokens for the one-hot
// comparison (the V = 50257, d = 4096 GEMM is 13 G multiply-adds per call), N = 8192 tokens
// (GPT-2's 8 x 1024 batch) for the lookup-vs-memcpy comparison. Ids are uniform over [0, V).
//
// Bytes processed = N*d*sizeof(float) (the embeddings produced) for all three, so their
// bytes_per_second are directly comparable; items = tokens. OneHotGemm also reports FLOPS.
// Single-threaded: built without OpenMP, so Eigen's GEMM runs on one thread.

// bench_support.hpp comes first, before any other include: it sets the pragma that silences
// GCC bug 105593's false -Wmaybe-uninitialized, which must precede the intrinsic headers.
#include "bench_support.hpp"

#include <embedhead/embedhead.hpp>

#include "../tests/reference/naive.hpp"
#include "gbench_main.hpp"

#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <tuple>

namespace {

using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::Parameter;
using embedhead::RowMatrix;
using embedhead::TokenEmbedding;
using bench_support::fail;
using bench_support::fill_uniform;
using bench_support::random_ids;

constexpr char kProgram[] = "lookup_bench";  // names this binary in fail() messages

// E [V, d], kept between benchmarks of the same shape (they are registered shape by shape), and
// at most one at a time: the largest is 50257 x 4096 floats = 823 MB.
std::shared_ptr<Parameter<float>> table(Index V, Index d) {
  static std::shared_ptr<Parameter<float>> cached;
  if (!cached || cached->rows() != V || cached->cols() != d) {
    cached.reset();  // free the previous table before allocating the next
    cached = std::make_shared<Parameter<float>>(V, d, "token_embedding.weight");
    fill_uniform(cached->value(), 1);
  }
  return cached;
}

// Checks that out [N, d] holds lookup(ids): a few rows (first, middle, last two) against the naive
// one-hot product, then every row against E[id] read directly. The one-hot product is exact (each
// output is 1 * E[v][j] plus zeros), so both comparisons are exact, not approximate.
void check_against_one_hot(const IdMatrix<std::int32_t>& ids, const embedhead::ConstMatrixRef<float>& E,
                           const RowMatrix<float>& out, const char* what) {
  const Index N = ids.cols();  // >= 2
  const std::string shape = ", V=" + std::to_string(E.rows()) + ", d=" + std::to_string(E.cols());
  const Index picks[] = {0, N / 2, N - 2, N - 1};
  IdMatrix<std::int32_t> some(1, 4);
  for (int i = 0; i < 4; ++i) some(0, i) = ids(0, picks[i]);
  const RowMatrix<float> one_hot = naive::one_hot<float>(some, E.rows());
  const RowMatrix<float> expected = one_hot * E;
  for (int i = 0; i < 4; ++i)
    if (out.row(picks[i]) != expected.row(i))
      fail(kProgram, std::string(what) + ": row " + std::to_string(picks[i]) + " (id " + std::to_string(some(0, i)) +
                         ") differs from one_hot(id) * E" + shape);
  for (Index n = 0; n < N; ++n)
    if (out.row(n) != E.row(ids(0, n)))
      fail(kProgram, std::string(what) + ": row " + std::to_string(n) + " differs from E[" + std::to_string(ids(0, n)) +
                         "]" + shape);
}

void set_counters(benchmark::State& state, Index N, Index d) {
  state.SetItemsProcessed(state.iterations() * N);
  state.SetBytesProcessed(state.iterations() * N * d * static_cast<Index>(sizeof(float)));
}

// args: V, d, N
void BM_Lookup(benchmark::State& state) {
  const Index V = state.range(0), d = state.range(1), N = state.range(2);
  const auto E = table(V, d);
  const TokenEmbedding<float> embedding(E);
  const IdMatrix<std::int32_t> ids = random_ids(N, V, 42);
  RowMatrix<float> out(N, d);
  embedding.forward(ids, out);
  check_against_one_hot(ids, E->value(), out, "Lookup");
  for (auto _ : state) {
    embedding.forward(ids, out);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, N, d);
}

// args: V, d, N
void BM_OneHotGemm(benchmark::State& state) {
  const Index V = state.range(0), d = state.range(1), N = state.range(2);
  const auto E = table(V, d);
  const auto E_value = static_cast<const Parameter<float>&>(*E).value();
  const IdMatrix<std::int32_t> ids = random_ids(N, V, 42);
  const RowMatrix<float> one_hot = naive::one_hot<float>(ids, V);  // [N, V], built once
  RowMatrix<float> out(N, d);
  // The full product equals the lookup exactly. Checked once per shape: at V = 50257, d = 4096
  // it costs as much as a timed iteration, and the function runs more than once per shape.
  static std::set<std::tuple<Index, Index, Index>> checked;
  if (checked.insert({V, d, N}).second) {
    out.noalias() = one_hot * E_value;
    const TokenEmbedding<float> embedding(E);
    if (embedding.forward(ids) != out)
      fail(kProgram,
           "OneHotGemm: one_hot * E differs from the lookup, V=" + std::to_string(V) + ", d=" + std::to_string(d));
  }
  for (auto _ : state) {
    out.noalias() = one_hot * E_value;
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, N, d);
  state.counters["FLOPS"] = benchmark::Counter(2.0 * static_cast<double>(N) * static_cast<double>(V) *
                                                   static_cast<double>(d),
                                               benchmark::Counter::kIsIterationInvariantRate);
}

// args: d, N. The source holds N rows already gathered in order, so this is the same bytes
// the lookup writes, moved as one contiguous block.
void BM_Memcpy(benchmark::State& state) {
  const Index d = state.range(0), N = state.range(1);
  const Index V = 50257;
  const auto E = table(V, d);
  const IdMatrix<std::int32_t> ids = random_ids(N, V, 42);
  const RowMatrix<float> gathered = TokenEmbedding<float>(E).forward(ids);
  RowMatrix<float> copy(N, d);
  const std::size_t bytes = static_cast<std::size_t>(N * d) * sizeof(float);
  std::memcpy(copy.data(), gathered.data(), bytes);  // also faults in the destination pages
  check_against_one_hot(ids, E->value(), copy, "Memcpy");
  for (auto _ : state) {
    std::memcpy(copy.data(), gathered.data(), bytes);
    benchmark::DoNotOptimize(copy.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, N, d);
}

constexpr Index kOneHotTokens = 64;
constexpr Index kLookupTokens = 8192;

// Registered shape by shape (not family by family) so each table is built once.
void register_benchmarks() {
  for (const Index d : {64, 768, 4096}) {
    for (const Index V : {1000, 32000, 50257}) {
      benchmark::RegisterBenchmark("OneHotGemm", BM_OneHotGemm)
          ->Args({V, d, kOneHotTokens})
          ->ArgNames({"V", "d", "N"})
          ->Unit(benchmark::kMicrosecond);
      for (const Index N : {kOneHotTokens, kLookupTokens})
        benchmark::RegisterBenchmark("Lookup", BM_Lookup)
            ->Args({V, d, N})
            ->ArgNames({"V", "d", "N"})
            ->Unit(benchmark::kMicrosecond);
    }
    benchmark::RegisterBenchmark("Memcpy", BM_Memcpy)
        ->Args({d, kLookupTokens})
        ->ArgNames({"d", "N"})
        ->Unit(benchmark::kMicrosecond);
  }
}

}  // namespace

int main(int argc, char** argv) { return bench_support::run_benchmarks(argc, argv, register_benchmarks); }
