// Tests for analysis/geometry.hpp against naive references in double (tests/reference/naive.hpp):
// per-row statistics, the exact anisotropy formula vs the O(V^2) mean, neighbours vs brute-force
// all-pairs top-k (ties, duplicates, k > V, exclusions, zero rows), PCA vs
// Eigen::SelfAdjointEigenSolver on the covariance, projection, analogies on a constructed table,
// the under-trained indicators on a synthetic table, progress reporting and every documented error.
//
// This file is also built with OpenMP as geometry_threads_test (tests/CMakeLists.txt); there the
// last test case checks that 1 and 2 threads give bit-identical results.
#include <embedhead/analysis/geometry.hpp>

#include "../reference/naive.hpp"
#include "../reference/test_support.hpp"

#include <catch2/catch.hpp>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <set>
#include <stdexcept>
#include <tuple>
#include <utility>
#include <vector>

using Catch::Matchers::Contains;
using Catch::Matchers::WithinAbs;
using Catch::Matchers::WithinRel;
using embedhead::Index;
using embedhead::Neighbours;
using embedhead::RowMatrix;
using embedhead::Similarity;
using test_support::random_matrix;

namespace {

// E [V, d] with integer entries in [-range, range]: all dot products exact in any order, so equal
// scores are exactly equal (ties), and with V large against (2 range + 1)^d, duplicate rows.
template <typename Scalar>
RowMatrix<Scalar> integer_table(Index V, Index d, int range, std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int> dist(-range, range);
  RowMatrix<Scalar> E(V, d);
  for (Index i = 0; i < E.size(); ++i) E.data()[i] = static_cast<Scalar>(dist(gen));
  return E;
}

template <typename Scalar>
double naive_score(const RowMatrix<Scalar>& E, const RowMatrix<Scalar>& queries, Index q, Index v, bool cosine) {
  if (cosine) return naive::cosine(queries.row(q), E.row(v));
  double s = 0;
  for (Index j = 0; j < E.cols(); ++j) s += double(queries(q, j)) * double(E(v, j));
  return s;
}

// got vs the brute-force top-k: same shape, scores within tol (relative to the largest), ids
// equal except where the two candidates are tied within tol; every id valid, distinct, not
// excluded; padding (-1, -inf) exactly where the reference pads.
template <typename Scalar>
void check_against_naive(const Neighbours& got, const RowMatrix<Scalar>& E, const RowMatrix<Scalar>& queries, Index k,
                         bool cosine, const std::vector<std::vector<Index>>& exclude, double tol) {
  RowMatrix<Index> ids;
  RowMatrix<double> scores;
  naive::top_k(E, queries, k, cosine, exclude, ids, scores);
  REQUIRE(got.ids.rows() == queries.rows());
  REQUIRE(got.ids.cols() == k);
  REQUIRE(got.scores.rows() == queries.rows());
  REQUIRE(got.scores.cols() == k);
  double scale = 1;
  for (Index i = 0; i < scores.size(); ++i)
    if (std::isfinite(scores.data()[i])) scale = std::max(scale, std::abs(scores.data()[i]));
  for (Index q = 0; q < queries.rows(); ++q) {
    std::set<Index> seen;
    for (Index i = 0; i < k; ++i) {
      INFO("query " << q << ", rank " << i);
      if (ids(q, i) == -1) {
        REQUIRE(got.ids(q, i) == -1);
        REQUIRE(got.scores(q, i) == -std::numeric_limits<double>::infinity());
        continue;
      }
      const Index id = got.ids(q, i);
      REQUIRE(id >= 0);
      REQUIRE(id < E.rows());
      REQUIRE(seen.insert(id).second);
      if (!exclude.empty()) REQUIRE(std::count(exclude[q].begin(), exclude[q].end(), id) == 0);
      REQUIRE(std::abs(got.scores(q, i) - scores(q, i)) <= tol * scale);
      if (id != ids(q, i)) REQUIRE(std::abs(naive_score(E, queries, q, id, cosine) - scores(q, i)) <= tol * scale);
    }
  }
}

}  // namespace

