// Built with OpenMP (see tests/CMakeLists.txt): the threaded paths give bit-identical results for
// 1 and 2 threads and across runs, and equal the naive sequential reference.
#include <embedhead/embedhead.hpp>

#include "reference/naive.hpp"
#include "reference/test_support.hpp"

#include <catch2/catch.hpp>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::RowMatrix;

namespace {

template <typename Scalar>
bool bit_identical(const RowMatrix<Scalar>& a, const RowMatrix<Scalar>& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         std::memcmp(a.data(), b.data(), sizeof(Scalar) * static_cast<std::size_t>(a.size())) == 0;
}

// Runs f with `threads` OpenMP threads and restores the previous setting.
template <typename F>
auto with_threads(int threads, F f) {
  const int before = omp_get_max_threads();
  omp_set_num_threads(threads);
  auto result = f();
  omp_set_num_threads(before);
  return result;
}

}  // namespace

TEST_CASE("threads: this test really runs two threads", "[threads]") {
  const int seen = with_threads(2, [] {
    int count = 0;
#pragma omp parallel
    {
#pragma omp single
      count = omp_get_num_threads();
    }
    return count;
  });
  REQUIRE(seen == 2);
}

TEMPLATE_TEST_CASE("threads: lookup and sparse backward are bit-identical for 1 and 2 threads", "[threads]", float,
                   double) {
  using S = TestType;
  // Large enough that both paths split (>= 2 * 256 tokens, >= 2 * 64 distinct rows), with many
  // repeated ids so the per-row sums have several terms, and T not dividing the split points.
  const Index V = 500, d = 33, B = 7, T = 151;
  for (const bool scale : {false, true}) {
    embedhead::TokenEmbeddingOptions options;
    options.scale_by_sqrt_d = scale;
    options.padding_idx = 3;
    options.seed = 5;
    const IdMatrix<std::int64_t> ids = test_support::random_ids<std::int64_t>(B, T, V, 17);
    const RowMatrix<S> dout = test_support::random_matrix<S>(B * T, d, 18);

    auto run = [&](int threads) {
      return with_threads(threads, [&] {
        embedhead::TokenEmbedding<S> embedding(V, d, options);
        RowMatrix<S> out(B * T, d);
        embedding.forward(ids, out);
        embedding.backward(ids, dout);
        embedding.backward(ids, dout);  // a second pass adds into existing rows
        return std::make_pair(out, embedding.weight().grad().to_dense());
      });
    };
    const auto one = run(1), two = run(2), two_again = run(2);
    CHECK(bit_identical(one.first, two.first));
    CHECK(bit_identical(one.second, two.second));
    CHECK(bit_identical(two.second, two_again.second));

    // And both equal the naive sequential references.
    embedhead::TokenEmbedding<S> reference(V, d, options);
    const RowMatrix<S> E = reference.weight().value();
    const RowMatrix<S> expected_out = naive::one_hot_lookup<S>(ids, E) * reference.scale();
    RowMatrix<S> expected_grad = RowMatrix<S>::Zero(V, d);
    naive::embedding_backward_dense<S>(ids, dout, reference.scale(), 3, expected_grad);
    naive::embedding_backward_dense<S>(ids, dout, reference.scale(), 3, expected_grad);
    CHECK(one.first == expected_out);
    CHECK(one.second == expected_grad);
  }
}

