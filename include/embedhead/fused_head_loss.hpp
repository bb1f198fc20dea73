// embedhead: the LM head and its cross-entropy fused, a chunk of tokens or a block of the
// vocabulary at a time, so the [N, V] logits never exist.
//
// For hidden states h [N, d], the head W [V, d] (+ bias b [V]) and targets y [N], one call gives
//   loss                      = reduce_n w_n (ce_n + z_loss lse_n^2)       (cross_entropy.hpp)
//   dh  [N, d]  (written)     = dz W
//   dW  [V, d]  (accumulated) += dz^T h
//   db  [V]     (accumulated) += column sums of dz
// with dz = d loss / d logits: what OutputProjection::forward + cross_entropy_forward_backward +
// OutputProjection::backward compute (the unfused path), without ever holding the [N, V] logits.
// Two plans walk them (FusedPlan, chosen per call by FusedHeadLossOptions::plan):
//   token_chunks  for each chunk of n tokens (n from memory_budget, default 64 MiB of logits):
//                 logits [n, V] = h_chunk W^T (+ b), each row's max, sum of exponentials, target
//                 logit and sum of logits (online over vocab_block columns at a time), lse and
//                 loss, dz in place, then dW += dz^T h_chunk, db += sums of dz, dh_chunk = dz W.
//                 6 N V d flops, as unfused: nothing is recomputed. dW is streamed once per chunk.
//   vocab_blocks  pass 1, for each block of vocab_block rows of W: logits [N, block] = h
//                 W_block^T (+ b) and each row's running statistics (the online softmax of
//                 Milakov & Gimelshein 2018) -> lse, loss; pass 2, for each block again: the same
//                 logits recomputed, turned into dz with the lse from pass 1, then dW_block +=
//                 dz^T h, db_block += sums of dz, dh += dz W_block. 8 N V d flops, a buffer of N
//                 vocab_block (about 2 % of the logits): for a vocabulary so large that the budget
//                 holds too few tokens for dW's product to run at GEMM speed.
// automatic (the default) takes token_chunks when the budget holds kFusedMinTokenChunk (128)
// tokens or all of them (GPT-2's V = 50,257: 333 tokens, chunks of 256: fused_token_chunk), else
// vocab_blocks; bench/RESULTS.md has the measurements behind it. The two agree within float rounding (the loss of each
// row is summed over the same blocks of columns; dW's sums over tokens are split differently). The loss alone
// (fused_head_loss, FusedHeadLoss::forward: 2 N V d flops) walks the same way without the backward.
// Tokens whose target is ignore_index are dropped before any arithmetic.
//
// Non-finite h, W or bias (docs/errors.md, "Non-finite values") give the plain loss's results on
// the logits they make, in either plan: a NaN or +inf logit makes its row NaN (and, through dW =
// dz^T h and db, every class row of dW and db), a -inf logit is a masked class -- a block of them
// adds 0 to the running sum of exponentials -- and a row of -inf classes has lse = -inf and a NaN
// loss. With error_if_nonfinite, a NaN or infinity in the counted rows of h, W's class rows or the
// bias throws instead (check_finite_inputs).
//
// Every option of the plain loss applies (CrossEntropyOptions: ignore_index, reductions, label
// smoothing, z-loss, soft-capping, a padded vocabulary, gradient_scale, entropy terms, class
// weights), plus per-token weights w_n >= 0 (mean divides by their sum over counted tokens; with
// class weights by the sum of w_n u_{y_n}), the log-sum-exp of every row as an output (for z-loss
// monitoring), and per-token losses (Reduction::none).
// Soft (probability) targets (fused_head_loss_soft*: dense [N, C] or SparseTargets, the plain
// loss's semantics, cross_entropy.hpp): each block of columns adds sum_c v_c s_c over its columns
// to the row's statistics (v_c = u_c t'_c, filled a block at a time from the targets) and
// subtracts w v_j in the row's gradient; T_n = sum_c v_c is computed once per row. With a float or
// double W, and with a bf16 W (below).
//
// bf16 mixed precision (the overloads taking W as Eigen::bfloat16, "bf16 mixed precision" below,
// for class indices and soft targets alike): the same pass with the products' inputs in bf16 --
// bf16(h), W, bf16(dz) -- and everything else, dW's accumulation included, in float; the products
// run on gemm::MixedBackend (oneDNN's bf16 kernels when the program links embedhead::onednn).
//
// Vocabulary-parallel (parallel/vocab_parallel_fused_head_loss.hpp): the same pass runs on one rank's
// shard of W's rows, in the same plan, with the per-row statistics combined across ranks for each
// token chunk (once for the two passes) and dh at the end (detail::fused_head_loss_pass's
// VocabSlice, implemented there over the Communicator).
//
// Threads (when built with OpenMP): each GEMM is cut into pieces -- rows of W for the logits (256
// within a two-pass block, 1024 across a token chunk's vocabulary); dW and dh one piece per
// thread on the default packed kernel, whose results do not depend on the pieces, else fixed
// pieces (rows of W for dW as for the logits, 128 columns of d for dh) -- and each row's softmax
// is one thread's, so the result is bit-identical for any thread count and across runs (for the
// default packed kernel, Eigen's, the serial CBLAS one and, for the bf16 products, oneDNN:
// detail/gemm.hpp, detail/gemm_onednn.hpp). The idea of never
// materialising the logits is Liger-Kernel's fused linear cross-entropy (Hsu et al. 2024) and Cut
// Cross-Entropy's (Wijmans et al. 2024); the code is this library's own.
#ifndef EMBEDHEAD_FUSED_HEAD_LOSS_HPP
#define EMBEDHEAD_FUSED_HEAD_LOSS_HPP

#include "cross_entropy.hpp"
#include "detail/checks.hpp"
#include "detail/gemm.hpp"
#include "detail/kernels.hpp"
#include "detail/softmax.hpp"
#include "output_projection.hpp"
#include "types.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace embedhead {

// How forward_backward walks the [N, V] logits it never holds (the top of this file):
//   token_chunks  one pass: n tokens at a time, their logits [n, V] computed once, turned into dz
//                 in place and used at once for dh and dW -- 6 N V d flops;
//   vocab_blocks  two passes over blocks of vocab_block rows of W, all tokens at once, the logits
//                 recomputed in the second -- 8 N V d flops, a buffer of N * vocab_block;
//   automatic     token_chunks when memory_budget holds at least kFusedMinTokenChunk tokens' rows of
//                 logits (or all of them), else vocab_blocks (bench/RESULTS.md has the measurements).
// The loss alone (forward, fused_head_loss) walks the logits the same way without the backward
// (2 N V d flops either way), so it is forward_backward's loss bit for bit under the same options.
enum class FusedPlan { automatic, token_chunks, vocab_blocks };

struct FusedHeadLossOptions : CrossEntropyOptions {
  // Rows of W per block: the logits buffer is [N, vocab_block]. 0 picks V / 50 rounded up to a
  // multiple of 64, within [256, 4096] (and at most V): about 2 % of the logits' memory, chosen
  // with bench/fused_head_loss_bench.cpp. It fixes the order of the floating-point sums, so the
  // result depends on it (within rounding) but never on the thread count. The token-chunk plan
  // sums each row's softmax statistics over the same blocks.
  Index vocab_block = 0;
  FusedPlan plan = FusedPlan::automatic;
  // Bytes the token-chunk plan may hold as logits: a chunk is n = memory_budget / (C sizeof(Scalar))
  // tokens (C: the classes; vocabulary-parallel, the most classes any shard holds), at most all the
  // counted ones (see fused_token_chunk for how n is rounded). 0: kFusedDefaultBudget (64 MiB:
  // 256 tokens of GPT-2's V = 50,257 in float, 25 % of the logits of N = 1024). The chunk fixes
  // dW's order of summation over tokens, so the result depends on it (within rounding), never on
  // the thread count. It does not bound the two-pass plan, whose buffer is N * vocab_block scalars
  // (64 MiB at N = 4096, vocab_block = 4096). Soft targets add a block of their weights v in double
  // for each row of the buffer: chunk * vocab_block doubles in token chunks (not counted in the
  // budget), N * vocab_block in the two-pass plan (128 MiB at the shape above, in float twice the
  // logits' buffer).
  Index memory_budget = 0;
};

// Buffers reused across calls, so the steady state allocates nothing but the GEMM backend's packing
// buffers. Contents are internal; a default-constructed one is always valid.
template <typename Scalar>
struct FusedHeadLossWorkspace {
  std::vector<Scalar> hidden;                      // [count, d] the counted tokens' rows of h, when some are ignored
  std::vector<Scalar> dhidden;                     // [count, d] their dh
  std::vector<Scalar> logits;                      // [chunk, C] or [count, vocab_block] logits, then dz
  std::vector<Index> tokens;                       // token index n of each counted row
  std::vector<detail::SoftmaxRowStats> row_stats;  // pass 1's running statistics
  std::vector<double> lse;                         // each counted row's log-sum-exp
  std::vector<double> entropy;                     // and its entropy (with an entropy term)
  std::vector<double> reduced;                     // vocabulary-parallel: the per-row sums all-reduced in one call
  std::vector<double> soft_mass;                   // soft targets: each counted row's T_n
  std::vector<double> soft_block;                  // and its v over a block of columns, per row being worked
  // bf16 mixed precision (W stored in bf16): h and dz rounded to bf16, as bf16 where the backend takes
  // bf16 operands (oneDNN), else as Scalar holding the rounded values (hidden then holds h's); the
  // float tiles a bf16 W is widened into on such a backend.
  std::vector<Eigen::bfloat16> hidden_bf16, dz_bf16;
  std::vector<Scalar> dz_rounded;
  std::vector<float> tiles;
  std::vector<Scalar> piece_logits;            // a token chunk's product per thread, before its copy
  std::vector<std::vector<float>> slot_tiles;  // and the widened tiles of each thread's product
  std::vector<Scalar> masked_dz;               // trainable rows (a row mask on W): a block's dz columns of those rows
};

