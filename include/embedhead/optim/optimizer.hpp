// embedhead: optimizers that know which rows of a gradient are non-zero.
//
// An embedding table's gradient touches a few hundred of V rows per step (RowGradient keeps them
// sparse). What an optimizer does with the other rows is a semantic choice, not an implementation
// detail -- the seeds' warning: a zero gradient does not mean an unchanged row.
//
//   exact (dense) semantics, every row every step, O(V d):
//     SGD with momentum or weight decay   momentum keeps moving rows, decay shrinks them
//     AdamW / Adam                        moments of untouched rows decay, their update continues
//   lazy (sparse) semantics, touched rows only, O(touched rows * d):
//     LazyAdam        PyTorch's SparseAdam / TensorFlow's LazyAdam: an untouched row's moments and
//                     value are left exactly as they were. Equals Adam when every row is touched.
//   both at once (nothing happens to an untouched row under either):
//     SGD without momentum and decay, Adagrad
//
// Formulas and operation order follow PyTorch's torch.optim (1.13), so a trajectory matches
// PyTorch's to float rounding. Every optimizer holds parameter groups (a per-group multiplier of
// the learning rate -- the seeds cite eta_E / eta_W ~ sqrt(d) -- and a per-group weight decay);
// a parameter may appear once only (pass tied layers' lists through unique_parameters()).
//
// A frozen parameter (Parameter::set_frozen) is skipped by step() -- its value and state stay as
// they are, while the step count still advances for everyone -- and by clip_grad_norm. After a
// parameter's row count changes (Parameter::resize_rows, resize_vocabulary), resize_state() makes
// its buffers follow.
//
// Low-precision parameters (Parameter<Eigen::bfloat16, float>, Parameter<Eigen::half, float>: the
// bf16/fp16 layers' tables) are not stepped: Optimizer<float>::add_group rejects them at compile
// time with a static_assert saying so. Stepping one correctly means widening the value to float,
// updating in float and rounding once to the storage type (round-to-nearest-even; stochastic
// rounding is a later issue), which is not implemented yet; rather than update such a value
// silently in the wrong precision, the optimizers refuse it. clip_grad_norm and unique_parameters
// do take them (they only read the float gradient).
//
// This header holds what every optimizer shares (parameter groups, the step count, state save and
// restore, resize_state); each optimizer has a header of its own beside it (sgd.hpp, adamw.hpp,
// lazy_adam.hpp, adagrad.hpp), with clip.hpp (gradient clipping) and schedule.hpp (learning-rate
// schedules).
#ifndef EMBEDHEAD_OPTIM_OPTIMIZER_HPP
#define EMBEDHEAD_OPTIM_OPTIMIZER_HPP

#include "../detail/checks.hpp"
#include "../errors.hpp"
#include "../parameter.hpp"
#include "../types.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace embedhead {

// The distinct parameters of `parameters`, in first-seen order, nulls dropped: a tied E listed by
// both the embedding and the head comes out once, whichever way the head was tied. Any element
// type (Parameter<Value, Grad>, ParameterBase<Grad>). Cost O(n^2) in the list length.
template <typename P>
std::vector<std::shared_ptr<P>> unique_parameters(const std::vector<std::shared_ptr<P>>& parameters) {
  std::vector<std::shared_ptr<P>> unique;
  for (const auto& p : parameters)
    if (p && std::find(unique.begin(), unique.end(), p) == unique.end()) unique.push_back(p);
  return unique;
}

struct ParameterGroupOptions {
  double lr_multiplier = 1.0;          // the group's learning rate is lr() * lr_multiplier
  std::optional<double> weight_decay;  // unset: the optimizer's default
};

template <typename Scalar>
struct ParameterGroup {
  std::vector<std::shared_ptr<Parameter<Scalar>>> parameters;
  double lr_multiplier = 1.0;
  double weight_decay = 0.0;
};

// Everything an optimizer needs to continue where it stopped: the step count and, per parameter
// (in registration order), its name, shape and named buffers ("exp_avg", "exp_avg_sq",
// "momentum_buffer", "sum"), each [rows, cols]. A buffer not created yet is absent.
template <typename Scalar>
struct OptimizerState {
  std::string optimizer;
  std::int64_t step = 0;
  struct Entry {
    std::string name;
    Index rows = 0, cols = 0;
    std::map<std::string, RowMatrix<Scalar>> buffers;
  };
  std::vector<Entry> parameters;
};

