// embedhead: the under-trained-token guard -- which rows of a table training never updated, a
// check that a batch does not look any of them up, and a repair that sets them to the mean of the
// trained rows.
//
// The problem (axolotl and unsloth users with Llama-3 base models): a vocabulary has tokens that
// pre-training never saw (reserved / special tokens). Their embedding rows were never updated:
// they hold whatever the initialisation or export left (often zeros or tiny values), and a batch
// that uses one -- a chat template's new special tokens -- gives activations and gradients of a
// scale nothing was trained for: inf / NaN gradient norms. The fix: find such rows and set them to
// the mean of the trained rows before fine-tuning (as resize_vocabulary does for new tokens).
//
// Finding them by COUNTING, not by value. RowUpdateCounter keeps, per row, how many steps updated
// it: record(p), called once per optimizer step (after backward, before zero_grad), adds 1 to the
// count of every row p's gradient touched (RowGradient::touched_rows: the rows a lazy optimizer
// updates). A token repeated within one batch is one touched row: it counts ONCE per step. Cost
// O(touched rows) per record, V int64 of memory. A row of count 0 was never updated, whatever its
// values: a detector that flags rows by their values (e.g. "max of the row <= 0") wrongly flags
// trained rows whose entries are all negative; this one cannot.
//   - A dense gradient (a tied head's dW = dlogits^T h) touches every row, so with a tied table
//     every row counts as updated at every step: to guard the INPUT side of a tied table, count
//     the ids the batches looked up instead (record_ids(ids), once per step) -- or keep a counter
//     for the untied embedding only.
//   - A frozen parameter, or one whose gradient has no touched row, is not counted (the
//     optimizers skip it; Optimizer::step's rules).
//   - After resize_vocabulary, call resize(result.rows, result.kept_rows): kept rows keep their
//     counts, new rows start at 0 (never updated). record() throws shape_error until then.
//   - Saved beside a checkpoint by io/update_counts.hpp (add_update_counts / read_update_counts).
//
// check(ids) lists the ids of a batch whose rows have count 0 (policy report), or throws
// untrained_token_error naming the first one in the batch (policy throw_error).
// repair_untrained_rows(table, counter) sets every row of count 0 to the mean of the rows of
// count > 0; repair_rows(table, ids) sets listed rows to the mean of the others.
// For a checkpoint loaded without counters, find_untrained_rows(table) flags rows by their NORM
// (zero, or tiny next to the median row norm), which does not depend on the sign of the entries.
//
// Every function checks everything first: on a throw the table and the counter are unchanged.
#ifndef EMBEDHEAD_OPTIM_UNTRAINED_GUARD_HPP
#define EMBEDHEAD_OPTIM_UNTRAINED_GUARD_HPP

#include "../detail/checks.hpp"
#include "../errors.hpp"
#include "../parameter.hpp"
#include "../token_ids.hpp"
#include "../types.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace embedhead {

enum class UntrainedPolicy {
  report,       // check() returns the untrained ids of the batch
  throw_error,  // check() throws untrained_token_error if there is any
};

struct UntrainedCheckOptions {
  UntrainedPolicy policy = UntrainedPolicy::report;
  // An id never flagged: the embedding's padding_idx, whose row never gets a gradient.
  std::optional<Index> padding_idx;
  // Ids must lie in [0, valid_vocab) (rows from there on are padding, resize_vocabulary's
  // valid_vocab); -1: in [0, rows).
  Index valid_vocab = -1;
};

// One distinct untrained id of a batch.
struct UntrainedId {
  Index id = 0;
  Index occurrences = 0;  // tokens of the batch with this id
  Index first_token = 0;  // the first such token, n = b * T + t (row-major)
  Index b = 0, t = 0;     // its position
};

struct UntrainedReport {
  std::vector<UntrainedId> ids;  // increasing id, each once
  Index occurrences = 0;         // tokens of the batch whose id is untrained (sum of ids[i].occurrences)
  bool empty() const { return ids.empty(); }
};

// Thrown by RowUpdateCounter::check under UntrainedPolicy::throw_error; a value_error that also
// carries the report.
class untrained_token_error : public value_error {
 public:
  untrained_token_error(const std::string& message, UntrainedReport report)
      : value_error(message), report_(std::move(report)) {}
  const UntrainedReport& report() const { return report_; }

 private:
  UntrainedReport report_;
};

