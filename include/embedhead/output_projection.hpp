// embedhead: the LM head, an output projection from hidden states to vocabulary logits.
//
//   forward   logits = h W^T + b                  h [N, d], W [V, d] (nn.Linear layout), b [V]
//   backward  dh  = dlogits W                      (written)
//             dW += dlogits^T h                    (accumulated, dense: every row of W is touched)
//             db += sum_n dlogits[n]               (accumulated)
//
// Untied, the head owns W and an optional bias. Tied (tie_to / the TokenEmbedding constructor /
// OutputProjection(embedding.weight_ptr())), W is the embedding's own Parameter -- the same
// storage and the same gradient -- and there is no bias, so dE = (sparse rows from the
// embedding's backward) + (dense dlogits^T h from here). Tying is pointer identity and nothing
// else: is_tied_to(embedding) compares the two weight_ptr()s; no flag is kept beside the pointer,
// so every way of sharing the table behaves the same (checkpoints, resize_vocabulary,
// unique_parameters).
#ifndef EMBEDHEAD_OUTPUT_PROJECTION_HPP
#define EMBEDHEAD_OUTPUT_PROJECTION_HPP

#include "detail/checks.hpp"
#include "detail/gemm.hpp"
#include "detail/kernels.hpp"
#include "detail/parallel.hpp"
#include "init.hpp"
#include "parameter.hpp"
#include "token_embedding.hpp"
#include "types.hpp"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <sstream>
#include <type_traits>
#include <utility>
#include <vector>

