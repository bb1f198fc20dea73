// embedhead: distillation of the LM head against a teacher, fused like the head loss (a chunk of tokens or a
// block of the vocabulary at a time) so that both models' logits take at most memory_budget or two blocks (the
// whole [N, V] of each only when the budget holds all N tokens).
//
// Student logits s = h W^T (+ bias) [N, V]; the teacher is either a second head, u = h_T W_T^T (+ bias_T)
// (h_T [N, d_T], W_T [V, d_T]), or cached teacher log-probabilities, dense [N, V] or top-k (ids and
// log-probs [N, k]), used as u. Temperature T > 0 divides both:
//   a = s / T,  b = u / T,  log p = a - lse(a),  log q = b - lse(b)     (q: the teacher)
// One row's divergence (Divergence):
//   forward_kl  L = T^2 sum_j q_j (log q_j - log p_j)                   (Hinton et al. 2015)
//   reverse_kl  L = T^2 sum_j p_j (log p_j - log q_j)
//   jsd         log m = logsumexp(log p + log(1 - beta), log q + log beta)
//               L = beta KL(q || m) + (1 - beta) KL(p || m)             (TRL's generalized_jsd_loss)
//               beta = 0 is KL(q || p) and beta = 1 is KL(p || q) exactly, as TRL special-cases them;
//               no T^2 factor (TRL's), so jsd at beta = 0 is forward_kl / T^2.
// Gradients, with the row's weight w (the reduction's scale: 1 / count for mean), c = T^2 for the
// two KLs and 1 for jsd, dL/ds = (1/T) dL/da and dL/du = (1/T) dL/db:
//   forward_kl  dL/da_j = w c (p_j - q_j),            dL/db_j = w c q_j (log q_j - log p_j - K)
//   reverse_kl  dL/da_j = w c p_j (log p_j - log q_j - K),   dL/db_j = w c (q_j - p_j)
//   jsd         dL/da_j = w (1 - beta) p_j (log p_j - log m_j - K_p)
//               dL/db_j = w beta q_j (log q_j - log m_j - K_q)
// with K the row's KL (without T^2), K_p = KL(p || m), K_q = KL(q || m). Terms of zero probability
// add 0 (0 log 0 = 0); a class with q_j > 0 and p_j = 0 makes forward_kl +inf, as it is.
//
// Two plans walk the logits (DistillationOptions::plan, as the fused loss's FusedPlan):
//   token_chunks  n tokens at a time: both models' logits [n, V] computed once and kept through the passes below,
//                 which walk them a block of vocab_block columns at a time; then dW += dz^T h_chunk, dh_chunk = dz W
//                 (and the teacher's) once for the chunk. The KLs' loss and student gradient 8 N V d flops (the
//                 student-only fused loss: 6 in token chunks), jsd's the same; memory: both chunks of logits,
//                 n = memory_budget / (2 V sizeof(Scalar)) tokens at most (rounded as fused_token_chunk; 64 MiB by
//                 default: 256 tokens at V = 32,768 in float).
//   vocab_blocks  all tokens at once, vocab_block rows of W (and W_T) at a time, the logits recomputed in each
//                 pass: 12 N V d flops for the KLs (the student-only fused loss: 8 in vocabulary blocks), jsd's
//                 16 N V d; memory: two blocks of logits [N, vocab_block] (the student's and the teacher's).
//   automatic     token_chunks when the budget holds kFusedMinTokenChunk (128) tokens or all of them, else
//                 vocab_blocks. The teacher's gradient adds 4 N V d; cached log-probs replace the teacher's products
//                 by reading [N, V] (or [N, k]); the loss alone is 4 N V d (teacher head) or 2 N V d (cached) in
//                 token chunks, twice that in blocks (pass 2 recomputes).
// Both plans sum each row's statistics and terms over the same blocks of columns in the same order, so on the
// default (packed) backend, whose logits of a row do not depend on the rows beside it, the loss and per-row losses
// are the same bits in either plan; dh and dW are summed over the vocabulary and the tokens in other groupings (to
// rounding). The passes, for the rows at hand (a token chunk, or all of them):
//   1  both blocks of logits, each row's online max and sum of exponentials (SoftmaxRowStats,
//      in double) -> lse(a), lse(b); for the KLs also, online beside the weighting distribution's
//      statistics, X = sum_j exp(a_j - max) (a_j - b_j) (reverse; forward: a and b swapped), so
//      that K = X / S - lse(a) + lse(b) is known after pass 1;
//   2  each block again, each row's sums (K, or K_p and K_q), in double, block by block in order;
//      for the KLs also dz = dL/ds (and dz_T = dL/du) from K, then dW += dz^T h, dh += dz W (and
//      dW_T += dz_T^T h_T, dh_T += dz_T W_T); the loss is pass 2's K, not pass 1's X;
//   3  (jsd with a gradient) the gradient pass: each block again, dz from the sums of pass 2.
// Cached log-probs: a dense row must be log-probabilities, |log sum_j exp(l_j)| <= 1e-3, without NaN
// or +inf (-inf: probability 0; refused for reverse_kl and jsd at beta = 1, which would be +inf). Top-k: the k classes
// of each row are the teacher's whole support, renormalised over them (q = softmax(l_k / T) on the k ids, 0 elsewhere);
// their probabilities must sum to at most 1 (log sum <= 1e-3), the ids be distinct and in [0, V). Only forward_kl is
// defined on a top-k support (reverse_kl and jsd would be infinite on the classes q leaves out).
//
// Masked tokens: extras.mask [N, 1] of 0 (masked) and 1 (counted), all counted when empty (a
// labels array with ignore_index -100 is mask = labels != -100). A masked row adds no loss and gets
// dh = 0 (and dh_T = 0); its cached log-probs are not read, and it takes no part in any product: the counted rows of
// h (and h_T) are gathered first (count (d + d_T) scalars, and as many for their dh and dh_T), as the fused loss
// drops ignored tokens, so a NaN or inf in a masked row reaches nothing. Reduction: mean over the
// counted tokens (TRL's batchmean over non-masked tokens), sum, or none (per-row losses into extras.losses, the
// result's loss their sum).
//
// Over a vocabulary shard (each rank W's rows [begin, end)): parallel/vocab_parallel_distillation.hpp, this pass with a
// DistillSlice whose collectives combine the rows' statistics after pass 1, their sums after pass 2 and dh at the end.
// On an OutputProjection (the student's W and bias, their gradients accumulated into its Parameters, tied or not):
// HeadDistillation, at the end of this file.
#ifndef EMBEDHEAD_DISTILLATION_HPP
#define EMBEDHEAD_DISTILLATION_HPP

#include "cross_entropy.hpp"
#include "detail/checks.hpp"
#include "detail/gemm.hpp"
#include "detail/softmax.hpp"
#include "errors.hpp"
#include "fused_head_loss.hpp"
#include "output_projection.hpp"
#include "parameter.hpp"
#include "types.hpp"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace embedhead {

enum class Divergence { forward_kl, reverse_kl, jsd };

struct DistillationOptions {
  Divergence divergence = Divergence::forward_kl;
  double temperature = 1.0;  // T in (0, inf)
  double beta = 0.5;         // jsd's beta in [0, 1] (ignored by the KLs)
  Reduction reduction = Reduction::mean;
  Index vocab_block = 0;  // rows of W per block; 0: as FusedHeadLossOptions (V / 50 in [256, 4096])
  // How the logits are walked (the top of this file), as FusedHeadLossOptions: token_chunks holds both
  // models' logits of a chunk of tokens [n, V] each, n = memory_budget / (2 V sizeof(Scalar)); vocab_blocks
  // two blocks [N, vocab_block]; automatic takes token_chunks when the budget holds kFusedMinTokenChunk
  // (128) tokens or all of them. A vocabulary shard always walks blocks (token_chunks is refused there).
  FusedPlan plan = FusedPlan::automatic;
  Index memory_budget = 0;  // bytes of both chunks of logits; 0: kFusedDefaultBudget (64 MiB)
};

struct DistillationResult {
  double loss = 0;  // mean: sum / count (0 when nothing counts); sum, none: sum
  double sum = 0;   // sum of the counted rows' L
  Index count = 0;  // counted (unmasked) rows
};

