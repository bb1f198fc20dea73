// Tests for include/embedhead/interleaved_head.hpp: the interleaved bf16 head's logits against the
// decode sequence written out here one value at a time (bit for bit), against the float head on the
// bf16-rounded W (bit for bit: the same sequence), against a double reference (within float
// rounding); batch invariance; the table's round trip; errors. Built twice: portable and, where the
// build targets this machine, with -march=native (the AVX-512 or AVX2 packets).
#include <embedhead/interleaved_head.hpp>
#include <embedhead/low_precision.hpp>
#include <embedhead/output_projection.hpp>

#include "reference/test_support.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>

using embedhead::Index;
using embedhead::InterleavedBf16Head;
using embedhead::RowMatrix;
using test_support::random_matrix;
using bf16 = Eigen::bfloat16;

namespace {

// a b + c as detail/gemm_packed.hpp defines it: one rounding where the build fuses, two otherwise.
float reference_madd(float a, float b, float c) {
  if constexpr (embedhead::detail::gemm::packed_gemm_fuses()) return std::fma(a, b, c);
  const float product = a * b;
  return product + c;
}

// The sequence at the top of interleaved_head.hpp for one logit: multiply-adds in increasing k
// from zero in each block of 256, the block sums added in order, then the bias.
float reference_logit(const float* h, const RowMatrix<float>& W, Index v, const float* bias) {
  const Index d = W.cols();
  float c = 0;
  for (Index k0 = 0; k0 < d; k0 += 256) {
    float s = 0;
    for (Index k = k0; k < std::min(d, k0 + 256); ++k) s = reference_madd(h[k], W(v, k), s);
    c = k0 == 0 ? s : c + s;
  }
  return bias ? c + *bias : c;
}

}  // namespace

TEST_CASE("interleaved bf16 head: logits are the written-out sequence and the float head's on float(W)",
          "[interleaved_head]") {
  // V: no whole group, one, one and a row, several with rows left over; d: one value, a block, a
  // block and a part, two blocks and one value; N: every token path (1, 2, groups of 4 and the rest).
  for (const Index V : {Index{1}, Index{15}, Index{16}, Index{17}, Index{77}, Index{130}})
    for (const Index d : {Index{1}, Index{7}, Index{256}, Index{300}, Index{513}})
      for (const bool with_bias : {false, true}) {
        CAPTURE(V, d, with_bias);
        const RowMatrix<float> W = random_matrix<float>(V, d, 1, 0.1), h = random_matrix<float>(11, d, 2);
        const RowMatrix<float> bias = with_bias ? random_matrix<float>(V, 1, 3) : RowMatrix<float>(0, 1);
        const InterleavedBf16Head head(W, bias);
        CHECK(head.vocab_size() == V);
        CHECK(head.dim() == d);
        CHECK(head.has_bias() == with_bias);
        CHECK(head.bytes() == V * d * 2 + (with_bias ? V * 4 : 0));
        // The table is bf16(W), nearest even, whatever the layout.
        const RowMatrix<bf16> table = head.weight();
        RowMatrix<float> Wr(V, d);
        bool rounded = true;
        for (Index v = 0; v < V; ++v)
          for (Index k = 0; k < d; ++k) {
            Wr(v, k) = static_cast<float>(table(v, k));
            rounded = rounded && Wr(v, k) == static_cast<float>(bf16(W(v, k)));
          }
        CHECK(rounded);
        for (const Index N : {Index{1}, Index{2}, Index{3}, Index{5}, Index{11}}) {
          CAPTURE(N);
          const RowMatrix<float> logits = head.forward(h.topRows(N));
          bool sequence = true, float_head = true, close = true;
          for (Index n = 0; n < N; ++n) {
            RowMatrix<float> row(1, V);
            embedhead::output_projection_decode<float>(h.row(n), Wr, bias, row);
            for (Index v = 0; v < V; ++v) {
              const float expected = reference_logit(h.row(n).data(), Wr, v, with_bias ? &bias(v, 0) : nullptr);
              sequence = sequence && std::memcmp(&expected, &logits(n, v), sizeof(float)) == 0;
              float_head = float_head && std::memcmp(&row(0, v), &logits(n, v), sizeof(float)) == 0;
              double exact = with_bias ? bias(v, 0) : 0.0, magnitude = std::abs(exact);
              for (Index k = 0; k < d; ++k) {
                exact += static_cast<double>(h(n, k)) * Wr(v, k);
                magnitude += std::abs(static_cast<double>(h(n, k)) * Wr(v, k));
              }
              close = close && std::abs(logits(n, v) - exact) <= 1e-6 * magnitude + 1e-30;
            }
          }
          CHECK(sequence);
          CHECK(float_head);
          CHECK(close);
        }
      }
}

TEST_CASE("interleaved bf16 head: a token's logits are the same bits in any batch",
          "[interleaved_head][batch_invariance]") {
  const Index V = 1000, d = 300, total = 64;
  const InterleavedBf16Head head(random_matrix<float>(V, d, 4, 0.1), random_matrix<float>(V, 1, 6));
  const RowMatrix<float> h = random_matrix<float>(total, d, 5);
  const RowMatrix<float> whole = head.forward(h);
  for (const Index N : {Index{1}, Index{2}, Index{3}, Index{4}, Index{5}, Index{7}, Index{8}, Index{9}})
    for (Index o = 0; o + N <= total; o += N + 3) {
      CAPTURE(N, o);
      RowMatrix<float> part(N, V);
      head.forward(h.middleRows(o, N), part);
      CHECK(test_support::first_difference(part, whole.middleRows(o, N)) == "");
    }
}

