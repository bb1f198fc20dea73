// Tests for include/embedhead/detail/gemm.hpp (the one seam of the library's matrix products) and
// include/embedhead/gemm_backend.hpp.
//
// Every backend compiled in (Eigen always; CBLAS in a build with embedhead::cblas) is checked on
// every layout pair and Init against a triple loop in double, over shapes that exercise the edges:
// K = 0, padded leading dimensions, several chunks along rows and along columns, a strided bias;
// then a single row whose leading dimension is smaller than the row (what an Eigen view of one
// row may carry), and Init::zero over a C full of NaN (C must not be read).
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <embedhead/detail/gemm.hpp>
#include <embedhead/gemm_backend.hpp>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "reference/test_support.hpp"

namespace {

using embedhead::Index;
using embedhead::RowMatrix;
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
                                  {40, 33, 70, 3, {gemm::Split::cols, 16, true}},
                                  // Across the packed kernel's blocks (depth 256, 240 rows, 1024 columns),
                                  // one chunk each.
                                  {250, 21, 300, 1, {gemm::Split::rows, 250, false}},
                                  {3, 1100, 260, 2, {gemm::Split::cols, 1100, false}}};
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
  check_backend<gemm::PackedBackend, TestType>("packed");
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
  check_single_row_and_nan<gemm::PackedBackend>("packed");
  check_single_row_and_nan<gemm::EigenBackend>("Eigen");
#if defined(EMBEDHEAD_GEMM_CBLAS)
  check_single_row_and_nan<gemm::CblasBackend>("CBLAS");
#endif
}

TEST_CASE("gemm seam: the default backend is the one the build asks for", "[gemm]") {
#if defined(EMBEDHEAD_GEMM_CBLAS)
  CHECK(std::is_same_v<gemm::DefaultBackend, gemm::CblasBackend>);
#elif defined(EMBEDHEAD_GEMM_EIGEN)
  CHECK(std::is_same_v<gemm::DefaultBackend, gemm::EigenBackend>);
#else
  CHECK(std::is_same_v<gemm::DefaultBackend, gemm::PackedBackend>);
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
#elif defined(EMBEDHEAD_GEMM_EIGEN)
  CHECK(info.name == "Eigen " + std::to_string(EIGEN_WORLD_VERSION) + "." + std::to_string(EIGEN_MAJOR_VERSION) + "." +
                         std::to_string(EIGEN_MINOR_VERSION));
  CHECK(info.kernels == Eigen::SimdInstructionSetsInUse());
#else
  CHECK(info.name == "embedhead packed kernel");
  CHECK(info.kernels.find(Eigen::SimdInstructionSetsInUse()) != std::string::npos);
  CHECK(info.kernels.find(gemm::packed_gemm_fuses() ? "fused multiply-add" : "multiply then add") != std::string::npos);
#endif
#if !defined(EMBEDHEAD_HAVE_ONEDNN)
  CHECK(std::is_same_v<gemm::MixedBackend, gemm::DefaultBackend>);
  CHECK(info.bf16 == "the float GEMM on bf16-rounded values");
#endif
}

// ---- the packed kernel's arithmetic, bit for bit ----

