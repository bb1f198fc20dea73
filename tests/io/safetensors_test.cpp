// Tests for include/embedhead/io/safetensors.hpp: the reader's validation (every malformed-file case
// is a hand-built byte string, not a file made by our writer), dtype conversion against
// independent references (half and bfloat16 decoded bit by bit here; nearest-value search for
// rounding), the writer's layout and atomic write, and the errors of both.
#include <embedhead/io/safetensors.hpp>
#include <embedhead/low_precision.hpp>

#include <catch2/catch.hpp>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "../reference/files.hpp"

using embedhead::DType;
using embedhead::format_error;
using embedhead::Index;
using embedhead::io_error;
using embedhead::RowMatrix;
using embedhead::SafetensorsFile;
using embedhead::SafetensorsWriter;
using embedhead::shape_error;
using embedhead::value_error;

using test_support::read_bytes;
using test_support::write_bytes;

namespace {

// u64 little-endian length + header + data, as the format's specification describes it.
std::string file_bytes(const std::string& header, const std::string& data = {}, std::uint64_t length_override = ~0ull) {
  std::uint64_t n = length_override == ~0ull ? header.size() : length_override;
  std::string out;
  for (int i = 0; i < 8; ++i, n >>= 8) out.push_back(static_cast<char>(n & 0xff));
  return out + header + data;
}

SafetensorsFile parse(const std::string& bytes) {
  return SafetensorsFile::from_bytes(bytes.data(), bytes.size(), "test");
}

template <typename T>
std::string le_bytes(const std::vector<T>& values) {
  std::string out(values.size() * sizeof(T), '\0');
  std::memcpy(&out[0], values.data(), out.size());  // the test host is little-endian (checked by the header)
  return out;
}

// IEEE binary16, decoded from its bits by the definition (independent of Eigen::half).
double half_value(std::uint16_t bits) {
  const int sign = bits >> 15, exponent = (bits >> 10) & 0x1f, mantissa = bits & 0x3ff;
  double magnitude;
  if (exponent == 0)
    magnitude = std::ldexp(mantissa, -24);
  else if (exponent == 31)
    magnitude = mantissa ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else
    magnitude = std::ldexp(1024 + mantissa, exponent - 25);
  return sign ? -magnitude : magnitude;
}
// bfloat16 is the top half of a float's bits.
double bfloat16_value(std::uint16_t bits) {
  const std::uint32_t wide = static_cast<std::uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, 4);
  return f;
}

// The finite values of a 16-bit format, sorted, with their bit patterns (+0 before -0 dropped).
std::vector<std::pair<double, std::uint16_t>> finite_values(double (*decode)(std::uint16_t)) {
  std::vector<std::pair<double, std::uint16_t>> values;
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const double v = decode(static_cast<std::uint16_t>(b));
    if (std::isfinite(v) && !(v == 0 && b != 0)) values.push_back({v, static_cast<std::uint16_t>(b)});
  }
  std::sort(values.begin(), values.end());
  return values;
}

// Round-to-nearest, ties to the even bit pattern, by search among all finite values; values
// beyond the largest finite one by half an ulp or more go to infinity (IEEE overflow).
double nearest(const std::vector<std::pair<double, std::uint16_t>>& values, double x) {
  auto hi = std::lower_bound(values.begin(), values.end(), std::make_pair(x, std::uint16_t(0)));
  if (hi != values.end() && hi->first == x) return x;
  if (hi == values.end() || hi == values.begin()) {
    const auto& edge = hi == values.end() ? values.back() : values.front();
    const auto& inner = hi == values.end() ? values[values.size() - 2] : values[1];
    const double half_ulp = std::abs(edge.first - inner.first) / 2;
    if (std::abs(x - edge.first) >= half_ulp) return std::copysign(std::numeric_limits<double>::infinity(), x);
    return edge.first;
  }
  const auto lo = hi - 1;
  const double d_lo = x - lo->first, d_hi = hi->first - x;
  if (d_lo < d_hi) return lo->first;
  if (d_hi < d_lo) return hi->first;
  return (lo->second & 1) == 0 ? lo->first : hi->first;
}

std::string temp_path(const std::string& name) { return test_support::temp_path("safetensors_test", name); }

