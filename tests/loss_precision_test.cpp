// Precision of the losses at real vocabulary sizes and extreme logits, against long double:
//   - float cross-entropy and the float fused head loss (loss, dz / dW, dh) at V = 256,000 (Gemma)
//     and 262,144 (Gemma 3) within 1e-6 relative: the row statistics are summed in double (a
//     float sum over a lane of 16,000 equal terms drifts by about 1e-4);
//   - logits near 1e5 (float) and 1e7 (double): ce = (m - z_y) + log S loses nothing to
//     cancellation (lse - z_y would lose lse's last bits: about 1e-9 relative at 1e7 in double);
//   - z_loss = 0 adds exactly nothing: the z-loss part is 0 and the loss is the plain one, bit for
//     bit.
#include <embedhead/cross_entropy.hpp>
#include <embedhead/fused_head_loss.hpp>
#include <embedhead/head_scores.hpp>

#include "reference/test_support.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::RowMatrix;
using test_support::random_matrix;

namespace {

// One row's cross-entropy and gradient (softmax - one_hot), in long double.
struct ReferenceRow {
  long double loss = 0;
  std::vector<long double> dz;
};

template <typename Row>
ReferenceRow reference_row(const Row& z, Index y) {
  const Index V = static_cast<Index>(z.size());
  long double m = z(0);
  for (Index j = 1; j < V; ++j) m = std::max(m, static_cast<long double>(z(j)));
  long double S = 0;
  for (Index j = 0; j < V; ++j) S += std::exp(static_cast<long double>(z(j)) - m);
  ReferenceRow r;
  r.loss = (m - static_cast<long double>(z(y))) + std::log(S);
  r.dz.resize(static_cast<std::size_t>(V));
  for (Index j = 0; j < V; ++j)
    r.dz[static_cast<std::size_t>(j)] = std::exp(static_cast<long double>(z(j)) - m) / S - (j == y ? 1.0L : 0.0L);
  return r;
}

}  // namespace

TEST_CASE("loss precision: float cross-entropy at V = 256,000 and 262,144 within 1e-6 of long double",
          "[loss][precision]") {
  for (const Index V : {Index{256000}, Index{262144}}) {
    INFO("V = " << V);
    // Row 0: the target at 0 and every other logit equal, so that the other classes hold half of
    // the probability mass in V - 1 equal terms (a float sum of them drifts systematically).
    // Row 1: uniform logits in (-3, 3).
    RowMatrix<float> logits(2, V);
    const float tail = static_cast<float>(-std::log(static_cast<double>(V - 1)));
    logits.row(0).setConstant(tail);
    logits(0, 17) = 0.0f;
    logits.row(1) = random_matrix<float>(1, V, 41, 3.0);
    IdMatrix<std::int64_t> targets(2, 1);
    targets << 17, V - 5;
    RowMatrix<float> dz(2, V), losses(2, 1);
    embedhead::CrossEntropyOptions options;
    options.reduction = embedhead::Reduction::none;
    embedhead::cross_entropy_forward_backward<float>(logits, targets, dz, losses, options);
    for (Index n = 0; n < 2; ++n) {
      INFO("row " << n);
      const ReferenceRow r = reference_row(logits.row(n), targets(n, 0));
      CHECK(std::abs(static_cast<long double>(losses(n, 0)) - r.loss) <= 1e-6L * r.loss);
      long double worst = 0;
      for (Index j = 0; j < V; ++j) {
        const long double expected = r.dz[static_cast<std::size_t>(j)];
        worst = std::max(worst, std::abs(static_cast<long double>(dz(n, j)) - expected) / std::abs(expected));
      }
      CHECK(worst <= 1e-6L);
    }
  }
}

