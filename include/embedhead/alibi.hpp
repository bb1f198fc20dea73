// embedhead: ALiBi, attention with linear biases (Press, Smith and Lewis, "Train Short, Test Long:
// Attention with Linear Biases Enables Input Length Extrapolation", ICLR 2022).
//
// No position embedding is added to the tokens. Instead every attention score gets a penalty
// linear in the distance between query and key, with a fixed slope m_h per head h:
//
//   scores(b, h, i, j) += -m_h * (q_pos(b, i) - k_pos(b, j))                 (the paper's form)
//
// Slopes, for H heads (h = 1 .. H):
//   H a power of two:  m_h = 2^(-8h/H)                        (H = 8: 1/2, 1/4, ..., 1/256)
//   otherwise:         n = 2^floor(log2 H), the largest power of two <= H; the n slopes of n heads,
//                      then every other slope of 2n heads -- 2^(-8k/(2n)) for k = 1, 3, 5, ... --
//                      the first H - n of them (the rule of get_slopes in the paper's reference
//                      code, ofirpress/attention_with_linear_biases, fairseq/models/transformer.py).
//                      H = 12: 2^-1, ..., 2^-8, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5.
// Every slope lies in [2^-8, 1). They are computed in double (the exponent -8k/(2n) is exact, so
// each slope is exp2 of an exact value) and rounded once to the Scalar asked for.
//
// Sign convention: the reference code adds +m_h * j (one row [1, T_k] broadcast over the queries)
// instead of -m_h * (i - j). The two differ by m_h * i, a constant along each row (i fixed), and
// softmax is invariant to adding a constant to a row, so attention probabilities are the same. The
// scores themselves differ; this header writes the paper's form, which is 0 on the diagonal and
// negative for past keys.
//
// Future keys: ALiBi itself does not mask. A key with k_pos > q_pos gets the positive bias
// m_h * (k_pos - q_pos), which is wrong for a causal model unless the caller masks it. Pass
// AlibiMask::causal to have those scores set to -inf here (by position: the key is masked when
// k_pos(b, j) > q_pos(b, i)), or AlibiMask::none and apply your own mask. Padding keys and
// document boundaries of packed rows are never masked here: that is the caller's attention mask.
//
// Backward: ALiBi has no parameters and the bias is an addition that does not depend on the
// scores, so d(scores before) = d(scores after) -- the identity; there is nothing to compute. A
// score set to -inf by AlibiMask::causal has softmax probability 0, so its gradient is 0 anyway.
#ifndef EMBEDHEAD_ALIBI_HPP
#define EMBEDHEAD_ALIBI_HPP

#include "detail/checks.hpp"
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

// H -> slopes [H]: m_1 .. m_H as above (slopes[h - 1] = m_h), computed in double and rounded once
// to Scalar. alibi_slopes(H) gives double; alibi_slopes<float>(H) the same values rounded to float.
// \throws value_error if H < 1.
template <typename Scalar = double>
std::vector<Scalar> alibi_slopes(Index H) {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");
  detail::check_size("alibi_slopes", "H", H);
  Index n = 1;  // the largest power of two <= H (n <= H / 2 before doubling, so no overflow)
  while (n <= H / 2) n *= 2;
  std::vector<Scalar> slopes;
  slopes.reserve(static_cast<std::size_t>(H));
  // The slopes of n heads: 2^(-8k/n), k = 1 .. n. n is a power of two, so 8k/n is exact.
  for (Index k = 1; k <= n; ++k)
    slopes.push_back(static_cast<Scalar>(std::exp2(-8.0 * static_cast<double>(k) / static_cast<double>(n))));
  // Every other slope of 2n heads, 2^(-8k/(2n)) for odd k = 1, 3, 5, ..., the first H - n of them.
  for (Index e = 0; e < H - n; ++e)
    slopes.push_back(
        static_cast<Scalar>(std::exp2(-8.0 * static_cast<double>(2 * e + 1) / (2.0 * static_cast<double>(n)))));
  return slopes;
}

// What add_alibi_bias writes for a future key (k_pos > q_pos): see the comment at the top.
enum class AlibiMask {
  none,    // the bias m_h * (k_pos - q_pos) > 0 is added like any other; the caller masks
  causal,  // the score is set to -inf (the input score is discarded, whatever it was)
};

