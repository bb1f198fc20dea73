// The worked examples and exercises of the specification (../shared/seeds/README.md and the
// three source chapters it digests) that concern the embedding, position, dropout and head layers,
// with the chapters' own numbers as expected values. Test names cite the chapter:
//   seed 000 = 000_6a1967a2a2b9a927.txt (Russian, "Embeddings and the output projection")
//   seed 001 = 001_c1d1c9e083f9f43b.txt (Chinese, "Token Embedding")
//   seed 002 = 002_0f237f9cdcc98ec0.txt (French, "An embedding is a lookup table, not a function")
// The chapters print most results to 3 decimals; those are compared within half a unit of the
// last printed digit (kThreeDecimals), and where a tighter hand-derived value exists it is checked
// as well. Statistical facts (expected norms at init) use tolerances of 5 standard errors of the
// sample actually drawn.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <embedhead/embedhead.hpp>
#include <limits>
#include <vector>

#include "reference/naive.hpp"
#include "reference/test_support.hpp"

namespace {

using Catch::Matchers::Contains;
using Catch::Matchers::WithinAbs;
using Catch::Matchers::WithinRel;
using embedhead::Index;
using embedhead::RowMatrix;
using test_support::same_values;

// Half a unit in the third decimal, plus room for float rounding of the inputs.
constexpr double kThreeDecimals = 0.0005 + 1e-6;

template <typename Id>
embedhead::IdMatrix<Id> id_matrix(Index B, Index T, std::initializer_list<Id> values) {
  embedhead::IdMatrix<Id> ids(B, T);
  std::copy(values.begin(), values.end(), ids.data());
  return ids;
}

// The chapter's table E = [[0.1, 0.2], [0.3, -0.1], [0.0, 0.5]] (seed 000, one-hot section).
template <typename Scalar>
void set_seed_table(embedhead::TokenEmbedding<Scalar>& embedding) {
  embedding.weight().value() << Scalar(0.1), Scalar(0.2), Scalar(0.3), Scalar(-0.1), Scalar(0.0), Scalar(0.5);
}

// Mean over rows of the squared row norm, in double.
template <typename M>
double mean_squared_row_norm(const M& m) {
  double total = 0;
  for (Index r = 0; r < m.rows(); ++r) total += m.row(r).template cast<double>().squaredNorm();
  return total / static_cast<double>(m.rows());
}

template <typename M>
double mean_row_norm(const M& m) {
  double total = 0;
  for (Index r = 0; r < m.rows(); ++r) total += m.row(r).template cast<double>().norm();
  return total / static_cast<double>(m.rows());
}

template <typename M>
double rms(const M& m) {
  return std::sqrt(m.template cast<double>().squaredNorm() / static_cast<double>(m.size()));
}

}  // namespace

TEMPLATE_TEST_CASE("seed 000 one-hot example: V=3, d=2, lookup of token 1 is [0.3, -0.1] = one_hot(1)*E",
                   "[seeds][token_embedding]", float, double) {
  using Scalar = TestType;
  embedhead::TokenEmbedding<Scalar> embedding(3, 2);
  set_seed_table(embedding);
  const RowMatrix<Scalar> E = embedding.weight().value();

  SECTION("worked example") {
    const auto ids = id_matrix<std::int32_t>(1, 1, {1});
    const RowMatrix<Scalar> out = embedding.forward(ids);
    REQUIRE(out.rows() == 1);
    REQUIRE(out.cols() == 2);
    // A lookup copies the row: exactly the stored values, no arithmetic.
    CHECK(out(0, 0) == Scalar(0.3));
    CHECK(out(0, 1) == Scalar(-0.1));
    // o(1) * E = [0*0.1 + 1*0.3 + 0*0.0, 0*0.2 + 1*(-0.1) + 0*0.5]: exact too (adding zeros).
    CHECK(same_values(naive::one_hot_lookup<Scalar>(ids, E), out));
    CHECK(same_values(embedding.forward(id_matrix<std::int64_t>(1, 1, {1})), out));
  }

  SECTION("seed 001: lookup = gather = one_hot x W: every row, int32 and int64 ids") {
    const auto ids = id_matrix<std::int32_t>(2, 3, {0, 1, 2, 2, 1, 0});
    const RowMatrix<Scalar> out = embedding.forward(ids);
    CHECK(same_values(out, naive::one_hot_lookup<Scalar>(ids, E)));
    for (Index n = 0; n < 6; ++n) CHECK(same_values(out.row(n), E.row(ids.data()[n])));
    const auto ids64 = id_matrix<std::int64_t>(2, 3, {0, 1, 2, 2, 1, 0});
    CHECK(same_values(embedding.forward(ids64), out));
  }

  SECTION("seed 000 PyTorch check: V=5, d=3, x=[[1, 3, 1]]: one_hot(x) @ W equals emb(x)") {
    embedhead::TokenEmbedding<Scalar> emb5(5, 3);
    const auto x = id_matrix<std::int32_t>(1, 3, {1, 3, 1});
    const RowMatrix<Scalar> W = emb5.weight().value();
    CHECK(same_values(naive::one_hot_lookup<Scalar>(x, W), emb5.forward(x)));
  }
}

