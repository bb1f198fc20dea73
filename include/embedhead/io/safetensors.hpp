// embedhead: safetensors files, the format Hugging Face models ship, read and written.
//
//   file  = u64 N (little-endian) | header: N bytes of JSON | data: raw little-endian tensors
//   header = { "<name>": {"dtype": "F32", "shape": [V, d], "data_offsets": [begin, end]}, ...,
//              "__metadata__": {"<key>": "<string>", ...} }          (offsets relative to data)
//
// Reading maps the file (mmap; or copies it into memory, ReadMode::copy, which nothing another
// process does can fault) and validates the whole header before anything is returned, so a bad
// file is rejected before any model sees it; tensors are then converted straight from the
// mapping into the destination (one copy of a 2 GB table, not two). Only a regular file is
// opened (a named pipe would block the open), and a TensorInfo is read only by the file it
// describes. The checks are those of the format's reference implementation
// (huggingface/safetensors, lib.rs): the header fits in the file and is at most 100 MB, is a
// JSON object beginning with '{', every tensor has a known dtype, a shape of non-negative
// integers and offsets whose length is numel * dtype size, and the tensors tile the data section
// exactly: no gap, no overlap, nothing after the last one. We also reject duplicate names,
// unknown fields, nesting deeper than the format allows and sizes that overflow 64 bits.
//
// Conversion to the layer's Scalar: F32, F64, F16 and BF16 (every F16/BF16/F32 value is exact in
// float and double; F64 -> float rounds to nearest-even, as a C++ cast does, and a finite F64
// value beyond float's range, which would become an infinity, is a format_error naming the tensor,
// the value and its position; NaN and +-inf are read as they are). Writing float or
// double to F16/BF16 rounds to nearest-even (Eigen::half / Eigen::bfloat16); a finite value that
// would round to +-inf there (or in F32, from double) is refused, as convert_table refuses it. The
// writer owns or shares everything it writes (a copy, or a Parameter's shared_ptr). The other
// dtypes of the format (integers, bool, F8) are read and validated but not converted: reading one
// as a table throws, naming the tensor and its dtype.
//
// Needs nlohmann/json (Debian: nlohmann-json3-dev), and POSIX mmap for ReadMode::map where
// detail/files.hpp uses POSIX calls (elsewhere, or with EMBEDHEAD_PORTABLE_FILES defined,
// ReadMode::map reads the file into memory as ReadMode::copy does); not part of the umbrella
// header so that the core layers keep no dependency beyond Eigen. CMake target:
// embedhead::safetensors.
#ifndef EMBEDHEAD_IO_SAFETENSORS_HPP
#define EMBEDHEAD_IO_SAFETENSORS_HPP

#include "../detail/files.hpp"
#include "../errors.hpp"
#include "../parameter.hpp"
#include "../types.hpp"

#include <nlohmann/json.hpp>

#if EMBEDHEAD_DETAIL_POSIX_FILES
#include <sys/mman.h>
#endif

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "embedhead/safetensors.hpp: safetensors data is little-endian; big-endian hosts are not supported"
#endif

