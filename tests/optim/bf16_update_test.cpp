// Tests for the low-precision update (include/embedhead/optim/low_precision_update.hpp) of every
// optimizer stepping a bf16 parameter.
//
// The references are written here: each optimizer's published rule (torch.optim.SGD, Adam, AdamW,
// SparseAdam, Adagrad; FBGEMM's rowwise Adagrad) in double, followed by the rounding to bf16 in
// double arithmetic (8 significant bits: ulp(y) = 2^(e - 8) for y = m 2^e, m in [0.5, 1)):
// nearest = round half to even of y / ulp, stochastic = one of floor and ceil of y / ulp.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <embedhead/optim/adagrad.hpp>
#include <embedhead/optim/adamw.hpp>
#include <embedhead/optim/lazy_adam.hpp>
#include <embedhead/optim/lazy_adamw.hpp>
#include <embedhead/optim/rowwise_adagrad.hpp>
#include <embedhead/optim/sgd.hpp>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "../reference/test_support.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using Catch::Matchers::Contains;
using embedhead::Index;
using embedhead::LowPrecisionUpdate;
using embedhead::LowPrecisionUpdateOptions;
using embedhead::Optimizer;
using embedhead::Parameter;
using embedhead::RowMatrix;
using BF16 = Eigen::bfloat16;
using BParam = Parameter<BF16, float>;

std::uint16_t bits(BF16 x) {
  std::uint16_t b = 0;
  std::memcpy(&b, &x, 2);
  return b;
}
template <typename A, typename B>
bool same_bits(const A& a, const B& b) {
  if (a.rows() != b.rows() || a.cols() != b.cols()) return false;
  for (Index i = 0; i < a.rows(); ++i)
    for (Index j = 0; j < a.cols(); ++j)
      if (bits(a(i, j)) != bits(b(i, j))) return false;
  return true;
}

// The bf16 spacing at y (normal range), in double.
double ulp_bf16(double y) {
  int e = 0;
  std::frexp(y, &e);
  return std::ldexp(1.0, e - 8);
}
double round_down(double y) { return std::floor(y / ulp_bf16(y)) * ulp_bf16(y); }
double round_up(double y) { return std::ceil(y / ulp_bf16(y)) * ulp_bf16(y); }
double round_nearest(double y) { return std::nearbyint(y / ulp_bf16(y)) * ulp_bf16(y); }

std::shared_ptr<BParam> make_bf16(Index rows, Index cols, std::uint64_t seed) {
  const RowMatrix<double> w = test_support::random_matrix<double>(rows, cols, seed);
  RowMatrix<BF16> v(rows, cols);
  for (Index i = 0; i < w.size(); ++i) v.data()[i] = BF16(static_cast<float>(w.data()[i]));
  return std::make_shared<BParam>(std::move(v), "E");
}
RowMatrix<double> widen(const BParam& p) { return p.value().cast<float>().cast<double>(); }

void set_dense_gradient(embedhead::ParameterBase<float>& p, const RowMatrix<double>& G) {
  p.zero_grad();
  p.grad().dense_accumulator() = G.cast<float>();
}
void set_rows_gradient(embedhead::ParameterBase<float>& p, const RowMatrix<double>& G, std::vector<Index> rows) {
  p.zero_grad();
  std::vector<Index> slots(rows.size());
  p.grad().touch_rows(rows.data(), static_cast<Index>(rows.size()), slots.data());
  for (std::size_t i = 0; i < rows.size(); ++i) p.grad().slot_row(slots[i]) = G.row(rows[i]).cast<float>();
}

enum class Kind {
  sgd,
  sgd_momentum,
  sgd_nesterov_decay,
  adam_l2,
  adamw,
  lazy_adam,
  lazy_adamw,
  adagrad,
  rowwise,
  rowwise_decoupled
};
const Kind kAll[] = {Kind::sgd,     Kind::sgd_momentum,     Kind::sgd_nesterov_decay, Kind::adam_l2,
                     Kind::adamw,   Kind::lazy_adam,        Kind::lazy_adamw,         Kind::adagrad,
                     Kind::rowwise, Kind::rowwise_decoupled};