std::string error_of(const std::string& bytes) {
  try {
    parse(bytes);
  } catch (const format_error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("safetensors: a hand-built file is read value by value for every float dtype", "[safetensors]") {
  const std::vector<float> f32 = {1.5f, -0.0f, 3.0e38f, 1.0e-45f, -2.25f, 7.0f};
  const std::vector<double> f64 = {0.1, -1.0e30, 1.0e-300, 2.5};
  const std::vector<std::uint16_t> f16 = {0x3C00, 0xC000, 0x7BFF, 0x0001, 0x8400, 0x3555};
  const std::vector<std::uint16_t> bf16 = {0x3F80, 0x4049, 0xFF7F, 0x0001};
  const std::string header = R"({"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
                             R"("b":{"dtype":"F64","shape":[4],"data_offsets":[24,56]},)"
                             R"("c":{"dtype":"F16","shape":[3,2],"data_offsets":[56,68]},)"
                             R"("d":{"dtype":"BF16","shape":[2,2],"data_offsets":[68,76]},)"
                             R"("__metadata__":{"format":"pt","note":"hand-built"}})";
  const auto file = parse(file_bytes(header, le_bytes(f32) + le_bytes(f64) + le_bytes(f16) + le_bytes(bf16)));

  REQUIRE(file.tensors().size() == 4);
  CHECK(file.metadata().at("format") == "pt");
  CHECK(file.metadata().at("note") == "hand-built");
  CHECK(file.at("a").shape_string() == "[2, 3]");
  CHECK(file.at("b").dtype == DType::F64);

  const auto a = file.read<float>("a");
  REQUIRE(a.rows() == 2);
  REQUIRE(a.cols() == 3);
  for (int i = 0; i < 6; ++i) CHECK(std::memcmp(&a(i / 3, i % 3), &f32[static_cast<std::size_t>(i)], 4) == 0);

  const auto b_float = file.read<float>("b");
  const auto b_double = file.read<double>("b");
  REQUIRE(b_float.rows() == 4);
  for (int i = 0; i < 4; ++i) {
    const double x = f64[static_cast<std::size_t>(i)];
    CHECK(b_double(i, 0) == x);
    // The float nearest to x: no neighbour of the result is closer.
    const float r = b_float(i, 0);
    if (std::isfinite(r)) {
      CHECK(std::abs(static_cast<double>(r) - x) <=
            std::abs(static_cast<double>(std::nextafter(r, std::numeric_limits<float>::infinity())) - x));
      CHECK(std::abs(static_cast<double>(r) - x) <=
            std::abs(static_cast<double>(std::nextafter(r, -std::numeric_limits<float>::infinity())) - x));
    }
  }
  CHECK(b_float(2, 0) == 0.0f);  // 1e-300 underflows

  const auto c = file.read<double>("c");
  for (int i = 0; i < 6; ++i) CHECK(c(i / 2, i % 2) == half_value(f16[static_cast<std::size_t>(i)]));
  CHECK(c(0, 0) == 1.0);
  CHECK(c(1, 0) == 65504.0);
  const auto d = file.read<float>("d");
  for (int i = 0; i < 4; ++i)
    CHECK(static_cast<double>(d(i / 2, i % 2)) == bfloat16_value(bf16[static_cast<std::size_t>(i)]));
  CHECK(d(0, 1) == 3.140625f);
}

TEST_CASE("safetensors: writer output follows the specification byte by byte", "[safetensors]") {
  RowMatrix<float> table(2, 2);
  table << 1.0f, -2.0f, 0.5f, 4.0f;
  RowMatrix<float> bias(3, 1);
  bias << 1.0f, 2.0f, 3.0f;
  const std::string path = temp_path("layout.safetensors");
  SafetensorsWriter writer;
  writer.add<float>("table", table, DType::F32)
      .add<float>("bias", bias, DType::BF16, true)
      .set_metadata("format", "pt");
  writer.write(path);
  const std::string bytes = read_bytes(path);
  std::remove(path.c_str());

  REQUIRE(bytes.size() >= 8);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[static_cast<std::size_t>(i)]);
  CHECK(n % 8 == 0);  // padded so the data section is 8-byte aligned
  REQUIRE(bytes.size() == 8 + n + 16 + 6);
  const std::string header = bytes.substr(8, n);
  CHECK(header.front() == '{');
  CHECK(header.find(R"("table":{"data_offsets":[0,16],"dtype":"F32","shape":[2,2]})") != std::string::npos);
  CHECK(header.find(R"("bias":{"data_offsets":[16,22],"dtype":"BF16","shape":[3]})") != std::string::npos);
  CHECK(header.find(R"("__metadata__":{"format":"pt"})") != std::string::npos);
  CHECK(header.find_last_not_of(' ') == header.rfind('}'));  // only spaces after the JSON
  float first;
  std::memcpy(&first, bytes.data() + 8 + n, 4);
  CHECK(first == 1.0f);
  // bfloat16 of 1, 2, 3: 0x3F80, 0x4000, 0x4040, little-endian.
  const std::string expected_bias("\x80\x3f\x00\x40\x40\x40", 6);
  CHECK(bytes.substr(8 + n + 16) == expected_bias);
}

TEST_CASE("safetensors: writing rounds to nearest-even, from float and from double", "[safetensors]") {
  const auto half_values = finite_values(half_value);
  const auto bf16_values = finite_values(bfloat16_value);
  std::mt19937_64 gen(7);
  std::uniform_real_distribution<double> mantissa(-1.0, 1.0);
  std::uniform_int_distribution<int> exponent(-30, 18);
  const Index n = 4000;
  RowMatrix<double> x(n, 1);
  for (Index i = 0; i < n; ++i) x(i, 0) = std::ldexp(mantissa(gen), exponent(gen));
  // Ties and near-ties that a double -> float -> 16-bit path gets wrong: 1 + 2^-8 + 2^-30 is just
  // above the bfloat16 tie between 1 and 1 + 2^-7, but rounds to the tie itself in float.
  x(0, 0) = 1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -30);
  x(1, 0) = 1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40);  // the same for half
  x(2, 0) = 1.0 + std::ldexp(1.0, -8);                          // an exact bfloat16 tie -> 1
  x(3, 0) = 1.0 + 3 * std::ldexp(1.0, -8);                      // an exact tie -> up to even
  x(4, 0) = 65519.0;                                            // just below half's overflow boundary -> 65504
  x(5, 0) = 65519.99;                                           // -> 65504
  const RowMatrix<float> x_float = x.cast<float>();
  // F16 gets the values it can hold (|x| < 65520; beyond is a value_error, tested below): the
  // larger ones scaled down by 2^-8, to the top binades of half.
  RowMatrix<double> x_half = x;
  for (Index i = 0; i < n; ++i)
    if (std::abs(static_cast<float>(x_half(i, 0))) >= 65520.0f) x_half(i, 0) = std::ldexp(x_half(i, 0), -8);
  const RowMatrix<float> x_half_float = x_half.cast<float>();

  const std::string path = temp_path("rounding.safetensors");
  SafetensorsWriter writer;
  writer.add<double>("h64", x_half, DType::F16).add<double>("b64", x, DType::BF16);
  writer.add<float>("h32", x_half_float, DType::F16).add<float>("b32", x_float, DType::BF16);
  writer.add<double>("f64to32", x, DType::F32);
  writer.write(path);
  const auto file = SafetensorsFile::open(path);
  const auto h64 = file.read<double>("h64"), b64 = file.read<double>("b64");
  const auto h32 = file.read<double>("h32"), b32 = file.read<double>("b32");
  const auto f32 = file.read<float>("f64to32");
  std::remove(path.c_str());

  Index mismatches = 0;
  for (Index i = 0; i < n; ++i) {
    const double xf = static_cast<double>(x_float(i, 0));
    mismatches += h64(i, 0) != nearest(half_values, x_half(i, 0));
    mismatches += b64(i, 0) != nearest(bf16_values, x(i, 0));
    mismatches += h32(i, 0) != nearest(half_values, static_cast<double>(x_half_float(i, 0)));
    mismatches += b32(i, 0) != nearest(bf16_values, xf);
    mismatches += f32(i, 0) != x_float(i, 0);
  }
  CHECK(mismatches == 0);
  CHECK(b64(0, 0) == 1.0 + std::ldexp(1.0, -7));
  CHECK(h64(1, 0) == 1.0 + std::ldexp(1.0, -10));
  CHECK(b64(2, 0) == 1.0);
  CHECK(b64(3, 0) == 1.0 + std::ldexp(1.0, -6));
  CHECK(h64(4, 0) == 65504.0);
  CHECK(h64(5, 0) == 65504.0);
}

