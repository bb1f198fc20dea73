// embedhead quick start: token + position embeddings -> tied LM head -> cross-entropy, forward and
// backward on one small batch. The README shows the core of this file.
#include <embedhead/embedhead.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>

int main() {
  using namespace embedhead;
  const Index V = 50, d = 16, B = 2, T = 5;

  TokenEmbedding<float> embedding(V, d);            // E [V, d] ~ N(0, 0.02^2)
  LearnedPositionEmbedding<float> positions(T, d);  // P [T, d]
  OutputProjection<float> head(embedding);          // tied: W is E (same storage, same gradient)
  CrossEntropyLoss<float> loss;                     // mean over the B*T tokens

  // Two sequences of T + 1 tokens; each position predicts the next token.
  IdMatrix<std::int32_t> tokens(B, T + 1);
  tokens << 3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 3;
  const auto ids = tokens.leftCols(T);       // [B, T], a view: no copy (TokenIds reads strided blocks)
  const auto targets = tokens.rightCols(T);  // [B, T], shifted by one

  // Forward: x = E[ids] + P[t], logits = x E^T.
  RowMatrix<float> x = embedding.forward(ids);      // [B*T, d]
  positions.forward(x, B, T, x);                    // in place
  const RowMatrix<float> logits = head.forward(x);  // [B*T, V]
  RowMatrix<float> dlogits(B * T, V);
  const CrossEntropyResult result = loss.forward_backward(logits, targets, dlogits);

  // Backward: gradients accumulate into each Parameter's RowGradient.
  const RowMatrix<float> dx = head.backward(x, dlogits);  // dE += dlogits^T x: all V rows
  positions.backward(dx, B, T);                           // dP[t] += sum over b of dx
  embedding.backward(ids, dx);                            // dE[ids] += dx: the rows present only

  const RowGradient<float>& dE = embedding.weight().grad();
  std::printf("loss %.4f over %ld tokens (log V = %.4f)\n", result.loss, static_cast<long>(result.count),
              std::log(static_cast<double>(V)));
  std::printf("tied dE: %ld of %ld rows touched, dense = %s (the head's dlogits^T x reaches every row)\n",
              static_cast<long>(dE.num_touched()), static_cast<long>(V), dE.is_dense() ? "yes" : "no");

  // The lookup's share alone: only the rows of the ids present in the batch.
  embedding.zero_grad();
  embedding.backward(ids, dx);
  std::printf("embedding backward alone: %ld of %ld rows touched, dense = %s\n", static_cast<long>(dE.num_touched()),
              static_cast<long>(V), dE.is_dense() ? "yes" : "no");
  return 0;
}