namespace detail {

// Positions above this are rejected: below it, q_pos - k_pos converts to double exactly.
inline constexpr std::int64_t kAlibiMaxPosition = std::int64_t{1} << 53;

// Throws value_error unless slopes is non-empty and every slope is finite and >= 0.
inline void check_alibi_slopes(const char* where, const std::vector<double>& slopes) {
  if (slopes.empty()) {
    std::ostringstream message;
    message << where << ": slopes has 0 entries, so H = 0 outside [1, inf)";
    throw value_error(message.str());
  }
  for (std::size_t h = 0; h < slopes.size(); ++h) {
    const double m = slopes[h];
    if (!(m >= 0.0) || !std::isfinite(m)) {
      std::ostringstream message;
      message << where << ": slopes[" << h << "] = " << m << " outside [0, inf)";
      throw value_error(message.str());
    }
  }
}

// Throws value_error unless B, H, T_q >= 0 and B*H*T_q is representable; shape_error unless
// scores is [B*H*T_q, T_k].
inline void check_alibi_scores(const char* where, Index scores_rows, Index scores_cols, Index B, Index H, Index T_q,
                               Index T_k) {
  const Index big = std::numeric_limits<Index>::max();
  if (B < 0 || T_q < 0 || (T_q > 0 && H > big / T_q) || (H * T_q > 0 && B > big / (H * T_q))) {
    std::ostringstream message;
    message << where << ": B = " << B << ", H = " << H << ", T_q = " << T_q
            << " must be >= 0 with B*H*T_q representable";
    throw value_error(message.str());
  }
  if (scores_rows != B * H * T_q || scores_cols != T_k)
    throw_shape(where, "scores", scores_rows, scores_cols, B * H * T_q, T_k);
}

// Throws index_error unless every position of the [B, T] view lies in [0, 2^53).
template <typename Id>
void check_alibi_positions(const char* where, const char* what, const TypedTokenIds<Id>& positions) {
  for (Index b = 0; b < positions.rows(); ++b)
    for (Index t = 0; t < positions.cols(); ++t) {
      const std::int64_t p = positions(b, t);
      if (p < 0 || p >= kAlibiMaxPosition) {
        std::ostringstream message;
        message << where << ": position " << p << " in " << what << " at (b=" << b << ", t=" << t
                << ") outside [0, 2^53 = " << kAlibiMaxPosition << ")";
        throw index_error(message.str());
      }
    }
}

// The one loop: row r of scores = (b*H + h)*T_q + i gets -m_h * (q(b, i) - k(b, j)) at column j,
// computed in double and rounded once to Scalar before the addition. q(b, i) and k(b, j) are
// int64 positions in [0, 2^53), so their difference is exact in double.
template <typename Scalar, typename QPos, typename KPos>
void add_alibi_rows(MatrixRef<Scalar>& scores, const std::vector<double>& slopes, Index B, Index T_q, Index T_k,
                    const QPos& q, const KPos& k, AlibiMask mask) {
  const Index H = static_cast<Index>(slopes.size());
  const Scalar minus_inf = -std::numeric_limits<Scalar>::infinity();
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h) {
      const double m = slopes[static_cast<std::size_t>(h)];
      for (Index i = 0; i < T_q; ++i) {
        const std::int64_t qi = q(b, i);
        Scalar* row = scores.row((b * H + h) * T_q + i).data();
        for (Index j = 0; j < T_k; ++j) {
          const std::int64_t kj = k(b, j);
          if (mask == AlibiMask::causal && kj > qi)
            row[j] = minus_inf;
          else
            row[j] += static_cast<Scalar>(-m * static_cast<double>(qi - kj));
        }
      }
    }
}

}  // namespace detail

