// embedhead: lazy AdamW with exact catch-up: only the rows a step's gradient touches are visited,
// and a row's next touch (or catch_up()) first applies, in closed form, what dense AdamW did to it
// while it was not touched (optim/optimizer.hpp has the shared semantics; adamw.hpp the dense
// AdamW this reproduces; lazy_adam.hpp the SparseAdam that instead leaves untouched rows alone).
//
// Dense AdamW (adamw.hpp) at a parameter's step s, with lr_s the group's learning rate at that
// step and f_s = 1 - lr_s wd its decoupled decay, on every row r (g_r = 0 where untouched):
//   p_r *= f_s;   m_r = b1 m_r + (1 - b1) g_r;   v_r = b2 v_r + (1 - b2) g_r^2
//   p_r -= lr_s / (1 - b1^s) * m_r / (sqrt(v_r) / sqrt(1 - b2^s) + eps)
// Over k steps s = l+1 .. l+k in which row r is not touched (g_r = 0), the recurrences close:
//   v_r -> b2^k v_r        m_r -> b1^k m_r        p_r -> (f_{l+1} ... f_{l+k}) p_r - U
// where U = sum_j (f_{s+1} ... f_{l+k}) u_j, s = l + j, j = 1 .. k, is the row's momentum moving it
// on: u_j = lr_s / (1 - b1^s) * b1^j m_r / (sqrt(b2^j v_r) / sqrt(1 - b2^s) + eps). With beta1 = 0,
// m_r = g_r at a touched step and 0 after one untouched step, so U = 0: an untouched row only
// decays, and the closed form is the trajectory.
//
// LazyAdamW, at the parameter's step t, for each touched row r last brought up to date at step l
// (l = 0 for a row never touched; k = t - 1 - l steps skipped between):
//   p_r *= D = f_{l+1} ... f_t          the skipped steps' decays and this step's, at once
//   m_r *= b1^k;   v_r *= b2^k          the skipped steps' moment decay
//   then dense AdamW's step t on the row, without its decay (already in D); l = t.
// An untouched row's value, moments and l are not read or written: its value lags, holding what
// dense AdamW held at its step l. catch_up() (every row of every parameter, O(V d)) applies D =
// f_{l+1} ... f_t and b1^(t - l), b2^(t - l) to each lagging row, so that afterwards every value
// is current; call it before evaluating or saving a model checkpoint. (Saving the optimizer state
// with the lagging values and restoring both continues identically without it.)
//
// In training, the forward pass reads a batch's rows before the step that would catch them up: a
// row last touched at l < t is read without the decays f_{l+1} ... f_t. For the gradients (and so
// the trajectory) to be dense AdamW's, bring the rows about to be read up to date first:
//   optimizer.catch_up(E, ids.data(), ids.size());   // O(ids * d), before embedding.forward(ids)
// A row so caught up at t is then stepped at t + 1 with k = 0. (A head whose every row has a
// gradient every step never lags.)
//
// Against dense AdamW (adamw.hpp), same options, same gradients:
//   beta1 = 0: equal for any touch pattern and any learning-rate schedule, to rounding (D is one
//     multiplication by a product accumulated in double where dense multiplies k times; 1e-12
//     relative in double; float: a few float roundings), once caught up (catch_up(), or the row
//     touched at the step read).
//   beta1 > 0: equal on a row touched at every step. On a row skipped for k steps, dense AdamW
//     moves it k times by its decaying momentum (U above; each term bias-corrected at its own
//     step s); LazyAdamW omits exactly those k moves and nothing else: the decays D, b1^k, b2^k
//     and the step at the next touch are dense's, so the next update uses the same m and v as
//     dense. The difference of the value is U itself, carried on (decayed by later f_s).
// The moment decay uses k; the value's decay uses the product of the f_s actually taken (a
// learning-rate schedule changes lr_s every step): each parameter keeps the running product
// P_t = f_1 ... f_t in double as a mantissa in [0.5, 1) and a power of two ("decay_mantissa",
// "decay_exponent": no underflow however long the run), each row the P of its last update, and
// D = P_t / P_l (the mantissas' quotient times 2^(exponent difference)). Each f_s is rounded to
// Scalar first, as dense AdamW multiplies by it.
//
// State per parameter: m, v [V, d] ("exp_avg", "exp_avg_sq"); per row [V, 1] "last_step" (l, an
// integer held exactly in Scalar), "decay_mantissa", "decay_exponent" (P_l); per parameter the
// scalars "decay_mantissa", "decay_exponent" (P_t). resize_state: new rows are up to date at the
// current t (l = t, P_l = P_t: no decay for steps before they existed, as dense AdamW's new rows),
// and a lagging row that leaves the state (a new row mask, Parameter::set_trainable_rows) is first
// brought up to date, so it keeps the decays it was owed. With trainable rows the
// per-row buffers are [k, ...] (optimizer.hpp).
// Cost O(touched rows * d) per step; catch_up() O(V d). No threads: results do not depend on any
// thread count.
//
// Limits (step() throws value_error before anything changes): the decay f_s = 1 - lr_s wd must be
// in [0.5, 1] (lr_s wd <= 0.5, far beyond any real setting; it keeps each step's exponent change
// to 0 or -1), and t <= 2^24 in float (2^53 in double), the largest step count a Scalar holds
// exactly (the per-row last_step and the exponents are integers stored in Scalar).
#ifndef EMBEDHEAD_OPTIM_LAZY_ADAMW_HPP
#define EMBEDHEAD_OPTIM_LAZY_ADAMW_HPP

