// embedhead: numpy .npy files, for exporting tables and activations to Python and back.
//
//   file   = "\x93NUMPY" | major, minor (1, 0) | u16 LE header length H | header: H bytes | data
//   header = "{'descr': '<f4', 'fortran_order': False, 'shape': (rows, cols), }" + spaces + '\n',
//            padded so that 10 + H is a multiple of 64 (numpy's own alignment since 1.x)
//   data   = rows * cols little-endian values in C (row-major) order
//
// save_npy writes exactly the bytes numpy.save writes for a C-ordered float32 / float64 array of
// shape (rows, cols) (checked against numpy by tests/python/safetensors_fixture.py). load_npy
// reads what numpy.save writes for 1-D and 2-D '<f4' / '<f8' arrays (format versions 1.0, 2.0 and
// 3.0; a 1-D array of n values becomes [n, 1]) and refuses everything else with a format_error
// naming the file and the field: another dtype or byte order, Fortran order, 0-D or 3-D and more,
// a bad magic string, a header longer than numpy.load's default limit (10,000 bytes), a data
// section that is truncated or has trailing bytes, and, read as float, a finite '<f8' value beyond
// float's range (it would become an infinity; NaN and +-inf are read as they are). Only a regular file is opened: a
// directory, a named pipe or a device is an io_error before any open (a pipe would block it), and a file that shrinks
// while it is read is an io_error, never a crash (detail/files.hpp). load_npy_from_bytes reads the same format from
// memory.
//
// Core-only: needs nothing beyond the standard library and Eigen (no JSON parser; the header is a
// Python dict literal with three known keys, parsed here); POSIX file calls where the system has
// them, standard C++ streams elsewhere.
#ifndef EMBEDHEAD_IO_NPY_HPP
#define EMBEDHEAD_IO_NPY_HPP

#include "../detail/files.hpp"
#include "../errors.hpp"
#include "../types.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "embedhead/npy.hpp: writes and reads little-endian data; big-endian hosts are not supported"
#endif

namespace embedhead {

namespace detail {

// numpy.load's default max_header_size (numpy >= 1.24): longer headers are refused unread.
inline constexpr std::size_t kNpyMaxHeaderBytes = 10000;

// The parsed header of an .npy file.
struct NpyHeader {
  std::string descr;
  bool fortran_order = false;
  std::vector<std::uint64_t> shape;
  std::size_t data_offset = 0;  // bytes before the data: magic, version, length, header
};

// A recursive-descent parser for the header's dict literal, e.g.
//   {'descr': '<f4', 'fortran_order': False, 'shape': (3, 5), }
// Accepts what numpy's ast.literal_eval would for these three keys (either quote, optional
// trailing commas, whitespace anywhere) and nothing else.
class NpyHeaderParser {
 public:
  NpyHeaderParser(const std::string& text, const std::string& path) : text_(text), path_(path) {}

