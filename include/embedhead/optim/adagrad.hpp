// embedhead: Adagrad, exact and sparse at once: an untouched row does not change
// (torch.optim.Adagrad's update order; optim/optimizer.hpp has the shared semantics).
#ifndef EMBEDHEAD_OPTIM_ADAGRAD_HPP
#define EMBEDHEAD_OPTIM_ADAGRAD_HPP

#include "optimizer.hpp"

#include <cmath>
#include <cstdint>
#include <map>
#include <string>

namespace embedhead {

struct AdagradOptions {
  double lr = 1e-2;
  double lr_decay = 0;                   // lr_t = lr / (1 + (t - 1) lr_decay)
  double initial_accumulator_value = 0;  // G starts here, >= 0
  double eps = 1e-10;                    // > 0
};

// For each touched row (torch.optim.Adagrad), at the parameter's own step t (optimizer.hpp):
//   G_r += g_r^2;  p_r -= lr_t g_r / (sqrt(G_r) + eps).
// An untouched row has g_r = 0 and would not change, so the sparse walk is exact: O(touched rows
// * d) per step; state G [V, d]. No weight decay (as PyTorch's Adagrad with sparse gradients).
template <typename Scalar>
class Adagrad : public Optimizer<Scalar> {
 public:
  explicit Adagrad(const AdagradOptions& options = {}, const typename Optimizer<Scalar>::ParameterList& parameters = {})
      : Optimizer<Scalar>("Adagrad", options.lr, 0.0, {"sum"}), options_(options) {
    detail::check_non_negative("Adagrad", "lr_decay", options.lr_decay);
    detail::check_non_negative("Adagrad", "initial_accumulator_value", options.initial_accumulator_value);
    detail::check_in_scalar<Scalar>("Adagrad", "initial_accumulator_value", options.initial_accumulator_value,
                                    "[0, inf)", /*reject_underflow=*/false);
    if (!(options.eps > 0) || !std::isfinite(options.eps))
      detail::throw_hyperparameter("Adagrad", "eps", options.eps, "(0, inf)");
    detail::check_in_scalar<Scalar>("Adagrad", "eps", options.eps, "(0, inf)");
    if (!parameters.empty()) this->add_group(parameters);
  }

 protected:
  void check_weight_decay(double weight_decay) const override {
    if (weight_decay != 0) {
      std::ostringstream message;
      message << "Adagrad: weight_decay = " << weight_decay
              << " is not supported (only 0), as in PyTorch with sparse gradients";
      throw value_error(message.str());
    }
  }
  double initial_buffer_value(const std::string&) const override { return options_.initial_accumulator_value; }
  void check_step(std::size_t g, double lr, double, std::int64_t t) const override {
    this->check_step_constant("lr / (1 + (t - 1) lr_decay)", decayed_lr(lr, t), g, lr, t);
  }
  void update(ParameterBase<Scalar>& p, ValueRows<Scalar>& value, double lr, double, std::int64_t t,
              std::map<std::string, RowMatrix<Scalar>>& state) override {
    const RowGradient<Scalar>& g = static_cast<const ParameterBase<Scalar>&>(p).grad();
    RowMatrix<Scalar>& sum = this->buffer(state, "sum", p, static_cast<Scalar>(options_.initial_accumulator_value));
    const Scalar clr = static_cast<Scalar>(decayed_lr(lr, t));
    const Scalar eps = static_cast<Scalar>(options_.eps);
    detail::for_touched_rows(g, [&](Index r, const auto& grad) {
      auto s = sum.row(r).array();
      s += grad.square();
      value.row(r) -= clr * grad / (s.sqrt() + eps);
      value.store(r);
    });
  }

 private:
  double decayed_lr(double lr, std::int64_t t) const {
    return lr / (1.0 + (static_cast<double>(t) - 1.0) * options_.lr_decay);
  }

  AdagradOptions options_;
};

}  // namespace embedhead

#endif  // EMBEDHEAD_OPTIM_ADAGRAD_HPP
