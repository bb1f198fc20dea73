// embedhead: data parallelism -- summing every rank's gradient of a replicated table.
//
// In data parallelism every rank holds the whole [V, d] table and runs its own part of the batch;
// after backward, each rank's gradient must become the sum over ranks before the optimizer step.
// An embedding's gradient is row-sparse (RowGradient: the k touched rows of V), so there are two
// ways to sum it:
//
//   sparse  all-gather every rank's touched count, ids and rows (3 collectives), then add them
//           rank by rank into the union of the touched rows. Sends k_r * (d * sizeof(S) + 8)
//           bytes per rank and never allocates or touches O(V * d); the gradient stays sparse.
//   dense   densify (O(V * d)) and one all-reduce of V * d values. What a dense framework does;
//           cheaper once the rows all ranks send approach the table's size.
//
// GradientExchange::automatic chooses by a byte model: dense when the rows all ranks would send,
// sum_r k_r * (d * sizeof(S) + 8) bytes, exceed dense_threshold * V * d * sizeof(S). The default
// threshold comes from bench/data_parallel_bench.cpp (bench/RESULTS.md, "Data-parallel gradient
// exchange"). A gradient that is already dense on some rank (e.g. an untied head's dW, which
// touches every row) always takes the dense path: its V rows would cost more sent sparsely. A
// gradient with a row mask (Parameter::set_trainable_rows; the same on every rank, checked by the
// fingerprint) always takes the sparse path, whatever the mode, and reports dense = false: it has
// no [V, d] buffer and at most its k rows to send.
//
//   embedding.backward(my_ids, dx);                     // each rank: its own part of the batch
//   all_reduce_gradients(params, comm, {}, &workspace);  // E, W, b: each becomes the sum over ranks
//   optimizer.step();                                   // the same step on every rank
//
// With a mean loss, the sum of the ranks' mean gradients is not the global mean unless every rank
// counts the same number of tokens (uneven splits, ignore_index). Exact for any split: use
// Reduction::sum with gradient_scale = 1 / (the global count of counted tokens, all-reduced
// first), as examples/parallel_lm.cpp does; gradient_scale = 1 / R with a mean loss is right
// only for equal counts.
//
// Both paths give every rank the same values: the sparse one adds the ranks' rows in rank order
// on every rank (bit-identical across ranks by construction); the dense one relies on the
// communicator's all-reduce returning the same result on every rank (the MPI standard recommends
// it; Open MPI's did in the tests with 1 to 3 ranks). The two paths agree to float rounding: bit for bit with 1 and 2
// ranks (one addition per entry, which commutes), to the reassociation of R terms with 3 or more.
#ifndef EMBEDHEAD_PARALLEL_DATA_PARALLEL_HPP
#define EMBEDHEAD_PARALLEL_DATA_PARALLEL_HPP

#include "../errors.hpp"
#include "../parameter.hpp"
#include "../types.hpp"
#include "communicator.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace embedhead {

enum class GradientExchange { automatic, sparse, dense };

struct GradientExchangeOptions {
  GradientExchange mode = GradientExchange::automatic;
  // automatic: dense when sum_r k_r * (d * sizeof(S) + 8) > dense_threshold * V * d * sizeof(S).
  // Finite and >= 0 (0: dense whenever any row is touched). Default 1.0: on 2 ranks of one
  // machine sparse won at every ratio up to 1 in every run, and the measured crossover lay
  // between 1 and 2 (bench/RESULTS.md); 1.0 also caps the sparse path's gathered buffer (ratio
  // times the dense gradient's size) at one dense gradient.
  double dense_threshold = 1.0;
};

struct GradientExchangeResult {
  bool dense = false;           // which path ran (the same on every rank)
  Index rows_sent = 0;          // this rank's k (sparse) or V (dense)
  Index rows_gathered = 0;      // sum over ranks of k_r (sparse), 0 dense
  Index union_rows = 0;         // touched rows after the exchange (V dense)
  std::int64_t bytes_sent = 0;  // this rank's payload in bytes: ids + rows, or V * d * sizeof(S)
};

// The sparse path's scratch: the gathered ids and rows and the union bookkeeping. Pass the same
// one to every step's exchange so that its buffers (sum_r k_r * d values) are allocated -- and
// their pages faulted in -- once, not on every call: on a 1 GB payload that is most of the cost.
// Buffers only grow. One workspace per Scalar; not shared between threads.
template <typename Scalar>
struct GradientExchangeWorkspace {
  std::vector<Index> ids, union_ids, slots;
  std::vector<unsigned char> fresh, written;
  std::vector<Scalar> rows;
};

