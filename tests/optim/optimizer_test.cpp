// Tests for include/embedhead/optim/optimizer.hpp.
//
// Reference trajectories come from naive dense re-implementations in double below (the
// torch.optim formulas written over full [V, d] gradient matrices, zeros where a row is
// untouched), from hand-derived first steps, and from invariants (untouched rows under the lazy
// optimizers do not change at all).
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <embedhead/optim/adagrad.hpp>
#include <embedhead/optim/adamw.hpp>
#include <embedhead/optim/clip.hpp>
#include <embedhead/optim/lazy_adam.hpp>
#include <embedhead/optim/lazy_adamw.hpp>
#include <embedhead/optim/optimizer.hpp>
#include <embedhead/optim/schedule.hpp>
#include <embedhead/optim/sgd.hpp>
#include <embedhead/output_projection.hpp>
#include <embedhead/token_embedding.hpp>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../reference/test_support.hpp"
#include "optim_support.hpp"

namespace {

using Catch::Matchers::Contains;
using Catch::Matchers::WithinAbs;
using Catch::Matchers::WithinRel;
using embedhead::Index;
using embedhead::Parameter;
using embedhead::RowMatrix;
using test_support::first_difference;
using test_support::random_matrix;
using test_support::same_values;

template <typename Scalar>
using ParameterPtr = std::shared_ptr<Parameter<Scalar>>;
template <typename Scalar>
using ParameterList = std::vector<ParameterPtr<Scalar>>;

template <typename Scalar>
double tolerance() {
  return std::is_same_v<Scalar, float> ? 2e-6 : 1e-13;
}

using optim_support::make_parameter;
using optim_support::set_gradient;

// The gradient a step sees: G on `rows` (all rows when empty), zero elsewhere, in double.
RowMatrix<double> masked(const RowMatrix<double>& G, const std::vector<Index>& rows) {
  if (rows.empty()) return G;
  RowMatrix<double> out = RowMatrix<double>::Zero(G.rows(), G.cols());
  for (Index r : rows) out.row(r) = G.row(r);
  return out;
}

// A schedule of sparse gradients: step s touches rows[s] (empty: dense) with values G[s].
struct Steps {
  std::vector<RowMatrix<double>> G;
  std::vector<std::vector<Index>> rows;
};

Steps make_steps(Index V, Index d, std::uint64_t seed) {
  Steps s;
  s.rows = {{0, 3, 4}, {1, 3}, {}, {4}, {0, 2, 3}};  // step 2 is dense; row 5 only touched there
  for (std::size_t t = 0; t < s.rows.size(); ++t) s.G.push_back(random_matrix<double>(V, d, seed + t));
  return s;
}

// ---- naive dense references, in double ----

// torch.optim.Adam / AdamW (lazy = false: every row) and torch.optim.SparseAdam (lazy = true:
// the rows listed, no decay), as PyTorch documents them; t counts this reference's own steps.
struct NaiveAdam {
  double lr, b1, b2, eps, wd;
  bool decoupled, lazy;
  RowMatrix<double> m, v;
  int t = 0;
  void step(RowMatrix<double>& p, const RowMatrix<double>& g, const std::vector<Index>& rows) {
    if (m.size() == 0) m = v = RowMatrix<double>::Zero(p.rows(), p.cols());
    ++t;
    const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
    for (Index r = 0; r < p.rows(); ++r) {
      const bool touched = rows.empty() || std::find(rows.begin(), rows.end(), r) != rows.end();
      if (lazy && !touched) continue;
      for (Index j = 0; j < p.cols(); ++j) {
        double grad = touched ? g(r, j) : 0.0;
        if (lazy) {  // SparseAdam: step_size = lr sqrt(bc2) / bc1, eps outside the correction
          m(r, j) = b1 * m(r, j) + (1 - b1) * grad;
          v(r, j) = b2 * v(r, j) + (1 - b2) * grad * grad;
          p(r, j) -= lr * std::sqrt(bc2) / bc1 * m(r, j) / (std::sqrt(v(r, j)) + eps);
          continue;
        }
        if (decoupled)
          p(r, j) *= 1 - lr * wd;
        else
          grad += wd * p(r, j);
        m(r, j) = b1 * m(r, j) + (1 - b1) * grad;
        v(r, j) = b2 * v(r, j) + (1 - b2) * grad * grad;
        p(r, j) -= lr / bc1 * m(r, j) / (std::sqrt(v(r, j)) / std::sqrt(bc2) + eps);
      }
    }
  }
};

struct NaiveSGD {
  double lr, mu, wd;
  bool nesterov;
  RowMatrix<double> buf;
  void step(RowMatrix<double>& p, const RowMatrix<double>& g) {
    const bool first = buf.size() == 0;
    if (first) buf = RowMatrix<double>::Zero(p.rows(), p.cols());
    for (Index i = 0; i < p.size(); ++i) {
      p.data()[i] *= 1 - lr * wd;
      double d = g.data()[i];
      if (mu > 0) {
        buf.data()[i] = first ? d : mu * buf.data()[i] + d;
        d = nesterov ? d + mu * buf.data()[i] : buf.data()[i];
      }
      p.data()[i] -= lr * d;
    }
  }
};

struct NaiveAdagrad {
  double lr, lr_decay, init, eps;
  RowMatrix<double> sum;
  int t = 0;
  void step(RowMatrix<double>& p, const RowMatrix<double>& g) {
    if (sum.size() == 0) sum = RowMatrix<double>::Constant(p.rows(), p.cols(), init);
    ++t;
    const double clr = lr / (1 + (t - 1) * lr_decay);
    for (Index i = 0; i < p.size(); ++i) {
      sum.data()[i] += g.data()[i] * g.data()[i];
      if (g.data()[i] != 0) p.data()[i] -= clr * g.data()[i] / (std::sqrt(sum.data()[i]) + eps);
    }
  }
};

template <typename A, typename B>
bool close(const A& a, const B& b, double tol) {
  const RowMatrix<double> da = a.template cast<double>(), db = b.template cast<double>();
  return da.rows() == db.rows() && da.cols() == db.cols() &&
         (da - db).cwiseAbs().maxCoeff() <= tol * std::max(1.0, db.cwiseAbs().maxCoeff());
}

}  // namespace

TEMPLATE_TEST_CASE("AdamW and Adam follow the torch.optim formulas step by step", "[optimizer][adam][naive]", float,
                   double) {
  using Scalar = TestType;
  const Index V = 6, d = 5;
  const Steps steps = make_steps(V, d, 11);
  for (bool decoupled : {true, false}) {
    CAPTURE(decoupled);
    auto p = make_parameter<Scalar>(V, d, 10);
    embedhead::AdamOptions options;
    options.lr = 0.05;
    options.weight_decay = 0.1;
    std::unique_ptr<embedhead::Optimizer<Scalar>> adam;
    if (decoupled)
      adam = std::make_unique<embedhead::AdamW<Scalar>>(options, ParameterList<Scalar>{p});
    else
      adam = std::make_unique<embedhead::Adam<Scalar>>(options, ParameterList<Scalar>{p});
    NaiveAdam naive{0.05, 0.9, 0.999, 1e-8, 0.1, decoupled, false, {}, {}};
    RowMatrix<double> expected = p->value().template cast<double>();
    for (std::size_t t = 0; t < steps.G.size(); ++t) {
      CAPTURE(t);
      set_gradient(*p, steps.G[t], steps.rows[t]);
      adam->step();
      naive.step(expected, masked(steps.G[t], steps.rows[t]), {});
      CHECK(close(p->value(), expected, 20 * tolerance<Scalar>()));
    }
    CHECK(adam->step_count() == 5);
    CHECK(adam->step_count(*p) == 5);
  }
}

TEMPLATE_TEST_CASE("AdamW rounds after the decay and after the step: the bits of a stored decay then a plain step",
                   "[optimizer][adam]", float, double) {
  // torch.optim.AdamW rounds p after the decay and again after the step; AdamW must give the bits
  // of a decay stored first, then the same step without decay, on any build (FMA or not).
  using Scalar = TestType;
  const Index V = 7, d = 67;
  auto p = make_parameter<Scalar>(V, d, 40);
  auto q = make_parameter<Scalar>(V, d, 40);
  embedhead::AdamOptions options;
  options.lr = 0.05;
  options.weight_decay = 0.3;
  embedhead::AdamW<Scalar> decayed(options, {p});
  embedhead::AdamOptions plain_options = options;
  plain_options.weight_decay = 0.0;
  embedhead::AdamW<Scalar> plain(plain_options, {q});
  const Scalar decay = static_cast<Scalar>(1.0 - 0.05 * 0.3);
  const Steps steps = make_steps(V, d, 41);
  for (std::size_t t = 0; t < steps.G.size(); ++t) {
    CAPTURE(t);
    set_gradient(*p, steps.G[t], steps.rows[t]);
    set_gradient(*q, steps.G[t], steps.rows[t]);
    decayed.step();
    q->value() *= decay;
    plain.step();
    CHECK(same_values(p->value(), q->value()));
  }
}

TEST_CASE("AdamW first step by hand: p (1 - lr wd) - lr g / (|g| + eps)", "[optimizer][adam][seeds]") {
  // After one step m_hat = g and v_hat = g^2, so the step is lr * sign(g) (up to eps), whatever |g|.
  auto p = std::make_shared<Parameter<double>>(1, 2, "p");
  p->value() << 1.0, -2.0;
  RowMatrix<double> G(1, 2);
  G << 0.5, -3.0;
  set_gradient(*p, G, {});
  embedhead::AdamOptions options;
  options.lr = 0.1;
  options.weight_decay = 0.5;
  embedhead::AdamW<double> adam(options, {p});
  adam.step();
  CHECK_THAT(p->value()(0, 0), WithinRel(1.0 * (1 - 0.05) - 0.1 * 0.5 / (0.5 + 1e-8), 1e-14));
  CHECK_THAT(p->value()(0, 1), WithinRel(-2.0 * (1 - 0.05) + 0.1 * 3.0 / (3.0 + 1e-8), 1e-14));
}

