// Tests for include/embedhead/position_embedding.hpp: the learned table P [T_max, d] (forward,
// incremental decoding with `start`, row-sparse backward, gradient check, errors) and the fixed
// sinusoidal table (both layouts, against values computed here from the Vaswani / tensor2tensor
// formulas with std::sin and std::cos).
#include <embedhead/position_embedding.hpp>

#include "reference/naive.hpp"
#include "reference/test_support.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

using Catch::Contains;
using Catch::Matchers::WithinAbs;
using Catch::Matchers::WithinRel;
using embedhead::Index;
using embedhead::RowMatrix;
using test_support::random_matrix;
using test_support::range;
using test_support::same_values;

namespace {

// A float table entry is the double value rounded once; allow that rounding plus a few ulps of
// libm / exp-vs-pow differences in the angle.
template <typename Scalar>
double table_tolerance() {
  return 4.0 * static_cast<double>(std::numeric_limits<Scalar>::epsilon());
}

}  // namespace

TEMPLATE_TEST_CASE("LearnedPositionEmbedding forward adds P[start + t] to every batch row", "[position][learned]",
                   float, double) {
  using S = TestType;

  SECTION("naive reference: out[b*T + t] == x[b*T + t] + P[start + t], exactly") {
    for (Index d : {1, 7, 8, 9, 15, 16, 17}) {
      const Index T_max = 11, B = 3, T = 4;
      embedhead::LearnedPositionEmbedding<S> pos(T_max, d);
      const RowMatrix<S> x = random_matrix<S>(B * T, d, 10 + static_cast<std::uint32_t>(d));
      const auto P = pos.weight().value();
      for (Index start : {0, 3, 7}) {  // 7 + 4 = 11 = T_max: the last window that fits
        RowMatrix<S> expected(B * T, d);
        for (Index b = 0; b < B; ++b)
          for (Index t = 0; t < T; ++t)
            for (Index c = 0; c < d; ++c) expected(b * T + t, c) = x(b * T + t, c) + P(start + t, c);

        const RowMatrix<S> out = pos.forward(x, B, T, start);
        CHECK(same_values(out, expected));

        RowMatrix<S> into(B * T, d);
        pos.forward(x, B, T, into, start);
        CHECK(same_values(into, expected));
      }
    }
  }

  SECTION("in place: out may be x") {
    const Index T_max = 6, d = 9, B = 2, T = 5;
    embedhead::LearnedPositionEmbedding<S> pos(T_max, d);
    const RowMatrix<S> x = random_matrix<S>(B * T, d, 3);
    const RowMatrix<S> expected = pos.forward(x, B, T, 1);
    RowMatrix<S> buffer = x;
    pos.forward(buffer, B, T, buffer, 1);
    CHECK(same_values(buffer, expected));
  }

  SECTION("incremental decoding: token by token with start = t equals one full forward") {
    const Index T_max = 8, d = 16, B = 3, T = 8;
    embedhead::LearnedPositionEmbedding<S> pos(T_max, d);
    const RowMatrix<S> x = random_matrix<S>(B * T, d, 4);
    const RowMatrix<S> full = pos.forward(x, B, T);
    for (Index t = 0; t < T; ++t) {
      // The step input holds position t of every sequence: [B*1, d].
      RowMatrix<S> step(B, d);
      for (Index b = 0; b < B; ++b) step.row(b) = x.row(b * T + t);
      const RowMatrix<S> step_out = pos.forward(step, B, 1, t);
      for (Index b = 0; b < B; ++b) CHECK(same_values(step_out.row(b), full.row(b * T + t)));
    }
    // Two chunks of 5 and 3 tokens as well (prefill, then continue).
    RowMatrix<S> first(B * 5, d), second(B * 3, d);
    for (Index b = 0; b < B; ++b) {
      first.middleRows(b * 5, 5) = x.middleRows(b * T, 5);
      second.middleRows(b * 3, 3) = x.middleRows(b * T + 5, 3);
    }
    const RowMatrix<S> out1 = pos.forward(first, B, 5, 0), out2 = pos.forward(second, B, 3, 5);
    for (Index b = 0; b < B; ++b) {
      CHECK(same_values(out1.middleRows(b * 5, 5), full.middleRows(b * T, 5)));
      CHECK(same_values(out2.middleRows(b * 3, 3), full.middleRows(b * T + 5, 3)));
    }
  }

  SECTION("empty batch: B = 0 or T = 0 gives an empty output") {
    embedhead::LearnedPositionEmbedding<S> pos(4, 3);
    const RowMatrix<S> empty(0, 3);
    CHECK(pos.forward(empty, 0, 4).rows() == 0);
    CHECK(pos.forward(empty, 2, 0).rows() == 0);
  }
}

