// The Catch2 main of the MPI builds of the parallel tests: MPI_Init before the tests, MPI_Finalize
// after. Each rank runs the whole session; mpirun fails if any rank returns non-zero. Catch2's
// implementation is in tests/catch_impl.cpp.
#include "../catch_run.hpp"

#include <embedhead/parallel/mpi_communicator.hpp>

int main(int argc, char* argv[]) {
  embedhead::MpiEnvironment mpi(argc, argv);
  const int failures = embedhead_catch_run(argc, argv);
  // Keep every rank until all have finished, so one rank's early exit cannot abort the others.
  MPI_Barrier(MPI_COMM_WORLD);
  return failures == 0 ? 0 : 1;
}
