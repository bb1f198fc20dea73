// Tests for include/embedhead/alibi.hpp: the slopes for every head count 1 .. 128 against the
// reference code's get_slopes recursion written here independently (and hard-coded values for
// H = 1, 2, 3, 6, 8, 12), the bias for 12 heads element by element against a naive loop (implied
// and explicit positions, causal or not), the equivalence of the paper's -m(i - j) and the
// reference code's +m*j under a row softmax, incremental decoding, left padding and packed rows,
// and every error with its message and the scores unchanged.
#include <embedhead/alibi.hpp>

#include "reference/test_support.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

using Catch::Contains;
using embedhead::AlibiMask;
using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::RowMatrix;
using test_support::first_difference;
using test_support::random_matrix;
using test_support::same_values;

namespace {

// get_slopes of Press et al.'s reference code (fairseq/models/transformer.py), written out
// plainly: for a power of two n, start = 2^(-2^-(log2(n) - 3)) and the slopes start * start^i,
// i = 0 .. n-1; otherwise the slopes of the closest lower power of two c, then get_slopes(2c)[0::2]
// cut to n - c entries. Repeated rounding of start^i makes these a few hundred ulps from exact
// for n = 128 at most.
std::vector<double> reference_get_slopes(int n) {
  const auto power_of_2 = [](int count) {
    const double start = std::pow(2.0, -std::pow(2.0, -(std::log2(static_cast<double>(count)) - 3.0)));
    std::vector<double> slopes;
    for (int i = 0; i < count; ++i) slopes.push_back(start * std::pow(start, i));
    return slopes;
  };
  int closest = 1;
  while (closest * 2 <= n) closest *= 2;
  if (closest == n) return power_of_2(n);
  std::vector<double> slopes = power_of_2(closest);
  const std::vector<double> twice = reference_get_slopes(2 * closest);
  for (int k = 0; 2 * k < static_cast<int>(twice.size()) && k < n - closest; ++k) slopes.push_back(twice[2 * k]);
  return slopes;
}

// The 12-head slopes, hard-coded: 2^-1 .. 2^-8, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5.
std::vector<double> twelve_head_slopes() {
  const double r = std::sqrt(0.5);  // 2^-0.5
  return {0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.0078125, 0.00390625, r, r / 2, r / 4, r / 8};
}

// The naive bias: expected(b, h, i, j) = scores + S(-m_h * (q(b, i) - k(b, j))), or -inf for a
// future key under causal, one element at a time in the [B*H*T_q, T_k] layout.
template <typename S>
RowMatrix<S> naive_alibi(const RowMatrix<S>& scores, const std::vector<double>& slopes, const IdMatrix<std::int64_t>& q,
                         const IdMatrix<std::int64_t>& k, bool causal) {
  const Index B = q.rows(), T_q = q.cols(), T_k = k.cols(), H = static_cast<Index>(slopes.size());
  RowMatrix<S> out = scores;
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h)
      for (Index i = 0; i < T_q; ++i)
        for (Index j = 0; j < T_k; ++j) {
          const Index r = (b * H + h) * T_q + i;
          if (causal && k(b, j) > q(b, i))
            out(r, j) = -std::numeric_limits<S>::infinity();
          else
            out(r, j) = scores(r, j) +
                        static_cast<S>(-slopes[static_cast<std::size_t>(h)] * static_cast<double>(q(b, i) - k(b, j)));
        }
  return out;
}

// Positions of the implied layout: q(b, i) = offset + i, k(b, j) = j.
IdMatrix<std::int64_t> implied_queries(Index B, Index T_q, Index offset) {
  IdMatrix<std::int64_t> q(B, T_q);
  for (Index b = 0; b < B; ++b)
    for (Index i = 0; i < T_q; ++i) q(b, i) = offset + i;
  return q;
}
IdMatrix<std::int64_t> implied_keys(Index B, Index T_k) { return implied_queries(B, T_k, 0); }