namespace detail {

[[noreturn]] inline void throw_hyperparameter(const char* where, const char* what, double value, const char* range) {
  std::ostringstream message;
  message << where << ": " << what << " = " << value << " outside " << range;
  throw value_error(message.str());
}
inline void check_non_negative(const char* where, const char* what, double value) {
  if (!(value >= 0) || !std::isfinite(value)) throw_hyperparameter(where, what, value, "[0, inf)");
}
inline void check_beta(const char* where, const char* what, double value) {
  if (!(value >= 0 && value < 1)) throw_hyperparameter(where, what, value, "[0, 1)");
}
// check_beta in the type the update multiplies by it: a beta just below 1 in double can be 1 in
// float (0.9999999999 is), and a moment that never decays is outside [0, 1).
template <typename Scalar>
void check_beta_in(const char* where, const char* what, double value) {
  check_beta(where, what, value);
  if (static_cast<Scalar>(value) < Scalar(1)) return;
  std::ostringstream message;
  message.precision(15);
  message << where << ": " << what << " = " << value << " outside [0, 1) in " << scalar_name<Scalar>()
          << ": it rounds to 1 (the largest " << scalar_name<Scalar>() << " below 1 is "
          << static_cast<double>(Scalar(1) - std::numeric_limits<Scalar>::epsilon() / 2) << ")";
  throw value_error(message.str());
}

// Calls f(row, gradient row) for every row of the parameter; untouched rows get `zero` (a zero
// row of length cols). O(rows * cols).
template <typename Scalar, typename F>
void for_every_row(const RowGradient<Scalar>& g, const Scalar* zero, F&& f) {
  using ConstRow = Eigen::Map<const Eigen::Array<Scalar, 1, Eigen::Dynamic>>;
  const auto& touched = g.touched_rows();
  std::size_t next = 0;
  for (Index r = 0; r < g.rows(); ++r) {
    if (next < touched.size() && touched[next] == r) {
      f(r, ConstRow(g.touched_row(static_cast<Index>(next)).data(), g.cols()));
      ++next;
    } else {
      f(r, ConstRow(zero, g.cols()));
    }
  }
}

// Calls f(row, gradient row) for the touched rows only. O(touched rows * cols).
template <typename Scalar, typename F>
void for_touched_rows(const RowGradient<Scalar>& g, F&& f) {
  using ConstRow = Eigen::Map<const Eigen::Array<Scalar, 1, Eigen::Dynamic>>;
  for (Index i = 0; i < g.num_touched(); ++i)
    f(g.touched_rows()[static_cast<std::size_t>(i)], ConstRow(g.touched_row(i).data(), g.cols()));
}

template <typename Scalar>
class StateResize;

}  // namespace detail

// The common part: groups, learning rate, step count, state save/restore. Subclasses define
// the update of one parameter.
template <typename Scalar>
class Optimizer {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");

 public:
  using ParameterList = std::vector<std::shared_ptr<Parameter<Scalar>>>;
  using Row = Eigen::Map<Eigen::Array<Scalar, 1, Eigen::Dynamic>>;
  using ConstRow = Eigen::Map<const Eigen::Array<Scalar, 1, Eigen::Dynamic>>;

  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // Adds a group. \throws value_error for a null parameter, a parameter already registered (in
  // any group; a tied table listed twice -- use unique_parameters), lr_multiplier or weight_decay
  // negative or not finite (weight_decay: also in Scalar), or a weight decay this optimizer cannot
  // apply. Nothing changes on throw. (lr() x lr_multiplier is checked in Scalar by each step.)
  void add_group(const ParameterList& parameters, const ParameterGroupOptions& options = {}) {
    const char* where = name_;
    detail::check_non_negative(where, "lr_multiplier", options.lr_multiplier);
    const double weight_decay = options.weight_decay.value_or(default_weight_decay_);
    check_weight_decay_value(weight_decay);
    check_weight_decay(weight_decay);
    for (std::size_t i = 0; i < parameters.size(); ++i) {
      const auto& p = parameters[i];
      if (!p) {
        std::ostringstream message;
        message << where << ": parameter " << i << " of the group is a null pointer";
        throw value_error(message.str());
      }
      const bool earlier_in_group = std::find(parameters.begin(), parameters.begin() + static_cast<std::ptrdiff_t>(i),
                                              p) != parameters.begin() + static_cast<std::ptrdiff_t>(i);
      if (earlier_in_group || slot_of(p.get()) >= 0) {
        std::ostringstream message;
        message << where << ": parameter '" << p->name() << "' [" << p->rows() << ", " << p->cols()
                << "] is registered twice (a tied table belongs to one group only; see unique_parameters)";
        throw value_error(message.str());
      }
    }
    groups_.push_back({parameters, options.lr_multiplier, weight_decay});
    for (const auto& p : parameters) {
      slots_.push_back(p.get());
      state_.emplace_back();
    }
  }

