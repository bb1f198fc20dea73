// Tests for include/embedhead/distillation.hpp: forward KL, reverse KL and the generalized JSD
// against a teacher head, dense cached log-probs and top-k log-probs. Expected values come from a
// worked example, a naive double reference written here from the definitions (full logits,
// log-softmax, the sums), and central differences of that reference in double.
#include <embedhead/distillation.hpp>

#include "reference/test_support.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

using Catch::Matchers::Contains;
using Catch::Matchers::WithinAbs;
using Catch::Matchers::WithinRel;
using embedhead::Divergence;
using embedhead::DistillationExtras;
using embedhead::DistillationOptions;
using embedhead::DistillationResult;
using embedhead::DistillationWorkspace;
using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::Reduction;
using embedhead::RowMatrix;
using embedhead::TeacherTopK;
using test_support::random_matrix;

namespace {

using Matrix = RowMatrix<double>;

// log softmax of each row of z / T, in double.
Matrix log_softmax(const Matrix& z, double T) {
  Matrix out(z.rows(), z.cols());
  for (Index n = 0; n < z.rows(); ++n) {
    double m = -INFINITY;
    for (Index j = 0; j < z.cols(); ++j) m = std::max(m, z(n, j) / T);
    double s = 0;
    for (Index j = 0; j < z.cols(); ++j) s += std::exp(z(n, j) / T - m);
    for (Index j = 0; j < z.cols(); ++j) out(n, j) = z(n, j) / T - m - std::log(s);
  }
  return out;
}

// sum_j P_j (log P_j - log Q_j) of one row, terms with P_j = 0 adding 0.
double kl_row(const Matrix& lP, const Matrix& lQ, Index n) {
  double total = 0;
  for (Index j = 0; j < lP.cols(); ++j) {
    const double P = std::exp(lP(n, j));
    if (P > 0) total += P * (lP(n, j) - lQ(n, j));
  }
  return total;
}

// The naive loss from student logits s and teacher logits u [N, V] (a row of u may be log-probs,
// -inf outside a top-k support), mask (empty: all counted); per-row losses into rows when given.
double naive_loss(const Matrix& s, const Matrix& u, const std::vector<int>& mask, const DistillationOptions& o,
                  std::vector<double>* rows = nullptr) {
  const double T = o.temperature, beta = o.beta;
  const Matrix lp = log_softmax(s, T), lq = log_softmax(u, T);
  double sum = 0;
  Index count = 0;
  for (Index n = 0; n < s.rows(); ++n) {
    double row = 0;
    if (mask.empty() || mask[static_cast<std::size_t>(n)]) {
      ++count;
      if (o.divergence == Divergence::forward_kl) {
        row = T * T * kl_row(lq, lp, n);
      } else if (o.divergence == Divergence::reverse_kl) {
        row = T * T * kl_row(lp, lq, n);
      } else if (beta == 0) {
        row = kl_row(lq, lp, n);
      } else if (beta == 1) {
        row = kl_row(lp, lq, n);
      } else {
        Matrix lm(1, s.cols()), lpn = lp.row(n), lqn = lq.row(n);
        for (Index j = 0; j < s.cols(); ++j)
          lm(0, j) = std::log(beta * std::exp(lq(n, j)) + (1 - beta) * std::exp(lp(n, j)));
        row = beta * kl_row(lqn, lm, 0) + (1 - beta) * kl_row(lpn, lm, 0);
      }
    }
    if (rows) rows->push_back(row);
    sum += row;
  }
  if (o.reduction == Reduction::mean) return count ? sum / static_cast<double>(count) : 0.0;
  return sum;
}

// Central differences of f over every element of x (modified in place, restored).
template <typename F>
Matrix central_differences(Matrix& x, const F& f, double step = 1e-5) {
  Matrix g(x.rows(), x.cols());
  for (Index i = 0; i < x.size(); ++i) {
    const double keep = x.data()[i];
    x.data()[i] = keep + step;
    const double up = f();
    x.data()[i] = keep - step;
    const double down = f();
    x.data()[i] = keep;
    g.data()[i] = (up - down) / (2 * step);
  }
  return g;
}

// An empty matrix: an absent bias or gradient.
template <typename Scalar>
RowMatrix<Scalar>& empty() {
  static RowMatrix<Scalar> none(0, 0);
  return none;
}

template <typename Scalar>
RowMatrix<Scalar> cast(const Matrix& m) {
  return m.template cast<Scalar>();
}

template <typename A, typename B>
void require_close(const A& got, const B& want, double rel, double abs) {
  REQUIRE(got.rows() == want.rows());
  REQUIRE(got.cols() == want.cols());
  for (Index i = 0; i < got.rows(); ++i)
    for (Index j = 0; j < got.cols(); ++j) {
      INFO("at (" << i << ", " << j << ")");
      REQUIRE_THAT(static_cast<double>(got(i, j)),
                   WithinRel(static_cast<double>(want(i, j)), rel) || WithinAbs(static_cast<double>(want(i, j)), abs));
    }
}

DistillationOptions make_options(Divergence divergence, double T, double beta = 0.5,
                                 Reduction reduction = Reduction::mean) {
  DistillationOptions o;
  o.divergence = divergence;
  o.temperature = T;
  o.beta = beta;
  o.reduction = reduction;
  o.vocab_block = 16;  // several blocks and a partial one at V = 53
  return o;
}

// The options every comparison runs: each divergence, jsd's edge cases, T != 1.
std::vector<DistillationOptions> all_options() {
  return {make_options(Divergence::forward_kl, 1.0), make_options(Divergence::forward_kl, 2.5),
          make_options(Divergence::reverse_kl, 1.0), make_options(Divergence::reverse_kl, 0.7),
          make_options(Divergence::jsd, 1.0, 0.3),   make_options(Divergence::jsd, 2.0, 0.8),
          make_options(Divergence::jsd, 1.5, 0.0),   make_options(Divergence::jsd, 1.5, 1.0)};
}

// o under each plan: vocabulary blocks; token chunks of 3 rows (a budget of 3 tokens' logits of both models: at N = 7
// chunks of 3, 3 and 1); automatic (here token chunks of every row).
template <typename Scalar>
std::vector<DistillationOptions> with_plans(DistillationOptions o, Index V) {
  std::vector<DistillationOptions> plans;
  o.plan = embedhead::FusedPlan::vocab_blocks;
  plans.push_back(o);
  o.plan = embedhead::FusedPlan::token_chunks;
  o.memory_budget = 3 * 2 * V * static_cast<Index>(sizeof(Scalar));
  plans.push_back(o);
  o.plan = embedhead::FusedPlan::automatic;
  o.memory_budget = 0;
  plans.push_back(o);
  return plans;
}

std::string describe(const DistillationOptions& o) {
  const char* name = o.divergence == Divergence::forward_kl   ? "forward_kl"
                     : o.divergence == Divergence::reverse_kl ? "reverse_kl"
                                                              : "jsd";
  return std::string(name) + " T=" + std::to_string(o.temperature) + " beta=" + std::to_string(o.beta) +
         " plan=" + std::to_string(static_cast<int>(o.plan)) + " budget=" + std::to_string(o.memory_budget);
}

struct Problem {
  Index N = 7, d = 5, dT = 4, V = 53;
  Matrix h, W, hT, WT;
  Matrix b = Matrix(0, 1), bT = Matrix(0, 1);  // the biases, empty: none
  std::vector<int> mask{1, 1, 0, 1, 1, 0, 1};
  Problem() {
    h = random_matrix<double>(N, d, 11, 1.0);
    W = random_matrix<double>(V, d, 12, 1.5);
    hT = random_matrix<double>(N, dT, 13, 1.0);
    WT = random_matrix<double>(V, dT, 14, 2.0);
  }
  Matrix s() const { return with_bias(h * W.transpose(), b); }
  Matrix u() const { return with_bias(hT * WT.transpose(), bT); }
  static Matrix with_bias(Matrix z, const Matrix& bias) {
    if (bias.size() != 0) z.rowwise() += bias.col(0).transpose();
    return z;
  }
  void add_biases() {
    b = random_matrix<double>(V, 1, 15, 0.7);
    bT = random_matrix<double>(V, 1, 16, 1.2);
  }
  template <typename Scalar>
  RowMatrix<Scalar> mask_matrix() const {
    RowMatrix<Scalar> m(N, 1);
    for (Index n = 0; n < N; ++n) m(n, 0) = static_cast<Scalar>(mask[static_cast<std::size_t>(n)]);
    return m;
  }
};

// dL/ds and dL/du [N, V] of naive_loss, in double over the full logits, written from the gradient
// formulas of distillation.hpp's header (dL/da, dL/db with the row's weight w, divided by T).
struct LogitGradients {
  Matrix ds, du;
};

LogitGradients naive_logit_gradients(const Matrix& s, const Matrix& u, const std::vector<int>& mask,
                                     const DistillationOptions& o) {
  const double T = o.temperature, beta = o.beta;
  const Index N = s.rows(), V = s.cols();
  const Matrix lp = log_softmax(s, T), lq = log_softmax(u, T);
  auto counted = [&](Index n) { return mask.empty() || mask[static_cast<std::size_t>(n)] != 0; };
  Index count = 0;
  for (Index n = 0; n < N; ++n) count += counted(n) ? 1 : 0;
  const double w = o.reduction == Reduction::mean ? (count ? 1.0 / static_cast<double>(count) : 0.0) : 1.0;
  const bool jsd = o.divergence == Divergence::jsd;
  const bool forward = o.divergence == Divergence::forward_kl || (jsd && beta == 0);
  const bool reverse = o.divergence == Divergence::reverse_kl || (jsd && beta == 1);
  const double c = jsd ? 1.0 : T * T;
  LogitGradients g{Matrix::Zero(N, V), Matrix::Zero(N, V)};
  for (Index n = 0; n < N; ++n) {
    if (!counted(n)) continue;
    Matrix lm(1, V);
    for (Index j = 0; j < V; ++j) lm(0, j) = std::log(beta * std::exp(lq(n, j)) + (1 - beta) * std::exp(lp(n, j)));
    const Matrix lpn = lp.row(n), lqn = lq.row(n);
    const double K = forward ? kl_row(lq, lp, n) : reverse ? kl_row(lp, lq, n) : 0.0;
    const double Kp = kl_row(lpn, lm, 0), Kq = kl_row(lqn, lm, 0);
    for (Index j = 0; j < V; ++j) {
      const double p = std::exp(lp(n, j)), q = std::exp(lq(n, j));
      double da = 0, db = 0;
      if (forward) {
        da = w * c * (p - q);
        if (q > 0) db = w * c * q * (lq(n, j) - lp(n, j) - K);
      } else if (reverse) {
        if (p > 0) da = w * c * p * (lp(n, j) - lq(n, j) - K);
        db = w * c * (q - p);
      } else {
        if (p > 0) da = w * (1 - beta) * p * (lp(n, j) - lm(0, j) - Kp);
        if (q > 0) db = w * beta * q * (lq(n, j) - lm(0, j) - Kq);
      }
      g.ds(n, j) = da / T;
      g.du(n, j) = db / T;
    }
  }
  return g;
}

// The naive gradients of the head parameters: z = x Y^T + bias, dz -> dx = dz Y, dY = dz^T x,
// dbias = column sums of dz.
struct HeadGradients {
  Matrix dx, dY, dbias;
};

HeadGradients head_gradients(const Matrix& dz, const Matrix& x, const Matrix& Y) {
  return {dz * Y, dz.transpose() * x, dz.colwise().sum().transpose()};
}

// Every entry of got within factor * (the largest |entry| of want) of want: a bound scaled to the
// gradient's magnitude. want must not be (nearly) zero, else the check would be vacuous.
template <typename A>
void require_close_scaled(const A& got, const Matrix& want, double factor) {
  const double scale = want.cwiseAbs().maxCoeff();
  REQUIRE(scale > 1e-4);
  require_close(got, want, 0.0, factor * scale);
}

// x rounded to float and back: the inputs a float computation sees, for its double reference.
Matrix float_rounded(const Matrix& x) { return x.cast<float>().cast<double>(); }

const char* reduction_name(Reduction r) { return r == Reduction::mean ? "mean" : r == Reduction::sum ? "sum" : "none"; }

}  // namespace

