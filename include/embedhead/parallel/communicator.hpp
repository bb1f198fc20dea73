// embedhead: the collective operations the parallel layers need, behind a small interface.
//
// A Communicator is a group of `size()` processes (ranks) that call the same collectives in the
// same order. The library needs four things of it: the rank and the size, an in-place all-reduce
// (sum or max, of float, double or int64), and an all-gather with a different byte count from each
// rank. Two implementations:
//   SingleProcessCommunicator  here, size 1: every collective is the identity (or a copy), so each
//                              parallel class runs, and is tested, without MPI;
//   MpiCommunicator            <embedhead/mpi_communicator.hpp>, target embedhead::mpi (OpenMPI or
//                              any MPI-3 library); the core headers never include <mpi.h>.
// Anything else (NCCL, gloo, a test double) implements the same four virtual functions.
//
// Errors across ranks. A check that fails on one rank while the others enter a collective would
// leave them waiting forever. So the parallel layers run their checks through check_on_every_rank
// below: every rank runs its own checks, the outcomes are all-gathered (one small collective), and
// if any rank failed, every rank throws the same exception -- the lowest failing rank's, its message
// ending in "[on rank r of R]" -- before any state changes. The same call compares a fingerprint of
// the inputs that must be identical on every rank (the token ids, the targets), so ranks fed
// different batches fail loudly instead of silently summing unrelated rows.
//
// Vocabulary shards: vocab_shard(V, rank, size) gives rank r the rows [begin, end) of a [V, d]
// table, balanced (the first V % size ranks own one row more), so V need not divide evenly.
#ifndef EMBEDHEAD_PARALLEL_COMMUNICATOR_HPP
#define EMBEDHEAD_PARALLEL_COMMUNICATOR_HPP

#include "../errors.hpp"
#include "../types.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace embedhead {

enum class ReduceOp { sum, max };
enum class ElementType { float32, float64, int64 };

template <typename T>
constexpr ElementType element_type_of() {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, std::int64_t>,
                "collectives take float, double or std::int64_t");
  if constexpr (std::is_same_v<T, float>)
    return ElementType::float32;
  else if constexpr (std::is_same_v<T, double>)
    return ElementType::float64;
  else
    return ElementType::int64;
}

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;  // in [0, size())
  virtual int size() const = 0;  // >= 1

  // data [count] <- the elementwise sum (or max) of every rank's data [count], in place. Every
  // rank passes the same count, type and op, and gets the same result.
  virtual void all_reduce(void* data, Index count, ElementType type, ReduceOp op) = 0;

  // send [byte_counts[rank()]] -> recv [sum of byte_counts]: rank r's bytes land at offset
  // byte_counts[0] + ... + byte_counts[r - 1]. Every rank passes the same byte_counts [size()].
  // recv must not overlap send.
  virtual void all_gather_bytes(const void* send, void* recv, const Index* byte_counts) = 0;

  // ---- typed helpers on top of the two collectives ----

  template <typename T>
  void all_reduce_sum(T* data, Index count) {
    all_reduce(data, count, element_type_of<T>(), ReduceOp::sum);
  }
  template <typename T>
  void all_reduce_max(T* data, Index count) {
    all_reduce(data, count, element_type_of<T>(), ReduceOp::max);
  }

  // send [counts[rank()]] -> recv [sum of counts], counts in elements of T (any trivially copyable T).
  template <typename T>
  void all_gather_v(const T* send, T* recv, const std::vector<Index>& counts) {
    static_assert(std::is_trivially_copyable_v<T>, "all_gather_v copies bytes");
    check_counts("Communicator::all_gather_v", counts);
    std::vector<Index> bytes(counts.size());
    for (std::size_t r = 0; r < counts.size(); ++r) bytes[r] = counts[r] * static_cast<Index>(sizeof(T));
    all_gather_bytes(send, recv, bytes.data());
  }

  // value -> [size()] every rank's value, in rank order.
  std::vector<std::int64_t> all_gather(std::int64_t value) {
    std::vector<std::int64_t> out(static_cast<std::size_t>(size()));
    std::vector<Index> bytes(static_cast<std::size_t>(size()), static_cast<Index>(sizeof(std::int64_t)));
    all_gather_bytes(&value, out.data(), bytes.data());
    return out;
  }

 private:
  void check_counts(const char* where, const std::vector<Index>& counts) const {
    if (static_cast<Index>(counts.size()) != size()) {
      std::ostringstream message;
      message << where << ": counts has " << counts.size() << " entries, expected size() = " << size();
      throw shape_error(message.str());
    }
  }
};

