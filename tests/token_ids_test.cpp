// Tests for include/embedhead/token_ids.hpp: one view of int32 / int64 ids in any layout.
//
// Every layout (row-major, column-major, a strided block of a larger matrix, a column of a
// row-major matrix, a Map with an InnerStride, a raw pointer) must give bit for bit what the
// contiguous row-major int64 copy of the same ids gives, for the lookup, its backward, the
// cross-entropy and the fused head loss; and out-of-range ids in a strided view must throw the
// usual message (value, position, range) with nothing changed.

#include <embedhead/cross_entropy.hpp>
#include <embedhead/errors.hpp>
#include <embedhead/fused_head_loss.hpp>
#include <embedhead/output_projection.hpp>
#include <embedhead/quantized_embedding.hpp>
#include <embedhead/token_embedding.hpp>
#include <embedhead/token_ids.hpp>

#include "reference/test_support.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

using embedhead::CrossEntropyOptions;
using embedhead::CrossEntropyResult;
using embedhead::FusedHeadLossExtras;
using embedhead::FusedHeadLossOptions;
using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::RowMatrix;
using embedhead::TokenIds;
using embedhead::TokenIdType;
using Catch::Matchers::Contains;
using test_support::random_ids;
using test_support::random_matrix;

namespace {

template <typename Id>
using ColIdMatrix = Eigen::Matrix<Id, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>;

template <typename Scalar>
bool bit_identical(const RowMatrix<Scalar>& a, const RowMatrix<Scalar>& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         std::memcmp(a.data(), b.data(), sizeof(Scalar) * static_cast<std::size_t>(a.size())) == 0;
}

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof(double)) == 0; }

// The ids of a view, read element by element into the contiguous row-major int64 matrix that
// every layout is compared against.
IdMatrix<std::int64_t> contiguous_copy(const TokenIds& ids) {
  IdMatrix<std::int64_t> out(ids.rows(), ids.cols());
  for (Index b = 0; b < ids.rows(); ++b)
    for (Index t = 0; t < ids.cols(); ++t) out(b, t) = ids(b, t);
  return out;
}

// One layout of the same [B, T] ids: a name, its storage (kept alive here) and the view of it.
struct Layout {
  std::string name;
  std::function<TokenIds()> view;
};

// The layouts of ids [B, T] given as int64 values in `base`; Id is the stored type. Each
// layout's storage is owned by the returned holder, so the views stay valid while it lives.
template <typename Id>
struct Layouts {
  IdMatrix<Id> row_major;
  ColIdMatrix<Id> col_major;
  ColIdMatrix<Id> wide_col_major;  // [B, T + 2]; the ids are middleCols(1, T)
  RowMatrix<Id> tall_row_major;    // [B * T, 3]; the ids (as [B*T, 1]) are col(1)
  std::vector<Id> interleaved;     // id n at 2 n: a row-major Map with InnerStride<2>
  std::vector<Layout> list;

  explicit Layouts(const IdMatrix<std::int64_t>& base) {
    const Index B = base.rows(), T = base.cols();
    row_major = base.template cast<Id>();
    col_major = base.template cast<Id>();
    wide_col_major = ColIdMatrix<Id>::Constant(B, T + 2, Id(-7));
    tall_row_major = RowMatrix<Id>::Constant(B * T, 3, Id(-7));
    interleaved.assign(static_cast<std::size_t>(2 * B * T), Id(-7));
    for (Index b = 0; b < B; ++b)
      for (Index t = 0; t < T; ++t) {
        const Id v = static_cast<Id>(base(b, t));
        wide_col_major(b, t + 1) = v;
        tall_row_major(b * T + t, 1) = v;
        interleaved[static_cast<std::size_t>(2 * (b * T + t))] = v;
      }
    list.push_back({"row-major", [this] { return TokenIds(row_major); }});
    list.push_back({"column-major", [this] { return TokenIds(col_major); }});
    list.push_back(
        {"middleCols of a column-major matrix", [this, T] { return TokenIds(wide_col_major.middleCols(1, T)); }});
    list.push_back({"Ref of a column-major block", [this, T] {
                      // A Ref with a dynamic stride views the block as it is.
                      using StridedRef = Eigen::Ref<const ColIdMatrix<Id>, 0, Eigen::OuterStride<>>;
                      const StridedRef ref(wide_col_major.middleCols(1, T));
                      return TokenIds(ref);  // the Ref's own pointer into wide_col_major
                    }});
    list.push_back({"Map with InnerStride<2>", [this, B, T] {
                      return TokenIds(
                          Eigen::Map<const IdMatrix<Id>, 0, Eigen::InnerStride<2>>(interleaved.data(), B, T));
                    }});
    list.push_back({"raw pointer and strides", [this, B, T] { return TokenIds(interleaved.data(), B, T, 2 * T, 2); }});
  }
};

