// embedhead: the sampling chain on logits rows, greedy decoding, and speculative verification.
//
// A row z [V] of logits (from the decode path or a scored block) goes through a chain of steps,
// each one Hugging Face's logits processor or warper of the same name (transformers,
// generation/logits_process.py), in the order the caller states:
//
//   logit_bias          z_id += bias for each (id, bias) pair                 (HF SequenceBias, 1-token)
//   repetition_penalty  for each DISTINCT id in the row's history:            (HF RepetitionPenalty;
//                         z_id > 0 ? z_id / penalty : z_id * penalty           Keskar et al. 2019)
//   frequency_presence  z_id -= frequency_penalty * c_id                      (OpenAI / vLLM; c_id =
//                              + presence_penalty * [c_id > 0]                 count of id in history)
//   banned_ids          z_id = -inf for each banned id                        (HF NoBadWords, 1-token)
//   allowed_ids         z_j = -inf for every j outside the allowed set        (HF PrefixConstrained)
//   temperature         z_j = z_j / T                                         (HF Temperature)
//   top_k               keep z_j >= the k-th largest value (ties at the       (HF TopK)
//                         k-th value all kept); k_eff = max(k, min_keep)
//   top_p               p = softmax(z); order the tokens by z descending, id  (HF TopP; Holtzman et
//                         ascending; keep token number r (from 1) iff the      al. 2019, nucleus)
//                         mass of the r - 1 before it is < top_p, i.e. the
//                         smallest prefix whose mass is >= top_p; at least
//                         min_keep tokens
//   min_p               keep p_j >= min_p * max_j p_j (at least the min_keep  (HF MinP; Nguyen et
//                         best)                                                al. 2024)
//   typical_p           lp = log_softmax(z), H = -sum p lp (terms with p = 0  (HF Typical; Meister
//                         skipped), s_j = | -lp_j - H |; order by s ascending, et al. 2022)
//                         id ascending; let s* = s of the first token at which
//                         the running mass reaches typical_p (the last token
//                         if it never does); keep s_j <= s* (ties kept), and
//                         the first min_keep in that order
//
// Removed tokens get -inf and are never sampled. The default order (hf_sampling_order()) is the
// one Hugging Face's generate() builds in GenerationMixin._get_logits_processor: processors first
// -- SequenceBias, RepetitionPenalty, NoBadWords, PrefixConstrained (the logits processors this
// header has; HF's others, e.g. n-gram blocking and minimum length, are not here) -- then, when
// sampling, the warpers Temperature, TopK, TopP, MinP, Typical. HF has no frequency / presence
// penalty; it goes right after the repetition penalty, on (nearly) raw logits, as vLLM applies
// repetition, frequency and presence penalties one after the other. With HF's generate, top_p = 1
// and typical_p = 1 add no warper; here they are accepted and change nothing.
//
// Two kinds of log-probabilities, named apart:
//   raw log-probs        log_softmax of the logits as given, before any step (what the model says;
//                        what RL trainers and evaluators score). raw_log_probs().
//   processed log-probs  log_softmax of the logits after the whole chain (the distribution the
//                        sampler draws from; -inf at removed tokens). processed_log_probs().
// sample_tokens() returns both for each sampled token.
//
// Sampling is Gumbel-max (Gumbel 1954; the "Gumbel-max trick"): token = argmax_j (z_j + g_j) over
// the surviving tokens, g_j = -log(-log u_j), which picks j with probability softmax(z)_j exactly.
// u_j comes from the counter-based Rng (init.hpp): draw number i of a stream uses
//   u_j = rng.uniform_at(i * V + j)      for each surviving id j (counters [i V, i V + V))
// so a draw is a function of (seed, i, the processed row) only: not of the thread count, the
// batch it is in or its row in it. Only surviving ids are evaluated, so after top-k a draw costs k
// uniforms, not V. The two logs run in Eigen's vectorised log, 16 values at a time through the
// same packet code wherever they are (detail/softmax.hpp's map_lanes); a build for another SIMD
// instruction set may round them differently in the last bit. Each row of a call names its own
// draw index (the caller keeps one per sequence, e.g. its number of generated tokens). Ties of
// z_j + g_j go to the smaller id.
// Greedy: argmax_j z_j, ties to the smaller id (greedy_tokens, on raw or processed logits).
//
// Speculative verification (Leviathan et al. 2023, "Fast Inference from Transformers via
// Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with
// Speculative Sampling"): a draft x_0 .. x_{k-1} with the draft model's rows q [k, V] and the
// target's p [k + 1, V] (both after their chains, rows summing to 1). For t = 0, 1, ...:
//   accept x_t with probability min(1, p_t(x_t) / q_t(x_t))   (u_t < p_t(x_t) / q_t(x_t));
//   at the first rejection emit a token from r = normalize(max(0, p_t - q_t)) and stop;
//   if all k are accepted emit a bonus token from p_k.
// The emitted tokens (accepted + 1 of them) are distributed exactly as the target's own next
// tokens would be: each is a draw from p_t given the tokens before it (the correctness proofs of
// both papers). Draws: u_t = rng.uniform_at(c + t) for the test of x_t, and the emitted token by
// inverse CDF over ids in increasing order from u = rng.uniform_at(c + k), where c is the
// caller's counter.
//
// Cost (one row of V logits, K surviving tokens before a step): bias, penalties and the banned list
// O(their lengths) (history sorted: O(L log L)); the allowed set and temperature O(V); top-k O(K):
// a min-heap of the k largest values seen when k <= K / 64 (one comparison per value once full,
// about k ln(K / k) insertions), else std::nth_element on a copy; top-p, min-p and typical: one
// vectorised exp pass over the survivors (the softmax core's sum_exp_shifted), then, for top-p and
// typical, a selection of the mass prefix by repeated halving -- nth_element on the undecided
// range, its mass summed, one half decided -- O(K) expected in all, with a std::sort of at most 16
// tokens at the end; above 8192 tokens the halving runs only in the one of 2048 equal-width buckets
// of the keys that holds the cut, found by one pass summing each bucket's mass (up to 8192 tokens
// top-p first drops the tokens below (1 - top_p) / K of the mass, which are all in its removed
// tail), and the prefix is then known by its last token, so one comparison per token removes the
// rest. Nothing sorts V (or K) entries. The survivors are kept as a list once found (no step
// revives a removed token), so steps after a cut cost O(K), not O(V); while the survivors are most
// of the row, the passes run over the whole row instead (contiguous and vectorised, no index loads;
// the same removals, and a sum of exponentials that may differ from the packed one in its last bit:
// deterministic either way, the path depending on the row only). Which tokens go is decided without
// a branch (the pattern is data-dependent). The chain runs in double; processed logits are rounded
// once to Scalar. Sampling: O(K') for K' survivors. Scratch: a workspace per thread (thread_local),
// grown to the largest V seen and kept for the thread's life (about 9 V doubles: 18 MB at V =
// 256,000), so calls allocate only their results and O(N) bookkeeping once it has grown. Rows are
// processed one after another on the calling thread (no threading), so results cannot depend on a
// thread count.
#ifndef EMBEDHEAD_SAMPLING_HPP
#define EMBEDHEAD_SAMPLING_HPP

