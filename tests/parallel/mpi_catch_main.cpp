// The Catch2 main of the MPI builds of the parallel tests: MPI_Init before the tests, MPI_Finalize
// after. Each rank runs the whole session; mpirun fails if any rank returns non-zero.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <embedhead/mpi_communicator.hpp>

int main(int argc, char* argv[]) {
  embedhead::MpiEnvironment mpi(argc, argv);
  const int failures = Catch::Session().run(argc, argv);
  // Keep every rank until all have finished, so one rank's early exit cannot abort the others.
  MPI_Barrier(MPI_COMM_WORLD);
  return failures == 0 ? 0 : 1;
}
