// The Catch2 (v2) main, compiled once into the `embedhead_catch_main` object
// library and linked into every test executable.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
