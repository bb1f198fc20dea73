// Tests for include/embedhead/backends/onednn_head.hpp: the bf16 head GEMM through oneDNN. Built only with
// EMBEDHEAD_WITH_ONEDNN=ON and oneDNN found (it links embedhead::onednn).
//
// The reference is the same product in double on the bf16-rounded inputs (W stored in bf16, h
// rounded to bf16), so the only difference left is oneDNN's fp32 accumulation: a few fp32
// roundings per logit, bounded here by k * 2^-24 * sum |terms| with slack. A second check against
// fp32 h (not rounded) uses the bf16 input tolerance 2^-8 * sum |terms|.
#include <catch2/catch.hpp>
#include <embedhead/backends/onednn_head.hpp>

#include <cmath>
#include <limits>
#include <string>

#include "../reference/test_support.hpp"

namespace {

using Catch::Matchers::Contains;
using embedhead::bfloat16;
using embedhead::Index;
using embedhead::OneDnnHead;
using embedhead::RowMatrix;
using test_support::random_matrix;

// Max over entries of |got - exact| / bound, where exact and bound (= scale * sum |terms| plus a
// floor) come from double loops over h_ref, W_ref (as doubles) and the bias. <= 1 passes.
template <typename HM, typename WM>
double worst_error_ratio(const RowMatrix<float>& logits, const HM& h_ref, const WM& W_ref, const RowMatrix<float>* bias,
                         double scale) {
  double worst = 0;
  for (Index n = 0; n < logits.rows(); ++n)
    for (Index v = 0; v < logits.cols(); ++v) {
      double exact = bias ? static_cast<double>((*bias)(v, 0)) : 0.0, magnitude = std::abs(exact);
      for (Index j = 0; j < W_ref.cols(); ++j) {
        const double term = static_cast<double>(h_ref(n, j)) * static_cast<double>(W_ref(v, j));
        exact += term;
        magnitude += std::abs(term);
      }
      const double bound = scale * magnitude + 1e-30;
      worst = std::max(worst, std::abs(static_cast<double>(logits(n, v)) - exact) / bound);
    }
  return worst;
}

RowMatrix<double> as_double(const RowMatrix<bfloat16>& m) {
  RowMatrix<double> out(m.rows(), m.cols());
  for (Index i = 0; i < m.size(); ++i) out.data()[i] = static_cast<double>(static_cast<float>(m.data()[i]));
  return out;
}

// fp32 accumulation of d + 1 terms, with slack for any summation order.
double accumulation_scale(Index d) { return 2.0 * static_cast<double>(d + 2) * std::ldexp(1.0, -24); }

}  // namespace

TEST_CASE("to_bf16 rounds to nearest even and keeps representable values", "[onednn_head]") {
  RowMatrix<float> x(1, 4);
  x << 1.0f, 1.0f + std::ldexp(1.0f, -8), 1.0f + 3 * std::ldexp(1.0f, -9), -2.5f;
  const RowMatrix<bfloat16> y = embedhead::to_bf16(x);
  CHECK(static_cast<float>(y(0, 0)) == 1.0f);
  CHECK(static_cast<float>(y(0, 1)) == 1.0f);                         // tie -> even (1.0)
  CHECK(static_cast<float>(y(0, 2)) == 1.0f + std::ldexp(1.0f, -7));  // above half -> up
  CHECK(static_cast<float>(y(0, 3)) == -2.5f);
  RowMatrix<bfloat16> wrong(2, 4);
  CHECK_THROWS_WITH(embedhead::to_bf16(x, wrong), Contains("to_bf16: out has shape [2, 4], expected [1, 4]"));
}

