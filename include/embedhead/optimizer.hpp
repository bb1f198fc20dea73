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
#ifndef EMBEDHEAD_OPTIMIZER_HPP
#define EMBEDHEAD_OPTIMIZER_HPP

#include "errors.hpp"
#include "parameter.hpp"
#include "types.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
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

// One Adam step's constants at step t (torch.optim's), and the update of one row with them:
//   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
//   x -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
template <typename Scalar>
struct AdamRowStep {
  Scalar b1, one_minus_b1, b2, one_minus_b2, step_size, bias2_sqrt, eps;
  AdamRowStep(double beta1, double beta2, double epsilon, double lr, double t)
      : b1(static_cast<Scalar>(beta1)),
        one_minus_b1(static_cast<Scalar>(1.0 - beta1)),
        b2(static_cast<Scalar>(beta2)),
        one_minus_b2(static_cast<Scalar>(1.0 - beta2)),
        step_size(static_cast<Scalar>(lr / (1.0 - std::pow(beta1, t)))),
        bias2_sqrt(static_cast<Scalar>(std::sqrt(1.0 - std::pow(beta2, t)))),
        eps(static_cast<Scalar>(epsilon)) {}
  template <typename X, typename M, typename V, typename G>
  void apply(X&& x, M&& m, V&& v, const G& grad) const {
    m = b1 * m + one_minus_b1 * grad;
    v = b2 * v + one_minus_b2 * grad.square();
    x -= step_size * m / (v.sqrt() / bias2_sqrt + eps);
  }
};

