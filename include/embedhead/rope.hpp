// embedhead: rotary position embedding, RoPE (Su et al., "RoFormer: Enhanced Transformer with
// Rotary Position Embedding", 2021), as a cos/sin table and a pair of kernels on views.
//
// RoPE adds no vector to the tokens. Inside attention, each query and key head vector x
// [head_dim] of the token at position p is rotated, pair by pair, by angles proportional to p:
//
//   theta_i = inv_freq[i]            (default: base^(-2i / rotary_dim), i = 0 .. rotary_dim/2 - 1)
//   c = a * cos(p * theta_i),  s = a * sin(p * theta_i)      (a = attention_factor, 1 by default)
//   (y_u, y_v) = (x_u * c - x_v * s,  x_v * c + x_u * s)      for the i-th pair (u, v)
//
// so that q(p).k(p') depends on p - p' only (a = 1). Pairing conventions, named explicitly:
//   half_split:   pair i = (i, i + rotary_dim/2)  -- Hugging Face's rotate_half, GPT-NeoX, Llama
//   interleaved:  pair i = (2i, 2i + 1)           -- GPT-J, the original RoFormer, Meta's complex form
// A checkpoint trained with one convention must be run with it (converting between them permutes
// the q and k projection rows). Partial rotary (rotary_dim < head_dim, GPT-NeoX, Phi): the first
// rotary_dim entries of each head are rotated, the rest pass through unchanged; the default
// frequencies use rotary_dim (not head_dim) in the exponent, as GPT-NeoX and Phi do.
//
// Precision: the table holds c and s for positions 0 .. num_positions - 1. Each angle p * theta_i,
// its cos and sin and the product with a are computed in double and rounded once to the table's
// Scalar (a float table is within 0.5 ulp of those double values at any position; computing the
// angle in float or bf16 instead is the famous silent long-context bug: in bf16, 15962 rounds to
// 15936). The rotation itself is done in Scalar.
//
// Backward: y = a * R(p) x is linear in x, so dx = a * R(p)^T dy -- the rotation by -p * theta_i
// (the same pairs, s negated) scaled by a. With a = 1 this is the inverse rotation. A table with
// a != 1 (YaRN, LongRoPE) scales q and k by a, as Hugging Face folds attention_scaling into cos
// and sin; the product q.k is then scaled by a^2.
#ifndef EMBEDHEAD_ROPE_HPP
#define EMBEDHEAD_ROPE_HPP

#include "detail/checks.hpp"
#include "detail/parallel.hpp"
#include "errors.hpp"
#include "token_ids.hpp"
#include "types.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <sstream>
#include <type_traits>
#include <vector>

namespace embedhead {

// How the entries of a head vector are paired for rotation (see the top of this header).
enum class RopePairing {
  half_split,   // (i, i + rotary_dim/2): HF's rotate_half, GPT-NeoX, Llama, Qwen, Gemma, Mistral
  interleaved,  // (2i, 2i + 1): GPT-J, RoFormer, Meta's reference (complex multiplication)
};

// The frequencies of a RoPE variant: what the scalings of rope_scaling.hpp produce and what a
// RopeTable is built from.
struct RopeFrequencies {
  std::vector<double> inv_freq;   // [rotary_dim / 2]: theta_i, radians per position, pair i
  double attention_factor = 1.0;  // a: multiplies every cos and sin (HF's attention_scaling)
};

// rotary_dim, base -> inv_freq [rotary_dim / 2] with theta_i = base^(-2i / rotary_dim), a = 1
// (HF's "default" rope type). Computed in double.
// \throws value_error if rotary_dim is odd or < 2, or base is not finite and > 0.
inline RopeFrequencies rope_default_frequencies(Index rotary_dim, double base) {
  const char* where = "rope_default_frequencies";
  if (rotary_dim < 2 || rotary_dim % 2 != 0) {
    std::ostringstream message;
    message << where << ": rotary_dim = " << rotary_dim << " must be even and in [2, inf)";
    throw value_error(message.str());
  }
  detail::check_positive(where, "base", base);
  RopeFrequencies f;
  f.inv_freq.resize(static_cast<std::size_t>(rotary_dim / 2));
  for (Index i = 0; i < rotary_dim / 2; ++i)
    f.inv_freq[static_cast<std::size_t>(i)] =
        1.0 / std::pow(base, static_cast<double>(2 * i) / static_cast<double>(rotary_dim));
  return f;
}

}  // namespace embedhead

#endif  // EMBEDHEAD_ROPE_HPP
