// Consumer of the installed embedhead::mpi target: a two-process all-reduce through MpiCommunicator
// (ctest runs it under mpirun -np 2).
#include <embedhead/parallel/mpi_communicator.hpp>

#include <cstdio>

int main(int argc, char** argv) {
  embedhead::MpiEnvironment mpi(argc, argv);
  embedhead::MpiCommunicator world;
  double value = world.rank() + 1.0;
  world.all_reduce_sum(&value, 1);
  const double expected = world.size() * (world.size() + 1) / 2.0;
  if (world.rank() == 0)
    std::printf("mpi all-reduce over %d ranks: %s\n", world.size(), value == expected ? "ok" : "MISMATCH");
  return value == expected ? 0 : 1;
}