TEST_CASE("distillation: a worked example", "[distillation]") {
  // s = [1, 0], q = [1/2, 1/2]: p = [e / (1 + e), 1 / (1 + e)].
  const RowMatrix<double> h = RowMatrix<double>::Constant(1, 1, 1.0);
  RowMatrix<double> W(2, 1);
  W << 1.0, 0.0;
  const RowMatrix<double> logq = RowMatrix<double>::Constant(1, 2, std::log(0.5));
  DistillationWorkspace<double> ws;
  RowMatrix<double> dh(1, 1), dW = RowMatrix<double>::Zero(2, 1);
  SECTION("forward KL: 1/2 log(1/2 / p_0) + 1/2 log(1/2 / p_1); dz = p - q") {
    const DistillationResult r = embedhead::distill_logprobs_forward_backward<double>(h, W, empty<double>(), logq, dh,
                                                                                      dW, empty<double>(), ws);
    REQUIRE_THAT(r.loss, WithinRel(0.12011450695827758, 1e-14));
    REQUIRE(r.count == 1);
    REQUIRE_THAT(dh(0, 0), WithinRel(0.2310585786300049, 1e-13));  // dz W = dz_0
    REQUIRE_THAT(dW(0, 0), WithinRel(0.2310585786300049, 1e-13));
    REQUIRE_THAT(dW(1, 0), WithinRel(-0.2310585786300049, 1e-13));
  }
  SECTION("reverse KL: p_0 log(2 p_0) + p_1 log(2 p_1); dz = p (log p - log q - K)") {
    DistillationOptions o;
    o.divergence = Divergence::reverse_kl;
    const DistillationResult r = embedhead::distill_logprobs_forward_backward<double>(h, W, empty<double>(), logq, dh,
                                                                                      dW, empty<double>(), ws, o);
    REQUIRE_THAT(r.loss, WithinRel(0.11094407167172735, 1e-14));
    REQUIRE_THAT(dW(0, 0), WithinRel(0.19661193324148185, 1e-13));
    REQUIRE_THAT(dW(1, 0), WithinRel(-0.19661193324148188, 1e-13));
  }
  SECTION("temperature 2 on forward KL: T^2 KL(q || softmax(s / 2))") {
    DistillationOptions o;
    o.temperature = 2.0;
    const DistillationResult r = embedhead::distill_logprobs<double>(h, W, empty<double>(), logq, ws, o);
    const double p0 = 1 / (1 + std::exp(-0.5)), p1 = 1 - p0;
    REQUIRE_THAT(r.loss, WithinRel(4 * (0.5 * std::log(0.5 / p0) + 0.5 * std::log(0.5 / p1)), 1e-14));
  }
}

TEMPLATE_TEST_CASE("distillation: teacher head, dense and top-k log-probs against the naive reference",
                   "[distillation]", float, double) {
  using Scalar = TestType;
  const bool is_float = std::is_same_v<Scalar, float>;
  const double rel = is_float ? 2e-4 : 1e-10, abs = is_float ? 2e-5 : 1e-12;
  Problem P;
  P.add_biases();
  const RowMatrix<Scalar> h = cast<Scalar>(P.h), W = cast<Scalar>(P.W), hT = cast<Scalar>(P.hT),
                          WT = cast<Scalar>(P.WT), b = cast<Scalar>(P.b), bT = cast<Scalar>(P.bT);
  // Cached teacher log-probs at T = 1 (the temperature applies to them as to logits).
  const Matrix teacher_logprobs = log_softmax(P.u(), 1.0);
  const RowMatrix<Scalar> logq = cast<Scalar>(teacher_logprobs);
  const RowMatrix<Scalar> mask = P.mask_matrix<Scalar>();
  DistillationWorkspace<Scalar> ws;
  for (const Reduction reduction : {Reduction::mean, Reduction::sum, Reduction::none}) {
    for (const DistillationOptions& o0 : all_options())
      for (DistillationOptions o : with_plans<Scalar>(o0, P.V)) {
        o.reduction = reduction;
        INFO(describe(o) << " reduction " << static_cast<int>(reduction));
        std::vector<double> rows;
        const double want = naive_loss(P.s(), P.u(), P.mask, o, &rows);
        RowMatrix<Scalar> losses = RowMatrix<Scalar>::Constant(P.N, 1, Scalar(-7));
        const DistillationExtras<Scalar> extras{{mask.data(), P.N, 1}, {losses.data(), P.N, 1}};
        RowMatrix<Scalar> dh1(P.N, P.d), dW1 = RowMatrix<Scalar>::Zero(P.V, P.d), dhT(P.N, P.dT),
                                         dWT = RowMatrix<Scalar>::Zero(P.V, P.dT),
                                         db1 = RowMatrix<Scalar>::Zero(P.V, 1), dbT = RowMatrix<Scalar>::Zero(P.V, 1);
        const DistillationResult head = embedhead::distill_head_forward_backward<Scalar>(h, W, b, hT, WT, bT, dh1, dW1,
                                                                                         db1, dhT, dWT, dbT, ws, o,
                                                                                         extras);
        REQUIRE_THAT(head.loss, WithinRel(want, rel) || WithinAbs(want, abs));
        REQUIRE(head.count == 5);
        for (Index n = 0; n < P.N; ++n)
          REQUIRE_THAT(static_cast<double>(losses(n, 0)), WithinRel(rows[static_cast<std::size_t>(n)], rel) ||
                                                              WithinAbs(rows[static_cast<std::size_t>(n)], abs));
        // The loss alone is the same.
        REQUIRE_THAT(embedhead::distill_head<Scalar>(h, W, b, hT, WT, bT, ws, o, extras).loss,
                     WithinRel(head.loss, 1e-12) || WithinAbs(head.loss, 1e-15));
        // Cached dense log-probs: the same loss and student gradients.
        RowMatrix<Scalar> dh2(P.N, P.d), dW2 = RowMatrix<Scalar>::Zero(P.V, P.d), db2 = RowMatrix<Scalar>::Zero(P.V, 1);
        const DistillationResult dense = embedhead::distill_logprobs_forward_backward<Scalar>(h, W, b, logq, dh2, dW2,
                                                                                              db2, ws, o, extras);
        REQUIRE_THAT(dense.loss, WithinRel(want, rel) || WithinAbs(want, abs));
        require_close(dh2, dh1, rel, abs);
        require_close(dW2, dW1, rel, abs);
        require_close(db2, db1, rel, abs);
        REQUIRE(db1.norm() > 1e-3);
        REQUIRE_THAT(embedhead::distill_logprobs<Scalar>(h, W, b, logq, ws, o, extras).loss,
                     WithinRel(dense.loss, 1e-12) || WithinAbs(dense.loss, 1e-15));
        // Masked rows: no loss, zero gradient (student and teacher).
        for (Index n : {2, 5}) {
          REQUIRE(losses(n, 0) == Scalar(0));
          REQUIRE(dh1.row(n).isZero(0));
          REQUIRE(dh2.row(n).isZero(0));
          REQUIRE(dhT.row(n).isZero(0));
        }
      }
  }
  SECTION("top-k: forward KL over the renormalised support") {
    const Index k = 6;
    IdMatrix<std::int32_t> ids(P.N, k);
    RowMatrix<Scalar> top(P.N, k);
    Matrix u_top = Matrix::Constant(P.N, P.V, -INFINITY);
    for (Index n = 0; n < P.N; ++n)
      for (Index i = 0; i < k; ++i) {
        const Index id = (7 * n + 9 * i + 3) % P.V;  // distinct for i < k
        ids(n, i) = static_cast<std::int32_t>(id);
        top(n, i) = static_cast<Scalar>(teacher_logprobs(n, id));
        u_top(n, id) = static_cast<double>(top(n, i));
      }
    for (const double T : {1.0, 3.0}) {
      const DistillationOptions o = make_options(Divergence::forward_kl, T);
      INFO("T = " << T);
      const double want = naive_loss(P.s(), u_top, P.mask, o);
      const DistillationExtras<Scalar> extras{{mask.data(), P.N, 1}};
      RowMatrix<Scalar> dh(P.N, P.d), dW = RowMatrix<Scalar>::Zero(P.V, P.d);
      const DistillationResult r = embedhead::distill_topk_forward_backward<Scalar>(h, W, b,
                                                                                    TeacherTopK<Scalar>{ids, top}, dh,
                                                                                    dW, empty<Scalar>(), ws, o, extras);
      REQUIRE_THAT(r.loss, WithinRel(want, rel) || WithinAbs(want, abs));
      REQUIRE(r.loss > 0.01);  // the support is not the whole vocabulary: far from the dense loss's 0
      // The same as dense log-probs of the renormalised support (-inf elsewhere).
      const RowMatrix<Scalar> logq_top = cast<Scalar>(log_softmax(u_top, 1.0));
      RowMatrix<Scalar> dh2(P.N, P.d), dW2 = RowMatrix<Scalar>::Zero(P.V, P.d);
      embedhead::distill_logprobs_forward_backward<Scalar>(h, W, b, logq_top, dh2, dW2, empty<Scalar>(), ws, o, extras);
      require_close(dh, dh2, rel, abs);
      require_close(dW, dW2, rel, abs);
    }
  }
}

