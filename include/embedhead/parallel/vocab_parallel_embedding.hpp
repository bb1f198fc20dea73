// embedhead: the vocabulary-parallel token embedding (vocab_shard.hpp has the design):
//   forward   out[n] = s E[ids_n] if this rank owns ids_n, else 0;  all-reduce sum
//             (exact: each row is one value plus zeros)
//   backward  dE_shard[ids_n - begin] += s dout[n] for owned ids only (no communication: dout is
//             replicated, so each rank has what its rows need)
#ifndef EMBEDHEAD_PARALLEL_VOCAB_PARALLEL_EMBEDDING_HPP
#define EMBEDHEAD_PARALLEL_VOCAB_PARALLEL_EMBEDDING_HPP

#include "../detail/checks.hpp"
#include "../detail/kernels.hpp"
#include "../detail/parallel.hpp"
#include "../init.hpp"
#include "../parameter.hpp"
#include "../token_embedding.hpp"
#include "../types.hpp"
#include "communicator.hpp"
#include "vocab_shard.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <memory>
#include <sstream>
#include <type_traits>
#include <utility>
#include <vector>

namespace embedhead {

template <typename Scalar>
class VocabParallelEmbedding {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");

 public:
  // Move-only, like TokenEmbedding: a copy would silently share the shard.
  VocabParallelEmbedding(const VocabParallelEmbedding&) = delete;
  VocabParallelEmbedding& operator=(const VocabParallelEmbedding&) = delete;
  VocabParallelEmbedding(VocabParallelEmbedding&&) noexcept = default;
  VocabParallelEmbedding& operator=(VocabParallelEmbedding&&) noexcept = default;

  // A new shard [shard.rows(), d]: rows [begin, end) of exactly the table TokenEmbedding<Scalar>(V,
  // d, options) draws (element (v, c) of that table is draw 2 (v d + c) of Rng(seed), so the shard
  // starts its stream at counter 2 begin d). The row padding_idx (a global id) is zeroed on the rank
  // that owns it. No communication.
  // \throws value_error if d < 1, V < R (each rank owns a row) or init_std is not in (0, inf), also
  // in Scalar (see init_normal); index_error if padding_idx is outside [0, V).
  VocabParallelEmbedding(Index V, Index d, Communicator& comm, const TokenEmbeddingOptions& options = {})
      : comm_(&comm),
        V_(V),
        shard_((validate(V, d, comm, options, true), vocab_shard(V, comm.rank(), comm.size()))),
        options_(options),
        weight_(std::make_shared<Parameter<Scalar>>(shard_.rows(), d, "token_embedding.weight")) {
    Rng rng(options.seed);
    rng.set_counter(2 * static_cast<std::uint64_t>(shard_.begin) * static_cast<std::uint64_t>(d));
    init_normal<Scalar>(weight_->value(), options.init_std, rng);
    if (options.padding_idx && shard_.owns(*options.padding_idx))
      weight_->value().row(*options.padding_idx - shard_.begin).setZero();
  }

  // Wraps an existing shard [shard.rows(), d] of a [V, d] table (e.g. loaded weights), values
  // untouched (padding_idx included); options.init_std and seed are unused. No communication.
  // \throws value_error if shard_weight is null or V < R; shape_error if it does not have
  // vocab_shard(V, rank, R).rows() rows; index_error for a bad padding_idx.
  VocabParallelEmbedding(Index V, std::shared_ptr<Parameter<Scalar>> shard_weight, Communicator& comm,
                         const TokenEmbeddingOptions& options = {})
      : comm_(&comm),
        V_(V),
        shard_(check_wrapped(V, shard_weight, comm, options)),
        options_(options),
        weight_(std::move(shard_weight)) {}

  Index vocab_size() const { return V_; }  // V, the global vocabulary
  Index dim() const { return weight_->cols(); }
  VocabShard shard() const { return shard_; }
  Communicator& communicator() const { return *comm_; }
  const TokenEmbeddingOptions& options() const { return options_; }
  // The output multiplier, as TokenEmbedding::scale(): Scalar(sqrt(d)) or 1.
  Scalar scale() const {
    return options_.scale_by_sqrt_d ? static_cast<Scalar>(std::sqrt(static_cast<double>(dim()))) : Scalar(1);
  }

