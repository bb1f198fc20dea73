// Tests for include/embedhead/rope.hpp: the cos/sin table against angles computed here in long
// double at positions up to 1,048,575 (and a demonstration that angles computed in float would
// fail the same check); the forward pass against a reference written as complex multiplication
// (x_u + i x_v) * a * e^(i p theta) in long double, for both pairing conventions, partial rotary,
// implied and per-row positions, in place and out of place; the backward pass by finite
// differences in double and against the conjugate rotation; norm preservation, the
// relative-position property and "applied once"; left-padding invariance; and every error with
// its message and nothing written.
#include <embedhead/rope.hpp>

#include "reference/test_support.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <complex>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

using Catch::Contains;
using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::RopeFrequencies;
using embedhead::RopePairing;
using embedhead::RopeTable;
using embedhead::RowMatrix;
using test_support::first_difference;
using test_support::random_matrix;
using test_support::same_values;

namespace {

// theta_i = base^(-2i / rotary_dim), in long double, as exp(-(2i / rotary_dim) * ln(base)): the
// RoFormer definition, written with other functions than the library's pow.
long double reference_theta(Index i, Index rotary_dim, long double base) {
  return std::exp(-(2.0L * static_cast<long double>(i) / static_cast<long double>(rotary_dim)) * std::log(base));
}

// The pair (u, v) of pair i under a convention.
std::pair<Index, Index> pair_of(RopePairing pairing, Index i, Index rotary_dim) {
  if (pairing == RopePairing::half_split) return {i, i + rotary_dim / 2};
  return {2 * i, 2 * i + 1};
}

// x [N, H * head_dim] rotated as complex numbers: z = x_u + i x_v, z * a * e^(+-i p theta_i),
// in long double; entries beyond rotary_dim copied. position(n) gives row n's position.
template <typename Scalar, typename Position>
RowMatrix<long double> reference_rotate(const RowMatrix<Scalar>& x, Index H, Index head_dim, Index rotary_dim,
                                        RopePairing pairing, const std::vector<long double>& theta, long double a,
                                        const Position& position, bool inverse) {
  RowMatrix<long double> y = x.template cast<long double>();
  for (Index n = 0; n < x.rows(); ++n) {
    const long double p = static_cast<long double>(position(n));
    for (Index h = 0; h < H; ++h)
      for (Index i = 0; i < rotary_dim / 2; ++i) {
        const auto [u, v] = pair_of(pairing, i, rotary_dim);
        const long double angle = (inverse ? -1.0L : 1.0L) * p * theta[static_cast<std::size_t>(i)];
        const std::complex<long double> z(x(n, h * head_dim + u), x(n, h * head_dim + v));
        const std::complex<long double> r = z * std::polar(a, angle);
        y(n, h * head_dim + u) = r.real();
        y(n, h * head_dim + v) = r.imag();
      }
  }
  return y;
}

std::vector<long double> thetas_of(const RopeFrequencies& f) {
  return std::vector<long double>(f.inv_freq.begin(), f.inv_freq.end());
}

// max |a - b| / (1 + |b|) over all entries.
template <typename A>
double max_error(const A& a, const RowMatrix<long double>& b) {
  long double worst = 0;
  for (Index r = 0; r < b.rows(); ++r)
    for (Index c = 0; c < b.cols(); ++c)
      worst = std::max(worst, std::abs(static_cast<long double>(a(r, c)) - b(r, c)) / (1.0L + std::abs(b(r, c))));
  return static_cast<double>(worst);
}

}  // namespace