TEMPLATE_TEST_CASE("seed 000 gradient example: V=5, d=3, x=[[1, 3, 1]], L=sum(out): row 1 = [2,2,2], row 3 = [1,1,1]",
                   "[seeds][token_embedding][backward]", float, double) {
  using Scalar = TestType;
  embedhead::TokenEmbedding<Scalar> embedding(5, 3);
  const auto x = id_matrix<std::int32_t>(1, 3, {1, 3, 1});
  const RowMatrix<Scalar> out = embedding.forward(x);
  // L = sum of all outputs, so g_t = dL/dout[t] = (1, 1, 1) at every position.
  const RowMatrix<Scalar> g = RowMatrix<Scalar>::Ones(out.rows(), out.cols());
  embedding.backward(x, g);

  RowMatrix<Scalar> expected = RowMatrix<Scalar>::Zero(5, 3);
  expected.row(1).setConstant(Scalar(2));  // token 1 appears twice
  expected.row(3).setConstant(Scalar(1));  // token 3 once
  const auto& grad = embedding.weight().grad();
  CHECK(same_values(grad.to_dense(), expected));
  // Rows of absent tokens are not even visited.
  CHECK(grad.touched_rows() == std::vector<Index>{1, 3});
  CHECK_FALSE(grad.is_dense());
  // The matrix form O^T G of the chapter.
  const RowMatrix<Scalar> O = naive::one_hot<Scalar>(x, 5);
  CHECK(same_values(RowMatrix<Scalar>(O.transpose() * g), grad.to_dense()));
}

TEMPLATE_TEST_CASE("seed 000 exercise 2: batch [[5,2,5],[2,7,5]] -> rows 2, 5, 7 with weights 2, 3, 1",
                   "[seeds][token_embedding][backward]", float, double) {
  using Scalar = TestType;
  embedhead::TokenEmbedding<Scalar> embedding(8, 3);
  // "If all g_t are equal": every position gets the same g (exact binary fractions).
  RowMatrix<Scalar> g_row(1, 3);
  g_row << Scalar(0.5), Scalar(-1.25), Scalar(2);
  const RowMatrix<Scalar> g = g_row.replicate(6, 1);

  SECTION("int32 ids") { embedding.backward(id_matrix<std::int32_t>(2, 3, {5, 2, 5, 2, 7, 5}), g); }
  SECTION("int64 ids") { embedding.backward(id_matrix<std::int64_t>(2, 3, {5, 2, 5, 2, 7, 5}), g); }

  const auto& grad = embedding.weight().grad();
  CHECK(grad.touched_rows() == std::vector<Index>{2, 5, 7});
  const RowMatrix<Scalar> dE = grad.to_dense();
  CHECK(same_values(dE.row(2), Scalar(2) * g_row));
  CHECK(same_values(dE.row(5), Scalar(3) * g_row));  // "three times the gradient of one position"
  CHECK(same_values(dE.row(7), g_row));
  for (const Index absent : {0, 1, 3, 4, 6}) CHECK(dE.row(absent).isZero(0));
}

