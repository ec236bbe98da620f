#!/usr/bin/env bash
# Sets up everything a fresh machine needs, builds ampfuse (CUDA path too when
# nvcc and a CUDA-enabled LibTorch are present), then runs every test.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

install_system_packages
configure_build Release -DAMPFUSE_BUILD_TESTS=ON -DAMPFUSE_BUILD_BENCH=ON
build
# Benchmarks are built (so a break fails here) but not run: that is scripts/bench.sh.
cd "$AMPFUSE_BUILD_DIR"
"$AMPFUSE_CTEST" --output-on-failure --parallel "${AMPFUSE_JOBS:-$(nproc)}" "$@"
