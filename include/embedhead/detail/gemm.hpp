// embedhead internal: the one entry point for the library's matrix products. No API promise.
//
//   C [M, N]  =  op(A) [M, K] op(B) [K, N]                  Init::zero
//   C [M, N] +=  op(A) [M, K] op(B) [K, N]                  Init::keep
//   C [M, N]  =  1 b^T + op(A) [M, K] op(B) [K, N]          Init::bias   (b [N], strided)
//
// C is row-major with leading dimension ldc. Each operand is a view of memory that is already
// there, given by pointer, leading dimension and Layout: Layout::row_major [rows, cols] is
// X[i * ld + j], Layout::col_major is X[i + j * ld], i.e. the transpose of a row-major matrix --
// so W^T for W [V, d] row-major is (W.data(), ld = d, col_major), a view, never a copy.
// A and B may be stored in bf16 or fp16 with C in float (mixed precision, see below).
//
// run<Kernel>(op, plan) cuts C into fixed chunks along plan.split (rows M or columns N of C),
// chunk k covering [k * plan.chunk, min((k + 1) * plan.chunk, extent)), and computes each chunk
// as one product of its own rows / columns on one thread. The chunk bounds depend on the shapes
// and plan.chunk only, and the backend's arithmetic for a chunk on the chunk's operands only, so
// every element of C is bit-identical for any thread count, with or without OpenMP. With
// plan.threaded (and OpenMP, two chunks or more, not already inside a parallel region) the chunks
// are handed to the OpenMP threads one at a time (detail::parallel_chunks); otherwise they run in
// order on the calling thread. An optional epilogue(begin, end) runs on the same thread right
// after chunk [begin, end)'s product (soft-capping, a bias gradient's sums); op.c == nullptr skips
// the products and runs the epilogues alone (a frozen W's dW with db still wanted).
//
// Kernels (how one chunk is computed; a backend without the distinction uses its GEMM for all):
//   Kernel::gemm        Eigen backend: Eigen's GEMM kernel (general_matrix_matrix_product) for
//                       every chunk whatever its shape, called with no parallel info (Eigen would
//                       otherwise split a large product over its own threads, and its split and
//                       cache blocking, which fix the summation order, would follow the threads).
//   Kernel::expression  Eigen backend: what Eigen's `C.noalias() (+)= op(A) * op(B)` computes on
//                       one thread: coefficient-wise below M + N + K = 20, matrix-vector when M or
//                       N is 1, else the same GEMM kernel (never Eigen's threaded split).
//   Kernel::decode      1 <= M <= kDecodeMaxTokens rows of A row-major, B = W^T (col_major): one
//                       pass over W's rows, lanes rows at a time transposed in registers, each
//                       logit by the packed GEMM's sequence (gemm::packed_decode), on every backend.
// The head and geometry use Kernel::gemm, the fused loss Kernel::expression, decoding
// Kernel::decode. The packed backend (the default) runs gemm and expression alike, the CBLAS
// backend as one sgemm / dgemm a chunk. On the packed backend a token's logits are therefore the
// same bits from the decode path, from a batch of any size and from the fused loss (batch
// invariance); on the Eigen and CBLAS backends the decode path's logits may differ in the last bits
// from a batch's.
//
// Backends are types chosen at compile time (run<Kernel, Backend>). DefaultBackend is
// PackedBackend, the library's own kernel (detail/gemm_packed.hpp); EigenBackend when the program
// defines EMBEDHEAD_GEMM_EIGEN; CblasBackend when it defines EMBEDHEAD_GEMM_CBLAS (the CMake target
// embedhead::cblas, which links a serial OpenBLAS or BLIS; docs/performance.md, "GEMM backends").
// Every translation unit of a program must agree. The packed kernel computes every element of C by
// one fixed sequence of multiply-adds that depends on K and the element's own operands only,
// so on it results do not depend on the chunking either: a row of logits is the same bits in any
// batch (any_chunking below; tests/gemm_test.cpp checks the sequence bit for bit).
//
// Mixed precision (B, and for backends that take it A, stored as Eigen::bfloat16 / Eigen::half, C
// float): the packed backend widens them (exactly) while it packs them. On a backend that does not
// take B's storage, inside each chunk B is widened kWidenTileRows of its stored rows at a time into
// a float tile, one tile per thread, and each tile is one float product of the backend: with op(B)
// col_major (B = W^T, W's rows are columns of C) a tile covers kWidenTileRows columns of the chunk;
// with op(B) row_major (W's rows are the summation index k) a tile covers kWidenTileRows values of
// k and the tiles are added into C in increasing k. Tile bounds are multiples of kWidenTileRows
// from the chunk's start and the chunk bounds are fixed, so the result does not depend on the
// threads either. Scratch: threads * kWidenTileRows * (K or the chunk's columns) floats in the
// caller's vector, grown only when too small; never a float copy of B.
//
// A backend provides
//   template <Kernel, typename Scalar, Layout LA, Layout LB, ...> static void multiply(const Op<...>&)
//       one chunk, Init included, on the calling thread, never threading by itself;
//   template <typename Scalar, typename BStorage, typename AStorage> static constexpr bool takes
//       whether multiply accepts B stored as BStorage and A as AStorage themselves (else run
//       widens B's tiles to Scalar; A below Scalar needs a backend that takes it);
//   static bool usable()  whether it can run here (oneDNN's bf16 kernels need AVX-512; the bf16
//                         entry points take DefaultBackend instead when it is false);
//   static constexpr bool any_chunking  whether its results are the same for any chunking of C
//                         (then per_thread_plan may choose the chunks by the thread count).
// The seam owns the chunking, so a new backend (CBLAS, oneDNN bf16, a hand-written kernel) only
// has to compute a chunk; results then depend on the backend and the build, never on the threads.
#ifndef EMBEDHEAD_DETAIL_GEMM_HPP
#define EMBEDHEAD_DETAIL_GEMM_HPP

