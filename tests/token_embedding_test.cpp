// Tests for include/embedhead/token_embedding.hpp: lookup, backward scatter, init and errors.
//
// Must come before any Eigen header in this translation unit: it arms Eigen's runtime allocation
// check used by the "no allocation" test at the end. That check is an eigen_assert, which
// -DNDEBUG (the Release build) would compile away, so asserts are switched back on here.
#undef NDEBUG
#define EIGEN_RUNTIME_NO_MALLOC

#include <embedhead/errors.hpp>
#include <embedhead/init.hpp>
#include <embedhead/token_embedding.hpp>

#include "reference/naive.hpp"
#include "reference/test_support.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::Parameter;
using embedhead::RowMatrix;
using embedhead::TokenEmbedding;
using embedhead::TokenEmbeddingOptions;
using Catch::Matchers::WithinAbs;
using test_support::first_difference;
using test_support::random_ids;
using test_support::random_matrix;

namespace {

// Bitwise equality, so -0 vs +0 or a different rounding anywhere counts as a difference.
template <typename Scalar>
bool bit_identical(const RowMatrix<Scalar>& a, const RowMatrix<Scalar>& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         std::memcmp(a.data(), b.data(), sizeof(Scalar) * static_cast<std::size_t>(a.size())) == 0;
}

template <typename Id, typename IdMatrixT>
IdMatrix<Id> ids_of(const IdMatrixT& m) {
  return m.template cast<Id>();
}

// The sorted distinct ids of a batch, minus padding_idx (-1 for none).
template <typename Id>
std::vector<Index> distinct_ids(const IdMatrix<Id>& ids, Index padding_idx) {
  std::set<Index> s;
  for (Index i = 0; i < ids.size(); ++i)
    if (static_cast<Index>(ids.data()[i]) != padding_idx) s.insert(static_cast<Index>(ids.data()[i]));
  return {s.begin(), s.end()};
}

// A TokenEmbedding over a table filled with random values in [-1, 1] (so rows are distinct and
// neither 0 nor 1 hides a missing or doubled multiply).
template <typename Scalar>
TokenEmbedding<Scalar> random_embedding(std::mt19937_64& gen, Index V, Index d, TokenEmbeddingOptions options = {}) {
  auto weight = std::make_shared<Parameter<Scalar>>(V, d, "E");
  weight->value() = random_matrix<Scalar>(V, d, gen());
  return TokenEmbedding<Scalar>(weight, options);
}

struct Size {
  Index V, d, B, T;
};

// Edge sizes (V = 1, d = 1, single tokens), packet widths +-1 for float and double (SSE/AVX:
// 2, 4, 8, 16 lanes) and a large vocabulary with a small width.
const Size kSizes[] = {{1, 1, 1, 1},   {1, 5, 2, 3},  {5, 1, 3, 4},   {3, 2, 1, 1},      {6, 3, 4, 16},
                       {10, 7, 2, 5},  {10, 8, 3, 3}, {10, 9, 1, 9},  {40, 15, 2, 4},    {40, 16, 4, 2},
                       {40, 17, 3, 3}, {2, 4, 5, 7},  {50, 32, 2, 8}, {100000, 3, 2, 5}, {100000, 1, 1, 3}};

// Runs `check(V, d, B, T)` over kSizes and some random sizes.
template <typename Check>
void for_each_size(std::mt19937_64& gen, Check check) {
  for (const Size& s : kSizes) check(s.V, s.d, s.B, s.T);
  std::uniform_int_distribution<Index> V_dist(1, 300), d_dist(1, 40), BT_dist(1, 6);
  for (int i = 0; i < 20; ++i) check(V_dist(gen), d_dist(gen), BT_dist(gen), BT_dist(gen));
}

}  // namespace

