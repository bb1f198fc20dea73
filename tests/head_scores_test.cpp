// Tests for include/embedhead/head_scores.hpp: log-probs (raw and processed), entropy and top-k
// against a naive reference written here in long double from the definitions (logits h W^T + b,
// soft-cap, temperature, log_softmax, -sum p log p, a full sort by (value desc, id asc)); ties;
// masked (-inf) classes; large logits; a padded vocabulary; batch invariance and the equality
// with the fused loss's per-token loss; every error with its message.
#include <embedhead/fused_head_loss.hpp>
#include <embedhead/head_scores.hpp>

#include "reference/test_support.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

using Catch::Contains;
using embedhead::HeadScoreOptions;
using embedhead::HeadScores;
using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::RowMatrix;
using test_support::random_ids;
using test_support::random_matrix;

namespace {

struct Reference {
  std::vector<long double> raw_logprob, processed_logprob, entropy;
  std::vector<std::vector<std::pair<long double, std::int64_t>>> ranked;  // (processed logprob, id), best first
};

// From the definitions, in long double, classes [0, C).
template <typename Scalar>
Reference reference_scores(const RowMatrix<Scalar>& h, const RowMatrix<Scalar>& W, const RowMatrix<Scalar>& bias,
                           const std::vector<std::int64_t>& y, const HeadScoreOptions& options) {
  const Index N = h.rows(), d = h.cols();
  const Index C = options.valid_vocab == -1 ? W.rows() : options.valid_vocab;
  const long double T = options.temperature, cap = options.softcap;
  Reference ref;
  for (Index n = 0; n < N; ++n) {
    std::vector<long double> s(static_cast<std::size_t>(C));
    for (Index j = 0; j < C; ++j) {
      long double z = bias.size() ? static_cast<long double>(bias(j, 0)) : 0.0L;
      for (Index k = 0; k < d; ++k) z += static_cast<long double>(h(n, k)) * static_cast<long double>(W(j, k));
      s[static_cast<std::size_t>(j)] = cap > 0 ? cap * std::tanh(z / cap) : z;
    }
    const auto lse_of = [&](long double scale) {
      long double m = -std::numeric_limits<long double>::infinity();
      for (const long double v : s) m = std::max(m, v / scale);
      long double sum = 0;
      for (const long double v : s) sum += std::exp(v / scale - m);
      return m + std::log(sum);
    };
    const long double lse_raw = lse_of(1.0L), lse_p = lse_of(T);
    if (!y.empty()) {
      const long double sy = s[static_cast<std::size_t>(y[static_cast<std::size_t>(n)])];
      ref.raw_logprob.push_back(sy - lse_raw);
      ref.processed_logprob.push_back(sy / T - lse_p);
    }
    long double H = 0;
    std::vector<std::pair<long double, std::int64_t>> ranked;
    for (Index j = 0; j < C; ++j) {
      const long double lp = s[static_cast<std::size_t>(j)] / T - lse_p;
      if (std::exp(lp) > 0) H -= std::exp(lp) * lp;
      ranked.push_back({lp, j});
    }
    ref.entropy.push_back(H);
    std::stable_sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    ref.ranked.push_back(ranked);
  }
  return ref;
}

template <typename Scalar>
double tolerance() {
  return std::is_same_v<Scalar, float> ? 2e-5 : 1e-11;
}

template <typename Scalar>
void check_against_reference(const RowMatrix<Scalar>& h, const RowMatrix<Scalar>& W, const RowMatrix<Scalar>& bias,
                             const IdMatrix<std::int64_t>& tokens, const HeadScoreOptions& options) {
  const std::vector<std::int64_t> y(tokens.data(), tokens.data() + tokens.size());
  const Reference ref = reference_scores(h, W, bias, y, options);
  const HeadScores got = embedhead::score_head<Scalar>(h, W, bias, tokens, options);
  const double tol = tolerance<Scalar>();
  const Index N = h.rows();
  REQUIRE(got.raw_logprob.size() == static_cast<std::size_t>(N));
  REQUIRE(got.processed_logprob.size() == static_cast<std::size_t>(N));
  for (Index n = 0; n < N; ++n) {
    const std::size_t i = static_cast<std::size_t>(n);
    CAPTURE(n);
    CHECK(got.raw_logprob[i] == Approx(static_cast<double>(ref.raw_logprob[i])).margin(tol).epsilon(tol));
    CHECK(got.processed_logprob[i] == Approx(static_cast<double>(ref.processed_logprob[i])).margin(tol).epsilon(tol));
    if (options.entropy) CHECK(got.entropy[i] == Approx(static_cast<double>(ref.entropy[i])).margin(tol).epsilon(tol));
    for (Index j = 0; j < options.top_k; ++j) {
      CHECK(got.top_ids(n, j) == ref.ranked[i][static_cast<std::size_t>(j)].second);
      CHECK(got.top_logprobs(n, j) ==
            Approx(static_cast<double>(ref.ranked[i][static_cast<std::size_t>(j)].first)).margin(tol).epsilon(tol));
    }
  }
  if (!options.entropy) CHECK(got.entropy.empty());
  if (options.top_k == 0) CHECK(got.top_ids.size() == 0);
}

template <typename A, typename B>
bool same_bytes(const A& a, const B& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), sizeof(a[0]) * a.size()) == 0;
}

}  // namespace

