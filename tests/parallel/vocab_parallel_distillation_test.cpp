// Tests for include/embedhead/parallel/vocab_parallel_distillation.hpp: distillation over a vocabulary shard; built
// single-process and under mpirun with 1, 2 and 3 ranks (tests/parallel/world.hpp).
//
// Every rank builds the same whole student and teacher heads (same seeds) and the same h, h_T, mask and cached
// teacher log-probs, and takes rows [begin, end) = vocab_shard(V, rank, R) of W, bias, W_T and bias_T as its shard.
// Expected values: the single-process distill_* functions on the whole heads under plan vocab_blocks, the plan a shard
// walks (bit-identical with one rank, to rounding with more: the vocabulary sums split at other places), and a naive
// reference in double written here from the definitions of distillation.hpp's header (full logits, log-softmax, the KLs
// and the generalized JSD by their sums; the gradients by central differences of each row's loss with respect to its
// logits). Replicated outputs are checked bit-identical across ranks. V = 53 splits 27/26 on 2 ranks and 18/18/17 on 3.
#include <embedhead/distillation.hpp>
#include <embedhead/parallel/vocab_parallel_distillation.hpp>

#include "../reference/test_support.hpp"
#include "world.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace {

using Catch::Matchers::Contains;
using Catch::Matchers::EndsWith;
using Catch::Matchers::WithinAbs;
using Catch::Matchers::WithinRel;
using embedhead::Communicator;
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
using embedhead::VocabShard;
using test_support::close;
using test_support::random_matrix;
using test_support::same_values;
using test_support::tolerance;
using test_support::agreed_error;
using test_support::on_last_rank;
using test_support::world;

using Matrix = RowMatrix<double>;

enum class Teacher { head, dense, topk };

// The whole heads and inputs on every rank, and this rank's shard of them.
template <typename Scalar>
struct Setup {
  Index V, d, d_T, N, k;
  VocabShard shard;
  RowMatrix<Scalar> W, b, W_T, b_T, h, h_T;  // whole: W [V, d], b [V, 1], W_T [V, d_T], b_T [V, 1]
  RowMatrix<Scalar> W_s, b_s, W_T_s, b_T_s;  // this rank's rows
  RowMatrix<Scalar> logprobs;                // [N, V] dense teacher log-probs
  IdMatrix<std::int64_t> top_ids;            // [N, k] distinct ids
  RowMatrix<Scalar> top_logprobs;            // [N, k]: the dense log-probs at those ids (sum < 1)
};

// Logits of a few units (weights 0.5, h in [-1, 1)), so both softmaxes are far from uniform.
template <typename Scalar>
Setup<Scalar> make_setup(Index N, Index d, Index d_T, std::uint64_t seed) {
  Communicator& comm = world();
  const Index V = 53, k = 5;
  Setup<Scalar> s;
  s.V = V, s.d = d, s.d_T = d_T, s.N = N, s.k = k;
  s.shard = embedhead::vocab_shard(V, comm.rank(), comm.size());
  s.W = random_matrix<Scalar>(V, d, seed, 0.5);
  s.b = random_matrix<Scalar>(V, 1, seed + 1, 0.5);
  s.W_T = random_matrix<Scalar>(V, d_T, seed + 2, 0.7);
  s.b_T = random_matrix<Scalar>(V, 1, seed + 3, 0.5);
  s.h = random_matrix<Scalar>(N, d, seed + 4, 1.0);
  s.h_T = random_matrix<Scalar>(N, d_T, seed + 5, 1.0);
  const Index b0 = s.shard.begin, rows = s.shard.rows();
  s.W_s = s.W.middleRows(b0, rows);
  s.b_s = s.b.middleRows(b0, rows);
  s.W_T_s = s.W_T.middleRows(b0, rows);
  s.b_T_s = s.b_T.middleRows(b0, rows);
  // Dense log-probs: log-softmax (in double) of random teacher logits of a few units.
  const Matrix z = random_matrix<double>(N, V, seed + 6, 2.0);
  s.logprobs.resize(N, V);
  for (Index n = 0; n < N; ++n) {
    const double m = z.row(n).maxCoeff();
    const double lse = m + std::log((z.row(n).array() - m).exp().sum());
    for (Index j = 0; j < V; ++j) s.logprobs(n, j) = static_cast<Scalar>(z(n, j) - lse);
  }
  // Top-k: k distinct random ids per row, with the dense log-probs there.
  std::mt19937_64 gen(seed + 7);
  s.top_ids.resize(N, k);
  s.top_logprobs.resize(N, k);
  std::vector<Index> all(static_cast<std::size_t>(V));
  for (Index n = 0; n < N; ++n) {
    std::iota(all.begin(), all.end(), Index(0));
    std::shuffle(all.begin(), all.end(), gen);
    for (Index i = 0; i < k; ++i) {
      s.top_ids(n, i) = static_cast<std::int64_t>(all[static_cast<std::size_t>(i)]);
      s.top_logprobs(n, i) = s.logprobs(n, all[static_cast<std::size_t>(i)]);
    }
  }
  return s;
}

template <typename Scalar>
struct Outputs {
  DistillationResult result;
  RowMatrix<Scalar> dh, dW, db, dh_T, dW_T, db_T, losses;  // dW, db, dW_T, db_T: this rank's rows [begin, end)
};

// What a call computes: the teacher, whether there is a gradient (and the teacher's), the options and the mask.
struct Case {
  Teacher teacher = Teacher::head;
  bool gradient = true;
  bool teacher_gradient = false;
  DistillationOptions options;
  std::vector<int> mask;  // empty: every row counted
};

