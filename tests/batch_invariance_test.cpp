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

}  // namespace

TEMPLATE_TEST_CASE("batch invariance: a token's logits are the same bits alone, in any batch, on every path",
                   "[batch_invariance]", float, double) {
  using Scalar = TestType;
  if (!kPackedDefault) {
    SUCCEED("the logits' batch invariance is promised on the packed backend only");
    return;
  }
  // V not a multiple of any lane count, d across two depth blocks with a tail.
  const Index V = 1500, d = 300, total = 1024;
  const RowMatrix<Scalar> h = test_support::random_matrix<Scalar>(total, d, 71);
  embedhead::OutputProjection<Scalar> head(V, d);
  head.weight().value() = test_support::random_matrix<Scalar>(V, d, 72, 0.1);
  head.bias()->value() = test_support::random_matrix<Scalar>(V, 1, 73);
  const auto W = static_cast<const embedhead::Parameter<Scalar>&>(head.weight()).value();
  const auto b = static_cast<const embedhead::Parameter<Scalar>&>(*head.bias()).value();

  // Each token alone, through the decode path.
  RowMatrix<Scalar> alone(total, V);
  for (Index n = 0; n < total; ++n) {
    RowMatrix<Scalar> row(1, V);
    embedhead::output_projection_decode<Scalar>(h.row(n), W, b, row);
    alone.row(n) = row;
  }
  for (const Index N : kSizes)
    for (const Index o : offsets(N, total)) {
      CAPTURE(N, o);
      const RowMatrix<Scalar> batch = head.forward(h.middleRows(o, N));  // decode for N <= 8, else the GEMM
      CHECK(same_bytes(batch, alone.middleRows(o, N)));
      RowMatrix<Scalar> free_call(N, V);
      embedhead::output_projection_forward<Scalar>(h.middleRows(o, N), W, b, free_call);
      CHECK(same_bytes(free_call, alone.middleRows(o, N)));
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
    CHECK(same_bytes(parallel.forward(h.topRows(N)), alone.topRows(N)));
  }
}

TEMPLATE_TEST_CASE("batch invariance: the fused loss's per-token loss and lse do not depend on the batch or the plan",
                   "[batch_invariance]", float, double) {
  using Scalar = TestType;
  if (!kPackedDefault) {
    SUCCEED("the loss terms' batch invariance is promised on the packed backend only");
    return;
  }
  const Index V = 1500, d = 300, total = 1024;
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
  RowMatrix<Scalar> losses(total, 1), lse(total, 1);
  for (Index n = 0; n < total; ++n) {
    const Rows one = run(n, 1, embedhead::FusedPlan::token_chunks);
    losses(n, 0) = one.losses(0, 0);
    lse(n, 0) = one.lse(0, 0);
  }
  for (const Index N : kSizes)
    for (const Index o : offsets(N, total))
      for (const auto plan : {embedhead::FusedPlan::token_chunks, embedhead::FusedPlan::vocab_blocks}) {
        CAPTURE(N, o, static_cast<int>(plan));
        const Rows got = run(o, N, plan);
        CHECK(same_bytes(got.losses, losses.middleRows(o, N)));
        CHECK(same_bytes(got.lse, lse.middleRows(o, N)));
      }
}
