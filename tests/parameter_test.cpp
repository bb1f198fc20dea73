// Tests for include/embedhead/parameter.hpp: RowGradient (the row-sparse gradient with its dense
// mode), Parameter and count_parameters.
//
// The reference for every RowGradient check is a plain dense [rows, cols] matrix that receives the
// same additions; touched-row lists are checked against a std::set of the ids. Each gradient row
// receives at most one addition per step below, so library and reference agree exactly (==).
#include <embedhead/errors.hpp>
#include <embedhead/parameter.hpp>

#include "reference/test_support.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <memory>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

using embedhead::Index;
using embedhead::Parameter;
using embedhead::RowGradient;
using embedhead::RowMatrix;
using test_support::first_difference;
using test_support::range;

namespace {

// Random sorted unique subset of [0, V) with at most max_count elements (possibly empty).
std::vector<Index> random_sorted_ids(std::mt19937_64& gen, Index V, Index max_count) {
  std::uniform_int_distribution<Index> count_dist(0, std::min(V, max_count));
  const Index count = count_dist(gen);
  std::vector<Index> all = range(0, V);
  std::shuffle(all.begin(), all.end(), gen);
  std::vector<Index> ids(all.begin(), all.begin() + count);
  std::sort(ids.begin(), ids.end());
  return ids;
}

// Touches `ids`, checks that rows new to the gradient read zero, then adds one random row to each
// id in both the gradient and the dense reference.
template <typename Scalar>
void touch_and_add(RowGradient<Scalar>& grad, RowMatrix<Scalar>& reference, const std::vector<Index>& ids,
                   std::mt19937_64& gen) {
  const std::vector<Index> before = grad.touched_rows();
  std::vector<Index> slots(ids.size(), -1);
  grad.touch_rows(ids.data(), static_cast<Index>(ids.size()), slots.data());
  std::uniform_real_distribution<double> value(-1.0, 1.0);
  for (std::size_t j = 0; j < ids.size(); ++j) {
    auto row = grad.slot_row(slots[j]);
    REQUIRE(row.size() == grad.cols());
    const bool is_new = grad.is_dense() ? false : !std::binary_search(before.begin(), before.end(), ids[j]);
    INFO("id " << ids[j]);
    // What the slot holds right now must be what the reference holds (zero for a new row).
    for (Index c = 0; c < grad.cols(); ++c) {
      REQUIRE(row(c) == reference(ids[j], c));
      if (is_new) REQUIRE(row(c) == Scalar(0));
    }
    for (Index c = 0; c < grad.cols(); ++c) {
      const auto delta = static_cast<Scalar>(value(gen));
      row(c) += delta;
      reference(ids[j], c) += delta;
    }
  }
}

// touched_rows() is `expected`, touched_row(i) is its row, and to_dense() equals the reference.
template <typename Scalar>
void check_gradient(const RowGradient<Scalar>& grad, const std::set<Index>& expected,
                    const RowMatrix<Scalar>& reference) {
  const std::vector<Index> expected_ids(expected.begin(), expected.end());
  REQUIRE(grad.touched_rows() == expected_ids);
  REQUIRE(grad.num_touched() == static_cast<Index>(expected_ids.size()));
  for (Index i = 0; i < grad.num_touched(); ++i) {
    const Index id = expected_ids[static_cast<std::size_t>(i)];
    const RowMatrix<Scalar> row = grad.touched_row(i);
    const RowMatrix<Scalar> want = reference.row(id);
    INFO("touched_row(" << i << ") = row " << id);
    REQUIRE(first_difference(row, want).empty());
  }
  REQUIRE(first_difference(grad.to_dense(), reference) == "");
}

}  // namespace

