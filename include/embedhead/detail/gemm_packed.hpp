// embedhead internal: the library's own GEMM kernel, the default backend of the seam (gemm.hpp).
// No API promise.
//
//   C [M, N] (init) op(A) [M, K] op(B) [K, N], every element by one fixed sequence of operations:
//
//     s_b      = fma(a[k_b + kc_b - 1] b[...], ... fma(a[k_b] b[k_b], 0))   k in block b, increasing
//     C[i, j]  = s_0 (Init::zero, Init::bias) or C[i, j] + s_0 (Init::keep)
//     C[i, j]  = C[i, j] + s_b                                               b = 1, 2, ... in order
//     C[i, j]  = C[i, j] + bias[j]                                           Init::bias, last
//
//   with the summation index cut into blocks of kPackedDepth = 256 from k = 0 (the last one
//   shorter) and fma the packet multiply-add of the build: one rounding where the target has a
//   fused multiply-add (x86 with -mfma / -march=haswell and later or AVX-512, AArch64 NEON, POWER
//   VSX), a product and a sum rounded apart otherwise (the portable x86-64 build: SSE2);
//   packed_gemm_fuses() says which.
//
// That sequence depends on K and the element's own operands only: not on M or N, not on where
// the element falls in the kernel's tiles, not on the chunk or thread that computes it. So a row of
// C (a token's logits, a row of dh) is bitwise the same whatever the batch it is computed in, any
// chunking of the seam gives the same bits, and a scalar loop written from the lines above
// (std::fma where the build fuses) reproduces the kernel exactly (tests/gemm_test.cpp does).
//
// How (the BLIS / GotoBLAS structure, on Eigen's packet primitives so that one source serves
// AVX-512, AVX2, SSE and NEON): op(B) is copied, kPackedDepth rows by up to kPackedCols columns at a
// time, into panels of kPackedTile::cols columns stored k-major (the panel's row k is cols
// consecutive values); op(A), kPackedRows rows at a time, into panels of kPackedTile::rows rows
// stored k-major. The micro-kernel keeps a rows x cols tile of C in registers (rows x packets
// accumulators), and for each k loads the panel's packets of B once, broadcasts each of the rows
// values of A and multiply-adds: rows x packets FMAs per rows + packets loads. Tiles at the edges of
// C (fewer rows or columns) run the same micro-kernel on zero-padded panels into a tile buffer, so
// they follow the same sequence. An operand stored as bf16 / fp16 is widened (exactly) while it is
// packed.
//
// Tile shape: 8 rows x 2 packets with 32 vector registers (AVX-512: 8 x 32 floats, 16 accumulators;
// a B panel of 256 x 32 floats is 32 KiB, in L1), 6 x 2 packets with 16 (AVX2: 6 x 16 floats, 12
// accumulators), 4 x 4 scalars without vectorisation. Tried on the project's AMD EPYC (Zen 5) at
// GPT-2 shape, whole products: 8 x 32 and 8 x 48 ran at 178-183 GFLOP/s, 6 x 64 and 10 x 32 at
// 171-175, 12 x 32 and 14 x 32 at 165-173 (bench/RESULTS.md, "Issue 14, third session").
#ifndef EMBEDHEAD_DETAIL_GEMM_PACKED_HPP
#define EMBEDHEAD_DETAIL_GEMM_PACKED_HPP

