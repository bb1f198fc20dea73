// Tests for include/embedhead/io/checkpoint.hpp: Hugging Face layouts (GPT-2, Llama, Gemma) saved
// and loaded, the tied/untied rules in both directions, all-or-nothing loading (every layer
// compared bit for bit with a snapshot after each failed load, for bad layouts and for corrupted
// files), and optimizer state restored so that training continues bit-identically.
#include <embedhead/io/checkpoint.hpp>
#include <embedhead/io/optimizer_state.hpp>
#include <embedhead/optim/adamw.hpp>
#include <embedhead/optim/lazy_adamw.hpp>
#include <embedhead/optim/rowwise_adagrad.hpp>
#include <embedhead/optim/sgd.hpp>

#include <catch2/catch.hpp>

#include <unistd.h>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "../reference/files.hpp"

using embedhead::AdamW;
using embedhead::CheckpointNames;
using embedhead::DType;
using embedhead::format_error;
using embedhead::Index;
using embedhead::LearnedPositionEmbedding;
using embedhead::ModelFamily;
using embedhead::OutputProjection;
using embedhead::OutputProjectionOptions;
using embedhead::RowMatrix;
using embedhead::SafetensorsFile;
using embedhead::SafetensorsWriter;
using embedhead::shape_error;
using embedhead::TokenEmbedding;
using embedhead::TokenEmbeddingOptions;
using embedhead::value_error;

using test_support::read_bytes;
using test_support::write_bytes;

namespace {

std::string temp_path(const std::string& name) { return test_support::temp_path("checkpoint_test", name); }

// Every value of the layers, to compare before and after a failed load.
struct Snapshot {
  RowMatrix<float> table, head, bias, positions;
  bool operator==(const Snapshot& o) const {
    return table == o.table && head == o.head && bias == o.bias && positions == o.positions;
  }
};
Snapshot snapshot(const TokenEmbedding<float>& e, const OutputProjection<float>& h,
                  const LearnedPositionEmbedding<float>* p) {
  Snapshot s;
  s.table = e.weight().value();
  s.head = h.weight().value();
  if (h.bias()) s.bias = h.bias()->value();
  if (p) s.positions = p->weight().value();
  return s;
}

TokenEmbedding<float> table(Index V, Index d, std::uint64_t seed, bool scale = false) {
  TokenEmbeddingOptions options;
  options.seed = seed;
  options.scale_by_sqrt_d = scale;
  return TokenEmbedding<float>(V, d, options);
}
OutputProjection<float> untied_head(Index V, Index d, std::uint64_t seed, bool bias = false) {
  OutputProjectionOptions options;
  options.seed = seed;
  options.bias = bias;
  return OutputProjection<float>(V, d, options);
}

}  // namespace

TEST_CASE("checkpoint: GPT-2 layout, tied, with learned positions, round trip", "[checkpoint]") {
  const Index V = 50, d = 8;
  auto embedding = table(V, d, 1);
  OutputProjection<float> head(embedding);
  LearnedPositionEmbedding<float> positions(16, d);
  const std::string path = temp_path("gpt2.safetensors");
  const auto names = embedhead::hugging_face_names(ModelFamily::gpt2);
  embedhead::save_checkpoint<float>(path, names, embedding, &head, &positions);

  const auto file = SafetensorsFile::open(path);
  CHECK(file.contains("wte.weight"));
  CHECK(file.contains("wpe.weight"));
  CHECK_FALSE(file.contains("lm_head.weight"));  // tied: the table is the head
  CHECK(file.metadata().at("format") == "pt");
  CHECK(file.metadata().at("embedhead.tied") == "true");
  CHECK(embedhead::guess_model_family(file) == ModelFamily::gpt2);

  auto loaded = embedhead::from_pretrained<float>(file, embedhead::hugging_face_names(ModelFamily::gpt2, &file));
  CHECK(loaded.tied);
  CHECK(loaded.head.weight_ptr() == loaded.token_embedding.weight_ptr());  // shared, not a copy
  CHECK(loaded.token_embedding.weight().value() == embedding.weight().value());
  REQUIRE(loaded.position_embedding.has_value());
  CHECK(loaded.position_embedding->weight().value() == positions.weight().value());
  CHECK_FALSE(loaded.head.has_bias());
  // Tied for real: a change to the table is seen by the head.
  loaded.token_embedding.weight().value()(3, 4) = 42.0f;
  CHECK(loaded.head.weight().value()(3, 4) == 42.0f);
  std::remove(path.c_str());
}

TEST_CASE("checkpoint: GPT2LMHeadModel's 'transformer.' prefix is found", "[checkpoint]") {
  auto embedding = table(10, 4, 3);
  const std::string path = temp_path("prefixed.safetensors");
  CheckpointNames prefixed = embedhead::hugging_face_names(ModelFamily::gpt2);
  prefixed.token_embedding = "transformer.wte.weight";
  embedhead::save_checkpoint<float>(path, prefixed, embedding);
  const auto file = SafetensorsFile::open(path);
  CHECK(embedhead::guess_model_family(file) == ModelFamily::gpt2);
  const auto names = embedhead::hugging_face_names(ModelFamily::gpt2, &file);
  CHECK(names.token_embedding == "transformer.wte.weight");
  CHECK(embedhead::from_pretrained<float>(file, names).token_embedding.weight().value() == embedding.weight().value());
  std::remove(path.c_str());
}

TEST_CASE("checkpoint: Llama layout, untied, and Gemma's sqrt(d) scale", "[checkpoint]") {
  const Index V = 40, d = 6;
  auto embedding = table(V, d, 5);
  auto head = untied_head(V, d, 6);
  const std::string path = temp_path("llama.safetensors");
  embedhead::save_checkpoint<float>(path, embedhead::hugging_face_names(ModelFamily::llama), embedding, &head);
  const auto file = SafetensorsFile::open(path);
  CHECK(file.contains("model.embed_tokens.weight"));
  CHECK(file.contains("lm_head.weight"));
  CHECK(embedhead::guess_model_family(file) == ModelFamily::llama);
  auto loaded = embedhead::from_pretrained<float>(file, embedhead::hugging_face_names(ModelFamily::llama));
  CHECK_FALSE(loaded.tied);
  CHECK(loaded.head.weight_ptr() != loaded.token_embedding.weight_ptr());
  CHECK(loaded.head.weight().value() == head.weight().value());
  CHECK(loaded.token_embedding.weight().value() == embedding.weight().value());
  CHECK_FALSE(loaded.position_embedding.has_value());
  std::remove(path.c_str());

  // Gemma: tied, scaled by Scalar(sqrt(d)).
  auto gemma_table = table(V, 16, 7, /*scale=*/true);
  OutputProjection<float> gemma_head(gemma_table);
  const auto gemma_names = embedhead::hugging_face_names(ModelFamily::gemma);
  embedhead::save_checkpoint<float>(path, gemma_names, gemma_table, &gemma_head);
  const auto gemma_file = SafetensorsFile::open(path);
  auto gemma = embedhead::from_pretrained<float>(gemma_file, gemma_names);
  CHECK(gemma.tied);
  CHECK(gemma.token_embedding.scale() == 4.0f);
  // The same file as Llama names but no scale: loading it into a scaled table is refused.
  auto scaled = table(V, 16, 8, true);
  CHECK_THROWS_WITH(embedhead::load_checkpoint<float>(gemma_file, embedhead::hugging_face_names(ModelFamily::llama),
                                                      scaled),
                    Catch::Contains("sqrt(d)"));
  std::remove(path.c_str());
}

