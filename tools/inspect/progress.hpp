// embedhead-inspect: a progress bar on stderr, fed by the geometry functions' Progress callbacks.
//
// A pass draws nothing during its first second (short passes stay silent), then redraws one line
// in place ("\r") at most ten times a second, and ends it with a newline. Only stderr is written,
// so stdout (the summary, which may be piped) is never garbled. Whether to draw at all is decided
// once by the caller: stderr is a terminal, or --progress was given.
#ifndef EMBEDHEAD_TOOLS_INSPECT_PROGRESS_HPP
#define EMBEDHEAD_TOOLS_INSPECT_PROGRESS_HPP

#include <embedhead/types.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>

namespace inspect {

using embedhead::Index;
using Clock = std::chrono::steady_clock;

// One pass (e.g. "principal components"). Create it right before the call, pass callback() to the
// geometry function, and let it go out of scope (or call finish()) right after.
class ProgressPass {
 public:
  ProgressPass(bool enabled, std::string label, std::FILE* out = stderr) : state_(std::make_shared<State>()) {
    state_->enabled = enabled;
    state_->label = std::move(label);
    state_->out = out;
    state_->start = Clock::now();
  }
  ProgressPass(const ProgressPass&) = delete;
  ProgressPass& operator=(const ProgressPass&) = delete;
  ~ProgressPass() { finish(); }

  // The callback for a geometry function; empty when disabled, so the pass costs nothing.
  std::function<void(Index, Index)> callback() const {
    if (!state_->enabled) return {};
    std::shared_ptr<State> state = state_;
    return [state](Index done, Index total) { state->update(done, total); };
  }

  // Completes the line if anything was drawn.
  void finish() {
    if (state_->drawn && !state_->finished) {
      state_->draw(std::max(state_->last_done, state_->last_total), state_->last_total);
      std::fputc('\n', state_->out);
      std::fflush(state_->out);
    }
    state_->finished = true;
  }

 private:
  struct State {
    bool enabled = false, drawn = false, finished = false;
    std::string label;
    std::FILE* out = stderr;
    Clock::time_point start, last_draw;
    Index last_done = 0, last_total = 0;

    double seconds() const { return std::chrono::duration<double>(Clock::now() - start).count(); }

    void update(Index done, Index total) {
      if (finished) return;
      last_done = done;
      last_total = total;
      const auto now = Clock::now();
      if (seconds() < 1.0) return;  // short passes never draw
      if (drawn && done < total && now - last_draw < std::chrono::milliseconds(100)) return;
      draw(done, total);
    }

    void draw(Index done, Index total) {
      constexpr int kWidth = 30;
      const double fraction = total > 0 ? std::clamp(static_cast<double>(done) / static_cast<double>(total), 0.0, 1.0)
                                        : 0.0;
      const int filled = static_cast<int>(fraction * kWidth + 0.5);
      std::string bar(static_cast<std::size_t>(filled), '#');
      bar.append(static_cast<std::size_t>(kWidth - filled), '-');
      // \r back to the line start, \033[K clears what a longer previous line left behind.
      std::fprintf(out, "\r\033[K%-22s [%s] %3d%%  %.1f s", label.c_str(), bar.c_str(),
                   static_cast<int>(fraction * 100 + 0.5), seconds());
      std::fflush(out);
      drawn = true;
      last_draw = Clock::now();
    }
  };
  std::shared_ptr<State> state_;
};

}  // namespace inspect

#endif  // EMBEDHEAD_TOOLS_INSPECT_PROGRESS_HPP