TEMPLATE_TEST_CASE("RowGradient: touch_rows merges sorted id batches", "[parameter][row_gradient]", float, double) {
  using Scalar = TestType;

  SECTION("worked example: ids before, between and after the existing ones, and repeats") {
    const Index V = 40, d = 3;
    RowGradient<Scalar> grad(V, d);
    RowMatrix<Scalar> reference = RowMatrix<Scalar>::Zero(V, d);
    std::set<Index> expected;
    std::mt19937_64 gen(1);
    const std::vector<std::vector<Index>> batches = {
        {10, 20},                            // into an empty gradient
        {5},                                 // before everything
        {15},                                // between
        {25},                                // after everything
        {0, 12, 20, 30, 39},                 // new ids at both ends and between, plus an existing one
        {10, 20},                            // all existing: no new rows
        {},                                  // empty batch
        {5, 10, 12, 15, 20, 25, 30, 39, 0},  // sorted below
    };
    for (auto ids : batches) {
      std::sort(ids.begin(), ids.end());
      touch_and_add(grad, reference, ids, gen);
      expected.insert(ids.begin(), ids.end());
      check_gradient(grad, expected, reference);
    }
    CHECK(grad.touched_rows() == std::vector<Index>{0, 5, 10, 12, 15, 20, 25, 30, 39});
    CHECK_FALSE(grad.is_dense());
  }

  SECTION("slots: slot_row(slots[j]) is the row of ids[j]") {
    RowGradient<Scalar> grad(10, 2);
    const std::vector<Index> first = {2, 7};
    std::vector<Index> slots(2);
    grad.touch_rows(first.data(), 2, slots.data());
    grad.slot_row(slots[0]).setConstant(Scalar(2));
    grad.slot_row(slots[1]).setConstant(Scalar(7));
    const std::vector<Index> second = {1, 2, 5, 7, 9};
    std::vector<Index> more(5);
    grad.touch_rows(second.data(), 5, more.data());
    for (std::size_t j = 0; j < second.size(); ++j) grad.slot_row(more[j]).array() += Scalar(100 * second[j]);
    const RowMatrix<Scalar> dense = grad.to_dense();
    RowMatrix<Scalar> expected = RowMatrix<Scalar>::Zero(10, 2);
    expected.row(1).setConstant(Scalar(100));
    expected.row(2).setConstant(Scalar(202));
    expected.row(5).setConstant(Scalar(500));
    expected.row(7).setConstant(Scalar(707));
    expected.row(9).setConstant(Scalar(900));
    CHECK(first_difference(dense, expected) == "");
  }

  SECTION("naive reference: random batch sequences, with clears reusing stale block rows") {
    std::mt19937_64 gen(20240601);
    const Index sizes[][2] = {{1, 1}, {1, 9}, {2, 3}, {7, 8}, {16, 7}, {33, 16}, {50, 17}, {1000, 4}};
    for (const auto& size : sizes) {
      const Index V = size[0], d = size[1];
      INFO("V = " << V << ", d = " << d);
      RowGradient<Scalar> grad(V, d);
      CHECK(grad.rows() == V);
      CHECK(grad.cols() == d);
      for (int round = 0; round < 4; ++round) {
        INFO("round " << round);
        // After the first round the block holds stale non-zero rows from before clear(): new
        // rows must still start at zero.
        grad.clear();
        REQUIRE(grad.num_touched() == 0);
        REQUIRE(grad.to_dense() == RowMatrix<Scalar>::Zero(V, d));
        RowMatrix<Scalar> reference = RowMatrix<Scalar>::Zero(V, d);
        std::set<Index> expected;
        for (int batch = 0; batch < 12; ++batch) {
          INFO("batch " << batch);
          const std::vector<Index> ids = random_sorted_ids(gen, V, batch % 3 == 0 ? 40 : 5);
          touch_and_add(grad, reference, ids, gen);
          expected.insert(ids.begin(), ids.end());
          check_gradient(grad, expected, reference);
        }
      }
    }
  }

  SECTION("many single-row batches grow the block without losing values") {
    const Index V = 300, d = 5;
    RowGradient<Scalar> grad(V, d);
    RowMatrix<Scalar> reference = RowMatrix<Scalar>::Zero(V, d);
    std::set<Index> expected;
    std::mt19937_64 gen(3);
    // Descending ids: every insertion goes in front, so every existing row moves each time.
    for (Index id = V - 1; id >= 0; id -= 2) {
      touch_and_add(grad, reference, std::vector<Index>{id}, gen);
      expected.insert(id);
    }
    check_gradient(grad, expected, reference);
    // Then all rows at once: the odd ids fill every gap.
    const std::vector<Index> all = range(0, V);
    touch_and_add(grad, reference, all, gen);
    expected.insert(all.begin(), all.end());
    check_gradient(grad, expected, reference);
  }

  SECTION("to_dense into an out of the wrong shape throws shape_error and writes nothing") {
    RowGradient<Scalar> grad(4, 3);
    RowMatrix<Scalar> out = RowMatrix<Scalar>::Constant(3, 4, Scalar(9));
    REQUIRE_THROWS_AS(grad.to_dense(out), embedhead::shape_error);
    REQUIRE_THROWS_WITH(grad.to_dense(out), Catch::Contains("RowGradient::to_dense") &&
                                                Catch::Contains("out has shape [3, 4], expected [4, 3]"));
    CHECK(out == RowMatrix<Scalar>::Constant(3, 4, Scalar(9)));
  }
}

