// Tests for include/embedhead/quantized_embedding.hpp: int8 table with a per-row absmax scale.
#include <embedhead/errors.hpp>
#include <embedhead/quantized_embedding.hpp>

#include "reference/naive.hpp"
#include "reference/test_support.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>

using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::QuantizedEmbedding;
using embedhead::RowMatrix;
using Catch::Contains;
using test_support::first_difference;
using test_support::random_ids;
using test_support::random_matrix;

namespace {

// Every row of the dequantized table, read through the lookup itself: ids = 0 .. V-1.
RowMatrix<float> lookup_all(const QuantizedEmbedding& q) {
  IdMatrix<std::int32_t> ids(1, q.vocab_size());
  for (Index v = 0; v < q.vocab_size(); ++v) ids(0, v) = static_cast<std::int32_t>(v);
  return q.forward(ids);
}

// Checks |lookup(v)[j] - E[v, j]| <= scale_v / 2 plus float rounding, with the scale recomputed
// here from its definition max_j |E[v, j]| / 127, and the codes' range. Returns the number of
// elements checked.
Index check_error_bound(const RowMatrix<float>& E, const QuantizedEmbedding& q) {
  const RowMatrix<float> got = lookup_all(q);
  Index checked = 0;
  for (Index v = 0; v < E.rows(); ++v) {
    double amax = 0;
    for (Index j = 0; j < E.cols(); ++j) amax = std::max(amax, std::abs(static_cast<double>(E(v, j))));
    const double scale = amax / 127;
    INFO("row " << v << ", amax " << amax);
    REQUIRE(std::abs(q.scales()(v, 0) - scale) <= 1e-7 * scale);
    int largest_code = 0;
    for (Index j = 0; j < E.cols(); ++j) {
      const int code = q.values()(v, j);
      REQUIRE(code >= -127);
      REQUIRE(code <= 127);
      largest_code = std::max(largest_code, std::abs(code));
      // scale/2 from rounding to an integer; the rest covers the float quotient and product.
      const double bound = scale / 2 * (1 + 1e-5) + 4 * std::ldexp(std::abs(static_cast<double>(E(v, j))), -24);
      REQUIRE(std::abs(static_cast<double>(got(v, j)) - E(v, j)) <= bound);
      ++checked;
    }
    REQUIRE(largest_code == (amax > 0 ? 127 : 0));  // the absmax entry maps to +-127
  }
  return checked;
}

}  // namespace

TEST_CASE("quantized embedding: worked example and the all-zero row", "[quantized]") {
  RowMatrix<float> E(3, 4);
  E << 0.5f, -1.27f, 0.0f, 0.004f,   // amax 1.27: scale 0.01, codes 50, -127, 0, 0 (0.4 rounds down)
      0.0f, 0.0f, 0.0f, 0.0f,        // all zero: scale 0, codes 0, dequantizes to 0 (not NaN)
      -2.0f, 1.0f, 0.015748f, 2.0f;  // amax 2: scale 2/127; 1 -> 63.5 -> 64 (half away from 0)
  const QuantizedEmbedding q(E);
  REQUIRE(q.vocab_size() == 3);
  REQUIRE(q.dim() == 4);
  CHECK(q.scales()(0, 0) == 1.27f / 127.0f);
  CHECK(q.scales()(1, 0) == 0.0f);
  CHECK(q.scales()(2, 0) == 2.0f / 127.0f);
  RowMatrix<std::int8_t> codes(3, 4);
  codes << 50, -127, 0, 0, 0, 0, 0, 0, -127, 64, 1, 127;
  CHECK(q.values() == codes);
  CHECK(q.bytes() == 3 * 4 + 3 * 4);

  IdMatrix<std::int32_t> ids(1, 3);
  ids << 1, 0, 2;
  const RowMatrix<float> out = q.forward(ids);
  CHECK(out.row(0).isZero(0));
  CHECK(out(1, 0) == 50.0f * (1.27f / 127.0f));
  CHECK(out(1, 1) == -1.27f);
  CHECK(out(2, 1) == 64.0f * (2.0f / 127.0f));
  CHECK(out(2, 3) == 2.0f);
  CHECK(check_error_bound(E, q) == 12);
}