TEMPLATE_TEST_CASE("geometry: row norms, centroid and centroid distances match the naive formulas", "[geometry]", float,
                   double) {
  using S = TestType;
  for (const Index d : {Index{1}, Index{15}, Index{16}, Index{17}}) {
    for (const Index V : {Index{1}, Index{7}, Index{1500}}) {
      INFO("V = " << V << ", d = " << d);
      const RowMatrix<S> E = random_matrix<S>(V, d, 100 + V + d);
      const Eigen::VectorXd norms = embedhead::row_norms<S>(E);
      const Eigen::VectorXd c = embedhead::centroid<S>(E);
      const Eigen::VectorXd dist = embedhead::centroid_distances<S>(E, c);
      const Eigen::MatrixXd X = E.template cast<double>();
      const Eigen::VectorXd c_ref = X.colwise().mean().transpose();
      REQUIRE(norms.size() == V);
      REQUIRE(dist.size() == V);
      REQUIRE(c.size() == d);
      REQUIRE(test_support::close(c, c_ref, 1e-13));
      for (Index v = 0; v < V; ++v) {
        REQUIRE_THAT(norms[v], WithinRel(X.row(v).norm(), 1e-13) || WithinAbs(0, 1e-300));
        REQUIRE_THAT(dist[v], WithinRel((X.row(v) - c_ref.transpose()).norm(), 1e-12) || WithinAbs(0, 1e-13));
      }
    }
  }
}

TEMPLATE_TEST_CASE("geometry: mean pairwise cosine equals the O(V^2) mean over ordered pairs", "[geometry]", float,
                   double) {
  using S = TestType;
  // An anisotropic table (a shared offset), zero rows included: cosine with a zero row is 0.
  RowMatrix<S> E = random_matrix<S>(60, 9, 7);
  E.rowwise() += RowMatrix<S>::Constant(1, 9, S(0.7)).row(0);
  E.row(3).setZero();
  E.row(41).setZero();
  const double got = embedhead::mean_pairwise_cosine<S>(E);
  REQUIRE_THAT(got, WithinRel(naive::mean_pairwise_cosine(E), 1e-12));
  REQUIRE(got > 0.3);  // the offset makes the cone narrow
  // Two rows: the cosine itself; V = 2 with one zero row throws.
  RowMatrix<S> two(2, 3);
  two << 1, 0, 0, 1, 1, 0;
  REQUIRE_THAT(embedhead::mean_pairwise_cosine<S>(two), WithinRel(1 / std::sqrt(2.0), 1e-12));
  REQUIRE_THAT(embedhead::row_similarity<S>(two, 0, 1, Similarity::cosine), WithinRel(1 / std::sqrt(2.0), 1e-15));
  REQUIRE(embedhead::row_similarity<S>(two, 0, 1, Similarity::dot) == 1.0);
  two.row(1).setZero();
  REQUIRE(embedhead::row_similarity<S>(two, 0, 1, Similarity::cosine) == 0.0);
  REQUIRE_THROWS_AS(embedhead::mean_pairwise_cosine<S>(two), embedhead::value_error);
}