#include "detail/checks.hpp"
#include "detail/softmax.hpp"
#include "errors.hpp"
#include "init.hpp"
#include "token_ids.hpp"
#include "types.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace embedhead {

// The steps of the chain (see the top of this header).
enum class SamplingStep {
  logit_bias,
  repetition_penalty,
  frequency_presence_penalty,
  banned_ids,
  allowed_ids,
  temperature,
  top_k,
  top_p,
  min_p,
  typical_p,
};

// Hugging Face's order (GenerationMixin._get_logits_processor), with the frequency / presence
// penalty after the repetition penalty: logit_bias, repetition_penalty,
// frequency_presence_penalty, banned_ids, allowed_ids, temperature, top_k, top_p, min_p, typical_p.
inline std::vector<SamplingStep> hf_sampling_order() {
  return {SamplingStep::logit_bias,
          SamplingStep::repetition_penalty,
          SamplingStep::frequency_presence_penalty,
          SamplingStep::banned_ids,
          SamplingStep::allowed_ids,
          SamplingStep::temperature,
          SamplingStep::top_k,
          SamplingStep::top_p,
          SamplingStep::min_p,
          SamplingStep::typical_p};
}

// The chain's settings. A step is active when its setting differs from the "off" value given; an
// active step must appear in `order` (value_error otherwise), no step twice; listed steps that are
// off are skipped.
struct SamplingOptions {
  std::vector<std::pair<Index, double>> logit_bias;  // (id, bias): id in [0, V), bias finite; off when empty
  double repetition_penalty = 1.0;                   // > 0, finite; 1 = off
  double frequency_penalty = 0.0;                    // finite (either sign); 0 = off
  double presence_penalty = 0.0;                     // finite (either sign); 0 = off
  std::vector<Index> banned_ids;                     // ids in [0, V); off when empty
  std::optional<std::vector<Index>> allowed_ids;     // ids in [0, V); off when absent (empty = nothing allowed)
  double temperature = 1.0;                          // > 0, finite; 1 = off
  std::optional<Index> top_k;                        // [1, V]
  std::optional<double> top_p;                       // (0, 1]
  std::optional<double> min_p;                       // (0, 1]
  std::optional<double> typical_p;                   // (0, 1]
  Index min_tokens_to_keep = 1;                      // >= 1: what top-k/p, min-p and typical keep at least
  std::vector<SamplingStep> order = hf_sampling_order();
};

// Per row: the sampled (or chosen) token and its log-probabilities under the raw and the processed
// distribution (the latter is finite: a sampled token survived the chain).
struct SampledTokens {
  std::vector<Index> tokens;
  std::vector<double> raw_log_probs;
  std::vector<double> processed_log_probs;
};

// The outcome of verify_draft: how many draft tokens were accepted (0 .. k), and the emitted
// tokens: the accepted ones followed by one more (the resampled token, or the bonus token when all
// k were accepted), accepted + 1 tokens in all.
struct DraftVerification {
  Index accepted = 0;
  std::vector<Index> tokens;
};

// verify_draft's tolerance on a row's sum: |sum - 1| <= kProbabilityRowTolerance.
inline constexpr double kProbabilityRowTolerance = 1e-3;