#include "../types.hpp"
#include "gemm_op.hpp"

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace embedhead {
namespace detail {
namespace gemm {

// The summation block: part of the arithmetic above (changing it changes results).
constexpr Index kPackedDepth = 256;
// Cache blocking only (results do not depend on them): rows of op(A) a micro-kernel sweep reads from
// L2 (240 x 256 floats = 240 KiB, a multiple of every tile's rows), rows of op(A) packed in one pass
// (five such blocks: a pass reads up to 1200 consecutive values of each stored row of a
// column-major A, such as dz^T in dW = dz^T h, instead of 240 from rows far apart), and columns of
// op(B) packed at once (256 x 1024 floats = 1 MiB).
constexpr Index kPackedRows = 240;
constexpr Index kPackedPassRows = 5 * kPackedRows;
constexpr Index kPackedCols = 1024;
// op(B) is packed whole depth at a time when that is at most this many scalars (4 MiB of floats:
// K up to 1024 at 1024 columns, as the head's forward is for d <= 1024 and its dW for N <= 1365
// tokens at d = 768), so that C is swept once for all the depth blocks instead of once per block;
// longer sums (dh = dz W over V) a block at a time.
constexpr Index kPackedWholeB = Index{1} << 20;

// Whether the build's packet multiply-add rounds once (a fused multiply-add): Eigen's pmadd is
// _mm*_fmadd_* on x86 with FMA (EIGEN_VECTORIZE_FMA, always set with AVX-512), vfmaq on NEON with
// __ARM_FEATURE_FMA (every AArch64 target) and vec_madd on POWER (fused); unvectorised builds use
// the scalar branch of packed_madd, std::fma where the target has FMA.
constexpr bool packed_gemm_fuses() {
#if defined(EIGEN_VECTORIZE_FMA) || (defined(EIGEN_VECTORIZE_NEON) && defined(__ARM_FEATURE_FMA)) || \
    defined(EIGEN_VECTORIZE_VSX) || defined(EIGEN_VECTORIZE_ALTIVEC) || defined(__FMA__) || defined(__ARM_FEATURE_FMA)
  return true;
#else
  return false;
#endif
}

template <typename Scalar>
struct PackedTile {
  using Packet = typename Eigen::internal::packet_traits<Scalar>::type;
  static constexpr int lanes = Eigen::internal::unpacket_traits<Packet>::size;
  static constexpr bool vectorised = lanes > 1;
  static constexpr bool wide = EIGEN_ARCH_DEFAULT_NUMBER_OF_REGISTERS >= 32;
  static constexpr int rows = vectorised ? (wide ? 8 : 6) : 4;
  static constexpr int packets = vectorised ? 2 : 4;
  static constexpr int cols = packets * lanes;
  // The blocking assumes whole panels: row blocks of A and column blocks of B are multiples of
  // the tile (pack offsets p0 / rows, and B's whole-depth blocks at k0 * nc_padded <= k0 * nc_max).
  static_assert(kPackedRows % rows == 0 && kPackedPassRows % rows == 0 && kPackedCols % cols == 0,
                "kPackedRows, kPackedPassRows and kPackedCols must be multiples of the tile");
};

// a b + c as the packet multiply-add of the build (one rounding where packed_gemm_fuses()).
template <typename Packet>
EIGEN_STRONG_INLINE Packet packed_madd(const Packet& a, const Packet& b, const Packet& c) {
  if constexpr (std::is_floating_point_v<Packet>) {
    if constexpr (packed_gemm_fuses()) {
      return std::fma(a, b, c);
    } else {
      // No fused multiply-add on this target, so the compiler cannot contract these two roundings.
      const Packet product = a * b;
      return product + c;
    }
  } else {
    return Eigen::internal::pmadd(a, b, c);
  }
}

// The value of stored element x as Scalar (exact for bf16 / fp16 to float).
template <typename Scalar, typename Storage>
EIGEN_STRONG_INLINE Scalar packed_value(const Storage& x) {
  return static_cast<Scalar>(x);
}

// How a tile's accumulators are written to C: C = acc (store), C = C + acc (add); then, with a bias
// panel (the last block of Init::bias), C = C + bias.
enum class TileWrite { store, add };

// The micro-kernel: the rows x cols tile of C at c (leading dimension ldc, every entry present)
// written from the depth-kc products of panels a (kc x rows, k-major) and b (kc x cols, k-major).
template <typename Scalar>
EIGEN_ALWAYS_INLINE void packed_tile(Index kc, const Scalar* a, const Scalar* b, Scalar* c, Index ldc, TileWrite write,
                                     const Scalar* bias) {
  using Tile = PackedTile<Scalar>;
  using Packet = typename Tile::Packet;
  constexpr int R = Tile::rows, P = Tile::packets, L = Tile::lanes;
  using namespace Eigen::internal;
  // The tile of C is read and written after the loop; its lines are fetched meanwhile.
  for (int i = 0; i < R; ++i)
    for (int p = 0; p < P; p += std::max(1, 64 / int(L * sizeof(Scalar)))) prefetch(c + i * ldc + p * L);
  Packet acc[R][P];
  for (int i = 0; i < R; ++i)
    for (int p = 0; p < P; ++p) acc[i][p] = pset1<Packet>(Scalar(0));
  for (Index k = 0; k < kc; ++k) {
    Packet bk[P];
    for (int p = 0; p < P; ++p) bk[p] = ploadu<Packet>(b + p * L);
    for (int i = 0; i < R; ++i) {
      const Packet ai = pset1<Packet>(a[i]);
      for (int p = 0; p < P; ++p) acc[i][p] = packed_madd(ai, bk[p], acc[i][p]);
    }
    a += R;
    b += Tile::cols;
  }
  for (int i = 0; i < R; ++i)
    for (int p = 0; p < P; ++p) {
      Scalar* out = c + i * ldc + p * L;
      Packet value = write == TileWrite::store ? acc[i][p] : padd(ploadu<Packet>(out), acc[i][p]);
      if (bias) value = padd(value, ploadu<Packet>(bias + p * L));
      pstoreu(out, value);
    }
}

// Packs of op(A) and op(B). Where the values to copy are consecutive in memory (op(A) col_major,
// op(B) row_major), a panel row is a short copy; where they are not (op(A) row_major: tokens' rows of
// h or dz; op(B) col_major: rows of W), blocks of lanes x lanes values are transposed in registers
// (Eigen's ptranspose) when the storage is Scalar and the panel width is a multiple of the lanes or
// half of them; otherwise, and at the edges, value by value. Either way the panel holds the same
// values: the packs change no arithmetic.

// The rows x lanes values src[r * ld + k] (r < rows, k < lanes) -> dst[k * dst_ld + r], with rows
// = lanes (the whole packet stored) or lanes / 2 (each half of the transposed packet to its own
// destination: rows 0 .. lanes/2 - 1 to dst, the rest to dst_high).
template <typename Scalar>
EIGEN_ALWAYS_INLINE void transpose_lanes(const Scalar* src, Index ld, Scalar* dst, Scalar* dst_high, Index dst_ld) {
  using Tile = PackedTile<Scalar>;
  using Packet = typename Tile::Packet;
  constexpr int L = Tile::lanes;
#if defined(__GNUC__)
#pragma GCC diagnostic push
// Packet is a vector type (__m512, ...); GCC warns that its alignment attribute is dropped in the
// template argument, as Eigen's own PacketBlock uses do (Eigen silences it inside its headers).
#pragma GCC diagnostic ignored "-Wignored-attributes"
#endif
  Eigen::internal::PacketBlock<Packet, L> block;
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif
  for (int r = 0; r < L; ++r) block.packet[r] = Eigen::internal::ploadu<Packet>(src + r * ld);
  Eigen::internal::ptranspose(block);
  for (int k = 0; k < L; ++k) {
    if (dst_high == nullptr) {
      Eigen::internal::pstoreu(dst + k * dst_ld, block.packet[k]);
    } else {
      alignas(64) Scalar lanes[L];
      Eigen::internal::pstore(lanes, block.packet[k]);
      std::copy_n(lanes, L / 2, dst + k * dst_ld);
      std::copy_n(lanes + L / 2, L / 2, dst_high + k * dst_ld);
    }
  }
}

// op(A) rows [i0, i0 + mc), depth [k0, k0 + kc) -> panels of PackedTile::rows rows, k-major, the
// last panel zero-padded.
template <typename Scalar, Layout LA, typename AStorage>
void pack_a(const AStorage* a, Index lda, Index i0, Index mc, Index k0, Index kc, Scalar* out) {
  using Tile = PackedTile<Scalar>;
  constexpr Index R = Tile::rows, L = Tile::lanes;
  const Index panels = (mc + R - 1) / R;
  if constexpr (LA == Layout::col_major) {
    // op(A)[i, k] = a[i + k * lda]: panel row k is R consecutive values of stored row k0 + k. In
    // groups of kRowGroup stored rows (in L1 while they are read) panel by panel, so that each
    // panel is written kRowGroup * R consecutive values at a time.
    constexpr Index kRowGroup = 16;
    for (Index g0 = 0; g0 < kc; g0 += kRowGroup) {
      const Index g1 = std::min(kc, g0 + kRowGroup);
      for (Index p = 0; p < panels; ++p) {
        const Index rows = std::min(R, mc - p * R);
        for (Index k = g0; k < g1; ++k) {
          const AStorage* src = a + (k0 + k) * lda + i0 + p * R;
          Scalar* dst = out + p * kc * R + k * R;
          if (rows == R) {
            for (Index i = 0; i < R; ++i) dst[i] = packed_value<Scalar>(src[i]);  // a fixed-size copy
            continue;
          }
          for (Index i = 0; i < rows; ++i) dst[i] = packed_value<Scalar>(src[i]);
          for (Index i = rows; i < R; ++i) dst[i] = Scalar(0);
        }
      }
    }
  } else {
    // op(A)[i, k] = a[i * lda + k]: panel column i is part of stored row i0 + i.
    Index p = 0;
    if constexpr (std::is_same_v<AStorage, Scalar> && Tile::vectorised && (R == L || 2 * R == L)) {
      constexpr Index group = L / R;  // panels per block of L rows
      const Index body = kc - kc % L;
      for (; (p + group) * R <= mc; p += group) {
        const Scalar* src = a + (i0 + p * R) * lda + k0;
        Scalar* dst = out + p * kc * R;
        for (Index k = 0; k < body; k += L)
          transpose_lanes(src + k, lda, dst + k * R, group == 2 ? dst + kc * R + k * R : static_cast<Scalar*>(nullptr),
                          R);
        for (Index k = body; k < kc; ++k)
          for (Index i = 0; i < group * R; ++i) dst[(i / R) * kc * R + k * R + i % R] = src[i * lda + k];
      }
    }
    for (; p < panels; ++p) {
      const Index rows = std::min(R, mc - p * R);
      Scalar* dst = out + p * kc * R;
      for (Index i = 0; i < rows; ++i) {
        const AStorage* src = a + (i0 + p * R + i) * lda + k0;
        for (Index k = 0; k < kc; ++k) dst[k * R + i] = packed_value<Scalar>(src[k]);
      }
      for (Index i = rows; i < R; ++i)
        for (Index k = 0; k < kc; ++k) dst[k * R + i] = Scalar(0);
    }
  }
}

// op(B) depth [k0, k0 + kc), columns [j0, j0 + nc) -> panels of PackedTile::cols columns, k-major,
// the last panel zero-padded.
template <typename Scalar, Layout LB, typename BStorage>
void pack_b(const BStorage* b, Index ldb, Index k0, Index kc, Index j0, Index nc, Scalar* out) {
  using Tile = PackedTile<Scalar>;
  constexpr Index C = Tile::cols, L = Tile::lanes;
  const Index panels = (nc + C - 1) / C;
  if constexpr (LB == Layout::row_major) {
    // op(B)[k, j] = b[k * ldb + j]: panel row k is C consecutive values of stored row k0 + k.
    for (Index k = 0; k < kc; ++k) {
      const BStorage* src = b + (k0 + k) * ldb + j0;
      for (Index q = 0; q < panels; ++q) {
        Scalar* dst = out + q * kc * C + k * C;
        const Index cols = std::min(C, nc - q * C);
        if (cols == C) {
          for (Index j = 0; j < C; ++j) dst[j] = packed_value<Scalar>(src[q * C + j]);  // a fixed-size copy
          continue;
        }
        for (Index j = 0; j < cols; ++j) dst[j] = packed_value<Scalar>(src[q * C + j]);
        for (Index j = cols; j < C; ++j) dst[j] = Scalar(0);
      }
    }
  } else {
    // op(B)[k, j] = b[k + j * ldb] (B = W^T): panel column j is part of stored row j0 + j. Whole
    // groups of L stored rows are transposed L x L at a time, the rest value by value.
    for (Index q = 0; q < panels; ++q) {
      Scalar* dst = out + q * kc * C;
      const Index cols = std::min(C, nc - q * C);
      Index j = 0;
      if constexpr (std::is_same_v<BStorage, Scalar> && Tile::vectorised) {
        const Index body = kc - kc % L;
        for (; j + L <= cols; j += L) {
          const Scalar* src = b + (j0 + q * C + j) * ldb + k0;
          for (Index k = 0; k < body; k += L)
            transpose_lanes(src + k, ldb, dst + k * C + j, static_cast<Scalar*>(nullptr), C);
          for (Index k = body; k < kc; ++k)
            for (Index jj = 0; jj < L; ++jj) dst[k * C + j + jj] = src[jj * ldb + k];
        }
      }
      for (; j < cols; ++j) {
        const BStorage* src = b + (j0 + q * C + j) * ldb + k0;
        for (Index k = 0; k < kc; ++k) dst[k * C + j] = packed_value<Scalar>(src[k]);
      }
      for (; j < C; ++j)
        for (Index k = 0; k < kc; ++k) dst[k * C + j] = Scalar(0);
    }
  }
}

// The packing buffers of one thread, grown on first use and kept (thread_local).
template <typename Scalar>
struct PackBuffers {
  std::vector<Scalar> a, b, bias;
  static PackBuffers& of_this_thread() {
    static thread_local PackBuffers buffers;
    return buffers;
  }
};

// One product on the calling thread (the seam's chunk), Init included; see the top of this file.
// \pre the views cover their extents; C aliases neither A nor B.
template <typename Scalar, Layout LA, Layout LB, typename BStorage, typename AStorage>
void packed_gemm(const Op<Scalar, LA, LB, BStorage, AStorage>& op) {
  using Tile = PackedTile<Scalar>;
  constexpr Index R = Tile::rows, C = Tile::cols;
  const Index M = op.M, N = op.N, K = op.K;
  if (M == 0 || N == 0) return;
  if (K == 0) return start(op);  // no sum: 0, the bias, or C as it is

  PackBuffers<Scalar>& buffers = PackBuffers<Scalar>::of_this_thread();
  const Index ma_max = std::min(kPackedPassRows, (M + R - 1) / R * R);
  const Index nc_max = std::min(kPackedCols, (N + C - 1) / C * C);
  const Index kc_max = std::min(kPackedDepth, K);
  // Whether all of op(B)'s depth for a block of columns fits kPackedWholeB scalars.
  const bool whole_depth = K * nc_max <= kPackedWholeB;
  auto grow = [](std::vector<Scalar>& v, Index size) {
    if (static_cast<Index>(v.size()) < size) v.resize(static_cast<std::size_t>(size));
  };
  grow(buffers.a, ma_max * kc_max);
  grow(buffers.b, nc_max * (whole_depth ? K : kc_max));
  if (op.init == Init::bias) grow(buffers.bias, nc_max);
  Scalar* packed_a = buffers.a.data();
  Scalar* packed_b = buffers.b.data();
  Scalar edge[R * C] = {};  // a tile at the edge of C, computed whole

  // Rows [a0, a0 + ma) of C, depth block [k0, k0 + kc), from B's block packed at b_block: op(A)'s
  // piece packed, then the micro-kernel over every tile (kPackedRows rows of A at a time, each
  // swept across B's panels).
  auto sweep = [&](Index a0, Index ma, Index j0, Index nc, Index k0, Index kc, const Scalar* b_block,
                   const Scalar* bias) {
    const bool first = k0 == 0, last = k0 + kc == K;
    const TileWrite write = first && op.init != Init::keep ? TileWrite::store : TileWrite::add;
    pack_a<Scalar, LA>(op.a, op.lda, a0, ma, k0, kc, packed_a);
    for (Index i0 = 0; i0 < ma; i0 += kPackedRows) {
      const Index mc = std::min(kPackedRows, ma - i0);
      for (Index q0 = 0; q0 < nc; q0 += C) {
        const Index cols = std::min(C, nc - q0);
        const Scalar* b_panel = b_block + (q0 / C) * kc * C;
        const Scalar* bias_panel = bias && last ? bias + q0 : nullptr;
        for (Index p0 = i0; p0 < i0 + mc; p0 += R) {
          const Index rows = std::min(R, ma - p0);
          const Scalar* a_panel = packed_a + (p0 / R) * kc * R;
          Scalar* c = op.c + (a0 + p0) * op.ldc + j0 + q0;
          if (rows == R && cols == C) {
            packed_tile(kc, a_panel, b_panel, c, op.ldc, write, bias_panel);
            continue;
          }
          // An edge tile: the same micro-kernel on the whole (zero-padded) panels, into edge.
          if (write == TileWrite::add)
            for (Index i = 0; i < rows; ++i) std::copy_n(c + i * op.ldc, cols, edge + i * C);
          packed_tile(kc, a_panel, b_panel, edge, C, write, bias_panel);
          for (Index i = 0; i < rows; ++i) std::copy_n(edge + i * C, cols, c + i * op.ldc);
        }
      }
    }
  };

  for (Index j0 = 0; j0 < N; j0 += kPackedCols) {
    const Index nc = std::min(kPackedCols, N - j0);
    const Index nc_padded = (nc + C - 1) / C * C;
    const Scalar* bias = nullptr;
    if (op.init == Init::bias) {
      // The bias of these columns, contiguous and zero-padded to whole panels.
      Scalar* packed_bias = buffers.bias.data();
      for (Index j = 0; j < nc; ++j) packed_bias[j] = op.bias[(j0 + j) * op.bias_stride];
      std::fill(packed_bias + nc, packed_bias + nc_padded, Scalar(0));
      bias = packed_bias;
    }
    if (whole_depth) {
      // All of op(B)'s depth for these columns packed first (block k0 at k0 * nc_padded), then C
      // a pass of rows at a time through every depth block: the pass's rows of C (up to 1200 x
      // 1024 values) stay in the last-level cache between the blocks (dW = dz^T h: rows of dW,
      // instead of all of dW once per block).
      for (Index k0 = 0; k0 < K; k0 += kPackedDepth)
        pack_b<Scalar, LB>(op.b, op.ldb, k0, std::min(kPackedDepth, K - k0), j0, nc, packed_b + k0 * nc_padded);
      for (Index a0 = 0; a0 < M; a0 += kPackedPassRows)
        for (Index k0 = 0; k0 < K; k0 += kPackedDepth)
          sweep(a0, std::min(kPackedPassRows, M - a0), j0, nc, k0, std::min(kPackedDepth, K - k0),
                packed_b + k0 * nc_padded, bias);
    } else {
      // A long sum (dh = dz W over all of V): one depth block of op(B) at a time, C a pass of rows
      // at a time through it.
      for (Index k0 = 0; k0 < K; k0 += kPackedDepth) {
        const Index kc = std::min(kPackedDepth, K - k0);
        pack_b<Scalar, LB>(op.b, op.ldb, k0, kc, j0, nc, packed_b);
        for (Index a0 = 0; a0 < M; a0 += kPackedPassRows)
          sweep(a0, std::min(kPackedPassRows, M - a0), j0, nc, k0, kc, packed_b, bias);
      }
    }
  }
}

// ---- decode: few tokens, one pass over W, the same sequence ----

// logits[t * ldl + v] = sum_k h[t * ldh + k] W[v * ldw + k] (+ bias[v * ldb]) for t < kTokens and
// v in [v0, v1): C = h W^T for a few tokens (the decode path), by exactly the sequence at the top
// of this file -- so a token's logits are the same bits from here, from packed_gemm in any batch,
// and from the fused loss. The GEMM vectorises across columns of C (rows of W) with k running
// sequentially, and so does this kernel: rows of W are taken lanes at a time, read lanes x lanes
// values at a time (each row's values consecutive) and transposed in registers (Eigen's
// ptranspose), so that packet j holds W[v .. v + lanes - 1][k + j]; each token's running sums then
// take fused multiply-adds k by k in increasing order, from zero at the start of each block of
// kPackedDepth, and the block sums are added to C in order, then the bias. W streams from memory
// once for all the tokens and nothing is packed: the transposed values live in registers only.
// Depth left over in a block (fewer than lanes values) and rows of W left over at the end (fewer
// than lanes rows) follow the same sequence value by value. The next rows of W are prefetched one
// cache line of each row per cache line of stored values (64 bytes, or lanes values if more).
//
// W may be stored as bf16 or fp16 (Scalar float): each packet is widened exactly as it is loaded,
// so the low-precision head's decode is the float decode on float(W), value for value. With bf16 W
// on AVX-512, bf16_columns_avx512 forms the same packets from the bf16 values directly (transposed
// as 32-bit pairs of bf16, widened by a shift or a mask): the transposition is the decode's main
// cost, and this one takes 32 shuffles per 16 x 16 values instead of 80. Only how the packets of W
// are formed differs; the multiply-adds are the same.

// A packet of Scalar from the lanes stored values at p (exact widening of bf16 / fp16).
template <typename Scalar, typename Storage>
EIGEN_STRONG_INLINE typename PackedTile<Scalar>::Packet load_widened(const Storage* p) {
  using Packet = typename PackedTile<Scalar>::Packet;
  constexpr int L = PackedTile<Scalar>::lanes;
  if constexpr (std::is_same_v<Scalar, Storage>) {
    return Eigen::internal::ploadu<Packet>(p);
  } else {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<Scalar, float> && L == 16) {  // Packet16f, __m512
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      if constexpr (std::is_same_v<Storage, Eigen::bfloat16>)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
      else
        return _mm512_cvtph_ps(raw);
    }
#endif
#if defined(__AVX2__)
    if constexpr (std::is_same_v<Scalar, float> && L == 8 && std::is_same_v<Storage, Eigen::bfloat16>) {  // __m256
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
    }
#endif
#if defined(__AVX2__) && defined(__F16C__)
    if constexpr (std::is_same_v<Scalar, float> && L == 8 && std::is_same_v<Storage, Eigen::half>)
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
    alignas(64) Scalar lanes[L];
    for (int i = 0; i < L; ++i) lanes[i] = packed_value<Scalar>(p[i]);
    return Eigen::internal::pload<Packet>(lanes);
  }
}

#if defined(__AVX512F__)
// bf16 W on AVX-512 (Scalar float, 16 lanes): col[j] = float(W[r][k + j]) for the rows r = 0 .. 15
// at w (lane r) and j = 0 .. 15, the same packets as load_widened and ptranspose give. Two
// neighbouring bf16 values of a row, the pair p = (W[r][k + 2p], W[r][k + 2p + 1]), make one 32-bit
// word, so the 16 x 16 bf16 block is a 16 x 8 block of words: it is transposed at 32-bit granularity
// into T[p] (lane r = pair p of row r), and each T[p] widens to two columns without a shuffle, since
// bf16 -> float places the 16 bits in the high half of the float: col[2p] = T[p] << 16 (the first
// value is the low half of the word) and col[2p + 1] = T[p] & 0xffff0000. The transpose:
//   1. 128-bit lanes: a row's 16 values are two lanes' worth, (r, 0) = pairs 0 .. 3 and (r, 1) =
//      pairs 4 .. 7. One 256-bit load and one 256-bit insert put rows i and 4 + i in a register,
//      another rows 8 + i and 12 + i; two shuffle_i32x4 of those give a[4q + i] = lanes (i, q),
//      (4 + i, q), (8 + i, q), (12 + i, q) for q = 0, 1: lane l of a[4q + i] is row 4l + i.
//   2. Within each 128-bit lane l, a[4q .. 4q + 3] hold the 4 x 4 words (rows 4l .. 4l + 3) x
//      (pairs 4q .. 4q + 3), transposed by unpacks of 32-bit then of 64-bit elements into
//      T[4q .. 4q + 3]: lane l of T[4q + c] is pair 4q + c of rows 4l .. 4l + 3, so T[p] lane r is
//      row r.
// Per 256 values: 8 inserts and 8 + 16 shuffles (32 shuffle-class operations) and 16 shifts / ands,
// against 16 widenings (shuffles, each with a shift) and Eigen's 16 x 16 float transpose (64
// shuffles) for load_widened and ptranspose.
EIGEN_ALWAYS_INLINE void bf16_columns_avx512(const Eigen::bfloat16* w, Index ldw, __m512 (&col)[16]) {
  auto row = [&](int r) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * ldw)); };
  __m512i a[8];
  for (int i = 0; i < 4; ++i) {
    const __m512i rows_i_4i = _mm512_inserti64x4(_mm512_castsi256_si512(row(i)), row(4 + i), 1);
    const __m512i rows_8i_12i = _mm512_inserti64x4(_mm512_castsi256_si512(row(8 + i)), row(12 + i), 1);
    a[i] = _mm512_shuffle_i32x4(rows_i_4i, rows_8i_12i, _MM_SHUFFLE(2, 0, 2, 0));      // quarters (., 0)
    a[4 + i] = _mm512_shuffle_i32x4(rows_i_4i, rows_8i_12i, _MM_SHUFFLE(3, 1, 3, 1));  // quarters (., 1)
  }
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int q = 0; q < 2; ++q) {
    const __m512i* x = a + 4 * q;
    const __m512i t0 = _mm512_unpacklo_epi32(x[0], x[1]), t1 = _mm512_unpackhi_epi32(x[0], x[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(x[2], x[3]), t3 = _mm512_unpackhi_epi32(x[2], x[3]);
    const __m512i pairs[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2),
                              _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)};
    for (int c = 0; c < 4; ++c) {
      const int p = 4 * q + c;
      col[2 * p] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs[c], 16));
      col[2 * p + 1] = _mm512_castsi512_ps(_mm512_and_si512(pairs[c], high));
    }
  }
}
#endif

