// Tests for include/embedhead/output_projection.hpp: the LM head logits = h W^T + b, its backward,
// weight tying to a TokenEmbedding (shared storage and a gradient that sums the embedding's sparse
// rows with the head's dense dlogits^T h), parameters(), and the error model.
//
// Expected values come from explicit loops accumulated in double (naive_* below), from
// tests/reference/naive.hpp, from central finite differences, or from hand arithmetic.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <embedhead/output_projection.hpp>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "reference/naive.hpp"
#include "reference/test_support.hpp"

namespace {

using Catch::Matchers::Contains;
using Catch::Matchers::WithinAbs;
using Catch::Matchers::WithinRel;
using embedhead::Index;
using embedhead::OutputProjection;
using embedhead::OutputProjectionOptions;
using embedhead::Parameter;
using embedhead::RowMatrix;
using embedhead::TokenEmbedding;
using embedhead::TokenEmbeddingOptions;
using test_support::random_matrix;
using test_support::same_values;

template <typename Scalar>
constexpr double unit_roundoff() {
  return std::numeric_limits<Scalar>::epsilon();
}

// A reference value and the absolute error a Scalar computation of it may carry.
struct Reference {
  RowMatrix<double> value;
  RowMatrix<double> tolerance;
};

// Error bound for a sum of k products accumulated in Scalar (any order): k * u * sum |terms|,
// doubled for slack, plus a tiny absolute floor so exact zeros compare.
template <typename Scalar>
double sum_bound(Index k, double abs_sum) {
  return 2.0 * static_cast<double>(k + 1) * unit_roundoff<Scalar>() * abs_sum + 1e-300;
}

// logits[n][v] = sum_j h[n][j] W[v][j] + b[v], with explicit loops in double.
template <typename Scalar, typename HM, typename WM>
Reference naive_logits(const HM& h, const WM& W, const RowMatrix<Scalar>* bias) {
  const Index N = h.rows(), V = W.rows(), d = W.cols();
  Reference r{RowMatrix<double>(N, V), RowMatrix<double>(N, V)};
  for (Index n = 0; n < N; ++n)
    for (Index v = 0; v < V; ++v) {
      double sum = bias ? static_cast<double>((*bias)(v, 0)) : 0.0;
      double abs_sum = std::abs(sum);
      for (Index j = 0; j < d; ++j) {
        const double term = static_cast<double>(h(n, j)) * static_cast<double>(W(v, j));
        sum += term;
        abs_sum += std::abs(term);
      }
      r.value(n, v) = sum;
      r.tolerance(n, v) = sum_bound<Scalar>(d + 1, abs_sum);
    }
  return r;
}

// dh[n][j] = sum_v dlogits[n][v] W[v][j].
template <typename Scalar, typename GM, typename WM>
Reference naive_dh(const GM& dlogits, const WM& W) {
  const Index N = dlogits.rows(), V = W.rows(), d = W.cols();
  Reference r{RowMatrix<double>(N, d), RowMatrix<double>(N, d)};
  for (Index n = 0; n < N; ++n)
    for (Index j = 0; j < d; ++j) {
      double sum = 0, abs_sum = 0;
      for (Index v = 0; v < V; ++v) {
        const double term = static_cast<double>(dlogits(n, v)) * static_cast<double>(W(v, j));
        sum += term;
        abs_sum += std::abs(term);
      }
      r.value(n, j) = sum;
      r.tolerance(n, j) = sum_bound<Scalar>(V, abs_sum);
    }
  return r;
}

// Adds dW[v][j] += sum_n dlogits[n][v] h[n][j] into r (value and tolerance), so several backward
// calls accumulate in the reference as they do in the layer.
template <typename Scalar, typename GM, typename HM>
void add_naive_dW(Reference& r, const GM& dlogits, const HM& h) {
  const Index N = h.rows(), V = dlogits.cols(), d = h.cols();
  for (Index v = 0; v < V; ++v)
    for (Index j = 0; j < d; ++j) {
      double sum = 0, abs_sum = 0;
      for (Index n = 0; n < N; ++n) {
        const double term = static_cast<double>(dlogits(n, v)) * static_cast<double>(h(n, j));
        sum += term;
        abs_sum += std::abs(term);
      }
      r.value(v, j) += sum;
      r.tolerance(v, j) += sum_bound<Scalar>(N + 1, abs_sum + std::abs(r.value(v, j)));
    }
}

// db[v] += sum_n dlogits[n][v].
template <typename Scalar, typename GM>
void add_naive_db(Reference& r, const GM& dlogits) {
  for (Index v = 0; v < dlogits.cols(); ++v) {
    double sum = 0, abs_sum = 0;
    for (Index n = 0; n < dlogits.rows(); ++n) {
      sum += static_cast<double>(dlogits(n, v));
      abs_sum += std::abs(static_cast<double>(dlogits(n, v)));
    }
    r.value(v, 0) += sum;
    r.tolerance(v, 0) += sum_bound<Scalar>(dlogits.rows() + 1, abs_sum + std::abs(r.value(v, 0)));
  }
}

Reference zero_reference(Index rows, Index cols) {
  return {RowMatrix<double>::Zero(rows, cols), RowMatrix<double>::Zero(rows, cols)};
}

// Every entry of `actual` within the reference's per-entry bound (or a few ulps relative). One
// assertion per matrix, naming the first entry out of bounds and how many are: an assertion per
// entry made this file 2.4 million assertions, most of its run time under the sanitizers.
template <typename Scalar, typename Actual>
void check_close(const Actual& actual, const Reference& expected) {
  REQUIRE(actual.rows() == expected.value.rows());
  REQUIRE(actual.cols() == expected.value.cols());
  Index outside = 0;
  std::ostringstream first;
  first.precision(17);
  for (Index i = 0; i < actual.rows(); ++i)
    for (Index j = 0; j < actual.cols(); ++j) {
      const double value = static_cast<double>(actual(i, j));
      // Both matchers are built for every entry, as Catch2's `||` of matchers did: WithinAbs
      // rejects a negative or NaN bound (an exception) even where WithinRel passes.
      const bool relative = WithinRel(expected.value(i, j), 8 * unit_roundoff<Scalar>()).match(value);
      const bool absolute = WithinAbs(expected.value(i, j), expected.tolerance(i, j)).match(value);
      if (relative || absolute) continue;
      if (outside++ == 0)
        first << "entry (" << i << ", " << j << "): " << value << ", reference " << expected.value(i, j) << " +- "
              << expected.tolerance(i, j);
    }
  INFO(first.str());
  CHECK(outside == 0);
}

struct Size {
  Index N, V, d;
};

// Edge sizes (V = 1, d = 1, N = 0) and widths around the SIMD packet sizes (4/8 floats, 2/4
// doubles) so both the vectorised body and the scalar tail of the GEMMs run.
const std::vector<Size> kSizes = {{1, 1, 1},   {3, 1, 4},   {1, 5, 1},  {4, 7, 7}, {5, 9, 8},  {3, 13, 9},
                                  {2, 16, 15}, {6, 17, 16}, {3, 8, 17}, {0, 3, 4}, {9, 33, 32}};

template <typename Scalar>
OutputProjection<Scalar> make_head(Index V, Index d, bool bias, std::uint64_t seed) {
  OutputProjectionOptions options;
  options.bias = bias;
  options.init_std = 0.5;  // O(1) weights so rounding errors are not hidden by tiny values
  options.seed = seed;
  OutputProjection<Scalar> head(V, d, options);
  // The bias starts at zero; give it values so that adding it is actually tested.
  if (bias) head.bias()->value() = random_matrix<Scalar>(V, 1, seed + 100);
  return head;
}

template <typename Scalar>
TokenEmbedding<Scalar> make_embedding(Index V, Index d, std::uint64_t seed, bool scaled = false) {
  TokenEmbeddingOptions options;
  options.init_std = 0.5;
  options.seed = seed;
  options.scale_by_sqrt_d = scaled;
  return TokenEmbedding<Scalar>(V, d, options);
}

}  // namespace