TEMPLATE_TEST_CASE("TokenEmbedding forward: the gather equals one_hot(ids) * E", "[token_embedding][forward]", float,
                   double) {
  using Scalar = TestType;

  SECTION("worked example: one-hot(1) * E = [0.3, -0.1]") {
    auto weight = std::make_shared<Parameter<Scalar>>(3, 2);
    weight->value() << Scalar(0.1), Scalar(0.2), Scalar(0.3), Scalar(-0.1), Scalar(0.0), Scalar(0.5);
    const TokenEmbedding<Scalar> emb(weight);
    IdMatrix<std::int32_t> ids(1, 1);
    ids << 1;
    const RowMatrix<Scalar> out = emb.forward(ids);
    REQUIRE(out.rows() == 1);
    REQUIRE(out.cols() == 2);
    CHECK(out(0, 0) == Scalar(0.3));
    CHECK(out(0, 1) == Scalar(-0.1));
    // A batch [B, T] = [2, 2] lands in row b*T + t.
    IdMatrix<std::int64_t> batch(2, 2);
    batch << 2, 0, 1, 2;
    RowMatrix<Scalar> expected(4, 2);
    expected << Scalar(0.0), Scalar(0.5), Scalar(0.1), Scalar(0.2), Scalar(0.3), Scalar(-0.1), Scalar(0.0), Scalar(0.5);
    CHECK(first_difference(emb.forward(batch), expected) == "");
  }

  SECTION("naive reference: exactly one_hot * E, int32 and int64 ids, both overloads") {
    std::mt19937_64 gen(11);
    for_each_size(gen, [&](Index V, Index d, Index B, Index T) {
      INFO("V = " << V << ", d = " << d << ", B = " << B << ", T = " << T);
      const TokenEmbedding<Scalar> emb = random_embedding<Scalar>(gen, V, d);
      REQUIRE(emb.scale() == Scalar(1));
      const IdMatrix<std::int64_t> ids64 = random_ids<std::int64_t>(B, T, V, gen());
      const IdMatrix<std::int32_t> ids32 = ids_of<std::int32_t>(ids64);
      const RowMatrix<Scalar> E = emb.weight().value();
      const RowMatrix<Scalar> expected = naive::one_hot_lookup<Scalar>(ids64, E);

      REQUIRE(first_difference(emb.forward(ids32), expected) == "");
      REQUIRE(first_difference(emb.forward(ids64), expected) == "");
      RowMatrix<Scalar> out = RowMatrix<Scalar>::Constant(B * T, d, Scalar(42));
      emb.forward(ids32, out);
      REQUIRE(first_difference(out, expected) == "");
      out.setConstant(Scalar(42));
      emb.forward(ids64, out);
      REQUIRE(first_difference(out, expected) == "");
      // The free kernel, as the layer uses it.
      out.setConstant(Scalar(42));
      embedhead::embedding_forward<Scalar>(E, ids32, Scalar(1), out);
      REQUIRE(first_difference(out, expected) == "");
    });
  }

  SECTION("scale_by_sqrt_d: exactly one_hot * (s * E), s = Scalar(sqrt(d))") {
    std::mt19937_64 gen(12);
    TokenEmbeddingOptions options;
    options.scale_by_sqrt_d = true;
    for_each_size(gen, [&](Index V, Index d, Index B, Index T) {
      INFO("V = " << V << ", d = " << d << ", B = " << B << ", T = " << T);
      const TokenEmbedding<Scalar> emb = random_embedding<Scalar>(gen, V, d, options);
      const auto s = static_cast<Scalar>(std::sqrt(static_cast<double>(d)));
      REQUIRE(emb.scale() == s);
      const IdMatrix<std::int32_t> ids = random_ids<std::int32_t>(B, T, V, gen());
      const RowMatrix<Scalar> scaled_E = s * emb.weight().value();
      const RowMatrix<Scalar> expected = naive::one_hot_lookup<Scalar>(ids, scaled_E);
      REQUIRE(first_difference(emb.forward(ids), expected) == "");
      RowMatrix<Scalar> out(B * T, d);
      emb.forward(ids_of<std::int64_t>(ids), out);
      REQUIRE(first_difference(out, expected) == "");
    });
  }

  SECTION("scale(): sqrt(d) cast to Scalar when on, 1 when off") {
    TokenEmbeddingOptions on;
    on.scale_by_sqrt_d = true;
    // The seeds: sqrt(2048) = 45.254833995939045..., cast to the table's type first.
    CHECK(TokenEmbedding<Scalar>(1, 2048, on).scale() == static_cast<Scalar>(45.254833995939045));
    CHECK(TokenEmbedding<Scalar>(1, 4, on).scale() == Scalar(2));
    CHECK(TokenEmbedding<Scalar>(1, 1, on).scale() == Scalar(1));
    CHECK(TokenEmbedding<Scalar>(1, 2048).scale() == Scalar(1));
    CHECK(TokenEmbedding<Scalar>(3, 7).scale() == Scalar(1));
  }

  SECTION("out may be a block of a larger matrix (strided view)") {
    std::mt19937_64 gen(13);
    const TokenEmbedding<Scalar> emb = random_embedding<Scalar>(gen, 6, 3);
    IdMatrix<std::int32_t> ids(2, 2);
    ids << 5, 0, 0, 3;
    RowMatrix<Scalar> big = RowMatrix<Scalar>::Constant(6, 5, Scalar(-9));
    emb.forward(ids, big.block(1, 1, 4, 3));
    const RowMatrix<Scalar> expected = naive::one_hot_lookup<Scalar>(ids, RowMatrix<Scalar>(emb.weight().value()));
    CHECK(first_difference(RowMatrix<Scalar>(big.block(1, 1, 4, 3)), expected) == "");
    big.block(1, 1, 4, 3).setConstant(Scalar(-9));
    CHECK(big == RowMatrix<Scalar>::Constant(6, 5, Scalar(-9)));  // nothing outside the block
  }
}