namespace embedhead {

// The dtypes of the safetensors format.
enum class DType { BOOL, U8, I8, F8_E5M2, F8_E4M3, I16, U16, F16, BF16, I32, U32, F32, I64, U64, F64 };

namespace detail {

struct DTypeInfo {
  DType dtype;
  const char* name;
  std::uint64_t bytes;
};
inline constexpr DTypeInfo kDTypes[] = {
    {DType::BOOL, "BOOL", 1},       {DType::U8, "U8", 1},   {DType::I8, "I8", 1},   {DType::F8_E5M2, "F8_E5M2", 1},
    {DType::F8_E4M3, "F8_E4M3", 1}, {DType::I16, "I16", 2}, {DType::U16, "U16", 2}, {DType::F16, "F16", 2},
    {DType::BF16, "BF16", 2},       {DType::I32, "I32", 4}, {DType::U32, "U32", 4}, {DType::F32, "F32", 4},
    {DType::I64, "I64", 8},         {DType::U64, "U64", 8}, {DType::F64, "F64", 8},
};

// The reference implementation's limit on the header size.
inline constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;

inline const DTypeInfo& dtype_info(DType dtype) {
  for (const auto& info : kDTypes)
    if (info.dtype == dtype) return info;
  throw value_error("safetensors: unknown DType enumerator");  // unreachable with a valid enum
}

// The value at index i of little-endian data at p (not aligned in general).
template <typename T>
T load_le(const unsigned char* p, std::uint64_t i) {
  T value;
  std::memcpy(&value, p + i * sizeof(T), sizeof(T));
  return value;
}

// out[r, c] = Scalar(widen(source element r * cols + c)), row by row (out may be strided).
template <typename Source, typename Scalar, typename Widen>
void convert_rows(const unsigned char* p, MatrixRef<Scalar>& out, Widen widen) {
  const Index cols = out.cols();
  for (Index r = 0; r < out.rows(); ++r) {
    Scalar* dst = out.row(r).data();
    const unsigned char* src = p + static_cast<std::size_t>(r) * static_cast<std::size_t>(cols) * sizeof(Source);
    for (Index c = 0; c < cols; ++c)
      dst[c] = static_cast<Scalar>(widen(load_le<Source>(src, static_cast<std::uint64_t>(c))));
  }
}

// The first of the n F64 values at p that is finite but becomes an infinity as a float (|x| at or
// beyond float's largest value plus half an ulp, 2^128 - 2^103), or -1. NaN and +-inf are not
// counted: they stay what they are. Blocks are scanned branch-free; only a block with a hit is
// searched again for its position.
inline std::int64_t first_beyond_float(const unsigned char* p, std::uint64_t n) {
  const auto beyond = [](double x) { return std::isfinite(x) && !std::isfinite(static_cast<float>(x)); };
  constexpr std::uint64_t kBlock = 4096;
  for (std::uint64_t begin = 0; begin < n; begin += kBlock) {
    const std::uint64_t end = std::min(n, begin + kBlock);
    bool any = false;
    for (std::uint64_t i = begin; i < end; ++i) any |= beyond(load_le<double>(p, i));
    if (any)
      for (std::uint64_t i = begin; i < end; ++i)
        if (beyond(load_le<double>(p, i))) return static_cast<std::int64_t>(i);
  }
  return -1;
}

// out.size() values of `dtype` (F32, F64, F16 or BF16), stored row-major from p on, into out.
// \pre out is not empty (the rows of an empty matrix may have a null data(), which memcpy must
// not be given, even for 0 bytes) and p holds out.size() values.
template <typename Scalar>
void convert_stored_values(const unsigned char* p, DType dtype, MatrixRef<Scalar> out) {
  switch (dtype) {
    case DType::F32:
      if constexpr (std::is_same_v<Scalar, float>) {
        const auto row_bytes = static_cast<std::size_t>(out.cols()) * sizeof(float);
        for (Index r = 0; r < out.rows(); ++r)
          std::memcpy(out.row(r).data(), p + static_cast<std::size_t>(r) * row_bytes, row_bytes);
      } else {
        convert_rows<float>(p, out, [](float x) { return x; });
      }
      break;
    case DType::F64: convert_rows<double>(p, out, [](double x) { return x; }); break;
    case DType::F16:
      convert_rows<std::uint16_t>(p, out, [](std::uint16_t x) {
        return static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(x));
      });
      break;
    case DType::BF16:
      // bfloat16 is the top half of a float: a shift, which vectorises.
      convert_rows<std::uint16_t>(p, out, [](std::uint16_t x) {
        return Eigen::numext::bit_cast<float>(static_cast<std::uint32_t>(x) << 16);
      });
      break;
    default: break;  // the callers check is_convertible first
  }
}

// The byte at which `s` stops being valid UTF-8 (RFC 3629: no overlong forms, no surrogates,
// nothing above U+10FFFF, no truncated sequence), or std::string::npos if it is valid.
inline std::size_t invalid_utf8_at(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const std::size_t n = s.size();
  std::size_t i = 0;
  while (i < n) {
    const unsigned c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    std::size_t length = 0;
    unsigned lo = 0x80, hi = 0xBF;  // the range of the second byte
    if (c >= 0xC2 && c <= 0xDF) {
      length = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      length = 3;
      if (c == 0xE0) lo = 0xA0;  // overlong
      if (c == 0xED) hi = 0x9F;  // surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      length = 4;
      if (c == 0xF0) lo = 0x90;  // overlong
      if (c == 0xF4) hi = 0x8F;  // above U+10FFFF
    } else {
      return i;
    }
    if (n - i < length || p[i + 1] < lo || p[i + 1] > hi) return i;
    for (std::size_t k = 2; k < length; ++k)
      if (p[i + k] < 0x80 || p[i + k] > 0xBF) return i;
    i += length;
  }
  return std::string::npos;
}

// `s` for a message: bytes outside printable ASCII (and backslashes) written as \xHH.
inline std::string escaped(const std::string& s) {
  static const char digits[] = "0123456789abcdef";
  std::string out;
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c >= 0x20 && c < 0x7F && c != '\\') {
      out.push_back(ch);
    } else {
      out += "\\x";
      out.push_back(digits[c >> 4]);
      out.push_back(digits[c & 15]);
    }
  }
  return out;
}

// A safetensors header is JSON, which is UTF-8. \throws value_error "<what> '<s>' is not valid
// UTF-8 (at byte i)" unless s is.
inline void check_utf8(const std::string& s, const std::string& what) {
  const std::size_t at = invalid_utf8_at(s);
  if (at != std::string::npos)
    throw value_error(what + " '" + escaped(s) + "' is not valid UTF-8 (at byte " + std::to_string(at) +
                      "); a safetensors header is JSON, which is UTF-8");
}

}  // namespace detail

inline const char* dtype_name(DType dtype) { return detail::dtype_info(dtype).name; }
inline std::uint64_t dtype_bytes(DType dtype) { return detail::dtype_info(dtype).bytes; }
// True for the dtypes a table can be read from and written to: F32, F64, F16, BF16.
inline bool is_convertible(DType dtype) {
  return dtype == DType::F32 || dtype == DType::F64 || dtype == DType::F16 || dtype == DType::BF16;
}

// One tensor of a file: its name, dtype, shape and byte range inside the data section.
struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<std::uint64_t> shape;  // empty for a scalar
  std::uint64_t begin = 0, end = 0;  // data_offsets, relative to the start of the data section

  std::uint64_t numel() const {
    std::uint64_t n = 1;
    for (auto s : shape) n *= s;  // cannot overflow: checked when the header was read
    return n;
  }
  // "[50257, 768]"
  std::string shape_string() const {
    std::ostringstream out;
    out << '[';
    for (std::size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
    out << ']';
    return out.str();
  }
};

// How SafetensorsFile::open reads a file.
//   map   (the default) maps it read-only (mmap, MAP_PRIVATE): pages are read when they are used,
//         and tensors are converted straight from the page cache into their destination, with no
//         memory beyond it. The mapping is not a snapshot: if another process writes the file in
//         place, later reads see the new bytes (the header was validated once, at open), and if it
//         truncates the file, the next access to a page past the new end raises SIGBUS, which
//         ends the process unless it handles that signal. A writer that renames a new file over
//         the old one, as this library's and the reference implementation's do, never does either.
//   copy  reads the whole file into memory the SafetensorsFile owns, then validates that copy: it
//         costs the file's size in memory and one read, and nothing another process does to the
//         file afterwards can change what is read or fault the process (a file truncated while it
//         is being read is an io_error).
// Without POSIX file calls (a system that has none, or EMBEDHEAD_PORTABLE_FILES defined: see
// detail/files.hpp) there is no mapping: map reads the file into memory, as copy does.
enum class ReadMode { map, copy };

