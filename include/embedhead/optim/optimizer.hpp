// embedhead: optimizers that know which rows of a gradient are non-zero.
//
// An embedding table's gradient touches a few hundred of V rows per step (RowGradient keeps them
// sparse). What an optimizer does with the other rows is a semantic choice, not an implementation
// detail -- the seeds' warning: a zero gradient does not mean an unchanged row.
//
//   exact (dense) semantics, every row every step, O(V d):
//     SGD with momentum or weight decay   momentum keeps moving rows, decay shrinks them
//     Adam / AdamW                        moments of untouched rows decay, their update continues
//   lazy (sparse) semantics, touched rows only, O(touched rows * d):
//     LazyAdam        PyTorch's SparseAdam (its formula exactly) / TensorFlow's LazyAdam: an
//                     untouched row's moments and value are left exactly as they were.
//     RowWiseAdagrad  FBGEMM's rowwise Adagrad: one accumulator per row, V values of state.
//     LazyAdamW       AdamW with exact catch-up: an untouched row lags, and its next touch (or
//                     catch_up()) applies the skipped steps' decoupled decay and moment decay in
//                     closed form; with beta1 = 0 that is dense AdamW's trajectory (to rounding).
//   both at once (nothing happens to an untouched row under either):
//     SGD without momentum and decay, Adagrad
//
// Formulas follow PyTorch's torch.optim (SparseAdam for LazyAdam; FBGEMM for RowWiseAdagrad), so
// a trajectory matches the reference's to float rounding. Every optimizer holds parameter groups (a
// per-group multiplier of the learning rate -- the seeds cite eta_E / eta_W ~ sqrt(d) -- and a
// per-group weight decay); a parameter may appear once only (pass tied layers' lists through
// unique_parameters()).
//
// Step counts, and a parameter without a gradient. As in PyTorch, each parameter has its own step
// count t (step_count(p)), which its bias corrections (Adam) and lr decay (Adagrad) use, beside
// the optimizer's count of step() calls (step_count(), what a schedule reads). A parameter whose
// gradient has no touched row (zero_grad and no backward reached it since: RowGradient's
// num_touched() == 0, the form PyTorch's `grad is None` takes here) is skipped by step() -- as
// PyTorch skips a parameter whose grad is None: its value, its buffers and its t stay exactly as
// they are (no moment decay, no weight decay, no momentum) -- while skip_parameters_without_grad()
// is true, the default. set_skip_parameters_without_grad(false) steps it with a zero gradient
// instead, as PyTorch does for a grad that is a zero tensor (zero_grad(set_to_none=False)): Adam's
// moments decay and its update continues, decay shrinks it, t advances. A gradient with touched
// rows of value zero is a gradient (it is stepped either way); in dense mode every row is touched.
//
// A frozen parameter (Parameter::set_frozen) is skipped by step() whatever that option -- its
// value, state and t stay as they are -- and by clip_grad_norm. After a parameter's row count
// changes (Parameter::resize_rows, resize_vocabulary), resize_state() makes its buffers follow.
//
// Trainable rows (Parameter::set_trainable_rows(ids), k of V rows): the state of such a parameter
// holds those k rows only (each buffer [k, cols], row i that of ids[i]; "trainable_rows" in
// state()), every update runs over them only -- the exact optimizers' "every row" is every
// trainable row -- and the other rows stay exactly as they are: no decay, no momentum, no state.
// So memory and step time scale with k, not V. A mask set or changed after the state was made
// needs resize_state(p) (rows in both keep their state; new ones start fresh); step() refuses
// until then.
//
// Low-precision parameters (Parameter<Eigen::bfloat16, float>, Parameter<Eigen::half, float>: the
// bf16/fp16 layers' tables) are stepped like float ones: each row the update reads is widened to
// float, updated by the same formulas with the state in float, and written back by the optimizer's
// LowPrecisionUpdate mode (set_low_precision_update; stochastic rounding by default): nearest
// (round-to-nearest-even, which loses an update below half an ulp), stochastic (unbiased, its draws
// from the counter-based Rng keyed by seed, parameter, step, row and column) or kahan (a float
// compensation buffer "kahan_compensation" [V, d] in the state). optim/low_precision_update.hpp has
// the rounding and ValueRows, the one seam through which every optimizer reads and writes a row.
//
// This header holds what every optimizer shares (parameter groups, the step count, state save and
// restore, resize_state); each optimizer has a header of its own beside it (sgd.hpp, adamw.hpp,
// lazy_adam.hpp, lazy_adamw.hpp, adagrad.hpp, rowwise_adagrad.hpp), with clip.hpp (gradient
// clipping), schedule.hpp (learning-rate schedules) and untrained_guard.hpp (per-row update
// counts: which rows no step ever updated, a batch check for their ids, and a repair to the mean
// of the trained rows -- the reserved-token rows behind inf / NaN gradient norms).
#ifndef EMBEDHEAD_OPTIM_OPTIMIZER_HPP
#define EMBEDHEAD_OPTIM_OPTIMIZER_HPP