TEMPLATE_TEST_CASE("OutputProjection forward computes h W^T + b", "[output_projection][forward]", float, double) {
  using Scalar = TestType;

  SECTION("worked example by hand: V=3, d=2, W = [[0.1, 0.2], [0.3, -0.1], [0.0, 0.5]], b = (1, -1, 0.5)") {
    OutputProjection<Scalar> head(3, 2);
    head.weight().value() << Scalar(0.1), Scalar(0.2), Scalar(0.3), Scalar(-0.1), Scalar(0.0), Scalar(0.5);
    head.bias()->value() << Scalar(1), Scalar(-1), Scalar(0.5);
    RowMatrix<Scalar> h(2, 2);
    h << Scalar(1), Scalar(2), Scalar(-2), Scalar(4);
    const RowMatrix<Scalar> logits = head.forward(h);
    // Row 0: (0.1 + 0.4 + 1, 0.3 - 0.2 - 1, 0 + 1 + 0.5); row 1: (-0.2 + 0.8 + 1, -0.6 - 0.4 - 1, 2 + 0.5).
    const double expected[2][3] = {{1.5, -0.9, 1.5}, {1.6, -2.0, 2.5}};
    REQUIRE(logits.rows() == 2);
    REQUIRE(logits.cols() == 3);
    for (Index n = 0; n < 2; ++n)
      for (Index v = 0; v < 3; ++v)
        CHECK_THAT(static_cast<double>(logits(n, v)),
                   WithinRel(expected[n][v], 1e-6) || WithinAbs(expected[n][v], 1e-6));
  }

  SECTION("naive reference: explicit loops in double, with and without bias, over edge and packet sizes") {
    for (const Size& s : kSizes) {
      for (const bool bias : {true, false}) {
        CAPTURE(s.N, s.V, s.d, bias);
        const auto head = make_head<Scalar>(s.V, s.d, bias, 7 + static_cast<std::uint64_t>(s.V));
        REQUIRE(head.has_bias() == bias);
        REQUIRE(head.vocab_size() == s.V);
        REQUIRE(head.dim() == s.d);
        const RowMatrix<Scalar> h = random_matrix<Scalar>(s.N, s.d, 11);
        const RowMatrix<Scalar> W = head.weight().value();
        RowMatrix<Scalar> b;
        if (bias) b = head.bias()->value();
        const Reference expected = naive_logits<Scalar>(h, W, bias ? &b : nullptr);

        // Returning overload.
        check_close<Scalar>(head.forward(h), expected);

        // Writing overload into a Map over caller-owned memory (zero-copy output), pre-filled with
        // garbage that must be overwritten.
        std::vector<Scalar> buffer(static_cast<std::size_t>(s.N * s.V), Scalar(1e6));
        Eigen::Map<RowMatrix<Scalar>> logits(buffer.data(), s.N, s.V);
        head.forward(h, logits);
        check_close<Scalar>(logits, expected);
      }
    }
  }

  SECTION("free function output_projection_forward with an empty bias adds nothing") {
    const RowMatrix<Scalar> h = random_matrix<Scalar>(4, 9, 3);
    const RowMatrix<Scalar> W = random_matrix<Scalar>(6, 9, 4);
    const RowMatrix<Scalar> no_bias(0, 1);
    RowMatrix<Scalar> logits(4, 6);
    embedhead::output_projection_forward<Scalar>(h, W, no_bias, logits);
    check_close<Scalar>(logits, naive_logits<Scalar>(h, W, nullptr));
    const RowMatrix<Scalar> b = random_matrix<Scalar>(6, 1, 5);
    embedhead::output_projection_forward<Scalar>(h, W, b, logits);
    check_close<Scalar>(logits, naive_logits<Scalar>(h, W, &b));
  }
}

TEMPLATE_TEST_CASE("OutputProjection backward: dh = dlogits W, dW += dlogits^T h, db += column sums",
                   "[output_projection][backward]", float, double) {
  using Scalar = TestType;

  SECTION("naive reference, two accumulating calls, then zero_grad") {
    for (const Size& s : kSizes) {
      for (const bool bias : {true, false}) {
        CAPTURE(s.N, s.V, s.d, bias);
        auto head = make_head<Scalar>(s.V, s.d, bias, 21 + static_cast<std::uint64_t>(s.d));
        const RowMatrix<Scalar> W = head.weight().value();
        const RowMatrix<Scalar> h1 = random_matrix<Scalar>(s.N, s.d, 31);
        const RowMatrix<Scalar> g1 = random_matrix<Scalar>(s.N, s.V, 32);
        const RowMatrix<Scalar> h2 = random_matrix<Scalar>(s.N, s.d, 33);
        const RowMatrix<Scalar> g2 = random_matrix<Scalar>(s.N, s.V, 34);

        Reference dW = zero_reference(s.V, s.d), db = zero_reference(s.V, 1);

        // First call: the returning overload.
        const RowMatrix<Scalar> dh1 = head.backward(h1, g1);
        check_close<Scalar>(dh1, naive_dh<Scalar>(g1, W));
        add_naive_dW<Scalar>(dW, g1, h1);
        add_naive_db<Scalar>(db, g1);
        CHECK(head.weight().grad().is_dense());
        CHECK(head.weight().grad().num_touched() == s.V);
        check_close<Scalar>(head.weight().grad().to_dense(), dW);
        if (bias) check_close<Scalar>(head.bias()->grad().to_dense(), db);

        // Second call into a pre-filled dh: dh is overwritten (it is this call's result alone),
        // while dW and db accumulate both calls.
        RowMatrix<Scalar> dh2 = RowMatrix<Scalar>::Constant(s.N, s.d, Scalar(-7));
        head.backward(h2, g2, dh2);
        check_close<Scalar>(dh2, naive_dh<Scalar>(g2, W));
        add_naive_dW<Scalar>(dW, g2, h2);
        add_naive_db<Scalar>(db, g2);
        check_close<Scalar>(head.weight().grad().to_dense(), dW);
        if (bias) check_close<Scalar>(head.bias()->grad().to_dense(), db);

        // The weights themselves are not touched by backward.
        CHECK(same_values(head.weight().value(), W));

        head.zero_grad();
        CHECK_FALSE(head.weight().grad().is_dense());
        CHECK(head.weight().grad().num_touched() == 0);
        CHECK(head.weight().grad().to_dense().isZero(0));
        if (bias) {
          CHECK(head.bias()->grad().num_touched() == 0);
          CHECK(head.bias()->grad().to_dense().isZero(0));
        }

        // After zero_grad the next backward starts from zero, not from the old sums.
        head.backward(h2, g2, dh2);
        Reference dW_again = zero_reference(s.V, s.d);
        add_naive_dW<Scalar>(dW_again, g2, h2);
        check_close<Scalar>(head.weight().grad().to_dense(), dW_again);
      }
    }
  }

  SECTION("free function output_projection_backward with an empty db leaves the bias out") {
    const RowMatrix<Scalar> h = random_matrix<Scalar>(5, 8, 41);
    const RowMatrix<Scalar> W = random_matrix<Scalar>(7, 8, 42);
    const RowMatrix<Scalar> g = random_matrix<Scalar>(5, 7, 43);
    RowMatrix<Scalar> dh(5, 8), dW = RowMatrix<Scalar>::Zero(7, 8), db(0, 1);
    embedhead::output_projection_backward<Scalar>(h, W, g, dh, dW, db);
    check_close<Scalar>(dh, naive_dh<Scalar>(g, W));
    Reference dW_ref = zero_reference(7, 8);
    add_naive_dW<Scalar>(dW_ref, g, h);
    check_close<Scalar>(dW, dW_ref);
  }
}

