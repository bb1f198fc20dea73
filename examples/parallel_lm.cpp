// Training across processes, checked against one process: run it under mpirun.
//
//   mpirun -np 2 build/release/examples/parallel_lm examples/data/corpus.txt
//
// The model predicts each next byte of examples/data/corpus.txt from the current one and its
// position in a window of T bytes:
//   x = dropout(E[ids] + P[t]),  loss = cross-entropy(x W^T + b, next byte)   (fused: no [N, V] logits)
// trained with AdamW for a number of steps, three ways, each beside a single-process replica that
// every rank trains on the same batches (the same layers from the same seeds):
//
//   1. vocabulary-parallel, untied: each rank owns rows [begin, end) of E and of W (and b);
//      VocabParallelEmbedding, VocabParallelOutputProjection, VocabParallelFusedHeadLoss.
//   2. vocabulary-parallel, tied: W is E's shard.
//   3. data-parallel: every rank holds the whole model and takes every R-th window of the batch;
//      after backward, all_reduce_gradients sums the gradients (E's sparsely: only touched rows
//      travel) so each rank steps with the whole batch's gradient. No dropout here: the replica's
//      masks over the whole batch could not match the ranks' masks over their parts.
//
// Each way prints its loss every few steps and, at the end, the largest difference from the
// replica in any loss and any parameter; the program exits with status 1 if one exceeds 1e-5
// (float rounding of sums taken in another order, amplified a little by AdamW's division by
// sqrt(v)). `--quick` runs 20 steps (ctest runs it under mpirun -np 2 and -np 3).
#include <embedhead/embedhead.hpp>
#include <embedhead/parallel/mpi_communicator.hpp>

#include "corpus.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace embedhead;
using Ids = IdMatrix<std::int32_t>;

constexpr Index kD = 32, kT = 16, kB = 16;
constexpr double kTolerance = 1e-5;

// Windows of T + 1 bytes starting at positions drawn from one seeded stream, the same on every rank.
struct Batch {
  Ids ids, targets;  // [B, T] each
};
Batch batch_at(const examples::Corpus& corpus, int step) {
  std::mt19937_64 gen(1000 + static_cast<std::uint64_t>(step));
  std::uniform_int_distribution<std::size_t> start(0, corpus.train.size() - kT - 2);
  Batch batch{Ids(kB, kT), Ids(kB, kT)};
  for (Index b = 0; b < kB; ++b) {
    const std::size_t s = start(gen);
    for (Index t = 0; t < kT; ++t) {
      batch.ids(b, t) = corpus.train[s + static_cast<std::size_t>(t)];
      batch.targets(b, t) = corpus.train[s + static_cast<std::size_t>(t) + 1];
    }
  }
  return batch;
}

// The largest |a - b| of two parameters of the same shape.
double difference_of(const Parameter<float>& a, const Parameter<float>& b) {
  return static_cast<double>((a.value() - b.value()).cwiseAbs().maxCoeff());
}

// The largest |a - b| over the rows [begin, begin + shard.rows()) of a full table.
double shard_difference(const Parameter<float>& shard, const Parameter<float>& full, Index begin) {
  return static_cast<double>((shard.value() - full.value().middleRows(begin, shard.rows())).cwiseAbs().maxCoeff());
}

// The single-process replica: the model every way is compared with.
struct Replica {
  TokenEmbedding<float> embedding;
  LearnedPositionEmbedding<float> positions{kT, kD};
  Dropout<float> dropout;
  OutputProjection<float> head;
  FusedHeadLoss<float> loss;
  std::unique_ptr<AdamW<float>> optimizer;

  Replica(Index V, bool tied, double p) : embedding(V, kD), dropout(p, 7), head(V, kD), loss() {
    if (tied) head.tie_to(embedding);
    auto parameters = unique_parameters(concat(embedding.weight_ptr(), positions.weight_ptr(), head.parameters()));
    optimizer = std::make_unique<AdamW<float>>(AdamOptions{3e-3}, parameters);
  }
  static std::vector<std::shared_ptr<Parameter<float>>> concat(std::shared_ptr<Parameter<float>> a,
                                                               std::shared_ptr<Parameter<float>> b,
                                                               std::vector<std::shared_ptr<Parameter<float>>> rest) {
    rest.insert(rest.begin(), {a, b});
    return rest;
  }
  double step(const Batch& batch) {
    RowMatrix<float> x = embedding.forward(batch.ids);
    positions.forward(x, kB, kT, x);
    RowMatrix<float> h = dropout.forward(x);
    RowMatrix<float> dh(kB * kT, kD);
    const double value = loss.forward_backward(head, h, batch.targets, dh).loss;
    const RowMatrix<float> dx = dropout.backward(dh);
    positions.backward(dx, kB, kT);
    embedding.backward(batch.ids, dx);
    optimizer->step();
    embedding.zero_grad();
    positions.zero_grad();
    head.zero_grad();
    return value;
  }
};

