// Tests for include/embedhead/dropout.hpp: inverted dropout with a stored mask. Checks the
// limits p = 0 and p = 1, eval mode, the mask's values and reuse in backward, keep statistics,
// reproducibility from the seed and the Rng counter, a gradient check and the errors.
#include <embedhead/dropout.hpp>

#include "reference/naive.hpp"
#include "reference/test_support.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>

using Catch::Contains;
using Catch::Matchers::WithinAbs;
using Catch::Matchers::WithinRel;
using embedhead::Index;
using embedhead::RowMatrix;
using test_support::random_matrix;
using test_support::same_values;

TEMPLATE_TEST_CASE("Dropout limits: p = 0 is the identity, p = 1 gives zeros", "[dropout]", float, double) {
  using S = TestType;

  SECTION("p = 0 in training: out == x, backward == dout, mask all ones") {
    for (Index d : {1, 7, 8, 9, 16, 17}) {
      embedhead::Dropout<S> dropout(0.0, 5);
      const RowMatrix<S> x = random_matrix<S>(3, d, 1);
      CHECK(same_values(dropout.forward(x), x));
      CHECK((dropout.mask().array() == S(1)).all());
      const RowMatrix<S> dout = random_matrix<S>(3, d, 2);
      CHECK(same_values(dropout.backward(dout), dout));
    }
  }

  SECTION("p = 1 in training: zeros, no NaN even for huge inputs, backward zeros") {
    embedhead::Dropout<S> dropout(1.0, 5);
    RowMatrix<S> x = random_matrix<S>(4, 9, 3);
    x(0, 0) = std::numeric_limits<S>::max();
    x(1, 3) = std::numeric_limits<S>::lowest();
    x(2, 5) = S(1e30);
    const RowMatrix<S> out = dropout.forward(x);
    CHECK(out.allFinite());
    CHECK(out.isZero(0));
    CHECK(dropout.mask().isZero(0));
    const RowMatrix<S> dx = dropout.backward(random_matrix<S>(4, 9, 4, 1e3));
    CHECK(dx.allFinite());
    CHECK(dx.isZero(0));
  }
}

TEMPLATE_TEST_CASE("Dropout eval mode is the identity and draws nothing", "[dropout][eval]", float, double) {
  using S = TestType;
  embedhead::Dropout<S> dropout(0.5, 11);
  CHECK(dropout.is_training());  // a new layer trains

  const RowMatrix<S> x = random_matrix<S>(5, 8, 1);
  dropout.forward(x);  // a training forward, so there is a mask to keep
  const RowMatrix<S> mask_before = dropout.mask();
  const std::uint64_t counter_before = dropout.rng().counter();

  dropout.eval();
  CHECK_FALSE(dropout.is_training());
  const RowMatrix<S> x2 = random_matrix<S>(3, 7, 2);
  CHECK(same_values(dropout.forward(x2), x2));
  RowMatrix<S> out(3, 7);
  dropout.forward(x2, out);
  CHECK(same_values(out, x2));
  RowMatrix<S> in_place = x2;
  dropout.forward(in_place, in_place);
  CHECK(same_values(in_place, x2));
  CHECK(dropout.rng().counter() == counter_before);
  CHECK(same_values(dropout.mask(), mask_before));

  // The last forward ran in eval mode, so backward is the identity, for any shape.
  const RowMatrix<S> dout = random_matrix<S>(3, 7, 3);
  CHECK(same_values(dropout.backward(dout), dout));

  // train() switches back and the counter moves again.
  dropout.train();
  CHECK(dropout.is_training());
  dropout.forward(x2);
  CHECK(dropout.rng().counter() == counter_before + 3 * 7);
  dropout.train(false);
  CHECK_FALSE(dropout.is_training());
}