  NpyHeader parse() {
    NpyHeader header;
    bool seen_descr = false, seen_order = false, seen_shape = false;
    expect('{');
    while (true) {
      skip_space();
      if (peek() == '}') break;
      const std::string key = string_literal();
      expect(':');
      if (key == "descr" && !seen_descr) {
        header.descr = string_literal();
        seen_descr = true;
      } else if (key == "fortran_order" && !seen_order) {
        header.fortran_order = boolean();
        seen_order = true;
      } else if (key == "shape" && !seen_shape) {
        header.shape = tuple();
        seen_shape = true;
      } else {
        fail("unexpected or repeated key '" + key + "' (expected descr, fortran_order, shape once each)");
      }
      skip_space();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      skip_space();
      if (peek() != '}') fail("expected ',' or '}' at byte " + std::to_string(pos_) + " of the header");
    }
    expect('}');
    skip_space();
    if (pos_ != text_.size()) fail("unexpected text after the header's closing '}' at byte " + std::to_string(pos_));
    if (!seen_descr || !seen_order || !seen_shape) fail("the header lacks one of descr, fortran_order, shape");
    return header;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw format_error("load_npy: '" + path_ + "' has a malformed header: " + what);
  }
  char peek() const { return pos_ < text_.size() ? text_[pos_] : '\0'; }
  void skip_space() {
    while (pos_ < text_.size() &&
           (text_[pos_] == ' ' || text_[pos_] == '\t' || text_[pos_] == '\n' || text_[pos_] == '\r'))
      ++pos_;
  }
  void expect(char c) {
    skip_space();
    if (peek() != c) fail(std::string("expected '") + c + "' at byte " + std::to_string(pos_) + " of the header");
    ++pos_;
  }
  std::string string_literal() {
    skip_space();
    const char quote = peek();
    if (quote != '\'' && quote != '"')
      fail("expected a quoted string at byte " + std::to_string(pos_) + " of the header");
    const std::size_t end = text_.find(quote, pos_ + 1);
    if (end == std::string::npos) fail("unterminated string at byte " + std::to_string(pos_) + " of the header");
    std::string value = text_.substr(pos_ + 1, end - pos_ - 1);
    if (value.find('\\') != std::string::npos) fail("escape sequences are not supported in '" + value + "'");
    pos_ = end + 1;
    return value;
  }
  bool boolean() {
    skip_space();
    if (text_.compare(pos_, 4, "True") == 0) {
      pos_ += 4;
      return true;
    }
    if (text_.compare(pos_, 5, "False") == 0) {
      pos_ += 5;
      return false;
    }
    fail("fortran_order is not True or False at byte " + std::to_string(pos_));
  }
  std::vector<std::uint64_t> tuple() {
    std::vector<std::uint64_t> values;
    expect('(');
    while (true) {
      skip_space();
      if (peek() == ')') break;
      if (peek() < '0' || peek() > '9')
        fail("a shape entry at byte " + std::to_string(pos_) + " is not a non-negative integer");
      std::uint64_t value = 0;
      while (peek() >= '0' && peek() <= '9') {
        const auto digit = static_cast<std::uint64_t>(peek() - '0');
        if (value > (std::numeric_limits<std::uint64_t>::max() - digit) / 10) fail("a shape entry overflows 64 bits");
        value = value * 10 + digit;
        ++pos_;
      }
      values.push_back(value);
      skip_space();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      skip_space();
      if (peek() != ')') fail("expected ',' or ')' in the shape at byte " + std::to_string(pos_));
    }
    expect(')');
    return values;
  }