template <typename Scalar>
RowMatrix<Scalar> mask_matrix(const Case& c) {
  RowMatrix<Scalar> m(static_cast<Index>(c.mask.size()), 1);
  for (std::size_t n = 0; n < c.mask.size(); ++n) m(static_cast<Index>(n), 0) = static_cast<Scalar>(c.mask[n]);
  return m;
}

template <typename Scalar>
Outputs<Scalar> new_outputs(const Setup<Scalar>& s, const Case& c, Index rows) {
  Outputs<Scalar> out;
  out.dh = RowMatrix<Scalar>::Zero(s.N, s.d);
  out.dW = RowMatrix<Scalar>::Zero(rows, s.d);
  out.db = RowMatrix<Scalar>::Zero(rows, 1);
  const bool teacher = c.teacher == Teacher::head && c.teacher_gradient;
  out.dh_T = RowMatrix<Scalar>::Zero(teacher ? s.N : 0, teacher ? s.d_T : 0);
  out.dW_T = RowMatrix<Scalar>::Zero(teacher ? rows : 0, teacher ? s.d_T : 0);
  out.db_T = RowMatrix<Scalar>::Zero(teacher ? rows : 0, 1);
  out.losses = RowMatrix<Scalar>::Zero(s.N, 1);
  return out;
}

// The single-process function on the whole heads in vocabulary blocks (a shard's plan); the gradients of W's rows cut
// to this rank's shard.
template <typename Scalar>
Outputs<Scalar> single(const Setup<Scalar>& s, Case c) {
  c.options.plan = embedhead::FusedPlan::vocab_blocks;
  Outputs<Scalar> out = new_outputs(s, c, s.V);
  const RowMatrix<Scalar> mask = mask_matrix<Scalar>(c);
  const DistillationExtras<Scalar> extras{{mask.data(), mask.rows(), 1}, {out.losses.data(), s.N, 1}};
  DistillationWorkspace<Scalar> ws;
  const TeacherTopK<Scalar> top{s.top_ids, s.top_logprobs};
  if (c.teacher == Teacher::head && c.gradient)
    out.result = embedhead::distill_head_forward_backward<Scalar>(s.h, s.W, s.b, s.h_T, s.W_T, s.b_T, out.dh, out.dW,
                                                                  out.db, out.dh_T, out.dW_T, out.db_T, ws, c.options,
                                                                  extras);
  else if (c.teacher == Teacher::head)
    out.result = embedhead::distill_head<Scalar>(s.h, s.W, s.b, s.h_T, s.W_T, s.b_T, ws, c.options, extras);
  else if (c.teacher == Teacher::dense && c.gradient)
    out.result = embedhead::distill_logprobs_forward_backward<Scalar>(s.h, s.W, s.b, s.logprobs, out.dh, out.dW, out.db,
                                                                      ws, c.options, extras);
  else if (c.teacher == Teacher::dense)
    out.result = embedhead::distill_logprobs<Scalar>(s.h, s.W, s.b, s.logprobs, ws, c.options, extras);
  else if (c.gradient)
    out.result = embedhead::distill_topk_forward_backward<Scalar>(s.h, s.W, s.b, top, out.dh, out.dW, out.db, ws,
                                                                  c.options, extras);
  else
    out.result = embedhead::distill_topk<Scalar>(s.h, s.W, s.b, top, ws, c.options, extras);
  const Index b0 = s.shard.begin, rows = s.shard.rows();
  out.dW = RowMatrix<Scalar>(out.dW.middleRows(b0, rows));
  out.db = RowMatrix<Scalar>(out.db.middleRows(b0, rows));
  if (out.dW_T.size() != 0) {
    out.dW_T = RowMatrix<Scalar>(out.dW_T.middleRows(b0, rows));
    out.db_T = RowMatrix<Scalar>(out.db_T.middleRows(b0, rows));
  }
  return out;
}

// The vocabulary-parallel function on this rank's shard.
template <typename Scalar>
Outputs<Scalar> sharded(const Setup<Scalar>& s, const Case& c, DistillationWorkspace<Scalar>& ws) {
  Communicator& comm = world();
  Outputs<Scalar> out = new_outputs(s, c, s.shard.rows());
  const RowMatrix<Scalar> mask = mask_matrix<Scalar>(c);
  const DistillationExtras<Scalar> extras{{mask.data(), mask.rows(), 1}, {out.losses.data(), s.N, 1}};
  const TeacherTopK<Scalar> top{s.top_ids, s.top_logprobs};
  if (c.teacher == Teacher::head && c.gradient)
    out.result = embedhead::vocab_parallel_distill_head_forward_backward<Scalar>(comm, s.V, s.h, s.W_s, s.b_s, s.h_T,
                                                                                 s.W_T_s, s.b_T_s, out.dh, out.dW,
                                                                                 out.db, out.dh_T, out.dW_T, out.db_T,
                                                                                 ws, c.options, extras);
  else if (c.teacher == Teacher::head)
    out.result = embedhead::vocab_parallel_distill_head<Scalar>(comm, s.V, s.h, s.W_s, s.b_s, s.h_T, s.W_T_s, s.b_T_s,
                                                                ws, c.options, extras);
  else if (c.teacher == Teacher::dense && c.gradient)
    out.result = embedhead::vocab_parallel_distill_logprobs_forward_backward<Scalar>(comm, s.V, s.h, s.W_s, s.b_s,
                                                                                     s.logprobs, out.dh, out.dW, out.db,
                                                                                     ws, c.options, extras);
  else if (c.teacher == Teacher::dense)
    out.result = embedhead::vocab_parallel_distill_logprobs<Scalar>(comm, s.V, s.h, s.W_s, s.b_s, s.logprobs, ws,
                                                                    c.options, extras);
  else if (c.gradient)
    out.result = embedhead::vocab_parallel_distill_topk_forward_backward<Scalar>(comm, s.V, s.h, s.W_s, s.b_s, top,
                                                                                 out.dh, out.dW, out.db, ws, c.options,
                                                                                 extras);
  else
    out.result = embedhead::vocab_parallel_distill_topk<Scalar>(comm, s.V, s.h, s.W_s, s.b_s, top, ws, c.options,
                                                                extras);
  return out;
}