// Optional per-token inputs and outputs of the fused loss (the free functions and the layer-level
// forms alike). Each is absent when empty (size 0), as default-constructed; present, it must be
// [N, 1]. Each member is a Map, bound when the struct is made (assigning to a Map copies values
// into it, it does not rebind it):
//   FusedHeadLossExtras<float> extras{{weights.data(), N, 1}, {lse.data(), N, 1}, {losses.data(), N, 1}};
//   FusedHeadLossExtras<float> lse_only{{}, {lse.data(), N, 1}};
template <typename Scalar>
struct FusedHeadLossExtras {
  Eigen::Map<const RowMatrix<Scalar>> weights{nullptr, 0, 1};  // in:  [N, 1] per-token weights (>= 0)
  Eigen::Map<RowMatrix<Scalar>> lse{nullptr, 0, 1};            // out: [N, 1] log-sum-exp of each row
  Eigen::Map<RowMatrix<Scalar>> losses{nullptr, 0, 1};         // out: [N, 1] w_n * loss_n (Reduction::none's result)
  Eigen::Map<RowMatrix<Scalar>> entropy{nullptr, 0, 1};        // out: [N, 1] H_n, each row's softmax entropy
};

namespace detail {

// body(r) for every row r in [0, rows), in groups of 32 rows per hand-out.
template <typename Body>
void parallel_rows(Index rows, const Body& body) {
  constexpr Index kGroup = 32;
  parallel_blocks((rows + kGroup - 1) / kGroup, [&](Index group) {
    for (Index r = group * kGroup, end = std::min(rows, r + kGroup); r < end; ++r) body(r);
  });
}

// Throws value_error unless every per-token weight [N, 1] is finite and >= 0 (the first bad one,
// with its n).
template <typename Weights>
void check_token_weights(const char* where, const Weights& weights) {
  for (Index n = 0; n < weights.size(); ++n) {
    const double w = static_cast<double>(weights(n, 0));
    if (!(w >= 0) || !std::isfinite(w)) {
      std::ostringstream message;
      message << where << ": weight " << w << " at n=" << n << " outside [0, inf)";
      throw value_error(message.str());
    }
  }
}

inline Index fused_vocab_block(Index option, Index classes) {
  if (option > 0) return std::min(option, classes);
  const Index rows = (classes / 50 + 63) / 64 * 64;
  return std::min(classes, std::clamp<Index>(rows, 256, 4096));
}

inline Index fused_memory_budget(const FusedHeadLossOptions& options) {
  return options.memory_budget > 0 ? options.memory_budget : kFusedDefaultBudget;
}

// The token-chunk plan's tokens per chunk for `count` counted tokens whose logits rows are
// `columns` long (the classes; with a slice, the most classes any shard holds), or 0 for the
// two-pass plan; automatic takes token chunks when the budget holds kFusedMinTokenChunk tokens (or
// all count of them). With `fits` tokens in memory_budget: all count of them if they fit; else a
// multiple of kPackedDepth (256) tokens when fits is at least that, so that on the packed kernel
// dW += dz^T h over the chunks sums the tokens in the same blocks as one unfused product over the
// same counted tokens does (detail/gemm_packed.hpp; ignored tokens are dropped first, so with some
// the blocks fall elsewhere than in an unfused product over all N rows); else chunks of equal
// length (count / chunks, rounded up), so that no short last chunk streams W and dW for a few
// tokens. \pre check_fused_head_loss passed (token_chunks: at least one row fits).
inline Index fused_token_chunk(const FusedHeadLossOptions& options, Index count, Index columns, Index scalar_bytes) {
  if (options.plan == FusedPlan::vocab_blocks || count == 0) return 0;
  const Index row_bytes = std::max<Index>(columns, 1) * scalar_bytes;
  const Index held = std::min(count, fused_memory_budget(options) / row_bytes);  // may be 0
  if (options.plan == FusedPlan::automatic && held < std::min(count, kFusedMinTokenChunk)) return 0;
  const Index fits = std::max<Index>(held, 1);  // token_chunks: check_fused_head_loss saw one row fit
  if (fits == count) return count;
  if (fits >= gemm::kPackedDepth) return fits / gemm::kPackedDepth * gemm::kPackedDepth;
  const Index chunks = (count + fits - 1) / fits;
  return (count + chunks - 1) / chunks;
}

// A vocabulary shard for fused_head_loss_pass: W holds rows [begin, begin + W.rows()) of the
// global [V, d] head, and the other rows live on other ranks. Its two collective steps are the
// caller's (parallel/vocab_parallel_fused_head_loss.hpp does them over a Communicator), so this
// single-process header knows nothing of ranks.
template <typename Scalar>
struct VocabSlice {
  Index begin = 0;   // global row of W's row 0
  Index V = 0;       // the global vocabulary
  Index widest = 0;  // the most rows any rank's shard has (the same on every rank)
  VocabSlice(Index begin_row, Index vocabulary, Index widest_rows)
      : begin(begin_row), V(vocabulary), widest(widest_rows) {}
  virtual ~VocabSlice() = default;
  // After pass 1 (or a token chunk's statistics): ws.row_stats[first, first + rows) over the local
  // columns -> the same over all V columns.
  virtual void combine_row_stats(FusedHeadLossWorkspace<Scalar>& ws, Index first, Index rows,
                                 const SoftmaxTerms& terms) const = 0;
  // At the end: dh [size] (contiguous), this rank's partial sum -> the sum over every rank.
  virtual void sum_over_ranks(Scalar* dh, Index size) const = 0;
};

// Every check of fused_head_loss_pass, in its order, before anything is written: W_rows is W's
// row count (a shard's with a VocabSlice), V the global vocabulary (= W_rows single-process);
// null or empty outputs are not checked. The vocabulary-parallel callers run it inside
// check_on_every_rank, with dW and db null (a Parameter's gradient has its value's shape).
template <typename Scalar, typename Id>
void check_fused_head_loss(const char* where, const ConstMatrixRef<Scalar>& h, Index W_rows, Index d,
                           const ConstMatrixRef<Scalar>& bias, const TypedTokenIds<Id>& targets,
                           const FusedHeadLossExtras<Scalar>& extras, const MatrixRef<Scalar>* dh,
                           const MatrixRef<Scalar>* dW, const MatrixRef<Scalar>* db,
                           const FusedHeadLossOptions& options, Index V,
                           Index bytes_per_logit = static_cast<Index>(sizeof(Scalar))) {
  const Index N = h.rows();
  const ConstMatrixRef<Scalar> weights = extras.weights;
  check_shape(where, "h", h, N, d);
  if (bias.size() != 0) check_shape(where, "bias", bias, W_rows, 1);
  if (weights.size() != 0) check_shape(where, "weights", weights, N, 1);
  if (dh) check_shape(where, "dh", *dh, N, d);
  if (dW && dW->size() != 0) check_shape(where, "dW", *dW, W_rows, d);
  if (db && db->size() != 0) check_shape(where, "db", *db, W_rows, 1);
  if (extras.lse.size() != 0) check_shape(where, "lse", extras.lse, N, 1);
  if (extras.losses.size() != 0) check_shape(where, "losses", extras.losses, N, 1);
  if (extras.entropy.size() != 0) check_shape(where, "entropy", extras.entropy, N, 1);
  check_loss_options<Scalar>(where, options, V);
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
  // token_chunks must hold one row of logits: the classes among W's rows (on rank 0, whose check
  // every rank shares through check_on_every_rank, the most any shard holds).
  const Index row_bytes = std::min(W_rows, classes_of(options, V)) * bytes_per_logit;
  if (options.plan == FusedPlan::token_chunks && fused_memory_budget(options) < row_bytes) {
    std::ostringstream message;
    message << where << ": memory_budget = " << fused_memory_budget(options) << " bytes outside [" << row_bytes
            << ", inf) for plan token_chunks: one token's logits are " << row_bytes << " bytes";
    throw value_error(message.str());
  }
  check_targets(where, targets, N, classes_of(options, V), options.ignore_index, V);
  check_token_weights(where, weights);
}

// With options.error_if_nonfinite: throws value_error naming the first NaN or infinite value that
// reaches the loss -- in a counted token's row of h (in token order), then in W's class rows, then
// in the bias's -- before anything is written. W holds rows [begin, begin + W.rows()) of the
// global head of V rows (a shard's, vocabulary-parallel; named by their global row). A finite h
// and W whose logits overflow are not caught: they give the non-finite logits' results.
template <typename Scalar, typename Storage, typename Id>
void check_finite_inputs(const char* where, const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Storage>& W,
                         const ConstMatrixRef<Scalar>& bias, const TypedTokenIds<Id>& targets,
                         const FusedHeadLossOptions& options, Index V, Index begin = 0) {
  if (!options.error_if_nonfinite) return;
  const Index T = targets.cols();
  for (Index n = 0; n < h.rows(); ++n) {
    if (static_cast<Index>(targets(n / T, n % T)) == options.ignore_index) continue;
    const Index j = first_nonfinite_column(h, n, h.cols());
    if (j < 0) continue;
    std::ostringstream place;
    place << "n=" << n << " (b=" << n / T << ", t=" << n % T << "), column " << j << ",";
    throw_nonfinite(where, "h", h(n, j), place.str());
  }
  const Index local_classes = std::clamp<Index>(classes_of(options, V) - begin, 0, W.rows());
  for (Index r = 0; r < local_classes; ++r) {
    const Index j = first_nonfinite_column(W, r, W.cols());
    if (j < 0) continue;
    std::ostringstream place;
    place << "row " << begin + r << ", column " << j << ",";
    throw_nonfinite(where, "W", W(r, j), place.str());
  }
  if (bias.size() == 0) return;
  for (Index r = 0; r < local_classes; ++r)
    if (!std::isfinite(bias(r, 0))) throw_nonfinite(where, "bias", bias(r, 0), "row " + std::to_string(begin + r));
}

// The fused pass (see the top of this file), in either plan; dh == nullptr: the loss alone.
//
// slice == nullptr: W is the whole head [V, d]. With a slice, W is one rank's shard of rows
// [begin, end) and every rank calls the pass with its own shard and the same h, targets, weights
// and options: targets stay global ids and the classes are the global valid_vocab, of which the
// shard holds the local columns [0, clamp(classes - begin, 0, rows)) (a shard wholly in the
// padding holds none). The statistics run on the local columns (pass 1, or a token chunk's rows);
// then each row's running maximum is all-reduced (max), every rank rescales its local sum of
// exponentials to the global maximum, and one all-reduce sums [sum_exp, target logit, (sum of
// logits)] -- the target logit is one rank's value plus zeros, so exact. From there the loss is
// computed from identical numbers on every rank. dz is written for the local columns only (dW
// and db are the shard's rows) and dh, a partial sum over the local columns, is all-reduced at the
// end (count * d values). In token chunks, dW and the outputs are written chunk by chunk, between
// the chunks' collectives: a communicator that fails mid-call leaves them partly updated. With one rank
// the arithmetic is the single-process pass's, bit for bit (the rescale factor is exp(0) = 1).
// \pre with a slice, the caller has agreed check_fused_head_loss across the ranks
// (check_on_every_rank) before calling: the local checks here then cannot fail on one rank alone.
// p itself when Low is its type; otherwise (a mixed-precision operand, which the pass always
// gathers into a buffer of its own) never called.
template <typename Low, typename Scalar>
const Low* same_storage(const Scalar* p) {
  if constexpr (std::is_same_v<Low, Scalar>)
    return p;
  else
    return nullptr;
}

template <typename Scalar, typename Id, typename Storage = Scalar, typename Backend = gemm::DefaultBackend>
CrossEntropyResult fused_head_loss_pass(
    const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<typename non_deduced<Storage>::type>& W,
    const ConstMatrixRef<Scalar>& bias, const TypedTokenIds<Id>& targets, const FusedHeadLossExtras<Scalar>& extras,
    MatrixRef<Scalar>* dh, MatrixRef<Scalar>* dW, MatrixRef<Scalar>* db, const FusedHeadLossOptions& options,
    FusedHeadLossWorkspace<Scalar>& ws, const char* where, const VocabSlice<Scalar>* slice = nullptr,
    const SoftTargetRows<Scalar>* soft = nullptr, const std::vector<Index>* dW_mask = nullptr) {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");
  // bf16 mixed precision: W stored in bf16, h and dz rounded to bf16 for the products, held as Low
  // (bf16 on a backend that takes bf16 operands, else Scalar holding the rounded values).
  constexpr bool mixed = !std::is_same_v<Storage, Scalar>;
  static_assert(!mixed || (std::is_same_v<Scalar, float> && std::is_same_v<Storage, Eigen::bfloat16>),
                "mixed precision: float h and gradients with a bf16 W");
  using Low = std::conditional_t<mixed && Backend::template takes<float, Storage, Storage>, Storage, Scalar>;
  constexpr Index bytes_per_logit = static_cast<Index>(sizeof(Scalar) + (mixed ? sizeof(Low) : 0));
  // rows: W's rows; V: the global vocabulary; begin: the global id of W's row 0.
  const Index N = h.rows(), rows = W.rows(), d = W.cols(), T = targets.cols();
  const Index V = slice ? slice->V : rows, begin = slice ? slice->begin : 0;
  // ---- every check before anything is written ----
  // dW_mask: W's trainable rows (sorted, local ids); dW is then [k, d], row i that of (*dW_mask)[i].
  check_fused_head_loss<Scalar, Id>(where, h, rows, d, bias, targets, extras, dh, dW_mask ? nullptr : dW, db, options,
                                    V, bytes_per_logit);
  if (dW_mask && dW && dW->size() != 0) check_shape(where, "dW", *dW, static_cast<Index>(dW_mask->size()), d);
  // The bf16 pass takes its dW from the caller, never a row mask (no layer passes one).
  if (mixed && dW_mask) throw value_error(std::string(where) + ": trainable rows with a bf16 W are not supported here");
  const ConstMatrixRef<Scalar> weights = extras.weights;
  Eigen::Map<RowMatrix<Scalar>> lse_map = extras.lse, losses_map = extras.losses, entropy_map = extras.entropy;
  MatrixRef<Scalar> lse_ref(lse_map), losses_ref(losses_map);
  MatrixRef<Scalar>* const lse = &lse_ref;
  MatrixRef<Scalar>* const losses = &losses_ref;
  check_finite_inputs<Scalar, Storage, Id>(where, h, W, bias, targets, options, V, begin);
  const Index classes = classes_of(options, V);
  // The classes among W's rows, in W's local numbering.
  const Index local_classes = slice ? std::clamp<Index>(classes - begin, 0, rows) : classes;
  const bool weighted = weights.size() != 0;
  const bool gradient = dh != nullptr;
  const bool want_dW = gradient && dW && dW->size() != 0;  // empty: a frozen W (or no trainable row)
  const bool masked_dW = want_dW && dW_mask != nullptr;    // dW on the mask's rows only
  const bool want_db = gradient && db && db->size() != 0 && bias.size() != 0;
  const bool want_lse = lse && lse->size() != 0;
  const bool want_losses = losses && losses->size() != 0;
  const bool want_entropy = entropy_map.size() != 0;
  auto target_of = [&](Index n) { return static_cast<Index>(targets(n / T, n % T)); };
  auto weight_of = [&](Index n) { return weighted ? static_cast<double>(weights(n, 0)) : 1.0; };

  SoftmaxTerms terms = softmax_terms(options, classes);
  terms.entropy = terms.entropy || want_entropy;  // the entropy output needs the statistic E
  // ---- the counted tokens, their weight sum (token weight x class weight), the gradient's scale ----
  CrossEntropyResult result;
  ws.tokens.clear();
  for (Index n = 0; n < N; ++n)
    if (target_of(n) != options.ignore_index) {
      ws.tokens.push_back(n);
      result.weight_sum += terms.class_weights && !soft ? weight_of(n) * terms.target_weight(target_of(n))
                                                        : weight_of(n);
    }
  const Index count = static_cast<Index>(ws.tokens.size());
  result.count = count;
  const double scale = reduction_scale(options.reduction, result.weight_sum, options.gradient_scale);

  // Ignored tokens get no loss and no gradient.
  for (Index n = 0; n < N; ++n) {
    if (target_of(n) != options.ignore_index) continue;
    if (want_lse) (*lse)(n, 0) = Scalar(0);
    if (want_losses) (*losses)(n, 0) = Scalar(0);
    if (want_entropy) entropy_map(n, 0) = Scalar(0);
  }
  if (count == 0) {
    if (gradient) dh->setZero();
    finish_reduction(result, options.reduction);
    return result;
  }

  // The counted rows of h, gathered only when some tokens are ignored or dh is h itself (dh is
  // then accumulated apart and copied out at the end); otherwise h and dh are used in place.
  const bool dh_overlaps_h = gradient && dh->data() < h.data() + h.size() && h.data() < dh->data() + dh->size();
  // Vocabulary-parallel, dh is all-reduced in place at the end, so it must be contiguous.
  const bool dh_strided = gradient && slice && dh->outerStride() != d;
  // Mixed precision always gathers: the gathered rows are h rounded to bf16.
  const bool gather = mixed || count < N || dh_overlaps_h || dh_strided;
  std::vector<Low>& hidden_buffer = [&]() -> std::vector<Low>& {
    if constexpr (std::is_same_v<Low, Scalar>)
      return ws.hidden;
    else
      return ws.hidden_bf16;
  }();
  if (gather) {
    hidden_buffer.resize(static_cast<std::size_t>(count * d));
    for (Index r = 0; r < count; ++r) {
      const Scalar* source = h.row(ws.tokens[static_cast<std::size_t>(r)]).data();
      Low* target = hidden_buffer.data() + r * d;
      if constexpr (mixed)
        for (Index j = 0; j < d; ++j) target[j] = static_cast<Low>(Eigen::bfloat16(source[j]));
      else
        std::copy_n(source, d, target);
    }
    if (gradient) ws.dhidden.resize(static_cast<std::size_t>(count * d));
  }
  const Eigen::Map<const RowMatrix<Low>, 0, Eigen::OuterStride<>> hidden(
      gather ? hidden_buffer.data() : same_storage<Low>(h.data()), count, d,
      Eigen::OuterStride<>(gather ? d : h.outerStride()));
  Scalar* dh_base = gradient ? (gather ? ws.dhidden.data() : dh->data()) : nullptr;
  Eigen::Map<RowMatrix<Scalar>, 0, Eigen::OuterStride<>> dhidden(dh_base, gradient ? count : 0, d,
                                                                 Eigen::OuterStride<>(
                                                                     gather || !gradient ? d : dh->outerStride()));
  if (gradient) dhidden.setZero();

  // The block is chosen from this rank's classes (all of them on one process), so the two-pass
  // buffer stays about 2 % of the logits this rank would otherwise hold, whatever the number of
  // ranks; one rank uses the single-process block. (A shard that is all padding has no block and no pass.)
  const Index block = fused_vocab_block(options.vocab_block, slice ? local_classes : classes);
  // The token chunk, the same on every rank (each makes one collective step per chunk): with a
  // slice, from the most classes a shard holds, min(widest, classes) -- rank 0's, as rows [0,
  // widest) are its -- so that one rank chunks exactly as the single-process pass does.
  const Index chunk = fused_token_chunk(options, count, slice ? std::min(slice->widest, classes) : classes,
                                        bytes_per_logit);
  const bool one_pass = chunk > 0;
  const std::size_t logits_size = static_cast<std::size_t>(one_pass ? chunk * local_classes : count * block);
  ws.logits.resize(logits_size);
  // Mixed precision: dz rounded to bf16 beside the float dz (db sums the float one).
  std::vector<Low>& dz_buffer = [&]() -> std::vector<Low>& {
    if constexpr (std::is_same_v<Low, Scalar>)
      return ws.dz_rounded;
    else
      return ws.dz_bf16;
  }();
  if (mixed && gradient) dz_buffer.resize(logits_size);
  // No column yet: max -inf, sums 0 (a shard without the target adds s_y = 0).
  ws.row_stats.assign(static_cast<std::size_t>(count), SoftmaxRowStats{});
  ws.lse.resize(static_cast<std::size_t>(count));
  if (terms.entropy) ws.entropy.resize(static_cast<std::size_t>(count));
  const double softcap = options.softcap;
  const Scalar cap = static_cast<Scalar>(softcap);
  // Soft targets: each row's T_n, and a block of v per row being worked (indexed r % soft_rows).
  const Index soft_rows = one_pass ? chunk : count;
  if (soft) {
    ws.soft_mass.resize(static_cast<std::size_t>(count));
    for (Index r = 0; r < count; ++r)
      ws.soft_mass[static_cast<std::size_t>(r)] = soft->mass(ws.tokens[static_cast<std::size_t>(r)]);
    // At least one value: the row's terms need a non-null v even on a shard with no class (block 0).
    ws.soft_block.resize(static_cast<std::size_t>(std::max<Index>(1, soft_rows * block)));
  }
  // The row's terms with its soft targets over global columns [c0, c0 + width) (v in its block buffer).
  auto soft_terms = [&](Index r, Index c0, Index width) {
    SoftmaxTerms row_terms = terms;
    double* v = ws.soft_block.data() + (r % soft_rows) * block;
    if (width > 0) soft->fill_block(ws.tokens[static_cast<std::size_t>(r)], c0, width, v);
    row_terms.soft_targets = v;
    row_terms.soft_mass = ws.soft_mass[static_cast<std::size_t>(r)];
    return row_terms;
  };

  // The GEMM pieces along the vocabulary: within a two-pass block (a few thousand rows at most)
  // kFusedRowPiece rows, so a block still gives the threads several pieces; across a token chunk's
  // whole vocabulary the larger kFusedChunkPiece, whose products run faster.
  const Index vocab_piece = one_pass ? kFusedChunkPiece : kFusedRowPiece;
  // logits [rows, width] (leading dimension ld, in ws.logits) = hidden[r0, r0 + rows) W[v0, v0 +
  // width)^T (+ b), then soft-capped; in fixed pieces of vocab_piece columns.
  auto logits_of = [&](Index r0, Index rows, Index v0, Index width, Index ld) {
    Eigen::Map<RowMatrix<Scalar>, 0, Eigen::OuterStride<>> logits(ws.logits.data(), rows, width,
                                                                  Eigen::OuterStride<>(ld));
    const gemm::Op<Scalar, gemm::Layout::row_major, gemm::Layout::col_major, Storage, Low> product{
        rows,
        width,
        d,
        hidden.data() + r0 * hidden.outerStride(),
        hidden.outerStride(),
        W.data() + v0 * W.outerStride(),
        W.outerStride(),
        logits.data(),
        ld,
        gemm::Init::zero};
    auto finish_piece = [&](Index p0, Index p1) {
      const Index p_width = p1 - p0;
      auto out = logits.middleCols(p0, p_width);
      if (bias.size() != 0) out.rowwise() += bias.col(0).segment(v0 + p0, p_width).transpose();
      if (softcap > 0)  // row by row: the same bits wherever a row lies (detail/softmax.hpp)
        for (Index r = 0; r < rows; ++r) softcap_row(out.row(r).data(), out.row(r).data(), p_width, cap);
    };
    if (mixed && one_pass) {
      // Mixed precision, token chunks: each piece's product into a contiguous [rows, p_width]
      // buffer of its thread's, then copied into the chunk's rows (measured with oneDNN at GPT-2
      // shape: writing C straight into rows V floats apart ran the product at half the speed).
      // The same products as below, so the same values.
      const Index pieces = (width + vocab_piece - 1) / vocab_piece;
      const Index slots = chunk_threads(pieces, 1, true);
      ws.piece_logits.resize(static_cast<std::size_t>(slots * rows * std::min(vocab_piece, width)));
      if (static_cast<Index>(ws.slot_tiles.size()) < slots) ws.slot_tiles.resize(static_cast<std::size_t>(slots));
      parallel_chunks_slotted(pieces, 1, true, [&](Index q0, Index q1, Index slot) {
        for (Index q = q0; q < q1; ++q) {
          const Index p0 = q * vocab_piece, p_width = std::min(vocab_piece, width - p0);
          Scalar* scratch = ws.piece_logits.data() + slot * rows * std::min(vocab_piece, width);
          auto piece = gemm::cols_of(product, p0, p_width);
          piece.c = scratch;
          piece.ldc = p_width;
          gemm::run<gemm::Kernel::expression, Backend>(piece, gemm::Plan{gemm::Split::cols, p_width, false},
                                                       gemm::NoEpilogue{},
                                                       &ws.slot_tiles[static_cast<std::size_t>(slot)]);
          for (Index r = 0; r < rows; ++r) std::copy_n(scratch + r * p_width, p_width, logits.row(r).data() + p0);
          finish_piece(p0, p0 + p_width);
        }
      });
      return logits;
    }
    gemm::run<gemm::Kernel::expression, Backend>(product, gemm::Plan{gemm::Split::cols, vocab_piece, true},
                                                 finish_piece, &ws.tiles);
    return logits;
  };
  // Row r's statistics over columns [v0, v0 + width) of its logits z (z[0] is column v0).
  auto accumulate_row = [&](Index r, const Scalar* z, Index v0, Index width) {
    const std::size_t i = static_cast<std::size_t>(r);
    if (soft) {  // v over the block's columns, read from column 0 of its buffer
      ws.row_stats[i].accumulate(z, width, -1, soft_terms(r, begin + v0, width), 0);
      return;
    }
    const Index y = target_of(ws.tokens[i]) - begin;                  // in W's local numbering
    ws.row_stats[i].accumulate(z, width, y - v0, terms, begin + v0);  // the online rescale
  };
  // Rows [r0, r1)'s lse and loss, added in token order.
  auto finish_rows = [&](Index r0, Index r1) {
    for (Index r = r0; r < r1; ++r) {
      const std::size_t i = static_cast<std::size_t>(r);
      const Index n = ws.tokens[i];
      const RowLoss row = soft ? row_loss(ws.row_stats[i], soft_terms(r, 0, 0))
                               : row_loss(ws.row_stats[i], terms, terms.target_weight(target_of(n)));
      ws.lse[i] = row.lse;
      if (terms.entropy) ws.entropy[i] = row.entropy;
      add_row_loss<Scalar>(row, weight_of(n), result, want_losses ? losses : nullptr, n);
      if (want_lse) (*lse)(n, 0) = static_cast<Scalar>(row.lse);
      if (want_entropy) entropy_map(n, 0) = static_cast<Scalar>(row.entropy);
    }
  };
  // Row r's logits over columns [v0, v0 + width) -> dz, in place, from exp(s - lse) (detail/softmax.hpp).
  auto gradient_row = [&](Index r, Scalar* z, Index v0, Index width) {
    const std::size_t i = static_cast<std::size_t>(r);
    const double w = weight_of(ws.tokens[i]) * scale;
    RowLoss row;
    row.lse = ws.lse[i];
    if (terms.entropy) row.entropy = ws.entropy[i];
    if (soft) {  // block by block, each with its v
      for (Index b0 = 0; b0 < width; b0 += block) {
        const Index b_width = std::min(block, width - b0);
        const SoftmaxTerms row_terms = soft_terms(r, begin + v0 + b0, b_width);
        const SoftmaxGradient<Scalar> k = softmax_gradient_at_lse<Scalar>(row, w, row_terms);
        apply_softmax_gradient(z + b0, b_width, -1, k, row_terms, /*holds_exp=*/false, 0);
      }
      return;
    }
    row.class_weight = terms.target_weight(target_of(ws.tokens[i]));
    const SoftmaxGradient<Scalar> k = softmax_gradient_at_lse<Scalar>(row, w, terms);
    const Index y = target_of(ws.tokens[i]) - begin;  // in W's local numbering
    apply_softmax_gradient(z, width, y - v0, k, terms, /*holds_exp=*/false, begin + v0);
  };
  // Mixed precision: dz [rows, width] (leading dimension ld) rounded to bf16 and transposed into
  // dz_buffer as dz^T [width, rows], the products' operand: dW += (dz^T) hidden then reads it as
  // plain rows (measured with oneDNN: twice as fast as dz^T read as a transposed view of dz), and
  // dh = dz W as its transposed view. Groups of kGroup columns per thread, so a group's rows of
  // dz^T stay in cache while they fill.
  auto round_dz = [&](const Scalar* dz, Index ld, Index rows, Index width) {
    constexpr Index kGroup = 256;
    Low* out = dz_buffer.data();
    parallel_blocks((width + kGroup - 1) / kGroup, [&](Index group) {
      const Index g0 = group * kGroup, g1 = std::min(width, g0 + kGroup);
      for (Index r = 0; r < rows; ++r)
        for (Index v = g0; v < g1; ++v) out[v * rows + r] = static_cast<Low>(Eigen::bfloat16(dz[r * ld + v]));
    });
  };
  // dz [rows, width] (leading dimension ld) of hidden rows [r0, r0 + rows) and W rows [v0, v0 +
  // width): dW_block += dz^T hidden (with db_block += sums of dz), dhidden rows += dz W_block.
  auto backward_of = [&](const Scalar* dz, Index ld, Index r0, Index rows, Index v0, Index width) {
    auto db_sums = [&](Index p0, Index p1) {
      if (want_db) add_column_sums(dz + p0, ld, rows, p1 - p0, db->col(0).segment(v0 + p0, p1 - p0));
    };
    // dW's pieces each pack all of hidden's rows, dh's all of W's: one piece per thread on a backend
    // whose results do not depend on the chunking (gemm::per_thread_plan), else the fixed pieces.
    const gemm::Plan row_pieces = gemm::per_thread_plan<Backend>(width, d, vocab_piece,
                                                                 gemm::Plan{gemm::Split::rows, vocab_piece, true},
                                                                 true);
    const gemm::Plan dim_pieces = gemm::per_thread_plan<Backend>(rows, d, kHeadMinThreadRows,
                                                                 gemm::Plan{gemm::Split::cols, kFusedDimPiece, true});
    // With a row mask (float and double only), the full product writes nothing (its epilogue still
    // sums db) and the mask's rows in this block, mask[m0, m1), get their own product of m1 - m0
    // rows from their gathered columns of dz.
    Scalar* dW_rows = want_dW && !masked_dW ? dW->data() + v0 * dW->outerStride() : nullptr;
    const Index ldW = want_dW ? dW->outerStride() : 0;
    const Low* h_rows = hidden.data() + r0 * hidden.outerStride();
    const Storage* W_rows = W.data() + v0 * W.outerStride();
    Scalar* dh_rows = dhidden.data() + r0 * dhidden.outerStride();
    using gemm::Layout;
    if constexpr (mixed) {
      // dW += (dz^T) hidden and dh = (dz^T)^T W from the rounded dz^T [width, rows].
      round_dz(dz, ld, rows, width);
      const Low* dzT = dz_buffer.data();
      const gemm::Op<Scalar, Layout::row_major, Layout::row_major, Low, Low> dW_product{
          width, d, rows, dzT, rows, h_rows, hidden.outerStride(), dW_rows, ldW};
      if ((want_dW && !masked_dW) || want_db)
        gemm::run<gemm::Kernel::expression, Backend>(dW_product, row_pieces, db_sums);
      const gemm::Op<Scalar, Layout::col_major, Layout::row_major, Storage, Low> dh_product{
          rows, d, width, dzT, rows, W_rows, W.outerStride(), dh_rows, dhidden.outerStride()};
      gemm::run<gemm::Kernel::expression, Backend>(dh_product, dim_pieces, gemm::NoEpilogue{}, &ws.tiles);
    } else {
      const gemm::Op<Scalar, Layout::col_major, Layout::row_major> dW_product{
          width, d, rows, dz, ld, h_rows, hidden.outerStride(), dW_rows, ldW};
      if ((want_dW && !masked_dW) || want_db)
        gemm::run<gemm::Kernel::expression, Backend>(dW_product, row_pieces, db_sums);
      const auto m0 = masked_dW ? std::lower_bound(dW_mask->begin(), dW_mask->end(), v0)
                                : std::vector<Index>::const_iterator();
      const auto m1 = masked_dW ? std::lower_bound(m0, dW_mask->end(), v0 + width) : m0;
      if (masked_dW && m1 > m0) {
        const Index k = static_cast<Index>(m1 - m0);  // dz's columns of the mask's rows, gathered [rows, k]
        const Index* cols = &*m0;
        ws.masked_dz.resize(static_cast<std::size_t>(rows * k));
        for (Index r = 0; r < rows; ++r)
          for (Index i = 0; i < k; ++i) ws.masked_dz[static_cast<std::size_t>(r * k + i)] = dz[r * ld + cols[i] - v0];
        Scalar* dW_mask_rows = dW->data() + static_cast<Index>(m0 - dW_mask->begin()) * ldW;
        const gemm::Op<Scalar, Layout::col_major, Layout::row_major> mask_product{
            k, d, rows, ws.masked_dz.data(), k, h_rows, hidden.outerStride(), dW_mask_rows, ldW};
        gemm::run<gemm::Kernel::expression, Backend>(
            mask_product,
            gemm::per_thread_plan<Backend>(k, d, vocab_piece, gemm::Plan{gemm::Split::rows, vocab_piece, true}, true));
      }
      const gemm::Op<Scalar, Layout::row_major, Layout::row_major> dh_product{
          rows, d, width, dz, ld, W_rows, W.outerStride(), dh_rows, dhidden.outerStride()};
      gemm::run<gemm::Kernel::expression, Backend>(dh_product, dim_pieces);
    }
  };

  if (one_pass) {
    // ---- token chunks: each chunk's logits [rows, local_classes] once, dz in place, then dW, db, dh ----
    for (Index r0 = 0; r0 < count; r0 += chunk) {
      const Index rows = std::min(chunk, count - r0);
      auto logits = logits_of(r0, rows, 0, local_classes, local_classes);
      // The statistics over the same blocks of columns as pass 1 of vocab_blocks.
      parallel_rows(rows, [&](Index r) {
        for (Index v0 = 0; v0 < local_classes; v0 += block)
          accumulate_row(r0 + r, logits.row(r).data() + v0, v0, std::min(block, local_classes - v0));
      });
      if (slice) slice->combine_row_stats(ws, r0, rows, terms);
      finish_rows(r0, r0 + rows);
      if (!gradient) continue;
      parallel_rows(rows, [&](Index r) { gradient_row(r0 + r, logits.row(r).data(), 0, local_classes); });
      backward_of(logits.data(), local_classes, r0, rows, 0, local_classes);
    }
    finish_reduction(result, options.reduction);
    if (!gradient) return result;
  } else {
    // ---- pass 1: each row's max, sum of exponentials, target logit and sum of logits ----
    for (Index v0 = 0; v0 < local_classes; v0 += block) {
      const Index width = std::min(block, local_classes - v0);
      auto logits = logits_of(0, count, v0, width, width);
      parallel_rows(count, [&](Index r) { accumulate_row(r, logits.row(r).data(), v0, width); });
    }
    if (slice) slice->combine_row_stats(ws, 0, count, terms);
    finish_rows(0, count);
    finish_reduction(result, options.reduction);
    if (!gradient) return result;

    // ---- pass 2: dz block by block (the logits recomputed), then dW, db and dh from it ----
    for (Index v0 = 0; v0 < local_classes; v0 += block) {
      const Index width = std::min(block, local_classes - v0);
      auto logits = logits_of(0, count, v0, width, width);
      parallel_rows(count, [&](Index r) { gradient_row(r, logits.row(r).data(), v0, width); });
      backward_of(logits.data(), width, 0, count, v0, width);
    }
  }
  // Vocabulary-parallel: each rank's dhidden is the sum over its own columns; dh is the sum
  // over all of them (dhidden is contiguous: the gathered buffer, or dh itself with all N rows).
  if (slice) slice->sum_over_ranks(dh_base, count * d);
  if (gather) {
    for (Index n = 0; n < N; ++n)
      if (target_of(n) == options.ignore_index) dh->row(n).setZero();
    for (Index r = 0; r < count; ++r) dh->row(ws.tokens[static_cast<std::size_t>(r)]) = dhidden.row(r);
  }
  return result;
}

}  // namespace detail

