// embedhead: the fused LM head + cross-entropy (fused_head_loss.hpp) over a vocabulary shard.
//
// Each of R ranks holds rows [begin, end) = vocab_shard(V, rank, R) of the head W [V, d] (and of
// its bias), and every rank passes the same hidden states h [N, d] and global targets. One call
// gives, on every rank, the loss that FusedHeadLoss computes on the whole head, dh [N, d], and the
// shard's rows of dW and db; neither the [N, V] logits nor the whole W exist anywhere. Per rank
// it costs the single-process pass on V / R rows -- 6 N (V / R) d flops with dW in token chunks,
// 8 in vocabulary blocks (the same FusedPlan choice, made from the widest shard's rows so that
// every rank makes it alike) -- plus the all-reduces: for each token chunk (once for the two
// passes) its row maxima (max) and 2 doubles a row (3 with label smoothing: sums of exponentials
// rescaled to the global maximum, target logits, sums of logits), and at the end dh's N_count d
// partial sums, where N_count counts the tokens whose target is not ignore_index. Memory per rank:
// a [n, V / R] chunk of logits within memory_budget, or one [N_count, vocab_block] block with
// vocab_block = 0 (automatic) chosen from this rank's V / R classes as FusedHeadLoss chooses it
// from V: about 2 % of the [N, V / R] logits the unfused path would hold on this rank.
//
// The shard's pass is detail::fused_head_loss_pass with a VocabSlice (below, over the Communicator), the same code as
// the single-process loss: with one rank the result is FusedHeadLoss's bit for bit; with more, the sums over the
// vocabulary are split differently, so it agrees to rounding.
//
// Errors: every check runs on every rank through check_on_every_rank before the first collective,
// together with a fingerprint of what must be replicated (the targets, the per-token weights, N, d,
// V, the loss options and whether a bias is given), so a bad input on one rank -- or ranks fed
// different targets -- makes every rank throw the same exception instead of hanging. h itself is
// not fingerprinted (hashing it would cost a pass over N d values each call): it must be the same
// on every rank.
//
// Soft (probability) targets (forward_backward_shard_soft, forward_shard_soft): the single-process
// fused_head_loss_soft's semantics; the targets are replicated like h but fingerprinted (every
// value: N C values dense, 2 N k sparse), and each row's statistic sum_c v_c s_c is all-reduced
// with the others (detail/softmax.hpp).
#ifndef EMBEDHEAD_PARALLEL_VOCAB_PARALLEL_FUSED_HEAD_LOSS_HPP
#define EMBEDHEAD_PARALLEL_VOCAB_PARALLEL_FUSED_HEAD_LOSS_HPP

#include "../cross_entropy.hpp"
#include "../fused_head_loss.hpp"
#include "../parameter.hpp"
#include "../types.hpp"
#include "communicator.hpp"
#include "vocab_shard.hpp"

#include <cstdint>
#include <functional>
#include <sstream>
#include <type_traits>

namespace embedhead {

namespace detail {

// fused_head_loss_pass's two collective steps over a Communicator (fused_head_loss.hpp's
// VocabSlice). After pass 1 (or each token chunk's statistics) on every rank's shard, each counted row's statistics
// (max, sum_exp, target logit, sum of logits) over the local columns become the same over all V columns on every rank:
// the row maxima all-reduced (max), each rank's sum of exponentials rescaled to them, then the sums all-reduced
// (detail/softmax.hpp). A rank with no local class has max -inf and sum 0, and contributes 0. At the end, each rank's
// dh -- the sum over its own columns -- is all-reduced.
template <typename Scalar>
struct CommunicatorSlice final : VocabSlice<Scalar> {
  Communicator* comm;
  CommunicatorSlice(Index begin, Index V, Communicator& communicator)
      : VocabSlice<Scalar>(begin, V, vocab_shard(V, 0, communicator.size()).rows()), comm(&communicator) {}
  void combine_row_stats(FusedHeadLossWorkspace<Scalar>& ws, Index first, Index rows,
                         const SoftmaxTerms& terms) const override {
    all_reduce_row_max(*comm, ws.row_stats.data() + first, rows, ws.reduced);
    all_reduce_row_sums(*comm, ws.row_stats.data() + first, rows, terms, ws.reduced);
  }
  void sum_over_ranks(Scalar* dh, Index size) const override { comm->all_reduce_sum(dh, size); }
};

}  // namespace detail

// One call per training step on every rank of the communicator:
//   VocabParallelFusedHeadLoss<float> loss(options);
//   auto r = loss.forward_backward_shard(comm, V, W_shard, &b_shard, h, targets, dh);
// or, on a head that knows its shard (a VocabParallelOutputProjection), loss.forward_backward(head,
// h, targets, dh). Holds the options and the workspace (so the steady state allocates nothing but
// Eigen's GEMM packing buffers).
template <typename Scalar>
class VocabParallelFusedHeadLoss {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");