TEMPLATE_TEST_CASE("LazyAdam is SparseAdam on the touched rows; against Adam when every row is touched",
                   "[optimizer][lazy]", float, double) {
  using Scalar = TestType;
  const Index V = 6, d = 4;
  const Steps steps = make_steps(V, d, 21);
  SECTION("against the naive lazy reference; untouched rows stay bit-identical") {
    auto p = make_parameter<Scalar>(V, d, 20);
    embedhead::AdamOptions options = embedhead::LazyAdam<Scalar>::lazy_defaults();
    options.lr = 0.05;
    embedhead::LazyAdam<Scalar> lazy(options, {p});
    NaiveAdam naive{0.05, 0.9, 0.999, 1e-8, 0.0, true, true, {}, {}};
    RowMatrix<double> expected = p->value().template cast<double>();
    for (std::size_t t = 0; t < steps.G.size(); ++t) {
      CAPTURE(t);
      const RowMatrix<Scalar> before = p->value();
      set_gradient(*p, steps.G[t], steps.rows[t]);
      lazy.step();
      naive.step(expected, steps.G[t], steps.rows[t]);
      CHECK(close(p->value(), expected, 20 * tolerance<Scalar>()));
      if (!steps.rows[t].empty())
        for (Index r = 0; r < V; ++r)
          if (std::find(steps.rows[t].begin(), steps.rows[t].end(), r) == steps.rows[t].end())
            CHECK(same_values(p->value().row(r), before.row(r)));
    }
  }
  SECTION("every row touched every step: Adam's moments bit for bit; Adam's step with eps / sqrt(1 - beta2^t)") {
    for (const double scale : {1.0, 1e-9}) {  // O(1) gradients, and gradients far below eps
      CAPTURE(scale);
      auto a = make_parameter<Scalar>(V, d, 22), b = make_parameter<Scalar>(V, d, 22);
      embedhead::LazyAdam<Scalar> lazy(embedhead::AdamOptions{}, {a});
      embedhead::Adam<Scalar> exact(embedhead::AdamOptions{}, {b});  // weight_decay 0 by default
      // Adam's formula in double with eps_t = eps / sqrt(1 - beta2^t) in place of eps.
      RowMatrix<double> expected = a->value().template cast<double>();
      RowMatrix<double> m = RowMatrix<double>::Zero(V, d), v = RowMatrix<double>::Zero(V, d);
      for (std::size_t t = 0; t < steps.G.size(); ++t) {
        const RowMatrix<double> G = scale * steps.G[t];
        set_gradient(*a, G, {});
        set_gradient(*b, G, {});
        lazy.step();
        exact.step();
        const double n = static_cast<double>(t + 1), bc1 = 1 - std::pow(0.9, n), bc2 = 1 - std::pow(0.999, n);
        const double eps_t = 1e-8 / std::sqrt(bc2);
        for (Index i = 0; i < expected.size(); ++i) {
          m.data()[i] = 0.9 * m.data()[i] + 0.1 * G.data()[i];
          v.data()[i] = 0.999 * v.data()[i] + 0.001 * G.data()[i] * G.data()[i];
          expected.data()[i] -= 1e-3 / bc1 * m.data()[i] / (std::sqrt(v.data()[i]) / std::sqrt(bc2) + eps_t);
        }
        CHECK(close(a->value(), expected, 20 * tolerance<Scalar>()));
      }
      const auto ls = lazy.state(), es = exact.state();
      CHECK(same_values(ls.parameters[0].buffers.at("exp_avg"), es.parameters[0].buffers.at("exp_avg")));
      CHECK(same_values(ls.parameters[0].buffers.at("exp_avg_sq"), es.parameters[0].buffers.at("exp_avg_sq")));
      if (scale < 1) {  // far below eps Adam's steps are many times SparseAdam's
        const RowMatrix<double> start = make_parameter<Scalar>(V, d, 22)->value().template cast<double>();
        const double lazy_moved = (a->value().template cast<double>() - start).cwiseAbs().maxCoeff();
        const double adam_moved = (b->value().template cast<double>() - start).cwiseAbs().maxCoeff();
        CHECK(adam_moved > 5 * lazy_moved);
      }
    }
  }
  SECTION("a row touched once, then not: AdamW keeps moving it, LazyAdam does not (the documented difference)") {
    auto a = make_parameter<Scalar>(V, d, 23), b = make_parameter<Scalar>(V, d, 23);
    embedhead::AdamOptions options = embedhead::LazyAdam<Scalar>::lazy_defaults();
    embedhead::LazyAdam<Scalar> lazy(options, {a});
    embedhead::Adam<Scalar> exact(options, {b});
    set_gradient(*a, steps.G[0], {0});
    set_gradient(*b, steps.G[0], {0});
    lazy.step();
    exact.step();
    for (Index r = 1; r < V; ++r) CHECK(same_values(a->value().row(r), b->value().row(r)));  // untouched so far
    const RowMatrix<Scalar> lazy_row = a->value().row(0), exact_row = b->value().row(0);
    set_gradient(*a, steps.G[1], {1});
    set_gradient(*b, steps.G[1], {1});
    lazy.step();
    exact.step();
    CHECK(same_values(a->value().row(0), lazy_row));         // lazy: row 0 untouched, unchanged
    CHECK_FALSE(same_values(b->value().row(0), exact_row));  // exact: stale momentum moves it
  }
}

TEMPLATE_TEST_CASE("SGD: plain, momentum, Nesterov, decoupled weight decay", "[optimizer][sgd][naive]", float, double) {
  using Scalar = TestType;
  const Index V = 6, d = 3;
  const Steps steps = make_steps(V, d, 31);
  struct Case {
    double mu, wd;
    bool nesterov;
  };
  for (const Case c :
       {Case{0, 0, false}, Case{0.9, 0, false}, Case{0.9, 0, true}, Case{0, 0.1, false}, Case{0.5, 0.2, true}}) {
    CAPTURE(c.mu, c.wd, c.nesterov);
    auto p = make_parameter<Scalar>(V, d, 30);
    embedhead::SGDOptions options;
    options.lr = 0.1;
    options.momentum = c.mu;
    options.nesterov = c.nesterov;
    options.weight_decay = c.wd;
    embedhead::SGD<Scalar> sgd(options, {p});
    NaiveSGD naive{0.1, c.mu, c.wd, c.nesterov, {}};
    RowMatrix<double> expected = p->value().template cast<double>();
    for (std::size_t t = 0; t < steps.G.size(); ++t) {
      set_gradient(*p, steps.G[t], steps.rows[t]);
      sgd.step();
      naive.step(expected, masked(steps.G[t], steps.rows[t]));
      CHECK(close(p->value(), expected, 10 * tolerance<Scalar>()));
    }
  }
}

TEST_CASE("SGD without momentum or decay touches only the gradient's rows, p - lr g exactly",
          "[optimizer][sgd][sparse]") {
  auto p = make_parameter<double>(5, 2, 40);
  const RowMatrix<double> before = p->value();
  RowMatrix<double> G = random_matrix<double>(5, 2, 41);
  set_gradient(*p, G, {1, 3});
  embedhead::SGDOptions options;
  options.lr = 0.5;
  embedhead::SGD<double> sgd(options, {p});
  sgd.step();
  for (Index r : {0, 2, 4}) CHECK(same_values(p->value().row(r), before.row(r)));
  for (Index r : {1, 3})
    for (Index j = 0; j < 2; ++j) CHECK(p->value()(r, j) == before(r, j) - 0.5 * G(r, j));
}

TEMPLATE_TEST_CASE("Adagrad matches torch.optim.Adagrad (lr decay, initial accumulator)", "[optimizer][adagrad][naive]",
                   float, double) {
  using Scalar = TestType;
  const Index V = 6, d = 4;
  const Steps steps = make_steps(V, d, 51);
  auto p = make_parameter<Scalar>(V, d, 50);
  embedhead::AdagradOptions options;
  options.lr = 0.1;
  options.lr_decay = 0.01;
  options.initial_accumulator_value = 0.1;
  embedhead::Adagrad<Scalar> adagrad(options, {p});
  NaiveAdagrad naive{0.1, 0.01, 0.1, 1e-10, {}};
  RowMatrix<double> expected = p->value().template cast<double>();
  for (std::size_t t = 0; t < steps.G.size(); ++t) {
    const RowMatrix<Scalar> before = p->value();
    set_gradient(*p, steps.G[t], steps.rows[t]);
    adagrad.step();
    naive.step(expected, masked(steps.G[t], steps.rows[t]));
    CHECK(close(p->value(), expected, 10 * tolerance<Scalar>()));
    for (Index r = 0; r < V && !steps.rows[t].empty(); ++r)  // untouched rows: exactly as before
      if (std::find(steps.rows[t].begin(), steps.rows[t].end(), r) == steps.rows[t].end())
        CHECK(same_values(p->value().row(r), before.row(r)));
  }
}

TEST_CASE("parameter groups: per-group learning-rate multiplier and weight decay", "[optimizer][groups]") {
  auto embedding = make_parameter<double>(4, 2, 60, "E");
  auto bias = make_parameter<double>(4, 1, 61, "b");
  const RowMatrix<double> E0 = embedding->value(), b0 = bias->value();
  embedhead::SGDOptions options;
  options.lr = 0.1;
  options.weight_decay = 0.5;
  embedhead::SGD<double> sgd(options);
  embedhead::ParameterGroupOptions embedding_group;
  embedding_group.lr_multiplier = std::sqrt(16.0);  // eta_E = sqrt(d_model) eta_W, as the seeds cite
  sgd.add_group({embedding}, embedding_group);
  embedhead::ParameterGroupOptions bias_group;
  bias_group.weight_decay = 0.0;  // no decay on biases
  sgd.add_group({bias}, bias_group);
  const RowMatrix<double> GE = random_matrix<double>(4, 2, 62), Gb = random_matrix<double>(4, 1, 63);
  set_gradient(*embedding, GE, {});
  set_gradient(*bias, Gb, {});
  sgd.step();
  CHECK(close(embedding->value(), RowMatrix<double>(E0 * (1 - 0.4 * 0.5) - 0.4 * GE), 1e-15));
  CHECK(close(bias->value(), RowMatrix<double>(b0 - 0.1 * Gb), 1e-15));
  REQUIRE(sgd.groups().size() == 2);
  CHECK(sgd.groups()[0].weight_decay == 0.5);
  CHECK(sgd.groups()[1].weight_decay == 0.0);
}

