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

std::string describe(const DistillationOptions& o) {
  const char* name = o.divergence == Divergence::forward_kl   ? "forward_kl"
                     : o.divergence == Divergence::reverse_kl ? "reverse_kl"
                                                              : "jsd";
  return std::string(name) + " T=" + std::to_string(o.temperature) + " beta=" + std::to_string(o.beta);
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
    for (DistillationOptions o : all_options()) {
      o.reduction = reduction;
      INFO(describe(o) << " reduction " << static_cast<int>(reduction));
      std::vector<double> rows;
      const double want = naive_loss(P.s(), P.u(), P.mask, o, &rows);
      RowMatrix<Scalar> losses = RowMatrix<Scalar>::Constant(P.N, 1, Scalar(-7));
      const DistillationExtras<Scalar> extras{{mask.data(), P.N, 1}, {losses.data(), P.N, 1}};
      RowMatrix<Scalar> dh1(P.N, P.d), dW1 = RowMatrix<Scalar>::Zero(P.V, P.d), dhT(P.N, P.dT),
                                       dWT = RowMatrix<Scalar>::Zero(P.V, P.dT), db1 = RowMatrix<Scalar>::Zero(P.V, 1),
                                       dbT = RowMatrix<Scalar>::Zero(P.V, 1);
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
  for (const DistillationOptions& o : all_options()) {
    INFO(describe(o));
    auto loss = [&] { return naive_loss(P.s(), P.u(), P.mask, o); };
    RowMatrix<double> dh(P.N, P.d), dW = RowMatrix<double>::Zero(P.V, P.d), dhT(P.N, P.dT),
                                    dWT = RowMatrix<double>::Zero(P.V, P.dT), db = RowMatrix<double>::Zero(P.V, 1),
                                    dbT = RowMatrix<double>::Zero(P.V, 1);
    embedhead::distill_head_forward_backward<double>(P.h, P.W, P.b, P.hT, P.WT, P.bT, dh, dW, db, dhT, dWT, dbT, ws, o,
                                                     extras);
    require_close(db, central_differences(P.b, loss), 1e-7, 1e-9);
    require_close(dbT, central_differences(P.bT, loss), 1e-7, 1e-9);
    require_close(dh, central_differences(P.h, loss), 1e-7, 1e-9);
    require_close(dW, central_differences(P.W, loss), 1e-7, 1e-9);
    require_close(dhT, central_differences(P.hT, loss), 1e-7, 1e-9);
    require_close(dWT, central_differences(P.WT, loss), 1e-7, 1e-9);
    REQUIRE(dhT.norm() > 1e-3);  // the teacher's gradient is not trivially 0
    // Without the teacher's gradients the student's are the same.
    RowMatrix<double> dh2(P.N, P.d), dW2 = RowMatrix<double>::Zero(P.V, P.d), none(0, 0);
    embedhead::distill_head_forward_backward<double>(P.h, P.W, P.b, P.hT, P.WT, P.bT, dh2, dW2, none, none, none, none,
                                                     ws, o, extras);
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
}