TEMPLATE_TEST_CASE("RowGradient: dense mode", "[parameter][row_gradient]", float, double) {
  using Scalar = TestType;
  const Index V = 9, d = 17;
  std::mt19937_64 gen(99);
  RowGradient<Scalar> grad(V, d);
  RowMatrix<Scalar> reference = RowMatrix<Scalar>::Zero(V, d);
  touch_and_add(grad, reference, {1, 4, 8}, gen);
  REQUIRE_FALSE(grad.is_dense());

  SECTION("dense_accumulator keeps the sparse rows and marks every row") {
    auto dense = grad.dense_accumulator();
    CHECK(grad.is_dense());
    REQUIRE(dense.rows() == V);
    REQUIRE(dense.cols() == d);
    CHECK(first_difference(RowMatrix<Scalar>(dense), reference) == "");
    CHECK(grad.touched_rows() == range(0, V));
    CHECK(grad.num_touched() == V);

    // A dense contribution, as the head's dW += dlogits^T h would add.
    RowMatrix<Scalar> contribution(V, d);
    for (Index i = 0; i < contribution.size(); ++i) contribution.data()[i] = Scalar(0.125) * Scalar(i % 13);
    dense += contribution;
    reference += contribution;
    std::set<Index> all;
    for (Index v = 0; v < V; ++v) all.insert(v);
    check_gradient(grad, all, reference);

    SECTION("sparse contributions after densify land in the dense buffer") {
      touch_and_add(grad, reference, {0, 4, 5}, gen);
      CHECK(grad.is_dense());
      check_gradient(grad, all, reference);
      // The same buffer is handed out again, values kept.
      auto again = grad.dense_accumulator();
      CHECK(again.data() == dense.data());
      CHECK(first_difference(RowMatrix<Scalar>(again), reference) == "");
    }

    SECTION("clear() returns to sparse mode with all zeros; a later densify starts from zero") {
      grad.clear();
      CHECK_FALSE(grad.is_dense());
      CHECK(grad.num_touched() == 0);
      CHECK(grad.to_dense() == RowMatrix<Scalar>::Zero(V, d));

      RowMatrix<Scalar> fresh = RowMatrix<Scalar>::Zero(V, d);
      touch_and_add(grad, fresh, {2, 3}, gen);  // new rows read zero (checked inside)
      check_gradient(grad, std::set<Index>{2, 3}, fresh);

      auto redense = grad.dense_accumulator();
      CHECK(grad.is_dense());
      // Only rows 2 and 3 are non-zero: nothing from before clear() survived in the buffer.
      CHECK(first_difference(RowMatrix<Scalar>(redense), fresh) == "");
      grad.clear();
      CHECK(grad.to_dense() == RowMatrix<Scalar>::Zero(V, d));
      grad.dense_accumulator();
      CHECK(grad.to_dense() == RowMatrix<Scalar>::Zero(V, d));
    }
  }

  SECTION("densify straight after clear() of a sparse gradient gives zeros") {
    grad.clear();
    auto dense = grad.dense_accumulator();
    CHECK(RowMatrix<Scalar>(dense) == RowMatrix<Scalar>::Zero(V, d));
  }
}

TEMPLATE_TEST_CASE("RowGradient: touched_values is the touched rows as one block, sparse and dense",
                   "[parameter][row_gradient]", float, double) {
  using S = TestType;
  RowGradient<S> g(9, 3);
  CHECK(g.touched_values().rows() == 0);
  // Two batches, the second merged in front of and between the first's rows.
  const Index first[] = {4, 7}, second[] = {1, 5, 7};
  Index slots[3];
  g.touch_rows(first, 2, slots);
  for (Index j = 0; j < 2; ++j) g.slot_row(slots[j]).setConstant(static_cast<S>(first[j]));
  g.touch_rows(second, 3, slots);
  for (Index j = 0; j < 3; ++j) g.slot_row(slots[j]).array() += static_cast<S>(second[j]);
  const auto sparse = g.touched_values();
  REQUIRE(sparse.rows() == 4);
  REQUIRE(sparse.cols() == 3);
  for (Index i = 0; i < 4; ++i) CHECK(first_difference(sparse.row(i), g.touched_row(i)) == "");
  const RowMatrix<S> dense_values = g.to_dense();
  g.dense_accumulator();
  const auto dense = g.touched_values();
  CHECK(first_difference(dense, dense_values) == "");  // [rows, cols]: every row touched
}

