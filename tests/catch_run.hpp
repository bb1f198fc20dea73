// Runs the Catch2 session on the command line (the body of CATCH_CONFIG_MAIN's main); defined in
// catch_impl.cpp.
#pragma once

int embedhead_catch_run(int argc, char* argv[]);
