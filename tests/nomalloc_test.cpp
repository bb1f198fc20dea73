// The output-argument overloads allocate nothing once their caches have grown: Eigen's runtime
// allocation check (EIGEN_RUNTIME_NO_MALLOC) aborts on any heap allocation made through Eigen
// while it is armed. Asserts are switched on in this file because that check is an eigen_assert
// and the Release build defines NDEBUG. std::vector growth is invisible to the check, so each
// case runs once first to let workspaces grow, then again under the check.
#undef NDEBUG
#define EIGEN_RUNTIME_NO_MALLOC

#include <embedhead/embedhead.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>

using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::RowMatrix;

namespace {

// Runs f once to warm caches, then again with Eigen allocations forbidden.
template <typename F>
void without_allocation(F f) {
  f();
  Eigen::internal::set_is_malloc_allowed(false);
  f();
  Eigen::internal::set_is_malloc_allowed(true);
}

}  // namespace

TEST_CASE("the allocation check is armed in this build", "[nomalloc]") {
  // If this did not abort-by-assert, the other cases would prove nothing; test the mechanism by
  // its documented query instead of by aborting.
  Eigen::internal::set_is_malloc_allowed(false);
  CHECK_FALSE(Eigen::internal::is_malloc_allowed());
  Eigen::internal::set_is_malloc_allowed(true);
  CHECK(Eigen::internal::is_malloc_allowed());
}

TEMPLATE_TEST_CASE("forward and backward passes with output arguments do not allocate", "[nomalloc]", float, double) {
  using S = TestType;
  const Index V = 40, d = 16, B = 2, T = 5, N = B * T;
  IdMatrix<std::int32_t> ids(B, T);
  ids << 1, 5, 5, 39, 0, 7, 7, 7, 2, 3;
  const RowMatrix<S> dout = RowMatrix<S>::Constant(N, d, S(0.5));
  RowMatrix<S> x(N, d), y(N, d), logits(N, V), dlogits(N, V), dh(N, d), losses(N, 1);

  embedhead::TokenEmbedding<S> embedding(V, d);
  embedhead::LearnedPositionEmbedding<S> positions(T, d);
  embedhead::SinusoidalPositionEmbedding<S> sinusoid(T, d);
  embedhead::Dropout<S> dropout(0.25, 3);
  // Small enough that Eigen's GEMM keeps its packing buffers on the stack; at large sizes it
  // allocates them on the heap (see output_projection.hpp).
  embedhead::OutputProjection<S> head(V, d);
  embedhead::OutputProjection<S> tied(embedding);

  without_allocation([&] { embedding.forward(ids, x); });
  without_allocation([&] { positions.forward(x, B, T, x); });
  without_allocation([&] { sinusoid.forward(x, B, T, y, 0); });
  without_allocation([&] { dropout.forward(x, y); });
  without_allocation([&] { dropout.backward(dout, y); });
  without_allocation([&] { head.forward(y, logits); });
  // N <= 8 takes the decode path, which has no packing buffers at all.
  const RowMatrix<S> few = RowMatrix<S>::Constant(3, d, S(0.25));
  RowMatrix<S> few_logits(3, V);
  without_allocation([&] { head.forward(few, few_logits); });
  without_allocation(
      [&] { embedhead::output_projection_decode<S>(few, head.weight().value(), head.bias()->value(), few_logits); });
  without_allocation([&] { embedhead::cross_entropy_forward_backward<S>(logits, ids, dlogits, losses); });
  without_allocation([&] { head.backward(y, dlogits, dh); });
  without_allocation([&] { tied.backward(y, dlogits, dh); });
  without_allocation([&] { positions.backward(dh, B, T); });
  embedhead::FusedHeadLossOptions fused_options;
  fused_options.vocab_block = 7;  // several blocks reuse one workspace
  fused_options.softcap = 5;
  embedhead::FusedHeadLoss<S> fused(fused_options);
  without_allocation([&] { fused.forward_backward(head, y, ids, dh); });
  without_allocation([&] { fused.forward(tied, y, ids); });
  without_allocation([&] {
    embedding.zero_grad();
    embedding.backward(ids, dh);
  });
  // zero_grad left sparse mode, so only the 7 distinct ids are touched; the sparse block's
  // capacity from the first run was reused without allocating.
  CHECK(embedding.weight().grad().num_touched() == 7);
  CHECK_FALSE(embedding.weight().grad().is_dense());
}

TEMPLATE_TEST_CASE("low-precision and int8 passes with output arguments do not allocate", "[nomalloc]", Eigen::bfloat16,
                   Eigen::half) {
  using Storage = TestType;
  const Index V = 300, d = 16, B = 2, T = 5, N = B * T;  // V > 256: the head runs two tiles
  IdMatrix<std::int32_t> ids(B, T);
  ids << 1, 5, 5, 299, 0, 7, 7, 7, 2, 3;
  const RowMatrix<float> E = RowMatrix<float>::Constant(V, d, 0.25f);
  const RowMatrix<float> dout = RowMatrix<float>::Constant(N, d, 0.5f);
  RowMatrix<float> x(N, d), logits(N, V), dh(N, d);
  const RowMatrix<float> dlogits = RowMatrix<float>::Constant(N, V, 0.125f);

  embedhead::TokenEmbeddingOptions options;
  options.scale_by_sqrt_d = true;
  embedhead::LowPrecisionEmbedding<Storage> embedding(E, options);
  embedhead::LowPrecisionOutputProjection<Storage> head(E, RowMatrix<float>::Zero(V, 1));
  const embedhead::QuantizedEmbedding quantized(E);

  without_allocation([&] { embedding.forward(ids, x); });
  without_allocation([&] { embedding.backward(ids, dout); });
  without_allocation([&] { head.forward(x, logits); });
  without_allocation([&] { head.backward(x, dlogits, dh); });
  without_allocation([&] { quantized.forward(ids, x); });
  CHECK(std::abs(x(0, 0) - 0.25f) <= 1e-7f);  // the passes ran: code 127 times scale 0.25 / 127
  CHECK(head.weight_grad().is_dense());
}
