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

#include <algorithm>
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
    f.inv_freq[static_cast<std::size_t>(i)] = 1.0 / std::pow(base, static_cast<double>(2 * i) /
                                                                       static_cast<double>(rotary_dim));
  return f;
}

// A RoPE cos/sin table for positions 0 .. num_positions - 1: c(p, i) = a * cos(p * theta_i) and
// s(p, i) = a * sin(p * theta_i), i = 0 .. rotary_dim/2 - 1, each computed in double and rounded
// once to Scalar (float or double). Memory num_positions * rotary_dim * sizeof(Scalar); building
// it costs num_positions * rotary_dim/2 double sin/cos pairs (about 0.1 s at 131,072 x 64). The
// pairing is part of the table, so a kernel cannot be run with the other convention by mistake.
template <typename Scalar>
class RopeTable {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");

 public:
  // head_dim (even), rotary_dim (even, 2 <= rotary_dim <= head_dim), pairing, num_positions >= 1,
  // frequencies f (f.inv_freq has rotary_dim/2 finite entries >= 0; f.attention_factor finite > 0).
  // \throws value_error naming the argument, its value and the valid range.
  RopeTable(Index head_dim, Index rotary_dim, RopePairing pairing, Index num_positions, const RopeFrequencies& f)
      : head_dim_(head_dim), rotary_dim_(rotary_dim), pairing_(pairing), num_positions_(num_positions) {
    const char* where = "RopeTable";
    if (head_dim < 2 || head_dim % 2 != 0) {
      std::ostringstream message;
      message << where << ": head_dim = " << head_dim << " must be even and in [2, inf)";
      throw value_error(message.str());
    }
    if (rotary_dim < 2 || rotary_dim % 2 != 0 || rotary_dim > head_dim) {
      std::ostringstream message;
      message << where << ": rotary_dim = " << rotary_dim << " must be even and in [2, head_dim = " << head_dim << "]";
      throw value_error(message.str());
    }
    detail::check_size(where, "num_positions", num_positions);
    const Index half = rotary_dim / 2;
    if (static_cast<Index>(f.inv_freq.size()) != half) {
      std::ostringstream message;
      message << where << ": inv_freq has " << f.inv_freq.size() << " entries, expected rotary_dim / 2 = " << half;
      throw value_error(message.str());
    }
    for (Index i = 0; i < half; ++i) {
      const double theta = f.inv_freq[static_cast<std::size_t>(i)];
      if (!(theta >= 0.0) || !std::isfinite(theta)) {
        std::ostringstream message;
        message << where << ": inv_freq[" << i << "] = " << theta << " outside [0, inf)";
        throw value_error(message.str());
      }
    }
    detail::check_positive(where, "attention_factor", f.attention_factor);
    if (num_positions > std::numeric_limits<Index>::max() / rotary_dim) {
      std::ostringstream message;
      message << where << ": num_positions = " << num_positions << " times rotary_dim = " << rotary_dim
              << " is not representable";
      throw value_error(message.str());
    }
    attention_factor_ = f.attention_factor;
    inv_freq_ = f.inv_freq;
    // Row p: [c(p, 0) .. c(p, half - 1), s(p, 0) .. s(p, half - 1)].
    table_.resize(num_positions, rotary_dim);
    const double a = f.attention_factor;
    detail::parallel_ranges(num_positions, 256, [&](Index begin, Index end) {
      for (Index p = begin; p < end; ++p) {
        Scalar* row = table_.row(p).data();
        for (Index i = 0; i < half; ++i) {
          const double angle = static_cast<double>(p) * f.inv_freq[static_cast<std::size_t>(i)];
          row[i] = static_cast<Scalar>(a * std::cos(angle));
          row[half + i] = static_cast<Scalar>(a * std::sin(angle));
        }
      }
    });
  }

  Index head_dim() const { return head_dim_; }
  Index rotary_dim() const { return rotary_dim_; }
  RopePairing pairing() const { return pairing_; }
  Index num_positions() const { return num_positions_; }
  double attention_factor() const { return attention_factor_; }
  const std::vector<double>& inv_freq() const { return inv_freq_; }

  // a * cos(p * theta_i) and a * sin(p * theta_i), rounded to Scalar; 0 <= p < num_positions,
  // 0 <= i < rotary_dim / 2 (not checked).
  Scalar cos(Index p, Index i) const { return table_(p, i); }
  Scalar sin(Index p, Index i) const { return table_(p, rotary_dim_ / 2 + i); }

