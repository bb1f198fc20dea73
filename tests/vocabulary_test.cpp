// Tests for include/embedhead/vocabulary.hpp: resize_vocabulary (and the Parameter::resize_rows /
// Optimizer::resize_state it is built on, tested on their own in parameter_test and
// optimizer_test).
//
// Expected values: the mean of the old rows recomputed here in double, the noise recomputed from
// Rng::normal_at at the documented draw indices, untouched rows compared bit for bit with a copy
// taken before the resize, and a padded model's loss compared with an unpadded one's.
#include <embedhead/cross_entropy.hpp>
#include <embedhead/fused_head_loss.hpp>
#include <embedhead/optim/adamw.hpp>
#include <embedhead/optim/lazy_adam.hpp>
#include <embedhead/optim/optimizer.hpp>
#include <embedhead/optim/sgd.hpp>
#include <embedhead/output_projection.hpp>
#include <embedhead/token_embedding.hpp>
#include <embedhead/vocabulary.hpp>

#include "reference/test_support.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using Catch::Matchers::Contains;
using Catch::Matchers::WithinRel;
using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::OutputProjection;
using embedhead::Parameter;
using embedhead::RowMatrix;
using embedhead::TokenEmbedding;
using embedhead::VocabularyResizeOptions;
using test_support::first_difference;
using test_support::random_ids;
using test_support::random_matrix;
using test_support::range;
using test_support::close;
using test_support::same_values;
using test_support::tolerance;

// Mean of rows [0, valid) of m, in double.
template <typename Matrix>
RowMatrix<double> mean_rows(const Matrix& m, Index valid) {
  RowMatrix<double> mean = RowMatrix<double>::Zero(1, m.cols());
  for (Index r = 0; r < valid; ++r) mean += m.row(r).template cast<double>();
  return mean / static_cast<double>(valid);
}

// A sparse gradient on `rows` of p with values G's rows.
template <typename Scalar>
void touch(Parameter<Scalar>& p, const std::vector<Index>& rows, std::uint64_t seed) {
  const RowMatrix<Scalar> G = random_matrix<Scalar>(p.rows(), p.cols(), seed);
  std::vector<Index> slots(rows.size());
  p.grad().touch_rows(rows.data(), static_cast<Index>(rows.size()), slots.data());
  for (std::size_t i = 0; i < rows.size(); ++i) p.grad().slot_row(slots[i]) += G.row(rows[i]);
}

// An untied model: embedding E [V, d] and head W [V, d] + b [V], random values, with gradients.
template <typename Scalar>
struct Model {
  TokenEmbedding<Scalar> embedding;
  OutputProjection<Scalar> head;
  Model(Index V, Index d, const embedhead::TokenEmbeddingOptions& options = {}) : embedding(V, d, options), head(V, d) {
    head.bias()->value() = random_matrix<Scalar>(V, 1, 900);
    touch(embedding.weight(), V > 1 ? std::vector<Index>{0, V - 1} : std::vector<Index>{0}, 901);
    head.backward(random_matrix<Scalar>(2, d, 902), random_matrix<Scalar>(2, V, 903));  // dense dW, db
  }
};

// Everything resize_vocabulary may change, for "unchanged after a throw" checks.
template <typename Scalar>
struct Snapshot {
  RowMatrix<Scalar> E, dE, W, dW, b, db;
  std::vector<Index> touched_E;
  embedhead::OptimizerState<Scalar> state;
  Snapshot(const Model<Scalar>& m, const embedhead::Optimizer<Scalar>& optimizer)
      : E(m.embedding.weight().value()),
        dE(m.embedding.weight().grad().to_dense()),
        W(m.head.weight().value()),
        dW(m.head.weight().grad().to_dense()),
        b(m.head.bias()->value()),
        db(m.head.bias()->grad().to_dense()),
        touched_E(m.embedding.weight().grad().touched_rows()),
        state(optimizer.state()) {}
  bool operator==(const Snapshot& o) const {
    if (!(same_values(E, o.E) && same_values(dE, o.dE) && same_values(W, o.W) && same_values(dW, o.dW) &&
          same_values(b, o.b) && same_values(db, o.db) && touched_E == o.touched_E && state.step == o.state.step &&
          state.parameters.size() == o.state.parameters.size()))
      return false;
    for (std::size_t i = 0; i < state.parameters.size(); ++i) {
      const auto &x = state.parameters[i], &y = o.state.parameters[i];
      if (x.rows != y.rows || x.buffers.size() != y.buffers.size()) return false;
      for (const auto& [key, buffer] : x.buffers)
        if (!y.buffers.count(key) || !same_values(buffer, y.buffers.at(key))) return false;
    }
    return true;
  }
};

}  // namespace