// A validated, read-only safetensors file. Opening reads and checks the header only; tensor data
// is read (through the mapping, or from the copy) when a tensor is converted. Move-only; cheap to
// move.
class SafetensorsFile {
 public:
  // Opens the file at `path` (mapped, or read into memory: see ReadMode) and validates it.
  // \throws io_error naming the path and the reason if it cannot be opened, mapped or read, or is
  // not a regular file (a directory, a named pipe, a device: refused before it is opened, so a
  // pipe never blocks); format_error (naming the path, the tensor and the rule broken) if it is
  // not a valid safetensors file. Cost: O(header) plus the mapping, or one read of the file.
  static SafetensorsFile open(const std::string& path, ReadMode mode = ReadMode::map) {
    const detail::InputFile file(path, "safetensors");
    if constexpr (sizeof(std::size_t) < sizeof(std::uint64_t))
      if (file.size() > std::numeric_limits<std::size_t>::max())
        throw io_error("safetensors: '" + path + "' is too large to address");
    const auto size = static_cast<std::size_t>(file.size());
    std::shared_ptr<const unsigned char> bytes;
#if EMBEDHEAD_DETAIL_POSIX_FILES
    if (size > 0 && mode == ReadMode::map) {
      void* mapped = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, file.descriptor(), 0);
      if (mapped == MAP_FAILED) throw io_error("safetensors: cannot map '" + path + "': " + std::strerror(errno));
      bytes = std::shared_ptr<const unsigned char>(static_cast<const unsigned char*>(mapped),
                                                   [size](const unsigned char* p) {
                                                     ::munmap(const_cast<unsigned char*>(p), size);
                                                   });
    } else if (size > 0) {
#else
    (void)mode;  // no mapping without POSIX file calls: both modes read the file into memory
    if (size > 0) {
#endif
      std::shared_ptr<unsigned char> copy = owned_bytes(size);
      file.read_at(0, copy.get(), size);
      bytes = std::move(copy);
    }
    return SafetensorsFile(std::move(bytes), size, path);
  }

  // Validates a file held in memory (a copy is kept). For tests and fuzzing. \throws format_error.
  static SafetensorsFile from_bytes(const void* data, std::size_t size, const std::string& label = "<memory>") {
    std::shared_ptr<unsigned char> copy = owned_bytes(size);
    if (size > 0) std::memcpy(copy.get(), data, size);
    return SafetensorsFile(std::shared_ptr<const unsigned char>(copy), size, label);
  }

  const std::string& path() const { return path_; }
  // The tensors in the order of their data (by begin offset).
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  // The optional "__metadata__" string map.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool contains(const std::string& name) const { return find(name) != nullptr; }
  // The tensor called `name`, or nullptr.
  const TensorInfo* find(const std::string& name) const {
    const auto it = by_name_.find(name);
    return it == by_name_.end() ? nullptr : &tensors_[it->second];
  }
  // The tensor called `name`. \throws format_error naming the file and listing a few names it has.
  const TensorInfo& at(const std::string& name) const {
    if (const TensorInfo* t = find(name)) return *t;
    std::ostringstream message;
    message << "safetensors: '" << path_ << "' has no tensor '" << name << "' (it has " << tensors_.size() << ": ";
    for (std::size_t i = 0; i < tensors_.size() && i < 8; ++i)
      message << (i ? ", " : "") << "'" << tensors_[i].name << "'";
    if (tensors_.size() > 8) message << ", ...";
    message << ")";
    throw format_error(message.str());
  }
  // The raw little-endian bytes of tensor t (end - begin of them; not aligned in general).
  // \throws value_error if t is not one of this file's tensors (see read).
  const unsigned char* raw(const TensorInfo& t) const {
    check_own(t, "raw");
    return data_ + t.begin;
  }

  // Checks that `name` can be read as a [rows, cols] table: convertible dtype and a shape of
  // [rows, cols], or [rows] when cols == 1 (a bias). \throws format_error (missing, dtype) or
  // shape_error (shape), each naming the tensor, the file and `what` (the layer asking).
  const TensorInfo& expect(const std::string& name, Index rows, Index cols, const std::string& what) const {
    const TensorInfo& t = at(name);
    if (!is_convertible(t.dtype)) {
      throw format_error("safetensors: tensor '" + name + "' in '" + path_ + "' has dtype " + dtype_name(t.dtype) +
                         "; " + what + " needs F32, F64, F16 or BF16");
    }
    const bool matrix = t.shape.size() == 2 && t.shape[0] == static_cast<std::uint64_t>(rows) &&
                        t.shape[1] == static_cast<std::uint64_t>(cols);
    const bool vector = cols == 1 && t.shape.size() == 1 && t.shape[0] == static_cast<std::uint64_t>(rows);
    if (!matrix && !vector) {
      std::ostringstream message;
      message << "safetensors: tensor '" << name << "' in '" << path_ << "' is " << t.shape_string() << " but " << what
              << " is [" << rows << ", " << cols << "]";
      throw shape_error(message.str());
    }
    return t;
  }

  // The first non-finite value (NaN or +-inf) of tensor t as a flat index, or -1 if all are finite
  // (or the dtype is not a float). \throws value_error if t is not one of this file's tensors (see
  // read). O(numel); reads the file's bytes only.
  std::int64_t first_non_finite(const TensorInfo& t) const {
    check_own(t, "first_non_finite");
    // NaN and +-inf are exactly the values whose exponent field is all ones.
    switch (t.dtype) {
      case DType::F32: return first_all_ones<std::uint32_t>(t, 0x7F800000u);
      case DType::F64: return first_all_ones<std::uint64_t>(t, 0x7FF0000000000000ull);
      case DType::F16: return first_all_ones<std::uint16_t>(t, 0x7C00u);
      case DType::BF16: return first_all_ones<std::uint16_t>(t, 0x7F80u);
      default: return -1;
    }
  }