TEST_CASE("safetensors: round trip of random tables is exact in their own dtype", "[safetensors]") {
  RowMatrix<float> a = RowMatrix<float>::Random(37, 11);
  RowMatrix<double> b = RowMatrix<double>::Random(5, 3);
  const std::string path = temp_path("roundtrip.safetensors");
  SafetensorsWriter().add<float>("a", a, DType::F32).add<double>("b", b, DType::F64).write(path);
  const auto file = SafetensorsFile::open(path);
  CHECK(file.read<float>("a") == a);
  CHECK(file.read<double>("b") == b);
  CHECK(file.read<double>("a") == a.cast<double>());
  // Reading into a strided destination (a block of a larger matrix).
  RowMatrix<float> big = RowMatrix<float>::Zero(40, 20);
  file.read<float>(file.at("a"), big.block(1, 2, 37, 11));
  CHECK(big.block(1, 2, 37, 11) == a);
  CHECK(big.col(0).isZero());
  std::remove(path.c_str());
}

TEST_CASE("safetensors: every malformed file is rejected with a message that names the problem", "[safetensors]") {
  const std::string ok_tensor = R"("t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::string eight(8, '\0');
  struct Case {
    const char* label;
    std::string bytes;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"empty file", "", "fewer than the 8"},
      {"7 bytes", std::string(7, '\0'), "fewer than the 8"},
      {"header length past the end", file_bytes("{" + ok_tensor + "}", eight, 1000), "runs past the end"},
      {"header length over 100 MB", file_bytes("{}", "", 100'000'001), "exceeds the limit"},
      {"header length 2^64 - 1", file_bytes("{}", "", ~0ull - 1), "exceeds the limit"},
      {"header not an object", file_bytes("[1, 2]"), "does not begin with '{'"},
      {"header with a leading space", file_bytes(" {}"), "does not begin with '{'"},
      {"truncated JSON", file_bytes(R"({"t":{"dtype":"F32")"), "not valid JSON"},
      {"garbage after JSON", file_bytes("{}x"), "not valid JSON"},
      {"binary zeros in the header", file_bytes(std::string("{\0}", 3)), "not valid JSON"},
      {"duplicate tensor", file_bytes("{" + ok_tensor + "," + ok_tensor + "}", eight), "appears twice"},
      {"tensor not an object", file_bytes(R"({"t":[1]})"), "is not an object"},
      {"unknown dtype", file_bytes(R"({"t":{"dtype":"F12","shape":[2],"data_offsets":[0,8]}})", eight),
       "unknown dtype 'F12'"},
      {"dtype not a string", file_bytes(R"({"t":{"dtype":4,"shape":[2],"data_offsets":[0,8]}})", eight),
       "no string 'dtype'"},
      {"missing shape", file_bytes(R"({"t":{"dtype":"F32","data_offsets":[0,8]}})", eight), "no array 'shape'"},
      {"negative dimension", file_bytes(R"({"t":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", eight),
       "not a non-negative integer"},
      {"fractional dimension", file_bytes(R"({"t":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", eight),
       "not a non-negative integer"},
      {"dimension beyond 64 bits", file_bytes(R"({"t":{"dtype":"F32","shape":[1e30],"data_offsets":[0,8]}})", eight),
       "not a non-negative integer"},
      {"element count overflow",
       file_bytes(R"({"t":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", eight),
       "overflows 64 bits"},
      {"byte size overflow",
       file_bytes(R"({"t":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8]}})", eight),
       "byte size overflows"},
      {"missing offsets", file_bytes(R"({"t":{"dtype":"F32","shape":[2]}})", eight), "'data_offsets' pair"},
      {"three offsets", file_bytes(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,4,8]}})", eight),
       "'data_offsets' pair"},
      {"negative offset", file_bytes(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}})", eight),
       "'data_offsets' pair"},
      {"end before begin", file_bytes(R"({"t":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", eight),
       "end < begin"},
      {"size disagrees with shape", file_bytes(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight),
       "span 8"},
      {"overlapping tensors",
       file_bytes(
           R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
           std::string(12, '\0')),
       "(overlap)"},
      {"gap between tensors",
       file_bytes(
           R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
           std::string(12, '\0')),
       "(gap)"},
      {"data truncated", file_bytes("{" + ok_tensor + "}", std::string(5, '\0')), "(truncated)"},
      {"trailing bytes", file_bytes("{" + ok_tensor + "}", std::string(9, '\0')), "(trailing bytes)"},
      {"metadata not an object", file_bytes(R"({"__metadata__":[1]})"), "__metadata__ is not an object"},
      {"metadata value not a string", file_bytes(R"({"__metadata__":{"k":1}})"), "entry 'k' is not a string"},
      {"unknown field", file_bytes(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", eight),
       "unknown field 'x'"},
      {"empty tensor name", file_bytes(R"({"":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", eight),
       "empty name"},
      {"deep nesting", file_bytes(R"({"t":)" + std::string(5000, '[') + std::string(5000, ']') + "}"), "nests deeper"},
  };
  for (const auto& c : cases) {
    INFO("case: " << c.label);
    const std::string message = error_of(c.bytes);
    INFO("message: " << message);
    CHECK(message.find(c.message) != std::string::npos);
    CHECK(message.find("'test'") != std::string::npos);  // the file is named
  }
  CHECK(cases.size() == 34);
}