TEMPLATE_TEST_CASE("LearnedPositionEmbedding init is reproducible from the seed", "[position][learned][init]", float,
                   double) {
  using S = TestType;
  const Index T_max = 32, d = 17;
  embedhead::LearnedPositionOptions options;
  options.seed = 1234;
  options.init_std = 0.05;
  embedhead::LearnedPositionEmbedding<S> a(T_max, d, options), b(T_max, d, options);
  CHECK(same_values(a.weight().value(), b.weight().value()));
  CHECK(a.parameter_count() == T_max * d);
  CHECK(a.max_positions() == T_max);
  CHECK(a.dim() == d);

  // The documented contract: P(r, c) = init_std * normal draw 2*(r*d + c) of Rng(seed).
  const embedhead::Rng rng(options.seed);
  bool all_match = true;
  for (Index r = 0; r < T_max; ++r)
    for (Index c = 0; c < d; ++c)
      all_match = all_match &&
                  a.weight().value()(r, c) ==
                      static_cast<S>(options.init_std * rng.normal_at(2 * static_cast<std::uint64_t>(r * d + c)));
  CHECK(all_match);

  options.seed = 1235;
  embedhead::LearnedPositionEmbedding<S> c(T_max, d, options);
  CHECK_FALSE(same_values(a.weight().value(), c.weight().value()));

  // 544 draws from N(0, 0.05^2): the sample std lies within 20% of 0.05 (its relative standard
  // error is about 1/sqrt(2*544) = 3%).
  const auto P = a.weight().value().template cast<double>();
  const double mean = P.mean();
  const double sample_std = std::sqrt((P.array() - mean).square().sum() / static_cast<double>(P.size() - 1));
  CHECK_THAT(sample_std, WithinRel(0.05, 0.2));
  // Nothing has a gradient yet.
  CHECK(a.weight().grad().num_touched() == 0);
}

TEMPLATE_TEST_CASE("LearnedPositionEmbedding backward sums dout over the batch into rows start..start+T-1",
                   "[position][learned][backward]", float, double) {
  using S = TestType;

  SECTION("naive reference: bit-identical to the plain loop, touched rows, accumulation") {
    for (Index d : {1, 7, 8, 9, 16, 17}) {
      const Index T_max = 12, B = 3, T = 5;
      embedhead::LearnedPositionEmbedding<S> pos(T_max, d);
      RowMatrix<S> expected = RowMatrix<S>::Zero(T_max, d);
      auto plain_loop = [&](const RowMatrix<S>& dout, Index b_count, Index t_count, Index start) {
        for (Index b = 0; b < b_count; ++b)
          for (Index t = 0; t < t_count; ++t)
            for (Index c = 0; c < d; ++c) expected(start + t, c) += dout(b * t_count + t, c);
      };

      const RowMatrix<S> dout1 = random_matrix<S>(B * T, d, 20 + static_cast<std::uint32_t>(d));
      pos.backward(dout1, B, T, 4);
      plain_loop(dout1, B, T, 4);
      CHECK(pos.weight().grad().touched_rows() == range(4, 9));
      CHECK(same_values(pos.weight().grad().to_dense(), expected));

      // A second call overlapping rows 6..8 and adding 9..11: sums accumulate, the touched set is
      // the union.
      const RowMatrix<S> dout2 = random_matrix<S>(2 * 6, d, 40 + static_cast<std::uint32_t>(d));
      pos.backward(dout2, 2, 6, 6);
      plain_loop(dout2, 2, 6, 6);
      CHECK(pos.weight().grad().touched_rows() == range(4, 12));
      CHECK(same_values(pos.weight().grad().to_dense(), expected));

      // A third call below the existing rows (merged in front).
      const RowMatrix<S> dout3 = random_matrix<S>(B * 2, d, 60 + static_cast<std::uint32_t>(d));
      pos.backward(dout3, B, 2, 0);
      plain_loop(dout3, B, 2, 0);
      CHECK(pos.weight().grad().touched_rows() == (std::vector<Index>{0, 1, 4, 5, 6, 7, 8, 9, 10, 11}));
      CHECK(same_values(pos.weight().grad().to_dense(), expected));

      pos.zero_grad();
      CHECK(pos.weight().grad().num_touched() == 0);
      CHECK(pos.weight().grad().to_dense().isZero(0));
    }
  }

  SECTION("worked example: L = sum(out), B = 2, T = 3, start = 1 -> rows 1..3 get [2, 2]") {
    // Each position row appears once per sequence, so with dout = 1 it collects B = 2.
    embedhead::LearnedPositionEmbedding<S> pos(5, 2);
    pos.backward(RowMatrix<S>::Ones(6, 2), 2, 3, 1);
    RowMatrix<S> expected(5, 2);
    expected << 0, 0, 2, 2, 2, 2, 2, 2, 0, 0;
    CHECK(same_values(pos.weight().grad().to_dense(), expected));
    CHECK(pos.weight().grad().touched_rows() == range(1, 4));
  }

  SECTION("B = 0 has no tokens and touches no row") {
    embedhead::LearnedPositionEmbedding<S> pos(5, 3);
    pos.backward(RowMatrix<S>(0, 3), 0, 2, 2);
    CHECK(pos.weight().grad().touched_rows().empty());
    CHECK(pos.weight().grad().to_dense().isZero(0));
  }
}

