// Interoperability with numpy, both ways (label `python`). tests/python/safetensors_fixture.py
// (numpy only, its own safetensors writer and reader written from the specification) generates
// files into $EMBEDHEAD_INTEROP_DIR/py before this test runs (a ctest fixture); here each tensor
// is read with SafetensorsFile and from_pretrained and compared bit for bit with the values numpy
// decoded (.npy sidecars, read with load_npy), and numpy.save's files are read with load_npy.
// The last test case writes checkpoints (F32, F16, BF16), a double table rounded to BF16 / F16 /
// F32 and .npy files into $EMBEDHEAD_INTEROP_DIR/cpp, which the script's `check` step then reads
// and compares with its own rounding of the sources.
#include <embedhead/io/checkpoint.hpp>
#include <embedhead/io/npy.hpp>
#include <embedhead/io/safetensors.hpp>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

using Catch::Matchers::Contains;
using embedhead::DType;
using embedhead::Index;
using embedhead::RowMatrix;
using embedhead::SafetensorsFile;

namespace {

std::string interop_dir() {
  const char* dir = std::getenv("EMBEDHEAD_INTEROP_DIR");
  if (!dir || !*dir)
    FAIL(
        "EMBEDHEAD_INTEROP_DIR is not set: run through ctest (tests python_fixture_generate -> python_interop_test), "
        "or run tests/python/safetensors_fixture.py generate <dir> and set it to <dir>");
  return dir;
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  REQUIRE(in.good());
  return nlohmann::json::parse(in);
}

// The first element whose bits differ (NaN payloads included), as "(r, c): got vs want", or "".
template <typename Scalar>
std::string bit_difference(const RowMatrix<Scalar>& got, const RowMatrix<Scalar>& want) {
  if (got.rows() != want.rows() || got.cols() != want.cols()) {
    std::ostringstream s;
    s << "shape [" << got.rows() << ", " << got.cols() << "] vs [" << want.rows() << ", " << want.cols() << "]";
    return s.str();
  }
  for (Index r = 0; r < got.rows(); ++r)
    for (Index c = 0; c < got.cols(); ++c)
      if (std::memcmp(&got(r, c), &want(r, c), sizeof(Scalar)) != 0) {
        std::ostringstream s;
        s.precision(17);
        s << "(" << r << ", " << c << "): " << got(r, c) << " vs " << want(r, c);
        return s.str();
      }
  return "";
}

// (k - 7) * 0.375 at flat index k: the pattern numpy_pattern() writes, exact in float and double.
template <typename Scalar>
RowMatrix<Scalar> pattern(Index rows, Index cols) {
  RowMatrix<Scalar> m(rows, cols);
  for (Index k = 0; k < rows * cols; ++k)
    m(k / cols, k % cols) = static_cast<Scalar>((static_cast<double>(k) - 7) * 0.375);
  return m;
}

}  // namespace

TEST_CASE("python fixtures: every tensor reads bit-exactly as numpy decoded it", "[python][safetensors]") {
  const std::string py = interop_dir() + "/py/";
  const nlohmann::json manifest = read_json(py + "manifest.json");
  std::set<std::string> dtypes;
  std::size_t count = 0;
  for (const auto& entry : manifest.at("tensors")) {
    const std::string file = entry.at("file"), name = entry.at("tensor");
    INFO(file << " / " << name << " (" << entry.at("dtype").get<std::string>() << ")");
    const SafetensorsFile st = SafetensorsFile::open(py + file);
    const embedhead::TensorInfo& t = st.at(name);
    CHECK(embedhead::dtype_name(t.dtype) == entry.at("dtype").get<std::string>());
    CHECK(t.shape == entry.at("shape").get<std::vector<std::uint64_t>>());

    // float: exact for F32/F16/BF16, float64 -> float32 rounded to nearest-even for F64; an F64
    // tensor with a finite value beyond float's range is refused, naming the first one.
    if (entry.contains("float_refused")) {
      CHECK_THROWS_AS(st.read<float>(name), embedhead::format_error);
      CHECK_THROWS_WITH(st.read<float>(name), Catch::Contains(entry.at("float_refused").get<std::string>()));
    } else {
      const RowMatrix<float> want_f = embedhead::load_npy<float>(py + entry.at("f32").get<std::string>());
      const RowMatrix<float> got_f = st.read<float>(name);
      CHECK(bit_difference(got_f, want_f) == "");
    }
    // double: exact for every dtype.
    const RowMatrix<double> want_d = embedhead::load_npy<double>(py + entry.at("f64").get<std::string>());
    const RowMatrix<double> got_d = st.read<double>(name);
    CHECK(bit_difference(got_d, want_d) == "");
    CHECK(got_d.rows() == entry.at("rows").get<Index>());
    CHECK(got_d.cols() == entry.at("cols").get<Index>());

    // first_non_finite agrees with numpy's view of the same values.
    std::int64_t first_bad = -1;
    for (Index k = 0; k < want_d.size() && first_bad < 0; ++k)
      if (!std::isfinite(want_d.data()[k])) first_bad = k;
    CHECK(st.first_non_finite(t) == first_bad);
    dtypes.insert(entry.at("dtype").get<std::string>());
    ++count;
  }
  CHECK(count >= 14);
  CHECK(dtypes == std::set<std::string>{"F32", "F64", "F16", "BF16"});
}

