// embedhead: bf16 and fp16 storage for the token table and the LM head weights, with fp32
// accumulation and fp32 outputs.
//
//   convert_table     E (float) [V, d] -> Storage [V, d], round to nearest even (Eigen's conversion)
//   widen_table       Storage [V, d] -> float [V, d], exact
//   embedding lookup  out[b*T + t] = s * float(E[ids(b, t)])           only gathered rows converted
//   embedding grad    dE[v] += s * sum_{n : ids_n = v} dout[n]          in a RowGradient<float>
//   head forward      logits = h float(W)^T + b                         tile by tile, float GEMM
//   head backward     dh = dlogits float(W) (tiled); dW += dlogits^T h; db += column sums (float)
//
// Storage is Eigen::bfloat16 or Eigen::half. Nothing here ever makes a float copy of the whole
// table: the lookup converts the d values of each gathered row, and the head runs the float head's
// chunks (detail::head_forward_chunked / head_backward_chunked) through the GEMM seam. On the
// default backend, the library's packed kernel, W is widened (exactly) while the kernel packs it,
// so the head computes the float head's sequence on float(W): its forward, dW and dh equal the
// float head's on float(W) bit for bit (N <= 8 tokens take the decode kernel, as the float head
// does, widening W as it streams: the decode path reads half the bytes of a float W). On the Eigen and
// CBLAS backends the seam's mixed-precision path (detail/gemm.hpp) converts W kWidenTileRows = 256
// rows at a time into a per-thread float tile (HeadTileWorkspace) and each tile is one float GEMM:
// forward and dW as the float head's, dh summing V in tiles of 256 rows (within rounding of the
// float head's). Either way bit-identical for any thread count; db adds each call's column sums
// once (a second call adds exactly the same). Converting W costs V*d cheap conversions (a shift
// for bf16) per pack, against the products' flops.
//
// The lookup's optional sqrt(d) multiplier is rounded to Storage first, then applied in float, as
// Gemma does with its bf16 normalizer: sqrt(2048) = 45.2548... becomes 45.25 in bf16 and in fp16
// (low_precision_scale).
//
// The backward of a low-precision lookup does not read the table: it is the float scatter
// embedding_backward<float> (token_embedding.hpp) into a RowGradient<float>, with the rounded
// multiplier; LowPrecisionEmbedding::backward calls it. Row-sparse, O(touched rows * d).
//
// The layers hold their tables as Parameter<Storage, float> (parameter.hpp): the value in Storage,
// a float row-sparse gradient, a frozen flag, so freezing, zero_grad, clip_grad_norm,
// count_parameters and the data-parallel exchange (all_reduce_gradient) reach them as they reach a
// float table. The head's bias is a float Parameter<float>; the head's parameters() lists both as
// ParameterBase<float> (the part that does not depend on the value's type). Every optimizer
// (optim/optimizer.hpp) steps a Parameter<Storage, float>: the rows are updated in float and written
// back by its LowPrecisionUpdate (nearest, stochastic or kahan; optim/low_precision_update.hpp).
#ifndef EMBEDHEAD_LOW_PRECISION_HPP
#define EMBEDHEAD_LOW_PRECISION_HPP

#include "detail/checks.hpp"
#include "detail/gemm.hpp"
#include "detail/kernels.hpp"
#include "detail/parallel.hpp"
#include "output_projection.hpp"
#include "parameter.hpp"
#include "token_embedding.hpp"
#include "types.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <sstream>
#include <type_traits>
#include <vector>