#include "../types.hpp"
#include "gemm_op.hpp"
#include "gemm_packed.hpp"
#include "parallel.hpp"

#include <Eigen/Core>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(EMBEDHEAD_GEMM_CBLAS)
#include <cblas.h>

#include <limits>
#include <mutex>
#endif

namespace embedhead {
namespace detail {

// ---- the chunk plans of the library's products (tuned on the project's machine, bench/RESULTS.md) ----

// The LM head (output_projection.hpp), at GPT-2 shape:
//   kHeadVocabChunk   rows of W (columns of logits, rows of dW and db) per chunk
//   kHeadTokenChunk   rows of dh (tokens) per chunk of dh = dlogits W, a sum over all of V
// and below kHeadMinFlops (2 N V d) the chunks run on the calling thread.
constexpr Index kHeadVocabChunk = 1024;
constexpr Index kHeadTokenChunk = 256;
// On a backend whose results do not depend on the chunking, dh's chunks are one per thread, along
// its rows (tokens) when each thread gets at least kHeadMinThreadRows of them, else along d.
constexpr Index kHeadMinThreadRows = 64;
constexpr double kHeadMinFlops = 4.0e6;

// The decode path (output_projection_decode) handles 1 to kDecodeMaxTokens tokens in one pass
// over W; kDecodeVocabChunk rows of W per chunk, threaded from kDecodeMinElements = V d.
constexpr Index kDecodeMaxTokens = 8;
constexpr Index kDecodeVocabChunk = 1024;
constexpr Index kDecodeMinElements = Index{1} << 18;

// The fused head loss (fused_head_loss.hpp): rows of a W block per logits / dW product, and
// columns of d per dh product.
constexpr Index kFusedRowPiece = 256;
constexpr Index kFusedDimPiece = 128;
// Its token-chunk plan: rows of W per logits / dW product (tried on the project's machine at GPT-2
// shape, 256 tokens a chunk: 256 rows 3.8-4.5 s a step on 1 thread, 1024 rows 3.2-3.8 s, 2048 and
// 4096 no better), the default bytes of logits a chunk may hold, and the fewest tokens per
// chunk at which the automatic choice takes it over the two-pass vocabulary blocks (below that, dW
// += dz^T h has too short a sum over tokens to run at GEMM speed).
constexpr Index kFusedChunkPiece = 1024;
constexpr Index kFusedDefaultBudget = Index{64} << 20;
constexpr Index kFusedMinTokenChunk = 128;

// Mixed precision: stored rows of B widened per float tile. 256 x 768 floats = 768 KiB at
// GPT-2's d, within a 1 MiB L2, and each tile product is still [N, d] x [d, 256] (or
// [256, 256] x [256, d]), large enough for Eigen's kernels.
constexpr Index kWidenTileRows = 256;

// ---- widening bf16 / fp16 to float ----

// src [d] (Storage) -> dst [d] = scale * float(src): Eigen's cast expression, used for fp16 when the
// compiler does not target F16C. half -> float is exact, so every path gives the same floats.
template <typename Storage>
inline void widen_row(const Storage* src, Index d, float scale, float* dst) {
  const Eigen::Map<const Eigen::Array<Storage, 1, Eigen::Dynamic>> in(src, d);
  Eigen::Map<Eigen::Array<float, 1, Eigen::Dynamic>> out(dst, d);
  if (scale == 1.0f)
    out = in.template cast<float>();
  else
    out = scale * in.template cast<float>();
}
#if defined(__F16C__)
// fp16 with F16C (-mf16c, or -march= any x86-64 since 2012): 8 values per vcvtph2ps, then the tail.
inline void widen_row(const Eigen::half* src, Index d, float scale, float* dst) {
  const __m256 s = _mm256_set1_ps(scale);
  Index j = 0;
  for (; j + 8 <= d; j += 8) {
    const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j)));
    _mm256_storeu_ps(dst + j, scale == 1.0f ? v : _mm256_mul_ps(s, v));
  }
  for (; j < d; ++j) dst[j] = scale == 1.0f ? static_cast<float>(src[j]) : scale * static_cast<float>(src[j]);
}
#endif
// bf16 is the upper half of a float, so widening is a 16-bit shift of the raw bits. Written out
// here because Eigen's bfloat16_to_float stores into half of a float through a pointer, which GCC
// does not vectorise; this loop becomes zero-extend + shift, 16 values per AVX-512 instruction.
inline void widen_row(const Eigen::bfloat16* src, Index d, float scale, float* dst) {
  for (Index j = 0; j < d; ++j) {
    const std::uint32_t bits = static_cast<std::uint32_t>(Eigen::numext::bit_cast<std::uint16_t>(src[j])) << 16;
    float value;
    std::memcpy(&value, &bits, sizeof value);
    dst[j] = scale == 1.0f ? value : scale * value;
  }
}

