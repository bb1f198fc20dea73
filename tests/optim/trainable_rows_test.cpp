// Trainable rows (Parameter::set_trainable_rows): only the mask's rows take a gradient -- from the
// embedding's backward and from the head's dW, unfused and fused -- and the optimizers keep state
// for those k rows only, leaving every other row exactly as it was.
//
// References: the gradients are naive double sums written here from their definitions (dE[v] =
// sum of dout over the tokens of id v; dW[v] = sum_n dz[n, v] h[n] with dz = (softmax - one_hot) /
// N), and a central difference of the loss in double; an optimizer over a masked V-row table is
// checked against the same optimizer over a k-row table holding just those rows (the cost the
// mask must match), whose own trajectories the optimizer tests check against torch.optim's rules.
#include <catch2/catch.hpp>
#include <embedhead/embedhead.hpp>

#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "../reference/test_support.hpp"
#include "optim_support.hpp"

using Catch::Matchers::Contains;
using embedhead::CrossEntropyResult;
using embedhead::FusedHeadLoss;
using embedhead::FusedHeadLossOptions;
using embedhead::FusedPlan;
using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::index_error;
using embedhead::OutputProjection;
using embedhead::Parameter;
using embedhead::RowMatrix;
using embedhead::shape_error;
using embedhead::TokenEmbedding;
using embedhead::value_error;
using optim_support::make_parameter;
using test_support::first_difference;
using test_support::random_ids;
using test_support::random_matrix;

namespace {

const std::vector<Index> kMask = {1, 4, 5, 9};

// dW_ref [V, d] = dz^T h in double, dz [N, V] = (softmax(h W^T) - one_hot(y)) / N: the mean
// cross-entropy's head gradient, written from its definition.
RowMatrix<double> naive_head_dW(const RowMatrix<double>& h, const RowMatrix<double>& W,
                                const IdMatrix<std::int32_t>& y) {
  const Index N = h.rows(), V = W.rows();
  const RowMatrix<double> z = h * W.transpose();
  RowMatrix<double> dz(N, V);
  for (Index n = 0; n < N; ++n) {
    const double m = z.row(n).maxCoeff();
    double sum = 0;
    for (Index v = 0; v < V; ++v) sum += std::exp(z(n, v) - m);
    for (Index v = 0; v < V; ++v) dz(n, v) = (std::exp(z(n, v) - m) / sum - (v == y(0, n) ? 1.0 : 0.0)) / N;
  }
  return dz.transpose() * h;
}

double naive_loss(const RowMatrix<double>& h, const RowMatrix<double>& W, const IdMatrix<std::int32_t>& y) {
  const RowMatrix<double> z = h * W.transpose();
  double total = 0;
  for (Index n = 0; n < h.rows(); ++n) {
    const double m = z.row(n).maxCoeff();
    double sum = 0;
    for (Index v = 0; v < W.rows(); ++v) sum += std::exp(z(n, v) - m);
    total += m + std::log(sum) - z(n, y(0, n));
  }
  return total / static_cast<double>(h.rows());
}

template <typename Scalar>
RowMatrix<double> gradient_rows(const embedhead::ParameterBase<Scalar>& p) {
  RowMatrix<double> out(p.grad().num_touched(), p.cols());
  for (Index i = 0; i < p.grad().num_touched(); ++i) out.row(i) = p.grad().touched_row(i).template cast<double>();
  return out;
}

RowMatrix<double> rows_of(const RowMatrix<double>& M, const std::vector<Index>& ids) {
  RowMatrix<double> out(static_cast<Index>(ids.size()), M.cols());
  for (std::size_t i = 0; i < ids.size(); ++i) out.row(static_cast<Index>(i)) = M.row(ids[i]);
  return out;
}

}  // namespace