  // Row p of the table: rotary_dim / 2 cosines, then rotary_dim / 2 sines (not checked).
  const Scalar* row(Index p) const { return table_.row(p).data(); }

 private:
  Index head_dim_, rotary_dim_;
  RopePairing pairing_;
  Index num_positions_;
  double attention_factor_ = 1.0;
  std::vector<double> inv_freq_;
  RowMatrix<Scalar> table_;  // [num_positions, rotary_dim]
};

namespace detail {

// Rotates one head vector's rotary part: out[u], out[v] from in[u], in[v] for each pair (u, v) of
// the table's pairing, with c and s from the table row cs; sign = +1 rotates by +p*theta (forward),
// sign = -1 by -p*theta (backward: R^T). in and out may be the same pointer (each pair is read
// before it is written); the pass-through part (rotary_dim .. head_dim) is not touched here.
template <typename Scalar>
inline void rope_rotate_head(const Scalar* cs, Index half, RopePairing pairing, bool inverse, const Scalar* in,
                             Scalar* out) {
  const Scalar* c = cs;
  const Scalar* s = cs + half;
  if (pairing == RopePairing::half_split) {
    const Scalar* x1 = in;
    const Scalar* x2 = in + half;
    Scalar* y1 = out;
    Scalar* y2 = out + half;
    if (!inverse) {
      for (Index i = 0; i < half; ++i) {
        const Scalar a = x1[i], b = x2[i];
        y1[i] = a * c[i] - b * s[i];
        y2[i] = b * c[i] + a * s[i];
      }
    } else {
      for (Index i = 0; i < half; ++i) {
        const Scalar a = x1[i], b = x2[i];
        y1[i] = a * c[i] + b * s[i];
        y2[i] = b * c[i] - a * s[i];
      }
    }
  } else {
    if (!inverse) {
      for (Index i = 0; i < half; ++i) {
        const Scalar a = in[2 * i], b = in[2 * i + 1];
        out[2 * i] = a * c[i] - b * s[i];
        out[2 * i + 1] = b * c[i] + a * s[i];
      }
    } else {
      for (Index i = 0; i < half; ++i) {
        const Scalar a = in[2 * i], b = in[2 * i + 1];
        out[2 * i] = a * c[i] + b * s[i];
        out[2 * i + 1] = b * c[i] - a * s[i];
      }
    }
  }
}

// Throws unless x is [N, num_heads * head_dim] with num_heads >= 1.
template <typename Scalar>
void check_rope_input(const char* where, const char* what, const RopeTable<Scalar>& table, Index rows, Index cols,
                      Index num_heads) {
  check_size(where, "num_heads", num_heads);
  if (num_heads > std::numeric_limits<Index>::max() / table.head_dim()) {
    std::ostringstream message;
    message << where << ": num_heads = " << num_heads << " times head_dim = " << table.head_dim()
            << " is not representable";
    throw value_error(message.str());
  }
  if (cols != num_heads * table.head_dim()) {
    std::ostringstream message;
    message << where << ": " << what << " has shape [" << rows << ", " << cols
            << "], expected [N, num_heads * head_dim = " << num_heads << " * " << table.head_dim() << " = "
            << num_heads * table.head_dim() << "]";
    throw shape_error(message.str());
  }
}

// Throws index_error unless every position of the [B, T] view lies in [0, num_positions).
template <typename Id>
void check_rope_positions(const char* where, const TypedTokenIds<Id>& positions, Index num_positions) {
  for (Index b = 0; b < positions.rows(); ++b)
    for (Index t = 0; t < positions.cols(); ++t) {
      const std::int64_t p = positions(b, t);
      if (p < 0 || p >= num_positions) {
        std::ostringstream message;
        message << where << ": position " << p << " at (b=" << b << ", t=" << t << ") outside the table's [0, "
                << num_positions << ")";
        throw index_error(message.str());
      }
    }
}

// The one loop: row n of out = the rotation of row n of in (heads 0 .. num_heads - 1) at position
// position_of(n); the pass-through part is copied when in != out. Rows are split among threads;
// each row's arithmetic is the same for any split, so results are bit-identical for any thread count.
template <typename Scalar, typename PositionOf>
void rope_rows(const RopeTable<Scalar>& table, const Scalar* in, Index in_stride, Scalar* out, Index out_stride,
               Index rows, Index num_heads, bool inverse, const PositionOf& position_of) {
  const Index head_dim = table.head_dim(), rotary = table.rotary_dim(), half = rotary / 2;
  const RopePairing pairing = table.pairing();
  const Index row_bytes = num_heads * head_dim * static_cast<Index>(sizeof(Scalar));
  const Index min_rows = std::max<Index>(1, (Index{1} << 16) / std::max<Index>(1, row_bytes));
  parallel_ranges(rows, min_rows, [&](Index begin, Index end) {
    for (Index n = begin; n < end; ++n) {
      const Scalar* cs = table.row(position_of(n));
      const Scalar* x = in + n * in_stride;
      Scalar* y = out + n * out_stride;
      for (Index h = 0; h < num_heads; ++h) {
        const Scalar* xh = x + h * head_dim;
        Scalar* yh = y + h * head_dim;
        rope_rotate_head(cs, half, pairing, inverse, xh, yh);
        if (xh != yh)
          for (Index j = rotary; j < head_dim; ++j) yh[j] = xh[j];
      }
    }
  });
}

template <typename Scalar>
void rope_apply(const char* where, const RopeTable<Scalar>& table, const Scalar* in, Index in_rows, Index in_cols,
                Index in_stride, Scalar* out, Index out_rows, Index out_cols, Index out_stride, Index num_heads,
                bool inverse, const TokenIds& positions) {
  check_rope_input(where, "x", table, in_rows, in_cols, num_heads);
  if (out_rows != in_rows || out_cols != in_cols) throw_shape(where, "out", out_rows, out_cols, in_rows, in_cols);
  const Index B = positions.rows(), T = positions.cols();
  if (B * T != in_rows) {
    std::ostringstream message;
    message << where << ": positions is [" << B << ", " << T << "], B*T = " << B * T << " rows, but x has " << in_rows
            << " rows (row n = b*T + t)";
    throw shape_error(message.str());
  }
  positions.visit([&](const auto& pos) {
    check_rope_positions(where, pos, table.num_positions());
    const auto position_of = [&pos, T](Index n) { return static_cast<Index>(pos(n / T, n % T)); };
    rope_rows(table, in, in_stride, out, out_stride, in_rows, num_heads, inverse, position_of);
  });
}

template <typename Scalar>
void rope_apply(const char* where, const RopeTable<Scalar>& table, const Scalar* in, Index in_rows, Index in_cols,
                Index in_stride, Scalar* out, Index out_rows, Index out_cols, Index out_stride, Index num_heads,
                bool inverse, Index T, Index start) {
  check_rope_input(where, "x", table, in_rows, in_cols, num_heads);
  if (out_rows != in_rows || out_cols != in_cols) throw_shape(where, "out", out_rows, out_cols, in_rows, in_cols);
  if (T < 1 || in_rows % T != 0) {
    std::ostringstream message;
    message << where << ": T = " << T << " must be >= 1 and divide the " << in_rows << " rows of x (row n = b*T + t)";
    throw shape_error(message.str());
  }
  // Positions start .. start + T - 1 must lie in [0, num_positions).
  if (start < 0 || start > table.num_positions() - T) {
    std::ostringstream message;
    message << where << ": positions start = " << start << " .. start + T - 1 = " << start + T - 1
            << " outside the table's [0, " << table.num_positions() << ")";
    throw index_error(message.str());
  }
  const auto position_of = [T, start](Index n) { return start + n % T; };
  rope_rows(table, in, in_stride, out, out_stride, in_rows, num_heads, inverse, position_of);
}

}  // namespace detail