struct Report {
  double loss_difference = 0, parameter_difference = 0;
};

Report vocabulary_parallel(Communicator& world, const examples::Corpus& corpus, bool tied, int steps) {
  const Index V = corpus.V();
  Replica replica(V, tied, 0.1);
  VocabParallelEmbedding<float> embedding(V, kD, world);
  LearnedPositionEmbedding<float> positions(kT, kD);  // replicated: every rank holds all of P
  Dropout<float> dropout(0.1, 7);                     // the same seed on every rank: the same masks
  VocabParallelOutputProjection<float> head = tied ? VocabParallelOutputProjection<float>(embedding)
                                                   : VocabParallelOutputProjection<float>(V, kD, world);
  VocabParallelFusedHeadLoss<float> loss;
  std::vector<std::shared_ptr<Parameter<float>>> parameters{embedding.weight_ptr(), positions.weight_ptr()};
  for (const auto& p : head.parameters()) parameters.push_back(p);
  AdamW<float> optimizer(AdamOptions{3e-3}, unique_parameters(parameters));

  Report report;
  const Index begin = embedding.shard().begin;
  for (int step = 0; step < steps; ++step) {
    const Batch batch = batch_at(corpus, step);
    RowMatrix<float> x = embedding.forward(batch.ids);  // one all-reduce of N d
    positions.forward(x, kB, kT, x);
    RowMatrix<float> h = dropout.forward(x);
    RowMatrix<float> dh(kB * kT, kD);
    const double value = loss.forward_backward(head, h, batch.targets, dh).loss;  // dh all-reduced
    const RowMatrix<float> dx = dropout.backward(dh);
    positions.backward(dx, kB, kT);
    embedding.backward(batch.ids, dx);  // owned rows only, no communication
    optimizer.step();
    embedding.zero_grad();
    positions.zero_grad();
    head.zero_grad();

    const double expected = replica.step(batch);
    report.loss_difference = std::max(report.loss_difference, std::abs(value - expected));
    if (world.rank() == 0 && (step % 10 == 0 || step == steps - 1))
      std::printf("  step %3d  loss %.5f  (one process: %.5f)\n", step, value, expected);
  }
  double difference = shard_difference(embedding.weight(), replica.embedding.weight(), begin);
  difference = std::max(difference, difference_of(positions.weight(), replica.positions.weight()));
  if (!tied) {
    difference = std::max(difference, shard_difference(head.weight(), replica.head.weight(), begin));
    difference = std::max(difference, shard_difference(*head.bias(), *replica.head.bias(), begin));
  }
  report.parameter_difference = difference;
  return report;
}

