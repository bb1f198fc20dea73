// embedhead internals: opening a file for reading, and writing one so that `path` is either the
// old file or the whole new one -- without ever blocking on, or acting on, a special file.
//
// A named pipe makes open() wait for the other end, a terminal may become the controlling one, a
// device may act when it is opened (a tape rewinds, a watchdog starts), and a symbolic link at a
// temporary name would redirect a write. So:
//   reading   InputFile stat()s the path and refuses anything but a regular file before opening
//             it; it then opens with O_NONBLOCK | O_NOCTTY and checks the opened file again
//             (fstat), so a path swapped for a pipe between the two cannot block either.
//   writing   write_file_atomically writes `path`.tmp -- refused if it exists and is not a
//             regular file, opened with O_NOFOLLOW | O_NONBLOCK and checked again -- then renames
//             it over `path` (atomic on POSIX within one file system).
// io_error messages name the caller, the path and the system's reason (strerror).
//
// POSIX (open, fstat, pread, write) on Unix-like systems. Elsewhere, or with
// EMBEDHEAD_PORTABLE_FILES defined (tests/CMakeLists.txt builds npy_test so too), standard C++ only:
// the same checks through std::filesystem, then std::fstream; a path swapped between the check and
// the open is not caught there.
#ifndef EMBEDHEAD_DETAIL_FILES_HPP
#define EMBEDHEAD_DETAIL_FILES_HPP

#include "../errors.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#if !defined(EMBEDHEAD_PORTABLE_FILES) && (defined(__unix__) || defined(__APPLE__))
#define EMBEDHEAD_DETAIL_POSIX_FILES 1
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#else
#define EMBEDHEAD_DETAIL_POSIX_FILES 0
#include <filesystem>
#include <fstream>
#include <system_error>
#endif