TEST_CASE("OutputProjection gradient check: central differences of L = sum(G * logits) in double",
          "[output_projection][gradient]") {
  // L is linear in each of h, W and b separately, so a central difference has no truncation error;
  // eps = 1e-4 keeps the cancellation error near 1e-12. The floor of 1e-4 in the relative error
  // means entries below 1e-4 are judged with an absolute tolerance of 1e-10.
  const double eps = 1e-4, floor = 1e-4, tolerance = 1e-6;
  SECTION("untied head with bias: h, W and b") {
    for (const Size& s : std::vector<Size>{{1, 1, 1}, {3, 5, 1}, {4, 1, 6}, {3, 7, 9}, {5, 16, 17}}) {
      CAPTURE(s.N, s.V, s.d);
      auto head = make_head<double>(s.V, s.d, true, 51);
      RowMatrix<double> h = random_matrix<double>(s.N, s.d, 52);
      const RowMatrix<double> G = random_matrix<double>(s.N, s.V, 53);

      // Finite differences perturb these copies; loss() writes them into the layer first.
      RowMatrix<double> W = head.weight().value();
      RowMatrix<double> b = head.bias()->value();
      auto loss = [&]() {
        head.weight().value() = W;
        head.bias()->value() = b;
        return head.forward(h).cwiseProduct(G).sum();
      };

      const RowMatrix<double> dh = head.backward(h, G);
      const RowMatrix<double> dW = head.weight().grad().to_dense();
      const RowMatrix<double> db = head.bias()->grad().to_dense();

      CHECK(naive::max_relative_error(dh, naive::numerical_gradient(h, loss, eps), floor) < tolerance);
      CHECK(naive::max_relative_error(dW, naive::numerical_gradient(W, loss, eps), floor) < tolerance);
      CHECK(naive::max_relative_error(db, naive::numerical_gradient(b, loss, eps), floor) < tolerance);
    }
  }

  SECTION("tied head: the gradient lands in the embedding's E") {
    auto embedding = make_embedding<double>(6, 5, 61);
    OutputProjection<double> head(embedding);
    RowMatrix<double> h = random_matrix<double>(4, 5, 62);
    const RowMatrix<double> G = random_matrix<double>(4, 6, 63);
    RowMatrix<double> E = embedding.weight().value();
    auto loss = [&]() {
      embedding.weight().value() = E;
      return head.forward(h).cwiseProduct(G).sum();
    };
    const RowMatrix<double> dh = head.backward(h, G);
    const RowMatrix<double> dE = embedding.weight().grad().to_dense();
    CHECK(naive::max_relative_error(dh, naive::numerical_gradient(h, loss, eps), floor) < tolerance);
    CHECK(naive::max_relative_error(dE, naive::numerical_gradient(E, loss, eps), floor) < tolerance);
  }
}

TEMPLATE_TEST_CASE("Tied OutputProjection shares the embedding's storage, not a copy", "[output_projection][tied]",
                   float, double) {
  using Scalar = TestType;
  const Index V = 7, d = 9;
  auto embedding = make_embedding<Scalar>(V, d, 71);
  const RowMatrix<Scalar> h = random_matrix<Scalar>(3, d, 72);

  auto check_shared = [&](OutputProjection<Scalar>& head) {
    CHECK(head.is_tied_to(embedding));
    CHECK_FALSE(head.has_bias());
    CHECK(head.bias() == nullptr);
    CHECK(head.weight_ptr() == embedding.weight_ptr());
    CHECK(&head.weight() == &embedding.weight());
    CHECK(head.weight().value().data() == embedding.weight().value().data());
    CHECK(head.vocab_size() == V);
    CHECK(head.dim() == d);

    // A write through the embedding is what the head multiplies by ...
    embedding.weight().value()(4, 2) = Scalar(3.5);
    RowMatrix<Scalar> E = embedding.weight().value();
    check_close<Scalar>(head.forward(h), naive_logits<Scalar>(h, E, nullptr));

    // ... and a write through the head (an optimizer step on the head's W) is what the embedding
    // looks up.
    head.weight().value()(5, 0) = Scalar(-2.25);
    embedhead::IdMatrix<std::int32_t> ids(1, 2);
    ids << 5, 4;
    const RowMatrix<Scalar> rows = embedding.forward(ids);
    CHECK(rows(0, 0) == Scalar(-2.25));
    CHECK(rows(1, 2) == Scalar(3.5));
    E = embedding.weight().value();
    check_close<Scalar>(head.forward(h), naive_logits<Scalar>(h, E, nullptr));
  };

  SECTION("constructed from the embedding") {
    OutputProjection<Scalar> head(embedding);
    check_shared(head);
  }

  SECTION("tie_to drops the bias and releases the head's own W") {
    auto head = make_head<Scalar>(V, d, true, 73);
    REQUIRE(head.has_bias());
    REQUIRE_FALSE(head.is_tied_to(embedding));
    REQUIRE(head.weight_ptr() != embedding.weight_ptr());
    const std::weak_ptr<Parameter<Scalar>> old_weight = head.weight_ptr();
    const std::weak_ptr<Parameter<Scalar>> old_bias = head.parameters().at(1);
    head.tie_to(embedding);
    check_shared(head);
    CHECK(old_weight.expired());
    CHECK(old_bias.expired());
  }

  SECTION("tie_to a second embedding of the same shape re-points W") {
    OutputProjection<Scalar> head(embedding);
    auto other = make_embedding<Scalar>(V, d, 74);
    head.tie_to(other);
    CHECK(head.weight_ptr() == other.weight_ptr());
    CHECK(head.weight_ptr() != embedding.weight_ptr());
    RowMatrix<Scalar> E_other = other.weight().value();
    check_close<Scalar>(head.forward(h), naive_logits<Scalar>(h, E_other, nullptr));
  }

  SECTION("the head keeps E alive after the embedding object is gone (shared ownership, no dangling)") {
    std::unique_ptr<OutputProjection<Scalar>> head;
    RowMatrix<Scalar> E;
    {
      auto scoped = make_embedding<Scalar>(V, d, 75);
      E = scoped.weight().value();
      head = std::make_unique<OutputProjection<Scalar>>(scoped);
    }
    CHECK(head->weight_ptr().use_count() == 1);
    check_close<Scalar>(head->forward(h), naive_logits<Scalar>(h, E, nullptr));
  }
}

