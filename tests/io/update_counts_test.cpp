// Tests for include/embedhead/io/update_counts.hpp: a RowUpdateCounter saved beside a checkpoint
// and read back, and the malformed files read_update_counts refuses.
#include <embedhead/io/checkpoint.hpp>
#include <embedhead/io/update_counts.hpp>
#include <embedhead/optim/lazy_adam.hpp>
#include <embedhead/optim/untrained_guard.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "../reference/files.hpp"

using Catch::Matchers::Contains;
using embedhead::DType;
using embedhead::format_error;
using embedhead::Index;
using embedhead::RowMatrix;
using embedhead::RowUpdateCounter;
using embedhead::SafetensorsFile;
using embedhead::SafetensorsWriter;

namespace {
std::string temp_path(const std::string& name) { return test_support::temp_path("update_counts_test", name); }
}  // namespace

TEST_CASE("update counts: saved beside a checkpoint and read back exactly", "[update_counts]") {
  embedhead::TokenEmbedding<float> embedding(9, 4);
  RowUpdateCounter counter(9);
  counter.record_rows({0, 2, 3, 8});
  counter.record_rows({2, 8});
  counter.record_rows({8});
  const std::string path = temp_path("counts.safetensors");
  SafetensorsWriter writer;
  embedhead::add_checkpoint<float>(writer, embedhead::hugging_face_names(embedhead::ModelFamily::llama), embedding);
  embedhead::add_update_counts(writer, counter);
  embedhead::add_update_counts(writer, RowUpdateCounter(3), "head.update_counts");  // a second one, its own name
  writer.write(path);

  const SafetensorsFile file = SafetensorsFile::open(path);
  const RowUpdateCounter restored = embedhead::read_update_counts(file);
  CHECK(restored.counts() == counter.counts());
  CHECK(restored.records() == 3);
  CHECK(embedhead::read_update_counts(file, "head.update_counts").counts() == std::vector<std::int64_t>{0, 0, 0});
  // The checkpoint loads as before: the counts are one more tensor beside it.
  embedhead::TokenEmbedding<float> loaded(9, 4, embedhead::TokenEmbeddingOptions{0.02, 5, {}, false});
  embedhead::load_checkpoint<float>(file, embedhead::hugging_face_names(embedhead::ModelFamily::llama), loaded);
  CHECK(loaded.weight().value() == embedding.weight().value());
  std::remove(path.c_str());

  // The same name twice is the writer's error, and the writer is unchanged.
  CHECK_THROWS_AS(embedhead::add_update_counts(writer, counter), embedhead::value_error);
}

