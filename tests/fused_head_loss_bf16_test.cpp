// Tests for the bf16 mixed-precision fused head loss (fused_head_loss.hpp, "bf16 mixed precision"):
// W stored in bf16, h and dz rounded to bf16 for the products, everything else float.
//
// Compiled twice: in the threads_tests group (with OpenMP; alone without it), where
// gemm::MixedBackend is the float GEMM on the rounded values, and as
// fused_head_loss_bf16_onednn_test with embedhead::onednn, where it is oneDNN's bf16 kernels (that
// program adds the backend's own tests at the end, and requires them to run wherever
// /proc/cpuinfo lists avx512_bf16 or amx_bf16).
//
// The reference is written from the definition, in double: hr = bf16(h), Wr = W, z = hr Wr^T + b,
// lse, loss and dz = d loss / dz as the plain cross-entropy defines them, dzr = bf16(dz), then
// dW = dzr^T hr, dh = dzr Wr, db = column sums of dz. What is left between it and the library is
// float rounding (the float logits, the float dz rounded to bf16 at a tie the double one rounds
// the other way, the float sums), bounded per entry by c * 2^-24 * sum |terms| except at the rare
// ties, whose share is bounded too. Soft (probability) targets: the same, with the loss and dz of
// naive::soft_loss (PyTorch's soft-target cross-entropy) on those logits (see "soft targets" below).
#include <catch2/catch.hpp>
#include <embedhead/embedhead.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "reference/naive.hpp"
#include "reference/test_support.hpp"

namespace {

using Catch::Matchers::Contains;
using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::RowMatrix;
using bf16 = Eigen::bfloat16;

double rounded(double x) { return static_cast<double>(static_cast<float>(bf16(static_cast<float>(x)))); }

// small: one GEMM piece of each kind; large: V = 2500 is three pieces of the token plan's 1024
// columns (the last partial) and d = 300 three of dh's 128 columns, so threads share them.
struct Problem {
  Index N = 37, V = 613, d = 48;
  RowMatrix<float> h, bias, weights;
  RowMatrix<bf16> W;
  IdMatrix<std::int32_t> targets;
  static constexpr std::int32_t kIgnore = -100;
  explicit Problem(bool with_bias = true, bool large = false) {
    if (large) {
      V = 2500;
      d = 300;
    }
    h = test_support::random_matrix<float>(N, d, 11, 1.5);
    W = test_support::random_matrix<float>(V, d, 12, 0.3).cast<bf16>();
    bias = with_bias ? test_support::random_matrix<float>(V, 1, 13, 0.5) : RowMatrix<float>(0, 1);
    weights = test_support::random_matrix<float>(N, 1, 14, 1.0).array().abs() + 0.25f;
    targets = test_support::random_ids<std::int32_t>(N, 1, V, 15);
    targets(3, 0) = kIgnore;
    targets(20, 0) = kIgnore;
  }
};

// The definition in double (mean over counted tokens of w_n (lse_n - z_{n,y_n}) / sum w).
struct Reference {
  double loss = 0;
  RowMatrix<double> dW, dh, db, lse, dW_mag, dh_mag, db_mag;
};

Reference reference(const Problem& p, bool round_h = true, bool round_dz = true) {
  const Index N = p.N, V = p.V, d = p.d;
  RowMatrix<double> hr(N, d), Wr(V, d);
  for (Index n = 0; n < N; ++n)
    for (Index j = 0; j < d; ++j) hr(n, j) = round_h ? rounded(p.h(n, j)) : static_cast<double>(p.h(n, j));
  for (Index v = 0; v < V; ++v)
    for (Index j = 0; j < d; ++j) Wr(v, j) = static_cast<double>(static_cast<float>(p.W(v, j)));
  Reference r;
  r.dW = r.dW_mag = RowMatrix<double>::Zero(V, d);
  r.dh = r.dh_mag = RowMatrix<double>::Zero(N, d);
  r.db = r.db_mag = RowMatrix<double>::Zero(V, 1);
  r.lse = RowMatrix<double>::Zero(N, 1);
  double weight_sum = 0;
  for (Index n = 0; n < N; ++n)
    if (p.targets(n, 0) != Problem::kIgnore) weight_sum += p.weights(n, 0);
  std::vector<double> z(static_cast<std::size_t>(V));
  for (Index n = 0; n < N; ++n) {
    const Index y = p.targets(n, 0);
    if (y == Problem::kIgnore) continue;
    double m = -INFINITY;
    for (Index v = 0; v < V; ++v) {
      double s = p.bias.size() ? static_cast<double>(p.bias(v, 0)) : 0.0;
      for (Index j = 0; j < d; ++j) s += hr(n, j) * Wr(v, j);
      z[static_cast<std::size_t>(v)] = s;
      m = std::max(m, s);
    }
    double sum = 0;
    for (Index v = 0; v < V; ++v) sum += std::exp(z[static_cast<std::size_t>(v)] - m);
    const double lse = m + std::log(sum), w = p.weights(n, 0);
    r.lse(n, 0) = lse;
    r.loss += w * (lse - z[static_cast<std::size_t>(y)]) / weight_sum;
    for (Index v = 0; v < V; ++v) {
      const double dz = w / weight_sum * (std::exp(z[static_cast<std::size_t>(v)] - lse) - (v == y ? 1.0 : 0.0));
      const double dzr = round_dz ? rounded(dz) : dz;
      r.db(v, 0) += dz;
      r.db_mag(v, 0) += std::abs(dz);
      for (Index j = 0; j < d; ++j) {
        r.dW(v, j) += dzr * hr(n, j);
        r.dW_mag(v, j) += std::abs(dzr * hr(n, j));
        r.dh(n, j) += dzr * Wr(v, j);
        r.dh_mag(n, j) += std::abs(dzr * Wr(v, j));
      }
    }
  }
  return r;
}

// The share of entries whose |got - exact| exceeds tight * magnitude, after requiring every entry
// within loose * magnitude (+ a floor for exact zeros); one assertion, naming the first entry out.
template <typename Got>
double share_outside(const Got& got, const RowMatrix<double>& exact, const RowMatrix<double>& magnitude, double tight,
                     double loose) {
  Index outside = 0;
  std::string first_out;
  for (Index i = 0; i < exact.rows(); ++i)
    for (Index j = 0; j < exact.cols(); ++j) {
      const double error = std::abs(static_cast<double>(got(i, j)) - exact(i, j));
      if (error > loose * magnitude(i, j) + 1e-30 && first_out.empty())
        first_out = "entry (" + std::to_string(i) + ", " + std::to_string(j) + "): " + std::to_string(got(i, j)) +
                    " against " + std::to_string(exact(i, j));
      if (error > tight * magnitude(i, j) + 1e-30) ++outside;
    }
  INFO(first_out);
  REQUIRE(first_out.empty());
  return static_cast<double>(outside) / static_cast<double>(exact.size());
}

double accumulation(Index terms) { return 2.0 * static_cast<double>(terms + 2) * std::ldexp(1.0, -24); }

struct Outputs {
  embedhead::CrossEntropyResult result;
  RowMatrix<float> dh, dW, db, lse, losses;
};

template <typename Backend = embedhead::detail::gemm::MixedBackend>
Outputs run(const Problem& p, const embedhead::FusedHeadLossOptions& options, float dW_start = 0.0f) {
  Outputs out;
  out.dh = RowMatrix<float>::Constant(p.N, p.d, 7.0f);
  out.dW = RowMatrix<float>::Constant(p.V, p.d, dW_start);
  out.db = RowMatrix<float>::Constant(p.bias.size() ? p.V : 0, 1, dW_start);
  out.lse = RowMatrix<float>::Constant(p.N, 1, 9.0f);
  out.losses = RowMatrix<float>::Constant(p.N, 1, 9.0f);
  embedhead::FusedHeadLossWorkspace<float> ws;
  const embedhead::FusedHeadLossExtras<float> extras{{p.weights.data(), p.N, 1},
                                                     {out.lse.data(), p.N, 1},
                                                     {out.losses.data(), p.N, 1}};
  out.result = embedhead::fused_head_loss_forward_backward<Backend>(p.h, p.W, p.bias, p.targets, out.dh, out.dW, out.db,
                                                                    ws, options, extras);
  return out;
}

embedhead::FusedHeadLossOptions plan_options(int plan, const Problem& p) {
  embedhead::FusedHeadLossOptions options;
  options.ignore_index = Problem::kIgnore;
  if (plan == 0) {
    options.plan = embedhead::FusedPlan::vocab_blocks;
    options.vocab_block = 256;
  } else if (plan == 1) {
    options.plan = embedhead::FusedPlan::token_chunks;
    options.memory_budget = 5 * p.V * 6;  // 5 tokens' float logits and bf16-rounded dz
  }
  return options;
}

}  // namespace