namespace embedhead {
namespace detail {

[[noreturn]] inline void throw_io_error(const char* where, const std::string& what, const std::string& path,
                                        const std::string& reason) {
  throw io_error(std::string(where) + ": " + what + " '" + path + "': " + reason);
}

[[noreturn]] inline void throw_not_regular(const char* where, const std::string& path, const char* kind,
                                           bool exists_already = false) {
  throw io_error(std::string(where) + ": '" + path + "' " + (exists_already ? "exists and " : "") +
                 "is not a regular file (" + kind + ")");
}

#if EMBEDHEAD_DETAIL_POSIX_FILES

inline const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a named pipe";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "an unknown kind of file";
}

// A regular file open for reading. Move-only.
class InputFile {
 public:
  // \throws io_error naming `where`, the path and the reason: it does not exist or may not be
  // read, or it is not a regular file (checked before it is opened).
  InputFile(const std::string& path, const char* where) : path_(path), where_(where) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) throw_io_error(where, "cannot open", path, std::strerror(errno));
    if (!S_ISREG(st.st_mode)) throw_not_regular(where, path, file_kind(st.st_mode));
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    if (fd_ < 0) throw_io_error(where, "cannot open", path, std::strerror(errno));
    const int flags = ::fcntl(fd_, F_GETFL);
    if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode) || flags < 0 ||
        ::fcntl(fd_, F_SETFL, flags & ~O_NONBLOCK) != 0) {
      const int error = errno;
      const bool regular = S_ISREG(st.st_mode);
      ::close(fd_);
      fd_ = -1;
      if (!regular) throw_not_regular(where, path, file_kind(st.st_mode));
      throw_io_error(where, "cannot open", path, std::strerror(error));
    }
    size_ = static_cast<std::uint64_t>(st.st_size);
  }
  InputFile(InputFile&& other) noexcept
      : path_(std::move(other.path_)), where_(other.where_), fd_(other.fd_), size_(other.size_) {
    other.fd_ = -1;
  }
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;
  InputFile& operator=(InputFile&&) = delete;
  ~InputFile() {
    if (fd_ >= 0) ::close(fd_);
  }

  // The size when it was opened.
  std::uint64_t size() const { return size_; }
  // The file descriptor (for mmap).
  int descriptor() const { return fd_; }

  // Reads exactly `bytes` bytes at `offset` into dst. \throws io_error with the reason, or if the
  // file ends first (truncated since it was opened).
  void read_at(std::uint64_t offset, void* dst, std::size_t bytes) const {
    auto* out = static_cast<unsigned char*>(dst);
    std::size_t done = 0;
    while (done < bytes) {
      const ::ssize_t n = ::pread(fd_, out + done, std::min<std::size_t>(bytes - done, std::size_t{1} << 30),
                                  static_cast<off_t>(offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw_io_error(where_, "cannot read", path_, std::strerror(errno));
      if (n == 0) throw_ended(offset + done);
      done += static_cast<std::size_t>(n);
    }
  }

 private:
  [[noreturn]] void throw_ended(std::uint64_t at) const {
    throw io_error(std::string(where_) + ": cannot read '" + path_ + "': it ends at byte " + std::to_string(at) +
                   " but had " + std::to_string(size_) + " bytes when it was opened (truncated since?)");
  }

  std::string path_;
  const char* where_;
  int fd_ = -1;
  std::uint64_t size_ = 0;
};

// The temporary of write_file_atomically, written through a buffer. Move-only.
class OutputFile {
 public:
  // Creates or truncates `path`. \throws io_error if it exists and is not a regular file (it is
  // not opened then, nor followed if it is a symbolic link), or cannot be created.
  OutputFile(const std::string& path, const char* where) : path_(path), where_(where) {
    struct stat st {};
    if (::lstat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
      throw_not_regular(where, path, file_kind(st.st_mode), true);
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_NOCTTY | O_NOFOLLOW | O_NONBLOCK, 0666);
    if (fd_ < 0) throw_io_error(where, "cannot create", path, std::strerror(errno));
    const int flags = ::fcntl(fd_, F_GETFL);
    if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode) || flags < 0 ||
        ::fcntl(fd_, F_SETFL, flags & ~O_NONBLOCK) != 0 || ::ftruncate(fd_, 0) != 0) {
      const int error = errno;
      const bool regular = S_ISREG(st.st_mode);
      ::close(fd_);
      fd_ = -1;
      if (!regular) throw_not_regular(where, path, file_kind(st.st_mode), true);
      throw_io_error(where, "cannot create", path, std::strerror(error));
    }
  }
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;
  ~OutputFile() {
    if (fd_ >= 0) ::close(fd_);
  }

  // Appends `bytes` bytes. \throws io_error with the reason (e.g. no space left on the device).
  void write(const void* data, std::size_t bytes) {
    if (bytes == 0) return;
    if (buffer_.size() + bytes > kBufferBytes) flush();
    if (bytes >= kBufferBytes) {
      write_all(static_cast<const unsigned char*>(data), bytes);
    } else {
      const auto* p = static_cast<const unsigned char*>(data);
      buffer_.insert(buffer_.end(), p, p + bytes);
    }
  }
  // Writes what is buffered and closes the file. \throws io_error (a write or the close failed).
  void close() {
    flush();
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) throw_io_error(where_, "cannot write", path_, std::strerror(errno));
  }
  // Closes the file without writing what is buffered (after a failure). Never throws.
  void abandon() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  static constexpr std::size_t kBufferBytes = std::size_t{1} << 20;

  void flush() {
    write_all(buffer_.data(), buffer_.size());
    buffer_.clear();
  }
  void write_all(const unsigned char* p, std::size_t bytes) {
    while (bytes > 0) {
      const ::ssize_t n = ::write(fd_, p, std::min<std::size_t>(bytes, std::size_t{1} << 30));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) throw_io_error(where_, "cannot write", path_, n < 0 ? std::strerror(errno) : "nothing written");
      p += n;
      bytes -= static_cast<std::size_t>(n);
    }
  }

  std::string path_;
  const char* where_;
  int fd_ = -1;
  std::vector<unsigned char> buffer_;
};

