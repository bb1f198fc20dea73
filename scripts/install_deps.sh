#!/usr/bin/env bash
# Install embedhead's build dependencies on Debian 12 (idempotent).
#
# Usage: scripts/install_deps.sh [extra-package ...]
#
# Only packages that are not installed yet are installed; `apt-get update` is
# run only when something is missing. Needs root only in that case.
set -euo pipefail

# python3-numpy: the python interop tests (tests/python); clang + libclang-rt-14-dev: the libFuzzer
# build of fuzz/ (libFuzzer and the sanitizer runtimes are in libclang-rt-14-dev on Debian 12);
# chromium: the headless-browser check of embedhead-inspect's HTML report (ctest label browser);
# libopenmpi-dev + openmpi-bin: embedhead::mpi and the parallel tests under mpirun (label mpi).
packages=(cmake g++ make libeigen3-dev catch2 libbenchmark-dev nlohmann-json3-dev
          python3-numpy clang libclang-rt-14-dev chromium libopenmpi-dev openmpi-bin "$@")

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
  echo "install_deps: all dependencies present (${packages[*]})"
  exit 0
fi

echo "install_deps: missing packages: ${missing[*]}"
if [ "$(id -u)" -ne 0 ]; then
  echo "install_deps: error: not running as root; cannot install the packages above." >&2
  echo "install_deps: run: sudo apt-get update && sudo apt-get install --no-install-recommends ${missing[*]}" >&2
  exit 1
fi

export DEBIAN_FRONTEND=noninteractive
apt-get update
apt-get install -y --no-install-recommends "${missing[@]}"
echo "install_deps: done"