TEST_CASE("safetensors: valid edge cases are accepted", "[safetensors]") {
  // No tensors at all; a scalar; an empty tensor; header padded with spaces; other dtypes.
  CHECK(parse(file_bytes("{}")).tensors().empty());
  CHECK(parse(file_bytes("{}      ")).tensors().empty());
  const auto file = parse(file_bytes(
      R"({"s":{"dtype":"F32","shape":[],"data_offsets":[0,4]},"e":{"dtype":"F16","shape":[0,5],"data_offsets":[4,4]},)"
      R"("i":{"dtype":"I64","shape":[1],"data_offsets":[4,12]}})",
      le_bytes(std::vector<float>{2.5f}) + le_bytes(std::vector<std::int64_t>{-3})));
  CHECK(file.read<float>("s")(0, 0) == 2.5f);
  CHECK(file.at("e").numel() == 0);
  CHECK(file.read<float>("e").size() == 0);
  CHECK(file.at("i").dtype == DType::I64);
  CHECK_THROWS_WITH(file.read<float>("i"), Catch::Contains("'i'") && Catch::Contains("dtype I64"));
  CHECK_THROWS_AS(file.read<float>("i"), format_error);
}

// Found by fuzz/safetensors_fuzz (fuzz/corpus/safetensors/crash-a12bd6fe...): an F32 tensor with
// rows but no columns, read as float, passed the null data() of the empty rows to memcpy
// (undefined behaviour, reported by UBSan's nonnull-attribute check in the sanitizer builds).
TEST_CASE("safetensors: zero-sized tensors of every float dtype read as empty matrices", "[safetensors][fuzz]") {
  for (const char* dtype : {"F32", "F64", "F16", "BF16"}) {
    INFO(dtype);
    const std::string d(dtype);
    const auto file = parse(file_bytes(R"({"z":{"dtype":")" + d +
                                       R"(","shape":[0,4],"data_offsets":[0,0]},)"
                                       R"("y":{"dtype":")" +
                                       d +
                                       R"(","shape":[3,0],"data_offsets":[0,0]},)"
                                       R"("e":{"dtype":")" +
                                       d + R"(","shape":[0],"data_offsets":[0,0]}})"));
    const RowMatrix<float> y = file.read<float>("y");
    CHECK(y.rows() == 3);
    CHECK(y.cols() == 0);
    CHECK(file.read<double>("y").rows() == 3);
    CHECK(file.read<float>("z").rows() == 0);
    CHECK(file.read<float>("z").cols() == 4);
    CHECK(file.read<double>("e").rows() == 0);
    RowMatrix<float> view(3, 0);
    file.read<float>(file.at("y"), view);
    CHECK(file.first_non_finite(file.at("y")) == -1);
  }
}

// fuzz/corpus/safetensors/crash-review-dimension-beyond-index: a zero-sized tensor may have
// another dimension up to 2^64 - 1 (valid, no data); read<Scalar>(name) cast it to a negative
// Index and Eigen aborted ("Invalid sizes"). Found by reading the code while writing the fuzzer.
TEST_CASE("safetensors: a dimension beyond Index is a shape_error, not a negative matrix size", "[safetensors][fuzz]") {
  const auto file = parse(file_bytes(R"({"a":{"dtype":"F32","shape":[0,9223372036854775808],"data_offsets":[0,0]},)"
                                     R"("b":{"dtype":"BF16","shape":[18446744073709551615,0],"data_offsets":[0,0]},)"
                                     R"("c":{"dtype":"F16","shape":[0,9223372036854775807],"data_offsets":[0,0]}})"));
  CHECK(file.at("a").numel() == 0);
  CHECK_THROWS_AS(file.read<float>("a"), shape_error);
  CHECK_THROWS_WITH(file.read<float>("a"), Catch::Contains("'a'") && Catch::Contains("dimension 9223372036854775808") &&
                                               Catch::Contains("outside [0, 9223372036854775807]"));
  CHECK_THROWS_AS(file.read<double>("b"), shape_error);
  const RowMatrix<float> c = file.read<float>("c");  // the largest Index is fine: [0, 2^63 - 1], no storage
  CHECK(c.rows() == 0);
  CHECK(c.cols() == std::numeric_limits<Index>::max());
}

TEST_CASE("safetensors: lookups and shape checks name the tensor", "[safetensors]") {
  const auto file = parse(file_bytes(R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
                                     R"("v":{"dtype":"F32","shape":[2,1,1],"data_offsets":[24,32]}})",
                                     std::string(32, '\0')));
  CHECK_THROWS_AS(file.at("missing"), format_error);
  CHECK_THROWS_WITH(file.at("missing"), Catch::Contains("no tensor 'missing'") && Catch::Contains("'w'"));
  CHECK_THROWS_AS(file.expect("w", 3, 2, "the thing"), shape_error);
  CHECK_THROWS_WITH(file.expect("w", 3, 2, "the thing"),
                    Catch::Contains("'w'") && Catch::Contains("[2, 3]") && Catch::Contains("the thing is [3, 2]"));
  CHECK(&file.expect("w", 2, 3, "x") == &file.at("w"));
  CHECK_THROWS_AS(file.read<float>("v"), shape_error);  // 3-D
  RowMatrix<float> wrong(3, 3);
  CHECK_THROWS_AS(file.read<float>(file.at("w"), wrong), shape_error);
}

TEST_CASE("safetensors: first_non_finite finds NaN and infinities in each float dtype", "[safetensors]") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const auto file = parse(file_bytes(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                                     R"("b":{"dtype":"BF16","shape":[3],"data_offsets":[16,22]},)"
                                     R"("c":{"dtype":"F16","shape":[2],"data_offsets":[22,26]},)"
                                     R"("d":{"dtype":"F64","shape":[1],"data_offsets":[26,34]}})",
                                     le_bytes(std::vector<float>{1, 2, nan, 3}) +
                                         le_bytes(std::vector<std::uint16_t>{0x3F80, 0x3F80, 0xFF80}) +
                                         le_bytes(std::vector<std::uint16_t>{0x3C00, 0x3C00}) +
                                         le_bytes(std::vector<double>{-std::numeric_limits<double>::infinity()})));
  CHECK(file.first_non_finite(file.at("a")) == 2);
  CHECK(file.first_non_finite(file.at("b")) == 2);
  CHECK(file.first_non_finite(file.at("c")) == -1);
  CHECK(file.first_non_finite(file.at("d")) == 0);
}

