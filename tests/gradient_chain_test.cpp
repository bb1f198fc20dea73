// End-to-end gradient check of the whole front and back of a model with no blocks:
//
//   ids [B, T] -> TokenEmbedding (optionally * sqrt(d)) -> + LearnedPositionEmbedding
//              -> Dropout (training, p = 0.3) -> OutputProjection (tied, or untied with bias)
//              -> cross-entropy (mean over the targets that are not ignore_index)
//
// The backward runs through every layer in reverse; each parameter gradient (E, P, W, b) is then
// compared with central finite differences of a loss computed naively (one-hot products, explicit
// loops, naive::cross_entropy_sum) from the same parameter values and the dropout mask of the
// forward pass, so the finite differences share no code with the layers under test. The float
// chain is compared with the double one.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <embedhead/embedhead.hpp>
#include <string>
#include <vector>

#include "reference/naive.hpp"

namespace {

using Catch::Matchers::WithinAbs;
using Catch::Matchers::WithinRel;
using embedhead::Index;
using embedhead::RowMatrix;

constexpr Index kB = 2, kT = 3, kV = 11, kD = 5, kTMax = 4;  // T_max > T: row 3 of P is unused
constexpr double kDropoutP = 0.3;
constexpr std::uint64_t kDropoutSeed = 17;

struct Variant {
  std::string name;
  bool tied;
  bool scaled;  // TokenEmbeddingOptions::scale_by_sqrt_d
  Index ignore_index;
};

// The parameter values and data, in double. Finite differences perturb E, P, W and b in place.
struct Problem {
  embedhead::IdMatrix<std::int32_t> ids = embedhead::IdMatrix<std::int32_t>(kB, kT);
  embedhead::IdMatrix<std::int32_t> targets = embedhead::IdMatrix<std::int32_t>(kB, kT);
  RowMatrix<double> E, P, W, b;
};

RowMatrix<double> normal_matrix(Index rows, Index cols, double sd, std::uint64_t seed) {
  embedhead::Rng rng(seed);
  RowMatrix<double> m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = sd * rng.normal();
  return m;
}

Problem make_problem(const Variant& variant) {
  Problem p;
  // Token 3 and 7 repeat, most tokens are absent; the last target is ignored.
  p.ids << 3, 7, 3, 0, 10, 7;
  p.targets << 7, 3, 0, 10, 7, static_cast<std::int32_t>(variant.ignore_index);
  // O(1) values so that every gradient is far from zero and from rounding noise.
  p.E = normal_matrix(kV, kD, 0.6, 101);
  p.P = normal_matrix(kTMax, kD, 0.4, 102);
  p.W = normal_matrix(kV, kD, 0.6, 103);
  p.b = normal_matrix(kV, 1, 0.3, 104);
  return p;
}

// The loss computed from scratch in double, given the dropout multipliers M [N, d].
double naive_loss(const Problem& p, const RowMatrix<double>& M, const Variant& variant) {
  const double scale = variant.scaled ? std::sqrt(static_cast<double>(kD)) : 1.0;
  RowMatrix<double> x = naive::one_hot_lookup<double>(p.ids, p.E);  // [N, d] = one_hot(ids) E
  for (Index b = 0; b < kB; ++b)
    for (Index t = 0; t < kT; ++t)
      for (Index j = 0; j < kD; ++j) {
        const Index n = b * kT + t;
        x(n, j) = (scale * x(n, j) + p.P(t, j)) * M(n, j);
      }
  const RowMatrix<double>& W_out = variant.tied ? p.E : p.W;
  RowMatrix<double> logits(kB * kT, kV);
  for (Index n = 0; n < kB * kT; ++n)
    for (Index v = 0; v < kV; ++v) {
      double z = variant.tied ? 0.0 : p.b(v, 0);
      for (Index j = 0; j < kD; ++j) z += x(n, j) * W_out(v, j);
      logits(n, v) = z;
    }
  Index count = 0;
  const double sum = naive::cross_entropy_sum(logits, p.targets, variant.ignore_index, count);
  return sum / static_cast<double>(count);
}

// What one run of the chain in Scalar produces, converted to double.
struct ChainRun {
  double loss = 0;
  Index count = 0;
  RowMatrix<double> mask;            // dropout multipliers [N, d]
  RowMatrix<double> dE, dP, dW, db;  // dW and db empty when tied
  bool dE_dense = false;
  std::vector<Index> dP_touched;
  RowMatrix<double> dlogits;
};

template <typename Scalar>
ChainRun run_chain(const Problem& p, const Variant& variant) {
  embedhead::TokenEmbeddingOptions embedding_options;
  embedding_options.scale_by_sqrt_d = variant.scaled;
  embedhead::TokenEmbedding<Scalar> embedding(kV, kD, embedding_options);
  embedhead::LearnedPositionEmbedding<Scalar> positions(kTMax, kD);
  embedhead::Dropout<Scalar> dropout(kDropoutP, kDropoutSeed);
  embedhead::OutputProjection<Scalar> head(kV, kD);  // untied, with bias
  if (variant.tied) head.tie_to(embedding);
  REQUIRE(head.is_tied_to(embedding) == variant.tied);
  REQUIRE(head.has_bias() == !variant.tied);

  embedding.weight().value() = p.E.cast<Scalar>();
  positions.weight().value() = p.P.cast<Scalar>();
  if (!variant.tied) {
    head.weight().value() = p.W.cast<Scalar>();
    head.bias()->value() = p.b.cast<Scalar>();
  }

  // Forward.
  const RowMatrix<Scalar> tokens = embedding.forward(p.ids);
  const RowMatrix<Scalar> summed = positions.forward(tokens, kB, kT);
  REQUIRE(dropout.is_training());
  const RowMatrix<Scalar> dropped = dropout.forward(summed);
  const RowMatrix<Scalar> logits = head.forward(dropped);
  embedhead::CrossEntropyOptions ce_options;
  ce_options.ignore_index = variant.ignore_index;
  ce_options.reduction = embedhead::Reduction::mean;
  RowMatrix<Scalar> dlogits(kB * kT, kV);
  const auto ce = embedhead::cross_entropy_forward_backward<Scalar>(logits, p.targets, dlogits, ce_options);

  // Backward, in reverse order. The position layer passes its gradient through unchanged.
  const RowMatrix<Scalar> d_dropped = head.backward(dropped, dlogits);
  const RowMatrix<Scalar> d_summed = dropout.backward(d_dropped);
  positions.backward(d_summed, kB, kT);
  embedding.backward(p.ids, d_summed);

  ChainRun run;
  run.loss = ce.loss;
  run.count = ce.count;
  run.mask = dropout.mask().template cast<double>();
  run.dE = embedding.weight().grad().to_dense().template cast<double>();
  run.dE_dense = embedding.weight().grad().is_dense();
  run.dP = positions.weight().grad().to_dense().template cast<double>();
  run.dP_touched = positions.weight().grad().touched_rows();
  if (!variant.tied) {
    run.dW = head.weight().grad().to_dense().template cast<double>();
    run.db = head.bias()->grad().to_dense().template cast<double>();
  }
  run.dlogits = dlogits.template cast<double>();
  return run;
}

const std::vector<Variant> kVariants = {
    {"untied head with bias, unscaled embedding, ignore_index -100", false, false, -100},
    {"tied head, sqrt(d)-scaled embedding, ignore_index -100", true, true, -100},
    {"tied head, unscaled embedding, ignore_index 4 (a valid id)", true, false, 4},
    {"untied head with bias, sqrt(d)-scaled embedding, ignore_index 4", false, true, 4},
};

}  // namespace