TEMPLATE_TEST_CASE("threads: the fused head loss is bit-identical for 1 and 2 threads", "[threads][fused_head_loss]",
                   float, double) {
  using S = TestType;
  // Blocks of 1000 rows cut into GEMM pieces of 256, d cut into pieces of 128, the last partial.
  const Index V = 4500, d = 300, N = 23;
  const RowMatrix<S> h = test_support::random_matrix<S>(N, d, 71, 0.3);
  const RowMatrix<S> W = test_support::random_matrix<S>(V, d, 72, 0.3);
  const RowMatrix<S> bias = test_support::random_matrix<S>(V, 1, 73, 0.3);
  IdMatrix<std::int32_t> targets = test_support::random_ids<std::int32_t>(1, N, V - 10, 74);
  targets(0, 4) = -100;
  embedhead::FusedHeadLossOptions options;
  options.vocab_block = 1000;  // pieces of 256, 256, 256, 232 rows
  options.label_smoothing = 0.1;
  options.softcap = 10;
  options.valid_vocab = V - 10;
  // Both plans: two passes over vocabulary blocks, and token chunks of 5 tokens (the last of 2 after
  // the ignored one), each over the whole vocabulary in pieces of 1024 rows.
  const bool chunks = GENERATE(false, true);
  CAPTURE(chunks);
  options.plan = chunks ? embedhead::FusedPlan::token_chunks : embedhead::FusedPlan::vocab_blocks;
  options.memory_budget = 5 * (V - 10) * static_cast<Index>(sizeof(S));
  struct Out {
    double loss;
    RowMatrix<S> dh, dW, db, lse;
  };
  auto run = [&] {
    Out out{0, RowMatrix<S>(N, d), RowMatrix<S>::Zero(V, d), RowMatrix<S>::Zero(V, 1), RowMatrix<S>(N, 1)};
    RowMatrix<S> no(0, 1), none(0, 1);
    embedhead::FusedHeadLossWorkspace<S> ws;
    const embedhead::FusedHeadLossExtras<S> extras{{no.data(), 0, 1}, {out.lse.data(), N, 1}, {none.data(), 0, 1}};
    out.loss = embedhead::fused_head_loss_forward_backward<S>(h, W, bias, targets, out.dh, out.dW, out.db, ws, options,
                                                              extras)
                   .loss;
    return out;
  };
  const Out one = with_threads(1, run), two = with_threads(2, run), again = with_threads(2, run);
  CHECK(one.loss == two.loss);
  CHECK(bit_identical(one.dh, two.dh));
  CHECK(bit_identical(one.dW, two.dW));
  CHECK(bit_identical(one.db, two.db));
  CHECK(bit_identical(one.lse, two.lse));
  CHECK(two.loss == again.loss);
  CHECK(bit_identical(two.dW, again.dW));
}

TEMPLATE_TEST_CASE("threads: low-precision lookup and backward are bit-identical for 1 and 2 threads", "[threads]",
                   Eigen::bfloat16, Eigen::half) {
  using Storage = TestType;
  const Index V = 500, d = 33, B = 7, T = 151;  // both paths split, as above
  const RowMatrix<Storage> table = test_support::random_matrix<float>(V, d, 21).cast<Storage>();
  const RowMatrix<float> widened = table.template cast<float>();
  const IdMatrix<std::int32_t> ids = test_support::random_ids<std::int32_t>(B, T, V, 22);
  const RowMatrix<float> dout = test_support::random_matrix<float>(B * T, d, 23);
  embedhead::TokenEmbeddingOptions options;
  options.scale_by_sqrt_d = true;
  options.padding_idx = 3;
  auto run = [&](int threads) {
    return with_threads(threads, [&] {
      embedhead::LowPrecisionEmbedding<Storage> embedding(table, options);
      RowMatrix<float> out(B * T, d);
      embedding.forward(ids, out);
      embedding.backward(ids, dout);
      return std::make_pair(out, embedding.grad().to_dense());
    });
  };
  const auto one = run(1), two = run(2);
  CHECK(bit_identical(one.first, two.first));
  CHECK(bit_identical(one.second, two.second));
  const float s = embedhead::low_precision_scale<Storage>(d);
  const RowMatrix<float> scaled = s * widened;
  CHECK(one.first == naive::one_hot_lookup<float>(ids, scaled));
  RowMatrix<float> expected_grad = RowMatrix<float>::Zero(V, d);
  naive::embedding_backward_dense<float>(ids, dout, s, 3, expected_grad);
  CHECK(one.second == expected_grad);
}

