// Tests for the soft (probability) targets of include/embedhead/cross_entropy.hpp
// (cross_entropy_soft*, dense [N, C] and sparse SparseTargets), in PyTorch's semantics for
// probability targets: label smoothing, class weights, the three reductions (the mean divides by
// N), z-loss, soft-capping and the entropy bonus. Expected values come from naive::soft_loss (written
// from PyTorch's definition, in double), values worked by hand, central differences in double, and
// the class-index loss (a one-hot soft target is the same loss); the fused head loss against the
// unfused head + loss + head backward, in both plans.
#include <embedhead/cross_entropy.hpp>
#include <embedhead/fused_head_loss.hpp>

#include "reference/naive.hpp"
#include "reference/test_support.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

using Catch::Matchers::Contains;
using Catch::Matchers::WithinAbs;
using Catch::Matchers::WithinRel;
using embedhead::CrossEntropyOptions;
using embedhead::FusedHeadLossOptions;
using embedhead::FusedPlan;
using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::Reduction;
using embedhead::RowMatrix;
using embedhead::SparseTargets;
using test_support::first_difference;
using test_support::random_matrix;

namespace {

constexpr double kLogitSpread = 3.0;

template <typename Scalar>
double loss_tolerance() {
  return std::is_same<Scalar, float>::value ? 2e-5 : 1e-12;
}

const char* name_of(Reduction r) { return r == Reduction::mean ? "mean" : r == Reduction::sum ? "sum" : "none"; }

// Sparse targets [N, k]: row n has k distinct classes of [0, C) with random probabilities summing to
// 1 (in double, then rounded to Scalar), one entry of probability 0 when k > 2.
template <typename Scalar>
struct RandomSparse {
  IdMatrix<std::int64_t> ids;
  RowMatrix<Scalar> probs;
};

template <typename Scalar>
RandomSparse<Scalar> random_sparse(Index N, Index C, Index k, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> uniform(0.05, 1.0);
  RandomSparse<Scalar> t{IdMatrix<std::int64_t>(N, k), RowMatrix<Scalar>(N, k)};
  for (Index n = 0; n < N; ++n) {
    std::vector<std::int64_t> classes;
    for (Index c = 0; c < C; ++c) classes.push_back(c);
    std::shuffle(classes.begin(), classes.end(), rng);
    std::vector<double> w(static_cast<std::size_t>(k));
    double sum = 0;
    for (Index i = 0; i < k; ++i) sum += (w[static_cast<std::size_t>(i)] = k > 2 && i == 1 ? 0.0 : uniform(rng));
    for (Index i = 0; i < k; ++i) {
      t.ids(n, i) = classes[static_cast<std::size_t>(i)];
      t.probs(n, i) = static_cast<Scalar>(w[static_cast<std::size_t>(i)] / sum);
    }
  }
  return t;
}

// The dense [N, V] form of sparse targets (0 outside the listed classes), in double.
template <typename Scalar>
RowMatrix<double> densify(const RandomSparse<Scalar>& t, Index V) {
  RowMatrix<double> d = RowMatrix<double>::Zero(t.ids.rows(), V);
  for (Index n = 0; n < t.ids.rows(); ++n)
    for (Index i = 0; i < t.ids.cols(); ++i)
      d(n, static_cast<Index>(t.ids(n, i))) += static_cast<double>(t.probs(n, i));
  return d;
}

}  // namespace

TEST_CASE("cross_entropy_soft: hand-computed values", "[cross_entropy][soft]") {
  // Two rows of logits (ln 3, 0): p = (3/4, 1/4). Targets t = (1/2, 1/2) and (1, 0).
  //   loss_0 = -(1/2) log(3/4) - (1/2) log(1/4),  loss_1 = -log(3/4),  dz_n = p - t_n
  RowMatrix<double> logits(2, 2);
  logits << std::log(3.0), 0, std::log(3.0), 0;
  RowMatrix<double> targets(2, 2);
  targets << 0.5, 0.5, 1, 0;
  const double l0 = -std::log(0.75), l1 = -std::log(0.25);
  RowMatrix<double> dz(2, 2), losses(2, 1);
  CrossEntropyOptions o;
  auto r = embedhead::cross_entropy_soft_forward_backward<double>(logits, targets, dz, losses, o);
  CHECK(r.count == 2);
  CHECK(r.weight_sum == 2.0);
  CHECK(r.loss == Approx((0.5 * l0 + 0.5 * l1 + l0) / 2).epsilon(1e-15));
  CHECK(losses(0, 0) == Approx(0.5 * l0 + 0.5 * l1).epsilon(1e-15));
  CHECK(losses(1, 0) == Approx(l0).epsilon(1e-15));
  CHECK(dz(0, 0) == Approx(0.25 / 2).epsilon(1e-15));
  CHECK(dz(0, 1) == Approx(-0.25 / 2).epsilon(1e-15));
  CHECK(dz(1, 0) == Approx(-0.25 / 2).epsilon(1e-15));
  CHECK(dz(1, 1) == Approx(0.25 / 2).epsilon(1e-15));
  // Class weights u = (1, 3): v = u t, T = sum v. Row 0: v = (1/2, 3/2), T = 2, dz = 2 p - v = (1, -1);
  // row 1: v = (1, 0), T = 1. The mean still divides by N = 2 (not by a weight sum).
  o.class_weights = {1, 3};
  r = embedhead::cross_entropy_soft_forward_backward<double>(logits, targets, dz, losses, o);
  CHECK(r.weight_sum == 2.0);
  CHECK(losses(0, 0) == Approx(0.5 * l0 + 1.5 * l1).epsilon(1e-15));
  CHECK(losses(1, 0) == Approx(l0).epsilon(1e-15));
  CHECK(r.loss == Approx((1.5 * l0 + 1.5 * l1) / 2).epsilon(1e-15));
  CHECK(dz(0, 0) == Approx(0.5).epsilon(1e-15));
  CHECK(dz(0, 1) == Approx(-0.5).epsilon(1e-15));
  // Label smoothing eps = 1/2, C = 2: t' = t / 2 + 1/4. Row 1: t' = (3/4, 1/4), v = (3/4, 3/4), T = 3/2.
  //   loss_1 = (3/4) l0 + (3/4) l1,  dz_1 = (3/2) p - v = (3/8, -3/8)  (sum reduction: scale 1)
  o.label_smoothing = 0.5;
  o.reduction = Reduction::sum;
  r = embedhead::cross_entropy_soft_forward_backward<double>(logits, targets, dz, losses, o);
  CHECK(losses(1, 0) == Approx(0.75 * l0 + 0.75 * l1).epsilon(1e-15));
  CHECK(dz(1, 0) == Approx(0.375).epsilon(1e-15));
  CHECK(dz(1, 1) == Approx(-0.375).epsilon(1e-15));
  // Row 0: t' = (1/2, 1/2), v = (1/2, 3/2): as without smoothing.
  CHECK(losses(0, 0) == Approx(0.5 * l0 + 1.5 * l1).epsilon(1e-15));
  CHECK(r.loss == Approx(1.25 * l0 + 2.25 * l1).epsilon(1e-15));
  // The same targets as sparse pairs (row 1 lists class 1 with probability 0).
  IdMatrix<std::int32_t> ids(2, 2);
  ids << 1, 0, 0, 1;
  RowMatrix<double> probs(2, 2);
  probs << 0.5, 0.5, 1, 0;
  RowMatrix<double> dz_sparse(2, 2), losses_sparse(2, 1);
  const auto rs = embedhead::cross_entropy_soft_forward_backward<double>(logits, SparseTargets<double>{ids, probs},
                                                                         dz_sparse, losses_sparse, o);
  CHECK(rs.loss == Approx(r.loss).epsilon(1e-15));
  CHECK(first_difference(dz_sparse, dz) == "");
}