namespace detail {

inline const char* exchange_mode_name(GradientExchange mode) {
  switch (mode) {
    case GradientExchange::automatic: return "automatic";
    case GradientExchange::sparse: return "sparse";
    case GradientExchange::dense: return "dense";
  }
  return "unknown";
}

// Throws value_error unless options are valid (a known mode, a finite threshold >= 0).
inline void check_exchange_options(const char* where, const GradientExchangeOptions& options) {
  const auto mode = static_cast<int>(options.mode);
  if (mode < 0 || mode > 2) {
    std::ostringstream message;
    message << where << ": options.mode = " << mode << " outside {automatic, sparse, dense} = [0, 2]";
    throw value_error(message.str());
  }
  if (!(options.dense_threshold >= 0.0) || !std::isfinite(options.dense_threshold)) {
    std::ostringstream message;
    message << where << ": options.dense_threshold = " << options.dense_threshold << " outside [0, inf)";
    throw value_error(message.str());
  }
}

// The fields every rank must agree on for one parameter: shape, frozen flag, row mask (trainable
// rows), and the options (so that automatic decides the same everywhere), folded into a fingerprint.
template <typename Scalar>
std::uint64_t exchange_fingerprint(const ParameterBase<Scalar>& parameter, const GradientExchangeOptions& options,
                                   std::uint64_t hash) {
  std::int64_t fields[4] = {static_cast<std::int64_t>(parameter.rows()), static_cast<std::int64_t>(parameter.cols()),
                            parameter.frozen() ? 1 : 0, static_cast<std::int64_t>(options.mode)};
  hash = fingerprint_bytes(fields, sizeof(fields), hash);
  const auto& mask = parameter.grad().row_mask();
  const std::int64_t masked[2] = {parameter.grad().has_row_mask() ? 1 : 0, static_cast<std::int64_t>(mask.size())};
  hash = fingerprint_bytes(masked, sizeof(masked), hash);
  if (!mask.empty()) hash = fingerprint_bytes(mask.data(), mask.size() * sizeof(Index), hash);
  return fingerprint_bytes(&options.dense_threshold, sizeof(double), hash);
}

// The exchange proper, after the checks agreed on every rank. Collective.
template <typename Scalar>
GradientExchangeResult exchange_gradient(ParameterBase<Scalar>& parameter, Communicator& comm,
                                         const GradientExchangeOptions& options,
                                         GradientExchangeWorkspace<Scalar>& work) {
  GradientExchangeResult result;
  if (parameter.frozen()) return result;  // agreed by the fingerprint: every rank returns here
  RowGradient<Scalar>& grad = parameter.grad();
  if (comm.size() == 1) {
    // One rank: the gradient is already the sum. Nothing is sent, densified or copied.
    result.dense = grad.is_dense();
    result.union_rows = grad.num_touched();
    return result;
  }
  const Index V = grad.rows(), d = grad.cols();
  const int R = comm.size(), me = comm.rank();
  const std::int64_t row_bytes = static_cast<std::int64_t>(d) * static_cast<std::int64_t>(sizeof(Scalar));

  // Collective 1: every rank's touched count, -1 for a gradient already dense.
  const std::vector<std::int64_t> reported = comm.all_gather(grad.is_dense() ? -1 : grad.num_touched());
  bool any_dense = false;
  Index gathered = 0;
  std::vector<Index> counts(static_cast<std::size_t>(R));
  for (int r = 0; r < R; ++r) {
    const std::int64_t k = reported[static_cast<std::size_t>(r)];
    any_dense = any_dense || k < 0;
    counts[static_cast<std::size_t>(r)] = static_cast<Index>(k < 0 ? 0 : k);
    gathered += counts[static_cast<std::size_t>(r)];
  }
  // The byte model, in double: K * (d * s + 8) against threshold * V * d * s.
  const double sparse_bytes = static_cast<double>(gathered) * static_cast<double>(row_bytes + 8);
  const double dense_bytes = static_cast<double>(V) * static_cast<double>(row_bytes);
  // A gradient with a row mask (the same on every rank: the fingerprint) is never made dense: its
  // rows are the mask's at most, and it has no [V, d] buffer.
  const bool dense = !grad.has_row_mask() && (any_dense || options.mode == GradientExchange::dense ||
                                              (options.mode == GradientExchange::automatic &&
                                               sparse_bytes > options.dense_threshold * dense_bytes));

  if (dense) {
    // Densify (no-op if dense already), then sum the whole [V, d] buffer in place.
    auto all = grad.dense_accumulator();
    comm.all_reduce_sum(all.data(), V * d);
    result.dense = true;
    result.rows_sent = V;
    result.union_rows = V;
    result.bytes_sent = static_cast<std::int64_t>(V) * row_bytes;
    return result;
  }

  const Index k_me = counts[static_cast<std::size_t>(me)];
  result.rows_sent = k_me;
  result.rows_gathered = gathered;
  result.bytes_sent = static_cast<std::int64_t>(k_me) * (row_bytes + 8);

  // Collectives 2 and 3: the ids (Index, sorted per rank) and the rows [k_r, d], in rank order.
  // Every buffer is allocated before the gradient changes.
  std::vector<Index>& ids = work.ids;
  ids.resize(static_cast<std::size_t>(gathered));
  work.rows.resize(static_cast<std::size_t>(gathered * d));
  const Eigen::Map<const RowMatrix<Scalar>> rows(work.rows.data(), gathered, d);
  std::vector<Index> value_counts(static_cast<std::size_t>(R));
  for (int r = 0; r < R; ++r) value_counts[static_cast<std::size_t>(r)] = counts[static_cast<std::size_t>(r)] * d;
  if (gathered > 0) {
    comm.all_gather_v(grad.touched_rows().data(), ids.data(), counts);
    comm.all_gather_v(grad.touched_values().data(), work.rows.data(), value_counts);
  }

  // The union of the touched rows: a merge of R sorted lists, done by sorting the gathered ids
  // (K log K, small beside the K * d additions).
  std::vector<Index>& union_ids = work.union_ids;
  union_ids.assign(ids.begin(), ids.end());
  std::sort(union_ids.begin(), union_ids.end());
  union_ids.erase(std::unique(union_ids.begin(), union_ids.end()), union_ids.end());
  const Index U = static_cast<Index>(union_ids.size());
  std::vector<Index>& slots = work.slots;
  slots.resize(static_cast<std::size_t>(U));
  std::vector<unsigned char>& fresh = work.fresh;
  fresh.resize(static_cast<std::size_t>(U));
  std::vector<unsigned char>& written = work.written;
  written.assign(static_cast<std::size_t>(U), 0);

  // Rebuild the gradient as the union (every row fresh after clear(), so touch_rows does not zero
  // them: the first rank holding a row assigns it, later ranks add), adding the ranks' rows in
  // rank order so that every rank performs the same additions in the same order.
  grad.clear();
  grad.touch_rows(union_ids.data(), U, slots.data(), fresh.data());
  Index at = 0;  // row of `rows` / entry of `ids`
  for (int r = 0; r < R; ++r) {
    Index u = 0;  // both lists sorted: one forward walk finds each id's place in the union
    for (Index j = 0; j < counts[static_cast<std::size_t>(r)]; ++j, ++at) {
      while (union_ids[static_cast<std::size_t>(u)] != ids[static_cast<std::size_t>(at)]) ++u;
      if (slots[static_cast<std::size_t>(u)] == RowGradient<Scalar>::kNoSlot) continue;  // outside a row mask
      auto target = grad.slot_row(slots[static_cast<std::size_t>(u)]);
      if (written[static_cast<std::size_t>(u)]) {
        target += rows.row(at);
      } else {
        target = rows.row(at);
        written[static_cast<std::size_t>(u)] = 1;
      }
    }
  }
  result.union_rows = U;
  return result;
}

}  // namespace detail