#include "../detail/checks.hpp"
#include "../errors.hpp"
#include "../parameter.hpp"
#include "../types.hpp"
#include "low_precision_update.hpp"

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

// A group holds Scalar parameters (`parameters`) or low-precision ones (`low_precision`, bf16 /
// fp16 values with a Scalar gradient), as it was added.
template <typename Scalar>
struct ParameterGroup {
  std::vector<std::shared_ptr<Parameter<Scalar>>> parameters;
  double lr_multiplier = 1.0;
  double weight_decay = 0.0;
  std::vector<std::shared_ptr<ParameterBase<Scalar>>> low_precision = {};
};

// Everything an optimizer needs to continue where it stopped: the count of step() calls and, per
// parameter (in registration order), its name, shape, its own step count and named buffers
// ("exp_avg", "exp_avg_sq", "momentum_buffer", "sum"; "kahan_compensation" for a low-precision
// parameter under LowPrecisionUpdate::kahan), each [rows, cols] (RowWiseAdagrad's "sum",
// LazyAdamW's per-row "last_step", "decay_mantissa", "decay_exponent": [rows, 1]), and named
// per-parameter scalars in double (LazyAdamW's running decay, "decay_mantissa" and
// "decay_exponent"; the other optimizers have none). A buffer or scalar not created yet is absent.
// An entry's step unset (a state saved before parameters had their own counts) means the state's
// step.
template <typename Scalar>
struct OptimizerState {
  std::string optimizer;
  std::int64_t step = 0;
  struct Entry {
    std::string name;
    Index rows = 0, cols = 0;
    std::map<std::string, RowMatrix<Scalar>> buffers;
    std::optional<std::int64_t> step = std::nullopt;  // this parameter's t, in [0, step]
    std::map<std::string, double> scalars = {};       // per-parameter scalars (LazyAdamW)
    // The rows the buffers hold (Parameter::set_trainable_rows): each buffer is then [k, ...], row
    // i that of trainable_rows[i]. Unset: every row.
    std::optional<std::vector<Index>> trainable_rows = std::nullopt;
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

// The rows an update visits are numbered as the state's rows: row r of the parameter without a
// row mask, and with one (Parameter::set_trainable_rows) i, the i-th trainable row -- the index
// into the state's [k, cols] buffers and into ValueRows, which maps it back to the value's row.

// Calls f(state row, gradient row) for every row of the parameter (every trainable row with a
// mask); untouched rows get `zero` (a zero row of length cols). O(rows * cols), O(k * cols).
template <typename Scalar, typename F>
void for_every_row(const RowGradient<Scalar>& g, const Scalar* zero, F&& f) {
  using ConstRow = Eigen::Map<const Eigen::Array<Scalar, 1, Eigen::Dynamic>>;
  const auto& touched = g.touched_rows();
  const bool masked = g.has_row_mask();
  const Index count = masked ? static_cast<Index>(g.row_mask().size()) : g.rows();
  std::size_t next = 0;
  for (Index i = 0; i < count; ++i) {
    const Index r = masked ? g.row_mask()[static_cast<std::size_t>(i)] : i;
    if (next < touched.size() && touched[next] == r) {
      f(i, ConstRow(g.touched_row(static_cast<Index>(next)).data(), g.cols()));
      ++next;
    } else {
      f(i, ConstRow(zero, g.cols()));
    }
  }
}

// Calls f(state row, gradient row) for the touched rows only. O(touched rows * cols) (plus O(k)
// with a mask, to number them).
template <typename Scalar, typename F>
void for_touched_rows(const RowGradient<Scalar>& g, F&& f) {
  using ConstRow = Eigen::Map<const Eigen::Array<Scalar, 1, Eigen::Dynamic>>;
  const auto& touched = g.touched_rows();
  if (!g.has_row_mask()) {
    for (Index i = 0; i < g.num_touched(); ++i)
      f(touched[static_cast<std::size_t>(i)], ConstRow(g.touched_row(i).data(), g.cols()));
    return;
  }
  const auto& mask = g.row_mask();  // touched rows are mask rows: one forward walk numbers them
  std::size_t m = 0;
  for (Index i = 0; i < g.num_touched(); ++i) {
    while (mask[m] != touched[static_cast<std::size_t>(i)]) ++m;
    f(static_cast<Index>(m), ConstRow(g.touched_row(i).data(), g.cols()));
  }
}

// The rows an optimizer state holds: a row mask's ids, or every row (nullopt).
using StateRows = std::optional<std::vector<Index>>;
inline StateRows state_rows_of(const std::vector<Index>* trainable) {
  return trainable ? StateRows(*trainable) : StateRows();
}
inline std::string describe_state_rows(const StateRows& rows, Index all) {
  if (!rows) return "every row (" + std::to_string(all) + ")";
  return std::to_string(rows->size()) + " trainable rows";
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
    add_group_of(parameters, options);
  }

