// embedhead: inverted dropout.
//
//   training  out = x * m / (1 - p),  m ~ Bernoulli(1 - p) per element, kept for backward
//   backward  dx  = dout * m / (1 - p) (the same mask)
//   eval      out = x, dx = dout
//
// The mask is stored as the multipliers M = m / (1 - p), so both passes are one elementwise
// product. p = 1 gives M = 0, so finite inputs give zeros rather than x * 0 * (1/0) = NaN
// (an infinite or NaN input still gives NaN where dropped, as in PyTorch). Element i of a
// forward keeps its value when rng.uniform_at(counter + i) >= p, so a seed fixes every mask.
#ifndef EMBEDHEAD_DROPOUT_HPP
#define EMBEDHEAD_DROPOUT_HPP

#include "detail/checks.hpp"
#include "init.hpp"
#include "types.hpp"

#include <cstdint>
#include <stdexcept>
#include <type_traits>

namespace embedhead {

template <typename Scalar>
class Dropout {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");

 public:
  // \throws value_error unless 0 <= p <= 1.
  explicit Dropout(double p, std::uint64_t seed = 0)
      : p_((detail::check_probability("Dropout", "p", p), p)), rng_(seed) {}

  double p() const { return p_; }
  bool is_training() const { return training_; }
  void train(bool on = true) { training_ = on; }
  void eval() { training_ = false; }
  const Rng& rng() const { return rng_; }
  Rng& rng() { return rng_; }
  // The multipliers M [N, d] of the last training forward: 0 or 1 / (1 - p) (0 when p = 1).
  const RowMatrix<Scalar>& mask() const { return mask_; }

  // x [N, d] -> out [N, d]: x * M with a fresh mask in training mode, x in eval mode. out may be
  // x. Training draws N*d numbers from rng(). \throws shape_error if out is not [N, d] (mask and
  // rng unchanged). Allocates only when the mask's shape changes.
  void forward(const ConstMatrixRef<Scalar>& x, MatrixRef<Scalar> out) {
    detail::check_shape("Dropout::forward", "out", out, x.rows(), x.cols());
    if (!training_) {
      has_forward_ = true;
      last_forward_training_ = false;
      if (out.data() != x.data()) out = x;
      return;
    }
    const Scalar keep_scale = p_ < 1.0 ? static_cast<Scalar>(1.0 / (1.0 - p_)) : Scalar(0);
    mask_.resize(x.rows(), x.cols());  // may throw bad_alloc: flags are set after it
    has_forward_ = true;
    last_forward_training_ = true;
    const std::uint64_t base = rng_.counter();
    Scalar* m = mask_.data();
    for (Index i = 0; i < mask_.size(); ++i)
      m[i] = rng_.uniform_at(base + static_cast<std::uint64_t>(i)) >= p_ ? keep_scale : Scalar(0);
    rng_.advance(static_cast<std::uint64_t>(mask_.size()));
    out = x.cwiseProduct(mask_);
  }
  RowMatrix<Scalar> forward(const ConstMatrixRef<Scalar>& x) {
    RowMatrix<Scalar> out(x.rows(), x.cols());
    forward(x, out);
    return out;
  }

  // dout [N, d] -> dx [N, d] = dout * M of the last forward (dout itself if it ran in eval mode).
  // dx may be dout. \throws std::logic_error if there was no forward; shape_error if dout or dx
  // is not the shape of the last training forward. Nothing written on throw.
  void backward(const ConstMatrixRef<Scalar>& dout, MatrixRef<Scalar> dx) const {
    if (!has_forward_) throw std::logic_error("Dropout::backward: no forward pass to take the mask from");
    detail::check_shape("Dropout::backward", "dx", dx, dout.rows(), dout.cols());
    if (!last_forward_training_) {
      if (dx.data() != dout.data()) dx = dout;
      return;
    }
    detail::check_shape("Dropout::backward", "dout", dout, mask_.rows(), mask_.cols());
    dx = dout.cwiseProduct(mask_);
  }
  RowMatrix<Scalar> backward(const ConstMatrixRef<Scalar>& dout) const {
    RowMatrix<Scalar> dx(dout.rows(), dout.cols());
    backward(dout, dx);
    return dx;
  }

 private:
  double p_;
  Rng rng_;
  bool training_ = true;
  bool has_forward_ = false;
  bool last_forward_training_ = false;
  RowMatrix<Scalar> mask_;
};

}  // namespace embedhead

#endif  // EMBEDHEAD_DROPOUT_HPP