TEST_CASE("rope: default frequencies are base^(-2i/rotary_dim)", "[rope]") {
  for (const Index rotary_dim : {Index{2}, Index{8}, Index{64}, Index{128}}) {
    for (const double base : {10000.0, 500000.0, 1e6, 2.5}) {
      const RopeFrequencies f = embedhead::rope_default_frequencies(rotary_dim, base);
      REQUIRE(static_cast<Index>(f.inv_freq.size()) == rotary_dim / 2);
      REQUIRE(f.attention_factor == 1.0);
      REQUIRE(f.inv_freq[0] == 1.0);
      for (Index i = 0; i < rotary_dim / 2; ++i) {
        const long double expected = reference_theta(i, rotary_dim, base);
        CHECK(std::abs(f.inv_freq[static_cast<std::size_t>(i)] - expected) <= 4e-16L * expected);
      }
    }
  }
  // Known values: theta_1 for head_dim 128, base 10000 is 10000^(-1/64); the last is 10000^(-63/64).
  const RopeFrequencies f = embedhead::rope_default_frequencies(128, 10000.0);
  CHECK(f.inv_freq[1] == Approx(0.86596432336006535).epsilon(1e-15));
  CHECK(f.inv_freq[63] == Approx(1.1547819846894583e-4).epsilon(1e-14));
}

TEST_CASE("rope: the float table is rounded once from angles computed in double, up to position 1,048,575", "[rope]") {
  const Index head_dim = 128, rotary_dim = 16;
  const double base = 10000.0;
  const RopeFrequencies f = embedhead::rope_default_frequencies(rotary_dim, base);
  const Index positions = 1048576;
  const RopeTable<float> table(head_dim, rotary_dim, RopePairing::half_split, positions, f);
  const RopeTable<double> table_d(head_dim, rotary_dim, RopePairing::half_split, positions, f);
  REQUIRE(table.num_positions() == positions);
  // The double angle p * theta carries an absolute error below 131072 * 2^-52 (4e-11 at 131,071,
  // 3e-10 at 1,048,575): far below a float ulp near 1 (6e-8), so the float table is within 2 ulp of
  // the exact values wherever the value is not tiny, and within that absolute bound everywhere.
  int float_angle_failures = 0;
  for (const Index p : {Index{0}, Index{1}, Index{4095}, Index{4096}, Index{8191}, Index{65535}, Index{131071},
                        Index{524287}, Index{1048575}}) {
    const long double abs_bound = p <= 131071 ? 5e-11L : 5e-10L;
    for (Index i = 0; i < rotary_dim / 2; ++i) {
      const long double angle = static_cast<long double>(p) * reference_theta(i, rotary_dim, base);
      const long double c = std::cos(angle), s = std::sin(angle);
      for (const auto& [got, exact, got_d] :
           {std::tuple{table.cos(p, i), c, table_d.cos(p, i)}, std::tuple{table.sin(p, i), s, table_d.sin(p, i)}}) {
        const long double ulp = std::nextafter(std::abs(static_cast<float>(exact)), 1.0f) -
                                std::abs(static_cast<float>(exact));
        const long double err = std::abs(static_cast<long double>(got) - exact);
        INFO("p = " << p << ", i = " << i << ", exact " << static_cast<double>(exact) << ", got " << got);
        CHECK((err <= 2 * ulp || err <= abs_bound));
        CHECK(std::abs(static_cast<long double>(got_d) - exact) <= abs_bound);
        // The double table rounded to float gives the float table: rounded once.
        CHECK(got == static_cast<float>(got_d));
      }
      // The check above fails for angles computed in float (the bug it exists to catch).
      const float angle_f = static_cast<float>(p) * static_cast<float>(f.inv_freq[static_cast<std::size_t>(i)]);
      const long double wrong = std::cos(static_cast<long double>(angle_f));
      const long double ulp = std::nextafter(std::abs(static_cast<float>(c)), 1.0f) - std::abs(static_cast<float>(c));
      if (!(std::abs(wrong - c) <= 2 * ulp || std::abs(wrong - c) <= abs_bound)) ++float_angle_failures;
    }
  }
  CHECK(float_angle_failures > 20);
  // Position 0 is the identity: cos 1, sin 0 exactly.
  for (Index i = 0; i < rotary_dim / 2; ++i) {
    CHECK(table.cos(0, i) == 1.0f);
    CHECK(table.sin(0, i) == 0.0f);
  }
}

