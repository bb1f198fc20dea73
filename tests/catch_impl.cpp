// Catch2's (v2) implementation, compiled once into the `embedhead_catch_impl` library and shared
// by the two mains: catch_main.cpp (every test executable) and parallel/mpi_catch_main.cpp.
// Catch2 declares its Session only beside its implementation, so the mains call this function.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "catch_run.hpp"

int embedhead_catch_run(int argc, char* argv[]) { return Catch::Session().run(argc, argv); }
