// embedhead: growing or shrinking the vocabulary of a trained embedding and head, in place.
//
//   resize_vocabulary(E, &head, new_vocab, options, &optimizer)
//     rows        = new_vocab rounded up to a multiple of pad_to_multiple   (stored rows, V)
//     E[0, keep)  kept bit for bit, keep = min(old valid rows, new_vocab)
//     E[keep, new_vocab)   mean of the old valid rows (+ optional noise)    (new tokens)
//     E[new_vocab, rows)   zero                                             (padding rows)
//   and the same for an untied head's W (its own mean) and bias (the mean of the old bias for new
//   tokens, zero for padding), the gradients and the optimizer's buffers.
//
// The tables are resized in place (Parameter::resize_rows): the embedding and a tied head hold one
// shared Parameter, so both see the new table and stay tied by construction.
//
// Why the mean: a new token's embedding drawn from the init distribution can be far from where
// training moved the others, and a new head row makes a logit h.w of a different scale, so the
// model starts by predicting (or being derailed by) the new tokens. Setting each new row to the
// mean of the existing rows makes every new token's logit h.mean(W) + mean(b) exactly the average
// of the old tokens' logits, for every h, so adding tokens barely moves the distribution over the
// old ones (Hewitt 2021, "Initializing new word embeddings for pretrained language models"; Hugging
// Face's resize_token_embeddings does the same for the embedding, lm_head weight and bias).
// Optional Gaussian noise (noise_std) breaks the symmetry between the new rows.
//
// Padding rows exist only so that V is GEMM-friendly (a multiple of 64 or 128). They are zero:
// never a target (pass valid_vocab to the loss, which masks their logits and gives them zero
// gradient), never looked up by a valid id, and a zero row with zero gradient stays exactly zero
// under every optimizer here, weight decay included.
#ifndef EMBEDHEAD_VOCABULARY_HPP
#define EMBEDHEAD_VOCABULARY_HPP

#include "detail/checks.hpp"
#include "errors.hpp"
#include "init.hpp"
#include "optim/optimizer.hpp"
#include "output_projection.hpp"
#include "parameter.hpp"
#include "token_embedding.hpp"
#include "types.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <type_traits>
#include <vector>