TEMPLATE_TEST_CASE("score_head: log-probs, entropy and top-k against a long double reference", "[head_scores]", float,
                   double) {
  using Scalar = TestType;
  const Index N = 9, d = 40, V = 700;
  const RowMatrix<Scalar> h = random_matrix<Scalar>(N, d, 1);
  const RowMatrix<Scalar> W = random_matrix<Scalar>(V, d, 2, 0.5);
  const RowMatrix<Scalar> bias = random_matrix<Scalar>(V, 1, 3);
  const IdMatrix<std::int64_t> tokens = random_ids<std::int64_t>(N, 1, V, 4);
  for (const double T : {1.0, 0.7, 1.9})
    for (const double cap : {0.0, 3.0})
      for (const Index block : {Index{0}, Index{64}, Index{100}, Index{700}}) {
        HeadScoreOptions options;
        options.temperature = T;
        options.softcap = cap;
        options.vocab_block = block;
        options.entropy = true;
        options.top_k = 5;
        CAPTURE(T, cap, block);
        check_against_reference(h, W, bias, tokens, options);
      }
  // Without bias, k = all classes, int32 tokens [3, 3].
  HeadScoreOptions all;
  all.top_k = V;
  all.entropy = true;
  check_against_reference(h, W, RowMatrix<Scalar>(0, 1), tokens, all);
  const IdMatrix<std::int32_t> tokens32 = tokens.reshaped<Eigen::RowMajor>(3, 3).template cast<std::int32_t>();
  const HeadScores a = embedhead::score_head<Scalar>(h, W, bias, tokens32);
  const HeadScores b = embedhead::score_head<Scalar>(h, W, bias, tokens);
  CHECK(same_bytes(a.processed_logprob, b.processed_logprob));
  // No tokens: no log-probs.
  const HeadScores none = embedhead::score_head<Scalar>(h, W, bias, IdMatrix<std::int64_t>(0, 1), all);
  CHECK(none.raw_logprob.empty());
  CHECK(none.processed_logprob.empty());
  CHECK(none.entropy.size() == static_cast<std::size_t>(N));
}

TEST_CASE("score_head: with T = 1 raw and processed are the same bits; with T != 1 they differ", "[head_scores]") {
  const RowMatrix<float> h = random_matrix<float>(4, 16, 5), W = random_matrix<float>(300, 16, 6);
  const IdMatrix<std::int64_t> tokens = random_ids<std::int64_t>(4, 1, 300, 7);
  const HeadScores one = embedhead::score_head<float>(h, W, RowMatrix<float>(0, 1), tokens);
  CHECK(same_bytes(one.raw_logprob, one.processed_logprob));
  HeadScoreOptions hot;
  hot.temperature = 2.0;
  const HeadScores two = embedhead::score_head<float>(h, W, RowMatrix<float>(0, 1), tokens, hot);
  CHECK(same_bytes(two.raw_logprob, one.raw_logprob));
  for (std::size_t i = 0; i < 4; ++i) CHECK(two.processed_logprob[i] != one.processed_logprob[i]);
  // raw_logprob off: no raw log-probs, the processed ones (and the rest) the same bits, at T = 1 and T = 2.
  hot.top_k = 3;
  hot.entropy = true;
  for (const double T : {1.0, 2.0}) {
    hot.temperature = T;
    const HeadScores both = embedhead::score_head<float>(h, W, RowMatrix<float>(0, 1), tokens, hot);
    HeadScoreOptions processed_only = hot;
    processed_only.raw_logprob = false;
    const HeadScores alone = embedhead::score_head<float>(h, W, RowMatrix<float>(0, 1), tokens, processed_only);
    CHECK(both.raw_logprob.size() == 4);
    CHECK(alone.raw_logprob.empty());
    CHECK(same_bytes(alone.processed_logprob, both.processed_logprob));
    CHECK(same_bytes(alone.entropy, both.entropy));
    CHECK(alone.top_ids == both.top_ids);
    CHECK(alone.top_logprobs == both.top_logprobs);
  }
}