#include "adamw.hpp"
#include "optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace embedhead {

// AdamW with lazy rows and exact catch-up (see the header). Default-constructs with PyTorch
// AdamW's defaults (lr 1e-3, betas 0.9 / 0.999, eps 1e-8, weight_decay 0.01).
template <typename Scalar>
class LazyAdamW : public Optimizer<Scalar> {
 public:
  static constexpr double default_weight_decay = 0.01;
  // The largest step count t a Scalar holds exactly: 2^24 (float), 2^53 (double).
  static constexpr std::int64_t max_step = std::int64_t{1} << std::numeric_limits<Scalar>::digits;

  // \throws value_error for lr, betas, eps or weight_decay out of range (as AdamW, naming the
  // value and the range), or as add_group for `parameters`.
  explicit LazyAdamW(const AdamOptions& options = {}, const typename Optimizer<Scalar>::ParameterList& parameters = {})
      : Optimizer<Scalar>("LazyAdamW", options.lr, options.weight_decay.value_or(default_weight_decay),
                          {"exp_avg", "exp_avg_sq", "last_step", "decay_mantissa", "decay_exponent"}),
        options_(options) {
    options_.weight_decay = options.weight_decay.value_or(default_weight_decay);
    detail::check_adam_options<Scalar>("LazyAdamW", options);
    if (!parameters.empty()) this->add_group(parameters);
  }
  const AdamOptions& options() const { return options_; }

