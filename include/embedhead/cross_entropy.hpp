// embedhead: softmax cross-entropy on logits.
//
// For a row z = logits[n] [V] with target y = targets[n]:
//   lse    = m + log sum_j exp(z_j - m),  m = max_j z_j        (the true row max: no overflow)
//   loss_n = lse - z_y                                          (= -log softmax(z)_y)
//          = (m - z_y) + log sum_j exp(z_j - m)                 (computed so: nothing cancels)
//   dz     = (softmax(z) - one_hot(y)) * scale,  softmax(z)_j = exp(z_j - lse)
// Rows whose target equals ignore_index give loss 0, dz = 0 and are not counted.
// scale = 1 / count for Reduction::mean, 1 for sum and none (none: dz is d loss_n / d z), times
// gradient_scale. Take logits, not probabilities: applying softmax first is the classic bug.
//
// Options that large-vocabulary training uses, all off by default (detail/softmax.hpp has the
// formulas): label smoothing eps (PyTorch's: (1 - eps) * loss_n + eps * mean_j(lse - z_j)),
// z-loss (z_loss * lse^2 added per row, PaLM), final-logit soft-capping (z -> c tanh(z / c) before
// the softmax, Gemma 2) and a padded vocabulary (only the first valid_vocab columns are classes;
// the rest never count and get dz = 0).
//
// Class weights u [C] (PyTorch's `weight=`, semantics included): a row with target y counts with
// weight u_y -- its loss is u_y times the unweighted one and the mean divides by the sum of the
// counted targets' u_y -- and label smoothing's term is (eps / C) sum_j u_j (lse - s_j), divided
// by that same sum, as PyTorch's cross_entropy does:
//   loss_n = (1 - eps) u_y (lse - s_y) + (eps / C) sum_j u_j (lse - s_j)  [+ u_y (z_loss lse^2 - beta H_n)]
// The z-loss and entropy terms, which PyTorch does not have, count as the target does (times u_y).
//
// Soft (probability) targets (cross_entropy_soft*): row n's target is a distribution t_n over the
// C classes, dense [N, C] or sparse (SparseTargets: k (id, probability) pairs a row), in PyTorch's
// semantics for probability targets (label smoothing and class weights included):
//   t'_c   = (1 - eps) t_c + eps / C,   v_c = u_c t'_c,   T_n = sum_c v_c
//   loss_n = -sum_c v_c log softmax(s)_c = T_n lse - sum_c v_c s_c   [+ z_loss lse^2 - beta H_n]
//          = T_n log S + (T_n m - sum_c v_c s_c)                     (computed so)
//   dz_j   = (T_n p_j - v_j [+ 2 z_loss lse p_j + beta p_j (s_j - lse + H_n)]) * scale
// Every row counts once: mean divides the sum by N (not by a weight sum), as PyTorch does. There
// is no ignore_index (PyTorch rejects one with probability targets; so do we: it must stay -100).
// The targets are checked (PyTorch does not): each t_c finite and in [0, 1], each row summing to 1
// within kSoftTargetTolerance (the sum taken in double). A class with v_c = 0 adds 0 to the loss
// even when its logit is -inf (PyTorch: 0 * -inf = NaN).
//
// Non-finite logits (docs/errors.md, "Non-finite values"): as PyTorch, a NaN or +inf logit makes
// its row's loss and every dz of the row NaN (and so the reduced loss); -inf is a class of
// probability 0 (dz = 0; the loss is +inf if it is the target); a row of -inf classes is NaN.
// Ignored rows and padding columns never reach the loss (loss 0, dz 0 whatever they hold). With
// error_if_nonfinite, a NaN or infinite logit among the counted rows' classes throws instead.
#ifndef EMBEDHEAD_CROSS_ENTROPY_HPP
#define EMBEDHEAD_CROSS_ENTROPY_HPP

#include "detail/checks.hpp"
#include "detail/softmax.hpp"
#include "types.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace embedhead {

// mean: loss = sum of loss_n / their count (or weight sum); sum: loss = the sum.
// none: the result is the per-token losses, losses[n] = loss_n (0 for ignored rows), written by
// the calls with a `losses` output; CrossEntropyResult::loss is then defined as their sum (what
// `sum` reports, bit for bit), and the gradient is each loss_n's own (scale 1), as PyTorch's
// loss.backward(torch.ones_like(loss)). Unlike PyTorch, which returns only the [N] tensor, a call
// without a losses output is allowed and gives that sum (and the gradient, if asked).
enum class Reduction { mean, sum, none };

