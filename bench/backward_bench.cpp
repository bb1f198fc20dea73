// Token embedding backward: the row-sparse gradient against the dense V x d one.
//
//   Sparse  TokenEmbedding::zero_grad() + TokenEmbedding::backward(ids, dout): the real per-step
//           cost. Sorts the N ids, adds each token's dout row into a compact [k, d] block of the
//           k touched rows. O(N log N + N*d); memory k*d floats.
//   Dense   what a dense framework does (PyTorch's CPU embedding backward without sparse=True):
//           zero a [V, d] gradient, then scatter-add dE[ids_n] += dout[n]. The add is an Eigen
//           row expression, vectorised like the library's, so the gap is the O(V*d) zeroing and
//           the V*d*4 bytes, not a slower inner loop. The matrix is allocated once, outside the
//           loop.
//
// Shapes: GPT-2 (V = 50257, d = 768) with N = 8192 (8 x 1024) and N = 512 tokens; Gemma 2B
// (V = 256000, d = 2048) with N = 512 (its dense gradient is 2.1 GB). Ids are uniform over
// [0, V); real text repeats tokens more, so it touches fewer rows than this.
//
// Counters: items = tokens; bytes = N*d*4 (dout read); grad_bytes = bytes the gradient holds
// (k*d*4 sparse, V*d*4 dense); touched_rows = k. Single-threaded (Eigen without OpenMP).

// bench_support.hpp comes first, before any other include: it sets the pragma that silences
// GCC bug 105593's false -Wmaybe-uninitialized, which must precede the intrinsic headers.
#include "bench_support.hpp"

#include <embedhead/embedhead.hpp>

#include "../tests/reference/naive.hpp"
#include "gbench_main.hpp"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