  // Brings every row of every registered parameter (frozen ones too: this applies steps already
  // taken, it takes none) up to date with its parameter's step count, so each value is dense
  // AdamW's (beta1 = 0; see the header for beta1 > 0). Step counts unchanged. O(V d).
  // \throws shape_error as step (a parameter resized, or its trainable rows changed, without
  // resize_state); nothing changes.
  void catch_up() {
    this->check_state("catch_up");
    this->for_each_slot([&](ParameterBase<Scalar>& p, ValueRows<Scalar>& value, auto& state, auto& scalars,
                            std::int64_t t) { catch_up_rows(p, value, state, scalars, t); });
  }
  // The same for p only. \throws value_error if p is not registered here, shape_error as step.
  void catch_up(const ParameterBase<Scalar>& p) {
    require_registered(p, "catch_up");
    this->check_state("catch_up");
    this->for_each_slot(
        [&](ParameterBase<Scalar>& q, ValueRows<Scalar>& value, auto& state, auto& scalars, std::int64_t t) {
          if (&q == &p) catch_up_rows(q, value, state, scalars, t);
        });
  }
  // The same for the rows ids[0 .. count) of p only (token ids, any integer type, any order,
  // repeats allowed): before a forward pass reads them (see the header). O(count * d).
  // \throws value_error if p is not registered here, count < 0 or an id is outside [0, p.rows())
  // (naming its index and value); shape_error as step. Nothing changes on throw.
  template <typename Id>
  void catch_up(const ParameterBase<Scalar>& p, const Id* ids, Index count) {
    static_assert(std::is_integral_v<Id>, "catch_up: ids must be integers");
    require_registered(p, "catch_up");
    this->check_state("catch_up");
    if (count < 0) throw value_error("LazyAdamW::catch_up: count = " + std::to_string(count) + " outside [0, inf)");
    for (Index i = 0; i < count; ++i) {
      bool negative = false;
      if constexpr (std::is_signed_v<Id>) negative = ids[i] < 0;
      if (!negative && static_cast<std::uint64_t>(ids[i]) < static_cast<std::uint64_t>(p.rows())) continue;
      std::ostringstream message;
      message << "LazyAdamW::catch_up: ids[" << i << "] = " << +ids[i] << " outside [0, " << p.rows()
              << ") (the rows of '" << p.name() << "'); nothing was updated";
      throw value_error(message.str());
    }
    this->for_each_slot(
        [&](ParameterBase<Scalar>& q, ValueRows<Scalar>& value, auto& state, auto& scalars, std::int64_t t) {
          if (&q != &p || state.find("last_step") == state.end()) return;
          Buffers b = buffers(q, state);
          const Running now = running(scalars);
          const std::vector<Index>* trainable = q.trainable_rows();
          for (Index i = 0; i < count; ++i) {
            // The state's row: the id itself, or with a row mask its place among the trainable
            // rows (a row outside the mask never changes, so it never lags).
            auto r = static_cast<Index>(ids[i]);
            if (trainable) {
              const auto it = std::lower_bound(trainable->begin(), trainable->end(), r);
              if (it == trainable->end() || *it != r) continue;
              r = static_cast<Index>(it - trainable->begin());
            }
            if (static_cast<std::int64_t>(b.last(r, 0)) >= t) continue;
            bring_up_to_date(value.row(r), b, r, now, t, t);
            value.store(r);
          }
        });
  }
  // -> the number of p's rows whose value lags (not brought up to date since p's last step);
  // 0 right after catch_up(). O(V). \throws value_error if p is not registered here.
  Index lagging_rows(const ParameterBase<Scalar>& p) const {
    require_registered(p, "lagging_rows");
    Index lagging = 0;
    this->for_each_slot([&](const ParameterBase<Scalar>& q, const auto& state, const auto&, std::int64_t t) {
      const auto it = state.find("last_step");
      if (&q != &p || it == state.end()) return;
      for (Index r = 0; r < it->second.rows(); ++r) lagging += static_cast<std::int64_t>(it->second(r, 0)) < t;
    });
    return lagging;
  }

 protected:
  std::vector<std::string> scalar_names() const override { return {"decay_mantissa", "decay_exponent"}; }
  Index buffer_cols(const std::string& key, Index cols) const override {
    return key == "exp_avg" || key == "exp_avg_sq" ? cols : 1;  // last_step and the row's P_l: per row
  }

  void check_step(std::size_t g, double lr, double weight_decay, std::int64_t t) const override {
    this->check_step_constant("the step size lr / (1 - beta1^t)",
                              lr / (1.0 - std::pow(options_.beta1, static_cast<double>(t))), g, lr, t);
    if (weight_decay != 0 && !(decay_factor(lr, weight_decay) >= 0.5)) {
      std::ostringstream message;
      message << "LazyAdamW::step: the decay 1 - lr weight_decay = " << 1.0 - lr * weight_decay
              << " outside [0.5, 1] (group " << g << ": lr = lr() x lr_multiplier = " << lr
              << ", weight_decay = " << weight_decay << ", at t = " << t
              << "): the catch-up's running product of the decays needs lr weight_decay <= 0.5; nothing was updated";
      throw value_error(message.str());
    }
    if (t > max_step) {
      std::ostringstream message;
      message << "LazyAdamW::step: step count t = " << t << " exceeds " << max_step << ", the largest integer "
              << detail::scalar_name<Scalar>()
              << " holds exactly (the per-row buffer last_step holds t); nothing was updated";
      throw value_error(message.str());
    }
  }

