// Tests for include/embedhead/vocab_parallel.hpp: the vocabulary-parallel embedding, head and
// cross-entropy against the single-process layers (TokenEmbedding, OutputProjection,
// cross_entropy_forward_backward, LearnedPositionEmbedding, Dropout) built from the same seeds on
// every rank. Built single-process and under mpirun with 1, 2 and 3 ranks (tests/parallel/world.hpp);
// V = 53 and 7 divide by neither 2 nor 3, so the shards are uneven. Every rank runs every test
// case and the same collectives in the same order: CHECK, not REQUIRE, wherever a collective follows.
#include <embedhead/embedhead.hpp>

#include "../reference/test_support.hpp"
#include "world.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <vector>

using namespace embedhead;
using test_support::close;
using test_support::first_difference;
using test_support::random_ids;
using test_support::random_matrix;
using test_support::same_values;
using test_support::gather_strings;
using test_support::world;

namespace {

constexpr Index kV = 53;  // 53 = 27 + 26 = 18 + 18 + 17

// True when x is the same double on every rank (two all-reduces).
bool same_on_every_rank(Communicator& comm, double x) {
  double hi = x, neg_lo = -x;
  comm.all_reduce_max(&hi, 1);
  comm.all_reduce_max(&neg_lo, 1);
  return hi == x && -neg_lo == x;
}

// What message the lowest failing rank's error carries on every rank.
std::string on_rank(const std::string& message, int failed, int R) {
  return R == 1 ? message : message + " [on rank " + std::to_string(failed) + " of " + std::to_string(R) + "]";
}

// Runs f, returns the message of the exception of type E it throws ("" if none, "other" for
// another type). Never leaves the test case, so every rank reaches the next collective.
template <typename E, typename F>
std::string thrown_message(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (...) {
    return "other";
  }
  return "";
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

template <typename Scalar>
double loss_tolerance() {
  return std::is_same_v<Scalar, float> ? 1e-5 : 1e-12;
}

bool close_scalar(double a, double b, double tol) { return std::abs(a - b) <= tol * std::max(1.0, std::abs(b)); }

}  // namespace

// ---------------------------------------------------------------------------------------------
// The embedding
// ---------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("VocabParallelEmbedding: the shard is the single-process table's rows, bit for bit",
                   "[vocab_parallel]", float, double) {
  using S = TestType;
  Communicator& comm = world();
  const int R = comm.size(), me = comm.rank();
  const VocabShard shard = vocab_shard(kV, me, R);
  for (const bool padding : {false, true}) {
    TokenEmbeddingOptions options;
    options.seed = 11;
    options.init_std = 0.5;
    if (padding) options.padding_idx = kV - 2;  // owned by the last rank
    const TokenEmbedding<S> full(kV, 7, options);
    const VocabParallelEmbedding<S> vp(kV, 7, comm, options);
    CHECK(vp.vocab_size() == kV);
    CHECK(vp.dim() == 7);
    CHECK(vp.shard().begin == shard.begin);
    CHECK(vp.shard().end == shard.end);
    CHECK(&vp.communicator() == &comm);
    CHECK(vp.weight().rows() == shard.rows());
    CHECK(first_difference(vp.weight().value(), full.weight().value().middleRows(shard.begin, shard.rows())) == "");
    if (padding && shard.owns(kV - 2)) CHECK(vp.weight().value().row(kV - 2 - shard.begin).isZero(0));
  }
}

TEMPLATE_TEST_CASE("VocabParallelEmbedding::forward equals TokenEmbedding::forward exactly", "[vocab_parallel]", float,
                   double) {
  using S = TestType;
  Communicator& comm = world();
  for (const bool scaled : {false, true}) {
    TokenEmbeddingOptions options;
    options.seed = 3;
    options.scale_by_sqrt_d = scaled;
    options.padding_idx = 4;
    const TokenEmbedding<S> full(kV, 6, options);
    const VocabParallelEmbedding<S> vp(kV, 6, comm, options);
    CHECK(vp.scale() == full.scale());
    IdMatrix<std::int32_t> ids = random_ids<std::int32_t>(3, 5, kV, 21);
    ids(0, 0) = 0, ids(0, 1) = kV - 1, ids(1, 2) = 4, ids(2, 4) = ids(1, 1);  // both ends, padding, a repeat
    const RowMatrix<S> expected = full.forward(ids);
    CHECK(first_difference(vp.forward(ids), expected) == "");
    const IdMatrix<std::int64_t> ids64 = ids.cast<std::int64_t>();
    RowMatrix<S> out(15, 6);
    vp.forward(ids64, out);
    CHECK(first_difference(out, expected) == "");
    // Into a column block of a wider matrix (rows not contiguous): the same values.
    RowMatrix<S> wide = RowMatrix<S>::Constant(15, 9, S(7));
    vp.forward(ids, wide.middleCols(1, 6));
    CHECK(first_difference(wide.middleCols(1, 6), expected) == "");
    CHECK(wide.col(0).isConstant(S(7)));
    CHECK(wide.rightCols(2).isConstant(S(7)));
  }
  // No tokens: nothing to do, no error.
  const VocabParallelEmbedding<S> vp(kV, 6, comm);
  CHECK(vp.forward(IdMatrix<std::int32_t>(0, 4)).rows() == 0);
}

TEMPLATE_TEST_CASE("VocabParallelEmbedding::backward: the shard's rows of TokenEmbedding's dE, owned rows only",
                   "[vocab_parallel]", float, double) {
  using S = TestType;
  Communicator& comm = world();
  const VocabShard shard = vocab_shard(kV, comm.rank(), comm.size());
  for (const bool scaled : {false, true}) {
    TokenEmbeddingOptions options;
    options.seed = 5;
    options.scale_by_sqrt_d = scaled;
    options.padding_idx = kV - 1;
    TokenEmbedding<S> full(kV, 5, options);
    VocabParallelEmbedding<S> vp(kV, 5, comm, options);
    IdMatrix<std::int32_t> ids = random_ids<std::int32_t>(4, 6, kV, 31);
    ids(0, 0) = kV - 1, ids(3, 5) = 0, ids(2, 2) = ids(1, 1) = ids(0, 3) = 26;  // padding, ends, repeats
    const RowMatrix<S> dout = random_matrix<S>(24, 5, 32);
    const RowMatrix<S> dout2 = random_matrix<S>(24, 5, 33);
    const IdMatrix<std::int64_t> ids2 = random_ids<std::int64_t>(4, 6, kV, 34);
    full.backward(ids, dout);
    full.backward(ids2, dout2);  // accumulates, merging new rows
    vp.backward(ids, dout);
    vp.backward(ids2, dout2);
    const RowMatrix<S> dE = full.weight().grad().to_dense();
    CHECK_FALSE(vp.weight().grad().is_dense());
    CHECK(first_difference(vp.weight().grad().to_dense(), dE.middleRows(shard.begin, shard.rows())) == "");
    // Touched: the owned distinct ids of both batches, as local rows, padding excluded.
    std::set<Index> expected;
    for (Index i = 0; i < ids.size(); ++i) {
      const Index v = ids.data()[i];
      if (v != kV - 1 && shard.owns(v)) expected.insert(v - shard.begin);
    }
    for (Index i = 0; i < ids2.size(); ++i) {
      const Index v = static_cast<Index>(ids2.data()[i]);
      if (v != kV - 1 && shard.owns(v)) expected.insert(v - shard.begin);
    }
    CHECK(vp.weight().grad().touched_rows() == std::vector<Index>(expected.begin(), expected.end()));
    vp.zero_grad();
    CHECK(vp.weight().grad().num_touched() == 0);
  }
  // Frozen: checks only, no gradient.
  VocabParallelEmbedding<S> vp(kV, 5, comm);
  vp.set_frozen(true);
  CHECK(vp.frozen());
  vp.backward(random_ids<std::int32_t>(2, 3, kV, 1), random_matrix<S>(6, 5, 2));
  CHECK(vp.weight().grad().num_touched() == 0);
  CHECK_THROWS_AS(vp.backward(random_ids<std::int32_t>(2, 3, kV, 1), random_matrix<S>(5, 5, 2)), shape_error);
  vp.set_frozen(false);
  CHECK_FALSE(vp.frozen());
}