// Buffers reused across calls; contents internal.
template <typename Scalar>
struct DistillationWorkspace {
  std::vector<Scalar> student, teacher;  // [N, vocab_block] or [chunk, V] each: logits a and b, then dz
  std::vector<detail::SoftmaxRowStats> student_stats, teacher_stats;
  std::vector<double> lse_student, lse_teacher, sum_p, sum_q;  // per row
  std::vector<double> cross;                                   // per row: X of pass 1, then K
  std::vector<Index> top_ids;                                  // a top-k row's ids, sorted (the check)
  std::vector<Index> rows;                                     // with masked rows: the counted rows
  std::vector<Scalar> h_rows, h_T_rows, dh_rows, dh_T_rows;    // ... their h, h_T, dh, dh_T
  std::vector<double> reduced;                                 // vocabulary-parallel: the all-reduce buffer
};

// Optional per-token input and output, each absent when empty, else [N, 1]:
//   DistillationExtras<float> extras{{mask.data(), N, 1}, {losses.data(), N, 1}};
template <typename Scalar>
struct DistillationExtras {
  Eigen::Map<const RowMatrix<Scalar>> mask{nullptr, 0, 1};  // in:  [N, 1] 1 counted, 0 masked
  Eigen::Map<RowMatrix<Scalar>> losses{nullptr, 0, 1};      // out: [N, 1] each row's L (0 masked)
};

// Top-k cached teacher log-probs: ids [N, k] in [0, V), distinct in a row; logprobs [N, k].
template <typename Scalar>
struct TeacherTopK {
  TokenIds ids;
  ConstMatrixRef<Scalar> logprobs;
};

// Tolerance of a cached row's normalisation: |log sum_j exp(l_j)| <= kLogProbTolerance (top-k:
// log sum <= kLogProbTolerance).
constexpr double kLogProbTolerance = 1e-3;