TEST_CASE("interleaved bf16 head: strided h and logits (blocks of larger matrices)", "[interleaved_head]") {
  // h and logits as blocks with an outer stride other than their width; the logits' neighbours
  // must stay untouched.
  const Index V = 77, d = 300;
  const InterleavedBf16Head head(random_matrix<float>(V, d, 14, 0.1), random_matrix<float>(V, 1, 15));
  const RowMatrix<float> big_h = random_matrix<float>(9, d + 5, 16);
  for (const Index N : {Index{1}, Index{2}, Index{5}}) {
    CAPTURE(N);
    const RowMatrix<float> h = big_h.block(1, 3, N, d);
    const RowMatrix<float> expected = head.forward(h);
    RowMatrix<float> big_logits = RowMatrix<float>::Constant(N + 2, V + 7, 9.0f);
    head.forward(big_h.block(1, 3, N, d), big_logits.block(1, 4, N, V));
    CHECK(test_support::first_difference(RowMatrix<float>(big_logits.block(1, 4, N, V)), expected) == "");
    RowMatrix<float> outside = big_logits;
    outside.block(1, 4, N, V).setConstant(9.0f);
    CHECK((outside.array() == 9.0f).all());
  }
}

TEST_CASE("interleaved bf16 head: from a bf16 table, the same head", "[interleaved_head]") {
  const Index V = 45, d = 33;
  const RowMatrix<float> W = random_matrix<float>(V, d, 7), bias = random_matrix<float>(V, 1, 8);
  const embedhead::LowPrecisionOutputProjection<bf16> row_major(W, bias);
  const InterleavedBf16Head from_float(W, bias), from_bf16(row_major.weight().value(), bias);
  CHECK(from_bf16.weight() == row_major.weight().value());
  CHECK(from_float.weight() == from_bf16.weight());
  const RowMatrix<float> h = random_matrix<float>(3, d, 9);
  CHECK(test_support::first_difference(from_float.forward(h), from_bf16.forward(h)) == "");
}

TEST_CASE("interleaved bf16 head: bad input throws and changes nothing", "[interleaved_head][errors]") {
  const Index V = 20, d = 6;
  const RowMatrix<float> W = random_matrix<float>(V, d, 10);
  CHECK_THROWS_MATCHES(InterleavedBf16Head(RowMatrix<float>(0, d)), embedhead::value_error,
                       Catch::Message("InterleavedBf16Head: V = 0 outside [1, inf)"));
  CHECK_THROWS_MATCHES(InterleavedBf16Head(RowMatrix<float>(V, 0)), embedhead::value_error,
                       Catch::Message("InterleavedBf16Head: d = 0 outside [1, inf)"));
  CHECK_THROWS_MATCHES(InterleavedBf16Head(W, RowMatrix<float>(V, 2)), embedhead::shape_error,
                       Catch::Message("InterleavedBf16Head: bias has shape [20, 2], expected [20, 1]"));
  RowMatrix<float> huge = W;
  huge(3, 4) = 3.4e38f;  // rounds past bf16's largest finite value, below float's
  CHECK_THROWS_MATCHES(InterleavedBf16Head(huge), embedhead::value_error,
                       Catch::Message("InterleavedBf16Head: value 3.4e+38 at (3, 4) overflows bf16 (largest finite "
                                      "3.38953e+38)"));
  // NaN and infinities are kept, as in convert_table, and reach the logits as in the float head.
  RowMatrix<float> special = W;
  special(0, 0) = std::numeric_limits<float>::quiet_NaN();
  special(17, 1) = std::numeric_limits<float>::infinity();
  const InterleavedBf16Head kept(special);
  const RowMatrix<float> special_logits = kept.forward(random_matrix<float>(1, d, 11));
  CHECK(std::isnan(special_logits(0, 0)));
  CHECK(std::isinf(special_logits(0, 17)));

  const InterleavedBf16Head head(W);
  const RowMatrix<float> h = random_matrix<float>(2, d, 12);
  RowMatrix<float> logits = RowMatrix<float>::Constant(2, V, 5.0f);
  const RowMatrix<float> before = logits;
  CHECK_THROWS_MATCHES(head.forward(random_matrix<float>(2, d + 1, 13), logits), embedhead::shape_error,
                       Catch::Message("InterleavedBf16Head::forward: h has shape [2, 7], expected [2, 6]"));
  CHECK_THROWS_MATCHES(head.forward(random_matrix<float>(2, d + 1, 13)), embedhead::shape_error,
                       Catch::Message("InterleavedBf16Head::forward: h has shape [2, 7], expected [2, 6]"));
  RowMatrix<float> wrong(2, V + 1);
  wrong.setConstant(5.0f);
  CHECK_THROWS_MATCHES(head.forward(h, wrong), embedhead::shape_error,
                       Catch::Message("InterleavedBf16Head::forward: logits has shape [2, 21], expected [2, 20]"));
  CHECK((wrong.array() == 5.0f).all());
  CHECK(logits == before);
  CHECK(head.forward(RowMatrix<float>(0, d)).rows() == 0);
}
