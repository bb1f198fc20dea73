// The communicator the parallel tests run on (see tests/CMakeLists.txt, embedhead_add_parallel_tests):
//   parallel_tests_mpi (ungrouped: <name>_mpi)
//                   EMBEDHEAD_TEST_MPI defined, when MPI is found: MPI_COMM_WORLD, run by ctest
//                   under `mpirun -np 1`, `-np 2` and `-np 3` (3 gives uneven vocabulary shards);
//                   the same program started with --single-process (ctest test <name>, also run
//                   under ASan+UBSan) never initialises MPI and runs on a SingleProcessCommunicator
//                   (rank 0 of 1), so each source is compiled once per build;
//   parallel_tests (ungrouped: <name>)
//                   EMBEDHEAD_TEST_MPI undefined, when MPI is not found: a SingleProcessCommunicator.
// Every rank runs every test case and calls the same collectives in the same order, so tests use
// CHECK (which never leaves a test case early) wherever a collective follows.
#ifndef EMBEDHEAD_TESTS_PARALLEL_WORLD_HPP
#define EMBEDHEAD_TESTS_PARALLEL_WORLD_HPP

#include <embedhead/parallel/communicator.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#ifdef EMBEDHEAD_TEST_MPI
#include <embedhead/parallel/mpi_communicator.hpp>
#endif

namespace test_support {

#ifdef EMBEDHEAD_TEST_MPI
// True when the program was started with --single-process (defined in mpi_catch_main.cpp).
bool single_process_run();
#endif

inline embedhead::Communicator& world() {
#ifdef EMBEDHEAD_TEST_MPI
  if (!single_process_run()) {
    static embedhead::MpiCommunicator communicator;  // MPI is initialised by mpi_catch_main.cpp
    return communicator;
  }
#endif
  static embedhead::SingleProcessCommunicator communicator;
  return communicator;
}

// -> every rank's string, in rank order (one all-gather of the lengths, one of the bytes): to check
// that an error message is the same on every rank. Collective.
inline std::vector<std::string> gather_strings(embedhead::Communicator& comm, const std::string& mine) {
  const std::vector<std::int64_t> lengths = comm.all_gather(static_cast<std::int64_t>(mine.size()));
  std::vector<embedhead::Index> counts(lengths.begin(), lengths.end());
  embedhead::Index total = 0;
  for (const embedhead::Index c : counts) total += c;
  std::string all(static_cast<std::size_t>(total), '\0');
  comm.all_gather_v(mine.data(), all.data(), counts);
  std::vector<std::string> out;
  std::size_t at = 0;
  for (const embedhead::Index c : counts) {
    out.push_back(all.substr(at, static_cast<std::size_t>(c)));
    at += static_cast<std::size_t>(c);
  }
  return out;
}

// Runs call(), which must throw E on every rank with the same message; returns it ("" if it did
// not throw E). The messages are all-gathered and compared. Collective.
template <typename E, typename Call>
std::string agreed_error(const Call& call) {
  embedhead::Communicator& comm = world();
  std::string message;
  bool thrown = false;
  try {
    call();
  } catch (const E& e) {
    thrown = true;
    message = e.what();
  } catch (const std::exception& e) {
    message = std::string("unexpected exception type: ") + e.what();
  }
  CHECK(thrown);
  for (const std::string& other : gather_strings(comm, message)) CHECK(other == message);
  return thrown ? message : std::string();
}

// The suffix of an error thrown on the last rank: " [on rank R-1 of R]", or "" with one rank.
inline std::string on_last_rank() {
  const int R = world().size();
  return R > 1 ? " [on rank " + std::to_string(R - 1) + " of " + std::to_string(R) + "]" : std::string();
}

}  // namespace test_support

#endif  // EMBEDHEAD_TESTS_PARALLEL_WORLD_HPP