TEMPLATE_TEST_CASE("rope: forward equals complex multiplication, both pairings, partial rotary", "[rope]", float,
                   double) {
  using Scalar = TestType;
  // float: the table's and the products' roundings; double: the angle p * theta rounded to double
  // (p <= 131071 times 2^-53 relative), against the long double reference.
  const double tol = std::is_same_v<Scalar, float> ? 2e-6 : 5e-11;
  const Index H = 3, num_positions = 131072;
  for (const RopePairing pairing : {RopePairing::half_split, RopePairing::interleaved}) {
    for (const auto& [head_dim, rotary_dim] : {std::pair<Index, Index>{16, 16}, std::pair<Index, Index>{16, 8},
                                               std::pair<Index, Index>{10, 2}, std::pair<Index, Index>{12, 6}}) {
      const double base = rotary_dim == 8 ? 500000.0 : 10000.0;
      RopeFrequencies f = embedhead::rope_default_frequencies(rotary_dim, base);
      const long double a = head_dim == 12 ? 1.25L : 1.0L;
      f.attention_factor = static_cast<double>(a);
      const RopeTable<Scalar> table(head_dim, rotary_dim, pairing, num_positions, f);
      const std::vector<long double> theta = thetas_of(f);
      INFO("pairing " << (pairing == RopePairing::half_split ? "half_split" : "interleaved") << ", head_dim "
                      << head_dim << ", rotary_dim " << rotary_dim);

      // Per-row positions [2, 7]: the positions the issue names, and more.
      IdMatrix<std::int64_t> pos(2, 7);
      pos << 0, 1, 4095, 4096, 8191, 65535, 131071, 7, 3, 3, 100, 131070, 2, 0;
      const RowMatrix<Scalar> x = random_matrix<Scalar>(14, H * head_dim, 11);
      const auto position_of = [&pos](Index n) { return pos(n / 7, n % 7); };
      const RowMatrix<long double> expected = reference_rotate(x, H, head_dim, rotary_dim, pairing, theta, a,
                                                               position_of, false);

      RowMatrix<Scalar> in_place = x;
      embedhead::rope_forward(table, in_place, H, pos);
      INFO("error " << max_error(in_place, expected));
      CHECK(max_error(in_place, expected) <= tol);
      RowMatrix<Scalar> out = RowMatrix<Scalar>::Constant(14, H * head_dim, Scalar(7));
      embedhead::rope_forward(table, x, H, pos, out);
      CHECK(same_values(out, in_place));
      // int32 positions give the same bits.
      const IdMatrix<std::int32_t> pos32 = pos.cast<std::int32_t>();
      RowMatrix<Scalar> with32 = x;
      embedhead::rope_forward(table, with32, H, pos32);
      CHECK(same_values(with32, in_place));
      // The pass-through entries are x's, bit for bit.
      for (Index n = 0; n < 14; ++n)
        for (Index h = 0; h < H; ++h)
          for (Index j = rotary_dim; j < head_dim; ++j) REQUIRE(out(n, h * head_dim + j) == x(n, h * head_dim + j));

      // Implied positions: T = 5, start = 131067 -> positions 131067 .. 131071 in each of 2 rows.
      const RowMatrix<Scalar> x2 = random_matrix<Scalar>(10, H * head_dim, 12);
      const auto implied = [](Index n) { return Index{131067} + n % 5; };
      RowMatrix<Scalar> y2 = x2;
      embedhead::rope_forward(table, y2, H, 5, 131067);
      CHECK(max_error(y2, reference_rotate(x2, H, head_dim, rotary_dim, pairing, theta, a, implied, false)) <= tol);
      IdMatrix<std::int64_t> explicit_pos(2, 5);
      for (Index n = 0; n < 10; ++n) explicit_pos(n / 5, n % 5) = 131067 + n % 5;
      RowMatrix<Scalar> y3 = RowMatrix<Scalar>::Zero(10, H * head_dim);
      embedhead::rope_forward(table, x2, H, explicit_pos, y3);
      CHECK(same_values(y3, y2));
      RowMatrix<Scalar> y4 = RowMatrix<Scalar>::Zero(10, H * head_dim);
      embedhead::rope_forward(table, x2, H, 5, 131067, y4);
      CHECK(same_values(y4, y2));
    }
  }
}

