// Tests for include/embedhead/parallel/vocab_parallel_fused_head_loss.hpp: the fused head + loss over a
// vocabulary shard; built single-process and under mpirun with 1, 2 and 3 ranks
// (tests/parallel/world.hpp).
//
// Every rank builds the same single-process OutputProjection (same seed) and the same h and
// targets, and takes rows [begin, end) = vocab_shard(V, rank, R) of its W and bias as its shard
// Parameters. Expected values: FusedHeadLoss on the whole head (bit-identical with one rank, to
// float rounding with more: the vocabulary sums split at other places) and the unfused path
// (logits [N, V] in full, cross_entropy_forward_backward, output_projection_backward). Replicated
// outputs are checked bit-identical across ranks. V = 53 splits 27/26 on 2 ranks and 18/18/17 on
// 3; valid_vocab = 36 then leaves the third rank's shard wholly in the padding.
#include <embedhead/fused_head_loss.hpp>
#include <embedhead/output_projection.hpp>
#include <embedhead/parallel/vocab_parallel_fused_head_loss.hpp>

#include "../reference/test_support.hpp"
#include "world.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace {

using Catch::Matchers::Contains;
using Catch::Matchers::EndsWith;
using Catch::Matchers::WithinAbs;
using Catch::Matchers::WithinRel;
using embedhead::Communicator;
using embedhead::CrossEntropyOptions;
using embedhead::CrossEntropyResult;
using embedhead::FusedHeadLoss;
using embedhead::FusedHeadLossExtras;
using embedhead::FusedHeadLossOptions;
using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::OutputProjection;
using embedhead::OutputProjectionOptions;
using embedhead::Parameter;
using embedhead::Reduction;
using embedhead::RowMatrix;
using embedhead::VocabParallelFusedHeadLoss;
using embedhead::VocabShard;
using test_support::close;
using test_support::random_ids;
using test_support::random_matrix;
using test_support::same_values;
using test_support::tolerance;
using test_support::agreed_error;
using test_support::on_last_rank;
using test_support::world;

// The whole head on every rank, and this rank's shard of it as Parameters.
template <typename Scalar>
struct Setup {
  Index V, d, N;
  VocabShard shard;
  OutputProjection<Scalar> full;
  std::shared_ptr<Parameter<Scalar>> W_shard, b_shard;  // b_shard null without a bias
  RowMatrix<Scalar> h;
  IdMatrix<std::int64_t> targets;
};

// init_std 0.5 and h in [-1, 1): logits of a few units, so the softmax is far from uniform and
// soft-capping at 2 matters. The bias (zero after construction) is drawn too.
template <typename Scalar>
Setup<Scalar> make_setup(Index V, Index d, Index B, Index T, std::uint64_t seed, bool bias, Index classes = -1) {
  Communicator& comm = world();
  OutputProjectionOptions options;
  options.bias = bias;
  options.init_std = 0.5;
  options.seed = seed;
  Setup<Scalar> s{V,
                  d,
                  B * T,
                  embedhead::vocab_shard(V, comm.rank(), comm.size()),
                  OutputProjection<Scalar>(V, d, options),
                  nullptr,
                  nullptr,
                  random_matrix<Scalar>(B * T, d, seed + 1, 1.0),
                  random_ids<std::int64_t>(B, T, classes < 0 ? V : classes, seed + 2)};
  if (bias) s.full.bias()->value() = random_matrix<Scalar>(V, 1, seed + 3, 0.5);
  s.W_shard = std::make_shared<Parameter<Scalar>>(s.shard.rows(), d, "W shard");
  s.W_shard->value() = s.full.weight().value().middleRows(s.shard.begin, s.shard.rows());
  if (bias) {
    s.b_shard = std::make_shared<Parameter<Scalar>>(s.shard.rows(), 1, "b shard");
    s.b_shard->value() = s.full.bias()->value().middleRows(s.shard.begin, s.shard.rows());
  }
  return s;
}

template <typename Scalar>
struct Outputs {
  CrossEntropyResult result;
  RowMatrix<Scalar> dh, dW, db, lse, losses;  // dW, db: this rank's rows [begin, end)
};

template <typename Scalar>
FusedHeadLossExtras<Scalar> extras_of(const RowMatrix<Scalar>& weights, RowMatrix<Scalar>& lse,
                                      RowMatrix<Scalar>& losses) {
  return FusedHeadLossExtras<Scalar>{Eigen::Map<const RowMatrix<Scalar>>(weights.data(), weights.rows(),
                                                                         weights.cols()),
                                     Eigen::Map<RowMatrix<Scalar>>(lse.data(), lse.rows(), lse.cols()),
                                     Eigen::Map<RowMatrix<Scalar>>(losses.data(), losses.rows(), losses.cols())};
}

// FusedHeadLoss on the whole head, from zero gradients; dW and db cut to this rank's rows.
template <typename Scalar>
Outputs<Scalar> on_full_head(Setup<Scalar>& s, const FusedHeadLossOptions& options, const RowMatrix<Scalar>& weights) {
  Outputs<Scalar> out{{}, RowMatrix<Scalar>(s.N, s.d), {}, {}, RowMatrix<Scalar>(s.N, 1), RowMatrix<Scalar>(s.N, 1)};
  s.full.zero_grad();
  FusedHeadLoss<Scalar> loss(options);
  out.result = loss.forward_backward(s.full, s.h, s.targets, out.dh, extras_of(weights, out.lse, out.losses));
  out.dW = s.full.weight().grad().to_dense().middleRows(s.shard.begin, s.shard.rows());
  if (s.full.bias()) out.db = s.full.bias()->grad().to_dense().middleRows(s.shard.begin, s.shard.rows());
  return out;
}

// VocabParallelFusedHeadLoss on this rank's shard, from zero gradients.
template <typename Scalar, typename Targets>
Outputs<Scalar> on_shard(Setup<Scalar>& s, const FusedHeadLossOptions& options, const RowMatrix<Scalar>& weights,
                         const Targets& targets) {
  Outputs<Scalar> out{{}, RowMatrix<Scalar>(s.N, s.d), {}, {}, RowMatrix<Scalar>(s.N, 1), RowMatrix<Scalar>(s.N, 1)};
  s.W_shard->zero_grad();
  if (s.b_shard) s.b_shard->zero_grad();
  VocabParallelFusedHeadLoss<Scalar> loss(options);
  out.result = loss.forward_backward_shard(world(), s.V, *s.W_shard, s.b_shard.get(), s.h, targets, out.dh,
                                           extras_of(weights, out.lse, out.losses));
  out.dW = s.W_shard->grad().to_dense();
  if (s.b_shard) out.db = s.b_shard->grad().to_dense();
  return out;
}