// parameter's gradient (RowGradient [V, d], sparse or dense on each rank) -> the sum over ranks,
// the same on every rank. Sparse path: the gradient ends sparse with the union of every rank's
// touched rows, O(sum_r k_r * d) time and a gathered buffer of sum_r k_r * d values (never
// O(V * d)). Dense path: the gradient ends dense, O(V * d). Which path runs: see
// GradientExchangeOptions; a gradient already dense on any rank forces dense in every mode.
// Frozen (on every rank): a no-op returning an all-zero result. One rank: the gradient is already
// the sum, so nothing happens in any mode (result: dense = gradient.is_dense(), union_rows = its
// touched rows, nothing sent). `workspace` (optional) keeps the
// sparse path's buffers between calls; without one each call allocates its own.
// Any parameter whose gradient is Scalar: a Parameter<Scalar>, a low-precision
// Parameter<Storage, float> (only the float gradient is exchanged), a ParameterBase<Scalar>.
// Collective: every rank calls it with the same parameter shape, frozen flag and options.
// \pre the same call order on every rank.
// \throws value_error (on every rank, before any change) if options are invalid on some rank
// (mode outside the enum, dense_threshold negative or not finite), or if the ranks disagree on
// the parameter's shape [V, d], its frozen flag or the options. Strong guarantee for these; if
// memory runs out during the exchange the gradient is unspecified.
template <typename Scalar>
GradientExchangeResult all_reduce_gradient(ParameterBase<Scalar>& parameter, Communicator& comm,
                                           const GradientExchangeOptions& options = {},
                                           GradientExchangeWorkspace<Scalar>* workspace = nullptr) {
  constexpr const char* where = "all_reduce_gradient";
  check_on_every_rank(
      comm, where, [&] { detail::check_exchange_options(where, options); },
      detail::exchange_fingerprint(parameter, options, 0xcbf29ce484222325ULL),
      "the parameter's shape [V, d], its frozen flag or the exchange options");
  GradientExchangeWorkspace<Scalar> local;
  return detail::exchange_gradient(parameter, comm, options, workspace ? *workspace : local);
}