 public:
  explicit VocabParallelFusedHeadLoss(const FusedHeadLossOptions& options = {}) : options_(options) {}
  const FusedHeadLossOptions& options() const { return options_; }

  // h [N, d], targets (N global ids), both replicated -> the loss FusedHeadLoss gives on the whole
  // head (replicated); dh [N, d] written (replicated, one all-reduce); weight_shard.grad() += the
  // shard's rows of dz^T h (dense mode); bias_shard's gradient += its columns' sums of dz. A
  // frozen weight or bias shard takes nothing. extras (per-token weights in, lse and losses out)
  // as FusedHeadLoss's, replicated.
  // weight_shard [shard.rows(), d] and bias_shard [shard.rows(), 1] (or null) hold rows
  // [shard.begin, shard.end) of the global head, shard = vocab_shard(V, comm.rank(), comm.size()).
  // Collective: every rank of comm calls it with the same V, h, targets, weights and options.
  // \throws value_error for V < comm.size(), an option out of range, a negative or non-finite
  //   weight, with error_if_nonfinite a NaN or infinity in a counted row of h or in this rank's
  //   class rows of W or bias (named by its global row), or targets / weights / shapes / options
  //   that differ across ranks; shape_error for a shard of the wrong shape or any other shape
  //   mismatch; index_error for a target outside [0, classes) that is not ignore_index. On every
  //   rank alike (the message of the lowest failing rank, ending "[on rank r of R]" when R > 1);
  //   nothing is changed on throw.
  // \pre dh does not alias W, the gradients or the extras (it may be h).
  CrossEntropyResult forward_backward_shard(Communicator& comm, Index V, Parameter<Scalar>& weight_shard,
                                            Parameter<Scalar>* bias_shard, const ConstMatrixRef<Scalar>& h,
                                            TokenIds targets, MatrixRef<Scalar> dh,
                                            const FusedHeadLossExtras<Scalar>& extras = {}) {
    return targets.visit([&](const auto& typed) {
      return forward_backward_impl(comm, V, weight_shard, bias_shard, h, typed, dh, extras,
                                   "VocabParallelFusedHeadLoss::forward_backward_shard");
    });
  }

  // h [N, d], targets (N global ids), replicated -> the loss only (evaluation): pass 1 and the
  // two all-reduces of the row statistics, the same loss bit for bit as forward_backward_shard.
  // Collective. \throws as forward_backward_shard.
  CrossEntropyResult forward_shard(Communicator& comm, Index V, const Parameter<Scalar>& weight_shard,
                                   const Parameter<Scalar>* bias_shard, const ConstMatrixRef<Scalar>& h,
                                   TokenIds targets, const FusedHeadLossExtras<Scalar>& extras = {}) {
    return targets.visit([&](const auto& typed) {
      return forward_impl(comm, V, weight_shard, bias_shard, h, typed, extras,
                          "VocabParallelFusedHeadLoss::forward_shard");
    });
  }

