// embedhead: lazy Adam, sparse semantics: only the rows a step's gradient touches change
// (optim/optimizer.hpp has the shared semantics; adamw.hpp the dense Adam it is compared with).
#ifndef EMBEDHEAD_OPTIM_LAZY_ADAM_HPP
#define EMBEDHEAD_OPTIM_LAZY_ADAM_HPP

#include "adamw.hpp"
#include "optimizer.hpp"

#include <cstdint>
#include <map>
#include <string>

namespace embedhead {

// Adam on the touched rows only (PyTorch's SparseAdam, TensorFlow's LazyAdam): for each touched
// row, the update of AdamW (adamw.hpp) without weight decay; an untouched row's value and moments stay
// exactly as they were, and t counts optimizer steps. Equal to AdamW(weight_decay = 0) when every
// row is touched every step; different otherwise (AdamW keeps moving rows with a stale momentum).
// Cost O(touched rows * d) per step; state m, v [V, d]. Weight decay is rejected: applied to
// touched rows only it would shrink frequent tokens and spare rare ones.
template <typename Scalar>
class LazyAdam : public Optimizer<Scalar> {
 public:
  explicit LazyAdam(AdamOptions options = lazy_defaults(),
                    const typename Optimizer<Scalar>::ParameterList& parameters = {})
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
  void check_step(std::size_t g, double lr, double, std::int64_t t) const override {
    this->check_step_constant("the step size lr / (1 - beta1^t)", AdamW<Scalar>::step_size(options_, lr, t), g, lr, t);
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

}  // namespace embedhead

#endif  // EMBEDHEAD_OPTIM_LAZY_ADAM_HPP
