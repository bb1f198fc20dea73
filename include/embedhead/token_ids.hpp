// embedhead: TokenIds, the one view every function that reads token ids or targets takes.
//
// A [rows, cols] block of std::int32_t or std::int64_t ids somewhere in the caller's memory:
//   id (b, t) = data[b * row_stride + t * col_stride],   token n = b * cols + t (row-major order)
// so a row-major IdMatrix [B, T] (row_stride T, col_stride 1), a column-major matrix (1, B), a
// column of a row-major [B, T] (T, any) or a Map with an InnerStride all convert implicitly with
// no copy: the view keeps only the pointer, the shape, the two strides and the id type.
//
// Dispatch: the layers' loops are templates on the id type, compiled once for int32 and once for
// int64, as ATen's AT_DISPATCH_INDEX_TYPES. ids.visit(f) calls f(TypedTokenIds<std::int32_t>) or
// f(TypedTokenIds<std::int64_t>): one branch per call, none per element.
//
// Lifetime: a TokenIds points into the caller's storage and must not outlive it; every function
// taking one reads the ids during the call only. Expressions that would have to be evaluated into
// a temporary first (ids.cast<std::int64_t>(), ids + 1, IdMatrix<...>::Zero(2, 3)) are rejected
// at compile time, so the library never makes a hidden copy to point into. A temporary matrix
// passed to a call (f(ids.cast<std::int64_t>().eval())) lives until the call returns, so that is
// safe; a TokenIds variable made from one would dangle, as a std::string_view of a temporary
// std::string does: keep ids that a view outlives in a named matrix.
#ifndef EMBEDHEAD_TOKEN_IDS_HPP
#define EMBEDHEAD_TOKEN_IDS_HPP

#include <Eigen/Core>

#include <cstdint>
#include <type_traits>

namespace embedhead {

// True for the id types a TokenIds accepts: std::int32_t and std::int64_t.
template <typename Id>
inline constexpr bool is_token_id_type_v = std::is_same_v<Id, std::int32_t> || std::is_same_v<Id, std::int64_t>;

// True for the Eigen types a TokenIds can view without a copy: int32 / int64 scalars stored in
// memory (a Matrix, Map, Ref or Block of one: Eigen's DirectAccessBit).
template <typename T, typename = void>
struct is_token_ids_storage : std::false_type {};
template <typename T>
struct is_token_ids_storage<T, std::enable_if_t<std::is_base_of_v<Eigen::DenseBase<T>, T>>>
    : std::bool_constant<is_token_id_type_v<typename T::Scalar> && ((T::Flags & Eigen::DirectAccessBit) != 0)> {};
template <typename T>
inline constexpr bool is_token_ids_storage_v =
    is_token_ids_storage<std::remove_cv_t<std::remove_reference_t<T>>>::value;

enum class TokenIdType { int32, int64 };

// The typed accessor that TokenIds::visit hands to its callback: the same view with the id type
// in the type, so a loop over it has no branch per element.
template <typename Id>
class TypedTokenIds {
  static_assert(is_token_id_type_v<Id>, "embedhead: token ids are std::int32_t or std::int64_t");

 public:
  using id_type = Id;
  TypedTokenIds(const Id* data, Eigen::Index rows, Eigen::Index cols, Eigen::Index row_stride, Eigen::Index col_stride)
      : data_(data), rows_(rows), cols_(cols), row_stride_(row_stride), col_stride_(col_stride) {}

  Eigen::Index rows() const { return rows_; }
  Eigen::Index cols() const { return cols_; }
  Eigen::Index size() const { return rows_ * cols_; }
  // id (b, t); \pre 0 <= b < rows(), 0 <= t < cols().
  Id operator()(Eigen::Index b, Eigen::Index t) const { return data_[b * row_stride_ + t * col_stride_]; }
  // token n = b * cols() + t; \pre 0 <= n < size().
  Id at(Eigen::Index n) const { return (*this)(n / cols_, n % cols_); }