namespace embedhead {

// ---- the arithmetic, as free functions on views ----

namespace detail {

// The head's products through the GEMM seam (detail/gemm.hpp): chunks of C, each one product on
// one thread (Kernel::gemm), handed to OpenMP threads. On the default backend, the library's packed
// kernel, every element's arithmetic depends on K and its own operands only, so the results do not
// depend on the chunking at all, and dW and dh run one chunk per thread (gemm::per_thread_plan:
// each chunk packs all of h or of W); on the Eigen and CBLAS backends the chunks are fixed by the
// shapes and the chunk sizes only. Either way results are bit-identical for any thread count and
// with or without OpenMP. The chunk sizes are parameters here so that bench/threads_bench.cpp can
// tune them; the public functions pass kHeadVocabChunk and kHeadTokenChunk. No checks: the public
// functions check first. WStorage is Scalar, or bf16 / fp16 for the low-precision head
// (low_precision.hpp): the packed kernel widens W while it packs it; other backends widen it a
// tile at a time inside each chunk into `tiles` (the seam's mixed-precision path).

// (non_deduced, types.hpp: WStorage below defaults to Scalar instead of being deduced from a
// Ref-convertible argument.)

inline bool head_threaded(Index N, Index V, Index d) {
  return 2.0 * static_cast<double>(N) * static_cast<double>(V) * static_cast<double>(d) >= kHeadMinFlops;
}

// logits[:, c] = b[c] + h W[c]^T for each chunk c of vocab_chunk rows of W.
template <typename Scalar, typename WStorage = Scalar>
void head_forward_chunked(const ConstMatrixRef<Scalar>& h,
                          const ConstMatrixRef<typename non_deduced<WStorage>::type>& W,
                          const ConstMatrixRef<Scalar>& bias, MatrixRef<Scalar> logits, Index vocab_chunk,
                          std::vector<float>* tiles = nullptr) {
  using namespace gemm;
  const Index N = h.rows(), V = W.rows(), d = W.cols();
  // W^T is the [d, V] column-major view of row-major W. Starting from the bias (or zero), the GEMM
  // adds into it: no second pass over logits.
  Op<Scalar, Layout::row_major, Layout::col_major, WStorage> op{
      N, V, d, h.data(), h.outerStride(), W.data(), W.outerStride(), logits.data(), logits.outerStride(), Init::zero};
  if (bias.size() != 0) op.init = Init::bias, op.bias = bias.data(), op.bias_stride = bias.outerStride();
  run<Kernel::gemm>(op, Plan{Split::cols, vocab_chunk, head_threaded(N, V, d)}, NoEpilogue{}, tiles);
}

// db [width] += the column sums of x [rows, width] (row r at x + r * ld): each group of kSumGroup
// columns summed into zeroed sums on the stack in row order, vectorised across the columns, then
// added to db -- so a second call adds exactly what the first added.
template <typename Scalar, typename Column>
void add_column_sums(const Scalar* x, Index ld, Index rows, Index width, Column&& db) {
  constexpr Index kSumGroup = 256;
  Eigen::Array<Scalar, kSumGroup, 1> sums;
  for (Index g0 = 0; g0 < width; g0 += kSumGroup) {
    const Index group = std::min(kSumGroup, width - g0);
    sums.head(group).setZero();
    for (Index r = 0; r < rows; ++r)
      sums.head(group) += Eigen::Map<const Eigen::Array<Scalar, Eigen::Dynamic, 1>>(x + r * ld + g0, group);
    db.segment(g0, group).array() += sums.head(group);
  }
}

// dW[c] += dlogits[:, c]^T h and db[c] += sum_n dlogits[n, c] by chunks c of vocab_chunk rows (each
// row of dW and db belongs to one chunk); then dh[r] = dlogits[r] W by chunks r of token_chunk
// rows (dh is a sum over all of V, so it is split by tokens instead, each row of dh in one chunk).
// db_sums_first (the low-precision head): each chunk's column sums are formed first, in token
// order from zero, and added to db once, so a second call adds exactly what the first added.
template <typename Scalar, typename WStorage = Scalar>
void head_backward_chunked(const ConstMatrixRef<Scalar>& h,
                           const ConstMatrixRef<typename non_deduced<WStorage>::type>& W,
                           const ConstMatrixRef<Scalar>& dlogits, MatrixRef<Scalar> dh, MatrixRef<Scalar> dW,
                           MatrixRef<Scalar> db, Index vocab_chunk, Index token_chunk,
                           std::vector<float>* tiles = nullptr, bool db_sums_first = false) {
  using namespace gemm;
  const Index N = h.rows(), V = W.rows(), d = W.cols();
  const bool threaded = head_threaded(N, V, d);
  // dW = dlogits^T h: dlogits^T is the [V, N] column-major view of row-major dlogits. An empty dW
  // (a frozen W) skips its GEMM (c = nullptr), an empty db its sums; with neither, the pass is skipped.
  const Op<Scalar, Layout::col_major, Layout::row_major> dW_op{V,
                                                               d,
                                                               N,
                                                               dlogits.data(),
                                                               dlogits.outerStride(),
                                                               h.data(),
                                                               h.outerStride(),
                                                               dW.size() != 0 ? dW.data() : nullptr,
                                                               dW.outerStride()};
  // db[v] += dlogits[0, v], then dlogits[1, v], ...: in token order, vectorised over v (with
  // db_sums_first: into a zeroed group of kSumGroup sums on the stack, then added to db).
  auto db_sums = [&](Index v0, Index v1) {
    if (db.size() == 0) return;
    if (!db_sums_first) {
      for (Index n = 0; n < N; ++n) db.col(0).segment(v0, v1 - v0) += dlogits.row(n).segment(v0, v1 - v0).transpose();
      return;
    }
    add_column_sums(dlogits.data() + v0, dlogits.outerStride(), N, v1 - v0, db.col(0).segment(v0, v1 - v0));
  };
  // Each chunk of dW packs all of h, each chunk of dh all of W: on a backend whose results do not
  // depend on the chunking, one chunk per thread (gemm::per_thread_plan), else the fixed chunks.
  if (dW.size() != 0 || db.size() != 0)
    run<Kernel::gemm>(dW_op,
                      per_thread_plan<DefaultBackend>(V, d, vocab_chunk, Plan{Split::rows, vocab_chunk, threaded},
                                                      true),
                      db_sums);
  // run returns after every chunk is done, so dW has read h before dh is written: dh may be h itself.
  const Op<Scalar, Layout::row_major, Layout::row_major, WStorage> dh_op{
      N,         d, V, dlogits.data(), dlogits.outerStride(), W.data(), W.outerStride(), dh.data(), dh.outerStride(),
      Init::zero};
  run<Kernel::gemm>(dh_op,
                    per_thread_plan<DefaultBackend>(N, d, kHeadMinThreadRows, Plan{Split::rows, token_chunk, threaded}),
                    NoEpilogue{}, tiles);
}

// h [N, d], dz [N, width] (row n at dz + n * ld), cols [k] (sorted, each in [0, width)) ->
// dW_rows [k, d] (row i at dW_rows + i * ldW) += dz[:, cols]^T h: the head's dW on some of its rows
// only -- a row mask's (Parameter::set_trainable_rows) -- from a gathered copy G [N, k] of those
// columns of dz (in `gathered`), one product of k rows instead of width. Row i's sum over tokens
// is the one a full dW product over the same N tokens would make for row cols[i]. Cost O(N k)
// to gather, 2 N k d flops.
template <typename Scalar, typename Backend = gemm::DefaultBackend>
void add_masked_rows_dW(const ConstMatrixRef<Scalar>& h, const Scalar* dz, Index ld, const Index* cols, Index k,
                        Scalar* dW_rows, Index ldW, std::vector<Scalar>& gathered) {
  using namespace gemm;
  const Index N = h.rows(), d = h.cols();
  if (k == 0 || N == 0) return;
  gathered.resize(static_cast<std::size_t>(N * k));
  for (Index n = 0; n < N; ++n)
    for (Index i = 0; i < k; ++i) gathered[static_cast<std::size_t>(n * k + i)] = dz[n * ld + cols[i]];
  const Op<Scalar, Layout::col_major, Layout::row_major> op{
      k, d, N, gathered.data(), k, h.data(), h.outerStride(), dW_rows, ldW};
  run<Kernel::gemm, Backend>(op, per_thread_plan<Backend>(k, d, kHeadVocabChunk,
                                                          Plan{Split::rows, kHeadVocabChunk, head_threaded(N, k, d)},
                                                          true));
}

// logits [N, V] = h W^T + b for 1 <= N <= kDecodeMaxTokens in one pass over W (Kernel::decode), by
// chunks of kDecodeVocabChunk rows of W. A logit's arithmetic does not depend on the chunking at
// all, so this is bit-identical for any thread count too.
template <typename Scalar>
void head_decode(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W, const ConstMatrixRef<Scalar>& bias,
                 MatrixRef<Scalar> logits) {
  using namespace gemm;
  const Index N = h.rows(), V = W.rows(), d = W.cols();
  Op<Scalar, Layout::row_major, Layout::col_major> op{
      N, V, d, h.data(), h.outerStride(), W.data(), W.outerStride(), logits.data(), logits.outerStride(), Init::zero};
  // A column of a wider matrix is strided: bias_stride is its outer stride.
  if (bias.size() != 0) op.init = Init::bias, op.bias = bias.data(), op.bias_stride = bias.outerStride();
  run<Kernel::decode>(op, Plan{Split::cols, kDecodeVocabChunk, V * d >= kDecodeMinElements});
}

}  // namespace detail

// h [N, d], W [V, d], bias [V, 1] or empty (0 rows: no bias) -> logits [N, V] = h W^T + b.
// N <= 8 (kDecodeMaxTokens) takes the decode path (output_projection_decode: one pass over W);
// larger N runs one GEMM per chunk of 1024 rows of W, the chunks spread over the OpenMP threads
// when built with OpenMP. The result is bit-identical for any thread count, with or without
// OpenMP; on the default (packed) kernel a token's logits are also the same bits in any batch of
// any N, the decode path's included (detail/gemm_packed.hpp, docs/threading.md "Batch invariance").
// \pre logits aliases neither h nor W. \throws shape_error on any shape mismatch (nothing written).
// Cost: 2 N V d flops. Nothing of size N*V is allocated; the packed kernel keeps per-thread packing
// buffers (at most about 5 MiB a thread in float, 10 in double, grown on first use and kept for the
// thread's life; Eigen's GEMM allocates its own per call).
namespace detail {

template <typename Scalar>
void output_projection_forward(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W,
                               const ConstMatrixRef<Scalar>& bias, MatrixRef<Scalar> logits, const char* where) {
  const Index N = h.rows(), V = W.rows(), d = W.cols();
  detail::check_shape(where, "h", h, N, d);
  if (bias.size() != 0) detail::check_shape(where, "bias", bias, V, 1);
  detail::check_shape(where, "logits", logits, N, V);
  if (N >= 1 && N <= detail::kDecodeMaxTokens)
    detail::head_decode<Scalar>(h, W, bias, logits);
  else
    detail::head_forward_chunked<Scalar>(h, W, bias, logits, detail::kHeadVocabChunk);
}

}  // namespace detail

// The function documented above; its errors name output_projection_forward.
// Layers call detail::output_projection_forward with their own name instead.
template <typename Scalar>
void output_projection_forward(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W,
                               const ConstMatrixRef<Scalar>& bias, MatrixRef<Scalar> logits) {
  detail::output_projection_forward<Scalar>(h, W, bias, logits, "output_projection_forward");
}

// Decode: h [N, d] with 1 <= N <= 8, W [V, d], bias [V, 1] or empty -> logits [N, V] = h W^T + b,
// streaming W from memory once. Rows of W are read a SIMD packet's width at a time, transposed in
// registers and multiplied into all N tokens, each logit by the packed GEMM's sequence (so the
// same bits as in a batch, on the default backend), so the cost is one read of W's V d values plus
// 2 N V d flops: memory-bound, about the time of reading W. Chunks of 1024
// rows of W go to the OpenMP threads; the result is bit-identical for any thread count.
// output_projection_forward (and so OutputProjection::forward) calls this for N <= 8 by itself;
// call it directly to insist on the decode path.
// \pre logits aliases neither h nor W. \throws value_error if N is outside [1, 8], shape_error on
// any shape mismatch (nothing written either way). Allocates nothing.
namespace detail {

template <typename Scalar>
void output_projection_decode(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W,
                              const ConstMatrixRef<Scalar>& bias, MatrixRef<Scalar> logits, const char* where) {
  const Index N = h.rows(), V = W.rows(), d = W.cols();
  detail::check_range(where, "N", N, 1, detail::kDecodeMaxTokens);
  detail::check_shape(where, "h", h, N, d);
  if (bias.size() != 0) detail::check_shape(where, "bias", bias, V, 1);
  detail::check_shape(where, "logits", logits, N, V);
  detail::head_decode<Scalar>(h, W, bias, logits);
}

}  // namespace detail

// The function documented above; its errors name output_projection_decode.
// Layers call detail::output_projection_decode with their own name instead.
template <typename Scalar>
void output_projection_decode(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W,
                              const ConstMatrixRef<Scalar>& bias, MatrixRef<Scalar> logits) {
  detail::output_projection_decode<Scalar>(h, W, bias, logits, "output_projection_decode");
}

// h [N, d], W [V, d], dlogits [N, V] -> dh [N, d] = dlogits W (written); dW [V, d] += dlogits^T h
// and db [V, 1] += column sums of dlogits, each skipped when empty (0 rows: a frozen W, no bias).
// dW and db run by chunks of 1024 rows of W, dh by chunks of 256 tokens, each chunk one GEMM, the
// chunks spread over the OpenMP threads when built with OpenMP; bit-identical for any thread
// count, with or without OpenMP.
// \pre dh aliases neither W, dlogits nor dW; it may be h (dW is computed first).
// \throws shape_error on any mismatch (nothing written). Cost: 4 N V d flops (2 N V d without dW).
namespace detail {

template <typename Scalar>
void output_projection_backward(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W,
                                const ConstMatrixRef<Scalar>& dlogits, MatrixRef<Scalar> dh, MatrixRef<Scalar> dW,
                                MatrixRef<Scalar> db, const char* where) {
  const Index N = h.rows(), V = W.rows(), d = W.cols();
  detail::check_shape(where, "h", h, N, d);
  detail::check_shape(where, "dlogits", dlogits, N, V);
  detail::check_shape(where, "dh", dh, N, d);
  if (dW.size() != 0) detail::check_shape(where, "dW", dW, V, d);
  if (db.size() != 0) detail::check_shape(where, "db", db, V, 1);
  detail::head_backward_chunked<Scalar>(h, W, dlogits, dh, dW, db, detail::kHeadVocabChunk, detail::kHeadTokenChunk);
}

}  // namespace detail

// The function documented above; its errors name output_projection_backward.
// Layers call detail::output_projection_backward with their own name instead.
template <typename Scalar>
void output_projection_backward(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& W,
                                const ConstMatrixRef<Scalar>& dlogits, MatrixRef<Scalar> dh, MatrixRef<Scalar> dW,
                                MatrixRef<Scalar> db) {
  detail::output_projection_backward<Scalar>(h, W, dlogits, dh, dW, db, "output_projection_backward");
}

// ---- the layer ----

struct OutputProjectionOptions {
  bool bias = true;        // an untied head's bias b [V], initialised to zero
  double init_std = 0.02;  // W ~ N(0, init_std^2)
  std::uint64_t seed = 2;  // differs from the embedding's default seed
};

template <typename Scalar>
class OutputProjection {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");

