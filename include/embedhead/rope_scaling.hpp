// embedhead: the RoPE context-extension scalings Hugging Face ships, as functions that return the
// frequencies (and the attention factor) a RopeTable is built from (rope.hpp).
//
// Every function computes in double and returns inv_freq [rotary_dim / 2] (theta_i, radians per
// position, pair i) and the attention factor a. Notation: d = rotary_dim, b = base (rope_theta),
// i = 0 .. d/2 - 1, theta_i = b^(-2i/d) (the default frequencies), s = factor, L = the original
// (pre-training) context length `original_max_position_embeddings`, M = max_position_embeddings.
//
//   linear ("position interpolation", kaiokendev 2023; Chen et al., arXiv:2306.15595):
//     inv_freq_i = theta_i / s,                                                       a = 1
//   dynamic NTK (bloc97 / emozilla, 2023), for the current sequence length n:
//     n' = max(n, M),  b' = b * (s * n' / M - (s - 1))^(d / (d - 2)),  inv_freq_i = b'^(-2i/d),  a = 1
//     (n' = M gives b' = b: the default frequencies up to the model's context length)
//   YaRN (Peng et al., "YaRN: Efficient Context Window Extension of Large Language Models",
//   arXiv:2309.00071):
//     corr(r) = d * ln(L / (2 pi r)) / (2 ln b)     the pair index whose wavelength fits r times in L
//     lo = corr(beta_fast), hi = corr(beta_slow)    (truncate: lo = floor(lo), hi = ceil(hi))
//     lo = max(lo, 0), hi = min(hi, d - 1);  if lo == hi: hi += 0.001
//     ramp_i = clamp((i - lo) / (hi - lo), 0, 1)
//     inv_freq_i = (theta_i / s) * ramp_i + theta_i * (1 - ramp_i)
//       (pairs below lo -- high frequencies -- keep theta_i, pairs above hi are interpolated)
//     a = attention_factor if given; else mscale(s, mscale) / mscale(s, mscale_all_dim) when both
//         are given and non-zero (DeepSeek); else mscale(s, 1), with
//     mscale(s, m) = 0.1 * m * ln(s) + 1 for s > 1, and 1 for s <= 1
//     Defaults: beta_fast = 32, beta_slow = 1, truncate = true.
//   LongRoPE (Ding et al., "LongRoPE: Extending LLM Context Window Beyond 2 Million Tokens",
//   arXiv:2402.13753; Phi-3), with per-pair rescale factors lambda (short_factor, long_factor):
//     lambda = long_factor if n > L else short_factor       (n = the current sequence length)
//     inv_freq_i = 1 / (lambda_i * b^(2i/d))
//     a = attention_factor if given; else, with s = factor if given, else M / L:
//         a = sqrt(1 + ln(s) / ln(L)) for s > 1, and 1 for s <= 1
//   Llama 3 (Meta's Llama 3.1 reference code, `apply_scaling`), with low / high frequency factors
//   f_lo < f_hi:
//     wavelen_i = 2 pi / theta_i,  r_i = L / wavelen_i   (wavelengths that fit into L)
//     wavelen_i < L / f_hi                     inv_freq_i = theta_i            (high frequencies)
//     wavelen_i > L / f_lo                     inv_freq_i = theta_i / s        (low frequencies)
//     otherwise, with g = (r_i - f_lo) / (f_hi - f_lo):
//                                              inv_freq_i = (1 - g) theta_i / s + g theta_i
//     a = 1
//
// Parity: these are the formulas and defaults of Hugging Face transformers'
// src/transformers/modeling_rope_utils.py (`_compute_linear_scaling_rope_parameters`,
// `_compute_dynamic_ntk_parameters`, `_compute_yarn_parameters`, `_compute_longrope_parameters`,
// `_compute_llama3_parameters`, the transformers-v5 versions), written here from the papers and
// that file, not copied. Where transformers differs:
//   - Precision: transformers computes b^(2i/d) and the products in float32 (the correction range
//     and the scalars in Python's double); embedhead computes everything in double and rounds
//     once, when a RopeTable is built. The float32 frequencies differ from these by up to a few
//     float ulps, which at position 10^5 is an angle error of ~0.01 rad: we differ on purpose.
//   - Bad values: transformers logs a warning (factor < 1, beta_fast < beta_slow, f_lo >= f_hi)
//     and computes on; embedhead throws value_error naming the function, the field, the value and
//     the valid range, before anything is computed.
//   - YaRN's factor: transformers-v4.4x replaced the given factor by M / L whenever
//     original_max_position_embeddings was present; v5 uses the given factor (and only warns when
//     it differs from M / L). embedhead follows v5: the caller passes s.
//
// The attention factor a is returned, not folded: a RopeTable built from the result multiplies
// every cos and sin by a (as transformers multiplies cos and sin by attention_scaling), so q.k is
// scaled by a^2.
//
// Dynamic NTK and LongRoPE depend on the sequence length. transformers keeps state between forward
// calls (`dynamic_rope_update`); DynamicNtkRopeCache below reproduces its decisions for dynamic
// NTK. For LongRoPE there is no state: each forward uses the long factors when max(position) + 1
// exceeds L and the short ones otherwise, so pass that n to rope_longrope_frequencies each time.
//
// Cost: O(d) each, plus d/2 calls of pow.
#ifndef EMBEDHEAD_ROPE_SCALING_HPP
#define EMBEDHEAD_ROPE_SCALING_HPP