TEMPLATE_TEST_CASE("Dropout mask: kept entries are x / (1 - p), dropped are 0, backward reuses it", "[dropout][mask]",
                   float, double) {
  using S = TestType;
  for (double p : {0.1, 0.5, 0.9}) {
    for (Index d : {1, 7, 8, 9, 15, 16, 17}) {
      INFO("p = " << p << ", d = " << d);
      const Index N = 6;
      embedhead::Dropout<S> dropout(p, 21);
      const std::uint64_t base = dropout.rng().counter();
      const RowMatrix<S> x = random_matrix<S>(N, d, 30 + static_cast<std::uint32_t>(d));
      const RowMatrix<S> out = dropout.forward(x);
      const RowMatrix<S> mask = dropout.mask();
      REQUIRE(mask.rows() == N);
      REQUIRE(mask.cols() == d);

      // The documented rule: element i (row-major) is kept iff uniform draw base + i >= p. The
      // draws come from a separate Rng with the same seed.
      const embedhead::Rng draws(21);
      const S keep_scale = S(1 / (1 - p));
      bool rule_holds = true, values_hold = true;
      for (Index r = 0; r < N; ++r)
        for (Index c = 0; c < d; ++c) {
          const bool kept = draws.uniform_at(base + static_cast<std::uint64_t>(r * d + c)) >= p;
          rule_holds = rule_holds && (mask(r, c) == (kept ? keep_scale : S(0)));
          values_hold = values_hold && (out(r, c) == (kept ? x(r, c) * keep_scale : S(0)));
        }
      CHECK(rule_holds);
      CHECK(values_hold);

      // backward(dout) == dout o mask of the last forward, also into a buffer and in place.
      const RowMatrix<S> dout = random_matrix<S>(N, d, 50 + static_cast<std::uint32_t>(d));
      RowMatrix<S> expected(N, d);
      for (Index r = 0; r < N; ++r)
        for (Index c = 0; c < d; ++c) expected(r, c) = mask(r, c) == S(0) ? S(0) : dout(r, c) * keep_scale;
      CHECK(same_values(dropout.backward(dout), expected));
      RowMatrix<S> dx(N, d);
      dropout.backward(dout, dx);
      CHECK(same_values(dx, expected));
      RowMatrix<S> in_place = dout;
      dropout.backward(in_place, in_place);
      CHECK(same_values(in_place, expected));

      // In-place forward draws a new mask and applies it.
      RowMatrix<S> buffer = x;
      dropout.forward(buffer, buffer);
      bool in_place_holds = true;
      for (Index i = 0; i < buffer.size(); ++i)
        in_place_holds = in_place_holds &&
                         buffer.data()[i] == (dropout.mask().data()[i] == S(0) ? S(0) : x.data()[i] * keep_scale);
      CHECK(in_place_holds);
    }
  }
}

TEMPLATE_TEST_CASE("Dropout keep statistics", "[dropout][statistics]", float, double) {
  using S = TestType;
  const Index n = 1000000;
  const RowMatrix<S> ones = RowMatrix<S>::Ones(1000, 1000);
  for (double p : {0.1, 0.5, 0.9}) {
    INFO("p = " << p);
    embedhead::Dropout<S> dropout(p, 2024);
    const RowMatrix<S> out = dropout.forward(ones);
    const double kept = static_cast<double>((dropout.mask().array() != S(0)).count());
    // The kept count is Binomial(n, 1 - p): its fraction has std sqrt(p(1-p)/n); allow 6 sigma.
    const double fraction_tolerance = 6 * std::sqrt(p * (1 - p) / static_cast<double>(n));
    CHECK_THAT(kept / static_cast<double>(n), WithinAbs(1 - p, fraction_tolerance));
    // Each output entry is 1/(1-p) with probability 1-p and 0 otherwise: mean 1, variance
    // (1-p)/(1-p)^2 - 1 = p/(1-p). The mean of n of them has std sqrt(p/(1-p)/n); allow 6 sigma.
    // The sum is taken in double so float rounding does not enter.
    const double mean = out.template cast<double>().sum() / static_cast<double>(n);
    const double mean_tolerance = 6 * std::sqrt(p / (1 - p) / static_cast<double>(n));
    CHECK_THAT(mean, WithinAbs(1.0, mean_tolerance));
  }
}

TEMPLATE_TEST_CASE("Dropout masks follow the seed and the Rng counter", "[dropout][rng]", float, double) {
  using S = TestType;
  const Index N = 7, d = 9;
  const RowMatrix<S> x = RowMatrix<S>::Ones(N, d);

  embedhead::Dropout<S> a(0.5, 42), b(0.5, 42), c(0.5, 43);
  CHECK(a.rng().seed() == 42);
  CHECK(a.rng().counter() == 0);
  a.forward(x);
  b.forward(x);
  c.forward(x);
  CHECK(same_values(a.mask(), b.mask()));
  CHECK_FALSE(same_values(a.mask(), c.mask()));
  // Rng counter advances by N*d per training forward.
  CHECK(a.rng().counter() == static_cast<std::uint64_t>(N * d));

  const RowMatrix<S> first_mask = a.mask();
  a.forward(x);
  CHECK_FALSE(same_values(a.mask(), first_mask));
  CHECK(a.rng().counter() == static_cast<std::uint64_t>(2 * N * d));
  // A different shape draws its own count.
  a.forward(RowMatrix<S>::Ones(3, 5));
  CHECK(a.rng().counter() == static_cast<std::uint64_t>(2 * N * d + 15));

  // Restoring the counter replays a mask: the state is (seed, counter) alone.
  b.rng().set_counter(0);
  b.forward(x);
  CHECK(same_values(b.mask(), first_mask));
}

TEST_CASE("Dropout gradient check in double", "[dropout][gradient]") {
  // L(x) = sum(W o dropout(x)) with the mask of one forward held fixed: a linear map x -> x o M,
  // whose Jacobian-transpose applied to W is W o M. f re-applies the stored mask rather than
  // calling forward, which would draw a new one.
  const Index N = 5, d = 9;
  embedhead::Dropout<double> dropout(0.4, 77);
  RowMatrix<double> x = random_matrix<double>(N, d, 1);
  const RowMatrix<double> W = random_matrix<double>(N, d, 2);
  dropout.forward(x);
  const RowMatrix<double> M = dropout.mask();
  REQUIRE((M.array() == 0).any());  // the check covers dropped entries too
  REQUIRE((M.array() != 0).any());

  auto loss = [&]() { return x.cwiseProduct(M).cwiseProduct(W).sum(); };
  const RowMatrix<double> numeric = naive::numerical_gradient(x, loss);
  const RowMatrix<double> analytic = dropout.backward(W);
  CHECK(naive::max_relative_error(analytic, numeric) < 1e-7);
  // The Jacobian is exactly zero at dropped entries.
  for (Index i = 0; i < M.size(); ++i)
    if (M.data()[i] == 0) CHECK(numeric.data()[i] == 0);
}