TEST_CASE("cross_entropy_soft: a one-hot target is the class-index loss", "[cross_entropy][soft]") {
  // PyTorch: probability targets equal to one_hot(y) give the class-index loss (its sum; the mean
  // differs with class weights, divided by N here and by the weight sum there).
  const Index N = 7, V = 11, C = 9;
  const RowMatrix<double> logits = random_matrix<double>(N, V, 1601, kLogitSpread);
  const IdMatrix<std::int64_t> y = test_support::random_ids<std::int64_t>(1, N, C, 1602);
  const RowMatrix<double> one_hot = naive::one_hot<double>(y, C);
  for (const bool weights : {false, true})
    for (const double eps : {0.0, 0.2}) {
      CAPTURE(weights, eps);
      CrossEntropyOptions o;
      o.reduction = Reduction::sum;
      o.valid_vocab = C;
      o.label_smoothing = eps;
      o.softcap = 2.0;
      if (weights)
        o.class_weights = test_support::class_weights(C);
      else
        o.z_loss = 1e-2, o.entropy_bonus = 0.3;  // per row, not per class weight: compared without weights
      RowMatrix<double> dz_hard(N, V), dz_soft(N, V);
      const auto hard = embedhead::cross_entropy_forward_backward<double>(logits, y, dz_hard, o);
      const auto soft = embedhead::cross_entropy_soft_forward_backward<double>(logits, one_hot, dz_soft, o);
      CHECK_THAT(soft.loss, WithinRel(hard.loss, 1e-13));
      CHECK(naive::max_relative_error(dz_soft, dz_hard, 1e-12) < 1e-12);
      if (!weights) {
        o.reduction = Reduction::mean;  // without weights both divide by N
        CHECK_THAT(embedhead::cross_entropy_soft<double>(logits, one_hot, o).loss,
                   WithinRel(embedhead::cross_entropy<double>(logits, y, o).loss, 1e-13));
      }
    }
}