// log softmax of the row x / T, in double (-inf stays -inf).
std::vector<double> log_softmax(const std::vector<double>& x, double T) {
  double m = -std::numeric_limits<double>::infinity();
  for (const double v : x) m = std::max(m, v / T);
  double sum = 0;
  for (const double v : x) sum += std::exp(v / T - m);
  std::vector<double> out(x.size());
  for (std::size_t j = 0; j < x.size(); ++j) out[j] = x[j] / T - m - std::log(sum);
  return out;
}

// sum_j P_j (log P_j - log Q_j), terms with P_j = 0 adding 0.
double kl(const std::vector<double>& lP, const std::vector<double>& lQ) {
  double total = 0;
  for (std::size_t j = 0; j < lP.size(); ++j) {
    const double P = std::exp(lP[j]);
    if (P > 0) total += P * (lP[j] - lQ[j]);
  }
  return total;
}

// One row's L from student logits s and teacher logits (or log-probs) u, by the definitions.
double naive_row(const std::vector<double>& s, const std::vector<double>& u, const DistillationOptions& o) {
  const double T = o.temperature, beta = o.beta;
  const std::vector<double> lp = log_softmax(s, T), lq = log_softmax(u, T);
  if (o.divergence == Divergence::forward_kl) return T * T * kl(lq, lp);
  if (o.divergence == Divergence::reverse_kl) return T * T * kl(lp, lq);
  if (beta == 0) return kl(lq, lp);
  if (beta == 1) return kl(lp, lq);
  std::vector<double> lm(s.size());
  for (std::size_t j = 0; j < s.size(); ++j) lm[j] = std::log(beta * std::exp(lq[j]) + (1 - beta) * std::exp(lp[j]));
  return beta * kl(lq, lm) + (1 - beta) * kl(lp, lm);
}

// d naive_row / d x_j by central differences (x modified in place, restored); -inf entries get 0.
std::vector<double> row_gradient(std::vector<double>& x, const std::function<double()>& f) {
  const double step = 1e-5;
  std::vector<double> g(x.size(), 0.0);
  for (std::size_t j = 0; j < x.size(); ++j) {
    if (!std::isfinite(x[j])) continue;
    const double keep = x[j];
    x[j] = keep + step;
    const double up = f();
    x[j] = keep - step;
    const double down = f();
    x[j] = keep;
    g[j] = (up - down) / (2 * step);
  }
  return g;
}

// The naive reference in double: full logits, the rows' losses, the reduction; the gradients from the logits'
// gradients (dh = dS W, dW = dS^T h, db = column sums of dS), cut to this rank's rows.
template <typename Scalar>
Outputs<double> naive(const Setup<Scalar>& s, const Case& c) {
  const Matrix W = s.W.template cast<double>(), b = s.b.template cast<double>(), h = s.h.template cast<double>();
  const Matrix W_T = s.W_T.template cast<double>(), b_T = s.b_T.template cast<double>();
  const Matrix h_T = s.h_T.template cast<double>();
  Matrix S = h * W.transpose();
  S.rowwise() += b.col(0).transpose();
  Matrix U(s.N, s.V);
  if (c.teacher == Teacher::head) {
    U = h_T * W_T.transpose();
    U.rowwise() += b_T.col(0).transpose();
  } else if (c.teacher == Teacher::dense) {
    U = s.logprobs.template cast<double>();
  } else {
    U.setConstant(-std::numeric_limits<double>::infinity());
    for (Index n = 0; n < s.N; ++n)
      for (Index i = 0; i < s.k; ++i) U(n, static_cast<Index>(s.top_ids(n, i))) = s.top_logprobs(n, i);
  }
  Outputs<double> out;
  Index count = 0;
  for (Index n = 0; n < s.N; ++n) count += c.mask.empty() || c.mask[static_cast<std::size_t>(n)] ? 1 : 0;
  const double scale = c.options.reduction == Reduction::mean ? (count ? 1.0 / static_cast<double>(count) : 0) : 1.0;
  Matrix dS = Matrix::Zero(s.N, s.V), dU = Matrix::Zero(s.N, s.V);
  out.losses = Matrix::Zero(s.N, 1);
  for (Index n = 0; n < s.N; ++n) {
    if (!(c.mask.empty() || c.mask[static_cast<std::size_t>(n)])) continue;
    std::vector<double> srow(S.row(n).data(), S.row(n).data() + s.V), urow(U.row(n).data(), U.row(n).data() + s.V);
    auto f = [&] { return naive_row(srow, urow, c.options); };
    out.losses(n, 0) = f();
    out.result.sum += out.losses(n, 0);
    const std::vector<double> gs = row_gradient(srow, f);
    const std::vector<double> gu = row_gradient(urow, f);
    for (Index j = 0; j < s.V; ++j) {
      dS(n, j) = scale * gs[static_cast<std::size_t>(j)];
      dU(n, j) = scale * gu[static_cast<std::size_t>(j)];
    }
  }
  out.result.count = count;
  out.result.loss = c.options.reduction == Reduction::mean ? out.result.sum * scale : out.result.sum;
  const Index b0 = s.shard.begin, rows = s.shard.rows();
  out.dh = dS * W;
  out.dW = (dS.transpose() * h).middleRows(b0, rows);
  out.db = dS.colwise().sum().transpose().middleRows(b0, rows);
  out.dh_T = dU * W_T;
  out.dW_T = (dU.transpose() * h_T).middleRows(b0, rows);
  out.db_T = dU.colwise().sum().transpose().middleRows(b0, rows);
  return out;
}