TEST_CASE("distillation: gradients against central differences in double", "[distillation]") {
  Problem P;
  P.N = 4, P.d = 3, P.dT = 2, P.V = 37;
  P.mask = {1, 0, 1, 1};
  P.h = random_matrix<double>(P.N, P.d, 21, 1.0);
  P.W = random_matrix<double>(P.V, P.d, 22, 1.5);
  P.hT = random_matrix<double>(P.N, P.dT, 23, 1.0);
  P.WT = random_matrix<double>(P.V, P.dT, 24, 2.0);
  P.add_biases();
  const RowMatrix<double> mask = P.mask_matrix<double>();
  const DistillationExtras<double> extras{{mask.data(), P.N, 1}};
  DistillationWorkspace<double> ws;
  for (const DistillationOptions& o0 : all_options())
    for (const DistillationOptions& o : with_plans<double>(o0, P.V)) {
      INFO(describe(o));
      auto loss = [&] { return naive_loss(P.s(), P.u(), P.mask, o); };
      RowMatrix<double> dh(P.N, P.d), dW = RowMatrix<double>::Zero(P.V, P.d), dhT(P.N, P.dT),
                                      dWT = RowMatrix<double>::Zero(P.V, P.dT), db = RowMatrix<double>::Zero(P.V, 1),
                                      dbT = RowMatrix<double>::Zero(P.V, 1);
      embedhead::distill_head_forward_backward<double>(P.h, P.W, P.b, P.hT, P.WT, P.bT, dh, dW, db, dhT, dWT, dbT, ws,
                                                       o, extras);
      require_close(db, central_differences(P.b, loss), 1e-7, 1e-9);
      require_close(dbT, central_differences(P.bT, loss), 1e-7, 1e-9);
      require_close(dh, central_differences(P.h, loss), 1e-7, 1e-9);
      require_close(dW, central_differences(P.W, loss), 1e-7, 1e-9);
      require_close(dhT, central_differences(P.hT, loss), 1e-7, 1e-9);
      require_close(dWT, central_differences(P.WT, loss), 1e-7, 1e-9);
      REQUIRE(dhT.norm() > 1e-3);  // the teacher's gradient is not trivially 0
      // Without the teacher's gradients the student's are the same.
      RowMatrix<double> dh2(P.N, P.d), dW2 = RowMatrix<double>::Zero(P.V, P.d), none(0, 0);
      embedhead::distill_head_forward_backward<double>(P.h, P.W, P.b, P.hT, P.WT, P.bT, dh2, dW2, none, none, none,
                                                       none, ws, o, extras);
      require_close(dh2, dh, 1e-12, 1e-15);
      require_close(dW2, dW, 1e-12, 1e-15);
    }
  SECTION("dW accumulates") {
    const DistillationOptions o = make_options(Divergence::reverse_kl, 1.3);
    RowMatrix<double> dh(P.N, P.d), dW = RowMatrix<double>::Zero(P.V, P.d), none(0, 0);
    embedhead::distill_head_forward_backward<double>(P.h, P.W, empty<double>(), P.hT, P.WT, empty<double>(), dh, dW,
                                                     empty<double>(), none, none, empty<double>(), ws, o, extras);
    RowMatrix<double> twice = dW;
    embedhead::distill_head_forward_backward<double>(P.h, P.W, empty<double>(), P.hT, P.WT, empty<double>(), dh, twice,
                                                     empty<double>(), none, none, empty<double>(), ws, o, extras);
    require_close(twice, 2 * dW, 1e-14, 1e-16);
  }
}

TEST_CASE("distillation: jsd at beta 0 and 1 is the KLs without T^2; top-k with k = V is dense; any block",
          "[distillation]") {
  const Problem P;
  const RowMatrix<double> logq = log_softmax(P.u(), 1.0);
  DistillationWorkspace<double> ws;
  const double T = 1.7;
  auto loss = [&](const DistillationOptions& o) {
    return embedhead::distill_logprobs<double>(P.h, P.W, empty<double>(), logq, ws, o).loss;
  };
  const double forward = loss(make_options(Divergence::forward_kl, T));
  const double reverse = loss(make_options(Divergence::reverse_kl, T));
  REQUIRE(std::abs(forward - reverse) > 1e-3);
  REQUIRE_THAT(loss(make_options(Divergence::jsd, T, 0.0)), WithinRel(forward / (T * T), 1e-14));
  REQUIRE_THAT(loss(make_options(Divergence::jsd, T, 1.0)), WithinRel(reverse / (T * T), 1e-14));
  // Near the ends the jsd tends to 0, not to the KLs (TRL's special cases are discontinuous).
  REQUIRE(loss(make_options(Divergence::jsd, T, 1e-9)) < 1e-6);
  // Top-k with every class: the dense loss and gradients.
  IdMatrix<std::int64_t> ids(P.N, P.V);
  RowMatrix<double> top(P.N, P.V);
  for (Index n = 0; n < P.N; ++n)
    for (Index i = 0; i < P.V; ++i) ids(n, i) = (i * 5 + n) % P.V, top(n, i) = logq(n, (i * 5 + n) % P.V);
  const DistillationOptions o = make_options(Divergence::forward_kl, T);
  RowMatrix<double> dh(P.N, P.d), dW = RowMatrix<double>::Zero(P.V, P.d), dh2(P.N, P.d),
                                  dW2 = RowMatrix<double>::Zero(P.V, P.d);
  const double dense = embedhead::distill_logprobs_forward_backward<double>(P.h, P.W, empty<double>(), logq, dh, dW,
                                                                            empty<double>(), ws, o)
                           .loss;
  const double topk = embedhead::distill_topk_forward_backward<double>(P.h, P.W, empty<double>(),
                                                                       TeacherTopK<double>{ids, top}, dh2, dW2,
                                                                       empty<double>(), ws, o)
                          .loss;
  REQUIRE_THAT(topk, WithinRel(dense, 1e-12));
  require_close(dh2, dh, 1e-11, 1e-14);
  require_close(dW2, dW, 1e-11, 1e-14);
  // The block size changes the order of the sums only.
  for (const Index block : {Index(0), Index(1), Index(7), P.V, Index(1000)}) {
    DistillationOptions b = make_options(Divergence::reverse_kl, T);
    b.vocab_block = block;
    RowMatrix<double> dh3(P.N, P.d), dW3 = RowMatrix<double>::Zero(P.V, P.d), none(0, 0);
    const double r = embedhead::distill_head_forward_backward<double>(P.h, P.W, empty<double>(), P.hT, P.WT,
                                                                      empty<double>(), dh3, dW3, empty<double>(), none,
                                                                      none, empty<double>(), ws, b)
                         .loss;
    REQUIRE_THAT(r, WithinRel(naive_loss(P.s(), P.u(), {}, b), 1e-12));
  }
}

TEMPLATE_TEST_CASE("distillation: token chunks and vocabulary blocks give the same loss bits, gradients to rounding",
                   "[distillation]", float, double) {
  // Both plans sum each row's statistics over the same blocks of columns in the same order, from the same logits (the
  // packed kernel's logits of a row do not depend on the rows beside it): the same loss and per-row losses, bit for
  // bit, on the default backend. dh and dW sum over the vocabulary and the tokens in other groupings: to rounding.
  using Scalar = TestType;
  const double tol = std::is_same_v<Scalar, float> ? 1e-5 : 1e-13;
  Problem P;
  P.add_biases();
  const RowMatrix<Scalar> h = cast<Scalar>(P.h), W = cast<Scalar>(P.W), hT = cast<Scalar>(P.hT),
                          WT = cast<Scalar>(P.WT), b = cast<Scalar>(P.b), bT = cast<Scalar>(P.bT);
  const RowMatrix<Scalar> logq = cast<Scalar>(log_softmax(P.u(), 1.0));
  const RowMatrix<Scalar> mask = P.mask_matrix<Scalar>();
  DistillationWorkspace<Scalar> ws;
  struct Outputs {
    DistillationResult r;
    RowMatrix<Scalar> losses, dh, dW, db, dhT, dWT, dbT;
  };
  for (const DistillationOptions& o0 : all_options()) {
    for (const int teacher : {0, 1}) {  // 0: a teacher head with its gradients; 1: cached dense log-probs
      std::vector<Outputs> outs;
      for (const DistillationOptions& o : with_plans<Scalar>(o0, P.V)) {
        Outputs out;
        out.losses = RowMatrix<Scalar>::Constant(P.N, 1, Scalar(-7));
        out.dh = RowMatrix<Scalar>::Constant(P.N, P.d, Scalar(5));
        out.dW = RowMatrix<Scalar>::Zero(P.V, P.d);
        out.db = RowMatrix<Scalar>::Zero(P.V, 1);
        out.dhT = RowMatrix<Scalar>::Constant(P.N, P.dT, Scalar(5));
        out.dWT = RowMatrix<Scalar>::Zero(P.V, P.dT);
        out.dbT = RowMatrix<Scalar>::Zero(P.V, 1);
        const DistillationExtras<Scalar> extras{{mask.data(), P.N, 1}, {out.losses.data(), P.N, 1}};
        out.r = teacher == 0
                    ? embedhead::distill_head_forward_backward<Scalar>(h, W, b, hT, WT, bT, out.dh, out.dW, out.db,
                                                                       out.dhT, out.dWT, out.dbT, ws, o, extras)
                    : embedhead::distill_logprobs_forward_backward<Scalar>(h, W, b, logq, out.dh, out.dW, out.db, ws, o,
                                                                           extras);
        // The loss alone walks the same way.
        const DistillationResult alone = teacher == 0
                                             ? embedhead::distill_head<Scalar>(h, W, b, hT, WT, bT, ws, o, extras)
                                             : embedhead::distill_logprobs<Scalar>(h, W, b, logq, ws, o, extras);
        REQUIRE(alone.loss == out.r.loss);
        outs.push_back(out);
      }
      for (std::size_t i = 1; i < outs.size(); ++i) {
        INFO(describe(o0) << " teacher " << teacher << " plan " << i << " against vocab_blocks");
        if constexpr (embedhead::detail::gemm::DefaultBackend::any_chunking) {
          REQUIRE(outs[i].r.loss == outs[0].r.loss);
          REQUIRE(outs[i].losses == outs[0].losses);
        } else {
          REQUIRE_THAT(outs[i].r.loss, WithinRel(outs[0].r.loss, tol));
        }
        REQUIRE(outs[i].r.count == outs[0].r.count);
        require_close(outs[i].dh, outs[0].dh, tol, tol);
        require_close(outs[i].dW, outs[0].dW, tol, tol);
        require_close(outs[i].db, outs[0].db, tol, tol);
        if (teacher == 0) {
          require_close(outs[i].dhT, outs[0].dhT, tol, tol);
          require_close(outs[i].dWT, outs[0].dWT, tol, tol);
          require_close(outs[i].dbT, outs[0].dbT, tol, tol);
        }
      }
    }
  }
}