TEST_CASE("bf16 fused head loss: loss, lse, losses, dh, dW and db against the double definition on rounded inputs",
          "[fused_head_loss_bf16]") {
  const int plan = GENERATE(0, 1, 2);
  const bool with_bias = GENERATE(true, false);
  const bool large = GENERATE(false, true);
  CAPTURE(plan, with_bias, large);
  const Problem p(with_bias, large);
  const Reference ref = reference(p);
  const Outputs out = run(p, plan_options(plan, p));

  CHECK(out.result.count == p.N - 2);
  CHECK(std::abs(out.result.loss - ref.loss) <= 2e-6 * std::abs(ref.loss));
  for (Index n = 0; n < p.N; ++n) {
    INFO("n = " << n);
    const bool ignored = p.targets(n, 0) == Problem::kIgnore;
    CHECK(std::abs(out.lse(n, 0) - ref.lse(n, 0)) <= (ignored ? 0.0 : 1e-5 * std::abs(ref.lse(n, 0))));
    if (ignored) CHECK(out.losses(n, 0) == 0.0f);
  }
  // dh: sums over V terms; dW and db: over the counted tokens.
  CHECK(share_outside(out.dh, ref.dh, ref.dh_mag, accumulation(p.V), std::ldexp(1.0, -7)) <= 0.02);
  CHECK(share_outside(out.dW, ref.dW, ref.dW_mag, accumulation(p.N), std::ldexp(1.0, -7)) <= 0.02);
  if (with_bias) CHECK(share_outside(out.db, ref.db, ref.db_mag, accumulation(p.N), accumulation(p.N)) == 0.0);

  // dW and db accumulate: from 0.5, the same sums added (each chunk's or block's sum rounded onto
  // 0.5: at most one float ulp of 0.5 a chunk, 37 of them in the worst plan).
  const Outputs onto = run(p, plan_options(plan, p), 0.5f);
  const double ulps = 37 * std::ldexp(1.0, -24);
  CHECK(((onto.dW.array() - 0.5f) - out.dW.array()).abs().maxCoeff() <= ulps);
  if (with_bias) CHECK(((onto.db.array() - 0.5f) - out.db.array()).abs().maxCoeff() <= ulps);
  CHECK(test_support::same_values(onto.dh, out.dh));
}

TEST_CASE("bf16 fused head loss: the reference distinguishes rounding h and dz from not rounding them",
          "[fused_head_loss_bf16]") {
  // The test above would pass a pass that skipped a rounding only if these differences fell
  // within its bounds; they do not.
  const Problem p;
  const Outputs out = run(p, plan_options(2, p));
  const Reference unrounded_h = reference(p, false, true);
  CHECK(std::abs(out.result.loss - unrounded_h.loss) > 1e-5 * std::abs(unrounded_h.loss));
  const Reference unrounded_dz = reference(p, true, false);
  Index outside = 0;
  for (Index i = 0; i < out.dW.size(); ++i) {
    const double error = std::abs(static_cast<double>(out.dW.data()[i]) - unrounded_dz.dW.data()[i]);
    if (error > accumulation(p.N) * unrounded_dz.dW_mag.data()[i] + 1e-30) ++outside;
  }
  CHECK(static_cast<double>(outside) / static_cast<double>(out.dW.size()) > 0.5);
}

TEST_CASE("bf16 fused head loss: against the float head, within bf16's rounding", "[fused_head_loss_bf16]") {
  // The accuracy the docs state: loss within 1e-3 relative, dh and dW within 2^-6 relative
  // (Frobenius) of the float computation on the unrounded W.
  const Problem p;
  const RowMatrix<float> W_float = p.W.cast<float>();
  const embedhead::FusedHeadLossOptions options = plan_options(2, p);
  RowMatrix<float> dh(p.N, p.d), dW = RowMatrix<float>::Zero(p.V, p.d), db = RowMatrix<float>::Zero(p.V, 1);
  embedhead::FusedHeadLossWorkspace<float> ws;
  const embedhead::FusedHeadLossExtras<float> extras{{p.weights.data(), p.N, 1}};
  const auto fp32 = embedhead::fused_head_loss_forward_backward<float>(p.h, W_float, p.bias, p.targets, dh, dW, db, ws,
                                                                       options, extras);
  const Outputs out = run(p, options);
  CHECK(std::abs(out.result.loss - fp32.loss) <= 1e-3 * std::abs(fp32.loss));
  CHECK((out.dh - dh).norm() <= std::ldexp(1.0, -6) * dh.norm());
  CHECK((out.dW - dW).norm() <= std::ldexp(1.0, -6) * dW.norm());
}