TEST_CASE("checkpoint: a tied checkpoint into an untied model, and the reverse, are errors", "[checkpoint]") {
  const Index V = 30, d = 5;
  const auto names = embedhead::hugging_face_names(ModelFamily::llama);
  const std::string tied_path = temp_path("tied.safetensors"), untied_path = temp_path("untied.safetensors");
  {
    auto e = table(V, d, 11);
    OutputProjection<float> h(e);
    embedhead::save_checkpoint<float>(tied_path, names, e, &h);
    auto e2 = table(V, d, 12);
    auto h2 = untied_head(V, d, 13);
    embedhead::save_checkpoint<float>(untied_path, names, e2, &h2);
  }
  const auto tied_file = SafetensorsFile::open(tied_path);
  const auto untied_file = SafetensorsFile::open(untied_path);

  SECTION("tied checkpoint -> untied head") {
    auto e = table(V, d, 21);
    auto h = untied_head(V, d, 22);
    const auto before = snapshot(e, h, nullptr);
    CHECK_THROWS_AS(embedhead::load_checkpoint<float>(tied_file, names, e, &h), value_error);
    CHECK_THROWS_WITH(embedhead::load_checkpoint<float>(tied_file, names, e, &h),
                      Catch::Contains("untied but the file has no 'lm_head.weight'") &&
                          Catch::Contains("tied checkpoint"));
    CHECK(snapshot(e, h, nullptr) == before);  // not even the table was written
    // from_pretrained with the config saying untied: the same error.
    embedhead::PretrainedOptions untied;
    untied.tie_word_embeddings = false;
    CHECK_THROWS_WITH(embedhead::from_pretrained<float>(tied_file, names, untied), Catch::Contains("tied checkpoint"));
  }
  SECTION("untied checkpoint -> tied head") {
    auto e = table(V, d, 31);
    OutputProjection<float> h(e);
    const auto before = snapshot(e, h, nullptr);
    CHECK_THROWS_AS(embedhead::load_checkpoint<float>(untied_file, names, e, &h), value_error);
    CHECK_THROWS_WITH(embedhead::load_checkpoint<float>(untied_file, names, e, &h),
                      Catch::Contains("differs from 'model.embed_tokens.weight' at (0, 0)") &&
                          Catch::Contains("untied checkpoint"));
    CHECK(snapshot(e, h, nullptr) == before);
    embedhead::PretrainedOptions tie;
    tie.tie_word_embeddings = true;
    CHECK_THROWS_WITH(embedhead::from_pretrained<float>(untied_file, names, tie), Catch::Contains("untied checkpoint"));
  }
  SECTION("a file with both tensors equal loads into a tied head") {
    auto e = table(V, d, 41);
    SafetensorsWriter writer;
    writer.add<float>("model.embed_tokens.weight", e.weight().value(), DType::F32);
    writer.add<float>("lm_head.weight", e.weight().value(), DType::BF16);  // equal only after rounding?
    const std::string both = temp_path("both.safetensors");
    writer.write(both);
    auto target = table(V, d, 42);
    OutputProjection<float> h(target);
    // F32 and BF16 copies differ (rounding): refused, naming the first differing entry.
    CHECK_THROWS_WITH(embedhead::load_checkpoint<float>(SafetensorsFile::open(both), names, target, &h),
                      Catch::Contains("differs"));
    SafetensorsWriter same;
    same.add<float>("model.embed_tokens.weight", e.weight().value(), DType::F32);
    same.add<float>("lm_head.weight", e.weight().value(), DType::F32);
    same.write(both);
    embedhead::load_checkpoint<float>(SafetensorsFile::open(both), names, target, &h);
    CHECK(target.weight().value() == e.weight().value());
    CHECK(h.weight_ptr() == target.weight_ptr());
    std::remove(both.c_str());
  }
  std::remove(tied_path.c_str());
  std::remove(untied_path.c_str());
}

TEST_CASE("checkpoint: a head wrapping the embedding's weight_ptr() follows the tied rules", "[checkpoint][tied]") {
  const Index V = 20, d = 4;
  const auto names = embedhead::hugging_face_names(ModelFamily::gpt2);
  const std::string path = temp_path("tied_by_pointer.safetensors");
  {
    auto e = table(V, d, 51);
    OutputProjection<float> h(e.weight_ptr());  // tied, as OutputProjection(e)
    embedhead::save_checkpoint<float>(path, names, e, &h);
  }
  const auto file = SafetensorsFile::open(path);
  CHECK_FALSE(file.contains("lm_head.weight"));  // tied: the table is the head
  CHECK(file.metadata().at("embedhead.tied") == "true");
  auto e = table(V, d, 52);
  OutputProjection<float> h(e.weight_ptr());
  embedhead::load_checkpoint<float>(file, names, e, &h);  // accepted: the tied rule
  CHECK(h.weight_ptr() == e.weight_ptr());
  CHECK(e.weight().value() == table(V, d, 51).weight().value());
  std::remove(path.c_str());

  SECTION("a head sharing W but with its own bias saves and loads the bias") {
    const std::string with_bias = temp_path("shared_with_bias.safetensors");
    const auto llama = embedhead::hugging_face_names(ModelFamily::llama);
    CheckpointNames biased = llama;
    biased.head_bias = "lm_head.bias";
    auto source = table(V, d, 53);
    OutputProjection<float> source_head(source.weight_ptr(),
                                        std::make_shared<embedhead::Parameter<float>>(V, 1, "lm_head.bias"));
    source_head.bias()->value().setConstant(0.25f);
    embedhead::save_checkpoint<float>(with_bias, biased, source, &source_head);
    const auto saved = SafetensorsFile::open(with_bias);
    CHECK_FALSE(saved.contains("lm_head.weight"));
    CHECK(saved.contains("lm_head.bias"));
    auto target = table(V, d, 54);
    OutputProjection<float> target_head(target.weight_ptr(),
                                        std::make_shared<embedhead::Parameter<float>>(V, 1, "lm_head.bias"));
    embedhead::load_checkpoint<float>(saved, biased, target, &target_head);
    CHECK(target_head.bias()->value().isConstant(0.25f, 0));
    CHECK(target.weight().value() == source.weight().value());
    std::remove(with_bias.c_str());
  }
}