// True when every rank passed the same bytes.
template <typename T>
bool same_on_every_rank(const T* data, Index count) {
  const std::uint64_t mine = embedhead::detail::fingerprint_bytes(data, static_cast<std::size_t>(count) * sizeof(T));
  const std::vector<std::int64_t> all = world().all_gather(static_cast<std::int64_t>(mine));
  for (const std::int64_t f : all)
    if (f != all[0]) return false;
  return true;
}

template <typename Scalar>
bool replicated(const Outputs<Scalar>& out) {
  const double scalars[3] = {out.result.loss, out.result.sum, static_cast<double>(out.result.count)};
  return same_on_every_rank(scalars, 3) && same_on_every_rank(out.dh.data(), out.dh.size()) &&
         same_on_every_rank(out.dh_T.data(), out.dh_T.size()) &&
         same_on_every_rank(out.losses.data(), out.losses.size());
}

template <typename A, typename B>
void check_close(const A& actual, const B& expected, double tol) {
  CHECK(actual.result.count == expected.result.count);
  CHECK_THAT(actual.result.loss, WithinRel(expected.result.loss, tol) || WithinAbs(expected.result.loss, tol));
  CHECK_THAT(actual.result.sum, WithinRel(expected.result.sum, tol) || WithinAbs(expected.result.sum, tol));
  CHECK(close(actual.losses, expected.losses, tol));
}

template <typename A, typename B>
void check_gradients_close(const A& actual, const B& expected, const Case& c, double tol) {
  CHECK(close(actual.dh, expected.dh, tol));
  CHECK(close(actual.dW, expected.dW, tol));
  CHECK(close(actual.db, expected.db, tol));
  if (c.teacher == Teacher::head && c.teacher_gradient) {
    CHECK(close(actual.dh_T, expected.dh_T, tol));
    CHECK(close(actual.dW_T, expected.dW_T, tol));
    CHECK(close(actual.db_T, expected.db_T, tol));
  }
}

template <typename Scalar>
void check_exact(const Outputs<Scalar>& actual, const Outputs<Scalar>& expected) {
  CHECK(actual.result.count == expected.result.count);
  CHECK(actual.result.loss == expected.result.loss);
  CHECK(actual.result.sum == expected.result.sum);
  CHECK(same_values(actual.losses, expected.losses));
  CHECK(same_values(actual.dh, expected.dh));
  CHECK(same_values(actual.dW, expected.dW));
  CHECK(same_values(actual.db, expected.db));
  CHECK(same_values(actual.dh_T, expected.dh_T));
  CHECK(same_values(actual.dW_T, expected.dW_T));
  CHECK(same_values(actual.db_T, expected.db_T));
}

std::string describe(const Case& c) {
  const char* teachers[] = {"head", "dense", "topk"};
  const char* divergences[] = {"forward_kl", "reverse_kl", "jsd"};
  const char* reductions[] = {"mean", "sum", "none"};
  return std::string(teachers[static_cast<int>(c.teacher)]) + " " +
         divergences[static_cast<int>(c.options.divergence)] + " beta " + std::to_string(c.options.beta) + " T " +
         std::to_string(c.options.temperature) + " " + reductions[static_cast<int>(c.options.reduction)] +
         (c.mask.empty() ? " unmasked" : " masked") + (c.gradient ? " gradient" : " loss") +
         (c.teacher_gradient ? " teacher gradient" : "") + " vocab_block " + std::to_string(c.options.vocab_block);
}

// Runs one case on the shard and checks it against the single-process function and the naive reference.
template <typename Scalar>
void check_case(const Setup<Scalar>& s, const Case& c, DistillationWorkspace<Scalar>& ws) {
  INFO(describe(c) << " on rank " << world().rank() << " of " << world().size());
  const Outputs<Scalar> got = sharded(s, c, ws);
  const Outputs<Scalar> want = single(s, c);
  const Outputs<double> reference = naive(s, c);
  CHECK(replicated(got));
  if (world().size() == 1) {
    check_exact(got, want);
  } else {
    check_close(got, want, 2 * tolerance<Scalar>());
    if (c.gradient) check_gradients_close(got, want, c, 2 * tolerance<Scalar>());
  }
  // The naive reference: float's logits round to about 1e-7 relative, the central differences to about 1e-9.
  const double tol = std::is_same_v<Scalar, float> ? 2e-4 : 1e-7;
  check_close(got, reference, tol);
  if (c.gradient) check_gradients_close(got, reference, c, tol);
}