  // A group of low-precision parameters (Parameter<Storage, Scalar>, Storage = Eigen::bfloat16 or
  // Eigen::half): updated in Scalar and written back by low_precision_update() (see the header).
  // \throws as above.
  template <typename Storage, typename = std::enable_if_t<is_low_precision_v<Storage>>>
  void add_group(const std::vector<std::shared_ptr<Parameter<Storage, Scalar>>>& parameters,
                 const ParameterGroupOptions& options = {}) {
    add_group_of(parameters, options);
  }

  // How low-precision parameters are written back (see the header); float parameters ignore it.
  const LowPrecisionUpdateOptions& low_precision_update() const { return low_precision_; }
  // Sets it. Leaving kahan drops the compensation buffers (each value keeps its rounded storage);
  // entering it starts them at zero. \throws value_error for a mode that is not a
  // LowPrecisionUpdate value (naming it); nothing changes on throw.
  void set_low_precision_update(const LowPrecisionUpdateOptions& options) {
    detail::check_low_precision_update((std::string(name_) + "::set_low_precision_update").c_str(), options.mode);
    if (options.mode != LowPrecisionUpdate::kahan)
      for (auto& buffers : state_) buffers.erase(detail::kKahanBuffer);
    low_precision_ = options;
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
  // -> the number of step() calls (what a schedule reads).
  std::int64_t step_count() const { return step_; }
  // -> p's own step count t: the steps that updated it (see the header; at most step_count()).
  // \throws value_error if p is not registered here.
  std::int64_t step_count(const ParameterBase<Scalar>& p) const {
    const std::ptrdiff_t slot = slot_of(&p);
    if (slot < 0) {
      std::ostringstream message;
      message << name_ << "::step_count: parameter '" << p.name() << "' [" << p.rows() << ", " << p.cols()
              << "] is not registered with this optimizer";
      throw value_error(message.str());
    }
    return steps_[static_cast<std::size_t>(slot)];
  }

  // Whether step() skips a parameter whose gradient has no touched row (true, the default:
  // PyTorch's treatment of a grad that is None) or steps it with a zero gradient (false). See the
  // header.
  bool skip_parameters_without_grad() const { return skip_without_grad_; }
  void set_skip_parameters_without_grad(bool skip) { skip_without_grad_ = skip; }

  // One update of every registered parameter from its current gradient, each with its own step
  // count t, which advances by one; skipped (value, state and t untouched): frozen parameters, and
  // parameters whose gradient has no touched row unless skip_parameters_without_grad() is false.
  // step_count() advances once. Cost: see each optimizer.
  // \throws shape_error if a registered parameter's buffers no longer have its shape (it was
  // resized, Parameter::resize_rows, without resize_state: frozen parameters included);
  // value_error if a constant of this step's update of a parameter it steps -- the group's
  // learning rate lr() x lr_multiplier, Adam's lr / (1 - beta1^t), the decoupled decay 1 - lr
  // weight_decay -- is not finite in Scalar. Nothing changes on throw, the step counts included.
  void step() {
    check_state("step");
    for (std::size_t s = 0; s < slots_.size(); ++s) {
      const auto& group = groups_[slots_[s].group];
      if (steps_this_time(*slots_[s].base))
        check_step(slots_[s].group, lr_ * group.lr_multiplier, group.weight_decay, steps_[s] + 1);
    }
    // A state made now holds the parameter's trainable rows (all rows without a mask).
    for (std::size_t s = 0; s < slots_.size(); ++s)
      if (state_[s].empty()) state_rows_[s] = detail::state_rows_of(slots_[s].base->trainable_rows());
    // The Kahan buffers this step writes, created before anything else changes.
    for (std::size_t s = 0; s < slots_.size(); ++s)
      if (steps_this_time(*slots_[s].base)) compensation_of(s);
    ++step_;
    for (std::size_t s = 0; s < slots_.size(); ++s) {
      const auto& group = groups_[slots_[s].group];
      if (!steps_this_time(*slots_[s].base)) continue;
      ++steps_[s];
      ValueRows<Scalar> value = value_rows(s);
      update(*slots_[s].base, value, lr_ * group.lr_multiplier, group.weight_decay, steps_[s], state_[s]);
    }
  }

  // After p's row count or its trainable rows changed (Parameter::resize_rows,
  // Parameter::set_trainable_rows): resizes each of p's buffers to [p.rows(), its cols] (with a
  // row mask, [k, its cols], each trainable row keeping its state if the old state held it). Rows below both the old
  // and the new count keep their values bit for bit; new rows start from the buffer's initial value (0 for exp_avg,
  // exp_avg_sq, momentum_buffer and RowWiseAdagrad's sum; initial_accumulator_value for Adagrad's sum), as if never
  // updated. p's step count t is unchanged, so a new row's first Adam update is bias-corrected with the current t, as
  // PyTorch's SparseAdam treats a row seen for the first time. A buffer not created yet stays absent. -> false,
  // changing nothing, when p is not registered here. Strong guarantee (new buffers are built, then swapped in). Cost
  // O(rows * cols) per buffer.
  bool resize_state(const ParameterBase<Scalar>& p);

  // zero_grad() of every registered parameter.
  void zero_grad() {
    for (const auto& slot : slots_) slot.base->zero_grad();
  }

  // -> the step count and every registered parameter's buffers, in registration order.
  // \throws shape_error if a parameter's buffers no longer have its shape (as step).
  OptimizerState<Scalar> state() const {
    check_state("state");
    OptimizerState<Scalar> s;
    s.optimizer = name_;
    s.step = step_;
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      const ParameterBase<Scalar>& p = *slots_[i].base;
      s.parameters.push_back({p.name(), p.rows(), p.cols(), state_[i], steps_[i], scalars_[i],
                              state_[i].empty() ? detail::state_rows_of(p.trainable_rows()) : state_rows_[i]});
    }
    return s;
  }