namespace detail {

// -> valid_vocab, or rows for -1. \throws value_error unless valid_vocab is -1 or in [1, rows].
inline Index checked_valid_vocab(const char* where, Index valid_vocab, Index rows) {
  if (valid_vocab != -1 && (valid_vocab < 1 || valid_vocab > rows)) {
    std::ostringstream message;
    message << where << ": valid_vocab = " << valid_vocab << " outside [1, " << rows << "] (or -1 for all rows)";
    throw value_error(message.str());
  }
  return valid_vocab == -1 ? rows : valid_vocab;
}

// \throws index_error for a row outside [0, n), value_error for rows not strictly increasing,
// naming the row and its index in the list.
inline void check_sorted_rows(const char* where, const std::vector<Index>& list, Index n) {
  for (std::size_t j = 0; j < list.size(); ++j) {
    if (list[j] < 0 || list[j] >= n) {
      std::ostringstream message;
      message << where << ": row " << list[j] << " at index " << j << " outside [0, " << n << ")";
      throw index_error(message.str());
    }
    if (j > 0 && list[j] <= list[j - 1]) {
      std::ostringstream message;
      message << where << ": rows must be strictly increasing (sorted, no repeats), but row " << list[j] << " at index "
              << j << " follows " << list[j - 1];
      throw value_error(message.str());
    }
  }
}

}  // namespace detail

// Per-row update counts of one table [rows, *]. See the header.
class RowUpdateCounter {
 public:
  // rows counts of 0. \throws value_error if rows < 1.
  explicit RowUpdateCounter(Index rows) {
    detail::check_size("RowUpdateCounter", "rows", rows);
    counts_.assign(static_cast<std::size_t>(rows), 0);
  }
  // Restores counts() and records() (a saved counter). \throws value_error if counts is empty,
  // records < 0, or a count is outside [0, records] (naming the row and the count).
  RowUpdateCounter(std::vector<std::int64_t> counts, std::int64_t records) {
    const char* where = "RowUpdateCounter";
    detail::check_size(where, "rows (counts.size())", static_cast<Index>(counts.size()));
    if (records < 0) {
      std::ostringstream message;
      message << where << ": records = " << records << " outside [0, inf)";
      throw value_error(message.str());
    }
    for (std::size_t r = 0; r < counts.size(); ++r)
      if (counts[r] < 0 || counts[r] > records) {
        std::ostringstream message;
        message << where << ": the count of row " << r << " is " << counts[r] << ", outside [0, " << records
                << "] (records)";
        throw value_error(message.str());
      }
    counts_ = std::move(counts);
    records_ = records;
  }

  Index rows() const { return static_cast<Index>(counts_.size()); }
  // The number of record / record_rows / record_ids calls that counted at least one row.
  std::int64_t records() const { return records_; }
  // -> how many steps updated row r. \throws index_error if r is outside [0, rows).
  std::int64_t count(Index r) const {
    check_row("RowUpdateCounter::count", r);
    return counts_[static_cast<std::size_t>(r)];
  }
  bool trained(Index r) const { return count(r) > 0; }
  // Every row's count, [rows].
  const std::vector<std::int64_t>& counts() const { return counts_; }
  // -> the rows of count 0, increasing. O(rows).
  std::vector<Index> untrained_rows() const {
    std::vector<Index> out;
    for (Index r = 0; r < rows(); ++r)
      if (counts_[static_cast<std::size_t>(r)] == 0) out.push_back(r);
    return out;
  }
  // -> how many rows have a count > 0. O(rows).
  Index num_trained() const {
    return static_cast<Index>(std::count_if(counts_.begin(), counts_.end(), [](std::int64_t c) { return c > 0; }));
  }

  // Counts one step of p: +1 for every row its gradient touches (each once, however many tokens
  // of the batch had that id; every row for a dense gradient). Call once per optimizer step,
  // after backward and before zero_grad. Counts nothing, and records() stays, when p is frozen or
  // its gradient touches no row (the optimizers skip it then). Any Parameter<Value, Grad>.
  // \throws shape_error if p.rows() != rows() (resized without resize(); nothing changed).
  // Cost O(touched rows).
  template <typename Grad>
  void record(const ParameterBase<Grad>& p) {
    if (p.rows() != rows()) {
      std::ostringstream message;
      message << "RowUpdateCounter::record: parameter '" << p.name() << "' has " << p.rows() << " rows but the counter "
              << rows() << "; call resize(rows, kept_rows) after resize_vocabulary / Parameter::resize_rows";
      throw shape_error(message.str());
    }
    if (p.frozen() || p.grad().num_touched() == 0) return;
    for (const Index r : p.grad().touched_rows()) ++counts_[static_cast<std::size_t>(r)];
    ++records_;
  }

