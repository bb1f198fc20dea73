// embedhead: row-wise Adagrad, sparse semantics with one accumulator per row (FBGEMM's rowwise
// Adagrad, the optimizer of its split embedding tables; torchrec's RowWiseAdagrad is the same
// idea). optim/optimizer.hpp has the shared semantics.
//
// For each touched row r of a stepped parameter, d = cols (FBGEMM's order of operations):
//   gd_r   = g_r + wd p_r                   (weight_decay_mode l2)   or  g_r  (none, decoupled)
//   G_r   += (1/d) sum_j gd_r[j]^2          one scalar per row: the mean of the squared gradient
//   mult   = lr / (sqrt(G_r) + eps)         eps outside the square root
//   c      = 1 - mult wd  (l2)   or   1 - lr wd  (decoupled)   or   1  (none / wd = 0)
//   p_r    = c p_r - mult g_r
// so in l2 mode p_r -= mult (g_r + wd p_r). An untouched row's value and accumulator stay as they
// were, weight decay included: as in FBGEMM, decay reaches only the rows a step touches.
// No step count enters the update (FBGEMM's has no lr decay). State G: V values ("sum", [V, 1])
// instead of Adagrad's V d. Cost O(touched rows * d) per step.
#ifndef EMBEDHEAD_OPTIM_ROWWISE_ADAGRAD_HPP
#define EMBEDHEAD_OPTIM_ROWWISE_ADAGRAD_HPP

#include "optimizer.hpp"

#include <cmath>
#include <cstdint>
#include <map>
#include <sstream>
#include <string>

namespace embedhead {

// FBGEMM's weight-decay modes for row-wise Adagrad (its NONE, L2 and DECOUPLE).
enum class RowWiseWeightDecay { none, l2, decoupled };

struct RowWiseAdagradOptions {
  double lr = 1e-2;                                               // >= 0
  double eps = 1e-8;                                              // > 0 (FBGEMM's default)
  double weight_decay = 0;                                        // >= 0; the default of groups that give none
  RowWiseWeightDecay weight_decay_mode = RowWiseWeightDecay::l2;  // how a non-zero decay applies
};

// Row-wise Adagrad (see the header).
template <typename Scalar>
class RowWiseAdagrad : public Optimizer<Scalar> {
 public:
  // \throws value_error for lr, eps or weight_decay out of range (naming the value and the range),
  // weight_decay > 0 with mode none, or as add_group for `parameters`.
  explicit RowWiseAdagrad(const RowWiseAdagradOptions& options = {},
                          const typename Optimizer<Scalar>::ParameterList& parameters = {})
      : Optimizer<Scalar>("RowWiseAdagrad", options.lr, options.weight_decay, {"sum"}), options_(options) {
    if (!(options.eps > 0) || !std::isfinite(options.eps))
      detail::throw_hyperparameter("RowWiseAdagrad", "eps", options.eps, "(0, inf)");
    detail::check_in_scalar<Scalar>("RowWiseAdagrad", "eps", options.eps, "(0, inf)");
    check_weight_decay(options.weight_decay);
    if (!parameters.empty()) this->add_group(parameters);
  }
  const RowWiseAdagradOptions& options() const { return options_; }

 protected:
  void check_weight_decay(double weight_decay) const override {
    if (weight_decay != 0 && options_.weight_decay_mode == RowWiseWeightDecay::none) {
      std::ostringstream message;
      message << "RowWiseAdagrad: weight_decay = " << weight_decay
              << " with weight_decay_mode none (only 0 there; choose l2 or decoupled)";
      throw value_error(message.str());
    }
  }
  Index buffer_cols(const std::string&, Index) const override { return 1; }
  void check_step(std::size_t g, double lr, double weight_decay, std::int64_t t) const override {
    if (weight_decay != 0 && options_.weight_decay_mode == RowWiseWeightDecay::decoupled)
      this->check_step_constant("the decay 1 - lr weight_decay", 1.0 - lr * weight_decay, g, lr, t);
  }
  void update(ParameterBase<Scalar>& p, ValueRows<Scalar>& value, double lr, double weight_decay, std::int64_t,
              std::map<std::string, RowMatrix<Scalar>>& state) override {
    const RowGradient<Scalar>& g = static_cast<const ParameterBase<Scalar>&>(p).grad();
    RowMatrix<Scalar>& sum = this->buffer(state, "sum", p);
    const bool l2 = weight_decay != 0 && options_.weight_decay_mode == RowWiseWeightDecay::l2;
    const bool decoupled = weight_decay != 0 && options_.weight_decay_mode == RowWiseWeightDecay::decoupled;
    const Scalar step = static_cast<Scalar>(lr), eps = static_cast<Scalar>(options_.eps);
    const Scalar wd = static_cast<Scalar>(weight_decay), decay = static_cast<Scalar>(1.0 - lr * weight_decay);
    const Scalar inv_d = Scalar(1) / static_cast<Scalar>(p.cols());
    detail::for_touched_rows(g, [&](Index r, const auto& grad) {
      auto x = value.row(r);
      // The mean of the squared (l2: decayed) gradient, summed in Scalar over the row.
      const Scalar mean_square = l2 ? (grad + wd * x).square().sum() * inv_d : grad.square().sum() * inv_d;
      const Scalar accumulated = sum(r, 0) + mean_square;
      sum(r, 0) = accumulated;
      const Scalar multiplier = step / (std::sqrt(accumulated) + eps);
      const Scalar correction = l2 ? Scalar(1) - multiplier * wd : decoupled ? decay : Scalar(1);
      x = correction * x - multiplier * grad;
      value.store(r);
    });
  }

 private:
  RowWiseAdagradOptions options_;
};

}  // namespace embedhead

#endif  // EMBEDHEAD_OPTIM_ROWWISE_ADAGRAD_HPP