namespace detail {

inline const char* sampling_step_name(SamplingStep step) {
  switch (step) {
    case SamplingStep::logit_bias: return "logit_bias";
    case SamplingStep::repetition_penalty: return "repetition_penalty";
    case SamplingStep::frequency_presence_penalty: return "frequency_presence_penalty";
    case SamplingStep::banned_ids: return "banned_ids";
    case SamplingStep::allowed_ids: return "allowed_ids";
    case SamplingStep::temperature: return "temperature";
    case SamplingStep::top_k: return "top_k";
    case SamplingStep::top_p: return "top_p";
    case SamplingStep::min_p: return "min_p";
    case SamplingStep::typical_p: return "typical_p";
  }
  return "unknown";
}

inline bool sampling_step_active(const SamplingOptions& o, SamplingStep step) {
  switch (step) {
    case SamplingStep::logit_bias: return !o.logit_bias.empty();
    case SamplingStep::repetition_penalty: return o.repetition_penalty != 1.0;
    case SamplingStep::frequency_presence_penalty: return o.frequency_penalty != 0.0 || o.presence_penalty != 0.0;
    case SamplingStep::banned_ids: return !o.banned_ids.empty();
    case SamplingStep::allowed_ids: return o.allowed_ids.has_value();
    case SamplingStep::temperature: return o.temperature != 1.0;
    case SamplingStep::top_k: return o.top_k.has_value();
    case SamplingStep::top_p: return o.top_p.has_value();
    case SamplingStep::min_p: return o.min_p.has_value();
    case SamplingStep::typical_p: return o.typical_p.has_value();
  }
  return false;
}

[[noreturn]] inline void throw_value(const std::string& message) { throw value_error(message); }

inline void check_open_unit(const char* where, const char* what, double v) {
  if (!(v > 0.0 && v <= 1.0)) {
    std::ostringstream m;
    m << where << ": " << what << " = " << v << " outside (0, 1]";
    throw_value(m.str());
  }
}

inline void check_finite_option(const char* where, const char* what, double v) {
  if (!std::isfinite(v)) {
    std::ostringstream m;
    m << where << ": " << what << " = " << v << " outside the finite numbers";
    throw_value(m.str());
  }
}

inline void check_vocab_id(const char* where, const char* what, Index id, Index position, Index V) {
  if (id < 0 || id >= V) {
    std::ostringstream m;
    m << where << ": " << what << " " << id << " at " << position << " outside [0, " << V << ")";
    throw index_error(m.str());
  }
}

// Every option against V; every history row's ids against V.
inline void check_sampling_options(const char* where, const SamplingOptions& o, Index V) {
  std::vector<char> listed(10, 0);
  for (const SamplingStep step : o.order) {
    const int s = static_cast<int>(step);
    if (s < 0 || s >= 10) throw_value(std::string(where) + ": order holds an unknown step");
    if (listed[static_cast<std::size_t>(s)]) {
      throw_value(std::string(where) + ": step " + sampling_step_name(step) +
                  " appears twice in order (each step at most once)");
    }
    listed[static_cast<std::size_t>(s)] = 1;
  }
  for (int s = 0; s < 10; ++s) {
    const auto step = static_cast<SamplingStep>(s);
    if (sampling_step_active(o, step) && !listed[static_cast<std::size_t>(s)]) {
      throw_value(std::string(where) + ": step " + sampling_step_name(step) +
                  " is set but not in order (list every step that is set)");
    }
  }
  for (std::size_t i = 0; i < o.logit_bias.size(); ++i) {
    check_vocab_id(where, "logit_bias id", o.logit_bias[i].first, static_cast<Index>(i), V);
    if (!std::isfinite(o.logit_bias[i].second)) {
      std::ostringstream m;
      m << where << ": logit_bias " << o.logit_bias[i].second << " for id " << o.logit_bias[i].first << " at " << i
        << " outside the finite numbers (ban an id with banned_ids)";
      throw_value(m.str());
    }
  }
  if (!(o.repetition_penalty > 0.0) || !std::isfinite(o.repetition_penalty)) {
    std::ostringstream m;
    m << where << ": repetition_penalty = " << o.repetition_penalty << " outside (0, inf)";
    throw_value(m.str());
  }
  check_finite_option(where, "frequency_penalty", o.frequency_penalty);
  check_finite_option(where, "presence_penalty", o.presence_penalty);
  for (std::size_t i = 0; i < o.banned_ids.size(); ++i)
    check_vocab_id(where, "banned id", o.banned_ids[i], static_cast<Index>(i), V);
  if (o.allowed_ids)
    for (std::size_t i = 0; i < o.allowed_ids->size(); ++i)
      check_vocab_id(where, "allowed id", (*o.allowed_ids)[i], static_cast<Index>(i), V);
  if (!(o.temperature > 0.0) || !std::isfinite(o.temperature)) {
    std::ostringstream m;
    m << where << ": temperature = " << o.temperature << " outside (0, inf) (greedy decoding: greedy_tokens)";
    throw_value(m.str());
  }
  if (o.top_k) check_range(where, "top_k", *o.top_k, 1, V);
  if (o.top_p) check_open_unit(where, "top_p", *o.top_p);
  if (o.min_p) check_open_unit(where, "min_p", *o.min_p);
  if (o.typical_p) check_open_unit(where, "typical_p", *o.typical_p);
  check_range(where, "min_tokens_to_keep", o.min_tokens_to_keep, 1, V);
}

inline void check_history(const char* where, const std::vector<TokenIds>& history, Index N, Index V) {
  if (history.empty()) return;
  if (static_cast<Index>(history.size()) != N) {
    std::ostringstream m;
    m << where << ": history has " << history.size() << " rows, expected " << N << " (one per logits row) or 0";
    throw shape_error(m.str());
  }
  for (Index n = 0; n < N; ++n) {
    const TokenIds& h = history[static_cast<std::size_t>(n)];
    for (Index t = 0; t < h.size(); ++t) {
      const Index id = h.at(t);
      if (id < 0 || id >= V) {
        std::ostringstream m;
        m << where << ": history id " << id << " at (row " << n << ", " << t << ") outside [0, " << V << ")";
        throw index_error(m.str());
      }
    }
  }
}

// Logits may be finite or -inf (masked); NaN and +inf are value_errors, and so is a row whose
// entries are all -inf.
template <typename Scalar>
void check_logits_rows(const char* where, const ConstMatrixRef<Scalar>& logits, const char* what = "logit") {
  const Index N = logits.rows(), V = logits.cols();
  for (Index n = 0; n < N; ++n) {
    bool any = false;
    for (Index j = 0; j < V; ++j) {
      const Scalar z = logits(n, j);
      if (std::isnan(z) || z == std::numeric_limits<Scalar>::infinity()) {
        std::ostringstream m;
        m << where << ": " << what << " " << z << " at (row " << n << ", column " << j
          << ") outside [-inf, inf) (finite, or -inf for a masked token)";
        throw value_error(m.str());
      }
      any = any || z > -std::numeric_limits<Scalar>::infinity();
    }
    if (!any) {
      std::ostringstream m;
      m << where << ": every entry of row " << n << " is -inf (masked): nothing to sample from";
      throw value_error(m.str());
    }
  }
}

inline constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// A token in a step's order: key ascending, then id ascending (a strict total order), with its
// weight (probability mass). Packed together so that selection moves contiguous records.
struct Ranked {
  double key;
  Index id;
  double weight;
};
struct RankedBefore {  // a function object, so that std::nth_element inlines it
  bool operator()(const Ranked& a, const Ranked& b) const { return a.key < b.key || (a.key == b.key && a.id < b.id); }
};
inline constexpr RankedBefore ranked_before{};

// The smallest prefix, in ranked_before order, of a [n] whose weights sum to >= target, by
// halving: rearranges a so that its first c entries are that prefix (in no particular order,
// except the last <= 16, decided by sorting) and returns c (n when the whole set falls short).
// nth_element on the undecided range [lo, hi); the mass of its better half decides which half holds
// the cut. O(n) expected; nothing sorts more than 16 entries.
inline Index select_mass_prefix_halving(Ranked* a, Index n, double target) {
  Index lo = 0, hi = n;
  double acc = 0.0;  // mass of a[0 .. lo), all in the prefix
  while (hi - lo > 16) {
    const Index mid = lo + (hi - lo) / 2;
    std::nth_element(a + lo, a + mid, a + hi, ranked_before);
    double left = 0.0;
    for (Index i = lo; i < mid; ++i) left += a[i].weight;
    if (acc + left >= target) {
      hi = mid;  // the cut is inside [lo, mid): [mid, hi) is after it
    } else {
      acc += left;
      lo = mid;
    }
  }
  std::sort(a + lo, a + hi, ranked_before);
  for (Index i = lo; i < hi; ++i) {
    acc += a[i].weight;
    if (acc >= target) return i + 1;
  }
  return hi;
}

// Moves the keep - c best of a[c .. n) (ranked_before) to a[c .. keep), when c < keep <= n; returns
// max(c, keep).
inline Index keep_at_least(Ranked* a, Index n, Index c, Index keep) {
  if (c >= keep) return c;
  std::nth_element(a + c, a + (keep - 1), a + n, ranked_before);
  return keep;
}

// The working state of one row: z [V] in double and scratch reused across rows.
struct SamplingRow {
  std::vector<double> z;
  std::vector<double> w;     // per-id weights (exp) of the current step
  std::vector<double> s;     // per-id typical scores |-log p - H|
  std::vector<double> vals;  // top-k's copy of the survivors' values; the Gumbel noise
  std::vector<Index> cand, ids;
  std::vector<Ranked> ranked;
  std::vector<char> mark;
  std::vector<double> packed;           // z (then exp) of the candidates, packed
  std::vector<std::int32_t> bucket_of;  // and its bucket
  std::vector<double> bucket_mass;
  std::vector<Index> bucket_count;
  double raw_lse = 0.0;     // log-sum-exp of the row as loaded, before the chain
  bool cand_valid = false;  // cand holds every survivor (and maybe some removed since)