TEST_CASE("threads: int8 lookup is bit-identical for 1 and 2 threads", "[threads]") {
  const Index V = 500, d = 33, B = 7, T = 151;
  const embedhead::QuantizedEmbedding table(test_support::random_matrix<float>(V, d, 31));
  const IdMatrix<std::int64_t> ids = test_support::random_ids<std::int64_t>(B, T, V, 32);
  auto run = [&](int threads) { return with_threads(threads, [&] { return table.forward(ids); }); };
  const RowMatrix<float> one = run(1), two = run(2);
  CHECK(bit_identical(one, two));
  CHECK(one == naive::one_hot_lookup<float>(ids, table.dequantize()));
}

namespace {

struct HeadSize {
  Index N, V, d;
};

// The head's forward and backward (two accumulating calls, the second into dh = h) run with
// `threads` OpenMP threads; returns logits, dh, dW and db.
template <typename S>
std::vector<RowMatrix<S>> run_head(int threads, const HeadSize& s) {
  return with_threads(threads, [&] {
    embedhead::OutputProjection<S> head(s.V, s.d);
    head.bias()->value() = test_support::random_matrix<S>(s.V, 1, 41);
    RowMatrix<S> h = test_support::random_matrix<S>(s.N, s.d, 42);
    const RowMatrix<S> dlogits = test_support::random_matrix<S>(s.N, s.V, 43);
    RowMatrix<S> logits(s.N, s.V), dh(s.N, s.d);
    head.forward(h, logits);
    head.backward(h, dlogits, dh);
    head.backward(h, dlogits, h);
    return std::vector<RowMatrix<S>>{logits, dh, h, head.weight().grad().to_dense(), head.bias()->grad().to_dense()};
  });
}

template <typename S>
bool all_bit_identical(const std::vector<RowMatrix<S>>& a, const std::vector<RowMatrix<S>>& b) {
  bool same = a.size() == b.size();
  for (std::size_t i = 0; same && i < a.size(); ++i) same = bit_identical(a[i], b[i]);
  return same;
}

}  // namespace

TEMPLATE_TEST_CASE("threads: the head's forward and backward are bit-identical for 1 and 2 threads", "[threads][head]",
                   float, double) {
  using S = TestType;
  using embedhead::detail::kHeadTokenChunk;
  using embedhead::detail::kHeadVocabChunk;
  // Threaded GEMM chunks with V not a multiple of the V chunk and N not one of the dh chunk; N = 1
  // and N <= 8 (decode forward, chunked backward); N = 9 (the smallest GEMM forward); and sizes
  // below the threading threshold, which run on the calling thread.
  // (Threaded: 2 N V d >= kHeadMinFlops for the GEMMs, V d >= kDecodeMinElements for decode.)
  const std::vector<HeadSize> sizes = {{kHeadTokenChunk + 5, 2 * kHeadVocabChunk + 37, 24},
                                       {1, 5 * kHeadVocabChunk + 1, 64},
                                       {8, 4 * kHeadVocabChunk + 5, 64},
                                       {3, kHeadVocabChunk + 300, 33},
                                       {9, kHeadVocabChunk + 3, 17},
                                       {1, 1, 1},
                                       {3, 5, 4},
                                       {20, 30, 10}};
  for (const HeadSize& s : sizes) {
    CAPTURE(s.N, s.V, s.d);
    const auto one = run_head<S>(1, s), two = run_head<S>(2, s), two_again = run_head<S>(2, s);
    CHECK(all_bit_identical(one, two));
    CHECK(all_bit_identical(two, two_again));

    // Inside a parallel region the chunks run in order on one thread, which is also the code
    // path of a build without OpenMP: same bits.
    std::vector<RowMatrix<S>> nested;
#pragma omp parallel num_threads(2)
    {
#pragma omp single
      nested = run_head<S>(2, s);
    }
    CHECK(all_bit_identical(one, nested));

    // Eigen's own GEMM threading (setNbThreads) is never used by the head: same bits with it on.
    Eigen::setNbThreads(2);
    const auto eigen_threads = run_head<S>(1, s);
    Eigen::setNbThreads(0);  // back to following OpenMP
    CHECK(all_bit_identical(one, eigen_threads));

    // And the results are the head's arithmetic: logits against a product in double.
    embedhead::OutputProjection<S> reference(s.V, s.d);
    const RowMatrix<double> W = reference.weight().value().template cast<double>();
    const RowMatrix<double> b = test_support::random_matrix<S>(s.V, 1, 41).template cast<double>();
    const RowMatrix<double> h = test_support::random_matrix<S>(s.N, s.d, 42).template cast<double>();
    const RowMatrix<double> expected = (h * W.transpose()).rowwise() + b.col(0).transpose();
    const double scale = std::sqrt(static_cast<double>(s.d)) * std::numeric_limits<S>::epsilon() * 16;
    CHECK((one[0].template cast<double>() - expected).cwiseAbs().maxCoeff() <= scale);
  }
}