// ---- the arithmetic, as free functions on views ----

// Common arguments: h [N, d], W [V, d], bias [V, 1] or empty (no bias), targets (a TokenIds: N
// ids of int32 or int64, any shape and layout, read row-major), extras (weights [N, 1], all 1 when
// empty; lse [N, 1], each row's log-sum-exp, 0 for ignored rows; losses [N, 1], w_n * loss_n, 0
// for ignored rows; entropy [N, 1], each row's H_n = -sum_j p_j log p_j of its softmax (of the
// soft-capped logits, over the classes), unweighted, 0 for ignored rows -- asking for it sums the
// entropy statistic, as options.entropy does, and reports the reduced entropy too; each used when
// not empty). \throws shape_error for any shape mismatch;
// index_error for a target outside [0, classes) that is not ignore_index (a target in the padding
// names it); value_error for an option out of range, a negative / non-finite weight, or with
// error_if_nonfinite a NaN or infinity in a counted row of h, a class row of W or the bias (the
// first, with its place). Nothing is written on throw. \pre no output aliases W or the other
// outputs; dh may be h.

// ... -> loss; dh [N, d] = dz W (written), dW [V, d] += dz^T h, db [V, 1] += sums of dz (each
// skipped when empty: a frozen W, no bias). Cost: 6 N V d flops in GEMMs in token chunks (4 N V d
// without dW), 8 N V d in vocabulary blocks (6 N V d without dW); memory in `workspace`: n * V
// scalars (n tokens a chunk, within memory_budget) or N * vocab_block, plus 2 N d when tokens are
// ignored. \throws value_error also for a negative memory_budget, or with plan token_chunks, one
// that holds no token's row of logits.
template <typename Scalar>
CrossEntropyResult fused_head_loss_forward_backward(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W,
                                                    const ConstMatrixRef<Scalar>& bias, TokenIds targets,
                                                    MatrixRef<Scalar> dh, MatrixRef<Scalar> dW, MatrixRef<Scalar> db,
                                                    FusedHeadLossWorkspace<Scalar>& workspace,
                                                    const FusedHeadLossOptions& options = {},
                                                    const FusedHeadLossExtras<Scalar>& extras = {}) {
  return targets.visit([&](const auto& typed) {
    return detail::fused_head_loss_pass<Scalar>(h, W, bias, typed, extras, &dh, &dW, &db, options, workspace,
                                                "fused_head_loss_forward_backward");
  });
}

