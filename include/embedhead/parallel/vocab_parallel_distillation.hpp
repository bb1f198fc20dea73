// embedhead: distillation of the LM head (distillation.hpp) over a vocabulary shard.
//
// Each of R ranks holds rows [begin, end) = vocab_shard(V, rank, R) of the student head W [V, d] (and of its bias),
// and, for a teacher head, the same rows of W_T [V, d_T] (and of bias_T); h [N, d], h_T [N, d_T], the mask and the
// cached teacher log-probs are replicated. One call gives, on every rank, the loss and per-row losses that the
// single-process distill_* function computes on the whole heads, dh [N, d] (and dh_T [N, d_T]), and the shard's rows
// of dW, db (dW_T, db_T); neither model's [N, V] logits nor the whole W exist anywhere.
//
// The shard's pass is detail::distill_pass with a DistillSlice (below, over the Communicator), the same code as the
// single-process functions in vocabulary blocks (a shard always walks blocks: plan automatic is vocab_blocks here,
// token_chunks is refused): with one rank the result is theirs under plan vocab_blocks bit for bit; with more, the sums
// over the vocabulary are split differently, so it agrees to rounding. Per rank it costs the single-process pass on V /
// R rows (the KLs' loss and student gradient 12 N (V / R) d flops, jsd's 16, the teacher's gradient 4 more; cached
// log-probs replace the teacher's products) plus the collectives, the same number on every rank:
//   after pass 1  each row's maxima, the student's and the teacher's (one all-reduce max of 2 N doubles), then the
//                 sums of exponentials rescaled to them and the KLs' cross term X = sum_j exp(x_j - max) (x_j - y_j),
//                 rescaled with the sum it sits beside (one all-reduce sum of 3 N doubles);
//   after pass 2  each row's sums K (or K_p and K_q): one all-reduce sum of 2 N doubles, before the loss and jsd's
//                 gradient pass use them;
//   at the end    dh's N d partial sums (and dh_T's N d_T): one all-reduce each, with a gradient.
// A rank whose shard holds none of a row's top-k ids has max -inf and sum 0 there, and contributes 0. Memory per
// rank: two blocks of logits [N, vocab_block], vocab_block = 0 (automatic) chosen from the shard's V / R rows.
//
// Cached log-probs. Dense: every rank passes the whole replicated [N, V] teacher log-probs and reads its own columns
// [begin, end); each counted row's normalisation check (|log sum exp| <= 1e-3) runs over the whole row on every rank,
// so every rank decides alike. Top-k: ids [N, k] and log-probs [N, k] replicated, ids global in [0, V); each rank
// uses the ids in its shard, and the renormalisation over the k ids is the all-reduced teacher statistics of pass 1.
//
// Errors: every check runs on every rank through check_on_every_rank before the first collective, with a fingerprint
// of what must be replicated (N, d, d_T, V, whether there is a bias and a gradient, the options but vocab_block, the
// mask, and the cached log-probs and ids: every value, N V dense or 2 N k top-k), so a bad input on one rank -- or
// ranks fed different masks or teachers -- makes every rank throw the same exception, the message ending
// "[on rank r of R]" when R > 1, instead of hanging. h and h_T are not fingerprinted (a pass over N d values each
// call): they must be the same on every rank.
#ifndef EMBEDHEAD_PARALLEL_VOCAB_PARALLEL_DISTILLATION_HPP
#define EMBEDHEAD_PARALLEL_VOCAB_PARALLEL_DISTILLATION_HPP

#include "../distillation.hpp"
#include "../types.hpp"
#include "communicator.hpp"
#include "vocab_shard.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

namespace embedhead {

namespace detail {

// distill_pass's collective steps over a Communicator (distillation.hpp's DistillSlice).
template <typename Scalar>
struct CommunicatorDistillSlice final : DistillSlice<Scalar> {
  Communicator* comm;
  CommunicatorDistillSlice(Index begin, Communicator& communicator)
      : DistillSlice<Scalar>(begin), comm(&communicator) {}

