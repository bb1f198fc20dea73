// all_reduce_gradient / all_reduce_gradients (data parallelism: replicated tables, per-rank
// batches); built single-process and under mpirun with 1, 2 and 3 ranks (tests/parallel/world.hpp).
//
// Every rank's input gradient is a pure function of (seed, rank), so each rank can rebuild every
// other rank's input and compute the expected sum itself, in rank order (the order the sparse path
// adds in, hence exact comparisons for it). Tests use CHECK wherever a collective follows.
#include <embedhead/cross_entropy.hpp>
#include <embedhead/optim/optimizer.hpp>
#include <embedhead/optim/sgd.hpp>
#include <embedhead/output_projection.hpp>
#include <embedhead/parallel/data_parallel.hpp>
#include <embedhead/token_embedding.hpp>

#include "../reference/test_support.hpp"
#include "world.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

using namespace embedhead;
using test_support::close;
using test_support::first_difference;
using test_support::same_values;
using test_support::tolerance;
using test_support::gather_strings;
using test_support::world;

namespace {

// Rank r's touched rows: about `count` distinct ids in [0, V), sorted; the ranks' sets overlap.
std::vector<Index> rank_ids(int r, Index V, Index count, std::uint64_t seed) {
  std::mt19937_64 gen(seed * 1000 + static_cast<std::uint64_t>(r));
  std::uniform_int_distribution<Index> dist(0, V - 1);
  std::vector<Index> ids;
  for (Index i = 0; i < count; ++i) ids.push_back(dist(gen));
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

template <typename Scalar>
RowMatrix<Scalar> rank_rows(int r, Index k, Index d, std::uint64_t seed) {
  return test_support::random_matrix<Scalar>(k, d, seed * 1000 + 500 + static_cast<std::uint64_t>(r));
}

// grad += rows at ids (sparse accumulation, as a backward pass does it).
template <typename Scalar>
void add_rows(RowGradient<Scalar>& grad, const std::vector<Index>& ids, const RowMatrix<Scalar>& rows) {
  std::vector<Index> slots(ids.size());
  grad.touch_rows(ids.data(), static_cast<Index>(ids.size()), slots.data());
  for (std::size_t j = 0; j < ids.size(); ++j) grad.slot_row(slots[j]) += rows.row(static_cast<Index>(j));
}

// The expected sum over ranks, in rank order, and the union of the touched rows.
template <typename Scalar>
RowMatrix<Scalar> reference_sum(int R, Index V, Index d, const std::vector<Index>& counts, std::uint64_t seed,
                                std::vector<Index>* union_ids = nullptr) {
  RowMatrix<Scalar> sum = RowMatrix<Scalar>::Zero(V, d);
  std::vector<Index> all;
  for (int r = 0; r < R; ++r) {
    const std::vector<Index> ids = rank_ids(r, V, counts[static_cast<std::size_t>(r)], seed);
    const RowMatrix<Scalar> rows = rank_rows<Scalar>(r, static_cast<Index>(ids.size()), d, seed);
    for (std::size_t j = 0; j < ids.size(); ++j) sum.row(ids[j]) += rows.row(static_cast<Index>(j));
    all.insert(all.end(), ids.begin(), ids.end());
  }
  std::sort(all.begin(), all.end());
  all.erase(std::unique(all.begin(), all.end()), all.end());
  if (union_ids) *union_ids = all;
  return sum;
}

// True on every rank iff m's bytes are the same on every rank (one all-gather).
template <typename Matrix>
bool same_on_every_rank(Communicator& comm, const Matrix& m) {
  const auto hash = static_cast<std::int64_t>(
      detail::fingerprint_bytes(m.data(), static_cast<std::size_t>(m.size()) * sizeof(typename Matrix::Scalar)));
  const std::vector<std::int64_t> all = comm.all_gather(hash);
  return std::all_of(all.begin(), all.end(), [&](std::int64_t h) { return h == all[0]; });
}

// A snapshot of a gradient, to check that a throwing call changed nothing.
template <typename Scalar>
struct GradientState {
  explicit GradientState(const RowGradient<Scalar>& g)
      : dense(g.is_dense()), touched(g.touched_rows()), values(g.to_dense()) {}
  bool operator==(const GradientState& o) const {
    return dense == o.dense && touched == o.touched && same_values(values, o.values);
  }
  bool dense;
  std::vector<Index> touched;
  RowMatrix<Scalar> values;
};

}  // namespace

TEMPLATE_TEST_CASE("all_reduce_gradient: sparse, dense and automatic give the sum over ranks", "", float, double) {
  using S = TestType;
  Communicator& comm = world();
  const int R = comm.size(), me = comm.rank();
  const Index V = 101, d = 7;
  const std::uint64_t seed = 11;
  // One workspace for every sparse call below (its buffers grow and shrink between calls); the
  // other modes run without one.
  GradientExchangeWorkspace<S> work;
  // Overlapping random sets; in the second case the middle rank (or the only one) touches
  // nothing, so a rank with k = 0 takes part too.
  for (int variant = 0; variant < 2; ++variant) {
    std::vector<Index> counts(static_cast<std::size_t>(R));
    for (int r = 0; r < R; ++r) counts[static_cast<std::size_t>(r)] = (variant == 1 && r == R / 2) ? 0 : 12 + 4 * r;
    std::vector<Index> union_ids;
    const RowMatrix<S> expected = reference_sum<S>(R, V, d, counts, seed, &union_ids);
    const std::vector<Index> my_ids = rank_ids(me, V, counts[static_cast<std::size_t>(me)], seed);
    const RowMatrix<S> my_rows = rank_rows<S>(me, static_cast<Index>(my_ids.size()), d, seed);
    Index gathered = 0;
    for (int r = 0; r < R; ++r)
      gathered += static_cast<Index>(rank_ids(r, V, counts[static_cast<std::size_t>(r)], seed).size());
    const Index k = static_cast<Index>(my_ids.size());

    for (GradientExchange mode : {GradientExchange::sparse, GradientExchange::dense, GradientExchange::automatic}) {
      INFO("variant " << variant << ", mode " << detail::exchange_mode_name(mode) << ", rank " << me << " of " << R);
      Parameter<S> p(V, d);
      add_rows(p.grad(), my_ids, my_rows);
      GradientExchangeOptions options;
      options.mode = mode;
      const GradientExchangeResult result = all_reduce_gradient(p, comm, options,
                                                                mode == GradientExchange::sparse ? &work : nullptr);
      const RowMatrix<S> got = p.grad().to_dense();
      // automatic: the byte model with the default threshold.
      const double ratio = static_cast<double>(gathered) * static_cast<double>(d * sizeof(S) + 8) /
                           (static_cast<double>(V) * static_cast<double>(d * sizeof(S)));
      const bool dense = mode == GradientExchange::dense ||
                         (mode == GradientExchange::automatic && ratio > options.dense_threshold);
      if (R == 1) {
        // One rank: the gradient is already the sum; nothing is sent, densified or copied.
        CHECK_FALSE(result.dense);
        CHECK_FALSE(p.grad().is_dense());
        CHECK(result.rows_sent == 0);
        CHECK(result.rows_gathered == 0);
        CHECK(result.bytes_sent == 0);
        CHECK(result.union_rows == k);
        CHECK(p.grad().touched_rows() == my_ids);
        CHECK(first_difference(got, expected) == "");
        continue;
      }
      CHECK(result.dense == dense);
      CHECK(p.grad().is_dense() == dense);
      if (dense) {
        CHECK(result.rows_sent == V);
        CHECK(result.rows_gathered == 0);
        CHECK(result.union_rows == V);
        CHECK(result.bytes_sent == static_cast<std::int64_t>(V * d * sizeof(S)));
        // One addition per entry with 1 or 2 ranks (it commutes): exactly the rank-order sum.
        if (R <= 2)
          CHECK(first_difference(got, expected) == "");
        else
          CHECK(close(got, expected, tolerance<S>()));
      } else {
        CHECK(result.rows_sent == k);
        CHECK(result.rows_gathered == gathered);
        CHECK(result.union_rows == static_cast<Index>(union_ids.size()));
        CHECK(result.bytes_sent == static_cast<std::int64_t>(k * (d * static_cast<Index>(sizeof(S)) + 8)));
        CHECK(p.grad().touched_rows() == union_ids);
        CHECK(first_difference(got, expected) == "");  // the same additions in the same order
      }
      CHECK(same_on_every_rank(comm, got));
    }
  }
}

TEMPLATE_TEST_CASE("all_reduce_gradient: a bf16 / fp16 table's float gradient is exchanged as a float one", "",
                   Eigen::bfloat16, Eigen::half) {
  using Storage = TestType;
  Communicator& comm = world();
  const int R = comm.size(), me = comm.rank();
  const Index V = 41, d = 5;
  const std::uint64_t seed = 17;
  std::vector<Index> counts(static_cast<std::size_t>(R));
  for (int r = 0; r < R; ++r) counts[static_cast<std::size_t>(r)] = 6 + 3 * r;
  std::vector<Index> union_ids;
  const RowMatrix<float> expected = reference_sum<float>(R, V, d, counts, seed, &union_ids);
  const std::vector<Index> my_ids = rank_ids(me, V, counts[static_cast<std::size_t>(me)], seed);
  const RowMatrix<float> my_rows = rank_rows<float>(me, static_cast<Index>(my_ids.size()), d, seed);
  for (GradientExchange mode : {GradientExchange::sparse, GradientExchange::dense}) {
    INFO("mode " << detail::exchange_mode_name(mode) << ", rank " << me << " of " << R);
    // The table itself (Storage) is replicated and never sent; only its float gradient is.
    auto table = std::make_shared<Parameter<Storage, float>>(RowMatrix<Storage>::Constant(V, d, Storage(0.5f)),
                                                             "table");
    auto bias = std::make_shared<Parameter<float>>(V, 1, "bias");
    add_rows(table->grad(), my_ids, my_rows);
    GradientExchangeOptions options;
    options.mode = mode;
    // A mixed list, as LowPrecisionOutputProjection::parameters() gives: ParameterBase<float>.
    const std::vector<std::shared_ptr<ParameterBase<float>>> list{table, bias};
    const std::vector<GradientExchangeResult> results = all_reduce_gradients(list, comm, options);
    CHECK(results.size() == 2);
    const RowMatrix<float> got = table->grad().to_dense();
    if (R <= 2 || mode == GradientExchange::sparse)
      CHECK(first_difference(got, expected) == "");  // rank-order additions (1 or 2 ranks commute)
    else
      CHECK(close(got, expected, tolerance<float>()));
    CHECK(same_on_every_rank(comm, got));
    CHECK(table->value().template cast<float>().isConstant(0.5f, 0));
    // And one parameter on its own, through the typed overload.
    table->zero_grad();
    add_rows(table->grad(), my_ids, my_rows);
    all_reduce_gradient(*table, comm, options);
    CHECK(same_on_every_rank(comm, RowMatrix<float>(table->grad().to_dense())));
  }
}

TEMPLATE_TEST_CASE("all_reduce_gradient: nothing touched anywhere, and one rank", "", float, double) {
  using S = TestType;
  Communicator& comm = world();
  Parameter<S> p(50, 3);
  const GradientExchangeResult result = all_reduce_gradient(p, comm);
  CHECK_FALSE(result.dense);
  CHECK(result.rows_gathered == 0);
  CHECK(result.union_rows == 0);
  CHECK(p.grad().num_touched() == 0);
  CHECK_FALSE(p.grad().is_dense());
  // V = 1, d = 1: every rank adds rank + 1 to the single entry.
  Parameter<S> one(1, 1);
  const std::vector<Index> ids = {0};
  RowMatrix<S> row(1, 1);
  row(0, 0) = static_cast<S>(comm.rank() + 1);
  add_rows(one.grad(), ids, row);
  for (GradientExchange mode : {GradientExchange::sparse, GradientExchange::dense}) {
    Parameter<S> q(1, 1);
    add_rows(q.grad(), ids, row);
    GradientExchangeOptions options;
    options.mode = mode;
    all_reduce_gradient(q, comm, options);
    const int R = comm.size();
    CHECK(q.grad().to_dense()(0, 0) == static_cast<S>(R * (R + 1) / 2));
  }
}

TEMPLATE_TEST_CASE("all_reduce_gradient: automatic switches to dense above the threshold", "", float, double) {
  using S = TestType;
  Communicator& comm = world();
  const int R = comm.size(), me = comm.rank();
  const Index V = 53, d = 5;
  const std::uint64_t seed = 23;
  std::vector<Index> counts(static_cast<std::size_t>(R), 12);
  const RowMatrix<S> expected = reference_sum<S>(R, V, d, counts, seed);
  const std::vector<Index> my_ids = rank_ids(me, V, 12, seed);
  const RowMatrix<S> my_rows = rank_rows<S>(me, static_cast<Index>(my_ids.size()), d, seed);
  Index gathered = 0;
  for (int r = 0; r < R; ++r) gathered += static_cast<Index>(rank_ids(r, V, 12, seed).size());
  // The byte model's ratio: what every rank sends sparsely over one dense gradient.
  const double ratio = static_cast<double>(gathered) * static_cast<double>(d * sizeof(S) + 8) /
                       (static_cast<double>(V) * static_cast<double>(d * sizeof(S)));
  struct Case {
    double threshold;
    bool dense;
  };
  for (const Case& c : {Case{ratio * 1.001, false}, Case{ratio * 0.999, true}, Case{0.0, true}, Case{1e9, false}}) {
    INFO("threshold " << c.threshold << " vs ratio " << ratio);
    Parameter<S> p(V, d);
    add_rows(p.grad(), my_ids, my_rows);
    GradientExchangeOptions options;
    options.dense_threshold = c.threshold;
    const GradientExchangeResult result = all_reduce_gradient(p, comm, options);
    // One rank has nothing to exchange and never densifies.
    CHECK(result.dense == (c.dense && R > 1));
    CHECK(p.grad().is_dense() == (c.dense && R > 1));
    if (R <= 2 || !c.dense)
      CHECK(first_difference(p.grad().to_dense(), expected) == "");
    else
      CHECK(close(p.grad().to_dense(), expected, tolerance<S>()));
  }
  // The default threshold keeps a small sparse gradient sparse.
  Parameter<S> p(V, d);
  add_rows(p.grad(), my_ids, my_rows);
  CHECK(all_reduce_gradient(p, comm).dense == (R > 1 && ratio > GradientExchangeOptions{}.dense_threshold));
}

TEMPLATE_TEST_CASE("all_reduce_gradient: a gradient already dense on one rank forces dense", "", float, double) {
  using S = TestType;
  Communicator& comm = world();
  const int R = comm.size(), me = comm.rank();
  const Index V = 50, d = 4;
  const std::uint64_t seed = 31;
  std::vector<Index> counts(static_cast<std::size_t>(R), 8);
  const RowMatrix<S> expected = reference_sum<S>(R, V, d, counts, seed);
  const std::vector<Index> my_ids = rank_ids(me, V, 8, seed);
  const RowMatrix<S> my_rows = rank_rows<S>(me, static_cast<Index>(my_ids.size()), d, seed);
  for (GradientExchange mode : {GradientExchange::sparse, GradientExchange::automatic}) {
    Parameter<S> p(V, d);
    add_rows(p.grad(), my_ids, my_rows);
    if (me == R - 1) p.grad().dense_accumulator();  // the last rank's gradient: dense, same values
    GradientExchangeOptions options;
    options.mode = mode;
    const GradientExchangeResult result = all_reduce_gradient(p, comm, options);
    CHECK(result.dense);
    CHECK(p.grad().is_dense());
    if (R <= 2)
      CHECK(first_difference(p.grad().to_dense(), expected) == "");
    else
      CHECK(close(p.grad().to_dense(), expected, tolerance<S>()));
    CHECK(same_on_every_rank(comm, p.grad().to_dense()));
  }
}

TEMPLATE_TEST_CASE("all_reduce_gradients: a data-parallel step equals the single-process step on the whole batch", "",
                   float, double) {
  using S = TestType;
  Communicator& comm = world();
  const int R = comm.size(), me = comm.rank();
  const Index V = 53, d = 8, B = 6, T = 3;  // B divisible by 1, 2 and 3: every rank gets B / R rows
  const IdMatrix<std::int32_t> ids = test_support::random_ids<std::int32_t>(B, T, V, 41);
  const IdMatrix<std::int32_t> targets = test_support::random_ids<std::int32_t>(B, T, V, 42);
  const Index rows_per_rank = B / R;
  const IdMatrix<std::int32_t> my_ids = ids.middleRows(me * rows_per_rank, rows_per_rank);
  const IdMatrix<std::int32_t> my_targets = targets.middleRows(me * rows_per_rank, rows_per_rank);
  SGDOptions sgd;
  sgd.lr = 0.5;

  for (bool tied : {false, true}) {
    INFO((tied ? "tied" : "untied") << ", rank " << me << " of " << R);
    // One step: forward, mean cross-entropy, backward, (exchange), SGD. The mean over this rank's
    // B/R rows times gradient_scale 1/R is the mean over the whole batch.
    auto step = [&](const IdMatrix<std::int32_t>& x, const IdMatrix<std::int32_t>& y, bool parallel) {
      auto embedding = std::make_unique<TokenEmbedding<S>>(V, d);
      auto head = tied ? std::make_unique<OutputProjection<S>>(*embedding)
                       : std::make_unique<OutputProjection<S>>(V, d);
      const RowMatrix<S> h = embedding->forward(x);
      const RowMatrix<S> logits = head->forward(h);
      RowMatrix<S> dlogits(logits.rows(), logits.cols());
      CrossEntropyOptions ce;
      ce.gradient_scale = parallel ? 1.0 / R : 1.0;
      const double loss = cross_entropy_forward_backward<S>(logits, y, dlogits, ce).loss;
      RowMatrix<S> dh(h.rows(), h.cols());
      head->backward(h, dlogits, dh);
      embedding->backward(x, dh);
      std::vector<std::shared_ptr<Parameter<S>>> params = {embedding->weight_ptr()};
      for (const auto& p : head->parameters()) params.push_back(p);
      if (parallel) {
        const std::vector<GradientExchangeResult> results = all_reduce_gradients(params, comm);
        CHECK(results.size() == params.size());
        if (tied) {  // E listed twice, exchanged once: twice would multiply it by R
          CHECK(params[0] == params[1]);
          CHECK(results[1].dense == results[0].dense);
          CHECK(results[1].bytes_sent == results[0].bytes_sent);
        }
        // The head's W and b are dense (dW touches every row), and so is a tied E; an untied E
        // goes by the byte model.
        for (std::size_t i = tied ? 0 : 1; i < results.size(); ++i) CHECK(results[i].dense);
      }
      std::vector<RowMatrix<S>> grads;
      for (const auto& p : params) grads.push_back(p->grad().to_dense());
      SGD<S> optimizer(sgd, unique_parameters(params));
      optimizer.step();
      std::vector<RowMatrix<S>> values;
      for (const auto& p : params) values.push_back(p->value());
      return std::make_tuple(loss, grads, values);
    };
    const auto [loss_all, grads_all, values_all] = step(ids, targets, false);
    const auto [loss_mine, grads_mine, values_mine] = step(my_ids, my_targets, true);
    double loss_sum = loss_mine / R;
    comm.all_reduce_sum(&loss_sum, 1);
    CHECK(std::abs(loss_sum - loss_all) <= 1e-5 * std::abs(loss_all));
    REQUIRE(grads_all.size() == grads_mine.size());
    for (std::size_t i = 0; i < grads_all.size(); ++i) {
      INFO("parameter " << i);
      CHECK(close(grads_mine[i], grads_all[i], tolerance<S>()));
      CHECK(close(values_mine[i], values_all[i], tolerance<S>()));
      CHECK(same_on_every_rank(comm, values_mine[i]));
    }
  }

  // An embedding alone (no head): sparse gradients, exchanged sparsely, equal to the whole batch's.
  TokenEmbedding<S> whole(V, d), part(V, d);
  const RowMatrix<S> dout_all = test_support::random_matrix<S>(B * T, d, 43);
  whole.backward(ids, dout_all);
  part.backward(my_ids, dout_all.middleRows(me * rows_per_rank * T, rows_per_rank * T));
  const std::vector<GradientExchangeResult> results = all_reduce_gradients<S>({part.weight_ptr()}, comm);
  CHECK_FALSE(results[0].dense);
  CHECK(part.weight().grad().touched_rows() == whole.weight().grad().touched_rows());
  CHECK(close(part.weight().grad().to_dense(), whole.weight().grad().to_dense(), tolerance<S>()));
}

TEST_CASE("all_reduce_gradient: frozen parameters are left alone on every rank") {
  Communicator& comm = world();
  const int R = comm.size(), me = comm.rank();
  Parameter<float> p(50, 3);
  p.set_frozen(true);
  const std::vector<Index> ids = {1, 7};
  add_rows(p.grad(), ids,
           test_support::random_matrix<float>(2, 3, 5 + static_cast<std::uint64_t>(me)));  // written directly
  const GradientState<float> before(p.grad());
  const GradientExchangeResult result = all_reduce_gradient(p, comm);
  CHECK(GradientState<float>(p.grad()) == before);
  CHECK_FALSE(result.dense);
  CHECK(result.rows_sent == 0);
  CHECK(result.bytes_sent == 0);
  // Frozen on some ranks only: every rank throws, nothing changes.
  if (R > 1) {
    Parameter<float> q(50, 3);
    add_rows(q.grad(), ids, test_support::random_matrix<float>(2, 3, 9));
    if (me == R - 1) q.set_frozen(true);
    const GradientState<float> q_before(q.grad());
    std::string message;
    try {
      all_reduce_gradient(q, comm);
    } catch (const value_error& e) {
      message = e.what();
    }
    CHECK_THAT(message, Catch::Contains("all_reduce_gradient: ranks 0 and " + std::to_string(R - 1)) &&
                            Catch::Contains("frozen flag"));
    CHECK(GradientState<float>(q.grad()) == q_before);
  }
}

TEST_CASE("all_reduce_gradient(s): errors agreed on every rank, nothing changed") {
  Communicator& comm = world();
  const int R = comm.size(), me = comm.rank();
  const Index V = 53, d = 4;
  const std::vector<Index> ids = {2, 30, 52};
  const RowMatrix<double> rows = test_support::random_matrix<double>(3, d, 77 + static_cast<std::uint64_t>(me));
  const std::string suffix = R > 1 ? " [on rank " + std::to_string(R - 1) + " of " + std::to_string(R) + "]" : "";

  // A shape that differs on the last rank (V + 1 rows there).
  if (R > 1) {
    Parameter<double> p(me == R - 1 ? V + 1 : V, d);
    add_rows(p.grad(), ids, rows);
    const GradientState<double> before(p.grad());
    std::string message;
    try {
      all_reduce_gradient(p, comm);
    } catch (const value_error& e) {
      message = e.what();
    }
    CHECK_THAT(message, Catch::Contains("ranks 0 and " + std::to_string(R - 1) + " of " + std::to_string(R) +
                                        " disagree on the parameter's shape [V, d]"));
    const std::vector<std::string> all = gather_strings(comm, message);
    for (const auto& m : all) CHECK(m == all[0]);
    CHECK(GradientState<double>(p.grad()) == before);
    // In a list: the second entry's columns differ on the last rank.
    auto a = std::make_shared<Parameter<double>>(V, d);
    auto b = std::make_shared<Parameter<double>>(V, me == R - 1 ? d + 1 : d);
    add_rows(a->grad(), ids, rows);
    const GradientState<double> a_before(a->grad());
    CHECK_THROWS_WITH(all_reduce_gradients<double>({a, b}, comm), Catch::Contains("all_reduce_gradients: ranks 0 and"));
    CHECK(GradientState<double>(a->grad()) == a_before);
    // Lists of different lengths.
    std::vector<std::shared_ptr<Parameter<double>>> list = {a};
    if (me == R - 1) list.push_back(b);
    CHECK_THROWS_AS(all_reduce_gradients(list, comm), value_error);
    CHECK(GradientState<double>(a->grad()) == a_before);
    // Valid options that differ: sparse on rank 0, dense elsewhere (they would make different
    // collectives), then two automatic thresholds.
    for (int variant = 0; variant < 2; ++variant) {
      GradientExchangeOptions options;
      if (variant == 0) options.mode = me == 0 ? GradientExchange::sparse : GradientExchange::dense;
      if (variant == 1) options.dense_threshold = me == R - 1 ? 0.5 : 1.0;
      std::string differ;
      try {
        all_reduce_gradient(*a, comm, options);
      } catch (const value_error& e) {
        differ = e.what();
      }
      CHECK_THAT(differ, Catch::Contains("disagree on"));
      const std::vector<std::string> all_differ = gather_strings(comm, differ);
      for (const auto& m : all_differ) CHECK(m == all_differ[0]);
      CHECK(GradientState<double>(a->grad()) == a_before);
    }
  }

  // Bad options on the last rank only.
  struct BadOption {
    double threshold;
    int mode;
    std::string expected;
  };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (const BadOption& c :
       {BadOption{-1.0, 0, "all_reduce_gradient: options.dense_threshold = -1 outside [0, inf)"},
        BadOption{nan, 0, "all_reduce_gradient: options.dense_threshold = nan outside [0, inf)"},
        BadOption{0.5, 7, "all_reduce_gradient: options.mode = 7 outside {automatic, sparse, dense} = [0, 2]"}}) {
    Parameter<double> p(V, d);
    add_rows(p.grad(), ids, rows);
    const GradientState<double> before(p.grad());
    GradientExchangeOptions options;
    if (me == R - 1) {
      options.dense_threshold = c.threshold;
      options.mode = static_cast<GradientExchange>(c.mode);
    }
    std::string message;
    try {
      all_reduce_gradient(p, comm, options);
    } catch (const value_error& e) {
      message = e.what();
    }
    CHECK(message == c.expected + suffix);
    CHECK(GradientState<double>(p.grad()) == before);
  }

  // A null entry on the last rank.
  auto a = std::make_shared<Parameter<double>>(V, d);
  add_rows(a->grad(), ids, rows);
  const GradientState<double> a_before(a->grad());
  std::vector<std::shared_ptr<Parameter<double>>> list = {a, std::make_shared<Parameter<double>>(V, d)};
  if (me == R - 1) list[1] = nullptr;
  std::string message;
  try {
    all_reduce_gradients(list, comm);
  } catch (const value_error& e) {
    message = e.what();
  }
  CHECK(message == "all_reduce_gradients: parameters[1] is null (of 2 entries)" + suffix);
  CHECK(GradientState<double>(a->grad()) == a_before);

  // And afterwards the exchange still works: nobody was left inside a collective.
  const GradientExchangeResult result = all_reduce_gradient(*a, comm);
  CHECK(result.union_rows == 3);
}
