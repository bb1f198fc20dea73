// embedhead: the token embedding, a trainable table E [V, d] read by row.
//
//   forward   out[b*T + t] = s * E[ids(b, t)]                 (a row gather, d copies per token)
//   backward  dE[v] += s * sum_{n : ids_n = v} dout[n]        (only rows of tokens present)
//
// s is 1, or sqrt(d) rounded to Scalar first when scale_by_sqrt_d is set (Gemma). The gather
// equals one_hot(ids) * E exactly, at d copies per token instead of V * d multiply-adds; the
// one-hot matrix is never built. The backward is the transpose, one_hot(ids)^T * dout, again
// without the one-hot: rows of absent tokens receive nothing, repeats sum.
#ifndef EMBEDHEAD_TOKEN_EMBEDDING_HPP
#define EMBEDHEAD_TOKEN_EMBEDDING_HPP

#include "detail/checks.hpp"
#include "detail/kernels.hpp"
#include "detail/parallel.hpp"
#include "init.hpp"
#include "parameter.hpp"
#include "types.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <sstream>
#include <type_traits>
#include <vector>

namespace embedhead {

// ---- the arithmetic, as free functions on views ----

// E [V, d], ids [B, T] -> out [B*T, d]: out[b*T + t] = scale * E[ids(b, t)].
// \pre out does not alias E. \throws index_error for an id outside [0, V) (first one in
// row-major order, with its (b, t)); shape_error if out is not [B*T, d]. Nothing written on throw.
// Cost: B*T*d copies (multiplies when scale != 1); no allocation. Outputs of 16 MiB or more are
// written with streaming stores (same values; they bypass the caches, as a large memcpy does).
namespace detail {

template <typename Scalar, typename Id>
void embedding_forward(const ConstMatrixRef<Scalar>& E, const TypedTokenIds<Id>& ids, Scalar scale,
                       MatrixRef<Scalar> out, const char* where) {
  const Index V = E.rows(), d = E.cols(), N = ids.size();
  detail::check_shape(where, "out", out, N, d);
  detail::check_ids(where, ids, V);
  if (N == 0) return;  // also keeps T = 0 out of gather_tokens' divisions
  // A large output is written with streaming stores (see detail::kStreamingBytes): same values.
  const bool streaming = N * d * static_cast<Index>(sizeof(Scalar)) >= detail::kStreamingBytes;
  detail::gather_tokens(
      ids, [&](Index v) { return E.row(v).data(); }, d,
      [&](Index n, Index v) {
        if (scale != Scalar(1))
          out.row(n) = scale * E.row(v);
        else if (streaming)
          detail::copy_row_streaming(E.row(v).data(), out.row(n).data(), d);
        else
          std::copy_n(E.row(v).data(), d, out.row(n).data());  // rows are contiguous
      },
      [&] {
        if (streaming) detail::stream_fence();
      });
}

}  // namespace detail

// E [V, d], ids [B, T] -> out [B*T, d], as described above.
template <typename Scalar>
void embedding_forward(const ConstMatrixRef<Scalar>& E, TokenIds ids, Scalar scale, MatrixRef<Scalar> out) {
  ids.visit([&](const auto& typed) { detail::embedding_forward<Scalar>(E, typed, scale, out, "embedding_forward"); });
}

namespace detail {

// The additions of the embedding's backward, after sort_tokens_by_id and RowGradient::touch_rows:
// for j in [0, count), the tokens of unique id ws.unique_ids[first + j] -- order[run_begin[first +
// j] .. run_begin[first + j + 1]), in increasing n, since order is sorted by (id, n) -- are summed
// times scale into the gradient row at ws.slots[j], assigned rather than added when ws.fresh[j]
// (a row new to the gradient); a slot of RowGradient::kNoSlot (a row outside the gradient's row
// mask, Parameter::set_trainable_rows) takes nothing. Rows are independent: each thread sums whole runs, in that order,
// so the result is the sequential loop's for any thread count. `first` lets the vocabulary-parallel embedding pass the
// run of unique ids its shard owns.
template <typename Scalar>
void add_token_runs(RowGradient<Scalar>& dE, const ScatterWorkspace& ws, std::size_t first, Index count,
                    const ConstMatrixRef<Scalar>& dout, Scalar scale) {
  parallel_ranges(count, kRowsPerThread, [&](Index lo, Index hi) {
    for (std::size_t j = static_cast<std::size_t>(lo); j < static_cast<std::size_t>(hi); ++j) {
      if (ws.slots[j] == RowGradient<Scalar>::kNoSlot) continue;  // a row outside the mask: no gradient
      auto dE_row = dE.slot_row(ws.slots[j]);
      bool assign = ws.fresh[j] != 0;
      const std::size_t u = first + j;
      for (std::size_t run = ws.run_begin[u]; run < ws.run_begin[u + 1]; ++run) {
        const auto dout_row = dout.row(ws.order[run].second);
        if (assign && scale == Scalar(1))
          dE_row = dout_row;
        else if (assign)
          dE_row = scale * dout_row;
        else if (scale == Scalar(1))
          dE_row += dout_row;
        else
          dE_row += scale * dout_row;
        assign = false;
      }
    }
  });
}

}  // namespace detail

// ids [B, T], dout [B*T, d] -> dE (a [V, d] RowGradient) += scale * one_hot(ids)^T * dout.
// Tokens whose id equals padding_idx (pass -1 for none) contribute nothing. Repeats of an id are
// summed in increasing token position n, so the result is bit-identical to the sequential loop
//   for n: dE[ids_n] += scale * dout[n]
// on every run. \throws index_error / shape_error as embedding_forward; dE unchanged on throw.
// Cost: O(N log N) to sort the N = B*T ids, O(N * d) to add, O((k_old + k_new) * d) to merge new
// rows into the gradient's sorted block; never O(V * d) in sparse mode. Reuses `workspace`.
namespace detail {

template <typename Scalar, typename Id>
void embedding_backward(const TypedTokenIds<Id>& ids, const ConstMatrixRef<Scalar>& dout, Scalar scale,
                        Index padding_idx, RowGradient<Scalar>& dE, ScatterWorkspace& workspace, const char* where) {
  const Index V = dE.rows(), d = dE.cols();
  detail::check_shape(where, "dout", dout, ids.size(), d);
  detail::check_ids(where, ids, V);
  detail::sort_tokens_by_id(ids, padding_idx, workspace);
  const Index k = static_cast<Index>(workspace.unique_ids.size());
  // Rows new to the gradient are left unzeroed (fresh): their first token is written, not added.
  dE.touch_rows(workspace.unique_ids.data(), k, workspace.slots.data(), workspace.fresh.data());
  detail::add_token_runs<Scalar>(dE, workspace, 0, k, dout, scale);
}

}  // namespace detail

// ids [B, T], dout [B*T, d] -> dE (a [V, d] RowGradient) += scale * one_hot(ids)^T * dout, as
// described above; padding_idx: std::nullopt (or -1, which no valid id equals) for none.
template <typename Scalar>
void embedding_backward(TokenIds ids, const ConstMatrixRef<Scalar>& dout, Scalar scale,
                        std::optional<Index> padding_idx, RowGradient<Scalar>& dE, ScatterWorkspace& workspace) {
  ids.visit([&](const auto& typed) {
    detail::embedding_backward<Scalar>(typed, dout, scale, padding_idx.value_or(-1), dE, workspace,
                                       "embedding_backward");
  });
}

// ---- the layer ----

struct TokenEmbeddingOptions {
  double init_std = 0.02;            // E ~ N(0, init_std^2), the GPT-2 / Llama initializer_range
  std::uint64_t seed = 0;            // Rng seed for the init
  std::optional<Index> padding_idx;  // never gets gradient; zeroed when a new table is drawn
                                     // (a wrapped Parameter is left as it is, like PyTorch's
                                     // from_pretrained)
  bool scale_by_sqrt_d = false;      // multiply outputs by Scalar(sqrt(d)) (Gemma)
};

template <typename Scalar>
class TokenEmbedding {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");