TEST_CASE("quantized embedding: error bound |dequant - E| <= scale_v / 2 on random tables", "[quantized]") {
  std::mt19937_64 gen(7);
  // V = 1, d = 1, odd and packet-width +-1 d, a large V.
  const Index shapes[][2] = {{1, 1},   {1, 7},  {5, 1},  {9, 3},   {20, 15}, {20, 16}, {20, 17},
                             {33, 31}, {8, 32}, {8, 33}, {16, 64}, {3, 769}, {5000, 3}};
  for (const auto& shape : shapes) {
    const Index V = shape[0], d = shape[1];
    for (const double magnitude : {1.0, 1e-3, 1e4}) {
      INFO("V = " << V << ", d = " << d << ", magnitude " << magnitude);
      RowMatrix<float> E = random_matrix<float>(V, d, gen(), magnitude);
      if (V > 2) E.row(1).setZero();
      const QuantizedEmbedding q(E);
      CHECK(check_error_bound(E, q) == V * d);
    }
  }
}

// Issue 15, class 6: a finite row with +-FLT_MAX got scale = FLT_MAX / 127 rounded up, so
// 127 * scale overflowed and the row dequantized to +-inf. Finite input gives finite output.
TEST_CASE("quantized embedding: rows up to +-FLT_MAX dequantize to finite values within the bound", "[quantized]") {
  const float big = std::numeric_limits<float>::max();
  RowMatrix<float> E(4, 3);
  E << big, -big, 1.0f,                                      // both signs at the largest float
      -big, 0.5f * big, -1e30f,                              // the absmax negative
      std::nextafter(big, 0.0f), 3e38f, 0.0f,                // just below
      std::numeric_limits<float>::denorm_min(), 0.0f, 0.0f;  // the other end: a subnormal absmax
  const QuantizedEmbedding q(E);
  CHECK(q.dequantize().allFinite());
  CHECK(lookup_all(q).allFinite());
  CHECK(q.scales().allFinite());
  // The bound of check_error_bound, in double, for the three large rows (their scale is amax / 127
  // rounded down where rounding up would overflow, so it is not compared with amax / 127 here).
  const RowMatrix<float> back = lookup_all(q);
  for (Index v = 0; v < 3; ++v)
    for (Index j = 0; j < 3; ++j) {
      INFO("(" << v << ", " << j << ")");
      const double scale = q.scales()(v, 0), x = E(v, j);
      CHECK(std::abs(static_cast<double>(back(v, j)) - x) <= scale / 2 * (1 + 1e-5) + 4 * std::ldexp(std::abs(x), -24));
    }
  CHECK(std::abs(q.values()(0, 0)) == 127);
  CHECK(back(0, 1) == -back(0, 0));
}

TEST_CASE("quantized embedding: representable rows come back exactly", "[quantized]") {
  // Row v = k * 2^-e with integer k, max |k| = 127: the scale is exactly 2^-e, so the codes are k.
  std::mt19937_64 gen(9);
  std::uniform_int_distribution<int> k_dist(-127, 127);
  for (const Index d : {1, 2, 15, 16, 17, 100}) {
    RowMatrix<float> E(4, d);
    for (Index v = 0; v < 4; ++v) {
      for (Index j = 0; j < d; ++j) E(v, j) = std::ldexp(static_cast<float>(k_dist(gen)), -static_cast<int>(v));
      E(v, d / 2) = std::ldexp(v % 2 ? -127.0f : 127.0f, -static_cast<int>(v));  // the absmax
    }
    const QuantizedEmbedding q(E);
    INFO("d = " << d);
    CHECK(first_difference(lookup_all(q), E) == "");
    for (Index v = 0; v < 4; ++v) CHECK(q.scales()(v, 0) == std::ldexp(1.0f, -static_cast<int>(v)));
  }
  // A row that is one value repeated: every code is +-127 and the row is exact.
  RowMatrix<float> same = RowMatrix<float>::Constant(2, 5, -0.3f);
  same.row(1).setConstant(123.456f);
  CHECK(first_difference(lookup_all(QuantizedEmbedding(same)), same) == "");
}