namespace {

// a b + c as detail/gemm_packed.hpp defines it: one rounding where the build fuses the packet
// multiply-add, a rounded product and a rounded sum otherwise.
template <typename Scalar>
Scalar reference_madd(Scalar a, Scalar b, Scalar c) {
  if constexpr (gemm::packed_gemm_fuses()) return std::fma(a, b, c);
  const Scalar product = a * b;
  return product + c;
}

// C (init) op(A) op(B), each element by the sequence written at the top of
// detail/gemm_packed.hpp: the sum over k in blocks of 256 from k = 0, each block a multiply-add
// chain from zero in increasing k, the block sums added to C in order (the first one stored,
// unless Init::keep), then the bias.
template <typename Scalar, gemm::Layout LA, gemm::Layout LB, typename BStorage, typename AStorage>
void reference_packed(const gemm::Op<Scalar, LA, LB, BStorage, AStorage>& op) {
  constexpr Index kDepth = 256;
  for (Index i = 0; i < op.M; ++i)
    for (Index j = 0; j < op.N; ++j) {
      Scalar& c = op.c[i * op.ldc + j];
      if (op.K == 0 && op.init != gemm::Init::keep) c = Scalar(0);
      for (Index k0 = 0; k0 < op.K; k0 += kDepth) {
        Scalar s(0);
        for (Index k = k0; k < std::min(op.K, k0 + kDepth); ++k) {
          const Scalar a = static_cast<Scalar>(LA == gemm::Layout::row_major ? op.a[i * op.lda + k]
                                                                             : op.a[i + k * op.lda]);
          const Scalar b = static_cast<Scalar>(LB == gemm::Layout::row_major ? op.b[k * op.ldb + j]
                                                                             : op.b[k + j * op.ldb]);
          s = reference_madd(a, b, s);
        }
        c = k0 == 0 && op.init != gemm::Init::keep ? s : c + s;
      }
      if (op.init == gemm::Init::bias) c = c + op.bias[j * op.bias_stride];
    }
}

template <typename Scalar, typename BStorage, typename AStorage, gemm::Layout LA, gemm::Layout LB>
void check_packed_sequence(Index M, Index N, Index K, std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> dist(-1.0, 1.0);
  auto fill = [&](auto& v, std::size_t size) {
    v.resize(size);
    for (auto& x : v) x = static_cast<std::decay_t<decltype(x)>>(dist(gen));
  };
  const Index pad = 3;
  const Index lda = (LA == gemm::Layout::row_major ? K : M) + pad, ldb = (LB == gemm::Layout::row_major ? N : K) + pad;
  const Index ldc = N + pad;
  std::vector<Scalar> C, bias;
  std::vector<AStorage> A;
  std::vector<BStorage> B;
  fill(A, static_cast<std::size_t>(std::max<Index>(1, (LA == gemm::Layout::row_major ? M : K) * lda)));
  fill(B, static_cast<std::size_t>(std::max<Index>(1, (LB == gemm::Layout::row_major ? K : N) * ldb)));
  fill(C, static_cast<std::size_t>(M * ldc));
  fill(bias, static_cast<std::size_t>(2 * N));
  for (gemm::Init init : {gemm::Init::zero, gemm::Init::keep, gemm::Init::bias}) {
    CAPTURE(M, N, K, static_cast<int>(LA), static_cast<int>(LB), static_cast<int>(init));
    std::vector<Scalar> expected = C, got = C;
    gemm::Op<Scalar, LA, LB, BStorage, AStorage> op{M,   N,        K,           A.data(),
                                                    lda, B.data(), ldb,         expected.data(),
                                                    ldc, init,     bias.data(), 2};
    reference_packed(op);
    op.c = got.data();
    // Two chunks along the columns on whatever threads there are: the chunking must not matter.
    gemm::run<gemm::Kernel::gemm, gemm::PackedBackend>(op, gemm::Plan{gemm::Split::cols, std::max<Index>(1, N / 2 + 1),
                                                                      true});
    CHECK(std::memcmp(expected.data(), got.data(), expected.size() * sizeof(Scalar)) == 0);
  }
}

template <typename Scalar, typename BStorage = Scalar, typename AStorage = Scalar>
void check_packed_sequences() {
  using gemm::Layout;
  struct Shape {
    Index M, N, K;
  };
  // Edges of the tiles (6 or 8 rows; 8 to 32 columns by build), of the depth block (256), of the
  // row block (240) and pass (1200), of the column block (1024; two of them in each of the two
  // column chunks at N = 2100), op(A) transposed in registers at K > 256 (M = 32), and op(B)
  // packed a depth block at a time (K * 64 columns > 2^20 at K = 16400: the dh = dz W path).
  for (const Shape s : {Shape{1, 1, 1}, Shape{7, 65, 255}, Shape{13, 17, 256}, Shape{6, 64, 257}, Shape{2, 33, 700},
                        Shape{245, 9, 40}, Shape{5, 1030, 20}, Shape{3, 5, 0}, Shape{32, 40, 300}, Shape{1300, 9, 40},
                        Shape{3, 2100, 30}, Shape{5, 64, 16400}}) {
    check_packed_sequence<Scalar, BStorage, AStorage, Layout::row_major, Layout::col_major>(s.M, s.N, s.K, 11);
    check_packed_sequence<Scalar, BStorage, AStorage, Layout::row_major, Layout::row_major>(s.M, s.N, s.K, 12);
    check_packed_sequence<Scalar, BStorage, AStorage, Layout::col_major, Layout::row_major>(s.M, s.N, s.K, 13);
    check_packed_sequence<Scalar, BStorage, AStorage, Layout::col_major, Layout::col_major>(s.M, s.N, s.K, 14);
  }
}

// The decode kernel (Kernel::decode: M <= 8 rows of A row-major, op(B) = W^T) against the same
// written-out sequence, for every token count, across the lanes x lanes transposes (rows of W and
// depth not multiples of the lanes), the depth blocks and the chunks. With W stored as bf16 / fp16
// the reference runs on float(W) (reference_packed widens each value): the AVX-512 path forms W's
// packets from bf16 pairs, so the values are distinct per position (random in (-1, 1), rounded to
// the storage) and a value in the wrong lane or the wrong half of a pair changes the bits.
template <typename Scalar, typename WStorage = Scalar>
void check_decode_sequences() {
  using gemm::Layout;
  constexpr Index kDepth = gemm::kPackedDepth;
  std::mt19937_64 gen(31);
  std::uniform_real_distribution<double> dist(-1.0, 1.0);
  for (const Index K : {Index{1}, Index{15}, Index{16}, Index{17}, Index{31}, Index{32}, Index{33}, kDepth - 1, kDepth,
                        kDepth + 1, kDepth + 17, 2 * kDepth + 5, Index{700}})
    for (const Index N : {Index{1}, Index{15}, Index{16}, Index{17}, Index{33}, Index{50}, Index{1030}})
      for (Index M = 1; M <= 8; ++M)
        for (gemm::Init init : {gemm::Init::zero, gemm::Init::bias}) {
          CAPTURE(M, N, K, static_cast<int>(init));
          const Index lda = K + 3, ldb = K + 5, ldc = N + 2;
          std::vector<Scalar> A(static_cast<std::size_t>(M * lda)), bias(static_cast<std::size_t>(2 * N)),
              expected(static_cast<std::size_t>(M * ldc), Scalar(7));
          std::vector<WStorage> B(static_cast<std::size_t>(N * ldb));
          for (auto* v : {&A, &bias})
            for (auto& x : *v) x = static_cast<Scalar>(dist(gen));
          for (auto& x : B) x = static_cast<WStorage>(dist(gen));
          std::vector<Scalar> got = expected;
          gemm::Op<Scalar, Layout::row_major, Layout::col_major, WStorage> op{
              M, N, K, A.data(), lda, B.data(), ldb, expected.data(), ldc, init, bias.data(), 2};
          reference_packed(op);
          op.c = got.data();
          gemm::run<gemm::Kernel::decode, gemm::PackedBackend>(op, gemm::Plan{gemm::Split::cols, 512, true});
          CHECK(std::memcmp(expected.data(), got.data(), expected.size() * sizeof(Scalar)) == 0);
        }
}

}  // namespace

