// The layer contract: every trainable layer -- TokenEmbedding, LearnedPositionEmbedding (its
// backward with a start and with positions [B, T]), OutputProjection (untied and tied both ways),
// LowPrecisionEmbedding, LowPrecisionOutputProjection (bf16 and fp16), VocabParallelEmbedding and
// VocabParallelOutputProjection (one rank) -- goes through ONE function template, check_contract,
// which exercises the whole surface:
//   weight() / weight_ptr() (and bias() / bias_ptr() where the layer has one) agree with
//   parameters(), which lists each distinct parameter once; parameter_count() is the sum of their
//   sizes; vocab_size() / dim() (max_positions() / dim() for a position table) are the shapes;
//   a real backward fills every gradient and zero_grad() clears them; set_frozen(true) makes a
//   backward leave the gradients empty and an optimizer step leave the values unchanged (stepping
//   again after set_frozen(false) does change them); clip_grad_norm, count_parameters and the
//   data-parallel exchange accept parameters() as it is.
// QuantizedEmbedding is inference-only and has the read-only part only (its own test case).
// Expected values come from the test's own arithmetic (sizes, sums of squares), never from the
// code under test.
#include <embedhead/embedhead.hpp>

#include "reference/test_support.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

using namespace embedhead;
using Catch::Matchers::Contains;
using test_support::first_difference;
using test_support::random_ids;
using test_support::random_matrix;

