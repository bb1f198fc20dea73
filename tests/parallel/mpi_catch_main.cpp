// The Catch2 main of the MPI builds of the parallel tests: MPI_Init before the tests, MPI_Finalize
// after. Each rank runs the whole session; mpirun fails if any rank returns non-zero. Started with
// --single-process (anywhere among the arguments), the program never initialises MPI and the tests
// run on a SingleProcessCommunicator (tests/parallel/world.hpp). Catch2's implementation is in
// tests/catch_impl.cpp.
#include "../catch_run.hpp"

#include <embedhead/parallel/mpi_communicator.hpp>

#include <cstring>

namespace {
bool single_process = false;
}  // namespace

namespace test_support {
bool single_process_run() { return single_process; }
}  // namespace test_support

int main(int argc, char* argv[]) {
  // --single-process is this main's option, not Catch2's: take it out of the arguments.
  int kept = 0;
  for (int i = 0; i < argc; ++i) {
    if (i > 0 && std::strcmp(argv[i], "--single-process") == 0) {
      single_process = true;
    } else {
      argv[kept++] = argv[i];
    }
  }
  argc = kept;
  if (single_process) return embedhead_catch_run(argc, argv);
  embedhead::MpiEnvironment mpi(argc, argv);
  const int failures = embedhead_catch_run(argc, argv);
  // Keep every rank until all have finished, so one rank's early exit cannot abort the others.
  MPI_Barrier(MPI_COMM_WORLD);
  return failures == 0 ? 0 : 1;
}