  // Counts one step that updated `rows_updated` (sorted, unique, in [0, rows)): +1 each. Nothing
  // is counted for an empty list. \throws index_error for a row outside [0, rows), value_error for
  // a list that is not strictly increasing, naming the row and its index; nothing changed.
  void record_rows(const std::vector<Index>& rows_updated) {
    detail::check_sorted_rows("RowUpdateCounter::record_rows", rows_updated, rows());
    if (rows_updated.empty()) return;
    for (const Index r : rows_updated) ++counts_[static_cast<std::size_t>(r)];
    ++records_;
  }

  // Counts one step from the ids a batch looked up: +1 for each distinct id (the input side of a
  // tied table, whose dense head gradient touches every row). \throws index_error naming the
  // first id outside [0, rows) and its (b, t); nothing changed. Cost O(N log N).
  void record_ids(TokenIds ids) {
    std::vector<Index> distinct;
    distinct.reserve(static_cast<std::size_t>(ids.size()));
    ids.visit([&](const auto& typed) {
      detail::check_ids("RowUpdateCounter::record_ids", typed, rows());
      for (Index b = 0; b < typed.rows(); ++b)
        for (Index t = 0; t < typed.cols(); ++t) distinct.push_back(static_cast<Index>(typed(b, t)));
    });
    std::sort(distinct.begin(), distinct.end());
    distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
    record_rows(distinct);
  }

  // -> the ids of the batch whose rows have count 0 (see UntrainedReport), ignoring
  // options.padding_idx. Under UntrainedPolicy::throw_error, throws untrained_token_error instead
  // when there is any, e.g.
  //   RowUpdateCounter::check: id 7 at (b=0, t=3) has a row that no step updated (count 0); 2
  //   distinct ids of the batch (3 tokens) are untrained: 7, 9 (repair_untrained_rows sets such
  //   rows to the mean of the trained rows)
  // \throws index_error naming the first id outside [0, valid_vocab) and its (b, t) (with either
  // policy); value_error for valid_vocab neither -1 nor in [1, rows]. The counter is const.
  // Cost O(N) plus O(u log u) for the u tokens with an untrained id; no allocation when u = 0.
  UntrainedReport check(TokenIds ids, const UntrainedCheckOptions& options = {}) const {
    const char* where = "RowUpdateCounter::check";
    const Index valid = detail::checked_valid_vocab(where, options.valid_vocab, rows());
    const Index padding = options.padding_idx.value_or(-1);
    const Index T = ids.cols();
    std::vector<std::pair<Index, Index>> hits;  // (id, n) of each token whose row is untrained
    ids.visit([&](const auto& typed) {
      detail::check_ids(where, typed, valid);
      for (Index b = 0; b < typed.rows(); ++b)
        for (Index t = 0; t < typed.cols(); ++t) {
          const auto id = static_cast<Index>(typed(b, t));
          if (id != padding && counts_[static_cast<std::size_t>(id)] == 0) hits.emplace_back(id, b * T + t);
        }
    });
    UntrainedReport report;
    if (hits.empty()) return report;
    const Index first_n = hits.front().second;  // tokens were visited in row-major order
    const Index first_id = hits.front().first;
    report.occurrences = static_cast<Index>(hits.size());
    std::sort(hits.begin(), hits.end());
    for (std::size_t i = 0; i < hits.size();) {
      std::size_t j = i;
      while (j < hits.size() && hits[j].first == hits[i].first) ++j;
      const Index n = hits[i].second;
      report.ids.push_back({hits[i].first, static_cast<Index>(j - i), n, n / T, n % T});
      i = j;
    }
    if (options.policy == UntrainedPolicy::throw_error) {
      std::ostringstream message;
      message << where << ": id " << first_id << " at (b=" << first_n / T << ", t=" << first_n % T
              << ") has a row that no step updated (count 0); " << report.ids.size() << " distinct id"
              << (report.ids.size() == 1 ? " of the batch (" : "s of the batch (") << report.occurrences << " token"
              << (report.occurrences == 1 ? "" : "s") << ") " << (report.ids.size() == 1 ? "is" : "are")
              << " untrained: ";
      for (std::size_t i = 0; i < report.ids.size() && i < 8; ++i) message << (i ? ", " : "") << report.ids[i].id;
      if (report.ids.size() > 8) message << ", ...";
      message << " (repair_untrained_rows sets such rows to the mean of the trained rows)";
      throw untrained_token_error(message.str(), std::move(report));
    }
    return report;
  }

