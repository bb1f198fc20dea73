// embedhead: stochastic gradient descent, with optional momentum, Nesterov momentum and decoupled
// weight decay (torch.optim.SGD's update order; optim/optimizer.hpp has the shared semantics).
#ifndef EMBEDHEAD_OPTIM_SGD_HPP
#define EMBEDHEAD_OPTIM_SGD_HPP

#include "optimizer.hpp"

#include <cstdint>
#include <map>
#include <string>

namespace embedhead {

struct SGDOptions {
  double lr = 1e-2;
  double momentum = 0;      // mu in [0, 1)
  bool nesterov = false;    // needs momentum > 0
  double weight_decay = 0;  // decoupled: p *= 1 - lr * weight_decay before the step
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
    detail::check_beta_in<Scalar>("SGD", "momentum", options.momentum);
    if (options.nesterov && !(options.momentum > 0))
      throw value_error("SGD: nesterov = true needs momentum > 0 (momentum = 0)");
    if (!parameters.empty()) this->add_group(parameters);
  }

 protected:
  void check_step(std::size_t g, double lr, double weight_decay, std::int64_t t) const override {
    this->check_step_constant("lr", lr, g, lr, t);
    if (weight_decay != 0)
      this->check_step_constant("the decay 1 - lr weight_decay", 1.0 - lr * weight_decay, g, lr, t);
  }
  void update(ParameterBase<Scalar>& p, ValueRows<Scalar>& value, double lr, double weight_decay, std::int64_t,
              std::map<std::string, RowMatrix<Scalar>>& state) override {
    const RowGradient<Scalar>& g = static_cast<const ParameterBase<Scalar>&>(p).grad();
    const Scalar step = static_cast<Scalar>(lr);
    if (options_.momentum == 0 && weight_decay == 0) {
      detail::for_touched_rows(g, [&](Index r, const auto& grad) {
        value.row(r) -= step * grad;
        value.store(r);
      });
      return;
    }
    const Scalar decay = static_cast<Scalar>(1.0 - lr * weight_decay), mu = static_cast<Scalar>(options_.momentum);
    const bool first = state.find("momentum_buffer") == state.end();
    RowMatrix<Scalar>* momentum = options_.momentum > 0 ? &this->buffer(state, "momentum_buffer", p) : nullptr;
    detail::for_every_row(g, this->zero_row(p.cols()), [&](Index r, const auto& grad) {
      auto v = value.row(r);
      if (weight_decay != 0) v *= decay;
      if (!momentum) {
        v -= step * grad;
      } else {
        auto buf = momentum->row(r).array();
        if (first)
          buf = grad;
        else
          buf = mu * buf + grad;
        if (options_.nesterov)
          v -= step * (grad + mu * buf);
        else
          v -= step * buf;
      }
      value.store(r);
    });
  }

 private:
  SGDOptions options_;
};

}  // namespace embedhead

#endif  // EMBEDHEAD_OPTIM_SGD_HPP