TEMPLATE_TEST_CASE("Tied gradient = embedding's sparse rows + head's dense dlogits^T h",
                   "[output_projection][tied][backward]", float, double) {
  using Scalar = TestType;
  // GENERATE rather than loops: Catch runs each SECTION below once per generated value.
  const bool scaled = GENERATE(false, true);
  const Index d = GENERATE(as<Index>{}, 1, 8, 17);
  const Index V = 9;
  CAPTURE(scaled, d);
  auto embedding = make_embedding<Scalar>(V, d, 81, scaled);
  OutputProjection<Scalar> head(embedding);
  auto& grad = embedding.weight().grad();

  // Repeated ids (2 three times, 6 twice) and absent ones (0, 1, 4, 5, 7).
  embedhead::IdMatrix<std::int64_t> ids(2, 4);
  ids << 2, 6, 2, 8, 3, 2, 6, 3;
  const RowMatrix<Scalar> dout = random_matrix<Scalar>(8, d, 82);
  const RowMatrix<Scalar> h = random_matrix<Scalar>(5, d, 83);
  const RowMatrix<Scalar> dlogits = random_matrix<Scalar>(5, V, 84);
  const double s = static_cast<double>(embedding.scale());

  // Expected: dense scatter of s * dout (naive.hpp, in double) plus dlogits^T h (loops).
  RowMatrix<double> scatter = RowMatrix<double>::Zero(V, d), scatter_abs = RowMatrix<double>::Zero(V, d);
  naive::embedding_backward_dense<double>(ids, dout.template cast<double>(), s, -1, scatter);
  naive::embedding_backward_dense<double>(ids, dout.template cast<double>().cwiseAbs(), s, -1, scatter_abs);
  Reference input_side = zero_reference(V, d);
  input_side.value = scatter;
  // Each row sums at most 3 products s * dout[n][j] (id 2 appears three times).
  for (Index v = 0; v < V; ++v)
    for (Index j = 0; j < d; ++j) input_side.tolerance(v, j) = sum_bound<Scalar>(4, scatter_abs(v, j));
  Reference both = input_side;
  add_naive_dW<Scalar>(both, dlogits, h);
  Reference output_side = zero_reference(V, d);
  add_naive_dW<Scalar>(output_side, dlogits, h);

  SECTION("embedding backward first, then the head") {
    embedding.backward(ids, dout);
    CHECK_FALSE(grad.is_dense());
    CHECK(grad.touched_rows() == std::vector<Index>{2, 3, 6, 8});
    check_close<Scalar>(grad.to_dense(), input_side);

    RowMatrix<Scalar> dh(5, d);
    head.backward(h, dlogits, dh);
    CHECK(grad.is_dense());
    CHECK(grad.num_touched() == V);
    // The sparse rows gathered before the switch to dense mode are kept and added to.
    check_close<Scalar>(grad.to_dense(), both);
  }

  SECTION("head backward first, then the embedding") {
    RowMatrix<Scalar> dh(5, d);
    head.backward(h, dlogits, dh);
    CHECK(grad.is_dense());
    check_close<Scalar>(grad.to_dense(), output_side);

    embedding.backward(ids, dout);
    CHECK(grad.is_dense());
    CHECK(grad.num_touched() == V);
    check_close<Scalar>(grad.to_dense(), both);
  }

  SECTION("the touched rows can be read one by one in dense mode") {
    embedding.backward(ids, dout);
    head.backward(h, dlogits);
    const RowMatrix<Scalar> dense = grad.to_dense();
    for (Index i = 0; i < grad.num_touched(); ++i) {
      CHECK(grad.touched_rows()[static_cast<std::size_t>(i)] == i);
      CHECK(same_values(grad.touched_row(i), dense.row(i)));
    }
  }

  SECTION("zero_grad through either layer clears the one shared gradient") {
    embedding.backward(ids, dout);
    head.backward(h, dlogits);
    head.zero_grad();
    CHECK_FALSE(grad.is_dense());
    CHECK(grad.num_touched() == 0);
    CHECK(grad.to_dense().isZero(0));
    // Back to the sparse mode: only the embedding's rows appear.
    embedding.backward(ids, dout);
    CHECK_FALSE(grad.is_dense());
    check_close<Scalar>(grad.to_dense(), input_side);
  }
}

TEMPLATE_TEST_CASE("OutputProjection parameters() and count_parameters", "[output_projection][parameters]", float,
                   double) {
  using Scalar = TestType;
  const Index V = 11, d = 6;
  auto embedding = make_embedding<Scalar>(V, d, 91);
  auto with_embedding = [&](const OutputProjection<Scalar>& head) {
    auto all = head.parameters();
    all.insert(all.begin(), embedding.weight_ptr());
    return embedhead::count_parameters(all);
  };

  SECTION("untied with bias lists W then b") {
    const auto head = make_head<Scalar>(V, d, true, 92);
    const auto params = head.parameters();
    REQUIRE(params.size() == 2);
    CHECK(params[0] == head.weight_ptr());
    CHECK(params[1].get() == head.bias());
    CHECK(params[0]->rows() == V);
    CHECK(params[0]->cols() == d);
    CHECK(params[1]->rows() == V);
    CHECK(params[1]->cols() == 1);
    CHECK(embedhead::count_parameters(params) == V * d + V);
    CHECK(with_embedding(head) == 2 * V * d + V);  // 143: E, W and b
  }

  SECTION("untied without bias lists W only") {
    const auto head = make_head<Scalar>(V, d, false, 93);
    const auto params = head.parameters();
    REQUIRE(params.size() == 1);
    CHECK(params[0] == head.weight_ptr());
    CHECK(with_embedding(head) == 2 * V * d);
  }

  SECTION("tied lists the shared E, counted once with the embedding") {
    const OutputProjection<Scalar> head(embedding);
    const auto params = head.parameters();
    REQUIRE(params.size() == 1);
    CHECK(params[0] == embedding.weight_ptr());
    CHECK(with_embedding(head) == V * d);  // 66, not 132
  }
}

