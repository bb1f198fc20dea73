// embedhead: softmax cross-entropy on logits.
//
// For a row z = logits[n] [V] with target y = targets[n]:
//   lse    = m + log sum_j exp(z_j - m),  m = max_j z_j        (the true row max: no overflow)
//   loss_n = lse - z_y                                          (= -log softmax(z)_y)
//   dz     = (softmax(z) - one_hot(y)) * scale,  softmax(z)_j = exp(z_j - lse)
// Rows whose target equals ignore_index give loss 0, dz = 0 and are not counted.
// scale = 1 / count for Reduction::mean, 1 for sum and none (none: dz is d loss_n / d z).
// Take logits, not probabilities: applying softmax before this function is the classic bug.
#ifndef EMBEDHEAD_CROSS_ENTROPY_HPP
#define EMBEDHEAD_CROSS_ENTROPY_HPP

#include "detail/checks.hpp"
#include "detail/kernels.hpp"
#include "types.hpp"

#include <cmath>
#include <cstdint>
#include <sstream>
#include <type_traits>

namespace embedhead {

enum class Reduction { mean, sum, none };

struct CrossEntropyOptions {
  Index ignore_index = -100;  // PyTorch's default; targets equal to it are skipped
  Reduction reduction = Reduction::mean;
};

struct CrossEntropyResult {
  double loss = 0;  // mean: sum / count (0 when count = 0); sum and none: sum
  double sum = 0;   // sum of loss_n over counted rows, for gradient accumulation across batches
  Index count = 0;  // rows whose target is not ignore_index
};

namespace detail {

template <typename Id>
void check_targets(const char* where, const ConstIdRef<Id>& targets, Index N, Index V, Index ignore_index) {
  if (targets.size() != N) {
    std::ostringstream message;
    message << where << ": targets has " << targets.size() << " entries, expected N = " << N
            << " (one per logits row)";
    throw shape_error(message.str());
  }
  for (Index n = 0; n < N; ++n) {
    const Index y = static_cast<Index>(targets(n / targets.cols(), n % targets.cols()));
    if (y != ignore_index && (y < 0 || y >= V)) {
      std::ostringstream message;
      message << where << ": target " << y << " at n=" << n << " (b=" << n / targets.cols() << ", t=" << n % targets.cols()
              << ") outside [0, " << V << ") and not ignore_index (" << ignore_index << ")";
      throw index_error(message.str());
    }
  }
}

// loss_n = m + log(sum_exp) - z_y, in double; stored in losses[n] when asked.
template <typename Scalar>
double row_loss(Scalar m, Scalar sum_exp, Scalar z_y, MatrixRef<Scalar>* losses, Index n) {
  const double loss_n = static_cast<double>(m) + std::log(static_cast<double>(sum_exp)) - static_cast<double>(z_y);
  if (losses) (*losses)(n, 0) = static_cast<Scalar>(loss_n);
  return loss_n;
}

// The shared pass: writes dlogits when it is non-null, per-token losses when non-null.
template <typename Scalar, typename Id>
CrossEntropyResult cross_entropy_pass(const ConstMatrixRef<Scalar>& logits, const ConstIdRef<Id>& targets,
                                      const CrossEntropyOptions& options, MatrixRef<Scalar>* dlogits,
                                      MatrixRef<Scalar>* losses, const char* where) {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");
  const Index N = logits.rows(), V = logits.cols(), T = targets.cols();
  if (dlogits) check_shape(where, "dlogits", *dlogits, N, V);
  if (losses) check_shape(where, "losses", *losses, N, 1);
  check_targets(where, targets, N, V, options.ignore_index);

  CrossEntropyResult result;
  for (Index n = 0; n < N; ++n)
    if (static_cast<Index>(targets(n / T, n % T)) != options.ignore_index) ++result.count;
  const double scale = options.reduction == Reduction::mean ? (result.count > 0 ? 1.0 / static_cast<double>(result.count) : 0.0)
                                                            : 1.0;
  for (Index n = 0; n < N; ++n) {
    const Index y = static_cast<Index>(targets(n / T, n % T));
    if (y == options.ignore_index) {
      if (dlogits) dlogits->row(n).setZero();
      if (losses) (*losses)(n, 0) = Scalar(0);
      continue;
    }
    const auto z = logits.row(n);
    // Read z_y and m before writing dlogits, so dlogits may be logits itself (in place).
    const Scalar z_y = z(y);
    const Scalar m = z.maxCoeff();
    if (dlogits) {
      // exp(z - m) lands in dlogits, then is rescaled in place into softmax * scale.
      auto dz = dlogits->row(n);
      const Scalar sum_exp = sum_exp_shifted(z.data(), V, m, dz.data());
      dz *= static_cast<Scalar>(scale / static_cast<double>(sum_exp));
      dz(y) -= static_cast<Scalar>(scale);
      result.sum += row_loss(m, sum_exp, z_y, losses, n);
    } else {
      result.sum += row_loss(m, sum_exp_shifted<Scalar>(z.data(), V, m, nullptr), z_y, losses, n);
    }
  }
  result.loss = options.reduction == Reduction::mean ? (result.count > 0 ? result.sum / static_cast<double>(result.count) : 0.0)
                                                     : result.sum;
  return result;
}

}  // namespace detail

// logits [N, V], targets (N ids, any shape, read row-major) -> loss; dlogits [N, V] written as
// (softmax - one_hot) * scale. \throws index_error for a target outside [0, V) that is not
// ignore_index (first one, with its n); shape_error if targets has not N entries or dlogits is
// not [N, V]. Nothing written on throw. dlogits may be logits itself (computed in place, so the
// [N, V] gradient needs no second buffer). Cost: 3 passes over the logits, no allocation.
template <typename Scalar>
CrossEntropyResult cross_entropy_forward_backward(const ConstMatrixRef<Scalar>& logits, const ConstIdRef<std::int32_t>& targets,
                                                  MatrixRef<Scalar> dlogits, const CrossEntropyOptions& options = {}) {
  return detail::cross_entropy_pass<Scalar, std::int32_t>(logits, targets, options, &dlogits, nullptr,
                                                          "cross_entropy_forward_backward");
}
template <typename Scalar>
CrossEntropyResult cross_entropy_forward_backward(const ConstMatrixRef<Scalar>& logits, const ConstIdRef<std::int64_t>& targets,
                                                  MatrixRef<Scalar> dlogits, const CrossEntropyOptions& options = {}) {
  return detail::cross_entropy_pass<Scalar, std::int64_t>(logits, targets, options, &dlogits, nullptr,
                                                          "cross_entropy_forward_backward");
}

// logits [N, V], targets (N ids) -> loss; dlogits [N, V] as above and losses [N, 1] = loss_n
// (0 for ignored rows) in the same pass -- Reduction::none's outputs without a second pass.
// \throws as above, shape_error if losses is not [N, 1].
template <typename Scalar>
CrossEntropyResult cross_entropy_forward_backward(const ConstMatrixRef<Scalar>& logits, const ConstIdRef<std::int32_t>& targets,
                                                  MatrixRef<Scalar> dlogits, MatrixRef<Scalar> losses,
                                                  const CrossEntropyOptions& options = {}) {
  return detail::cross_entropy_pass<Scalar, std::int32_t>(logits, targets, options, &dlogits, &losses,
                                                          "cross_entropy_forward_backward");
}
template <typename Scalar>
CrossEntropyResult cross_entropy_forward_backward(const ConstMatrixRef<Scalar>& logits, const ConstIdRef<std::int64_t>& targets,
                                                  MatrixRef<Scalar> dlogits, MatrixRef<Scalar> losses,
                                                  const CrossEntropyOptions& options = {}) {
  return detail::cross_entropy_pass<Scalar, std::int64_t>(logits, targets, options, &dlogits, &losses,
                                                          "cross_entropy_forward_backward");
}

// logits [N, V], targets (N ids) -> loss only. \throws as cross_entropy_forward_backward.
template <typename Scalar>
CrossEntropyResult cross_entropy(const ConstMatrixRef<Scalar>& logits, const ConstIdRef<std::int32_t>& targets,
                                 const CrossEntropyOptions& options = {}) {
  return detail::cross_entropy_pass<Scalar, std::int32_t>(logits, targets, options, nullptr, nullptr, "cross_entropy");
}
template <typename Scalar>
CrossEntropyResult cross_entropy(const ConstMatrixRef<Scalar>& logits, const ConstIdRef<std::int64_t>& targets,
                                 const CrossEntropyOptions& options = {}) {
  return detail::cross_entropy_pass<Scalar, std::int64_t>(logits, targets, options, nullptr, nullptr, "cross_entropy");
}

// logits [N, V], targets (N ids) -> losses [N, 1]: loss_n per row (0 for ignored rows), the
// Reduction::none output. \throws as above, shape_error if losses is not [N, 1].
template <typename Scalar>
CrossEntropyResult cross_entropy_per_token(const ConstMatrixRef<Scalar>& logits, const ConstIdRef<std::int32_t>& targets,
                                           MatrixRef<Scalar> losses, const CrossEntropyOptions& options = {}) {
  return detail::cross_entropy_pass<Scalar, std::int32_t>(logits, targets, options, nullptr, &losses, "cross_entropy_per_token");
}
template <typename Scalar>
CrossEntropyResult cross_entropy_per_token(const ConstMatrixRef<Scalar>& logits, const ConstIdRef<std::int64_t>& targets,
                                           MatrixRef<Scalar> losses, const CrossEntropyOptions& options = {}) {
  return detail::cross_entropy_pass<Scalar, std::int64_t>(logits, targets, options, nullptr, &losses, "cross_entropy_per_token");
}


// The loss as an object holding its options, so the scalar type is named once:
//   CrossEntropyLoss<float> loss;  auto r = loss.forward_backward(logits, targets, dlogits);
template <typename Scalar>
class CrossEntropyLoss {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");

