// Tests for include/embedhead/optim/lazy_adamw.hpp.
//
// Two references in double, written below from their published descriptions, never the library's
// code: dense AdamW as PyTorch documents torch.optim.AdamW (theta *= 1 - gamma lambda; m, v;
// m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^t); theta -= gamma m_hat / (sqrt(v_hat) + eps)), every
// row every step, zeros where a row is untouched; and the documented lazy semantics, each row with
// the list of every step's decay, its moments decayed b^k and its value multiplied by the decays
// one at a time on its next touch. With beta1 = 0 LazyAdamW must equal the dense one (after
// catch_up) to 1e-12 in double; with beta1 > 0 the lazy one.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <embedhead/optim/adamw.hpp>
#include <embedhead/optim/lazy_adamw.hpp>
#include <embedhead/optim/schedule.hpp>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "../reference/test_support.hpp"
#include "optim_support.hpp"

namespace {

using Catch::Matchers::Contains;
using embedhead::Index;
using embedhead::LazyAdamW;
using embedhead::Parameter;
using embedhead::RowMatrix;
using test_support::random_matrix;
using test_support::same_values;

template <typename Scalar>
std::shared_ptr<Parameter<Scalar>> make_parameter(Index rows, Index cols, std::uint64_t seed, const char* name = "E") {
  return optim_support::make_parameter<Scalar>(rows, cols, seed, name);
}
using optim_support::set_gradient;

bool touched(const std::vector<Index>& rows, Index r) { return std::find(rows.begin(), rows.end(), r) != rows.end(); }

// torch.optim.AdamW's documented algorithm in double, over all rows (g = 0 where untouched).
struct TorchAdamW {
  double b1, b2, eps, wd;
  RowMatrix<double> m, v;
  int t = 0;
  void step(RowMatrix<double>& p, const RowMatrix<double>& G, const std::vector<Index>& rows, double lr) {
    if (m.size() == 0) m = v = RowMatrix<double>::Zero(p.rows(), p.cols());
    ++t;
    for (Index r = 0; r < p.rows(); ++r)
      for (Index j = 0; j < p.cols(); ++j) {
        const double g = touched(rows, r) ? G(r, j) : 0.0;
        p(r, j) = p(r, j) - lr * wd * p(r, j);
        m(r, j) = b1 * m(r, j) + (1 - b1) * g;
        v(r, j) = b2 * v(r, j) + (1 - b2) * g * g;
        const double m_hat = m(r, j) / (1 - std::pow(b1, t)), v_hat = v(r, j) / (1 - std::pow(b2, t));
        p(r, j) -= lr * m_hat / (std::sqrt(v_hat) + eps);
      }
  }
  void grow(Index rows) {  // resize_state of dense AdamW: new rows with zero moments
    const Index old = m.rows(), kept = std::min(old, rows);
    RowMatrix<double> m2 = RowMatrix<double>::Zero(rows, m.cols()), v2 = m2;
    m2.topRows(kept) = m.topRows(kept);
    v2.topRows(kept) = v.topRows(kept);
    m = m2;
    v = v2;
  }
};

// The documented lazy semantics in double: a touched row first takes every decay since its last
// update, one multiplication per step, and b1^k, b2^k on its moments; catch_up does the same for
// every row. decays[s - 1] is step s's 1 - lr_s wd.
struct LazyReference {
  double b1, b2, eps, wd;
  RowMatrix<double> m, v;
  std::vector<int> last;
  std::vector<double> decays;
  int t = 0;
  void bring(RowMatrix<double>& p, Index r, int through) {
    const auto i = static_cast<std::size_t>(r);
    for (int s = last[i] + 1; s <= t; ++s) p.row(r) *= decays[static_cast<std::size_t>(s - 1)];
    for (int s = last[i] + 1; s <= through; ++s) {
      m.row(r) *= b1;
      v.row(r) *= b2;
    }
    last[i] = t;
  }
  void step(RowMatrix<double>& p, const RowMatrix<double>& G, const std::vector<Index>& rows, double lr) {
    if (m.size() == 0) {
      m = v = RowMatrix<double>::Zero(p.rows(), p.cols());
      last.assign(static_cast<std::size_t>(p.rows()), 0);
    }
    ++t;
    decays.push_back(1 - lr * wd);
    for (Index r : rows) {
      bring(p, r, t - 1);
      for (Index j = 0; j < p.cols(); ++j) {
        m(r, j) = b1 * m(r, j) + (1 - b1) * G(r, j);
        v(r, j) = b2 * v(r, j) + (1 - b2) * G(r, j) * G(r, j);
        const double m_hat = m(r, j) / (1 - std::pow(b1, t)), v_hat = v(r, j) / (1 - std::pow(b2, t));
        p(r, j) -= lr * m_hat / (std::sqrt(v_hat) + eps);
      }
    }
  }
  void catch_up(RowMatrix<double>& p) {
    for (Index r = 0; r < p.rows(); ++r) bring(p, r, t);
  }
};

// max over rows of max_j |a - b| / max_j |b|: the error relative to each row's size (a row decayed
// to below 1e-290 relative to 1e-290: the reference's p - lr wd p and the library's p (1 - lr wd)
// round differently among subnormals, 2^-1074 apart).
template <typename A>
double row_relative_error(const A& a, const RowMatrix<double>& b) {
  const RowMatrix<double> da = a.template cast<double>();
  double worst = 0;
  for (Index r = 0; r < b.rows(); ++r) {
    const double size = b.row(r).cwiseAbs().maxCoeff();
    const double error = (da.row(r) - b.row(r)).cwiseAbs().maxCoeff();
    worst = std::max(worst, error / std::max(size, 1e-290));
  }
  return worst;
}

// A touch pattern over V rows and `steps` steps: row 0 every step; row 1 first at step 3/4 of the
// way; row 2 never; row 3 at the last step only; the others each step with probability 0.3.
std::vector<std::vector<Index>> touch_pattern(Index V, int steps, std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::bernoulli_distribution coin(0.3);
  std::vector<std::vector<Index>> pattern;
  for (int s = 0; s < steps; ++s) {
    std::vector<Index> rows = {0};
    if (s >= 3 * steps / 4) rows.push_back(1);
    if (s == steps - 1) rows.push_back(3);
    for (Index r = 4; r < V; ++r)
      if (coin(gen)) rows.push_back(r);
    pattern.push_back(rows);
  }
  return pattern;
}

template <typename Scalar>
RowMatrix<Scalar> buffer_of(const embedhead::Optimizer<Scalar>& o, const char* key, std::size_t i = 0) {
  return o.state().parameters[i].buffers.at(key);
}

}  // namespace

