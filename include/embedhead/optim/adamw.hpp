// embedhead: Adam and AdamW, exact (dense) semantics: every row moves every step
// (torch.optim.Adam / AdamW's update order; optim/optimizer.hpp has the shared semantics).
#ifndef EMBEDHEAD_OPTIM_ADAMW_HPP
#define EMBEDHEAD_OPTIM_ADAMW_HPP

#include "optimizer.hpp"

#include <cmath>
#include <cstdint>
#include <map>
#include <string>

namespace embedhead {

namespace detail {

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

}  // namespace detail

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
      : Optimizer<Scalar>(options.decoupled ? "AdamW" : "Adam", options.lr, options.weight_decay,
                          {"exp_avg", "exp_avg_sq"}),
        options_(options) {
    check_adam_options(this->name_, options);
    if (!parameters.empty()) this->add_group(parameters);
  }

  // beta1, beta2 in [0, 1) and eps in (0, inf), each in Scalar too (the update runs in Scalar:
  // an eps that is 0 there makes sqrt(v) + eps = 0 for a row with no gradient yet, and 0 / 0).
  static void check_adam_options(const char* where, const AdamOptions& options) {
    detail::check_beta_in<Scalar>(where, "beta1", options.beta1);
    detail::check_beta_in<Scalar>(where, "beta2", options.beta2);
    if (!(options.eps > 0) || !std::isfinite(options.eps))
      detail::throw_hyperparameter(where, "eps", options.eps, "(0, inf)");
    detail::check_in_scalar<Scalar>(where, "eps", options.eps, "(0, inf)");
  }
  // The step size lr / (1 - beta1^t) at step t, as AdamRowStep computes it.
  static double step_size(const AdamOptions& options, double lr, std::int64_t t) {
    return lr / (1.0 - std::pow(options.beta1, static_cast<double>(t)));
  }

 protected:
  void check_step(std::size_t g, double lr, double weight_decay, std::int64_t t) const override {
    this->check_step_constant("the step size lr / (1 - beta1^t)", step_size(options_, lr, t), g, lr, t);
    if (weight_decay != 0 && options_.decoupled)
      this->check_step_constant("the decay 1 - lr weight_decay", 1.0 - lr * weight_decay, g, lr, t);
  }
  void update(Parameter<Scalar>& p, double lr, double weight_decay,
              std::map<std::string, RowMatrix<Scalar>>& state) override {
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

}  // namespace embedhead

#endif  // EMBEDHEAD_OPTIM_ADAMW_HPP
