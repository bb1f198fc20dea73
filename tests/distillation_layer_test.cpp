// Tests for HeadDistillation (include/embedhead/distillation.hpp), the layer-level form of the distillation on an
// OutputProjection: each member against the free function it wraps (distill_head*, distill_logprobs*,
// distill_topk*) on the head's W and bias -- loss, per-row losses, dh and the head's gradients bit for bit, the
// gradients accumulated (+=) over a non-zero start -- untied and tied to a TokenEmbedding, in float and double; a
// frozen W or bias; every error leaving dh, the gradients and their modes (dense or sparse) as they were. Expected
// values come from the free functions, which tests/distillation_test.cpp checks against a naive double reference and
// central differences: this file tests the wrapper (its plumbing of W, bias, gradients and checks), not the
// arithmetic.
#include <embedhead/distillation.hpp>
#include <embedhead/output_projection.hpp>
#include <embedhead/token_embedding.hpp>

#include "reference/test_support.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

using Catch::Matchers::Contains;
using embedhead::Divergence;
using embedhead::DistillationExtras;
using embedhead::DistillationOptions;
using embedhead::DistillationResult;
using embedhead::DistillationWorkspace;
using embedhead::FusedPlan;
using embedhead::HeadDistillation;
using embedhead::IdMatrix;
using embedhead::Index;
using embedhead::OutputProjection;
using embedhead::Parameter;
using embedhead::Reduction;
using embedhead::RowMatrix;
using embedhead::TeacherTopK;
using embedhead::TokenEmbedding;
using test_support::random_ids;
using test_support::random_matrix;
using test_support::same_values;