TEST_CASE("set_trainable_rows: ids checked, gradient cleared, mask read back", "[trainable_rows][errors]") {
  Parameter<float> p(10, 3, "E");
  const Index first = 2;
  Index slot = 0;
  p.grad().touch_rows(&first, 1, &slot);
  p.grad().slot_row(slot).setConstant(7.f);

  SECTION("an id outside [0, rows): index_error naming it, nothing changed") {
    CHECK_THROWS_AS(p.set_trainable_rows({1, 10}), index_error);
    CHECK_THROWS_WITH(p.set_trainable_rows({1, 10}),
                      Contains("Parameter::set_trainable_rows: ids[1] = 10 outside [0, 10)"));
    CHECK_THROWS_WITH(p.set_trainable_rows({-1}), Contains("ids[0] = -1 outside [0, 10)"));
    CHECK(p.trainable_rows() == nullptr);
    REQUIRE(p.grad().num_touched() == 1);
    CHECK(p.grad().touched_row(0)(0) == 7.f);
  }
  SECTION("unsorted or repeated ids: value_error naming them, nothing changed") {
    CHECK_THROWS_AS(p.set_trainable_rows({4, 3}), value_error);
    CHECK_THROWS_WITH(p.set_trainable_rows({4, 3}), Contains("strictly increasing, but ids[1] = 3 follows ids[0] = 4"));
    CHECK_THROWS_WITH(p.set_trainable_rows({2, 5, 5}), Contains("ids[2] = 5 follows ids[1] = 5"));
    CHECK(p.trainable_rows() == nullptr);
    CHECK(p.grad().num_touched() == 1);
  }
  SECTION("a valid mask clears the gradient and reads back; all rows again clears it too") {
    p.set_trainable_rows(kMask);
    REQUIRE(p.trainable_rows() != nullptr);
    CHECK(*p.trainable_rows() == kMask);
    CHECK(p.grad().num_touched() == 0);
    // A dense contribution is refused: it must go to the mask's rows.
    CHECK_THROWS_WITH(p.grad().dense_accumulator(), Contains("masked_accumulator"));
    CHECK_FALSE(p.grad().is_dense());
    p.set_all_rows_trainable();
    CHECK(p.trainable_rows() == nullptr);
  }
  SECTION("an empty mask: nothing trains") {
    p.set_trainable_rows({});
    REQUIRE(p.trainable_rows() != nullptr);
    CHECK(p.trainable_rows()->empty());
  }
}

TEMPLATE_TEST_CASE("trainable rows: the embedding's backward touches only the mask's rows", "[trainable_rows]", float,
                   double) {
  using Scalar = TestType;
  const Index V = 12, d = 5, B = 3, T = 7;
  TokenEmbedding<Scalar> embedding(V, d);
  embedding.set_trainable_rows(kMask);
  const auto ids = random_ids<std::int32_t>(B, T, V, 11);
  const RowMatrix<Scalar> dout = random_matrix<Scalar>(B * T, d, 12);
  embedding.backward(ids, dout);
  // The reference: for each id in the batch and the mask, the sum of its tokens' dout rows.
  std::vector<Index> expected_rows;
  for (Index v : kMask)
    for (Index n = 0; n < B * T; ++n)
      if (ids.data()[n] == v) {
        expected_rows.push_back(v);
        break;
      }
  REQUIRE(expected_rows.size() >= 2);  // the seed puts several mask ids in the batch
  CHECK(embedding.weight().grad().touched_rows() == expected_rows);
  RowMatrix<double> expected = RowMatrix<double>::Zero(static_cast<Index>(expected_rows.size()), d);
  for (std::size_t i = 0; i < expected_rows.size(); ++i)
    for (Index n = 0; n < B * T; ++n)
      if (ids.data()[n] == expected_rows[i]) expected.row(static_cast<Index>(i)) += dout.row(n).template cast<double>();
  CHECK(test_support::close(gradient_rows(embedding.weight()), expected, test_support::tolerance<Scalar>()));
}