  // cand <- the ids with z > -inf, in increasing order. No step turns -inf into a value, so once
  // cand is valid and short a later call filters it (O(K)) instead of scanning the row (O(V));
  // while it holds most of the row, scanning z (contiguous, no index loads) is the faster.
  void candidates() {
    // Branch-free compaction: survival is data-dependent and a branch on it mispredicts.
    std::size_t k = 0;
    if (cand_valid && 2 * cand.size() <= z.size()) {  // few survivors: filter the list (O(K))
      for (const Index j : cand) {
        cand[k] = j;
        k += z[static_cast<std::size_t>(j)] > kNegInf ? 1 : 0;
      }
    } else {
      cand.resize(z.size());
      for (std::size_t j = 0; j < z.size(); ++j) {
        cand[k] = static_cast<Index>(j);
        k += z[j] > kNegInf ? 1 : 0;
      }
      cand_valid = true;
    }
    cand.resize(k);
  }
  // Over the candidates (call candidates() first): m = max z_j, w_j = exp(z_j - m), by the
  // softmax core's vectorised pass (detail/softmax.hpp) on the packed values; returns
  // S = sum_j w_j, and m in *max. w is left stale at removed ids. While the candidates are most
  // of the row the pass runs on the whole of z instead (no packing; a removed id adds
  // exp(-inf) = 0 and gets w = 0).
  double exp_weights(double* max = nullptr) {
    const Index K = static_cast<Index>(cand.size());
    if (2 * cand.size() > z.size()) {
      const Index V = static_cast<Index>(z.size());
      const double m = row_max(z.data(), V);
      if (max) *max = m;
      return sum_exp_shifted(z.data(), V, m, w.data());
    }
    packed.resize(static_cast<std::size_t>(K));
    for (Index i = 0; i < K; ++i) packed[static_cast<std::size_t>(i)] = z[static_cast<std::size_t>(cand[i])];
    const double m = row_max(packed.data(), K);
    if (max) *max = m;
    const double S = sum_exp_shifted(packed.data(), K, m, packed.data());
    for (Index i = 0; i < K; ++i) w[static_cast<std::size_t>(cand[i])] = packed[static_cast<std::size_t>(i)];
    return S;
  }
  // ranked [K] <- (key(j), j, weight(j)) for the candidates j.
  template <typename Key, typename Weight>
  void rank(const Key& key, const Weight& weight) {
    ranked.resize(cand.size());
    for (std::size_t i = 0; i < cand.size(); ++i) ranked[i] = Ranked{key(cand[i]), cand[i], weight(cand[i])};
  }
  // z_j = -inf for the candidates j with remove(j, z_j). When most of the row survives, every
  // entry of z is visited instead (a removed entry stays -inf whatever remove says), one
  // contiguous, vectorisable pass with no index loads; the result is the same.
  template <typename Remove>
  void remove_if(const Remove& remove) {
    if (2 * cand.size() > z.size()) {
      double* const zz = z.data();
      const Index V = static_cast<Index>(z.size());
      for (Index j = 0; j < V; ++j) zz[j] = remove(j, zz[j]) ? kNegInf : zz[j];
    } else {
      for (const Index j : cand) {
        double& v = z[static_cast<std::size_t>(j)];
        v = remove(j, v) ? kNegInf : v;
      }
    }
  }
  // z = -inf for the ids of ranked[from ...].
  void remove_ranked_from(Index from) {
    for (std::size_t i = static_cast<std::size_t>(from); i < ranked.size(); ++i)
      z[static_cast<std::size_t>(ranked[i].id)] = kNegInf;
  }
};

// Up to this many candidates mass_prefix runs the halving on them all; above, on one bucket.
inline constexpr Index kMassPrefixHalving = 8192;

// The smallest prefix of the candidates in (key, id) order (ranked_before) whose weights sum to
// >= target, as its last token `mass_last`, then widened to the first `keep` tokens: `last`. The
// prefix is every token up to its last one, so the caller removes the tokens after it (top-p) or
// those whose key exceeds mass_last's (typical). cut is false when nothing is removed (the prefix
// is every candidate, or keep >= their count).
// Above kMassPrefixHalving candidates, the keys' range [lo, hi] (the caller's: every key is >= lo,
// and the prefix ends at a key <= hi) is cut into kBuckets - 1 equal buckets, the keys above hi
// going to one more: bucket(key) = floor((key - lo) / (hi - lo) * (kBuckets - 1)), monotone in the
// key, so every token of a lower bucket comes before every token of a higher one. One pass computes
// each candidate's bucket and sums each bucket's mass, the bucket where the running mass reaches
// target holds the cut, and the halving runs on that bucket's tokens alone, gathered by a second
// pass. O(n); nothing sorts more than 16 tokens, nothing moves the other tokens.
struct PrefixCut {
  bool cut = false;
  Ranked mass_last{}, last{};
};

template <typename Key, typename Weight>
PrefixCut mass_prefix(SamplingRow& row, const Key& key, const Weight& weight, double target, Index keep, double lo,
                      double hi) {
  constexpr Index kBuckets = 2048;
  const std::vector<Index>& cand = row.cand;
  const Index n = static_cast<Index>(cand.size());
  PrefixCut result;
  Index c = 0;  // the mass prefix's size
  bool found = false;
  const double scale = static_cast<double>(kBuckets - 1) / (hi - lo);
  if (n > kMassPrefixHalving && hi > lo && std::isfinite(scale)) {
    // Each bucket's mass and count, summed in kWays interleaved copies (token i into copy i %
    // kWays, then the copies added in order): consecutive tokens of one bucket then do not wait on
    // each other's store.
    constexpr Index kWays = 4;
    row.bucket_of.resize(static_cast<std::size_t>(n));
    row.bucket_mass.assign(static_cast<std::size_t>(kWays * kBuckets), 0.0);
    row.bucket_count.assign(static_cast<std::size_t>(kWays * kBuckets), 0);
    for (Index i = 0; i < n; ++i) {
      const Index j = cand[static_cast<std::size_t>(i)];
      const double k = key(j);
      const Index within = std::clamp<Index>(static_cast<Index>((k - lo) * scale), 0, kBuckets - 2);
      const auto b = static_cast<std::int32_t>(k > hi ? kBuckets - 1 : within);
      row.bucket_of[static_cast<std::size_t>(i)] = b;
      const std::size_t slot = static_cast<std::size_t>((i % kWays) * kBuckets + b);
      row.bucket_mass[slot] += weight(j);
      ++row.bucket_count[slot];
    }
    double acc = 0.0;         // the mass of the buckets below b
    Index b = 0, before = 0;  // and their count of tokens
    for (; b < kBuckets; ++b) {
      double mass = 0.0;
      Index count = 0;
      for (Index way = 0; way < kWays; ++way) {
        mass += row.bucket_mass[static_cast<std::size_t>(way * kBuckets + b)];
        count += row.bucket_count[static_cast<std::size_t>(way * kBuckets + b)];
      }
      if (acc + mass >= target) break;
      acc += mass;
      before += count;
    }
    if (b == kBuckets) return result;  // the whole set falls short (rounding): nothing removed
    row.ranked.clear();
    for (Index i = 0; i < n; ++i) {
      const std::int32_t bi = row.bucket_of[static_cast<std::size_t>(i)];
      if (bi == b) {
        const Index j = cand[static_cast<std::size_t>(i)];
        row.ranked.push_back(Ranked{key(j), j, weight(j)});
      }
    }
    const Index within = select_mass_prefix_halving(row.ranked.data(), static_cast<Index>(row.ranked.size()),
                                                    target - acc);
    c = before + within;
    result.mass_last = row.ranked[static_cast<std::size_t>(within - 1)];  // the prefix's largest
    found = true;
  }
  if (!found) {
    row.rank(key, weight);
    c = select_mass_prefix_halving(row.ranked.data(), n, target);
    result.mass_last = row.ranked[static_cast<std::size_t>(c - 1)];
  }
  if (c >= n) return result;
  result.last = result.mass_last;
  if (c < keep) {  // the best `keep` tokens, which hold the prefix (rare: a full ranking)
    if (keep >= n) return result;
    row.rank(key, weight);
    std::nth_element(row.ranked.begin(), row.ranked.begin() + (keep - 1), row.ranked.end(), ranked_before);
    result.last = row.ranked[static_cast<std::size_t>(keep - 1)];
  }
  result.cut = true;
  return result;
}

// The sorted ids of one history row.
inline void sorted_history(const TokenIds& h, std::vector<Index>& ids) {
  ids.resize(static_cast<std::size_t>(h.size()));
  for (Index t = 0; t < h.size(); ++t) ids[static_cast<std::size_t>(t)] = h.at(t);
  std::sort(ids.begin(), ids.end());
}

// Applies the chain to row.z (already holding the row's logits in double), the options checked.
inline void run_chain(SamplingRow& row, const SamplingOptions& o, const TokenIds* history) {
  std::vector<double>& z = row.z;
  const Index V = static_cast<Index>(z.size());
  const Index keep = o.min_tokens_to_keep;
  auto at = [&z](Index j) -> double& { return z[static_cast<std::size_t>(j)]; };
  // Keys of the orders: -z (z descending, then id ascending) for top-p and min_tokens_to_keep.
  const auto minus_z = [&z](Index j) { return -z[static_cast<std::size_t>(j)]; };
  const auto weight_w = [&row](Index j) { return row.w[static_cast<std::size_t>(j)]; };
  const auto no_weight = [](Index) { return 0.0; };
  for (const SamplingStep step : o.order) {
    if (!sampling_step_active(o, step)) continue;
    switch (step) {
      case SamplingStep::logit_bias:
        for (const auto& [id, bias] : o.logit_bias) at(id) += bias;
        break;
      case SamplingStep::repetition_penalty:
        if (history != nullptr && history->size() > 0) {
          sorted_history(*history, row.ids);
          const double penalty = o.repetition_penalty;
          for (std::size_t i = 0; i < row.ids.size(); ++i) {
            if (i > 0 && row.ids[i] == row.ids[i - 1]) continue;  // once per distinct id
            double& v = at(row.ids[i]);
            v = v > 0.0 ? v / penalty : v * penalty;
          }
        }
        break;
      case SamplingStep::frequency_presence_penalty:
        if (history != nullptr && history->size() > 0) {
          sorted_history(*history, row.ids);
          for (std::size_t i = 0; i < row.ids.size();) {
            std::size_t e = i;
            while (e < row.ids.size() && row.ids[e] == row.ids[i]) ++e;
            at(row.ids[i]) -= o.frequency_penalty * static_cast<double>(e - i) + o.presence_penalty;
            i = e;
          }
        }
        break;
      case SamplingStep::banned_ids:
        for (const Index id : o.banned_ids) at(id) = kNegInf;
        break;
      case SamplingStep::allowed_ids:
        row.mark.assign(static_cast<std::size_t>(V), 0);
        for (const Index id : *o.allowed_ids) row.mark[static_cast<std::size_t>(id)] = 1;
        for (Index j = 0; j < V; ++j)
          if (!row.mark[static_cast<std::size_t>(j)]) at(j) = kNegInf;
        break;
      case SamplingStep::temperature:
        for (double& v : z) v /= o.temperature;  // -inf stays -inf
        break;
      case SamplingStep::top_k: {
        row.candidates();
        if (row.cand.empty()) break;  // the masks removed everything: process_row reports it
        const Index k = std::max(*o.top_k, keep);
        if (k >= static_cast<Index>(row.cand.size())) break;
        // The k-th largest value (with repeats). Small k: a min-heap of the k largest seen, one
        // comparison per value once full (about k ln(K / k) insertions for values in random
        // order); else selection on a copy.
        const std::size_t K = row.cand.size(), kk = static_cast<std::size_t>(k);
        row.vals.resize(K);
        for (std::size_t i = 0; i < K; ++i) row.vals[i] = at(row.cand[i]);
        double kth = 0.0;
        if (kk * 64 <= K) {
          const auto heap_end = row.vals.begin() + k;
          std::make_heap(row.vals.begin(), heap_end, std::greater<double>());
          for (std::size_t i = kk; i < K; ++i) {
            const double v = row.vals[i];
            if (v > row.vals.front()) {
              std::pop_heap(row.vals.begin(), heap_end, std::greater<double>());
              *(heap_end - 1) = v;
              std::push_heap(row.vals.begin(), heap_end, std::greater<double>());
            }
          }
          kth = row.vals.front();
        } else {
          std::nth_element(row.vals.begin(), row.vals.begin() + (k - 1), row.vals.end(), std::greater<double>());
          kth = row.vals[static_cast<std::size_t>(k - 1)];
        }
        for (const Index j : row.cand)
          if (at(j) < kth) at(j) = kNegInf;
        break;
      }
      case SamplingStep::top_p: {
        const double p = *o.top_p;
        if (p >= 1.0) break;
        row.candidates();
        if (row.cand.empty()) break;  // the masks removed everything: process_row reports it
        double m = 0.0;
        const double S = row.exp_weights(&m);
        // Pre-cut: tokens with w_j < (1 - p) S / K weigh less than (1 - p) S together, and each is
        // lighter than every other token, so they are all in the removed tail. Dropped before
        // ranking, unless fewer than min_tokens_to_keep would remain.
        // (Above kMassPrefixHalving tokens the bucketed selection costs a pass or two whatever the
        // tail, and the removal drops it: no pre-cut there.)
        const double floor_w = (1.0 - p) * S / static_cast<double>(row.cand.size());
        Index heavy = 0;
        if (static_cast<Index>(row.cand.size()) <= kMassPrefixHalving)
          for (const Index j : row.cand) heavy += row.w[static_cast<std::size_t>(j)] < floor_w ? 0 : 1;
        if (heavy >= keep && heavy < static_cast<Index>(row.cand.size())) {
          // Branch-free: which tokens go is data-dependent, and a branch on it mispredicts.
          std::size_t k = 0;
          for (const Index j : row.cand) {
            const bool light = row.w[static_cast<std::size_t>(j)] < floor_w;
            at(j) = light ? kNegInf : at(j);
            row.cand[k] = j;
            k += light ? 0 : 1;
          }
          row.cand.resize(k);
        }
        // Keys -z from -m up; the prefix ends at a weight >= floor_w, i.e. a key <= -m - log(floor_w).
        const PrefixCut cut = mass_prefix(row, minus_z, weight_w, p * S, keep, -m, -m - std::log(floor_w));
        if (cut.cut) {
          // Every token after the prefix's last in (-z, id) order: z below its z, or equal with a
          // larger id. Branch-free (the pattern is data-dependent).
          const double z_last = -cut.last.key;
          const Index id_last = cut.last.id;
          row.remove_if(
              [z_last, id_last](Index j, double v) { return (v < z_last) | ((v == z_last) & (j > id_last)); });
        }
        break;
      }
      case SamplingStep::min_p: {
        row.candidates();
        if (row.cand.empty()) break;  // the masks removed everything: process_row reports it
        row.exp_weights();            // w_j = p_j / p_max
        const double min_p = *o.min_p;
        Index survivors = 0;
        for (const Index j : row.cand) survivors += row.w[static_cast<std::size_t>(j)] < min_p ? 0 : 1;
        if (survivors >= keep) {
          const double* const w = row.w.data();
          row.remove_if([w, min_p](Index j, double) { return w[j] < min_p; });
        } else {  // the survivors are the best by z: keep the best `keep` instead
          row.rank(minus_z, no_weight);
          row.remove_ranked_from(keep_at_least(row.ranked.data(), static_cast<Index>(row.ranked.size()), 0, keep));
        }
        break;
      }
      case SamplingStep::typical_p: {
        const double mass = *o.typical_p;
        if (mass >= 1.0) break;
        row.candidates();
        if (row.cand.empty()) break;  // the masks removed everything: process_row reports it
        double m = 0.0;
        const double S = row.exp_weights(&m);
        const double lse = m + std::log(S);
        double H = 0.0;
        for (const Index j : row.cand) {
          const double lp = at(j) - lse, pj = row.w[static_cast<std::size_t>(j)] / S;
          row.w[static_cast<std::size_t>(j)] = pj;
          if (pj > 0.0) H -= pj * lp;
        }
        // s_j = |-lp_j - H|, per id in row.s.
        row.s.resize(static_cast<std::size_t>(V));
        double s_min = std::numeric_limits<double>::infinity(), s_max = -s_min;
        for (const Index j : row.cand) {
          const double sj = std::fabs(-(at(j) - lse) - H);
          row.s[static_cast<std::size_t>(j)] = sj;
          s_min = std::min(s_min, sj);
          s_max = std::max(s_max, sj);
        }
        const auto s_of = [&row](Index j) { return row.s[static_cast<std::size_t>(j)]; };
        // s* = s of the boundary token (the last of the mass prefix; none when the prefix is every
        // token): tokens with s > s* go, but for the first min_tokens_to_keep.
        const PrefixCut cut = mass_prefix(row, s_of, weight_w, mass, keep, s_min, s_max);
        if (cut.cut) {
          const double* const s = row.s.data();
          const double s_mass = cut.mass_last.key, s_last = cut.last.key;
          const Index id_last = cut.last.id;
          row.remove_if([s, s_mass, s_last, id_last](Index j, double) {
            return (s[j] > s_mass) & ((s[j] > s_last) | ((s[j] == s_last) & (j > id_last)));
          });
        }
        break;
      }
    }
  }
}

// log-sum-exp of row.z (some entry above -inf), writing exp(z_j - max) to row.w at the survivors.
// A row as loaded (no candidate list yet) is summed whole, without building the list.
inline double row_lse(SamplingRow& row) {
  if (!row.cand_valid) {
    const Index V = static_cast<Index>(row.z.size());
    const double m = row_max(row.z.data(), V);
    return m + std::log(sum_exp_shifted(row.z.data(), V, m, row.w.data()));
  }
  row.candidates();
  double m = 0.0;
  const double S = row.exp_weights(&m);
  return m + std::log(S);
}

// The workspace of the calling thread, grown to the largest V seen and kept for the thread's
// life (about 9 V doubles: 18 MB at V = 256,000), so a call allocates nothing once it has grown.
inline SamplingRow& sampling_workspace() {
  thread_local SamplingRow row;
  return row;
}

// Loads row n of logits into row.z (with raw_lse, its log-sum-exp into row.raw_lse) and runs the
// chain; then checks the result: some entry above -inf (value_error naming the row otherwise) and
// no +inf or NaN (an option that overflowed).
template <typename Scalar>
void process_row(const char* where, const ConstMatrixRef<Scalar>& logits, Index n, const SamplingOptions& o,
                 const std::vector<TokenIds>& history, SamplingRow& row, bool raw_lse = false) {
  const Index V = logits.cols();
  row.z.resize(static_cast<std::size_t>(V));
  row.w.resize(static_cast<std::size_t>(V));
  for (Index j = 0; j < V; ++j) row.z[static_cast<std::size_t>(j)] = static_cast<double>(logits(n, j));
  row.cand_valid = false;
  if (raw_lse) row.raw_lse = row_lse(row);
  run_chain(row, o, history.empty() ? nullptr : &history[static_cast<std::size_t>(n)]);
  // v is bad when NaN, +inf, or finite beyond Scalar's range: !(v <= largest) && v != -inf. One
  // branch-free pass (which entries are -inf is data-dependent, a branch on it mispredicts); the
  // first bad entry is looked for only when there is one.
  const double largest = static_cast<double>(std::numeric_limits<Scalar>::max());
  const auto bad = [largest](double v) { return !(std::fabs(v) <= largest) & (v != kNegInf); };
  bool any = false, any_bad = false;
  for (Index j = 0; j < V; ++j) {
    const double v = row.z[static_cast<std::size_t>(j)];
    any_bad |= bad(v);
    any |= v > kNegInf;
  }
  if (any_bad)
    for (Index j = 0; j < V; ++j) {
      const double v = row.z[static_cast<std::size_t>(j)];
      if (!bad(v)) continue;
      std::ostringstream m;
      m << where << ": the chain gives " << v << " at (row " << n << ", column " << j << "), outside the finite "
        << scalar_name<Scalar>() << " numbers (an option overflowed)";
      throw value_error(m.str());
    }
  if (!any) {
    std::ostringstream m;
    m << where << ": the masks (banned_ids, allowed_ids) remove every token of row " << n << ": nothing to sample from";
    throw value_error(m.str());
  }
}

inline void check_draw_index(const char* where, std::uint64_t draw, Index n, Index V) {
  const std::uint64_t limit = std::numeric_limits<std::uint64_t>::max() / static_cast<std::uint64_t>(V);
  if (draw >= limit) {
    std::ostringstream m;
    m << where << ": draw index " << draw << " of row " << n << " outside [0, " << limit
      << ") (its counters i * V + j must fit in 64 bits)";
    throw value_error(m.str());
  }
}

// Gumbel-max over the ids with z > -inf, counters draw * V + j. The noise g = -log(-log u) is
// computed in blocks of kSoftmaxLanes by Eigen's vectorised log (map_lanes: every element through
// the same packet code, whatever its position).
inline Index gumbel_max(SamplingRow& row, const Rng& rng, std::uint64_t draw) {
  row.candidates();
  const std::uint64_t base = draw * static_cast<std::uint64_t>(row.z.size());
  const Index K = static_cast<Index>(row.cand.size());
  row.vals.resize(static_cast<std::size_t>(K));
  for (Index i = 0; i < K; ++i)
    row.vals[static_cast<std::size_t>(i)] = rng.uniform_at(base + static_cast<std::uint64_t>(row.cand[i]));
  // u = 0 gives log(0) = -inf, -log(+inf) = -inf: never ahead of a real key.
  map_lanes<double>(row.vals.data(), row.vals.data(), K,
                    [](const SoftmaxLanes<double>& u) -> SoftmaxLanes<double> { return -((-u.log()).log()); });
  Index best = row.cand[0];
  double best_key = row.z[static_cast<std::size_t>(best)] + row.vals[0];
  for (Index i = 1; i < K; ++i) {
    const double key = row.z[static_cast<std::size_t>(row.cand[i])] + row.vals[static_cast<std::size_t>(i)];
    if (key > best_key) {  // strict: ties keep the smaller id (cand is in increasing order)
      best = row.cand[i];
      best_key = key;
    }
  }
  return best;
}

}  // namespace detail

