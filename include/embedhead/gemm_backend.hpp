// embedhead: which GEMM backend this build's matrix products run on, and whether it runs the
// kernels the CPU is fastest with.
//
//   GemmBackendInfo info = embedhead::gemm_backend();
//   info.name      "embedhead packed kernel", "Eigen 3.4.0", "OpenBLAS 0.3.21 ..." (its build
//                  configuration) or "BLIS"
//   info.kernels   the packed kernel: its tile, whether it fuses the multiply-add and the SIMD sets
//                  it was compiled for; Eigen: those SIMD sets; OpenBLAS: the core whose kernels it
//                  dispatched at load time (openblas_get_corename); BLIS: BLIS_ARCH_TYPE, if set
//   info.warning   empty, or why the fast kernels are not in use and what to set
//   info.bf16      what the bf16 mixed-precision products (the bf16 fused head loss) run on:
//                  "oneDNN <version>: <its kernel>" with embedhead::onednn and native bf16 kernels
//                  here, else "the float GEMM on bf16-rounded values" (and why, with oneDNN)
//
// The backend is fixed when the program is compiled (detail/gemm.hpp: the library's own packed
// kernel by default, Eigen's with EMBEDHEAD_GEMM_EIGEN defined, CBLAS with the CMake target
// embedhead::cblas). A BLAS picks its kernels when it is loaded, from the
// CPU and the environment; some misdetect recent Xeons and fall back to old kernels (issue 14 saw
// Debian's threaded OpenBLAS 0.3.21 run its 'Prescott' SSE3 kernels on an Emerald Rapids Xeon, at
// 17 % of the FMA peak; on the project's Xeon, Debian's serial BLIS 0.9 ran the GPT-2 head forward
// in 1.89 s, 0.97 s with BLIS_ARCH_TYPE=skx: bench/RESULTS.md), and a running process cannot change that:
// OPENBLAS_CORETYPE (OpenBLAS) or BLIS_ARCH_TYPE (BLIS) must be in the environment before the program starts. So this
// reports rather than fixes; the benchmarks print it with their results.
#ifndef EMBEDHEAD_GEMM_BACKEND_HPP
#define EMBEDHEAD_GEMM_BACKEND_HPP

#include "detail/gemm.hpp"

#include <Eigen/Core>

#include <cctype>
#include <cstdlib>
#include <initializer_list>
#include <string>

