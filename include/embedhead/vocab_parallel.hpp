// embedhead: vocabulary-parallel (Megatron-style) embedding, LM head and cross-entropy.
//
// The [V, d] tables are split by rows over the R ranks of a Communicator: rank r holds the shard
// rows [begin, end) = vocab_shard(V, r, R) of E (and of W, b). Activations -- ids, targets, h,
// dout, dh -- are replicated: every rank holds the same values.
//
//   embedding forward   out[n] = s E[ids_n] if this rank owns ids_n, else 0;  all-reduce sum
//                       (exact: each row is one value plus zeros)
//   embedding backward  dE_shard[ids_n - begin] += s dout[n] for owned ids only (no communication:
//                       dout is replicated, so each rank has what its rows need)
//   head forward        local_logits [N, rows] = h W_shard^T + b_shard   (columns [begin, end))
//   head backward       dh = sum over ranks of dlocal W_shard (one all-reduce of N*d);
//                       dW_shard += dlocal^T h,  db_shard += column sums
//   cross-entropy       the full-vocabulary softmax from each rank's columns: an all-reduce max of
//                       the N row maxima, then one all-reduce sum of the N partial sum_exp, target
//                       logits (and logit sums for label smoothing); dlocal = this rank's columns
//                       of the full dlogits. The [N, V] logits exist nowhere.
//
// Every collective call first runs its checks through check_on_every_rank (communicator.hpp), so
// one rank's bad input makes every rank throw the same exception instead of hanging, and the
// replicated inputs (ids, targets, shapes) are fingerprinted so ranks fed different batches fail.
// New shards are drawn from the same Rng stream as the single-process layers (init_normal is
// counter-based), so a parallel model starts bit-identical to TokenEmbedding / OutputProjection
// built with the same options.
#ifndef EMBEDHEAD_VOCAB_PARALLEL_HPP
#define EMBEDHEAD_VOCAB_PARALLEL_HPP

#include "communicator.hpp"
#include "cross_entropy.hpp"
#include "detail/checks.hpp"
#include "detail/kernels.hpp"
#include "detail/parallel.hpp"
#include "detail/softmax.hpp"
#include "init.hpp"
#include "output_projection.hpp"
#include "parameter.hpp"
#include "token_embedding.hpp"
#include "types.hpp"

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

namespace detail {

// Throws value_error unless V >= R: every rank must own at least one row.
inline void check_vocab_over_ranks(const char* where, Index V, int R) {
  if (V < R) {
    std::ostringstream message;
    message << where << ": V = " << V << " rows over " << R << " ranks; needs V >= " << R
            << " (every rank owns at least one row)";
    throw value_error(message.str());
  }
}

// A fingerprint of a few integers that must agree on every rank (shapes, V, options).
inline std::uint64_t fingerprint_values(std::initializer_list<std::int64_t> values,
                                        std::uint64_t hash = 0xcbf29ce484222325ULL) {
  for (const std::int64_t v : values) hash = fingerprint_bytes(&v, sizeof(v), hash);
  return hash;
}

inline std::uint64_t fingerprint_double(double value, std::uint64_t hash) {
  return fingerprint_bytes(&value, sizeof(value), hash);
}

// m [rows, cols] <- the elementwise sum over ranks, as one all-reduce of rows * cols values:
// in place when the rows are contiguous, else through a packed copy (a column block of a wider
// matrix). Every rank must call it with the same shape.
template <typename Scalar>
void all_reduce_sum_matrix(Communicator& comm, MatrixRef<Scalar> m) {
  if (m.size() == 0 || comm.size() == 1) return;
  if (m.outerStride() == m.cols()) {
    comm.all_reduce_sum(m.data(), m.size());
    return;
  }
  RowMatrix<Scalar> packed = m;
  comm.all_reduce_sum(packed.data(), packed.size());
  m = packed;
}

}  // namespace detail

