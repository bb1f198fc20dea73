// embedhead: a RowUpdateCounter (optim/untrained_guard.hpp) to and from a safetensors file, beside
// a checkpoint or an optimizer state.
//
//   tensor   <name>            F64 [rows], row r's count (exact: counts are integers below 2^53)
//   metadata <name>.records    the counter's records(), a decimal integer
//
// Needs <embedhead/io/safetensors.hpp> (nlohmann/json, POSIX); not part of the umbrella header.
#ifndef EMBEDHEAD_IO_UPDATE_COUNTS_HPP
#define EMBEDHEAD_IO_UPDATE_COUNTS_HPP

#include "../optim/untrained_guard.hpp"
#include "../types.hpp"
#include "safetensors.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace embedhead {

inline constexpr const char* kUpdateCountsName = "embedhead.update_counts";

// Adds `counter` to `writer` as the tensor `name` and the metadata `name`.records (a copy: later
// records are not written). \throws value_error if a count or records() is 2^53 or more (not
// exact in F64), or as SafetensorsWriter::add / set_metadata (the name added before, not UTF-8);
// the writer is unchanged on throw.
inline void add_update_counts(SafetensorsWriter& writer, const RowUpdateCounter& counter,
                              const std::string& name = kUpdateCountsName) {
  constexpr std::int64_t kExact = std::int64_t{1} << 53;
  if (counter.records() >= kExact)
    throw value_error("add_update_counts: records() = " + std::to_string(counter.records()) +
                      " is not exact in F64 (2^53 or more)");  // counts <= records
  RowMatrix<double> counts(counter.rows(), 1);
  for (Index r = 0; r < counter.rows(); ++r)
    counts(r, 0) = static_cast<double>(counter.counts()[static_cast<std::size_t>(r)]);
  SafetensorsWriter staged = writer;  // all or nothing
  staged.add<double>(name, std::move(counts), DType::F64, /*as_vector=*/true);
  staged.set_metadata(name + ".records", std::to_string(counter.records()));
  writer = std::move(staged);
}

// The counter stored by add_update_counts under `name`. \throws format_error naming the file and
// what is wrong: no tensor `name` or no metadata `name`.records, a records value that is not a
// non-negative integer, a tensor that is not F64 or F32, not [rows] or [rows, 1] with rows >= 1,
// or a count that is not an integer in [0, records] (naming its row and value).
inline RowUpdateCounter read_update_counts(const SafetensorsFile& file, const std::string& name = kUpdateCountsName) {
  const auto fail = [&](const std::string& what) {
    return format_error("read_update_counts: '" + file.path() + "': " + what);
  };
  const TensorInfo* t = file.find(name);
  if (!t) throw fail("no tensor '" + name + "' (no update counts saved here)");
  const auto& metadata = file.metadata();
  const auto it = metadata.find(name + ".records");
  if (it == metadata.end()) throw fail("no metadata '" + name + ".records'");
  std::int64_t records = -1;
  try {
    // Digits only: std::stoll alone would take " 5" and "+5".
    const bool digits = !it->second.empty() &&
                        std::all_of(it->second.begin(), it->second.end(), [](char c) { return c >= '0' && c <= '9'; });
    std::size_t used = 0;
    records = digits ? std::stoll(it->second, &used) : -1;
    if (used != it->second.size() || records < 0) records = -1;
  } catch (const std::exception&) {
    records = -1;
  }
  if (records < 0) throw fail("metadata '" + name + ".records' = '" + it->second + "' is not a non-negative integer");
  if (t->dtype != DType::F64 && t->dtype != DType::F32)
    throw fail("tensor '" + name + "' has dtype " + dtype_name(t->dtype) + "; update counts are F64 (or F32)");
  const bool vector = t->shape.size() == 1;
  const bool column = t->shape.size() == 2 && t->shape[1] == 1;
  if ((!vector && !column) || t->shape[0] < 1)
    throw fail("tensor '" + name + "' is " + t->shape_string() + "; update counts are [rows] or [rows, 1], rows >= 1");
  const RowMatrix<double> values = file.read<double>(name);
  std::vector<std::int64_t> counts(static_cast<std::size_t>(values.rows()));
  for (Index r = 0; r < values.rows(); ++r) {
    const double x = values(r, 0);
    if (!(x >= 0 && x <= static_cast<double>(records) && std::floor(x) == x)) {
      std::ostringstream message;
      message << "tensor '" << name << "' has the count " << x << " at row " << r << ", not an integer in [0, "
              << records << "] (records)";
      throw fail(message.str());
    }
    counts[static_cast<std::size_t>(r)] = static_cast<std::int64_t>(x);
  }
  return RowUpdateCounter(std::move(counts), records);
}

}  // namespace embedhead

#endif  // EMBEDHEAD_IO_UPDATE_COUNTS_HPP