  void fill_new_rows(const std::string& key, RowMatrix<Scalar>& buffer, Index from,
                     const std::map<std::string, double>& scalars, std::int64_t t) const override {
    auto rows = buffer.bottomRows(buffer.rows() - from);
    const Running now = running(scalars);
    if (key == "last_step")
      rows.setConstant(static_cast<Scalar>(t));
    else if (key == "decay_mantissa")
      rows.setConstant(static_cast<Scalar>(now.mantissa));
    else if (key == "decay_exponent")
      rows.setConstant(static_cast<Scalar>(now.exponent));
    else
      rows.setZero();
  }

  void check_entry(const typename OptimizerState<Scalar>::Entry& entry, std::int64_t t) const override {
    const auto fail = [&](const std::string& what) {
      throw value_error("LazyAdamW::load_state: parameter '" + entry.name + "' " + what);
    };
    std::size_t buffers = 0;
    for (const char* key : {"exp_avg", "exp_avg_sq", "last_step", "decay_mantissa", "decay_exponent"})
      buffers += entry.buffers.count(key);
    const std::size_t scalars = entry.scalars.count("decay_mantissa") + entry.scalars.count("decay_exponent");
    if ((buffers != 0 && buffers != 5) || (scalars != 0 && scalars != 2) || (buffers == 0) != (scalars == 0))
      fail("has " + std::to_string(buffers) + " of the 5 buffers and " + std::to_string(scalars) +
           " of the 2 scalars (decay_mantissa, decay_exponent): all or none");
    if (buffers == 0) return;
    const auto check = [&](const std::string& what, double value, double low, double high, bool integer) {
      if (value >= low && value <= high && (!integer || value == std::floor(value))) return;
      std::ostringstream message;
      message.precision(17);
      message << "has " << what << " = " << value << ", not " << (integer ? "an integer" : "a value") << " in [" << low
              << ", " << high << "]";
      fail(message.str());
    };
    const double steps = static_cast<double>(t);
    check("the scalar decay_mantissa", entry.scalars.at("decay_mantissa"), 0.5, 1.0, false);
    check("the scalar decay_exponent", entry.scalars.at("decay_exponent"), -steps, 1.0, true);
    const RowMatrix<Scalar>& last = entry.buffers.at("last_step");
    const RowMatrix<Scalar>& mantissa = entry.buffers.at("decay_mantissa");
    const RowMatrix<Scalar>& exponent = entry.buffers.at("decay_exponent");
    const double now_mantissa = entry.scalars.at("decay_mantissa"), now_exponent = entry.scalars.at("decay_exponent");
    // A row's stamp P_l is a product of fewer decays than the running one P_t: the catch-up's
    // D = P_t / P_l (bring_up_to_date's) is at most 1, to the rounding of the stamp to Scalar.
    const double slack = 1.0 + 4.0 * static_cast<double>(std::numeric_limits<Scalar>::epsilon());
    for (Index r = 0; r < last.rows(); ++r) {
      const std::string row = "[" + std::to_string(r) + "]";
      check("last_step" + row, static_cast<double>(last(r, 0)), 0.0, steps, true);
      check("decay_mantissa" + row, static_cast<double>(mantissa(r, 0)), 0.5, 1.0, false);
      check("decay_exponent" + row, static_cast<double>(exponent(r, 0)), -steps, 1.0, true);
      const double shift = std::clamp(now_exponent - static_cast<double>(exponent(r, 0)), -2200.0, 2200.0);
      const double D = std::ldexp(now_mantissa / static_cast<double>(mantissa(r, 0)), static_cast<int>(shift));
      if (D > slack) {
        std::ostringstream message;
        message.precision(17);
        message << "has the decay stamp decay_mantissa" << row << " x 2^decay_exponent" << row << " = "
                << static_cast<double>(mantissa(r, 0)) << " x 2^" << static_cast<double>(exponent(r, 0))
                << " below the running decay " << now_mantissa << " x 2^" << now_exponent
                << " (a row's decays are a part of the parameter's: its catch-up would multiply by " << D << " > 1)";
        fail(message.str());
      }
    }
  }

