// embedhead internal: the oneDNN backend of the GEMM seam (detail/gemm.hpp), for bf16 products.
//
//   C [M, N] (float)  (init)  op(A) [M, K] (bf16) op(B) [K, N] (bf16),  each product of two bf16
//                             values exact in float, the sums accumulated in float
//
// One chunk of the seam is one oneDNN matmul on the calling thread: src = op(A), weights = op(B),
// dst = C, every operand described in place by its strides (a col_major operand is the transpose
// of a row-major one, never copied or reordered). Init::zero writes C; Init::keep adds to it
// through a sum post-op; Init::bias starts C as 1 b^T (gemm::start) and adds the same way. On a
// CPU with AMX, oneDNN 2.6 dispatches its AMX kernels (brg:avx512_core_amx_bf16), with AVX512_BF16 its
// vdpbf16ps kernels; onednn_matmul_kernel() names the one it runs. Products in float (A and B
// float) go to the Eigen backend: this backend exists for the bf16 ones.
//
// Threads: each call sets the calling thread's OpenMP thread count to 1 around the primitive's
// creation and execution, and restores it, inside the seam's threaded chunks and outside alike: a
// primitive fixes its blocking (and any split of the sum) for the thread count current when it
// is made, so every primitive is made and run for one thread, a chunk's sums do not depend on how
// many threads exist or which thread made it, and the seam's fixed chunks keep results
// bit-identical for any thread count. This needs OpenMP in the translation unit (the CMake target
// embedhead::onednn carries it; oneDNN itself runs on OpenMP).
//
// Primitives: one matmul primitive per distinct problem (shape, strides, layouts, sum or not),
// made on first use and kept per thread (creating one costs far more than a small product), at
// most kMaxPrimitives a thread (then the thread's cache starts over: the last token chunk's row
// count varies with the batch); oneDNN also keeps its own process-wide cache of them.
//
// usable(): whether oneDNN runs bf16 products on native bf16 instructions here -- its kernels
// for head-sized products in the three layouts the fused loss uses (logits: A row-major, B
// transposed; dW: both row-major; dh: A transposed) all name bf16: AMX's
// brg:avx512_core_amx_bf16 or AVX512_BF16's brg:avx512_core_bf16 -- decided once per process.
// Where it does not (no AVX-512, or only oneDNN's emulation), the library's bf16 entry points
// (fused_head_loss.hpp) take DefaultBackend instead: the float GEMM on the rounded values, the
// same products within float rounding, slower than fp32, rather than throw mid-pass. A
// dnnl::error after that (a primitive oneDNN cannot make for some other shape, or memory) is
// thrown inside the seam's chunks, where OpenMP ends the program (detail/parallel.hpp).
//
// Compiled only with EMBEDHEAD_HAVE_ONEDNN (linking embedhead::onednn); detail/gemm.hpp includes
// it then and makes it gemm::MixedBackend. Every translation unit of a program must agree.
// gemm.hpp first, outside the guard: it includes this header at its end and defines
// gemm::MixedBackend after it, so this header included on its own must go through gemm.hpp.
#include "gemm.hpp"

#ifndef EMBEDHEAD_DETAIL_GEMM_ONEDNN_HPP
#define EMBEDHEAD_DETAIL_GEMM_ONEDNN_HPP

#ifdef EMBEDHEAD_HAVE_ONEDNN

#include <oneapi/dnnl/dnnl.hpp>

#ifdef _OPENMP
#include <omp.h>
#else
#error "embedhead's oneDNN backend needs OpenMP (compile with -fopenmp; the target embedhead::onednn does)"
#endif

#include <array>
#include <map>
#include <string>

namespace embedhead {
namespace detail {
namespace gemm {

struct OneDnnBackend {
  template <typename Scalar, typename BStorage, typename AStorage = Scalar>
  static constexpr bool takes = std::conjunction_v<std::is_same<Scalar, float>, std::is_same<BStorage, Eigen::bfloat16>,
                                                   std::is_same<AStorage, Eigen::bfloat16>>;

  static constexpr bool any_chunking = false;  // oneDNN picks its kernel and blocking by shape
  static bool usable() {
    static const bool native = [] {
      try {
        OneThread one_thread;
        const Index M = 256, N = 768, K = 1024;
        for (const Key& key : {Key{M, K, N, N, N, K, true, false, false}, Key{K, N, M, M, N, N, true, true, true},
                               Key{M, N, K, M, N, N, false, true, true}})
          if (make_entry(key).name.find("bf16") == std::string::npos) return false;
        return true;
      } catch (const dnnl::error&) {
        return false;
      }
    }();
    return native;
  }

