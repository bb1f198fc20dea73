// embedhead: scores from the LM head without the logits -- the log-probability of given tokens,
// each row's entropy and its top-k tokens -- computed from hidden states block by block of W, as
// the fused loss walks them, so the [N, V] logits never exist.
//
// For hidden states h [N, d], the head W [V, d] (+ bias b [V]) and, optionally, tokens y [N]:
//   z       = h W^T + b                                   the logits (never held whole)
//   s       = c tanh(z / c) if softcap c > 0, else z      the model's logits (Gemma 2 caps them)
//   raw       log_softmax(s)                              the model's distribution
//   processed log_softmax(s / T)                          after the temperature T (what a sampler
//                                                         with temperature draws from)
//   raw_logprob[n]       = s_y - lse(s)
//   processed_logprob[n] = s_y / T - lse(s / T)
//   entropy[n]           = -sum_j p_j log p_j,  p = softmax(s / T)   (log S - E / S, softmax.hpp)
//   top_ids[n], top_logprobs[n]: the k classes of largest s (equivalently s / T, T > 0), in
//                        decreasing order, ties broken by the smaller id; their processed log-probs
// With T = 1 the raw and processed values are the same bits. "Raw" and "processed" are named
// apart because samplers and trainers mix them up: an RL trainer's importance ratio needs the
// log-prob of the distribution the sampler drew from (processed), an evaluation the model's (raw).
//
// The walk: tokens in chunks of up to kScoreTokenChunk, and for each chunk the classes in blocks of
// vocab_block rows of W (FusedHeadLossOptions' rule: about 2 % of V): logits [chunk, block] = h W^T
// (+ b) by the head's GEMM, then each row's softmax statistics updated online (the softmax core,
// detail/softmax.hpp, the same code and blocks as the fused loss) and its top-k candidates
// gathered (a comparison per logit against the running k-th value, a block skipped on its max,
// the candidates cut to the best k by a selection whenever they reach 2 k: no sort, no buffer of
// a block). Cost 2 N V d flops and one exponential per logit (two when T != 1 and the raw log-prob is
// asked for: raw and processed; raw_logprob = false leaves it out); memory chunk * vocab_block scalars (1 MiB at
// GPT-2's V = 50,257: 0.5 % of the logits of 1,024 tokens) plus 2 k entries a row.
//
// Batch invariance: every row's results depend on its own h row, W, b, the options and
// vocab_block only: on the default (packed) backend a token's scores are the same bits in any
// batch and on any number of threads, and equal the fused loss's: processed_logprob = -loss_n for
// T = 1 without label smoothing or z-loss (docs/threading.md, "Batch invariance"; tested).
// Statistics are summed in double over float (or double) blocks, as in the loss.
#ifndef EMBEDHEAD_HEAD_SCORES_HPP
#define EMBEDHEAD_HEAD_SCORES_HPP

#include "detail/checks.hpp"
#include "detail/softmax.hpp"
#include "errors.hpp"
#include "fused_head_loss.hpp"
#include "output_projection.hpp"
#include "token_ids.hpp"
#include "types.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <utility>
#include <vector>