TEMPLATE_TEST_CASE("geometry: neighbours equal brute-force top-k, ties broken by smaller id", "[geometry]", float,
                   double) {
  using S = TestType;
  // Integer entries: exact dot products, many ties and duplicate rows; V spans 3 blocks of 1024
  // rows and Q 2 blocks of 256 queries.
  const Index V = 2600, d = 5, Q = 300;
  RowMatrix<S> E = integer_table<S>(V, d, 2, 1);
  E.row(17).setZero();
  E.row(2000).setZero();
  RowMatrix<S> queries = integer_table<S>(Q, d, 2, 2);
  queries.row(5).setZero();  // a zero query: every cosine is 0, so ids 0, 1, 2, ... win
  SECTION("dot: exact scores, exact ids") {
    for (const Index k : {Index{1}, Index{10}, Index{37}}) {
      const Neighbours got = embedhead::nearest_neighbours<S>(E, queries, k, Similarity::dot);
      RowMatrix<Index> ids;
      RowMatrix<double> scores;
      naive::top_k(E, queries, k, false, {}, ids, scores);
      REQUIRE(test_support::first_difference(got.ids, ids) == "");
      REQUIRE(test_support::first_difference(got.scores, scores) == "");
    }
  }
  SECTION("cosine, with zero rows and a zero query") {
    const Neighbours got = embedhead::nearest_neighbours<S>(E, queries, 12);
    check_against_naive(got, E, queries, 12, true, {}, test_support::tolerance<S>());
    for (Index i = 0; i < 12; ++i) {
      REQUIRE(got.ids(5, i) == i);
      REQUIRE(got.scores(5, i) == 0.0);
    }
    // Duplicate rows have bit-identical scores, so they come out adjacent in ascending id order.
    for (Index q = 0; q < Q; ++q)
      for (Index i = 0; i + 1 < 12; ++i)
        if (E.row(got.ids(q, i)) == E.row(got.ids(q, i + 1))) REQUIRE(got.ids(q, i) < got.ids(q, i + 1));
  }
  SECTION("exclusions, duplicates in the lists") {
    std::vector<std::vector<Index>> exclude(static_cast<std::size_t>(Q));
    for (Index q = 0; q < Q; ++q)
      for (Index i = 0; i < q % 7; ++i) exclude[static_cast<std::size_t>(q)].push_back((q * 131 + i * 977) % V);
    exclude[3] = {0, 1, 2, 3, 0, 2599, 1024, 1023};
    const Neighbours dot = embedhead::nearest_neighbours<S>(E, queries, 20, Similarity::dot, exclude);
    RowMatrix<Index> ids;
    RowMatrix<double> scores;
    naive::top_k(E, queries, 20, false, exclude, ids, scores);
    REQUIRE(test_support::first_difference(dot.ids, ids) == "");
    const Neighbours cos = embedhead::nearest_neighbours<S>(E, queries, 20, Similarity::cosine, exclude);
    check_against_naive(cos, E, queries, 20, true, exclude, test_support::tolerance<S>());
  }
}

TEMPLATE_TEST_CASE("geometry: neighbours on random tables, k > V, V = 1, d = 1, no queries", "[geometry]", float,
                   double) {
  using S = TestType;
  const RowMatrix<S> E = random_matrix<S>(1100, 17, 3);
  const RowMatrix<S> queries = random_matrix<S>(9, 17, 4);
  for (const Similarity sim : {Similarity::cosine, Similarity::dot}) {
    const bool cosine = sim == Similarity::cosine;
    check_against_naive(embedhead::nearest_neighbours<S>(E, queries, 25, sim), E, queries, 25, cosine, {},
                        test_support::tolerance<S>());
  }
  // k > V: V real candidates, then (-1, -inf); with exclusions, fewer.
  const RowMatrix<S> small = random_matrix<S>(6, 4, 5);
  const RowMatrix<S> q2 = random_matrix<S>(2, 4, 6);
  const Neighbours padded = embedhead::nearest_neighbours<S>(small, q2, 9, Similarity::cosine, {{1, 2}, {}});
  check_against_naive(padded, small, q2, 9, true, {{1, 2}, {}}, test_support::tolerance<S>());
  REQUIRE(padded.ids(0, 3) != -1);  // 4 candidates left after the exclusions
  REQUIRE(padded.ids(0, 4) == -1);
  REQUIRE(padded.ids(1, 5) != -1);
  REQUIRE(padded.ids(1, 6) == -1);
  // V = 1, d = 1.
  RowMatrix<S> one(1, 1);
  one << S(-2);
  RowMatrix<S> q1(2, 1);
  q1 << S(3), S(0);
  const Neighbours n1 = embedhead::nearest_neighbours<S>(one, q1, 2, Similarity::cosine);
  REQUIRE(n1.ids(0, 0) == 0);
  REQUIRE(n1.scores(0, 0) == -1.0);
  REQUIRE(n1.ids(0, 1) == -1);
  REQUIRE(n1.scores(1, 0) == 0.0);
  // No queries: an empty [0, k] result.
  const Neighbours none = embedhead::nearest_neighbours<S>(E, RowMatrix<S>(0, 17), 3);
  REQUIRE(none.ids.rows() == 0);
  REQUIRE(none.ids.cols() == 3);
}