  // A list of low-precision parameters (Parameter<Storage, Scalar>, Storage = bf16 / fp16): a
  // compile-time error, see the header. (A list of Parameter<Scalar> takes the overload above.)
  template <typename Storage>
  void add_group(const std::vector<std::shared_ptr<Parameter<Storage, Scalar>>>&, const ParameterGroupOptions& = {}) {
    static_assert(!is_low_precision_v<Storage>,
                  "embedhead optimizers do not step bf16/fp16 parameters (Parameter<Storage, float>) yet: the update "
                  "would have to run in float and round once to Storage; train a float table and convert_table it");
  }

  const std::vector<ParameterGroup<Scalar>>& groups() const { return groups_; }
  double lr() const { return lr_; }
  // \throws value_error unless lr is finite and >= 0, and, rounded to Scalar, neither inf nor
  // (when not 0) 0: the update multiplies by it in Scalar (lr unchanged).
  void set_lr(double lr) {
    detail::check_non_negative(name_, "lr", lr);
    detail::check_in_scalar<Scalar>(name_, "lr", lr, "[0, inf)");
    lr_ = lr;
  }
  std::int64_t step_count() const { return step_; }

  // One update of every registered parameter from its current gradient; frozen parameters are
  // skipped (value and state untouched), but the step count t advances once for all. Cost: see the
  // class.
  // \throws shape_error if a registered parameter's buffers no longer have its shape (it was
  // resized, Parameter::resize_rows, without resize_state: frozen parameters included);
  // value_error if a constant of this step's update -- the group's learning rate lr() x
  // lr_multiplier, Adam's lr / (1 - beta1^t), the decoupled decay 1 - lr weight_decay -- is not
  // finite in Scalar. Nothing changes on throw, the step count included.
  void step() {
    check_state("step");
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      const auto& group = groups_[g];
      const bool any = std::any_of(group.parameters.begin(), group.parameters.end(),
                                   [](const auto& p) { return !p->frozen(); });
      if (any) check_step(g, lr_ * group.lr_multiplier, group.weight_decay, step_ + 1);
    }
    ++step_;
    std::size_t slot = 0;
    for (const auto& group : groups_)
      for (const auto& p : group.parameters) {
        auto& state = state_[slot++];
        if (!p->frozen()) update(*p, lr_ * group.lr_multiplier, group.weight_decay, state);
      }
  }

  // After p's row count changed (Parameter::resize_rows): resizes each of p's buffers to
  // [p.rows(), cols]. Rows below both the old and the new count keep their values bit for bit; new
  // rows start from the buffer's initial value (0 for exp_avg, exp_avg_sq and momentum_buffer;
  // initial_accumulator_value for Adagrad's sum), as if never updated. The step count is global and
  // unchanged, so a new row's first Adam update is bias-corrected with the current t, as PyTorch's
  // SparseAdam treats a row seen for the first time. A buffer not created yet stays absent.
  // -> false, changing nothing, when p is not registered here. Strong guarantee (new buffers are
  // built, then swapped in). Cost O(rows * cols) per buffer.
  bool resize_state(const Parameter<Scalar>& p);

  // zero_grad() of every registered parameter.
  void zero_grad() {
    for (const auto& group : groups_)
      for (const auto& p : group.parameters) p->zero_grad();
  }

  // -> the step count and every registered parameter's buffers, in registration order.
  // \throws shape_error if a parameter's buffers no longer have its shape (as step).
  OptimizerState<Scalar> state() const {
    check_state("state");
    OptimizerState<Scalar> s;
    s.optimizer = name_;
    s.step = step_;
    std::size_t slot = 0;
    for (const auto& group : groups_)
      for (const auto& p : group.parameters) s.parameters.push_back({p->name(), p->rows(), p->cols(), state_[slot++]});
    return s;
  }

  // Restores a state() of an optimizer of the same kind over parameters of the same names and
  // shapes, in the same order. \throws value_error (wrong optimizer, count, name -- whatever the
  // shapes --, unknown buffer) or shape_error (same name, a shape differs), naming the entry;
  // nothing changes on throw.
  void load_state(const OptimizerState<Scalar>& s) {
    const char* where = name_;
    if (s.optimizer != name_) {
      std::ostringstream message;
      message << where << "::load_state: the state is of '" << s.optimizer << "', not '" << name_ << "'";
      throw value_error(message.str());
    }
    if (s.parameters.size() != slots_.size() || s.step < 0) {
      std::ostringstream message;
      message << where << "::load_state: the state has " << s.parameters.size() << " parameters and step " << s.step
              << ", this optimizer " << slots_.size() << " parameters (and step must be >= 0)";
      throw value_error(message.str());
    }
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      const auto& entry = s.parameters[i];
      const Parameter<Scalar>& p = *slots_[i];
      if (entry.name != p.name() || entry.rows != p.rows() || entry.cols != p.cols()) {
        std::ostringstream message;
        message << where << "::load_state: parameter " << i << " is '" << entry.name << "' [" << entry.rows << ", "
                << entry.cols << "] in the state but '" << p.name() << "' [" << p.rows() << ", " << p.cols()
                << "] here";
        // Another name is another parameter (value_error); the same one of another shape, a shape_error.
        if (entry.name != p.name()) throw value_error(message.str());
        throw shape_error(message.str());
      }
      for (const auto& [key, buffer] : entry.buffers) {
        if (std::find(buffer_names_.begin(), buffer_names_.end(), key) == buffer_names_.end()) {
          std::ostringstream message;
          message << where << "::load_state: parameter '" << entry.name << "' has a buffer '" << key << "' that "
                  << name_ << " does not use";
          throw value_error(message.str());
        }
        detail::check_shape(where, (entry.name + "." + key).c_str(), buffer, p.rows(), p.cols());
      }
    }
    std::vector<std::map<std::string, RowMatrix<Scalar>>> restored;
    restored.reserve(slots_.size());
    for (const auto& entry : s.parameters) restored.push_back(entry.buffers);
    state_ = std::move(restored);
    step_ = s.step;
  }

 protected:
  Optimizer(const char* name, double lr, double default_weight_decay, std::vector<std::string> buffer_names)
      : name_(name), default_weight_decay_(default_weight_decay), buffer_names_(std::move(buffer_names)) {
    set_lr(lr);
    check_weight_decay_value(default_weight_decay);
  }

  // Updates p with learning rate lr and weight decay; `state` holds its buffers by name.
  virtual void update(Parameter<Scalar>& p, double lr, double weight_decay,
                      std::map<std::string, RowMatrix<Scalar>>& state) = 0;
  // Throws if this optimizer cannot apply weight_decay (the lazy ones).
  virtual void check_weight_decay(double) const {}
  // The value the buffer `key` starts from (and a resized buffer's new rows).
  virtual double initial_buffer_value(const std::string& /*key*/) const { return 0.0; }
  // Throws value_error (check_step_constant) if a constant the update of group g at step t would
  // compute in double, with learning rate lr and weight_decay, is not finite in Scalar. Called by
  // step() before anything changes, for each group with a parameter that is not frozen.
  virtual void check_step(std::size_t /*g*/, double /*lr*/, double /*weight_decay*/, std::int64_t /*t*/) const {}

  // value: a constant of group g's update at step t (lr: the group's learning rate), computed in
  // double and rounded to Scalar for the update. Throws value_error unless that is finite.
  void check_step_constant(const char* what, double value, std::size_t g, double lr, std::int64_t t) const {
    if (std::fabs(value) <= static_cast<double>(std::numeric_limits<Scalar>::max())) return;
    std::ostringstream message;
    message << name_ << "::step: " << what << " = " << value << " is not finite in " << detail::scalar_name<Scalar>()
            << " (group " << g << ": lr = lr() x lr_multiplier = " << lr << ", at t = " << t
            << "); nothing was updated";
    throw value_error(message.str());
  }
  // A weight decay: finite and >= 0, and finite in Scalar (coupled Adam multiplies by it there).
  void check_weight_decay_value(double weight_decay) const {
    detail::check_non_negative(name_, "weight_decay", weight_decay);
    detail::check_in_scalar<Scalar>(name_, "weight_decay", weight_decay, "[0, inf)", /*reject_underflow=*/false);
  }

  // The named buffer of p's state, created [rows, cols] filled with `initial` on first use.
  static RowMatrix<Scalar>& buffer(std::map<std::string, RowMatrix<Scalar>>& state, const char* key,
                                   const Parameter<Scalar>& p, Scalar initial = Scalar(0)) {
    auto it = state.find(key);
    if (it == state.end()) it = state.emplace(key, RowMatrix<Scalar>::Constant(p.rows(), p.cols(), initial)).first;
    return it->second;
  }
  // A zero row of p's width, for untouched rows in the exact optimizers.
  const Scalar* zero_row(Index cols) {
    if (static_cast<Index>(zero_.size()) < cols) zero_.assign(static_cast<std::size_t>(cols), Scalar(0));
    return zero_.data();
  }
  Scalar* scratch_row(Index cols) {
    if (static_cast<Index>(scratch_.size()) < cols) scratch_.resize(static_cast<std::size_t>(cols));
    return scratch_.data();
  }

  const char* name_;

 private:
  template <typename>
  friend class detail::StateResize;

  // Throws shape_error, naming <name>::<call>, the parameter and the buffer, if a registered
  // parameter's buffer is not of its [rows, cols]: it was resized without resize_state, and the
  // update would read and write past the buffer. O(parameters * buffers).
  void check_state(const char* call) const {
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      const Parameter<Scalar>& p = *slots_[i];
      for (const auto& [key, buffer] : state_[i]) {
        if (buffer.rows() == p.rows() && buffer.cols() == p.cols()) continue;
        std::ostringstream message;
        message << name_ << "::" << call << ": parameter '" << p.name() << "' is [" << p.rows() << ", " << p.cols()
                << "] but its state '" << key << "' is [" << buffer.rows() << ", " << buffer.cols()
                << "]; call resize_state(parameter) after Parameter::resize_rows (resize_vocabulary does both)";
        throw shape_error(message.str());
      }
    }
  }

  std::ptrdiff_t slot_of(const Parameter<Scalar>* p) const {
    const auto it = std::find(slots_.begin(), slots_.end(), p);
    return it == slots_.end() ? -1 : it - slots_.begin();
  }

  double lr_ = 0;
  double default_weight_decay_ = 0;
  std::vector<std::string> buffer_names_;
  std::int64_t step_ = 0;
  std::vector<ParameterGroup<Scalar>> groups_;
  std::vector<const Parameter<Scalar>*> slots_;  // registration order
  std::vector<std::map<std::string, RowMatrix<Scalar>>> state_;
  std::vector<Scalar> zero_, scratch_;
};

