// Tests for include/embedhead/io/npy.hpp: the bytes save_npy writes (against the format as numpy
// documents it, spelled out here by hand), round trips in both dtypes, 1-D files and dtype
// conversion on load, and every malformed file (hand-built byte strings) refused with a message
// naming the problem while the destination keeps its values. numpy itself reads and writes these
// files in the python-labelled tests (tests/python/safetensors_fixture.py).
#include <embedhead/io/npy.hpp>

#include <catch2/catch.hpp>

#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "../reference/files.hpp"

using Catch::Matchers::Contains;
using embedhead::format_error;
using embedhead::Index;
using embedhead::io_error;
using embedhead::load_npy;
using embedhead::RowMatrix;
using embedhead::save_npy;
using embedhead::shape_error;

using test_support::read_bytes;
using test_support::write_bytes;

namespace {

std::string temp_path(const std::string& name) { return test_support::temp_path("npy_test", name); }

// "\x93NUMPY" 1.0, the header padded with spaces to a multiple of 64 with '\n', then data.
std::string npy_bytes(const std::string& dict, const std::string& data, int major = 1, bool pad = true) {
  std::string header = dict;
  const std::size_t preamble = major == 1 ? 10 : 12;
  if (pad) header.append((64 - (preamble + header.size() + 1) % 64) % 64, ' ');
  header.push_back('\n');
  std::string out("\x93NUMPY", 6);
  out.push_back(static_cast<char>(major));
  out.push_back('\0');
  std::uint64_t n = header.size();
  for (std::size_t i = 0; i < preamble - 8; ++i, n >>= 8) out.push_back(static_cast<char>(n & 0xff));
  return out + header + data;
}
template <typename T>
std::string le_bytes(const std::vector<T>& values) {
  std::string out(values.size() * sizeof(T), '\0');
  if (!values.empty()) std::memcpy(&out[0], values.data(), out.size());
  return out;
}

}  // namespace

TEST_CASE("npy: save_npy writes numpy's bytes: magic, v1.0, dict, 64-byte padding, C-order data", "[npy]") {
  RowMatrix<float> m(2, 3);
  m << 1.5f, -0.0f, 3.0e38f, 1.0e-45f, -2.25f, 7.0f;
  const std::string path = temp_path("exact.npy");
  save_npy(path, m);
  const std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  std::string expected("\x93NUMPY\x01\x00", 8);
  // 10 + 59 + 1 = 70 bytes unpadded -> 128: 58 spaces, then '\n'; header length 118 = 0x76.
  expected += std::string("\x76\x00", 2) + dict + std::string(58, ' ') + "\n";
  expected += le_bytes(std::vector<float>{1.5f, -0.0f, 3.0e38f, 1.0e-45f, -2.25f, 7.0f});
  const std::string bytes = read_bytes(path);
  CHECK(bytes == expected);
  CHECK((bytes.size() - 24) % 64 == 0);  // the data starts at byte 128
  std::remove(path.c_str());

  RowMatrix<double> d(1, 1);
  d << 0.1;
  save_npy(path, d);
  const std::string dbytes = read_bytes(path);
  CHECK(dbytes.substr(10, 59) == "{'descr': '<f8', 'fortran_order': False, 'shape': (1, 1), }");
  CHECK(dbytes.size() == 128 + 8);
  CHECK(dbytes[127] == '\n');
  std::remove(path.c_str());
}

TEMPLATE_TEST_CASE("npy: round trip is exact in the own dtype, including empty and strided views", "[npy]", float,
                   double) {
  const std::string path = temp_path("roundtrip.npy");
  for (const auto& [rows, cols] :
       std::vector<std::pair<Index, Index>>{{1, 1}, {7, 5}, {3, 17}, {0, 4}, {4, 0}, {129, 1}}) {
    RowMatrix<TestType> m = RowMatrix<TestType>::Random(rows, cols);
    if (m.size() > 0) {
      m(0, 0) = std::numeric_limits<TestType>::infinity();
      m(rows - 1, cols - 1) = -std::numeric_limits<TestType>::denorm_min();
    }
    save_npy(path, m);
    const RowMatrix<TestType> back = load_npy<TestType>(path);
    REQUIRE(back.rows() == rows);
    REQUIRE(back.cols() == cols);
    if (m.size() > 0)
      CHECK(std::memcmp(back.data(), m.data(), static_cast<std::size_t>(m.size()) * sizeof(TestType)) == 0);
  }
  // A block of a larger matrix (outer stride != cols) is written as its own rows.
  RowMatrix<TestType> big = RowMatrix<TestType>::Random(6, 8);
  save_npy(path, big.block(1, 2, 3, 4));
  CHECK(load_npy<TestType>(path) == big.block(1, 2, 3, 4));
  // The in-place overload fills a view.
  RowMatrix<TestType> target = RowMatrix<TestType>::Zero(6, 8);
  load_npy(path, target.block(2, 3, 3, 4));
  CHECK(target.block(2, 3, 3, 4) == big.block(1, 2, 3, 4));
  CHECK(target.col(0).isZero());
  std::remove(path.c_str());
}

