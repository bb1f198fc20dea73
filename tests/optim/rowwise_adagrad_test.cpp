// Tests for include/embedhead/optim/rowwise_adagrad.hpp.
//
// The reference is FBGEMM's rowwise Adagrad written out in double below (one accumulator per row,
// the mean of the row's squared gradient, eps outside the square root, its three weight-decay
// modes), over the touched rows only; never the library's own code.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <embedhead/optim/rowwise_adagrad.hpp>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "../reference/test_support.hpp"
#include "optim_support.hpp"

namespace {

using Catch::Matchers::Contains;
using Catch::Matchers::WithinRel;
using embedhead::Index;
using embedhead::Parameter;
using embedhead::RowMatrix;
using embedhead::RowWiseWeightDecay;
using test_support::random_matrix;
using test_support::same_values;

// The parameter's default name here is "E".
template <typename Scalar>
std::shared_ptr<Parameter<Scalar>> make_parameter(Index rows, Index cols, std::uint64_t seed, const char* name = "E") {
  return optim_support::make_parameter<Scalar>(rows, cols, seed, name);
}
using optim_support::set_gradient;

// FBGEMM's rowwise Adagrad in double, on the rows listed (all when empty).
struct NaiveRowWiseAdagrad {
  double lr, eps, wd;
  RowWiseWeightDecay mode;
  std::vector<double> sum;
  void step(RowMatrix<double>& p, const RowMatrix<double>& g, const std::vector<Index>& rows) {
    if (sum.empty()) sum.assign(static_cast<std::size_t>(p.rows()), 0.0);
    const Index d = p.cols();
    for (Index r = 0; r < p.rows(); ++r) {
      if (!rows.empty() && std::find(rows.begin(), rows.end(), r) == rows.end()) continue;
      double square = 0;
      for (Index j = 0; j < d; ++j) {
        const double gj = mode == RowWiseWeightDecay::l2 ? g(r, j) + wd * p(r, j) : g(r, j);
        square += gj * gj;
      }
      sum[static_cast<std::size_t>(r)] += square / static_cast<double>(d);
      const double multiplier = lr / (std::sqrt(sum[static_cast<std::size_t>(r)]) + eps);
      for (Index j = 0; j < d; ++j) {
        if (mode == RowWiseWeightDecay::l2)
          p(r, j) -= multiplier * (g(r, j) + wd * p(r, j));
        else if (mode == RowWiseWeightDecay::decoupled)
          p(r, j) = (1 - lr * wd) * p(r, j) - multiplier * g(r, j);
        else
          p(r, j) -= multiplier * g(r, j);
      }
    }
  }
};

template <typename Scalar>
double tolerance() {
  return std::is_same_v<Scalar, float> ? 1e-5 : 1e-13;
}

template <typename A, typename B>
bool close(const A& a, const B& b, double tol) {
  const RowMatrix<double> da = a.template cast<double>(), db = b.template cast<double>();
  return (da - db).cwiseAbs().maxCoeff() <= tol * std::max(1.0, db.cwiseAbs().maxCoeff());
}

const std::vector<std::vector<Index>> kTouches = {{0, 3, 4}, {3}, {}, {1, 6}, {0, 3, 6}, {2}};

}  // namespace

TEMPLATE_TEST_CASE("RowWiseAdagrad follows FBGEMM's rowwise Adagrad, each weight-decay mode",
                   "[rowwise_adagrad][naive]", float, double) {
  using Scalar = TestType;
  for (const Index d : {Index{1}, Index{5}, Index{17}}) {
    const Index V = 7;
    for (const RowWiseWeightDecay mode :
         {RowWiseWeightDecay::none, RowWiseWeightDecay::l2, RowWiseWeightDecay::decoupled}) {
      CAPTURE(d, static_cast<int>(mode));
      auto p = make_parameter<Scalar>(V, d, 400);
      embedhead::RowWiseAdagradOptions options;
      options.lr = 0.1;
      options.weight_decay = mode == RowWiseWeightDecay::none ? 0.0 : 0.05;
      options.weight_decay_mode = mode;
      embedhead::RowWiseAdagrad<Scalar> adagrad(options, {p});
      NaiveRowWiseAdagrad naive{0.1, 1e-8, options.weight_decay, mode, {}};
      RowMatrix<double> expected = p->value().template cast<double>();
      for (std::size_t t = 0; t < kTouches.size(); ++t) {
        CAPTURE(t);
        const RowMatrix<double> G = random_matrix<double>(V, d, 410 + t);
        const RowMatrix<Scalar> before = p->value();
        set_gradient(*p, G, kTouches[t]);
        adagrad.step();
        naive.step(expected, G, kTouches[t]);
        CHECK(close(p->value(), expected, tolerance<Scalar>()));
        for (Index r = 0; r < V && !kTouches[t].empty(); ++r)  // untouched rows: bit for bit, decay included
          if (std::find(kTouches[t].begin(), kTouches[t].end(), r) == kTouches[t].end())
            CHECK(same_values(p->value().row(r), before.row(r)));
      }
      // The state: V values, one per row, each the reference's accumulator.
      const auto state = adagrad.state();
      const RowMatrix<Scalar>& sum = state.parameters[0].buffers.at("sum");
      REQUIRE(sum.rows() == V);
      REQUIRE(sum.cols() == 1);
      for (Index r = 0; r < V; ++r)
        CHECK_THAT(static_cast<double>(sum(r, 0)),
                   WithinRel(naive.sum[static_cast<std::size_t>(r)], tolerance<Scalar>()));
    }
  }
}