TEMPLATE_TEST_CASE("resize_vocabulary grows an untied model: kept rows exact, new rows the mean, padding zero",
                   "[vocabulary][resize]", float, double) {
  using Scalar = TestType;
  const Index V = 5, d = 3;
  Model<Scalar> m(V, d);
  embedhead::AdamW<Scalar> adam(embedhead::AdamOptions{}, {m.embedding.weight_ptr(), m.head.weight_ptr()});
  auto other = std::make_shared<Parameter<Scalar>>(1, 1, "other");
  other->grad().dense_accumulator().setConstant(Scalar(1));  // a gradient, so that step() updates it
  adam.add_group({other});
  adam.step();  // creates the buffers; the bias is not registered
  const Snapshot<Scalar> before(m, adam);
  const Parameter<Scalar>* E_address = &m.embedding.weight();
  const Parameter<Scalar>* W_address = &m.head.weight();
  const Parameter<Scalar>* b_address = m.head.bias();

  VocabularyResizeOptions options;
  options.pad_to_multiple = 4;
  const auto result = embedhead::resize_vocabulary<Scalar>(m.embedding, &m.head, 7, options, &adam);
  CHECK(result.rows == 8);
  CHECK(result.valid_vocab == 7);
  CHECK(result.kept_rows == 5);

  // The same Parameter objects, now [8, d].
  CHECK(&m.embedding.weight() == E_address);
  CHECK(&m.head.weight() == W_address);
  CHECK(m.head.bias() == b_address);
  CHECK(m.embedding.vocab_size() == 8);
  CHECK(m.head.vocab_size() == 8);
  CHECK(m.head.bias()->rows() == 8);

  // Values: kept rows bit for bit; rows 5, 6 the mean of the old rows (each table its own); row 7 zero.
  const auto check_table = [&](const auto& value, const RowMatrix<Scalar>& old) {
    CHECK(first_difference(value.topRows(V), old).empty());
    const RowMatrix<Scalar> mean = mean_rows(old, V).template cast<Scalar>();
    CHECK(first_difference(value.row(5), mean).empty());
    CHECK(first_difference(value.row(6), mean).empty());
    CHECK(value.row(7) == RowMatrix<Scalar>::Zero(1, old.cols()));
  };
  check_table(m.embedding.weight().value(), before.E);
  check_table(m.head.weight().value(), before.W);
  check_table(m.head.bias()->value(), before.b);  // the bias: new tokens get the mean of the old bias

  // Gradients: kept rows keep theirs; new rows have none (the dense ones stay dense, new rows zero).
  CHECK(m.embedding.weight().grad().touched_rows() == std::vector<Index>({0, V - 1}));
  RowMatrix<Scalar> dE = RowMatrix<Scalar>::Zero(8, d);
  dE.topRows(V) = before.dE;
  CHECK(same_values(m.embedding.weight().grad().to_dense(), dE));
  CHECK(m.head.weight().grad().is_dense());
  RowMatrix<Scalar> dW = RowMatrix<Scalar>::Zero(8, d);
  dW.topRows(V) = before.dW;
  CHECK(same_values(m.head.weight().grad().to_dense(), dW));
  CHECK(same_values(m.head.bias()->grad().to_dense().topRows(V), before.db));

  // Optimizer state: the registered E and W resized, kept rows exact, new rows zero; the rest as it was.
  const auto state = adam.state();
  CHECK(state.step == 1);
  for (std::size_t i = 0; i < 2; ++i) {
    CHECK(state.parameters[i].rows == 8);
    for (const char* key : {"exp_avg", "exp_avg_sq"}) {
      const RowMatrix<Scalar>& buffer = state.parameters[i].buffers.at(key);
      CHECK(same_values(buffer.topRows(V), before.state.parameters[i].buffers.at(key)));
      CHECK(buffer.bottomRows(3) == RowMatrix<Scalar>::Zero(3, d));
    }
  }
  CHECK(same_values(state.parameters[2].buffers.at("exp_avg"), before.state.parameters[2].buffers.at("exp_avg")));

  // The model runs at the new size.
  const IdMatrix<std::int32_t> ids = random_ids<std::int32_t>(2, 4, 7, 910);
  const RowMatrix<Scalar> h = m.embedding.forward(ids);
  CHECK(m.head.forward(h).cols() == 8);
}