// ... -> loss only (evaluation): pass 1 alone, the same loss bit for bit. Cost: 2 N V d flops.
template <typename Scalar>
CrossEntropyResult fused_head_loss(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W,
                                   const ConstMatrixRef<Scalar>& bias, TokenIds targets,
                                   FusedHeadLossWorkspace<Scalar>& workspace, const FusedHeadLossOptions& options = {},
                                   const FusedHeadLossExtras<Scalar>& extras = {}) {
  return targets.visit([&](const auto& typed) {
    return detail::fused_head_loss_pass<Scalar>(h, W, bias, typed, extras, nullptr, nullptr, nullptr, options,
                                                workspace, "fused_head_loss");
  });
}

// ---- soft (probability) targets ----
// The plain loss's soft targets (cross_entropy.hpp: dense [N, C] or [N, V], or SparseTargets [N,
// k]; PyTorch's semantics, label smoothing and class weights included; ignore_index must stay
// -100), in either plan: each block of columns adds sum_c v_c s_c over its columns (a sparse row
// only its targets there) to the row's statistics, and its gradient subtracts w v_j. Per-token
// weights w_n apply as with class indices: the mean divides by sum_n w_n (N without weights).
// \throws as the class-index calls, and as cross_entropy_soft for the targets. Nothing written on
// throw. Cost: the class-index call's, plus reading the targets (dense: N C values) and a block of
// v in double for each row of the logits buffer (FusedHeadLossOptions::memory_budget has the sizes).
// The same four calls with W in bf16 are under "bf16 mixed precision" below: the detail helpers
// here take W's storage type and the products' backend for them.