 public:
  // Move-only, like TokenEmbedding: a copy would silently share the parameters.
  OutputProjection(const OutputProjection&) = delete;
  OutputProjection& operator=(const OutputProjection&) = delete;
  OutputProjection(OutputProjection&&) noexcept = default;
  OutputProjection& operator=(OutputProjection&&) noexcept = default;

  // Untied: a new W [V, d] from N(0, init_std^2) with Rng(seed), and a zero bias [V] if asked.
  // \throws value_error if V or d < 1 or init_std is not in (0, inf), also in Scalar (see
  // init_normal: not 0 there, every draw finite there).
  OutputProjection(Index V, Index d, const OutputProjectionOptions& options = {})
      : weight_(make_weight(V, d, options)) {
    Rng rng(options.seed);
    init_normal<Scalar>(weight_->value(), options.init_std, rng);
    if (options.bias) bias_ = std::make_shared<Parameter<Scalar>>(V, 1, "lm_head.bias");
  }

  // Wrapping existing parameters (e.g. loaded weights): W [V, d] and an optional bias [V, 1] (null
  // for none), values untouched. Passing embedding.weight_ptr() without a bias ties the head, as
  // the TokenEmbedding constructor does. \throws value_error if weight is null; shape_error if the
  // bias is not [V, 1].
  explicit OutputProjection(std::shared_ptr<Parameter<Scalar>> weight,
                            std::shared_ptr<Parameter<Scalar>> bias = nullptr)
      : weight_(std::move(weight)), bias_(std::move(bias)) {
    if (!weight_) throw value_error("OutputProjection: weight is a null shared_ptr<Parameter>");
    if (bias_) detail::check_shape("OutputProjection", "bias", bias_->value(), weight_->rows(), 1);
  }