// parameters (each non-null) -> every distinct parameter's gradient summed over ranks, in list
// order; a Parameter listed twice (a tied table: the embedding's E is also the head's W) is
// exchanged once. -> one result per list entry; a repeated entry gets its first occurrence's.
// One workspace serves the whole list (optional, as for all_reduce_gradient). The entries may be
// Parameter<Scalar>, low-precision Parameter<Storage, float> or ParameterBase<Scalar> (a
// low-precision head's parameters()).
// Collective: every rank passes lists of the same length whose entries agree in shape, frozen
// flag and repetition pattern.
// \throws value_error (on every rank, before any change) if an entry is null on some rank,
// options are invalid, or the ranks disagree on the list's length, an entry's shape [V, d] or
// frozen flag, or the options.
namespace detail {
template <typename P, typename Scalar = typename P::grad_type>
std::vector<GradientExchangeResult> all_reduce_gradients_impl(const std::vector<std::shared_ptr<P>>& parameters,
                                                              Communicator& comm,
                                                              const GradientExchangeOptions& options,
                                                              GradientExchangeWorkspace<Scalar>* workspace) {
  constexpr const char* where = "all_reduce_gradients";
  // first[i]: the index of parameters[i]'s first occurrence (i itself if new).
  std::vector<std::size_t> first(parameters.size());
  for (std::size_t i = 0; i < parameters.size(); ++i) {
    first[i] = i;
    for (std::size_t j = 0; j < i; ++j)
      if (parameters[j] && parameters[j] == parameters[i]) {
        first[i] = j;
        break;
      }
  }
  std::uint64_t hash = 0xcbf29ce484222325ULL;
  const std::int64_t count = static_cast<std::int64_t>(parameters.size());
  hash = detail::fingerprint_bytes(&count, sizeof(count), hash);
  for (std::size_t i = 0; i < parameters.size(); ++i) {
    const std::int64_t repeat_of = static_cast<std::int64_t>(first[i]);
    hash = detail::fingerprint_bytes(&repeat_of, sizeof(repeat_of), hash);
    if (parameters[i]) hash = detail::exchange_fingerprint(*parameters[i], options, hash);
  }
  check_on_every_rank(
      comm, where,
      [&] {
        detail::check_exchange_options(where, options);
        for (std::size_t i = 0; i < parameters.size(); ++i)
          if (!parameters[i]) {
            std::ostringstream message;
            message << where << ": parameters[" << i << "] is null (of " << parameters.size() << " entries)";
            throw value_error(message.str());
          }
      },
      hash, "the parameter list (length, repeats, each shape [V, d] and frozen flag) or the exchange options");
  GradientExchangeWorkspace<Scalar> local;
  GradientExchangeWorkspace<Scalar>& work = workspace ? *workspace : local;
  std::vector<GradientExchangeResult> results(parameters.size());
  for (std::size_t i = 0; i < parameters.size(); ++i)
    results[i] = first[i] == i ? detail::exchange_gradient(*parameters[i], comm, options, work) : results[first[i]];
  return results;
}
}  // namespace detail

template <typename Scalar, typename Value = Scalar>
std::vector<GradientExchangeResult> all_reduce_gradients(
    const std::vector<std::shared_ptr<Parameter<Value, Scalar>>>& parameters, Communicator& comm,
    const GradientExchangeOptions& options = {}, GradientExchangeWorkspace<Scalar>* workspace = nullptr) {
  return detail::all_reduce_gradients_impl(parameters, comm, options, workspace);
}
template <typename P, typename Scalar = typename P::grad_type>
std::vector<GradientExchangeResult> all_reduce_gradients(const std::vector<std::shared_ptr<P>>& parameters,
                                                         Communicator& comm,
                                                         const GradientExchangeOptions& options = {},
                                                         GradientExchangeWorkspace<Scalar>* workspace = nullptr) {
  return detail::all_reduce_gradients_impl(parameters, comm, options, workspace);
}

}  // namespace embedhead

#endif  // EMBEDHEAD_PARALLEL_DATA_PARALLEL_HPP
