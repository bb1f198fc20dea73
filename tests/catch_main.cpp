// The Catch2 (v2) main of every test executable, compiled once into the `embedhead_catch_main`
// library; Catch2's implementation is in catch_impl.cpp.
#include "catch_run.hpp"

int main(int argc, char* argv[]) { return embedhead_catch_run(argc, argv); }