TEST_CASE("safetensors: open reports missing files, directories and maps real files", "[safetensors]") {
  CHECK_THROWS_AS(SafetensorsFile::open("/nonexistent/x.safetensors"), io_error);
  CHECK_THROWS_WITH(SafetensorsFile::open("/nonexistent/x.safetensors"), Catch::Contains("/nonexistent/x.safetensors"));
  CHECK_THROWS_AS(SafetensorsFile::open("/tmp"), io_error);
  const std::string path = temp_path("truncated.safetensors");
  write_bytes(path, file_bytes(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", std::string(4, '\0')));
  CHECK_THROWS_AS(SafetensorsFile::open(path), format_error);
  CHECK_THROWS_WITH(SafetensorsFile::open(path), Catch::Contains(path) && Catch::Contains("truncated"));
  write_bytes(path, "");
  CHECK_THROWS_AS(SafetensorsFile::open(path), format_error);
  std::remove(path.c_str());
}

TEST_CASE("safetensors: writer errors and the atomic write", "[safetensors]") {
  RowMatrix<float> a = RowMatrix<float>::Ones(2, 2);
  SafetensorsWriter writer;
  writer.add<float>("a", a, DType::F32);
  CHECK_THROWS_AS(writer.add<float>("a", a, DType::F32), value_error);
  CHECK_THROWS_WITH(writer.add<float>("a", a, DType::F32), Catch::Contains("'a' was added before"));
  CHECK_THROWS_AS(writer.add<float>("__metadata__", a, DType::F32), value_error);
  CHECK_THROWS_AS(writer.add<float>("", a, DType::F32), value_error);
  CHECK_THROWS_WITH(writer.add<float>("b", a, DType::I32), Catch::Contains("dtype I32"));
  CHECK_THROWS_AS(writer.add<float>("b", a, DType::F32, true), shape_error);  // a vector needs one column
  const std::shared_ptr<const embedhead::Parameter<float>> none;
  CHECK_THROWS_AS(writer.add<float>("p", none, DType::F32), value_error);
  CHECK_THROWS_WITH(writer.add<float>("p", none, DType::F32), "SafetensorsWriter::add: tensor 'p' is a null Parameter");
  CHECK_FALSE(writer.contains("p"));
  // A Parameter is written as it is at write(), in the shape it was added with.
  {
    auto parameter = std::make_shared<embedhead::Parameter<double>>(RowMatrix<double>::Ones(3, 2), "p");
    SafetensorsWriter shared;
    shared.add<double>("p", parameter, DType::F64);
    parameter->resize_rows(2);
    const std::string path = temp_path("resized_parameter.safetensors");
    CHECK_THROWS_AS(shared.write(path), shape_error);
    CHECK_THROWS_WITH(shared.write(path),
                      "SafetensorsWriter::write: tensor 'p' was added as a Parameter of shape "
                      "[3, 2] but it is [2, 2] now (resized since add); nothing was written. "
                      "Add it to a new writer to write the new shape");
    CHECK_FALSE(std::ifstream(path).good());
    CHECK_FALSE(std::ifstream(path + ".tmp").good());
  }

  // A directory that does not exist: io_error, nothing created.
  CHECK_THROWS_AS(writer.write("/nonexistent/dir/x.safetensors"), io_error);

  // Overwriting an existing file replaces it whole; the temporary is gone afterwards.
  const std::string path = temp_path("atomic.safetensors");
  write_bytes(path, "old contents");
  writer.write(path);
  CHECK(SafetensorsFile::open(path).read<float>("a") == a);
  CHECK(std::ifstream(path + ".tmp").good() == false);
  std::remove(path.c_str());
}

namespace {

// Allocates and fills blocks of many sizes, so that memory freed earlier is handed out again and
// overwritten: a writer still reading it would see -12345 (without ASan; ASan reports the read).
void overwrite_freed_memory() {
  std::vector<std::vector<float>> blocks;
  for (std::size_t size = 1; size <= 256; ++size) blocks.emplace_back(size, -12345.0f);
}

}  // namespace

// Issue 15, class 1: add() kept values.data(), and for an argument that is not a contiguous
// row-major float / double matrix the Ref is a temporary copy, freed when add() returns.
TEST_CASE("safetensors: the writer keeps every table it is given, whatever its layout", "[safetensors][lifetime]") {
  RowMatrix<float> R(3, 4);
  for (Index i = 0; i < R.size(); ++i) R.data()[i] = static_cast<float>(i + 1);
  const Eigen::MatrixXf column_major = R;  // the same values, column-major storage
  float storage[24];
  for (int i = 0; i < 24; ++i) storage[i] = i % 2 ? -1.0f : static_cast<float>(i / 2 + 1);
  // Row r, column c at storage[8 r + 2 c] = 4 r + c + 1 = R(r, c): an inner stride of 2.
  const Eigen::Map<const RowMatrix<float>, 0, Eigen::Stride<8, 2>> strided(storage, 3, 4);
  RowMatrix<double> later = R.cast<double>();

  const std::string path = temp_path("views.safetensors");
  SafetensorsWriter writer;
  writer.add<float>("column_major", column_major, DType::F32)
      .add<float>("transpose", R.transpose(), DType::F32)
      .add<float>("inner_strided", strided, DType::BF16)
      .add<float>("row_major_column", R.col(1), DType::F16, /*as_vector=*/true)
      .add<double>("expression", R.cast<double>() * 2.0, DType::F64)
      .add<double>("later", later, DType::F64);
  {
    const RowMatrix<float> local = R;  // gone before write()
    writer.add<float>("local", local, DType::F32);
  }
  later.setZero();  // after add(): the file has the values add() was given
  overwrite_freed_memory();
  writer.write(path);

  const auto file = SafetensorsFile::open(path);
  CHECK(file.read<float>("column_major") == R);
  const RowMatrix<float> transposed = R.transpose();
  CHECK(file.read<float>("transpose") == transposed);
  CHECK(file.read<float>("inner_strided") == R);  // small integers: exact in bf16
  CHECK(file.read<float>("row_major_column") == R.col(1));
  CHECK(file.at("row_major_column").shape_string() == "[3]");
  CHECK(file.read<double>("expression") == 2.0 * R.cast<double>());
  CHECK(file.read<double>("later") == R.cast<double>());
  CHECK(file.read<float>("local") == R);
  std::remove(path.c_str());
}

// A finite F64 value that float cannot hold used to be read as an infinity without a word.
TEST_CASE("safetensors: an F64 value beyond float's range is a format_error when read as float; out unchanged",
          "[safetensors][errors]") {
  const double halfway = std::ldexp(1.0, 128) - std::ldexp(1.0, 103);  // rounds to 2^128 (even): inf
  const double below = halfway - std::ldexp(1.0, 80);                  // rounds to float's largest
  const std::vector<double> w = {1, 2, 3, 4, -1e300, 6};
  const std::vector<double> v = {0, halfway, 1};
  const std::vector<double> edge = {below, -below};
  const std::vector<double> special = {std::numeric_limits<double>::infinity(),
                                       std::numeric_limits<double>::quiet_NaN()};
  const std::string header = R"({"w":{"dtype":"F64","shape":[2,3],"data_offsets":[0,48]},)"
                             R"("v":{"dtype":"F64","shape":[3],"data_offsets":[48,72]},)"
                             R"("edge":{"dtype":"F64","shape":[1,2],"data_offsets":[72,88]},)"
                             R"("special":{"dtype":"F64","shape":[2],"data_offsets":[88,104]}})";
  const auto file = parse(file_bytes(header, le_bytes(w) + le_bytes(v) + le_bytes(edge) + le_bytes(special)));

  const std::string expected =
      "safetensors: tensor 'w' in 'test' has the F64 value -1e+300 at (1, 1), outside "
      "float's range [-3.40282e+38, 3.40282e+38]: read as float it would become an "
      "infinity (read it as double)";
  CHECK_THROWS_AS(file.read<float>("w"), format_error);
  CHECK_THROWS_WITH(file.read<float>("w"), expected);
  RowMatrix<float> out = RowMatrix<float>::Constant(2, 3, 7.0f);
  CHECK_THROWS_WITH(file.read<float>(file.at("w"), out), expected);
  CHECK(out == RowMatrix<float>::Constant(2, 3, 7.0f));
  CHECK(file.read<double>("w")(1, 1) == -1e300);  // as double: exact
  CHECK_THROWS_WITH(file.read<float>("v"), Catch::Contains("tensor 'v' in 'test' has the F64 value 3.40282e+38 at "
                                                           "index 1, outside float's range"));
  // Below the halfway point: float's largest value, no error.
  const RowMatrix<float> e = file.read<float>("edge");
  CHECK(e(0, 0) == std::ldexp(1.0f - std::ldexp(1.0f, -24), 128));
  CHECK(e(0, 1) == -std::ldexp(1.0f - std::ldexp(1.0f, -24), 128));
  // NaN and infinities are not an overflow: read as they are (docs/errors.md, Non-finite values).
  const RowMatrix<float> s = file.read<float>("special");
  CHECK(s(0, 0) == std::numeric_limits<float>::infinity());
  CHECK(std::isnan(s(1, 0)));
}

// Issue 15, class 2: read(t, out), first_non_finite(t) and raw(t) trusted a TensorInfo from
// another file and read outside this file's data.
TEST_CASE("safetensors: a TensorInfo of another file is refused, not read out of bounds", "[safetensors][errors]") {
  const auto small = parse(file_bytes(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})",
                                      le_bytes(std::vector<float>{1, 2, 3, 4})));
  const std::string big_header = R"({"w":{"dtype":"F32","shape":[64,64],"data_offsets":[0,16384]}})";
  const auto big = SafetensorsFile::from_bytes(file_bytes(big_header, std::string(16384, '\0')).data(),
                                               8 + big_header.size() + 16384, "big");
  RowMatrix<float> out = RowMatrix<float>::Constant(64, 64, 42.0f);
  REQUIRE_THROWS_AS(small.read<float>(big.at("w"), out), value_error);
  REQUIRE_THROWS_WITH(small.read<float>(big.at("w"), out),
                      Catch::Contains("tensor 'w' F32 [64, 64] at data_offsets [0, 16384]") &&
                          Catch::Contains("is not a tensor of 'test'"));
  CHECK((out.array() == 42.0f).all());
  REQUIRE_THROWS_AS(small.first_non_finite(big.at("w")), value_error);
  REQUIRE_THROWS_AS(small.raw(big.at("w")), value_error);

  // A description changed by hand is refused too, even under a name the file has.
  embedhead::TensorInfo forged = small.at("w");
  forged.begin = 8;
  forged.end = 24;
  RowMatrix<float> four = RowMatrix<float>::Constant(2, 2, 42.0f);
  REQUIRE_THROWS_WITH(small.read<float>(forged, four), Catch::Contains("data_offsets [8, 24]"));
  CHECK((four.array() == 42.0f).all());
  embedhead::TensorInfo unknown = small.at("w");
  unknown.name = "v";
  REQUIRE_THROWS_AS(small.first_non_finite(unknown), value_error);

  // The same description from a file with the same layout is this file's tensor: read from here.
  const auto twin = parse(file_bytes(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})",
                                     le_bytes(std::vector<float>{5, 6, 7, 8})));
  small.read<float>(twin.at("w"), four);
  CHECK(four(1, 1) == 4.0f);
  CHECK(twin.first_non_finite(small.at("w")) == -1);
}

