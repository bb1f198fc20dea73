#!/usr/bin/env bash
# Install embedhead's build dependencies on Debian 12 (idempotent).
#
# Usage: scripts/install_deps.sh [demo|full] [extra-package ...]
#
#   demo  what scripts/demo.sh needs: a compiler, cmake, ninja, Eigen, Google Benchmark and
#         nlohmann-json (the tiny_gpt example saves a safetensors checkpoint)
#   full  (default) everything scripts/test.sh needs: also Catch2, numpy, clang
#         with libFuzzer and OpenMP, chromium and OpenMPI
#
# Only packages that are not installed yet are installed; `apt-get update` is
# run only when something is missing. Needs root only in that case.
set -euo pipefail

set_name="full"
case "${1:-}" in
  demo|full) set_name="$1"; shift ;;
esac

# ninja-build: the scripts use Ninja when it is there (it schedules both cores better than make).
# nlohmann-json3-dev: embedhead::safetensors, which the tiny_gpt example saves its checkpoint with.
demo_packages=(cmake g++ ninja-build libeigen3-dev libbenchmark-dev nlohmann-json3-dev)
# python3-numpy: the python interop tests (tests/python); clang + libclang-rt-14-dev: the libFuzzer
# build of fuzz/ and the clang ASan+UBSan build of the tests (libFuzzer and the sanitizer runtimes
# are in libclang-rt-14-dev on Debian 12); libomp-dev: OpenMP for clang (threads_test);
# chromium: the headless-browser check of embedhead-inspect's HTML report (ctest label browser);
# libopenmpi-dev + openmpi-bin: embedhead::mpi and the parallel tests under mpirun (label mpi);
# make: cmake's fallback generator; clang-format-14: the formatting check (ctest label format);
# libopenblas-serial-dev: the CBLAS backend the third tree's tests run on (embedhead::cblas);
# libdnnl-dev: oneDNN, the bf16 products' backend the Release tree tests (embedhead::onednn).
full_packages=("${demo_packages[@]}" make catch2 python3-numpy clang libclang-rt-14-dev
               libomp-dev chromium libopenmpi-dev openmpi-bin clang-format-14 libopenblas-serial-dev
               libdnnl-dev)
if [ "$set_name" = "demo" ]; then
  packages=("${demo_packages[@]}" "$@")
else
  packages=("${full_packages[@]}" "$@")
fi

is_installed() {
  dpkg -s "$1" 2>/dev/null | grep -q '^Status: install ok installed$'
}

missing=()
for pkg in "${packages[@]}"; do
  if ! is_installed "$pkg"; then
    missing+=("$pkg")
  fi
done

if [ "${#missing[@]}" -eq 0 ]; then
  echo "install_deps ($set_name): all dependencies present (${packages[*]})"
  exit 0
fi

echo "install_deps ($set_name): missing packages: ${missing[*]}"
if [ "$(id -u)" -ne 0 ]; then
  echo "install_deps: error: not running as root; cannot install the packages above." >&2
  echo "install_deps: run: sudo apt-get update && sudo apt-get install --no-install-recommends ${missing[*]}" >&2
  exit 1
fi

export DEBIAN_FRONTEND=noninteractive
apt-get update
apt-get install -y --no-install-recommends "${missing[@]}"
echo "install_deps: done"