namespace embedhead {

struct HeadScoreOptions {
  double temperature = 1.0;  // T, finite and > 0: processed = log_softmax(s / T)
  Index top_k = 0;           // k in [0, classes]: the top-k ids and processed log-probs of each row
  bool entropy = false;      // each row's entropy (of the processed distribution)
  double softcap = 0;        // c > 0: s = c tanh(z / c) (Gemma 2's final soft-capping, 30); 0: off
  Index valid_vocab = -1;    // classes are rows [0, valid_vocab) of W; -1: all V
  Index vocab_block = 0;     // rows of W per block; 0: the fused loss's choice (V / 50, see there)
  bool raw_logprob = true;   // with tokens: raw_logprob too (when T != 1, a second exponential per logit); false:
                             // processed_logprob only, raw_logprob left empty
};

// Per row n of h; each empty when not asked for (no tokens, top_k = 0, entropy off).
struct HeadScores {
  std::vector<double> raw_logprob;        // [N] log_softmax(s)_y of the given token y (unless raw_logprob off)
  std::vector<double> processed_logprob;  // [N] log_softmax(s / T)_y
  std::vector<double> entropy;            // [N] entropy of softmax(s / T), in nats
  IdMatrix<std::int64_t> top_ids;         // [N, k] the k largest classes, decreasing, ties to smaller ids
  RowMatrix<double> top_logprobs;         // [N, k] their processed log-probs
};

namespace detail {

// Tokens per chunk of the walk: the logits buffer is [chunk, vocab_block].
constexpr Index kScoreTokenChunk = 256;

// (value, id) ordered best first: larger value, then smaller id.
template <typename Scalar>
struct ScoreCandidate {
  Scalar value;
  std::int64_t id;
};
template <typename Scalar>
bool better(const ScoreCandidate<Scalar>& a, const ScoreCandidate<Scalar>& b) {
  return a.value > b.value || (a.value == b.value && a.id < b.id);
}

// A row's running top-k: kept, the candidates so far (unordered, fewer than 2 k), and once they
// have been cut to the best k, bound, the worst of those k. A value enters kept only if it beats
// bound (any value before the first cut, -inf included; NaN never); when kept reaches 2 k it is
// cut to its best k by a selection (nth_element, O(k)), so a row costs O(width) per block and
// O(k) memory, never a sort or a buffer of the block. Later ids are larger, so a value equal to
// bound never beats the kept one. The caller sorts kept and takes its first k at the end.
template <typename Scalar>
struct RowTopK {
  std::vector<ScoreCandidate<Scalar>> kept;
  Scalar bound = -std::numeric_limits<Scalar>::infinity();
  bool cut = false;

