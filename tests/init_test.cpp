// Tests for include/embedhead/init.hpp: the counter-based Rng and init_normal.
//
// Expected values come from an independent SplitMix64 written below (itself checked against the
// published reference outputs for seed 1234567), from the definitions in the header comment, and
// from statistical bounds whose width is derived from the sample size (6 standard errors, so a
// correct generator fails with probability ~1e-9 per check while the seeds stay fixed anyway).
#include <embedhead/errors.hpp>
#include <embedhead/init.hpp>
#include <embedhead/output_projection.hpp>
#include <embedhead/position_embedding.hpp>
#include <embedhead/token_embedding.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

using embedhead::Index;
using embedhead::Rng;
using embedhead::RowMatrix;
using Catch::Matchers::WithinAbs;
using Catch::Matchers::WithinRel;

namespace {

constexpr std::uint64_t kGolden = 0x9E3779B97F4A7C15ULL;

// SplitMix64's output function (Steele, Lea, Flood 2014), written from the paper's constants.
std::uint64_t splitmix_finaliser(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// The textbook sequential SplitMix64: add the golden gamma, then finalise.
struct ReferenceSplitMix64 {
  std::uint64_t state;
  std::uint64_t next() { return splitmix_finaliser(state += kGolden); }
};

// Sample mean and (population-normalised) variance; the n is large enough that n vs n-1 is noise.
struct Moments {
  double mean = 0, variance = 0;
};
Moments moments(const std::vector<double>& x) {
  Moments m;
  for (double v : x) m.mean += v;
  m.mean /= static_cast<double>(x.size());
  for (double v : x) m.variance += (v - m.mean) * (v - m.mean);
  m.variance /= static_cast<double>(x.size());
  return m;
}

double correlation(const std::vector<double>& a, const std::vector<double>& b) {
  const Moments ma = moments(a), mb = moments(b);
  double cov = 0;
  for (std::size_t i = 0; i < a.size(); ++i) cov += (a[i] - ma.mean) * (b[i] - mb.mean);
  cov /= static_cast<double>(a.size());
  return cov / std::sqrt(ma.variance * mb.variance);
}

std::vector<double> uniforms(std::uint64_t seed, std::size_t n) {
  Rng rng(seed);
  std::vector<double> u(n);
  for (auto& v : u) v = rng.uniform();
  return u;
}

}  // namespace

TEST_CASE("Rng: known-answer test against a reference SplitMix64", "[init][rng]") {
  SECTION("the reference itself reproduces the published SplitMix64 outputs") {
    // Seed 1234567: the outputs printed by Vigna's splitmix64.c (also Rosetta Code's task).
    ReferenceSplitMix64 ref{1234567};
    CHECK(ref.next() == 6457827717110365317ULL);
    CHECK(ref.next() == 3203168211198807973ULL);
    CHECK(ref.next() == 9817491932198370423ULL);
    CHECK(ref.next() == 4593380528125082431ULL);
    CHECK(ref.next() == 16408922859458223821ULL);
    // Seed 0: first output 0xE220A8397B1DCDAF.
    ReferenceSplitMix64 zero{0};
    CHECK(zero.next() == 0xE220A8397B1DCDAFULL);
  }

  SECTION("draw i is the finaliser applied to a Weyl sequence keyed by the hashed seed") {
    // The header: key = finalise(seed), draw i = finalise(key + (i + 1) * golden), i.e. the
    // sequential SplitMix64 started from state key.
    for (std::uint64_t seed : {0ULL, 1ULL, 2ULL, 42ULL, 1234567ULL, 0xFFFFFFFFFFFFFFFFULL}) {
      INFO("seed " << seed);
      const Rng rng(seed);
      ReferenceSplitMix64 ref{splitmix_finaliser(seed)};
      for (std::uint64_t i = 0; i < 64; ++i) {
        INFO("draw " << i);
        const std::uint64_t expected = ref.next();
        REQUIRE(rng.bits_at(i) == expected);
        // 53 high bits scaled by 2^-53: exactly representable, so compare with ==.
        REQUIRE(rng.uniform_at(i) == static_cast<double>(expected >> 11) / 9007199254740992.0);
      }
    }
  }

  SECTION("normal_at is Box-Muller on uniforms i and i + 1") {
    const Rng rng(7);
    const double pi = 3.14159265358979323846;
    for (std::uint64_t i = 0; i < 64; ++i) {
      const double u1 = rng.uniform_at(i), u2 = rng.uniform_at(i + 1);
      const double expected = std::sqrt(-2.0 * std::log(1.0 - u1)) * std::cos(2.0 * pi * u2);
      INFO("draw " << i);
      REQUIRE_THAT(rng.normal_at(i), WithinRel(expected, 1e-14) || WithinAbs(expected, 1e-15));
    }
  }
}

TEST_CASE("Rng: the state is (seed, counter) and bits_at ignores the counter", "[init][rng]") {
  SECTION("same seed, same stream") {
    Rng a(99), b(99);
    for (int i = 0; i < 1000; ++i) REQUIRE(a.next_bits() == b.next_bits());
    CHECK(a.seed() == 99);
    CHECK(a.counter() == 1000);
  }

  SECTION("a fresh Rng starts at counter 0 with seed 0 by default") {
    const Rng rng;
    CHECK(rng.seed() == 0);
    CHECK(rng.counter() == 0);
    CHECK(rng.bits_at(0) == Rng(0).bits_at(0));
  }

  SECTION("restoring (seed, counter) resumes the stream") {
    Rng original(12345);
    for (int i = 0; i < 37; ++i) original.next_bits();
    (void)original.normal();   // two draws
    (void)original.uniform();  // one draw
    REQUIRE(original.counter() == 40);

    Rng restored(original.seed());
    restored.set_counter(original.counter());
    for (int i = 0; i < 100; ++i) {
      REQUIRE(restored.next_bits() == original.next_bits());
      REQUIRE(restored.uniform() == original.uniform());
      REQUIRE(restored.normal() == original.normal());
    }
    CHECK(restored.counter() == original.counter());
  }

  SECTION("next_bits / uniform / normal read draw `counter` and advance by 1 / 1 / 2") {
    Rng rng(5);
    const Rng reader(5);  // same seed, counter never moved
    rng.set_counter(10);
    CHECK(rng.next_bits() == reader.bits_at(10));
    CHECK(rng.counter() == 11);
    CHECK(rng.uniform() == reader.uniform_at(11));
    CHECK(rng.counter() == 12);
    CHECK(rng.normal() == reader.normal_at(12));
    CHECK(rng.counter() == 14);
    CHECK(rng.next_bits() == reader.bits_at(14));
  }

  SECTION("bits_at does not depend on or move the counter") {
    Rng rng(2024);
    const std::uint64_t before = rng.bits_at(17);
    rng.set_counter(1000);
    for (int i = 0; i < 5; ++i) rng.next_bits();
    CHECK(rng.bits_at(17) == before);
    CHECK(rng.counter() == 1005);
    (void)rng.bits_at(3);
    (void)rng.uniform_at(3);
    (void)rng.normal_at(3);
    CHECK(rng.counter() == 1005);
  }

  SECTION("advance(n) is n draws skipped") {
    Rng skipped(8), drawn(8);
    skipped.advance(25);
    for (int i = 0; i < 25; ++i) drawn.next_bits();
    CHECK(skipped.counter() == 25);
    CHECK(skipped.next_bits() == drawn.next_bits());
    skipped.advance(0);
    CHECK(skipped.counter() == 26);
  }
}

TEST_CASE("Rng: uniform draws lie in [0, 1) with the uniform's moments", "[init][rng]") {
  const std::size_t n = 1000000;
  const std::vector<double> u = uniforms(31337, n);
  double lo = 1, hi = 0;
  for (double v : u) {
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  CHECK(lo >= 0.0);
  CHECK(hi < 1.0);
  // U(0,1): mean 1/2, variance 1/12; the sample variance of a uniform has sd sqrt(1/180 / n).
  const Moments m = moments(u);
  const double sqrt_n = std::sqrt(static_cast<double>(n));
  CHECK_THAT(m.mean, WithinAbs(0.5, 6.0 * std::sqrt(1.0 / 12.0) / sqrt_n));
  CHECK_THAT(m.variance, WithinAbs(1.0 / 12.0, 6.0 * std::sqrt(1.0 / 180.0) / sqrt_n));
  // Consecutive draws of one stream are uncorrelated.
  const std::vector<double> head(u.begin(), u.end() - 1), tail(u.begin() + 1, u.end());
  CHECK(std::abs(correlation(head, tail)) < 6.0 / sqrt_n);
}

TEST_CASE("Rng: normal draws have the standard normal's moments", "[init][rng]") {
  const std::size_t n = 1000000;
  Rng rng(4242);
  std::vector<double> z(n);
  for (auto& v : z) v = rng.normal();
  CHECK(rng.counter() == 2 * n);
  std::size_t non_finite = 0;
  for (double v : z) non_finite += std::isfinite(v) ? 0 : 1;
  CHECK(non_finite == 0);

  const Moments m = moments(z);
  const double sqrt_n = std::sqrt(static_cast<double>(n));
  // sd of the sample mean is 1/sqrt(n); of the sample variance sqrt(2/n) (Var z^2 = 2).
  CHECK_THAT(m.mean, WithinAbs(0.0, 6.0 / sqrt_n));
  CHECK_THAT(m.variance, WithinAbs(1.0, 6.0 * std::sqrt(2.0 / static_cast<double>(n))));
  // Fourth moment 3 (a wrong Box-Muller, e.g. a missing sqrt, keeps the mean but not this);
  // Var z^4 = E z^8 - 9 = 105 - 9 = 96.
  double fourth = 0;
  for (double v : z) fourth += v * v * v * v;
  fourth /= static_cast<double>(n);
  CHECK_THAT(fourth, WithinAbs(3.0, 6.0 * std::sqrt(96.0) / sqrt_n));
  // Symmetry: P(z < 0) = 1/2, sd 0.5/sqrt(n).
  double negative = 0;
  for (double v : z) negative += v < 0 ? 1.0 : 0.0;
  CHECK_THAT(negative / static_cast<double>(n), WithinAbs(0.5, 6.0 * 0.5 / sqrt_n));
}

TEST_CASE("Rng: different seeds give different, uncorrelated streams", "[init][rng]") {
  const std::size_t n = 100000;
  const std::vector<std::vector<double>> streams = {uniforms(0, n), uniforms(1, n), uniforms(2, n)};
  const double bound = 6.0 / std::sqrt(static_cast<double>(n));
  for (std::size_t a = 0; a < streams.size(); ++a)
    for (std::size_t b = a + 1; b < streams.size(); ++b) {
      INFO("seeds " << a << " and " << b);
      std::size_t equal = 0;
      for (std::size_t i = 0; i < n; ++i) equal += streams[a][i] == streams[b][i] ? 1 : 0;
      CHECK(equal == 0);  // 53-bit values: a collision at the same index has probability ~1e-11
      CHECK(std::abs(correlation(streams[a], streams[b])) < bound);
    }
  // A stream is not a shifted copy of its neighbour seed's stream.
  const std::vector<double> shifted(streams[1].begin() + 1, streams[1].end());
  const std::vector<double> base(streams[0].begin(), streams[0].end() - 1);
  CHECK(std::abs(correlation(base, shifted)) < bound);
  CHECK(Rng(0).bits_at(0) != Rng(1).bits_at(0));
}

TEMPLATE_TEST_CASE("init_normal: element (r, c) from draws counter + 2(r*cols + c)", "[init][init_normal]", float,
                   double) {
  using Scalar = TestType;

  SECTION("each element is std * normal_at(base + 2*(r*cols + c)), rounded to Scalar") {
    Rng rng(77);
    rng.set_counter(9);  // an odd start, so pairs do not line up with even draws
    const Rng reader(77);
    RowMatrix<Scalar> W(3, 4);
    embedhead::init_normal<Scalar>(W, 0.5, rng);
    for (Index r = 0; r < 3; ++r)
      for (Index c = 0; c < 4; ++c) {
        INFO("(r, c) = (" << r << ", " << c << ")");
        const auto draw = static_cast<std::uint64_t>(9 + 2 * (r * 4 + c));
        REQUIRE(W(r, c) == static_cast<Scalar>(0.5 * reader.normal_at(draw)));
      }
    CHECK(rng.counter() == 9 + 2 * 12);
  }

  SECTION("the same as sequential normal() calls in row-major order") {
    Rng filler(3), sequential(3);
    filler.set_counter(100);
    sequential.set_counter(100);
    RowMatrix<Scalar> W(5, 7);
    embedhead::init_normal<Scalar>(W, 1.0, filler);
    for (Index r = 0; r < 5; ++r)
      for (Index c = 0; c < 7; ++c) REQUIRE(W(r, c) == static_cast<Scalar>(sequential.normal()));
    CHECK(filler.counter() == sequential.counter());
  }

  SECTION("a [2, 3] and a [3, 2] matrix from the same counter hold the same row-major sequence") {
    Rng a(11), b(11);
    a.set_counter(40);
    b.set_counter(40);
    RowMatrix<Scalar> wide(2, 3), tall(3, 2);
    embedhead::init_normal<Scalar>(wide, 0.02, a);
    embedhead::init_normal<Scalar>(tall, 0.02, b);
    for (Index i = 0; i < 6; ++i) REQUIRE(wide.data()[i] == tall.data()[i]);
    CHECK(a.counter() == 52);
    CHECK(b.counter() == 52);
  }

  SECTION("consecutive fills continue the stream") {
    Rng rng(5);
    RowMatrix<Scalar> first(2, 2), second(2, 2), both(4, 2);
    embedhead::init_normal<Scalar>(first, 1.0, rng);
    embedhead::init_normal<Scalar>(second, 1.0, rng);
    Rng again(5);
    embedhead::init_normal<Scalar>(both, 1.0, again);
    CHECK(both.topRows(2) == first);
    CHECK(both.bottomRows(2) == second);
    CHECK(rng.counter() == again.counter());
  }

  SECTION("a strided view (block of a larger matrix) is indexed by the view's own (r, c)") {
    RowMatrix<Scalar> big = RowMatrix<Scalar>::Constant(4, 5, Scalar(-7));
    Rng rng(21);
    const Rng reader(21);
    embedhead::init_normal<Scalar>(big.block(1, 1, 2, 3), 2.0, rng);
    for (Index r = 0; r < 4; ++r)
      for (Index c = 0; c < 5; ++c) {
        INFO("(r, c) = (" << r << ", " << c << ")");
        const bool inside = r >= 1 && r < 3 && c >= 1 && c < 4;
        if (inside) {
          const auto draw = static_cast<std::uint64_t>(2 * ((r - 1) * 3 + (c - 1)));
          REQUIRE(big(r, c) == static_cast<Scalar>(2.0 * reader.normal_at(draw)));
        } else {
          REQUIRE(big(r, c) == Scalar(-7));
        }
      }
    CHECK(rng.counter() == 12);
  }

  SECTION("errors: std <= 0, NaN or infinite throws value_error; W and the counter unchanged") {
    struct Case {
      double std;
      const char* printed;
    };
    const double inf = std::numeric_limits<double>::infinity();
    const Case cases[] = {{0.0, "std = 0 "},
                          {-0.02, "std = -0.02 "},
                          {std::numeric_limits<double>::quiet_NaN(), "std = nan "},
                          {inf, "std = inf "},
                          {-inf, "std = -inf "}};
    for (const Case& bad : cases) {
      INFO("std " << bad.std);
      Rng rng(1);
      rng.set_counter(6);
      RowMatrix<Scalar> W = RowMatrix<Scalar>::Constant(2, 3, Scalar(0.25));
      REQUIRE_THROWS_AS(embedhead::init_normal<Scalar>(W, bad.std, rng), embedhead::value_error);
      REQUIRE_THROWS_AS(embedhead::init_normal<Scalar>(W, bad.std, rng), std::invalid_argument);
      REQUIRE_THROWS_WITH(embedhead::init_normal<Scalar>(W, bad.std, rng), Catch::Contains("init_normal") &&
                                                                               Catch::Contains(bad.printed) &&
                                                                               Catch::Contains("outside (0, inf)"));
      CHECK(W == RowMatrix<Scalar>::Constant(2, 3, Scalar(0.25)));
      CHECK(rng.counter() == 6);
      CHECK(rng.seed() == 1);
    }
  }
}

TEST_CASE("init_normal: a large fill has mean 0 and the requested std", "[init][init_normal]") {
  const double sigma = 0.02;
  RowMatrix<double> W(500, 400);
  Rng rng(2718);
  embedhead::init_normal<double>(W, sigma, rng);
  const double n = static_cast<double>(W.size());
  const double mean = W.mean();
  const double sample_std = std::sqrt((W.array() - mean).square().sum() / (n - 1));
  CHECK_THAT(mean, WithinAbs(0.0, 6.0 * sigma / std::sqrt(n)));
  CHECK_THAT(sample_std, WithinAbs(sigma, 6.0 * sigma / std::sqrt(2.0 * n)));
}

TEMPLATE_TEST_CASE("init_std is checked in the Scalar the table is stored in, by init_normal and every layer",
                   "[init][init_normal][errors]", float, double) {
  using Scalar = TestType;
  constexpr bool is_float = std::is_same_v<Scalar, float>;
  const char* type = is_float ? "float" : "double";
  const double largest = static_cast<double>(std::numeric_limits<Scalar>::max());
  // Finite in Scalar, but its largest draw -- sqrt(-2 ln 2^-53) = 8.5717 standard deviations,
  // the most Rng::normal_at gives -- is not: 1e38 in float, 1e308 in double.
  const double huge = is_float ? 1e38 : 1e308;
  RowMatrix<Scalar> W = RowMatrix<Scalar>::Constant(3, 4, Scalar(7));
  Rng rng(5);
  REQUIRE_THROWS_AS(embedhead::init_normal<Scalar>(W, huge, rng), embedhead::value_error);
  REQUIRE_THROWS_WITH(
      embedhead::init_normal<Scalar>(W, huge, rng),
      Catch::Contains(std::string("init_normal: std = ") + (is_float ? "1e+38" : "1e+308") + " outside (0, ") &&
          Catch::Contains(std::string("] in ") + type + ": its largest draw, 8.5717 standard deviations"));
  // The bound itself: just below it every draw is finite, just above it throws.
  REQUIRE_THROWS_AS(embedhead::init_normal<Scalar>(W, largest / 8.5, rng), embedhead::value_error);
  CHECK(W == RowMatrix<Scalar>::Constant(3, 4, Scalar(7)));
  CHECK(rng.counter() == 0);
  embedhead::init_normal<Scalar>(W, largest / 8.58, rng);
  CHECK(W.allFinite());

  // 1e-50 is positive in double and 0 in float: a float table of zeros, not N(0, 1e-100).
  RowMatrix<Scalar> V = RowMatrix<Scalar>::Constant(3, 4, Scalar(7));
  Rng rng2(5);
  if constexpr (is_float) {
    REQUIRE_THROWS_WITH(embedhead::init_normal<Scalar>(V, 1e-50, rng2),
                        Catch::Contains("init_normal: std = 1e-50 outside (0, inf) in float: it rounds to 0"));
    CHECK(V == RowMatrix<Scalar>::Constant(3, 4, Scalar(7)));
    CHECK(rng2.counter() == 0);
  } else {
    embedhead::init_normal<Scalar>(V, 1e-50, rng2);
    CHECK((V.array() != 0).all());
    CHECK((V.array().abs() <= 1e-50 * 8.5717).all());
  }

  // The layers that draw a table check before allocating it, naming themselves.
  for (const double bad : {huge, 1e-50}) {
    if (!is_float && bad == 1e-50) continue;
    INFO("init_std = " << bad);
    embedhead::TokenEmbeddingOptions token;
    token.init_std = bad;
    REQUIRE_THROWS_WITH(embedhead::TokenEmbedding<Scalar>(5, 3, token),
                        Catch::Contains("TokenEmbedding: init_std = ") && Catch::Contains(type));
    embedhead::LearnedPositionOptions position;
    position.init_std = bad;
    REQUIRE_THROWS_WITH(embedhead::LearnedPositionEmbedding<Scalar>(5, 3, position),
                        Catch::Contains("LearnedPositionEmbedding: init_std = ") && Catch::Contains(type));
    embedhead::OutputProjectionOptions head;
    head.init_std = bad;
    REQUIRE_THROWS_WITH(embedhead::OutputProjection<Scalar>(5, 3, head),
                        Catch::Contains("OutputProjection: init_std = ") && Catch::Contains(type));
  }
}