  // The same on a head that holds its shard: any type with communicator() (Communicator&),
  // vocab_size() (the global V), weight() (the shard Parameter) and bias() (the bias shard's
  // Parameter pointer, or null), such as VocabParallelOutputProjection. Tied or untied alike (a
  // tied head's weight() is the embedding's shard, so dW lands in its gradient).
  // h [N, d], targets (N global ids) -> loss; dh [N, d]; the head's shard gradients +=.
  // \throws as forward_backward_shard.
  template <typename Head>
  CrossEntropyResult forward_backward(Head& head, const ConstMatrixRef<Scalar>& h, TokenIds targets,
                                      MatrixRef<Scalar> dh, const FusedHeadLossExtras<Scalar>& extras = {}) {
    return targets.visit([&](const auto& typed) {
      return forward_backward_impl(head.communicator(), head.vocab_size(), head.weight(), head.bias(), h, typed, dh,
                                   extras, "VocabParallelFusedHeadLoss::forward_backward");
    });
  }

  // h [N, d], targets (N global ids) -> loss only, on a head as above. \throws as forward_shard.
  template <typename Head>
  CrossEntropyResult forward(const Head& head, const ConstMatrixRef<Scalar>& h, TokenIds targets,
                             const FusedHeadLossExtras<Scalar>& extras = {}) {
    return targets.visit([&](const auto& typed) {
      return forward_impl(head.communicator(), head.vocab_size(), head.weight(), head.bias(), h, typed, extras,
                          "VocabParallelFusedHeadLoss::forward");
    });
  }

  // Soft (probability) targets (fused_head_loss_soft's semantics: cross_entropy.hpp), dense [N, C]
  // (or [N, V]) or SparseTargets [N, k], replicated like h and fingerprinted with the call (every
  // value, so ranks fed different targets throw alike). Otherwise as forward_backward_shard /
  // forward_shard, and \throws as those and as cross_entropy_soft for the targets.
  CrossEntropyResult forward_backward_shard_soft(Communicator& comm, Index V, Parameter<Scalar>& weight_shard,
                                                 Parameter<Scalar>* bias_shard, const ConstMatrixRef<Scalar>& h,
                                                 const ConstMatrixRef<Scalar>& targets, MatrixRef<Scalar> dh,
                                                 const FusedHeadLossExtras<Scalar>& extras = {}) {
    const char* where = "VocabParallelFusedHeadLoss::forward_backward_shard_soft";
    detail::SoftTargetRows<Scalar> rows;
    rows.dense = &targets;
    return soft_impl(comm, V, &weight_shard, bias_shard, weight_shard, bias_shard, h,
                     detail::DenseSoftTargets<Scalar>{targets}, rows, detail::fingerprint_matrix<Scalar>(targets), &dh,
                     extras, where);
  }
  CrossEntropyResult forward_backward_shard_soft(Communicator& comm, Index V, Parameter<Scalar>& weight_shard,
                                                 Parameter<Scalar>* bias_shard, const ConstMatrixRef<Scalar>& h,
                                                 const SparseTargets<Scalar>& targets, MatrixRef<Scalar> dh,
                                                 const FusedHeadLossExtras<Scalar>& extras = {}) {
    return targets.ids.visit([&](const auto& typed) {
      return sparse_impl(comm, V, &weight_shard, bias_shard, weight_shard, bias_shard, h, typed, targets.probs, &dh,
                         extras, "VocabParallelFusedHeadLoss::forward_backward_shard_soft");
    });
  }
  CrossEntropyResult forward_shard_soft(Communicator& comm, Index V, const Parameter<Scalar>& weight_shard,
                                        const Parameter<Scalar>* bias_shard, const ConstMatrixRef<Scalar>& h,
                                        const ConstMatrixRef<Scalar>& targets,
                                        const FusedHeadLossExtras<Scalar>& extras = {}) {
    detail::SoftTargetRows<Scalar> rows;
    rows.dense = &targets;
    return soft_impl(comm, V, nullptr, nullptr, weight_shard, bias_shard, h, detail::DenseSoftTargets<Scalar>{targets},
                     rows, detail::fingerprint_matrix<Scalar>(targets), nullptr, extras,
                     "VocabParallelFusedHeadLoss::forward_shard_soft");
  }
  CrossEntropyResult forward_shard_soft(Communicator& comm, Index V, const Parameter<Scalar>& weight_shard,
                                        const Parameter<Scalar>* bias_shard, const ConstMatrixRef<Scalar>& h,
                                        const SparseTargets<Scalar>& targets,
                                        const FusedHeadLossExtras<Scalar>& extras = {}) {
    return targets.ids.visit([&](const auto& typed) {
      return sparse_impl(comm, V, nullptr, nullptr, weight_shard, bias_shard, h, typed, targets.probs, nullptr, extras,
                         "VocabParallelFusedHeadLoss::forward_shard_soft");
    });
  }