// logits [N, V] -> log_probs [N, V] = log_softmax of each row, in double, rounded once to Scalar:
// the raw log-probs when given the model's logits. -inf entries stay -inf. log_probs may be logits
// (in place).
// \throws value_error for a NaN or +inf logit, or a row of -inf only (naming the row and column);
// shape_error if log_probs is not [N, V]. Nothing is written on a throw. Cost O(N V).
template <typename Scalar>
void raw_log_probs(const ConstMatrixRef<Scalar>& logits, MatrixRef<Scalar> log_probs) {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");
  const char* where = "raw_log_probs";
  detail::check_shape(where, "log_probs", log_probs, logits.rows(), logits.cols());
  detail::check_logits_rows<Scalar>(where, logits);
  detail::SamplingRow& row = detail::sampling_workspace();
  const Index V = logits.cols();
  row.z.resize(static_cast<std::size_t>(V));
  row.w.resize(static_cast<std::size_t>(V));
  for (Index n = 0; n < logits.rows(); ++n) {
    for (Index j = 0; j < V; ++j) row.z[static_cast<std::size_t>(j)] = static_cast<double>(logits(n, j));
    row.cand_valid = false;
    const double lse = detail::row_lse(row);
    for (Index j = 0; j < V; ++j) log_probs(n, j) = static_cast<Scalar>(row.z[static_cast<std::size_t>(j)] - lse);
  }
}