namespace detail {

// forward / reverse / jsd with beta strictly inside (0, 1); jsd at 0 and 1 runs as fkl / rkl.
enum class DistillKind { fkl, rkl, jsd };

inline void check_distillation_options(const char* where, const DistillationOptions& options) {
  const double T = options.temperature;
  if (!(T > 0) || !std::isfinite(T)) {
    std::ostringstream message;
    message << where << ": temperature = " << T << " outside (0, inf)";
    throw value_error(message.str());
  }
  if (options.divergence == Divergence::jsd && !(options.beta >= 0 && options.beta <= 1)) {
    std::ostringstream message;
    message << where << ": beta = " << options.beta << " outside [0, 1]";
    throw value_error(message.str());
  }
  if (options.vocab_block < 0) {
    std::ostringstream message;
    message << where << ": vocab_block = " << options.vocab_block << " outside [0, inf) (0: automatic)";
    throw value_error(message.str());
  }
  if (options.memory_budget < 0) {
    std::ostringstream message;
    message << where << ": memory_budget = " << options.memory_budget << " outside [0, inf) (0: " << kFusedDefaultBudget
            << " bytes)";
    throw value_error(message.str());
  }
}

// The token-chunk plan's tokens per chunk for N rows of V classes (both models' logits: 2 V scalars a token), or 0
// for the vocabulary blocks; fused_token_chunk's rule (multiples of 256 tokens once that many fit).
template <typename Scalar>
Index distill_token_chunk(const DistillationOptions& options, Index N, Index V) {
  FusedHeadLossOptions plan;
  plan.plan = options.plan;
  plan.memory_budget = options.memory_budget;
  return fused_token_chunk(plan, N, 2 * V, static_cast<Index>(sizeof(Scalar)));
}

template <typename Mask>
void check_mask(const char* where, const Mask& mask) {
  for (Index n = 0; n < mask.rows(); ++n) {
    const double m = static_cast<double>(mask(n, 0));
    if (m != 0.0 && m != 1.0) {
      std::ostringstream message;
      message << where << ": mask " << m << " at n=" << n << " outside {0, 1}";
      throw value_error(message.str());
    }
  }
}

// Throws value_error unless the k values of a row (stride 1 or not) hold no NaN nor +inf and
// log sum exp is within kLogProbTolerance of 0 (at_most: only <= kLogProbTolerance, top-k).
template <typename Row>
void check_logprob_row(const char* where, const char* what, const Row& row, Index n, bool at_most) {
  double max = -std::numeric_limits<double>::infinity();
  for (Index j = 0; j < row.size(); ++j) {
    const double l = static_cast<double>(row(j));
    if (std::isnan(l) || l == std::numeric_limits<double>::infinity()) {
      std::ostringstream message;
      message << where << ": " << what << " " << l << " at n=" << n << ", column " << j
              << " outside [-inf, 0] (log-probabilities)";
      throw value_error(message.str());
    }
    max = std::max(max, l);
  }
  double sum = 0;
  if (max > -std::numeric_limits<double>::infinity())
    for (Index j = 0; j < row.size(); ++j) sum += std::exp(static_cast<double>(row(j)) - max);
  const double lse = max + std::log(sum);
  // Top-k: at least one class of non-zero probability (a row of -inf has no distribution).
  const bool bad = at_most ? !(lse <= kLogProbTolerance) || lse == -std::numeric_limits<double>::infinity()
                           : !(std::abs(lse) <= kLogProbTolerance);
  if (bad) {
    std::ostringstream message;
    message << where << ": " << what << " at n=" << n << " have log sum exp = " << lse << " outside ";
    if (at_most)
      message << "(-inf";
    else
      message << "[" << -kLogProbTolerance;
    message << ", " << kLogProbTolerance << "] (rows must be log-probabilities)";
    throw value_error(message.str());
  }
}

// The online statistics of x [width] (SoftmaxRowStats: max, S) and beside them, at the same max,
// X = sum_j exp(x_j - max) (x_j - y_j) (a term with exp 0 adds 0), rescaled as S when the max grows;
// each term in Scalar (X only sets the gradient's K: the loss is pass 2's sum, in double).
// For the KLs' row sum K from pass 1: sum_j p_j (a_j - b_j) = X / S.
template <typename Scalar>
void accumulate_cross(SoftmaxRowStats& stats, double& X, const Scalar* x, const Scalar* y, Index width) {
  using Lanes = SoftmaxLanes<Scalar>;
  using D = SoftmaxLanes<double>;
  const double block_max = static_cast<double>(row_max(x, width));
  if (block_max > stats.max) {
    if (X != 0.0) X *= std::exp(stats.max - block_max);
    stats.rescale_to(block_max);
  }
  const Scalar minus_inf = -std::numeric_limits<Scalar>::infinity();
  const Scalar shift = stats.max == -std::numeric_limits<double>::infinity() ? Scalar(0)
                                                                             : static_cast<Scalar>(stats.max);
  // In Scalar over runs of kSoftmaxRun blocks, each run's lanes then added in double (as
  // sum_exp_shifted).
  D sum = D::Zero(), cross = D::Zero();
  Lanes part_sum = Lanes::Zero(), part_cross = Lanes::Zero();
  Index run = 0;
  for (Index j = 0; j < width; j += kSoftmaxLanes) {
    const Index count = std::min(kSoftmaxLanes, width - j);
    const Lanes sx = count == kSoftmaxLanes ? Lanes(Eigen::Map<const Lanes>(x + j))
                                            : load_partial_lanes(x + j, count, minus_inf);
    const Lanes sy = count == kSoftmaxLanes ? Lanes(Eigen::Map<const Lanes>(y + j))
                                            : load_partial_lanes(y + j, count, Scalar(0));
    const Lanes e = exp_lanes<Scalar>(Lanes(sx - shift));
    part_sum += e;
    part_cross += (e > Scalar(0)).select(e * (sx - sy), Lanes::Zero());
    if (++run == kSoftmaxRun || j + kSoftmaxLanes >= width) {
      sum += part_sum.template cast<double>();
      cross += part_cross.template cast<double>();
      part_sum.setZero();
      part_cross.setZero();
      run = 0;
    }
  }
  stats.sum_exp += sum.sum();
  X += cross.sum();
}

// One row's block of columns: a, b [width] (already divided by T), the row's lse of each. Adds the
// row's sums (sum_p: K or K_p; sum_q: K_q) over the block when `sums`; writes dL/ds into ga and
// dL/du into gb (each may be a or b itself, or null) with the coefficients ca, cb (w c / T, the
// beta factors included) and the row's full sums kp, kq.
template <typename Scalar>
void distill_row_block(DistillKind kind, double beta, const Scalar* a, const Scalar* b, Index width, double lse_a,
                       double lse_b, bool sums, double* sum_p, double* sum_q, Scalar* ga, Scalar* gb, double ca,
                       double cb, double kp, double kq) {
  using Lanes = SoftmaxLanes<Scalar>;
  using D = SoftmaxLanes<double>;
  const Scalar minus_inf = -std::numeric_limits<Scalar>::infinity();
  const double log_beta = kind == DistillKind::jsd ? std::log(beta) : 0.0;
  const double log_1mbeta = kind == DistillKind::jsd ? std::log1p(-beta) : 0.0;
  D acc_p = D::Zero(), acc_q = D::Zero();
  for (Index j = 0; j < width; j += kSoftmaxLanes) {
    const Index count = std::min(kSoftmaxLanes, width - j);
    const Lanes sa = count == kSoftmaxLanes ? Lanes(Eigen::Map<const Lanes>(a + j))
                                            : load_partial_lanes(a + j, count, minus_inf);
    const Lanes sb = count == kSoftmaxLanes ? Lanes(Eigen::Map<const Lanes>(b + j))
                                            : load_partial_lanes(b + j, count, minus_inf);
    const D lp = sa.template cast<double>() - lse_a;
    const D lq = sb.template cast<double>() - lse_b;
    // p and q by Scalar's exp (in float 1e-7 relative, twice as fast as double's), the logs and
    // the sums in double.
    const D p = exp_lanes<Scalar>(Lanes(sa - static_cast<Scalar>(lse_a))).template cast<double>();
    const D q = exp_lanes<Scalar>(Lanes(sb - static_cast<Scalar>(lse_b))).template cast<double>();
    D tp, tq, dp, dq;  // the row terms; dL/da, dL/db before their coefficients
    if (kind == DistillKind::fkl) {
      tp = (q > 0.0).select(q * (lq - lp), D::Zero());
      tq = D::Zero();
      dp = p - q;
      dq = (q > 0.0).select(q * (lq - lp - kp), D::Zero());
    } else if (kind == DistillKind::rkl) {
      tp = (p > 0.0).select(p * (lp - lq), D::Zero());
      tq = D::Zero();
      dp = (p > 0.0).select(p * (lp - lq - kp), D::Zero());
      dq = q - p;
    } else {
      const D x1 = lp + log_1mbeta, x2 = lq + log_beta;
      const D hi = x1.max(x2), lo = x1.min(x2);
      const D lm = hi + exp_lanes<double>(D(lo - hi)).log1p();
      tp = (p > 0.0).select(p * (lp - lm), D::Zero());
      tq = (q > 0.0).select(q * (lq - lm), D::Zero());
      dp = (p > 0.0).select(p * (lp - lm - kp), D::Zero());
      dq = (q > 0.0).select(q * (lq - lm - kq), D::Zero());
    }
    if (sums) {
      acc_p += tp;
      acc_q += tq;
    }
    if (ga) {
      const Lanes g = (dp * ca).template cast<Scalar>();
      std::copy_n(g.data(), count, ga + j);
    }
    if (gb) {
      const Lanes g = (dq * cb).template cast<Scalar>();
      std::copy_n(g.data(), count, gb + j);
    }
  }
  if (sums) {
    *sum_p += acc_p.sum();
    *sum_q += acc_q.sum();
  }
}

// The teacher as a second head: u = h_T W_T^T, with optional gradients.
template <typename Scalar>
struct HeadTeacher {
  const ConstMatrixRef<Scalar>* h = nullptr;     // [N, d_T]
  const ConstMatrixRef<Scalar>* W = nullptr;     // [V, d_T]
  const ConstMatrixRef<Scalar>* bias = nullptr;  // [V, 1] or empty
  MatrixRef<Scalar>* dh = nullptr;               // [N, d_T] written, or null
  MatrixRef<Scalar>* dW = nullptr;               // [V, d_T] +=, or null
  MatrixRef<Scalar>* db = nullptr;               // [V, 1] +=, or null
};

// Which teacher: exactly one of head, dense, topk is set.
template <typename Scalar>
struct TeacherSource {
  const HeadTeacher<Scalar>* head = nullptr;
  const ConstMatrixRef<Scalar>* dense = nullptr;  // [N, V] log-probs
  const ConstMatrixRef<Scalar>* topk = nullptr;   // [N, k] log-probs
  std::vector<Index> topk_ids;                    // [N, k] ids as Index (checked)
};

// logits [N, width] (leading dimension width) = x [N, K] Y[v0, v0 + width)^T (+ bias[v0, v0 + width)).
template <typename Scalar>
void distill_logits(const ConstMatrixRef<Scalar>& x, const ConstMatrixRef<Scalar>& Y,
                    const ConstMatrixRef<Scalar>& bias, Index v0, Index width, Scalar* out) {
  using gemm::Layout;
  const gemm::Op<Scalar, Layout::row_major, Layout::col_major> product{x.rows(),        width,
                                                                       x.cols(),        x.data(),
                                                                       x.outerStride(), Y.data() + v0 * Y.outerStride(),
                                                                       Y.outerStride(), out,
                                                                       width,           gemm::Init::zero};
  gemm::Op<Scalar, Layout::row_major, Layout::col_major> op = product;
  if (bias.size() != 0) {
    op.init = gemm::Init::bias;
    op.bias = bias.data() + v0 * bias.outerStride();
    op.bias_stride = bias.outerStride();
  }
  // One piece of columns per thread on the packed kernel (whose results do not depend on the
  // pieces): a block's few fixed pieces of kFusedRowPiece columns would leave a thread idle.
  const gemm::Plan plan{gemm::Split::cols, gemm::per_thread_columns<Scalar>(width, kFusedRowPiece), true};
  gemm::run<gemm::Kernel::expression>(op, plan);
}

// dz [N, width] of W's rows [v0, v0 + width): dW[v0 ..) += dz^T x (dW may be null), db[v0 ..) +=
// column sums of dz (db may be null), dx += dz Y[v0 ..).
template <typename Scalar>
void distill_backward(const Scalar* dz, Index N, Index width, const ConstMatrixRef<Scalar>& x,
                      const ConstMatrixRef<Scalar>& Y, Index v0, MatrixRef<Scalar>* dx, MatrixRef<Scalar>* dY,
                      MatrixRef<Scalar>* db) {
  using gemm::Layout;
  const Index d = x.cols();
  if (db) add_column_sums(dz, width, N, width, db->col(0).segment(v0, width));
  if (dY) {
    const gemm::Op<Scalar, Layout::col_major, Layout::row_major> dW_product{
        width, d, N, dz, width, x.data(), x.outerStride(), dY->data() + v0 * dY->outerStride(), dY->outerStride()};
    gemm::run<gemm::Kernel::expression>(dW_product, gemm::per_thread_plan<gemm::DefaultBackend>(
                                                        width, d, kFusedRowPiece,
                                                        gemm::Plan{gemm::Split::rows, kFusedRowPiece, true}, true));
  }
  const gemm::Op<Scalar, Layout::row_major, Layout::row_major> dh_product{
      N, d, width, dz, width, Y.data() + v0 * Y.outerStride(), Y.outerStride(), dx->data(), dx->outerStride()};
  gemm::run<gemm::Kernel::expression>(dh_product,
                                      gemm::per_thread_plan<gemm::DefaultBackend>(N, d, kHeadMinThreadRows,
                                                                                  gemm::Plan{gemm::Split::cols,
                                                                                             kFusedDimPiece, true}));
}

// distill_pass over one shard of the vocabulary (parallel/vocab_parallel_distillation.hpp implements it over a
// Communicator): W (and the teacher's W_T) hold the global rows [begin, begin + W.rows()); a dense teacher's log-probs
// are the whole [N, V] (column begin + j is the shard's column j) and top-k ids are global. Null: the whole head.
template <typename Scalar>
struct DistillSlice {
  Index begin = 0;  // global row of W's row 0
  explicit DistillSlice(Index begin_row) : begin(begin_row) {}
  virtual ~DistillSlice() = default;
  // After pass 1, ws.student_stats, ws.teacher_stats [N] and ws.cross [N] (X, beside the student's statistics for rkl,
  // the teacher's for fkl, unused for jsd) over the local columns -> the same over all V columns.
  virtual void combine_stats(DistillationWorkspace<Scalar>& ws, Index N, DistillKind kind) const = 0;
  // After pass 2: ws.sum_p and ws.sum_q [N] over the local columns -> their sums over all V columns.
  virtual void combine_sums(DistillationWorkspace<Scalar>& ws, Index N) const = 0;
  // At the end: dh (dh_T), this rank's partial sum -> the sum over every rank.
  virtual void sum_over_ranks(MatrixRef<Scalar>& dh) const = 0;
};

// The pass (the top of this file). dh == nullptr: the loss alone. Every check has run.
template <typename Scalar>
DistillationResult distill_pass(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W,
                                const ConstMatrixRef<Scalar>& bias, const TeacherSource<Scalar>& teacher,
                                MatrixRef<Scalar>* dh, MatrixRef<Scalar>* dW, MatrixRef<Scalar>* db,
                                DistillationWorkspace<Scalar>& ws, const DistillationOptions& options,
                                const DistillationExtras<Scalar>& extras, const DistillSlice<Scalar>* slice = nullptr) {
  const Index N = h.rows(), V = W.rows();
  const double T = options.temperature;
  DistillKind kind = DistillKind::fkl;
  double factor = T * T;
  if (options.divergence == Divergence::reverse_kl) kind = DistillKind::rkl;
  if (options.divergence == Divergence::jsd) {
    factor = 1.0;
    kind = options.beta == 0.0 ? DistillKind::fkl : options.beta == 1.0 ? DistillKind::rkl : DistillKind::jsd;
  }
  const double beta = options.beta;
  const bool masked = extras.mask.size() != 0;
  auto counted = [&](Index n) { return !masked || extras.mask(n, 0) != Scalar(0); };
  const bool gradient = dh != nullptr;
  const bool want_dW = gradient && dW && dW->size() != 0;
  const bool want_db = gradient && db && db->size() != 0 && bias.size() != 0;
  const HeadTeacher<Scalar>* head = teacher.head;
  const bool teacher_dh = gradient && head && head->dh && head->dh->size() != 0;
  const bool teacher_dW = teacher_dh && head->dW && head->dW->size() != 0;
  const bool teacher_db = teacher_dh && head->db && head->db->size() != 0 && head->bias->size() != 0;

  DistillationResult result;
  for (Index n = 0; n < N; ++n) result.count += counted(n) ? 1 : 0;
  const double scale = options.reduction == Reduction::mean ? (result.count > 0 ? 1.0 / result.count : 0.0) : 1.0;
  if (gradient) dh->setZero();
  if (teacher_dh) head->dh->setZero();
  if (extras.losses.size() != 0) {
    Eigen::Map<RowMatrix<Scalar>> losses = extras.losses;
    losses.setZero();
  }
  if (result.count == 0) return result;

  // With masked rows, the counted rows of h (and h_T) gathered, their dh (dh_T) computed there and scattered at the
  // end, so that a masked row takes no part in any product (as the fused loss drops ignored tokens): M rows walked,
  // walked row n being row orig(n) of the call.
  const bool gather = result.count < N;
  const Index M = result.count;
  if (gather) {
    ws.rows.clear();
    for (Index n = 0; n < N; ++n)
      if (counted(n)) ws.rows.push_back(n);
  }
  auto orig = [&](Index n) { return gather ? ws.rows[static_cast<std::size_t>(n)] : n; };
  // x (h or its counted rows) and dx (dh, or the counted rows' dh) for each model: views into the call's matrices or
  // into the workspace.
  auto gathered = [&](std::vector<Scalar>& store, const ConstMatrixRef<Scalar>& from) -> ConstMatrixRef<Scalar> {
    if (!gather) return from;
    store.resize(static_cast<std::size_t>(M * from.cols()));
    Eigen::Map<RowMatrix<Scalar>> to(store.data(), M, from.cols());
    for (Index n = 0; n < M; ++n) to.row(n) = from.row(orig(n));
    return to;
  };
  auto gradient_rows = [&](std::vector<Scalar>& store, MatrixRef<Scalar>& of) -> MatrixRef<Scalar> {
    if (!gather) return of;
    store.resize(static_cast<std::size_t>(M * of.cols()));
    Eigen::Map<RowMatrix<Scalar>> rows(store.data(), M, of.cols());
    rows.setZero();
    return rows;
  };
  const ConstMatrixRef<Scalar> hx = gathered(ws.h_rows, h);
  std::optional<ConstMatrixRef<Scalar>> hx_T;
  if (head) hx_T.emplace(gathered(ws.h_T_rows, *head->h));
  std::optional<MatrixRef<Scalar>> dhx, dhx_T;
  if (gradient) dhx.emplace(gradient_rows(ws.dh_rows, *dh));
  if (teacher_dh) dhx_T.emplace(gradient_rows(ws.dh_T_rows, *head->dh));

  const Index block = fused_vocab_block(options.vocab_block, V);
  // Token chunks (none over a shard): rows [r0, r0 + rows) at a time, their logits [rows, V] computed once and kept
  // through the passes (which then walk them a block of columns at a time, the same blocks as the other plan, so
  // the loss is the same bits); else all N rows, a block of logits at a time, recomputed in each pass.
  const Index chunk = slice ? 0 : distill_token_chunk<Scalar>(options, M, V);
  const bool whole_rows = chunk > 0;
  const Index rows_max = whole_rows ? chunk : M;
  const Index buffer = rows_max * (whole_rows ? V : block);
  ws.student.resize(static_cast<std::size_t>(buffer));
  ws.teacher.resize(static_cast<std::size_t>(buffer));
  ws.student_stats.assign(static_cast<std::size_t>(M), SoftmaxRowStats{});
  ws.teacher_stats.assign(static_cast<std::size_t>(M), SoftmaxRowStats{});
  ws.lse_student.assign(static_cast<std::size_t>(M), 0.0);
  ws.lse_teacher.assign(static_cast<std::size_t>(M), 0.0);
  ws.sum_p.assign(static_cast<std::size_t>(M), 0.0);
  ws.sum_q.assign(static_cast<std::size_t>(M), 0.0);
  ws.cross.assign(static_cast<std::size_t>(M), 0.0);
  const Scalar inv_T = static_cast<Scalar>(1.0 / T);
  const Index k = teacher.topk ? teacher.topk->cols() : 0;
  const Index column0 = slice ? slice->begin : 0;  // the global column of W's row 0
  const SoftmaxTerms terms = [&] {
    SoftmaxTerms t;
    t.classes = V;
    return t;
  }();
  // The gradient's coefficients on dL/da and dL/db, times 1/T for ds and du.
  const double c = scale * factor / T;
  const double ca = kind == DistillKind::jsd ? c * (1.0 - beta) : c;
  const double cb = kind == DistillKind::jsd ? c * beta : c;
  // The gradient in pass 2 when its row sums are known from pass 1: both KLs.
  const bool gradient_in_sums = gradient && kind != DistillKind::jsd;

  for (Index r0 = 0; r0 < M; r0 += rows_max) {
    const Index rows = std::min(rows_max, M - r0);
    const ConstMatrixRef<Scalar> x = hx.middleRows(r0, rows);
    std::optional<ConstMatrixRef<Scalar>> x_T;
    if (head) x_T.emplace(hx_T->middleRows(r0, rows));
    std::optional<MatrixRef<Scalar>> dx, dx_T;
    if (gradient) dx.emplace(dhx->middleRows(r0, rows));
    if (teacher_dh) dx_T.emplace(dhx_T->middleRows(r0, rows));
    // The buffers' leading dimension, and where the columns [v0, ..) of a block start in a row.
    auto ld = [&](Index width) { return whole_rows ? V : width; };
    auto at = [&](Index v0) { return whole_rows ? v0 : Index{0}; };
    // Both models' logits of columns [v0, v0 + width), divided by T, into ws.student / ws.teacher (leading
    // dimension width).
    auto blocks_of = [&](Index v0, Index width) {
      distill_logits(x, W, bias, v0, width, ws.student.data());
      if (head) distill_logits(*x_T, *head->W, *head->bias, v0, width, ws.teacher.data());
      parallel_rows(rows, [&](Index r) {
        const Index n = r0 + r;
        Scalar* a = ws.student.data() + r * width;
        Scalar* b = ws.teacher.data() + r * width;
        if (teacher.dense) {
          for (Index j = 0; j < width; ++j) b[j] = (*teacher.dense)(orig(n), column0 + v0 + j);
        } else if (teacher.topk) {
          std::fill(b, b + width, -std::numeric_limits<Scalar>::infinity());
          for (Index i = 0; i < k; ++i) {
            const Index id = teacher.topk_ids[static_cast<std::size_t>(orig(n) * k + i)] - column0;
            if (id >= v0 && id < v0 + width) b[id - v0] = (*teacher.topk)(orig(n), i);
          }
        }
        if (T != 1.0) {
          Eigen::Map<Eigen::Array<Scalar, Eigen::Dynamic, 1>>(a, width) *= inv_T;
          Eigen::Map<Eigen::Array<Scalar, Eigen::Dynamic, 1>>(b, width) *= inv_T;
        }
      });
    };
    if (whole_rows) blocks_of(0, V);
    // Pass 1: the statistics.
    for (Index v0 = 0; v0 < V; v0 += block) {
      const Index width = std::min(block, V - v0);
      if (!whole_rows) blocks_of(v0, width);
      parallel_rows(rows, [&](Index r) {
        const std::size_t i = static_cast<std::size_t>(r0 + r);
        const Scalar* a = ws.student.data() + r * ld(width) + at(v0);
        const Scalar* b = ws.teacher.data() + r * ld(width) + at(v0);
        // The KLs' X beside the statistics of the distribution that weights them (reverse: p's,
        // forward: q's); jsd has none.
        if (kind == DistillKind::rkl)
          accumulate_cross(ws.student_stats[i], ws.cross[i], a, b, width);
        else
          ws.student_stats[i].accumulate(a, width, -1, terms);
        if (kind == DistillKind::fkl)
          accumulate_cross(ws.teacher_stats[i], ws.cross[i], b, a, width);
        else
          ws.teacher_stats[i].accumulate(b, width, -1, terms);
      });
    }
    if (slice) slice->combine_stats(ws, M, kind);
    for (Index n = r0; n < r0 + rows; ++n) {
      const std::size_t i = static_cast<std::size_t>(n);
      ws.lse_student[i] = ws.student_stats[i].max + std::log(ws.student_stats[i].sum_exp);
      ws.lse_teacher[i] = ws.teacher_stats[i].max + std::log(ws.teacher_stats[i].sum_exp);
      // K = X / S - lse + lse' (reverse: sum_j p_j (a_j - b_j) - lse(a) + lse(b); forward mirrored).
      if (kind == DistillKind::rkl)
        ws.cross[i] = ws.cross[i] / ws.student_stats[i].sum_exp - ws.lse_student[i] + ws.lse_teacher[i];
      else if (kind == DistillKind::fkl)
        ws.cross[i] = ws.cross[i] / ws.teacher_stats[i].sum_exp - ws.lse_teacher[i] + ws.lse_student[i];
    }
    // dW += dz^T x, db += column sums of dz, dx += dz W over columns [v0, v0 + width) (and the teacher's).
    auto backward = [&](Index v0, Index width) {
      distill_backward(ws.student.data(), rows, width, x, W, v0, &*dx, want_dW ? dW : nullptr, want_db ? db : nullptr);
      if (teacher_dh)
        distill_backward(ws.teacher.data(), rows, width, *x_T, *head->W, v0, &*dx_T, teacher_dW ? head->dW : nullptr,
                         teacher_db ? head->db : nullptr);
    };
    // One pass over the blocks: row sums (sums), gradients (grad) and their products.
    auto walk = [&](bool sums, bool grad) {
      for (Index v0 = 0; v0 < V; v0 += block) {
        const Index width = std::min(block, V - v0);
        if (!whole_rows) blocks_of(v0, width);
        parallel_rows(rows, [&](Index r) {
          const Index n = r0 + r;
          const std::size_t i = static_cast<std::size_t>(n);
          Scalar* a = ws.student.data() + r * ld(width) + at(v0);
          Scalar* b = ws.teacher.data() + r * ld(width) + at(v0);
          distill_row_block(kind, beta, a, b, width, ws.lse_student[i], ws.lse_teacher[i], sums, &ws.sum_p[i],
                            &ws.sum_q[i], grad ? a : nullptr, grad && teacher_dh ? b : nullptr, ca, cb,
                            kind == DistillKind::jsd ? ws.sum_p[i] : ws.cross[i], ws.sum_q[i]);
        });
        if (grad && !whole_rows) backward(v0, width);
      }
      if (grad && whole_rows) backward(0, V);
    };
    walk(true, gradient_in_sums);
    if (slice) slice->combine_sums(ws, M);
    for (Index n = r0; n < r0 + rows; ++n) {
      const std::size_t i = static_cast<std::size_t>(n);
      const double row = kind == DistillKind::jsd ? beta * ws.sum_q[i] + (1.0 - beta) * ws.sum_p[i]
                                                  : factor * ws.sum_p[i];
      result.sum += row;
      if (extras.losses.size() != 0) {
        Eigen::Map<RowMatrix<Scalar>> losses = extras.losses;
        losses(orig(n), 0) = static_cast<Scalar>(row);
      }
    }
    if (gradient && !gradient_in_sums) walk(false, true);
  }
  result.loss = options.reduction == Reduction::mean ? result.sum / static_cast<double>(result.count) : result.sum;
  if (gather) {
    for (Index n = 0; n < M; ++n) {
      if (gradient) dh->row(orig(n)) = dhx->row(n);
      if (teacher_dh) head->dh->row(orig(n)) = dhx_T->row(n);
    }
  }
  if (slice && gradient) slice->sum_over_ranks(*dh);
  if (slice && teacher_dh) slice->sum_over_ranks(*head->dh);
  return result;
}

// Where the pass adds the student's dW and db (each null or empty: none), made by a callable once every check has
// run: a layer's accumulators switch its gradients' modes (HeadDistillation), which must not happen for a call that
// then throws.
template <typename Scalar>
struct DistillGradients {
  MatrixRef<Scalar>* dW = nullptr;
  MatrixRef<Scalar>* db = nullptr;
};

// The student's dW [V, d] and db [V, 1], each skipped when null or empty.
template <typename Scalar>
void check_distill_gradients(const char* where, Index V, Index d, const MatrixRef<Scalar>* dW,
                             const MatrixRef<Scalar>* db) {
  if (dW && dW->size() != 0) check_shape(where, "dW", *dW, V, d);
  if (db && db->size() != 0) check_shape(where, "db", *db, V, 1);
}

// Every check shared by the entry points, before anything is written (dW and db: null when they are made after the
// checks, by a DistillGradients callable).
template <typename Scalar>
void check_distill_common(const char* where, const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W,
                          const ConstMatrixRef<Scalar>& bias, const MatrixRef<Scalar>* dh, const MatrixRef<Scalar>* dW,
                          const MatrixRef<Scalar>* db, const DistillationOptions& options,
                          const DistillationExtras<Scalar>& extras) {
  const Index N = h.rows(), V = W.rows(), d = W.cols();
  check_size(where, "V", V);
  check_shape(where, "h", h, N, d);
  if (dh) check_shape(where, "dh", *dh, N, d);
  if (bias.size() != 0) check_shape(where, "bias", bias, V, 1);
  check_distill_gradients(where, V, d, dW, db);
  if (extras.mask.size() != 0) check_shape(where, "mask", extras.mask, N, 1);
  if (extras.losses.size() != 0) check_shape(where, "losses", extras.losses, N, 1);
  check_distillation_options(where, options);
  // The logits are divided by T in Scalar: T and 1 / T must both be finite and non-zero there.
  check_in_scalar<Scalar>(where, "temperature", options.temperature, "(0, inf)");
  check_in_scalar<Scalar>(where, "1 / temperature", 1.0 / options.temperature, "(0, inf)");
  // token_chunks must hold one token's logits of both models.
  const Index row_bytes = 2 * V * static_cast<Index>(sizeof(Scalar));
  const Index budget = options.memory_budget > 0 ? options.memory_budget : kFusedDefaultBudget;
  if (options.plan == FusedPlan::token_chunks && budget < row_bytes) {
    std::ostringstream message;
    message << where << ": memory_budget = " << budget << " bytes outside [" << row_bytes
            << ", inf) for plan token_chunks: one token's logits of both models are " << row_bytes << " bytes";
    throw value_error(message.str());
  }
  check_mask(where, extras.mask);
}

template <typename Scalar>
bool distill_counted(const DistillationExtras<Scalar>& extras, Index n) {
  return extras.mask.size() == 0 || extras.mask(n, 0) != Scalar(0);
}

// The teacher head's checks: W_T, bias_T, db_T and dW_T with W's rows (a shard's, vocabulary-parallel).
template <typename Scalar>
void check_distill_head_teacher(const char* where, const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W,
                                const ConstMatrixRef<Scalar>& h_T, const ConstMatrixRef<Scalar>& W_T,
                                const ConstMatrixRef<Scalar>& bias_T, const MatrixRef<Scalar>* dh_T,
                                const MatrixRef<Scalar>* dW_T, const MatrixRef<Scalar>* db_T) {
  check_shape(where, "teacher W_T", W_T, W.rows(), W_T.cols());
  if (bias_T.size() != 0) check_shape(where, "teacher bias_T", bias_T, W.rows(), 1);
  if (db_T && db_T->size() != 0) check_shape(where, "db_T", *db_T, W.rows(), 1);
  check_shape(where, "teacher h_T", h_T, h.rows(), W_T.cols());
  if (dh_T && dh_T->size() != 0) check_shape(where, "dh_T", *dh_T, h.rows(), W_T.cols());
  if (dW_T && dW_T->size() != 0) check_shape(where, "dW_T", *dW_T, W.rows(), W_T.cols());
}

// Dense cached log-probs [N, V] (V the whole vocabulary: W.rows(), or the global V of a shard): shape, each counted
// row normalised, and no probability 0 for reverse_kl (or jsd at beta = 1).
template <typename Scalar>
void check_distill_dense(const char* where, Index N, Index V, const ConstMatrixRef<Scalar>& logprobs,
                         const DistillationOptions& options, const DistillationExtras<Scalar>& extras);

// Top-k cached log-probs over V classes (the global V of a shard): the divergence, k, the shapes, each counted row's
// ids (in [0, V), distinct, into teacher.topk_ids) and log-probs.
template <typename Scalar>
void check_distill_topk(const char* where, Index N, Index V, const TeacherTopK<Scalar>& top,
                        const DistillationOptions& options, const DistillationExtras<Scalar>& extras,
                        TeacherSource<Scalar>& teacher, DistillationWorkspace<Scalar>& ws);

// Once every other check has run: the student's gradients made by `gradients` (a callable -> DistillGradients, called
// only with dh), their shapes checked (a free function's dW and db; a layer's accumulators are [V, d] and [V, 1] by
// construction), then the pass.
template <typename Scalar, typename Gradients>
DistillationResult distill_checked_pass(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W,
                                        const ConstMatrixRef<Scalar>& bias, const TeacherSource<Scalar>& teacher,
                                        MatrixRef<Scalar>* dh, const Gradients& gradients,
                                        DistillationWorkspace<Scalar>& ws, const DistillationOptions& options,
                                        const DistillationExtras<Scalar>& extras, const char* where) {
  const DistillGradients<Scalar> out = dh ? gradients() : DistillGradients<Scalar>{};
  check_distill_gradients(where, W.rows(), W.cols(), out.dW, out.db);
  return distill_pass<Scalar>(h, W, bias, teacher, dh, out.dW, out.db, ws, options, extras);
}

// The entry points' gradients: the free functions' own dW and db, or none (the loss alone).
template <typename Scalar>
auto distill_outputs(MatrixRef<Scalar>& dW, MatrixRef<Scalar>& db) {
  return [&dW, &db] { return DistillGradients<Scalar>{&dW, &db}; };
}
template <typename Scalar>
DistillGradients<Scalar> no_distill_outputs() {
  return {};
}

template <typename Scalar, typename Gradients>
DistillationResult distill_head_impl(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W,
                                     const ConstMatrixRef<Scalar>& bias, const ConstMatrixRef<Scalar>& h_T,
                                     const ConstMatrixRef<Scalar>& W_T, const ConstMatrixRef<Scalar>& bias_T,
                                     MatrixRef<Scalar>* dh, const Gradients& gradients, MatrixRef<Scalar>* dh_T,
                                     MatrixRef<Scalar>* dW_T, MatrixRef<Scalar>* db_T,
                                     DistillationWorkspace<Scalar>& ws, const DistillationOptions& options,
                                     const DistillationExtras<Scalar>& extras, const char* where) {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");
  check_distill_common<Scalar>(where, h, W, bias, dh, nullptr, nullptr, options, extras);
  check_distill_head_teacher(where, h, W, h_T, W_T, bias_T, dh_T, dW_T, db_T);
  HeadTeacher<Scalar> head{&h_T, &W_T, &bias_T, dh_T, dW_T, db_T};
  TeacherSource<Scalar> teacher;
  teacher.head = &head;
  return distill_checked_pass<Scalar>(h, W, bias, teacher, dh, gradients, ws, options, extras, where);
}

template <typename Scalar, typename Gradients>
DistillationResult distill_dense_impl(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W,
                                      const ConstMatrixRef<Scalar>& bias, const ConstMatrixRef<Scalar>& logprobs,
                                      MatrixRef<Scalar>* dh, const Gradients& gradients,
                                      DistillationWorkspace<Scalar>& ws, const DistillationOptions& options,
                                      const DistillationExtras<Scalar>& extras, const char* where) {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");
  check_distill_common<Scalar>(where, h, W, bias, dh, nullptr, nullptr, options, extras);
  check_distill_dense(where, h.rows(), W.rows(), logprobs, options, extras);
  TeacherSource<Scalar> teacher;
  teacher.dense = &logprobs;
  return distill_checked_pass<Scalar>(h, W, bias, teacher, dh, gradients, ws, options, extras, where);
}

template <typename Scalar>
void check_distill_dense(const char* where, Index N, Index V, const ConstMatrixRef<Scalar>& logprobs,
                         const DistillationOptions& options, const DistillationExtras<Scalar>& extras) {
  check_shape(where, "teacher log-probs", logprobs, N, V);
  for (Index n = 0; n < N; ++n)
    if (distill_counted(extras, n)) check_logprob_row(where, "teacher log-probs", logprobs.row(n), n, false);
  // KL(p || q) is +inf, and its gradient NaN, on a class the teacher gives probability 0: refused
  // for reverse_kl (and jsd at beta = 1, which is reverse_kl), as on a top-k support.
  const bool reverse = options.divergence == Divergence::reverse_kl ||
                       (options.divergence == Divergence::jsd && options.beta == 1.0);
  for (Index n = 0; reverse && n < N; ++n) {
    if (!distill_counted(extras, n)) continue;
    for (Index j = 0; j < logprobs.cols(); ++j) {
      if (logprobs(n, j) != -std::numeric_limits<Scalar>::infinity()) continue;
      std::ostringstream message;
      message << where << ": teacher log-probs -inf at n=" << n << ", column " << j
              << ": reverse_kl (and jsd at beta = 1) needs every class's probability above 0 (KL(p || q) is "
                 "+inf where q = 0)";
      throw value_error(message.str());
    }
  }
}

template <typename Scalar, typename Gradients>
DistillationResult distill_topk_impl(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W,
                                     const ConstMatrixRef<Scalar>& bias, const TeacherTopK<Scalar>& top,
                                     MatrixRef<Scalar>* dh, const Gradients& gradients,
                                     DistillationWorkspace<Scalar>& ws, const DistillationOptions& options,
                                     const DistillationExtras<Scalar>& extras, const char* where) {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");
  check_distill_common<Scalar>(where, h, W, bias, dh, nullptr, nullptr, options, extras);
  TeacherSource<Scalar> teacher;
  check_distill_topk(where, h.rows(), W.rows(), top, options, extras, teacher, ws);
  return distill_checked_pass<Scalar>(h, W, bias, teacher, dh, gradients, ws, options, extras, where);
}

template <typename Scalar>
void check_distill_topk(const char* where, Index N, Index V, const TeacherTopK<Scalar>& top,
                        const DistillationOptions& options, const DistillationExtras<Scalar>& extras,
                        TeacherSource<Scalar>& teacher, DistillationWorkspace<Scalar>& ws) {
  const Index k = top.logprobs.cols();
  if (options.divergence != Divergence::forward_kl) {
    std::ostringstream message;
    message << where << ": divergence " << (options.divergence == Divergence::jsd ? "jsd" : "reverse_kl")
            << " outside {forward_kl}: top-k teacher log-probs define forward KL only";
    throw value_error(message.str());
  }
  if (k < 1 || k > V) {
    std::ostringstream message;
    message << where << ": k = " << k << " outside [1, " << V << "] (V = " << V << ")";
    throw shape_error(message.str());
  }
  check_shape(where, "teacher top-k log-probs", top.logprobs, N, k);
  if (top.ids.rows() != N || top.ids.cols() != k)
    throw_shape(where, "teacher top-k ids", top.ids.rows(), top.ids.cols(), N, k);
  teacher.topk = &top.logprobs;
  teacher.topk_ids.assign(static_cast<std::size_t>(N * k), 0);
  top.ids.visit([&](const auto& typed) {
    for (Index n = 0; n < N; ++n) {
      if (!distill_counted(extras, n)) continue;
      for (Index i = 0; i < k; ++i) {
        const Index id = static_cast<Index>(typed(n, i));
        if (id < 0 || id >= V) {
          std::ostringstream message;
          message << where << ": teacher top-k id " << id << " at n=" << n << ", column " << i << " outside [0, " << V
                  << ")";
          throw index_error(message.str());
        }
        teacher.topk_ids[static_cast<std::size_t>(n * k + i)] = id;
      }
      ws.top_ids.assign(teacher.topk_ids.begin() + n * k, teacher.topk_ids.begin() + (n + 1) * k);
      std::sort(ws.top_ids.begin(), ws.top_ids.end());
      const auto twice = std::adjacent_find(ws.top_ids.begin(), ws.top_ids.end());
      if (twice != ws.top_ids.end()) {
        std::ostringstream message;
        message << where << ": teacher top-k id " << *twice << " repeated at n=" << n << " (ids must be distinct)";
        throw value_error(message.str());
      }
      check_logprob_row(where, "teacher top-k log-probs", top.logprobs.row(n), n, true);
    }
  });
}

}  // namespace detail