  // Tensor t, converted element by element into out (row-major, numel entries). t must describe
  // one of this file's tensors: a reference from tensors(), find(), at() or expect(), or any
  // TensorInfo equal to one (name, dtype, shape and offsets; a copy) -- any other, e.g. a
  // TensorInfo of another file whose tensor of that name differs, is refused, never read outside
  // this file's data.
  // \throws value_error if t is not one of this file's tensors; format_error if its dtype is not
  // convertible, or (Scalar float, t F64) for a finite value beyond float's range, which would
  // become an infinity (naming the tensor, the value, its position and float's range); shape_error
  // if out.size() != t.numel(). `out` is unchanged on throw. Cost: one pass over the values, two
  // for F64 read as float (the range check first).
  template <typename Scalar>
  void read(const TensorInfo& t, MatrixRef<Scalar> out) const {
    static_assert(std::is_floating_point_v<Scalar>, "Scalar must be a floating-point type");
    check_own(t, "read");
    check_convertible(t);
    if (static_cast<std::uint64_t>(out.size()) != t.numel()) {
      std::ostringstream message;
      message << "safetensors: tensor '" << t.name << "' " << t.shape_string() << " has " << t.numel()
              << " elements; the destination is [" << out.rows() << ", " << out.cols() << "]";
      throw shape_error(message.str());
    }
    if (std::is_same_v<Scalar, float> && t.dtype == DType::F64) check_fits_float(t);
    // Nothing to convert. Also required: the rows of an empty matrix ([3, 0]) have a null data(),
    // which must not reach memcpy (its arguments are declared non-null even for 0 bytes).
    if (out.size() == 0) return;
    detail::convert_stored_values<Scalar>(data_ + t.begin, t.dtype, out);
  }

  // Tensor `name` as a new [rows, cols] matrix (1-D tensors become [n, 1], scalars [1, 1]).
  // \throws format_error if there is no such tensor, its dtype is not convertible or (as above) an
  // F64 value read as float would become an infinity; shape_error if it has more than 2
  // dimensions or a dimension beyond Index.
  template <typename Scalar>
  RowMatrix<Scalar> read(const std::string& name) const {
    const TensorInfo& t = at(name);
    // A zero-sized tensor may have any other dimension, up to 2^64 - 1 ([0, 2^63] has no data and
    // is valid); one beyond Index would become a negative matrix size.
    for (const std::uint64_t s : t.shape)
      if (s > static_cast<std::uint64_t>(std::numeric_limits<Index>::max()))
        throw shape_error("safetensors: tensor '" + name + "' in '" + path_ + "' is " + t.shape_string() +
                          "; the dimension " + std::to_string(s) + " is outside [0, " +
                          std::to_string(std::numeric_limits<Index>::max()) + "]");
    Index rows = 1, cols = 1;
    if (t.shape.size() == 1) {
      rows = static_cast<Index>(t.shape[0]);
    } else if (t.shape.size() == 2) {
      rows = static_cast<Index>(t.shape[0]);
      cols = static_cast<Index>(t.shape[1]);
    } else if (!t.shape.empty()) {
      throw shape_error("safetensors: tensor '" + name + "' in '" + path_ + "' is " + t.shape_string() +
                        "; only scalars, vectors and matrices can be read as a table");
    }
    check_convertible(t);
    RowMatrix<Scalar> out(rows, cols);
    read<Scalar>(t, out);
    return out;
  }

 private:
  void check_convertible(const TensorInfo& t) const {
    if (!is_convertible(t.dtype))
      throw format_error("safetensors: tensor '" + t.name + "' in '" + path_ + "' has dtype " + dtype_name(t.dtype) +
                         ", which cannot be converted to a floating-point table");
  }

  // format_error for the first finite value of the F64 tensor t that float cannot hold.
  void check_fits_float(const TensorInfo& t) const {
    const std::int64_t bad = detail::first_beyond_float(data_ + t.begin, t.numel());
    if (bad < 0) return;
    const auto i = static_cast<std::uint64_t>(bad);
    std::ostringstream message;
    message << "safetensors: tensor '" << t.name << "' in '" << path_ << "' has the F64 value "
            << detail::load_le<double>(data_ + t.begin, i) << " at ";
    if (t.shape.size() == 2)
      message << "(" << i / t.shape[1] << ", " << i % t.shape[1] << ")";
    else
      message << "index " << i;
    message << ", outside float's range [" << -std::numeric_limits<float>::max() << ", "
            << std::numeric_limits<float>::max() << "]: read as float it would become an infinity (read it as double)";
    throw format_error(message.str());
  }

  // The first element whose bits have all of `mask` set, or -1; blocks are scanned branch-free
  // (vectorised) and only a block with a hit is searched again for its position.
  template <typename Bits>
  std::int64_t first_all_ones(const TensorInfo& t, Bits mask) const {
    const std::uint64_t n = t.numel();
    const unsigned char* p = data_ + t.begin;
    constexpr std::uint64_t kBlock = 4096;
    for (std::uint64_t begin = 0; begin < n; begin += kBlock) {
      const std::uint64_t end = std::min(n, begin + kBlock);
      unsigned hit = 0;
      for (std::uint64_t i = begin; i < end; ++i)
        hit |= static_cast<unsigned>((detail::load_le<Bits>(p, i) & mask) == mask);
      if (hit)
        for (std::uint64_t i = begin; i < end; ++i)
          if ((detail::load_le<Bits>(p, i) & mask) == mask) return static_cast<std::int64_t>(i);
    }
    return -1;
  }

  // A buffer of `size` bytes (at least one), not initialised.
  static std::shared_ptr<unsigned char> owned_bytes(std::size_t size) {
    return std::shared_ptr<unsigned char>(new unsigned char[size > 0 ? size : 1],
                                          std::default_delete<unsigned char[]>());
  }

