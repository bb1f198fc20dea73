// Tests for include/embedhead/sampling.hpp: each step of the chain alone and chained (HF's order
// and another) against a naive double reference written here from the published definitions
// (Hugging Face's processors and warpers, in their "remove" form with full sorts, which the
// library never uses), worked examples with negative logits, masked entries and ties, raw and
// processed log-probs, greedy ties, chi-square tests of 10^6 draws for the sampler and for
// verify_draft, the draw's independence of its row and batch, and every error with its message
// and the inputs unchanged. The library has no threading in sampling.hpp, so there is no thread
// count to compare.
#include <embedhead/sampling.hpp>

#include "reference/test_support.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

using Catch::Contains;
using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::RowMatrix;
using embedhead::SamplingOptions;
using embedhead::SamplingStep;
using embedhead::TokenIds;
using test_support::random_matrix;
using test_support::same_values;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// ---------------------------------------------------------------------------------------------
// The naive reference: one row as std::vector<double>, every step from its definition.
// ---------------------------------------------------------------------------------------------
std::vector<double> ref_softmax(const std::vector<double>& z) {
  double m = -kInf;
  for (const double v : z) m = std::max(m, v);
  std::vector<double> p(z.size());
  double S = 0;
  for (std::size_t j = 0; j < z.size(); ++j) S += p[j] = std::exp(z[j] - m);
  for (double& v : p) v /= S;
  return p;
}

std::vector<double> ref_log_softmax(const std::vector<double>& z) {
  double m = -kInf;
  for (const double v : z) m = std::max(m, v);
  double S = 0;
  for (const double v : z) S += std::exp(v - m);
  std::vector<double> out(z.size());
  for (std::size_t j = 0; j < z.size(); ++j) out[j] = z[j] - m - std::log(S);
  return out;
}