// Row-wise softmax in double; -inf entries give 0.
RowMatrix<double> softmax_rows(const RowMatrix<double>& x) {
  RowMatrix<double> p(x.rows(), x.cols());
  for (Index r = 0; r < x.rows(); ++r) {
    const double top = x.row(r).maxCoeff();
    double sum = 0;
    for (Index c = 0; c < x.cols(); ++c) sum += (p(r, c) = std::exp(x(r, c) - top));
    p.row(r) /= sum;
  }
  return p;
}

}  // namespace

TEST_CASE("alibi_slopes matches the reference get_slopes for every H in 1..128", "[alibi][slopes]") {
  for (int H = 1; H <= 128; ++H) {
    INFO("H = " << H);
    const std::vector<double> expected = reference_get_slopes(H);
    const std::vector<double> got = embedhead::alibi_slopes(H);
    REQUIRE(got.size() == expected.size());
    REQUIRE(static_cast<int>(got.size()) == H);
    for (int h = 0; h < H; ++h) {
      INFO("h = " << h << ": " << got[static_cast<std::size_t>(h)] << " vs " << expected[static_cast<std::size_t>(h)]);
      CHECK(std::fabs(got[static_cast<std::size_t>(h)] - expected[static_cast<std::size_t>(h)]) <=
            1e-13 * expected[static_cast<std::size_t>(h)]);
      // Every slope lies in [2^-8, 1).
      CHECK(got[static_cast<std::size_t>(h)] >= 1.0 / 256);
      CHECK(got[static_cast<std::size_t>(h)] < 1.0);
    }
    // The float slopes are the double ones rounded once.
    const std::vector<float> as_float = embedhead::alibi_slopes<float>(H);
    REQUIRE(as_float.size() == got.size());
    for (std::size_t h = 0; h < got.size(); ++h) CHECK(as_float[h] == static_cast<float>(got[h]));
  }
}

TEST_CASE("alibi_slopes: hard-coded values", "[alibi][slopes]") {
  SECTION("H = 8: 1/2, 1/4, ..., 1/256 exactly") {
    CHECK(embedhead::alibi_slopes(8) ==
          std::vector<double>{0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.0078125, 0.00390625});
  }
  SECTION("H = 1, 2, 4: 2^(-8h/H) exactly") {
    CHECK(embedhead::alibi_slopes(1) == std::vector<double>{1.0 / 256});
    CHECK(embedhead::alibi_slopes(2) == std::vector<double>{1.0 / 16, 1.0 / 256});
    CHECK(embedhead::alibi_slopes(4) == std::vector<double>{1.0 / 4, 1.0 / 16, 1.0 / 64, 1.0 / 256});
  }
  SECTION("H = 3 and 6: the lower power of two's slopes, then every other slope of twice as many heads") {
    // H = 3: n = 2 -> 1/16, 1/256; 4 heads -> 1/4, 1/16, 1/64, 1/256, take index 0.
    CHECK(embedhead::alibi_slopes(3) == std::vector<double>{1.0 / 16, 1.0 / 256, 1.0 / 4});
    // H = 6: n = 4 -> 1/4 .. 1/256; 8 heads -> take indices 0 and 2: 1/2, 1/8.
    CHECK(embedhead::alibi_slopes(6) == std::vector<double>{1.0 / 4, 1.0 / 16, 1.0 / 64, 1.0 / 256, 1.0 / 2, 1.0 / 8});
  }
  SECTION("H = 12: 2^-1 .. 2^-8, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5 (within an ulp of sqrt(1/2) / 2^k)") {
    const std::vector<double> got = embedhead::alibi_slopes(12);
    const std::vector<double> expected = twelve_head_slopes();
    REQUIRE(got.size() == 12);
    for (std::size_t h = 0; h < 8; ++h) CHECK(got[h] == expected[h]);
    for (std::size_t h = 8; h < 12; ++h) {
      INFO("h = " << h);
      CHECK(std::fabs(got[h] - expected[h]) <= std::numeric_limits<double>::epsilon() * expected[h]);
    }
  }
}

