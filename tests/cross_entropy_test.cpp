// Tests for include/embedhead/cross_entropy.hpp: softmax cross-entropy on logits, its gradient
// (softmax - one_hot) * scale, the three reductions, ignore_index, per-token losses, numerical
// stability and the errors. Expected values come from naive::cross_entropy_sum, a naive softmax
// written here in double, central finite differences, and the worked example of the seeds.
#include <embedhead/cross_entropy.hpp>

#include "reference/naive.hpp"
#include "reference/test_support.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

using Catch::Contains;
using Catch::Matchers::WithinAbs;
using Catch::Matchers::WithinRel;
using embedhead::CrossEntropyOptions;
using embedhead::Index;
using embedhead::IdMatrix;
using embedhead::Reduction;
using embedhead::RowMatrix;
using test_support::first_difference;
using test_support::first_difference_nan;
using test_support::random_ids;
using test_support::random_matrix;
using test_support::same_values;

namespace {

// Test logits are uniform in [-kLogitSpread, kLogitSpread).
constexpr double kLogitSpread = 3.0;

// (softmax(z) - one_hot(y)) * scale per row, zero rows where y == ignore_index; all in double.
template <typename Scalar, typename TargetsT>
RowMatrix<double> naive_dlogits(const RowMatrix<Scalar>& logits, const TargetsT& targets, Index ignore_index,
                                double scale) {
  RowMatrix<double> g = RowMatrix<double>::Zero(logits.rows(), logits.cols());
  for (Index n = 0; n < logits.rows(); ++n) {
    const Index y = static_cast<Index>(targets(n / targets.cols(), n % targets.cols()));
    if (y == ignore_index) continue;
    double m = -INFINITY, s = 0;
    for (Index j = 0; j < logits.cols(); ++j) m = std::max(m, static_cast<double>(logits(n, j)));
    for (Index j = 0; j < logits.cols(); ++j) s += std::exp(static_cast<double>(logits(n, j)) - m);
    for (Index j = 0; j < logits.cols(); ++j)
      g(n, j) = (std::exp(static_cast<double>(logits(n, j)) - m) / s - (j == y ? 1.0 : 0.0)) * scale;
  }
  return g;
}

template <typename Scalar>
double loss_tolerance() {
  return std::is_same<Scalar, float>::value ? 2e-5 : 1e-12;
}

CrossEntropyOptions with(Reduction reduction, Index ignore_index = -100) {
  CrossEntropyOptions options;
  options.reduction = reduction;
  options.ignore_index = ignore_index;
  return options;
}

const char* name_of(Reduction r) { return r == Reduction::mean ? "mean" : r == Reduction::sum ? "sum" : "none"; }

}  // namespace

TEMPLATE_TEST_CASE("cross_entropy matches the naive reference for every reduction", "[cross_entropy][naive]", float,
                   double) {
  using S = TestType;
  const double tol = loss_tolerance<S>();
  for (Index V : {1, 2, 7, 8, 9, 15, 16, 17}) {
    const Index B = 3, T = 4, N = B * T;
    const RowMatrix<S> logits = random_matrix<S>(N, V, 100 + static_cast<std::uint32_t>(V), kLogitSpread);
    IdMatrix<std::int32_t> targets = random_ids<std::int32_t>(B, T, V, 200 + static_cast<std::uint32_t>(V));
    targets(1, 2) = -100;  // one ignored token (PyTorch's default ignore_index)
    Index naive_count = 0;
    const double naive_sum = naive::cross_entropy_sum(logits, targets, -100, naive_count);
    REQUIRE(naive_count == N - 1);

    for (Reduction reduction : {Reduction::mean, Reduction::sum, Reduction::none}) {
      INFO("V = " << V << ", reduction = " << name_of(reduction));
      const double expected_loss = reduction == Reduction::mean ? naive_sum / static_cast<double>(naive_count)
                                                                : naive_sum;
      const auto r = embedhead::cross_entropy<S>(logits, targets, with(reduction));
      CHECK(r.count == naive_count);
      CHECK_THAT(r.sum, WithinRel(naive_sum, tol) || WithinAbs(naive_sum, tol));
      CHECK_THAT(r.loss, WithinRel(expected_loss, tol) || WithinAbs(expected_loss, tol));

      RowMatrix<S> dlogits(N, V);
      const auto r2 = embedhead::cross_entropy_forward_backward<S>(logits, targets, dlogits, with(reduction));
      // The loss does not depend on whether the gradient is asked for: both paths sum
      // exp(z - m) in the same fixed order, so the results are bit-identical.
      CHECK(r2.loss == r.loss);
      CHECK(r2.sum == r.sum);
      CHECK(r2.count == r.count);
    }
  }
}

TEMPLATE_TEST_CASE("cross_entropy accepts int32 and int64 targets, as [B, T] or as a column",
                   "[cross_entropy][targets]", float, double) {
  using S = TestType;
  const Index B = 2, T = 5, N = B * T, V = 9;
  const RowMatrix<S> logits = random_matrix<S>(N, V, 7, kLogitSpread);
  const IdMatrix<std::int32_t> targets32 = random_ids<std::int32_t>(B, T, V, 8);
  const IdMatrix<std::int64_t> targets64 = targets32.template cast<std::int64_t>();
  // The same ids as an [N, 1] column, a column-major [B, T] matrix and an Eigen vector.
  const IdMatrix<std::int32_t> column = Eigen::Map<const IdMatrix<std::int32_t>>(targets32.data(), N, 1);
  const Eigen::Matrix<std::int32_t, Eigen::Dynamic, Eigen::Dynamic> col_major = targets32;
  const Eigen::Matrix<std::int64_t, Eigen::Dynamic, 1> vector64 = column.template cast<std::int64_t>();

  Index naive_count = 0;
  const double naive_sum = naive::cross_entropy_sum(logits, targets32, -100, naive_count);
  const double tol = loss_tolerance<S>();

  RowMatrix<S> reference_dlogits(N, V);
  const auto reference = embedhead::cross_entropy_forward_backward<S>(logits, targets32, reference_dlogits);
  CHECK(reference.count == N);
  CHECK_THAT(reference.loss, WithinRel(naive_sum / static_cast<double>(N), tol));

  auto same_as_reference = [&](const embedhead::CrossEntropyResult& r, const RowMatrix<S>& dlogits) {
    CHECK(r.loss == reference.loss);
    CHECK(r.count == reference.count);
    CHECK(same_values(dlogits, reference_dlogits));
  };
  RowMatrix<S> dlogits(N, V);
  same_as_reference(embedhead::cross_entropy_forward_backward<S>(logits, targets64, dlogits), dlogits);
  dlogits.setZero();
  same_as_reference(embedhead::cross_entropy_forward_backward<S>(logits, column, dlogits), dlogits);
  dlogits.setZero();
  same_as_reference(embedhead::cross_entropy_forward_backward<S>(logits, col_major, dlogits), dlogits);
  dlogits.setZero();
  same_as_reference(embedhead::cross_entropy_forward_backward<S>(logits, vector64, dlogits), dlogits);
}

TEMPLATE_TEST_CASE("cross_entropy gradient is (softmax - one_hot) * scale", "[cross_entropy][gradient]", float,
                   double) {
  using S = TestType;
  const double tol = std::is_same<S, float>::value ? 1e-6 : 1e-14;

  for (Index V : {1, 7, 8, 9, 16, 17}) {
    const Index B = 2, T = 3, N = B * T;
    const RowMatrix<S> logits = random_matrix<S>(N, V, 300 + static_cast<std::uint32_t>(V), kLogitSpread);
    IdMatrix<std::int64_t> targets = random_ids<std::int64_t>(B, T, V, 400 + static_cast<std::uint32_t>(V));
    targets(0, 1) = -100;
    const Index count = N - 1;

    RowMatrix<S> d_mean(N, V), d_sum(N, V), d_none(N, V);
    embedhead::cross_entropy_forward_backward<S>(logits, targets, d_mean, with(Reduction::mean));
    embedhead::cross_entropy_forward_backward<S>(logits, targets, d_sum, with(Reduction::sum));
    embedhead::cross_entropy_forward_backward<S>(logits, targets, d_none, with(Reduction::none));

    SECTION("naive reference, V = " + std::to_string(V)) {
      // sum and none: scale 1; mean: scale 1 / count.
      const RowMatrix<double> expected_sum = naive_dlogits(logits, targets, -100, 1.0);
      const RowMatrix<double> expected_mean = naive_dlogits(logits, targets, -100, 1.0 / static_cast<double>(count));
      for (Index i = 0; i < N * V; ++i) {
        CHECK_THAT(static_cast<double>(d_sum.data()[i]), WithinAbs(expected_sum.data()[i], tol));
        CHECK_THAT(static_cast<double>(d_none.data()[i]), WithinAbs(expected_sum.data()[i], tol));
        CHECK_THAT(static_cast<double>(d_mean.data()[i]), WithinAbs(expected_mean.data()[i], tol));
      }
      CHECK(same_values(d_none, d_sum));
      // The ignored row is exactly zero.
      CHECK(d_sum.row(1).isZero(0));
      CHECK(d_mean.row(1).isZero(0));
    }

    SECTION("rows sum to ~0 and mean = sum / count, V = " + std::to_string(V)) {
      // sum_j softmax_j = 1 and the one-hot removes 1, so every row's gradient sums to zero.
      for (Index n = 0; n < N; ++n) {
        CHECK_THAT(static_cast<double>(d_sum.row(n).sum()), WithinAbs(0.0, 8 * tol));
        CHECK_THAT(static_cast<double>(d_mean.row(n).sum()), WithinAbs(0.0, 8 * tol));
      }
      for (Index i = 0; i < N * V; ++i)
        CHECK_THAT(static_cast<double>(d_mean.data()[i]) * static_cast<double>(count),
                   WithinAbs(static_cast<double>(d_sum.data()[i]), 8 * tol));
      // Only the target column is negative (softmax < 1 elsewhere is positive).
      for (Index n = 0; n < N; ++n) {
        const Index y = targets(n / T, n % T);
        if (y == -100 || V == 1) continue;
        for (Index j = 0; j < V; ++j) CHECK((j == y ? d_sum(n, j) < 0 : d_sum(n, j) > 0));
      }
    }
  }
}

