// Tests for include/embedhead/io/rope_config.hpp: real config.json snippets (Llama 3.1, Llama 2
// with linear and dynamic scaling, Qwen2.5 and DeepSeek-V3 YaRN, Phi-3 LongRoPE under its three
// type spellings, Phi-2's partial rotary, Gemma's explicit head_dim, a transformers-v5
// rope_parameters block) read into RopeConfig, field by field, and dispatched by rope_frequencies
// to the scaling functions (whose values rope_scaling_test checks against its references); the
// three spellings of the type; reading from a stream and a file; and every error, its type and
// the key its message names.
#include <embedhead/io/rope_config.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "../reference/files.hpp"

using Catch::Contains;
using embedhead::format_error;
using embedhead::Index;
using embedhead::parse_rope_config;
using embedhead::RopeConfig;
using embedhead::RopeFrequencies;

namespace {

// A JSON list of n numbers a, a + step, ...
std::string number_list(Index n, double a, double step) {
  std::ostringstream out;
  out.precision(17);
  out << "[";
  for (Index i = 0; i < n; ++i) out << (i ? ", " : "") << a + step * static_cast<double>(i);
  out << "]";
  return out.str();
}

std::vector<double> numbers(Index n, double a, double step) {
  std::vector<double> out;
  for (Index i = 0; i < n; ++i) out.push_back(a + step * static_cast<double>(i));
  return out;
}

// Llama-3.1-8B's config.json, the keys that matter and a few that do not.
const char* const kLlama31 = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
  "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
  "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "vocab_size": 128256, "torch_dtype": "bfloat16"})";

// Phi-3-mini-128k-style: 48 factors per list, L at the top level, the type spelled three ways.
std::string phi3(const std::string& type_entry) {
  return R"({"model_type": "phi3", "hidden_size": 3072, "num_attention_heads": 32,
    "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
    "rope_scaling": {)" +
         type_entry + R"(, "short_factor": )" + number_list(48, 1.0, 0.01) + R"(, "long_factor": )" +
         number_list(48, 1.0, 0.5) + "}}";
}

std::string with_scaling(const std::string& scaling) {
  return R"({"hidden_size": 512, "num_attention_heads": 8, "max_position_embeddings": 4096, "rope_theta": 10000.0,
    "rope_scaling": )" +
         scaling + "}";
}

void require_same(const RopeFrequencies& a, const RopeFrequencies& b) {
  REQUIRE(a.inv_freq == b.inv_freq);
  REQUIRE(a.attention_factor == b.attention_factor);
}

}  // namespace

TEST_CASE("rope_config: Llama 3.1", "[rope_config]") {
  const RopeConfig c = parse_rope_config(kLlama31);
  REQUIRE(c.rope_type == "llama3");
  REQUIRE(c.rope_theta == 500000.0);
  REQUIRE(c.head_dim == 128);
  REQUIRE(c.rotary_dim == 128);
  REQUIRE(c.max_position_embeddings == Index{131072});
  REQUIRE(c.original_max_position_embeddings == Index{8192});
  REQUIRE(c.factor == 8.0);
  REQUIRE(c.low_freq_factor == 1.0);
  REQUIRE(c.high_freq_factor == 4.0);
  embedhead::Llama3Options options;  // Llama 3.1's values are the defaults
  require_same(embedhead::rope_frequencies(c, 0), embedhead::rope_llama3_frequencies(128, 500000.0, options));
  // Llama 3.2 1B: factor 32 is read, not assumed.
  std::string text = kLlama31;
  text.replace(text.find("\"factor\": 8.0"), 13, "\"factor\": 32");
  REQUIRE(parse_rope_config(text).factor == 32.0);
}