TEST_CASE("npy: 1-D arrays load as [n, 1]; f4 -> double is exact, f8 -> float rounds to nearest-even", "[npy]") {
  const std::string path = temp_path("one_d.npy");
  // numpy.save of np.arange(3, dtype='<f8') + 0.5, and of a float64 tie case.
  write_bytes(path, npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (3,), }",
                              le_bytes(std::vector<double>{0.5, 1.5, 2.5})));
  const RowMatrix<double> v = load_npy<double>(path);
  REQUIRE(v.rows() == 3);
  REQUIRE(v.cols() == 1);
  CHECK(v(2, 0) == 2.5);

  const double tie = 1.0 + std::ldexp(1.0, -24);    // halfway between 1 and 1 + 2^-23: to 1 (even)
  const double above = 1.0 + std::ldexp(3.0, -24);  // halfway between 1 + 2^-23 and 1 + 2^-22: up (even)
  // Beyond float's largest value (2^128 - 2^104) but below the halfway point to 2^128: to it.
  const double near_max = std::ldexp(1.0, 128) - std::ldexp(1.0, 103) - std::ldexp(1.0, 80);
  write_bytes(path, npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (1, 3), }",
                              le_bytes(std::vector<double>{tie, above, near_max})));
  const RowMatrix<float> f = load_npy<float>(path);
  CHECK(f(0, 0) == 1.0f);
  CHECK(f(0, 1) == 1.0f + std::ldexp(1.0f, -22));
  CHECK(f(0, 2) == std::ldexp(1.0f - std::ldexp(1.0f, -24), 128));

  write_bytes(path, npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 1), }",
                              le_bytes(std::vector<float>{0.1f, -3.0f})));
  const RowMatrix<double> wide = load_npy<double>(path);
  CHECK(wide(0, 0) == static_cast<double>(0.1f));

  // Format versions 2.0 and 3.0 (4-byte header length), other quotes, spacing and no padding.
  write_bytes(path, npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 1), }",
                              le_bytes(std::vector<float>{1.0f, 2.0f}), 2));
  CHECK(load_npy<float>(path)(1, 0) == 2.0f);
  write_bytes(path, npy_bytes("{ \"shape\" : (2 , 1) , \"descr\":\"<f4\",\"fortran_order\":False}",
                              le_bytes(std::vector<float>{1.0f, 2.0f}), 3, false));
  CHECK(load_npy<float>(path)(1, 0) == 2.0f);
  std::remove(path.c_str());
}