namespace {

enum class Member { head, logprobs, topk };

const char* member_name(Member m) { return m == Member::head ? "head" : m == Member::logprobs ? "logprobs" : "topk"; }

// The inputs: the student's h, W, bias; a teacher head's h_T, W_T, bias_T; cached dense and top-k log-probs; a mask.
template <typename Scalar>
struct Inputs {
  static constexpr Index N = 7, d = 5, dT = 4, V = 53, k = 6;
  RowMatrix<Scalar> h = random_matrix<Scalar>(N, d, 31, 1.0), W = random_matrix<Scalar>(V, d, 32, 1.5),
                    b = random_matrix<Scalar>(V, 1, 33, 0.7), hT = random_matrix<Scalar>(N, dT, 34, 1.0),
                    WT = random_matrix<Scalar>(V, dT, 35, 2.0), bT = random_matrix<Scalar>(V, 1, 36, 1.2);
  RowMatrix<Scalar> logq, top, mask;
  IdMatrix<std::int32_t> ids;
  Inputs() {
    // Log-softmax of random logits, in double; the top-k the first k of each row's cyclic picks (distinct), holding
    // about 0.78 of the probability (at most 1).
    const RowMatrix<double> u = random_matrix<double>(N, V, 37, 2.0);
    logq.resize(N, V);
    top.resize(N, k);
    ids.resize(N, k);
    for (Index n = 0; n < N; ++n) {
      const double m = u.row(n).maxCoeff();
      const double lse = m + std::log((u.row(n).array() - m).exp().sum());
      for (Index j = 0; j < V; ++j) logq(n, j) = static_cast<Scalar>(u(n, j) - lse);
      for (Index i = 0; i < k; ++i) {
        ids(n, i) = static_cast<std::int32_t>((7 * n + 9 * i + 3) % V);
        top(n, i) = static_cast<Scalar>(std::log(0.6 / k) + 0.1 * static_cast<double>(i));
      }
    }
    mask = RowMatrix<Scalar>::Ones(N, 1);
    mask(2, 0) = Scalar(0);
    mask(5, 0) = Scalar(0);
  }
};

// A student head, untied (with a bias, its gradients started dense) or tied to an embedding (no bias, its gradient
// started sparse with a few rows), W = inputs.W either way.
template <typename Scalar>
struct Student {
  std::optional<TokenEmbedding<Scalar>> embedding;
  std::optional<OutputProjection<Scalar>> head;
  Student(const Inputs<Scalar>& in, bool tied) {
    if (tied) {
      embedding.emplace(in.V, in.d);
      embedding->weight().value() = in.W;
      embedding->backward(random_ids<std::int32_t>(1, 4, in.V, 38), random_matrix<Scalar>(4, in.d, 39));
      head.emplace(*embedding);
    } else {
      head.emplace(in.V, in.d);
      head->weight().value() = in.W;
      head->bias()->value() = in.b;
      head->weight().grad().dense_accumulator() = random_matrix<Scalar>(in.V, in.d, 40);
      head->bias()->grad().dense_accumulator() = random_matrix<Scalar>(in.V, 1, 41);
    }
  }
  OutputProjection<Scalar>& operator*() { return *head; }
  RowMatrix<Scalar> bias() const {
    return head->bias() ? RowMatrix<Scalar>(head->bias()->value()) : RowMatrix<Scalar>();
  }
};

template <typename Scalar>
OutputProjection<Scalar> make_teacher(const Inputs<Scalar>& in) {
  OutputProjection<Scalar> teacher(in.V, in.dT);
  teacher.weight().value() = in.WT;
  teacher.bias()->value() = in.bT;
  return teacher;
}

// One member of the layer, with the gradient (dh) or the loss alone (dh null).
template <typename Scalar>
DistillationResult layer_call(HeadDistillation<Scalar>& layer, Member m, OutputProjection<Scalar>& student,
                              const Inputs<Scalar>& in, const OutputProjection<Scalar>& teacher, RowMatrix<Scalar>* dh,
                              const DistillationExtras<Scalar>& extras) {
  const TeacherTopK<Scalar> topk{in.ids, in.top};
  if (dh) {
    if (m == Member::head) return layer.forward_backward(student, in.h, teacher, in.hT, *dh, extras);
    if (m == Member::logprobs) return layer.forward_backward_logprobs(student, in.h, in.logq, *dh, extras);
    return layer.forward_backward_topk(student, in.h, topk, *dh, extras);
  }
  if (m == Member::head) return layer.forward(student, in.h, teacher, in.hT, extras);
  if (m == Member::logprobs) return layer.forward_logprobs(student, in.h, in.logq, extras);
  return layer.forward_topk(student, in.h, topk, extras);
}

// The free function the member wraps, on W and bias (empty: none), dW and db += (each skipped when empty).
template <typename Scalar>
DistillationResult free_call(Member m, const RowMatrix<Scalar>& W, const RowMatrix<Scalar>& bias,
                             const Inputs<Scalar>& in, RowMatrix<Scalar>* dh, RowMatrix<Scalar>& dW,
                             RowMatrix<Scalar>& db, const DistillationOptions& o,
                             const DistillationExtras<Scalar>& extras) {
  DistillationWorkspace<Scalar> ws;
  RowMatrix<Scalar> none(0, 0);
  const TeacherTopK<Scalar> topk{in.ids, in.top};
  if (dh) {
    if (m == Member::head)
      return embedhead::distill_head_forward_backward<Scalar>(in.h, W, bias, in.hT, in.WT, in.bT, *dh, dW, db, none,
                                                              none, none, ws, o, extras);
    if (m == Member::logprobs)
      return embedhead::distill_logprobs_forward_backward<Scalar>(in.h, W, bias, in.logq, *dh, dW, db, ws, o, extras);
    return embedhead::distill_topk_forward_backward<Scalar>(in.h, W, bias, topk, *dh, dW, db, ws, o, extras);
  }
  if (m == Member::head) return embedhead::distill_head<Scalar>(in.h, W, bias, in.hT, in.WT, in.bT, ws, o, extras);
  if (m == Member::logprobs) return embedhead::distill_logprobs<Scalar>(in.h, W, bias, in.logq, ws, o, extras);
  return embedhead::distill_topk<Scalar>(in.h, W, bias, topk, ws, o, extras);
}

bool same_result(const DistillationResult& a, const DistillationResult& b) {
  return a.loss == b.loss && a.sum == b.sum && a.count == b.count;
}

// The options compared: each divergence, T != 1, every reduction, both plans (token chunks of 3 tokens).
template <typename Scalar>
std::vector<DistillationOptions> layer_options() {
  std::vector<DistillationOptions> all;
  auto add = [&](Divergence divergence, double T, double beta, Reduction reduction) {
    for (const FusedPlan plan : {FusedPlan::vocab_blocks, FusedPlan::token_chunks}) {
      DistillationOptions o;
      o.divergence = divergence;
      o.temperature = T;
      o.beta = beta;
      o.reduction = reduction;
      o.vocab_block = 16;
      o.plan = plan;
      o.memory_budget = 3 * 2 * Inputs<Scalar>::V * static_cast<Index>(sizeof(Scalar));
      all.push_back(o);
    }
  };
  add(Divergence::forward_kl, 2.5, 0.5, Reduction::mean);
  add(Divergence::forward_kl, 1.0, 0.5, Reduction::none);
  add(Divergence::reverse_kl, 0.7, 0.5, Reduction::sum);
  add(Divergence::jsd, 1.5, 0.3, Reduction::mean);
  return all;
}

}  // namespace