TEST_CASE("Gradient chain in double: every parameter gradient matches central finite differences",
          "[chain][gradient]") {
  // The loss is smooth with O(1) third derivatives here: eps = 1e-5 balances truncation (~eps^2)
  // against cancellation (~1e-16 / eps), both near 1e-10 in absolute terms. The floor makes
  // entries below 1e-3 count with that absolute accuracy instead of relative to their own size.
  const double eps = 1e-5, floor = 1e-3, tolerance = 1e-6;
  for (const Variant& variant : kVariants) {
    INFO(variant.name);
    Problem p = make_problem(variant);
    const ChainRun run = run_chain<double>(p, variant);
    const RowMatrix<double>& M = run.mask;

    // The mask is a real dropout mask: entries 0 or 1/(1-p), some of each.
    Index kept = 0;
    for (Index i = 0; i < M.size(); ++i) {
      const double m = M.data()[i];
      CHECK((m == 0.0 || m == 1.0 / (1.0 - kDropoutP)));
      if (m != 0.0) ++kept;
    }
    CHECK(kept > 0);
    CHECK(kept < M.size());

    // The chain's forward agrees with the naive loss, and the ignored target is not counted.
    CHECK(run.count == kB * kT - 1);
    CHECK_THAT(run.loss, WithinRel(naive_loss(p, M, variant), 1e-12));
    CHECK(run.dlogits.row(kB * kT - 1).isZero(0));

    auto loss = [&]() { return naive_loss(p, M, variant); };

    const RowMatrix<double> num_dE = naive::numerical_gradient(p.E, loss, eps);
    CAPTURE(naive::max_relative_error(run.dE, num_dE, floor));
    CHECK(naive::max_relative_error(run.dE, num_dE, floor) < tolerance);
    // Tied: the head's contribution is dense, every row of E has gradient; untied: only the rows of
    // tokens present (0, 3, 7, 10), which the finite differences confirm are the only non-zero ones.
    CHECK(run.dE_dense == variant.tied);
    if (!variant.tied) {
      for (const Index absent : {1, 2, 4, 5, 6, 8, 9}) {
        CHECK(run.dE.row(absent).isZero(0));
        CHECK(num_dE.row(absent).isZero(0));
      }
    }

    const RowMatrix<double> num_dP = naive::numerical_gradient(p.P, loss, eps);
    CAPTURE(naive::max_relative_error(run.dP, num_dP, floor));
    CHECK(naive::max_relative_error(run.dP, num_dP, floor) < tolerance);
    CHECK(run.dP_touched == std::vector<Index>{0, 1, 2});  // row 3 (t >= T) untouched
    CHECK(run.dP.row(3).isZero(0));

    if (!variant.tied) {
      const RowMatrix<double> num_dW = naive::numerical_gradient(p.W, loss, eps);
      CAPTURE(naive::max_relative_error(run.dW, num_dW, floor));
      CHECK(naive::max_relative_error(run.dW, num_dW, floor) < tolerance);
      const RowMatrix<double> num_db = naive::numerical_gradient(p.b, loss, eps);
      CAPTURE(naive::max_relative_error(run.db, num_db, floor));
      CHECK(naive::max_relative_error(run.db, num_db, floor) < tolerance);
    }
  }
}

