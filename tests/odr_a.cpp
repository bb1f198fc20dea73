// ODR check, translation unit A. odr_a.cpp and odr_b.cpp both include the
// whole library and are linked into one executable (odr_test): any non-inline
// function or variable defined in a header shows up as a duplicate symbol.
//
// Including the headers is not enough for that: a header's functions are only
// emitted where they are used. So both units instantiate the same templates
// (TokenEmbedding<float>::forward, OutputProjection<float> forward/backward,
// cross-entropy, dropout, position tables) and call the same non-template
// inline functions (embedding_head_budget, the detail checks, Rng), and each
// returns EMBEDHEAD_VERSION_MAJOR only if its results match hand-computed
// values (-1 here, -2 in B otherwise, so odr_main's a == b check fails too).
#include <embedhead/embedhead.hpp>

#include <cstdint>
#include <stdexcept>

int embedhead_odr_a();

namespace {

// A tied model with no blocks on E = [[1, 2], [3, 4], [5, 6]] (exact in float).
bool tied_float_model_matches_hand_values() {
  embedhead::TokenEmbedding<float> embedding(3, 2);
  embedding.weight().value() << 1, 2, 3, 4, 5, 6;
  embedhead::OutputProjection<float> head(embedding);
  embedhead::IdMatrix<std::int32_t> ids(1, 2);
  ids << 2, 0;
  const embedhead::RowMatrix<float> x = embedding.forward(ids);  // [E[2]; E[0]]
  const embedhead::RowMatrix<float> logits = head.forward(x);    // x E^T
  // Row 0: E[2] . E[u] = [17, 39, 61]; row 1: E[0] . E[u] = [5, 11, 17].
  const float expected[2][3] = {{17, 39, 61}, {5, 11, 17}};
  for (int n = 0; n < 2; ++n)
    for (int v = 0; v < 3; ++v)
      if (logits(n, v) != expected[n][v]) return false;

  // dlogits = one-hot on token 1 for row 0 only: dE += dlogits^T x puts E[2] = (5, 6) in row 1,
  // and dh = dlogits E gives E[1] = (3, 4) for row 0.
  embedhead::RowMatrix<float> dlogits = embedhead::RowMatrix<float>::Zero(2, 3);
  dlogits(0, 1) = 1;
  const embedhead::RowMatrix<float> dh = head.backward(x, dlogits);
  const embedhead::RowMatrix<float> dE = embedding.weight().grad().to_dense();
  return dh(0, 0) == 3 && dh(0, 1) == 4 && dh(1, 0) == 0 && dE(1, 0) == 5 && dE(1, 1) == 6 && dE(0, 0) == 0 &&
         dE(2, 1) == 0 && embedding.weight().grad().is_dense();
}

bool untied_float_head_and_helpers_work() {
  embedhead::OutputProjection<float> head(3, 2);  // untied, with bias: 3*2 + 3 parameters
  if (embedhead::count_parameters(head.parameters()) != 9) return false;
  if (embedhead::embedding_head_budget({3, 2, false, true, 0}).total() != 15) return false;

  // Bad input must throw the library's exception types from this unit too.
  bool threw = false;
  try {
    embedhead::TokenEmbedding<float> embedding(3, 2);
    embedhead::IdMatrix<std::int32_t> bad(1, 1);
    bad << 3;
    embedding.forward(bad);
  } catch (const embedhead::index_error&) {
    threw = true;
  }
  if (!threw) return false;

  // Cross-entropy of equal logits over V = 4 is log 4, for any target.
  const embedhead::RowMatrix<float> logits = embedhead::RowMatrix<float>::Zero(1, 4);
  embedhead::IdMatrix<std::int32_t> target(1, 1);
  target << 2;
  const double loss = embedhead::cross_entropy<float>(logits, target).loss;
  if (loss < 1.3862 || loss > 1.3863) return false;

  embedhead::Dropout<float> dropout(1.0, 3);  // p = 1 drops everything
  const embedhead::RowMatrix<float> dropped = dropout.forward(embedhead::RowMatrix<float>::Ones(2, 2));
  if (!dropped.isZero(0)) return false;

  const embedhead::SinusoidalPositionEmbedding<float> sinusoid(4, 2);
  return sinusoid.table()(0, 0) == 0 && sinusoid.table()(0, 1) == 1;  // sin 0, cos 0
}

}  // namespace

int embedhead_odr_a() {
  const bool ok = tied_float_model_matches_hand_values() && untied_float_head_and_helpers_work();
  return ok ? EMBEDHEAD_VERSION_MAJOR : -1;
}
