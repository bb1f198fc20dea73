// embedhead: a vocabulary shortlist -- the LM head over a subset S of W's rows, gathered once and
// reused, with every output in the ORIGINAL id space.
//
//   S        = ids s_0 < s_1 < ... < s_{k-1}, a subset of [0, V)
//   W_S      = W[S] [k, d],  b_S = b[S]                            gathered once, at construction
//   logits   = h W_S^T + b_S  [N, k]: column j is original id s_j   (forward)
//   scores   = score_head on (W_S, b_S), tokens given as original ids and top-k returned as
//              original ids (score)
//   sampling = the sampling chain (sampling.hpp) on the [N, k] logits, every id of the options
//              and histories given as an original id and every token returned as one (process,
//              sample, greedy)
//
// Restricting the output vocabulary (to the tokens a task allows, a language's subset, the ids a
// translation's source suggests) makes the head k / V of its cost. The classic bug with it is an id
// returned in the shortlist's local numbering, 0 .. k - 1, as if it were a vocabulary id
// (CTranslate2 had it); here every id that comes in or goes out is an original one, and the local
// index is only ever seen through index_of / original_id. Local order follows the original ids, so
// "ties to the smaller id" means the same in both numberings.
//
// On the default backend a shortlisted id's logit is the same bits as the full head's logit for it
// (each logit's sequence depends on its own row of W and h only), and its scores those of the full
// head restricted to S (a softmax over S, not over V: a shortlist changes the distribution).
//
// The chain over a shortlist is the chain over the full vocabulary with every id outside S at
// -inf: an id outside S has no logit here, so a logit bias, a ban or a permission for it changes
// nothing and is dropped, and so is a history token outside S (its penalty would fall on a logit
// that does not exist). Ids are still checked against [0, V). top_k is checked against k, the
// number of classes (as the chain checks it against V). Gumbel-max draw i uses the counters
// i k + j for local column j (sampling.hpp with k classes).
#ifndef EMBEDHEAD_SHORTLIST_HPP
#define EMBEDHEAD_SHORTLIST_HPP

#include "detail/checks.hpp"
#include "errors.hpp"
#include "head_scores.hpp"
#include "output_projection.hpp"
#include "sampling.hpp"
#include "token_ids.hpp"
#include "types.hpp"

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <vector>

namespace embedhead {

template <typename Scalar>
class VocabShortlist {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");

 public:
  // W [V, d], bias [V, 1] or empty, ids: the k >= 1 original ids of the shortlist (int32 or int64,
  // any TokenIds shape, read row-major), strictly increasing. W's and the bias's rows are copied.
  // \throws value_error for no ids; index_error for an id outside [0, V) or not larger than the
  // one before it (naming its position and value); shape_error for a bias that is not [V, 1].
  VocabShortlist(const ConstMatrixRef<Scalar>& W, const ConstMatrixRef<Scalar>& bias, TokenIds ids)
      : full_vocab_(W.rows()) {
    const char* where = "VocabShortlist";
    const Index V = W.rows(), d = W.cols(), k = ids.size();
    if (bias.size() != 0) detail::check_shape(where, "bias", bias, V, 1);
    if (k < 1) throw value_error(std::string(where) + ": ids is empty (a shortlist needs at least one id)");
    ids_.resize(static_cast<std::size_t>(k));
    for (Index j = 0; j < k; ++j) {
      const std::int64_t id = static_cast<std::int64_t>(ids.at(j));
      if (id < 0 || id >= V || (j > 0 && id <= ids_[static_cast<std::size_t>(j - 1)])) {
        std::ostringstream message;
        message << where << ": id " << id << " at position " << j << " outside ["
                << (j > 0 ? ids_[static_cast<std::size_t>(j - 1)] + 1 : 0) << ", " << V
                << ") (ids must be strictly increasing ids of the vocabulary [0, " << V << "))";
        throw index_error(message.str());
      }
      ids_[static_cast<std::size_t>(j)] = id;
    }
    W_.resize(k, d);
    bias_.resize(bias.size() != 0 ? k : 0, 1);
    for (Index j = 0; j < k; ++j) {
      W_.row(j) = W.row(static_cast<Index>(ids_[static_cast<std::size_t>(j)]));
      if (bias.size() != 0) bias_(j, 0) = bias(static_cast<Index>(ids_[static_cast<std::size_t>(j)]), 0);
    }
  }

