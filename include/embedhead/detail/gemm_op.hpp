// embedhead internal: the operand description of the library's matrix products (detail/gemm.hpp
// has the seam and its backends, detail/gemm_packed.hpp the library's own kernel). No API promise.
//
//   C [M, N]  =  op(A) [M, K] op(B) [K, N]                  Init::zero
//   C [M, N] +=  op(A) [M, K] op(B) [K, N]                  Init::keep
//   C [M, N]  =  1 b^T + op(A) [M, K] op(B) [K, N]          Init::bias   (b [N], strided)
//
// C is row-major with leading dimension ldc; op(A) and op(B) are views given by pointer, leading
// dimension and Layout (see detail/gemm.hpp).
#ifndef EMBEDHEAD_DETAIL_GEMM_OP_HPP
#define EMBEDHEAD_DETAIL_GEMM_OP_HPP

#include "../types.hpp"

#include <algorithm>

namespace embedhead {
namespace detail {
namespace gemm {

enum class Layout { row_major, col_major };
enum class Init { zero, keep, bias };
enum class Split { rows, cols };  // of C: rows = M, cols = N
enum class Kernel { gemm, expression, decode };

// C [M, N] (init) op(A) [M, K] op(B) [K, N]; see the top of this file. An aggregate:
//   gemm::Op<float, Layout::row_major, Layout::col_major> op{N, V, d, h, ldh, W, ldw, logits, ldl};
template <typename Scalar, Layout LA, Layout LB, typename BStorage = Scalar, typename AStorage = Scalar>
struct Op {
  Index M = 0, N = 0, K = 0;
  const AStorage* a = nullptr;  // op(A) [M, K] in layout LA
  Index lda = 0;
  const BStorage* b = nullptr;  // op(B) [K, N] in layout LB
  Index ldb = 0;
  Scalar* c = nullptr;  // C [M, N] row-major; nullptr: no product, the epilogues alone
  Index ldc = 0;
  Init init = Init::keep;
  const Scalar* bias = nullptr;  // Init::bias: b[n] = bias[n * bias_stride]
  Index bias_stride = 1;
};

// Which dimension of C the chunks cut, how long a chunk is, whether the chunks may go to threads.
struct Plan {
  Split split = Split::cols;
  Index chunk = 1;  // >= 1
  bool threaded = false;
};

// p + offset, or p itself when it is null (the view of an empty operand; never dereferenced).
template <typename T>
T* offset(T* p, Index offset) {
  return p ? p + offset : p;
}

// op restricted to rows [m0, m0 + rows) of C (and of op(A)).
template <typename Scalar, Layout LA, Layout LB, typename BStorage, typename AStorage>
Op<Scalar, LA, LB, BStorage, AStorage> rows_of(Op<Scalar, LA, LB, BStorage, AStorage> op, Index m0, Index rows) {
  op.a = offset(op.a, LA == Layout::row_major ? m0 * op.lda : m0);
  op.c = offset(op.c, m0 * op.ldc);
  op.M = rows;
  return op;
}
// op restricted to columns [n0, n0 + cols) of C (and of op(B), and of the bias).
template <typename Scalar, Layout LA, Layout LB, typename BStorage, typename AStorage>
Op<Scalar, LA, LB, BStorage, AStorage> cols_of(Op<Scalar, LA, LB, BStorage, AStorage> op, Index n0, Index cols) {
  op.b = offset(op.b, LB == Layout::row_major ? n0 : n0 * op.ldb);
  op.c = offset(op.c, n0);
  op.bias = offset(op.bias, n0 * op.bias_stride);
  op.N = cols;
  return op;
}
// op restricted to the summation indices [k0, k0 + depth) (columns of op(A), rows of op(B)).
template <typename Scalar, Layout LA, Layout LB, typename BStorage, typename AStorage>
Op<Scalar, LA, LB, BStorage, AStorage> depth_of(Op<Scalar, LA, LB, BStorage, AStorage> op, Index k0, Index depth) {
  op.a = offset(op.a, LA == Layout::row_major ? k0 : k0 * op.lda);
  op.b = offset(op.b, LB == Layout::row_major ? k0 * op.ldb : k0);
  op.K = depth;
  return op;
}

// C = 0 or C = 1 b^T for Init::zero / Init::bias; nothing for Init::keep.
template <typename Scalar, Layout LA, Layout LB, typename BStorage, typename AStorage>
void start(const Op<Scalar, LA, LB, BStorage, AStorage>& op) {
  if (op.init == Init::keep || op.M == 0 || op.N == 0) return;
  for (Index m = 0; m < op.M; ++m) {
    Scalar* row = op.c + m * op.ldc;
    if (op.init == Init::bias && op.bias_stride == 1)
      std::copy_n(op.bias, op.N, row);
    else if (op.init == Init::bias)
      for (Index n = 0; n < op.N; ++n) row[n] = op.bias[n * op.bias_stride];
    else
      std::fill(row, row + op.N, Scalar(0));
  }
}

}  // namespace gemm
}  // namespace detail
}  // namespace embedhead

#endif  // EMBEDHEAD_DETAIL_GEMM_OP_HPP
