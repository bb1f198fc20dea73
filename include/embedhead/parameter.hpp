// embedhead: a trainable matrix and its row-sparse gradient.
//
// Parameter<Scalar> owns a value matrix [rows, cols] and its gradient. Layers hold parameters
// through std::shared_ptr, so a tied embedding and head share one Parameter (one value, one
// gradient) and neither can dangle.
//
// The gradient (RowGradient) records which rows it touches. It starts sparse: the sorted ids of
// the touched rows plus a compact [k, cols] block with their values, so an untied 256k x 2048
// table trains without a second V x d matrix. A dense contribution (the head's dW = dlogits^T h)
// switches it to dense mode: it then holds a [rows, cols] buffer and marks every row. Clearing
// (zero_grad) is O(1) in sparse mode -- stale block rows are zeroed when a later backward reuses
// them, as part of its O(k * cols) work -- and O(rows * cols) only after a dense contribution,
// which wrote all rows anyway.
//
// A parameter can be frozen (set_frozen(true), PyTorch's from_pretrained(freeze=True)): the layers
// then accumulate no gradient into it and the optimizers leave it alone. It can also change its row
// count in place (resize_rows), so every layer sharing it -- a tied embedding and head -- sees the
// resized table.
#ifndef EMBEDHEAD_PARAMETER_HPP
#define EMBEDHEAD_PARAMETER_HPP

#include "detail/checks.hpp"
#include "types.hpp"

#include <algorithm>
#include <memory>
#include <numeric>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace embedhead {

namespace detail {
template <typename Scalar>
class RowResize;
}  // namespace detail

template <typename Scalar>
class RowGradient {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");

 public:
  using RowMap = Eigen::Map<Eigen::Matrix<Scalar, 1, Eigen::Dynamic>>;
  using ConstRowMap = Eigen::Map<const Eigen::Matrix<Scalar, 1, Eigen::Dynamic>>;

  RowGradient(Index rows, Index cols) : rows_(rows), cols_(cols) {}

  Index rows() const { return rows_; }
  Index cols() const { return cols_; }

  // True after a dense contribution: every row is marked and the values live in a full buffer.
  bool is_dense() const { return dense_mode_; }

  // Sorted ids of the rows that may be non-zero; every other row is exactly zero. In dense mode
  // this is 0 .. rows-1.
  const std::vector<Index>& touched_rows() const { return touched_; }
  Index num_touched() const { return static_cast<Index>(touched_.size()); }

  // i in [0, num_touched()) -> the gradient of row touched_rows()[i], [cols].
  ConstRowMap touched_row(Index i) const { return ConstRowMap(slot_data(slot_of_touched(i)), cols_); }
  RowMap touched_row(Index i) { return RowMap(slot_data(slot_of_touched(i)), cols_); }

  // -> the touched rows' values [num_touched(), cols], row i = touched_row(i), one contiguous
  // row-major block (the compact block in sparse mode, the full buffer in dense mode): what a
  // data-parallel exchange sends without copying it first. Valid until the next change.
  Eigen::Map<const RowMatrix<Scalar>> touched_values() const {
    const Scalar* data = dense_mode_ ? dense_.data() : block_.data();
    return Eigen::Map<const RowMatrix<Scalar>>(data, num_touched(), cols_);
  }

  // -> out [rows, cols], zeros where untouched. Costs O(rows * cols); for tests and export.
  // \throws shape_error if out is not [rows, cols] (nothing written).
  void to_dense(MatrixRef<Scalar> out) const {
    detail::check_shape("RowGradient::to_dense", "out", out, rows_, cols_);
    if (dense_mode_) {
      out = dense_;
      return;
    }
    out.setZero();
    for (Index i = 0; i < num_touched(); ++i) out.row(touched_[i]) = block_.row(i);
  }
  RowMatrix<Scalar> to_dense() const {
    RowMatrix<Scalar> out(rows_, cols_);
    to_dense(out);
    return out;
  }

  // ---- accumulation, used by the layers' backward passes ----