TEST_CASE("cross_entropy gradient check in double (mean loss)", "[cross_entropy][gradient]") {
  const Index B = 2, T = 3, N = B * T, V = 7;
  RowMatrix<double> logits = random_matrix<double>(N, V, 9, kLogitSpread);
  IdMatrix<std::int32_t> targets = random_ids<std::int32_t>(B, T, V, 10);
  targets(1, 0) = -100;
  targets(0, 2) = targets(0, 0);  // a repeated target

  auto loss = [&]() { return embedhead::cross_entropy<double>(logits, targets).loss; };
  const RowMatrix<double> numeric = naive::numerical_gradient(logits, loss);
  RowMatrix<double> analytic(N, V);
  embedhead::cross_entropy_forward_backward<double>(logits, targets, analytic);
  // Central differences here carry ~2e-10 of absolute rounding noise (eps = 1e-6, loss ~ 2), which
  // is a large relative error on the smallest gradient entries. So the error is measured against
  // the gradient's scale: a wrong term shows up at ~1e-2 of it, the noise at ~1e-9.
  const auto scaled_error = [](const RowMatrix<double>& a, const RowMatrix<double>& n) {
    return (a - n).cwiseAbs().maxCoeff() / n.cwiseAbs().maxCoeff();
  };
  CHECK(scaled_error(analytic, numeric) < 1e-7);
  // The ignored row does not affect the loss at all.
  CHECK(numeric.row(3).isZero(0));

  SECTION("sum reduction too") {
    auto sum_loss = [&]() { return embedhead::cross_entropy<double>(logits, targets, with(Reduction::sum)).loss; };
    const RowMatrix<double> numeric_sum = naive::numerical_gradient(logits, sum_loss);
    RowMatrix<double> analytic_sum(N, V);
    embedhead::cross_entropy_forward_backward<double>(logits, targets, analytic_sum, with(Reduction::sum));
    CHECK(scaled_error(analytic_sum, numeric_sum) < 1e-7);
  }
}

TEMPLATE_TEST_CASE("cross_entropy is stable for huge logits", "[cross_entropy][stability]", float, double) {
  using S = TestType;
  // Offsets are multiples of 1/8, exact in float next to 1e4 (its ulp there is 2^-10), so z - c is
  // computed exactly and both calls see the same shifted row.
  const Index N = 3, V = 5;
  RowMatrix<S> offsets(N, V);
  offsets << S(0.5), S(-1.25), S(2.0), S(0.125), S(-3.0),  //
      S(1.0), S(1.0), S(1.0), S(1.0), S(1.0),              //
      S(-0.75), S(4.0), S(0.0), S(-2.5), S(3.25);
  IdMatrix<std::int32_t> targets(N, 1);
  targets << 2, 0, 4;

  RowMatrix<S> shifted_dlogits(N, V);
  const auto shifted = embedhead::cross_entropy_forward_backward<S>(offsets, targets, shifted_dlogits);
  for (double c : {1e4, -1e4}) {
    INFO("c = " << c);
    const RowMatrix<S> logits = (offsets.array() + static_cast<S>(c)).matrix();
    RowMatrix<S> dlogits(N, V);
    const auto r = embedhead::cross_entropy_forward_backward<S>(logits, targets, dlogits);
    CHECK(std::isfinite(r.loss));
    CHECK(dlogits.allFinite());
    CHECK_THAT(r.loss, WithinRel(shifted.loss, 1e-9));
    CHECK(same_values(dlogits, shifted_dlogits));
    Index naive_count = 0;
    CHECK_THAT(r.sum, WithinRel(naive::cross_entropy_sum(logits, targets, -100, naive_count), loss_tolerance<S>()));
  }
  // Row 1 is uniform: loss log 5 whatever the offset.
  RowMatrix<S> losses(N, 1);
  embedhead::cross_entropy_per_token<S>(offsets, targets, losses);
  CHECK_THAT(static_cast<double>(losses(1, 0)), WithinRel(std::log(5.0), 1e-6));

  SECTION("a row spanning [-1e4, 1e4]") {
    RowMatrix<S> wide(2, 3);
    wide << S(1e4), S(-1e4), S(0), S(1e4), S(-1e4), S(0);
    IdMatrix<std::int32_t> y(2, 1);
    y << 0, 1;
    RowMatrix<S> losses2(2, 1), dlogits(2, 3);
    embedhead::cross_entropy_per_token<S>(wide, y, losses2);
    embedhead::cross_entropy_forward_backward<S>(wide, y, dlogits, with(Reduction::sum));
    CHECK(losses2.allFinite());
    CHECK(dlogits.allFinite());
    // Row 0 predicts its target with probability 1 - O(e^-1e4): loss 0. Row 1's target is 2e4 below
    // the max: loss 2e4 (exp(-1e4) and exp(-2e4) vanish next to 1).
    CHECK_THAT(static_cast<double>(losses2(0, 0)), WithinAbs(0.0, 1e-12));
    CHECK_THAT(static_cast<double>(losses2(1, 0)), WithinRel(2e4, 1e-7));
    CHECK_THAT(static_cast<double>(dlogits(1, 0)), WithinAbs(1.0, 1e-7));
    CHECK_THAT(static_cast<double>(dlogits(1, 1)), WithinAbs(-1.0, 1e-7));
  }

  SECTION("V = 1: loss 0 and zero gradient") {
    RowMatrix<S> one_column(4, 1);
    one_column << S(1e4), S(-1e4), S(0), S(3.5);
    const IdMatrix<std::int32_t> zeros = IdMatrix<std::int32_t>::Zero(2, 2);
    for (Reduction reduction : {Reduction::mean, Reduction::sum, Reduction::none}) {
      RowMatrix<S> dlogits = RowMatrix<S>::Constant(4, 1, S(7));
      const auto r = embedhead::cross_entropy_forward_backward<S>(one_column, zeros, dlogits, with(reduction));
      CHECK(r.loss == 0.0);
      CHECK(r.sum == 0.0);
      CHECK(r.count == 4);
      CHECK(dlogits.isZero(0));
    }
  }
}

TEMPLATE_TEST_CASE("cross_entropy ignore_index", "[cross_entropy][ignore]", float, double) {
  using S = TestType;
  const Index B = 2, T = 4, N = B * T, V = 6;
  const RowMatrix<S> logits = random_matrix<S>(N, V, 11, kLogitSpread);
  const double tol = loss_tolerance<S>();

  SECTION("ignored rows: no loss, zero gradient rows, not counted") {
    IdMatrix<std::int32_t> targets = random_ids<std::int32_t>(B, T, V, 12);
    targets(0, 0) = -100;
    targets(1, 3) = -100;
    // The same loss as dropping those rows entirely.
    RowMatrix<S> kept_logits(N - 2, V);
    IdMatrix<std::int32_t> kept_targets(N - 2, 1);
    for (Index n = 0, k = 0; n < N; ++n)
      if (targets(n / T, n % T) != -100) {
        kept_logits.row(k) = logits.row(n);
        kept_targets(k++, 0) = targets(n / T, n % T);
      }
    Index kept_count = 0;
    const double kept_sum = naive::cross_entropy_sum(kept_logits, kept_targets, -100, kept_count);
    REQUIRE(kept_count == N - 2);

    RowMatrix<S> dlogits = RowMatrix<S>::Constant(N, V, S(5));
    const auto r = embedhead::cross_entropy_forward_backward<S>(logits, targets, dlogits);
    CHECK(r.count == N - 2);
    CHECK_THAT(r.loss, WithinRel(kept_sum / static_cast<double>(N - 2), tol));
    CHECK(dlogits.row(0).isZero(0));
    CHECK(dlogits.row(7).isZero(0));
    const RowMatrix<double> expected = naive_dlogits(logits, targets, -100, 1.0 / static_cast<double>(N - 2));
    CHECK(naive::max_relative_error(dlogits.template cast<double>(), expected, 1e-6) < 1e-4);

    RowMatrix<S> losses = RowMatrix<S>::Constant(N, 1, S(5));
    embedhead::cross_entropy_per_token<S>(logits, targets, losses);
    CHECK(losses(0, 0) == S(0));
    CHECK(losses(7, 0) == S(0));
  }

  SECTION("all targets ignored: loss 0, count 0, zero gradient, no NaN") {
    const IdMatrix<std::int32_t> all_ignored = IdMatrix<std::int32_t>::Constant(B, T, -100);
    for (Reduction reduction : {Reduction::mean, Reduction::sum, Reduction::none}) {
      INFO(name_of(reduction));
      RowMatrix<S> dlogits = RowMatrix<S>::Constant(N, V, S(5));
      const auto r = embedhead::cross_entropy_forward_backward<S>(logits, all_ignored, dlogits, with(reduction));
      CHECK(r.loss == 0.0);
      CHECK(r.sum == 0.0);
      CHECK(r.count == 0);
      CHECK(dlogits.allFinite());
      CHECK(dlogits.isZero(0));
      CHECK(embedhead::cross_entropy<S>(logits, all_ignored, with(reduction)).loss == 0.0);
      RowMatrix<S> losses = RowMatrix<S>::Constant(N, 1, S(5));
      embedhead::cross_entropy_per_token<S>(logits, all_ignored, losses, with(reduction));
      CHECK(losses.isZero(0));
    }
  }

  SECTION("custom ignore_index: -1, and V - 1 inside the vocabulary") {
    IdMatrix<std::int64_t> targets = random_ids<std::int64_t>(B, T, V - 1, 13);  // ids in [0, V-1)
    targets(0, 3) = -1;
    // With ignore_index = -1, -1 is skipped and -100 would be an error.
    Index naive_count = 0;
    const double naive_sum = naive::cross_entropy_sum(logits, targets, -1, naive_count);
    const auto r = embedhead::cross_entropy<S>(logits, targets, with(Reduction::sum, -1));
    CHECK(r.count == N - 1);
    CHECK(naive_count == N - 1);
    CHECK_THAT(r.loss, WithinRel(naive_sum, tol));

    targets(0, 3) = V - 1;
    targets(1, 1) = V - 1;
    const auto r2 = embedhead::cross_entropy<S>(logits, targets, with(Reduction::mean, V - 1));
    const double naive_sum2 = naive::cross_entropy_sum(logits, targets, V - 1, naive_count);
    CHECK(r2.count == N - 2);
    CHECK(naive_count == N - 2);
    CHECK_THAT(r2.loss, WithinRel(naive_sum2 / static_cast<double>(N - 2), tol));
    RowMatrix<S> dlogits(N, V);
    embedhead::cross_entropy_forward_backward<S>(logits, targets, dlogits, with(Reduction::mean, V - 1));
    CHECK(dlogits.row(3).isZero(0));
    CHECK(dlogits.row(5).isZero(0));
    // The default ignore_index (-100) does not apply any more.
    targets(1, 2) = -100;
    REQUIRE_THROWS_AS(embedhead::cross_entropy<S>(logits, targets, with(Reduction::mean, V - 1)),
                      embedhead::index_error);
  }
}