TEMPLATE_TEST_CASE("a tied pair is one parameter: one update with the summed gradient", "[optimizer][tied]", float,
                   double) {
  using Scalar = TestType;
  const Index V = 7, d = 3;
  embedhead::TokenEmbedding<Scalar> embedding(V, d);
  embedhead::OutputProjection<Scalar> head(embedding);
  std::vector<ParameterPtr<Scalar>> list{embedding.weight_ptr()};
  for (const auto& p : head.parameters()) list.push_back(p);
  REQUIRE(list.size() == 2);  // E twice
  SECTION("registering the raw list is an error that names the table") {
    embedhead::SGD<Scalar> sgd;
    CHECK_THROWS_AS(sgd.add_group(list), embedhead::value_error);
    CHECK_THROWS_WITH(sgd.add_group(list),
                      Contains("SGD: parameter 'token_embedding.weight' [7, 3] is registered twice"));
    CHECK(sgd.groups().empty());
  }
  SECTION("unique_parameters: the sparse and dense contributions are summed once") {
    const auto unique = embedhead::unique_parameters(list);
    REQUIRE(unique.size() == 1);
    embedhead::SGDOptions options;
    options.lr = 0.1;
    embedhead::SGD<Scalar> sgd(options, unique);
    embedhead::IdMatrix<std::int32_t> ids(1, 2);
    ids << 2, 5;
    const RowMatrix<Scalar> h = random_matrix<Scalar>(2, d, 70), dlogits = random_matrix<Scalar>(2, V, 71);
    RowMatrix<Scalar> dh(2, d);
    head.backward(h, dlogits, dh);
    embedding.backward(ids, dh);
    const RowMatrix<Scalar> total = embedding.weight().grad().to_dense();
    const RowMatrix<Scalar> before = embedding.weight().value();
    sgd.step();
    CHECK(close(embedding.weight().value(), RowMatrix<Scalar>(before - Scalar(0.1) * total), 4 * tolerance<Scalar>()));
  }
}

TEMPLATE_TEST_CASE("clip_grad_norm counts each touched row once, sparse and dense together", "[optimizer][clip]", float,
                   double) {
  using Scalar = TestType;
  auto sparse = make_parameter<Scalar>(8, 3, 80, "E");
  auto dense = make_parameter<Scalar>(2, 3, 81, "W");
  const RowMatrix<double> GS = random_matrix<double>(8, 3, 82), GD = random_matrix<double>(2, 3, 83);
  set_gradient(*sparse, GS, {1, 6});
  set_gradient(*dense, GD, {});
  const double expected = std::sqrt(masked(GS, {1, 6}).squaredNorm() + GD.squaredNorm());
  SECTION("below the threshold: nothing changes") {
    const double norm = embedhead::clip_grad_norm<Scalar>({sparse, dense, sparse}, 1e3);  // sparse listed twice
    CHECK_THAT(norm, WithinRel(expected, 1e-6));
    CHECK(close(sparse->grad().to_dense(), masked(GS, {1, 6}), tolerance<Scalar>()));
  }
  SECTION("above: scaled by max_norm / (norm + 1e-6)") {
    const double norm = embedhead::clip_grad_norm<Scalar>({sparse, dense}, 0.5);
    CHECK_THAT(norm, WithinRel(expected, 1e-6));
    const double factor = 0.5 / (expected + 1e-6);
    CHECK(close(sparse->grad().to_dense(), RowMatrix<double>(masked(GS, {1, 6}) * factor), 10 * tolerance<Scalar>()));
    CHECK(close(dense->grad().to_dense(), RowMatrix<double>(GD * factor), 10 * tolerance<Scalar>()));
    CHECK(sparse->grad().num_touched() == 2);  // still sparse
    CHECK_THAT(embedhead::clip_grad_norm<Scalar>({sparse, dense}, 1e3), WithinRel(0.5, 1e-5));
  }
  SECTION("errors") {
    CHECK_THROWS_WITH(embedhead::clip_grad_norm<Scalar>({sparse}, -1.0),
                      Contains("clip_grad_norm: max_norm = -1 outside [0, inf)"));
    CHECK_THROWS_WITH(embedhead::clip_grad_norm<Scalar>({sparse, nullptr}, 1.0),
                      Contains("parameter 1 is a null pointer"));
    CHECK(close(sparse->grad().to_dense(), masked(GS, {1, 6}), tolerance<Scalar>()));
  }
}

TEMPLATE_TEST_CASE("clip_grad_norm with a NaN or infinite gradient: PyTorch's result, or an error",
                   "[optimizer][clip][nonfinite]", float, double) {
  // docs/errors.md, "Non-finite values". PyTorch multiplies every gradient by
  // clamp(max_norm / (norm + 1e-6), max = 1): a NaN norm makes every gradient NaN, an infinite one
  // makes the factor 0. error_if_nonfinite throws instead, before anything is scaled.
  using Scalar = TestType;
  const Scalar inf = std::numeric_limits<Scalar>::infinity(), nan = std::numeric_limits<Scalar>::quiet_NaN();
  auto sparse = make_parameter<Scalar>(8, 3, 90, "E");
  auto dense = make_parameter<Scalar>(2, 3, 91, "W");
  RowMatrix<double> GS = random_matrix<double>(8, 3, 92), GD = random_matrix<double>(2, 3, 93);
  auto gradients = [&] { return std::pair{sparse->grad().to_dense(), dense->grad().to_dense()}; };

  SECTION("a NaN: the norm is NaN and every stored gradient entry becomes NaN") {
    GS(6, 1) = nan;
    set_gradient(*sparse, GS, {1, 6});
    set_gradient(*dense, GD, {});
    const double norm = embedhead::clip_grad_norm<Scalar>({sparse, dense}, 1e3);  // far above any finite norm
    CHECK(std::isnan(norm));
    CHECK(sparse->grad().touched_values().array().isNaN().all());
    CHECK(dense->grad().touched_values().array().isNaN().all());
    // A row-sparse gradient's untouched rows are not stored: they stay zero (PyTorch's dense
    // gradient would be NaN there too).
    CHECK(sparse->grad().num_touched() == 2);
    CHECK(sparse->grad().to_dense().row(0).isZero(0));
  }
  SECTION("an infinity: the norm is inf, the factor 0: finite entries become 0, infinite ones NaN") {
    GD(1, 2) = -inf;
    set_gradient(*sparse, GS, {1, 6});
    set_gradient(*dense, GD, {});
    const double norm = embedhead::clip_grad_norm<Scalar>({sparse, dense}, 1.0);
    CHECK(norm == std::numeric_limits<double>::infinity());
    CHECK(sparse->grad().touched_values().isZero(0));
    RowMatrix<Scalar> d = dense->grad().to_dense();
    CHECK(std::isnan(d(1, 2)));
    d(1, 2) = 0;
    CHECK(d.isZero(0));
  }
  SECTION("error_if_nonfinite: value_error naming the first non-finite entry; nothing scaled") {
    GS(6, 1) = nan;
    GD(0, 2) = inf;
    set_gradient(*sparse, GS, {1, 6});
    set_gradient(*dense, GD, {});
    const auto before = gradients();
    auto unchanged = [&] {
      const auto now = gradients();
      CHECK(test_support::first_difference_nan(now.first, before.first) == "");
      CHECK(test_support::first_difference_nan(now.second, before.second) == "");
      CHECK(sparse->grad().num_touched() == 2);
    };
    CHECK_THROWS_AS(embedhead::clip_grad_norm<Scalar>({sparse, dense}, 1.0, true), embedhead::value_error);
    CHECK_THROWS_WITH(embedhead::clip_grad_norm<Scalar>({sparse, dense}, 1.0, true),
                      Contains("clip_grad_norm: gradient nan at (6, 1) of parameter 0 ('E'): the norm is nan, "
                               "outside the finite numbers (error_if_nonfinite)"));
    // In the order given, each parameter once; the dense one first here.
    CHECK_THROWS_WITH(embedhead::clip_grad_norm<Scalar>({dense, sparse, dense}, 1.0, true),
                      Contains("gradient inf at (0, 2) of parameter 0 ('W')"));
    unchanged();
  }
  SECTION("error_if_nonfinite with finite gradients: the same as without") {
    set_gradient(*sparse, GS, {1, 6});
    set_gradient(*dense, GD, {});
    const double with_option = embedhead::clip_grad_norm<Scalar>({sparse, dense}, 0.5, true);
    const auto clipped = gradients();
    set_gradient(*sparse, GS, {1, 6});
    set_gradient(*dense, GD, {});
    CHECK(embedhead::clip_grad_norm<Scalar>({sparse, dense}, 0.5) == with_option);
    CHECK(same_values(gradients().first, clipped.first));
    CHECK(same_values(gradients().second, clipped.second));
  }
}

TEST_CASE("clip_grad_norm: double gradients whose squares overflow still have a finite norm", "[optimizer][clip]") {
  // Each entry below 1.8e308, their squares above: the norm is computed rescaled, not as inf (which
  // would scale every gradient by 0).
  const double big = std::numeric_limits<double>::max() / 4;
  auto p = std::make_shared<Parameter<double>>(2, 2, "W");
  RowMatrix<double> G(2, 2);
  G << big, 0, -big, big;
  set_gradient(*p, G, {});
  const double norm = embedhead::clip_grad_norm<double>({p}, 1.0, true);
  CHECK_THAT(norm, WithinRel(std::sqrt(3.0) * big, 1e-12));
  CHECK_THAT(p->grad().to_dense()(0, 0), WithinRel(1 / std::sqrt(3.0), 1e-12));
  CHECK_THAT(p->grad().to_dense()(1, 0), WithinRel(-1 / std::sqrt(3.0), 1e-12));
}