  // t is one of this file's tensors: an element of tensors_, or equal to the one of its name.
  void check_own(const TensorInfo& t, const char* where) const {
    const std::less<const TensorInfo*> before;
    if (!tensors_.empty() && !before(&t, tensors_.data()) && before(&t, tensors_.data() + tensors_.size())) return;
    const TensorInfo* own = find(t.name);
    if (own && own->dtype == t.dtype && own->shape == t.shape && own->begin == t.begin && own->end == t.end) return;
    std::ostringstream message;
    message << "SafetensorsFile::" << where << ": tensor '" << t.name << "' " << dtype_name(t.dtype) << " "
            << t.shape_string() << " at data_offsets [" << t.begin << ", " << t.end << "] is not a tensor of '" << path_
            << "'";
    if (own)
      message << " (its '" << t.name << "' is " << dtype_name(own->dtype) << " " << own->shape_string()
              << " at data_offsets [" << own->begin << ", " << own->end << "])";
    message << "; pass a TensorInfo of this file (tensors(), find(), at())";
    throw value_error(message.str());
  }

  SafetensorsFile(std::shared_ptr<const unsigned char> bytes, std::size_t size, std::string path)
      : bytes_(std::move(bytes)), path_(std::move(path)) {
    parse(size);
  }

  [[noreturn]] void fail(const std::string& what) const {
    throw format_error("safetensors: '" + path_ + "' is not a valid safetensors file: " + what);
  }

  void parse(std::size_t size) {
    const unsigned char* base = bytes_.get();
    if (size < 8) fail("it has " + std::to_string(size) + " bytes, fewer than the 8 of the header length");
    std::uint64_t header_bytes = 0;
    for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | base[i];
    if (header_bytes > detail::kMaxHeaderBytes)
      fail("the header length " + std::to_string(header_bytes) + " exceeds the limit of " +
           std::to_string(detail::kMaxHeaderBytes) + " bytes");
    if (header_bytes > size - 8)
      fail("the header length " + std::to_string(header_bytes) + " runs past the end of the file (" +
           std::to_string(size - 8) + " bytes after the length; truncated?)");
    if (header_bytes < 2 || base[8] != '{')
      fail("the header does not begin with '{' (the format requires a JSON object)");
    const char* header = reinterpret_cast<const char*>(base + 8);
    data_ = base + 8 + header_bytes;
    const std::uint64_t data_bytes = size - 8 - header_bytes;

    // Duplicate keys and deep nesting are caught while parsing (nlohmann would keep the last
    // duplicate silently); the callback sees every key with its depth.
    std::set<std::string> top_keys;
    const nlohmann::json::parser_callback_t callback = [&](int depth, nlohmann::json::parse_event_t event,
                                                           nlohmann::json& parsed) {
      if (depth > 3) fail("the header nests deeper than the format allows");
      if (event == nlohmann::json::parse_event_t::key && depth == 1 &&
          !top_keys.insert(parsed.get<std::string>()).second)
        fail("tensor '" + parsed.get<std::string>() + "' appears twice in the header");
      return true;
    };
    nlohmann::json json;
    try {
      json = nlohmann::json::parse(header, header + header_bytes, callback);
    } catch (const nlohmann::json::exception& e) {
      fail(std::string("the header is not valid JSON (") + e.what() + ")");
    }
    if (!json.is_object()) fail("the header is not a JSON object");

    for (auto it = json.begin(); it != json.end(); ++it) {
      const std::string& key = it.key();
      const nlohmann::json& value = it.value();
      if (key == "__metadata__") {
        if (!value.is_object()) fail("__metadata__ is not an object of strings");
        for (auto m = value.begin(); m != value.end(); ++m) {
          if (!m.value().is_string()) fail("__metadata__ entry '" + m.key() + "' is not a string");
          metadata_[m.key()] = m.value().get<std::string>();
        }
        continue;
      }
      tensors_.push_back(parse_tensor(key, value));
    }

    // The tensors must tile [0, data_bytes) exactly, in offset order.
    std::sort(tensors_.begin(), tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
      return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
    });
    std::uint64_t cursor = 0;
    for (const auto& t : tensors_) {
      if (t.begin != cursor) {
        std::ostringstream message;
        message << "tensor '" << t.name << "' has data_offsets [" << t.begin << ", " << t.end
                << "] but the previous tensor ends at " << cursor << (t.begin < cursor ? " (overlap)" : " (gap)");
        fail(message.str());
      }
      cursor = t.end;
    }
    if (cursor != data_bytes) {
      std::ostringstream message;
      message << "the tensors cover " << cursor << " bytes of data but the file has " << data_bytes
              << " after the header" << (cursor > data_bytes ? " (truncated)" : " (trailing bytes)");
      fail(message.str());
    }
    for (std::size_t i = 0; i < tensors_.size(); ++i) by_name_[tensors_[i].name] = i;
  }

  TensorInfo parse_tensor(const std::string& name, const nlohmann::json& value) const {
    const std::string where = "tensor '" + name + "'";
    if (name.empty()) fail("a tensor has an empty name");
    if (!value.is_object()) fail(where + " is not an object");
    for (auto it = value.begin(); it != value.end(); ++it)
      if (it.key() != "dtype" && it.key() != "shape" && it.key() != "data_offsets")
        fail(where + " has an unknown field '" + it.key() + "' (expected dtype, shape, data_offsets)");
    TensorInfo t;
    t.name = name;

    const auto dtype = value.find("dtype");
    if (dtype == value.end() || !dtype->is_string()) fail(where + " has no string 'dtype'");
    const std::string dtype_string = dtype->get<std::string>();
    bool known = false;
    for (const auto& info : detail::kDTypes)
      if (dtype_string == info.name) {
        t.dtype = info.dtype;
        known = true;
      }
    if (!known) fail(where + " has unknown dtype '" + dtype_string + "'");

    const auto shape = value.find("shape");
    if (shape == value.end() || !shape->is_array()) fail(where + " has no array 'shape'");
    std::uint64_t numel = 1;
    for (const auto& dim : *shape) {
      if (!dim.is_number_unsigned())
        fail(where + " has a shape entry " + dim.dump() + " that is not a non-negative integer");
      const auto s = dim.get<std::uint64_t>();
      if (s != 0 && numel > std::numeric_limits<std::uint64_t>::max() / s)
        fail(where + " has shape " + shape->dump() + " whose element count overflows 64 bits");
      numel *= s;
      t.shape.push_back(s);
    }
    const std::uint64_t element_bytes = dtype_bytes(t.dtype);
    if (numel > std::numeric_limits<std::uint64_t>::max() / element_bytes)
      fail(where + " has shape " + shape->dump() + " whose byte size overflows 64 bits");

    const auto offsets = value.find("data_offsets");
    if (offsets == value.end() || !offsets->is_array() || offsets->size() != 2 || !(*offsets)[0].is_number_unsigned() ||
        !(*offsets)[1].is_number_unsigned())
      fail(where + " has no 'data_offsets' pair of non-negative integers");
    t.begin = (*offsets)[0].get<std::uint64_t>();
    t.end = (*offsets)[1].get<std::uint64_t>();
    if (t.end < t.begin)
      fail(where + " has data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
           "] with end < begin");
    if (t.end - t.begin != numel * element_bytes) {
      std::ostringstream message;
      message << where << " is " << dtype_string << " " << shape->dump() << " = " << numel * element_bytes
              << " bytes but its data_offsets [" << t.begin << ", " << t.end << "] span " << t.end - t.begin;
      fail(message.str());
    }
    return t;
  }

  std::shared_ptr<const unsigned char> bytes_;
  const unsigned char* data_ = nullptr;
  std::string path_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::size_t> by_name_;
  std::map<std::string, std::string> metadata_;
};