namespace detail {

// The checks of the whole-matrix functions (out [N, V], the options, the history, the logits),
// then the chain over every row once -- so that a row that throws does so before anything is
// written -- then again, handing each row's result to write(n, row) (row is the workspace).
template <typename Scalar, typename Write>
void run_chain_checked(const char* where, const char* out_name, const ConstMatrixRef<Scalar>& logits,
                       const SamplingOptions& options, const std::vector<TokenIds>& history,
                       const MatrixRef<Scalar>& out, const Write& write) {
  const Index N = logits.rows(), V = logits.cols();
  check_shape(where, out_name, out, N, V);
  check_sampling_options(where, options, V);
  check_history(where, history, N, V);
  check_logits_rows<Scalar>(where, logits);
  SamplingRow& row = sampling_workspace();
  for (Index n = 0; n < N; ++n) process_row<Scalar>(where, logits, n, options, history, row);
  for (Index n = 0; n < N; ++n) {
    process_row<Scalar>(where, logits, n, options, history, row);
    write(n, row);
  }
}

}  // namespace detail

// logits [N, V] -> processed [N, V]: each row through the chain of `options` (removed tokens -inf),
// computed in double and rounded once to Scalar. history: empty, or N views (one per row, any
// shape, read as a flat list) of the tokens each row has seen, for the penalties. processed may be
// logits (in place).
// \throws value_error for a bad option (naming it and its range), a NaN or +inf logit or a row of
// -inf only, a row the masks empty, or a processed value outside Scalar's finite range;
// index_error for an id (logit_bias, banned_ids, allowed_ids, history) outside [0, V);
// shape_error for a history of another length than N or 0, or processed not [N, V]. Every row is
// run through the chain once to check it before the first is written, so nothing is written on a
// throw. Cost: two runs of the chain (see the top of this header).
template <typename Scalar>
void process_logits(const ConstMatrixRef<Scalar>& logits, const SamplingOptions& options,
                    const std::vector<TokenIds>& history, MatrixRef<Scalar> processed) {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");
  detail::run_chain_checked<Scalar>("process_logits", "processed", logits, options, history, processed,
                                    [&](Index n, detail::SamplingRow& row) {
                                      for (Index j = 0; j < logits.cols(); ++j)
                                        processed(n, j) = static_cast<Scalar>(row.z[static_cast<std::size_t>(j)]);
                                    });
}

