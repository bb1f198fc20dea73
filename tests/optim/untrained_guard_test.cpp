// Tests for include/embedhead/optim/untrained_guard.hpp: the per-row update counter, the batch
// check, the repair to the mean of the trained rows and the norm-based detector.
//
// References are written out here: the counts by hand from the batches, the mean in double over
// the rows the test knows are trained; never the library's own code.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <embedhead/optim/lazy_adam.hpp>
#include <embedhead/optim/untrained_guard.hpp>
#include <embedhead/token_embedding.hpp>
#include <embedhead/vocabulary.hpp>
#include <memory>
#include <string>
#include <vector>

#include "../reference/test_support.hpp"
#include "optim_support.hpp"

namespace {

using Catch::Matchers::Contains;
using embedhead::FindUntrainedOptions;
using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::Parameter;
using embedhead::RowMatrix;
using embedhead::RowUpdateCounter;
using embedhead::UntrainedCheckOptions;
using embedhead::UntrainedPolicy;
using embedhead::UntrainedRepairOptions;
using test_support::random_matrix;
using test_support::same_values;

using Ids = IdMatrix<std::int64_t>;

Ids ids_of(std::initializer_list<std::initializer_list<std::int64_t>> rows) {
  Ids out(static_cast<Index>(rows.size()), static_cast<Index>(rows.begin()->size()));
  Index b = 0;
  for (const auto& row : rows) {
    Index t = 0;
    for (const auto id : row) out(b, t++) = id;
    ++b;
  }
  return out;
}

// One training step of the embedding on `ids`: forward, backward with dout = 1, record, LazyAdam
// step, zero_grad.
void train_step(embedhead::TokenEmbedding<float>& embedding, embedhead::LazyAdam<float>& optimizer,
                RowUpdateCounter& counter, const Ids& ids) {
  const RowMatrix<float> dout = RowMatrix<float>::Ones(ids.size(), embedding.dim());
  embedding.backward(ids, dout);
  counter.record(embedding.weight());
  optimizer.step();
  optimizer.zero_grad();
}

// The mean of rows `rows` of `values`, in double.
template <typename Matrix>
std::vector<double> mean_of_rows(const Matrix& values, const std::vector<Index>& rows) {
  std::vector<double> mean(static_cast<std::size_t>(values.cols()), 0.0);
  for (const Index r : rows)
    for (Index c = 0; c < values.cols(); ++c) mean[static_cast<std::size_t>(c)] += static_cast<double>(values(r, c));
  for (double& m : mean) m /= static_cast<double>(rows.size());
  return mean;
}

}  // namespace

TEST_CASE("untrained guard: counts after a few steps equal hand counts", "[untrained_guard]") {
  embedhead::TokenEmbeddingOptions options;
  options.padding_idx = 0;
  embedhead::TokenEmbedding<float> embedding(10, 4, options);
  embedhead::AdamOptions adam;
  adam.lr = 0.1;
  embedhead::LazyAdam<float> optimizer(adam, embedding.parameters());
  RowUpdateCounter counter(10);
  const RowMatrix<float> initial = embedding.weight().value();

  // Repeats within a batch count once per step; the padding id gets no gradient, so no count.
  train_step(embedding, optimizer, counter, ids_of({{1, 2, 2}, {3, 1, 5}}));  // 1 2 3 5
  train_step(embedding, optimizer, counter, ids_of({{2, 2, 2}}));             // 2
  train_step(embedding, optimizer, counter, ids_of({{7, 1, 0}, {0, 0, 1}}));  // 1 7 (0 is padding)
  const std::vector<std::int64_t> expected = {0, 2, 2, 1, 0, 1, 0, 1, 0, 0};
  CHECK(counter.counts() == expected);
  CHECK(counter.records() == 3);
  CHECK(counter.num_trained() == 5);
  CHECK(counter.count(2) == 2);
  CHECK_FALSE(counter.trained(4));
  CHECK(counter.untrained_rows() == std::vector<Index>{0, 4, 6, 8, 9});

  // Count 0 is exactly "never updated" under the lazy optimizer: those rows kept their values.
  for (Index r = 0; r < 10; ++r) {
    INFO("row " << r);
    CHECK((embedding.weight().value().row(r) == initial.row(r)) == (counter.count(r) == 0));
  }

  // A step with no gradient, or of a frozen table, counts nothing (the optimizers skip both).
  counter.record(embedding.weight());
  CHECK(counter.records() == 3);
  embedding.set_frozen(true);
  embedding.backward(ids_of({{4}}), RowMatrix<float>::Ones(1, 4));
  counter.record(embedding.weight());
  CHECK(counter.counts() == expected);
  CHECK(counter.records() == 3);
  embedding.set_frozen(false);

  // A dense gradient (a tied head's dW) touches, and counts, every row.
  embedding.weight().grad().dense_accumulator();
  counter.record(embedding.weight());
  for (Index r = 0; r < 10; ++r) CHECK(counter.count(r) == expected[static_cast<std::size_t>(r)] + 1);
  CHECK(counter.records() == 4);
}

