// Tests for include/embedhead/fused_head_loss.hpp: the LM head + cross-entropy fused by vocabulary blocks.
//
// Expected values come from three independent places: the unfused path (output_projection_forward,
// cross_entropy_forward_backward, output_projection_backward: the [N, V] logits materialised),
// naive::full_loss (every option from its definition, in double) and central finite differences
// in double. Sizes cover blocks of 1 row, uneven blocks, a block larger than V, several GEMM pieces
// per block (> 256 rows) and several d pieces (d > 128).
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <embedhead/fused_head_loss.hpp>
#include <embedhead/output_projection.hpp>
#include <embedhead/token_embedding.hpp>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "reference/naive.hpp"
#include "reference/test_support.hpp"

namespace {

using Catch::Matchers::Contains;
using Catch::Matchers::WithinAbs;
using Catch::Matchers::WithinRel;
using embedhead::CrossEntropyOptions;
using embedhead::CrossEntropyResult;
using embedhead::FusedHeadLoss;
using embedhead::FusedHeadLossExtras;
using embedhead::FusedHeadLossOptions;
using embedhead::FusedHeadLossWorkspace;
using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::Reduction;
using embedhead::RowMatrix;
using test_support::random_ids;
using test_support::random_matrix;
using test_support::close;
using test_support::same_values;
using test_support::tolerance;

template <typename Scalar>
struct Problem {
  Index N, V, d;
  RowMatrix<Scalar> h, W, bias;
  IdMatrix<std::int64_t> targets;
};

// h and W at scale 1 so logits reach a few units (soft-capping at 2 then matters).
template <typename Scalar>
Problem<Scalar> make_problem(Index B, Index T, Index V, Index d, std::uint64_t seed, Index classes = -1) {
  Problem<Scalar> p{B * T,
                    V,
                    d,
                    random_matrix<Scalar>(B * T, d, seed, 1.0),
                    random_matrix<Scalar>(V, d, seed + 1, 0.5),
                    random_matrix<Scalar>(V, 1, seed + 2, 0.5),
                    random_ids<std::int64_t>(B, T, classes < 0 ? V : classes, seed + 3)};
  return p;
}

struct Outputs {
  CrossEntropyResult result;
  RowMatrix<double> dh, dW, db, losses;
};

// The unfused path: logits [N, V] in full, the plain loss, the head's backward.
template <typename Scalar>
Outputs unfused(const Problem<Scalar>& p, bool with_bias, const CrossEntropyOptions& options) {
  const RowMatrix<Scalar> no_bias(0, 1);
  const RowMatrix<Scalar>& bias = with_bias ? p.bias : no_bias;
  RowMatrix<Scalar> logits(p.N, p.V), dlogits(p.N, p.V), losses(p.N, 1);
  embedhead::output_projection_forward<Scalar>(p.h, p.W, bias, logits);
  Outputs out;
  out.result = embedhead::cross_entropy_forward_backward<Scalar>(logits, p.targets, dlogits, losses, options);
  RowMatrix<Scalar> dh(p.N, p.d), dW = RowMatrix<Scalar>::Zero(p.V, p.d),
                                  db = RowMatrix<Scalar>::Zero(with_bias ? p.V : 0, 1);
  embedhead::output_projection_backward<Scalar>(p.h, p.W, dlogits, dh, dW, db);
  out.dh = dh.template cast<double>();
  out.dW = dW.template cast<double>();
  out.db = db.template cast<double>();
  out.losses = losses.template cast<double>();
  return out;
}

// The optional per-token inputs and outputs as the fused loss takes them (each empty = absent).
template <typename Scalar>
FusedHeadLossExtras<Scalar> extras_of(const RowMatrix<Scalar>& weights, RowMatrix<Scalar>& lse,
                                      RowMatrix<Scalar>& losses) {
  return FusedHeadLossExtras<Scalar>{{weights.data(), weights.rows(), weights.cols()},
                                     {lse.data(), lse.rows(), lse.cols()},
                                     {losses.data(), losses.rows(), losses.cols()}};
}

template <typename Scalar>
Outputs fused(const Problem<Scalar>& p, bool with_bias, const FusedHeadLossOptions& options,
              const RowMatrix<Scalar>& weights, RowMatrix<Scalar>* lse_out = nullptr) {
  const RowMatrix<Scalar> no_bias(0, 1);
  RowMatrix<Scalar> dh(p.N, p.d), dW = RowMatrix<Scalar>::Zero(p.V, p.d),
                                  db = RowMatrix<Scalar>::Zero(with_bias ? p.V : 0, 1);
  RowMatrix<Scalar> lse(p.N, 1), losses(p.N, 1);
  FusedHeadLossWorkspace<Scalar> ws;
  Outputs out;
  out.result = embedhead::fused_head_loss_forward_backward<Scalar>(p.h, p.W, with_bias ? p.bias : no_bias, p.targets,
                                                                   dh, dW, db, ws, options,
                                                                   extras_of(weights, lse, losses));
  out.dh = dh.template cast<double>();
  out.dW = dW.template cast<double>();
  out.db = db.template cast<double>();
  out.losses = losses.template cast<double>();
  if (lse_out) *lse_out = lse;
  return out;
}

struct Variant {
  const char* name;
  FusedHeadLossOptions options;
  Index classes;  // -1: no padding
};

std::vector<Variant> variants(Index V) {
  std::vector<Variant> list;
  auto add = [&](const char* name, auto edit, Index classes = -1) {
    FusedHeadLossOptions o;
    edit(o);
    if (classes > 0) o.valid_vocab = classes;
    list.push_back({name, o, classes});
  };
  add("plain", [](FusedHeadLossOptions&) {});
  add("sum", [](FusedHeadLossOptions& o) { o.reduction = Reduction::sum; });
  add("none", [](FusedHeadLossOptions& o) { o.reduction = Reduction::none; });
  add("label smoothing", [](FusedHeadLossOptions& o) { o.label_smoothing = 0.1; });
  add("z-loss", [](FusedHeadLossOptions& o) { o.z_loss = 1e-2; });
  add("soft-cap", [](FusedHeadLossOptions& o) { o.softcap = 2.0; });
  add("gradient scale", [](FusedHeadLossOptions& o) { o.gradient_scale = 0.25; });
  add("entropy bonus", [](FusedHeadLossOptions& o) { o.entropy_bonus = 0.3; });
  add("class weights", [V](FusedHeadLossOptions& o) { o.class_weights = test_support::class_weights(V); });
  add("class weights, label smoothing", [V](FusedHeadLossOptions& o) {
    o.class_weights = test_support::class_weights(V);
    o.label_smoothing = 0.1;
  });
  add(
      "padded vocabulary", [](FusedHeadLossOptions&) {}, V - 3);
  add(
      "everything",
      [](FusedHeadLossOptions& o) {
        o.label_smoothing = 0.2;
        o.z_loss = 1e-3;
        o.softcap = 3.0;
        o.ignore_index = 1;
        o.entropy_bonus = -0.2;
      },
      V - 5);
  add(
      "everything, class weights",
      [V](FusedHeadLossOptions& o) {
        o.label_smoothing = 0.2;
        o.z_loss = 1e-3;
        o.softcap = 3.0;
        o.entropy_bonus = -0.2;
        o.class_weights = test_support::class_weights(V - 5);
      },
      V - 5);
  return list;
}

// The walks over the logits to test: the two-pass vocabulary blocks, and token chunks of `tokens`
// tokens (memory_budget set to hold exactly that many rows of `classes` logits; 0: automatic, all
// the tokens of these small problems in one chunk).
struct PlanCase {
  const char* name;
  embedhead::FusedPlan plan;
  Index tokens;
};
const std::vector<PlanCase>& plan_cases() {
  static const std::vector<PlanCase> list{{"vocab_blocks", embedhead::FusedPlan::vocab_blocks, 0},
                                          {"token_chunks of 1", embedhead::FusedPlan::token_chunks, 1},
                                          {"token_chunks of 4", embedhead::FusedPlan::token_chunks, 4},
                                          {"automatic", embedhead::FusedPlan::automatic, 0}};
  return list;
}
template <typename Scalar>
FusedHeadLossOptions with_plan(FusedHeadLossOptions options, const PlanCase& plan, Index classes) {
  options.plan = plan.plan;
  options.memory_budget = plan.tokens * classes * static_cast<Index>(sizeof(Scalar));
  return options;
}

}  // namespace