TEMPLATE_TEST_CASE("TokenEmbedding backward: dE += s * one_hot(ids)^T * dout", "[token_embedding][backward]", float,
                   double) {
  using Scalar = TestType;

  SECTION("worked example: V=5, d=3, x=[[1,3,1]], L = sum(out)") {
    TokenEmbedding<Scalar> emb(5, 3);
    IdMatrix<std::int32_t> ids(1, 3);
    ids << 1, 3, 1;
    emb.backward(ids, RowMatrix<Scalar>::Ones(3, 3));
    RowMatrix<Scalar> expected = RowMatrix<Scalar>::Zero(5, 3);
    expected.row(1) << Scalar(2), Scalar(2), Scalar(2);
    expected.row(3) << Scalar(1), Scalar(1), Scalar(1);
    CHECK(first_difference(emb.weight().grad().to_dense(), expected) == "");
    CHECK(emb.weight().grad().touched_rows() == std::vector<Index>{1, 3});
  }

  SECTION("worked example (exercise): batch [[5,2,5],[2,7,5]], L = sum(out)") {
    const Index d = 4;
    TokenEmbedding<Scalar> emb(8, d);
    IdMatrix<std::int64_t> ids(2, 3);
    ids << 5, 2, 5, 2, 7, 5;
    emb.backward(ids, RowMatrix<Scalar>::Ones(6, d));
    RowMatrix<Scalar> expected = RowMatrix<Scalar>::Zero(8, d);
    expected.row(2).setConstant(Scalar(2));
    expected.row(5).setConstant(Scalar(3));
    expected.row(7).setConstant(Scalar(1));
    CHECK(first_difference(emb.weight().grad().to_dense(), expected) == "");
    CHECK(emb.weight().grad().touched_rows() == std::vector<Index>{2, 5, 7});
  }

  SECTION("hand-derived: the scale multiplies the gradient (d = 4, s = 2)") {
    TokenEmbeddingOptions options;
    options.scale_by_sqrt_d = true;
    TokenEmbedding<Scalar> emb(3, 4, options);
    IdMatrix<std::int32_t> ids(1, 2);
    ids << 0, 0;
    RowMatrix<Scalar> dout(2, 4);
    dout << Scalar(1), Scalar(-1), Scalar(0.5), Scalar(0), Scalar(0.25), Scalar(2), Scalar(-3), Scalar(1);
    emb.backward(ids, dout);
    RowMatrix<Scalar> expected = RowMatrix<Scalar>::Zero(3, 4);
    expected.row(0) << Scalar(2.5), Scalar(2), Scalar(-5), Scalar(2);  // 2 * (dout[0] + dout[1])
    CHECK(first_difference(emb.weight().grad().to_dense(), expected) == "");
  }

  SECTION("naive reference: bit-exact dense scatter, touched rows, padding, scale, int32/int64") {
    std::mt19937_64 gen(21);
    for (const bool scaled : {false, true}) {
      for (const bool padded : {false, true}) {
        for_each_size(gen, [&](Index V, Index d, Index B, Index T) {
          // A small vocabulary relative to B*T forces many repeated ids.
          INFO("V = " << V << ", d = " << d << ", B = " << B << ", T = " << T << ", scaled " << scaled << ", padded "
                      << padded);
          TokenEmbeddingOptions options;
          options.scale_by_sqrt_d = scaled;
          std::uniform_int_distribution<Index> pad_dist(0, V - 1);
          const Index padding_idx = padded ? pad_dist(gen) : -1;
          if (padded) options.padding_idx = padding_idx;
          TokenEmbedding<Scalar> emb = random_embedding<Scalar>(gen, V, d, options);
          const IdMatrix<std::int64_t> ids64 = random_ids<std::int64_t>(B, T, V, gen());
          const RowMatrix<Scalar> dout = random_matrix<Scalar>(B * T, d, gen());

          RowMatrix<Scalar> expected = RowMatrix<Scalar>::Zero(V, d);
          naive::embedding_backward_dense<Scalar>(ids64, dout, emb.scale(), padding_idx, expected);

          emb.backward(ids64, dout);
          const auto& grad = emb.weight().grad();
          REQUIRE(first_difference(grad.to_dense(), expected) == "");
          REQUIRE(grad.touched_rows() == distinct_ids(ids64, padding_idx));
          REQUIRE_FALSE(grad.is_dense());
          if (padded) REQUIRE(grad.to_dense().row(padding_idx).isZero(0));

          // The int32 overload gives the same bits.
          emb.zero_grad();
          emb.backward(ids_of<std::int32_t>(ids64), dout);
          REQUIRE(first_difference(emb.weight().grad().to_dense(), expected) == "");
        });
      }
    }
  }

  SECTION("untouched rows are exactly zero; repeats sum") {
    const Index V = 10, d = 9;
    TokenEmbedding<Scalar> emb(V, d);
    IdMatrix<std::int32_t> ids(2, 4);
    ids << 3, 3, 8, 3, 8, 3, 0, 3;
    RowMatrix<Scalar> dout(8, d);
    for (Index n = 0; n < 8; ++n) dout.row(n).setConstant(Scalar(n + 1));
    emb.backward(ids, dout);
    const RowMatrix<Scalar> g = emb.weight().grad().to_dense();
    for (Index v : {1, 2, 4, 5, 6, 7, 9}) CHECK(g.row(v).isZero(0));
    CHECK(g.row(3) == RowMatrix<Scalar>::Constant(1, d, Scalar(1 + 2 + 4 + 6 + 8)));
    CHECK(g.row(8) == RowMatrix<Scalar>::Constant(1, d, Scalar(3 + 5)));
    CHECK(g.row(0) == RowMatrix<Scalar>::Constant(1, d, Scalar(7)));
  }

  SECTION("padding_idx: initialised to zero, no gradient, not touched") {
    TokenEmbeddingOptions options;
    options.padding_idx = 2;
    options.seed = 17;
    TokenEmbedding<Scalar> emb(6, 5, options);
    CHECK(emb.weight().value().row(2).isZero(0));
    // The other rows are the unpadded table's: padding does not shift the random stream.
    TokenEmbeddingOptions unpadded;
    unpadded.seed = 17;
    const TokenEmbedding<Scalar> plain(6, 5, unpadded);
    for (Index v : {0, 1, 3, 4, 5}) CHECK(emb.weight().value().row(v) == plain.weight().value().row(v));

    IdMatrix<std::int32_t> ids(2, 3);
    ids << 2, 4, 2, 2, 2, 1;
    emb.backward(ids, RowMatrix<Scalar>::Ones(6, 5));
    CHECK(emb.weight().grad().touched_rows() == std::vector<Index>{1, 4});
    RowMatrix<Scalar> expected = RowMatrix<Scalar>::Zero(6, 5);
    expected.row(1).setOnes();
    expected.row(4).setOnes();
    CHECK(first_difference(emb.weight().grad().to_dense(), expected) == "");

    // A batch of padding only touches nothing.
    emb.zero_grad();
    const IdMatrix<std::int32_t> all_padding = IdMatrix<std::int32_t>::Constant(2, 2, 2);
    emb.backward(all_padding, RowMatrix<Scalar>::Ones(4, 5));
    CHECK(emb.weight().grad().num_touched() == 0);
    // The forward still reads the (zero) padding row.
    CHECK(emb.forward(all_padding).isZero(0));
  }

  SECTION("two backward calls accumulate (+=), as the sequential naive loop over both batches") {
    std::mt19937_64 gen(23);
    const Index V = 12, d = 16;
    TokenEmbeddingOptions options;
    options.scale_by_sqrt_d = true;
    TokenEmbedding<Scalar> emb = random_embedding<Scalar>(gen, V, d, options);
    const IdMatrix<std::int32_t> first = random_ids<std::int32_t>(3, 5, V, gen());
    const IdMatrix<std::int32_t> second = random_ids<std::int32_t>(2, 7, V / 2, gen());  // adds some new rows
    const RowMatrix<Scalar> dout1 = random_matrix<Scalar>(15, d, gen()), dout2 = random_matrix<Scalar>(14, d, gen());
    RowMatrix<Scalar> expected = RowMatrix<Scalar>::Zero(V, d);
    naive::embedding_backward_dense<Scalar>(first, dout1, emb.scale(), -1, expected);
    naive::embedding_backward_dense<Scalar>(second, dout2, emb.scale(), -1, expected);
    emb.backward(first, dout1);
    emb.backward(second, dout2);
    CHECK(first_difference(emb.weight().grad().to_dense(), expected) == "");
    std::set<Index> both;
    for (Index i = 0; i < first.size(); ++i) both.insert(first.data()[i]);
    for (Index i = 0; i < second.size(); ++i) both.insert(second.data()[i]);
    CHECK(emb.weight().grad().touched_rows() == std::vector<Index>(both.begin(), both.end()));
    // zero_grad then the second batch alone: nothing of the first remains.
    emb.zero_grad();
    emb.backward(second, dout2);
    RowMatrix<Scalar> second_only = RowMatrix<Scalar>::Zero(V, d);
    naive::embedding_backward_dense<Scalar>(second, dout2, emb.scale(), -1, second_only);
    CHECK(first_difference(emb.weight().grad().to_dense(), second_only) == "");
  }

  SECTION("determinism: the same backward twice gives bit-identical gradients") {
    std::mt19937_64 gen(29);
    const Index V = 37, d = 17;
    const IdMatrix<std::int32_t> ids = random_ids<std::int32_t>(16, 256, V, gen());  // ~110 repeats per id
    const RowMatrix<Scalar> dout = random_matrix<Scalar>(ids.size(), d, gen());
    TokenEmbedding<Scalar> a(V, d), b(V, d);
    a.backward(ids, dout);
    b.backward(ids, dout);
    CHECK(bit_identical(a.weight().grad().to_dense(), b.weight().grad().to_dense()));
    const RowMatrix<Scalar> first = a.weight().grad().to_dense();
    a.zero_grad();
    a.backward(ids, dout);
    CHECK(bit_identical(a.weight().grad().to_dense(), first));
  }

  SECTION("a dense gradient (e.g. from a tied head) receives the scatter in place") {
    std::mt19937_64 gen(31);
    const Index V = 7, d = 8;
    TokenEmbedding<Scalar> emb = random_embedding<Scalar>(gen, V, d);
    const RowMatrix<Scalar> head_part = random_matrix<Scalar>(V, d, gen());
    emb.weight().grad().dense_accumulator() += head_part;
    const IdMatrix<std::int32_t> ids = random_ids<std::int32_t>(2, 6, V, gen());
    const RowMatrix<Scalar> dout = random_matrix<Scalar>(12, d, gen());
    RowMatrix<Scalar> expected = head_part;
    naive::embedding_backward_dense<Scalar>(ids, dout, Scalar(1), -1, expected);
    emb.backward(ids, dout);
    CHECK(emb.weight().grad().is_dense());
    CHECK(first_difference(emb.weight().grad().to_dense(), expected) == "");
  }
}