Case make_case(Teacher teacher, Divergence divergence, double beta, double T, Reduction reduction, bool masked,
               bool gradient, Index vocab_block) {
  Case c;
  c.teacher = teacher;
  c.gradient = gradient;
  c.teacher_gradient = gradient && teacher == Teacher::head;
  c.options.divergence = divergence;
  c.options.beta = beta;
  c.options.temperature = T;
  c.options.reduction = reduction;
  c.options.vocab_block = vocab_block;
  if (masked) c.mask = {1, 0, 1, 1, 1, 0, 1, 1};
  return c;
}

struct DivergenceCase {
  Divergence divergence;
  double beta;
};

const DivergenceCase kDivergences[] = {{Divergence::forward_kl, 0.5},
                                       {Divergence::reverse_kl, 0.5},
                                       {Divergence::jsd, 0.0},
                                       {Divergence::jsd, 0.3},
                                       {Divergence::jsd, 1.0}};

}  // namespace

TEMPLATE_TEST_CASE("vocabulary-parallel distillation with a teacher head equals distill_head and the naive reference",
                   "[vocab_parallel_distillation]", float, double) {
  using Scalar = TestType;
  const Setup<Scalar> s = make_setup<Scalar>(8, 6, 5, 71);
  DistillationWorkspace<Scalar> ws;  // reused across the calls
  for (const DivergenceCase& dv : kDivergences)
    for (const double T : {1.0, 2.0})
      for (const Reduction reduction : {Reduction::mean, Reduction::sum, Reduction::none})
        for (const bool masked : {false, true}) {
          // Several blocks per shard (vocab_block 8) on half the cases, one on the others.
          const Index block = masked ? 8 : 0;
          check_case(s, make_case(Teacher::head, dv.divergence, dv.beta, T, reduction, masked, true, block), ws);
        }
  // The loss alone, and a gradient without the teacher's.
  for (const DivergenceCase& dv : kDivergences) {
    check_case(s, make_case(Teacher::head, dv.divergence, dv.beta, 2.0, Reduction::mean, true, false, 8), ws);
    Case c = make_case(Teacher::head, dv.divergence, dv.beta, 1.0, Reduction::sum, false, true, 0);
    c.teacher_gradient = false;
    check_case(s, c, ws);
  }
}

TEMPLATE_TEST_CASE("vocabulary-parallel distillation with dense cached log-probs equals distill_logprobs",
                   "[vocab_parallel_distillation]", float, double) {
  using Scalar = TestType;
  const Setup<Scalar> s = make_setup<Scalar>(8, 6, 5, 83);
  DistillationWorkspace<Scalar> ws;
  for (const DivergenceCase& dv : kDivergences)
    for (const double T : {1.0, 2.0})
      for (const Reduction reduction : {Reduction::mean, Reduction::sum, Reduction::none})
        for (const bool masked : {false, true})
          check_case(s, make_case(Teacher::dense, dv.divergence, dv.beta, T, reduction, masked, true, masked ? 8 : 0),
                     ws);
  for (const DivergenceCase& dv : kDivergences)
    check_case(s, make_case(Teacher::dense, dv.divergence, dv.beta, 2.0, Reduction::mean, true, false, 8), ws);
}

TEMPLATE_TEST_CASE("vocabulary-parallel distillation with top-k cached log-probs equals distill_topk",
                   "[vocab_parallel_distillation]", float, double) {
  using Scalar = TestType;
  const Setup<Scalar> s = make_setup<Scalar>(8, 6, 5, 97);
  DistillationWorkspace<Scalar> ws;
  for (const double T : {1.0, 2.0})
    for (const Reduction reduction : {Reduction::mean, Reduction::sum, Reduction::none})
      for (const bool masked : {false, true})
        for (const bool gradient : {true, false})
          check_case(s,
                     make_case(Teacher::topk, Divergence::forward_kl, 0.5, T, reduction, masked, gradient,
                               masked ? 8 : 0),
                     ws);
  // Every id of a row in one shard (the others hold none of it): rows whose k ids are the first k classes.
  Setup<Scalar> one_shard = s;
  for (Index n = 0; n < s.N; n += 2)
    for (Index i = 0; i < s.k; ++i) {
      one_shard.top_ids(n, i) = i;
      one_shard.top_logprobs(n, i) = s.logprobs(n, i);
    }
  check_case(one_shard, make_case(Teacher::topk, Divergence::forward_kl, 0.5, 1.0, Reduction::mean, false, true, 8),
             ws);
}

TEMPLATE_TEST_CASE("vocabulary-parallel distillation: every row masked, then every top-k id in the first shard",
                   "[vocab_parallel_distillation]", float, double) {
  using Scalar = TestType;
  const Setup<Scalar> s = make_setup<Scalar>(8, 6, 5, 151);
  DistillationWorkspace<Scalar> ws;
  // No counted row: nothing to reduce on any rank; the calls after it must still meet in their collectives.
  for (const Teacher teacher : {Teacher::head, Teacher::dense, Teacher::topk})
    for (const bool gradient : {true, false}) {
      Case c = make_case(teacher, Divergence::forward_kl, 0.5, 1.0, Reduction::mean, true, gradient, 0);
      c.mask.assign(static_cast<std::size_t>(s.N), 0);
      INFO(describe(c));
      const Outputs<Scalar> got = sharded(s, c, ws);
      CHECK(got.result.count == 0);
      CHECK(got.result.loss == 0);
      CHECK(got.result.sum == 0);
      CHECK(got.losses.isZero(0));
      if (gradient) {
        CHECK(got.dh.isZero(0));
        CHECK(got.dW.isZero(0));
      }
      CHECK(replicated(got));
      check_case(s, make_case(teacher, Divergence::forward_kl, 0.5, 2.0, Reduction::sum, false, gradient, 0), ws);
    }
  // Every row's k ids in the first shard: every other rank has max -inf and sum 0 in every row of the teacher.
  Setup<Scalar> first = s;
  for (Index n = 0; n < s.N; ++n)
    for (Index i = 0; i < s.k; ++i) {
      first.top_ids(n, i) = (n + i) % s.k;
      first.top_logprobs(n, i) = s.logprobs(n, (n + i) % s.k);
    }
  for (const double T : {1.0, 2.0})
    for (const bool gradient : {true, false})
      check_case(first, make_case(Teacher::topk, Divergence::forward_kl, 0.5, T, Reduction::mean, false, gradient, 2),
                 ws);
}

