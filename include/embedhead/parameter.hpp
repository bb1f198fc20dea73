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
// then accumulate no gradient into it and the optimizers leave it alone. Or only some of its rows
// can be trainable (set_trainable_rows(ids)): the gradient then holds those rows only (a row mask,
// honoured by the embedding's backward and the head's dW), and the optimizers keep state for them
// only. It can also change its row
// count in place (resize_rows), so every layer sharing it -- a tied embedding and head -- sees the
// resized table.
//
// The value and the gradient may have different types: Parameter<Value, Grad = Value>. A bf16 or
// fp16 table is Parameter<Eigen::bfloat16, float> / Parameter<Eigen::half, float>: the value in the
// 16-bit storage type, the gradient a float RowGradient (LowPrecisionEmbedding and
// LowPrecisionOutputProjection hold their W so). What does not depend on the value's type -- name,
// shape, gradient, frozen flag -- lives in the base ParameterBase<Grad>, so the code that only
// needs those (freezing, zero_grad, clip_grad_norm, count_parameters, the data-parallel exchange)
// takes any parameter whose gradient is Grad:
//
//   ParameterBase<Grad>            name, rows x cols, RowGradient<Grad>, frozen
//     Parameter<Grad>              + value RowMatrix<Grad>          (float / double tables)
//     Parameter<Storage, Grad>     + value RowMatrix<Storage>       (Storage = bf16 / fp16, Grad = float)
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
template <typename Value, typename Grad = Value>
class RowResize;
}  // namespace detail

// True for the 16-bit storage types a Parameter's value may have besides its gradient's type:
// Eigen::bfloat16 and Eigen::half.
template <typename T>
struct is_low_precision : std::false_type {};
template <>
struct is_low_precision<Eigen::bfloat16> : std::true_type {};
template <>
struct is_low_precision<Eigen::half> : std::true_type {};
template <typename T>
inline constexpr bool is_low_precision_v = is_low_precision<T>::value;

template <typename Scalar>
class RowGradient {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");

 public:
  using RowMap = Eigen::Map<Eigen::Matrix<Scalar, 1, Eigen::Dynamic>>;
  using ConstRowMap = Eigen::Map<const Eigen::Matrix<Scalar, 1, Eigen::Dynamic>>;

  RowGradient(Index rows, Index cols) : rows_(rows), cols_(cols) {}
  RowGradient(const RowGradient&) = default;
  RowGradient(RowGradient&&) noexcept = default;

  // Assignment, copied or moved, keeps the shape: a gradient is [rows, cols] for life (a
  // Parameter's changes only through Parameter::resize_rows), as PyTorch refuses a .grad of
  // another size. It takes everything else from `other`, its row mask (set_row_mask) included:
  // assigning to a Parameter's gradient sets its trainable rows to other's. So a Parameter's gradient always has its
  // value's shape, which the layers and optimizers rely on (a parameter's shape is its gradient's). \throws shape_error
  // if other is not [rows, cols] (nothing changed).
  RowGradient& operator=(const RowGradient& other) {
    if (this == &other) return *this;
    check_same_shape(other);
    RowGradient copy(other);  // may throw bad_alloc; *this is unchanged until the swap
    swap(copy);
    return *this;
  }
  RowGradient& operator=(RowGradient&& other) {
    check_same_shape(other);
    swap(other);  // other keeps this one's old contents: valid, of the same shape
    return *this;
  }

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

  // An id outside the row mask gets this slot from touch_rows: it has no row to add into.
  static constexpr Index kNoSlot = -1;