// The real-valued options are doubles, checked in the loss's Scalar too where its arithmetic
// uses them (detail::check_loss_options): z_loss, softcap and gradient_scale must not become inf
// there, softcap and gradient_scale not 0 unless they are 0.
struct CrossEntropyOptions {
  Index ignore_index = -100;  // PyTorch's default; targets equal to it are skipped
  Reduction reduction = Reduction::mean;
  double label_smoothing = 0;  // eps in [0, 1]
  double z_loss = 0;           // coefficient of lse^2, >= 0 (1e-4 in PaLM)
  double softcap = 0;          // c > 0 caps logits to c tanh(z / c) (30 in Gemma 2); 0: off
  Index valid_vocab = -1;      // classes are columns [0, valid_vocab); -1: all V columns
  double gradient_scale = 1;   // multiplies every gradient (e.g. 1 / micro-batches), finite
  // Entropy terms (RL trainers' use): with entropy_bonus = beta, each row's loss gets -beta H_n,
  // H_n = -sum_j p_j log p_j the entropy of its softmax (of the soft-capped logits), and its
  // gradient beta p_j (s_j - lse + H_n): beta > 0 rewards entropy (PPO's entropy coefficient),
  // beta < 0 penalises it. Finite. entropy (or a non-zero bonus) reports the rows' entropy in
  // CrossEntropyResult::entropy, reduced as the loss. Per-row entropies without a loss:
  // score_head (head_scores.hpp).
  double entropy_bonus = 0;
  bool entropy = false;
  // Per-class weights u [C] (C = valid_vocab, else V; empty: all 1), PyTorch's `weight=`: see the
  // header. Each finite and >= 0 (and finite in the loss's Scalar); a target of weight 0 is still
  // counted in `count`, with weight 0. With Reduction::mean the loss is divided by the sum of the
  // counted targets' u_y (0 when that sum is 0, where PyTorch gives NaN).
  std::vector<double> class_weights;
  // NaN and infinite logits (in the fused loss: h, W, bias) that reach the loss throw value_error,
  // naming the first, instead of giving PyTorch's NaN / inf results (docs/errors.md, "Non-finite
  // values"). Off by default, as in PyTorch; -inf masks are rejected too. Costs a scan of the
  // counted rows' classes (fused: of the counted rows of h and the class rows of W).
  bool error_if_nonfinite = false;
};

// Sparse soft targets: row n's targets are the k pairs (ids(n, i), probs(n, i)), i < k, ids in
// [0, C); the probabilities of a repeated id add up, an entry of probability 0 adds nothing.
// ids [N, k] (int32 or int64, any layout), probs [N, k].
template <typename Scalar>
struct SparseTargets {
  TokenIds ids;                  // [N, k]
  ConstMatrixRef<Scalar> probs;  // [N, k]
};

// How far a row of soft targets may sum from 1: |sum_c t_c - 1| <= kSoftTargetTolerance.
constexpr double kSoftTargetTolerance = 1e-3;

struct CrossEntropyResult {
  double loss = 0;        // mean: sum / weight_sum (0 when nothing counts); sum: sum; none: sum of
                          // the per-token losses (= sum; the losses themselves are the outputs)
  double sum = 0;         // sum of (weighted) loss_n over counted rows, z-loss included
  Index count = 0;        // rows whose target is not ignore_index
  double weight_sum = 0;  // sum of the counted rows' weights: token weight x u_y (= count without weights)
  double z_loss = 0;      // the z-loss part of `loss`, reduced the same way
  double entropy = 0;     // the rows' entropy H_n, weighted and reduced as the loss (computed with
                          // options.entropy or a non-zero entropy_bonus; else 0). The bonus's part
                          // of `loss` is -entropy_bonus * entropy.
};