TEST_CASE("bf16 fused head loss: the loss alone is forward_backward's bit for bit, in every plan",
          "[fused_head_loss_bf16]") {
  const int plan = GENERATE(0, 1, 2);
  const Problem p;
  const embedhead::FusedHeadLossOptions options = plan_options(plan, p);
  const Outputs out = run(p, options);
  embedhead::FusedHeadLossWorkspace<float> ws;
  RowMatrix<float> lse(p.N, 1);
  const embedhead::FusedHeadLossExtras<float> extras{{p.weights.data(), p.N, 1}, {lse.data(), p.N, 1}};
  const auto loss_only = embedhead::fused_head_loss(p.h, p.W, p.bias, p.targets, ws, options, extras);
  CHECK(loss_only.loss == out.result.loss);
  CHECK(test_support::same_values(lse, out.lse));
}

TEST_CASE("bf16 fused head loss: bad shapes and budgets throw, naming the value, and change nothing",
          "[fused_head_loss_bf16]") {
  const Problem p;
  RowMatrix<float> dh = RowMatrix<float>::Constant(p.N, p.d, 3.0f), dW = RowMatrix<float>::Constant(p.V, p.d, 4.0f),
                   db = RowMatrix<float>::Constant(p.V, 1, 5.0f);
  RowMatrix<float> lse = RowMatrix<float>::Constant(p.N, 1, 6.0f), losses = RowMatrix<float>::Constant(p.N, 1, 8.0f);
  const RowMatrix<float> dh0 = dh, dW0 = dW, db0 = db, lse0 = lse, losses0 = losses;
  const embedhead::FusedHeadLossExtras<float> extras{{p.weights.data(), p.N, 1},
                                                     {lse.data(), p.N, 1},
                                                     {losses.data(), p.N, 1}};
  embedhead::FusedHeadLossWorkspace<float> ws;
  embedhead::FusedHeadLossOptions options = plan_options(2, p);
  const RowMatrix<bf16> W_short = p.W.leftCols(p.d - 1);
  REQUIRE_THROWS_AS(embedhead::fused_head_loss_forward_backward(p.h, W_short, p.bias, p.targets, dh, dW, db, ws,
                                                                options, extras),
                    embedhead::shape_error);
  REQUIRE_THROWS_WITH(embedhead::fused_head_loss_forward_backward(p.h, W_short, p.bias, p.targets, dh, dW, db, ws,
                                                                  options, extras),
                      Contains("fused_head_loss_forward_backward: h has shape [37, 48], expected [37, 47]"));
  // token_chunks: one token's row is V float logits plus V rounded dz values (4 + 2 or 4 + 4 bytes).
  options.plan = embedhead::FusedPlan::token_chunks;
  options.memory_budget = p.V * 4;
  // The backend the call runs on: MixedBackend where it is usable here, the default one otherwise
  // (oneDNN's bf16 kernels need AVX512_BF16; both take bf16 operands where they run).
  using Mixed = embedhead::detail::gemm::MixedBackend;
  using Default = embedhead::detail::gemm::DefaultBackend;
  const bool bf16_operands = Mixed::usable() ? Mixed::takes<float, bf16, bf16> : Default::takes<float, bf16, bf16>;
  const std::string row = std::to_string(p.V * (bf16_operands ? 6 : 8));
  REQUIRE_THROWS_AS(embedhead::fused_head_loss_forward_backward(p.h, p.W, p.bias, p.targets, dh, dW, db, ws, options,
                                                                extras),
                    embedhead::value_error);
  REQUIRE_THROWS_WITH(embedhead::fused_head_loss_forward_backward(p.h, p.W, p.bias, p.targets, dh, dW, db, ws, options,
                                                                  extras),
                      Contains("memory_budget = " + std::to_string(p.V * 4) + " bytes outside [" + row + ", inf)"));
  options.memory_budget = p.V * (bf16_operands ? 6 : 8);
  CHECK(test_support::same_values(dh, dh0));
  CHECK(test_support::same_values(dW, dW0));
  CHECK(test_support::same_values(db, db0));
  CHECK(test_support::same_values(lse, lse0));
  CHECK(test_support::same_values(losses, losses0));
  REQUIRE_NOTHROW(embedhead::fused_head_loss(p.h, p.W, p.bias, p.targets, ws, options));
}

// ---- soft (probability) targets ----
//
// The bf16 soft calls (fused_head_loss_soft*, W bf16) against the same definition in double with
// soft targets: z = bf16(h) W^T + b, then naive::soft_loss (tests/reference/naive.hpp: PyTorch's
// soft-target cross-entropy, t' = (1 - eps) t + eps / C, v = u t', loss_n = -sum_c v_c log
// softmax(z_n)_c, dz_n = T_n p_n - v, T_n = sum_c v_c) on those logits with reduction sum, each
// row's loss and dz times its token weight w_n, the mean divided by sum_n w_n (N without weights);
// then dzr = bf16(dz), dW = dzr^T hr, dh = dzr W, db = column sums of dz. No finite differences
// here: the float soft path has them (soft_targets_test.cpp), and the bf16 path's gradients are
// those of the rounded products, which the definition above states directly.