#else  // standard C++ only

inline const char* file_kind(std::filesystem::file_type type) {
  switch (type) {
    case std::filesystem::file_type::directory: return "a directory";
    case std::filesystem::file_type::fifo: return "a named pipe";
    case std::filesystem::file_type::character: return "a character device";
    case std::filesystem::file_type::block: return "a block device";
    case std::filesystem::file_type::socket: return "a socket";
    case std::filesystem::file_type::symlink: return "a symbolic link";
    default: return "an unknown kind of file";
  }
}

class InputFile {
 public:
  InputFile(const std::string& path, const char* where) : path_(path), where_(where) {
    std::error_code error;
    const auto status = std::filesystem::status(path, error);
    if (error) throw_io_error(where, "cannot open", path, error.message());
    if (!std::filesystem::is_regular_file(status)) throw_not_regular(where, path, file_kind(status.type()));
    size_ = static_cast<std::uint64_t>(std::filesystem::file_size(path, error));
    if (error) throw_io_error(where, "cannot open", path, error.message());
    in_.open(path, std::ios::binary);
    if (!in_) throw_io_error(where, "cannot open", path, std::strerror(errno));
  }
  std::uint64_t size() const { return size_; }
  void read_at(std::uint64_t offset, void* dst, std::size_t bytes) const {
    if (bytes == 0) return;
    in_.clear();
    in_.seekg(static_cast<std::streamoff>(offset));
    in_.read(static_cast<char*>(dst), static_cast<std::streamsize>(bytes));
    if (static_cast<std::size_t>(in_.gcount()) != bytes)
      throw io_error(std::string(where_) + ": cannot read '" + path_ + "': it ends at byte " +
                     std::to_string(offset + static_cast<std::uint64_t>(in_.gcount())) + " but had " +
                     std::to_string(size_) + " bytes when it was opened (truncated since?)");
  }

 private:
  std::string path_;
  const char* where_;
  std::uint64_t size_ = 0;
  mutable std::ifstream in_;
};

class OutputFile {
 public:
  OutputFile(const std::string& path, const char* where) : path_(path), where_(where) {
    std::error_code error;
    const auto status = std::filesystem::symlink_status(path, error);
    if (!error && std::filesystem::exists(status) && !std::filesystem::is_regular_file(status))
      throw_not_regular(where, path, file_kind(status.type()), true);
    out_.open(path, std::ios::binary | std::ios::trunc);
    if (!out_) throw_io_error(where, "cannot create", path, std::strerror(errno));
  }
  void write(const void* data, std::size_t bytes) {
    if (bytes == 0) return;
    out_.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
    if (!out_) throw_io_error(where_, "cannot write", path_, std::strerror(errno));
  }
  void close() {
    out_.close();
    if (!out_) throw_io_error(where_, "cannot write", path_, std::strerror(errno));
  }
  void abandon() noexcept { out_.close(); }

 private:
  std::string path_;
  const char* where_;
  std::ofstream out_;
};

#endif

// Calls write_contents(OutputFile&) on `path`.tmp, then renames it over `path`: a crash, a full
// disk or an exception never leaves a partial file under the final name, and the temporary is
// removed on every failure after it was created.
// \throws io_error naming `where`, the file and the system's reason; whatever write_contents throws.
template <typename WriteContents>
void write_file_atomically(const std::string& path, const char* where, WriteContents&& write_contents) {
  const std::string temporary = path + ".tmp";
  {
    OutputFile out(temporary, where);  // a refused temporary is not ours to remove
    try {
      write_contents(out);
      out.close();
    } catch (...) {
      out.abandon();
      std::remove(temporary.c_str());
      throw;
    }
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    const int error = errno;
    std::remove(temporary.c_str());
    throw io_error(std::string(where) + ": cannot rename '" + temporary + "' to '" + path +
                   "': " + std::strerror(error));
  }
}

}  // namespace detail
}  // namespace embedhead

#endif  // EMBEDHEAD_DETAIL_FILES_HPP
