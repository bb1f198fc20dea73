// embedhead: the LM head and its cross-entropy fused, in chunks of tokens, so the [N, V] logits
// never exist.
//
// For hidden states h [N, d], the head W [V, d] (+ bias b [V]) and targets y [N], one call gives
//   loss                     = reduce_n w_n (ce_n + z_loss lse_n^2)       (cross_entropy.hpp)
//   dh  [N, d]  (written)    = dz W
//   dW  [V, d]  (accumulated)+= dz^T h
//   db  [V]     (accumulated)+= column sums of dz
// with dz = d loss / d logits, exactly what OutputProjection::forward + cross_entropy_forward_
// backward + OutputProjection::backward compute (the unfused path), at 1/(N / token_chunk) of
// their memory: the tokens are taken token_chunk at a time (ignored tokens are skipped before
// any arithmetic), their logits [token_chunk, V] are computed, turned into dz in place, and used
// for the chunk's dW and dh before the next chunk overwrites them. The arithmetic is the same
// three GEMMs as the unfused path (6 N V d flops, nothing recomputed); what changes is that W and
// dW are streamed once per chunk instead of once per call.
//
// Every option of the plain loss applies (CrossEntropyOptions: ignore_index, reductions, label
// smoothing, z-loss, soft-capping, a padded vocabulary, gradient_scale), plus per-token weights
// w_n >= 0 (mean divides by their sum over counted tokens), the log-sum-exp of every row as an
// output (for z-loss monitoring), and per-token losses (Reduction::none).
//
// Threads (when built with OpenMP): each GEMM is cut into fixed blocks -- of V rows for the
// logits and dW, of d columns for dh -- and each row's loss is computed by one thread, so the
// result is bit-identical for any thread count and across runs. Ideas from Liger-Kernel's fused
// linear cross-entropy (token chunks; Hsu et al. 2024) and Cut Cross-Entropy (Wijmans et al.
// 2024); the code is this library's own.
#ifndef EMBEDHEAD_FUSED_HEAD_LOSS_HPP
#define EMBEDHEAD_FUSED_HEAD_LOSS_HPP

#include "cross_entropy.hpp"
#include "detail/checks.hpp"
#include "detail/kernels.hpp"
#include "output_projection.hpp"
#include "types.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace embedhead {

struct FusedHeadLossOptions : CrossEntropyOptions {
  // Tokens per chunk; 0 picks one so that a chunk's logits take at most max(1 MiB, 2 % of the
  // full [N, V] logits) and at least 16 rows -- measured in bench/fused_head_loss_bench.cpp.
  Index token_chunk = 0;
};

// Buffers reused across calls, so the steady state allocates nothing but Eigen's GEMM packing
// buffers. Contents are internal; a default-constructed one is always valid.
template <typename Scalar>
struct FusedHeadLossWorkspace {
  std::vector<Scalar> hidden;        // [chunk, d] the chunk's hidden rows, gathered
  std::vector<Scalar> logits;        // [chunk, V] its logits, then dz in place
  std::vector<Scalar> dhidden;       // [chunk, d] its dh
  std::vector<Index> tokens;         // token index n of each chunk row
  std::vector<detail::RowLoss> rows;  // each chunk row's loss terms
};