// logits [N, V] -> log_probs [N, V]: the processed log-probs, log_softmax of the chain's output
// (-inf at removed tokens), in double, rounded once to Scalar. log_probs may be logits.
// \throws as process_logits (naming processed_log_probs). Nothing is written on a throw.
template <typename Scalar>
void processed_log_probs(const ConstMatrixRef<Scalar>& logits, const SamplingOptions& options,
                         const std::vector<TokenIds>& history, MatrixRef<Scalar> log_probs) {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");
  detail::run_chain_checked<Scalar>("processed_log_probs", "log_probs", logits, options, history, log_probs,
                                    [&](Index n, detail::SamplingRow& row) {
                                      const double lse = detail::row_lse(row);
                                      for (Index j = 0; j < logits.cols(); ++j)
                                        log_probs(n, j) = static_cast<Scalar>(row.z[static_cast<std::size_t>(j)] - lse);
                                    });
}

// logits [N, V] -> one token per row, drawn from softmax(chain(row)) by Gumbel-max with draw index
// draws[n] of rng's stream (counters draws[n] * V + j, for the surviving ids j; rng's own counter
// is neither read nor advanced), with its raw and processed log-probs. logits are not changed.
// \throws as process_logits (naming sample_tokens); shape_error if draws does not hold N indices;
// value_error for a draw index >= 2^64 / V. Cost: one run of the chain and one Gumbel-max per row,
// plus one O(V) pass for the raw log-prob (process_logits and processed_log_probs skip it).
template <typename Scalar>
SampledTokens sample_tokens(const ConstMatrixRef<Scalar>& logits, const SamplingOptions& options,
                            const std::vector<TokenIds>& history, const Rng& rng,
                            const std::vector<std::uint64_t>& draws) {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");
  const char* where = "sample_tokens";
  const Index N = logits.rows(), V = logits.cols();
  if (static_cast<Index>(draws.size()) != N) {
    std::ostringstream m;
    m << where << ": draws has " << draws.size() << " indices, expected " << N << " (one per logits row)";
    throw shape_error(m.str());
  }
  detail::check_sampling_options(where, options, V);
  detail::check_history(where, history, N, V);
  detail::check_logits_rows<Scalar>(where, logits);
  for (Index n = 0; n < N; ++n) detail::check_draw_index(where, draws[static_cast<std::size_t>(n)], n, V);
  SampledTokens out;
  detail::SamplingRow& row = detail::sampling_workspace();
  for (Index n = 0; n < N; ++n) {
    detail::process_row<Scalar>(where, logits, n, options, history, row, /*raw_lse=*/true);
    const Index token = detail::gumbel_max(row, rng, draws[static_cast<std::size_t>(n)]);
    out.tokens.push_back(token);
    out.raw_log_probs.push_back(static_cast<double>(logits(n, token)) - row.raw_lse);
    out.processed_log_probs.push_back(row.z[static_cast<std::size_t>(token)] - detail::row_lse(row));
  }
  return out;
}

// logits [N, V] -> one token per row, as above with draw index first_draw + n for row n (for a
// batch that is one stream; a batch of independent sequences should pass each its own index).
template <typename Scalar>
SampledTokens sample_tokens(const ConstMatrixRef<Scalar>& logits, const SamplingOptions& options,
                            const std::vector<TokenIds>& history, const Rng& rng, std::uint64_t first_draw) {
  std::vector<std::uint64_t> draws(static_cast<std::size_t>(logits.rows()));
  for (std::size_t n = 0; n < draws.size(); ++n) draws[n] = first_draw + n;
  return sample_tokens<Scalar>(logits, options, history, rng, draws);
}