// ---- the embedding ----

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
  // \throws value_error if d < 1, V < R (each rank owns a row) or init_std <= 0; index_error if
  // padding_idx is outside [0, V).
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
  // outside [0, V), shape_error if out is not [B*T, d], value_error if the ids differ across ranks.
  // Cost: N*d writes and one all-reduce of N*d values.
  void forward(const ConstIdRef<std::int32_t>& ids, MatrixRef<Scalar> out) const { forward_into(ids, out); }
  void forward(const ConstIdRef<std::int64_t>& ids, MatrixRef<Scalar> out) const { forward_into(ids, out); }
  RowMatrix<Scalar> forward(const ConstIdRef<std::int32_t>& ids) const { return forward_new(ids); }
  RowMatrix<Scalar> forward(const ConstIdRef<std::int64_t>& ids) const { return forward_new(ids); }

  // ids [B, T], dout [B*T, d] (replicated) -> weight().grad() += s * the scatter of the tokens this
  // rank owns, sparse (touched rows are local row numbers), padding_idx skipped, repeats summed in
  // increasing n: the shard's rows of TokenEmbedding::backward's dE, bit for bit. No communication
  // (the inputs are replicated, so every rank meets the same errors). Being collective-free, it
  // cannot compare the ids across ranks as forward does: pass the ids forward was given, or the
  // ranks update rows of different batches. A frozen shard: checks only.
  // \throws index_error for an id outside [0, V), shape_error if dout is not [B*T, d]; the gradient
  // is unchanged on throw. Cost: O(N log N) to sort the ids, O(owned tokens * d) to add.
  void backward(const ConstIdRef<std::int32_t>& ids, const ConstMatrixRef<Scalar>& dout) { backward_impl(ids, dout); }
  void backward(const ConstIdRef<std::int64_t>& ids, const ConstMatrixRef<Scalar>& dout) { backward_impl(ids, dout); }

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
    if (initialises) detail::check_positive(where, "init_std", options.init_std);
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

  template <typename Id>
  void forward_into(const ConstIdRef<Id>& ids, MatrixRef<Scalar> out) const {
    const char* where = "VocabParallelEmbedding::forward";
    const Index N = ids.size(), d = dim();
    check_on_every_rank(
        *comm_, where,
        [&] {
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
  RowMatrix<Scalar> forward_new(const ConstIdRef<Id>& ids) const {
    RowMatrix<Scalar> out(ids.size(), dim());  // the checks are collective: forward_into runs them
    forward_into(ids, out);
    return out;
  }

  template <typename Id>
  void backward_impl(const ConstIdRef<Id>& ids, const ConstMatrixRef<Scalar>& dout) {
    const char* where = "VocabParallelEmbedding::backward";
    const Index d = dim();
    detail::check_shape(where, "dout", dout, ids.size(), d);
    detail::check_ids(where, ids, V_);
    if (weight_->frozen()) return;
    // Sort every token by global id, then keep the run of unique ids inside [begin, end): the
    // same (id, n) order as TokenEmbedding's backward, so each owned row sums its tokens in the
    // same order and the shard's rows are bit-identical to the single-process dE's.
    ScatterWorkspace& ws = workspace_;
    detail::sort_tokens_by_id(ids, options_.padding_idx.value_or(-1), ws);
    const auto& unique = ws.unique_ids;
    const std::size_t first =
        static_cast<std::size_t>(std::lower_bound(unique.begin(), unique.end(), shard_.begin) - unique.begin());
    const std::size_t last =
        static_cast<std::size_t>(std::lower_bound(unique.begin(), unique.end(), shard_.end) - unique.begin());
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

// ---- the head ----

template <typename Scalar>
class VocabParallelOutputProjection {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");

 public:
  VocabParallelOutputProjection(const VocabParallelOutputProjection&) = delete;
  VocabParallelOutputProjection& operator=(const VocabParallelOutputProjection&) = delete;
  VocabParallelOutputProjection(VocabParallelOutputProjection&&) noexcept = default;
  VocabParallelOutputProjection& operator=(VocabParallelOutputProjection&&) noexcept = default;

  // Untied: W shard = rows [begin, end) of OutputProjection<Scalar>(V, d, options)'s W (the same
  // Rng stream from counter 2 begin d: bit-identical), and a zero bias shard [rows, 1] if
  // options.bias. No communication.
  // \throws value_error if d < 1, V < R or init_std <= 0.
  VocabParallelOutputProjection(Index V, Index d, Communicator& comm, const OutputProjectionOptions& options = {})
      : comm_(&comm), V_(V), shard_(validate_new(V, d, comm, options)),
        weight_(std::make_shared<Parameter<Scalar>>(shard_.rows(), d, "lm_head.weight")) {
    Rng rng(options.seed);
    rng.set_counter(2 * static_cast<std::uint64_t>(shard_.begin) * static_cast<std::uint64_t>(d));
    init_normal<Scalar>(weight_->value(), options.init_std, rng);
    if (options.bias) bias_ = std::make_shared<Parameter<Scalar>>(shard_.rows(), 1, "lm_head.bias");
  }

  // Untied, wrapping existing shards (e.g. loaded): W shard [rows, d] and an optional bias shard
  // [rows, 1] (null for none), rows = vocab_shard(V, rank, R).rows(). Values untouched.
  // \throws value_error if weight_shard is null or V < R; shape_error for a wrong shape.
  VocabParallelOutputProjection(Index V, std::shared_ptr<Parameter<Scalar>> weight_shard,
                                std::shared_ptr<Parameter<Scalar>> bias_shard, Communicator& comm)
      : comm_(&comm), V_(V), shard_(check_wrapped(V, weight_shard, bias_shard, comm)),
        weight_(std::move(weight_shard)), bias_(std::move(bias_shard)) {}

  // Tied to `embedding`: W is the embedding's shard Parameter (shared storage, one gradient: the
  // embedding's sparse rows plus this head's dense dW), no bias; same communicator and V.
  // \throws value_error if the embedding was moved from.
  explicit VocabParallelOutputProjection(const VocabParallelEmbedding<Scalar>& embedding)
      : comm_(&embedding.communicator()), V_(embedding.vocab_size()), shard_(embedding.shard()),
        weight_((check_not_moved_from(embedding), embedding.weight_ptr())) {}

  Index vocab_size() const { return V_; }  // V, the global vocabulary
  Index dim() const { return weight_->cols(); }
  VocabShard shard() const { return shard_; }
  Communicator& communicator() const { return *comm_; }
  // True when W is embedding's shard Parameter (pointer identity), however the head was built (the
  // tying constructor, or wrapping embedding.weight_ptr()).
  bool is_tied_to(const VocabParallelEmbedding<Scalar>& embedding) const { return weight_ == embedding.weight_ptr(); }
  bool has_bias() const { return bias_ != nullptr; }

  // The shards: W [rows, d], bias [rows, 1] or nullptr (tied, or bias = false).
  Parameter<Scalar>& weight() { return *weight_; }
  const Parameter<Scalar>& weight() const { return *weight_; }
  const std::shared_ptr<Parameter<Scalar>>& weight_ptr() const { return weight_; }
  Parameter<Scalar>* bias() { return bias_.get(); }
  const Parameter<Scalar>* bias() const { return bias_.get(); }
  const std::shared_ptr<Parameter<Scalar>>& bias_ptr() const { return bias_; }

  // The shards this layer uses, each once (a tied head lists the embedding's).
  std::vector<std::shared_ptr<Parameter<Scalar>>> parameters() const {
    std::vector<std::shared_ptr<Parameter<Scalar>>> list;
    list.push_back(weight_);
    if (bias_) list.push_back(bias_);
    return list;
  }

  // h [N, d] (replicated) -> local_logits [N, shard().rows()] = h W_shard^T + b_shard: columns
  // [begin, end) of the full logits (see output_projection_forward for the kernel). No
  // communication. \throws shape_error if h is not [N, d] or local_logits not [N, rows] (nothing
  // written). Cost: 2 N rows d flops.
  void forward(const ConstMatrixRef<Scalar>& h, MatrixRef<Scalar> local_logits) const {
    const char* where = "VocabParallelOutputProjection::forward";
    detail::check_shape(where, "h", h, h.rows(), dim());
    output_projection_forward<Scalar>(h, weight_->value(), bias_view(), local_logits, where);
  }
  RowMatrix<Scalar> forward(const ConstMatrixRef<Scalar>& h) const {
    detail::check_shape("VocabParallelOutputProjection::forward", "h", h, h.rows(), dim());
    RowMatrix<Scalar> local_logits(h.rows(), shard_.rows());
    forward(h, local_logits);
    return local_logits;
  }

  // h [N, d], dlocal_logits [N, rows] -> dh [N, d] (replicated) = sum over ranks of dlocal W_shard
  // (one all-reduce of N*d values; dh may be h); weight().grad() += dlocal^T h (switches the
  // shard's gradient to dense mode); bias grad += column sums. A frozen W or bias takes nothing.
  // Collective. \throws (on every rank, before anything is written) shape_error on a wrong shape,
  // value_error if N or d differ across ranks.
  void backward(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& dlocal_logits, MatrixRef<Scalar> dh) {
    const char* where = "VocabParallelOutputProjection::backward";
    const Index N = h.rows(), d = dim();
    check_on_every_rank(
        *comm_, where,
        [&] {
          detail::check_shape(where, "h", h, N, d);
          detail::check_shape(where, "dlocal_logits", dlocal_logits, N, shard_.rows());
          detail::check_shape(where, "dh", dh, N, d);
        },
        detail::fingerprint_values({V_, N, d}), "the shapes N, d and V");
    // The dense accumulators after every check: dense_accumulator() switches the gradient's mode.
    const Eigen::Map<RowMatrix<Scalar>> none(nullptr, 0, 1);
    auto dW = weight_->frozen() ? Eigen::Map<RowMatrix<Scalar>>(nullptr, 0, d) : weight_->grad().dense_accumulator();
    auto db = bias_ && !bias_->frozen() ? bias_->grad().dense_accumulator() : none;
    // dW (which reads h) is computed before dh is written, so dh may be h.
    output_projection_backward<Scalar>(h, weight_->value(), dlocal_logits, dh, dW, db, where);
    detail::all_reduce_sum_matrix<Scalar>(*comm_, dh);
  }
  RowMatrix<Scalar> backward(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& dlocal_logits) {
    RowMatrix<Scalar> dh(h.rows(), dim());  // the checks are collective: backward runs them
    backward(h, dlocal_logits, dh);
    return dh;
  }

  void zero_grad() {
    weight_->zero_grad();
    if (bias_) bias_->zero_grad();
  }
  // This rank's shard sizes: W's plus the bias's.
  Index parameter_count() const { return weight_->size() + (bias_ ? bias_->size() : 0); }
  // True when W and the bias (if any) are frozen; set_frozen applies to both (tied: the
  // embedding's shard too).
  bool frozen() const { return weight_->frozen() && (!bias_ || bias_->frozen()); }
  void set_frozen(bool frozen) {
    weight_->set_frozen(frozen);
    if (bias_) bias_->set_frozen(frozen);
  }

 private:
  static VocabShard validate_new(Index V, Index d, const Communicator& comm, const OutputProjectionOptions& options) {
    const char* where = "VocabParallelOutputProjection";
    detail::check_size(where, "V", V);
    detail::check_size(where, "d", d);
    detail::check_vocab_over_ranks(where, V, comm.size());
    detail::check_positive(where, "init_std", options.init_std);
    return vocab_shard(V, comm.rank(), comm.size());
  }
  static VocabShard check_wrapped(Index V, const std::shared_ptr<Parameter<Scalar>>& weight,
                                  const std::shared_ptr<Parameter<Scalar>>& bias, const Communicator& comm) {
    const char* where = "VocabParallelOutputProjection";
    if (!weight) throw value_error("VocabParallelOutputProjection: weight_shard is a null shared_ptr<Parameter>");
    detail::check_size(where, "V", V);
    detail::check_vocab_over_ranks(where, V, comm.size());
    const VocabShard shard = vocab_shard(V, comm.rank(), comm.size());
    detail::check_shape(where, "weight_shard", weight->value(), shard.rows(), weight->cols());
    if (bias) detail::check_shape(where, "bias_shard", bias->value(), shard.rows(), 1);
    return shard;
  }
  static void check_not_moved_from(const VocabParallelEmbedding<Scalar>& embedding) {
    if (!embedding.weight_ptr())
      throw value_error("VocabParallelOutputProjection: the VocabParallelEmbedding was moved from and holds no shard");
  }
  Eigen::Map<const RowMatrix<Scalar>> bias_view() const {
    if (bias_) return static_cast<const Parameter<Scalar>&>(*bias_).value();
    return {nullptr, 0, 1};
  }

  Communicator* comm_;
  Index V_;
  VocabShard shard_;
  std::shared_ptr<Parameter<Scalar>> weight_;
  std::shared_ptr<Parameter<Scalar>> bias_;
};

// ---- the loss ----

namespace detail {

// The vocabulary-parallel loss, with or without the gradient: the plain loss's arithmetic, max
// first (detail/softmax.hpp), from per-rank partial results:
//   pass 1  s = softcap(z) on the local classes (written to dlocal when there is one), the local
//           row max; all-reduce max -> m, the global row max
//   pass 2  the row statistics at m over the local columns: sum_j exp(s_j - m) (exp written to
//           dlocal without soft-capping), s_y on the target's owner, sum_j s_j (label smoothing);
//           one all-reduce sum of 2N (3N) doubles
//   pass 3  lse, the row loss, and dz for the local columns (at the max)
// With one rank this is softmax_loss_row's arithmetic operation for operation.
template <typename Scalar, typename Id>
CrossEntropyResult vocab_parallel_cross_entropy_pass(Communicator& comm, Index V,
                                                     const ConstMatrixRef<Scalar>& local_logits,
                                                     const ConstIdRef<Id>& targets, MatrixRef<Scalar>* dlocal,
                                                     const CrossEntropyOptions& options, const char* where) {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");
  const Index N = local_logits.rows(), T = targets.cols();
  VocabShard shard;
  std::uint64_t fingerprint = fingerprint_values({V, N, options.ignore_index, static_cast<std::int64_t>(options.reduction),
                                                  options.valid_vocab});
  for (const double x : {options.label_smoothing, options.z_loss, options.softcap, options.gradient_scale})
    fingerprint = fingerprint_double(x, fingerprint);
  check_on_every_rank(
      comm, where,
      [&] {
        check_size(where, "V", V);
        check_vocab_over_ranks(where, V, comm.size());
        shard = vocab_shard(V, comm.rank(), comm.size());
        check_shape(where, "local_logits", local_logits, N, shard.rows());
        if (dlocal) check_shape(where, "dlocal_logits", *dlocal, N, shard.rows());
        check_loss_options(where, options, V);
        check_targets(where, targets, N, classes_of(options, V), options.ignore_index, V);
      },
      fingerprint_ids(targets, fingerprint), "the targets, N, V or the loss options");

  const Index classes = classes_of(options, V);
  // This rank's classes: local columns [0, local_classes); the rest are vocabulary padding.
  const Index local_classes = std::clamp<Index>(classes - shard.begin, 0, shard.rows());
  const SoftmaxTerms terms = softmax_terms(options, classes);
  const bool softcap = options.softcap > 0;
  const bool gradient = dlocal != nullptr;

  CrossEntropyResult result;
  for (Index n = 0; n < N; ++n)
    if (static_cast<Index>(targets(n / T, n % T)) != options.ignore_index) ++result.count;
  result.weight_sum = static_cast<double>(result.count);
  const double scale = reduction_scale(options.reduction, result.weight_sum, options.gradient_scale);
  auto counted = [&](Index n) { return static_cast<Index>(targets(n / T, n % T)) != options.ignore_index; };

  // Without dlocal, soft-capped values go to a scratch row (and are recomputed in pass 2).
  std::vector<Scalar> scratch(!gradient && softcap ? static_cast<std::size_t>(local_classes) : 0);
  auto capped_row = [&](Index n) -> const Scalar* {  // s for row n's local classes
    if (!softcap) return local_logits.row(n).data();
    Scalar* work = gradient ? dlocal->row(n).data() : scratch.data();
    softcap_row(local_logits.row(n).data(), work, local_classes, static_cast<Scalar>(options.softcap));
    return work;
  };

  // Pass 1: the row maxima (-inf where this rank holds no class, and for ignored rows, unused).
  std::vector<SoftmaxRowStats> stats(static_cast<std::size_t>(N));
  std::vector<double> buffer;
  for (Index n = 0; n < N; ++n)
    if (counted(n) && local_classes > 0)
      stats[static_cast<std::size_t>(n)].max = static_cast<double>(row_max(capped_row(n), local_classes));
  all_reduce_row_max(comm, stats.data(), N, buffer);

  // Pass 2: [sum_exp, s_y, (sum_s)] per row at the global max, this rank's part; the owner alone
  // has s_y.
  for (Index n = 0; n < N; ++n) {
    if (!counted(n) || local_classes == 0) continue;
    const Index y = static_cast<Index>(targets(n / T, n % T));
    // With soft-capping and a gradient, pass 1 left s in dlocal; without a gradient, recompute.
    const Scalar* s = softcap && gradient ? dlocal->row(n).data() : capped_row(n);
    // Without soft-capping, exp(s - m) goes straight into dlocal (the gradient's first step);
    // s_y and sum_s are read first, so dlocal may be local_logits.
    stats[static_cast<std::size_t>(n)].add_at_max(s, local_classes, y - shard.begin, terms,
                                                  gradient && !softcap ? dlocal->row(n).data() : nullptr);
  }
  all_reduce_row_sums(comm, stats.data(), N, terms, buffer);

  // Pass 3: the losses (identical on every rank: the same reduced values, the same order) and dz.
  for (Index n = 0; n < N; ++n) {
    if (!counted(n)) {
      if (gradient) dlocal->row(n).setZero();
      continue;
    }
    const Index y = static_cast<Index>(targets(n / T, n % T));
    const SoftmaxRowStats& row_stats = stats[static_cast<std::size_t>(n)];
    const RowLoss row = row_loss(row_stats, terms);
    add_row_loss<Scalar>(row, 1.0, result, nullptr, n);
    if (!gradient) continue;

    auto d_row = dlocal->row(n);
    if (local_classes < shard.rows()) d_row.tail(shard.rows() - local_classes).setZero();
    if (local_classes == 0) continue;
    apply_softmax_gradient(d_row.data(), local_classes, y - shard.begin,
                           softmax_gradient_at_max<Scalar>(row_stats, row.lse, scale, terms), terms,
                           /*holds_exp=*/!softcap);
  }
  finish_reduction(result, options.reduction);
  return result;
}

}  // namespace detail

// local_logits [N, shard.rows()] (this rank's columns [begin, end) of the full [N, V] logits,
// shard = vocab_shard(V, rank, R)), targets (N global ids, any shape read row-major, replicated)
// -> the CrossEntropyResult cross_entropy_forward_backward gives on the full logits (replicated:
// the same on every rank), and dlocal_logits [N, shard.rows()] = this rank's columns of its
// dlogits. Every CrossEntropyOptions field applies; valid_vocab is global (a rank whose columns are
// all padding gets dlocal = 0). dlocal_logits may be local_logits (computed in place).
// Collective: one all-reduce max of N values, one all-reduce sum of 2N doubles (3N with label
// smoothing). \throws (on every rank, before any collective or write) shape_error if local_logits
// or dlocal_logits is not [N, shard.rows()] or targets has not N entries; index_error for a target
// outside [0, classes) that is not ignore_index; value_error for an option out of range, V < R,
// or targets, N, V or options that differ across ranks. Cost: 3 passes over the local logits.
template <typename Scalar>
CrossEntropyResult vocab_parallel_cross_entropy_forward_backward(Communicator& comm, Index V,
                                                                 const ConstMatrixRef<Scalar>& local_logits,
                                                                 const ConstIdRef<std::int32_t>& targets,
                                                                 MatrixRef<Scalar> dlocal_logits,
                                                                 const CrossEntropyOptions& options = {}) {
  return detail::vocab_parallel_cross_entropy_pass<Scalar, std::int32_t>(
      comm, V, local_logits, targets, &dlocal_logits, options, "vocab_parallel_cross_entropy_forward_backward");
}
template <typename Scalar>
CrossEntropyResult vocab_parallel_cross_entropy_forward_backward(Communicator& comm, Index V,
                                                                 const ConstMatrixRef<Scalar>& local_logits,
                                                                 const ConstIdRef<std::int64_t>& targets,
                                                                 MatrixRef<Scalar> dlocal_logits,
                                                                 const CrossEntropyOptions& options = {}) {
  return detail::vocab_parallel_cross_entropy_pass<Scalar, std::int64_t>(
      comm, V, local_logits, targets, &dlocal_logits, options, "vocab_parallel_cross_entropy_forward_backward");
}

// local_logits [N, shard.rows()], targets (N global ids) -> the loss only (replicated).
// Collective, as above. \throws as vocab_parallel_cross_entropy_forward_backward.
template <typename Scalar>
CrossEntropyResult vocab_parallel_cross_entropy(Communicator& comm, Index V, const ConstMatrixRef<Scalar>& local_logits,
                                                const ConstIdRef<std::int32_t>& targets,
                                                const CrossEntropyOptions& options = {}) {
  return detail::vocab_parallel_cross_entropy_pass<Scalar, std::int32_t>(comm, V, local_logits, targets, nullptr,
                                                                         options, "vocab_parallel_cross_entropy");
}
template <typename Scalar>
CrossEntropyResult vocab_parallel_cross_entropy(Communicator& comm, Index V, const ConstMatrixRef<Scalar>& local_logits,
                                                const ConstIdRef<std::int64_t>& targets,
                                                const CrossEntropyOptions& options = {}) {
  return detail::vocab_parallel_cross_entropy_pass<Scalar, std::int64_t>(comm, V, local_logits, targets, nullptr,
                                                                         options, "vocab_parallel_cross_entropy");
}

}  // namespace embedhead

#endif  // EMBEDHEAD_VOCAB_PARALLEL_HPP