TEMPLATE_TEST_CASE("cross_entropy_per_token matches the naive loss of each row", "[cross_entropy][per_token]", float,
                   double) {
  using S = TestType;
  const double tol = loss_tolerance<S>();
  for (Index V : {1, 8, 9, 17}) {
    const Index B = 3, T = 3, N = B * T;
    const RowMatrix<S> logits = random_matrix<S>(N, V, 500 + static_cast<std::uint32_t>(V), kLogitSpread);
    IdMatrix<std::int32_t> targets = random_ids<std::int32_t>(B, T, V, 600 + static_cast<std::uint32_t>(V));
    targets(2, 0) = -100;
    RowMatrix<S> losses = RowMatrix<S>::Constant(N, 1, S(-1));
    const auto r = embedhead::cross_entropy_per_token<S>(logits, targets, losses, with(Reduction::none));
    double total = 0;
    for (Index n = 0; n < N; ++n) {
      INFO("V = " << V << ", n = " << n);
      // The naive loss of row n alone.
      Index one = 0;
      const RowMatrix<S> row = logits.row(n);
      IdMatrix<std::int32_t> y(1, 1);
      y(0, 0) = targets(n / T, n % T);
      const double expected = naive::cross_entropy_sum(row, y, -100, one);
      CHECK_THAT(static_cast<double>(losses(n, 0)), WithinRel(expected, tol) || WithinAbs(expected, tol));
      total += expected;
    }
    CHECK(losses(6, 0) == S(0));
    CHECK(r.count == N - 1);
    CHECK_THAT(r.loss, WithinRel(total, tol) || WithinAbs(total, tol));
  }
}

TEMPLATE_TEST_CASE("CrossEntropyLoss equals the free functions", "[cross_entropy][class]", float, double) {
  using S = TestType;
  const Index B = 2, T = 3, N = B * T, V = 8;
  const RowMatrix<S> logits = random_matrix<S>(N, V, 14, kLogitSpread);
  IdMatrix<std::int32_t> targets(B, T);
  targets << 0, 7, 5,  //
      2, 3, 1;         // 3 is this test's ignore_index
  const IdMatrix<std::int64_t> targets64 = targets.template cast<std::int64_t>();

  for (Reduction reduction : {Reduction::mean, Reduction::sum, Reduction::none}) {
    const CrossEntropyOptions options = with(reduction, 3);
    const embedhead::CrossEntropyLoss<S> loss(options);
    CHECK(loss.options().reduction == reduction);
    CHECK(loss.options().ignore_index == 3);

    RowMatrix<S> free_d(N, V), class_d(N, V), class_d64(N, V);
    const auto free_r = embedhead::cross_entropy_forward_backward<S>(logits, targets, free_d, options);
    const auto class_r = loss.forward_backward(logits, targets, class_d);
    const auto class_r64 = loss.forward_backward(logits, targets64, class_d64);
    for (const auto& r : {class_r, class_r64, loss.forward(logits, targets), loss.forward(logits, targets64)}) {
      CHECK(r.loss == free_r.loss);
      CHECK(r.sum == free_r.sum);
      CHECK(r.count == free_r.count);
    }
    CHECK(free_r.count == N - 1);
    CHECK(same_values(class_d, free_d));
    CHECK(same_values(class_d64, free_d));
  }
  // Default options: mean, ignore_index -100.
  const embedhead::CrossEntropyLoss<S> default_loss;
  CHECK(default_loss.options().reduction == Reduction::mean);
  CHECK(default_loss.options().ignore_index == -100);
}

TEMPLATE_TEST_CASE("cross_entropy_forward_backward in place (dlogits = logits)", "[cross_entropy][in_place]", float,
                   double) {
  using S = TestType;
  const Index B = 2, T = 4, N = B * T, V = 9;
  const RowMatrix<S> logits = random_matrix<S>(N, V, 16, kLogitSpread);
  IdMatrix<std::int32_t> targets = random_ids<std::int32_t>(B, T, V, 17);
  targets(1, 0) = -100;
  RowMatrix<S> separate(N, V);
  const auto expected = embedhead::cross_entropy_forward_backward<S>(logits, targets, separate);
  RowMatrix<S> buffer = logits;
  const auto r = embedhead::cross_entropy_forward_backward<S>(buffer, targets, buffer);
  CHECK(r.loss == expected.loss);
  CHECK(r.count == expected.count);
  CHECK(same_values(buffer, separate));
}

TEMPLATE_TEST_CASE("cross_entropy worked example from the seeds", "[cross_entropy][seeds]", float, double) {
  using S = TestType;
  // E = [[0.1, 0.2], [0.3, -0.1], [0.0, 0.5]], h = (1, 2): z = E h = [0.5, 0.1, 1.0], target 2.
  RowMatrix<S> z(1, 3);
  z << S(0.5), S(0.1), S(1.0);
  IdMatrix<std::int32_t> y(1, 1);
  y << 2;

  // The softmax by hand: e^0.5, e^0.1, e^1 over their sum.
  const double e0 = std::exp(0.5), e1 = std::exp(0.1), e2 = std::exp(1.0), total = e0 + e1 + e2;
  const double p[3] = {e0 / total, e1 / total, e2 / total};
  const double tol = std::is_same<S, float>::value ? 1e-6 : 1e-14;

  RowMatrix<S> dlogits(1, 3);
  const auto r = embedhead::cross_entropy_forward_backward<S>(z, y, dlogits, with(Reduction::sum));
  // softmax = dlogits + one_hot(y).
  const double softmax[3] = {static_cast<double>(dlogits(0, 0)), static_cast<double>(dlogits(0, 1)),
                             static_cast<double>(dlogits(0, 2)) + 1.0};
  // The seeds' rounded values: p ~ [0.301, 0.202, 0.497].
  CHECK_THAT(softmax[0], WithinAbs(0.301, 5e-4));
  CHECK_THAT(softmax[1], WithinAbs(0.202, 5e-4));
  CHECK_THAT(softmax[2], WithinAbs(0.497, 5e-4));
  for (int j = 0; j < 3; ++j) CHECK_THAT(softmax[j], WithinAbs(p[j], tol));
  // dlogits = p - one_hot ~ [0.301, 0.202, -0.503]; times h = (1, 2) it gives the seeds' tied
  // gradient rows [0.301, 0.603], [0.202, 0.404], [-0.503, -1.007].
  CHECK_THAT(static_cast<double>(dlogits(0, 2)), WithinAbs(-0.503, 5e-4));
  CHECK_THAT(2.0 * static_cast<double>(dlogits(0, 0)), WithinAbs(0.603, 5e-4));
  CHECK_THAT(2.0 * static_cast<double>(dlogits(0, 2)), WithinAbs(-1.007, 5e-4));

  // loss = -log p_2 = -log(0.4967...) = 0.6996...
  CHECK_THAT(r.loss, WithinAbs(-std::log(p[2]), tol));
  CHECK_THAT(r.loss, WithinAbs(0.6996, 1e-4));
  CHECK(r.count == 1);
}

TEMPLATE_TEST_CASE("cross_entropy rejects bad input and writes nothing", "[cross_entropy][errors]", float, double) {
  using S = TestType;
  const Index B = 2, T = 3, N = B * T, V = 5;
  const RowMatrix<S> logits = random_matrix<S>(N, V, 18, kLogitSpread);
  const S sentinel = S(-12.5);
  RowMatrix<S> dlogits = RowMatrix<S>::Constant(N, V, sentinel);
  RowMatrix<S> losses = RowMatrix<S>::Constant(N, 1, sentinel);
  auto check_untouched = [&] {
    CHECK((dlogits.array() == sentinel).all());
    CHECK((losses.array() == sentinel).all());
  };

  SECTION("target == V") {
    IdMatrix<std::int32_t> targets = IdMatrix<std::int32_t>::Zero(B, T);
    targets(1, 0) = 5;  // n = 3
    REQUIRE_THROWS_AS(embedhead::cross_entropy_forward_backward<S>(logits, targets, dlogits), embedhead::index_error);
    REQUIRE_THROWS_WITH(embedhead::cross_entropy_forward_backward<S>(logits, targets, dlogits),
                        Contains("cross_entropy_forward_backward") && Contains("target 5") && Contains("n=3") &&
                            Contains("(b=1, t=0)") && Contains("[0, 5)"));
    REQUIRE_THROWS_WITH(embedhead::cross_entropy_per_token<S>(logits, targets, losses),
                        Contains("target 5") && Contains("n=3") && Contains("[0, 5)"));
    REQUIRE_THROWS_WITH(embedhead::cross_entropy<S>(logits, targets),
                        Contains("target 5") && Contains("n=3") && Contains("[0, 5)"));
    REQUIRE_THROWS_WITH(embedhead::CrossEntropyLoss<S>().forward_backward(logits, targets, dlogits),
                        Contains("CrossEntropyLoss::forward_backward") && Contains("target 5"));
    check_untouched();
  }

  SECTION("negative target that is not ignore_index, int64, reported first in row-major order") {
    IdMatrix<std::int64_t> targets = IdMatrix<std::int64_t>::Zero(B, T);
    targets(0, 2) = -1;    // n = 2, the first bad one
    targets(1, 2) = 77;    // n = 5
    targets(1, 1) = -100;  // ignored, not an error
    REQUIRE_THROWS_AS(embedhead::cross_entropy_forward_backward<S>(logits, targets, dlogits), embedhead::index_error);
    REQUIRE_THROWS_WITH(embedhead::cross_entropy_forward_backward<S>(logits, targets, dlogits),
                        Contains("target -1") && Contains("n=2") && Contains("[0, 5)") && Contains("-100"));
    REQUIRE_THROWS_WITH(embedhead::CrossEntropyLoss<S>().forward(logits, targets),
                        Contains("CrossEntropyLoss::forward") && Contains("target -1"));
    check_untouched();
  }

  SECTION("targets with the wrong count") {
    const IdMatrix<std::int32_t> targets = IdMatrix<std::int32_t>::Zero(B, T + 1);
    REQUIRE_THROWS_AS(embedhead::cross_entropy_forward_backward<S>(logits, targets, dlogits), embedhead::shape_error);
    REQUIRE_THROWS_WITH(embedhead::cross_entropy_forward_backward<S>(logits, targets, dlogits),
                        Contains("targets") && Contains("8") && Contains("N = 6"));
    REQUIRE_THROWS_WITH(embedhead::cross_entropy_per_token<S>(logits, targets, losses), Contains("N = 6"));
    const IdMatrix<std::int32_t> too_few = IdMatrix<std::int32_t>::Zero(N - 1, 1);
    REQUIRE_THROWS_WITH(embedhead::cross_entropy<S>(logits, too_few), Contains("5 entries") && Contains("N = 6"));
    check_untouched();
  }

  SECTION("dlogits wrong shape (checked before the targets)") {
    IdMatrix<std::int32_t> targets = IdMatrix<std::int32_t>::Zero(B, T);
    RowMatrix<S> wrong = RowMatrix<S>::Constant(N, V + 1, sentinel);
    REQUIRE_THROWS_AS(embedhead::cross_entropy_forward_backward<S>(logits, targets, wrong), embedhead::shape_error);
    REQUIRE_THROWS_WITH(embedhead::cross_entropy_forward_backward<S>(logits, targets, wrong),
                        Contains("dlogits") && Contains("[6, 6]") && Contains("expected [6, 5]"));
    CHECK((wrong.array() == sentinel).all());
    targets(0, 0) = 9;
    REQUIRE_THROWS_AS(embedhead::cross_entropy_forward_backward<S>(logits, targets, wrong), embedhead::shape_error);
    check_untouched();
  }

  SECTION("losses wrong shape") {
    const IdMatrix<std::int32_t> targets = IdMatrix<std::int32_t>::Zero(B, T);
    RowMatrix<S> wrong = RowMatrix<S>::Constant(N, 2, sentinel);
    REQUIRE_THROWS_AS(embedhead::cross_entropy_per_token<S>(logits, targets, wrong), embedhead::shape_error);
    REQUIRE_THROWS_WITH(embedhead::cross_entropy_per_token<S>(logits, targets, wrong),
                        Contains("losses") && Contains("[6, 2]") && Contains("expected [6, 1]"));
    RowMatrix<S> row_shaped = RowMatrix<S>::Constant(1, N, sentinel);
    REQUIRE_THROWS_AS(embedhead::cross_entropy_per_token<S>(logits, targets, row_shaped), embedhead::shape_error);
    CHECK((wrong.array() == sentinel).all());
    CHECK((row_shaped.array() == sentinel).all());
    check_untouched();
  }

  SECTION("a bad target after good rows: the good rows are not written either") {
    IdMatrix<std::int32_t> targets = IdMatrix<std::int32_t>::Ones(B, T);
    targets(1, 2) = 5;  // the last row
    REQUIRE_THROWS_AS(embedhead::cross_entropy_forward_backward<S>(logits, targets, dlogits), embedhead::index_error);
    REQUIRE_THROWS_AS(embedhead::cross_entropy_per_token<S>(logits, targets, losses), embedhead::index_error);
    check_untouched();
  }
}