// Ids sorted by value descending, ties by id ascending (full sort: the reference may).
std::vector<std::size_t> order_desc(const std::vector<double>& z) {
  std::vector<std::size_t> idx(z.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::sort(idx.begin(), idx.end(),
            [&](std::size_t a, std::size_t b) { return z[a] > z[b] || (z[a] == z[b] && a < b); });
  return idx;
}

void ref_step(std::vector<double>& z, SamplingStep step, const SamplingOptions& o, const std::vector<Index>& hist) {
  const std::size_t V = z.size();
  const std::size_t keep = static_cast<std::size_t>(o.min_tokens_to_keep);
  switch (step) {
    case SamplingStep::logit_bias:
      for (const auto& b : o.logit_bias) z[static_cast<std::size_t>(b.first)] += b.second;
      break;
    case SamplingStep::repetition_penalty: {
      // HF: score = gather(scores, input_ids); where(score < 0, score * penalty, score / penalty);
      // scatter back: each distinct id once.
      const std::set<Index> seen(hist.begin(), hist.end());
      for (const Index id : seen) {
        double& v = z[static_cast<std::size_t>(id)];
        v = v < 0 ? v * o.repetition_penalty : v / o.repetition_penalty;
      }
      break;
    }
    case SamplingStep::frequency_presence_penalty: {
      std::map<Index, int> count;
      for (const Index id : hist) ++count[id];
      for (const auto& [id, c] : count)
        z[static_cast<std::size_t>(id)] -= o.frequency_penalty * c + o.presence_penalty * (c > 0 ? 1 : 0);
      break;
    }
    case SamplingStep::banned_ids:
      for (const Index id : o.banned_ids) z[static_cast<std::size_t>(id)] = -kInf;
      break;
    case SamplingStep::allowed_ids: {
      const std::set<Index> allowed(o.allowed_ids->begin(), o.allowed_ids->end());
      for (std::size_t j = 0; j < V; ++j)
        if (!allowed.count(static_cast<Index>(j))) z[j] = -kInf;
      break;
    }
    case SamplingStep::temperature:
      for (double& v : z) v /= o.temperature;
      break;
    case SamplingStep::top_k: {
      // HF: top_k = max(top_k, min_tokens_to_keep); remove scores < the k-th of topk.
      const std::size_t k = std::min(V, std::max(static_cast<std::size_t>(*o.top_k), keep));
      std::vector<double> sorted = z;
      std::sort(sorted.begin(), sorted.end(), std::greater<double>());
      const double kth = sorted[k - 1];
      for (double& v : z)
        if (v < kth) v = -kInf;
      break;
    }
    case SamplingStep::top_p: {
      if (*o.top_p >= 1.0) break;
      // HF: sort ascending, cumulative softmax, remove cum <= 1 - top_p, keep the last
      // min_tokens_to_keep. Ascending here = the reverse of (value desc, id asc).
      const std::vector<double> p = ref_softmax(z);
      std::vector<std::size_t> asc = order_desc(z);
      std::reverse(asc.begin(), asc.end());
      double cum = 0;
      std::vector<bool> remove(V, false);
      for (std::size_t r = 0; r < V; ++r) {
        cum += p[asc[r]];
        remove[r] = cum <= 1.0 - *o.top_p;
      }
      for (std::size_t r = V - std::min(keep, V); r < V; ++r) remove[r] = false;
      for (std::size_t r = 0; r < V; ++r)
        if (remove[r]) z[asc[r]] = -kInf;
      break;
    }
    case SamplingStep::min_p: {
      const std::vector<double> p = ref_softmax(z);
      const double top = *std::max_element(p.begin(), p.end());
      std::vector<bool> remove(V);
      for (std::size_t j = 0; j < V; ++j) remove[j] = p[j] < *o.min_p * top;
      const std::vector<std::size_t> desc = order_desc(z);
      for (std::size_t r = 0; r < std::min(keep, V); ++r) remove[desc[r]] = false;
      for (std::size_t j = 0; j < V; ++j)
        if (remove[j]) z[j] = -kInf;
      break;
    }
    case SamplingStep::typical_p: {
      if (*o.typical_p >= 1.0) break;
      // HF's TypicalLogitsWarper, line by line.
      const std::vector<double> lp = ref_log_softmax(z);
      double ent = 0;
      for (std::size_t j = 0; j < V; ++j) {
        const double t = lp[j] * std::exp(lp[j]);
        if (!std::isnan(t)) ent -= t;  // nansum
      }
      std::vector<double> shifted(V);
      for (std::size_t j = 0; j < V; ++j) shifted[j] = std::fabs(-lp[j] - ent);
      std::vector<std::size_t> idx(V);
      std::iota(idx.begin(), idx.end(), 0);
      std::sort(idx.begin(), idx.end(), [&](std::size_t a, std::size_t b) {
        return shifted[a] < shifted[b] || (shifted[a] == shifted[b] && a < b);
      });
      const std::vector<double> p = ref_softmax(z);
      double cum = 0;
      std::size_t last = 0;
      for (std::size_t r = 0; r < V; ++r) {
        cum += p[idx[r]];
        if (cum < *o.typical_p) ++last;
      }
      last = std::min(last, V - 1);
      const double cut = shifted[idx[last]];
      for (std::size_t r = 0; r < V; ++r)
        if (r >= keep && shifted[idx[r]] > cut) z[idx[r]] = -kInf;
      break;
    }
  }
}

bool ref_active(const SamplingOptions& o, SamplingStep s) {
  switch (s) {
    case SamplingStep::logit_bias: return !o.logit_bias.empty();
    case SamplingStep::repetition_penalty: return o.repetition_penalty != 1.0;
    case SamplingStep::frequency_presence_penalty: return o.frequency_penalty != 0 || o.presence_penalty != 0;
    case SamplingStep::banned_ids: return !o.banned_ids.empty();
    case SamplingStep::allowed_ids: return o.allowed_ids.has_value();
    case SamplingStep::temperature: return o.temperature != 1.0;
    case SamplingStep::top_k: return o.top_k.has_value();
    case SamplingStep::top_p: return o.top_p.has_value();
    case SamplingStep::min_p: return o.min_p.has_value();
    case SamplingStep::typical_p: return o.typical_p.has_value();
  }
  return false;
}

std::vector<double> ref_chain(std::vector<double> z, const SamplingOptions& o, const std::vector<Index>& hist) {
  for (const SamplingStep s : o.order)
    if (ref_active(o, s)) ref_step(z, s, o, hist);
  return z;
}

template <typename S>
std::vector<double> row_of(const RowMatrix<S>& m, Index r) {
  std::vector<double> z(static_cast<std::size_t>(m.cols()));
  for (Index j = 0; j < m.cols(); ++j) z[static_cast<std::size_t>(j)] = static_cast<double>(m(r, j));
  return z;
}

// Random logits [N, V] in [-4, 4), with masked entries (-inf) and ties (a few columns copied).
template <typename S>
RowMatrix<S> test_logits(Index N, Index V, std::uint64_t seed) {
  RowMatrix<S> z = random_matrix<S>(N, V, seed, 4.0);
  std::mt19937_64 gen(seed + 1);
  for (Index n = 0; n < N; ++n) {
    for (int t = 0; t < 3; ++t)
      z(n, static_cast<Index>(gen() % static_cast<std::uint64_t>(V))) = -std::numeric_limits<S>::infinity();
    for (int t = 0; t < 3; ++t) {
      const Index a = static_cast<Index>(gen() % static_cast<std::uint64_t>(V));
      const Index b = static_cast<Index>(gen() % static_cast<std::uint64_t>(V));
      z(n, b) = z(n, a);
    }
    // The row's max, tied.
    Index arg = 0;
    for (Index j = 1; j < V; ++j)
      if (z(n, j) > z(n, arg)) arg = j;
    z(n, (arg + 7) % V) = z(n, arg);
  }
  return z;
}

// Compares process_logits<S> of every row with the reference: same removed set, values within
// the rounding of S.
template <typename S>
void check_against_reference(const RowMatrix<S>& logits, const SamplingOptions& o,
                             const std::vector<std::vector<Index>>& hist) {
  std::vector<IdMatrix<std::int64_t>> store;
  std::vector<TokenIds> views;
  for (const auto& h : hist) {
    IdMatrix<std::int64_t> m(1, static_cast<Index>(h.size()));
    for (std::size_t t = 0; t < h.size(); ++t) m(0, static_cast<Index>(t)) = h[t];
    store.push_back(m);
  }
  for (const auto& m : store) views.emplace_back(m);
  RowMatrix<S> processed(logits.rows(), logits.cols());
  embedhead::process_logits<S>(logits, o, views, processed);
  const double tol = std::is_same_v<S, float> ? 1e-6 : 1e-13;
  for (Index n = 0; n < logits.rows(); ++n) {
    const std::vector<double> expected = ref_chain(row_of(logits, n), o,
                                                   hist.empty() ? std::vector<Index>{}
                                                                : hist[static_cast<std::size_t>(n)]);
    for (Index j = 0; j < logits.cols(); ++j) {
      const double e = expected[static_cast<std::size_t>(j)], a = static_cast<double>(processed(n, j));
      INFO("row " << n << " column " << j << ": expected " << e << ", got " << a);
      if (std::isinf(e) || std::isinf(a)) {
        REQUIRE(e == a);
      } else {
        REQUIRE(std::fabs(a - e) <= tol * std::max(1.0, std::fabs(e)));
      }
    }
  }
}

// Q(a, x) = Gamma(a, x) / Gamma(a), the regularized upper incomplete gamma function: the series
// for P below x < a + 1, Lentz's continued fraction above (Numerical Recipes' gammp / gammq).
double upper_gamma_q(double a, double x) {
  const double log_prefix = -x + a * std::log(x) - std::lgamma(a);
  if (x < a + 1.0) {
    double term = 1.0 / a, sum = term;
    for (int n = 1; n < 1000 && std::fabs(term) > 1e-17 * std::fabs(sum); ++n) sum += term *= x / (a + n);
    return 1.0 - sum * std::exp(log_prefix);
  }
  const double tiny = 1e-300;
  double b = x + 1.0 - a, c = 1.0 / tiny, d = 1.0 / b, h = d;
  for (int i = 1; i < 1000; ++i) {
    const double an = -i * (i - a);
    b += 2.0;
    d = an * d + b;
    if (std::fabs(d) < tiny) d = tiny;
    c = b + an / c;
    if (std::fabs(c) < tiny) c = tiny;
    d = 1.0 / d;
    const double delta = d * c;
    h *= delta;
    if (std::fabs(delta - 1.0) < 1e-16) break;
  }
  return std::exp(log_prefix) * h;
}

// The upper alpha critical value of chi-square with df degrees of freedom: the x with
// Q(df / 2, x / 2) = alpha, by bisection (df = 2 gives -2 ln(alpha) exactly: checked below).
double chi_square_critical(int df, double alpha) {
  double lo = 0.0, hi = 10.0 * df + 100.0;
  for (int i = 0; i < 200; ++i) {
    const double mid = 0.5 * (lo + hi);
    (upper_gamma_q(0.5 * df, 0.5 * mid) > alpha ? lo : hi) = mid;
  }
  return 0.5 * (lo + hi);
}

double chi_square_critical_1e4(int df) { return chi_square_critical(df, 1e-4); }

// Chi-square of counts against probabilities (categories with probability 0 must have no count).
double chi_square(const std::vector<long>& counts, const std::vector<double>& prob, long total, int& df) {
  double chi = 0;
  df = -1;
  for (std::size_t j = 0; j < prob.size(); ++j) {
    if (prob[j] <= 0) {
      REQUIRE(counts[j] == 0);
      continue;
    }
    const double e = prob[j] * static_cast<double>(total);
    chi += (static_cast<double>(counts[j]) - e) * (static_cast<double>(counts[j]) - e) / e;
    ++df;
  }
  return chi;
}

}  // namespace

