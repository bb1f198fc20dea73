// Tests for per-row position ids in include/embedhead/position_embedding.hpp: positions [B, T]
// (int32 / int64 TokenIds, strided blocks) for the learned and sinusoidal tables, the learned
// backward (naive loop, finite differences), positions_from_attention_mask (Hugging Face's rule),
// the left-padding invariance, agreement with the `start` API, packed documents, and every error
// with its message and unchanged state. Expected values come from loops written here.
#include <embedhead/position_embedding.hpp>

#include "reference/naive.hpp"
#include "reference/test_support.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

using Catch::Contains;
using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::RowMatrix;
using test_support::random_matrix;
using test_support::same_values;

namespace {

// Positions in [0, T_max) with repeats, from a fixed linear congruential sequence.
template <typename Id>
IdMatrix<Id> some_positions(Index B, Index T, Index T_max, std::uint64_t seed) {
  IdMatrix<Id> positions(B, T);
  std::uint64_t state = seed;
  for (Index b = 0; b < B; ++b)
    for (Index t = 0; t < T; ++t) {
      state = state * 6364136223846793005ULL + 1442695040888963407ULL;
      positions(b, t) = static_cast<Id>((state >> 33) % static_cast<std::uint64_t>(T_max));
    }
  return positions;
}

// out[b*T + t] = x[b*T + t] + P[positions(b, t)], one element at a time.
template <typename Scalar, typename Positions>
RowMatrix<Scalar> naive_forward(const RowMatrix<Scalar>& x, const RowMatrix<Scalar>& P, const Positions& positions) {
  const Index B = positions.rows(), T = positions.cols();
  RowMatrix<Scalar> out(B * T, P.cols());
  for (Index b = 0; b < B; ++b)
    for (Index t = 0; t < T; ++t)
      for (Index c = 0; c < P.cols(); ++c)
        out(b * T + t, c) = x(b * T + t, c) + P(static_cast<Index>(positions(b, t)), c);
  return out;
}

// dP[positions(b, t)] += dout[b*T + t] in token order, one element at a time.
template <typename Scalar, typename Positions>
void naive_backward(RowMatrix<Scalar>& dP, const RowMatrix<Scalar>& dout, const Positions& positions) {
  const Index B = positions.rows(), T = positions.cols();
  for (Index b = 0; b < B; ++b)
    for (Index t = 0; t < T; ++t)
      for (Index c = 0; c < dP.cols(); ++c) dP(static_cast<Index>(positions(b, t)), c) += dout(b * T + t, c);
}

// The sorted distinct values of positions.
template <typename Positions>
std::vector<Index> distinct(const Positions& positions) {
  std::vector<Index> values;
  for (Index b = 0; b < positions.rows(); ++b)
    for (Index t = 0; t < positions.cols(); ++t) values.push_back(static_cast<Index>(positions(b, t)));
  std::sort(values.begin(), values.end());
  values.erase(std::unique(values.begin(), values.end()), values.end());
  return values;
}

}  // namespace

TEMPLATE_TEST_CASE("positions [B, T]: learned forward against a naive loop", "[position][position_ids][learned]", float,
                   double) {
  using S = TestType;
  for (Index d : {1, 7, 8, 9, 17}) {
    const Index T_max = 10, B = 3, T = 6;
    embedhead::LearnedPositionEmbedding<S> pos(T_max, d);
    const RowMatrix<S> P = pos.weight().value();
    const RowMatrix<S> x = random_matrix<S>(B * T, d, 100 + static_cast<std::uint64_t>(d));
    const IdMatrix<std::int64_t> p64 = some_positions<std::int64_t>(B, T, T_max, 7);
    const IdMatrix<std::int32_t> p32 = p64.template cast<std::int32_t>();
    const RowMatrix<S> expected = naive_forward(x, P, p64);

    CHECK(same_values(pos.forward(x, p64), expected));
    CHECK(same_values(pos.forward(x, p32), expected));
    RowMatrix<S> into(B * T, d);
    pos.forward(x, p32, into);
    CHECK(same_values(into, expected));
    RowMatrix<S> buffer = x;  // in place
    pos.forward(buffer, p64, buffer);
    CHECK(same_values(buffer, expected));
    RowMatrix<S> free_out(B * T, d);
    embedhead::add_position_rows<S>(x, P, p64, free_out);
    CHECK(same_values(free_out, expected));

    // A strided view: columns 2 .. 2+T of a wider int64 matrix, and a column-major int32 copy.
    IdMatrix<std::int64_t> wide = IdMatrix<std::int64_t>::Constant(B, T + 4, 999);
    wide.middleCols(2, T) = p64;
    CHECK(same_values(pos.forward(x, wide.middleCols(2, T)), expected));
    const Eigen::Matrix<std::int32_t, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor> col_major = p32;
    CHECK(same_values(pos.forward(x, col_major), expected));
  }
}