// The ids as one column [B*T, 1]: a column of a row-major matrix, read in the same token order.
template <typename Id>
TokenIds column_view(const Layouts<Id>& layouts) {
  return TokenIds(layouts.tall_row_major.col(1));
}

template <typename Scalar>
struct LookupOutputs {
  RowMatrix<Scalar> out, dE;
};

template <typename Scalar>
LookupOutputs<Scalar> lookup(const RowMatrix<Scalar>& E, TokenIds ids, const RowMatrix<Scalar>& dout) {
  embedhead::TokenEmbedding<Scalar> embedding(std::make_shared<embedhead::Parameter<Scalar>>(E.rows(), E.cols()));
  embedding.weight().value() = E;
  LookupOutputs<Scalar> r;
  r.out = embedding.forward(ids);
  embedding.backward(ids, dout);
  r.dE = embedding.weight().grad().to_dense();
  return r;
}

template <typename Scalar>
struct LossOutputs {
  CrossEntropyResult result;
  RowMatrix<Scalar> dlogits, losses;
};

template <typename Scalar>
LossOutputs<Scalar> loss_of(const RowMatrix<Scalar>& logits, TokenIds targets, const CrossEntropyOptions& options) {
  LossOutputs<Scalar> r;
  r.dlogits.resize(logits.rows(), logits.cols());
  r.losses.resize(logits.rows(), 1);
  r.result = embedhead::cross_entropy_forward_backward<Scalar>(logits, targets, r.dlogits, r.losses, options);
  return r;
}

template <typename Scalar>
struct FusedOutputs {
  CrossEntropyResult result;
  RowMatrix<Scalar> dh, dW, db, lse, losses;
};

template <typename Scalar>
FusedOutputs<Scalar> fused_of(const RowMatrix<Scalar>& h, const RowMatrix<Scalar>& W, const RowMatrix<Scalar>& bias,
                              TokenIds targets, const FusedHeadLossOptions& options) {
  const Index N = h.rows();
  FusedOutputs<Scalar> r;
  r.dh.resize(N, h.cols());
  r.dW = RowMatrix<Scalar>::Zero(W.rows(), W.cols());
  r.db = RowMatrix<Scalar>::Zero(W.rows(), 1);
  r.lse.resize(N, 1);
  r.losses.resize(N, 1);
  embedhead::FusedHeadLossWorkspace<Scalar> ws;
  const FusedHeadLossExtras<Scalar> extras{{nullptr, 0, 1}, {r.lse.data(), N, 1}, {r.losses.data(), N, 1}};
  r.result = embedhead::fused_head_loss_forward_backward<Scalar>(h, W, bias, targets, r.dh, r.dW, r.db, ws, options,
                                                                 extras);
  return r;
}

}  // namespace

