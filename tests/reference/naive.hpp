// Naive reference implementations for the tests and benchmarks: the textbook formulas written as
// plainly as possible (dense one-hot matrices, full V x d gradients, explicit loops), so that the
// library's fast paths can be compared with something obviously right.
#ifndef EMBEDHEAD_TESTS_REFERENCE_NAIVE_HPP
#define EMBEDHEAD_TESTS_REFERENCE_NAIVE_HPP

#include <embedhead/types.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

namespace naive {

using embedhead::Index;
using embedhead::RowMatrix;

// ids [B, T] -> one_hot [B*T, V]: row b*T + t has a single 1 at column ids(b, t).
template <typename Scalar, typename IdMatrixT>
RowMatrix<Scalar> one_hot(const IdMatrixT& ids, Index V) {
  RowMatrix<Scalar> O = RowMatrix<Scalar>::Zero(ids.size(), V);
  for (Index b = 0; b < ids.rows(); ++b)
    for (Index t = 0; t < ids.cols(); ++t) O(b * ids.cols() + t, static_cast<Index>(ids(b, t))) = Scalar(1);
  return O;
}

// ids [B, T], E [V, d] -> one_hot(ids) * E [B*T, d], by a dense matrix product.
template <typename Scalar, typename IdMatrixT>
RowMatrix<Scalar> one_hot_lookup(const IdMatrixT& ids, const RowMatrix<Scalar>& E) {
  RowMatrix<Scalar> O = one_hot<Scalar>(ids, E.rows());
  return O * E;
}

// ids [B, T], dout [B*T, d] -> dense dE [V, d] += scale * dout rows, token by token in order n,
// skipping padding_idx (-1 for none).
template <typename Scalar, typename IdMatrixT>
void embedding_backward_dense(const IdMatrixT& ids, const RowMatrix<Scalar>& dout, Scalar scale, Index padding_idx,
                              RowMatrix<Scalar>& dE) {
  for (Index n = 0; n < ids.size(); ++n) {
    const Index v = static_cast<Index>(ids(n / ids.cols(), n % ids.cols()));
    if (v == padding_idx) continue;
    for (Index j = 0; j < dE.cols(); ++j) dE(v, j) += scale * dout(n, j);
  }
}

// Per-row softmax cross-entropy, straight from the definition, in double.
// Returns the summed loss over non-ignored rows; count receives their number.
template <typename Scalar, typename TargetsT>
double cross_entropy_sum(const RowMatrix<Scalar>& logits, const TargetsT& targets, Index ignore_index, Index& count) {
  double total = 0;
  count = 0;
  for (Index n = 0; n < logits.rows(); ++n) {
    const Index y = static_cast<Index>(targets(n / targets.cols(), n % targets.cols()));
    if (y == ignore_index) continue;
    ++count;
    double m = -INFINITY;
    for (Index j = 0; j < logits.cols(); ++j) m = std::max(m, static_cast<double>(logits(n, j)));
    double s = 0;
    for (Index j = 0; j < logits.cols(); ++j) s += std::exp(static_cast<double>(logits(n, j)) - m);
    total += m + std::log(s) - static_cast<double>(logits(n, y));
  }
  return total;
}

// The loss with every option, straight from the definitions, in double (PyTorch's formulas):
//   s_j  = cap tanh(z_j / cap) (cap > 0) else z_j, over the first `classes` columns only
//   log p_j = s_j - log sum_k exp(s_k)
//   loss_n = w_n * ( -(1 - eps) log p_y - (eps / classes) sum_j log p_j + z_coef * lse^2 )
// reduced by mean (divided by the sum of w_n over counted rows), sum or none (sum). dlogits [N, V]
// receives the hand-derived gradient of the reduced loss times gradient_scale:
//   d loss_n / d s_k = w_n (p_k - (1 - eps) [k = y] - eps / classes + 2 z_coef lse p_k)
//   d s_k / d z_k    = 1 - tanh(z_k / cap)^2
// and 0 in padding columns and ignored rows. lse [N] and losses [N] (w_n * loss_n) are filled too.
// With class weights u (PyTorch's cross_entropy(weight=u, label_smoothing=eps), LossNLL.cpp):
//   loss_n = w_n ( -(1 - eps) u_y log p_y - (eps / classes) sum_j u_j log p_j + u_y (z_coef lse^2 - beta H) )
// and the mean divides by sum_n w_n u_{y_n} (PyTorch divides both its nll and its smoothing term by
// the sum of the targets' weights); each term's gradient is summed term by term below.
struct LossOptions {
  Index ignore_index = -100;
  bool mean = true;  // false: sum (and none, whose outputs are the same sums)
  double label_smoothing = 0;
  double z_loss = 0;
  double softcap = 0;
  Index classes = -1;  // -1: all columns
  double gradient_scale = 1;
  double entropy_bonus = 0;           // beta: -beta H_n added to each row's loss
  std::vector<double> class_weights;  // u [classes]; empty: all 1
};

struct LossResult {
  double loss = 0, sum = 0, weight_sum = 0;
  double entropy = 0;  // weighted entropies, reduced as the loss
  Index count = 0;
  RowMatrix<double> dlogits;
  std::vector<double> lse, losses;
  std::vector<double> entropies;  // each counted row's H_n (0 for ignored rows)
};

template <typename TargetsT>
LossResult full_loss(const RowMatrix<double>& logits, const TargetsT& targets, const std::vector<double>& weights,
                     const LossOptions& o) {
  const Index N = logits.rows(), V = logits.cols(), C = o.classes < 0 ? V : o.classes;
  LossResult r;
  r.dlogits = RowMatrix<double>::Zero(N, V);
  r.lse.assign(static_cast<std::size_t>(N), 0.0);
  r.losses.assign(static_cast<std::size_t>(N), 0.0);
  r.entropies.assign(static_cast<std::size_t>(N), 0.0);
  auto target = [&](Index n) { return static_cast<Index>(targets(n / targets.cols(), n % targets.cols())); };
  auto weight = [&](Index n) { return weights.empty() ? 1.0 : weights[static_cast<std::size_t>(n)]; };
  auto u = [&](Index j) { return o.class_weights.empty() ? 1.0 : o.class_weights[static_cast<std::size_t>(j)]; };
  for (Index n = 0; n < N; ++n)
    if (target(n) != o.ignore_index) {
      ++r.count;
      r.weight_sum += weight(n) * u(target(n));
    }
  const double scale = (o.mean ? (r.weight_sum > 0 ? 1.0 / r.weight_sum : 0.0) : 1.0) * o.gradient_scale;
  for (Index n = 0; n < N; ++n) {
    const Index y = target(n);
    if (y == o.ignore_index) continue;
    std::vector<double> s(static_cast<std::size_t>(C));
    for (Index j = 0; j < C; ++j) s[j] = o.softcap > 0 ? o.softcap * std::tanh(logits(n, j) / o.softcap) : logits(n, j);
    const double m = *std::max_element(s.begin(), s.end());
    double total = 0;
    for (Index j = 0; j < C; ++j) total += std::exp(s[j] - m);
    const double lse = m + std::log(total);
    double smooth = 0;
    for (Index j = 0; j < C; ++j) smooth -= u(j) * (s[j] - lse);  // -sum_j u_j log p_j
    // H = -sum_j p_j log p_j, straight from the definition.
    double H = 0;
    for (Index j = 0; j < C; ++j) H -= std::exp(s[j] - lse) * (s[j] - lse);
    const double loss_n = weight(n) * (-(1 - o.label_smoothing) * u(y) * (s[y] - lse) + o.label_smoothing / C * smooth +
                                       u(y) * (o.z_loss * lse * lse - o.entropy_bonus * H));
    r.entropy += weight(n) * u(y) * H;
    r.entropies[static_cast<std::size_t>(n)] = H;
    r.sum += loss_n;
    r.lse[n] = lse;
    r.losses[n] = loss_n;
    double U = 0;
    for (Index j = 0; j < C; ++j) U += u(j);
    for (Index k = 0; k < C; ++k) {
      const double p = std::exp(s[k] - lse);
      // d(-log p_j)/ds_k = p_k - [k = j]: the target's term, then the smoothing's sum over j.
      double g = (1 - o.label_smoothing) * u(y) * (p - (k == y ? 1.0 : 0.0));
      g += o.label_smoothing / C * (U * p - u(k));
      g += u(y) * 2 * o.z_loss * lse * p;
      // d(-beta H)/ds_k = beta p_k (log p_k + H), from dH/ds_k = -p_k (log p_k + H).
      g += u(y) * o.entropy_bonus * p * ((s[k] - lse) + H);
      if (o.softcap > 0) {
        const double t = std::tanh(logits(n, k) / o.softcap);
        g *= 1 - t * t;
      }
      r.dlogits(n, k) = weight(n) * scale * g;
    }
  }
  r.loss = o.mean ? (r.weight_sum > 0 ? r.sum / r.weight_sum : 0.0) : r.sum;
  if (o.mean) r.entropy = r.weight_sum > 0 ? r.entropy / r.weight_sum : 0.0;
  return r;
}

// Soft (probability) targets, PyTorch's cross_entropy with a [N, C] float target (aten
// LossNLL.cpp), plus the z-loss and entropy terms it does not have: logits [N, V] (classes: the
// first o.classes columns), targets t [N, classes] with
//   t'_c = (1 - eps) t_c + eps / C,  loss_n = -sum_c u_c t'_c log p_c + z lse^2 - beta H_n,
// p = softmax(s) over the classes, s = c tanh(z / c) with softcap c. Each row counts once: the mean
// divides by N. The gradient is each term's derivative, times the softcap's 1 - (s_j / c)^2:
//   d/ds_j (-sum_c v_c log p_c) = (sum_c v_c) p_j - v_j,  d/ds_j lse^2 = 2 lse p_j,
//   d/ds_j (-H) = p_j (log p_j + H).
// A term with u_c t'_c = 0 adds 0 (where PyTorch's 0 * log 0 would be NaN).
inline LossResult soft_loss(const RowMatrix<double>& logits, const RowMatrix<double>& targets, const LossOptions& o) {
  const Index N = logits.rows(), V = logits.cols(), C = o.classes < 0 ? V : o.classes;
  LossResult r;
  r.dlogits = RowMatrix<double>::Zero(N, V);
  r.losses.assign(static_cast<std::size_t>(N), 0.0);
  r.count = N;
  r.weight_sum = static_cast<double>(N);
  const double scale = o.gradient_scale * (o.mean ? 1.0 / static_cast<double>(N) : 1.0);
  for (Index n = 0; n < N; ++n) {
    std::vector<double> s(static_cast<std::size_t>(C)), p(s.size()), v(s.size());
    for (Index j = 0; j < C; ++j) s[j] = o.softcap > 0 ? o.softcap * std::tanh(logits(n, j) / o.softcap) : logits(n, j);
    double m = -INFINITY;
    for (Index j = 0; j < C; ++j) m = std::max(m, s[j]);
    double S = 0;
    for (Index j = 0; j < C; ++j) S += std::exp(s[j] - m);
    const double lse = m + std::log(S);
    double H = 0, ce = 0, T = 0;
    for (Index j = 0; j < C; ++j) {
      p[j] = std::exp(s[j] - lse);
      if (p[j] > 0) H -= p[j] * (s[j] - lse);
      const double u = o.class_weights.empty() ? 1.0 : o.class_weights[static_cast<std::size_t>(j)];
      v[j] = u * ((1 - o.label_smoothing) * targets(n, j) + o.label_smoothing / static_cast<double>(C));
      T += v[j];
      if (v[j] != 0) ce -= v[j] * (s[j] - lse);
    }
    const double loss = ce + o.z_loss * lse * lse - o.entropy_bonus * H;
    r.losses[static_cast<std::size_t>(n)] = loss;
    r.sum += loss;
    r.entropy += H;
    for (Index j = 0; j < C; ++j) {
      double g = T * p[j] - v[j] + 2 * o.z_loss * lse * p[j];
      if (p[j] > 0) g += o.entropy_bonus * p[j] * (s[j] - lse + H);
      if (o.softcap > 0) g *= 1 - (s[j] / o.softcap) * (s[j] / o.softcap);
      r.dlogits(n, j) = scale * g;
    }
  }
  r.loss = o.mean ? r.sum / static_cast<double>(N) : r.sum;
  if (o.mean) r.entropy /= static_cast<double>(N);
  return r;
}

// Central finite differences of a scalar function f over every entry of x (double):
//   g_i = (f(x + eps e_i) - f(x - eps e_i)) / (2 eps).
inline RowMatrix<double> numerical_gradient(RowMatrix<double>& x, const std::function<double()>& f, double eps = 1e-6) {
  RowMatrix<double> g(x.rows(), x.cols());
  for (Index i = 0; i < x.size(); ++i) {
    double& xi = x.data()[i];
    const double saved = xi;
    xi = saved + eps;
    const double plus = f();
    xi = saved - eps;
    const double minus = f();
    xi = saved;
    g.data()[i] = (plus - minus) / (2 * eps);
  }
  return g;
}

// Largest relative error |a - n| / max(|a|, |n|, floor) over all entries (floor avoids 0/0 where
// both are ~0).
inline double max_relative_error(const RowMatrix<double>& analytic, const RowMatrix<double>& numeric,
                                 double floor = 1e-7) {
  double worst = 0;
  for (Index i = 0; i < analytic.size(); ++i) {
    const double a = analytic.data()[i], n = numeric.data()[i];
    worst = std::max(worst, std::abs(a - n) / std::max({std::abs(a), std::abs(n), floor}));
  }
  return worst;
}

// ---- geometry (geometry_test, geometry_bench) ----

// cosine(x, y) in double straight from the definition, 0 when either is the zero vector.
template <typename RowA, typename RowB>
double cosine(const RowA& x, const RowB& y) {
  double dot = 0, xx = 0, yy = 0;
  for (Index j = 0; j < x.size(); ++j) {
    dot += double(x[j]) * double(y[j]);
    xx += double(x[j]) * double(x[j]);
    yy += double(y[j]) * double(y[j]);
  }
  return xx > 0 && yy > 0 ? dot / (std::sqrt(xx) * std::sqrt(yy)) : 0.0;
}

// queries [Q, d], E [V, d] -> (ids, scores) [Q, k] of the brute-force top-k: every score of the
// [Q, V] all-pairs matrix in double, fully sorted by (score desc, id asc), excluded ids removed,
// padded with (-1, -inf).
template <typename Scalar>
void top_k(const RowMatrix<Scalar>& E, const RowMatrix<Scalar>& queries, Index k, bool cosine_similarity,
           const std::vector<std::vector<Index>>& exclude, RowMatrix<Index>& ids, RowMatrix<double>& scores) {
  ids = RowMatrix<Index>::Constant(queries.rows(), k, -1);
  scores = RowMatrix<double>::Constant(queries.rows(), k, -INFINITY);
  for (Index q = 0; q < queries.rows(); ++q) {
    std::vector<std::pair<double, Index>> all;
    for (Index v = 0; v < E.rows(); ++v) {
      if (!exclude.empty() && std::count(exclude[q].begin(), exclude[q].end(), v) > 0) continue;
      double s = 0;
      if (cosine_similarity) {
        s = cosine(queries.row(q), E.row(v));
      } else {
        for (Index j = 0; j < E.cols(); ++j) s += double(queries(q, j)) * double(E(v, j));
      }
      all.emplace_back(s, v);
    }
    std::sort(all.begin(), all.end(), [](const std::pair<double, Index>& a, const std::pair<double, Index>& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    for (Index i = 0; i < k && i < static_cast<Index>(all.size()); ++i) {
      ids(q, i) = all[static_cast<std::size_t>(i)].second;
      scores(q, i) = all[static_cast<std::size_t>(i)].first;
    }
  }
}

// E [V, d] -> the mean of cosine(E[i], E[j]) over all V (V - 1) ordered pairs i != j, O(V^2 d).
template <typename Scalar>
double mean_pairwise_cosine(const RowMatrix<Scalar>& E) {
  double sum = 0;
  for (Index i = 0; i < E.rows(); ++i)
    for (Index j = 0; j < E.rows(); ++j)
      if (i != j) sum += cosine(E.row(i), E.row(j));
  const double V = static_cast<double>(E.rows());
  return sum / (V * (V - 1));
}

// E [V, d] -> the population covariance [d, d] = (1/V) sum_v (E[v] - mu)(E[v] - mu)^T in double.
template <typename Scalar>
Eigen::MatrixXd covariance(const RowMatrix<Scalar>& E) {
  const Eigen::MatrixXd X = E.template cast<double>();
  const Eigen::RowVectorXd mu = X.colwise().mean();
  const Eigen::MatrixXd C = X.rowwise() - mu;
  return C.transpose() * C / static_cast<double>(E.rows());
}

}  // namespace naive

#endif  // EMBEDHEAD_TESTS_REFERENCE_NAIVE_HPP