TEMPLATE_TEST_CASE("geometry: neighbours of rows exclude the row itself", "[geometry]", float, double) {
  using S = TestType;
  RowMatrix<S> E = random_matrix<S>(300, 8, 9);
  E.row(77) = E.row(12);  // a duplicate of row 12: its best neighbour, cosine 1
  const std::vector<Index> ids = {12, 0, 299, 12};
  const Neighbours got = embedhead::nearest_neighbours_of_rows<S>(E, ids, 5);
  RowMatrix<S> queries(4, 8);
  std::vector<std::vector<Index>> exclude;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    queries.row(static_cast<Index>(i)) = E.row(ids[i]);
    exclude.push_back({ids[i]});
  }
  check_against_naive(got, E, queries, 5, true, exclude, test_support::tolerance<S>());
  REQUIRE(got.ids(0, 0) == 77);
  REQUIRE_THAT(got.scores(0, 0), WithinAbs(1.0, 1e-6));
  REQUIRE(test_support::same_values(got.ids.row(0), got.ids.row(3)));
  const Neighbours dot = embedhead::nearest_neighbours_of_rows<S>(E, ids, 3, Similarity::dot);
  check_against_naive(dot, E, queries, 3, false, exclude, test_support::tolerance<S>());
}

TEMPLATE_TEST_CASE("geometry: analogy recovers king - man + woman = queen", "[geometry]", float, double) {
  using S = TestType;
  // Orthogonal axes: male, female, commoner, royalty, then 4 unrelated ones. man = male +
  // commoner, woman = female + commoner, king = male + royalty, queen = female + royalty.
  const Index d = 8, V = 40;
  RowMatrix<S> E = random_matrix<S>(V, d, 11, 0.3);
  for (Index v = 0; v < V; ++v) E.row(v).head(4) *= S(0.1);  // distractors live off the 4 axes
  const Index man = 3, woman = 17, king = 25, queen = 9, prince = 30;
  auto put = [&](Index v, std::initializer_list<int> axes) {
    E.row(v).setZero();
    for (const int a : axes) E(v, a) = S(1);
  };
  put(man, {0, 2});
  put(woman, {1, 2});
  put(king, {0, 3});
  put(queen, {1, 3});
  put(prince, {0, 3, 4});  // close to king, but not the answer
  const Neighbours got = embedhead::analogy<S>(E, man, king, woman, 3);
  REQUIRE(got.ids(0, 0) == queen);
  REQUIRE_THAT(got.scores(0, 0), WithinAbs(1.0, 1e-6));
  for (Index i = 0; i < 3; ++i) {
    REQUIRE(got.ids(0, i) != man);
    REQUIRE(got.ids(0, i) != king);
    REQUIRE(got.ids(0, i) != woman);
  }
  // And the other way round: woman is to queen as man is to king.
  REQUIRE(embedhead::analogy<S>(E, woman, queen, man, 1).ids(0, 0) == king);
}

