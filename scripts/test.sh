#!/usr/bin/env bash
# Sets up everything a fresh machine needs, builds ampfuse (CUDA path too when
# nvcc and a CUDA-enabled LibTorch are present), installs it to a scratch
# prefix and builds a consumer project against it (find_package(ampfuse)),
# then runs every test through ctest (ampfuse_tests as 8 GoogleTest shards;
# the test over a tensor of 2^31 + 17 elements, label "large", alone), then the CPU tests again under
# AddressSanitizer + UndefinedBehaviorSanitizer in build-asan
# (scripts/sanitize.sh, docs/testing.md). Extra arguments go to ctest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

install_system_packages
log "docs/guide.md: every code block is an excerpt of a compiled source"
python3 "$AMPFUSE_ROOT/scripts/check_guide.py"
configure_build Release -DAMPFUSE_BUILD_TESTS=ON -DAMPFUSE_BUILD_BENCH=ON
build
# Benchmarks are built (so a break fails here) but not run: that is scripts/bench.sh.

log "install and find_package(ampfuse) from a consumer project"
prefix="$AMPFUSE_BUILD_DIR/install"
rm -rf "$prefix" "$AMPFUSE_BUILD_DIR/consumer"
"$AMPFUSE_CMAKE" --install "$AMPFUSE_BUILD_DIR" --prefix "$prefix" >/dev/null
"$AMPFUSE_CMAKE" -S "$AMPFUSE_ROOT/examples/consumer" -B "$AMPFUSE_BUILD_DIR/consumer" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix;$AMPFUSE_PREFIX_PATH" ${Torch_DIR:+-DTorch_DIR="$Torch_DIR"} \
  -DTORCH_CUDA_ARCH_LIST="8.0;9.0" ${AMPFUSE_LAUNCHER_ARGS} >/dev/null
"$AMPFUSE_CMAKE" --build "$AMPFUSE_BUILD_DIR/consumer" --parallel "${AMPFUSE_JOBS:-$(nproc)}" >/dev/null
"$AMPFUSE_BUILD_DIR/consumer/consumer"

# ctest runs tests side by side, each with ATen's OpenMP pool of one thread per core: libgomp's
# default spin-wait would take the cores from the working threads (docs/testing.md). ampfuse's
# own tests set it in CMake too; this reaches the Lion project's and anything ctest starts.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}

log "a third-party optimizer (examples/lion, docs/guide.md) against the installed ampfuse: build and ctest"
rm -rf "$AMPFUSE_BUILD_DIR/lion"
lion_cuda=()
[ -x /usr/local/cuda/bin/nvcc ] && lion_cuda+=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
"$AMPFUSE_CMAKE" -S "$AMPFUSE_ROOT/examples/lion" -B "$AMPFUSE_BUILD_DIR/lion" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix;$AMPFUSE_PREFIX_PATH" ${Torch_DIR:+-DTorch_DIR="$Torch_DIR"} \
  "${lion_cuda[@]}" ${AMPFUSE_LAUNCHER_ARGS} >/dev/null  # the documented command: no TORCH_CUDA_ARCH_LIST
"$AMPFUSE_CMAKE" --build "$AMPFUSE_BUILD_DIR/lion" --parallel "${AMPFUSE_JOBS:-$(nproc)}" >/dev/null
"$AMPFUSE_CTEST" --test-dir "$AMPFUSE_BUILD_DIR/lion" --output-on-failure --parallel "${AMPFUSE_JOBS:-$(nproc)}"

cd "$AMPFUSE_BUILD_DIR"
"$AMPFUSE_CTEST" --output-on-failure --parallel "${AMPFUSE_JOBS:-$(nproc)}" "$@"
# ctest counts shards (tests/CMakeLists.txt); this counts the GoogleTest tests inside them.
passed=$(grep -hoE '^\[  PASSED  \] [0-9]+' Testing/Temporary/LastTest.log | awk '{n += $NF} END {print n + 0}')
log "ctest: $passed GoogleTest tests passed in ampfuse_tests (CUDA ones skip without a device)"

cd "$AMPFUSE_ROOT"
bash "$AMPFUSE_ROOT/scripts/sanitize.sh"