namespace {

// Problem's h, W, bias and token weights with soft targets: row n has k distinct classes of
// [0, V) with random probabilities summing to 1 (in double, then rounded to float), the second
// of probability 0; dense is the same distribution as [N, V].
struct SoftTargets {
  IdMatrix<std::int64_t> ids;
  RowMatrix<float> probs, dense;
};

SoftTargets soft_targets(const Problem& p, Index k = 5) {
  std::mt19937 rng(16);
  std::uniform_real_distribution<double> uniform(0.05, 1.0);
  SoftTargets t{IdMatrix<std::int64_t>(p.N, k), RowMatrix<float>(p.N, k), RowMatrix<float>::Zero(p.N, p.V)};
  std::vector<std::int64_t> classes(static_cast<std::size_t>(p.V));
  for (Index n = 0; n < p.N; ++n) {
    for (Index c = 0; c < p.V; ++c) classes[static_cast<std::size_t>(c)] = c;
    std::shuffle(classes.begin(), classes.end(), rng);
    std::vector<double> w(static_cast<std::size_t>(k));
    double sum = 0;
    for (Index i = 0; i < k; ++i) sum += (w[static_cast<std::size_t>(i)] = i == 1 ? 0.0 : uniform(rng));
    for (Index i = 0; i < k; ++i) {
      t.ids(n, i) = classes[static_cast<std::size_t>(i)];
      t.probs(n, i) = static_cast<float>(w[static_cast<std::size_t>(i)] / sum);
      t.dense(n, static_cast<Index>(t.ids(n, i))) = t.probs(n, i);
    }
  }
  return t;
}

// The loss's options and whether the per-token weights are given, by variant: 0 mean; 1 label
// smoothing; 2 class weights; 3 both and per-token weights; 4 sum, label smoothing and per-token
// weights; 5 none with all three.
struct SoftCase {
  embedhead::FusedHeadLossOptions options;
  bool token_weights = false;
};

SoftCase soft_case(int variant, int plan, const Problem& p) {
  SoftCase c;
  c.options = plan_options(plan, p);  // its ignore_index is -100, soft targets' only valid one
  if (variant == 1 || variant >= 3) c.options.label_smoothing = 0.1;
  if (variant == 2 || variant == 3 || variant == 5) c.options.class_weights = test_support::class_weights(p.V);
  c.token_weights = variant >= 3;
  if (variant == 4) c.options.reduction = embedhead::Reduction::sum;
  if (variant == 5) c.options.reduction = embedhead::Reduction::none;
  return c;
}

struct SoftReference : Reference {
  double weight_sum = 0;
  RowMatrix<double> losses;  // [N, 1] w_n loss_n
};

SoftReference soft_reference(const Problem& p, const RowMatrix<float>& targets, const SoftCase& c, bool round_h = true,
                             bool round_dz = true) {
  const Index N = p.N, V = p.V, d = p.d;
  RowMatrix<double> hr(N, d);
  for (Index n = 0; n < N; ++n)
    for (Index j = 0; j < d; ++j) hr(n, j) = round_h ? rounded(p.h(n, j)) : static_cast<double>(p.h(n, j));
  const RowMatrix<double> Wr = p.W.cast<float>().cast<double>();
  RowMatrix<double> z = hr * Wr.transpose();
  if (p.bias.size()) z.rowwise() += p.bias.col(0).cast<double>().transpose();
  naive::LossOptions o;
  o.mean = false;  // summed here, then weighted and divided below
  o.label_smoothing = c.options.label_smoothing;
  o.class_weights = c.options.class_weights;
  const naive::LossResult soft = naive::soft_loss(z, targets.cast<double>(), o);
  const bool mean = c.options.reduction == embedhead::Reduction::mean;
  SoftReference r;
  for (Index n = 0; n < N; ++n) r.weight_sum += c.token_weights ? static_cast<double>(p.weights(n, 0)) : 1.0;
  const double scale = mean ? 1.0 / r.weight_sum : 1.0;
  r.dW = r.dW_mag = RowMatrix<double>::Zero(V, d);
  r.dh = r.dh_mag = RowMatrix<double>::Zero(N, d);
  r.db = r.db_mag = RowMatrix<double>::Zero(V, 1);
  r.lse = r.losses = RowMatrix<double>::Zero(N, 1);
  for (Index n = 0; n < N; ++n) {
    const double w = c.token_weights ? static_cast<double>(p.weights(n, 0)) : 1.0;
    const double m = z.row(n).maxCoeff();
    r.lse(n, 0) = m + std::log((z.row(n).array() - m).exp().sum());
    r.losses(n, 0) = w * soft.losses[static_cast<std::size_t>(n)];
    r.loss += w * soft.losses[static_cast<std::size_t>(n)] * scale;
    for (Index v = 0; v < V; ++v) {
      // dz = T p - v: its float computation is bounded by the magnitude of both terms.
      const double u = c.options.class_weights.empty() ? 1.0 : c.options.class_weights[static_cast<std::size_t>(v)];
      const double target = u * ((1 - o.label_smoothing) * static_cast<double>(targets(n, v)) +
                                 o.label_smoothing / static_cast<double>(V));
      const double g = soft.dlogits(n, v), dz = w * scale * g, dzr = round_dz ? rounded(dz) : dz;
      r.db(v, 0) += dz;
      r.db_mag(v, 0) += w * scale * (std::abs(g + target) + target);
      for (Index j = 0; j < d; ++j) {
        r.dW(v, j) += dzr * hr(n, j);
        r.dW_mag(v, j) += std::abs(dzr * hr(n, j));
        r.dh(n, j) += dzr * Wr(v, j);
        r.dh_mag(n, j) += std::abs(dzr * Wr(v, j));
      }
    }
  }
  return r;
}

template <typename Backend = embedhead::detail::gemm::MixedBackend>
Outputs run_soft(const Problem& p, const SoftTargets& t, bool sparse, const SoftCase& c, float dW_start = 0.0f) {
  Outputs out;
  out.dh = RowMatrix<float>::Constant(p.N, p.d, 7.0f);
  out.dW = RowMatrix<float>::Constant(p.V, p.d, dW_start);
  out.db = RowMatrix<float>::Constant(p.bias.size() ? p.V : 0, 1, dW_start);
  out.lse = RowMatrix<float>::Constant(p.N, 1, 9.0f);
  out.losses = RowMatrix<float>::Constant(p.N, 1, 9.0f);
  embedhead::FusedHeadLossWorkspace<float> ws;
  const embedhead::FusedHeadLossExtras<float> extras{{p.weights.data(), c.token_weights ? p.N : 0, 1},
                                                     {out.lse.data(), p.N, 1},
                                                     {out.losses.data(), p.N, 1}};
  out.result = sparse
                   ? embedhead::fused_head_loss_soft_forward_backward<Backend>(
                         p.h, p.W, p.bias, embedhead::SparseTargets<float>{t.ids, t.probs}, out.dh, out.dW, out.db, ws,
                         c.options, extras)
                   : embedhead::fused_head_loss_soft_forward_backward<Backend>(p.h, p.W, p.bias, t.dense, out.dh,
                                                                               out.dW, out.db, ws, c.options, extras);
  return out;
}

// The exception a call throws, as its type and message ("" if none).
template <typename Call>
std::string thrown(const Call& call) {
  try {
    call();
  } catch (const embedhead::shape_error& e) {
    return std::string("shape_error: ") + e.what();
  } catch (const embedhead::value_error& e) {
    return std::string("value_error: ") + e.what();
  } catch (const embedhead::index_error& e) {
    return std::string("index_error: ") + e.what();
  } catch (const std::exception& e) {
    return std::string("another exception: ") + e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("bf16 fused head loss, soft targets: loss, lse, losses, dh, dW and db against the double definition",
          "[fused_head_loss_bf16][soft]") {
  const int plan = GENERATE(0, 1, 2);
  const bool with_bias = GENERATE(true, false);
  const int variant = GENERATE(0, 1, 2, 3, 4, 5);
  const bool large = GENERATE(false, true);
  CAPTURE(plan, with_bias, variant, large);
  const Problem p(with_bias, large);
  const SoftTargets t = soft_targets(p);
  const SoftCase c = soft_case(variant, plan, p);
  const SoftReference ref = soft_reference(p, t.dense, c);
  for (const bool sparse : {false, true}) {
    CAPTURE(sparse);
    const Outputs out = run_soft(p, t, sparse, c);
    CHECK(out.result.count == p.N);
    CHECK(std::abs(out.result.weight_sum - ref.weight_sum) <= 1e-12 * ref.weight_sum);
    CHECK(std::abs(out.result.loss - ref.loss) <= 2e-6 * std::abs(ref.loss));
    for (Index n = 0; n < p.N; ++n) {
      INFO("n = " << n);
      CHECK(std::abs(out.lse(n, 0) - ref.lse(n, 0)) <= 1e-5 * std::abs(ref.lse(n, 0)));
      CHECK(std::abs(out.losses(n, 0) - ref.losses(n, 0)) <= 1e-5 * std::abs(ref.losses(n, 0)));
    }
    // dh: sums over V terms; dW and db: over the N tokens (the same bounds as with class indices).
    CHECK(share_outside(out.dh, ref.dh, ref.dh_mag, accumulation(p.V), std::ldexp(1.0, -7)) <= 0.02);
    CHECK(share_outside(out.dW, ref.dW, ref.dW_mag, accumulation(p.N), std::ldexp(1.0, -7)) <= 0.02);
    if (with_bias) CHECK(share_outside(out.db, ref.db, ref.db_mag, accumulation(p.N), accumulation(p.N)) == 0.0);

    // dW and db accumulate (+=): from 0.5, the same sums added, within an ulp of 0.5 a chunk;
    // dh is written, the same.
    const Outputs onto = run_soft(p, t, sparse, c, 0.5f);
    const double ulps = 37 * std::ldexp(1.0, -24);
    CHECK(((onto.dW.array() - 0.5f) - out.dW.array()).abs().maxCoeff() <= ulps);
    if (with_bias) CHECK(((onto.db.array() - 0.5f) - out.db.array()).abs().maxCoeff() <= ulps);
    CHECK(test_support::same_values(onto.dh, out.dh));
    CHECK(onto.result.loss == out.result.loss);
  }
}

TEST_CASE("bf16 fused head loss, soft targets: the reference distinguishes rounding h and dz from not rounding them",
          "[fused_head_loss_bf16][soft]") {
  // The test above would pass a pass that skipped a rounding only if these differences fell
  // within its bounds; they do not.
  const Problem p;
  const SoftTargets t = soft_targets(p);
  const SoftCase c = soft_case(3, 2, p);
  const Outputs out = run_soft(p, t, false, c);
  const SoftReference unrounded_h = soft_reference(p, t.dense, c, false, true);
  CHECK(std::abs(out.result.loss - unrounded_h.loss) > 1e-5 * std::abs(unrounded_h.loss));
  const SoftReference unrounded_dz = soft_reference(p, t.dense, c, true, false);
  Index outside = 0;
  for (Index i = 0; i < out.dW.size(); ++i) {
    const double error = std::abs(static_cast<double>(out.dW.data()[i]) - unrounded_dz.dW.data()[i]);
    if (error > accumulation(p.N) * unrounded_dz.dW_mag.data()[i] + 1e-30) ++outside;
  }
  CHECK(static_cast<double>(outside) / static_cast<double>(out.dW.size()) > 0.5);
}

TEST_CASE("bf16 fused head loss, soft targets: the loss alone is forward_backward's bit for bit",
          "[fused_head_loss_bf16][soft]") {
  const int plan = GENERATE(0, 1, 2);
  const int variant = GENERATE(0, 3, 4);
  CAPTURE(plan, variant);
  const Problem p;
  const SoftTargets t = soft_targets(p);
  const SoftCase c = soft_case(variant, plan, p);
  for (const bool sparse : {false, true}) {
    CAPTURE(sparse);
    const Outputs out = run_soft(p, t, sparse, c);
    embedhead::FusedHeadLossWorkspace<float> ws;
    RowMatrix<float> lse(p.N, 1), losses(p.N, 1);
    const embedhead::FusedHeadLossExtras<float> extras{{p.weights.data(), c.token_weights ? p.N : 0, 1},
                                                       {lse.data(), p.N, 1},
                                                       {losses.data(), p.N, 1}};
    const auto loss_only = sparse ? embedhead::fused_head_loss_soft(p.h, p.W, p.bias,
                                                                    embedhead::SparseTargets<float>{t.ids, t.probs}, ws,
                                                                    c.options, extras)
                                  : embedhead::fused_head_loss_soft(p.h, p.W, p.bias, t.dense, ws, c.options, extras);
    CHECK(loss_only.loss == out.result.loss);
    CHECK(loss_only.weight_sum == out.result.weight_sum);
    CHECK(test_support::same_values(lse, out.lse));
    CHECK(test_support::same_values(losses, out.losses));
  }
}

TEST_CASE("bf16 fused head loss, soft targets: against the float soft call on the same bf16-representable inputs",
          "[fused_head_loss_bf16][soft]") {
  // h already bf16 (so bf16(h) = h) and the float call given W widened: the logits are the same
  // products, so the loss, lse, losses and db (sums of the float dz) agree within float rounding;
  // dh and dW differ by dz's rounding to bf16 (at most 2^-9 of each term): visible, and small.
  const int plan = GENERATE(0, 1, 2);
  CAPTURE(plan);
  Problem p;
  p.h = p.h.cast<bf16>().cast<float>();
  const RowMatrix<float> W_float = p.W.cast<float>();
  const SoftTargets t = soft_targets(p);
  const SoftCase c = soft_case(3, plan, p);
  for (const bool sparse : {false, true}) {
    CAPTURE(sparse);
    RowMatrix<float> dh(p.N, p.d), dW = RowMatrix<float>::Zero(p.V, p.d), db = RowMatrix<float>::Zero(p.V, 1);
    RowMatrix<float> lse(p.N, 1), losses(p.N, 1);
    embedhead::FusedHeadLossWorkspace<float> ws;
    const embedhead::FusedHeadLossExtras<float> extras{{p.weights.data(), p.N, 1},
                                                       {lse.data(), p.N, 1},
                                                       {losses.data(), p.N, 1}};
    const embedhead::SparseTargets<float> sparse_targets{t.ids, t.probs};
    const auto fp32 = sparse
                          ? embedhead::fused_head_loss_soft_forward_backward<float>(p.h, W_float, p.bias,
                                                                                    sparse_targets, dh, dW, db, ws,
                                                                                    c.options, extras)
                          : embedhead::fused_head_loss_soft_forward_backward<float>(p.h, W_float, p.bias, t.dense, dh,
                                                                                    dW, db, ws, c.options, extras);
    const Outputs out = run_soft(p, t, sparse, c);
    CHECK(out.result.weight_sum == fp32.weight_sum);
    CHECK(std::abs(out.result.loss - fp32.loss) <= 2e-6 * std::abs(fp32.loss));
    CHECK(((out.lse - lse).array().abs() <= 1e-5f * lse.array().abs()).all());
    CHECK(((out.losses - losses).array().abs() <= 1e-5f * losses.array().abs()).all());
    CHECK((out.db - db).norm() <= 1e-5 * db.norm());
    CHECK((out.dh - dh).norm() <= std::ldexp(1.0, -7) * dh.norm());
    CHECK((out.dW - dW).norm() <= std::ldexp(1.0, -7) * dW.norm());
    CHECK((out.dW - dW).norm() > 1e-5 * dW.norm());  // dz is rounded
  }
}

TEST_CASE("bf16 fused head loss, soft targets: bad inputs throw the float soft call's error and change nothing",
          "[fused_head_loss_bf16][soft]") {
  const Problem p;
  const SoftTargets t = soft_targets(p);
  embedhead::FusedHeadLossWorkspace<float> ws;
  // The float and bf16 calls, forward_backward and the loss alone, on the same arguments (W
  // widened for the float one): the same exception, and nothing of the bf16 call's written.
  auto same_error = [&](const std::string& what, const auto& targets, const embedhead::FusedHeadLossOptions& options,
                        const RowMatrix<bf16>& W, const RowMatrix<float>& weights, Index dh_cols) {
    CAPTURE(what);
    const RowMatrix<float> W_float = W.cast<float>();
    RowMatrix<float> dh = RowMatrix<float>::Constant(p.N, dh_cols, 3.0f),
                     dW = RowMatrix<float>::Constant(p.V, p.d, 4.0f), db = RowMatrix<float>::Constant(p.V, 1, 5.0f);
    RowMatrix<float> lse = RowMatrix<float>::Constant(p.N, 1, 6.0f), losses = RowMatrix<float>::Constant(p.N, 1, 8.0f);
    const RowMatrix<float> dh0 = dh, dW0 = dW, db0 = db, lse0 = lse, losses0 = losses;
    const embedhead::FusedHeadLossExtras<float> extras{{weights.data(), weights.rows(), 1},
                                                       {lse.data(), p.N, 1},
                                                       {losses.data(), p.N, 1}};
    RowMatrix<float> dh_f = dh, dW_f = dW, db_f = db, lse_f = lse, losses_f = losses;
    const embedhead::FusedHeadLossExtras<float> extras_f{{weights.data(), weights.rows(), 1},
                                                         {lse_f.data(), p.N, 1},
                                                         {losses_f.data(), p.N, 1}};
    const std::string expected = thrown([&] {
      embedhead::fused_head_loss_soft_forward_backward<float>(p.h, W_float, p.bias, targets, dh_f, dW_f, db_f, ws,
                                                              options, extras_f);
    });
    REQUIRE(!expected.empty());
    CHECK(thrown([&] {
            embedhead::fused_head_loss_soft_forward_backward(p.h, W, p.bias, targets, dh, dW, db, ws, options, extras);
          }) == expected);
    // The loss alone (which takes no dh: where dh is the one thing wrong, neither call throws).
    RowMatrix<float> lse_alone = lse0, losses_alone = losses0;
    const embedhead::FusedHeadLossExtras<float> extras_alone{{weights.data(), weights.rows(), 1},
                                                             {lse_alone.data(), p.N, 1},
                                                             {losses_alone.data(), p.N, 1}};
    const std::string expected_alone = thrown(
        [&] { embedhead::fused_head_loss_soft<float>(p.h, W_float, p.bias, targets, ws, options, extras_f); });
    CHECK(thrown([&] { embedhead::fused_head_loss_soft(p.h, W, p.bias, targets, ws, options, extras_alone); }) ==
          expected_alone);
    if (!expected_alone.empty()) {
      CHECK(test_support::same_values(lse_alone, lse0));
      CHECK(test_support::same_values(losses_alone, losses0));
    }
    CHECK(test_support::same_values(dh, dh0));
    CHECK(test_support::same_values(dW, dW0));
    CHECK(test_support::same_values(db, db0));
    CHECK(test_support::same_values(lse, lse0));
    CHECK(test_support::same_values(losses, losses0));
  };
  const embedhead::FusedHeadLossOptions options = soft_case(3, 2, p).options;
  const embedhead::SparseTargets<float> sparse{t.ids, t.probs};
  // Each call is valid but for the one thing named.
  REQUIRE(thrown([&] {
            RowMatrix<float> dh(p.N, p.d), dW = RowMatrix<float>::Zero(p.V, p.d), db = RowMatrix<float>::Zero(p.V, 1);
            embedhead::fused_head_loss_soft_forward_backward(p.h, p.W, p.bias, t.dense, dh, dW, db, ws, options);
            embedhead::fused_head_loss_soft_forward_backward(p.h, p.W, p.bias, sparse, dh, dW, db, ws, options);
          }) == "");

  // Dense targets: shape, a negative entry, a NaN, a row not summing to 1, a padding column.
  same_error("dense shape", RowMatrix<float>(t.dense.leftCols(p.V - 1)), options, p.W, p.weights, p.d);
  RowMatrix<float> dense = t.dense;
  dense(4, static_cast<Index>(t.ids(4, 1))) = -0.25f;
  same_error("negative", dense, options, p.W, p.weights, p.d);
  dense = t.dense;
  dense(5, 0) = std::numeric_limits<float>::quiet_NaN();
  same_error("NaN", dense, options, p.W, p.weights, p.d);
  dense = t.dense;
  dense(6, static_cast<Index>(t.ids(6, 1))) = 0.5f;
  same_error("sum", dense, options, p.W, p.weights, p.d);
  embedhead::FusedHeadLossOptions padded = options;
  padded.valid_vocab = p.V - 1;
  padded.class_weights = test_support::class_weights(p.V - 1);
  dense = t.dense;
  dense(0, p.V - 1) = 0.25f;  // row 0: found at that entry, before its sum
  same_error("padding column", dense, padded, p.W, p.weights, p.d);

  // Sparse targets: shapes, an id out of range, a negative or NaN probability, a sum.
  const RowMatrix<float> probs_short = t.probs.leftCols(2);
  same_error("sparse shape", embedhead::SparseTargets<float>{t.ids, probs_short}, options, p.W, p.weights, p.d);
  IdMatrix<std::int64_t> ids = t.ids;
  ids(2, 3) = p.V;
  same_error("sparse id", embedhead::SparseTargets<float>{ids, t.probs}, options, p.W, p.weights, p.d);
  ids(2, 3) = -1;
  same_error("negative sparse id", embedhead::SparseTargets<float>{ids, t.probs}, options, p.W, p.weights, p.d);
  RowMatrix<float> probs = t.probs;
  probs(3, 0) = -probs(3, 0);
  same_error("negative probability", embedhead::SparseTargets<float>{t.ids, probs}, options, p.W, p.weights, p.d);
  probs = t.probs;
  probs(3, 2) = std::numeric_limits<float>::quiet_NaN();
  same_error("NaN probability", embedhead::SparseTargets<float>{t.ids, probs}, options, p.W, p.weights, p.d);
  probs = t.probs;
  probs(8, 1) = 0.25f;
  same_error("sparse sum", embedhead::SparseTargets<float>{t.ids, probs}, options, p.W, p.weights, p.d);

  // The call's other inputs: h against W, dh, the bias, a token weight, options.
  const RowMatrix<bf16> W_short = p.W.leftCols(p.d - 1);
  same_error("W's columns", t.dense, options, W_short, p.weights, p.d);
  same_error("W's columns, sparse", sparse, options, W_short, p.weights, p.d);
  same_error("dh", t.dense, options, p.W, p.weights, p.d + 1);
  same_error("dh, sparse", sparse, options, p.W, p.weights, p.d + 1);
  RowMatrix<float> weights = p.weights;
  weights(9, 0) = -1.0f;
  same_error("token weight", t.dense, options, p.W, weights, p.d);
  same_error("weights' shape", t.dense, options, p.W, RowMatrix<float>(p.weights.topRows(p.N - 1)), p.d);
  embedhead::FusedHeadLossOptions bad = options;
  bad.ignore_index = 3;
  same_error("ignore_index", t.dense, bad, p.W, p.weights, p.d);
  same_error("ignore_index, sparse", sparse, bad, p.W, p.weights, p.d);
  bad = options;
  bad.label_smoothing = 1.5;
  same_error("label_smoothing", sparse, bad, p.W, p.weights, p.d);
  bad = options;
  bad.class_weights = test_support::class_weights(p.V - 1);
  same_error("class_weights", t.dense, bad, p.W, p.weights, p.d);
  bad = options;
  bad.error_if_nonfinite = true;
  RowMatrix<bf16> W_inf = p.W;
  W_inf(11, 5) = bf16(std::numeric_limits<float>::infinity());
  same_error("W not finite", t.dense, bad, W_inf, p.weights, p.d);
}

#ifdef _OPENMP
TEST_CASE("bf16 fused head loss: bit-identical on 1 and 2 threads and across runs", "[fused_head_loss_bf16][threads]") {
  const int plan = GENERATE(0, 1, 2);
  const bool large = GENERATE(false, true);
  CAPTURE(plan, large);
  const Problem p(true, large);
  const embedhead::FusedHeadLossOptions options = plan_options(plan, p);
  const int before = omp_get_max_threads();
  omp_set_num_threads(1);
  const Outputs one = run(p, options);
  omp_set_num_threads(2);
  const Outputs two = run(p, options), again = run(p, options);
  omp_set_num_threads(before);
  for (const Outputs* other : {&two, &again}) {
    CHECK(other->result.loss == one.result.loss);
    CHECK(test_support::same_values(other->dh, one.dh));
    CHECK(test_support::same_values(other->dW, one.dW));
    CHECK(test_support::same_values(other->db, one.db));
  }
}

TEST_CASE("bf16 fused head loss, soft targets: bit-identical on 1 and 2 threads and across runs",
          "[fused_head_loss_bf16][soft][threads]") {
  const int plan = GENERATE(0, 1, 2);
  const bool sparse = GENERATE(false, true);
  CAPTURE(plan, sparse);
  const Problem p(true, true);
  const SoftTargets t = soft_targets(p);
  const SoftCase c = soft_case(3, plan, p);
  const int before = omp_get_max_threads();
  omp_set_num_threads(1);
  const Outputs one = run_soft(p, t, sparse, c);
  omp_set_num_threads(2);
  const Outputs two = run_soft(p, t, sparse, c), again = run_soft(p, t, sparse, c);
  omp_set_num_threads(before);
  for (const Outputs* other : {&two, &again}) {
    CHECK(other->result.loss == one.result.loss);
    CHECK(test_support::same_values(other->dh, one.dh));
    CHECK(test_support::same_values(other->dW, one.dW));
    CHECK(test_support::same_values(other->db, one.db));
    CHECK(test_support::same_values(other->losses, one.losses));
  }
}
#endif

#ifdef EMBEDHEAD_HAVE_ONEDNN
namespace {

namespace gemm = embedhead::detail::gemm;

// Whether the CPU has native bf16 instructions (/proc/cpuinfo's avx512_bf16 or amx_bf16 flag):
// there oneDNN must be usable, so the tests below cannot pass on the fallback alone.
bool cpu_has_bf16() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line))
    if (line.rfind("flags", 0) == 0)
      return line.find(" avx512_bf16") != std::string::npos || line.find(" amx_bf16") != std::string::npos;
  return false;
}

// C [M, N] (init) op(A) op(B) by a triple loop in double, on small integers (exact in bf16, and
// every sum exact in float): the backend must give the same floats exactly.
template <gemm::Layout LA, gemm::Layout LB>
void check_backend(gemm::Init init) {
  const Index M = 19, N = 45, K = 33;
  const Index lda = (LA == gemm::Layout::row_major ? K : M) + 3, ldb = (LB == gemm::Layout::row_major ? N : K) + 5,
              ldc = N + 2;
  std::vector<bf16> a(static_cast<std::size_t>((LA == gemm::Layout::row_major ? M : K) * lda));
  std::vector<bf16> b(static_cast<std::size_t>((LB == gemm::Layout::row_major ? K : N) * ldb));
  std::vector<float> c(static_cast<std::size_t>(M * ldc)), bias(static_cast<std::size_t>(N));
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = bf16(static_cast<float>(static_cast<int>(i * 7 % 9) - 4));
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = bf16(static_cast<float>(static_cast<int>(i * 5 % 7) - 3));
  for (std::size_t i = 0; i < c.size(); ++i) c[i] = static_cast<float>(static_cast<int>(i % 11) - 5);
  for (std::size_t i = 0; i < bias.size(); ++i) bias[i] = static_cast<float>(static_cast<int>(i % 5) - 2);
  auto A = [&](Index m, Index k) {
    return static_cast<double>(
        static_cast<float>(a[static_cast<std::size_t>(LA == gemm::Layout::row_major ? m * lda + k : k * lda + m)]));
  };
  auto B = [&](Index k, Index n) {
    return static_cast<double>(
        static_cast<float>(b[static_cast<std::size_t>(LB == gemm::Layout::row_major ? k * ldb + n : n * ldb + k)]));
  };
  std::vector<float> expected = c;
  for (Index m = 0; m < M; ++m)
    for (Index n = 0; n < N; ++n) {
      double s = init == gemm::Init::keep ? expected[static_cast<std::size_t>(m * ldc + n)]
                                          : (init == gemm::Init::bias ? bias[static_cast<std::size_t>(n)] : 0.0);
      for (Index k = 0; k < K; ++k) s += A(m, k) * B(k, n);
      expected[static_cast<std::size_t>(m * ldc + n)] = static_cast<float>(s);
    }
  const gemm::Op<float, LA, LB, bf16, bf16> op{M,   N,        K,   a.data(), lda,         b.data(),
                                               ldb, c.data(), ldc, init,     bias.data(), 1};
  gemm::run<gemm::Kernel::expression, gemm::OneDnnBackend>(op, gemm::Plan{gemm::Split::cols, 16, true});
  for (Index m = 0; m < M; ++m)
    for (Index n = 0; n < N; ++n) {
      INFO("m = " << m << ", n = " << n);
      REQUIRE(c[static_cast<std::size_t>(m * ldc + n)] == expected[static_cast<std::size_t>(m * ldc + n)]);
    }
}

}  // namespace