TEMPLATE_TEST_CASE("HeadDistillation: each member is its free function bit for bit, untied and tied",
                   "[distillation][layer][tied]", float, double) {
  using Scalar = TestType;
  const Inputs<Scalar> in;
  const Index N = in.N, d = in.d;
  const OutputProjection<Scalar> teacher = make_teacher(in);
  for (const bool tied : {false, true})
    for (const DistillationOptions& o : layer_options<Scalar>())
      for (const Member m : {Member::head, Member::logprobs, Member::topk}) {
        if (m == Member::topk && o.divergence != Divergence::forward_kl) continue;  // forward KL only
        INFO("tied " << tied << ", " << member_name(m) << ", divergence " << static_cast<int>(o.divergence)
                     << ", reduction " << static_cast<int>(o.reduction) << ", plan " << static_cast<int>(o.plan));
        Student<Scalar> student(in, tied);
        const RowMatrix<Scalar> bias = student.bias();
        RowMatrix<Scalar> dW_free = (*student).weight().grad().to_dense(), db_free(0, 0);
        if (!tied) db_free = (*student).bias()->grad().to_dense();
        RowMatrix<Scalar> losses_free = RowMatrix<Scalar>::Constant(N, 1, Scalar(-7)), losses = losses_free;
        const DistillationExtras<Scalar> extras_free{{in.mask.data(), N, 1}, {losses_free.data(), N, 1}};
        const DistillationExtras<Scalar> extras{{in.mask.data(), N, 1}, {losses.data(), N, 1}};
        RowMatrix<Scalar> dh_free(N, d), dh = RowMatrix<Scalar>::Constant(N, d, Scalar(5));
        const DistillationResult want = free_call<Scalar>(m, in.W, bias, in, &dh_free, dW_free, db_free, o,
                                                          extras_free);
        HeadDistillation<Scalar> layer(o);
        const DistillationResult got = layer_call<Scalar>(layer, m, *student, in, teacher, &dh, extras);
        CHECK(same_result(got, want));
        CHECK(same_values(losses, losses_free));
        CHECK(same_values(dh, dh_free));
        CHECK((*student).weight().grad().is_dense());
        CHECK(same_values((*student).weight().grad().to_dense(), dW_free));
        if (tied) {
          // One Parameter: the embedding's gradient holds the head's dense dW (beside its sparse rows).
          CHECK(&(*student).weight() == &student.embedding->weight());
          CHECK(same_values(student.embedding->weight().grad().to_dense(), dW_free));
        } else {
          CHECK(same_values((*student).bias()->grad().to_dense(), db_free));
        }
        // The teacher head is frozen here: no gradient.
        CHECK(teacher.weight().grad().num_touched() == 0);
        CHECK_FALSE(teacher.weight().grad().is_dense());
        CHECK(teacher.bias()->grad().num_touched() == 0);

        // The loss alone: the free function's, no gradient touched; a second call reuses the workspace.
        Student<Scalar> evaluated(in, tied);
        const RowMatrix<Scalar> grad_before = (*evaluated).weight().grad().to_dense();
        const bool dense_before = (*evaluated).weight().grad().is_dense();
        const Index touched_before = (*evaluated).weight().grad().num_touched();
        RowMatrix<Scalar> losses_alone = RowMatrix<Scalar>::Constant(N, 1, Scalar(-7)), none(0, 0);
        const DistillationExtras<Scalar> extras_alone{{in.mask.data(), N, 1}, {losses_alone.data(), N, 1}};
        const DistillationResult alone_free = free_call<Scalar>(m, in.W, bias, in, nullptr, none, none, o, extras_free);
        const DistillationResult alone = layer_call<Scalar>(layer, m, *evaluated, in, teacher, nullptr, extras_alone);
        CHECK(same_result(alone, alone_free));
        CHECK(same_values(losses_alone, losses_free));
        CHECK((*evaluated).weight().grad().is_dense() == dense_before);
        CHECK((*evaluated).weight().grad().num_touched() == touched_before);
        CHECK(same_values((*evaluated).weight().grad().to_dense(), grad_before));
      }
}