TEST_CASE("distillation: every row masked gives 0 and zero gradients", "[distillation]") {
  const Problem P;
  const RowMatrix<double> mask = RowMatrix<double>::Zero(P.N, 1);
  DistillationWorkspace<double> ws;
  RowMatrix<double> dh = RowMatrix<double>::Constant(P.N, P.d, 3.0), dW = RowMatrix<double>::Zero(P.V, P.d);
  const RowMatrix<double> logq = log_softmax(P.u(), 1.0);
  const DistillationResult r = embedhead::distill_logprobs_forward_backward<double>(
      P.h, P.W, empty<double>(), logq, dh, dW, empty<double>(), ws, DistillationOptions{},
      DistillationExtras<double>{{mask.data(), P.N, 1}});
  REQUIRE(r.count == 0);
  REQUIRE(r.loss == 0);
  REQUIRE(dh.isZero(0));
  REQUIRE(dW.isZero(0));
}

TEMPLATE_TEST_CASE("distillation: bad input throws and changes nothing", "[distillation][errors]", float, double) {
  using Scalar = TestType;
  const Problem P;
  const RowMatrix<Scalar> h = cast<Scalar>(P.h), W = cast<Scalar>(P.W), hT = cast<Scalar>(P.hT),
                          WT = cast<Scalar>(P.WT);
  RowMatrix<Scalar> logq = cast<Scalar>(log_softmax(P.u(), 1.0));
  DistillationWorkspace<Scalar> ws;
  const Scalar sentinel = Scalar(-123.5);
  RowMatrix<Scalar> dh = RowMatrix<Scalar>::Constant(P.N, P.d, sentinel),
                    dW = RowMatrix<Scalar>::Constant(P.V, P.d, sentinel),
                    dhT = RowMatrix<Scalar>::Constant(P.N, P.dT, sentinel),
                    dWT = RowMatrix<Scalar>::Constant(P.V, P.dT, sentinel),
                    losses = RowMatrix<Scalar>::Constant(P.N, 1, sentinel);
  const DistillationExtras<Scalar> extras{{nullptr, 0, 1}, {losses.data(), P.N, 1}};
  auto unchanged = [&] {
    REQUIRE((dh.array() == sentinel).all());
    REQUIRE((dW.array() == sentinel).all());
    REQUIRE((dhT.array() == sentinel).all());
    REQUIRE((dWT.array() == sentinel).all());
    REQUIRE((losses.array() == sentinel).all());
  };
  auto head = [&](const DistillationOptions& o, const RowMatrix<Scalar>& h_T, const RowMatrix<Scalar>& W_T) {
    return embedhead::distill_head_forward_backward<Scalar>(h, W, empty<Scalar>(), h_T, W_T, empty<Scalar>(), dh, dW,
                                                            empty<Scalar>(), dhT, dWT, empty<Scalar>(), ws, o, extras);
  };
  auto dense = [&](const DistillationOptions& o, const RowMatrix<Scalar>& q) {
    return embedhead::distill_logprobs_forward_backward<Scalar>(h, W, empty<Scalar>(), q, dh, dW, empty<Scalar>(), ws,
                                                                o, extras);
  };
  SECTION("temperature <= 0, NaN or inf") {
    for (const double T : {0.0, -1.0, std::nan(""), double(INFINITY)}) {
      DistillationOptions o;
      o.temperature = T;
      REQUIRE_THROWS_AS(head(o, hT, WT), embedhead::value_error);
      REQUIRE_THROWS_WITH(dense(o, logq), Contains("distill_logprobs_forward_backward: temperature = ") &&
                                              Contains("outside (0, inf)"));
      unchanged();
    }
    DistillationOptions o;
    o.temperature = -1;
    REQUIRE_THROWS_WITH(head(o, hT, WT), Contains("distill_head_forward_backward: temperature = -1 outside (0, inf)"));
    if constexpr (std::is_same_v<Scalar, float>) {
      o.temperature = 1e-39;  // 1 / T = 1e39 is inf in float
      REQUIRE_THROWS_WITH(dense(o, logq), Contains("1 / temperature = 1e+39 outside (0, inf) in float"));
      o.temperature = 1e39;
      REQUIRE_THROWS_WITH(dense(o, logq), Contains("temperature = 1e+39 outside (0, inf) in float"));
      unchanged();
    }
  }
  SECTION("beta outside [0, 1] or NaN") {
    for (const double beta : {-0.1, 1.5, std::nan("")}) {
      const DistillationOptions o = make_options(Divergence::jsd, 1.0, beta);
      REQUIRE_THROWS_AS(dense(o, logq), embedhead::value_error);
      REQUIRE_THROWS_WITH(head(o, hT, WT), Contains("beta = ") && Contains("outside [0, 1]"));
      unchanged();
    }
  }
  SECTION("teacher shapes that disagree") {
    const RowMatrix<Scalar> WT_short = WT.topRows(P.V - 1), hT_short = hT.topRows(P.N - 1),
                            hT_wide = RowMatrix<Scalar>::Zero(P.N, P.dT + 1);
    REQUIRE_THROWS_AS(head(DistillationOptions{}, hT, WT_short), embedhead::shape_error);
    REQUIRE_THROWS_WITH(head(DistillationOptions{}, hT, WT_short), Contains("teacher W_T has shape [52, 4]"));
    REQUIRE_THROWS_WITH(head(DistillationOptions{}, hT_short, WT), Contains("teacher h_T has shape [6, 4]"));
    REQUIRE_THROWS_WITH(head(DistillationOptions{}, hT_wide, WT), Contains("teacher h_T has shape [7, 5]"));
    const RowMatrix<Scalar> q_short = logq.leftCols(P.V - 1);
    REQUIRE_THROWS_WITH(dense(DistillationOptions{}, q_short), Contains("teacher log-probs has shape [7, 52]"));
    RowMatrix<Scalar> dWT_bad = RowMatrix<Scalar>::Zero(P.V, P.dT + 1);
    REQUIRE_THROWS_WITH(embedhead::distill_head_forward_backward<Scalar>(h, W, empty<Scalar>(), hT, WT, empty<Scalar>(),
                                                                         dh, dW, empty<Scalar>(), dhT, dWT_bad,
                                                                         empty<Scalar>(), ws, DistillationOptions{},
                                                                         extras),
                        Contains("dW_T has shape"));
    // Biases and their gradients: [V, 1].
    const RowMatrix<Scalar> b_short = RowMatrix<Scalar>::Zero(P.V - 1, 1), b = RowMatrix<Scalar>::Zero(P.V, 1);
    RowMatrix<Scalar> db_bad = RowMatrix<Scalar>::Zero(P.V, 2);
    const DistillationOptions o;
    REQUIRE_THROWS_WITH(embedhead::distill_head_forward_backward<Scalar>(h, W, b_short, hT, WT, b, dh, dW,
                                                                         empty<Scalar>(), dhT, dWT, empty<Scalar>(), ws,
                                                                         o, extras),
                        Contains("distill_head_forward_backward: bias has shape [52, 1], expected [53, 1]"));
    REQUIRE_THROWS_WITH(embedhead::distill_head_forward_backward<Scalar>(h, W, b, hT, WT, b_short, dh, dW,
                                                                         empty<Scalar>(), dhT, dWT, empty<Scalar>(), ws,
                                                                         o, extras),
                        Contains("teacher bias_T has shape [52, 1], expected [53, 1]"));
    REQUIRE_THROWS_WITH(embedhead::distill_head_forward_backward<Scalar>(h, W, b, hT, WT, b, dh, dW, empty<Scalar>(),
                                                                         dhT, dWT, db_bad, ws, o, extras),
                        Contains("db_T has shape [53, 2], expected [53, 1]"));
    REQUIRE_THROWS_WITH(embedhead::distill_logprobs_forward_backward<Scalar>(h, W, b, logq, dh, dW, db_bad, ws, o,
                                                                             extras),
                        Contains("distill_logprobs_forward_backward: db has shape [53, 2], expected [53, 1]"));
    REQUIRE((db_bad.array() == 0).all());
    unchanged();
  }
  SECTION("mask values other than 0 and 1") {
    RowMatrix<Scalar> mask = RowMatrix<Scalar>::Ones(P.N, 1);
    mask(3, 0) = Scalar(0.5);
    const DistillationExtras<Scalar> bad{{mask.data(), P.N, 1}, {losses.data(), P.N, 1}};
    REQUIRE_THROWS_WITH(embedhead::distill_logprobs_forward_backward<Scalar>(h, W, empty<Scalar>(), logq, dh, dW,
                                                                             empty<Scalar>(), ws, {}, bad),
                        Contains("mask 0.5 at n=3 outside {0, 1}"));
    unchanged();
  }
  SECTION("log-prob rows that do not normalise or hold NaN / +inf") {
    RowMatrix<Scalar> q = logq;
    q.row(4).array() += Scalar(0.1);
    REQUIRE_THROWS_WITH(dense({}, q), Contains("teacher log-probs at n=4 have log sum exp = ") &&
                                          Contains("outside [-0.001, 0.001]"));
    q = logq;
    q(2, 7) = std::numeric_limits<Scalar>::quiet_NaN();
    REQUIRE_THROWS_WITH(dense({}, q), Contains("teacher log-probs nan at n=2, column 7"));
    q(2, 7) = std::numeric_limits<Scalar>::infinity();
    REQUIRE_THROWS_WITH(dense({}, q), Contains("teacher log-probs inf at n=2, column 7"));
    unchanged();
    // A class of probability 0 (-inf, the row renormalised): reverse KL and jsd at beta = 1 refuse
    // it (+inf), forward KL and jsd below 1 take it.
    q = logq;
    q(2, 7) = -std::numeric_limits<Scalar>::infinity();
    double mass = 0;
    for (Index j = 0; j < P.V; ++j) mass += std::exp(static_cast<double>(q(2, j)));
    q.row(2).array() -= static_cast<Scalar>(std::log(mass));
    DistillationOptions reverse;
    reverse.divergence = embedhead::Divergence::reverse_kl;
    REQUIRE_THROWS_WITH(dense(reverse, q), Contains("teacher log-probs -inf at n=2, column 7: reverse_kl"));
    DistillationOptions jsd_one;
    jsd_one.divergence = embedhead::Divergence::jsd;
    jsd_one.beta = 1.0;
    REQUIRE_THROWS_WITH(dense(jsd_one, q), Contains("teacher log-probs -inf at n=2, column 7"));
    unchanged();
    {
      RowMatrix<Scalar> dh3(P.N, P.d), dW3 = RowMatrix<Scalar>::Zero(P.V, P.d);
      DistillationOptions jsd_half = jsd_one;
      jsd_half.beta = 0.5;
      for (const DistillationOptions& o : {DistillationOptions{}, jsd_half}) {
        const auto r = embedhead::distill_logprobs_forward_backward<Scalar>(h, W, empty<Scalar>(), q, dh3, dW3,
                                                                            empty<Scalar>(), ws, o);
        REQUIRE(std::isfinite(r.loss));
        REQUIRE(dh3.allFinite());
        REQUIRE(dW3.allFinite());
      }
    }
    // A masked row is not read.
    RowMatrix<Scalar> mask = RowMatrix<Scalar>::Ones(P.N, 1);
    mask(2, 0) = 0;
    RowMatrix<Scalar> dh2(P.N, P.d), dW2 = RowMatrix<Scalar>::Zero(P.V, P.d);
    REQUIRE_NOTHROW(embedhead::distill_logprobs_forward_backward<Scalar>(h, W, empty<Scalar>(), q, dh2, dW2,
                                                                         empty<Scalar>(), ws, {},
                                                                         {{mask.data(), P.N, 1}}));
    REQUIRE(std::isfinite(dh2.norm()));
  }
  SECTION("top-k: k > V, ids out of range or repeated, bad log-probs, a divergence other than forward KL") {
    const Index k = 3;
    IdMatrix<std::int64_t> ids(P.N, k);
    RowMatrix<Scalar> top(P.N, k);
    for (Index n = 0; n < P.N; ++n)
      for (Index i = 0; i < k; ++i) ids(n, i) = n + 10 * i, top(n, i) = Scalar(std::log(0.25));
    auto run = [&](const IdMatrix<std::int64_t>& i, const RowMatrix<Scalar>& l, const DistillationOptions& o) {
      return embedhead::distill_topk_forward_backward<Scalar>(h, W, empty<Scalar>(), TeacherTopK<Scalar>{i, l}, dh, dW,
                                                              empty<Scalar>(), ws, o, extras);
    };
    REQUIRE_NOTHROW(embedhead::distill_topk<Scalar>(h, W, empty<Scalar>(), TeacherTopK<Scalar>{ids, top}, ws));
    IdMatrix<std::int64_t> bad = ids;
    bad(5, 1) = P.V;
    REQUIRE_THROWS_AS(run(bad, top, {}), embedhead::index_error);
    REQUIRE_THROWS_WITH(run(bad, top, {}), Contains("teacher top-k id 53 at n=5, column 1 outside [0, 53)"));
    bad(5, 1) = -1;
    REQUIRE_THROWS_WITH(run(bad, top, {}), Contains("teacher top-k id -1 at n=5, column 1 outside [0, 53)"));
    bad(5, 1) = bad(5, 2);
    REQUIRE_THROWS_WITH(run(bad, top, {}), Contains("teacher top-k id 25 repeated at n=5"));
    const IdMatrix<std::int64_t> wide = IdMatrix<std::int64_t>::Zero(P.N, P.V + 1);
    const RowMatrix<Scalar> wide_l = RowMatrix<Scalar>::Constant(P.N, P.V + 1, Scalar(-10));
    REQUIRE_THROWS_AS(run(wide, wide_l, {}), embedhead::shape_error);
    REQUIRE_THROWS_WITH(run(wide, wide_l, {}), Contains("k = 54 outside [1, 53]"));
    const IdMatrix<std::int64_t> ids_short = ids.leftCols(2);
    REQUIRE_THROWS_WITH(run(ids_short, top, {}), Contains("teacher top-k ids has shape [7, 2], expected [7, 3]"));
    RowMatrix<Scalar> heavy = top;
    heavy(1, 0) = Scalar(std::log(0.9));  // 0.9 + 0.25 + 0.25 > 1
    REQUIRE_THROWS_WITH(run(ids, heavy, {}), Contains("teacher top-k log-probs at n=1 have log sum exp"));
    REQUIRE_THROWS_WITH(run(ids, heavy, {}), Contains("outside (-inf, 0.001]"));
    RowMatrix<Scalar> empty_row = top;
    empty_row.row(6).setConstant(-std::numeric_limits<Scalar>::infinity());
    REQUIRE_THROWS_WITH(run(ids, empty_row, {}),
                        Contains("teacher top-k log-probs at n=6 have log sum exp = -inf outside (-inf, 0.001]"));
    heavy(1, 0) = std::numeric_limits<Scalar>::quiet_NaN();
    REQUIRE_THROWS_WITH(run(ids, heavy, {}), Contains("teacher top-k log-probs nan at n=1, column 0"));
    REQUIRE_THROWS_WITH(run(ids, top, make_options(Divergence::reverse_kl, 1.0)),
                        Contains("divergence reverse_kl outside {forward_kl}"));
    REQUIRE_THROWS_WITH(run(ids, top, make_options(Divergence::jsd, 1.0)), Contains("divergence jsd outside"));
    unchanged();
  }
  SECTION("student shapes and vocab_block") {
    RowMatrix<Scalar> dh_bad(P.N, P.d + 1);
    REQUIRE_THROWS_WITH(embedhead::distill_logprobs_forward_backward<Scalar>(h, W, empty<Scalar>(), logq, dh_bad, dW,
                                                                             empty<Scalar>(), ws, {}, extras),
                        Contains("dh has shape"));
    DistillationOptions o;
    o.vocab_block = -1;
    REQUIRE_THROWS_WITH(dense(o, logq), Contains("vocab_block = -1 outside [0, inf)"));
    unchanged();
  }
  SECTION("memory_budget") {
    DistillationOptions o;
    o.memory_budget = -1;
    REQUIRE_THROWS_WITH(dense(o, logq), Contains("memory_budget = -1 outside [0, inf)"));
    unchanged();
    // token_chunks must hold one token's logits of both models: 2 V scalars.
    const Index row = 2 * P.V * static_cast<Index>(sizeof(Scalar));
    o.plan = embedhead::FusedPlan::token_chunks;
    o.memory_budget = row - 1;
    REQUIRE_THROWS_WITH(dense(o, logq), Contains("memory_budget = " + std::to_string(row - 1) + " bytes outside [" +
                                                 std::to_string(row) + ", inf) for plan token_chunks"));
    unchanged();
    // automatic with the same budget: vocabulary blocks, no error.
    o.plan = embedhead::FusedPlan::automatic;
    REQUIRE_NOTHROW(embedhead::distill_logprobs<Scalar>(h, W, empty<Scalar>(), logq, ws, o));
  }
}