namespace embedhead {

// is_low_precision_v<T> (parameter.hpp): true for the storage types this header accepts,
// Eigen::bfloat16 and Eigen::half.

// Scratch for the tiled head passes on a backend that does not widen W itself (Eigen, CBLAS): one
// float tile of at most 256 x d values per thread (detail::kWidenTileRows), reused across calls so
// the steady state allocates nothing; unused (left empty) on the default packed kernel. A
// default-constructed one is always valid.
struct HeadTileWorkspace {
  std::vector<float> tiles;
};

namespace detail {

template <typename Storage>
using enable_if_low_precision = std::enable_if_t<is_low_precision_v<Storage>, int>;

template <typename Storage>
constexpr const char* storage_name() {
  return std::is_same_v<Storage, Eigen::bfloat16> ? "bf16" : "fp16";
}

}  // namespace detail

// ---- conversions ----

// -> float(Storage(sqrt(d))): the lookup multiplier rounded to the storage type, as Gemma rounds
// its normalizer to bf16 (d = 2048 -> 45.25). \throws value_error if d < 1. Cost O(1).
template <typename Storage, detail::enable_if_low_precision<Storage> = 0>
float low_precision_scale(Index d) {
  detail::check_size("low_precision_scale", "d", d);
  return static_cast<float>(static_cast<Storage>(static_cast<float>(std::sqrt(static_cast<double>(d)))));
}

// src float [V, d] -> dst Storage [V, d], each value rounded to nearest, ties to even (NaN and
// +-inf are kept). \throws shape_error if dst is not [V, d]; value_error if a finite value
// overflows Storage (|x| >= 65520 for fp16, >= 2^128 - 2^119 = 3.3962e38 for bf16), naming it and
// its (row, col).
// Nothing written on throw. Cost: two passes over V*d values; no allocation.
namespace detail {

template <typename Storage, detail::enable_if_low_precision<Storage> = 0>
void convert_table(const ConstMatrixRef<float>& src, MatrixRef<Storage> dst, const char* where) {
  detail::check_shape(where, "dst", dst, src.rows(), src.cols());
  for (Index r = 0; r < src.rows(); ++r)
    for (Index c = 0; c < src.cols(); ++c) {
      const float x = src(r, c);
      if (std::isfinite(x) && !std::isfinite(static_cast<float>(static_cast<Storage>(x)))) {
        std::ostringstream message;
        message << where << ": value " << x << " at (" << r << ", " << c << ") overflows "
                << detail::storage_name<Storage>() << " (largest finite "
                << static_cast<float>(Eigen::NumTraits<Storage>::highest()) << ")";
        throw value_error(message.str());
      }
    }
  dst = src.template cast<Storage>();
}

}  // namespace detail

// The function documented above; its errors name convert_table (layers call detail::convert_table with their own name).
template <typename Storage, detail::enable_if_low_precision<Storage> = 0>
void convert_table(const ConstMatrixRef<float>& src, MatrixRef<Storage> dst) {
  detail::convert_table<Storage>(src, dst, "convert_table");
}
// src float [V, d] -> a new Storage [V, d]. As above.
template <typename Storage, detail::enable_if_low_precision<Storage> = 0>
RowMatrix<Storage> convert_table(const ConstMatrixRef<float>& src) {
  RowMatrix<Storage> dst(src.rows(), src.cols());
  convert_table<Storage>(src, dst);
  return dst;
}

// src Storage [V, d] -> dst float [V, d], exact (every bf16 / fp16 value is a float).
// \throws shape_error if dst is not [V, d] (nothing written). Cost O(V*d); no allocation.
template <typename Storage, detail::enable_if_low_precision<Storage> = 0>
void widen_table(const ConstMatrixRef<Storage>& src, MatrixRef<float> dst) {
  detail::check_shape("widen_table", "dst", dst, src.rows(), src.cols());
  dst = src.template cast<float>();
}
// src Storage [V, d] -> a new float [V, d]. As above; allocates V*d floats.
template <typename Storage, detail::enable_if_low_precision<Storage> = 0>
RowMatrix<float> widen_table(const ConstMatrixRef<Storage>& src) {
  return src.template cast<float>();
}

// ---- the lookup, on views ----

// E Storage [V, d], ids [B, T] -> out float [B*T, d]: out[b*T + t] = scale * float(E[ids(b, t)]).
// Only the gathered rows are converted. Same checks, messages, prefetching and OpenMP threading
// as the float embedding_forward (bit-identical for any thread count).
// \pre out does not alias E. \throws index_error for an id outside [0, V) (the first in
// row-major order, with its (b, t)); shape_error if out is not [B*T, d]. Nothing written on throw.
// Cost: B*T*d conversions (and multiplies when scale != 1); no allocation.
namespace detail {

template <typename Storage, typename Id, detail::enable_if_low_precision<Storage> = 0>
void embedding_forward(const ConstMatrixRef<Storage>& E, const TypedTokenIds<Id>& ids, float scale,
                       MatrixRef<float> out, const char* where) {
  const Index V = E.rows(), d = E.cols(), N = ids.size();
  detail::check_shape(where, "out", out, N, d);
  detail::check_ids(where, ids, V);
  if (N == 0) return;  // also keeps T = 0 out of gather_tokens' divisions
  detail::gather_tokens(
      ids, [&](Index v) { return E.row(v).data(); }, d,
      [&](Index n, Index v) { detail::widen_row(E.row(v).data(), d, scale, out.row(n).data()); }, [] {});
}

}  // namespace detail

// The function documented above; its errors name embedding_forward.
// Layers call detail::embedding_forward with their own name instead.
template <typename Storage, detail::enable_if_low_precision<Storage> = 0>
void embedding_forward(const ConstMatrixRef<Storage>& E, TokenIds ids, float scale, MatrixRef<float> out) {
  ids.visit([&](const auto& typed) { detail::embedding_forward<Storage>(E, typed, scale, out, "embedding_forward"); });
}

// ---- the head, on views ----

// h float [N, d], W Storage [V, d], bias float [V, 1] or empty (no bias) -> logits float [N, V]
// = h float(W)^T + b, by the float head's chunks of 1024 rows of W (over the OpenMP threads when
// built with OpenMP); W widened while packed (the packed kernel) or 256 rows at a time into the
// thread's tile in workspace.tiles (Eigen, CBLAS); N <= 8 tokens take the decode kernel, W widened
// as it streams. Bit-identical for any thread count, and equal to output_projection_forward<float>
// on float(W) for every N (on the Eigen and CBLAS backends: for N <= 8).
// \pre logits aliases neither h nor W. \throws shape_error on any shape mismatch (nothing
// written). Cost: 2 N V d flops plus V*d conversions; allocates only when the workspace is too
// small (256 * d floats per thread, Eigen and CBLAS), plus the kernel's packing buffers.
namespace detail {

template <typename Storage, detail::enable_if_low_precision<Storage> = 0>
void output_projection_forward(const ConstMatrixRef<float>& h, const ConstMatrixRef<Storage>& W,
                               const ConstMatrixRef<float>& bias, MatrixRef<float> logits, HeadTileWorkspace& workspace,
                               const char* where) {
  const Index N = h.rows(), V = W.rows(), d = W.cols();
  detail::check_shape(where, "h", h, N, d);
  if (bias.size() != 0) detail::check_shape(where, "bias", bias, V, 1);
  detail::check_shape(where, "logits", logits, N, V);
  if (N >= 1 && N <= detail::kDecodeMaxTokens) {
    // The decode kernel, W widened as it streams (the same on every backend).
    using namespace gemm;
    Op<float, Layout::row_major, Layout::col_major, Storage> op{
        N, V, d, h.data(), h.outerStride(), W.data(), W.outerStride(), logits.data(), logits.outerStride(), Init::zero};
    if (bias.size() != 0) op.init = Init::bias, op.bias = bias.data(), op.bias_stride = bias.outerStride();
    run<Kernel::decode, PackedBackend>(op, Plan{Split::cols, kDecodeVocabChunk, V * d >= kDecodeMinElements});
    return;
  }
  detail::head_forward_chunked<float, Storage>(h, W, bias, logits, detail::kHeadVocabChunk, &workspace.tiles);
}

}  // namespace detail

// The function documented above; its errors name output_projection_forward.
// Layers call detail::output_projection_forward with their own name instead.
template <typename Storage, detail::enable_if_low_precision<Storage> = 0>
void output_projection_forward(const ConstMatrixRef<float>& h, const ConstMatrixRef<Storage>& W,
                               const ConstMatrixRef<float>& bias, MatrixRef<float> logits,
                               HeadTileWorkspace& workspace) {
  detail::output_projection_forward<Storage>(h, W, bias, logits, workspace, "output_projection_forward");
}

// h float [N, d], W Storage [V, d], dlogits float [N, V] -> dh float [N, d] = dlogits float(W)
// (written; on the packed kernel the float head's sequence on float(W), elsewhere the sum over V
// in tiles of 256 converted rows of W, in increasing v); dW float [V, d] += dlogits^T h and db
// float [V, 1] += column sums of dlogits, each skipped when empty (0 rows: frozen weights, no
// bias): dW by the float head's code, bit for bit; db as each chunk's column sums (token order
// from zero) added once. Bit-identical for any thread count.
// \pre dh aliases neither W, dlogits nor dW; it may be h (dW is computed first).
// \throws shape_error on any mismatch (nothing written). Cost: 4 N V d flops (2 N V d without
// dW) plus V*d conversions per pack of W; allocation as output_projection_forward.
namespace detail {

template <typename Storage, detail::enable_if_low_precision<Storage> = 0>
void output_projection_backward(const ConstMatrixRef<float>& h, const ConstMatrixRef<Storage>& W,
                                const ConstMatrixRef<float>& dlogits, MatrixRef<float> dh, MatrixRef<float> dW,
                                MatrixRef<float> db, HeadTileWorkspace& workspace, const char* where) {
  const Index N = h.rows(), V = W.rows(), d = W.cols();
  detail::check_shape(where, "h", h, N, d);
  detail::check_shape(where, "dlogits", dlogits, N, V);
  detail::check_shape(where, "dh", dh, N, d);
  if (dW.size() != 0) detail::check_shape(where, "dW", dW, V, d);
  if (db.size() != 0) detail::check_shape(where, "db", db, V, 1);
  // dW reads h, so it goes before dh is written: dh may then be h itself.
  detail::head_backward_chunked<float, Storage>(h, W, dlogits, dh, dW, db, detail::kHeadVocabChunk,
                                                detail::kHeadTokenChunk, &workspace.tiles, true);
}

}  // namespace detail

// The function documented above; its errors name output_projection_backward.
// Layers call detail::output_projection_backward with their own name instead.
template <typename Storage, detail::enable_if_low_precision<Storage> = 0>
void output_projection_backward(const ConstMatrixRef<float>& h, const ConstMatrixRef<Storage>& W,
                                const ConstMatrixRef<float>& dlogits, MatrixRef<float> dh, MatrixRef<float> dW,
                                MatrixRef<float> db, HeadTileWorkspace& workspace) {
  detail::output_projection_backward<Storage>(h, W, dlogits, dh, dW, db, workspace, "output_projection_backward");
}

// ---- the layers ----

// A token embedding whose table E [V, d] is stored in bf16 or fp16 (a Parameter<Storage, float>)
// and whose gradient is float. Options as TokenEmbedding's (padding_idx, scale_by_sqrt_d); init_std
// and seed are unused: the table always comes from the caller. Move-only, like the other layers.
template <typename Storage>
class LowPrecisionEmbedding {
  static_assert(is_low_precision_v<Storage>, "Storage must be Eigen::bfloat16 or Eigen::half");