#include "errors.hpp"
#include "rope.hpp"
#include "types.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace embedhead {

// Helpers of this header only, in a namespace of their own (rope.hpp has its own detail helpers).
namespace detail::rope_scaling_impl {

[[noreturn]] inline void throw_rope_value(const char* where, const char* field, double value, const char* range) {
  std::ostringstream message;
  message.precision(17);
  message << where << ": " << field << " = " << value << " outside " << range;
  throw value_error(message.str());
}

// rotary_dim even and >= min_dim.
inline void check_rotary_dim(const char* where, Index rotary_dim, Index min_dim = 2) {
  if (rotary_dim < min_dim || rotary_dim % 2 != 0) {
    std::ostringstream message;
    message << where << ": rotary_dim = " << rotary_dim << " must be even and in [" << min_dim << ", inf)";
    throw value_error(message.str());
  }
}

inline void check_rope_base(const char* where, double base) {
  if (!(base > 0.0) || !std::isfinite(base)) throw_rope_value(where, "base", base, "(0, inf)");
}

// factor finite and >= 1 (transformers' rule, which it only warns about).
inline void check_rope_factor(const char* where, const char* field, double factor) {
  if (!(factor >= 1.0) || !std::isfinite(factor)) throw_rope_value(where, field, factor, "[1, inf)");
}

inline void check_rope_positive(const char* where, const char* field, double value) {
  if (!(value > 0.0) || !std::isfinite(value)) throw_rope_value(where, field, value, "(0, inf)");
}

inline void check_rope_length(const char* where, const char* field, Index value, Index lo = 1) {
  if (value < lo) {
    std::ostringstream message;
    message << where << ": " << field << " = " << value << " outside [" << lo << ", inf)";
    throw value_error(message.str());
  }
}

// Every frequency finite: a base or a LongRoPE factor below DBL_MIN (subnormal) passes the range
// checks but gives 1 / 0-like results.
inline void check_rope_finite(const char* where, const std::vector<double>& inv_freq) {
  for (std::size_t i = 0; i < inv_freq.size(); ++i)
    if (!std::isfinite(inv_freq[i])) {
      std::ostringstream message;
      message << where << ": inv_freq[" << i << "] = " << inv_freq[i]
              << " is not finite (a base or factor too close to 0)";
      throw value_error(message.str());
    }
}

// theta_i = base^(-2i / rotary_dim) for i = 0 .. rotary_dim/2 - 1, in double (checked by the caller).
inline std::vector<double> rope_theta(Index rotary_dim, double base) {
  std::vector<double> theta(static_cast<std::size_t>(rotary_dim / 2));
  for (Index i = 0; i < rotary_dim / 2; ++i)
    theta[static_cast<std::size_t>(i)] = 1.0 /
                                         std::pow(base, static_cast<double>(2 * i) / static_cast<double>(rotary_dim));
  return theta;
}

}  // namespace detail::rope_scaling_impl

