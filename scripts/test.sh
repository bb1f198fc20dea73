#!/usr/bin/env bash
# Full embedhead check, in five parts:
#   1. gcc Release build with -Werror (tests, tools, examples, benchmarks, standalone headers) and
#      all its tests (the python interop tests, the browser test and the parallel tests under
#      mpirun must be among them);
#   2. a clang libFuzzer build that replays the corpora and fuzzes the safetensors, .npy and
#      config.json (RoPE) readers, each for a bounded time;
#   3. a clang ASan+UBSan build of the tests (the clang build of the test suite) and its ctest;
#   4. a gcc Release build of the tests with every matrix product through the CBLAS backend
#      (serial OpenBLAS: embedhead::cblas) and its ctest;
#   5. a gcc Release build of the tests on Eigen's GEMM kernel (EMBEDHEAD_GEMM_EIGEN) and its
#      ctest: the suite runs on the library's own packed kernel (parts 1 and 3, the default), on a
#      BLAS and on Eigen's kernel.
# The fuzzers are built in the clang ASan+UBSan tree, without -DNDEBUG: the tests at -O0 with line
# tables (-gline-tables-only: file:line stacks), the fuzzers at -O1 -g (fuzz/CMakeLists.txt).
#
# Environment:
#   EMBEDHEAD_SKIP_ASAN=1       skip the sanitizer phase (fast local iteration)
#   EMBEDHEAD_SKIP_FUZZ=1       skip the fuzz phase
#   EMBEDHEAD_SKIP_CBLAS=1      skip the CBLAS-backend phase
#   EMBEDHEAD_SKIP_EIGEN=1      skip the Eigen-GEMM-backend phase
#   EMBEDHEAD_FUZZ_SECONDS=<s>  how long each fuzzing worker of each fuzzer runs (default 30)
#   EMBEDHEAD_FUZZ_WORKERS=<n>  how many fuzzing workers run side by side (default JOBS)
#   EMBEDHEAD_CCACHE=0|1        compile through ccache (default: when installed and CI is unset)
#   JOBS=<n>                    parallelism for build and ctest (default 2)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
# shellcheck source=scripts/common.sh
source scripts/common.sh

jobs="${JOBS:-2}"
skip_asan="${EMBEDHEAD_SKIP_ASAN:-0}"
skip_fuzz="${EMBEDHEAD_SKIP_FUZZ:-0}"
skip_cblas="${EMBEDHEAD_SKIP_CBLAS:-0}"
skip_eigen="${EMBEDHEAD_SKIP_EIGEN:-0}"
start_time=$SECONDS

# The clang tree (build/asan): the sanitized tests unless skipped, the fuzzer unless skipped.
clang_tree=0
if [ "$skip_asan" != "1" ] || [ "$skip_fuzz" != "1" ]; then
  clang_tree=1
fi
asan_tests=ON
[ "$skip_asan" = "1" ] && asan_tests=OFF
fuzzers=ON
[ "$skip_fuzz" = "1" ] && fuzzers=OFF

# The background Release ctest, if any, ends with the script.
release_ctest_pid=""
stop_background() {
  local pid
  for pid in $release_ctest_pid; do
    kill "$pid" 2> /dev/null || true
  done
}
trap stop_background EXIT

# count_tests <build dir> <label>: how many tests ctest has registered with that label.
count_tests() {
  ctest --test-dir "$1" -N -L "$2" | sed -n 's/^Total Tests: //p'
}

phase "Dependencies"
bash scripts/install_deps.sh

# The gcc Release test trees' common settings (build/release and build/cblas).
gcc_test_tree=(
  -DCMAKE_BUILD_TYPE=Release
  -DEMBEDHEAD_WERROR=ON
  -DEMBEDHEAD_REQUIRE_SAFETENSORS=ON
  -DEMBEDHEAD_REQUIRE_MPI=ON
  -DEMBEDHEAD_SANITIZE=OFF
  -DEMBEDHEAD_BUILD_TESTS=ON
  -DEMBEDHEAD_REQUIRE_PYTHON_TESTS=ON
)