TEMPLATE_TEST_CASE("seed 000 tied-gradient example: h=(1, 2), y=2 -> z=[0.5, 0.1, 1.0], p~[0.301, 0.202, 0.497]",
                   "[seeds][output_projection][tied][cross_entropy]", float, double) {
  using Scalar = TestType;
  embedhead::TokenEmbedding<Scalar> embedding(3, 2);
  set_seed_table(embedding);
  embedhead::OutputProjection<Scalar> head(embedding);  // W_out = E^T, no bias
  REQUIRE_FALSE(head.has_bias());

  RowMatrix<Scalar> h(1, 2);
  h << Scalar(1), Scalar(2);
  const auto y = id_matrix<std::int32_t>(1, 1, {2});

  // z = h E^T = [0.1*1 + 0.2*2, 0.3*1 - 0.1*2, 0*1 + 0.5*2].
  const RowMatrix<Scalar> z = head.forward(h);
  REQUIRE(z.cols() == 3);
  const double z_expected[3] = {0.5, 0.1, 1.0};
  for (Index v = 0; v < 3; ++v) CHECK_THAT(static_cast<double>(z(0, v)), WithinAbs(z_expected[v], 1e-6));

  // dL/dz = p - y for cross-entropy on one row (sum reduction, N = 1).
  embedhead::CrossEntropyOptions options;
  options.reduction = embedhead::Reduction::sum;
  RowMatrix<Scalar> dz(1, 3);
  const auto result = embedhead::cross_entropy_forward_backward<Scalar>(z, y, dz, options);
  REQUIRE(result.count == 1);

  const double p_seed[3] = {0.301, 0.202, 0.497};
  const double p_minus_y_seed[3] = {0.301, 0.202, -0.503};
  // Hand derivation in double: p_v = exp(z_v) / (e^0.5 + e^0.1 + e^1).
  const double partition = std::exp(0.5) + std::exp(0.1) + std::exp(1.0);
  for (Index v = 0; v < 3; ++v) {
    const double p_exact = std::exp(z_expected[v]) / partition;
    const double p = static_cast<double>(dz(0, v)) + (v == 2 ? 1.0 : 0.0);
    CHECK_THAT(p, WithinAbs(p_seed[v], kThreeDecimals));
    CHECK_THAT(static_cast<double>(dz(0, v)), WithinAbs(p_minus_y_seed[v], kThreeDecimals));
    CHECK_THAT(p, WithinAbs(p_exact, 1e-6));
  }
  CHECK_THAT(result.loss, WithinAbs(-std::log(std::exp(1.0) / partition), 1e-6));

  // Output-side gradient (p - y)^T h.
  head.backward(h, dz);
  const RowMatrix<Scalar> dE = embedding.weight().grad().to_dense();
  const double dE_seed[3][2] = {{0.301, 0.603}, {0.202, 0.404}, {-0.503, -1.007}};
  for (Index v = 0; v < 3; ++v)
    for (Index j = 0; j < 2; ++j) {
      CHECK_THAT(static_cast<double>(dE(v, j)), WithinAbs(dE_seed[v][j], kThreeDecimals));
      const double exact = (std::exp(z_expected[v]) / partition - (v == 2 ? 1.0 : 0.0)) * (j == 0 ? 1.0 : 2.0);
      CHECK_THAT(static_cast<double>(dE(v, j)), WithinAbs(exact, 1e-6));
    }
  // "All V rows get gradient": the head's contribution is dense.
  CHECK(embedding.weight().grad().is_dense());

  SECTION("seed 000 exercise 5: one SGD step, eta = 0.1, on the output part raises z_2 from 1.0 to ~1.252") {
    const double eta = 0.1;
    const double h_norm2 = 5.0;  // |h|^2 = 1 + 4
    // W <- W - eta * dW with the head's gradient only (the embedding did no backward here).
    head.weight().value() -= Scalar(eta) * head.weight().grad().to_dense();
    // New row 2: (0, 0.5) - 0.1 * (-0.503, -1.007) ~ (0.050, 0.601).
    CHECK_THAT(static_cast<double>(head.weight().value()(2, 0)), WithinAbs(0.050, kThreeDecimals));
    CHECK_THAT(static_cast<double>(head.weight().value()(2, 1)), WithinAbs(0.601, kThreeDecimals));

    const RowMatrix<Scalar> z_new = head.forward(h);
    CHECK_THAT(static_cast<double>(z_new(0, 2)), WithinAbs(1.252, kThreeDecimals));
    CHECK_THAT(static_cast<double>(z_new(0, 2) - z(0, 2)), WithinAbs(0.252, kThreeDecimals));
    CHECK_THAT(static_cast<double>(z(0, 0) - z_new(0, 0)), WithinAbs(0.151, kThreeDecimals));
    CHECK_THAT(static_cast<double>(z(0, 1) - z_new(0, 1)), WithinAbs(0.101, kThreeDecimals));
    // The exact rule: z_v moves by -eta (p_v - y_v) |h|^2, i.e. +eta (1 - p_2) |h|^2 for the target.
    for (Index v = 0; v < 3; ++v) {
      const double p_exact = std::exp(z_expected[v]) / partition;
      const double shift = -eta * (p_exact - (v == 2 ? 1.0 : 0.0)) * h_norm2;
      CHECK_THAT(static_cast<double>(z_new(0, v)), WithinAbs(z_expected[v] + shift, 1e-5));
    }
    // seed 000 pitfall "tying must be shared storage, not a copy": the step is seen by the lookup.
    const RowMatrix<Scalar> e2 = embedding.forward(id_matrix<std::int32_t>(1, 1, {2}));
    CHECK(same_values(e2, head.weight().value().row(2)));
  }
}