TEST_CASE("vocabulary-parallel distillation adds into the shards' gradients and writes dh",
          "[vocab_parallel_distillation]") {
  using Scalar = double;
  const Setup<Scalar> s = make_setup<Scalar>(8, 6, 5, 131);
  Communicator& comm = world();
  const Index rows = s.shard.rows();
  Case c = make_case(Teacher::head, Divergence::jsd, 0.3, 2.0, Reduction::mean, true, true, 8);
  DistillationWorkspace<Scalar> ws;
  const Outputs<Scalar> fresh = sharded(s, c, ws);
  // From gradients holding earlier values, and dh, dh_T holding garbage: dW, db, dW_T, db_T add; dh, dh_T are written.
  const RowMatrix<Scalar> start_W = random_matrix<Scalar>(rows, s.d, 5, 1.0),
                          start_b = random_matrix<Scalar>(rows, 1, 6);
  const RowMatrix<Scalar> start_W_T = random_matrix<Scalar>(rows, s.d_T, 7),
                          start_b_T = random_matrix<Scalar>(rows, 1, 8);
  RowMatrix<Scalar> dW = start_W, db = start_b, dW_T = start_W_T, db_T = start_b_T;
  RowMatrix<Scalar> dh = RowMatrix<Scalar>::Constant(s.N, s.d, 3.0),
                    dh_T = RowMatrix<Scalar>::Constant(s.N, s.d_T, 4.0);
  RowMatrix<Scalar> losses(s.N, 1);
  const RowMatrix<Scalar> mask = mask_matrix<Scalar>(c);
  const DistillationExtras<Scalar> extras{{mask.data(), mask.rows(), 1}, {losses.data(), s.N, 1}};
  const DistillationResult result = embedhead::vocab_parallel_distill_head_forward_backward<Scalar>(
      comm, s.V, s.h, s.W_s, s.b_s, s.h_T, s.W_T_s, s.b_T_s, dh, dW, db, dh_T, dW_T, db_T, ws, c.options, extras);
  CHECK(result.loss == fresh.result.loss);
  CHECK(same_values(dh, fresh.dh));
  CHECK(same_values(dh_T, fresh.dh_T));
  CHECK(close(dW, RowMatrix<Scalar>(start_W + fresh.dW), 1e-15));
  CHECK(close(db, RowMatrix<Scalar>(start_b + fresh.db), 1e-15));
  CHECK(close(dW_T, RowMatrix<Scalar>(start_W_T + fresh.dW_T), 1e-15));
  CHECK(close(db_T, RowMatrix<Scalar>(start_b_T + fresh.db_T), 1e-15));
  // Masked rows (1 and 5) get dh = 0.
  CHECK(dh.row(1).isZero(0));
  CHECK(dh_T.row(5).isZero(0));
  CHECK(losses(1, 0) == 0);
  CHECK_FALSE(fresh.dh.isZero(0));
}