TEMPLATE_TEST_CASE("VocabParallelEmbedding: wrapping an existing shard", "[vocab_parallel]", float, double) {
  using S = TestType;
  Communicator& comm = world();
  const VocabShard shard = vocab_shard(kV, comm.rank(), comm.size());
  // The full table is random; every rank wraps its rows of it.
  const RowMatrix<S> table = random_matrix<S>(kV, 4, 41);
  auto weight = std::make_shared<Parameter<S>>(shard.rows(), 4, "E");
  weight->value() = table.middleRows(shard.begin, shard.rows());
  TokenEmbeddingOptions options;
  options.padding_idx = 0;  // not zeroed when wrapping
  VocabParallelEmbedding<S> vp(kV, weight, comm, options);
  CHECK(vp.weight_ptr() == weight);
  CHECK(first_difference(vp.weight().value(), table.middleRows(shard.begin, shard.rows())) == "");
  const IdMatrix<std::int32_t> ids = random_ids<std::int32_t>(2, 7, kV, 42);
  RowMatrix<S> expected(14, 4);
  for (Index n = 0; n < 14; ++n) expected.row(n) = table.row(ids.data()[n]);
  CHECK(first_difference(vp.forward(ids), expected) == "");
}

// ---------------------------------------------------------------------------------------------
// The head
// ---------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("VocabParallelOutputProjection: untied forward and backward against OutputProjection",
                   "[vocab_parallel]", float, double) {
  using S = TestType;
  Communicator& comm = world();
  const VocabShard shard = vocab_shard(kV, comm.rank(), comm.size());
  const double tol = test_support::tolerance<S>();
  for (const bool bias : {true, false}) {
    OutputProjectionOptions options;
    options.bias = bias;
    options.seed = 9;
    options.init_std = 0.3;
    OutputProjection<S> full(kV, 8, options);
    VocabParallelOutputProjection<S> vp(kV, 8, comm, options);
    CHECK(vp.vocab_size() == kV);
    CHECK(vp.dim() == 8);
    CHECK(vp.weight_ptr().use_count() == 1);  // its own W shard: tied to nothing
    CHECK(vp.has_bias() == bias);
    CHECK(vp.parameters().size() == (bias ? 2u : 1u));
    CHECK(first_difference(vp.weight().value(), full.weight().value().middleRows(shard.begin, shard.rows())) == "");
    if (bias) {
      CHECK(vp.bias()->value().isZero(0));
      CHECK(vp.bias()->rows() == shard.rows());
      // A non-zero bias, the same on both.
      const RowMatrix<S> b = random_matrix<S>(kV, 1, 50);
      full.bias()->value() = b;
      vp.bias()->value() = b.middleRows(shard.begin, shard.rows());
    }
    for (const Index N : {Index(3), Index(12)}) {  // the decode path and the GEMM path
      const RowMatrix<S> h = random_matrix<S>(N, 8, 51 + static_cast<std::uint64_t>(N));
      const RowMatrix<S> logits = full.forward(h);
      const RowMatrix<S> local = vp.forward(h);
      CHECK(close(local, logits.middleCols(shard.begin, shard.rows()), tol));
      // Backward: full dlogits, each rank its columns.
      const RowMatrix<S> dlogits = random_matrix<S>(N, kV, 60 + static_cast<std::uint64_t>(N));
      full.zero_grad();
      vp.zero_grad();
      const RowMatrix<S> dh = full.backward(h, dlogits);
      const RowMatrix<S> dlocal = dlogits.middleCols(shard.begin, shard.rows());
      RowMatrix<S> vp_dh(N, 8);
      vp.backward(h, dlocal, vp_dh);
      CHECK(close(vp_dh, dh, tol));
      CHECK(same_on_every_rank(comm, static_cast<double>(vp_dh.sum())));
      CHECK(vp.weight().grad().is_dense());
      CHECK(close(vp.weight().grad().to_dense(), full.weight().grad().to_dense().middleRows(shard.begin, shard.rows()),
                  tol));
      if (bias)
        CHECK(close(vp.bias()->grad().to_dense(), full.bias()->grad().to_dense().middleRows(shard.begin, shard.rows()),
                    tol));
      // The returning overload, and dh written over h itself.
      RowMatrix<S> h_inout = h;
      vp.backward(h_inout, dlocal, h_inout);
      CHECK(close(h_inout, dh, tol));
      CHECK(close(vp.backward(h, dlocal), dh, tol));
    }
  }
  // Frozen W: dh still computed, no gradient.
  VocabParallelOutputProjection<S> vp(kV, 8, comm);
  vp.weight().set_frozen(true);
  const RowMatrix<S> dh = vp.backward(random_matrix<S>(4, 8, 70), RowMatrix<S>::Ones(4, shard.rows()));
  CHECK(dh.allFinite());
  CHECK(vp.weight().grad().num_touched() == 0);
  CHECK_FALSE(vp.weight().grad().is_dense());
  CHECK(vp.bias()->grad().is_dense());
}

TEMPLATE_TEST_CASE("VocabParallelOutputProjection: tied to the embedding's shard, and wrapping shards",
                   "[vocab_parallel]", float, double) {
  using S = TestType;
  Communicator& comm = world();
  const VocabShard shard = vocab_shard(kV, comm.rank(), comm.size());
  VocabParallelEmbedding<S> embedding(kV, 6, comm);
  VocabParallelOutputProjection<S> head(embedding);
  CHECK(head.is_tied_to(embedding));
  CHECK_FALSE(head.has_bias());
  CHECK(head.bias() == nullptr);
  CHECK(head.weight_ptr() == embedding.weight_ptr());
  CHECK(head.vocab_size() == kV);
  CHECK(head.shard().begin == shard.begin);
  CHECK(&head.communicator() == &comm);
  REQUIRE(head.parameters().size() == 1);
  CHECK(head.parameters()[0] == embedding.weight_ptr());

  auto W = std::make_shared<Parameter<S>>(shard.rows(), 3, "W");
  auto b = std::make_shared<Parameter<S>>(shard.rows(), 1, "b");
  VocabParallelOutputProjection<S> wrapped(kV, W, b, comm);
  CHECK(wrapped.bias() == b.get());
  CHECK(&wrapped.weight() == W.get());
  VocabParallelOutputProjection<S> no_bias(kV, W, nullptr, comm);
  CHECK_FALSE(no_bias.has_bias());
}

// ---------------------------------------------------------------------------------------------
// The loss
// ---------------------------------------------------------------------------------------------