 public:
  explicit CrossEntropyLoss(const CrossEntropyOptions& options = {}) : options_(options) {}
  const CrossEntropyOptions& options() const { return options_; }

  // logits [N, V], targets (N ids) -> loss. See cross_entropy.
  CrossEntropyResult forward(const ConstMatrixRef<Scalar>& logits, const ConstIdRef<std::int32_t>& targets) const {
    return detail::cross_entropy_pass<Scalar, std::int32_t>(logits, targets, options_, nullptr, nullptr,
                                                            "CrossEntropyLoss::forward");
  }
  CrossEntropyResult forward(const ConstMatrixRef<Scalar>& logits, const ConstIdRef<std::int64_t>& targets) const {
    return detail::cross_entropy_pass<Scalar, std::int64_t>(logits, targets, options_, nullptr, nullptr,
                                                            "CrossEntropyLoss::forward");
  }

  // logits [N, V], targets (N ids) -> loss; dlogits [N, V] = (softmax - one_hot) * scale.
  // See cross_entropy_forward_backward.
  CrossEntropyResult forward_backward(const ConstMatrixRef<Scalar>& logits, const ConstIdRef<std::int32_t>& targets,
                                      MatrixRef<Scalar> dlogits) const {
    return detail::cross_entropy_pass<Scalar, std::int32_t>(logits, targets, options_, &dlogits, nullptr,
                                                            "CrossEntropyLoss::forward_backward");
  }
  CrossEntropyResult forward_backward(const ConstMatrixRef<Scalar>& logits, const ConstIdRef<std::int64_t>& targets,
                                      MatrixRef<Scalar> dlogits) const {
    return detail::cross_entropy_pass<Scalar, std::int64_t>(logits, targets, options_, &dlogits, nullptr,
                                                            "CrossEntropyLoss::forward_backward");
  }
  // ... and losses [N, 1] = loss_n in the same pass.
  CrossEntropyResult forward_backward(const ConstMatrixRef<Scalar>& logits, const ConstIdRef<std::int32_t>& targets,
                                      MatrixRef<Scalar> dlogits, MatrixRef<Scalar> losses) const {
    return detail::cross_entropy_pass<Scalar, std::int32_t>(logits, targets, options_, &dlogits, &losses,
                                                            "CrossEntropyLoss::forward_backward");
  }
  CrossEntropyResult forward_backward(const ConstMatrixRef<Scalar>& logits, const ConstIdRef<std::int64_t>& targets,
                                      MatrixRef<Scalar> dlogits, MatrixRef<Scalar> losses) const {
    return detail::cross_entropy_pass<Scalar, std::int64_t>(logits, targets, options_, &dlogits, &losses,
                                                            "CrossEntropyLoss::forward_backward");
  }

 private:
  CrossEntropyOptions options_;
};

}  // namespace embedhead

#endif  // EMBEDHEAD_CROSS_ENTROPY_HPP