 private:
  using OutputMap = Eigen::Map<RowMatrix<Scalar>>;

  template <typename Id>
  CrossEntropyResult sparse_impl(Communicator& comm, Index V, Parameter<Scalar>* weight_grad,
                                 Parameter<Scalar>* bias_grad, const Parameter<Scalar>& weight_shard,
                                 const Parameter<Scalar>* bias_shard, const ConstMatrixRef<Scalar>& h,
                                 const TypedTokenIds<Id>& ids, const ConstMatrixRef<Scalar>& probs,
                                 MatrixRef<Scalar>* dh, const FusedHeadLossExtras<Scalar>& extras, const char* where) {
    std::uint64_t hash = detail::fingerprint_ids(ids, detail::fingerprint_matrix<Scalar>(probs));
    detail::SoftTargetRows<Scalar> rows;
    rows.probs = &probs;
    rows.k = probs.cols();
    if (ids.rows() == h.rows() && ids.cols() == rows.k) {  // else check reports the shapes
      rows.ids.resize(static_cast<std::size_t>(ids.rows() * rows.k));
      for (Index n = 0; n < ids.rows(); ++n)
        for (Index i = 0; i < rows.k; ++i)
          rows.ids[static_cast<std::size_t>(n * rows.k + i)] = static_cast<Index>(ids(n, i));
    }
    return soft_impl(comm, V, weight_grad, bias_grad, weight_shard, bias_shard, h,
                     detail::SparseSoftTargets<Scalar, Id>{ids, probs}, rows, hash, dh, extras, where);
  }

  // The soft-target call: every check (the targets' too) agreed across the ranks, the targets'
  // hash in the fingerprint, then the shard's pass. weight_grad null: the loss alone (dh null).
  template <typename Checked>
  CrossEntropyResult soft_impl(Communicator& comm, Index V, Parameter<Scalar>* weight_grad,
                               Parameter<Scalar>* bias_grad, const Parameter<Scalar>& weight_shard,
                               const Parameter<Scalar>* bias_shard, const ConstMatrixRef<Scalar>& h,
                               const Checked& checked, detail::SoftTargetRows<Scalar> rows, std::uint64_t target_hash,
                               MatrixRef<Scalar>* dh, const FusedHeadLossExtras<Scalar>& extras, const char* where) {
    const Index N = h.rows();
    // The class-index checks see N targets of class 0: every row counted, none out of range.
    const std::vector<std::int32_t> zeros(static_cast<std::size_t>(N), 0);
    const TypedTokenIds<std::int32_t> counted(zeros.data(), 1, N, N, 1);
    const detail::CommunicatorSlice<Scalar> slice = agree<std::int32_t>(
        comm, V, weight_shard, bias_shard, h, counted, dh, extras, where,
        [&] {
          detail::check_loss_options<Scalar>(where, options_, V);
          detail::check_soft_options(where, options_);
          checked.check(where, N, detail::classes_of(options_, V), V);
        },
        target_hash);
    rows.set_options(options_, detail::classes_of(options_, V));
    if (!dh)
      return detail::fused_head_loss_pass<Scalar, std::int32_t>(h, weight_shard.value(), bias_of(bias_shard), counted,
                                                                extras, nullptr, nullptr, nullptr, options_, workspace_,
                                                                where, &slice, &rows);
    OutputMap no_output(nullptr, 0, 1);
    const std::vector<Index>* trainable = weight_grad->frozen() ? nullptr : weight_grad->trainable_rows();
    OutputMap dW = weight_grad->frozen() ? no_output
                   : trainable           ? weight_grad->grad().masked_accumulator()
                                         : weight_grad->grad().dense_accumulator();
    OutputMap db = bias_grad && !bias_grad->frozen() ? bias_grad->grad().dense_accumulator() : no_output;
    MatrixRef<Scalar> dW_ref(dW), db_ref(db);
    return detail::fused_head_loss_pass<Scalar, std::int32_t>(h, weight_shard.value(), bias_of(bias_shard), counted,
                                                              extras, dh, &dW_ref, &db_ref, options_, workspace_, where,
                                                              &slice, &rows, trainable);
  }