TEST_CASE("TokenIds accepts int32 and int64 only, stored in memory", "[token_ids][types]") {
  STATIC_REQUIRE(embedhead::is_token_id_type_v<std::int32_t>);
  STATIC_REQUIRE(embedhead::is_token_id_type_v<std::int64_t>);
  STATIC_REQUIRE_FALSE(embedhead::is_token_id_type_v<std::int8_t>);
  STATIC_REQUIRE_FALSE(embedhead::is_token_id_type_v<std::int16_t>);
  STATIC_REQUIRE_FALSE(embedhead::is_token_id_type_v<std::uint32_t>);
  STATIC_REQUIRE_FALSE(embedhead::is_token_id_type_v<std::uint64_t>);
  STATIC_REQUIRE_FALSE(embedhead::is_token_id_type_v<float>);

  STATIC_REQUIRE(embedhead::is_token_ids_storage_v<IdMatrix<std::int32_t>>);
  STATIC_REQUIRE(embedhead::is_token_ids_storage_v<ColIdMatrix<std::int64_t>>);
  STATIC_REQUIRE(
      embedhead::is_token_ids_storage_v<decltype(std::declval<ColIdMatrix<std::int64_t>&>().middleCols(1, 2))>);
  STATIC_REQUIRE(embedhead::is_token_ids_storage_v<decltype(std::declval<const RowMatrix<std::int32_t>&>().col(0))>);
  STATIC_REQUIRE(embedhead::is_token_ids_storage_v<Eigen::Map<const IdMatrix<std::int64_t>, 0, Eigen::InnerStride<2>>>);
  // Other id types (a static_assert in TokenIds names the accepted ones) and expressions that
  // would have to be evaluated into a temporary first.
  STATIC_REQUIRE_FALSE(embedhead::is_token_ids_storage_v<IdMatrix<std::int8_t>>);
  STATIC_REQUIRE_FALSE(embedhead::is_token_ids_storage_v<IdMatrix<std::int16_t>>);
  STATIC_REQUIRE_FALSE(embedhead::is_token_ids_storage_v<IdMatrix<std::uint32_t>>);
  STATIC_REQUIRE_FALSE(
      embedhead::is_token_ids_storage_v<decltype(std::declval<const IdMatrix<std::int32_t>&>().cast<std::int64_t>())>);
  STATIC_REQUIRE_FALSE(embedhead::is_token_ids_storage_v<decltype(IdMatrix<std::int64_t>::Zero(2, 3))>);
  STATIC_REQUIRE_FALSE(embedhead::is_token_ids_storage_v<int>);
  // What the layers take converts implicitly.
  STATIC_REQUIRE(std::is_convertible_v<IdMatrix<std::int64_t>&, TokenIds>);
  STATIC_REQUIRE(std::is_convertible_v<const IdMatrix<std::int32_t>&, TokenIds>);
  STATIC_REQUIRE(std::is_convertible_v<const Eigen::Ref<const IdMatrix<std::int32_t>>&, TokenIds>);
}

TEST_CASE("TokenIds: shape, element access and dispatch in every layout", "[token_ids][view]") {
  const IdMatrix<std::int64_t> base = random_ids<std::int64_t>(3, 5, 1000, 11);
  auto check = [&](const auto& layouts, TokenIdType type, bool is_int32) {
    for (const Layout& layout : layouts.list) {
      INFO(layout.name);
      const TokenIds ids = layout.view();
      CHECK(ids.type() == type);
      CHECK(ids.rows() == 3);
      CHECK(ids.cols() == 5);
      CHECK(ids.size() == 15);
      for (Index b = 0; b < 3; ++b)
        for (Index t = 0; t < 5; ++t) {
          CHECK(ids(b, t) == base(b, t));
          CHECK(ids.at(b * 5 + t) == base(b, t));
        }
      // The typed accessor has the stored type in its type and reads the same values.
      const bool typed_int32 = ids.visit([](const auto& typed) {
        return std::is_same_v<typename std::decay_t<decltype(typed)>::id_type, std::int32_t>;
      });
      CHECK(typed_int32 == is_int32);
      const Index sum = ids.visit([](const auto& typed) {
        Index s = 0;
        for (Index n = 0; n < typed.size(); ++n) s += static_cast<Index>(typed.at(n));
        return s;
      });
      CHECK(sum == base.sum());
    }
    const TokenIds column = column_view(layouts);
    CHECK(column.rows() == 15);
    CHECK(column.cols() == 1);
    for (Index n = 0; n < 15; ++n) CHECK(column.at(n) == base(n / 5, n % 5));
  };
  check(Layouts<std::int32_t>(base), TokenIdType::int32, true);
  check(Layouts<std::int64_t>(base), TokenIdType::int64, false);
}