TEST_CASE("LearnedPositionEmbedding gradient check in double", "[position][learned][gradient]") {
  // L(P, x) = sum(W o forward(x)), so dL/dP[start + t] = sum_b W[b*T + t] and dL/dx = W.
  const Index T_max = 7, d = 5, B = 3, T = 4, start = 2;
  embedhead::LearnedPositionOptions options;
  options.init_std = 0.5;  // larger values than the default, so the check is not trivially near zero
  embedhead::LearnedPositionEmbedding<double> pos(T_max, d, options);
  RowMatrix<double> x = random_matrix<double>(B * T, d, 7);
  const RowMatrix<double> W = random_matrix<double>(B * T, d, 8);

  RowMatrix<double> P = pos.weight().value();
  auto loss = [&]() {
    pos.weight().value() = P;
    return pos.forward(x, B, T, start).cwiseProduct(W).sum();
  };

  const RowMatrix<double> numeric_dP = naive::numerical_gradient(P, loss);
  const RowMatrix<double> numeric_dx = naive::numerical_gradient(x, loss);
  pos.weight().value() = P;

  pos.backward(W, B, T, start);
  const RowMatrix<double> analytic_dP = pos.weight().grad().to_dense();
  CHECK(naive::max_relative_error(analytic_dP, numeric_dP) < 1e-6);
  // Rows outside the window have no gradient at all, numerically or analytically.
  CHECK(numeric_dP.topRows(start).isZero(0));
  CHECK(numeric_dP.bottomRows(T_max - start - T).isZero(0));
  CHECK(analytic_dP.topRows(start).isZero(0));
  CHECK(analytic_dP.bottomRows(T_max - start - T).isZero(0));
  // The gradient for x is dout itself.
  CHECK(naive::max_relative_error(W, numeric_dx) < 1e-6);
}