TEST_CASE("score_head: ties go to the smaller id, across and within blocks", "[head_scores]") {
  // W rows 3, 40, 41 and 250 identical (and the biggest), so their logits tie; blocks of 64.
  const Index V = 300, d = 8;
  RowMatrix<double> W = random_matrix<double>(V, d, 8, 0.1);
  const RowMatrix<double> h = RowMatrix<double>::Ones(2, d);
  for (const Index r : {3, 40, 41, 250}) W.row(r).setConstant(1.0);
  HeadScoreOptions options;
  options.top_k = 3;
  options.vocab_block = 64;
  const HeadScores got = embedhead::score_head<double>(h, W, RowMatrix<double>(0, 1), IdMatrix<std::int64_t>(0, 1),
                                                       options);
  for (Index n = 0; n < 2; ++n) {
    CHECK(got.top_ids(n, 0) == 3);
    CHECK(got.top_ids(n, 1) == 40);
    CHECK(got.top_ids(n, 2) == 41);
    CHECK(got.top_logprobs(n, 0) == got.top_logprobs(n, 2));
  }
  // The tie at the k-th place with a later block: 250 never displaces 41.
  options.vocab_block = 16;
  const HeadScores small = embedhead::score_head<double>(h, W, RowMatrix<double>(0, 1), IdMatrix<std::int64_t>(0, 1),
                                                         options);
  CHECK(small.top_ids(0, 2) == 41);
}

TEST_CASE("score_head: a block of equal logits keeps the smallest ids through every cut of the candidates",
          "[head_scores]") {
  // W = 0: every logit of a row is 0. The running top-k gathers candidates and cuts them to the
  // best k whenever they reach 2 k, so a block of 250 equal values goes through many cuts, each
  // a selection among ties; the answer is ids 0 .. k - 1 (ties to the smaller id), in one block
  // and in blocks of 16.
  const Index V = 250, d = 4;
  const RowMatrix<float> W = RowMatrix<float>::Zero(V, d), h = RowMatrix<float>::Ones(2, d);
  for (const Index k : {1, 3, 7}) {
    for (const Index block : {Index{0}, Index{16}}) {
      HeadScoreOptions options;
      options.top_k = k;
      options.vocab_block = block;
      const HeadScores got = embedhead::score_head<float>(h, W, RowMatrix<float>(0, 1), IdMatrix<std::int64_t>(0, 1),
                                                          options);
      for (Index n = 0; n < 2; ++n)
        for (Index j = 0; j < k; ++j) {
          CHECK(got.top_ids(n, j) == j);
          CHECK(got.top_logprobs(n, j) == Approx(-std::log(250.0)).epsilon(1e-6));
        }
    }
  }
  // Equal maxima scattered after the first cut: rows 5, 60, 61, 200 and 249 are the largest; the
  // rest 0. With k = 2 the cut (at 4 candidates) has happened before 60 is seen.
  RowMatrix<float> W2 = RowMatrix<float>::Zero(V, d);
  for (const Index r : {5, 60, 61, 200, 249}) W2.row(r).setConstant(1.0f);
  HeadScoreOptions two;
  two.top_k = 2;
  const HeadScores got = embedhead::score_head<float>(h, W2, RowMatrix<float>(0, 1), IdMatrix<std::int64_t>(0, 1), two);
  CHECK(got.top_ids(0, 0) == 5);
  CHECK(got.top_ids(0, 1) == 60);
}