namespace {

constexpr Index kV = 7, kD = 4, kB = 2, kT = 3;

// ---- detection of the optional parts of the surface ----

template <typename L, typename = void>
struct has_bias_ptr : std::false_type {};
template <typename L>
struct has_bias_ptr<L, std::void_t<decltype(std::declval<const L&>().bias_ptr())>> : std::true_type {};

template <typename L, typename = void>
struct has_vocab_size : std::false_type {};
template <typename L>
struct has_vocab_size<L, std::void_t<decltype(std::declval<const L&>().vocab_size())>> : std::true_type {};

// The layer's values as float, per parameter (weight, then bias): a bf16 / fp16 value widens
// exactly, so equality of these is equality of the stored values.
template <typename P>
RowMatrix<float> value_as_float(const P& p) {
  return static_cast<const P&>(p).value().template cast<float>();
}
template <typename Layer>
std::vector<RowMatrix<float>> values_of(const Layer& layer) {
  std::vector<RowMatrix<float>> values{value_as_float(*layer.weight_ptr())};
  if constexpr (has_bias_ptr<Layer>::value)
    if (layer.bias_ptr()) values.push_back(value_as_float(*layer.bias_ptr()));
  return values;
}

// The layer's parameters whose value is float: what Optimizer<float> steps. A low-precision W is
// left out (the optimizers reject it at compile time, see optim/optimizer.hpp).
template <typename Layer>
std::vector<std::shared_ptr<Parameter<float>>> float_parameters(const Layer& layer) {
  std::vector<std::shared_ptr<Parameter<float>>> list;
  using W = typename std::decay_t<decltype(layer.weight_ptr())>::element_type;
  if constexpr (std::is_same_v<W, Parameter<float>>) list.push_back(layer.weight_ptr());
  if constexpr (has_bias_ptr<Layer>::value)
    if (layer.bias_ptr()) list.push_back(layer.bias_ptr());
  return list;
}

struct Expected {
  Index rows = 0, cols = 0;  // the shape vocab_size()/max_positions() x dim()
  bool bias = false;
  std::size_t stepped = 0;  // how many parameters an Optimizer<float> can step
};

// The one generic check. `backward(layer)` runs a real backward with non-zero upstream gradients.
template <typename Layer, typename Backward>
void check_contract(Layer& layer, const Backward& backward, const Expected& expected) {
  // -- shapes --
  if constexpr (has_vocab_size<Layer>::value)
    CHECK(layer.vocab_size() == expected.rows);
  else
    CHECK(layer.max_positions() == expected.rows);
  CHECK(layer.dim() == expected.cols);
  CHECK(layer.weight().cols() == expected.cols);

  // -- weight(), bias(), parameters() --
  const auto params = layer.parameters();
  REQUIRE(params.size() == (expected.bias ? 2u : 1u));
  for (std::size_t i = 0; i < params.size(); ++i) {
    REQUIRE(params[i] != nullptr);
    for (std::size_t j = 0; j < i; ++j) CHECK(params[i] != params[j]);  // each distinct one once
  }
  CHECK(params[0] == layer.weight_ptr());
  CHECK(&layer.weight() == layer.weight_ptr().get());
  if constexpr (has_bias_ptr<Layer>::value) {
    CHECK((layer.bias_ptr() != nullptr) == expected.bias);
    CHECK(layer.has_bias() == expected.bias);
    CHECK(layer.bias() == layer.bias_ptr().get());
    if (expected.bias) {
      CHECK(params[1] == layer.bias_ptr());
      CHECK(layer.bias_ptr()->rows() == layer.weight().rows());
      CHECK(layer.bias_ptr()->cols() == 1);
    }
  } else {
    CHECK_FALSE(expected.bias);
  }

  // -- parameter_count() --
  Index total = 0;
  for (const auto& p : params) total += p->rows() * p->cols();
  const Index rows = layer.weight().rows();
  CHECK(total == rows * expected.cols + (expected.bias ? rows : 0));
  CHECK(layer.parameter_count() == total);
  CHECK(count_parameters(params) == total);

  // -- a real backward fills every gradient; zero_grad() clears every one --
  CHECK_FALSE(layer.frozen());
  backward(layer);
  double squares = 0;
  for (const auto& p : params) {
    CHECK(p->grad().num_touched() > 0);
    const RowMatrix<double> g = p->grad().to_dense().template cast<double>();
    CHECK(g.cwiseAbs().maxCoeff() > 0);
    squares += g.squaredNorm();
  }
  // The gradient-side consumers take parameters() as it is: clipping (a bound it does not reach,
  // so nothing is scaled) and the data-parallel exchange (one rank: nothing changes).
  CHECK(clip_grad_norm(params, 1e30) == Approx(std::sqrt(squares)).epsilon(1e-6));
  SingleProcessCommunicator comm;
  const std::vector<GradientExchangeResult> exchanged = all_reduce_gradients(params, comm);
  REQUIRE(exchanged.size() == params.size());
  for (std::size_t i = 0; i < params.size(); ++i) CHECK(exchanged[i].union_rows == params[i]->grad().num_touched());
  layer.zero_grad();
  for (const auto& p : params) {
    CHECK(p->grad().num_touched() == 0);
    CHECK(p->grad().to_dense().isZero(0));
  }

  // -- set_frozen(true): a backward leaves the gradients alone, a step leaves the values alone --
  const std::vector<RowMatrix<float>> before = values_of(layer);
  const auto stepped = float_parameters(layer);
  CHECK(stepped.size() == expected.stepped);
  layer.set_frozen(true);
  CHECK(layer.frozen());
  for (const auto& p : params) CHECK(p->frozen());
  backward(layer);
  for (const auto& p : params) {
    CHECK(p->grad().num_touched() == 0);
    CHECK_FALSE(p->grad().is_dense());
  }
  if (!stepped.empty()) {
    // AdamW with weight decay moves every row of a live parameter, gradient or not.
    AdamOptions options;
    options.lr = 0.1;
    options.weight_decay = 0.5;
    AdamW<float> adamw(options, stepped);
    adamw.step();
    const std::vector<RowMatrix<float>> after = values_of(layer);
    REQUIRE(after.size() == before.size());
    for (std::size_t i = 0; i < before.size(); ++i) CHECK(first_difference(after[i], before[i]) == "");
    // Control: unfrozen, with gradients, the same optimizer moves exactly the stepped parameters.
    layer.set_frozen(false);
    backward(layer);
    adamw.step();
    const std::vector<RowMatrix<float>> moved = values_of(layer);
    std::size_t changed = 0;
    for (std::size_t i = 0; i < before.size(); ++i) changed += first_difference(moved[i], before[i]) != "" ? 1 : 0;
    CHECK(changed == expected.stepped);
  }
  layer.set_frozen(false);
  CHECK_FALSE(layer.frozen());
  for (const auto& p : params) CHECK_FALSE(p->frozen());
}

// ---- backward drivers, one per kind of layer ----

const auto embedding_backward_driver = [](auto& layer) {
  using Scalar = std::decay_t<decltype(layer.weight().grad().touched_values()(0, 0))>;
  const IdMatrix<std::int32_t> ids = random_ids<std::int32_t>(kB, kT, layer.vocab_size(), 11);
  layer.backward(ids, random_matrix<Scalar>(kB * kT, layer.dim(), 12));
};
const auto head_backward_driver = [](auto& layer) {
  using Scalar = std::decay_t<decltype(layer.weight().grad().touched_values()(0, 0))>;
  const RowMatrix<Scalar> h = random_matrix<Scalar>(kB * kT, layer.dim(), 13);
  const RowMatrix<Scalar> dlogits = random_matrix<Scalar>(kB * kT, layer.weight().rows(), 14);
  RowMatrix<Scalar> dh(kB * kT, layer.dim());
  layer.backward(h, dlogits, dh);
};
const auto position_backward_driver = [](auto& layer) {
  using Scalar = std::decay_t<decltype(layer.weight().grad().touched_values()(0, 0))>;
  layer.backward(random_matrix<Scalar>(kB * kT, layer.dim(), 15), kB, kT);
};
// The per-row form: positions [B, T] (a left-padded row and a packed one) instead of a start.
const auto position_ids_backward_driver = [](auto& layer) {
  using Scalar = std::decay_t<decltype(layer.weight().grad().touched_values()(0, 0))>;
  IdMatrix<std::int64_t> positions(kB, kT);
  positions << 1, 0, 1, 0, 1, 0;
  layer.backward(random_matrix<Scalar>(kB * kT, layer.dim(), 16), positions);
};

}  // namespace