TEST_CASE("geometry: PCA matches the eigen-decomposition of the covariance", "[geometry]") {
  // A table with a clear spectral gap: Gaussian coordinates with variances 2^(4 - i) along the
  // axes of a random rotation, plus a large mean (anisotropy) that implicit centring must remove.
  const Index V = 500, d = 24, k = 5;
  std::mt19937_64 gen(21);
  std::normal_distribution<double> normal;
  Eigen::MatrixXd R(d, d);
  for (Index i = 0; i < R.size(); ++i) R.data()[i] = normal(gen);
  const Eigen::MatrixXd rotation = Eigen::HouseholderQR<Eigen::MatrixXd>(R).householderQ();
  RowMatrix<double> E(V, d);
  for (Index v = 0; v < V; ++v) {
    Eigen::VectorXd z(d);
    for (Index i = 0; i < d; ++i) z[i] = normal(gen) * std::pow(2.0, (4.0 - static_cast<double>(i)) / 2);
    E.row(v) = (rotation * z).transpose() + Eigen::RowVectorXd::Constant(d, 3.0);
  }
  const Eigen::MatrixXd C = naive::covariance(E);
  Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> solver(C);
  const embedhead::PrincipalComponents pc = embedhead::principal_components<double>(E, k);
  REQUIRE(pc.directions.rows() == k);
  REQUIRE(pc.directions.cols() == d);
  REQUIRE_THAT(pc.total_variance, WithinRel(C.trace(), 1e-12));
  REQUIRE(test_support::close(pc.mean, Eigen::VectorXd(E.colwise().mean().transpose()), 1e-13));
  REQUIRE(test_support::close(pc.directions * pc.directions.transpose(), Eigen::MatrixXd::Identity(k, k), 1e-12));
  for (Index j = 0; j < k; ++j) {
    INFO("component " << j);
    const double lambda = solver.eigenvalues()[d - 1 - j];
    REQUIRE_THAT(pc.variances[j], WithinRel(lambda, 1e-8));
    REQUIRE_THAT(pc.explained[j], WithinRel(lambda / C.trace(), 1e-8));
    const double alignment = std::abs(pc.directions.row(j).dot(solver.eigenvectors().col(d - 1 - j).transpose()));
    REQUIRE_THAT(alignment, WithinAbs(1.0, 1e-8));
    // Sign convention: the largest-magnitude component is positive.
    Index at = 0;
    pc.directions.row(j).cwiseAbs().maxCoeff(&at);
    REQUIRE(pc.directions(j, at) > 0);
  }
  // The same in float, to float accuracy; and the projection.
  const RowMatrix<float> Ef = E.cast<float>();
  const embedhead::PrincipalComponents pf = embedhead::principal_components<float>(Ef, 2);
  for (Index j = 0; j < 2; ++j) {
    REQUIRE_THAT(pf.variances[j], WithinRel(solver.eigenvalues()[d - 1 - j], 1e-4));
    REQUIRE_THAT(std::abs(pf.directions.row(j).dot(solver.eigenvectors().col(d - 1 - j).transpose())),
                 WithinAbs(1.0, 1e-5));
  }
  const RowMatrix<double> coords = embedhead::project<double>(E, pc);
  const RowMatrix<double> coords_ref = (E.rowwise() - pc.mean.transpose()) * pc.directions.transpose();
  REQUIRE(test_support::close(coords, coords_ref, 1e-12));
  // The variance of each coordinate is the component's variance.
  for (Index j = 0; j < k; ++j) REQUIRE_THAT(coords.col(j).squaredNorm() / V, WithinRel(pc.variances[j], 1e-8));
  // Reproducible: the same seed gives the same bits.
  const embedhead::PrincipalComponents again = embedhead::principal_components<double>(E, k);
  REQUIRE(test_support::same_values(pc.directions, again.directions));
  // k = d and V = 1 (a zero covariance) work.
  REQUIRE(embedhead::principal_components<double>(E.leftCols(3), 3).variances.size() == 3);
  const embedhead::PrincipalComponents single = embedhead::principal_components<double>(E.topRows(1), 2);
  REQUIRE(single.variances.cwiseAbs().maxCoeff() < 1e-12);
}

TEMPLATE_TEST_CASE("geometry: under-trained rows rank first", "[geometry]", float, double) {
  using S = TestType;
  const Index V = 600, d = 24, unused = 30;
  std::mt19937_64 gen(31);
  std::normal_distribution<double> normal;
  std::vector<Index> set;
  for (Index i = 0; i < unused; ++i) set.push_back(7 + 19 * i);
  auto in_set = [&](Index v) { return std::count(set.begin(), set.end(), v) > 0; };
  auto precision = [&](const std::vector<Index>& ranking) {
    Index hits = 0;
    for (Index i = 0; i < unused; ++i) hits += in_set(ranking[static_cast<std::size_t>(i)]) ? 1 : 0;
    return static_cast<double>(hits) / static_cast<double>(unused);
  };
  SECTION("by centroid distance: untouched rows stay at their common initialisation, the centroid") {
    RowMatrix<S> U(V, d);
    for (Index v = 0; v < V; ++v)
      for (Index j = 0; j < d; ++j) U(v, j) = static_cast<S>(in_set(v) ? 0.5 + 0.01 * normal(gen) : 0.5 + normal(gen));
    const embedhead::UndertrainedScores s = embedhead::undertrained_scores<S>(U);
    REQUIRE(s.magikarp.size() == 0);
    REQUIRE(s.ranking.size() == static_cast<std::size_t>(V));
    REQUIRE(precision(s.ranking) == 1.0);
    REQUIRE(test_support::close(s.norm, embedhead::row_norms<S>(U), 1e-15));
  }
  SECTION("Magikarp: a few known unused ids find the rest") {
    // Trained rows: small isotropic noise plus a dominant direction f (the first principal
    // component, as the constant component of a trained model); unused rows: a shared point
    // 2 z (z orthogonal to f) plus small noise.
    RowMatrix<S> U(V, d);
    for (Index v = 0; v < V; ++v) {
      for (Index j = 0; j < d; ++j) U(v, j) = static_cast<S>((in_set(v) ? 0.05 : 0.3) * normal(gen));
      if (in_set(v))
        U(v, 1) += S(2);
      else
        U(v, 0) += static_cast<S>(5 * normal(gen));
    }
    const std::vector<Index> known = {set[0], set[3], set[10], set[22], set[29]};
    const embedhead::UndertrainedScores s = embedhead::undertrained_scores<S>(U, known);
    REQUIRE(s.magikarp.size() == V);
    REQUIRE(precision(s.ranking) == 1.0);
    // The score, from its definition with an explicit PC-removed copy.
    const embedhead::PrincipalComponents pc = embedhead::principal_components<S>(U, 1);
    const Eigen::RowVectorXd w = pc.directions.row(0);
    REQUIRE(std::abs(w[0]) > 0.99);
    Eigen::MatrixXd removed = U.template cast<double>();
    removed -= (removed * w.transpose()) * w;
    Eigen::RowVectorXd r = Eigen::RowVectorXd::Zero(d);
    for (const Index id : known) r += removed.row(id);
    r /= static_cast<double>(known.size());
    REQUIRE(test_support::close(s.magikarp, Eigen::VectorXd(removed * r.transpose()), 1e-10));
    // ranking is sorted by score, descending.
    for (std::size_t i = 0; i + 1 < s.ranking.size(); ++i)
      REQUIRE(s.magikarp[s.ranking[i]] >= s.magikarp[s.ranking[i + 1]]);
  }
}