TEMPLATE_TEST_CASE("cross_entropy_soft matches the naive definition with every option", "[cross_entropy][soft][naive]",
                   float, double) {
  using Scalar = TestType;
  const Index N = 10, V = 37, C = 35, k = 5;
  const RowMatrix<Scalar> logits = random_matrix<Scalar>(N, V, 1611, kLogitSpread);
  const RandomSparse<Scalar> sparse = random_sparse<Scalar>(N, C, k, 1612);
  const RowMatrix<double> dense_double = densify(sparse, C);
  const RowMatrix<Scalar> dense = dense_double.template cast<Scalar>();          // [N, C]
  const RowMatrix<Scalar> dense_v = densify(sparse, V).template cast<Scalar>();  // [N, V]
  const SparseTargets<Scalar> sparse_targets{sparse.ids, sparse.probs};
  for (Reduction reduction : {Reduction::mean, Reduction::sum, Reduction::none})
    for (double eps : {0.0, 0.15})
      for (const bool weights : {false, true})
        for (int extras = 0; extras < 2; ++extras) {
          CAPTURE(name_of(reduction), eps, weights, extras);
          CrossEntropyOptions o;
          o.reduction = reduction;
          o.label_smoothing = eps;
          o.valid_vocab = C;
          if (weights) o.class_weights = test_support::class_weights(C);
          if (extras) {
            o.z_loss = 1e-3;
            o.softcap = 2.5;
            o.gradient_scale = 0.5;
            o.entropy_bonus = -0.3;
          }
          naive::LossOptions ref;
          ref.mean = reduction == Reduction::mean;
          ref.label_smoothing = eps;
          ref.classes = C;
          if (weights) ref.class_weights = test_support::class_weights(C);
          ref.z_loss = o.z_loss;
          ref.softcap = o.softcap;
          ref.gradient_scale = o.gradient_scale;
          ref.entropy_bonus = o.entropy_bonus;
          const naive::LossResult expected = naive::soft_loss(logits.template cast<double>(), dense_double, ref);
          RowMatrix<Scalar> dz(N, V), losses(N, 1);
          const auto r = embedhead::cross_entropy_soft_forward_backward<Scalar>(logits, dense, dz, losses, o);
          CHECK(r.count == N);
          CHECK(r.weight_sum == static_cast<double>(N));
          CHECK_THAT(r.loss, WithinRel(expected.loss, loss_tolerance<Scalar>()));
          if (extras) {
            CHECK_THAT(r.entropy, WithinRel(expected.entropy, loss_tolerance<Scalar>()));
            CHECK(r.z_loss > 0);
          }
          for (Index n = 0; n < N; ++n) {
            CHECK_THAT(static_cast<double>(losses(n, 0)), WithinAbs(expected.losses[n], 4 * loss_tolerance<Scalar>()));
            for (Index j = 0; j < V; ++j) {
              CAPTURE(n, j);
              CHECK_THAT(static_cast<double>(dz(n, j)),
                         WithinAbs(expected.dlogits(n, j), 4 * loss_tolerance<Scalar>()));
            }
          }
          // The loss alone, the [N, V] form and the sparse form: the same bits.
          CHECK(embedhead::cross_entropy_soft<Scalar>(logits, dense, o).loss == r.loss);
          RowMatrix<Scalar> dz_v(N, V), dz_sparse(N, V), losses_sparse(N, 1);
          CHECK(embedhead::cross_entropy_soft_forward_backward<Scalar>(logits, dense_v, dz_v, o).loss == r.loss);
          CHECK(first_difference(dz_v, dz) == "");
          const auto rs = embedhead::cross_entropy_soft_forward_backward<Scalar>(logits, sparse_targets, dz_sparse,
                                                                                 losses_sparse, o);
          CHECK(rs.loss == r.loss);
          CHECK(first_difference(dz_sparse, dz) == "");
          CHECK(first_difference(losses_sparse, losses) == "");
          CHECK(embedhead::cross_entropy_soft<Scalar>(logits, sparse_targets, o).loss == r.loss);
          RowMatrix<Scalar> inplace = logits;  // dlogits may be logits
          embedhead::cross_entropy_soft_forward_backward<Scalar>(inplace, dense, inplace, o);
          CHECK(first_difference(inplace, dz) == "");
        }
}

TEST_CASE("cross_entropy_soft gradient check in double", "[cross_entropy][soft][gradient]") {
  RowMatrix<double> logits = random_matrix<double>(5, 9, 1621, kLogitSpread);
  const RandomSparse<double> sparse = random_sparse<double>(5, 8, 4, 1622);
  const RowMatrix<double> targets = densify(sparse, 8);
  for (Reduction reduction : {Reduction::mean, Reduction::sum})
    for (const double eps : {0.0, 0.3})
      for (const bool weights : {false, true})
        for (const bool everything : {false, true}) {
          CAPTURE(name_of(reduction), eps, weights, everything);
          CrossEntropyOptions o;
          o.reduction = reduction;
          o.valid_vocab = 8;
          o.label_smoothing = eps;
          if (weights) o.class_weights = test_support::class_weights(8);
          o.z_loss = everything ? 0.05 : 0.0;
          o.softcap = everything ? 1.7 : 0.0;
          o.entropy_bonus = everything ? 0.4 : 0.0;
          RowMatrix<double> dz(5, 9);
          embedhead::cross_entropy_soft_forward_backward<double>(logits, targets, dz, o);
          const RowMatrix<double> numeric = naive::numerical_gradient(logits, [&] {
            return embedhead::cross_entropy_soft<double>(logits, targets, o).loss;
          });
          // Central differences with a step of 1e-6 carry about 1e-16 |loss| / 1e-6 = 1e-10 of
          // rounding: 1e-5 relative of entries above 1e-4.
          CHECK(naive::max_relative_error(dz, numeric, 1e-4) < 1e-5);
          RowMatrix<double> dz_sparse(5, 9);
          embedhead::cross_entropy_soft_forward_backward<double>(logits,
                                                                 SparseTargets<double>{sparse.ids, sparse.probs},
                                                                 dz_sparse, o);
          const RowMatrix<double> numeric_sparse = naive::numerical_gradient(logits, [&] {
            return embedhead::cross_entropy_soft<double>(logits, SparseTargets<double>{sparse.ids, sparse.probs}, o)
                .loss;
          });
          CHECK(naive::max_relative_error(dz_sparse, numeric_sparse, 1e-4) < 1e-5);
        }
}