TEMPLATE_TEST_CASE("OutputProjection errors throw and leave everything unchanged", "[output_projection][errors]", float,
                   double) {
  using Scalar = TestType;
  const Index V = 5, d = 4;

  SECTION("tie_to an embedding of another shape: shape_error naming both shapes, head unchanged") {
    auto head = make_head<Scalar>(V, d, true, 101);
    const auto weight_before = head.weight_ptr();
    const Parameter<Scalar>* bias_before = head.bias();
    const RowMatrix<Scalar> W_before = head.weight().value();

    auto wrong_V = make_embedding<Scalar>(6, 4, 102);
    REQUIRE_THROWS_AS(head.tie_to(wrong_V), embedhead::shape_error);
    REQUIRE_THROWS_WITH(head.tie_to(wrong_V), Contains("[V=6, d=4]") && Contains("[V=5, d=4]"));
    auto wrong_d = make_embedding<Scalar>(5, 3, 103);
    REQUIRE_THROWS_AS(head.tie_to(wrong_d), embedhead::shape_error);
    REQUIRE_THROWS_WITH(head.tie_to(wrong_d), Contains("[V=5, d=3]") && Contains("[V=5, d=4]"));
    auto wrong_both = make_embedding<Scalar>(4, 5, 104);
    REQUIRE_THROWS_WITH(head.tie_to(wrong_both),
                        Contains("OutputProjection::tie_to") && Contains("[V=4, d=5]") && Contains("[V=5, d=4]"));

    CHECK_FALSE(head.is_tied_to(wrong_d));
    CHECK_FALSE(head.is_tied_to(wrong_both));
    CHECK(head.weight_ptr() == weight_before);
    CHECK(head.has_bias());
    CHECK(head.bias() == bias_before);
    CHECK(same_values(head.weight().value(), W_before));
    CHECK(wrong_V.weight_ptr().use_count() == 1);  // not retained by the head
  }

  SECTION("forward with a wrong h or logits shape: shape_error, logits untouched") {
    const auto head = make_head<Scalar>(V, d, true, 111);
    const RowMatrix<Scalar> h_wide = random_matrix<Scalar>(3, 5, 112);
    REQUIRE_THROWS_AS(head.forward(h_wide), embedhead::shape_error);
    REQUIRE_THROWS_WITH(head.forward(h_wide),
                        Contains("OutputProjection::forward") && Contains("h has shape [3, 5], expected [3, 4]"));

    RowMatrix<Scalar> logits = RowMatrix<Scalar>::Constant(3, V, Scalar(42));
    REQUIRE_THROWS_WITH(head.forward(h_wide, logits), Contains("h has shape [3, 5], expected [3, 4]"));
    CHECK((logits.array() == Scalar(42)).all());

    const RowMatrix<Scalar> h = random_matrix<Scalar>(3, d, 113);
    RowMatrix<Scalar> too_few_rows = RowMatrix<Scalar>::Constant(2, V, Scalar(42));
    REQUIRE_THROWS_AS(head.forward(h, too_few_rows), embedhead::shape_error);
    REQUIRE_THROWS_WITH(head.forward(h, too_few_rows), Contains("logits has shape [2, 5], expected [3, 5]"));
    CHECK((too_few_rows.array() == Scalar(42)).all());
    RowMatrix<Scalar> wrong_V = RowMatrix<Scalar>::Constant(3, V + 1, Scalar(42));
    REQUIRE_THROWS_WITH(head.forward(h, wrong_V), Contains("logits has shape [3, 6], expected [3, 5]"));
    CHECK((wrong_V.array() == Scalar(42)).all());
  }

  SECTION("backward with wrong shapes: shape_error, gradients not switched to dense, dh untouched") {
    // A tied head whose gradient already holds sparse rows from the embedding: a failed head
    // backward must neither densify it nor change the rows.
    auto embedding = make_embedding<Scalar>(V, d, 121);
    OutputProjection<Scalar> head(embedding);
    embedhead::IdMatrix<std::int32_t> ids(1, 3);
    ids << 3, 1, 3;
    embedding.backward(ids, random_matrix<Scalar>(3, d, 122));
    const auto& grad = embedding.weight().grad();
    REQUIRE_FALSE(grad.is_dense());
    const std::vector<Index> touched_before = grad.touched_rows();
    const RowMatrix<Scalar> grad_before = grad.to_dense();

    const RowMatrix<Scalar> h = random_matrix<Scalar>(3, d, 123);
    const RowMatrix<Scalar> dlogits = random_matrix<Scalar>(3, V, 124);
    const RowMatrix<Scalar> dlogits_wrong_V = random_matrix<Scalar>(3, V + 2, 125);
    const RowMatrix<Scalar> dlogits_wrong_N = random_matrix<Scalar>(2, V, 126);
    const RowMatrix<Scalar> h_wide = random_matrix<Scalar>(3, d + 1, 127);
    RowMatrix<Scalar> dh = RowMatrix<Scalar>::Constant(3, d, Scalar(42));
    RowMatrix<Scalar> dh_wrong = RowMatrix<Scalar>::Constant(3, d + 1, Scalar(42));

    REQUIRE_THROWS_AS(head.backward(h, dlogits_wrong_V, dh), embedhead::shape_error);
    REQUIRE_THROWS_WITH(head.backward(h, dlogits_wrong_V, dh),
                        Contains("OutputProjection::backward") &&
                            Contains("dlogits has shape [3, 7], expected [3, 5]"));
    REQUIRE_THROWS_WITH(head.backward(h, dlogits_wrong_N), Contains("dlogits has shape [2, 5], expected [3, 5]"));
    REQUIRE_THROWS_WITH(head.backward(h, dlogits, dh_wrong), Contains("dh has shape [3, 5], expected [3, 4]"));
    REQUIRE_THROWS_WITH(head.backward(h_wide, dlogits, dh), Contains("h has shape [3, 5], expected [3, 4]"));
    REQUIRE_THROWS_WITH(head.backward(h_wide, dlogits), Contains("h has shape [3, 5], expected [3, 4]"));

    CHECK_FALSE(grad.is_dense());
    CHECK(grad.touched_rows() == touched_before);
    CHECK(same_values(grad.to_dense(), grad_before));
    CHECK((dh.array() == Scalar(42)).all());
    CHECK((dh_wrong.array() == Scalar(42)).all());
  }

  SECTION("backward with wrong shapes on an untied head: W and b gradients stay empty, then stay as they were") {
    auto head = make_head<Scalar>(V, d, true, 131);
    const RowMatrix<Scalar> h = random_matrix<Scalar>(2, d, 132);
    const RowMatrix<Scalar> bad = random_matrix<Scalar>(2, V - 1, 133);
    REQUIRE_THROWS_AS(head.backward(h, bad), embedhead::shape_error);
    CHECK_FALSE(head.weight().grad().is_dense());
    CHECK(head.weight().grad().num_touched() == 0);
    CHECK_FALSE(head.bias()->grad().is_dense());
    CHECK(head.bias()->grad().num_touched() == 0);

    head.backward(h, random_matrix<Scalar>(2, V, 134));
    const RowMatrix<Scalar> dW_before = head.weight().grad().to_dense();
    const RowMatrix<Scalar> db_before = head.bias()->grad().to_dense();
    REQUIRE_THROWS_AS(head.backward(h, bad), embedhead::shape_error);
    CHECK(same_values(head.weight().grad().to_dense(), dW_before));
    CHECK(same_values(head.bias()->grad().to_dense(), db_before));
  }

  SECTION("backward with a bias whose length no longer matches W: shape_error before any gradient turns dense") {
    // A head wrapping the embedding's table with a bias of its own: the table is resized (as
    // resize_vocabulary given the embedding alone does), the bias is not.
    auto embedding = make_embedding<Scalar>(V, d, 161);
    auto bias = std::make_shared<Parameter<Scalar>>(random_matrix<Scalar>(V, 1, 162), "lm_head.bias");
    OutputProjection<Scalar> head(embedding.weight_ptr(), bias);
    embedhead::IdMatrix<std::int32_t> ids(1, 3);
    ids << 3, 1, 3;
    embedding.backward(ids, random_matrix<Scalar>(3, d, 163));
    embedding.weight().resize_rows(V + 2);
    const auto& grad = embedding.weight().grad();
    REQUIRE_FALSE(grad.is_dense());
    const std::vector<Index> touched_before = grad.touched_rows();
    const RowMatrix<Scalar> grad_before = grad.to_dense(), W_before = embedding.weight().value();
    const RowMatrix<Scalar> h = random_matrix<Scalar>(3, d, 164), dlogits = random_matrix<Scalar>(3, V + 2, 165);
    RowMatrix<Scalar> dh = RowMatrix<Scalar>::Constant(3, d, Scalar(42));

    REQUIRE_THROWS_AS(head.backward(h, dlogits, dh), embedhead::shape_error);
    REQUIRE_THROWS_WITH(head.backward(h, dlogits, dh),
                        Contains("OutputProjection::backward: bias has shape [5, 1], expected [7, 1]"));
    REQUIRE_THROWS_WITH(head.backward(h, dlogits), Contains("bias has shape [5, 1], expected [7, 1]"));
    CHECK_FALSE(grad.is_dense());
    CHECK(grad.touched_rows() == touched_before);
    CHECK(same_values(grad.to_dense(), grad_before));
    CHECK(same_values(embedding.weight().value(), W_before));
    CHECK_FALSE(bias->grad().is_dense());
    CHECK(bias->grad().num_touched() == 0);
    CHECK((dh.array() == Scalar(42)).all());
    // The forward pass names it too (it never changed anything).
    REQUIRE_THROWS_WITH(head.forward(h), Contains("OutputProjection::forward: bias has shape [5, 1], expected [7, 1]"));
  }

  SECTION("free functions check every shape, the bias included, before writing") {
    const RowMatrix<Scalar> h = random_matrix<Scalar>(2, d, 141);
    const RowMatrix<Scalar> W = random_matrix<Scalar>(V, d, 142);
    const RowMatrix<Scalar> bias_wrong = random_matrix<Scalar>(V + 1, 1, 143);
    RowMatrix<Scalar> logits = RowMatrix<Scalar>::Constant(2, V, Scalar(42));
    REQUIRE_THROWS_AS(embedhead::output_projection_forward<Scalar>(h, W, bias_wrong, logits), embedhead::shape_error);
    REQUIRE_THROWS_WITH(embedhead::output_projection_forward<Scalar>(h, W, bias_wrong, logits),
                        Contains("bias has shape [6, 1], expected [5, 1]"));
    CHECK((logits.array() == Scalar(42)).all());

    const RowMatrix<Scalar> g = random_matrix<Scalar>(2, V, 144);
    RowMatrix<Scalar> dh = RowMatrix<Scalar>::Constant(2, d, Scalar(42));
    RowMatrix<Scalar> dW = RowMatrix<Scalar>::Constant(V, d, Scalar(42));
    RowMatrix<Scalar> db_wrong = RowMatrix<Scalar>::Constant(V - 1, 1, Scalar(42));
    REQUIRE_THROWS_WITH(embedhead::output_projection_backward<Scalar>(h, W, g, dh, dW, db_wrong),
                        Contains("db has shape [4, 1], expected [5, 1]"));
    RowMatrix<Scalar> dW_wrong = RowMatrix<Scalar>::Constant(V, d + 1, Scalar(42));
    RowMatrix<Scalar> db = RowMatrix<Scalar>::Constant(V, 1, Scalar(42));
    REQUIRE_THROWS_WITH(embedhead::output_projection_backward<Scalar>(h, W, g, dh, dW_wrong, db),
                        Contains("dW has shape [5, 5], expected [5, 4]"));
    CHECK((dh.array() == Scalar(42)).all());
    CHECK((dW.array() == Scalar(42)).all());
    CHECK((db.array() == Scalar(42)).all());
    CHECK((db_wrong.array() == Scalar(42)).all());
    CHECK((dW_wrong.array() == Scalar(42)).all());
  }

  SECTION("constructor: V = 0, d = 0 and init_std <= 0 are value_errors") {
    using embedhead::value_error;
    OutputProjectionOptions options;
    REQUIRE_THROWS_AS(OutputProjection<Scalar>(0, d), value_error);
    REQUIRE_THROWS_WITH(OutputProjection<Scalar>(0, d),
                        Contains("OutputProjection") && Contains("V = 0 outside [1, inf)"));
    REQUIRE_THROWS_WITH(OutputProjection<Scalar>(-3, d), Contains("V = -3 outside [1, inf)"));
    REQUIRE_THROWS_AS(OutputProjection<Scalar>(V, 0), value_error);
    REQUIRE_THROWS_WITH(OutputProjection<Scalar>(V, 0), Contains("d = 0 outside [1, inf)"));
    options.init_std = 0.0;
    REQUIRE_THROWS_AS(OutputProjection<Scalar>(V, d, options), value_error);
    REQUIRE_THROWS_WITH(OutputProjection<Scalar>(V, d, options), Contains("init_std = 0 outside (0, inf)"));
    options.init_std = -0.5;
    REQUIRE_THROWS_WITH(OutputProjection<Scalar>(V, d, options), Contains("init_std = -0.5 outside (0, inf)"));
    options.init_std = std::numeric_limits<double>::quiet_NaN();
    REQUIRE_THROWS_AS(OutputProjection<Scalar>(V, d, options), value_error);
    options.init_std = std::numeric_limits<double>::infinity();
    REQUIRE_THROWS_AS(OutputProjection<Scalar>(V, d, options), value_error);
    // The exception types derive from the standard ones.
    REQUIRE_THROWS_AS(OutputProjection<Scalar>(0, d), std::invalid_argument);
  }
}