TEST_CASE("rope_config: the three spellings of the type", "[rope_config]") {
  // rope_scaling.rope_type, the legacy rope_scaling.type, and v5's rope_parameters (which carries
  // rope_theta and partial_rotary_factor itself) give the same configuration.
  const RopeConfig a = parse_rope_config(R"({"head_dim": 64, "max_position_embeddings": 2048, "rope_theta": 50000,
      "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})");
  const RopeConfig b = parse_rope_config(R"({"head_dim": 64, "max_position_embeddings": 2048, "rope_theta": 50000,
      "rope_scaling": {"type": "dynamic", "factor": 2.0}})");
  const RopeConfig c = parse_rope_config(R"({"head_dim": 64, "max_position_embeddings": 2048,
      "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 50000}})");
  for (const RopeConfig* config : {&a, &b, &c}) {
    REQUIRE(config->rope_type == "dynamic");
    REQUIRE(config->rope_theta == 50000.0);
    REQUIRE(config->rotary_dim == 64);
    REQUIRE(config->factor == 2.0);
    require_same(embedhead::rope_frequencies(*config, 5000),
                 embedhead::rope_dynamic_ntk_frequencies(64, 50000.0, 2.0, 2048, 5000));
  }
  // Both, agreeing (some converted configs carry both).
  REQUIRE(parse_rope_config(with_scaling(R"({"rope_type": "linear", "type": "linear", "factor": 2})")).rope_type ==
          "linear");
  // Both blocks, equal: fine.
  REQUIRE(parse_rope_config(R"({"head_dim": 8, "rope_scaling": {"type": "linear", "factor": 2},
      "rope_parameters": {"type": "linear", "factor": 2}})")
              .rope_type == "linear");
}