  // Tied to `embedding`: W is the embedding's Parameter (shared, not copied), no bias.
  // \throws value_error if the embedding was moved from (it holds no table).
  explicit OutputProjection(const TokenEmbedding<Scalar>& embedding)
      : weight_((check_not_moved_from(embedding), embedding.weight_ptr())) {}

  // Makes W the embedding's Parameter and drops the bias; the old W is released.
  // \throws shape_error if the embedding's [V, d] differs from this head's, value_error if it
  // was moved from (head unchanged either way).
  void tie_to(const TokenEmbedding<Scalar>& embedding) {
    check_not_moved_from(embedding);
    if (embedding.vocab_size() != vocab_size() || embedding.dim() != dim()) {
      std::ostringstream message;
      message << "OutputProjection::tie_to: embedding is [V=" << embedding.vocab_size() << ", d=" << embedding.dim()
              << "] but the head is [V=" << vocab_size() << ", d=" << dim() << "]; tying needs equal shapes";
      throw shape_error(message.str());
    }
    weight_ = embedding.weight_ptr();
    bias_.reset();
  }

  Index vocab_size() const { return weight_->rows(); }
  Index dim() const { return weight_->cols(); }
  // True when W is embedding's Parameter (pointer identity), however the head was built.
  bool is_tied_to(const TokenEmbedding<Scalar>& embedding) const { return weight_ == embedding.weight_ptr(); }
  // (There is no is_tied() without an argument: whether a head is tied is a fact about the head
  // and an embedding together, and only pointer identity decides it.)
  bool has_bias() const { return bias_ != nullptr; }

