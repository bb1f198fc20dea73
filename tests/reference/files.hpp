// Scratch files for the tests of include/embedhead/io/: a path under /tmp unique to the test
// program and the process, and a file's bytes read or written whole.
#ifndef EMBEDHEAD_TESTS_REFERENCE_FILES_HPP
#define EMBEDHEAD_TESTS_REFERENCE_FILES_HPP

#include <unistd.h>

#include <fstream>
#include <iterator>
#include <string>

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

}  // namespace test_support

#endif  // EMBEDHEAD_TESTS_REFERENCE_FILES_HPP