TEMPLATE_TEST_CASE("trainable rows: the head's dW on the mask's rows only, unfused and fused", "[trainable_rows]",
                   float, double) {
  using Scalar = TestType;
  const Index V = 23, d = 6, N = 9;
  const RowMatrix<Scalar> h = random_matrix<Scalar>(N, d, 21);
  const auto y = random_ids<std::int32_t>(1, N, V, 22);
  auto make_head = [&] {
    OutputProjection<Scalar> head(V, d);
    head.weight().value() = random_matrix<Scalar>(V, d, 23, 0.5);
    return head;
  };
  const RowMatrix<double> W_double = make_head().weight().value().template cast<double>();
  const RowMatrix<double> dW_ref = naive_head_dW(h.template cast<double>(), W_double, y);
  const double tol = test_support::tolerance<Scalar>();

  SECTION("unfused: OutputProjection::backward of the loss's dlogits") {
    OutputProjection<Scalar> masked = make_head(), full = make_head();
    masked.set_trainable_rows(kMask);
    RowMatrix<Scalar> dz(N, V);
    embedhead::cross_entropy_forward_backward<Scalar>(masked.forward(h), y, dz);
    const RowMatrix<Scalar> dh_masked = masked.backward(h, dz), dh_full = full.backward(h, dz);
    CHECK(first_difference(dh_masked, dh_full).empty());  // dh does not depend on the mask
    CHECK_FALSE(masked.weight().grad().is_dense());
    CHECK(masked.weight().grad().touched_rows() == kMask);
    CHECK(test_support::close(gradient_rows(masked.weight()), rows_of(dW_ref, kMask), tol));
  }
  for (const FusedPlan plan : {FusedPlan::token_chunks, FusedPlan::vocab_blocks}) {
    DYNAMIC_SECTION("fused, plan " << static_cast<int>(plan)) {
      FusedHeadLossOptions options;
      options.plan = plan;
      options.vocab_block = 8;  // several blocks, the mask's rows spread over them
      options.memory_budget = 4 * static_cast<Index>(V * sizeof(Scalar));  // token chunks of 4 rows
      OutputProjection<Scalar> masked = make_head(), full = make_head();
      masked.set_trainable_rows(kMask);
      FusedHeadLoss<Scalar> loss(options);
      RowMatrix<Scalar> dh_masked(N, d), dh_full(N, d);
      const CrossEntropyResult r_masked = loss.forward_backward(masked, h, y, dh_masked);
      const CrossEntropyResult r_full = loss.forward_backward(full, h, y, dh_full);
      CHECK(r_masked.loss == r_full.loss);
      CHECK(first_difference(dh_masked, dh_full).empty());
      CHECK_FALSE(masked.weight().grad().is_dense());
      CHECK(masked.weight().grad().touched_rows() == kMask);
      CHECK(test_support::close(gradient_rows(masked.weight()), rows_of(dW_ref, kMask), tol));
      // The mask's rows of the unmasked dW, to rounding (the same sums, gathered first).
      CHECK(test_support::close(gradient_rows(masked.weight()),
                                rows_of(full.weight().grad().to_dense().template cast<double>(), kMask), tol));
    }
  }
  SECTION("fused: a central difference of the loss in double, per masked entry") {
    if constexpr (std::is_same_v<Scalar, double>) {
      OutputProjection<double> masked = make_head();
      masked.set_trainable_rows(kMask);
      FusedHeadLoss<double> loss;
      RowMatrix<double> dh(N, d);
      loss.forward_backward(masked, h, y, dh);
      const RowMatrix<double> got = gradient_rows(masked.weight());
      const double step = 1e-6;
      for (std::size_t i = 0; i < kMask.size(); ++i)
        for (Index j = 0; j < d; ++j) {
          RowMatrix<double> plus = W_double, minus = W_double;
          plus(kMask[i], j) += step;
          minus(kMask[i], j) -= step;
          const double numeric = (naive_loss(h, plus, y) - naive_loss(h, minus, y)) / (2 * step);
          const double analytic = got(static_cast<Index>(i), j);
          CHECK(std::fabs(analytic - numeric) <= 1e-7 * std::max(1.0, std::fabs(numeric)));
        }
    }
  }
  SECTION("tied: the lookup's rows and the head's rows, both within the mask, in one gradient") {
    TokenEmbedding<Scalar> embedding(V, d);
    embedding.weight().value() = make_head().weight().value();
    OutputProjection<Scalar> head(embedding);
    embedding.set_trainable_rows(kMask);  // one Parameter: the head's W is masked too
    REQUIRE(head.weight().trainable_rows() != nullptr);
    IdMatrix<std::int32_t> ids(1, 4);
    ids << 4, 2, 4, 7;  // 4 is trainable, 2 and 7 are not
    const RowMatrix<Scalar> dout = random_matrix<Scalar>(4, d, 24);
    embedding.backward(ids, dout);
    FusedHeadLoss<Scalar> loss;
    RowMatrix<Scalar> dh(N, d);
    loss.forward_backward(head, h, y, dh);
    RowMatrix<double> expected = rows_of(dW_ref, kMask);
    expected.row(1) += (dout.row(0) + dout.row(2)).template cast<double>();  // row 4 = kMask[1]
    CHECK(embedding.weight().grad().touched_rows() == kMask);
    CHECK(test_support::close(gradient_rows(embedding.weight()), expected, test_support::tolerance<Scalar>()));
  }
}