TEMPLATE_TEST_CASE("add_alibi_bias with implied positions: 12 heads against a naive loop", "[alibi][bias]", float,
                   double) {
  using S = TestType;
  const std::vector<double> slopes = twelve_head_slopes();
  const Index H = 12;
  struct Case {
    Index B, T_q, T_k, offset;
  };
  for (const Case c : {Case{1, 5, 5, 0}, Case{2, 7, 7, 0}, Case{2, 1, 6, 5}, Case{3, 3, 8, 5}, Case{2, 2, 6, 1}}) {
    INFO("B = " << c.B << ", T_q = " << c.T_q << ", T_k = " << c.T_k << ", offset = " << c.offset);
    const RowMatrix<S> scores = random_matrix<S>(c.B * H * c.T_q, c.T_k, 7 + static_cast<std::uint64_t>(c.T_k), 3.0);
    const IdMatrix<std::int64_t> q = implied_queries(c.B, c.T_q, c.offset), k = implied_keys(c.B, c.T_k);
    for (const bool causal : {false, true}) {
      INFO("causal = " << causal);
      RowMatrix<S> got = scores;
      embedhead::add_alibi_bias<S>(got, slopes, c.B, c.T_q, c.offset, causal ? AlibiMask::causal : AlibiMask::none);
      const RowMatrix<S> expected = naive_alibi<S>(scores, slopes, q, k, causal);
      CHECK(first_difference(got, expected) == "");
    }
  }

  SECTION("worked example: H = 12, T = 3, zero scores: head 0 row 2 = [-1, -0.5, 0]; head 8 row 1 = [-2^-0.5, 0, ..]") {
    RowMatrix<S> scores = RowMatrix<S>::Zero(H * 3, 3);
    embedhead::add_alibi_bias<S>(scores, slopes, 1, 3, 0, AlibiMask::causal);
    const S inf = std::numeric_limits<S>::infinity();
    CHECK(scores(0, 0) == S(0));
    CHECK(scores(0, 1) == -inf);
    CHECK(scores(0, 2) == -inf);
    CHECK(scores(2, 0) == S(-1));
    CHECK(scores(2, 1) == S(-0.5));
    CHECK(scores(2, 2) == S(0));
    CHECK(scores(8 * 3 + 1, 0) == static_cast<S>(-std::sqrt(0.5)));
    CHECK(scores(8 * 3 + 1, 1) == S(0));
    CHECK(scores(8 * 3 + 1, 2) == -inf);
    CHECK(scores(11 * 3 + 2, 0) == static_cast<S>(-2 * std::sqrt(0.5) / 8));
  }

  SECTION("no mask: a future key gets the positive bias m (j - i)") {
    RowMatrix<S> scores = RowMatrix<S>::Zero(H * 2, 4);
    embedhead::add_alibi_bias<S>(scores, slopes, 1, 2, 0, AlibiMask::none);
    CHECK(scores(0, 3) == S(1.5));          // row h*2 + i = 0: head 0 (m = 1/2), i = 0, j = 3
    CHECK(scores(1, 3) == S(1));            // head 0, i = 1
    CHECK(scores(15, 0) == S(-1.0 / 256));  // row 15: head 7 (m = 1/256), i = 1, j = 0
    CHECK(scores(15, 3) == S(2.0 / 256));   // j = 3
  }

  SECTION("with alibi_slopes(12) itself: within rounding of the hard-coded slopes") {
    const RowMatrix<S> scores = random_matrix<S>(2 * H * 4, 4, 99);
    RowMatrix<S> got = scores;
    embedhead::add_alibi_bias<S>(got, embedhead::alibi_slopes(12), 2, 4, 0, AlibiMask::none);
    const RowMatrix<S> expected = naive_alibi<S>(scores, slopes, implied_queries(2, 4, 0), implied_keys(2, 4), false);
    CHECK(test_support::close(got, expected, 4 * static_cast<double>(std::numeric_limits<S>::epsilon())));
  }

  SECTION("empty: B = 0, T_q = 0 or T_k = 0 writes nothing and does not throw") {
    RowMatrix<S> none(0, 5);
    embedhead::add_alibi_bias<S>(none, slopes, 0, 3, 0, AlibiMask::causal);
    embedhead::add_alibi_bias<S>(none, slopes, 2, 0, 5, AlibiMask::causal);
    // T_k = 0 with a query: the query's own position is no key position, an error (offset range [0, -1]).
    RowMatrix<S> no_keys(H * 1, 0);
    CHECK_THROWS_AS(embedhead::add_alibi_bias<S>(no_keys, slopes, 1, 1, 0, AlibiMask::none), embedhead::index_error);
    RowMatrix<S> no_queries_no_keys(0, 0);
    embedhead::add_alibi_bias<S>(no_queries_no_keys, slopes, 1, 0, 0, AlibiMask::none);
  }
}

