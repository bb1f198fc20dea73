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