TEST_CASE("checkpoint: loads are all-or-nothing for every layout error", "[checkpoint]") {
  const Index V = 20, d = 4;
  const auto names = embedhead::hugging_face_names(ModelFamily::gpt2);
  auto source = table(V, d, 51);
  auto source_head = untied_head(V, d, 52, /*bias=*/true);
  LearnedPositionEmbedding<float> source_positions(8, d);
  const std::string path = temp_path("all_or_nothing.safetensors");
  embedhead::save_checkpoint<float>(path, names, source, &source_head, &source_positions);
  const auto file = SafetensorsFile::open(path);

  auto e = table(V, d, 61);
  auto h = untied_head(V, d, 62, true);
  LearnedPositionEmbedding<float> p(8, d, {0.02, 63});
  const auto before = snapshot(e, h, &p);

  // A position table of the wrong length: checked after the token table, and still nothing written.
  LearnedPositionEmbedding<float> long_positions(9, d);
  const auto long_before = long_positions.weight().value().eval();
  CHECK_THROWS_AS(embedhead::load_checkpoint<float>(file, names, e, &h, &long_positions), shape_error);
  CHECK_THROWS_WITH(embedhead::load_checkpoint<float>(file, names, e, &h, &long_positions),
                    Catch::Contains("'wpe.weight'") && Catch::Contains("[8, 4]") && Catch::Contains("[9, 4]"));
  CHECK(snapshot(e, h, &p) == before);
  CHECK(long_positions.weight().value() == long_before);

  // A head without the bias the file has.
  auto no_bias = untied_head(V, d, 64, false);
  CHECK_THROWS_WITH(embedhead::load_checkpoint<float>(file, names, e, &no_bias, &p), Catch::Contains("has no bias"));
  CHECK(snapshot(e, h, &p) == before);

  // A vocabulary of another size.
  auto wrong_v = table(V + 1, d, 65);
  const auto wrong_v_before = wrong_v.weight().value().eval();
  CHECK_THROWS_AS(embedhead::load_checkpoint<float>(file, names, wrong_v), shape_error);
  CHECK(wrong_v.weight().value() == wrong_v_before);

  // Positions asked of a layout without them.
  CHECK_THROWS_AS(embedhead::load_checkpoint<float>(file, embedhead::hugging_face_names(ModelFamily::llama), e, nullptr,
                                                    &p),
                  format_error);  // the Llama table name is not in a GPT-2 file
  CHECK(snapshot(e, h, &p) == before);

  // A good load writes everything.
  embedhead::load_checkpoint<float>(file, names, e, &h, &p);
  CHECK(snapshot(e, h, &p) == snapshot(source, source_head, &source_positions));
  std::remove(path.c_str());
}

TEST_CASE("checkpoint: non-finite values and wrong dtypes are refused, naming the entry", "[checkpoint]") {
  const Index V = 6, d = 3;
  const auto names = embedhead::hugging_face_names(ModelFamily::llama);
  auto bad_head = untied_head(V, d, 71);
  bad_head.weight().value()(4, 2) = std::numeric_limits<float>::infinity();
  auto good = table(V, d, 72);
  const std::string path = temp_path("nonfinite.safetensors");
  embedhead::save_checkpoint<float>(path, names, good, &bad_head);
  auto e = table(V, d, 73);
  auto h = untied_head(V, d, 74);
  const auto before = snapshot(e, h, nullptr);
  CHECK_THROWS_AS(embedhead::load_checkpoint<float>(SafetensorsFile::open(path), names, e, &h), value_error);
  CHECK_THROWS_WITH(embedhead::load_checkpoint<float>(SafetensorsFile::open(path), names, e, &h),
                    Catch::Contains("'lm_head.weight'") && Catch::Contains("non-finite value at (4, 2)"));
  CHECK(snapshot(e, h, nullptr) == before);  // the (good) table was not written either

  // An integer tensor under the table's name.
  RowMatrix<float> ids = RowMatrix<float>::Zero(V, d);
  SafetensorsWriter writer;
  writer.add<float>("model.embed_tokens.weight", ids, DType::F32);
  writer.write(path);
  std::string bytes = read_bytes(path);
  const auto at = bytes.find("\"F32\"");
  REQUIRE(at != std::string::npos);
  bytes.replace(at, 5, "\"I32\"");  // same byte size, other dtype
  write_bytes(path, bytes);
  CHECK_THROWS_AS(embedhead::load_checkpoint<float>(SafetensorsFile::open(path), names, e), format_error);
  CHECK_THROWS_WITH(embedhead::load_checkpoint<float>(SafetensorsFile::open(path), names, e),
                    Catch::Contains("dtype I32"));
  CHECK(snapshot(e, h, nullptr) == before);
  std::remove(path.c_str());
}

TEST_CASE("checkpoint: F64 values beyond float's range are refused for a float model, kept for double",
          "[checkpoint]") {
  const Index V = 4, d = 3;
  const auto names = embedhead::hugging_face_names(ModelFamily::llama);
  RowMatrix<double> values = RowMatrix<double>::Constant(V, d, 0.5);
  values(2, 1) = 1e300;  // finite in F64, infinite as float
  const std::string path = temp_path("f64range.safetensors");
  SafetensorsWriter().add<double>("model.embed_tokens.weight", values, DType::F64).write(path);
  const auto file = SafetensorsFile::open(path);
  auto e = table(V, d, 111);
  const auto before = e.weight().value().eval();
  CHECK_THROWS_AS(embedhead::load_checkpoint<float>(file, names, e), value_error);
  CHECK_THROWS_WITH(embedhead::load_checkpoint<float>(file, names, e),
                    Catch::Contains("beyond float's range") && Catch::Contains("at (2, 1)"));
  CHECK(e.weight().value() == before);
  TokenEmbedding<double> wide(V, d);
  embedhead::load_checkpoint<double>(file, names, wide);
  CHECK(wide.weight().value() == values);
  std::remove(path.c_str());
}