// x [N, num_heads * head_dim] (row-major; the same memory as [N, num_heads, head_dim]) is rotated
// in place: row n = b*T + t is the token at position positions(b, t), positions [B, T] with
// B*T = N (int32 or int64, any layout a TokenIds views; per-row positions for left padding and
// packed documents). Each head's rotary part is rotated, the rest left as is.
// \throws value_error if num_heads < 1; shape_error if x is not [B*T, num_heads * head_dim];
// index_error for a position outside [0, num_positions) (the first, with its (b, t)). Nothing is
// written on a throw. Cost one read and one write of x plus one table row per token.
template <typename Scalar>
void rope_forward(const RopeTable<Scalar>& table, detail::non_deduced_t<MatrixRef<Scalar>> x, Index num_heads,
                  TokenIds positions) {
  detail::rope_apply("rope_forward", table, x.data(), x.rows(), x.cols(), x.outerStride(), x.data(), x.rows(), x.cols(),
                     x.outerStride(), num_heads, false, positions);
}

// The same into out [N, num_heads * head_dim] (x unchanged; the pass-through part is copied).
// out may be x itself, but must not otherwise overlap it. Throws as above, also shape_error if out
// is not x's shape.
template <typename Scalar>
void rope_forward(const RopeTable<Scalar>& table, detail::non_deduced_t<ConstMatrixRef<Scalar>> x, Index num_heads,
                  TokenIds positions, detail::non_deduced_t<MatrixRef<Scalar>> out) {
  detail::rope_apply("rope_forward", table, x.data(), x.rows(), x.cols(), x.outerStride(), out.data(), out.rows(),
                     out.cols(), out.outerStride(), num_heads, false, positions);
}