const char* kind_name(Kind k) {
  const char* names[] = {
      "SGD",     "SGD momentum",   "SGD nesterov decay",      "Adam (L2)", "AdamW", "LazyAdam", "LazyAdamW",
      "Adagrad", "RowWiseAdagrad", "RowWiseAdagrad decoupled"};
  return names[static_cast<int>(k)];
}

const double kLr = 0.05, kWd = 0.1, kMu = 0.9, kB1 = 0.9, kB2 = 0.999, kEps = 1e-8;

std::unique_ptr<Optimizer<float>> make_optimizer(Kind k) {
  using namespace embedhead;
  switch (k) {
    case Kind::sgd: return std::make_unique<SGD<float>>(SGDOptions{kLr, 0, false, 0});
    case Kind::sgd_momentum: return std::make_unique<SGD<float>>(SGDOptions{kLr, kMu, false, 0});
    case Kind::sgd_nesterov_decay: return std::make_unique<SGD<float>>(SGDOptions{kLr, kMu, true, kWd});
    case Kind::adam_l2: return std::make_unique<Adam<float>>(AdamOptions{kLr, kB1, kB2, kEps, kWd});
    case Kind::adamw: return std::make_unique<AdamW<float>>(AdamOptions{kLr, kB1, kB2, kEps, kWd});
    case Kind::lazy_adam: return std::make_unique<LazyAdam<float>>(AdamOptions{kLr, kB1, kB2, kEps, 0.0});
    case Kind::lazy_adamw: return std::make_unique<LazyAdamW<float>>(AdamOptions{kLr, kB1, kB2, kEps, kWd});
    case Kind::adagrad: return std::make_unique<Adagrad<float>>(AdagradOptions{kLr, 0.01, 0.0, kEps});
    case Kind::rowwise:
      return std::make_unique<RowWiseAdagrad<float>>(RowWiseAdagradOptions{kLr, kEps, kWd, RowWiseWeightDecay::l2});
    case Kind::rowwise_decoupled:
      return std::make_unique<RowWiseAdagrad<float>>(
          RowWiseAdagradOptions{kLr, kEps, kWd, RowWiseWeightDecay::decoupled});
  }
  return nullptr;
}

// One step t of the published rule in double on every row (the gradient touches every row).
struct Reference {
  Kind kind;
  RowMatrix<double> m, v, sum;
  void step(RowMatrix<double>& x, const RowMatrix<double>& g, int t) {
    if (m.size() == 0) {
      m = RowMatrix<double>::Zero(x.rows(), x.cols());
      v = m;
      sum = RowMatrix<double>::Zero(x.rows(), 1);
    }
    const double T = t;
    for (Index r = 0; r < x.rows(); ++r) {
      if (kind == Kind::rowwise || kind == Kind::rowwise_decoupled) {
        const bool l2 = kind == Kind::rowwise;
        double ms = 0;
        for (Index j = 0; j < x.cols(); ++j) {
          const double gg = l2 ? g(r, j) + kWd * x(r, j) : g(r, j);
          ms += gg * gg;
        }
        sum(r, 0) += ms / static_cast<double>(x.cols());
        const double mult = kLr / (std::sqrt(sum(r, 0)) + kEps);
        for (Index j = 0; j < x.cols(); ++j) x(r, j) = (l2 ? 1 - mult * kWd : 1 - kLr * kWd) * x(r, j) - mult * g(r, j);
        continue;
      }
      for (Index j = 0; j < x.cols(); ++j) {
        double& p = x(r, j);
        double gr = g(r, j);
        switch (kind) {
          case Kind::sgd: p -= kLr * gr; break;
          case Kind::sgd_momentum:
          case Kind::sgd_nesterov_decay: {
            const bool nesterov = kind == Kind::sgd_nesterov_decay;
            if (nesterov) p *= 1 - kLr * kWd;
            m(r, j) = t == 1 ? gr : kMu * m(r, j) + gr;
            p -= kLr * (nesterov ? gr + kMu * m(r, j) : m(r, j));
            break;
          }
          case Kind::adam_l2:
          case Kind::adamw:
          case Kind::lazy_adamw:
            if (kind == Kind::adam_l2)
              gr += kWd * p;
            else
              p *= 1 - kLr * kWd;
            m(r, j) = kB1 * m(r, j) + (1 - kB1) * gr;
            v(r, j) = kB2 * v(r, j) + (1 - kB2) * gr * gr;
            p -= kLr / (1 - std::pow(kB1, T)) * m(r, j) / (std::sqrt(v(r, j)) / std::sqrt(1 - std::pow(kB2, T)) + kEps);
            break;
          case Kind::lazy_adam:
            m(r, j) = kB1 * m(r, j) + (1 - kB1) * gr;
            v(r, j) = kB2 * v(r, j) + (1 - kB2) * gr * gr;
            p -= kLr * std::sqrt(1 - std::pow(kB2, T)) / (1 - std::pow(kB1, T)) * m(r, j) / (std::sqrt(v(r, j)) + kEps);
            break;
          case Kind::adagrad:
            v(r, j) += gr * gr;
            p -= kLr / (1 + (T - 1) * 0.01) * gr / (std::sqrt(v(r, j)) + kEps);
            break;
          default: break;
        }
      }
    }
  }
};