 public:
  // A new table E [V, d] drawn from N(0, init_std^2) with Rng(seed).
  // \throws value_error if V or d < 1 or init_std is not in (0, inf), also in Scalar (see
  // init_normal: not 0 there, every draw finite there); index_error if padding_idx is outside
  // [0, V).
  // Layers are move-only: a copy would silently share the table and gradient (it holds a
  // shared_ptr), which is what tying means and nothing else should.
  TokenEmbedding(const TokenEmbedding&) = delete;
  TokenEmbedding& operator=(const TokenEmbedding&) = delete;
  TokenEmbedding(TokenEmbedding&&) noexcept = default;
  TokenEmbedding& operator=(TokenEmbedding&&) noexcept = default;

  TokenEmbedding(Index V, Index d, const TokenEmbeddingOptions& options = {})
      : options_((validate(V, d, options), options)),
        weight_(std::make_shared<Parameter<Scalar>>(V, d, "token_embedding.weight")) {
    Rng rng(options.seed);
    init_normal<Scalar>(weight_->value(), options.init_std, rng);
    if (options.padding_idx) weight_->value().row(*options.padding_idx).setZero();
  }

  // Wraps an existing parameter (e.g. loaded weights) as E [V, d], values untouched;
  // options.init_std and seed are unused. \throws value_error if weight is null; index_error
  // for a bad padding_idx.
  explicit TokenEmbedding(std::shared_ptr<Parameter<Scalar>> weight, const TokenEmbeddingOptions& options = {})
      : options_((check_not_null(weight), validate(weight->rows(), weight->cols(), options, false), options)),
        weight_(std::move(weight)) {}

