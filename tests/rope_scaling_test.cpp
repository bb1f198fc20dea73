// Tests for include/embedhead/rope_scaling.hpp: every scaling against a reference written here
// from the published definitions in long double, with another formulation where there is one
// (exp / log instead of pow, rotations in L instead of wavelengths, the ramp written as a blend of
// the two frequency sets) -- never the code under test -- at several rotary dims and bases; known
// values of real configs (Llama 3.1, a Qwen2.5-style and a DeepSeek-V3-style YaRN, Phi-3's
// LongRoPE); transformers' stateful dynamic NTK decisions (DynamicNtkRopeCache); a RopeTable built
// from the frequencies; and every error with its message.
#include <embedhead/rope.hpp>
#include <embedhead/rope_scaling.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstddef>
#include <limits>
#include <optional>
#include <string>
#include <vector>

using Catch::Contains;
using embedhead::Index;
using embedhead::RopeFrequencies;

namespace {

using Real = long double;
const Real kPi = 3.141592653589793238462643383279502884L;

// theta_i = base^(-2i/d) as exp(-(2i/d) ln base), in long double.
std::vector<Real> ref_theta(Index d, Real base) {
  std::vector<Real> theta;
  for (Index i = 0; i < d / 2; ++i) theta.push_back(std::exp(-(Real(2 * i) / Real(d)) * std::log(base)));
  return theta;
}

std::vector<Real> ref_linear(Index d, Real base, Real factor) {
  std::vector<Real> out = ref_theta(d, base);
  for (Real& x : out) x = x / factor;
  return out;
}

// Dynamic NTK: the scaled base as exp((d / (d - 2)) ln(...)).
std::vector<Real> ref_dynamic(Index d, Real base, Real factor, Index max_pos, Index seq_len) {
  const Real n = Real(seq_len > max_pos ? seq_len : max_pos);
  const Real scaled = base * std::exp(Real(d) / Real(d - 2) * std::log(factor * n / Real(max_pos) - factor + 1));
  return ref_theta(d, scaled);
}

// YaRN, from the paper's definitions: r(i) = L / wavelength_i = L theta_i / (2 pi) rotations; the
// correction dims written as d (ln L - ln(2 pi beta)) / (2 ln b); the result as a blend of the
// extrapolated (theta) and interpolated (theta / s) sets with weight ramp.
struct RefYarn {
  std::vector<Real> inv_freq;
  Real attention = 1;
};
RefYarn ref_yarn(Index d, Real base, Real s, Index L, Real beta_fast, Real beta_slow, bool truncate,
                 std::optional<Real> attention, std::optional<Real> mscale, std::optional<Real> mscale_all_dim) {
  const auto corr = [&](Real beta) {
    return Real(d) * (std::log(Real(L)) - std::log(2 * kPi * beta)) / (2 * std::log(base));
  };
  Real lo = corr(beta_fast), hi = corr(beta_slow);
  if (truncate) {
    lo = std::floor(lo);
    hi = std::ceil(hi);
  }
  if (lo < 0) lo = 0;
  if (hi > Real(d - 1)) hi = Real(d - 1);
  if (lo == hi) hi += Real(0.001);
  RefYarn out;
  const std::vector<Real> theta = ref_theta(d, base);
  for (std::size_t i = 0; i < theta.size(); ++i) {
    Real w = (Real(i) - lo) / (hi - lo);
    w = w < 0 ? 0 : w > 1 ? 1 : w;
    const Real extrapolated = theta[i], interpolated = theta[i] / s;
    out.inv_freq.push_back(extrapolated + w * (interpolated - extrapolated));
  }
  const auto m = [&](Real scale, Real k) { return scale <= 1 ? Real(1) : 1 + k * std::log(scale) / 10; };
  if (attention)
    out.attention = *attention;
  else if (mscale && mscale_all_dim && *mscale != 0 && *mscale_all_dim != 0)
    out.attention = m(s, *mscale) / m(s, *mscale_all_dim);
  else
    out.attention = m(s, 1);
  return out;
}

// Llama 3, in rotations r_i = L theta_i / (2 pi) within the original context: r > f_hi keeps
// theta, r < f_lo divides by s, in between g = (r - f_lo) / (f_hi - f_lo) blends.
std::vector<Real> ref_llama3(Index d, Real base, Real s, Real f_lo, Real f_hi, Index L) {
  std::vector<Real> out = ref_theta(d, base);
  for (Real& theta : out) {
    const Real r = Real(L) * theta / (2 * kPi);
    if (r > f_hi) continue;
    if (r < f_lo) {
      theta = theta / s;
      continue;
    }
    const Real g = (r - f_lo) / (f_hi - f_lo);
    theta = theta / s + g * (theta - theta / s);
  }
  return out;
}

void require_close(const std::vector<double>& got, const std::vector<Real>& want, double rel = 1e-13) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO("pair " << i);
    REQUIRE_THAT(got[i], Catch::Matchers::WithinRel(static_cast<double>(want[i]), rel));
  }
}