  void combine_stats(DistillationWorkspace<Scalar>& ws, Index N, DistillKind kind) const override {
    if (N == 0) return;
    const std::size_t n = static_cast<std::size_t>(N);
    std::vector<double>& b = ws.reduced;
    b.resize(3 * n);
    for (std::size_t i = 0; i < n; ++i) {
      b[i] = ws.student_stats[i].max;
      b[n + i] = ws.teacher_stats[i].max;
    }
    comm->all_reduce_max(b.data(), static_cast<Index>(2 * n));
    for (std::size_t i = 0; i < n; ++i) {
      // X sits beside the weighting distribution's statistics at their max: rescaled by the same factor as S (0 when
      // no column had a non-zero exponential, as in accumulate_cross).
      SoftmaxRowStats& weighting = kind == DistillKind::rkl ? ws.student_stats[i] : ws.teacher_stats[i];
      const double new_max = kind == DistillKind::rkl ? b[i] : b[n + i];
      if (kind != DistillKind::jsd && ws.cross[i] != 0.0 && new_max > weighting.max)
        ws.cross[i] *= std::exp(weighting.max - new_max);
      ws.student_stats[i].rescale_to(b[i]);
      ws.teacher_stats[i].rescale_to(b[n + i]);
    }
    for (std::size_t i = 0; i < n; ++i) {
      b[i] = ws.student_stats[i].sum_exp;
      b[n + i] = ws.teacher_stats[i].sum_exp;
      b[2 * n + i] = ws.cross[i];
    }
    comm->all_reduce_sum(b.data(), static_cast<Index>(3 * n));
    for (std::size_t i = 0; i < n; ++i) {
      ws.student_stats[i].sum_exp = b[i];
      ws.teacher_stats[i].sum_exp = b[n + i];
      ws.cross[i] = b[2 * n + i];
    }
  }

  void combine_sums(DistillationWorkspace<Scalar>& ws, Index N) const override {
    if (N == 0) return;
    const std::size_t n = static_cast<std::size_t>(N);
    std::vector<double>& b = ws.reduced;
    b.resize(2 * n);
    std::copy_n(ws.sum_p.data(), n, b.data());
    std::copy_n(ws.sum_q.data(), n, b.data() + n);
    comm->all_reduce_sum(b.data(), static_cast<Index>(2 * n));
    std::copy_n(b.data(), n, ws.sum_p.data());
    std::copy_n(b.data() + n, n, ws.sum_q.data());
  }