TEMPLATE_TEST_CASE("geometry: summarize_table agrees with the separate functions", "[geometry]", float, double) {
  using S = TestType;
  RowMatrix<S> E = random_matrix<S>(1201, 12, 41);
  E.row(5).setZero();
  embedhead::SummaryOptions options;
  options.components = 3;
  const embedhead::TableSummary s = embedhead::summarize_table<S>(E, options);
  REQUIRE(s.V == 1201);
  REQUIRE(s.d == 12);
  REQUIRE(test_support::same_values(s.norms, embedhead::row_norms<S>(E)));
  const Eigen::VectorXd c = embedhead::centroid<S>(E);
  REQUIRE_THAT(s.centroid_norm, WithinRel(c.norm(), 1e-15));
  REQUIRE(test_support::same_values(s.centroid_distances, embedhead::centroid_distances<S>(E, c)));
  REQUIRE(s.mean_pairwise_cosine == embedhead::mean_pairwise_cosine<S>(E));
  const embedhead::PrincipalComponents pc = embedhead::principal_components<S>(E, 3);
  REQUIRE(test_support::same_values(s.pcs.directions, pc.directions));
  REQUIRE(test_support::same_values(s.pcs.variances, pc.variances));
  // Quantiles: numpy's linear interpolation over the sorted values.
  std::vector<double> sorted(s.norms.data(), s.norms.data() + s.norms.size());
  std::sort(sorted.begin(), sorted.end());
  REQUIRE(s.norm_quantiles[0] == 0.0);  // the zero row
  REQUIRE(s.norm_quantiles[2] == sorted[600]);
  REQUIRE(s.norm_quantiles[1] == sorted[300]);
  REQUIRE(s.norm_quantiles[4] == sorted.back());
  REQUIRE(s.centroid_distance_quantiles[4] == s.centroid_distances.maxCoeff());
  // components = 0: no PCA; more components than d are clamped; one non-zero row: NaN anisotropy.
  options.components = 0;
  REQUIRE(embedhead::summarize_table<S>(E, options).pcs.directions.rows() == 0);
  options.components = 50;
  REQUIRE(embedhead::summarize_table<S>(E, options).pcs.directions.rows() == 12);
  REQUIRE(std::isnan(embedhead::summarize_table<S>(E.topRows(1)).mean_pairwise_cosine));
}