  // The shard [shard().rows(), d]; row i (of the value and of the gradient) is global row
  // shard().begin + i.
  Parameter<Scalar>& weight() { return *weight_; }
  const Parameter<Scalar>& weight() const { return *weight_; }
  const std::shared_ptr<Parameter<Scalar>>& weight_ptr() const { return weight_; }
  // -> {weight_ptr()}: the one parameter, this rank's shard (no bias).
  std::vector<std::shared_ptr<Parameter<Scalar>>> parameters() const { return {weight_}; }
  // This rank's shard size, rows * d (the layer's whole table is V * d across the ranks).
  Index parameter_count() const { return weight_->size(); }

  // ids [B, T] (replicated) -> out [B*T, d] (replicated) = s E[ids]: this rank writes the rows of
  // the ids it owns and zeros elsewhere, then one all-reduce sum of N*d values completes every row
  // (exactly: one value plus zeros), bit-identical to TokenEmbedding::forward.
  // Collective. \throws (on every rank, before any collective or write) index_error for an id
  // outside [0, V), shape_error if out is not [B*T, d] or weight() no longer has the shard's rows
  // (resized under the layer), value_error if the ids differ across ranks.
  // Cost: N*d writes and one all-reduce of N*d values.
  void forward(TokenIds ids, MatrixRef<Scalar> out) const {
    ids.visit([&](const auto& typed) { forward_into(typed, out); });
  }
  RowMatrix<Scalar> forward(TokenIds ids) const {
    return ids.visit([&](const auto& typed) { return forward_new(typed); });
  }

  // ids [B, T], dout [B*T, d] (replicated) -> weight().grad() += s * the scatter of the tokens this
  // rank owns, sparse (touched rows are local row numbers), padding_idx skipped, repeats summed in
  // increasing n: the shard's rows of TokenEmbedding::backward's dE, bit for bit. No communication
  // (the inputs are replicated, so every rank meets the same errors). Being collective-free, it
  // cannot compare the ids across ranks as forward does: pass the ids forward was given, or the
  // ranks update rows of different batches. A frozen shard: checks only.
  // \throws index_error for an id outside [0, V), shape_error if dout is not [B*T, d] or weight()
  // no longer has the shard's rows; the gradient is unchanged on throw. Cost: O(N log N) to sort
  // the ids, O(owned tokens * d) to add.
  void backward(TokenIds ids, const ConstMatrixRef<Scalar>& dout) {
    ids.visit([&](const auto& typed) { backward_impl(typed, dout); });
  }

  void zero_grad() { weight_->zero_grad(); }
  bool frozen() const { return weight_->frozen(); }
  void set_frozen(bool frozen) { weight_->set_frozen(frozen); }

 private:
  static void validate(Index V, Index d, const Communicator& comm, const TokenEmbeddingOptions& options,
                       bool initialises) {
    const char* where = "VocabParallelEmbedding";
    detail::check_size(where, "V", V);
    detail::check_size(where, "d", d);
    detail::check_vocab_over_ranks(where, V, comm.size());
    if (initialises) detail::check_init_std<Scalar>(where, "init_std", options.init_std);
    if (options.padding_idx && (*options.padding_idx < 0 || *options.padding_idx >= V)) {
      std::ostringstream message;
      message << where << ": padding_idx " << *options.padding_idx << " outside [0, " << V << ")";
      throw index_error(message.str());
    }
  }
  static VocabShard check_wrapped(Index V, const std::shared_ptr<Parameter<Scalar>>& weight, const Communicator& comm,
                                  const TokenEmbeddingOptions& options) {
    if (!weight) throw value_error("VocabParallelEmbedding: shard_weight is a null shared_ptr<Parameter>");
    validate(V, weight->cols(), comm, options, false);
    const VocabShard shard = vocab_shard(V, comm.rank(), comm.size());
    if (weight->rows() != shard.rows()) {
      std::ostringstream message;
      message << "VocabParallelEmbedding: shard_weight has shape [" << weight->rows() << ", " << weight->cols()
              << "], expected [" << shard.rows() << ", " << weight->cols() << "] (rows [" << shard.begin << ", "
              << shard.end << ") of V = " << V << " on rank " << comm.rank() << " of " << comm.size() << ")";
      throw shape_error(message.str());
    }
    return shard;
  }