// The float update's error against the double rule: a few float roundings of x and of the step.
double tolerance(double x, double before) { return 4e-6 * std::fabs(x) + 1e-4 * std::fabs(x - before) + 1e-30; }

LowPrecisionUpdateOptions mode(LowPrecisionUpdate m, std::uint64_t seed = 7) { return {m, seed}; }

}  // namespace

TEST_CASE("bf16 update: nearest and stochastic against the double rule, every optimizer", "[optim][bf16]") {
  const Index V = 6, d = 16;
  for (Kind kind : kAll)
    for (LowPrecisionUpdate m : {LowPrecisionUpdate::nearest, LowPrecisionUpdate::stochastic}) {
      INFO(kind_name(kind) << (m == LowPrecisionUpdate::nearest ? ", nearest" : ", stochastic"));
      auto p = make_bf16(V, d, 11);
      auto opt = make_optimizer(kind);
      opt->set_low_precision_update(mode(m));
      opt->add_group(std::vector<std::shared_ptr<BParam>>{p});
      Reference ref{kind, {}, {}, {}};
      std::size_t moved = 0;
      for (int t = 1; t <= 12; ++t) {
        const RowMatrix<double> G = test_support::random_matrix<double>(V, d, 100 + static_cast<std::uint64_t>(t));
        RowMatrix<double> x = widen(*p);  // the rule continues from the stored bf16 values
        const RowMatrix<double> before = x;
        ref.step(x, G, t);
        set_dense_gradient(*p, G);
        opt->step();
        for (Index i = 0; i < x.size(); ++i) {
          const double y = x.data()[i], tol = tolerance(y, before.data()[i]);
          const double got = static_cast<double>(static_cast<float>(p->value().data()[i]));
          const double lo = m == LowPrecisionUpdate::nearest ? round_nearest(y - tol) : round_down(y - tol);
          const double hi = m == LowPrecisionUpdate::nearest ? round_nearest(y + tol) : round_up(y + tol);
          INFO("t = " << t << ", element " << i << ": rule " << y << ", stored " << got);
          REQUIRE(got >= lo);
          REQUIRE(got <= hi);
          moved += got != before.data()[i];
        }
      }
      CHECK(moved > 0);  // the test sees updates, not only values that stayed
    }
}

