// Tests for include/embedhead/low_precision.hpp: bf16 / fp16 tables with fp32 accumulation.
//
// References: the whole table is widened to float (or double) by the test itself, then the plain
// float formulas (naive one-hot product, dense scatter, double GEMM) give the expected values.
#include <embedhead/errors.hpp>
#include <embedhead/low_precision.hpp>
#include <embedhead/output_projection.hpp>
#include <embedhead/token_embedding.hpp>

#include "reference/naive.hpp"
#include "reference/test_support.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::LowPrecisionEmbedding;
using embedhead::LowPrecisionOutputProjection;
using embedhead::RowMatrix;
using embedhead::TokenEmbeddingOptions;
using Catch::Contains;
using test_support::first_difference;
using test_support::random_ids;
using test_support::random_matrix;

namespace {

// Storage -> float by the bit pattern, written here independently of Eigen's conversion:
// bf16 is the top half of a float; fp16 is decoded field by field.
float to_float_bits(Eigen::bfloat16 x) {
  std::uint16_t raw;
  std::memcpy(&raw, &x, 2);
  const std::uint32_t bits = static_cast<std::uint32_t>(raw) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
float to_float_bits(Eigen::half x) {
  std::uint16_t raw;
  std::memcpy(&raw, &x, 2);
  const int sign = raw >> 15, exponent = (raw >> 10) & 0x1f, mantissa = raw & 0x3ff;
  double value;
  if (exponent == 0)
    value = std::ldexp(mantissa, -24);
  else if (exponent == 31)
    value = mantissa ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else
    value = std::ldexp(1024 + mantissa, exponent - 25);
  return static_cast<float>(sign ? -value : value);
}

// A Storage [rows, cols] -> float, element by element through to_float_bits.
template <typename Storage>
RowMatrix<float> widen_by_bits(const RowMatrix<Storage>& m) {
  RowMatrix<float> out(m.rows(), m.cols());
  for (Index i = 0; i < m.size(); ++i) out.data()[i] = to_float_bits(m.data()[i]);
  return out;
}

// Spacing of Storage values in [1, 2): 2^-7 for bf16, 2^-10 for fp16.
template <typename Storage>
float ulp_at_one() {
  return std::is_same_v<Storage, Eigen::bfloat16> ? std::ldexp(1.0f, -7) : std::ldexp(1.0f, -10);
}

template <typename Storage>
const char* name() {
  return std::is_same_v<Storage, Eigen::bfloat16> ? "bf16" : "fp16";
}

// A random Storage table, values in [-1, 1].
template <typename Storage>
RowMatrix<Storage> random_table(Index V, Index d, std::uint64_t seed) {
  return random_matrix<float>(V, d, seed).template cast<Storage>();
}

struct Size {
  Index V, d, B, T;
};
// V = 1, d = 1, packet widths +-1 (float: 4, 8, 16 lanes; bf16/fp16: 8, 16, 32).
const Size kSizes[] = {{1, 1, 1, 1},   {1, 5, 2, 3},   {5, 1, 3, 4},   {3, 2, 1, 1},      {10, 7, 2, 5},
                       {10, 8, 3, 3},  {10, 9, 1, 9},  {40, 15, 2, 4}, {40, 16, 4, 2},    {40, 17, 3, 3},
                       {50, 31, 2, 8}, {50, 32, 2, 8}, {50, 33, 2, 8}, {100000, 3, 2, 5}, {7, 64, 3, 3}};

// Largest |got - exact| / bound over all entries, where bound = k * 2^-24 * (sum of |terms|): a
// float dot product of k terms is within (k * 2^-24) sum |terms| of the exact one (Higham).
// Returns a ratio: <= 1 means within the rigorous bound.
double worst_against_bound(const RowMatrix<float>& got, const RowMatrix<double>& exact,
                           const RowMatrix<double>& magnitude, Index k) {
  double worst = 0;
  for (Index i = 0; i < got.size(); ++i) {
    const double bound = (static_cast<double>(k) + 2) * std::ldexp(1.0, -24) * magnitude.data()[i] + 1e-30;
    worst = std::max(worst, std::abs(static_cast<double>(got.data()[i]) - exact.data()[i]) / bound);
  }
  return worst;
}

}  // namespace

TEMPLATE_TEST_CASE("low precision: convert_table rounds to nearest even, widen_table is exact", "[low_precision]",
                   Eigen::bfloat16, Eigen::half) {
  using Storage = TestType;
  const float u = ulp_at_one<Storage>();

  SECTION("worked values: ties go to the even neighbour") {
    RowMatrix<float> src(2, 3);
    src << 1.0f, 1.0f + u / 2, 1.0f + 3 * u / 2,       // exact; tie -> 1 (even); tie -> 1 + 2u (even)
        1.0f + u / 2 + u / 64, -(1.0f + u / 4), 0.0f;  // above the tie -> 1 + u; below -> -1; 0
    RowMatrix<float> expected(2, 3);
    expected << 1.0f, 1.0f, 1.0f + 2 * u, 1.0f + u, -1.0f, 0.0f;
    const RowMatrix<Storage> t = embedhead::convert_table<Storage>(src);
    CHECK(first_difference(widen_by_bits(t), expected) == "");
    CHECK(first_difference(embedhead::widen_table<Storage>(t), expected) == "");
    RowMatrix<float> widened(2, 3);
    embedhead::widen_table<Storage>(t, widened);
    CHECK(first_difference(widened, expected) == "");
  }

  SECTION("values already in Storage survive the round trip exactly") {
    const RowMatrix<Storage> t = random_table<Storage>(37, 19, 3);
    const RowMatrix<float> f = widen_by_bits(t);
    RowMatrix<Storage> back(37, 19);
    embedhead::convert_table<Storage>(f, back);
    CHECK(first_difference(widen_by_bits(back), f) == "");
  }

  SECTION("errors: overflow and shape, nothing written") {
    RowMatrix<float> src = RowMatrix<float>::Constant(2, 3, 0.5f);
    const bool bf16 = std::is_same_v<Storage, Eigen::bfloat16>;
    // fp16 tops out at 65504 (65520 rounds to inf); bf16 at 3.3895e38 (FLT_MAX rounds to inf).
    const float big = bf16 ? std::numeric_limits<float>::max() : 70000.0f;
    src(1, 2) = -big;
    RowMatrix<Storage> dst = RowMatrix<Storage>::Constant(2, 3, Storage(7.0f));
    REQUIRE_THROWS_AS(embedhead::convert_table<Storage>(src, dst), embedhead::value_error);
    REQUIRE_THROWS_WITH(embedhead::convert_table<Storage>(src, dst),
                        Contains("convert_table: value -") &&
                            Contains("at (1, 2) overflows " + std::string(name<Storage>())) &&
                            Contains(bf16 ? "largest finite 3.38953e+38" : "largest finite 65504"));
    CHECK(first_difference(widen_by_bits(dst), RowMatrix<float>::Constant(2, 3, 7.0f)) == "");
    // The largest finite value itself converts.
    src(1, 2) = bf16 ? 3.3895313892515355e38f : 65504.0f;
    embedhead::convert_table<Storage>(src, dst);
    CHECK(to_float_bits(dst(1, 2)) == src(1, 2));
    // Infinity is kept, not an overflow.
    src(0, 0) = -std::numeric_limits<float>::infinity();
    embedhead::convert_table<Storage>(src, dst);
    CHECK(to_float_bits(dst(0, 0)) == -std::numeric_limits<float>::infinity());

    RowMatrix<Storage> wrong = RowMatrix<Storage>::Constant(3, 2, Storage(7.0f));
    REQUIRE_THROWS_AS(embedhead::convert_table<Storage>(src, wrong), embedhead::shape_error);
    REQUIRE_THROWS_WITH(embedhead::convert_table<Storage>(src, wrong),
                        Contains("convert_table: dst has shape [3, 2], expected [2, 3]"));
    CHECK(first_difference(widen_by_bits(wrong), RowMatrix<float>::Constant(3, 2, 7.0f)) == "");
    RowMatrix<float> wrong_f = RowMatrix<float>::Constant(2, 2, 9.0f);
    REQUIRE_THROWS_WITH(embedhead::widen_table<Storage>(dst, wrong_f),
                        Contains("widen_table: dst has shape [2, 2], expected [2, 3]"));
    CHECK(wrong_f == RowMatrix<float>::Constant(2, 2, 9.0f));
  }
}

TEMPLATE_TEST_CASE("low precision: the sqrt(d) multiplier is rounded to Storage first", "[low_precision]",
                   Eigen::bfloat16, Eigen::half) {
  using Storage = TestType;
  const bool bf16 = std::is_same_v<Storage, Eigen::bfloat16>;
  // Gemma 2B: sqrt(2048) = 45.2548...; both formats round it to 45.25 (spacing 0.25 / 0.03125).
  CHECK(embedhead::low_precision_scale<Storage>(2048) == 45.25f);
  // sqrt(768) = 27.7128...: bf16 spacing 0.125 -> 27.75; fp16 spacing 1/64 -> 27.71875.
  CHECK(embedhead::low_precision_scale<Storage>(768) == (bf16 ? 27.75f : 27.71875f));
  CHECK(embedhead::low_precision_scale<Storage>(4) == 2.0f);
  CHECK(embedhead::low_precision_scale<Storage>(1) == 1.0f);
  REQUIRE_THROWS_AS(embedhead::low_precision_scale<Storage>(0), embedhead::value_error);
  REQUIRE_THROWS_WITH(embedhead::low_precision_scale<Storage>(0), Contains("d = 0 outside [1, inf)"));

  TokenEmbeddingOptions on;
  on.scale_by_sqrt_d = true;
  CHECK(LowPrecisionEmbedding<Storage>(RowMatrix<Storage>::Zero(1, 2048), on).scale() == 45.25f);
  CHECK(LowPrecisionEmbedding<Storage>(RowMatrix<Storage>::Zero(1, 2048)).scale() == 1.0f);
}

TEMPLATE_TEST_CASE("low precision: lookup equals one_hot(ids) * widen(E), in float", "[low_precision][forward]",
                   Eigen::bfloat16, Eigen::half) {
  using Storage = TestType;

  SECTION("worked example") {
    RowMatrix<float> E(3, 2);
    E << 0.5f, -1.25f, 3.0f, 0.1f, -2.0f, 1024.0f;  // 0.1 is not representable: it rounds
    const LowPrecisionEmbedding<Storage> emb(E);
    IdMatrix<std::int32_t> ids(1, 3);
    ids << 1, 1, 2;
    const RowMatrix<float> out = emb.forward(ids);
    // 0.1 rounded: bf16 0.10009765625 (0x3DCD), fp16 0.0999755859375 (0x2E66).
    const float tenth = std::is_same_v<Storage, Eigen::bfloat16> ? 0.10009765625f : 0.0999755859375f;
    RowMatrix<float> expected(3, 2);
    expected << 3.0f, tenth, 3.0f, tenth, -2.0f, 1024.0f;
    CHECK(first_difference(out, expected) == "");
  }

  SECTION("naive reference, with and without the scale, int32 / int64, all overloads") {
    std::mt19937_64 gen(21);
    auto check = [&](Index V, Index d, Index B, Index T) {
      INFO("V = " << V << ", d = " << d << ", B = " << B << ", T = " << T);
      const RowMatrix<Storage> table = random_table<Storage>(V, d, gen());
      const RowMatrix<float> widened = widen_by_bits(table);
      const IdMatrix<std::int64_t> ids64 = random_ids<std::int64_t>(B, T, V, gen());
      const IdMatrix<std::int32_t> ids32 = ids64.template cast<std::int32_t>();
      for (const bool scaled : {false, true}) {
        TokenEmbeddingOptions options;
        options.scale_by_sqrt_d = scaled;
        const LowPrecisionEmbedding<Storage> emb(table, options);
        const float s = scaled ? static_cast<float>(Storage(std::sqrt(static_cast<float>(d)))) : 1.0f;
        REQUIRE(emb.scale() == s);
        const RowMatrix<float> scaled_E = s * widened;
        const RowMatrix<float> expected = naive::one_hot_lookup<float>(ids64, scaled_E);
        REQUIRE(first_difference(emb.forward(ids32), expected) == "");
        REQUIRE(first_difference(emb.forward(ids64), expected) == "");
        RowMatrix<float> out = RowMatrix<float>::Constant(B * T, d, 42.0f);
        emb.forward(ids32, out);
        REQUIRE(first_difference(out, expected) == "");
        out.setConstant(42.0f);
        embedhead::embedding_forward<Storage>(table, ids64, s, out);
        REQUIRE(first_difference(out, expected) == "");
      }
    };
    for (const Size& s : kSizes) check(s.V, s.d, s.B, s.T);
    std::uniform_int_distribution<Index> V_dist(1, 300), d_dist(1, 70), BT_dist(1, 6);
    for (int i = 0; i < 20; ++i) check(V_dist(gen), d_dist(gen), BT_dist(gen), BT_dist(gen));
  }

  SECTION("equals TokenEmbedding<float> on the widened table") {
    const RowMatrix<Storage> table = random_table<Storage>(60, 24, 5);
    const IdMatrix<std::int32_t> ids = random_ids<std::int32_t>(3, 11, 60, 6);
    const LowPrecisionEmbedding<Storage> emb(table);
    auto weight = std::make_shared<embedhead::Parameter<float>>(60, 24);
    weight->value() = widen_by_bits(table);
    const embedhead::TokenEmbedding<float> reference(weight);
    CHECK(first_difference(emb.forward(ids), reference.forward(ids)) == "");
  }

  SECTION("out may be a block of a larger matrix") {
    const RowMatrix<Storage> table = random_table<Storage>(6, 3, 7);
    const LowPrecisionEmbedding<Storage> emb(table);
    IdMatrix<std::int32_t> ids(2, 2);
    ids << 5, 0, 0, 3;
    RowMatrix<float> big = RowMatrix<float>::Constant(6, 5, -9.0f);
    emb.forward(ids, big.block(1, 1, 4, 3));
    const RowMatrix<float> expected = naive::one_hot_lookup<float>(ids, widen_by_bits(table));
    CHECK(first_difference(RowMatrix<float>(big.block(1, 1, 4, 3)), expected) == "");
    big.block(1, 1, 4, 3).setConstant(-9.0f);
    CHECK(big == RowMatrix<float>::Constant(6, 5, -9.0f));
  }
}

TEMPLATE_TEST_CASE("low precision: embedding backward is the float scatter into a RowGradient<float>",
                   "[low_precision][backward]", Eigen::bfloat16, Eigen::half) {
  using Storage = TestType;

  SECTION("naive dense scatter, sparse rows, repeats and padding") {
    std::mt19937_64 gen(31);
    for (const Size& sz : kSizes) {
      for (const bool scaled : {false, true}) {
        INFO("V = " << sz.V << ", d = " << sz.d << ", scaled = " << scaled);
        TokenEmbeddingOptions options;
        options.scale_by_sqrt_d = scaled;
        const Index padding = sz.V > 2 ? 1 : -1;
        if (padding >= 0) options.padding_idx = padding;
        LowPrecisionEmbedding<Storage> emb(random_table<Storage>(sz.V, sz.d, gen()), options);
        const IdMatrix<std::int32_t> ids = random_ids<std::int32_t>(sz.B, sz.T, sz.V, gen());
        const RowMatrix<float> dout = random_matrix<float>(sz.B * sz.T, sz.d, gen());
        const RowMatrix<float> dout2 = random_matrix<float>(sz.B * sz.T, sz.d, gen());
        emb.backward(ids, dout);
        emb.backward(ids.template cast<std::int64_t>().eval(), dout2);  // accumulates
        RowMatrix<float> expected = RowMatrix<float>::Zero(sz.V, sz.d);
        naive::embedding_backward_dense<float>(ids, dout, emb.scale(), padding, expected);
        naive::embedding_backward_dense<float>(ids, dout2, emb.scale(), padding, expected);
        REQUIRE(first_difference(emb.grad().to_dense(), expected) == "");
        std::set<Index> distinct;
        for (Index i = 0; i < ids.size(); ++i)
          if (ids.data()[i] != padding) distinct.insert(ids.data()[i]);
        REQUIRE(emb.grad().touched_rows() == std::vector<Index>(distinct.begin(), distinct.end()));
        REQUIRE_FALSE(emb.grad().is_dense());
        emb.zero_grad();
        REQUIRE(emb.grad().num_touched() == 0);
      }
    }
  }

  SECTION("gradient check: central differences in double on the widened table") {
    const Index V = 7, d = 5, B = 2, T = 4;
    TokenEmbeddingOptions options;
    options.scale_by_sqrt_d = true;
    LowPrecisionEmbedding<Storage> emb(random_table<Storage>(V, d, 41), options);
    IdMatrix<std::int32_t> ids(B, T);
    ids << 0, 3, 3, 6, 2, 3, 0, 0;                                  // repeats; rows 1, 4, 5 absent
    const RowMatrix<float> G = random_matrix<float>(B * T, d, 42);  // L = sum(G .* out)
    emb.backward(ids, G);
    RowMatrix<double> E = widen_by_bits(RowMatrix<Storage>(emb.table())).template cast<double>();
    const double s = emb.scale();
    auto loss = [&] {
      double L = 0;
      for (Index n = 0; n < B * T; ++n)
        for (Index j = 0; j < d; ++j) L += static_cast<double>(G(n, j)) * s * E(ids(n / T, n % T), j);
      return L;
    };
    const RowMatrix<double> numeric = naive::numerical_gradient(E, loss);
    const RowMatrix<double> analytic = emb.grad().to_dense().template cast<double>();
    CHECK(naive::max_relative_error(analytic, numeric, 1e-3) < 1e-5);
    CHECK(analytic.row(1).isZero(0));
    CHECK(numeric.row(4).cwiseAbs().maxCoeff() < 1e-9);
  }

  SECTION("equals TokenEmbedding<float>::backward with the same multiplier, bit for bit") {
    TokenEmbeddingOptions options;
    options.padding_idx = 2;
    LowPrecisionEmbedding<Storage> emb(random_table<Storage>(30, 9, 51), options);
    embedhead::TokenEmbedding<float> reference(30, 9, options);
    const IdMatrix<std::int32_t> ids = random_ids<std::int32_t>(4, 20, 30, 52);
    const RowMatrix<float> dout = random_matrix<float>(80, 9, 53);
    emb.backward(ids, dout);
    reference.backward(ids, dout);
    CHECK(first_difference(emb.grad().to_dense(), reference.weight().grad().to_dense()) == "");
  }
}

TEMPLATE_TEST_CASE("low precision: embedding errors name the id, (b, t) and range; nothing changes",
                   "[low_precision][errors]", Eigen::bfloat16, Eigen::half) {
  using Storage = TestType;
  const RowMatrix<Storage> table = random_table<Storage>(5, 3, 61);
  LowPrecisionEmbedding<Storage> emb(table);
  IdMatrix<std::int64_t> ids(2, 3);
  ids << 0, 1, 2, 3, 4, 5;
  RowMatrix<float> out = RowMatrix<float>::Constant(6, 3, 42.0f);
  const auto message = Contains("id 5 at (b=1, t=2) outside [0, 5)");
  REQUIRE_THROWS_AS(emb.forward(ids, out), embedhead::index_error);
  REQUIRE_THROWS_WITH(emb.forward(ids, out), Contains("LowPrecisionEmbedding::forward") && message);
  REQUIRE_THROWS_WITH(emb.forward(ids), Contains("LowPrecisionEmbedding::forward") && message);
  REQUIRE_THROWS_WITH((embedhead::embedding_forward<Storage>(table, ids, 1.0f, out)),
                      Contains("embedding_forward: id 5 at (b=1, t=2) outside [0, 5)"));
  CHECK(out == RowMatrix<float>::Constant(6, 3, 42.0f));
  ids(0, 1) = -1;
  REQUIRE_THROWS_WITH(emb.forward(ids, out), Contains("id -1 at (b=0, t=1) outside [0, 5)"));
  CHECK(out == RowMatrix<float>::Constant(6, 3, 42.0f));

  IdMatrix<std::int32_t> good(2, 3);
  good << 0, 1, 2, 3, 4, 4;
  RowMatrix<float> wrong = RowMatrix<float>::Constant(6, 4, 42.0f);
  REQUIRE_THROWS_AS(emb.forward(good, wrong), embedhead::shape_error);
  REQUIRE_THROWS_WITH(emb.forward(good, wrong), Contains("out has shape [6, 4], expected [6, 3]"));
  CHECK(wrong == RowMatrix<float>::Constant(6, 4, 42.0f));

  // Backward: a bad id or a wrong dout leaves the gradient as it was.
  emb.backward(good, RowMatrix<float>::Ones(6, 3));
  const RowMatrix<float> before = emb.grad().to_dense();
  const std::vector<Index> touched = emb.grad().touched_rows();
  REQUIRE_THROWS_AS(emb.backward(ids, RowMatrix<float>::Ones(6, 3)), embedhead::index_error);
  REQUIRE_THROWS_WITH(emb.backward(ids, RowMatrix<float>::Ones(6, 3)),
                      Contains("LowPrecisionEmbedding::backward: id -1 at (b=0, t=1) outside [0, 5)"));
  REQUIRE_THROWS_AS(emb.backward(good, RowMatrix<float>::Ones(6, 2)), embedhead::shape_error);
  REQUIRE_THROWS_WITH(emb.backward(good, RowMatrix<float>::Ones(6, 2)),
                      Contains("dout has shape [6, 2], expected [6, 3]"));
  CHECK(first_difference(emb.grad().to_dense(), before) == "");
  CHECK(emb.grad().touched_rows() == touched);

  // Constructors.
  TokenEmbeddingOptions bad_padding;
  bad_padding.padding_idx = 5;
  REQUIRE_THROWS_AS(LowPrecisionEmbedding<Storage>(table, bad_padding), embedhead::index_error);
  REQUIRE_THROWS_WITH(LowPrecisionEmbedding<Storage>(table, bad_padding),
                      Contains("LowPrecisionEmbedding: padding_idx 5 outside [0, 5)"));
  REQUIRE_THROWS_AS(LowPrecisionEmbedding<Storage>(RowMatrix<Storage>(0, 3)), embedhead::value_error);
  REQUIRE_THROWS_WITH(LowPrecisionEmbedding<Storage>(RowMatrix<float>(4, 0)),
                      Contains("LowPrecisionEmbedding: d = 0 outside [1, inf)"));
  RowMatrix<float> huge = RowMatrix<float>::Zero(2, 2);
  huge(1, 0) = std::numeric_limits<float>::max();
  REQUIRE_THROWS_AS(LowPrecisionEmbedding<Storage>(huge), embedhead::value_error);
}

TEMPLATE_TEST_CASE("low precision: head forward = h widen(W)^T + b, tile by tile", "[low_precision][head]",
                   Eigen::bfloat16, Eigen::half) {
  using Storage = TestType;
  // V around the tile size (256): one partial tile, exactly one, one plus a row, several.
  struct HeadSize {
    Index N, d, V;
  };
  const HeadSize sizes[] = {{1, 1, 1}, {3, 5, 7}, {4, 17, 255}, {2, 16, 256}, {5, 9, 257}, {6, 33, 700}, {1, 64, 1030}};
  std::mt19937_64 gen(71);
  for (const HeadSize& sz : sizes) {
    for (const bool with_bias : {false, true}) {
      INFO("N = " << sz.N << ", d = " << sz.d << ", V = " << sz.V << ", bias = " << with_bias);
      const RowMatrix<Storage> W = random_table<Storage>(sz.V, sz.d, gen());
      const RowMatrix<float> h = random_matrix<float>(sz.N, sz.d, gen());
      const RowMatrix<float> bias = with_bias ? random_matrix<float>(sz.V, 1, gen()) : RowMatrix<float>(0, 1);

      // Reference in double on the widened W, and the bound sum |h_k W_vk| + |b_v|.
      const RowMatrix<double> Wd = widen_by_bits(W).template cast<double>();
      const RowMatrix<double> hd = h.template cast<double>();
      RowMatrix<double> exact = hd * Wd.transpose();
      RowMatrix<double> magnitude = hd.cwiseAbs() * Wd.cwiseAbs().transpose();
      if (with_bias) {
        exact.rowwise() += bias.template cast<double>().col(0).transpose();
        magnitude.rowwise() += bias.template cast<double>().cwiseAbs().col(0).transpose();
      }

      LowPrecisionOutputProjection<Storage> head(W, bias);
      REQUIRE(head.has_bias() == with_bias);
      const RowMatrix<float> logits = head.forward(h);
      CHECK(worst_against_bound(logits, exact, magnitude, sz.d) <= 1.0);

      // The float head on the widened W agrees within twice the bound.
      RowMatrix<float> float_logits(sz.N, sz.V);
      embedhead::output_projection_forward<float>(h, widen_by_bits(W), bias, float_logits);
      CHECK(worst_against_bound(logits, float_logits.template cast<double>(), magnitude, 2 * sz.d) <= 1.0);

      // Free function with a reused workspace; a strided logits block.
      embedhead::HeadTileWorkspace workspace;
      RowMatrix<float> big = RowMatrix<float>::Constant(sz.N + 2, sz.V + 3, -9.0f);
      embedhead::output_projection_forward<Storage>(h, W, bias, big.block(1, 2, sz.N, sz.V), workspace);
      CHECK(first_difference(RowMatrix<float>(big.block(1, 2, sz.N, sz.V)), logits) == "");
      big.block(1, 2, sz.N, sz.V).setConstant(-9.0f);
      CHECK(big == RowMatrix<float>::Constant(sz.N + 2, sz.V + 3, -9.0f));
      // On a backend that widens W itself while packing it (the default, the packed kernel), and
      // on the decode path (N <= 8, W widened as it streams, on every backend), no tile at all;
      // otherwise one tile of min(V, 256) rows (one thread: these sizes run on the calling
      // thread). Never V x d.
      const bool widened_by_backend = embedhead::detail::gemm::DefaultBackend::template takes<float, Storage, float>;
      const bool decoded = sz.N >= 1 && sz.N <= embedhead::detail::kDecodeMaxTokens;
      CHECK(workspace.tiles.size() ==
            (widened_by_backend || decoded ? 0 : static_cast<std::size_t>(std::min<Index>(sz.V, 256) * sz.d)));
    }
  }
}

TEMPLATE_TEST_CASE("low precision: head backward", "[low_precision][head][backward]", Eigen::bfloat16, Eigen::half) {
  using Storage = TestType;

  SECTION("dh, dW, db against double references on the widened W, over tile boundaries") {
    std::mt19937_64 gen(81);
    for (const Index V : {1, 7, 256, 257, 600}) {
      const Index N = 4, d = 13;
      INFO("V = " << V);
      const RowMatrix<Storage> W = random_table<Storage>(V, d, gen());
      const RowMatrix<float> h = random_matrix<float>(N, d, gen());
      const RowMatrix<float> dlogits = random_matrix<float>(N, V, gen());
      LowPrecisionOutputProjection<Storage> head(W, RowMatrix<float>::Zero(V, 1));
      const RowMatrix<float> dh = head.backward(h, dlogits);

      const RowMatrix<double> Wd = widen_by_bits(W).template cast<double>();
      const RowMatrix<double> hd = h.template cast<double>(), gd = dlogits.template cast<double>();
      CHECK(worst_against_bound(dh, gd * Wd, gd.cwiseAbs() * Wd.cwiseAbs(), V) <= 1.0);
      REQUIRE(head.weight_grad().is_dense());
      CHECK(worst_against_bound(head.weight_grad().to_dense(), gd.transpose() * hd,
                                gd.cwiseAbs().transpose() * hd.cwiseAbs(), N) <= 1.0);
      CHECK(worst_against_bound(head.bias_grad().to_dense(), gd.colwise().sum().transpose(),
                                gd.cwiseAbs().colwise().sum().transpose(), N) <= 1.0);

      // The float head backward on the widened W: dW and db are the same float expressions.
      RowMatrix<float> f_dh(N, d), f_dW = RowMatrix<float>::Zero(V, d), f_db = RowMatrix<float>::Zero(V, 1);
      embedhead::output_projection_backward<float>(h, widen_by_bits(W), dlogits, f_dh, f_dW, f_db);
      CHECK(worst_against_bound(dh, f_dh.template cast<double>(), gd.cwiseAbs() * Wd.cwiseAbs(), 2 * V) <= 1.0);
      CHECK(worst_against_bound(head.weight_grad().to_dense(), f_dW.template cast<double>(),
                                gd.cwiseAbs().transpose() * hd.cwiseAbs(), 2 * N) <= 1.0);
      // On the packed kernel (it widens W while packing it), dh and dW are the float head's sequence
      // on float(W): the same bits.
      if (embedhead::detail::gemm::DefaultBackend::template takes<float, Storage, float>) {
        CHECK(first_difference(dh, f_dh) == "");
        CHECK(first_difference(head.weight_grad().to_dense(), f_dW) == "");
      }

      // A second call accumulates: exactly twice (x + x is exact) where the GEMM adds its finished
      // product to dW, as Eigen and OpenBLAS do for a sum over N = 4 tokens (longer sums are added
      // in blocks); BLIS's small-matrix kernels fold the existing dW into their sums, so there it
      // is twice within rounding.
      const RowMatrix<float> dW1 = head.weight_grad().to_dense(), db1 = head.bias_grad().to_dense();
      head.backward(h, dlogits);
#if defined(EMBEDHEAD_CBLAS_BLIS)
      CHECK(test_support::close(head.weight_grad().to_dense(), RowMatrix<float>(2 * dW1), 1e-6));
#else
      CHECK(first_difference(head.weight_grad().to_dense(), RowMatrix<float>(2 * dW1)) == "");
#endif
      CHECK(first_difference(head.bias_grad().to_dense(), RowMatrix<float>(2 * db1)) == "");
      head.zero_grad();
      CHECK(head.weight_grad().to_dense().isZero(0));
    }
  }

  SECTION("gradient check: central differences in double, L = sum(G .* logits)") {
    const Index N = 3, d = 4, V = 300;  // two tiles
    const RowMatrix<Storage> W = random_table<Storage>(V, d, 91);
    const RowMatrix<float> h = random_matrix<float>(N, d, 92);
    const RowMatrix<float> bias = random_matrix<float>(V, 1, 93);
    const RowMatrix<float> G = random_matrix<float>(N, V, 94);
    LowPrecisionOutputProjection<Storage> head(W, bias);
    const RowMatrix<double> dh = head.backward(h, G).template cast<double>();
    const RowMatrix<double> dW = head.weight_grad().to_dense().template cast<double>();
    const RowMatrix<double> db = head.bias_grad().to_dense().template cast<double>();

    RowMatrix<double> hd = h.template cast<double>(), Wd = widen_by_bits(W).template cast<double>();
    RowMatrix<double> bd = bias.template cast<double>();
    const RowMatrix<double> Gd = G.template cast<double>();
    auto loss = [&] {
      const RowMatrix<double> logits = (hd * Wd.transpose()).rowwise() + bd.col(0).transpose();
      return logits.cwiseProduct(Gd).sum();
    };
    CHECK(naive::max_relative_error(dh, naive::numerical_gradient(hd, loss), 1e-3) < 1e-4);
    CHECK(naive::max_relative_error(dW, naive::numerical_gradient(Wd, loss), 1e-3) < 1e-4);
    CHECK(naive::max_relative_error(db, naive::numerical_gradient(bd, loss), 1e-3) < 1e-4);
  }

  SECTION("dh may be h; an empty dW or db is skipped (frozen weights)") {
    const Index N = 3, d = 6, V = 270;
    const RowMatrix<Storage> W = random_table<Storage>(V, d, 95);
    const RowMatrix<float> h = random_matrix<float>(N, d, 96);
    const RowMatrix<float> dlogits = random_matrix<float>(N, V, 97);
    embedhead::HeadTileWorkspace workspace;
    RowMatrix<float> dh(N, d), dW = RowMatrix<float>::Zero(V, d), db = RowMatrix<float>::Zero(V, 1);
    embedhead::output_projection_backward<Storage>(h, W, dlogits, dh, dW, db, workspace);
    RowMatrix<float> in_place = h;
    RowMatrix<float> dW2 = RowMatrix<float>::Zero(V, d), db2 = RowMatrix<float>::Zero(V, 1);
    embedhead::output_projection_backward<Storage>(in_place, W, dlogits, in_place, dW2, db2, workspace);
    CHECK(first_difference(in_place, dh) == "");
    CHECK(first_difference(dW2, dW) == "");
    RowMatrix<float> dh_only(N, d), none(0, 1), no_dW(0, d);
    embedhead::output_projection_backward<Storage>(h, W, dlogits, dh_only, no_dW, none, workspace);
    CHECK(first_difference(dh_only, dh) == "");
  }
}

TEMPLATE_TEST_CASE("low precision: head errors name the operand and shapes; nothing changes",
                   "[low_precision][head][errors]", Eigen::bfloat16, Eigen::half) {
  using Storage = TestType;
  const Index N = 2, d = 4, V = 5;
  const RowMatrix<Storage> W = random_table<Storage>(V, d, 101);
  LowPrecisionOutputProjection<Storage> head(W, RowMatrix<float>::Zero(V, 1));
  const RowMatrix<float> h = random_matrix<float>(N, d, 102);
  const RowMatrix<float> dlogits = random_matrix<float>(N, V, 103);

  RowMatrix<float> logits = RowMatrix<float>::Constant(N, V, 42.0f);
  REQUIRE_THROWS_AS(head.forward(RowMatrix<float>::Ones(N, d + 1), logits), embedhead::shape_error);
  REQUIRE_THROWS_WITH(head.forward(RowMatrix<float>::Ones(N, d + 1), logits),
                      Contains("LowPrecisionOutputProjection::forward: h has shape [2, 5], expected [2, 4]"));
  REQUIRE_THROWS_WITH(head.forward(RowMatrix<float>::Ones(N, d + 1)), Contains("h has shape [2, 5], expected [2, 4]"));
  RowMatrix<float> wrong_logits = RowMatrix<float>::Constant(N, V + 1, 42.0f);
  REQUIRE_THROWS_WITH(head.forward(h, wrong_logits), Contains("logits has shape [2, 6], expected [2, 5]"));
  CHECK(logits == RowMatrix<float>::Constant(N, V, 42.0f));
  CHECK(wrong_logits == RowMatrix<float>::Constant(N, V + 1, 42.0f));
  embedhead::HeadTileWorkspace workspace;
  REQUIRE_THROWS_WITH(embedhead::output_projection_forward<Storage>(h, W, RowMatrix<float>::Zero(V + 1, 1), logits,
                                                                    workspace),
                      Contains("output_projection_forward: bias has shape [6, 1], expected [5, 1]"));
  CHECK(logits == RowMatrix<float>::Constant(N, V, 42.0f));

  RowMatrix<float> dh = RowMatrix<float>::Constant(N, d, 42.0f);
  const auto unchanged = [&] {
    return dh == RowMatrix<float>::Constant(N, d, 42.0f) && !head.weight_grad().is_dense() &&
           head.weight_grad().num_touched() == 0 && head.bias_grad().num_touched() == 0;
  };
  REQUIRE_THROWS_AS(head.backward(h, RowMatrix<float>::Ones(N, V - 1), dh), embedhead::shape_error);
  REQUIRE_THROWS_WITH(head.backward(h, RowMatrix<float>::Ones(N, V - 1), dh),
                      Contains("LowPrecisionOutputProjection::backward: dlogits has shape [2, 4], expected [2, 5]"));
  RowMatrix<float> wrong_dh = RowMatrix<float>::Constant(N + 1, d, 42.0f);
  REQUIRE_THROWS_WITH(head.backward(h, dlogits, wrong_dh), Contains("dh has shape [3, 4], expected [2, 4]"));
  REQUIRE_THROWS_WITH(head.backward(RowMatrix<float>::Ones(N, 3), dlogits),
                      Contains("h has shape [2, 3], expected [2, 4]"));
  CHECK(unchanged());
  CHECK(wrong_dh == RowMatrix<float>::Constant(N + 1, d, 42.0f));

  RowMatrix<float> dW = RowMatrix<float>::Constant(V, d + 1, 1.0f), db = RowMatrix<float>::Constant(V, 1, 1.0f);
  REQUIRE_THROWS_WITH(embedhead::output_projection_backward<Storage>(h, W, dlogits, dh, dW, db, workspace),
                      Contains("output_projection_backward: dW has shape [5, 5], expected [5, 4]"));
  RowMatrix<float> good_dW = RowMatrix<float>::Constant(V, d, 1.0f),
                   bad_db = RowMatrix<float>::Constant(V - 1, 1, 1.0f);
  REQUIRE_THROWS_WITH(embedhead::output_projection_backward<Storage>(h, W, dlogits, dh, good_dW, bad_db, workspace),
                      Contains("db has shape [4, 1], expected [5, 1]"));
  CHECK(good_dW == RowMatrix<float>::Constant(V, d, 1.0f));
  CHECK(dW == RowMatrix<float>::Constant(V, d + 1, 1.0f));
  CHECK(unchanged());

  // A bias whose length no longer matches W (W resized through its Parameter): named before either
  // gradient turns dense.
  head.weight().resize_rows(V + 2);
  REQUIRE_THROWS_AS(head.backward(h, RowMatrix<float>::Ones(N, V + 2), dh), embedhead::shape_error);
  REQUIRE_THROWS_WITH(head.backward(h, RowMatrix<float>::Ones(N, V + 2), dh),
                      Contains("LowPrecisionOutputProjection::backward: bias has shape [5, 1], expected [7, 1]"));
  CHECK(unchanged());
  CHECK_FALSE(head.bias_grad().is_dense());
  head.weight().resize_rows(V);

  // Constructors.
  REQUIRE_THROWS_AS(LowPrecisionOutputProjection<Storage>(W, RowMatrix<float>::Zero(V, 2)), embedhead::shape_error);
  REQUIRE_THROWS_WITH(LowPrecisionOutputProjection<Storage>(W, RowMatrix<float>::Zero(V, 2)),
                      Contains("LowPrecisionOutputProjection: bias has shape [5, 2], expected [5, 1]"));
  REQUIRE_THROWS_AS(LowPrecisionOutputProjection<Storage>(RowMatrix<Storage>(0, 4)), embedhead::value_error);
  REQUIRE_THROWS_WITH(LowPrecisionOutputProjection<Storage>(RowMatrix<float>(3, 0)),
                      Contains("LowPrecisionOutputProjection: d = 0 outside [1, inf)"));
  // A float W is converted, and a bias is optional.
  RowMatrix<float> Wf(2, 1);
  Wf << 1.0f, -0.5f;
  LowPrecisionOutputProjection<Storage> from_float(Wf);
  CHECK_FALSE(from_float.has_bias());
  RowMatrix<float> one(1, 1);
  one << 2.0f;
  RowMatrix<float> expected(1, 2);
  expected << 2.0f, -1.0f;
  CHECK(first_difference(from_float.forward(one), expected) == "");
}

TEMPLATE_TEST_CASE("low precision: without a bias, bias_grad() is an untouched gradient of the current V",
                   "[low_precision][head]", Eigen::bfloat16, Eigen::half) {
  using Storage = TestType;
  LowPrecisionOutputProjection<Storage> head(random_table<Storage>(5, 4, 201));
  // Made with the layer: calls change nothing while V stays (const ones may run side by side).
  const embedhead::RowGradient<float>* made = &std::as_const(head).bias_grad();
  CHECK(&std::as_const(head).bias_grad() == made);
  CHECK(&head.bias_grad() == made);
  CHECK(head.bias_grad().rows() == 5);
  CHECK(head.bias_grad().num_touched() == 0);
  head.weight().resize_rows(8);
  CHECK(head.bias_grad().rows() == 8);
  const auto& const_head = head;
  CHECK(const_head.bias_grad().rows() == 8);
  // Layers of different V move-assign (a gradient keeps its shape, so the layer holds this one
  // by pointer).
  LowPrecisionOutputProjection<Storage> other(random_table<Storage>(3, 4, 202));
  head = std::move(other);
  CHECK(head.vocab_size() == 3);
  CHECK(head.bias_grad().rows() == 3);
}

TEMPLATE_TEST_CASE(
    "low-precision head: decode (N <= 8) widens W as it streams; a token's logits are the same "
    "bits in any batch and equal the float head's on float(W)",
    "[low_precision][batch_invariance]", Eigen::bfloat16, Eigen::half) {
  using Storage = TestType;
  // V not a multiple of the lanes, d across a depth block with a tail.
  const Index V = 1000, d = 300, total = 40;
  const RowMatrix<Storage> W = embedhead::convert_table<Storage>(random_matrix<float>(V, d, 61, 0.1));
  const RowMatrix<float> Wf = widen_by_bits(W), bias = random_matrix<float>(V, 1, 62);
  const RowMatrix<float> h = random_matrix<float>(total, d, 63);
  LowPrecisionOutputProjection<Storage> head(W, bias);
  // Float head on float(W), each token alone (its decode path).
  RowMatrix<float> alone(total, V);
  for (Index n = 0; n < total; ++n) {
    RowMatrix<float> row(1, V);
    embedhead::output_projection_forward<float>(h.row(n), Wf, bias, row);
    alone.row(n) = row;
  }
  for (const Index N : {Index{1}, Index{2}, Index{7}, Index{8}, Index{9}, Index{40}})
    for (const Index o : {Index{0}, total - N}) {
      CAPTURE(N, o);
      const RowMatrix<float> got = head.forward(h.middleRows(o, N));
      if (N <= 8 || std::is_same_v<embedhead::detail::gemm::DefaultBackend, embedhead::detail::gemm::PackedBackend>)
        CHECK(first_difference(got, alone.middleRows(o, N)) == "");
    }
}