namespace detail {

// Throws value_error unless every option is in range; valid_vocab is checked against V. The
// options the arithmetic uses in Scalar are checked there too (check_in_scalar): softcap (the
// soft-cap runs in Scalar: 0 there divides by zero, inf multiplies 0 by inf), gradient_scale
// (rounded into every gradient's factor: inf makes inf and NaN gradients, a non-zero value that is
// 0 in Scalar zeroes them all) and z_loss (inf in Scalar makes the gradient's factor inf).
// label_smoothing is used in double (its products with the row weight are rounded, and their
// underflow to 0 is that of the gradient itself).
template <typename Scalar>
void check_loss_options(const char* where, const CrossEntropyOptions& options, Index V) {
  auto fail = [&](const char* what, double value, const char* range) {
    std::ostringstream message;
    message << where << ": " << what << " = " << value << " outside " << range;
    throw value_error(message.str());
  };
  if (!(options.label_smoothing >= 0 && options.label_smoothing <= 1))
    fail("label_smoothing", options.label_smoothing, "[0, 1]");
  if (!(options.z_loss >= 0) || !std::isfinite(options.z_loss)) fail("z_loss", options.z_loss, "[0, inf)");
  check_in_scalar<Scalar>(where, "z_loss", options.z_loss, "[0, inf)", /*reject_underflow=*/false);
  if (!(options.softcap >= 0) || !std::isfinite(options.softcap)) fail("softcap", options.softcap, "[0, inf) (0: off)");
  check_in_scalar<Scalar>(where, "softcap", options.softcap, "[0, inf) (0: off)");
  if (!std::isfinite(options.entropy_bonus)) fail("entropy_bonus", options.entropy_bonus, "the finite numbers");
  check_in_scalar<Scalar>(where, "entropy_bonus", options.entropy_bonus, "the finite numbers",
                          /*reject_underflow=*/false);
  if (!std::isfinite(options.gradient_scale)) fail("gradient_scale", options.gradient_scale, "the finite numbers");
  check_in_scalar<Scalar>(where, "gradient_scale", options.gradient_scale, "the finite numbers");
  if (options.valid_vocab != -1 && (options.valid_vocab < 1 || options.valid_vocab > V)) {
    std::ostringstream message;
    message << where << ": valid_vocab = " << options.valid_vocab << " outside [1, " << V
            << "] (or -1 for all V = " << V << " columns)";
    throw value_error(message.str());
  }
  if (options.class_weights.empty()) return;
  const Index C = options.valid_vocab == -1 ? V : options.valid_vocab;
  if (static_cast<Index>(options.class_weights.size()) != C) {
    std::ostringstream message;
    message << where << ": class_weights has " << options.class_weights.size() << " entries, expected C = " << C
            << " (one per class: " << (options.valid_vocab == -1 ? "V" : "valid_vocab") << ")";
    throw shape_error(message.str());
  }
  // One pass of comparisons; the entry's name is built only for a message.
  const double largest = static_cast<double>(std::numeric_limits<Scalar>::max());
  double sum = 0;
  for (std::size_t j = 0; j < options.class_weights.size(); ++j) {
    const double u = options.class_weights[j];
    sum += u;
    if (u >= 0 && u <= largest) continue;  // NaN and inf fail both
    const std::string what = "class_weights[" + std::to_string(j) + "]";
    if (!(u >= 0) || !std::isfinite(u)) fail(what.c_str(), u, "[0, inf)");
    check_in_scalar<Scalar>(where, what.c_str(), u, "[0, inf)", /*reject_underflow=*/false);
  }
  if (!std::isfinite(sum)) fail("the sum of class_weights", sum, "the finite numbers");
}

inline Index classes_of(const CrossEntropyOptions& options, Index V) {
  return options.valid_vocab == -1 ? V : options.valid_vocab;
}

// Throws unless targets has N entries, each in [0, classes) or equal to ignore_index. A target
// in [classes, V) names a padding column and is rejected as such.
template <typename Id>
void check_targets(const char* where, const TypedTokenIds<Id>& targets, Index N, Index classes, Index ignore_index,
                   Index V = -1) {
  if (targets.size() != N) {
    std::ostringstream message;
    message << where << ": targets has " << targets.size() << " entries, expected N = " << N << " (one per logits row)";
    throw shape_error(message.str());
  }
  for (Index n = 0; n < N; ++n) {
    const Index y = static_cast<Index>(targets(n / targets.cols(), n % targets.cols()));
    if (y != ignore_index && (y < 0 || y >= classes)) {
      std::ostringstream message;
      message << where << ": target " << y << " at n=" << n << " (b=" << n / targets.cols()
              << ", t=" << n % targets.cols() << ") outside [0, " << classes << ") and not ignore_index ("
              << ignore_index << ")";
      if (V > classes && y >= classes && y < V)
        message << "; columns [" << classes << ", " << V << ") are vocabulary padding";
      throw index_error(message.str());
    }
  }
}

// With error_if_nonfinite: throws value_error naming the first NaN or infinite logit, in row-major
// order, among the columns [0, columns) of the counted rows -- the values that reach the loss (an
// ignored row, a padding column never does). first_column: the global column of logits' column 0
// (a vocabulary shard's begin), for the message.
template <typename Scalar, typename Id>
void check_finite_logits(const char* where, const ConstMatrixRef<Scalar>& logits, const TypedTokenIds<Id>& targets,
                         Index columns, const CrossEntropyOptions& options, Index first_column = 0) {
  if (!options.error_if_nonfinite) return;
  const Index T = targets.cols();
  for (Index n = 0; n < logits.rows(); ++n) {
    if (static_cast<Index>(targets(n / T, n % T)) == options.ignore_index) continue;
    const Index j = first_nonfinite_column(logits, n, columns);
    if (j < 0) continue;
    std::ostringstream place;
    place << "n=" << n << " (b=" << n / T << ", t=" << n % T << "), column " << first_column + j << ",";
    throw_nonfinite(where, "logit", logits(n, j), place.str());
  }
}

// Adds a row's (weighted) loss to the result and stores it in losses[n] when asked.
template <typename Scalar>
void add_row_loss(const RowLoss& row, double weight, CrossEntropyResult& result, MatrixRef<Scalar>* losses, Index n) {
  const double loss_n = weight == 1.0 ? row.total() : weight * row.total();
  result.sum += loss_n;
  result.z_loss += weight == 1.0 ? row.z_loss : weight * row.z_loss;
  // The entropy is reported unweighted per row (row.entropy), so its class weight is applied here.
  const double entropy_weight = weight * row.class_weight;
  result.entropy += entropy_weight == 1.0 ? row.entropy : entropy_weight * row.entropy;
  if (losses) (*losses)(n, 0) = static_cast<Scalar>(loss_n);
}

// mean divides by the weight sum; sum and none report the sums.
inline void finish_reduction(CrossEntropyResult& result, Reduction reduction) {
  if (reduction == Reduction::mean) {
    const double denominator = result.weight_sum;
    result.loss = denominator > 0 ? result.sum / denominator : 0.0;
    result.z_loss = denominator > 0 ? result.z_loss / denominator : 0.0;
    result.entropy = denominator > 0 ? result.entropy / denominator : 0.0;
  } else {
    result.loss = result.sum;
  }
}

// The gradient's multiplier for every counted row (before per-token weights).
inline double reduction_scale(Reduction reduction, double weight_sum, double gradient_scale) {
  if (reduction != Reduction::mean) return gradient_scale;
  return weight_sum > 0 ? gradient_scale / weight_sum : 0.0;
}

// The shared pass: writes dlogits when it is non-null, per-token losses when non-null.
template <typename Scalar, typename Id>
CrossEntropyResult cross_entropy_pass(const ConstMatrixRef<Scalar>& logits, const TypedTokenIds<Id>& targets,
                                      const CrossEntropyOptions& options, MatrixRef<Scalar>* dlogits,
                                      MatrixRef<Scalar>* losses, const char* where) {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");
  const Index N = logits.rows(), V = logits.cols(), T = targets.cols();
  if (dlogits) check_shape(where, "dlogits", *dlogits, N, V);
  if (losses) check_shape(where, "losses", *losses, N, 1);
  check_loss_options<Scalar>(where, options, V);
  const Index classes = classes_of(options, V);
  check_targets(where, targets, N, classes, options.ignore_index, V);
  check_finite_logits(where, logits, targets, classes, options);

  const SoftmaxTerms terms = softmax_terms(options, classes);
  CrossEntropyResult result;
  for (Index n = 0; n < N; ++n) {
    const Index y = static_cast<Index>(targets(n / T, n % T));
    if (y == options.ignore_index) continue;
    ++result.count;
    if (terms.class_weights) result.weight_sum += terms.target_weight(y);
  }
  if (!terms.class_weights) result.weight_sum = static_cast<double>(result.count);
  const double scale = reduction_scale(options.reduction, result.weight_sum, options.gradient_scale);
  // Soft-capping needs a row to write the capped logits to; without dlogits that is this one.
  std::vector<Scalar> scratch(!dlogits && options.softcap > 0 ? static_cast<std::size_t>(classes) : 0);
  for (Index n = 0; n < N; ++n) {
    const Index y = static_cast<Index>(targets(n / T, n % T));
    if (y == options.ignore_index) {
      if (dlogits) dlogits->row(n).setZero();
      if (losses) (*losses)(n, 0) = Scalar(0);
      continue;
    }
    // The kernel reads z_y and the max before it writes, so dlogits may be logits (in place).
    Scalar* work = dlogits ? dlogits->row(n).data() : scratch.data();
    const RowLoss row = softmax_loss_row<Scalar>(logits.row(n).data(), work, y, terms, dlogits != nullptr, scale);
    if (dlogits && classes < V) dlogits->row(n).tail(V - classes).setZero();
    add_row_loss(row, 1.0, result, losses, n);
  }
  finish_reduction(result, options.reduction);
  return result;
}

// Soft targets: options that do not apply. ignore_index must keep its default (PyTorch raises too).
inline void check_soft_options(const char* where, const CrossEntropyOptions& options) {
  if (options.ignore_index != -100) {
    std::ostringstream message;
    message << where << ": ignore_index = " << options.ignore_index
            << " with soft targets, which have no ignored rows (leave it at its default, -100)";
    throw value_error(message.str());
  }
}

// t = a target probability at `place`: finite and in [0, 1].
template <typename Scalar>
void check_soft_probability(const char* where, const char* what, Scalar t, Index n, Index i) {
  if (t >= Scalar(0) && t <= Scalar(1)) return;
  std::ostringstream message;
  message << where << ": " << what << "(" << n << ", " << i << ") = " << t << " outside [0, 1]";
  throw value_error(message.str());
}

inline void check_soft_sum(const char* where, double sum, Index n) {
  if (std::fabs(sum - 1.0) <= kSoftTargetTolerance) return;
  std::ostringstream message;
  message << where << ": targets of row n=" << n << " sum to " << sum << ", outside [1 - " << kSoftTargetTolerance
          << ", 1 + " << kSoftTargetTolerance << "] (a distribution over the classes)";
  throw value_error(message.str());
}

// Dense targets [N, C] (or [N, V], the padding columns [C, V) 0): throws unless every row is a
// distribution. fill(n, t) then writes row n's t [C].
template <typename Scalar>
struct DenseSoftTargets {
  const ConstMatrixRef<Scalar>& targets;