TEST_CASE("bf16 update: nearest is Eigen's bf16 rounding of the float update, bit for bit", "[optim][bf16]") {
  // A float twin reset to the widened bf16 value before each step: nearest stores bf16(twin).
  const Index V = 5, d = 12;
  for (Kind kind : kAll) {
    INFO(kind_name(kind));
    auto p = make_bf16(V, d, 3);
    auto twin = std::make_shared<Parameter<float>>(V, d, "E");
    auto opt = make_optimizer(kind), twin_opt = make_optimizer(kind);
    opt->set_low_precision_update(mode(LowPrecisionUpdate::nearest));
    opt->add_group(std::vector<std::shared_ptr<BParam>>{p});
    twin_opt->add_group({twin});
    for (int t = 1; t <= 6; ++t) {
      const RowMatrix<double> G = test_support::random_matrix<double>(V, d, 200 + static_cast<std::uint64_t>(t));
      twin->value() = p->value().cast<float>();
      set_dense_gradient(*p, G);
      set_dense_gradient(*twin, G);
      opt->step();
      twin_opt->step();
      for (Index i = 0; i < V * d; ++i) REQUIRE(bits(p->value().data()[i]) == bits(BF16(twin->value().data()[i])));
    }
  }
}

TEST_CASE("bf16 update: stochastic rounding is unbiased, in {down, up}, reproducible", "[optim][bf16]") {
  // 10^5 elements at 1.5 (ulp 2^-7), one SGD step of 0.3 ulp: each goes to 1.5 - 2^-7 with
  // probability 0.3. Binomial(10^5, 0.3) has sd 145: the count lies within 6 sd (870).
  const Index V = 1000, d = 100;
  const double ulp = std::ldexp(1.0, -7);
  auto make = [&] {
    auto p = std::make_shared<BParam>(RowMatrix<BF16>::Constant(V, d, BF16(1.5f)), "E");
    set_dense_gradient(*p, RowMatrix<double>::Constant(V, d, 0.3 * ulp));
    return p;
  };
  auto run = [&](std::uint64_t seed) {
    auto p = make();
    embedhead::SGD<float> sgd(embedhead::SGDOptions{1.0});
    sgd.set_low_precision_update(mode(LowPrecisionUpdate::stochastic, seed));
    sgd.add_group(std::vector<std::shared_ptr<BParam>>{p});
    sgd.step();
    return RowMatrix<BF16>(p->value());
  };
  const RowMatrix<BF16> a = run(1);
  long down = 0;
  for (Index i = 0; i < a.size(); ++i) {
    const double w = static_cast<float>(a.data()[i]);
    REQUIRE((w == 1.5 || w == 1.5 - ulp));
    down += w == 1.5 - ulp;
  }
  CHECK(std::labs(down - 30000) <= 870);
  CHECK(same_bits(run(1), a));   // same seed, same bits
  CHECK(!same_bits(run(2), a));  // another seed, other draws
#ifdef _OPENMP
  const int before = omp_get_max_threads();
  omp_set_num_threads(1);
  const RowMatrix<BF16> one = run(1);
  omp_set_num_threads(2);
  const RowMatrix<BF16> two = run(1);
  omp_set_num_threads(before);
  CHECK(same_bits(one, two));
  CHECK(same_bits(one, a));
#endif
}

TEST_CASE("bf16 update: a row's draws do not depend on the other rows touched", "[optim][bf16]") {
  // SGD without momentum steps the touched rows only; rows 1 and 3 get the same bits whether row 5
  // is touched too, and the same after a save and restore of the optimizer's state.
  const Index V = 8, d = 32;
  const RowMatrix<double> G = test_support::random_matrix<double>(V, d, 5, 1e-3);
  auto run = [&](std::vector<Index> rows) {
    auto p = make_bf16(V, d, 9);
    embedhead::SGD<float> sgd(embedhead::SGDOptions{0.37});
    sgd.set_low_precision_update(mode(LowPrecisionUpdate::stochastic, 4));
    sgd.add_group(std::vector<std::shared_ptr<BParam>>{p});
    for (int t = 0; t < 3; ++t) {
      set_rows_gradient(*p, G, rows);
      sgd.step();
    }
    return RowMatrix<BF16>(p->value());
  };
  const RowMatrix<BF16> a = run({1, 3}), b = run({1, 3, 5}), start = make_bf16(V, d, 9)->value();
  for (Index r : {1, 3}) CHECK(same_bits(a.row(r), b.row(r)));
  CHECK(!same_bits(a.row(1), start.row(1)));
  CHECK(!same_bits(a.row(5), b.row(5)));
}