namespace {

// The bf16 / fp16 head's forward and backward (two accumulating calls, the second into dh = h) by
// the free functions the LowPrecisionOutputProjection layer calls, with `threads` OpenMP threads;
// returns logits, dh, dh in place, dW and db.
template <typename Storage>
std::vector<RowMatrix<float>> run_low_precision_head(int threads, const RowMatrix<Storage>& W, const HeadSize& s) {
  return with_threads(threads, [&] {
    const RowMatrix<float> b = test_support::random_matrix<float>(s.V, 1, 51);
    RowMatrix<float> h = test_support::random_matrix<float>(s.N, s.d, 52);
    const RowMatrix<float> dlogits = test_support::random_matrix<float>(s.N, s.V, 53);
    RowMatrix<float> logits(s.N, s.V), dh(s.N, s.d);
    RowMatrix<float> dW = RowMatrix<float>::Zero(s.V, s.d), db = RowMatrix<float>::Zero(s.V, 1);
    embedhead::HeadTileWorkspace workspace;
    embedhead::output_projection_forward<Storage>(h, W, b, logits, workspace);
    embedhead::output_projection_backward<Storage>(h, W, dlogits, dh, dW, db, workspace);
    embedhead::output_projection_backward<Storage>(h, W, dlogits, h, dW, db, workspace);
    return std::vector<RowMatrix<float>>{logits, dh, h, dW, db};
  });
}

}  // namespace

TEMPLATE_TEST_CASE("threads: the bf16 / fp16 head's forward and backward are bit-identical for 1, 2 and 3 threads",
                   "[threads][head][low_precision]", Eigen::bfloat16, Eigen::half) {
  using Storage = TestType;
  using embedhead::detail::kHeadTokenChunk;
  using embedhead::detail::kHeadVocabChunk;
  // Threaded (2 N V d >= kHeadMinFlops): V not a multiple of the V chunk nor of the 256-row tile,
  // N not a multiple of the dh chunk; and sizes below the threshold, on the calling thread.
  const std::vector<HeadSize> sizes = {{kHeadTokenChunk + 5, 2 * kHeadVocabChunk + 37, 24},
                                       {40, 3 * kHeadVocabChunk + 300, 33},
                                       {300, 600, 16},
                                       {9, kHeadVocabChunk + 3, 17},
                                       {1, 1, 1},
                                       {3, 5, 4}};
  for (const HeadSize& s : sizes) {
    CAPTURE(s.N, s.V, s.d);
    const RowMatrix<Storage> W = test_support::random_matrix<float>(s.V, s.d, 54).template cast<Storage>();
    const auto one = run_low_precision_head(1, W, s), two = run_low_precision_head(2, W, s);
    const auto three = run_low_precision_head(3, W, s), two_again = run_low_precision_head(2, W, s);
    CHECK(all_bit_identical(one, two));
    CHECK(all_bit_identical(one, three));
    CHECK(all_bit_identical(two, two_again));

    // Inside a parallel region the chunks run in order on one thread: same bits.
    std::vector<RowMatrix<float>> nested;
#pragma omp parallel num_threads(2)
    {
#pragma omp single
      nested = run_low_precision_head(2, W, s);
    }
    CHECK(all_bit_identical(one, nested));

    // Eigen's own GEMM threading is never used: same bits with it on.
    Eigen::setNbThreads(2);
    const auto eigen_threads = run_low_precision_head(1, W, s);
    Eigen::setNbThreads(0);
    CHECK(all_bit_identical(one, eigen_threads));

    // The results are the head's arithmetic: logits against a product in double on the widened W
    // (Eigen's exact cast, not the library's conversion).
    const RowMatrix<double> Wd = W.template cast<float>().template cast<double>();
    const RowMatrix<double> b = test_support::random_matrix<float>(s.V, 1, 51).template cast<double>();
    const RowMatrix<double> h = test_support::random_matrix<float>(s.N, s.d, 52).template cast<double>();
    const RowMatrix<double> expected = (h * Wd.transpose()).rowwise() + b.col(0).transpose();
    const RowMatrix<double> magnitude = (h.cwiseAbs() * Wd.cwiseAbs().transpose()).rowwise() +
                                        b.cwiseAbs().col(0).transpose();
    const double eps = std::numeric_limits<float>::epsilon();
    CHECK(((one[0].template cast<double>() - expected).cwiseAbs().array() <= s.d * eps * magnitude.array() + 1e-30)
              .all());
  }
}