TEST_CASE("cross_entropy_soft: large logits lose nothing, masked classes of target 0 add 0", "[cross_entropy][soft]") {
  const RowMatrix<double> logits = random_matrix<double>(4, 6, 1631, kLogitSpread);
  const RandomSparse<double> sparse = random_sparse<double>(4, 6, 3, 1632);
  const RowMatrix<double> targets = densify(sparse, 6);
  CrossEntropyOptions o;
  o.label_smoothing = 0.1;
  o.class_weights = test_support::class_weights(6);
  RowMatrix<double> dz(4, 6), dz_shifted(4, 6);
  const double loss = embedhead::cross_entropy_soft_forward_backward<double>(logits, targets, dz, o).loss;
  // Softmax is shift-invariant: logits + 1e5 give the loss to about 1e5 * 1e-16 (the shift's
  // rounding of each logit), where lse - s_c of 1e5-sized values would lose more.
  const RowMatrix<double> shifted = (logits.array() + 1e5).matrix();
  CHECK_THAT(embedhead::cross_entropy_soft_forward_backward<double>(shifted, targets, dz_shifted, o).loss,
             WithinAbs(loss, 1e-10));
  CHECK(naive::max_relative_error(dz_shifted, dz, 1e-6) < 1e-9);
  // A class masked with -inf whose weighted target is 0 (no smoothing) adds nothing: the loss is
  // that of the other classes (PyTorch: 0 * -inf = NaN).
  o.label_smoothing = 0;
  o.class_weights.clear();
  RowMatrix<double> masked = logits, one_row(1, 6);
  const Index n = 0;
  Index zero = 0;
  while (targets(n, zero) != 0) ++zero;
  masked(n, zero) = -std::numeric_limits<double>::infinity();
  one_row = masked.row(n);
  RowMatrix<double> dz_masked(1, 6);
  const auto r = embedhead::cross_entropy_soft_forward_backward<double>(one_row, RowMatrix<double>(targets.row(n)),
                                                                        dz_masked, o);
  naive::LossOptions ref;
  const naive::LossResult expected = naive::soft_loss(one_row, RowMatrix<double>(targets.row(n)), ref);
  REQUIRE(std::isfinite(r.loss));
  CHECK_THAT(r.loss, WithinRel(expected.loss, 1e-14));
  CHECK(dz_masked(0, zero) == 0.0);
  CHECK(naive::max_relative_error(dz_masked, expected.dlogits, 1e-12) < 1e-13);
}

TEMPLATE_TEST_CASE("cross_entropy_soft rejects bad targets and writes nothing", "[cross_entropy][soft][errors]", float,
                   double) {
  using Scalar = TestType;
  const RowMatrix<Scalar> logits = random_matrix<Scalar>(2, 5, 1641);
  RowMatrix<Scalar> targets(2, 5);
  targets << 0.5, 0.5, 0, 0, 0, 0, 0.25, 0.25, 0.25, 0.25;
  IdMatrix<std::int32_t> ids(2, 2);
  ids << 0, 1, 2, 3;
  RowMatrix<Scalar> probs(2, 2);
  probs << 0.5, 0.5, 0.25, 0.75;
  RowMatrix<Scalar> dz = RowMatrix<Scalar>::Constant(2, 5, 7), losses = RowMatrix<Scalar>::Constant(2, 1, 7);
  CrossEntropyOptions o;
  const std::string where = "cross_entropy_soft_forward_backward: ";
  auto unchanged = [&] {
    CHECK((dz.array() == Scalar(7)).all());
    CHECK((losses.array() == Scalar(7)).all());
  };
  auto dense_fails = [&](const RowMatrix<Scalar>& t, const std::string& message) {
    CAPTURE(message);
    CHECK_THROWS_WITH(embedhead::cross_entropy_soft_forward_backward<Scalar>(logits, t, dz, losses, o),
                      where + message);
    unchanged();
  };
  auto sparse_fails = [&](const IdMatrix<std::int32_t>& i, const RowMatrix<Scalar>& p, const std::string& message) {
    CAPTURE(message);
    CHECK_THROWS_WITH(embedhead::cross_entropy_soft_forward_backward<Scalar>(logits, SparseTargets<Scalar>{i, p}, dz,
                                                                             losses, o),
                      where + message);
    unchanged();
  };
  REQUIRE_NOTHROW(embedhead::cross_entropy_soft<Scalar>(logits, targets, o));
  REQUIRE_NOTHROW(embedhead::cross_entropy_soft<Scalar>(logits, SparseTargets<Scalar>{ids, probs}, o));

  SECTION("shapes") {
    CHECK_THROWS_AS(embedhead::cross_entropy_soft<Scalar>(logits, RowMatrix<Scalar>(targets.leftCols(4)), o),
                    embedhead::shape_error);
    dense_fails(targets.leftCols(4), "targets has shape [2, 4], expected [N, C] = [2, 5]");
    dense_fails(targets.topRows(1), "targets has shape [1, 5], expected [N, C] = [2, 5]");
    o.valid_vocab = 4;
    dense_fails(targets.leftCols(3), "targets has shape [2, 3], expected [N, C] = [2, 4] or [N, V] = [2, 5]");
    o.valid_vocab = -1;
    CHECK_THROWS_AS(embedhead::cross_entropy_soft<Scalar>(logits, SparseTargets<Scalar>{ids, probs.leftCols(1)}, o),
                    embedhead::shape_error);
    sparse_fails(ids, probs.leftCols(1),
                 "sparse targets have ids [2, 2] and probs [2, 1], expected both [N, k] with N = 2");
    sparse_fails(ids.topRows(1), probs.topRows(1),
                 "sparse targets have ids [1, 2] and probs [1, 2], expected both [N, k] with N = 2");
    RowMatrix<Scalar> bad_dz = RowMatrix<Scalar>::Constant(2, 4, 7);
    CHECK_THROWS_WITH(embedhead::cross_entropy_soft_forward_backward<Scalar>(logits, targets, bad_dz, o),
                      where + "dlogits has shape [2, 4], expected [2, 5]");
    CHECK((bad_dz.array() == Scalar(7)).all());
  }
  SECTION("probabilities") {
    RowMatrix<Scalar> t = targets;
    t(1, 2) = Scalar(-0.25);
    t(1, 3) = Scalar(0.75);
    CHECK_THROWS_AS(embedhead::cross_entropy_soft<Scalar>(logits, t, o), embedhead::value_error);
    dense_fails(t, "targets(1, 2) = -0.25 outside [0, 1]");
    t = targets;
    t(0, 4) = std::numeric_limits<Scalar>::quiet_NaN();
    dense_fails(t, "targets(0, 4) = nan outside [0, 1]");
    t(0, 4) = std::numeric_limits<Scalar>::infinity();
    dense_fails(t, "targets(0, 4) = inf outside [0, 1]");
    t = targets;
    t(1, 0) = Scalar(0.5);  // row 1 sums to 1.5
    dense_fails(t, "targets of row n=1 sum to 1.5, outside [1 - 0.001, 1 + 0.001] (a distribution over the classes)");
    t = targets;
    t(0, 0) = Scalar(0.25);
    dense_fails(t, "targets of row n=0 sum to 0.75, outside [1 - 0.001, 1 + 0.001] (a distribution over the classes)");
    t(0, 0) = Scalar(0.5005);  // within the tolerance
    CHECK_NOTHROW(embedhead::cross_entropy_soft<Scalar>(logits, t, o));
    // [N, V] targets with a padding column that is not 0.
    o.valid_vocab = 4;
    t = targets;
    t(1, 3) = 0;
    dense_fails(t, "targets(1, 4) = 0.25 in a padding column [4, 5): must be 0");
    t(1, 3) = Scalar(0.25);
    t(1, 4) = 0;
    t(1, 0) = Scalar(0.25);
    CHECK_NOTHROW(embedhead::cross_entropy_soft<Scalar>(logits, t, o));
    o.valid_vocab = -1;
    RowMatrix<Scalar> p = probs;
    p(1, 1) = Scalar(1.5);
    p(1, 0) = Scalar(-0.5);
    sparse_fails(ids, p, "targets.probs(1, 0) = -0.5 outside [0, 1]");
    p = probs;
    p(0, 1) = Scalar(0.25);
    sparse_fails(ids, p,
                 "targets of row n=0 sum to 0.75, outside [1 - 0.001, 1 + 0.001] (a distribution over the classes)");
  }
  SECTION("sparse ids") {
    IdMatrix<std::int32_t> i = ids;
    i(1, 1) = 5;
    CHECK_THROWS_AS(embedhead::cross_entropy_soft<Scalar>(logits, SparseTargets<Scalar>{i, probs}, o),
                    embedhead::index_error);
    sparse_fails(i, probs, "targets.ids(1, 1) = 5 outside [0, 5)");
    i(1, 1) = -1;
    sparse_fails(i, probs, "targets.ids(1, 1) = -1 outside [0, 5)");
    o.valid_vocab = 3;
    i = ids;
    sparse_fails(i, probs, "targets.ids(1, 1) = 3 outside [0, 3); columns [3, 5) are vocabulary padding");
    o.valid_vocab = -1;
    // A repeated id: its probabilities add up (0.25 + 0.75 on class 2).
    i(1, 1) = 2;
    RowMatrix<Scalar> dense_dup(2, 5), dz_dup(2, 5), dz_dense(2, 5);
    dense_dup << 0.5, 0.5, 0, 0, 0, 0, 0, 1, 0, 0;
    embedhead::cross_entropy_soft_forward_backward<Scalar>(logits, SparseTargets<Scalar>{i, probs}, dz_dup, o);
    embedhead::cross_entropy_soft_forward_backward<Scalar>(logits, dense_dup, dz_dense, o);
    CHECK(first_difference(dz_dup, dz_dense) == "");
  }
  SECTION("options") {
    o.ignore_index = 0;
    CHECK_THROWS_AS(embedhead::cross_entropy_soft<Scalar>(logits, targets, o), embedhead::value_error);
    dense_fails(targets,
                "ignore_index = 0 with soft targets, which have no ignored rows (leave it at its default, -100)");
    sparse_fails(ids, probs,
                 "ignore_index = 0 with soft targets, which have no ignored rows (leave it at its default, -100)");
    o.ignore_index = -100;
    o.class_weights = {1, 1, 1};
    dense_fails(targets, "class_weights has 3 entries, expected C = 5 (one per class: V)");
    o.class_weights.clear();
    o.label_smoothing = 2;
    dense_fails(targets, "label_smoothing = 2 outside [0, 1]");
    o.label_smoothing = 0;
    o.error_if_nonfinite = true;
    RowMatrix<Scalar> bad = logits;
    bad(1, 3) = std::numeric_limits<Scalar>::infinity();
    CHECK_THROWS_WITH(embedhead::cross_entropy_soft_forward_backward<Scalar>(bad, targets, dz, losses, o),
                      where + "logit inf at n=1, column 3, outside the finite numbers (error_if_nonfinite)");
    unchanged();
  }
}