  // Follows a row-count change of the table (resize_vocabulary: resize(r.rows, r.kept_rows)):
  // rows [0, keep) keep their counts, every other row is 0 (never updated); keep = -1 takes
  // min(rows(), new_rows). \throws value_error if new_rows < 1 or keep is neither -1 nor in
  // [0, min(rows(), new_rows)]; nothing changed.
  void resize(Index new_rows, Index keep = -1) {
    const char* where = "RowUpdateCounter::resize";
    detail::check_size(where, "new_rows", new_rows);
    const Index most = std::min(rows(), new_rows);
    if (keep != -1) detail::check_range(where, "keep", keep, 0, most);
    const Index kept = keep == -1 ? most : keep;
    std::vector<std::int64_t> resized(static_cast<std::size_t>(new_rows), 0);
    std::copy_n(counts_.begin(), kept, resized.begin());
    counts_.swap(resized);
  }

  // Every count and records() back to 0.
  void reset() {
    std::fill(counts_.begin(), counts_.end(), 0);
    records_ = 0;
  }

 private:
  void check_row(const char* where, Index r) const {
    if (r >= 0 && r < rows()) return;
    std::ostringstream message;
    message << where << ": row " << r << " outside [0, " << rows() << ")";
    throw index_error(message.str());
  }

  std::vector<std::int64_t> counts_;
  std::int64_t records_ = 0;
};

struct UntrainedRepairOptions {
  // A row never repaired and left out of the mean: the embedding's padding_idx (a zero row).
  std::optional<Index> padding_idx;
  // Rows [valid_vocab, rows) are padding (resize_vocabulary's valid_vocab): never repaired, left
  // out of the mean; -1: every row is a token.
  Index valid_vocab = -1;
};

namespace detail {

template <typename Value>
double widen_value(Value x) {
  if constexpr (std::is_floating_point_v<Value>)
    return static_cast<double>(x);
  else
    return static_cast<double>(static_cast<float>(x));
}

// x rounded once (to nearest even) to Value: float / double directly; bf16 / fp16 through a float
// rounded to odd, which makes the two roundings one (float has >= 2 more bits than either).
template <typename Value>
Value narrow_value(double x) {
  if constexpr (std::is_floating_point_v<Value>) {
    return static_cast<Value>(x);
  } else {
    float f = static_cast<float>(x);
    if (std::isfinite(f) && static_cast<double>(f) != x) {
      std::uint32_t bits = 0;
      std::memcpy(&bits, &f, sizeof bits);
      if ((bits & 1u) == 0)
        f = std::nextafter(f, x > static_cast<double>(f) ? std::numeric_limits<float>::infinity()
                                                         : -std::numeric_limits<float>::infinity());
    }
    return static_cast<Value>(f);
  }
}

// Sets table's rows `targets` (sorted, unique, in range) to the mean of the rows r with source[r],
// summed in double in row order and rounded once to Value. Checks first: a source set that is
// empty, or a mean that is not finite once rounded to Value, is a value_error (nothing written).
template <typename Value, typename Grad>
void set_rows_to_mean(Parameter<Value, Grad>& table, const std::vector<Index>& targets,
                      const std::vector<unsigned char>& source, const char* where, const char* source_name) {
  const Index d = table.cols();
  const auto values = table.value();
  Eigen::Matrix<double, 1, Eigen::Dynamic> sum = Eigen::Matrix<double, 1, Eigen::Dynamic>::Zero(d);
  Index n = 0;
  for (Index r = 0; r < table.rows(); ++r) {
    if (!source[static_cast<std::size_t>(r)]) continue;
    for (Index c = 0; c < d; ++c) sum(c) += widen_value(values(r, c));
    ++n;
  }
  if (n == 0) {
    std::ostringstream message;
    message << where << ": no row is " << source_name << ", so there is no mean to set " << targets.size() << " row"
            << (targets.size() == 1 ? "" : "s") << " to; nothing was changed";
    throw value_error(message.str());
  }
  std::vector<Value> mean(static_cast<std::size_t>(d));
  for (Index c = 0; c < d; ++c) {
    const double m = sum(c) / static_cast<double>(n);
    const Value rounded = narrow_value<Value>(m);
    if (!std::isfinite(m) || !std::isfinite(widen_value(rounded))) {
      std::ostringstream message;
      message.precision(9);
      message << where << ": the mean of the " << n << " " << source_name << " rows is " << m << " in column " << c
              << ", which is not finite in "
              << (std::is_floating_point_v<Value> ? scalar_name<Value>() : "the table's type")
              << " (a trained row holds a NaN, an infinity or values too large); nothing was changed";
      throw value_error(message.str());
    }
    mean[static_cast<std::size_t>(c)] = rounded;
  }
  auto out = table.value();
  for (const Index r : targets) std::copy(mean.begin(), mean.end(), out.row(r).data());
}

inline void check_padding_idx(const char* where, const std::optional<Index>& padding_idx, Index rows) {
  if (!padding_idx || (*padding_idx >= 0 && *padding_idx < rows)) return;
  std::ostringstream message;
  message << where << ": padding_idx " << *padding_idx << " outside [0, " << rows << ")";
  throw index_error(message.str());
}

}  // namespace detail