// The one-process group: rank 0 of 1. all_reduce leaves data as it is; all_gather_bytes copies.
class SingleProcessCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void all_reduce(void*, Index, ElementType, ReduceOp) override {}
  void all_gather_bytes(const void* send, void* recv, const Index* byte_counts) override {
    if (byte_counts[0] > 0) std::memcpy(recv, send, static_cast<std::size_t>(byte_counts[0]));
  }
};

// ---- vocabulary shards ----

// Rows [begin, end) of a [V, d] table, the part one rank owns.
struct VocabShard {
  Index begin = 0;
  Index end = 0;
  Index rows() const { return end - begin; }
  bool owns(Index v) const { return v >= begin && v < end; }
};

// V rows over `size` ranks, balanced: rank r owns V / size rows, plus one for the first V % size
// ranks. \throws value_error if size < 1, rank outside [0, size) or V < size (every rank must own
// at least one row).
inline VocabShard vocab_shard(Index V, int rank, int size) {
  if (size < 1 || rank < 0 || rank >= size || V < size) {
    std::ostringstream message;
    message << "vocab_shard: V = " << V << ", rank " << rank << ", size " << size
            << ": needs size >= 1, rank in [0, size) and V >= size (each rank owns at least one row)";
    throw value_error(message.str());
  }
  const Index base = V / size, extra = V % size, r = rank;
  VocabShard shard;
  shard.begin = r * base + std::min<Index>(r, extra);
  shard.end = shard.begin + base + (r < extra ? 1 : 0);
  return shard;
}

// The shard that holds row v. \pre 0 <= v < V, V >= size >= 1.
inline int vocab_owner(Index V, Index v, int size) {
  const Index base = V / size, extra = V % size;
  const Index split = extra * (base + 1);  // rows below this belong to the ranks with one extra row
  return static_cast<int>(v < split ? v / (base + 1) : extra + (v - split) / base);
}

// ---- errors that every rank agrees on ----

namespace detail {

// FNV-1a over bytes, for the fingerprints that check_on_every_rank compares.
inline std::uint64_t fingerprint_bytes(const void* data, std::size_t bytes,
                                       std::uint64_t hash = 0xcbf29ce484222325ULL) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < bytes; ++i) hash = (hash ^ p[i]) * 0x100000001b3ULL;
  return hash;
}

// Ids [B, T] (any integer type) -> a fingerprint of their shape and values, read row-major.
template <typename Ids>
std::uint64_t fingerprint_ids(const Ids& ids, std::uint64_t hash = 0xcbf29ce484222325ULL) {
  const std::int64_t shape[2] = {static_cast<std::int64_t>(ids.rows()), static_cast<std::int64_t>(ids.cols())};
  hash = fingerprint_bytes(shape, sizeof(shape), hash);
  for (Index b = 0; b < ids.rows(); ++b)
    for (Index t = 0; t < ids.cols(); ++t) {
      const std::int64_t id = static_cast<std::int64_t>(ids(b, t));
      hash = fingerprint_bytes(&id, sizeof(id), hash);
    }
  return hash;
}

// A matrix of Scalar [rows, cols] (row-major or any row stride) -> a fingerprint of its shape and
// values (their bytes), read row by row.
template <typename Scalar>
std::uint64_t fingerprint_matrix(const ConstMatrixRef<Scalar>& m, std::uint64_t hash = 0xcbf29ce484222325ULL) {
  const std::int64_t shape[2] = {static_cast<std::int64_t>(m.rows()), static_cast<std::int64_t>(m.cols())};
  hash = fingerprint_bytes(shape, sizeof(shape), hash);
  for (Index n = 0; n < m.rows(); ++n)
    hash = fingerprint_bytes(m.row(n).data(), static_cast<std::size_t>(m.cols()) * sizeof(Scalar), hash);
  return hash;
}

// The unit in which a gather of byte_counts [size] is counted, for a library whose counts and
// displacements are int (MPI before 4.0): the greatest common divisor of the counts (a whole row
// of d floats when every rank sends whole rows), divided by its smallest prime factors until it
// is at most `limit`, since any divisor of the gcd divides every count. 1 when the counts are all
// zero or the gcd has no factor below 2^20 to take out. The caller still checks that the counts
// and displacements in units fit.
inline Index gather_unit(const Index* byte_counts, int size, Index limit = 2147483647) {
  Index unit = 0;
  for (int r = 0; r < size; ++r) unit = std::gcd(unit, byte_counts[r]);
  while (unit > limit) {
    Index factor = 2;
    while (factor < (Index(1) << 20) && unit % factor != 0) ++factor;
    if (unit % factor != 0) return 1;
    unit /= factor;
  }
  return unit == 0 ? 1 : unit;
}