TEST_CASE("distillation: sum and none reductions against central differences in double", "[distillation]") {
  // The teacher-head path: every gradient (student and teacher) against central differences of
  // the naive loss, which for sum and none is the sum of the counted rows' losses (weight 1, not
  // 1 / count: with 4 counted rows a mean-scaled gradient would be 4 times too small).
  Problem P;
  P.N = 5, P.d = 4, P.dT = 3, P.V = 29;
  P.mask = {1, 1, 0, 1, 1};
  P.h = random_matrix<double>(P.N, P.d, 31, 1.0);
  P.W = random_matrix<double>(P.V, P.d, 32, 1.5);
  P.hT = random_matrix<double>(P.N, P.dT, 33, 1.0);
  P.WT = random_matrix<double>(P.V, P.dT, 34, 2.0);
  P.add_biases();
  const RowMatrix<double> mask = P.mask_matrix<double>();
  DistillationWorkspace<double> ws;
  const std::vector<DistillationOptions> options = {make_options(Divergence::forward_kl, 1.8),
                                                    make_options(Divergence::reverse_kl, 0.6),
                                                    make_options(Divergence::jsd, 1.5, 0.0),
                                                    make_options(Divergence::jsd, 2.0, 0.4),
                                                    make_options(Divergence::jsd, 0.8, 1.0)};
  for (const Reduction reduction : {Reduction::sum, Reduction::none}) {
    for (DistillationOptions o : options) {
      o.reduction = reduction;
      INFO(describe(o) << " reduction " << reduction_name(reduction));
      std::vector<double> rows;
      const double want = naive_loss(P.s(), P.u(), P.mask, o, &rows);
      RowMatrix<double> losses = RowMatrix<double>::Constant(P.N, 1, -7.0);
      // Per-row losses requested with reduction none only (sum: the mask alone).
      const DistillationExtras<double> extras = reduction == Reduction::none
                                                    ? DistillationExtras<double>{{mask.data(), P.N, 1},
                                                                                 {losses.data(), P.N, 1}}
                                                    : DistillationExtras<double>{{mask.data(), P.N, 1}};
      RowMatrix<double> dh(P.N, P.d), dW = RowMatrix<double>::Zero(P.V, P.d), db = RowMatrix<double>::Zero(P.V, 1),
                                      dhT(P.N, P.dT), dWT = RowMatrix<double>::Zero(P.V, P.dT),
                                      dbT = RowMatrix<double>::Zero(P.V, 1);
      const DistillationResult r = embedhead::distill_head_forward_backward<double>(P.h, P.W, P.b, P.hT, P.WT, P.bT, dh,
                                                                                    dW, db, dhT, dWT, dbT, ws, o,
                                                                                    extras);
      REQUIRE(r.count == 4);
      REQUIRE(want > 1e-3);
      REQUIRE_THAT(r.loss, WithinRel(want, 1e-12));
      REQUIRE_THAT(r.sum, WithinRel(want, 1e-12));
      if (reduction == Reduction::none) {
        // Each row's loss is the naive row's (0 masked), and the loss is their sum.
        double total = 0;
        for (Index n = 0; n < P.N; ++n) {
          INFO("row " << n);
          const double row = rows[static_cast<std::size_t>(n)];
          REQUIRE_THAT(losses(n, 0), WithinRel(row, 1e-12) || WithinAbs(row, 1e-15));
          total += losses(n, 0);
        }
        REQUIRE(losses(2, 0) == 0.0);
        REQUIRE(rows[0] > 1e-4);
        REQUIRE_THAT(r.loss, WithinRel(total, 1e-12));
      }
      auto loss = [&] { return naive_loss(P.s(), P.u(), P.mask, o); };
      const Matrix fd_h = central_differences(P.h, loss), fd_W = central_differences(P.W, loss),
                   fd_b = central_differences(P.b, loss), fd_hT = central_differences(P.hT, loss),
                   fd_WT = central_differences(P.WT, loss), fd_bT = central_differences(P.bT, loss);
      require_close(dh, fd_h, 1e-7, 1e-9);
      require_close(dW, fd_W, 1e-7, 1e-9);
      require_close(db, fd_b, 1e-7, 1e-9);
      require_close(dhT, fd_hT, 1e-7, 1e-9);
      require_close(dWT, fd_WT, 1e-7, 1e-9);
      require_close(dbT, fd_bT, 1e-7, 1e-9);
      REQUIRE(dW.norm() > 1e-3);
      REQUIRE(dhT.norm() > 1e-3);
      REQUIRE(dh.row(2).isZero(0));  // the masked row
      REQUIRE(dhT.row(2).isZero(0));
      // The analytic naive gradients (the float test's reference) agree with the differences too.
      const LogitGradients z = naive_logit_gradients(P.s(), P.u(), P.mask, o);
      const HeadGradients student = head_gradients(z.ds, P.h, P.W), teacher = head_gradients(z.du, P.hT, P.WT);
      require_close(student.dx, fd_h, 1e-7, 1e-9);
      require_close(student.dY, fd_W, 1e-7, 1e-9);
      require_close(student.dbias, fd_b, 1e-7, 1e-9);
      require_close(teacher.dx, fd_hT, 1e-7, 1e-9);
      require_close(teacher.dY, fd_WT, 1e-7, 1e-9);
      require_close(teacher.dbias, fd_bT, 1e-7, 1e-9);
    }
  }
}