  Parameter<Scalar>& weight() { return *weight_; }
  const Parameter<Scalar>& weight() const { return *weight_; }
  const std::shared_ptr<Parameter<Scalar>>& weight_ptr() const { return weight_; }
  // The bias [V, 1], or nullptr when there is none (tied, or bias = false).
  Parameter<Scalar>* bias() { return bias_.get(); }
  const Parameter<Scalar>* bias() const { return bias_.get(); }
  const std::shared_ptr<Parameter<Scalar>>& bias_ptr() const { return bias_; }

  // Every parameter this layer uses, each once: W, then the bias if any. A tied head lists the
  // embedding's E (pass both layers' lists through unique_parameters() to register E once);
  // count_parameters() counts each distinct one once.
  std::vector<std::shared_ptr<Parameter<Scalar>>> parameters() const {
    std::vector<std::shared_ptr<Parameter<Scalar>>> list;
    list.reserve(2);
    list.push_back(weight_);
    if (bias_) list.push_back(bias_);
    return list;
  }

  // h [N, d] -> logits [N, V] = h W^T + b. See output_projection_forward.
  void forward(const ConstMatrixRef<Scalar>& h, MatrixRef<Scalar> logits) const {
    detail::output_projection_forward<Scalar>(h, weight_->value(), bias_view(), logits, "OutputProjection::forward");
  }
  RowMatrix<Scalar> forward(const ConstMatrixRef<Scalar>& h) const {
    detail::check_shape("OutputProjection::forward", "h", h, h.rows(), dim());
    RowMatrix<Scalar> logits(h.rows(), vocab_size());
    forward(h, logits);
    return logits;
  }