TEST_CASE("trainable rows: the bf16 head's dW on the mask's rows only", "[trainable_rows][low_precision]") {
  const Index V = 19, d = 4, N = 6;
  const RowMatrix<float> W = random_matrix<float>(V, d, 31);
  embedhead::LowPrecisionOutputProjection<Eigen::bfloat16> masked(W), full(W);
  masked.weight().set_trainable_rows(kMask);
  const RowMatrix<float> h = random_matrix<float>(N, d, 32), dlogits = random_matrix<float>(N, V, 33);
  const RowMatrix<float> dh_masked = masked.backward(h, dlogits), dh_full = full.backward(h, dlogits);
  CHECK(first_difference(dh_masked, dh_full).empty());
  CHECK(masked.weight().grad().touched_rows() == kMask);
  const RowMatrix<double> reference = dlogits.cast<double>().transpose() * h.cast<double>();
  CHECK(test_support::close(gradient_rows(masked.weight()), rows_of(reference, kMask), 2e-5));
}

namespace {

// Runs `steps` steps of an optimizer made by make(list) on a V-row parameter masked to kMask and on
// a k-row parameter holding those rows, with the same gradients on the mask's rows (some rows left
// untouched at some steps), and checks: the mask's rows equal the k-row table's bit for bit, every
// other row is unchanged, every state buffer has k rows.
template <typename Scalar, typename Make>
void check_masked_equals_k_rows(Make&& make, int steps = 5) {
  const Index V = 12, d = 3, k = static_cast<Index>(kMask.size());
  auto big = make_parameter<Scalar>(V, d, 41, "big");
  auto small = std::make_shared<Parameter<Scalar>>(
      RowMatrix<Scalar>(rows_of(big->value().template cast<double>(), kMask).template cast<Scalar>()), "small");
  const RowMatrix<Scalar> before = big->value();
  big->set_trainable_rows(kMask);
  auto big_optimizer = make(std::vector<std::shared_ptr<Parameter<Scalar>>>{big});
  auto small_optimizer = make(std::vector<std::shared_ptr<Parameter<Scalar>>>{small});
  for (int s = 0; s < steps; ++s) {
    const RowMatrix<double> G = random_matrix<double>(k, d, 100 + static_cast<std::uint64_t>(s));
    // Step s touches the mask's rows i with (i + s) % 3 != 0, so rows skip steps.
    std::vector<Index> big_rows, small_rows;
    for (Index i = 0; i < k; ++i)
      if ((i + s) % 3 != 0) big_rows.push_back(kMask[static_cast<std::size_t>(i)]), small_rows.push_back(i);
    big->zero_grad();
    small->zero_grad();
    // Through touch_rows, with a row outside the mask among the ids: dropped.
    std::vector<Index> ids = big_rows;
    ids.insert(ids.begin(), 0);
    std::vector<Index> slots(ids.size());
    big->grad().touch_rows(ids.data(), static_cast<Index>(ids.size()), slots.data());
    REQUIRE(slots[0] == embedhead::RowGradient<Scalar>::kNoSlot);
    std::vector<Index> small_slots(small_rows.size());
    small->grad().touch_rows(small_rows.data(), static_cast<Index>(small_rows.size()), small_slots.data());
    for (std::size_t j = 0; j < small_rows.size(); ++j) {
      big->grad().slot_row(slots[j + 1]) = G.row(small_rows[j]).template cast<Scalar>();
      small->grad().slot_row(small_slots[j]) = G.row(small_rows[j]).template cast<Scalar>();
    }
    big_optimizer->step();
    small_optimizer->step();
  }
  for (Index i = 0; i < k; ++i)
    CHECK(first_difference(big->value().row(kMask[static_cast<std::size_t>(i)]), small->value().row(i)).empty());
  for (Index r = 0; r < V; ++r)
    if (std::find(kMask.begin(), kMask.end(), r) == kMask.end())
      CHECK(first_difference(big->value().row(r), before.row(r)).empty());
  const auto state = big_optimizer->state();
  REQUIRE(state.parameters.size() == 1);
  REQUIRE(state.parameters[0].trainable_rows.has_value());
  CHECK(*state.parameters[0].trainable_rows == kMask);
  CHECK_FALSE(state.parameters[0].buffers.empty());
  for (const auto& [key, buffer] : state.parameters[0].buffers) {
    INFO(key);
    CHECK(buffer.rows() == k);
  }
}

}  // namespace