  void check(const char* where, Index N, Index C, Index V) const {
    if (targets.rows() != N || (targets.cols() != C && targets.cols() != V)) {
      std::ostringstream message;
      message << where << ": targets has shape [" << targets.rows() << ", " << targets.cols()
              << "], expected [N, C] = [" << N << ", " << C << "]";
      if (V != C) message << " or [N, V] = [" << N << ", " << V << "]";
      throw shape_error(message.str());
    }
    for (Index n = 0; n < N; ++n) {
      double sum = 0;
      for (Index j = 0; j < targets.cols(); ++j) {
        const Scalar t = targets(n, j);
        check_soft_probability(where, "targets", t, n, j);
        if (j >= C && t != Scalar(0)) {
          std::ostringstream message;
          message << where << ": targets(" << n << ", " << j << ") = " << t << " in a padding column [" << C << ", "
                  << V << "): must be 0";
          throw value_error(message.str());
        }
        sum += static_cast<double>(t);
      }
      check_soft_sum(where, sum, n);
    }
  }
  void fill(Index n, Index C, double* t) const {
    for (Index j = 0; j < C; ++j) t[j] = static_cast<double>(targets(n, j));
  }
};

// Sparse targets: throws unless ids and probs are [N, k] alike, every id in [0, C) and every row a
// distribution.
template <typename Scalar, typename Id>
struct SparseSoftTargets {
  const TypedTokenIds<Id>& ids;
  const ConstMatrixRef<Scalar>& probs;