TEST_CASE("quantized embedding: subnormal rows keep the error bound and never collapse to scale 0",
          "[quantized][nonfinite]") {
  // Below 127 * FLT_MIN (about 1.5e-36) the scale amax / 127 is a subnormal float, with fewer
  // significant bits, or rounds to 0: rounded to nearest it can fall below amax / 127, and the
  // absmax entry's code then exceeds 127 (clamped: an error of up to half the row). The scale is
  // rounded up there instead, so 127 * scale >= amax holds for every row and each element
  // dequantizes within scale / 2 (plus the rounding of the product), as for normal rows.
  const float tiny = std::numeric_limits<float>::denorm_min();  // 2^-149
  const float least = std::numeric_limits<float>::min();        // 2^-126
  std::mt19937_64 gen(15);
  std::uniform_int_distribution<int> steps(-(1 << 22), 1 << 22);  // subnormal multiples of 2^-149
  RowMatrix<float> E(8, 5);
  E.row(0) << tiny, 0, -tiny, 0, tiny;                     // amax / 127 rounds to 0
  E.row(1) << 190 * tiny, -95 * tiny, 3 * tiny, 0, -tiny;  // amax / 127 = 1.496 * 2^-149 rounds down
  E.row(2) << least, -least / 3, least / 128, 0, tiny;     // amax normal, the scale subnormal
  E.row(3) << 127 * least, 1.5f * least, -least, tiny, 0;  // the scale exactly 2^-126: normal
  E.row(4) << 126.9f * least, -least, 100 * tiny, 0, 0;    // just below: subnormal again
  for (Index r = 5; r < 8; ++r)
    for (Index j = 0; j < 5; ++j) E(r, j) = static_cast<float>(steps(gen)) * tiny;
  const QuantizedEmbedding q(E);
  const RowMatrix<float> got = lookup_all(q);
  CHECK(first_difference(got, q.dequantize()) == "");
  for (Index v = 0; v < E.rows(); ++v) {
    double amax = 0;
    for (Index j = 0; j < E.cols(); ++j) amax = std::max(amax, std::abs(static_cast<double>(E(v, j))));
    const double scale = q.scales()(v, 0);
    INFO("row " << v << ", amax " << amax << ", scale " << scale);
    CHECK(scale > 0);
    CHECK(127 * scale >= amax);  // exact in double
    // The nearest float at or above amax / 127: one float less would be below it.
    CHECK(127 * static_cast<double>(std::nextafter(static_cast<float>(scale), 0.0f)) < amax);
    for (Index j = 0; j < E.cols(); ++j) {
      const int code = q.values()(v, j);
      CHECK(code >= -127);
      CHECK(code <= 127);
      const double error = std::abs(static_cast<double>(got(v, j)) - E(v, j));
      CHECK(error <= scale / 2 + std::ldexp(std::abs(static_cast<double>(got(v, j))), -24));
    }
  }
  // The worked cases: the single-ulp row comes back exactly; 190 ulps use scale 2^-148.
  CHECK(first_difference(RowMatrix<float>(got.row(0)), RowMatrix<float>(E.row(0))) == "");
  CHECK(q.scales()(1, 0) == 2 * tiny);
  CHECK(q.values()(1, 0) == 95);
  CHECK(got(1, 0) == 190 * tiny);
  CHECK(q.scales()(3, 0) == least);  // normal: amax / 127 as before
}

TEST_CASE("quantized embedding: lookup gathers dequantized rows, int32 and int64, both overloads", "[quantized]") {
  std::mt19937_64 gen(11);
  for (const Index V : {1, 6, 300}) {
    for (const Index d : {1, 7, 16, 33}) {
      const RowMatrix<float> E = random_matrix<float>(V, d, gen());
      const QuantizedEmbedding q(E);
      // Reference: dequantize every row by hand from the stored codes, then one_hot * table.
      RowMatrix<float> table(V, d);
      for (Index v = 0; v < V; ++v)
        for (Index j = 0; j < d; ++j) table(v, j) = q.scales()(v, 0) * static_cast<float>(q.values()(v, j));
      CHECK(first_difference(q.dequantize(), table) == "");
      const IdMatrix<std::int64_t> ids64 = random_ids<std::int64_t>(3, 5, V, gen());
      const IdMatrix<std::int32_t> ids32 = ids64.cast<std::int32_t>();
      const RowMatrix<float> expected = naive::one_hot_lookup<float>(ids64, table);
      CHECK(first_difference(q.forward(ids32), expected) == "");
      CHECK(first_difference(q.forward(ids64), expected) == "");
      RowMatrix<float> out = RowMatrix<float>::Constant(15, d, 42.0f);
      q.forward(ids32, out);
      CHECK(first_difference(out, expected) == "");
      out.setConstant(42.0f);
      embedhead::quantized_embedding_forward(q.values(), q.scales(), ids64, out);
      CHECK(first_difference(out, expected) == "");
    }
  }
}