TEST_CASE("untrained guard: record_ids and record_rows count each distinct row once", "[untrained_guard]") {
  RowUpdateCounter counter(6);
  const IdMatrix<std::int32_t> ids32 = (IdMatrix<std::int32_t>(2, 3) << 5, 1, 5, 1, 1, 3).finished();
  counter.record_ids(ids32);
  counter.record_ids(ids_of({{3, 3}}));
  counter.record_rows({0, 5});
  counter.record_rows({});  // nothing: not a record
  CHECK(counter.counts() == std::vector<std::int64_t>{1, 1, 0, 2, 0, 2});
  CHECK(counter.records() == 3);
}

TEST_CASE("untrained guard: check reports the untrained ids of a batch", "[untrained_guard]") {
  RowUpdateCounter counter(10);
  counter.record_rows({1, 2, 3, 7});
  const Ids batch = ids_of({{1, 4, 9, 4}, {2, 0, 4, 3}});
  const auto report = counter.check(batch);
  REQUIRE(report.ids.size() == 3);
  CHECK(report.occurrences == 5);
  CHECK(report.ids[0].id == 0);
  CHECK(report.ids[0].occurrences == 1);
  CHECK(report.ids[0].first_token == 5);
  CHECK((report.ids[0].b == 1 && report.ids[0].t == 1));
  CHECK(report.ids[1].id == 4);
  CHECK(report.ids[1].occurrences == 3);
  CHECK(report.ids[1].first_token == 1);
  CHECK((report.ids[1].b == 0 && report.ids[1].t == 1));
  CHECK(report.ids[2].id == 9);
  CHECK(report.ids[2].occurrences == 1);
  CHECK(report.ids[2].first_token == 2);

  // int32 ids, a column-major view: the same answer.
  const Eigen::Matrix<std::int32_t, Eigen::Dynamic, Eigen::Dynamic> col_major = batch.cast<std::int32_t>();
  const auto again = counter.check(col_major);
  REQUIRE(again.ids.size() == 3);
  CHECK(again.ids[1].first_token == 1);

  // The padding id is never flagged.
  UntrainedCheckOptions options;
  options.padding_idx = 0;
  const auto without_padding = counter.check(batch, options);
  REQUIRE(without_padding.ids.size() == 2);
  CHECK(without_padding.ids[0].id == 4);
  CHECK(without_padding.occurrences == 4);

  // A clean batch: an empty report, and no throw under throw_error.
  options.policy = UntrainedPolicy::throw_error;
  CHECK(counter.check(ids_of({{1, 2}, {7, 0}}), options).empty());
  CHECK(counter.check(Ids(0, 3), options).empty());
}

TEST_CASE("untrained guard: check throws under throw_error, naming the first untrained id",
          "[untrained_guard][errors]") {
  RowUpdateCounter counter(10);
  counter.record_rows({1, 2, 3, 7});
  UntrainedCheckOptions options;
  options.policy = UntrainedPolicy::throw_error;
  const Ids batch = ids_of({{1, 2, 3, 7}, {2, 9, 4, 9}});
  CHECK_THROWS_AS(counter.check(batch, options), embedhead::untrained_token_error);
  CHECK_THROWS_AS(counter.check(batch, options), embedhead::value_error);
  CHECK_THROWS_WITH(counter.check(batch, options),
                    Contains("RowUpdateCounter::check: id 9 at (b=1, t=1) has a row that no step updated (count 0)") &&
                        Contains("2 distinct ids of the batch (3 tokens) are untrained: 4, 9") &&
                        Contains("repair_untrained_rows"));
  try {
    counter.check(batch, options);
    FAIL("no throw");
  } catch (const embedhead::untrained_token_error& e) {
    REQUIRE(e.report().ids.size() == 2);
    CHECK(e.report().ids[0].id == 4);
    CHECK(e.report().ids[1].occurrences == 2);
  }
  CHECK_THROWS_WITH(counter.check(ids_of({{5}}), options),
                    Contains("id 5 at (b=0, t=0)") && Contains("1 distinct id of the batch (1 token) is untrained: 5"));
}

