// Small helpers shared by several tests/*_test.cpp files: seeded random inputs and exact
// comparisons of matrices. Helpers that only one test file needs stay in that file.
//
// The random inputs come from std::mt19937_64, not from the library's embedhead::Rng, so test data
// shares no code with what is being tested. Every test that uses them checks a property (against a
// naive reference, finite differences or an invariant), so the particular values do not matter;
// a fixed seed only makes a failure reproducible.
#ifndef EMBEDHEAD_TESTS_REFERENCE_TEST_SUPPORT_HPP
#define EMBEDHEAD_TESTS_REFERENCE_TEST_SUPPORT_HPP

#include <embedhead/types.hpp>

#include <algorithm>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace test_support {

using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::RowMatrix;

// -> m [rows, cols], entries uniform in [-scale, scale), drawn in double and rounded once to Scalar.
// The same (rows, cols, seed, scale) always gives the same matrix. To draw several matrices from
// one stream, pass seeds taken from it: random_matrix<S>(r, c, gen()).
template <typename Scalar>
RowMatrix<Scalar> random_matrix(Index rows, Index cols, std::uint64_t seed, double scale = 1.0) {
  static_assert(std::is_floating_point_v<Scalar>, "random_matrix needs a floating-point Scalar");
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> dist(-scale, scale);
  RowMatrix<Scalar> m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = static_cast<Scalar>(dist(gen));
  return m;
}

// -> ids [B, T], each uniform over [0, V) (V >= 1), so repeated ids are likely once B*T is
// comparable to V. Used for token ids and for cross-entropy targets alike.
template <typename Id>
IdMatrix<Id> random_ids(Index B, Index T, Index V, std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<long long> dist(0, static_cast<long long>(V) - 1);
  IdMatrix<Id> ids(B, T);
  for (Index i = 0; i < ids.size(); ++i) ids.data()[i] = static_cast<Id>(dist(gen));
  return ids;
}

// Exact equality of two matrices: same shape and a(r, c) == b(r, c) everywhere. This is IEEE
// equality, not bit equality: a NaN anywhere fails, -0 equals +0. For "state unchanged after a
// throw" and "same result from two code paths" checks, where any rounding difference is a bug.
template <typename A, typename B>
bool same_values(const A& a, const B& b) {
  if (a.rows() != b.rows() || a.cols() != b.cols()) return false;
  for (Index r = 0; r < a.rows(); ++r)
    for (Index c = 0; c < a.cols(); ++c)
      if (!(a(r, c) == b(r, c))) return false;
  return true;
}

// The same test as same_values, reported as text for short failure output: "" if equal, else the
// shapes or the first differing entry, "(r, c): a vs b" with 17 significant digits.
template <typename A, typename B>
std::string first_difference(const A& a, const B& b) {
  std::ostringstream out;
  if (a.rows() != b.rows() || a.cols() != b.cols()) {
    out << "shapes [" << a.rows() << ", " << a.cols() << "] vs [" << b.rows() << ", " << b.cols() << "]";
    return out.str();
  }
  for (Index r = 0; r < a.rows(); ++r)
    for (Index c = 0; c < a.cols(); ++c)
      if (!(a(r, c) == b(r, c))) {
        out.precision(17);
        out << "(" << r << ", " << c << "): " << a(r, c) << " vs " << b(r, c);
        return out.str();
      }
  return {};
}

// first_difference that also matches a NaN with a NaN (and still -0 with +0): "" when both have
// the same shape and every entry is equal or NaN in both. For the non-finite tests, where a NaN
// is the expected value in some places and a bug in others.
template <typename A, typename B>
std::string first_difference_nan(const A& a, const B& b) {
  std::ostringstream out;
  if (a.rows() != b.rows() || a.cols() != b.cols()) {
    out << "shapes [" << a.rows() << ", " << a.cols() << "] vs [" << b.rows() << ", " << b.cols() << "]";
    return out.str();
  }
  for (Index r = 0; r < a.rows(); ++r)
    for (Index c = 0; c < a.cols(); ++c) {
      const auto x = a(r, c);
      const auto y = b(r, c);
      if (!(x == y) && !(x != x && y != y)) {
        out.precision(17);
        out << "(" << r << ", " << c << "): " << x << " vs " << y;
        return out.str();
      }
    }
  return {};
}

// -> [first, first + 1, ..., last - 1]; empty if last <= first. Expected touched-row lists and
// "every id" batches.
inline std::vector<Index> range(Index first, Index last) {
  std::vector<Index> v;
  for (Index i = first; i < last; ++i) v.push_back(i);
  return v;
}

// The tolerance of close() for results that are sums of O(1) products in Scalar.
template <typename Scalar>
double tolerance() {
  return std::is_same_v<Scalar, float> ? 2e-5 : 1e-12;
}

// max |a - b| <= tol * max(1, max |b|): the tolerance of a sum of products whose terms are O(1).
template <typename A, typename B>
bool close(const A& a, const B& b, double tol) {
  if (a.rows() != b.rows() || a.cols() != b.cols()) return false;
  if (a.size() == 0) return true;
  using Double = embedhead::RowMatrix<double>;
  const Double da = a.template cast<double>(), db = b.template cast<double>();
  return (da - db).cwiseAbs().maxCoeff() <= tol * std::max(1.0, db.cwiseAbs().maxCoeff());
}

// Class weights u [C] for the loss tests: unequal (0.25 to 2.25), class 3 weighted 0 (C > 3).
inline std::vector<double> class_weights(Index C) {
  std::vector<double> u(static_cast<std::size_t>(C));
  for (Index j = 0; j < C; ++j) u[static_cast<std::size_t>(j)] = 0.25 + 0.5 * static_cast<double>((j * 7) % 5);
  u[3] = 0;
  return u;
}

}  // namespace test_support

#endif  // EMBEDHEAD_TESTS_REFERENCE_TEST_SUPPORT_HPP