TEMPLATE_TEST_CASE("seed 000 exercise 4: d=512, sigma=1/sqrt(512): E|e|^2 = 1 before sqrt(d) scaling, 512 after",
                   "[seeds][token_embedding][scale]", float, double) {
  using Scalar = TestType;
  const Index V = 4096, d = 512;
  const double sigma = 1.0 / std::sqrt(512.0);
  embedhead::TokenEmbeddingOptions options;
  options.init_std = sigma;
  options.seed = 4;
  options.scale_by_sqrt_d = true;
  const embedhead::TokenEmbedding<Scalar> embedding(V, d, options);

  // |e|^2 = sigma^2 chi^2_d: mean d sigma^2 = 1, variance 2 d sigma^4 = 2/d per row; the mean over
  // V rows has standard error sqrt(2 / (d V)) (relative, the same after scaling).
  const double rel_se = std::sqrt(2.0 / static_cast<double>(d * V));
  const double tol = 5 * rel_se;

  const double before = mean_squared_row_norm(embedding.weight().value());
  CHECK_THAT(before, WithinAbs(1.0, tol));
  CHECK_THAT(rms(embedding.weight().value()), WithinAbs(sigma, sigma * tol / 2));

  embedhead::IdMatrix<std::int32_t> all_ids(1, V);
  for (Index v = 0; v < V; ++v) all_ids(0, v) = static_cast<std::int32_t>(v);
  const RowMatrix<Scalar> out = embedding.forward(all_ids);
  CHECK_THAT(mean_squared_row_norm(out), WithinAbs(512.0, 512.0 * tol));
  // RMS per coordinate after = sqrt(d) sigma = 1; an RMS has half the relative error of its square.
  CHECK_THAT(rms(out), WithinAbs(1.0, tol / 2));
  // "norm ~ 22.6": a scaled row is sqrt(d) sigma chi_d = chi_d, mean ~ sqrt(d - 1/2) = 22.62, sd ~ 0.71.
  CHECK_THAT(mean_row_norm(out), WithinAbs(22.6, 0.05 + 5 * 0.71 / std::sqrt(static_cast<double>(V))));
}

TEST_CASE("seed 000 sqrt(d) multiplier is cast to the embedding dtype first (bf16: sqrt(2048) -> 45.25)",
          "[seeds][token_embedding][scale]") {
  // The bf16 case itself cannot be tested: Scalar must be a standard floating-point type and there
  // is no bf16 one. The same rule is checked for float vs double.
  embedhead::TokenEmbeddingOptions options;
  options.scale_by_sqrt_d = true;
  const embedhead::TokenEmbedding<float> table_f(3, 2048, options);
  const embedhead::TokenEmbedding<double> table_d(3, 2048, options);
  const double exact = std::sqrt(2048.0);  // 45.254833995939045
  CHECK(table_f.scale() == static_cast<float>(exact));
  CHECK(static_cast<double>(table_f.scale()) != exact);  // float(45.2548...) = 45.25483322...
  CHECK(table_d.scale() == exact);

  // The outputs are the float multiplier times the float row, one rounding, exactly as a float
  // framework computes tok_out * tensor(scale, dtype=tok_out.dtype).
  const auto ids = id_matrix<std::int32_t>(1, 2, {2, 0});
  const RowMatrix<float> out = table_f.forward(ids);
  const float s = static_cast<float>(exact);
  for (Index j = 0; j < 2048; ++j) {
    CHECK(out(0, j) == s * table_f.weight().value()(2, j));
    CHECK(out(1, j) == s * table_f.weight().value()(0, j));
  }
  // Without the option the multiplier is exactly 1.
  CHECK(embedhead::TokenEmbedding<float>(3, 2048).scale() == 1.0f);
}