TEST_CASE("python fixtures: from_pretrained builds GPT-2 (tied) and Llama (untied) layers with numpy's values",
          "[python][checkpoint]") {
  const std::string py = interop_dir() + "/py/";
  const nlohmann::json manifest = read_json(py + "manifest.json");
  const auto sidecar = [&](const std::string& file, const std::string& tensor) {
    return py + file.substr(0, file.size() - std::string(".safetensors").size()) + "__" + tensor + ".f32.npy";
  };
  std::size_t gpt2 = 0, llama = 0;
  for (const auto& entry : manifest.at("pretrained")) {
    const std::string file = entry.at("file");
    INFO(file);
    const SafetensorsFile st = SafetensorsFile::open(py + file);
    const embedhead::ModelFamily family = embedhead::guess_model_family(st);
    CHECK(embedhead::model_family_name(family) == entry.at("family").get<std::string>());
    const auto layers = embedhead::from_pretrained<float>(st, embedhead::hugging_face_names(family, &st));
    CHECK(layers.tied == entry.at("tied").get<bool>());
    CHECK(bit_difference<float>(layers.token_embedding.weight().value(),
                                embedhead::load_npy<float>(sidecar(file, entry.at("table")))) == "");
    if (layers.tied) {
      CHECK(layers.head.weight_ptr() == layers.token_embedding.weight_ptr());
    } else {
      CHECK(bit_difference<float>(layers.head.weight().value(),
                                  embedhead::load_npy<float>(sidecar(file, entry.at("head")))) == "");
    }
    if (entry.contains("positions")) {
      REQUIRE(layers.position_embedding.has_value());
      CHECK(bit_difference<float>(layers.position_embedding->weight().value(),
                                  embedhead::load_npy<float>(sidecar(file, entry.at("positions")))) == "");
    } else {
      CHECK_FALSE(layers.position_embedding.has_value());
    }
    (family == embedhead::ModelFamily::gpt2 ? gpt2 : llama) += 1;
  }
  CHECK(gpt2 >= 1);
  CHECK(llama >= 2);
}

TEST_CASE("python fixtures: numpy.save files load with load_npy, or are refused naming why", "[python][npy]") {
  const std::string py = interop_dir() + "/py/";
  const nlohmann::json manifest = read_json(py + "manifest.json");
  std::size_t accepted = 0, refused = 0;
  for (const auto& entry : manifest.at("npy")) {
    const std::string path = py + entry.at("file").get<std::string>();
    INFO(path);
    if (entry.at("ok").get<bool>()) {
      const Index rows = entry.at("rows"), cols = entry.at("cols");
      CHECK(bit_difference(embedhead::load_npy<double>(path), pattern<double>(rows, cols)) == "");
      CHECK(bit_difference(embedhead::load_npy<float>(path), pattern<float>(rows, cols)) == "");
      ++accepted;
    } else {
      RowMatrix<double> untouched = RowMatrix<double>::Constant(2, 2, 5.0);
      CHECK_THROWS_AS(embedhead::load_npy<double>(path), embedhead::format_error);
      CHECK_THROWS_WITH(embedhead::load_npy(path, untouched),
                        Contains(entry.at("reason").get<std::string>()) && Contains(path));
      CHECK((untouched.array() == 5.0).all());
      ++refused;
    }
  }
  CHECK(accepted >= 4);
  CHECK(refused >= 6);
}