namespace detail {

// Fixed block sizes: they define the order of every floating-point operation, so they must not
// depend on the thread count.
constexpr Index kFusedVocabBlock = 2048;  // rows of W per logits / dW GEMM
constexpr Index kFusedDimBlock = 128;     // columns of W per dh GEMM

// Calls body(i) for i in [0, count), spread over the OpenMP threads (static schedule). With more
// than one thread the region is entered even for one block, so Eigen's own GEMM threading (which
// would change the summation order) never starts inside body.
template <typename Body>
void parallel_blocks(Index count, const Body& body) {
#ifdef _OPENMP
  if (omp_get_max_threads() > 1 && !omp_in_parallel()) {
#pragma omp parallel for schedule(static)
    for (Index i = 0; i < count; ++i) body(i);
    return;
  }
#endif
  for (Index i = 0; i < count; ++i) body(i);
}

inline Index fused_token_chunk(Index option, Index N, Index classes, std::size_t scalar_bytes) {
  if (option > 0) return option;
  const double logits_bytes = static_cast<double>(N) * static_cast<double>(classes) * static_cast<double>(scalar_bytes);
  const double budget = std::max(1024.0 * 1024.0, 0.02 * logits_bytes);
  const double row_bytes = static_cast<double>(classes) * static_cast<double>(scalar_bytes);
  const Index rows = static_cast<Index>(budget / row_bytes);
  return std::max<Index>(16, std::min<Index>(rows, std::max<Index>(N, 1)));
}

template <typename Scalar, typename Id>
CrossEntropyResult fused_head_loss_pass(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W,
                                        const ConstMatrixRef<Scalar>& bias, const ConstIdRef<Id>& targets,
                                        const ConstMatrixRef<Scalar>& weights, MatrixRef<Scalar>* dh,
                                        MatrixRef<Scalar>* dW, MatrixRef<Scalar>* db, MatrixRef<Scalar>* lse,
                                        MatrixRef<Scalar>* losses, const FusedHeadLossOptions& options,
                                        FusedHeadLossWorkspace<Scalar>& ws, const char* where) {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");
  const Index N = h.rows(), V = W.rows(), d = W.cols(), T = targets.cols();
  // ---- every check before anything is written ----
  check_shape(where, "h", h, N, d);
  if (bias.size() != 0) check_shape(where, "bias", bias, V, 1);
  if (weights.size() != 0) check_shape(where, "weights", weights, N, 1);
  if (dh) check_shape(where, "dh", *dh, N, d);
  if (dW) check_shape(where, "dW", *dW, V, d);
  if (db && db->size() != 0) check_shape(where, "db", *db, V, 1);
  if (lse && lse->size() != 0) check_shape(where, "lse", *lse, N, 1);
  if (losses && losses->size() != 0) check_shape(where, "losses", *losses, N, 1);
  check_loss_options(where, options, V);
  if (options.token_chunk < 0) {
    std::ostringstream message;
    message << where << ": token_chunk = " << options.token_chunk << " outside [0, inf) (0: automatic)";
    throw value_error(message.str());
  }
  const Index classes = classes_of(options, V);
  check_targets(where, targets, N, classes, options.ignore_index, V);
  const bool weighted = weights.size() != 0;
  for (Index n = 0; weighted && n < N; ++n) {
    const double w = static_cast<double>(weights(n, 0));
    if (!(w >= 0) || !std::isfinite(w)) {
      std::ostringstream message;
      message << where << ": weight " << w << " at n=" << n << " outside [0, inf)";
      throw value_error(message.str());
    }
  }
  const bool gradient = dh != nullptr;
  const bool want_db = gradient && db && db->size() != 0 && bias.size() != 0;
  const bool want_lse = lse && lse->size() != 0;
  const bool want_losses = losses && losses->size() != 0;

  // ---- the counted tokens, their weight sum, the gradient's scale ----
  CrossEntropyResult result;
  ws.tokens.clear();
  for (Index n = 0; n < N; ++n)
    if (static_cast<Index>(targets(n / T, n % T)) != options.ignore_index) {
      ++result.count;
      result.weight_sum += weighted ? static_cast<double>(weights(n, 0)) : 1.0;
    }
  const double scale = reduction_scale(options.reduction, result.weight_sum, options.gradient_scale);
  const Index chunk = fused_token_chunk(options.token_chunk, result.count, classes, sizeof(Scalar));
  const Index rows_capacity = std::min(chunk, std::max<Index>(result.count, 1));
  ws.hidden.resize(static_cast<std::size_t>(rows_capacity * d));
  ws.logits.resize(static_cast<std::size_t>(rows_capacity * classes));
  if (gradient) ws.dhidden.resize(static_cast<std::size_t>(rows_capacity * d));
  ws.tokens.resize(static_cast<std::size_t>(rows_capacity));
  ws.rows.resize(static_cast<std::size_t>(rows_capacity));

  const auto Wv = W.topRows(classes);  // padded rows of W take no part
  const Index vocab_blocks = (classes + kFusedVocabBlock - 1) / kFusedVocabBlock;
  const Index dim_blocks = (d + kFusedDimBlock - 1) / kFusedDimBlock;

  // ---- the chunks: gather, logits, per-row loss and dz, dW and db, dh ----
  Index next = 0;  // next token to look at
  while (true) {
    Index rows = 0;
    for (; next < N && rows < rows_capacity; ++next) {
      if (static_cast<Index>(targets(next / T, next % T)) == options.ignore_index) continue;
      ws.tokens[static_cast<std::size_t>(rows)] = next;
      std::copy_n(h.row(next).data(), d, ws.hidden.data() + rows * d);
      ++rows;
    }
    if (rows == 0) break;
    const Eigen::Map<const RowMatrix<Scalar>> hidden(ws.hidden.data(), rows, d);
    Eigen::Map<RowMatrix<Scalar>> logits(ws.logits.data(), rows, classes);

    parallel_blocks(vocab_blocks, [&](Index block) {
      const Index v0 = block * kFusedVocabBlock, width = std::min(kFusedVocabBlock, classes - v0);
      logits.middleCols(v0, width).noalias() = hidden * Wv.middleRows(v0, width).transpose();
      if (bias.size() != 0) logits.middleCols(v0, width).rowwise() += bias.col(0).segment(v0, width).transpose();
    });
    parallel_blocks(rows, [&](Index r) {
      const Index n = ws.tokens[static_cast<std::size_t>(r)];
      const Index y = static_cast<Index>(targets(n / T, n % T));
      const double w = weighted ? static_cast<double>(weights(n, 0)) : 1.0;
      Scalar* row = logits.row(r).data();
      ws.rows[static_cast<std::size_t>(r)] = softmax_loss_row<Scalar>(row, row, classes, y, options.label_smoothing,
                                                                      options.z_loss, options.softcap, gradient, w * scale);
    });
    // Summed in token order, whatever the threads did.
    for (Index r = 0; r < rows; ++r) {
      const Index n = ws.tokens[static_cast<std::size_t>(r)];
      const RowLoss& row = ws.rows[static_cast<std::size_t>(r)];
      const double w = weighted ? static_cast<double>(weights(n, 0)) : 1.0;
      add_row_loss<Scalar>(row, w, result, want_losses ? losses : nullptr, n);
      if (want_lse) (*lse)(n, 0) = static_cast<Scalar>(row.lse);
    }
    if (gradient) {
      parallel_blocks(vocab_blocks, [&](Index block) {
        const Index v0 = block * kFusedVocabBlock, width = std::min(kFusedVocabBlock, classes - v0);
        dW->middleRows(v0, width).noalias() += logits.middleCols(v0, width).transpose() * hidden;
        if (want_db) db->col(0).segment(v0, width) += logits.middleCols(v0, width).colwise().sum().transpose();
      });
      Eigen::Map<RowMatrix<Scalar>> dhidden(ws.dhidden.data(), rows, d);
      parallel_blocks(dim_blocks, [&](Index block) {
        const Index c0 = block * kFusedDimBlock, width = std::min(kFusedDimBlock, d - c0);
        dhidden.middleCols(c0, width).noalias() = logits * Wv.middleCols(c0, width);
      });
      // h was gathered before dh is written, so dh may be h itself.
      for (Index r = 0; r < rows; ++r) dh->row(ws.tokens[static_cast<std::size_t>(r)]) = dhidden.row(r);
    }
  }
  // Ignored tokens: no loss, no gradient.
  for (Index n = 0; n < N; ++n) {
    if (static_cast<Index>(targets(n / T, n % T)) != options.ignore_index) continue;
    if (gradient) dh->row(n).setZero();
    if (want_lse) (*lse)(n, 0) = Scalar(0);
    if (want_losses) (*losses)(n, 0) = Scalar(0);
  }
  finish_reduction(result, options.reduction);
  return result;
}

}  // namespace detail