// Common arguments: h [N, d], W [V, d] and bias [V, 1] (empty: none) the student's, options (divergence, temperature,
// beta, reduction, vocab_block), extras (mask [N, 1] in, losses [N, 1] out, each used when not empty). Outputs: dh [N,
// d] written (masked rows 0), dW [V, d] += and db [V, 1] += (each skipped when empty; db also without a bias). \throws
// value_error for temperature <= 0, NaN or inf (or T or 1 / T out of Scalar's range), beta outside [0, 1] or NaN (jsd),
// a negative vocab_block, a mask value other than 0 or 1, a cached log-prob row that holds NaN or +inf or does not
// normalise; shape_error for any shape that disagrees (the teacher's included); and for top-k, shape_error for k
// outside [1, V], index_error for an id outside [0, V), value_error for a repeated id, a row of -inf or a divergence
// other than forward_kl. Nothing is written on throw. \pre no output aliases an input or another output.

// h [N, d], W [V, d], bias [V, 1] or empty, h_T [N, d_T], W_T [V, d_T], bias_T [V, 1] or empty
// -> loss; dh [N, d] written, dW [V, d] +=, db [V, 1] +=; dh_T [N, d_T] written, dW_T [V, d_T] +=,
// db_T [V, 1] += when not empty (dW_T and db_T need dh_T).
template <typename Scalar>
DistillationResult distill_head_forward_backward(
    const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W, const ConstMatrixRef<Scalar>& bias,
    const ConstMatrixRef<Scalar>& h_T, const ConstMatrixRef<Scalar>& W_T, const ConstMatrixRef<Scalar>& bias_T,
    MatrixRef<Scalar> dh, MatrixRef<Scalar> dW, MatrixRef<Scalar> db, MatrixRef<Scalar> dh_T, MatrixRef<Scalar> dW_T,
    MatrixRef<Scalar> db_T, DistillationWorkspace<Scalar>& workspace, const DistillationOptions& options = {},
    const DistillationExtras<Scalar>& extras = {}) {
  return detail::distill_head_impl<Scalar>(h, W, bias, h_T, W_T, bias_T, &dh, detail::distill_outputs<Scalar>(dW, db),
                                           &dh_T, &dW_T, &db_T, workspace, options, extras,
                                           "distill_head_forward_backward");
}