TEST_CASE("rope: the two pairings are the same rotation up to a permutation of each head", "[rope]") {
  // Interleaved on x equals half-split on x permuted so that pair (2i, 2i+1) lands on (i, i + r/2).
  const Index head_dim = 8, rotary_dim = 8, H = 2;
  const RopeFrequencies f = embedhead::rope_default_frequencies(rotary_dim, 10000.0);
  const RopeTable<double> half(head_dim, rotary_dim, RopePairing::half_split, 64, f);
  const RopeTable<double> inter(head_dim, rotary_dim, RopePairing::interleaved, 64, f);
  const RowMatrix<double> x = random_matrix<double>(4, H * head_dim, 5);
  RowMatrix<double> permuted(4, H * head_dim);
  for (Index n = 0; n < 4; ++n)
    for (Index h = 0; h < H; ++h)
      for (Index i = 0; i < rotary_dim / 2; ++i) {
        permuted(n, h * head_dim + i) = x(n, h * head_dim + 2 * i);
        permuted(n, h * head_dim + i + rotary_dim / 2) = x(n, h * head_dim + 2 * i + 1);
      }
  RowMatrix<double> yi = x, yh = permuted;
  embedhead::rope_forward(inter, yi, H, 4, 37);
  embedhead::rope_forward(half, yh, H, 4, 37);
  for (Index n = 0; n < 4; ++n)
    for (Index h = 0; h < H; ++h)
      for (Index i = 0; i < rotary_dim / 2; ++i) {
        CHECK(yh(n, h * head_dim + i) == yi(n, h * head_dim + 2 * i));
        CHECK(yh(n, h * head_dim + i + rotary_dim / 2) == yi(n, h * head_dim + 2 * i + 1));
      }
  // And they differ from each other on the same x (the convention matters).
  RowMatrix<double> yh_same = x;
  embedhead::rope_forward(half, yh_same, H, 4, 37);
  CHECK_FALSE(same_values(yh_same, yi));
}

TEST_CASE("rope: a rotation: norms kept, q.k depends on p - p' only, applied once", "[rope]") {
  const Index head_dim = 12, rotary_dim = 8, H = 2;
  for (const RopePairing pairing : {RopePairing::half_split, RopePairing::interleaved}) {
    const RopeFrequencies f = embedhead::rope_default_frequencies(rotary_dim, 10000.0);
    const RopeTable<double> table(head_dim, rotary_dim, pairing, 70000, f);
    const RowMatrix<double> q = random_matrix<double>(1, H * head_dim, 21);
    const RowMatrix<double> k = random_matrix<double>(1, H * head_dim, 22);
    const auto rotated = [&](const RowMatrix<double>& x, Index p) {
      RowMatrix<double> y = x;
      embedhead::rope_forward(table, y, H, 1, p);
      return y;
    };
    for (const Index p : {Index{0}, Index{1}, Index{4096}, Index{65535}}) {
      const RowMatrix<double> y = rotated(q, p);
      for (Index h = 0; h < H; ++h)
        CHECK(y.block(0, h * head_dim, 1, head_dim).norm() ==
              Approx(q.block(0, h * head_dim, 1, head_dim).norm()).epsilon(1e-14));
    }
    // <R(p) q, R(p') k> per head is the same for (p, p') = (10, 3), (4103, 4096), (65542, 65535).
    for (Index h = 0; h < H; ++h) {
      const auto dot = [&](Index p, Index pk) {
        return (rotated(q, p).block(0, h * head_dim, 1, head_dim).array() *
                rotated(k, pk).block(0, h * head_dim, 1, head_dim).array())
            .sum();
      };
      const double base_dot = dot(10, 3);
      CHECK(dot(4103, 4096) == Approx(base_dot).epsilon(1e-9));
      CHECK(dot(65542, 65535) == Approx(base_dot).epsilon(1e-9));
      // Not invariant to the absolute positions when the offset differs (the test can fail).
      CHECK(std::abs(dot(11, 3) - base_dot) > 1e-6);
    }
    // Applied once: the result at p is one rotation by p, which differs from rotating twice (a
    // double application would be the rotation by 2p).
    const RowMatrix<double> once = rotated(q, 5000);
    const RowMatrix<double> twice = rotated(rotated(q, 2500), 2500);
    CHECK(max_error(twice, once.cast<long double>()) <= 1e-12);
    CHECK(max_error(rotated(once, 5000), once.cast<long double>()) > 1e-3);
  }
}