TEMPLATE_TEST_CASE(
    "seed 000 sqrt(d) numerical example: N(0, 0.02), d=2048: norm ~0.905, RMS 0.02, x45.25: RMS ~0.905, norm ~41",
    "[seeds][token_embedding][scale]", float, double) {
  using Scalar = TestType;
  const Index V = 512, d = 2048;
  embedhead::TokenEmbeddingOptions options;  // default init_std = 0.02
  options.seed = 2048;
  options.scale_by_sqrt_d = true;
  const embedhead::TokenEmbedding<Scalar> embedding(V, d, options);
  const double rel_se = std::sqrt(2.0 / static_cast<double>(d * V));  // of the mean |e|^2

  // sqrt(mean |e|^2) = 0.02 sqrt(2048) = 0.9051; half the relative error of the mean square.
  CHECK_THAT(std::sqrt(mean_squared_row_norm(embedding.weight().value())),
             WithinAbs(0.905, 0.0005 + 0.905 * 2.5 * rel_se));
  CHECK_THAT(rms(embedding.weight().value()), WithinAbs(0.02, 0.02 * 2.5 * rel_se));

  embedhead::IdMatrix<std::int32_t> all_ids(1, V);
  for (Index v = 0; v < V; ++v) all_ids(0, v) = static_cast<std::int32_t>(v);
  const RowMatrix<Scalar> out = embedding.forward(all_ids);
  CHECK_THAT(static_cast<double>(embedding.scale()), WithinAbs(45.25, 0.005));  // printed to 2 decimals
  CHECK_THAT(rms(out), WithinAbs(0.905, 0.0005 + 0.905 * 2.5 * rel_se));
  // 0.905 * 45.25 = 40.96, printed as "~41".
  CHECK_THAT(std::sqrt(mean_squared_row_norm(out)), WithinAbs(41.0, 0.05 + 41.0 * 2.5 * rel_se));
}

TEMPLATE_TEST_CASE("seed 000 pitfall: sqrt(d) scaling with N(0, 1) init makes input coordinates ~sqrt(d) (16 at d=256)",
                   "[seeds][token_embedding][scale]", float, double) {
  using Scalar = TestType;
  const Index V = 256, d = 256;
  embedhead::TokenEmbeddingOptions options;
  options.init_std = 1.0;  // nn.Embedding's default init
  options.seed = 256;
  options.scale_by_sqrt_d = true;
  const embedhead::TokenEmbedding<Scalar> embedding(V, d, options);
  embedhead::IdMatrix<std::int32_t> all_ids(1, V);
  for (Index v = 0; v < V; ++v) all_ids(0, v) = static_cast<std::int32_t>(v);
  const double rel_se = std::sqrt(2.0 / static_cast<double>(d * V));
  CHECK_THAT(rms(embedding.forward(all_ids)), WithinAbs(16.0, 16.0 * 2.5 * rel_se));
}