// ---------------------------------------------------------------------------------------------
// linear
// ---------------------------------------------------------------------------------------------

// rotary_dim, base, factor -> inv_freq [rotary_dim / 2] = base^(-2i / rotary_dim) / factor, a = 1
// (HF's "linear": positions divided by factor).
// \throws value_error if rotary_dim is odd or < 2, base is not finite and > 0, factor is not
// finite and >= 1, or a frequency is not finite (a subnormal base).
inline RopeFrequencies rope_linear_frequencies(Index rotary_dim, double base, double factor) {
  const char* where = "rope_linear_frequencies";
  detail::rope_scaling_impl::check_rotary_dim(where, rotary_dim);
  detail::rope_scaling_impl::check_rope_base(where, base);
  detail::rope_scaling_impl::check_rope_factor(where, "factor", factor);
  RopeFrequencies f;
  f.inv_freq = detail::rope_scaling_impl::rope_theta(rotary_dim, base);
  for (double& x : f.inv_freq) x /= factor;
  detail::rope_scaling_impl::check_rope_finite(where, f.inv_freq);
  return f;
}

// ---------------------------------------------------------------------------------------------
// dynamic NTK
// ---------------------------------------------------------------------------------------------

// The base dynamic NTK uses for a sequence of seq_len tokens: seq_len' = max(seq_len, M),
// base * (factor * seq_len' / M - (factor - 1))^(d / (d - 2)); exactly base when seq_len <= M.
// Checked as below.
inline double rope_dynamic_ntk_base(Index rotary_dim, double base, double factor, Index max_position_embeddings,
                                    Index seq_len) {
  const char* where = "rope_dynamic_ntk_frequencies";
  detail::rope_scaling_impl::check_rotary_dim(where, rotary_dim, 4);  // d / (d - 2): d = 2 would divide by zero
  detail::rope_scaling_impl::check_rope_base(where, base);
  detail::rope_scaling_impl::check_rope_factor(where, "factor", factor);
  detail::rope_scaling_impl::check_rope_length(where, "max_position_embeddings", max_position_embeddings);
  detail::rope_scaling_impl::check_rope_length(where, "seq_len", seq_len, 0);
  if (seq_len <= max_position_embeddings) return base;  // the formula's value, 1^(d / (d - 2)) = 1, exactly
  const double n = static_cast<double>(seq_len);
  const double m = static_cast<double>(max_position_embeddings);
  const double d = static_cast<double>(rotary_dim);
  // transformers' expression, evaluated as it does (Python's double). For factors near 2^52 and
  // beyond, s n / M - (s - 1) cancels to 0 or below: refused with the overflow.
  const double scaled = base * std::pow(factor * n / m - (factor - 1.0), d / (d - 2.0));
  if (!(scaled > 0.0) || !std::isfinite(scaled)) {
    std::ostringstream message;
    message.precision(17);
    message << where << ": the scaled base for seq_len = " << seq_len << " (base " << base << ", factor " << factor
            << ", max_position_embeddings " << max_position_embeddings << ") is " << scaled << ", outside (0, inf)";
    throw value_error(message.str());
  }
  return scaled;
}