TEST_CASE("Gradient chain in float agrees with the same chain in double", "[chain][float]") {
  for (const Variant& variant : kVariants) {
    INFO(variant.name);
    Problem p = make_problem(variant);
    // Both chains start from the float-rounded values, so only the arithmetic differs.
    p.E = p.E.cast<float>().cast<double>();
    p.P = p.P.cast<float>().cast<double>();
    p.W = p.W.cast<float>().cast<double>();
    p.b = p.b.cast<float>().cast<double>();
    const ChainRun d = run_chain<double>(p, variant);
    const ChainRun f = run_chain<float>(p, variant);

    // Same seed, same draws: the float mask keeps exactly the elements the double one keeps.
    REQUIRE(f.mask.rows() == d.mask.rows());
    for (Index i = 0; i < d.mask.size(); ++i) CHECK((f.mask.data()[i] == 0.0) == (d.mask.data()[i] == 0.0));

    CHECK_THAT(f.loss, WithinRel(d.loss, 1e-5));
    CHECK(f.dE_dense == d.dE_dense);
    CHECK(f.dP_touched == d.dP_touched);

    // Float tolerance: a few hundred units of float roundoff relative to the largest gradient entry
    // of the matrix (the chain has ~10 rounding steps of O(1) values per entry).
    auto check_matrix = [](const RowMatrix<double>& actual, const RowMatrix<double>& expected, const char* what) {
      INFO(what);
      REQUIRE(actual.rows() == expected.rows());
      REQUIRE(actual.cols() == expected.cols());
      const double scale = expected.cwiseAbs().maxCoeff();
      for (Index i = 0; i < expected.size(); ++i)
        CHECK_THAT(actual.data()[i],
                   WithinRel(expected.data()[i], 1e-4) || WithinAbs(expected.data()[i], 2e-5 * scale));
    };
    check_matrix(f.dE, d.dE, "dE");
    check_matrix(f.dP, d.dP, "dP");
    if (!variant.tied) {
      check_matrix(f.dW, d.dW, "dW");
      check_matrix(f.db, d.db, "db");
    }
  }
}
