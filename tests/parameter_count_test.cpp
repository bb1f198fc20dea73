// Tests for include/embedhead/parameter_count.hpp: the embedding / LM-head parameter budget from
// shapes alone. Expected counts are the seeds' published numbers (tying savings, GPT-1, GPT-2,
// Gemma 2B, LLaMA 7B, ANDREA-120M), and the budget is checked against the sizes of real layers.
#include <embedhead/output_projection.hpp>
#include <embedhead/parameter.hpp>
#include <embedhead/parameter_count.hpp>
#include <embedhead/position_embedding.hpp>
#include <embedhead/token_embedding.hpp>

#include <catch2/catch.hpp>

#include <memory>
#include <string>
#include <utility>
#include <vector>

using Catch::Contains;
using embedhead::EmbeddingHeadShape;
using embedhead::Index;

namespace {

EmbeddingHeadShape shape_of(Index V, Index d, bool tied, bool head_bias = false, Index learned_positions = 0) {
  EmbeddingHeadShape shape;
  shape.V = V;
  shape.d = d;
  shape.tied = tied;
  shape.head_bias = head_bias;
  shape.learned_positions = learned_positions;
  return shape;
}

}  // namespace

TEST_CASE("embedding_head_budget: tying saves V*d + V (seeds)", "[parameter_count][seeds]") {
  // The seeds: V = 50, d = 32 saves 1650; V = 1000, d = 256 saves 257,000.
  struct Case {
    Index V, d, saving;
  };
  for (const Case& c : {Case{50, 32, 1650}, Case{1000, 256, 257000}}) {
    INFO("V = " << c.V << ", d = " << c.d);
    const auto tied = embedhead::embedding_head_budget(shape_of(c.V, c.d, true));
    const auto untied = embedhead::embedding_head_budget(shape_of(c.V, c.d, false, true));
    CHECK(untied.total() - tied.total() == c.saving);
    CHECK(tied.head_weight == 0);
    CHECK(tied.head_bias == 0);
    CHECK(untied.head_weight == c.V * c.d);
    CHECK(untied.head_bias == c.V);
  }
  // 1650 = 50*32 + 50 split into its parts, by hand.
  const auto untied = embedhead::embedding_head_budget(shape_of(50, 32, false, true));
  CHECK(untied.token_embedding == 1600);
  CHECK(untied.head_weight == 1600);
  CHECK(untied.head_bias == 50);
  CHECK(untied.position_embedding == 0);
  CHECK(untied.total() == 3250);
}

TEST_CASE("embedding_head_budget: token tables of published models (seeds)", "[parameter_count][seeds]") {
  struct Case {
    const char* model;
    Index V, d, token_table;
  };
  for (const Case& c : {Case{"GPT-1", 40478, 768, 31087104}, Case{"GPT-2 124M", 50257, 768, 38597376},
                        Case{"Gemma 2B", 256000, 2048, 524288000}, Case{"LLaMA 7B", 32000, 4096, 131072000}}) {
    INFO(c.model);
    const auto tied = embedhead::embedding_head_budget(shape_of(c.V, c.d, true));
    CHECK(tied.token_embedding == c.token_table);
    CHECK(tied.total() == c.token_table);
    // Untied without bias (LLaMA's lm_head): the head doubles the count.
    const auto untied = embedhead::embedding_head_budget(shape_of(c.V, c.d, false, false));
    CHECK(untied.head_weight == c.token_table);
    CHECK(untied.head_bias == 0);
    CHECK(untied.total() == 2 * c.token_table);
  }
  // Gemma 2B's untied-with-bias alternative, by hand: 2 * 524,288,000 + 256,000.
  CHECK(embedhead::embedding_head_budget(shape_of(256000, 2048, false, true)).total() == 1048832000);
  // head_bias is ignored when tied.
  CHECK(embedhead::embedding_head_budget(shape_of(256000, 2048, true, true)).total() == 524288000);
}

TEST_CASE("embedding_head_budget: ANDREA-120M with learned positions (seeds)", "[parameter_count][seeds]") {
  // V = 8,449, d = 768: token table 6,488,832; learned positions T = 1,024: 786,432; embedding
  // total 7,275,264. The head is untied (no bias); it is not part of that total.
  const auto budget = embedhead::embedding_head_budget(shape_of(8449, 768, false, false, 1024));
  CHECK(budget.token_embedding == 6488832);
  CHECK(budget.position_embedding == 786432);
  CHECK(budget.token_embedding + budget.position_embedding == 7275264);
  CHECK(budget.head_weight == 6488832);
  CHECK(budget.head_bias == 0);
  CHECK(budget.total() == 13764096);  // 7,275,264 + 6,488,832
  CHECK(embedhead::embedding_head_budget(shape_of(8449, 768, true, false, 1024)).total() == 7275264);
}