// rotary_dim, base, factor, max_position_embeddings M, seq_len -> inv_freq [rotary_dim / 2] =
// base'^(-2i / rotary_dim) with base' = rope_dynamic_ntk_base(...), a = 1 (HF's "dynamic").
// seq_len is the sequence length of the forward call (max position id + 1); seq_len <= M gives the
// default frequencies. This is the stateless formula; HF's caching between calls is
// DynamicNtkRopeCache below.
// \throws value_error if rotary_dim is odd or < 4, base is not finite and > 0, factor is not
// finite and >= 1, M < 1, seq_len < 0, or the scaled base is not finite and > 0 (overflow, or
// cancellation for factors near 2^52), or a frequency is not finite (a subnormal base).
inline RopeFrequencies rope_dynamic_ntk_frequencies(Index rotary_dim, double base, double factor,
                                                    Index max_position_embeddings, Index seq_len) {
  const double scaled = rope_dynamic_ntk_base(rotary_dim, base, factor, max_position_embeddings, seq_len);
  RopeFrequencies f;
  f.inv_freq = detail::rope_scaling_impl::rope_theta(rotary_dim, scaled);
  detail::rope_scaling_impl::check_rope_finite("rope_dynamic_ntk_frequencies", f.inv_freq);
  return f;
}

// Hugging Face's stateful dynamic NTK (`dynamic_rope_update` around the rotary embedding's
// forward), as a small state machine. HF starts with the frequencies for seq_len = M (the default
// ones) and max_seq_len_cached = M; at each forward call, with n = max(position_ids) + 1:
//   n > max_seq_len_cached                      recompute for n; max_seq_len_cached = n   (growth)
//   n < M and max_seq_len_cached > M            back to the original frequencies;
//                                               max_seq_len_cached = M                     (reset)
//   otherwise                                   keep the cached frequencies
// So the frequencies depend on the history: after a call at n = 10000 (M = 4096), a call at
// n = 6000 still uses the n = 10000 frequencies, and one at n = 3000 the original ones. (HF names
// M `original_max_seq_len`; it is the config's max_position_embeddings, not
// original_max_position_embeddings.) Call update(n) before each forward and build the table from
// frequencies() when it returns true.
class DynamicNtkRopeCache {
 public:
  // \throws value_error as rope_dynamic_ntk_frequencies.
  DynamicNtkRopeCache(Index rotary_dim, double base, double factor, Index max_position_embeddings)
      : rotary_dim_(rotary_dim),
        base_(base),
        factor_(factor),
        max_position_embeddings_(max_position_embeddings),
        max_seq_len_cached_(max_position_embeddings),
        original_(
            rope_dynamic_ntk_frequencies(rotary_dim, base, factor, max_position_embeddings, max_position_embeddings)),
        current_(original_) {}

  // seq_len = max(position id) + 1 of the coming forward call. Returns true when frequencies()
  // changed. \throws value_error if seq_len < 0 (nothing changes then).
  bool update(Index seq_len) {
    if (seq_len < 0) detail::rope_scaling_impl::check_rope_length("DynamicNtkRopeCache::update", "seq_len", seq_len, 0);
    if (seq_len > max_seq_len_cached_) {
      current_ = rope_dynamic_ntk_frequencies(rotary_dim_, base_, factor_, max_position_embeddings_, seq_len);
      max_seq_len_cached_ = seq_len;
      return true;
    }
    if (seq_len < max_position_embeddings_ && max_seq_len_cached_ > max_position_embeddings_) {
      current_ = original_;
      max_seq_len_cached_ = max_position_embeddings_;
      return true;
    }
    return false;
  }

  const RopeFrequencies& frequencies() const noexcept { return current_; }
  Index max_seq_len_cached() const noexcept { return max_seq_len_cached_; }

 private:
  Index rotary_dim_;
  double base_;
  double factor_;
  Index max_position_embeddings_;
  Index max_seq_len_cached_;
  RopeFrequencies original_;
  RopeFrequencies current_;
};

// ---------------------------------------------------------------------------------------------
// YaRN
// ---------------------------------------------------------------------------------------------

struct YarnOptions {
  double factor = 1.0;                         // s, required in HF's config (>= 1)
  Index original_max_position_embeddings = 0;  // L, the pre-training context (>= 1)
  double beta_fast = 32.0;                     // rotations in L where extrapolation ends
  double beta_slow = 1.0;                      // rotations in L where interpolation starts
  bool truncate = true;                        // floor / ceil the correction range
  std::optional<double> attention_factor;      // a, when given (> 0)
  std::optional<double> mscale;                // DeepSeek's mscale ...
  std::optional<double> mscale_all_dim;        // ... and mscale_all_dim: a = ratio when both non-zero
};