  const std::string& text_;
  const std::string& path_;
  std::size_t pos_ = 0;
};

inline std::string npy_shape_string(const std::vector<std::uint64_t>& shape) {
  std::ostringstream out;
  out << '(';
  for (std::size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  if (shape.size() == 1) out << ',';
  out << ')';
  return out.str();
}

// The bytes of a file that can hold its preamble and header: the version 2/3 preamble of 12
// bytes and the longest header read.
inline constexpr std::size_t kNpyHeadBytes = 12 + kNpyMaxHeaderBytes;

// Where the values of an .npy file are and how to read them.
struct NpyLayout {
  NpyHeader header;
  Index rows = 0, cols = 0;
  std::uint64_t item_bytes = 0;  // 4 ('<f4') or 8 ('<f8')
  std::uint64_t data_bytes = 0;  // rows * cols * item_bytes, from header.data_offset to the end
};

// Checks the magic, version and header of a file of `file_bytes` bytes and that the data section
// holds exactly rows * cols values. \pre head holds the file's first min(file_bytes,
// kNpyHeadBytes) bytes, which contain any header it accepts (at most 10,000 bytes after a preamble
// of at most 12). \throws format_error naming `path` and the field.
inline NpyLayout parse_npy_layout(const unsigned char* head, std::uint64_t file_bytes, const std::string& path) {
  const auto fail = [&](const std::string& what) -> void { throw format_error("load_npy: '" + path + "' " + what); };
  if (file_bytes < 10) fail("has " + std::to_string(file_bytes) + " bytes, fewer than the 10 of the .npy preamble");
  if (std::memcmp(head, "\x93NUMPY", 6) != 0) fail("does not begin with the .npy magic string \"\\x93NUMPY\"");
  const int major = head[6], minor = head[7];
  std::uint64_t header_bytes = 0;
  std::uint64_t preamble = 10;
  if (major == 1 && minor == 0) {
    header_bytes = head[8] | (static_cast<std::uint64_t>(head[9]) << 8);
  } else if ((major == 2 || major == 3) && minor == 0) {
    preamble = 12;
    if (file_bytes < 12)
      fail("has " + std::to_string(file_bytes) + " bytes, fewer than the 12 of a version 2/3 preamble");
    for (int i = 11; i >= 8; --i) header_bytes = (header_bytes << 8) | head[i];
  } else {
    fail("has format version " + std::to_string(major) + "." + std::to_string(minor) + "; 1.0, 2.0 and 3.0 are read");
  }
  if (header_bytes > kNpyMaxHeaderBytes)
    fail("has a header of " + std::to_string(header_bytes) + " bytes, more than numpy.load's limit of " +
         std::to_string(kNpyMaxHeaderBytes));
  if (header_bytes > file_bytes - preamble)
    fail("is truncated: its header of " + std::to_string(header_bytes) + " bytes runs past the end of the file (" +
         std::to_string(file_bytes) + " bytes)");
  // preamble + header_bytes <= min(file_bytes, kNpyHeadBytes): the header is in head.
  const std::string text(reinterpret_cast<const char*>(head) + preamble, static_cast<std::size_t>(header_bytes));

  NpyLayout layout;
  NpyHeader& header = layout.header;
  header = NpyHeaderParser(text, path).parse();
  header.data_offset = static_cast<std::size_t>(preamble + header_bytes);
  if (header.descr == "<f4")
    layout.item_bytes = 4;
  else if (header.descr == "<f8")
    layout.item_bytes = 8;
  else
    fail("has dtype '" + header.descr + "'; only '<f4' (float32) and '<f8' (float64) are read");
  if (header.fortran_order) fail("is in Fortran order; save a C-ordered array (numpy.ascontiguousarray)");
  if (header.shape.size() != 1 && header.shape.size() != 2)
    fail("has shape " + npy_shape_string(header.shape) + "; only 1-D (read as [n, 1]) and 2-D arrays are read");
  const std::uint64_t r = header.shape[0], c = header.shape.size() == 2 ? header.shape[1] : 1;
  constexpr auto max_index = static_cast<std::uint64_t>(std::numeric_limits<Index>::max());
  if (r > max_index || c > max_index || (c != 0 && r > max_index / c) || (r * c > max_index / layout.item_bytes))
    fail("has shape " + npy_shape_string(header.shape) + ", too large to address");
  layout.data_bytes = r * c * layout.item_bytes;
  const std::uint64_t data_bytes = file_bytes - header.data_offset;
  if (data_bytes != layout.data_bytes) {
    std::ostringstream message;
    message << "has shape " << npy_shape_string(header.shape) << " of " << header.descr << " = " << layout.data_bytes
            << " bytes of data, but " << data_bytes << " bytes follow the header"
            << (data_bytes < layout.data_bytes ? " (truncated)" : " (trailing bytes)");
    fail(message.str());
  }
  layout.rows = static_cast<Index>(r);
  layout.cols = static_cast<Index>(c);
  return layout;
}

// The values of `layout` from `data` (its data section, read whole) into out [rows, cols].
// \throws format_error naming `path` (the file or label), the value, its position and float's
// range for a finite '<f8' value that would become an infinity as a float (Scalar float), before
// anything is written.
template <typename Scalar>
void convert_npy_data(const unsigned char* data, const NpyLayout& layout, const std::string& path,
                      MatrixRef<Scalar> out) {
  if (std::is_same_v<Scalar, float> && layout.item_bytes == 8) {
    const std::uint64_t n = static_cast<std::uint64_t>(layout.rows) * static_cast<std::uint64_t>(layout.cols);
    for (std::uint64_t i = 0; i < n; ++i) {
      double value;
      std::memcpy(&value, data + 8 * i, 8);
      if (!std::isfinite(value) || std::isfinite(static_cast<float>(value))) continue;
      std::ostringstream message;
      message << "load_npy: '" << path << "' has the '<f8' value " << value << " at ";
      if (layout.header.shape.size() == 2)
        message << "(" << i / static_cast<std::uint64_t>(layout.cols) << ", "
                << i % static_cast<std::uint64_t>(layout.cols) << ")";
      else
        message << "index " << i;
      message << ", outside float's range [" << -std::numeric_limits<float>::max() << ", "
              << std::numeric_limits<float>::max()
              << "]: read as float it would become an infinity (load it as double)";
      throw format_error(message.str());
    }
  }
  for (Index r = 0; r < layout.rows; ++r)
    for (Index c = 0; c < layout.cols; ++c) {
      const std::size_t i = static_cast<std::size_t>(r * layout.cols + c);
      if (layout.item_bytes == 4) {
        float value;
        std::memcpy(&value, data + 4 * i, 4);
        out(r, c) = static_cast<Scalar>(value);
      } else {
        double value;
        std::memcpy(&value, data + 8 * i, 8);
        out(r, c) = static_cast<Scalar>(value);  // to float: round to nearest-even
      }
    }
}

// An .npy file opened and its layout read (a regular file only: see detail/files.hpp).
struct NpyFile {
  InputFile file;
  NpyLayout layout;

  explicit NpyFile(const std::string& path) : file(path, "load_npy"), layout(read_layout(file, path)) {}

  // The data section, read whole: an I/O failure half-way leaves any destination untouched.
  std::vector<unsigned char> data() const {
    std::vector<unsigned char> bytes(static_cast<std::size_t>(layout.data_bytes));
    file.read_at(layout.header.data_offset, bytes.data(), bytes.size());
    return bytes;
  }

 private:
  static NpyLayout read_layout(const InputFile& file, const std::string& path) {
    std::vector<unsigned char> head(static_cast<std::size_t>(std::min<std::uint64_t>(file.size(), kNpyHeadBytes)));
    file.read_at(0, head.data(), head.size());
    return parse_npy_layout(head.data(), file.size(), path);
  }
};

template <typename Scalar>
void save_npy(const std::string& path, const ConstMatrixRef<Scalar>& values) {
  std::string header = std::string("{'descr': '") + (std::is_same_v<Scalar, float> ? "<f4" : "<f8") +
                       "', 'fortran_order': False, 'shape': (" + std::to_string(values.rows()) + ", " +
                       std::to_string(values.cols()) + "), }";
  // numpy pads with spaces and ends with '\n' so that the data starts at a multiple of 64.
  const std::size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header.push_back('\n');

  write_file_atomically(path, "save_npy", [&](OutputFile& out) {
    const unsigned char preamble[10] = {0x93,
                                        'N',
                                        'U',
                                        'M',
                                        'P',
                                        'Y',
                                        1,
                                        0,
                                        static_cast<unsigned char>(header.size() & 0xff),
                                        static_cast<unsigned char>(header.size() >> 8)};
    out.write(preamble, 10);
    out.write(header.data(), header.size());
    for (Index r = 0; r < values.rows(); ++r)
      out.write(values.row(r).data(), static_cast<std::size_t>(values.cols()) * sizeof(Scalar));
  });
}
}  // namespace detail

// values [rows, cols] -> an .npy file at `path` (descr '<f4' for float, '<f8' for double, C
// order, shape (rows, cols)), byte for byte what numpy.save writes. Written to `path`.tmp, then
// renamed over `path`, so a failure never leaves a half-written file under the final name.
// \throws io_error naming the path (nothing at `path` changes then). Cost: one pass over values.
inline void save_npy(const std::string& path, const ConstMatrixRef<float>& values) {
  detail::save_npy<float>(path, values);
}
inline void save_npy(const std::string& path, const ConstMatrixRef<double>& values) {
  detail::save_npy<double>(path, values);
}

// An .npy file -> a new [rows, cols] matrix (1-D arrays of n values as [n, 1]); '<f8' read as
// float rounds to nearest-even, '<f4' as double is exact. NaN and +-inf are read as they are.
// \throws io_error naming the path and the reason if it cannot be opened or read, or is not a
// regular file (a directory, a named pipe, a device: refused before it is opened, so a pipe never
// blocks); format_error (naming the file and the field) for anything but a 1-D or 2-D, C-ordered
// '<f4' / '<f8' array with exactly its data, and (naming the file, the value, its position and
// float's range) for a finite '<f8' value read as float that would become an infinity, e.g.
//   load_npy: 'x.npy' has the '<f8' value 1e+300 at (1, 2), outside float's range
//   [-3.40282e+38, 3.40282e+38]: read as float it would become an infinity (load it as double)
// Cost: one read of the file (and, '<f8' as float, a range check before the conversion).
template <typename Scalar>
RowMatrix<Scalar> load_npy(const std::string& path) {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");
  const detail::NpyFile npy(path);
  const std::vector<unsigned char> data = npy.data();
  RowMatrix<Scalar> out(npy.layout.rows, npy.layout.cols);
  detail::convert_npy_data<Scalar>(data.data(), npy.layout, path, out);
  return out;
}

// The bytes of an .npy file held in memory (`size` of them at `data`; `label` names it in the
// messages) -> a new [rows, cols] matrix, as load_npy. For tests, fuzzing, and files that do not
// come from a path (an archive member). \throws format_error as load_npy. Cost: one pass.
template <typename Scalar>
RowMatrix<Scalar> load_npy_from_bytes(const void* data, std::size_t size, const std::string& label = "<memory>") {
  static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");
  const auto* bytes = static_cast<const unsigned char*>(data);
  const detail::NpyLayout layout = detail::parse_npy_layout(bytes, size, label);
  RowMatrix<Scalar> out(layout.rows, layout.cols);
  detail::convert_npy_data<Scalar>(bytes + layout.header.data_offset, layout, label, out);
  return out;
}

namespace detail {
template <typename Scalar>
void load_npy_into(const std::string& path, MatrixRef<Scalar> out) {
  const NpyFile npy(path);
  if (npy.layout.rows != out.rows() || npy.layout.cols != out.cols()) {
    std::ostringstream message;
    message << "load_npy: '" << path << "' holds [" << npy.layout.rows << ", " << npy.layout.cols << "] (shape "
            << npy_shape_string(npy.layout.header.shape) << ") but the destination is [" << out.rows() << ", "
            << out.cols() << "]";
    throw shape_error(message.str());
  }
  const std::vector<unsigned char> data = npy.data();
  convert_npy_data<Scalar>(data.data(), npy.layout, path, out);
}
}  // namespace detail

// An .npy file -> out, which must already have the file's [rows, cols] (1-D: [n, 1]).
// \throws as load_npy, and shape_error naming both shapes; `out` is unchanged on any throw.
inline void load_npy(const std::string& path, MatrixRef<float> out) { detail::load_npy_into<float>(path, out); }
inline void load_npy(const std::string& path, MatrixRef<double> out) { detail::load_npy_into<double>(path, out); }

}  // namespace embedhead

#endif  // EMBEDHEAD_IO_NPY_HPP