TEST_CASE("layer contract: the float layers", "[layer_contract]") {
  SECTION("TokenEmbedding") {
    TokenEmbedding<float> layer(kV, kD);
    check_contract(layer, embedding_backward_driver, {kV, kD, false, 1});
  }
  SECTION("TokenEmbedding<double>") {
    TokenEmbedding<double> layer(kV, kD);
    check_contract(layer, embedding_backward_driver, {kV, kD, false, 0});
  }
  SECTION("LearnedPositionEmbedding") {
    LearnedPositionEmbedding<float> layer(kT + 2, kD);
    check_contract(layer, position_backward_driver, {kT + 2, kD, false, 1});
  }
  SECTION("LearnedPositionEmbedding, positions [B, T]") {
    LearnedPositionEmbedding<float> layer(kT + 2, kD);
    check_contract(layer, position_ids_backward_driver, {kT + 2, kD, false, 1});
  }
  SECTION("OutputProjection, untied with a bias") {
    OutputProjection<float> layer(kV, kD);
    check_contract(layer, head_backward_driver, {kV, kD, true, 2});
  }
  SECTION("OutputProjection, untied without a bias") {
    OutputProjectionOptions options;
    options.bias = false;
    OutputProjection<float> layer(kV, kD, options);
    check_contract(layer, head_backward_driver, {kV, kD, false, 1});
  }
  SECTION("OutputProjection tied by the TokenEmbedding constructor") {
    TokenEmbedding<float> embedding(kV, kD);
    OutputProjection<float> layer(embedding);
    CHECK(layer.is_tied_to(embedding));
    check_contract(layer, head_backward_driver, {kV, kD, false, 1});
  }
  SECTION("OutputProjection tied by wrapping the embedding's weight_ptr()") {
    TokenEmbedding<float> embedding(kV, kD);
    OutputProjection<float> layer(embedding.weight_ptr());
    CHECK(layer.is_tied_to(embedding));
    check_contract(layer, head_backward_driver, {kV, kD, false, 1});
  }
}

TEMPLATE_TEST_CASE("layer contract: the low-precision layers", "[layer_contract][low_precision]", Eigen::bfloat16,
                   Eigen::half) {
  using Storage = TestType;
  const RowMatrix<float> table = random_matrix<float>(kV, kD, 21);
  SECTION("LowPrecisionEmbedding") {
    LowPrecisionEmbedding<Storage> layer(table);
    check_contract(layer, embedding_backward_driver, {kV, kD, false, 0});
  }
  SECTION("LowPrecisionOutputProjection with a float bias") {
    LowPrecisionOutputProjection<Storage> layer(table, random_matrix<float>(kV, 1, 22));
    check_contract(layer, head_backward_driver, {kV, kD, true, 1});
  }
  SECTION("LowPrecisionOutputProjection without a bias") {
    LowPrecisionOutputProjection<Storage> layer(table);
    check_contract(layer, head_backward_driver, {kV, kD, false, 0});
  }
}

TEST_CASE("layer contract: the vocabulary-parallel layers on one rank", "[layer_contract][vocab_parallel]") {
  SingleProcessCommunicator comm;
  SECTION("VocabParallelEmbedding") {
    VocabParallelEmbedding<float> layer(kV, kD, comm);
    check_contract(layer, embedding_backward_driver, {kV, kD, false, 1});
  }
  SECTION("VocabParallelOutputProjection, untied") {
    VocabParallelOutputProjection<float> layer(kV, kD, comm);
    check_contract(layer, head_backward_driver, {kV, kD, true, 2});
  }
  SECTION("VocabParallelOutputProjection tied by the embedding constructor") {
    VocabParallelEmbedding<float> embedding(kV, kD, comm);
    VocabParallelOutputProjection<float> layer(embedding);
    CHECK(layer.is_tied_to(embedding));
    check_contract(layer, head_backward_driver, {kV, kD, false, 1});
  }
  SECTION("VocabParallelOutputProjection tied by wrapping the embedding's weight_ptr()") {
    VocabParallelEmbedding<float> embedding(kV, kD, comm);
    VocabParallelOutputProjection<float> layer(kV, embedding.weight_ptr(), nullptr, comm);
    CHECK(layer.is_tied_to(embedding));
    check_contract(layer, head_backward_driver, {kV, kD, false, 1});
  }
}