// YaRN's mscale(s, m) = 0.1 m ln(s) + 1 for s > 1, else 1 (HF's get_mscale).
inline double yarn_get_mscale(double scale, double mscale = 1.0) {
  if (scale <= 1.0) return 1.0;
  return 0.1 * mscale * std::log(scale) + 1.0;
}

// rotary_dim, base, options -> YaRN's inv_freq [rotary_dim / 2] and attention factor (the formulas
// at the top of this header; HF's "yarn").
// \throws value_error if rotary_dim is odd or < 2, base is not finite and > 1 (ln(base) divides),
// factor is not finite and >= 1, original_max_position_embeddings < 1, beta_fast or beta_slow is
// not finite and > 0, beta_fast < beta_slow, attention_factor is given and not finite and > 0,
// mscale or mscale_all_dim is given and not finite, or the attention factor they give is not
// finite and > 0.
inline RopeFrequencies rope_yarn_frequencies(Index rotary_dim, double base, const YarnOptions& options) {
  const char* where = "rope_yarn_frequencies";
  detail::rope_scaling_impl::check_rotary_dim(where, rotary_dim);
  if (!(base > 1.0) || !std::isfinite(base))
    detail::rope_scaling_impl::throw_rope_value(where, "base", base, "(1, inf)");
  detail::rope_scaling_impl::check_rope_factor(where, "factor", options.factor);
  detail::rope_scaling_impl::check_rope_length(where, "original_max_position_embeddings",
                                               options.original_max_position_embeddings);
  detail::rope_scaling_impl::check_rope_positive(where, "beta_fast", options.beta_fast);
  detail::rope_scaling_impl::check_rope_positive(where, "beta_slow", options.beta_slow);
  if (options.beta_fast < options.beta_slow) {
    std::ostringstream message;
    message.precision(17);
    message << where << ": beta_fast = " << options.beta_fast
            << " outside [beta_slow, inf) (beta_slow = " << options.beta_slow << ")";
    throw value_error(message.str());
  }
  if (options.attention_factor)
    detail::rope_scaling_impl::check_rope_positive(where, "attention_factor", *options.attention_factor);
  if (options.mscale && !std::isfinite(*options.mscale))
    detail::rope_scaling_impl::throw_rope_value(where, "mscale", *options.mscale, "(-inf, inf)");
  if (options.mscale_all_dim && !std::isfinite(*options.mscale_all_dim))
    detail::rope_scaling_impl::throw_rope_value(where, "mscale_all_dim", *options.mscale_all_dim, "(-inf, inf)");

  const double s = options.factor;
  double a = 0.0;
  if (options.attention_factor) {
    a = *options.attention_factor;
  } else if (options.mscale && options.mscale_all_dim && *options.mscale != 0.0 && *options.mscale_all_dim != 0.0) {
    // HF tests `mscale and mscale_all_dim`: both present and non-zero.
    a = yarn_get_mscale(s, *options.mscale) / yarn_get_mscale(s, *options.mscale_all_dim);
    if (!(a > 0.0) || !std::isfinite(a))
      detail::rope_scaling_impl::throw_rope_value(
          where, "attention factor mscale(factor, mscale) / mscale(factor, mscale_all_dim)", a, "(0, inf)");
  } else {
    a = yarn_get_mscale(s);
  }

  // The correction range, in Python's double as HF computes it.
  const double d = static_cast<double>(rotary_dim);
  const double two_pi = 2.0 * 3.14159265358979323846;
  const double big_l = static_cast<double>(options.original_max_position_embeddings);
  const auto correction_dim = [&](double rotations) {
    return d * std::log(big_l / (rotations * two_pi)) / (2.0 * std::log(base));
  };
  double lo = correction_dim(options.beta_fast);
  double hi = correction_dim(options.beta_slow);
  if (options.truncate) {
    lo = std::floor(lo);
    hi = std::ceil(hi);
  }
  lo = std::max(lo, 0.0);
  hi = std::min(hi, d - 1.0);
  if (lo == hi) hi += 0.001;  // HF's guard against 0 / 0

  RopeFrequencies f;
  f.inv_freq = detail::rope_scaling_impl::rope_theta(rotary_dim, base);
  for (Index i = 0; i < rotary_dim / 2; ++i) {
    const double ramp = std::clamp((static_cast<double>(i) - lo) / (hi - lo), 0.0, 1.0);
    double& theta = f.inv_freq[static_cast<std::size_t>(i)];
    theta = (theta / s) * ramp + theta * (1.0 - ramp);
  }
  detail::rope_scaling_impl::check_rope_finite(where, f.inv_freq);
  f.attention_factor = a;
  return f;
}

