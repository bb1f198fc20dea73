// ODR check, translation unit B (see odr_a.cpp): the same float instantiations
// as A, plus the double ones, so the linker sees every shared symbol twice.
#include <embedhead/embedhead.hpp>

#include <cstdint>

int embedhead_odr_b();

namespace {

// The tied model of odr_a.cpp in Scalar: E = [[1, 2], [3, 4], [5, 6]], ids (2, 0).
template <typename Scalar>
bool tied_model_matches_hand_values() {
  embedhead::TokenEmbedding<Scalar> embedding(3, 2);
  embedding.weight().value() << 1, 2, 3, 4, 5, 6;
  embedhead::OutputProjection<Scalar> head(embedding);
  embedhead::IdMatrix<std::int64_t> ids(2, 1);
  ids << 2, 0;
  const embedhead::RowMatrix<Scalar> x = embedding.forward(ids);
  const embedhead::RowMatrix<Scalar> logits = head.forward(x);
  const Scalar expected[2][3] = {{17, 39, 61}, {5, 11, 17}};
  for (int n = 0; n < 2; ++n)
    for (int v = 0; v < 3; ++v)
      if (logits(n, v) != expected[n][v]) return false;

  // The embedding's backward adds dout to the rows of its ids: rows 2 and 0 get (1, 1).
  embedding.backward(ids, embedhead::RowMatrix<Scalar>::Ones(2, 2));
  const embedhead::RowMatrix<Scalar> dE = embedding.weight().grad().to_dense();
  return !embedding.weight().grad().is_dense() && dE(2, 0) == 1 && dE(0, 1) == 1 && dE(1, 0) == 0;
}

// Untied head with bias b = (1, 0, -1) and W = E: logits = h W^T + b.
template <typename Scalar>
bool untied_head_matches_hand_values() {
  embedhead::OutputProjection<Scalar> head(3, 2);
  head.weight().value() << 1, 2, 3, 4, 5, 6;
  head.bias()->value() << 1, 0, -1;
  embedhead::RowMatrix<Scalar> h(1, 2);
  h << 1, -1;
  const embedhead::RowMatrix<Scalar> logits = head.forward(h);  // (-1 + 1, -1 + 0, -1 - 1)
  if (logits(0, 0) != 0 || logits(0, 1) != -1 || logits(0, 2) != -2) return false;

  embedhead::LearnedPositionEmbedding<Scalar> positions(4, 2);
  positions.weight().value().setZero();
  const embedhead::RowMatrix<Scalar> moved = positions.forward(h, 1, 1);
  return moved == h && embedhead::count_parameters(head.parameters()) == 9 &&
         embedhead::embedding_head_budget({3, 2, true, false, 4}).total() == 14;
}

}  // namespace

int embedhead_odr_b() {
  const bool ok = tied_model_matches_hand_values<float>() && tied_model_matches_hand_values<double>() &&
                  untied_head_matches_hand_values<float>() && untied_head_matches_hand_values<double>();
  return ok ? EMBEDHEAD_VERSION_MAJOR : -2;
}