const Index kDims[] = {2, 4, 8, 64, 96, 128, 256};
const double kBases[] = {10000.0, 500000.0, 1000000.0, 1.0e7};

}  // namespace

TEST_CASE("rope_scaling: linear against the reference", "[rope_scaling][linear]") {
  for (const Index d : kDims)
    for (const double base : kBases)
      for (const double factor : {1.0, 2.0, 4.0, 8.0, 32.5}) {
        INFO("d = " << d << ", base = " << base << ", factor = " << factor);
        const RopeFrequencies f = embedhead::rope_linear_frequencies(d, base, factor);
        require_close(f.inv_freq, ref_linear(d, base, factor));
        REQUIRE(f.attention_factor == 1.0);
      }
  // factor 1 is the default frequencies, exactly.
  const RopeFrequencies one = embedhead::rope_linear_frequencies(128, 10000.0, 1.0);
  REQUIRE(one.inv_freq == embedhead::rope_default_frequencies(128, 10000.0).inv_freq);
}

TEST_CASE("rope_scaling: dynamic NTK against the reference", "[rope_scaling][dynamic]") {
  for (const Index d : {Index{4}, Index{8}, Index{64}, Index{128}})
    for (const double base : kBases)
      for (const double factor : {1.0, 2.0, 4.0})
        for (const Index seq_len :
             {Index{0}, Index{1}, Index{4095}, Index{4096}, Index{4097}, Index{8191}, Index{65535}, Index{131071}}) {
          INFO("d = " << d << ", base = " << base << ", factor = " << factor << ", seq_len = " << seq_len);
          const RopeFrequencies f = embedhead::rope_dynamic_ntk_frequencies(d, base, factor, 4096, seq_len);
          require_close(f.inv_freq, ref_dynamic(d, base, factor, 4096, seq_len), 1e-12);
          REQUIRE(f.attention_factor == 1.0);
        }
  // Known value: seq_len = 2 M with factor 2 gives base * 3^(d / (d - 2)).
  REQUIRE_THAT(embedhead::rope_dynamic_ntk_base(128, 10000.0, 2.0, 2048, 4096),
               Catch::Matchers::WithinRel(10000.0 * std::pow(3.0, 128.0 / 126.0), 1e-15));
  // Up to M the frequencies are the default ones.
  REQUIRE(embedhead::rope_dynamic_ntk_base(128, 10000.0, 2.0, 2048, 100) == 10000.0);
  require_close(embedhead::rope_dynamic_ntk_frequencies(128, 10000.0, 2.0, 2048, 2048).inv_freq,
                ref_theta(128, 10000.0));
}