namespace {

using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::Parameter;
using embedhead::RowMatrix;
using embedhead::TokenEmbedding;
using bench_support::fail;
using bench_support::fill_uniform;
using bench_support::random_ids;

constexpr char kProgram[] = "backward_bench";  // names this binary in fail() messages

// The inputs of one shape: ids [1, N], dout [N, d], and the expected gradient of the touched
// rows. The expectation is naive::embedding_backward_dense run on the ids relabelled to
// 0 .. k-1 (their rank among the distinct ids): the same additions in the same token order as
// over the full vocabulary, so the sums are bit-identical, but in k*d floats instead of V*d.
struct Problem {
  Index V, d;
  IdMatrix<std::int32_t> ids;
  RowMatrix<float> dout;
  std::vector<Index> distinct_ids;  // sorted
  RowMatrix<float> expected_rows;   // row u: expected dE[distinct_ids[u]]
};

Problem make_problem(Index V, Index d, Index N) {
  Problem p{V, d, random_ids(N, V, 7), RowMatrix<float>(N, d), {}, {}};
  fill_uniform(p.dout, 3);
  p.distinct_ids.assign(p.ids.data(), p.ids.data() + N);
  std::sort(p.distinct_ids.begin(), p.distinct_ids.end());
  p.distinct_ids.erase(std::unique(p.distinct_ids.begin(), p.distinct_ids.end()), p.distinct_ids.end());
  IdMatrix<std::int32_t> relabelled(1, N);
  for (Index n = 0; n < N; ++n)
    relabelled(0, n) = static_cast<std::int32_t>(
        std::lower_bound(p.distinct_ids.begin(), p.distinct_ids.end(), Index{p.ids(0, n)}) - p.distinct_ids.begin());
  const Index k = static_cast<Index>(p.distinct_ids.size());
  p.expected_rows = RowMatrix<float>::Zero(k, d);
  naive::embedding_backward_dense(relabelled, p.dout, 1.0f, -1, p.expected_rows);
  return p;
}

std::string shape(const Problem& p) {
  return "V=" + std::to_string(p.V) + ", d=" + std::to_string(p.d) + ", N=" + std::to_string(p.ids.cols());
}

void check_sparse(const Problem& p, const embedhead::RowGradient<float>& grad) {
  if (grad.is_dense()) fail(kProgram, "sparse backward switched the gradient to dense mode, " + shape(p));
  if (grad.touched_rows() != p.distinct_ids)
    fail(kProgram, "sparse backward touched rows differ from the distinct ids, " + shape(p));
  for (Index u = 0; u < grad.num_touched(); ++u)
    if (grad.touched_row(u) != p.expected_rows.row(u))
      fail(kProgram, "sparse gradient row " + std::to_string(p.distinct_ids[static_cast<std::size_t>(u)]) +
                         " differs from the naive scatter, " + shape(p));
}

void check_dense(const Problem& p, const RowMatrix<float>& dE) {
  std::size_t u = 0;
  for (Index v = 0; v < p.V; ++v) {
    const bool touched = u < p.distinct_ids.size() && p.distinct_ids[u] == v;
    if (touched ? dE.row(v) != p.expected_rows.row(static_cast<Index>(u)) : !dE.row(v).isZero(0))
      fail(kProgram, "dense gradient row " + std::to_string(v) + " is wrong, " + shape(p));
    if (touched) ++u;
  }
}

// The competitor: a dense [V, d] gradient, zeroed and scatter-added every step.
void dense_backward(const IdMatrix<std::int32_t>& ids, const RowMatrix<float>& dout, RowMatrix<float>& dE) {
  dE.setZero();
  for (Index n = 0; n < ids.cols(); ++n) dE.row(ids(0, n)) += dout.row(n);
}

void set_counters(benchmark::State& state, const Problem& p, Index gradient_rows) {
  const Index N = p.ids.cols();
  state.SetItemsProcessed(state.iterations() * N);
  state.SetBytesProcessed(state.iterations() * N * p.d * static_cast<Index>(sizeof(float)));
  state.counters["grad_bytes"] = benchmark::Counter(static_cast<double>(gradient_rows * p.d) * sizeof(float),
                                                    benchmark::Counter::kDefaults, benchmark::Counter::kIs1024);
  state.counters["touched_rows"] = static_cast<double>(p.distinct_ids.size());
}

// Each shape's correctness check runs once, not on every call of the benchmark function.
bool first_time(const char* which, const Problem& p) {
  static std::set<std::tuple<std::string, Index, Index, Index>> done;
  return done.insert({which, p.V, p.d, p.ids.cols()}).second;
}

// args: V, d, N
void BM_SparseBackward(benchmark::State& state) {
  const Problem p = make_problem(state.range(0), state.range(1), state.range(2));
  // The table's values are not read by the backward; zeros keep the setup fast.
  TokenEmbedding<float> embedding(std::make_shared<Parameter<float>>(p.V, p.d, "token_embedding.weight"));
  const auto& grad = embedding.weight().grad();
  embedding.zero_grad();
  embedding.backward(p.ids, p.dout);  // also grows the workspace and the gradient block once
  if (first_time("sparse", p)) check_sparse(p, grad);
  for (auto _ : state) {
    embedding.zero_grad();
    embedding.backward(p.ids, p.dout);
    benchmark::DoNotOptimize(grad.touched_row(0).data());
    benchmark::ClobberMemory();
  }
  set_counters(state, p, grad.num_touched());
}

// args: V, d, N
void BM_DenseBackward(benchmark::State& state) {
  const Problem p = make_problem(state.range(0), state.range(1), state.range(2));
  RowMatrix<float> dE(p.V, p.d);  // allocated once; zeroed inside the loop, as each step must
  dense_backward(p.ids, p.dout, dE);
  if (first_time("dense", p)) check_dense(p, dE);
  for (auto _ : state) {
    dense_backward(p.ids, p.dout, dE);
    benchmark::DoNotOptimize(dE.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, p, p.V);
}

void register_benchmarks() {
  const std::vector<std::vector<std::int64_t>> shapes = {{50257, 768, 8192}, {50257, 768, 512}, {256000, 2048, 512}};
  for (const auto& args : shapes) {
    benchmark::RegisterBenchmark("SparseBackward", BM_SparseBackward)
        ->Args(args)
        ->ArgNames({"V", "d", "N"})
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark("DenseBackward", BM_DenseBackward)
        ->Args(args)
        ->ArgNames({"V", "d", "N"})
        ->Unit(benchmark::kMicrosecond);
  }
}

}  // namespace

int main(int argc, char** argv) { return bench_support::run_benchmarks(argc, argv, register_benchmarks); }