TEST_CASE("RowGradient: zero_grad forgets touched rows without ever going dense", "[parameter][row_gradient]") {
  // V * d = 12.8M entries: a per-step memset of a full gradient would be the cost zero_grad must
  // avoid. We assert the behaviour (no dense buffer, empty touched set), not timings.
  const Index V = 200000, d = 64;
  Parameter<float> table(V, d, "big");
  auto& grad = table.grad();
  std::mt19937_64 gen(5);
  std::uniform_int_distribution<Index> id_dist(0, V - 1);
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  std::vector<Index> ids, slots;
  RowMatrix<float> contributions;
  std::size_t failures = 0;
  for (int step = 0; step < 1000; ++step) {
    std::set<Index> batch;
    while (batch.size() < 4) batch.insert(id_dist(gen));
    ids.assign(batch.begin(), batch.end());
    slots.resize(ids.size());
    grad.touch_rows(ids.data(), static_cast<Index>(ids.size()), slots.data());
    contributions.resize(static_cast<Index>(ids.size()), d);
    for (Index i = 0; i < contributions.size(); ++i) contributions.data()[i] = value(gen);
    for (std::size_t j = 0; j < ids.size(); ++j) {
      auto row = grad.slot_row(slots[j]);
      // Last step's rows were cleared: a reused block row must read zero before this add.
      failures += row.isZero(0) ? 0 : 1;
      row += contributions.row(static_cast<Index>(j));
    }
    // Only this step's rows, holding only this step's values.
    failures += grad.touched_rows() == ids ? 0 : 1;
    for (Index i = 0; i < grad.num_touched(); ++i) failures += grad.touched_row(i) == contributions.row(i) ? 0 : 1;
    failures += grad.is_dense() ? 1 : 0;
    if (step == 999) {
      RowMatrix<float> expected = RowMatrix<float>::Zero(V, d);
      for (std::size_t j = 0; j < ids.size(); ++j) expected.row(ids[j]) = contributions.row(static_cast<Index>(j));
      CHECK(grad.to_dense() == expected);
    }
    table.zero_grad();
    failures += grad.num_touched() == 0 ? 0 : 1;
    failures += grad.touched_rows().empty() ? 0 : 1;
    failures += grad.is_dense() ? 1 : 0;
  }
  CHECK(failures == 0);
  CHECK_FALSE(grad.is_dense());
  CHECK(grad.to_dense() == RowMatrix<float>::Zero(V, d));
}

TEMPLATE_TEST_CASE("Parameter: value, shape, name and gradient", "[parameter]", float, double) {
  using Scalar = TestType;

  SECTION("a zero-initialised [rows, cols] value behind a Map, and an empty gradient of that shape") {
    Parameter<Scalar> p(3, 5, "head.weight");
    CHECK(p.rows() == 3);
    CHECK(p.cols() == 5);
    CHECK(p.size() == 15);
    CHECK(p.name() == "head.weight");
    CHECK(p.value() == RowMatrix<Scalar>::Zero(3, 5));
    CHECK(p.grad().rows() == 3);
    CHECK(p.grad().cols() == 5);
    CHECK(p.grad().num_touched() == 0);
    CHECK_FALSE(p.grad().is_dense());
    CHECK(Parameter<Scalar>(1, 1).name().empty());

    // value() is a Map: entries are writable in place but the matrix cannot be resized or
    // reassigned to another shape through it.
    static_assert(std::is_same_v<decltype(p.value()), Eigen::Map<RowMatrix<Scalar>>>);
    const Parameter<Scalar>& cp = p;
    static_assert(std::is_same_v<decltype(cp.value()), Eigen::Map<const RowMatrix<Scalar>>>);
    p.value()(1, 2) = Scalar(3.5);
    p.value().row(2).setConstant(Scalar(-1));
    CHECK(cp.value()(1, 2) == Scalar(3.5));
    CHECK(cp.value().row(2) == RowMatrix<Scalar>::Constant(1, 5, Scalar(-1)));
    CHECK(cp.value().data() == p.value().data());  // the same storage every call
  }

  SECTION("zero_grad clears the gradient and leaves the value alone") {
    Parameter<Scalar> p(4, 2);
    p.value().setConstant(Scalar(2));
    const std::vector<Index> ids = {0, 3};
    std::vector<Index> slots(2);
    p.grad().touch_rows(ids.data(), 2, slots.data());
    p.grad().slot_row(slots[1]).setConstant(Scalar(1));
    REQUIRE(p.grad().num_touched() == 2);
    p.zero_grad();
    CHECK(p.grad().num_touched() == 0);
    CHECK(p.grad().to_dense() == RowMatrix<Scalar>::Zero(4, 2));
    CHECK(p.value() == RowMatrix<Scalar>::Constant(4, 2, Scalar(2)));
  }

  SECTION("errors: rows or cols < 1 throw value_error naming the value") {
    REQUIRE_THROWS_AS(Parameter<Scalar>(0, 3), embedhead::value_error);
    REQUIRE_THROWS_AS(Parameter<Scalar>(0, 3), std::invalid_argument);
    REQUIRE_THROWS_WITH(Parameter<Scalar>(0, 3),
                        Catch::Contains("Parameter") && Catch::Contains("rows = 0") && Catch::Contains("[1, inf)"));
    REQUIRE_THROWS_WITH(Parameter<Scalar>(-2, 3), Catch::Contains("rows = -2") && Catch::Contains("[1, inf)"));
    REQUIRE_THROWS_WITH(Parameter<Scalar>(3, 0), Catch::Contains("cols = 0") && Catch::Contains("[1, inf)"));
    REQUIRE_THROWS_WITH(Parameter<Scalar>(3, -7), Catch::Contains("cols = -7") && Catch::Contains("[1, inf)"));
    REQUIRE_NOTHROW(Parameter<Scalar>(1, 1));
  }
}