namespace detail {

// Where a soft-target pass adds dW and db (each null or empty: none), and W's trainable rows (a row
// mask: dW is then [k, d]), made by a callable once the targets are checked: a layer's
// accumulators switch its gradients' modes, which must not happen for a call that then throws.
template <typename Scalar>
struct SoftGradients {
  MatrixRef<Scalar>* dW = nullptr;
  MatrixRef<Scalar>* db = nullptr;
  const std::vector<Index>* dW_mask = nullptr;
};

// Storage: W's type (Scalar, or bf16 for the mixed-precision pass with float Scalar); Backend: the
// products' (fused_head_loss_pass's).
template <typename Scalar, typename Storage = Scalar, typename Backend = gemm::DefaultBackend, typename Checked,
          typename Gradients>
CrossEntropyResult fused_soft_pass(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<non_deduced_t<Storage>>& W,
                                   const ConstMatrixRef<Scalar>& bias, const Checked& checked,
                                   const SoftTargetRows<Scalar>& soft, MatrixRef<Scalar>* dh,
                                   const Gradients& gradients, FusedHeadLossWorkspace<Scalar>& workspace,
                                   const FusedHeadLossOptions& options, const FusedHeadLossExtras<Scalar>& extras,
                                   const char* where) {
  const Index N = h.rows(), V = W.rows();
  check_loss_options<Scalar>(where, options, V);
  check_soft_options(where, options);
  checked.check(where, N, classes_of(options, V), V);
  SoftTargetRows<Scalar> rows = soft;
  rows.set_options(options, classes_of(options, V));
  // The class-index checks see N targets of class 0: every row counted, none out of range.
  const std::vector<std::int32_t> zeros(static_cast<std::size_t>(N), 0);
  const TypedTokenIds<std::int32_t> counted(zeros.data(), 1, N, N, 1);
  const SoftGradients<Scalar> out = dh ? gradients() : SoftGradients<Scalar>{};
  return fused_head_loss_pass<Scalar, std::int32_t, Storage, Backend>(h, W, bias, counted, extras, dh, out.dW, out.db,
                                                                      options, workspace, where, nullptr, &rows,
                                                                      out.dW_mask);
}

template <typename Scalar, typename Storage = Scalar, typename Backend = gemm::DefaultBackend, typename Gradients>
CrossEntropyResult fused_soft_dense(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<non_deduced_t<Storage>>& W,
                                    const ConstMatrixRef<Scalar>& bias, const ConstMatrixRef<Scalar>& targets,
                                    MatrixRef<Scalar>* dh, const Gradients& gradients,
                                    FusedHeadLossWorkspace<Scalar>& workspace, const FusedHeadLossOptions& options,
                                    const FusedHeadLossExtras<Scalar>& extras, const char* where) {
  SoftTargetRows<Scalar> soft;
  soft.dense = &targets;
  return fused_soft_pass<Scalar, Storage, Backend>(h, W, bias, DenseSoftTargets<Scalar>{targets}, soft, dh, gradients,
                                                   workspace, options, extras, where);
}

template <typename Scalar, typename Storage = Scalar, typename Backend = gemm::DefaultBackend, typename Gradients>
CrossEntropyResult fused_soft_sparse(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<non_deduced_t<Storage>>& W,
                                     const ConstMatrixRef<Scalar>& bias, const SparseTargets<Scalar>& targets,
                                     MatrixRef<Scalar>* dh, const Gradients& gradients,
                                     FusedHeadLossWorkspace<Scalar>& workspace, const FusedHeadLossOptions& options,
                                     const FusedHeadLossExtras<Scalar>& extras, const char* where) {
  return targets.ids.visit([&](const auto& typed) {
    using Id = typename std::decay_t<decltype(typed)>::id_type;
    const SparseSoftTargets<Scalar, Id> checked{typed, targets.probs};
    SoftTargetRows<Scalar> soft;
    soft.probs = &targets.probs;
    soft.k = targets.probs.cols();
    // The ids as Index, once checked (a shape error is reported by check first).
    if (typed.rows() == h.rows() && typed.cols() == soft.k) {
      soft.ids.resize(static_cast<std::size_t>(typed.rows() * soft.k));
      for (Index n = 0; n < typed.rows(); ++n)
        for (Index i = 0; i < soft.k; ++i)
          soft.ids[static_cast<std::size_t>(n * soft.k + i)] = static_cast<Index>(typed(n, i));
    }
    return fused_soft_pass<Scalar, Storage, Backend>(h, W, bias, checked, soft, dh, gradients, workspace, options,
                                                     extras, where);
  });
}

}  // namespace detail

