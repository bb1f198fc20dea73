// embedhead: the vocabulary-parallel cross-entropy (vocab_shard.hpp has the design): the
// full-vocabulary softmax from each rank's columns -- an all-reduce max of the N row maxima, then
// one all-reduce sum of the N partial sum_exp, target logits (and logit sums for label smoothing);
// dlocal = this rank's columns of the full dlogits. The [N, V] logits exist nowhere. Soft targets
// (vocab_parallel_cross_entropy_soft*): the same passes, each row's sum_c v_c s_c over this rank's
// classes in place of s_y (cross_entropy.hpp).
#ifndef EMBEDHEAD_PARALLEL_VOCAB_PARALLEL_CROSS_ENTROPY_HPP
#define EMBEDHEAD_PARALLEL_VOCAB_PARALLEL_CROSS_ENTROPY_HPP

#include "../cross_entropy.hpp"
#include "../detail/checks.hpp"
#include "../detail/softmax.hpp"
#include "../types.hpp"
#include "communicator.hpp"
#include "vocab_shard.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <limits>
#include <memory>
#include <sstream>
#include <type_traits>
#include <utility>
#include <vector>

namespace embedhead {

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
// Soft targets (soft not null; targets then N class-0 ids, for the shared checks): soft_check(N,
// C) checks them (on every rank, before any collective), soft_hash is their fingerprint, and each
// row's statistic sum_c v_c s_c is summed over this rank's classes as s_y is.
template <typename Scalar, typename Id>
CrossEntropyResult vocab_parallel_cross_entropy_pass(Communicator& comm, Index V,
                                                     const ConstMatrixRef<Scalar>& local_logits,
                                                     const TypedTokenIds<Id>& targets, MatrixRef<Scalar>* dlocal,
                                                     const CrossEntropyOptions& options, const char* where,
                                                     const SoftTargetRows<Scalar>* soft = nullptr,
                                                     const std::function<void(Index, Index)>& soft_check = {},
                                                     std::uint64_t soft_hash = 0) {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");
  const Index N = local_logits.rows(), T = targets.cols();
  VocabShard shard;
  std::uint64_t fingerprint = fingerprint_values({V, N, options.ignore_index,
                                                  static_cast<std::int64_t>(options.reduction), options.valid_vocab,
                                                  options.error_if_nonfinite ? 1 : 0, options.entropy ? 1 : 0});
  for (const double x : {options.label_smoothing, options.z_loss, options.softcap, options.gradient_scale,
                         options.entropy_bonus, static_cast<double>(options.class_weights.size())})
    fingerprint = fingerprint_double(x, fingerprint);
  for (const double u : options.class_weights) fingerprint = fingerprint_double(u, fingerprint);
  check_on_every_rank(
      comm, where,
      [&] {
        check_size(where, "V", V);
        check_vocab_over_ranks(where, V, comm.size());
        shard = vocab_shard(V, comm.rank(), comm.size());
        check_shape(where, "local_logits", local_logits, N, shard.rows());
        if (dlocal) check_shape(where, "dlocal_logits", *dlocal, N, shard.rows());
        check_loss_options<Scalar>(where, options, V);
        if (soft) {
          check_soft_options(where, options);
          soft_check(N, classes_of(options, V));
        }
        check_targets(where, targets, N, classes_of(options, V), options.ignore_index, V);
        // This rank's classes only; the lowest failing rank's message is everyone's.
        check_finite_logits(where, local_logits, targets,
                            std::clamp<Index>(classes_of(options, V) - shard.begin, 0, shard.rows()), options,
                            shard.begin);
      },
      fingerprint_ids(targets, fingerprint) ^ soft_hash, "the targets, N, V or the loss options");

  const Index classes = classes_of(options, V);
  // This rank's classes: local columns [0, local_classes); the rest are vocabulary padding.
  const Index local_classes = std::clamp<Index>(classes - shard.begin, 0, shard.rows());
  const SoftmaxTerms terms = softmax_terms(options, classes);
  const bool softcap = options.softcap > 0;
  const bool gradient = dlocal != nullptr;
  // Without soft-capping pass 2 leaves exp(s - m) in dlocal for the gradient, unless the entropy
  // bonus's gradient needs s itself (then dlocal gets the logits in pass 3).
  // Nor with class weights under label smoothing (b_j needs the column's weight, not exp(s - m)).
  // Nor with soft targets (b_j = w v_j needs the column).
  const bool exp_in_d = gradient && !softcap && terms.entropy_bonus == 0 &&
                        !(terms.class_weights && terms.logit_sums()) && !soft;

  CrossEntropyResult result;
  for (Index n = 0; n < N; ++n) {
    const Index y = static_cast<Index>(targets(n / T, n % T));
    if (y == options.ignore_index) continue;
    ++result.count;
    if (terms.class_weights && !soft) result.weight_sum += terms.target_weight(y);
  }
  if (!terms.class_weights || soft) result.weight_sum = static_cast<double>(result.count);
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

  // Soft targets: each row's T_n, and v over this rank's classes (at least one value: the row's
  // terms need a non-null v even on a rank with no class).
  std::vector<double> soft_mass(soft ? static_cast<std::size_t>(N) : 0);
  std::vector<double> soft_v(soft ? static_cast<std::size_t>(std::max<Index>(1, local_classes)) : 0);
  if (soft)
    for (Index n = 0; n < N; ++n) soft_mass[static_cast<std::size_t>(n)] = soft->mass(n);
  auto soft_terms = [&](Index n, bool fill) {
    SoftmaxTerms row_terms = terms;
    if (fill && local_classes > 0) soft->fill_block(n, shard.begin, local_classes, soft_v.data());
    row_terms.soft_targets = soft_v.data();
    row_terms.soft_mass = soft_mass[static_cast<std::size_t>(n)];
    return row_terms;
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
    if (soft)  // v over this rank's classes, from column 0 of soft_v
      stats[static_cast<std::size_t>(n)].add_at_max(s, local_classes, -1, soft_terms(n, true),
                                                    static_cast<Scalar*>(nullptr), 0);
    else
      stats[static_cast<std::size_t>(n)].add_at_max(s, local_classes, y - shard.begin, terms,
                                                    exp_in_d ? dlocal->row(n).data() : nullptr, shard.begin);
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
    const SoftmaxTerms row_terms = soft ? soft_terms(n, false) : terms;
    const RowLoss row = soft ? row_loss(row_stats, row_terms) : row_loss(row_stats, terms, terms.target_weight(y));
    add_row_loss<Scalar>(row, 1.0, result, nullptr, n);
    if (!gradient) continue;

    auto d_row = dlocal->row(n);
    if (local_classes < shard.rows()) d_row.tail(shard.rows() - local_classes).setZero();
    if (local_classes == 0) continue;
    if (!softcap && !exp_in_d && d_row.data() != local_logits.row(n).data())
      std::copy_n(local_logits.row(n).data(), local_classes, d_row.data());
    if (soft) {
      const SoftmaxTerms filled = soft_terms(n, true);
      apply_softmax_gradient(d_row.data(), local_classes, -1,
                             softmax_gradient_at_max<Scalar>(row_stats, row, scale, filled), filled,
                             /*holds_exp=*/false, 0);
      continue;
    }
    apply_softmax_gradient(d_row.data(), local_classes, y - shard.begin,
                           softmax_gradient_at_max<Scalar>(row_stats, row, scale, terms), terms,
                           /*holds_exp=*/exp_in_d, shard.begin);
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
// targets, N, V or options that differ across ranks, or with error_if_nonfinite a NaN or infinite
// logit among a rank's classes of the counted rows (named with its global column; the lowest
// failing rank's). Non-finite logits otherwise give cross_entropy's results (docs/errors.md).
// Cost: 3 passes over the local logits.
template <typename Scalar>
CrossEntropyResult vocab_parallel_cross_entropy_forward_backward(Communicator& comm, Index V,
                                                                 const ConstMatrixRef<Scalar>& local_logits,
                                                                 TokenIds targets, MatrixRef<Scalar> dlocal_logits,
                                                                 const CrossEntropyOptions& options = {}) {
  return targets.visit([&](const auto& typed) {
    return detail::vocab_parallel_cross_entropy_pass<Scalar>(comm, V, local_logits, typed, &dlocal_logits, options,
                                                             "vocab_parallel_cross_entropy_forward_backward");
  });
}

// local_logits [N, shard.rows()], targets (N global ids) -> the loss only (replicated).
// Collective, as above. \throws as vocab_parallel_cross_entropy_forward_backward.
template <typename Scalar>
CrossEntropyResult vocab_parallel_cross_entropy(Communicator& comm, Index V, const ConstMatrixRef<Scalar>& local_logits,
                                                TokenIds targets, const CrossEntropyOptions& options = {}) {
  return targets.visit([&](const auto& typed) {
    return detail::vocab_parallel_cross_entropy_pass<Scalar>(comm, V, local_logits, typed, nullptr, options,
                                                             "vocab_parallel_cross_entropy");
  });
}

// ---- soft (probability) targets (cross_entropy.hpp: PyTorch's semantics, the mean divides by N) ----
// local_logits [N, shard.rows()], targets dense [N, C] (or [N, V]) or SparseTargets [N, k], global
// and replicated (fingerprinted: every value) -> the CrossEntropyResult cross_entropy_soft gives
// on the full logits (replicated); dlocal_logits [N, shard.rows()] = this rank's columns of its
// dlogits. Collective, as above. \throws as vocab_parallel_cross_entropy_forward_backward and as
// cross_entropy_soft for the targets, on every rank alike; nothing written on throw.

namespace detail {

template <typename Scalar>
std::uint64_t soft_targets_fingerprint(const ConstMatrixRef<Scalar>& m, std::uint64_t hash = 0xcbf29ce484222325ULL) {
  const std::int64_t shape[2] = {static_cast<std::int64_t>(m.rows()), static_cast<std::int64_t>(m.cols())};
  hash = fingerprint_bytes(shape, sizeof(shape), hash);
  for (Index n = 0; n < m.rows(); ++n)
    hash = fingerprint_bytes(m.row(n).data(), static_cast<std::size_t>(m.cols()) * sizeof(Scalar), hash);
  return hash;
}

template <typename Scalar>
CrossEntropyResult vocab_parallel_soft_dense(Communicator& comm, Index V, const ConstMatrixRef<Scalar>& local_logits,
                                             const ConstMatrixRef<Scalar>& targets, MatrixRef<Scalar>* dlocal,
                                             const CrossEntropyOptions& options, const char* where) {
  const Index N = local_logits.rows();
  SoftTargetRows<Scalar> rows;
  rows.dense = &targets;
  rows.set_options(options, options.valid_vocab == -1 ? V : options.valid_vocab);
  const std::vector<std::int32_t> zeros(static_cast<std::size_t>(N), 0);
  const TypedTokenIds<std::int32_t> counted(zeros.data(), 1, N, N, 1);
  return vocab_parallel_cross_entropy_pass<Scalar>(
      comm, V, local_logits, counted, dlocal, options, where, &rows,
      [&](Index rows_n, Index C) { DenseSoftTargets<Scalar>{targets}.check(where, rows_n, C, V); },
      soft_targets_fingerprint(targets));
}

template <typename Scalar>
CrossEntropyResult vocab_parallel_soft_sparse(Communicator& comm, Index V, const ConstMatrixRef<Scalar>& local_logits,
                                              const SparseTargets<Scalar>& targets, MatrixRef<Scalar>* dlocal,
                                              const CrossEntropyOptions& options, const char* where) {
  return targets.ids.visit([&](const auto& typed) {
    using Id = typename std::decay_t<decltype(typed)>::id_type;
    const Index N = local_logits.rows();
    SoftTargetRows<Scalar> rows;
    rows.probs = &targets.probs;
    rows.k = targets.probs.cols();
    rows.set_options(options, options.valid_vocab == -1 ? V : options.valid_vocab);
    if (typed.rows() == N && typed.cols() == rows.k) {  // else the check reports the shapes
      rows.ids.resize(static_cast<std::size_t>(N * rows.k));
      for (Index n = 0; n < N; ++n)
        for (Index i = 0; i < rows.k; ++i)
          rows.ids[static_cast<std::size_t>(n * rows.k + i)] = static_cast<Index>(typed(n, i));
    }
    const std::vector<std::int32_t> zeros(static_cast<std::size_t>(N), 0);
    const TypedTokenIds<std::int32_t> counted(zeros.data(), 1, N, N, 1);
    return vocab_parallel_cross_entropy_pass<Scalar>(
        comm, V, local_logits, counted, dlocal, options, where, &rows,
        [&](Index rows_n, Index C) {
          SparseSoftTargets<Scalar, Id>{typed, targets.probs}.check(where, rows_n, C, V);
        },
        fingerprint_ids(typed, soft_targets_fingerprint(targets.probs)));
  });
}

}  // namespace detail

// Dense soft targets [N, C] (or [N, V]) -> loss; dlocal_logits [N, shard.rows()].
template <typename Scalar>
CrossEntropyResult vocab_parallel_cross_entropy_soft_forward_backward(Communicator& comm, Index V,
                                                                      const ConstMatrixRef<Scalar>& local_logits,
                                                                      const ConstMatrixRef<Scalar>& targets,
                                                                      MatrixRef<Scalar> dlocal_logits,
                                                                      const CrossEntropyOptions& options = {}) {
  return detail::vocab_parallel_soft_dense<Scalar>(comm, V, local_logits, targets, &dlocal_logits, options,
                                                   "vocab_parallel_cross_entropy_soft_forward_backward");
}

// Sparse soft targets (ids [N, k], probs [N, k]) -> loss; dlocal_logits [N, shard.rows()].
template <typename Scalar>
CrossEntropyResult vocab_parallel_cross_entropy_soft_forward_backward(Communicator& comm, Index V,
                                                                      const ConstMatrixRef<Scalar>& local_logits,
                                                                      const SparseTargets<Scalar>& targets,
                                                                      MatrixRef<Scalar> dlocal_logits,
                                                                      const CrossEntropyOptions& options = {}) {
  return detail::vocab_parallel_soft_sparse<Scalar>(comm, V, local_logits, targets, &dlocal_logits, options,
                                                    "vocab_parallel_cross_entropy_soft_forward_backward");
}

// The loss only, dense or sparse soft targets.
template <typename Scalar>
CrossEntropyResult vocab_parallel_cross_entropy_soft(Communicator& comm, Index V,
                                                     const ConstMatrixRef<Scalar>& local_logits,
                                                     const ConstMatrixRef<Scalar>& targets,
                                                     const CrossEntropyOptions& options = {}) {
  return detail::vocab_parallel_soft_dense<Scalar>(comm, V, local_logits, targets, nullptr, options,
                                                   "vocab_parallel_cross_entropy_soft");
}
template <typename Scalar>
CrossEntropyResult vocab_parallel_cross_entropy_soft(Communicator& comm, Index V,
                                                     const ConstMatrixRef<Scalar>& local_logits,
                                                     const SparseTargets<Scalar>& targets,
                                                     const CrossEntropyOptions& options = {}) {
  return detail::vocab_parallel_soft_sparse<Scalar>(comm, V, local_logits, targets, nullptr, options,
                                                    "vocab_parallel_cross_entropy_soft");
}

}  // namespace embedhead

#endif  // EMBEDHEAD_PARALLEL_VOCAB_PARALLEL_CROSS_ENTROPY_HPP
