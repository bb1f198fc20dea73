// Batch invariance (issue 17's contract, docs/threading.md): on the default backend a token's
// logits and loss terms are the same bits whatever batch it is computed in and whichever path
// computes them -- the decode path (N <= 8), the batched head (N > 8), the vocabulary-parallel
// head on one rank, and the fused head loss in either plan. Every row of every sub-batch (N = 1,
// 2, 7, 8, 9, 64, 1024 at several offsets) is compared byte for byte with the same token computed
// alone. On the Eigen and CBLAS backends nothing of this is promised (their GEMMs' orders depend
// on the shapes), so the test cases pass without checking there.
#include <embedhead/embedhead.hpp>
#include <embedhead/parallel/communicator.hpp>
#include <embedhead/parallel/vocab_parallel_output_projection.hpp>

#include "reference/test_support.hpp"

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::RowMatrix;

namespace {

constexpr bool kPackedDefault =
    std::is_same_v<embedhead::detail::gemm::DefaultBackend, embedhead::detail::gemm::PackedBackend>;

template <typename A, typename B>
bool same_bytes(const A& a, const B& b) {
  if (a.rows() != b.rows() || a.cols() != b.cols()) return false;
  for (Index r = 0; r < a.rows(); ++r)
    for (Index c = 0; c < a.cols(); ++c) {
      const auto x = a(r, c), y = b(r, c);
      if (std::memcmp(&x, &y, sizeof x) != 0) return false;
    }
  return true;
}

const Index kSizes[] = {1, 2, 7, 8, 9, 64, 1024};

// Offsets of a sub-batch of `rows` rows in a batch of `total`: the start, the end and two inside.
std::vector<Index> offsets(Index rows, Index total) {
  std::vector<Index> out{0, total - rows};
  if (total - rows >= 3) out.push_back((total - rows) / 3), out.push_back(1);
  return out;
}

// The rows of a sub-batch of N rows compared with the tokens alone: all of them up to 64, else 40
// spread over the batch (first and last included), so the references stay cheap in a sanitizer build.
std::vector<Index> checked_rows(Index N) {
  std::vector<Index> rows;
  const Index step = N <= 64 ? 1 : (N - 1) / 39;
  for (Index r = 0; r < N; r += step) rows.push_back(r);
  if (rows.back() != N - 1) rows.push_back(N - 1);
  return rows;
}

// A token's result alone, computed on first use and kept.
template <typename Row, typename Compute>
const Row& alone_row(std::map<Index, Row>& cache, Index n, const Compute& compute) {
  auto it = cache.find(n);
  if (it == cache.end()) it = cache.emplace(n, compute(n)).first;
  return it->second;
}

}  // namespace

TEMPLATE_TEST_CASE("batch invariance: a token's logits are the same bits alone, in any batch, on every path",
                   "[batch_invariance]", float, double) {
  using Scalar = TestType;
  if (!kPackedDefault) {
    SUCCEED("the logits' batch invariance is promised on the packed backend only");
    return;
  }
  // V not a multiple of any lane count, d across two depth blocks with a tail.
  const Index V = 600, d = 260, total = 1024;
  const RowMatrix<Scalar> h = test_support::random_matrix<Scalar>(total, d, 71);
  embedhead::OutputProjection<Scalar> head(V, d);
  head.weight().value() = test_support::random_matrix<Scalar>(V, d, 72, 0.1);
  head.bias()->value() = test_support::random_matrix<Scalar>(V, 1, 73);
  const auto W = static_cast<const embedhead::Parameter<Scalar>&>(head.weight()).value();
  const auto b = static_cast<const embedhead::Parameter<Scalar>&>(*head.bias()).value();

  // Each token alone, through the decode path.
  std::map<Index, RowMatrix<Scalar>> cache;
  const auto alone = [&](Index n) -> const RowMatrix<Scalar>& {
    return alone_row(cache, n, [&](Index m) {
      RowMatrix<Scalar> row(1, V);
      embedhead::output_projection_decode<Scalar>(h.row(m), W, b, row);
      return row;
    });
  };
  const auto check_rows = [&](const RowMatrix<Scalar>& batch, Index o) {
    for (const Index r : checked_rows(batch.rows())) {
      CAPTURE(r);
      CHECK(same_bytes(batch.row(r), alone(o + r)));
    }
  };
  for (const Index N : kSizes)
    for (const Index o : offsets(N, total)) {
      CAPTURE(N, o);
      check_rows(head.forward(h.middleRows(o, N)), o);  // decode for N <= 8, else the GEMM
      RowMatrix<Scalar> free_call(N, V);
      embedhead::output_projection_forward<Scalar>(h.middleRows(o, N), W, b, free_call);
      check_rows(free_call, o);
    }

  // The vocabulary-parallel head on one rank: the same bits.
  embedhead::SingleProcessCommunicator comm;
  embedhead::OutputProjectionOptions options;
  options.bias = true;
  embedhead::VocabParallelOutputProjection<Scalar> parallel(V, d, comm, options);
  parallel.weight().value() = W;
  parallel.bias()->value() = b;
  for (const Index N : {Index{1}, Index{9}, Index{1024}}) {
    CAPTURE(N);
    check_rows(parallel.forward(h.topRows(N)), 0);
  }
}

TEMPLATE_TEST_CASE("batch invariance: the fused loss's per-token loss and lse do not depend on the batch or the plan",
                   "[batch_invariance]", float, double) {
  using Scalar = TestType;
  if (!kPackedDefault) {
    SUCCEED("the loss terms' batch invariance is promised on the packed backend only");
    return;
  }
  const Index V = 600, d = 260, total = 1024;
  const RowMatrix<Scalar> h = test_support::random_matrix<Scalar>(total, d, 81);
  const RowMatrix<Scalar> W = test_support::random_matrix<Scalar>(V, d, 82, 0.1);
  const RowMatrix<Scalar> bias = test_support::random_matrix<Scalar>(V, 1, 83);
  const IdMatrix<std::int64_t> targets = test_support::random_ids<std::int64_t>(total, 1, V, 84);

  struct Rows {
    RowMatrix<Scalar> losses, lse;
  };
  const auto run = [&](Index o, Index N, embedhead::FusedPlan plan) {
    embedhead::FusedHeadLossOptions options;
    options.plan = plan;
    options.reduction = embedhead::Reduction::none;
    Rows out{RowMatrix<Scalar>(N, 1), RowMatrix<Scalar>(N, 1)};
    embedhead::FusedHeadLossExtras<Scalar> extras{{nullptr, 0, 1}, {out.lse.data(), N, 1}, {out.losses.data(), N, 1}};
    embedhead::FusedHeadLossWorkspace<Scalar> workspace;
    embedhead::fused_head_loss<Scalar>(h.middleRows(o, N), W, bias, targets.middleRows(o, N), workspace, options,
                                       extras);
    return out;
  };
  // Each token alone (one token: both plans are the same walk).
  std::map<Index, Rows> cache;
  for (const Index N : kSizes)
    for (const Index o : offsets(N, total))
      for (const auto plan : {embedhead::FusedPlan::token_chunks, embedhead::FusedPlan::vocab_blocks}) {
        CAPTURE(N, o, static_cast<int>(plan));
        const Rows got = run(o, N, plan);
        for (const Index r : checked_rows(N)) {
          CAPTURE(r);
          const Rows& one = alone_row(cache, o + r,
                                      [&](Index n) { return run(n, 1, embedhead::FusedPlan::token_chunks); });
          CHECK(same_bytes(got.losses.row(r), one.losses));
          CHECK(same_bytes(got.lse.row(r), one.lse));
        }
      }
}