TEST_CASE("layer contract: QuantizedEmbedding is inference-only and has the read-only part",
          "[layer_contract][quantized]") {
  const QuantizedEmbedding table(random_matrix<float>(kV, kD, 31));
  CHECK(table.vocab_size() == kV);
  CHECK(table.dim() == kD);
  CHECK(table.parameter_count() == kV * kD);  // the table's entries; the V scales are not parameters
}

TEST_CASE("layer contract: both ways of tying are one tied head everywhere", "[layer_contract][tied]") {
  TokenEmbedding<float> embedding(kV, kD);
  TokenEmbedding<float> other(kV, kD);
  OutputProjection<float> by_constructor(embedding);
  OutputProjection<float> by_pointer(embedding.weight_ptr());
  for (const OutputProjection<float>* head : {&by_constructor, &by_pointer}) {
    CHECK(head->is_tied_to(embedding));
    CHECK_FALSE(head->is_tied_to(other));
    CHECK_FALSE(head->has_bias());
    CHECK(head->bias_ptr() == nullptr);
    // One distinct parameter between the two layers: registered once, counted once.
    std::vector<std::shared_ptr<Parameter<float>>> all = embedding.parameters();
    for (const auto& p : head->parameters()) all.push_back(p);
    REQUIRE(all.size() == 2);
    const auto unique = unique_parameters(all);
    REQUIRE(unique.size() == 1);
    CHECK(unique[0] == embedding.weight_ptr());
    CHECK(count_parameters(all) == kV * kD);
    SGD<float> sgd;
    REQUIRE_NOTHROW(sgd.add_group(unique));
    CHECK(sgd.groups().at(0).parameters.size() == 1);
    // Registering both lists as they are is refused the same way for both heads.
    SGD<float> twice;
    twice.add_group(embedding.parameters());
    CHECK_THROWS_WITH(twice.add_group(head->parameters()),
                      Contains("'token_embedding.weight' [7, 4] is registered twice"));
    CHECK(twice.groups().size() == 1);
  }
  // An untied head of the same shape: not tied, to anything.
  OutputProjection<float> untied(kV, kD);
  CHECK_FALSE(untied.is_tied_to(embedding));
  // A head sharing the table but with its own bias shares W (is_tied_to) without the tied shape.
  OutputProjection<float> shared_with_bias(embedding.weight_ptr(),
                                           std::make_shared<Parameter<float>>(kV, 1, "lm_head.bias"));
  CHECK(shared_with_bias.is_tied_to(embedding));
  CHECK(shared_with_bias.has_bias());
}

TEST_CASE("layer contract: a head tied through weight_ptr() stays tied through resize_vocabulary",
          "[layer_contract][tied]") {
  TokenEmbedding<float> embedding(kV, kD);
  OutputProjection<float> head(embedding.weight_ptr());
  const auto result = resize_vocabulary<float>(embedding, &head, kV + 3);
  CHECK(result.rows == kV + 3);
  CHECK(head.is_tied_to(embedding));
  CHECK(head.vocab_size() == kV + 3);
  CHECK(embedding.vocab_size() == kV + 3);
}

TEST_CASE("layer contract: the vocabulary-parallel head tied both ways", "[layer_contract][tied][vocab_parallel]") {
  SingleProcessCommunicator comm;
  VocabParallelEmbedding<float> embedding(kV, kD, comm);
  VocabParallelOutputProjection<float> by_constructor(embedding);
  VocabParallelOutputProjection<float> by_pointer(kV, embedding.weight_ptr(), nullptr, comm);
  for (const VocabParallelOutputProjection<float>* head : {&by_constructor, &by_pointer}) {
    CHECK(head->is_tied_to(embedding));
    std::vector<std::shared_ptr<Parameter<float>>> all = embedding.parameters();
    for (const auto& p : head->parameters()) all.push_back(p);
    CHECK(unique_parameters(all).size() == 1);
  }
  VocabParallelOutputProjection<float> untied(kV, kD, comm);
  CHECK_FALSE(untied.is_tied_to(embedding));
}

