// Helpers shared by the programs in bench/: the correctness-failure exit, number formatting and
// the seeded inputs. No Google Benchmark dependency, so the plain tour.cpp can use it too; the
// google-benchmark main() is in gbench_main.hpp.
//
// Include this header FIRST in every bench/*.cpp, before any other header: see the pragma below.
#ifndef EMBEDHEAD_BENCH_BENCH_SUPPORT_HPP
#define EMBEDHEAD_BENCH_BENCH_SUPPORT_HPP

// GCC 12 reports -Wmaybe-uninitialized and -Wuninitialized inside its own AVX-512 intrinsics (the
// deliberately undefined _mm512_undefined_ps / _mm256_undefined_pd operands, GCC bug 105593) when
// Eigen code (GEMM, a 16-lane double sum's reduction) is inlined under -march=native; the
// benchmarks also build with -Werror. The pragmas must come before any include so that they cover
// the intrinsic headers; they are deliberately not pushed and popped, so they stay in force to the
// end of the including translation unit.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <embedhead/init.hpp>
#include <embedhead/types.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

namespace bench_support {

using embedhead::IdMatrix;
using embedhead::Index;

// Prints "<program>: correctness check failed: <what>" to stderr and exits with status 1, so a
// broken kernel is never timed and a script running the binary sees the failure.
[[noreturn]] inline void fail(const char* program, const std::string& what) {
  std::fprintf(stderr, "%s: correctness check failed: %s\n", program, what.c_str());
  std::exit(EXIT_FAILURE);
}

// x with 7 significant digits (enough to show a float's rounding), for failure messages.
inline std::string number(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%.7g", x);
  return text;
}

// m(r, c) = scale * (2u - 1), u uniform in [0, 1) from the library's counter-based Rng at counter
// r * cols + c: values in [-scale, scale), the same for a given (shape, seed) on every machine.
// Much cheaper than the normal init for the 823 MB tables, and the timings only need ordinary
// finite floats.
inline void fill_uniform(embedhead::MatrixRef<float> m, std::uint64_t seed, double scale = 1.0) {
  const embedhead::Rng rng(seed);
  for (Index r = 0; r < m.rows(); ++r)
    for (Index c = 0; c < m.cols(); ++c)
      m(r, c) = static_cast<float>(scale * (2.0 * rng.uniform_at(static_cast<std::uint64_t>(r * m.cols() + c)) - 1.0));
}

// -> ids [1, N] uniform over [0, V): every row of E is equally likely, as in a realistic gather.
inline IdMatrix<std::int32_t> random_ids(Index N, Index V, unsigned seed) {
  std::mt19937 engine(seed);
  std::uniform_int_distribution<std::int32_t> id(0, static_cast<std::int32_t>(V - 1));
  IdMatrix<std::int32_t> ids(1, N);
  for (Index n = 0; n < N; ++n) ids(0, n) = id(engine);
  return ids;
}

// The FMA peak of one core, the limit the GEMM-bound benchmarks are measured against: `rounds`
// rounds of kFmaChains independent fused multiply-adds on Eigen's widest float packet (16 floats
// with AVX-512), enough chains in flight to cover the FMA latency on two ports. Returns the flops
// done (2 per lane per FMA); sink keeps the result alive.
constexpr int kFmaChains = 16;
inline double fma_peak_kernel(long rounds, float* sink) {
  using Packet = Eigen::internal::packet_traits<float>::type;
  constexpr int kLanes = Eigen::internal::packet_traits<float>::size;
  Packet acc[kFmaChains];
  for (int i = 0; i < kFmaChains; ++i) acc[i] = Eigen::internal::pset1<Packet>(0.001f * static_cast<float>(i));
  const Packet a = Eigen::internal::pset1<Packet>(0.999999f), b = Eigen::internal::pset1<Packet>(1e-7f);
  for (long r = 0; r < rounds; ++r)
    for (int i = 0; i < kFmaChains; ++i) acc[i] = Eigen::internal::pmadd(acc[i], a, b);
  Packet total = acc[0];
  for (int i = 1; i < kFmaChains; ++i) total = Eigen::internal::padd(total, acc[i]);
  *sink = Eigen::internal::predux(total);
  return 2.0 * kLanes * kFmaChains * static_cast<double>(rounds);
}

}  // namespace bench_support

#endif  // EMBEDHEAD_BENCH_BENCH_SUPPORT_HPP