  void check(const char* where, Index N, Index C, Index V) const {
    if (ids.rows() != N || probs.rows() != N || ids.cols() != probs.cols()) {
      std::ostringstream message;
      message << where << ": sparse targets have ids [" << ids.rows() << ", " << ids.cols() << "] and probs ["
              << probs.rows() << ", " << probs.cols() << "], expected both [N, k] with N = " << N;
      throw shape_error(message.str());
    }
    for (Index n = 0; n < N; ++n) {
      double sum = 0;
      for (Index i = 0; i < ids.cols(); ++i) {
        const Index c = static_cast<Index>(ids(n, i));
        if (c < 0 || c >= C) {
          std::ostringstream message;
          message << where << ": targets.ids(" << n << ", " << i << ") = " << c << " outside [0, " << C << ")";
          if (V > C && c >= C && c < V) message << "; columns [" << C << ", " << V << ") are vocabulary padding";
          throw index_error(message.str());
        }
        check_soft_probability(where, "targets.probs", probs(n, i), n, i);
        sum += static_cast<double>(probs(n, i));
      }
      check_soft_sum(where, sum, n);
    }
  }
  void fill(Index n, Index C, double* t) const {
    std::fill_n(t, C, 0.0);
    for (Index i = 0; i < ids.cols(); ++i) t[static_cast<Index>(ids(n, i))] += static_cast<double>(probs(n, i));
  }
};

// Checked soft targets as the fused loss reads them, a block of columns at a time: row n's
// v_c = u_c t'_c over global columns [c0, c0 + width) (fill_block) and T_n = sum_c v_c (mass).
// Either dense (targets [N, C or V]) or sparse (ids, as Index, and probs [N, k]).
template <typename Scalar>
struct SoftTargetRows {
  const ConstMatrixRef<Scalar>* dense = nullptr;
  const ConstMatrixRef<Scalar>* probs = nullptr;
  std::vector<Index> ids;  // [N * k], row-major
  Index k = 0;
  double eps = 0;
  Index classes = 0;
  const double* u = nullptr;  // class weights [C]; null: all 1
  double u_sum = 0;           // U = sum_c u_c (C without class weights)