TEST_CASE("TokenEmbedding backward: central finite differences of L = sum(W o forward(ids))",
          "[token_embedding][gradient_check]") {
  std::mt19937_64 gen(37);
  const Index V = 6, d = 5;
  IdMatrix<std::int32_t> ids(2, 4);
  ids << 1, 4, 1, 0, 3, 1, 4, 3;  // repeats: 1 three times, 4 and 3 twice; rows 2 and 5 absent
  const RowMatrix<double> W = random_matrix<double>(8, d, gen());

  for (const bool scaled : {false, true}) {
    for (const Index padding_idx : {Index(-1), Index(4)}) {
      INFO("scaled " << scaled << ", padding_idx " << padding_idx);
      TokenEmbeddingOptions options;
      options.scale_by_sqrt_d = scaled;
      if (padding_idx >= 0) options.padding_idx = padding_idx;
      TokenEmbedding<double> emb = random_embedding<double>(gen, V, d, options);

      // Analytic: dL/d out = W, so one backward with dout = W.
      emb.backward(ids, W);
      const RowMatrix<double> analytic = emb.weight().grad().to_dense();

      RowMatrix<double> E = emb.weight().value();
      const auto loss = [&] {
        emb.weight().value() = E;
        return (W.array() * emb.forward(ids).array()).sum();
      };
      const RowMatrix<double> numeric = naive::numerical_gradient(E, loss);
      emb.weight().value() = E;

      // The padding row is read by the forward but deliberately gets no gradient, so it is
      // compared with zero, not with the finite difference.
      RowMatrix<double> analytic_rest = analytic, numeric_rest = numeric;
      if (padding_idx >= 0) {
        CHECK(analytic.row(padding_idx).isZero(0));
        CHECK_FALSE(numeric.row(padding_idx).isZero(1e-3));  // it does affect the loss
        analytic_rest.row(padding_idx).setZero();
        numeric_rest.row(padding_idx).setZero();
      }
      CHECK(naive::max_relative_error(analytic_rest, numeric_rest) < 1e-6);
      // Absent rows: exactly zero analytically, ~0 numerically.
      for (Index v : {2, 5}) {
        CHECK(analytic.row(v).isZero(0));
        CHECK(numeric.row(v).cwiseAbs().maxCoeff() < 1e-8);
      }
    }
  }
}