  // Offers the block s [width] of classes first_id .. first_id + width - 1.
  void offer(const Scalar* s, Index width, std::int64_t first_id, Index k) {
    const std::size_t limit = 2 * static_cast<std::size_t>(k);
    if (kept.capacity() < limit) kept.reserve(limit);
    // Once cut, a block, then a piece of 64 values, whose max does not beat bound adds nothing
    // (vectorised passes); only the pieces that may hold a candidate are compared value by value.
    using Values = Eigen::Map<const Eigen::Array<Scalar, Eigen::Dynamic, 1>>;
    if (cut && !(Values(s, width).maxCoeff() > bound)) return;
    constexpr Index kPiece = 64;
    for (Index j0 = 0; j0 < width; j0 += kPiece) {
      const Index j1 = std::min(width, j0 + kPiece);
      if (cut && !(Values(s + j0, j1 - j0).maxCoeff() > bound)) continue;
      for (Index j = j0; j < j1; ++j) {
        if (!(s[j] > bound || (!cut && s[j] == bound))) continue;
        kept.push_back({s[j], first_id + j});
        if (kept.size() == limit) {
          std::nth_element(kept.begin(), kept.begin() + (k - 1), kept.end(), better<Scalar>);
          kept.resize(static_cast<std::size_t>(k));
          bound = kept[static_cast<std::size_t>(k - 1)].value;
          cut = true;
        }
      }
    }
  }
};

}  // namespace detail

// h [N, d], W [V, d], bias [V, 1] or empty, tokens (N ids, int32 or int64, any shape and layout a
// TokenIds views, read row-major; or an empty view: no log-probs) -> HeadScores (above).
// \throws shape_error for any shape mismatch (tokens not N ids, bias not [V, 1]); index_error for a
// token outside [0, classes) (the first, with its (b, t)); value_error for a temperature that is
// not finite and > 0, top_k outside [0, classes], a negative or non-finite softcap, valid_vocab
// outside [1, V] (or -1), a negative vocab_block, and for a row whose log-sum-exp is not finite (a
// NaN or infinite logit from non-finite h, W or bias, or a row of -inf soft-capped logits), naming
// the row. Nothing is returned on a throw.
template <typename Scalar>
HeadScores score_head(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W,
                      const ConstMatrixRef<Scalar>& bias, TokenIds tokens, const HeadScoreOptions& options = {}) {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");
  const char* where = "score_head";
  const Index N = h.rows(), d = h.cols(), V = W.rows();
  if (W.cols() != d) detail::throw_shape(where, "W", W.rows(), W.cols(), V, d);
  if (bias.size() != 0 && (bias.rows() != V || bias.cols() != 1))
    detail::throw_shape(where, "bias", bias.rows(), bias.cols(), V, 1);
  const bool want_logprob = tokens.size() != 0;
  const bool want_raw = want_logprob && options.raw_logprob;
  if (want_logprob && tokens.size() != N) {
    std::ostringstream message;
    message << where << ": tokens has " << tokens.size() << " ids (" << tokens.rows() << " x " << tokens.cols()
            << "), expected N = " << N << " (or none)";
    throw shape_error(message.str());
  }
  if (options.valid_vocab != -1 && (options.valid_vocab < 1 || options.valid_vocab > V)) {
    std::ostringstream message;
    message << where << ": valid_vocab = " << options.valid_vocab << " outside [1, V = " << V << "] (or -1: all)";
    throw value_error(message.str());
  }
  const Index C = options.valid_vocab == -1 ? V : options.valid_vocab;
  detail::check_positive(where, "temperature", options.temperature);
  detail::check_positive(where, "temperature (as the Scalar type)",
                         static_cast<double>(static_cast<Scalar>(options.temperature)));
  if (!(options.softcap >= 0) || !std::isfinite(options.softcap)) {
    std::ostringstream message;
    message << where << ": softcap = " << options.softcap << " outside [0, inf)";
    throw value_error(message.str());
  }
  if (options.top_k < 0 || options.top_k > C) {
    std::ostringstream message;
    message << where << ": top_k = " << options.top_k << " outside [0, classes = " << C << "]";
    throw value_error(message.str());
  }
  if (options.vocab_block < 0) {
    std::ostringstream message;
    message << where << ": vocab_block = " << options.vocab_block << " outside [0, inf)";
    throw value_error(message.str());
  }
  std::vector<std::int64_t> y;
  if (want_logprob) {
    tokens.visit([&](const auto& typed) { detail::check_ids(where, typed, C, "token"); });
    y.resize(static_cast<std::size_t>(N));
    for (Index n = 0; n < N; ++n) y[static_cast<std::size_t>(n)] = static_cast<std::int64_t>(tokens.at(n));
  }

  const Index k = options.top_k;
  const bool tempered = options.temperature != 1.0;
  const Scalar T = static_cast<Scalar>(options.temperature), cap = static_cast<Scalar>(options.softcap);
  detail::SoftmaxTerms terms;
  terms.classes = C;
  terms.entropy = options.entropy;
  detail::SoftmaxTerms raw_terms;
  raw_terms.classes = C;

  const Index block = detail::fused_vocab_block(options.vocab_block, C);
  const Index chunk = std::min(N, detail::kScoreTokenChunk);
  std::vector<detail::SoftmaxRowStats> processed(static_cast<std::size_t>(N)), raw;
  if (tempered && want_raw) raw.resize(static_cast<std::size_t>(N));
  std::vector<detail::RowTopK<Scalar>> top(k > 0 ? static_cast<std::size_t>(N) : 0);
  RowMatrix<Scalar> logits(std::max<Index>(chunk, 1), block);
  const RowMatrix<Scalar> no_bias(0, 1);

  for (Index n0 = 0; n0 < N; n0 += chunk) {
    const Index rows = std::min(chunk, N - n0);
    for (Index v0 = 0; v0 < C; v0 += block) {
      const Index width = std::min(block, C - v0);
      Eigen::Map<RowMatrix<Scalar>, 0, Eigen::OuterStride<>> z(logits.data(), rows, width, Eigen::OuterStride<>(block));
      detail::head_forward_chunked<Scalar>(h.middleRows(n0, rows), W.middleRows(v0, width),
                                           bias.size() != 0 ? ConstMatrixRef<Scalar>(bias.middleRows(v0, width))
                                                            : ConstMatrixRef<Scalar>(no_bias),
                                           z, detail::gemm::per_thread_columns<Scalar>(width, detail::kFusedRowPiece));
      detail::parallel_rows(rows, [&](Index r) {
        const Index n = n0 + r;
        Scalar* s = logits.data() + r * block;
        if (options.softcap > 0) detail::softcap_row(s, s, width, cap);
        const Index target = want_logprob ? static_cast<Index>(y[static_cast<std::size_t>(n)]) - v0 : -1;
        if (tempered) {
          if (want_raw) raw[static_cast<std::size_t>(n)].accumulate(s, width, target, raw_terms);
          detail::map_lanes(s, s, width, [T](const detail::SoftmaxLanes<Scalar>& x) -> detail::SoftmaxLanes<Scalar> {
            return x / T;
          });
        }
        processed[static_cast<std::size_t>(n)].accumulate(s, width, target, terms);
        if (k > 0) top[static_cast<std::size_t>(n)].offer(s, width, v0, k);
      });
    }
  }

  HeadScores result;
  for (Index n = 0; n < N; ++n) {
    const detail::SoftmaxRowStats& st = processed[static_cast<std::size_t>(n)];
    const double lse = st.max + std::log(st.sum_exp);
    if (!std::isfinite(lse)) {
      std::ostringstream message;
      message << where << ": row n=" << n << " has log-sum-exp " << lse
              << " (not finite: a NaN or infinite logit from non-finite h, W or bias, or every class -inf)";
      throw value_error(message.str());
    }
  }
  if (want_logprob) {
    result.processed_logprob.resize(static_cast<std::size_t>(N));
    if (want_raw) result.raw_logprob.resize(static_cast<std::size_t>(N));
    for (Index n = 0; n < N; ++n) {
      const std::size_t i = static_cast<std::size_t>(n);
      const detail::SoftmaxRowStats& st = processed[i];
      // (s_y - m) - log S: the negated cross-entropy of the softmax core's row_loss, bit for bit
      // (m - s_y exact, nothing of lse's size subtracted).
      result.processed_logprob[i] = (st.target - st.max) - std::log(st.sum_exp);
      if (!want_raw) continue;
      const detail::SoftmaxRowStats& rs = tempered ? raw[i] : st;
      result.raw_logprob[i] = (rs.target - rs.max) - std::log(rs.sum_exp);
    }
  }
  if (options.entropy) {
    result.entropy.resize(static_cast<std::size_t>(N));
    for (Index n = 0; n < N; ++n)
      result.entropy[static_cast<std::size_t>(n)] = detail::row_entropy(processed[static_cast<std::size_t>(n)]);
  }
  if (k > 0) {
    result.top_ids.resize(N, k);
    result.top_logprobs.resize(N, k);
    for (Index n = 0; n < N; ++n) {
      auto& kept = top[static_cast<std::size_t>(n)].kept;
      std::sort(kept.begin(), kept.end(), detail::better<Scalar>);
      const detail::SoftmaxRowStats& st = processed[static_cast<std::size_t>(n)];
      const double log_sum = std::log(st.sum_exp);
      for (Index j = 0; j < k; ++j) {
        result.top_ids(n, j) = kept[static_cast<std::size_t>(j)].id;
        result.top_logprobs(n, j) = (static_cast<double>(kept[static_cast<std::size_t>(j)].value) - st.max) - log_sum;
      }
    }
  }
  return result;
}

}  // namespace embedhead

#endif  // EMBEDHEAD_HEAD_SCORES_HPP