TEMPLATE_TEST_CASE("positions [B, T]: sinusoidal forward against a naive loop", "[position][position_ids][sinusoidal]",
                   float, double) {
  using S = TestType;
  for (auto layout : {embedhead::SinusoidLayout::interleaved, embedhead::SinusoidLayout::concatenated}) {
    const Index T_max = 12, d = 9, B = 2, T = 7;
    const embedhead::SinusoidalPositionEmbedding<S> pe(T_max, d, layout);
    const RowMatrix<S> x = random_matrix<S>(B * T, d, 31);
    const IdMatrix<std::int32_t> positions = some_positions<std::int32_t>(B, T, T_max, 3);
    const RowMatrix<S> expected = naive_forward(x, pe.table(), positions);
    CHECK(same_values(pe.forward(x, positions), expected));
    const IdMatrix<std::int64_t> p64 = positions.template cast<std::int64_t>();
    RowMatrix<S> buffer = x;
    pe.forward(buffer, p64, buffer);
    CHECK(same_values(buffer, expected));
  }
}

TEMPLATE_TEST_CASE("positions [B, T]: learned backward is the naive loop bit for bit, row-sparse",
                   "[position][position_ids][learned][backward]", float, double) {
  using S = TestType;
  for (Index d : {1, 8, 9, 17}) {
    const Index T_max = 16, B = 4, T = 9;
    embedhead::LearnedPositionEmbedding<S> pos(T_max, d);
    RowMatrix<S> expected = RowMatrix<S>::Zero(T_max, d);

    // Positions drawn from [0, 6): many repeats, rows 6 .. 15 untouched.
    const IdMatrix<std::int64_t> p1 = some_positions<std::int64_t>(B, T, 6, 11);
    const RowMatrix<S> dout1 = random_matrix<S>(B * T, d, 200 + static_cast<std::uint64_t>(d));
    pos.backward(dout1, p1);
    naive_backward(expected, dout1, p1);
    CHECK(pos.weight().grad().touched_rows() == distinct(p1));
    CHECK(same_values(pos.weight().grad().to_dense(), expected));

    // A second call, int32, over rows 4 .. 15: sums accumulate, touched rows are the union.
    IdMatrix<std::int32_t> p2 = some_positions<std::int32_t>(2, 5, 12, 5);
    p2.array() += 4;
    const RowMatrix<S> dout2 = random_matrix<S>(2 * 5, d, 300 + static_cast<std::uint64_t>(d));
    pos.backward(dout2, p2);
    naive_backward(expected, dout2, p2);
    std::vector<Index> both = distinct(p1), second = distinct(p2);
    both.insert(both.end(), second.begin(), second.end());
    std::sort(both.begin(), both.end());
    both.erase(std::unique(both.begin(), both.end()), both.end());
    CHECK(pos.weight().grad().touched_rows() == both);
    CHECK(same_values(pos.weight().grad().to_dense(), expected));

    // The same calls on a fresh layer give the same bits (the order is fixed by the positions).
    embedhead::LearnedPositionEmbedding<S> again(T_max, d);
    again.backward(dout1, p1);
    again.backward(dout2, p2);
    CHECK(same_values(again.weight().grad().to_dense(), pos.weight().grad().to_dense()));
  }

  SECTION("worked example: positions [[0, 1, 1], [2, 0, 0]], dout = 1 -> rows 0, 1, 2 get 3, 2, 1") {
    embedhead::LearnedPositionEmbedding<S> pos(4, 2);
    IdMatrix<std::int64_t> positions(2, 3);
    positions << 0, 1, 1, 2, 0, 0;
    pos.backward(RowMatrix<S>::Ones(6, 2), positions);
    RowMatrix<S> expected(4, 2);
    expected << 3, 3, 2, 2, 1, 1, 0, 0;
    CHECK(same_values(pos.weight().grad().to_dense(), expected));
    CHECK(pos.weight().grad().touched_rows() == (std::vector<Index>{0, 1, 2}));
  }

  SECTION("empty positions and a frozen table touch no row") {
    embedhead::LearnedPositionEmbedding<S> pos(4, 2);
    pos.backward(RowMatrix<S>(0, 2), IdMatrix<std::int64_t>(0, 3));
    pos.backward(RowMatrix<S>(0, 2), IdMatrix<std::int32_t>(2, 0));
    CHECK(pos.weight().grad().num_touched() == 0);
    pos.set_frozen(true);
    IdMatrix<std::int64_t> positions(1, 2);
    positions << 1, 3;
    pos.backward(RowMatrix<S>::Ones(2, 2), positions);
    CHECK(pos.weight().grad().num_touched() == 0);
    positions(0, 1) = 4;  // the checks still run when frozen
    CHECK_THROWS_AS(pos.backward(RowMatrix<S>::Ones(2, 2), positions), embedhead::index_error);
  }
}