TEMPLATE_TEST_CASE("every id layout gives the contiguous int64 copy's results, bit for bit", "[token_ids][layouts]",
                   float, double) {
  using Scalar = TestType;
  const Index B = 3, T = 4, N = B * T, V = 9, d = 5;
  IdMatrix<std::int64_t> base = random_ids<std::int64_t>(B, T, V, 21);
  base(0, 1) = base(2, 3);  // a repeated id
  const RowMatrix<Scalar> E = random_matrix<Scalar>(V, d, 22);
  const RowMatrix<Scalar> dout = random_matrix<Scalar>(N, d, 23);
  const RowMatrix<Scalar> logits = random_matrix<Scalar>(N, V, 24, 3.0);
  const RowMatrix<Scalar> h = random_matrix<Scalar>(N, d, 25);
  const RowMatrix<Scalar> W = random_matrix<Scalar>(V, d, 26, 0.5);
  const RowMatrix<Scalar> bias = random_matrix<Scalar>(V, 1, 27, 0.1);
  CrossEntropyOptions ce_options;
  ce_options.label_smoothing = 0.1;
  ce_options.ignore_index = base(1, 2);  // some targets ignored, wherever that id sits
  FusedHeadLossOptions fused_options;
  fused_options.z_loss = 1e-3;
  fused_options.vocab_block = 4;

  // The contiguous row-major int64 copy, and naive references for it.
  const IdMatrix<std::int64_t> copy = base;
  const LookupOutputs<Scalar> lookup_ref = lookup<Scalar>(E, copy, dout);
  RowMatrix<Scalar> naive_out(N, d);
  RowMatrix<Scalar> naive_dE = RowMatrix<Scalar>::Zero(V, d);
  for (Index n = 0; n < N; ++n) {
    const Index v = copy(n / T, n % T);
    naive_out.row(n) = E.row(v);
    naive_dE.row(v) += dout.row(n);  // in increasing n, as the library sums repeats
  }
  REQUIRE(bit_identical(lookup_ref.out, naive_out));
  REQUIRE(bit_identical(lookup_ref.dE, naive_dE));
  const LossOutputs<Scalar> loss_ref = loss_of<Scalar>(logits, copy, ce_options);
  const FusedOutputs<Scalar> fused_ref = fused_of<Scalar>(h, W, bias, copy, fused_options);
  REQUIRE(loss_ref.result.count < N);  // the ignore_index is hit
  REQUIRE(loss_ref.result.count > 0);

  auto compare = [&](TokenIds ids) {
    // The view reads the ids of `copy` in token order (a [N, 1] column holds them one per row).
    const IdMatrix<std::int64_t> read = contiguous_copy(ids);
    REQUIRE(read.size() == N);
    for (Index n = 0; n < N; ++n) REQUIRE(read.data()[n] == copy(n / T, n % T));
    const LookupOutputs<Scalar> a = lookup<Scalar>(E, ids, dout);
    CHECK(bit_identical(a.out, lookup_ref.out));
    CHECK(bit_identical(a.dE, lookup_ref.dE));
    RowMatrix<Scalar> free_out(N, d);
    embedhead::embedding_forward<Scalar>(E, ids, Scalar(2), free_out);
    CHECK(bit_identical(free_out, RowMatrix<Scalar>(Scalar(2) * lookup_ref.out)));

    const LossOutputs<Scalar> l = loss_of<Scalar>(logits, ids, ce_options);
    CHECK(same_bits(l.result.loss, loss_ref.result.loss));
    CHECK(same_bits(l.result.sum, loss_ref.result.sum));
    CHECK(l.result.count == loss_ref.result.count);
    CHECK(bit_identical(l.dlogits, loss_ref.dlogits));
    CHECK(bit_identical(l.losses, loss_ref.losses));
    const embedhead::CrossEntropyLoss<Scalar> object(ce_options);
    CHECK(same_bits(object.forward(logits, ids).loss, loss_ref.result.loss));

    const FusedOutputs<Scalar> f = fused_of<Scalar>(h, W, bias, ids, fused_options);
    CHECK(same_bits(f.result.loss, fused_ref.result.loss));
    CHECK(bit_identical(f.dh, fused_ref.dh));
    CHECK(bit_identical(f.dW, fused_ref.dW));
    CHECK(bit_identical(f.db, fused_ref.db));
    CHECK(bit_identical(f.lse, fused_ref.lse));
    CHECK(bit_identical(f.losses, fused_ref.losses));
  };
  auto run = [&](const auto& layouts) {
    for (const Layout& layout : layouts.list) {
      INFO(layout.name);
      compare(layout.view());
    }
    INFO("a column of a row-major matrix");
    compare(column_view(layouts));
  };
  {
    INFO("int32");
    run(Layouts<std::int32_t>(base));
  }
  {
    INFO("int64");
    run(Layouts<std::int64_t>(base));
  }
}