TEMPLATE_TEST_CASE("LearnedPositionEmbedding rejects bad input and changes nothing", "[position][learned][errors]",
                   float, double) {
  using S = TestType;
  const Index T_max = 8, d = 3;

  SECTION("constructor") {
    REQUIRE_THROWS_AS(embedhead::LearnedPositionEmbedding<S>(0, d), embedhead::value_error);
    REQUIRE_THROWS_WITH(embedhead::LearnedPositionEmbedding<S>(0, d), Contains("T_max = 0") && Contains("[1, inf)"));
    REQUIRE_THROWS_WITH(embedhead::LearnedPositionEmbedding<S>(-3, d), Contains("T_max = -3"));
    REQUIRE_THROWS_AS(embedhead::LearnedPositionEmbedding<S>(T_max, 0), embedhead::value_error);
    REQUIRE_THROWS_WITH(embedhead::LearnedPositionEmbedding<S>(T_max, 0), Contains("d = 0") && Contains("[1, inf)"));
    for (double bad_std : {0.0, -0.5}) {
      embedhead::LearnedPositionOptions options;
      options.init_std = bad_std;
      REQUIRE_THROWS_AS(embedhead::LearnedPositionEmbedding<S>(T_max, d, options), embedhead::value_error);
      REQUIRE_THROWS_WITH(embedhead::LearnedPositionEmbedding<S>(T_max, d, options),
                          Contains("init_std") && Contains("(0, inf)"));
    }
    embedhead::LearnedPositionOptions options;
    options.init_std = std::numeric_limits<double>::quiet_NaN();
    REQUIRE_THROWS_WITH(embedhead::LearnedPositionEmbedding<S>(T_max, d, options), Contains("init_std = nan"));
  }

  // A layer with a non-empty gradient, so "unchanged" covers touched rows and their values.
  embedhead::LearnedPositionEmbedding<S> pos(T_max, d);
  pos.backward(random_matrix<S>(2 * 3, d, 99), 2, 3, 2);
  const RowMatrix<S> P_before = pos.weight().value();
  const RowMatrix<S> grad_before = pos.weight().grad().to_dense();
  const std::vector<Index> touched_before = pos.weight().grad().touched_rows();
  auto check_unchanged = [&] {
    CHECK(same_values(pos.weight().value(), P_before));
    CHECK(same_values(pos.weight().grad().to_dense(), grad_before));
    CHECK(pos.weight().grad().touched_rows() == touched_before);
  };

  const S sentinel = S(-7.25);
  SECTION("positions outside [0, T_max)") {
    struct Case {
      Index B, T, start;
      // The message names the first position outside the table (bad_position); other_bad_position
      // is kept equal to it now that the header promises the first one.
      const char* bad_position;
      const char* other_bad_position;
    };
    // T > T_max (positions 8 and 9 are both outside); start + T > T_max (only 8); negative start
    // (only -1); a single token just past the end.
    for (const Case& bad : {Case{1, 10, 0, "position 8", "position 8"}, Case{2, 4, 5, "position 8", "position 8"},
                            Case{2, 3, -1, "position -1", "position -1"}, Case{1, 1, 8, "position 8", "position 8"}}) {
      INFO("B=" << bad.B << " T=" << bad.T << " start=" << bad.start);
      const RowMatrix<S> x = RowMatrix<S>::Ones(bad.B * bad.T, d);
      RowMatrix<S> out = RowMatrix<S>::Constant(bad.B * bad.T, d, sentinel);
      const std::string start_text = "start " + std::to_string(bad.start);
      const std::string T_text = "T " + std::to_string(bad.T);
      REQUIRE_THROWS_AS(pos.forward(x, bad.B, bad.T, out, bad.start), embedhead::index_error);
      REQUIRE_THROWS_WITH(pos.forward(x, bad.B, bad.T, out, bad.start),
                          Contains("LearnedPositionEmbedding::forward") && Contains(start_text) && Contains(T_text) &&
                              Contains("[0, 8)") && Contains("T_max = 8"));
      REQUIRE_THROWS_WITH(pos.forward(x, bad.B, bad.T, out, bad.start),
                          Contains(bad.bad_position) || Contains(bad.other_bad_position));
      REQUIRE_THROWS_WITH(pos.forward(x, bad.B, bad.T, bad.start),
                          Contains(start_text) && Contains(T_text) && Contains("[0, 8)"));
      REQUIRE_THROWS_AS(pos.backward(x, bad.B, bad.T, bad.start), embedhead::index_error);
      REQUIRE_THROWS_WITH(pos.backward(x, bad.B, bad.T, bad.start), Contains("LearnedPositionEmbedding::backward") &&
                                                                        Contains(start_text) && Contains(T_text) &&
                                                                        Contains("[0, 8)"));
      CHECK((out.array() == sentinel).all());
      check_unchanged();
    }
  }

  SECTION("x / dout not [B*T, d]") {
    RowMatrix<S> out = RowMatrix<S>::Constant(6, d, sentinel);
    const RowMatrix<S> short_x = RowMatrix<S>::Ones(5, d);       // rows != B*T = 6
    const RowMatrix<S> narrow_x = RowMatrix<S>::Ones(6, d - 1);  // cols != d
    REQUIRE_THROWS_AS(pos.forward(short_x, 2, 3, out), embedhead::shape_error);
    REQUIRE_THROWS_WITH(pos.forward(short_x, 2, 3, out), Contains("[5, 3]") && Contains("expected [6, 3]"));
    REQUIRE_THROWS_WITH(pos.forward(short_x, 2, 3), Contains("[5, 3]") && Contains("expected [6, 3]"));
    REQUIRE_THROWS_WITH(pos.forward(narrow_x, 2, 3, out), Contains("[6, 2]") && Contains("expected [6, 3]"));
    REQUIRE_THROWS_AS(pos.backward(short_x, 2, 3), embedhead::shape_error);
    REQUIRE_THROWS_WITH(pos.backward(short_x, 2, 3), Contains("[5, 3]") && Contains("expected [6, 3]"));
    REQUIRE_THROWS_WITH(pos.backward(narrow_x, 2, 3), Contains("[6, 2]") && Contains("expected [6, 3]"));
    CHECK((out.array() == sentinel).all());
    check_unchanged();
  }

  SECTION("out not [B*T, d]") {
    const RowMatrix<S> x = RowMatrix<S>::Ones(6, d);
    RowMatrix<S> out = RowMatrix<S>::Constant(6, d + 1, sentinel);
    REQUIRE_THROWS_AS(pos.forward(x, 2, 3, out), embedhead::shape_error);
    REQUIRE_THROWS_WITH(pos.forward(x, 2, 3, out),
                        Contains("out") && Contains("[6, 4]") && Contains("expected [6, 3]"));
    CHECK((out.array() == sentinel).all());
    check_unchanged();
  }

  SECTION("negative B or T") {
    const RowMatrix<S> x(0, d);
    RowMatrix<S> out(0, d);
    REQUIRE_THROWS_AS(pos.forward(x, -1, 0, out), embedhead::value_error);
    REQUIRE_THROWS_WITH(pos.forward(x, -1, 0, out), Contains("B = -1"));
    REQUIRE_THROWS_WITH(pos.forward(x, 0, -2), Contains("T = -2"));
    REQUIRE_THROWS_AS(pos.backward(x, 0, -2), embedhead::value_error);
    REQUIRE_THROWS_WITH(pos.backward(x, -1, 0), Contains("B = -1"));
    // (-1) * (-3) = 3 rows would pass a shape check on B*T alone.
    const RowMatrix<S> three_rows = RowMatrix<S>::Ones(3, d);
    REQUIRE_THROWS_AS(pos.backward(three_rows, -1, -3), embedhead::value_error);
    check_unchanged();
  }
}

