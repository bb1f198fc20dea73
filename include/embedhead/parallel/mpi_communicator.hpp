// embedhead: the Communicator over MPI (target embedhead::mpi; Debian: libopenmpi-dev).
//
//   MpiEnvironment mpi(argc, argv);          // MPI_Init ... MPI_Finalize, once per program
//   MpiCommunicator world;                   // MPI_COMM_WORLD (or any communicator you pass)
//   VocabParallelEmbedding<float> embedding(V, d, world);
//
// all_reduce is MPI_Allreduce in place; all_gather_bytes is MPI_Allgatherv. MPI counts are int,
// so large calls are split: an all-reduce into pieces of at most 2^30 elements, and an all-gather
// counts in units of a common divisor of the byte counts (detail::gather_unit: their gcd, reduced
// below 2^31 if need be), so rank blocks of several GiB still fit int counts. A gather whose
// counts cannot be expressed so (more than 2^31 units) throws value_error on every rank alike.
// Only this header includes <mpi.h>.
#ifndef EMBEDHEAD_PARALLEL_MPI_COMMUNICATOR_HPP
#define EMBEDHEAD_PARALLEL_MPI_COMMUNICATOR_HPP

#include "../errors.hpp"
#include "communicator.hpp"

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace embedhead {

namespace detail {

inline void check_mpi(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  std::ostringstream message;
  message << "MpiCommunicator: " << call << " failed: " << std::string(text, static_cast<std::size_t>(length));
  throw std::runtime_error(message.str());
}

}  // namespace detail

// MPI_Init in the constructor (unless MPI is already initialised), MPI_Finalize in the destructor
// (only if this object initialised it). Make one at the top of main, before any MpiCommunicator.
class MpiEnvironment {
 public:
  MpiEnvironment(int& argc, char**& argv) {
    int initialised = 0;
    MPI_Initialized(&initialised);
    if (!initialised) {
      detail::check_mpi(MPI_Init(&argc, &argv), "MPI_Init");
      owns_ = true;
    }
  }
  MpiEnvironment(const MpiEnvironment&) = delete;
  MpiEnvironment& operator=(const MpiEnvironment&) = delete;
  ~MpiEnvironment() {
    int finalised = 0;
    MPI_Finalized(&finalised);
    if (owns_ && !finalised) MPI_Finalize();
  }

 private:
  bool owns_ = false;
};

class MpiCommunicator final : public Communicator {
 public:
  // Wraps `comm` (not duplicated, not freed). \throws value_error if MPI is not initialised.
  explicit MpiCommunicator(MPI_Comm comm = MPI_COMM_WORLD) : comm_(comm) {
    int initialised = 0;
    MPI_Initialized(&initialised);
    if (!initialised) throw value_error("MpiCommunicator: MPI is not initialised (make an MpiEnvironment first)");
    detail::check_mpi(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    detail::check_mpi(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  MPI_Comm native() const { return comm_; }

  void all_reduce(void* data, Index count, ElementType type, ReduceOp op) override {
    if (count <= 0 || size_ == 1) return;
    const MPI_Datatype datatype = type == ElementType::float32   ? MPI_FLOAT
                                  : type == ElementType::float64 ? MPI_DOUBLE
                                                                 : MPI_INT64_T;
    const std::size_t element = type == ElementType::float32 ? 4 : 8;
    const MPI_Op mpi_op = op == ReduceOp::sum ? MPI_SUM : MPI_MAX;
    constexpr Index kPiece = Index(1) << 30;
    auto* bytes = static_cast<char*>(data);
    for (Index first = 0; first < count; first += kPiece) {
      const int n = static_cast<int>(std::min(kPiece, count - first));
      detail::check_mpi(MPI_Allreduce(MPI_IN_PLACE, bytes + static_cast<std::size_t>(first) * element, n, datatype,
                                      mpi_op, comm_),
                        "MPI_Allreduce");
    }
  }

  void all_gather_bytes(const void* send, void* recv, const Index* byte_counts) override {
    // The unit: a divisor of the byte counts (detail::gather_unit), so that counts and
    // displacements in units fit an int.
    Index total = 0;
    for (int r = 0; r < size_; ++r) {
      if (byte_counts[r] < 0) throw value_error("MpiCommunicator::all_gather_bytes: a negative byte count");
      total += byte_counts[r];
    }
    if (total == 0) return;
    const Index unit = detail::gather_unit(byte_counts, size_);
    std::vector<int> counts(static_cast<std::size_t>(size_)), displacements(static_cast<std::size_t>(size_));
    Index offset = 0;
    for (int r = 0; r < size_; ++r) {
      if (offset / unit > INT_MAX || byte_counts[r] / unit > INT_MAX) {
        std::ostringstream message;
        message << "MpiCommunicator::all_gather_bytes: " << total << " bytes in units of " << unit
                << " exceed MPI's int counts; gather in smaller calls";
        throw value_error(message.str());
      }
      counts[static_cast<std::size_t>(r)] = static_cast<int>(byte_counts[r] / unit);
      displacements[static_cast<std::size_t>(r)] = static_cast<int>(offset / unit);
      offset += byte_counts[r];
    }
    MPI_Datatype datatype = MPI_BYTE;
    const bool custom = unit > 1;
    if (custom) {
      detail::check_mpi(MPI_Type_contiguous(static_cast<int>(unit), MPI_BYTE, &datatype), "MPI_Type_contiguous");
      detail::check_mpi(MPI_Type_commit(&datatype), "MPI_Type_commit");
    }
    const int code = MPI_Allgatherv(send, counts[static_cast<std::size_t>(rank_)], datatype, recv, counts.data(),
                                    displacements.data(), datatype, comm_);
    if (custom) MPI_Type_free(&datatype);
    detail::check_mpi(code, "MPI_Allgatherv");
  }

 private:
  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace embedhead

#endif  // EMBEDHEAD_PARALLEL_MPI_COMMUNICATOR_HPP