TEST_CASE("C++ writes checkpoints, a double table and .npy files for numpy to check", "[python][checkpoint][npy]") {
  const std::string cpp = interop_dir() + "/cpp/";
  nlohmann::json written = {{"checkpoints", nlohmann::json::array()},
                            {"from_double", nlohmann::json::array()},
                            {"npy", nlohmann::json::array()}};

  // Llama layout, untied head with a bias, values that stress each 16-bit rounding: float32
  // values halfway between two bf16 values (both parities), halfway between two halves, half
  // subnormals, and values just below half's overflow boundary (65520) and near bf16's largest.
  // The F16 file has -65519.998 where the others have 3e38, which F16 cannot hold (a value_error
  // since issue 15, where numpy would store +inf).
  const Index V = 9, d = 5;
  embedhead::TokenEmbeddingOptions table_options;
  table_options.seed = 11;
  embedhead::TokenEmbedding<float> table(V, d, table_options);
  embedhead::OutputProjectionOptions head_options;
  head_options.seed = 12;
  head_options.bias = true;
  embedhead::OutputProjection<float> head(V, d, head_options);
  head.bias()->value() = RowMatrix<float>::Random(V, 1);
  auto E = table.weight().value();  // a Map onto the parameter
  const float specials[] = {1.0f + std::ldexp(1.0f, -8),
                            1.0f + std::ldexp(3.0f, -8),
                            -(1.0f + std::ldexp(1.0f, -8)),
                            1.0f + std::ldexp(1.0f, -11),
                            1.0f + std::ldexp(3.0f, -11),
                            6.0e-8f,
                            -3.0e-5f,
                            65519.998f,
                            65519.0f,
                            -0.0f,
                            1.0e-40f,
                            3.0e38f};
  for (std::size_t i = 0; i < sizeof(specials) / sizeof(specials[0]); ++i) E.data()[i] = specials[i];
  embedhead::save_npy(cpp + "llama_table.npy", E);
  embedhead::save_npy(cpp + "llama_head.npy", head.weight().value());
  embedhead::save_npy(cpp + "llama_bias.npy", head.bias()->value());
  auto E_half = std::make_shared<embedhead::Parameter<float>>(V, d, "token_embedding.weight");
  E_half->value() = E;
  E_half->value().data()[11] = -65519.998f;  // instead of 3e38
  embedhead::TokenEmbedding<float> table_half(E_half);
  embedhead::save_npy(cpp + "llama_table_f16.npy", E_half->value());
  const auto llama = embedhead::hugging_face_names(embedhead::ModelFamily::llama);
  for (const auto& [dtype, suffix] :
       {std::pair{DType::F32, "f32"}, std::pair{DType::F16, "f16"}, std::pair{DType::BF16, "bf16"}}) {
    const std::string file = std::string("ckpt_llama_") + suffix + ".safetensors";
    const bool half = dtype == DType::F16;
    embedhead::save_checkpoint<float>(cpp + file, llama, half ? table_half : table, &head, nullptr, dtype);
    written["checkpoints"].push_back({{"file", file},
                                      {"dtype", embedhead::dtype_name(dtype)},
                                      {"tied", false},
                                      {"tensors",
                                       {{"model.embed_tokens.weight", half ? "llama_table_f16.npy" : "llama_table.npy"},
                                        {"lm_head.weight", "llama_head.npy"},
                                        {"lm_head.bias", "llama_bias.npy"}}}});
  }
  // Beyond what F16 holds: a value_error naming the tensor, and no file.
  CHECK_THROWS_WITH(embedhead::save_checkpoint<float>(cpp + "ckpt_llama_f16_overflow.safetensors", llama, table, &head,
                                                      nullptr, DType::F16),
                    Catch::Contains("tensor 'model.embed_tokens.weight': value 3e+38 at (2, 1) overflows F16"));
  CHECK_FALSE(std::ifstream(cpp + "ckpt_llama_f16_overflow.safetensors").good());

  // GPT-2 layout, tied, with learned positions, in BF16.
  embedhead::TokenEmbedding<float> wte(7, 4, table_options);
  embedhead::OutputProjection<float> tied(wte);
  embedhead::LearnedPositionEmbedding<float> wpe(6, 4);
  embedhead::save_npy(cpp + "gpt2_wte.npy", wte.weight().value());
  embedhead::save_npy(cpp + "gpt2_wpe.npy", wpe.weight().value());
  embedhead::save_checkpoint<float>(cpp + "ckpt_gpt2_tied_bf16.safetensors",
                                    embedhead::hugging_face_names(embedhead::ModelFamily::gpt2), wte, &tied, &wpe,
                                    DType::BF16);
  written["checkpoints"].push_back({{"file", "ckpt_gpt2_tied_bf16.safetensors"},
                                    {"dtype", "BF16"},
                                    {"tied", true},
                                    {"tensors", {{"wte.weight", "gpt2_wte.npy"}, {"wpe.weight", "gpt2_wpe.npy"}}}});

  // A double table written as BF16, F16, F32 and F64. The traps are doubles just off a tie of the
  // 16-bit format, by less than float's resolution: rounding to float first lands on the tie and
  // then goes the wrong way; one rounding (what the writer must do) does not.
  RowMatrix<double> source = RowMatrix<double>::Random(4, 8);
  const double tiny = std::ldexp(1.0, -30);
  const double traps[] = {
      1.0 + std::ldexp(1.0, -8) + tiny,  // bf16: up to 1 + 2^-7 (via float: down to 1)
      1.0 + std::ldexp(3.0, -8) - tiny,  // bf16: down to 1 + 2^-7 (via float: up to 1 + 2^-6)
      -(1.0 + std::ldexp(1.0, -8) + tiny),
      1.0 + std::ldexp(1.0, -11) + tiny,  // f16: up to 1 + 2^-10 (via float: down to 1)
      1.0 + std::ldexp(3.0, -11) - tiny,  // f16: down to 1 + 2^-10 (via float: up to 1 + 2^-9)
      65520.0 - tiny,                     // f16: 65504 (via float: the tie at 65520, then to +inf)
  };
  nlohmann::json trap_indices = nlohmann::json::array();
  for (std::size_t i = 0; i < sizeof(traps) / sizeof(traps[0]); ++i) {
    source.data()[i] = traps[i];
    trap_indices.push_back(i);
  }
  source(3, 7) = 65519.0;  // near half's overflow boundary: 65504 (1e300 here, beyond all but F64, is a value_error)
  source(3, 6) = -1e-300;  // underflows to -0
  source(3, 5) = 3.0e-7;   // a half subnormal
  embedhead::save_npy(cpp + "from_double.npy", source);
  embedhead::SafetensorsWriter writer;
  writer.add<double>("as_bf16", source, DType::BF16)
      .add<double>("as_f16", source, DType::F16)
      .add<double>("as_f32", source, DType::F32)
      .add<double>("as_f64", source, DType::F64);
  writer.write(cpp + "from_double.safetensors");
  written["from_double"].push_back(
      {{"file", "from_double.safetensors"},
       {"source", "from_double.npy"},
       {"tensors", {{"as_bf16", "BF16"}, {"as_f16", "F16"}, {"as_f32", "F32"}, {"as_f64", "F64"}}},
       {"double_rounding_traps", trap_indices}});

  // .npy files numpy.load must read, byte-identical to numpy.save's.
  embedhead::save_npy(cpp + "cpp_f32.npy", pattern<float>(3, 5));
  embedhead::save_npy(cpp + "cpp_f64.npy", pattern<double>(4, 2));
  embedhead::save_npy(cpp + "cpp_f32_empty.npy", pattern<float>(0, 3));
  embedhead::save_npy(cpp + "cpp_f64_wide.npy", pattern<double>(1, 300));  // header padded past 64 bytes
  written["npy"] = {{{"file", "cpp_f32.npy"}, {"rows", 3}, {"cols", 5}, {"dtype", "<f4"}},
                    {{"file", "cpp_f64.npy"}, {"rows", 4}, {"cols", 2}, {"dtype", "<f8"}},
                    {{"file", "cpp_f32_empty.npy"}, {"rows", 0}, {"cols", 3}, {"dtype", "<f4"}},
                    {{"file", "cpp_f64_wide.npy"}, {"rows", 1}, {"cols", 300}, {"dtype", "<f8"}}};

  // Each file also reads back here (the Python side checks the bits independently).
  const SafetensorsFile back = SafetensorsFile::open(cpp + "from_double.safetensors");
  CHECK(bit_difference(back.read<double>("as_f64"), source) == "");
  CHECK(back.read<float>("as_bf16")(0, 0) == 1.0f + std::ldexp(1.0f, -7));
  CHECK(back.read<float>("as_bf16")(0, 1) == 1.0f + std::ldexp(1.0f, -7));
  CHECK(back.read<float>("as_f16")(0, 3) == 1.0f + std::ldexp(1.0f, -10));
  CHECK(back.read<float>("as_f16")(0, 5) == 65504.0f);
  CHECK(bit_difference(embedhead::load_npy<double>(cpp + "from_double.npy"), source) == "");

  std::ofstream(cpp + "written.json") << written.dump(1);
}