TEST_CASE("count_parameters: a Parameter listed twice counts once", "[parameter]") {
  auto E = std::make_shared<Parameter<float>>(50, 32, "E");
  auto bias = std::make_shared<Parameter<float>>(1, 50, "bias");
  auto twin = std::make_shared<Parameter<float>>(50, 32, "E copy");  // same shape, own storage

  CHECK(embedhead::count_parameters<float>({}) == 0);
  CHECK(embedhead::count_parameters<float>({E}) == 1600);
  // Tied: the embedding and the head list the same E.
  CHECK(embedhead::count_parameters<float>({E, E}) == 1600);
  CHECK(embedhead::count_parameters<float>({E, bias, E, E}) == 1650);
  // An untied copy is a second parameter: 50*32 + 50 + 50*32 (the seeds: tying saves V*d + V).
  CHECK(embedhead::count_parameters<float>({E, bias, twin}) == 3250);
  CHECK(embedhead::count_parameters<float>({E, bias, twin}) - embedhead::count_parameters<float>({E, E}) == 1650);
  // Null entries are skipped.
  CHECK(embedhead::count_parameters<float>({nullptr, E, nullptr}) == 1600);
}

TEMPLATE_TEST_CASE("RowGradient: touch_rows rejects bad ids and changes nothing", "[parameter][row_gradient][errors]",
                   float, double) {
  using Scalar = TestType;
  RowGradient<Scalar> g(10, 3);
  const std::vector<Index> first{2, 5};
  std::vector<Index> slots(2);
  g.touch_rows(first.data(), 2, slots.data());
  g.slot_row(slots[0]).setConstant(Scalar(1));
  g.slot_row(slots[1]).setConstant(Scalar(2));
  const RowMatrix<Scalar> before = g.to_dense();

  auto expect_unchanged = [&] {
    CHECK(g.touched_rows() == first);
    CHECK(g.to_dense() == before);
  };
  std::vector<Index> out(3);
  const std::vector<Index> too_big{1, 10};
  REQUIRE_THROWS_AS(g.touch_rows(too_big.data(), 2, out.data()), embedhead::index_error);
  REQUIRE_THROWS_WITH(g.touch_rows(too_big.data(), 2, out.data()),
                      Catch::Contains("id 10") && Catch::Contains("index 1") && Catch::Contains("[0, 10)"));
  expect_unchanged();
  const std::vector<Index> negative{-1};
  REQUIRE_THROWS_WITH(g.touch_rows(negative.data(), 1, out.data()),
                      Catch::Contains("id -1") && Catch::Contains("[0, 10)"));
  expect_unchanged();
  const std::vector<Index> unsorted{3, 1, 7};
  REQUIRE_THROWS_AS(g.touch_rows(unsorted.data(), 3, out.data()), embedhead::value_error);
  REQUIRE_THROWS_WITH(g.touch_rows(unsorted.data(), 3, out.data()), Catch::Contains("strictly increasing") &&
                                                                        Catch::Contains("id 1 at index 1") &&
                                                                        Catch::Contains("follows 3"));
  expect_unchanged();
  const std::vector<Index> repeated{4, 4};
  REQUIRE_THROWS_AS(g.touch_rows(repeated.data(), 2, out.data()), embedhead::value_error);
  expect_unchanged();
}