TEST_CASE("untrained guard: ids out of range are an index_error naming the id, position and range",
          "[untrained_guard][errors]") {
  RowUpdateCounter counter(10);
  counter.record_rows({1});
  const std::vector<std::int64_t> before = counter.counts();
  for (const auto policy : {UntrainedPolicy::report, UntrainedPolicy::throw_error}) {
    UntrainedCheckOptions options;
    options.policy = policy;
    CHECK_THROWS_AS(counter.check(ids_of({{1, 2}, {3, 10}}), options), embedhead::index_error);
    CHECK_THROWS_WITH(counter.check(ids_of({{1, 2}, {3, 10}}), options),
                      Contains("RowUpdateCounter::check: id 10 at (b=1, t=1) outside [0, 10)"));
    CHECK_THROWS_WITH(counter.check(ids_of({{-1, 2}}), options), Contains("id -1 at (b=0, t=0) outside [0, 10)"));
    options.valid_vocab = 8;
    CHECK_THROWS_WITH(counter.check(ids_of({{1, 8}}), options), Contains("id 8 at (b=0, t=1) outside [0, 8)"));
    options.valid_vocab = 11;
    CHECK_THROWS_WITH(counter.check(ids_of({{1}}), options), Contains("valid_vocab = 11 outside [1, 10]"));
  }
  CHECK_THROWS_WITH(counter.record_ids(ids_of({{3, 12}})),
                    Contains("RowUpdateCounter::record_ids: id 12 at (b=0, t=1) outside [0, 10)"));
  CHECK(counter.counts() == before);
  CHECK(counter.records() == 1);
}

TEST_CASE("untrained guard: repair sets untrained rows to the mean of the trained rows", "[untrained_guard]") {
  const Index V = 9, d = 5;
  auto table = optim_support::make_parameter<float>(V, d, 11, "E");
  table->value().row(2).setZero();
  table->value().row(6).setConstant(1e-7f);
  RowUpdateCounter counter(V);
  counter.record_rows({0, 1, 3, 4, 5, 7});
  counter.record_rows({1, 3});
  const RowMatrix<float> before = table->value();
  const std::vector<double> mean = mean_of_rows(before, {0, 1, 3, 4, 5, 7});

  const std::vector<Index> repaired = embedhead::repair_untrained_rows(*table, counter);
  CHECK(repaired == std::vector<Index>{2, 6, 8});
  for (Index r = 0; r < V; ++r) {
    INFO("row " << r);
    if (std::find(repaired.begin(), repaired.end(), r) == repaired.end()) {
      CHECK(same_values(table->value().row(r), before.row(r)));
      continue;
    }
    for (Index c = 0; c < d; ++c) CHECK(table->value()(r, c) == static_cast<float>(mean[static_cast<std::size_t>(c)]));
  }
  // The counts are not changed; a second repair finds the same rows and writes the same values.
  CHECK(counter.untrained_rows() == repaired);
  const RowMatrix<float> once = table->value();
  CHECK(embedhead::repair_untrained_rows(*table, counter) == repaired);
  CHECK(same_values(table->value(), once));
  // After record_rows(repaired) nothing is left to repair.
  counter.record_rows(repaired);
  CHECK(embedhead::repair_untrained_rows(*table, counter).empty());
  CHECK(same_values(table->value(), once));
}

