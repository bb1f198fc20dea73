// Tests for include/embedhead/detail/gemm.hpp (the one seam of the library's matrix products) and
// include/embedhead/gemm_backend.hpp.
//
// Every backend compiled in (Eigen always; CBLAS in a build with embedhead::cblas) is checked on
// every layout pair and Init against a triple loop in double, over shapes that exercise the edges:
// K = 0, padded leading dimensions, several chunks along rows and along columns, a strided bias;
// then a single row whose leading dimension is smaller than the row (what an Eigen view of one
// row may carry), and Init::zero over a C full of NaN (C must not be read).
#include <catch2/catch.hpp>
#include <embedhead/detail/gemm.hpp>
#include <embedhead/gemm_backend.hpp>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "reference/test_support.hpp"

namespace {

using embedhead::Index;
namespace gemm = embedhead::detail::gemm;

// X [rows, cols] in `layout` with leading dimension ld, as a flat buffer: element (i, j) is
// X[i * ld + j] (row_major) or X[i + j * ld] (col_major).
template <typename Scalar>
struct Stored {
  std::vector<Scalar> data;
  Index ld;
};

template <typename Scalar>
Scalar value_at(std::uint64_t seed, Index i) {
  // Small integers over 8: every product and partial sum below is exact in float, so any
  // summation order gives the same bits and the comparison can be exact.
  return static_cast<Scalar>(static_cast<int>((seed * 2654435761u + static_cast<std::uint64_t>(i) * 40503u) % 17) - 8) /
         Scalar(8);
}

template <typename Scalar>
Stored<Scalar> make(gemm::Layout layout, Index rows, Index cols, Index pad, std::uint64_t seed) {
  const Index ld = (layout == gemm::Layout::row_major ? cols : rows) + pad;
  const Index outer = layout == gemm::Layout::row_major ? rows : cols;
  Stored<Scalar> s{std::vector<Scalar>(static_cast<std::size_t>(std::max<Index>(outer * ld, 1))), ld};
  for (std::size_t i = 0; i < s.data.size(); ++i) s.data[i] = value_at<Scalar>(seed, static_cast<Index>(i));
  return s;
}

template <typename Scalar>
double at(const Stored<Scalar>& s, gemm::Layout layout, Index i, Index j) {
  return static_cast<double>(layout == gemm::Layout::row_major ? s.data[static_cast<std::size_t>(i * s.ld + j)]
                                                               : s.data[static_cast<std::size_t>(i + j * s.ld)]);
}

template <typename Backend, typename Scalar, gemm::Layout LA, gemm::Layout LB>
void check_layouts(const char* backend) {
  struct Shape {
    Index M, N, K, pad;
    gemm::Plan plan;
  };
  const std::vector<Shape> shapes{{5, 7, 3, 0, {gemm::Split::cols, 3, true}},
                                  {9, 4, 11, 2, {gemm::Split::rows, 4, true}},
                                  {1, 13, 6, 5, {gemm::Split::cols, 5, false}},
                                  {6, 1, 9, 1, {gemm::Split::rows, 2, true}},
                                  {4, 6, 0, 0, {gemm::Split::cols, 4, true}},
                                  {40, 33, 70, 3, {gemm::Split::cols, 16, true}}};
  for (const Shape& shape : shapes)
    for (gemm::Init init : {gemm::Init::zero, gemm::Init::keep, gemm::Init::bias}) {
      CAPTURE(backend, static_cast<int>(LA), static_cast<int>(LB), static_cast<int>(init), shape.M, shape.N, shape.K,
              shape.pad);
      const Stored<Scalar> A = make<Scalar>(LA, shape.M, shape.K, shape.pad, 1);
      const Stored<Scalar> B = make<Scalar>(LB, shape.K, shape.N, shape.pad, 2);
      Stored<Scalar> C = make<Scalar>(gemm::Layout::row_major, shape.M, shape.N, shape.pad, 3);
      const Stored<Scalar> bias = make<Scalar>(gemm::Layout::row_major, shape.N, 1, 1, 4);  // stride 2
      // The expected C, in double: the start (0, C itself, or the bias) plus the products.
      std::vector<double> expected(static_cast<std::size_t>(shape.M * shape.N));
      for (Index i = 0; i < shape.M; ++i)
        for (Index j = 0; j < shape.N; ++j) {
          double sum = init == gemm::Init::keep   ? at(C, gemm::Layout::row_major, i, j)
                       : init == gemm::Init::bias ? static_cast<double>(bias.data[static_cast<std::size_t>(j * 2)])
                                                  : 0.0;
          for (Index k = 0; k < shape.K; ++k) sum += at(A, LA, i, k) * at(B, LB, k, j);
          expected[static_cast<std::size_t>(i * shape.N + j)] = sum;
        }
      // A padding value past each row of C must survive.
      const Scalar guard = shape.pad > 0 ? C.data[static_cast<std::size_t>(shape.N)] : Scalar(0);
      const gemm::Op<Scalar, LA, LB> op{shape.M,       shape.N, shape.K, A.data.data(),    A.ld, B.data.data(), B.ld,
                                        C.data.data(), C.ld,    init,    bias.data.data(), 2};
      for (gemm::Kernel kernel : {gemm::Kernel::gemm, gemm::Kernel::expression}) {
        Stored<Scalar> out = C;
        gemm::Op<Scalar, LA, LB> run_op = op;
        run_op.c = out.data.data();
        if (kernel == gemm::Kernel::gemm)
          gemm::run<gemm::Kernel::gemm, Backend>(run_op, shape.plan);
        else
          gemm::run<gemm::Kernel::expression, Backend>(run_op, shape.plan);
        bool equal = true;
        for (Index i = 0; i < shape.M; ++i)
          for (Index j = 0; j < shape.N; ++j)
            equal = equal &&
                    at(out, gemm::Layout::row_major, i, j) == expected[static_cast<std::size_t>(i * shape.N + j)];
        CHECK(equal);
        if (shape.pad > 0 && shape.M > 0) CHECK(out.data[static_cast<std::size_t>(shape.N)] == guard);
      }
    }
}

template <typename Backend, typename Scalar>
void check_backend(const char* name) {
  check_layouts<Backend, Scalar, gemm::Layout::row_major, gemm::Layout::row_major>(name);
  check_layouts<Backend, Scalar, gemm::Layout::row_major, gemm::Layout::col_major>(name);
  check_layouts<Backend, Scalar, gemm::Layout::col_major, gemm::Layout::row_major>(name);
  check_layouts<Backend, Scalar, gemm::Layout::col_major, gemm::Layout::col_major>(name);
}

}  // namespace