TEST_CASE("clip_grad_norm: finite double gradients whose norm exceeds the largest double",
          "[optimizer][clip][nonfinite]") {
  // Two entries of 1.5e308: each finite, but the norm 1.5e308 * sqrt(2) ~ 2.1e308 is beyond
  // 1.7977e308, so it is inf even rescaled.
  auto p = std::make_shared<Parameter<double>>(2, 2, "W");
  RowMatrix<double> G(2, 2);
  G << 1.5e308, 0, 0, -1.5e308;
  SECTION("error_if_nonfinite: value_error saying every entry is finite; nothing scaled") {
    set_gradient(*p, G, {});
    CHECK_THROWS_AS(embedhead::clip_grad_norm<double>({p}, 1.0, true), embedhead::value_error);
    CHECK_THROWS_WITH(embedhead::clip_grad_norm<double>({p}, 1.0, true),
                      Contains("clip_grad_norm: the norm is inf, outside the finite numbers (error_if_nonfinite): "
                               "every entry is finite, but the norm exceeds the largest double"));
    CHECK(same_values(p->grad().to_dense(), G));
  }
  SECTION("without it: PyTorch's result, the norm inf and the factor 0") {
    set_gradient(*p, G, {});
    CHECK(embedhead::clip_grad_norm<double>({p}, 1.0) == std::numeric_limits<double>::infinity());
    CHECK(p->grad().to_dense().isZero(0));
  }
}

TEST_CASE("learning-rate schedules", "[optimizer][schedule]") {
  const auto constant = embedhead::LrSchedule::constant();
  CHECK(constant(0) == 1.0);
  CHECK(constant(1000) == 1.0);
  const auto warmup = embedhead::LrSchedule::linear_warmup(4);
  CHECK(warmup(0) == 0.25);
  CHECK(warmup(3) == 1.0);
  CHECK(warmup(10) == 1.0);
  const auto cosine = embedhead::LrSchedule::warmup_cosine(2, 12, 0.1);
  CHECK(cosine(0) == 0.5);
  CHECK(cosine(2) == 1.0);                                   // progress 0
  CHECK_THAT(cosine(7), WithinAbs(0.1 + 0.9 * 0.5, 1e-15));  // progress 1/2
  CHECK_THAT(cosine(12), WithinAbs(0.1, 1e-15));             // the end
  CHECK_THAT(cosine(100), WithinAbs(0.1, 1e-15));            // and after it
  CHECK_THROWS_WITH(embedhead::LrSchedule::linear_warmup(-1), Contains("warmup_steps = -1 outside [0, inf)"));
  CHECK_THROWS_WITH(embedhead::LrSchedule::warmup_cosine(5, 5), Contains("total_steps = 5 outside (5, inf)"));
  CHECK_THROWS_WITH(embedhead::LrSchedule::warmup_cosine(0, 5, 1.5), Contains("min_ratio = 1.5 outside [0, 1]"));
}

TEMPLATE_TEST_CASE("state save and restore continues the same trajectory", "[optimizer][state]", float, double) {
  using Scalar = TestType;
  const Index V = 6, d = 3;
  const Steps steps = make_steps(V, d, 91);
  auto run = [&](auto make_optimizer) {
    auto p = make_parameter<Scalar>(V, d, 90, "E");
    auto optimizer = make_optimizer(p);
    for (std::size_t t = 0; t < 2; ++t) {
      set_gradient(*p, steps.G[t], steps.rows[t]);
      optimizer.step();
    }
    const auto saved = optimizer.state();
    const RowMatrix<Scalar> value_at_save = p->value();
    for (std::size_t t = 2; t < 5; ++t) {
      set_gradient(*p, steps.G[t], steps.rows[t]);
      optimizer.step();
    }
    // A new parameter with the saved values and a new optimizer with the saved state.
    auto q = make_parameter<Scalar>(V, d, 999, "E");
    q->value() = value_at_save;
    auto resumed = make_optimizer(q);
    resumed.load_state(saved);
    CHECK(resumed.step_count() == 2);
    for (std::size_t t = 2; t < 5; ++t) {
      set_gradient(*q, steps.G[t], steps.rows[t]);
      resumed.step();
    }
    CHECK(same_values(q->value(), p->value()));
  };
  embedhead::SGDOptions sgd_options;
  sgd_options.momentum = 0.9;
  run([&](const ParameterPtr<Scalar>& p) { return embedhead::SGD<Scalar>(sgd_options, {p}); });
  run([&](const ParameterPtr<Scalar>& p) { return embedhead::AdamW<Scalar>(embedhead::AdamOptions{}, {p}); });
  run([&](const ParameterPtr<Scalar>& p) {
    return embedhead::LazyAdam<Scalar>(embedhead::LazyAdam<Scalar>::lazy_defaults(), {p});
  });
  run([&](const ParameterPtr<Scalar>& p) { return embedhead::Adagrad<Scalar>(embedhead::AdagradOptions{}, {p}); });
  run([&](const ParameterPtr<Scalar>& p) { return embedhead::LazyAdamW<Scalar>(embedhead::AdamOptions{}, {p}); });
}

TEMPLATE_TEST_CASE("load_state rejects a state that does not fit and changes nothing", "[optimizer][state][errors]",
                   float, double) {
  using Scalar = TestType;
  auto p = make_parameter<Scalar>(4, 2, 100, "E");
  embedhead::AdamW<Scalar> adam(embedhead::AdamOptions{}, {p});
  set_gradient(*p, random_matrix<double>(4, 2, 101), {});
  adam.step();
  const auto good = adam.state();
  auto bad = good;
  bad.optimizer = "SGD";
  CHECK_THROWS_WITH(adam.load_state(bad), Contains("AdamW::load_state: the state is of 'SGD', not 'AdamW'"));
  bad = good;
  bad.parameters[0].name = "W";  // a renamed entry is a value_error, as documented (issue 15)
  CHECK_THROWS_AS(adam.load_state(bad), embedhead::value_error);
  CHECK_THROWS_WITH(adam.load_state(bad), Contains("parameter 0 is 'W' [4, 2] in the state but 'E' [4, 2] here"));
  bad = good;
  bad.parameters[0].rows = 5;  // a shape that differs is a shape_error
  CHECK_THROWS_AS(adam.load_state(bad), embedhead::shape_error);
  CHECK_THROWS_WITH(adam.load_state(bad), Contains("parameter 0 is 'E' [5, 2] in the state but 'E' [4, 2] here"));
  bad = good;
  bad.parameters[0].buffers["exp_avg"] = RowMatrix<Scalar>::Zero(3, 2);
  CHECK_THROWS_AS(adam.load_state(bad), embedhead::shape_error);
  CHECK_THROWS_WITH(adam.load_state(bad), Contains("E.exp_avg has shape [3, 2], expected [4, 2]"));
  bad = good;
  bad.parameters[0].buffers["momentum_buffer"] = RowMatrix<Scalar>::Zero(4, 2);
  CHECK_THROWS_WITH(adam.load_state(bad), Contains("has a buffer 'momentum_buffer' that AdamW does not use"));
  bad = good;
  bad.parameters.clear();
  CHECK_THROWS_WITH(adam.load_state(bad),
                    Contains("the state has 0 parameters and step 1, this optimizer 1 parameters"));
  // Unchanged: the state reads back equal, and the step count is still 1.
  const auto after = adam.state();
  CHECK(adam.step_count() == 1);
  CHECK(same_values(after.parameters[0].buffers.at("exp_avg"), good.parameters[0].buffers.at("exp_avg")));
}

TEST_CASE("optimizers reject bad hyperparameters with the value and its range", "[optimizer][errors]") {
  using P = ParameterPtr<float>;
  const P p = make_parameter<float>(2, 2, 110);
  auto sgd = [](double lr, double mu, bool nesterov, double wd) {
    embedhead::SGDOptions o;
    o.lr = lr;
    o.momentum = mu;
    o.nesterov = nesterov;
    o.weight_decay = wd;
    return embedhead::SGD<float>(o);
  };
  CHECK_THROWS_WITH(sgd(-0.1, 0, false, 0), Contains("SGD: lr = -0.1 outside [0, inf)"));
  CHECK_THROWS_WITH(sgd(0.1, 1.0, false, 0), Contains("SGD: momentum = 1 outside [0, 1)"));
  CHECK_THROWS_WITH(sgd(0.1, 0, true, 0), Contains("SGD: nesterov = true needs momentum > 0"));
  CHECK_THROWS_WITH(sgd(0.1, 0, false, -1), Contains("SGD: weight_decay = -1 outside [0, inf)"));
  auto adam = [](double b1, double b2, double eps) {
    embedhead::AdamOptions o;
    o.beta1 = b1;
    o.beta2 = b2;
    o.eps = eps;
    return embedhead::AdamW<float>(o);
  };
  CHECK_THROWS_WITH(adam(1.0, 0.999, 1e-8), Contains("AdamW: beta1 = 1 outside [0, 1)"));
  CHECK_THROWS_WITH(adam(0.9, -0.5, 1e-8), Contains("AdamW: beta2 = -0.5 outside [0, 1)"));
  CHECK_THROWS_WITH(adam(0.9, 0.999, 0.0), Contains("AdamW: eps = 0 outside (0, inf)"));
  CHECK_THROWS_WITH(adam(0.9, 0.999, -1e-8), Contains("AdamW: eps = -1e-08 outside (0, inf)"));
  embedhead::AdamOptions lazy_decay = embedhead::LazyAdam<float>::lazy_defaults();
  lazy_decay.weight_decay = 0.01;
  CHECK_THROWS_WITH(embedhead::LazyAdam<float>(lazy_decay), Contains("LazyAdam: weight_decay = 0.01 is not supported"));
  embedhead::AdagradOptions adagrad;
  adagrad.eps = 0;
  CHECK_THROWS_WITH(embedhead::Adagrad<float>(adagrad), Contains("Adagrad: eps = 0 outside (0, inf)"));

  embedhead::SGD<float> ok;
  CHECK_THROWS_WITH(ok.set_lr(std::numeric_limits<double>::quiet_NaN()), Contains("SGD: lr = nan outside [0, inf)"));
  CHECK(ok.lr() == embedhead::SGDOptions{}.lr);
  embedhead::ParameterGroupOptions negative;
  negative.lr_multiplier = -2;
  CHECK_THROWS_WITH(ok.add_group({p}, negative), Contains("SGD: lr_multiplier = -2 outside [0, inf)"));
  CHECK_THROWS_WITH(ok.add_group({p, nullptr}), Contains("SGD: parameter 1 of the group is a null pointer"));
  CHECK(ok.groups().empty());
  ok.add_group({p});
  CHECK_THROWS_WITH(ok.add_group({p}), Contains("is registered twice"));
  CHECK(ok.groups().size() == 1);
  embedhead::ParameterGroupOptions decay;
  decay.weight_decay = 0.1;
  embedhead::LazyAdam<float> lazy;
  CHECK_THROWS_WITH(lazy.add_group({p}, decay), Contains("LazyAdam: weight_decay = 0.1 is not supported"));
  CHECK(lazy.groups().empty());
}