TEMPLATE_TEST_CASE("cross_entropy: the loss and gradient do not depend on where the logits live",
                   "[cross_entropy][determinism]", float, double) {
  // Vectorised loops over a row peel scalar iterations up to an aligned address, and the scalar
  // exp and tanh round differently from the packet ones (up to 2 ulp): the library's fixed 16-lane
  // order must not. Copy the same logits to every offset of a buffer (0..15 scalars), write dlogits
  // at another offset (or in place), and require bit-identical results, with and without the
  // soft-cap (its tanh and its gradient's exp run on every element).
  using S = TestType;
  const Index N = 3, V = 53;  // V not a multiple of 16: lanes and tail both used
  std::mt19937 gen(7);
  std::normal_distribution<double> normal(0.0, 3.0);
  RowMatrix<S> logits(N, V);
  for (Index i = 0; i < logits.size(); ++i) logits.data()[i] = static_cast<S>(normal(gen));
  IdMatrix<std::int32_t> targets(1, N);
  targets << 4, 52, 0;
  CrossEntropyOptions softcap;
  softcap.softcap = 1.7;
  CrossEntropyOptions everything = softcap;
  everything.label_smoothing = 0.1;
  everything.z_loss = 1e-2;
  everything.ignore_index = 0;  // the third row
  everything.reduction = Reduction::none;

  for (const CrossEntropyOptions& options : {CrossEntropyOptions{}, softcap, everything}) {
    INFO("softcap " << options.softcap << ", label_smoothing " << options.label_smoothing);
    RowMatrix<S> dlogits_ref(N, V), losses_ref(N, 1);
    const auto ref = embedhead::cross_entropy_forward_backward<S>(logits, targets, dlogits_ref, losses_ref, options);
    std::vector<S> buffer(static_cast<std::size_t>(N * V + 16)), grad_buffer(buffer.size());
    for (Index offset = 0; offset < 16; ++offset) {
      INFO("offset " << offset);
      Eigen::Map<RowMatrix<S>> moved(buffer.data() + offset, N, V);
      Eigen::Map<RowMatrix<S>> dmoved(grad_buffer.data() + (15 - offset), N, V);
      moved = logits;
      RowMatrix<S> losses(N, 1);
      const auto r = embedhead::cross_entropy_forward_backward<S>(moved, targets, dmoved, losses, options);
      CHECK(r.sum == ref.sum);
      CHECK(embedhead::cross_entropy<S>(moved, targets, options).sum == ref.sum);
      CHECK(first_difference(RowMatrix<S>(dmoved), dlogits_ref) == "");
      CHECK(first_difference(losses, losses_ref) == "");
      // In place: dlogits is the logits' own (misaligned) storage.
      const auto in_place = embedhead::cross_entropy_forward_backward<S>(moved, targets, moved, options);
      CHECK(in_place.sum == ref.sum);
      CHECK(first_difference(RowMatrix<S>(moved), dlogits_ref) == "");
    }
  }
}

TEMPLATE_TEST_CASE("the softmax core's elementwise kernels give the same bits at every address and column",
                   "[cross_entropy][determinism]", float, double) {
  // detail/softmax.hpp, shared by every loss: the fused loss runs them on rows of its logits
  // buffer, whose alignment varies from row to row, so the plain loss's offsets test above does
  // not reach all of them. Each kernel runs on the same row copied to 16 offsets (in place and
  // out of place); and on a row of one repeated value, whose outputs must all be equal: lanes and
  // the padded tail alike. A peeled loop computes only the few values before the first aligned
  // address apart, so the row is long and drawn 20 times.
  using S = TestType;
  namespace d = embedhead::detail;
  const Index width = 997;  // 62 blocks of 16 and a tail of 5
  const S cap = S(1.7);
  d::SoftmaxTerms terms;
  terms.classes = width;
  terms.label_smoothing = 0.1;
  d::SoftmaxTerms capped = terms;
  capped.softcap = cap;
  std::mt19937 gen(11);
  std::normal_distribution<double> normal(0.0, 3.0);
  std::vector<S> row(static_cast<std::size_t>(width));
  for (int draw = 0; draw < 20; ++draw) {
    INFO("draw " << draw);
    for (S& x : row) x = static_cast<S>(normal(gen));
    const S m = *std::max_element(row.begin(), row.end());
    const auto k = d::softmax_gradient_at_lse<S>(static_cast<double>(m) + 1.5, 0.25, terms);
    const auto k_exp = d::softmax_gradient_at_max<S>(d::SoftmaxRowStats{static_cast<double>(m), 9.0, 0, 0}, 3.0, 0.25,
                                                     terms);
    // Each kernel as a function of (input, output) pointers; sums are kept apart.
    double sum = 0;
    auto gradient = [&](const S* in, S* out, Index y, const auto& coefficients, const auto& options, bool holds_exp) {
      if (in != out) std::copy_n(in, width, out);
      d::apply_softmax_gradient(out, width, y, coefficients, options, holds_exp);
    };
    const std::vector<std::pair<const char*, std::function<void(const S*, S*)>>> kernels{
        {"softcap_row", [&](const S* in, S* out) { d::softcap_row(in, out, width, cap); }},
        {"sum_exp_shifted", [&](const S* in, S* out) { sum = d::sum_exp_shifted(in, width, m, out); }},
        {"add_at_max: the sum of the logits (label smoothing)",
         [&](const S* in, S* out) {
           if (in != out) std::copy_n(in, width, out);  // (no output: the row passes through)
           d::SoftmaxRowStats stats;
           stats.max = static_cast<double>(m);
           stats.add_at_max(in, width, 5, terms, static_cast<S*>(nullptr));
           sum = stats.logit_sum;
         }},
        {"gradient at the lse", [&](const S* in, S* out) { gradient(in, out, 3, k, terms, false); }},
        {"gradient with the soft-cap", [&](const S* in, S* out) { gradient(in, out, 30, k, capped, false); }},
        {"gradient from the exponentials", [&](const S* in, S* out) { gradient(in, out, 7, k_exp, terms, true); }}};
    for (const auto& [name, kernel] : kernels) {
      INFO(name);
      std::vector<S> expected(static_cast<std::size_t>(width));
      kernel(row.data(), expected.data());
      const double expected_sum = sum;
      std::vector<S> in(static_cast<std::size_t>(width + 16)), out(in.size());
      for (Index offset = 0; offset < 16; ++offset) {
        INFO("offset " << offset);
        std::copy(row.begin(), row.end(), in.begin() + offset);
        kernel(in.data() + offset, out.data() + (15 - offset));
        CHECK(std::equal(expected.begin(), expected.end(), out.begin() + (15 - offset)));
        CHECK(sum == expected_sum);
        kernel(in.data() + offset, in.data() + offset);  // in place
        CHECK(std::equal(expected.begin(), expected.end(), in.begin() + offset));
        CHECK(sum == expected_sum);
      }
    }
  }
  // A repeated value: every column's output the same (the capped values, the exponentials, dz).
  const auto k = d::softmax_gradient_at_lse<S>(2.0, 0.25, terms);
  for (Index offset = 0; offset < 16; ++offset) {
    INFO("offset " << offset);
    std::vector<S> in(static_cast<std::size_t>(width + 16), S(-0.7)), out(in.size());
    auto all_equal = [&](const std::vector<S>& v) {
      return std::all_of(v.begin() + offset, v.begin() + offset + width, [&](S x) { return x == v[offset]; });
    };
    d::softcap_row(in.data() + offset, out.data() + offset, width, cap);
    CHECK(all_equal(out));
    d::sum_exp_shifted(in.data() + offset, width, S(0.3), out.data() + offset);
    CHECK(all_equal(out));
    d::apply_softmax_gradient(in.data() + offset, width, -1, k, capped, false);
    CHECK(all_equal(in));
  }
}