TEMPLATE_TEST_CASE("seed 000 exercise 8: a tied model with no blocks predicts the input token at init",
                   "[seeds][output_projection][tied]", float, double) {
  using Scalar = TestType;
  const Index V = 1000, d = 256;
  embedhead::TokenEmbeddingOptions options;  // init_std 0.02
  options.seed = 8;
  embedhead::TokenEmbedding<Scalar> embedding(V, d, options);
  const embedhead::OutputProjection<Scalar> head(embedding);

  // Every token of the vocabulary, then a random batch with repeats.
  embedhead::IdMatrix<std::int32_t> all_ids(1, V);
  for (Index v = 0; v < V; ++v) all_ids(0, v) = static_cast<std::int32_t>(v);
  embedhead::IdMatrix<std::int64_t> batch(4, 32);
  embedhead::Rng rng(88);
  for (Index i = 0; i < batch.size(); ++i)
    batch.data()[i] = static_cast<std::int64_t>(rng.next_bits() % static_cast<std::uint64_t>(V));

  auto predicted_is_input = [&](const auto& ids) {
    const RowMatrix<Scalar> logits = head.forward(embedding.forward(ids));
    Index hits = 0;
    for (Index n = 0; n < logits.rows(); ++n) {
      Index best = 0;
      logits.row(n).maxCoeff(&best);
      if (best == static_cast<Index>(ids.data()[n])) ++hits;
    }
    return hits;
  };
  CHECK(predicted_is_input(all_ids) == V);
  CHECK(predicted_is_input(batch) == batch.size());

  SECTION("why: |E[v]|^2 ~ d sigma^2 = 0.1024 dominates E[v].E[u], mean 0 and spread sqrt(d) sigma^2 = 0.0064") {
    const RowMatrix<Scalar> logits = head.forward(embedding.forward(all_ids));  // = E E^T
    double diagonal = 0, off_sum = 0, off_sum2 = 0;
    for (Index v = 0; v < V; ++v)
      for (Index u = 0; u < V; ++u) {
        const double value = static_cast<double>(logits(v, u));
        if (u == v) {
          diagonal += value;
        } else {
          off_sum += value;
          off_sum2 += value * value;
        }
      }
    const double pairs = static_cast<double>(V * (V - 1));
    // Mean of V squared norms: per-row sd 0.1024 sqrt(2/d) = 0.00905, standard error 0.00029.
    CHECK_THAT(diagonal / static_cast<double>(V), WithinAbs(0.1024, 5 * 0.00905 / std::sqrt(static_cast<double>(V))));
    CHECK_THAT(off_sum / pairs, WithinAbs(0.0, 0.0005));
    CHECK_THAT(std::sqrt(off_sum2 / pairs), WithinRel(0.0064, 0.05));
  }

  SECTION("contrast: an untied head with its own random W does not copy the input (about 1/V hits)") {
    embedhead::OutputProjectionOptions head_options;
    head_options.bias = false;
    const embedhead::OutputProjection<Scalar> untied(V, d, head_options);
    const RowMatrix<Scalar> logits = untied.forward(embedding.forward(all_ids));
    Index hits = 0;
    for (Index n = 0; n < V; ++n) {
      Index best = 0;
      logits.row(n).maxCoeff(&best);
      if (best == n) ++hits;
    }
    CHECK(hits <= 10);  // expected 1 in 1000; 10 is far in the Binomial(1000, 0.001) tail
  }
}

TEST_CASE("seed 000 tying saves V*d + V: V=50, d=32 -> 1650, exercise 3: V=1000, d=256 -> 257,000",
          "[seeds][parameter_count][output_projection]") {
  struct Case {
    Index V, d, saved;
  };
  for (const Case c : {Case{50, 32, 1650}, Case{1000, 256, 257000}}) {
    CAPTURE(c.V, c.d);
    SECTION("real layers, V=" + std::to_string(c.V)) {
      const embedhead::TokenEmbedding<float> embedding(c.V, c.d);
      const embedhead::OutputProjection<float> untied(c.V, c.d);  // bias on by default, as nn.Linear
      const embedhead::OutputProjection<float> tied(embedding);
      // seed 000 pitfall "tied checkpoints do not load into untied models": the untied head has a bias.
      CHECK(untied.has_bias());
      CHECK_FALSE(tied.has_bias());
      auto model = [&](const embedhead::OutputProjection<float>& head) {
        auto params = head.parameters();
        params.push_back(embedding.weight_ptr());
        return embedhead::count_parameters(params);
      };
      CHECK(model(untied) == 2 * c.V * c.d + c.V);
      CHECK(model(tied) == c.V * c.d);  // model.parameters() returns the shared one once
      CHECK(model(untied) - model(tied) == c.saved);
    }
    SECTION("embedding_head_budget, V=" + std::to_string(c.V)) {
      embedhead::EmbeddingHeadShape untied{c.V, c.d, false, true, 0};
      embedhead::EmbeddingHeadShape tied{c.V, c.d, true, false, 0};
      CHECK(embedhead::embedding_head_budget(untied).total() - embedhead::embedding_head_budget(tied).total() ==
            c.saved);
      // Without a head bias the saving is V*d.
      untied.head_bias = false;
      CHECK(embedhead::embedding_head_budget(untied).total() - embedhead::embedding_head_budget(tied).total() ==
            c.V * c.d);
    }
  }
}