TEST_CASE("positions [B, T]: learned backward by finite differences in double",
          "[position][position_ids][learned][gradient]") {
  // L(P, x) = sum(W o forward(x, positions)): dL/dP[p] = sum of W over the tokens at position p.
  const Index T_max = 9, d = 4, B = 3, T = 5;
  embedhead::LearnedPositionOptions options;
  options.init_std = 0.5;
  embedhead::LearnedPositionEmbedding<double> pos(T_max, d, options);
  IdMatrix<std::int32_t> positions(B, T);
  positions << 1, 1, 0, 1, 2,  // left-padded (pads at 1)
      0, 1, 2, 0, 1,           // packed: two documents
      7, 3, 3, 8, 3;           // repeats and the last row of the table
  RowMatrix<double> x = random_matrix<double>(B * T, d, 41);
  const RowMatrix<double> W = random_matrix<double>(B * T, d, 42);
  RowMatrix<double> P = pos.weight().value();
  auto loss = [&]() {
    pos.weight().value() = P;
    return pos.forward(x, positions).cwiseProduct(W).sum();
  };
  const RowMatrix<double> numeric_dP = naive::numerical_gradient(P, loss);
  const RowMatrix<double> numeric_dx = naive::numerical_gradient(x, loss);
  pos.weight().value() = P;
  pos.backward(W, positions);
  const RowMatrix<double> analytic_dP = pos.weight().grad().to_dense();
  CHECK(naive::max_relative_error(analytic_dP, numeric_dP) < 1e-6);
  // Rows no token uses (4, 5, 6) have no gradient, numerically or analytically.
  for (Index r : {4, 5, 6}) {
    CHECK(numeric_dP.row(r).isZero(0));
    CHECK(analytic_dP.row(r).isZero(0));
  }
  CHECK(pos.weight().grad().touched_rows() == (std::vector<Index>{0, 1, 2, 3, 7, 8}));
  CHECK(naive::max_relative_error(W, numeric_dx) < 1e-6);  // dx = dout
}