TEST_CASE("LazyAdamW with beta1 = 0 is dense AdamW after catch-up, to 1e-12, for any touch pattern",
          "[lazy_adamw][naive]") {
  const Index V = 12, d = 5;
  const int steps = 40;
  const auto pattern = touch_pattern(V, steps, 7);
  for (const bool catch_up_every_step : {false, true}) {
    CAPTURE(catch_up_every_step);
    auto p = make_parameter<double>(V, d, 500);
    embedhead::AdamOptions options;
    options.lr = 0.02;
    options.beta1 = 0;
    options.weight_decay = 0.5;  // 1 - lr wd = 0.99: 40 steps shrink an untouched row by a third
    LazyAdamW<double> lazy(options, {p});
    TorchAdamW dense{0, 0.999, 1e-8, 0.5, {}, {}};
    RowMatrix<double> expected = p->value();
    for (int s = 0; s < steps; ++s) {
      CAPTURE(s);
      const RowMatrix<double> G = random_matrix<double>(V, d, 600 + static_cast<std::uint64_t>(s));
      const auto& rows = pattern[static_cast<std::size_t>(s)];
      const RowMatrix<double> before = p->value();
      set_gradient(*p, G, rows);
      lazy.step();
      dense.step(expected, G, rows, 0.02);
      // Before catch-up: touched rows are current, untouched ones exactly as they were.
      for (Index r = 0; r < V; ++r) {
        if (touched(rows, r))
          CHECK(row_relative_error(p->value().row(r), RowMatrix<double>(expected.row(r))) <= 1e-12);
        else
          CHECK(same_values(p->value().row(r), before.row(r)));
      }
      if (catch_up_every_step) {
        lazy.catch_up();
        CHECK(lazy.lagging_rows(*p) == 0);
        CHECK(row_relative_error(p->value(), expected) <= 1e-12);
      }
    }
    CHECK(lazy.lagging_rows(*p) == (catch_up_every_step ? 0 : V - static_cast<Index>(pattern.back().size())));
    lazy.catch_up();
    CHECK(lazy.lagging_rows(*p) == 0);
    CHECK(row_relative_error(p->value(), expected) <= 1e-12);
    // The moments too: m is 0 on a row not touched at the last step, v decayed b2^k.
    const RowMatrix<double> v = buffer_of(lazy, "exp_avg_sq");
    CHECK(row_relative_error(v, dense.v) <= 1e-12);
    CHECK(row_relative_error(buffer_of(lazy, "exp_avg"), dense.m) <= 1e-12);
    // Row 2, never touched, only decayed: 0.99^40 of its start (the test can fail).
    CHECK(std::abs(p->value()(2, 0) - std::pow(0.99, 40) * random_matrix<double>(V, d, 500)(2, 0)) <= 1e-14);
    CHECK(lazy.step_count(*p) == steps);
  }
}

