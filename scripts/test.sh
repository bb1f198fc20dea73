#!/usr/bin/env bash
# Full embedhead check: Release build with -Werror + all tests, then an
# ASan+UBSan build of the tests.
#
# Environment:
#   EMBEDHEAD_SKIP_ASAN=1   skip the sanitizer phase (fast local iteration)
#   JOBS=<n>                parallelism for build and ctest (default 2)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"

jobs="${JOBS:-2}"

phase() {
  printf '\n==================================================================\n'
  printf '== %s\n' "$*"
  printf '==================================================================\n'
}

phase "Dependencies"
bash scripts/install_deps.sh

phase "Release: configure (build/release, -DEMBEDHEAD_WERROR=ON)"
cmake -S . -B build/release \
  -DCMAKE_BUILD_TYPE=Release \
  -DEMBEDHEAD_WERROR=ON \
  -DEMBEDHEAD_REQUIRE_SAFETENSORS=ON \
  -DEMBEDHEAD_SANITIZE=OFF \
  -DEMBEDHEAD_BUILD_TESTS=ON \
  -DEMBEDHEAD_CHECK_HEADERS=ON \
  -DEMBEDHEAD_BUILD_BENCHMARKS=ON \
  -DEMBEDHEAD_BUILD_EXAMPLES=ON

phase "Release: build"
cmake --build build/release -j "$jobs"

phase "Release: ctest"
ctest --test-dir build/release --output-on-failure -j "$jobs"

if [ "${EMBEDHEAD_SKIP_ASAN:-0}" = "1" ]; then
  phase "ASan+UBSan: skipped (EMBEDHEAD_SKIP_ASAN=1)"
else
  # Abort on the first sanitizer report and print useful stacks.
  export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:strict_init_order=1:check_initialization_order=1:detect_stack_use_after_return=1}"
  export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

  # RelWithDebInfo, but -O1 (faster to build, better sanitizer stacks) and
  # without -DNDEBUG so assert()/Eigen's bounds checks stay active.
  # -Werror is left to the Release phase: sanitizer instrumentation makes GCC
  # emit false-positive warnings.
  phase "ASan+UBSan: configure (build/asan, RelWithDebInfo -O1)"
  cmake -S . -B build/asan \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g" \
    -DEMBEDHEAD_SANITIZE=ON \
    -DEMBEDHEAD_REQUIRE_SAFETENSORS=ON \
    -DEMBEDHEAD_WERROR=OFF \
    -DEMBEDHEAD_BUILD_TESTS=ON \
    -DEMBEDHEAD_CHECK_HEADERS=OFF \
    -DEMBEDHEAD_BUILD_BENCHMARKS=OFF \
    -DEMBEDHEAD_BUILD_EXAMPLES=OFF

  phase "ASan+UBSan: build"
  cmake --build build/asan -j "$jobs"

  phase "ASan+UBSan: ctest (excluding label 'cmake')"
  ctest --test-dir build/asan --output-on-failure -j "$jobs" -LE cmake
fi

phase "All checks passed"
