// A guided tour of embedhead's key facts, measured on this machine. Plain C++ and <chrono>, no
// benchmark framework: each time is the median of several samples, each sample long enough
// (>= 2 ms, repeating the call if it is short) for the clock to resolve it.
//
//   1. A lookup equals the one-hot product one_hot(ids) * E, bit for bit.
//   2. ... but costs d copies per token instead of V * d multiply-adds.
//   3. A lookup against a memcpy of the same bytes.
//   4. The row-sparse backward vs a dense V x d gradient: time and memory.
//   5. The LM head is a GEMM: its GFLOP/s against this machine's measured GEMM peak.
//
// Single-threaded (Eigen without OpenMP). Takes about 20 s on an idle core, mostly section 5.

// bench_support.hpp comes first, before any other include: it sets the pragma that silences
// GCC bug 105593's false -Wmaybe-uninitialized, which must precede the intrinsic headers.
#include "bench_support.hpp"

#include <embedhead/embedhead.hpp>

#include "../tests/reference/naive.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace {

using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::OutputProjection;
using embedhead::RowMatrix;
using embedhead::TokenEmbedding;
using bench_support::fail;
using bench_support::fill_uniform;
using bench_support::random_ids;

constexpr char kProgram[] = "tour";  // names this binary in fail() messages

using Clock = std::chrono::steady_clock;

// Tells the compiler that the memory behind p is read, so the work writing it cannot be dropped.
void escape(const void* p) {
#if defined(__GNUC__)
  asm volatile("" : : "g"(p) : "memory");
#else
  static const void* volatile sink;
  sink = p;
#endif
}

