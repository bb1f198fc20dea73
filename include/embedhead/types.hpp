// embedhead: shared type aliases.
//
// Conventions used by every header:
//   V      vocabulary size (rows of the token table and of the head weight)
//   d      model width (columns)
//   B, T   batch size and sequence length; N = B*T tokens
//   T_max  rows of a position table
// Activations are row-major [N, d] matrices: one token per contiguous row, as in llm.c.
#ifndef EMBEDHEAD_TYPES_HPP
#define EMBEDHEAD_TYPES_HPP

#include "token_ids.hpp"

#include <Eigen/Core>

#include <cstdint>

namespace embedhead {

using Index = Eigen::Index;

// A dense row-major matrix of scalars: tables [V, d], activations [N, d], logits [N, V].
template <typename Scalar>
using RowMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// Token ids [B, T], row-major so that id (b, t) sits at b*T + t. int32 and int64 are accepted.
// Functions take ids as a TokenIds (token_ids.hpp), which also views column-major and strided
// int32 / int64 storage without a copy.
template <typename Id>
using IdMatrix = Eigen::Matrix<Id, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// Read-only views used for inputs (no copy when the argument is already row-major and contiguous).
template <typename Scalar>
using ConstMatrixRef = Eigen::Ref<const RowMatrix<Scalar>>;
template <typename Scalar>
using MatrixRef = Eigen::Ref<RowMatrix<Scalar>>;

namespace detail {

// T itself, in a context that template argument deduction skips (std::type_identity in C++20):
// a parameter of type non_deduced_t<MatrixRef<Scalar>> takes Scalar from another argument (a
// table, a layer) and accepts anything Ref-convertible.
template <typename T>
struct non_deduced {
  using type = T;
};
template <typename T>
using non_deduced_t = typename non_deduced<T>::type;

}  // namespace detail

}  // namespace embedhead

#endif  // EMBEDHEAD_TYPES_HPP