// Sets every row of count 0 (below options.valid_vocab, other than options.padding_idx) to the
// mean of the rows of count > 0 (same limits), computed in double and rounded once to the table's
// type (float, double, bf16, fp16). -> the rows set, increasing (empty: nothing to do, nothing
// changed). The counts are not changed: the repaired rows were still never updated (call
// counter.record_rows(result) if check() should stop flagging them). The gradient and optimizer
// state are not touched (a never-updated row's lazy state is still its initial value). A frozen
// table is repaired too: this is not an optimizer step.
// \throws shape_error if table.rows() != counter.rows(); index_error for a padding_idx outside
// [0, rows); value_error for valid_vocab neither -1 nor in [1, rows], when no row is trained
// (nothing to average), or when the mean is not finite in the table's type (naming the column).
// Nothing is changed on throw. Cost O(rows * d).
template <typename Value, typename Grad>
std::vector<Index> repair_untrained_rows(Parameter<Value, Grad>& table, const RowUpdateCounter& counter,
                                         const UntrainedRepairOptions& options = {}) {
  const char* where = "repair_untrained_rows";
  if (table.rows() != counter.rows()) {
    std::ostringstream message;
    message << where << ": the table '" << table.name() << "' has " << table.rows() << " rows but the counter "
            << counter.rows() << "; resize the counter with the table (RowUpdateCounter::resize)";
    throw shape_error(message.str());
  }
  const Index valid = detail::checked_valid_vocab(where, options.valid_vocab, counter.rows());
  detail::check_padding_idx(where, options.padding_idx, table.rows());
  std::vector<unsigned char> source(static_cast<std::size_t>(table.rows()), 0);
  std::vector<Index> targets;
  for (Index r = 0; r < valid; ++r) {
    if (options.padding_idx && r == *options.padding_idx) continue;
    if (counter.counts()[static_cast<std::size_t>(r)] > 0)
      source[static_cast<std::size_t>(r)] = 1;
    else
      targets.push_back(r);
  }
  if (targets.empty()) return targets;
  detail::set_rows_to_mean(table, targets, source, where, "trained (count > 0)");
  return targets;
}