 public:
  using ParameterType = Parameter<Storage, float>;

  LowPrecisionEmbedding(const LowPrecisionEmbedding&) = delete;
  LowPrecisionEmbedding& operator=(const LowPrecisionEmbedding&) = delete;
  LowPrecisionEmbedding(LowPrecisionEmbedding&&) noexcept = default;
  LowPrecisionEmbedding& operator=(LowPrecisionEmbedding&&) noexcept = default;

  // E Storage [V, d], copied as it is. \throws value_error if V or d < 1; index_error if
  // padding_idx is outside [0, V).
  explicit LowPrecisionEmbedding(const ConstMatrixRef<Storage>& E, const TokenEmbeddingOptions& options = {})
      : options_((validate(E.rows(), E.cols(), options), options)),
        weight_(std::make_shared<ParameterType>(RowMatrix<Storage>(E), "token_embedding.weight")) {}
  // E float [V, d], rounded to Storage (convert_table). \throws as above and as convert_table.
  explicit LowPrecisionEmbedding(const ConstMatrixRef<float>& E, const TokenEmbeddingOptions& options = {})
      : options_((validate(E.rows(), E.cols(), options), options)),
        weight_(std::make_shared<ParameterType>(convert_table<Storage>(E), "token_embedding.weight")) {}
  // Wraps an existing parameter as E [V, d] (shared, values untouched). \throws value_error if
  // weight is null; index_error for a bad padding_idx.
  explicit LowPrecisionEmbedding(std::shared_ptr<ParameterType> weight, const TokenEmbeddingOptions& options = {})
      : options_((check_not_null(weight), validate(weight->rows(), weight->cols(), options), options)),
        weight_(std::move(weight)) {}