// ---- frozen parameters ----

TEMPLATE_TEST_CASE("step skips a frozen parameter: value, state and its own step count untouched",
                   "[optimizer][freeze]", float, double) {
  using Scalar = TestType;
  const Index V = 5, d = 3;
  auto trained = make_parameter<Scalar>(V, d, 120, "W"), frozen = make_parameter<Scalar>(V, d, 121, "E");
  frozen->set_frozen(true);
  embedhead::AdamOptions options;
  options.lr = 0.05;
  embedhead::AdamW<Scalar> adam(options, {trained, frozen});
  NaiveAdam naive{0.05, 0.9, 0.999, 1e-8, 0.01, true, false, {}, {}};
  RowMatrix<double> expected = trained->value().template cast<double>();
  const RowMatrix<Scalar> frozen_before = frozen->value();
  const RowMatrix<double> G = random_matrix<double>(V, d, 122);
  for (int t = 0; t < 2; ++t) {
    set_gradient(*trained, G, {});
    set_gradient(*frozen, G, {0, 2});  // written through grad() directly: still ignored
    adam.step();
    naive.step(expected, G, {});
  }
  CHECK(adam.step_count() == 2);
  CHECK(adam.step_count(*trained) == 2);
  CHECK(adam.step_count(*frozen) == 0);
  CHECK(close(trained->value(), expected, 20 * tolerance<Scalar>()));
  CHECK(same_values(frozen->value(), frozen_before));
  const auto state = adam.state();
  CHECK(state.parameters[1].buffers.empty());  // never updated, so no buffer was even created

  // Unfrozen, it trains from fresh moments at its own t = 1 (as PyTorch, whose frozen parameter
  // has no grad and so no step), while the optimizer is at its third step.
  frozen->set_frozen(false);
  set_gradient(*frozen, G, {0, 2});
  set_gradient(*trained, G, {});
  adam.step();
  CHECK(adam.step_count(*frozen) == 1);
  NaiveAdam late{0.05, 0.9, 0.999, 1e-8, 0.01, true, false, {}, {}};
  RowMatrix<double> frozen_expected = frozen_before.template cast<double>();
  late.step(frozen_expected, masked(G, {0, 2}), {});
  CHECK(close(frozen->value(), frozen_expected, 20 * tolerance<Scalar>()));
}

TEMPLATE_TEST_CASE("every optimizer leaves a frozen parameter bit-identical", "[optimizer][freeze]", float, double) {
  using Scalar = TestType;
  const Index V = 4, d = 2;
  const RowMatrix<double> G = random_matrix<double>(V, d, 130);
  auto check = [&](auto make_optimizer) {
    auto p = make_parameter<Scalar>(V, d, 131);
    p->set_frozen(true);
    const RowMatrix<Scalar> before = p->value();
    auto optimizer = make_optimizer(p);
    set_gradient(*p, G, {1});
    optimizer.step();
    set_gradient(*p, G, {});
    optimizer.step();
    CHECK(same_values(p->value(), before));
    CHECK(optimizer.step_count() == 2);
  };
  embedhead::SGDOptions sgd;
  sgd.momentum = 0.9;
  sgd.weight_decay = 0.1;
  check([&](const ParameterPtr<Scalar>& p) { return embedhead::SGD<Scalar>(sgd, {p}); });
  check([&](const ParameterPtr<Scalar>& p) { return embedhead::AdamW<Scalar>(embedhead::AdamOptions{}, {p}); });
  check([&](const ParameterPtr<Scalar>& p) {
    return embedhead::LazyAdam<Scalar>(embedhead::LazyAdam<Scalar>::lazy_defaults(), {p});
  });
  check([&](const ParameterPtr<Scalar>& p) { return embedhead::Adagrad<Scalar>(embedhead::AdagradOptions{}, {p}); });
  check([&](const ParameterPtr<Scalar>& p) { return embedhead::LazyAdamW<Scalar>(embedhead::AdamOptions{}, {p}); });
}

TEMPLATE_TEST_CASE("clip_grad_norm ignores frozen parameters", "[optimizer][freeze][clip]", float, double) {
  using Scalar = TestType;
  auto trained = make_parameter<Scalar>(3, 2, 140, "W"), frozen = make_parameter<Scalar>(3, 2, 141, "E");
  frozen->set_frozen(true);
  const RowMatrix<double> G = random_matrix<double>(3, 2, 142);
  set_gradient(*trained, G, {});
  set_gradient(*frozen, G, {0, 1});  // written directly: neither counted nor scaled
  const double norm = embedhead::clip_grad_norm<Scalar>({trained, frozen}, 0.1);
  CHECK_THAT(norm, WithinRel(G.norm(), 1e-6));
  CHECK(close(frozen->grad().to_dense(), masked(G, {0, 1}), tolerance<Scalar>()));
  CHECK(close(trained->grad().to_dense(), RowMatrix<double>(G * (0.1 / (G.norm() + 1e-6))), 10 * tolerance<Scalar>()));
}

// ---- resize_state ----

TEMPLATE_TEST_CASE("resize_state: kept rows continue bit-identically, new rows start from fresh state",
                   "[optimizer][resize]", float, double) {
  using Scalar = TestType;
  const Index V = 6, d = 4, grown = 9;
  const Steps steps = make_steps(V, d, 150);
  const RowMatrix<double> G = random_matrix<double>(grown, d, 151);
  const std::vector<Index> after_rows = {1, 3, 7};  // two old rows and a new one

  auto run = [&](auto make_optimizer, bool sparse_adam) {
    // p is resized after three steps; q is the reference that never is.
    auto p = make_parameter<Scalar>(V, d, 152, "E"), q = make_parameter<Scalar>(V, d, 152, "E");
    auto op = make_optimizer(p);
    auto oq = make_optimizer(q);
    for (std::size_t t = 0; t < 3; ++t) {
      set_gradient(*p, steps.G[t], steps.rows[t]);
      set_gradient(*q, steps.G[t], steps.rows[t]);
      op.step();
      oq.step();
    }
    REQUIRE(same_values(p->value(), q->value()));
    p->resize_rows(grown);
    CHECK(op.resize_state(*p));
    const auto state = op.state(), reference = oq.state();
    REQUIRE(state.parameters[0].rows == grown);
    for (const char* key : {"exp_avg", "exp_avg_sq"}) {
      const RowMatrix<Scalar>& buffer = state.parameters[0].buffers.at(key);
      REQUIRE(buffer.rows() == grown);
      CHECK(same_values(buffer.topRows(V), reference.parameters[0].buffers.at(key)));
      CHECK(buffer.bottomRows(grown - V) == RowMatrix<Scalar>::Zero(grown - V, d));
    }
    // One more step: old rows 1 and 3 touched, new row 7 touched, the rest not.
    set_gradient(*p, G, after_rows);
    set_gradient(*q, RowMatrix<double>(G.topRows(V)), {1, 3});
    op.step();
    oq.step();
    CHECK(test_support::first_difference(p->value().topRows(V), q->value()).empty());
    // Row 7 from zero value and zero moments at t = 4: m = (1 - b1) g, v = (1 - b2) g^2.
    const double lr = 1e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8, t = 4;
    RowMatrix<double> row7(1, d);
    for (Index c = 0; c < d; ++c) {
      const double g = G(7, c), m = (1 - b1) * g, v = (1 - b2) * g * g;
      const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
      row7(0, c) = sparse_adam ? -lr * std::sqrt(bc2) / bc1 * m / (std::sqrt(v) + eps)
                               : -lr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + eps);
    }
    CHECK(close(p->value().row(7), row7, 20 * tolerance<Scalar>()));
    // Untouched new rows: zero stays zero (AdamW's decay of 0 is 0; LazyAdam does not visit them).
    CHECK(p->value().row(6) == RowMatrix<Scalar>::Zero(1, d));
    CHECK(p->value().row(8) == RowMatrix<Scalar>::Zero(1, d));

    // Shrinking to 4 rows: rows 0..3 still follow the reference exactly.
    p->resize_rows(4);
    CHECK(op.resize_state(*p));
    CHECK(op.state().parameters[0].buffers.at("exp_avg").rows() == 4);
    set_gradient(*p, RowMatrix<double>(G.topRows(4)), {0, 3});
    set_gradient(*q, RowMatrix<double>(G.topRows(V)), {0, 3});
    op.step();
    oq.step();
    CHECK(test_support::first_difference(p->value(), q->value().topRows(4)).empty());
  };
  SECTION("AdamW") {
    run([](const ParameterPtr<Scalar>& p) { return embedhead::AdamW<Scalar>(embedhead::AdamOptions{}, {p}); }, false);
  }
  SECTION("LazyAdam") {
    run(
        [](const ParameterPtr<Scalar>& p) {
          return embedhead::LazyAdam<Scalar>(embedhead::LazyAdam<Scalar>::lazy_defaults(), {p});
        },
        true);
  }
}