// h [N, d], W [V, d], bias, h_T [N, d_T], W_T [V, d_T], bias_T -> the loss alone.
template <typename Scalar>
DistillationResult distill_head(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W,
                                const ConstMatrixRef<Scalar>& bias, const ConstMatrixRef<Scalar>& h_T,
                                const ConstMatrixRef<Scalar>& W_T, const ConstMatrixRef<Scalar>& bias_T,
                                DistillationWorkspace<Scalar>& workspace, const DistillationOptions& options = {},
                                const DistillationExtras<Scalar>& extras = {}) {
  return detail::distill_head_impl<Scalar>(h, W, bias, h_T, W_T, bias_T, nullptr, detail::no_distill_outputs<Scalar>,
                                           nullptr, nullptr, nullptr, workspace, options, extras, "distill_head");
}

// h [N, d], W [V, d], bias [V, 1] or empty, teacher log-probs [N, V] -> loss; dh [N, d] written,
// dW [V, d] +=, db [V, 1] +=.
template <typename Scalar>
DistillationResult distill_logprobs_forward_backward(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W,
                                                     const ConstMatrixRef<Scalar>& bias,
                                                     const ConstMatrixRef<Scalar>& teacher_logprobs,
                                                     MatrixRef<Scalar> dh, MatrixRef<Scalar> dW, MatrixRef<Scalar> db,
                                                     DistillationWorkspace<Scalar>& workspace,
                                                     const DistillationOptions& options = {},
                                                     const DistillationExtras<Scalar>& extras = {}) {
  return detail::distill_dense_impl<Scalar>(h, W, bias, teacher_logprobs, &dh, detail::distill_outputs<Scalar>(dW, db),
                                            workspace, options, extras, "distill_logprobs_forward_backward");
}