TEMPLATE_TEST_CASE("resize_vocabulary keeps a tied head tied", "[vocabulary][tied]", float, double) {
  using Scalar = TestType;
  const Index V = 6, d = 4;
  TokenEmbedding<Scalar> embedding(V, d);
  OutputProjection<Scalar> head(embedding);
  embedhead::LazyAdam<Scalar> lazy(embedhead::LazyAdam<Scalar>::lazy_defaults(), {embedding.weight_ptr()});
  touch(embedding.weight(), {1, 2}, 920);
  lazy.step();
  const RowMatrix<Scalar> old = embedding.weight().value();

  const auto result = embedhead::resize_vocabulary<Scalar>(embedding, &head, 9, {}, &lazy);
  CHECK(result.rows == 9);
  CHECK(head.weight_ptr() == embedding.weight_ptr());
  CHECK(head.is_tied_to(embedding));
  CHECK(head.vocab_size() == 9);
  CHECK(first_difference(embedding.weight().value().topRows(V), old).empty());
  const RowMatrix<Scalar> mean = mean_rows(old, V).template cast<Scalar>();
  for (Index r = V; r < 9; ++r) CHECK(first_difference(embedding.weight().value().row(r), mean).empty());
  CHECK(lazy.state().parameters[0].buffers.at("exp_avg").rows() == 9);  // resized once

  // Writing to the embedding is seen by the head: one table.
  embedding.weight().value().row(8).setConstant(Scalar(2));
  const RowMatrix<Scalar> h = RowMatrix<Scalar>::Ones(1, d);
  CHECK(head.forward(h)(0, 8) == Scalar(2 * d));
  // And one gradient: the head's dense dW lands beside the embedding's sparse rows.
  head.backward(h, RowMatrix<Scalar>::Ones(1, 9));
  CHECK(embedding.weight().grad().is_dense());
  CHECK(embedding.weight().grad().rows() == 9);

  // Frozen through the embedding: still frozen after a resize, for the head too.
  embedding.set_frozen(true);
  embedhead::resize_vocabulary<Scalar>(embedding, &head, 4);
  CHECK(head.weight().frozen());
  CHECK(head.vocab_size() == 4);
}

TEMPLATE_TEST_CASE("resize_vocabulary noise is reproducible from the seed at the documented draws",
                   "[vocabulary][noise]", float, double) {
  using Scalar = TestType;
  const Index V = 4, d = 3, grown = 7;
  VocabularyResizeOptions options;
  options.noise_std = 0.5;
  options.seed = 42;
  options.pad_to_multiple = 8;  // rows = 8
  auto resized = [&](const VocabularyResizeOptions& o) {
    Model<Scalar> m(V, d);
    embedhead::resize_vocabulary<Scalar>(m.embedding, &m.head, grown, o);
    return std::make_pair(RowMatrix<Scalar>(m.embedding.weight().value()), RowMatrix<Scalar>(m.head.weight().value()));
  };
  const auto [E, W] = resized(options);
  Model<Scalar> m(V, d);  // the same values before the resize
  const RowMatrix<double> mean_E = mean_rows(m.embedding.weight().value(), V),
                          mean_W = mean_rows(m.head.weight().value(), V);
  const embedhead::Rng rng(42);
  const std::uint64_t head_offset = 2 * static_cast<std::uint64_t>(8 * d);
  for (Index r = V; r < grown; ++r)
    for (Index c = 0; c < d; ++c) {
      const std::uint64_t draw = 2 * static_cast<std::uint64_t>(r * d + c);
      CHECK(E(r, c) == static_cast<Scalar>(mean_E(0, c) + 0.5 * rng.normal_at(draw)));
      CHECK(W(r, c) == static_cast<Scalar>(mean_W(0, c) + 0.5 * rng.normal_at(head_offset + draw)));
    }
  CHECK(E.row(7) == RowMatrix<Scalar>::Zero(1, d));  // padding: no noise
  const auto [E2, W2] = resized(options);
  CHECK(same_values(E, E2));
  CHECK(same_values(W, W2));
  options.seed = 43;
  const auto [E3, W3] = resized(options);
  CHECK_FALSE(same_values(E.row(V), E3.row(V)));
  CHECK(same_values(E.topRows(V), E3.topRows(V)));
}