TEST_CASE("RowTopK: the best k by (value desc, id asc) for any k, block widths, ties and -inf", "[head_scores]") {
  // Values from a small set (ties everywhere, many equal to the running k-th) with -inf among them,
  // offered in blocks of varying widths (below, at and above the 64-value pieces); the sorted
  // candidates' first k against a full sort of the row.
  std::uint64_t state = 12345;
  auto next = [&] {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<std::uint32_t>(state >> 33);
  };
  const float inf = std::numeric_limits<float>::infinity();
  for (int trial = 0; trial < 400; ++trial) {
    const Index V = 1 + static_cast<Index>(next() % 300);
    const int levels = 1 + static_cast<int>(next() % 6);
    const bool many_inf = next() % 3 == 0;
    std::vector<float> row(static_cast<std::size_t>(V));
    for (float& x : row) {
      const std::uint32_t r = next() % 10;
      x = (r < (many_inf ? 7u : 1u)) ? -inf : static_cast<float>(next() % static_cast<std::uint32_t>(levels));
    }
    std::vector<std::int64_t> order(static_cast<std::size_t>(V));
    std::iota(order.begin(), order.end(), std::int64_t{0});
    std::sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
      const float x = row[static_cast<std::size_t>(a)], y = row[static_cast<std::size_t>(b)];
      return x > y || (x == y && a < b);
    });
    for (const Index k : {Index{1}, Index{2}, Index{3}, Index{7}, V / 2 + 1, V - 1, V}) {
      if (k < 1 || k > V) continue;
      for (const Index block : {Index{1}, Index{5}, Index{64}, Index{65}, Index{150}, V}) {
        CAPTURE(trial, V, k, block);
        embedhead::detail::RowTopK<float> top;
        for (Index v0 = 0; v0 < V; v0 += block) top.offer(row.data() + v0, std::min(block, V - v0), v0, k);
        auto kept = top.kept;
        REQUIRE(static_cast<Index>(kept.size()) >= k);
        std::sort(kept.begin(), kept.end(), embedhead::detail::better<float>);
        for (Index j = 0; j < k; ++j)
          REQUIRE(kept[static_cast<std::size_t>(j)].id == order[static_cast<std::size_t>(j)]);
      }
    }
  }
}

TEST_CASE("score_head: masked classes (-inf bias) have probability 0, large logits lose nothing", "[head_scores]") {
  const Index N = 3, d = 12, V = 200;
  const RowMatrix<double> h = random_matrix<double>(N, d, 9);
  const RowMatrix<double> W = random_matrix<double>(V, d, 10);
  RowMatrix<double> bias = RowMatrix<double>::Zero(V, 1);
  for (Index j = 0; j < V; j += 3) bias(j, 0) = -std::numeric_limits<double>::infinity();
  HeadScoreOptions options;
  options.entropy = true;
  options.top_k = 4;
  options.vocab_block = 32;
  IdMatrix<std::int64_t> tokens(N, 1);
  tokens << 1, 2, 4;
  check_against_reference(h, W, bias, tokens, options);
  const HeadScores got = embedhead::score_head<double>(h, W, bias, tokens, options);
  for (Index n = 0; n < N; ++n)
    for (Index j = 0; j < 4; ++j) CHECK(got.top_ids(n, j) % 3 != 0);
  // A masked token's log-prob is -inf.
  tokens(0, 0) = 3;
  CHECK(embedhead::score_head<double>(h, W, bias, tokens, options).raw_logprob[0] ==
        -std::numeric_limits<double>::infinity());
  // Logits around 1e4 (a shift that cancels in the entropy only if it is computed shifted).
  const RowMatrix<double> big_bias = RowMatrix<double>::Constant(V, 1, 1e4) + random_matrix<double>(V, 1, 11);
  tokens(0, 0) = 1;
  check_against_reference(h, W, big_bias, tokens, options);
}

TEMPLATE_TEST_CASE("score_head: a padded vocabulary scores classes [0, valid_vocab) only", "[head_scores]", float,
                   double) {
  using Scalar = TestType;
  const Index N = 5, d = 10, V = 130;
  const RowMatrix<Scalar> h = random_matrix<Scalar>(N, d, 12), W = random_matrix<Scalar>(V, d, 13);
  const RowMatrix<Scalar> bias = random_matrix<Scalar>(V, 1, 14);
  HeadScoreOptions options;
  options.valid_vocab = 100;
  options.top_k = 100;
  options.entropy = true;
  check_against_reference(h, W, bias, random_ids<std::int64_t>(N, 1, 100, 15), options);
  // Equal to scoring the first 100 rows of W.
  HeadScoreOptions plain = options;
  plain.valid_vocab = -1;
  const IdMatrix<std::int64_t> tokens = random_ids<std::int64_t>(N, 1, 100, 15);
  const HeadScores padded = embedhead::score_head<Scalar>(h, W, bias, tokens, options);
  const HeadScores cut = embedhead::score_head<Scalar>(h, W.topRows(100), bias.topRows(100), tokens, plain);
  CHECK(same_bytes(padded.processed_logprob, cut.processed_logprob));
  CHECK(same_bytes(padded.entropy, cut.entropy));
}