TEMPLATE_TEST_CASE("SinusoidalPositionEmbedding, interleaved layout (Vaswani et al.)", "[position][sinusoidal]", float,
                   double) {
  using S = TestType;
  const double tol = table_tolerance<S>();

  SECTION("worked example: d = 4, position 1 = [sin 1, cos 1, sin(1/100), cos(1/100)]") {
    // w_i = 10000^(-2i/d): w_0 = 1, w_1 = 10000^(-1/2) = 1/100.
    const embedhead::SinusoidalPositionEmbedding<S> pe(3, 4);
    const auto& P = pe.table();
    REQUIRE(P.rows() == 3);
    REQUIRE(P.cols() == 4);
    CHECK_THAT(static_cast<double>(P(1, 0)), WithinAbs(std::sin(1.0), tol));
    CHECK_THAT(static_cast<double>(P(1, 1)), WithinAbs(std::cos(1.0), tol));
    CHECK_THAT(static_cast<double>(P(1, 2)), WithinAbs(std::sin(0.01), tol));
    CHECK_THAT(static_cast<double>(P(1, 3)), WithinAbs(std::cos(0.01), tol));
    CHECK_THAT(static_cast<double>(P(2, 2)), WithinAbs(std::sin(0.02), tol));
    CHECK_THAT(static_cast<double>(P(2, 3)), WithinAbs(std::cos(0.02), tol));
    // Hand values as a guard against a wrong std call: sin 1 = 0.84147..., cos(0.01) = 0.99995...
    CHECK_THAT(static_cast<double>(P(1, 0)), WithinAbs(0.841470985, 1e-6));
    CHECK_THAT(static_cast<double>(P(1, 3)), WithinAbs(0.999950000, 1e-6));
  }

  SECTION("position 0 is [0, 1, 0, 1, ...] exactly") {
    for (Index d : {1, 2, 5, 8, 17}) {
      const embedhead::SinusoidalPositionEmbedding<S> pe(2, d);
      for (Index j = 0; j < d; ++j) CHECK(pe.table()(0, j) == (j % 2 == 0 ? S(0) : S(1)));
    }
  }

  SECTION("naive reference: every entry from the formula, d around the packet width") {
    for (Index d : {1, 2, 3, 5, 7, 8, 9, 16, 17}) {
      const Index T_max = 50;
      const embedhead::SinusoidalPositionEmbedding<S> pe(T_max, d);
      CHECK(pe.layout() == embedhead::SinusoidLayout::interleaved);
      for (Index p = 0; p < T_max; ++p)
        for (Index j = 0; j < d; ++j) {
          const double w = std::pow(10000.0, -static_cast<double>(2 * (j / 2)) / static_cast<double>(d));
          const double angle = static_cast<double>(p) * w;
          const double expected = j % 2 == 0 ? std::sin(angle) : std::cos(angle);
          // angle reaches 49 rad; an ulp of relative error in w moves it by ~1e-14.
          CHECK_THAT(static_cast<double>(pe.table()(p, j)), WithinAbs(expected, tol + 1e-13));
        }
    }
  }

  SECTION("odd d = 5 ends with a sin column; d = 1 is sin(p)") {
    const embedhead::SinusoidalPositionEmbedding<S> pe5(4, 5);
    // Column 4 is 2i with i = 2: sin(p * 10000^(-4/5)).
    const double w2 = std::pow(10000.0, -0.8);
    for (Index p = 0; p < 4; ++p)
      CHECK_THAT(static_cast<double>(pe5.table()(p, 4)), WithinAbs(std::sin(static_cast<double>(p) * w2), tol));
    const embedhead::SinusoidalPositionEmbedding<S> pe1(4, 1);
    for (Index p = 0; p < 4; ++p)
      CHECK_THAT(static_cast<double>(pe1.table()(p, 0)), WithinAbs(std::sin(static_cast<double>(p)), tol));
  }
}