TEST_CASE("RowWiseAdagrad first step by hand", "[rowwise_adagrad][seeds]") {
  // d = 2, g = (3, 4): mean square 12.5, multiplier lr / (sqrt(12.5) + eps).
  auto p = std::make_shared<Parameter<double>>(3, 2, "E");
  p->value() << 1, 2, 3, 4, 5, 6;
  RowMatrix<double> G = RowMatrix<double>::Zero(3, 2);
  G.row(1) << 3, 4;
  set_gradient(*p, G, {1});
  embedhead::RowWiseAdagradOptions options;
  options.lr = 0.5;
  embedhead::RowWiseAdagrad<double> adagrad(options, {p});
  adagrad.step();
  const double multiplier = 0.5 / (std::sqrt(12.5) + 1e-8);
  CHECK_THAT(p->value()(1, 0), WithinRel(3 - multiplier * 3, 1e-15));
  CHECK_THAT(p->value()(1, 1), WithinRel(4 - multiplier * 4, 1e-15));
  CHECK(p->value()(0, 0) == 1);
  CHECK(p->value()(2, 1) == 6);
}

TEMPLATE_TEST_CASE("RowWiseAdagrad state: save and restore, resize_state, a parameter without a gradient",
                   "[rowwise_adagrad][state]", float, double) {
  using Scalar = TestType;
  const Index V = 7, d = 4;
  auto p = make_parameter<Scalar>(V, d, 420);
  embedhead::RowWiseAdagrad<Scalar> adagrad({}, {p});
  for (std::size_t t = 0; t < 3; ++t) {
    set_gradient(*p, random_matrix<double>(V, d, 430 + t), kTouches[t]);
    adagrad.step();
  }
  const auto saved = adagrad.state();
  auto q = make_parameter<Scalar>(V, d, 999);
  q->value() = p->value();
  embedhead::RowWiseAdagrad<Scalar> resumed({}, {q});
  resumed.load_state(saved);
  for (std::size_t t = 3; t < kTouches.size(); ++t) {
    const RowMatrix<double> G = random_matrix<double>(V, d, 430 + t);
    set_gradient(*p, G, kTouches[t]);
    set_gradient(*q, G, kTouches[t]);
    adagrad.step();
    resumed.step();
  }
  CHECK(same_values(q->value(), p->value()));

  // A buffer of the full width is not this optimizer's: refused, nothing changed.
  auto bad = saved;
  bad.parameters[0].buffers["sum"] = RowMatrix<Scalar>::Zero(V, d);
  CHECK_THROWS_AS(resumed.load_state(bad), embedhead::shape_error);
  CHECK_THROWS_WITH(resumed.load_state(bad), Contains("E.sum has shape [7, 4], expected [7, 1]"));
  CHECK(resumed.step_count() == 6);

  // Growing the table: kept rows keep their accumulator, new rows start at 0.
  const RowMatrix<Scalar> sum_before = adagrad.state().parameters[0].buffers.at("sum");
  p->resize_rows(V + 2);
  CHECK(adagrad.resize_state(*p));
  const RowMatrix<Scalar> sum_after = adagrad.state().parameters[0].buffers.at("sum");
  REQUIRE(sum_after.rows() == V + 2);
  REQUIRE(sum_after.cols() == 1);
  CHECK(same_values(sum_after.topRows(V), sum_before));
  CHECK(sum_after(V, 0) == 0);
  CHECK(sum_after(V + 1, 0) == 0);
  // The new row's first update is the first step by hand: p - lr g / (sqrt(mean g^2) + eps).
  const RowMatrix<double> G = random_matrix<double>(V + 2, d, 440);
  const RowMatrix<Scalar> before = p->value();
  set_gradient(*p, G, {V + 1});
  adagrad.step();
  const double rms = std::sqrt(G.row(V + 1).squaredNorm() / static_cast<double>(d));
  for (Index j = 0; j < d; ++j)
    CHECK_THAT(static_cast<double>(p->value()(V + 1, j)),
               WithinRel(static_cast<double>(before(V + 1, j)) - 1e-2 * G(V + 1, j) / (rms + 1e-8),
                         tolerance<Scalar>()) ||
                   Catch::Matchers::WithinAbs(static_cast<double>(before(V + 1, j)) - 1e-2 * G(V + 1, j) / (rms + 1e-8),
                                              tolerance<Scalar>()));
  // No gradient: nothing at all happens (the default skips it).
  p->zero_grad();
  const RowMatrix<Scalar> still = p->value();
  const auto state = adagrad.state();
  adagrad.step();
  CHECK(same_values(p->value(), still));
  CHECK(same_values(adagrad.state().parameters[0].buffers.at("sum"), state.parameters[0].buffers.at("sum")));
  CHECK(adagrad.step_count(*p) == 7);
}