TEST_CASE("bf16 update: Kahan keeps the updates nearest loses", "[optim][bf16]") {
  // 200 SGD steps of 0.1 ulp on 1.5: nearest never moves; kahan's bf16 + c is the double rule's
  // 1.5 - 20 ulp to float rounding, and the stored bf16 is its nearest rounding.
  const Index V = 3, d = 4;
  const double ulp = std::ldexp(1.0, -7);
  auto run = [&](LowPrecisionUpdate m, embedhead::SGD<float>& sgd) {
    auto p = std::make_shared<BParam>(RowMatrix<BF16>::Constant(V, d, BF16(1.5f)), "E");
    sgd.set_low_precision_update(mode(m));
    sgd.add_group(std::vector<std::shared_ptr<BParam>>{p});
    for (int t = 0; t < 200; ++t) {
      set_dense_gradient(*p, RowMatrix<double>::Constant(V, d, 0.1 * ulp));
      sgd.step();
    }
    return p;
  };
  embedhead::SGD<float> nearest(embedhead::SGDOptions{1.0}), kahan(embedhead::SGDOptions{1.0});
  const auto n = run(LowPrecisionUpdate::nearest, nearest);
  CHECK((n->value().cast<float>().array() == 1.5f).all());
  const auto k = run(LowPrecisionUpdate::kahan, kahan);
  const RowMatrix<float> c = kahan.state().parameters[0].buffers.at("kahan_compensation");
  const double expected = 1.5 - 200 * 0.1 * ulp;
  for (Index i = 0; i < V * d; ++i) {
    const float w = static_cast<float>(k->value().data()[i]);
    CHECK(std::fabs(static_cast<double>(w + c.data()[i]) - expected) <= 200 * 1.2e-7);
    CHECK(bits(k->value().data()[i]) == bits(BF16(w + c.data()[i])));
  }
  CHECK(static_cast<double>(static_cast<float>(k->value()(0, 0))) == round_nearest(expected));
}

TEST_CASE("bf16 update: Kahan follows the double rule of every optimizer", "[optim][bf16]") {
  // bf16 + c against the rule in double; and, bit for bit, against a float parameter started at the
  // same values (c holds exactly what the rounding removed, so nothing is lost).
  const Index V = 4, d = 8;
  for (Kind kind : kAll) {
    INFO(kind_name(kind));
    auto p = make_bf16(V, d, 21);
    auto twin = std::make_shared<Parameter<float>>(RowMatrix<float>(p->value().cast<float>()), "E");
    auto opt = make_optimizer(kind), twin_opt = make_optimizer(kind);
    opt->set_low_precision_update(mode(LowPrecisionUpdate::kahan));
    opt->add_group(std::vector<std::shared_ptr<BParam>>{p});
    twin_opt->add_group({twin});
    Reference ref{kind, {}, {}, {}};
    RowMatrix<double> x = widen(*p);
    for (int t = 1; t <= 15; ++t) {
      const RowMatrix<double> G = test_support::random_matrix<double>(V, d, 300 + static_cast<std::uint64_t>(t), 0.01);
      ref.step(x, G, t);
      set_dense_gradient(*p, G);
      set_dense_gradient(*twin, G);
      opt->step();
      twin_opt->step();
    }
    const RowMatrix<float> c = opt->state().parameters[0].buffers.at("kahan_compensation");
    for (Index i = 0; i < V * d; ++i) {
      const float sum = static_cast<float>(p->value().data()[i]) + c.data()[i];
      INFO("element " << i << ": rule " << x.data()[i] << ", bf16 + c " << sum);
      CHECK(std::fabs(static_cast<double>(sum) - x.data()[i]) <= 1e-5 * std::fabs(x.data()[i]) + 1e-6);
      CHECK(sum == twin->value().data()[i]);
    }
  }
}