// h [N, d], W [V, d], bias [V, 1] or empty, targets [N, C] (or [N, V]) probabilities -> loss;
// dh [N, d] written, dW [V, d] +=, db [V, 1] += (each skipped when empty).
template <typename Scalar>
CrossEntropyResult fused_head_loss_soft_forward_backward(
    const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W, const ConstMatrixRef<Scalar>& bias,
    const ConstMatrixRef<Scalar>& targets, MatrixRef<Scalar> dh, MatrixRef<Scalar> dW, MatrixRef<Scalar> db,
    FusedHeadLossWorkspace<Scalar>& workspace, const FusedHeadLossOptions& options = {},
    const FusedHeadLossExtras<Scalar>& extras = {}) {
  const auto gradients = [&] { return detail::SoftGradients<Scalar>{&dW, &db}; };
  return detail::fused_soft_dense<Scalar>(h, W, bias, targets, &dh, gradients, workspace, options, extras,
                                          "fused_head_loss_soft_forward_backward");
}

// ... with sparse targets (ids [N, k], probs [N, k]).
template <typename Scalar>
CrossEntropyResult fused_head_loss_soft_forward_backward(
    const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W, const ConstMatrixRef<Scalar>& bias,
    const SparseTargets<Scalar>& targets, MatrixRef<Scalar> dh, MatrixRef<Scalar> dW, MatrixRef<Scalar> db,
    FusedHeadLossWorkspace<Scalar>& workspace, const FusedHeadLossOptions& options = {},
    const FusedHeadLossExtras<Scalar>& extras = {}) {
  const auto gradients = [&] { return detail::SoftGradients<Scalar>{&dW, &db}; };
  return detail::fused_soft_sparse<Scalar>(h, W, bias, targets, &dh, gradients, workspace, options, extras,
                                           "fused_head_loss_soft_forward_backward");
}

// h [N, d], W [V, d], bias, targets [N, C] (or [N, V]) -> the loss alone.
template <typename Scalar>
CrossEntropyResult fused_head_loss_soft(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W,
                                        const ConstMatrixRef<Scalar>& bias, const ConstMatrixRef<Scalar>& targets,
                                        FusedHeadLossWorkspace<Scalar>& workspace,
                                        const FusedHeadLossOptions& options = {},
                                        const FusedHeadLossExtras<Scalar>& extras = {}) {
  const auto none = [] { return detail::SoftGradients<Scalar>{}; };
  return detail::fused_soft_dense<Scalar>(h, W, bias, targets, nullptr, none, workspace, options, extras,
                                          "fused_head_loss_soft");
}

// ... with sparse targets.
template <typename Scalar>
CrossEntropyResult fused_head_loss_soft(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W,
                                        const ConstMatrixRef<Scalar>& bias, const SparseTargets<Scalar>& targets,
                                        FusedHeadLossWorkspace<Scalar>& workspace,
                                        const FusedHeadLossOptions& options = {},
                                        const FusedHeadLossExtras<Scalar>& extras = {}) {
  const auto none = [] { return detail::SoftGradients<Scalar>{}; };
  return detail::fused_soft_sparse<Scalar>(h, W, bias, targets, nullptr, none, workspace, options, extras,
                                           "fused_head_loss_soft");
}

