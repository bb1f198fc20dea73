// embedhead: lazy Adam, sparse semantics: only the rows a step's gradient touches change
// (optim/optimizer.hpp has the shared semantics; adamw.hpp the dense Adam it is compared with).
//
// PyTorch's torch.optim.SparseAdam, its formula exactly. For a parameter stepped at its step t
// (its own count, optimizer.hpp), each touched row r:
//   m_r = beta1 m_r + (1 - beta1) g_r;   v_r = beta2 v_r + (1 - beta2) g_r^2
//   p_r -= lr sqrt(1 - beta2^t) / (1 - beta1^t) * m_r / (sqrt(v_r) + eps)
// An untouched row's value and moments stay exactly as they were (TensorFlow's LazyAdam too).
// Cost O(touched rows * d) per step; state m, v [V, d] ("exp_avg", "exp_avg_sq").
//
// Against Adam (adamw.hpp) with weight_decay 0. The moments follow the same recurrences, so when
// every row is touched at every step m and v are Adam's bit for bit. The update is not: eps sits
// outside the bias correction here, so this step is Adam's with eps replaced by
// eps_t = eps / sqrt(1 - beta2^t) at step t (31.6 eps at t = 1 for beta2 = 0.999, tending to eps).
// No constant eps makes the two equal. With O(1) gradients they agree to about 1e-8 relative;
// with gradients far below eps Adam's first update is up to 1 / sqrt(1 - beta2) = 31.6 times this
// one (28.8 times for g = 1e-9, eps = 1e-8). When rows are skipped the two differ in kind: Adam
// keeps moving an untouched row with its decaying momentum.
// Weight decay is rejected: applied to touched rows only it would shrink frequent tokens and spare
// rare ones (PyTorch's SparseAdam has none either). LazyAdamW (lazy_adamw.hpp) is the lazy
// optimizer with decay: AdamW's formula (eps inside the bias correction), and a row's next touch
// applies the decays of the steps it skipped, so rare rows shrink as in dense AdamW; where this
// class leaves an untouched row's moments as they were, it decays them by beta^k on the next touch.
#ifndef EMBEDHEAD_OPTIM_LAZY_ADAM_HPP
#define EMBEDHEAD_OPTIM_LAZY_ADAM_HPP

#include "adamw.hpp"
#include "optimizer.hpp"

#include <cmath>
#include <cstdint>
#include <map>
#include <sstream>
#include <string>

namespace embedhead {

namespace detail {

// One SparseAdam step's constants at step t, and the update of one row with them:
//   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
//   x -= lr sqrt(1 - beta2^t) / (1 - beta1^t) * m / (sqrt(v) + eps)
template <typename Scalar>
struct SparseAdamRowStep {
  Scalar b1, one_minus_b1, b2, one_minus_b2, step_size, eps;
  SparseAdamRowStep(double beta1, double beta2, double epsilon, double lr, double t)
      : b1(static_cast<Scalar>(beta1)),
        one_minus_b1(static_cast<Scalar>(1.0 - beta1)),
        b2(static_cast<Scalar>(beta2)),
        one_minus_b2(static_cast<Scalar>(1.0 - beta2)),
        step_size(static_cast<Scalar>(step_size_at(beta1, beta2, lr, t))),
        eps(static_cast<Scalar>(epsilon)) {}
  static double step_size_at(double beta1, double beta2, double lr, double t) {
    return lr * std::sqrt(1.0 - std::pow(beta2, t)) / (1.0 - std::pow(beta1, t));
  }
  template <typename X, typename M, typename V, typename G>
  void apply(X&& x, M&& m, V&& v, const G& grad) const {
    m = b1 * m + one_minus_b1 * grad;
    v = b2 * v + one_minus_b2 * grad.square();
    x -= step_size * m / (v.sqrt() + eps);
  }
};

}  // namespace detail

// PyTorch's SparseAdam on the touched rows only (see the header). Default-constructs with
// PyTorch's defaults (lr 1e-3, betas 0.9 / 0.999, eps 1e-8, no decay).
template <typename Scalar>
class LazyAdam : public Optimizer<Scalar> {
 public:
  // \throws value_error for lr, betas or eps out of range, or a weight_decay other than 0 (unset
  // is 0), naming the value and the range; or as add_group for `parameters`.
  explicit LazyAdam(const AdamOptions& options = {}, const typename Optimizer<Scalar>::ParameterList& parameters = {})
      : Optimizer<Scalar>("LazyAdam", options.lr, options.weight_decay.value_or(0.0), {"exp_avg", "exp_avg_sq"}),
        options_(options) {
    options_.weight_decay = options.weight_decay.value_or(0.0);
    detail::check_adam_options<Scalar>("LazyAdam", options);
    check_weight_decay(*options_.weight_decay);
    if (!parameters.empty()) this->add_group(parameters);
  }
  // AdamOptions{} (kept for code written when AdamOptions defaulted to AdamW's decay).
  static AdamOptions lazy_defaults() { return AdamOptions{}; }
  const AdamOptions& options() const { return options_; }

 protected:
  void check_weight_decay(double weight_decay) const override {
    if (weight_decay != 0) {
      std::ostringstream message;
      message << "LazyAdam: weight_decay = " << weight_decay
              << " is not supported (only 0): lazy decay would spare untouched rows; use AdamW";
      throw value_error(message.str());
    }
  }
  void check_step(std::size_t g, double lr, double, std::int64_t t) const override {
    this->check_step_constant("the step size lr sqrt(1 - beta2^t) / (1 - beta1^t)",
                              detail::SparseAdamRowStep<Scalar>::step_size_at(options_.beta1, options_.beta2, lr,
                                                                              static_cast<double>(t)),
                              g, lr, t);
  }
  void update(ParameterBase<Scalar>& p, ValueRows<Scalar>& value, double lr, double, std::int64_t t,
              std::map<std::string, RowMatrix<Scalar>>& state) override {
    const RowGradient<Scalar>& g = static_cast<const ParameterBase<Scalar>&>(p).grad();
    RowMatrix<Scalar>& m = this->buffer(state, "exp_avg", p);
    RowMatrix<Scalar>& v = this->buffer(state, "exp_avg_sq", p);
    const detail::SparseAdamRowStep<Scalar> adam(options_.beta1, options_.beta2, options_.eps, lr,
                                                 static_cast<double>(t));
    detail::for_touched_rows(g, [&](Index r, const auto& grad) {
      adam.apply(value.row(r), m.row(r).array(), v.row(r).array(), grad);
      value.store(r);
    });
  }

 private:
  AdamOptions options_;
};

}  // namespace embedhead

#endif  // EMBEDHEAD_OPTIM_LAZY_ADAM_HPP