TEST_CASE("RowGradient: touch_rows with `fresh` flags new rows and leaves them for the caller",
          "[parameter][row_gradient]") {
  RowGradient<double> g(20, 2);
  std::vector<Index> slots(3);
  std::vector<unsigned char> fresh(3, 9);
  const std::vector<Index> first{4, 10, 15};
  g.touch_rows(first.data(), 3, slots.data(), fresh.data());
  CHECK(fresh == std::vector<unsigned char>{1, 1, 1});
  for (std::size_t j = 0; j < 3; ++j) g.slot_row(slots[j]).setConstant(static_cast<double>(first[j]));

  // 10 exists; 2, 12 and 19 are new and land before, between and after the old rows.
  const std::vector<Index> second{2, 10, 12, 19};
  slots.assign(4, -1);
  fresh.assign(4, 9);
  g.touch_rows(second.data(), 4, slots.data(), fresh.data());
  CHECK(fresh == std::vector<unsigned char>{1, 0, 1, 1});
  CHECK(g.touched_rows() == std::vector<Index>{2, 4, 10, 12, 15, 19});
  // Old rows moved with their values; the caller assigns the new ones.
  CHECK(g.slot_row(slots[1])(0) == 10.0);
  for (std::size_t j : {std::size_t{0}, std::size_t{2}, std::size_t{3}}) g.slot_row(slots[j]).setConstant(-1.0);
  const RowMatrix<double> dense = g.to_dense();
  CHECK(dense(4, 0) == 4.0);
  CHECK(dense(15, 1) == 15.0);
  CHECK(dense(12, 0) == -1.0);

  // Nothing new: every flag is 0.
  fresh.assign(4, 9);
  g.touch_rows(second.data(), 4, slots.data(), fresh.data());
  CHECK(fresh == std::vector<unsigned char>{0, 0, 0, 0});

  // Dense mode: rows exist already, so nothing is fresh.
  g.dense_accumulator();
  fresh.assign(4, 9);
  g.touch_rows(second.data(), 4, slots.data(), fresh.data());
  CHECK(fresh == std::vector<unsigned char>{0, 0, 0, 0});
  CHECK(slots == second);
}

TEMPLATE_TEST_CASE("Parameter: frozen flag", "[parameter][freeze]", float, double) {
  using Scalar = TestType;
  Parameter<Scalar> p(4, 2, "E");
  CHECK_FALSE(p.frozen());  // trainable by default

  SECTION("freezing clears the gradient and keeps the value; unfreezing keeps the (empty) gradient") {
    p.value().setConstant(Scalar(1.5));
    const std::vector<Index> ids = {1, 2};
    std::vector<Index> slots(2);
    p.grad().touch_rows(ids.data(), 2, slots.data());
    p.grad().slot_row(slots[0]).setConstant(Scalar(3));
    p.set_frozen(true);
    CHECK(p.frozen());
    CHECK(p.grad().num_touched() == 0);
    CHECK(p.value() == RowMatrix<Scalar>::Constant(4, 2, Scalar(1.5)));
    p.set_frozen(false);
    CHECK_FALSE(p.frozen());
    CHECK(p.grad().num_touched() == 0);
  }

  SECTION("freezing a dense gradient leaves it sparse and zero") {
    p.grad().dense_accumulator().setConstant(Scalar(1));
    p.set_frozen(true);
    CHECK_FALSE(p.grad().is_dense());
    CHECK(p.grad().to_dense() == RowMatrix<Scalar>::Zero(4, 2));
  }
}

namespace {

// A Parameter [rows, cols] with distinct values and a sparse gradient on `ids` (value of row r:
// 100 r + c + 0.25; gradient of row r: -(r + 1) - c / 8), and the dense reference of that gradient.
template <typename Scalar>
std::pair<std::shared_ptr<Parameter<Scalar>>, RowMatrix<Scalar>> filled_parameter(Index rows, Index cols,
                                                                                  const std::vector<Index>& ids) {
  auto p = std::make_shared<Parameter<Scalar>>(rows, cols, "E");
  RowMatrix<Scalar> grad = RowMatrix<Scalar>::Zero(rows, cols);
  for (Index r = 0; r < rows; ++r)
    for (Index c = 0; c < cols; ++c) p->value()(r, c) = static_cast<Scalar>(100 * r + c) + Scalar(0.25);
  std::vector<Index> slots(ids.size());
  p->grad().touch_rows(ids.data(), static_cast<Index>(ids.size()), slots.data());
  for (std::size_t i = 0; i < ids.size(); ++i)
    for (Index c = 0; c < cols; ++c) {
      const Scalar g = -static_cast<Scalar>(ids[i] + 1) - static_cast<Scalar>(c) / Scalar(8);
      p->grad().slot_row(slots[i])(c) = g;
      grad(ids[i], c) = g;
    }
  return {p, grad};
}

}  // namespace