TEMPLATE_TEST_CASE("resize_vocabulary shrinks and re-pads", "[vocabulary][shrink]", float, double) {
  using Scalar = TestType;
  const Index V = 8, d = 2;

  SECTION("shrinking drops rows, their gradients and their optimizer state") {
    Model<Scalar> m(V, d);
    embedhead::SGDOptions sgd_options;
    sgd_options.momentum = 0.9;
    embedhead::SGD<Scalar> sgd(sgd_options, {m.embedding.weight_ptr(), m.head.weight_ptr(), m.head.parameters()[1]});
    sgd.step();
    const RowMatrix<Scalar> E = m.embedding.weight().value(), b = m.head.bias()->value();
    const auto result = embedhead::resize_vocabulary<Scalar>(m.embedding, &m.head, 3, {}, &sgd);
    CHECK(result.rows == 3);
    CHECK(result.kept_rows == 3);
    CHECK(first_difference(m.embedding.weight().value(), E.topRows(3)).empty());
    CHECK(first_difference(m.head.bias()->value(), b.topRows(3)).empty());
    CHECK(m.embedding.weight().grad().touched_rows() == std::vector<Index>({0}));  // row V - 1 dropped
    CHECK(m.head.weight().grad().rows() == 3);
    for (const auto& entry : sgd.state().parameters) CHECK(entry.buffers.at("momentum_buffer").rows() == 3);
  }

  SECTION("shrinking with padding: rows past new_vocab become zero padding, with no gradient") {
    Model<Scalar> m(V, d);
    const RowMatrix<Scalar> E = m.embedding.weight().value();
    VocabularyResizeOptions options;
    options.pad_to_multiple = 4;
    const auto result = embedhead::resize_vocabulary<Scalar>(m.embedding, &m.head, 5, options);
    CHECK(result.rows == 8);
    CHECK(result.kept_rows == 5);
    CHECK(first_difference(m.embedding.weight().value().topRows(5), E.topRows(5)).empty());
    CHECK(m.embedding.weight().value().bottomRows(3) == RowMatrix<Scalar>::Zero(3, d));
    CHECK(m.embedding.weight().grad().touched_rows() == std::vector<Index>({0}));  // row 7's gradient dropped
  }

  SECTION("old_valid_vocab: a second resize replaces the old padding and leaves it out of the mean") {
    Model<Scalar> m(5, d);
    const RowMatrix<Scalar> E = m.embedding.weight().value();
    VocabularyResizeOptions options;
    options.pad_to_multiple = 4;
    const auto first = embedhead::resize_vocabulary<Scalar>(m.embedding, &m.head, 6, options);  // rows 8, valid 6
    const RowMatrix<Scalar> E6 = m.embedding.weight().value();
    CHECK(E6.row(6) == RowMatrix<Scalar>::Zero(1, d));
    options.old_valid_vocab = first.valid_vocab;
    const auto second = embedhead::resize_vocabulary<Scalar>(m.embedding, &m.head, 10, options);
    CHECK(second.rows == 12);
    CHECK(second.kept_rows == 6);
    const auto& value = m.embedding.weight().value();
    CHECK(first_difference(value.topRows(6), E6.topRows(6)).empty());
    const RowMatrix<Scalar> mean = mean_rows(E6, 6).template cast<Scalar>();
    for (Index r = 6; r < 10; ++r) CHECK(first_difference(value.row(r), mean).empty());
    CHECK(value.bottomRows(2) == RowMatrix<Scalar>::Zero(2, d));
    CHECK(first_difference(value.topRows(5), E).empty());
  }

  SECTION("V = 1, d = 1: new rows copy the one row; same size keeps everything") {
    Model<Scalar> m(1, 1);
    const Scalar e = m.embedding.weight().value()(0, 0);
    embedhead::resize_vocabulary<Scalar>(m.embedding, &m.head, 3);
    CHECK(m.embedding.weight().value() == RowMatrix<Scalar>::Constant(3, 1, e));
    const RowMatrix<Scalar> E = m.embedding.weight().value();
    const auto result = embedhead::resize_vocabulary<Scalar>(m.embedding, nullptr, 3);
    CHECK(result.kept_rows == 3);
    CHECK(same_values(m.embedding.weight().value(), E));
    CHECK(m.head.vocab_size() == 3);
  }
}