TEST_CASE("rope_scaling: DynamicNtkRopeCache follows transformers' growth and reset rules", "[rope_scaling][dynamic]") {
  const Index d = 64, M = 4096;
  const double base = 10000.0, factor = 2.0;
  embedhead::DynamicNtkRopeCache cache(d, base, factor, M);
  const auto original = ref_theta(d, base);
  REQUIRE(cache.max_seq_len_cached() == M);
  require_close(cache.frequencies().inv_freq, original);

  // Within the original context: nothing changes.
  REQUIRE_FALSE(cache.update(1));
  REQUIRE_FALSE(cache.update(M));
  REQUIRE(cache.max_seq_len_cached() == M);
  // Growth: recomputed for n.
  REQUIRE(cache.update(10000));
  REQUIRE(cache.max_seq_len_cached() == 10000);
  require_close(cache.frequencies().inv_freq, ref_dynamic(d, base, factor, M, 10000), 1e-12);
  // Shorter, but not below M: the n = 10000 frequencies stay (history matters).
  REQUIRE_FALSE(cache.update(6000));
  REQUIRE_FALSE(cache.update(M));
  require_close(cache.frequencies().inv_freq, ref_dynamic(d, base, factor, M, 10000), 1e-12);
  // Growth again.
  REQUIRE(cache.update(12000));
  require_close(cache.frequencies().inv_freq, ref_dynamic(d, base, factor, M, 12000), 1e-12);
  // Below M: back to the original frequencies and cache length.
  REQUIRE(cache.update(M - 1));
  REQUIRE(cache.max_seq_len_cached() == M);
  require_close(cache.frequencies().inv_freq, original);
  REQUIRE_FALSE(cache.update(10));
  // A bad length changes nothing.
  REQUIRE(cache.update(5000));
  REQUIRE_THROWS_WITH(cache.update(-1), Contains("DynamicNtkRopeCache::update: seq_len = -1 outside [0, inf)"));
  REQUIRE(cache.max_seq_len_cached() == 5000);
}

TEST_CASE("rope_scaling: YaRN against the reference", "[rope_scaling][yarn]") {
  for (const Index d : kDims)
    for (const double base : kBases)
      for (const double factor : {1.0, 2.0, 4.0, 16.0, 40.0})
        for (const Index L : {Index{2048}, Index{4096}, Index{32768}})
          for (const bool truncate : {true, false}) {
            INFO("d = " << d << ", base = " << base << ", factor = " << factor << ", L = " << L
                        << ", truncate = " << truncate);
            embedhead::YarnOptions options;
            options.factor = factor;
            options.original_max_position_embeddings = L;
            options.truncate = truncate;
            const RopeFrequencies f = embedhead::rope_yarn_frequencies(d, base, options);
            const RefYarn want = ref_yarn(d, base, factor, L, 32, 1, truncate, {}, {}, {});
            require_close(f.inv_freq, want.inv_freq, 1e-12);
            REQUIRE_THAT(f.attention_factor, Catch::Matchers::WithinRel(static_cast<double>(want.attention), 1e-15));
          }
  // Other betas, an explicit attention factor, DeepSeek's mscale ratio.
  embedhead::YarnOptions options;
  options.factor = 8.0;
  options.original_max_position_embeddings = 4096;
  options.beta_fast = 16.0;
  options.beta_slow = 2.0;
  const RefYarn betas = ref_yarn(128, 10000.0, 8.0, 4096, 16, 2, true, {}, {}, {});
  require_close(embedhead::rope_yarn_frequencies(128, 10000.0, options).inv_freq, betas.inv_freq, 1e-12);
  options.attention_factor = 0.75;
  REQUIRE(embedhead::rope_yarn_frequencies(128, 10000.0, options).attention_factor == 0.75);
  options.attention_factor.reset();
  options.mscale = 0.707;
  options.mscale_all_dim = 1.0;
  const RefYarn ratio = ref_yarn(128, 10000.0, 8.0, 4096, 16, 2, true, {}, 0.707L, 1.0L);
  REQUIRE_THAT(embedhead::rope_yarn_frequencies(128, 10000.0, options).attention_factor,
               Catch::Matchers::WithinRel(static_cast<double>(ratio.attention), 1e-15));
  // A zero mscale_all_dim is "not given" (transformers' `mscale and mscale_all_dim`).
  options.mscale_all_dim = 0.0;
  REQUIRE_THAT(embedhead::rope_yarn_frequencies(128, 10000.0, options).attention_factor,
               Catch::Matchers::WithinRel(0.1 * std::log(8.0) + 1.0, 1e-15));
}