TEST_CASE("OneDnnBackend: every layout and Init against a triple loop, exactly", "[fused_head_loss_bf16][onednn]") {
  if (cpu_has_bf16()) REQUIRE(gemm::OneDnnBackend::usable());
  if (!gemm::OneDnnBackend::usable()) {
    // No native bf16 kernel: the library takes the fallback; only the report is checked.
    CHECK(embedhead::gemm_backend().bf16.rfind("the float GEMM on bf16-rounded values (oneDNN ", 0) == 0);
    return;
  }
  for (const gemm::Init init : {gemm::Init::zero, gemm::Init::keep, gemm::Init::bias}) {
    CAPTURE(static_cast<int>(init));
    check_backend<gemm::Layout::row_major, gemm::Layout::row_major>(init);
    check_backend<gemm::Layout::row_major, gemm::Layout::col_major>(init);
    check_backend<gemm::Layout::col_major, gemm::Layout::row_major>(init);
    check_backend<gemm::Layout::col_major, gemm::Layout::col_major>(init);
  }
  const std::string kernel = gemm::OneDnnBackend::kernel_name();
  CHECK(kernel.find("bf16") != std::string::npos);
  // gemm_backend() reports what the bf16 products run on.
  const std::string bf16_backend = embedhead::gemm_backend().bf16;
  CAPTURE(kernel, bf16_backend);
  CHECK(bf16_backend.rfind("oneDNN ", 0) == 0);
  CHECK(bf16_backend.find(kernel) != std::string::npos);
}

