// embedhead: how far one LM head's output distribution is from another's on the same hidden
// states -- the accuracy figure to put beside a quantized head's speed figure. For each token n,
// with P = softmax(logits of head A), Q = softmax(logits of head B) over V classes:
//
//   KL(P || Q)   = sum_v P_v (log P_v - log Q_v)        (in nats; A is the reference)
//   same top-1   argmax P == argmax Q                    (ties to the smaller id)
//   |delta p|    = |P_a - Q_a| at a = argmax P           (the reference's top token)
//
// reported as means over the tokens and maxima. The logits are computed a chunk of tokens at a
// time into a [chunk, V] buffer per head and reduced at once, so nothing of size N*V is kept
// (llama.cpp's perplexity tool measures the same KL through a saved file of reference logits).
// Log-softmax in double from the float logits.
#ifndef EMBEDHEAD_ANALYSIS_HEAD_COMPARISON_HPP
#define EMBEDHEAD_ANALYSIS_HEAD_COMPARISON_HPP

#include "../detail/checks.hpp"
#include "../errors.hpp"
#include "../types.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

namespace embedhead {

struct HeadComparison {
  Index tokens = 0;
  double mean_kl = 0, max_kl = 0;                  // KL(P || Q), nats
  double same_top1 = 0;                            // fraction of tokens whose argmax agrees
  double mean_abs_dp_top = 0, max_abs_dp_top = 0;  // |P_a - Q_a| at the reference's top token a
};

// h float [N, d]; head_a and head_b callables (const ConstMatrixRef<float>& h_chunk [n, d],
// MatrixRef<float> logits [n, V]) -> void, e.g. [&](auto& x, auto out) { head.forward(x, out); };
// V the number of classes both produce; chunk tokens per call (>= 1; 8 keeps both heads on their
// decode paths). -> HeadComparison over the N tokens.
// \throws value_error for V or chunk < 1, or a row whose logits are not all finite (naming the
// head and the token); whatever the heads throw.
template <typename HeadA, typename HeadB>
HeadComparison compare_heads(const ConstMatrixRef<float>& h, Index V, const HeadA& head_a, const HeadB& head_b,
                             Index chunk = 8) {
  const char* where = "compare_heads";
  detail::check_size(where, "V", V);
  detail::check_size(where, "chunk", chunk);
  const Index N = h.rows();
  RowMatrix<float> za(std::min(chunk, std::max<Index>(N, 1)), V), zb(za.rows(), V);
  HeadComparison out;
  out.tokens = N;
  double kl_sum = 0, dp_sum = 0;
  Index same = 0;
  for (Index n0 = 0; n0 < N; n0 += chunk) {
    const Index rows = std::min(chunk, N - n0);
    auto a = za.topRows(rows);
    auto b = zb.topRows(rows);
    head_a(h.middleRows(n0, rows), a);
    head_b(h.middleRows(n0, rows), b);
    for (Index r = 0; r < rows; ++r) {
      const auto check_row = [&](const auto& row, const char* name) {
        if (!row.allFinite()) {
          std::ostringstream message;
          message << where << ": head " << name << " gave a non-finite logit for token n=" << n0 + r;
          throw value_error(message.str());
        }
      };
      check_row(a.row(r), "a");
      check_row(b.row(r), "b");
      // log-softmax in double; argmax with ties to the smaller id.
      Index top_a = 0, top_b = 0;
      double ma = -std::numeric_limits<double>::infinity(), mb = ma;
      for (Index v = 0; v < V; ++v) {
        if (a(r, v) > ma) ma = a(r, v), top_a = v;
        if (b(r, v) > mb) mb = b(r, v), top_b = v;
      }
      double sa = 0, sb = 0;
      for (Index v = 0; v < V; ++v) {
        sa += std::exp(static_cast<double>(a(r, v)) - ma);
        sb += std::exp(static_cast<double>(b(r, v)) - mb);
      }
      const double lsa = ma + std::log(sa), lsb = mb + std::log(sb);
      double kl = 0;
      for (Index v = 0; v < V; ++v) {
        const double la = static_cast<double>(a(r, v)) - lsa, lb = static_cast<double>(b(r, v)) - lsb;
        kl += std::exp(la) * (la - lb);
      }
      kl = std::max(kl, 0.0);  // rounding can leave a tiny negative value for equal distributions
      const double dp = std::abs(std::exp(static_cast<double>(a(r, top_a)) - lsa) -
                                 std::exp(static_cast<double>(b(r, top_a)) - lsb));
      kl_sum += kl;
      dp_sum += dp;
      out.max_kl = std::max(out.max_kl, kl);
      out.max_abs_dp_top = std::max(out.max_abs_dp_top, dp);
      same += top_a == top_b;
    }
  }
  if (N > 0) {
    out.mean_kl = kl_sum / static_cast<double>(N);
    out.mean_abs_dp_top = dp_sum / static_cast<double>(N);
    out.same_top1 = static_cast<double>(same) / static_cast<double>(N);
  }
  return out;
}

}  // namespace embedhead

#endif  // EMBEDHEAD_ANALYSIS_HEAD_COMPARISON_HPP