TEST_CASE("rope_config: every type", "[rope_config]") {
  SECTION("default: no block, a null block, an empty block, an explicit default") {
    for (
        const char* text :
        {R"({"hidden_size": 768, "num_attention_heads": 12})",
         R"({"hidden_size": 768, "num_attention_heads": 12, "rope_scaling": null, "rope_theta": null})",
         R"({"hidden_size": 768, "num_attention_heads": 12, "rope_scaling": {}})",
         R"({"hidden_size": 768, "num_attention_heads": 12, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})"}) {
      INFO(text);
      const RopeConfig c = parse_rope_config(text);
      REQUIRE(c.rope_type == "default");
      REQUIRE(c.rope_theta == 10000.0);  // transformers' default_theta
      REQUIRE(c.rotary_dim == 64);
      require_same(embedhead::rope_frequencies(c, 0), embedhead::rope_default_frequencies(64, 10000.0));
    }
  }
  SECTION("linear (Llama 2 long-context fine-tunes)") {
    const RopeConfig c = parse_rope_config(with_scaling(R"({"type": "linear", "factor": 4.0})"));
    REQUIRE(c.rope_type == "linear");
    require_same(embedhead::rope_frequencies(c, 0), embedhead::rope_linear_frequencies(64, 10000.0, 4.0));
  }
  SECTION("dynamic") {
    const RopeConfig c = parse_rope_config(with_scaling(R"({"type": "dynamic", "factor": 2})"));
    require_same(embedhead::rope_frequencies(c, 0), embedhead::rope_default_frequencies(64, 10000.0));
    require_same(embedhead::rope_frequencies(c, 10000),
                 embedhead::rope_dynamic_ntk_frequencies(64, 10000.0, 2.0, 4096, 10000));
  }
  SECTION("yarn, Qwen2.5 style (legacy type, L in the block)") {
    const RopeConfig c = parse_rope_config(R"({"model_type": "qwen2", "hidden_size": 5120, "num_attention_heads": 40,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0,
        "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}})");
    REQUIRE(c.rope_type == "yarn");
    REQUIRE(c.rotary_dim == 128);
    REQUIRE(c.original_max_position_embeddings == Index{32768});
    REQUIRE_FALSE(c.beta_fast);
    REQUIRE_FALSE(c.truncate);
    embedhead::YarnOptions options;
    options.factor = 4.0;
    options.original_max_position_embeddings = 32768;
    const RopeFrequencies f = embedhead::rope_frequencies(c, 0);
    require_same(f, embedhead::rope_yarn_frequencies(128, 1.0e6, options));
    REQUIRE_THAT(f.attention_factor, Catch::Matchers::WithinRel(0.1 * std::log(4.0) + 1.0, 1e-15));
  }
  SECTION("yarn, DeepSeek-V3 style (mscale, betas, explicit head_dim) and truncate") {
    const RopeConfig c = parse_rope_config(R"({"model_type": "deepseek_v3", "head_dim": 64,
        "max_position_embeddings": 163840, "rope_theta": 10000,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn", "truncate": false}})");
    REQUIRE(c.mscale == 1.0);
    REQUIRE(c.mscale_all_dim == 1.0);
    REQUIRE(c.truncate == false);
    embedhead::YarnOptions options;
    options.factor = 40.0;
    options.original_max_position_embeddings = 4096;
    options.mscale = 1.0;
    options.mscale_all_dim = 1.0;
    options.truncate = false;
    const RopeFrequencies f = embedhead::rope_frequencies(c, 0);
    require_same(f, embedhead::rope_yarn_frequencies(64, 10000.0, options));
    REQUIRE(f.attention_factor == 1.0);
  }
  SECTION("yarn: L defaults to max_position_embeddings; betas of 0 are transformers' defaults") {
    const RopeConfig c = parse_rope_config(
        with_scaling(R"({"rope_type": "yarn", "factor": 2, "beta_fast": 0, "beta_slow": null})"));
    REQUIRE(c.original_max_position_embeddings == Index{4096});
    REQUIRE_FALSE(c.beta_fast);
    REQUIRE_FALSE(c.beta_slow);
  }
  SECTION("longrope: Phi-3 under \"longrope\", the legacy \"su\", and Phi3Config's \"yarn\"") {
    for (const char* entry :
         {R"("type": "longrope")", R"("rope_type": "longrope")", R"("type": "su")", R"("type": "yarn")"}) {
      INFO(entry);
      const RopeConfig c = parse_rope_config(phi3(entry));
      REQUIRE(c.rope_type == "longrope");
      REQUIRE(c.rotary_dim == 96);
      REQUIRE(c.original_max_position_embeddings == Index{4096});
      REQUIRE(c.short_factor == numbers(48, 1.0, 0.01));
      REQUIRE(c.long_factor == numbers(48, 1.0, 0.5));
      embedhead::LongRopeOptions options;
      options.short_factor = numbers(48, 1.0, 0.01);
      options.long_factor = numbers(48, 1.0, 0.5);
      options.original_max_position_embeddings = 4096;
      options.max_position_embeddings = 131072;
      for (const Index n : {Index{0}, Index{4096}, Index{4097}, Index{131072}}) {
        const RopeFrequencies f = embedhead::rope_frequencies(c, n);
        require_same(f, embedhead::rope_longrope_frequencies(96, 10000.0, options, n));
        REQUIRE_THAT(f.attention_factor, Catch::Matchers::WithinRel(std::sqrt(17.0 / 12.0), 1e-15));
      }
      REQUIRE(embedhead::rope_frequencies(c, 4097).inv_freq != embedhead::rope_frequencies(c, 4096).inv_freq);
    }
    // "yarn" means YaRN outside Phi-3 (it then needs a factor and knows no short_factor).
    std::string other = phi3(R"("type": "yarn")");
    other.replace(other.find("\"phi3\""), 6, "\"llama\"");
    REQUIRE_THROWS_WITH(parse_rope_config(other),
                        Contains("rope_scaling.long_factor: unknown key for rope type 'yarn'"));
  }
  SECTION("partial rotary (Phi-2: 80 * 0.4 = 32; GPT-NeoX-style 0.25) and its truncation") {
    const RopeConfig phi2 = parse_rope_config(
        R"({"model_type": "phi", "hidden_size": 2560, "num_attention_heads": 32, "partial_rotary_factor": 0.4})");
    REQUIRE(phi2.head_dim == 80);
    REQUIRE(phi2.rotary_dim == 32);
    require_same(embedhead::rope_frequencies(phi2, 0), embedhead::rope_default_frequencies(32, 10000.0));
    REQUIRE(parse_rope_config(R"({"head_dim": 128, "partial_rotary_factor": 0.25})").rotary_dim == 32);
    // int(100 * 0.33) = int(33.0) = 33 is odd; int(100 * 0.335) = int(33.5) = 33 too; 0.345 -> 34.
    REQUIRE(parse_rope_config(R"({"head_dim": 100, "partial_rotary_factor": 0.345})").rotary_dim == 34);
    REQUIRE_THROWS_WITH(parse_rope_config(R"({"head_dim": 100, "partial_rotary_factor": 0.335})"),
                        Contains("parse_rope_config: partial_rotary_factor: rotary_dim = int(head_dim * "
                                 "partial_rotary_factor) = int(100 * 0.33500000000000002) = 33 must be even"));
    // In v5's block, and the same value at the top level too.
    REQUIRE(parse_rope_config(R"({"head_dim": 128, "partial_rotary_factor": 0.5,
        "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}})")
                .rotary_dim == 64);
  }
  SECTION("head_dim: explicit (Gemma: 256 with hidden_size 3072 and 16 heads), null, or derived with //") {
    REQUIRE(parse_rope_config(R"({"hidden_size": 3072, "num_attention_heads": 16, "head_dim": 256})").head_dim == 256);
    REQUIRE(parse_rope_config(R"({"hidden_size": 3072, "num_attention_heads": 16, "head_dim": null})").head_dim == 192);
    REQUIRE(parse_rope_config(R"({"hidden_size": 98, "num_attention_heads": 3})").head_dim == 32);  // 98 // 3
    REQUIRE(parse_rope_config(R"({"head_dim": 128.0})").head_dim == 128);  // an integral number is an integer
    REQUIRE(parse_rope_config(R"({"head_dim": 64, "max_position_embeddings": 2048, "rope_scaling": {"type": "yarn",
        "factor": 2, "original_max_position_embeddings": 1e3}})")
                .original_max_position_embeddings == Index{1000});
  }
}