TEST_CASE("LazyAdamW with beta1 = 0 is dense AdamW under a learning-rate schedule and two groups",
          "[lazy_adamw][naive][schedule]") {
  const Index V = 10, d = 4;
  const int steps = 60;
  const auto pattern = touch_pattern(V, steps, 8);
  auto E = make_parameter<double>(V, d, 510, "E"), W = make_parameter<double>(V, d, 511, "W");
  embedhead::AdamOptions options;
  options.lr = 0.05;
  options.beta1 = 0;
  LazyAdamW<double> lazy(options);
  embedhead::ParameterGroupOptions e_group, w_group;
  e_group.weight_decay = 0.8;
  w_group.lr_multiplier = 0.5;
  w_group.weight_decay = 0.1;
  lazy.add_group({E}, e_group);
  lazy.add_group({W}, w_group);
  const auto schedule = embedhead::LrSchedule::warmup_cosine(10, 50, 0.1);
  TorchAdamW dense_e{0, 0.999, 1e-8, 0.8, {}, {}}, dense_w{0, 0.999, 1e-8, 0.1, {}, {}};
  RowMatrix<double> expected_e = E->value(), expected_w = W->value();
  for (int s = 0; s < steps; ++s) {
    const double lr = 0.05 * schedule(lazy.step_count());
    lazy.set_lr(lr);
    const RowMatrix<double> G = random_matrix<double>(V, d, 700 + static_cast<std::uint64_t>(s));
    const auto& rows = pattern[static_cast<std::size_t>(s)];
    set_gradient(*E, G, rows);
    set_gradient(*W, G, rows);
    lazy.step();
    dense_e.step(expected_e, G, rows, lr);
    dense_w.step(expected_w, G, rows, lr * 0.5);
  }
  lazy.catch_up();
  CHECK(row_relative_error(E->value(), expected_e) <= 1e-12);
  CHECK(row_relative_error(W->value(), expected_w) <= 1e-12);
  // The decay actually taken, not the last lr's: the last step's lr, held over the skipped steps,
  // would have given row 2 (never touched) another value.
  const double last_lr = 0.05 * schedule(steps - 1);
  CHECK(std::abs(E->value()(2, 1) - std::pow(1 - last_lr * 0.8, steps) * random_matrix<double>(V, d, 510)(2, 1)) >
        1e-6);
}

TEST_CASE("LazyAdamW keeps the running decay exact over a long run (no underflow)", "[lazy_adamw][naive]") {
  // 1 - lr wd = 0.5 every step: the running product is 2^-3000 after 3000 steps, far below the
  // smallest double; a row touched at steps 1, 1500 and 3000 still decays by exactly 2^-1499.
  auto p = make_parameter<double>(3, 2, 520);
  embedhead::AdamOptions options;
  options.lr = 0.5;
  options.beta1 = 0;
  options.weight_decay = 1.0;
  LazyAdamW<double> lazy(options, {p});
  TorchAdamW dense{0, 0.999, 1e-8, 1.0, {}, {}};
  RowMatrix<double> expected = p->value();
  for (int s = 1; s <= 3000; ++s) {
    const std::vector<Index> rows = (s == 1 || s == 1500 || s == 3000) ? std::vector<Index>{1} : std::vector<Index>{0};
    const RowMatrix<double> G = random_matrix<double>(3, 2, 800 + static_cast<std::uint64_t>(s % 7));
    set_gradient(*p, G, rows);
    lazy.step();
    if (s == 1499) {
      // Just before row 1's second touch: its value lags at step 1.
      CHECK(lazy.lagging_rows(*p) == 2);
    }
    dense.step(expected, G, rows, 0.5);
  }
  lazy.catch_up();
  CHECK(row_relative_error(p->value(), expected) <= 1e-12);
  const auto state = lazy.state();
  CHECK(state.parameters[0].scalars.at("decay_exponent") == -2999.0);  // 2^-3000 = 0.5 x 2^-2999
  CHECK(state.parameters[0].scalars.at("decay_mantissa") == 0.5);
}

TEST_CASE("LazyAdamW with beta1 > 0: the documented lazy semantics; dense AdamW on rows touched every step",
          "[lazy_adamw][naive]") {
  const Index V = 12, d = 5;
  const int steps = 30;
  const auto pattern = touch_pattern(V, steps, 9);
  auto p = make_parameter<double>(V, d, 530);
  embedhead::AdamOptions options;
  options.lr = 0.02;
  options.weight_decay = 0.3;  // beta1 0.9, beta2 0.999: PyTorch's defaults
  LazyAdamW<double> lazy(options, {p});
  LazyReference reference{0.9, 0.999, 1e-8, 0.3, {}, {}, {}, {}};
  TorchAdamW dense{0.9, 0.999, 1e-8, 0.3, {}, {}};
  RowMatrix<double> expected = p->value(), dense_value = p->value();
  for (int s = 0; s < steps; ++s) {
    CAPTURE(s);
    const double lr = 0.02 * (1 + 0.5 * std::sin(s));  // any schedule
    lazy.set_lr(lr);
    const RowMatrix<double> G = random_matrix<double>(V, d, 900 + static_cast<std::uint64_t>(s));
    const auto& rows = pattern[static_cast<std::size_t>(s)];
    set_gradient(*p, G, rows);
    lazy.step();
    reference.step(expected, G, rows, lr);
    dense.step(dense_value, G, rows, lr);
    for (Index r : rows) CHECK(row_relative_error(p->value().row(r), RowMatrix<double>(expected.row(r))) <= 1e-12);
  }
  lazy.catch_up();
  reference.catch_up(expected);
  CHECK(row_relative_error(p->value(), expected) <= 1e-12);
  CHECK(row_relative_error(buffer_of(lazy, "exp_avg"), reference.m) <= 1e-12);
  CHECK(row_relative_error(buffer_of(lazy, "exp_avg_sq"), reference.v) <= 1e-12);
  // Against dense AdamW: the moments are dense's (the decays are the same), row 0 (touched every
  // step) is dense's; a skipped row is not (dense moved it by its momentum while skipped).
  CHECK(row_relative_error(buffer_of(lazy, "exp_avg"), dense.m) <= 1e-12);
  CHECK(row_relative_error(buffer_of(lazy, "exp_avg_sq"), dense.v) <= 1e-12);
  CHECK(row_relative_error(p->value().row(0), RowMatrix<double>(dense_value.row(0))) <= 1e-12);
  CHECK(row_relative_error(p->value().row(5), RowMatrix<double>(dense_value.row(5))) > 1e-4);
  // Row 2 was never touched: its momentum is 0, so it only decays under both.
  CHECK(row_relative_error(p->value().row(2), RowMatrix<double>(dense_value.row(2))) <= 1e-12);
}