enum class ErrorKind : std::int64_t { none = 0, index = 1, shape = 2, value = 3, other = 4 };

[[noreturn]] inline void throw_error(ErrorKind kind, const std::string& message) {
  switch (kind) {
    case ErrorKind::index: throw index_error(message);
    case ErrorKind::shape: throw shape_error(message);
    case ErrorKind::value: throw value_error(message);
    default: throw std::runtime_error(message);
  }
}

}  // namespace detail

// Runs `local_checks` on this rank, then agrees with every other rank on the outcome (one
// all-gather of 24 bytes per rank, and one more of the messages when something failed):
//  - if the checks threw on any rank, every rank throws the lowest failing rank's exception type
//    (index_error, shape_error, value_error; anything else becomes std::runtime_error) with its
//    message followed by " [on rank r of R]";
//  - otherwise, if the ranks' fingerprints differ, every rank throws value_error naming `what`
//    (e.g. "the token ids") and the first two ranks that disagree;
//  - otherwise it returns.
// Every rank must call it at the same point. With one rank it runs the checks and rethrows as is.
inline void check_on_every_rank(Communicator& comm, const char* where, const std::function<void()>& local_checks,
                                std::uint64_t fingerprint = 0, const char* what = "the inputs") {
  detail::ErrorKind kind = detail::ErrorKind::none;
  std::string message;
  try {
    local_checks();
  } catch (const index_error& e) {
    kind = detail::ErrorKind::index, message = e.what();
  } catch (const shape_error& e) {
    kind = detail::ErrorKind::shape, message = e.what();
  } catch (const value_error& e) {
    kind = detail::ErrorKind::value, message = e.what();
  } catch (const std::exception& e) {
    kind = detail::ErrorKind::other, message = e.what();
  } catch (...) {  // not a std::exception: still every rank's failure, never one rank's alone
    kind = detail::ErrorKind::other, message = std::string(where) + ": a check threw a non-standard exception";
  }
  const int R = comm.size();
  if (R == 1) {
    if (kind != detail::ErrorKind::none) detail::throw_error(kind, message);
    return;
  }
  // [kind, message length, fingerprint] of every rank.
  const std::int64_t header[3] = {static_cast<std::int64_t>(kind), static_cast<std::int64_t>(message.size()),
                                  static_cast<std::int64_t>(fingerprint)};
  std::vector<std::int64_t> headers(static_cast<std::size_t>(3 * R));
  std::vector<Index> header_bytes(static_cast<std::size_t>(R), static_cast<Index>(sizeof(header)));
  comm.all_gather_bytes(header, headers.data(), header_bytes.data());
  int failed = -1;
  for (int r = 0; r < R && failed < 0; ++r)
    if (headers[static_cast<std::size_t>(3 * r)] != 0) failed = r;
  if (failed >= 0) {
    std::vector<Index> lengths(static_cast<std::size_t>(R));
    Index total = 0, offset = 0;
    for (int r = 0; r < R; ++r) {
      lengths[static_cast<std::size_t>(r)] = headers[static_cast<std::size_t>(3 * r + 1)];
      if (r < failed) offset += lengths[static_cast<std::size_t>(r)];
      total += lengths[static_cast<std::size_t>(r)];
    }
    std::string all(static_cast<std::size_t>(total), '\0');
    comm.all_gather_bytes(message.data(), all.data(), lengths.data());
    std::ostringstream text;
    text << all.substr(static_cast<std::size_t>(offset),
                       static_cast<std::size_t>(lengths[static_cast<std::size_t>(failed)]))
         << " [on rank " << failed << " of " << R << "]";
    detail::throw_error(static_cast<detail::ErrorKind>(headers[static_cast<std::size_t>(3 * failed)]), text.str());
  }
  for (int r = 1; r < R; ++r)
    if (headers[static_cast<std::size_t>(3 * r + 2)] != headers[2]) {
      std::ostringstream text;
      text << where << ": ranks 0 and " << r << " of " << R << " disagree on " << what
           << "; every rank must pass the same values";
      throw value_error(text.str());
    }
}

}  // namespace embedhead

#endif  // EMBEDHEAD_PARALLEL_COMMUNICATOR_HPP