TEST_CASE("sampling: HF's order is the documented default", "[sampling]") {
  const std::vector<SamplingStep> expected = {SamplingStep::logit_bias,
                                              SamplingStep::repetition_penalty,
                                              SamplingStep::frequency_presence_penalty,
                                              SamplingStep::banned_ids,
                                              SamplingStep::allowed_ids,
                                              SamplingStep::temperature,
                                              SamplingStep::top_k,
                                              SamplingStep::top_p,
                                              SamplingStep::min_p,
                                              SamplingStep::typical_p};
  REQUIRE(embedhead::hf_sampling_order() == expected);
  REQUIRE(SamplingOptions().order == expected);
}

TEST_CASE("sampling: worked examples (negative logits, masked entries, ties)", "[sampling]") {
  const double ninf = -kInf;
  RowMatrix<double> z(1, 6);
  z << 2.0, -2.0, 0.5, -1.0, ninf, 0.0;
  IdMatrix<std::int32_t> hist(1, 5);
  hist << 0, 1, 1, 4, 5;
  const std::vector<TokenIds> h{TokenIds(hist)};
  RowMatrix<double> out(1, 6);

  SECTION("repetition penalty divides positive and multiplies negative logits, once per distinct id") {
    SamplingOptions o;
    o.repetition_penalty = 2.0;
    embedhead::process_logits<double>(z, o, h, out);
    RowMatrix<double> expected(1, 6);
    expected << 1.0, -4.0, 0.5, -1.0, ninf, 0.0;  // id 1 seen twice, penalised once; -inf stays
    REQUIRE(same_values(out, expected));
  }
  SECTION("frequency and presence penalties subtract f * count + presence") {
    SamplingOptions o;
    o.frequency_penalty = 0.5;
    o.presence_penalty = 0.25;
    embedhead::process_logits<double>(z, o, h, out);
    RowMatrix<double> expected(1, 6);
    expected << 2.0 - 0.75, -2.0 - 1.25, 0.5, -1.0, ninf, -0.75;
    REQUIRE(same_values(out, expected));
  }
  SECTION("logit bias, banned and allowed ids") {
    SamplingOptions o;
    o.logit_bias = {{2, 1.5}, {3, -1.0}};
    o.banned_ids = {0};
    o.allowed_ids = std::vector<Index>{0, 1, 2, 4};
    embedhead::process_logits<double>(z, o, {}, out);
    RowMatrix<double> expected(1, 6);
    expected << ninf, -2.0, 2.0, ninf, ninf, ninf;
    REQUIRE(same_values(out, expected));
  }
  SECTION("top-k keeps every token tied with the k-th value (HF's scores < kth rule)") {
    RowMatrix<double> t(1, 5);
    t << 1.0, 3.0, 3.0, 2.0, ninf;
    SamplingOptions o;
    o.top_k = 1;
    RowMatrix<double> r(1, 5);
    embedhead::process_logits<double>(t, o, {}, r);
    RowMatrix<double> expected(1, 5);
    expected << ninf, 3.0, 3.0, ninf, ninf;
    REQUIRE(same_values(r, expected));
    o.top_k = 5;  // k = V keeps everything
    embedhead::process_logits<double>(t, o, {}, r);
    REQUIRE(same_values(r, t));
  }
  SECTION("top-p keeps the smallest set whose mass reaches p; ties go to the smaller id") {
    RowMatrix<double> t(1, 4);
    t << 0.0, 0.0, 0.0, 0.0;  // 0.25 each
    SamplingOptions o;
    o.top_p = 0.5;
    RowMatrix<double> r(1, 4);
    embedhead::process_logits<double>(t, o, {}, r);
    RowMatrix<double> expected(1, 4);
    expected << 0.0, 0.0, ninf, ninf;  // 0.25 + 0.25 = 0.5 >= 0.5
    REQUIRE(same_values(r, expected));
    o.top_p = 0.51;
    embedhead::process_logits<double>(t, o, {}, r);
    expected << 0.0, 0.0, 0.0, ninf;
    REQUIRE(same_values(r, expected));
    o.top_p = 0.01;  // at least one token (min_tokens_to_keep = 1)
    embedhead::process_logits<double>(t, o, {}, r);
    expected << 0.0, ninf, ninf, ninf;
    REQUIRE(same_values(r, expected));
    o.top_p = 1.0;  // keeps everything
    embedhead::process_logits<double>(t, o, {}, r);
    REQUIRE(same_values(r, t));
  }
  SECTION("min-p: threshold min_p * max prob; min_p = 1 keeps the tied maxima") {
    RowMatrix<double> t(1, 4);
    t << std::log(0.5), std::log(0.2), std::log(0.2), std::log(0.1);
    SamplingOptions o;
    o.min_p = 0.3;  // threshold 0.15 of the probabilities 0.5, 0.2, 0.2, 0.1
    RowMatrix<double> r(1, 4);
    embedhead::process_logits<double>(t, o, {}, r);
    REQUIRE(r(0, 3) == ninf);
    REQUIRE(r(0, 0) == t(0, 0));
    REQUIRE(r(0, 1) == t(0, 1));
    REQUIRE(r(0, 2) == t(0, 2));
    RowMatrix<double> u(1, 4);
    u << 1.0, 3.0, 3.0, -1.0;
    o.min_p = 1.0;
    embedhead::process_logits<double>(u, o, {}, r);
    RowMatrix<double> expected(1, 4);
    expected << ninf, 3.0, 3.0, ninf;
    REQUIRE(same_values(r, expected));
  }
  SECTION("typical: a confident row keeps the tokens nearest the entropy, not the argmax") {
    // p = 0.7, 0.1 x 3: H = 0.940; -log p = 0.357, 2.303: |.| = 0.584 and 1.362, so the 0.7
    // token comes first; typical_p = 0.5 keeps it alone, 0.75 keeps all (the ties at 0.1 too).
    RowMatrix<double> t(1, 4);
    t << std::log(0.7), std::log(0.1), std::log(0.1), std::log(0.1);
    SamplingOptions o;
    o.typical_p = 0.5;
    RowMatrix<double> r(1, 4);
    embedhead::process_logits<double>(t, o, {}, r);
    RowMatrix<double> expected(1, 4);
    expected << t(0, 0), ninf, ninf, ninf;
    REQUIRE(same_values(r, expected));
    o.typical_p = 0.75;
    embedhead::process_logits<double>(t, o, {}, r);
    REQUIRE(same_values(r, t));
    // A flat-topped row: p = 0.3, 0.3, 0.3, 0.1: H = 1.3138; |-log p - H| = 0.110 for the 0.3s and
    // 0.989 for 0.1: typical_p = 0.5 keeps the three tied 0.3s (ties at the cut kept).
    t << std::log(0.3), std::log(0.3), std::log(0.1), std::log(0.3);
    o.typical_p = 0.5;
    embedhead::process_logits<double>(t, o, {}, r);
    expected << t(0, 0), t(0, 1), ninf, t(0, 3);
    REQUIRE(same_values(r, expected));
  }
}