  Index size() const { return static_cast<Index>(ids_.size()); }  // k
  Index full_vocab() const { return full_vocab_; }                // V
  Index dim() const { return W_.cols(); }
  const std::vector<std::int64_t>& ids() const { return ids_; }  // the original ids, increasing
  const RowMatrix<Scalar>& weight() const { return W_; }         // W_S [k, d]
  const RowMatrix<Scalar>& bias() const { return bias_; }        // b_S [k, 1] or empty

  // Local column j -> its original id. \throws index_error for j outside [0, k).
  std::int64_t original_id(Index j) const {
    if (j < 0 || j >= size()) {
      std::ostringstream message;
      message << "VocabShortlist::original_id: column " << j << " outside [0, " << size() << ")";
      throw index_error(message.str());
    }
    return ids_[static_cast<std::size_t>(j)];
  }
  bool contains(std::int64_t id) const { return std::binary_search(ids_.begin(), ids_.end(), id); }
  // Original id -> its local column. \throws index_error for an id not in the shortlist.
  Index index_of(std::int64_t id) const {
    const auto it = std::lower_bound(ids_.begin(), ids_.end(), id);
    if (it == ids_.end() || *it != id) {
      std::ostringstream message;
      message << "VocabShortlist::index_of: id " << id << " is not in the shortlist of " << size() << " ids";
      throw index_error(message.str());
    }
    return static_cast<Index>(it - ids_.begin());
  }

  // h [N, d] -> logits [N, k], column j for original id ids()[j] (output_projection_forward on the
  // gathered rows). \throws shape_error (nothing written).
  void forward(const ConstMatrixRef<Scalar>& h, MatrixRef<Scalar> logits) const {
    detail::output_projection_forward<Scalar>(h, W_, bias_, logits, "VocabShortlist::forward");
  }
  RowMatrix<Scalar> forward(const ConstMatrixRef<Scalar>& h) const {
    RowMatrix<Scalar> logits(h.rows(), size());
    forward(h, logits);
    return logits;
  }

  // logits [N, k] -> [N, V]: each column at its original id, fill (default -inf: probability 0)
  // elsewhere, for code that wants full-vocabulary rows. \throws shape_error.
  RowMatrix<Scalar> to_full(const ConstMatrixRef<Scalar>& logits,
                            Scalar fill = -std::numeric_limits<Scalar>::infinity()) const {
    if (logits.cols() != size())
      detail::throw_shape("VocabShortlist::to_full", "logits", logits.rows(), logits.cols(), logits.rows(), size());
    RowMatrix<Scalar> full = RowMatrix<Scalar>::Constant(logits.rows(), full_vocab_, fill);
    for (Index j = 0; j < size(); ++j) full.col(static_cast<Index>(ids_[static_cast<std::size_t>(j)])) = logits.col(j);
    return full;
  }

  // score_head over the shortlist: tokens are original ids (each must be in the shortlist), and
  // top_ids are original ids. The distribution is the softmax over the k shortlisted classes.
  // \throws as score_head, and index_error for a token not in the shortlist (naming its (b, t));
  // options.valid_vocab must be -1 (the shortlist is the set of classes).
  HeadScores score(const ConstMatrixRef<Scalar>& h, TokenIds tokens, const HeadScoreOptions& options = {}) const {
    const char* where = "VocabShortlist::score";
    if (options.valid_vocab != -1) {
      std::ostringstream message;
      message << where << ": valid_vocab = " << options.valid_vocab << " must be -1 (the shortlist is the classes)";
      throw value_error(message.str());
    }
    IdMatrix<std::int64_t> local(tokens.rows(), tokens.cols());
    for (Index b = 0; b < tokens.rows(); ++b)
      for (Index t = 0; t < tokens.cols(); ++t) {
        const std::int64_t id = static_cast<std::int64_t>(tokens(b, t));
        const auto it = std::lower_bound(ids_.begin(), ids_.end(), id);
        if (it == ids_.end() || *it != id) {
          std::ostringstream message;
          message << where << ": token " << id << " at (b=" << b << ", t=" << t << ") is not in the shortlist of "
                  << size() << " ids";
          throw index_error(message.str());
        }
        local(b, t) = static_cast<std::int64_t>(it - ids_.begin());
      }
    HeadScores scores = score_head<Scalar>(h, W_, bias_, local, options);
    for (Index i = 0; i < scores.top_ids.size(); ++i)
      scores.top_ids.data()[i] = ids_[static_cast<std::size_t>(scores.top_ids.data()[i])];
    return scores;
  }