TEST_CASE("rope_scaling: YaRN known values (Qwen2.5 128K, DeepSeek-V3)", "[rope_scaling][yarn]") {
  // Qwen2.5's long-context setting: rope_theta 1e6, head_dim 128, factor 4, L = 32768. By hand:
  // corr(32) = 128 ln(32768 / 64 pi) / (2 ln 1e6) = 23.60 -> 23, corr(1) = 39.66 -> 40.
  embedhead::YarnOptions qwen;
  qwen.factor = 4.0;
  qwen.original_max_position_embeddings = 32768;
  const RopeFrequencies f = embedhead::rope_yarn_frequencies(128, 1.0e6, qwen);
  REQUIRE_THAT(f.attention_factor, Catch::Matchers::WithinRel(1.1386294361119891, 1e-15));  // 0.1 ln 4 + 1
  for (Index i = 0; i < 64; ++i) {
    INFO("pair " << i);
    const double theta = std::pow(1.0e6, -static_cast<double>(i) / 64.0);
    if (i <= 23) REQUIRE_THAT(f.inv_freq[static_cast<std::size_t>(i)], Catch::Matchers::WithinRel(theta, 1e-14));
    if (i >= 40) REQUIRE_THAT(f.inv_freq[static_cast<std::size_t>(i)], Catch::Matchers::WithinRel(theta / 4, 1e-14));
    if (i > 23 && i < 40) {
      const double ramp = (static_cast<double>(i) - 23.0) / 17.0;
      REQUIRE_THAT(f.inv_freq[static_cast<std::size_t>(i)],
                   Catch::Matchers::WithinRel(theta * (1 - ramp) + theta / 4 * ramp, 1e-14));
    }
  }
  // truncate = false: the unrounded range 23.596 .. 39.655 (gpt-oss sets it so).
  qwen.truncate = false;
  const RopeFrequencies g = embedhead::rope_yarn_frequencies(128, 1.0e6, qwen);
  REQUIRE(g.inv_freq[23] == f.inv_freq[23]);  // below the unrounded low end too
  REQUIRE(g.inv_freq[24] != f.inv_freq[24]);

  // DeepSeek-V3: qk_rope_head_dim 64, rope_theta 10000, factor 40, L = 4096, mscale =
  // mscale_all_dim = 1: the attention factor is 1 (the model scales its softmax instead).
  embedhead::YarnOptions deepseek;
  deepseek.factor = 40.0;
  deepseek.original_max_position_embeddings = 4096;
  deepseek.mscale = 1.0;
  deepseek.mscale_all_dim = 1.0;
  const RopeFrequencies v3 = embedhead::rope_yarn_frequencies(64, 10000.0, deepseek);
  REQUIRE(v3.attention_factor == 1.0);
  // corr(32) = 64 ln(4096 / 64 pi) / (2 ln 1e4) = 10.4 -> 10, corr(1) = 22.9 -> 23.
  REQUIRE_THAT(v3.inv_freq[10], Catch::Matchers::WithinRel(std::pow(10000.0, -10.0 / 32.0), 1e-15));
  REQUIRE_THAT(v3.inv_freq[23], Catch::Matchers::WithinRel(std::pow(10000.0, -23.0 / 32.0) / 40.0, 1e-14));
  REQUIRE_THAT(v3.inv_freq[11], Catch::Matchers::WithinRel(std::pow(10000.0, -11.0 / 32.0) * (1 - 1.0 / 13) +
                                                               std::pow(10000.0, -11.0 / 32.0) / 40 / 13,
                                                           1e-14));
}

TEST_CASE("rope_scaling: YaRN's 0.001 rule when the range collapses", "[rope_scaling][yarn]") {
  // A short original context puts both correction dims below 0: lo = hi = 0, so hi = 0.001 and
  // every pair but the first is fully interpolated (ramp((i - 0) / 0.001) = 1 for i >= 1).
  embedhead::YarnOptions options;
  options.factor = 4.0;
  options.original_max_position_embeddings = 4;
  const RopeFrequencies f = embedhead::rope_yarn_frequencies(16, 10000.0, options);
  const RefYarn want = ref_yarn(16, 10000.0, 4.0, 4, 32, 1, true, {}, {}, {});
  require_close(f.inv_freq, want.inv_freq, 1e-14);
  REQUIRE(f.inv_freq[0] == 1.0);
  REQUIRE_THAT(f.inv_freq[1], Catch::Matchers::WithinRel(std::pow(10000.0, -2.0 / 16.0) / 4.0, 1e-15));
}