// ---------------------------------------------------------------------------------------------
// LongRoPE
// ---------------------------------------------------------------------------------------------

struct LongRopeOptions {
  std::vector<double> short_factor;            // [rotary_dim / 2], each > 0: n <= L
  std::vector<double> long_factor;             // [rotary_dim / 2], each > 0: n > L
  Index original_max_position_embeddings = 0;  // L (>= 1)
  Index max_position_embeddings = 0;           // M (>= 1): s = M / L when factor is absent
  std::optional<double> factor;                // s, when given (>= 1)
  std::optional<double> attention_factor;      // a, when given (> 0)
};

// rotary_dim, base, options, seq_len -> LongRoPE's inv_freq [rotary_dim / 2] and attention factor
// (HF's "longrope"): the long factors when seq_len > L, else the short ones. seq_len is the
// sequence length of the forward call (max position id + 1; 0 = unknown, as HF's None: short).
// \throws value_error if rotary_dim is odd or < 2, base is not finite and > 0, either factor list
// does not have rotary_dim / 2 entries or has one that is not finite and > 0 (named by its index),
// L or M < 1, factor is given and not finite and >= 1, attention_factor is given and not finite
// and > 0, seq_len < 0, the default attention factor divides by ln(L) = 0 (L = 1 with s > 1), or
// a frequency is not finite (a subnormal base or factor).
inline RopeFrequencies rope_longrope_frequencies(Index rotary_dim, double base, const LongRopeOptions& options,
                                                 Index seq_len) {
  const char* where = "rope_longrope_frequencies";
  detail::rope_scaling_impl::check_rotary_dim(where, rotary_dim);
  detail::rope_scaling_impl::check_rope_base(where, base);
  const auto check_list = [&](const char* name, const std::vector<double>& list) {
    if (static_cast<Index>(list.size()) != rotary_dim / 2) {
      std::ostringstream message;
      message << where << ": " << name << " has " << list.size()
              << " entries, expected rotary_dim / 2 = " << rotary_dim / 2;
      throw value_error(message.str());
    }
    for (std::size_t i = 0; i < list.size(); ++i) {
      if (!(list[i] > 0.0) || !std::isfinite(list[i])) {
        const std::string field = std::string(name) + "[" + std::to_string(i) + "]";
        detail::rope_scaling_impl::throw_rope_value(where, field.c_str(), list[i], "(0, inf)");
      }
    }
  };
  check_list("short_factor", options.short_factor);
  check_list("long_factor", options.long_factor);
  detail::rope_scaling_impl::check_rope_length(where, "original_max_position_embeddings",
                                               options.original_max_position_embeddings);
  detail::rope_scaling_impl::check_rope_length(where, "max_position_embeddings", options.max_position_embeddings);
  if (options.factor) detail::rope_scaling_impl::check_rope_factor(where, "factor", *options.factor);
  if (options.attention_factor)
    detail::rope_scaling_impl::check_rope_positive(where, "attention_factor", *options.attention_factor);
  detail::rope_scaling_impl::check_rope_length(where, "seq_len", seq_len, 0);

  const double big_l = static_cast<double>(options.original_max_position_embeddings);
  double a = 1.0;
  if (options.attention_factor) {
    a = *options.attention_factor;
  } else {
    const double s = options.factor ? *options.factor : static_cast<double>(options.max_position_embeddings) / big_l;
    if (s > 1.0) {
      if (options.original_max_position_embeddings < 2)
        detail::rope_scaling_impl::check_rope_length(
            where, "original_max_position_embeddings (ln(L) divides the attention factor)",
            options.original_max_position_embeddings, 2);
      a = std::sqrt(1.0 + std::log(s) / std::log(big_l));
    }
  }

  const std::vector<double>& lambda = seq_len > options.original_max_position_embeddings ? options.long_factor
                                                                                         : options.short_factor;
  RopeFrequencies f;
  f.inv_freq = detail::rope_scaling_impl::rope_theta(rotary_dim, base);
  for (std::size_t i = 0; i < f.inv_freq.size(); ++i) f.inv_freq[i] /= lambda[i];
  detail::rope_scaling_impl::check_rope_finite(where, f.inv_freq);
  f.attention_factor = a;
  return f;
}

