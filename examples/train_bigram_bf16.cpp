// The untied bigram model of train_bigram.cpp (logits[n] = E[x_n] W^T + b predicts x_{n+1}),
// trained four times from the same start, with the library's SGD (lr 2 decaying linearly to 0, as
// train_bigram) and again with its AdamW (lr 3e-3 decaying linearly to 0, weight_decay 0.01: steps
// of about lr per weight, many of them below half a bf16 ulp of weights of size 0.3):
//
//   float                       E, W float (TokenEmbedding, OutputProjection)
//   bf16, round-to-nearest      E, W bf16 (LowPrecisionEmbedding, LowPrecisionOutputProjection),
//                               each update rounded to the nearest bf16: updates below half an
//                               ulp are lost, which the decaying lr makes more and more of them
//   bf16, stochastic rounding   the same, rounded up or down with the probabilities that make the
//                               stored value unbiased (LowPrecisionUpdate::stochastic)
//   bf16, Kahan compensation    nearest plus a float compensation buffer (LowPrecisionUpdate::kahan)
//
// The bias is float in all four. All start from the same bf16-representable values and see the
// same batches; the held-out losses are printed side by side.
//
// Usage: train_bigram_bf16 <corpus.txt> [--quick]     (--quick: fewer steps, for ctest)
#include <embedhead/embedhead.hpp>

#include "corpus.hpp"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>
#include <vector>