// logits [N, V] -> tokens [N]: argmax of each row, ties to the smaller id (raw or processed
// logits), with the token's log-prob under that row's softmax in raw_log_probs (and the same
// value in processed_log_probs: greedy decodes the distribution it is given).
// \throws value_error for a NaN or +inf logit or a row of -inf only. Cost O(N V).
template <typename Scalar>
SampledTokens greedy_tokens(const ConstMatrixRef<Scalar>& logits) {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");
  detail::check_logits_rows<Scalar>("greedy_tokens", logits);
  SampledTokens out;
  for (Index n = 0; n < logits.rows(); ++n) {
    Index best = 0;
    for (Index j = 1; j < logits.cols(); ++j)
      if (logits(n, j) > logits(n, best)) best = j;  // strict: ties keep the smaller id
    detail::SamplingRow& row = detail::sampling_workspace();
    row.z.resize(static_cast<std::size_t>(logits.cols()));
    row.w.resize(static_cast<std::size_t>(logits.cols()));
    for (Index j = 0; j < logits.cols(); ++j) row.z[static_cast<std::size_t>(j)] = static_cast<double>(logits(n, j));
    row.cand_valid = false;
    const double lp = static_cast<double>(logits(n, best)) - detail::row_lse(row);
    out.tokens.push_back(best);
    out.raw_log_probs.push_back(lp);
    out.processed_log_probs.push_back(lp);
  }
  return out;
}

namespace detail {

// Throws value_error unless every entry of rows [N, V] is finite and >= 0 and each row sums to 1
// within kProbabilityRowTolerance.
template <typename Scalar>
void check_probability_rows(const char* where, const char* what, const ConstMatrixRef<Scalar>& rows) {
  for (Index r = 0; r < rows.rows(); ++r) {
    double sum = 0.0;
    for (Index j = 0; j < rows.cols(); ++j) {
      const Scalar v = rows(r, j);
      if (!(v >= Scalar(0)) || !std::isfinite(v)) {
        std::ostringstream m;
        m << where << ": " << what << " " << v << " at (row " << r << ", column " << j << ") outside [0, inf)";
        throw value_error(m.str());
      }
      sum += static_cast<double>(v);
    }
    if (!(std::fabs(sum - 1.0) <= kProbabilityRowTolerance)) {
      std::ostringstream m;
      m << where << ": row " << r << " of " << what << " sums to " << sum << ", outside [1 - "
        << kProbabilityRowTolerance << ", 1 + " << kProbabilityRowTolerance << "]";
      throw value_error(m.str());
    }
  }
}

// Inverse CDF over ids in increasing order: the first j whose running sum of weight(j) exceeds
// u * total, skipping zero weights; the last positive-weight id if rounding leaves u * total at or
// above the sum.
template <typename Weight>
Index inverse_cdf(Index V, const Weight& weight, double total, double u) {
  const double target = u * total;
  double acc = 0.0;
  Index last = -1;
  for (Index j = 0; j < V; ++j) {
    const double w = weight(j);
    if (!(w > 0.0)) continue;
    acc += w;
    last = j;
    if (acc > target) return j;
  }
  return last;
}

}  // namespace detail

// draft [k] (any shape with k ids), q [k, V] the draft model's probabilities at each drafted
// position, p [k + 1, V] the target's (both after their chains; row t of p is the target's
// distribution for the token x_t, its row k the one after the whole draft) -> the accepted count
// and the accepted + 1 emitted tokens (see the top of this header), whose joint distribution is
// the target's. Draws: u_t = rng.uniform_at(counter + t) decides x_t; the emitted token's inverse
// CDF uses rng.uniform_at(counter + k); so one verification uses the counters [counter,
// counter + k + 1) (rng's own counter is neither read nor advanced). If at a rejection the residual
// max(0, p_t - q_t) sums to 0 (p_t and q_t equal within rounding), the token is drawn from p_t.
// \pre each row sums to 1 within kProbabilityRowTolerance (1e-3). \throws value_error if k < 1 or
// k > V, for a negative, NaN or infinite probability or a row whose sum is off by more than the
// tolerance (naming the matrix, row and column), for q_t(x_t) = 0 at a drafted token (it could not
// have been drafted), or if counter + k overflows; index_error for a draft id outside [0, V);
// shape_error if q is not [k, V] or p not [k + 1, V]. Nothing is modified. Cost O(k V) for the
// checks, O(V) for the emitted token.
template <typename Scalar>
DraftVerification verify_draft(const TokenIds& draft, const ConstMatrixRef<Scalar>& q, const ConstMatrixRef<Scalar>& p,
                               const Rng& rng, std::uint64_t counter) {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");
  const char* where = "verify_draft";
  const Index k = draft.size(), V = p.cols();
  if (k < 1 || k > V) {
    std::ostringstream m;
    m << where << ": k = " << k << " draft tokens outside [1, " << V << "] (V = p.cols())";
    throw value_error(m.str());
  }
  detail::check_shape(where, "q", q, k, V);
  detail::check_shape(where, "p", p, k + 1, V);
  for (Index t = 0; t < k; ++t) detail::check_vocab_id(where, "draft id", draft.at(t), t, V);
  detail::check_probability_rows<Scalar>(where, "q", q);
  detail::check_probability_rows<Scalar>(where, "p", p);
  for (Index t = 0; t < k; ++t) {
    if (!(q(t, draft.at(t)) > Scalar(0))) {
      std::ostringstream m;
      m << where << ": q(" << t << ", " << draft.at(t) << ") = 0 at drafted token " << draft.at(t) << " (position " << t
        << "): outside (0, 1], the draft model could not have drawn it";
      throw value_error(m.str());
    }
  }
  if (counter > std::numeric_limits<std::uint64_t>::max() - static_cast<std::uint64_t>(k)) {
    std::ostringstream m;
    m << where << ": counter " << counter << " + k = " << k << " overflows 64 bits";
    throw value_error(m.str());
  }
  DraftVerification out;
  const double u_last = rng.uniform_at(counter + static_cast<std::uint64_t>(k));
  for (Index t = 0; t < k; ++t) {
    const Index x = draft.at(t);
    const double ratio = static_cast<double>(p(t, x)) / static_cast<double>(q(t, x));
    if (rng.uniform_at(counter + static_cast<std::uint64_t>(t)) < ratio) {  // P = min(1, ratio)
      out.tokens.push_back(x);
      ++out.accepted;
      continue;
    }
    // Rejected: a token from normalize(max(0, p_t - q_t)).
    const auto residual = [&](Index j) {
      return std::max(0.0, static_cast<double>(p(t, j)) - static_cast<double>(q(t, j)));
    };
    double total = 0.0;
    for (Index j = 0; j < V; ++j) total += residual(j);
    if (total > 0.0) {
      out.tokens.push_back(detail::inverse_cdf(V, residual, total, u_last));
    } else {
      const auto target = [&](Index j) { return static_cast<double>(p(t, j)); };
      double sum = 0.0;
      for (Index j = 0; j < V; ++j) sum += target(j);
      out.tokens.push_back(detail::inverse_cdf(V, target, sum, u_last));
    }
    return out;
  }
  // All k accepted: the bonus token from p_k.
  const auto bonus = [&](Index j) { return static_cast<double>(p(k, j)); };
  double sum = 0.0;
  for (Index j = 0; j < V; ++j) sum += bonus(j);
  out.tokens.push_back(detail::inverse_cdf(V, bonus, sum, u_last));
  return out;
}

}  // namespace embedhead

#endif  // EMBEDHEAD_SAMPLING_HPP