TEMPLATE_TEST_CASE("trainable rows: every optimizer steps the k rows as it steps a k-row table", "[trainable_rows]",
                   float, double) {
  using Scalar = TestType;
  using List = std::vector<std::shared_ptr<Parameter<Scalar>>>;
  embedhead::AdamOptions adam;
  adam.lr = 1e-2;
  adam.weight_decay = 0.05;
  SECTION("SGD with momentum and decay (exact semantics: every trainable row moves)") {
    embedhead::SGDOptions sgd;
    sgd.lr = 0.1;
    sgd.momentum = 0.9;
    sgd.weight_decay = 0.01;
    check_masked_equals_k_rows<Scalar>([&](const List& l) { return std::make_unique<embedhead::SGD<Scalar>>(sgd, l); });
  }
  SECTION("Adam") {
    check_masked_equals_k_rows<Scalar>(
        [&](const List& l) { return std::make_unique<embedhead::Adam<Scalar>>(adam, l); });
  }
  SECTION("AdamW") {
    check_masked_equals_k_rows<Scalar>(
        [&](const List& l) { return std::make_unique<embedhead::AdamW<Scalar>>(adam, l); });
  }
  SECTION("LazyAdam") {
    embedhead::AdamOptions lazy = adam;
    lazy.weight_decay = 0;
    check_masked_equals_k_rows<Scalar>(
        [&](const List& l) { return std::make_unique<embedhead::LazyAdam<Scalar>>(lazy, l); });
  }
  SECTION("LazyAdamW") {
    check_masked_equals_k_rows<Scalar>(
        [&](const List& l) { return std::make_unique<embedhead::LazyAdamW<Scalar>>(adam, l); });
  }
  SECTION("Adagrad") {
    check_masked_equals_k_rows<Scalar>(
        [&](const List& l) { return std::make_unique<embedhead::Adagrad<Scalar>>(embedhead::AdagradOptions{}, l); });
  }
  SECTION("RowWiseAdagrad") {
    embedhead::RowWiseAdagradOptions rowwise;
    rowwise.weight_decay = 0.01;
    check_masked_equals_k_rows<Scalar>(
        [&](const List& l) { return std::make_unique<embedhead::RowWiseAdagrad<Scalar>>(rowwise, l); });
  }
}

TEST_CASE("trainable rows: LazyAdamW's catch-up of ids maps them to the mask's rows", "[trainable_rows][lazy_adamw]") {
  embedhead::AdamOptions adam;
  adam.lr = 1e-2;
  adam.beta1 = 0;
  adam.weight_decay = 0.1;
  auto p = make_parameter<double>(12, 3, 51);
  p->set_trainable_rows(kMask);
  const RowMatrix<double> before = p->value();
  embedhead::LazyAdamW<double> optimizer(adam, {p});
  for (int s = 0; s < 3; ++s) {
    p->zero_grad();
    const Index row = 9;  // only row 9 is touched: rows 1, 4, 5 lag
    Index slot = 0;
    p->grad().touch_rows(&row, 1, &slot);
    p->grad().slot_row(slot).setConstant(0.5);
    optimizer.step();
  }
  CHECK(optimizer.lagging_rows(*p) == 3);
  const std::int64_t ids[] = {0, 4, 7, 4};  // 0 and 7 are not trainable: never change, never lag
  optimizer.catch_up(*p, ids, 4);
  CHECK(optimizer.lagging_rows(*p) == 2);
  // Row 4 took three decays of (1 - lr wd) in closed form (no gradient: beta1 = 0 and v = 0 keep
  // Adam's step at 0); rows 0 and 7 are as they were.
  const double f = 1.0 - 1e-2 * 0.1;
  for (Index j = 0; j < 3; ++j) CHECK(std::fabs(p->value()(4, j) - before(4, j) * f * f * f) <= 1e-15);
  CHECK(first_difference(p->value().row(0), before.row(0)).empty());
  CHECK(first_difference(p->value().row(7), before.row(7)).empty());
}