TEST_CASE("rope_config: from a stream and from a file", "[rope_config]") {
  std::istringstream in(kLlama31);
  REQUIRE(embedhead::read_rope_config(in).rope_type == "llama3");
  const std::string path = test_support::temp_path("rope_config_test", "config.json");
  test_support::write_bytes(path, kLlama31);
  REQUIRE(embedhead::load_rope_config(path).factor == 8.0);
  test_support::write_bytes(path, with_scaling(R"({"type": "linear", "factor": "4"})"));
  REQUIRE_THROWS_AS(embedhead::load_rope_config(path), format_error);
  REQUIRE_THROWS_WITH(embedhead::load_rope_config(path),
                      Contains("rope_scaling.factor: expected a number, got string \"4\"") &&
                          Contains("(in '" + path + "')"));
  std::remove(path.c_str());
  REQUIRE_THROWS_AS(embedhead::load_rope_config(path), embedhead::io_error);
  REQUIRE_THROWS_WITH(embedhead::load_rope_config(path), Contains("load_rope_config: cannot open '" + path + "'"));
}

TEST_CASE("rope_config: every error is a format_error naming the key", "[rope_config][errors]") {
  const auto fails = [](const std::string& text, const std::string& message) {
    INFO(text);
    REQUIRE_THROWS_AS(parse_rope_config(text), format_error);
    REQUIRE_THROWS_WITH(parse_rope_config(text), Contains("parse_rope_config: ") && Contains(message));
  };
  // Not a config.
  fails("{\"head_dim\": 64,", "not valid JSON");
  fails("[1, 2]", "(root): expected an object, got array");
  // Unknown types, never a fallback.
  fails(with_scaling(R"({"rope_type": "ntk", "factor": 2})"), "rope_scaling.rope_type: unknown rope type \"ntk\"");
  fails(with_scaling(R"({"type": "mrope", "mrope_section": [16, 24, 24]})"),
        "rope_scaling.type: unknown rope type \"mrope\"");
  fails(with_scaling(R"({"type": "LINEAR", "factor": 2})"), "rope_scaling.type: unknown rope type \"LINEAR\"");
  fails(with_scaling(R"({"rope_type": 3})"), "rope_scaling.rope_type: expected a string, got number 3");
  fails(with_scaling(R"({"rope_type": "linear", "type": "dynamic", "factor": 2})"),
        "rope_scaling.type: value \"dynamic\" disagrees with rope_scaling.rope_type = \"linear\"");
  // Missing required fields.
  fails(with_scaling(R"({"type": "linear"})"), "rope_scaling.factor: missing (rope type 'linear' needs it)");
  fails(with_scaling(R"({"type": "dynamic", "factor": null})"),
        "rope_scaling.factor: missing (rope type 'dynamic' needs it)");
  fails(with_scaling(R"({"type": "yarn"})"), "rope_scaling.factor: missing (rope type 'yarn' needs it)");
  fails(with_scaling(R"({"rope_type": "llama3", "factor": 8, "high_freq_factor": 4})"),
        "rope_scaling.low_freq_factor: missing (rope type 'llama3' needs it)");
  fails(with_scaling(R"({"rope_type": "llama3", "factor": 8, "low_freq_factor": 1})"),
        "rope_scaling.high_freq_factor: missing (rope type 'llama3' needs it)");
  fails(with_scaling(R"({"type": "longrope", "short_factor": )" + number_list(32, 1, 0) + "}"),
        "rope_scaling.long_factor: missing (rope type 'longrope' needs it)");
  fails(R"({"head_dim": 64, "rope_scaling": {"type": "dynamic", "factor": 2}})",
        "max_position_embeddings: missing (rope type 'dynamic' needs it)");
  fails(R"({"head_dim": 64, "rope_scaling": {"type": "yarn", "factor": 2}})",
        "rope_scaling.original_max_position_embeddings: missing (rope type 'yarn' needs it");
  fails(R"({"head_dim": 8, "original_max_position_embeddings": 10, "rope_scaling": {"type": "longrope",
        "short_factor": [1, 1, 1, 1], "long_factor": [1, 1, 1, 1]}})",
        "max_position_embeddings: missing (rope type 'longrope' without rope_scaling.factor needs it");
  fails(R"({"num_attention_heads": 8})", "hidden_size: missing");
  fails(R"({"hidden_size": 512})", "num_attention_heads: missing");
  // Ill-typed fields.
  fails(with_scaling(R"({"type": "linear", "factor": "8"})"),
        "rope_scaling.factor: expected a number, got string \"8\"");
  fails(with_scaling(R"({"type": "linear", "factor": true})"),
        "rope_scaling.factor: expected a number, got boolean true");
  fails(with_scaling(R"({"type": "yarn", "factor": 2, "truncate": 1})"),
        "rope_scaling.truncate: expected true or false, got number 1");
  fails(with_scaling(R"({"type": "yarn", "factor": 2, "beta_fast": [32]})"),
        "rope_scaling.beta_fast: expected a number, got array [32]");
  fails(with_scaling(R"({"type": "longrope", "short_factor": 1.0, "long_factor": 1.0})"),
        "rope_scaling.short_factor: expected a list of numbers, got number 1.0");
  fails(with_scaling(R"({"type": "longrope", "short_factor": )" + number_list(31, 1, 0) +
                     R"(, "long_factor": [1, "x"]})"),
        "rope_scaling.long_factor[1]: expected a number, got string \"x\"");
  fails(R"({"head_dim": -64})", "head_dim: value -64 outside [1, 9007199254740992]");
  fails(R"({"head_dim": 0})", "head_dim: value 0 outside [1, ");
  fails(R"({"head_dim": 64.5})", "head_dim: expected an integer, got 64.5");
  fails(R"({"head_dim": "64"})", "head_dim: expected an integer, got string \"64\"");
  fails(R"({"head_dim": 18446744073709551615})", "head_dim: value 18446744073709551615 outside [1, ");
  fails(R"({"head_dim": 64, "max_position_embeddings": -1})", "max_position_embeddings: value -1 outside [1, ");
  fails(R"({"head_dim": 64, "rope_theta": "10000"})", "rope_theta: expected a number, got string \"10000\"");
  fails(R"({"head_dim": 64, "rope_scaling": "linear"})",
        "rope_scaling: expected an object or null, got string \"linear\"");
  fails(R"({"head_dim": 64, "rope_parameters": [1]})", "rope_parameters: expected an object or null, got array [1]");
  // Out of range.
  fails(with_scaling(R"({"type": "linear", "factor": 0.5})"), "rope_scaling.factor: value 0.5 outside [1, inf)");
  fails(with_scaling(R"({"type": "dynamic", "factor": -2})"), "rope_scaling.factor: value -2 outside [1, inf)");
  fails(R"({"head_dim": 64, "rope_theta": 0})", "rope_theta: value 0 outside (0, inf)");
  fails(
      R"({"head_dim": 64, "rope_theta": 1, "max_position_embeddings": 64, "rope_scaling": {"type": "yarn", "factor": 2}})",
      "rope_theta: value 1 outside (1, inf) (yarn divides by ln(rope_theta))");
  fails(R"({"head_dim": 64, "partial_rotary_factor": 0})", "partial_rotary_factor: value 0 outside (0, 1]");
  fails(R"({"head_dim": 64, "partial_rotary_factor": 1.5})", "partial_rotary_factor: value 1.5 outside (0, 1]");
  fails(R"({"head_dim": 63})",
        "partial_rotary_factor: rotary_dim = int(head_dim * partial_rotary_factor) = int(63 * 1) = 63 must be even and "
        "in [2, inf)");
  fails(R"({"head_dim": 2, "max_position_embeddings": 64, "rope_scaling": {"type": "dynamic", "factor": 2}})",
        "= 2 must be even and in [4, inf)");
  fails(R"({"hidden_size": 4, "num_attention_heads": 8})", "hidden_size: value 4 is less than num_attention_heads = 8");
  fails(R"({"head_dim": 65537})", "head_dim: value 65537 outside [1, 65536]");
  fails(R"({"hidden_size": 1048576, "num_attention_heads": 1})",
        "hidden_size: value 1048576 gives head_dim = hidden_size // num_attention_heads = 1048576 outside [1, 65536]");
  fails(R"({"head_dim": 256, "rope_theta": 5e-324})",
        "rope_theta: value 4.9406564584124654e-324 gives a frequency that is not finite (inv_freq[123])");
  fails(R"({"head_dim": 8, "max_position_embeddings": 4096, "original_max_position_embeddings": 64,
        "rope_scaling": {"type": "longrope", "short_factor": [1, 1, 1, 1], "long_factor": [1, 5e-324, 1, 1]}})",
        "the values give no frequencies: rope_longrope_frequencies: inv_freq[1] = inf is not finite");
  fails(with_scaling(R"({"type": "yarn", "factor": 2, "attention_factor": 0})"),
        "rope_scaling.attention_factor: value 0 outside (0, inf)");
  fails(with_scaling(R"({"type": "yarn", "factor": 2, "beta_fast": -1})"),
        "rope_scaling.beta_fast: value -1 outside (0, inf)");
  fails(with_scaling(R"({"type": "yarn", "factor": 2, "beta_fast": 1, "beta_slow": 2})"),
        "rope_scaling.beta_fast: value 1 is less than beta_slow = 2");
  fails(with_scaling(R"({"type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 4})"),
        "rope_scaling.high_freq_factor: value 4 is not greater than low_freq_factor = 4");
  fails(with_scaling(R"({"type": "llama3", "factor": 8, "low_freq_factor": 0, "high_freq_factor": 4})"),
        "rope_scaling.low_freq_factor: value 0 outside (0, inf)");
  fails(with_scaling(R"({"type": "longrope", "short_factor": )" + number_list(31, 1, 0) + R"(, "long_factor": )" +
                     number_list(32, 1, 0) + "}"),
        "rope_scaling.short_factor: has 31 entries, expected rotary_dim / 2 = 32");
  fails(with_scaling(R"({"type": "longrope", "short_factor": )" + number_list(32, 1, 0) + R"(, "long_factor": [1, 0])" +
                     "}"),
        "rope_scaling.long_factor[1]: value 0 outside (0, inf)");
  fails(R"({"head_dim": 8, "max_position_embeddings": 4096, "original_max_position_embeddings": 1,
        "rope_scaling": {"type": "longrope", "short_factor": [1, 1, 1, 1], "long_factor": [1, 1, 1, 1]}})",
        "the values give no frequencies: rope_longrope_frequencies: original_max_position_embeddings");
  // Unknown keys where transformers flags them, and per-layer blocks.
  fails(with_scaling(R"({"type": "linear", "factor": 2, "original_max_position_embeddings": 2048})"),
        "rope_scaling.original_max_position_embeddings: unknown key for rope type 'linear'");
  fails(with_scaling(R"({"type": "longrope", "short_factor": [1], "long_factor": [1], "long_mscale": 1.2})"),
        "rope_scaling.long_mscale: unknown key for rope type 'longrope'");
  fails(with_scaling(R"({"factor": 2})"), "rope_scaling.factor: unknown key for rope type 'default'");
  fails(with_scaling(R"({"type": "linear", "factor": 2, "a b": 1})"), "rope_scaling.\"a b\": unknown key");
  fails(R"({"head_dim": 64, "rope_parameters": {"full_attention": {"rope_type": "default"},
        "sliding_attention": {"rope_type": "default"}}})",
        "rope_parameters.full_attention: per-layer-type RoPE parameters are not supported");
  // The same value given twice, differently.
  fails(R"({"head_dim": 64, "rope_theta": 10000, "rope_parameters": {"rope_type": "default", "rope_theta": 500000}})",
        "rope_parameters.rope_theta: value 500000 disagrees with rope_theta = 10000");
  fails(R"({"head_dim": 64, "partial_rotary_factor": 0.5, "rope_parameters": {"partial_rotary_factor": 0.25}})",
        "rope_parameters.partial_rotary_factor: value 0.25 disagrees with partial_rotary_factor = 0.5");
  fails(R"({"head_dim": 64, "original_max_position_embeddings": 4096, "rope_scaling": {"type": "yarn", "factor": 2,
        "original_max_position_embeddings": 8192}})",
        "rope_scaling.original_max_position_embeddings: value 8192 disagrees with original_max_position_embeddings = "
        "4096");
  fails(
      R"({"head_dim": 64, "rope_scaling": {"type": "linear", "factor": 2}, "rope_parameters": {"type": "linear", "factor": 4}})",
      "rope_parameters: given beside rope_scaling, with other values");
}