  Index vocab_size() const { return weight_->rows(); }
  Index dim() const { return weight_->cols(); }
  const TokenEmbeddingOptions& options() const { return options_; }
  // float(Storage(sqrt(d))) when scale_by_sqrt_d is set (45.25 at d = 2048), else 1.
  float scale() const { return options_.scale_by_sqrt_d ? low_precision_scale<Storage>(dim()) : 1.0f; }

  // The table as a parameter: value Storage [V, d], gradient float [V, d] row-sparse.
  ParameterType& weight() { return *weight_; }
  const ParameterType& weight() const { return *weight_; }
  const std::shared_ptr<ParameterType>& weight_ptr() const { return weight_; }
  // -> {weight_ptr()}: the one parameter.
  std::vector<std::shared_ptr<ParameterType>> parameters() const { return {weight_}; }
  Index parameter_count() const { return weight_->size(); }

  // The table [V, d] (weight().value()); entries may be changed in place, never resized.
  Eigen::Map<RowMatrix<Storage>> table() { return weight_->value(); }
  Eigen::Map<const RowMatrix<Storage>> table() const { return static_cast<const ParameterType&>(*weight_).value(); }
  // dE [V, d] in float, row-sparse (weight().grad()).
  RowGradient<float>& grad() { return weight_->grad(); }
  const RowGradient<float>& grad() const { return weight_->grad(); }
  void zero_grad() { weight_->zero_grad(); }
  // weight().frozen() / set_frozen(): see ParameterBase.
  bool frozen() const { return weight_->frozen(); }
  void set_frozen(bool frozen) { weight_->set_frozen(frozen); }