TEMPLATE_TEST_CASE("Parameter::resize_rows changes the row count in place", "[parameter][resize]", float, double) {
  using Scalar = TestType;
  const Index rows = 6, d = 3;
  const std::vector<Index> ids = {0, 2, 4, 5};

  SECTION("growing: same object, old rows bit-exact, new rows zero, gradient rows kept, new rows untouched") {
    auto [p, grad] = filled_parameter<Scalar>(rows, d, ids);
    const RowMatrix<Scalar> before = p->value();
    const Parameter<Scalar>* address = p.get();
    auto alias = p;  // a second holder, as a tied head
    p->resize_rows(9);
    CHECK(p.get() == address);
    CHECK(alias->rows() == 9);
    CHECK(alias->cols() == d);
    CHECK(first_difference(p->value().topRows(rows), before).empty());
    CHECK(p->value().bottomRows(3) == RowMatrix<Scalar>::Zero(3, d));
    CHECK(p->grad().rows() == 9);
    CHECK(p->grad().touched_rows() == ids);
    RowMatrix<Scalar> expected = RowMatrix<Scalar>::Zero(9, d);
    expected.topRows(rows) = grad;
    CHECK(first_difference(p->grad().to_dense(), expected).empty());
    CHECK_FALSE(p->grad().is_dense());
    // The resized gradient keeps working: a batch touching an old and a new row merges into it.
    const std::vector<Index> more = {2, 7};
    std::vector<Index> slots(2);
    p->grad().touch_rows(more.data(), 2, slots.data());
    p->grad().slot_row(slots[1]).setConstant(Scalar(9));
    CHECK(p->grad().touched_rows() == std::vector<Index>({0, 2, 4, 5, 7}));
    expected.row(7).setConstant(Scalar(9));
    CHECK(first_difference(p->grad().to_dense(), expected).empty());
  }

  SECTION("shrinking: rows from new_rows on are dropped with their gradient") {
    auto [p, grad] = filled_parameter<Scalar>(rows, d, ids);
    const RowMatrix<Scalar> before = p->value();
    p->resize_rows(3);
    CHECK(p->rows() == 3);
    CHECK(first_difference(p->value(), before.topRows(3)).empty());
    CHECK(p->grad().touched_rows() == std::vector<Index>({0, 2}));
    CHECK(first_difference(p->grad().to_dense(), grad.topRows(3)).empty());
    // Shrinking to one row, then growing back: the dropped rows come back as zero.
    p->resize_rows(1);
    p->resize_rows(4);
    CHECK(first_difference(p->value().topRows(1), before.topRows(1)).empty());
    CHECK(p->value().bottomRows(3) == RowMatrix<Scalar>::Zero(3, d));
    CHECK(p->grad().touched_rows() == std::vector<Index>({0}));
  }

  SECTION("a dense gradient stays dense: kept rows keep their values, new rows are zero and marked") {
    auto [p, grad] = filled_parameter<Scalar>(rows, d, ids);
    p->grad().dense_accumulator().row(1).setConstant(Scalar(5));
    grad.row(1).setConstant(Scalar(5));
    p->resize_rows(8);
    CHECK(p->grad().is_dense());
    CHECK(p->grad().touched_rows() == range(0, 8));
    RowMatrix<Scalar> expected = RowMatrix<Scalar>::Zero(8, d);
    expected.topRows(rows) = grad;
    CHECK(first_difference(p->grad().to_dense(), expected).empty());
    p->resize_rows(2);
    CHECK(p->grad().is_dense());
    CHECK(first_difference(p->grad().to_dense(), grad.topRows(2)).empty());
    p->zero_grad();  // clear() keeps its invariant: the buffer is all zero, sparse mode again
    CHECK_FALSE(p->grad().is_dense());
    CHECK(p->grad().dense_accumulator() == RowMatrix<Scalar>::Zero(2, d));
  }

  SECTION("same size, V = 1 and d = 1") {
    auto [p, grad] = filled_parameter<Scalar>(rows, d, ids);
    const RowMatrix<Scalar> before = p->value();
    p->resize_rows(rows);
    CHECK(first_difference(p->value(), before).empty());
    CHECK(first_difference(p->grad().to_dense(), grad).empty());
    Parameter<Scalar> one(1, 1);
    one.value()(0, 0) = Scalar(7);
    one.resize_rows(2);
    CHECK(one.value()(0, 0) == Scalar(7));
    CHECK(one.value()(1, 0) == Scalar(0));
  }

  SECTION("a frozen parameter stays frozen") {
    Parameter<Scalar> q(2, 2);
    q.set_frozen(true);
    q.resize_rows(5);
    CHECK(q.frozen());
  }

  SECTION("errors: new_rows < 1 throws value_error naming it; nothing changes") {
    auto [p, grad] = filled_parameter<Scalar>(rows, d, ids);
    const RowMatrix<Scalar> before = p->value();
    REQUIRE_THROWS_AS(p->resize_rows(0), embedhead::value_error);
    REQUIRE_THROWS_WITH(p->resize_rows(0), Catch::Contains("Parameter::resize_rows: new_rows = 0 outside [1, inf)"));
    REQUIRE_THROWS_WITH(p->resize_rows(-3), Catch::Contains("new_rows = -3 outside [1, inf)"));
    CHECK(p->rows() == rows);
    CHECK(first_difference(p->value(), before).empty());
    CHECK(p->grad().touched_rows() == ids);
    CHECK(first_difference(p->grad().to_dense(), grad).empty());
  }
}