TEST_CASE("positions_from_attention_mask: cumsum(mask) - 1 on tokens, 1 on pads (Hugging Face's rule)",
          "[position][position_ids][mask]") {
  SECTION("worked examples, values written by hand") {
    IdMatrix<std::int64_t> mask(5, 5);
    mask << 0, 0, 1, 1, 1,  // left padding
        1, 1, 1, 1, 1,      // no padding
        1, 1, 1, 0, 0,      // right padding
        0, 0, 0, 0, 0,      // all pads
        1, 0, 1, 0, 1;      // holes: tokens keep counting
    IdMatrix<std::int64_t> expected(5, 5);
    expected << 1, 1, 0, 1, 2,  //
        0, 1, 2, 3, 4,          //
        0, 1, 2, 1, 1,          //
        1, 1, 1, 1, 1,          //
        0, 1, 1, 1, 2;
    CHECK(embedhead::positions_from_attention_mask(mask) == expected);
    CHECK(embedhead::kPadPosition == 1);
    const IdMatrix<std::int32_t> mask32 = mask.cast<std::int32_t>();
    CHECK(embedhead::positions_from_attention_mask(mask32) == expected);

    // pad_position = 0 (for a one-row table): only the pads change.
    IdMatrix<std::int64_t> expected0(5, 5);
    expected0 << 0, 0, 0, 1, 2,  //
        0, 1, 2, 3, 4,           //
        0, 1, 2, 0, 0,           //
        0, 0, 0, 0, 0,           //
        0, 0, 1, 0, 2;
    CHECK(embedhead::positions_from_attention_mask(mask32, 0) == expected0);

    // A strided block (the last three columns): its own cumsum, from its first column.
    IdMatrix<std::int64_t> expected_tail(5, 3);
    expected_tail << 0, 1, 2,  //
        0, 1, 2,               //
        0, 1, 1,               //
        1, 1, 1,               //
        0, 1, 1;
    CHECK(embedhead::positions_from_attention_mask(mask.rightCols(3)) == expected_tail);
  }

  SECTION("empty masks") {
    CHECK(embedhead::positions_from_attention_mask(IdMatrix<std::int64_t>(0, 4)).rows() == 0);
    CHECK(embedhead::positions_from_attention_mask(IdMatrix<std::int32_t>(3, 0)).rows() == 3);
  }

  SECTION("a value other than 0 or 1 is a value_error naming (b, t) and the value") {
    IdMatrix<std::int32_t> mask = IdMatrix<std::int32_t>::Ones(2, 4);
    mask(1, 2) = 2;
    mask(1, 3) = 5;  // later in row-major order: not the one named
    REQUIRE_THROWS_AS(embedhead::positions_from_attention_mask(mask), embedhead::value_error);
    REQUIRE_THROWS_WITH(embedhead::positions_from_attention_mask(mask),
                        Contains("positions_from_attention_mask") && Contains("mask value 2") &&
                            Contains("(b=1, t=2)") && Contains("0 (pad) or 1 (token)"));
    IdMatrix<std::int64_t> negative = IdMatrix<std::int64_t>::Zero(1, 3);
    negative(0, 1) = -1;
    REQUIRE_THROWS_WITH(embedhead::positions_from_attention_mask(negative),
                        Contains("mask value -1") && Contains("(b=0, t=1)"));
    const IdMatrix<std::int64_t> ones = IdMatrix<std::int64_t>::Ones(1, 2);
    REQUIRE_THROWS_AS(embedhead::positions_from_attention_mask(ones, -1), embedhead::value_error);
    REQUIRE_THROWS_WITH(embedhead::positions_from_attention_mask(ones, -1), Contains("pad_position = -1"));
  }
}