TEST_CASE("threads: the interleaved bf16 head is bit-identical for 1, 2 and 3 threads", "[threads][interleaved_head]") {
  // Threaded from V d = kDecodeMinElements: V with rows after the last group of 16, and the 1-, 2-
  // and 4-token paths; below the threshold, on the calling thread.
  for (const Index V : {embedhead::detail::kDecodeMinElements / 300 + 37, Index{50}}) {
    const Index d = 300;  // two depth blocks
    CAPTURE(V);
    const embedhead::InterleavedBf16Head head(test_support::random_matrix<float>(V, d, 61),
                                              test_support::random_matrix<float>(V, 1, 62));
    const RowMatrix<float> h = test_support::random_matrix<float>(7, d, 63);
    for (const Index N : {Index{1}, Index{2}, Index{7}}) {
      CAPTURE(N);
      auto run = [&](int threads) { return with_threads(threads, [&] { return head.forward(h.topRows(N)); }); };
      const RowMatrix<float> one = run(1);
      CHECK(bit_identical(one, run(2)));
      CHECK(bit_identical(one, run(3)));
    }
  }
}

TEST_CASE("threads: parallel_chunks covers every chunk once, with fixed bounds, threaded only when asked",
          "[threads]") {
  using embedhead::detail::parallel_chunks;
  for (const Index count : {Index{0}, Index{1}, Index{63}, Index{64}, Index{65}, Index{1000}}) {
    for (const bool threaded : {false, true}) {
      CAPTURE(count, threaded);
      std::vector<int> seen(static_cast<std::size_t>(count), 0);
      std::vector<std::pair<Index, Index>> bounds;
      int in_parallel = 0, calls = 0;
      with_threads(2, [&] {
        parallel_chunks(count, 64, threaded, [&](Index begin, Index end) {
#pragma omp critical
          {
            bounds.emplace_back(begin, end);
            for (Index i = begin; i < end; ++i) ++seen[static_cast<std::size_t>(i)];
            in_parallel += omp_in_parallel() ? 1 : 0;
            ++calls;
          }
        });
        return 0;
      });
      CHECK(std::all_of(seen.begin(), seen.end(), [](int k) { return k == 1; }));
      std::sort(bounds.begin(), bounds.end());
      for (std::size_t k = 0; k < bounds.size(); ++k) {
        CHECK(bounds[k].first == static_cast<Index>(k) * 64);
        CHECK(bounds[k].second == std::min(count, static_cast<Index>(k + 1) * 64));
      }
      // With two chunks or more and threaded = true, the chunks run inside a parallel region.
      CHECK(in_parallel == ((threaded && count > 64) ? calls : 0));
    }
  }
}