  // The shard Parameter still has the shard's rows (a Parameter::resize_rows under the layer).
  void check_weight(const char* where) const {
    detail::check_shard_shape(where, "weight()", *weight_, shard_, weight_->cols(), V_, comm_->rank(), comm_->size());
  }

  template <typename Id>
  void forward_into(const TypedTokenIds<Id>& ids, MatrixRef<Scalar> out) const {
    const char* where = "VocabParallelEmbedding::forward";
    const Index N = ids.size(), d = dim();
    check_on_every_rank(
        *comm_, where,
        [&] {
          check_weight(where);
          detail::check_shape(where, "out", out, N, d);
          detail::check_ids(where, ids, V_);
        },
        detail::fingerprint_ids(ids, detail::fingerprint_values({V_, d})), "the token ids");
    const auto E = static_cast<const Parameter<Scalar>&>(*weight_).value();
    const Scalar s = scale();
    const Index T = ids.cols();
    detail::parallel_ranges(N, detail::kTokensPerThread, [&](Index first, Index last) {
      for (Index n = first; n < last; ++n) {
        const Index v = static_cast<Index>(ids(n / T, n % T));
        if (!shard_.owns(v))
          out.row(n).setZero();
        else if (s != Scalar(1))
          out.row(n) = s * E.row(v - shard_.begin);  // the same product TokenEmbedding computes
        else
          out.row(n) = E.row(v - shard_.begin);
      }
    });
    detail::all_reduce_sum_matrix<Scalar>(*comm_, out);
  }
  template <typename Id>
  RowMatrix<Scalar> forward_new(const TypedTokenIds<Id>& ids) const {
    RowMatrix<Scalar> out(ids.size(), dim());  // the checks are collective: forward_into runs them
    forward_into(ids, out);
    return out;
  }

  template <typename Id>
  void backward_impl(const TypedTokenIds<Id>& ids, const ConstMatrixRef<Scalar>& dout) {
    const char* where = "VocabParallelEmbedding::backward";
    const Index d = dim();
    check_weight(where);
    detail::check_shape(where, "dout", dout, ids.size(), d);
    detail::check_ids(where, ids, V_);
    if (weight_->frozen()) return;
    // Sort every token by global id, then keep the run of unique ids inside [begin, end): the
    // same (id, n) order as TokenEmbedding's backward, so each owned row sums its tokens in the
    // same order and the shard's rows are bit-identical to the single-process dE's.
    ScatterWorkspace& ws = workspace_;
    detail::sort_tokens_by_id(ids, options_.padding_idx.value_or(-1), ws);
    const auto& unique = ws.unique_ids;
    const std::size_t first = static_cast<std::size_t>(std::lower_bound(unique.begin(), unique.end(), shard_.begin) -
                                                       unique.begin());
    const std::size_t last = static_cast<std::size_t>(std::lower_bound(unique.begin(), unique.end(), shard_.end) -
                                                      unique.begin());
    const Index k = static_cast<Index>(last - first);
    local_ids_.resize(last - first);
    for (std::size_t u = first; u < last; ++u) local_ids_[u - first] = unique[u] - shard_.begin;
    RowGradient<Scalar>& dE = weight_->grad();
    // Rows new to the gradient are left unzeroed (fresh): their first token is written, not added.
    dE.touch_rows(local_ids_.data(), k, ws.slots.data(), ws.fresh.data());
    detail::add_token_runs<Scalar>(dE, ws, first, k, dout, scale());
  }

  Communicator* comm_;
  Index V_;
  VocabShard shard_;
  TokenEmbeddingOptions options_;
  std::shared_ptr<Parameter<Scalar>> weight_;
  ScatterWorkspace workspace_;
  std::vector<Index> local_ids_;  // the owned unique ids as local rows, for touch_rows
};

}  // namespace embedhead

#endif  // EMBEDHEAD_PARALLEL_VOCAB_PARALLEL_EMBEDDING_HPP