TEST_CASE("seed 002 ANDREA-120M: token table 6,488,832 (~5.4%), learned positions 786,432, total 7,275,264 (~6%)",
          "[seeds][parameter_count]") {
  const Index V = 8449, d = 768, T_max = 1024;
  const double model_size = 120e6;

  SECTION("embedding_head_budget (untied head, as ANDREA)") {
    const auto budget = embedhead::embedding_head_budget({V, d, false, false, T_max});
    CHECK(budget.token_embedding == 6488832);
    CHECK(budget.position_embedding == 786432);
    CHECK(budget.token_embedding + budget.position_embedding == 7275264);
    CHECK(budget.head_weight == 6488832);  // the untied head is a second V x d matrix
    CHECK(budget.head_bias == 0);
    CHECK_THAT(100.0 * static_cast<double>(budget.token_embedding) / model_size, WithinAbs(5.4, 0.05));
    CHECK_THAT(100.0 * static_cast<double>(budget.token_embedding + budget.position_embedding) / model_size,
               WithinAbs(6.0, 0.1));
  }

  SECTION("real layers") {
    const embedhead::TokenEmbedding<float> tokens(V, d);
    const embedhead::LearnedPositionEmbedding<float> positions(T_max, d);
    CHECK(tokens.parameter_count() == 6488832);
    CHECK(positions.parameter_count() == 786432);
    CHECK(embedhead::count_parameters<float>({tokens.weight_ptr(), positions.weight_ptr()}) == 7275264);
  }
}

TEST_CASE(
    "seed 000 parameter shares: GPT-1 31.1M (~27%), GPT-2 38.6M (~31%), Gemma 2B 524.3M (~21%), LLaMA 7B 131.1M (~2%)",
    "[seeds][parameter_count]") {
  struct Model {
    const char* name;
    Index V, d;
    double table_millions, model_size, share_percent, share_tolerance;
  };
  const Model models[] = {
      {"GPT-1", 40478, 768, 31.1, 116.5e6, 27, 0.5},
      {"GPT-2 124M", 50257, 768, 38.6, 124e6, 31, 0.5},
      {"Gemma 2B", 256000, 2048, 524.3, 2.5e9, 21, 0.5},
      {"LLaMA 7B (exercise 7: ~131M of ~6.7B)", 32000, 4096, 131.1, 6.7e9, 2, 0.1},
  };
  for (const Model& m : models) {
    INFO(m.name);
    const auto budget = embedhead::embedding_head_budget({m.V, m.d, true, false, 0});
    const double table = static_cast<double>(budget.token_embedding);
    CHECK_THAT(table / 1e6, WithinAbs(m.table_millions, 0.05));
    CHECK_THAT(100.0 * table / m.model_size, WithinAbs(m.share_percent, m.share_tolerance));
  }
  // Exercise 6: the Gemma 2B head costs 2 * d * V ~ 1.05e9 operations per token.
  const auto gemma = embedhead::embedding_head_budget({256000, 2048, true, false, 0});
  CHECK_THAT(2.0 * static_cast<double>(gemma.token_embedding), WithinRel(1.05e9, 0.005));
}

TEMPLATE_TEST_CASE("seed 000 pitfall: an id >= V gives a clear error (PyTorch: 'index out of range in self')",
                   "[seeds][token_embedding][errors]", float, double) {
  using Scalar = TestType;
  embedhead::TokenEmbedding<Scalar> embedding(3, 2);
  set_seed_table(embedding);
  const RowMatrix<Scalar> E = embedding.weight().value();
  const auto bad = id_matrix<std::int32_t>(2, 2, {0, 1, 2, 3});

  REQUIRE_THROWS_AS(embedding.forward(bad), embedhead::index_error);
  REQUIRE_THROWS_AS(embedding.forward(bad), std::out_of_range);
  REQUIRE_THROWS_WITH(embedding.forward(bad), Contains("id 3") && Contains("(b=1, t=1)") && Contains("outside [0, 3)"));
  RowMatrix<Scalar> out = RowMatrix<Scalar>::Constant(4, 2, Scalar(42));
  REQUIRE_THROWS_WITH(embedding.forward(bad, out), Contains("id 3 at (b=1, t=1) outside [0, 3)"));
  CHECK((out.array() == Scalar(42)).all());

  const auto negative = id_matrix<std::int64_t>(1, 2, {-1, 0});
  REQUIRE_THROWS_WITH(embedding.forward(negative), Contains("id -1 at (b=0, t=0) outside [0, 3)"));

  const RowMatrix<Scalar> g = RowMatrix<Scalar>::Ones(4, 2);
  REQUIRE_THROWS_WITH(embedding.backward(bad, g), Contains("TokenEmbedding::backward") && Contains("id 3"));
  CHECK(embedding.weight().grad().num_touched() == 0);
  CHECK(same_values(embedding.weight().value(), E));
}

