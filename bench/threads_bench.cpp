// The threaded paths on 1 and 2 OpenMP threads (built with OpenMP when CMake finds it).
//
//   Lookup/threads:T          TokenEmbedding::forward, GPT-2 shape, N = 8192 random ids
//   SparseBackward/threads:T  zero_grad + TokenEmbedding::backward, same shape
//
// The LM head at GPT-2 shape (N = 1024, d = 768, V = 50257, float), in GFLOP/s (FLOPS counter):
//   HeadForward/threads:T/vchunk:C            logits = h W^T + b by chunks of C rows of W
//   HeadBackward/threads:T/vchunk:C/tchunk:R  dW += dlogits^T h, db += .. by chunks of C rows of
//                                             W, then dh = dlogits W by chunks of R tokens (on
//                                             the packed kernel C and R are ignored: one chunk
//                                             per thread, gemm::per_thread_plan)
//   HeadBackwardTokens/threads:T/N:n          output_projection_backward on the first n tokens
//   EigenHeadForward/threads:T, EigenHeadBackward/threads:T
//                                             the same arithmetic as single Eigen products, split
//                                             by Eigen's own GEMM threading (Eigen::setNbThreads)
//   EigenGemm/square/threads:T                2048^3 Eigen GEMM: the measured fp32 peak
// The decode path, in bytes of W per second (bytes_per_second counter):
//   Decode/N:n/V:../d:../threads:T            output_projection_decode, n = 1, 2, 4, 8 tokens
//   EigenDecode/...                           the same as one Eigen product (GEMV for n = 1)
//   DecodeBf16/...                            the bf16 head's decode (LowPrecisionOutputProjection
//                                             forward, W widened as it streams), W rounded to bf16;
//                                             bytes counted as W's float bytes, like DecodeInt8
//   DecodeBf16Interleaved/...                 the same table in InterleavedBf16Head's layout
//                                             (interleaved_head.hpp), checked bit-identical to
//                                             DecodeBf16; bytes counted as W's float bytes
//   DecodeInt8/...                            the int8 head (quantized_head_forward) on W quantized
//                                             per row; its bytes_per_second also counts W's float
//                                             bytes, so its rate over Decode's is the speed-up
//   ReadW/..., MemcpyW/...                    a vectorised sum over W and a memcpy of W, by the
//                                             same chunks: the bandwidth ceiling of the decode
//
// Before timing, the 2-thread results are checked bit-identical to the 1-thread ones, and each
// head benchmark checks its result against Eigen's product once.
#include "bench_support.hpp"  // first: its pragma must precede every other include

#include "gbench_main.hpp"

#include <embedhead/embedhead.hpp>

#include <benchmark/benchmark.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace {

using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::RowMatrix;
using embedhead::TokenEmbedding;

constexpr const char* kProgram = "threads_bench";
constexpr Index kV = 50257, kD = 768, kN = 8192;

struct Problem {
  TokenEmbedding<float> embedding{kV, kD};
  IdMatrix<std::int32_t> ids = bench_support::random_ids(kN, kV, 1);
  RowMatrix<float> dout = RowMatrix<float>(kN, kD);
  RowMatrix<float> out = RowMatrix<float>(kN, kD);
  Problem() { bench_support::fill_uniform(dout, 2); }
};

Problem& problem() {
  static Problem p;
  return p;
}

// Runs the lookup and backward with `threads` threads and returns (output, dense gradient).
std::pair<RowMatrix<float>, RowMatrix<float>> run_once(int threads) {
  Problem& p = problem();
  omp_set_num_threads(threads);
  p.embedding.forward(p.ids, p.out);
  p.embedding.zero_grad();
  p.embedding.backward(p.ids, p.dout);
  return {p.out, p.embedding.weight().grad().to_dense()};
}

