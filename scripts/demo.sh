#!/usr/bin/env bash
# Build what the demo shows and show it: the benchmark tour (bench/tour), then the examples.
# Installs only the demo's packages (scripts/install_deps.sh demo: a compiler, cmake, ninja, Eigen,
# Google Benchmark, nlohmann-json) and builds only the tour and the examples, not the tests
# (scripts/test.sh). The examples run in examples/CMakeLists.txt's order: quickstart,
# parameter_budget, train_bigram, train_lm, undertrained_tokens, then tiny_gpt (a 2-layer RoPE
# transformer trained for about half a minute; it leaves build/release/examples/tiny_gpt.safetensors).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
# shellcheck source=scripts/common.sh
source scripts/common.sh

jobs="${JOBS:-2}"

phase "Dependencies (demo set)"
bash scripts/install_deps.sh demo

phase "Release: configure (build/release, tour + examples)"
configure build/release "${CXX:-g++}" \
  -DCMAKE_BUILD_TYPE=Release \
  -DEMBEDHEAD_BUILD_TESTS=OFF \
  -DEMBEDHEAD_BUILD_TOOLS=OFF \
  -DEMBEDHEAD_BUILD_BENCHMARKS=ON \
  -DEMBEDHEAD_BUILD_EXAMPLES=ON

# Only the tour and the examples that run_examples runs (target embedhead_examples), not the
# google-benchmark binaries; both at once, so both cores stay busy.
phase "Release: build the tour and the examples"
cmake --build build/release -j "$jobs" --target tour embedhead_examples

phase "Tour (build/release/bench/tour)"
build/release/bench/tour

phase "Examples"
cmake --build build/release --target run_examples

phase "Demo finished"