TEMPLATE_TEST_CASE("layer contract: a low-precision table is a Parameter<Storage, float>",
                   "[layer_contract][low_precision]", Eigen::bfloat16, Eigen::half) {
  using Storage = TestType;
  const RowMatrix<float> table = random_matrix<float>(kV, kD, 41);
  LowPrecisionEmbedding<Storage> embedding(table);
  // The value is stored in Storage (round to nearest even), the gradient is float.
  static_assert(std::is_same_v<typename std::decay_t<decltype(embedding.weight())>::value_type, Storage>);
  static_assert(std::is_same_v<typename std::decay_t<decltype(embedding.weight())>::grad_type, float>);
  CHECK(first_difference(embedding.weight().value(), RowMatrix<Storage>(table.template cast<Storage>())) == "");
  CHECK(embedding.table().data() == embedding.weight().value().data());
  CHECK(&embedding.grad() == &embedding.weight().grad());

  SECTION("wrapping a shared parameter shares it") {
    LowPrecisionEmbedding<Storage> wrapped(embedding.weight_ptr());
    CHECK(wrapped.weight_ptr() == embedding.weight_ptr());
    wrapped.set_frozen(true);
    CHECK(embedding.frozen());
  }
  SECTION("a null parameter is refused, naming it") {
    REQUIRE_THROWS_AS(LowPrecisionEmbedding<Storage>(std::shared_ptr<Parameter<Storage, float>>()), value_error);
    REQUIRE_THROWS_WITH(LowPrecisionEmbedding<Storage>(std::shared_ptr<Parameter<Storage, float>>()),
                        Contains("LowPrecisionEmbedding: weight is a null shared_ptr<Parameter>"));
  }
  SECTION("a bad padding_idx on a wrapped parameter is refused, the parameter unchanged") {
    TokenEmbeddingOptions bad;
    bad.padding_idx = kV;
    const RowMatrix<Storage> before = embedding.weight().value();
    REQUIRE_THROWS_WITH(LowPrecisionEmbedding<Storage>(embedding.weight_ptr(), bad),
                        Contains("LowPrecisionEmbedding: padding_idx 7 outside [0, 7)"));
    CHECK(first_difference(embedding.weight().value(), before) == "");
    CHECK(embedding.weight_ptr().use_count() == 1);
  }
  SECTION("resize_rows keeps the kept rows bit for bit") {
    const RowMatrix<Storage> before = embedding.weight().value();
    embedding.weight().resize_rows(kV + 2);
    CHECK(embedding.vocab_size() == kV + 2);
    CHECK(first_difference(embedding.weight().value().topRows(kV), before) == "");
    CHECK(embedding.weight().value().bottomRows(2).template cast<float>().isZero(0));
    CHECK(embedding.grad().rows() == kV + 2);
  }
  SECTION("the low-precision head: W in Storage, the bias a float Parameter") {
    LowPrecisionOutputProjection<Storage> head(table, RowMatrix<float>::Constant(kV, 1, 0.5f));
    static_assert(std::is_same_v<std::decay_t<decltype(*head.bias_ptr())>, Parameter<float>>);
    CHECK(head.bias()->value().isConstant(0.5f, 0));
    CHECK(&head.weight_grad() == &head.weight().grad());
    CHECK(&head.bias_grad() == &head.bias()->grad());
    // Only the bias can be registered with an optimizer (W is refused at compile time).
    SGD<float> sgd;
    REQUIRE_NOTHROW(sgd.add_group({head.bias_ptr()}));
  }
}

TEST_CASE("Parameter: constructed from a value matrix", "[layer_contract][parameter]") {
  RowMatrix<float> value(2, 3);
  value << 1, 2, 3, 4, 5, 6;
  const Parameter<float> p(value, "p");
  CHECK(p.name() == "p");
  CHECK(p.rows() == 2);
  CHECK(p.cols() == 3);
  CHECK(p.size() == 6);
  CHECK(first_difference(p.value(), value) == "");
  CHECK(p.grad().rows() == 2);
  CHECK(p.grad().num_touched() == 0);
  REQUIRE_THROWS_AS(Parameter<float>(RowMatrix<float>(0, 3)), value_error);
  REQUIRE_THROWS_WITH(Parameter<float>(RowMatrix<float>(0, 3)), Contains("Parameter: rows = 0 outside [1, inf)"));
  using Bf16Parameter = Parameter<Eigen::bfloat16, float>;
  REQUIRE_THROWS_WITH(Bf16Parameter(RowMatrix<Eigen::bfloat16>(2, 0)),
                      Contains("Parameter: cols = 0 outside [1, inf)"));
}