namespace embedhead {

struct GemmBackendInfo {
  std::string name;
  std::string kernels;
  std::string warning;
  std::string bf16;
};

namespace detail {

// Whether the CPU executing this has AVX-512F / AVX2 (false where the compiler cannot ask).
inline bool cpu_has(const char* feature) {
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
  if (std::string(feature) == "avx512f") return __builtin_cpu_supports("avx512f");
  if (std::string(feature) == "avx2") return __builtin_cpu_supports("avx2");
#endif
  (void)feature;
  return false;
}

// Whether core is one of names, ignoring case (a DYNAMIC_ARCH build says "SkylakeX", a build for
// one target "SKYLAKEX").
inline bool openblas_core_in(const std::string& core, std::initializer_list<const char*> names) {
  auto lower = [](std::string text) {
    for (char& c : text) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return text;
  };
  for (const char* name : names)
    if (lower(core) == lower(name)) return true;
  return false;
}

}  // namespace detail

// -> the backend of this build's GEMM seam (see the top of this file). Never throws but for
// std::bad_alloc.
inline GemmBackendInfo gemm_backend() {
  GemmBackendInfo info;
#if defined(EMBEDHEAD_GEMM_CBLAS) && defined(EMBEDHEAD_CBLAS_OPENBLAS)
  info.name = openblas_get_config();
  info.kernels = openblas_get_corename();
  const bool avx512 = detail::cpu_has("avx512f"), avx2 = detail::cpu_has("avx2");
  const bool has_avx512_kernels = detail::openblas_core_in(info.kernels, {"SkylakeX", "Cooperlake", "SapphireRapids"});
  const bool has_avx2_kernels = has_avx512_kernels ||
                                detail::openblas_core_in(info.kernels, {"Haswell", "Zen", "SkylakeX", "Cooperlake"});
  if (openblas_get_parallel() != 0)
    info.warning = "a threaded OpenBLAS is loaded (openblas_get_parallel() = " +
                   std::to_string(openblas_get_parallel()) +
                   "): its own threads split the sums by the thread count; load the serial build "
                   "(libopenblas-serial-dev), which embedhead::cblas links";
  else if (avx512 && !has_avx512_kernels)
    info.warning = "OpenBLAS runs its '" + info.kernels +
                   "' kernels on a CPU with AVX-512: start the program with OPENBLAS_CORETYPE=SkylakeX in the "
                   "environment";
  else if (avx2 && !has_avx2_kernels)
    info.warning = "OpenBLAS runs its '" + info.kernels +
                   "' kernels on a CPU with AVX2: start the program with OPENBLAS_CORETYPE=Haswell in the environment";
#elif defined(EMBEDHEAD_GEMM_CBLAS) && defined(EMBEDHEAD_CBLAS_BLIS)
  info.name = "BLIS";
  const char* arch = std::getenv("BLIS_ARCH_TYPE");
  info.kernels = arch ? std::string("BLIS_ARCH_TYPE=") + arch : "chosen by BLIS at load time (BLIS_ARCH_TYPE unset)";
  if (!arch && detail::cpu_has("avx512f"))
    info.warning =
        "BLIS_ARCH_TYPE is unset on a CPU with AVX-512, and Debian's BLIS 0.9 was measured at half the speed of "
        "its skx kernels on such a Xeon: start the program with BLIS_ARCH_TYPE=skx in the environment";
#elif defined(EMBEDHEAD_GEMM_CBLAS)
  info.name = "CBLAS";
  info.kernels = "unknown (not OpenBLAS or BLIS)";
#else
#if defined(EMBEDHEAD_GEMM_EIGEN)
  info.name = "Eigen " + std::to_string(EIGEN_WORLD_VERSION) + "." + std::to_string(EIGEN_MAJOR_VERSION) + "." +
              std::to_string(EIGEN_MINOR_VERSION);
  info.kernels = Eigen::SimdInstructionSetsInUse();
#else
  using Tile = detail::gemm::PackedTile<float>;
  info.name = "embedhead packed kernel";
  info.kernels = std::to_string(Tile::rows) + " x " + std::to_string(Tile::cols) + " float tiles, " +
                 (detail::gemm::packed_gemm_fuses() ? "fused multiply-add, " : "multiply then add, ") +
                 Eigen::SimdInstructionSetsInUse();
#endif
  if (detail::cpu_has("avx512f") && info.kernels.find("AVX512") == std::string::npos)
    info.warning =
        "compiled without AVX-512 on a CPU that has it: -march=native (or -mavx512f -mfma) makes "
        "the kernels twice as wide";
  else if (detail::cpu_has("avx2") && info.kernels.find("AVX2") == std::string::npos)
    info.warning =
        "compiled without AVX2 and FMA on a CPU that has them: -march=native (or -mavx2 -mfma) makes "
        "the kernels twice as wide";
#endif
  info.bf16 = "the float GEMM on bf16-rounded values";
#if defined(EMBEDHEAD_HAVE_ONEDNN)
  const dnnl_version_t* version = dnnl_version();
  const std::string onednn = "oneDNN " + std::to_string(version->major) + "." + std::to_string(version->minor) + "." +
                             std::to_string(version->patch);
  if (detail::gemm::OneDnnBackend::usable()) {
    info.bf16 = onednn + ": " + detail::gemm::OneDnnBackend::kernel_name();
  } else {
    std::string kernel;
    try {
      kernel = detail::gemm::OneDnnBackend::kernel_name();
    } catch (const dnnl::error& e) {
      kernel = std::string("none (") + e.what() + ")";
    }
    info.bf16 += " (" + onednn + " has no native bf16 kernel here: " + kernel + ")";
  }
#endif
  return info;
}

}  // namespace embedhead

#endif  // EMBEDHEAD_GEMM_BACKEND_HPP