// ---- decode kernel: few tokens, one pass over W ----

// The decode kernel (gemm::packed_decode, detail/gemm_packed.hpp: the packed GEMM's sequence, so a
// token's logits are the same bits as in any batch on the packed backend) with the token count as
// a run-time value in [1, kDecodeMaxTokens].
template <typename Scalar, typename WStorage = Scalar>
void decode_rows(Index tokens, const Scalar* h, Index ldh, const WStorage* W, Index ldw, Index d, const Scalar* bias,
                 Index ldb, Scalar* logits, Index ldl, Index v0, Index v1) {
  static_assert(kDecodeMaxTokens == 8, "the switch below lists 1 ... kDecodeMaxTokens");
  switch (tokens) {
    case 1: return gemm::packed_decode<1, Scalar, WStorage>(h, ldh, W, ldw, d, bias, ldb, logits, ldl, v0, v1);
    case 2: return gemm::packed_decode<2, Scalar, WStorage>(h, ldh, W, ldw, d, bias, ldb, logits, ldl, v0, v1);
    case 3: return gemm::packed_decode<3, Scalar, WStorage>(h, ldh, W, ldw, d, bias, ldb, logits, ldl, v0, v1);
    case 4: return gemm::packed_decode<4, Scalar, WStorage>(h, ldh, W, ldw, d, bias, ldb, logits, ldl, v0, v1);
    case 5: return gemm::packed_decode<5, Scalar, WStorage>(h, ldh, W, ldw, d, bias, ldb, logits, ldl, v0, v1);
    case 6: return gemm::packed_decode<6, Scalar, WStorage>(h, ldh, W, ldw, d, bias, ldb, logits, ldl, v0, v1);
    case 7: return gemm::packed_decode<7, Scalar, WStorage>(h, ldh, W, ldw, d, bias, ldb, logits, ldl, v0, v1);
    case 8: return gemm::packed_decode<8, Scalar, WStorage>(h, ldh, W, ldw, d, bias, ldb, logits, ldl, v0, v1);
    default: return;  // unreachable: the callers check the range
  }
}