TEST_CASE("checkpoint: corrupted copies of a good file never change the model", "[checkpoint]") {
  const Index V = 12, d = 4;
  const auto names = embedhead::hugging_face_names(ModelFamily::gpt2);
  auto source = table(V, d, 81);
  LearnedPositionEmbedding<float> source_positions(5, d);
  const std::string path = temp_path("corrupt.safetensors");
  embedhead::save_checkpoint<float>(path, names, source, nullptr, &source_positions);
  const std::string good = read_bytes(path);

  auto e = table(V, d, 82);
  OutputProjection<float> h(e);
  LearnedPositionEmbedding<float> p(5, d, {0.02, 83});
  const auto before = snapshot(e, h, &p);

  std::vector<std::string> corrupted;
  for (std::size_t cut = 0; cut < good.size(); cut += 7) corrupted.push_back(good.substr(0, cut));  // truncations
  corrupted.push_back(good + "x");                                                                  // trailing byte
  for (std::size_t i = 0; i < 8; ++i) {                                                             // header length
    std::string b = good;
    b[i] = static_cast<char>(b[i] ^ 0x40);
    corrupted.push_back(b);
  }
  const std::size_t header_end = 8 + static_cast<unsigned char>(good[0]) + 256 * static_cast<unsigned char>(good[1]);
  for (std::size_t i = 8; i < header_end; ++i) {  // every header byte changed to something else
    std::string b = good;
    b[i] = b[i] == '1' ? '2' : (b[i] == '"' ? 'x' : '1');
    corrupted.push_back(b);
  }
  Index rejected = 0, accepted = 0;
  for (const auto& bytes : corrupted) {
    write_bytes(path, bytes);
    try {
      embedhead::load_checkpoint<float>(SafetensorsFile::open(path), names, e, &h, &p);
      ++accepted;  // a change the format cannot see (e.g. inside a metadata string): loads
      e.weight().value() = before.table;
      p.weight().value() = before.positions;
    } catch (const std::exception& error) {
      ++rejected;
      INFO(error.what());
      REQUIRE(snapshot(e, h, &p) == before);
    }
  }
  CHECK(rejected > 100);
  CHECK(accepted < rejected / 4);
  std::remove(path.c_str());
}

TEST_CASE("checkpoint: BF16 storage halves the file and rounds each value once", "[checkpoint]") {
  const Index V = 64, d = 16;
  auto e = table(V, d, 91);
  const auto names = embedhead::hugging_face_names(ModelFamily::gemma);
  const std::string f32 = temp_path("f32.safetensors"), bf16 = temp_path("bf16.safetensors");
  auto scaled = table(V, d, 91, true);
  embedhead::save_checkpoint<float>(f32, names, scaled, nullptr, nullptr, DType::F32);
  embedhead::save_checkpoint<float>(bf16, names, scaled, nullptr, nullptr, DType::BF16);
  const auto size32 = read_bytes(f32).size(), size16 = read_bytes(bf16).size();
  CHECK(size32 - size16 == static_cast<std::size_t>(V * d * 2));
  auto loaded = embedhead::from_pretrained<float>(SafetensorsFile::open(bf16), names);
  for (Index r = 0; r < V; ++r)
    for (Index c = 0; c < d; ++c) {
      const float x = scaled.weight().value()(r, c), y = loaded.token_embedding.weight().value()(r, c);
      CHECK(std::abs(x - y) <= std::abs(x) * (1.0f / 256));  // 8 significant bits
    }
  std::remove(f32.c_str());
  std::remove(bf16.c_str());
}

TEST_CASE("checkpoint: optimizer state saved beside the model resumes training bit-identically", "[checkpoint]") {
  const Index V = 24, d = 6, N = 10;
  const auto names = embedhead::hugging_face_names(ModelFamily::llama);
  auto embedding = table(V, d, 101);
  auto head = untied_head(V, d, 102);
  embedhead::AdamOptions adam;
  adam.lr = 1e-2;
  adam.weight_decay = 0.01;
  AdamW<float> optimizer(adam, {embedding.weight_ptr(), head.weight_ptr()});

  embedhead::IdMatrix<std::int32_t> ids(1, N);
  for (Index n = 0; n < N; ++n) ids(0, n) = static_cast<std::int32_t>((n * 7) % V);
  const RowMatrix<float> dlogits = RowMatrix<float>::Random(N, V);
  auto train_step = [&](TokenEmbedding<float>& e, OutputProjection<float>& h, AdamW<float>& opt) {
    opt.zero_grad();
    const RowMatrix<float> x = e.forward(ids);
    const RowMatrix<float> dh = h.backward(x, dlogits);
    e.backward(ids, dh);
    opt.step();
  };
  for (int s = 0; s < 3; ++s) train_step(embedding, head, optimizer);

  const std::string path = temp_path("optimizer.safetensors");
  SafetensorsWriter writer;
  embedhead::add_checkpoint<float>(writer, names, embedding, &head);
  const auto state = optimizer.state();
  embedhead::add_optimizer_state(writer, state);
  writer.write(path);

  const auto file = SafetensorsFile::open(path);
  auto resumed = embedhead::from_pretrained<float>(file, names);
  AdamW<float> resumed_optimizer(adam, {resumed.token_embedding.weight_ptr(), resumed.head.weight_ptr()});
  resumed_optimizer.load_state(embedhead::read_optimizer_state<float>(file));
  CHECK(resumed_optimizer.step_count() == 3);

  for (int s = 0; s < 2; ++s) {
    train_step(embedding, head, optimizer);
    train_step(resumed.token_embedding, resumed.head, resumed_optimizer);
  }
  CHECK(resumed.token_embedding.weight().value() == embedding.weight().value());
  CHECK(resumed.head.weight().value() == head.weight().value());

  // A file with no optimizer state, and metadata that is malformed.
  const std::string plain = temp_path("plain.safetensors");
  embedhead::save_checkpoint<float>(plain, names, embedding, &head);
  CHECK_THROWS_AS(embedhead::read_optimizer_state<float>(SafetensorsFile::open(plain)), format_error);
  CHECK_THROWS_WITH(embedhead::read_optimizer_state<float>(SafetensorsFile::open(plain)),
                    Catch::Contains("no metadata 'optimizer'"));
  SafetensorsWriter bad;
  bad.set_metadata("optimizer", "AdamW")
      .set_metadata("optimizer.step", "three")
      .set_metadata("optimizer.parameters", "[]");
  bad.write(plain);
  CHECK_THROWS_WITH(embedhead::read_optimizer_state<float>(SafetensorsFile::open(plain)), Catch::Contains("'three'"));
  for (const char* step : {" 3", "+3", ""}) {
    bad.set_metadata("optimizer.step", step);
    bad.write(plain);
    CHECK_THROWS_WITH(embedhead::read_optimizer_state<float>(SafetensorsFile::open(plain)),
                      Catch::Contains("metadata 'optimizer.step' = '" + std::string(step) +
                                      "' is not a non-negative integer"));
  }
  // The state of another optimizer kind is refused by load_state.
  embedhead::SGD<float> sgd({}, {embedding.weight_ptr(), head.weight_ptr()});
  CHECK_THROWS_AS(sgd.load_state(embedhead::read_optimizer_state<float>(file)), value_error);
  std::remove(path.c_str());
  std::remove(plain.c_str());
}