TEST_CASE("trainable rows: a mask changed under an optimizer's state needs resize_state", "[trainable_rows][errors]") {
  embedhead::AdamOptions adam;
  adam.lr = 1e-2;
  auto p = make_parameter<float>(12, 3, 61, "E");
  p->set_trainable_rows(kMask);
  embedhead::AdamW<float> optimizer(adam, {p});
  auto touch_all = [&] {
    p->zero_grad();
    const std::vector<Index> rows = *p->trainable_rows();
    std::vector<Index> slots(rows.size());
    p->grad().touch_rows(rows.data(), static_cast<Index>(rows.size()), slots.data());
    for (Index s : slots) p->grad().slot_row(s).setConstant(0.25f);
  };
  touch_all();
  optimizer.step();
  const auto state = optimizer.state();
  const RowMatrix<float> m_before = state.parameters[0].buffers.at("exp_avg");

  p->set_trainable_rows({4, 5, 6});
  touch_all();
  const RowMatrix<float> value = p->value();
  CHECK_THROWS_AS(optimizer.step(), shape_error);
  CHECK_THROWS_WITH(optimizer.step(),
                    Contains("AdamW::step: parameter 'E' has 3 trainable rows but its state holds 4 trainable rows") &&
                        Contains("call resize_state(parameter) after Parameter::set_trainable_rows"));
  CHECK(first_difference(p->value(), value).empty());
  CHECK(optimizer.step_count() == 1);
  // load_state of the old state: its rows are not the parameter's now.
  CHECK_THROWS_WITH(optimizer.load_state(state), Contains("has state for 4 trainable rows but 3 trainable rows here"));

  REQUIRE(optimizer.resize_state(*p));
  const auto resized = optimizer.state();
  REQUIRE(resized.parameters[0].trainable_rows.has_value());
  CHECK(*resized.parameters[0].trainable_rows == std::vector<Index>{4, 5, 6});
  const RowMatrix<float>& m = resized.parameters[0].buffers.at("exp_avg");
  REQUIRE(m.rows() == 3);
  CHECK(first_difference(m.row(0), m_before.row(1)).empty());  // row 4 keeps its moments
  CHECK(first_difference(m.row(1), m_before.row(2)).empty());  // row 5 too
  CHECK(m.row(2).isZero());                                    // row 6 starts fresh
  optimizer.step();
  CHECK(optimizer.step_count() == 2);
  CHECK(first_difference(p->value().row(1), value.row(1)).empty());  // row 1 is no longer trainable

  // Every row again: the state grows back to [V, d], rows 4 and 5 (and 6) keeping theirs.
  const RowMatrix<float> m_masked = optimizer.state().parameters[0].buffers.at("exp_avg");
  p->set_all_rows_trainable();
  REQUIRE(optimizer.resize_state(*p));
  const auto all = optimizer.state();
  CHECK_FALSE(all.parameters[0].trainable_rows.has_value());
  CHECK(all.parameters[0].buffers.at("exp_avg").rows() == 12);
  CHECK(first_difference(all.parameters[0].buffers.at("exp_avg").row(5), m_masked.row(1)).empty());
  CHECK(all.parameters[0].buffers.at("exp_avg").row(1).isZero());  // row 1's old state was dropped
}

TEST_CASE("trainable rows: resize_vocabulary keeps the mask's rows below the kept count, and their state",
          "[trainable_rows][vocabulary]") {
  TokenEmbedding<float> embedding(12, 3);
  embedding.set_trainable_rows(kMask);  // {1, 4, 5, 9}
  embedhead::AdamW<float> optimizer(embedhead::AdamOptions{}, embedding.parameters());
  const std::vector<Index> rows = kMask;
  std::vector<Index> slots(rows.size());
  embedding.weight().grad().touch_rows(rows.data(), 4, slots.data());
  for (Index s : slots) embedding.weight().grad().slot_row(s).setConstant(1.f);
  for (Index s = 0; s < 4; ++s) embedding.weight().grad().slot_row(slots[s]) *= static_cast<float>(s + 1);
  optimizer.step();
  const RowMatrix<float> m_before = optimizer.state().parameters[0].buffers.at("exp_avg");
  embedhead::resize_vocabulary<float>(embedding, nullptr, 8, {}, &optimizer);  // rows 8.. dropped: row 9 too
  REQUIRE(embedding.weight().trainable_rows() != nullptr);
  CHECK(*embedding.weight().trainable_rows() == std::vector<Index>{1, 4, 5});
  const auto state = optimizer.state();
  const RowMatrix<float>& m = state.parameters[0].buffers.at("exp_avg");
  REQUIRE(m.rows() == 3);
  CHECK(first_difference(m, RowMatrix<float>(m_before.topRows(3))).empty());  // rows 1, 4, 5 keep theirs
  embedding.weight().grad().touch_rows(rows.data(), 3, slots.data());
  optimizer.step();  // the state follows the mask: no resize_state needed
  CHECK(optimizer.step_count() == 2);
}

