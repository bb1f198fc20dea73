// embedhead: gradient clipping by the global norm, over row-sparse gradients (PyTorch's
// clip_grad_norm_).
#ifndef EMBEDHEAD_OPTIM_CLIP_HPP
#define EMBEDHEAD_OPTIM_CLIP_HPP

#include "../errors.hpp"
#include "../parameter.hpp"
#include "../types.hpp"
#include "optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <memory>
#include <sstream>
#include <vector>

namespace embedhead {

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

}  // namespace embedhead

#endif  // EMBEDHEAD_OPTIM_CLIP_HPP