TEST_CASE("the quantized lookup reads every layout", "[token_ids][quantized]") {
  const IdMatrix<std::int64_t> base = random_ids<std::int64_t>(2, 3, 6, 31);
  const RowMatrix<float> E = random_matrix<float>(6, 4, 32);
  const embedhead::QuantizedEmbedding q(E);
  const RowMatrix<float> expected = q.forward(base);
  const RowMatrix<float> dequantized = q.dequantize();
  for (Index n = 0; n < 6; ++n)
    CHECK(bit_identical(RowMatrix<float>(expected.row(n)), RowMatrix<float>(dequantized.row(base(n / 3, n % 3)))));
  const Layouts<std::int32_t> layouts(base);
  for (const Layout& layout : layouts.list) {
    INFO(layout.name);
    CHECK(bit_identical(q.forward(layout.view()), expected));
  }
}

TEMPLATE_TEST_CASE("out-of-range ids in a strided view throw with value, position and range, changing nothing",
                   "[token_ids][errors]", std::int32_t, std::int64_t) {
  using Id = TestType;
  const Index B = 2, T = 3, V = 7, d = 2;
  // ids [B, T] = middleCols(1, T) of a column-major [B, T + 2]; (b=1, t=2) holds 9 >= V.
  ColIdMatrix<Id> wide = ColIdMatrix<Id>::Constant(B, T + 2, Id(100));
  wide.middleCols(1, T) << 0, 1, 2,  //
      3, 4, 9;
  const auto ids = wide.middleCols(1, T);

  embedhead::TokenEmbedding<float> embedding(V, d);
  RowMatrix<float> out = RowMatrix<float>::Constant(B * T, d, 5.0f);
  const RowMatrix<float> out0 = out;
  REQUIRE_THROWS_AS(embedding.forward(ids, out), embedhead::index_error);
  REQUIRE_THROWS_WITH(embedding.forward(ids, out),
                      Contains("TokenEmbedding::forward: id 9 at (b=1, t=2) outside [0, 7)"));
  CHECK(bit_identical(out, out0));
  REQUIRE_THROWS_WITH(embedding.backward(ids, RowMatrix<float>::Ones(B * T, d)),
                      Contains("TokenEmbedding::backward: id 9 at (b=1, t=2) outside [0, 7)"));
  CHECK(embedding.weight().grad().num_touched() == 0);

  const RowMatrix<float> logits = random_matrix<float>(B * T, V, 41);
  RowMatrix<float> dlogits = RowMatrix<float>::Constant(B * T, V, 3.0f),
                   losses = RowMatrix<float>::Constant(B * T, 1, 4.0f);
  const RowMatrix<float> dlogits0 = dlogits, losses0 = losses;
  REQUIRE_THROWS_AS(embedhead::cross_entropy_forward_backward<float>(logits, ids, dlogits, losses),
                    embedhead::index_error);
  REQUIRE_THROWS_WITH(embedhead::cross_entropy_forward_backward<float>(logits, ids, dlogits, losses),
                      Contains("cross_entropy_forward_backward: target 9 at n=5 (b=1, t=2) outside [0, 7)"));
  CHECK(bit_identical(dlogits, dlogits0));
  CHECK(bit_identical(losses, losses0));

  const RowMatrix<float> h = random_matrix<float>(B * T, d, 42), W = random_matrix<float>(V, d, 43), no_bias(0, 1);
  RowMatrix<float> dh = RowMatrix<float>::Constant(B * T, d, 6.0f), dW = RowMatrix<float>::Constant(V, d, 7.0f),
                   no_db(0, 1);
  const RowMatrix<float> dh0 = dh, dW0 = dW;
  embedhead::FusedHeadLossWorkspace<float> ws;
  REQUIRE_THROWS_WITH(embedhead::fused_head_loss_forward_backward<float>(h, W, no_bias, ids, dh, dW, no_db, ws),
                      Contains("fused_head_loss_forward_backward: target 9 at n=5 (b=1, t=2) outside [0, 7)"));
  CHECK(bit_identical(dh, dh0));
  CHECK(bit_identical(dW, dW0));

  // A column of a row-major matrix: position (b, t) of the [N, 1] view is (n, 0).
  RowMatrix<Id> tall = RowMatrix<Id>::Zero(4, 2);
  tall(2, 1) = Id(-1);
  RowMatrix<float> out_col = RowMatrix<float>::Constant(4, d, 5.0f);
  const RowMatrix<float> out_col0 = out_col;
  REQUIRE_THROWS_WITH(embedding.forward(tall.col(1), out_col),
                      Contains("TokenEmbedding::forward: id -1 at (b=2, t=0) outside [0, 7)"));
  CHECK(bit_identical(out_col, out_col0));
}
