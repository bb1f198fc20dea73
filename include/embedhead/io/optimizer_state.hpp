// embedhead: an optimizer's state (optim/optimizer.hpp's OptimizerState: the step count and every
// parameter's buffers) to and from a safetensors file, exactly (stored in Scalar's own dtype).
//
// Needs <embedhead/io/safetensors.hpp> (nlohmann/json, POSIX); not part of the umbrella header.
#ifndef EMBEDHEAD_IO_OPTIMIZER_STATE_HPP
#define EMBEDHEAD_IO_OPTIMIZER_STATE_HPP

#include "../optim/optimizer.hpp"
#include "../types.hpp"
#include "safetensors.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace embedhead {

// Adds an optimizer's state to `writer`: tensors "optimizer.<i>.<buffer>" for parameter i (in
// registration order) and metadata "optimizer" (kind), "optimizer.step", "optimizer.parameters"
// (a JSON list of [name, rows, cols]) and "optimizer.parameter_steps" (a JSON list of each
// parameter's own step count; an entry without one is written with the state's step), and, when
// some parameter has per-parameter scalars (LazyAdamW's running decay),
// "optimizer.parameter_scalars" (a JSON list of one object {name: value} per parameter; doubles,
// written to round-trip exactly), and, when some parameter's state holds its trainable rows only
// (Parameter::set_trainable_rows), "optimizer.trainable_rows" (a JSON list of, per parameter, null
// or the sorted list of those rows' ids; the buffers are then [k, cols]). Buffers are stored in Scalar's own dtype, so
// a restore is exact. The buffers are moved into the writer: pass optimizer.state() directly (no copy), or a named
// state, which is copied once.
// \throws value_error "add_optimizer_state: parameter <i>'s name '<name>' is not valid UTF-8 (at
// byte <k>) ..." (a safetensors header is JSON), the same for the optimizer's kind
// (state.optimizer) and a scalar's name, value_error for a scalar that is not finite (JSON holds
// none), or as SafetensorsWriter::add: value_error for a tensor "optimizer.<i>.<buffer>" added to
// the writer before. The writer is unchanged on throw.
template <typename Scalar>
void add_optimizer_state(SafetensorsWriter& writer, OptimizerState<Scalar> state) {
  const DType dtype = std::is_same_v<Scalar, float> ? DType::F32 : DType::F64;
  detail::check_utf8(state.optimizer, "add_optimizer_state: the optimizer's kind");
  for (std::size_t i = 0; i < state.parameters.size(); ++i)
    detail::check_utf8(state.parameters[i].name, "add_optimizer_state: parameter " + std::to_string(i) + "'s name");
  SafetensorsWriter staged = writer;  // all or nothing: the entries are added to a copy, then swapped in
  nlohmann::json parameters = nlohmann::json::array(), steps = nlohmann::json::array();
  nlohmann::json scalars = nlohmann::json::array(), trainable = nlohmann::json::array();
  bool any_scalars = false, any_trainable = false;
  for (std::size_t i = 0; i < state.parameters.size(); ++i) {
    auto& entry = state.parameters[i];
    parameters.push_back({entry.name, entry.rows, entry.cols});
    steps.push_back(entry.step.value_or(state.step));
    nlohmann::json object = nlohmann::json::object();
    for (const auto& [key, value] : entry.scalars) {
      if (!std::isfinite(value))
        throw value_error("add_optimizer_state: parameter " + std::to_string(i) + "'s scalar '" + key +
                          "' is not finite (JSON has no infinity or NaN)");
      detail::check_utf8(key, "add_optimizer_state: parameter " + std::to_string(i) + "'s scalar name");
      object[key] = value;
    }
    any_scalars = any_scalars || !entry.scalars.empty();
    scalars.push_back(std::move(object));
    any_trainable = any_trainable || entry.trainable_rows.has_value();
    trainable.push_back(entry.trainable_rows ? nlohmann::json(*entry.trainable_rows) : nlohmann::json(nullptr));
    for (auto& [key, buffer] : entry.buffers)
      staged.add<Scalar>("optimizer." + std::to_string(i) + "." + key, std::move(buffer), dtype);
  }
  staged.set_metadata("optimizer", state.optimizer);
  staged.set_metadata("optimizer.step", std::to_string(state.step));
  staged.set_metadata("optimizer.parameters", parameters.dump());
  staged.set_metadata("optimizer.parameter_steps", steps.dump());
  if (any_scalars) staged.set_metadata("optimizer.parameter_scalars", scalars.dump());
  if (any_trainable) staged.set_metadata("optimizer.trainable_rows", trainable.dump());
  writer = std::move(staged);
}