TEST_CASE("quantized embedding: errors name the value, where it is and the range; nothing written",
          "[quantized][errors]") {
  const RowMatrix<float> E = random_matrix<float>(4, 3, 13);
  const QuantizedEmbedding q(E);

  SECTION("bad ids") {
    IdMatrix<std::int32_t> ids(2, 3);
    ids << 0, 1, 2, 3, 4, 0;
    RowMatrix<float> out = RowMatrix<float>::Constant(6, 3, 42.0f);
    REQUIRE_THROWS_AS(q.forward(ids, out), embedhead::index_error);
    REQUIRE_THROWS_WITH(q.forward(ids, out),
                        Contains("QuantizedEmbedding::forward: id 4 at (b=1, t=1) outside [0, 4)"));
    REQUIRE_THROWS_WITH(q.forward(ids), Contains("id 4 at (b=1, t=1) outside [0, 4)"));
    CHECK(out == RowMatrix<float>::Constant(6, 3, 42.0f));
    IdMatrix<std::int64_t> ids64(1, 2);
    ids64 << 2, -3;
    RowMatrix<float> out2 = RowMatrix<float>::Constant(2, 3, 42.0f);
    REQUIRE_THROWS_WITH(q.forward(ids64, out2), Contains("id -3 at (b=0, t=1) outside [0, 4)"));
    REQUIRE_THROWS_WITH(embedhead::quantized_embedding_forward(q.values(), q.scales(), ids64, out2),
                        Contains("quantized_embedding_forward: id -3 at (b=0, t=1) outside [0, 4)"));
    CHECK(out2 == RowMatrix<float>::Constant(2, 3, 42.0f));
  }

  SECTION("wrong shapes") {
    IdMatrix<std::int32_t> ids(1, 2);
    ids << 0, 3;
    RowMatrix<float> out = RowMatrix<float>::Constant(2, 4, 42.0f);
    REQUIRE_THROWS_AS(q.forward(ids, out), embedhead::shape_error);
    REQUIRE_THROWS_WITH(q.forward(ids, out),
                        Contains("QuantizedEmbedding::forward: out has shape [2, 4], expected [2, 3]"));
    CHECK(out == RowMatrix<float>::Constant(2, 4, 42.0f));
    RowMatrix<float> good = RowMatrix<float>::Constant(2, 3, 42.0f);
    const RowMatrix<float> short_scales = RowMatrix<float>::Ones(3, 1);
    REQUIRE_THROWS_WITH(embedhead::quantized_embedding_forward(q.values(), short_scales, ids, good),
                        Contains("scales has shape [3, 1], expected [4, 1]"));
    CHECK(good == RowMatrix<float>::Constant(2, 3, 42.0f));
  }

  SECTION("tables that cannot be quantized") {
    RowMatrix<float> bad = RowMatrix<float>::Ones(3, 2);
    bad(2, 1) = std::numeric_limits<float>::quiet_NaN();
    REQUIRE_THROWS_AS(QuantizedEmbedding(bad), embedhead::value_error);
    REQUIRE_THROWS_WITH(QuantizedEmbedding(bad), Contains("QuantizedEmbedding: value nan at (2, 1) is not finite"));
    bad(2, 1) = 1.0f;
    bad(0, 1) = -std::numeric_limits<float>::infinity();
    REQUIRE_THROWS_WITH(QuantizedEmbedding(bad), Contains("value -inf at (0, 1) is not finite"));
    REQUIRE_THROWS_AS(QuantizedEmbedding(RowMatrix<float>(0, 3)), embedhead::value_error);
    REQUIRE_THROWS_WITH(QuantizedEmbedding(RowMatrix<float>(0, 3)),
                        Contains("QuantizedEmbedding: V = 0 outside [1, inf)"));
    REQUIRE_THROWS_WITH(QuantizedEmbedding(RowMatrix<float>(2, 0)),
                        Contains("QuantizedEmbedding: d = 0 outside [1, inf)"));
  }
}