  // A lagging row that leaves the state (a new row mask) but stays in p's table is brought up to
  // date first: it would otherwise lose its pending decay. Rows that stay keep their lag.
  void before_resize_state(ParameterBase<Scalar>& p, ValueRows<Scalar>& value,
                           std::map<std::string, RowMatrix<Scalar>>& state,
                           const std::map<std::string, double>& scalars, std::int64_t t,
                           const detail::StateRows& next) override {
    if (state.find("last_step") == state.end()) return;  // never stepped: nothing lags
    Buffers b = buffers(p, state);
    const Running now = running(scalars);
    for (Index r = 0; r < b.last.rows(); ++r) {
      const Index row = value.value_row(r);
      if (row >= p.rows() || static_cast<std::int64_t>(b.last(r, 0)) >= t) continue;  // dropped, or up to date
      if (!next || std::binary_search(next->begin(), next->end(), row)) continue;     // stays in the state
      bring_up_to_date(value.row(r), b, r, now, t, t);
      value.store(r);
    }
  }

  void update(ParameterBase<Scalar>& p, ValueRows<Scalar>& value, double lr, double weight_decay, std::int64_t t,
              std::map<std::string, RowMatrix<Scalar>>& state) override {
    const RowGradient<Scalar>& g = static_cast<const ParameterBase<Scalar>&>(p).grad();
    Buffers b = buffers(p, state);
    auto& scalars = this->scalars_of(p);
    Running now = running(scalars);
    const double f_t = weight_decay != 0 ? decay_factor(lr, weight_decay) : 1.0;
    if (weight_decay != 0) now.multiply(f_t);
    store(scalars, now);
    // Dense AdamW's step t on a touched row, its decay left out (the catch-up's D holds it).
    const detail::AdamRowStep<Scalar> adam(options_.beta1, options_.beta2, options_.eps, lr, static_cast<double>(t));
    detail::for_touched_rows(g, [&](Index r, const auto& grad) {
      auto x = value.row(r);
      bring_up_to_date(x, b, r, now, t, t - 1, f_t);
      adam.apply(x, b.m.row(r).array(), b.v.row(r).array(), grad);
      value.store(r);
    });
  }

 private:
  // A product of decays, mantissa * 2^exponent with the mantissa in [0.5, 1) (std::frexp's form).
  struct Running {
    double mantissa = 0.5, exponent = 1;  // 1 = 0.5 * 2^1
    void multiply(double f) {             // f in [0.5, 1]: the exponent changes by 0 or -1, exactly
      int e = 0;
      mantissa = std::frexp(mantissa * f, &e);
      exponent += e;
    }
  };
  struct Buffers {
    RowMatrix<Scalar>&m, &v, &last, &mantissa, &exponent;
  };

  static double decay_factor(double lr, double weight_decay) {
    return static_cast<double>(static_cast<Scalar>(1.0 - lr * weight_decay));  // rounded as dense AdamW's
  }
  static Running running(const std::map<std::string, double>& scalars) {
    Running now;
    if (const auto it = scalars.find("decay_mantissa"); it != scalars.end()) now.mantissa = it->second;
    if (const auto it = scalars.find("decay_exponent"); it != scalars.end()) now.exponent = it->second;
    return now;
  }
  static void store(std::map<std::string, double>& scalars, const Running& now) {
    scalars["decay_mantissa"] = now.mantissa;
    scalars["decay_exponent"] = now.exponent;
  }
  Buffers buffers(const ParameterBase<Scalar>& p, std::map<std::string, RowMatrix<Scalar>>& state) const {
    const Running start;  // a row never updated: up to date at step 0, P_0 = 1
    return {this->buffer(state, "exp_avg", p), this->buffer(state, "exp_avg_sq", p),
            this->buffer(state, "last_step", p),
            this->buffer(state, "decay_mantissa", p, static_cast<Scalar>(start.mantissa)),
            this->buffer(state, "decay_exponent", p, static_cast<Scalar>(start.exponent))};
  }