// Issue 15, class 3: open() on a named pipe blocked until a writer came (the regular-file check
// came after a blocking open).
TEST_CASE("safetensors: open refuses a named pipe, a directory or a device without blocking", "[safetensors][errors]") {
  const std::string fifo = temp_path("pipe.safetensors");
  bool blocked = test_support::blocks_on_fifo(fifo, [&] {
    CHECK_THROWS_AS(SafetensorsFile::open(fifo), io_error);
    CHECK_THROWS_WITH(SafetensorsFile::open(fifo),
                      Catch::Contains("'" + fifo + "' is not a regular file") && Catch::Contains("named pipe"));
  });
  CHECK_FALSE(blocked);
  CHECK_THROWS_WITH(SafetensorsFile::open("/tmp"), Catch::Contains("'/tmp' is not a regular file (a directory)"));
  CHECK_THROWS_WITH(SafetensorsFile::open("/dev/null"),
                    Catch::Contains("'/dev/null' is not a regular file (a character device)"));

  // The writer's temporary: a named pipe at path.tmp is refused too, and nothing appears at path.
  const std::string path = temp_path("pipe_target.safetensors");
  RowMatrix<float> a = RowMatrix<float>::Ones(2, 2);
  SafetensorsWriter writer;
  writer.add<float>("a", a, DType::F32);
  blocked = test_support::blocks_on_fifo(
      path + ".tmp",
      [&] {
        CHECK_THROWS_AS(writer.write(path), io_error);
        CHECK_THROWS_WITH(writer.write(path),
                          Catch::Contains("'" + path + ".tmp' exists and is not a regular file (a named pipe)"));
      },
      /*call_writes=*/true);
  CHECK_FALSE(blocked);
  struct stat st {};
  CHECK(::lstat(path.c_str(), &st) != 0);
  std::remove(path.c_str());
}