// ---- the arithmetic, as free functions on views ----
//
// Common arguments: h [N, d], W [V, d], bias [V, 1] or empty (no bias), targets (N ids, any
// shape, read row-major), weights [N, 1] or empty (all 1). Optional outputs, written when not
// empty: lse [N, 1] (each row's log-sum-exp; 0 for ignored rows), losses [N, 1] (w_n * loss_n,
// 0 for ignored rows). \throws shape_error for any shape mismatch; index_error for a target
// outside [0, classes) that is not ignore_index (a target in the padding names it); value_error
// for an option out of range or a negative / non-finite weight. Nothing is written on throw.
// \pre no output aliases W or the other outputs; dh may be h.

// ... -> loss; dh [N, d] = dz W (written), dW [V, d] += dz^T h, db [V, 1] += sums of dz (skipped
// when empty). Cost: 6 N V d flops in GEMMs plus 4 passes over each chunk's logits; memory
// chunk * (V + 2 d) scalars in `workspace`.
template <typename Scalar>
CrossEntropyResult fused_head_loss_forward_backward(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W,
                                                    const ConstMatrixRef<Scalar>& bias, const ConstIdRef<std::int32_t>& targets,
                                                    const ConstMatrixRef<Scalar>& weights, MatrixRef<Scalar> dh,
                                                    MatrixRef<Scalar> dW, MatrixRef<Scalar> db, MatrixRef<Scalar> lse,
                                                    MatrixRef<Scalar> losses, const FusedHeadLossOptions& options,
                                                    FusedHeadLossWorkspace<Scalar>& workspace) {
  return detail::fused_head_loss_pass<Scalar, std::int32_t>(h, W, bias, targets, weights, &dh, &dW, &db, &lse, &losses,
                                                            options, workspace, "fused_head_loss_forward_backward");
}
template <typename Scalar>
CrossEntropyResult fused_head_loss_forward_backward(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W,
                                                    const ConstMatrixRef<Scalar>& bias, const ConstIdRef<std::int64_t>& targets,
                                                    const ConstMatrixRef<Scalar>& weights, MatrixRef<Scalar> dh,
                                                    MatrixRef<Scalar> dW, MatrixRef<Scalar> db, MatrixRef<Scalar> lse,
                                                    MatrixRef<Scalar> losses, const FusedHeadLossOptions& options,
                                                    FusedHeadLossWorkspace<Scalar>& workspace) {
  return detail::fused_head_loss_pass<Scalar, std::int64_t>(h, W, bias, targets, weights, &dh, &dW, &db, &lse, &losses,
                                                            options, workspace, "fused_head_loss_forward_backward");
}

