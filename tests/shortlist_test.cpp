// Tests for include/embedhead/shortlist.hpp: the shortlist's logits are the full head's columns at
// the original ids (bit for bit on the default backend), its scores are a softmax over the
// shortlisted classes computed here in long double, every id that goes in or out is an original
// one (tokens, top-k), and bad ids are errors naming the position and value.
#include <embedhead/head_scores.hpp>
#include <embedhead/shortlist.hpp>

#include "reference/test_support.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::RowMatrix;
using embedhead::VocabShortlist;
using test_support::random_matrix;

TEMPLATE_TEST_CASE("shortlist: logits are the full head's columns at the original ids", "[shortlist]", float, double) {
  using Scalar = TestType;
  const Index V = 500, d = 300, N = 12;
  const RowMatrix<Scalar> W = random_matrix<Scalar>(V, d, 1, 0.1), bias = random_matrix<Scalar>(V, 1, 2);
  const RowMatrix<Scalar> h = random_matrix<Scalar>(N, d, 3);
  IdMatrix<std::int32_t> ids(1, 7);
  ids << 0, 3, 17, 18, 250, 256, 499;
  const VocabShortlist<Scalar> shortlist(W, bias, ids);
  CHECK(shortlist.size() == 7);
  CHECK(shortlist.full_vocab() == V);
  CHECK(shortlist.original_id(4) == 250);
  CHECK(shortlist.index_of(256) == 5);
  CHECK(shortlist.contains(499));
  CHECK_FALSE(shortlist.contains(1));
  RowMatrix<Scalar> full(N, V);
  embedhead::output_projection_forward<Scalar>(h, W, bias, full);
  for (const Index n_tokens : {Index{1}, Index{8}, Index{12}}) {
    const RowMatrix<Scalar> logits = shortlist.forward(h.topRows(n_tokens));
    for (Index n = 0; n < n_tokens; ++n)
      for (Index j = 0; j < 7; ++j) {
        const Index v = ids(0, j);
        if (std::is_same_v<embedhead::detail::gemm::DefaultBackend, embedhead::detail::gemm::PackedBackend>)
          CHECK(logits(n, j) == full(n, v));
        else
          CHECK(logits(n, j) == Approx(full(n, v)).epsilon(1e-5).margin(1e-6));
      }
    // to_full puts each column at its id and -inf elsewhere.
    const RowMatrix<Scalar> back = shortlist.to_full(logits);
    CHECK(back(0, 250) == logits(0, 4));
    CHECK(back(0, 1) == -std::numeric_limits<Scalar>::infinity());
  }
}

