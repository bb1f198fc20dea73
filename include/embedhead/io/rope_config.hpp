// embedhead: reading a model's RoPE settings from a Hugging Face config.json, and the frequencies
// they give (rope_scaling.hpp).
//
// Needs nlohmann/json (Debian: nlohmann-json3-dev; CMake: link embedhead::safetensors, which is
// embedhead plus nlohmann_json). The umbrella header does not include it.
//
// What is read (top-level keys of config.json; every other top-level key is ignored):
//   rope_theta                        the base b (default 10000, transformers' default_theta)
//   rope_scaling                      the scaling block of transformers v4: {"rope_type": ..., ...}
//                                     or the legacy spelling {"type": ..., ...}; null = none
//   rope_parameters                   transformers v5's block: the same keys, and it may carry
//                                     rope_theta and partial_rotary_factor itself
//   partial_rotary_factor             the rotated fraction of a head (default 1), top level or in
//                                     the block
//   head_dim                          else hidden_size // num_attention_heads (integer division, as
//                                     transformers; a null head_dim counts as absent)
//   max_position_embeddings           M
//   original_max_position_embeddings  L, top level (Phi-3) or in the block
//
// As transformers standardises them (RotaryEmbeddingConfigMixin.standardize_rope_params and the
// _validate_*_rope_parameters functions of modeling_rope_utils.py, v5):
//   - the type is the block's "rope_type", else its legacy "type", else "default"; both may be
//     given if they agree (transformers v4's LlamaConfig let `type` win, v5 lets rope_type win, so
//     two different values are refused). Legacy names: "su" is "longrope" (Phi-3's first configs); in a config whose
//     model_type is "phi3", a legacy "type": "yarn" is "longrope" too (transformers' Phi3Config
//     maps both). Types: default, linear, dynamic, yarn, longrope, llama3.
//   - for yarn, longrope and llama3, L is the top-level original_max_position_embeddings if
//     present, else the block's, else M.
//   - rotary_dim = int(head_dim * partial_rotary_factor): the product in double, truncated toward
//     zero as Python's int() (Phi-2: 80 * 0.4 = 32); it must be even and >= 2 (>= 4 for dynamic).
//   - null for an optional key means absent (transformers reads None), and so do YaRN's beta_fast
//     and beta_slow when 0 (transformers' `or 32`, `or 1`).
//
// Where embedhead is stricter than transformers, which logs a warning and computes on: a key of
// the block that transformers does not know for the type ("Unrecognized keys", e.g. Phi-3.5-MoE's
// long_mscale, which transformers' generic code ignores but that model uses), a value outside its
// range (factor < 1, a list of the wrong length), and the same key given twice with different
// values (rope_theta at the top level and in rope_parameters; rope_scaling and rope_parameters
// both given and different) are a format_error naming the key. Per-layer-type blocks (v5's
// {"full_attention": {...}, "sliding_attention": {...}}) are refused, named, as are types not
// listed above (e.g. "mrope", "proportional"): never a silent fallback to another schedule.
#ifndef EMBEDHEAD_IO_ROPE_CONFIG_HPP
#define EMBEDHEAD_IO_ROPE_CONFIG_HPP

#include "../detail/files.hpp"
#include "../errors.hpp"
#include "../rope.hpp"
#include "../rope_scaling.hpp"
#include "../types.hpp"

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <istream>
#include <iterator>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace embedhead {

// A model's RoPE settings, as read from config.json (see the top of this header). The optional
// fields are those the type uses and the config gives; rope_frequencies reads what the type needs.
struct RopeConfig {
  std::string rope_type = "default";  // default, linear, dynamic, yarn, longrope, llama3
  double rope_theta = 10000.0;        // b
  Index head_dim = 0;
  double partial_rotary_factor = 1.0;
  Index rotary_dim = 0;                                   // int(head_dim * partial_rotary_factor), even
  std::optional<Index> max_position_embeddings;           // M
  std::optional<Index> original_max_position_embeddings;  // L (yarn, longrope, llama3: resolved)
  std::optional<double> factor;                           // linear, dynamic, yarn, llama3; longrope (optional)
  std::optional<double> attention_factor;                 // yarn, longrope
  std::optional<double> beta_fast;                        // yarn (default 32)
  std::optional<double> beta_slow;                        // yarn (default 1)
  std::optional<double> mscale;                           // yarn
  std::optional<double> mscale_all_dim;                   // yarn
  std::optional<bool> truncate;                           // yarn (default true)
  std::optional<double> low_freq_factor;                  // llama3
  std::optional<double> high_freq_factor;                 // llama3
  std::vector<double> short_factor;                       // longrope [rotary_dim / 2]
  std::vector<double> long_factor;                        // longrope [rotary_dim / 2]
};