TEST_CASE("checkpoint: each parameter's step count and a per-row buffer survive the file", "[checkpoint]") {
  const std::string path = temp_path("optimizer_steps.safetensors");
  auto a = std::make_shared<embedhead::Parameter<float>>(RowMatrix<float>::Random(5, 3), "a");
  auto b = std::make_shared<embedhead::Parameter<float>>(RowMatrix<float>::Random(5, 3), "b");
  embedhead::RowWiseAdagrad<float> optimizer({}, {a, b});
  std::vector<Index> slots(2);
  const Index rows[] = {1, 3};
  for (int s = 0; s < 3; ++s) {
    optimizer.zero_grad();
    a->grad().touch_rows(rows, 2, slots.data());
    for (Index slot : slots) a->grad().slot_row(slot).setConstant(0.5f + static_cast<float>(s));
    if (s == 1) b->grad().dense_accumulator().setConstant(-0.25f);  // b has a gradient once
    optimizer.step();
  }
  SafetensorsWriter writer;
  embedhead::add_optimizer_state(writer, optimizer.state());
  writer.write(path);
  const auto file = SafetensorsFile::open(path);
  CHECK(file.metadata().at("optimizer.parameter_steps") == "[3,1]");
  const auto state = embedhead::read_optimizer_state<float>(file);
  REQUIRE(state.parameters.size() == 2);
  CHECK(state.parameters[0].step == std::optional<std::int64_t>(3));
  CHECK(state.parameters[1].step == std::optional<std::int64_t>(1));
  const RowMatrix<float>& sum = state.parameters[0].buffers.at("sum");
  CHECK(sum.rows() == 5);
  CHECK(sum.cols() == 1);
  CHECK(sum == optimizer.state().parameters[0].buffers.at("sum"));
  embedhead::RowWiseAdagrad<float> resumed({}, {a, b});
  resumed.load_state(state);
  CHECK(resumed.step_count(*b) == 1);

  // Without the key (a file from before per-parameter counts): every parameter at the state's step.
  // A malformed list is a format_error naming it.
  const auto with_steps = [&](const char* steps) {
    SafetensorsWriter w;
    w.add<float>("optimizer.0.sum", RowMatrix<float>::Ones(5, 1), DType::F32)
        .set_metadata("optimizer", "RowWiseAdagrad")
        .set_metadata("optimizer.step", "3")
        .set_metadata("optimizer.parameters", R"([["a",5,3]])");
    if (steps) w.set_metadata("optimizer.parameter_steps", steps);
    w.write(path);
    return SafetensorsFile::open(path);
  };
  CHECK_FALSE(embedhead::read_optimizer_state<float>(with_steps(nullptr)).parameters[0].step.has_value());
  for (const char* bad : {"[4]", "[1,2]", "[-1]", "x"}) {
    CAPTURE(bad);
    CHECK_THROWS_AS(embedhead::read_optimizer_state<float>(with_steps(bad)), format_error);
    CHECK_THROWS_WITH(embedhead::read_optimizer_state<float>(with_steps(bad)),
                      Catch::Contains("metadata 'optimizer.parameter_steps'") &&
                          Catch::Contains("is not a list of 1 integers in [0, 3]"));
  }
  std::remove(path.c_str());
}

TEST_CASE(
    "checkpoint: LazyAdamW's per-row buffers and running decay survive the file; training resumes bit-identically",
    "[checkpoint]") {
  const std::string path = temp_path("lazy_adamw.safetensors");
  for (const bool as_double : {false, true}) {
    CAPTURE(as_double);
    auto run = [&](auto zero) {
      using Scalar = decltype(zero);
      const Index V = 7, d = 3;
      auto p = std::make_shared<embedhead::Parameter<Scalar>>(RowMatrix<Scalar>::Random(V, d), "E");
      embedhead::AdamOptions options;
      options.weight_decay = 0.3;
      embedhead::LazyAdamW<Scalar> optimizer(options, {p});
      std::vector<Index> slots(2);
      auto train = [&](embedhead::Parameter<Scalar>& q, embedhead::LazyAdamW<Scalar>& o, int s) {
        o.zero_grad();
        const Index rows[] = {static_cast<Index>(s % V), static_cast<Index>((3 * s + 1) % V)};
        if (rows[0] == rows[1]) return o.step();
        const Index sorted[] = {std::min(rows[0], rows[1]), std::max(rows[0], rows[1])};
        q.grad().touch_rows(sorted, 2, slots.data());
        for (Index slot : slots) q.grad().slot_row(slot).setConstant(Scalar(0.5) + static_cast<Scalar>(s % 3));
        o.set_lr(1e-2 / (1 + s));  // a schedule: the running decay is not (1 - lr wd)^k
        o.step();
      };
      for (int s = 0; s < 9; ++s) train(*p, optimizer, s);
      SafetensorsWriter writer;
      embedhead::add_optimizer_state(writer, optimizer.state());
      writer.write(path);
      const auto file = SafetensorsFile::open(path);
      CHECK(file.metadata().count("optimizer.parameter_scalars") == 1);
      const auto state = embedhead::read_optimizer_state<Scalar>(file);
      CHECK(state.parameters.at(0).scalars == optimizer.state().parameters.at(0).scalars);  // exact
      CHECK(state.parameters.at(0).buffers.at("last_step") ==
            optimizer.state().parameters.at(0).buffers.at("last_step"));
      CHECK(state.parameters.at(0).buffers.at("last_step").cols() == 1);
      auto q = std::make_shared<embedhead::Parameter<Scalar>>(p->value(), "E");
      embedhead::LazyAdamW<Scalar> resumed(options, {q});
      resumed.load_state(state);
      for (int s = 9; s < 14; ++s) {
        train(*p, optimizer, s);
        train(*q, resumed, s);
      }
      optimizer.catch_up();
      resumed.catch_up();
      CHECK(q->value() == p->value());
    };
    if (as_double)
      run(0.0);
    else
      run(0.0f);
  }
  // Another optimizer writes no scalars; malformed scalars are a format_error naming the key.
  const auto with_scalars = [&](const char* scalars) {
    SafetensorsWriter w;
    w.add<float>("optimizer.0.exp_avg", RowMatrix<float>::Ones(5, 3), DType::F32)
        .set_metadata("optimizer", "LazyAdamW")
        .set_metadata("optimizer.step", "3")
        .set_metadata("optimizer.parameters", R"([["a",5,3]])");
    if (scalars) w.set_metadata("optimizer.parameter_scalars", scalars);
    w.write(path);
    return SafetensorsFile::open(path);
  };
  CHECK(embedhead::read_optimizer_state<float>(with_scalars(nullptr)).parameters[0].scalars.empty());
  CHECK(embedhead::read_optimizer_state<float>(with_scalars(R"([{"x":0.75}])")).parameters[0].scalars.at("x") == 0.75);
  for (const char* bad : {"[]", "[1]", R"([{"x":"y"}])", "x", R"([{},{}])"}) {
    CAPTURE(bad);
    CHECK_THROWS_AS(embedhead::read_optimizer_state<float>(with_scalars(bad)), format_error);
    CHECK_THROWS_WITH(embedhead::read_optimizer_state<float>(with_scalars(bad)),
                      Catch::Contains("metadata 'optimizer.parameter_scalars'") &&
                          Catch::Contains("is not a list of 1 objects of numbers"));
  }
  auto a = std::make_shared<embedhead::Parameter<float>>(RowMatrix<float>::Random(5, 3), "a");
  embedhead::AdamW<float> adamw({}, {a});
  a->grad().dense_accumulator().setConstant(1.0f);
  adamw.step();
  SafetensorsWriter writer;
  embedhead::add_optimizer_state(writer, adamw.state());
  writer.write(path);
  CHECK(SafetensorsFile::open(path).metadata().count("optimizer.parameter_scalars") == 0);
  std::remove(path.c_str());
}