  // ids [B, T] -> out float [B*T, d]. See embedding_forward above.
  void forward(TokenIds ids, MatrixRef<float> out) const {
    ids.visit([&](const auto& typed) { forward_into(typed, out); });
  }
  RowMatrix<float> forward(TokenIds ids) const {
    return ids.visit([&](const auto& typed) { return forward_new(typed); });
  }

  // ids [B, T], dout float [B*T, d] -> grad() += scale * one_hot(ids)^T * dout, skipping
  // padding_idx: embedding_backward<float>, bit-identical to TokenEmbedding<float>::backward with
  // the same multiplier. A frozen table takes nothing, after the same checks.
  // \throws index_error / shape_error (gradient unchanged). Cost O(N log N + touched rows * d).
  void backward(TokenIds ids, const ConstMatrixRef<float>& dout) {
    ids.visit([&](const auto& typed) { backward_impl(typed, dout); });
  }

 private:
  static void check_not_null(const std::shared_ptr<ParameterType>& weight) {
    if (!weight) throw value_error("LowPrecisionEmbedding: weight is a null shared_ptr<Parameter>");
  }
  static void validate(Index V, Index d, const TokenEmbeddingOptions& options) {
    detail::check_size("LowPrecisionEmbedding", "V", V);
    detail::check_size("LowPrecisionEmbedding", "d", d);
    if (options.padding_idx && (*options.padding_idx < 0 || *options.padding_idx >= V)) {
      std::ostringstream message;
      message << "LowPrecisionEmbedding: padding_idx " << *options.padding_idx << " outside [0, " << V << ")";
      throw index_error(message.str());
    }
  }
  template <typename Id>
  void forward_into(const TypedTokenIds<Id>& ids, MatrixRef<float> out) const {
    detail::embedding_forward<Storage, Id>(table(), ids, scale(), out, "LowPrecisionEmbedding::forward");
  }
  template <typename Id>
  RowMatrix<float> forward_new(const TypedTokenIds<Id>& ids) const {
    detail::check_ids("LowPrecisionEmbedding::forward", ids, vocab_size());  // before allocating
    RowMatrix<float> out(ids.size(), dim());
    forward_into(ids, out);
    return out;
  }
  template <typename Id>
  void backward_impl(const TypedTokenIds<Id>& ids, const ConstMatrixRef<float>& dout) {
    if (weight_->frozen()) {
      detail::check_shape("LowPrecisionEmbedding::backward", "dout", dout, ids.size(), dim());
      detail::check_ids("LowPrecisionEmbedding::backward", ids, vocab_size());
      return;
    }
    detail::embedding_backward<float, Id>(ids, dout, scale(), options_.padding_idx.value_or(-1), weight_->grad(),
                                          workspace_, "LowPrecisionEmbedding::backward");
  }