// ---- bf16 mixed precision ----
//
// The same losses and gradients -- class indices (fused_head_loss_forward_backward,
// fused_head_loss) and soft targets (fused_head_loss_soft_forward_backward, fused_head_loss_soft,
// dense or SparseTargets) -- with W [V, d] stored in bf16 (e.g. to_bf16 of float master weights
// once a step) and the products' inputs in bf16, as mixed-precision training runs the head:
//   logits = bf16(h) W^T (+ b)            each product exact in float, the sums in float
//   dz     = d loss / d logits            in float, from the float logits (the softmax in double)
//   dW    += bf16(dz)^T bf16(h),  db += sums of the float dz,  dh = bf16(dz) W
// with h, dh, dW, db, bias, loss, lse and losses in float; dW is accumulated in float across
// chunks and calls, never rounded. bf16(x) rounds to nearest even (8 significant bits). The
// products run on gemm::MixedBackend: oneDNN's bf16 kernels (AMX or AVX512_BF16) when the program
// links embedhead::onednn and oneDNN has native bf16 kernels on this CPU (OneDnnBackend::usable),
// else the float GEMM on the rounded values (the same products within float rounding, at about
// the float call's speed: the default packed kernel widens the bf16 operands while it packs them;
// on Eigen or CBLAS the rounded dz and h are held in float); Backend names one explicitly (a
// detail::gemm backend; when !Backend::usable(), the call runs on gemm::DefaultBackend). Plans,
// options (soft targets: every option the float soft calls take -- label smoothing, class weights,
// per-token weights, the reductions -- with their semantics), extras, checks, errors (the same
// messages) and thread-count invariance are the float call's, but for plan token_chunks' smallest
// memory_budget, one row of float logits plus its rounded dz. Soft targets pass no dW row mask
// (none of the bf16 calls takes trainable rows: fused_head_loss_pass refuses one with a bf16 W).
// Memory: the rounded dz beside the float logits (a token chunk is memory_budget /
// (6 C) tokens on oneDNN and the packed kernel, / (8 C) on Eigen and CBLAS), the counted rows of h
// rounded (count d values, bf16 or float likewise) and their dh (count d floats); in token chunks, also one
// [n, min(1024, C)] float buffer (and the widened tiles of W, without oneDNN) per thread.
// Accuracy against the float head: bench/RESULTS.md and tests/fused_head_loss_bf16_test.cpp.

// h [N, d], W [V, d] bf16, bias [V, 1] or empty, targets -> loss; dh [N, d] written, dW [V, d]
// +=, db [V, 1] += (each as the float call, empty: skipped). \throws as the float call.
template <typename Backend = detail::gemm::MixedBackend>
CrossEntropyResult fused_head_loss_forward_backward(const ConstMatrixRef<float>& h,
                                                    const ConstMatrixRef<Eigen::bfloat16>& W,
                                                    const ConstMatrixRef<float>& bias, TokenIds targets,
                                                    MatrixRef<float> dh, MatrixRef<float> dW, MatrixRef<float> db,
                                                    FusedHeadLossWorkspace<float>& workspace,
                                                    const FusedHeadLossOptions& options = {},
                                                    const FusedHeadLossExtras<float>& extras = {}) {
  static_assert(detail::gemm::is_backend<Backend>::value, "Backend: a detail::gemm backend (default MixedBackend)");
  if (!Backend::usable())
    return fused_head_loss_forward_backward<detail::gemm::DefaultBackend>(h, W, bias, targets, dh, dW, db, workspace,
                                                                          options, extras);
  return targets.visit([&](const auto& typed) {
    using Id = typename std::decay_t<decltype(typed)>::id_type;
    return detail::fused_head_loss_pass<float, Id, Eigen::bfloat16, Backend>(h, W, bias, typed, extras, &dh, &dW, &db,
                                                                             options, workspace,
                                                                             "fused_head_loss_forward_backward");
  });
}

// h [N, d], W [V, d] bf16, bias, targets -> the loss alone, forward_backward's bit for bit.
template <typename Backend = detail::gemm::MixedBackend>
CrossEntropyResult fused_head_loss(const ConstMatrixRef<float>& h, const ConstMatrixRef<Eigen::bfloat16>& W,
                                   const ConstMatrixRef<float>& bias, TokenIds targets,
                                   FusedHeadLossWorkspace<float>& workspace, const FusedHeadLossOptions& options = {},
                                   const FusedHeadLossExtras<float>& extras = {}) {
  static_assert(detail::gemm::is_backend<Backend>::value, "Backend: a detail::gemm backend (default MixedBackend)");
  if (!Backend::usable())
    return fused_head_loss<detail::gemm::DefaultBackend>(h, W, bias, targets, workspace, options, extras);
  return targets.visit([&](const auto& typed) {
    using Id = typename std::decay_t<decltype(typed)>::id_type;
    return detail::fused_head_loss_pass<float, Id, Eigen::bfloat16, Backend>(h, W, bias, typed, extras, nullptr,
                                                                             nullptr, nullptr, options, workspace,
                                                                             "fused_head_loss");
  });
}

// Soft (probability) targets with a bf16 W: the float soft calls' loss (fused_head_loss_soft*
// above: their semantics, options, extras, checks and errors) on the bf16 products of the
// class-index calls just above.

namespace detail {

// The four bf16 soft-target calls: dense or sparse targets (Targets), with the gradients (dh, dW,
// db) or the loss alone (dh null), on Backend, or on DefaultBackend when Backend is not usable.
template <typename Backend, typename Targets>
CrossEntropyResult fused_soft_bf16(const ConstMatrixRef<float>& h, const ConstMatrixRef<Eigen::bfloat16>& W,
                                   const ConstMatrixRef<float>& bias, const Targets& targets, MatrixRef<float>* dh,
                                   MatrixRef<float>* dW, MatrixRef<float>* db, FusedHeadLossWorkspace<float>& workspace,
                                   const FusedHeadLossOptions& options, const FusedHeadLossExtras<float>& extras,
                                   const char* where) {
  static_assert(gemm::is_backend<Backend>::value, "Backend: a detail::gemm backend (default MixedBackend)");
  if (!Backend::usable())
    return fused_soft_bf16<gemm::DefaultBackend>(h, W, bias, targets, dh, dW, db, workspace, options, extras, where);
  const auto gradients = [&] { return SoftGradients<float>{dW, db}; };
  if constexpr (std::is_same_v<Targets, SparseTargets<float>>)
    return fused_soft_sparse<float, Eigen::bfloat16, Backend>(h, W, bias, targets, dh, gradients, workspace, options,
                                                              extras, where);
  else
    return fused_soft_dense<float, Eigen::bfloat16, Backend>(h, W, bias, targets, dh, gradients, workspace, options,
                                                             extras, where);
}

}  // namespace detail

// h [N, d], W [V, d] bf16, bias [V, 1] or empty, targets [N, C] (or [N, V]) probabilities -> loss;
// dh [N, d] written, dW [V, d] +=, db [V, 1] += (each as the float call, empty: skipped).
// \throws as the float soft call.
template <typename Backend = detail::gemm::MixedBackend>
CrossEntropyResult fused_head_loss_soft_forward_backward(
    const ConstMatrixRef<float>& h, const ConstMatrixRef<Eigen::bfloat16>& W, const ConstMatrixRef<float>& bias,
    const ConstMatrixRef<float>& targets, MatrixRef<float> dh, MatrixRef<float> dW, MatrixRef<float> db,
    FusedHeadLossWorkspace<float>& workspace, const FusedHeadLossOptions& options = {},
    const FusedHeadLossExtras<float>& extras = {}) {
  return detail::fused_soft_bf16<Backend>(h, W, bias, targets, &dh, &dW, &db, workspace, options, extras,
                                          "fused_head_loss_soft_forward_backward");
}

// ... with sparse targets (ids [N, k], probs [N, k]).
template <typename Backend = detail::gemm::MixedBackend>
CrossEntropyResult fused_head_loss_soft_forward_backward(
    const ConstMatrixRef<float>& h, const ConstMatrixRef<Eigen::bfloat16>& W, const ConstMatrixRef<float>& bias,
    const SparseTargets<float>& targets, MatrixRef<float> dh, MatrixRef<float> dW, MatrixRef<float> db,
    FusedHeadLossWorkspace<float>& workspace, const FusedHeadLossOptions& options = {},
    const FusedHeadLossExtras<float>& extras = {}) {
  return detail::fused_soft_bf16<Backend>(h, W, bias, targets, &dh, &dW, &db, workspace, options, extras,
                                          "fused_head_loss_soft_forward_backward");
}

// h [N, d], W [V, d] bf16, bias, targets [N, C] (or [N, V]) -> the loss alone,
// forward_backward's bit for bit.
template <typename Backend = detail::gemm::MixedBackend>
CrossEntropyResult fused_head_loss_soft(const ConstMatrixRef<float>& h, const ConstMatrixRef<Eigen::bfloat16>& W,
                                        const ConstMatrixRef<float>& bias, const ConstMatrixRef<float>& targets,
                                        FusedHeadLossWorkspace<float>& workspace,
                                        const FusedHeadLossOptions& options = {},
                                        const FusedHeadLossExtras<float>& extras = {}) {
  return detail::fused_soft_bf16<Backend>(h, W, bias, targets, nullptr, nullptr, nullptr, workspace, options, extras,
                                          "fused_head_loss_soft");
}

// ... with sparse targets.
template <typename Backend = detail::gemm::MixedBackend>
CrossEntropyResult fused_head_loss_soft(const ConstMatrixRef<float>& h, const ConstMatrixRef<Eigen::bfloat16>& W,
                                        const ConstMatrixRef<float>& bias, const SparseTargets<float>& targets,
                                        FusedHeadLossWorkspace<float>& workspace,
                                        const FusedHeadLossOptions& options = {},
                                        const FusedHeadLossExtras<float>& extras = {}) {
  return detail::fused_soft_bf16<Backend>(h, W, bias, targets, nullptr, nullptr, nullptr, workspace, options, extras,
                                          "fused_head_loss_soft");
}

// ---- the layer-level form ----

