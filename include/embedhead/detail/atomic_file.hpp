// embedhead internals: writing a file so that `path` is either the old file or the whole new one.
#ifndef EMBEDHEAD_DETAIL_ATOMIC_FILE_HPP
#define EMBEDHEAD_DETAIL_ATOMIC_FILE_HPP

#include "../errors.hpp"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

namespace embedhead {
namespace detail {

// Calls write_contents(std::ofstream&) on `path`.tmp, then renames it over `path` (atomic on
// POSIX within one file system): a crash, a full disk or an exception never leaves a partial
// file under the final name, and the temporary is removed on every failure.
// \throws io_error naming `where`, the file and errno's text; whatever write_contents throws.
template <typename WriteContents>
void write_file_atomically(const std::string& path, const char* where, WriteContents&& write_contents) {
  const std::string temporary = path + ".tmp";
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    if (!out) throw io_error(std::string(where) + ": cannot create '" + temporary + "': " + std::strerror(errno));
    try {
      write_contents(out);
    } catch (...) {
      out.close();
      std::remove(temporary.c_str());
      throw;
    }
    out.flush();
    if (!out) {
      out.close();
      std::remove(temporary.c_str());
      throw io_error(std::string(where) + ": writing '" + temporary + "' failed (disk full?)");
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

#endif  // EMBEDHEAD_DETAIL_ATOMIC_FILE_HPP