namespace detail {

// resize_state in two halves, as detail::RowResize for the values: the constructor builds p's
// buffers at new_rows rows keeping rows [0, keep) (nothing changed; a parameter not registered
// gives an empty, no-op resize), commit() swaps them in without throwing.
template <typename Scalar>
class StateResize {
 public:
  StateResize(Optimizer<Scalar>& optimizer, const Parameter<Scalar>& p, Index new_rows, Index keep)
      : optimizer_(&optimizer), slot_(optimizer.slot_of(&p)) {
    if (slot_ < 0) return;
    for (const auto& [key, buffer] : optimizer.state_[static_cast<std::size_t>(slot_)]) {
      const Index kept = std::min(keep, buffer.rows());
      RowMatrix<Scalar> resized(new_rows, buffer.cols());
      resized.topRows(kept) = buffer.topRows(kept);
      resized.bottomRows(new_rows - kept).setConstant(static_cast<Scalar>(optimizer.initial_buffer_value(key)));
      buffers_.emplace(key, std::move(resized));
    }
  }
  bool registered() const { return slot_ >= 0; }
  void commit() noexcept {
    if (slot_ >= 0) optimizer_->state_[static_cast<std::size_t>(slot_)].swap(buffers_);
  }

 private:
  Optimizer<Scalar>* optimizer_;
  std::ptrdiff_t slot_;
  std::map<std::string, RowMatrix<Scalar>> buffers_;
};

}  // namespace detail

template <typename Scalar>
bool Optimizer<Scalar>::resize_state(const Parameter<Scalar>& p) {
  const std::ptrdiff_t slot = slot_of(&p);
  if (slot < 0) return false;
  // Kept rows: those below the old row count, which every buffer of p still has.
  Index old_rows = p.rows();
  for (const auto& entry : state_[static_cast<std::size_t>(slot)]) old_rows = std::min(old_rows, entry.second.rows());
  detail::StateResize<Scalar> staged(*this, p, p.rows(), old_rows);
  staged.commit();
  return true;
}

}  // namespace embedhead

#endif  // EMBEDHEAD_OPTIM_OPTIMIZER_HPP