// fuzz/corpus/safetensors/crash-review-optimizer-*: read_optimizer_state allocated the buffer at
// the metadata's size before checking the tensor's shape (std::bad_alloc for 2^62 rows) and cast
// sizes beyond Index to negative ones (Eigen abort). Now: format_error, no allocation.
TEST_CASE("checkpoint: forged optimizer sizes in the metadata are refused before any allocation",
          "[checkpoint][fuzz]") {
  const std::string path = temp_path("forged_optimizer.safetensors");
  const RowMatrix<float> m = RowMatrix<float>::Ones(2, 2);
  const auto with_sizes = [&](const std::string& parameters) {
    SafetensorsWriter writer;
    writer.add<float>("optimizer.0.m", m, DType::F32)
        .set_metadata("optimizer", "adamw")
        .set_metadata("optimizer.step", "1")
        .set_metadata("optimizer.parameters", parameters);
    writer.write(path);
    return SafetensorsFile::open(path);
  };
  const auto huge = with_sizes(R"([["w",4611686018427387904,2]])");
  CHECK_THROWS_AS(embedhead::read_optimizer_state<float>(huge), format_error);
  CHECK_THROWS_WITH(embedhead::read_optimizer_state<float>(huge),
                    Catch::Contains("optimizer.0.m") && Catch::Contains("[4611686018427387904, 2]"));
  const auto beyond = with_sizes(R"([["w",9223372036854775808,0]])");
  CHECK_THROWS_AS(embedhead::read_optimizer_state<float>(beyond), format_error);
  CHECK_THROWS_WITH(embedhead::read_optimizer_state<float>(beyond),
                    Catch::Contains("entry 0") && Catch::Contains("9223372036854775808") &&
                        Catch::Contains("outside [0, 9223372036854775807]"));
  const auto fine = with_sizes(R"([["w",2,2]])");
  CHECK(embedhead::read_optimizer_state<float>(fine).parameters.at(0).buffers.at("m") == m);
  std::remove(path.c_str());
}

TEST_CASE("checkpoint: from_pretrained with freeze = true loads frozen layers", "[checkpoint]") {
  const Index V = 16, d = 4;
  const auto names = embedhead::hugging_face_names(ModelFamily::gpt2);
  auto source = table(V, d, 121);
  auto source_head = untied_head(V, d, 122, /*bias=*/true);
  LearnedPositionEmbedding<float> source_positions(6, d);
  const std::string path = temp_path("freeze.safetensors");
  embedhead::save_checkpoint<float>(path, names, source, &source_head, &source_positions);
  embedhead::PretrainedOptions options;
  options.freeze = true;
  auto layers = embedhead::from_pretrained<float>(SafetensorsFile::open(path), names, options);
  CHECK_FALSE(layers.tied);
  CHECK(layers.token_embedding.frozen());
  CHECK(layers.head.weight().frozen());
  CHECK(layers.head.bias()->frozen());
  CHECK(layers.position_embedding->weight().frozen());

  // A training step changes nothing: no gradient is accumulated and the optimizer skips them.
  embedhead::IdMatrix<std::int32_t> ids(1, 3);
  ids << 1, 5, 1;
  const RowMatrix<float> x = layers.token_embedding.forward(ids);
  const RowMatrix<float> dlogits = RowMatrix<float>::Ones(3, V);
  embedhead::AdamOptions adam;
  adam.lr = 0.1;
  AdamW<float> optimizer(adam, {layers.token_embedding.weight_ptr(), layers.head.weight_ptr(),
                                layers.position_embedding->weight_ptr()});
  const RowMatrix<float> dh = layers.head.backward(x, dlogits);
  layers.token_embedding.backward(ids, dh);
  layers.position_embedding->backward(dh, 1, 3);
  CHECK(layers.token_embedding.weight().grad().num_touched() == 0);
  CHECK(layers.position_embedding->weight().grad().num_touched() == 0);
  optimizer.step();
  CHECK(layers.token_embedding.weight().value() == source.weight().value());
  CHECK(layers.head.weight().value() == source_head.weight().value());
  CHECK(dh.allFinite());
  CHECK_FALSE(dh.isZero());  // the input gradient still flows through a frozen head

  // Unfrozen, the same step trains the table.
  layers.token_embedding.set_frozen(false);
  layers.token_embedding.backward(ids, dh);
  optimizer.step();
  CHECK(layers.token_embedding.weight().value() != source.weight().value());
  std::remove(path.c_str());
}

TEST_CASE("checkpoint: guess_model_family and from_pretrained refuse what they cannot read", "[checkpoint]") {
  RowMatrix<float> x = RowMatrix<float>::Ones(3, 2);
  const std::string path = temp_path("other.safetensors");
  SafetensorsWriter().add<float>("encoder.weight", x, DType::F32).write(path);
  const auto file = SafetensorsFile::open(path);
  CHECK_THROWS_AS(embedhead::guess_model_family(file), format_error);
  CHECK_THROWS_WITH(embedhead::guess_model_family(file),
                    Catch::Contains("wte.weight") && Catch::Contains("model.embed_tokens.weight"));
  CheckpointNames custom;
  custom.token_embedding = "encoder.weight";
  auto layers = embedhead::from_pretrained<float>(file, custom);  // any names work
  CHECK(layers.token_embedding.vocab_size() == 3);
  CHECK(layers.tied);
  SafetensorsWriter().add<float>("encoder.weight", x, DType::F32, false).write(path);
  RowMatrix<float> v = RowMatrix<float>::Ones(3, 1);
  SafetensorsWriter().add<float>("encoder.weight", v, DType::F32, true).write(path);
  CHECK_THROWS_AS(embedhead::from_pretrained<float>(SafetensorsFile::open(path), custom), shape_error);
  std::remove(path.c_str());
}

namespace {

// Allocates and fills blocks of many sizes, so that memory freed earlier is handed out again and
// overwritten: a writer still reading it would see -12345 (without ASan; ASan reports the read).
void overwrite_freed_memory() {
  std::vector<std::vector<float>> blocks;
  for (std::size_t size = 1; size <= 512; ++size) blocks.emplace_back(size, -12345.0f);
}

}  // namespace

