// embedhead: parameter budgets of the embedding and the LM head, from shapes alone.
//
// A tied head reuses E [V, d] and has no bias, so tying saves exactly V*d + V parameters against
// an untied head with bias (V = 50, d = 32 saves 1,650; V = 1000, d = 256 saves 257,000).
// These formulas allocate nothing, so a Gemma-size table (256,000 x 2048) is budgeted for free;
// the tests check them against the sizes of real layers.
#ifndef EMBEDHEAD_PARAMETER_COUNT_HPP
#define EMBEDHEAD_PARAMETER_COUNT_HPP

#include "detail/checks.hpp"
#include "types.hpp"

#include <algorithm>
#include <limits>
#include <sstream>

namespace embedhead {

struct EmbeddingHeadShape {
  Index V = 0;                  // vocabulary size
  Index d = 0;                  // model width
  bool tied = true;             // head shares E
  bool head_bias = true;        // untied head has a bias [V], as OutputProjectionOptions' default
                                // (ignored when tied)
  Index learned_positions = 0;  // T_max of a learned position table, 0 for none
};

struct EmbeddingHeadBudget {
  Index token_embedding = 0;     // V * d
  Index position_embedding = 0;  // T_max * d
  Index head_weight = 0;         // V * d untied, 0 tied
  Index head_bias = 0;           // V untied with bias, else 0
  Index total() const { return token_embedding + position_embedding + head_weight + head_bias; }
};

// shape -> the parameter count of each part. \throws value_error if V or d < 1,
// learned_positions < 0, or a count does not fit in Index.
inline EmbeddingHeadBudget embedding_head_budget(const EmbeddingHeadShape& shape) {
  detail::check_size("embedding_head_budget", "V", shape.V);
  detail::check_size("embedding_head_budget", "d", shape.d);
  if (shape.learned_positions < 0) {
    std::ostringstream message;
    message << "embedding_head_budget: learned_positions = " << shape.learned_positions << " outside [0, inf)";
    throw value_error(message.str());
  }
  const Index rows = std::max(shape.V, shape.learned_positions);
  if (rows > std::numeric_limits<Index>::max() / (3 * shape.d)) {  // E, W and P together must fit
    std::ostringstream message;
    message << "embedding_head_budget: V = " << shape.V << ", d = " << shape.d
            << ", learned_positions = " << shape.learned_positions << " give counts that overflow Index";
    throw value_error(message.str());
  }
  EmbeddingHeadBudget budget;
  budget.token_embedding = shape.V * shape.d;
  budget.position_embedding = shape.learned_positions * shape.d;
  budget.head_weight = shape.tied ? 0 : shape.V * shape.d;
  budget.head_bias = (!shape.tied && shape.head_bias) ? shape.V : 0;
  return budget;
}

}  // namespace embedhead

#endif  // EMBEDHEAD_PARAMETER_COUNT_HPP