TEST_CASE("distillation: cached dense and top-k log-probs, student gradients against central differences in double",
          "[distillation]") {
  Problem P;
  P.N = 5, P.d = 4, P.dT = 3, P.V = 31;
  P.mask = {1, 1, 1, 0, 1};
  P.h = random_matrix<double>(P.N, P.d, 41, 1.0);
  P.W = random_matrix<double>(P.V, P.d, 42, 1.5);
  P.hT = random_matrix<double>(P.N, P.dT, 43, 1.0);
  P.WT = random_matrix<double>(P.V, P.dT, 44, 2.0);
  P.add_biases();
  const RowMatrix<double> mask = P.mask_matrix<double>();
  DistillationWorkspace<double> ws;
  // Cached log-probs [N, V]; a second set with a class of probability 0 in row 1 (the row
  // renormalised), taken by forward KL and jsd below beta = 1.
  const Matrix logq = log_softmax(P.u(), 1.0);
  Matrix logq_zero = logq;
  logq_zero(1, 4) = -INFINITY;
  logq_zero = log_softmax(logq_zero, 1.0);
  REQUIRE(std::isinf(logq_zero(1, 4)));
  auto check = [&](const DistillationOptions& o, const DistillationResult& r, const Matrix& u,
                   const RowMatrix<double>& losses, const RowMatrix<double>& dh, const RowMatrix<double>& dW,
                   const RowMatrix<double>& db) {
    std::vector<double> rows;
    const double want = naive_loss(P.s(), u, P.mask, o, &rows);
    REQUIRE(r.count == 4);
    REQUIRE(want > 1e-3);
    REQUIRE_THAT(r.loss, WithinRel(want, 1e-12));
    if (o.reduction == Reduction::none)
      for (Index n = 0; n < P.N; ++n) {
        INFO("row " << n);
        const double row = rows[static_cast<std::size_t>(n)];
        REQUIRE_THAT(losses(n, 0), WithinRel(row, 1e-12) || WithinAbs(row, 1e-15));
      }
    auto loss = [&] { return naive_loss(P.s(), u, P.mask, o); };
    require_close(dh, central_differences(P.h, loss), 1e-7, 1e-9);
    require_close(dW, central_differences(P.W, loss), 1e-7, 1e-9);
    require_close(db, central_differences(P.b, loss), 1e-7, 1e-9);
    REQUIRE(dW.norm() > 1e-3);
    REQUIRE(db.norm() > 1e-4);
    REQUIRE(dh.row(3).isZero(0));
  };
  struct Case {
    DistillationOptions options;
    const Matrix* teacher;
  };
  for (const Reduction reduction : {Reduction::mean, Reduction::sum, Reduction::none}) {
    SECTION(std::string("dense log-probs, reduction ") + reduction_name(reduction)) {
      for (Case c :
           {Case{make_options(Divergence::forward_kl, 2.2), &logq},
            Case{make_options(Divergence::reverse_kl, 0.7), &logq},
            Case{make_options(Divergence::jsd, 1.4, 0.0), &logq}, Case{make_options(Divergence::jsd, 1.9, 0.4), &logq},
            Case{make_options(Divergence::jsd, 0.9, 1.0), &logq},
            Case{make_options(Divergence::forward_kl, 1.3), &logq_zero},
            Case{make_options(Divergence::jsd, 1.6, 0.4), &logq_zero}}) {
        DistillationOptions& o = c.options;
        o.reduction = reduction;
        INFO(describe(o) << (c.teacher == &logq_zero ? " with a class of probability 0" : ""));
        RowMatrix<double> losses = RowMatrix<double>::Constant(P.N, 1, -7.0);
        const DistillationExtras<double> extras{{mask.data(), P.N, 1}, {losses.data(), P.N, 1}};
        RowMatrix<double> dh(P.N, P.d), dW = RowMatrix<double>::Zero(P.V, P.d), db = RowMatrix<double>::Zero(P.V, 1);
        const DistillationResult r = embedhead::distill_logprobs_forward_backward<double>(P.h, P.W, P.b, *c.teacher, dh,
                                                                                          dW, db, ws, o, extras);
        check(o, r, *c.teacher, losses, dh, dW, db);
      }
    }
    SECTION(std::string("top-k log-probs, reduction ") + reduction_name(reduction)) {
      // q = softmax(l_k / T) on the k ids, 0 elsewhere: the naive loss of teacher logits l_k on the
      // ids and -inf elsewhere. The k log-probs sum to less than 1 (renormalised by the definition).
      const Index k = 5;
      IdMatrix<std::int64_t> ids(P.N, k);
      Matrix top(P.N, k);
      Matrix u_top = Matrix::Constant(P.N, P.V, -INFINITY);
      for (Index n = 0; n < P.N; ++n)
        for (Index i = 0; i < k; ++i) {
          const Index id = (11 * n + 6 * i + 2) % P.V;  // distinct for i < k
          ids(n, i) = id;
          top(n, i) = logq(n, id);
          u_top(n, id) = top(n, i);
        }
      for (const double T : {1.0, 2.6}) {
        DistillationOptions o = make_options(Divergence::forward_kl, T);
        o.reduction = reduction;
        INFO(describe(o));
        RowMatrix<double> losses = RowMatrix<double>::Constant(P.N, 1, -7.0);
        const DistillationExtras<double> extras{{mask.data(), P.N, 1}, {losses.data(), P.N, 1}};
        RowMatrix<double> dh(P.N, P.d), dW = RowMatrix<double>::Zero(P.V, P.d), db = RowMatrix<double>::Zero(P.V, 1);
        const DistillationResult r = embedhead::distill_topk_forward_backward<double>(P.h, P.W, P.b,
                                                                                      TeacherTopK<double>{ids, top}, dh,
                                                                                      dW, db, ws, o, extras);
        check(o, r, u_top, losses, dh, dW, db);
      }
    }
  }
}

