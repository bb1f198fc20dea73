// embedhead (optional backend): the LM head's forward GEMM in bf16 through oneDNN.
//
//   logits [N, V] (fp32) = bf16(h) [N, d] * W^T + b,   W [V, d] stored as bf16 (the nn.Linear
//                                                       layout), b [V] fp32 or none
//
// Products of bf16 inputs are accumulated in fp32 by oneDNN's matmul (on CPUs with avx512_bf16 it
// uses the vdpbf16ps dot-product instructions). The only rounding beyond an fp32 GEMM is that of
// the inputs to bf16 (8 significant bits): |error| <= about 2^-8 * sum_j |h_j W_vj| per logit.
//
// Not part of the header-only core: it needs oneDNN (Debian: libdnnl-dev) and is compiled only
// when EMBEDHEAD_HAVE_ONEDNN is defined, which linking the CMake target embedhead::onednn does
// (option EMBEDHEAD_WITH_ONEDNN). embedhead.hpp does not include it.
#ifndef EMBEDHEAD_BACKENDS_ONEDNN_HEAD_HPP
#define EMBEDHEAD_BACKENDS_ONEDNN_HEAD_HPP

#ifdef EMBEDHEAD_HAVE_ONEDNN

#include "../detail/checks.hpp"
#include "../errors.hpp"
#include "../types.hpp"

#include <Eigen/Core>
#include <oneapi/dnnl/dnnl.hpp>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <array>
#include <map>
#include <sstream>
#include <unordered_map>

namespace embedhead {

using bfloat16 = Eigen::bfloat16;

// Read-only and writable views of row-major bf16 matrices (rows may be strided).
using ConstBf16Ref = Eigen::Ref<const RowMatrix<bfloat16>>;
using Bf16Ref = Eigen::Ref<RowMatrix<bfloat16>>;

// x [rows, cols] fp32 -> out [rows, cols] bf16, rounded to nearest even (Eigen's conversion).
// As PyTorch's x.to(torch.bfloat16) (c10::BFloat16's round to nearest even): a finite value at or
// beyond 2^128 - 2^119 ~ 3.3962e38 in magnitude (half-way from bf16's largest, 3.3895e38, to
// 2^128) becomes +-inf, without an error; NaN and +-inf stay what they are. convert_table
// (low_precision.hpp) refuses such a value with a value_error instead: use it, or check
// x.cwiseAbs().maxCoeff() first, when an infinity must not appear silently.
// \throws shape_error if out's shape differs. For converting a head's W once: W_bf16 = to_bf16(W).
inline void to_bf16(const ConstMatrixRef<float>& x, Bf16Ref out) {
  detail::check_shape("to_bf16", "out", out, x.rows(), x.cols());
  out = x.cast<bfloat16>();
}
inline RowMatrix<bfloat16> to_bf16(const ConstMatrixRef<float>& x) {
  RowMatrix<bfloat16> out(x.rows(), x.cols());
  to_bf16(x, out);
  return out;
}

// The bf16 head GEMM. Holds a oneDNN CPU engine and stream, one matmul primitive per problem
// (shape, strides, bias or not; created on first use, then reused: creating one costs far more
// than a small GEMM), the bf16 copy of h when h is given in fp32, and a contiguous copy of a
// strided bias.
//
// Not thread-safe: one object per calling thread. oneDNN itself runs on the OpenMP threads of the
// process: omp_set_num_threads applies (a new primitive is made for a new thread count when this
// header is compiled with OpenMP; otherwise the count at the first call stays).
class OneDnnHead {
 public:
  OneDnnHead() : engine_(dnnl::engine::kind::cpu, 0), stream_(engine_) {}

  // h [N, d] fp32, W [V, d] bf16, bias [V, 1] fp32 or empty (0 rows: none) -> logits [N, V] fp32
  // = bf16(h) W^T + b. h is rounded to bf16 into a buffer kept for the next call.
  // \pre logits aliases neither h, W nor bias. \throws shape_error on any mismatch (nothing
  // written); dnnl::error if oneDNN cannot create the primitive (e.g. a CPU without AVX-512,
  // where oneDNN 2.6 has no bf16 matmul). Cost: N*d conversions + one GEMM, 2 N V d flops. W is
  // read in place through a transposed memory descriptor: never copied or reordered.
  void forward(const ConstMatrixRef<float>& h, const ConstBf16Ref& W, const ConstMatrixRef<float>& bias,
               MatrixRef<float> logits) {
    const char* where = "OneDnnHead::forward";
    check(where, h.rows(), h.cols(), W, bias, logits);
    if (h_bf16_.rows() != h.rows() || h_bf16_.cols() != h.cols()) h_bf16_.resize(h.rows(), h.cols());
    h_bf16_ = h.cast<bfloat16>();
    run(h_bf16_, W, bias, logits);
  }

  // The same with h already in bf16: h [N, d] bf16 -> logits [N, V] fp32 = h W^T + b.
  void forward(const ConstBf16Ref& h, const ConstBf16Ref& W, const ConstMatrixRef<float>& bias,
               MatrixRef<float> logits) {
    check("OneDnnHead::forward", h.rows(), h.cols(), W, bias, logits);
    run(h, W, bias, logits);
  }