TEMPLATE_TEST_CASE("embedding_head_budget agrees with the sizes of real layers", "[parameter_count][layers]", float,
                   double) {
  using S = TestType;
  struct Case {
    Index V, d, T_max;
  };
  for (const Case& c : {Case{1, 1, 1}, Case{7, 5, 9}, Case{17, 16, 3}, Case{9, 8, 0}}) {
    INFO("V = " << c.V << ", d = " << c.d << ", T_max = " << c.T_max);
    const embedhead::TokenEmbedding<S> emb(c.V, c.d);
    // A T_max = 0 case means "no learned table": only the embedding and the head are listed.
    // Reserved, not brace-initialised: gcc 12 -O3 reports a false -Warray-bounds for the
    // push_back below onto a one-element initializer-list vector (seen in the grouped build).
    std::vector<std::shared_ptr<embedhead::Parameter<S>>> base;
    base.reserve(2);
    base.push_back(emb.weight_ptr());
    if (c.T_max > 0) {
      const embedhead::LearnedPositionEmbedding<S> pos(c.T_max, c.d);
      base.push_back(pos.weight_ptr());  // the shared_ptr keeps the table alive after pos goes
    }
    auto with_head = [&](const embedhead::OutputProjection<S>& head) {
      auto params = base;
      for (const auto& p : head.parameters()) params.push_back(p);
      return embedhead::count_parameters(params);
    };

    const embedhead::OutputProjection<S> tied(emb);
    embedhead::OutputProjectionOptions with_bias;
    with_bias.bias = true;
    embedhead::OutputProjectionOptions no_bias;
    no_bias.bias = false;
    const embedhead::OutputProjection<S> untied_bias(c.V, c.d, with_bias), untied(c.V, c.d, no_bias);

    const Index tied_count = with_head(tied);
    const Index untied_bias_count = with_head(untied_bias);
    CHECK(tied_count == embedhead::embedding_head_budget(shape_of(c.V, c.d, true, false, c.T_max)).total());
    CHECK(untied_bias_count == embedhead::embedding_head_budget(shape_of(c.V, c.d, false, true, c.T_max)).total());
    CHECK(with_head(untied) == embedhead::embedding_head_budget(shape_of(c.V, c.d, false, false, c.T_max)).total());
    // Tying removes W [V, d] and b [V].
    CHECK(untied_bias_count - tied_count == c.V * c.d + c.V);
    // By hand: the tied model holds E and P only.
    CHECK(tied_count == c.V * c.d + c.T_max * c.d);
  }
}

TEST_CASE("embedding_head_budget rejects bad shapes", "[parameter_count][errors]") {
  REQUIRE_THROWS_AS(embedhead::embedding_head_budget(shape_of(0, 8, true)), embedhead::value_error);
  REQUIRE_THROWS_WITH(embedhead::embedding_head_budget(shape_of(0, 8, true)),
                      Contains("embedding_head_budget") && Contains("V = 0") && Contains("[1, inf)"));
  REQUIRE_THROWS_WITH(embedhead::embedding_head_budget(shape_of(-4, 8, false)), Contains("V = -4"));
  REQUIRE_THROWS_AS(embedhead::embedding_head_budget(shape_of(10, 0, true)), embedhead::value_error);
  REQUIRE_THROWS_WITH(embedhead::embedding_head_budget(shape_of(10, 0, true)),
                      Contains("d = 0") && Contains("[1, inf)"));
  REQUIRE_THROWS_AS(embedhead::embedding_head_budget(shape_of(10, 8, true, false, -1)), embedhead::value_error);
  REQUIRE_THROWS_WITH(embedhead::embedding_head_budget(shape_of(10, 8, true, false, -1)),
                      Contains("learned_positions = -1") && Contains("[0, inf)"));
  // The default shape (V = d = 0) is not a valid model.
  REQUIRE_THROWS_AS(embedhead::embedding_head_budget(EmbeddingHeadShape{}), embedhead::value_error);
  // learned_positions = 0 (no table) and V = d = 1 are fine.
  const auto smallest = embedhead::embedding_head_budget(shape_of(1, 1, false, true, 0));
  CHECK(smallest.total() == 3);
}

TEST_CASE("embedding_head_budget: defaults match the layers' defaults", "[parameter_count]") {
  // OutputProjectionOptions has bias = true, so an untied shape with default fields must count a
  // bias too: untied minus tied is V*d + V, the seeds' figure (V = 50, d = 32 -> 1650).
  EmbeddingHeadShape tied;
  tied.V = 50;
  tied.d = 32;
  EmbeddingHeadShape untied = tied;
  untied.tied = false;
  CHECK(embedhead::embedding_head_budget(untied).total() - embedhead::embedding_head_budget(tied).total() == 1650);

  embedhead::TokenEmbedding<float> embedding(50, 32);
  embedhead::OutputProjection<float> head(50, 32);  // default options
  std::vector<std::shared_ptr<embedhead::Parameter<float>>> params{embedding.weight_ptr()};
  for (const auto& p : head.parameters()) params.push_back(p);
  CHECK(embedhead::count_parameters(params) == embedhead::embedding_head_budget(untied).total());
}

TEST_CASE("embedding_head_budget: counts that overflow Index are an error", "[parameter_count][errors]") {
  EmbeddingHeadShape shape;
  shape.V = Index{1} << 40;
  shape.d = Index{1} << 30;
  REQUIRE_THROWS_AS(embedhead::embedding_head_budget(shape), embedhead::value_error);
  REQUIRE_THROWS_WITH(embedhead::embedding_head_budget(shape),
                      Contains("V = " + std::to_string(Index{1} << 40)) && Contains("overflow"));
  shape.V = 256000;
  shape.d = 2048;
  REQUIRE_NOTHROW(embedhead::embedding_head_budget(shape));
}