TEST_CASE("untrained guard: repair with padding_idx and valid_vocab, and with an explicit list", "[untrained_guard]") {
  const Index V = 8, d = 3;
  auto table = optim_support::make_parameter<double>(V, d, 3, "E");
  table->value().row(0).setZero();         // padding_idx
  table->value().bottomRows(2).setZero();  // padding rows [6, 8), "trained" by a dense gradient
  RowUpdateCounter counter(V);
  counter.record_rows({1, 2, 4, 6, 7});
  const RowMatrix<double> before = table->value();

  UntrainedRepairOptions options;
  options.padding_idx = 0;
  options.valid_vocab = 6;
  CHECK(embedhead::repair_untrained_rows(*table, counter, options) == std::vector<Index>{3, 5});
  const std::vector<double> mean = mean_of_rows(before, {1, 2, 4});
  for (const Index r : {3, 5})
    for (Index c = 0; c < d; ++c) CHECK(table->value()(r, c) == mean[static_cast<std::size_t>(c)]);
  for (const Index r : {0, 1, 2, 4, 6, 7}) CHECK(same_values(table->value().row(r), before.row(r)));

  // An explicit list: the mean of the unlisted rows (below valid_vocab, not the padding row).
  auto other = optim_support::make_parameter<double>(V, d, 4, "E2");
  const RowMatrix<double> other_before = other->value();
  embedhead::repair_rows(*other, {2, 5}, nullptr, options);
  const std::vector<double> unlisted = mean_of_rows(other_before, {1, 3, 4});
  for (const Index r : {2, 5})
    for (Index c = 0; c < d; ++c) CHECK(other->value()(r, c) == unlisted[static_cast<std::size_t>(c)]);
  // With a counter: the unlisted rows that are also trained.
  auto third = optim_support::make_parameter<double>(V, d, 5, "E3");
  const RowMatrix<double> third_before = third->value();
  embedhead::repair_rows(*third, {3}, &counter, options);
  const std::vector<double> trained = mean_of_rows(third_before, {1, 2, 4});
  for (Index c = 0; c < d; ++c) CHECK(third->value()(3, c) == trained[static_cast<std::size_t>(c)]);
  // An empty list changes nothing.
  embedhead::repair_rows(*third, {}, &counter, options);
}

TEST_CASE("untrained guard: a bf16 table's mean is rounded once, to the nearest bf16", "[untrained_guard]") {
  const Index V = 7, d = 16;
  const RowMatrix<double> source = random_matrix<double>(V, d, 21);
  Parameter<Eigen::bfloat16, float> table(source.cast<float>().cast<Eigen::bfloat16>(), "E");
  RowUpdateCounter counter(V);
  counter.record_rows({0, 1, 2, 4, 6});
  const RowMatrix<Eigen::bfloat16> before = table.value();
  RowMatrix<double> widened(V, d);
  for (Index r = 0; r < V; ++r)
    for (Index c = 0; c < d; ++c) widened(r, c) = static_cast<double>(static_cast<float>(before(r, c)));
  const std::vector<double> mean = mean_of_rows(widened, {0, 1, 2, 4, 6});
  CHECK(embedhead::repair_untrained_rows(table, counter) == std::vector<Index>{3, 5});
  // The nearest bf16: neither neighbour (one unit in the last place either way) is closer.
  const auto neighbour = [](Eigen::bfloat16 x, int step) {
    const auto bits = static_cast<std::uint16_t>(Eigen::numext::bit_cast<std::uint16_t>(x) + step);
    return static_cast<double>(static_cast<float>(Eigen::numext::bit_cast<Eigen::bfloat16>(bits)));
  };
  for (const Index r : {3, 5})
    for (Index c = 0; c < d; ++c) {
      const double m = mean[static_cast<std::size_t>(c)];
      const Eigen::bfloat16 got = table.value()(r, c);
      const double error = std::fabs(static_cast<double>(static_cast<float>(got)) - m);
      INFO("row " << r << " col " << c << " mean " << m);
      CHECK(error <= std::fabs(neighbour(got, 1) - m));
      CHECK(error <= std::fabs(neighbour(got, -1) - m));
    }
  for (const Index r : {0, 1, 2, 4, 6})
    for (Index c = 0; c < d; ++c)
      CHECK(Eigen::numext::bit_cast<std::uint16_t>(Eigen::bfloat16(table.value()(r, c))) ==
            Eigen::numext::bit_cast<std::uint16_t>(Eigen::bfloat16(before(r, c))));
}