TEST_CASE("rope_scaling: LongRoPE against the reference, and Phi-3's attention factor", "[rope_scaling][longrope]") {
  for (const Index d : {Index{2}, Index{8}, Index{96}, Index{128}})
    for (const double base : kBases) {
      embedhead::LongRopeOptions options;
      for (Index i = 0; i < d / 2; ++i) {
        options.short_factor.push_back(1.0 + 0.01 * static_cast<double>(i));
        options.long_factor.push_back(1.0 + 0.5 * static_cast<double>(i));
      }
      options.original_max_position_embeddings = 4096;
      options.max_position_embeddings = 131072;
      for (const Index seq_len : {Index{0}, Index{1}, Index{4095}, Index{4096}, Index{4097}, Index{131071}}) {
        INFO("d = " << d << ", base = " << base << ", seq_len = " << seq_len);
        const RopeFrequencies f = embedhead::rope_longrope_frequencies(d, base, options, seq_len);
        const std::vector<double>& lambda = seq_len > 4096 ? options.long_factor : options.short_factor;
        std::vector<Real> want = ref_theta(d, base);
        for (std::size_t i = 0; i < want.size(); ++i) want[i] = want[i] / lambda[i];
        require_close(f.inv_freq, want);
        // Phi-3-mini-128k: s = 131072 / 4096 = 32, a = sqrt(1 + ln 32 / ln 4096) = sqrt(1 + 5/12).
        REQUIRE_THAT(f.attention_factor, Catch::Matchers::WithinRel(std::sqrt(17.0 / 12.0), 1e-15));
      }
    }
  embedhead::LongRopeOptions options;
  options.short_factor.assign(4, 1.0);
  options.long_factor.assign(4, 2.0);
  options.original_max_position_embeddings = 4096;
  options.max_position_embeddings = 4096;  // s = 1: a = 1
  REQUIRE(embedhead::rope_longrope_frequencies(8, 10000.0, options, 0).attention_factor == 1.0);
  options.max_position_embeddings = 2048;  // s < 1: a = 1
  REQUIRE(embedhead::rope_longrope_frequencies(8, 10000.0, options, 0).attention_factor == 1.0);
  options.factor = 4.0;  // an explicit factor wins over M / L
  REQUIRE_THAT(embedhead::rope_longrope_frequencies(8, 10000.0, options, 0).attention_factor,
               Catch::Matchers::WithinRel(std::sqrt(1.0 + std::log(4.0) / std::log(4096.0)), 1e-15));
  options.attention_factor = 1.5;  // an explicit attention factor wins over both
  REQUIRE(embedhead::rope_longrope_frequencies(8, 10000.0, options, 0).attention_factor == 1.5);
}

TEST_CASE("rope_scaling: Llama 3 against the reference, and Llama 3.1's frequencies", "[rope_scaling][llama3]") {
  for (const Index d : kDims)
    for (const double base : kBases)
      for (const double factor : {1.0, 8.0, 32.0})
        for (const Index L : {Index{2048}, Index{8192}}) {
          INFO("d = " << d << ", base = " << base << ", factor = " << factor << ", L = " << L);
          embedhead::Llama3Options options;
          options.factor = factor;
          options.original_max_position_embeddings = L;
          require_close(embedhead::rope_llama3_frequencies(d, base, options).inv_freq,
                        ref_llama3(d, base, factor, 1.0, 4.0, L));
          options.low_freq_factor = 2.0;
          options.high_freq_factor = 3.0;
          require_close(embedhead::rope_llama3_frequencies(d, base, options).inv_freq,
                        ref_llama3(d, base, factor, 2.0, 3.0, L));
        }
  // Llama 3.1 (rope_theta 500000, head_dim 128, factor 8, low 1, high 4, L = 8192). By hand:
  // wavelength 2 pi 500000^(i/64) < 8192 / 4 for i <= 28 (kept), > 8192 for i >= 35 (divided by
  // 8), and the 6 pairs 29 .. 34 smoothed in between.
  const RopeFrequencies f = embedhead::rope_llama3_frequencies(128, 500000.0, embedhead::Llama3Options{});
  REQUIRE(f.attention_factor == 1.0);
  for (Index i = 0; i < 64; ++i) {
    INFO("pair " << i);
    const double theta = std::pow(500000.0, -static_cast<double>(i) / 64.0);
    const double got = f.inv_freq[static_cast<std::size_t>(i)];
    if (i <= 28) REQUIRE_THAT(got, Catch::Matchers::WithinRel(theta, 1e-14));
    if (i >= 35) REQUIRE_THAT(got, Catch::Matchers::WithinRel(theta / 8, 1e-14));
    if (i >= 29 && i <= 34) {
      REQUIRE(got < theta);
      REQUIRE(got > theta / 8);
    }
  }
  REQUIRE(f.inv_freq[0] == 1.0);
}