  static Eigen::Map<const RowMatrix<Scalar>> bias_of(const Parameter<Scalar>* bias_shard) {
    if (bias_shard) return bias_shard->value();
    return {nullptr, 0, 1};
  }

  // Every check, agreed across the ranks (one small all-gather), then this rank's slice. Nothing
  // is written before it returns. dh is null for the loss alone.
  template <typename Id>
  detail::CommunicatorSlice<Scalar> agree(Communicator& comm, Index V, const Parameter<Scalar>& weight_shard,
                                          const Parameter<Scalar>* bias_shard, const ConstMatrixRef<Scalar>& h,
                                          const TypedTokenIds<Id>& targets, const MatrixRef<Scalar>* dh,
                                          const FusedHeadLossExtras<Scalar>& extras, const char* where,
                                          const std::function<void()>& more_checks = {},
                                          std::uint64_t more_fingerprint = 0) const {
    const int R = comm.size(), rank = comm.rank();
    VocabShard shard;
    auto checks = [&] {
      if (V < R) {
        std::ostringstream message;
        message << where << ": V = " << V << " outside [" << R << ", inf): each of the " << R
                << " ranks must own at least one row";
        throw value_error(message.str());
      }
      if (more_checks) more_checks();
      shard = vocab_shard(V, rank, R);
      detail::check_shard_shape(where, "weight_shard", weight_shard, shard, h.cols(), V, rank, R);
      if (bias_shard) detail::check_shard_shape(where, "bias_shard", *bias_shard, shard, 1, V, rank, R);
      detail::check_fused_head_loss<Scalar, Id>(where, h, shard.rows(), weight_shard.cols(), bias_of(bias_shard),
                                                targets, extras, dh, nullptr, nullptr, options_, V);
      detail::check_finite_inputs<Scalar, Scalar, Id>(where, h, weight_shard.value(), bias_of(bias_shard), targets,
                                                      options_, V, shard.begin);
    };
    // Whether dh is asked for is part of it: forward_shard on one rank and forward_backward_shard on
    // another would make different numbers of collectives.
    check_on_every_rank(comm, where, checks,
                        fingerprint(V, h, bias_shard != nullptr, dh != nullptr, targets, extras) ^ more_fingerprint,
                        "the call (forward or forward_backward), targets, per-token weights, shapes (N, d, V, bias) "
                        "or loss options");
    return detail::CommunicatorSlice<Scalar>(shard.begin, V, comm);
  }