TEMPLATE_TEST_CASE("a gradient keeps its parameter's shape: assigning one of another shape throws, nothing changes",
                   "[parameter][row_gradient][errors]", float, double) {
  using Scalar = TestType;
  const Index rows = 6, d = 3;
  const std::vector<Index> ids = {0, 2, 4, 5};
  const auto filled = filled_parameter<Scalar>(rows, d, ids);
  const std::shared_ptr<Parameter<Scalar>>& p = filled.first;
  const RowMatrix<Scalar>& grad = filled.second;
  const RowMatrix<Scalar> before = p->value();
  auto unchanged = [&] {
    CHECK(p->rows() == rows);
    CHECK(p->cols() == d);
    CHECK(p->grad().rows() == rows);
    CHECK(p->grad().cols() == d);
    CHECK(p->name() == "E");
    CHECK(first_difference(p->value(), before).empty());
    CHECK(p->grad().touched_rows() == ids);
    CHECK(first_difference(p->grad().to_dense(), grad).empty());
  };

  // A gradient of more rows would have the optimizers walk rows the value does not have (the
  // parameter's shape is read from its gradient), and resize_vocabulary copy rows past the value.
  REQUIRE_THROWS_AS(p->grad() = RowGradient<Scalar>(9, d), embedhead::shape_error);
  REQUIRE_THROWS_WITH(p->grad() = RowGradient<Scalar>(9, d),
                      Catch::Contains(
                          "RowGradient::operator=: the assigned gradient has shape [9, 3], expected [6, 3]"));
  const RowGradient<Scalar> narrow(rows, d - 1);
  REQUIRE_THROWS_WITH(p->grad() = narrow, Catch::Contains("has shape [6, 2], expected [6, 3]"));
  unchanged();

  // So is a whole Parameter of another shape: a parameter's shape changes only through resize_rows.
  const Parameter<Scalar> bigger(rows + 1, d, "F");
  REQUIRE_THROWS_AS(*p = bigger, embedhead::shape_error);
  REQUIRE_THROWS_AS(*p = Parameter<Scalar>(rows, d + 1, "F"), embedhead::shape_error);
  unchanged();

  // The same shape assigns as before, copied or moved: touched rows and values.
  RowGradient<Scalar> other(rows, d);
  const std::vector<Index> one = {3};
  std::vector<Index> slot(1);
  other.touch_rows(one.data(), 1, slot.data());
  other.slot_row(slot[0]).setConstant(Scalar(2));
  p->grad() = other;
  CHECK(p->grad().touched_rows() == one);
  CHECK(p->grad().to_dense() == other.to_dense());
  p->grad() = RowGradient<Scalar>(rows, d);
  CHECK(p->grad().num_touched() == 0);
  Parameter<Scalar> same(rows, d, "G");
  same.value().setConstant(Scalar(4));
  *p = same;
  CHECK(p->name() == "G");
  CHECK(p->value() == RowMatrix<Scalar>::Constant(rows, d, Scalar(4)));
  // A standalone gradient keeps its shape too.
  RowGradient<Scalar> standalone(2, 2);
  REQUIRE_THROWS_AS(standalone = RowGradient<Scalar>(3, 2), embedhead::shape_error);
  CHECK(standalone.rows() == 2);
}
