#!/usr/bin/env bash
# Full embedhead check: Release build with -Werror + all tests (the python
# interop tests and the parallel tests under mpirun must be among them), a clang libFuzzer build that replays the
# corpus and fuzzes the safetensors reader for a bounded time, then an
# ASan+UBSan build of the tests.
#
# Environment:
#   EMBEDHEAD_SKIP_ASAN=1       skip the sanitizer phase (fast local iteration)
#   EMBEDHEAD_SKIP_FUZZ=1       skip the fuzz phase
#   EMBEDHEAD_FUZZ_SECONDS=<s>  how long to fuzz (default 60)
#   JOBS=<n>                    parallelism for build and ctest (default 2)
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
  -DEMBEDHEAD_REQUIRE_MPI=ON \
  -DEMBEDHEAD_SANITIZE=OFF \
  -DEMBEDHEAD_BUILD_TESTS=ON \
  -DEMBEDHEAD_REQUIRE_PYTHON_TESTS=ON \
  -DEMBEDHEAD_BUILD_TOOLS=ON \
  -DEMBEDHEAD_REQUIRE_BROWSER_TESTS=ON \
  -DEMBEDHEAD_CHECK_HEADERS=ON \
  -DEMBEDHEAD_BUILD_BENCHMARKS=ON \
  -DEMBEDHEAD_BUILD_EXAMPLES=ON

phase "Release: build"
cmake --build build/release -j "$jobs"

phase "Release: ctest"
ctest --test-dir build/release --output-on-failure -j "$jobs"
# The python interop tests (label python) must have been registered and run, never skipped.
python_tests="$(ctest --test-dir build/release -N -L python | sed -n 's/^Total Tests: //p')"
if [ "${python_tests:-0}" -lt 3 ]; then
  echo "test.sh: error: expected 3 python interop tests in build/release, found ${python_tests:-0}" >&2
  exit 1
fi
# So must the headless-Chromium check of embedhead-inspect's report (label browser).
browser_tests="$(ctest --test-dir build/release -N -L browser | sed -n 's/^Total Tests: //p')"
if [ "${browser_tests:-0}" -lt 1 ]; then
  echo "test.sh: error: expected the browser test (inspect_report_browser) in build/release, found ${browser_tests:-0}" >&2
  exit 1
fi

# So must the parallel tests under mpirun (label mpi): 4 test programs x 1, 2 and 3 ranks, the
# installed-package consumer under mpirun -np 2, and examples/parallel_lm alone, on 2 and on 3 ranks.
mpi_tests="$(ctest --test-dir build/release -N -L mpi | sed -n 's/^Total Tests: //p')"
if [ "${mpi_tests:-0}" -lt 16 ]; then
  echo "test.sh: error: expected 16 MPI tests (label mpi) in build/release, found ${mpi_tests:-0}" >&2
  exit 1
fi

if [ "${EMBEDHEAD_SKIP_FUZZ:-0}" = "1" ]; then
  phase "Fuzz: skipped (EMBEDHEAD_SKIP_FUZZ=1)"
else
  # libFuzzer needs clang; a separate build directory (see fuzz/README.md).
  phase "Fuzz: configure (build/fuzz, clang, -fsanitize=fuzzer,address,undefined)"
  CC=clang CXX=clang++ cmake -S . -B build/fuzz \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g" \
    -DEMBEDHEAD_BUILD_FUZZERS=ON \
    -DEMBEDHEAD_WERROR=ON \
    -DEMBEDHEAD_BUILD_TESTS=OFF \
    -DEMBEDHEAD_BUILD_BENCHMARKS=OFF \
    -DEMBEDHEAD_BUILD_EXAMPLES=OFF \
    -DEMBEDHEAD_INSTALL=OFF

  phase "Fuzz: build"
  cmake --build build/fuzz -j "$jobs" --target safetensors_fuzz

  phase "Fuzz: replay the corpus (ctest -L fuzz)"
  ctest --test-dir build/fuzz --output-on-failure -L fuzz

  # Fuzz a scratch copy of the corpus, so fuzz/corpus is never modified.
  fuzz_seconds="${EMBEDHEAD_FUZZ_SECONDS:-60}"
  phase "Fuzz: safetensors_fuzz for ${fuzz_seconds} s"
  fuzz_work="build/fuzz/run"
  rm -rf "$fuzz_work"
  mkdir -p "$fuzz_work/corpus" "$fuzz_work/artifacts"
  cp fuzz/corpus/safetensors/* "$fuzz_work/corpus/"
  if ! build/fuzz/fuzz/safetensors_fuzz "$fuzz_work/corpus" \
       -dict=fuzz/safetensors.dict -max_len=4096 -max_total_time="$fuzz_seconds" \
       -artifact_prefix="$fuzz_work/artifacts/" -print_final_stats=1 > "$fuzz_work/fuzz.log" 2>&1; then
    tail -n 60 "$fuzz_work/fuzz.log"
    echo "test.sh: error: safetensors_fuzz found a failing input: $(ls "$fuzz_work/artifacts")" >&2
    echo "test.sh: reproduce with build/fuzz/fuzz/safetensors_fuzz $fuzz_work/artifacts/<file>; see fuzz/README.md" >&2
    exit 1
  fi
  grep -E '^(#[0-9]+[[:space:]]+INITED|Done [0-9]+ runs|stat::)' "$fuzz_work/fuzz.log"
fi

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
    -DEMBEDHEAD_REQUIRE_MPI=ON \
    -DEMBEDHEAD_WERROR=OFF \
    -DEMBEDHEAD_BUILD_TESTS=ON \
    -DEMBEDHEAD_REQUIRE_PYTHON_TESTS=ON \
    -DEMBEDHEAD_CHECK_HEADERS=OFF \
    -DEMBEDHEAD_BUILD_BENCHMARKS=OFF \
    -DEMBEDHEAD_BUILD_EXAMPLES=OFF

  phase "ASan+UBSan: build"
  cmake --build build/asan -j "$jobs"

  phase "ASan+UBSan: ctest (excluding label 'cmake')"
  ctest --test-dir build/asan --output-on-failure -j "$jobs" -LE cmake
fi

phase "All checks passed"