// ---- writing ----

// Collects tensors and writes one safetensors file. Tensors are written in the order they were
// added; the header is padded with spaces to a multiple of 8 bytes so the data section is 8-byte
// aligned, as the reference writer does.
//
// Nothing the writer holds can dangle: add(name, values) keeps its own copy of the values (or
// takes an rvalue RowMatrix over, without a copy), and add(name, parameter) shares the Parameter
// (std::shared_ptr) and writes its values as they are when write() runs -- the zero-copy way to
// write a large table, which add_checkpoint takes. Its shape is the one it had when it was added:
// a parameter resized since (Parameter::resize_rows) makes write() throw, so a file never mixes
// shapes from before and after a resize (a head and its table, or a table and the optimizer state
// added beside it). A copyable value type: copies share what was added.
class SafetensorsWriter {
 public:
  // Adds a copy of `values` [rows, cols] as tensor `name` stored as `dtype` (F32, F64, F16 or BF16),
  // with shape [rows, cols], or [rows] when `as_vector` (a bias). Any float / double matrix,
  // block, map or expression is accepted; its values are copied now (rows * cols Scalars), so a
  // later change to the source is not written.
  // \throws value_error for an empty or "__metadata__" name, a name that is not valid UTF-8, a name
  // added before, or a dtype that is not a float dtype; shape_error for `as_vector` with more than
  // one column. The writer is unchanged on throw.
  template <typename Scalar>
  SafetensorsWriter& add(const std::string& name, const Eigen::Ref<const RowMatrix<Scalar>>& values, DType dtype,
                         bool as_vector = false) {
    check_entry<Scalar>(name, dtype, as_vector, values.cols(), "add");
    Entry entry = make_entry(name, dtype, as_vector);
    holder<Scalar>(entry).matrix = std::make_shared<const RowMatrix<Scalar>>(values);
    entries_.push_back(std::move(entry));
    return *this;
  }
  // The same for an rvalue RowMatrix<Scalar>, which is moved into the writer (no copy).
  template <typename Scalar, typename Matrix, std::enable_if_t<std::is_same_v<Matrix, RowMatrix<Scalar>>, int> = 0>
  SafetensorsWriter& add(const std::string& name, Matrix&& values, DType dtype, bool as_vector = false) {
    check_entry<Scalar>(name, dtype, as_vector, values.cols(), "add");
    Entry entry = make_entry(name, dtype, as_vector);
    holder<Scalar>(entry).matrix = std::make_shared<const RowMatrix<Scalar>>(std::move(values));
    entries_.push_back(std::move(entry));
    return *this;
  }
  // Adds a Parameter's value [rows, cols] as tensor `name`, shared, not copied: write() writes the
  // values the parameter has then, and the parameter lives as long as the writer needs it. Its
  // shape is recorded now: write() throws shape_error if the parameter has another one by then.
  // \throws as above, and value_error for a null parameter.
  template <typename Scalar>
  SafetensorsWriter& add(const std::string& name, std::shared_ptr<const Parameter<Scalar>> parameter, DType dtype,
                         bool as_vector = false) {
    if (!parameter)
      throw value_error("SafetensorsWriter::add: tensor '" + detail::escaped(name) + "' is a null Parameter");
    check_entry<Scalar>(name, dtype, as_vector, parameter->cols(), "add");
    Entry entry = make_entry(name, dtype, as_vector);
    entry.added_rows = parameter->rows();
    entry.added_cols = parameter->cols();
    holder<Scalar>(entry).parameter = std::move(parameter);
    entries_.push_back(std::move(entry));
    return *this;
  }
  // Sets a "__metadata__" entry (replacing one of the same key).
  // \throws value_error if the key or the value is not valid UTF-8; the writer is unchanged then.
  SafetensorsWriter& set_metadata(const std::string& key, const std::string& value) {
    detail::check_utf8(key, "SafetensorsWriter::set_metadata: the key");
    detail::check_utf8(value, "SafetensorsWriter::set_metadata: the value of '" + detail::escaped(key) + "'");
    metadata_[key] = value;
    return *this;
  }
  bool contains(const std::string& name) const {
    return std::any_of(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.name == name; });
  }

  // Writes the file: to `path`.tmp first, then renamed over `path`, so a crash or a full disk
  // never leaves a half-written file under the final name. Every value is checked first: a finite
  // value that its dtype cannot hold -- it would round to +-inf, which load_checkpoint refuses --
  // is an error, as in convert_table (F16: |x| >= 65520; BF16: |x| >= 2^128 - 2^119 ~ 3.3962e38;
  // F32 from double: beyond float's range). NaN and +-inf are written as they are.
  // \throws shape_error naming the tensor and both shapes if a Parameter added with add(name,
  // parameter) was resized since; value_error naming the tensor, the value, its (row, col) and the
  // dtype's largest finite value; both before the file is opened. io_error naming the path and
  // the reason (`path.tmp` exists and is not a regular file, cannot be created or written, the
  // rename fails). Nothing at `path` changes on throw. Cost: two passes over the tensors (check,
  // then convert in rows).
  void write(const std::string& path) const {
    for (const auto& e : entries_) check_shape(e);
    for (const auto& e : entries_) check_values(e);
    nlohmann::json header = nlohmann::json::object();
    if (!metadata_.empty()) header["__metadata__"] = metadata_;
    std::uint64_t offset = 0;
    for (const auto& e : entries_) {
      const View v = view(e);
      const std::uint64_t bytes = static_cast<std::uint64_t>(v.rows) * static_cast<std::uint64_t>(v.cols) *
                                  dtype_bytes(e.dtype);
      const auto shape = e.as_vector ? std::vector<std::uint64_t>{static_cast<std::uint64_t>(v.rows)}
                                     : std::vector<std::uint64_t>{static_cast<std::uint64_t>(v.rows),
                                                                  static_cast<std::uint64_t>(v.cols)};
      header[e.name] = {{"dtype", dtype_name(e.dtype)}, {"shape", shape}, {"data_offsets", {offset, offset + bytes}}};
      offset += bytes;
    }
    std::string text = header.dump();  // names and metadata were checked to be UTF-8: cannot throw
    text.append((8 - text.size() % 8) % 8, ' ');

    detail::write_file_atomically(path, "SafetensorsWriter::write", [&](detail::OutputFile& out) {
      unsigned char length[8];
      std::uint64_t n = text.size();
      for (int i = 0; i < 8; ++i, n >>= 8) length[i] = static_cast<unsigned char>(n & 0xff);
      out.write(length, 8);
      out.write(text.data(), text.size());
      // Rows are encoded into a buffer of about 4 MiB and written in one call each.
      std::vector<unsigned char> buffer;
      for (const auto& e : entries_) {
        const View v = view(e);
        const auto row_bytes = static_cast<std::size_t>(v.cols) * static_cast<std::size_t>(dtype_bytes(e.dtype));
        const Index rows_per_write = std::max<Index>(1, static_cast<Index>((std::size_t{4} << 20) /
                                                                           std::max<std::size_t>(row_bytes, 1)));
        buffer.resize(row_bytes * static_cast<std::size_t>(std::min(rows_per_write, std::max<Index>(v.rows, 1))));
        for (Index r0 = 0; r0 < v.rows; r0 += rows_per_write) {
          const Index r1 = std::min(v.rows, r0 + rows_per_write);
          for (Index r = r0; r < r1; ++r)
            encode_row(v, e.dtype, r, buffer.data() + static_cast<std::size_t>(r - r0) * row_bytes);
          out.write(buffer.data(), static_cast<std::size_t>(r1 - r0) * row_bytes);
        }
      }
    });
  }

 private:
  // Where a tensor's values are: a matrix the writer owns, or a Parameter it shares.
  template <typename Scalar>
  struct Holder {
    std::shared_ptr<const RowMatrix<Scalar>> matrix;
    std::shared_ptr<const Parameter<Scalar>> parameter;
  };
  struct Entry {
    std::string name;
    DType dtype = DType::F32;
    bool as_vector = false;
    Index added_rows = 0, added_cols = 0;  // a Parameter's shape when it was added
    Holder<float> f32;
    Holder<double> f64;
  };
  // The values of an entry as they are now: contiguous, row-major.
  struct View {
    const float* f32 = nullptr;
    const double* f64 = nullptr;
    Index rows = 0, cols = 0;
  };

  template <typename Scalar>
  static Holder<Scalar>& holder(Entry& e) {
    if constexpr (std::is_same_v<Scalar, float>)
      return e.f32;
    else
      return e.f64;
  }
  static Entry make_entry(const std::string& name, DType dtype, bool as_vector) {
    Entry entry;
    entry.name = name;
    entry.dtype = dtype;
    entry.as_vector = as_vector;
    return entry;
  }
  template <typename Scalar>
  static void view_of(const Holder<Scalar>& s, const Scalar*& data, Index& rows, Index& cols) {
    if (s.parameter) {
      const auto values = s.parameter->value();
      data = values.data();
      rows = values.rows();
      cols = values.cols();
    } else if (s.matrix) {
      data = s.matrix->data();
      rows = s.matrix->rows();
      cols = s.matrix->cols();
    }
  }
  static View view(const Entry& e) {
    View v;
    if (e.f32.matrix || e.f32.parameter)
      view_of(e.f32, v.f32, v.rows, v.cols);
    else
      view_of(e.f64, v.f64, v.rows, v.cols);
    return v;
  }

  template <typename Scalar>
  void check_entry(const std::string& name, DType dtype, bool as_vector, Index cols, const char* where) const {
    static_assert(std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>, "float or double tables");
    const std::string prefix = std::string("SafetensorsWriter::") + where + ": ";
    if (name.empty() || name == "__metadata__")
      throw value_error(prefix + "tensor name '" + name + "' is reserved or empty");
    detail::check_utf8(name, prefix + "tensor name");
    if (contains(name)) throw value_error(prefix + "tensor '" + name + "' was added before");
    if (!is_convertible(dtype))
      throw value_error(prefix + "tensor '" + name + "' dtype " + dtype_name(dtype) + " is not F32, F64, F16 or BF16");
    if (as_vector && cols != 1)
      throw shape_error(prefix + "tensor '" + name + "' as a vector needs one column, it has " + std::to_string(cols));
  }

  // shape_error if e is a Parameter whose shape is no longer the one it was added with.
  static void check_shape(const Entry& e) {
    if (!e.f32.parameter && !e.f64.parameter) return;
    const View v = view(e);
    if (v.rows == e.added_rows && v.cols == e.added_cols) return;
    std::ostringstream message;
    message << "SafetensorsWriter::write: tensor '" << e.name << "' was added as a Parameter of shape [" << e.added_rows
            << ", " << e.added_cols << "] but it is [" << v.rows << ", " << v.cols
            << "] now (resized since add); nothing was written. Add it to a new writer to write the new shape";
    throw shape_error(message.str());
  }

  // value_error for the first finite value of e that its dtype cannot hold (see write).
  static void check_values(const Entry& e) {
    const View v = view(e);
    if (v.f32)
      check_values(e, v.f32, v.rows, v.cols);
    else
      check_values(e, v.f64, v.rows, v.cols);
  }
  // A finite x rounds to +-inf in F16 exactly when |x| >= 65520 (half-way from 65504 to 2^16) and
  // in BF16 when |x| >= 511 * 2^119 (half-way from its largest, 255 * 2^120, to 2^128); both
  // bounds are even floats, so a double first rounded to odd (encode_row) crosses them exactly
  // when it does. F32 from double: when static_cast<float> does.
  template <typename Source>
  static void check_values(const Entry& e, const Source* values, Index rows, Index cols) {
    const auto beyond = [&](Source bound) {
      return first_where(values, rows * cols, [bound](Source x) {
        const Source a = std::abs(x);
        return a >= bound && a <= std::numeric_limits<Source>::max();  // NaN and +-inf are kept
      });
    };
    Index bad = -1;
    double largest = 0;
    switch (e.dtype) {
      case DType::F32:
        if constexpr (std::is_same_v<Source, double>)
          bad = first_where(values, rows * cols,
                            [](double x) { return std::isfinite(x) && !std::isfinite(static_cast<float>(x)); });
        largest = std::numeric_limits<float>::max();
        break;
      case DType::F16:
        bad = beyond(Source(65520));
        largest = static_cast<float>(Eigen::NumTraits<Eigen::half>::highest());
        break;
      case DType::BF16:
        bad = beyond(static_cast<Source>(std::ldexp(511.0f, 119)));
        largest = static_cast<float>(Eigen::NumTraits<Eigen::bfloat16>::highest());
        break;
      default: break;  // F64 holds every float and double
    }
    if (bad < 0) return;
    std::ostringstream message;
    message << "SafetensorsWriter::write: tensor '" << e.name << "': value " << values[bad] << " at (" << bad / cols
            << ", " << bad % cols << ") overflows " << dtype_name(e.dtype) << " (largest finite " << largest
            << "); nothing was written";
    throw value_error(message.str());
  }
  // The first i < n with hit(values[i]), or -1. Blocks are scanned branch-free (vectorised); only a
  // block with a hit is searched again for its position.
  template <typename Source, typename Hit>
  static Index first_where(const Source* values, Index n, Hit hit) {
    constexpr Index kBlock = 4096;
    for (Index begin = 0; begin < n; begin += kBlock) {
      const Index end = std::min(n, begin + kBlock);
      bool any = false;
      for (Index i = begin; i < end; ++i) any |= hit(values[i]);
      if (any)
        for (Index i = begin; i < end; ++i)
          if (hit(values[i])) return i;
    }
    return -1;
  }

  template <typename T>
  static void store(unsigned char* dst, Index c, T value) {
    std::memcpy(dst + static_cast<std::size_t>(c) * sizeof(T), &value, sizeof(T));
  }

  // x rounded to a float whose last mantissa bit is 1 whenever the rounding is inexact
  // (Boldo & Melquiond, "Emulation of FMA and correctly rounded sums: proved algorithms using
  // rounding to odd", IEEE TC 2008): a second rounding to a format with >= 2 fewer bits is then
  // the correctly rounded result.
  static float float_round_to_odd(double x) {
    float f = static_cast<float>(x);
    if (std::isfinite(f) && static_cast<double>(f) != x && (Eigen::numext::bit_cast<std::uint32_t>(f) & 1u) == 0)
      f = std::nextafter(f, x > static_cast<double>(f) ? std::numeric_limits<float>::infinity()
                                                       : -std::numeric_limits<float>::infinity());
    return f;
  }

  // Row r of v, stored as dtype at dst. Eigen rounds to F16/BF16 from float; a double goes through
  // float rounded to odd first, which makes the two roundings equal one direct rounding to
  // nearest-even (float has >= 2 more bits than either).
  static void encode_row(const View& v, DType dtype, Index r, unsigned char* dst) {
    if (v.f32)
      encode_values(v.f32 + r * v.cols, v.cols, dtype, dst, [](float x) { return x; });
    else
      encode_values(v.f64 + r * v.cols, v.cols, dtype, dst, float_round_to_odd);
  }

  template <typename Source, typename ToFloatForHalf>
  static void encode_values(const Source* src, Index cols, DType dtype, unsigned char* dst, ToFloatForHalf to_float) {
    switch (dtype) {
      case DType::F32:  // from float exact; from double one rounding to nearest-even
        for (Index c = 0; c < cols; ++c) store(dst, c, static_cast<float>(src[c]));
        break;
      case DType::F64:
        for (Index c = 0; c < cols; ++c) store(dst, c, static_cast<double>(src[c]));
        break;
      case DType::F16:
        for (Index c = 0; c < cols; ++c)
          store(dst, c, Eigen::numext::bit_cast<std::uint16_t>(Eigen::half(to_float(src[c]))));
        break;
      case DType::BF16:
        for (Index c = 0; c < cols; ++c)
          store(dst, c, Eigen::numext::bit_cast<std::uint16_t>(Eigen::bfloat16(to_float(src[c]))));
        break;
      default: break;  // excluded by add()
    }
  }

  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace embedhead

#endif  // EMBEDHEAD_IO_SAFETENSORS_HPP