TEST_CASE("bf16 fused head loss: oneDNN and the float GEMM on the rounded values agree within float rounding",
          "[fused_head_loss_bf16][onednn]") {
  if (cpu_has_bf16()) REQUIRE(gemm::OneDnnBackend::usable());
  const int plan = GENERATE(0, 1, 2);
  const bool large = GENERATE(false, true);
  CAPTURE(plan, large);
  const Problem p(true, large);
  const embedhead::FusedHeadLossOptions options = plan_options(plan, p);
  const Outputs onednn = run<gemm::OneDnnBackend>(p, options);
  const Outputs eigen = run<gemm::DefaultBackend>(p, options);
  const Reference ref = reference(p);
  CHECK(std::abs(onednn.result.loss - eigen.result.loss) <= 1e-6 * std::abs(eigen.result.loss));
  // Both within the tight bound of the same reference at all but the rare ties.
  CHECK(share_outside(onednn.dW, ref.dW, ref.dW_mag, accumulation(p.N), std::ldexp(1.0, -7)) <= 0.02);
  CHECK(share_outside(eigen.dW, ref.dW, ref.dW_mag, accumulation(p.N), std::ldexp(1.0, -7)) <= 0.02);
  CHECK((onednn.dh - eigen.dh).norm() <= 1e-5 * eigen.dh.norm());
}

