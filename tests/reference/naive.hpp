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

}  // namespace naive

#endif  // EMBEDHEAD_TESTS_REFERENCE_NAIVE_HPP