TEST_CASE("to_bf16: a finite value beyond bf16's range becomes an infinity, as in PyTorch", "[onednn_head]") {
  // bf16's largest finite value is 255 * 2^120 (bits 0x7F7F); half-way to 2^128 is 511 * 2^119.
  // Below it: the largest value; at it (a tie, to the even 2^128) and beyond: +-inf, no error, as
  // c10::BFloat16's round to nearest even gives. NaN and +-inf stay.
  const float largest = std::ldexp(255.0f, 120), halfway = std::ldexp(511.0f, 119);
  RowMatrix<float> x(1, 6);
  x << std::nextafter(halfway, 0.0f), halfway, -3.4e38f, std::numeric_limits<float>::max(),
      std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN();
  const RowMatrix<bfloat16> y = embedhead::to_bf16(x);
  CHECK(static_cast<float>(y(0, 0)) == largest);
  CHECK(static_cast<float>(y(0, 1)) == std::numeric_limits<float>::infinity());
  CHECK(static_cast<float>(y(0, 2)) == -std::numeric_limits<float>::infinity());
  CHECK(static_cast<float>(y(0, 3)) == std::numeric_limits<float>::infinity());
  CHECK(static_cast<float>(y(0, 4)) == std::numeric_limits<float>::infinity());
  CHECK(std::isnan(static_cast<float>(y(0, 5))));
}

TEST_CASE("OneDnnHead: worked example", "[onednn_head]") {
  // h = [[1, 2], [3, -1]], W = [[1, 0], [0, 1], [1, 1]], b = [0.5, -1, 2]: all exact in bf16.
  RowMatrix<float> h(2, 2), bias(3, 1);
  h << 1, 2, 3, -1;
  bias << 0.5f, -1, 2;
  RowMatrix<float> W32(3, 2);
  W32 << 1, 0, 0, 1, 1, 1;
  const RowMatrix<bfloat16> W = embedhead::to_bf16(W32);
  RowMatrix<float> logits(2, 3), expected(2, 3);
  expected << 1.5f, 1, 5, 3.5f, -2, 4;
  OneDnnHead head;
  head.forward(h, W, bias, logits);
  CHECK(test_support::same_values(logits, expected));
  head.forward(h, W, RowMatrix<float>(0, 1), logits);  // no bias
  expected << 1, 2, 3, 3, -1, 2;
  CHECK(test_support::same_values(logits, expected));
  CHECK(head.cached_primitives() == 2);
}

TEST_CASE("OneDnnHead matches the double product of the bf16 inputs", "[onednn_head]") {
  // Sizes around the 16-float packet and oneDNN's 32-wide bf16 blocks, and the degenerate ones.
  const Index shapes[][3] = {{1, 1, 1},   {1, 1, 7},   {3, 1, 5},     {2, 15, 17},   {5, 16, 33},   {7, 17, 31},
                             {9, 31, 65}, {4, 32, 64}, {16, 33, 129}, {33, 768, 97}, {64, 96, 1000}};
  OneDnnHead head;
  std::uint64_t seed = 1;
  for (const auto& s : shapes) {
    const Index N = s[0], d = s[1], V = s[2];
    CAPTURE(N, d, V);
    const RowMatrix<float> h = random_matrix<float>(N, d, seed++);
    const RowMatrix<bfloat16> W = embedhead::to_bf16(random_matrix<float>(V, d, seed++, 0.1));
    const RowMatrix<float> bias = random_matrix<float>(V, 1, seed++, 0.5);
    const RowMatrix<bfloat16> h_bf16 = embedhead::to_bf16(h);
    const RowMatrix<double> h_ref = as_double(h_bf16), W_ref = as_double(W);
    RowMatrix<float> logits(N, V);

    head.forward(h, W, bias, logits);  // fp32 h, rounded inside
    CHECK(worst_error_ratio(logits, h_ref, W_ref, &bias, accumulation_scale(d)) <= 1.0);
    // Against the unrounded fp32 h: within bf16 input rounding (2^-8 relative per product).
    CHECK(worst_error_ratio(logits, h, W_ref, &bias, std::ldexp(1.0, -8) + accumulation_scale(d)) <= 1.0);

    RowMatrix<float> from_bf16(N, V);
    head.forward(h_bf16, W, RowMatrix<float>(0, 1), from_bf16);  // bf16 h, no bias
    CHECK(worst_error_ratio(from_bf16, h_ref, W_ref, nullptr, accumulation_scale(d)) <= 1.0);
  }
  CHECK(head.cached_primitives() == 2 * (sizeof shapes / sizeof shapes[0]));
}