TEMPLATE_TEST_CASE("fused head loss equals the unfused head + loss + head backward", "[fused_head_loss][unfused]",
                   float, double) {
  using Scalar = TestType;
  const Index V = 37, d = 11;
  Problem<Scalar> p = make_problem<Scalar>(3, 7, V, d, 101, V - 5);
  p.targets(0, 2) = -100;  // ignored by the default ignore_index
  p.targets(2, 6) = -100;
  const RowMatrix<Scalar> no_weights(0, 1);
  for (const Variant& variant : variants(V)) {
    for (const PlanCase& plan : plan_cases()) {
      for (Index block : {Index(0), Index(1), Index(8), Index(1000)}) {
        for (bool with_bias : {true, false}) {
          CAPTURE(variant.name, plan.name, block, with_bias);
          FusedHeadLossOptions options = with_plan<Scalar>(variant.options, plan,
                                                           variant.classes > 0 ? variant.classes : V);
          options.vocab_block = block;
          Problem<Scalar> q = p;  // the same two tokens ignored, whatever ignore_index is
          q.targets(0, 2) = q.targets(2, 6) = options.ignore_index;
          const Outputs expected = unfused<Scalar>(q, with_bias, options);
          const Outputs actual = fused<Scalar>(q, with_bias, options, no_weights);
          CHECK(actual.result.count == q.N - 2);
          CHECK(actual.result.count == expected.result.count);
          CHECK(actual.result.weight_sum == expected.result.weight_sum);
          CHECK_THAT(actual.result.loss, WithinRel(expected.result.loss, tolerance<Scalar>()));
          CHECK_THAT(actual.result.sum, WithinRel(expected.result.sum, tolerance<Scalar>()));
          CHECK_THAT(actual.result.z_loss,
                     WithinRel(expected.result.z_loss, 1e-4) || WithinAbs(expected.result.z_loss, 1e-12));
          CHECK(close(actual.dh, expected.dh, tolerance<Scalar>()));
          CHECK(close(actual.dW, expected.dW, tolerance<Scalar>()));
          CHECK(close(actual.db, expected.db, tolerance<Scalar>()));
          CHECK(close(actual.losses, expected.losses, tolerance<Scalar>()));
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("fused head loss spans several vocabulary and width blocks", "[fused_head_loss][blocks]", float,
                   double) {
  using Scalar = TestType;
  // Several vocabulary blocks, each cut into GEMM pieces (the last partial), and d > 2 * 128.
  const Index V = 4200, d = 260;
  Problem<Scalar> p = make_problem<Scalar>(2, 5, V, d, 202, V - 40);
  p.h *= Scalar(0.2);
  p.targets(1, 1) = -100;
  FusedHeadLossOptions options;
  options.valid_vocab = V - 40;
  options.label_smoothing = 0.05;
  options.vocab_block = 1500;  // blocks of 1500, 1500 and 1160 rows, each in pieces of 256
  const Outputs expected = unfused<Scalar>(p, true, options);
  for (const PlanCase& plan : plan_cases()) {
    CAPTURE(plan.name);
    const Outputs actual = fused<Scalar>(p, true, with_plan<Scalar>(options, plan, V - 40), RowMatrix<Scalar>(0, 1));
    CHECK_THAT(actual.result.loss, WithinRel(expected.result.loss, tolerance<Scalar>()));
    CHECK(close(actual.dh, expected.dh, 4 * tolerance<Scalar>()));
    CHECK(close(actual.dW, expected.dW, 4 * tolerance<Scalar>()));
    CHECK(close(actual.db, expected.db, 4 * tolerance<Scalar>()));
    // Padding rows of W receive nothing.
    CHECK(actual.dW.bottomRows(40).cwiseAbs().maxCoeff() == 0.0);
    CHECK(actual.db.bottomRows(40).cwiseAbs().maxCoeff() == 0.0);
  }
}

TEMPLATE_TEST_CASE("fused head loss with per-token weights matches the naive definition",
                   "[fused_head_loss][naive][weights]", float, double) {
  using Scalar = TestType;
  const Index V = 29, d = 9, classes = 26;
  Problem<Scalar> p = make_problem<Scalar>(2, 9, V, d, 303, classes);
  p.targets(1, 3) = -100;
  RowMatrix<Scalar> weights = random_matrix<Scalar>(p.N, 1, 304, 1.0).cwiseAbs();
  weights(4, 0) = 0;  // a zero weight counts in `count` but adds nothing
  for (const PlanCase& plan : plan_cases())
    for (bool mean : {true, false})
      for (bool class_weighted : {false, true}) {
        FusedHeadLossOptions options = with_plan<Scalar>({}, plan, classes);
        options.reduction = mean ? Reduction::mean : Reduction::sum;
        options.label_smoothing = 0.1;
        options.z_loss = 2e-3;
        options.softcap = 2.5;
        options.valid_vocab = classes;
        options.gradient_scale = 0.5;
        options.vocab_block = 5;
        // Class weights: each row counts with its token weight times its target's class weight.
        if (class_weighted) options.class_weights = test_support::class_weights(classes);
        CAPTURE(plan.name, mean, class_weighted);
        RowMatrix<Scalar> lse;
        const Outputs actual = fused<Scalar>(p, true, options, weights, &lse);

        RowMatrix<double> logits = p.h.template cast<double>() * p.W.template cast<double>().transpose();
        logits.rowwise() += p.bias.template cast<double>().col(0).transpose();
        naive::LossOptions reference;
        reference.mean = mean;
        reference.label_smoothing = 0.1;
        reference.z_loss = 2e-3;
        reference.softcap = 2.5;
        reference.classes = classes;
        reference.gradient_scale = 0.5;
        if (class_weighted) reference.class_weights = test_support::class_weights(classes);
        std::vector<double> w(weights.data(), weights.data() + weights.size());
        const naive::LossResult expected = naive::full_loss(logits, p.targets, w, reference);

        CHECK(actual.result.count == expected.count);
        CHECK_THAT(actual.result.weight_sum, WithinRel(expected.weight_sum, 1e-12));
        CHECK_THAT(actual.result.loss, WithinRel(expected.loss, 10 * tolerance<Scalar>()));
        const RowMatrix<double> dh = expected.dlogits * p.W.template cast<double>();
        const RowMatrix<double> dW = expected.dlogits.transpose() * p.h.template cast<double>();
        const RowMatrix<double> db = expected.dlogits.colwise().sum().transpose();
        CHECK(close(actual.dh, dh, 10 * tolerance<Scalar>()));
        CHECK(close(actual.dW, dW, 10 * tolerance<Scalar>()));
        CHECK(close(actual.db, db, 10 * tolerance<Scalar>()));
        for (Index n = 0; n < p.N; ++n) {
          CAPTURE(n);
          CHECK_THAT(static_cast<double>(lse(n, 0)), WithinAbs(expected.lse[n], 10 * tolerance<Scalar>()));
          CHECK_THAT(actual.losses(n, 0), WithinAbs(expected.losses[n], 10 * tolerance<Scalar>()));
        }
        CHECK(lse(1 * 9 + 3, 0) == Scalar(0));  // the ignored token
        CHECK(actual.dh.row(1 * 9 + 3).cwiseAbs().maxCoeff() == 0.0);
      }
}

TEMPLATE_TEST_CASE("fused head loss per-row entropy output matches the naive definition",
                   "[fused_head_loss][naive][entropy]", float, double) {
  using Scalar = TestType;
  const Index V = 31, d = 7, classes = 27;
  Problem<Scalar> p = make_problem<Scalar>(2, 6, V, d, 313, classes);
  p.targets(1, 2) = -100;
  for (const PlanCase& plan : plan_cases()) {
    CAPTURE(plan.name);
    FusedHeadLossOptions options = with_plan<Scalar>({}, plan, classes);
    options.valid_vocab = classes;
    options.softcap = 2.5;
    options.vocab_block = 6;
    // Without options.entropy: asking for the output is enough.
    RowMatrix<Scalar> entropy = RowMatrix<Scalar>::Constant(p.N, 1, Scalar(9));
    const FusedHeadLossExtras<Scalar> extras{{nullptr, 0, 1},
                                             {nullptr, 0, 1},
                                             {nullptr, 0, 1},
                                             {entropy.data(), p.N, 1}};
    FusedHeadLossWorkspace<Scalar> ws;
    const auto with_output = embedhead::fused_head_loss<Scalar>(p.h, p.W, p.bias, p.targets, ws, options, extras);
    const auto without = embedhead::fused_head_loss<Scalar>(p.h, p.W, p.bias, p.targets, ws, options);
    CHECK(with_output.loss == without.loss);  // the statistic E does not change S's bits

    RowMatrix<double> logits = p.h.template cast<double>() * p.W.template cast<double>().transpose();
    logits.rowwise() += p.bias.template cast<double>().col(0).transpose();
    naive::LossOptions reference;
    reference.softcap = 2.5;
    reference.classes = classes;
    const naive::LossResult expected = naive::full_loss(logits, p.targets, {}, reference);
    CHECK_THAT(with_output.entropy, WithinRel(expected.entropy, 10 * tolerance<Scalar>()));
    for (Index n = 0; n < p.N; ++n) {
      CAPTURE(n);
      CHECK_THAT(static_cast<double>(entropy(n, 0)), WithinAbs(expected.entropies[n], 10 * tolerance<Scalar>()));
    }
    CHECK(entropy(1 * 6 + 2, 0) == Scalar(0));  // the ignored token
    // The wrong shape: shape_error, nothing written.
    RowMatrix<Scalar> wrong = RowMatrix<Scalar>::Constant(p.N + 1, 1, Scalar(9));
    const FusedHeadLossExtras<Scalar> bad{{nullptr, 0, 1},
                                          {nullptr, 0, 1},
                                          {nullptr, 0, 1},
                                          {wrong.data(), p.N + 1, 1}};
    CHECK_THROWS_MATCHES(embedhead::fused_head_loss<Scalar>(p.h, p.W, p.bias, p.targets, ws, options, bad),
                         embedhead::shape_error,
                         Catch::Message("fused_head_loss: entropy has shape [" + std::to_string(p.N + 1) +
                                        ", 1], expected [" + std::to_string(p.N) + ", 1]"));
    CHECK((wrong.array() == Scalar(9)).all());
  }
}

TEST_CASE("fused head loss gradient check in double, every option on", "[fused_head_loss][gradient]") {
  const Index V = 13, d = 5, classes = 11;
  Problem<double> p = make_problem<double>(2, 3, V, d, 404, classes);
  p.targets(0, 1) = 7;
  p.targets(1, 2) = 7;  // a repeated target
  p.targets(1, 0) = -1;
  RowMatrix<double> weights = random_matrix<double>(p.N, 1, 405, 1.0).cwiseAbs();
  FusedHeadLossOptions options;
  options.ignore_index = -1;
  options.label_smoothing = 0.15;
  options.z_loss = 0.01;
  options.softcap = 1.5;
  options.valid_vocab = classes;
  options.vocab_block = 4;
  // With the entropy bonus (or class weights, whose losses are larger) the loss is smooth enough
  // for a step of 1e-4, whose differences are
  // exact to about 1e-8 relative; the step of 1e-6 leaves their rounding (1e-16 |loss| / 1e-6,
  // about 1e-10) at 2e-6 of dW's entries near 1e-4.
  for (const double bonus : {0.0, 0.35})
    for (const bool class_weighted : {false, true})
      for (const PlanCase& plan : plan_cases()) {
        CAPTURE(plan.name, bonus, class_weighted);
        options.entropy_bonus = bonus;
        options.class_weights = class_weighted ? test_support::class_weights(classes) : std::vector<double>{};
        const double step = bonus != 0 || class_weighted ? 1e-4 : 1e-6;  // class weights: larger losses
        const FusedHeadLossOptions planned = with_plan<double>(options, plan, classes);
        const Outputs analytic = fused<double>(p, true, planned, weights);
        auto loss = [&] {
          FusedHeadLossWorkspace<double> ws;
          RowMatrix<double> lse(0, 1), losses(0, 1);
          return embedhead::fused_head_loss<double>(p.h, p.W, p.bias, p.targets, ws, planned,
                                                    extras_of(weights, lse, losses))
              .loss;
        };
        CHECK(naive::max_relative_error(analytic.dh, naive::numerical_gradient(p.h, loss, step), 1e-6) < 1e-6);
        CHECK(naive::max_relative_error(analytic.dW, naive::numerical_gradient(p.W, loss, step), 1e-6) < 1e-6);
        CHECK(naive::max_relative_error(analytic.db, naive::numerical_gradient(p.bias, loss, step), 1e-6) < 1e-6);
        // Padding rows of W are not classes: the loss does not depend on them.
        CHECK(analytic.dW.bottomRows(V - classes).cwiseAbs().maxCoeff() == 0.0);
      }
}

TEMPLATE_TEST_CASE("fused_head_loss (no gradient) gives the same loss and writes no gradient",
                   "[fused_head_loss][forward]", float, double) {
  using Scalar = TestType;
  Problem<Scalar> p = make_problem<Scalar>(3, 4, 23, 6, 505);
  FusedHeadLossOptions options;
  options.softcap = 2.0;
  options.z_loss = 1e-3;
  options.vocab_block = 5;
  const RowMatrix<Scalar> no(0, 1);
  for (const PlanCase& plan : plan_cases()) {
    CAPTURE(plan.name);
    const FusedHeadLossOptions planned = with_plan<Scalar>(options, plan, 23);
    const Outputs with_gradient = fused<Scalar>(p, true, planned, no);
    FusedHeadLossWorkspace<Scalar> ws;
    RowMatrix<Scalar> lse(0, 1), losses(p.N, 1);
    const CrossEntropyResult r = embedhead::fused_head_loss<Scalar>(p.h, p.W, p.bias, p.targets, ws, planned,
                                                                    extras_of(no, lse, losses));
    // The loss is forward_backward's walk without the backward: bit-identical.
    CHECK(r.loss == with_gradient.result.loss);
    CHECK(same_values(RowMatrix<double>(losses.template cast<double>()), with_gradient.losses));
  }
}

TEMPLATE_TEST_CASE("fused head loss: the automatic plan is token chunks when the budget holds enough tokens",
                   "[fused_head_loss][plan]", float, double) {
  using Scalar = TestType;
  const Index V = 19, d = 6;
  Problem<Scalar> p = make_problem<Scalar>(3, 50, V, d, 515);  // 150 tokens
  const RowMatrix<Scalar> no(0, 1);
  const Index row = V * static_cast<Index>(sizeof(Scalar));
  auto with = [&](embedhead::FusedPlan plan, Index rows) {
    FusedHeadLossOptions o;
    o.vocab_block = 4;
    o.plan = plan;
    o.memory_budget = rows * row;
    return o;
  };
  auto same = [](const Outputs& a, const Outputs& b) {
    return a.result.loss == b.result.loss && same_values(a.dh, b.dh) && same_values(a.dW, b.dW) &&
           same_values(a.db, b.db);
  };
  using embedhead::FusedPlan;
  // 127 rows hold fewer than min(150, 128) tokens: the two passes; 128 rows: two chunks, of equal
  // length (75 and 75, not 128 and 22).
  CHECK(embedhead::detail::fused_token_chunk(with(FusedPlan::automatic, 127), 150, V, sizeof(Scalar)) == 0);
  CHECK(embedhead::detail::fused_token_chunk(with(FusedPlan::automatic, 128), 150, V, sizeof(Scalar)) == 75);
  CHECK(embedhead::detail::fused_token_chunk(with(FusedPlan::token_chunks, 40), 150, V, sizeof(Scalar)) == 38);
  // From 256 tokens a chunk is a multiple of 256 (the packed kernel's summation block); all the
  // tokens when they fit.
  CHECK(embedhead::detail::fused_token_chunk(with(FusedPlan::automatic, 300), 1000, V, sizeof(Scalar)) == 256);
  CHECK(embedhead::detail::fused_token_chunk(with(FusedPlan::automatic, 999), 1000, V, sizeof(Scalar)) == 768);
  CHECK(embedhead::detail::fused_token_chunk(with(FusedPlan::automatic, 1000), 1000, V, sizeof(Scalar)) == 1000);
  // A budget below one row: automatic takes the two passes even for a single token.
  FusedHeadLossOptions tiny = with(FusedPlan::automatic, 1);
  tiny.memory_budget = row - 1;
  CHECK(embedhead::detail::fused_token_chunk(tiny, 1, V, sizeof(Scalar)) == 0);
  CHECK(same(fused<Scalar>(p, true, with(FusedPlan::automatic, 127), no),
             fused<Scalar>(p, true, with(FusedPlan::vocab_blocks, 127), no)));
  CHECK(same(fused<Scalar>(p, true, with(FusedPlan::automatic, 128), no),
             fused<Scalar>(p, true, with(FusedPlan::token_chunks, 128), no)));
  // Fewer tokens than 128, all within the budget: one chunk of all of them.
  Problem<Scalar> small = make_problem<Scalar>(2, 30, V, d, 516);
  CHECK(embedhead::detail::fused_token_chunk(with(FusedPlan::automatic, 60), 60, V, sizeof(Scalar)) == 60);
  CHECK(embedhead::detail::fused_token_chunk(with(FusedPlan::automatic, 59), 60, V, sizeof(Scalar)) == 0);
  CHECK(same(fused<Scalar>(small, true, with(FusedPlan::automatic, 60), no),
             fused<Scalar>(small, true, with(FusedPlan::token_chunks, 60), no)));
}

TEMPLATE_TEST_CASE("FusedHeadLoss layer: tied and untied, equal to the unfused layers",
                   "[fused_head_loss][layer][tied]", float, double) {
  using Scalar = TestType;
  const Index V = 31, d = 8;
  const IdMatrix<std::int32_t> ids = random_ids<std::int32_t>(2, 6, V, 606);
  IdMatrix<std::int32_t> targets = random_ids<std::int32_t>(2, 6, V, 607);
  targets(0, 5) = -100;
  const RowMatrix<Scalar> upstream = random_matrix<Scalar>(12, d, 608);  // stand-in for the layers between
  FusedHeadLossOptions options;
  options.label_smoothing = 0.1;
  options.vocab_block = 5;

  for (bool tied : {true, false}) {
    CAPTURE(tied);
    auto build = [&](embedhead::TokenEmbedding<Scalar>& emb) {
      return tied ? embedhead::OutputProjection<Scalar>(emb) : embedhead::OutputProjection<Scalar>(V, d);
    };
    // Unfused: embedding forward, h = x + upstream, head forward, loss, head backward, embedding backward.
    embedhead::TokenEmbedding<Scalar> emb_a(V, d);
    auto head_a = build(emb_a);
    const RowMatrix<Scalar> h = emb_a.forward(ids) + upstream;
    const RowMatrix<Scalar> logits = head_a.forward(h);
    RowMatrix<Scalar> dlogits(12, V);
    const auto expected = embedhead::cross_entropy_forward_backward<Scalar>(logits, targets, dlogits, options);
    const RowMatrix<Scalar> dh_a = head_a.backward(h, dlogits);
    emb_a.backward(ids, dh_a);

    // Fused.
    embedhead::TokenEmbedding<Scalar> emb_b(V, d);
    auto head_b = build(emb_b);
    FusedHeadLoss<Scalar> loss(options);
    RowMatrix<Scalar> dh_b(12, d);
    const auto actual = loss.forward_backward(head_b, h, targets, dh_b);
    emb_b.backward(ids, dh_b);

    CHECK_THAT(actual.loss, WithinRel(expected.loss, tolerance<Scalar>()));
    CHECK(close(dh_b, dh_a, tolerance<Scalar>()));
    CHECK(close(emb_b.weight().grad().to_dense(), emb_a.weight().grad().to_dense(), tolerance<Scalar>()));
    CHECK(close(head_b.weight().grad().to_dense(), head_a.weight().grad().to_dense(), tolerance<Scalar>()));
    if (!tied) CHECK(close(head_b.bias()->grad().to_dense(), head_a.bias()->grad().to_dense(), tolerance<Scalar>()));
    // Tied: one matrix, one gradient.
    CHECK((&head_b.weight() == &emb_b.weight()) == tied);

    // forward() evaluates without touching any gradient.
    embedhead::TokenEmbedding<Scalar> emb_c(V, d);
    auto head_c = build(emb_c);
    const auto evaluated = loss.forward(head_c, h, targets);
    CHECK(evaluated.loss == actual.loss);
    CHECK(head_c.weight().grad().num_touched() == 0);
    CHECK(!head_c.weight().grad().is_dense());
  }
}

TEMPLATE_TEST_CASE("fused head loss edge cases", "[fused_head_loss][edge]", float, double) {
  using Scalar = TestType;
  const RowMatrix<Scalar> no(0, 1);
  SECTION("V = 1, d = 1: the loss is 0 and so is every gradient") {
    Problem<Scalar> p = make_problem<Scalar>(1, 3, 1, 1, 707);
    const Outputs out = fused<Scalar>(p, true, FusedHeadLossOptions{}, no);
    CHECK(out.result.loss == 0.0);
    CHECK(out.dh.cwiseAbs().maxCoeff() == 0.0);
    CHECK(out.dW.cwiseAbs().maxCoeff() == 0.0);
  }
  SECTION("every token ignored: loss 0, count 0, dh zero, dW unchanged") {
    Problem<Scalar> p = make_problem<Scalar>(2, 2, 5, 3, 708);
    p.targets.setConstant(-100);
    const Outputs out = fused<Scalar>(p, true, FusedHeadLossOptions{}, no);
    CHECK(out.result.loss == 0.0);
    CHECK(out.result.count == 0);
    CHECK(out.dh.cwiseAbs().maxCoeff() == 0.0);
    CHECK(out.dW.cwiseAbs().maxCoeff() == 0.0);
  }
  SECTION("N = 0") {
    Problem<Scalar> p = make_problem<Scalar>(0, 4, 5, 3, 709);
    const Outputs out = fused<Scalar>(p, false, FusedHeadLossOptions{}, no);
    CHECK(out.result.count == 0);
    CHECK(out.result.loss == 0.0);
  }
  SECTION("dh may be h itself") {
    Problem<Scalar> p = make_problem<Scalar>(2, 5, 17, 4, 710);
    FusedHeadLossOptions options;
    options.vocab_block = 3;
    const Outputs expected = fused<Scalar>(p, true, options, no);
    RowMatrix<Scalar> h = p.h, dW = RowMatrix<Scalar>::Zero(17, 4), db = RowMatrix<Scalar>::Zero(17, 1), none(0, 1);
    FusedHeadLossWorkspace<Scalar> ws;
    embedhead::fused_head_loss_forward_backward<Scalar>(h, p.W, p.bias, p.targets, h, dW, db, ws, options);
    CHECK(same_values(RowMatrix<double>(h.template cast<double>()), expected.dh));
  }
}

TEMPLATE_TEST_CASE("fused head loss rejects bad input and writes nothing", "[fused_head_loss][errors]", float, double) {
  using Scalar = TestType;
  const Index V = 7, d = 3, N = 4;
  Problem<Scalar> p = make_problem<Scalar>(1, N, V, d, 808);
  RowMatrix<Scalar> dh = RowMatrix<Scalar>::Constant(N, d, 5), dW = RowMatrix<Scalar>::Constant(V, d, 6),
                    db = RowMatrix<Scalar>::Constant(V, 1, 7), lse = RowMatrix<Scalar>::Constant(N, 1, 8),
                    losses = RowMatrix<Scalar>::Constant(N, 1, 9), weights = RowMatrix<Scalar>::Ones(N, 1);
  const RowMatrix<Scalar> dh0 = dh, dW0 = dW, db0 = db, lse0 = lse, losses0 = losses;
  FusedHeadLossWorkspace<Scalar> ws;
  auto call = [&](const RowMatrix<Scalar>& h, const RowMatrix<Scalar>& W, const RowMatrix<Scalar>& bias,
                  const IdMatrix<std::int64_t>& targets, const RowMatrix<Scalar>& w, RowMatrix<Scalar>& dh_,
                  RowMatrix<Scalar>& dW_, RowMatrix<Scalar>& db_, RowMatrix<Scalar>& lse_, RowMatrix<Scalar>& losses_,
                  const FusedHeadLossOptions& o) {
    embedhead::fused_head_loss_forward_backward<Scalar>(h, W, bias, targets, dh_, dW_, db_, ws, o,
                                                        extras_of(w, lse_, losses_));
  };
  auto unchanged = [&] {
    CHECK(same_values(dh, dh0));
    CHECK(same_values(dW, dW0));
    CHECK(same_values(db, db0));
    CHECK(same_values(lse, lse0));
    CHECK(same_values(losses, losses0));
  };
  const FusedHeadLossOptions ok;
  SECTION("shapes") {
    RowMatrix<Scalar> bad_h(N, d + 1), bad_bias(V + 1, 1), bad_w(N + 1, 1), bad_dh(N, d + 1), bad_dW(V, d + 1),
        bad_db(V - 1, 1), bad_lse(N + 2, 1), bad_losses(N, 2);
    CHECK_THROWS_WITH(call(bad_h, p.W, p.bias, p.targets, weights, dh, dW, db, lse, losses, ok),
                      Contains("fused_head_loss_forward_backward: h has shape [4, 4], expected [4, 3]"));
    CHECK_THROWS_WITH(call(p.h, p.W, bad_bias, p.targets, weights, dh, dW, db, lse, losses, ok),
                      Contains("bias has shape [8, 1], expected [7, 1]"));
    CHECK_THROWS_WITH(call(p.h, p.W, p.bias, p.targets, bad_w, dh, dW, db, lse, losses, ok),
                      Contains("weights has shape [5, 1], expected [4, 1]"));
    CHECK_THROWS_WITH(call(p.h, p.W, p.bias, p.targets, weights, bad_dh, dW, db, lse, losses, ok),
                      Contains("dh has shape [4, 4], expected [4, 3]"));
    CHECK_THROWS_WITH(call(p.h, p.W, p.bias, p.targets, weights, dh, bad_dW, db, lse, losses, ok),
                      Contains("dW has shape [7, 4], expected [7, 3]"));
    CHECK_THROWS_WITH(call(p.h, p.W, p.bias, p.targets, weights, dh, dW, bad_db, lse, losses, ok),
                      Contains("db has shape [6, 1], expected [7, 1]"));
    CHECK_THROWS_WITH(call(p.h, p.W, p.bias, p.targets, weights, dh, dW, db, bad_lse, losses, ok),
                      Contains("lse has shape [6, 1], expected [4, 1]"));
    CHECK_THROWS_WITH(call(p.h, p.W, p.bias, p.targets, weights, dh, dW, db, lse, bad_losses, ok),
                      Contains("losses has shape [4, 2], expected [4, 1]"));
    IdMatrix<std::int64_t> short_targets(1, N - 1);
    short_targets.setZero();
    CHECK_THROWS_WITH(call(p.h, p.W, p.bias, short_targets, weights, dh, dW, db, lse, losses, ok),
                      Contains("targets has 3 entries, expected N = 4"));
    unchanged();
  }
  SECTION("targets") {
    IdMatrix<std::int64_t> t(1, N);
    t << 0, 4, 1, 2;
    t(0, 2) = V;
    CHECK_THROWS_AS(call(p.h, p.W, p.bias, t, weights, dh, dW, db, lse, losses, ok), embedhead::index_error);
    CHECK_THROWS_WITH(call(p.h, p.W, p.bias, t, weights, dh, dW, db, lse, losses, ok),
                      Contains("target 7 at n=2 (b=0, t=2) outside [0, 7) and not ignore_index (-100)"));
    t(0, 2) = -3;
    CHECK_THROWS_WITH(call(p.h, p.W, p.bias, t, weights, dh, dW, db, lse, losses, ok), Contains("target -3 at n=2"));
    FusedHeadLossOptions padded;
    padded.valid_vocab = 5;
    t(0, 2) = 6;
    CHECK_THROWS_WITH(call(p.h, p.W, p.bias, t, weights, dh, dW, db, lse, losses, padded),
                      Contains(
                          "target 6 at n=2 (b=0, t=2) outside [0, 5) and not ignore_index (-100); columns [5, 7) are "
                          "vocabulary padding"));
    unchanged();
  }
  SECTION("weights") {
    RowMatrix<Scalar> w = weights;
    w(3, 0) = Scalar(-0.5);
    CHECK_THROWS_AS(call(p.h, p.W, p.bias, p.targets, w, dh, dW, db, lse, losses, ok), embedhead::value_error);
    CHECK_THROWS_WITH(call(p.h, p.W, p.bias, p.targets, w, dh, dW, db, lse, losses, ok),
                      Contains("weight -0.5 at n=3 outside [0, inf)"));
    w(3, 0) = std::numeric_limits<Scalar>::quiet_NaN();
    CHECK_THROWS_WITH(call(p.h, p.W, p.bias, p.targets, w, dh, dW, db, lse, losses, ok), Contains("weight nan at n=3"));
    unchanged();
  }
  SECTION("options") {
    auto with = [&](auto edit) {
      FusedHeadLossOptions o;
      edit(o);
      return o;
    };
    const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
    CHECK_THROWS_WITH(call(p.h, p.W, p.bias, p.targets, weights, dh, dW, db, lse, losses,
                           with([](FusedHeadLossOptions& o) { o.label_smoothing = 1.5; })),
                      Contains("label_smoothing = 1.5 outside [0, 1]"));
    CHECK_THROWS_WITH(call(p.h, p.W, p.bias, p.targets, weights, dh, dW, db, lse, losses,
                           with([&](FusedHeadLossOptions& o) { o.label_smoothing = nan; })),
                      Contains("label_smoothing = nan outside [0, 1]"));
    CHECK_THROWS_WITH(call(p.h, p.W, p.bias, p.targets, weights, dh, dW, db, lse, losses,
                           with([](FusedHeadLossOptions& o) { o.z_loss = -1e-4; })),
                      Contains("z_loss = -0.0001 outside [0, inf)"));
    CHECK_THROWS_WITH(call(p.h, p.W, p.bias, p.targets, weights, dh, dW, db, lse, losses,
                           with([&](FusedHeadLossOptions& o) { o.softcap = inf; })),
                      Contains("softcap = inf outside [0, inf) (0: off)"));
    CHECK_THROWS_WITH(call(p.h, p.W, p.bias, p.targets, weights, dh, dW, db, lse, losses,
                           with([](FusedHeadLossOptions& o) { o.valid_vocab = 8; })),
                      Contains("valid_vocab = 8 outside [1, 7] (or -1 for all V = 7 columns)"));
    CHECK_THROWS_WITH(call(p.h, p.W, p.bias, p.targets, weights, dh, dW, db, lse, losses,
                           with([](FusedHeadLossOptions& o) { o.valid_vocab = 0; })),
                      Contains("valid_vocab = 0 outside [1, 7]"));
    CHECK_THROWS_WITH(call(p.h, p.W, p.bias, p.targets, weights, dh, dW, db, lse, losses,
                           with([&](FusedHeadLossOptions& o) { o.gradient_scale = inf; })),
                      Contains("gradient_scale = inf outside the finite numbers"));
    CHECK_THROWS_WITH(call(p.h, p.W, p.bias, p.targets, weights, dh, dW, db, lse, losses,
                           with([](FusedHeadLossOptions& o) { o.vocab_block = -2; })),
                      Contains("vocab_block = -2 outside [0, inf) (0: automatic)"));
    CHECK_THROWS_WITH(call(p.h, p.W, p.bias, p.targets, weights, dh, dW, db, lse, losses,
                           with([](FusedHeadLossOptions& o) { o.memory_budget = -1; })),
                      Contains("memory_budget = -1 outside [0, inf) (0: 67108864 bytes)"));
    // token_chunks must hold one token's logits: V = 7 scalars (5 with valid_vocab = 5).
    const Index row = 7 * static_cast<Index>(sizeof(Scalar));
    CHECK_THROWS_WITH(call(p.h, p.W, p.bias, p.targets, weights, dh, dW, db, lse, losses,
                           with([&](FusedHeadLossOptions& o) {
                             o.plan = embedhead::FusedPlan::token_chunks;
                             o.memory_budget = row - 1;
                           })),
                      Contains("memory_budget = " + std::to_string(row - 1) + " bytes outside [" + std::to_string(row) +
                               ", inf) for plan token_chunks: one token's logits are " + std::to_string(row) +
                               " bytes"));
    CHECK_THROWS_WITH(
        call(p.h, p.W, p.bias, p.targets, weights, dh, dW, db, lse, losses, with([&](FusedHeadLossOptions& o) {
               o.plan = embedhead::FusedPlan::token_chunks;
               o.valid_vocab = 5;
               o.memory_budget = 5 * static_cast<Index>(sizeof(Scalar)) - 1;
             })),
        Contains("for plan token_chunks: one token's logits are " + std::to_string(5 * sizeof(Scalar)) + " bytes"));
    CHECK_THROWS_AS(call(p.h, p.W, p.bias, p.targets, weights, dh, dW, db, lse, losses,
                         with([](FusedHeadLossOptions& o) { o.z_loss = -1; })),
                    embedhead::value_error);
    // Checked in the Scalar the pass computes in: 0 there, the soft-cap divides by zero.
    if constexpr (std::is_same_v<Scalar, float>)
      CHECK_THROWS_WITH(call(p.h, p.W, p.bias, p.targets, weights, dh, dW, db, lse, losses,
                             with([](FusedHeadLossOptions& o) { o.softcap = 1e-50; })),
                        Contains("fused_head_loss_forward_backward: softcap = 1e-50 outside [0, inf) (0: off) in "
                                 "float: it rounds to 0"));
    unchanged();
  }
}

TEMPLATE_TEST_CASE("FusedHeadLoss layer leaves the gradients untouched when it throws",
                   "[fused_head_loss][layer][errors]", float, double) {
  using Scalar = TestType;
  embedhead::TokenEmbedding<Scalar> emb(9, 4);
  embedhead::OutputProjection<Scalar> head(emb);
  const IdMatrix<std::int32_t> ids = random_ids<std::int32_t>(1, 3, 9, 901);
  emb.backward(ids, RowMatrix<Scalar>::Ones(3, 4));  // a sparse gradient with a few rows
  const Index touched = emb.weight().grad().num_touched();
  const RowMatrix<Scalar> before = emb.weight().grad().to_dense();
  FusedHeadLoss<Scalar> loss;
  RowMatrix<Scalar> h = random_matrix<Scalar>(3, 4, 902), dh = RowMatrix<Scalar>::Constant(3, 4, 3);
  IdMatrix<std::int32_t> targets(1, 3);
  targets << 1, 9, 2;
  CHECK_THROWS_WITH(loss.forward_backward(head, h, targets, dh),
                    Contains("FusedHeadLoss::forward_backward: target 9 at n=1 (b=0, t=1) outside [0, 9)"));
  RowMatrix<Scalar> bad_dh(3, 5);
  targets(0, 1) = 0;
  CHECK_THROWS_WITH(loss.forward_backward(head, h, targets, bad_dh), Contains("dh has shape [3, 5], expected [3, 4]"));
  RowMatrix<Scalar> bad_weights = RowMatrix<Scalar>::Ones(3, 1);
  bad_weights(2, 0) = Scalar(-1);
  const FusedHeadLossExtras<Scalar> extras{Eigen::Map<const RowMatrix<Scalar>>(bad_weights.data(), 3, 1)};
  CHECK_THROWS_WITH(loss.forward_backward(head, h, targets, dh, extras), Contains("weight -1 at n=2 outside [0, inf)"));
  // Still sparse, same rows, same values; dh untouched.
  CHECK(emb.weight().grad().num_touched() == touched);
  CHECK(!emb.weight().grad().is_dense());
  CHECK(same_values(emb.weight().grad().to_dense(), before));
  CHECK(same_values(dh, RowMatrix<Scalar>::Constant(3, 4, 3)));
}

TEMPLATE_TEST_CASE("FusedHeadLoss layer: every check before a gradient turns dense, options and a stale bias too",
                   "[fused_head_loss][layer][errors]", float, double) {
  using Scalar = TestType;
  // A head wrapping the embedding's table with a bias of its own, the table with sparse rows.
  embedhead::TokenEmbedding<Scalar> emb(9, 4);
  auto bias = std::make_shared<embedhead::Parameter<Scalar>>(random_matrix<Scalar>(9, 1, 911), "lm_head.bias");
  embedhead::OutputProjection<Scalar> head(emb.weight_ptr(), bias);
  emb.backward(random_ids<std::int32_t>(1, 3, 9, 912), RowMatrix<Scalar>::Ones(3, 4));
  const RowMatrix<Scalar> h = random_matrix<Scalar>(3, 4, 913);
  RowMatrix<Scalar> dh = RowMatrix<Scalar>::Constant(3, 4, 3);
  IdMatrix<std::int32_t> targets(1, 3);
  targets << 1, 0, 2;
  auto unchanged = [&](const std::vector<Index>& touched, const RowMatrix<Scalar>& before) {
    CHECK(emb.weight().grad().touched_rows() == touched);
    CHECK_FALSE(emb.weight().grad().is_dense());
    CHECK(same_values(emb.weight().grad().to_dense(), before));
    CHECK_FALSE(bias->grad().is_dense());
    CHECK(bias->grad().num_touched() == 0);
    CHECK(same_values(dh, RowMatrix<Scalar>::Constant(3, 4, 3)));
  };
  std::vector<Index> touched = emb.weight().grad().touched_rows();
  RowMatrix<Scalar> before = emb.weight().grad().to_dense();
  for (const auto& [edit, message] : std::vector<std::pair<void (*)(FusedHeadLossOptions&), std::string>>{
           {[](FusedHeadLossOptions& o) { o.vocab_block = -1; }, "vocab_block = -1 outside [0, inf)"},
           {[](FusedHeadLossOptions& o) { o.memory_budget = -1; }, "memory_budget = -1 outside [0, inf)"},
           {[](FusedHeadLossOptions& o) { o.z_loss = -1; }, "z_loss = -1 outside [0, inf)"}}) {
    FusedHeadLossOptions options;
    edit(options);
    FusedHeadLoss<Scalar> loss(options);
    CHECK_THROWS_WITH(loss.forward_backward(head, h, targets, dh),
                      Contains("FusedHeadLoss::forward_backward: " + message));
    unchanged(touched, before);
  }
  {
    // A bias with trainable rows (db is a dense [V, 1]): refused before W's gradient turns dense, in both calls that
    // take a gradient; the loss alone is fine.
    bias->set_trainable_rows({0, 4});
    FusedHeadLoss<Scalar> loss;
    const std::string message =
        "the head's bias has 2 trainable rows of 9 (Parameter::set_trainable_rows), not "
        "supported: the pass adds a dense db [9, 1]";
    CHECK_THROWS_AS(loss.forward_backward(head, h, targets, dh), embedhead::value_error);
    CHECK_THROWS_WITH(loss.forward_backward(head, h, targets, dh),
                      Contains("FusedHeadLoss::forward_backward: " + message));
    unchanged(touched, before);
    RowMatrix<Scalar> soft = RowMatrix<Scalar>::Constant(3, 9, Scalar(1) / Scalar(9));
    CHECK_THROWS_WITH(loss.forward_backward_soft(head, h, soft, dh),
                      Contains("FusedHeadLoss::forward_backward_soft: " + message));
    unchanged(touched, before);
    CHECK_NOTHROW(loss.forward(head, h, targets));
    unchanged(touched, before);
    bias->set_all_rows_trainable();
  }
  // The table resized (as resize_vocabulary given the embedding alone does), the bias not.
  emb.weight().resize_rows(11);
  touched = emb.weight().grad().touched_rows();
  before = emb.weight().grad().to_dense();
  FusedHeadLoss<Scalar> loss;
  CHECK_THROWS_AS(loss.forward_backward(head, h, targets, dh), embedhead::shape_error);
  CHECK_THROWS_WITH(loss.forward_backward(head, h, targets, dh),
                    Contains("FusedHeadLoss::forward_backward: bias has shape [9, 1], expected [11, 1]"));
  unchanged(touched, before);
}

TEMPLATE_TEST_CASE("FusedHeadLoss layer with a frozen W or bias: same loss and dh, no frozen gradient",
                   "[fused_head_loss][layer][freeze]", float, double) {
  using Scalar = TestType;
  const Index N = 9, V = 300, d = 6;
  IdMatrix<std::int32_t> targets = random_ids<std::int32_t>(1, N, V, 700);
  targets(0, 4) = -100;
  const RowMatrix<Scalar> h = random_matrix<Scalar>(N, d, 701);
  FusedHeadLossOptions options;
  options.vocab_block = 128;
  // Both plans: blocks of 128 rows (one GEMM piece each), token chunks of 3 tokens over V (one piece).
  options.plan = GENERATE(embedhead::FusedPlan::vocab_blocks, embedhead::FusedPlan::token_chunks);
  options.memory_budget = 3 * V * static_cast<Index>(sizeof(Scalar));
  embedhead::OutputProjection<Scalar> reference(V, d), head(V, d);  // same default seed: same W
  reference.bias()->value() = random_matrix<Scalar>(V, 1, 702);
  head.bias()->value() = reference.bias()->value();
  FusedHeadLoss<Scalar> loss(options);
  RowMatrix<Scalar> dh_expected(N, d), dh(N, d);
  const auto expected = loss.forward_backward(reference, h, targets, dh_expected);

  SECTION("frozen W: the dW GEMMs are skipped; loss, dh and db bit-identical") {
    head.weight().set_frozen(true);
    const auto actual = loss.forward_backward(head, h, targets, dh);
    CHECK(actual.loss == expected.loss);
    CHECK(same_values(dh, dh_expected));
    CHECK(head.weight().grad().num_touched() == 0);
    CHECK_FALSE(head.weight().grad().is_dense());
    CHECK(same_values(head.bias()->grad().to_dense(), reference.bias()->grad().to_dense()));
  }
  SECTION("frozen bias: dW bit-identical, no db") {
    head.bias()->set_frozen(true);
    const auto actual = loss.forward_backward(head, h, targets, dh);
    CHECK(actual.loss == expected.loss);
    CHECK(same_values(dh, dh_expected));
    CHECK(same_values(head.weight().grad().to_dense(), reference.weight().grad().to_dense()));
    CHECK(head.bias()->grad().num_touched() == 0);
  }
  SECTION("tied and frozen through the embedding") {
    embedhead::TokenEmbedding<Scalar> embedding(V, d), unfrozen_embedding(V, d);
    embedhead::OutputProjection<Scalar> tied(embedding), unfrozen(unfrozen_embedding);
    embedding.set_frozen(true);
    RowMatrix<Scalar> dh_unfrozen(N, d);
    const auto a = loss.forward_backward(tied, h, targets, dh);
    const auto b = loss.forward_backward(unfrozen, h, targets, dh_unfrozen);
    CHECK(a.loss == b.loss);
    CHECK(same_values(dh, dh_unfrozen));
    CHECK(embedding.weight().grad().num_touched() == 0);
  }
  SECTION("the free function skips an empty dW") {
    RowMatrix<Scalar> none(0, d), db = RowMatrix<Scalar>::Zero(V, 1), lse(0, 1), losses(0, 1);
    FusedHeadLossWorkspace<Scalar> workspace;
    const RowMatrix<Scalar> no_weights(0, 1);
    const auto actual = embedhead::fused_head_loss_forward_backward<Scalar>(h, head.weight().value(),
                                                                            head.bias()->value(), targets, dh, none, db,
                                                                            workspace, options,
                                                                            extras_of(no_weights, lse, losses));
    CHECK(actual.loss == expected.loss);
    CHECK(same_values(dh, dh_expected));
    CHECK(same_values(db, reference.bias()->grad().to_dense()));
  }
}

namespace {

// Every output of one fused call (forward_backward, or the loss alone with gradient = false), in Scalar.
template <typename Scalar>
struct Run {
  CrossEntropyResult result;
  RowMatrix<Scalar> dh, dW, db, lse, losses;
};
template <typename Scalar>
Run<Scalar> run_fused(const RowMatrix<Scalar>& h, const RowMatrix<Scalar>& W, const RowMatrix<Scalar>& bias,
                      const IdMatrix<std::int64_t>& targets, const FusedHeadLossOptions& options,
                      bool gradient = true) {
  const Index N = h.rows(), V = W.rows(), d = W.cols();
  Run<Scalar> out{{},
                  RowMatrix<Scalar>::Constant(N, d, Scalar(7)),
                  RowMatrix<Scalar>::Zero(V, d),
                  RowMatrix<Scalar>::Zero(bias.rows(), 1),
                  RowMatrix<Scalar>::Constant(N, 1, Scalar(7)),
                  RowMatrix<Scalar>::Constant(N, 1, Scalar(7))};
  const RowMatrix<Scalar> no_weights(0, 1);
  FusedHeadLossWorkspace<Scalar> ws;
  if (gradient)
    out.result = embedhead::fused_head_loss_forward_backward<Scalar>(h, W, bias, targets, out.dh, out.dW, out.db, ws,
                                                                     options,
                                                                     extras_of(no_weights, out.lse, out.losses));
  else
    out.result = embedhead::fused_head_loss<Scalar>(h, W, bias, targets, ws, options,
                                                    extras_of(no_weights, out.lse, out.losses));
  return out;
}

// "" when every output of a and b is the same value (NaN matching NaN), else the first difference.
template <typename Scalar>
std::string run_difference(const Run<Scalar>& a, const Run<Scalar>& b) {
  for (const auto& [name, x, y] :
       {std::tuple{"dh", &a.dh, &b.dh}, std::tuple{"dW", &a.dW, &b.dW}, std::tuple{"db", &a.db, &b.db},
        std::tuple{"lse", &a.lse, &b.lse}, std::tuple{"losses", &a.losses, &b.losses}}) {
    const std::string difference = test_support::first_difference_nan(*x, *y);
    if (!difference.empty()) return std::string(name) + " " + difference;
  }
  const bool same_loss = a.result.loss == b.result.loss || (std::isnan(a.result.loss) && std::isnan(b.result.loss));
  return same_loss ? "" : "loss " + std::to_string(a.result.loss) + " vs " + std::to_string(b.result.loss);
}

}  // namespace

TEMPLATE_TEST_CASE("fused head loss: non-finite values give the plain loss's results, in both plans",
                   "[fused_head_loss][nonfinite]", float, double) {
  // docs/errors.md, "Non-finite values". The fused loss sums each row's exponentials block by
  // block at a running maximum; a block whose logits are all -inf (masked classes) must add 0
  // there, as exp(-inf) = 0 does in the plain loss, not exp(-inf - (-inf)) = NaN. Masks are
  // compared with -1e30 in their place (exp underflows to 0: the same numbers, bit for bit) and
  // with the unfused path; NaN and +inf against the same call on clean inputs.
  using Scalar = TestType;
  const Scalar inf = std::numeric_limits<Scalar>::infinity(), nan = std::numeric_limits<Scalar>::quiet_NaN();
  const Index V = 40, d = 5, classes = 37, block = 8;
  Problem<Scalar> p = make_problem<Scalar>(2, 3, V, d, 2301, classes);
  p.targets(0, 1) = 11;
  p.targets(1, 2) = -100;  // n = 5 ignored
  const PlanCase& plan = plan_cases()[static_cast<std::size_t>(GENERATE(0, 1, 2, 3))];
  CAPTURE(plan.name);
  FusedHeadLossOptions options = with_plan<Scalar>(FusedHeadLossOptions{}, plan, classes);
  options.valid_vocab = classes;
  options.vocab_block = block;
  {
    SECTION("masked classes: a whole block of -inf logits (through the bias) and one more") {
      RowMatrix<Scalar> masked = p.bias, floored = p.bias;
      masked.topRows(block).setConstant(-inf);  // columns [0, 8): the first block, every row
      masked(20, 0) = -inf;
      floored.topRows(block).setConstant(Scalar(-1e30));
      floored(20, 0) = Scalar(-1e30);
      const Run<Scalar> got = run_fused<Scalar>(p.h, p.W, masked, p.targets, options);
      const Run<Scalar> expected = run_fused<Scalar>(p.h, p.W, floored, p.targets, options);
      CHECK(std::isfinite(got.result.loss));
      CHECK(run_difference(got, expected) == "");
      CHECK(got.dW.topRows(block).isZero(0));  // a masked class gets exactly no gradient
      CHECK(got.db.topRows(block).isZero(0));
      const Run<Scalar> loss_only = run_fused<Scalar>(p.h, p.W, masked, p.targets, options, false);
      CHECK(loss_only.result.loss == got.result.loss);
      CHECK(same_values(loss_only.lse, got.lse));
      // The unfused path: -inf logits in the plain loss.
      Problem<Scalar> q = p;
      q.bias = masked;
      const Outputs unfused_out = unfused<Scalar>(q, true, options);
      CHECK_THAT(got.result.loss, WithinRel(unfused_out.result.loss, tolerance<Scalar>()));
      CHECK(close(got.dh, unfused_out.dh, tolerance<Scalar>()));
      CHECK(close(got.dW, unfused_out.dW, tolerance<Scalar>()));
    }
    SECTION("every class masked: lse = -inf (the log of an empty sum), loss and gradients NaN") {
      RowMatrix<Scalar> masked = p.bias;
      masked.topRows(classes).setConstant(-inf);
      const Run<Scalar> got = run_fused<Scalar>(p.h, p.W, masked, p.targets, options);
      CHECK(std::isnan(got.result.loss));
      for (Index n = 0; n < 5; ++n) {
        CAPTURE(n);
        CHECK(got.lse(n, 0) == -inf);
        CHECK(std::isnan(got.losses(n, 0)));
        CHECK(got.dh.row(n).array().isNaN().all());
      }
      CHECK(got.lse(5, 0) == Scalar(0));  // the ignored token
      CHECK(got.dh.row(5).isZero(0));
      CHECK(got.dW.topRows(classes).array().isNaN().all());
      CHECK(got.dW.bottomRows(V - classes).isZero(0));  // padding rows: nothing
      // The plain loss on the same logits agrees: NaN for every counted row.
      Problem<Scalar> q = p;
      q.bias = masked;
      const Outputs unfused_out = unfused<Scalar>(q, true, options);
      CHECK(std::isnan(unfused_out.result.loss));
      CHECK(test_support::first_difference_nan(RowMatrix<double>(got.losses.template cast<double>()),
                                               unfused_out.losses) == "");
    }
    SECTION("a NaN in a counted row of h: that row's loss and dh are NaN, and every row of dW and db") {
      RowMatrix<Scalar> bad = p.h, clean = p.h;
      bad(2, 3) = nan;
      clean.row(2).setZero();
      const Run<Scalar> got = run_fused<Scalar>(bad, p.W, p.bias, p.targets, options);
      const Run<Scalar> expected = run_fused<Scalar>(clean, p.W, p.bias, p.targets, options);
      CHECK(std::isnan(got.result.loss));
      CHECK(std::isnan(got.lse(2, 0)));
      CHECK(std::isnan(got.losses(2, 0)));
      CHECK(got.dh.row(2).array().isNaN().all());
      for (const Index n : {0, 1, 3, 4, 5}) {
        CAPTURE(n);
        CHECK(got.lse(n, 0) == expected.lse(n, 0));
        CHECK(got.losses(n, 0) == expected.losses(n, 0));
        CHECK(same_values(RowMatrix<Scalar>(got.dh.row(n)), RowMatrix<Scalar>(expected.dh.row(n))));
      }
      // dW = dz^T h sums every row of dz, the NaN one too (as the unfused path and PyTorch).
      CHECK(got.dW.topRows(classes).array().isNaN().all());
      CHECK(got.db.topRows(classes).array().isNaN().all());
      CHECK(got.dW.bottomRows(V - classes).isZero(0));
      Problem<Scalar> q = p;
      q.h = bad;
      const Outputs unfused_out = unfused<Scalar>(q, true, options);
      CHECK(unfused_out.dW.topRows(classes).array().isNaN().all());
      // A per-token weight of 0 does not drop the row (0 * NaN = NaN, as in PyTorch): ignore_index does.
      RowMatrix<Scalar> weights = RowMatrix<Scalar>::Ones(q.N, 1);
      weights(2, 0) = 0;
      CHECK(std::isnan(fused<Scalar>(q, true, options, weights).result.loss));
      q.targets(0, 2) = options.ignore_index;
      const Outputs dropped = fused<Scalar>(q, true, options, weights);
      CHECK(std::isfinite(dropped.result.loss));
      CHECK(dropped.dW.allFinite());
    }
    SECTION("a NaN in a class row of W, or +inf in the bias: every row's loss is NaN") {
      // (+-inf in W or h give logits of either sign, or NaN where they meet a 0: see the docs.)
      RowMatrix<Scalar> W = p.W, bias = p.bias;
      W(13, 0) = nan;
      bias(21, 0) = inf;  // class 21's logit is +inf in every row
      for (const Run<Scalar>& got : {run_fused<Scalar>(p.h, W, p.bias, p.targets, options),
                                     run_fused<Scalar>(p.h, p.W, bias, p.targets, options)}) {
        CHECK(std::isnan(got.result.loss));
        CHECK(got.lse.topRows(5).array().isNaN().all());
        CHECK(got.losses.topRows(5).array().isNaN().all());
        CHECK(got.dh.topRows(5).array().isNaN().all());
        CHECK(got.dW.topRows(classes).array().isNaN().all());
        CHECK(got.lse(5, 0) == Scalar(0));
        CHECK(got.dh.row(5).isZero(0));
      }
    }
    SECTION("values that never reach the loss change nothing: an ignored token's h, a padding row of W") {
      RowMatrix<Scalar> h = p.h, W = p.W, bias = p.bias;
      h(5, 0) = nan;   // n = 5 is ignored
      W(38, 1) = inf;  // padding
      bias(39, 0) = nan;
      const Run<Scalar> got = run_fused<Scalar>(h, W, bias, p.targets, options);
      const Run<Scalar> expected = run_fused<Scalar>(p.h, p.W, p.bias, p.targets, options);
      CHECK(std::isfinite(got.result.loss));
      CHECK(run_difference(got, expected) == "");
    }
  }
}

TEMPLATE_TEST_CASE("fused head loss with error_if_nonfinite rejects NaN or infinite inputs and writes nothing",
                   "[fused_head_loss][nonfinite][errors]", float, double) {
  using Scalar = TestType;
  const Scalar inf = std::numeric_limits<Scalar>::infinity(), nan = std::numeric_limits<Scalar>::quiet_NaN();
  const Index V = 9, d = 3, N = 4, classes = 7;
  Problem<Scalar> p = make_problem<Scalar>(1, N, V, d, 2501, classes);
  p.targets(0, 1) = -100;  // n = 1 ignored
  FusedHeadLossOptions options;
  options.error_if_nonfinite = true;
  options.valid_vocab = classes;
  RowMatrix<Scalar> dh = RowMatrix<Scalar>::Constant(N, d, 5), dW = RowMatrix<Scalar>::Constant(V, d, 6),
                    db = RowMatrix<Scalar>::Constant(V, 1, 7), lse = RowMatrix<Scalar>::Constant(N, 1, 8),
                    losses = RowMatrix<Scalar>::Constant(N, 1, 9);
  const RowMatrix<Scalar> dh0 = dh, dW0 = dW, db0 = db, lse0 = lse, losses0 = losses, no_weights(0, 1);
  FusedHeadLossWorkspace<Scalar> ws;
  auto call = [&](const RowMatrix<Scalar>& h, const RowMatrix<Scalar>& W, const RowMatrix<Scalar>& bias) {
    embedhead::fused_head_loss_forward_backward<Scalar>(h, W, bias, p.targets, dh, dW, db, ws, options,
                                                        extras_of(no_weights, lse, losses));
  };
  auto unchanged = [&] {
    CHECK(same_values(dh, dh0));
    CHECK(same_values(dW, dW0));
    CHECK(same_values(db, db0));
    CHECK(same_values(lse, lse0));
    CHECK(same_values(losses, losses0));
  };
  RowMatrix<Scalar> h = p.h, W = p.W, bias = p.bias;
  options.plan = GENERATE(embedhead::FusedPlan::vocab_blocks, embedhead::FusedPlan::token_chunks);
  SECTION("h, W and bias, each reported with its place; h first, then W, then the bias") {
    h(3, 1) = nan;
    W(4, 2) = -inf;
    bias(6, 0) = inf;
    CHECK_THROWS_AS(call(h, W, bias), embedhead::value_error);
    CHECK_THROWS_WITH(call(h, W, bias), Contains("fused_head_loss_forward_backward: h nan at n=3 (b=0, t=3), column "
                                                 "1, outside the finite numbers (error_if_nonfinite)"));
    CHECK_THROWS_WITH(embedhead::fused_head_loss<Scalar>(h, W, bias, p.targets, ws, options),
                      Contains("fused_head_loss: h nan at n=3"));
    h(3, 1) = 0;
    CHECK_THROWS_WITH(call(h, W, bias), Contains("fused_head_loss_forward_backward: W -inf at row 4, column 2, "
                                                 "outside the finite numbers (error_if_nonfinite)"));
    W(4, 2) = 0;
    CHECK_THROWS_WITH(call(h, W, bias), Contains("fused_head_loss_forward_backward: bias inf at row 6 outside the "
                                                 "finite numbers (error_if_nonfinite)"));
    unchanged();
  }
  SECTION("not checked where nothing reaches the loss: an ignored token, padding rows of W and bias") {
    h(1, 0) = nan;
    W(7, 2) = inf;
    bias(8, 0) = -inf;
    FusedHeadLossOptions off = options;
    off.error_if_nonfinite = false;
    const Run<Scalar> expected = run_fused<Scalar>(h, W, bias, p.targets, off);
    const Run<Scalar> got = run_fused<Scalar>(h, W, bias, p.targets, options);
    CHECK(std::isfinite(got.result.loss));
    CHECK(run_difference(got, expected) == "");
  }
  SECTION("the layer: the gradients stay as they were (sparse, untouched)") {
    embedhead::TokenEmbedding<Scalar> emb(V, d);
    embedhead::OutputProjection<Scalar> head(emb);
    const IdMatrix<std::int32_t> ids = random_ids<std::int32_t>(1, 3, V, 2502);
    emb.backward(ids, RowMatrix<Scalar>::Ones(3, d));
    const RowMatrix<Scalar> before = emb.weight().grad().to_dense();
    const Index touched = emb.weight().grad().num_touched();
    FusedHeadLoss<Scalar> loss(options);
    h(0, 2) = -inf;
    CHECK_THROWS_WITH(loss.forward_backward(head, h, p.targets, dh),
                      Contains("FusedHeadLoss::forward_backward: h -inf at n=0 (b=0, t=0), column 2"));
    CHECK_THROWS_WITH(loss.forward(head, h, p.targets), Contains("FusedHeadLoss::forward: h -inf at n=0"));
    CHECK(!emb.weight().grad().is_dense());
    CHECK(emb.weight().grad().num_touched() == touched);
    CHECK(same_values(emb.weight().grad().to_dense(), before));
    unchanged();
  }
}