// Implied positions: x [B*T, num_heads * head_dim], row n at position start + n % T (every batch
// row b = n / T at start .. start + T - 1; start = the key/value cache length when decoding).
// \throws shape_error if T < 1 or T does not divide N; index_error if start < 0 or
// start + T > num_positions; otherwise as above.
template <typename Scalar>
void rope_forward(const RopeTable<Scalar>& table, detail::non_deduced_t<MatrixRef<Scalar>> x, Index num_heads, Index T,
                  Index start) {
  detail::rope_apply("rope_forward", table, x.data(), x.rows(), x.cols(), x.outerStride(), x.data(), x.rows(), x.cols(),
                     x.outerStride(), num_heads, false, T, start);
}

template <typename Scalar>
void rope_forward(const RopeTable<Scalar>& table, detail::non_deduced_t<ConstMatrixRef<Scalar>> x, Index num_heads,
                  Index T, Index start, detail::non_deduced_t<MatrixRef<Scalar>> out) {
  detail::rope_apply("rope_forward", table, x.data(), x.rows(), x.cols(), x.outerStride(), out.data(), out.rows(),
                     out.cols(), out.outerStride(), num_heads, false, T, start);
}

// Backward: dy [N, num_heads * head_dim], the gradient of rope_forward's output, becomes the
// gradient of its input, dx = a * R(p)^T dy (the rotation by -p * theta_i; pass-through entries
// unchanged), in place or into out. Same positions, shapes and errors as rope_forward.
template <typename Scalar>
void rope_backward(const RopeTable<Scalar>& table, detail::non_deduced_t<MatrixRef<Scalar>> dy, Index num_heads,
                   TokenIds positions) {
  detail::rope_apply("rope_backward", table, dy.data(), dy.rows(), dy.cols(), dy.outerStride(), dy.data(), dy.rows(),
                     dy.cols(), dy.outerStride(), num_heads, true, positions);
}

template <typename Scalar>
void rope_backward(const RopeTable<Scalar>& table, detail::non_deduced_t<ConstMatrixRef<Scalar>> dy, Index num_heads,
                   TokenIds positions, detail::non_deduced_t<MatrixRef<Scalar>> dx) {
  detail::rope_apply("rope_backward", table, dy.data(), dy.rows(), dy.cols(), dy.outerStride(), dx.data(), dx.rows(),
                     dx.cols(), dx.outerStride(), num_heads, true, positions);
}

template <typename Scalar>
void rope_backward(const RopeTable<Scalar>& table, detail::non_deduced_t<MatrixRef<Scalar>> dy, Index num_heads,
                   Index T, Index start) {
  detail::rope_apply("rope_backward", table, dy.data(), dy.rows(), dy.cols(), dy.outerStride(), dy.data(), dy.rows(),
                     dy.cols(), dy.outerStride(), num_heads, true, T, start);
}

template <typename Scalar>
void rope_backward(const RopeTable<Scalar>& table, detail::non_deduced_t<ConstMatrixRef<Scalar>> dy, Index num_heads,
                   Index T, Index start, detail::non_deduced_t<MatrixRef<Scalar>> dx) {
  detail::rope_apply("rope_backward", table, dy.data(), dy.rows(), dy.cols(), dy.outerStride(), dx.data(), dx.rows(),
                     dx.cols(), dx.outerStride(), num_heads, true, T, start);
}

}  // namespace embedhead

#endif  // EMBEDHEAD_ROPE_HPP