template <int kTokens, typename Scalar, typename WStorage = Scalar>
void packed_decode(const Scalar* h, Index ldh, const WStorage* W, Index ldw, Index d, const Scalar* bias, Index ldb,
                   Scalar* logits, Index ldl, Index v0, Index v1) {
  using Tile = PackedTile<Scalar>;
  using Packet = typename Tile::Packet;
  constexpr int L = Tile::lanes;
  using namespace Eigen::internal;
  Index v = v0;
#if defined(__AVX512F__)
  constexpr bool kBf16Avx512 = std::is_same_v<Scalar, float> && std::is_same_v<WStorage, Eigen::bfloat16> && L == 16;
#endif
  if constexpr (Tile::vectorised) {
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"  // as in transpose_lanes
#endif
    for (; v + L <= v1; v += L) {
      const WStorage* w = W + v * ldw;
      const bool prefetch_next = v + 2 * L <= v1;
      Packet c[kTokens];
      for (int t = 0; t < kTokens; ++t) c[t] = pset1<Packet>(Scalar(0));
      for (Index k0 = 0; k0 < d; k0 += kPackedDepth) {
        const Index k1 = std::min(d, k0 + kPackedDepth);
        Packet s[kTokens];
        for (int t = 0; t < kTokens; ++t) s[t] = pset1<Packet>(Scalar(0));
        Index k = k0;
        for (; k + L <= k1; k += L) {
          PacketBlock<Packet, L> block;  // block.packet[j] = W[v .. v + L - 1][k + j]
          if (prefetch_next && k % std::max<Index>(L, 64 / static_cast<Index>(sizeof(WStorage))) == 0)
            for (int r = 0; r < L; ++r) prefetch(w + (L + r) * ldw + k);
#if defined(__AVX512F__)
          if constexpr (kBf16Avx512) {
            bf16_columns_avx512(w + k, ldw, block.packet);
          } else
#endif
          {
            for (int r = 0; r < L; ++r) block.packet[r] = load_widened<Scalar>(w + r * ldw + k);
            ptranspose(block);
          }
          for (int j = 0; j < L; ++j)
            for (int t = 0; t < kTokens; ++t)
              s[t] = packed_madd(pset1<Packet>(h[t * ldh + k + j]), block.packet[j], s[t]);
        }
        for (; k < k1; ++k) {
          alignas(64) Scalar column[L];
          for (int r = 0; r < L; ++r) column[r] = packed_value<Scalar>(w[r * ldw + k]);
          const Packet wk = pload<Packet>(column);
          for (int t = 0; t < kTokens; ++t) s[t] = packed_madd(pset1<Packet>(h[t * ldh + k]), wk, s[t]);
        }
        for (int t = 0; t < kTokens; ++t) c[t] = k0 == 0 ? s[t] : padd(c[t], s[t]);
      }
      if (bias) {
        alignas(64) Scalar lanes[L];
        for (int r = 0; r < L; ++r) lanes[r] = bias[(v + r) * ldb];
        const Packet b = pload<Packet>(lanes);
        for (int t = 0; t < kTokens; ++t) c[t] = padd(c[t], b);
      }
      for (int t = 0; t < kTokens; ++t) pstoreu(logits + t * ldl + v, c[t]);
    }
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif
  }
  for (; v < v1; ++v) {
    const WStorage* w = W + v * ldw;
    for (int t = 0; t < kTokens; ++t) {
      Scalar c(0);
      for (Index k0 = 0; k0 < d; k0 += kPackedDepth) {
        const Index k1 = std::min(d, k0 + kPackedDepth);
        Scalar s(0);
        for (Index k = k0; k < k1; ++k) s = packed_madd(h[t * ldh + k], packed_value<Scalar>(w[k]), s);
        c = k0 == 0 ? s : c + s;
      }
      if (bias) c = c + bias[v * ldb];
      logits[t * ldl + v] = c;
    }
  }
}

}  // namespace gemm
}  // namespace detail
}  // namespace embedhead

#endif  // EMBEDHEAD_DETAIL_GEMM_PACKED_HPP