// h [N, d], W [V, d], bias, teacher log-probs [N, V] -> the loss alone.
template <typename Scalar>
DistillationResult distill_logprobs(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W,
                                    const ConstMatrixRef<Scalar>& bias, const ConstMatrixRef<Scalar>& teacher_logprobs,
                                    DistillationWorkspace<Scalar>& workspace, const DistillationOptions& options = {},
                                    const DistillationExtras<Scalar>& extras = {}) {
  return detail::distill_dense_impl<Scalar>(h, W, bias, teacher_logprobs, nullptr, detail::no_distill_outputs<Scalar>,
                                            workspace, options, extras, "distill_logprobs");
}

// h [N, d], W [V, d], bias, top-k {ids [N, k], log-probs [N, k]} -> loss (forward_kl over the
// renormalised top-k support); dh [N, d] written, dW [V, d] +=, db [V, 1] +=.
template <typename Scalar>
DistillationResult distill_topk_forward_backward(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W,
                                                 const ConstMatrixRef<Scalar>& bias, const TeacherTopK<Scalar>& teacher,
                                                 MatrixRef<Scalar> dh, MatrixRef<Scalar> dW, MatrixRef<Scalar> db,
                                                 DistillationWorkspace<Scalar>& workspace,
                                                 const DistillationOptions& options = {},
                                                 const DistillationExtras<Scalar>& extras = {}) {
  return detail::distill_topk_impl<Scalar>(h, W, bias, teacher, &dh, detail::distill_outputs<Scalar>(dW, db), workspace,
                                           options, extras, "distill_topk_forward_backward");
}