// Median seconds per call of `work` over `samples` samples. The first call calibrates: one shorter
// than 2 ms is repeated inside each sample so every sample lasts >= 2 ms, and it is otherwise
// only a warm-up (page faults, first allocations). A first call of 0.1 s or more is kept as a
// sample, to save time on the ~1 s GEMMs: the median ignores one slow outlier.
template <typename Work>
double median_seconds(Work&& work, int samples) {
  auto seconds_since = [](Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  Clock::time_point start = Clock::now();
  work();
  const double first = seconds_since(start);
  const long calls = first >= 2e-3 ? 1 : static_cast<long>(std::ceil(2e-3 / std::max(first, 1e-9)));
  std::vector<double> per_call;
  if (first >= 0.1) per_call.push_back(first);
  while (static_cast<int>(per_call.size()) < samples) {
    start = Clock::now();
    for (long c = 0; c < calls; ++c) work();
    per_call.push_back(seconds_since(start) / static_cast<double>(calls));
  }
  std::nth_element(per_call.begin(), per_call.begin() + samples / 2, per_call.end());
  return per_call[static_cast<std::size_t>(samples / 2)];
}

double megabytes(double bytes) { return bytes / 1e6; }

void heading(const char* title) { std::printf("\n%s\n", title); }

constexpr Index kGpt2Vocab = 50257, kGpt2Dim = 768;
constexpr int kSamples = 5;

// The GPT-2 token table [50257, 768] with the GPT-2 init N(0, 0.02^2), built once (the init draws
// 38.6 M normal numbers) and shared by sections 1, 3 and 5.
TokenEmbedding<float>& gpt2_embedding() {
  static TokenEmbedding<float> embedding(kGpt2Vocab, kGpt2Dim);
  return embedding;
}

// 1 and 2: lookup == one-hot product, and what each costs.
void lookup_vs_one_hot() {
  const Index d = kGpt2Dim, N = 64;
  heading("1. A lookup is the one-hot product, exactly");
  std::printf("   For each V below: N = %ld random ids, d = %ld; lookup(ids) compared with one_hot(ids) * E\n",
              static_cast<long>(N), static_cast<long>(d));
  std::printf("   in all N*d entries, bit for bit (each entry of the product is 1 * E[v][j] plus zeros).\n");

  struct Row {
    Index V;
    double lookup_s, one_hot_s;
  };
  std::vector<Row> rows;
  for (const Index V : {Index{1000}, Index{32000}, kGpt2Vocab}) {
    std::unique_ptr<TokenEmbedding<float>> smaller;  // the other tables, same init, built per V
    if (V != kGpt2Vocab) smaller = std::make_unique<TokenEmbedding<float>>(V, d);
    const TokenEmbedding<float>& embedding = smaller ? *smaller : gpt2_embedding();
    const IdMatrix<std::int32_t> ids = random_ids(N, V, 1);
    const RowMatrix<float> one_hot = naive::one_hot<float>(ids, V);  // [N, V], built outside the timing
    const auto E = embedding.weight().value();
    RowMatrix<float> looked_up(N, d), product(N, d);
    embedding.forward(ids, looked_up);
    product.noalias() = one_hot * E;
    const bool equal = std::memcmp(looked_up.data(), product.data(), sizeof(float) * static_cast<std::size_t>(N * d)) ==
                       0;
    std::printf("   V = %6ld: %s\n", static_cast<long>(V), equal ? "identical" : "DIFFERENT");
    if (!equal) fail(kProgram, "lookup differs from one_hot * E at V = " + std::to_string(V));

    const double lookup_s = median_seconds(
        [&] {
          embedding.forward(ids, looked_up);
          escape(looked_up.data());
        },
        kSamples);
    const double one_hot_s = median_seconds(
        [&] {
          product.noalias() = one_hot * E;
          escape(product.data());
        },
        kSamples);
    rows.push_back({V, lookup_s, one_hot_s});
  }

  heading("2. ... but a lookup copies d floats per token, the product does V*d multiply-adds");
  std::printf("   d = %ld, N = %ld tokens; median of %d samples\n", static_cast<long>(d), static_cast<long>(N),
              kSamples);
  std::printf("   %8s  %12s  %14s  %14s  %10s  %12s\n", "V", "lookup [us]", "one-hot*E [ms]", "GEMM [GFLOP/s]",
              "speed-up", "theory (= V)");
  for (const Row& r : rows) {
    const double flops = 2.0 * static_cast<double>(N * r.V * d);
    std::printf("   %8ld  %12.2f  %14.3f  %14.1f  %9.0fx  %11ldx\n", static_cast<long>(r.V), r.lookup_s * 1e6,
                r.one_hot_s * 1e3, flops / r.one_hot_s / 1e9, r.one_hot_s / r.lookup_s, static_cast<long>(r.V));
  }
  std::printf(
      "   The lookup's time does not depend on V; the product's grows with V, as the operation count\n"
      "   (V*d multiply-adds vs d copies per token) predicts. How close the speed-up comes to V depends\n"
      "   on how many multiply-adds per cycle the GEMM sustains against floats per cycle a copy moves.\n");
}

// 3: lookup against memcpy of the same bytes.
void lookup_vs_memcpy() {
  const Index V = kGpt2Vocab, d = kGpt2Dim, N = 8192;
  const TokenEmbedding<float>& embedding = gpt2_embedding();
  const IdMatrix<std::int32_t> ids = random_ids(N, V, 2);
  const RowMatrix<float> gathered = embedding.forward(ids);  // the same rows, already in order
  RowMatrix<float> out(N, d), copy(N, d);
  const std::size_t bytes = sizeof(float) * static_cast<std::size_t>(N * d);
  std::memcpy(copy.data(), gathered.data(), bytes);
  const double lookup_s = median_seconds(
      [&] {
        embedding.forward(ids, out);
        escape(out.data());
      },
      kSamples);
  const double memcpy_s = median_seconds(
      [&] {
        std::memcpy(copy.data(), gathered.data(), bytes);
        escape(copy.data());
      },
      kSamples);
  if (out != gathered || copy != gathered) fail(kProgram, "lookup or memcpy result differs");

  heading("3. Lookup vs memcpy of the same bytes");
  std::printf("   N = %ld random ids over V = %ld, d = %ld: %.1f MB of rows gathered; median of %d samples\n",
              static_cast<long>(N), static_cast<long>(V), static_cast<long>(d), megabytes(static_cast<double>(bytes)),
              kSamples);
  std::printf("   %-40s  %9s  %8s\n", "", "time [ms]", "GB/s");
  std::printf("   %-40s  %9.3f  %8.2f\n", "lookup (random rows of a 154 MB table)", lookup_s * 1e3,
              static_cast<double>(bytes) / lookup_s / 1e9);
  std::printf("   %-40s  %9.3f  %8.2f\n", "memcpy (one contiguous block)", memcpy_s * 1e3,
              static_cast<double>(bytes) / memcpy_s / 1e9);
  std::printf("   lookup / memcpy time = %.2f\n", lookup_s / memcpy_s);
}

// 4: sparse vs dense embedding backward.
void sparse_vs_dense_backward() {
  const Index V = kGpt2Vocab, d = kGpt2Dim;
  heading("4. Backward: row-sparse gradient vs a dense V x d gradient");
  std::printf(
      "   V = %ld, d = %ld, ids uniform over V. Sparse: zero_grad + TokenEmbedding::backward. Dense: zero\n"
      "   a [V, d] matrix, then dE[id_n] += dout[n] (vectorised rows), as a dense framework does.\n"
      "   Both gradients are checked equal to the naive scatter. Median of %d samples.\n",
      static_cast<long>(V), static_cast<long>(d), kSamples);
  std::printf("   %6s  %12s  %11s  %10s  %9s  %16s  %15s\n", "N", "touched rows", "sparse [ms]", "dense [ms]",
              "speed-up", "sparse grad [MB]", "dense grad [MB]");

  TokenEmbedding<float> embedding(std::make_shared<embedhead::Parameter<float>>(V, d));  // values unused here
  RowMatrix<float> dense(V, d), naive_dE(V, d);
  for (const Index N : {Index{512}, Index{8192}}) {
    const IdMatrix<std::int32_t> ids = random_ids(N, V, 3);
    RowMatrix<float> dout(N, d);
    fill_uniform(dout, 4, 1.0);
    auto sparse_step = [&] {
      embedding.zero_grad();
      embedding.backward(ids, dout);
      escape(embedding.weight().grad().touched_row(0).data());
    };
    auto dense_step = [&] {
      dense.setZero();
      for (Index n = 0; n < N; ++n) dense.row(ids(0, n)) += dout.row(n);
      escape(dense.data());
    };
    sparse_step();
    dense_step();
    naive_dE.setZero();
    naive::embedding_backward_dense(ids, dout, 1.0f, -1, naive_dE);
    if (embedding.weight().grad().to_dense() != naive_dE || dense != naive_dE)
      fail(kProgram, "backward differs from the naive scatter at N = " + std::to_string(N));

    const double sparse_s = median_seconds(sparse_step, kSamples);
    const double dense_s = median_seconds(dense_step, kSamples);
    const Index touched = embedding.weight().grad().num_touched();
    std::printf("   %6ld  %12ld  %11.3f  %10.3f  %8.1fx  %16.2f  %15.1f\n", static_cast<long>(N),
                static_cast<long>(touched), sparse_s * 1e3, dense_s * 1e3, dense_s / sparse_s,
                megabytes(static_cast<double>(touched * d * 4)), megabytes(static_cast<double>(V * d * 4)));
  }
  std::printf("   The sparse gradient holds touched*d*4 bytes, the dense one V*d*4 whatever the batch.\n");
}

// A few logits against the dot product in double. The tolerance is the worst-case rounding bound
// of a float sum of d products, (d + 2) * 2^-24 * sum |products|: a correct GEMM cannot exceed
// it, a wrong index or a missing term does.
void check_head_forward(const RowMatrix<float>& h, const OutputProjection<float>& head,
                        const RowMatrix<float>& logits) {
  const auto W = head.weight().value();
  const Index N = h.rows(), V = W.rows(), d = W.cols();
  const std::vector<std::pair<Index, Index>> probes = {{0, 0}, {N - 1, V - 1}, {N / 2, V / 3}};
  for (const auto& [n, v] : probes) {
    double exact = 0, magnitude = 0;
    for (Index j = 0; j < d; ++j) {
      exact += double{h(n, j)} * W(v, j);
      magnitude += std::abs(double{h(n, j)} * W(v, j));
    }
    if (!(std::abs(logits(n, v) - exact) <= static_cast<double>(d + 2) * std::ldexp(1.0, -24) * magnitude + 1e-30))
      fail(kProgram,
           "head logits(" + std::to_string(n) + ", " + std::to_string(v) + ") differs from the double dot product");
  }
}

// 5: the LM head as GEMM throughput.
void head_gemm() {
  const Index N = 1024, d = kGpt2Dim, V = kGpt2Vocab;
  const int samples = 3;                           // a forward is ~1 s of work on one core, a backward ~2 s
  OutputProjection<float> head(gpt2_embedding());  // tied, as in GPT-2: W = E, no bias
  RowMatrix<float> h(N, d), logits(N, V), dlogits(N, V), dh(N, d);
  fill_uniform(h, 5, 1.0);
  fill_uniform(dlogits, 6, 1.0 / static_cast<double>(N));
  head.forward(h, logits);
  check_head_forward(h, head, logits);
  const double forward_s = median_seconds(
      [&] {
        head.forward(h, logits);
        escape(logits.data());
      },
      samples);
  const double backward_s = median_seconds(
      [&] {
        head.backward(h, dlogits, dh);
        escape(dh.data());
      },
      samples);

  const Index P = 2048;
  RowMatrix<float> A(P, P), B(P, P), C(P, P);
  fill_uniform(A, 7, 1.0);
  fill_uniform(B, 8, 1.0);
  const double peak_s = median_seconds(
      [&] {
        C.noalias() = A * B;
        escape(C.data());
      },
      samples);

  const double forward_flops = 2.0 * static_cast<double>(N * V * d);
  const double peak = 2.0 * static_cast<double>(P * P * P) / peak_s / 1e9;
  heading("5. The LM head is a GEMM");
  std::printf(
      "   Head tied to the embedding (W = E, no bias) as in GPT-2. N = %ld tokens, d = %ld, V = %ld, float,\n"
      "   1 thread; median of %d samples\n",
      static_cast<long>(N), static_cast<long>(d), static_cast<long>(V), samples);
  std::printf("   %-44s  %8s  %8s  %9s  %8s\n", "", "GFLOP", "time [s]", "GFLOP/s", "of peak");
  auto line = [&](const char* what, double flops, double seconds) {
    const double rate = flops / seconds / 1e9;
    std::printf("   %-44s  %8.1f  %8.3f  %9.1f  %7.0f%%\n", what, flops / 1e9, seconds, rate, 100.0 * rate / peak);
  };
  line("forward   logits = h W^T", forward_flops, forward_s);
  line("backward  dh = dlogits W, dW += dlogits^T h", 2 * forward_flops, backward_s);
  line("peak: square 2048^3 Eigen GEMM", 2.0 * static_cast<double>(P * P * P), peak_s);
  std::printf("   Per token the head costs 2*V*d = %.1f MFLOP forward; the embedding lookup copies d = %ld floats.\n",
              2.0 * static_cast<double>(V * d) / 1e6, static_cast<long>(d));
}

}  // namespace

int main() {
  const Clock::time_point start = Clock::now();
  std::printf("embedhead tour: token embedding and LM head, measured on this machine\n");
  std::printf("Eigen %d.%d.%d (%s), %d thread; times are medians, units in the column headers.\n", EIGEN_WORLD_VERSION,
              EIGEN_MAJOR_VERSION, EIGEN_MINOR_VERSION, Eigen::SimdInstructionSetsInUse(), Eigen::nbThreads());
  lookup_vs_one_hot();
  lookup_vs_memcpy();
  sparse_vs_dense_backward();
  head_gemm();
  std::printf("\nAll checks passed; tour took %.1f s.\n", std::chrono::duration<double>(Clock::now() - start).count());
  return 0;
}
