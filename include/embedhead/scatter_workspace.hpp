// embedhead: the scratch space of an embedding backward (token_embedding.hpp's embedding_backward,
// the layers' backward passes): the batch's ids sorted once, so each touched row of dE is summed in
// token order by one thread. Reused across calls, the steady state allocates nothing.
#ifndef EMBEDHEAD_SCATTER_WORKSPACE_HPP
#define EMBEDHEAD_SCATTER_WORKSPACE_HPP

#include "types.hpp"

#include <cstddef>
#include <utility>
#include <vector>

namespace embedhead {

// Scratch space for embedding_backward, reused across calls so the steady state allocates
// nothing. Its contents are internal; a default-constructed one is always valid.
struct ScatterWorkspace {
  std::vector<std::pair<Index, Index>> order;  // (id, token position n), sorted
  std::vector<Index> unique_ids;               // sorted distinct ids of `order`
  std::vector<Index> slots;                    // gradient slot of each unique id
  std::vector<unsigned char> fresh;            // 1 where that slot is new to the gradient
  std::vector<std::size_t> run_begin;          // unique id u's tokens: order[run_begin[u], run_begin[u+1])
};

}  // namespace embedhead

#endif  // EMBEDHEAD_SCATTER_WORKSPACE_HPP