  TokenEmbeddingOptions options_;
  std::shared_ptr<ParameterType> weight_;
  ScatterWorkspace workspace_;
};

// An untied LM head whose weight W [V, d] is stored in bf16 or fp16 (a Parameter<Storage, float>),
// with an optional float bias [V, 1] (a Parameter<float>); gradients (dW, db) are float. Move-only.
template <typename Storage>
class LowPrecisionOutputProjection {
  static_assert(is_low_precision_v<Storage>, "Storage must be Eigen::bfloat16 or Eigen::half");

 public:
  using ParameterType = Parameter<Storage, float>;

  LowPrecisionOutputProjection(const LowPrecisionOutputProjection&) = delete;
  LowPrecisionOutputProjection& operator=(const LowPrecisionOutputProjection&) = delete;
  LowPrecisionOutputProjection(LowPrecisionOutputProjection&&) noexcept = default;
  LowPrecisionOutputProjection& operator=(LowPrecisionOutputProjection&&) noexcept = default;

  // W Storage [V, d] (copied) and bias float [V, 1] or empty (none).
  // \throws value_error if V or d < 1; shape_error if the bias is neither empty nor [V, 1].
  explicit LowPrecisionOutputProjection(const ConstMatrixRef<Storage>& W,
                                        const ConstMatrixRef<float>& bias = RowMatrix<float>(0, 1))
      : weight_((validate(W, bias), std::make_shared<ParameterType>(RowMatrix<Storage>(W), "lm_head.weight"))),
        bias_(make_bias(bias)),
        absent_bias_grad_(make_absent_bias_grad()) {}
  // W float [V, d], rounded to Storage (convert_table); bias as above. \throws as above and as
  // convert_table.
  explicit LowPrecisionOutputProjection(const ConstMatrixRef<float>& W,
                                        const ConstMatrixRef<float>& bias = RowMatrix<float>(0, 1))
      : weight_((validate(W, bias), std::make_shared<ParameterType>(convert_table<Storage>(W), "lm_head.weight"))),
        bias_(make_bias(bias)),
        absent_bias_grad_(make_absent_bias_grad()) {}