TEST_CASE("untrained guard: all-negative trained rows are neither flagged nor changed", "[untrained_guard]") {
  // The bug of value-based detectors: "max(row) <= threshold" flags a trained row whose entries are
  // all negative. Counting cannot, and the norm-based detector does not.
  const Index V = 12, d = 6;
  RowMatrix<float> values = random_matrix<float>(V, d, 7);
  values = -(values.cwiseAbs().array() + 0.1f).matrix();  // every trained entry in (-1.1, -0.1]
  const std::vector<Index> untrained = {3, 8, 11};
  values.row(3).setZero();
  values.row(8).setZero();
  values.row(11).setConstant(-1e-6f);  // tiny, negative: untrained too
  Parameter<float> table(values, "E");

  // The detector this replaces would flag every row.
  Index flagged_by_max = 0;
  for (Index r = 0; r < V; ++r) flagged_by_max += table.value().row(r).maxCoeff() <= 0.0f ? 1 : 0;
  CHECK(flagged_by_max == V);

  CHECK(embedhead::find_untrained_rows(table) == untrained);
  FindUntrainedOptions find;
  find.relative_norm = 0;  // exact zeros only
  CHECK(embedhead::find_untrained_rows(table, find) == std::vector<Index>{3, 8});

  RowUpdateCounter counter(V);
  std::vector<Index> trained;
  for (Index r = 0; r < V; ++r)
    if (std::find(untrained.begin(), untrained.end(), r) == untrained.end()) trained.push_back(r);
  counter.record_rows(trained);
  UntrainedCheckOptions report;
  CHECK(counter.check(ids_of({{0, 1, 2, 4, 5, 6, 7, 9, 10}}), report).empty());

  const RowMatrix<float> before = table.value();
  CHECK(embedhead::repair_untrained_rows(table, counter) == untrained);
  for (const Index r : trained) CHECK(same_values(table.value().row(r), before.row(r)));
  const std::vector<double> mean = mean_of_rows(before, trained);
  for (const Index r : untrained)
    for (Index c = 0; c < d; ++c) {
      CHECK(table.value()(r, c) == static_cast<float>(mean[static_cast<std::size_t>(c)]));
      CHECK(table.value()(r, c) < 0.0f);
    }
  // Repaired, nothing is small any more.
  CHECK(embedhead::find_untrained_rows(table).empty());
}

TEST_CASE("untrained guard: find_untrained_rows with padding and valid_vocab", "[untrained_guard]") {
  RowMatrix<double> values = random_matrix<double>(10, 4, 9);
  values.row(0).setZero();          // padding_idx: never flagged
  values.row(4).setConstant(1e-5);  // tiny
  values.bottomRows(2).setZero();   // padding rows
  Parameter<double> table(values, "E");
  FindUntrainedOptions options;
  CHECK(embedhead::find_untrained_rows(table, options) == std::vector<Index>{0, 4, 8, 9});
  options.padding_idx = 0;
  options.valid_vocab = 8;
  CHECK(embedhead::find_untrained_rows(table, options) == std::vector<Index>{4});
  options.relative_norm = 1;
  CHECK_THROWS_WITH(embedhead::find_untrained_rows(table, options),
                    Contains("find_untrained_rows: relative_norm = 1 outside [0, 1)"));
  options.relative_norm = 0.5;
  options.padding_idx = 10;
  CHECK_THROWS_AS(embedhead::find_untrained_rows(table, options), embedhead::index_error);
}