TEMPLATE_TEST_CASE("add_alibi_bias: incremental decoding equals the rows of the full sequence", "[alibi][bias]", float,
                   double) {
  using S = TestType;
  const std::vector<double> slopes = embedhead::alibi_slopes(6);
  const Index H = 6, B = 2, T = 7;
  const RowMatrix<S> scores = random_matrix<S>(B * H * T, T, 5);
  RowMatrix<S> full = scores;
  embedhead::add_alibi_bias<S>(full, slopes, B, T, 0, AlibiMask::causal);

  // A chunk of T_q queries at offset T_k - T_q (a key/value cache of T_k - T_q tokens) gives the
  // full result's rows offset .. offset + T_q - 1, columns 0 .. T_k - 1, for every (b, h).
  for (Index T_k = 1; T_k <= T; ++T_k)
    for (Index T_q = 1; T_q <= T_k; ++T_q) {
      const Index offset = T_k - T_q;
      INFO("T_q = " << T_q << ", T_k = " << T_k);
      RowMatrix<S> step(B * H * T_q, T_k), expected(B * H * T_q, T_k);
      for (Index bh = 0; bh < B * H; ++bh) {
        step.middleRows(bh * T_q, T_q) = scores.block(bh * T + offset, 0, T_q, T_k);
        expected.middleRows(bh * T_q, T_q) = full.block(bh * T + offset, 0, T_q, T_k);
      }
      embedhead::add_alibi_bias<S>(step, slopes, B, T_q, offset, AlibiMask::causal);
      CHECK(first_difference(step, expected) == "");
    }
}

TEST_CASE("add_alibi_bias: the paper's -m(i - j) and the reference code's +m*j give the same softmax per row",
          "[alibi][bias][softmax]") {
  const std::vector<double> slopes = twelve_head_slopes();
  const Index H = 12, T = 9;
  const RowMatrix<double> scores = random_matrix<double>(H * T, T, 11, 2.0);
  for (const bool causal : {false, true}) {
    INFO("causal = " << causal);
    RowMatrix<double> paper = scores;
    embedhead::add_alibi_bias<double>(paper, slopes, 1, T, 0, causal ? AlibiMask::causal : AlibiMask::none);
    // The reference code: scores + m_h * j (the same row for every query), then the future mask.
    RowMatrix<double> reference = scores;
    for (Index h = 0; h < H; ++h)
      for (Index i = 0; i < T; ++i)
        for (Index j = 0; j < T; ++j) {
          reference(h * T + i, j) += slopes[static_cast<std::size_t>(h)] * static_cast<double>(j);
          if (causal && j > i) reference(h * T + i, j) = -std::numeric_limits<double>::infinity();
        }
    // The scores differ (by m_h * i per row; compared without the mask, whose -inf - -inf is NaN) ...
    if (!causal) CHECK_FALSE(test_support::close(paper, reference, 1e-6));
    // ... the probabilities do not.
    CHECK(test_support::close(softmax_rows(paper), softmax_rows(reference), 1e-14));
  }
}