TEST_CASE("rope: backward is a * R^T, checked by finite differences in double", "[rope]") {
  for (const RopePairing pairing : {RopePairing::half_split, RopePairing::interleaved}) {
    const Index head_dim = 10, rotary_dim = 6, H = 2, T = 3;
    RopeFrequencies f = embedhead::rope_default_frequencies(rotary_dim, 10000.0);
    f.attention_factor = 1.3;
    const RopeTable<double> table(head_dim, rotary_dim, pairing, 5000, f);
    IdMatrix<std::int32_t> pos(2, T);
    pos << 4999, 0, 17, 2, 4095, 1;
    const RowMatrix<double> x = random_matrix<double>(2 * T, H * head_dim, 31);
    const RowMatrix<double> w = random_matrix<double>(2 * T, H * head_dim, 32);  // L = sum(w .* y)
    const auto loss = [&](const RowMatrix<double>& in) {
      RowMatrix<double> y = in;
      embedhead::rope_forward(table, y, H, pos);
      return (y.array() * w.array()).sum();
    };
    RowMatrix<double> dx = w;  // dL/dy = w
    embedhead::rope_backward(table, dx, H, pos);
    RowMatrix<double> dx_out = RowMatrix<double>::Zero(2 * T, H * head_dim);
    embedhead::rope_backward(table, w, H, pos, dx_out);
    CHECK(same_values(dx_out, dx));
    const double eps = 1e-6;
    for (Index r = 0; r < x.rows(); ++r)
      for (Index c = 0; c < x.cols(); ++c) {
        RowMatrix<double> plus = x, minus = x;
        plus(r, c) += eps;
        minus(r, c) -= eps;
        const double numeric = (loss(plus) - loss(minus)) / (2 * eps);
        INFO("r = " << r << ", c = " << c);
        CHECK(dx(r, c) == Approx(numeric).epsilon(1e-8).margin(1e-9));
      }
    // Against the conjugate rotation written as complex multiplication.
    const auto position_of = [&pos](Index n) { return static_cast<Index>(pos(n / T, n % T)); };
    CHECK(max_error(dx, reference_rotate(w, H, head_dim, rotary_dim, pairing, thetas_of(f), 1.3L, position_of, true)) <=
          1e-13);
    // With a = 1 the backward undoes the forward.
    const RopeTable<double> plain(head_dim, rotary_dim, pairing, 5000,
                                  embedhead::rope_default_frequencies(rotary_dim, 10000.0));
    RowMatrix<double> round_trip = x;
    embedhead::rope_forward(plain, round_trip, H, pos);
    embedhead::rope_backward(plain, round_trip, H, pos);
    CHECK(max_error(round_trip, x.cast<long double>()) <= 1e-15);
    // The implied-position backward equals the explicit one.
    IdMatrix<std::int64_t> implied(2, T);
    implied << 40, 41, 42, 40, 41, 42;
    RowMatrix<double> a1 = w, a2 = w;
    embedhead::rope_backward(table, a1, H, implied);
    embedhead::rope_backward(table, a2, H, T, 40);
    CHECK(same_values(a1, a2));
    RowMatrix<double> a3 = RowMatrix<double>::Zero(2 * T, H * head_dim);
    embedhead::rope_backward(table, w, H, T, 40, a3);
    CHECK(same_values(a1, a3));
  }
}