phase "Release: configure (build/release, gcc, -DEMBEDHEAD_WERROR=ON)"
configure build/release "${CXX_RELEASE:-g++}" \
  "${gcc_test_tree[@]}" \
  -DEMBEDHEAD_BUILD_TOOLS=ON \
  -DEMBEDHEAD_REQUIRE_BROWSER_TESTS=ON \
  -DEMBEDHEAD_CHECK_HEADERS=ON \
  -DEMBEDHEAD_BUILD_BENCHMARKS=ON \
  -DEMBEDHEAD_BUILD_EXAMPLES=ON \
  -DEMBEDHEAD_WITH_ONEDNN=ON
# oneDNN is optional for users and found quietly; here its tests must be there.
onednn_listed="$(ctest --test-dir build/release -N -R '^fused_head_loss_bf16_onednn_test$')"
if ! grep -q 'Total Tests: 1' <<< "$onednn_listed"; then
  echo "test.sh: error: build/release has no fused_head_loss_bf16_onednn_test (oneDNN or OpenMP not found?)" >&2
  exit 1
fi

if [ "$clang_tree" = "1" ]; then
  # RelWithDebInfo, but -O0 -gline-tables-only and without -DNDEBUG so assert()/Eigen's bounds
  # checks stay active. -O0 with line tables builds in about a third of the CPU time of -O1 -g
  # (clang 14, e.g. vocabulary_test: 39 against 135 CPU s) and its sanitizer stacks still name
  # every frame's file and line; the fuzzer adds -O1 -g itself (fuzz/CMakeLists.txt), so it
  # executes as many inputs as before. Tools (embedhead-inspect and its tests, the browser test
  # included) are built and sanitized too; benchmarks and examples only in the Release tree.
  phase "clang: configure (build/asan, ASan+UBSan tests: $asan_tests, fuzzer: $fuzzers, -DEMBEDHEAD_WERROR=ON)"
  configure build/asan "${CXX_CLANG:-clang++}" \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O0 -gline-tables-only" \
    -DEMBEDHEAD_SANITIZE=ON \
    -DEMBEDHEAD_REQUIRE_SAFETENSORS=ON \
    -DEMBEDHEAD_REQUIRE_MPI=ON \
    -DEMBEDHEAD_WERROR=ON \
    -DEMBEDHEAD_BUILD_TESTS="$asan_tests" \
    -DEMBEDHEAD_REQUIRE_PYTHON_TESTS="$asan_tests" \
    -DEMBEDHEAD_BUILD_TOOLS="$asan_tests" \
    -DEMBEDHEAD_CHECK_HEADERS=OFF \
    -DEMBEDHEAD_BUILD_BENCHMARKS=OFF \
    -DEMBEDHEAD_BUILD_EXAMPLES=OFF \
    -DEMBEDHEAD_BUILD_FUZZERS="$fuzzers"
fi

phase "Release: build"
cmake --build build/release -j "$jobs"

if [ "$skip_asan" != "1" ]; then
  # The Release ctest leaves cores idle much of the time (the CMake consumers configure and build
  # one after the other, the browser waits for Chromium, the MPI ranks yield), so it runs in the
  # background, beside the clang build (which builds the fuzzer too); its log is printed after.
  release_ctest_log="build/release/ctest.log"
  phase "Release: ctest, in the background (log: $release_ctest_log), beside the clang ASan+UBSan build"
  ctest --test-dir build/release --output-on-failure -j "$jobs" > "$release_ctest_log" 2>&1 &
  release_ctest_pid=$!

  phase "clang ASan+UBSan: build (build/asan)"
  cmake --build build/asan -j "$jobs"

  phase "Release: ctest result"
  release_ctest_status=0
  wait "$release_ctest_pid" || release_ctest_status=$?
  release_ctest_pid=""
  cat "$release_ctest_log"
  if [ "$release_ctest_status" -ne 0 ]; then
    echo "test.sh: error: the Release ctest failed (status $release_ctest_status)" >&2
    exit 1
  fi