TEMPLATE_TEST_CASE("resize_state: each buffer's initial value; unregistered parameters and absent buffers",
                   "[optimizer][resize]", float, double) {
  using Scalar = TestType;
  const RowMatrix<double> G = random_matrix<double>(3, 2, 160);
  SECTION("Adagrad's sum starts new rows at initial_accumulator_value") {
    auto p = make_parameter<Scalar>(3, 2, 161);
    embedhead::AdagradOptions options;
    options.initial_accumulator_value = 0.25;
    embedhead::Adagrad<Scalar> adagrad(options, {p});
    set_gradient(*p, G, {});
    adagrad.step();
    const RowMatrix<Scalar> sum = adagrad.state().parameters[0].buffers.at("sum");
    p->resize_rows(5);
    adagrad.resize_state(*p);
    const RowMatrix<Scalar> resized = adagrad.state().parameters[0].buffers.at("sum");
    CHECK(same_values(resized.topRows(3), sum));
    CHECK(resized.bottomRows(2) == RowMatrix<Scalar>::Constant(2, 2, Scalar(0.25)));
  }
  SECTION("SGD's momentum buffer starts new rows at zero") {
    auto p = make_parameter<Scalar>(3, 2, 162);
    embedhead::SGDOptions options;
    options.momentum = 0.9;
    embedhead::SGD<Scalar> sgd(options, {p});
    set_gradient(*p, G, {});
    sgd.step();
    p->resize_rows(4);
    sgd.resize_state(*p);
    const RowMatrix<Scalar> buffer = sgd.state().parameters[0].buffers.at("momentum_buffer");
    CHECK(buffer.rows() == 4);
    CHECK(buffer.row(3) == RowMatrix<Scalar>::Zero(1, 2));
  }
  SECTION("before the first step there is no buffer to resize; one is created at the new size") {
    auto p = make_parameter<Scalar>(3, 2, 163);
    embedhead::AdamW<Scalar> adam(embedhead::AdamOptions{}, {p});
    p->resize_rows(5);
    CHECK(adam.resize_state(*p));
    CHECK(adam.state().parameters[0].buffers.empty());
    set_gradient(*p, random_matrix<double>(5, 2, 164), {4});
    adam.step();
    CHECK(adam.state().parameters[0].buffers.at("exp_avg").rows() == 5);
  }
  SECTION("a parameter the optimizer does not hold: false, nothing changes") {
    auto p = make_parameter<Scalar>(3, 2, 165), other = make_parameter<Scalar>(3, 2, 166);
    embedhead::AdamW<Scalar> adam(embedhead::AdamOptions{}, {p});
    set_gradient(*p, G, {});
    adam.step();
    const auto before = adam.state();
    other->resize_rows(6);
    CHECK_FALSE(adam.resize_state(*other));
    CHECK(same_values(adam.state().parameters[0].buffers.at("exp_avg"), before.parameters[0].buffers.at("exp_avg")));
  }
}

// ---- state that no longer matches its parameter ----

TEMPLATE_TEST_CASE("step and state() reject buffers that no longer match their parameter; nothing changes",
                   "[optimizer][resize][errors]", float, double) {
  using Scalar = TestType;
  const Index V = 4, d = 3;
  // p is resized without resize_state; q, registered beside it, is not. The reference optimizer
  // over copies of them takes the same first step and no other.
  auto run = [&](auto make_optimizer, const std::string& name, const std::string& buffer) {
    for (const Index new_rows : {Index{7}, Index{2}}) {
      INFO("resized to " << new_rows << " rows");
      auto p = make_parameter<Scalar>(V, d, 170, "E"), q = make_parameter<Scalar>(2, d, 171, "b");
      auto p0 = make_parameter<Scalar>(V, d, 170, "E"), q0 = make_parameter<Scalar>(2, d, 171, "b");
      auto optimizer = make_optimizer(p, q);
      auto reference = make_optimizer(p0, q0);
      const RowMatrix<double> Gp = random_matrix<double>(V, d, 172), Gq = random_matrix<double>(2, d, 173);
      set_gradient(*p, Gp, {});
      set_gradient(*p0, Gp, {});
      set_gradient(*q, Gq, {});
      set_gradient(*q0, Gq, {});
      optimizer.step();
      reference.step();
      p->resize_rows(new_rows);
      // Every row has a gradient, those beyond the buffers' rows too.
      set_gradient(*p, random_matrix<double>(new_rows, d, 174), {});
      const RowMatrix<Scalar> p_before = p->value(), q_before = q->value(), g_before = p->grad().to_dense();
      const std::string expected = "parameter 'E' is [" + std::to_string(new_rows) + ", 3] but its state '" + buffer +
                                   "' is [4, 3]; call resize_state(parameter) after Parameter::resize_rows";
      REQUIRE_THROWS_AS(optimizer.step(), embedhead::shape_error);
      REQUIRE_THROWS_WITH(optimizer.step(), Contains(name + "::step: " + expected));
      REQUIRE_THROWS_AS(optimizer.state(), embedhead::shape_error);
      REQUIRE_THROWS_WITH(optimizer.state(), Contains(name + "::state: " + expected));
      // A frozen parameter's state is checked too: step would skip it, but it is stale all the same.
      p->set_frozen(true);
      REQUIRE_THROWS_AS(optimizer.step(), embedhead::shape_error);
      p->set_frozen(false);
      set_gradient(*p, random_matrix<double>(new_rows, d, 174), {});
      CHECK(optimizer.step_count() == 1);
      CHECK(first_difference(p->value(), p_before).empty());
      CHECK(first_difference(q->value(), q_before).empty());
      CHECK(first_difference(p->grad().to_dense(), g_before).empty());
      // resize_state makes the buffers follow: they still hold the first step's values (the failed
      // steps wrote nothing), and the next step runs.
      REQUIRE(optimizer.resize_state(*p));
      const auto state = optimizer.state(), expected_state = reference.state();
      const Index kept = std::min(V, new_rows);
      for (const auto& [key, value] : expected_state.parameters[0].buffers)
        CHECK(first_difference(state.parameters[0].buffers.at(key).topRows(kept), value.topRows(kept)).empty());
      for (const auto& [key, value] : expected_state.parameters[1].buffers)
        CHECK(first_difference(state.parameters[1].buffers.at(key), value).empty());
      optimizer.step();
      CHECK(optimizer.step_count() == 2);
      CHECK(optimizer.state().parameters[0].rows == new_rows);
      CHECK(p->value().allFinite());
    }
  };
  using P = ParameterPtr<Scalar>;
  SECTION("AdamW") {
    run(
        [](const P& p, const P& q) {
          return embedhead::AdamW<Scalar>(embedhead::AdamOptions{}, {p, q});
        },
        "AdamW", "exp_avg");
  }
  SECTION("LazyAdam") {
    run(
        [](const P& p, const P& q) {
          return embedhead::LazyAdam<Scalar>(embedhead::LazyAdam<Scalar>::lazy_defaults(), {p, q});
        },
        "LazyAdam", "exp_avg");
  }
  SECTION("SGD with momentum") {
    embedhead::SGDOptions options;
    options.momentum = 0.9;
    run([&](const P& p, const P& q) { return embedhead::SGD<Scalar>(options, {p, q}); }, "SGD", "momentum_buffer");
  }
  SECTION("Adagrad") {
    run(
        [](const P& p, const P& q) {
          return embedhead::Adagrad<Scalar>(embedhead::AdagradOptions{}, {p, q});
        },
        "Adagrad", "sum");
  }
}

// ---- options checked in the Scalar the update runs in ----

TEMPLATE_TEST_CASE("optimizer options are checked in the Scalar the update runs in", "[optimizer][errors]", float,
                   double) {
  using Scalar = TestType;
  constexpr bool is_float = std::is_same_v<Scalar, float>;
  const double below_one = 1 - 1e-10;  // < 1 in double, 1 in float
  // A gradient with an untouched row: with eps = 0 its Adam update is 0 / 0.
  auto step_once = [](embedhead::Optimizer<Scalar>& optimizer, Parameter<Scalar>& p) {
    set_gradient(p, random_matrix<double>(p.rows(), p.cols(), 181), {0, 2});
    optimizer.step();
    return p.value().allFinite();
  };
  embedhead::AdamOptions adam;
  embedhead::AdagradOptions adagrad;
  embedhead::SGDOptions sgd;
  // Each case: an optimizer made with one option that is 0, inf or 1 in float only.
  struct Case {
    std::string message;  // what float says
    std::function<std::unique_ptr<embedhead::Optimizer<Scalar>>(const ParameterPtr<Scalar>&)> make;
  };
  auto with_adam = [&](auto edit) {
    return [=](const ParameterPtr<Scalar>& p) {
      embedhead::AdamOptions o = adam;
      edit(o);
      return std::unique_ptr<embedhead::Optimizer<Scalar>>(new embedhead::AdamW<Scalar>(o, {p}));
    };
  };
  auto with_adagrad = [&](auto edit) {
    return [=](const ParameterPtr<Scalar>& p) {
      embedhead::AdagradOptions o = adagrad;
      edit(o);
      return std::unique_ptr<embedhead::Optimizer<Scalar>>(new embedhead::Adagrad<Scalar>(o, {p}));
    };
  };
  auto with_sgd = [&](auto edit) {
    return [=](const ParameterPtr<Scalar>& p) {
      embedhead::SGDOptions o = sgd;
      edit(o);
      return std::unique_ptr<embedhead::Optimizer<Scalar>>(new embedhead::SGD<Scalar>(o, {p}));
    };
  };
  const std::vector<Case> cases = {
      {"AdamW: eps = 1e-50 outside (0, inf) in float: it rounds to 0",
       with_adam([](embedhead::AdamOptions& o) { o.eps = 1e-50; })},
      {"AdamW: eps = 1e+300 outside (0, inf) in float: it rounds to inf",
       with_adam([](embedhead::AdamOptions& o) { o.eps = 1e300; })},
      {"AdamW: beta1 = 0.9999999999 outside [0, 1) in float: it rounds to 1",
       with_adam([=](embedhead::AdamOptions& o) { o.beta1 = below_one; })},
      {"AdamW: beta2 = 0.9999999999 outside [0, 1) in float: it rounds to 1",
       with_adam([=](embedhead::AdamOptions& o) { o.beta2 = below_one; })},
      {"AdamW: lr = 1e+300 outside [0, inf) in float: it rounds to inf",
       with_adam([](embedhead::AdamOptions& o) { o.lr = 1e300; })},
      {"AdamW: lr = 1e-50 outside [0, inf) in float: it rounds to 0",
       with_adam([](embedhead::AdamOptions& o) { o.lr = 1e-50; })},
      {"AdamW: weight_decay = 1e+300 outside [0, inf) in float: it rounds to inf",
       with_adam([](embedhead::AdamOptions& o) { o.weight_decay = 1e300; })},
      {"Adagrad: eps = 1e-50 outside (0, inf) in float: it rounds to 0",
       with_adagrad([](embedhead::AdagradOptions& o) { o.eps = 1e-50; })},
      {"Adagrad: initial_accumulator_value = 1e+300 outside [0, inf) in float: it rounds to inf",
       with_adagrad([](embedhead::AdagradOptions& o) { o.initial_accumulator_value = 1e300; })},
      {"SGD: momentum = 0.9999999999 outside [0, 1) in float: it rounds to 1",
       with_sgd([=](embedhead::SGDOptions& o) { o.momentum = below_one; })},
      {"SGD: lr = 1e+300 outside [0, inf) in float: it rounds to inf",
       with_sgd([](embedhead::SGDOptions& o) { o.lr = 1e300; })},
  };
  for (const Case& c : cases) {
    INFO(c.message);
    auto p = make_parameter<Scalar>(3, 2, 180);
    if constexpr (is_float) {
      CHECK_THROWS_AS(c.make(p), embedhead::value_error);
      CHECK_THROWS_WITH(c.make(p), Contains(c.message));
    } else {
      // In double each is an ordinary value (the lr of 1e300 moves far, but finitely).
      auto optimizer = c.make(p);
      CHECK(step_once(*optimizer, *p));
    }
  }
  // set_lr and a group's weight decay: the same checks, nothing changed on throw.
  embedhead::SGD<Scalar> plain;
  auto p = make_parameter<Scalar>(3, 2, 182);
  embedhead::ParameterGroupOptions decay;
  decay.weight_decay = 1e300;
  if constexpr (is_float) {
    CHECK_THROWS_WITH(plain.set_lr(1e-50), Contains("SGD: lr = 1e-50 outside [0, inf) in float: it rounds to 0"));
    CHECK(plain.lr() == embedhead::SGDOptions{}.lr);
    CHECK_THROWS_WITH(plain.add_group({p}, decay),
                      Contains("SGD: weight_decay = 1e+300 outside [0, inf) in float: it rounds to inf"));
    CHECK(plain.groups().empty());
  } else {
    plain.set_lr(1e-50);
    CHECK(plain.lr() == 1e-50);
  }
}