TEST_CASE("loss precision: the float fused head loss at V = 256,000 and 262,144 within 1e-6 of long double",
          "[loss][fused][precision]") {
  const Index N = 3, d = 16;
  for (const Index V : {Index{256000}, Index{262144}}) {
    INFO("V = " << V);
    const RowMatrix<float> W = random_matrix<float>(V, d, 51, 0.5), h = random_matrix<float>(N, d, 52, 1.0);
    IdMatrix<std::int64_t> targets(N, 1);
    targets << 3, V / 2 + 1, V - 1;
    RowMatrix<float> dh(N, d), dW = RowMatrix<float>::Zero(V, d), db(0, 1), losses(N, 1);
    embedhead::FusedHeadLossWorkspace<float> workspace;
    embedhead::FusedHeadLossOptions options;
    options.reduction = embedhead::Reduction::sum;
    const embedhead::FusedHeadLossExtras<float> extras{{nullptr, 0, 1}, {nullptr, 0, 1}, {losses.data(), N, 1}};
    const embedhead::CrossEntropyResult result = embedhead::fused_head_loss_forward_backward<float>(
        h, W, RowMatrix<float>(0, 1), targets, dh, dW, db, workspace, options, extras);

    // Reference: the logits of the float inputs in long double, then the rows as above.
    std::vector<long double> dW_ref(static_cast<std::size_t>(V * d), 0.0L),
        dh_ref(static_cast<std::size_t>(N * d), 0.0L);
    long double total = 0;
    for (Index n = 0; n < N; ++n) {
      Eigen::Array<long double, Eigen::Dynamic, 1> z(V);
      for (Index v = 0; v < V; ++v) {
        long double s = 0;
        for (Index k = 0; k < d; ++k) s += static_cast<long double>(h(n, k)) * W(v, k);
        z(v) = s;
      }
      const ReferenceRow r = reference_row(z, targets(n, 0));
      total += r.loss;
      CHECK(std::abs(static_cast<long double>(losses(n, 0)) - r.loss) <= 1e-6L * r.loss);
      for (Index v = 0; v < V; ++v)
        for (Index k = 0; k < d; ++k) {
          const long double g = r.dz[static_cast<std::size_t>(v)];
          dW_ref[static_cast<std::size_t>(v * d + k)] += g * h(n, k);
          dh_ref[static_cast<std::size_t>(n * d + k)] += g * W(v, k);
        }
    }
    CHECK(std::abs(static_cast<long double>(result.loss) - total) <= 1e-6L * total);
    // dW and dh: relative error in the Frobenius norm.
    long double err = 0, norm = 0;
    for (Index i = 0; i < V * d; ++i) {
      const long double e = dW_ref[static_cast<std::size_t>(i)];
      err += (dW.data()[i] - e) * (dW.data()[i] - e);
      norm += e * e;
    }
    CHECK(std::sqrt(err / norm) <= 1e-6L);
    err = norm = 0;
    for (Index i = 0; i < N * d; ++i) {
      const long double e = dh_ref[static_cast<std::size_t>(i)];
      err += (dh.data()[i] - e) * (dh.data()[i] - e);
      norm += e * e;
    }
    CHECK(std::sqrt(err / norm) <= 1e-6L);
  }
}

TEST_CASE("loss precision: logits near 1e5 lose nothing to cancellation", "[loss][precision]") {
  // Float logits 1e5 - j/2 (exact in float, whose step there is 1/128), the reference in long
  // double from the same values.
  const Index V = 1000;
  RowMatrix<float> logits(3, V);
  for (Index n = 0; n < 3; ++n)
    for (Index j = 0; j < V; ++j) logits(n, j) = 1e5f - 0.5f * static_cast<float>((j + 37 * n) % V);
  IdMatrix<std::int64_t> targets(3, 1);
  targets << 0, 5, 800;
  RowMatrix<float> losses(3, 1);
  embedhead::CrossEntropyOptions options;
  options.reduction = embedhead::Reduction::none;
  RowMatrix<float> dz(3, V);
  const embedhead::CrossEntropyResult result = embedhead::cross_entropy_forward_backward<float>(logits, targets, dz,
                                                                                                losses, options);
  long double total = 0;
  for (Index n = 0; n < 3; ++n) total += reference_row(logits.row(n), targets(n, 0)).loss;
  // In float each exponential is rounded to float (about 6e-8 relative), which bounds the loss's
  // precision, not the size of the logits: within 1e-6 relative as at any logit size.
  CHECK(std::abs(static_cast<long double>(result.sum) - total) <= 1e-6L * total);
  // In double, at logits of 1e7 (where lse's step is 1.9e-9, so lse - z_y would be off by about
  // 1e-9 relative): as exact as the exponentials, 1e-14.
  RowMatrix<double> big = logits.cast<double>().array() + (1e7 - 1e5);
  const embedhead::CrossEntropyResult in_double = embedhead::cross_entropy<double>(big, targets, options);
  long double total_double = 0;
  for (Index n = 0; n < 3; ++n) total_double += reference_row(big.row(n), targets(n, 0)).loss;
  CHECK(std::abs(static_cast<long double>(in_double.sum) - total_double) <= 1e-14L * total_double);
}