TEMPLATE_TEST_CASE("SinusoidalPositionEmbedding, concatenated layout (tensor2tensor)", "[position][sinusoidal]", float,
                   double) {
  using S = TestType;
  const double tol = table_tolerance<S>();
  const auto concatenated = embedhead::SinusoidLayout::concatenated;

  SECTION("worked example: d = 6 -> [sin p, sin(p/100), sin(p/10^4), cos p, cos(p/100), cos(p/10^4)]") {
    // half = 3, w_i = 10000^(-i / (half - 1)) = 10000^(-i/2): 1, 1/100, 1/10000.
    const embedhead::SinusoidalPositionEmbedding<S> pe(10, 6, concatenated);
    CHECK(pe.layout() == concatenated);
    for (Index p : {0, 1, 3, 9}) {
      const double q = static_cast<double>(p);
      const double expected[6] = {std::sin(q), std::sin(q / 100.0), std::sin(q / 10000.0),
                                  std::cos(q), std::cos(q / 100.0), std::cos(q / 10000.0)};
      for (Index j = 0; j < 6; ++j) CHECK_THAT(static_cast<double>(pe.table()(p, j)), WithinAbs(expected[j], tol));
    }
    // Position 0: sin half zero, cos half one, exactly.
    for (Index j = 0; j < 6; ++j) CHECK(pe.table()(0, j) == (j < 3 ? S(0) : S(1)));
  }

  SECTION("odd d = 5: half = 2, w = [1, 1/10000], last column zero") {
    // max(half - 1, 1) = 1, so w_1 = 10000^(-1).
    const embedhead::SinusoidalPositionEmbedding<S> pe(6, 5, concatenated);
    for (Index p = 0; p < 6; ++p) {
      const double q = static_cast<double>(p);
      CHECK_THAT(static_cast<double>(pe.table()(p, 0)), WithinAbs(std::sin(q), tol));
      CHECK_THAT(static_cast<double>(pe.table()(p, 1)), WithinAbs(std::sin(q / 10000.0), tol));
      CHECK_THAT(static_cast<double>(pe.table()(p, 2)), WithinAbs(std::cos(q), tol));
      CHECK_THAT(static_cast<double>(pe.table()(p, 3)), WithinAbs(std::cos(q / 10000.0), tol));
      CHECK(pe.table()(p, 4) == S(0));
    }
  }

  SECTION("d = 2 and d = 3: half = 1, max(half - 1, 1) = 1 keeps w_0 = 1 (no division by zero)") {
    const embedhead::SinusoidalPositionEmbedding<S> pe2(5, 2, concatenated), pe3(5, 3, concatenated);
    for (Index p = 0; p < 5; ++p) {
      const double q = static_cast<double>(p);
      CHECK_THAT(static_cast<double>(pe2.table()(p, 0)), WithinAbs(std::sin(q), tol));
      CHECK_THAT(static_cast<double>(pe2.table()(p, 1)), WithinAbs(std::cos(q), tol));
      CHECK_THAT(static_cast<double>(pe3.table()(p, 0)), WithinAbs(std::sin(q), tol));
      CHECK_THAT(static_cast<double>(pe3.table()(p, 1)), WithinAbs(std::cos(q), tol));
      CHECK(pe3.table()(p, 2) == S(0));
    }
    CHECK(pe2.table().allFinite());
    CHECK(pe3.table().allFinite());
  }

  SECTION("naive reference: every entry, d around the packet width") {
    for (Index d : {4, 7, 8, 9, 16, 17}) {
      const Index T_max = 40, half = d / 2;
      const embedhead::SinusoidalPositionEmbedding<S> pe(T_max, d, concatenated);
      for (Index p = 0; p < T_max; ++p) {
        for (Index i = 0; i < half; ++i) {
          const double w = std::pow(10000.0, -static_cast<double>(i) / static_cast<double>(half - 1));
          const double angle = static_cast<double>(p) * w;
          CHECK_THAT(static_cast<double>(pe.table()(p, i)), WithinAbs(std::sin(angle), tol + 1e-13));
          CHECK_THAT(static_cast<double>(pe.table()(p, half + i)), WithinAbs(std::cos(angle), tol + 1e-13));
        }
        if (d % 2 == 1) CHECK(pe.table()(p, d - 1) == S(0));
      }
    }
  }
}

