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
// ties, whose share is bounded too.
#include <catch2/catch.hpp>
#include <embedhead/embedhead.hpp>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

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
  using Mixed = embedhead::detail::gemm::MixedBackend;
  const bool bf16_operands = Mixed::takes<float, bf16, bf16> && Mixed::usable();
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
#endif