TEST_CASE("distillation: float loss and gradients against the naive double reference", "[distillation]") {
  // Scalar = float on every path (teacher head, dense and top-k cached log-probs) against the
  // naive double reference of the same float-rounded inputs, gradients from the header's formulas
  // over the full logits (checked against central differences by the sum / none test above).
  // Tolerances: the loss and each row's loss relative 1e-5 (float logits and probabilities, sums in
  // double); each gradient entry within 3e-5 times the largest |entry| of its reference matrix.
  const double rel = 1e-5, grad = 3e-5;
  Problem P;
  P.N = 5, P.d = 5, P.dT = 4, P.V = 37;
  P.mask = {1, 0, 1, 1, 1};
  P.h = float_rounded(random_matrix<double>(P.N, P.d, 51, 1.0));
  P.W = float_rounded(random_matrix<double>(P.V, P.d, 52, 1.5));
  P.hT = float_rounded(random_matrix<double>(P.N, P.dT, 53, 1.0));
  P.WT = float_rounded(random_matrix<double>(P.V, P.dT, 54, 2.0));
  P.add_biases();
  P.b = float_rounded(P.b);
  P.bT = float_rounded(P.bT);
  const RowMatrix<float> h = cast<float>(P.h), W = cast<float>(P.W), hT = cast<float>(P.hT), WT = cast<float>(P.WT),
                         b = cast<float>(P.b), bT = cast<float>(P.bT), mask = P.mask_matrix<float>();
  const Matrix logq = float_rounded(log_softmax(P.u(), 1.0));
  const RowMatrix<float> logq_f = cast<float>(logq);
  DistillationWorkspace<float> ws;
  // The loss (and with reduction none each row's) against the naive reference.
  auto check_loss = [&](const DistillationOptions& o, const DistillationResult& r, const Matrix& u,
                        const RowMatrix<float>& losses) {
    std::vector<double> rows;
    const double want = naive_loss(P.s(), u, P.mask, o, &rows);
    REQUIRE(r.count == 4);
    REQUIRE(want > 1e-3);
    REQUIRE_THAT(r.loss, WithinRel(want, rel));
    if (o.reduction == Reduction::none)
      for (Index n = 0; n < P.N; ++n) {
        INFO("row " << n);
        const double row = rows[static_cast<std::size_t>(n)];
        REQUIRE_THAT(static_cast<double>(losses(n, 0)), WithinRel(row, rel) || WithinAbs(row, 0.0));
      }
  };
  for (const Reduction reduction : {Reduction::mean, Reduction::sum, Reduction::none}) {
    for (const DistillationOptions& o0 : all_options())
      for (DistillationOptions o : with_plans<float>(o0, P.V)) {
        o.reduction = reduction;
        INFO(describe(o) << " reduction " << reduction_name(reduction));
        const LogitGradients z = naive_logit_gradients(P.s(), P.u(), P.mask, o);
        const HeadGradients student = head_gradients(z.ds, P.h, P.W), teacher = head_gradients(z.du, P.hT, P.WT);
        RowMatrix<float> losses = RowMatrix<float>::Constant(P.N, 1, -7.0f);
        const DistillationExtras<float> extras{{mask.data(), P.N, 1}, {losses.data(), P.N, 1}};
        {
          INFO("teacher head");
          RowMatrix<float> dh(P.N, P.d), dW = RowMatrix<float>::Zero(P.V, P.d), db = RowMatrix<float>::Zero(P.V, 1),
                                         dhT(P.N, P.dT), dWT = RowMatrix<float>::Zero(P.V, P.dT),
                                         dbT = RowMatrix<float>::Zero(P.V, 1);
          const DistillationResult r = embedhead::distill_head_forward_backward<float>(h, W, b, hT, WT, bT, dh, dW, db,
                                                                                       dhT, dWT, dbT, ws, o, extras);
          check_loss(o, r, P.u(), losses);
          require_close_scaled(dh, student.dx, grad);
          require_close_scaled(dW, student.dY, grad);
          require_close_scaled(db, student.dbias, grad);
          require_close_scaled(dhT, teacher.dx, grad);
          require_close_scaled(dWT, teacher.dY, grad);
          require_close_scaled(dbT, teacher.dbias, grad);
        }
        {
          INFO("dense log-probs");
          // Cached log-probs are the teacher's logits: the same divergence as log_softmax(u).
          const LogitGradients zq = naive_logit_gradients(P.s(), logq, P.mask, o);
          const HeadGradients cached = head_gradients(zq.ds, P.h, P.W);
          RowMatrix<float> dh(P.N, P.d), dW = RowMatrix<float>::Zero(P.V, P.d), db = RowMatrix<float>::Zero(P.V, 1);
          const DistillationResult r = embedhead::distill_logprobs_forward_backward<float>(h, W, b, logq_f, dh, dW, db,
                                                                                           ws, o, extras);
          check_loss(o, r, logq, losses);
          require_close_scaled(dh, cached.dx, grad);
          require_close_scaled(dW, cached.dY, grad);
          require_close_scaled(db, cached.dbias, grad);
        }
      }
    {
      INFO("top-k log-probs, reduction " << reduction_name(reduction));
      const Index k = 6;
      IdMatrix<std::int32_t> ids(P.N, k);
      RowMatrix<float> top(P.N, k);
      Matrix u_top = Matrix::Constant(P.N, P.V, -INFINITY);
      for (Index n = 0; n < P.N; ++n)
        for (Index i = 0; i < k; ++i) {
          const Index id = (7 * n + 9 * i + 3) % P.V;  // distinct for i < k
          ids(n, i) = static_cast<std::int32_t>(id);
          top(n, i) = static_cast<float>(logq(n, id));
          u_top(n, id) = logq(n, id);
        }
      for (const double T : {1.0, 2.5}) {
        DistillationOptions o = make_options(Divergence::forward_kl, T);
        o.reduction = reduction;
        INFO(describe(o));
        const HeadGradients student = head_gradients(naive_logit_gradients(P.s(), u_top, P.mask, o).ds, P.h, P.W);
        RowMatrix<float> losses = RowMatrix<float>::Constant(P.N, 1, -7.0f);
        const DistillationExtras<float> extras{{mask.data(), P.N, 1}, {losses.data(), P.N, 1}};
        RowMatrix<float> dh(P.N, P.d), dW = RowMatrix<float>::Zero(P.V, P.d), db = RowMatrix<float>::Zero(P.V, 1);
        const DistillationResult r = embedhead::distill_topk_forward_backward<float>(h, W, b,
                                                                                     TeacherTopK<float>{ids, top}, dh,
                                                                                     dW, db, ws, o, extras);
        check_loss(o, r, u_top, losses);
        require_close_scaled(dh, student.dx, grad);
        require_close_scaled(dW, student.dY, grad);
        require_close_scaled(db, student.dbias, grad);
      }
    }
  }
}

namespace {

// Token chunks of `tokens` rows: a budget of that many tokens' logits of both models.
DistillationOptions chunked(DistillationOptions o, Index tokens, Index V) {
  o.plan = embedhead::FusedPlan::token_chunks;
  o.memory_budget = tokens * 2 * V * static_cast<Index>(sizeof(double));
  return o;
}

DistillationOptions blocked(DistillationOptions o) {
  o.plan = embedhead::FusedPlan::vocab_blocks;
  return o;
}

// The naive student (and teacher) gradients of the head for teacher logits u.
struct NaiveHead {
  double loss = 0;
  std::vector<double> rows;
  HeadGradients student, teacher;
};

NaiveHead naive_head(const Problem& P, const Matrix& u, const DistillationOptions& o) {
  NaiveHead out;
  out.loss = naive_loss(P.s(), u, P.mask, o, &out.rows);
  const LogitGradients g = naive_logit_gradients(P.s(), u, P.mask, o);
  out.student = head_gradients(g.ds, P.h, P.W);
  out.teacher = head_gradients(g.du, P.hT, P.WT);
  return out;
}

}  // namespace

TEST_CASE("distillation: token chunks of 1, 2, 3 and more tokens than N against the naive reference",
          "[distillation]") {
  // Rows r0 > 0 of every teacher (head with its gradients, dense and top-k log-probs), the last short chunk and a chunk
  // larger than N; dh written over a non-zero start, dW, db (dW_T, db_T) added to a non-zero start.
  Problem P;
  P.add_biases();
  const Matrix logq = log_softmax(P.u(), 1.0);
  const RowMatrix<double> mask = P.mask_matrix<double>();
  const Index k = 6;
  IdMatrix<std::int64_t> ids(P.N, k);
  Matrix top(P.N, k);
  Matrix u_top = Matrix::Constant(P.N, P.V, -INFINITY);
  for (Index n = 0; n < P.N; ++n)
    for (Index i = 0; i < k; ++i) {
      const Index id = (7 * n + 9 * i + 3) % P.V;
      ids(n, i) = id;
      top(n, i) = logq(n, id);
      u_top(n, id) = top(n, i);
    }
  DistillationWorkspace<double> ws;
  const double start = 0.25;
  for (const Index tokens : {Index(1), Index(2), Index(3), Index(10)})
    for (const Reduction reduction : {Reduction::mean, Reduction::sum, Reduction::none})
      for (const DistillationOptions& o0 : all_options()) {
        DistillationOptions o = chunked(o0, tokens, P.V);
        o.reduction = reduction;
        INFO(describe(o) << " reduction " << reduction_name(reduction));
        const NaiveHead want = naive_head(P, P.u(), o);
        RowMatrix<double> losses = RowMatrix<double>::Constant(P.N, 1, -7.0);
        const DistillationExtras<double> extras{{mask.data(), P.N, 1}, {losses.data(), P.N, 1}};
        RowMatrix<double> dh = RowMatrix<double>::Constant(P.N, P.d, 5.0),
                          dW = RowMatrix<double>::Constant(P.V, P.d, start),
                          db = RowMatrix<double>::Constant(P.V, 1, start),
                          dhT = RowMatrix<double>::Constant(P.N, P.dT, 5.0),
                          dWT = RowMatrix<double>::Constant(P.V, P.dT, start),
                          dbT = RowMatrix<double>::Constant(P.V, 1, start);
        const DistillationResult r = embedhead::distill_head_forward_backward<double>(P.h, P.W, P.b, P.hT, P.WT, P.bT,
                                                                                      dh, dW, db, dhT, dWT, dbT, ws, o,
                                                                                      extras);
        REQUIRE_THAT(r.loss, WithinRel(want.loss, 1e-11) || WithinAbs(want.loss, 1e-13));
        REQUIRE(r.count == 5);
        for (Index n = 0; n < P.N; ++n)
          REQUIRE_THAT(losses(n, 0), WithinRel(want.rows[static_cast<std::size_t>(n)], 1e-11) ||
                                         WithinAbs(want.rows[static_cast<std::size_t>(n)], 1e-13));
        require_close(dh, want.student.dx, 1e-10, 1e-13);
        require_close(dW.array() - start, want.student.dY, 1e-9, 1e-13);
        require_close(db.array() - start, want.student.dbias, 1e-9, 1e-13);
        require_close(dhT, want.teacher.dx, 1e-10, 1e-13);
        require_close(dWT.array() - start, want.teacher.dY, 1e-9, 1e-13);
        require_close(dbT.array() - start, want.teacher.dbias, 1e-9, 1e-13);
        // Dense cached log-probs, with what a masked row's log-probs may hold (never read): NaN and -inf.
        Matrix bad = logq;
        bad(2, 4) = std::nan("");
        bad.row(5).setConstant(-INFINITY);
        const NaiveHead want_dense = naive_head(P, logq, o);
        RowMatrix<double> dh2 = RowMatrix<double>::Constant(P.N, P.d, 5.0),
                          dW2 = RowMatrix<double>::Constant(P.V, P.d, start),
                          db2 = RowMatrix<double>::Constant(P.V, 1, start);
        const DistillationResult dense = embedhead::distill_logprobs_forward_backward<double>(P.h, P.W, P.b, bad, dh2,
                                                                                              dW2, db2, ws, o, extras);
        REQUIRE_THAT(dense.loss, WithinRel(want_dense.loss, 1e-11) || WithinAbs(want_dense.loss, 1e-13));
        require_close(dh2, want_dense.student.dx, 1e-10, 1e-13);
        require_close(dW2.array() - start, want_dense.student.dY, 1e-9, 1e-13);
        require_close(db2.array() - start, want_dense.student.dbias, 1e-9, 1e-13);
        if (o.divergence != Divergence::forward_kl) continue;
        // Top-k (forward KL only).
        const NaiveHead want_top = naive_head(P, u_top, o);
        RowMatrix<double> dh3 = RowMatrix<double>::Constant(P.N, P.d, 5.0),
                          dW3 = RowMatrix<double>::Constant(P.V, P.d, start),
                          db3 = RowMatrix<double>::Constant(P.V, 1, start);
        const DistillationResult topk = embedhead::distill_topk_forward_backward<double>(P.h, P.W, P.b,
                                                                                         TeacherTopK<double>{ids, top},
                                                                                         dh3, dW3, db3, ws, o, extras);
        REQUIRE_THAT(topk.loss, WithinRel(want_top.loss, 1e-11) || WithinAbs(want_top.loss, 1e-13));
        for (Index n = 0; n < P.N; ++n)
          REQUIRE_THAT(losses(n, 0), WithinRel(want_top.rows[static_cast<std::size_t>(n)], 1e-11) ||
                                         WithinAbs(want_top.rows[static_cast<std::size_t>(n)], 1e-13));
        require_close(dh3, want_top.student.dx, 1e-10, 1e-13);
        require_close(dW3.array() - start, want_top.student.dY, 1e-9, 1e-13);
        require_close(db3.array() - start, want_top.student.dbias, 1e-9, 1e-13);
      }
}