TEMPLATE_TEST_CASE("TokenEmbedding init: N(0, init_std^2) from Rng(seed)", "[token_embedding][init]", float, double) {
  using Scalar = TestType;

  SECTION("reproducible: same seed, same table; different seed, different table") {
    TokenEmbeddingOptions options;
    options.seed = 123;
    const TokenEmbedding<Scalar> a(50, 16, options), b(50, 16, options);
    CHECK(a.weight().value() == b.weight().value());
    options.seed = 124;
    const TokenEmbedding<Scalar> c(50, 16, options);
    Index equal = 0;
    for (Index i = 0; i < a.weight().size(); ++i)
      equal += a.weight().value().data()[i] == c.weight().value().data()[i] ? 1 : 0;
    CHECK(equal == 0);
    // The documented stream: init_normal with Rng(seed) from counter 0.
    RowMatrix<Scalar> from_rng(50, 16);
    embedhead::Rng rng(123);
    embedhead::init_normal<Scalar>(from_rng, 0.02, rng);
    CHECK(a.weight().value() == from_rng);
  }

  SECTION("a large table has mean 0 and std init_std") {
    for (const double sigma : {0.02, 1.0 / std::sqrt(512.0)}) {
      INFO("init_std " << sigma);
      TokenEmbeddingOptions options;
      options.init_std = sigma;
      options.seed = 2;
      const TokenEmbedding<Scalar> emb(2000, 128, options);
      const RowMatrix<double> E = emb.weight().value().template cast<double>();
      const double n = static_cast<double>(E.size());
      const double mean = E.mean();
      const double sample_std = std::sqrt((E.array() - mean).square().sum() / (n - 1));
      // sd of the sample mean: sigma/sqrt(n); of the sample std: ~sigma/sqrt(2n).
      CHECK_THAT(mean, WithinAbs(0.0, 6.0 * sigma / std::sqrt(n)));
      CHECK_THAT(sample_std, WithinAbs(sigma, 6.0 * sigma / std::sqrt(2.0 * n)));
    }
  }

  SECTION("shape, names, sharing") {
    const TokenEmbedding<Scalar> emb(11, 6);
    CHECK(emb.vocab_size() == 11);
    CHECK(emb.dim() == 6);
    CHECK(emb.parameter_count() == 66);
    CHECK(emb.weight().rows() == 11);
    CHECK(emb.weight().cols() == 6);
    CHECK(emb.weight().name() == "token_embedding.weight");
    CHECK(emb.weight_ptr().get() == &emb.weight());
    CHECK(emb.options().init_std == 0.02);

    auto shared = std::make_shared<Parameter<Scalar>>(4, 3, "loaded");
    shared->value().setConstant(Scalar(0.5));
    TokenEmbedding<Scalar> wrapped(shared);
    CHECK(wrapped.weight_ptr() == shared);
    CHECK(wrapped.vocab_size() == 4);
    CHECK(wrapped.dim() == 3);
    CHECK(wrapped.weight().value() == RowMatrix<Scalar>::Constant(4, 3, Scalar(0.5)));  // not re-initialised
    // Gradients go to the shared parameter.
    IdMatrix<std::int32_t> ids(1, 1);
    ids << 2;
    wrapped.backward(ids, RowMatrix<Scalar>::Ones(1, 3));
    CHECK(shared->grad().touched_rows() == std::vector<Index>{2});
  }
}