  // Restores a state() of an optimizer of the same kind over parameters of the same names and
  // shapes, in the same order; an entry without its own step takes the state's. \throws
  // value_error (wrong optimizer, count, name -- whatever the shapes --, unknown buffer, an entry's
  // step outside [0, step]) or shape_error (same name, a shape differs, a buffer not of its
  // shape), naming the entry; nothing changes on throw.
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
      const ParameterBase<Scalar>& p = *slots_[i].base;
      if (entry.name != p.name() || entry.rows != p.rows() || entry.cols != p.cols()) {
        std::ostringstream message;
        message << where << "::load_state: parameter " << i << " is '" << entry.name << "' [" << entry.rows << ", "
                << entry.cols << "] in the state but '" << p.name() << "' [" << p.rows() << ", " << p.cols()
                << "] here";
        // Another name is another parameter (value_error); the same one of another shape, a shape_error.
        if (entry.name != p.name()) throw value_error(message.str());
        throw shape_error(message.str());
      }
      if (entry.step && (*entry.step < 0 || *entry.step > s.step)) {
        std::ostringstream message;
        message << where << "::load_state: parameter " << i << " ('" << entry.name << "') has step " << *entry.step
                << " outside [0, " << s.step << "] (the state's step)";
        throw value_error(message.str());
      }
      // The state's rows must be the parameter's trainable rows now (set the same mask first).
      const detail::StateRows here = detail::state_rows_of(p.trainable_rows());
      if (!entry.buffers.empty() && entry.trainable_rows != here) {
        std::ostringstream message;
        message << where << "::load_state: parameter '" << entry.name << "' has state for "
                << detail::describe_state_rows(entry.trainable_rows, entry.rows) << " but "
                << detail::describe_state_rows(here, p.rows())
                << " here, or other ids; set the same trainable rows (Parameter::set_trainable_rows) before load_state";
        throw value_error(message.str());
      }
      const Index state_rows = here ? static_cast<Index>(here->size()) : p.rows();
      for (const auto& [key, buffer] : entry.buffers) {
        if (key == detail::kKahanBuffer &&
            !(slots_[i].low_precision() && low_precision_.mode == LowPrecisionUpdate::kahan)) {
          std::ostringstream message;
          message << where << "::load_state: parameter '" << entry.name << "' has a buffer '" << key << "', which "
                  << (slots_[i].low_precision()
                          ? "only the kahan low-precision update uses (this optimizer's is "
                          : "only a low-precision parameter with the kahan update has (this one is ")
                  << (slots_[i].low_precision() ? low_precision_update_name(low_precision_.mode)
                                                : detail::scalar_name<Scalar>())
                  << ")";
          throw value_error(message.str());
        }
        if (key != detail::kKahanBuffer &&
            std::find(buffer_names_.begin(), buffer_names_.end(), key) == buffer_names_.end()) {
          std::ostringstream message;
          message << where << "::load_state: parameter '" << entry.name << "' has a buffer '" << key << "' that "
                  << name_ << " does not use";
          throw value_error(message.str());
        }
        detail::check_shape(where, (entry.name + "." + key).c_str(), buffer, state_rows, cols_of(key, p.cols()));
      }
      for (const auto& [key, value] : entry.scalars) {
        const auto names = scalar_names();
        if (std::find(names.begin(), names.end(), key) != names.end()) continue;
        std::ostringstream message;
        message << where << "::load_state: parameter '" << entry.name << "' has a scalar '" << key << "' = " << value
                << " that " << name_ << " does not use";
        throw value_error(message.str());
      }
      check_entry(entry, entry.step.value_or(s.step));
    }
    std::vector<std::map<std::string, RowMatrix<Scalar>>> restored;
    restored.reserve(slots_.size());
    std::vector<std::int64_t> steps;
    steps.reserve(slots_.size());
    std::vector<std::map<std::string, double>> scalars;
    scalars.reserve(slots_.size());
    std::vector<detail::StateRows> state_rows;
    state_rows.reserve(slots_.size());
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      const auto& entry = s.parameters[i];
      restored.push_back(entry.buffers);
      steps.push_back(entry.step.value_or(s.step));
      scalars.push_back(entry.scalars);
      state_rows.push_back(detail::state_rows_of(slots_[i].base->trainable_rows()));
    }
    state_ = std::move(restored);
    steps_ = std::move(steps);
    scalars_ = std::move(scalars);
    state_rows_ = std::move(state_rows);
    step_ = s.step;
  }

 protected:
  Optimizer(const char* name, double lr, double default_weight_decay, std::vector<std::string> buffer_names)
      : name_(name), default_weight_decay_(default_weight_decay), buffer_names_(std::move(buffer_names)) {
    set_lr(lr);
    check_weight_decay_value(default_weight_decay);
  }

  // Updates p with learning rate lr and weight decay at p's step t (>= 1, already advanced);
  // `value` its rows (read each row through value.row(r), updated in Scalar, written back with
  // value.store(r): the seam between the update and the storage); `state` holds its buffers by name.
  virtual void update(ParameterBase<Scalar>& p, ValueRows<Scalar>& value, double lr, double weight_decay,
                      std::int64_t t, std::map<std::string, RowMatrix<Scalar>>& state) = 0;
  // Throws if this optimizer cannot apply weight_decay (the lazy ones).
  virtual void check_weight_decay(double) const {}
  // The value the buffer `key` starts from (and a resized buffer's new rows).
  virtual double initial_buffer_value(const std::string& /*key*/) const { return 0.0; }
  // Fills rows [from, rows) of the buffer `key` that resize_state adds, for a parameter with its
  // own step count t and per-parameter scalars `scalars`: initial_buffer_value(key) unless an
  // optimizer's new rows depend on its state (LazyAdamW stamps them up to date at t).
  virtual void fill_new_rows(const std::string& key, RowMatrix<Scalar>& buffer, Index from,
                             const std::map<std::string, double>& /*scalars*/, std::int64_t /*t*/) const {
    buffer.bottomRows(buffer.rows() - from).setConstant(static_cast<Scalar>(initial_buffer_value(key)));
  }
  // Called by resize_state before p's buffers change, with `value` numbered as p's state still is
  // (value.row(i): state row i, value.value_row(i) its row of p; one at or past p.rows() was dropped
  // by Parameter::resize_rows) and `next`, the rows the state will hold (nullopt: every row of p):
  // LazyAdamW brings the rows that leave the state but stay in p up to date here, so that they
  // take their pending decay with them.
  virtual void before_resize_state(ParameterBase<Scalar>& /*p*/, ValueRows<Scalar>& /*value*/,
                                   std::map<std::string, RowMatrix<Scalar>>& /*state*/,
                                   const std::map<std::string, double>& /*scalars*/, std::int64_t /*t*/,
                                   const detail::StateRows& /*next*/) {}
  // The per-parameter scalars this optimizer keeps (Entry::scalars); load_state refuses others.
  virtual std::vector<std::string> scalar_names() const { return {}; }
  // Throws value_error if an entry load_state is given (of the right names and shapes; its own
  // step count t) holds values this optimizer cannot continue from. Called before anything changes.
  virtual void check_entry(const typename OptimizerState<Scalar>::Entry& /*entry*/, std::int64_t /*t*/) const {}
  // The column count of the buffer `key` of a parameter of `cols` columns: cols, or 1 for a
  // per-row buffer (RowWiseAdagrad's "sum").
  virtual Index buffer_cols(const std::string& /*key*/, Index cols) const { return cols; }
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

  // The named buffer of p's state, created [rows, buffer_cols(key, cols)] filled with `initial`
  // on first use (rows: p's trainable rows' count with a row mask, else p.rows()).
  RowMatrix<Scalar>& buffer(std::map<std::string, RowMatrix<Scalar>>& state, const char* key,
                            const ParameterBase<Scalar>& p, Scalar initial = Scalar(0)) const {
    auto it = state.find(key);
    if (it == state.end())
      it = state.emplace(key, RowMatrix<Scalar>::Constant(state_row_count(p), cols_of(key, p.cols()), initial)).first;
    return it->second;
  }
  // The rows p's state holds: its trainable rows' count (Parameter::set_trainable_rows), or p.rows().
  static Index state_row_count(const ParameterBase<Scalar>& p) {
    const auto* trainable = p.trainable_rows();
    return trainable ? static_cast<Index>(trainable->size()) : p.rows();
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
  // p's per-parameter scalars (Entry::scalars), for update(); p must be registered here.
  std::map<std::string, double>& scalars_of(const ParameterBase<Scalar>& p) {
    return scalars_[static_cast<std::size_t>(slot_of(&p))];
  }
  // Calls f(parameter, its value rows, buffers, scalars, own step count) for each registered
  // parameter, in registration order (a Kahan buffer is created on the way if missing).
  template <typename F>
  void for_each_slot(F&& f) {
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      ValueRows<Scalar> value = value_rows(i);
      f(*slots_[i].base, value, state_[i], scalars_[i], steps_[i]);
    }
  }
  template <typename F>
  void for_each_slot(F&& f) const {
    for (std::size_t i = 0; i < slots_.size(); ++i) f(*slots_[i].base, state_[i], scalars_[i], steps_[i]);
  }

  const char* name_;

  // Throws shape_error, naming <name>::<call>, the parameter and the buffer, if a registered
  // parameter's state holds other rows than its trainable rows now (set_trainable_rows changed
  // them) or a buffer is not of its [rows, buffer_cols]: it was resized without resize_state, and
  // the update would read and write past the buffer. O(parameters * (buffers + k)).
  void check_state(const char* call) const {
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      const ParameterBase<Scalar>& p = *slots_[i].base;
      if (!state_[i].empty()) {
        const auto* trainable = p.trainable_rows();
        const bool same = trainable ? state_rows_[i] && *state_rows_[i] == *trainable : !state_rows_[i];
        if (!same) {
          std::ostringstream message;
          message << name_ << "::" << call << ": parameter '" << p.name() << "' has "
                  << detail::describe_state_rows(detail::state_rows_of(trainable), p.rows()) << " but its state holds "
                  << detail::describe_state_rows(state_rows_[i], p.rows())
                  << (trainable && state_rows_[i] ? " of other ids" : "")
                  << "; call resize_state(parameter) after Parameter::set_trainable_rows";
          throw shape_error(message.str());
        }
      }
      const Index rows = state_row_count(p);
      for (const auto& [key, buffer] : state_[i]) {
        if (buffer.rows() == rows && buffer.cols() == cols_of(key, p.cols())) continue;
        std::ostringstream message;
        message << name_ << "::" << call << ": parameter '" << p.name() << "' is [" << p.rows() << ", " << p.cols()
                << "] but its state '" << key << "' is [" << buffer.rows() << ", " << buffer.cols()
                << "]; call resize_state(parameter) after Parameter::resize_rows (resize_vocabulary does both)";
        throw shape_error(message.str());
      }
    }
  }

  std::ptrdiff_t slot_of(const ParameterBase<Scalar>* p) const {
    for (std::size_t i = 0; i < slots_.size(); ++i)
      if (slots_[i].base == p) return static_cast<std::ptrdiff_t>(i);
    return -1;
  }

 private:
  template <typename>
  friend class detail::StateResize;

  // A registered parameter: its base, and its value as a Scalar, bf16 or fp16 matrix (one set).
  struct Slot {
    ParameterBase<Scalar>* base = nullptr;
    Parameter<Scalar>* full = nullptr;
    Parameter<Eigen::bfloat16, Scalar>* bf16 = nullptr;
    Parameter<Eigen::half, Scalar>* fp16 = nullptr;
    std::size_t group = 0;
    bool low_precision() const { return full == nullptr; }
  };

  template <typename Value>
  void add_group_of(const std::vector<std::shared_ptr<Parameter<Value, Scalar>>>& parameters,
                    const ParameterGroupOptions& options) {
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
    ParameterGroup<Scalar> group{{}, options.lr_multiplier, weight_decay};
    if constexpr (std::is_same_v<Value, Scalar>)
      group.parameters = parameters;
    else
      group.low_precision.assign(parameters.begin(), parameters.end());
    groups_.push_back(std::move(group));
    for (const auto& p : parameters) {
      Slot slot;
      slot.base = p.get();
      if constexpr (std::is_same_v<Value, Scalar>)
        slot.full = p.get();
      else if constexpr (std::is_same_v<Value, Eigen::bfloat16>)
        slot.bf16 = p.get();
      else
        slot.fp16 = p.get();
      slot.group = groups_.size() - 1;
      slots_.push_back(slot);
      state_.emplace_back();
      steps_.push_back(0);
      scalars_.emplace_back();
      state_rows_.emplace_back();
    }
  }

  // The column count of buffer `key`: the Kahan buffer is [rows, cols], the others buffer_cols.
  Index cols_of(const std::string& key, Index cols) const {
    return key == detail::kKahanBuffer ? cols : buffer_cols(key, cols);
  }
  void fill_rows(const std::string& key, RowMatrix<Scalar>& buffer, Index from,
                 const std::map<std::string, double>& scalars, std::int64_t t) const {
    if (key == detail::kKahanBuffer)
      buffer.bottomRows(buffer.rows() - from).setZero();
    else
      fill_new_rows(key, buffer, from, scalars, t);
  }
  // Slot s's Kahan buffer, created (zero) if missing; null unless s is low precision under kahan.
  RowMatrix<Scalar>* compensation_of(std::size_t s) {
    if (!slots_[s].low_precision() || low_precision_.mode != LowPrecisionUpdate::kahan) return nullptr;
    // A state made now holds the parameter's trainable rows.
    if (state_[s].empty()) state_rows_[s] = detail::state_rows_of(slots_[s].base->trainable_rows());
    return &buffer(state_[s], detail::kKahanBuffer, *slots_[s].base);
  }
  // Slot s's rows as its update reads and writes them, at its current step count, numbered as its
  // state is (check_state has made sure the parameter's trainable rows are the state's), or as
  // `rows` says (resize_state, before the state follows a new mask).
  ValueRows<Scalar> value_rows(std::size_t s, const detail::StateRows* rows = nullptr) {
    const Slot& slot = slots_[s];
    const std::vector<Index>* trainable = rows ? (*rows ? &**rows : nullptr) : slot.base->trainable_rows();
    const Index* ids = trainable ? trainable->data() : nullptr;
    if constexpr (!std::is_same_v<Scalar, float>) {
      return ValueRows<Scalar>(*slot.full, ids);  // only float parameters have low-precision values
    } else {
      if (slot.full) return ValueRows<Scalar>(*slot.full, ids);
      const Rng stream(Rng(low_precision_.seed).bits_at(static_cast<std::uint64_t>(s)));
      if (static_cast<Index>(widened_.size()) < slot.base->cols())
        widened_.resize(static_cast<std::size_t>(slot.base->cols()));
      Scalar* scratch = widened_.data();
      if (slot.bf16)
        return ValueRows<Scalar>(*slot.bf16, low_precision_.mode, stream, steps_[s], compensation_of(s), scratch, ids);
      return ValueRows<Scalar>(*slot.fp16, low_precision_.mode, stream, steps_[s], compensation_of(s), scratch, ids);
    }
  }

  // Whether step() updates p now: not frozen, and with a gradient unless those without are stepped.
  bool steps_this_time(const ParameterBase<Scalar>& p) const {
    return !p.frozen() && (!skip_without_grad_ || p.grad().num_touched() > 0);
  }

  double lr_ = 0;
  double default_weight_decay_ = 0;
  std::vector<std::string> buffer_names_;
  std::int64_t step_ = 0;
  bool skip_without_grad_ = true;
  std::vector<ParameterGroup<Scalar>> groups_;
  std::vector<Slot> slots_;  // registration order
  LowPrecisionUpdateOptions low_precision_;
  std::vector<std::map<std::string, RowMatrix<Scalar>>> state_;
  std::vector<std::int64_t> steps_;                     // each parameter's own t, by slot
  std::vector<std::map<std::string, double>> scalars_;  // each parameter's scalars, by slot
  std::vector<detail::StateRows> state_rows_;           // the rows each slot's state holds
  std::vector<Scalar> zero_, scratch_;
  std::vector<Scalar> widened_;  // a low-precision row widened to Scalar (ValueRows)
};