TEST_CASE("bf16 update: weight decay moves a bf16 weight under stochastic and kahan, not nearest", "[optim][bf16]") {
  // AdamW with a zero gradient is the decay alone, w *= 1 - lr wd = 1 - 1e-5: 1.5e-5 a step on
  // 1.5, below half an ulp (2^-8). The factor is the float nearest 1 - 1e-5 (the update multiplies
  // by it in float, as PyTorch on a float tensor).
  const Index V = 100, d = 100;
  const double factor = static_cast<double>(static_cast<float>(1.0 - 1e-3 * 0.01));
  auto run = [&](LowPrecisionUpdate m, int steps, embedhead::AdamW<float>& opt) {
    auto p = std::make_shared<BParam>(RowMatrix<BF16>::Constant(V, d, BF16(1.5f)), "E");
    opt.set_low_precision_update(mode(m, 3));
    opt.add_group(std::vector<std::shared_ptr<BParam>>{p});
    for (int t = 0; t < steps; ++t) {
      set_dense_gradient(*p, RowMatrix<double>::Zero(V, d));
      opt.step();
    }
    return p;
  };
  const embedhead::AdamOptions options{1e-3, 0.9, 0.999, 1e-8, 0.01};
  embedhead::AdamW<float> nearest(options), stochastic(options), kahan(options);
  CHECK((run(LowPrecisionUpdate::nearest, 300, nearest)->value().cast<float>().array() == 1.5f).all());
  // Stochastic: E[w_100] = 1.5 factor^100 (the rounding is unbiased and the decay linear); each w
  // is 1.5 or 1.5 - 2^-7, so the mean of 10^4 has sd <= 2^-7 / (2 sqrt(10^4)) = 3.9e-5.
  const auto s = run(LowPrecisionUpdate::stochastic, 100, stochastic);
  const double mean = s->value().cast<float>().cast<double>().mean();
  CHECK(std::fabs(mean - 1.5 * std::pow(factor, 100)) <= 6 * 3.9e-5);
  CHECK(mean < 1.5);
  // Kahan: after 300 steps the true value 1.5 factor^300 = 1.4955 rounds to 1.4921875; bf16 + c
  // is it to the float roundings of 300 products (half a float ulp of 1.5, 6e-8, each).
  const auto k = run(LowPrecisionUpdate::kahan, 300, kahan);
  const RowMatrix<float> c = kahan.state().parameters[0].buffers.at("kahan_compensation");
  CHECK(static_cast<float>(k->value()(7, 7)) == 1.4921875f);
  CHECK(std::fabs(static_cast<double>(static_cast<float>(k->value()(7, 7)) + c(7, 7)) - 1.5 * std::pow(factor, 300)) <=
        300 * 6e-8);
}