// A finite float64 that float cannot hold used to load as an infinity without a word.
TEST_CASE("npy: a finite '<f8' value beyond float's range is a format_error when read as float", "[npy][errors]") {
  const std::string path = temp_path("beyond_float.npy");
  write_bytes(path, npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (2, 3), }",
                              le_bytes(std::vector<double>{1, 2, 3, 4, -1e300, 6})));
  const std::string expected = "load_npy: '" + path +
                               "' has the '<f8' value -1e+300 at (1, 1), outside float's range [-3.40282e+38, "
                               "3.40282e+38]: read as float it would become an infinity (load it as double)";
  CHECK_THROWS_AS(load_npy<float>(path), format_error);
  CHECK_THROWS_WITH(load_npy<float>(path), expected);
  RowMatrix<float> out = RowMatrix<float>::Constant(2, 3, 7.0f);
  CHECK_THROWS_WITH(load_npy(path, out), expected);
  CHECK(out == RowMatrix<float>::Constant(2, 3, 7.0f));
  CHECK(load_npy<double>(path)(1, 1) == -1e300);  // as double: exact

  // 1-D, from memory: the position is an index, the file is the label. The halfway point between
  // float's largest value and 2^128 rounds to 2^128 (even), an infinity.
  const double halfway = std::ldexp(1.0, 128) - std::ldexp(1.0, 103);
  const std::string bytes = npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (3,), }",
                                      le_bytes(std::vector<double>{0, 0, halfway}));
  CHECK_THROWS_AS(embedhead::load_npy_from_bytes<float>(bytes.data(), bytes.size(), "archive/x.npy"), format_error);
  CHECK_THROWS_WITH(embedhead::load_npy_from_bytes<float>(bytes.data(), bytes.size(), "archive/x.npy"),
                    Contains("load_npy: 'archive/x.npy' has the '<f8' value 3.40282e+38 at index 2, outside float's "
                             "range"));

  // NaN and infinities are not an overflow: read as they are (docs/errors.md, Non-finite values).
  write_bytes(path, npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (1, 2), }",
                              le_bytes(std::vector<double>{-std::numeric_limits<double>::infinity(),
                                                           std::numeric_limits<double>::quiet_NaN()})));
  const RowMatrix<float> special = load_npy<float>(path);
  CHECK(special(0, 0) == -std::numeric_limits<float>::infinity());
  CHECK(std::isnan(special(0, 1)));
  std::remove(path.c_str());
}

TEST_CASE("npy: malformed files are refused naming the problem, the destination unchanged", "[npy]") {
  const std::string path = temp_path("bad.npy");
  const std::string six = le_bytes(std::vector<float>{1, 2, 3, 4, 5, 6});
  const std::string dict23 = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  struct Case {
    const char* what;
    std::string bytes;
    const char* message;
  };
  std::string long_header = npy_bytes(dict23, six);
  long_header[8] = static_cast<char>(0x11);  // 10001 = 0x2711
  long_header[9] = static_cast<char>(0x27);
  const std::vector<Case> cases = {
      {"empty file", "", "fewer than the 10 of the .npy preamble"},
      {"bad magic", "\x93NUMPZ" + npy_bytes(dict23, six).substr(6), "magic string"},
      {"version 4.0", std::string("\x93NUMPY\x04\x00", 8) + npy_bytes(dict23, six).substr(8), "format version 4.0"},
      {"header longer than numpy's limit", long_header, "more than numpy.load's limit of 10000"},
      {"header runs past the end", npy_bytes(dict23, six).substr(0, 40), "runs past the end of the file"},
      {"truncated data", npy_bytes(dict23, six.substr(0, 20)),
       "24 bytes of data, but 20 bytes follow the header (truncated)"},
      {"trailing bytes", npy_bytes(dict23, six + "xx"), "(trailing bytes)"},
      {"int32", npy_bytes("{'descr': '<i4', 'fortran_order': False, 'shape': (2, 3), }", six), "dtype '<i4'"},
      {"big-endian float", npy_bytes("{'descr': '>f4', 'fortran_order': False, 'shape': (2, 3), }", six),
       "dtype '>f4'"},
      {"float16", npy_bytes("{'descr': '<f2', 'fortran_order': False, 'shape': (2, 6), }", six), "dtype '<f2'"},
      {"Fortran order", npy_bytes("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", six), "Fortran order"},
      {"3-D", npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (1, 2, 3), }", six), "shape (1, 2, 3)"},
      {"0-D", npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (), }", six.substr(0, 4)), "shape ()"},
      {"too large", npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (4611686018427387904, 4), }", six),
       "too large to address"},
      {"shape overflows 64 bits",
       npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (18446744073709551616, 1), }", six),
       "overflows 64 bits"},
      {"negative shape", npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (-2, 3), }", six),
       "not a non-negative integer"},
      {"missing key", npy_bytes("{'descr': '<f4', 'shape': (2, 3), }", six),
       "lacks one of descr, fortran_order, shape"},
      {"unknown key", npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), 'x': 1}", six),
       "unexpected or repeated key 'x'"},
      {"repeated key", npy_bytes("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", six),
       "repeated key 'descr'"},
      {"not a dict", npy_bytes("['descr', '<f4']", six), "expected '{'"},
      {"text after the dict", npy_bytes(dict23 + " 0", six), "after the header's closing '}'"},
      {"unterminated string", npy_bytes("{'descr: '<f4}", six), "expected ':'"},
      {"fortran_order not a bool", npy_bytes("{'descr': '<f4', 'fortran_order': 0, 'shape': (2, 3), }", six),
       "not True or False"},
  };
  RowMatrix<float> out = RowMatrix<float>::Constant(2, 3, 42.0f);
  for (const auto& c : cases) {
    INFO(c.what);
    write_bytes(path, c.bytes);
    REQUIRE_THROWS_AS(load_npy<float>(path), format_error);
    REQUIRE_THROWS_WITH(load_npy(path, out), Contains(c.message) && Contains(path));
    CHECK((out.array() == 42.0f).all());
  }

  // A well-formed file of another shape: shape_error naming both, destination unchanged.
  write_bytes(path, npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (3, 2), }", six));
  REQUIRE_THROWS_AS(load_npy(path, out), shape_error);
  REQUIRE_THROWS_WITH(load_npy(path, out), Contains("holds [3, 2]") && Contains("destination is [2, 3]"));
  CHECK((out.array() == 42.0f).all());
  std::remove(path.c_str());

  REQUIRE_THROWS_AS(load_npy<double>(path), io_error);  // removed: cannot open
  REQUIRE_THROWS_WITH(load_npy<double>(path), Contains("cannot open") && Contains(path));
}