  // Row r: value *= P_now / P_l, m *= b1^k, v *= b2^k with k = through - l (the steps after l up to
  // `through` in which the row's moments only decayed); then l = t and P_l = P_now. step_factor: f_t,
  // when step t's decay is P_now's last factor (0: not given). A row up to date at t - 1 then has f_t
  // alone pending, and is multiplied by f_t itself, as dense AdamW multiplies it: its stamp P_l is
  // rounded to Scalar, so the quotient P_now / P_l could be off by an ulp of Scalar, every step for a
  // row touched at every step.
  template <typename X>
  void bring_up_to_date(X&& x, Buffers& b, Index r, const Running& now, std::int64_t t, std::int64_t through,
                        double step_factor = 0.0) const {
    const Scalar stamp_mantissa = b.mantissa(r, 0), stamp_exponent = b.exponent(r, 0);
    if (step_factor > 0.0 && static_cast<std::int64_t>(b.last(r, 0)) == t - 1) {
      if (step_factor != 1.0) {
        if constexpr (std::is_same_v<Scalar, double>)
          x *= step_factor;
        else
          x = (x.template cast<double>() * step_factor).template cast<Scalar>();  // = the Scalar product
      }
    } else if (stamp_mantissa != static_cast<Scalar>(now.mantissa) ||
               stamp_exponent != static_cast<Scalar>(now.exponent)) {
      // The exponent difference is <= 0; below -2200 the quotient underflows to 0 all the same.
      const double shift = std::max(now.exponent - static_cast<double>(stamp_exponent), -2200.0);
      const double D = std::ldexp(now.mantissa / static_cast<double>(stamp_mantissa), static_cast<int>(shift));
      if constexpr (std::is_same_v<Scalar, double>)
        x *= D;
      else
        x = (x.template cast<double>() * D).template cast<Scalar>();  // one rounding, as one dense step
    }
    const auto k = through - static_cast<std::int64_t>(b.last(r, 0));
    if (k > 0) {
      b.m.row(r).array() *= static_cast<Scalar>(std::pow(options_.beta1, static_cast<double>(k)));
      b.v.row(r).array() *= static_cast<Scalar>(std::pow(options_.beta2, static_cast<double>(k)));
    }
    b.last(r, 0) = static_cast<Scalar>(t);
    b.mantissa(r, 0) = static_cast<Scalar>(now.mantissa);
    b.exponent(r, 0) = static_cast<Scalar>(now.exponent);
  }

  void catch_up_rows(ParameterBase<Scalar>& p, ValueRows<Scalar>& value,
                     std::map<std::string, RowMatrix<Scalar>>& state, const std::map<std::string, double>& scalars,
                     std::int64_t t) const {
    if (state.find("last_step") == state.end()) return;  // never stepped: nothing lags
    Buffers b = buffers(p, state);
    const Running now = running(scalars);
    for (Index r = 0; r < b.last.rows(); ++r) {  // the state's rows: every row, or the trainable ones
      if (static_cast<std::int64_t>(b.last(r, 0)) >= t) continue;
      bring_up_to_date(value.row(r), b, r, now, t, t);
      value.store(r);
    }
  }

  void require_registered(const ParameterBase<Scalar>& p, const char* call) const {
    if (this->slot_of(&p) >= 0) return;
    std::ostringstream message;
    message << "LazyAdamW::" << call << ": parameter '" << p.name() << "' [" << p.rows() << ", " << p.cols()
            << "] is not registered with this optimizer";
    throw value_error(message.str());
  }

  AdamOptions options_;  // weight_decay set: the default of groups that give none
};

}  // namespace embedhead

#endif  // EMBEDHEAD_OPTIM_LAZY_ADAMW_HPP