namespace detail {

using rope_json = nlohmann::json;

// A JSON value for a message: compact, at most ~60 characters.
inline std::string rope_json_preview(const rope_json& value) {
  std::string text = value.dump(-1, ' ', false, rope_json::error_handler_t::replace);
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  return text;
}

// A key for a message: as a JSON string when it is not a plain identifier.
inline std::string rope_json_key(const std::string& key) {
  bool plain = !key.empty();
  for (const char c : key)
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_')) plain = false;
  return plain ? key : rope_json(key).dump(-1, ' ', false, rope_json::error_handler_t::replace);
}

[[noreturn]] inline void throw_rope_config(const std::string& key, const std::string& what) {
  throw format_error("parse_rope_config: " + key + ": " + what);
}

[[noreturn]] inline void throw_rope_config_type(const std::string& key, const char* expected, const rope_json& value) {
  throw_rope_config(key, std::string("expected ") + expected + ", got " + value.type_name() + " " +
                             rope_json_preview(value));
}

inline std::string rope_number_text(double value) {
  std::ostringstream text;
  text.precision(17);
  text << value;
  return text.str();
}

// obj[key] if present and not null.
inline const rope_json* rope_json_find(const rope_json& obj, const std::string& key) {
  const auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

inline std::optional<double> rope_json_number(const rope_json& obj, const std::string& key, const std::string& path) {
  const rope_json* value = rope_json_find(obj, key);
  if (value == nullptr) return std::nullopt;
  if (!value->is_number()) throw_rope_config_type(path, "a number", *value);
  const double x = value->get<double>();
  if (!std::isfinite(x)) throw_rope_config(path, "value " + rope_number_text(x) + " is not finite");
  return x;
}

// An integer in [lo, 2^53]: a JSON integer, or a number with an integral value (4096.0).
inline std::optional<Index> rope_json_integer(const rope_json& obj, const std::string& key, const std::string& path,
                                              Index lo) {
  const rope_json* value = rope_json_find(obj, key);
  if (value == nullptr) return std::nullopt;
  constexpr Index hi = Index{1} << 53;
  const auto out_of_range = [&](const std::string& shown) {
    throw_rope_config(path, "value " + shown + " outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  };
  if (value->is_number_unsigned()) {
    const auto x = value->get<std::uint64_t>();
    if (x > static_cast<std::uint64_t>(hi) || static_cast<Index>(x) < lo) out_of_range(std::to_string(x));
    return static_cast<Index>(x);
  }
  if (value->is_number_integer()) {
    const auto x = value->get<std::int64_t>();
    if (x < lo || x > hi) out_of_range(std::to_string(x));
    return static_cast<Index>(x);
  }
  if (value->is_number_float()) {
    const double x = value->get<double>();
    if (!std::isfinite(x) || std::floor(x) != x)
      throw_rope_config(path, "expected an integer, got " + rope_number_text(x));
    if (x < static_cast<double>(lo) || x > static_cast<double>(hi)) out_of_range(rope_number_text(x));
    return static_cast<Index>(x);
  }
  throw_rope_config_type(path, "an integer", *value);
}

inline std::optional<std::string> rope_json_string(const rope_json& obj, const std::string& key,
                                                   const std::string& path) {
  const rope_json* value = rope_json_find(obj, key);
  if (value == nullptr) return std::nullopt;
  if (!value->is_string()) throw_rope_config_type(path, "a string", *value);
  return value->get<std::string>();
}

inline std::optional<bool> rope_json_bool(const rope_json& obj, const std::string& key, const std::string& path) {
  const rope_json* value = rope_json_find(obj, key);
  if (value == nullptr) return std::nullopt;
  if (!value->is_boolean()) throw_rope_config_type(path, "true or false", *value);
  return value->get<bool>();
}

inline std::optional<std::vector<double>> rope_json_numbers(const rope_json& obj, const std::string& key,
                                                            const std::string& path) {
  const rope_json* value = rope_json_find(obj, key);
  if (value == nullptr) return std::nullopt;
  if (!value->is_array()) throw_rope_config_type(path, "a list of numbers", *value);
  std::vector<double> out;
  out.reserve(value->size());
  for (std::size_t i = 0; i < value->size(); ++i) {
    const rope_json& item = (*value)[i];
    const std::string item_path = path + "[" + std::to_string(i) + "]";
    if (!item.is_number()) throw_rope_config_type(item_path, "a number", item);
    const double x = item.get<double>();
    if (!(x > 0.0) || !std::isfinite(x))
      throw_rope_config(item_path, "value " + rope_number_text(x) + " outside (0, inf)");
    out.push_back(x);
  }
  return out;
}

inline void rope_check_at_least(const std::string& path, double value, double lo) {
  if (!(value >= lo))
    throw_rope_config(path, "value " + rope_number_text(value) + " outside [" + rope_number_text(lo) + ", inf)");
}

inline void rope_check_positive(const std::string& path, double value) {
  if (!(value > 0.0)) throw_rope_config(path, "value " + rope_number_text(value) + " outside (0, inf)");
}

// A value that may be given at the top level and in the block: both given must agree.
template <typename T>
std::optional<T> rope_one_of(const std::optional<T>& top, const std::string& top_path, const std::optional<T>& block,
                             const std::string& block_path, const std::string& shown_top,
                             const std::string& shown_block) {
  if (top && block && !(*top == *block))
    throw_rope_config(block_path, "value " + shown_block + " disagrees with " + top_path + " = " + shown_top);
  return block ? block : top;
}

// The keys transformers knows for each type (its required and optional keys, and the ones every
// type may carry).
inline const std::set<std::string>& rope_known_keys(const std::string& type) {
  static const std::set<std::string> common = {"rope_type", "type", "rope_theta", "partial_rotary_factor"};
  static const std::set<std::string> with_factor = [] {
    std::set<std::string> keys = common;
    keys.insert("factor");
    return keys;
  }();
  static const std::set<std::string> yarn = [] {
    std::set<std::string> keys = common;
    keys.insert({"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
                 "mscale_all_dim", "truncate"});
    return keys;
  }();
  static const std::set<std::string> longrope = [] {
    std::set<std::string> keys = common;
    keys.insert({"short_factor", "long_factor", "original_max_position_embeddings", "attention_factor", "factor"});
    return keys;
  }();
  static const std::set<std::string> llama3 = [] {
    std::set<std::string> keys = common;
    keys.insert({"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"});
    return keys;
  }();
  if (type == "linear" || type == "dynamic") return with_factor;
  if (type == "yarn") return yarn;
  if (type == "longrope") return longrope;
  if (type == "llama3") return llama3;
  return common;
}

// The largest head_dim the reader accepts (real models: 64 to 512), so that a corrupt value
// cannot ask for gigabytes of frequencies.
constexpr Index kRopeMaxHeadDim = Index{1} << 16;

inline RopeConfig parse_rope_config_json(const rope_json& root) {
  if (!root.is_object()) throw_rope_config("(root)", std::string("expected an object, got ") + root.type_name());
  RopeConfig config;

  // The block: rope_scaling (v4) or rope_parameters (v5).
  const rope_json* scaling = rope_json_find(root, "rope_scaling");
  const rope_json* parameters = rope_json_find(root, "rope_parameters");
  if (scaling != nullptr && !scaling->is_object())
    throw_rope_config_type("rope_scaling", "an object or null", *scaling);
  if (parameters != nullptr && !parameters->is_object())
    throw_rope_config_type("rope_parameters", "an object or null", *parameters);
  if (scaling != nullptr && parameters != nullptr && *scaling != *parameters)
    throw_rope_config("rope_parameters", "given beside rope_scaling, with other values (give one of them)");
  const rope_json empty = rope_json::object();
  const rope_json& block = scaling != nullptr ? *scaling : parameters != nullptr ? *parameters : empty;
  const std::string name = scaling != nullptr ? "rope_scaling" : "rope_parameters";
  for (auto it = block.begin(); it != block.end(); ++it)
    if (it->is_object())
      throw_rope_config(name + "." + rope_json_key(it.key()),
                        "per-layer-type RoPE parameters are not supported (one block of rope parameters expected)");

  // The type, with transformers' legacy spellings.
  const auto rope_type = rope_json_string(block, "rope_type", name + ".rope_type");
  const auto legacy_type = rope_json_string(block, "type", name + ".type");
  // transformers v4's LlamaConfig copied `type` over `rope_type`, v5 keeps `rope_type`: two
  // different values are ambiguous.
  if (rope_type && legacy_type && *rope_type != *legacy_type)
    throw_rope_config(name + ".type", "value " + rope_json_preview(rope_json(*legacy_type)) + " disagrees with " +
                                          name + ".rope_type = " + rope_json_preview(rope_json(*rope_type)));
  std::string type = rope_type ? *rope_type : legacy_type ? *legacy_type : "default";
  const auto model_type = rope_json_find(root, "model_type");
  const bool phi3 = model_type != nullptr && model_type->is_string() && model_type->get<std::string>() == "phi3";
  if (type == "su" || (!rope_type && phi3 && type == "yarn")) type = "longrope";
  if (type != "default" && type != "linear" && type != "dynamic" && type != "yarn" && type != "longrope" &&
      type != "llama3")
    throw_rope_config(name + (rope_type ? ".rope_type" : ".type"),
                      "unknown rope type " + rope_json_preview(rope_json(rope_type ? *rope_type : *legacy_type)) +
                          " (known: default, linear, dynamic, yarn, longrope, llama3; legacy: su)");
  config.rope_type = type;

  const auto& known = rope_known_keys(type);
  for (auto it = block.begin(); it != block.end(); ++it)
    if (known.count(it.key()) == 0) {
      std::string list;
      for (const auto& key : known) list += (list.empty() ? "" : ", ") + key;
      throw_rope_config(name + "." + rope_json_key(it.key()),
                        "unknown key for rope type '" + type + "' (transformers' keys for it: " + list + ")");
    }

  // rope_theta and partial_rotary_factor: top level or in the block.
  const auto theta = rope_one_of(rope_json_number(root, "rope_theta", "rope_theta"), "rope_theta",
                                 rope_json_number(block, "rope_theta", name + ".rope_theta"), name + ".rope_theta",
                                 root.contains("rope_theta") ? rope_json_preview(root["rope_theta"]) : "",
                                 block.contains("rope_theta") ? rope_json_preview(block["rope_theta"]) : "");
  if (theta) {
    const std::string path = block.contains("rope_theta") && !block["rope_theta"].is_null() ? name + ".rope_theta"
                                                                                            : "rope_theta";
    rope_check_positive(path, *theta);
    if (type == "yarn" && !(*theta > 1.0))
      throw_rope_config(path,
                        "value " + rope_number_text(*theta) + " outside (1, inf) (yarn divides by ln(rope_theta))");
    config.rope_theta = *theta;
  }
  const auto prf =
      rope_one_of(rope_json_number(root, "partial_rotary_factor", "partial_rotary_factor"), "partial_rotary_factor",
                  rope_json_number(block, "partial_rotary_factor", name + ".partial_rotary_factor"),
                  name + ".partial_rotary_factor",
                  root.contains("partial_rotary_factor") ? rope_json_preview(root["partial_rotary_factor"]) : "",
                  block.contains("partial_rotary_factor") ? rope_json_preview(block["partial_rotary_factor"]) : "");
  const std::string prf_path = block.contains("partial_rotary_factor") && !block["partial_rotary_factor"].is_null()
                                   ? name + ".partial_rotary_factor"
                                   : "partial_rotary_factor";
  if (prf) {
    if (!(*prf > 0.0 && *prf <= 1.0))
      throw_rope_config(prf_path, "value " + rope_number_text(*prf) + " outside (0, 1]");
    config.partial_rotary_factor = *prf;
  }

  // head_dim, then rotary_dim.
  if (const auto head_dim = rope_json_integer(root, "head_dim", "head_dim", 1)) {
    if (*head_dim > kRopeMaxHeadDim)
      throw_rope_config("head_dim",
                        "value " + std::to_string(*head_dim) + " outside [1, " + std::to_string(kRopeMaxHeadDim) + "]");
    config.head_dim = *head_dim;
  } else {
    const auto hidden = rope_json_integer(root, "hidden_size", "hidden_size", 1);
    const auto heads = rope_json_integer(root, "num_attention_heads", "num_attention_heads", 1);
    if (!hidden)
      throw_rope_config("hidden_size",
                        "missing (needed for head_dim = hidden_size // num_attention_heads, as head_dim is not given)");
    if (!heads)
      throw_rope_config("num_attention_heads",
                        "missing (needed for head_dim = hidden_size // num_attention_heads, as head_dim is not given)");
    config.head_dim = *hidden / *heads;
    if (config.head_dim > kRopeMaxHeadDim)
      throw_rope_config("hidden_size", "value " + std::to_string(*hidden) +
                                           " gives head_dim = hidden_size // "
                                           "num_attention_heads = " +
                                           std::to_string(config.head_dim) + " outside [1, " +
                                           std::to_string(kRopeMaxHeadDim) + "]");
    if (config.head_dim < 1)
      throw_rope_config("hidden_size", "value " + std::to_string(*hidden) +
                                           " is less than num_attention_heads = " + std::to_string(*heads) +
                                           ": head_dim = hidden_size // num_attention_heads would be 0");
  }
  const double rotary = static_cast<double>(config.head_dim) * config.partial_rotary_factor;
  config.rotary_dim = static_cast<Index>(rotary);  // truncation toward zero, as Python's int()
  const Index min_rotary = type == "dynamic" ? 4 : 2;
  if (config.rotary_dim < min_rotary || config.rotary_dim % 2 != 0)
    throw_rope_config(prf_path, "rotary_dim = int(head_dim * partial_rotary_factor) = int(" +
                                    std::to_string(config.head_dim) + " * " +
                                    rope_number_text(config.partial_rotary_factor) +
                                    ") = " + std::to_string(config.rotary_dim) + " must be even and in [" +
                                    std::to_string(min_rotary) + ", inf)");

  // Context lengths.
  config.max_position_embeddings = rope_json_integer(root, "max_position_embeddings", "max_position_embeddings", 1);
  const auto top_original = rope_json_integer(root, "original_max_position_embeddings",
                                              "original_max_position_embeddings", 1);
  const auto block_original = rope_json_integer(block, "original_max_position_embeddings",
                                                name + ".original_max_position_embeddings", 1);
  if (type == "yarn" || type == "longrope" || type == "llama3") {
    config.original_max_position_embeddings = rope_one_of(top_original, "original_max_position_embeddings",
                                                          block_original, name + ".original_max_position_embeddings",
                                                          top_original ? std::to_string(*top_original) : "",
                                                          block_original ? std::to_string(*block_original) : "");
    if (!config.original_max_position_embeddings)
      config.original_max_position_embeddings = config.max_position_embeddings;
    if (!config.original_max_position_embeddings)
      throw_rope_config(name + ".original_max_position_embeddings",
                        "missing (rope type '" + type +
                            "' needs it; neither it, a top-level original_max_position_embeddings nor "
                            "max_position_embeddings is given)");
  }

  // The type's own fields.
  const auto field = [&](const char* key) { return name + "." + key; };
  config.factor = rope_json_number(block, "factor", field("factor"));
  if (type == "linear" || type == "dynamic" || type == "yarn" || type == "llama3") {
    if (!config.factor) throw_rope_config(field("factor"), "missing (rope type '" + type + "' needs it)");
  }
  if (config.factor) rope_check_at_least(field("factor"), *config.factor, 1.0);
  if (type == "dynamic" && !config.max_position_embeddings)
    throw_rope_config("max_position_embeddings", "missing (rope type 'dynamic' needs it)");

  config.attention_factor = rope_json_number(block, "attention_factor", field("attention_factor"));
  if (config.attention_factor) rope_check_positive(field("attention_factor"), *config.attention_factor);

  if (type == "yarn") {
    config.beta_fast = rope_json_number(block, "beta_fast", field("beta_fast"));
    config.beta_slow = rope_json_number(block, "beta_slow", field("beta_slow"));
    if (config.beta_fast && *config.beta_fast == 0.0) config.beta_fast.reset();  // transformers' `or 32`
    if (config.beta_slow && *config.beta_slow == 0.0) config.beta_slow.reset();  // transformers' `or 1`
    if (config.beta_fast) rope_check_positive(field("beta_fast"), *config.beta_fast);
    if (config.beta_slow) rope_check_positive(field("beta_slow"), *config.beta_slow);
    const double fast = config.beta_fast.value_or(32.0);
    const double slow = config.beta_slow.value_or(1.0);
    if (fast < slow)
      throw_rope_config(field("beta_fast"), "value " + rope_number_text(fast) + " is less than beta_slow = " +
                                                rope_number_text(slow) + " (defaults: 32 and 1)");
    config.mscale = rope_json_number(block, "mscale", field("mscale"));
    config.mscale_all_dim = rope_json_number(block, "mscale_all_dim", field("mscale_all_dim"));
    config.truncate = rope_json_bool(block, "truncate", field("truncate"));
  }
  if (type == "longrope") {
    const auto short_factor = rope_json_numbers(block, "short_factor", field("short_factor"));
    const auto long_factor = rope_json_numbers(block, "long_factor", field("long_factor"));
    if (!short_factor) throw_rope_config(field("short_factor"), "missing (rope type 'longrope' needs it)");
    if (!long_factor) throw_rope_config(field("long_factor"), "missing (rope type 'longrope' needs it)");
    const auto check_length = [&](const char* key, const std::vector<double>& list) {
      if (static_cast<Index>(list.size()) != config.rotary_dim / 2)
        throw_rope_config(field(key), "has " + std::to_string(list.size()) + " entries, expected rotary_dim / 2 = " +
                                          std::to_string(config.rotary_dim / 2));
    };
    check_length("short_factor", *short_factor);
    check_length("long_factor", *long_factor);
    config.short_factor = *short_factor;
    config.long_factor = *long_factor;
    if (!config.factor && !config.max_position_embeddings)
      throw_rope_config("max_position_embeddings", "missing (rope type 'longrope' without " + field("factor") +
                                                       " needs it for factor = "
                                                       "max_position_embeddings / original_max_position_embeddings)");
  }
  if (type == "llama3") {
    config.low_freq_factor = rope_json_number(block, "low_freq_factor", field("low_freq_factor"));
    config.high_freq_factor = rope_json_number(block, "high_freq_factor", field("high_freq_factor"));
    if (!config.low_freq_factor) throw_rope_config(field("low_freq_factor"), "missing (rope type 'llama3' needs it)");
    if (!config.high_freq_factor) throw_rope_config(field("high_freq_factor"), "missing (rope type 'llama3' needs it)");
    rope_check_positive(field("low_freq_factor"), *config.low_freq_factor);
    if (!(*config.high_freq_factor > *config.low_freq_factor))
      throw_rope_config(field("high_freq_factor"),
                        "value " + rope_number_text(*config.high_freq_factor) +
                            " is not greater than low_freq_factor = " + rope_number_text(*config.low_freq_factor));
  }
  return config;
}

}  // namespace detail

// A RopeConfig's frequencies for a forward call over seq_len tokens (max position id + 1; 0 = at
// initialisation, as transformers' seq_len=None). Only dynamic and longrope depend on seq_len:
// dynamic gives the stateless formula (transformers' caching between calls is
// DynamicNtkRopeCache, rope_scaling.hpp), longrope the long factors when seq_len >
// original_max_position_embeddings.
// \throws value_error if a field the type needs is missing (a RopeConfig built by hand) and
// whatever the scaling function throws (rope_scaling.hpp); a config from parse_rope_config gives
// none at seq_len = 0.
inline RopeFrequencies rope_frequencies(const RopeConfig& config, Index seq_len) {
  const char* where = "rope_frequencies";
  const auto need = [&](const auto& value, const char* field) {
    if (!value) throw value_error(std::string(where) + ": rope type '" + config.rope_type + "' needs " + field);
    return *value;
  };
  const std::string& type = config.rope_type;
  if (type == "default") return rope_default_frequencies(config.rotary_dim, config.rope_theta);
  if (type == "linear")
    return rope_linear_frequencies(config.rotary_dim, config.rope_theta, need(config.factor, "factor"));
  if (type == "dynamic")
    return rope_dynamic_ntk_frequencies(config.rotary_dim, config.rope_theta, need(config.factor, "factor"),
                                        need(config.max_position_embeddings, "max_position_embeddings"), seq_len);
  if (type == "yarn") {
    YarnOptions options;
    options.factor = need(config.factor, "factor");
    options.original_max_position_embeddings = need(config.original_max_position_embeddings,
                                                    "original_max_position_embeddings");
    options.beta_fast = config.beta_fast.value_or(32.0);
    options.beta_slow = config.beta_slow.value_or(1.0);
    options.truncate = config.truncate.value_or(true);
    options.attention_factor = config.attention_factor;
    options.mscale = config.mscale;
    options.mscale_all_dim = config.mscale_all_dim;
    return rope_yarn_frequencies(config.rotary_dim, config.rope_theta, options);
  }
  if (type == "longrope") {
    LongRopeOptions options;
    options.short_factor = config.short_factor;
    options.long_factor = config.long_factor;
    options.original_max_position_embeddings = need(config.original_max_position_embeddings,
                                                    "original_max_position_embeddings");
    options.max_position_embeddings = config.factor ? config.max_position_embeddings.value_or(
                                                          options.original_max_position_embeddings)
                                                    : need(config.max_position_embeddings, "max_position_embeddings");
    options.factor = config.factor;
    options.attention_factor = config.attention_factor;
    return rope_longrope_frequencies(config.rotary_dim, config.rope_theta, options, seq_len);
  }
  if (type == "llama3") {
    Llama3Options options;
    options.factor = need(config.factor, "factor");
    options.low_freq_factor = need(config.low_freq_factor, "low_freq_factor");
    options.high_freq_factor = need(config.high_freq_factor, "high_freq_factor");
    options.original_max_position_embeddings = need(config.original_max_position_embeddings,
                                                    "original_max_position_embeddings");
    return rope_llama3_frequencies(config.rotary_dim, config.rope_theta, options);
  }
  throw value_error(std::string(where) + ": unknown rope type '" + type +
                    "' (known: default, linear, dynamic, yarn, longrope, llama3)");
}

// config.json text -> RopeConfig (see the top of this header).
// \throws format_error naming the key (e.g. "parse_rope_config: rope_scaling.factor: expected a
// number, got string \"8\""): text that is not JSON or whose root is not an object; an unknown
// rope type; a key the type does not know; a missing required field; a value of the wrong JSON
// type, out of its range, or given twice with different values; a rotary_dim that is odd or too
// small; values that the scaling function refuses (checked by computing the frequencies once).
inline RopeConfig parse_rope_config(const std::string& text) {
  detail::rope_json root;
  try {
    root = detail::rope_json::parse(text);
  } catch (const detail::rope_json::exception& e) {
    throw format_error(std::string("parse_rope_config: not valid JSON: ") + e.what());
  }
  RopeConfig config = detail::parse_rope_config_json(root);
  // The frequencies at initialisation (and LongRoPE's long regime): what the scaling functions
  // refuse beyond the reader's own checks (e.g. a subnormal rope_theta) is refused here.
  const auto check = [&](Index seq_len) {
    RopeFrequencies f;
    try {
      f = rope_frequencies(config, seq_len);
    } catch (const value_error& e) {
      throw format_error(std::string("parse_rope_config: the values give no frequencies: ") + e.what());
    }
    for (std::size_t i = 0; i < f.inv_freq.size(); ++i)
      if (!std::isfinite(f.inv_freq[i]))
        throw format_error("parse_rope_config: rope_theta: value " + detail::rope_number_text(config.rope_theta) +
                           " gives a frequency that is not finite (inv_freq[" + std::to_string(i) + "])");
  };
  check(0);
  if (config.rope_type == "longrope") check(*config.original_max_position_embeddings + 1);
  return config;
}

// As parse_rope_config, from a stream read to its end.
// \throws io_error if the stream fails before its end; format_error as parse_rope_config.
inline RopeConfig read_rope_config(std::istream& in) {
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw io_error("read_rope_config: the stream failed while reading");
  return parse_rope_config(text);
}

// As parse_rope_config, from the file at path (a regular file only: detail/files.hpp).
// \throws io_error naming the path if it cannot be opened or read; format_error as
// parse_rope_config, the message then ending in " (in '<path>')".
inline RopeConfig load_rope_config(const std::string& path) {
  const detail::InputFile file(path, "load_rope_config");
  std::string text(static_cast<std::size_t>(file.size()), '\0');
  file.read_at(0, text.data(), text.size());
  try {
    return parse_rope_config(text);
  } catch (const format_error& e) {
    throw format_error(std::string(e.what()) + " (in '" + path + "')");
  }
}

}  // namespace embedhead

#endif  // EMBEDHEAD_IO_ROPE_CONFIG_HPP