TEMPLATE_TEST_CASE("score_head: a token's scores are the same bits in any batch and equal the fused loss's",
                   "[head_scores][batch_invariance]", float, double) {
  using Scalar = TestType;
  if (!std::is_same_v<embedhead::detail::gemm::DefaultBackend, embedhead::detail::gemm::PackedBackend>) return;
  const Index total = 300, d = 300, V = 1500;
  const RowMatrix<Scalar> h = random_matrix<Scalar>(total, d, 16);
  const RowMatrix<Scalar> W = random_matrix<Scalar>(V, d, 17, 0.1);
  const RowMatrix<Scalar> bias = random_matrix<Scalar>(V, 1, 18);
  const IdMatrix<std::int64_t> tokens = random_ids<std::int64_t>(total, 1, V, 19);
  HeadScoreOptions options;
  options.top_k = 4;
  options.entropy = true;
  const HeadScores whole = embedhead::score_head<Scalar>(h, W, bias, tokens, options);
  for (const Index N : {Index{1}, Index{2}, Index{7}, Index{8}, Index{9}, Index{64}})
    for (const Index o : {Index{0}, Index{5}, total - N}) {
      CAPTURE(N, o);
      const HeadScores part = embedhead::score_head<Scalar>(h.middleRows(o, N), W, bias, tokens.middleRows(o, N),
                                                            options);
      for (Index n = 0; n < N; ++n) {
        const std::size_t i = static_cast<std::size_t>(n), w = static_cast<std::size_t>(o + n);
        CHECK(std::memcmp(&part.processed_logprob[i], &whole.processed_logprob[w], sizeof(double)) == 0);
        CHECK(std::memcmp(&part.entropy[i], &whole.entropy[w], sizeof(double)) == 0);
        for (Index j = 0; j < 4; ++j) {
          CHECK(part.top_ids(n, j) == whole.top_ids(o + n, j));
          CHECK(std::memcmp(&part.top_logprobs(n, j), &whole.top_logprobs(o + n, j), sizeof(double)) == 0);
        }
      }
    }
  // -logprob is the fused loss's per-token loss, bit for bit (the same logits, blocks and statistics).
  for (const double cap : {0.0, 30.0}) {
    embedhead::FusedHeadLossOptions loss_options;
    loss_options.reduction = embedhead::Reduction::none;
    loss_options.softcap = cap;
    RowMatrix<Scalar> losses(total, 1);
    embedhead::FusedHeadLossWorkspace<Scalar> workspace;
    embedhead::FusedHeadLossExtras<Scalar> extras{{nullptr, 0, 1}, {nullptr, 0, 1}, {losses.data(), total, 1}};
    embedhead::fused_head_loss<Scalar>(h, W, bias, tokens, workspace, loss_options, extras);
    HeadScoreOptions score_options;
    score_options.softcap = cap;
    const HeadScores scores = embedhead::score_head<Scalar>(h, W, bias, tokens, score_options);
    for (Index n = 0; n < total; ++n)
      CHECK(static_cast<Scalar>(-scores.processed_logprob[static_cast<std::size_t>(n)]) == losses(n, 0));
  }
}