TEMPLATE_TEST_CASE("cross_entropy_forward_backward with losses: one pass gives both outputs", "[cross_entropy][none]",
                   float, double) {
  using S = TestType;
  const Index N = 6, V = 21;
  std::mt19937 gen(3);
  std::normal_distribution<double> normal(0.0, 2.0);
  RowMatrix<S> logits(N, V);
  for (Index i = 0; i < logits.size(); ++i) logits.data()[i] = static_cast<S>(normal(gen));
  IdMatrix<std::int64_t> targets(2, 3);
  targets << 0, 20, -100, 7, 7, 3;
  CrossEntropyOptions options;
  options.reduction = Reduction::none;

  RowMatrix<S> dlogits(N, V), losses(N, 1), dlogits_ref(N, V), losses_ref(N, 1);
  const auto both = embedhead::cross_entropy_forward_backward<S>(logits, targets, dlogits, losses, options);
  const auto grad_only = embedhead::cross_entropy_forward_backward<S>(logits, targets, dlogits_ref, options);
  embedhead::cross_entropy_per_token<S>(logits, targets, losses_ref, options);
  CHECK(dlogits == dlogits_ref);
  CHECK(losses == losses_ref);
  CHECK(both.sum == grad_only.sum);
  CHECK(both.count == 5);
  CHECK(losses(2, 0) == S(0));  // the ignored row
  RowMatrix<S> dlogits_class(N, V), losses_class(N, 1);
  embedhead::CrossEntropyLoss<S>(options).forward_backward(logits, targets, dlogits_class, losses_class);
  CHECK(dlogits_class == dlogits);
  CHECK(losses_class == losses);

  RowMatrix<S> wrong(N + 1, 1);
  wrong.setConstant(S(9));
  dlogits.setConstant(S(9));
  REQUIRE_THROWS_AS(embedhead::cross_entropy_forward_backward<S>(logits, targets, dlogits, wrong, options),
                    embedhead::shape_error);
  REQUIRE_THROWS_WITH(embedhead::cross_entropy_forward_backward<S>(logits, targets, dlogits, wrong, options),
                      Contains("losses") && Contains("[7, 1]") && Contains("[6, 1]"));
  CHECK(dlogits == RowMatrix<S>::Constant(N, V, S(9)));
  CHECK(wrong == RowMatrix<S>::Constant(N + 1, 1, S(9)));
}

// ---- the large-vocabulary options: label smoothing, z-loss, soft-capping, padded vocabulary ----

TEST_CASE("cross_entropy options: hand-computed values", "[cross_entropy][options][seeds]") {
  // z = [0, ln 3]: softmax = [1/4, 3/4], lse = ln 4. Target 0.
  RowMatrix<double> z(1, 2);
  z << 0.0, std::log(3.0);
  IdMatrix<std::int32_t> y(1, 1);
  y << 0;
  SECTION("label smoothing eps = 0.2: 0.8 * ln 4 + 0.2 * (ln 4 + ln 4/3) / 2, PyTorch's definition") {
    CrossEntropyOptions o;
    o.label_smoothing = 0.2;
    RowMatrix<double> dz(1, 2);
    const auto r = embedhead::cross_entropy_forward_backward<double>(z, y, dz, o);
    CHECK_THAT(r.loss, WithinRel(0.8 * std::log(4.0) + 0.1 * (std::log(4.0) + std::log(4.0 / 3.0)), 1e-14));
    // d/dz = softmax - (1 - eps) one_hot - eps / V = [0.25 - 0.8 - 0.1, 0.75 - 0.1]
    CHECK_THAT(dz(0, 0), WithinAbs(-0.65, 1e-15));
    CHECK_THAT(dz(0, 1), WithinAbs(0.65, 1e-15));
  }
  SECTION("z-loss 0.1: ln 4 + 0.1 * (ln 4)^2, reported separately too") {
    CrossEntropyOptions o;
    o.z_loss = 0.1;
    const auto r = embedhead::cross_entropy<double>(z, y, o);
    const double lse = std::log(4.0);
    CHECK_THAT(r.loss, WithinRel(lse + 0.1 * lse * lse, 1e-14));
    CHECK_THAT(r.z_loss, WithinRel(0.1 * lse * lse, 1e-14));
  }
  SECTION("soft-cap c = 1: logits become tanh(z)") {
    CrossEntropyOptions o;
    o.softcap = 1.0;
    const double s1 = std::tanh(std::log(3.0));  // = 0.8
    const auto r = embedhead::cross_entropy<double>(z, y, o);
    CHECK_THAT(r.loss, WithinRel(std::log(1.0 + std::exp(s1)), 1e-14));
  }
  SECTION("padded vocabulary: a third column that never counts") {
    RowMatrix<double> padded(1, 3);
    padded << 0.0, std::log(3.0), 50.0;
    CrossEntropyOptions o;
    o.valid_vocab = 2;
    RowMatrix<double> dz = RowMatrix<double>::Constant(1, 3, 9.0);
    const auto r = embedhead::cross_entropy_forward_backward<double>(padded, y, dz, o);
    CHECK_THAT(r.loss, WithinRel(std::log(4.0), 1e-14));
    CHECK_THAT(dz(0, 0), WithinAbs(-0.75, 1e-15));
    CHECK_THAT(dz(0, 1), WithinAbs(0.75, 1e-15));
    CHECK(dz(0, 2) == 0.0);
  }
}

TEMPLATE_TEST_CASE("cross_entropy options match the naive definition", "[cross_entropy][options][naive]", float,
                   double) {
  using Scalar = TestType;
  const Index V = 19, classes = 17;
  const RowMatrix<Scalar> logits = random_matrix<Scalar>(10, V, 1201, kLogitSpread);
  IdMatrix<std::int64_t> targets = random_ids<std::int64_t>(2, 5, classes, 1202);
  targets(1, 2) = -100;
  for (Reduction reduction : {Reduction::mean, Reduction::sum, Reduction::none}) {
    CAPTURE(name_of(reduction));
    CrossEntropyOptions o;
    o.reduction = reduction;
    o.label_smoothing = 0.1;
    o.z_loss = 1e-3;
    o.softcap = 2.0;
    o.valid_vocab = classes;
    o.gradient_scale = 2.0;
    o.entropy_bonus = 0.3;
    RowMatrix<Scalar> dz(10, V), losses(10, 1);
    const auto r = embedhead::cross_entropy_forward_backward<Scalar>(logits, targets, dz, losses, o);
    naive::LossOptions ref;
    ref.mean = reduction == Reduction::mean;
    ref.label_smoothing = 0.1;
    ref.z_loss = 1e-3;
    ref.softcap = 2.0;
    ref.classes = classes;
    ref.gradient_scale = 2.0;
    ref.entropy_bonus = 0.3;
    const naive::LossResult expected = naive::full_loss(logits.template cast<double>(), targets, {}, ref);
    CHECK(r.count == 9);
    CHECK_THAT(r.loss, WithinRel(expected.loss, loss_tolerance<Scalar>()));
    CHECK_THAT(r.entropy, WithinRel(expected.entropy, loss_tolerance<Scalar>()));
    for (Index n = 0; n < 10; ++n) {
      CHECK_THAT(static_cast<double>(losses(n, 0)), WithinAbs(expected.losses[n], 4 * loss_tolerance<Scalar>()));
      for (Index j = 0; j < V; ++j) {
        CAPTURE(n, j);
        CHECK_THAT(static_cast<double>(dz(n, j)), WithinAbs(expected.dlogits(n, j), 4 * loss_tolerance<Scalar>()));
      }
    }
    // The loss alone (a scratch row for the soft-cap) is the same number.
    CHECK(embedhead::cross_entropy<Scalar>(logits, targets, o).loss == r.loss);
  }
}

TEST_CASE("cross_entropy options gradient check in double", "[cross_entropy][options][gradient]") {
  RowMatrix<double> logits = random_matrix<double>(4, 7, 1301, kLogitSpread);
  IdMatrix<std::int32_t> targets(2, 2);
  targets << 3, 0, 5, 3;
  CrossEntropyOptions o;
  o.label_smoothing = 0.3;
  o.z_loss = 0.05;
  o.softcap = 1.7;
  o.valid_vocab = 6;
  for (const double bonus : {0.0, 0.4, -0.7}) {
    CAPTURE(bonus);
    o.entropy_bonus = bonus;
    for (const bool capped : {true, false}) {
      o.softcap = capped ? 1.7 : 0.0;
      RowMatrix<double> dz(4, 7);
      embedhead::cross_entropy_forward_backward<double>(logits, targets, dz, o);
      const RowMatrix<double> numeric = naive::numerical_gradient(logits, [&] {
        return embedhead::cross_entropy<double>(logits, targets, o).loss;
      });
      CHECK(naive::max_relative_error(dz, numeric, 1e-6) < 1e-6);
      // In place (dlogits = logits) gives the same gradient.
      RowMatrix<double> inplace = logits;
      embedhead::cross_entropy_forward_backward<double>(inplace, targets, inplace, o);
      CHECK((inplace.array() == dz.array()).all());
    }
  }
}

TEST_CASE("cross_entropy entropy bonus: hand-computed values", "[cross_entropy][options][entropy]") {
  // Two classes, logits (0, 0): p = (1/2, 1/2), H = ln 2; target 0: ce = ln 2. With beta = 0.5
  // the loss is ln 2 - 0.5 ln 2 = (ln 2) / 2; the entropy's gradient is beta p_j (log p_j + H) =
  // 0.5 * 0.5 * (-ln 2 + ln 2) = 0 at the uniform distribution (its maximum), so dz = p - onehot.
  RowMatrix<double> logits = RowMatrix<double>::Zero(1, 2);
  IdMatrix<std::int32_t> targets(1, 1);
  targets << 0;
  CrossEntropyOptions o;
  o.entropy_bonus = 0.5;
  RowMatrix<double> dz(1, 2);
  const auto r = embedhead::cross_entropy_forward_backward<double>(logits, targets, dz, o);
  CHECK(r.loss == Approx(0.5 * std::log(2.0)).epsilon(1e-15));
  CHECK(r.entropy == Approx(std::log(2.0)).epsilon(1e-15));
  CHECK(dz(0, 0) == Approx(-0.5).epsilon(1e-15));
  CHECK(dz(0, 1) == Approx(0.5).epsilon(1e-15));
  // Logits (ln 3, 0): p = (3/4, 1/4), H = -(3/4) ln(3/4) - (1/4) ln(1/4); the bonus's gradient
  // at class 0 is beta (3/4) (ln(3/4) + H).
  logits(0, 0) = std::log(3.0);
  const auto r2 = embedhead::cross_entropy_forward_backward<double>(logits, targets, dz, o);
  const double H = -0.75 * std::log(0.75) - 0.25 * std::log(0.25);
  CHECK(r2.entropy == Approx(H).epsilon(1e-14));
  CHECK(r2.loss == Approx(-std::log(0.75) - 0.5 * H).epsilon(1e-14));
  CHECK(dz(0, 0) == Approx(0.75 - 1 + 0.5 * 0.75 * (std::log(0.75) + H)).epsilon(1e-14));
  CHECK(dz(0, 1) == Approx(0.25 + 0.5 * 0.25 * (std::log(0.25) + H)).epsilon(1e-14));
  // Without the bonus and without `entropy`, no entropy is computed: 0.
  o.entropy_bonus = 0;
  CHECK(embedhead::cross_entropy<double>(logits, targets, o).entropy == 0.0);
  o.entropy = true;
  CHECK(embedhead::cross_entropy<double>(logits, targets, o).entropy == Approx(H).epsilon(1e-14));
  o.entropy_bonus = std::numeric_limits<double>::infinity();
  dz.setConstant(7.0);
  REQUIRE_THROWS_MATCHES(embedhead::cross_entropy_forward_backward<double>(logits, targets, dz, o),
                         embedhead::value_error,
                         Catch::Message(
                             "cross_entropy_forward_backward: entropy_bonus = inf outside the finite numbers"));
  CHECK((dz.array() == 7.0).all());  // nothing written
}