TEST_CASE("safetensors: a file the process may not read is an io_error naming it and the reason",
          "[safetensors][errors]") {
  const std::string path = test_support::unreadable_path(temp_path("unreadable.safetensors"));
  if (path.empty()) {
    WARN("skipped: no file here refuses reading to this process (neither mode 000 nor a write-only sysctl file)");
    return;
  }
  REQUIRE_THROWS_AS(SafetensorsFile::open(path), io_error);
  REQUIRE_THROWS_WITH(SafetensorsFile::open(path),
                      Catch::Contains("cannot open '" + path + "'") && Catch::Contains(std::strerror(EACCES)));
  ::unlink(temp_path("unreadable.safetensors").c_str());
}

// Issue 15, class 6: F16 stored a finite 1e5 as +inf (BF16: 3.4e38) without an error, while
// convert_table throws for the same value, and the library's own loader refuses the file.
TEST_CASE("safetensors: a finite value that overflows its storage type is a value_error; nothing is written",
          "[safetensors][errors]") {
  const std::string path = temp_path("overflow.safetensors");
  write_bytes(path, "old contents");
  struct Case {
    const char* what;
    double value;
    bool is_double;
    DType dtype;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"float 1e5 as F16", 1e5, false, DType::F16, "value 100000 at (1, 2) overflows F16 (largest finite 65504)"},
      {"float -65520 as F16 (the tie rounds to -inf)", -65520.0, false, DType::F16, "value -65520 at (1, 2)"},
      {"double 65520 as F16", 65520.0, true, DType::F16, "overflows F16"},
      {"float 3.4e38 as BF16", 3.4e38, false, DType::BF16,
       "value 3.4e+38 at (1, 2) overflows BF16 (largest finite 3.38953e+38)"},
      {"double 1e300 as BF16", 1e300, true, DType::BF16, "overflows BF16"},
      {"double 1e300 as F32", 1e300, true, DType::F32,
       "value 1e+300 at (1, 2) overflows F32 (largest finite 3.40282e+38)"},
      {"double -1e39 as F16", -1e39, true, DType::F16, "value -1e+39 at (1, 2) overflows F16"},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    RowMatrix<double> values = RowMatrix<double>::Ones(2, 3);
    values(1, 2) = c.value;
    const RowMatrix<float> float_values = values.cast<float>(), fine = RowMatrix<float>::Ones(2, 2);
    SafetensorsWriter writer;
    writer.add<float>("fine", fine, DType::F16);
    if (c.is_double)
      writer.add<double>("table", values, c.dtype);
    else
      writer.add<float>("table", float_values, c.dtype);
    REQUIRE_THROWS_AS(writer.write(path), value_error);
    REQUIRE_THROWS_WITH(writer.write(path),
                        Catch::Contains("SafetensorsWriter::write: tensor 'table'") && Catch::Contains(c.message));
    CHECK(read_bytes(path) == "old contents");
    CHECK_FALSE(std::ifstream(path + ".tmp").good());
  }

  // The largest values that round to a finite one are written; NaN and infinities are kept as they
  // are (they are not an overflow, as in convert_table).
  RowMatrix<float> edge(1, 5);
  edge << 65519.99f, -65519.99f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(), 1.0f;
  RowMatrix<float> bf16_edge(1, 2);
  bf16_edge << 3.3961e38f, std::numeric_limits<float>::max();
  const RowMatrix<double> edge64 = edge.cast<double>();
  SafetensorsWriter writer;
  writer.add<float>("edge", edge, DType::F16).add<double>("edge64", edge64, DType::F16);
  writer.add<float>("float_max", bf16_edge.leftCols(1), DType::BF16);
  writer.write(path);
  const auto file = SafetensorsFile::open(path);
  const RowMatrix<float> back = file.read<float>("edge");
  CHECK(back(0, 0) == 65504.0f);
  CHECK(back(0, 1) == -65504.0f);
  CHECK(std::isinf(back(0, 2)));
  CHECK(std::isnan(back(0, 3)));
  CHECK(file.read<float>("edge64")(0, 0) == 65504.0f);
  CHECK(file.read<float>("float_max")(0, 0) == static_cast<float>(Eigen::NumTraits<Eigen::bfloat16>::highest()));
  SafetensorsWriter too_large;
  too_large.add<float>("float_max", bf16_edge, DType::BF16);
  REQUIRE_THROWS_WITH(too_large.write(path), Catch::Contains("at (0, 1) overflows BF16"));

  // The same policy as convert_table: at the boundaries and around them, the writer refuses a value
  // exactly when convert_table does, from float and from double.
  const float half_bound = 65520.0f, bf16_bound = std::ldexp(511.0f, 119);
  for (const float x : {half_bound, std::nextafter(half_bound, 0.0f), std::nextafter(half_bound, 1e30f), bf16_bound,
                        std::nextafter(bf16_bound, 0.0f),
                        std::nextafter(bf16_bound, std::numeric_limits<float>::infinity()), 1e5f, 1e38f}) {
    for (const float sign : {1.0f, -1.0f}) {
      const RowMatrix<float> one = RowMatrix<float>::Constant(1, 1, sign * x);
      const RowMatrix<double> one64 = one.cast<double>();
      const auto refused = [&](auto table_convert, DType dtype) {
        bool by_table = false, by_writer = false, by_writer64 = false;
        try {
          table_convert(one);
        } catch (const value_error&) {
          by_table = true;
        }
        try {
          SafetensorsWriter().add<float>("x", one, dtype).write(path);
        } catch (const value_error&) {
          by_writer = true;
        }
        try {
          SafetensorsWriter().add<double>("x", one64, dtype).write(path);
        } catch (const value_error&) {
          by_writer64 = true;
        }
        INFO("x = " << sign * x << " as " << embedhead::dtype_name(dtype));
        CHECK(by_writer == by_table);
        CHECK(by_writer64 == by_table);
      };
      refused([](const RowMatrix<float>& m) { embedhead::convert_table<Eigen::half>(m); }, DType::F16);
      refused([](const RowMatrix<float>& m) { embedhead::convert_table<Eigen::bfloat16>(m); }, DType::BF16);
    }
  }
  std::remove(path.c_str());
}