TEST_CASE("rope: a left-padded row gives the bits of the same sequence alone", "[rope]") {
  const Index head_dim = 8, H = 4, L = 5, pad = 3;
  const RopeTable<float> table(head_dim, head_dim, RopePairing::half_split, 64,
                               embedhead::rope_default_frequencies(head_dim, 10000.0));
  const RowMatrix<float> alone = random_matrix<float>(L, H * head_dim, 41);
  // Batch of 2 rows, T = L + pad: row 0 left-padded (pads at position 1, HF's rule), row 1 full.
  RowMatrix<float> batch = random_matrix<float>(2 * (L + pad), H * head_dim, 42);
  batch.block(pad, 0, L, H * head_dim) = alone;
  IdMatrix<std::int64_t> pos(2, L + pad);
  for (Index t = 0; t < L + pad; ++t) {
    pos(0, t) = t < pad ? 1 : t - pad;
    pos(1, t) = t;
  }
  RowMatrix<float> alone_out = alone;
  embedhead::rope_forward(table, alone_out, H, L, 0);
  embedhead::rope_forward(table, batch, H, pos);
  const RowMatrix<float> real_part = batch.block(pad, 0, L, H * head_dim);
  INFO(first_difference(real_part, alone_out));
  CHECK(same_values(real_part, alone_out));
}