TEMPLATE_TEST_CASE("LazyAdamW on rows touched at every step is the library's dense AdamW bit for bit",
                   "[lazy_adamw][dense]", float, double) {
  // A dense gradient touches every row every step: each step's decay f_t is then applied as dense
  // AdamW applies it (one multiplication by f_t in Scalar), not as a quotient of running products
  // whose per-row copy is rounded to Scalar (which drifted by an ulp a step in float).
  using Scalar = TestType;
  const Index V = 8, d = 4;
  auto lazy_p = make_parameter<Scalar>(V, d, 540), dense_p = make_parameter<Scalar>(V, d, 540);
  embedhead::AdamOptions options;
  options.lr = 3e-3;
  options.weight_decay = 0.1;
  LazyAdamW<Scalar> lazy(options, {lazy_p});
  embedhead::AdamW<Scalar> dense(options, {dense_p});
  for (int s = 0; s < 50; ++s) {
    CAPTURE(s);
    const RowMatrix<double> G = random_matrix<double>(V, d, 950 + static_cast<std::uint64_t>(s));
    set_gradient(*lazy_p, G, {});
    set_gradient(*dense_p, G, {});
    lazy.step();
    dense.step();
    REQUIRE(same_values(lazy_p->value(), dense_p->value()));
  }
}

TEST_CASE("LazyAdamW in a training loop: catch_up(p, ids) before the forward pass gives dense AdamW's gradients",
          "[lazy_adamw][naive]") {
  // The loss of a batch is 0.5 |E[id] - target_id|^2 over the batch's rows: the gradient is read
  // from the values, as an embedding's is. Without catching the batch's rows up first, the forward
  // pass reads a lagging row (missing the decays since its last touch) and the trajectory departs.
  const Index V = 10, d = 4;
  const int steps = 30;
  const auto pattern = touch_pattern(V, steps, 12);
  const RowMatrix<double> target = random_matrix<double>(V, d, 1400);
  embedhead::AdamOptions options;
  options.lr = 0.02;
  options.beta1 = 0;
  options.weight_decay = 0.5;
  for (const bool catch_up_batch : {true, false}) {
    CAPTURE(catch_up_batch);
    auto p = make_parameter<double>(V, d, 1401);
    LazyAdamW<double> lazy(options, {p});
    TorchAdamW dense{0, 0.999, 1e-8, 0.5, {}, {}};
    RowMatrix<double> expected = p->value();
    for (int s = 0; s < steps; ++s) {
      const auto& rows = pattern[static_cast<std::size_t>(s)];
      if (catch_up_batch) lazy.catch_up(*p, rows.data(), static_cast<Index>(rows.size()));
      RowMatrix<double> G = RowMatrix<double>::Zero(V, d), G_dense = G;
      for (Index r : rows) {
        G.row(r) = p->value().row(r) - target.row(r);  // what the forward pass read
        G_dense.row(r) = expected.row(r) - target.row(r);
      }
      set_gradient(*p, G, rows);
      lazy.step();
      dense.step(expected, G_dense, rows, 0.02);
    }
    lazy.catch_up();
    if (catch_up_batch)
      CHECK(row_relative_error(p->value(), expected) <= 1e-12);
    else
      CHECK(row_relative_error(p->value(), expected) > 1e-6);
  }
  SECTION("ids of any integer type, any order, repeated; a bad id is refused before anything changes") {
    auto p = make_parameter<float>(V, d, 1402);
    LazyAdamW<float> lazy(options, {p});
    set_gradient(*p, random_matrix<double>(V, d, 1403), {0});
    lazy.step();
    lazy.step();  // row 0 touched at both steps, the others lag since step 0
    CHECK(lazy.lagging_rows(*p) == V - 1);
    const std::int32_t ids[] = {7, 2, 7};
    lazy.catch_up(*p, ids, 3);
    CHECK(lazy.lagging_rows(*p) == V - 3);
    const std::uint16_t unsigned_ids[] = {3};
    lazy.catch_up(*p, unsigned_ids, 1);
    CHECK(lazy.lagging_rows(*p) == V - 4);
    const RowMatrix<float> value = p->value();
    const auto state = lazy.state();
    const std::int64_t bad[] = {1, 10};
    CHECK_THROWS_AS(lazy.catch_up(*p, bad, 2), embedhead::value_error);
    CHECK_THROWS_WITH(lazy.catch_up(*p, bad, 2),
                      Contains(
                          "LazyAdamW::catch_up: ids[1] = 10 outside [0, 10) (the rows of 'E'); nothing was updated"));
    const int negative[] = {-1};
    CHECK_THROWS_WITH(lazy.catch_up(*p, negative, 1), Contains("ids[0] = -1 outside [0, 10)"));
    CHECK_THROWS_WITH(lazy.catch_up(*p, ids, -1), Contains("LazyAdamW::catch_up: count = -1 outside [0, inf)"));
    CHECK(same_values(p->value(), value));
    CHECK(same_values(buffer_of(lazy, "last_step"), state.parameters[0].buffers.at("last_step")));
  }
}