// Issue 15, class 9: a tensor name or metadata that is not UTF-8 let nlohmann's type_error escape
// write(); it is refused when it is given, and the writer is unchanged.
TEST_CASE("safetensors: names and metadata that are not UTF-8 are refused by add and set_metadata",
          "[safetensors][errors]") {
  RowMatrix<float> a = RowMatrix<float>::Ones(2, 2);
  const std::string bad = "emb\xff\xfe";
  SafetensorsWriter writer;
  writer.add<float>("a", a, DType::F32);
  REQUIRE_THROWS_AS(writer.add<float>(bad, a, DType::F32), value_error);
  REQUIRE_THROWS_WITH(writer.add<float>(bad, a, DType::F32),
                      Catch::Contains("SafetensorsWriter::add: tensor name 'emb\\xff\\xfe'") &&
                          Catch::Contains("is not valid UTF-8 (at byte 3)"));
  CHECK_FALSE(writer.contains(bad));
  REQUIRE_THROWS_AS(writer.set_metadata(bad, "v"), value_error);
  REQUIRE_THROWS_WITH(writer.set_metadata("k", "\xc3"),
                      Catch::Contains("SafetensorsWriter::set_metadata: the value of 'k'") &&
                          Catch::Contains("is not valid UTF-8 (at byte 0)"));
  REQUIRE_THROWS_AS(writer.set_metadata("overlong", "\xc0\xaf"), value_error);       // '/' in two bytes
  REQUIRE_THROWS_AS(writer.set_metadata("surrogate", "\xed\xa0\x80"), value_error);  // U+D800
  writer.set_metadata("ok", "\xc3\xa9\xe4\xb8\xad\xf0\x9f\x98\x80");                 // é 中 😀
  const std::string path = temp_path("utf8.safetensors");
  writer.write(path);
  const auto file = SafetensorsFile::open(path);
  CHECK(file.tensors().size() == 1);
  CHECK(file.metadata().size() == 1);
  CHECK(file.metadata().at("ok") == "\xc3\xa9\xe4\xb8\xad\xf0\x9f\x98\x80");
  std::remove(path.c_str());
}

namespace {

// Runs body() in a child process and returns its wait status: a test of what kills a process.
template <typename Body>
int status_of_child(Body&& body) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    int code = 3;
    try {
      code = body();
    } catch (...) {
      code = 4;
    }
    ::_exit(code);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

}  // namespace

// Issue 15, class 4: a file truncated by another process while it is mapped killed the process with
// SIGBUS on the next read. ReadMode::copy reads and validates a copy, which nothing outside can
// change; ReadMode::map (the default) keeps the mapping and its documented risk.
TEST_CASE("safetensors: ReadMode::copy is immune to the file being truncated or rewritten after open",
          "[safetensors][errors]") {
  const std::string path = temp_path("truncated_later.safetensors");
  const RowMatrix<float> table = RowMatrix<float>::Random(512, 64);  // 128 KiB: many pages
  SafetensorsWriter().add<float>("t", table, DType::F32).write(path);

  // In a child, so that a regression (SIGBUS) fails this test instead of ending the test program.
  const int status = status_of_child([&] {
    const auto file = SafetensorsFile::open(path, embedhead::ReadMode::copy);
    if (::truncate(path.c_str(), 16) != 0) return 5;
    test_support::write_bytes(path, "rewritten");
    return file.read<float>("t") == table && file.first_non_finite(file.at("t")) == -1 ? 0 : 6;
  });
  const int signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
  CHECK(signal == 0);  // (7, SIGBUS, when the copy was a mapping)
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  // (A file that shrinks while open() copies it is an io_error: detail::InputFile::read_at, tested
  // in tests/io/npy_test.cpp.)
  std::remove(path.c_str());
}

TEST_CASE("safetensors: ReadMode::map, the default, ends the process with SIGBUS when the mapped file is truncated",
          "[safetensors]") {
  // What the documentation of ReadMode::map says happens, shown in a child process.
  const std::string path = temp_path("truncated_mapped.safetensors");
  const RowMatrix<float> table = RowMatrix<float>::Random(512, 64);
  SafetensorsWriter().add<float>("t", table, DType::F32).write(path);
  const int status = status_of_child([&] {
    std::signal(SIGBUS, SIG_DFL);  // the default action, also under a sanitizer's handler
    const auto file = SafetensorsFile::open(path);
    if (::truncate(path.c_str(), 16) != 0) return 5;
    const RowMatrix<float> back = file.read<float>("t");
    return back.size() > 0 ? 0 : 6;  // not reached
  });
  CHECK(WIFSIGNALED(status));
  if (WIFSIGNALED(status)) CHECK(WTERMSIG(status) == SIGBUS);
  std::remove(path.c_str());
}