namespace detail {

// A head's bias [V, 1], or an empty view without one.
template <typename Scalar>
Eigen::Map<const RowMatrix<Scalar>> head_bias(const OutputProjection<Scalar>& head) {
  if (head.bias()) return head.bias()->value();
  return {nullptr, 0, 1};
}

// A layer's refusal of trainable rows on a gradient it adds densely: \throws value_error "<where>: the <name> has k
// trainable rows of R (Parameter::set_trainable_rows), not supported: <why>" when p is an unfrozen Parameter with a
// row mask; nothing changes.
template <typename Scalar>
void refuse_trainable_rows(const char* where, const Parameter<Scalar>* p, const char* name, const std::string& why) {
  if (!p || p->frozen() || !p->trainable_rows()) return;
  std::ostringstream message;
  message << where << ": the " << name << " has " << p->trainable_rows()->size() << " trainable rows of " << p->rows()
          << " (Parameter::set_trainable_rows), not supported: " << why;
  throw value_error(message.str());
}

// FusedHeadLoss's gradients: W may have trainable rows (the pass's dW then covers them), its bias may not (db is a
// dense [V, 1]).
template <typename Scalar>
void check_head_bias_rows(const char* where, const OutputProjection<Scalar>& head) {
  const Parameter<Scalar>* bias = head.bias();
  if (!bias) return;
  refuse_trainable_rows(where, bias, "head's bias",
                        "the pass adds a dense db [" + std::to_string(bias->rows()) +
                            ", 1] (freeze the bias, or make every row trainable: set_all_rows_trainable)");
}

}  // namespace detail

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
  // mode; with trainable rows, Parameter::set_trainable_rows, their rows only: the gradient stays
  // sparse and the dW products cover k rows), bias grad += sums of dz. A frozen W or bias takes nothing: a frozen W
  // skips the dW GEMMs (a third of the flops in token chunks, a quarter in vocabulary blocks) and its gradient is left
  // as it was; loss and dh are the same. \throws as fused_head_loss_forward_backward; gradients, dh and extras
  // unchanged on throw.
  CrossEntropyResult forward_backward(OutputProjection<Scalar>& head, const ConstMatrixRef<Scalar>& h, TokenIds targets,
                                      MatrixRef<Scalar> dh, const FusedHeadLossExtras<Scalar>& extras = {}) {
    return targets.visit([&](const auto& typed) { return forward_backward_impl(head, h, typed, dh, extras); });
  }

  // h [N, d], targets (N ids) -> loss, no gradient (evaluation).
  CrossEntropyResult forward(const OutputProjection<Scalar>& head, const ConstMatrixRef<Scalar>& h, TokenIds targets,
                             const FusedHeadLossExtras<Scalar>& extras = {}) {
    return targets.visit([&](const auto& typed) { return forward_impl(head, h, typed, extras); });
  }

  // Soft (probability) targets, as fused_head_loss_soft_forward_backward: h [N, d], targets [N, C]
  // (or [N, V]) or SparseTargets [N, k] -> loss; dh [N, d] written; the head's gradients += as
  // forward_backward (a frozen W or bias takes nothing, trainable rows their dW only).
  // \throws as fused_head_loss_soft_forward_backward; gradients, dh and extras unchanged on throw.
  CrossEntropyResult forward_backward_soft(OutputProjection<Scalar>& head, const ConstMatrixRef<Scalar>& h,
                                           const ConstMatrixRef<Scalar>& targets, MatrixRef<Scalar> dh,
                                           const FusedHeadLossExtras<Scalar>& extras = {}) {
    return soft_impl(head, &head, h, targets, &dh, extras, "FusedHeadLoss::forward_backward_soft");
  }
  CrossEntropyResult forward_backward_soft(OutputProjection<Scalar>& head, const ConstMatrixRef<Scalar>& h,
                                           const SparseTargets<Scalar>& targets, MatrixRef<Scalar> dh,
                                           const FusedHeadLossExtras<Scalar>& extras = {}) {
    return soft_impl(head, &head, h, targets, &dh, extras, "FusedHeadLoss::forward_backward_soft");
  }
  // The same without a gradient (evaluation).
  CrossEntropyResult forward_soft(const OutputProjection<Scalar>& head, const ConstMatrixRef<Scalar>& h,
                                  const ConstMatrixRef<Scalar>& targets,
                                  const FusedHeadLossExtras<Scalar>& extras = {}) {
    return soft_impl(head, nullptr, h, targets, nullptr, extras, "FusedHeadLoss::forward_soft");
  }
  CrossEntropyResult forward_soft(const OutputProjection<Scalar>& head, const ConstMatrixRef<Scalar>& h,
                                  const SparseTargets<Scalar>& targets,
                                  const FusedHeadLossExtras<Scalar>& extras = {}) {
    return soft_impl(head, nullptr, h, targets, nullptr, extras, "FusedHeadLoss::forward_soft");
  }

 private:
  // Soft targets on a head (writable: the same head, to take the gradients, or null): every check
  // of the pass first (its shapes and finite inputs here, the targets and options in
  // fused_soft_pass), the head's accumulators only after them.
  template <typename Targets>
  CrossEntropyResult soft_impl(const OutputProjection<Scalar>& head, OutputProjection<Scalar>* writable,
                               const ConstMatrixRef<Scalar>& h, const Targets& targets, MatrixRef<Scalar>* dh,
                               const FusedHeadLossExtras<Scalar>& extras, const char* where) {
    const Index N = h.rows(), V = head.vocab_size();
    const Parameter<Scalar>& weight = head.weight();
    if (writable && dh) detail::check_head_bias_rows(where, head);
    const std::vector<std::int32_t> zeros(static_cast<std::size_t>(N), 0);
    const TypedTokenIds<std::int32_t> counted(zeros.data(), 1, N, N, 1);
    detail::check_fused_head_loss<Scalar, std::int32_t>(where, h, V, head.dim(), detail::head_bias(head), counted,
                                                        extras, dh, nullptr, nullptr, options_, V);
    detail::check_finite_inputs<Scalar, Scalar, std::int32_t>(where, h, weight.value(), detail::head_bias(head),
                                                              counted, options_, V);
    // The accumulators, made by the pass once the targets are checked (a const head: no gradient).
    Eigen::Map<RowMatrix<Scalar>> no_output(nullptr, 0, 1);
    std::optional<Eigen::Map<RowMatrix<Scalar>>> dW_map, db_map;
    std::optional<MatrixRef<Scalar>> dW_ref, db_ref;
    const auto gradients = [&] {
      Parameter<Scalar>& W = writable->weight();
      const std::vector<Index>* trainable = W.frozen() ? nullptr : W.trainable_rows();
      dW_map.emplace(W.frozen() ? no_output : trainable ? W.grad().masked_accumulator() : W.grad().dense_accumulator());
      Parameter<Scalar>* bias = writable->bias();
      db_map.emplace(bias && !bias->frozen() ? bias->grad().dense_accumulator() : no_output);
      dW_ref.emplace(*dW_map);
      db_ref.emplace(*db_map);
      return detail::SoftGradients<Scalar>{&*dW_ref, &*db_ref, trainable};
    };
    if constexpr (std::is_same_v<Targets, SparseTargets<Scalar>>)
      return detail::fused_soft_sparse<Scalar>(h, weight.value(), detail::head_bias(head), targets, dh, gradients,
                                               workspace_, options_, extras, where);
    else
      return detail::fused_soft_dense<Scalar>(h, weight.value(), detail::head_bias(head), targets, dh, gradients,
                                              workspace_, options_, extras, where);
  }

  template <typename Id>
  CrossEntropyResult forward_backward_impl(OutputProjection<Scalar>& head, const ConstMatrixRef<Scalar>& h,
                                           const TypedTokenIds<Id>& targets, MatrixRef<Scalar> dh,
                                           const FusedHeadLossExtras<Scalar>& extras) {
    const char* where = "FusedHeadLoss::forward_backward";
    const Parameter<Scalar>& weight = head.weight();
    detail::check_head_bias_rows(where, head);
    // A dry run of every check first: dense_accumulator() below switches the gradient to dense
    // mode, which must not happen for a call that then throws.
    Eigen::Map<RowMatrix<Scalar>> no_output(nullptr, 0, 1);
    {
      MatrixRef<Scalar> dh_ref(dh);
      detail::check_fused_head_loss<Scalar, Id>(where, h, head.vocab_size(), head.dim(), detail::head_bias(head),
                                                targets, extras, &dh_ref, nullptr, nullptr, options_,
                                                head.vocab_size());
      detail::check_finite_inputs<Scalar, Scalar, Id>(where, h, weight.value(), detail::head_bias(head), targets,
                                                      options_, head.vocab_size());
    }
    // Trainable rows (a row mask): dW on those rows only, [k, d], the gradient staying sparse.
    const std::vector<Index>* trainable = weight.frozen() ? nullptr : weight.trainable_rows();
    auto dW = weight.frozen() ? no_output
              : trainable     ? head.weight().grad().masked_accumulator()
                              : head.weight().grad().dense_accumulator();
    auto db = head.bias() && !head.bias()->frozen() ? head.bias()->grad().dense_accumulator() : no_output;
    MatrixRef<Scalar> dh_ref(dh), dW_ref(dW), db_ref(db);
    return detail::fused_head_loss_pass<Scalar, Id>(h, weight.value(), detail::head_bias(head), targets, extras,
                                                    &dh_ref, &dW_ref, &db_ref, options_, workspace_, where, nullptr,
                                                    nullptr, trainable);
  }

  template <typename Id>
  CrossEntropyResult forward_impl(const OutputProjection<Scalar>& head, const ConstMatrixRef<Scalar>& h,
                                  const TypedTokenIds<Id>& targets, const FusedHeadLossExtras<Scalar>& extras) {
    return detail::fused_head_loss_pass<Scalar, Id>(h, head.weight().value(), detail::head_bias(head), targets, extras,
                                                    nullptr, nullptr, nullptr, options_, workspace_,
                                                    "FusedHeadLoss::forward");
  }

  FusedHeadLossOptions options_;
  FusedHeadLossWorkspace<Scalar> workspace_;
};

}  // namespace embedhead

#endif  // EMBEDHEAD_FUSED_HEAD_LOSS_HPP