TEMPLATE_TEST_CASE("LazyAdamW in float and double against the double references", "[lazy_adamw][naive]", float,
                   double) {
  using Scalar = TestType;
  const Index V = 9, d = 6;
  const int steps = 25;
  const auto pattern = touch_pattern(V, steps, 10);
  for (const double beta1 : {0.0, 0.9}) {
    CAPTURE(beta1);
    auto p = make_parameter<Scalar>(V, d, 540);
    embedhead::AdamOptions options;
    options.lr = 0.01;
    options.beta1 = beta1;
    options.weight_decay = 0.2;
    LazyAdamW<Scalar> lazy(options, {p});
    LazyReference reference{beta1, 0.999, 1e-8, 0.2, {}, {}, {}, {}};
    TorchAdamW dense{beta1, 0.999, 1e-8, 0.2, {}, {}};
    RowMatrix<double> expected = p->value().template cast<double>(), dense_value = expected;
    for (int s = 0; s < steps; ++s) {
      const RowMatrix<double> G = random_matrix<double>(V, d, 1000 + static_cast<std::uint64_t>(s));
      const auto& rows = pattern[static_cast<std::size_t>(s)];
      set_gradient(*p, G, rows);
      lazy.step();
      reference.step(expected, G, rows, 0.01);
      dense.step(dense_value, G, rows, 0.01);
    }
    lazy.catch_up();
    reference.catch_up(expected);
    const double tol = std::is_same_v<Scalar, float> ? 2e-6 : 1e-12;
    CHECK(row_relative_error(p->value(), expected) <= tol);
    if (beta1 == 0) CHECK(row_relative_error(p->value(), dense_value) <= tol);
  }
}

TEMPLATE_TEST_CASE("LazyAdamW state: save and restore mid-trajectory continues identically", "[lazy_adamw][state]",
                   float, double) {
  using Scalar = TestType;
  const Index V = 8, d = 3;
  const int steps = 20;
  const auto pattern = touch_pattern(V, steps, 11);
  auto gradient = [&](int s) { return random_matrix<double>(V, d, 1100 + static_cast<std::uint64_t>(s)); };
  auto p = make_parameter<Scalar>(V, d, 550);
  embedhead::AdamOptions options;
  options.weight_decay = 0.1;
  LazyAdamW<Scalar> lazy(options, {p});
  for (int s = 0; s < 10; ++s) {
    lazy.set_lr(1e-3 * (s + 1));
    set_gradient(*p, gradient(s), pattern[static_cast<std::size_t>(s)]);
    lazy.step();
  }
  REQUIRE(lazy.lagging_rows(*p) > 0);  // saved with lagging rows
  const auto saved = lazy.state();
  const RowMatrix<Scalar> value_at_save = p->value();
  for (const char* key : {"exp_avg", "exp_avg_sq", "last_step", "decay_mantissa", "decay_exponent"})
    CHECK(saved.parameters[0].buffers.count(key) == 1);
  CHECK(saved.parameters[0].buffers.at("last_step").cols() == 1);
  CHECK(saved.parameters[0].scalars.size() == 2);
  for (int s = 10; s < steps; ++s) {
    lazy.set_lr(1e-3 * (s + 1));
    set_gradient(*p, gradient(s), pattern[static_cast<std::size_t>(s)]);
    lazy.step();
  }
  lazy.catch_up();
  auto q = make_parameter<Scalar>(V, d, 999);
  q->value() = value_at_save;
  LazyAdamW<Scalar> resumed(options, {q});
  resumed.load_state(saved);
  CHECK(resumed.lagging_rows(*q) == V - static_cast<Index>(pattern[9].size()));
  for (int s = 10; s < steps; ++s) {
    resumed.set_lr(1e-3 * (s + 1));
    set_gradient(*q, gradient(s), pattern[static_cast<std::size_t>(s)]);
    resumed.step();
  }
  resumed.catch_up();
  CHECK(same_values(q->value(), p->value()));
  const auto a = lazy.state(), b = resumed.state();
  for (const auto& [key, buffer] : a.parameters[0].buffers) CHECK(same_values(b.parameters[0].buffers.at(key), buffer));
  CHECK(a.parameters[0].scalars == b.parameters[0].scalars);
}