TEMPLATE_TEST_CASE("positions [B, T]: a left-padded row gives its real tokens the outputs of the sequence run alone",
                   "[position][position_ids][padding]", float, double) {
  using S = TestType;
  const Index T_max = 8, d = 9, B = 3, T = 6;
  const Index lengths[B] = {6, 4, 1};  // real tokens per row, left-padded to T
  IdMatrix<std::int64_t> mask = IdMatrix<std::int64_t>::Zero(B, T);
  for (Index b = 0; b < B; ++b) mask.row(b).tail(lengths[b]).setOnes();
  const IdMatrix<std::int64_t> positions = embedhead::positions_from_attention_mask(mask);
  const RowMatrix<S> x = random_matrix<S>(B * T, d, 51);

  embedhead::LearnedPositionEmbedding<S> learned(T_max, d);
  const embedhead::SinusoidalPositionEmbedding<S> sinusoidal(T_max, d);
  const RowMatrix<S> learned_out = learned.forward(x, positions);
  const RowMatrix<S> sinusoidal_out = sinusoidal.forward(x, positions);
  for (Index b = 0; b < B; ++b) {
    const Index pad = T - lengths[b];
    const RowMatrix<S> alone = x.middleRows(b * T + pad, lengths[b]);  // the sequence without pads
    CHECK(same_values(learned_out.middleRows(b * T + pad, lengths[b]), learned.forward(alone, 1, lengths[b], 0)));
    CHECK(same_values(sinusoidal_out.middleRows(b * T + pad, lengths[b]), sinusoidal.forward(alone, 1, lengths[b], 0)));
  }

  // The gradient of a padded row whose pads carry dout = 0 equals the sequence's alone.
  RowMatrix<S> dout = random_matrix<S>(B * T, d, 52);
  for (Index b = 0; b < B; ++b) dout.middleRows(b * T, T - lengths[b]).setZero();
  const Index b = 1, pad = T - lengths[b];
  IdMatrix<std::int64_t> one_row = positions.row(b);
  embedhead::LearnedPositionEmbedding<S> padded(T_max, d), alone(T_max, d);
  padded.backward(dout.middleRows(b * T, T), one_row);
  alone.backward(dout.middleRows(b * T + pad, lengths[b]), 1, lengths[b], 0);
  CHECK(same_values(padded.weight().grad().to_dense(), alone.weight().grad().to_dense()));
}

TEMPLATE_TEST_CASE("positions [B, T] with positions(b, t) = start + t agree with the start API bit for bit",
                   "[position][position_ids][start]", float, double) {
  using S = TestType;
  const Index T_max = 12, d = 7, B = 3, T = 5;
  embedhead::LearnedPositionEmbedding<S> learned(T_max, d), learned_start(T_max, d);
  const embedhead::SinusoidalPositionEmbedding<S> sinusoidal(T_max, d, embedhead::SinusoidLayout::concatenated);
  const RowMatrix<S> x = random_matrix<S>(B * T, d, 61);
  for (Index start : {0, 3, 7}) {
    IdMatrix<std::int32_t> positions(B, T);
    for (Index b = 0; b < B; ++b)
      for (Index t = 0; t < T; ++t) positions(b, t) = static_cast<std::int32_t>(start + t);
    CHECK(same_values(learned.forward(x, positions), learned.forward(x, B, T, start)));
    CHECK(same_values(sinusoidal.forward(x, positions), sinusoidal.forward(x, B, T, start)));
    const RowMatrix<S> dout = random_matrix<S>(B * T, d, 70 + static_cast<std::uint64_t>(start));
    learned.backward(dout, positions);
    learned_start.backward(dout, B, T, start);
    CHECK(learned.weight().grad().touched_rows() == learned_start.weight().grad().touched_rows());
    CHECK(same_values(learned.weight().grad().to_dense(), learned_start.weight().grad().to_dense()));
  }
}