TEMPLATE_TEST_CASE("seed 000 dropout after embeddings is inverted: x*m/(1-p) in training, identity in eval",
                   "[seeds][dropout]", float, double) {
  using Scalar = TestType;
  const double p = 0.1;
  embedhead::TokenEmbeddingOptions options;
  options.init_std = 1.0;
  const embedhead::TokenEmbedding<Scalar> embedding(50, 40, options);
  embedhead::IdMatrix<std::int32_t> ids(4, 50);
  for (Index i = 0; i < ids.size(); ++i) ids.data()[i] = static_cast<std::int32_t>(i % 50);
  const RowMatrix<Scalar> x = embedding.forward(ids);

  embedhead::Dropout<Scalar> dropout(p, 5);
  const RowMatrix<Scalar> out = dropout.forward(x);
  const Scalar keep_scale = static_cast<Scalar>(1.0 / (1.0 - p));
  Index kept = 0;
  for (Index i = 0; i < x.size(); ++i) {
    const Scalar o = out.data()[i];
    if (o == Scalar(0)) continue;
    ++kept;
    CHECK(o == x.data()[i] * keep_scale);
  }
  // Kept fraction ~ 1 - p; binomial standard error sqrt(p (1 - p) / n).
  const double n = static_cast<double>(x.size());
  CHECK_THAT(static_cast<double>(kept) / n, WithinAbs(1.0 - p, 5 * std::sqrt(p * (1 - p) / n)));

  dropout.eval();
  CHECK(same_values(dropout.forward(x), x));
}

TEMPLATE_TEST_CASE("seed 002 x_t = token_embedding[id_t] + position_embedding[t] (ANDREA ids [256, 1842, 7301])",
                   "[seeds][position_embedding]", float, double) {
  using Scalar = TestType;
  const Index V = 8449, d = 8, T_max = 1024;
  const embedhead::TokenEmbedding<Scalar> tokens(V, d);
  const embedhead::LearnedPositionEmbedding<Scalar> positions(T_max, d);
  const auto ids = id_matrix<std::int32_t>(1, 3, {256, 1842, 7301});
  const RowMatrix<Scalar> x = positions.forward(tokens.forward(ids), 1, 3);
  const auto E = tokens.weight().value();
  const auto P = positions.weight().value();
  for (Index t = 0; t < 3; ++t)
    for (Index j = 0; j < d; ++j) CHECK(x(t, j) == E(ids(0, t), j) + P(t, j));
}

TEMPLATE_TEST_CASE("seed 000/001: init N(0, 0.02) by default (initializer_range), seed 002: 1/sqrt(d_model) on request",
                   "[seeds][init]", float, double) {
  using Scalar = TestType;
  CHECK(embedhead::TokenEmbeddingOptions{}.init_std == 0.02);
  CHECK(embedhead::OutputProjectionOptions{}.init_std == 0.02);
  CHECK(embedhead::LearnedPositionOptions{}.init_std == 0.02);

  const Index V = 1000, d = 64;
  // The sample RMS of n = V*d normals has relative standard error ~ sqrt(1 / (2 n)).
  const double rel_tol = 5 * std::sqrt(0.5 / static_cast<double>(V * d));
  const embedhead::TokenEmbedding<Scalar> tokens(V, d);
  const embedhead::OutputProjection<Scalar> head(V, d);
  const embedhead::LearnedPositionEmbedding<Scalar> positions(V, d);
  CHECK_THAT(rms(tokens.weight().value()), WithinRel(0.02, rel_tol));
  CHECK_THAT(rms(head.weight().value()), WithinRel(0.02, rel_tol));
  CHECK_THAT(rms(positions.weight().value()), WithinRel(0.02, rel_tol));
  // The three tables use different default seeds, so they are not the same draws.
  CHECK_FALSE(same_values(tokens.weight().value(), head.weight().value()));
  CHECK_FALSE(same_values(tokens.weight().value(), positions.weight().value()));

  embedhead::TokenEmbeddingOptions andrea;
  andrea.init_std = 1.0 / std::sqrt(768.0);
  const embedhead::TokenEmbedding<Scalar> scaled_init(V, 768, andrea);
  const double rel_tol_768 = 5 * std::sqrt(0.5 / static_cast<double>(V * 768));
  CHECK_THAT(rms(scaled_init.weight().value()), WithinRel(1.0 / std::sqrt(768.0), rel_tol_768));
}