TEMPLATE_TEST_CASE("LazyAdamW resize_state: new rows are up to date at the current step", "[lazy_adamw][resize]", float,
                   double) {
  using Scalar = TestType;
  const Index V = 6, d = 3, grown = 9;
  auto p = make_parameter<Scalar>(V, d, 560);
  embedhead::AdamOptions options;
  options.lr = 0.05;
  options.beta1 = 0;
  options.weight_decay = 0.4;
  LazyAdamW<Scalar> lazy(options, {p});
  TorchAdamW dense{0, 0.999, 1e-8, 0.4, {}, {}};
  RowMatrix<double> expected = p->value().template cast<double>();
  const std::vector<std::vector<Index>> before = {{0, 1}, {1}, {4}, {0}};
  for (std::size_t s = 0; s < before.size(); ++s) {
    const RowMatrix<double> G = random_matrix<double>(V, d, 1200 + s);
    set_gradient(*p, G, before[s]);
    lazy.step();
    dense.step(expected, G, before[s], 0.05);
  }
  const auto state_before = lazy.state();
  p->resize_rows(grown);
  CHECK(lazy.resize_state(*p));
  const RowMatrix<Scalar> new_rows = random_matrix<Scalar>(grown - V, d, 1210);
  p->value().bottomRows(grown - V) = new_rows;
  expected.conservativeResize(grown, d);
  expected.bottomRows(grown - V) = new_rows.template cast<double>();
  dense.grow(grown);
  const auto state = lazy.state();
  for (const auto& [key, buffer] : state_before.parameters[0].buffers) {
    CAPTURE(key);
    REQUIRE(state.parameters[0].buffers.at(key).rows() == grown);
    CHECK(same_values(state.parameters[0].buffers.at(key).topRows(V), buffer));  // kept rows bit for bit
  }
  const RowMatrix<Scalar> last = state.parameters[0].buffers.at("last_step");
  CHECK(last.bottomRows(grown - V) == RowMatrix<Scalar>::Constant(grown - V, 1, Scalar(4)));
  CHECK(lazy.lagging_rows(*p) == V - 1);  // the old rows not touched at step 4; not the new ones
  // Steps after: a new row touched, an old lagging row touched, a new row left alone.
  const std::vector<std::vector<Index>> after = {{2, 6}, {0}, {7}};
  for (std::size_t s = 0; s < after.size(); ++s) {
    const RowMatrix<double> G = random_matrix<double>(grown, d, 1220 + s);
    set_gradient(*p, G, after[s]);
    lazy.step();
    dense.step(expected, G, after[s], 0.05);
  }
  lazy.catch_up();
  CHECK(row_relative_error(p->value(), expected) <= (std::is_same_v<Scalar, float> ? 2e-6 : 1e-12));
  // Shrinking keeps rows bit for bit.
  const RowMatrix<Scalar> top = p->value().topRows(4);
  const RowMatrix<Scalar> top_last = lazy.state().parameters[0].buffers.at("last_step").topRows(4);
  p->resize_rows(4);
  CHECK(lazy.resize_state(*p));
  CHECK(same_values(lazy.state().parameters[0].buffers.at("last_step"), top_last));
  CHECK(same_values(p->value(), top));
}

TEMPLATE_TEST_CASE("LazyAdamW: a parameter without a gradient, skipped or stepped with zeros; frozen parameters",
                   "[lazy_adamw][no-grad]", float, double) {
  using Scalar = TestType;
  const Index V = 5, d = 2;
  embedhead::AdamOptions options;
  options.lr = 0.05;
  options.beta1 = 0;
  options.weight_decay = 0.4;
  for (const bool skip : {true, false}) {
    CAPTURE(skip);
    auto a = make_parameter<Scalar>(V, d, 570, "a"), b = make_parameter<Scalar>(V, d, 571, "b");
    LazyAdamW<Scalar> lazy(options, {a, b});
    lazy.set_skip_parameters_without_grad(skip);
    TorchAdamW dense{0, 0.999, 1e-8, 0.4, {}, {}};
    RowMatrix<double> expected = b->value().template cast<double>();
    const std::vector<bool> b_has = {true, false, false, true, false};
    for (std::size_t s = 0; s < b_has.size(); ++s) {
      const RowMatrix<double> G = random_matrix<double>(V, d, 1300 + s);
      set_gradient(*a, G, {0});
      b->zero_grad();
      if (b_has[s]) set_gradient(*b, G, {1, 3});
      const RowMatrix<Scalar> b_before = b->value();
      lazy.step();
      if (!b_has[s]) CHECK(same_values(b->value(), b_before));  // lazily: no row visited either way
      if (b_has[s] || !skip) dense.step(expected, G, b_has[s] ? std::vector<Index>{1, 3} : std::vector<Index>{}, 0.05);
    }
    CHECK(lazy.step_count(*b) == (skip ? 2 : 5));
    lazy.catch_up();
    CHECK(row_relative_error(b->value(), expected) <= (std::is_same_v<Scalar, float> ? 2e-6 : 1e-12));
  }
  SECTION("frozen: step leaves it alone; catch_up applies the steps it had taken") {
    auto p = make_parameter<Scalar>(V, d, 572);
    LazyAdamW<Scalar> lazy(options, {p});
    TorchAdamW dense{0, 0.999, 1e-8, 0.4, {}, {}};
    RowMatrix<double> expected = p->value().template cast<double>();
    for (std::uint64_t s = 0; s < 3; ++s) {
      const RowMatrix<double> G = random_matrix<double>(V, d, 1310 + s);
      set_gradient(*p, G, {s == 1 ? Index{2} : Index{0}});
      lazy.step();
      dense.step(expected, G, {s == 1 ? Index{2} : Index{0}}, 0.05);
    }
    p->set_frozen(true);
    const RowMatrix<Scalar> frozen = p->value();
    const auto state = lazy.state();
    set_gradient(*p, random_matrix<double>(V, d, 1320), {1});
    lazy.step();
    CHECK(same_values(p->value(), frozen));
    CHECK(lazy.step_count(*p) == 3);
    CHECK(same_values(buffer_of(lazy, "last_step"), state.parameters[0].buffers.at("last_step")));
    lazy.catch_up();
    CHECK(row_relative_error(p->value(), expected) <= (std::is_same_v<Scalar, float> ? 2e-6 : 1e-12));
    CHECK(lazy.step_count(*p) == 3);
  }
}