namespace detail {

// resize_state in two halves, as detail::RowResize for the values: the constructor builds p's
// buffers for the rows `rows` of a parameter of new_rows rows -- a row mask's ids, or every row
// (nullopt) -- keeping the state of each row below `keep` that the old state holds (nothing
// changed; a parameter not registered gives an empty, no-op resize); commit() swaps them in
// without throwing. The four-argument form (resize_vocabulary's, before the table's resize is
// committed) takes p's row mask below keep, as RowResize keeps it.
template <typename Scalar>
class StateResize {
 public:
  StateResize(Optimizer<Scalar>& optimizer, const ParameterBase<Scalar>& p, Index new_rows, Index keep)
      : StateResize(optimizer, p, new_rows, keep, kept_mask(p, keep)) {}
  StateResize(Optimizer<Scalar>& optimizer, const ParameterBase<Scalar>& p, Index new_rows, Index keep, StateRows rows)
      : optimizer_(&optimizer), slot_(optimizer.slot_of(&p)), rows_(std::move(rows)) {
    if (slot_ < 0) return;
    const auto slot = static_cast<std::size_t>(slot_);
    const StateRows& old_rows = optimizer.state_rows_[slot];
    const Index count = rows_ ? static_cast<Index>(rows_->size()) : new_rows;
    for (const auto& [key, buffer] : optimizer.state_[slot]) {
      RowMatrix<Scalar> resized(count, buffer.cols());
      if (!rows_ && !old_rows) {  // every row before and after: rows [0, kept) keep their state
        const Index kept = std::min(keep, buffer.rows());
        resized.topRows(kept) = buffer.topRows(kept);
        optimizer.fill_rows(key, resized, kept, optimizer.scalars_[slot], optimizer.steps_[slot]);
      } else {
        // Row by row: a row in the old state (and below keep) keeps it, any other starts fresh.
        RowMatrix<Scalar> fresh(1, buffer.cols());
        optimizer.fill_rows(key, fresh, 0, optimizer.scalars_[slot], optimizer.steps_[slot]);
        for (Index i = 0; i < count; ++i) {
          const Index id = rows_ ? (*rows_)[static_cast<std::size_t>(i)] : i;
          const Index from = id < keep ? old_index(old_rows, buffer.rows(), id) : -1;
          if (from >= 0)
            resized.row(i) = buffer.row(from);
          else
            resized.row(i) = fresh.row(0);
        }
      }
      buffers_.emplace(key, std::move(resized));
    }
  }
  bool registered() const { return slot_ >= 0; }
  void commit() noexcept {
    if (slot_ < 0) return;
    optimizer_->state_[static_cast<std::size_t>(slot_)].swap(buffers_);
    optimizer_->state_rows_[static_cast<std::size_t>(slot_)].swap(rows_);
  }