void check_thread_counts_agree() {
  const auto one = run_once(1), two = run_once(2);
  const auto same = [](const RowMatrix<float>& a, const RowMatrix<float>& b) {
    return std::memcmp(a.data(), b.data(), sizeof(float) * static_cast<std::size_t>(a.size())) == 0;
  };
  if (!same(one.first, two.first)) bench_support::fail(kProgram, "lookup differs between 1 and 2 threads");
  if (!same(one.second, two.second)) bench_support::fail(kProgram, "backward differs between 1 and 2 threads");
}

void BM_Lookup(benchmark::State& state) {
  Problem& p = problem();
  omp_set_num_threads(static_cast<int>(state.range(0)));
  for (auto _ : state) {
    p.embedding.forward(p.ids, p.out);
    benchmark::DoNotOptimize(p.out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * kN * kD * static_cast<std::int64_t>(sizeof(float)));
}

void BM_SparseBackward(benchmark::State& state) {
  Problem& p = problem();
  omp_set_num_threads(static_cast<int>(state.range(0)));
  for (auto _ : state) {
    p.embedding.zero_grad();
    p.embedding.backward(p.ids, p.dout);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * kN * kD * static_cast<std::int64_t>(sizeof(float)));
}

// ---- the LM head ----

constexpr Index kTokens = 1024;

struct HeadProblem {
  RowMatrix<float> W = RowMatrix<float>(kV, kD), b = RowMatrix<float>(kV, 1);
  RowMatrix<float> h = RowMatrix<float>(kTokens, kD), dlogits = RowMatrix<float>(kTokens, kV);
  RowMatrix<float> logits = RowMatrix<float>(kTokens, kV), dh = RowMatrix<float>(kTokens, kD);
  RowMatrix<float> dW = RowMatrix<float>::Zero(kV, kD), db = RowMatrix<float>::Zero(kV, 1);
  // Eigen's products (one thread), computed on first use: the correctness references.
  RowMatrix<float> logits_ref, dh_ref, dW_ref;
  HeadProblem() {
    bench_support::fill_uniform(W, 3, 0.05);
    bench_support::fill_uniform(b, 4, 0.1);
    bench_support::fill_uniform(h, 5);
    bench_support::fill_uniform(dlogits, 6, 1.0 / kTokens);
  }
};

HeadProblem& head_problem() {
  static HeadProblem p;
  return p;
}

// Fails unless every entry of got is within 1e-4 of the largest |entry| of expected: a loose
// bound (float rounding here is near 1e-6 of it) that still catches a wrong index, a lost
// transpose, a missing bias or chunk, or a result from another input.
void check_close(const RowMatrix<float>& got, const RowMatrix<float>& expected, const std::string& what) {
  const float scale = expected.cwiseAbs().maxCoeff();
  const float error = (got - expected).cwiseAbs().maxCoeff();
  if (!(error <= 1e-4f * scale))
    bench_support::fail(kProgram, what + ": max error " + bench_support::number(error) +
                                      " against Eigen's product (scale " + bench_support::number(scale) + ")");
}

const RowMatrix<float>& forward_reference() {
  HeadProblem& p = head_problem();
  if (p.logits_ref.size() == 0) {
    Eigen::setNbThreads(1);
    p.logits_ref.noalias() = p.h * p.W.transpose();
    p.logits_ref.rowwise() += p.b.col(0).transpose();
    Eigen::setNbThreads(0);
  }
  return p.logits_ref;
}

void backward_reference() {
  HeadProblem& p = head_problem();
  if (p.dW_ref.size() == 0) {
    Eigen::setNbThreads(1);
    p.dW_ref.noalias() = p.dlogits.transpose() * p.h;
    p.dh_ref.noalias() = p.dlogits * p.W;
    Eigen::setNbThreads(0);
  }
}

constexpr double kHeadFlops = 2.0 * kTokens * kV * kD;

void set_flops(benchmark::State& state, double flops) {
  state.counters["FLOPS"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
}

// Eigen's own threading is off for the library's head (it never uses it); Eigen::setNbThreads(T)
// for the Eigen baselines; omp_set_num_threads(T) for both.
void use_threads(int threads, bool eigen_threads) {
  omp_set_num_threads(threads);
  Eigen::setNbThreads(eigen_threads ? threads : 1);
}

void BM_HeadForward(benchmark::State& state) {
  HeadProblem& p = head_problem();
  const Index chunk = state.range(1);
  use_threads(static_cast<int>(state.range(0)), false);
  auto run = [&] { embedhead::detail::head_forward_chunked<float>(p.h, p.W, p.b, p.logits, chunk); };
  run();
  check_close(p.logits, forward_reference(), "HeadForward");
  for (auto _ : state) {
    run();
    benchmark::DoNotOptimize(p.logits.data());
    benchmark::ClobberMemory();
  }
  set_flops(state, kHeadFlops);
}

void BM_EigenHeadForward(benchmark::State& state) {
  HeadProblem& p = head_problem();
  use_threads(static_cast<int>(state.range(0)), true);
  auto run = [&] {
    p.logits.noalias() = p.h * p.W.transpose();
    p.logits.rowwise() += p.b.col(0).transpose();
  };
  run();
  check_close(p.logits, forward_reference(), "EigenHeadForward");
  for (auto _ : state) {
    run();
    benchmark::DoNotOptimize(p.logits.data());
    benchmark::ClobberMemory();
  }
  Eigen::setNbThreads(0);
  set_flops(state, kHeadFlops);
}

// Gradients are zeroed before the check and not in the loop: they accumulate over iterations,
// as in training without zero_grad, which costs the same.
void BM_HeadBackward(benchmark::State& state) {
  HeadProblem& p = head_problem();
  const Index vocab_chunk = state.range(1), token_chunk = state.range(2);
  use_threads(static_cast<int>(state.range(0)), false);
  auto run = [&] {
    embedhead::detail::head_backward_chunked<float>(p.h, p.W, p.dlogits, p.dh, p.dW, p.db, vocab_chunk, token_chunk);
  };
  p.dW.setZero();
  p.db.setZero();
  run();
  backward_reference();
  check_close(p.dh, p.dh_ref, "HeadBackward dh");
  check_close(p.dW, p.dW_ref, "HeadBackward dW");
  for (auto _ : state) {
    run();
    benchmark::DoNotOptimize(p.dh.data());
    benchmark::DoNotOptimize(p.dW.data());
    benchmark::ClobberMemory();
  }
  set_flops(state, 2 * kHeadFlops);
}

// The public backward (output_projection_backward: the library's own plan, on the packed kernel one
// chunk per thread) on the first N tokens, N = 128, 256, 1024: at small N the fixed plan of 256
// tokens a chunk ran dh on one thread. Checked against Eigen's products of the same rows first.
void BM_HeadBackwardTokens(benchmark::State& state) {
  HeadProblem& p = head_problem();
  const Index N = state.range(1);
  use_threads(static_cast<int>(state.range(0)), false);
  const auto h = p.h.topRows(N);
  const auto dlogits = p.dlogits.topRows(N);
  auto dh = p.dh.topRows(N);
  RowMatrix<float> no_db(0, 1);
  auto run = [&] { embedhead::output_projection_backward<float>(h, p.W, dlogits, dh, p.dW, no_db); };
  p.dW.setZero();
  run();
  Eigen::setNbThreads(1);
  const RowMatrix<float> dh_ref = dlogits * p.W, dW_ref = dlogits.transpose() * h;
  Eigen::setNbThreads(0);
  check_close(RowMatrix<float>(dh), dh_ref, "HeadBackwardTokens dh");
  check_close(p.dW, dW_ref, "HeadBackwardTokens dW");
  for (auto _ : state) {
    run();
    benchmark::DoNotOptimize(p.dh.data());
    benchmark::DoNotOptimize(p.dW.data());
    benchmark::ClobberMemory();
  }
  set_flops(state, 4.0 * static_cast<double>(N) * kV * kD);
}

void BM_EigenHeadBackward(benchmark::State& state) {
  HeadProblem& p = head_problem();
  use_threads(static_cast<int>(state.range(0)), true);
  auto run = [&] {
    p.dW.noalias() += p.dlogits.transpose() * p.h;
    p.db.col(0) += p.dlogits.colwise().sum().transpose();
    p.dh.noalias() = p.dlogits * p.W;
  };
  p.dW.setZero();
  p.db.setZero();
  run();
  backward_reference();
  check_close(p.dh, p.dh_ref, "EigenHeadBackward dh");
  check_close(p.dW, p.dW_ref, "EigenHeadBackward dW");
  for (auto _ : state) {
    run();
    benchmark::DoNotOptimize(p.dh.data());
    benchmark::DoNotOptimize(p.dW.data());
    benchmark::ClobberMemory();
  }
  Eigen::setNbThreads(0);
  set_flops(state, 2 * kHeadFlops);
}

// C [2048, 2048] = A B with Eigen's threading: the measured peak on T threads.
void BM_EigenGemmSquare(benchmark::State& state) {
  const Index n = 2048;
  use_threads(static_cast<int>(state.range(0)), true);
  RowMatrix<float> A(n, n), B(n, n), C(n, n);
  bench_support::fill_uniform(A, 7);
  bench_support::fill_uniform(B, 8);
  C.noalias() = A * B;
  const double expected = A.row(5).cast<double>().dot(B.col(9).cast<double>());
  if (!(std::abs(C(5, 9) - expected) <= 1e-3)) bench_support::fail(kProgram, "EigenGemm/square: C(5, 9) is wrong");
  for (auto _ : state) {
    C.noalias() = A * B;
    benchmark::DoNotOptimize(C.data());
    benchmark::ClobberMemory();
  }
  Eigen::setNbThreads(0);
  set_flops(state, 2.0 * n * n * n);
}

void check_head_thread_counts_agree() {
  HeadProblem& p = head_problem();
  auto forward = [&](int threads) {
    use_threads(threads, false);
    embedhead::output_projection_forward<float>(p.h, p.W, p.b, p.logits);
    return p.logits;
  };
  auto backward = [&](int threads) {
    use_threads(threads, false);
    p.dW.setZero();
    p.db.setZero();
    embedhead::output_projection_backward<float>(p.h, p.W, p.dlogits, p.dh, p.dW, p.db);
    return std::vector<RowMatrix<float>>{p.dh, p.dW, p.db};
  };
  const auto same = [](const RowMatrix<float>& a, const RowMatrix<float>& b) {
    return std::memcmp(a.data(), b.data(), sizeof(float) * static_cast<std::size_t>(a.size())) == 0;
  };
  if (!same(forward(1), forward(2))) bench_support::fail(kProgram, "head forward differs between 1 and 2 threads");
  const auto one = backward(1), two = backward(2);
  for (std::size_t i = 0; i < one.size(); ++i)
    if (!same(one[i], two[i])) bench_support::fail(kProgram, "head backward differs between 1 and 2 threads");
}

// ---- the decode path ----

struct DecodeProblem {
  RowMatrix<float> W, b, h, logits, copy;
  std::unique_ptr<embedhead::QuantizedEmbedding> int8;                             // built on first use
  std::unique_ptr<embedhead::LowPrecisionOutputProjection<Eigen::bfloat16>> bf16;  // built on first use
  std::unique_ptr<embedhead::InterleavedBf16Head> interleaved;                     // built on first use
  DecodeProblem(Index V, Index d) : W(V, d), b(V, 1), h(embedhead::detail::kDecodeMaxTokens, d), logits(h.rows(), V) {
    // Cheap deterministic values: the 256000 x 2048 table has 524 M entries.
    for (Index v = 0; v < V; ++v)
      for (Index j = 0; j < d; ++j) W(v, j) = static_cast<float>(((v * 31 + j * 7) % 61) - 30) * 1e-3f;
    bench_support::fill_uniform(b, 9, 0.1);
    bench_support::fill_uniform(h, 10);
  }
};

DecodeProblem& decode_problem(Index V, Index d) {
  static std::vector<std::unique_ptr<DecodeProblem>> problems;
  for (auto& p : problems)
    if (p->W.rows() == V && p->W.cols() == d) return *p;
  problems.clear();  // one table at a time: the large one is 2 GiB
  problems.push_back(std::make_unique<DecodeProblem>(V, d));
  return *problems.back();
}

void set_bytes_of_W(benchmark::State& state, const RowMatrix<float>& W) {
  state.SetBytesProcessed(state.iterations() * W.size() * static_cast<std::int64_t>(sizeof(float)));
}

// args: n, V, d, threads
void BM_Decode(benchmark::State& state) {
  const Index n = state.range(0);
  DecodeProblem& p = decode_problem(state.range(1), state.range(2));
  use_threads(static_cast<int>(state.range(3)), false);
  const auto h = p.h.topRows(n);
  auto logits = p.logits.topRows(n);
  embedhead::output_projection_decode<float>(h, p.W, p.b, logits);
  RowMatrix<float> expected = h * p.W.transpose();
  expected.rowwise() += p.b.col(0).transpose();
  check_close(logits, expected, "Decode");
  for (auto _ : state) {
    embedhead::output_projection_decode<float>(h, p.W, p.b, logits);
    benchmark::DoNotOptimize(p.logits.data());
    benchmark::ClobberMemory();
  }
  set_bytes_of_W(state, p.W);
}

void BM_DecodeInt8(benchmark::State& state) {
  const Index n = state.range(0);
  DecodeProblem& p = decode_problem(state.range(1), state.range(2));
  if (!p.int8) p.int8 = std::make_unique<embedhead::QuantizedEmbedding>(p.W);
  use_threads(static_cast<int>(state.range(3)), false);
  const auto h = p.h.topRows(n);
  auto logits = p.logits.topRows(n);
  embedhead::quantized_head_forward(h, p.int8->values(), p.int8->scales(), p.b, logits);
  // Against the float head: within the quantization bound sum_k |h_k| scale_v / 2 (+ rounding).
  RowMatrix<float> expected = h * p.W.transpose();
  expected.rowwise() += p.b.col(0).transpose();
  for (Index t = 0; t < n; ++t)
    for (Index v = 0; v < p.W.rows(); v += 997) {
      const double bound = h.row(t).cwiseAbs().sum() * p.int8->scales()(v, 0) / 2 + 1e-4;
      if (std::abs(logits(t, v) - expected(t, v)) > bound)
        bench_support::fail(kProgram, "DecodeInt8: a logit is outside the quantization bound");
    }
  for (auto _ : state) {
    embedhead::quantized_head_forward(h, p.int8->values(), p.int8->scales(), p.b, logits);
    benchmark::DoNotOptimize(p.logits.data());
    benchmark::ClobberMemory();
  }
  set_bytes_of_W(state, p.W);
}

void BM_DecodeBf16(benchmark::State& state) {
  const Index n = state.range(0);
  DecodeProblem& p = decode_problem(state.range(1), state.range(2));
  if (!p.bf16) p.bf16 = std::make_unique<embedhead::LowPrecisionOutputProjection<Eigen::bfloat16>>(p.W, p.b);
  use_threads(static_cast<int>(state.range(3)), false);
  const auto h = p.h.topRows(n);
  auto logits = p.logits.topRows(n);
  p.bf16->forward(h, logits);
  // Against the float head on the bf16-rounded W, computed in double for a few rows.
  const RowMatrix<float> Wr = embedhead::widen_table<Eigen::bfloat16>(p.bf16->weight().value().topRows(8));
  for (Index t = 0; t < n; ++t)
    for (Index v = 0; v < 8; ++v) {
      const double expected = Wr.row(v).cast<double>().dot(h.row(t).cast<double>()) + p.b(v, 0);
      if (std::abs(logits(t, v) - expected) > 1e-4 * (1 + std::abs(expected)))
        bench_support::fail(kProgram, "DecodeBf16: a logit differs from the float head on the rounded W");
    }
  for (auto _ : state) {
    p.bf16->forward(h, logits);
    benchmark::DoNotOptimize(p.logits.data());
    benchmark::ClobberMemory();
  }
  set_bytes_of_W(state, p.W);
}

void BM_DecodeBf16Interleaved(benchmark::State& state) {
  const Index n = state.range(0);
  DecodeProblem& p = decode_problem(state.range(1), state.range(2));
  if (!p.bf16) p.bf16 = std::make_unique<embedhead::LowPrecisionOutputProjection<Eigen::bfloat16>>(p.W, p.b);
  if (!p.interleaved) p.interleaved = std::make_unique<embedhead::InterleavedBf16Head>(p.bf16->weight().value(), p.b);
  use_threads(static_cast<int>(state.range(3)), false);
  const auto h = p.h.topRows(n);
  auto logits = p.logits.topRows(n);
  // The same bits as the row-major bf16 head (the float decode's sequence on the same rounded W).
  p.bf16->forward(h, logits);
  const RowMatrix<float> row_major = logits;
  logits.setConstant(std::numeric_limits<float>::quiet_NaN());  // a logit not written fails the check
  p.interleaved->forward(h, logits);
  if (std::memcmp(row_major.data(), RowMatrix<float>(logits).data(),
                  sizeof(float) * static_cast<std::size_t>(n * p.W.rows())) != 0)
    bench_support::fail(kProgram, "DecodeBf16Interleaved: a logit differs from the row-major bf16 head's");
  for (auto _ : state) {
    p.interleaved->forward(h, logits);
    benchmark::DoNotOptimize(p.logits.data());
    benchmark::ClobberMemory();
  }
  set_bytes_of_W(state, p.W);
}

void BM_EigenDecode(benchmark::State& state) {
  const Index n = state.range(0);
  DecodeProblem& p = decode_problem(state.range(1), state.range(2));
  use_threads(static_cast<int>(state.range(3)), true);
  const auto h = p.h.topRows(n);
  auto logits = p.logits.topRows(n);
  for (auto _ : state) {
    logits.noalias() = h * p.W.transpose();
    logits.rowwise() += p.b.col(0).transpose();
    benchmark::DoNotOptimize(p.logits.data());
    benchmark::ClobberMemory();
  }
  Eigen::setNbThreads(0);
  set_bytes_of_W(state, p.W);
}

// A 16-lane sum over W by the decode's chunks: reading W once, nothing else.
void BM_ReadW(benchmark::State& state) {
  DecodeProblem& p = decode_problem(state.range(1), state.range(2));
  use_threads(static_cast<int>(state.range(3)), false);
  using Lanes = Eigen::Array<float, 16, 1>;
  const Index chunk = embedhead::detail::kDecodeVocabChunk, d = p.W.cols();
  std::vector<float> partial(static_cast<std::size_t>((p.W.rows() + chunk - 1) / chunk));
  for (auto _ : state) {
    embedhead::detail::parallel_chunks(p.W.rows(), chunk, true, [&](Index v0, Index v1) {
      const float* data = p.W.data() + v0 * d;
      const Index size = (v1 - v0) * d;
      Lanes acc = Lanes::Zero();
      Index i = 0;
      for (; i + 16 <= size; i += 16) acc += Eigen::Map<const Lanes>(data + i);
      float tail = 0;
      for (; i < size; ++i) tail += data[i];
      partial[static_cast<std::size_t>(v0 / chunk)] = acc.sum() + tail;
    });
    benchmark::DoNotOptimize(partial.data());
    benchmark::ClobberMemory();
  }
  set_bytes_of_W(state, p.W);
}

void BM_MemcpyW(benchmark::State& state) {
  DecodeProblem& p = decode_problem(state.range(1), state.range(2));
  use_threads(static_cast<int>(state.range(3)), false);
  p.copy.resize(p.W.rows(), p.W.cols());
  const Index chunk = embedhead::detail::kDecodeVocabChunk, d = p.W.cols();
  auto copy = [&] {
    embedhead::detail::parallel_chunks(p.W.rows(), chunk, true, [&](Index v0, Index v1) {
      std::memcpy(p.copy.data() + v0 * d, p.W.data() + v0 * d, sizeof(float) * static_cast<std::size_t>((v1 - v0) * d));
    });
  };
  copy();  // the destination's pages are faulted in here, not in the timed loop
  if (!(p.copy == p.W)) bench_support::fail(kProgram, "MemcpyW: the copy differs");
  for (auto _ : state) {
    copy();
    benchmark::DoNotOptimize(p.copy.data());
    benchmark::ClobberMemory();
  }
  p.copy.resize(0, 0);
  set_bytes_of_W(state, p.W);
}

void register_benchmarks() {
  check_thread_counts_agree();
  check_head_thread_counts_agree();
  for (const int threads : {1, 2}) {
    benchmark::RegisterBenchmark("Lookup", BM_Lookup)
        ->Arg(threads)
        ->ArgName("threads")
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("SparseBackward", BM_SparseBackward)
        ->Arg(threads)
        ->ArgName("threads")
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
  for (const int threads : {1, 2}) {
    benchmark::RegisterBenchmark("EigenGemm/square", BM_EigenGemmSquare)
        ->Arg(threads)
        ->ArgName("threads")
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    for (const Index chunk : {256, 512, 1024, 2048, 4096})
      benchmark::RegisterBenchmark("HeadForward", BM_HeadForward)
          ->Args({threads, chunk})
          ->ArgNames({"threads", "vchunk"})
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("EigenHeadForward", BM_EigenHeadForward)
        ->Arg(threads)
        ->ArgName("threads")
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    for (const Index vocab_chunk : {512, 1024, 2048})
      for (const Index token_chunk : {128, 256, 512})
        benchmark::RegisterBenchmark("HeadBackward", BM_HeadBackward)
            ->Args({threads, vocab_chunk, token_chunk})
            ->ArgNames({"threads", "vchunk", "tchunk"})
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("EigenHeadBackward", BM_EigenHeadBackward)
        ->Arg(threads)
        ->ArgName("threads")
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    for (const Index tokens : {128, 256, 1024})
      benchmark::RegisterBenchmark("HeadBackwardTokens", BM_HeadBackwardTokens)
          ->Args({threads, tokens})
          ->ArgNames({"threads", "N"})
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
  }
  // Decode shapes grouped so that each table is built once.
  for (const auto& shape : std::vector<std::pair<Index, Index>>{{kV, kD}, {256000, 2048}})
    for (const int threads : {1, 2}) {
      const std::vector<std::int64_t> base = {0, shape.first, shape.second, threads};
      const std::vector<std::string> names = {"N", "V", "d", "threads"};
      benchmark::RegisterBenchmark("ReadW", BM_ReadW)->Args(base)->ArgNames(names)->UseRealTime();
      benchmark::RegisterBenchmark("MemcpyW", BM_MemcpyW)->Args(base)->ArgNames(names)->UseRealTime();
      for (const Index n : {1, 2, 4, 8}) {
        std::vector<std::int64_t> args = base;
        args[0] = n;
        benchmark::RegisterBenchmark("Decode", BM_Decode)->Args(args)->ArgNames(names)->UseRealTime();
        benchmark::RegisterBenchmark("EigenDecode", BM_EigenDecode)->Args(args)->ArgNames(names)->UseRealTime();
        benchmark::RegisterBenchmark("DecodeBf16", BM_DecodeBf16)->Args(args)->ArgNames(names)->UseRealTime();
        benchmark::RegisterBenchmark("DecodeBf16Interleaved", BM_DecodeBf16Interleaved)
            ->Args(args)
            ->ArgNames(names)
            ->UseRealTime();
        benchmark::RegisterBenchmark("DecodeInt8", BM_DecodeInt8)->Args(args)->ArgNames(names)->UseRealTime();
      }
    }
}

}  // namespace

int main(int argc, char** argv) { return bench_support::run_benchmarks(argc, argv, register_benchmarks); }