else
  phase "Release: ctest"
  ctest --test-dir build/release --output-on-failure -j "$jobs"
fi
# The python interop tests (label python) must have been registered and run, never skipped.
python_tests="$(count_tests build/release python)"
if [ "${python_tests:-0}" -lt 3 ]; then
  echo "test.sh: error: expected 3 python interop tests in build/release, found ${python_tests:-0}" >&2
  exit 1
fi
# So must the headless-Chromium check of embedhead-inspect's report (label browser).
browser_tests="$(count_tests build/release browser)"
if [ "${browser_tests:-0}" -lt 1 ]; then
  echo "test.sh: error: expected the browser test (inspect_report_browser) in build/release, found ${browser_tests:-0}" >&2
  exit 1
fi

# So must the parallel tests under mpirun (label mpi): 5 test programs x 1, 2 and 3 ranks, the
# installed-package consumer under mpirun -np 2, and examples/parallel_lm alone, on 2 and on 3 ranks.
mpi_tests="$(count_tests build/release mpi)"
if [ "${mpi_tests:-0}" -lt 19 ]; then
  echo "test.sh: error: expected 19 MPI tests (label mpi) in build/release, found ${mpi_tests:-0}" >&2
  exit 1
fi

fuzz_work="build/asan/fuzz/run"
# The fuzzers, each with its corpus (fuzz/corpus/<corpus>) and dictionary (fuzz/<corpus>.dict).
fuzzers_and_corpora=(safetensors_fuzz:safetensors npy_fuzz:npy rope_config_fuzz:rope_config)
if [ "$skip_fuzz" = "1" ]; then
  phase "Fuzz: skipped (EMBEDHEAD_SKIP_FUZZ=1)"