namespace {

struct LossCase {
  std::string name;
  CrossEntropyOptions options;
};

std::vector<LossCase> loss_cases() {
  std::vector<LossCase> cases;
  auto add = [&](const std::string& name, auto set) {
    CrossEntropyOptions o;
    o.ignore_index = -1;
    set(o);
    cases.push_back({name, o});
  };
  add("default", [](CrossEntropyOptions&) {});
  add("sum", [](CrossEntropyOptions& o) { o.reduction = Reduction::sum; });
  add("none", [](CrossEntropyOptions& o) { o.reduction = Reduction::none; });
  add("label smoothing", [](CrossEntropyOptions& o) { o.label_smoothing = 0.1; });
  add("z-loss", [](CrossEntropyOptions& o) { o.z_loss = 1e-2; });
  add("softcap", [](CrossEntropyOptions& o) { o.softcap = 2.5; });
  // 36 classes: on 3 ranks the last shard [36, 53) is all padding, on 2 ranks half of [27, 53).
  add("valid_vocab", [](CrossEntropyOptions& o) { o.valid_vocab = 36; });
  add("gradient_scale", [](CrossEntropyOptions& o) { o.gradient_scale = 0.25; });
  add("entropy bonus", [](CrossEntropyOptions& o) { o.entropy_bonus = 0.3; });
  add("class weights", [](CrossEntropyOptions& o) { o.class_weights = test_support::class_weights(kV); });
  add("class weights, label smoothing, valid_vocab", [](CrossEntropyOptions& o) {
    o.valid_vocab = 36;
    o.label_smoothing = 0.1;
    o.class_weights = test_support::class_weights(36);
  });
  add("everything", [](CrossEntropyOptions& o) {
    o.entropy_bonus = -0.2;
    o.reduction = Reduction::sum;
    o.label_smoothing = 0.2;
    o.z_loss = 1e-3;
    o.softcap = 3.0;
    o.valid_vocab = 36;
    o.gradient_scale = 2.0;
  });
  return cases;
}

}  // namespace

TEMPLATE_TEST_CASE("vocab_parallel_cross_entropy: the loss and dlogits columns of cross_entropy on the full logits",
                   "[vocab_parallel]", float, double) {
  using S = TestType;
  Communicator& comm = world();
  const int R = comm.size();
  const VocabShard shard = vocab_shard(kV, comm.rank(), R);
  const double tol = test_support::tolerance<S>(), ltol = loss_tolerance<S>();
  const Index N = 10;
  const RowMatrix<S> logits = random_matrix<S>(N, kV, 80, 4.0);
  const RowMatrix<S> local = logits.middleCols(shard.begin, shard.rows());
  for (const LossCase& c : loss_cases()) {
    INFO(c.name);
    IdMatrix<std::int32_t> targets = random_ids<std::int32_t>(2, 5,
                                                              c.options.valid_vocab == -1 ? kV : c.options.valid_vocab,
                                                              81);
    targets(0, 1) = -1, targets(1, 3) = -1;  // ignored rows
    targets(1, 0) = 0;
    targets(1, 4) = static_cast<std::int32_t>((c.options.valid_vocab == -1 ? kV : c.options.valid_vocab) - 1);
    RowMatrix<S> dlogits(N, kV);
    const CrossEntropyResult expected = cross_entropy_forward_backward<S>(logits, targets, dlogits, c.options);
    RowMatrix<S> dlocal = RowMatrix<S>::Constant(N, shard.rows(), S(9));
    const CrossEntropyResult got = vocab_parallel_cross_entropy_forward_backward<S>(comm, kV, local, targets, dlocal,
                                                                                    c.options);
    CHECK(got.count == expected.count);
    CHECK(got.count == 8);
    CHECK(got.weight_sum == expected.weight_sum);
    CHECK(close_scalar(got.loss, expected.loss, ltol));
    CHECK(close_scalar(got.sum, expected.sum, ltol));
    CHECK(close_scalar(got.z_loss, expected.z_loss, ltol));
    CHECK((c.options.z_loss > 0) == (got.z_loss > 0));
    CHECK(close(dlocal, dlogits.middleCols(shard.begin, shard.rows()), tol));
    // Replicated: bit-identical on every rank.
    CHECK(same_on_every_rank(comm, got.loss));
    CHECK(same_on_every_rank(comm, got.z_loss));
    // The loss alone, int64 targets, in place (dlocal over the logits): the same results.
    const IdMatrix<std::int64_t> targets64 = targets.cast<std::int64_t>();
    const CrossEntropyResult alone = vocab_parallel_cross_entropy<S>(comm, kV, local, targets64, c.options);
    CHECK(alone.loss == got.loss);
    CHECK(alone.sum == got.sum);
    RowMatrix<S> inplace = local;
    const CrossEntropyResult in = vocab_parallel_cross_entropy_forward_backward<S>(comm, kV, inplace, targets64,
                                                                                   inplace, c.options);
    CHECK(in.loss == got.loss);
    CHECK(first_difference(inplace, dlocal) == "");
    if (R == 1) {  // one rank: softmax_loss_row's arithmetic, operation for operation
      CHECK(got.loss == expected.loss);
      CHECK(first_difference(dlocal, dlogits) == "");
    }
  }
  // Every target ignored: loss 0, dlocal 0, count 0.
  CrossEntropyOptions options;
  const IdMatrix<std::int32_t> ignored = IdMatrix<std::int32_t>::Constant(2, 5, -100);
  RowMatrix<S> dlocal = RowMatrix<S>::Constant(N, shard.rows(), S(1));
  const CrossEntropyResult none = vocab_parallel_cross_entropy_forward_backward<S>(comm, kV, local, ignored, dlocal,
                                                                                   options);
  CHECK(none.loss == 0);
  CHECK(none.count == 0);
  CHECK(dlocal.isZero(0));
}

TEMPLATE_TEST_CASE("vocab_parallel_cross_entropy: non-finite logits give cross_entropy's results on the full logits",
                   "[vocab_parallel][nonfinite]", float, double) {
  // docs/errors.md, "Non-finite values": the same cases as cross_entropy_test.cpp's, with masks
  // covering whole shards (rank 0's columns [0, 27) on 2 ranks, [0, 18) on 3).
  using S = TestType;
  Communicator& comm = world();
  const VocabShard shard = vocab_shard(kV, comm.rank(), comm.size());
  const S inf = std::numeric_limits<S>::infinity(), nan = std::numeric_limits<S>::quiet_NaN();
  const Index N = 7;
  RowMatrix<S> logits = random_matrix<S>(N, kV, 90, 4.0);
  IdMatrix<std::int32_t> targets(1, N);
  targets << 3, 3, 3, 30, 3, 3, -100;
  logits(1, 40) = nan;                       // 1: NaN (on the last rank's shard)
  logits(2, 5) = inf;                        // 2: +inf
  logits.row(3).head(27).setConstant(-inf);  // 3: rank 0's shard masked (target 30 is not)
  logits.row(4).setConstant(-inf);           // 4: everything masked
  logits(5, 3) = -inf;                       // 5: the target masked
  logits(6, 0) = nan;                        // 6: ignored
  const RowMatrix<S> local = logits.middleCols(shard.begin, shard.rows());
  RowMatrix<S> dlogits(N, kV), dlocal(N, shard.rows());
  const CrossEntropyResult expected = cross_entropy_forward_backward<S>(logits, targets, dlogits);
  const CrossEntropyResult got = vocab_parallel_cross_entropy_forward_backward<S>(comm, kV, local, targets, dlocal);
  CHECK(std::isnan(expected.loss));
  CHECK(std::isnan(got.loss));
  CHECK(got.count == expected.count);
  const RowMatrix<S> expected_local = dlogits.middleCols(shard.begin, shard.rows());
  // NaN exactly where the plain loss has NaN: the whole rows 1, 2 and 4; the rest to rounding
  // (bit for bit on one rank).
  CHECK((dlocal.array().isNaN() == expected_local.array().isNaN()).all());
  for (const Index n : {1, 2, 4}) CHECK(dlocal.row(n).array().isNaN().all());
  for (const Index n : {0, 3, 5, 6}) {
    CAPTURE(n);
    CHECK(close(RowMatrix<S>(dlocal.row(n)), RowMatrix<S>(expected_local.row(n)), test_support::tolerance<S>()));
  }
  if (comm.size() == 1) CHECK(test_support::first_difference_nan(dlocal, expected_local) == "");
  CHECK(dlocal.row(3).head(std::max<Index>(0, std::min<Index>(27 - shard.begin, shard.rows()))).isZero(0));
  // The rows with a defined loss alone: row 3 finite, row 5 +inf (-log 0).
  IdMatrix<std::int32_t> defined = targets;
  defined(0, 1) = defined(0, 2) = defined(0, 4) = defined(0, 5) = -100;
  const CrossEntropyResult finite_expected = cross_entropy<S>(logits, defined);
  const CrossEntropyResult finite_got = vocab_parallel_cross_entropy<S>(comm, kV, local, defined);
  CHECK(std::isfinite(finite_got.loss));
  CHECK(close_scalar(finite_got.loss, finite_expected.loss, loss_tolerance<S>()));
  defined(0, 5) = 3;
  CHECK(vocab_parallel_cross_entropy<S>(comm, kV, local, defined).loss == std::numeric_limits<double>::infinity());
}

