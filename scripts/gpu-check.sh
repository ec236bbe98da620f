#!/usr/bin/env bash
# The GPU check, for a machine with a CUDA GPU, PyTorch and no network.
#
# Builds ampfuse against that machine's PyTorch for sm_90, runs every test
# (CUDA included), runs the CUDA benchmarks with the device-to-device copy
# ceiling, prints a short table last and writes full logs under $OUT when set.
# GoogleTest and Google Benchmark come from the machine, or from .gpu-deps/
# (made here by scripts/gpu-deps.sh and carried along). Budget: 8 minutes.
#
#   scripts/gpu-deps.sh            # on the build machine, once
#   device run: bash scripts/gpu-check.sh   (carry .gpu-deps)
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${OUT:-$root/build-gpu/logs}
build=${AMPFUSE_GPU_BUILD_DIR:-/tmp/ampfuse-gpu-build}
python=${PYTHON:-python3}
mkdir -p "$out"
log() { printf '[gpu-check] %s\n' "$*" | tee -a "$out/summary.txt"; }
export PATH=/usr/local/cuda/bin:$PATH

log "$(date -u) on $(hostname)"
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$out/summary.txt"
torch_prefix=$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)') || { log "no PyTorch"; exit 1; }
log "torch $("$python" -c 'import torch; print(torch.__version__, torch.version.cuda)')"
prefix="$torch_prefix"
[ -d "$root/.gpu-deps/usr" ] && prefix="$root/.gpu-deps/usr;$prefix"
generator=(); command -v ninja >/dev/null && generator=(-G Ninja)

start=$(date +%s)
cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
  -DAMPFUSE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DAMPFUSE_BUILD_TESTS=ON -DAMPFUSE_BUILD_BENCH=ON \
  >"$out/configure.log" 2>&1 || { log "configure FAILED"; tail -30 "$out/configure.log"; exit 1; }
cmake --build "$build" --parallel "$(nproc)" >"$out/build.log" 2>&1 || { log "build FAILED"; grep -E "error" -A3 "$out/build.log" | head -40; exit 1; }
log "built in $(( $(date +%s) - start )) s"

export LD_LIBRARY_PATH="$root/.gpu-deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
"$build/tests/ampfuse_tests" --gtest_output=xml:"$out/tests.xml" >"$out/tests.log" 2>&1
tests_rc=$?
log "tests: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) *\] [0-9]+ tests?' "$out/tests.log" | tr '\n' ' ') (rc $tests_rc)"
"$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' ||
  log "WARNING: PyTorch sees no CUDA device here: the CUDA tests were skipped"
grep -E '^\[  FAILED  \]' "$out/tests.log" | head -20 | tee -a "$out/summary.txt"
grep -E '^\[ launches \]' "$out/tests.log" | tee -a "$out/summary.txt"

# The third-party example (examples/lion) against the installed ampfuse, CUDA part included.
cmake --install "$build" --prefix "$build/install" >/dev/null 2>&1 &&
  cmake -S "$root/examples/lion" -B "$build/lion" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$build/install;$prefix" -DTORCH_CUDA_ARCH_LIST=9.0 >"$out/lion.log" 2>&1 &&
  cmake --build "$build/lion" --parallel "$(nproc)" >>"$out/lion.log" 2>&1 &&
  ctest --test-dir "$build/lion" --output-on-failure >>"$out/lion.log" 2>&1
log "examples/lion: rc $? ($(grep -E 'tests passed|tests failed' "$out/lion.log" | tail -1))"

"$build/bench/ampfuse_bench" --benchmark_filter='@cuda' --benchmark_out="$out/bench_cuda.json" \
  --benchmark_out_format=json --benchmark_context=torch_version="$("$python" -c 'import torch; print(torch.__version__)')" \
  >"$out/bench.log" 2>&1
log "benchmarks rc $?"
[ -s "$out/bench_cuda.json" ] && "$python" "$root/bench/report.py" "$out/bench_cuda.json" --title "ampfuse on ${gpu_name:-no GPU}" \
  --md "$out/RESULTS_cuda.md" >/dev/null 2>"$out/report.err" || log "report failed: $(tail -3 "$out/report.err")"
log "total $(( $(date +%s) - start )) s"
cat "$out/RESULTS_cuda.md" 2>/dev/null
exit $tests_rc