  // ids [count], sorted and unique, each in [0, rows) -> slots [count]: marks the rows touched
  // (new rows start at zero) and writes where each one's values live, for slot_row().
  // With `fresh` [count] given, rows new to the gradient are NOT zeroed and fresh[j] = 1 marks
  // them: the caller must assign them before anything reads them (the embedding's backward
  // writes a new row's first token instead of adding it to zeros, saving a pass over k rows).
  // With a row mask (set_row_mask), an id outside it is not touched: its slot is kNoSlot (and its
  // fresh 0), and the caller drops its contribution.
  // Cost O((num_touched() + count) * cols) when new rows must be merged into the sorted block,
  // O(count) in dense mode, plus O(count + mask) with a mask. \throws index_error if an id is
  // outside [0, rows), value_error if the ids are not strictly increasing (nothing changed).
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
    if (!masked_) {
      touch_sorted(ids, count, slots, fresh);
      return;
    }
    // The ids in the mask (both lists sorted: one forward walk), touched as a list of their own.
    kept_ids_.clear();
    kept_at_.clear();
    std::size_t m = 0;
    for (Index j = 0; j < count; ++j) {
      while (m < mask_.size() && mask_[m] < ids[j]) ++m;
      if (m < mask_.size() && mask_[m] == ids[j]) {
        kept_ids_.push_back(ids[j]);
        kept_at_.push_back(j);
      } else {
        slots[j] = kNoSlot;
        if (fresh) fresh[j] = 0;
      }
    }
    const Index kept = static_cast<Index>(kept_ids_.size());
    kept_slots_.resize(kept_ids_.size());
    kept_fresh_.resize(kept_ids_.size());
    touch_sorted(kept_ids_.data(), kept, kept_slots_.data(), fresh ? kept_fresh_.data() : nullptr);
    for (Index i = 0; i < kept; ++i) {
      const std::size_t u = static_cast<std::size_t>(i);
      slots[kept_at_[u]] = kept_slots_[u];
      if (fresh) fresh[kept_at_[u]] = kept_fresh_[u];
    }
  }

  // ---- the row mask: only these rows may take a gradient (Parameter::set_trainable_rows) ----

  // Whether a row mask is set, and its sorted ids (empty when none is set).
  bool has_row_mask() const { return masked_; }
  const std::vector<Index>& row_mask() const { return mask_; }

  // ids [k], strictly increasing, each in [0, rows): from now on only these rows take a gradient.
  // Clears the gradient (zero_grad) and frees a dense buffer: a masked gradient never turns dense,
  // so a V x d buffer is never allocated again. \throws index_error for an id outside [0, rows),
  // value_error for ids not strictly increasing (naming the index and value, `where` first;
  // nothing changed).
  void set_row_mask(std::vector<Index> ids, const char* where = "RowGradient::set_row_mask") {
    for (std::size_t j = 0; j < ids.size(); ++j) {
      if (ids[j] < 0 || ids[j] >= rows_) {
        std::ostringstream message;
        message << where << ": ids[" << j << "] = " << ids[j] << " outside [0, " << rows_ << ") (the rows)";
        throw index_error(message.str());
      }
      if (j > 0 && ids[j] <= ids[j - 1]) {
        std::ostringstream message;
        message << where << ": ids must be strictly increasing, but ids[" << j << "] = " << ids[j] << " follows ids["
                << j - 1 << "] = " << ids[j - 1];
        throw value_error(message.str());
      }
    }
    clear();
    dense_ = RowMatrix<Scalar>();
    mask_ = std::move(ids);
    masked_ = true;
  }
  // Every row takes a gradient again. Clears the gradient.
  void clear_row_mask() {
    clear();
    mask_.clear();
    masked_ = false;
  }

  // With a row mask of k rows: touches every row of the mask (rows new to the gradient start at
  // zero) and returns their gradients [k, cols], row i that of row_mask()[i], for a dense
  // contribution restricted to the mask -- the head's dW on its trainable rows, dW_mask +=
  // dlogits[:, mask]^T h. Cost O(k * cols) when rows are new, O(k) otherwise.
  // \throws value_error if no row mask is set (nothing changed).
  Eigen::Map<RowMatrix<Scalar>> masked_accumulator() {
    if (!masked_) throw value_error("RowGradient::masked_accumulator: no row mask is set (see set_row_mask)");
    const Index k = static_cast<Index>(mask_.size());
    if (num_touched() != k) {
      kept_slots_.resize(mask_.size());
      touch_sorted(mask_.data(), k, kept_slots_.data(), nullptr);
    }
    return Eigen::Map<RowMatrix<Scalar>>(k == 0 ? nullptr : block_.data(), k, cols_);
  }

  // The gradient row living at `slot` (from touch_rows), [cols].
  RowMap slot_row(Index slot) { return RowMap(slot_data(slot), cols_); }

  // Switches to dense mode (marking every row) and returns the full [rows, cols] gradient for a
  // dense contribution to add into, e.g. dW += dlogits^T h. The first call allocates and zeroes
  // rows * cols values; later ones reuse the buffer.
  // \throws value_error with a row mask (nothing changed): a masked gradient takes a dense
  // contribution through masked_accumulator(), on its rows only.
  Eigen::Map<RowMatrix<Scalar>> dense_accumulator() {
    if (masked_)
      throw value_error(
          "RowGradient::dense_accumulator: the gradient has a row mask (set_row_mask, "
          "Parameter::set_trainable_rows); a dense contribution goes to its rows only, through masked_accumulator()");
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
  template <typename, typename>
  friend class detail::RowResize;

  // -> a new gradient of `rows` rows holding this one's rows [0, keep), keep <= min(rows_, rows);
  // every other row is zero. Sparse: the touched ids below keep and their block rows, O(touched *
  // cols) (ids are sorted, so the dropped ones are a tail). Dense: a new [rows, cols] buffer, every
  // row marked, O(rows * cols).
  RowGradient resized_copy(Index rows, Index keep) const {
    RowGradient out(rows, cols_);
    // A row mask keeps its ids below keep (those at or beyond it are dropped rows; new rows are
    // not in it).
    out.masked_ = masked_;
    out.mask_.assign(mask_.begin(), std::lower_bound(mask_.begin(), mask_.end(), keep));
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

  // touch_rows without the checks and the mask: ids sorted, unique, in range.
  void touch_sorted(const Index* ids, Index count, Index* slots, unsigned char* fresh) {
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

  void check_same_shape(const RowGradient& other) const {
    if (other.rows_ == rows_ && other.cols_ == cols_) return;
    std::ostringstream message;
    message << "RowGradient::operator=: the assigned gradient has shape [" << other.rows_ << ", " << other.cols_
            << "], expected [" << rows_ << ", " << cols_
            << "]; a gradient keeps its shape (Parameter::resize_rows changes a parameter's)";
    throw shape_error(message.str());
  }

  // Exchanges everything, shapes included: the one way a gradient changes shape (RowResize).
  void swap(RowGradient& other) noexcept {
    std::swap(rows_, other.rows_);
    std::swap(cols_, other.cols_);
    touched_.swap(other.touched_);
    block_.swap(other.block_);
    dense_.swap(other.dense_);
    std::swap(dense_mode_, other.dense_mode_);
    is_new_.swap(other.is_new_);
    mask_.swap(other.mask_);
    std::swap(masked_, other.masked_);
  }

  Index slot_of_touched(Index i) const { return dense_mode_ ? touched_[i] : i; }
  Scalar* slot_data(Index slot) { return dense_mode_ ? dense_.row(slot).data() : block_.row(slot).data(); }
  const Scalar* slot_data(Index slot) const { return dense_mode_ ? dense_.row(slot).data() : block_.row(slot).data(); }

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
  std::vector<Index> mask_;            // the row mask, sorted (set_row_mask)
  bool masked_ = false;
  // Scratch of touch_rows with a mask: the ids kept, their indices, slots and fresh flags.
  std::vector<Index> kept_ids_, kept_at_, kept_slots_;
  std::vector<unsigned char> kept_fresh_;
};

// What every parameter has, whatever its value's type: a name, a shape [rows, cols], the
// row-sparse gradient and the frozen flag. Held through Parameter<Value, Grad>; code that needs no
// value (freezing, zero_grad, gradient clipping and exchange, counting) takes a ParameterBase<Grad>.
// Not constructible on its own, and never deleted through (shared_ptr<ParameterBase<Grad>> made
// from a shared_ptr<Parameter<...>> deletes the Parameter).
template <typename Grad>
class ParameterBase {
  static_assert(std::is_floating_point_v<Grad>, "Grad must be a floating-point type");

 public:
  using grad_type = Grad;

  Index rows() const { return grad_.rows(); }
  Index cols() const { return grad_.cols(); }
  Index size() const { return grad_.rows() * grad_.cols(); }
  const std::string& name() const { return name_; }

  RowGradient<Grad>& grad() { return grad_; }
  const RowGradient<Grad>& grad() const { return grad_; }
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

  // Trainable rows (PEFT's "trainable tokens": after resize_vocabulary, train only the new rows).
  // ids [k], strictly increasing, each in [0, rows): only these rows take a gradient -- the
  // embedding's backward drops the other tokens' rows, the head computes dW for these rows only
  // (dW_mask += dlogits[:, ids]^T h, never a [V, d] buffer) -- and the optimizers keep state for
  // these k rows only and leave every other row exactly as it is (no decay, no momentum). Tied, the
  // embedding and the head share the mask (one Parameter). Clears the gradient. A mask set while an
  // optimizer holds state for this parameter needs Optimizer::resize_state(*this) before its next
  // step. \throws index_error for an id outside [0, rows), value_error for ids not strictly
  // increasing (naming the index and value; nothing changed). Cost O(k).
  void set_trainable_rows(std::vector<Index> ids) {
    grad_.set_row_mask(std::move(ids), "Parameter::set_trainable_rows");
  }
  // Every row trainable again (the default). Clears the gradient.
  void set_all_rows_trainable() { grad_.clear_row_mask(); }
  // -> the trainable rows' ids, or nullptr when every row is trainable.
  const std::vector<Index>* trainable_rows() const { return grad_.has_row_mask() ? &grad_.row_mask() : nullptr; }

 protected:
  // \pre rows, cols >= 1 (Parameter checks them first).
  ParameterBase(Index rows, Index cols, std::string name) : grad_(rows, cols), name_(std::move(name)) {}
  ParameterBase(const ParameterBase&) = default;
  ParameterBase(ParameterBase&&) = default;
  ParameterBase& operator=(const ParameterBase&) = default;
  ParameterBase& operator=(ParameterBase&&) = default;
  ~ParameterBase() = default;

 private:
  template <typename, typename>
  friend class detail::RowResize;

  RowGradient<Grad> grad_;
  std::string name_;
  bool frozen_ = false;
};

// A value matrix [rows, cols] of Value and its gradient, a RowGradient<Grad>. Value is Grad (float
// or double), or a 16-bit storage type (Eigen::bfloat16 / Eigen::half) with Grad = float.
// The shape changes only through resize_rows: assigning a Parameter (or a gradient) of another
// shape throws shape_error before anything changes (the gradient's assignment is the first).
template <typename Value, typename Grad = Value>
class Parameter : public ParameterBase<Grad> {
  static_assert(std::is_same_v<Value, Grad> || (is_low_precision_v<Value> && std::is_same_v<Grad, float>),
                "Parameter<Value, Grad>: Value must be Grad (float or double), or Eigen::bfloat16 / Eigen::half "
                "with Grad = float");

 public:
  using value_type = Value;

  // A zero-initialised [rows, cols] parameter. \throws value_error if rows or cols < 1.
  Parameter(Index rows, Index cols, std::string name = {})
      : ParameterBase<Grad>((check(rows, cols), rows), cols, std::move(name)),
        value_(RowMatrix<Value>::Zero(rows, cols)) {}
  // Takes `value` [rows, cols] as the initial value (by value: an rvalue is moved in, not copied).
  // \throws value_error if it has fewer than one row or column.
  explicit Parameter(RowMatrix<Value> value, std::string name = {})
      : ParameterBase<Grad>((check(value.rows(), value.cols()), value.rows()), value.cols(), std::move(name)),
        value_(std::move(value)) {}

  // The values [rows, cols]. A Map so callers can read and write entries but never resize.
  Eigen::Map<RowMatrix<Value>> value() { return {value_.data(), value_.rows(), value_.cols()}; }
  Eigen::Map<const RowMatrix<Value>> value() const { return {value_.data(), value_.rows(), value_.cols()}; }

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
    detail::RowResize<Value, Grad> staged(*this, new_rows, std::min(this->rows(), new_rows));
    staged.commit();
  }

 private:
  template <typename, typename>
  friend class detail::RowResize;

  static int check(Index rows, Index cols) {
    detail::check_size("Parameter", "rows", rows);
    detail::check_size("Parameter", "cols", cols);
    return 0;
  }

  RowMatrix<Value> value_;
};

namespace detail {

// One Parameter's row-count change in two halves, so that resize_vocabulary can prepare several
// tables before changing any: the constructor builds the new value [new_rows, cols] and gradient
// (every allocation happens here; the target is not changed), commit() installs them without
// throwing. Rows [0, keep) keep their values and gradients, rows [keep, new_rows) are zero with no
// gradient until the caller writes value() before committing. \pre 0 <= keep <= min(rows, new_rows).
template <typename Value, typename Grad>
class RowResize {
 public:
  RowResize(Parameter<Value, Grad>& target, Index new_rows, Index keep)
      : target_(&target),
        value_(new_rows, target.cols()),
        grad_(static_cast<ParameterBase<Grad>&>(target).grad_.resized_copy(new_rows, keep)) {
    value_.topRows(keep) = target.value_.topRows(keep);
    value_.bottomRows(new_rows - keep).setZero();
  }

  Parameter<Value, Grad>& target() const { return *target_; }
  // The new values [new_rows, cols], writable until commit().
  RowMatrix<Value>& value() { return value_; }

  // Installs the new value and gradient (swaps that cannot throw); the old ones are freed with
  // this object.
  void commit() noexcept {
    target_->value_.swap(value_);
    static_cast<ParameterBase<Grad>*>(target_)->grad_.swap(grad_);
  }

 private:
  Parameter<Value, Grad>* target_;
  RowMatrix<Value> value_;
  RowGradient<Grad> grad_;
};

}  // namespace detail

namespace detail {
template <typename P>
Index count_distinct(const std::vector<std::shared_ptr<P>>& params) {
  std::vector<const P*> seen;
  Index total = 0;
  for (const auto& p : params) {
    if (!p || std::find(seen.begin(), seen.end(), p.get()) != seen.end()) continue;
    seen.push_back(p.get());
    total += p->size();
  }
  return total;
}
}  // namespace detail

// params -> total size (rows * cols) of the distinct parameters; a Parameter listed twice (a tied
// E) counts once, null entries count nothing. For lists of Parameter<Value, Grad> and of
// ParameterBase<Grad> (a low-precision head's parameters()). Cost O(n^2) in the list length.
template <typename Grad, typename Value = Grad>
Index count_parameters(const std::vector<std::shared_ptr<Parameter<Value, Grad>>>& params) {
  return detail::count_distinct(params);
}
template <typename P, typename = typename P::grad_type>
Index count_parameters(const std::vector<std::shared_ptr<P>>& params) {
  return detail::count_distinct(params);
}

}  // namespace embedhead

#endif  // EMBEDHEAD_PARAMETER_HPP