// ---- the fused head loss ----

namespace {

struct HeadOutputs {
  double loss = 0, weight_sum = 0;
  RowMatrix<double> dh, dW, db, losses;
};

// The unfused path: logits = h W^T + b, cross_entropy_soft_forward_backward, then dh = dz W,
// dW = dz^T h, db = sums of dz (per-token weights: each row's dz and loss times w_n, the mean
// divided by sum w_n instead of N).
template <typename Scalar, typename Targets>
HeadOutputs unfused_soft(const RowMatrix<Scalar>& h, const RowMatrix<Scalar>& W, const RowMatrix<Scalar>& b,
                         const Targets& targets, CrossEntropyOptions o, const std::vector<double>& weights) {
  const Index N = h.rows(), V = W.rows();
  const RowMatrix<Scalar> logits = (h * W.transpose()).rowwise() + b.col(0).transpose();
  RowMatrix<Scalar> dz(N, V), losses(N, 1);
  HeadOutputs out;
  double denominator = static_cast<double>(N);
  const Reduction reduction = o.reduction;
  if (!weights.empty()) o.reduction = Reduction::sum;  // weighted below
  const auto r = embedhead::cross_entropy_soft_forward_backward<Scalar>(logits, targets, dz, losses, o);
  out.loss = r.loss;
  out.weight_sum = r.weight_sum;
  RowMatrix<double> dzd = dz.template cast<double>();
  out.losses = losses.template cast<double>();
  if (!weights.empty()) {
    denominator = 0;
    double sum = 0;
    for (Index n = 0; n < N; ++n) {
      denominator += weights[static_cast<std::size_t>(n)];
      sum += weights[static_cast<std::size_t>(n)] * out.losses(n, 0);
      out.losses(n, 0) *= weights[static_cast<std::size_t>(n)];
      dzd.row(n) *= weights[static_cast<std::size_t>(n)];
    }
    out.weight_sum = denominator;
    out.loss = reduction == Reduction::mean ? sum / denominator : sum;
    if (reduction == Reduction::mean) dzd /= denominator;
  }
  out.dh = dzd * W.template cast<double>();
  out.dW = dzd.transpose() * h.template cast<double>();
  out.db = dzd.colwise().sum().transpose();
  return out;
}

}  // namespace