namespace gemm {

constexpr int eigen_order(Layout layout) { return layout == Layout::row_major ? Eigen::RowMajor : Eigen::ColMajor; }

// The Eigen backend: Eigen 3.3/3.4's internal general_matrix_matrix_product (no API promise from
// Eigen), its expression products and the decode kernel, each on the calling thread. Packing
// buffers go on the stack up to EIGEN_STACK_ALLOCATION_LIMIT and on the heap above, as in Eigen.
struct EigenBackend {
  template <typename Scalar, typename BStorage, typename AStorage = Scalar>
  static constexpr bool takes = std::conjunction_v<std::is_same<Scalar, BStorage>, std::is_same<Scalar, AStorage>>;
  static bool usable() { return true; }
  static constexpr bool any_chunking = false;  // Eigen's blocking (the summation order) follows the chunk's shape

  // C += op(A) op(B) by Eigen's GEMM kernel, whatever the shape; no Init.
  template <typename Scalar, Layout LA, Layout LB>
  static void gemm_add(const Op<Scalar, LA, LB>& op) {
    if (op.M == 0 || op.N == 0 || op.K == 0) return;
    using Product = Eigen::internal::general_matrix_matrix_product<Index, Scalar, eigen_order(LA), false, Scalar,
                                                                   eigen_order(LB), false, Eigen::RowMajor, 1>;
    Eigen::internal::gemm_blocking_space<Eigen::RowMajor, Scalar, Scalar, Eigen::Dynamic, Eigen::Dynamic,
                                         Eigen::Dynamic>
        blocking(op.M, op.N, op.K, 1, true);
    Product::run(op.M, op.N, op.K, op.a, op.lda, op.b, op.ldb, op.c, 1, op.ldc, Scalar(1), blocking, nullptr);
  }

  // Eigen's `C.noalias() (+)= op(A) * op(B)` on one thread: its own coefficient-wise and
  // matrix-vector paths for small and vector shapes (never threaded by Eigen), and gemm_add where
  // Eigen would run its GEMM (the same kernel, blocking and alpha, minus Eigen's threaded split).
  template <typename Scalar, Layout LA, Layout LB>
  static void expression(const Op<Scalar, LA, LB>& op) {
    const Index M = op.M, N = op.N, K = op.K;
    if (M == 0 || N == 0) return;
    const bool coefficient_wise = K > 0 && K + M + N < EIGEN_GEMM_TO_COEFFBASED_THRESHOLD;
    const bool vector = K > 0 && (M == 1 || N == 1);
    if (!coefficient_wise && !vector) {
      start(op);
      gemm_add(op);
      return;
    }
    // The operands as the row-major views (transposed for col_major) the callers' expressions had.
    using RowMap = Eigen::Map<const RowMatrix<Scalar>, 0, Eigen::OuterStride<>>;
    const RowMap a(op.a, LA == Layout::row_major ? M : K, LA == Layout::row_major ? K : M,
                   Eigen::OuterStride<>(op.lda));
    const RowMap b(op.b, LB == Layout::row_major ? K : N, LB == Layout::row_major ? N : K,
                   Eigen::OuterStride<>(op.ldb));
    Eigen::Map<RowMatrix<Scalar>, 0, Eigen::OuterStride<>> c(op.c, M, N, Eigen::OuterStride<>(op.ldc));
    auto product = [&](auto&& lhs, auto&& rhs) {
      if (op.init == Init::zero) {
        c.noalias() = lhs * rhs;
      } else {
        start(op);
        c.noalias() += lhs * rhs;
      }
    };
    if constexpr (LA == Layout::row_major && LB == Layout::row_major) product(a, b);
    if constexpr (LA == Layout::row_major && LB == Layout::col_major) product(a, b.transpose());
    if constexpr (LA == Layout::col_major && LB == Layout::row_major) product(a.transpose(), b);
    if constexpr (LA == Layout::col_major && LB == Layout::col_major) product(a.transpose(), b.transpose());
  }