 private:
  static StateRows kept_mask(const ParameterBase<Scalar>& p, Index keep) {
    const auto* trainable = p.trainable_rows();
    if (!trainable) return StateRows();
    return StateRows(
        std::vector<Index>(trainable->begin(), std::lower_bound(trainable->begin(), trainable->end(), keep)));
  }
  // Row id's index in a state holding `rows` (buffer_rows of them without a mask), or -1.
  static Index old_index(const StateRows& rows, Index buffer_rows, Index id) {
    if (!rows) return id < buffer_rows ? id : -1;
    const auto it = std::lower_bound(rows->begin(), rows->end(), id);
    return it != rows->end() && *it == id ? static_cast<Index>(it - rows->begin()) : -1;
  }

  Optimizer<Scalar>* optimizer_;
  std::ptrdiff_t slot_;
  StateRows rows_;
  std::map<std::string, RowMatrix<Scalar>> buffers_;
};

}  // namespace detail

template <typename Scalar>
bool Optimizer<Scalar>::resize_state(const ParameterBase<Scalar>& p) {
  const std::ptrdiff_t slot = slot_of(&p);
  if (slot < 0) return false;
  const auto s = static_cast<std::size_t>(slot);
  const detail::StateRows next = detail::state_rows_of(p.trainable_rows());
  if (!state_[s].empty()) {
    ValueRows<Scalar> value = value_rows(s, &state_rows_[s]);  // numbered as the state still is
    before_resize_state(*slots_[s].base, value, state_[s], scalars_[s], steps_[s], next);
  }
  // Kept rows: without a mask before, those below the old row count, which every buffer of p still
  // has; with one, every old row (its ids are below p's rows unless p shrank, and ids at or past
  // p.rows() cannot be asked for).
  Index keep = p.rows();
  if (!state_rows_[s])
    for (const auto& entry : state_[s]) keep = std::min(keep, entry.second.rows());
  detail::StateResize<Scalar> staged(*this, p, p.rows(), keep, next);
  staged.commit();
  return true;
}

}  // namespace embedhead

#endif  // EMBEDHEAD_OPTIM_OPTIMIZER_HPP