// The unfused single-process path (no per-token weights): full logits, the plain loss, the
// head's backward; dW and db cut to this rank's rows.
template <typename Scalar>
Outputs<Scalar> unfused(const Setup<Scalar>& s, const CrossEntropyOptions& options) {
  const RowMatrix<Scalar> no_bias(0, 1);
  const bool bias = s.full.bias() != nullptr;
  const RowMatrix<Scalar> b = bias ? RowMatrix<Scalar>(s.full.bias()->value()) : no_bias;
  RowMatrix<Scalar> logits(s.N, s.V), dlogits(s.N, s.V);
  Outputs<Scalar> out{{}, RowMatrix<Scalar>(s.N, s.d), {}, {}, {}, RowMatrix<Scalar>(s.N, 1)};
  embedhead::output_projection_forward<Scalar>(s.h, s.full.weight().value(), b, logits);
  out.result = embedhead::cross_entropy_forward_backward<Scalar>(logits, s.targets, dlogits, out.losses, options);
  RowMatrix<Scalar> dW = RowMatrix<Scalar>::Zero(s.V, s.d), db = RowMatrix<Scalar>::Zero(bias ? s.V : 0, 1);
  embedhead::output_projection_backward<Scalar>(s.h, s.full.weight().value(), dlogits, out.dh, dW, db);
  out.dW = dW.middleRows(s.shard.begin, s.shard.rows());
  if (bias) out.db = db.middleRows(s.shard.begin, s.shard.rows());
  return out;
}

// True when every rank passed the same bytes.
template <typename T>
bool same_on_every_rank(const T* data, Index count) {
  const std::uint64_t mine = embedhead::detail::fingerprint_bytes(data, static_cast<std::size_t>(count) * sizeof(T));
  const std::vector<std::int64_t> all = world().all_gather(static_cast<std::int64_t>(mine));
  for (std::int64_t f : all)
    if (f != all[0]) return false;
  return true;
}

template <typename Scalar>
bool replicated(const Outputs<Scalar>& out) {
  const double scalars[4] = {out.result.loss, out.result.sum, out.result.z_loss, out.result.weight_sum};
  return same_on_every_rank(scalars, 4) && same_on_every_rank(out.dh.data(), out.dh.size()) &&
         same_on_every_rank(out.lse.data(), out.lse.size()) && same_on_every_rank(out.losses.data(), out.losses.size());
}

// Exact with one rank (the same arithmetic), to rounding with more.
template <typename Scalar>
void check_matches(const Outputs<Scalar>& actual, const Outputs<Scalar>& expected, bool exact, bool has_lse = true) {
  const double tol = 2 * tolerance<Scalar>();
  CHECK(actual.result.count == expected.result.count);
  CHECK(actual.result.weight_sum == expected.result.weight_sum);
  if (exact) {
    CHECK(actual.result.loss == expected.result.loss);
    CHECK(actual.result.sum == expected.result.sum);
    CHECK(actual.result.z_loss == expected.result.z_loss);
    CHECK(same_values(actual.dh, expected.dh));
    CHECK(same_values(actual.dW, expected.dW));
    CHECK(same_values(actual.db, expected.db));
    if (has_lse) CHECK(same_values(actual.lse, expected.lse));
    CHECK(same_values(actual.losses, expected.losses));
  } else {
    CHECK_THAT(actual.result.loss, WithinRel(expected.result.loss, tol) || WithinAbs(expected.result.loss, tol));
    CHECK_THAT(actual.result.sum, WithinRel(expected.result.sum, tol) || WithinAbs(expected.result.sum, tol));
    CHECK_THAT(actual.result.z_loss,
               WithinRel(expected.result.z_loss, 1e-4) || WithinAbs(expected.result.z_loss, 1e-12));
    CHECK(close(actual.dh, expected.dh, tol));
    CHECK(close(actual.dW, expected.dW, tol));
    CHECK(close(actual.db, expected.db, tol));
    if (has_lse) CHECK(close(actual.lse, expected.lse, tol));
    CHECK(close(actual.losses, expected.losses, tol));
  }
}

struct Variant {
  const char* name;
  FusedHeadLossOptions options;
};

std::vector<Variant> variants() {
  std::vector<Variant> list;
  auto add = [&](const char* name, auto edit) {
    FusedHeadLossOptions o;
    edit(o);
    list.push_back({name, o});
  };
  add("plain", [](FusedHeadLossOptions&) {});
  add("sum", [](FusedHeadLossOptions& o) { o.reduction = Reduction::sum; });
  add("none, gradient scale", [](FusedHeadLossOptions& o) {
    o.reduction = Reduction::none;
    o.gradient_scale = 0.25;
  });
  add("ignore_index 1", [](FusedHeadLossOptions& o) { o.ignore_index = 1; });
  add("label smoothing", [](FusedHeadLossOptions& o) { o.label_smoothing = 0.1; });
  add("z-loss", [](FusedHeadLossOptions& o) { o.z_loss = 1e-2; });
  add("soft-cap", [](FusedHeadLossOptions& o) { o.softcap = 2.0; });
  add("entropy bonus", [](FusedHeadLossOptions& o) { o.entropy_bonus = 0.3; });
  add("class weights", [](FusedHeadLossOptions& o) { o.class_weights = test_support::class_weights(53); });
  add("class weights, label smoothing, padding", [](FusedHeadLossOptions& o) {
    o.valid_vocab = 36;
    o.label_smoothing = 0.1;
    o.class_weights = test_support::class_weights(36);
  });
  add("padding: a whole shard on 3 ranks", [](FusedHeadLossOptions& o) { o.valid_vocab = 36; });
  add("padding inside a shard", [](FusedHeadLossOptions& o) { o.valid_vocab = 50; });
  add("everything", [](FusedHeadLossOptions& o) {
    o.label_smoothing = 0.2;
    o.z_loss = 1e-3;
    o.softcap = 3.0;
    o.ignore_index = 1;
    o.valid_vocab = 36;
    o.gradient_scale = 0.5;
    o.entropy_bonus = -0.2;
  });
  return list;
}

// Targets within the classes, two of them ignored (whatever ignore_index is).
template <typename Scalar>
IdMatrix<std::int64_t> targets_for(const Setup<Scalar>& s, const FusedHeadLossOptions& options, std::uint64_t seed) {
  const Index classes = options.valid_vocab < 0 ? s.V : options.valid_vocab;
  IdMatrix<std::int64_t> t = random_ids<std::int64_t>(s.targets.rows(), s.targets.cols(), classes, seed);
  t(0, 2) = t(2, 5) = options.ignore_index;
  return t;
}