// Issue 15, class 1: add_checkpoint stored pointers into the layers' storage, which dangled when
// the layers went (or a parameter was resized) before write().
TEST_CASE("checkpoint: add_checkpoint shares the layers' parameters until write(), which writes their values then",
          "[checkpoint][lifetime]") {
  const Index V = 12, d = 4;
  const auto names = embedhead::hugging_face_names(ModelFamily::llama);
  const std::string path = temp_path("lifetime.safetensors");
  SafetensorsWriter writer;
  RowMatrix<float> table_values, head_values, bias_values;
  std::shared_ptr<embedhead::Parameter<float>> kept_bias;
  {
    auto e = table(V, d, 131);
    auto h = untied_head(V, d, 132, /*bias=*/true);
    embedhead::add_checkpoint<float>(writer, names, e, &h);
    // Written as they are when write() runs: a change after add_checkpoint is in the file ...
    e.weight().value()(0, 0) = 7.5f;
    table_values = e.weight().value();
    head_values = h.weight().value();
    // ... also after a resize that came back to the added shape (each resize frees the old storage).
    kept_bias = h.bias_ptr();
    kept_bias->resize_rows(V + 4);
    kept_bias->resize_rows(V);
    kept_bias->value()(3, 0) = 2.5f;
    bias_values = kept_bias->value();
  }  // the layers are gone; the writer still holds their parameters
  overwrite_freed_memory();
  writer.write(path);
  const auto file = SafetensorsFile::open(path);
  CHECK(file.read<float>(names.token_embedding) == table_values);
  CHECK(file.read<float>(names.head_weight) == head_values);
  CHECK(file.read<float>(names.head_bias) == bias_values);
  CHECK(file.at(names.head_bias).shape_string() == "[12]");
  std::remove(path.c_str());
}

// A parameter resized between add_checkpoint and write() would have been written in its new shape
// beside tensors (or optimizer state) of the old one: write() refuses it, naming the tensor.
TEST_CASE("checkpoint: write() refuses a parameter resized since add_checkpoint; nothing written",
          "[checkpoint][lifetime][errors]") {
  const Index V = 12, d = 4;
  const auto names = embedhead::hugging_face_names(ModelFamily::llama);
  const std::string path = temp_path("resized.safetensors");
  auto e = table(V, d, 133);
  auto h = untied_head(V, d, 134, /*bias=*/true);
  embedhead::save_checkpoint<float>(path, names, e, &h);
  const std::string before = read_bytes(path);
  SafetensorsWriter writer;
  embedhead::add_checkpoint<float>(writer, names, e, &h);
  h.bias()->resize_rows(V + 4);
  REQUIRE_THROWS_AS(writer.write(path), shape_error);
  REQUIRE_THROWS_WITH(writer.write(path),
                      Catch::Contains("SafetensorsWriter::write: tensor 'lm_head.bias' was added as a Parameter of "
                                      "shape [12, 1] but it is [16, 1] now (resized since add); nothing was "
                                      "written"));
  CHECK(read_bytes(path) == before);
  CHECK(h.bias()->rows() == V + 4);  // the parameter is left as it is
  // The table too (a resize_vocabulary between add and write).
  h.bias()->resize_rows(V);
  e.weight().resize_rows(V - 2);
  REQUIRE_THROWS_WITH(writer.write(path), Catch::Contains("tensor 'model.embed_tokens.weight' was added as a "
                                                          "Parameter of shape [12, 4] but it is [10, 4] now"));
  CHECK(read_bytes(path) == before);
  // Back at the added shapes, the writer writes again.
  e.weight().resize_rows(V);
  writer.write(path);
  CHECK(SafetensorsFile::open(path).read<float>(names.head_bias) == h.bias()->value());
  std::remove(path.c_str());
}

// Issue 15, class 6: save_checkpoint as F16 stored a finite 1e5 as +inf (BF16: 3.4e38) without an
// error, and load_checkpoint then refused the file for its non-finite value.
TEST_CASE("checkpoint: save_checkpoint refuses a value its dtype cannot hold, naming the tensor; nothing written",
          "[checkpoint][errors]") {
  const Index V = 6, d = 3;
  const auto names = embedhead::hugging_face_names(ModelFamily::llama);
  const std::string path = temp_path("overflow.safetensors");
  auto e = table(V, d, 141);
  auto h = untied_head(V, d, 142);
  embedhead::save_checkpoint<float>(path, names, e, &h, nullptr, DType::F16);
  const std::string before = read_bytes(path);
  h.weight().value()(4, 2) = 1e5f;
  REQUIRE_THROWS_AS(embedhead::save_checkpoint<float>(path, names, e, &h, nullptr, DType::F16), value_error);
  REQUIRE_THROWS_WITH(embedhead::save_checkpoint<float>(path, names, e, &h, nullptr, DType::F16),
                      Catch::Contains("tensor 'lm_head.weight'") &&
                          Catch::Contains("value 100000 at (4, 2) overflows F16 (largest finite 65504)"));
  CHECK(read_bytes(path) == before);
  // The same value as BF16 fits; 3.4e38 does not.
  embedhead::save_checkpoint<float>(path, names, e, &h, nullptr, DType::BF16);
  CHECK(embedhead::from_pretrained<float>(SafetensorsFile::open(path), names).head.weight().value()(4, 2) == 99840.0f);
  e.weight().value()(1, 0) = -3.4e38f;
  REQUIRE_THROWS_WITH(embedhead::save_checkpoint<float>(path, names, e, &h, nullptr, DType::BF16),
                      Catch::Contains("tensor 'model.embed_tokens.weight'") &&
                          Catch::Contains("value -3.4e+38 at (1, 0) overflows BF16"));
  // F32 holds every float: the file loads back exactly.
  embedhead::save_checkpoint<float>(path, names, e, &h, nullptr, DType::F32);
  CHECK(embedhead::from_pretrained<float>(SafetensorsFile::open(path), names).token_embedding.weight().value() ==
        e.weight().value());
  std::remove(path.c_str());
}