// Calls f(row, gradient row) for the touched rows only. O(touched rows * cols).
template <typename Scalar, typename F>
void for_touched_rows(const RowGradient<Scalar>& g, F&& f) {
  using ConstRow = Eigen::Map<const Eigen::Array<Scalar, 1, Eigen::Dynamic>>;
  for (Index i = 0; i < g.num_touched(); ++i) f(g.touched_rows()[static_cast<std::size_t>(i)], ConstRow(g.touched_row(i).data(), g.cols()));
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
  // negative or not finite, or a weight decay this optimizer cannot apply. Nothing changes on throw.
  void add_group(const ParameterList& parameters, const ParameterGroupOptions& options = {}) {
    const char* where = name_;
    detail::check_non_negative(where, "lr_multiplier", options.lr_multiplier);
    const double weight_decay = options.weight_decay.value_or(default_weight_decay_);
    detail::check_non_negative(where, "weight_decay", weight_decay);
    check_weight_decay(weight_decay);
    for (std::size_t i = 0; i < parameters.size(); ++i) {
      const auto& p = parameters[i];
      if (!p) {
        std::ostringstream message;
        message << where << ": parameter " << i << " of the group is a null pointer";
        throw value_error(message.str());
      }
      const bool earlier_in_group = std::find(parameters.begin(), parameters.begin() + static_cast<std::ptrdiff_t>(i), p) !=
                                    parameters.begin() + static_cast<std::ptrdiff_t>(i);
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
  // \throws value_error unless lr is finite and >= 0 (lr unchanged).
  void set_lr(double lr) {
    detail::check_non_negative(name_, "lr", lr);
    lr_ = lr;
  }
  std::int64_t step_count() const { return step_; }

  // One update of every registered parameter from its current gradient; frozen parameters are
  // skipped (value and state untouched), but the step count t advances once for all. Cost: see the
  // class.
  void step() {
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

  OptimizerState<Scalar> state() const {
    OptimizerState<Scalar> s;
    s.optimizer = name_;
    s.step = step_;
    std::size_t slot = 0;
    for (const auto& group : groups_)
      for (const auto& p : group.parameters) s.parameters.push_back({p->name(), p->rows(), p->cols(), state_[slot++]});
    return s;
  }

  // Restores a state() of an optimizer of the same kind over parameters of the same names and
  // shapes, in the same order. \throws value_error (wrong optimizer, count, name, unknown buffer)
  // or shape_error (a shape differs), naming the entry; nothing changes on throw.
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
        message << where << "::load_state: parameter " << i << " is '" << entry.name << "' [" << entry.rows << ", " << entry.cols
                << "] in the state but '" << p.name() << "' [" << p.rows() << ", " << p.cols() << "] here";
        throw shape_error(message.str());
      }
      for (const auto& [key, buffer] : entry.buffers) {
        if (std::find(buffer_names_.begin(), buffer_names_.end(), key) == buffer_names_.end()) {
          std::ostringstream message;
          message << where << "::load_state: parameter '" << entry.name << "' has a buffer '" << key << "' that " << name_
                  << " does not use";
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
    detail::check_non_negative(name_, "weight_decay", default_weight_decay);
  }

  // Updates p with learning rate lr and weight decay; `state` holds its buffers by name.
  virtual void update(Parameter<Scalar>& p, double lr, double weight_decay, std::map<std::string, RowMatrix<Scalar>>& state) = 0;
  // Throws if this optimizer cannot apply weight_decay (the lazy ones).
  virtual void check_weight_decay(double) const {}
  // The value the buffer `key` starts from (and a resized buffer's new rows).
  virtual double initial_buffer_value(const std::string& /*key*/) const { return 0.0; }

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

// ---- SGD ----

struct SGDOptions {
  double lr = 1e-2;
  double momentum = 0;       // mu in [0, 1)
  bool nesterov = false;     // needs momentum > 0
  double weight_decay = 0;   // decoupled: p *= 1 - lr * weight_decay before the step
};

// For each row r, with g_r = 0 where untouched:
//   p_r *= 1 - lr wd;   buf_r = g_r (first step) or mu buf_r + g_r;   d_r = nesterov ? g_r + mu buf_r : buf_r
//   p_r -= lr d_r       (d_r = g_r without momentum)
// Cost: O(touched rows * d) without momentum and decay (nothing else moves); O(V d) with either.
template <typename Scalar>
class SGD : public Optimizer<Scalar> {
 public:
  explicit SGD(const SGDOptions& options = {}, const typename Optimizer<Scalar>::ParameterList& parameters = {})
      : Optimizer<Scalar>("SGD", options.lr, options.weight_decay, {"momentum_buffer"}), options_(options) {
    detail::check_beta("SGD", "momentum", options.momentum);
    if (options.nesterov && !(options.momentum > 0)) throw value_error("SGD: nesterov = true needs momentum > 0 (momentum = 0)");
    if (!parameters.empty()) this->add_group(parameters);
  }

 protected:
  void update(Parameter<Scalar>& p, double lr, double weight_decay, std::map<std::string, RowMatrix<Scalar>>& state) override {
    const RowGradient<Scalar>& g = static_cast<const Parameter<Scalar>&>(p).grad();
    auto value = p.value();
    const Scalar step = static_cast<Scalar>(lr);
    if (options_.momentum == 0 && weight_decay == 0) {
      detail::for_touched_rows(g, [&](Index r, const auto& grad) { value.row(r).array() -= step * grad; });
      return;
    }
    const Scalar decay = static_cast<Scalar>(1.0 - lr * weight_decay), mu = static_cast<Scalar>(options_.momentum);
    const bool first = state.find("momentum_buffer") == state.end();
    RowMatrix<Scalar>* momentum = options_.momentum > 0 ? &this->buffer(state, "momentum_buffer", p) : nullptr;
    detail::for_every_row(g, this->zero_row(p.cols()), [&](Index r, const auto& grad) {
      auto v = value.row(r).array();
      if (weight_decay != 0) v *= decay;
      if (!momentum) {
        v -= step * grad;
        return;
      }
      auto buf = momentum->row(r).array();
      if (first) buf = grad;
      else buf = mu * buf + grad;
      if (options_.nesterov) v -= step * (grad + mu * buf);
      else v -= step * buf;
    });
  }

 private:
  SGDOptions options_;
};

// ---- Adam and AdamW (exact) ----

struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;  // each in [0, 1)
  double eps = 1e-8;                  // > 0
  double weight_decay = 0.01;         // AdamW's default; decoupled unless decoupled = false
  bool decoupled = true;              // true: AdamW (p *= 1 - lr wd); false: Adam (g += wd p)
};

// Every row, every step, with g_r = 0 where untouched (torch.optim.AdamW / Adam):
//   p_r *= 1 - lr wd            (AdamW)        or   g_r += wd p_r   (Adam)
//   m_r = beta1 m_r + (1 - beta1) g_r;   v_r = beta2 v_r + (1 - beta2) g_r^2
//   p_r -= lr / (1 - beta1^t) * m_r / (sqrt(v_r) / sqrt(1 - beta2^t) + eps)
// So an untouched row still moves: its moments decay, its update continues, decay shrinks it.
// Cost O(V d) per step; state m, v [V, d].
template <typename Scalar>
class AdamW : public Optimizer<Scalar> {
 public:
  explicit AdamW(const AdamOptions& options = {}, const typename Optimizer<Scalar>::ParameterList& parameters = {})
      : Optimizer<Scalar>(options.decoupled ? "AdamW" : "Adam", options.lr, options.weight_decay, {"exp_avg", "exp_avg_sq"}),
        options_(options) {
    check_adam_options(this->name_, options);
    if (!parameters.empty()) this->add_group(parameters);
  }

  static void check_adam_options(const char* where, const AdamOptions& options) {
    detail::check_beta(where, "beta1", options.beta1);
    detail::check_beta(where, "beta2", options.beta2);
    if (!(options.eps > 0) || !std::isfinite(options.eps)) detail::throw_hyperparameter(where, "eps", options.eps, "(0, inf)");
  }

 protected:
  void update(Parameter<Scalar>& p, double lr, double weight_decay, std::map<std::string, RowMatrix<Scalar>>& state) override {
    const RowGradient<Scalar>& g = static_cast<const Parameter<Scalar>&>(p).grad();
    auto value = p.value();
    RowMatrix<Scalar>& m = this->buffer(state, "exp_avg", p);
    RowMatrix<Scalar>& v = this->buffer(state, "exp_avg_sq", p);
    const detail::AdamRowStep<Scalar> adam(options_.beta1, options_.beta2, options_.eps, lr,
                                           static_cast<double>(this->step_count()));
    const Scalar decay = static_cast<Scalar>(1.0 - lr * weight_decay), wd = static_cast<Scalar>(weight_decay);
    typename Optimizer<Scalar>::Row coupled(this->scratch_row(p.cols()), p.cols());
    detail::for_every_row(g, this->zero_row(p.cols()), [&](Index r, const auto& grad) {
      auto x = value.row(r).array();
      if (weight_decay != 0 && options_.decoupled) x *= decay;
      if (weight_decay != 0 && !options_.decoupled) {
        coupled = grad + wd * x;
        adam.apply(x, m.row(r).array(), v.row(r).array(), coupled);
      } else {
        adam.apply(x, m.row(r).array(), v.row(r).array(), grad);
      }
    });
  }

 private:
  AdamOptions options_;
};

// ---- lazy Adam ----

// Adam on the touched rows only (PyTorch's SparseAdam, TensorFlow's LazyAdam): for each touched
// row, the update of AdamW above without weight decay; an untouched row's value and moments stay
// exactly as they were, and t counts optimizer steps. Equal to AdamW(weight_decay = 0) when every
// row is touched every step; different otherwise (AdamW keeps moving rows with a stale momentum).
// Cost O(touched rows * d) per step; state m, v [V, d]. Weight decay is rejected: applied to
// touched rows only it would shrink frequent tokens and spare rare ones.
template <typename Scalar>
class LazyAdam : public Optimizer<Scalar> {
 public:
  explicit LazyAdam(AdamOptions options = lazy_defaults(), const typename Optimizer<Scalar>::ParameterList& parameters = {})
      : Optimizer<Scalar>("LazyAdam", options.lr, options.weight_decay, {"exp_avg", "exp_avg_sq"}), options_(options) {
    AdamW<Scalar>::check_adam_options("LazyAdam", options);
    check_weight_decay(options.weight_decay);
    if (!parameters.empty()) this->add_group(parameters);
  }
  static AdamOptions lazy_defaults() {
    AdamOptions options;
    options.weight_decay = 0;
    return options;
  }

 protected:
  void check_weight_decay(double weight_decay) const override {
    if (weight_decay != 0) {
      std::ostringstream message;
      message << "LazyAdam: weight_decay = " << weight_decay
              << " is not supported (only 0): lazy decay would spare untouched rows; use AdamW";
      throw value_error(message.str());
    }
  }
  void update(Parameter<Scalar>& p, double lr, double, std::map<std::string, RowMatrix<Scalar>>& state) override {
    const RowGradient<Scalar>& g = static_cast<const Parameter<Scalar>&>(p).grad();
    auto value = p.value();
    RowMatrix<Scalar>& m = this->buffer(state, "exp_avg", p);
    RowMatrix<Scalar>& v = this->buffer(state, "exp_avg_sq", p);
    const detail::AdamRowStep<Scalar> adam(options_.beta1, options_.beta2, options_.eps, lr,
                                           static_cast<double>(this->step_count()));
    detail::for_touched_rows(g, [&](Index r, const auto& grad) {
      adam.apply(value.row(r).array(), m.row(r).array(), v.row(r).array(), grad);
    });
  }

 private:
  AdamOptions options_;
};

// ---- Adagrad ----

struct AdagradOptions {
  double lr = 1e-2;
  double lr_decay = 0;                   // lr_t = lr / (1 + (t - 1) lr_decay)
  double initial_accumulator_value = 0;  // G starts here, >= 0
  double eps = 1e-10;                    // > 0
};

// For each touched row (torch.optim.Adagrad): G_r += g_r^2;  p_r -= lr_t g_r / (sqrt(G_r) + eps).
// An untouched row has g_r = 0 and would not change, so the sparse walk is exact: O(touched rows
// * d) per step; state G [V, d]. No weight decay (as PyTorch's Adagrad with sparse gradients).
template <typename Scalar>
class Adagrad : public Optimizer<Scalar> {
 public:
  explicit Adagrad(const AdagradOptions& options = {}, const typename Optimizer<Scalar>::ParameterList& parameters = {})
      : Optimizer<Scalar>("Adagrad", options.lr, 0.0, {"sum"}), options_(options) {
    detail::check_non_negative("Adagrad", "lr_decay", options.lr_decay);
    detail::check_non_negative("Adagrad", "initial_accumulator_value", options.initial_accumulator_value);
    if (!(options.eps > 0) || !std::isfinite(options.eps)) detail::throw_hyperparameter("Adagrad", "eps", options.eps, "(0, inf)");
    if (!parameters.empty()) this->add_group(parameters);
  }

 protected:
  void check_weight_decay(double weight_decay) const override {
    if (weight_decay != 0) {
      std::ostringstream message;
      message << "Adagrad: weight_decay = " << weight_decay << " is not supported (only 0), as in PyTorch with sparse gradients";
      throw value_error(message.str());
    }
  }
  double initial_buffer_value(const std::string&) const override { return options_.initial_accumulator_value; }
  void update(Parameter<Scalar>& p, double lr, double, std::map<std::string, RowMatrix<Scalar>>& state) override {
    const RowGradient<Scalar>& g = static_cast<const Parameter<Scalar>&>(p).grad();
    auto value = p.value();
    RowMatrix<Scalar>& sum = this->buffer(state, "sum", p, static_cast<Scalar>(options_.initial_accumulator_value));
    const double t = static_cast<double>(this->step_count());
    const Scalar clr = static_cast<Scalar>(lr / (1.0 + (t - 1.0) * options_.lr_decay));
    const Scalar eps = static_cast<Scalar>(options_.eps);
    detail::for_touched_rows(g, [&](Index r, const auto& grad) {
      auto s = sum.row(r).array();
      s += grad.square();
      value.row(r).array() -= clr * grad / (s.sqrt() + eps);
    });
  }

 private:
  AdagradOptions options_;
};

// ---- gradient clipping ----

// -> the global L2 norm of the gradients of the distinct, not frozen `parameters` (a tied table
// listed twice counts once, each touched row once; dense gradients every row; frozen parameters
// are neither counted nor scaled), accumulated in double. When it
// exceeds max_norm, every gradient is multiplied by max_norm / (norm + 1e-6), as PyTorch's
// clip_grad_norm_. \throws value_error if max_norm is negative or not finite, or a parameter is
// null (nothing scaled). Cost O(touched rows * d).
// Any parameter list: Parameter<Scalar>, a low-precision Parameter<Storage, float> or
// ParameterBase<float> (the gradients are Scalar / float in every case).
namespace detail {
template <typename P>
double clip_grad_norm_impl(const std::vector<std::shared_ptr<P>>& parameters, double max_norm) {
  using Scalar = typename P::grad_type;
  detail::check_non_negative("clip_grad_norm", "max_norm", max_norm);
  for (std::size_t i = 0; i < parameters.size(); ++i)
    if (!parameters[i]) {
      std::ostringstream message;
      message << "clip_grad_norm: parameter " << i << " is a null pointer";
      throw value_error(message.str());
    }
  auto unique = unique_parameters(parameters);
  unique.erase(std::remove_if(unique.begin(), unique.end(), [](const auto& p) { return p->frozen(); }), unique.end());
  double squares = 0;
  for (const auto& p : unique) {
    const RowGradient<Scalar>& g = static_cast<const P&>(*p).grad();
    for (Index i = 0; i < g.num_touched(); ++i) squares += g.touched_row(i).template cast<double>().squaredNorm();
  }
  const double norm = std::sqrt(squares);
  if (norm > max_norm) {
    const Scalar factor = static_cast<Scalar>(max_norm / (norm + 1e-6));
    for (const auto& p : unique) {
      RowGradient<Scalar>& g = p->grad();
      for (Index i = 0; i < g.num_touched(); ++i) g.touched_row(i) *= factor;
    }
  }
  return norm;
}
}  // namespace detail

template <typename Scalar, typename Value = Scalar>
double clip_grad_norm(const std::vector<std::shared_ptr<Parameter<Value, Scalar>>>& parameters, double max_norm) {
  return detail::clip_grad_norm_impl(parameters, max_norm);
}
template <typename P, typename = typename P::grad_type>
double clip_grad_norm(const std::vector<std::shared_ptr<P>>& parameters, double max_norm) {
  return detail::clip_grad_norm_impl(parameters, max_norm);
}

// ---- learning-rate schedules ----

// multiplier(t) for optimizer step t = 0, 1, 2, ... (the step about to be taken); set
//   optimizer.set_lr(base_lr * schedule(optimizer.step_count()))
// before each step. Linear warm-up: (t + 1) / warmup for t < warmup, then 1. Cosine: after the
// warm-up, min_ratio + (1 - min_ratio) (1 + cos(pi progress)) / 2 with progress = (t - warmup) /
// (total - warmup) clamped to [0, 1].
class LrSchedule {
 public:
  static LrSchedule constant() { return LrSchedule(0, 0, 1.0, false); }
  // \throws value_error if warmup_steps < 0.
  static LrSchedule linear_warmup(std::int64_t warmup_steps) {
    check_steps("linear_warmup", "warmup_steps", warmup_steps);
    return LrSchedule(warmup_steps, 0, 1.0, false);
  }
  // \throws value_error if warmup_steps < 0, total_steps <= warmup_steps or min_ratio outside [0, 1].
  static LrSchedule warmup_cosine(std::int64_t warmup_steps, std::int64_t total_steps, double min_ratio = 0.0) {
    check_steps("warmup_cosine", "warmup_steps", warmup_steps);
    if (total_steps <= warmup_steps) {
      std::ostringstream message;
      message << "LrSchedule::warmup_cosine: total_steps = " << total_steps << " outside (" << warmup_steps
              << ", inf) (must exceed warmup_steps)";
      throw value_error(message.str());
    }
    if (!(min_ratio >= 0 && min_ratio <= 1)) detail::throw_hyperparameter("LrSchedule::warmup_cosine", "min_ratio", min_ratio, "[0, 1]");
    return LrSchedule(warmup_steps, total_steps, min_ratio, true);
  }

  double operator()(std::int64_t t) const {
    if (t < warmup_) return static_cast<double>(t + 1) / static_cast<double>(warmup_);
    if (!cosine_) return 1.0;
    const double progress = std::clamp(static_cast<double>(t - warmup_) / static_cast<double>(total_ - warmup_), 0.0, 1.0);
    return min_ratio_ + (1.0 - min_ratio_) * 0.5 * (1.0 + std::cos(3.14159265358979323846 * progress));
  }

 private:
  LrSchedule(std::int64_t warmup, std::int64_t total, double min_ratio, bool cosine)
      : warmup_(warmup), total_(total), min_ratio_(min_ratio), cosine_(cosine) {}
  static void check_steps(const char* where, const char* what, std::int64_t steps) {
    if (steps < 0) {
      std::ostringstream message;
      message << "LrSchedule::" << where << ": " << what << " = " << steps << " outside [0, inf)";
      throw value_error(message.str());
    }
  }
  std::int64_t warmup_, total_;
  double min_ratio_;
  bool cosine_;
};

}  // namespace embedhead

#endif  // EMBEDHEAD_OPTIMIZER_HPP