TEST_CASE("vocab_parallel_cross_entropy with error_if_nonfinite: agreed across ranks, nothing written",
          "[vocab_parallel][nonfinite]") {
  Communicator& comm = world();
  const int R = comm.size(), me = comm.rank(), last = R - 1;
  const VocabShard shard = vocab_shard(kV, me, R);
  RowMatrix<float> logits = random_matrix<float>(4, kV, 91);
  logits(2, 50) = std::numeric_limits<float>::quiet_NaN();  // on the last rank's columns
  logits(3, 1) = -std::numeric_limits<float>::infinity();   // on rank 0's, in a later row
  const RowMatrix<float> local = logits.middleCols(shard.begin, shard.rows());
  RowMatrix<float> dlocal = RowMatrix<float>::Constant(4, shard.rows(), 2.0f);
  IdMatrix<std::int32_t> targets(1, 4);
  targets << 1, 2, 3, 4;
  CrossEntropyOptions o;
  o.error_if_nonfinite = true;
  // Each rank checks its own columns; the lowest failing rank's message is everyone's: on one rank
  // the first in row-major order (the NaN), on more rank 0's (the -inf).
  std::string message = thrown_message<value_error>(
      [&] { vocab_parallel_cross_entropy_forward_backward<float>(comm, kV, local, targets, dlocal, o); });
  const std::string first = R == 1 ? "logit nan at n=2 (b=0, t=2), column 50"
                                   : "logit -inf at n=3 (b=0, t=3), column 1";
  CHECK_THAT(message, Catch::Contains("vocab_parallel_cross_entropy_forward_backward: " + first +
                                      ", outside the finite numbers (error_if_nonfinite)"));
  CHECK(ends_with(message, on_rank("", 0, R)));
  for (const std::string& m : gather_strings(comm, message)) CHECK(m == message);
  CHECK(dlocal.isConstant(2.0f));
  // Without the -inf, the NaN on the last rank alone.
  RowMatrix<float> local2 = local;
  if (shard.begin <= 1 && 1 < shard.end) local2(3, 1 - shard.begin) = 0;
  message = thrown_message<value_error>([&] { vocab_parallel_cross_entropy<float>(comm, kV, local2, targets, o); });
  CHECK(message == on_rank("vocab_parallel_cross_entropy: logit nan at n=2 (b=0, t=2), column 50, outside the finite "
                           "numbers (error_if_nonfinite)",
                           last, R));
  // Ranks that disagree on the option (on finite logits).
  if (R > 1) {
    CrossEntropyOptions mixed;
    mixed.error_if_nonfinite = me == last;
    const RowMatrix<float> clean = random_matrix<float>(4, shard.rows(), 92);
    message = thrown_message<value_error>(
        [&] { vocab_parallel_cross_entropy<float>(comm, kV, clean, targets, mixed); });
    CHECK_THAT(message, Catch::Contains("disagree on the targets, N, V or the loss options"));
    // Class weights that differ in one entry, or an entropy bonus on one rank only.
    CrossEntropyOptions weighted;
    weighted.class_weights.assign(static_cast<std::size_t>(kV), 1.0);
    if (me == last) weighted.class_weights[7] = 2.0;
    message = thrown_message<value_error>(
        [&] { vocab_parallel_cross_entropy<float>(comm, kV, clean, targets, weighted); });
    CHECK_THAT(message, Catch::Contains("disagree on the targets, N, V or the loss options"));
    CrossEntropyOptions bonus;
    bonus.entropy_bonus = me == last ? 0.1 : 0.0;
    message = thrown_message<value_error>(
        [&] { vocab_parallel_cross_entropy<float>(comm, kV, clean, targets, bonus); });
    CHECK_THAT(message, Catch::Contains("disagree on the targets, N, V or the loss options"));
  }
  CHECK(dlocal.isConstant(2.0f));
}

TEST_CASE("vocab_parallel_cross_entropy: central differences in double on every rank's columns", "[vocab_parallel]") {
  Communicator& comm = world();
  const Index V = 7, N = 3;
  const VocabShard shard = vocab_shard(V, comm.rank(), comm.size());
  for (const LossCase& c : loss_cases()) {
    CrossEntropyOptions options = c.options;
    if (options.valid_vocab != -1) options.valid_vocab = 5;  // 7 = 3 + 2 + 2: shard [5, 7) all padding on 3 ranks
    if (!options.class_weights.empty())
      options.class_weights = test_support::class_weights(options.valid_vocab == -1 ? V : options.valid_vocab);
    INFO(c.name);
    RowMatrix<double> logits = random_matrix<double>(N, V, 90, 2.0);
    IdMatrix<std::int32_t> targets(1, 3);
    targets << 4, -1, 1;
    RowMatrix<double> dlocal(N, shard.rows());
    const RowMatrix<double> local = logits.middleCols(shard.begin, shard.rows());
    vocab_parallel_cross_entropy_forward_backward<double>(comm, V, local, targets, dlocal, options);
    // The finite differences read loss (the reduced scalar); d loss / d z is the gradient up to
    // gradient_scale, which multiplies the gradient only.
    const double h = 1e-6;
    double worst = 0;
    for (Index n = 0; n < N; ++n)
      for (Index j = 0; j < V; ++j) {  // every rank perturbs every column: the same collectives
        const double saved = logits(n, j);
        logits(n, j) = saved + h;
        const double up = vocab_parallel_cross_entropy<double>(comm, V, logits.middleCols(shard.begin, shard.rows()),
                                                               targets, options)
                              .loss;
        logits(n, j) = saved - h;
        const double down = vocab_parallel_cross_entropy<double>(comm, V, logits.middleCols(shard.begin, shard.rows()),
                                                                 targets, options)
                                .loss;
        logits(n, j) = saved;
        if (!shard.owns(j)) continue;
        const double numeric = options.gradient_scale * (up - down) / (2 * h);
        const double analytic = dlocal(n, j - shard.begin);
        const double error = std::abs(analytic - numeric) / std::max({std::abs(analytic), std::abs(numeric), 1e-3});
        worst = std::max(worst, error);
      }
    CHECK(worst < 1e-5);
  }
}