  // What must be the same on every rank, hashed: N, d, V, whether there is a bias, whether dh is
  // computed, the loss options (all but vocab_block, which only orders this rank's sums; plan and
  // memory_budget set the number of collective steps), the targets and weights.
  template <typename Id>
  std::uint64_t fingerprint(Index V, const ConstMatrixRef<Scalar>& h, bool has_bias, bool gradient,
                            const TypedTokenIds<Id>& targets, const FusedHeadLossExtras<Scalar>& extras) const {
    const std::int64_t sizes[12] = {static_cast<std::int64_t>(h.rows()),
                                    static_cast<std::int64_t>(h.cols()),
                                    static_cast<std::int64_t>(V),
                                    has_bias ? 1 : 0,
                                    gradient ? 1 : 0,
                                    static_cast<std::int64_t>(options_.ignore_index),
                                    static_cast<std::int64_t>(options_.valid_vocab),
                                    static_cast<std::int64_t>(options_.plan),
                                    static_cast<std::int64_t>(options_.memory_budget),
                                    options_.error_if_nonfinite ? 1 : 0,
                                    options_.entropy || extras.entropy.size() != 0 ? 1 : 0,
                                    static_cast<std::int64_t>(options_.class_weights.size())};
    const double values[6] = {static_cast<double>(static_cast<int>(options_.reduction)),
                              options_.label_smoothing,
                              options_.z_loss,
                              options_.softcap,
                              options_.gradient_scale,
                              options_.entropy_bonus};
    std::uint64_t hash = detail::fingerprint_bytes(sizes, sizeof(sizes));
    hash = detail::fingerprint_bytes(values, sizeof(values), hash);
    hash = detail::fingerprint_bytes(options_.class_weights.data(), options_.class_weights.size() * sizeof(double),
                                     hash);
    hash = detail::fingerprint_ids(targets, hash);
    const std::int64_t weight_count = static_cast<std::int64_t>(extras.weights.size());
    hash = detail::fingerprint_bytes(&weight_count, sizeof(weight_count), hash);
    for (Index n = 0; n < extras.weights.size(); ++n) {
      const Scalar w = extras.weights.data()[n];
      hash = detail::fingerprint_bytes(&w, sizeof(w), hash);
    }
    return hash;
  }

  template <typename Id>
  CrossEntropyResult forward_backward_impl(Communicator& comm, Index V, Parameter<Scalar>& weight_shard,
                                           Parameter<Scalar>* bias_shard, const ConstMatrixRef<Scalar>& h,
                                           const TypedTokenIds<Id>& targets, MatrixRef<Scalar> dh,
                                           const FusedHeadLossExtras<Scalar>& extras, const char* where) {
    const detail::CommunicatorSlice<Scalar> slice = agree<Id>(comm, V, weight_shard, bias_shard, h, targets, &dh,
                                                              extras, where);
    // Only now, with every rank's checks passed: dense_accumulator() switches the gradient to
    // dense mode, which must not happen for a call that throws.
    // Trainable rows (a row mask on the shard, local ids): dW on those rows only.
    OutputMap no_output(nullptr, 0, 1);
    const std::vector<Index>* trainable = weight_shard.frozen() ? nullptr : weight_shard.trainable_rows();
    OutputMap dW = weight_shard.frozen() ? no_output
                   : trainable           ? weight_shard.grad().masked_accumulator()
                                         : weight_shard.grad().dense_accumulator();
    OutputMap db = bias_shard && !bias_shard->frozen() ? bias_shard->grad().dense_accumulator() : no_output;
    MatrixRef<Scalar> dW_ref(dW), db_ref(db);
    return detail::fused_head_loss_pass<Scalar, Id>(h, weight_shard.value(), bias_of(bias_shard), targets, extras, &dh,
                                                    &dW_ref, &db_ref, options_, workspace_, where, &slice, nullptr,
                                                    trainable);
  }

  template <typename Id>
  CrossEntropyResult forward_impl(Communicator& comm, Index V, const Parameter<Scalar>& weight_shard,
                                  const Parameter<Scalar>* bias_shard, const ConstMatrixRef<Scalar>& h,
                                  const TypedTokenIds<Id>& targets, const FusedHeadLossExtras<Scalar>& extras,
                                  const char* where) {
    const detail::CommunicatorSlice<Scalar> slice = agree<Id>(comm, V, weight_shard, bias_shard, h, targets, nullptr,
                                                              extras, where);
    return detail::fused_head_loss_pass<Scalar, Id>(h, weight_shard.value(), bias_of(bias_shard), targets, extras,
                                                    nullptr, nullptr, nullptr, options_, workspace_, where, &slice);
  }

  FusedHeadLossOptions options_;
  FusedHeadLossWorkspace<Scalar> workspace_;
};

}  // namespace embedhead

#endif  // EMBEDHEAD_PARALLEL_VOCAB_PARALLEL_FUSED_HEAD_LOSS_HPP