TEST_CASE("vocabulary-parallel distillation: errors agreed on every rank, nothing changed",
          "[vocab_parallel_distillation][errors]") {
  using Scalar = float;
  Communicator& comm = world();
  const int R = comm.size();
  const bool last = comm.rank() == R - 1;
  Setup<Scalar> s = make_setup<Scalar>(8, 6, 5, 113);
  const Index rows = s.shard.rows();
  const std::string last_rows = std::to_string(embedhead::vocab_shard(53, R - 1, R).rows());  // in the messages
  RowMatrix<Scalar> dh = RowMatrix<Scalar>::Constant(s.N, s.d, Scalar(7));
  RowMatrix<Scalar> dW = RowMatrix<Scalar>::Constant(rows, s.d, Scalar(8));
  RowMatrix<Scalar> db = RowMatrix<Scalar>::Constant(rows, 1, Scalar(9));
  RowMatrix<Scalar> dh_T = RowMatrix<Scalar>::Constant(s.N, s.d_T, Scalar(10));
  RowMatrix<Scalar> dW_T = RowMatrix<Scalar>::Constant(rows, s.d_T, Scalar(11));
  RowMatrix<Scalar> db_T = RowMatrix<Scalar>::Constant(rows, 1, Scalar(12));
  RowMatrix<Scalar> losses = RowMatrix<Scalar>::Constant(s.N, 1, Scalar(13));
  const RowMatrix<Scalar> dh0 = dh, dW0 = dW, db0 = db, dh_T0 = dh_T, dW_T0 = dW_T, db_T0 = db_T, losses0 = losses;
  RowMatrix<Scalar> mask = RowMatrix<Scalar>::Ones(s.N, 1);
  DistillationWorkspace<Scalar> ws;
  auto extras = [&] {
    return DistillationExtras<Scalar>{{mask.data(), mask.rows(), 1}, {losses.data(), losses.rows(), 1}};
  };
  auto head = [&](const DistillationOptions& o, const RowMatrix<Scalar>& W_s, const RowMatrix<Scalar>& W_T_s) {
    return [&, o] {
      embedhead::vocab_parallel_distill_head_forward_backward<Scalar>(comm, s.V, s.h, W_s, s.b_s, s.h_T, W_T_s, s.b_T_s,
                                                                      dh, dW, db, dh_T, dW_T, db_T, ws, o, extras());
    };
  };
  auto unchanged = [&] {
    CHECK(same_values(dh, dh0));
    CHECK(same_values(dW, dW0));
    CHECK(same_values(db, db0));
    CHECK(same_values(dh_T, dh_T0));
    CHECK(same_values(dW_T, dW_T0));
    CHECK(same_values(db_T, db_T0));
    CHECK(same_values(losses, losses0));
  };

  SECTION("a temperature out of range on the last rank") {
    DistillationOptions o;
    if (last) o.temperature = -1;
    const std::string message = agreed_error<embedhead::value_error>(head(o, s.W_s, s.W_T_s));
    CHECK_THAT(message, Contains("vocab_parallel_distill_head_forward_backward") && Contains("temperature = -1") &&
                            Contains("outside (0, inf)") && EndsWith(on_last_rank()));
    unchanged();
  }
  SECTION("plan token_chunks on the last rank (a shard walks blocks)") {
    DistillationOptions o;
    if (last) o.plan = embedhead::FusedPlan::token_chunks;
    const std::string message = agreed_error<embedhead::value_error>(head(o, s.W_s, s.W_T_s));
    CHECK_THAT(message, Contains("plan token_chunks outside {automatic, vocab_blocks} over a vocabulary shard") &&
                            EndsWith(on_last_rank()));
    unchanged();
  }
  SECTION("jsd's beta out of range on the last rank") {
    DistillationOptions o;
    o.divergence = Divergence::jsd;
    o.beta = last ? 1.5 : 0.5;
    const std::string message = agreed_error<embedhead::value_error>(head(o, s.W_s, s.W_T_s));
    CHECK_THAT(message, Contains("beta = 1.5 outside [0, 1]") && EndsWith(on_last_rank()));
    unchanged();
  }
  SECTION("a student shard of the wrong rows on the last rank") {
    const RowMatrix<Scalar> W_bad = last ? RowMatrix<Scalar>(RowMatrix<Scalar>::Zero(rows + 1, s.d)) : s.W_s;
    const std::string message = agreed_error<embedhead::shape_error>(head({}, W_bad, s.W_T_s));
    const std::string wider = std::to_string(embedhead::vocab_shard(53, R - 1, R).rows() + 1);
    CHECK_THAT(message, Contains("W_shard is [" + wider + ", 6], expected [" + last_rows + ", 6]") &&
                            Contains("of V = 53") && EndsWith(on_last_rank()));
    unchanged();
  }
  SECTION("a teacher shard of the wrong width on the last rank") {
    const RowMatrix<Scalar> W_T_bad = last ? RowMatrix<Scalar>(RowMatrix<Scalar>::Zero(rows, s.d_T + 1)) : s.W_T_s;
    const std::string message = agreed_error<embedhead::shape_error>(head({}, s.W_s, W_T_bad));
    CHECK_THAT(message, Contains("W_T_shard is [" + last_rows + ", 6], expected [" + last_rows + ", 5]") &&
                            EndsWith(on_last_rank()));
    unchanged();
  }
  SECTION("a mask value out of range on the last rank") {
    if (last) mask(3, 0) = Scalar(2);
    const std::string message = agreed_error<embedhead::value_error>(head({}, s.W_s, s.W_T_s));
    CHECK_THAT(message, Contains("mask 2 at n=3 outside {0, 1}") && EndsWith(on_last_rank()));
    unchanged();
  }
  SECTION("masks that differ across ranks") {
    if (last && R > 1) mask(2, 0) = Scalar(0);
    if (R > 1) {
      const std::string message = agreed_error<embedhead::value_error>(head({}, s.W_s, s.W_T_s));
      CHECK_THAT(message,
                 Contains("vocab_parallel_distill_head_forward_backward") && Contains("disagree") && Contains("mask"));
      unchanged();
    }
  }
  SECTION("V below the number of ranks") {
    if (R > 1) {
      const std::string message = agreed_error<embedhead::value_error>([&] {
        embedhead::vocab_parallel_distill_head<Scalar>(comm, 1, s.h, s.W_s, s.b_s, s.h_T, s.W_T_s, s.b_T_s, ws, {},
                                                       extras());
      });
      CHECK_THAT(message, Contains("V = 1 rows over " + std::to_string(R) + " ranks"));
      unchanged();
    }
  }
  SECTION("a dense row that does not normalise on the last rank") {
    RowMatrix<Scalar> logprobs = s.logprobs;
    if (last) logprobs(4, 50) = Scalar(0);  // probability 1 more: log sum exp about log 2
    const std::string message = agreed_error<embedhead::value_error>([&] {
      embedhead::vocab_parallel_distill_logprobs_forward_backward<Scalar>(comm, s.V, s.h, s.W_s, s.b_s, logprobs, dh,
                                                                          dW, db, ws, {}, extras());
    });
    CHECK_THAT(message, Contains("vocab_parallel_distill_logprobs_forward_backward") &&
                            Contains("teacher log-probs at n=4 have log sum exp") && EndsWith(on_last_rank()));
    unchanged();
  }
  SECTION("dense log-probs of a shard's width instead of V") {
    const RowMatrix<Scalar> narrow = s.logprobs.leftCols(rows);
    if (R > 1) {
      const std::string message = agreed_error<embedhead::shape_error>([&] {
        embedhead::vocab_parallel_distill_logprobs_forward_backward<Scalar>(comm, s.V, s.h, s.W_s, s.b_s, narrow, dh,
                                                                            dW, db, ws, {}, extras());
      });
      CHECK_THAT(message, Contains("teacher log-probs") && Contains("53"));
      unchanged();
    }
  }
  SECTION("the loss alone on the last rank, the gradient on the others") {
    if (R > 1) {
      // Every rank throws value_error; the messages differ only in the function each rank called.
      std::string message;
      try {
        if (last)
          embedhead::vocab_parallel_distill_head<Scalar>(comm, s.V, s.h, s.W_s, s.b_s, s.h_T, s.W_T_s, s.b_T_s, ws, {},
                                                         extras());
        else
          head({}, s.W_s, s.W_T_s)();
      } catch (const embedhead::value_error& e) {
        message = e.what();
      }
      CHECK_THAT(message, Contains(last ? "vocab_parallel_distill_head: ranks 0 and "
                                        : "vocab_parallel_distill_head_forward_backward: ranks 0 and ") &&
                              Contains("disagree on the call (loss or gradient)"));
      unchanged();
    }
  }
  SECTION("the teacher's gradient asked for on every rank but the last") {
    RowMatrix<Scalar> no_dh_T(0, 0);
    if (R > 1) {
      const std::string message = agreed_error<embedhead::value_error>([&] {
        embedhead::vocab_parallel_distill_head_forward_backward<Scalar>(comm, s.V, s.h, s.W_s, s.b_s, s.h_T, s.W_T_s,
                                                                        s.b_T_s, dh, dW, db, last ? no_dh_T : dh_T,
                                                                        last ? no_dh_T : dW_T, last ? no_dh_T : db_T,
                                                                        ws, {}, extras());
      });
      CHECK_THAT(message, Contains("disagree"));
      unchanged();
    }
  }
  SECTION("a dense teacher with a zero-probability class for reverse_kl on the last rank") {
    RowMatrix<Scalar> logprobs = s.logprobs;
    if (last) {
      // Class 0's probability moved to class 1: the row still normalises.
      const double p0 = std::exp(static_cast<double>(logprobs(2, 0))),
                   p1 = std::exp(static_cast<double>(logprobs(2, 1)));
      logprobs(2, 1) = static_cast<Scalar>(std::log(p0 + p1));
      logprobs(2, 0) = -std::numeric_limits<Scalar>::infinity();
    }
    DistillationOptions o;
    o.divergence = Divergence::reverse_kl;
    const std::string message = agreed_error<embedhead::value_error>([&] {
      embedhead::vocab_parallel_distill_logprobs_forward_backward<Scalar>(comm, s.V, s.h, s.W_s, s.b_s, logprobs, dh,
                                                                          dW, db, ws, o, extras());
    });
    CHECK_THAT(message, Contains("teacher log-probs -inf at n=2, column 0") && EndsWith(on_last_rank()));
    unchanged();
  }
  SECTION("a top-k call with reverse_kl on the last rank") {
    const TeacherTopK<Scalar> top{s.top_ids, s.top_logprobs};
    DistillationOptions o;
    if (last) o.divergence = Divergence::reverse_kl;
    const std::string message = agreed_error<embedhead::value_error>([&] {
      embedhead::vocab_parallel_distill_topk_forward_backward<Scalar>(comm, s.V, s.h, s.W_s, s.b_s, top, dh, dW, db, ws,
                                                                      o, extras());
    });
    CHECK_THAT(message, Contains("divergence reverse_kl outside {forward_kl}") && EndsWith(on_last_rank()));
    unchanged();
  }
  SECTION("a top-k id out of range on the last rank") {
    IdMatrix<std::int64_t> ids = s.top_ids;
    if (last) ids(6, 1) = 53;
    const TeacherTopK<Scalar> top{ids, s.top_logprobs};
    const std::string message = agreed_error<embedhead::index_error>([&] {
      embedhead::vocab_parallel_distill_topk_forward_backward<Scalar>(comm, s.V, s.h, s.W_s, s.b_s, top, dh, dW, db, ws,
                                                                      {}, extras());
    });
    CHECK_THAT(message, Contains("teacher top-k id 53 at n=6, column 1 outside [0, 53)") && EndsWith(on_last_rank()));
    unchanged();
  }
  SECTION("top-k ids that differ across ranks") {
    IdMatrix<std::int64_t> ids = s.top_ids;
    if (last && R > 1) std::swap(ids(0, 0), ids(0, 1));
    const TeacherTopK<Scalar> top{ids, s.top_logprobs};
    if (R > 1) {
      const std::string message = agreed_error<embedhead::value_error>(
          [&] { embedhead::vocab_parallel_distill_topk<Scalar>(comm, s.V, s.h, s.W_s, s.b_s, top, ws, {}, extras()); });
      CHECK_THAT(message, Contains("disagree"));
      unchanged();
    }
  }
}