// h [N, d], W [V, d], bias, top-k {ids [N, k], log-probs [N, k]} -> the loss alone.
template <typename Scalar>
DistillationResult distill_topk(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W,
                                const ConstMatrixRef<Scalar>& bias, const TeacherTopK<Scalar>& teacher,
                                DistillationWorkspace<Scalar>& workspace, const DistillationOptions& options = {},
                                const DistillationExtras<Scalar>& extras = {}) {
  return detail::distill_topk_impl<Scalar>(h, W, bias, teacher, nullptr, detail::no_distill_outputs<Scalar>, workspace,
                                           options, extras, "distill_topk");
}

// ---- the layer-level form ----

// The distillation of a student OutputProjection, holding the options and the workspace, its gradients accumulated
// into the head's Parameters (as FusedHeadLoss does for the hard-label loss):
//   HeadDistillation<float> distill(options);
//   auto r = distill.forward_backward(student, h, teacher, h_T, dh);   // student's W (and b) gradients += ...
// Shapes: h [N, d] and student W [V, d], bias [V, 1] (or none); the teacher an OutputProjection, h_T [N, d_T] and
// W_T [V, d_T], bias_T [V, 1] (or none), frozen here (no teacher gradient: its Parameters are not touched), or cached
// log-probs, dense [N, V] or top-k (ids, log-probs [N, k]). Each call is the free function's (distill_head*,
// distill_logprobs*, distill_topk*) on W = student.weight().value() and the bias, with
//   dh [N, d] written,  student.weight().grad() += dW = dz^T h  [V, d] (dense mode),
//   student.bias()->grad() += db = sum_n dz_n  [V, 1],          dz = dL/ds [N, V] (the top of this file),
// the same loss, per-row losses, dh, dW and db bits. Tied (an OutputProjection of a TokenEmbedding) dW lands in the
// embedding's gradient, beside its sparse rows. A frozen W takes nothing (no dW products: about a quarter of the
// student's flops; its gradient is left as it was, mode included), nor does a frozen bias; loss and dh are the
// same. Trainable rows (Parameter::set_trainable_rows) on an unfrozen W or bias are refused: the pass computes a
// dense [V, d] dW, not a row mask's [k, d]. Every check runs before the head's gradients are touched (their
// accumulators switch a gradient to dense mode), so a call that throws leaves dh, the gradients and their modes as
// they were.
template <typename Scalar>
class HeadDistillation {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");