TEMPLATE_TEST_CASE("Dropout rejects bad input and changes nothing", "[dropout][errors]", float, double) {
  using S = TestType;

  SECTION("p outside [0, 1] or NaN") {
    REQUIRE_THROWS_AS(embedhead::Dropout<S>(-0.25), embedhead::value_error);
    REQUIRE_THROWS_WITH(embedhead::Dropout<S>(-0.25), Contains("-0.25") && Contains("[0, 1]"));
    REQUIRE_THROWS_AS(embedhead::Dropout<S>(1.5), embedhead::value_error);
    REQUIRE_THROWS_WITH(embedhead::Dropout<S>(1.5), Contains("1.5") && Contains("[0, 1]"));
    REQUIRE_THROWS_AS(embedhead::Dropout<S>(std::nan("")), embedhead::value_error);
    REQUIRE_THROWS_WITH(embedhead::Dropout<S>(std::nan("")), Contains("nan") && Contains("[0, 1]"));
    // The edges are allowed.
    CHECK_NOTHROW(embedhead::Dropout<S>(0.0));
    CHECK_NOTHROW(embedhead::Dropout<S>(1.0));
  }

  SECTION("backward before any forward") {
    const embedhead::Dropout<S> dropout(0.5);
    const RowMatrix<S> dout = RowMatrix<S>::Ones(2, 3);
    RowMatrix<S> dx = RowMatrix<S>::Constant(2, 3, S(-9));
    REQUIRE_THROWS_AS(dropout.backward(dout, dx), std::logic_error);
    REQUIRE_THROWS_WITH(dropout.backward(dout), Contains("Dropout::backward") && Contains("forward"));
    CHECK((dx.array() == S(-9)).all());
  }

  SECTION("shape errors leave mask, Rng counter and outputs unchanged") {
    embedhead::Dropout<S> dropout(0.5, 3);
    const RowMatrix<S> x = random_matrix<S>(4, 6, 1);
    dropout.forward(x);
    const RowMatrix<S> mask_before = dropout.mask();
    const std::uint64_t counter_before = dropout.rng().counter();
    auto check_unchanged = [&] {
      CHECK(same_values(dropout.mask(), mask_before));
      CHECK(dropout.rng().counter() == counter_before);
    };

    // forward: out not [N, d].
    RowMatrix<S> wrong_out = RowMatrix<S>::Constant(4, 5, S(-9));
    REQUIRE_THROWS_AS(dropout.forward(x, wrong_out), embedhead::shape_error);
    REQUIRE_THROWS_WITH(dropout.forward(x, wrong_out), Contains("Dropout::forward") && Contains("out") &&
                                                           Contains("[4, 5]") && Contains("expected [4, 6]"));
    CHECK((wrong_out.array() == S(-9)).all());
    check_unchanged();

    // A failed forward must not count as the "last forward": backward still uses the old mask.
    const RowMatrix<S> dout = RowMatrix<S>::Ones(4, 6);
    CHECK(same_values(dropout.backward(dout), mask_before));

    // backward: dout not the mask's shape.
    const RowMatrix<S> wrong_dout = RowMatrix<S>::Ones(3, 6);
    REQUIRE_THROWS_AS(dropout.backward(wrong_dout), embedhead::shape_error);
    REQUIRE_THROWS_WITH(dropout.backward(wrong_dout),
                        Contains("Dropout::backward") && Contains("[3, 6]") && Contains("expected [4, 6]"));
    RowMatrix<S> dx_for_wrong = RowMatrix<S>::Constant(3, 6, S(-9));
    REQUIRE_THROWS_AS(dropout.backward(wrong_dout, dx_for_wrong), embedhead::shape_error);
    CHECK((dx_for_wrong.array() == S(-9)).all());

    // backward: dx not dout's shape.
    RowMatrix<S> wrong_dx = RowMatrix<S>::Constant(4, 7, S(-9));
    REQUIRE_THROWS_AS(dropout.backward(dout, wrong_dx), embedhead::shape_error);
    REQUIRE_THROWS_WITH(dropout.backward(dout, wrong_dx), Contains("dx") && Contains("[4, 7]"));
    CHECK((wrong_dx.array() == S(-9)).all());
    check_unchanged();

    // The same checks in eval mode: a failed eval forward leaves the training mask in charge.
    dropout.eval();
    REQUIRE_THROWS_AS(dropout.forward(x, wrong_out), embedhead::shape_error);
    CHECK(same_values(dropout.backward(dout), mask_before));
    check_unchanged();
  }
}