TEMPLATE_TEST_CASE("add_alibi_bias with per-row positions", "[alibi][bias][positions]", float, double) {
  using S = TestType;
  const std::vector<double> slopes = twelve_head_slopes();
  const Index H = 12;

  SECTION("naive reference: any positions (packed documents, gaps, non-monotone), int64 and int32") {
    const Index B = 3, T_q = 4, T_k = 6;
    IdMatrix<std::int64_t> q(B, T_q), k(B, T_k);
    q << 3, 4, 5, 6,  //
        0, 1, 0, 1,   // two packed documents
        9, 2, 7, 40;
    k << 0, 1, 2, 3, 4, 5,  //
        0, 1, 2, 0, 1, 2,   //
        40, 3, 0, 9, 100, 7;
    const RowMatrix<S> scores = random_matrix<S>(B * H * T_q, T_k, 21);
    for (const bool causal : {false, true}) {
      INFO("causal = " << causal);
      const AlibiMask mask = causal ? AlibiMask::causal : AlibiMask::none;
      const RowMatrix<S> expected = naive_alibi<S>(scores, slopes, q, k, causal);
      RowMatrix<S> got = scores;
      embedhead::add_alibi_bias<S>(got, slopes, q, k, mask);
      CHECK(first_difference(got, expected) == "");

      const IdMatrix<std::int32_t> q32 = q.cast<std::int32_t>(), k32 = k.cast<std::int32_t>();
      RowMatrix<S> got32 = scores;
      embedhead::add_alibi_bias<S>(got32, slopes, q32, k32, mask);
      CHECK(first_difference(got32, expected) == "");

      // Column-major positions (any layout a TokenIds views).
      const Eigen::Matrix<std::int64_t, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor> q_col = q, k_col = k;
      RowMatrix<S> got_col = scores;
      embedhead::add_alibi_bias<S>(got_col, slopes, q_col, k_col, mask);
      CHECK(first_difference(got_col, expected) == "");
    }
  }

  SECTION("positions equal to the implied ones give the implied overload's result exactly") {
    const Index B = 2, T_q = 3, T_k = 7, offset = 4;
    const RowMatrix<S> scores = random_matrix<S>(B * H * T_q, T_k, 22);
    for (const AlibiMask mask : {AlibiMask::none, AlibiMask::causal}) {
      RowMatrix<S> implied = scores, explicit_positions = scores;
      embedhead::add_alibi_bias<S>(implied, slopes, B, T_q, offset, mask);
      embedhead::add_alibi_bias<S>(explicit_positions, slopes, implied_queries(B, T_q, offset), implied_keys(B, T_k),
                                   mask);
      CHECK(first_difference(explicit_positions, implied) == "");
    }
  }

  SECTION("left padding: a padded row's real tokens get exactly the bias of the sequence alone") {
    // Row 0: 2 pads then 4 real tokens; row 1: 6 real tokens. Positions from the attention mask as
    // Hugging Face derives them: cumsum(mask) - 1, pads set to 1.
    const Index B = 2, T = 6, pads = 2, L = T - pads;
    IdMatrix<std::int64_t> positions(B, T);
    positions << 1, 1, 0, 1, 2, 3,  //
        0, 1, 2, 3, 4, 5;
    const RowMatrix<S> scores = random_matrix<S>(B * H * T, T, 23);
    for (const AlibiMask mask : {AlibiMask::none, AlibiMask::causal}) {
      RowMatrix<S> batch = scores;
      embedhead::add_alibi_bias<S>(batch, slopes, positions, positions, mask);

      // The 4 real tokens of row 0 alone (B = 1, T = 4, offset 0), from the same scores.
      RowMatrix<S> alone(H * L, L);
      for (Index h = 0; h < H; ++h) alone.middleRows(h * L, L) = scores.block(h * T + pads, pads, L, L);
      embedhead::add_alibi_bias<S>(alone, slopes, 1, L, 0, mask);
      for (Index h = 0; h < H; ++h) {
        INFO("h = " << h);
        const RowMatrix<S> real = batch.block(h * T + pads, pads, L, L);
        const RowMatrix<S> expected = alone.middleRows(h * L, L);
        CHECK(first_difference(real, expected) == "");
      }

      // Row 1 (no padding) is the implied layout with offset 0.
      RowMatrix<S> unpadded = scores.bottomRows(H * T);
      embedhead::add_alibi_bias<S>(unpadded, slopes, 1, T, 0, mask);
      const RowMatrix<S> row1 = batch.bottomRows(H * T);
      CHECK(first_difference(row1, unpadded) == "");
    }
  }
}