TEST_CASE("LazyAdamW: PyTorch AdamW's defaults and names", "[lazy_adamw][defaults]") {
  const LazyAdamW<float> lazy;
  CHECK(lazy.lr() == 1e-3);
  CHECK(lazy.options().beta1 == 0.9);
  CHECK(lazy.options().beta2 == 0.999);
  CHECK(lazy.options().eps == 1e-8);
  CHECK(lazy.options().weight_decay == 0.01);
  CHECK(lazy.state().optimizer == "LazyAdamW");
  CHECK(LazyAdamW<float>::max_step == 16777216);
  // One step with every row touched is AdamW's step to rounding (same defaults).
  auto p = make_parameter<double>(4, 3, 580), q = make_parameter<double>(4, 3, 580);
  LazyAdamW<double> a({}, {p});
  embedhead::AdamW<double> b({}, {q});
  const RowMatrix<double> G = random_matrix<double>(4, 3, 581);
  for (int s = 0; s < 3; ++s) {
    set_gradient(*p, G, {});
    set_gradient(*q, G, {});
    a.step();
    b.step();
  }
  CHECK(row_relative_error(p->value(), q->value()) <= 1e-14);
}

TEMPLATE_TEST_CASE("LazyAdamW: every bad input is an error naming it, and nothing changes", "[lazy_adamw][errors]",
                   float, double) {
  using Scalar = TestType;
  const Index V = 4, d = 2;
  auto p = make_parameter<Scalar>(V, d, 590);
  const RowMatrix<double> G = random_matrix<double>(V, d, 591);
  set_gradient(*p, G, {1, 3});
  struct Bad {
    double lr, beta1, beta2, eps, wd;
    const char* message;
  };
  const Bad bad[] = {{-0.1, 0.9, 0.999, 1e-8, 0.01, "LazyAdamW: lr = -0.1 outside [0, inf)"},
                     {1e-3, -0.1, 0.999, 1e-8, 0.01, "LazyAdamW: beta1 = -0.1 outside [0, 1)"},
                     {1e-3, 1.0, 0.999, 1e-8, 0.01, "LazyAdamW: beta1 = 1 outside [0, 1)"},
                     {1e-3, 0.9, 1.0, 1e-8, 0.01, "LazyAdamW: beta2 = 1 outside [0, 1)"},
                     {1e-3, 0.9, -0.5, 1e-8, 0.01, "LazyAdamW: beta2 = -0.5 outside [0, 1)"},
                     {1e-3, 0.9, 0.999, 0.0, 0.01, "LazyAdamW: eps = 0 outside (0, inf)"},
                     {1e-3, 0.9, 0.999, -1e-8, 0.01, "LazyAdamW: eps = -1e-08 outside (0, inf)"},
                     {1e-3, 0.9, 0.999, 1e-8, -0.5, "LazyAdamW: weight_decay = -0.5 outside [0, inf)"},
                     {std::numeric_limits<double>::quiet_NaN(), 0.9, 0.999, 1e-8, 0.01,
                      "LazyAdamW: lr = nan outside [0, inf)"}};
  const RowMatrix<Scalar> value = p->value(), grad = p->grad().to_dense();
  for (const Bad& b : bad) {
    CAPTURE(b.message);
    embedhead::AdamOptions o;
    o.lr = b.lr;
    o.beta1 = b.beta1;
    o.beta2 = b.beta2;
    o.eps = b.eps;
    o.weight_decay = b.wd;
    CHECK_THROWS_AS(LazyAdamW<Scalar>(o, {p}), embedhead::value_error);
    CHECK_THROWS_WITH(LazyAdamW<Scalar>(o, {p}), Contains(b.message));
  }
  CHECK(same_values(p->value(), value));
  CHECK(same_values(p->grad().to_dense(), grad));

  // An optimizer part-way through: every later error leaves values, moments, last_step, the
  // running decay and the step counts as they were.
  embedhead::AdamOptions options;
  options.lr = 0.1;
  options.weight_decay = 0.5;
  LazyAdamW<Scalar> lazy(options, {p});
  lazy.step();
  set_gradient(*p, G, {0});
  lazy.step();
  const auto good = lazy.state();
  const RowMatrix<Scalar> stepped = p->value();
  const auto unchanged = [&] {
    CHECK(same_values(p->value(), stepped));
    CHECK(lazy.step_count() == 2);
    CHECK(lazy.step_count(*p) == 2);
    const auto now = lazy.state();
    for (const auto& [key, buffer] : good.parameters[0].buffers)
      CHECK(same_values(now.parameters[0].buffers.at(key), buffer));
    CHECK(now.parameters[0].scalars == good.parameters[0].scalars);
    CHECK(now.parameters[0].step == good.parameters[0].step);
  };
  CHECK_THROWS_WITH(lazy.set_lr(-1.0), Contains("LazyAdamW: lr = -1 outside [0, inf)"));
  CHECK(lazy.lr() == 0.1);
  // lr wd > 0.5: refused at step, before anything changes.
  lazy.set_lr(1.5);
  CHECK_THROWS_AS(lazy.step(), embedhead::value_error);
  CHECK_THROWS_WITH(lazy.step(), Contains("LazyAdamW::step: the decay 1 - lr weight_decay = 0.25 outside [0.5, 1]") &&
                                     Contains("group 0") && Contains("at t = 3") && Contains("nothing was updated"));
  unchanged();
  lazy.set_lr(0.1);
  // Not registered.
  auto stranger = make_parameter<Scalar>(V, d, 592, "X");
  CHECK_THROWS_WITH(lazy.catch_up(*stranger),
                    Contains("LazyAdamW::catch_up: parameter 'X' [4, 2] is not registered with this optimizer"));
  CHECK_THROWS_WITH(lazy.lagging_rows(*stranger), Contains("LazyAdamW::lagging_rows: parameter 'X'"));
  unchanged();
  // Bad states: each refused naming what is wrong.
  const auto refuse = [&](auto edit, const std::string& message) {
    auto s = good;
    edit(s.parameters[0]);
    CAPTURE(message);
    CHECK_THROWS_AS(lazy.load_state(s), embedhead::value_error);
    CHECK_THROWS_WITH(lazy.load_state(s), Contains(message));
    unchanged();
  };
  using Entry = typename embedhead::OptimizerState<Scalar>::Entry;
  refuse([](Entry& e) { e.buffers.at("last_step")(1, 0) = Scalar(0.5); },
         "LazyAdamW::load_state: parameter 'E' has last_step[1] = 0.5, not an integer in [0, 2]");
  refuse([](Entry& e) { e.buffers.at("last_step")(2, 0) = Scalar(3); },
         "has last_step[2] = 3, not an integer in [0, 2]");
  refuse([](Entry& e) { e.buffers.at("decay_mantissa")(0, 0) = Scalar(0.25); },
         "has decay_mantissa[0] = 0.25, not a value in [0.5, 1]");
  refuse([](Entry& e) { e.buffers.at("decay_exponent")(3, 0) = Scalar(2); },
         "has decay_exponent[3] = 2, not an integer in [-2, 1]");
  refuse([](Entry& e) { e.scalars.at("decay_mantissa") = std::numeric_limits<double>::quiet_NaN(); },
         "has the scalar decay_mantissa = nan, not a value in [0.5, 1]");
  refuse([](Entry& e) { e.scalars.at("decay_exponent") = -0.5; },
         "has the scalar decay_exponent = -0.5, not an integer in [-2, 1]");
  refuse([](Entry& e) { e.scalars.erase("decay_exponent"); },
         "has 5 of the 5 buffers and 1 of the 2 scalars (decay_mantissa, decay_exponent): all or none");
  refuse([](Entry& e) { e.buffers.erase("last_step"); }, "has 4 of the 5 buffers and 2 of the 2 scalars");
  // A running decay above a row's stamp (the product only shrinks): D = P_t / P_l > 1.
  refuse(
      [](Entry& e) {
        e.scalars.at("decay_mantissa") = 0.875;
        e.scalars.at("decay_exponent") = 1;  // P_t = 1.75 > any stamp, each at most 1
      },
      "has the decay stamp decay_mantissa[0] x 2^decay_exponent[0] = ");
  refuse(
      [](Entry& e) {
        e.scalars.at("decay_mantissa") = 0.875;
        e.scalars.at("decay_exponent") = 1;
      },
      "below the running decay 0.875 x 2^1");
  refuse([](Entry& e) { e.scalars["momentum"] = 1; },
         "LazyAdamW::load_state: parameter 'E' has a scalar 'momentum' = 1 that LazyAdamW does not use");
  // A step count beyond what the Scalar holds exactly: refused at step, nothing changed.
  auto far = good;
  far.step = LazyAdamW<Scalar>::max_step;
  far.parameters[0].step = LazyAdamW<Scalar>::max_step;
  lazy.load_state(far);
  const RowMatrix<Scalar> at_far = p->value();
  CHECK_THROWS_WITH(lazy.step(),
                    Contains("LazyAdamW::step: step count t = " + std::to_string(LazyAdamW<Scalar>::max_step + 1) +
                             " exceeds " + std::to_string(LazyAdamW<Scalar>::max_step)) &&
                        Contains("nothing was updated"));
  CHECK(same_values(p->value(), at_far));
  CHECK(lazy.step_count(*p) == LazyAdamW<Scalar>::max_step);
  lazy.load_state(good);
  unchanged();
  // Resized without resize_state: catch_up refuses as step does.
  p->resize_rows(V + 1);
  CHECK_THROWS_AS(lazy.catch_up(), embedhead::shape_error);
  CHECK_THROWS_WITH(lazy.catch_up(), Contains("LazyAdamW::catch_up: parameter 'E' is [5, 2] but its state"));
  CHECK_THROWS_AS(lazy.catch_up(*p), embedhead::shape_error);
  CHECK(same_values(p->value().topRows(V), stepped));
}