TEST_CASE("bf16 update: Kahan state saved and restored; bad states and modes refused", "[optim][bf16]") {
  const Index V = 5, d = 6;
  auto p = make_bf16(V, d, 1);
  embedhead::AdamW<float> opt(embedhead::AdamOptions{0.01});
  opt.set_low_precision_update(mode(LowPrecisionUpdate::kahan));
  opt.add_group(std::vector<std::shared_ptr<BParam>>{p});
  for (int t = 1; t <= 3; ++t) {
    set_dense_gradient(*p, test_support::random_matrix<double>(V, d, 40 + static_cast<std::uint64_t>(t)));
    opt.step();
  }
  const auto state = opt.state();
  REQUIRE(state.parameters[0].buffers.count("kahan_compensation") == 1);
  CHECK(state.parameters[0].buffers.at("kahan_compensation").cwiseAbs().maxCoeff() > 0);

  // A copy of the parameter and a fresh optimizer continue bit for bit.
  auto q = std::make_shared<BParam>(RowMatrix<BF16>(p->value()), "E");
  embedhead::AdamW<float> resumed(embedhead::AdamOptions{0.01});
  resumed.set_low_precision_update(mode(LowPrecisionUpdate::kahan));
  resumed.add_group(std::vector<std::shared_ptr<BParam>>{q});
  resumed.load_state(state);
  const RowMatrix<double> G = test_support::random_matrix<double>(V, d, 99);
  set_dense_gradient(*p, G);
  set_dense_gradient(*q, G);
  opt.step();
  resumed.step();
  CHECK(same_bits(p->value(), q->value()));
  CHECK(test_support::same_values(opt.state().parameters[0].buffers.at("kahan_compensation"),
                                  resumed.state().parameters[0].buffers.at("kahan_compensation")));

  // Refused, nothing changed: a Kahan buffer of the wrong shape, ...
  const auto before = resumed.state();
  auto bad = state;
  bad.parameters[0].buffers["kahan_compensation"] = RowMatrix<float>::Zero(V, d + 1);
  CHECK_THROWS_AS(resumed.load_state(bad), embedhead::shape_error);
  CHECK_THROWS_WITH(resumed.load_state(bad), Contains("E.kahan_compensation"));
  // ... a Kahan buffer for an optimizer whose update is not kahan, ...
  embedhead::AdamW<float> plain(embedhead::AdamOptions{0.01});
  plain.set_low_precision_update(mode(LowPrecisionUpdate::nearest));
  auto r = std::make_shared<BParam>(RowMatrix<BF16>(p->value()), "E");
  plain.add_group(std::vector<std::shared_ptr<BParam>>{r});
  CHECK_THROWS_WITH(plain.load_state(state), Contains("has a buffer 'kahan_compensation', which only the kahan "
                                                      "low-precision update uses (this optimizer's is nearest)"));
  CHECK(plain.step_count() == 0);
  CHECK(plain.state().parameters[0].buffers.empty());
  // ... a Kahan buffer on a float parameter, ...
  embedhead::AdamW<float> floats(embedhead::AdamOptions{0.01});
  floats.set_low_precision_update(mode(LowPrecisionUpdate::kahan));
  floats.add_group({std::make_shared<Parameter<float>>(V, d, "E")});
  CHECK_THROWS_WITH(floats.load_state(state), Contains("only a low-precision parameter with the kahan update has"));
  CHECK(floats.step_count() == 0);
  // ... and a mode that is not a LowPrecisionUpdate.
  CHECK_THROWS_AS(resumed.set_low_precision_update({static_cast<LowPrecisionUpdate>(7), 1}), embedhead::value_error);
  CHECK_THROWS_WITH(resumed.set_low_precision_update({static_cast<LowPrecisionUpdate>(7), 1}),
                    Contains("AdamW::set_low_precision_update: LowPrecisionUpdate mode = 7 is not one of nearest (0), "
                             "stochastic (1), kahan (2)"));
  CHECK(resumed.low_precision_update().mode == LowPrecisionUpdate::kahan);
  const auto after = resumed.state();
  CHECK(after.step == before.step);
  CHECK(test_support::same_values(after.parameters[0].buffers.at("kahan_compensation"),
                                  before.parameters[0].buffers.at("kahan_compensation")));
  CHECK(
      test_support::same_values(after.parameters[0].buffers.at("exp_avg"), before.parameters[0].buffers.at("exp_avg")));
  // Leaving kahan drops the compensation.
  resumed.set_low_precision_update(mode(LowPrecisionUpdate::stochastic));
  CHECK(resumed.state().parameters[0].buffers.count("kahan_compensation") == 0);
}