  // ids [count], sorted and unique, each in [0, rows) -> slots [count]: marks the rows touched
  // (new rows start at zero) and writes where each one's values live, for slot_row().
  // With `fresh` [count] given, rows new to the gradient are NOT zeroed and fresh[j] = 1 marks
  // them: the caller must assign them before anything reads them (the embedding's backward
  // writes a new row's first token instead of adding it to zeros, saving a pass over k rows).
  // Cost O((num_touched() + count) * cols) when new rows must be merged into the sorted block,
  // O(count) in dense mode. \throws index_error if an id is outside [0, rows), value_error if
  // the ids are not strictly increasing (nothing changed).
  void touch_rows(const Index* ids, Index count, Index* slots, unsigned char* fresh = nullptr) {
    for (Index j = 0; j < count; ++j) {
      if (ids[j] < 0 || ids[j] >= rows_) {
        std::ostringstream message;
        message << "RowGradient::touch_rows: id " << ids[j] << " at index " << j << " outside [0, " << rows_ << ")";
        throw index_error(message.str());
      }
      if (j > 0 && ids[j] <= ids[j - 1]) {
        std::ostringstream message;
        message << "RowGradient::touch_rows: ids must be strictly increasing, but id " << ids[j] << " at index " << j
                << " follows " << ids[j - 1];
        throw value_error(message.str());
      }
    }
    if (dense_mode_) {
      for (Index j = 0; j < count; ++j) slots[j] = ids[j];  // a row's slot is its id
      if (fresh) std::fill(fresh, fresh + count, static_cast<unsigned char>(0));
      return;
    }
    const bool merged = merge_sorted_ids(ids, count, /*zero_new_rows=*/fresh == nullptr);
    // Both lists sorted: one forward walk finds each id's slot.
    Index k = 0;
    for (Index j = 0; j < count; ++j) {
      while (touched_[k] != ids[j]) ++k;
      slots[j] = k;
      if (fresh) fresh[j] = merged ? is_new_[static_cast<std::size_t>(k)] : 0;
    }
  }

  // The gradient row living at `slot` (from touch_rows), [cols].
  RowMap slot_row(Index slot) { return RowMap(slot_data(slot), cols_); }

  // Switches to dense mode (marking every row) and returns the full [rows, cols] gradient for a
  // dense contribution to add into, e.g. dW += dlogits^T h. The first call allocates and zeroes
  // rows * cols values; later ones reuse the buffer.
  Eigen::Map<RowMatrix<Scalar>> dense_accumulator() {
    if (!dense_mode_) densify();
    return Eigen::Map<RowMatrix<Scalar>>(dense_.data(), rows_, cols_);
  }

  // zero_grad: forgets every touched row. O(1) in sparse mode; O(rows * cols) in dense mode,
  // where every row was written. Keeps allocated buffers for the next step.
  void clear() {
    if (dense_mode_) dense_.setZero();  // keep the invariant: dense_ is all zero outside dense mode
    dense_mode_ = false;
    touched_.clear();
  }

 private:
  template <typename>
  friend class detail::RowResize;

  // -> a new gradient of `rows` rows holding this one's rows [0, keep), keep <= min(rows_, rows);
  // every other row is zero. Sparse: the touched ids below keep and their block rows, O(touched *
  // cols) (ids are sorted, so the dropped ones are a tail). Dense: a new [rows, cols] buffer, every
  // row marked, O(rows * cols).
  RowGradient resized_copy(Index rows, Index keep) const {
    RowGradient out(rows, cols_);
    if (dense_mode_) {
      out.dense_.resize(rows, cols_);
      out.dense_.topRows(keep) = dense_.topRows(keep);
      out.dense_.bottomRows(rows - keep).setZero();
      out.touched_.resize(static_cast<std::size_t>(rows));
      std::iota(out.touched_.begin(), out.touched_.end(), Index{0});
      out.dense_mode_ = true;
      return out;
    }
    const auto end = std::lower_bound(touched_.begin(), touched_.end(), keep);
    const Index k = static_cast<Index>(end - touched_.begin());
    out.touched_.assign(touched_.begin(), end);
    out.block_ = block_.topRows(k);
    return out;
  }