TEMPLATE_TEST_CASE("decode kernel: every logit is the packed kernel's sequence, bit for bit", "[gemm]", float, double) {
  check_decode_sequences<TestType>();
}

TEST_CASE("decode kernel: with W stored as bf16 or fp16, the sequence on float(W), bit for bit", "[gemm]") {
  check_decode_sequences<float, Eigen::bfloat16>();
  check_decode_sequences<float, Eigen::half>();
}

TEST_CASE("packed kernel: the build's multiply-add is fused exactly when packed_gemm_fuses() says so", "[gemm]") {
  using Packet = gemm::PackedTile<float>::Packet;
  // (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24: a float product drops the 2^-24, a fused multiply-add keeps it.
  const float a = 1.0f + std::ldexp(1.0f, -12), c = -(1.0f + std::ldexp(1.0f, -11));
  const Packet result = gemm::packed_madd(Eigen::internal::pset1<Packet>(a), Eigen::internal::pset1<Packet>(a),
                                          Eigen::internal::pset1<Packet>(c));
  const float first = Eigen::internal::pfirst(result);
  CHECK(first == (gemm::packed_gemm_fuses() ? std::ldexp(1.0f, -24) : 0.0f));
}

TEMPLATE_TEST_CASE("packed kernel: every element is the documented sequence, bit for bit", "[gemm]", float, double) {
  check_packed_sequences<TestType>();
}

TEST_CASE("packed kernel: bf16 and fp16 operands widened while packed give the float sequence on the widened values",
          "[gemm]") {
  check_packed_sequences<float, Eigen::bfloat16>();
  check_packed_sequences<float, Eigen::half>();
  check_packed_sequences<float, Eigen::bfloat16, Eigen::bfloat16>();
  check_packed_sequences<float, float, Eigen::half>();
}

TEST_CASE("packed kernel: a row of C does not depend on the batch it is computed in", "[gemm]") {
  // logits = h W^T with h [64, 300], W [70, 300]: each row of h alone and in sub-batches of 2, 7,
  // 8, 9 rows at every offset gives the same bits as in the whole batch.
  const Index M = 64, N = 70, K = 300;
  const RowMatrix<float> h = test_support::random_matrix<float>(M, K, 21),
                         W = test_support::random_matrix<float>(N, K, 22);
  auto logits_of = [&](Index r0, Index rows) {
    RowMatrix<float> out(rows, N);
    const gemm::Op<float, gemm::Layout::row_major, gemm::Layout::col_major> op{
        rows, N, K, h.data() + r0 * K, K, W.data(), K, out.data(), N, gemm::Init::zero};
    gemm::run<gemm::Kernel::gemm, gemm::PackedBackend>(op, gemm::Plan{gemm::Split::cols, 32, true});
    return out;
  };
  const RowMatrix<float> whole = logits_of(0, M);
  for (Index rows : {1, 2, 7, 8, 9})
    for (Index r0 = 0; r0 + rows <= M; r0 += rows) {
      CAPTURE(rows, r0);
      const RowMatrix<float> part = logits_of(r0, rows);
      CHECK(test_support::first_difference(part, whole.middleRows(r0, rows)) == "");
    }
}