TEST_CASE("trainable rows: bf16 tables under each write-back mode step as the k-row table does",
          "[trainable_rows][low_precision]") {
  using BF16 = Parameter<Eigen::bfloat16, float>;
  const Index V = 12, d = 3, k = static_cast<Index>(kMask.size());
  const RowMatrix<float> start = random_matrix<float>(V, d, 71);
  for (const auto mode : {embedhead::LowPrecisionUpdate::nearest, embedhead::LowPrecisionUpdate::stochastic,
                          embedhead::LowPrecisionUpdate::kahan}) {
    DYNAMIC_SECTION("mode " << embedhead::low_precision_update_name(mode)) {
      // The masked V-row table; a k-row table of the mask's rows (nearest, kahan: the same bits);
      // the unmasked V-row table touched on the mask's rows only (stochastic: its draws are keyed by
      // the value's row, so the masked table's must be the unmasked one's).
      auto big = std::make_shared<BF16>(RowMatrix<Eigen::bfloat16>(start.cast<Eigen::bfloat16>()), "big");
      auto open = std::make_shared<BF16>(RowMatrix<Eigen::bfloat16>(start.cast<Eigen::bfloat16>()), "big");
      auto small = std::make_shared<BF16>(
          RowMatrix<Eigen::bfloat16>(rows_of(start.cast<double>(), kMask).cast<float>().cast<Eigen::bfloat16>()),
          "small");
      big->set_trainable_rows(kMask);
      embedhead::AdamOptions adam;
      adam.lr = 1e-3;  // updates below half an ulp of bf16: the modes differ
      adam.weight_decay = 0;
      embedhead::LazyAdam<float> on_big(adam), on_open(adam), on_small(adam);
      on_big.add_group(std::vector<std::shared_ptr<BF16>>{big});
      on_open.add_group(std::vector<std::shared_ptr<BF16>>{open});
      on_small.add_group(std::vector<std::shared_ptr<BF16>>{small});
      for (auto* o : {&on_big, &on_open, &on_small}) o->set_low_precision_update({mode, 5});
      for (int s = 0; s < 4; ++s) {
        const RowMatrix<double> G = random_matrix<double>(k, d, 200 + static_cast<std::uint64_t>(s));
        for (auto* p : {big.get(), open.get(), small.get()}) {
          p->zero_grad();
          const std::vector<Index> ids = p == small.get() ? test_support::range(0, k) : kMask;
          std::vector<Index> slots(ids.size());
          p->grad().touch_rows(ids.data(), k, slots.data());
          for (Index i = 0; i < k; ++i) p->grad().slot_row(slots[static_cast<std::size_t>(i)]) = G.row(i).cast<float>();
        }
        on_big.step();
        on_open.step();
        on_small.step();
      }
      const RowMatrix<float> got = big->value().cast<float>();
      for (Index r = 0; r < V; ++r) {
        const auto at = std::find(kMask.begin(), kMask.end(), r);
        if (at == kMask.end()) {
          CHECK(first_difference(got.row(r), RowMatrix<float>(start.cast<Eigen::bfloat16>().cast<float>()).row(r))
                    .empty());
          continue;
        }
        const Index i = static_cast<Index>(at - kMask.begin());
        if (mode == embedhead::LowPrecisionUpdate::stochastic)
          CHECK(first_difference(got.row(r), RowMatrix<float>(open->value().cast<float>()).row(r)).empty());
        else
          CHECK(first_difference(got.row(r), RowMatrix<float>(small->value().cast<float>()).row(i)).empty());
      }
      if (mode == embedhead::LowPrecisionUpdate::kahan) {
        const auto state = on_big.state();
        CHECK(state.parameters[0].buffers.at("kahan_compensation").rows() == k);
        CHECK(first_difference(state.parameters[0].buffers.at("kahan_compensation"),
                               on_small.state().parameters[0].buffers.at("kahan_compensation"))
                  .empty());
      }
    }
  }
}