Report data_parallel(Communicator& world, const examples::Corpus& corpus, int steps) {
  const Index V = corpus.V();
  const int R = world.size(), me = world.rank();
  Replica replica(V, false, 0.0);
  TokenEmbedding<float> embedding(V, kD);
  LearnedPositionEmbedding<float> positions(kT, kD);
  OutputProjection<float> head(V, kD);
  std::vector<std::shared_ptr<Parameter<float>>> parameters{embedding.weight_ptr(), positions.weight_ptr()};
  for (const auto& p : head.parameters()) parameters.push_back(p);
  AdamW<float> optimizer(AdamOptions{3e-3}, parameters);

  Report report;
  for (int step = 0; step < steps; ++step) {
    const Batch batch = batch_at(corpus, step);
    // This rank's windows: b = me, me + R, ... (uneven when R does not divide B).
    std::vector<Index> mine;
    for (Index b = me; b < kB; b += R) mine.push_back(b);
    const Index local_B = static_cast<Index>(mine.size());
    Ids ids(local_B, kT), targets(local_B, kT);
    for (Index i = 0; i < local_B; ++i) {
      ids.row(i) = batch.ids.row(mine[static_cast<std::size_t>(i)]);
      targets.row(i) = batch.targets.row(mine[static_cast<std::size_t>(i)]);
    }
    // Sum over this rank's tokens, scaled by 1 / (all tokens): summed over ranks, the whole
    // batch's mean, and the gradients the mean's.
    FusedHeadLossOptions options;
    options.reduction = Reduction::sum;
    options.gradient_scale = 1.0 / static_cast<double>(kB * kT);
    FusedHeadLoss<float> loss(options);
    RowMatrix<float> dh(local_B * kT, kD);
    double value = 0;
    if (local_B > 0) {
      RowMatrix<float> x = embedding.forward(ids);
      positions.forward(x, local_B, kT, x);
      value = loss.forward_backward(head, x, targets, dh).sum / static_cast<double>(kB * kT);
      positions.backward(dh, local_B, kT);
      embedding.backward(ids, dh);
    }
    world.all_reduce_sum(&value, 1);
    const auto exchanged = all_reduce_gradients(parameters, world);  // E sparse, the rest dense
    optimizer.step();
    embedding.zero_grad();
    positions.zero_grad();
    head.zero_grad();

    const double expected = replica.step(batch);
    report.loss_difference = std::max(report.loss_difference, std::abs(value - expected));
    if (world.rank() == 0 && (step % 10 == 0 || step == steps - 1))
      std::printf("  step %3d  loss %.5f  (one process: %.5f)  E's gradient: %s, %lld of %lld rows sent\n", step, value,
                  expected, exchanged[0].dense ? "dense" : "sparse", static_cast<long long>(exchanged[0].rows_sent),
                  static_cast<long long>(V));
  }
  double difference = difference_of(embedding.weight(), replica.embedding.weight());
  difference = std::max(difference, difference_of(positions.weight(), replica.positions.weight()));
  difference = std::max(difference, difference_of(head.weight(), replica.head.weight()));
  difference = std::max(difference, difference_of(*head.bias(), *replica.head.bias()));
  report.parameter_difference = difference;
  return report;
}

}  // namespace

int main(int argc, char** argv) {
  MpiEnvironment mpi(argc, argv);
  MpiCommunicator world;
  if (argc < 2) {
    if (world.rank() == 0) std::fprintf(stderr, "usage: mpirun -np R %s <corpus.txt> [--quick]\n", argv[0]);
    return 2;
  }
  const bool quick = argc > 2 && std::strcmp(argv[2], "--quick") == 0;
  const int steps = quick ? 20 : 200;
  examples::Corpus corpus;
  try {
    corpus = examples::load_corpus(argv[1]);
  } catch (const std::exception& e) {
    if (world.rank() == 0) std::fprintf(stderr, "parallel_lm: %s\n", e.what());
    return 1;
  }
  if (world.rank() == 0)
    std::printf("parallel_lm: %d rank(s), V = %lld bytes, d = %lld, %lld windows of %lld bytes per step, %d steps\n",
                world.size(), static_cast<long long>(corpus.V()), static_cast<long long>(kD),
                static_cast<long long>(kB), static_cast<long long>(kT), steps);
  bool ok = true;
  auto print = [&](const char* name, const Report& report) {
    // Every rank's differences: the worst one counts.
    double worst[2] = {report.loss_difference, report.parameter_difference};
    world.all_reduce_max(worst, 2);
    const bool pass = worst[0] <= kTolerance && worst[1] <= kTolerance;
    ok = ok && pass;
    if (world.rank() == 0)
      std::printf("%s: largest difference from one process: loss %.3g, parameters %.3g -> %s\n\n", name, worst[0],
                  worst[1], pass ? "same to float rounding" : "MISMATCH");
  };
  if (world.rank() == 0) std::printf("\n1. vocabulary-parallel, untied head\n");
  print("vocabulary-parallel, untied", vocabulary_parallel(world, corpus, false, steps));
  if (world.rank() == 0) std::printf("2. vocabulary-parallel, tied head\n");
  print("vocabulary-parallel, tied", vocabulary_parallel(world, corpus, true, steps));
  if (world.rank() == 0) std::printf("3. data-parallel, sparse embedding gradients\n");
  print("data-parallel", data_parallel(world, corpus, steps));
  return ok ? 0 : 1;
}