// Issue 15, class 9 and the strong guarantee: add_optimizer_state let nlohmann's type_error out for
// a parameter name that is not UTF-8, and both add_* functions could leave the writer half-filled.
TEST_CASE("checkpoint: add_checkpoint and add_optimizer_state add all or nothing", "[checkpoint][errors]") {
  const Index V = 5, d = 2;
  auto e = table(V, d, 151);
  auto h = untied_head(V, d, 152);
  auto names = embedhead::hugging_face_names(ModelFamily::llama);
  RowMatrix<float> other = RowMatrix<float>::Ones(1, 1);
  SafetensorsWriter writer;
  writer.add<float>("other", other, DType::F32);
  names.head_weight = names.token_embedding;  // the second tensor's name is taken by the first
  REQUIRE_THROWS_AS(embedhead::add_checkpoint<float>(writer, names, e, &h), value_error);
  REQUIRE_THROWS_WITH(embedhead::add_checkpoint<float>(writer, names, e, &h),
                      Catch::Contains("'model.embed_tokens.weight' was added before"));
  CHECK_FALSE(writer.contains("model.embed_tokens.weight"));

  auto bad_name = std::make_shared<embedhead::Parameter<float>>(2, 2, "emb\xff");
  AdamW<float> adam(embedhead::AdamOptions{}, {e.weight_ptr(), bad_name});
  bad_name->grad().dense_accumulator().setOnes();
  e.weight().grad().dense_accumulator().setOnes();
  adam.step();
  REQUIRE_THROWS_AS(embedhead::add_optimizer_state(writer, adam.state()), value_error);
  REQUIRE_THROWS_WITH(embedhead::add_optimizer_state(writer, adam.state()),
                      Catch::Contains("add_optimizer_state: parameter 1's name 'emb\\xff' is not valid UTF-8"));
  CHECK_FALSE(writer.contains("optimizer.0.exp_avg"));
  auto bad_kind = adam.state();
  bad_kind.parameters.pop_back();
  bad_kind.optimizer = "adam\xc3";
  REQUIRE_THROWS_AS(embedhead::add_optimizer_state(writer, bad_kind), value_error);
  REQUIRE_THROWS_WITH(embedhead::add_optimizer_state(writer, bad_kind),
                      Catch::Contains("add_optimizer_state: the optimizer's kind 'adam\\xc3' is not valid UTF-8 (at "
                                      "byte 4)"));
  CHECK_FALSE(writer.contains("optimizer.0.exp_avg"));
  const std::string path = temp_path("all_or_nothing.safetensors");
  writer.write(path);
  const auto file = SafetensorsFile::open(path);
  CHECK(file.tensors().size() == 1);
  CHECK(file.metadata().empty());
  std::remove(path.c_str());
}

// An F64 buffer read as float with a finite value beyond float's range used to become an infinity.
TEST_CASE("checkpoint: read_optimizer_state<float> refuses an F64 buffer value float cannot hold",
          "[checkpoint][errors]") {
  const std::string path = temp_path("optimizer_beyond_float.safetensors");
  RowMatrix<double> m = RowMatrix<double>::Ones(3, 2);
  m(2, 1) = 1e300;
  SafetensorsWriter writer;
  writer.add<double>("optimizer.0.exp_avg", m, DType::F64)
      .set_metadata("optimizer", "AdamW")
      .set_metadata("optimizer.step", "1")
      .set_metadata("optimizer.parameters", R"([["E",3,2]])");
  writer.write(path);
  const auto file = SafetensorsFile::open(path);
  REQUIRE_THROWS_AS(embedhead::read_optimizer_state<float>(file), format_error);
  REQUIRE_THROWS_WITH(embedhead::read_optimizer_state<float>(file),
                      "safetensors: tensor 'optimizer.0.exp_avg' in '" + path +
                          "' has the F64 value 1e+300 at (2, 1), outside float's range [-3.40282e+38, "
                          "3.40282e+38]: read as float it would become an infinity (read it as double)");
  CHECK(embedhead::read_optimizer_state<double>(file).parameters.at(0).buffers.at("exp_avg") == m);
  std::remove(path.c_str());
}

// Issue 15, class 9: a buffer whose shape disagrees with the metadata's [rows, cols] was a
// shape_error; read_optimizer_state documents format_error (malformed optimizer state).
TEST_CASE("checkpoint: read_optimizer_state reports buffers that disagree with the metadata as format_error",
          "[checkpoint][errors]") {
  const std::string path = temp_path("optimizer_shapes.safetensors");
  const RowMatrix<float> m = RowMatrix<float>::Ones(2, 3);
  SafetensorsWriter writer;
  writer.add<float>("optimizer.0.exp_avg", m, DType::F32)
      .set_metadata("optimizer", "AdamW")
      .set_metadata("optimizer.step", "1")
      .set_metadata("optimizer.parameters", R"([["E",3,2]])");
  writer.write(path);
  const auto file = SafetensorsFile::open(path);
  REQUIRE_THROWS_AS(embedhead::read_optimizer_state<float>(file), format_error);
  REQUIRE_THROWS_WITH(embedhead::read_optimizer_state<float>(file),
                      Catch::Contains("read_optimizer_state: '" + path + "'") &&
                          Catch::Contains("'optimizer.0.exp_avg' is [2, 3]") &&
                          Catch::Contains("parameter 0 ('E') is [3, 2]"));
  std::remove(path.c_str());
}

TEST_CASE("optimizer state: the state of a parameter's trainable rows only round-trips with its row ids",
          "[checkpoint][trainable_rows]") {
  auto p = std::make_shared<embedhead::Parameter<float>>(RowMatrix<float>(RowMatrix<float>::Random(10, 3)), "E");
  const std::vector<Index> rows = {2, 3, 7};
  p->set_trainable_rows(rows);
  embedhead::AdamOptions adam;
  adam.lr = 1e-2;
  AdamW<float> optimizer(adam, {p});
  std::vector<Index> slots(rows.size());
  p->grad().touch_rows(rows.data(), 3, slots.data());
  for (const Index s : slots) p->grad().slot_row(s).setConstant(0.5f);
  optimizer.step();

  const std::string path = temp_path("trainable_rows.safetensors");
  SafetensorsWriter writer;
  embedhead::add_optimizer_state(writer, optimizer.state());
  writer.write(path);
  const auto file = SafetensorsFile::open(path);
  CHECK(file.metadata().at("optimizer.trainable_rows") == "[[2,3,7]]");
  const auto read = embedhead::read_optimizer_state<float>(file);
  REQUIRE(read.parameters[0].trainable_rows.has_value());
  CHECK(*read.parameters[0].trainable_rows == rows);
  CHECK(read.parameters[0].buffers.at("exp_avg").rows() == 3);
  CHECK(read.parameters[0].buffers.at("exp_avg") == optimizer.state().parameters[0].buffers.at("exp_avg"));

  // A parameter with the same rows loads it; one with every row trainable refuses it.
  auto q = std::make_shared<embedhead::Parameter<float>>(10, 3, "E");
  AdamW<float> resumed(adam, {q});
  CHECK_THROWS_WITH(resumed.load_state(read),
                    Catch::Matchers::Contains("has state for 3 trainable rows but every row (10) here"));
  q->set_trainable_rows(rows);
  resumed.load_state(read);
  CHECK(resumed.state().parameters[0].buffers.at("exp_avg_sq") ==
        optimizer.state().parameters[0].buffers.at("exp_avg_sq"));

  // Malformed row ids: not increasing, or outside the parameter's rows.
  for (const char* ids : {"[[3,2,7]]", "[[2,3,10]]"}) {
    SafetensorsWriter bad;
    embedhead::add_optimizer_state(bad, optimizer.state());
    bad.set_metadata("optimizer.trainable_rows", ids);
    bad.write(path);
    CHECK_THROWS_AS(embedhead::read_optimizer_state<float>(SafetensorsFile::open(path)), format_error);
  }
  std::remove(path.c_str());
}