TEST_CASE("bf16 update: LazyAdamW's catch-up writes through the same rounding", "[optim][bf16]") {
  // A row untouched for 5 steps, then caught up: its value is the decay applied to it, rounded.
  const Index V = 4, d = 8;
  auto p = make_bf16(V, d, 2);
  embedhead::LazyAdamW<float> opt(embedhead::AdamOptions{0.01, 0.9, 0.999, 1e-8, 1.0});
  opt.set_low_precision_update(mode(LowPrecisionUpdate::kahan));
  opt.add_group(std::vector<std::shared_ptr<BParam>>{p});
  const RowMatrix<double> start = widen(*p);
  const RowMatrix<double> G = test_support::random_matrix<double>(V, d, 8);
  for (int t = 0; t < 5; ++t) {
    set_rows_gradient(*p, G, {0});
    opt.step();
  }
  CHECK(opt.lagging_rows(*p) == V - 1);
  opt.catch_up(*p);
  CHECK(opt.lagging_rows(*p) == 0);
  const RowMatrix<float> c = opt.state().parameters[0].buffers.at("kahan_compensation");
  const double decay = std::pow(1.0 - 0.01, 5);
  for (Index j = 0; j < d; ++j) {
    const double got = static_cast<float>(p->value()(2, j)) + c(2, j);
    CHECK(std::fabs(got - start(2, j) * decay) <= 1e-6);
  }
}

TEST_CASE("fp16 update: stochastic rounding unbiased, Kahan the float trajectory", "[optim][bf16]") {
  // fp16 has 11 significant bits: ulp 2^-10 on [1, 2). 10^5 elements at 1.5, one SGD step of 0.3
  // ulp: each goes to 1.5 - 2^-10 with probability 0.3 (count within 6 sd, 870, of 30,000).
  using Half = Eigen::half;
  using HParam = Parameter<Half, float>;
  const Index V = 1000, d = 100;
  const double ulp = std::ldexp(1.0, -10);
  auto p = std::make_shared<HParam>(RowMatrix<Half>::Constant(V, d, Half(1.5f)), "E");
  set_dense_gradient(*p, RowMatrix<double>::Constant(V, d, 0.3 * ulp));
  embedhead::SGD<float> sgd(embedhead::SGDOptions{1.0});
  sgd.set_low_precision_update(mode(LowPrecisionUpdate::stochastic));
  sgd.add_group(std::vector<std::shared_ptr<HParam>>{p});
  sgd.step();
  long down = 0;
  for (Index i = 0; i < V * d; ++i) {
    const double w = static_cast<float>(p->value().data()[i]);
    REQUIRE((w == 1.5 || w == 1.5 - ulp));
    down += w == 1.5 - ulp;
  }
  CHECK(std::labs(down - 30000) <= 870);

  // Kahan: fp16 + c is a float parameter's AdamW trajectory bit for bit.
  const RowMatrix<double> start = test_support::random_matrix<double>(4, 8, 6);
  RowMatrix<Half> h(4, 8);
  for (Index i = 0; i < h.size(); ++i) h.data()[i] = Half(static_cast<float>(start.data()[i]));
  auto q = std::make_shared<HParam>(h, "E");
  auto twin = std::make_shared<Parameter<float>>(RowMatrix<float>(h.cast<float>()), "E");
  embedhead::AdamW<float> opt(embedhead::AdamOptions{0.01}), twin_opt(embedhead::AdamOptions{0.01});
  opt.set_low_precision_update(mode(LowPrecisionUpdate::kahan));
  opt.add_group(std::vector<std::shared_ptr<HParam>>{q});
  twin_opt.add_group({twin});
  for (int t = 1; t <= 10; ++t) {
    const RowMatrix<double> G = test_support::random_matrix<double>(4, 8, 60 + static_cast<std::uint64_t>(t), 1e-3);
    set_dense_gradient(*q, G);
    set_dense_gradient(*twin, G);
    opt.step();
    twin_opt.step();
  }
  const RowMatrix<float> c = opt.state().parameters[0].buffers.at("kahan_compensation");
  bool compensated = false;
  for (Index i = 0; i < 32; ++i) {
    CHECK(static_cast<float>(q->value().data()[i]) + c.data()[i] == twin->value().data()[i]);
    compensated = compensated || c.data()[i] != 0;
  }
  CHECK(compensated);
}