TEMPLATE_TEST_CASE("sampling: in place, V = 1, and every step at once on one row", "[sampling]", float, double) {
  using S = TestType;
  // In place: processed may be logits.
  RowMatrix<S> z = test_logits<S>(3, 37, 41);
  SamplingOptions o;
  o.temperature = 0.7;
  o.top_p = 0.8;
  RowMatrix<S> expected(3, 37);
  embedhead::process_logits<S>(z, o, {}, expected);
  embedhead::process_logits<S>(z, o, {}, z);
  REQUIRE(same_values(z, expected));
  // V = 1: every step keeps the one token; the draw and greedy return it; verify_draft with k = 1.
  RowMatrix<S> one(2, 1);
  one << S(-3), S(5);
  SamplingOptions all;
  all.logit_bias = {{0, 1.0}};
  all.repetition_penalty = 1.5;
  all.frequency_penalty = 0.5;
  all.presence_penalty = 0.5;
  all.allowed_ids = std::vector<Index>{0};
  all.temperature = 0.5;
  all.top_k = 1;
  all.top_p = 0.5;
  all.min_p = 0.5;
  all.typical_p = 0.5;
  IdMatrix<std::int32_t> h(1, 2);
  h << 0, 0;
  const embedhead::SampledTokens s = embedhead::sample_tokens<S>(one, all, {TokenIds(h), TokenIds(h)},
                                                                 embedhead::Rng(3), std::uint64_t{9});
  REQUIRE(s.tokens == std::vector<Index>{0, 0});
  REQUIRE(s.processed_log_probs == std::vector<double>{0.0, 0.0});
  REQUIRE(embedhead::greedy_tokens<S>(one).tokens == std::vector<Index>{0, 0});
  RowMatrix<S> q1(1, 1), p1(2, 1);
  q1 << S(1);
  p1 << S(1), S(1);
  IdMatrix<std::int32_t> d1(1, 1);
  d1 << 0;
  const embedhead::DraftVerification v = embedhead::verify_draft<S>(d1, q1, p1, embedhead::Rng(3), 0);
  REQUIRE(v.accepted == 1);
  REQUIRE(v.tokens == std::vector<Index>{0, 0});
}

TEMPLATE_TEST_CASE("sampling: each step alone against the naive reference", "[sampling]", float, double) {
  using S = TestType;
  const Index N = 4, V = 61;
  const RowMatrix<S> logits = test_logits<S>(N, V, 11);
  std::vector<std::vector<Index>> hist(static_cast<std::size_t>(N));
  std::mt19937_64 gen(5);
  for (auto& h : hist)
    for (int t = 0; t < 25; ++t) h.push_back(static_cast<Index>(gen() % 20));  // repeats likely
  SECTION("logit_bias") {
    SamplingOptions o;
    o.logit_bias = {{0, 1.5}, {7, -2.0}, {60, 0.25}, {7, 0.5}};
    check_against_reference(logits, o, hist);
  }
  SECTION("repetition_penalty") {
    for (const double pen : {1.3, 0.7, 2.5}) {
      SamplingOptions o;
      o.repetition_penalty = pen;
      check_against_reference(logits, o, hist);
    }
  }
  SECTION("frequency_presence_penalty") {
    SamplingOptions o;
    o.frequency_penalty = 0.4;
    o.presence_penalty = -0.3;
    check_against_reference(logits, o, hist);
  }
  SECTION("banned_ids and allowed_ids") {
    SamplingOptions o;
    o.banned_ids = {1, 2, 3, 50};
    check_against_reference(logits, o, hist);
    SamplingOptions a;
    a.allowed_ids = std::vector<Index>{4, 5, 9, 12, 40, 41, 42, 59};
    check_against_reference(logits, a, hist);
  }
  SECTION("temperature") {
    for (const double T : {0.3, 1.7}) {
      SamplingOptions o;
      o.temperature = T;
      check_against_reference(logits, o, hist);
    }
  }
  SECTION("top_k") {
    for (const Index k : {Index{1}, Index{2}, Index{5}, Index{30}, Index{57}, Index{61}}) {
      SamplingOptions o;
      o.top_k = k;
      check_against_reference(logits, o, hist);
      o.min_tokens_to_keep = 3;
      check_against_reference(logits, o, hist);
    }
  }
  SECTION("top_p") {
    for (const double p : {0.05, 0.3, 0.5, 0.9, 0.99, 1.0}) {
      SamplingOptions o;
      o.top_p = p;
      check_against_reference(logits, o, hist);
      o.min_tokens_to_keep = 4;
      check_against_reference(logits, o, hist);
    }
  }
  SECTION("min_p") {
    for (const double p : {0.01, 0.1, 0.5, 1.0}) {
      SamplingOptions o;
      o.min_p = p;
      check_against_reference(logits, o, hist);
      o.min_tokens_to_keep = 5;
      check_against_reference(logits, o, hist);
    }
  }
  SECTION("typical_p") {
    for (const double p : {0.05, 0.2, 0.5, 0.9, 0.999, 1.0}) {
      SamplingOptions o;
      o.typical_p = p;
      check_against_reference(logits, o, hist);
      o.min_tokens_to_keep = 3;
      check_against_reference(logits, o, hist);
    }
  }
}