 public:
  explicit HeadDistillation(const DistillationOptions& options = {}) : options_(options) {}
  const DistillationOptions& options() const { return options_; }

  // h [N, d], teacher head (W_T [V, d_T], bias_T [V, 1] or none), h_T [N, d_T] -> loss; dh [N, d] written; student
  // W grad [V, d] +=, bias grad [V, 1] +=. \throws as distill_head_forward_backward, and value_error for trainable
  // rows; dh, the gradients and extras unchanged on throw.
  DistillationResult forward_backward(OutputProjection<Scalar>& student, const ConstMatrixRef<Scalar>& h,
                                      const OutputProjection<Scalar>& teacher, const ConstMatrixRef<Scalar>& h_T,
                                      MatrixRef<Scalar> dh, const DistillationExtras<Scalar>& extras = {}) {
    const char* where = "HeadDistillation::forward_backward";
    return with_gradients(student, where, [&](const auto& gradients) {
      const Eigen::Map<const RowMatrix<Scalar>> W_T = teacher.weight().value();
      return detail::distill_head_impl<Scalar>(h, weight_of(student), detail::head_bias(student), h_T, W_T,
                                               detail::head_bias(teacher), &dh, gradients, nullptr, nullptr, nullptr,
                                               workspace_, options_, extras, where);
    });
  }

  // h [N, d], teacher log-probs [N, V] -> loss; dh [N, d] written; student W grad [V, d] +=, bias grad [V, 1] +=.
  // \throws as distill_logprobs_forward_backward, and value_error for trainable rows; nothing changed on throw.
  DistillationResult forward_backward_logprobs(OutputProjection<Scalar>& student, const ConstMatrixRef<Scalar>& h,
                                               const ConstMatrixRef<Scalar>& teacher_logprobs, MatrixRef<Scalar> dh,
                                               const DistillationExtras<Scalar>& extras = {}) {
    const char* where = "HeadDistillation::forward_backward_logprobs";
    return with_gradients(student, where, [&](const auto& gradients) {
      return detail::distill_dense_impl<Scalar>(h, weight_of(student), detail::head_bias(student), teacher_logprobs,
                                                &dh, gradients, workspace_, options_, extras, where);
    });
  }

  // h [N, d], top-k {ids [N, k], log-probs [N, k]} -> loss (forward_kl); dh [N, d] written; student W grad [V, d] +=,
  // bias grad [V, 1] +=. \throws as distill_topk_forward_backward, and value_error for trainable rows; nothing changed
  // on throw.
  DistillationResult forward_backward_topk(OutputProjection<Scalar>& student, const ConstMatrixRef<Scalar>& h,
                                           const TeacherTopK<Scalar>& teacher, MatrixRef<Scalar> dh,
                                           const DistillationExtras<Scalar>& extras = {}) {
    const char* where = "HeadDistillation::forward_backward_topk";
    return with_gradients(student, where, [&](const auto& gradients) {
      return detail::distill_topk_impl<Scalar>(h, weight_of(student), detail::head_bias(student), teacher, &dh,
                                               gradients, workspace_, options_, extras, where);
    });
  }

  // h [N, d], teacher head, h_T [N, d_T] -> the loss alone (no gradient; trainable rows allowed).
  DistillationResult forward(const OutputProjection<Scalar>& student, const ConstMatrixRef<Scalar>& h,
                             const OutputProjection<Scalar>& teacher, const ConstMatrixRef<Scalar>& h_T,
                             const DistillationExtras<Scalar>& extras = {}) {
    const Eigen::Map<const RowMatrix<Scalar>> W_T = teacher.weight().value();
    return detail::distill_head_impl<Scalar>(h, weight_of(student), detail::head_bias(student), h_T, W_T,
                                             detail::head_bias(teacher), nullptr, detail::no_distill_outputs<Scalar>,
                                             nullptr, nullptr, nullptr, workspace_, options_, extras,
                                             "HeadDistillation::forward");
  }

  // h [N, d], teacher log-probs [N, V] -> the loss alone.
  DistillationResult forward_logprobs(const OutputProjection<Scalar>& student, const ConstMatrixRef<Scalar>& h,
                                      const ConstMatrixRef<Scalar>& teacher_logprobs,
                                      const DistillationExtras<Scalar>& extras = {}) {
    return detail::distill_dense_impl<Scalar>(h, weight_of(student), detail::head_bias(student), teacher_logprobs,
                                              nullptr, detail::no_distill_outputs<Scalar>, workspace_, options_, extras,
                                              "HeadDistillation::forward_logprobs");
  }

  // h [N, d], top-k {ids [N, k], log-probs [N, k]} -> the loss alone.
  DistillationResult forward_topk(const OutputProjection<Scalar>& student, const ConstMatrixRef<Scalar>& h,
                                  const TeacherTopK<Scalar>& teacher, const DistillationExtras<Scalar>& extras = {}) {
    return detail::distill_topk_impl<Scalar>(h, weight_of(student), detail::head_bias(student), teacher, nullptr,
                                             detail::no_distill_outputs<Scalar>, workspace_, options_, extras,
                                             "HeadDistillation::forward_topk");
  }

 private:
  static Eigen::Map<const RowMatrix<Scalar>> weight_of(const OutputProjection<Scalar>& head) {
    return head.weight().value();
  }

  // Trainable rows refused first (nothing touched); then `pass` given the callable that makes the student's
  // accumulators, which the pass calls once every check has run (a frozen W or bias: none, an empty dW or db).
  template <typename Pass>
  DistillationResult with_gradients(OutputProjection<Scalar>& student, const char* where, const Pass& pass) {
    Parameter<Scalar>& weight = student.weight();
    Parameter<Scalar>* bias = student.bias();
    for (const Parameter<Scalar>* p : std::initializer_list<const Parameter<Scalar>*>{&weight, bias}) {
      if (!p || !p->trainable_rows()) continue;
      const std::string rows = std::to_string(p->trainable_rows()->size()), cols = std::to_string(p->cols());
      detail::refuse_trainable_rows(where, p, p == &weight ? "student's W" : "student's bias",
                                    "the distillation pass adds a dense gradient [" + std::to_string(p->rows()) + ", " +
                                        cols + "], not the rows' [" + rows + ", " + cols +
                                        "] (freeze it, or make every row trainable: set_all_rows_trainable)");
    }
    Eigen::Map<RowMatrix<Scalar>> no_output(nullptr, 0, 1);
    std::optional<Eigen::Map<RowMatrix<Scalar>>> dW_map, db_map;
    std::optional<MatrixRef<Scalar>> dW_ref, db_ref;
    const auto gradients = [&] {
      dW_map.emplace(weight.frozen() ? no_output : weight.grad().dense_accumulator());
      db_map.emplace(bias && !bias->frozen() ? bias->grad().dense_accumulator() : no_output);
      dW_ref.emplace(*dW_map);
      db_ref.emplace(*db_map);
      return detail::DistillGradients<Scalar>{&*dW_ref, &*db_ref};
    };
    return pass(gradients);
  }

  DistillationOptions options_;
  DistillationWorkspace<Scalar> workspace_;
};

}  // namespace embedhead

#endif  // EMBEDHEAD_DISTILLATION_HPP