TEMPLATE_TEST_CASE("OutputProjection backward: dh may be h itself", "[output_projection][backward]", float, double) {
  using S = TestType;
  OutputProjectionOptions options;
  options.seed = 11;
  OutputProjection<S> separate(13, 6, options), in_place(13, 6, options);
  RowMatrix<S> h = RowMatrix<S>::Random(5, 6);
  const RowMatrix<S> dlogits = RowMatrix<S>::Random(5, 13);
  RowMatrix<S> dh(5, 6);
  separate.backward(h, dlogits, dh);
  in_place.backward(h, dlogits, h);  // dW reads h before dh overwrites it
  CHECK(h == dh);
  CHECK(in_place.weight().grad().to_dense() == separate.weight().grad().to_dense());
  CHECK(in_place.bias()->grad().to_dense() == separate.bias()->grad().to_dense());
}

TEST_CASE("OutputProjection: tying to a moved-from TokenEmbedding is an error", "[output_projection][errors]") {
  TokenEmbedding<float> embedding(10, 4);
  TokenEmbedding<float> taken = std::move(embedding);
  REQUIRE_THROWS_AS(OutputProjection<float>(embedding), embedhead::value_error);
  REQUIRE_THROWS_WITH(OutputProjection<float>(embedding), Contains("moved from"));
  OutputProjection<float> head(10, 4);
  const auto W = head.weight_ptr();
  REQUIRE_THROWS_WITH(head.tie_to(embedding), Contains("moved from"));
  CHECK(head.weight_ptr() == W);
  CHECK(head.has_bias());
  CHECK_FALSE(head.is_tied_to(taken));
  REQUIRE_NOTHROW(head.tie_to(taken));
  CHECK(head.weight_ptr() == taken.weight_ptr());
}