// Scores laid out [B, H, T_q, T_k] as one row-major matrix [B*H*T_q, T_k]: the scores of batch row
// b, head h, query i are the matrix row (b*H + h)*T_q + i, one entry per key j (B = 1: one [T_q,
// T_k] block per head, stacked). H = slopes.size() (alibi_slopes(H), or other slopes, e.g. MPT's).
//
// Positions implied, for causal self-attention and incremental decoding: query i sits at position
// offset + i, key j at position j, in every batch row:
//   scores [B*H*T_q, T_k] += -m_h * (offset + i - j)      (or -inf where j > offset + i, causal)
// offset = 0 with T_q = T_k is a whole sequence; offset = T_k - T_q is the last T_q tokens of T_k
// (a decoding step with a key/value cache of T_k - T_q earlier tokens). Every query's own position
// must be a key position: 0 <= offset <= T_k - T_q. Slopes are used in double.
// \throws value_error if slopes is empty or a slope is not finite or < 0, or if B or T_q < 0;
// shape_error if scores is not [B*H*T_q, T_k] (T_k = scores.cols()); index_error if offset lies
// outside [0, T_k - T_q]. Nothing is written on a throw. Cost B*H*T_q*T_k additions.
template <typename Scalar>
void add_alibi_bias(MatrixRef<Scalar> scores, const std::vector<double>& slopes, Index B, Index T_q, Index offset,
                    AlibiMask mask) {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");
  const char* where = "add_alibi_bias";
  detail::check_alibi_slopes(where, slopes);
  const Index H = static_cast<Index>(slopes.size()), T_k = scores.cols();
  detail::check_alibi_scores(where, scores.rows(), scores.cols(), B, H, T_q, T_k);
  if (offset < 0 || offset > T_k - T_q) {
    std::ostringstream message;
    message << where << ": offset " << offset << " (T_q " << T_q << ", T_k " << T_k << ") outside [0, " << T_k - T_q
            << "]: query i sits at position offset + i and must be one of the key positions 0 .. T_k - 1";
    throw index_error(message.str());
  }
  const auto q = [offset](Index, Index i) { return static_cast<std::int64_t>(offset + i); };
  const auto k = [](Index, Index j) { return static_cast<std::int64_t>(j); };
  detail::add_alibi_rows<Scalar>(scores, slopes, B, T_q, T_k, q, k, mask);
}

// Positions given per batch row (left padding, packed documents, any offset per row):
// q_positions [B, T_q], k_positions [B, T_k] (int32 or int64, any layout TokenIds views):
//   scores [B*H*T_q, T_k] += -m_h * (q_positions(b, i) - k_positions(b, j))
// (or -inf where k_positions(b, j) > q_positions(b, i), causal). Positions are compared as given:
// a padding token's position gets a bias like any other, and the caller masks padding keys. A
// left-padded row whose real tokens sit at 0 .. L - 1 gets, on those tokens, exactly the bias of
// the same L tokens alone with offset 0.
// \throws value_error as above; shape_error if k_positions does not have B = q_positions.rows()
// rows or scores is not [B*H*T_q, T_k]; index_error for a position outside [0, 2^53) (the first
// one, q_positions before k_positions, in row-major order, with its (b, t)). Nothing is written
// on a throw.
template <typename Scalar>
void add_alibi_bias(MatrixRef<Scalar> scores, const std::vector<double>& slopes, TokenIds q_positions,
                    TokenIds k_positions, AlibiMask mask) {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");
  const char* where = "add_alibi_bias";
  detail::check_alibi_slopes(where, slopes);
  const Index B = q_positions.rows(), T_q = q_positions.cols(), T_k = k_positions.cols();
  if (k_positions.rows() != B) detail::throw_shape(where, "k_positions", k_positions.rows(), T_k, B, T_k);
  detail::check_alibi_scores(where, scores.rows(), scores.cols(), B, static_cast<Index>(slopes.size()), T_q, T_k);
  q_positions.visit([&](const auto& q) {
    k_positions.visit([&](const auto& k) {
      detail::check_alibi_positions(where, "q_positions", q);
      detail::check_alibi_positions(where, "k_positions", k);
      const auto q64 = [&q](Index b, Index i) { return static_cast<std::int64_t>(q(b, i)); };
      const auto k64 = [&k](Index b, Index j) { return static_cast<std::int64_t>(k(b, j)); };
      detail::add_alibi_rows<Scalar>(scores, slopes, B, T_q, T_k, q64, k64, mask);
    });
  });
}

}  // namespace embedhead

#endif  // EMBEDHEAD_ALIBI_HPP