TEMPLATE_TEST_CASE("sampling: the chain in HF's order and in another order against the reference", "[sampling]", float,
                   double) {
  using S = TestType;
  const Index N = 5, V = 300;  // V > 2 * 16: the selection's halving runs
  const RowMatrix<S> logits = test_logits<S>(N, V, 21);
  std::vector<std::vector<Index>> hist(static_cast<std::size_t>(N));
  std::mt19937_64 gen(9);
  for (auto& h : hist)
    for (int t = 0; t < 40; ++t) h.push_back(static_cast<Index>(gen() % 100));
  SamplingOptions o;
  o.logit_bias = {{3, 2.0}, {150, -1.0}};
  o.repetition_penalty = 1.2;
  o.frequency_penalty = 0.1;
  o.presence_penalty = 0.2;
  o.banned_ids = {10, 11};
  o.temperature = 0.8;
  o.top_k = 200;
  o.top_p = 0.95;
  o.min_p = 0.02;
  o.typical_p = 0.9;
  check_against_reference(logits, o, hist);
  o.order = {SamplingStep::typical_p,
             SamplingStep::min_p,
             SamplingStep::top_p,
             SamplingStep::temperature,
             SamplingStep::top_k,
             SamplingStep::banned_ids,
             SamplingStep::logit_bias,
             SamplingStep::repetition_penalty,
             SamplingStep::frequency_presence_penalty};
  check_against_reference(logits, o, hist);
  // Large V: every selection path (halving alone up to 8192 candidates, buckets then halving
  // above), against the reference on a few parameter values, peaked and flat rows.
  for (const RowMatrix<S>& wide :
       {test_logits<S>(2, 5000, 33), test_logits<S>(2, 20000, 34), RowMatrix<S>(random_matrix<S>(2, 20000, 35, 0.5))}) {
    for (const double p : {0.2, 0.9, 0.999}) {
      SamplingOptions w;
      w.temperature = 1.5;
      w.top_p = p;
      check_against_reference(wide, w, {});
      SamplingOptions t;
      t.typical_p = p;
      check_against_reference(wide, t, {});
      // min_tokens_to_keep above the prefix (the selection widened by a full ranking), and near V.
      for (const Index keep : {Index{9000}, wide.cols() - 1}) {
        if (keep >= wide.cols()) continue;
        CAPTURE(keep);
        w.min_tokens_to_keep = t.min_tokens_to_keep = keep;
        check_against_reference(wide, w, {});
        check_against_reference(wide, t, {});
      }
    }
  }
}

TEMPLATE_TEST_CASE("sampling: raw and processed log-probs, greedy with ties", "[sampling]", float, double) {
  using S = TestType;
  const Index N = 3, V = 40;
  const RowMatrix<S> logits = test_logits<S>(N, V, 3);
  SamplingOptions o;
  o.temperature = 0.5;
  o.top_k = 10;
  RowMatrix<S> raw(N, V), processed(N, V);
  embedhead::raw_log_probs<S>(logits, raw);
  embedhead::processed_log_probs<S>(logits, o, {}, processed);
  const double tol = std::is_same_v<S, float> ? 2e-6 : 1e-13;
  for (Index n = 0; n < N; ++n) {
    const std::vector<double> r = ref_log_softmax(row_of(logits, n));
    const std::vector<double> p = ref_log_softmax(ref_chain(row_of(logits, n), o, {}));
    for (Index j = 0; j < V; ++j) {
      const double rj = r[static_cast<std::size_t>(j)], pj = p[static_cast<std::size_t>(j)];
      if (std::isinf(rj))
        REQUIRE(static_cast<double>(raw(n, j)) == rj);
      else
        REQUIRE(std::fabs(static_cast<double>(raw(n, j)) - rj) <= tol * std::max(1.0, std::fabs(rj)));
      if (std::isinf(pj))
        REQUIRE(static_cast<double>(processed(n, j)) == pj);
      else
        REQUIRE(std::fabs(static_cast<double>(processed(n, j)) - pj) <= tol * std::max(1.0, std::fabs(pj)));
    }
  }
  // In place.
  RowMatrix<S> inplace = logits;
  embedhead::raw_log_probs<S>(inplace, inplace);
  REQUIRE(same_values(inplace, raw));
  // The sampled token's two log-probs are these.
  const embedhead::Rng rng(4);
  const embedhead::SampledTokens s = embedhead::sample_tokens<S>(logits, o, {}, rng, std::uint64_t{0});
  for (Index n = 0; n < N; ++n) {
    const Index t = s.tokens[static_cast<std::size_t>(n)];
    REQUIRE(std::fabs(s.raw_log_probs[static_cast<std::size_t>(n)] - static_cast<double>(raw(n, t))) <= 1e-5);
    REQUIRE(std::fabs(s.processed_log_probs[static_cast<std::size_t>(n)] - static_cast<double>(processed(n, t))) <=
            1e-5);
  }
  // Greedy: ties to the smaller id.
  RowMatrix<S> g(2, 5);
  const S ninf = -std::numeric_limits<S>::infinity();
  g << 1, 4, 2, 4, ninf, ninf, ninf, -3, -3, -5;
  const embedhead::SampledTokens greedy = embedhead::greedy_tokens<S>(g);
  REQUIRE(greedy.tokens == std::vector<Index>{1, 2});
}

TEST_CASE("sampling: the chi-square critical values of the tests are right", "[sampling][statistics]") {
  // df = 2: exactly -2 ln(alpha); df = 1 at 1e-4: the square of the normal quantile 3.890592;
  // the rest: published tables.
  REQUIRE(std::fabs(chi_square_critical(2, 1e-4) - (-2.0 * std::log(1e-4))) < 1e-9);
  REQUIRE(std::fabs(chi_square_critical(1, 0.05) - 3.841459) < 1e-5);
  REQUIRE(std::fabs(chi_square_critical(10, 0.05) - 18.307038) < 1e-5);
  REQUIRE(std::fabs(chi_square_critical(1, 1e-4) - 15.136705) < 1e-5);
  REQUIRE(std::fabs(chi_square_critical(30, 0.01) - 50.892181) < 1e-5);
}