TEST_CASE("rope: bad input throws naming the value and range, and writes nothing", "[rope]") {
  const RopeFrequencies f8 = embedhead::rope_default_frequencies(8, 10000.0);
  using embedhead::index_error;
  using embedhead::shape_error;
  using embedhead::value_error;
  // Frequencies.
  REQUIRE_THROWS_MATCHES(embedhead::rope_default_frequencies(7, 10000.0), value_error,
                         Catch::Message("rope_default_frequencies: rotary_dim = 7 must be even and in [2, inf)"));
  REQUIRE_THROWS_MATCHES(embedhead::rope_default_frequencies(0, 10000.0), value_error,
                         Catch::Message("rope_default_frequencies: rotary_dim = 0 must be even and in [2, inf)"));
  REQUIRE_THROWS_MATCHES(embedhead::rope_default_frequencies(8, 0.0), value_error,
                         Catch::Message("rope_default_frequencies: base = 0 outside (0, inf)"));
  REQUIRE_THROWS_MATCHES(embedhead::rope_default_frequencies(8, -1.0), value_error,
                         Catch::Message("rope_default_frequencies: base = -1 outside (0, inf)"));
  REQUIRE_THROWS_WITH(embedhead::rope_default_frequencies(8, std::numeric_limits<double>::quiet_NaN()),
                      Contains("base = nan outside (0, inf)"));
  REQUIRE_THROWS_WITH(embedhead::rope_default_frequencies(8, std::numeric_limits<double>::infinity()),
                      Contains("base = inf outside (0, inf)"));
  // Table.
  REQUIRE_THROWS_MATCHES(RopeTable<float>(9, 8, RopePairing::half_split, 16, f8), value_error,
                         Catch::Message("RopeTable: head_dim = 9 must be even and in [2, inf)"));
  REQUIRE_THROWS_MATCHES(RopeTable<float>(6, 8, RopePairing::half_split, 16, f8), value_error,
                         Catch::Message("RopeTable: rotary_dim = 8 must be even and in [2, head_dim = 6]"));
  REQUIRE_THROWS_MATCHES(RopeTable<float>(8, 7, RopePairing::half_split, 16, f8), value_error,
                         Catch::Message("RopeTable: rotary_dim = 7 must be even and in [2, head_dim = 8]"));
  REQUIRE_THROWS_MATCHES(RopeTable<float>(8, 8, RopePairing::half_split, 0, f8), value_error,
                         Catch::Message("RopeTable: num_positions = 0 outside [1, inf)"));
  REQUIRE_THROWS_MATCHES(RopeTable<float>(8, 6, RopePairing::half_split, 16, f8), value_error,
                         Catch::Message("RopeTable: inv_freq has 4 entries, expected rotary_dim / 2 = 3"));
  RopeFrequencies bad = f8;
  bad.inv_freq[2] = std::numeric_limits<double>::quiet_NaN();
  REQUIRE_THROWS_MATCHES(RopeTable<float>(8, 8, RopePairing::half_split, 16, bad), value_error,
                         Catch::Message("RopeTable: inv_freq[2] = nan outside [0, inf)"));
  bad.inv_freq[2] = -0.5;
  REQUIRE_THROWS_MATCHES(RopeTable<float>(8, 8, RopePairing::half_split, 16, bad), value_error,
                         Catch::Message("RopeTable: inv_freq[2] = -0.5 outside [0, inf)"));
  bad = f8;
  bad.attention_factor = 0.0;
  REQUIRE_THROWS_MATCHES(RopeTable<float>(8, 8, RopePairing::half_split, 16, bad), value_error,
                         Catch::Message("RopeTable: attention_factor = 0 outside (0, inf)"));
  bad.attention_factor = std::numeric_limits<double>::infinity();
  REQUIRE_THROWS_WITH(RopeTable<float>(8, 8, RopePairing::half_split, 16, bad),
                      Contains("attention_factor = inf outside (0, inf)"));

  // Kernels: every error leaves x (and out) as they were.
  const RopeTable<float> table(8, 8, RopePairing::half_split, 16, f8);
  const RowMatrix<float> x0 = random_matrix<float>(6, 16, 51);
  RowMatrix<float> x = x0;
  IdMatrix<std::int64_t> pos(2, 3);
  pos << 0, 1, 2, 3, 4, 15;
  REQUIRE_THROWS_MATCHES(embedhead::rope_forward(table, x, 0, pos), value_error,
                         Catch::Message("rope_forward: num_heads = 0 outside [1, inf)"));
  REQUIRE_THROWS_MATCHES(embedhead::rope_forward(table, x, 3, pos), shape_error,
                         Catch::Message(
                             "rope_forward: x has shape [6, 16], expected [N, num_heads * head_dim = 3 * 8 = "
                             "24]"));
  IdMatrix<std::int64_t> wrong_rows(3, 3);
  wrong_rows.setZero();
  REQUIRE_THROWS_MATCHES(embedhead::rope_forward(table, x, 2, wrong_rows), shape_error,
                         Catch::Message("rope_forward: positions is [3, 3], B*T = 9 rows, but x has 6 rows (row n = "
                                        "b*T + t)"));
  pos(1, 2) = 16;
  REQUIRE_THROWS_MATCHES(embedhead::rope_forward(table, x, 2, pos), index_error,
                         Catch::Message("rope_forward: position 16 at (b=1, t=2) outside the table's [0, 16)"));
  pos(1, 2) = 15;
  pos(0, 1) = -1;
  REQUIRE_THROWS_MATCHES(embedhead::rope_backward(table, x, 2, pos), index_error,
                         Catch::Message("rope_backward: position -1 at (b=0, t=1) outside the table's [0, 16)"));
  pos(0, 1) = 1;
  REQUIRE_THROWS_MATCHES(embedhead::rope_forward(table, x, 2, 4, 0), shape_error,
                         Catch::Message("rope_forward: T = 4 must be >= 1 and divide the 6 rows of x (row n = b*T + "
                                        "t)"));
  REQUIRE_THROWS_MATCHES(embedhead::rope_forward(table, x, 2, 0, 0), shape_error,
                         Catch::Message("rope_forward: T = 0 must be >= 1 and divide the 6 rows of x (row n = b*T + "
                                        "t)"));
  REQUIRE_THROWS_MATCHES(embedhead::rope_forward(table, x, 2, 3, 14), index_error,
                         Catch::Message("rope_forward: positions start = 14 .. start + T - 1 = 16 outside the table's "
                                        "[0, 16)"));
  REQUIRE_THROWS_MATCHES(embedhead::rope_backward(table, x, 2, 3, -1), index_error,
                         Catch::Message("rope_backward: positions start = -1 .. start + T - 1 = 1 outside the table's "
                                        "[0, 16)"));
  RowMatrix<float> out = RowMatrix<float>::Constant(6, 8, 3.0f);
  const RowMatrix<float> out0 = out;
  REQUIRE_THROWS_MATCHES(embedhead::rope_forward(table, x0, 2, pos, out), shape_error,
                         Catch::Message("rope_forward: out has shape [6, 8], expected [6, 16]"));
  REQUIRE_THROWS_MATCHES(embedhead::rope_backward(table, x0, 2, 3, 0, out), shape_error,
                         Catch::Message("rope_backward: out has shape [6, 8], expected [6, 16]"));
  CHECK(same_values(x, x0));
  CHECK(same_values(out, out0));
  // And the valid call still works after all that.
  embedhead::rope_forward(table, x, 2, pos);
  CHECK_FALSE(same_values(x, x0));
}