namespace {

using namespace embedhead;
using Ids = IdMatrix<std::int32_t>;
using BF16 = Eigen::bfloat16;

struct Settings {
  Index d = 32, B = 16, T = 32;
  int steps = 3000;
  double lr = 2.0;  // on the mean loss, decayed linearly to 0
  double init_std = 0.3;
  std::uint64_t seed = 7;
};

// The float model and the bf16 one expose the same four calls.
struct FloatModel {
  TokenEmbedding<float> embedding;
  OutputProjection<float> head;
  FloatModel(const RowMatrix<float>& E, const RowMatrix<float>& W)
      : embedding(std::make_shared<Parameter<float>>(E, "token_embedding.weight")),
        head(std::make_shared<Parameter<float>>(W, "lm_head.weight"),
             std::make_shared<Parameter<float>>(RowMatrix<float>::Zero(W.rows(), 1), "lm_head.bias")) {}
  void add_to(Optimizer<float>& o) {
    o.add_group({embedding.weight_ptr(), head.weight_ptr()});
    o.add_group({head.bias_ptr()});
  }
};
struct BF16Model {
  LowPrecisionEmbedding<BF16> embedding;
  LowPrecisionOutputProjection<BF16> head;
  BF16Model(const RowMatrix<float>& E, const RowMatrix<float>& W)
      : embedding(ConstMatrixRef<float>(E)),
        head(ConstMatrixRef<float>(W), ConstMatrixRef<float>(RowMatrix<float>::Zero(W.rows(), 1))) {}
  void add_to(Optimizer<float>& o) {
    o.add_group(std::vector<std::shared_ptr<Parameter<BF16, float>>>{embedding.weight_ptr(), head.weight_ptr()});
    o.add_group({head.bias_ptr()});
  }
};

template <typename Model>
double evaluate(Model& model, const std::vector<std::int32_t>& text) {
  const Index N = static_cast<Index>(text.size()) - 1;
  const Eigen::Map<const Ids> inputs(text.data(), 1, N);
  const Eigen::Map<const Ids> targets(text.data() + 1, 1, N);
  const RowMatrix<float> logits = model.head.forward(model.embedding.forward(inputs));
  return cross_entropy<float>(logits, targets).loss;
}

// Trains `model` with SGD (or AdamW) written back by `update`; -> the final held-out loss.
template <typename Model>
double train(Model& model, const examples::Corpus& corpus, const Settings& s, bool adamw, LowPrecisionUpdate update) {
  const Index V = corpus.V(), N = s.B * s.T;
  const double lr = adamw ? 3e-3 : s.lr;
  std::unique_ptr<Optimizer<float>> optimizer;
  if (adamw)
    optimizer = std::make_unique<AdamW<float>>(AdamOptions{lr, 0.9, 0.999, 1e-8, 0.01});
  else
    optimizer = std::make_unique<SGD<float>>(SGDOptions{lr});
  Optimizer<float>& sgd = *optimizer;
  sgd.set_low_precision_update({update, s.seed + 300});
  model.add_to(sgd);
  Ids ids(s.B, s.T), targets(s.B, s.T);
  RowMatrix<float> h(N, s.d), logits(N, V), dlogits(N, V), dh(N, s.d);
  CrossEntropyLoss<float> loss;
  Rng window_rng(s.seed + 100);
  const std::uint64_t last_start = corpus.train.size() - static_cast<std::size_t>(s.T) - 1;
  for (int step = 0; step < s.steps; ++step) {
    for (Index b = 0; b < s.B; ++b) {
      const std::size_t start = static_cast<std::size_t>(window_rng.next_bits() % (last_start + 1));
      for (Index t = 0; t < s.T; ++t) {
        ids(b, t) = corpus.train[start + static_cast<std::size_t>(t)];
        targets(b, t) = corpus.train[start + static_cast<std::size_t>(t) + 1];
      }
    }
    sgd.zero_grad();
    model.embedding.forward(ids, h);
    model.head.forward(h, logits);
    loss.forward_backward(logits, targets, dlogits);
    model.head.backward(h, dlogits, dh);
    model.embedding.backward(ids, dh);
    sgd.set_lr(lr * (1.0 - static_cast<double>(step) / static_cast<double>(s.steps)));
    sgd.step();
  }
  return evaluate(model, corpus.held_out);
}

int run(int argc, char** argv) {
  const bool quick = argc == 3 && std::string(argv[2]) == "--quick";
  if (argc < 2 || argc > 3 || (argc == 3 && !quick)) {
    std::fprintf(stderr, "usage: %s <corpus.txt> [--quick]\n", argc > 0 ? argv[0] : "train_bigram_bf16");
    return 1;
  }
  Settings s;
  if (quick) s.steps = 300;
  const examples::Corpus corpus = examples::load_corpus(argv[1]);
  const Index V = corpus.V();
  std::printf("corpus %s: V = %ld; untied bigram, d = %ld, B = %ld x T = %ld, %d steps\n", argv[1],
              static_cast<long>(V), static_cast<long>(s.d), static_cast<long>(s.B), static_cast<long>(s.T), s.steps);

  // One start for all four: N(0, init_std^2) draws rounded to bf16 (so float starts there too).
  RowMatrix<float> E(V, s.d), W(V, s.d);
  Rng rng(s.seed);
  init_normal<float>(E, s.init_std, rng);
  init_normal<float>(W, s.init_std, rng);
  E = widen_table<BF16>(convert_table<BF16>(E));
  W = widen_table<BF16>(convert_table<BF16>(W));

  for (const bool adamw : {false, true}) {
    FloatModel f(E, W);
    const double float_loss = train(f, corpus, s, adamw, LowPrecisionUpdate::nearest);  // float: mode unused
    double bf16_loss[3] = {};
    const LowPrecisionUpdate modes[3] = {LowPrecisionUpdate::nearest, LowPrecisionUpdate::stochastic,
                                         LowPrecisionUpdate::kahan};
    for (int i = 0; i < 3; ++i) {
      BF16Model m(E, W);
      bf16_loss[i] = train(m, corpus, s, adamw, modes[i]);
    }
    std::printf("\n%s: held-out loss (nats per byte) after %d steps:\n",
                adamw ? "AdamW, lr 3e-3 -> 0, weight_decay 0.01" : "SGD, lr 2 -> 0", s.steps);
    std::printf("  float                       %.4f\n", float_loss);
    const char* names[3] = {"bf16, round-to-nearest    ", "bf16, stochastic rounding ", "bf16, Kahan compensation  "};
    for (int i = 0; i < 3; ++i)
      std::printf("  %s  %.4f  (%+.2f %% of float)\n", names[i], bf16_loss[i],
                  100.0 * (bf16_loss[i] - float_loss) / float_loss);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_bigram_bf16: error: %s\n", e.what());
    return 1;
  }
}