  // h [N, d], dlogits [N, V] -> dh [N, d] = dlogits W (written); weight().grad() += dlogits^T h
  // (switches it to dense mode; with trainable rows, Parameter::set_trainable_rows, only their rows
  // are computed and it stays sparse); bias grad += column sums of dlogits. A frozen W or bias takes
  // nothing (dh is still computed, for the layers below): a frozen W skips the dW GEMM, half the
  // flops, and its gradient stays as it was (sparse, nothing allocated).
  // \throws shape_error on any mismatch, a bias whose length is no longer W's V included (W or the
  // bias resized alone); gradients (their dense flag too) and dh unchanged on throw.
  void backward(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& dlogits, MatrixRef<Scalar> dh) {
    const char* where = "OutputProjection::backward";
    // Check before dense_accumulator(), which would switch the gradient to dense mode.
    detail::check_shape(where, "h", h, h.rows(), dim());
    detail::check_shape(where, "dlogits", dlogits, h.rows(), vocab_size());
    detail::check_shape(where, "dh", dh, h.rows(), dim());
    // A bias of another length than W (one of them resized alone) would only be found by the
    // product's check, after both gradients had turned dense.
    if (bias_) detail::check_shape(where, "bias", bias_->value(), vocab_size(), 1);
    // The V x d buffer first: if its allocation fails, the bias gradient is still untouched.
    const Eigen::Map<RowMatrix<Scalar>> none(nullptr, 0, 1);
    const Eigen::Map<RowMatrix<Scalar>> no_dW(nullptr, 0, dim());
    const auto* trainable = weight_->frozen() ? nullptr : weight_->trainable_rows();
    auto dW = weight_->frozen() || trainable ? no_dW : weight_->grad().dense_accumulator();
    // A row mask: dW on the trainable rows only (k x d, never V x d). Every buffer is allocated
    // before a value changes: the gathered columns, the mask's rows, then the bias's gradient.
    std::vector<Scalar> gathered;
    if (trainable) gathered.reserve(static_cast<std::size_t>(h.rows()) * trainable->size());
    auto dW_rows = trainable ? weight_->grad().masked_accumulator() : no_dW;
    auto db = bias_ && !bias_->frozen() ? bias_->grad().dense_accumulator() : none;
    if (trainable)  // before dh is written: dh may be h
      detail::add_masked_rows_dW<Scalar>(h, dlogits.data(), dlogits.outerStride(), trainable->data(),
                                         static_cast<Index>(trainable->size()), dW_rows.data(), dim(), gathered);
    detail::output_projection_backward<Scalar>(h, weight_->value(), dlogits, dh, dW, db, where);
  }
  RowMatrix<Scalar> backward(const ConstMatrixRef<Scalar>& h, const ConstMatrixRef<Scalar>& dlogits) {
    detail::check_shape("OutputProjection::backward", "h", h, h.rows(), dim());
    RowMatrix<Scalar> dh(h.rows(), dim());
    backward(h, dlogits, dh);
    return dh;
  }