TEST_CASE("RowWiseAdagrad rejects bad options with the value and its range; nothing changes",
          "[rowwise_adagrad][errors]") {
  auto p = make_parameter<float>(3, 2, 450);
  set_gradient(*p, random_matrix<double>(3, 2, 451), {0});
  const RowMatrix<float> value = p->value(), grad = p->grad().to_dense();
  auto make = [&](double lr, double eps, double wd, RowWiseWeightDecay mode) {
    embedhead::RowWiseAdagradOptions o;
    o.lr = lr;
    o.eps = eps;
    o.weight_decay = wd;
    o.weight_decay_mode = mode;
    return embedhead::RowWiseAdagrad<float>(o, {p});
  };
  CHECK_THROWS_WITH(make(-0.5, 1e-8, 0, RowWiseWeightDecay::l2),
                    Contains("RowWiseAdagrad: lr = -0.5 outside [0, inf)"));
  CHECK_THROWS_WITH(make(0.1, 0, 0, RowWiseWeightDecay::l2), Contains("RowWiseAdagrad: eps = 0 outside (0, inf)"));
  CHECK_THROWS_WITH(make(0.1, -1, 0, RowWiseWeightDecay::l2), Contains("RowWiseAdagrad: eps = -1 outside (0, inf)"));
  CHECK_THROWS_WITH(make(0.1, 1e-8, -0.1, RowWiseWeightDecay::l2),
                    Contains("RowWiseAdagrad: weight_decay = -0.1 outside [0, inf)"));
  CHECK_THROWS_WITH(make(0.1, 1e-8, 0.1, RowWiseWeightDecay::none),
                    Contains("RowWiseAdagrad: weight_decay = 0.1 with weight_decay_mode none"));
  CHECK(same_values(p->value(), value));
  CHECK(same_values(p->grad().to_dense(), grad));
  embedhead::RowWiseAdagrad<float> ok;
  CHECK_THROWS_WITH(ok.set_lr(-1), Contains("RowWiseAdagrad: lr = -1 outside [0, inf)"));
  CHECK(ok.lr() == 1e-2);
}

TEMPLATE_TEST_CASE("RowWiseAdagrad: eps outside the square root shows with gradients near eps",
                   "[rowwise_adagrad][naive]", float, double) {
  using Scalar = TestType;
  const Index V = 7, d = 4;
  // sqrt(G) is about 1e-8 here, as large as eps: eps inside the root (sqrt(G + eps)) would be 1e-4.
  auto p = std::make_shared<Parameter<Scalar>>(V, d, "E");  // zero: the displacement is the value
  embedhead::RowWiseAdagrad<Scalar> adagrad({}, {p});
  NaiveRowWiseAdagrad naive{1e-2, 1e-8, 0.0, RowWiseWeightDecay::l2, {}};
  RowMatrix<double> expected = RowMatrix<double>::Zero(V, d);
  for (std::size_t t = 0; t < kTouches.size(); ++t) {
    CAPTURE(t);
    const RowMatrix<double> G = 1e-8 * random_matrix<double>(V, d, 460 + t);
    set_gradient(*p, G, kTouches[t]);
    adagrad.step();
    naive.step(expected, G, kTouches[t]);
    const double error = (p->value().template cast<double>() - expected).cwiseAbs().maxCoeff();
    CHECK(error <= (std::is_same_v<Scalar, float> ? 1e-5 : 1e-12) * expected.cwiseAbs().maxCoeff());
  }
}