TEMPLATE_TEST_CASE("fused_head_loss_soft equals the unfused head + soft loss + head backward, in both plans",
                   "[fused_head_loss][soft][unfused]", float, double) {
  using Scalar = TestType;
  const Index N = 12, V = 41, C = 38, d = 9, k = 4;
  const RowMatrix<Scalar> h = random_matrix<Scalar>(N, d, 1701, 1.0);
  const RowMatrix<Scalar> W = random_matrix<Scalar>(V, d, 1702, 0.5);
  const RowMatrix<Scalar> b = random_matrix<Scalar>(V, 1, 1703, 0.5);
  const RandomSparse<Scalar> sparse = random_sparse<Scalar>(N, C, k, 1704);
  const RowMatrix<Scalar> dense = densify(sparse, C).template cast<Scalar>();
  const SparseTargets<Scalar> sparse_targets{sparse.ids, sparse.probs};
  const RowMatrix<Scalar> token_weights = random_matrix<Scalar>(N, 1, 1705, 1.0).cwiseAbs();
  std::vector<double> weight_list;
  for (Index n = 0; n < N; ++n) weight_list.push_back(static_cast<double>(token_weights(n, 0)));
  const double tol = loss_tolerance<Scalar>();
  embedhead::FusedHeadLossWorkspace<Scalar> ws;
  for (Reduction reduction : {Reduction::mean, Reduction::sum, Reduction::none})
    for (const double eps : {0.0, 0.1})
      for (const bool weights : {false, true})
        for (const bool extras : {false, true})
          for (const bool token_weighted : {false, true})
            for (const FusedPlan plan : {FusedPlan::vocab_blocks, FusedPlan::token_chunks})
              for (const Index block : {Index(0), Index(5), Index(16)}) {
                CAPTURE(name_of(reduction), eps, weights, extras, token_weighted, static_cast<int>(plan), block);
                FusedHeadLossOptions o;
                o.reduction = reduction;
                o.label_smoothing = eps;
                o.valid_vocab = C;
                if (weights) o.class_weights = test_support::class_weights(C);
                if (extras) {
                  o.z_loss = 1e-3;
                  o.softcap = 2.0;
                  o.entropy_bonus = 0.2;
                  o.gradient_scale = 0.5;
                }
                o.plan = plan;
                o.vocab_block = block;
                o.memory_budget = plan == FusedPlan::token_chunks ? 5 * C * static_cast<Index>(sizeof(Scalar)) : 0;
                const std::vector<double> no_weights;
                const HeadOutputs expected = unfused_soft<Scalar>(h, W, b, dense, o,
                                                                  token_weighted ? weight_list : no_weights);
                for (const bool use_sparse : {false, true}) {
                  CAPTURE(use_sparse);
                  RowMatrix<Scalar> dh(N, d), dW = RowMatrix<Scalar>::Zero(V, d), db = RowMatrix<Scalar>::Zero(V, 1);
                  RowMatrix<Scalar> losses(N, 1), lse(N, 1);
                  embedhead::FusedHeadLossExtras<Scalar> extra{{token_weighted ? token_weights.data() : nullptr,
                                                                token_weighted ? N : 0, 1},
                                                               {lse.data(), N, 1},
                                                               {losses.data(), N, 1}};
                  const auto r = use_sparse
                                     ? embedhead::fused_head_loss_soft_forward_backward<Scalar>(h, W, b, sparse_targets,
                                                                                                dh, dW, db, ws, o,
                                                                                                extra)
                                     : embedhead::fused_head_loss_soft_forward_backward<Scalar>(h, W, b, dense, dh, dW,
                                                                                                db, ws, o, extra);
                  CHECK(r.count == N);
                  CHECK_THAT(r.weight_sum, WithinRel(expected.weight_sum, 1e-12));
                  CHECK_THAT(r.loss, WithinRel(expected.loss, tol));
                  CHECK(test_support::close(dh, expected.dh, 4 * tol));
                  CHECK(test_support::close(dW, expected.dW, 4 * tol));
                  CHECK(test_support::close(db, expected.db, 4 * tol));
                  CHECK(test_support::close(losses, expected.losses, 4 * tol));
                  CHECK(dW.bottomRows(V - C).cwiseAbs().maxCoeff() == Scalar(0));
                  // The loss alone: the same bits.
                  const double alone =
                      use_sparse ? embedhead::fused_head_loss_soft<Scalar>(h, W, b, sparse_targets, ws, o, extra).loss
                                 : embedhead::fused_head_loss_soft<Scalar>(h, W, b, dense, ws, o, extra).loss;
                  CHECK(alone == r.loss);
                }
              }
}