TEMPLATE_TEST_CASE("ALiBi rejects bad input and writes nothing", "[alibi][errors]", float, double) {
  using S = TestType;
  const std::vector<double> slopes = embedhead::alibi_slopes(4);
  const Index H = 4, B = 2, T_q = 3, T_k = 5;
  const RowMatrix<S> original = random_matrix<S>(B * H * T_q, T_k, 31);
  RowMatrix<S> scores = original;
  const IdMatrix<std::int64_t> q = implied_queries(B, T_q, 2), k = implied_keys(B, T_k);

  SECTION("alibi_slopes: H < 1") {
    REQUIRE_THROWS_AS(embedhead::alibi_slopes(0), embedhead::value_error);
    REQUIRE_THROWS_WITH(embedhead::alibi_slopes(0),
                        Contains("alibi_slopes") && Contains("H = 0") && Contains("[1, inf)"));
    REQUIRE_THROWS_WITH(embedhead::alibi_slopes<float>(-3), Contains("H = -3") && Contains("[1, inf)"));
  }

  SECTION("slopes: empty, non-finite or negative") {
    const std::vector<double> empty;
    REQUIRE_THROWS_AS(embedhead::add_alibi_bias<S>(scores, empty, B, T_q, 2, AlibiMask::none), embedhead::value_error);
    REQUIRE_THROWS_WITH(embedhead::add_alibi_bias<S>(scores, empty, B, T_q, 2, AlibiMask::none),
                        Contains("add_alibi_bias") && Contains("0 entries") && Contains("[1, inf)"));
    REQUIRE_THROWS_WITH(embedhead::add_alibi_bias<S>(scores, empty, q, k, AlibiMask::none), Contains("0 entries"));
    for (const double bad : {std::nan(""), std::numeric_limits<double>::infinity(), -0.5}) {
      std::vector<double> with_bad = slopes;
      with_bad[2] = bad;
      INFO("slope " << bad);
      REQUIRE_THROWS_AS(embedhead::add_alibi_bias<S>(scores, with_bad, B, T_q, 2, AlibiMask::causal),
                        embedhead::value_error);
      REQUIRE_THROWS_WITH(embedhead::add_alibi_bias<S>(scores, with_bad, B, T_q, 2, AlibiMask::causal),
                          Contains("slopes[2] = ") && Contains("outside [0, inf)"));
      REQUIRE_THROWS_AS(embedhead::add_alibi_bias<S>(scores, with_bad, q, k, AlibiMask::none), embedhead::value_error);
    }
  }

  SECTION("scores not [B*H*T_q, T_k]") {
    RowMatrix<S> wrong_rows = original.topRows(B * H * T_q - 1);
    const RowMatrix<S> wrong_rows_before = wrong_rows;
    REQUIRE_THROWS_AS(embedhead::add_alibi_bias<S>(wrong_rows, slopes, B, T_q, 2, AlibiMask::none),
                      embedhead::shape_error);
    REQUIRE_THROWS_WITH(embedhead::add_alibi_bias<S>(wrong_rows, slopes, B, T_q, 2, AlibiMask::none),
                        Contains("scores has shape [23, 5], expected [24, 5]"));
    REQUIRE_THROWS_WITH(embedhead::add_alibi_bias<S>(wrong_rows, slopes, q, k, AlibiMask::none),
                        Contains("scores has shape [23, 5], expected [24, 5]"));
    CHECK(same_values(wrong_rows, wrong_rows_before));
    // Explicit positions: the key count fixes T_k.
    const IdMatrix<std::int64_t> k4 = implied_keys(B, T_k - 1);
    REQUIRE_THROWS_AS(embedhead::add_alibi_bias<S>(scores, slopes, q, k4, AlibiMask::none), embedhead::shape_error);
    REQUIRE_THROWS_WITH(embedhead::add_alibi_bias<S>(scores, slopes, q, k4, AlibiMask::none),
                        Contains("scores has shape [24, 5], expected [24, 4]"));
  }

  SECTION("k_positions with another batch size than q_positions") {
    const IdMatrix<std::int64_t> k1 = implied_keys(1, T_k);
    REQUIRE_THROWS_AS(embedhead::add_alibi_bias<S>(scores, slopes, q, k1, AlibiMask::none), embedhead::shape_error);
    REQUIRE_THROWS_WITH(embedhead::add_alibi_bias<S>(scores, slopes, q, k1, AlibiMask::none),
                        Contains("k_positions has shape [1, 5], expected [2, 5]"));
  }

  SECTION("negative B or T_q") {
    REQUIRE_THROWS_AS(embedhead::add_alibi_bias<S>(scores, slopes, -1, T_q, 2, AlibiMask::none),
                      embedhead::value_error);
    REQUIRE_THROWS_WITH(embedhead::add_alibi_bias<S>(scores, slopes, -1, T_q, 2, AlibiMask::none),
                        Contains("B = -1") && Contains(">= 0"));
    REQUIRE_THROWS_WITH(embedhead::add_alibi_bias<S>(scores, slopes, B, -3, 2, AlibiMask::none),
                        Contains("T_q = -3") && Contains(">= 0"));
  }

  SECTION("offset outside [0, T_k - T_q]") {
    REQUIRE_THROWS_AS(embedhead::add_alibi_bias<S>(scores, slopes, B, T_q, -1, AlibiMask::causal),
                      embedhead::index_error);
    REQUIRE_THROWS_WITH(embedhead::add_alibi_bias<S>(scores, slopes, B, T_q, -1, AlibiMask::causal),
                        Contains("offset -1") && Contains("outside [0, 2]"));
    REQUIRE_THROWS_WITH(embedhead::add_alibi_bias<S>(scores, slopes, B, T_q, 3, AlibiMask::causal),
                        Contains("offset 3 (T_q 3, T_k 5) outside [0, 2]"));
  }

  SECTION("a position outside [0, 2^53), with (b, t)") {
    IdMatrix<std::int64_t> bad_q = q;
    bad_q(1, 2) = -1;
    REQUIRE_THROWS_AS(embedhead::add_alibi_bias<S>(scores, slopes, bad_q, k, AlibiMask::causal),
                      embedhead::index_error);
    REQUIRE_THROWS_WITH(embedhead::add_alibi_bias<S>(scores, slopes, bad_q, k, AlibiMask::causal),
                        Contains("position -1 in q_positions at (b=1, t=2) outside [0, 2^53 = 9007199254740992)"));
    IdMatrix<std::int64_t> bad_k = k;
    bad_k(0, 4) = std::int64_t{1} << 53;
    REQUIRE_THROWS_WITH(embedhead::add_alibi_bias<S>(scores, slopes, q, bad_k, AlibiMask::none),
                        Contains("position 9007199254740992 in k_positions at (b=0, t=4)"));
    IdMatrix<std::int32_t> bad_k32 = k.cast<std::int32_t>();
    bad_k32(1, 0) = -7;
    REQUIRE_THROWS_WITH(embedhead::add_alibi_bias<S>(scores, slopes, q, bad_k32, AlibiMask::none),
                        Contains("position -7 in k_positions at (b=1, t=0)"));
  }

  // Every section: the scores are exactly as they were.
  CHECK(same_values(scores, original));
}