TEMPLATE_TEST_CASE("positions [B, T]: packed documents restart at 0 mid-row", "[position][position_ids][packed]", float,
                   double) {
  using S = TestType;
  const Index T_max = 6, d = 5, T = 8;
  // One row holding documents of 3, 4 and 1 tokens.
  IdMatrix<std::int64_t> positions(1, T);
  positions << 0, 1, 2, 0, 1, 2, 3, 0;
  const Index doc_begin[3] = {0, 3, 7}, doc_length[3] = {3, 4, 1};
  const RowMatrix<S> x = random_matrix<S>(T, d, 81);
  embedhead::LearnedPositionEmbedding<S> learned(T_max, d);
  const embedhead::SinusoidalPositionEmbedding<S> sinusoidal(T_max, d);
  const RowMatrix<S> learned_out = learned.forward(x, positions);
  const RowMatrix<S> sinusoidal_out = sinusoidal.forward(x, positions);
  CHECK(same_values(learned_out, naive_forward(x, RowMatrix<S>(learned.weight().value()), positions)));
  for (Index k = 0; k < 3; ++k) {
    const RowMatrix<S> doc = x.middleRows(doc_begin[k], doc_length[k]);
    CHECK(same_values(learned_out.middleRows(doc_begin[k], doc_length[k]), learned.forward(doc, 1, doc_length[k])));
    CHECK(
        same_values(sinusoidal_out.middleRows(doc_begin[k], doc_length[k]), sinusoidal.forward(doc, 1, doc_length[k])));
  }
  const RowMatrix<S> dout = random_matrix<S>(T, d, 82);
  learned.backward(dout, positions);
  RowMatrix<S> expected = RowMatrix<S>::Zero(T_max, d);
  naive_backward(expected, dout, positions);
  CHECK(same_values(learned.weight().grad().to_dense(), expected));
  CHECK(learned.weight().grad().touched_rows() == (std::vector<Index>{0, 1, 2, 3}));
}