TEMPLATE_TEST_CASE("HeadDistillation: a frozen W or bias takes nothing; loss and dh unchanged",
                   "[distillation][layer][freeze]", float, double) {
  using Scalar = TestType;
  const Inputs<Scalar> in;
  const Index N = in.N, d = in.d;
  const OutputProjection<Scalar> teacher = make_teacher(in);
  DistillationOptions o;
  o.temperature = 2.0;
  o.vocab_block = 16;
  o.plan = GENERATE(FusedPlan::vocab_blocks, FusedPlan::token_chunks);
  o.memory_budget = 3 * 2 * in.V * static_cast<Index>(sizeof(Scalar));
  HeadDistillation<Scalar> layer(o);
  const DistillationExtras<Scalar> extras{{in.mask.data(), N, 1}};
  for (const Member m : {Member::head, Member::logprobs, Member::topk}) {
    INFO(member_name(m));
    Student<Scalar> reference(in, false);
    RowMatrix<Scalar> dh_reference(N, d);
    const DistillationResult want = layer_call<Scalar>(layer, m, *reference, in, teacher, &dh_reference, extras);
    {  // frozen W: no dW; loss, dh and db the same bits
      Student<Scalar> student(in, false);
      (*student).weight().set_frozen(true);  // clears its gradient
      RowMatrix<Scalar> dh = RowMatrix<Scalar>::Constant(N, d, Scalar(5));
      const DistillationResult got = layer_call<Scalar>(layer, m, *student, in, teacher, &dh, extras);
      CHECK(same_result(got, want));
      CHECK(same_values(dh, dh_reference));
      CHECK((*student).weight().grad().num_touched() == 0);
      CHECK_FALSE((*student).weight().grad().is_dense());
      CHECK(same_values((*student).bias()->grad().to_dense(), (*reference).bias()->grad().to_dense()));
    }
    {  // frozen bias: no db; loss, dh and dW the same bits
      Student<Scalar> student(in, false);
      (*student).bias()->set_frozen(true);
      RowMatrix<Scalar> dh = RowMatrix<Scalar>::Constant(N, d, Scalar(5));
      const DistillationResult got = layer_call<Scalar>(layer, m, *student, in, teacher, &dh, extras);
      CHECK(same_result(got, want));
      CHECK(same_values(dh, dh_reference));
      CHECK(same_values((*student).weight().grad().to_dense(), (*reference).weight().grad().to_dense()));
      CHECK((*student).bias()->grad().num_touched() == 0);
      CHECK_FALSE((*student).bias()->grad().is_dense());
    }
    {  // tied and frozen through the embedding: loss and dh those of the unfrozen tied head, no gradient
      Student<Scalar> frozen(in, true), unfrozen(in, true);
      frozen.embedding->set_frozen(true);
      RowMatrix<Scalar> dh = RowMatrix<Scalar>::Constant(N, d, Scalar(5)), dh_unfrozen(N, d);
      const DistillationResult a = layer_call<Scalar>(layer, m, *frozen, in, teacher, &dh, extras);
      const DistillationResult b = layer_call<Scalar>(layer, m, *unfrozen, in, teacher, &dh_unfrozen, extras);
      CHECK(same_result(a, b));
      CHECK(same_values(dh, dh_unfrozen));
      CHECK(frozen.embedding->weight().grad().num_touched() == 0);
      CHECK_FALSE(frozen.embedding->weight().grad().is_dense());
    }
  }
}