  // eps, C, u and U from the loss's options, C = classes (valid_vocab, else V). O(C) once a call.
  void set_options(const CrossEntropyOptions& options, Index C) {
    eps = options.label_smoothing;
    classes = C;
    u = options.class_weights.empty() ? nullptr : options.class_weights.data();
    u_sum = static_cast<double>(C);
    if (u) {
      u_sum = 0;
      for (Index c = 0; c < C; ++c) u_sum += u[c];
    }
  }
  double weight(Index c) const { return u ? u[c] : 1.0; }
  // T_n: dense, sum_c v_c (O(C)); sparse, (1 - eps) sum_i u_{id_i} p_i + (eps / C) U (O(k)).
  double mass(Index n) const {
    const double smooth = eps / static_cast<double>(classes);
    double T = 0;
    if (dense) {
      for (Index c = 0; c < classes; ++c) T += weight(c) * ((1.0 - eps) * static_cast<double>((*dense)(n, c)) + smooth);
      return T;
    }
    for (Index i = 0; i < k; ++i)
      T += weight(ids[static_cast<std::size_t>(n * k + i)]) * static_cast<double>((*probs)(n, i));
    return (1.0 - eps) * T + (eps > 0 ? smooth * u_sum : 0.0);
  }
  void fill_block(Index n, Index c0, Index width, double* out) const {
    const double smooth = eps / static_cast<double>(classes);
    if (dense) {
      for (Index j = 0; j < width; ++j)
        out[j] = weight(c0 + j) * ((1.0 - eps) * static_cast<double>((*dense)(n, c0 + j)) + smooth);
      return;
    }
    for (Index j = 0; j < width; ++j) out[j] = weight(c0 + j) * smooth;
    for (Index i = 0; i < k; ++i) {
      const Index c = ids[static_cast<std::size_t>(n * k + i)];
      if (c >= c0 && c < c0 + width) out[c - c0] += weight(c) * (1.0 - eps) * static_cast<double>((*probs)(n, i));
    }
  }
};

// The soft-target pass: Targets is DenseSoftTargets or SparseSoftTargets. Everything is checked
// before anything is written; dlogits and losses are written when non-null.
template <typename Scalar, typename Targets>
CrossEntropyResult soft_cross_entropy_pass(const ConstMatrixRef<Scalar>& logits, const Targets& targets,
                                           const CrossEntropyOptions& options, MatrixRef<Scalar>* dlogits,
                                           MatrixRef<Scalar>* losses, const char* where) {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");
  const Index N = logits.rows(), V = logits.cols();
  if (dlogits) check_shape(where, "dlogits", *dlogits, N, V);
  if (losses) check_shape(where, "losses", *losses, N, 1);
  check_loss_options<Scalar>(where, options, V);
  check_soft_options(where, options);
  const Index C = classes_of(options, V);
  targets.check(where, N, C, V);
  if (options.error_if_nonfinite)
    for (Index n = 0; n < N; ++n) {
      const Index j = first_nonfinite_column(logits, n, C);
      if (j < 0) continue;
      std::ostringstream place;
      place << "n=" << n << ", column " << j << ",";
      throw_nonfinite(where, "logit", logits(n, j), place.str());
    }

  SoftmaxTerms terms = softmax_terms(options, C);
  CrossEntropyResult result;
  result.count = N;
  result.weight_sum = static_cast<double>(N);
  const double scale = reduction_scale(options.reduction, result.weight_sum, options.gradient_scale);
  std::vector<double> v(static_cast<std::size_t>(C));
  std::vector<Scalar> scratch(!dlogits && options.softcap > 0 ? static_cast<std::size_t>(C) : 0);
  const double eps = options.label_smoothing, smooth = eps / static_cast<double>(C);
  for (Index n = 0; n < N; ++n) {
    targets.fill(n, C, v.data());
    double mass = 0;
    for (Index c = 0; c < C; ++c) {
      const double t = (1.0 - eps) * v[c] + smooth;
      v[c] = terms.class_weights ? terms.class_weights[c] * t : t;
      mass += v[c];
    }
    terms.soft_targets = v.data();
    terms.soft_mass = mass;
    Scalar* work = dlogits ? dlogits->row(n).data() : scratch.data();
    const RowLoss row = softmax_loss_row<Scalar>(logits.row(n).data(), work, -1, terms, dlogits != nullptr, scale);
    if (dlogits && C < V) dlogits->row(n).tail(V - C).setZero();
    add_row_loss(row, 1.0, result, losses, n);
  }
  finish_reduction(result, options.reduction);
  return result;
}

template <typename Scalar, typename F>
CrossEntropyResult visit_sparse_targets(const SparseTargets<Scalar>& targets, const F& f) {
  return targets.ids.visit([&](const auto& typed) {
    using Id = typename std::decay_t<decltype(typed)>::id_type;
    return f(SparseSoftTargets<Scalar, Id>{typed, targets.probs});
  });
}

}  // namespace detail

// Targets are a TokenIds (token_ids.hpp): N ids of std::int32_t or std::int64_t in any shape
// and layout (row-major, column-major, a strided block), read in row-major order n = b * cols + t.
// The passes below are compiled once per id type and picked by one branch per call.

// logits [N, V], targets (N ids) -> loss; dlogits [N, V] written as (softmax - one_hot) * scale.
// \throws index_error for a target outside [0, V) that is not ignore_index (first one, with its
// n); shape_error if targets has not N entries or dlogits is not [N, V]; value_error for an option
// out of range (see CrossEntropyOptions; in Scalar too), or with error_if_nonfinite a NaN or
// infinite logit among the counted rows' classes (the first, with its n and column). Nothing
// written on throw.
// dlogits may be logits itself (computed in place, so the [N, V] gradient needs no second
// buffer). Cost: 3 passes over the logits, no allocation.
template <typename Scalar>
CrossEntropyResult cross_entropy_forward_backward(const ConstMatrixRef<Scalar>& logits, TokenIds targets,
                                                  MatrixRef<Scalar> dlogits, const CrossEntropyOptions& options = {}) {
  return targets.visit([&](const auto& typed) {
    return detail::cross_entropy_pass<Scalar>(logits, typed, options, &dlogits, nullptr,
                                              "cross_entropy_forward_backward");
  });
}

