// embedhead: vocabulary-parallel (Megatron-style) layers -- the design, and what the three
// headers beside this one (vocab_parallel_embedding.hpp, vocab_parallel_output_projection.hpp,
// vocab_parallel_cross_entropy.hpp) share.
//
// The [V, d] tables are split by rows over the R ranks of a Communicator: rank r holds the shard
// rows [begin, end) = vocab_shard(V, r, R) of E (and of W, b). Activations -- ids, targets, h,
// dout, dh -- are replicated: every rank holds the same values.
//
//   embedding forward   out[n] = s E[ids_n] if this rank owns ids_n, else 0;  all-reduce sum
//                       (exact: each row is one value plus zeros)
//   embedding backward  dE_shard[ids_n - begin] += s dout[n] for owned ids only (no communication:
//                       dout is replicated, so each rank has what its rows need)
//   head forward        local_logits [N, rows] = h W_shard^T + b_shard   (columns [begin, end))
//   head backward       dh = sum over ranks of dlocal W_shard (one all-reduce of N*d);
//                       dW_shard += dlocal^T h,  db_shard += column sums
//   cross-entropy       the full-vocabulary softmax from each rank's columns: an all-reduce max of
//                       the N row maxima, then one all-reduce sum of the N partial sum_exp, target
//                       logits (and logit sums for label smoothing); dlocal = this rank's columns
//                       of the full dlogits. The [N, V] logits exist nowhere.
//
// Every collective call first runs its checks through check_on_every_rank (parallel/communicator.hpp), so
// one rank's bad input makes every rank throw the same exception instead of hanging, and the
// replicated inputs (ids, targets, shapes) are fingerprinted so ranks fed different batches fail.
// New shards are drawn from the same Rng stream as the single-process layers (init_normal is
// counter-based), so a parallel model starts bit-identical to TokenEmbedding / OutputProjection
// built with the same options.
#ifndef EMBEDHEAD_PARALLEL_VOCAB_SHARD_HPP
#define EMBEDHEAD_PARALLEL_VOCAB_SHARD_HPP

#include "../errors.hpp"
#include "../types.hpp"
#include "communicator.hpp"

#include <cstdint>
#include <initializer_list>
#include <sstream>

namespace embedhead {

namespace detail {

// Throws value_error unless V >= R: every rank must own at least one row.
inline void check_vocab_over_ranks(const char* where, Index V, int R) {
  if (V < R) {
    std::ostringstream message;
    message << where << ": V = " << V << " rows over " << R << " ranks; needs V >= " << R
            << " (every rank owns at least one row)";
    throw value_error(message.str());
  }
}

// Throws shape_error unless the Parameter p is [shard.rows(), cols], shard being rank `rank`'s rows
// of V over R ranks. A layer's shard is fixed at construction: a Parameter::resize_rows under it
// would leave ids it owns without rows (reads and writes past the table), so every pass checks.
template <typename P>
void check_shard_shape(const char* where, const char* what, const P& p, const VocabShard& shard, Index cols, Index V,
                       int rank, int R) {
  if (p.rows() == shard.rows() && p.cols() == cols) return;
  std::ostringstream message;
  message << where << ": " << what << " is [" << p.rows() << ", " << p.cols() << "], expected [" << shard.rows() << ", "
          << cols << "] (rows [" << shard.begin << ", " << shard.end << ") of V = " << V << " on rank " << rank
          << " of " << R << ")";
  throw shape_error(message.str());
}

// A fingerprint of a few integers that must agree on every rank (shapes, V, options).
inline std::uint64_t fingerprint_values(std::initializer_list<std::int64_t> values,
                                        std::uint64_t hash = 0xcbf29ce484222325ULL) {
  for (const std::int64_t v : values) hash = fingerprint_bytes(&v, sizeof(v), hash);
  return hash;
}

inline std::uint64_t fingerprint_double(double value, std::uint64_t hash) {
  return fingerprint_bytes(&value, sizeof(value), hash);
}

// m [rows, cols] <- the elementwise sum over ranks, as one all-reduce of rows * cols values:
// in place when the rows are contiguous, else through a packed copy (a column block of a wider
// matrix). Every rank must call it with the same shape.
template <typename Scalar>
void all_reduce_sum_matrix(Communicator& comm, MatrixRef<Scalar> m) {
  if (m.size() == 0 || comm.size() == 1) return;
  if (m.outerStride() == m.cols()) {
    comm.all_reduce_sum(m.data(), m.size());
    return;
  }
  RowMatrix<Scalar> packed = m;
  comm.all_reduce_sum(packed.data(), packed.size());
  m = packed;
}

}  // namespace detail

}  // namespace embedhead

#endif  // EMBEDHEAD_PARALLEL_VOCAB_SHARD_HPP