  void zero_grad() {
    weight_->zero_grad();
    if (bias_) bias_->zero_grad();
  }
  // Size of W plus the bias's. A tied head counts the shared table too (count_parameters over both
  // layers' parameters() counts it once).
  Index parameter_count() const { return weight_->size() + (bias_ ? bias_->size() : 0); }
  // True when W and the bias (if any) are frozen. set_frozen applies to both; tied, it freezes the
  // embedding's table as well (one Parameter).
  bool frozen() const { return weight_->frozen() && (!bias_ || bias_->frozen()); }
  void set_frozen(bool frozen) {
    weight_->set_frozen(frozen);
    if (bias_) bias_->set_frozen(frozen);
  }
  // ids [k] (strictly increasing, in [0, V)): only these rows of W train, their dW alone computed
  // (Parameter::set_trainable_rows); tied, the embedding's too. The bias is not masked.
  // \throws as Parameter::set_trainable_rows (nothing changed).
  void set_trainable_rows(std::vector<Index> ids) { weight_->set_trainable_rows(std::move(ids)); }

 private:
  static void check_not_moved_from(const TokenEmbedding<Scalar>& embedding) {
    if (!embedding.weight_ptr())
      throw value_error("OutputProjection: the TokenEmbedding was moved from and holds no table");
  }
  static std::shared_ptr<Parameter<Scalar>> make_weight(Index V, Index d, const OutputProjectionOptions& options) {
    detail::check_size("OutputProjection", "V", V);
    detail::check_size("OutputProjection", "d", d);
    detail::check_init_std<Scalar>("OutputProjection", "init_std", options.init_std);
    return std::make_shared<Parameter<Scalar>>(V, d, "lm_head.weight");
  }
  Eigen::Map<const RowMatrix<Scalar>> bias_view() const {
    if (bias_) return static_cast<const Parameter<Scalar>&>(*bias_).value();
    return {nullptr, 0, 1};
  }

  std::shared_ptr<Parameter<Scalar>> weight_;
  std::shared_ptr<Parameter<Scalar>> bias_;
};

}  // namespace embedhead

#endif  // EMBEDHEAD_OUTPUT_PROJECTION_HPP