TEMPLATE_TEST_CASE(
    "a padded vocabulary with valid_vocab: padded columns get zero gradient and leave the loss unchanged",
    "[vocabulary][padding][loss]", float, double) {
  using Scalar = TestType;
  const Index V = 7, d = 4, N = 6;
  const IdMatrix<std::int32_t> targets = random_ids<std::int32_t>(2, 3, V, 930);
  const RowMatrix<Scalar> h = random_matrix<Scalar>(N, d, 931);
  Model<Scalar> plain(V, d), padded(V, d);  // equal values
  plain.head.zero_grad();
  padded.head.zero_grad();
  VocabularyResizeOptions options;
  options.pad_to_multiple = 4;
  const auto result = embedhead::resize_vocabulary<Scalar>(padded.embedding, &padded.head, V, options);
  REQUIRE(result.rows == 8);
  REQUIRE(result.valid_vocab == V);
  REQUIRE(result.kept_rows == V);
  // Give the padding row non-zero values: with valid_vocab they still must not matter.
  padded.head.weight().value().row(7).setConstant(Scalar(3));
  padded.head.bias()->value()(7, 0) = Scalar(5);

  SECTION("unfused: head forward, cross-entropy with valid_vocab, head backward") {
    embedhead::CrossEntropyOptions ce;
    const RowMatrix<Scalar> logits_plain = plain.head.forward(h);
    RowMatrix<Scalar> dlogits_plain(N, V);
    const auto expected = embedhead::cross_entropy_forward_backward<Scalar>(logits_plain, targets, dlogits_plain, ce);
    const RowMatrix<Scalar> dh_plain = plain.head.backward(h, dlogits_plain);

    ce.valid_vocab = result.valid_vocab;
    const RowMatrix<Scalar> logits = padded.head.forward(h);
    RowMatrix<Scalar> dlogits(N, 8);
    const auto actual = embedhead::cross_entropy_forward_backward<Scalar>(logits, targets, dlogits, ce);
    const RowMatrix<Scalar> dh = padded.head.backward(h, dlogits);
    CHECK_THAT(actual.loss, WithinRel(expected.loss, tolerance<Scalar>()));
    CHECK(dlogits.col(7) == RowMatrix<Scalar>::Zero(N, 1));
    CHECK(close(dlogits.leftCols(V), dlogits_plain, tolerance<Scalar>()));
    CHECK(close(dh, dh_plain, tolerance<Scalar>()));
    const RowMatrix<Scalar> dW = padded.head.weight().grad().to_dense();
    CHECK(dW.row(7) == RowMatrix<Scalar>::Zero(1, d));
    CHECK(padded.head.bias()->grad().to_dense()(7, 0) == Scalar(0));
    CHECK(close(dW.topRows(V), plain.head.weight().grad().to_dense(), tolerance<Scalar>()));
  }

  SECTION("fused: FusedHeadLossOptions::valid_vocab") {
    embedhead::FusedHeadLossOptions fo;
    embedhead::FusedHeadLoss<Scalar> plain_loss(fo);
    RowMatrix<Scalar> dh_plain(N, d), dh(N, d);
    const auto expected = plain_loss.forward_backward(plain.head, h, targets, dh_plain);
    fo.valid_vocab = result.valid_vocab;
    embedhead::FusedHeadLoss<Scalar> padded_loss(fo);
    const auto actual = padded_loss.forward_backward(padded.head, h, targets, dh);
    CHECK_THAT(actual.loss, WithinRel(expected.loss, tolerance<Scalar>()));
    CHECK(close(dh, dh_plain, tolerance<Scalar>()));
    const RowMatrix<Scalar> dW = padded.head.weight().grad().to_dense();
    CHECK(dW.row(7) == RowMatrix<Scalar>::Zero(1, d));
    CHECK(close(dW.topRows(V), plain.head.weight().grad().to_dense(), tolerance<Scalar>()));
  }

  SECTION("zero padding rows stay exactly zero under AdamW with weight decay") {
    Model<Scalar> model(V, d);
    embedhead::AdamW<Scalar> adam(embedhead::AdamOptions{}, {model.embedding.weight_ptr(), model.head.weight_ptr()});
    embedhead::resize_vocabulary<Scalar>(model.embedding, &model.head, V, options, &adam);
    embedhead::FusedHeadLossOptions fo;
    fo.valid_vocab = V;
    embedhead::FusedHeadLoss<Scalar> loss(fo);
    RowMatrix<Scalar> dh(N, d);
    for (int step = 0; step < 3; ++step) {
      model.head.zero_grad();
      loss.forward_backward(model.head, h, targets, dh);
      adam.step();
    }
    CHECK(model.head.weight().value().row(7) == RowMatrix<Scalar>::Zero(1, d));
    CHECK(model.embedding.weight().value().row(7) == RowMatrix<Scalar>::Zero(1, d));
  }
}

