// Scratch files for the tests of include/embedhead/io/: a path under /tmp unique to the test
// program and the process, a file's bytes read or written whole, calls that must not block on a
// named pipe, and a path the process may not read.
#ifndef EMBEDHEAD_TESTS_REFERENCE_FILES_HPP
#define EMBEDHEAD_TESTS_REFERENCE_FILES_HPP

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <fstream>
#include <iterator>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace test_support {

// "/tmp/embedhead_<test>_<pid>_<name>": distinct for two test programs run side by side (ctest -j).
inline std::string temp_path(const std::string& test, const std::string& name) {
  return "/tmp/embedhead_" + test + "_" + std::to_string(::getpid()) + "_" + name;
}

// The whole file, byte for byte ("" when it cannot be opened).
inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Replaces the file (or creates it) with exactly `bytes`.
inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Runs call() while a named pipe exists at `fifo` (created here, removed after) and returns true
// if the call blocked on it. A call that opens the pipe and waits for the other end is released
// after `patience` by a helper thread that opens the other end -- for reading (and drains it) when
// `call_writes`, else for writing (and closes it at once, an end of file) -- so a test of a call
// that blocks fails instead of hanging.
template <typename Call>
bool blocks_on_fifo(const std::string& fifo, Call&& call, bool call_writes = false,
                    std::chrono::milliseconds patience = std::chrono::milliseconds(1500)) {
  ::unlink(fifo.c_str());
  if (::mkfifo(fifo.c_str(), 0600) != 0) throw std::runtime_error("mkfifo '" + fifo + "' failed");
  // A writer released by a reader that has gone must not kill the test program.
  const auto old_sigpipe = std::signal(SIGPIPE, SIG_IGN);
  std::mutex mutex;
  std::condition_variable done_cv;
  bool done = false, blocked = false;
  std::thread rescuer([&] {
    std::unique_lock<std::mutex> lock(mutex);
    if (done_cv.wait_for(lock, patience, [&] { return done; })) return;
    blocked = true;
    while (!done) {
      lock.unlock();
      const int fd = ::open(fifo.c_str(), (call_writes ? O_RDONLY : O_WRONLY) | O_NONBLOCK | O_CLOEXEC);
      if (fd >= 0) {
        if (call_writes) {  // read what the call writes until it closes its end
          ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
          char buffer[4096];
          while (::read(fd, buffer, sizeof buffer) > 0) {
          }
        }
        ::close(fd);
      }
      lock.lock();
      done_cv.wait_for(lock, std::chrono::milliseconds(20), [&] { return done; });
    }
  });
  const auto finish = [&] {
    {
      std::lock_guard<std::mutex> lock(mutex);
      done = true;
    }
    done_cv.notify_all();
    rescuer.join();
    std::signal(SIGPIPE, old_sigpipe);
    ::unlink(fifo.c_str());
  };
  try {
    call();
  } catch (...) {
    finish();
    throw;
  }
  finish();
  return blocked;
}

// A path that open(O_RDONLY) refuses with EACCES, or "" if there is none here. As a non-root
// user: `scratch`, created with mode 000. As root, whom file modes do not stop (CAP_DAC_OVERRIDE),
// a write-only sysctl file: /proc/sys checks a file's mode for root as well.
inline std::string unreadable_path(const std::string& scratch) {
  std::vector<std::string> candidates;
  if (::geteuid() != 0) {
    write_bytes(scratch, "secret");
    ::chmod(scratch.c_str(), 0);
    candidates.push_back(scratch);
  }
  candidates.push_back("/proc/sys/vm/compact_memory");
  for (const auto& path : candidates) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd >= 0) {
      ::close(fd);
      continue;
    }
    if (errno == EACCES) return path;
  }
  return "";
}

}  // namespace test_support

#endif  // EMBEDHEAD_TESTS_REFERENCE_FILES_HPP