TEST_CASE("fused_head_loss_soft gradient check in double", "[fused_head_loss][soft][gradient]") {
  const Index N = 4, V = 7, d = 3;
  RowMatrix<double> h = random_matrix<double>(N, d, 1711, 1.0), W = random_matrix<double>(V, d, 1712, 0.5);
  const RowMatrix<double> b = random_matrix<double>(V, 1, 1713, 0.5);
  const RandomSparse<double> sparse = random_sparse<double>(N, V, 3, 1714);
  const SparseTargets<double> targets{sparse.ids, sparse.probs};
  embedhead::FusedHeadLossWorkspace<double> ws;
  FusedHeadLossOptions o;
  o.label_smoothing = 0.2;
  o.class_weights = test_support::class_weights(V);
  o.z_loss = 0.02;
  o.softcap = 1.5;
  o.vocab_block = 3;
  for (const FusedPlan plan : {FusedPlan::vocab_blocks, FusedPlan::token_chunks}) {
    CAPTURE(static_cast<int>(plan));
    o.plan = plan;
    RowMatrix<double> dh(N, d), dW = RowMatrix<double>::Zero(V, d), db = RowMatrix<double>::Zero(V, 1);
    embedhead::fused_head_loss_soft_forward_backward<double>(h, W, b, targets, dh, dW, db, ws, o);
    auto loss = [&] { return embedhead::fused_head_loss_soft<double>(h, W, b, targets, ws, o).loss; };
    CHECK(naive::max_relative_error(dh, naive::numerical_gradient(h, loss), 1e-4) < 1e-5);
    CHECK(naive::max_relative_error(dW, naive::numerical_gradient(W, loss), 1e-4) < 1e-5);
  }
}

TEMPLATE_TEST_CASE("fused_head_loss_soft rejects bad targets and writes nothing", "[fused_head_loss][soft][errors]",
                   float, double) {
  using Scalar = TestType;
  const Index N = 2, V = 5, d = 3;
  const RowMatrix<Scalar> h = random_matrix<Scalar>(N, d, 1721, 1.0), W = random_matrix<Scalar>(V, d, 1722, 0.5);
  const RowMatrix<Scalar> b = random_matrix<Scalar>(V, 1, 1723, 0.5);
  RowMatrix<Scalar> targets(2, 5);
  targets << 0.5, 0.5, 0, 0, 0, 0, 0.25, 0.25, 0.25, 0.25;
  IdMatrix<std::int32_t> ids(2, 2);
  ids << 0, 1, 2, 3;
  RowMatrix<Scalar> probs(2, 2);
  probs << 0.5, 0.5, 0.25, 0.75;
  RowMatrix<Scalar> dh = RowMatrix<Scalar>::Constant(N, d, 7), dW = RowMatrix<Scalar>::Constant(V, d, 7),
                    db = RowMatrix<Scalar>::Constant(V, 1, 7), losses = RowMatrix<Scalar>::Constant(N, 1, 7);
  embedhead::FusedHeadLossWorkspace<Scalar> ws;
  FusedHeadLossOptions o;
  const embedhead::FusedHeadLossExtras<Scalar> extra{{nullptr, 0, 1}, {nullptr, 0, 1}, {losses.data(), N, 1}};
  const std::string where = "fused_head_loss_soft_forward_backward: ";
  auto unchanged = [&] {
    CHECK((dh.array() == Scalar(7)).all());
    CHECK((dW.array() == Scalar(7)).all());
    CHECK((db.array() == Scalar(7)).all());
    CHECK((losses.array() == Scalar(7)).all());
  };
  auto dense_fails = [&](const RowMatrix<Scalar>& t, const std::string& message) {
    CAPTURE(message);
    CHECK_THROWS_WITH(embedhead::fused_head_loss_soft_forward_backward<Scalar>(h, W, b, t, dh, dW, db, ws, o, extra),
                      where + message);
    unchanged();
  };
  auto sparse_fails = [&](const IdMatrix<std::int32_t>& i, const RowMatrix<Scalar>& p, const std::string& message) {
    CAPTURE(message);
    CHECK_THROWS_WITH(embedhead::fused_head_loss_soft_forward_backward<Scalar>(h, W, b, SparseTargets<Scalar>{i, p}, dh,
                                                                               dW, db, ws, o, extra),
                      where + message);
    unchanged();
  };
  dense_fails(targets.leftCols(4), "targets has shape [2, 4], expected [N, C] = [2, 5]");
  RowMatrix<Scalar> t = targets;
  t(1, 2) = Scalar(-0.25);
  dense_fails(t, "targets(1, 2) = -0.25 outside [0, 1]");
  t = targets;
  t(1, 0) = Scalar(0.5);
  dense_fails(t, "targets of row n=1 sum to 1.5, outside [1 - 0.001, 1 + 0.001] (a distribution over the classes)");
  sparse_fails(ids, probs.leftCols(1),
               "sparse targets have ids [2, 2] and probs [2, 1], expected both [N, k] with N = 2");
  IdMatrix<std::int32_t> i = ids;
  i(0, 1) = 5;
  CHECK_THROWS_AS(embedhead::fused_head_loss_soft<Scalar>(h, W, b, SparseTargets<Scalar>{i, probs}, ws, o),
                  embedhead::index_error);
  sparse_fails(i, probs, "targets.ids(0, 1) = 5 outside [0, 5)");
  RowMatrix<Scalar> p = probs;
  p(0, 0) = std::numeric_limits<Scalar>::quiet_NaN();
  sparse_fails(ids, p, "targets.probs(0, 0) = nan outside [0, 1]");
  o.ignore_index = 3;
  dense_fails(targets,
              "ignore_index = 3 with soft targets, which have no ignored rows (leave it at its default, -100)");
  o.ignore_index = -100;
  RowMatrix<Scalar> bad_dh = RowMatrix<Scalar>::Constant(N, d + 1, 7);
  CHECK_THROWS_WITH(embedhead::fused_head_loss_soft_forward_backward<Scalar>(h, W, b, targets, bad_dh, dW, db, ws, o,
                                                                             extra),
                    where + "dh has shape [2, 4], expected [2, 3]");
  unchanged();
  CHECK((bad_dh.array() == Scalar(7)).all());
}