TEST_CASE("score_head: bad input throws naming the value and the range", "[head_scores][errors]") {
  const RowMatrix<float> h = random_matrix<float>(3, 8, 20), W = random_matrix<float>(50, 8, 21);
  const RowMatrix<float> bias = random_matrix<float>(50, 1, 22), none(0, 1);
  IdMatrix<std::int64_t> tokens(3, 1);
  tokens << 0, 49, 7;
  using embedhead::index_error;
  using embedhead::shape_error;
  using embedhead::value_error;
  const auto with = [](auto set) {
    HeadScoreOptions o;
    set(o);
    return o;
  };
  REQUIRE_THROWS_MATCHES(embedhead::score_head<float>(h, W.leftCols(7), bias, tokens), shape_error,
                         Catch::Message("score_head: W has shape [50, 7], expected [50, 8]"));
  REQUIRE_THROWS_MATCHES(embedhead::score_head<float>(h, W, bias.topRows(49), tokens), shape_error,
                         Catch::Message("score_head: bias has shape [49, 1], expected [50, 1]"));
  REQUIRE_THROWS_MATCHES(embedhead::score_head<float>(h, W, bias, tokens.topRows(2)), shape_error,
                         Catch::Message("score_head: tokens has 2 ids (2 x 1), expected N = 3 (or none)"));
  tokens(2, 0) = 50;
  REQUIRE_THROWS_MATCHES(embedhead::score_head<float>(h, W, bias, tokens), index_error,
                         Catch::Message("score_head: token 50 at (b=2, t=0) outside [0, 50)"));
  tokens(2, 0) = 45;
  REQUIRE_THROWS_MATCHES(embedhead::score_head<float>(h, W, bias, tokens,
                                                      with([](HeadScoreOptions& o) { o.valid_vocab = 40; })),
                         index_error, Catch::Message("score_head: token 49 at (b=1, t=0) outside [0, 40)"));
  REQUIRE_THROWS_MATCHES(embedhead::score_head<float>(h, W, bias, tokens,
                                                      with([](HeadScoreOptions& o) { o.valid_vocab = 51; })),
                         value_error, Catch::Message("score_head: valid_vocab = 51 outside [1, V = 50] (or -1: all)"));
  REQUIRE_THROWS_MATCHES(embedhead::score_head<float>(h, W, bias, tokens,
                                                      with([](HeadScoreOptions& o) { o.temperature = 0; })),
                         value_error, Catch::Message("score_head: temperature = 0 outside (0, inf)"));
  REQUIRE_THROWS_WITH(embedhead::score_head<float>(h, W, bias, tokens, with([](HeadScoreOptions& o) {
                                                     o.temperature = std::numeric_limits<double>::quiet_NaN();
                                                   })),
                      Contains("temperature = nan outside (0, inf)"));
  REQUIRE_THROWS_WITH(embedhead::score_head<float>(h, W, bias, tokens,
                                                   with([](HeadScoreOptions& o) { o.temperature = 1e-60; })),
                      Contains("temperature (as the Scalar type) = 0 outside (0, inf)"));
  REQUIRE_THROWS_MATCHES(embedhead::score_head<float>(h, W, bias, tokens,
                                                      with([](HeadScoreOptions& o) { o.top_k = 51; })),
                         value_error, Catch::Message("score_head: top_k = 51 outside [0, classes = 50]"));
  REQUIRE_THROWS_MATCHES(embedhead::score_head<float>(h, W, bias, tokens,
                                                      with([](HeadScoreOptions& o) { o.top_k = -1; })),
                         value_error, Catch::Message("score_head: top_k = -1 outside [0, classes = 50]"));
  REQUIRE_THROWS_MATCHES(embedhead::score_head<float>(h, W, bias, tokens,
                                                      with([](HeadScoreOptions& o) { o.softcap = -1; })),
                         value_error, Catch::Message("score_head: softcap = -1 outside [0, inf)"));
  REQUIRE_THROWS_MATCHES(embedhead::score_head<float>(h, W, bias, tokens,
                                                      with([](HeadScoreOptions& o) { o.vocab_block = -2; })),
                         value_error, Catch::Message("score_head: vocab_block = -2 outside [0, inf)"));
  RowMatrix<float> bad = h;
  bad(1, 3) = std::numeric_limits<float>::quiet_NaN();
  REQUIRE_THROWS_MATCHES(embedhead::score_head<float>(bad, W, bias, tokens), value_error,
                         Catch::Message("score_head: row n=1 has log-sum-exp nan (not finite: a NaN or infinite logit "
                                        "from non-finite h, W or bias, or every class -inf)"));
  RowMatrix<float> masked = RowMatrix<float>::Constant(50, 1, -std::numeric_limits<float>::infinity());
  REQUIRE_THROWS_WITH(embedhead::score_head<float>(h, W, masked, tokens), Contains("row n=0 has log-sum-exp -inf"));
  // A valid call after all that.
  CHECK(embedhead::score_head<float>(h, W, none, tokens).processed_logprob.size() == 3);
}