// Sets the listed rows (sorted, unique, in [0, valid_vocab)) to the mean of the rows NOT listed
// (below valid_vocab, other than padding_idx), and, when a counter is given, of count > 0 too --
// for rows found by find_untrained_rows, or a known list of reserved tokens. Rounded once as
// repair_untrained_rows. An empty list changes nothing.
// \throws index_error for a row outside [0, valid_vocab) or a padding_idx outside [0, rows) (or
// the padding_idx listed), value_error for a list not strictly increasing (naming the row and its
// index), valid_vocab out of range, no row to average, or a mean not finite in the table's type;
// shape_error for a counter of another row count. Nothing is changed on throw. Cost O(rows * d).
template <typename Value, typename Grad>
void repair_rows(Parameter<Value, Grad>& table, const std::vector<Index>& rows,
                 const RowUpdateCounter* counter = nullptr, const UntrainedRepairOptions& options = {}) {
  const char* where = "repair_rows";
  if (counter && table.rows() != counter->rows()) {
    std::ostringstream message;
    message << where << ": the table '" << table.name() << "' has " << table.rows() << " rows but the counter "
            << counter->rows();
    throw shape_error(message.str());
  }
  const Index valid = detail::checked_valid_vocab(where, options.valid_vocab, table.rows());
  detail::check_padding_idx(where, options.padding_idx, table.rows());
  detail::check_sorted_rows(where, rows, valid);
  if (options.padding_idx && std::binary_search(rows.begin(), rows.end(), *options.padding_idx)) {
    std::ostringstream message;
    message << where << ": row " << *options.padding_idx << " is the padding_idx, which is never repaired";
    throw index_error(message.str());
  }
  if (rows.empty()) return;
  std::vector<unsigned char> source(static_cast<std::size_t>(table.rows()), 0);
  for (Index r = 0; r < valid; ++r)
    source[static_cast<std::size_t>(r)] = (!counter || counter->counts()[static_cast<std::size_t>(r)] > 0) ? 1 : 0;
  for (const Index r : rows) source[static_cast<std::size_t>(r)] = 0;
  if (options.padding_idx) source[static_cast<std::size_t>(*options.padding_idx)] = 0;
  detail::set_rows_to_mean(table, rows, source, where, counter ? "unlisted trained (count > 0)" : "unlisted");
}

struct FindUntrainedOptions {
  // A row is flagged when its L2 norm is <= relative_norm x the median L2 norm of the rows
  // considered: exact zero rows always are. In [0, 1).
  double relative_norm = 1e-2;
  std::optional<Index> padding_idx;  // never flagged, left out of the median
  Index valid_vocab = -1;            // rows from here on are padding: never flagged, left out; -1: all
};

// The value-based detector, for a table loaded without counters: -> the rows whose L2 norm
// (computed in double) is at most relative_norm x the median row norm, increasing. Untrained
// reserved tokens are left at zero or at values far smaller than the trained rows; a trained row
// whose entries are all negative has an ordinary norm and is not flagged (the bug of detectors
// that test max(row) <= threshold). A row holding NaN or an infinity is not flagged here (it is
// not small; find it with allFinite). If half the rows or more are zero the median is 0 and only
// the zero rows are flagged.
// \throws value_error for relative_norm outside [0, 1) or valid_vocab out of range, index_error
// for a padding_idx outside [0, rows). Cost O(rows * d).
template <typename Value, typename Grad>
std::vector<Index> find_untrained_rows(const Parameter<Value, Grad>& table, const FindUntrainedOptions& options = {}) {
  const char* where = "find_untrained_rows";
  if (!(options.relative_norm >= 0 && options.relative_norm < 1)) {
    std::ostringstream message;
    message << where << ": relative_norm = " << options.relative_norm << " outside [0, 1)";
    throw value_error(message.str());
  }
  const Index valid = detail::checked_valid_vocab(where, options.valid_vocab, table.rows());
  detail::check_padding_idx(where, options.padding_idx, table.rows());
  const auto values = table.value();
  std::vector<double> norms(static_cast<std::size_t>(valid));
  std::vector<double> considered;
  considered.reserve(static_cast<std::size_t>(valid));
  for (Index r = 0; r < valid; ++r) {
    double s = 0;
    for (Index c = 0; c < table.cols(); ++c) {
      const double x = detail::widen_value(values(r, c));
      s += x * x;
    }
    norms[static_cast<std::size_t>(r)] = std::sqrt(s);
    if (!(options.padding_idx && r == *options.padding_idx)) considered.push_back(std::sqrt(s));
  }
  std::vector<Index> out;
  if (considered.empty()) return out;
  // The lower median: nth_element over the norms (NaN rows compare as large: replaced by +inf).
  for (double& x : considered)
    if (std::isnan(x)) x = std::numeric_limits<double>::infinity();
  const auto middle = considered.begin() + static_cast<std::ptrdiff_t>((considered.size() - 1) / 2);
  std::nth_element(considered.begin(), middle, considered.end());
  // A median that is not finite (half the rows or more hold an infinity or NaN) flags zero rows only.
  const double threshold = std::isfinite(*middle) ? options.relative_norm * *middle : 0.0;
  for (Index r = 0; r < valid; ++r) {
    if (options.padding_idx && r == *options.padding_idx) continue;
    const double norm = norms[static_cast<std::size_t>(r)];
    if (norm == 0 || norm <= threshold) out.push_back(r);
  }
  return out;
}

}  // namespace embedhead

#endif  // EMBEDHEAD_OPTIM_UNTRAINED_GUARD_HPP