  void sum_over_ranks(MatrixRef<Scalar>& dh) const override { all_reduce_sum_matrix<Scalar>(*comm, dh); }
};

// Which teacher a call has (part of the fingerprint).
enum class DistillTeacherKind : std::int64_t { head = 1, dense = 2, topk = 3 };

// Every check of the call agreed across the ranks (student_checks: the student's, common to every teacher;
// teacher_checks: the teacher's, given this rank's shard), then the shard's pass. Nothing is written before the
// checks pass on every rank. dh null: the loss alone.
template <typename Scalar>
DistillationResult vocab_parallel_distill(
    Communicator& comm, Index V, const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W_shard,
    const ConstMatrixRef<Scalar>& bias_shard, const TeacherSource<Scalar>& teacher, MatrixRef<Scalar>* dh,
    MatrixRef<Scalar>* dW, MatrixRef<Scalar>* db, DistillationWorkspace<Scalar>& ws, const DistillationOptions& options,
    const DistillationExtras<Scalar>& extras, const char* where, DistillTeacherKind teacher_kind, bool teacher_gradient,
    const std::function<void(const VocabShard&)>& teacher_checks, std::uint64_t teacher_hash) {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");
  const int R = comm.size(), rank = comm.rank();
  VocabShard shard;
  auto checks = [&] {
    check_vocab_over_ranks(where, V, R);
    if (options.plan == FusedPlan::token_chunks)
      throw value_error(std::string(where) +
                        ": plan token_chunks outside {automatic, vocab_blocks} over a vocabulary shard (it walks "
                        "blocks of the vocabulary)");
    shard = vocab_shard(V, rank, R);
    check_shard_shape(where, "W_shard", W_shard, shard, h.cols(), V, rank, R);
    if (bias_shard.size() != 0) check_shard_shape(where, "bias_shard", bias_shard, shard, 1, V, rank, R);
    check_distill_common(where, h, W_shard, bias_shard, dh, dW, db, options, extras);
    teacher_checks(shard);
  };
  // What decides the collectives and the values every rank must share; vocab_block only orders this rank's sums.
  std::uint64_t hash = fingerprint_values(
      {static_cast<std::int64_t>(h.rows()), static_cast<std::int64_t>(h.cols()), static_cast<std::int64_t>(V),
       bias_shard.size() != 0 ? 1 : 0, dh != nullptr ? 1 : 0, teacher_gradient ? 1 : 0,
       static_cast<std::int64_t>(teacher_kind), static_cast<std::int64_t>(options.divergence),
       static_cast<std::int64_t>(options.reduction), static_cast<std::int64_t>(teacher_hash)});
  hash = fingerprint_double(options.temperature, hash);
  hash = fingerprint_double(options.beta, hash);
  hash = fingerprint_matrix<Scalar>(extras.mask, hash);
  check_on_every_rank(comm, where, checks, hash,
                      "the call (loss or gradient), shapes (N, d, d_T, V, bias), options, mask or teacher");
  const CommunicatorDistillSlice<Scalar> slice(shard.begin, comm);
  return distill_pass<Scalar>(h, W_shard, bias_shard, teacher, dh, dW, db, ws, options, extras, &slice);
}

template <typename Scalar>
DistillationResult vocab_parallel_distill_head_impl(
    Communicator& comm, Index V, const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W,
    const ConstMatrixRef<Scalar>& bias, const ConstMatrixRef<Scalar>& h_T, const ConstMatrixRef<Scalar>& W_T,
    const ConstMatrixRef<Scalar>& bias_T, MatrixRef<Scalar>* dh, MatrixRef<Scalar>* dW, MatrixRef<Scalar>* db,
    MatrixRef<Scalar>* dh_T, MatrixRef<Scalar>* dW_T, MatrixRef<Scalar>* db_T, DistillationWorkspace<Scalar>& ws,
    const DistillationOptions& options, const DistillationExtras<Scalar>& extras, const char* where) {
  HeadTeacher<Scalar> head{&h_T, &W_T, &bias_T, dh_T, dW_T, db_T};
  TeacherSource<Scalar> teacher;
  teacher.head = &head;
  const bool teacher_gradient = dh && dh_T && dh_T->size() != 0;
  const std::uint64_t teacher_hash = fingerprint_values(
      {static_cast<std::int64_t>(h_T.cols()), bias_T.size() != 0 ? 1 : 0});
  return vocab_parallel_distill<Scalar>(
      comm, V, h, W, bias, teacher, dh, dW, db, ws, options, extras, where, DistillTeacherKind::head, teacher_gradient,
      [&](const VocabShard& shard) {
        const int R = comm.size(), rank = comm.rank();
        check_shard_shape(where, "W_T_shard", W_T, shard, h_T.cols(), V, rank, R);
        if (bias_T.size() != 0) check_shard_shape(where, "bias_T_shard", bias_T, shard, 1, V, rank, R);
        check_distill_head_teacher(where, h, W, h_T, W_T, bias_T, dh_T, dW_T, db_T);
      },
      teacher_hash);
}

template <typename Scalar>
DistillationResult vocab_parallel_distill_dense_impl(
    Communicator& comm, Index V, const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W,
    const ConstMatrixRef<Scalar>& bias, const ConstMatrixRef<Scalar>& logprobs, MatrixRef<Scalar>* dh,
    MatrixRef<Scalar>* dW, MatrixRef<Scalar>* db, DistillationWorkspace<Scalar>& ws, const DistillationOptions& options,
    const DistillationExtras<Scalar>& extras, const char* where) {
  TeacherSource<Scalar> teacher;
  teacher.dense = &logprobs;
  return vocab_parallel_distill<Scalar>(
      comm, V, h, W, bias, teacher, dh, dW, db, ws, options, extras, where, DistillTeacherKind::dense, false,
      [&](const VocabShard&) { check_distill_dense(where, h.rows(), V, logprobs, options, extras); },
      fingerprint_matrix<Scalar>(logprobs));
}

template <typename Scalar>
DistillationResult vocab_parallel_distill_topk_impl(Communicator& comm, Index V, const ConstMatrixRef<Scalar>& h,
                                                    const ConstMatrixRef<Scalar>& W, const ConstMatrixRef<Scalar>& bias,
                                                    const TeacherTopK<Scalar>& top, MatrixRef<Scalar>* dh,
                                                    MatrixRef<Scalar>* dW, MatrixRef<Scalar>* db,
                                                    DistillationWorkspace<Scalar>& ws,
                                                    const DistillationOptions& options,
                                                    const DistillationExtras<Scalar>& extras, const char* where) {
  TeacherSource<Scalar> teacher;
  const std::uint64_t hash = top.ids.visit(
      [&](const auto& typed) { return fingerprint_ids(typed, fingerprint_matrix<Scalar>(top.logprobs)); });
  return vocab_parallel_distill<Scalar>(
      comm, V, h, W, bias, teacher, dh, dW, db, ws, options, extras, where, DistillTeacherKind::topk, false,
      [&](const VocabShard&) { check_distill_topk(where, h.rows(), V, top, options, extras, teacher, ws); }, hash);
}

}  // namespace detail

// Common arguments (as distillation.hpp's, on a shard): comm, every rank of which calls alike (collective); V the
// global vocabulary; h [N, d] replicated; W_shard [rows, d] and bias_shard [rows, 1] (empty: none) rows [begin, end)
// of the student's W and bias, rows = end - begin, [begin, end) = vocab_shard(V, comm.rank(), comm.size()); options
// and extras (mask [N, 1] in, replicated; losses [N, 1] out, replicated) as the single-process functions'. Outputs:
// dh [N, d] written (replicated: the sum over the ranks), dW_shard [rows, d] += and db_shard [rows, 1] += (each
// skipped when empty). The result (loss, sum, count) is the same on every rank.
// \throws value_error for V < comm.size(), and as the single-process function for its options, mask and cached
//   log-probs; shape_error for a shard not [rows, ...] (named with its rows [begin, end) and rank) or any other shape
//   that disagrees; index_error for a top-k id outside [0, V); value_error for a mask, teacher, shape or option (but
//   vocab_block) that differs across ranks, or for a loss-only call on one rank and a gradient call on another. On
//   every rank alike (the message of the lowest failing rank, ending "[on rank r of R]" when R > 1); nothing is
//   written on throw. \pre no output aliases an input or another output; h (and h_T) the same on every rank.

// h [N, d], W_shard [rows, d], bias_shard [rows, 1] or empty, h_T [N, d_T], W_T_shard [rows, d_T] (the same rows of
// the teacher's W_T), bias_T_shard [rows, 1] or empty -> loss; dh [N, d] written, dW_shard [rows, d] +=, db_shard
// [rows, 1] +=; dh_T [N, d_T] written, dW_T_shard [rows, d_T] +=, db_T_shard [rows, 1] += when not empty (dW_T_shard
// and db_T_shard need dh_T; dh_T empty on every rank or none). \throws as above (the common arguments).
template <typename Scalar>
DistillationResult vocab_parallel_distill_head_forward_backward(
    Communicator& comm, Index V, const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W_shard,
    const ConstMatrixRef<Scalar>& bias_shard, const ConstMatrixRef<Scalar>& h_T,
    const ConstMatrixRef<Scalar>& W_T_shard, const ConstMatrixRef<Scalar>& bias_T_shard, MatrixRef<Scalar> dh,
    MatrixRef<Scalar> dW_shard, MatrixRef<Scalar> db_shard, MatrixRef<Scalar> dh_T, MatrixRef<Scalar> dW_T_shard,
    MatrixRef<Scalar> db_T_shard, DistillationWorkspace<Scalar>& workspace, const DistillationOptions& options = {},
    const DistillationExtras<Scalar>& extras = {}) {
  return detail::vocab_parallel_distill_head_impl<Scalar>(comm, V, h, W_shard, bias_shard, h_T, W_T_shard, bias_T_shard,
                                                          &dh, &dW_shard, &db_shard, &dh_T, &dW_T_shard, &db_T_shard,
                                                          workspace, options, extras,
                                                          "vocab_parallel_distill_head_forward_backward");
}

// h [N, d], W_shard [rows, d], bias_shard, h_T [N, d_T], W_T_shard [rows, d_T], bias_T_shard -> the loss alone.
// \throws as above (the common arguments).
template <typename Scalar>
DistillationResult vocab_parallel_distill_head(
    Communicator& comm, Index V, const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W_shard,
    const ConstMatrixRef<Scalar>& bias_shard, const ConstMatrixRef<Scalar>& h_T,
    const ConstMatrixRef<Scalar>& W_T_shard, const ConstMatrixRef<Scalar>& bias_T_shard,
    DistillationWorkspace<Scalar>& workspace, const DistillationOptions& options = {},
    const DistillationExtras<Scalar>& extras = {}) {
  return detail::vocab_parallel_distill_head_impl<Scalar>(comm, V, h, W_shard, bias_shard, h_T, W_T_shard, bias_T_shard,
                                                          nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                                          workspace, options, extras, "vocab_parallel_distill_head");
}

// h [N, d], W_shard [rows, d], bias_shard [rows, 1] or empty, teacher log-probs [N, V] (the whole rows, replicated)
// -> loss; dh [N, d] written, dW_shard [rows, d] +=, db_shard [rows, 1] +=. \throws as above (the common arguments).
template <typename Scalar>
DistillationResult vocab_parallel_distill_logprobs_forward_backward(
    Communicator& comm, Index V, const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W_shard,
    const ConstMatrixRef<Scalar>& bias_shard, const ConstMatrixRef<Scalar>& teacher_logprobs, MatrixRef<Scalar> dh,
    MatrixRef<Scalar> dW_shard, MatrixRef<Scalar> db_shard, DistillationWorkspace<Scalar>& workspace,
    const DistillationOptions& options = {}, const DistillationExtras<Scalar>& extras = {}) {
  return detail::vocab_parallel_distill_dense_impl<Scalar>(comm, V, h, W_shard, bias_shard, teacher_logprobs, &dh,
                                                           &dW_shard, &db_shard, workspace, options, extras,
                                                           "vocab_parallel_distill_logprobs_forward_backward");
}

// h [N, d], W_shard [rows, d], bias_shard, teacher log-probs [N, V] replicated -> the loss alone.
// \throws as above (the common arguments).
template <typename Scalar>
DistillationResult vocab_parallel_distill_logprobs(Communicator& comm, Index V, const ConstMatrixRef<Scalar>& h,
                                                   const ConstMatrixRef<Scalar>& W_shard,
                                                   const ConstMatrixRef<Scalar>& bias_shard,
                                                   const ConstMatrixRef<Scalar>& teacher_logprobs,
                                                   DistillationWorkspace<Scalar>& workspace,
                                                   const DistillationOptions& options = {},
                                                   const DistillationExtras<Scalar>& extras = {}) {
  return detail::vocab_parallel_distill_dense_impl<Scalar>(comm, V, h, W_shard, bias_shard, teacher_logprobs, nullptr,
                                                           nullptr, nullptr, workspace, options, extras,
                                                           "vocab_parallel_distill_logprobs");
}

// h [N, d], W_shard [rows, d], bias_shard [rows, 1] or empty, top-k {ids [N, k] global in [0, V), log-probs [N, k]},
// replicated -> loss (forward_kl over the renormalised top-k support); dh [N, d] written, dW_shard [rows, d] +=,
// db_shard [rows, 1] +=. \throws as above (the common arguments), and as distill_topk for k, the ids and the
// divergence.
template <typename Scalar>
DistillationResult vocab_parallel_distill_topk_forward_backward(
    Communicator& comm, Index V, const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W_shard,
    const ConstMatrixRef<Scalar>& bias_shard, const TeacherTopK<Scalar>& teacher, MatrixRef<Scalar> dh,
    MatrixRef<Scalar> dW_shard, MatrixRef<Scalar> db_shard, DistillationWorkspace<Scalar>& workspace,
    const DistillationOptions& options = {}, const DistillationExtras<Scalar>& extras = {}) {
  return detail::vocab_parallel_distill_topk_impl<Scalar>(comm, V, h, W_shard, bias_shard, teacher, &dh, &dW_shard,
                                                          &db_shard, workspace, options, extras,
                                                          "vocab_parallel_distill_topk_forward_backward");
}

// h [N, d], W_shard [rows, d], bias_shard, top-k {ids [N, k], log-probs [N, k]} replicated -> the loss alone.
// \throws as vocab_parallel_distill_topk_forward_backward.
template <typename Scalar>
DistillationResult vocab_parallel_distill_topk(Communicator& comm, Index V, const ConstMatrixRef<Scalar>& h,
                                               const ConstMatrixRef<Scalar>& W_shard,
                                               const ConstMatrixRef<Scalar>& bias_shard,
                                               const TeacherTopK<Scalar>& teacher,
                                               DistillationWorkspace<Scalar>& workspace,
                                               const DistillationOptions& options = {},
                                               const DistillationExtras<Scalar>& extras = {}) {
  return detail::vocab_parallel_distill_topk_impl<Scalar>(comm, V, h, W_shard, bias_shard, teacher, nullptr, nullptr,
                                                          nullptr, workspace, options, extras,
                                                          "vocab_parallel_distill_topk");
}

}  // namespace embedhead

#endif  // EMBEDHEAD_PARALLEL_VOCAB_PARALLEL_DISTILLATION_HPP