TEMPLATE_TEST_CASE("SinusoidalPositionEmbedding forward, parameters and errors", "[position][sinusoidal]", float,
                   double) {
  using S = TestType;
  const Index T_max = 9, d = 8, B = 2, T = 4;
  const embedhead::SinusoidalPositionEmbedding<S> pe(T_max, d);

  SECTION("no parameters") {
    CHECK(pe.parameter_count() == 0);
    CHECK(
        embedhead::SinusoidalPositionEmbedding<S>(100, 64, embedhead::SinusoidLayout::concatenated).parameter_count() ==
        0);
    CHECK(pe.max_positions() == T_max);
    CHECK(pe.dim() == d);
  }

  SECTION("naive reference: out = x + table[start + t], also in place") {
    const RowMatrix<S> x = random_matrix<S>(B * T, d, 5);
    for (Index start : {0, 2, 5}) {
      RowMatrix<S> expected(B * T, d);
      for (Index b = 0; b < B; ++b)
        for (Index t = 0; t < T; ++t)
          for (Index c = 0; c < d; ++c) expected(b * T + t, c) = x(b * T + t, c) + pe.table()(start + t, c);
      CHECK(same_values(pe.forward(x, B, T, start), expected));
      RowMatrix<S> buffer = x;
      pe.forward(buffer, B, T, buffer, start);
      CHECK(same_values(buffer, expected));
    }
  }

  SECTION("errors") {
    REQUIRE_THROWS_AS(embedhead::SinusoidalPositionEmbedding<S>(0, d), embedhead::value_error);
    REQUIRE_THROWS_WITH(embedhead::SinusoidalPositionEmbedding<S>(0, d), Contains("T_max = 0") && Contains("[1, inf)"));
    REQUIRE_THROWS_WITH(embedhead::SinusoidalPositionEmbedding<S>(T_max, 0, embedhead::SinusoidLayout::concatenated),
                        Contains("d = 0"));

    const RowMatrix<S> table_before = pe.table();
    const RowMatrix<S> x = RowMatrix<S>::Ones(B * T, d);
    RowMatrix<S> out = RowMatrix<S>::Constant(B * T, d, S(-3));
    REQUIRE_THROWS_AS(pe.forward(x, B, T, out, 6), embedhead::index_error);
    REQUIRE_THROWS_WITH(pe.forward(x, B, T, out, 6),
                        Contains("SinusoidalPositionEmbedding::forward") && Contains("start 6") && Contains("[0, 9)"));
    REQUIRE_THROWS_WITH(pe.forward(x, B, T, -2), Contains("position -2") && Contains("[0, 9)"));
    REQUIRE_THROWS_AS(pe.forward(x, B, T + 1, out), embedhead::shape_error);
    REQUIRE_THROWS_WITH(pe.forward(x, B, T + 1, out), Contains("[8, 8]") && Contains("expected [10, 8]"));
    RowMatrix<S> wrong_out(B * T, d - 1);
    REQUIRE_THROWS_WITH(pe.forward(x, B, T, wrong_out), Contains("out") && Contains("expected [8, 8]"));
    REQUIRE_THROWS_AS(pe.forward(x, -B, -T), embedhead::value_error);
    CHECK((out.array() == S(-3)).all());
    CHECK(same_values(pe.table(), table_before));
  }
}