TEST_CASE("update counts: malformed files are format errors naming what is wrong", "[update_counts][errors]") {
  const std::string path = temp_path("bad.safetensors");
  const auto write = [&](const RowMatrix<double>& counts, const std::string& records, DType dtype = DType::F64) {
    SafetensorsWriter writer;
    writer.add<double>("embedhead.update_counts", counts, dtype, /*as_vector=*/counts.cols() == 1);
    if (!records.empty()) writer.set_metadata("embedhead.update_counts.records", records);
    writer.write(path);
    return SafetensorsFile::open(path, embedhead::ReadMode::copy);
  };
  RowMatrix<double> counts(3, 1);
  counts << 0, 2, 1;
  CHECK(embedhead::read_update_counts(write(counts, "2")).counts() == std::vector<std::int64_t>{0, 2, 1});
  CHECK(embedhead::read_update_counts(write(counts, "2", DType::F32)).records() == 2);

  CHECK_THROWS_AS(embedhead::read_update_counts(write(counts, "")), format_error);
  CHECK_THROWS_WITH(embedhead::read_update_counts(write(counts, "")),
                    Contains("no metadata 'embedhead.update_counts.records'"));
  CHECK_THROWS_WITH(embedhead::read_update_counts(write(counts, "2x")),
                    Contains("metadata 'embedhead.update_counts.records' = '2x' is not a non-negative integer"));
  CHECK_THROWS_WITH(embedhead::read_update_counts(write(counts, "-1")), Contains("is not a non-negative integer"));
  CHECK_THROWS_WITH(embedhead::read_update_counts(write(counts, " 2")), Contains("' 2' is not a non-negative integer"));
  CHECK_THROWS_WITH(embedhead::read_update_counts(write(counts, "+2")), Contains("'+2' is not a non-negative integer"));
  CHECK_THROWS_WITH(embedhead::read_update_counts(write(counts, "1")),
                    Contains("has the count 2 at row 1, not an integer in [0, 1] (records)"));
  counts(2, 0) = 0.5;
  CHECK_THROWS_WITH(embedhead::read_update_counts(write(counts, "2")), Contains("has the count 0.5 at row 2"));
  counts(2, 0) = -1;
  CHECK_THROWS_WITH(embedhead::read_update_counts(write(counts, "2")), Contains("has the count -1 at row 2"));
  CHECK_THROWS_WITH(embedhead::read_update_counts(write(counts, "2", DType::BF16)),
                    Contains("has dtype BF16; update counts are F64 (or F32)"));
  CHECK_THROWS_WITH(embedhead::read_update_counts(write(RowMatrix<double>::Zero(2, 3), "2")),
                    Contains("is [2, 3]; update counts are [rows] or [rows, 1]"));
  CHECK_THROWS_WITH(embedhead::read_update_counts(write(counts, "2"), "other"),
                    Contains("no tensor 'other' (no update counts saved here)"));
  std::remove(path.c_str());
}

TEST_CASE("update counts: fine-tuning from a checkpoint saved with its counts (docs/api.md)", "[update_counts]") {
  using Ids = embedhead::IdMatrix<std::int64_t>;
  const auto names = embedhead::hugging_face_names(embedhead::ModelFamily::llama);
  const std::string path = temp_path("pretrained.safetensors");
  {
    // "Pre-training" that never sees the reserved tokens 6 and 7.
    embedhead::TokenEmbedding<float> pretrained(8, 3);
    RowUpdateCounter seen(8);
    seen.record_ids((Ids(1, 6) << 0, 1, 2, 3, 4, 5).finished());
    SafetensorsWriter writer;
    embedhead::add_checkpoint<float>(writer, names, pretrained);
    embedhead::add_update_counts(writer, seen);
    writer.write(path);
  }
  const SafetensorsFile file = SafetensorsFile::open(path);
  embedhead::TokenEmbedding<float> embedding(8, 3);
  embedhead::load_checkpoint<float>(file, names, embedding);
  embedhead::LazyAdam<float> optimizer({}, embedding.parameters());
  const std::vector<Ids> batches = {(Ids(2, 2) << 1, 6, 6, 2).finished(), (Ids(1, 3) << 7, 0, 6).finished()};
  Index untrained_tokens = 0;

  embedhead::RowUpdateCounter counter = embedhead::read_update_counts(file);
  const std::vector<Index> repaired = embedhead::repair_untrained_rows(embedding.weight(), counter);
  for (const Ids& batch : batches) {
    const embedhead::UntrainedReport report = counter.check(batch);  // repaired rows still count 0
    untrained_tokens += report.occurrences;
    embedding.backward(batch, RowMatrix<float>::Ones(batch.size(), embedding.dim()));
    counter.record(embedding.weight());
    optimizer.step();
    optimizer.zero_grad();
  }

  CHECK(repaired == std::vector<Index>{6, 7});
  CHECK(untrained_tokens == 3);  // 6 twice in the first batch; 7 in the second (6 was updated by then)
  CHECK(counter.counts() == std::vector<std::int64_t>{2, 2, 2, 1, 1, 1, 2, 1});
  CHECK(counter.records() == 3);
  std::remove(path.c_str());
}