TEMPLATE_TEST_CASE("threads: RoPE forward and backward are bit-identical for 1 and 2 threads", "[threads][rope]", float,
                   double) {
  using Scalar = TestType;
  const Index head_dim = 64, rotary_dim = 48, H = 4, B = 3, T = 200;
  for (const auto pairing : {embedhead::RopePairing::half_split, embedhead::RopePairing::interleaved}) {
    const embedhead::RopeTable<Scalar> table(head_dim, rotary_dim, pairing, 4096,
                                             embedhead::rope_default_frequencies(rotary_dim, 10000.0));
    const RowMatrix<Scalar> x = test_support::random_matrix<Scalar>(B * T, H * head_dim, 61);
    const IdMatrix<std::int64_t> positions = test_support::random_ids<std::int64_t>(B, T, 4096, 62);
    const auto run = [&](int threads) {
      return with_threads(threads, [&] {
        RowMatrix<Scalar> y = x, dx(B * T, H * head_dim);
        embedhead::rope_forward(table, y, H, positions);
        embedhead::rope_backward(table, x, H, positions, dx);
        RowMatrix<Scalar> both(2 * B * T, H * head_dim);
        both << y, dx;
        return both;
      });
    };
    const RowMatrix<Scalar> one = run(1), two = run(2), again = run(2);
    CHECK(bit_identical(one, two));
    CHECK(bit_identical(two, again));
  }
}

TEST_CASE("threads: a token's logits and loss terms are the same bits alone on 1 thread and in a batch on 2",
          "[threads][batch_invariance]") {
  if (!std::is_same_v<embedhead::detail::gemm::DefaultBackend, embedhead::detail::gemm::PackedBackend>) return;
  const Index V = 3000, d = 300, N = 512;
  const RowMatrix<float> h = test_support::random_matrix<float>(N, d, 91);
  const RowMatrix<float> W = test_support::random_matrix<float>(V, d, 92, 0.1);
  const RowMatrix<float> b = test_support::random_matrix<float>(V, 1, 93);
  const IdMatrix<std::int64_t> targets = test_support::random_ids<std::int64_t>(N, 1, V, 94);
  // Alone, one thread: the decode path and a one-token fused loss.
  RowMatrix<float> alone(N, V), alone_losses(N, 1);
  with_threads(1, [&] {
    for (Index n = 0; n < N; ++n) {
      RowMatrix<float> row(1, V), loss(1, 1);
      embedhead::output_projection_decode<float>(h.row(n), W, b, row);
      alone.row(n) = row;
      embedhead::FusedHeadLossOptions options;
      options.reduction = embedhead::Reduction::none;
      embedhead::FusedHeadLossWorkspace<float> workspace;
      embedhead::FusedHeadLossExtras<float> extras{{nullptr, 0, 1}, {nullptr, 0, 1}, {loss.data(), 1, 1}};
      embedhead::fused_head_loss<float>(h.row(n), W, b, targets.row(n), workspace, options, extras);
      alone_losses(n, 0) = loss(0, 0);
    }
    return 0;
  });
  // The whole batch on two threads: the GEMM and both fused plans.
  for (const auto plan : {embedhead::FusedPlan::token_chunks, embedhead::FusedPlan::vocab_blocks}) {
    const auto [logits, losses] = with_threads(2, [&] {
      RowMatrix<float> out(N, V), loss(N, 1);
      embedhead::output_projection_forward<float>(h, W, b, out);
      embedhead::FusedHeadLossOptions options;
      options.reduction = embedhead::Reduction::none;
      options.plan = plan;
      embedhead::FusedHeadLossWorkspace<float> workspace;
      embedhead::FusedHeadLossExtras<float> extras{{nullptr, 0, 1}, {nullptr, 0, 1}, {loss.data(), N, 1}};
      embedhead::fused_head_loss<float>(h, W, b, targets, workspace, options, extras);
      return std::make_pair(out, loss);
    });
    CHECK(bit_identical(logits, alone));
    CHECK(bit_identical(losses, alone_losses));
  }
}