TEMPLATE_TEST_CASE("LearnedPositionEmbedding: a huge start or B*T cannot overflow past the checks",
                   "[position_embedding][errors]", float, double) {
  using S = TestType;
  embedhead::LearnedPositionEmbedding<S> pos(8, 2);
  const RowMatrix<S> P_before = pos.weight().value();
  const RowMatrix<S> x = RowMatrix<S>::Zero(2, 2);
  RowMatrix<S> out = RowMatrix<S>::Constant(2, 2, S(7));
  const Index huge = std::numeric_limits<Index>::max() - 1;  // start + T would wrap negative
  REQUIRE_THROWS_AS(pos.forward(x, 1, 2, out, huge), embedhead::index_error);
  REQUIRE_THROWS_WITH(pos.forward(x, 1, 2, out, huge),
                      Contains("position " + std::to_string(huge)) && Contains("[0, 8)"));
  REQUIRE_THROWS_AS(pos.backward(x, 1, 2, huge), embedhead::index_error);
  CHECK(out == RowMatrix<S>::Constant(2, 2, S(7)));
  CHECK(pos.weight().grad().num_touched() == 0);
  CHECK(RowMatrix<S>(pos.weight().value()) == P_before);

  // B * T does not fit in Index: a value_error, not a wrapped shape.
  const Index big = Index{1} << 62;
  REQUIRE_THROWS_AS(pos.forward(x, big, 4, out, 0), embedhead::value_error);
  REQUIRE_THROWS_WITH(pos.forward(x, big, 4, out, 0), Contains("B = " + std::to_string(big)) && Contains("T = 4"));
}

TEMPLATE_TEST_CASE("LearnedPositionEmbedding: backward of an empty batch touches no row",
                   "[position_embedding][backward]", float, double) {
  using S = TestType;
  embedhead::LearnedPositionEmbedding<S> pos(8, 3);
  pos.backward(RowMatrix<S>(0, 3), 0, 5);
  CHECK(pos.weight().grad().num_touched() == 0);
  pos.backward(RowMatrix<S>(0, 3), 4, 0);
  CHECK(pos.weight().grad().num_touched() == 0);
}

TEST_CASE("LearnedPositionEmbedding wraps an existing Parameter without copying or re-initialising it",
          "[position_embedding][wrap]") {
  auto P = std::make_shared<embedhead::Parameter<double>>(4, 2, "wpe");
  P->value() << 1, 2, 3, 4, 5, 6, 7, 8;
  embedhead::LearnedPositionEmbedding<double> pos(P);
  CHECK(pos.weight_ptr() == P);
  CHECK(pos.max_positions() == 4);
  CHECK(pos.dim() == 2);
  const RowMatrix<double> out = pos.forward(RowMatrix<double>::Zero(2, 2), 1, 2, 1);
  CHECK(out(0, 0) == 3.0);
  CHECK(out(1, 1) == 6.0);
  REQUIRE_THROWS_AS(embedhead::LearnedPositionEmbedding<double>(nullptr), embedhead::value_error);
  REQUIRE_THROWS_WITH(embedhead::LearnedPositionEmbedding<double>(nullptr), Contains("null"));
}

TEMPLATE_TEST_CASE("LearnedPositionEmbedding: a frozen table takes no gradient; its checks still run",
                   "[position_embedding][freeze]", float, double) {
  using Scalar = TestType;
  embedhead::LearnedPositionEmbedding<Scalar> positions(8, 3);
  positions.weight().set_frozen(true);
  const RowMatrix<Scalar> dout = test_support::random_matrix<Scalar>(2 * 4, 3, 400);
  positions.backward(dout, 2, 4, 1);
  CHECK(positions.weight().grad().num_touched() == 0);
  CHECK_THROWS_AS(positions.backward(dout, 2, 4, 5), embedhead::index_error);
  positions.weight().set_frozen(false);
  positions.backward(dout, 2, 4, 1);
  CHECK(positions.weight().grad().touched_rows() == test_support::range(1, 5));
}