TEMPLATE_TEST_CASE("TokenEmbedding errors: clear messages, nothing changed", "[token_embedding][errors]", float,
                   double) {
  using Scalar = TestType;
  const Index V = 5, d = 4;
  TokenEmbeddingOptions options;
  options.seed = 9;
  TokenEmbedding<Scalar> emb(V, d, options);
  // Some gradient already present, so "unchanged" means more than "still empty".
  {
    IdMatrix<std::int32_t> ids(1, 3);
    ids << 4, 1, 4;
    emb.backward(ids, RowMatrix<Scalar>::Constant(3, d, Scalar(0.5)));
  }
  const RowMatrix<Scalar> value_before = emb.weight().value();
  const std::vector<Index> touched_before = emb.weight().grad().touched_rows();
  const RowMatrix<Scalar> grad_before = emb.weight().grad().to_dense();
  const auto check_unchanged = [&] {
    CHECK(emb.weight().value() == value_before);
    CHECK(emb.weight().grad().touched_rows() == touched_before);
    CHECK(first_difference(emb.weight().grad().to_dense(), grad_before) == "");
  };
  const RowMatrix<Scalar> sentinel = RowMatrix<Scalar>::Constant(6, d, Scalar(-3));
  RowMatrix<Scalar> out = sentinel;
  const RowMatrix<Scalar> dout = RowMatrix<Scalar>::Ones(6, d);

  SECTION("id == V") {
    IdMatrix<std::int32_t> ids(2, 3);
    ids << 0, 1, 2, 3, 4, 5;
    const auto message = Catch::Contains("id 5 at (b=1, t=2) outside [0, 5)");
    REQUIRE_THROWS_AS(emb.forward(ids), embedhead::index_error);
    REQUIRE_THROWS_AS(emb.forward(ids), std::out_of_range);
    REQUIRE_THROWS_WITH(emb.forward(ids), Catch::Contains("TokenEmbedding::forward") && message);
    REQUIRE_THROWS_AS(emb.forward(ids, out), embedhead::index_error);
    REQUIRE_THROWS_WITH(emb.forward(ids, out), message);
    CHECK(out == sentinel);
    REQUIRE_THROWS_AS(emb.backward(ids, dout), embedhead::index_error);
    REQUIRE_THROWS_WITH(emb.backward(ids, dout), Catch::Contains("TokenEmbedding::backward") && message);
    check_unchanged();
  }

  SECTION("negative id; the first bad id in row-major order is reported") {
    IdMatrix<std::int64_t> ids(2, 3);
    ids << 0, -1, 9, -4, 1, 2;
    const auto message = Catch::Contains("id -1 at (b=0, t=1) outside [0, 5)");
    REQUIRE_THROWS_AS(emb.forward(ids), embedhead::index_error);
    REQUIRE_THROWS_WITH(emb.forward(ids), message);
    REQUIRE_THROWS_WITH(emb.forward(ids, out), message);
    CHECK(out == sentinel);
    REQUIRE_THROWS_AS(emb.backward(ids, dout), embedhead::index_error);
    REQUIRE_THROWS_WITH(emb.backward(ids, dout), message);
    check_unchanged();
  }

  SECTION("int64 ids beyond the int32 range are rejected, not truncated") {
    // 2^32 + 1 would become the valid id 1 if narrowed to 32 bits; -2^32 would become 0.
    IdMatrix<std::int64_t> ids(2, 3);
    ids << 0, 1, 2, 4294967297LL, 3, 4;
    const auto message = Catch::Contains("id 4294967297 at (b=1, t=0) outside [0, 5)");
    REQUIRE_THROWS_AS(emb.forward(ids), embedhead::index_error);
    REQUIRE_THROWS_WITH(emb.forward(ids), message);
    REQUIRE_THROWS_WITH(emb.forward(ids, out), message);
    CHECK(out == sentinel);
    REQUIRE_THROWS_WITH(emb.backward(ids, dout), message);
    ids(1, 0) = -4294967296LL;
    REQUIRE_THROWS_WITH(emb.backward(ids, dout), Catch::Contains("id -4294967296 at (b=1, t=0) outside [0, 5)"));
    ids(1, 0) = std::numeric_limits<std::int64_t>::max();
    REQUIRE_THROWS_WITH(emb.forward(ids, out), Catch::Contains("id 9223372036854775807 at (b=1, t=0)"));
    CHECK(out == sentinel);
    check_unchanged();
  }

  SECTION("out with the wrong shape") {
    IdMatrix<std::int32_t> ids(2, 3);
    ids << 0, 1, 2, 3, 4, 0;
    RowMatrix<Scalar> too_few_rows = RowMatrix<Scalar>::Constant(5, d, Scalar(-3));
    REQUIRE_THROWS_AS(emb.forward(ids, too_few_rows), embedhead::shape_error);
    REQUIRE_THROWS_AS(emb.forward(ids, too_few_rows), std::invalid_argument);
    REQUIRE_THROWS_WITH(emb.forward(ids, too_few_rows), Catch::Contains("TokenEmbedding::forward") &&
                                                            Catch::Contains("out has shape [5, 4], expected [6, 4]"));
    CHECK(too_few_rows == RowMatrix<Scalar>::Constant(5, d, Scalar(-3)));
    RowMatrix<Scalar> wrong_width = RowMatrix<Scalar>::Constant(6, d + 1, Scalar(-3));
    REQUIRE_THROWS_WITH(emb.forward(ids, wrong_width), Catch::Contains("out has shape [6, 5], expected [6, 4]"));
    CHECK(wrong_width == RowMatrix<Scalar>::Constant(6, d + 1, Scalar(-3)));
    check_unchanged();
  }

  SECTION("dout with the wrong shape in backward") {
    IdMatrix<std::int32_t> ids(2, 3);
    ids << 0, 1, 2, 3, 4, 0;
    REQUIRE_THROWS_AS(emb.backward(ids, RowMatrix<Scalar>::Ones(6, 3)), embedhead::shape_error);
    REQUIRE_THROWS_WITH(emb.backward(ids, RowMatrix<Scalar>::Ones(6, 3)),
                        Catch::Contains("TokenEmbedding::backward") &&
                            Catch::Contains("dout has shape [6, 3], expected [6, 4]"));
    REQUIRE_THROWS_WITH(emb.backward(ids, RowMatrix<Scalar>::Ones(3, 4)),
                        Catch::Contains("dout has shape [3, 4], expected [6, 4]"));
    check_unchanged();
  }

  SECTION("V or d < 1") {
    REQUIRE_THROWS_AS(TokenEmbedding<Scalar>(0, 4), embedhead::value_error);
    REQUIRE_THROWS_WITH(TokenEmbedding<Scalar>(0, 4),
                        Catch::Contains("TokenEmbedding") && Catch::Contains("V = 0 outside [1, inf)"));
    REQUIRE_THROWS_WITH(TokenEmbedding<Scalar>(-3, 4), Catch::Contains("V = -3 outside [1, inf)"));
    REQUIRE_THROWS_AS(TokenEmbedding<Scalar>(4, 0), embedhead::value_error);
    REQUIRE_THROWS_WITH(TokenEmbedding<Scalar>(4, 0), Catch::Contains("d = 0 outside [1, inf)"));
  }

  SECTION("init_std <= 0, NaN or infinite") {
    struct Case {
      double std;
      const char* printed;
    };
    const Case cases[] = {{0.0, "init_std = 0 "},
                          {-0.02, "init_std = -0.02 "},
                          {std::numeric_limits<double>::quiet_NaN(), "init_std = nan "},
                          {std::numeric_limits<double>::infinity(), "init_std = inf "}};
    for (const Case& bad : cases) {
      INFO("init_std " << bad.std);
      TokenEmbeddingOptions o;
      o.init_std = bad.std;
      REQUIRE_THROWS_AS(TokenEmbedding<Scalar>(5, 4, o), embedhead::value_error);
      REQUIRE_THROWS_WITH(TokenEmbedding<Scalar>(5, 4, o),
                          Catch::Contains(bad.printed) && Catch::Contains("outside (0, inf)"));
    }
  }

  SECTION("padding_idx outside [0, V)") {
    for (const Index bad : {Index(5), Index(-1), Index(100)}) {
      TokenEmbeddingOptions o;
      o.padding_idx = bad;
      const std::string printed = "padding_idx " + std::to_string(bad) + " outside [0, 5)";
      REQUIRE_THROWS_AS(TokenEmbedding<Scalar>(5, 4, o), embedhead::index_error);
      REQUIRE_THROWS_WITH(TokenEmbedding<Scalar>(5, 4, o), Catch::Contains(printed));
      auto weight = std::make_shared<Parameter<Scalar>>(5, 4);
      REQUIRE_THROWS_AS(TokenEmbedding<Scalar>(weight, o), embedhead::index_error);
      REQUIRE_THROWS_WITH(TokenEmbedding<Scalar>(weight, o), Catch::Contains(printed));
    }
  }

  SECTION("a null parameter") {
    REQUIRE_THROWS_AS(TokenEmbedding<Scalar>(std::shared_ptr<Parameter<Scalar>>()), embedhead::value_error);
    REQUIRE_THROWS_WITH(TokenEmbedding<Scalar>(std::shared_ptr<Parameter<Scalar>>()),
                        Catch::Contains("TokenEmbedding") && Catch::Contains("null"));
  }
}