TEST_CASE("shortlist: scores are a softmax over the shortlist, in original ids", "[shortlist]") {
  const Index V = 300, d = 16, N = 5;
  const RowMatrix<double> W = random_matrix<double>(V, d, 4), bias = random_matrix<double>(V, 1, 5);
  const RowMatrix<double> h = random_matrix<double>(N, d, 6);
  std::vector<std::int64_t> chosen;
  for (std::int64_t v = 7; v < V; v += 13) chosen.push_back(v);
  const IdMatrix<std::int64_t> ids = Eigen::Map<const IdMatrix<std::int64_t>>(chosen.data(), 1, chosen.size());
  const VocabShortlist<double> shortlist(W, bias, ids);
  IdMatrix<std::int64_t> tokens(N, 1);
  tokens << 7, 20, 293, 46, 7;
  embedhead::HeadScoreOptions options;
  options.top_k = 3;
  options.entropy = true;
  const embedhead::HeadScores scores = shortlist.score(h, tokens, options);
  for (Index n = 0; n < N; ++n) {
    // Reference: softmax over the shortlisted classes only, in long double.
    std::vector<std::pair<long double, std::int64_t>> z;
    long double m = -INFINITY;
    for (const std::int64_t v : chosen) {
      long double s = bias(v, 0);
      for (Index k = 0; k < d; ++k) s += static_cast<long double>(h(n, k)) * W(v, k);
      z.push_back({s, v});
      m = std::max(m, s);
    }
    long double sum = 0;
    for (const auto& [s, v] : z) sum += std::exp(s - m);
    const long double lse = m + std::log(sum);
    long double target = 0;
    for (const auto& [s, v] : z)
      if (v == tokens(n, 0)) target = s;
    CHECK(scores.processed_logprob[static_cast<std::size_t>(n)] ==
          Approx(static_cast<double>(target - lse)).epsilon(1e-12));
    std::stable_sort(z.begin(), z.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    for (Index j = 0; j < 3; ++j) {
      CHECK(scores.top_ids(n, j) == z[static_cast<std::size_t>(j)].second);  // an original id
      CHECK(shortlist.contains(scores.top_ids(n, j)));
    }
  }
  // A token outside the shortlist is an error naming it, in original ids.
  tokens(3, 0) = 8;
  REQUIRE_THROWS_MATCHES(shortlist.score(h, tokens, options), embedhead::index_error,
                         Catch::Message("VocabShortlist::score: token 8 at (b=3, t=0) is not in the shortlist of 23 "
                                        "ids"));
}

TEST_CASE("shortlist: bad ids throw naming the position and value", "[shortlist][errors]") {
  const RowMatrix<float> W = random_matrix<float>(10, 4, 7), bias = random_matrix<float>(10, 1, 8);
  const auto make = [&](std::vector<std::int64_t> v) {
    const IdMatrix<std::int64_t> ids = Eigen::Map<const IdMatrix<std::int64_t>>(v.data(), 1, v.size());
    return VocabShortlist<float>(W, bias, ids);
  };
  REQUIRE_THROWS_MATCHES(make({}), embedhead::value_error,
                         Catch::Message("VocabShortlist: ids is empty (a shortlist needs at least one id)"));
  REQUIRE_THROWS_MATCHES(make({1, 3, 3}), embedhead::index_error,
                         Catch::Message("VocabShortlist: id 3 at position 2 outside [4, 10) (ids must be strictly "
                                        "increasing ids of the vocabulary [0, 10))"));
  REQUIRE_THROWS_MATCHES(make({2, 10}), embedhead::index_error,
                         Catch::Message("VocabShortlist: id 10 at position 1 outside [3, 10) (ids must be strictly "
                                        "increasing ids of the vocabulary [0, 10))"));
  REQUIRE_THROWS_MATCHES(make({-1}), embedhead::index_error,
                         Catch::Message("VocabShortlist: id -1 at position 0 outside [0, 10) (ids must be strictly "
                                        "increasing ids of the vocabulary [0, 10))"));
  const VocabShortlist<float> ok = make({2, 5});
  REQUIRE_THROWS_MATCHES(ok.index_of(3), embedhead::index_error,
                         Catch::Message("VocabShortlist::index_of: id 3 is not in the shortlist of 2 ids"));
  REQUIRE_THROWS_MATCHES(ok.original_id(2), embedhead::index_error,
                         Catch::Message("VocabShortlist::original_id: column 2 outside [0, 2)"));
  RowMatrix<float> out(1, 3);
  REQUIRE_THROWS_AS(ok.forward(random_matrix<float>(1, 4, 9), out), embedhead::shape_error);
  embedhead::HeadScoreOptions padded;
  padded.valid_vocab = 1;
  REQUIRE_THROWS_MATCHES(ok.score(random_matrix<float>(1, 4, 9), IdMatrix<std::int64_t>(0, 1), padded),
                         embedhead::value_error,
                         Catch::Message("VocabShortlist::score: valid_vocab = 1 must be -1 (the shortlist is the "
                                        "classes)"));
}

// The chain over a shortlist, step by step and chained: process() with options in original ids
// must give, at each shortlisted id, what the full-vocabulary chain gives on a row where every id
// outside the shortlist is -inf (the definition at the top of shortlist.hpp), with ids of the
// options and the history both inside and outside the shortlist. A few steps are also checked
// against values written out here from HF's definitions.
TEST_CASE("shortlist: every sampling step works in original ids", "[shortlist][sampling]") {
  using embedhead::SamplingOptions;
  using embedhead::SamplingStep;
  using embedhead::TokenIds;
  const Index V = 200, d = 8, N = 3;
  const RowMatrix<double> W = random_matrix<double>(V, d, 21), h = random_matrix<double>(N, d, 22);
  std::vector<std::int64_t> chosen;
  for (std::int64_t v = 3; v < V; v += 5) chosen.push_back(v);  // 40 ids: 3, 8, ..., 198
  const Index k = static_cast<Index>(chosen.size());
  const IdMatrix<std::int64_t> ids = Eigen::Map<const IdMatrix<std::int64_t>>(chosen.data(), 1, k);
  const VocabShortlist<double> shortlist(W, RowMatrix<double>(0, 1), ids);
  RowMatrix<double> logits = 3 * shortlist.forward(h);
  logits(0, 2) = -logits(0, 2) - 1;  // some negative logits among the penalised ids
  logits(1, 4) = -std::abs(logits(1, 4)) - 0.5;
  const RowMatrix<double> full = shortlist.to_full(logits);

  // Histories in original ids: shortlisted ids (13 = column 2, 23 = column 4, 8 twice) and others.
  std::vector<IdMatrix<std::int64_t>> seen;
  for (Index n = 0; n < N; ++n) {
    IdMatrix<std::int64_t> row(1, 6);
    row << 13, 23, 8, 8, 50 + n, 199;
    seen.push_back(row);
  }
  const std::vector<TokenIds> history(seen.begin(), seen.end());

  std::vector<std::pair<const char*, SamplingOptions>> cases;
  const auto add = [&](const char* name, const auto& set) {
    SamplingOptions o;
    set(o);
    cases.push_back({name, o});
  };
  add("logit_bias", [](SamplingOptions& o) { o.logit_bias = {{8, 2.5}, {9, 100.0}, {198, -1.0}}; });
  add("repetition_penalty", [](SamplingOptions& o) { o.repetition_penalty = 1.7; });
  add("frequency_presence_penalty", [](SamplingOptions& o) {
    o.frequency_penalty = 0.4;
    o.presence_penalty = -0.3;
  });
  add("banned_ids", [](SamplingOptions& o) { o.banned_ids = {8, 10, 103}; });
  add("allowed_ids", [](SamplingOptions& o) { o.allowed_ids = std::vector<Index>{0, 3, 13, 14, 98, 199}; });
  add("temperature", [](SamplingOptions& o) { o.temperature = 0.6; });
  add("top_k", [](SamplingOptions& o) { o.top_k = 7; });
  add("top_p", [](SamplingOptions& o) { o.top_p = 0.8; });
  add("min_p", [](SamplingOptions& o) { o.min_p = 0.05; });
  add("typical_p", [](SamplingOptions& o) { o.typical_p = 0.7; });
  add("chained", [](SamplingOptions& o) {
    o.logit_bias = {{8, 1.5}, {9, 100.0}};
    o.repetition_penalty = 1.3;
    o.frequency_penalty = 0.2;
    o.banned_ids = {18, 11};
    o.temperature = 0.9;
    o.top_k = 20;
    o.top_p = 0.95;
    o.min_p = 0.01;
    o.typical_p = 0.99;
  });
  for (const auto& [name, options] : cases) {
    INFO("step: " << name);
    RowMatrix<double> local(N, k), reference(V, V);
    reference.resize(N, V);
    shortlist.process(logits, options, history, local);
    embedhead::process_logits<double>(full, options, history, reference);
    for (Index n = 0; n < N; ++n)
      for (Index j = 0; j < k; ++j) {
        const double expected = reference(n, chosen[static_cast<std::size_t>(j)]);
        if (std::isinf(expected)) {
          CHECK(local(n, j) == expected);
        } else {
          CHECK(local(n, j) == Approx(expected).epsilon(1e-14).margin(1e-14));
        }
      }
    // A draw returns an original id of the shortlist that survived the chain, with its processed
    // log-prob: the processed logit minus the log-sum-exp of the processed row.
    const embedhead::SampledTokens drawn = shortlist.sample(logits, options, history, embedhead::Rng(5), {0, 1, 2});
    for (Index n = 0; n < N; ++n) {
      const Index token = drawn.tokens[static_cast<std::size_t>(n)];
      REQUIRE(shortlist.contains(token));
      const Index j = shortlist.index_of(token);
      REQUIRE(std::isfinite(local(n, j)));
      long double sum = 0;
      for (Index c = 0; c < k; ++c)
        if (std::isfinite(local(n, c))) sum += std::exp(static_cast<long double>(local(n, c)));
      CHECK(drawn.processed_log_probs[static_cast<std::size_t>(n)] ==
            Approx(static_cast<double>(local(n, j) - std::log(sum))).epsilon(1e-12));
    }
  }

  // Written out from HF's definitions, at shortlisted columns: the repetition penalty divides the
  // positive and multiplies the negative logits of the ids seen (13 -> column 2, 23 -> column 4,
  // 8 -> column 1), whatever the ids outside the shortlist in the history.
  RowMatrix<double> local(N, k);
  SamplingOptions rp;
  rp.repetition_penalty = 2.0;
  shortlist.process(logits, rp, history, local);
  for (Index n = 0; n < N; ++n)
    for (Index j = 0; j < k; ++j) {
      const bool penalised = j == 1 || j == 2 || j == 4;
      const double z = logits(n, j);
      CHECK(local(n, j) == (penalised ? (z > 0 ? z / 2 : z * 2) : z));
    }
  CHECK(logits(0, 2) < 0);  // the negative case is exercised
  // The bias of id 8 lands on column 1; the bias of id 9 (not shortlisted) nowhere.
  SamplingOptions bias;
  bias.logit_bias = {{8, 2.5}, {9, 100.0}};
  shortlist.process(logits, bias, {}, local);
  for (Index n = 0; n < N; ++n)
    for (Index j = 0; j < k; ++j) CHECK(local(n, j) == logits(n, j) + (j == 1 ? 2.5 : 0.0));
  // Greedy returns original ids.
  const embedhead::SampledTokens best = shortlist.greedy(logits);
  for (Index n = 0; n < N; ++n) {
    Index argmax = 0;
    for (Index j = 1; j < k; ++j)
      if (logits(n, j) > logits(n, argmax)) argmax = j;
    CHECK(best.tokens[static_cast<std::size_t>(n)] == chosen[static_cast<std::size_t>(argmax)]);
  }
}

TEST_CASE("shortlist: sampling errors name original ids and change nothing", "[shortlist][sampling][errors]") {
  using embedhead::SamplingOptions;
  const RowMatrix<float> W = random_matrix<float>(10, 4, 31);
  std::vector<std::int64_t> chosen{1, 4, 6};
  const IdMatrix<std::int64_t> ids = Eigen::Map<const IdMatrix<std::int64_t>>(chosen.data(), 1, 3);
  const VocabShortlist<float> shortlist(W, RowMatrix<float>(0, 1), ids);
  const RowMatrix<float> logits = shortlist.forward(random_matrix<float>(2, 4, 32));
  RowMatrix<float> out = RowMatrix<float>::Constant(2, 3, 7.0f);
  SamplingOptions banned;
  banned.banned_ids = {4, 10};
  REQUIRE_THROWS_MATCHES(shortlist.process(logits, banned, {}, out), embedhead::index_error,
                         Catch::Message("VocabShortlist::process: banned id 10 at 1 outside [0, 10)"));
  SamplingOptions bias;
  bias.logit_bias = {{-1, 1.0}};
  REQUIRE_THROWS_MATCHES(shortlist.sample(logits, bias, {}, embedhead::Rng(1), {0, 1}), embedhead::index_error,
                         Catch::Message("VocabShortlist::sample: logit_bias id -1 at 0 outside [0, 10)"));
  IdMatrix<std::int64_t> h0(1, 2), h1(1, 2);
  h0 << 1, 2;
  h1 << 3, 12;
  const std::vector<embedhead::TokenIds> history{h0, h1};
  REQUIRE_THROWS_MATCHES(shortlist.process(logits, SamplingOptions{}, history, out), embedhead::index_error,
                         Catch::Message("VocabShortlist::process: history id 12 at (row 1, 1) outside [0, 10)"));
  SamplingOptions top;
  top.top_k = 4;  // more than the 3 shortlisted classes
  REQUIRE_THROWS_MATCHES(shortlist.process(logits, top, {}, out), embedhead::value_error,
                         Catch::Message("VocabShortlist::process: top_k = 4 outside [1, 3]"));
  SamplingOptions none;
  none.allowed_ids = std::vector<embedhead::Index>{0, 2};  // none shortlisted: every class masked
  REQUIRE_THROWS_MATCHES(shortlist.process(logits, none, {}, out), embedhead::value_error,
                         Catch::Message("process_logits: the masks (banned_ids, allowed_ids) remove every token of "
                                        "row 0: nothing to sample from"));
  REQUIRE_THROWS_AS(shortlist.process(logits.leftCols(2), SamplingOptions{}, {}, out.leftCols(2)),
                    embedhead::shape_error);
  CHECK((out.array() == 7.0f).all());  // nothing written
}