TEST_CASE("untrained guard: bad repair inputs are clear errors and change nothing", "[untrained_guard][errors]") {
  const Index V = 6, d = 3;
  auto table = optim_support::make_parameter<float>(V, d, 13, "E");
  const RowMatrix<float> before = table->value();
  RowUpdateCounter counter(V);

  // No trained row: no mean.
  CHECK_THROWS_AS(embedhead::repair_untrained_rows(*table, counter), embedhead::value_error);
  CHECK_THROWS_WITH(embedhead::repair_untrained_rows(*table, counter),
                    Contains("repair_untrained_rows: no row is trained (count > 0)") &&
                        Contains("nothing was changed"));
  CHECK(same_values(table->value(), before));

  counter.record_rows({1, 4});
  const std::vector<std::int64_t> counts = counter.counts();
  // The only trained rows are beyond valid_vocab, or the padding row.
  UntrainedRepairOptions options;
  options.valid_vocab = 1;
  CHECK_THROWS_WITH(embedhead::repair_untrained_rows(*table, counter, options), Contains("no row is trained"));
  options.valid_vocab = 7;
  CHECK_THROWS_WITH(embedhead::repair_untrained_rows(*table, counter, options),
                    Contains("valid_vocab = 7 outside [1, 6]"));
  options = {};
  options.padding_idx = 6;
  CHECK_THROWS_AS(embedhead::repair_untrained_rows(*table, counter, options), embedhead::index_error);
  // Another row count.
  RowUpdateCounter wrong(V + 1);
  CHECK_THROWS_AS(embedhead::repair_untrained_rows(*table, wrong), embedhead::shape_error);
  CHECK_THROWS_WITH(embedhead::repair_untrained_rows(*table, wrong), Contains("has 6 rows but the counter 7"));

  // Explicit lists: unsorted, repeated, out of range, the padding row; everything unlisted untrained.
  CHECK_THROWS_AS(embedhead::repair_rows(*table, {3, 2}), embedhead::value_error);
  CHECK_THROWS_WITH(embedhead::repair_rows(*table, {3, 2}),
                    Contains("repair_rows: rows must be strictly increasing (sorted, no repeats), but row 2 at index 1 "
                             "follows 3"));
  CHECK_THROWS_WITH(embedhead::repair_rows(*table, {2, 2}), Contains("row 2 at index 1 follows 2"));
  CHECK_THROWS_AS(embedhead::repair_rows(*table, {2, 6}), embedhead::index_error);
  CHECK_THROWS_WITH(embedhead::repair_rows(*table, {2, 6}), Contains("repair_rows: row 6 at index 1 outside [0, 6)"));
  CHECK_THROWS_WITH(embedhead::repair_rows(*table, {-1}), Contains("row -1 at index 0 outside [0, 6)"));
  options = {};
  options.padding_idx = 2;
  CHECK_THROWS_WITH(embedhead::repair_rows(*table, {2, 3}, nullptr, options), Contains("row 2 is the padding_idx"));
  CHECK_THROWS_WITH(embedhead::repair_rows(*table, {1, 2, 4}, &counter),
                    Contains("repair_rows: no row is unlisted trained (count > 0)"));
  CHECK_THROWS_AS(embedhead::repair_rows(*table, {0}, &wrong), embedhead::shape_error);
  CHECK(same_values(table->value(), before));

  // A mean that is not finite: a trained row holds an infinity.
  table->value()(4, 1) = std::numeric_limits<float>::infinity();
  const RowMatrix<float> with_inf = table->value();
  CHECK_THROWS_WITH(embedhead::repair_untrained_rows(*table, counter),
                    Contains("the mean of the 2 trained (count > 0) rows is inf in column 1"));
  CHECK(same_values(table->value(), with_inf));
  table->value()(4, 1) = before(4, 1);
  CHECK(same_values(table->value(), before));
  CHECK(counter.counts() == counts);

  // An fp16 table near its largest value: the mean (62752) is finite and exact.
  RowMatrix<float> big = RowMatrix<float>::Constant(3, 2, 6e4f);
  big(1, 0) = 65504.0f;
  Parameter<Eigen::half, float> half_table(big.cast<Eigen::half>(), "H");
  RowUpdateCounter half_counter(3);
  half_counter.record_rows({0, 1});
  CHECK_NOTHROW(embedhead::repair_untrained_rows(half_table, half_counter));  // 62752 rounds to 62752
}