TEMPLATE_TEST_CASE("cross_entropy rejects options out of range and writes nothing", "[cross_entropy][options][errors]",
                   float, double) {
  using Scalar = TestType;
  const RowMatrix<Scalar> logits = random_matrix<Scalar>(2, 5, 1401);
  IdMatrix<std::int32_t> targets(1, 2);
  targets << 1, 4;
  RowMatrix<Scalar> dz = RowMatrix<Scalar>::Constant(2, 5, 7);
  const RowMatrix<Scalar> before = dz;
  CrossEntropyOptions o;
  o.label_smoothing = -0.1;
  CHECK_THROWS_WITH(embedhead::cross_entropy_forward_backward<Scalar>(logits, targets, dz, o),
                    Contains("cross_entropy_forward_backward: label_smoothing = -0.1 outside [0, 1]"));
  o = {};
  o.softcap = -1;
  CHECK_THROWS_AS(embedhead::cross_entropy<Scalar>(logits, targets, o), embedhead::value_error);
  o = {};
  o.valid_vocab = 4;  // target 4 becomes a padding column
  CHECK_THROWS_WITH(embedhead::cross_entropy_forward_backward<Scalar>(logits, targets, dz, o),
                    Contains(
                        "target 4 at n=1 (b=0, t=1) outside [0, 4) and not ignore_index (-100); columns [4, 5) are "
                        "vocabulary padding"));
  o.valid_vocab = 6;
  CHECK_THROWS_WITH(embedhead::cross_entropy_forward_backward<Scalar>(logits, targets, dz, o),
                    Contains("valid_vocab = 6 outside [1, 5] (or -1 for all V = 5 columns)"));
  CHECK(same_values(dz, before));
}

TEMPLATE_TEST_CASE("loss options are checked in the Scalar the loss computes in; nothing written",
                   "[cross_entropy][options][errors]", float, double) {
  using Scalar = TestType;
  constexpr bool is_float = std::is_same_v<Scalar, float>;
  const RowMatrix<Scalar> logits = random_matrix<Scalar>(2, 5, 1411);
  IdMatrix<std::int32_t> targets(1, 2);
  targets << 1, 4;
  // Each value is finite (and the positive ones positive) in double, but 0 or inf in float, where
  // it made NaN or inf gradients: softcap 1e-50 divides by 0, softcap 1e300 multiplies 0 by inf,
  // gradient_scale and z_loss of 1e300 make the gradient's factor inf, and gradient_scale 1e-50
  // silently zeroes every gradient.
  struct Case {
    double CrossEntropyOptions::*field;
    double value;
    const char* message;
  };
  const std::vector<Case> cases = {
      {&CrossEntropyOptions::softcap, 1e-50, "softcap = 1e-50 outside [0, inf) (0: off) in float: it rounds to 0"},
      {&CrossEntropyOptions::softcap, 1e300, "softcap = 1e+300 outside [0, inf) (0: off) in float: it rounds to inf"},
      {&CrossEntropyOptions::gradient_scale, 1e300,
       "gradient_scale = 1e+300 outside the finite numbers in float: it rounds to inf"},
      {&CrossEntropyOptions::gradient_scale, -1e300,
       "gradient_scale = -1e+300 outside the finite numbers in float: it rounds to inf"},
      {&CrossEntropyOptions::gradient_scale, 1e-50,
       "gradient_scale = 1e-50 outside the finite numbers in float: it rounds to 0"},
      {&CrossEntropyOptions::z_loss, 1e300, "z_loss = 1e+300 outside [0, inf) in float: it rounds to inf"},
      {&CrossEntropyOptions::entropy_bonus, 1e300,
       "entropy_bonus = 1e+300 outside the finite numbers in float: it rounds to inf"},
  };
  for (const Case& c : cases) {
    INFO(c.message);
    CrossEntropyOptions o;
    o.*c.field = c.value;
    RowMatrix<Scalar> dz = RowMatrix<Scalar>::Constant(2, 5, 7);
    if constexpr (is_float) {
      CHECK_THROWS_AS(embedhead::cross_entropy_forward_backward<Scalar>(logits, targets, dz, o),
                      embedhead::value_error);
      CHECK_THROWS_WITH(embedhead::cross_entropy_forward_backward<Scalar>(logits, targets, dz, o),
                        Contains(std::string("cross_entropy_forward_backward: ") + c.message));
      CHECK_THROWS_WITH(embedhead::cross_entropy<Scalar>(logits, targets, o), Contains(c.message));
      CHECK(dz == RowMatrix<Scalar>::Constant(2, 5, 7));
    } else {
      // In double each is an ordinary value: a finite loss and gradient.
      const auto result = embedhead::cross_entropy_forward_backward<Scalar>(logits, targets, dz, o);
      CHECK(std::isfinite(result.loss));
      CHECK(dz.allFinite());
    }
  }
}

TEMPLATE_TEST_CASE("Reduction::none: the per-token losses, and loss defined as their sum", "[cross_entropy][none]",
                   float, double) {
  using S = TestType;
  const Index B = 2, T = 5, N = B * T, V = 7;
  const RowMatrix<S> logits = random_matrix<S>(N, V, 1301, kLogitSpread);
  IdMatrix<std::int32_t> targets = random_ids<std::int32_t>(B, T, V, 1302);
  targets(1, 3) = -100;
  const double tol = loss_tolerance<S>();

  // Naive per-token losses in double: lse(z) - z_y, 0 for the ignored row.
  std::vector<double> naive_losses(static_cast<std::size_t>(N), 0.0);
  for (Index n = 0; n < N; ++n) {
    const Index y = targets(n / T, n % T);
    if (y == -100) continue;
    double m = -1e300;
    for (Index j = 0; j < V; ++j) m = std::max(m, static_cast<double>(logits(n, j)));
    double s = 0;
    for (Index j = 0; j < V; ++j) s += std::exp(static_cast<double>(logits(n, j)) - m);
    naive_losses[static_cast<std::size_t>(n)] = m + std::log(s) - static_cast<double>(logits(n, y));
  }

  RowMatrix<S> losses = RowMatrix<S>::Constant(N, 1, S(9)), dlogits(N, V), dlogits_sum(N, V);
  const auto none = embedhead::cross_entropy_forward_backward<S>(logits, targets, dlogits, losses,
                                                                 with(Reduction::none));
  const auto sum = embedhead::cross_entropy_forward_backward<S>(logits, targets, dlogits_sum, with(Reduction::sum));
  double losses_total = 0;
  for (Index n = 0; n < N; ++n) {
    CHECK_THAT(static_cast<double>(losses(n, 0)), WithinAbs(naive_losses[static_cast<std::size_t>(n)], tol) ||
                                                      WithinRel(naive_losses[static_cast<std::size_t>(n)], tol));
    losses_total += naive_losses[static_cast<std::size_t>(n)];
  }
  CHECK(losses(1 * T + 3, 0) == S(0));  // the ignored row
  // loss under none is the sum of the per-token losses: result.sum, bit for bit the sum reduction's.
  CHECK(none.loss == none.sum);
  CHECK(none.loss == sum.loss);
  CHECK_THAT(none.loss, WithinRel(losses_total, tol) || WithinAbs(losses_total, tol));
  CHECK(none.count == N - 1);
  // Its gradient is each loss_n's own: the same numbers as sum's.
  CHECK(same_values(dlogits, dlogits_sum));
  // The loss-only call and the per-token call agree with it.
  RowMatrix<S> losses2(N, 1);
  const auto per_token = embedhead::cross_entropy_per_token<S>(logits, targets, losses2, with(Reduction::none));
  CHECK(per_token.loss == none.loss);
  CHECK(same_values(losses2, losses));
  CHECK(embedhead::cross_entropy<S>(logits, targets, with(Reduction::none)).loss == none.loss);
}