  // One chunk, Init included.
  template <Kernel kKernel, typename Scalar, Layout LA, Layout LB>
  static void multiply(const Op<Scalar, LA, LB>& op) {
    if constexpr (kKernel == Kernel::decode) {
      static_assert(LA == Layout::row_major && LB == Layout::col_major, "decode: A = h row-major, op(B) = W^T");
      if (op.M == 0 || op.N == 0) return;
      const Scalar* bias = op.init == Init::bias ? op.bias : nullptr;
      decode_rows<Scalar>(op.M, op.a, op.lda, op.b, op.ldb, op.K, bias, op.bias_stride, op.c, op.ldc, 0, op.N);
    } else if constexpr (kKernel == Kernel::expression) {
      expression(op);
    } else {
      start(op);
      gemm_add(op);
    }
  }
};

#if defined(EMBEDHEAD_GEMM_CBLAS)
// The CBLAS backend (defined by linking the CMake target embedhead::cblas; every translation unit
// of a program must agree): each chunk of Kernel::gemm and Kernel::expression is one cblas_sgemm /
// cblas_dgemm on the calling thread, C = op(A) op(B) + beta C with beta = 0 for Init::zero (C is
// not read), else 1 after start(). Kernel::decode stays the library's own kernel (few tokens:
// bandwidth, not flops), so decoding is the same on every backend. Results are independent of the
// thread count only if the BLAS computes a call on the calling thread alone, as the serial builds
// that embedhead::cblas links do (Debian's libopenblas-serial-dev, libblis-serial-dev): the seam's
// fixed chunks then fix every sum. A dimension or leading dimension beyond the BLAS's int goes
// to the Eigen backend instead, as does a view CBLAS cannot describe (rows that overlap).
//
// The calls are made one at a time (one mutex for the program): Debian's serial OpenBLAS 0.3.21
// is not safe to call from two threads at once -- the fused loss's token chunks on 2 OpenMP
// threads gave a different loss on each run (8.553 against 8.523) until the calls were
// serialised. So on this backend the products do not run in parallel; what runs beside them
// (softmax rows, epilogues, lookups) still does. The same lock is taken for BLIS, whose serial
// build's safety under concurrent calls was not established.
struct CblasBackend {
  template <typename Scalar, typename BStorage, typename AStorage = Scalar>
  static constexpr bool takes = std::conjunction_v<std::is_same<Scalar, BStorage>, std::is_same<Scalar, AStorage>>;
  static bool usable() { return true; }
  static constexpr bool any_chunking = false;  // the BLAS's blocking may follow the chunk's shape

  // The leading dimension CBLAS is given for a row-major stored [rows, cols] operand: ld itself,
  // or cols for a single stored row (whose ld is never used, and may be anything in an Eigen view);
  // 0 when CBLAS cannot take it (overlapping rows, or beyond its int).
  static int blas_ld(Index ld, Index rows, Index cols) {
    const Index needed = std::max<Index>(cols, 1);
    const Index value = rows <= 1 ? needed : ld;
    return value < needed || value > std::numeric_limits<int>::max() ? 0 : static_cast<int>(value);
  }

  static std::mutex& call_mutex() {
    static std::mutex mutex;
    return mutex;
  }