  Index vocab_size() const { return weight_->rows(); }
  Index dim() const { return weight_->cols(); }
  bool has_bias() const { return bias_ != nullptr; }

  // W as a parameter: value Storage [V, d], gradient float [V, d].
  ParameterType& weight() { return *weight_; }
  const ParameterType& weight() const { return *weight_; }
  const std::shared_ptr<ParameterType>& weight_ptr() const { return weight_; }
  // The bias [V, 1] (float), or nullptr when there is none.
  Parameter<float>* bias() { return bias_.get(); }
  const Parameter<float>* bias() const { return bias_.get(); }
  const std::shared_ptr<Parameter<float>>& bias_ptr() const { return bias_; }
  // W, then the bias if any, as ParameterBase<float> (W's value is Storage, the bias's float: the
  // common part is the gradient, shape, name and frozen flag).
  std::vector<std::shared_ptr<ParameterBase<float>>> parameters() const {
    std::vector<std::shared_ptr<ParameterBase<float>>> list;
    list.reserve(2);
    list.push_back(weight_);
    if (bias_) list.push_back(bias_);
    return list;
  }
  Index parameter_count() const { return weight_->size() + (bias_ ? bias_->size() : 0); }

  // weight().grad(); bias()->grad(), or an untouched [V, 1] gradient when there is no bias. That
  // one is made with the layer, so bias_grad() changes nothing while V stays as it was: const calls
  // may then run side by side. After W's rows change (weight().resize_rows), the next bias_grad()
  // -- const or not -- replaces it by one of the new V: that call changes the layer (it must not
  // run concurrently with any other use of it, as a non-const call), and references returned
  // before it dangle.
  RowGradient<float>& weight_grad() { return weight_->grad(); }
  const RowGradient<float>& weight_grad() const { return weight_->grad(); }
  RowGradient<float>& bias_grad() { return bias_ ? bias_->grad() : absent_bias_grad(); }
  const RowGradient<float>& bias_grad() const { return bias_ ? bias_->grad() : absent_bias_grad(); }
  void zero_grad() {
    weight_->zero_grad();
    if (bias_) bias_->zero_grad();
  }
  // True when W and the bias (if any) are frozen; set_frozen applies to both (see ParameterBase).
  bool frozen() const { return weight_->frozen() && (!bias_ || bias_->frozen()); }
  void set_frozen(bool frozen) {
    weight_->set_frozen(frozen);
    if (bias_) bias_->set_frozen(frozen);
  }

  // h float [N, d] -> logits float [N, V] = h float(W)^T + b. See output_projection_forward above.
  // Uses this layer's tile workspace: not to be called concurrently on one object.
  void forward(const ConstMatrixRef<float>& h, MatrixRef<float> logits) {
    detail::output_projection_forward<Storage>(h, weight_value(), bias_view(), logits, workspace_,
                                               "LowPrecisionOutputProjection::forward");
  }
  RowMatrix<float> forward(const ConstMatrixRef<float>& h) {
    detail::check_shape("LowPrecisionOutputProjection::forward", "h", h, h.rows(), dim());
    RowMatrix<float> logits(h.rows(), vocab_size());
    forward(h, logits);
    return logits;
  }