// The optimizer state stored by add_optimizer_state, to pass to Optimizer::load_state (which
// checks it against the optimizer). \throws format_error naming what is missing or malformed: the
// metadata, or a buffer whose dtype is not a float dtype or whose shape is neither the [rows, cols]
// the metadata gives its parameter nor [rows, 1] (a per-row buffer), or (Scalar float) an F64
// buffer holding a finite value beyond float's range, which would become an infinity
// (SafetensorsFile::read: the tensor, the value, its (row, col) and float's range). Sizes are
// trusted only once a tensor of that shape exists.
template <typename Scalar>
OptimizerState<Scalar> read_optimizer_state(const SafetensorsFile& file) {
  const auto& metadata = file.metadata();
  const auto fail = [&](const std::string& what) -> void {
    throw format_error("read_optimizer_state: '" + file.path() + "': " + what);
  };
  for (const char* key : {"optimizer", "optimizer.step", "optimizer.parameters"})
    if (metadata.find(key) == metadata.end())
      fail(std::string("no metadata '") + key + "' (no optimizer state saved here)");
  OptimizerState<Scalar> state;
  state.optimizer = metadata.at("optimizer");
  try {
    // Digits only: std::stoll alone would take " 5" and "+5".
    const std::string& step = metadata.at("optimizer.step");
    if (step.empty() || !std::all_of(step.begin(), step.end(), [](char c) { return c >= '0' && c <= '9'; }))
      throw std::invalid_argument("step");
    std::size_t used = 0;
    state.step = std::stoll(step, &used);
    if (used != step.size() || state.step < 0) throw std::invalid_argument("step");
  } catch (const std::exception&) {
    fail("metadata 'optimizer.step' = '" + metadata.at("optimizer.step") + "' is not a non-negative integer");
  }
  const nlohmann::json parameters = nlohmann::json::parse(metadata.at("optimizer.parameters"), nullptr, false);
  if (!parameters.is_array()) fail("metadata 'optimizer.parameters' is not a JSON list");
  // Each parameter's own step count; files written before there were any lack the key (every
  // parameter then has the state's step).
  nlohmann::json steps;
  if (const auto it = metadata.find("optimizer.parameter_steps"); it != metadata.end()) {
    steps = nlohmann::json::parse(it->second, nullptr, false);
    bool valid = steps.is_array() && steps.size() == parameters.size();
    for (std::size_t i = 0; valid && i < steps.size(); ++i)
      valid = steps[i].is_number_unsigned() && steps[i].get<std::uint64_t>() <= static_cast<std::uint64_t>(state.step);
    if (!valid)
      fail("metadata 'optimizer.parameter_steps' = '" + it->second + "' is not a list of " +
           std::to_string(parameters.size()) + " integers in [0, " + std::to_string(state.step) + "]");
  }
  // Each parameter's scalars (LazyAdamW's); absent when no parameter has any.
  nlohmann::json scalars;
  if (const auto it = metadata.find("optimizer.parameter_scalars"); it != metadata.end()) {
    scalars = nlohmann::json::parse(it->second, nullptr, false);
    bool valid = scalars.is_array() && scalars.size() == parameters.size();
    for (std::size_t i = 0; valid && i < scalars.size(); ++i) {
      valid = scalars[i].is_object();
      for (auto item = valid ? scalars[i].begin() : scalars[i].end(); valid && item != scalars[i].end(); ++item)
        valid = item.value().is_number();
    }
    if (!valid)
      fail("metadata 'optimizer.parameter_scalars' = '" + it->second + "' is not a list of " +
           std::to_string(parameters.size()) + " objects of numbers");
  }
  // Each parameter's trainable rows, or null; absent when every state holds every row.
  nlohmann::json trainable;
  if (const auto it = metadata.find("optimizer.trainable_rows"); it != metadata.end()) {
    trainable = nlohmann::json::parse(it->second, nullptr, false);
    bool valid = trainable.is_array() && trainable.size() == parameters.size();
    for (std::size_t i = 0; valid && i < trainable.size(); ++i) {
      valid = trainable[i].is_null() || trainable[i].is_array();
      for (std::size_t j = 0; valid && trainable[i].is_array() && j < trainable[i].size(); ++j)
        valid = trainable[i][j].is_number_unsigned() &&
                (j == 0 || trainable[i][j].get<std::uint64_t>() > trainable[i][j - 1].get<std::uint64_t>());
    }
    if (!valid)
      fail("metadata 'optimizer.trainable_rows' is not a list of " + std::to_string(parameters.size()) +
           " entries, each null or a strictly increasing list of row ids");
  }
  for (std::size_t i = 0; i < parameters.size(); ++i) {
    const auto& p = parameters[i];
    if (!p.is_array() || p.size() != 3 || !p[0].is_string() || !p[1].is_number_unsigned() || !p[2].is_number_unsigned())
      fail("metadata 'optimizer.parameters' entry " + std::to_string(i) + " is not [name, rows, cols]");
    typename OptimizerState<Scalar>::Entry entry;
    entry.name = p[0].get<std::string>();
    constexpr auto max_index = static_cast<std::uint64_t>(std::numeric_limits<Index>::max());
    if (p[1].get<std::uint64_t>() > max_index || p[2].get<std::uint64_t>() > max_index)
      fail("metadata 'optimizer.parameters' entry " + std::to_string(i) + " has a size " + p.dump() + " outside [0, " +
           std::to_string(max_index) + "]");
    entry.rows = static_cast<Index>(p[1].get<std::uint64_t>());
    entry.cols = static_cast<Index>(p[2].get<std::uint64_t>());
    if (!steps.is_null()) entry.step = static_cast<std::int64_t>(steps[i].get<std::uint64_t>());
    if (!scalars.is_null())
      for (auto item = scalars[i].begin(); item != scalars[i].end(); ++item)
        entry.scalars.emplace(item.key(), item.value().get<double>());
    if (!trainable.is_null() && trainable[i].is_array()) {
      std::vector<Index> ids;
      ids.reserve(trainable[i].size());
      for (const auto& id : trainable[i]) {
        if (id.get<std::uint64_t>() >= static_cast<std::uint64_t>(entry.rows))
          fail("metadata 'optimizer.trainable_rows' entry " + std::to_string(i) + " has the id " + id.dump() +
               " outside [0, " + std::to_string(entry.rows) + ") (the parameter's rows)");
        ids.push_back(static_cast<Index>(id.get<std::uint64_t>()));
      }
      entry.trainable_rows = std::move(ids);
    }
    // The buffers' rows: the trainable rows' count, or the parameter's rows.
    const Index state_rows = entry.trainable_rows ? static_cast<Index>(entry.trainable_rows->size()) : entry.rows;
    const std::string prefix = "optimizer." + std::to_string(i) + ".";
    for (const auto& t : file.tensors()) {
      if (t.name.compare(0, prefix.size(), prefix) != 0) continue;
      const std::string key = t.name.substr(prefix.size());
      // The shape check first: the metadata's sizes are only trusted once a tensor of that shape,
      // backed by data in the file, exists; allocating before it let a forged size ask for 2^62.
      if (!is_convertible(t.dtype))
        fail("tensor '" + t.name + "' has dtype " + dtype_name(t.dtype) +
             "; optimizer buffers are F32, F64, F16 or BF16");
      const bool matrix = t.shape.size() == 2 && t.shape[0] == static_cast<std::uint64_t>(state_rows) &&
                          t.shape[1] == static_cast<std::uint64_t>(entry.cols);
      const bool vector = entry.cols == 1 && t.shape.size() == 1 &&
                          t.shape[0] == static_cast<std::uint64_t>(state_rows);
      const bool per_row = t.shape.size() == 2 && t.shape[0] == static_cast<std::uint64_t>(state_rows) &&
                           t.shape[1] == 1;
      if (!matrix && !vector && !per_row)
        fail("tensor '" + t.name + "' is " + t.shape_string() + " but parameter " + std::to_string(i) + " ('" +
             entry.name + "') is [" + std::to_string(entry.rows) + ", " + std::to_string(entry.cols) +
             "] in metadata 'optimizer.parameters'" +
             (entry.trainable_rows ? " with " + std::to_string(state_rows) + " trainable rows" : std::string()));
      RowMatrix<Scalar> buffer(state_rows, per_row && !matrix ? Index{1} : entry.cols);
      file.read<Scalar>(t, buffer);
      entry.buffers.emplace(key, std::move(buffer));
    }
    state.parameters.push_back(std::move(entry));
  }
  return state;
}

}  // namespace embedhead

#endif  // EMBEDHEAD_IO_OPTIMIZER_STATE_HPP
