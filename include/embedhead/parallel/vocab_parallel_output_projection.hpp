// embedhead: the vocabulary-parallel LM head (vocab_shard.hpp has the design):
//   forward   local_logits [N, rows] = h W_shard^T + b_shard   (columns [begin, end))
//   backward  dh = sum over ranks of dlocal W_shard (one all-reduce of N*d);
//             dW_shard += dlocal^T h,  db_shard += column sums
#ifndef EMBEDHEAD_PARALLEL_VOCAB_PARALLEL_OUTPUT_PROJECTION_HPP
#define EMBEDHEAD_PARALLEL_VOCAB_PARALLEL_OUTPUT_PROJECTION_HPP

#include "../detail/checks.hpp"
#include "../detail/gemm.hpp"
#include "../detail/parallel.hpp"
#include "../init.hpp"
#include "../output_projection.hpp"
#include "../parameter.hpp"
#include "../types.hpp"
#include "communicator.hpp"
#include "vocab_parallel_embedding.hpp"
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
  // \throws value_error if d < 1, V < R or init_std is not in (0, inf), also in Scalar (see
  // init_normal).
  VocabParallelOutputProjection(Index V, Index d, Communicator& comm, const OutputProjectionOptions& options = {})
      : comm_(&comm),
        V_(V),
        shard_(validate_new(V, d, comm, options)),
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
      : comm_(&comm),
        V_(V),
        shard_(check_wrapped(V, weight_shard, bias_shard, comm)),
        weight_(std::move(weight_shard)),
        bias_(std::move(bias_shard)) {}

  // Tied to `embedding`: W is the embedding's shard Parameter (shared storage, one gradient: the
  // embedding's sparse rows plus this head's dense dW), no bias; same communicator and V.
  // \throws value_error if the embedding was moved from.
  explicit VocabParallelOutputProjection(const VocabParallelEmbedding<Scalar>& embedding)
      : comm_(&embedding.communicator()),
        V_(embedding.vocab_size()),
        shard_(embedding.shard()),
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
  // communication. \throws shape_error if h is not [N, d], local_logits not [N, rows], or W or the
  // bias no longer has the shard's rows (resized under the layer); nothing written. Cost: 2 N rows
  // d flops.
  void forward(const ConstMatrixRef<Scalar>& h, MatrixRef<Scalar> local_logits) const {
    const char* where = "VocabParallelOutputProjection::forward";
    check_shards(where);
    detail::check_shape(where, "h", h, h.rows(), dim());
    detail::output_projection_forward<Scalar>(h, weight_->value(), bias_view(), local_logits, where);
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
  // Collective. \throws (on every rank, before anything is written) shape_error on a wrong shape
  // (W or the bias included: resized under the layer), value_error if N or d differ across ranks.
  void backward(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& dlocal_logits, MatrixRef<Scalar> dh) {
    const char* where = "VocabParallelOutputProjection::backward";
    const Index N = h.rows(), d = dim();
    check_on_every_rank(
        *comm_, where,
        [&] {
          check_shards(where);
          detail::check_shape(where, "h", h, N, d);
          detail::check_shape(where, "dlocal_logits", dlocal_logits, N, shard_.rows());
          detail::check_shape(where, "dh", dh, N, d);
        },
        detail::fingerprint_values({V_, N, d}), "the shapes N, d and V");
    // The dense accumulators after every check: dense_accumulator() switches the gradient's mode.
    const Eigen::Map<RowMatrix<Scalar>> none(nullptr, 0, 1);
    const auto* trainable = weight_->frozen() ? nullptr : weight_->trainable_rows();
    auto dW = weight_->frozen() || trainable ? Eigen::Map<RowMatrix<Scalar>>(nullptr, 0, d)
                                             : weight_->grad().dense_accumulator();
    // A row mask on the shard (local ids): dW on those rows only; every buffer allocated first.
    std::vector<Scalar> gathered;
    if (trainable) gathered.reserve(static_cast<std::size_t>(N) * trainable->size());
    auto dW_rows = trainable ? weight_->grad().masked_accumulator() : Eigen::Map<RowMatrix<Scalar>>(nullptr, 0, d);
    auto db = bias_ && !bias_->frozen() ? bias_->grad().dense_accumulator() : none;
    if (trainable)
      detail::add_masked_rows_dW<Scalar>(h, dlocal_logits.data(), dlocal_logits.outerStride(), trainable->data(),
                                         static_cast<Index>(trainable->size()), dW_rows.data(), d, gathered);
    // dW (which reads h) is computed before dh is written, so dh may be h.
    detail::output_projection_backward<Scalar>(h, weight_->value(), dlocal_logits, dh, dW, db, where);
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
    detail::check_init_std<Scalar>(where, "init_std", options.init_std);
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
  // W and the bias still have the shard's rows (a Parameter::resize_rows under the layer).
  void check_shards(const char* where) const {
    detail::check_shard_shape(where, "weight()", *weight_, shard_, weight_->cols(), V_, comm_->rank(), comm_->size());
    if (bias_) detail::check_shard_shape(where, "bias()", *bias_, shard_, 1, V_, comm_->rank(), comm_->size());
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

}  // namespace embedhead

#endif  // EMBEDHEAD_PARALLEL_VOCAB_PARALLEL_OUTPUT_PROJECTION_HPP
