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
// clip_grad_norm_.
// Non-finite gradients (docs/errors.md, "Non-finite values"): as PyTorch's default
// (error_if_nonfinite = false), a NaN norm multiplies every stored gradient entry by NaN and an
// infinite one by 0 (finite entries become 0, infinite ones NaN), and the norm is returned; a
// row-sparse gradient's untouched rows are not stored and stay zero. With error_if_nonfinite =
// true a NaN or infinite norm throws instead, naming the first NaN or infinite entry (in the
// order of `parameters`, then of the touched rows), and nothing is scaled. Double gradients
// whose squares overflow while every entry is finite get their finite norm all the same (summed
// again, divided by the largest entry).
// \throws value_error if max_norm is negative or not finite, a parameter is null, or, with
// error_if_nonfinite, the norm is NaN or infinite (nothing scaled). Cost O(touched rows * d).
// Any parameter list: Parameter<Scalar>, a low-precision Parameter<Storage, float> or
// ParameterBase<float> (the gradients are Scalar / float in every case).
namespace detail {

// The norm of the gradients of `unique` (distinct, not frozen), each entry divided by the largest
// |entry| first: for when the plain sum of squares overflows double. inf if an entry is.
template <typename P>
double rescaled_grad_norm(const std::vector<std::shared_ptr<P>>& unique) {
  using Scalar = typename P::grad_type;
  double largest = 0;
  for (const auto& p : unique) {
    const RowGradient<Scalar>& g = static_cast<const P&>(*p).grad();
    for (Index i = 0; i < g.num_touched(); ++i)
      largest = std::max(largest, g.touched_row(i).template cast<double>().cwiseAbs().maxCoeff());
  }
  if (!std::isfinite(largest)) return largest;
  double squares = 0;
  for (const auto& p : unique) {
    const RowGradient<Scalar>& g = static_cast<const P&>(*p).grad();
    for (Index i = 0; i < g.num_touched(); ++i)
      squares += (g.touched_row(i).template cast<double>() / largest).squaredNorm();
  }
  return largest * std::sqrt(squares);
}

// Throws value_error for a non-finite norm, naming the first NaN or infinite gradient entry.
template <typename P>
[[noreturn]] void throw_nonfinite_norm(const std::vector<std::shared_ptr<P>>& parameters,
                                       const std::vector<std::shared_ptr<P>>& unique, double norm) {
  using Scalar = typename P::grad_type;
  std::ostringstream message;
  message << "clip_grad_norm: ";
  for (const auto& p : unique) {
    const RowGradient<Scalar>& g = static_cast<const P&>(*p).grad();
    for (Index i = 0; i < g.num_touched(); ++i) {
      const auto row = g.touched_row(i);
      for (Index j = 0; j < row.size(); ++j) {
        if (std::isfinite(static_cast<double>(row(j)))) continue;
        const std::size_t index = static_cast<std::size_t>(
            std::find_if(parameters.begin(), parameters.end(), [&](const auto& q) { return q.get() == p.get(); }) -
            parameters.begin());
        message << "gradient " << static_cast<double>(row(j)) << " at ("
                << g.touched_rows()[static_cast<std::size_t>(i)] << ", " << j << ") of parameter " << index;
        if (!p->name().empty()) message << " ('" << p->name() << "')";
        message << ": the norm is " << norm << ", outside the finite numbers (error_if_nonfinite)";
        throw value_error(message.str());
      }
    }
  }
  message << "the norm is " << norm << ", outside the finite numbers (error_if_nonfinite): every entry is finite, "
          << "but the norm exceeds the largest double";
  throw value_error(message.str());
}

template <typename P>
double clip_grad_norm_impl(const std::vector<std::shared_ptr<P>>& parameters, double max_norm,
                           bool error_if_nonfinite) {
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
  double norm = std::sqrt(squares);
  if (std::isinf(norm)) norm = rescaled_grad_norm(unique);  // an infinite entry, or squares beyond double
  if (!std::isfinite(norm) && error_if_nonfinite) throw_nonfinite_norm(parameters, unique, norm);
  // PyTorch multiplies by min(max_norm / (norm + 1e-6), 1) unconditionally, so a NaN norm scales
  // by NaN and an infinite one by 0; below max_norm the factor would be (nearly) 1 and is skipped.
  if (norm > max_norm || std::isnan(norm)) {
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
double clip_grad_norm(const std::vector<std::shared_ptr<Parameter<Value, Scalar>>>& parameters, double max_norm,
                      bool error_if_nonfinite = false) {
  return detail::clip_grad_norm_impl(parameters, max_norm, error_if_nonfinite);
}
template <typename P, typename = typename P::grad_type>
double clip_grad_norm(const std::vector<std::shared_ptr<P>>& parameters, double max_norm,
                      bool error_if_nonfinite = false) {
  return detail::clip_grad_norm_impl(parameters, max_norm, error_if_nonfinite);
}

}  // namespace embedhead

#endif  // EMBEDHEAD_OPTIM_CLIP_HPP