namespace {
// Disallows Eigen heap allocation for its lifetime; restores it even if the body throws.
struct NoEigenMalloc {
  NoEigenMalloc() { Eigen::internal::set_is_malloc_allowed(false); }
  ~NoEigenMalloc() { Eigen::internal::set_is_malloc_allowed(true); }
  NoEigenMalloc(const NoEigenMalloc&) = delete;
  NoEigenMalloc& operator=(const NoEigenMalloc&) = delete;
};
}  // namespace

#ifndef EIGEN_RUNTIME_NO_MALLOC
#error "EIGEN_RUNTIME_NO_MALLOC must be defined before Eigen is included"
#endif

TEMPLATE_TEST_CASE("TokenEmbedding: the output-argument overloads do not allocate", "[token_embedding][nomalloc]",
                   float, double) {
  // An Eigen allocation while disallowed fails an eigen_assert (abort, reported by Catch as a
  // fatal SIGABRT in this test).
  using Scalar = TestType;
  std::mt19937_64 gen(41);
  const Index V = 30, d = 9, B = 3, T = 7;
  TokenEmbeddingOptions scaled;
  scaled.scale_by_sqrt_d = true;
  for (const TokenEmbeddingOptions& options : {TokenEmbeddingOptions{}, scaled}) {
    TokenEmbedding<Scalar> emb = random_embedding<Scalar>(gen, V, d, options);
    const IdMatrix<std::int32_t> ids32 = random_ids<std::int32_t>(B, T, V, gen());
    const IdMatrix<std::int64_t> ids64 = ids_of<std::int64_t>(ids32);
    const RowMatrix<Scalar> dout = random_matrix<Scalar>(B * T, d, gen());
    RowMatrix<Scalar> out32(B * T, d), out64(B * T, d);
    RowMatrix<Scalar> wide = RowMatrix<Scalar>::Zero(B * T, d + 3);

    {
      const NoEigenMalloc guard;
      emb.forward(ids32, out32);
      emb.forward(ids64, out64);
      emb.forward(ids32, wide.leftCols(d));  // a strided destination binds without a copy too
    }
    const RowMatrix<Scalar> scaled_E = emb.scale() * emb.weight().value();
    const RowMatrix<Scalar> expected = naive::one_hot_lookup<Scalar>(ids32, scaled_E);
    CHECK(first_difference(out32, expected) == "");
    CHECK(first_difference(out64, expected) == "");
    CHECK(first_difference(RowMatrix<Scalar>(wide.leftCols(d)), expected) == "");

    emb.backward(ids32, dout);  // may grow the workspace and the gradient block
    {
      const NoEigenMalloc guard;
      emb.backward(ids32, dout);  // same ids: rows exist, nothing grows
      emb.backward(ids64, dout);
      emb.zero_grad();
      emb.backward(ids32, dout);  // after zero_grad the block's capacity is reused
    }
    RowMatrix<Scalar> expected_grad = RowMatrix<Scalar>::Zero(V, d);
    naive::embedding_backward_dense<Scalar>(ids32, dout, emb.scale(), -1, expected_grad);
    CHECK(first_difference(emb.weight().grad().to_dense(), expected_grad) == "");
  }
}