  // logits [N, k] (forward's) -> processed [N, k]: process_logits with the options' and the
  // histories' ids in original ids (see the top of this header). history: empty or N views.
  // \throws as process_logits (ids checked against [0, V), top_k against k). Nothing is written on
  // a throw.
  void process(const ConstMatrixRef<Scalar>& logits, const SamplingOptions& options,
               const std::vector<TokenIds>& history, MatrixRef<Scalar> processed) const {
    const Local local = localise("VocabShortlist::process", logits, options, history);
    process_logits<Scalar>(logits, local.options, local.views(), processed);
  }

  // logits [N, k] -> one token per row as sample_tokens (draw index draws[n]), as an ORIGINAL id,
  // with its raw and processed log-probs over the shortlist. \throws as sample_tokens.
  SampledTokens sample(const ConstMatrixRef<Scalar>& logits, const SamplingOptions& options,
                       const std::vector<TokenIds>& history, const Rng& rng,
                       const std::vector<std::uint64_t>& draws) const {
    const Local local = localise("VocabShortlist::sample", logits, options, history);
    SampledTokens out = sample_tokens<Scalar>(logits, local.options, local.views(), rng, draws);
    for (Index& token : out.tokens) token = static_cast<Index>(ids_[static_cast<std::size_t>(token)]);
    return out;
  }

  // logits [N, k] -> the argmax of each row as an ORIGINAL id (greedy_tokens; ties to the smaller
  // id, the same in both numberings). \throws shape_error for logits not [N, k]; as greedy_tokens.
  SampledTokens greedy(const ConstMatrixRef<Scalar>& logits) const {
    if (logits.cols() != size())
      detail::throw_shape("VocabShortlist::greedy", "logits", logits.rows(), logits.cols(), logits.rows(), size());
    SampledTokens out = greedy_tokens<Scalar>(logits);
    for (Index& token : out.tokens) token = static_cast<Index>(ids_[static_cast<std::size_t>(token)]);
    return out;
  }

 private:
  // The options and histories in local columns (see the top of this header).
  struct Local {
    SamplingOptions options;
    std::vector<IdMatrix<std::int64_t>> history;
    std::vector<TokenIds> views() const { return std::vector<TokenIds>(history.begin(), history.end()); }
  };

  // The local column of an original id, or -1 when it is not in the shortlist.
  Index column_of(std::int64_t id) const {
    const auto it = std::lower_bound(ids_.begin(), ids_.end(), id);
    return it != ids_.end() && *it == id ? static_cast<Index>(it - ids_.begin()) : -1;
  }

  Local localise(const char* where, const ConstMatrixRef<Scalar>& logits, const SamplingOptions& options,
                 const std::vector<TokenIds>& history) const {
    if (logits.cols() != size())
      detail::throw_shape(where, "logits", logits.rows(), logits.cols(), logits.rows(), size());
    const Index V = full_vocab_;
    detail::check_history(where, history, logits.rows(), V);
    Local local;
    local.options = options;
    local.options.logit_bias.clear();
    for (std::size_t i = 0; i < options.logit_bias.size(); ++i) {
      detail::check_vocab_id(where, "logit_bias id", options.logit_bias[i].first, static_cast<Index>(i), V);
      const Index j = column_of(options.logit_bias[i].first);
      if (j >= 0) local.options.logit_bias.push_back({j, options.logit_bias[i].second});
    }
    local.options.banned_ids.clear();
    for (std::size_t i = 0; i < options.banned_ids.size(); ++i) {
      detail::check_vocab_id(where, "banned id", options.banned_ids[i], static_cast<Index>(i), V);
      const Index j = column_of(options.banned_ids[i]);
      if (j >= 0) local.options.banned_ids.push_back(j);
    }
    if (options.allowed_ids) {
      local.options.allowed_ids.emplace();
      for (std::size_t i = 0; i < options.allowed_ids->size(); ++i) {
        detail::check_vocab_id(where, "allowed id", (*options.allowed_ids)[i], static_cast<Index>(i), V);
        const Index j = column_of((*options.allowed_ids)[i]);
        if (j >= 0) local.options.allowed_ids->push_back(j);
      }
    }
    for (const TokenIds& row : history) {
      std::vector<std::int64_t> kept;
      for (Index t = 0; t < row.size(); ++t) {
        const Index j = column_of(row.at(t));
        if (j >= 0) kept.push_back(j);
      }
      local.history.push_back(
          Eigen::Map<const IdMatrix<std::int64_t>>(kept.data(), 1, static_cast<Index>(kept.size())));
    }
    detail::check_sampling_options(where, local.options, size());  // top_k etc. against k, named here
    return local;
  }

  Index full_vocab_;
  std::vector<std::int64_t> ids_;
  RowMatrix<Scalar> W_, bias_;
};

}  // namespace embedhead

#endif  // EMBEDHEAD_SHORTLIST_HPP