TEMPLATE_TEST_CASE("positions [B, T]: bad input throws and changes nothing", "[position][position_ids][errors]", float,
                   double) {
  using S = TestType;
  const Index T_max = 8, d = 3, B = 2, T = 4;
  embedhead::LearnedPositionEmbedding<S> pos(T_max, d);
  const embedhead::SinusoidalPositionEmbedding<S> pe(T_max, d);
  pos.backward(random_matrix<S>(2 * 3, d, 91), 2, 3, 2);  // a non-empty gradient to keep
  const RowMatrix<S> P_before = pos.weight().value();
  const RowMatrix<S> grad_before = pos.weight().grad().to_dense();
  const std::vector<Index> touched_before = pos.weight().grad().touched_rows();
  const RowMatrix<S> table_before = pe.table();
  const S sentinel = S(-7.25);
  RowMatrix<S> out = RowMatrix<S>::Constant(B * T, d, sentinel);
  auto check_unchanged = [&] {
    CHECK(same_values(pos.weight().value(), P_before));
    CHECK(same_values(pos.weight().grad().to_dense(), grad_before));
    CHECK(pos.weight().grad().touched_rows() == touched_before);
    CHECK(same_values(pe.table(), table_before));
    CHECK((out.array() == sentinel).all());
  };
  const RowMatrix<S> x = RowMatrix<S>::Ones(B * T, d);

  SECTION("a position outside [0, T_max) or negative: index_error naming (b, t), the value and the range") {
    struct Case {
      Index b, t, value;
      const char* text;
    };
    for (const Case& bad : {Case{1, 2, 8, "position 8 at (b=1, t=2) outside [0, 8)"},
                            Case{0, 3, -1, "position -1 at (b=0, t=3) outside [0, 8)"},
                            Case{1, 0, 1000000, "position 1000000 at (b=1, t=0) outside [0, 8)"}}) {
      INFO(bad.text);
      IdMatrix<std::int64_t> p64 = some_positions<std::int64_t>(B, T, T_max, 9);
      p64(bad.b, bad.t) = bad.value;
      p64(1, 3) = 9;  // also bad, but later in row-major order than each case's (b, t)
      const IdMatrix<std::int32_t> p32 = p64.cast<std::int32_t>();
      REQUIRE_THROWS_AS(pos.forward(x, p64, out), embedhead::index_error);
      REQUIRE_THROWS_WITH(pos.forward(x, p64, out),
                          Contains("LearnedPositionEmbedding::forward") && Contains(bad.text));
      REQUIRE_THROWS_WITH(pos.forward(x, p32), Contains("LearnedPositionEmbedding::forward") && Contains(bad.text));
      REQUIRE_THROWS_AS(pos.backward(x, p32), embedhead::index_error);
      REQUIRE_THROWS_WITH(pos.backward(x, p64), Contains("LearnedPositionEmbedding::backward") && Contains(bad.text));
      REQUIRE_THROWS_AS(pe.forward(x, p32, out), embedhead::index_error);
      REQUIRE_THROWS_WITH(pe.forward(x, p64), Contains("SinusoidalPositionEmbedding::forward") && Contains(bad.text));
      REQUIRE_THROWS_WITH(embedhead::add_position_rows<S>(x, P_before, p64, out),
                          Contains("add_position_rows") && Contains(bad.text));
      check_unchanged();
    }
  }

  SECTION("HF's pad position 1 does not fit a one-row table: index_error naming the pad") {
    embedhead::LearnedPositionEmbedding<S> one_row(1, d);
    IdMatrix<std::int64_t> mask(1, 3);
    mask << 0, 1, 1;  // positions [1, 0, 1]
    const RowMatrix<S> x3 = RowMatrix<S>::Ones(3, d);
    REQUIRE_THROWS_WITH(one_row.forward(x3, embedhead::positions_from_attention_mask(mask)),
                        Contains("position 1 at (b=0, t=0) outside [0, 1)"));
    // With pad_position = 0 the padded row fits.
    mask << 0, 1, 0;
    const RowMatrix<S> fits = one_row.forward(x3, embedhead::positions_from_attention_mask(mask, 0));
    CHECK(fits.rows() == 3);
    CHECK(one_row.weight().grad().num_touched() == 0);
    check_unchanged();
  }

  SECTION("shape mismatches: shape_error") {
    const IdMatrix<std::int64_t> positions = some_positions<std::int64_t>(B, T, T_max, 13);
    const RowMatrix<S> short_x = RowMatrix<S>::Ones(B * T - 1, d);   // rows != B*T
    const RowMatrix<S> narrow_x = RowMatrix<S>::Ones(B * T, d - 1);  // cols != d
    RowMatrix<S> wrong_out = RowMatrix<S>::Constant(B * T, d + 1, sentinel);
    REQUIRE_THROWS_AS(pos.forward(short_x, positions, out), embedhead::shape_error);
    REQUIRE_THROWS_WITH(pos.forward(short_x, positions, out), Contains("x has shape [7, 3], expected [8, 3]") &&
                                                                  Contains("LearnedPositionEmbedding::forward"));
    REQUIRE_THROWS_WITH(pos.forward(short_x, positions), Contains("x has shape [7, 3], expected [8, 3]"));
    REQUIRE_THROWS_WITH(pos.forward(narrow_x, positions, out), Contains("x has shape [8, 2], expected [8, 3]"));
    REQUIRE_THROWS_AS(pos.forward(x, positions, wrong_out), embedhead::shape_error);
    REQUIRE_THROWS_WITH(pos.forward(x, positions, wrong_out), Contains("out has shape [8, 4], expected [8, 3]"));
    REQUIRE_THROWS_AS(pos.backward(short_x, positions), embedhead::shape_error);
    REQUIRE_THROWS_WITH(pos.backward(narrow_x, positions), Contains("LearnedPositionEmbedding::backward") &&
                                                               Contains("dout has shape [8, 2], expected [8, 3]"));
    REQUIRE_THROWS_AS(pe.forward(short_x, positions, out), embedhead::shape_error);
    REQUIRE_THROWS_WITH(pe.forward(narrow_x, positions), Contains("x has shape [8, 2], expected [8, 3]"));
    REQUIRE_THROWS_WITH(pe.forward(x, positions, wrong_out), Contains("out has shape [8, 4], expected [8, 3]"));
    REQUIRE_THROWS_AS(embedhead::add_position_rows<S>(short_x, P_before, positions, out), embedhead::shape_error);
    // positions [B, T] transposed: [4, 2] is still 8 tokens, so only a wrong count is a shape error;
    // [3, 3] is 9 tokens.
    const IdMatrix<std::int64_t> nine = IdMatrix<std::int64_t>::Zero(3, 3);
    REQUIRE_THROWS_WITH(pos.forward(x, nine, out), Contains("x has shape [8, 3], expected [9, 3]"));
    REQUIRE_THROWS_WITH(pos.backward(x, nine), Contains("dout has shape [8, 3], expected [9, 3]"));
    CHECK((wrong_out.array() == sentinel).all());
    check_unchanged();
  }
}