// A stand-in for VocabParallelOutputProjection (part of another change): exactly the members the
// Head entry points use.
template <typename Scalar>
struct ShardHead {
  Communicator* comm;
  Index V;
  std::shared_ptr<Parameter<Scalar>> w, b;
  Communicator& communicator() const { return *comm; }
  Index vocab_size() const { return V; }
  Parameter<Scalar>& weight() { return *w; }
  const Parameter<Scalar>& weight() const { return *w; }
  Parameter<Scalar>* bias() { return b.get(); }
  const Parameter<Scalar>* bias() const { return b.get(); }
};

}  // namespace

TEMPLATE_TEST_CASE("vocabulary-parallel fused loss equals FusedHeadLoss on the whole head, every option",
                   "[vocab_parallel_fused]", float, double) {
  using Scalar = TestType;
  const bool one_rank = world().size() == 1;
  for (bool bias : {true, false}) {
    Setup<Scalar> s = make_setup<Scalar>(53, 13, 3, 7, 11, bias);
    for (const Variant& variant : variants()) {
      for (Index block : {Index(0), Index(4), Index(7)}) {  // 0: one block; 4, 7: several per shard, the last partial
        // The plan: two passes, token chunks of 2 tokens (several chunks, the last partial), automatic.
        for (int plan : {0, 1, 2}) {
          for (bool weighted : {false, true}) {
            CAPTURE(variant.name, block, plan, bias, weighted, world().rank(), world().size());
            FusedHeadLossOptions options = variant.options;
            options.vocab_block = block;
            options.plan = plan == 0   ? embedhead::FusedPlan::vocab_blocks
                           : plan == 1 ? embedhead::FusedPlan::token_chunks
                                       : embedhead::FusedPlan::automatic;
            // 2 tokens of the widest shard's rows (the whole head on one rank).
            if (plan == 1)
              options.memory_budget = 2 * embedhead::vocab_shard(s.V, 0, world().size()).rows() *
                                      static_cast<Index>(sizeof(Scalar));
            s.targets = targets_for(s, options, 17);
            RowMatrix<Scalar> weights(0, 1);
            if (weighted) {
              weights = random_matrix<Scalar>(s.N, 1, 19, 1.0).cwiseAbs();
              weights(3, 0) = 0;  // counts, adds nothing
            }
            // The whole head's reference: the same plan on one rank (then bit for bit); on more, a
            // budget sized for a shard may not hold a row of the whole head, so the default plan.
            FusedHeadLossOptions reference = options;
            if (!one_rank) {
              reference.plan = embedhead::FusedPlan::automatic;
              reference.memory_budget = 0;
            }
            const Outputs<Scalar> expected = on_full_head(s, reference, weights);
            const Outputs<Scalar> actual = on_shard(s, options, weights, s.targets);
            CHECK(actual.result.count == (s.targets.array() != options.ignore_index).count());
            CHECK(actual.result.count <= s.N - 2);
            check_matches(actual, expected, one_rank);
            CHECK(replicated(actual));
            CHECK(s.W_shard->grad().is_dense());
            // Padding rows of the shard receive nothing.
            const Index classes = options.valid_vocab < 0 ? s.V : options.valid_vocab;
            const Index padding_from = std::clamp<Index>(classes - s.shard.begin, 0, s.shard.rows());
            CHECK(actual.dW.bottomRows(s.shard.rows() - padding_from).cwiseAbs().sum() == 0);

            // The loss alone: the same numbers, bit for bit.
            RowMatrix<Scalar> lse(s.N, 1), losses(s.N, 1);
            VocabParallelFusedHeadLoss<Scalar> loss_only(options);
            const CrossEntropyResult r = loss_only.forward_shard(world(), s.V, *s.W_shard, s.b_shard.get(), s.h,
                                                                 s.targets, extras_of(weights, lse, losses));
            CHECK(r.loss == actual.result.loss);
            CHECK(r.z_loss == actual.result.z_loss);
            CHECK(same_values(lse, actual.lse));
            CHECK(same_values(losses, actual.losses));

            if (!weighted) {  // the unfused path has no per-token weights
              const Outputs<Scalar> plain = unfused(s, options);
              check_matches(actual, plain, false, /*has_lse=*/false);
            }
          }
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("vocabulary-parallel fused loss: int32 targets, larger V, d over several GEMM pieces",
                   "[vocab_parallel_fused]", float, double) {
  using Scalar = TestType;
  const bool one_rank = world().size() == 1;
  // V = 701: shards of 351/350 and 234/234/233 rows, each in pieces of 256 rows; d = 140 > 128.
  Setup<Scalar> s = make_setup<Scalar>(701, 140, 2, 5, 23, true);
  s.h *= Scalar(0.3);
  FusedHeadLossOptions options;
  options.label_smoothing = 0.05;
  options.vocab_block = 300;
  s.targets(1, 1) = -100;
  const IdMatrix<std::int32_t> targets32 = s.targets.template cast<std::int32_t>();
  const RowMatrix<Scalar> no_weights(0, 1);
  const Outputs<Scalar> expected = on_full_head(s, options, no_weights);
  const Outputs<Scalar> actual64 = on_shard(s, options, no_weights, s.targets);
  const Outputs<Scalar> actual32 = on_shard(s, options, no_weights, targets32);
  check_matches(actual64, expected, one_rank);
  check_matches(actual32, actual64, true);
  CHECK(replicated(actual64));
}

TEMPLATE_TEST_CASE("vocabulary-parallel fused loss: accumulation, frozen shards, dh aliasing h or strided, all ignored",
                   "[vocab_parallel_fused]", float, double) {
  using Scalar = TestType;
  Communicator& comm = world();
  Setup<Scalar> s = make_setup<Scalar>(50, 9, 2, 6, 31, true);
  FusedHeadLossOptions options;
  options.vocab_block = 5;
  options.z_loss = 1e-3;
  s.targets(1, 4) = -100;
  const RowMatrix<Scalar> no_weights(0, 1);
  const Outputs<Scalar> once = on_shard(s, options, no_weights, s.targets);
  VocabParallelFusedHeadLoss<Scalar> loss(options);

  SECTION("gradients accumulate") {
    RowMatrix<Scalar> dh(s.N, s.d);
    loss.forward_backward_shard(comm, s.V, *s.W_shard, s.b_shard.get(), s.h, s.targets, dh);  // on top of `once`
    CHECK(same_values(s.W_shard->grad().to_dense(), RowMatrix<Scalar>(once.dW * Scalar(2))));
    CHECK(same_values(s.b_shard->grad().to_dense(), RowMatrix<Scalar>(once.db * Scalar(2))));
    CHECK(same_values(dh, once.dh));  // dh is written, not accumulated
  }
  SECTION("frozen weight and bias shards take nothing; loss and dh unchanged") {
    s.W_shard->zero_grad();
    s.b_shard->zero_grad();
    s.W_shard->set_frozen(true);
    s.b_shard->set_frozen(true);
    RowMatrix<Scalar> dh(s.N, s.d);
    const CrossEntropyResult r = loss.forward_backward_shard(comm, s.V, *s.W_shard, s.b_shard.get(), s.h, s.targets,
                                                             dh);
    CHECK(r.loss == once.result.loss);
    CHECK(same_values(dh, once.dh));
    CHECK(s.W_shard->grad().num_touched() == 0);
    CHECK(s.b_shard->grad().num_touched() == 0);
  }
  SECTION("trainable rows on each shard: dW on those rows only; loss, dh and db unchanged") {
    const std::vector<Index> rows = {0, 2, s.shard.rows() - 1};  // local ids of this rank's shard
    s.W_shard->set_trainable_rows(rows);
    s.b_shard->zero_grad();
    RowMatrix<Scalar> dh(s.N, s.d);
    const CrossEntropyResult r = loss.forward_backward_shard(comm, s.V, *s.W_shard, s.b_shard.get(), s.h, s.targets,
                                                             dh);
    CHECK(r.loss == once.result.loss);
    CHECK(same_values(dh, once.dh));
    CHECK(same_values(s.b_shard->grad().to_dense(), once.db));
    CHECK_FALSE(s.W_shard->grad().is_dense());
    REQUIRE(s.W_shard->grad().touched_rows() == rows);
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const RowMatrix<Scalar> got = s.W_shard->grad().touched_row(static_cast<Index>(i));
      const RowMatrix<Scalar> expected = once.dW.row(rows[i]);
      CHECK(test_support::close(got, expected, test_support::tolerance<Scalar>()));
    }
  }
  SECTION("dh may be h") {
    RowMatrix<Scalar> h = s.h;
    s.W_shard->zero_grad();
    s.b_shard->zero_grad();
    loss.forward_backward_shard(comm, s.V, *s.W_shard, s.b_shard.get(), h, s.targets, h);
    CHECK(same_values(h, once.dh));
    CHECK(same_values(s.W_shard->grad().to_dense(), once.dW));
  }
  SECTION("dh strided (a block of a wider matrix), h strided, every token counted") {
    s.targets(1, 4) = 3;  // nothing ignored: dh would be used in place, were it contiguous
    const Outputs<Scalar> dense = on_shard(s, options, no_weights, s.targets);
    RowMatrix<Scalar> wide = RowMatrix<Scalar>::Constant(s.N, s.d + 3, Scalar(7));
    RowMatrix<Scalar> h_wide = RowMatrix<Scalar>::Zero(s.N, s.d + 2);
    h_wide.leftCols(s.d) = s.h;
    s.W_shard->zero_grad();
    s.b_shard->zero_grad();
    loss.forward_backward_shard(comm, s.V, *s.W_shard, s.b_shard.get(), h_wide.leftCols(s.d), s.targets,
                                wide.middleCols(1, s.d));
    CHECK(same_values(wide.middleCols(1, s.d), dense.dh));
    CHECK(wide.col(0).isConstant(Scalar(7)));
    CHECK(wide.rightCols(2).isConstant(Scalar(7)));
    CHECK(same_values(s.W_shard->grad().to_dense(), dense.dW));
    CHECK(replicated(dense));
  }
  SECTION("every target ignored: loss 0, dh zero, no gradient") {
    s.targets.setConstant(-100);
    s.W_shard->zero_grad();
    RowMatrix<Scalar> dh = RowMatrix<Scalar>::Constant(s.N, s.d, Scalar(5));
    const CrossEntropyResult r = loss.forward_backward_shard(comm, s.V, *s.W_shard, s.b_shard.get(), s.h, s.targets,
                                                             dh);
    CHECK(r.count == 0);
    CHECK(r.loss == 0);
    CHECK(dh.isZero(0));
    CHECK(s.W_shard->grad().to_dense().isZero(0));
  }
}

TEMPLATE_TEST_CASE("vocabulary-parallel fused loss on a head object (the template entry points)",
                   "[vocab_parallel_fused]", float, double) {
  using Scalar = TestType;
  Setup<Scalar> s = make_setup<Scalar>(53, 8, 2, 4, 41, true);
  FusedHeadLossOptions options;
  options.vocab_block = 6;
  options.softcap = 2.0;
  const RowMatrix<Scalar> no_weights(0, 1);
  const Outputs<Scalar> expected = on_shard(s, options, no_weights, s.targets);
  ShardHead<Scalar> head{&world(), s.V, s.W_shard, s.b_shard};
  VocabParallelFusedHeadLoss<Scalar> loss(options);
  for (bool int32 : {false, true}) {
    CAPTURE(int32);
    head.w->zero_grad();
    head.b->zero_grad();
    RowMatrix<Scalar> dh(s.N, s.d);
    const IdMatrix<std::int32_t> targets32 = s.targets.template cast<std::int32_t>();
    const CrossEntropyResult r = int32 ? loss.forward_backward(head, s.h, targets32, dh)
                                       : loss.forward_backward(head, s.h, s.targets, dh);
    CHECK(r.loss == expected.result.loss);
    CHECK(same_values(dh, expected.dh));
    CHECK(same_values(head.w->grad().to_dense(), expected.dW));
    CHECK(same_values(head.b->grad().to_dense(), expected.db));
    const ShardHead<Scalar>& const_head = head;
    const CrossEntropyResult f = int32 ? loss.forward(const_head, s.h, targets32)
                                       : loss.forward(const_head, s.h, s.targets);
    CHECK(f.loss == expected.result.loss);
  }
}

TEST_CASE("vocabulary-parallel fused loss: errors agreed on every rank, nothing changed",
          "[vocab_parallel_fused][errors]") {
  using Scalar = float;
  Communicator& comm = world();
  const int R = comm.size();
  const bool last = comm.rank() == R - 1;
  Setup<Scalar> s = make_setup<Scalar>(53, 6, 2, 4, 51, true);
  // A sparse gradient (row 0 touched) that a dry run must not switch to dense mode.
  Index slot = 0;
  const Index row0 = 0;
  s.W_shard->grad().touch_rows(&row0, 1, &slot);
  s.W_shard->grad().slot_row(slot).setConstant(Scalar(1.5));
  const RowMatrix<Scalar> W_before = s.W_shard->value(), b_before = s.b_shard->value();
  RowMatrix<Scalar> dh = RowMatrix<Scalar>::Constant(s.N, s.d, Scalar(7));
  RowMatrix<Scalar> lse = RowMatrix<Scalar>::Constant(s.N, 1, Scalar(8)),
                    losses = RowMatrix<Scalar>::Constant(s.N, 1, Scalar(9));
  RowMatrix<Scalar> no_weights(0, 1);
  VocabParallelFusedHeadLoss<Scalar> loss;
  const std::string fb = "VocabParallelFusedHeadLoss::forward_backward_shard";

  auto call = [&](const IdMatrix<std::int64_t>& targets, const RowMatrix<Scalar>& weights, Parameter<Scalar>& W,
                  Parameter<Scalar>* b, Index V) {
    return [&, V, b] { loss.forward_backward_shard(comm, V, W, b, s.h, targets, dh, extras_of(weights, lse, losses)); };
  };

  SECTION("a target out of range on the last rank") {
    IdMatrix<std::int64_t> targets = s.targets;
    if (last) targets(1, 2) = 53;
    const std::string message = agreed_error<embedhead::index_error>(
        call(targets, no_weights, *s.W_shard, s.b_shard.get(), 53));
    CHECK_THAT(message,
               Contains(fb) && Contains("target 53 at n=6") && Contains("outside [0, 53)") && EndsWith(on_last_rank()));
  }
  SECTION("a target in the padding") {
    VocabParallelFusedHeadLoss<Scalar> padded([] {
      FusedHeadLossOptions o;
      o.valid_vocab = 36;
      return o;
    }());
    IdMatrix<std::int64_t> targets = s.targets;
    targets(0, 0) = 40;
    const std::string message = agreed_error<embedhead::index_error>(
        [&] { padded.forward_backward_shard(comm, 53, *s.W_shard, s.b_shard.get(), s.h, targets, dh); });
    CHECK_THAT(message, Contains("target 40") && Contains("vocabulary padding"));
  }
  SECTION("targets that differ across ranks") {
    IdMatrix<std::int64_t> targets = s.targets;
    if (last && R > 1) targets(0, 1) = (targets(0, 1) + 1) % 53;
    if (R > 1) {
      const std::string message = agreed_error<embedhead::value_error>(
          call(targets, no_weights, *s.W_shard, s.b_shard.get(), 53));
      CHECK_THAT(message, Contains(fb) && Contains("disagree on the call (forward or forward_backward), targets"));
    }
  }
  SECTION("valid per-token weights that differ across ranks") {
    RowMatrix<Scalar> weights = RowMatrix<Scalar>::Ones(s.N, 1);
    if (last && R > 1) weights(1, 0) = Scalar(2);  // valid on every rank, but not the same
    if (R > 1) {
      const std::string message = agreed_error<embedhead::value_error>(
          call(s.targets, weights, *s.W_shard, s.b_shard.get(), 53));
      CHECK_THAT(message, Contains(fb) && Contains("per-token weights"));
    }
  }
  SECTION("forward_shard on one rank, forward_backward_shard on the others") {
    if (R > 1) {
      // Every rank throws value_error; the messages differ only in the function each rank called.
      std::string message;
      try {
        if (last)
          loss.forward_shard(comm, 53, *s.W_shard, s.b_shard.get(), s.h, s.targets, extras_of(no_weights, lse, losses));
        else
          loss.forward_backward_shard(comm, 53, *s.W_shard, s.b_shard.get(), s.h, s.targets, dh,
                                      extras_of(no_weights, lse, losses));
      } catch (const embedhead::value_error& e) {
        message = e.what();
      }
      CHECK_THAT(message, Contains(last ? "forward_shard: ranks 0 and " : "forward_backward_shard: ranks 0 and ") &&
                              Contains("disagree on the call (forward or forward_backward)"));
    }
  }
  SECTION("a weight shard of the wrong shape on the last rank") {
    Parameter<Scalar> wrong(s.shard.rows() + (last ? 1 : 0), s.d);
    wrong.value().setZero();
    const std::string message = agreed_error<embedhead::shape_error>(
        call(s.targets, no_weights, wrong, s.b_shard.get(), 53));
    CHECK_THAT(message, Contains(fb) && Contains("weight_shard is [") && EndsWith(on_last_rank()));
  }
  SECTION("a bias shard of the wrong shape") {
    Parameter<Scalar> wrong(s.shard.rows(), 2);
    const std::string message = agreed_error<embedhead::shape_error>(
        call(s.targets, no_weights, *s.W_shard, &wrong, 53));
    CHECK_THAT(message, Contains("bias_shard is ["));
  }
  SECTION("V smaller than the number of ranks") {
    const std::string message = agreed_error<embedhead::value_error>(
        call(s.targets, no_weights, *s.W_shard, s.b_shard.get(), R - 1));
    CHECK_THAT(message, Contains(fb) && Contains("V = " + std::to_string(R - 1)));
  }
  SECTION("a negative weight on the last rank") {
    RowMatrix<Scalar> weights = RowMatrix<Scalar>::Ones(s.N, 1);
    if (last) weights(5, 0) = -1;
    const std::string message = agreed_error<embedhead::value_error>(
        call(s.targets, weights, *s.W_shard, s.b_shard.get(), 53));
    CHECK_THAT(message, Contains("weight -1 at n=5") && EndsWith(on_last_rank()));
  }
  SECTION("options out of range") {
    for (int which = 0; which < 3; ++which) {
      FusedHeadLossOptions o;
      if (which == 0) o.label_smoothing = 1.5;
      if (which == 1) o.vocab_block = -1;
      if (which == 2) o.valid_vocab = 54;
      VocabParallelFusedHeadLoss<Scalar> bad(o);
      const std::string message = agreed_error<embedhead::value_error>(
          [&] { bad.forward_backward_shard(comm, 53, *s.W_shard, s.b_shard.get(), s.h, s.targets, dh); });
      CHECK_THAT(message, Contains(which == 0   ? "label_smoothing = 1.5"
                                   : which == 1 ? "vocab_block = -1"
                                                : "valid_vocab = 54"));
    }
  }
  SECTION("wrong shapes of dh, h, the extras and the targets") {
    RowMatrix<Scalar> small_dh(s.N, s.d - 1), wide_h(s.N, s.d + 1), short_lse(s.N - 1, 1);
    CHECK_THAT(agreed_error<embedhead::shape_error>([&] {
                 loss.forward_backward_shard(comm, 53, *s.W_shard, s.b_shard.get(), s.h, s.targets, small_dh);
               }),
               Contains("dh"));
    CHECK_THAT(agreed_error<embedhead::shape_error>(
                   [&] { loss.forward_backward_shard(comm, 53, *s.W_shard, s.b_shard.get(), wide_h, s.targets, dh); }),
               Contains("weight_shard is ["));
    CHECK_THAT(agreed_error<embedhead::shape_error>([&] {
                 loss.forward_backward_shard(comm, 53, *s.W_shard, s.b_shard.get(), s.h, s.targets, dh,
                                             extras_of(no_weights, short_lse, losses));
               }),
               Contains("lse"));
    const IdMatrix<std::int64_t> few = s.targets.leftCols(2);
    CHECK_THAT(agreed_error<embedhead::shape_error>(
                   [&] { loss.forward_backward_shard(comm, 53, *s.W_shard, s.b_shard.get(), s.h, few, dh); }),
               Contains("targets has 4 entries"));
  }
  SECTION("forward_shard checks the same way") {
    IdMatrix<std::int64_t> targets = s.targets;
    if (last) targets(0, 0) = -5;
    const std::string message = agreed_error<embedhead::index_error>([&] {
      loss.forward_shard(comm, 53, *s.W_shard, s.b_shard.get(), s.h, targets, extras_of(no_weights, lse, losses));
    });
    CHECK_THAT(message, Contains("VocabParallelFusedHeadLoss::forward_shard") && Contains("target -5") &&
                            EndsWith(on_last_rank()));
  }
  // Nothing changed, whichever error.
  CHECK(same_values(s.W_shard->value(), W_before));
  CHECK(same_values(s.b_shard->value(), b_before));
  CHECK_FALSE(s.W_shard->grad().is_dense());
  CHECK(s.W_shard->grad().touched_rows() == std::vector<Index>{0});
  CHECK(s.W_shard->grad().to_dense().row(0).isConstant(Scalar(1.5)));
  CHECK(s.b_shard->grad().num_touched() == 0);
  CHECK(dh.isConstant(Scalar(7)));
  CHECK(lse.isConstant(Scalar(8)));
  CHECK(losses.isConstant(Scalar(9)));
}

TEMPLATE_TEST_CASE("vocabulary-parallel fused loss: masked classes, whole shards of them, and non-finite inputs",
                   "[vocab_parallel_fused][nonfinite]", float, double) {
  // docs/errors.md, "Non-finite values". A shard whose every class is masked (-inf through the
  // bias: rank 0's [0, 27) on 2 ranks, [0, 18) on 3) has no finite logit: its statistics must add
  // nothing (a sum of exponentials of 0), not NaN. -1e30 in place of -inf gives the same numbers,
  // bit for bit; FusedHeadLoss on the whole head gives them to rounding (exactly on one rank).
  using Scalar = TestType;
  const Scalar inf = std::numeric_limits<Scalar>::infinity();
  Setup<Scalar> s = make_setup<Scalar>(53, 6, 2, 4, 61, true);
  for (Index i = 0; i < s.targets.size(); ++i) s.targets.data()[i] = 27 + s.targets.data()[i] % 26;  // not masked
  const RowMatrix<Scalar> full_bias = s.full.bias()->value();
  const RowMatrix<Scalar> no_weights(0, 1);
  auto set_bias = [&](const RowMatrix<Scalar>& bias) {
    s.full.bias()->value() = bias;
    s.b_shard->value() = bias.middleRows(s.shard.begin, s.shard.rows());
  };
  for (int plan : {0, 1}) {
    CAPTURE(plan, world().size());
    FusedHeadLossOptions options;
    options.vocab_block = 4;
    options.plan = plan == 0 ? embedhead::FusedPlan::vocab_blocks : embedhead::FusedPlan::token_chunks;
    if (plan == 1)
      options.memory_budget = 3 * embedhead::vocab_shard(s.V, 0, world().size()).rows() *
                              static_cast<Index>(sizeof(Scalar));
    RowMatrix<Scalar> masked = full_bias, floored = full_bias;
    masked.topRows(27).setConstant(-inf);
    floored.topRows(27).setConstant(Scalar(-1e30));
    set_bias(floored);
    const Outputs<Scalar> expected = on_shard(s, options, no_weights, s.targets);
    set_bias(masked);
    const Outputs<Scalar> got = on_shard(s, options, no_weights, s.targets);
    CHECK(std::isfinite(got.result.loss));
    CHECK(got.result.loss == expected.result.loss);
    CHECK(same_values(got.dh, expected.dh));
    CHECK(same_values(got.dW, expected.dW));
    CHECK(same_values(got.db, expected.db));
    CHECK(same_values(got.lse, expected.lse));
    CHECK(replicated(got));
    FusedHeadLossOptions reference = options;
    if (world().size() > 1) reference = FusedHeadLossOptions{};
    reference.vocab_block = 4;
    check_matches(got, on_full_head(s, reference, no_weights), world().size() == 1);
    // Every class masked: lse -inf, loss NaN, on every rank alike.
    RowMatrix<Scalar> all_masked = RowMatrix<Scalar>::Constant(53, 1, -inf);
    set_bias(all_masked);
    const Outputs<Scalar> none = on_shard(s, options, no_weights, s.targets);
    CHECK(std::isnan(none.result.loss));
    CHECK((none.lse.array() == -inf).all());
    CHECK(none.dh.array().isNaN().all());
    set_bias(full_bias);
  }
}

TEST_CASE("vocabulary-parallel fused loss with error_if_nonfinite: agreed on every rank, nothing changed",
          "[vocab_parallel_fused][nonfinite][errors]") {
  using Scalar = float;
  Communicator& comm = world();
  const int R = comm.size();
  const bool last = comm.rank() == R - 1;
  Setup<Scalar> s = make_setup<Scalar>(53, 6, 2, 4, 71, true);
  RowMatrix<Scalar> dh = RowMatrix<Scalar>::Constant(s.N, s.d, Scalar(7));
  FusedHeadLossOptions options;
  options.error_if_nonfinite = true;
  VocabParallelFusedHeadLoss<Scalar> loss(options);
  // A NaN in the last rank's rows of W: row 50 of the whole head.
  const RowMatrix<Scalar> W_before = s.W_shard->value();
  if (last) s.W_shard->value()(50 - s.shard.begin, 1) = std::numeric_limits<Scalar>::quiet_NaN();
  std::string message = agreed_error<embedhead::value_error>(
      [&] { loss.forward_backward_shard(comm, 53, *s.W_shard, s.b_shard.get(), s.h, s.targets, dh); });
  CHECK_THAT(message, Contains("VocabParallelFusedHeadLoss::forward_backward_shard: W nan at row 50, column 1, "
                               "outside the finite numbers (error_if_nonfinite)") &&
                          EndsWith(on_last_rank()));
  s.W_shard->value() = W_before;
  // h is replicated: every rank finds its -inf, and rank 0's message is everyone's.
  s.h(5, 2) = -std::numeric_limits<Scalar>::infinity();
  message = agreed_error<embedhead::value_error>(
      [&] { loss.forward_shard(comm, 53, *s.W_shard, s.b_shard.get(), s.h, s.targets); });
  CHECK_THAT(message,
             Contains("VocabParallelFusedHeadLoss::forward_shard: h -inf at n=5 (b=1, t=1), column 2") &&
                 EndsWith(R > 1 ? " [on rank 0 of " + std::to_string(R) + "]" : std::string("(error_if_nonfinite)")));
  s.h(5, 2) = 0;
  CHECK(s.W_shard->grad().num_touched() == 0);
  CHECK_FALSE(s.W_shard->grad().is_dense());
  CHECK(s.b_shard->grad().num_touched() == 0);
  CHECK(dh.isConstant(Scalar(7)));
  // Ranks that disagree on the option (on finite inputs).
  if (R > 1) {
    FusedHeadLossOptions mixed;
    mixed.error_if_nonfinite = last;
    VocabParallelFusedHeadLoss<Scalar> mixed_loss(mixed);
    message = agreed_error<embedhead::value_error>(
        [&] { mixed_loss.forward_backward_shard(comm, 53, *s.W_shard, s.b_shard.get(), s.h, s.targets, dh); });
    CHECK_THAT(message, Contains("loss options"));
    // Class weights that differ in one entry.
    FusedHeadLossOptions weighted;
    weighted.class_weights.assign(53, 1.0);
    if (last) weighted.class_weights[7] = 2.0;
    VocabParallelFusedHeadLoss<Scalar> weighted_loss(weighted);
    message = agreed_error<embedhead::value_error>(
        [&] { weighted_loss.forward_backward_shard(comm, 53, *s.W_shard, s.b_shard.get(), s.h, s.targets, dh); });
    CHECK_THAT(message, Contains("loss options"));
    CHECK(s.W_shard->grad().num_touched() == 0);
    CHECK(dh.isConstant(Scalar(7)));
  }
}

// ---- soft (probability) targets ----

namespace {

// Soft targets [N, C] for the setup: row n puts 1/2 on targets(n) (a class index in [0, C)), and
// 1/2 spread over the 3 classes after it (mod C), so every shard sees some of them; the same on
// every rank. And the same targets as sparse pairs [N, 4].
template <typename Scalar>
struct SoftSetup {
  RowMatrix<Scalar> dense;
  IdMatrix<std::int64_t> ids;
  RowMatrix<Scalar> probs;
};

template <typename Scalar>
SoftSetup<Scalar> soft_targets_for(const Setup<Scalar>& s, Index C) {
  SoftSetup<Scalar> t{RowMatrix<Scalar>::Zero(s.N, C), IdMatrix<std::int64_t>(s.N, 4), RowMatrix<Scalar>(s.N, 4)};
  const double share[4] = {0.5, 0.25, 0.125, 0.125};
  for (Index n = 0; n < s.N; ++n) {
    const Index y = static_cast<Index>(s.targets(n / s.targets.cols(), n % s.targets.cols())) % C;
    for (Index i = 0; i < 4; ++i) {
      const Index c = (y + 11 * i) % C;
      t.dense(n, c) += static_cast<Scalar>(share[i]);
      t.ids(n, i) = c;
      t.probs(n, i) = static_cast<Scalar>(share[i]);
    }
  }
  return t;
}

}  // namespace

TEMPLATE_TEST_CASE("vocabulary-parallel fused loss with soft targets equals fused_head_loss_soft on the whole head",
                   "[vocab_parallel_fused][soft]", float, double) {
  using Scalar = TestType;
  const bool one_rank = world().size() == 1;
  Setup<Scalar> s = make_setup<Scalar>(53, 13, 3, 7, 61, true);
  for (const Index C : {Index(53), Index(36)})  // 36: the third rank's shard wholly in the padding
    for (const Reduction reduction : {Reduction::mean, Reduction::sum, Reduction::none})
      for (const bool smoothing_weights : {false, true})
        for (const bool extras : {false, true})
          for (int plan : {0, 1})
            for (const bool sparse : {false, true}) {
              CAPTURE(C, static_cast<int>(reduction), smoothing_weights, extras, plan, sparse, world().rank(),
                      world().size());
              FusedHeadLossOptions options;
              options.valid_vocab = C;
              options.reduction = reduction;
              if (smoothing_weights) {
                options.label_smoothing = 0.1;
                options.class_weights = test_support::class_weights(C);
              }
              if (extras) {
                options.z_loss = 1e-3;
                options.softcap = 3.0;
                options.entropy_bonus = -0.2;
                options.gradient_scale = 0.5;
              }
              options.vocab_block = 7;
              options.plan = plan == 0 ? embedhead::FusedPlan::vocab_blocks : embedhead::FusedPlan::token_chunks;
              if (plan == 1)
                options.memory_budget = 2 * embedhead::vocab_shard(s.V, 0, world().size()).rows() *
                                        static_cast<Index>(sizeof(Scalar));
              const SoftSetup<Scalar> t = soft_targets_for(s, C);
              const embedhead::SparseTargets<Scalar> sparse_targets{t.ids, t.probs};
              RowMatrix<Scalar> weights = random_matrix<Scalar>(s.N, 1, 63, 1.0).cwiseAbs();
              // The whole head: fused_head_loss_soft_forward_backward, the same plan on one rank (bit
              // for bit), the default plan on more (a shard's budget may not hold a whole row).
              FusedHeadLossOptions reference = options;
              if (!one_rank) {
                reference.plan = embedhead::FusedPlan::automatic;
                reference.memory_budget = 0;
              }
              Outputs<Scalar> expected{{},
                                       RowMatrix<Scalar>(s.N, s.d),
                                       RowMatrix<Scalar>::Zero(s.V, s.d),
                                       RowMatrix<Scalar>::Zero(s.V, 1),
                                       RowMatrix<Scalar>(s.N, 1),
                                       RowMatrix<Scalar>(s.N, 1)};
              embedhead::FusedHeadLossWorkspace<Scalar> ws;
              expected.result = sparse ? embedhead::fused_head_loss_soft_forward_backward<Scalar>(
                                             s.h, s.full.weight().value(), s.full.bias()->value(), sparse_targets,
                                             expected.dh, expected.dW, expected.db, ws, reference,
                                             extras_of(weights, expected.lse, expected.losses))
                                       : embedhead::fused_head_loss_soft_forward_backward<Scalar>(
                                             s.h, s.full.weight().value(), s.full.bias()->value(), t.dense, expected.dh,
                                             expected.dW, expected.db, ws, reference,
                                             extras_of(weights, expected.lse, expected.losses));
              expected.dW = RowMatrix<Scalar>(expected.dW.middleRows(s.shard.begin, s.shard.rows()));
              expected.db = RowMatrix<Scalar>(expected.db.middleRows(s.shard.begin, s.shard.rows()));

              Outputs<Scalar> actual{{}, RowMatrix<Scalar>(s.N, s.d), {},
                                     {}, RowMatrix<Scalar>(s.N, 1),   RowMatrix<Scalar>(s.N, 1)};
              s.W_shard->zero_grad();
              s.b_shard->zero_grad();
              VocabParallelFusedHeadLoss<Scalar> loss(options);
              actual.result = sparse ? loss.forward_backward_shard_soft(world(), s.V, *s.W_shard, s.b_shard.get(), s.h,
                                                                        sparse_targets, actual.dh,
                                                                        extras_of(weights, actual.lse, actual.losses))
                                     : loss.forward_backward_shard_soft(world(), s.V, *s.W_shard, s.b_shard.get(), s.h,
                                                                        t.dense, actual.dh,
                                                                        extras_of(weights, actual.lse, actual.losses));
              actual.dW = s.W_shard->grad().to_dense();
              actual.db = s.b_shard->grad().to_dense();
              CHECK(actual.result.count == s.N);
              check_matches(actual, expected, one_rank);
              CHECK(replicated(actual));
              // The loss alone: the same numbers, bit for bit.
              RowMatrix<Scalar> lse(s.N, 1), losses(s.N, 1);
              const CrossEntropyResult r = sparse
                                               ? loss.forward_shard_soft(world(), s.V, *s.W_shard, s.b_shard.get(), s.h,
                                                                         sparse_targets,
                                                                         extras_of(weights, lse, losses))
                                               : loss.forward_shard_soft(world(), s.V, *s.W_shard, s.b_shard.get(), s.h,
                                                                         t.dense, extras_of(weights, lse, losses));
              CHECK(r.loss == actual.result.loss);
              CHECK(same_values(losses, actual.losses));
            }
}

TEST_CASE("vocabulary-parallel fused loss with soft targets: errors agreed on every rank, nothing changed",
          "[vocab_parallel_fused][soft][errors]") {
  using Scalar = float;
  Communicator& comm = world();
  const int R = comm.size();
  const bool last = comm.rank() == R - 1;
  Setup<Scalar> s = make_setup<Scalar>(53, 6, 2, 4, 71, true);
  const SoftSetup<Scalar> t = soft_targets_for(s, 53);
  s.W_shard->grad().dense_accumulator().setConstant(Scalar(1.5));
  RowMatrix<Scalar> dh = RowMatrix<Scalar>::Constant(s.N, s.d, Scalar(7));
  RowMatrix<Scalar> lse = RowMatrix<Scalar>::Constant(s.N, 1, Scalar(8)),
                    losses = RowMatrix<Scalar>::Constant(s.N, 1, Scalar(9));
  const RowMatrix<Scalar> no_weights(0, 1);
  VocabParallelFusedHeadLoss<Scalar> loss;
  const std::string fb = "VocabParallelFusedHeadLoss::forward_backward_shard_soft";
  auto unchanged = [&] {
    CHECK((dh.array() == Scalar(7)).all());
    CHECK((lse.array() == Scalar(8)).all());
    CHECK((losses.array() == Scalar(9)).all());
    CHECK((s.W_shard->grad().to_dense().array() == Scalar(1.5)).all());
    CHECK(s.b_shard->grad().to_dense().cwiseAbs().sum() == 0);
  };
  auto dense_call = [&](const RowMatrix<Scalar>& targets) {
    return [&] {
      loss.forward_backward_shard_soft(comm, 53, *s.W_shard, s.b_shard.get(), s.h, targets, dh,
                                       extras_of(no_weights, lse, losses));
    };
  };
  SECTION("a row that does not sum to 1 on the last rank") {
    RowMatrix<Scalar> targets = t.dense;
    if (last) targets(1, 0) += Scalar(0.5);
    const std::string message = agreed_error<embedhead::value_error>(dense_call(targets));
    CHECK_THAT(message, Contains(fb) && Contains("targets of row n=1 sum to 1.5") && EndsWith(on_last_rank()));
    unchanged();
  }
  SECTION("a sparse id out of range") {
    IdMatrix<std::int64_t> ids = t.ids;
    ids(2, 3) = 60;
    const std::string message = agreed_error<embedhead::index_error>([&] {
      loss.forward_backward_shard_soft(comm, 53, *s.W_shard, s.b_shard.get(), s.h,
                                       embedhead::SparseTargets<Scalar>{ids, t.probs}, dh,
                                       extras_of(no_weights, lse, losses));
    });
    CHECK_THAT(message, Contains(fb) && Contains("targets.ids(2, 3) = 60 outside [0, 53)"));
    unchanged();
  }
  SECTION("valid soft targets that differ across ranks") {
    RowMatrix<Scalar> targets = t.dense;
    if (last && R > 1) {  // still a distribution on every rank, but not the same one
      const Index c = (targets(0, 0) > 0) ? 1 : 0;
      targets(0, c) += Scalar(0.125);
      Index other = 0;
      while (!(targets(0, other) >= Scalar(0.125)) || other == c) ++other;
      targets(0, other) -= Scalar(0.125);
    }
    if (R > 1) {
      const std::string message = agreed_error<embedhead::value_error>(dense_call(targets));
      CHECK_THAT(message, Contains(fb) && Contains("disagree on the call (forward or forward_backward), targets"));
      unchanged();
    }
  }
}