TEST_CASE("OneDnnHead reads strided views in place and reuses primitives", "[onednn_head]") {
  const Index N = 6, d = 40, V = 50;
  const RowMatrix<float> h_big = random_matrix<float>(N + 2, d + 3, 7);
  const RowMatrix<bfloat16> W_big = embedhead::to_bf16(random_matrix<float>(V + 4, d + 5, 8, 0.1));
  const RowMatrix<float> bias_big = random_matrix<float>(V + 1, 2, 9);
  RowMatrix<float> logits_big = RowMatrix<float>::Constant(N + 1, V + 6, -7.0f);
  const auto h = h_big.block(1, 2, N, d);
  const auto W = W_big.block(2, 1, V, d);
  const auto bias = bias_big.block(0, 1, V, 1);  // a column of a row-major matrix: stride 2
  OneDnnHead head;
  head.forward(h, W, bias, logits_big.block(1, 3, N, V));
  const RowMatrix<float> bias_copy = bias;
  const RowMatrix<float> logits = logits_big.block(1, 3, N, V);
  CHECK(worst_error_ratio(logits, as_double(embedhead::to_bf16(h)), as_double(RowMatrix<bfloat16>(W)), &bias_copy,
                          accumulation_scale(d)) <= 1.0);
  // Nothing outside the block was written.
  CHECK((logits_big.row(0).array() == -7.0f).all());
  CHECK((logits_big.block(1, 0, N, 3).array() == -7.0f).all());
  CHECK((logits_big.block(1, 3 + V, N, 3).array() == -7.0f).all());
  head.forward(h, W, bias, logits_big.block(1, 3, N, V));
  CHECK(head.cached_primitives() == 1);

  // bf16 h given as a strided view goes to oneDNN as it is (no conversion copy).
  const RowMatrix<bfloat16> h_bf16_big = embedhead::to_bf16(h_big);
  RowMatrix<float> from_bf16(N, V);
  head.forward(h_bf16_big.block(1, 2, N, d), W, bias, from_bf16);
  CHECK(worst_error_ratio(from_bf16, as_double(RowMatrix<bfloat16>(h_bf16_big.block(1, 2, N, d))),
                          as_double(RowMatrix<bfloat16>(W)), &bias_copy, accumulation_scale(d)) <= 1.0);
  CHECK(head.cached_primitives() == 2);
}

TEST_CASE("OneDnnHead: shape errors name the argument and write nothing", "[onednn_head]") {
  const RowMatrix<float> h = random_matrix<float>(4, 8, 1);
  const RowMatrix<bfloat16> W = embedhead::to_bf16(random_matrix<float>(5, 8, 2));
  const RowMatrix<float> bias = random_matrix<float>(5, 1, 3);
  RowMatrix<float> logits = RowMatrix<float>::Constant(4, 5, 3.0f);
  const RowMatrix<float> before = logits;
  OneDnnHead head;
  CHECK_THROWS_AS(head.forward(random_matrix<float>(4, 7, 4), W, bias, logits), embedhead::shape_error);
  CHECK_THROWS_WITH(head.forward(random_matrix<float>(4, 7, 4), W, bias, logits),
                    Contains("OneDnnHead::forward: h has shape [4, 7], expected [4, 8]"));
  CHECK_THROWS_WITH(head.forward(embedhead::to_bf16(random_matrix<float>(4, 9, 4)), W, bias, logits),
                    Contains("h has shape [4, 9], expected [4, 8]"));
  CHECK_THROWS_WITH(head.forward(h, W, random_matrix<float>(4, 1, 5), logits),
                    Contains("OneDnnHead::forward: bias has shape [4, 1], expected [5, 1]"));
  RowMatrix<float> wrong(4, 6);
  CHECK_THROWS_WITH(head.forward(h, W, bias, wrong),
                    Contains("OneDnnHead::forward: logits has shape [4, 6], expected [4, 5]"));
  CHECK(test_support::same_values(logits, before));
  CHECK(head.cached_primitives() == 0);
}
