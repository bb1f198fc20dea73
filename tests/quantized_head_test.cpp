// Tests for include/embedhead/quantized_head.hpp: the int8 head's logits against a double
// reference on the dequantized table (scale_v * float(Q[v])) written here, within float rounding;
// against the float head within the quantization bound sum_k |h_k| scale_v / 2; the written-out
// sequence of the build bit for bit; batch invariance (any N, any offset); the tied form sharing
// the embedding's table; errors. Built twice: portable (the scalar lanes) and, where the build
// targets this machine, with -march=native (the AVX-512 or AVX2 lanes).
#include <embedhead/analysis/head_comparison.hpp>
#include <embedhead/output_projection.hpp>
#include <embedhead/quantized_head.hpp>

#include "reference/test_support.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

using embedhead::Index;
using embedhead::QuantizedEmbedding;
using embedhead::QuantizedOutputProjection;
using embedhead::RowMatrix;
using test_support::random_matrix;

namespace {

// The sequence at the top of quantized_head.hpp, written out one value at a time for the build's
// lanes: 4 running packets of `lanes` sums over runs of 4 * lanes values, ((p0 + p1) + (p2 + p3)),
// lanes reduced by halves, the tail value by value, times the scale, plus the bias; every
// multiply-add fused where the build's target has FMA, a product and a sum otherwise.
float reference_sequence(const float* h, const std::int8_t* q, Index d, float scale, const float* bias) {
  constexpr Index L = embedhead::detail::Int8HeadLanes::lanes;
  auto madd = [](float a, float b, float c) {
    if constexpr (embedhead::detail::int8_head_fuses()) return std::fma(a, b, c);
    const float product = a * b;  // a target without FMA: the two roundings stay apart
    return product + c;
  };
  const Index run = 4 * L, body = d - d % run;
  float acc[4][L > 0 ? L : 1] = {};
  for (Index k = 0; k < body; k += run)
    for (Index u = 0; u < 4; ++u)
      for (Index l = 0; l < L; ++l) acc[u][l] = madd(static_cast<float>(q[k + u * L + l]), h[k + u * L + l], acc[u][l]);
  float lanes[L > 0 ? L : 1];
  for (Index l = 0; l < L; ++l) lanes[l] = (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
  for (Index width = L / 2; width >= 1; width /= 2)
    for (Index l = 0; l < width; ++l) lanes[l] = lanes[l] + lanes[l + width];
  float sum = lanes[0];
  for (Index k = body; k < d; ++k) sum = madd(h[k], static_cast<float>(q[k]), sum);
  return bias ? madd(scale, sum, *bias) : scale * sum;
}

}  // namespace

TEST_CASE("quantized head: logits against double references and the documented sequence", "[quantized_head]") {
  // One and two tokens read rows from 4 and 2 segments of the vocabulary at once (the rows left
  // over one by one): V = 1, 3, 6 and 77 cover the segments and the rows left over.
  for (const Index d : {Index{1}, Index{63}, Index{64}, Index{130}, Index{768}})
    for (const Index V : {Index{1}, Index{3}, Index{6}, Index{77}})
      for (const Index N : {Index{1}, Index{2}, Index{11}}) {
        CAPTURE(d, V, N);
        const RowMatrix<float> W = random_matrix<float>(V, d, 1, 0.1), h = random_matrix<float>(N, d, 2);
        const RowMatrix<float> bias = random_matrix<float>(V, 1, 3);
        const QuantizedOutputProjection head(W, bias);
        const RowMatrix<float> logits = head.forward(h);
        const QuantizedEmbedding& table = head.table();
        for (Index n = 0; n < N; ++n)
          for (Index v = 0; v < V; ++v) {
            // Double reference on the dequantized values.
            double exact = 0, abs_sum = 0, bound = 0;
            for (Index k = 0; k < d; ++k) {
              const double w = static_cast<double>(table.scales()(v, 0)) * table.values()(v, k);
              exact += static_cast<double>(h(n, k)) * w;
              abs_sum += std::abs(static_cast<double>(h(n, k)) * w);
              bound += std::abs(static_cast<double>(h(n, k)));
            }
            exact += bias(v, 0);
            CHECK(std::abs(logits(n, v) - exact) <= 1e-6 * (abs_sum + std::abs(bias(v, 0))) + 1e-7);
            // Against the float head: the quantization error bound.
            double unquantized = bias(v, 0);
            for (Index k = 0; k < d; ++k) unquantized += static_cast<double>(h(n, k)) * W(v, k);
            CHECK(std::abs(logits(n, v) - unquantized) <=
                  bound * table.scales()(v, 0) / 2 * (1 + 1e-5) + 1e-6 * (abs_sum + std::abs(bias(v, 0))) + 1e-7);
            // Bit for bit, the written-out sequence.
            const float expected = reference_sequence(h.row(n).data(), table.values().row(v).data(), d,
                                                      table.scales()(v, 0), &bias(v, 0));
            CHECK(std::memcmp(&expected, &logits(n, v), sizeof(float)) == 0);
          }
      }
}

TEST_CASE("quantized head: a token's logits are the same bits in any batch; tied heads share the table",
          "[quantized_head][batch_invariance]") {
  const Index V = 300, d = 200, total = 64;
  const RowMatrix<float> W = random_matrix<float>(V, d, 4, 0.1), h = random_matrix<float>(total, d, 5);
  auto table = std::make_shared<const QuantizedEmbedding>(W);
  const QuantizedOutputProjection tied(table);
  CHECK(&tied.table() == table.get());
  CHECK(tied.shared_table() == table);
  CHECK_FALSE(tied.has_bias());
  const RowMatrix<float> whole = tied.forward(h);
  for (const Index N : {Index{1}, Index{2}, Index{3}, Index{5}, Index{7}, Index{8}, Index{9}})
    for (Index o = 0; o + N <= total; o += N + 3) {
      CAPTURE(N, o);
      const RowMatrix<float> part = tied.forward(h.middleRows(o, N));
      CHECK(test_support::first_difference(part, whole.middleRows(o, N)) == "");
    }
  // The same table through the free function.
  RowMatrix<float> free_call(total, V);
  embedhead::quantized_head_forward(h, table->values(), table->scales(), RowMatrix<float>(0, 1), free_call);
  CHECK(test_support::same_values(free_call, whole));
  CHECK(tied.bytes() == V * d + V * static_cast<Index>(sizeof(float)));
}

TEST_CASE("quantized head: bad input throws and writes nothing", "[quantized_head][errors]") {
  const RowMatrix<float> W = random_matrix<float>(10, 6, 6), h = random_matrix<float>(2, 6, 7);
  const QuantizedOutputProjection head(W);
  RowMatrix<float> logits = RowMatrix<float>::Constant(2, 10, 5.0f);
  const RowMatrix<float> before = logits;
  REQUIRE_THROWS_MATCHES(head.forward(h.leftCols(5), logits), embedhead::shape_error,
                         Catch::Message("quantized_head_forward: Q has shape [10, 6], expected [10, 5]"));
  REQUIRE_THROWS_MATCHES(head.forward(h.leftCols(5)), embedhead::shape_error,
                         Catch::Message("quantized_head_forward: h has shape [2, 5], expected [2, 6]"));
  RowMatrix<float> wrong(2, 9);
  REQUIRE_THROWS_MATCHES(head.forward(h, wrong), embedhead::shape_error,
                         Catch::Message("quantized_head_forward: logits has shape [2, 9], expected [2, 10]"));
  REQUIRE_THROWS_MATCHES(QuantizedOutputProjection(W, RowMatrix<float>(9, 1)), embedhead::shape_error,
                         Catch::Message("QuantizedOutputProjection: bias has shape [9, 1], expected [10, 1]"));
  REQUIRE_THROWS_MATCHES(QuantizedOutputProjection(std::shared_ptr<const QuantizedEmbedding>()), embedhead::value_error,
                         Catch::Message("QuantizedOutputProjection: table is null"));
  RowMatrix<float> nan_W = W;
  nan_W(3, 2) = std::nanf("");
  REQUIRE_THROWS_AS(QuantizedOutputProjection(nan_W), embedhead::value_error);
  embedhead::QuantizedEmbedding table(W);
  REQUIRE_THROWS_MATCHES(embedhead::quantized_head_forward(h, table.values(), table.scales().topRows(9),
                                                           RowMatrix<float>(0, 1), logits),
                         embedhead::shape_error,
                         Catch::Message("quantized_head_forward: scales has shape [9, 1], expected [10, 1]"));
  CHECK(test_support::same_values(logits, before));
}

TEST_CASE("compare_heads: KL, top-1 agreement and |delta p| against a direct computation", "[quantized_head]") {
  const Index V = 40, d = 12, N = 19;
  const RowMatrix<float> h = random_matrix<float>(N, d, 8);
  const RowMatrix<float> Wa = random_matrix<float>(V, d, 9), Wb = Wa + random_matrix<float>(V, d, 10, 0.3);
  // Heads whose logits do not depend on the chunk: each a double dot product rounded to float.
  const auto logits_of = [&](const RowMatrix<float>& W, const embedhead::ConstMatrixRef<float>& x,
                             embedhead::MatrixRef<float> out) {
    out = (x.cast<double>() * W.cast<double>().transpose()).cast<float>();
  };
  const auto head_a = [&](const embedhead::ConstMatrixRef<float>& x, embedhead::MatrixRef<float> out) {
    logits_of(Wa, x, out);
  };
  const auto head_b = [&](const embedhead::ConstMatrixRef<float>& x, embedhead::MatrixRef<float> out) {
    logits_of(Wb, x, out);
  };
  const embedhead::HeadComparison same = embedhead::compare_heads(h, V, head_a, head_a, 4);
  CHECK(same.tokens == N);
  CHECK(same.mean_kl == Approx(0).margin(1e-12));
  CHECK(same.same_top1 == 1.0);
  CHECK(same.max_abs_dp_top == 0.0);
  const embedhead::HeadComparison got = embedhead::compare_heads(h, V, head_a, head_b, 4);
  // Direct: probabilities in long double from the same float logits.
  RowMatrix<float> za(N, V), zb(N, V);
  head_a(h, za);
  head_b(h, zb);
  long double kl_sum = 0, kl_max = 0, dp_sum = 0, dp_max = 0;
  int agree = 0;
  for (Index n = 0; n < N; ++n) {
    long double sa = 0, sb = 0;
    for (Index v = 0; v < V; ++v)
      sa += std::exp(static_cast<long double>(za(n, v))), sb += std::exp(static_cast<long double>(zb(n, v)));
    long double kl = 0;
    Index ia = 0, ib = 0;
    for (Index v = 0; v < V; ++v) {
      const long double p = std::exp(static_cast<long double>(za(n, v))) / sa,
                        q = std::exp(static_cast<long double>(zb(n, v))) / sb;
      kl += p * std::log(p / q);
      if (za(n, v) > za(n, ia)) ia = v;
      if (zb(n, v) > zb(n, ib)) ib = v;
    }
    const long double dp = std::abs(std::exp(static_cast<long double>(za(n, ia))) / sa -
                                    std::exp(static_cast<long double>(zb(n, ia))) / sb);
    kl_sum += kl, kl_max = std::max(kl_max, kl), dp_sum += dp, dp_max = std::max(dp_max, dp), agree += ia == ib;
  }
  CHECK(got.mean_kl == Approx(static_cast<double>(kl_sum / N)).epsilon(1e-9));
  CHECK(got.max_kl == Approx(static_cast<double>(kl_max)).epsilon(1e-9));
  CHECK(got.mean_abs_dp_top == Approx(static_cast<double>(dp_sum / N)).epsilon(1e-9));
  CHECK(got.max_abs_dp_top == Approx(static_cast<double>(dp_max)).epsilon(1e-9));
  CHECK(got.same_top1 == Approx(agree / static_cast<double>(N)));
  CHECK(got.mean_kl > 1e-3);  // the heads really differ
  // The int8 head against the float head it was quantized from: small KL.
  const QuantizedOutputProjection q(Wa);
  const embedhead::HeadComparison int8 = embedhead::compare_heads(h, V, head_a,
                                                                  [&](const embedhead::ConstMatrixRef<float>& x,
                                                                      embedhead::MatrixRef<float> out) {
                                                                    q.forward(x, out);
                                                                  });
  CHECK(int8.mean_kl < 1e-3);
  REQUIRE_THROWS_MATCHES(embedhead::compare_heads(h, V, head_a, head_b, 0), embedhead::value_error,
                         Catch::Message("compare_heads: chunk = 0 outside [1, inf)"));
  const auto nan_head = [&](const embedhead::ConstMatrixRef<float>& x, embedhead::MatrixRef<float> out) {
    logits_of(Wa, x, out);
    out(0, 3) = std::nanf("");
  };
  REQUIRE_THROWS_MATCHES(embedhead::compare_heads(h, V, head_a, nan_head, 4), embedhead::value_error,
                         Catch::Message("compare_heads: head b gave a non-finite logit for token n=0"));
}