  // The number of matmul primitives created so far (one per distinct problem and thread count).
  std::size_t cached_primitives() const { return primitives_.size(); }

 private:
  using Key = std::array<Index, 8>;  // N, d, V, h stride, W stride, logits stride, has bias, threads

  static void check(const char* where, Index N, Index d_h, const ConstBf16Ref& W, const ConstMatrixRef<float>& bias,
                    const MatrixRef<float>& logits) {
    const Index V = W.rows(), d = W.cols();
    if (d_h != d) {
      std::ostringstream message;
      message << where << ": h has shape [" << N << ", " << d_h << "], expected [" << N << ", " << d
              << "] (d = W's columns; W is [" << V << ", " << d << "])";
      throw shape_error(message.str());
    }
    if (bias.size() != 0) detail::check_shape(where, "bias", bias, V, 1);
    detail::check_shape(where, "logits", logits, N, V);
  }

  void run(const ConstBf16Ref& h, const ConstBf16Ref& W, const ConstMatrixRef<float>& bias, MatrixRef<float> logits) {
    using dt = dnnl::memory::data_type;
    const Index N = h.rows(), d = h.cols(), V = W.rows();
    if (N == 0 || V == 0) return;
    if (d == 0) {  // an empty sum: oneDNN rejects zero-sized K
      if (bias.size() != 0)
        logits.rowwise() = bias.col(0).transpose();
      else
        logits.setZero();
      return;
    }
    const bool has_bias = bias.size() != 0;
    // oneDNN 2.6's brgemm matmul reads the bias as contiguous whatever strides its descriptor
    // gives (measured: wrong logits for a bias column of a two-column matrix), so a strided
    // bias is copied first (V floats).
    const float* bias_data = bias.data();
    if (has_bias && V > 1 && bias.outerStride() != 1) {
      bias_copy_ = bias;
      bias_data = bias_copy_.data();
    }
    // A stride of a one-row or one-column view is arbitrary in Eigen; use the dense one there.
    const Index h_stride = N > 1 ? h.outerStride() : d;
    const Index W_stride = V > 1 ? W.outerStride() : d;
    const Index logits_stride = N > 1 ? logits.outerStride() : V;
    // A oneDNN primitive splits its work for the thread count current when it was created, and
    // keeps that split (measured: a primitive made on 1 thread ran no faster on 2), so the count
    // is part of the key. Without OpenMP in this translation unit it cannot change at run time.
#ifdef _OPENMP
    const Index threads = omp_get_max_threads();
#else
    const Index threads = 0;
#endif
    const Key key{N, d, V, h_stride, W_stride, logits_stride, has_bias ? 1 : 0, threads};
    auto found = primitives_.find(key);
    if (found == primitives_.end()) {
      // src [N, d] row-major; weights [d, V] with strides {1, W_stride}: W [V, d] row-major read as
      // its transpose, no copy; dst [N, V] row-major; bias [1, V] broadcast over rows.
      const dnnl::memory::desc src_md({N, d}, dt::bf16, {h_stride, 1});
      const dnnl::memory::desc weights_md({d, V}, dt::bf16, {1, W_stride});
      const dnnl::memory::desc dst_md({N, V}, dt::f32, {logits_stride, 1});
      const dnnl::memory::desc bias_md({1, V}, dt::f32, {V, 1});
      const auto desc = has_bias ? dnnl::matmul::desc(src_md, weights_md, bias_md, dst_md)
                                 : dnnl::matmul::desc(src_md, weights_md, dst_md);
      const dnnl::matmul::primitive_desc pd(desc, engine_);
      found = primitives_.emplace(key, Entry{dnnl::matmul(pd), src_md, weights_md, dst_md, bias_md}).first;
    }
    const Entry& entry = found->second;
    dnnl::memory src(entry.src, engine_, const_cast<bfloat16*>(h.data()));
    dnnl::memory weights(entry.weights, engine_, const_cast<bfloat16*>(W.data()));
    dnnl::memory dst(entry.dst, engine_, logits.data());
    std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, weights}, {DNNL_ARG_DST, dst}};
    if (has_bias) args.emplace(DNNL_ARG_BIAS, dnnl::memory(entry.bias, engine_, const_cast<float*>(bias_data)));
    entry.matmul.execute(stream_, args);
    stream_.wait();
  }

  struct Entry {
    dnnl::matmul matmul;
    dnnl::memory::desc src, weights, dst, bias;
  };

  dnnl::engine engine_;
  dnnl::stream stream_;
  std::map<Key, Entry> primitives_;
  RowMatrix<bfloat16> h_bf16_;
  RowMatrix<float> bias_copy_;
};

}  // namespace embedhead

#endif  // EMBEDHEAD_HAVE_ONEDNN

#endif  // EMBEDHEAD_BACKENDS_ONEDNN_HEAD_HPP