TEST_CASE("OutputProjection wraps existing W and bias without copying them", "[output_projection][wrap]") {
  auto W = std::make_shared<Parameter<double>>(3, 2, "lm_head.weight");
  auto b = std::make_shared<Parameter<double>>(3, 1, "lm_head.bias");
  W->value() << 1, 0, 0, 1, 1, 1;
  b->value() << 0.5, -0.5, 0;
  OutputProjection<double> head(W, b);
  CHECK(head.weight_ptr() == W);
  CHECK(head.bias() == b.get());
  CHECK(W.use_count() == 2);  // this test's W and the head's: tied to no embedding
  RowMatrix<double> h(1, 2);
  h << 2, 3;
  const RowMatrix<double> logits = head.forward(h);
  CHECK(logits(0, 0) == 2.5);
  CHECK(logits(0, 1) == 2.5);
  CHECK(logits(0, 2) == 5.0);
  OutputProjection<double> no_bias(W);
  CHECK_FALSE(no_bias.has_bias());

  REQUIRE_THROWS_AS(OutputProjection<double>(nullptr), embedhead::value_error);
  auto wrong_bias = std::make_shared<Parameter<double>>(4, 1);
  REQUIRE_THROWS_AS(OutputProjection<double>(W, wrong_bias), embedhead::shape_error);
  REQUIRE_THROWS_WITH(OutputProjection<double>(W, wrong_bias),
                      Contains("bias") && Contains("[4, 1]") && Contains("[3, 1]"));
}

// ---- the chunked GEMMs (N > 8) across chunk boundaries ----

TEMPLATE_TEST_CASE("OutputProjection forward and backward across several chunks of V and of N",
                   "[output_projection][chunks]", float, double) {
  using Scalar = TestType;
  // V = 2 chunks of kHeadVocabChunk and 37 rows more, N = one chunk of kHeadTokenChunk and 3
  // tokens more: the last chunk of each is partial, and chunk edges fall inside SIMD packets.
  const Index V = 2 * embedhead::detail::kHeadVocabChunk + 37;
  const Index N = embedhead::detail::kHeadTokenChunk + 3, d = 19;
  for (const bool bias : {true, false}) {
    CAPTURE(bias);
    auto head = make_head<Scalar>(V, d, bias, 201);
    const RowMatrix<Scalar> W = head.weight().value();
    RowMatrix<Scalar> b;
    if (bias) b = head.bias()->value();
    const RowMatrix<Scalar> h = random_matrix<Scalar>(N, d, 202);
    const RowMatrix<Scalar> g = random_matrix<Scalar>(N, V, 203);
    check_close<Scalar>(head.forward(h), naive_logits<Scalar>(h, W, bias ? &b : nullptr));
    const RowMatrix<Scalar> dh = head.backward(h, g);
    check_close<Scalar>(dh, naive_dh<Scalar>(g, W));
    Reference dW = zero_reference(V, d), db = zero_reference(V, 1);
    add_naive_dW<Scalar>(dW, g, h);
    add_naive_db<Scalar>(db, g);
    check_close<Scalar>(head.weight().grad().to_dense(), dW);
    if (bias) check_close<Scalar>(head.bias()->grad().to_dense(), db);
  }
}

// ---- the decode path (1 <= N <= 8) ----

TEMPLATE_TEST_CASE("output_projection_decode computes h W^T + b for 1 to 8 tokens", "[output_projection][decode]",
                   float, double) {
  using Scalar = TestType;
  using embedhead::output_projection_decode;
  using embedhead::output_projection_forward;

  SECTION("naive reference for N = 1 ... 8, d around the 16-lane width, V = 1, d = 1, with and without bias") {
    for (const Index d : {Index{1}, Index{7}, Index{15}, Index{16}, Index{17}, Index{33}, Index{50}}) {
      for (const Index V : {Index{1}, Index{5}, Index{70}}) {
        const RowMatrix<Scalar> W = random_matrix<Scalar>(V, d, 300 + static_cast<std::uint64_t>(d));
        const RowMatrix<Scalar> b = random_matrix<Scalar>(V, 1, 301);
        const RowMatrix<Scalar> no_bias(0, 1);
        for (Index N = 1; N <= 8; ++N) {
          for (const bool bias : {true, false}) {
            CAPTURE(N, V, d, bias);
            const RowMatrix<Scalar> h = random_matrix<Scalar>(N, d, 302 + static_cast<std::uint64_t>(N));
            const Reference expected = naive_logits<Scalar>(h, W, bias ? &b : nullptr);
            RowMatrix<Scalar> logits = RowMatrix<Scalar>::Constant(N, V, Scalar(1e6));
            output_projection_decode<Scalar>(h, W, bias ? b : no_bias, logits);
            check_close<Scalar>(logits, expected);
            // output_projection_forward takes the decode path by itself for N <= 8: same bits.
            RowMatrix<Scalar> forward = RowMatrix<Scalar>::Constant(N, V, Scalar(-1e6));
            output_projection_forward<Scalar>(h, W, bias ? b : no_bias, forward);
            CHECK(same_values(forward, logits));
          }
        }
      }
    }
  }

  SECTION("a token's logits do not depend on the other tokens of the call") {
    const Index V = 37, d = 35;
    const RowMatrix<Scalar> W = random_matrix<Scalar>(V, d, 311);
    const RowMatrix<Scalar> b = random_matrix<Scalar>(V, 1, 312);
    const RowMatrix<Scalar> h = random_matrix<Scalar>(8, d, 313);
    RowMatrix<Scalar> all(8, V);
    output_projection_decode<Scalar>(h, W, b, all);
    for (Index n = 0; n < 8; ++n) {
      RowMatrix<Scalar> one(1, V);
      output_projection_decode<Scalar>(h.middleRows(n, 1), W, b, one);
      CHECK(same_values(one, all.middleRows(n, 1)));
    }
  }

  SECTION("strided views: rows of wider matrices, and a bias that is a column of a wider matrix") {
    const Index N = 3, V = 11, d = 18;
    const RowMatrix<Scalar> h_wide = random_matrix<Scalar>(N, d + 5, 321);
    const RowMatrix<Scalar> W_wide = random_matrix<Scalar>(V, d + 3, 322);
    const RowMatrix<Scalar> b_wide = random_matrix<Scalar>(V, 4, 323);
    RowMatrix<Scalar> logits_wide = RowMatrix<Scalar>::Constant(N, V + 2, Scalar(42));
    output_projection_decode<Scalar>(h_wide.leftCols(d), W_wide.leftCols(d), b_wide.col(2), logits_wide.leftCols(V));
    const RowMatrix<Scalar> h = h_wide.leftCols(d), W = W_wide.leftCols(d), b = b_wide.col(2);
    check_close<Scalar>(logits_wide.leftCols(V), naive_logits<Scalar>(h, W, &b));
    CHECK((logits_wide.rightCols(2).array() == Scalar(42)).all());
  }

  SECTION("errors: N outside [1, 8] is a value_error, shapes are shape_errors; nothing written") {
    const Index V = 5, d = 4;
    const RowMatrix<Scalar> W = random_matrix<Scalar>(V, d, 331);
    const RowMatrix<Scalar> b = random_matrix<Scalar>(V, 1, 332);
    const RowMatrix<Scalar> h9 = random_matrix<Scalar>(9, d, 333);
    RowMatrix<Scalar> logits9 = RowMatrix<Scalar>::Constant(9, V, Scalar(42));
    REQUIRE_THROWS_AS(output_projection_decode<Scalar>(h9, W, b, logits9), embedhead::value_error);
    REQUIRE_THROWS_WITH(output_projection_decode<Scalar>(h9, W, b, logits9),
                        Contains("output_projection_decode: N = 9 outside [1, 8]"));
    CHECK((logits9.array() == Scalar(42)).all());
    const RowMatrix<Scalar> h0(0, d);
    RowMatrix<Scalar> logits0(0, V);
    REQUIRE_THROWS_WITH(output_projection_decode<Scalar>(h0, W, b, logits0), Contains("N = 0 outside [1, 8]"));

    const RowMatrix<Scalar> h_wide = random_matrix<Scalar>(2, d + 1, 334);
    RowMatrix<Scalar> logits = RowMatrix<Scalar>::Constant(2, V, Scalar(42));
    REQUIRE_THROWS_AS(output_projection_decode<Scalar>(h_wide, W, b, logits), embedhead::shape_error);
    REQUIRE_THROWS_WITH(output_projection_decode<Scalar>(h_wide, W, b, logits),
                        Contains("output_projection_decode: h has shape [2, 5], expected [2, 4]"));
    const RowMatrix<Scalar> h = random_matrix<Scalar>(2, d, 335);
    const RowMatrix<Scalar> b_wrong = random_matrix<Scalar>(V + 1, 1, 336);
    REQUIRE_THROWS_WITH(output_projection_decode<Scalar>(h, W, b_wrong, logits),
                        Contains("bias has shape [6, 1], expected [5, 1]"));
    RowMatrix<Scalar> logits_wrong = RowMatrix<Scalar>::Constant(2, V - 1, Scalar(42));
    REQUIRE_THROWS_WITH(output_projection_decode<Scalar>(h, W, b, logits_wrong),
                        Contains("logits has shape [2, 4], expected [2, 5]"));
    CHECK((logits.array() == Scalar(42)).all());
    CHECK((logits_wrong.array() == Scalar(42)).all());
  }
}