TEST_CASE("geometry: progress is rate-limited, ends at (total, total), and a throw propagates", "[geometry]") {
  const RowMatrix<float> E = random_matrix<float>(5000, 16, 51);
  const RowMatrix<float> queries = random_matrix<float>(3, 16, 52);
  std::vector<std::pair<Index, Index>> calls;
  const embedhead::Progress record = [&](Index done, Index total) { calls.emplace_back(done, total); };
  embedhead::nearest_neighbours<float>(E, queries, 4, Similarity::cosine, {}, record);
  REQUIRE(!calls.empty());
  REQUIRE(calls.back().first == calls.back().second);
  for (std::size_t i = 1; i < calls.size(); ++i) REQUIRE(calls[i].first > calls[i - 1].first);
  calls.clear();
  embedhead::summarize_table<float>(E, {}, record);
  REQUIRE(calls.size() <= 101);
  REQUIRE(calls.back().first == calls.back().second);
  calls.clear();
  embedhead::undertrained_scores<float>(E, {1, 2}, record);
  REQUIRE(calls.back().first == calls.back().second);
  const embedhead::Progress cancel = [](Index, Index) { throw std::runtime_error("cancelled"); };
  REQUIRE_THROWS_WITH(embedhead::principal_components<float>(E, 2, 20, 0, cancel), "cancelled");
  REQUIRE_THROWS_WITH(embedhead::nearest_neighbours<float>(E, queries, 4, Similarity::dot, {}, cancel), "cancelled");
}

TEST_CASE("geometry: every documented error, inputs unchanged", "[geometry]") {
  using S = double;
  RowMatrix<S> E = random_matrix<S>(5, 3, 61);
  const RowMatrix<S> before = E;
  const RowMatrix<S> empty(0, 3), no_cols(4, 0);
  REQUIRE_THROWS_WITH(embedhead::row_norms<S>(empty), Contains("row_norms: V (rows of E) = 0 outside [1, inf)"));
  REQUIRE_THROWS_AS(embedhead::centroid<S>(no_cols), embedhead::value_error);
  REQUIRE_THROWS_AS(embedhead::mean_pairwise_cosine<S>(empty), embedhead::value_error);
  REQUIRE_THROWS_WITH(embedhead::centroid_distances<S>(E, Eigen::VectorXd::Zero(4)),
                      Contains("centroid_distances: c has shape [4, 1], expected [3, 1]"));
  REQUIRE_THROWS_AS(embedhead::centroid_distances<S>(E, Eigen::VectorXd::Zero(4)), embedhead::shape_error);
  RowMatrix<S> one_nonzero = RowMatrix<S>::Zero(4, 3);
  one_nonzero(2, 1) = 1;
  REQUIRE_THROWS_WITH(embedhead::mean_pairwise_cosine<S>(one_nonzero),
                      Contains("1 non-zero rows of 4, needs at least 2"));
  REQUIRE_THROWS_AS(embedhead::row_similarity<S>(E, 0, 5, Similarity::dot), embedhead::index_error);
  REQUIRE_THROWS_WITH(embedhead::row_similarity<S>(E, -1, 0, Similarity::dot),
                      Contains("row_similarity: a = -1 outside [0, 5)"));

  const RowMatrix<S> queries = random_matrix<S>(2, 3, 62);
  REQUIRE_THROWS_WITH(embedhead::nearest_neighbours<S>(E, queries, 0), Contains("k = 0 outside [1, inf)"));
  REQUIRE_THROWS_AS(embedhead::nearest_neighbours<S>(E, queries, 0), embedhead::value_error);
  REQUIRE_THROWS_WITH(embedhead::nearest_neighbours<S>(E, random_matrix<S>(2, 4, 63), 1),
                      Contains("queries has shape [2, 4], expected [2, 3]"));
  REQUIRE_THROWS_WITH(embedhead::nearest_neighbours<S>(E, queries, 1, Similarity::cosine, {{1}}),
                      Contains("exclude has 1 lists, expected 0 or 2"));
  REQUIRE_THROWS_AS(embedhead::nearest_neighbours<S>(E, queries, 1, Similarity::cosine, {{1}}), embedhead::shape_error);
  REQUIRE_THROWS_WITH(embedhead::nearest_neighbours<S>(E, queries, 1, Similarity::cosine, {{1}, {0, 5}}),
                      Contains("exclude id 5 at (query=1, i=1) outside [0, 5)"));
  REQUIRE_THROWS_AS(embedhead::nearest_neighbours<S>(E, queries, 1, Similarity::cosine, {{-1}, {}}),
                    embedhead::index_error);
  REQUIRE_THROWS_WITH(embedhead::nearest_neighbours_of_rows<S>(E, {0, 7}, 2),
                      Contains("nearest_neighbours_of_rows: id 7 at i=1 outside [0, 5)"));
  REQUIRE_THROWS_AS(embedhead::nearest_neighbours_of_rows<S>(E, {0}, -1), embedhead::value_error);
  REQUIRE_THROWS_WITH(embedhead::analogy<S>(E, 0, 1, 5, 1), Contains("analogy: c = 5 outside [0, 5)"));
  REQUIRE_THROWS_AS(embedhead::analogy<S>(E, 0, 1, 2, 0), embedhead::value_error);

  REQUIRE_THROWS_WITH(embedhead::principal_components<S>(E, 4), Contains("principal_components: k = 4 outside [1, 3]"));
  REQUIRE_THROWS_AS(embedhead::principal_components<S>(E, 0), embedhead::value_error);
  REQUIRE_THROWS_WITH(embedhead::principal_components<S>(E, 1, 0), Contains("iterations = 0 outside [1, "));
  embedhead::PrincipalComponents pc = embedhead::principal_components<S>(E, 2);
  pc.mean = Eigen::VectorXd::Zero(2);
  REQUIRE_THROWS_WITH(embedhead::project<S>(E, pc), Contains("project: pc.mean has shape [2, 1], expected [3, 1]"));
  REQUIRE_THROWS_AS(embedhead::project<S>(E, pc), embedhead::shape_error);
  REQUIRE_THROWS_WITH(embedhead::undertrained_scores<S>(E, {0, 5}),
                      Contains("undertrained_scores: known_unused id 5 at i=1 outside [0, 5)"));
  embedhead::SummaryOptions options;
  options.components = -1;
  REQUIRE_THROWS_WITH(embedhead::summarize_table<S>(E, options), Contains("options.components = -1 outside [0, "));
  options.components = 1;
  options.iterations = 0;
  REQUIRE_THROWS_AS(embedhead::summarize_table<S>(E, options), embedhead::value_error);
  REQUIRE(test_support::same_values(E, before));
}