TEMPLATE_TEST_CASE("threads: score_head and the distillation (both plans) are bit-identical for 1, 2 and 3 threads",
                   "[threads][head_scores][distillation]", float, double) {
  // Their block products take one chunk of columns per thread (gemm::per_thread_columns): blocks
  // not a multiple of the packed kernel's tile, narrower than a tile, and a last short block.
  using S = TestType;
  struct Size {
    Index N, V, d, block;
  };
  const std::vector<Size> sizes = {{300, 1500, 24, 704}, {40, 2000, 64, 0}, {17, 23, 9, 0}, {9, 700, 33, 5}};
  for (const Size& s : sizes) {
    CAPTURE(s.N, s.V, s.d, s.block);
    const RowMatrix<S> h = test_support::random_matrix<S>(s.N, s.d, 81),
                       W = test_support::random_matrix<S>(s.V, s.d, 82);
    const RowMatrix<S> b = test_support::random_matrix<S>(s.V, 1, 83);
    const RowMatrix<S> hT = test_support::random_matrix<S>(s.N, s.d + 3, 84);
    const RowMatrix<S> WT = test_support::random_matrix<S>(s.V, s.d + 3, 85);
    const IdMatrix<std::int64_t> y = test_support::random_ids<std::int64_t>(s.N, 1, s.V, 86);
    auto scores = [&](int threads) {
      return with_threads(threads, [&] {
        embedhead::HeadScoreOptions options;
        options.top_k = 5;
        options.temperature = 0.7;
        options.entropy = true;
        options.vocab_block = s.block;
        return embedhead::score_head<S>(h, W, b, y, options);
      });
    };
    auto distill = [&](int threads, embedhead::FusedPlan plan) {
      return with_threads(threads, [&] {
        RowMatrix<S> dh(s.N, s.d), dW = RowMatrix<S>::Zero(s.V, s.d), db = RowMatrix<S>::Zero(s.V, 1);
        RowMatrix<S> dhT(s.N, s.d + 3), dWT = RowMatrix<S>::Zero(s.V, s.d + 3), dbT = RowMatrix<S>::Zero(s.V, 1);
        embedhead::DistillationWorkspace<S> ws;
        embedhead::DistillationOptions options;
        options.vocab_block = s.block;
        options.plan = plan;
        // Token chunks of 7 tokens (several chunks and a short last one).
        if (plan == embedhead::FusedPlan::token_chunks) options.memory_budget = 7 * 2 * s.V * Index{sizeof(S)};
        const auto result = embedhead::distill_head_forward_backward<S>(h, W, b, hT, WT, b, dh, dW, db, dhT, dWT, dbT,
                                                                        ws, options);
        RowMatrix<S> loss(1, 1);
        loss(0, 0) = static_cast<S>(result.loss);
        return std::vector<RowMatrix<S>>{loss, dh, dW, db, dhT, dWT, dbT};
      });
    };
    const auto one = scores(1);
    for (const int threads : {2, 3}) {
      CAPTURE(threads);
      const auto other = scores(threads);
      CHECK(one.raw_logprob == other.raw_logprob);
      CHECK(one.processed_logprob == other.processed_logprob);
      CHECK(one.entropy == other.entropy);
      CHECK(one.top_ids == other.top_ids);
      CHECK(bit_identical<double>(one.top_logprobs, other.top_logprobs));
    }
    for (const embedhead::FusedPlan plan : {embedhead::FusedPlan::vocab_blocks, embedhead::FusedPlan::token_chunks}) {
      CAPTURE(static_cast<int>(plan));
      const auto d1 = distill(1, plan);
      for (const int threads : {2, 3}) {
        CAPTURE(threads);
        const auto other = distill(threads, plan);
        for (std::size_t i = 0; i < d1.size(); ++i) {
          CAPTURE(i);
          CHECK(bit_identical<S>(d1[i], other[i]));
        }
      }
    }
  }
}