namespace {

// The teacher-head call on problem Q (P's inputs with garbage in the masked rows 2 and 5) under the
// block plan and token chunks of 2 and 3 for each divergence, against the naive reference on P's clean inputs: every
// output, dW and dW_T included.
void check_masked_garbage(const Problem& P, const Problem& Q) {
  const RowMatrix<double> mask = P.mask_matrix<double>();
  DistillationWorkspace<double> ws;
  for (const DistillationOptions& o0 : all_options())
    for (const DistillationOptions& o : {blocked(o0), chunked(o0, 2, P.V), chunked(o0, 3, P.V)}) {
      INFO(describe(o));
      const NaiveHead want = naive_head(P, P.u(), o);
      RowMatrix<double> losses = RowMatrix<double>::Constant(P.N, 1, -7.0);
      const DistillationExtras<double> extras{{mask.data(), P.N, 1}, {losses.data(), P.N, 1}};
      RowMatrix<double> dh(P.N, P.d), dW = RowMatrix<double>::Zero(P.V, P.d), db = RowMatrix<double>::Zero(P.V, 1),
                                      dhT(P.N, P.dT), dWT = RowMatrix<double>::Zero(P.V, P.dT),
                                      dbT = RowMatrix<double>::Zero(P.V, 1);
      const DistillationResult r = embedhead::distill_head_forward_backward<double>(Q.h, Q.W, Q.b, Q.hT, Q.WT, Q.bT, dh,
                                                                                    dW, db, dhT, dWT, dbT, ws, o,
                                                                                    extras);
      REQUIRE_THAT(r.loss, WithinRel(want.loss, 1e-11) || WithinAbs(want.loss, 1e-13));
      for (Index n = 0; n < P.N; ++n)
        REQUIRE_THAT(losses(n, 0), WithinRel(want.rows[static_cast<std::size_t>(n)], 1e-11) ||
                                       WithinAbs(want.rows[static_cast<std::size_t>(n)], 1e-13));
      require_close(dh, want.student.dx, 1e-10, 1e-13);
      require_close(db, want.student.dbias, 1e-9, 1e-13);
      require_close(dhT, want.teacher.dx, 1e-10, 1e-13);
      require_close(dbT, want.teacher.dbias, 1e-9, 1e-13);
      require_close(dW, want.student.dY, 1e-9, 1e-13);
      require_close(dWT, want.teacher.dY, 1e-9, 1e-13);
    }
}

}  // namespace

TEST_CASE("distillation: garbage in the masked rows' h and h_T reaches nothing, in either plan", "[distillation]") {
  // The masked rows take no part in any product (the counted rows of h and h_T are gathered first): finite garbage
  // (logits ~1e200), NaN and inf in them reach no loss and no gradient, dW and dW_T included (0 * NaN would).
  Problem P;
  P.add_biases();
  Problem huge = P;
  huge.h.row(2).setConstant(1e200);
  huge.h(5, 1) = -1e200;
  huge.hT.row(5).setConstant(1e200);
  huge.hT(2, 0) = -1e200;
  check_masked_garbage(P, huge);
  Problem bad = P;
  bad.h.row(2).setConstant(std::nan(""));
  bad.h(5, 1) = INFINITY;
  bad.hT.row(5).setConstant(std::nan(""));
  bad.hT(2, 0) = -INFINITY;
  check_masked_garbage(P, bad);
}

TEST_CASE("distillation: NaN in a masked row's h and h_T reaches neither dW nor dW_T (both plans)", "[distillation]") {
  // A masked row's dz is 0; were its h in dW's product, 0 * NaN would make dW NaN.
  Problem P;
  P.add_biases();
  Problem bad = P;
  bad.h.row(2).setConstant(std::nan(""));
  bad.hT.row(5).setConstant(std::nan(""));
  check_masked_garbage(P, bad);
}

TEST_CASE("distillation: a workspace reused across plans, sizes and masks", "[distillation]") {
  // Stale logits or gradients of a previous call (or chunk) in the buffers must not reach the next one.
  Problem P;
  const Matrix logq = log_softmax(P.u(), 1.0);
  DistillationWorkspace<double> ws;
  // A first call fills the buffers (larger N, no mask, token chunks of 4).
  {
    Problem big;
    big.N = 11;
    big.h = random_matrix<double>(big.N, big.d, 31, 3.0);
    big.hT = random_matrix<double>(big.N, big.dT, 32, 3.0);
    RowMatrix<double> dh(big.N, big.d), dW = RowMatrix<double>::Zero(big.V, big.d);
    const RowMatrix<double> none(0, 0);
    const Matrix big_logq = log_softmax(big.u(), 1.0);
    embedhead::distill_logprobs_forward_backward<double>(big.h, big.W, none, big_logq, dh, dW, empty<double>(), ws,
                                                         chunked(make_options(Divergence::jsd, 1.0, 0.3), 4, big.V));
  }
  const RowMatrix<double> mask = P.mask_matrix<double>();
  for (const DistillationOptions& o0 : all_options())
    for (const DistillationOptions& o : {chunked(o0, 2, P.V), blocked(o0), chunked(o0, 4, P.V)}) {
      INFO(describe(o));
      const NaiveHead want = naive_head(P, logq, o);
      const DistillationExtras<double> extras{{mask.data(), P.N, 1}};
      RowMatrix<double> dh(P.N, P.d), dW = RowMatrix<double>::Zero(P.V, P.d);
      const DistillationResult r = embedhead::distill_logprobs_forward_backward<double>(P.h, P.W, empty<double>(), logq,
                                                                                        dh, dW, empty<double>(), ws, o,
                                                                                        extras);
      REQUIRE_THAT(r.loss, WithinRel(want.loss, 1e-11) || WithinAbs(want.loss, 1e-13));
      require_close(dh, want.student.dx, 1e-10, 1e-13);
      require_close(dW, want.student.dY, 1e-9, 1e-13);
    }
}

TEST_CASE("distillation: the plan's rule and its memory (the buffers of both models' logits)", "[distillation]") {
  // token_chunks of n tokens hold [n, V] each (n from the budget, at most N); vocab_blocks [N, vocab_block] each;
  // automatic takes token chunks when the budget holds min(N, 128) tokens, else blocks.
  const Problem P;  // N = 7, V = 53
  const Matrix logq = log_softmax(P.u(), 1.0);
  const Index token = 2 * P.V * static_cast<Index>(sizeof(double));
  auto buffer = [&](embedhead::FusedPlan plan, Index budget) {
    DistillationWorkspace<double> ws;
    DistillationOptions o = make_options(Divergence::forward_kl, 1.0);
    o.plan = plan;
    o.memory_budget = budget;
    RowMatrix<double> dh(P.N, P.d), dW = RowMatrix<double>::Zero(P.V, P.d);
    embedhead::distill_logprobs_forward_backward<double>(P.h, P.W, empty<double>(), logq, dh, dW, empty<double>(), ws,
                                                         o);
    REQUIRE(ws.teacher.size() == ws.student.size());
    return static_cast<Index>(ws.student.size());
  };
  using embedhead::FusedPlan;
  CHECK(buffer(FusedPlan::vocab_blocks, 0) == P.N * 16);
  CHECK(buffer(FusedPlan::token_chunks, token) == P.V);
  CHECK(buffer(FusedPlan::token_chunks, 3 * token) == 3 * P.V);
  CHECK(buffer(FusedPlan::token_chunks, 3 * token + token / 2) == 3 * P.V);
  CHECK(buffer(FusedPlan::token_chunks, 100 * token) == P.N * P.V);
  CHECK(buffer(FusedPlan::automatic, 0) == P.N * P.V);               // 64 MiB holds all 7 tokens
  CHECK(buffer(FusedPlan::automatic, P.N * token) == P.N * P.V);     // exactly all of them
  CHECK(buffer(FusedPlan::automatic, P.N * token - 1) == P.N * 16);  // not all, and fewer than 128: blocks
  CHECK(buffer(FusedPlan::automatic, 3 * token) == P.N * 16);
}