// ... -> loss only (evaluation): the same chunks, no gradient. Cost: 2 N V d flops.
template <typename Scalar>
CrossEntropyResult fused_head_loss(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W,
                                   const ConstMatrixRef<Scalar>& bias, const ConstIdRef<std::int32_t>& targets,
                                   const ConstMatrixRef<Scalar>& weights, MatrixRef<Scalar> lse, MatrixRef<Scalar> losses,
                                   const FusedHeadLossOptions& options, FusedHeadLossWorkspace<Scalar>& workspace) {
  return detail::fused_head_loss_pass<Scalar, std::int32_t>(h, W, bias, targets, weights, nullptr, nullptr, nullptr, &lse,
                                                            &losses, options, workspace, "fused_head_loss");
}
template <typename Scalar>
CrossEntropyResult fused_head_loss(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W,
                                   const ConstMatrixRef<Scalar>& bias, const ConstIdRef<std::int64_t>& targets,
                                   const ConstMatrixRef<Scalar>& weights, MatrixRef<Scalar> lse, MatrixRef<Scalar> losses,
                                   const FusedHeadLossOptions& options, FusedHeadLossWorkspace<Scalar>& workspace) {
  return detail::fused_head_loss_pass<Scalar, std::int64_t>(h, W, bias, targets, weights, nullptr, nullptr, nullptr, &lse,
                                                            &losses, options, workspace, "fused_head_loss");
}

// ---- the layer-level form ----

// Optional per-token inputs and outputs of FusedHeadLoss; each is used when not empty.
template <typename Scalar>
struct FusedHeadLossExtras {
  Eigen::Map<const RowMatrix<Scalar>> weights{nullptr, 0, 1};  // [N, 1] per-token weights
  Eigen::Map<RowMatrix<Scalar>> lse{nullptr, 0, 1};            // [N, 1] log-sum-exp of each row
  Eigen::Map<RowMatrix<Scalar>> losses{nullptr, 0, 1};         // [N, 1] w_n * loss_n
};

// An OutputProjection's forward, the loss and the head's backward in one call, holding the
// options and the workspace:
//   FusedHeadLoss<float> loss(options);
//   auto r = loss.forward_backward(head, h, targets, dh);   // head's W (and b) gradients += ...
// Works tied (dW lands in the embedding's gradient, beside its sparse rows) and untied.
template <typename Scalar>
class FusedHeadLoss {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");

 public:
  explicit FusedHeadLoss(const FusedHeadLossOptions& options = {}) : options_(options) {}
  const FusedHeadLossOptions& options() const { return options_; }

  // h [N, d], targets (N ids) -> loss; dh [N, d] written; head.weight().grad() += dz^T h (dense
  // mode), bias grad += sums of dz. \throws as fused_head_loss_forward_backward; gradients, dh
  // and extras unchanged on throw.
  CrossEntropyResult forward_backward(OutputProjection<Scalar>& head, const ConstMatrixRef<Scalar>& h,
                                      const ConstIdRef<std::int32_t>& targets, MatrixRef<Scalar> dh,
                                      const FusedHeadLossExtras<Scalar>& extras = {}) {
    return forward_backward_impl(head, h, targets, dh, extras);
  }
  CrossEntropyResult forward_backward(OutputProjection<Scalar>& head, const ConstMatrixRef<Scalar>& h,
                                      const ConstIdRef<std::int64_t>& targets, MatrixRef<Scalar> dh,
                                      const FusedHeadLossExtras<Scalar>& extras = {}) {
    return forward_backward_impl(head, h, targets, dh, extras);
  }