namespace embedhead {

struct VocabularyResizeOptions {
  // Stored rows are new_vocab rounded up to a multiple of this (64 or 128 keep the head's GEMMs on
  // full tiles); the extra rows are zero padding. >= 1; 1: no padding.
  Index pad_to_multiple = 1;
  // New token rows get mean + N(0, noise_std^2) noise, drawn in double from Rng(seed): element
  // (r, c) of the embedding from draws 2 (r d + c) and the next, the head's from the same draws
  // offset by 2 rows d, so a row's noise depends on (seed, r, rows, d) only. >= 0; 0: the mean.
  double noise_std = 0;
  std::uint64_t seed = 0;
  // How many of the current rows are real tokens (the valid_vocab of the previous resize); rows
  // from there on are padding, replaced as new rows and left out of the mean. -1: all of them.
  Index old_valid_vocab = -1;
};

// What resize_vocabulary did. Pass valid_vocab as CrossEntropyOptions::valid_vocab (and so
// FusedHeadLossOptions::valid_vocab) when rows > valid_vocab, so that the padding rows' logits are
// masked out of the loss.
struct VocabularyResize {
  Index rows = 0;         // stored rows now: new_vocab rounded up to pad_to_multiple
  Index valid_vocab = 0;  // real tokens, = new_vocab: ids and targets lie in [0, valid_vocab)
  Index kept_rows = 0;    // rows [0, kept_rows) kept their values, gradients and optimizer state
};

namespace detail {

// table [rows, d] (the staged new values; rows [0, keep) already hold the old ones): rows [keep,
// vocab) <- mean of old[0, valid) (+ noise from draws offset + 2 (r d + c)), rows [vocab, rows)
// stay zero. The mean is summed in double in row order, then rounded to Scalar together with the
// noise. Cost O(valid * d) for the mean (only when there are new rows), O((vocab - keep) * d) more.
template <typename Scalar>
void fill_new_rows(RowMatrix<Scalar>& table, const ConstMatrixRef<Scalar>& old, Index valid, Index keep, Index vocab,
                   double noise_std, const Rng& rng, std::uint64_t offset) {
  if (keep >= vocab) return;
  const Index d = table.cols();
  Eigen::Matrix<double, 1, Eigen::Dynamic> mean = Eigen::Matrix<double, 1, Eigen::Dynamic>::Zero(d);
  for (Index r = 0; r < valid; ++r) mean += old.row(r).template cast<double>();
  mean /= static_cast<double>(valid);
  for (Index r = keep; r < vocab; ++r)
    for (Index c = 0; c < d; ++c) {
      const std::uint64_t draw = offset + 2 * static_cast<std::uint64_t>(r * d + c);
      table(r, c) = static_cast<Scalar>(noise_std > 0 ? mean(c) + noise_std * rng.normal_at(draw) : mean(c));
    }
}

}  // namespace detail

// Resizes the vocabulary of `embedding`, of `head` (nullptr for none; tied or untied) and of the
// optimizer's state for them (nullptr for none) to new_vocab tokens, stored in
// rows = ceil(new_vocab / pad_to_multiple) * pad_to_multiple rows. With K = min(old valid rows,
// new_vocab) (old valid rows: options.old_valid_vocab, else all rows):
//   rows [0, K)             keep values, gradients and optimizer state bit for bit
//   rows [K, new_vocab)     new tokens: the mean of the old valid rows, plus N(0, noise_std^2)
//                           noise (see VocabularyResizeOptions); an untied head's W uses its own
//                           mean and noise, its bias the mean of the old valid bias entries
//   rows [new_vocab, rows)  padding: zero values (W and bias too)
// and rows from K on have no gradient and fresh optimizer state (0, or Adagrad's
// initial_accumulator_value). Shrinking drops the rows from new_vocab on. Every Parameter is
// resized in place: a tied head keeps the same Parameter as the embedding (it stays tied); layers
// and optimizers keep their pointers. Frozen parameters are resized too and stay frozen. The
// optimizer's buffers are resized for each of these parameters that it holds (others: nothing).
// \pre embedding and head are not in the middle of a forward / backward pair (a FusedHeadLoss or
// cached activations sized for the old V must be recomputed).
// \throws value_error if new_vocab < 1, pad_to_multiple < 1, noise_std is negative or not finite
// (or so large that its largest draw, 8.5717 noise_std, overflows Scalar),
// old_valid_vocab is neither -1 nor in [1, old rows], the rounded row count overflows Index, or
// the embedding or head was moved from; index_error if the embedding's padding_idx is not below
// new_vocab; shape_error if an untied head's [V, d] (or its bias's V) differs from the
// embedding's. Strong guarantee, allocation failure included: all checks run and every new table,
// gradient and buffer is built before any is installed (swaps that cannot throw).
// Cost: O(rows * d) per resized table and optimizer buffer for the reallocation copy, one read of
// the old valid rows for the mean when growing, O((new_vocab - K) * d) to fill the new rows (each
// with one normal draw per value when noise_std > 0). Peak memory holds each resized table and
// buffer twice, old and new, until the install.
template <typename Scalar>
VocabularyResize resize_vocabulary(TokenEmbedding<Scalar>& embedding, OutputProjection<Scalar>* head, Index new_vocab,
                                   const VocabularyResizeOptions& options = {},
                                   Optimizer<Scalar>* optimizer = nullptr) {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");
  const char* where = "resize_vocabulary";
  // ---- every check before anything changes ----
  if (!embedding.weight_ptr())
    throw value_error("resize_vocabulary: the TokenEmbedding was moved from and holds no table");
  if (head && !head->weight_ptr())
    throw value_error("resize_vocabulary: the OutputProjection was moved from and holds no weight");
  detail::check_size(where, "new_vocab", new_vocab);
  detail::check_size(where, "pad_to_multiple", options.pad_to_multiple);
  if (!(options.noise_std >= 0) || !std::isfinite(options.noise_std)) {
    std::ostringstream message;
    message << where << ": noise_std = " << options.noise_std << " outside [0, inf)";
    throw value_error(message.str());
  }
  detail::check_draw_std<Scalar>(where, "noise_std", options.noise_std, /*zero_allowed=*/true);
  const Index old_rows = embedding.vocab_size(), d = embedding.dim();
  if (options.old_valid_vocab != -1 && (options.old_valid_vocab < 1 || options.old_valid_vocab > old_rows)) {
    std::ostringstream message;
    message << where << ": old_valid_vocab = " << options.old_valid_vocab << " outside [1, " << old_rows
            << "] (the embedding's rows; or -1 for all)";
    throw value_error(message.str());
  }
  const Index multiple = options.pad_to_multiple;
  if (new_vocab > std::numeric_limits<Index>::max() - (multiple - 1)) {
    std::ostringstream message;
    message << where << ": new_vocab = " << new_vocab << " rounded up to a multiple of pad_to_multiple = " << multiple
            << " overflows Index";
    throw value_error(message.str());
  }
  const Index rows = (new_vocab + multiple - 1) / multiple * multiple;
  const auto& padding_idx = embedding.options().padding_idx;
  if (padding_idx && *padding_idx >= new_vocab) {
    std::ostringstream message;
    message << where << ": the embedding's padding_idx " << *padding_idx << " outside [0, " << new_vocab
            << ") (new_vocab = " << new_vocab << "); it must stay a valid token";
    throw index_error(message.str());
  }
  // A head sharing the embedding's Parameter (tied) is resized with it; only its bias, if it has
  // one (a head wrapping the shared weight with a bias), is its own.
  const bool untied_head = head && head->weight_ptr() != embedding.weight_ptr();
  if (head) {
    const Index head_bias_rows = head->bias() ? head->bias()->rows() : old_rows;
    if (head->vocab_size() != old_rows || head->dim() != d || head_bias_rows != old_rows) {
      std::ostringstream message;
      message << where << ": the " << (untied_head ? "untied " : "") << "head is [V=" << head->vocab_size()
              << ", d=" << head->dim() << "]";
      if (head->bias()) message << " with a bias of V=" << head_bias_rows;
      message << " but the embedding is [V=" << old_rows << ", d=" << d << "]; they must agree";
      throw shape_error(message.str());
    }
  }
  const Index valid = options.old_valid_vocab == -1 ? old_rows : options.old_valid_vocab;
  const Index keep = std::min(valid, new_vocab);

  // ---- build every new table, gradient and buffer (allocations only; nothing changes) ----
  const Rng rng(options.seed);
  std::vector<detail::RowResize<Scalar>> tables;
  tables.reserve(3);
  tables.emplace_back(embedding.weight(), rows, keep);
  detail::fill_new_rows<Scalar>(tables.back().value(), embedding.weight().value(), valid, keep, new_vocab,
                                options.noise_std, rng, 0);
  if (untied_head) {
    tables.emplace_back(head->weight(), rows, keep);
    detail::fill_new_rows<Scalar>(tables.back().value(), head->weight().value(), valid, keep, new_vocab,
                                  options.noise_std, rng, 2 * static_cast<std::uint64_t>(rows * d));
  }
  if (head && head->bias()) {
    // The bias: the mean of the old valid entries, no noise (W's noise already breaks the symmetry).
    tables.emplace_back(*head->bias(), rows, keep);
    detail::fill_new_rows<Scalar>(tables.back().value(), head->bias()->value(), valid, keep, new_vocab, 0.0, rng, 0);
  }
  std::vector<detail::StateResize<Scalar>> states;
  if (optimizer) {
    states.reserve(tables.size());
    for (auto& table : tables) states.emplace_back(*optimizer, table.target(), rows, keep);
  }

  // ---- install: swaps only, none throws ----
  for (auto& table : tables) table.commit();
  for (auto& state : states) state.commit();
  return {rows, new_vocab, keep};
}

}  // namespace embedhead

#endif  // EMBEDHEAD_VOCABULARY_HPP