// ---------------------------------------------------------------------------------------------
// Llama 3
// ---------------------------------------------------------------------------------------------

struct Llama3Options {
  double factor = 8.0;                            // s (>= 1); Llama 3.1: 8, Llama 3.2 1B/3B: 32
  double low_freq_factor = 1.0;                   // f_lo (> 0)
  double high_freq_factor = 4.0;                  // f_hi (> f_lo)
  Index original_max_position_embeddings = 8192;  // L (>= 1)
};

// rotary_dim, base, options -> Llama 3's inv_freq [rotary_dim / 2], a = 1 (HF's "llama3"; the
// formulas at the top of this header). The defaults are Llama 3.1's; there is no default in HF's
// config, every field is required there.
// \throws value_error if rotary_dim is odd or < 2, base is not finite and > 0, factor is not
// finite and >= 1, low_freq_factor is not finite and > 0, high_freq_factor is not finite and
// > low_freq_factor, original_max_position_embeddings < 1, or a frequency is not finite (a
// subnormal base).
inline RopeFrequencies rope_llama3_frequencies(Index rotary_dim, double base, const Llama3Options& options) {
  const char* where = "rope_llama3_frequencies";
  detail::rope_scaling_impl::check_rotary_dim(where, rotary_dim);
  detail::rope_scaling_impl::check_rope_base(where, base);
  detail::rope_scaling_impl::check_rope_factor(where, "factor", options.factor);
  detail::rope_scaling_impl::check_rope_positive(where, "low_freq_factor", options.low_freq_factor);
  if (!(options.high_freq_factor > options.low_freq_factor) || !std::isfinite(options.high_freq_factor)) {
    std::ostringstream message;
    message.precision(17);
    message << where << ": high_freq_factor = " << options.high_freq_factor
            << " outside (low_freq_factor, inf) (low_freq_factor = " << options.low_freq_factor << ")";
    throw value_error(message.str());
  }
  detail::rope_scaling_impl::check_rope_length(where, "original_max_position_embeddings",
                                               options.original_max_position_embeddings);

  const double big_l = static_cast<double>(options.original_max_position_embeddings);
  const double low_freq_wavelen = big_l / options.low_freq_factor;    // longer wavelengths: / factor
  const double high_freq_wavelen = big_l / options.high_freq_factor;  // shorter ones: unchanged
  const double two_pi = 2.0 * 3.14159265358979323846;
  RopeFrequencies f;
  f.inv_freq = detail::rope_scaling_impl::rope_theta(rotary_dim, base);
  for (double& theta : f.inv_freq) {
    const double wavelen = two_pi / theta;
    if (wavelen > low_freq_wavelen) {
      theta = theta / options.factor;
    } else if (!(wavelen < high_freq_wavelen)) {  // high_freq_wavelen <= wavelen <= low_freq_wavelen
      const double g = (big_l / wavelen - options.low_freq_factor) /
                       (options.high_freq_factor - options.low_freq_factor);
      theta = (1.0 - g) * theta / options.factor + g * theta;
    }
  }
  detail::rope_scaling_impl::check_rope_finite(where, f.inv_freq);
  return f;
}

}  // namespace embedhead

#endif  // EMBEDHEAD_ROPE_SCALING_HPP