TEMPLATE_TEST_CASE("gemm seam: every backend, layout pair and Init against a triple loop", "[gemm]", float, double) {
  check_backend<gemm::EigenBackend, TestType>("Eigen");
#if defined(EMBEDHEAD_GEMM_CBLAS)
  check_backend<gemm::CblasBackend, TestType>("CBLAS");
#endif
}

template <typename Backend>
void check_single_row_and_nan(const char* backend) {
  CAPTURE(backend);
  // h [1, 5] with lda = 1, W [7, 5] (op(B) = W^T) with ldb = 5, logits [1, 7] with ldc = 2.
  const Index K = 5, N = 7;
  std::vector<float> h(K), W(static_cast<std::size_t>(N * K));
  for (Index k = 0; k < K; ++k) h[static_cast<std::size_t>(k)] = value_at<float>(5, k);
  for (Index i = 0; i < N * K; ++i) W[static_cast<std::size_t>(i)] = value_at<float>(6, i);
  for (gemm::Kernel kernel : {gemm::Kernel::gemm, gemm::Kernel::expression}) {
    std::vector<float> C(static_cast<std::size_t>(N), std::numeric_limits<float>::quiet_NaN());
    const gemm::Op<float, gemm::Layout::row_major, gemm::Layout::col_major> op{
        1, N, K, h.data(), 1, W.data(), K, C.data(), 2, gemm::Init::zero};
    if (kernel == gemm::Kernel::gemm)
      gemm::run<gemm::Kernel::gemm, Backend>(op, gemm::Plan{gemm::Split::cols, 3, false});
    else
      gemm::run<gemm::Kernel::expression, Backend>(op, gemm::Plan{gemm::Split::cols, 3, false});
    bool equal = true;
    for (Index n = 0; n < N; ++n) {
      double sum = 0;
      for (Index k = 0; k < K; ++k)
        sum += static_cast<double>(h[static_cast<std::size_t>(k)]) * W[static_cast<std::size_t>(n * K + k)];
      equal = equal && static_cast<double>(C[static_cast<std::size_t>(n)]) == sum;
    }
    CHECK(equal);
  }
}

TEST_CASE("gemm seam: a single row with a short leading dimension, and Init::zero never reads C", "[gemm]") {
  check_single_row_and_nan<gemm::EigenBackend>("Eigen");
#if defined(EMBEDHEAD_GEMM_CBLAS)
  check_single_row_and_nan<gemm::CblasBackend>("CBLAS");
#endif
}

TEST_CASE("gemm seam: the default backend is the one the build asks for", "[gemm]") {
#if defined(EMBEDHEAD_GEMM_CBLAS)
  CHECK(std::is_same_v<gemm::DefaultBackend, gemm::CblasBackend>);
#else
  CHECK(std::is_same_v<gemm::DefaultBackend, gemm::EigenBackend>);
#endif
}

TEST_CASE("gemm_backend names the backend and its kernels", "[gemm]") {
  const embedhead::GemmBackendInfo info = embedhead::gemm_backend();
  CAPTURE(info.name, info.kernels, info.warning);
  CHECK(!info.kernels.empty());
#if defined(EMBEDHEAD_GEMM_CBLAS) && defined(EMBEDHEAD_CBLAS_OPENBLAS)
  CHECK(info.name.rfind("OpenBLAS", 0) == 0);
#elif defined(EMBEDHEAD_GEMM_CBLAS) && defined(EMBEDHEAD_CBLAS_BLIS)
  CHECK(info.name == "BLIS");
#elif !defined(EMBEDHEAD_GEMM_CBLAS)
  CHECK(info.name == "Eigen " + std::to_string(EIGEN_WORLD_VERSION) + "." + std::to_string(EIGEN_MAJOR_VERSION) + "." +
                         std::to_string(EIGEN_MINOR_VERSION));
  CHECK(info.kernels == Eigen::SimdInstructionSetsInUse());
#endif
#if !defined(EMBEDHEAD_HAVE_ONEDNN)
  CHECK(std::is_same_v<gemm::MixedBackend, gemm::DefaultBackend>);
  CHECK(info.bf16 == "the float GEMM on bf16-rounded values");
#endif
}