TEST_CASE("npy: save_npy failures throw io_error and leave what is at the path", "[npy]") {
  RowMatrix<double> m = RowMatrix<double>::Ones(2, 2);
  REQUIRE_THROWS_AS(save_npy("/nonexistent_embedhead_dir/x.npy", m), io_error);
  REQUIRE_THROWS_WITH(save_npy("/nonexistent_embedhead_dir/x.npy", m),
                      Contains("cannot create '/nonexistent_embedhead_dir/x.npy.tmp'"));

  // A directory at the path: the temporary is written, the rename fails, the directory stays.
  const std::string dir = temp_path("dir.npy");
  REQUIRE(::mkdir(dir.c_str(), 0700) == 0);
  REQUIRE_THROWS_AS(save_npy(dir, m), io_error);
  REQUIRE_THROWS_WITH(save_npy(dir, m), Contains("cannot rename"));
  struct stat st {};
  CHECK(::stat(dir.c_str(), &st) == 0);
  CHECK(S_ISDIR(st.st_mode));
  CHECK(::stat((dir + ".tmp").c_str(), &st) != 0);  // the temporary was removed
  ::rmdir(dir.c_str());

  // An existing file is replaced only by a complete one.
  const std::string path = temp_path("replace.npy");
  save_npy(path, m);
  const std::string before = read_bytes(path);
  RowMatrix<double> other = RowMatrix<double>::Zero(3, 1);
  save_npy(path, other);
  CHECK(read_bytes(path) != before);
  CHECK(load_npy<double>(path) == other);
  std::remove(path.c_str());
}

// Issue 15, classes 3 and 9: load_npy of a named pipe blocked until a writer came, and of a
// directory threw format_error ("fewer than the 10 bytes") instead of io_error. Anything but a
// regular file is refused before it is opened.
TEST_CASE("npy: load_npy refuses a named pipe, a directory or a device without blocking, as io_error",
          "[npy][errors]") {
  const std::string fifo = temp_path("pipe.npy");
  RowMatrix<float> out = RowMatrix<float>::Constant(2, 3, 42.0f);
  bool blocked = test_support::blocks_on_fifo(fifo, [&] {
    CHECK_THROWS_AS(load_npy<float>(fifo), io_error);
    CHECK_THROWS_WITH(load_npy(fifo, out), Contains("load_npy: '" + fifo + "' is not a regular file (a named pipe)"));
  });
  CHECK_FALSE(blocked);
  CHECK((out.array() == 42.0f).all());

  const std::string dir = temp_path("dir_to_load.npy");
  REQUIRE(::mkdir(dir.c_str(), 0700) == 0);
  CHECK_THROWS_AS(load_npy<double>(dir), io_error);
  CHECK_THROWS_WITH(load_npy<double>(dir), Contains("'" + dir + "' is not a regular file (a directory)"));
  ::rmdir(dir.c_str());
  CHECK_THROWS_WITH(load_npy<float>("/dev/zero"), Contains("'/dev/zero' is not a regular file (a character device)"));

  // save_npy's temporary: a named pipe at path.tmp is refused, and nothing appears at path.
  const std::string path = temp_path("pipe_target.npy");
  const RowMatrix<float> m = RowMatrix<float>::Ones(2, 2);
  blocked = test_support::blocks_on_fifo(
      path + ".tmp",
      [&] {
        CHECK_THROWS_AS(save_npy(path, m), io_error);
        CHECK_THROWS_WITH(save_npy(path, m),
                          Contains("save_npy: '" + path + ".tmp' exists and is not a regular file (a named pipe)"));
      },
      /*call_writes=*/true);
  CHECK_FALSE(blocked);
  struct stat st {};
  CHECK(::lstat(path.c_str(), &st) != 0);

  // A symbolic link there is not followed: the file it points to keeps its contents.
  const std::string target = temp_path("link_target");
  write_bytes(target, "keep me");
  REQUIRE(::symlink(target.c_str(), (path + ".tmp").c_str()) == 0);
  CHECK_THROWS_WITH(save_npy(path, m),
                    Contains("'" + path + ".tmp' exists and is not a regular file (a symbolic link)"));
  CHECK(read_bytes(target) == "keep me");
  CHECK(::lstat(path.c_str(), &st) != 0);
  ::unlink((path + ".tmp").c_str());
  std::remove(target.c_str());
}