  template <Kernel kKernel, typename Scalar, Layout LA, Layout LB>
  static void multiply(const Op<Scalar, LA, LB>& op) {
    static_assert(std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>, "CBLAS: float or double");
    constexpr Index kMaxInt = std::numeric_limits<int>::max();
    // The stored shapes: op(A) [M, K] is A [M, K] row_major or [K, M] col_major; likewise op(B).
    const int lda = LA == Layout::row_major ? blas_ld(op.lda, op.M, op.K) : blas_ld(op.lda, op.K, op.M);
    const int ldb = LB == Layout::row_major ? blas_ld(op.ldb, op.K, op.N) : blas_ld(op.ldb, op.N, op.K);
    const int ldc = blas_ld(op.ldc, op.M, op.N);
    const bool fits = op.M <= kMaxInt && op.N <= kMaxInt && op.K <= kMaxInt && lda > 0 && ldb > 0 && ldc > 0;
    if (kKernel == Kernel::decode || !fits) return EigenBackend::template multiply<kKernel>(op);
    if (op.M == 0 || op.N == 0) return;
    // beta = 0 writes C without reading it (Init::zero); otherwise C starts as start() leaves it.
    const bool overwrite = op.init == Init::zero && op.K > 0;
    if (!overwrite) start(op);
    if (op.K == 0) return;
    const CBLAS_TRANSPOSE ta = LA == Layout::row_major ? CblasNoTrans : CblasTrans;
    const CBLAS_TRANSPOSE tb = LB == Layout::row_major ? CblasNoTrans : CblasTrans;
    const int M = static_cast<int>(op.M), N = static_cast<int>(op.N), K = static_cast<int>(op.K);
    const std::lock_guard<std::mutex> one_at_a_time(call_mutex());
    if constexpr (std::is_same_v<Scalar, float>)
      cblas_sgemm(CblasRowMajor, ta, tb, M, N, K, 1.0f, op.a, lda, op.b, ldb, overwrite ? 0.0f : 1.0f, op.c, ldc);
    else
      cblas_dgemm(CblasRowMajor, ta, tb, M, N, K, 1.0, op.a, lda, op.b, ldb, overwrite ? 0.0 : 1.0, op.c, ldc);
  }
};
#endif

// The library's own kernel (detail/gemm_packed.hpp): every element of C by one fixed sequence of
// multiply-adds (fused where the build has FMA) that depends on K and its own operands only, so results are the same
// for any batch, chunking and thread count. It takes A and B stored as bf16 / fp16 itself (widened while packed), so
// the bf16 fused loss on it holds its rounded dz in bf16. Kernel::gemm and Kernel::expression are the same on it;
// Kernel::decode is the decode kernel.
struct PackedBackend {
  // An operand stored as Scalar, or as bf16 / fp16 with Scalar float.
  template <typename Scalar, typename Storage>
  static constexpr bool widens = std::is_same_v<Scalar, Storage> ||
                                 (std::is_same_v<Scalar, float> &&
                                  (std::is_same_v<Storage, Eigen::bfloat16> || std::is_same_v<Storage, Eigen::half>));
  template <typename Scalar, typename BStorage, typename AStorage = Scalar>
  static constexpr bool takes = widens<Scalar, BStorage>&& widens<Scalar, AStorage>;
  static bool usable() { return true; }
  static constexpr bool any_chunking = true;  // an element's arithmetic depends on K and its operands only