#ifdef _OPENMP
TEMPLATE_TEST_CASE("geometry: 1 and 2 threads give bit-identical results", "[geometry][threads]", float, double) {
  using S = TestType;
  const RowMatrix<S> E = random_matrix<S>(4100, 40, 71);
  const RowMatrix<S> queries = random_matrix<S>(300, 40, 72);
  auto run = [&](int threads) {
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    const Neighbours n = embedhead::nearest_neighbours<S>(E, queries, 7);
    const Neighbours dot = embedhead::nearest_neighbours<S>(E, queries, 3000, Similarity::dot);
    const embedhead::TableSummary s = embedhead::summarize_table<S>(E);
    const embedhead::UndertrainedScores u = embedhead::undertrained_scores<S>(E, {3, 4});
    const RowMatrix<double> coords = embedhead::project<S>(E, s.pcs);
    omp_set_num_threads(saved);
    return std::make_tuple(n, dot, s, u, coords);
  };
  const auto one = run(1), two = run(2);
  REQUIRE(test_support::same_values(std::get<0>(one).ids, std::get<0>(two).ids));
  REQUIRE(test_support::same_values(std::get<0>(one).scores, std::get<0>(two).scores));
  REQUIRE(test_support::same_values(std::get<1>(one).ids, std::get<1>(two).ids));
  REQUIRE(test_support::same_values(std::get<1>(one).scores, std::get<1>(two).scores));
  const embedhead::TableSummary &s1 = std::get<2>(one), &s2 = std::get<2>(two);
  REQUIRE(test_support::same_values(s1.norms, s2.norms));
  REQUIRE(test_support::same_values(s1.centroid_distances, s2.centroid_distances));
  REQUIRE(s1.mean_pairwise_cosine == s2.mean_pairwise_cosine);
  REQUIRE(s1.centroid_norm == s2.centroid_norm);
  REQUIRE(test_support::same_values(s1.pcs.directions, s2.pcs.directions));
  REQUIRE(test_support::same_values(s1.pcs.variances, s2.pcs.variances));
  REQUIRE(test_support::same_values(std::get<3>(one).magikarp, std::get<3>(two).magikarp));
  REQUIRE(std::get<3>(one).ranking == std::get<3>(two).ranking);
  REQUIRE(test_support::same_values(std::get<4>(one), std::get<4>(two)));
}
#endif
