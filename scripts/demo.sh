#!/usr/bin/env bash
# Build embedhead in Release (benchmarks + examples) and show it off:
# runs the benchmark tour (if present), then the examples.
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

phase "Release: configure (build/release, benchmarks + examples ON)"
cmake -S . -B build/release \
  -DCMAKE_BUILD_TYPE=Release \
  -DEMBEDHEAD_BUILD_BENCHMARKS=ON \
  -DEMBEDHEAD_BUILD_EXAMPLES=ON

phase "Release: build"
cmake --build build/release -j "$jobs"

if [ -x build/release/bench/tour ]; then
  phase "Tour (build/release/bench/tour)"
  build/release/bench/tour
else
  phase "Tour: build/release/bench/tour not built (bench/tour.cpp missing?), skipping"
fi

phase "Examples"
cmake --build build/release --target run_examples

phase "Demo finished"