TEST_CASE("untrained guard: bad counter inputs are clear errors and change nothing", "[untrained_guard][errors]") {
  RowUpdateCounter counter(5);
  counter.record_rows({0, 3});
  const std::vector<std::int64_t> counts = counter.counts();
  CHECK_THROWS_AS(counter.record_rows({3, 1}), embedhead::value_error);
  CHECK_THROWS_WITH(counter.record_rows({1, 1}),
                    Contains(
                        "RowUpdateCounter::record_rows: rows must be strictly increasing (sorted, no repeats), but "
                        "row 1 at index 1 follows 1"));
  CHECK_THROWS_AS(counter.record_rows({1, 5}), embedhead::index_error);
  CHECK_THROWS_WITH(counter.record_rows({1, 5}),
                    Contains("RowUpdateCounter::record_rows: row 5 at index 1 outside [0, 5)"));
  CHECK_THROWS_AS(counter.count(5), embedhead::index_error);
  Parameter<float> resized(6, 2, "E");
  CHECK_THROWS_AS(counter.record(resized), embedhead::shape_error);
  CHECK_THROWS_WITH(counter.record(resized),
                    Contains("RowUpdateCounter::record: parameter 'E' has 6 rows but the counter 5") &&
                        Contains("resize(rows, kept_rows)"));
  CHECK_THROWS_AS(counter.resize(0), embedhead::value_error);
  CHECK_THROWS_WITH(counter.resize(8, 6), Contains("RowUpdateCounter::resize: keep = 6 outside [0, 5]"));
  CHECK(counter.counts() == counts);
  CHECK(counter.records() == 1);

  CHECK_THROWS_AS(RowUpdateCounter(0), embedhead::value_error);
  CHECK_THROWS_WITH(RowUpdateCounter({1, 3}, 2), Contains("RowUpdateCounter: the count of row 1 is 3, outside [0, 2]"));
  CHECK_THROWS_WITH(RowUpdateCounter({0, -1}, 2), Contains("the count of row 1 is -1"));
  CHECK_THROWS_WITH(RowUpdateCounter({0}, -1), Contains("records = -1 outside [0, inf)"));
  CHECK_THROWS_AS(RowUpdateCounter(std::vector<std::int64_t>{}, 0), embedhead::value_error);
}

TEST_CASE("untrained guard: a counter restored from counts() and records() is the same", "[untrained_guard]") {
  RowUpdateCounter counter(7);
  counter.record_rows({0, 2, 5});
  counter.record_rows({2});
  const RowUpdateCounter restored(counter.counts(), counter.records());
  CHECK(restored.counts() == counter.counts());
  CHECK(restored.records() == 2);
  counter.reset();
  CHECK(counter.num_trained() == 0);
  CHECK(counter.records() == 0);
}

TEST_CASE("untrained guard: the counter follows resize_vocabulary", "[untrained_guard]") {
  embedhead::TokenEmbedding<float> embedding(6, 3);
  embedhead::AdamOptions adam;
  adam.lr = 0.05;
  embedhead::LazyAdam<float> optimizer(adam, embedding.parameters());
  RowUpdateCounter counter(6);
  train_step(embedding, optimizer, counter, ids_of({{0, 1, 2, 3, 4}}));
  train_step(embedding, optimizer, counter, ids_of({{1, 4}}));

  embedhead::VocabularyResizeOptions grow;
  grow.pad_to_multiple = 4;
  const auto r = embedhead::resize_vocabulary<float>(embedding, nullptr, 9, grow, &optimizer);
  REQUIRE(r.rows == 12);
  CHECK_THROWS_AS(counter.record(embedding.weight()), embedhead::shape_error);
  counter.resize(r.rows, r.kept_rows);
  CHECK(counter.counts() == std::vector<std::int64_t>{1, 2, 1, 1, 2, 0, 0, 0, 0, 0, 0, 0});
  // New tokens 6..8 were never updated: the check says so.
  UntrainedCheckOptions options;
  options.valid_vocab = r.valid_vocab;
  const auto report = counter.check(ids_of({{1, 7, 8, 5}}), options);
  REQUIRE(report.ids.size() == 3);
  CHECK(report.ids[0].id == 5);
  train_step(embedding, optimizer, counter, ids_of({{7, 2}}));
  CHECK(counter.count(7) == 1);
  CHECK(counter.count(2) == 2);
  CHECK(counter.records() == 3);

  // Shrinking keeps the first rows' counts.
  const auto shrunk = embedhead::resize_vocabulary<float>(embedding, nullptr, 4, {}, &optimizer);
  counter.resize(shrunk.rows, shrunk.kept_rows);
  CHECK(counter.counts() == std::vector<std::int64_t>{1, 2, 2, 1});
  // keep defaults to min(old, new) rows.
  counter.resize(5);
  CHECK(counter.counts() == std::vector<std::int64_t>{1, 2, 2, 1, 0});
}