  template <Kernel kKernel, typename Scalar, Layout LA, Layout LB, typename BStorage, typename AStorage>
  static void multiply(const Op<Scalar, LA, LB, BStorage, AStorage>& op) {
    if constexpr (!takes<Scalar, BStorage, AStorage>) {
      EigenBackend::template multiply<kKernel>(op);
    } else {
      if (op.M == 0 || op.N == 0) return;
      if (op.init != Init::zero || op.K == 0) start(op);
      if (op.K == 0) return;  // an empty sum: oneDNN rejects K = 0
      // A stride of a single stored row is arbitrary in an Eigen view: use the dense one.
      auto ld = [](Index ld_given, Index stored_rows, Index stored_cols) {
        return stored_rows <= 1 ? std::max<Index>(stored_cols, 1) : ld_given;
      };
      const Index lda = LA == Layout::row_major ? ld(op.lda, op.M, op.K) : ld(op.lda, op.K, op.M);
      const Index ldb = LB == Layout::row_major ? ld(op.ldb, op.K, op.N) : ld(op.ldb, op.N, op.K);
      const Index ldc = ld(op.ldc, op.M, op.N);
      const bool sum = op.init != Init::zero;
      const Key key{op.M, op.N, op.K, lda, ldb, ldc, LA == Layout::row_major, LB == Layout::row_major, sum};
      OneThread one_thread;
      Cache& cache = cache_of_this_thread();
      auto found = cache.entries.find(key);
      if (found == cache.entries.end()) {
        if (cache.entries.size() >= kMaxPrimitives) cache.entries.clear();
        found = cache.entries.emplace(key, make_entry(key)).first;
      }
      const Entry& entry = found->second;
      const dnnl::engine& cpu = engine();
      dnnl::memory src(entry.src, cpu, const_cast<AStorage*>(op.a));
      dnnl::memory weights(entry.weights, cpu, const_cast<BStorage*>(op.b));
      dnnl::memory dst(entry.dst, cpu, op.c);
      entry.matmul.execute(cache.stream, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, weights}, {DNNL_ARG_DST, dst}});
      cache.stream.wait();
    }
  }

  // The implementation oneDNN picks for a bf16 product of this shape (A row-major, B transposed)
  // on this CPU (e.g. "brg:avx512_core_amx_bf16"); throws dnnl::error where it has none (a CPU
  // without AVX-512).
  static std::string kernel_name(Index M = 256, Index N = 1024, Index K = 768) {
    OneThread one_thread;
    return make_entry(Key{M, N, K, K, K, N, true, false, false}).name;
  }

 private:
  static constexpr std::size_t kMaxPrimitives = 256;
  // M, N, K, lda, ldb, ldc, A row-major, B row-major, sum post-op.
  using Key = std::array<Index, 9>;
  struct Entry {
    dnnl::matmul matmul;
    dnnl::memory::desc src, weights, dst;
    std::string name;
  };
  struct Cache {
    dnnl::stream stream{engine()};
    std::map<Key, Entry> entries;
  };

  // The calling thread's OpenMP thread count 1 while this object lives (for oneDNN's primitive
  // creation and execution), then restored.
  struct OneThread {
    int saved = 0;
    OneThread() : saved(omp_get_max_threads()) {
      if (saved != 1) omp_set_num_threads(1);
    }
    ~OneThread() {
      if (saved != 1) omp_set_num_threads(saved);
    }
    OneThread(const OneThread&) = delete;
    OneThread& operator=(const OneThread&) = delete;
  };

  static const dnnl::engine& engine() {
    static const dnnl::engine cpu(dnnl::engine::kind::cpu, 0);
    return cpu;
  }
  static Cache& cache_of_this_thread() {
    thread_local Cache cache;
    return cache;
  }

  static Entry make_entry(const Key& key) {
    using dt = dnnl::memory::data_type;
    const Index M = key[0], N = key[1], K = key[2], lda = key[3], ldb = key[4], ldc = key[5];
    const bool a_row = key[6] != 0, b_row = key[7] != 0, sum = key[8] != 0;
    // op(A) [M, K]: element (m, k) at m * lda + k (row-major) or m + k * lda (col_major).
    const dnnl::memory::desc src({M, K}, dt::bf16, a_row ? dnnl::memory::dims{lda, 1} : dnnl::memory::dims{1, lda});
    const dnnl::memory::desc weights({K, N}, dt::bf16, b_row ? dnnl::memory::dims{ldb, 1} : dnnl::memory::dims{1, ldb});
    const dnnl::memory::desc dst({M, N}, dt::f32, {ldc, 1});
    dnnl::primitive_attr attr;
    if (sum) {
      dnnl::post_ops ops;
      ops.append_sum(1.0f);
      attr.set_post_ops(ops);
    }
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src, weights, dst), attr, engine());
    return Entry{dnnl::matmul(pd), src, weights, dst, pd.impl_info_str()};
  }
};

}  // namespace gemm
}  // namespace detail
}  // namespace embedhead

#endif  // EMBEDHEAD_HAVE_ONEDNN

#endif  // EMBEDHEAD_DETAIL_GEMM_ONEDNN_HPP