  Index slot_of_touched(Index i) const { return dense_mode_ ? touched_[i] : i; }
  Scalar* slot_data(Index slot) { return dense_mode_ ? dense_.row(slot).data() : block_.row(slot).data(); }
  const Scalar* slot_data(Index slot) const {
    return dense_mode_ ? dense_.row(slot).data() : block_.row(slot).data();
  }

  // Merges sorted unique ids into touched_, moving block rows so they stay aligned with it, and
  // records in is_new_ which block rows are new. Returns false when every id was already there.
  bool merge_sorted_ids(const Index* ids, Index count, bool zero_new_rows) {
    const Index old_k = num_touched();
    Index fresh = 0;
    for (Index i = 0, j = 0; j < count; ++j) {
      while (i < old_k && touched_[i] < ids[j]) ++i;
      if (i == old_k || touched_[i] != ids[j]) ++fresh;
    }
    if (fresh == 0) return false;
    const Index new_k = old_k + fresh;
    is_new_.assign(static_cast<std::size_t>(new_k), 0);
    if (block_.rows() < new_k) {
      // Grow geometrically; conservativeResize keeps the first rows of a row-major matrix.
      block_.conservativeResize(std::max(new_k, 2 * block_.rows()), cols_);
    }
    touched_.resize(static_cast<std::size_t>(new_k));
    // Merge from the back so nothing is overwritten before it is moved.
    Index i = old_k - 1, j = count - 1, w = new_k - 1;
    while (j >= 0 && w > i) {
      if (i >= 0 && touched_[i] > ids[j]) {
        touched_[w] = touched_[i];
        block_.row(w) = block_.row(i);
        --i;
      } else if (i >= 0 && touched_[i] == ids[j]) {
        touched_[w] = touched_[i];
        block_.row(w) = block_.row(i);
        --i;
        --j;
      } else {
        touched_[w] = ids[j];
        is_new_[static_cast<std::size_t>(w)] = 1;
        if (zero_new_rows) block_.row(w).setZero();
        --j;
      }
      --w;
    }
    return true;
  }

  void densify() {
    if (dense_.rows() != rows_) dense_.setZero(rows_, cols_);
    for (Index i = 0; i < num_touched(); ++i) dense_.row(touched_[i]) = block_.row(i);
    touched_.resize(static_cast<std::size_t>(rows_));
    std::iota(touched_.begin(), touched_.end(), Index{0});
    dense_mode_ = true;
  }

  Index rows_;
  Index cols_;
  std::vector<Index> touched_;  // sorted ids of touched rows
  RowMatrix<Scalar> block_;     // sparse mode: row i holds touched_[i]'s values (capacity may exceed k)
  RowMatrix<Scalar> dense_;     // [rows, cols] once allocated; all zero whenever !dense_mode_
  bool dense_mode_ = false;
  std::vector<unsigned char> is_new_;  // scratch of merge_sorted_ids: block row w was just added
};

template <typename Scalar>
class Parameter {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");

 public:
  // A zero-initialised [rows, cols] parameter. \throws value_error if rows or cols < 1.
  Parameter(Index rows, Index cols, std::string name = {})
      : value_((check(rows, cols), RowMatrix<Scalar>::Zero(rows, cols))),
        grad_(rows, cols),
        name_(std::move(name)) {}

  Index rows() const { return value_.rows(); }
  Index cols() const { return value_.cols(); }
  Index size() const { return value_.size(); }
  const std::string& name() const { return name_; }

  // The values [rows, cols]. A Map so callers can read and write entries but never resize.
  Eigen::Map<RowMatrix<Scalar>> value() { return {value_.data(), value_.rows(), value_.cols()}; }
  Eigen::Map<const RowMatrix<Scalar>> value() const {
    return {value_.data(), value_.rows(), value_.cols()};
  }

  RowGradient<Scalar>& grad() { return grad_; }
  const RowGradient<Scalar>& grad() const { return grad_; }
  void zero_grad() { grad_.clear(); }