TEMPLATE_TEST_CASE("soft targets on the layer classes: CrossEntropyLoss and FusedHeadLoss equal the free functions",
                   "[cross_entropy][fused_head_loss][soft]", float, double) {
  using Scalar = TestType;
  const Index N = 6, V = 11, d = 4, k = 3;
  const RowMatrix<Scalar> h = random_matrix<Scalar>(N, d, 1801, 1.0);
  const RandomSparse<Scalar> sparse = random_sparse<Scalar>(N, V, k, 1802);
  const SparseTargets<Scalar> sparse_targets{sparse.ids, sparse.probs};
  const RowMatrix<Scalar> dense = densify(sparse, V).template cast<Scalar>();
  FusedHeadLossOptions options;
  options.label_smoothing = 0.1;
  options.vocab_block = 4;

  SECTION("CrossEntropyLoss") {
    const RowMatrix<Scalar> logits = random_matrix<Scalar>(N, V, 1803, 2.0);
    const embedhead::CrossEntropyLoss<Scalar> loss(options);
    RowMatrix<Scalar> d1(N, V), d2(N, V), d3(N, V), d4(N, V);
    CHECK(loss.forward_soft(logits, dense).loss == embedhead::cross_entropy_soft<Scalar>(logits, dense, options).loss);
    CHECK(loss.forward_soft(logits, sparse_targets).loss ==
          embedhead::cross_entropy_soft<Scalar>(logits, sparse_targets, options).loss);
    CHECK(loss.forward_backward_soft(logits, dense, d1).loss ==
          embedhead::cross_entropy_soft_forward_backward<Scalar>(logits, dense, d2, options).loss);
    CHECK(first_difference(d1, d2).empty());
    CHECK(loss.forward_backward_soft(logits, sparse_targets, d3).loss ==
          embedhead::cross_entropy_soft_forward_backward<Scalar>(logits, sparse_targets, d4, options).loss);
    CHECK(first_difference(d3, d4).empty());
  }
  SECTION("FusedHeadLoss on a head with a bias, and with trainable rows") {
    embedhead::OutputProjectionOptions head_options;
    head_options.bias = true;
    embedhead::OutputProjection<Scalar> head(V, d, head_options);
    head.bias()->value() = random_matrix<Scalar>(V, 1, 1804, 0.5);
    const RowMatrix<Scalar> W = head.weight().value(), b = head.bias()->value();
    embedhead::FusedHeadLoss<Scalar> layer(options);
    embedhead::FusedHeadLossWorkspace<Scalar> ws;
    for (const bool use_sparse : {false, true}) {
      CAPTURE(use_sparse);
      head.zero_grad();
      RowMatrix<Scalar> dh(N, d), dh_ref(N, d), dW_ref = RowMatrix<Scalar>::Zero(V, d),
                                                db_ref = RowMatrix<Scalar>::Zero(V, 1);
      const double got = use_sparse ? layer.forward_backward_soft(head, h, sparse_targets, dh).loss
                                    : layer.forward_backward_soft(head, h, dense, dh).loss;
      const double expected = use_sparse
                                  ? embedhead::fused_head_loss_soft_forward_backward<Scalar>(h, W, b, sparse_targets,
                                                                                             dh_ref, dW_ref, db_ref, ws,
                                                                                             options)
                                        .loss
                                  : embedhead::fused_head_loss_soft_forward_backward<Scalar>(h, W, b, dense, dh_ref,
                                                                                             dW_ref, db_ref, ws,
                                                                                             options)
                                        .loss;
      CHECK(got == expected);
      CHECK(first_difference(dh, dh_ref).empty());
      CHECK(first_difference(head.weight().grad().to_dense(), dW_ref).empty());
      CHECK(first_difference(head.bias()->grad().to_dense(), db_ref).empty());
      CHECK((use_sparse ? layer.forward_soft(head, h, sparse_targets).loss : layer.forward_soft(head, h, dense).loss) ==
            expected);
    }
    // Trainable rows: dW on those rows only, the same values to rounding.
    const std::vector<Index> rows = {2, 7};
    head.set_trainable_rows(rows);
    head.bias()->zero_grad();
    RowMatrix<Scalar> dh(N, d), dh_ref(N, d), dW_ref = RowMatrix<Scalar>::Zero(V, d),
                                              db_ref = RowMatrix<Scalar>::Zero(V, 1);
    layer.forward_backward_soft(head, h, dense, dh);
    embedhead::fused_head_loss_soft_forward_backward<Scalar>(h, W, b, dense, dh_ref, dW_ref, db_ref, ws, options);
    CHECK(first_difference(dh, dh_ref).empty());
    REQUIRE(head.weight().grad().touched_rows() == rows);
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const RowMatrix<Scalar> got = head.weight().grad().touched_row(static_cast<Index>(i));
      const RowMatrix<Scalar> want = dW_ref.row(rows[i]);
      CHECK(test_support::close(got, want, loss_tolerance<Scalar>()));
    }
    head.weight().set_all_rows_trainable();

    // Bad targets: the error names the layer's call, and the gradients (their modes too) and dh are
    // unchanged.
    head.zero_grad();
    RowMatrix<Scalar> bad = dense;
    bad(1, 0) += Scalar(0.5);
    RowMatrix<Scalar> dh_bad = RowMatrix<Scalar>::Constant(N, d, 7);
    CHECK_THROWS_WITH(layer.forward_backward_soft(head, h, bad, dh_bad),
                      Contains("FusedHeadLoss::forward_backward_soft: targets of row n=1 sum to"));
    CHECK(head.weight().grad().num_touched() == 0);
    CHECK_FALSE(head.weight().grad().is_dense());
    CHECK_FALSE(head.bias()->grad().is_dense());
    CHECK((dh_bad.array() == Scalar(7)).all());
    CHECK_THROWS_WITH(layer.forward_backward_soft(head, h.leftCols(2), dense, dh_bad),
                      Contains("FusedHeadLoss::forward_backward_soft: h has shape [6, 2]"));
    CHECK_FALSE(head.weight().grad().is_dense());
  }
}