TEMPLATE_TEST_CASE("after resize_vocabulary, old rows train exactly as if never resized", "[vocabulary][optimizer]",
                   float, double) {
  using Scalar = TestType;
  const Index V = 6, d = 3, N = 5;
  const IdMatrix<std::int32_t> ids = random_ids<std::int32_t>(1, N, V, 940);
  const RowMatrix<Scalar> dout = random_matrix<Scalar>(N, d, 941);
  auto run = [&](auto make_optimizer) {
    TokenEmbedding<Scalar> a(V, d), b(V, d);  // equal tables
    auto oa = make_optimizer(a.weight_ptr());
    auto ob = make_optimizer(b.weight_ptr());
    for (int step = 0; step < 3; ++step) {
      a.zero_grad();
      b.zero_grad();
      a.backward(ids, dout);
      b.backward(ids, dout);
      oa.step();
      ob.step();
    }
    embedhead::resize_vocabulary<Scalar>(a, nullptr, 10, {}, &oa);
    a.zero_grad();
    b.zero_grad();
    a.backward(ids, dout);
    b.backward(ids, dout);
    oa.step();
    ob.step();
    CHECK(first_difference(a.weight().value().topRows(V), b.weight().value()).empty());
  };
  run([](const std::shared_ptr<Parameter<Scalar>>& p) {
    return embedhead::AdamW<Scalar>(embedhead::AdamOptions{}, {p});
  });
  run([](const std::shared_ptr<Parameter<Scalar>>& p) {
    return embedhead::LazyAdam<Scalar>(embedhead::LazyAdam<Scalar>::lazy_defaults(), {p});
  });
}