  // h float [N, d], dlogits float [N, V] -> dh [N, d] = dlogits float(W) (written);
  // weight_grad() += dlogits^T h (dense; with trainable rows, their rows only);
  // bias_grad() += column sums of dlogits. A frozen W or bias
  // takes nothing (dh is still computed; a frozen W skips the dW product).
  // \throws shape_error on any mismatch, a bias whose length is no longer W's V included;
  // gradients (their dense flag too) and dh unchanged on throw.
  void backward(const ConstMatrixRef<float>& h, const ConstMatrixRef<float>& dlogits, MatrixRef<float> dh) {
    const char* where = "LowPrecisionOutputProjection::backward";
    // Check before dense_accumulator(), which switches the gradient to dense mode.
    detail::check_shape(where, "h", h, h.rows(), dim());
    detail::check_shape(where, "dlogits", dlogits, h.rows(), vocab_size());
    detail::check_shape(where, "dh", dh, h.rows(), dim());
    if (bias_) detail::check_shape(where, "bias", bias_->value(), vocab_size(), 1);  // W or the bias resized alone
    const auto* trainable = weight_->frozen() ? nullptr : weight_->trainable_rows();
    auto dW = weight_->frozen() || trainable ? Eigen::Map<RowMatrix<float>>(nullptr, 0, dim())
                                             : weight_->grad().dense_accumulator();
    // A row mask: dW on the trainable rows only; every buffer allocated before a value changes.
    std::vector<float> gathered;
    if (trainable) gathered.reserve(static_cast<std::size_t>(h.rows()) * trainable->size());
    auto dW_rows = trainable ? weight_->grad().masked_accumulator() : Eigen::Map<RowMatrix<float>>(nullptr, 0, dim());
    auto db = bias_ && !bias_->frozen() ? bias_->grad().dense_accumulator()
                                        : Eigen::Map<RowMatrix<float>>(nullptr, 0, 1);
    if (trainable)  // before dh is written: dh may be h
      detail::add_masked_rows_dW<float>(h, dlogits.data(), dlogits.outerStride(), trainable->data(),
                                        static_cast<Index>(trainable->size()), dW_rows.data(), dim(), gathered);
    detail::output_projection_backward<Storage>(h, weight_value(), dlogits, dh, dW, db, workspace_, where);
  }
  RowMatrix<float> backward(const ConstMatrixRef<float>& h, const ConstMatrixRef<float>& dlogits) {
    detail::check_shape("LowPrecisionOutputProjection::backward", "h", h, h.rows(), dim());
    RowMatrix<float> dh(h.rows(), dim());
    backward(h, dlogits, dh);
    return dh;
  }

 private:
  template <typename WeightRef>
  static void validate(const WeightRef& W, const ConstMatrixRef<float>& bias) {
    detail::check_size("LowPrecisionOutputProjection", "V", W.rows());
    detail::check_size("LowPrecisionOutputProjection", "d", W.cols());
    if (bias.size() != 0) detail::check_shape("LowPrecisionOutputProjection", "bias", bias, W.rows(), 1);
  }
  static std::shared_ptr<Parameter<float>> make_bias(const ConstMatrixRef<float>& bias) {
    if (bias.size() == 0) return nullptr;
    return std::make_shared<Parameter<float>>(RowMatrix<float>(bias), "lm_head.bias");
  }
  std::unique_ptr<RowGradient<float>> make_absent_bias_grad() const {
    return bias_ ? nullptr : std::make_unique<RowGradient<float>>(vocab_size(), 1);
  }
  // Replaces the gradient only when W's rows changed since it was made (see bias_grad).
  RowGradient<float>& absent_bias_grad() const {
    if (!absent_bias_grad_ || absent_bias_grad_->rows() != vocab_size()) absent_bias_grad_ = make_absent_bias_grad();
    return *absent_bias_grad_;
  }
  Eigen::Map<const RowMatrix<Storage>> weight_value() const {
    return static_cast<const ParameterType&>(*weight_).value();
  }
  Eigen::Map<const RowMatrix<float>> bias_view() const {
    if (bias_) return static_cast<const Parameter<float>&>(*bias_).value();
    return {nullptr, 0, 1};
  }

  std::shared_ptr<ParameterType> weight_;
  std::shared_ptr<Parameter<float>> bias_;
  // What bias_grad() returns without a bias: never touched by the layer, made with it (null with a
  // bias). Held by pointer (a gradient keeps its shape, so moving a layer of another V into this
  // one could not assign it). Mutable: a const bias_grad() after W's rows changed replaces it.
  mutable std::unique_ptr<RowGradient<float>> absent_bias_grad_;
  HeadTileWorkspace workspace_;
};

}  // namespace embedhead

#endif  // EMBEDHEAD_LOW_PRECISION_HPP
