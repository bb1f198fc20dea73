// embedhead: learning-rate schedules (constant, linear warm-up, warm-up then cosine decay), as
// multipliers of an optimizer's base learning rate.
#ifndef EMBEDHEAD_OPTIM_SCHEDULE_HPP
#define EMBEDHEAD_OPTIM_SCHEDULE_HPP

#include "../errors.hpp"
#include "optimizer.hpp"

#include <cmath>
#include <cstdint>
#include <sstream>

namespace embedhead {

// multiplier(t) for optimizer step t = 0, 1, 2, ... (the step about to be taken); set
//   optimizer.set_lr(base_lr * schedule(optimizer.step_count()))
// before each step. Linear warm-up: (t + 1) / warmup for t < warmup, then 1. Cosine: after the
// warm-up, min_ratio + (1 - min_ratio) (1 + cos(pi progress)) / 2 with progress = (t - warmup) /
// (total - warmup) clamped to [0, 1].
class LrSchedule {
 public:
  static LrSchedule constant() { return LrSchedule(0, 0, 1.0, false); }
  // \throws value_error if warmup_steps < 0.
  static LrSchedule linear_warmup(std::int64_t warmup_steps) {
    check_steps("linear_warmup", "warmup_steps", warmup_steps);
    return LrSchedule(warmup_steps, 0, 1.0, false);
  }
  // \throws value_error if warmup_steps < 0, total_steps <= warmup_steps or min_ratio outside [0, 1].
  static LrSchedule warmup_cosine(std::int64_t warmup_steps, std::int64_t total_steps, double min_ratio = 0.0) {
    check_steps("warmup_cosine", "warmup_steps", warmup_steps);
    if (total_steps <= warmup_steps) {
      std::ostringstream message;
      message << "LrSchedule::warmup_cosine: total_steps = " << total_steps << " outside (" << warmup_steps
              << ", inf) (must exceed warmup_steps)";
      throw value_error(message.str());
    }
    if (!(min_ratio >= 0 && min_ratio <= 1))
      detail::throw_hyperparameter("LrSchedule::warmup_cosine", "min_ratio", min_ratio, "[0, 1]");
    return LrSchedule(warmup_steps, total_steps, min_ratio, true);
  }

  double operator()(std::int64_t t) const {
    if (t < warmup_) return static_cast<double>(t + 1) / static_cast<double>(warmup_);
    if (!cosine_) return 1.0;
    const double progress = std::clamp(static_cast<double>(t - warmup_) / static_cast<double>(total_ - warmup_), 0.0,
                                       1.0);
    return min_ratio_ + (1.0 - min_ratio_) * 0.5 * (1.0 + std::cos(3.14159265358979323846 * progress));
  }

 private:
  LrSchedule(std::int64_t warmup, std::int64_t total, double min_ratio, bool cosine)
      : warmup_(warmup), total_(total), min_ratio_(min_ratio), cosine_(cosine) {}
  static void check_steps(const char* where, const char* what, std::int64_t steps) {
    if (steps < 0) {
      std::ostringstream message;
      message << "LrSchedule::" << where << ": " << what << " = " << steps << " outside [0, inf)";
      throw value_error(message.str());
    }
  }
  std::int64_t warmup_, total_;
  double min_ratio_;
  bool cosine_;
};

}  // namespace embedhead

#endif  // EMBEDHEAD_OPTIM_SCHEDULE_HPP
