#!/usr/bin/env bash
# Copies the test, benchmark and example binaries of this machine's build
# (CUDA path on, sm_80 and sm_90 code, PyTorch from the project's venv) into
# .gpu-prebuilt/, stripped, for scripts/gpu-check.sh on a lent GPU machine:
# when they run there (same PyTorch release and CUDA major version), the check
# skips its build, which is most of its device time. Run scripts/test.sh (or
# build with the CUDA path) first; examples/lion is built here from the
# installed ampfuse. Carry .gpu-prebuilt along with .gpu-deps.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
build=${AMPFUSE_BUILD_DIR}
dest="$AMPFUSE_ROOT/.gpu-prebuilt"
configure_build Release -DAMPFUSE_BUILD_TESTS=ON -DAMPFUSE_BUILD_BENCH=ON -DAMPFUSE_CUDA=ON
build --target ampfuse_tests ampfuse_bench readme_example train_amp >/dev/null
prefix="$build/install"
rm -rf "$prefix" "$build/lion-prebuilt"
"$AMPFUSE_CMAKE" --install "$build" --prefix "$prefix" >/dev/null
"$AMPFUSE_CMAKE" -S "$AMPFUSE_ROOT/examples/lion" -B "$build/lion-prebuilt" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix;$AMPFUSE_PREFIX_PATH" -DTORCH_CUDA_ARCH_LIST="9.0" \
  -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc ${AMPFUSE_LAUNCHER_ARGS} >/dev/null
"$AMPFUSE_CMAKE" --build "$build/lion-prebuilt" --parallel "${AMPFUSE_JOBS:-$(nproc)}" --target test_lion >/dev/null
rm -rf "$dest" && mkdir -p "$dest"
cp "$build/tests/ampfuse_tests" "$build/bench/ampfuse_bench" "$build/tests/readme_example" \
   "$build/tests/train_amp" "$build/lion-prebuilt/test_lion" "$dest/"
strip "$dest"/*
for f in "$dest"/*; do
  [[ "$(readelf -S "$f")" == *.nv_fatbin* ]] || { log "$f holds no CUDA code: is the CUDA path on?"; exit 1; }
done
echo "$(git -C "$AMPFUSE_ROOT" rev-parse --short HEAD)$(git -C "$AMPFUSE_ROOT" diff --quiet HEAD || echo '+changes'), built $(date -u +%FT%TZ)" >"$dest/BUILT"
du -sh "$dest"