TEMPLATE_TEST_CASE("HeadDistillation: every error leaves dh, the gradients and their modes as they were",
                   "[distillation][layer][errors]", float, double) {
  using Scalar = TestType;
  const Inputs<Scalar> in;
  const Index N = in.N, d = in.d, V = in.V;
  const OutputProjection<Scalar> teacher = make_teacher(in);
  // A head wrapping the embedding's table (its gradient sparse, a few rows) with a bias of its own (no gradient yet).
  TokenEmbedding<Scalar> embedding(V, d);
  embedding.weight().value() = in.W;
  auto bias = std::make_shared<Parameter<Scalar>>(in.b, "lm_head.bias");
  OutputProjection<Scalar> head(embedding.weight_ptr(), bias);
  embedding.backward(random_ids<std::int32_t>(1, 4, V, 42), random_matrix<Scalar>(4, d, 43));
  const Scalar sentinel = Scalar(-123.5);
  RowMatrix<Scalar> dh = RowMatrix<Scalar>::Constant(N, d, sentinel);
  RowMatrix<Scalar> losses = RowMatrix<Scalar>::Constant(N, 1, sentinel);
  const DistillationExtras<Scalar> extras{{in.mask.data(), N, 1}, {losses.data(), N, 1}};
  std::vector<Index> touched = embedding.weight().grad().touched_rows();
  RowMatrix<Scalar> before = embedding.weight().grad().to_dense();
  auto unchanged = [&] {
    CHECK(embedding.weight().grad().touched_rows() == touched);
    CHECK_FALSE(embedding.weight().grad().is_dense());
    CHECK(same_values(embedding.weight().grad().to_dense(), before));
    CHECK_FALSE(bias->grad().is_dense());
    CHECK(bias->grad().num_touched() == 0);
    CHECK((dh.array() == sentinel).all());
    CHECK((losses.array() == sentinel).all());
  };
  const TeacherTopK<Scalar> topk{in.ids, in.top};

  SECTION("bad options") {
    struct Case {
      DistillationOptions options;
      std::string message;
    };
    std::vector<Case> cases(5);
    cases[0].options.temperature = 0;
    cases[0].message = "temperature = 0 outside (0, inf)";
    cases[1].options.divergence = Divergence::jsd;
    cases[1].options.beta = 1.5;
    cases[1].message = "beta = 1.5 outside [0, 1]";
    cases[2].options.vocab_block = -1;
    cases[2].message = "vocab_block = -1 outside [0, inf)";
    cases[3].options.memory_budget = -1;
    cases[3].message = "memory_budget = -1 outside [0, inf)";
    cases[4].options.plan = FusedPlan::token_chunks;
    cases[4].options.memory_budget = 8;
    cases[4].message = "memory_budget = 8 bytes outside [";
    for (const Case& c : cases) {
      HeadDistillation<Scalar> layer(c.options);
      CHECK_THROWS_AS(layer.forward_backward(head, in.h, teacher, in.hT, dh, extras), embedhead::value_error);
      CHECK_THROWS_WITH(layer.forward_backward(head, in.h, teacher, in.hT, dh, extras),
                        Contains("HeadDistillation::forward_backward: " + c.message));
      CHECK_THROWS_WITH(layer.forward_backward_logprobs(head, in.h, in.logq, dh, extras),
                        Contains("HeadDistillation::forward_backward_logprobs: " + c.message));
      CHECK_THROWS_WITH(layer.forward_backward_topk(head, in.h, topk, dh, extras),
                        Contains("HeadDistillation::forward_backward_topk: " + c.message));
      CHECK_THROWS_WITH(layer.forward(head, in.h, teacher, in.hT, extras),
                        Contains("HeadDistillation::forward: " + c.message));
      unchanged();
    }
    // Top-k defines forward KL only.
    DistillationOptions reverse;
    reverse.divergence = Divergence::reverse_kl;
    HeadDistillation<Scalar> layer(reverse);
    CHECK_THROWS_WITH(layer.forward_backward_topk(head, in.h, topk, dh, extras),
                      Contains("HeadDistillation::forward_backward_topk: divergence reverse_kl outside {forward_kl}"));
    unchanged();
  }

  SECTION("bad shapes and values") {
    HeadDistillation<Scalar> layer;
    const RowMatrix<Scalar> h_wide = RowMatrix<Scalar>::Zero(N, d + 1), hT_short = in.hT.topRows(N - 1),
                            logq_short = in.logq.leftCols(V - 1);
    RowMatrix<Scalar> dh_bad = RowMatrix<Scalar>::Constant(N, d + 1, sentinel);
    CHECK_THROWS_AS(layer.forward_backward(head, h_wide, teacher, in.hT, dh, extras), embedhead::shape_error);
    CHECK_THROWS_WITH(layer.forward_backward(head, h_wide, teacher, in.hT, dh, extras),
                      Contains("HeadDistillation::forward_backward: h has shape [7, 6], expected [7, 5]"));
    CHECK_THROWS_WITH(layer.forward_backward(head, in.h, teacher, in.hT, dh_bad, extras),
                      Contains("HeadDistillation::forward_backward: dh has shape [7, 6], expected [7, 5]"));
    CHECK((dh_bad.array() == sentinel).all());
    CHECK_THROWS_WITH(layer.forward_backward(head, in.h, teacher, hT_short, dh, extras),
                      Contains("HeadDistillation::forward_backward: teacher h_T has shape [6, 4], expected [7, 4]"));
    OutputProjection<Scalar> small_teacher(V - 1, in.dT);
    CHECK_THROWS_WITH(layer.forward_backward(head, in.h, small_teacher, in.hT, dh, extras),
                      Contains("HeadDistillation::forward_backward: teacher W_T has shape [52, 4], expected [53, 4]"));
    CHECK_THROWS_WITH(layer.forward_backward_logprobs(head, in.h, logq_short, dh, extras),
                      Contains("HeadDistillation::forward_backward_logprobs: teacher log-probs has shape [7, 52], "
                               "expected [7, 53]"));
    RowMatrix<Scalar> logq_bad = in.logq;
    logq_bad(3, 0) = Scalar(1);  // no longer normalised
    CHECK_THROWS_WITH(layer.forward_backward_logprobs(head, in.h, logq_bad, dh, extras),
                      Contains(
                          "HeadDistillation::forward_backward_logprobs: teacher log-probs at n=3 have log sum exp"));
    IdMatrix<std::int32_t> ids_bad = in.ids;
    ids_bad(1, 2) = static_cast<std::int32_t>(V);
    CHECK_THROWS_AS(layer.forward_backward_topk(head, in.h, TeacherTopK<Scalar>{ids_bad, in.top}, dh, extras),
                    embedhead::index_error);
    CHECK_THROWS_WITH(layer.forward_backward_topk(head, in.h, TeacherTopK<Scalar>{ids_bad, in.top}, dh, extras),
                      Contains("HeadDistillation::forward_backward_topk: teacher top-k id 53 at n=1, column 2 outside "
                               "[0, 53)"));
    ids_bad(1, 2) = ids_bad(1, 1);
    CHECK_THROWS_WITH(layer.forward_backward_topk(head, in.h, TeacherTopK<Scalar>{ids_bad, in.top}, dh, extras),
                      Contains("repeated at n=1"));
    const IdMatrix<std::int32_t> ids_short = in.ids.leftCols(in.k - 1);
    CHECK_THROWS_WITH(layer.forward_backward_topk(head, in.h, TeacherTopK<Scalar>{ids_short, in.top}, dh, extras),
                      Contains("HeadDistillation::forward_backward_topk: teacher top-k ids"));
    RowMatrix<Scalar> mask_bad = in.mask;
    mask_bad(4, 0) = Scalar(0.5);
    const DistillationExtras<Scalar> bad_extras{{mask_bad.data(), N, 1}, {losses.data(), N, 1}};
    CHECK_THROWS_WITH(layer.forward_backward_logprobs(head, in.h, in.logq, dh, bad_extras),
                      Contains("HeadDistillation::forward_backward_logprobs: mask 0.5 at n=4 outside {0, 1}"));
    unchanged();
    // The table resized (as resize_vocabulary given the embedding alone does), the bias not.
    embedding.weight().resize_rows(V + 2);
    touched = embedding.weight().grad().touched_rows();
    before = embedding.weight().grad().to_dense();
    CHECK_THROWS_AS(layer.forward_backward_logprobs(head, in.h, in.logq, dh, extras), embedhead::shape_error);
    CHECK_THROWS_WITH(layer.forward_backward(head, in.h, teacher, in.hT, dh, extras),
                      Contains("HeadDistillation::forward_backward: bias has shape [53, 1], expected [55, 1]"));
    unchanged();
  }

  SECTION("trainable rows: refused before anything changes, W's or the bias's") {
    HeadDistillation<Scalar> layer;
    embedding.weight().set_trainable_rows({1, 4, 9});  // clears the gradient
    touched = embedding.weight().grad().touched_rows();
    before = embedding.weight().grad().to_dense();
    const std::string why =
        "has 3 trainable rows of 53 (Parameter::set_trainable_rows), not supported: the distillation pass adds a "
        "dense gradient [53, 5], not the rows' [3, 5]";
    CHECK_THROWS_AS(layer.forward_backward(head, in.h, teacher, in.hT, dh, extras), embedhead::value_error);
    CHECK_THROWS_WITH(layer.forward_backward(head, in.h, teacher, in.hT, dh, extras),
                      Contains("HeadDistillation::forward_backward: the student's W " + why));
    CHECK_THROWS_WITH(layer.forward_backward_logprobs(head, in.h, in.logq, dh, extras),
                      Contains("HeadDistillation::forward_backward_logprobs: the student's W " + why));
    CHECK_THROWS_WITH(layer.forward_backward_topk(head, in.h, topk, dh, extras),
                      Contains("HeadDistillation::forward_backward_topk: the student's W " + why));
    CHECK(embedding.weight().trainable_rows() != nullptr);
    unchanged();
    // The loss alone takes no gradient: allowed, the free function's loss.
    DistillationWorkspace<Scalar> ws;
    RowMatrix<Scalar> losses_free(N, 1);
    const DistillationExtras<Scalar> extras_free{{in.mask.data(), N, 1}, {losses_free.data(), N, 1}};
    const DistillationResult want = embedhead::distill_logprobs<Scalar>(in.h, in.W, in.b, in.logq, ws, {}, extras_free);
    RowMatrix<Scalar> losses_alone(N, 1);
    const DistillationExtras<Scalar> extras_alone{{in.mask.data(), N, 1}, {losses_alone.data(), N, 1}};
    CHECK(same_result(layer.forward_logprobs(head, in.h, in.logq, extras_alone), want));
    CHECK(same_values(losses_alone, losses_free));
    unchanged();
    // Frozen, its trainable rows do not matter (no gradient): the call runs, W's gradient untouched.
    embedding.weight().set_frozen(true);
    const DistillationResult frozen = layer.forward_backward_logprobs(head, in.h, in.logq, dh, extras);
    CHECK(frozen.count == 5);
    CHECK(embedding.weight().grad().num_touched() == 0);
    CHECK(bias->grad().is_dense());
    embedding.weight().set_frozen(false);
    embedding.weight().set_all_rows_trainable();
    bias->zero_grad();
    dh.setConstant(sentinel);
    losses.setConstant(sentinel);
    touched = embedding.weight().grad().touched_rows();
    before = embedding.weight().grad().to_dense();
    // The bias's trainable rows: refused before W's accumulator turns dense.
    bias->set_trainable_rows({0, 2});
    CHECK_THROWS_WITH(layer.forward_backward(head, in.h, teacher, in.hT, dh, extras),
                      Contains("HeadDistillation::forward_backward: the student's bias has 2 trainable rows of 53"));
    CHECK(embedding.weight().grad().num_touched() == 0);
    CHECK_FALSE(embedding.weight().grad().is_dense());
    CHECK(bias->grad().num_touched() == 0);
    CHECK_FALSE(bias->grad().is_dense());
    CHECK((dh.array() == sentinel).all());
    CHECK((losses.array() == sentinel).all());
  }
}