// logits [N, V], targets (N ids) -> loss; dlogits [N, V] as above and losses [N, 1] = loss_n
// (0 for ignored rows) in the same pass: Reduction::none's result and its gradient in one call.
// \throws as above, shape_error if losses is not [N, 1].
template <typename Scalar>
CrossEntropyResult cross_entropy_forward_backward(const ConstMatrixRef<Scalar>& logits, TokenIds targets,
                                                  MatrixRef<Scalar> dlogits, MatrixRef<Scalar> losses,
                                                  const CrossEntropyOptions& options = {}) {
  return targets.visit([&](const auto& typed) {
    return detail::cross_entropy_pass<Scalar>(logits, typed, options, &dlogits, &losses,
                                              "cross_entropy_forward_backward");
  });
}

// logits [N, V], targets (N ids) -> loss only. \throws as cross_entropy_forward_backward.
template <typename Scalar>
CrossEntropyResult cross_entropy(const ConstMatrixRef<Scalar>& logits, TokenIds targets,
                                 const CrossEntropyOptions& options = {}) {
  return targets.visit([&](const auto& typed) {
    return detail::cross_entropy_pass<Scalar>(logits, typed, options, nullptr, nullptr, "cross_entropy");
  });
}

// logits [N, V], targets (N ids) -> losses [N, 1]: loss_n per row (0 for ignored rows), the
// Reduction::none result. \throws as above, shape_error if losses is not [N, 1].
template <typename Scalar>
CrossEntropyResult cross_entropy_per_token(const ConstMatrixRef<Scalar>& logits, TokenIds targets,
                                           MatrixRef<Scalar> losses, const CrossEntropyOptions& options = {}) {
  return targets.visit([&](const auto& typed) {
    return detail::cross_entropy_pass<Scalar>(logits, typed, options, nullptr, &losses, "cross_entropy_per_token");
  });
}

// ---- soft (probability) targets: see the header ----
// \throws shape_error if targets is not [N, C] (or [N, V], its padding columns 0), sparse ids and
// probs are not both [N, k], dlogits is not [N, V] or losses not [N, 1]; value_error for a target
// probability NaN or outside [0, 1], a row not summing to 1 within kSoftTargetTolerance, a
// non-zero probability in a padding column, ignore_index other than -100, an option out of range,
// or with error_if_nonfinite a NaN or infinite logit among the classes; index_error for a sparse
// id outside [0, C). Each names the row n, the entry and the valid range. Nothing written on throw.
// dlogits may be logits itself.

// logits [N, V], targets [N, C] (or [N, V]) probabilities -> loss.
template <typename Scalar>
CrossEntropyResult cross_entropy_soft(const ConstMatrixRef<Scalar>& logits, const ConstMatrixRef<Scalar>& targets,
                                      const CrossEntropyOptions& options = {}) {
  return detail::soft_cross_entropy_pass<Scalar>(logits, detail::DenseSoftTargets<Scalar>{targets}, options, nullptr,
                                                 nullptr, "cross_entropy_soft");
}

// logits [N, V], sparse targets (ids [N, k], probs [N, k]) -> loss.
template <typename Scalar>
CrossEntropyResult cross_entropy_soft(const ConstMatrixRef<Scalar>& logits, const SparseTargets<Scalar>& targets,
                                      const CrossEntropyOptions& options = {}) {
  return detail::visit_sparse_targets(targets, [&](const auto& sparse) {
    return detail::soft_cross_entropy_pass<Scalar>(logits, sparse, options, nullptr, nullptr, "cross_entropy_soft");
  });
}

// logits [N, V], targets [N, C] (or [N, V]) -> loss; dlogits [N, V] = (T_n softmax - v) * scale.
template <typename Scalar>
CrossEntropyResult cross_entropy_soft_forward_backward(const ConstMatrixRef<Scalar>& logits,
                                                       const ConstMatrixRef<Scalar>& targets, MatrixRef<Scalar> dlogits,
                                                       const CrossEntropyOptions& options = {}) {
  return detail::soft_cross_entropy_pass<Scalar>(logits, detail::DenseSoftTargets<Scalar>{targets}, options, &dlogits,
                                                 nullptr, "cross_entropy_soft_forward_backward");
}

// ... and losses [N, 1] = loss_n in the same pass.
template <typename Scalar>
CrossEntropyResult cross_entropy_soft_forward_backward(const ConstMatrixRef<Scalar>& logits,
                                                       const ConstMatrixRef<Scalar>& targets, MatrixRef<Scalar> dlogits,
                                                       MatrixRef<Scalar> losses,
                                                       const CrossEntropyOptions& options = {}) {
  return detail::soft_cross_entropy_pass<Scalar>(logits, detail::DenseSoftTargets<Scalar>{targets}, options, &dlogits,
                                                 &losses, "cross_entropy_soft_forward_backward");
}