  // h [N, d], targets (N ids) -> loss, no gradient (evaluation).
  CrossEntropyResult forward(const OutputProjection<Scalar>& head, const ConstMatrixRef<Scalar>& h,
                             const ConstIdRef<std::int32_t>& targets, const FusedHeadLossExtras<Scalar>& extras = {}) {
    return forward_impl(head, h, targets, extras);
  }
  CrossEntropyResult forward(const OutputProjection<Scalar>& head, const ConstMatrixRef<Scalar>& h,
                             const ConstIdRef<std::int64_t>& targets, const FusedHeadLossExtras<Scalar>& extras = {}) {
    return forward_impl(head, h, targets, extras);
  }

 private:
  static Eigen::Map<const RowMatrix<Scalar>> bias_of(const OutputProjection<Scalar>& head) {
    if (head.bias()) return head.bias()->value();
    return {nullptr, 0, 1};
  }

  template <typename Id>
  CrossEntropyResult forward_backward_impl(OutputProjection<Scalar>& head, const ConstMatrixRef<Scalar>& h,
                                           const ConstIdRef<Id>& targets, MatrixRef<Scalar> dh,
                                           const FusedHeadLossExtras<Scalar>& extras) {
    const char* where = "FusedHeadLoss::forward_backward";
    const Parameter<Scalar>& weight = head.weight();
    // A dry run of every check first: dense_accumulator() below switches the gradient to dense
    // mode, which must not happen for a call that then throws.
    Eigen::Map<RowMatrix<Scalar>> no_output(nullptr, 0, 1);
    {
      Eigen::Map<RowMatrix<Scalar>> lse = extras.lse, losses = extras.losses;
      detail::check_shape(where, "h", h, h.rows(), head.dim());
      detail::check_shape(where, "dh", dh, h.rows(), head.dim());
      if (extras.weights.size() != 0) detail::check_shape(where, "weights", extras.weights, h.rows(), 1);
      if (lse.size() != 0) detail::check_shape(where, "lse", lse, h.rows(), 1);
      if (losses.size() != 0) detail::check_shape(where, "losses", losses, h.rows(), 1);
      detail::check_loss_options(where, options_, head.vocab_size());
      detail::check_targets(where, targets, h.rows(), detail::classes_of(options_, head.vocab_size()), options_.ignore_index,
                            head.vocab_size());
      for (Index n = 0; n < extras.weights.size(); ++n) {
        const double w = static_cast<double>(extras.weights(n, 0));
        if (!(w >= 0) || !std::isfinite(w)) {
          std::ostringstream message;
          message << where << ": weight " << w << " at n=" << n << " outside [0, inf)";
          throw value_error(message.str());
        }
      }
    }
    auto dW = head.weight().grad().dense_accumulator();
    auto db = head.bias() ? head.bias()->grad().dense_accumulator() : no_output;
    Eigen::Map<RowMatrix<Scalar>> lse = extras.lse, losses = extras.losses;
    MatrixRef<Scalar> dh_ref(dh), dW_ref(dW), db_ref(db), lse_ref(lse), losses_ref(losses);
    return detail::fused_head_loss_pass<Scalar, Id>(h, weight.value(), bias_of(head), targets, extras.weights, &dh_ref,
                                                    &dW_ref, &db_ref, &lse_ref, &losses_ref, options_, workspace_, where);
  }

  template <typename Id>
  CrossEntropyResult forward_impl(const OutputProjection<Scalar>& head, const ConstMatrixRef<Scalar>& h,
                                  const ConstIdRef<Id>& targets, const FusedHeadLossExtras<Scalar>& extras) {
    Eigen::Map<RowMatrix<Scalar>> lse = extras.lse, losses = extras.losses;
    MatrixRef<Scalar> lse_ref(lse), losses_ref(losses);
    return detail::fused_head_loss_pass<Scalar, Id>(h, head.weight().value(), bias_of(head), targets, extras.weights,
                                                    nullptr, nullptr, nullptr, &lse_ref, &losses_ref, options_, workspace_,
                                                    "FusedHeadLoss::forward");
  }

  FusedHeadLossOptions options_;
  FusedHeadLossWorkspace<Scalar> workspace_;
};

}  // namespace embedhead

#endif  // EMBEDHEAD_FUSED_HEAD_LOSS_HPP