TEST_CASE("sampling: 10^6 draws follow softmax of the processed logits (chi-square)", "[sampling][statistics]") {
  const Index V = 24;
  RowMatrix<double> logits = random_matrix<double>(1, V, 77, 2.0);
  logits(0, 5) = -kInf;
  SamplingOptions o;
  o.repetition_penalty = 1.3;
  o.temperature = 0.8;
  o.top_k = 16;
  o.top_p = 0.97;
  IdMatrix<std::int32_t> hist(1, 4);
  hist << 0, 1, 2, 2;
  const std::vector<double> expected_z = ref_chain(row_of(logits, 0), o, {0, 1, 2, 2});
  const std::vector<double> prob = ref_softmax(expected_z);
  // 1000 calls of 1000 rows (the same row), draw indices 0 .. 10^6 - 1.
  const Index rows = 1000, calls = 1000;
  RowMatrix<double> batch = logits.replicate(rows, 1);
  const std::vector<TokenIds> h(static_cast<std::size_t>(rows), TokenIds(hist));
  const embedhead::Rng rng(2024);
  std::vector<long> counts(static_cast<std::size_t>(V), 0);
  std::vector<std::uint64_t> draws(static_cast<std::size_t>(rows));
  for (Index c = 0; c < calls; ++c) {
    // Rows in reverse draw order: a row's draw depends on its index, not its position.
    for (Index r = 0; r < rows; ++r)
      draws[static_cast<std::size_t>(r)] = static_cast<std::uint64_t>(c * rows + rows - 1 - r);
    const embedhead::SampledTokens s = embedhead::sample_tokens<double>(batch, o, h, rng, draws);
    for (const Index t : s.tokens) ++counts[static_cast<std::size_t>(t)];
  }
  int df = 0;
  const double chi = chi_square(counts, prob, rows * calls, df);
  const double critical = chi_square_critical_1e4(df);
  INFO("chi-square " << chi << " with " << df << " degrees of freedom, critical value (alpha 1e-4) " << critical);
  REQUIRE(df >= 5);
  REQUIRE(chi < critical);
}

TEST_CASE("sampling: a draw depends on (seed, draw index) only, not on its row or batch", "[sampling]") {
  const Index V = 1000;
  const RowMatrix<float> row = random_matrix<float>(1, V, 8, 3.0);
  RowMatrix<float> batch = random_matrix<float>(6, V, 9, 3.0);
  batch.row(4) = row.row(0);
  SamplingOptions o;
  o.temperature = 1.3;
  o.top_p = 0.9;
  const embedhead::Rng rng(99);
  for (std::uint64_t draw : {0ULL, 1ULL, 12345ULL, 1ULL << 40}) {
    const embedhead::SampledTokens alone = embedhead::sample_tokens<float>(row, o, {}, rng, draw);
    const embedhead::SampledTokens inside = embedhead::sample_tokens<float>(batch, o, {}, rng,
                                                                            std::vector<std::uint64_t>{7, 8, 9, 10,
                                                                                                       draw, 11});
    REQUIRE(alone.tokens[0] == inside.tokens[4]);
    REQUIRE(alone.processed_log_probs[0] == inside.processed_log_probs[4]);
  }
  // Different draw indices give different tokens (a weak sanity check on 50 draws).
  std::set<Index> seen;
  for (std::uint64_t i = 0; i < 50; ++i) seen.insert(embedhead::sample_tokens<float>(row, o, {}, rng, i).tokens[0]);
  REQUIRE(seen.size() > 5);
}

TEST_CASE("verify_draft: the emitted tokens follow the target's p (chi-square, 10^6 verifications)",
          "[sampling][statistics]") {
  const Index V = 8, k = 3;
  // p and q far apart: q puts most mass where p has little, and p has mass where q has none.
  RowMatrix<double> p(k + 1, V), q(k, V);
  p << 0.40, 0.30, 0.10, 0.10, 0.05, 0.05, 0.00, 0.00,         //
      0.05, 0.05, 0.05, 0.05, 0.10, 0.10, 0.20, 0.40,          //
      0.125, 0.125, 0.125, 0.125, 0.125, 0.125, 0.125, 0.125,  //
      0.00, 0.00, 0.00, 0.50, 0.25, 0.25, 0.00, 0.00;
  q << 0.02, 0.03, 0.05, 0.10, 0.30, 0.20, 0.30, 0.00,  //
      0.40, 0.30, 0.10, 0.10, 0.05, 0.05, 0.00, 0.00,   //
      0.70, 0.10, 0.10, 0.10, 0.00, 0.00, 0.00, 0.00;
  const embedhead::Rng rng(7);
  std::mt19937_64 drafts(123);  // the draft model: x_t ~ q_t, independent of the library's Rng
  const auto draw_q = [&](Index t) {
    std::uniform_real_distribution<double> u(0.0, 1.0);
    const double x = u(drafts);
    double acc = 0;
    for (Index j = 0; j < V; ++j) {
      acc += q(t, j);
      if (x < acc && q(t, j) > 0) return j;
    }
    for (Index j = V - 1; j >= 0; --j)
      if (q(t, j) > 0) return j;
    return Index{0};
  };
  const long trials = 1000000;
  std::vector<std::vector<long>> counts(static_cast<std::size_t>(k + 1),
                                        std::vector<long>(static_cast<std::size_t>(V), 0));
  std::vector<long> emitted(static_cast<std::size_t>(k + 1), 0);
  std::vector<long> accepted_hist(static_cast<std::size_t>(k + 1), 0);
  IdMatrix<std::int32_t> draft(1, k);
  for (long i = 0; i < trials; ++i) {
    for (Index t = 0; t < k; ++t) draft(0, t) = static_cast<std::int32_t>(draw_q(t));
    const embedhead::DraftVerification v = embedhead::verify_draft<double>(draft, q, p, rng,
                                                                           static_cast<std::uint64_t>(i) * (k + 1));
    REQUIRE(static_cast<Index>(v.tokens.size()) == v.accepted + 1);
    ++accepted_hist[static_cast<std::size_t>(v.accepted)];
    for (std::size_t t = 0; t < v.tokens.size(); ++t) {
      ++counts[t][static_cast<std::size_t>(v.tokens[t])];
      ++emitted[t];
    }
  }
  // Position t's emitted token, whenever there is one, is distributed as p_t (the rows here do
  // not depend on the prefix, so the target alone would emit independent draws from p_0, p_1, ...).
  for (Index t = 0; t <= k; ++t) {
    std::vector<double> prob(static_cast<std::size_t>(V));
    for (Index j = 0; j < V; ++j) prob[static_cast<std::size_t>(j)] = p(t, j);
    int df = 0;
    const double chi = chi_square(counts[static_cast<std::size_t>(t)], prob, emitted[static_cast<std::size_t>(t)], df);
    const double critical = chi_square_critical_1e4(df);
    INFO("position " << t << ": " << emitted[static_cast<std::size_t>(t)] << " tokens, chi-square " << chi << " with "
                     << df << " degrees of freedom, critical value (alpha 1e-4) " << critical);
    REQUIRE(chi < critical);
  }
  REQUIRE(emitted[0] == trials);
  // The acceptance rate of position 0 is sum_j min(p_0j, q_0j) = 0.02+0.03+0.05+0.10+0.05+0.05 = 0.30.
  const double rate0 = 1.0 - static_cast<double>(accepted_hist[0]) / static_cast<double>(trials);
  REQUIRE(std::fabs(rate0 - 0.30) < 0.003);
}

