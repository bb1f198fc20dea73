// Tests for include/embedhead/io/safetensors.hpp on the standard-C++ file path of
// detail/files.hpp (tests/CMakeLists.txt builds this file with EMBEDHEAD_PORTABLE_FILES defined,
// as npy_portable_test): the header compiles without POSIX calls, ReadMode::map reads the file into
// memory as ReadMode::copy does, and the writer's atomic write and the reader's checks still hold.
#include <embedhead/io/safetensors.hpp>

#include <catch2/catch.hpp>

#include <cstdio>
#include <fstream>
#include <string>

#include "../reference/files.hpp"

static_assert(EMBEDHEAD_DETAIL_POSIX_FILES == 0, "this test is built with EMBEDHEAD_PORTABLE_FILES defined");

using Catch::Matchers::Contains;
using embedhead::DType;
using embedhead::format_error;
using embedhead::io_error;
using embedhead::ReadMode;
using embedhead::RowMatrix;
using embedhead::SafetensorsFile;
using embedhead::SafetensorsWriter;

namespace {

std::string temp_path(const std::string& name) { return test_support::temp_path("safetensors_portable_test", name); }

}  // namespace

TEST_CASE("safetensors (portable files): write, then read in both modes", "[safetensors][portable]") {
  RowMatrix<float> table(2, 3);
  table << 1.5f, -2.0f, 0.25f, 3.0f, 4.0f, -0.5f;
  RowMatrix<double> wide(1, 2);
  wide << 0.1, -1e300;
  const std::string path = temp_path("round_trip.safetensors");
  SafetensorsWriter writer;
  writer.add<float>("t", table, DType::F32).add<double>("w", wide, DType::F64).set_metadata("format", "pt");
  writer.write(path);
  CHECK_FALSE(std::ifstream(path + ".tmp").good());

  for (const ReadMode mode : {ReadMode::map, ReadMode::copy}) {
    const auto file = SafetensorsFile::open(path, mode);
    CHECK(file.metadata().at("format") == "pt");
    CHECK(file.read<float>("t") == table);
    CHECK(file.read<double>("w") == wide);
    CHECK_THROWS_AS(file.read<float>("w"), format_error);
  }
  // Without a mapping, map mode holds its own copy: rewriting the file after open changes nothing.
  const auto opened = SafetensorsFile::open(path);
  test_support::write_bytes(path, "not a safetensors file any more");
  CHECK(opened.read<float>("t") == table);
  CHECK_THROWS_AS(SafetensorsFile::open(path), format_error);
  std::remove(path.c_str());
}

TEST_CASE("safetensors (portable files): a missing file or a directory is an io_error naming it",
          "[safetensors][portable][errors]") {
  const std::string missing = temp_path("missing.safetensors");
  CHECK_THROWS_AS(SafetensorsFile::open(missing), io_error);
  CHECK_THROWS_WITH(SafetensorsFile::open(missing), Contains("safetensors: cannot open '" + missing + "'"));
  CHECK_THROWS_WITH(SafetensorsFile::open("/"), "safetensors: '/' is not a regular file (a directory)");
}