TEST_CASE("trainable rows: LazyAdamW under kahan, caught up before its first step, then stepped",
          "[trainable_rows][lazy_adamw][low_precision]") {
  using BF16 = Parameter<Eigen::bfloat16, float>;
  auto p = std::make_shared<BF16>(RowMatrix<Eigen::bfloat16>(random_matrix<float>(12, 3, 81).cast<Eigen::bfloat16>()),
                                  "E");
  p->set_trainable_rows(kMask);
  embedhead::LazyAdamW<float> optimizer;
  optimizer.add_group(std::vector<std::shared_ptr<BF16>>{p});
  optimizer.set_low_precision_update({embedhead::LowPrecisionUpdate::kahan, 1});
  optimizer.catch_up();  // creates the compensation buffer, for the mask's rows
  const Index row = 4;
  Index slot = 0;
  p->grad().touch_rows(&row, 1, &slot);
  p->grad().slot_row(slot).setConstant(0.5f);
  optimizer.step();
  CHECK(optimizer.step_count() == 1);
  CHECK(optimizer.state().parameters[0].buffers.at("kahan_compensation").rows() == 4);
}

TEST_CASE("trainable rows: LazyAdamW's lagging rows keep their decay when they leave the trainable rows",
          "[trainable_rows][lazy_adamw]") {
  embedhead::AdamOptions adam;
  adam.lr = 1e-2;
  adam.beta1 = 0;
  adam.weight_decay = 0.1;
  auto p = std::make_shared<Parameter<double>>(RowMatrix<double>(RowMatrix<double>::Ones(3, 2)), "E");
  embedhead::LazyAdamW<double> optimizer(adam, {p});
  for (int s = 0; s < 3; ++s) {  // only row 0 is touched: rows 1 and 2 lag by three decays
    p->zero_grad();
    const Index row = 0;
    Index slot = 0;
    p->grad().touch_rows(&row, 1, &slot);
    p->grad().slot_row(slot).setConstant(0.5);
    optimizer.step();
  }
  p->set_trainable_rows({0, 2});
  REQUIRE(optimizer.resize_state(*p));
  // Dense AdamW (beta1 = 0, no gradient on rows 1 and 2: m = v = 0, no Adam move) multiplied both
  // by (1 - lr wd)^3. Row 1 has left the state with it; row 2 stays in it, still lagging, and takes
  // it on catch_up.
  const double f = 1.0 - 1e-2 * 0.1, expected = f * f * f;
  for (Index j = 0; j < 2; ++j) CHECK(std::fabs(p->value()(1, j) - expected) <= 1e-15);
  CHECK(p->value().row(2).isOnes(0));
  CHECK(optimizer.lagging_rows(*p) == 1);
  optimizer.catch_up();
  for (Index j = 0; j < 2; ++j) CHECK(std::fabs(p->value()(2, j) - expected) <= 1e-15);
  CHECK(optimizer.lagging_rows(*p) == 0);
}

TEMPLATE_TEST_CASE("trainable rows: an empty mask trains nothing, through every path", "[trainable_rows]", float,
                   double) {
  using Scalar = TestType;
  const Index V = 9, d = 4, N = 5;
  TokenEmbedding<Scalar> embedding(V, d);
  OutputProjection<Scalar> head(embedding);
  embedding.set_trainable_rows({});
  const RowMatrix<Scalar> before = embedding.weight().value();
  const auto ids = random_ids<std::int32_t>(1, N, V, 91);
  embedding.backward(ids, random_matrix<Scalar>(N, d, 92));
  FusedHeadLoss<Scalar> loss;
  RowMatrix<Scalar> dh(N, d);
  loss.forward_backward(head, random_matrix<Scalar>(N, d, 93), ids, dh);
  head.backward(random_matrix<Scalar>(N, d, 94), random_matrix<Scalar>(N, V, 95));
  CHECK(embedding.weight().grad().num_touched() == 0);
  embedhead::AdamW<Scalar> optimizer(embedhead::AdamOptions{}, embedding.parameters());
  optimizer.set_skip_parameters_without_grad(false);
  optimizer.step();
  CHECK(first_difference(embedding.weight().value(), before).empty());
  const auto state = optimizer.state();
  for (const auto& [key, buffer] : state.parameters[0].buffers) CHECK(buffer.rows() == 0);
}