TEST_CASE("rope_scaling: bad values are value_errors naming the function, the field, the value and the range",
          "[rope_scaling][errors]") {
  using namespace embedhead;
  const auto nan = std::nan("");
  const auto inf = std::numeric_limits<double>::infinity();
  REQUIRE_THROWS_AS(rope_linear_frequencies(3, 10000.0, 2.0), value_error);
  REQUIRE_THROWS_WITH(rope_linear_frequencies(3, 10000.0, 2.0),
                      Contains("rope_linear_frequencies: rotary_dim = 3 must be even and in [2, inf)"));
  REQUIRE_THROWS_WITH(rope_linear_frequencies(0, 10000.0, 2.0), Contains("rotary_dim = 0"));
  REQUIRE_THROWS_WITH(rope_linear_frequencies(8, 0.0, 2.0),
                      Contains("rope_linear_frequencies: base = 0 outside (0, inf)"));
  REQUIRE_THROWS_WITH(rope_linear_frequencies(8, -1.0, 2.0), Contains("base = -1 outside (0, inf)"));
  REQUIRE_THROWS_WITH(rope_linear_frequencies(8, inf, 2.0), Contains("base = inf outside (0, inf)"));
  REQUIRE_THROWS_WITH(rope_linear_frequencies(8, 10000.0, 0.5),
                      Contains("rope_linear_frequencies: factor = 0.5 outside [1, inf)"));
  REQUIRE_THROWS_WITH(rope_linear_frequencies(8, 10000.0, nan), Contains("factor = nan outside [1, inf)"));
  REQUIRE_THROWS_WITH(rope_linear_frequencies(8, 10000.0, inf), Contains("factor = inf outside [1, inf)"));

  REQUIRE_THROWS_WITH(rope_dynamic_ntk_frequencies(2, 10000.0, 2.0, 4096, 0),
                      Contains("rope_dynamic_ntk_frequencies: rotary_dim = 2 must be even and in [4, inf)"));
  REQUIRE_THROWS_WITH(rope_dynamic_ntk_frequencies(8, 10000.0, 0.9, 4096, 0),
                      Contains("rope_dynamic_ntk_frequencies: factor = 0.90000000000000002 outside [1, inf)"));
  REQUIRE_THROWS_WITH(rope_dynamic_ntk_frequencies(8, 10000.0, 2.0, 0, 0),
                      Contains("rope_dynamic_ntk_frequencies: max_position_embeddings = 0 outside [1, inf)"));
  REQUIRE_THROWS_WITH(rope_dynamic_ntk_frequencies(8, 10000.0, 2.0, 4096, -5),
                      Contains("rope_dynamic_ntk_frequencies: seq_len = -5 outside [0, inf)"));
  REQUIRE_THROWS_WITH(rope_dynamic_ntk_frequencies(4, 1e300, 1e300, 1, Index{1} << 62),
                      Contains("rope_dynamic_ntk_frequencies: the scaled base for seq_len = "));
  REQUIRE_THROWS_WITH(DynamicNtkRopeCache(6, 10000.0, 0.0, 4096), Contains("factor = 0 outside [1, inf)"));
  // s n / M - (s - 1) cancels to 0 for a factor of 1e17 (s - 1 rounds to s).
  REQUIRE_THROWS_WITH(rope_dynamic_ntk_frequencies(8, 10000.0, 1e17, Index{1} << 53, (Index{1} << 53) + 1),
                      Contains("the scaled base for seq_len = 9007199254740993") &&
                          Contains(") is 0, outside (0, inf)"));
  // A subnormal base passes the range check but overflows the frequencies.
  REQUIRE_THROWS_WITH(rope_linear_frequencies(256, 5e-324, 1.0),
                      Contains("rope_linear_frequencies: inv_freq[123] = inf is not finite"));
  REQUIRE_THROWS_WITH(rope_dynamic_ntk_frequencies(256, 5e-324, 1.0, 16, 0),
                      Contains("rope_dynamic_ntk_frequencies: inv_freq[123] = inf is not finite"));

  YarnOptions yarn;
  yarn.factor = 4.0;
  yarn.original_max_position_embeddings = 4096;
  REQUIRE_NOTHROW(rope_yarn_frequencies(8, 10000.0, yarn));
  REQUIRE_THROWS_WITH(rope_yarn_frequencies(7, 10000.0, yarn), Contains("rope_yarn_frequencies: rotary_dim = 7"));
  REQUIRE_THROWS_WITH(rope_yarn_frequencies(8, 1.0, yarn),
                      Contains("rope_yarn_frequencies: base = 1 outside (1, inf)"));
  YarnOptions bad = yarn;
  bad.factor = 0.0;
  REQUIRE_THROWS_WITH(rope_yarn_frequencies(8, 10000.0, bad),
                      Contains("rope_yarn_frequencies: factor = 0 outside [1, inf)"));
  bad = yarn;
  bad.original_max_position_embeddings = 0;
  REQUIRE_THROWS_WITH(rope_yarn_frequencies(8, 10000.0, bad),
                      Contains("rope_yarn_frequencies: original_max_position_embeddings = 0 outside [1, inf)"));
  bad = yarn;
  bad.beta_fast = -1.0;
  REQUIRE_THROWS_WITH(rope_yarn_frequencies(8, 10000.0, bad),
                      Contains("rope_yarn_frequencies: beta_fast = -1 outside (0, inf)"));
  bad = yarn;
  bad.beta_slow = nan;
  REQUIRE_THROWS_WITH(rope_yarn_frequencies(8, 10000.0, bad), Contains("beta_slow = nan outside (0, inf)"));
  bad = yarn;
  bad.beta_fast = 1.0;
  bad.beta_slow = 2.0;
  REQUIRE_THROWS_WITH(rope_yarn_frequencies(8, 10000.0, bad),
                      Contains("rope_yarn_frequencies: beta_fast = 1 outside [beta_slow, inf) (beta_slow = 2)"));
  bad = yarn;
  bad.attention_factor = 0.0;
  REQUIRE_THROWS_WITH(rope_yarn_frequencies(8, 10000.0, bad), Contains("attention_factor = 0 outside (0, inf)"));
  bad = yarn;
  bad.mscale = inf;
  REQUIRE_THROWS_WITH(rope_yarn_frequencies(8, 10000.0, bad), Contains("mscale = inf outside (-inf, inf)"));
  bad = yarn;
  bad.mscale = 1.0;
  bad.mscale_all_dim = -20.0;  // mscale(s, mscale_all_dim) < 0
  REQUIRE_THROWS_WITH(rope_yarn_frequencies(8, 10000.0, bad), Contains("attention factor mscale(factor, mscale)"));

  LongRopeOptions longrope;
  longrope.short_factor.assign(4, 1.0);
  longrope.long_factor.assign(4, 2.0);
  longrope.original_max_position_embeddings = 4096;
  longrope.max_position_embeddings = 131072;
  REQUIRE_NOTHROW(rope_longrope_frequencies(8, 10000.0, longrope, 0));
  REQUIRE_THROWS_WITH(rope_longrope_frequencies(10, 10000.0, longrope, 0),
                      Contains("rope_longrope_frequencies: short_factor has 4 entries, expected rotary_dim / 2 = 5"));
  LongRopeOptions lbad = longrope;
  lbad.long_factor[2] = 0.0;
  REQUIRE_THROWS_WITH(rope_longrope_frequencies(8, 10000.0, lbad, 0),
                      Contains("rope_longrope_frequencies: long_factor[2] = 0 outside (0, inf)"));
  lbad = longrope;
  lbad.short_factor[0] = -inf;
  REQUIRE_THROWS_WITH(rope_longrope_frequencies(8, 10000.0, lbad, 0),
                      Contains("short_factor[0] = -inf outside (0, inf)"));
  lbad = longrope;
  lbad.long_factor[0] = 5e-324;  // subnormal: 1 / (lambda theta) overflows in the long regime only
  REQUIRE_NOTHROW(rope_longrope_frequencies(8, 10000.0, lbad, 4096));
  REQUIRE_THROWS_WITH(rope_longrope_frequencies(8, 10000.0, lbad, 4097),
                      Contains("rope_longrope_frequencies: inv_freq[0] = inf is not finite"));
  lbad = longrope;
  lbad.original_max_position_embeddings = 1;
  REQUIRE_THROWS_WITH(
      rope_longrope_frequencies(8, 10000.0, lbad, 0),
      Contains("original_max_position_embeddings (ln(L) divides the attention factor) = 1 outside [2, inf)"));
  lbad = longrope;
  lbad.factor = 0.5;
  REQUIRE_THROWS_WITH(rope_longrope_frequencies(8, 10000.0, lbad, 0),
                      Contains("rope_longrope_frequencies: factor = 0.5 outside [1, inf)"));
  REQUIRE_THROWS_WITH(rope_longrope_frequencies(8, 10000.0, longrope, -1), Contains("seq_len = -1 outside [0, inf)"));

  Llama3Options llama;
  REQUIRE_THROWS_WITH(rope_llama3_frequencies(8, nan, llama),
                      Contains("rope_llama3_frequencies: base = nan outside (0, inf)"));
  Llama3Options llbad = llama;
  llbad.low_freq_factor = 4.0;
  REQUIRE_THROWS_WITH(
      rope_llama3_frequencies(8, 10000.0, llbad),
      Contains("rope_llama3_frequencies: high_freq_factor = 4 outside (low_freq_factor, inf) (low_freq_factor = 4)"));
  llbad = llama;
  llbad.low_freq_factor = 0.0;
  REQUIRE_THROWS_WITH(rope_llama3_frequencies(8, 10000.0, llbad), Contains("low_freq_factor = 0 outside (0, inf)"));
  llbad = llama;
  llbad.factor = 0.25;
  REQUIRE_THROWS_WITH(rope_llama3_frequencies(8, 10000.0, llbad), Contains("factor = 0.25 outside [1, inf)"));
  llbad = llama;
  llbad.original_max_position_embeddings = -3;
  REQUIRE_THROWS_WITH(rope_llama3_frequencies(8, 10000.0, llbad),
                      Contains("original_max_position_embeddings = -3 outside [1, inf)"));
}