TEMPLATE_TEST_CASE("resize_vocabulary rejects bad arguments and changes nothing", "[vocabulary][errors]", float,
                   double) {
  using Scalar = TestType;
  const Index V = 5, d = 3;
  embedhead::TokenEmbeddingOptions embedding_options;
  embedding_options.padding_idx = 3;
  Model<Scalar> m(V, d, embedding_options);
  embedhead::AdamW<Scalar> adam(embedhead::AdamOptions{},
                                {m.embedding.weight_ptr(), m.head.weight_ptr(), m.head.parameters()[1]});
  adam.step();
  const Snapshot<Scalar> before(m, adam);
  auto resize = [&](Index new_vocab, const VocabularyResizeOptions& options, OutputProjection<Scalar>* head) {
    return embedhead::resize_vocabulary<Scalar>(m.embedding, head, new_vocab, options, &adam);
  };
  const VocabularyResizeOptions defaults;
  auto with = [&](auto change) {
    VocabularyResizeOptions options;
    change(options);
    return options;
  };

  CHECK_THROWS_AS(resize(0, defaults, &m.head), embedhead::value_error);
  CHECK_THROWS_WITH(resize(0, defaults, &m.head), Contains("resize_vocabulary: new_vocab = 0 outside [1, inf)"));
  CHECK_THROWS_WITH(resize(-4, defaults, &m.head), Contains("new_vocab = -4 outside [1, inf)"));
  const auto no_multiple = with([](auto& o) { o.pad_to_multiple = 0; });
  CHECK_THROWS_AS(resize(6, no_multiple, &m.head), embedhead::value_error);
  CHECK_THROWS_WITH(resize(6, no_multiple, &m.head),
                    Contains("resize_vocabulary: pad_to_multiple = 0 outside [1, inf)"));
  const auto negative_noise = with([](auto& o) { o.noise_std = -0.5; });
  CHECK_THROWS_WITH(resize(6, negative_noise, &m.head),
                    Contains("resize_vocabulary: noise_std = -0.5 outside [0, inf)"));
  const auto nan_noise = with([](auto& o) { o.noise_std = std::numeric_limits<double>::quiet_NaN(); });
  CHECK_THROWS_AS(resize(6, nan_noise, &m.head), embedhead::value_error);
  // Finite in double and in Scalar, but the largest normal draw (8.5717 standard deviations)
  // would make an inf row.
  constexpr bool is_float = std::is_same_v<Scalar, float>;
  const auto huge_noise = with([&](auto& o) { o.noise_std = is_float ? 1e38 : 1e308; });
  CHECK_THROWS_AS(resize(6, huge_noise, &m.head), embedhead::value_error);
  CHECK_THROWS_WITH(resize(6, huge_noise, &m.head),
                    Contains(std::string("resize_vocabulary: noise_std = ") + (is_float ? "1e+38" : "1e+308") +
                             " outside [0, ") &&
                        Contains(std::string("] in ") + (is_float ? "float" : "double") + ": its largest draw"));
  const auto bad_valid = with([](auto& o) { o.old_valid_vocab = 6; });
  CHECK_THROWS_WITH(resize(6, bad_valid, &m.head), Contains("resize_vocabulary: old_valid_vocab = 6 outside [1, 5]"));
  const auto zero_valid = with([](auto& o) { o.old_valid_vocab = 0; });
  CHECK_THROWS_AS(resize(6, zero_valid, &m.head), embedhead::value_error);
  const auto huge_multiple = with([](auto& o) { o.pad_to_multiple = std::numeric_limits<Index>::max(); });
  CHECK_THROWS_WITH(resize(6, huge_multiple, &m.head), Contains("overflows Index"));

  // padding_idx 3 must stay a token.
  CHECK_THROWS_AS(resize(3, defaults, &m.head), embedhead::index_error);
  CHECK_THROWS_WITH(resize(3, defaults, &m.head),
                    Contains("resize_vocabulary: the embedding's padding_idx 3 outside [0, 3) (new_vocab = 3)"));

  // An untied head of another shape.
  OutputProjection<Scalar> wide(V, d + 1), longer(V + 1, d);
  CHECK_THROWS_AS(resize(6, defaults, &wide), embedhead::shape_error);
  CHECK_THROWS_WITH(
      resize(6, defaults, &wide),
      Contains("resize_vocabulary: the untied head is [V=5, d=4] with a bias of V=5 but the embedding is [V=5, d=3]"));
  CHECK_THROWS_WITH(resize(6, defaults, &longer), Contains("the untied head is [V=6, d=3]"));
  const RowMatrix<Scalar> wide_W = wide.weight().value();

  // Moved-from layers.
  TokenEmbedding<Scalar> moved_to(std::move(m.embedding));
  CHECK_THROWS_WITH(embedhead::resize_vocabulary<Scalar>(m.embedding, nullptr, 6),
                    Contains("resize_vocabulary: the TokenEmbedding was moved from"));
  m.embedding = std::move(moved_to);
  OutputProjection<Scalar> head_moved_to(std::move(wide));
  CHECK_THROWS_WITH(resize(6, defaults, &wide), Contains("resize_vocabulary: the OutputProjection was moved from"));

  // Nothing changed anywhere.
  CHECK(Snapshot<Scalar>(m, adam) == before);
  CHECK(same_values(head_moved_to.weight().value(), wide_W));
  CHECK(m.embedding.vocab_size() == V);
  // And a valid call still works afterwards.
  CHECK(resize(6, defaults, &m.head).rows == 6);
}