TEST_CASE("loss precision: z_loss = 0 adds exactly nothing", "[loss][precision]") {
  const Index N = 6, V = 300, d = 8;
  const RowMatrix<float> W = random_matrix<float>(V, d, 61, 2.0), h = random_matrix<float>(N, d, 62, 2.0);
  IdMatrix<std::int64_t> targets(N, 1);
  targets << 0, 5, 299, 17, 17, 100;
  embedhead::FusedHeadLossOptions options;  // z_loss = 0, the default
  options.z_loss = 0.0;
  options.reduction = embedhead::Reduction::sum;
  RowMatrix<float> losses(N, 1);
  const embedhead::FusedHeadLossExtras<float> extras{{nullptr, 0, 1}, {nullptr, 0, 1}, {losses.data(), N, 1}};
  embedhead::FusedHeadLossWorkspace<float> workspace;
  const embedhead::CrossEntropyResult fused = embedhead::fused_head_loss<float>(h, W, RowMatrix<float>(0, 1), targets,
                                                                                workspace, options, extras);
  CHECK(fused.z_loss == 0.0);
  // Each token's loss is the negated log-prob that score_head computes from the same statistics
  // (a path without any z-loss term), bit for bit.
  const embedhead::HeadScores scores = embedhead::score_head<float>(h, W, RowMatrix<float>(0, 1), targets);
  for (Index n = 0; n < N; ++n)
    CHECK(losses(n, 0) == static_cast<float>(-scores.raw_logprob[static_cast<std::size_t>(n)]));
  // The plain loss on the head's logits: z_loss = 0 gives the z-loss part 0 and a sum equal to the
  // default options' bit for bit.
  const RowMatrix<float> logits = h * W.transpose();
  embedhead::CrossEntropyOptions plain;
  plain.reduction = embedhead::Reduction::sum;
  embedhead::CrossEntropyOptions off = plain;
  off.z_loss = 0.0;
  const embedhead::CrossEntropyResult a = embedhead::cross_entropy<float>(logits, targets, plain);
  const embedhead::CrossEntropyResult b = embedhead::cross_entropy<float>(logits, targets, off);
  CHECK(b.z_loss == 0.0);
  CHECK(a.loss == b.loss);
  // And with z_loss > 0 the term is z_loss * lse^2, summed (so the switch does something).
  off.z_loss = 1e-2;
  const embedhead::CrossEntropyResult c = embedhead::cross_entropy<float>(logits, targets, off);
  long double expected = 0;
  for (Index n = 0; n < N; ++n) {
    long double m = logits(n, 0), S = 0;
    for (Index j = 1; j < V; ++j) m = std::max(m, static_cast<long double>(logits(n, j)));
    for (Index j = 0; j < V; ++j) S += std::exp(static_cast<long double>(logits(n, j)) - m);
    expected += 1e-2L * (m + std::log(S)) * (m + std::log(S));
  }
  CHECK(c.z_loss == Approx(static_cast<double>(expected)).epsilon(1e-6));
}