TEST_CASE("rope_scaling: the frequencies build a RopeTable, with the attention factor folded into cos and sin",
          "[rope_scaling][table]") {
  // Qwen2.5's YaRN (a = 0.1 ln 4 + 1) into a float table at positions up to 131071: each entry is
  // a cos(p theta_i) and a sin(p theta_i) of the returned frequencies (rope_test checks the
  // table's rounding itself).
  embedhead::YarnOptions options;
  options.factor = 4.0;
  options.original_max_position_embeddings = 32768;
  const RopeFrequencies f = embedhead::rope_yarn_frequencies(128, 1.0e6, options);
  const embedhead::RopeTable<float> table(128, 128, embedhead::RopePairing::half_split, 131072, f);
  REQUIRE(table.attention_factor() == f.attention_factor);
  REQUIRE(table.inv_freq() == f.inv_freq);
  for (const Index p : {Index{0}, Index{1}, Index{4095}, Index{4096}, Index{8191}, Index{65535}, Index{131071}})
    for (const Index i : {Index{0}, Index{23}, Index{30}, Index{40}, Index{63}}) {
      INFO("p = " << p << ", i = " << i);
      const Real angle = Real(p) * Real(f.inv_freq[static_cast<std::size_t>(i)]);
      const Real a = Real(f.attention_factor);
      // Within one float ulp of |a| <= 1.14 (2^-23 * 2): the table rounds once, from double.
      REQUIRE_THAT(table.cos(p, i), Catch::Matchers::WithinAbs(static_cast<double>(a * std::cos(angle)), 2.4e-7));
      REQUIRE_THAT(table.sin(p, i), Catch::Matchers::WithinAbs(static_cast<double>(a * std::sin(angle)), 2.4e-7));
    }
}
