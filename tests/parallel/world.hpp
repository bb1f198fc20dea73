// The communicator the parallel tests run on: compiled twice from the same sources (see
// tests/CMakeLists.txt, embedhead_add_parallel_test):
//   <name>          EMBEDHEAD_TEST_MPI undefined: a SingleProcessCommunicator (rank 0 of 1), a
//                   plain ctest test, also run under ASan+UBSan;
//   <name>_mpi      EMBEDHEAD_TEST_MPI defined: MPI_COMM_WORLD, run by ctest under
//                   `mpirun -np 1`, `-np 2` and `-np 3` (3 gives uneven vocabulary shards).
// Every rank runs every test case and calls the same collectives in the same order, so tests use
// CHECK (which never leaves a test case early) wherever a collective follows.
#ifndef EMBEDHEAD_TESTS_PARALLEL_WORLD_HPP
#define EMBEDHEAD_TESTS_PARALLEL_WORLD_HPP

#include <embedhead/communicator.hpp>

#ifdef EMBEDHEAD_TEST_MPI
#include <embedhead/mpi_communicator.hpp>
#endif

namespace test_support {

inline embedhead::Communicator& world() {
#ifdef EMBEDHEAD_TEST_MPI
  static embedhead::MpiCommunicator communicator;  // MPI is initialised by mpi_catch_main.cpp
#else
  static embedhead::SingleProcessCommunicator communicator;
#endif
  return communicator;
}

}  // namespace test_support

#endif  // EMBEDHEAD_TESTS_PARALLEL_WORLD_HPP