TEMPLATE_TEST_CASE("sampling: every bad input is an error naming it, with nothing changed", "[sampling][errors]", float,
                   double) {
  using S = TestType;
  using embedhead::index_error;
  using embedhead::shape_error;
  using embedhead::value_error;
  const Index N = 2, V = 10;
  RowMatrix<S> logits = random_matrix<S>(N, V, 1);
  const RowMatrix<S> logits0 = logits;
  RowMatrix<S> out = RowMatrix<S>::Constant(N, V, S(7));
  const RowMatrix<S> out0 = out;
  const auto process = [&](const SamplingOptions& o) { embedhead::process_logits<S>(logits, o, {}, out); };
  const auto unchanged = [&]() {
    REQUIRE(same_values(logits, logits0));
    REQUIRE(same_values(out, out0));
  };
  SamplingOptions o;
  o.top_k = 0;
  REQUIRE_THROWS_MATCHES(process(o), value_error, Catch::Message("process_logits: top_k = 0 outside [1, 10]"));
  o.top_k = 11;
  REQUIRE_THROWS_MATCHES(process(o), value_error, Catch::Message("process_logits: top_k = 11 outside [1, 10]"));
  unchanged();
  for (const double bad : {0.0, -0.1, 1.5, std::numeric_limits<double>::quiet_NaN()}) {
    SamplingOptions a;
    a.top_p = bad;
    REQUIRE_THROWS_AS(process(a), value_error);
    REQUIRE_THROWS_WITH(process(a), Contains("top_p = ") && Contains("outside (0, 1]"));
    SamplingOptions b;
    b.min_p = bad;
    REQUIRE_THROWS_WITH(process(b), Contains("min_p = ") && Contains("outside (0, 1]"));
    SamplingOptions c;
    c.typical_p = bad;
    REQUIRE_THROWS_WITH(process(c), Contains("typical_p = ") && Contains("outside (0, 1]"));
  }
  for (const double bad : {0.0, -1.0, kInf, std::numeric_limits<double>::quiet_NaN()}) {
    SamplingOptions a;
    a.temperature = bad;
    REQUIRE_THROWS_AS(process(a), value_error);
    REQUIRE_THROWS_WITH(process(a), Contains("process_logits: temperature = ") && Contains("outside (0, inf)"));
    SamplingOptions b;
    b.repetition_penalty = bad;
    REQUIRE_THROWS_WITH(process(b), Contains("repetition_penalty = ") && Contains("outside (0, inf)"));
  }
  {
    SamplingOptions a;
    a.frequency_penalty = kInf;
    REQUIRE_THROWS_WITH(process(a), Contains("frequency_penalty = inf outside the finite numbers"));
    SamplingOptions b;
    b.min_tokens_to_keep = 0;
    REQUIRE_THROWS_WITH(process(b), Contains("min_tokens_to_keep = 0 outside [1, 10]"));
  }
  unchanged();
  // Ids outside [0, V).
  {
    SamplingOptions a;
    a.banned_ids = {3, 10};
    REQUIRE_THROWS_MATCHES(process(a), index_error,
                           Catch::Message("process_logits: banned id 10 at 1 outside [0, 10)"));
    SamplingOptions b;
    b.logit_bias = {{-1, 1.0}};
    REQUIRE_THROWS_MATCHES(process(b), index_error,
                           Catch::Message("process_logits: logit_bias id -1 at 0 outside [0, 10)"));
    SamplingOptions c;
    c.allowed_ids = std::vector<Index>{12};
    REQUIRE_THROWS_AS(process(c), index_error);
    SamplingOptions d;
    d.logit_bias = {{2, std::numeric_limits<double>::quiet_NaN()}};
    REQUIRE_THROWS_AS(process(d), value_error);
    IdMatrix<std::int64_t> h0(1, 2), h1(1, 3);
    h0 << 1, 2;
    h1 << 0, 10, 3;
    SamplingOptions r;
    r.repetition_penalty = 1.5;
    REQUIRE_THROWS_MATCHES(embedhead::process_logits<S>(logits, r, {TokenIds(h0), TokenIds(h1)}, out), index_error,
                           Catch::Message("process_logits: history id 10 at (row 1, 1) outside [0, 10)"));
    REQUIRE_THROWS_AS(embedhead::process_logits<S>(logits, r, {TokenIds(h0)}, out), shape_error);
  }
  unchanged();
  // The order: an active step missing from it, or a step twice.
  {
    SamplingOptions a;
    a.top_p = 0.5;
    a.order = {SamplingStep::temperature};
    REQUIRE_THROWS_WITH(process(a), Contains("step top_p is set but not in order"));
    SamplingOptions b;
    b.order = {SamplingStep::top_k, SamplingStep::top_k};
    REQUIRE_THROWS_WITH(process(b), Contains("step top_k appears twice in order"));
  }
  // Every entry masked: by the input, or by the masks.
  {
    SamplingOptions a;
    a.allowed_ids = std::vector<Index>{};
    REQUIRE_THROWS_MATCHES(process(a), value_error,
                           Catch::Message("process_logits: the masks (banned_ids, allowed_ids) remove every token of "
                                          "row 0: nothing to sample from"));
    SamplingOptions b;
    b.banned_ids = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
    REQUIRE_THROWS_AS(process(b), value_error);
    RowMatrix<S> masked = logits;
    masked.row(1).setConstant(-std::numeric_limits<S>::infinity());
    REQUIRE_THROWS_MATCHES(embedhead::process_logits<S>(masked, SamplingOptions(), {}, out), value_error,
                           Catch::Message(
                               "process_logits: every entry of row 1 is -inf (masked): nothing to sample from"));
  }
  unchanged();
  // NaN and +inf logits.
  {
    RowMatrix<S> bad = logits;
    bad(1, 4) = std::numeric_limits<S>::quiet_NaN();
    REQUIRE_THROWS_WITH(embedhead::process_logits<S>(bad, SamplingOptions(), {}, out),
                        Contains("logit nan at (row 1, column 4) outside [-inf, inf)"));
    REQUIRE_THROWS_AS(embedhead::raw_log_probs<S>(bad, out), value_error);
    REQUIRE_THROWS_AS(embedhead::greedy_tokens<S>(bad), value_error);
    REQUIRE_THROWS_AS(embedhead::sample_tokens<S>(bad, SamplingOptions(), {}, embedhead::Rng(1), std::uint64_t{0}),
                      value_error);
    bad(1, 4) = std::numeric_limits<S>::infinity();
    REQUIRE_THROWS_WITH(embedhead::processed_log_probs<S>(bad, SamplingOptions(), {}, out),
                        Contains("logit inf at (row 1, column 4)"));
  }
  unchanged();
  // Shapes, draws.
  {
    RowMatrix<S> small(N, V - 1);
    REQUIRE_THROWS_AS(embedhead::process_logits<S>(logits, SamplingOptions(), {}, small), shape_error);
    REQUIRE_THROWS_AS(embedhead::sample_tokens<S>(logits, SamplingOptions(), {}, embedhead::Rng(1),
                                                  std::vector<std::uint64_t>{1}),
                      shape_error);
    REQUIRE_THROWS_WITH(embedhead::sample_tokens<S>(logits, SamplingOptions(), {}, embedhead::Rng(1),
                                                    std::vector<std::uint64_t>{0, ~0ULL}),
                        Contains("draw index 18446744073709551615 of row 1 outside [0, "));
  }
  // A processed value that overflows: a positive logit below 1 at temperature 1e-310 is above
  // 1e309, +inf in double.
  {
    SamplingOptions a;
    a.temperature = 1e-310;
    REQUIRE_THROWS_WITH(process(a), Contains("outside the finite"));
  }
  unchanged();
}