  Index vocab_size() const { return weight_->rows(); }
  Index dim() const { return weight_->cols(); }
  const TokenEmbeddingOptions& options() const { return options_; }
  // The output multiplier: Scalar(sqrt(d)) rounded to Scalar, or 1.
  Scalar scale() const {
    return options_.scale_by_sqrt_d ? static_cast<Scalar>(std::sqrt(static_cast<double>(dim()))) : Scalar(1);
  }

  Parameter<Scalar>& weight() { return *weight_; }
  const Parameter<Scalar>& weight() const { return *weight_; }
  // Shared ownership, for tying an OutputProjection to this table.
  const std::shared_ptr<Parameter<Scalar>>& weight_ptr() const { return weight_; }
  // -> {weight_ptr()}: the one parameter (no bias).
  std::vector<std::shared_ptr<Parameter<Scalar>>> parameters() const { return {weight_}; }
  Index parameter_count() const { return weight_->size(); }

  // ids [B, T] -> out [B*T, d]. See embedding_forward.
  void forward(TokenIds ids, MatrixRef<Scalar> out) const {
    ids.visit([&](const auto& typed) { forward_into(typed, out); });
  }
  RowMatrix<Scalar> forward(TokenIds ids) const {
    return ids.visit([&](const auto& typed) { return forward_new(typed); });
  }

  // ids [B, T], dout [B*T, d] -> weight().grad() += scale * one_hot(ids)^T * dout, skipping
  // padding_idx. See embedding_backward. No allocation once the workspace has grown. A frozen
  // table takes no gradient: the arguments are checked as usual (same throws), then nothing is
  // done, O(N).
  void backward(TokenIds ids, const ConstMatrixRef<Scalar>& dout) {
    ids.visit([&](const auto& typed) { backward_impl(typed, dout); });
  }

  void zero_grad() { weight_->zero_grad(); }

  // weight().frozen() / set_frozen(): see Parameter. Tied, this freezes the head's W as well.
  bool frozen() const { return weight_->frozen(); }
  void set_frozen(bool frozen) { weight_->set_frozen(frozen); }
  // ids [k] (strictly increasing, in [0, V)): only these rows train (Parameter::set_trainable_rows);
  // tied, the head's W too. \throws as Parameter::set_trainable_rows (nothing changed).
  void set_trainable_rows(std::vector<Index> ids) { weight_->set_trainable_rows(std::move(ids)); }

 private:
  static void check_not_null(const std::shared_ptr<Parameter<Scalar>>& weight) {
    if (!weight) throw value_error("TokenEmbedding: weight is a null shared_ptr<Parameter>");
  }
  static void validate(Index V, Index d, const TokenEmbeddingOptions& options, bool initialises = true) {
    detail::check_size("TokenEmbedding", "V", V);
    detail::check_size("TokenEmbedding", "d", d);
    if (initialises) detail::check_init_std<Scalar>("TokenEmbedding", "init_std", options.init_std);
    if (options.padding_idx && (*options.padding_idx < 0 || *options.padding_idx >= V)) {
      std::ostringstream message;
      message << "TokenEmbedding: padding_idx " << *options.padding_idx << " outside [0, " << V << ")";
      throw index_error(message.str());
    }
  }

  template <typename Id>
  void forward_into(const TypedTokenIds<Id>& ids, MatrixRef<Scalar> out) const {
    detail::embedding_forward<Scalar, Id>(weight_->value(), ids, scale(), out, "TokenEmbedding::forward");
  }
  template <typename Id>
  RowMatrix<Scalar> forward_new(const TypedTokenIds<Id>& ids) const {
    detail::check_ids("TokenEmbedding::forward", ids, vocab_size());  // before allocating
    RowMatrix<Scalar> out(ids.size(), dim());
    forward_into(ids, out);
    return out;
  }
  template <typename Id>
  void backward_impl(const TypedTokenIds<Id>& ids, const ConstMatrixRef<Scalar>& dout) {
    if (weight_->frozen()) {
      detail::check_shape("TokenEmbedding::backward", "dout", dout, ids.size(), dim());
      detail::check_ids("TokenEmbedding::backward", ids, vocab_size());
      return;
    }
    detail::embedding_backward<Scalar, Id>(ids, dout, scale(), options_.padding_idx.value_or(-1), weight_->grad(),
                                           workspace_, "TokenEmbedding::backward");
  }

  TokenEmbeddingOptions options_;
  std::shared_ptr<Parameter<Scalar>> weight_;
  ScatterWorkspace workspace_;
};

}  // namespace embedhead

#endif  // EMBEDHEAD_TOKEN_EMBEDDING_HPP