TEMPLATE_TEST_CASE("cross_entropy: non-finite logits give PyTorch's results, row by row", "[cross_entropy][nonfinite]",
                   float, double) {
  // docs/errors.md, "Non-finite values". Each row holds one case; the rows around it show that a
  // bad row changes nothing else. A -inf logit is a class of probability exp(-inf) = 0, which is
  // also what a logit of -1e30 gives (exp(-1e30 - m) underflows to 0): so wherever the result is
  // defined, it equals the result on `finite`, the same logits with -inf replaced by -1e30, bit
  // for bit. NaN and +inf logits (PyTorch: NaN) and rows with no finite class (NaN) are checked
  // as NaN, the rest of their rows' columns included.
  using S = TestType;
  const S inf = std::numeric_limits<S>::infinity(), nan = std::numeric_limits<S>::quiet_NaN();
  const Index N = 9, V = 37, classes = 36;  // column 36 is vocabulary padding; 36 = 2 blocks of 16 + 4
  RowMatrix<S> logits = random_matrix<S>(N, V, 2101, kLogitSpread);
  IdMatrix<std::int32_t> targets(1, N);
  targets << 2, 2, 2, 2, 2, 2, 2, -100, 2;
  logits(1, 4) = nan;                                                  // 1: a NaN logit (not the target)
  logits(2, 0) = inf;                                                  // 2: a +inf logit
  logits(3, 0) = logits(3, 1) = logits(3, 20) = logits(3, 35) = -inf;  // 3: masked classes (not the target)
  logits(4, 2) = -inf;                                                 // 4: the target masked
  logits.row(5).head(classes).setConstant(-inf);                       // 5: every class masked
  logits(6, classes) = nan;                                            // 6: NaN in the padding column only
  logits(7, 0) = nan;                                                  // 7: an ignored row, NaN and +inf
  logits(7, 1) = inf;
  RowMatrix<S> finite = logits;
  for (Index i = 0; i < finite.size(); ++i)
    if (finite.data()[i] == -inf) finite.data()[i] = S(-1e30);
  const std::vector<Index> nan_rows{1, 2, 5};
  for (const Index n : nan_rows) finite.row(n).setZero();  // any finite row: the others do not see it
  finite(6, classes) = 0;
  finite.row(7).setZero();

  for (Reduction reduction : {Reduction::mean, Reduction::none}) {
    CAPTURE(name_of(reduction));
    CrossEntropyOptions o;
    o.valid_vocab = classes;
    o.reduction = reduction;
    RowMatrix<S> dz(N, V), losses(N, 1), dz_finite(N, V), losses_finite(N, 1);
    const auto r = embedhead::cross_entropy_forward_backward<S>(logits, targets, dz, losses, o);
    const auto r_finite = embedhead::cross_entropy_forward_backward<S>(finite, targets, dz_finite, losses_finite, o);
    CHECK(r.count == 8);  // the NaN rows count (the mean is NaN), the ignored row does not
    CHECK(r_finite.count == 8);
    CHECK(std::isnan(r.loss));
    CHECK(std::isnan(r.sum));
    for (Index n = 0; n < N; ++n) {
      CAPTURE(n);
      const bool nan_row = std::find(nan_rows.begin(), nan_rows.end(), n) != nan_rows.end();
      if (nan_row) {
        CHECK(std::isnan(losses(n, 0)));
        CHECK(dz.row(n).head(classes).array().isNaN().all());
        CHECK(dz(n, classes) == S(0));  // padding: 0 whatever the row
      } else if (n == 4) {
        CHECK(losses(n, 0) == inf);  // -log 0: PyTorch's inf, the gradient stays finite
        CHECK(first_difference(RowMatrix<S>(dz.row(n)), RowMatrix<S>(dz_finite.row(n))) == "");
        CHECK(dz(n, 2) == S(-1) / S(8) * (reduction == Reduction::mean ? S(1) : S(8)));
      } else {
        CHECK(losses(n, 0) == losses_finite(n, 0));
        CHECK(first_difference(RowMatrix<S>(dz.row(n)), RowMatrix<S>(dz_finite.row(n))) == "");
      }
    }
    for (const Index j : {0, 1, 20, 35}) CHECK(dz(3, j) == S(0));  // a masked class: exactly 0
    CHECK(dz.row(7).isZero(0));
    CHECK(losses(7, 0) == S(0));
    // The loss alone and the per-token losses alone: the same numbers.
    RowMatrix<S> losses_only(N, 1);
    embedhead::cross_entropy_per_token<S>(logits, targets, losses_only, o);
    CHECK(first_difference_nan(losses_only, losses) == "");
    CHECK(std::isnan(embedhead::cross_entropy<S>(logits, targets, o).loss));
    // In place as well.
    RowMatrix<S> in_place = logits;
    embedhead::cross_entropy_forward_backward<S>(in_place, targets, in_place, o);
    CHECK(first_difference_nan(in_place, dz) == "");
  }

  SECTION("label smoothing sums every class's logit: a masked class makes the loss +inf, dz stays finite") {
    // PyTorch's smoothing term -sum_j log p_j / C is +inf too; its gradient at a masked class is
    // -eps / C (times the scale), at the others p_j - eps / C - (1 - eps) [j = y].
    CrossEntropyOptions o;
    o.valid_vocab = classes;
    o.reduction = Reduction::sum;
    o.label_smoothing = 0.25;
    RowMatrix<S> dz(N, V), losses(N, 1);
    embedhead::cross_entropy_forward_backward<S>(logits, targets, dz, losses, o);
    CHECK(losses(3, 0) == inf);
    CHECK(dz.row(3).allFinite());
    for (const Index j : {0, 1, 20, 35}) CHECK(dz(3, j) == static_cast<S>(-0.25 / static_cast<double>(classes)));
    CHECK(std::isfinite(losses(0, 0)));  // a row without -inf: finite as always
  }
  SECTION("soft-capping maps +-inf to +-c: only the NaN row stays NaN") {
    // c tanh(+-inf / c) = +-c, as for any logit far beyond c: +-inf give what +-1e30 give.
    CrossEntropyOptions o;
    o.valid_vocab = classes;
    o.softcap = 2.5;
    RowMatrix<S> saturated = logits;
    for (Index i = 0; i < saturated.size(); ++i)
      if (std::isinf(saturated.data()[i])) saturated.data()[i] = saturated.data()[i] > 0 ? S(1e30) : S(-1e30);
    RowMatrix<S> dz(N, V), losses(N, 1), dz_saturated(N, V), losses_saturated(N, 1);
    embedhead::cross_entropy_forward_backward<S>(logits, targets, dz, losses, o);
    embedhead::cross_entropy_forward_backward<S>(saturated, targets, dz_saturated, losses_saturated, o);
    CHECK(first_difference_nan(losses, losses_saturated) == "");
    CHECK(first_difference_nan(dz, dz_saturated) == "");
    CHECK(std::isnan(losses(1, 0)));
    CHECK(dz.row(1).head(classes).array().isNaN().all());
    for (const Index n : {0, 2, 3, 4, 5, 6, 8}) {
      CAPTURE(n);
      CHECK(std::isfinite(losses(n, 0)));
      CHECK(dz.row(n).allFinite());
    }
    // Every class at -c: the uniform distribution, loss log 36, and a zero gradient (tanh saturated).
    CHECK_THAT(static_cast<double>(losses(5, 0)), WithinRel(std::log(36.0), 1e-6));
    CHECK(dz.row(5).isZero(0));
  }
}

TEMPLATE_TEST_CASE("cross_entropy with error_if_nonfinite rejects a NaN or infinite logit and writes nothing",
                   "[cross_entropy][nonfinite][errors]", float, double) {
  using S = TestType;
  const S inf = std::numeric_limits<S>::infinity(), nan = std::numeric_limits<S>::quiet_NaN();
  const Index B = 2, T = 3, N = B * T, V = 6;
  RowMatrix<S> logits = random_matrix<S>(N, V, 2201, kLogitSpread);
  IdMatrix<std::int32_t> targets(B, T);
  targets << 1, 2, 3, -100, 4, 0;
  CrossEntropyOptions o;
  o.error_if_nonfinite = true;
  o.valid_vocab = 5;  // column 5 is padding
  RowMatrix<S> dz = RowMatrix<S>::Constant(N, V, S(-3)), losses = RowMatrix<S>::Constant(N, 1, S(-4));
  const RowMatrix<S> dz0 = dz, losses0 = losses;
  auto unchanged = [&] {
    CHECK(same_values(dz, dz0));
    CHECK(same_values(losses, losses0));
  };

  SECTION("values that do not reach the loss are not checked: the ignored row, the padding column") {
    logits(3, 2) = nan;  // n = 3 is ignored
    logits(0, 5) = inf;  // padding
    RowMatrix<S> expected_dz(N, V), expected_losses(N, 1);
    CrossEntropyOptions off = o;
    off.error_if_nonfinite = false;
    const auto expected = embedhead::cross_entropy_forward_backward<S>(logits, targets, expected_dz, expected_losses,
                                                                       off);
    const auto r = embedhead::cross_entropy_forward_backward<S>(logits, targets, dz, losses, o);
    CHECK(r.loss == expected.loss);
    CHECK(std::isfinite(r.loss));
    CHECK(same_values(dz, expected_dz));
    CHECK(same_values(losses, expected_losses));
  }
  SECTION("the first bad logit in row-major order, with its row, position and column") {
    logits(4, 3) = -inf;  // n = 4: also reported, but after n = 2
    logits(2, 4) = nan;
    REQUIRE_THROWS_AS(embedhead::cross_entropy_forward_backward<S>(logits, targets, dz, losses, o),
                      embedhead::value_error);
    REQUIRE_THROWS_WITH(embedhead::cross_entropy_forward_backward<S>(logits, targets, dz, losses, o),
                        Contains("cross_entropy_forward_backward: logit nan at n=2 (b=0, t=2), column 4, outside the "
                                 "finite numbers (error_if_nonfinite)"));
    REQUIRE_THROWS_WITH(embedhead::cross_entropy<S>(logits, targets, o), Contains("cross_entropy: logit nan at n=2"));
    REQUIRE_THROWS_WITH(embedhead::cross_entropy_per_token<S>(logits, targets, losses, o),
                        Contains("cross_entropy_per_token: logit nan at n=2"));
    REQUIRE_THROWS_WITH(embedhead::CrossEntropyLoss<S>(o).forward_backward(logits, targets, dz),
                        Contains("CrossEntropyLoss::forward_backward: logit nan at n=2"));
    logits(2, 4) = 0;
    // -inf too: the option makes every non-finite logit an error, masks included.
    REQUIRE_THROWS_WITH(embedhead::CrossEntropyLoss<S>(o).forward(logits, targets),
                        Contains("CrossEntropyLoss::forward: logit -inf at n=4 (b=1, t=1), column 3, outside the "
                                 "finite numbers"));
    unchanged();
  }
  SECTION("in place: logits (= dlogits) unchanged") {
    logits(5, 0) = inf;
    RowMatrix<S> buffer = logits;
    REQUIRE_THROWS_WITH(embedhead::cross_entropy_forward_backward<S>(buffer, targets, buffer, o),
                        Contains("logit inf at n=5 (b=1, t=2), column 0"));
    CHECK(first_difference(buffer, logits) == "");
  }
  SECTION("checked after the other arguments: a bad target is reported first") {
    logits(0, 0) = nan;
    targets(1, 2) = 9;
    REQUIRE_THROWS_AS(embedhead::cross_entropy_forward_backward<S>(logits, targets, dz, o), embedhead::index_error);
    unchanged();
  }
}

// ---- class weights (PyTorch's weight=) ----

namespace {

CrossEntropyOptions class_weighted(Index C) {
  CrossEntropyOptions o;
  o.class_weights = test_support::class_weights(C);
  return o;
}

}  // namespace

TEST_CASE("cross_entropy class weights: hand-computed values (PyTorch's weight= and label smoothing)",
          "[cross_entropy][options][class_weights]") {
  // Three rows of logits (ln 3, 0): p = (3/4, 1/4); targets 0, 1, 1; u = (1, 3), so the weight sum
  // is 1 + 3 + 3 = 7. Without smoothing loss_n = -u_y log p_y; with eps = 1/2 and C = 2 (U = 4)
  //   loss_n = (1/2) u_y (-log p_y) + (1/4) (-log p_0 - 3 log p_1)
  //   dz_n   = ((1/2) u_y (p - e_y) + (1/4) (U p - u)) / 7
  RowMatrix<double> logits(3, 2);
  logits << std::log(3.0), 0, std::log(3.0), 0, std::log(3.0), 0;
  IdMatrix<std::int32_t> targets(1, 3);
  targets << 0, 1, 1;
  const double l0 = -std::log(0.75), l1 = -std::log(0.25);
  CrossEntropyOptions o;
  o.class_weights = {1, 3};
  RowMatrix<double> dz(3, 2), losses(3, 1);
  auto r = embedhead::cross_entropy_forward_backward<double>(logits, targets, dz, o);
  CHECK(r.count == 3);
  CHECK(r.weight_sum == 7.0);
  CHECK(r.loss == Approx((l0 + 6 * l1) / 7).epsilon(1e-15));
  CHECK(dz(0, 0) == Approx(-0.25 / 7).epsilon(1e-15));
  CHECK(dz(0, 1) == Approx(0.25 / 7).epsilon(1e-15));
  CHECK(dz(1, 0) == Approx(3 * 0.75 / 7).epsilon(1e-15));
  CHECK(dz(2, 1) == Approx(-3 * 0.75 / 7).epsilon(1e-15));
  o.label_smoothing = 0.5;
  o.reduction = Reduction::none;
  r = embedhead::cross_entropy_forward_backward<double>(logits, targets, dz, losses, o);
  CHECK(losses(0, 0) == Approx(0.5 * l0 + 0.25 * (l0 + 3 * l1)).epsilon(1e-15));
  CHECK(losses(1, 0) == Approx(1.5 * l1 + 0.25 * (l0 + 3 * l1)).epsilon(1e-15));
  CHECK(r.loss == Approx(1.25 * l0 + 5.25 * l1).epsilon(1e-15));
  CHECK(dz(0, 0) == Approx(0.375).epsilon(1e-15));  // none: each row's own gradient
  CHECK(dz(0, 1) == Approx(-0.375).epsilon(1e-15));
  CHECK(dz(1, 0) == Approx(1.625).epsilon(1e-15));
  CHECK(dz(1, 1) == Approx(-1.625).epsilon(1e-15));
  o.reduction = Reduction::mean;  // smoothing's term is divided by the weight sum too
  r = embedhead::cross_entropy_forward_backward<double>(logits, targets, dz, o);
  CHECK(r.loss == Approx((1.25 * l0 + 5.25 * l1) / 7).epsilon(1e-15));
  CHECK(dz(1, 0) == Approx(1.625 / 7).epsilon(1e-15));
  // All weights 0: nothing has weight, the mean is 0 (PyTorch: NaN) and so is the gradient.
  o.class_weights = {0, 0};
  r = embedhead::cross_entropy_forward_backward<double>(logits, targets, dz, o);
  CHECK(r.count == 3);
  CHECK(r.weight_sum == 0.0);
  CHECK(r.loss == 0.0);
  CHECK((dz.array() == 0.0).all());
}