// logits [N, V], sparse targets (ids [N, k], probs [N, k]) -> loss; dlogits [N, V].
template <typename Scalar>
CrossEntropyResult cross_entropy_soft_forward_backward(const ConstMatrixRef<Scalar>& logits,
                                                       const SparseTargets<Scalar>& targets, MatrixRef<Scalar> dlogits,
                                                       const CrossEntropyOptions& options = {}) {
  return detail::visit_sparse_targets(targets, [&](const auto& sparse) {
    return detail::soft_cross_entropy_pass<Scalar>(logits, sparse, options, &dlogits, nullptr,
                                                   "cross_entropy_soft_forward_backward");
  });
}

// ... and losses [N, 1] = loss_n in the same pass.
template <typename Scalar>
CrossEntropyResult cross_entropy_soft_forward_backward(const ConstMatrixRef<Scalar>& logits,
                                                       const SparseTargets<Scalar>& targets, MatrixRef<Scalar> dlogits,
                                                       MatrixRef<Scalar> losses,
                                                       const CrossEntropyOptions& options = {}) {
  return detail::visit_sparse_targets(targets, [&](const auto& sparse) {
    return detail::soft_cross_entropy_pass<Scalar>(logits, sparse, options, &dlogits, &losses,
                                                   "cross_entropy_soft_forward_backward");
  });
}

// The loss as an object holding its options, so the scalar type is named once:
//   CrossEntropyLoss<float> loss;  auto r = loss.forward_backward(logits, targets, dlogits);
template <typename Scalar>
class CrossEntropyLoss {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");

 public:
  explicit CrossEntropyLoss(const CrossEntropyOptions& options = {}) : options_(options) {}
  const CrossEntropyOptions& options() const { return options_; }

  // logits [N, V], targets (N ids) -> loss. See cross_entropy.
  CrossEntropyResult forward(const ConstMatrixRef<Scalar>& logits, TokenIds targets) const {
    return targets.visit([&](const auto& typed) {
      return detail::cross_entropy_pass<Scalar>(logits, typed, options_, nullptr, nullptr, "CrossEntropyLoss::forward");
    });
  }

  // logits [N, V], targets (N ids) -> loss; dlogits [N, V] = (softmax - one_hot) * scale.
  // See cross_entropy_forward_backward.
  CrossEntropyResult forward_backward(const ConstMatrixRef<Scalar>& logits, TokenIds targets,
                                      MatrixRef<Scalar> dlogits) const {
    return targets.visit([&](const auto& typed) {
      return detail::cross_entropy_pass<Scalar>(logits, typed, options_, &dlogits, nullptr,
                                                "CrossEntropyLoss::forward_backward");
    });
  }
  // ... and losses [N, 1] = loss_n in the same pass.
  CrossEntropyResult forward_backward(const ConstMatrixRef<Scalar>& logits, TokenIds targets, MatrixRef<Scalar> dlogits,
                                      MatrixRef<Scalar> losses) const {
    return targets.visit([&](const auto& typed) {
      return detail::cross_entropy_pass<Scalar>(logits, typed, options_, &dlogits, &losses,
                                                "CrossEntropyLoss::forward_backward");
    });
  }

  // Soft (probability) targets, as cross_entropy_soft[_forward_backward]: logits [N, V], targets
  // [N, C] (or [N, V]) or SparseTargets [N, k] -> loss (and dlogits [N, V]).
  CrossEntropyResult forward_soft(const ConstMatrixRef<Scalar>& logits, const ConstMatrixRef<Scalar>& targets) const {
    return detail::soft_cross_entropy_pass<Scalar>(logits, detail::DenseSoftTargets<Scalar>{targets}, options_, nullptr,
                                                   nullptr, "CrossEntropyLoss::forward_soft");
  }
  CrossEntropyResult forward_soft(const ConstMatrixRef<Scalar>& logits, const SparseTargets<Scalar>& targets) const {
    return detail::visit_sparse_targets(targets, [&](const auto& sparse) {
      return detail::soft_cross_entropy_pass<Scalar>(logits, sparse, options_, nullptr, nullptr,
                                                     "CrossEntropyLoss::forward_soft");
    });
  }
  CrossEntropyResult forward_backward_soft(const ConstMatrixRef<Scalar>& logits, const ConstMatrixRef<Scalar>& targets,
                                           MatrixRef<Scalar> dlogits) const {
    return detail::soft_cross_entropy_pass<Scalar>(logits, detail::DenseSoftTargets<Scalar>{targets}, options_,
                                                   &dlogits, nullptr, "CrossEntropyLoss::forward_backward_soft");
  }
  CrossEntropyResult forward_backward_soft(const ConstMatrixRef<Scalar>& logits, const SparseTargets<Scalar>& targets,
                                           MatrixRef<Scalar> dlogits) const {
    return detail::visit_sparse_targets(targets, [&](const auto& sparse) {
      return detail::soft_cross_entropy_pass<Scalar>(logits, sparse, options_, &dlogits, nullptr,
                                                     "CrossEntropyLoss::forward_backward_soft");
    });
  }

 private:
  CrossEntropyOptions options_;
};

}  // namespace embedhead

#endif  // EMBEDHEAD_CROSS_ENTROPY_HPP