TEST_CASE("npy: a file the process may not read is an io_error naming it and the reason", "[npy][errors]") {
  const std::string scratch = temp_path("unreadable.npy");
  const std::string path = test_support::unreadable_path(scratch);
  if (path.empty()) {
    WARN("skipped: no file here refuses reading to this process (neither mode 000 nor a write-only sysctl file)");
    return;
  }
  RowMatrix<float> out = RowMatrix<float>::Constant(1, 1, 42.0f);
  REQUIRE_THROWS_AS(load_npy<float>(path), io_error);
  REQUIRE_THROWS_WITH(load_npy(path, out),
                      Contains("load_npy: cannot open '" + path + "'") && Contains(std::strerror(EACCES)));
  CHECK(out(0, 0) == 42.0f);
  ::unlink(scratch.c_str());
}

// The file helpers under load_npy, save_npy and the safetensors reader and writer
// (include/embedhead/detail/files.hpp): a file that shrinks after it was opened is an io_error,
// never a short read, and a write that fails says why.
TEST_CASE("npy: a file truncated while it is read, and a failed write, are io_errors with the reason",
          "[npy][errors]") {
  const std::string path = temp_path("shrinking.npy");
  write_bytes(path, std::string(4096, 'x'));
  const embedhead::detail::InputFile file(path, "load_npy");
  REQUIRE(file.size() == 4096);
  REQUIRE(::truncate(path.c_str(), 100) == 0);
  std::vector<unsigned char> buffer(4096);
  file.read_at(0, buffer.data(), 100);  // what is still there is read
  CHECK_THROWS_AS(file.read_at(0, buffer.data(), 4096), io_error);
  CHECK_THROWS_WITH(file.read_at(0, buffer.data(), 4096),
                    Contains("load_npy: cannot read '" + path + "': it ends at byte 100 but had 4096 bytes"));
  std::remove(path.c_str());

  // A file size limit makes write() fail with EFBIG: save_npy reports it, removes its temporary and
  // leaves what was at the path.
  const RowMatrix<double> big = RowMatrix<double>::Ones(64, 64);  // 32 KiB of data
  save_npy(path, RowMatrix<double>::Zero(1, 1));
  const std::string before = read_bytes(path);
  struct rlimit old_limit {};
  REQUIRE(::getrlimit(RLIMIT_FSIZE, &old_limit) == 0);
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit limit = old_limit;
  limit.rlim_cur = 1000;
  REQUIRE(::setrlimit(RLIMIT_FSIZE, &limit) == 0);
  std::string message;
  try {
    save_npy(path, big);
  } catch (const io_error& e) {
    message = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &old_limit);
  std::signal(SIGXFSZ, old_handler);
  CHECK_THAT(message, Contains("save_npy: cannot write '" + path + ".tmp': " + std::strerror(EFBIG)));
  CHECK(read_bytes(path) == before);
  struct stat st {};
  CHECK(::stat((path + ".tmp").c_str(), &st) != 0);
  std::remove(path.c_str());
}