TEMPLATE_TEST_CASE("cross_entropy class weights match the naive definition with every option",
                   "[cross_entropy][options][class_weights][naive]", float, double) {
  using Scalar = TestType;
  const Index N = 12, V = 21, classes = 19;
  const RowMatrix<Scalar> logits = random_matrix<Scalar>(N, V, 1501, kLogitSpread);
  IdMatrix<std::int64_t> targets = random_ids<std::int64_t>(3, 4, classes, 1502);
  targets(1, 2) = -100;
  targets(2, 0) = 3;  // a target of weight 0
  for (Reduction reduction : {Reduction::mean, Reduction::sum, Reduction::none})
    for (double eps : {0.0, 0.15})
      for (int extras = 0; extras < 2; ++extras) {
        CAPTURE(name_of(reduction), eps, extras);
        CrossEntropyOptions o = class_weighted(classes);
        o.reduction = reduction;
        o.label_smoothing = eps;
        o.valid_vocab = classes;
        if (extras) {
          o.z_loss = 1e-3;
          o.softcap = 2.5;
          o.gradient_scale = 0.5;
          o.entropy_bonus = -0.3;
        }
        RowMatrix<Scalar> dz(N, V), losses(N, 1);
        const auto r = embedhead::cross_entropy_forward_backward<Scalar>(logits, targets, dz, losses, o);
        naive::LossOptions ref;
        ref.mean = reduction == Reduction::mean;
        ref.label_smoothing = eps;
        ref.classes = classes;
        ref.class_weights = test_support::class_weights(classes);
        ref.z_loss = o.z_loss;
        ref.softcap = o.softcap;
        ref.gradient_scale = o.gradient_scale;
        ref.entropy_bonus = o.entropy_bonus;
        const naive::LossResult expected = naive::full_loss(logits.template cast<double>(), targets, {}, ref);
        CHECK(r.count == N - 1);
        CHECK_THAT(r.weight_sum, WithinRel(expected.weight_sum, 1e-15));
        CHECK_THAT(r.loss, WithinRel(expected.loss, loss_tolerance<Scalar>()));
        if (extras) CHECK_THAT(r.entropy, WithinRel(expected.entropy, loss_tolerance<Scalar>()));
        for (Index n = 0; n < N; ++n) {
          CHECK_THAT(static_cast<double>(losses(n, 0)), WithinAbs(expected.losses[n], 4 * loss_tolerance<Scalar>()));
          for (Index j = 0; j < V; ++j) {
            CAPTURE(n, j);
            CHECK_THAT(static_cast<double>(dz(n, j)), WithinAbs(expected.dlogits(n, j), 4 * loss_tolerance<Scalar>()));
          }
        }
        CHECK(embedhead::cross_entropy<Scalar>(logits, targets, o).loss == r.loss);
        // The loss is invariant to scaling every weight under the mean (numerator and denominator).
        if (reduction == Reduction::mean) {
          CrossEntropyOptions scaled = o;
          for (double& u : scaled.class_weights) u *= 8;  // a power of 2: the sums scale exactly
          CHECK_THAT(embedhead::cross_entropy<Scalar>(logits, targets, scaled).loss,
                     WithinRel(r.loss, loss_tolerance<Scalar>()));
        }
      }
}

TEST_CASE("cross_entropy class weights of 1 give the unweighted loss", "[cross_entropy][options][class_weights]") {
  const RowMatrix<double> logits = random_matrix<double>(6, 9, 1511, kLogitSpread);
  const IdMatrix<std::int32_t> targets = random_ids<std::int32_t>(2, 3, 9, 1512);
  for (double eps : {0.0, 0.2}) {
    CrossEntropyOptions plain;
    plain.label_smoothing = eps;
    plain.z_loss = 1e-2;
    CrossEntropyOptions ones = plain;
    ones.class_weights.assign(9, 1.0);
    RowMatrix<double> dz_plain(6, 9), dz_ones(6, 9);
    const auto a = embedhead::cross_entropy_forward_backward<double>(logits, targets, dz_plain, plain);
    const auto b = embedhead::cross_entropy_forward_backward<double>(logits, targets, dz_ones, ones);
    CHECK(a.weight_sum == b.weight_sum);
    CHECK_THAT(b.loss, WithinRel(a.loss, 1e-14));
    CHECK(naive::max_relative_error(dz_ones, dz_plain, 1e-12) < 1e-13);
  }
}

TEST_CASE("cross_entropy class weights gradient check in double", "[cross_entropy][options][class_weights][gradient]") {
  RowMatrix<double> logits = random_matrix<double>(5, 8, 1521, kLogitSpread);
  IdMatrix<std::int32_t> targets(1, 5);
  targets << 3, 0, 5, -100, 2;
  CrossEntropyOptions o;
  o.valid_vocab = 7;
  o.class_weights = test_support::class_weights(7);
  for (const double eps : {0.0, 0.3})
    for (const bool everything : {false, true}) {
      CAPTURE(eps, everything);
      o.label_smoothing = eps;
      o.z_loss = everything ? 0.05 : 0.0;
      o.softcap = everything ? 1.7 : 0.0;
      o.entropy_bonus = everything ? 0.4 : 0.0;
      RowMatrix<double> dz(5, 8);
      embedhead::cross_entropy_forward_backward<double>(logits, targets, dz, o);
      const RowMatrix<double> numeric = naive::numerical_gradient(logits, [&] {
        return embedhead::cross_entropy<double>(logits, targets, o).loss;
      });
      // Central differences with a step of 1e-6 carry about 1e-16 |loss| / 1e-6 = 1e-9 of rounding
      // (the weighted smoothing term makes the loss about 10): 1e-5 of entries of 1e-4, the floor.
      // The naive reference below checks the gradient to 1e-12.
      CHECK(naive::max_relative_error(dz, numeric, 1e-4) < 1e-5);
      naive::LossOptions ref;
      ref.label_smoothing = o.label_smoothing;
      ref.z_loss = o.z_loss;
      ref.softcap = o.softcap;
      ref.entropy_bonus = o.entropy_bonus;
      ref.classes = 7;
      ref.class_weights = test_support::class_weights(7);
      const naive::LossResult expected = naive::full_loss(logits, targets, {}, ref);
      CHECK(naive::max_relative_error(dz, expected.dlogits, 1e-12) < 1e-12);
      RowMatrix<double> inplace = logits;  // in place: the same gradient
      embedhead::cross_entropy_forward_backward<double>(inplace, targets, inplace, o);
      CHECK((inplace.array() == dz.array()).all());
    }
}

TEMPLATE_TEST_CASE("cross_entropy rejects bad class weights and writes nothing",
                   "[cross_entropy][options][class_weights][errors]", float, double) {
  using Scalar = TestType;
  const RowMatrix<Scalar> logits = random_matrix<Scalar>(2, 5, 1531);
  IdMatrix<std::int32_t> targets(1, 2);
  targets << 1, 3;
  RowMatrix<Scalar> dz = RowMatrix<Scalar>::Constant(2, 5, 7), losses = RowMatrix<Scalar>::Constant(2, 1, 7);
  auto fails = [&](const CrossEntropyOptions& o, const std::string& message) {
    CAPTURE(message);
    CHECK_THROWS_WITH(embedhead::cross_entropy_forward_backward<Scalar>(logits, targets, dz, losses, o),
                      "cross_entropy_forward_backward: " + message);
    CHECK((dz.array() == Scalar(7)).all());
    CHECK((losses.array() == Scalar(7)).all());
  };
  CrossEntropyOptions o;
  o.class_weights = {1, 1, 1, 1};
  CHECK_THROWS_AS(embedhead::cross_entropy<Scalar>(logits, targets, o), embedhead::shape_error);
  fails(o, "class_weights has 4 entries, expected C = 5 (one per class: V)");
  o.valid_vocab = 4;
  o.class_weights.assign(5, 1.0);
  fails(o, "class_weights has 5 entries, expected C = 4 (one per class: valid_vocab)");
  o = {};
  o.class_weights = {1, 2, -1, 0, 1};
  CHECK_THROWS_AS(embedhead::cross_entropy<Scalar>(logits, targets, o), embedhead::value_error);
  fails(o, "class_weights[2] = -1 outside [0, inf)");
  o.class_weights[2] = std::nan("");
  fails(o, "class_weights[2] = nan outside [0, inf)");
  o.class_weights[2] = std::numeric_limits<double>::infinity();
  fails(o, "class_weights[2] = inf outside [0, inf)");
  o.class_weights = {1, 1e308, 1e308, 1, 1};
  if constexpr (std::is_same_v<Scalar, float>)  // each is beyond float first
    fails(o,
          "class_weights[1] = 1e+308 outside [0, inf) in float: it rounds to inf (the largest finite float is "
          "3.40282e+38)");
  else
    fails(o, "the sum of class_weights = inf outside the finite numbers");
  o.class_weights = {1, 1, 1e300, 1, 1};
  if constexpr (std::is_same_v<Scalar, float>)
    fails(o,
          "class_weights[2] = 1e+300 outside [0, inf) in float: it rounds to inf (the largest finite float is "
          "3.40282e+38)");
  else
    CHECK_NOTHROW(embedhead::cross_entropy<Scalar>(logits, targets, o));
}