// ---------------------------------------------------------------------------------------------
// The whole chain
// ---------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE(
    "vocabulary-parallel chain (unfused and fused loss) equals the single-process chain, tied and untied",
    "[vocab_parallel]", float, double) {
  using S = TestType;
  Communicator& comm = world();
  const VocabShard shard = vocab_shard(kV, comm.rank(), comm.size());
  const Index B = 2, T = 5, d = 8, T_max = 6, N = B * T;
  const double tol = test_support::tolerance<S>() * 10, ltol = loss_tolerance<S>();
  for (const bool tied : {true, false}) {
    INFO((tied ? "tied" : "untied"));
    TokenEmbeddingOptions eopt;
    eopt.seed = 1;
    eopt.init_std = 0.5;
    eopt.scale_by_sqrt_d = tied;
    eopt.padding_idx = 2;
    OutputProjectionOptions hopt;
    hopt.seed = 4;
    hopt.init_std = 0.5;
    LearnedPositionOptions popt;
    popt.init_std = 0.3;
    CrossEntropyOptions lopt;
    lopt.label_smoothing = 0.05;
    lopt.z_loss = 1e-3;

    IdMatrix<std::int32_t> ids = random_ids<std::int32_t>(B, T, kV, 100);
    ids(0, 0) = 2, ids(1, 1) = ids(0, 3);
    IdMatrix<std::int32_t> targets = random_ids<std::int32_t>(B, T, kV, 101);
    targets(0, 2) = -100, targets(1, 4) = -100;

    // Single process.
    TokenEmbedding<S> E(kV, d, eopt);
    LearnedPositionEmbedding<S> P(T_max, d, popt);
    Dropout<S> drop(0.25, 77);
    OutputProjection<S> head = tied ? OutputProjection<S>(E) : OutputProjection<S>(kV, d, hopt);
    if (!tied) head.bias()->value() = random_matrix<S>(kV, 1, 102);
    const RowMatrix<S> x = P.forward(E.forward(ids), B, T);
    const RowMatrix<S> h = drop.forward(x);
    RowMatrix<S> logits = head.forward(h);
    const CrossEntropyResult loss = cross_entropy_forward_backward<S>(logits, targets, logits, lopt);
    const RowMatrix<S> dx = drop.backward(head.backward(h, logits));
    P.backward(dx, B, T);
    E.backward(ids, dx);

    // Vocabulary-parallel: the same seeds on every rank, so the dropout masks agree.
    VocabParallelEmbedding<S> vE(kV, d, comm, eopt);
    LearnedPositionEmbedding<S> vP(T_max, d, popt);
    Dropout<S> vdrop(0.25, 77);
    VocabParallelOutputProjection<S> vhead = tied ? VocabParallelOutputProjection<S>(vE)
                                                  : VocabParallelOutputProjection<S>(kV, d, comm, hopt);
    if (!tied) vhead.bias()->value() = random_matrix<S>(kV, 1, 102).middleRows(shard.begin, shard.rows());
    const RowMatrix<S> vx = vP.forward(vE.forward(ids), B, T);
    CHECK(first_difference(vx, x) == "");  // the lookup is exact, the rest identical code
    const RowMatrix<S> vh = vdrop.forward(vx);
    RowMatrix<S> local = vhead.forward(vh);
    const CrossEntropyResult vloss = vocab_parallel_cross_entropy_forward_backward<S>(comm, kV, local, targets, local,
                                                                                      lopt);
    const RowMatrix<S> vdh = vhead.backward(vh, local);
    const RowMatrix<S> vdx = vdrop.backward(vdh);
    vP.backward(vdx, B, T);
    vE.backward(ids, vdx);

    CHECK(vloss.count == N - 2);
    CHECK(close_scalar(vloss.loss, loss.loss, ltol));
    CHECK(same_on_every_rank(comm, vloss.loss));
    CHECK(close(vdx, dx, tol));
    CHECK(close(vP.weight().grad().to_dense(), P.weight().grad().to_dense(), tol));
    const RowMatrix<S> dE = E.weight().grad().to_dense();
    CHECK(close(vE.weight().grad().to_dense(), dE.middleRows(shard.begin, shard.rows()), tol));
    if (!tied) {
      const RowMatrix<S> dW = head.weight().grad().to_dense();
      CHECK(close(vhead.weight().grad().to_dense(), dW.middleRows(shard.begin, shard.rows()), tol));
      CHECK(close(vhead.bias()->grad().to_dense(), head.bias()->grad().to_dense().middleRows(shard.begin, shard.rows()),
                  tol));
    }

    // The same chain with the fused head and loss (VocabParallelFusedHeadLoss on the real head,
    // blocks of 4 rows so that every shard spans several): the same single-process references.
    VocabParallelEmbedding<S> fE(kV, d, comm, eopt);
    LearnedPositionEmbedding<S> fP(T_max, d, popt);
    Dropout<S> fdrop(0.25, 77);
    VocabParallelOutputProjection<S> fhead = tied ? VocabParallelOutputProjection<S>(fE)
                                                  : VocabParallelOutputProjection<S>(kV, d, comm, hopt);
    if (!tied) fhead.bias()->value() = random_matrix<S>(kV, 1, 102).middleRows(shard.begin, shard.rows());
    FusedHeadLossOptions fopt;
    static_cast<CrossEntropyOptions&>(fopt) = lopt;
    fopt.vocab_block = 4;
    VocabParallelFusedHeadLoss<S> floss(fopt);
    const RowMatrix<S> fh = fdrop.forward(fP.forward(fE.forward(ids), B, T));
    RowMatrix<S> fdh(N, d);
    const CrossEntropyResult fl = floss.forward_backward(fhead, fh, targets, fdh);
    const RowMatrix<S> fdx = fdrop.backward(fdh);
    fP.backward(fdx, B, T);
    fE.backward(ids, fdx);
    CHECK(fl.count == N - 2);
    CHECK(close_scalar(fl.loss, loss.loss, ltol));
    CHECK(same_on_every_rank(comm, fl.loss));
    CHECK(close(fdx, dx, tol));
    CHECK(close(fP.weight().grad().to_dense(), P.weight().grad().to_dense(), tol));
    CHECK(close(fE.weight().grad().to_dense(), dE.middleRows(shard.begin, shard.rows()), tol));
    if (!tied) {
      const RowMatrix<S> dW = head.weight().grad().to_dense();
      CHECK(close(fhead.weight().grad().to_dense(), dW.middleRows(shard.begin, shard.rows()), tol));
      CHECK(close(fhead.bias()->grad().to_dense(), head.bias()->grad().to_dense().middleRows(shard.begin, shard.rows()),
                  tol));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

TEST_CASE("VocabParallelEmbedding errors: every rank throws the last rank's error, nothing changed",
          "[vocab_parallel]") {
  Communicator& comm = world();
  const int R = comm.size(), me = comm.rank(), last = R - 1;
  VocabParallelEmbedding<float> vp(kV, 4, comm);
  const RowMatrix<float> before = vp.weight().value();
  IdMatrix<std::int32_t> ids = random_ids<std::int32_t>(2, 3, kV, 5);
  if (me == last) ids(1, 2) = kV;  // only the last rank is given the bad id
  RowMatrix<float> out = RowMatrix<float>::Constant(6, 4, 3.0f);
  const std::string message = thrown_message<index_error>([&] { vp.forward(ids, out); });
  const std::string expected = on_rank("VocabParallelEmbedding::forward: id 53 at (b=1, t=2) outside [0, 53)", last, R);
  CHECK(message == expected);
  if (R > 1) CHECK(ends_with(message, " [on rank " + std::to_string(last) + " of " + std::to_string(R) + "]"));
  for (const std::string& m : gather_strings(comm, message)) CHECK(m == expected);
  CHECK(out.isConstant(3.0f));

  // Ids that differ across ranks (each in range): value_error on every rank.
  IdMatrix<std::int32_t> mine = random_ids<std::int32_t>(2, 3, kV, 5);
  if (me == last && R > 1) mine(0, 0) = (mine(0, 0) + 1) % kV;
  const std::string differ = thrown_message<value_error>([&] { vp.forward(mine, out); });
  if (R > 1) {
    CHECK_THAT(differ, Catch::Contains("VocabParallelEmbedding::forward: ranks 0 and " + std::to_string(last)) &&
                           Catch::Contains("disagree on the token ids"));
    for (const std::string& m : gather_strings(comm, differ)) CHECK(m == differ);
  } else {
    CHECK(differ.empty());
  }
  CHECK((R == 1 || out.isConstant(3.0f)));

  // Wrong out shape on the last rank only: shape_error everywhere.
  RowMatrix<float> out_bad(me == last ? 5 : 6, 4);
  CHECK(thrown_message<shape_error>([&] { vp.forward(mine.cast<std::int32_t>(), out_bad); }) ==
        on_rank("VocabParallelEmbedding::forward: out has shape [5, 4], expected [6, 4]", last, R));

  // Backward: local checks (no collective), gradient unchanged.
  IdMatrix<std::int64_t> bad = random_ids<std::int64_t>(2, 3, kV, 6);
  bad(0, 1) = -1;
  CHECK_THROWS_WITH(vp.backward(bad, RowMatrix<float>::Ones(6, 4)),
                    "VocabParallelEmbedding::backward: id -1 at (b=0, t=1) outside [0, 53)");
  CHECK_THROWS_WITH(vp.backward(ids.cast<std::int64_t>().eval(), RowMatrix<float>::Ones(6, 5)),
                    "VocabParallelEmbedding::backward: dout has shape [6, 5], expected [6, 4]");
  CHECK(vp.weight().grad().num_touched() == 0);
  CHECK(first_difference(vp.weight().value(), before) == "");

  // Constructors (no collective).
  CHECK_THROWS_WITH(VocabParallelEmbedding<float>(kV, 0, comm), "VocabParallelEmbedding: d = 0 outside [1, inf)");
  TokenEmbeddingOptions o;
  o.init_std = 0;
  CHECK_THROWS_AS(VocabParallelEmbedding<float>(kV, 4, comm, o), value_error);
  o.init_std = 1e-50;  // 0 in float
  CHECK_THROWS_WITH(VocabParallelEmbedding<float>(kV, 4, comm, o),
                    Catch::Contains(
                        "VocabParallelEmbedding: init_std = 1e-50 outside (0, inf) in float: it rounds to 0"));
  OutputProjectionOptions head_options;
  head_options.init_std = 1e-50;
  CHECK_THROWS_WITH(VocabParallelOutputProjection<float>(kV, 4, comm, head_options),
                    Catch::Contains("VocabParallelOutputProjection: init_std = 1e-50 outside (0, inf) in float"));
  o = {};
  o.padding_idx = kV;
  CHECK_THROWS_WITH(VocabParallelEmbedding<float>(kV, 4, comm, o),
                    "VocabParallelEmbedding: padding_idx 53 outside [0, 53)");
  if (R > 1)
    CHECK_THROWS_WITH(VocabParallelEmbedding<float>(R - 1, 4, comm),
                      Catch::Contains("V = " + std::to_string(R - 1) + " rows over " + std::to_string(R) + " ranks"));
  else
    CHECK_THROWS_AS(VocabParallelEmbedding<float>(0, 4, comm), value_error);
  CHECK_THROWS_AS(VocabParallelEmbedding<float>(kV, std::shared_ptr<Parameter<float>>(), comm), value_error);
  const VocabShard shard = vocab_shard(kV, me, R);
  CHECK_THROWS_WITH(VocabParallelEmbedding<float>(kV, std::make_shared<Parameter<float>>(shard.rows() + 1, 4), comm),
                    Catch::Contains("VocabParallelEmbedding: shard_weight has shape [" +
                                    std::to_string(shard.rows() + 1) + ", 4], expected [" +
                                    std::to_string(shard.rows()) + ", 4]"));
}

TEST_CASE("VocabParallelOutputProjection errors: agreed across ranks, nothing changed", "[vocab_parallel]") {
  Communicator& comm = world();
  const int R = comm.size(), me = comm.rank(), last = R - 1;
  const VocabShard shard = vocab_shard(kV, me, R);
  VocabParallelOutputProjection<double> head(kV, 4, comm);
  const RowMatrix<double> h = random_matrix<double>(3, 4, 7);
  RowMatrix<double> dh = RowMatrix<double>::Constant(3, 4, 5.0);
  // The last rank's dlocal_logits has a column too many.
  const RowMatrix<double> dlocal = RowMatrix<double>::Ones(3, shard.rows() + (me == last ? 1 : 0));
  const std::string message = thrown_message<shape_error>([&] { head.backward(h, dlocal, dh); });
  const std::string expected = on_rank("VocabParallelOutputProjection::backward: dlocal_logits has shape [3, " +
                                           std::to_string(vocab_shard(kV, last, R).rows() + 1) + "], expected [3, " +
                                           std::to_string(vocab_shard(kV, last, R).rows()) + "]",
                                       last, R);
  CHECK(message == expected);
  for (const std::string& m : gather_strings(comm, message)) CHECK(m == expected);
  CHECK(dh.isConstant(5.0));
  CHECK_FALSE(head.weight().grad().is_dense());  // no dense accumulator was made
  CHECK(head.weight().grad().num_touched() == 0);
  CHECK(head.bias()->grad().num_touched() == 0);

  // N differing across ranks: value_error on every rank.
  if (R > 1) {
    const Index n = me == last ? 2 : 3;
    RowMatrix<double> dh2(n, 4);
    const std::string differ = thrown_message<value_error>(
        [&] { head.backward(random_matrix<double>(n, 4, 8), RowMatrix<double>::Ones(n, shard.rows()), dh2); });
    CHECK_THAT(differ, Catch::Contains("disagree on the shapes N, d and V"));
    for (const std::string& m : gather_strings(comm, differ)) CHECK(m == differ);
  }

  // Forward: local shape checks.
  RowMatrix<double> local(3, shard.rows() + 1);
  CHECK_THROWS_AS(head.forward(h, local), shape_error);
  CHECK_THROWS_WITH(head.forward(RowMatrix<double>::Ones(3, 5)),
                    "VocabParallelOutputProjection::forward: h has shape [3, 5], expected [3, 4]");

  // Constructors.
  CHECK_THROWS_AS(VocabParallelOutputProjection<double>(kV, 0, comm), value_error);
  CHECK_THROWS_AS(VocabParallelOutputProjection<double>(kV, nullptr, nullptr, comm), value_error);
  CHECK_THROWS_AS(VocabParallelOutputProjection<double>(kV, std::make_shared<Parameter<double>>(shard.rows() + 1, 4),
                                                        nullptr, comm),
                  shape_error);
  CHECK_THROWS_WITH(VocabParallelOutputProjection<double>(kV, std::make_shared<Parameter<double>>(shard.rows(), 4),
                                                          std::make_shared<Parameter<double>>(shard.rows(), 2), comm),
                    Catch::Contains("bias_shard has shape [" + std::to_string(shard.rows()) + ", 2]"));
}

TEST_CASE("vocabulary-parallel layers reject a shard resized under them, on every rank; nothing changed",
          "[vocab_parallel][errors]") {
  Communicator& comm = world();
  const int R = comm.size(), me = comm.rank(), last = R - 1;
  const VocabShard shard = vocab_shard(kV, me, R), last_shard = vocab_shard(kV, last, R);
  const std::string last_rows = std::to_string(last_shard.rows());
  const std::string of_last = " (rows [" + std::to_string(last_shard.begin) + ", 53) of V = 53 on rank " +
                              std::to_string(last) + " of " + std::to_string(R) + ")";
  IdMatrix<std::int32_t> ids(1, 2);
  ids << kV - 1, 0;  // the vocabulary's last row, which the last rank's shard no longer has

  SECTION("embedding: forward fails on every rank, backward on the last; nothing written") {
    VocabParallelEmbedding<float> embedding(kV, 4, comm);
    if (me == last) embedding.weight().resize_rows(shard.rows() - 5);  // Parameter::resize_rows, not the layer's
    const RowMatrix<float> before = embedding.weight().value();
    const std::string shape = "weight() is [" + std::to_string(last_shard.rows() - 5) + ", 4], expected [" + last_rows +
                              ", 4]" + of_last;
    RowMatrix<float> out = RowMatrix<float>::Constant(2, 4, 3.0f);
    const std::string message = thrown_message<shape_error>([&] { embedding.forward(ids, out); });
    const std::string expected = on_rank("VocabParallelEmbedding::forward: " + shape, last, R);
    CHECK(message == expected);
    for (const std::string& m : gather_strings(comm, message)) CHECK(m == expected);
    CHECK(out.isConstant(3.0f));
    if (me == last) {
      CHECK(thrown_message<shape_error>([&] { embedding.backward(ids, RowMatrix<float>::Ones(2, 4)); }) ==
            "VocabParallelEmbedding::backward: " + shape);
      CHECK(embedding.weight().grad().num_touched() == 0);
    }
    CHECK(first_difference(embedding.weight().value(), before) == "");
  }

  SECTION("head: backward fails on every rank before any gradient turns dense, forward on the last") {
    for (const bool bias : {false, true}) {
      INFO((bias ? "the bias shard resized" : "the weight shard resized"));
      VocabParallelOutputProjection<double> head(kV, 4, comm);
      Parameter<double>& resized = bias ? *head.bias() : head.weight();
      if (me == last) resized.resize_rows(shard.rows() + 2);
      const std::string cols = bias ? "1" : "4";
      const std::string shape = std::string(bias ? "bias()" : "weight()") + " is [" +
                                std::to_string(last_shard.rows() + 2) + ", " + cols + "], expected [" + last_rows +
                                ", " + cols + "]" + of_last;
      const RowMatrix<double> h = random_matrix<double>(3, 4, 9);
      RowMatrix<double> dh = RowMatrix<double>::Constant(3, 4, 5.0);
      const std::string message = thrown_message<shape_error>(
          [&] { head.backward(h, RowMatrix<double>::Ones(3, shard.rows()), dh); });
      const std::string expected = on_rank("VocabParallelOutputProjection::backward: " + shape, last, R);
      CHECK(message == expected);
      for (const std::string& m : gather_strings(comm, message)) CHECK(m == expected);
      CHECK(dh.isConstant(5.0));
      CHECK_FALSE(head.weight().grad().is_dense());
      CHECK_FALSE(head.bias()->grad().is_dense());
      CHECK(head.weight().grad().num_touched() == 0);
      if (me == last) {
        RowMatrix<double> local = RowMatrix<double>::Constant(3, shard.rows(), 5.0);
        CHECK(thrown_message<shape_error>([&] { head.forward(h, local); }) ==
              "VocabParallelOutputProjection::forward: " + shape);
        CHECK(local.isConstant(5.0));
      }
    }
  }
}

TEST_CASE("vocab_parallel_cross_entropy errors: agreed across ranks, nothing written", "[vocab_parallel]") {
  Communicator& comm = world();
  const int R = comm.size(), me = comm.rank(), last = R - 1;
  const VocabShard shard = vocab_shard(kV, me, R);
  const RowMatrix<float> local = random_matrix<float>(4, shard.rows(), 9);
  RowMatrix<float> dlocal = RowMatrix<float>::Constant(4, shard.rows(), 2.0f);
  IdMatrix<std::int32_t> targets(1, 4);
  targets << 1, 2, 3, 4;

  // Out of range on the last rank.
  IdMatrix<std::int32_t> bad = targets;
  if (me == last) bad(0, 2) = kV + 5;
  std::string message = thrown_message<index_error>(
      [&] { vocab_parallel_cross_entropy_forward_backward<float>(comm, kV, local, bad, dlocal); });
  std::string expected = on_rank(
      "vocab_parallel_cross_entropy_forward_backward: target 58 at n=2 (b=0, t=2) outside [0, 53) "
      "and not ignore_index (-100)",
      last, R);
  CHECK(message == expected);
  for (const std::string& m : gather_strings(comm, message)) CHECK(m == expected);
  CHECK(dlocal.isConstant(2.0f));

  // A padding column as target (valid_vocab), on every rank.
  CrossEntropyOptions padded;
  padded.valid_vocab = 50;
  IdMatrix<std::int32_t> pad = targets;
  pad(0, 3) = 51;
  CHECK_THAT(thrown_message<index_error>([&] { vocab_parallel_cross_entropy<float>(comm, kV, local, pad, padded); }),
             Catch::Contains("columns [50, 53) are vocabulary padding"));

  // An option checked in the float the loss computes in: a soft-cap of 1e-50 is 0 there.
  CrossEntropyOptions tiny_cap;
  tiny_cap.softcap = 1e-50;
  CHECK(thrown_message<value_error>([&] {
          vocab_parallel_cross_entropy_forward_backward<float>(comm, kV, local, targets, dlocal, tiny_cap);
        }) == on_rank("vocab_parallel_cross_entropy_forward_backward: softcap = 1e-50 outside [0, inf) (0: off) in "
                      "float: it rounds to 0 (the smallest positive float is 1.4013e-45)",
                      0, R));  // every rank fails: rank 0's message
  CHECK(dlocal.isConstant(2.0f));

  // Targets differing across ranks.
  if (R > 1) {
    IdMatrix<std::int32_t> differ = targets;
    if (me == last) differ(0, 0) = 7;
    message = thrown_message<value_error>(
        [&] { vocab_parallel_cross_entropy_forward_backward<float>(comm, kV, local, differ, dlocal); });
    CHECK_THAT(message, Catch::Contains("ranks 0 and " + std::to_string(last)) &&
                            Catch::Contains("disagree on the targets, N, V or the loss options"));
    // Options differing across ranks.
    CrossEntropyOptions o;
    o.label_smoothing = me == last ? 0.1 : 0.0;
    CHECK_THROWS_AS(vocab_parallel_cross_entropy<float>(comm, kV, local, targets, o), value_error);
  }
  CHECK(dlocal.isConstant(2.0f));

  // Wrong local width on the last rank.
  const RowMatrix<float> wide = random_matrix<float>(4, shard.rows() + (me == last ? 1 : 0), 9);
  message = thrown_message<shape_error>([&] { vocab_parallel_cross_entropy<float>(comm, kV, wide, targets); });
  CHECK(ends_with(message, R == 1 ? "expected [4, 53]" : " of " + std::to_string(R) + "]"));
  CHECK_THAT(message, Catch::Contains("vocab_parallel_cross_entropy: local_logits has shape"));
  for (const std::string& m : gather_strings(comm, message)) CHECK(m == message);

  // Wrong dlocal shape, wrong target count, bad option, V < R.
  RowMatrix<float> dlocal_bad(4, shard.rows() + 1);
  CHECK_THROWS_AS(vocab_parallel_cross_entropy_forward_backward<float>(comm, kV, local, targets, dlocal_bad),
                  shape_error);
  CHECK_THROWS_WITH(vocab_parallel_cross_entropy<float>(comm, kV, local,
                                                        IdMatrix<std::int32_t>(IdMatrix<std::int32_t>::Zero(1, 3))),
                    Catch::Contains("targets has 3 entries, expected N = 4"));
  CrossEntropyOptions o;
  o.label_smoothing = 1.5;
  CHECK_THROWS_WITH(vocab_parallel_cross_entropy_forward_backward<float>(comm, kV, local, targets, dlocal, o),
                    Catch::Contains("label_smoothing = 1.5 outside [0, 1]"));
  CHECK_THROWS_AS(vocab_parallel_cross_entropy<float>(comm, R > 1 ? R - 1 : 0, local, targets), value_error);
  CHECK(dlocal.isConstant(2.0f));
}

// ---- soft (probability) targets ----

namespace {

// Soft targets [N, C] and the same as sparse pairs [N, 4]: row n puts 1/2, 1/4, 1/8, 1/8 on the
// classes (7 n + 13 i) mod C, spread over every shard.
template <typename S>
void soft_targets(Index N, Index C, RowMatrix<S>& dense, IdMatrix<std::int64_t>& ids, RowMatrix<S>& probs) {
  const double share[4] = {0.5, 0.25, 0.125, 0.125};
  dense = RowMatrix<S>::Zero(N, C);
  ids.resize(N, 4);
  probs.resize(N, 4);
  for (Index n = 0; n < N; ++n)
    for (Index i = 0; i < 4; ++i) {
      const Index c = (7 * n + 13 * i) % C;
      dense(n, c) += static_cast<S>(share[i]);
      ids(n, i) = c;
      probs(n, i) = static_cast<S>(share[i]);
    }
}

}  // namespace

TEMPLATE_TEST_CASE("vocab_parallel_cross_entropy_soft: the loss and dlogits columns of cross_entropy_soft",
                   "[vocab_parallel][soft]", float, double) {
  using S = TestType;
  Communicator& comm = world();
  const int R = comm.size();
  const VocabShard shard = vocab_shard(kV, comm.rank(), R);
  const double tol = test_support::tolerance<S>(), ltol = loss_tolerance<S>();
  const Index N = 10;
  const RowMatrix<S> logits = random_matrix<S>(N, kV, 180, 4.0);
  const RowMatrix<S> local = logits.middleCols(shard.begin, shard.rows());
  for (const Index C : {kV, Index(36)})  // 36: the third rank's columns all padding
    for (const Reduction reduction : {Reduction::mean, Reduction::sum, Reduction::none})
      for (const bool smoothing_weights : {false, true})
        for (const bool extras : {false, true})
          for (const bool sparse : {false, true}) {
            CAPTURE(C, static_cast<int>(reduction), smoothing_weights, extras, sparse, comm.rank(), R);
            CrossEntropyOptions o;
            o.valid_vocab = C;
            o.reduction = reduction;
            if (smoothing_weights) {
              o.label_smoothing = 0.1;
              o.class_weights = test_support::class_weights(C);
            }
            if (extras) {
              o.z_loss = 1e-3;
              o.softcap = 3.0;
              o.entropy_bonus = 0.25;
              o.gradient_scale = 0.5;
            }
            RowMatrix<S> dense, probs;
            IdMatrix<std::int64_t> ids;
            soft_targets<S>(N, C, dense, ids, probs);
            const SparseTargets<S> sparse_targets{ids, probs};
            RowMatrix<S> dlogits(N, kV);
            const CrossEntropyResult expected = sparse
                                                    ? cross_entropy_soft_forward_backward<S>(logits, sparse_targets,
                                                                                             dlogits, o)
                                                    : cross_entropy_soft_forward_backward<S>(logits, dense, dlogits, o);
            RowMatrix<S> dlocal = RowMatrix<S>::Constant(N, shard.rows(), S(9));
            const CrossEntropyResult got =
                sparse
                    ? vocab_parallel_cross_entropy_soft_forward_backward<S>(comm, kV, local, sparse_targets, dlocal, o)
                    : vocab_parallel_cross_entropy_soft_forward_backward<S>(comm, kV, local, dense, dlocal, o);
            CHECK(got.count == N);
            CHECK(got.weight_sum == expected.weight_sum);
            CHECK(close_scalar(got.loss, expected.loss, ltol));
            CHECK(close_scalar(got.entropy, expected.entropy, ltol));
            CHECK(close(dlocal, dlogits.middleCols(shard.begin, shard.rows()), tol));
            CHECK(same_on_every_rank(comm, got.loss));
            const CrossEntropyResult alone = sparse ? vocab_parallel_cross_entropy_soft<S>(comm, kV, local,
                                                                                           sparse_targets, o)
                                                    : vocab_parallel_cross_entropy_soft<S>(comm, kV, local, dense, o);
            CHECK(alone.loss == got.loss);
            RowMatrix<S> inplace = local;  // dlocal over the logits
            vocab_parallel_cross_entropy_soft_forward_backward<S>(comm, kV, inplace, dense, inplace, o);
            if (!sparse) CHECK(first_difference(inplace, dlocal) == "");
            if (R == 1 && !sparse) {  // one rank, dense: the plain loss's arithmetic
              CHECK(got.loss == expected.loss);
              CHECK(first_difference(dlocal, dlogits) == "");
            }
          }
}

TEST_CASE("vocab_parallel_cross_entropy_soft errors: agreed across ranks, nothing written", "[vocab_parallel][soft]") {
  Communicator& comm = world();
  const int R = comm.size(), me = comm.rank(), last = R - 1;
  const VocabShard shard = vocab_shard(kV, me, R);
  const RowMatrix<float> local = random_matrix<float>(4, shard.rows(), 19);
  RowMatrix<float> dlocal = RowMatrix<float>::Constant(4, shard.rows(), 2.0f);
  RowMatrix<float> dense, probs;
  IdMatrix<std::int64_t> ids;
  soft_targets<float>(4, kV, dense, ids, probs);
  const std::string fb = "vocab_parallel_cross_entropy_soft_forward_backward: ";

  // A row that does not sum to 1 on the last rank.
  RowMatrix<float> bad = dense;
  if (me == last) bad(2, 0) += 0.5f;
  std::string message = thrown_message<value_error>(
      [&] { vocab_parallel_cross_entropy_soft_forward_backward<float>(comm, kV, local, bad, dlocal); });
  std::string expected = on_rank(
      fb + "targets of row n=2 sum to 1.5, outside [1 - 0.001, 1 + 0.001] (a distribution over the classes)", last, R);
  CHECK(message == expected);
  for (const std::string& m : gather_strings(comm, message)) CHECK(m == expected);
  CHECK(dlocal.isConstant(2.0f));

  // A sparse id out of range, on every rank.
  IdMatrix<std::int64_t> bad_ids = ids;
  bad_ids(1, 2) = 60;
  CHECK(thrown_message<index_error>([&] {
          vocab_parallel_cross_entropy_soft_forward_backward<float>(comm, kV, local,
                                                                    SparseTargets<float>{bad_ids, probs}, dlocal);
        }) == on_rank(fb + "targets.ids(1, 2) = 60 outside [0, 53)", 0, R));
  CHECK(dlocal.isConstant(2.0f));

  // ignore_index other than -100.
  CrossEntropyOptions o;
  o.ignore_index = 0;
  CHECK(thrown_message<value_error>([&] {
          vocab_parallel_cross_entropy_soft_forward_backward<float>(comm, kV, local, dense, dlocal, o);
        }) == on_rank(fb + "ignore_index = 0 with soft targets, which have no ignored rows (leave it at its default, "
                           "-100)",
                      0, R));
  CHECK(dlocal.isConstant(2.0f));

  // Valid soft targets that differ across ranks.
  if (R > 1) {
    RowMatrix<float> differ = dense;
    if (me == last) {  // still a distribution: 1/8 moved from one class to another
      const Index from = ids(0, 3), to = (ids(0, 3) + 1) % kV;
      differ(0, from) -= 0.125f;
      differ(0, to) += 0.125f;
    }
    message = thrown_message<value_error>(
        [&] { vocab_parallel_cross_entropy_soft_forward_backward<float>(comm, kV, local, differ, dlocal); });
    CHECK_THAT(message, Catch::Contains("ranks 0 and " + std::to_string(last)) &&
                            Catch::Contains("disagree on the targets, N, V or the loss options"));
  }
  CHECK(dlocal.isConstant(2.0f));
}