 private:
  const Id* data_;
  Eigen::Index rows_, cols_, row_stride_, col_stride_;
};

class TokenIds {
 public:
  // Any stored int32 / int64 Eigen matrix, Map, Ref or Block, row- or column-major, any strides.
  // Implicit, so every function taking TokenIds accepts them as they are. Other id types and
  // expressions that are not stored are compile-time errors naming what is accepted.
  template <typename Derived>
  TokenIds(const Eigen::DenseBase<Derived>& ids) {  // NOLINT(google-explicit-constructor)
    static_assert(is_token_id_type_v<typename Derived::Scalar>,
                  "embedhead::TokenIds: token ids must be std::int32_t or std::int64_t "
                  "(cast other integer types into an IdMatrix<std::int64_t> first)");
    static_assert(!is_token_id_type_v<typename Derived::Scalar> || (Derived::Flags & Eigen::DirectAccessBit) != 0,
                  "embedhead::TokenIds: token ids must be stored in memory (a Matrix, Map, Ref or Block of one); "
                  "evaluate this expression into an IdMatrix first");
    if constexpr (is_token_ids_storage_v<Derived>) {
      const Derived& m = ids.derived();
      data_ = m.data();
      type_ = type_of<typename Derived::Scalar>();
      rows_ = m.rows();
      cols_ = m.cols();
      row_stride_ = m.rowStride();
      col_stride_ = m.colStride();
    }
  }
  // A raw buffer of int32 or int64 ids: id (b, t) = data[b * row_stride + t * col_stride].
  template <typename Id, typename = std::enable_if_t<is_token_id_type_v<Id>>>
  TokenIds(const Id* data, Eigen::Index rows, Eigen::Index cols, Eigen::Index row_stride, Eigen::Index col_stride)
      : data_(data), type_(type_of<Id>()), rows_(rows), cols_(cols), row_stride_(row_stride), col_stride_(col_stride) {}

  TokenIdType type() const { return type_; }
  Eigen::Index rows() const { return rows_; }
  Eigen::Index cols() const { return cols_; }
  Eigen::Index size() const { return rows_ * cols_; }
  Eigen::Index row_stride() const { return row_stride_; }
  Eigen::Index col_stride() const { return col_stride_; }

  // id (b, t) widened to Eigen::Index (one branch on the type per call: for loops, use visit).
  Eigen::Index operator()(Eigen::Index b, Eigen::Index t) const {
    const Eigen::Index offset = b * row_stride_ + t * col_stride_;
    if (type_ == TokenIdType::int32) return static_cast<const std::int32_t*>(data_)[offset];
    return static_cast<Eigen::Index>(static_cast<const std::int64_t*>(data_)[offset]);
  }
  // token n = b * cols() + t.
  Eigen::Index at(Eigen::Index n) const { return (*this)(n / cols_, n % cols_); }

  // f(TypedTokenIds<std::int32_t>) or f(TypedTokenIds<std::int64_t>), whichever the ids are;
  // f is a generic lambda, compiled once per id type, and both must return the same type.
  template <typename F>
  decltype(auto) visit(F&& f) const {
    if (type_ == TokenIdType::int32)
      return f(
          TypedTokenIds<std::int32_t>(static_cast<const std::int32_t*>(data_), rows_, cols_, row_stride_, col_stride_));
    return f(
        TypedTokenIds<std::int64_t>(static_cast<const std::int64_t*>(data_), rows_, cols_, row_stride_, col_stride_));
  }

 private:
  template <typename Id>
  static constexpr TokenIdType type_of() {
    return std::is_same_v<Id, std::int32_t> ? TokenIdType::int32 : TokenIdType::int64;
  }

  const void* data_ = nullptr;
  TokenIdType type_ = TokenIdType::int64;
  Eigen::Index rows_ = 0, cols_ = 0, row_stride_ = 0, col_stride_ = 0;
};

}  // namespace embedhead

#endif  // EMBEDHEAD_TOKEN_IDS_HPP