TEMPLATE_TEST_CASE("step checks its constants in Scalar before anything changes", "[optimizer][errors]", float,
                   double) {
  using Scalar = TestType;
  const double largest = static_cast<double>(std::numeric_limits<Scalar>::max());
  const std::string type = std::is_same_v<Scalar, float> ? "float" : "double";
  // Each option is finite in Scalar, but a constant of the update computed from them is not.
  auto check = [&](embedhead::Optimizer<Scalar>& optimizer, const ParameterPtr<Scalar>& p, const std::string& what) {
    set_gradient(*p, random_matrix<double>(p->rows(), p->cols(), 191), {1});
    const RowMatrix<Scalar> before = p->value();
    CHECK_THROWS_AS(optimizer.step(), embedhead::value_error);
    CHECK_THROWS_WITH(optimizer.step(), Contains(std::string(optimizer.state().optimizer) + "::step: " + what) &&
                                            Contains("is not finite in " + type + " (group 0") &&
                                            Contains("nothing was updated"));
    CHECK(optimizer.step_count() == 0);
    CHECK(first_difference(p->value(), before).empty());
    CHECK(optimizer.state().parameters[0].buffers.empty());
  };
  SECTION("Adam's step size lr / (1 - beta1^t): 10 lr at t = 1") {
    auto p = make_parameter<Scalar>(3, 2, 190);
    embedhead::AdamOptions o;
    o.lr = largest / 2;
    embedhead::AdamW<Scalar> adam(o, {p});
    check(adam, p, "the step size lr / (1 - beta1^t) = ");
    // SparseAdam's lr sqrt(1 - beta2^t) / (1 - beta1^t): 31.6 lr at t = 1 with these betas.
    auto q = make_parameter<Scalar>(3, 2, 190);
    embedhead::AdamOptions lazy_options;
    lazy_options.beta1 = 0.99;
    lazy_options.beta2 = 0.9;
    embedhead::LazyAdam<Scalar> lazy(lazy_options, {q});
    lazy.set_lr(largest / 2);
    check(lazy, q, "the step size lr sqrt(1 - beta2^t) / (1 - beta1^t) = ");
  }
  SECTION("the decoupled decay 1 - lr weight_decay") {
    auto p = make_parameter<Scalar>(3, 2, 190);
    embedhead::AdamOptions o;
    o.lr = 4;
    o.weight_decay = largest / 2;
    embedhead::AdamW<Scalar> adam(o, {p});
    check(adam, p, "the decay 1 - lr weight_decay = ");
    auto q = make_parameter<Scalar>(3, 2, 190);
    embedhead::SGDOptions s;
    s.lr = 4;
    s.weight_decay = largest / 2;
    embedhead::SGD<Scalar> sgd(s, {q});
    check(sgd, q, "the decay 1 - lr weight_decay = ");
  }
  SECTION("a group's lr() x lr_multiplier") {
    auto p = make_parameter<Scalar>(3, 2, 190);
    embedhead::ParameterGroupOptions group;
    group.lr_multiplier = 4;
    embedhead::SGDOptions s;
    s.lr = largest / 2;
    embedhead::SGD<Scalar> sgd(s);
    sgd.add_group({p}, group);
    check(sgd, p, "lr = ");
    auto q = make_parameter<Scalar>(3, 2, 190);
    embedhead::AdagradOptions a;
    a.lr = largest / 2;
    embedhead::Adagrad<Scalar> adagrad(a);
    adagrad.add_group({q}, group);
    check(adagrad, q, "lr / (1 + (t - 1) lr_decay) = ");
  }
}

// ---- PyTorch's rules, re-implemented in double: defaults, SparseAdam, a parameter without a grad ----

namespace {

// max |a - b| <= tol max |b|: relative to the displacement itself when b is one (no floor at 1).
template <typename A, typename B>
bool close_relative(const A& a, const B& b, double tol) {
  const RowMatrix<double> da = a.template cast<double>(), db = b.template cast<double>();
  return (da - db).cwiseAbs().maxCoeff() <= tol * db.cwiseAbs().maxCoeff();
}

}  // namespace

TEST_CASE("Adam and AdamW carry PyTorch's names and defaults; LazyAdam default-constructs",
          "[optimizer][adam][defaults]") {
  auto p = make_parameter<double>(3, 2, 300), q = make_parameter<double>(3, 2, 300);
  embedhead::AdamOptions options;  // a literal port of torch.optim.Adam(params, lr=0.1)
  options.lr = 0.1;
  embedhead::Adam<double> adam(options, {p});
  embedhead::AdamW<double> adamw(options, {q});
  CHECK(adam.groups()[0].weight_decay == 0.0);
  CHECK(adamw.groups()[0].weight_decay == 0.01);
  CHECK(adam.state().optimizer == "Adam");
  CHECK(adamw.state().optimizer == "AdamW");
  CHECK(embedhead::Adam<float>().groups().empty());
  const embedhead::LazyAdam<float> lazy;  // no throw: no decay by default
  CHECK(lazy.options().weight_decay == 0.0);
  CHECK(lazy.lr() == 1e-3);
  // One step each against torch.optim's rules: Adam without decay, AdamW with 0.01 decoupled.
  const RowMatrix<double> G = random_matrix<double>(3, 2, 301);
  NaiveAdam torch_adam{0.1, 0.9, 0.999, 1e-8, 0.0, false, false, {}, {}};
  NaiveAdam torch_adamw{0.1, 0.9, 0.999, 1e-8, 0.01, true, false, {}, {}};
  RowMatrix<double> expected_adam = p->value(), expected_adamw = q->value();
  for (int t = 0; t < 3; ++t) {
    set_gradient(*p, G, {});
    set_gradient(*q, G, {});
    adam.step();
    adamw.step();
    torch_adam.step(expected_adam, G, {});
    torch_adamw.step(expected_adamw, G, {});
  }
  CHECK(close(p->value(), expected_adam, 1e-14));
  CHECK(close(q->value(), expected_adamw, 1e-14));
  CHECK_FALSE(close(p->value(), expected_adamw, 1e-6));  // the decay is visible: the test can fail
}

TEMPLATE_TEST_CASE("LazyAdam follows PyTorch's SparseAdam: sparse touches, gradients of 1e-9",
                   "[optimizer][lazy][naive]", float, double) {
  using Scalar = TestType;
  const Index V = 7, d = 3;
  // Rows touched per step: repeats, gaps, a row first seen late (6 at step 4), a dense step.
  const std::vector<std::vector<Index>> touches = {{0, 2}, {2}, {1, 5}, {}, {0, 6}, {2, 6}};
  for (const double scale : {1.0, 1e-9}) {
    CAPTURE(scale);
    auto p = std::make_shared<Parameter<Scalar>>(V, d, "E");  // zero: the displacement is the value
    embedhead::AdamOptions options;
    options.lr = 0.01;
    embedhead::LazyAdam<Scalar> lazy(options, {p});
    NaiveAdam sparse_adam{0.01, 0.9, 0.999, 1e-8, 0.0, false, true, {}, {}};
    RowMatrix<double> expected = RowMatrix<double>::Zero(V, d);
    for (std::size_t t = 0; t < touches.size(); ++t) {
      CAPTURE(t);
      const RowMatrix<double> G = scale * random_matrix<double>(V, d, 310 + t);
      set_gradient(*p, G, touches[t]);
      lazy.step();
      sparse_adam.step(expected, G, touches[t]);
      CHECK(close_relative(p->value(), expected, std::is_same_v<Scalar, float> ? 2e-5 : 1e-12));
    }
    CHECK(lazy.step_count(*p) == 6);
  }
  SECTION("the first update for a gradient of 1e-9 by hand: lr sqrt(1 - b2) g / (sqrt(1 - b2) |g| + eps)") {
    auto p = std::make_shared<Parameter<Scalar>>(1, 1, "E");
    embedhead::LazyAdam<Scalar> lazy(embedhead::AdamOptions{}, {p});
    set_gradient(*p, RowMatrix<double>::Constant(1, 1, 1e-9), {});
    lazy.step();
    const double s = std::sqrt(0.001), sparse = 1e-3 * s * 1e-9 / (s * 1e-9 + 1e-8);
    const double adam_form = 1e-3 * 1e-9 / (1e-9 + 1e-8);  // what the Adam form gave: 28.8 times more
    CHECK_THAT(static_cast<double>(-p->value()(0, 0)), WithinRel(sparse, std::is_same_v<Scalar, float> ? 1e-5 : 1e-12));
    CHECK(adam_form > 28.5 * sparse);
  }
}