TEST_CASE("output_projection free functions accept empty operands (N = 0 with V over several chunks, d = 0)",
          "[output_projection][chunks]") {
  const Index V = 2 * embedhead::detail::kHeadVocabChunk + 5;
  const RowMatrix<float> b = random_matrix<float>(V, 1, 401);
  SECTION("N = 0: nothing to compute, the gradients stay as they were") {
    const RowMatrix<float> h(0, 3), W = random_matrix<float>(V, 3, 402), g(0, V);
    RowMatrix<float> logits(0, V), dh(0, 3), dW = RowMatrix<float>::Constant(V, 3, 2.0f),
                                             db = RowMatrix<float>::Constant(V, 1, 3.0f);
    embedhead::output_projection_forward<float>(h, W, b, logits);
    embedhead::output_projection_backward<float>(h, W, g, dh, dW, db);
    CHECK((dW.array() == 2.0f).all());
    CHECK((db.array() == 3.0f).all());
  }
  SECTION("d = 0: logits are the bias, dh is empty, dW is empty, db still sums dlogits") {
    const Index N = 10;
    const RowMatrix<float> h(N, 0), W(V, 0), g = random_matrix<float>(N, V, 403);
    RowMatrix<float> logits(N, V), dh(N, 0), dW(V, 0), db = RowMatrix<float>::Zero(V, 1);
    embedhead::output_projection_forward<float>(h, W, b, logits);
    for (Index n = 0; n < N; ++n) CHECK(same_values(logits.row(n), b.transpose()));
    embedhead::output_projection_backward<float>(h, W, g, dh, dW, db);
    Reference expected = zero_reference(V, 1);
    add_naive_db<float>(expected, g);
    check_close<float>(db, expected);
  }
}

TEMPLATE_TEST_CASE("OutputProjection with a frozen W or bias: dh unchanged, the frozen gradient untouched",
                   "[output_projection][freeze]", float, double) {
  using Scalar = TestType;
  const Index N = 5, V = 1030, d = 4;  // V over two chunks of 1024 rows
  const RowMatrix<Scalar> h = random_matrix<Scalar>(N, d, 500), dlogits = random_matrix<Scalar>(N, V, 501);
  OutputProjection<Scalar> reference(V, d), head(V, d);
  head.bias()->value() = random_matrix<Scalar>(V, 1, 502);
  reference.bias()->value() = head.bias()->value();
  const RowMatrix<Scalar> dh_expected = reference.backward(h, dlogits);
  const RowMatrix<Scalar> dW_expected = reference.weight().grad().to_dense();
  const RowMatrix<Scalar> db_expected = reference.bias()->grad().to_dense();

  SECTION("frozen W: no dW (the gradient stays sparse and empty), db and dh as unfrozen") {
    head.weight().set_frozen(true);
    const RowMatrix<Scalar> dh = head.backward(h, dlogits);
    CHECK(same_values(dh, dh_expected));
    CHECK(head.weight().grad().num_touched() == 0);
    CHECK_FALSE(head.weight().grad().is_dense());
    CHECK(same_values(head.bias()->grad().to_dense(), db_expected));
  }
  SECTION("frozen bias: dW and dh as unfrozen, no db") {
    head.bias()->set_frozen(true);
    const RowMatrix<Scalar> dh = head.backward(h, dlogits);
    CHECK(same_values(dh, dh_expected));
    CHECK(same_values(head.weight().grad().to_dense(), dW_expected));
    CHECK(head.bias()->grad().num_touched() == 0);
  }
  SECTION("both frozen: dh only") {
    head.weight().set_frozen(true);
    head.bias()->set_frozen(true);
    CHECK(same_values(head.backward(h, dlogits), dh_expected));
    CHECK(head.weight().grad().num_touched() == 0);
    CHECK(head.bias()->grad().num_touched() == 0);
  }
  SECTION("the free function skips an empty dW and an empty db") {
    RowMatrix<Scalar> dh(N, d), db = RowMatrix<Scalar>::Zero(V, 1);
    RowMatrix<Scalar> none(0, d), no_bias(0, 1);
    embedhead::output_projection_backward<Scalar>(h, head.weight().value(), dlogits, dh, none, db);
    CHECK(same_values(dh, dh_expected));
    CHECK(same_values(db, db_expected));
    embedhead::output_projection_backward<Scalar>(h, head.weight().value(), dlogits, dh, none, no_bias);
    CHECK(same_values(dh, dh_expected));
  }
}

TEMPLATE_TEST_CASE("Tied: freezing the embedding freezes the head's W (one Parameter)",
                   "[output_projection][tied][freeze]", float, double) {
  using Scalar = TestType;
  const Index N = 3, V = 6, d = 2;
  TokenEmbedding<Scalar> embedding(V, d);
  OutputProjection<Scalar> head(embedding);
  embedding.set_frozen(true);
  CHECK(head.weight().frozen());
  const RowMatrix<Scalar> h = random_matrix<Scalar>(N, d, 510), dlogits = random_matrix<Scalar>(N, V, 511);
  TokenEmbedding<Scalar> unfrozen_embedding(V, d);  // the same seed: the same table
  OutputProjection<Scalar> unfrozen(unfrozen_embedding);
  RowMatrix<Scalar> dh(N, d);
  head.backward(h, dlogits, dh);
  CHECK(same_values(dh, unfrozen.backward(h, dlogits)));
  embedhead::IdMatrix<std::int32_t> ids(1, N);
  ids << 0, 5, 0;
  embedding.backward(ids, dh);
  CHECK(embedding.weight().grad().num_touched() == 0);
  head.weight().set_frozen(false);  // and unfreezing through the head unfreezes the embedding
  CHECK_FALSE(embedding.frozen());
}
