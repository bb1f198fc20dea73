// Peak resident memory of each optimizer's state, measured (getrusage's ru_maxrss), not estimated:
// an embedding table of V rows, d = 768 (float), whose gradient touches 2,000 distinct rows, stepped
// 3 times by each optimizer in a process of its own (fork), so that one optimizer's pages never
// count towards another's. Each child measures its peak RSS once the table and its gradient exist
// (the baseline), then constructs the optimizer and steps; the row is the growth of the peak, beside
// the size of the optimizer's buffers (state_MiB: what its state() would save).
//
//   optimizer         state buffers                     expected growth at V = 262,144, d = 768
//   SGD               none                              0
//   RowWiseAdagrad    one accumulator per row, [V, 1]    1 MiB
//   Adagrad           [V, d]                            768 MiB
//   LazyAdam          m, v [V, d]                       1.5 GiB
//   AdamW             m, v [V, d]                       1.5 GiB
//   LazyAdamW         m, v [V, d], three [V, 1]          1.5 GiB + 3 MiB
//   AdamW, trainable  m, v [k, d], k = 2,000 rows       11.7 MiB (Parameter::set_trainable_rows:
//     rows            the touched rows are the only trainable ones)
//
// Usage: optimizer_memory [V] (default 262,144). Exits non-zero when a child fails or when a
// growth exceeds its buffers by more than 16 MiB (the allocator's and the step's own scratch).
#include <embedhead/optim/adagrad.hpp>
#include <embedhead/optim/adamw.hpp>
#include <embedhead/optim/lazy_adam.hpp>
#include <embedhead/optim/lazy_adamw.hpp>
#include <embedhead/optim/rowwise_adagrad.hpp>
#include <embedhead/optim/sgd.hpp>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace {

using embedhead::Index;
using embedhead::Parameter;

constexpr Index kD = 768, kTouched = 2000;

double peak_mib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;  // kilobytes on Linux
}

// The table with every page written, and a gradient over kTouched distinct rows.
std::shared_ptr<Parameter<float>> make_table(Index V) {
  auto p = std::make_shared<Parameter<float>>(V, kD, "E");
  std::mt19937 engine(7);
  std::uniform_real_distribution<float> uniform(-0.02f, 0.02f);
  for (Index i = 0; i < p->value().size(); ++i) p->value().data()[i] = uniform(engine);
  // Rows spread evenly over the table (no O(V) temporary: it would raise the baseline's peak and hide
  // a smaller state under it).
  std::vector<Index> rows(static_cast<std::size_t>(kTouched));
  for (Index i = 0; i < kTouched; ++i) rows[static_cast<std::size_t>(i)] = i * (V / kTouched);
  std::vector<Index> slots(rows.size());
  p->grad().touch_rows(rows.data(), kTouched, slots.data());
  for (Index i = 0; i < kTouched; ++i)
    for (Index j = 0; j < kD; ++j) p->grad().slot_row(slots[static_cast<std::size_t>(i)])(j) = 1e-3f * uniform(engine);
  return p;
}

struct Case {
  const char* name;
  double state_floats_per_row;                                        // the buffers' floats per row of the table
  std::function<void(const std::shared_ptr<Parameter<float>>&)> run;  // construct, step 3 times
};

// The same, with the gradient's touched rows made the table's only trainable rows first.
template <typename Optimizer, typename Options>
std::function<void(const std::shared_ptr<Parameter<float>>&)> masked_steps(const Options& options) {
  return [options](const std::shared_ptr<Parameter<float>>& p) {
    const std::vector<Index> rows = p->grad().touched_rows();
    p->set_trainable_rows(rows);  // clears the gradient: set it again
    std::vector<Index> slots(rows.size());
    p->grad().touch_rows(rows.data(), static_cast<Index>(rows.size()), slots.data());
    for (const Index slot : slots) p->grad().slot_row(slot).setConstant(1e-3f);
    Optimizer optimizer(options, {p});
    for (int i = 0; i < 3; ++i) optimizer.step();
  };
}

template <typename Optimizer, typename Options>
std::function<void(const std::shared_ptr<Parameter<float>>&)> steps(const Options& options) {
  return [options](const std::shared_ptr<Parameter<float>>& p) {
    Optimizer optimizer(options, {p});
    for (int i = 0; i < 3; ++i) optimizer.step();
  };
}

}  // namespace

int main(int argc, char** argv) {
  const Index V = argc > 1 ? std::atol(argv[1]) : 262144;
  if (V < kTouched) {
    std::fprintf(stderr, "optimizer_memory: V = %ld outside [%ld, inf)\n", static_cast<long>(V),
                 static_cast<long>(kTouched));
    return 2;
  }
  const std::vector<Case> cases = {
      {"SGD", 0, steps<embedhead::SGD<float>>(embedhead::SGDOptions{})},
      {"RowWiseAdagrad", 1.0 / kD, steps<embedhead::RowWiseAdagrad<float>>(embedhead::RowWiseAdagradOptions{})},
      {"Adagrad", 1, steps<embedhead::Adagrad<float>>(embedhead::AdagradOptions{})},
      {"LazyAdam", 2, steps<embedhead::LazyAdam<float>>(embedhead::AdamOptions{})},
      {"AdamW", 2, steps<embedhead::AdamW<float>>(embedhead::AdamOptions{})},
      {"LazyAdamW", 2 + 3.0 / kD, steps<embedhead::LazyAdamW<float>>(embedhead::AdamOptions{})},
      {"AdamW_trainable", 2.0 * kTouched / static_cast<double>(V),
       masked_steps<embedhead::AdamW<float>>(embedhead::AdamOptions{})},
  };
  const double table_mib = static_cast<double>(V) * kD * 4 / (1024.0 * 1024.0);
  std::printf("V = %ld, d = %ld, table %.1f MiB, %ld touched rows, 3 steps each\n", static_cast<long>(V),
              static_cast<long>(kD), table_mib, static_cast<long>(kTouched));
  std::printf("%-16s %12s %12s %12s\n", "optimizer", "state_MiB", "peak_growth", "baseline");
  bool ok = true;
  for (const Case& c : cases) {
    int pipe_fd[2];
    if (pipe(pipe_fd) != 0) return 2;
    const pid_t child = fork();
    if (child < 0) return 2;
    if (child == 0) {
      close(pipe_fd[0]);
      const auto p = make_table(V);
      const double baseline = peak_mib();
      c.run(p);
      const double growth = peak_mib() - baseline;
      const double values[2] = {growth, baseline};
      const bool written = write(pipe_fd[1], values, sizeof(values)) == static_cast<ssize_t>(sizeof(values));
      _exit(written ? 0 : 1);
    }
    close(pipe_fd[1]);
    double values[2] = {0, 0};
    const bool read_ok = read(pipe_fd[0], values, sizeof(values)) == static_cast<ssize_t>(sizeof(values));
    close(pipe_fd[0]);
    int status = 0;
    waitpid(child, &status, 0);
    if (!read_ok || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      std::fprintf(stderr, "optimizer_memory: the %s child failed\n", c.name);
      ok = false;
      continue;
    }
    const double state_mib = c.state_floats_per_row * table_mib;
    std::printf("%-16s %12.1f %12.1f %12.1f\n", c.name, state_mib, values[0], values[1]);
    if (values[0] > state_mib + 16.0) {
      std::fprintf(stderr, "optimizer_memory: %s grew by %.1f MiB, beyond its %.1f MiB of buffers\n", c.name, values[0],
                   state_mib);
      ok = false;
    }
  }
  return ok ? 0 : 1;
}
