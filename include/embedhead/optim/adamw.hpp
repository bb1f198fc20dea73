// embedhead: Adam and AdamW, exact (dense) semantics: every row of a stepped parameter moves
// (torch.optim.Adam / torch.optim.AdamW, their defaults and names; optim/optimizer.hpp has the
// shared semantics: groups, each parameter's own step count t, a parameter without a gradient).
//
// For a parameter stepped at its step t, every row r, with g_r = 0 where untouched:
//   AdamW:  p_r *= 1 - lr wd                  decoupled decay; weight_decay defaults to 0.01
//   Adam:   g_r += wd p_r                     coupled L2;      weight_decay defaults to 0
//   m_r = beta1 m_r + (1 - beta1) g_r;   v_r = beta2 v_r + (1 - beta2) g_r^2
//   p_r -= lr / (1 - beta1^t) * m_r / (sqrt(v_r) / sqrt(1 - beta2^t) + eps)
// So an untouched row of a parameter with a gradient still moves: its moments decay, its update
// continues, decay shrinks it. Cost O(V d) per step; state m, v [V, d] ("exp_avg", "exp_avg_sq").
#ifndef EMBEDHEAD_OPTIM_ADAMW_HPP
#define EMBEDHEAD_OPTIM_ADAMW_HPP

#include "optimizer.hpp"

#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <string>

namespace embedhead {

// The options of Adam, AdamW and LazyAdam. weight_decay unset takes the class's default, PyTorch's:
// Adam 0, AdamW 0.01, LazyAdam 0 (the only value it accepts). So AdamOptions{} ported from
// torch.optim.Adam(lr=...) gets no decay, and LazyAdam<S>() constructs.
struct AdamOptions {
  double lr = 1e-3;                                   // >= 0
  double beta1 = 0.9, beta2 = 0.999;                  // each in [0, 1)
  double eps = 1e-8;                                  // > 0
  std::optional<double> weight_decay = std::nullopt;  // >= 0; unset: the class's default
};

namespace detail {

// beta1, beta2 in [0, 1) and eps in (0, inf), each in Scalar too (the update runs in Scalar: an
// eps that is 0 there makes sqrt(v) + eps = 0 for a row with no gradient yet, and 0 / 0).
template <typename Scalar>
void check_adam_options(const char* where, const AdamOptions& options) {
  check_beta_in<Scalar>(where, "beta1", options.beta1);
  check_beta_in<Scalar>(where, "beta2", options.beta2);
  if (!(options.eps > 0) || !std::isfinite(options.eps)) throw_hyperparameter(where, "eps", options.eps, "(0, inf)");
  check_in_scalar<Scalar>(where, "eps", options.eps, "(0, inf)");
}

// One Adam step's constants at step t (torch.optim.Adam's), and the update of one row with them:
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
  // The same after AdamW's decay x *= decay: each value is rounded to Scalar after the decay and
  // after the update (torch.optim.AdamW's two roundings). The decayed row is stored before the
  // update reads it: in one expression, x * decay - u, a build with FMA contraction (GCC's default
  // with -mfma or -march=native) fuses the product into the subtraction, one rounding instead of two.
  template <typename X, typename M, typename V, typename G>
  void apply_decayed(X&& x, Scalar decay, M&& m, V&& v, const G& grad) const {
    x *= decay;
    apply(x, m, v, grad);
  }
};

// Adam (Decoupled = false) and AdamW (true): everything but the name and the default decay.
template <typename Scalar, bool Decoupled>
class DenseAdam : public Optimizer<Scalar> {
 public:
  const AdamOptions& options() const { return options_; }

 protected:
  DenseAdam(const char* name, double default_weight_decay, const AdamOptions& options,
            const typename Optimizer<Scalar>::ParameterList& parameters)
      : Optimizer<Scalar>(name, options.lr, options.weight_decay.value_or(default_weight_decay),
                          {"exp_avg", "exp_avg_sq"}),
        options_(options) {
    options_.weight_decay = options.weight_decay.value_or(default_weight_decay);
    check_adam_options<Scalar>(name, options);
    if (!parameters.empty()) this->add_group(parameters);
  }

  void check_step(std::size_t g, double lr, double weight_decay, std::int64_t t) const override {
    this->check_step_constant("the step size lr / (1 - beta1^t)",
                              lr / (1.0 - std::pow(options_.beta1, static_cast<double>(t))), g, lr, t);
    if (weight_decay != 0 && Decoupled)
      this->check_step_constant("the decay 1 - lr weight_decay", 1.0 - lr * weight_decay, g, lr, t);
  }
  void update(ParameterBase<Scalar>& p, ValueRows<Scalar>& value, double lr, double weight_decay, std::int64_t t,
              std::map<std::string, RowMatrix<Scalar>>& state) override {
    const RowGradient<Scalar>& g = static_cast<const ParameterBase<Scalar>&>(p).grad();
    RowMatrix<Scalar>& m = this->buffer(state, "exp_avg", p);
    RowMatrix<Scalar>& v = this->buffer(state, "exp_avg_sq", p);
    const AdamRowStep<Scalar> adam(options_.beta1, options_.beta2, options_.eps, lr, static_cast<double>(t));
    const Scalar decay = static_cast<Scalar>(1.0 - lr * weight_decay), wd = static_cast<Scalar>(weight_decay);
    typename Optimizer<Scalar>::Row coupled(this->scratch_row(p.cols()), p.cols());
    for_every_row(g, this->zero_row(p.cols()), [&](Index r, const auto& grad) {
      auto x = value.row(r);
      if (weight_decay != 0 && Decoupled) {
        adam.apply_decayed(x, decay, m.row(r).array(), v.row(r).array(), grad);
      } else if (weight_decay != 0 && !Decoupled) {
        coupled = grad + wd * x;
        adam.apply(x, m.row(r).array(), v.row(r).array(), coupled);
      } else {
        adam.apply(x, m.row(r).array(), v.row(r).array(), grad);
      }
      value.store(r);
    });
  }

 private:
  AdamOptions options_;  // weight_decay set: the default of groups that give none
};

}  // namespace detail

// torch.optim.Adam: coupled L2 decay (g += wd p), weight_decay 0 unless given.
template <typename Scalar>
class Adam : public detail::DenseAdam<Scalar, false> {
 public:
  static constexpr double default_weight_decay = 0.0;
  // \throws value_error for lr, betas, eps or weight_decay out of range (naming the value and the
  // range), or as add_group for `parameters`.
  explicit Adam(const AdamOptions& options = {}, const typename Optimizer<Scalar>::ParameterList& parameters = {})
      : detail::DenseAdam<Scalar, false>("Adam", default_weight_decay, options, parameters) {}
};

// torch.optim.AdamW: decoupled decay (p *= 1 - lr wd before the step), weight_decay 0.01 unless
// given.
template <typename Scalar>
class AdamW : public detail::DenseAdam<Scalar, true> {
 public:
  static constexpr double default_weight_decay = 0.01;
  // \throws as Adam.
  explicit AdamW(const AdamOptions& options = {}, const typename Optimizer<Scalar>::ParameterList& parameters = {})
      : detail::DenseAdam<Scalar, true>("AdamW", default_weight_decay, options, parameters) {}
};

}  // namespace embedhead

#endif  // EMBEDHEAD_OPTIM_ADAMW_HPP