else
  phase "Fuzz: build ${fuzzers_and_corpora[*]%%:*} (build/asan, clang, -fsanitize=fuzzer,address,undefined)"
  cmake --build build/asan -j "$jobs" --target safetensors_fuzz npy_fuzz rope_config_fuzz

  # Each fuzzer fuzzes a scratch copy of its corpus, so fuzz/corpus is never modified, with one
  # libFuzzer worker per core (-jobs/-workers: each worker a process of its own, its log in
  # <fuzzer>/fuzz-<n>.log, all of them adding to the one corpus), alone, one fuzzer after the
  # other: beside the Release ctest one worker made about a fifth of its executions (269,079
  # against 1.24 million in 60 s). Two workers for 30 s ran 667,887 inputs of the safetensors
  # fuzzer, one worker for 60 s 474,000 to 507,000 (the runs of the previous CI).
  fuzz_seconds="${EMBEDHEAD_FUZZ_SECONDS:-30}"
  fuzz_workers="${EMBEDHEAD_FUZZ_WORKERS:-$jobs}"
  if ! [[ "$fuzz_workers" =~ ^[1-9][0-9]*$ ]]; then
    echo "test.sh: error: EMBEDHEAD_FUZZ_WORKERS must be a whole number >= 1, got '$fuzz_workers'" >&2
    exit 1
  fi
  rm -rf "$fuzz_work"
  for fuzzer_and_corpus in "${fuzzers_and_corpora[@]}"; do
    fuzzer="${fuzzer_and_corpus%%:*}"
    corpus="${fuzzer_and_corpus#*:}"
    run="$fuzz_work/$fuzzer"
    phase "Fuzz: $fuzzer, $fuzz_workers workers for ${fuzz_seconds} s (logs: $run/fuzz-*.log)"
    mkdir -p "$run/corpus" "$run/artifacts"
    cp "fuzz/corpus/$corpus"/* "$run/corpus/"
    fuzz_status=0
    (cd "$run" && exec "$repo_root/build/asan/fuzz/$fuzzer" corpus \
      -dict="$repo_root/fuzz/$corpus.dict" -max_len=4096 -max_total_time="$fuzz_seconds" \
      -jobs="$fuzz_workers" -workers="$fuzz_workers" \
      -artifact_prefix=artifacts/ -print_final_stats=1 > fuzz.log 2>&1) || fuzz_status=$?
    if [ "$fuzz_status" -ne 0 ]; then
      tail -n 60 "$run"/fuzz-*.log
      echo "test.sh: error: $fuzzer failed (status $fuzz_status); failing inputs: $(ls "$run/artifacts")" >&2
      echo "test.sh: reproduce with build/asan/fuzz/$fuzzer $run/artifacts/<file>; see fuzz/README.md" >&2
      exit 1
    fi
    grep -E '^(#[0-9]+[[:space:]]+INITED|Done [0-9]+ runs|stat::)' "$run"/fuzz-*.log
  done
fi

if [ "$clang_tree" = "1" ]; then
  # Abort on the first sanitizer report and print useful stacks.
  export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:strict_init_order=1:check_initialization_order=1:detect_stack_use_after_return=1}"
  export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

  if [ "$skip_asan" = "1" ]; then
    phase "ASan+UBSan: skipped (EMBEDHEAD_SKIP_ASAN=1); replaying the fuzz corpus (ctest -L fuzz)"
    ctest --test-dir build/asan --output-on-failure -L fuzz
  else
    # (built above, beside the Release ctest)
    # Every test but the CMake consumers (label cmake), and the fuzz corpus replay (label fuzz).
    phase "clang ASan+UBSan: ctest (excluding label 'cmake')"
    ctest --test-dir build/asan --output-on-failure -j "$jobs" -LE cmake
  fi
  if [ "$skip_fuzz" != "1" ]; then
    fuzz_tests="$(count_tests build/asan fuzz)"
    if [ "${fuzz_tests:-0}" -lt 3 ]; then
      echo "test.sh: error: expected the fuzz corpus replays (safetensors_fuzz_replay, npy_fuzz_replay, rope_config_fuzz_replay) in build/asan, found ${fuzz_tests:-0}" >&2
      exit 1
    fi
  fi
fi

# backend_tree <dir> <title> <skip variable's name> <skip value> <CMake flags...>: the test suite
# once more with every matrix product on another GEMM backend -- the tests only (no tools,
# examples, benchmarks or header check: those do not depend on the backend beyond what the tests
# cover), gcc Release, -Werror -- and its ctest.
backend_tree() {
  local dir="$1" title="$2" skip_name="$3" skip_value="$4"
  shift 4
  if [ "$skip_value" = "1" ]; then
    phase "$title: skipped ($skip_name=1)"
    return
  fi
  phase "$title: configure and build ($dir, gcc, $*)"
  configure "$dir" "${CXX_RELEASE:-g++}" \
    "${gcc_test_tree[@]}" \
    -DEMBEDHEAD_BUILD_TOOLS=OFF \
    -DEMBEDHEAD_CHECK_HEADERS=OFF \
    -DEMBEDHEAD_BUILD_BENCHMARKS=OFF \
    -DEMBEDHEAD_BUILD_EXAMPLES=OFF \
    "$@"
  cmake --build "$dir" -j "$jobs"
  phase "$title: ctest (excluding label 'cmake')"
  ctest --test-dir "$dir" --output-on-failure -j "$jobs" -LE cmake
  local unit
  unit="$(count_tests "$dir" unit)"
  if [ "${unit:-0}" -lt 20 ]; then
    echo "test.sh: error: expected the unit tests (label unit) in $dir, found ${unit:-0}" >&2
    exit 1
  fi
}

# Serial OpenBLAS (embedhead::cblas).
backend_tree build/cblas "CBLAS backend" EMBEDHEAD_SKIP_CBLAS "$skip_cblas" \
  -DEMBEDHEAD_CBLAS=OpenBLAS -DEMBEDHEAD_TEST_CBLAS=ON
# Eigen's GEMM kernel (EMBEDHEAD_GEMM_EIGEN), the backend the library ran on before its own packed
# kernel became the default.
backend_tree build/eigen "Eigen GEMM backend" EMBEDHEAD_SKIP_EIGEN "$skip_eigen" -DEMBEDHEAD_TEST_GEMM_EIGEN=ON

phase "All checks passed ($((SECONDS - start_time)) s)"