  template <Kernel kKernel, typename Scalar, Layout LA, Layout LB, typename BStorage, typename AStorage>
  static void multiply(const Op<Scalar, LA, LB, BStorage, AStorage>& op) {
    if constexpr (kKernel == Kernel::decode) {
      static_assert(LA == Layout::row_major && LB == Layout::col_major, "decode: A = h row-major, op(B) = W^T");
      static_assert(std::is_same_v<Scalar, AStorage>, "decode: h stored as Scalar (W may be bf16 / fp16)");
      if (op.M == 0 || op.N == 0) return;
      const Scalar* bias = op.init == Init::bias ? op.bias : nullptr;
      decode_rows<Scalar, BStorage>(op.M, op.a, op.lda, op.b, op.ldb, op.K, bias, op.bias_stride, op.c, op.ldc, 0,
                                    op.N);
    } else {
      packed_gemm(op);
    }
  }
};

// The backend of every product unless the build chooses another: CBLAS when EMBEDHEAD_GEMM_CBLAS
// is defined (the target embedhead::cblas), Eigen's kernel when EMBEDHEAD_GEMM_EIGEN is defined,
// else the library's own kernel.
#if defined(EMBEDHEAD_GEMM_CBLAS)
using DefaultBackend = CblasBackend;
#elif defined(EMBEDHEAD_GEMM_EIGEN)
using DefaultBackend = EigenBackend;
#else
using DefaultBackend = PackedBackend;
#endif

// Mixed precision, one chunk: op's B widened kWidenTileRows stored rows at a time into tile
// (kWidenTileRows * (K or N) floats), each tile one float product of the backend.
template <Kernel kKernel, typename Backend, Layout LA, Layout LB, typename BStorage>
void multiply_widened(const Op<float, LA, LB, BStorage>& op, float* tile) {
  auto as_float = [&](const Op<float, LA, LB, BStorage>& part, const float* b, Index ldb) {
    Op<float, LA, LB> widened{part.M, part.N, part.K,   part.a,    part.lda,  b,
                              ldb,    part.c, part.ldc, part.init, part.bias, part.bias_stride};
    Backend::template multiply<kKernel>(widened);
  };
  if constexpr (LB == Layout::col_major) {
    // B's stored rows are columns n of C: a tile is kWidenTileRows columns, K values each.
    for (Index n0 = 0; n0 < op.N; n0 += kWidenTileRows) {
      const Index cols = std::min(kWidenTileRows, op.N - n0);
      const auto part = cols_of(op, n0, cols);
      if (op.K > 0)
        for (Index n = 0; n < cols; ++n) widen_row(part.b + n * part.ldb, op.K, 1.0f, tile + n * op.K);
      as_float(part, op.K > 0 ? tile : nullptr, op.K);
    }
  } else {
    // B's stored rows are summation indices k: a tile is kWidenTileRows of them, N values each,
    // added into C in increasing k (the first tile applies op.init).
    if (op.K == 0) return as_float(op, nullptr, op.N);
    for (Index k0 = 0; k0 < op.K; k0 += kWidenTileRows) {
      const Index depth = std::min(kWidenTileRows, op.K - k0);
      auto part = depth_of(op, k0, depth);
      if (k0 > 0) part.init = Init::keep;
      for (Index k = 0; k < depth; ++k) widen_row(part.b + k * part.ldb, op.N, 1.0f, tile + k * op.N);
      as_float(part, tile, op.N);
    }
  }
}

struct NoEpilogue {
  void operator()(Index, Index) const {}
};

// C (init) op(A) op(B) by the chunks of plan (see the top of this file); epilogue(begin, end) after
// each chunk's product. tiles: the float scratch of a mixed-precision op (ignored otherwise).
// \pre op's views cover their [M, K], [K, N], [M, N] extents; C aliases neither A nor B. No checks:
// the public functions check first. Nothing allocated but the backend's packing buffers (the packed
// kernel's per thread, grown once; Eigen's per call) and, for mixed precision on a backend that
// does not take the storage, tiles' growth.
template <Kernel kKernel, typename Backend = DefaultBackend, typename Scalar, Layout LA, Layout LB, typename BStorage,
          typename AStorage, typename Epilogue = NoEpilogue>
void run(const Op<Scalar, LA, LB, BStorage, AStorage>& op, const Plan& plan, const Epilogue& epilogue = {},
         std::vector<float>* tiles = nullptr) {
  const Index extent = plan.split == Split::rows ? op.M : op.N;
  constexpr bool widen = !std::is_same_v<Scalar, BStorage> && !Backend::template takes<Scalar, BStorage, AStorage>;
  static_assert(std::is_same_v<Scalar, AStorage> || Backend::template takes<Scalar, BStorage, AStorage>,
                "A stored below Scalar needs a backend that takes it (MixedBackend); only B is ever widened");
  float* scratch = nullptr;
  Index tile_floats = 0;
  if constexpr (widen) {
    static_assert(std::is_same_v<Scalar, float>, "mixed precision: A and C are float");
    // One tile per thread: kWidenTileRows stored rows of B (fewer if B has fewer), each K (col_major)
    // or the chunk's columns (row_major) long.
    const Index stored_rows = LB == Layout::col_major ? op.N : op.K;
    const Index row_length = LB == Layout::col_major ? op.K
                                                     : (plan.split == Split::cols ? std::min(plan.chunk, op.N) : op.N);
    tile_floats = std::min(kWidenTileRows, stored_rows) * row_length;
    const std::size_t needed = static_cast<std::size_t>(chunk_threads(extent, plan.chunk, plan.threaded) * tile_floats);
    if (op.c) {
      if (tiles->size() < needed) tiles->resize(needed);
      scratch = tiles->data();
    }
  } else {
    (void)tiles;
  }
  parallel_chunks_slotted(extent, plan.chunk, plan.threaded, [&](Index begin, Index end, Index slot) {
    if (op.c) {
      const auto part = plan.split == Split::rows ? rows_of(op, begin, end - begin) : cols_of(op, begin, end - begin);
      if constexpr (widen)
        multiply_widened<kKernel, Backend>(part, scratch + slot * tile_floats);
      else
        Backend::template multiply<kKernel>(part);
    }
    epilogue(begin, end);
  });
}

// The plan of a product whose every chunk reads all of one operand (dh = dz W: a chunk of rows of
// dh packs all of W; dW = dz^T h: a chunk of rows of dW packs all of h). On a backend whose results
// do not depend on the chunking (any_chunking), one chunk per thread that run() would use: along
// the rows of C when each thread gets at least min_rows of them, else along its columns; so the
// shared operand is packed once per thread instead of once per fixed chunk. With rows_only (a
// caller whose epilogue sums over rows of C), `fixed` where the rows are too few. On any other
// backend, `fixed`, whose chunks are what keeps its results independent of the thread count.
template <typename Backend>
Plan per_thread_plan(Index M, Index N, Index min_rows, const Plan& fixed, bool rows_only = false) {
  if constexpr (!Backend::any_chunking) {
    (void)M, (void)N, (void)min_rows, (void)rows_only;
    return fixed;
  } else {
    const Index threads = fixed.threaded ? chunk_threads(std::max<Index>(M, N), 1, true) : 1;
    if (threads <= 1) return Plan{Split::rows, std::max<Index>(M, 1), false};
    if (M >= threads * min_rows) return Plan{Split::rows, (M + threads - 1) / threads, true};
    if (rows_only) return fixed;
    // Columns in multiples of 64 (whole tiles and cache lines of C for every build's tile width).
    constexpr Index kColumnGrain = 64;
    const Index columns = (N + threads - 1) / threads;
    return Plan{Split::cols, (columns + kColumnGrain - 1) / kColumnGrain * kColumnGrain, true};
  }
}

// Columns of C per chunk for a product cut along its columns only, every chunk packing all of A
// (the logits of a block of W's rows): on a backend whose results do not depend on the chunking
// (any_chunking), one chunk per thread in whole tiles of the packed kernel (32 columns with
// AVX-512: a block of 704 columns splits 352 / 352 on two threads, where 64-column grains would give
// 384 / 320), so A is packed once per thread; on any other backend, `fixed`.
template <typename Scalar, typename Backend = DefaultBackend>
Index per_thread_columns(Index width, Index fixed) {
  if constexpr (!Backend::any_chunking) {
    (void)width;
    return fixed;
  } else {
    constexpr Index grain = PackedTile<Scalar>::cols;
    const Index threads = chunk_threads(width, grain, true);
    return std::max<Index>(grain, ((width + threads - 1) / threads + grain - 1) / grain * grain);
  }
}

// One product on the calling thread, for a caller whose fixed chunks carry more than a product
// (geometry's top-k scan of each score block) and are driven by the caller itself.
template <Kernel kKernel, typename Backend = DefaultBackend, typename Scalar, Layout LA, Layout LB>
void multiply(const Op<Scalar, LA, LB>& op) {
  Backend::template multiply<kKernel>(op);
}

}  // namespace gemm
}  // namespace detail
}  // namespace embedhead

#if defined(EMBEDHEAD_HAVE_ONEDNN)
#include "gemm_onednn.hpp"
#endif

namespace embedhead {
namespace detail {
namespace gemm {
// The backend of bf16 mixed-precision products (A and B stored in bf16, C float; the fused loss's
// bf16 overloads): oneDNN when EMBEDHEAD_HAVE_ONEDNN is defined (the target embedhead::onednn),
// else DefaultBackend, whose operands are then float holding bf16-rounded values (B widened in
// tiles): the same products, at float GEMM speed.
#if defined(EMBEDHEAD_HAVE_ONEDNN)
using MixedBackend = OneDnnBackend;
#else
using MixedBackend = DefaultBackend;
#endif
// Whether T is one of the seam's backends (a type with takes<float, float, float> and usable()).
template <typename T, typename = void>
struct is_backend : std::false_type {};
template <typename T>
struct is_backend<T, std::void_t<decltype(T::template takes<float, float, float>), decltype(T::usable())>>
    : std::true_type {};
}  // namespace gemm
}  // namespace detail
}  // namespace embedhead

#endif  // EMBEDHEAD_DETAIL_GEMM_HPP