TEST_CASE("rope_config: rope_frequencies on a hand-built config names what is missing", "[rope_config][errors]") {
  RopeConfig c;
  c.rotary_dim = 64;
  c.rope_type = "linear";
  REQUIRE_THROWS_AS(embedhead::rope_frequencies(c, 0), embedhead::value_error);
  REQUIRE_THROWS_WITH(embedhead::rope_frequencies(c, 0), Contains("rope_frequencies: rope type 'linear' needs factor"));
  c.rope_type = "nope";
  REQUIRE_THROWS_WITH(embedhead::rope_frequencies(c, 0), Contains("rope_frequencies: unknown rope type 'nope'"));
}

TEST_CASE("rope_config: the inputs of fuzz/corpus/rope_config/crash-review-* are refused", "[rope_config][fuzz]") {
  // Each once gave a finding in rope_config_fuzz (see fuzz/README.md): an allocation of 2^55
  // bytes, or frequencies that were not finite.
  const auto refused = [](const std::string& text, const std::string& message) {
    INFO(text);
    REQUIRE_THROWS_WITH(parse_rope_config(text), Contains(message));
  };
  refused(R"({"head_dim": 9007199254740992})", "head_dim: value 9007199254740992 outside [1, 65536]");
  refused(R"({"head_dim": 256, "rope_theta": 5e-324})", "rope_theta: value 4.9406564584124654e-324 gives a frequency");
  refused(R"({"head_dim": 8, "max_position_embeddings": 4096, "original_max_position_embeddings": 64, "rope_scaling":
      {"type": "longrope", "short_factor": [1, 1, 1, 1], "long_factor": [1, 5e-324, 1, 1]}})",
          "rope_longrope_frequencies: inv_freq[1] = inf is not finite");
  // Dynamic NTK with factor 1e17 and M = 1: at n <= M the base is exact (it was 0 by cancellation).
  const RopeConfig c = parse_rope_config(
      R"({"head_dim": 8, "max_position_embeddings": 1, "rope_scaling": {"type": "dynamic", "factor": 1e17}})");
  require_same(embedhead::rope_frequencies(c, 0), embedhead::rope_default_frequencies(8, 10000.0));
}