TEST_CASE("bf16 fused head loss, soft targets: oneDNN and the float GEMM on the rounded values agree",
          "[fused_head_loss_bf16][soft][onednn]") {
  if (cpu_has_bf16()) REQUIRE(gemm::OneDnnBackend::usable());
  const int plan = GENERATE(0, 1, 2);
  const bool sparse = GENERATE(false, true);
  CAPTURE(plan, sparse);
  const Problem p(true, true);
  const SoftTargets t = soft_targets(p);
  const SoftCase c = soft_case(3, plan, p);
  const Outputs onednn = run_soft<gemm::OneDnnBackend>(p, t, sparse, c);
  const Outputs eigen = run_soft<gemm::DefaultBackend>(p, t, sparse, c);
  const SoftReference ref = soft_reference(p, t.dense, c);
  CHECK(std::abs(onednn.result.loss - eigen.result.loss) <= 1e-6 * std::abs(eigen.result.loss));
  CHECK(share_outside(onednn.dW, ref.dW, ref.dW_mag, accumulation(p.N), std::ldexp(1.0, -7)) <= 0.02);
  CHECK(share_outside(eigen.dW, ref.dW, ref.dW_mag, accumulation(p.N), std::ldexp(1.0, -7)) <= 0.02);
  CHECK((onednn.dh - eigen.dh).norm() <= 1e-5 * eigen.dh.norm());
}
#endif