TEMPLATE_TEST_CASE("verify_draft: bad inputs are errors naming them, nothing changed", "[sampling][errors]", float,
                   double) {
  using S = TestType;
  using embedhead::index_error;
  using embedhead::shape_error;
  using embedhead::value_error;
  const Index V = 4;
  RowMatrix<S> q(2, V), p(3, V);
  q << S(0.25), S(0.25), S(0.25), S(0.25), S(0.5), S(0.5), S(0), S(0);
  p << S(0.1), S(0.2), S(0.3), S(0.4), S(0.4), S(0.3), S(0.2), S(0.1), S(1), S(0), S(0), S(0);
  const RowMatrix<S> q0 = q, p0 = p;
  const embedhead::Rng rng(1);
  IdMatrix<std::int32_t> draft(1, 2);
  draft << 1, 0;
  REQUIRE_NOTHROW(embedhead::verify_draft<S>(draft, q, p, rng, 0));
  IdMatrix<std::int32_t> none(1, 0);
  REQUIRE_THROWS_MATCHES(embedhead::verify_draft<S>(none, q, p, rng, 0), value_error,
                         Catch::Message("verify_draft: k = 0 draft tokens outside [1, 4] (V = p.cols())"));
  IdMatrix<std::int32_t> five(1, 5);
  five << 0, 1, 0, 1, 0;
  REQUIRE_THROWS_WITH(embedhead::verify_draft<S>(five, q, p, rng, 0), Contains("k = 5 draft tokens outside [1, 4]"));
  IdMatrix<std::int32_t> out_of_range(1, 2);
  out_of_range << 1, 4;
  REQUIRE_THROWS_MATCHES(embedhead::verify_draft<S>(out_of_range, q, p, rng, 0), index_error,
                         Catch::Message("verify_draft: draft id 4 at 1 outside [0, 4)"));
  IdMatrix<std::int32_t> impossible(1, 2);
  impossible << 1, 2;  // q(1, 2) = 0
  REQUIRE_THROWS_MATCHES(embedhead::verify_draft<S>(impossible, q, p, rng, 0), value_error,
                         Catch::Message("verify_draft: q(1, 2) = 0 at drafted token 2 (position 1): outside (0, 1], "
                                        "the draft model could not have drawn it"));
  RowMatrix<S> p_short = p.topRows(2);
  REQUIRE_THROWS_AS(embedhead::verify_draft<S>(draft, q, p_short, rng, 0), shape_error);
  RowMatrix<S> p_bad = p;
  p_bad(2, 0) = S(0.9);  // row 2 sums to 0.9
  REQUIRE_THROWS_WITH(embedhead::verify_draft<S>(draft, q, p_bad, rng, 0), Contains("row 2 of p sums to 0.9"));
  p_bad = p;
  p_bad(0, 3) = std::numeric_limits<S>::quiet_NaN();
  REQUIRE_THROWS_WITH(embedhead::verify_draft<S>(draft, q, p_bad, rng, 0),
                      Contains("p nan at (row 0, column 3) outside [0, inf)"));
  RowMatrix<S> q_bad = q;
  q_bad(0, 0) = S(-0.25);
  q_bad(0, 1) = S(0.75);
  REQUIRE_THROWS_WITH(embedhead::verify_draft<S>(draft, q_bad, p, rng, 0), Contains("q -0.25 at (row 0, column 0)"));
  REQUIRE_THROWS_AS(embedhead::verify_draft<S>(draft, q, p, rng, ~0ULL), value_error);
  REQUIRE(same_values(q, q0));
  REQUIRE(same_values(p, p0));
  // Accept-all when p = q on the drafted tokens' rows: p / q = 1 > u always.
  RowMatrix<S> same(3, V);
  same << q.row(0), q.row(1), p.row(2);
  const embedhead::DraftVerification v = embedhead::verify_draft<S>(draft, q, same, rng, 5);
  REQUIRE(v.accepted == 2);
  REQUIRE(v.tokens == std::vector<Index>{1, 0, 0});  // bonus from p_2 = one-hot at 0
}