  // A frozen parameter takes no gradient and no optimizer update: the layers' backward passes skip
  // its accumulation (still computing the gradients of their inputs), Optimizer::step and
  // clip_grad_norm skip it. Freezing clears the gradient (zero_grad), so a frozen parameter's
  // gradient is always empty unless written through grad() directly. Not frozen by default. A tied
  // table is one Parameter: freezing the embedding freezes the head's W too.
  bool frozen() const { return frozen_; }
  void set_frozen(bool frozen) {
    if (frozen) zero_grad();
    frozen_ = frozen;
  }

  // Changes the row count to new_rows in place: this object stays, so every layer holding it (a
  // tied embedding and head share one) sees the new table. Rows [0, min(rows(), new_rows)) keep
  // their values bit for bit; new rows are zero. The gradient follows: touched rows below new_rows
  // keep their values, touched rows at or beyond it are dropped, new rows are untouched (a dense
  // gradient stays dense, its new rows zero). Optimizer state lives in the optimizer: call
  // Optimizer::resize_state(*this) after this (resize_vocabulary does both).
  // \throws value_error if new_rows < 1. Strong guarantee, allocation failure included: the new
  // storage is built beside the old one, then swapped in.
  // Cost: O(new_rows * cols) for the new value (the reallocation copy), plus O(touched * cols) for
  // a sparse gradient or O(new_rows * cols) for a dense one; the old storage is freed.
  void resize_rows(Index new_rows) {
    detail::check_size("Parameter::resize_rows", "new_rows", new_rows);
    detail::RowResize<Scalar> staged(*this, new_rows, std::min(rows(), new_rows));
    staged.commit();
  }

 private:
  template <typename>
  friend class detail::RowResize;

  static int check(Index rows, Index cols) {
    detail::check_size("Parameter", "rows", rows);
    detail::check_size("Parameter", "cols", cols);
    return 0;
  }

  RowMatrix<Scalar> value_;
  RowGradient<Scalar> grad_;
  std::string name_;
  bool frozen_ = false;
};

namespace detail {

// One Parameter's row-count change in two halves, so that resize_vocabulary can prepare several
// tables before changing any: the constructor builds the new value [new_rows, cols] and gradient
// (every allocation happens here; the target is not changed), commit() installs them without
// throwing. Rows [0, keep) keep their values and gradients, rows [keep, new_rows) are zero with no
// gradient until the caller writes value() before committing. \pre 0 <= keep <= min(rows, new_rows).
template <typename Scalar>
class RowResize {
 public:
  RowResize(Parameter<Scalar>& target, Index new_rows, Index keep)
      : target_(&target), value_(new_rows, target.cols()), grad_(target.grad_.resized_copy(new_rows, keep)) {
    value_.topRows(keep) = target.value_.topRows(keep);
    value_.bottomRows(new_rows - keep).setZero();
  }

  Parameter<Scalar>& target() const { return *target_; }
  // The new values [new_rows, cols], writable until commit().
  RowMatrix<Scalar>& value() { return value_; }

  // Installs the new value and gradient; the old ones are freed with this object.
  void commit() noexcept {
    static_assert(std::is_nothrow_move_constructible_v<RowGradient<Scalar>> &&
                      std::is_nothrow_move_assignable_v<RowGradient<Scalar>>,
                  "commit() must not throw");
    target_->value_.swap(value_);
    std::swap(target_->grad_, grad_);
  }

 private:
  Parameter<Scalar>* target_;
  RowMatrix<Scalar> value_;
  RowGradient<Scalar> grad_;
};

}  // namespace detail

// Total size of the distinct parameters in `params`; a Parameter listed twice (a tied E) counts
// once.
template <typename Scalar>
Index count_parameters(const std::vector<std::shared_ptr<Parameter<Scalar>>>& params) {
  std::vector<const Parameter<Scalar>*> seen;
  Index total = 0;
  for (const auto& p : params) {
    if (!p || std::find(seen.begin(), seen.end(), p.get()) != seen.end()) continue;
    seen.push_back(p.get());
    total += p->size();
  }
  return total;
}

}  // namespace embedhead

#endif  // EMBEDHEAD_PARAMETER_HPP