TEMPLATE_TEST_CASE("TokenEmbedding backward: reused and merged gradient rows never leak stale values",
                   "[token_embedding][backward]", float, double) {
  // The sparse gradient keeps its block of rows across zero_grad and writes a new row's first
  // token instead of adding it to zeros. A row reused after zero_grad, or shifted by a merge,
  // must therefore come out exactly as the naive dense accumulation of the current step.
  using Scalar = TestType;
  std::mt19937_64 gen(2024);
  const Index V = 64, d = 9;
  for (const Scalar scale_on : {Scalar(0), Scalar(1)}) {
    TokenEmbeddingOptions options;
    options.scale_by_sqrt_d = scale_on != Scalar(0);
    options.padding_idx = 7;
    auto embedding = random_embedding<Scalar>(gen, V, d, options);
    const Scalar s = embedding.scale();
    RowMatrix<Scalar> expected = RowMatrix<Scalar>::Zero(V, d);
    for (int step = 0; step < 30; ++step) {
      // Every third step starts a new accumulation; the others add to it, so new ids land before,
      // between and after rows already in the block.
      if (step % 3 == 0) {
        embedding.zero_grad();
        expected.setZero();
      }
      std::uniform_int_distribution<Index> T_dist(1, 12);
      const Index B = 2, T = T_dist(gen);
      const IdMatrix<std::int32_t> ids = random_ids<std::int32_t>(B, T, V, gen());
      const RowMatrix<Scalar> dout = random_matrix<Scalar>(B * T, d, gen());
      embedding.backward(ids, dout);
      naive::embedding_backward_dense<Scalar>(ids, dout, s, 7, expected);
      INFO("step " << step << ", scale " << s);
      REQUIRE(first_difference(embedding.weight().grad().to_dense(), expected).empty());
    }
  }
}

TEMPLATE_TEST_CASE("a large lookup (streaming stores) is the same row gather, on aligned and unaligned outputs",
                   "[token_embedding][forward][streaming]", float, double) {
  using Scalar = TestType;
  // N * d * sizeof(Scalar) >= 16 MiB takes the streaming path; d = 1027 is not a multiple of any
  // vector width, so every row has an unaligned head and tail.
  const Index V = 300, d = 1027;
  const Index N = (Index{16} << 20) / (d * static_cast<Index>(sizeof(Scalar))) + 5;
  const RowMatrix<Scalar> E = random_matrix<Scalar>(V, d, 4101);
  const IdMatrix<std::int32_t> ids = random_ids<std::int32_t>(1, N, V, 4102);
  RowMatrix<Scalar> expected(N, d);
  for (Index n = 0; n < N; ++n) expected.row(n) = E.row(ids(0, n));
  for (const Index offset : {Index(0), Index(1), Index(3)}) {
    CAPTURE(offset);
    // The output starts `offset` scalars into a buffer, so its rows start at every alignment.
    std::vector<Scalar> buffer(static_cast<std::size_t>(N * d + offset), Scalar(-1));
    Eigen::Map<RowMatrix<Scalar>> out(buffer.data() + offset, N, d);
    embedhead::embedding_forward<Scalar>(E, ids, Scalar(1), out);
    CHECK(first_difference(out, expected) == "");
    for (Index i = 0; i < offset; ++i) CHECK(buffer[static_cast<std::size_t>(i)] == Scalar(-1));
  }
}

TEMPLATE_TEST_CASE("a frozen table takes no gradient; its checks still run", "[token_embedding][freeze]", float,
                   double) {
  using Scalar = TestType;
  const Index V = 7, d = 3;
  TokenEmbedding<Scalar> embedding(V, d);
  CHECK_FALSE(embedding.frozen());
  IdMatrix<std::int32_t> ids(2, 3);
  ids << 1, 4, 1, 6, 0, 4;
  const RowMatrix<Scalar> dout = random_matrix<Scalar>(6, d, 300);
  embedding.backward(ids, dout);
  REQUIRE(embedding.weight().grad().num_touched() == 4);
  embedding.set_frozen(true);
  CHECK(embedding.frozen());
  CHECK(embedding.weight().frozen());
  CHECK(embedding.weight().grad().num_touched() == 0);  // freezing cleared it
  embedding.backward(ids, dout);
  CHECK(embedding.weight().grad().num_touched() == 0);
  // The forward is unaffected, and bad arguments throw as before.
  const RowMatrix<Scalar> out = embedding.forward(ids);
  CHECK(first_difference(out.row(1), embedding.weight().value().row(4)).empty());
  IdMatrix<std::int32_t> bad = ids;
  bad(1, 2) = 7;
  CHECK_THROWS_WITH(embedding.backward(bad, dout),
                    Catch::Contains("TokenEmbedding::backward: id 7 at (b=1, t=2) outside [0, 7)"));
  CHECK_THROWS_AS(embedding.backward(ids, RowMatrix<Scalar>(5, d)), embedhead::shape_error);
  // Unfrozen, it accumulates again.
  embedding.set_frozen(false);
  embedding.backward(ids, dout);
  CHECK(embedding.weight().grad().num_touched() == 4);
}