TEMPLATE_TEST_CASE("a parameter without a gradient is skipped as PyTorch skips grad None, or stepped with zeros",
                   "[optimizer][no-grad]", float, double) {
  using Scalar = TestType;
  const Index V = 5, d = 3;
  // b has a gradient at steps 1 and 3 only (rows 1, 4 then 0, 1); a at every step.
  const std::vector<std::vector<Index>> b_rows = {{}, {1, 4}, {}, {0, 1}, {}};
  const std::vector<bool> b_has = {false, true, false, true, false};
  enum Kind { adam, adamw, lazy, adagrad, sgd };
  for (const Kind kind : {adam, adamw, lazy, adagrad, sgd}) {
    for (const bool skip : {true, false}) {
      CAPTURE(kind, skip);
      auto a = make_parameter<Scalar>(V, d, 320, "a"), b = make_parameter<Scalar>(V, d, 321, "b");
      std::unique_ptr<embedhead::Optimizer<Scalar>> optimizer;
      const ParameterList<Scalar> both{a, b};
      embedhead::AdamOptions adam_options;
      adam_options.lr = 0.05;
      adam_options.weight_decay = kind == lazy ? 0.0 : 0.1;
      embedhead::AdagradOptions adagrad_options;
      adagrad_options.lr_decay = 0.5;  // uses t: a skipped step shows
      embedhead::SGDOptions sgd_options;
      sgd_options.momentum = 0.9;
      sgd_options.weight_decay = 0.1;
      if (kind == adam) optimizer = std::make_unique<embedhead::Adam<Scalar>>(adam_options, both);
      if (kind == adamw) optimizer = std::make_unique<embedhead::AdamW<Scalar>>(adam_options, both);
      if (kind == lazy) optimizer = std::make_unique<embedhead::LazyAdam<Scalar>>(adam_options, both);
      if (kind == adagrad) optimizer = std::make_unique<embedhead::Adagrad<Scalar>>(adagrad_options, both);
      if (kind == sgd) optimizer = std::make_unique<embedhead::SGD<Scalar>>(sgd_options, both);
      CHECK(optimizer->skip_parameters_without_grad());  // the default
      optimizer->set_skip_parameters_without_grad(skip);
      // b's reference in double: PyTorch steps it only when it has a grad (skip), or every step
      // with a zero grad (not skip).
      NaiveAdam ref_adam{0.05, 0.9, 0.999, 1e-8, kind == lazy ? 0.0 : 0.1, kind == adamw, kind == lazy, {}, {}};
      NaiveAdagrad ref_adagrad{0.01, 0.5, 0.0, 1e-10, {}};
      NaiveSGD ref_sgd{0.01, 0.9, 0.1, false, {}};
      RowMatrix<double> expected = b->value().template cast<double>();
      std::int64_t b_steps = 0;
      for (std::size_t t = 0; t < b_rows.size(); ++t) {
        CAPTURE(t);
        const RowMatrix<double> G = random_matrix<double>(V, d, 330 + t);
        set_gradient(*a, G, {});
        b->zero_grad();
        if (b_has[t]) set_gradient(*b, G, b_rows[t]);
        const RowMatrix<Scalar> before = b->value();
        const auto state_before = optimizer->state();
        optimizer->step();
        if (!b_has[t] && skip) {  // nothing about b changed: value, buffers, its t
          CHECK(same_values(b->value(), before));
          const auto state_after = optimizer->state();
          CHECK(state_after.parameters[1].step == state_before.parameters[1].step);
          for (const auto& [key, buffer] : state_before.parameters[1].buffers)
            CHECK(same_values(state_after.parameters[1].buffers.at(key), buffer));
          continue;
        }
        ++b_steps;
        const RowMatrix<double> g = b_has[t] ? masked(G, b_rows[t]) : RowMatrix<double>::Zero(V, d);
        if (kind == adam || kind == adamw) ref_adam.step(expected, g, {});
        if (kind == lazy) ref_adam.step(expected, g, b_has[t] ? b_rows[t] : std::vector<Index>{V + 1});
        if (kind == adagrad) ref_adagrad.step(expected, g);
        if (kind == sgd) ref_sgd.step(expected, g);
        CHECK(close(b->value(), expected, 20 * tolerance<Scalar>()));
      }
      CHECK(optimizer->step_count() == 5);
      CHECK(optimizer->step_count(*a) == 5);
      CHECK(optimizer->step_count(*b) == b_steps);
      CHECK(b_steps == (skip ? 2 : 5));
    }
  }
}

TEMPLATE_TEST_CASE("each parameter's step count is saved and restored", "[optimizer][state][no-grad]", float, double) {
  using Scalar = TestType;
  auto a = make_parameter<Scalar>(4, 2, 340, "a"), b = make_parameter<Scalar>(4, 2, 341, "b");
  embedhead::AdamW<Scalar> adam(embedhead::AdamOptions{}, {a, b});
  const RowMatrix<double> G = random_matrix<double>(4, 2, 342);
  for (int t = 0; t < 3; ++t) {
    set_gradient(*a, G, {});
    b->zero_grad();
    if (t == 1) set_gradient(*b, G, {2});
    adam.step();
  }
  auto saved = adam.state();
  CHECK(saved.step == 3);
  REQUIRE(saved.parameters[1].step.has_value());
  CHECK(*saved.parameters[1].step == 1);
  auto a2 = make_parameter<Scalar>(4, 2, 340, "a"), b2 = make_parameter<Scalar>(4, 2, 341, "b");
  a2->value() = a->value();
  b2->value() = b->value();
  embedhead::AdamW<Scalar> resumed(embedhead::AdamOptions{}, {a2, b2});
  resumed.load_state(saved);
  CHECK(resumed.step_count(*b2) == 1);
  set_gradient(*b, G, {0, 2});
  set_gradient(*b2, G, {0, 2});
  set_gradient(*a, G, {});
  set_gradient(*a2, G, {});
  adam.step();
  resumed.step();
  CHECK(same_values(b2->value(), b->value()));
  // An entry without a step (a state saved before per-parameter counts) takes the state's step.
  saved.parameters[1].step.reset();
  resumed.load_state(saved);
  CHECK(resumed.step_count(*b2) == 3);
  // An entry's step beyond the state's is refused, nothing changed.
  saved.parameters[1].step = 4;
  const auto before = resumed.state();
  CHECK_THROWS_WITH(resumed.load_state(saved),
                    Contains("AdamW::load_state: parameter 1 ('b') has step 4 outside [0, 3]"));
  CHECK(resumed.step_count(*b2) == 3);
  CHECK(same_values(resumed.state().parameters[1].buffers.at("exp_avg"), before.parameters[1].buffers.at("exp_avg")));
  auto stranger = make_parameter<Scalar>(4, 2, 343, "c");
  CHECK_THROWS_WITH(resumed.step_count(*stranger),
                    Contains("AdamW::step_count: parameter 'c' [4, 2] is not registered"));
}

TEMPLATE_TEST_CASE("Adam, AdamW, LazyAdam: bad lr, betas, eps throw naming the value; nothing changes",
                   "[optimizer][adam][errors]", float, double) {
  using Scalar = TestType;
  auto p = make_parameter<Scalar>(4, 2, 350, "E");
  const RowMatrix<double> G = random_matrix<double>(4, 2, 351);
  set_gradient(*p, G, {1, 3});
  const RowMatrix<Scalar> value = p->value(), grad = p->grad().to_dense();
  struct Bad {
    double lr, beta1, beta2, eps;
    const char* message;
  };
  const Bad bad[] = {{-0.1, 0.9, 0.999, 1e-8, "lr = -0.1 outside [0, inf)"},
                     {1e-3, -0.1, 0.999, 1e-8, "beta1 = -0.1 outside [0, 1)"},
                     {1e-3, 1.0, 0.999, 1e-8, "beta1 = 1 outside [0, 1)"},
                     {1e-3, 0.9, 1.0, 1e-8, "beta2 = 1 outside [0, 1)"},
                     {1e-3, 0.9, 1.5, 1e-8, "beta2 = 1.5 outside [0, 1)"},
                     {1e-3, 0.9, 0.999, 0.0, "eps = 0 outside (0, inf)"},
                     {1e-3, 0.9, 0.999, -1e-8, "eps = -1e-08 outside (0, inf)"}};
  for (const Bad& b : bad) {
    CAPTURE(b.message);
    embedhead::AdamOptions o;
    o.lr = b.lr;
    o.beta1 = b.beta1;
    o.beta2 = b.beta2;
    o.eps = b.eps;
    CHECK_THROWS_WITH(embedhead::Adam<Scalar>(o, {p}), Contains(std::string("Adam: ") + b.message));
    CHECK_THROWS_WITH(embedhead::AdamW<Scalar>(o, {p}), Contains(std::string("AdamW: ") + b.message));
    CHECK_THROWS_WITH(embedhead::LazyAdam<Scalar>(o, {p}), Contains(std::string("LazyAdam: ") + b.message));
  }
  CHECK(same_values(p->value(), value));
  CHECK(same_values(p->grad().to_dense(), grad));
  // An existing optimizer: a bad lr leaves lr, the state, the weights and the gradient as they were.
  embedhead::LazyAdam<Scalar> lazy(embedhead::AdamOptions{}, {p});
  lazy.step();
  const RowMatrix<Scalar> stepped = p->value();
  const auto state = lazy.state();
  CHECK_THROWS_WITH(lazy.set_lr(-1.0), Contains("LazyAdam: lr = -1 outside [0, inf)"));
  CHECK(lazy.lr() == 1e-3);
  CHECK(same_values(p->value(), stepped));
  CHECK(same_values(p->grad().to_dense(), grad));
  CHECK(lazy.step_count(*p) == 1);
  CHECK(same_values(lazy.state().parameters[0].buffers.at("exp_avg_sq"), state.parameters[0].buffers.at("exp_avg_sq")));
}
