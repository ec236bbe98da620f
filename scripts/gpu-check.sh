#!/usr/bin/env bash
# The GPU check, for a machine with a CUDA GPU, PyTorch and no network.
#
# Takes the test, benchmark and example binaries carried in .gpu-prebuilt/
# (scripts/gpu-prebuilt.sh) when they load against that machine's PyTorch,
# else builds them there for sm_90; runs the tests (CUDA ones and the rest,
# not the CPU instruction-set cases CI covers), the README example and
# train_amp, one tensor of 2^31 + 17 fp32 elements, a CUDA test subset under
# compute-sanitizer memcheck and racecheck (those two steps not yet run on a
# GPU: up to 3 + 8 min, by their time limits), the CUDA benchmarks with the device-to-device copy ceiling (1B
# parameters for Adam included), then examples/lion's tests, and prints a
# short table last. GoogleTest and Google Benchmark
# come from the machine, or from .gpu-deps/ (made here by scripts/gpu-deps.sh
# and carried along).
#
# Budget (H200, 2026-11-30): with the carried binaries, tests 15 s, examples
# and lion 5 s, every CUDA benchmark about 6 min (the 300 s it had once ended
# during LAMB); building here instead adds minutes. Every phase has a time
# limit, so that what ran comes back even when one hangs. $OUT (when set) gets at most 7
# files, since a lent machine sends back 8: summary.txt, tests.log,
# bench.log, bench_cuda.json, RESULTS_cuda.md, logs.tar.gz (configure, build,
# lion and report logs) and nothing else.
#
#   scripts/gpu-deps.sh; scripts/gpu-prebuilt.sh   # on the build machine
#   device run: bash scripts/gpu-check.sh   (carry .gpu-deps and .gpu-prebuilt)
#   then commit $OUT/bench_cuda.json as bench/gpu/<gpu>.json: scripts/bench.sh
#   renders it as the CUDA part of bench/RESULTS.md and of the README.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${OUT:-$root/build-gpu/logs}
build=${AMPFUSE_GPU_BUILD_DIR:-/tmp/ampfuse-gpu-build}
python=${PYTHON:-python3}
logs="$build/logs"  # the long logs, packed into $out/logs.tar.gz at the end
mkdir -p "$out" "$logs"
log() { printf '[gpu-check] %s\n' "$*" | tee -a "$out/summary.txt"; }
pack_logs() { tar -czf "$out/logs.tar.gz" -C "$build" logs 2>/dev/null; }
trap pack_logs EXIT
export PATH=/usr/local/cuda/bin:$PATH

log "$(date -u) on $(hostname)"
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$out/summary.txt"
torch_prefix=$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)') || { log "no PyTorch"; exit 1; }
log "torch $("$python" -c 'import torch; print(torch.__version__, torch.version.cuda)')"
"$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' ||
  log "WARNING: PyTorch sees no CUDA device here: the CUDA tests will skip"
prefix="$torch_prefix"
[ -d "$root/.gpu-deps/usr" ] && prefix="$root/.gpu-deps/usr;$prefix"
generator=(); command -v ninja >/dev/null && generator=(-G Ninja)

start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }
# The CUDA libraries of this machine's PyTorch wheel (and the carried test
# libraries), for binaries built elsewhere and for the ones built here.
torch_dir=$("$python" -c 'import os, torch; print(os.path.dirname(torch.__file__))')
libs="$root/.gpu-deps/usr/lib/x86_64-linux-gnu:$torch_dir/lib"
for d in "$(dirname "$torch_dir")"/nvidia/*/lib "$(dirname "$torch_dir")"/nvidia/cu13/lib /usr/local/cuda/lib64; do
  [ -d "$d" ] && libs="$libs:$d"
done
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# Binaries built on the build machine (scripts/gpu-prebuilt.sh) save the
# build's minutes of device time when they run here (same PyTorch release,
# same CUDA major version); otherwise everything is built here.
bin="$root/.gpu-prebuilt"
if [ -x "$bin/ampfuse_tests" ] && [ -x "$bin/ampfuse_bench" ] &&
   timeout 60 "$bin/ampfuse_tests" --gtest_list_tests >/dev/null 2>"$logs/prebuilt.log" &&
   timeout 60 "$bin/ampfuse_bench" --benchmark_list_tests --benchmark_filter=NONE >/dev/null 2>>"$logs/prebuilt.log"; then
  log "using the carried binaries in .gpu-prebuilt ($(cat "$bin/BUILT" 2>/dev/null))"
  prebuilt=1
else
  [ -d "$bin" ] && log "carried binaries do not run here: $(tail -2 "$logs/prebuilt.log" | tr '\n' ' ')"
  prebuilt=0
  timeout 180 cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
    -DAMPFUSE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DAMPFUSE_BUILD_TESTS=ON -DAMPFUSE_BUILD_BENCH=ON \
    >"$logs/configure.log" 2>&1 || { log "configure FAILED"; tail -30 "$logs/configure.log"; exit 1; }
  # Only what the check runs (not the header checks).
  timeout 360 cmake --build "$build" --parallel "$(nproc)" --target ampfuse_tests ampfuse_bench readme_example train_amp \
    >"$logs/build.log" 2>&1 || { log "build FAILED after $(elapsed) s"; grep -E "error" -A3 "$logs/build.log" | head -40; exit 1; }
  log "built in $(elapsed) s"
  bin="$build/bin"
  mkdir -p "$bin"
  cp "$build/tests/ampfuse_tests" "$build/bench/ampfuse_bench" "$build/tests/readme_example" "$build/tests/train_amp" "$bin/"
fi

timeout 240 "$bin/ampfuse_tests" --gtest_filter='-*cpu*:*avx*:*baseline*' >"$out/tests.log" 2>&1
tests_rc=$?
log "tests ($(elapsed) s): $(grep -E '^\[  (PASSED|FAILED|SKIPPED) *\] [0-9]+ tests?' "$out/tests.log" | tr '\n' ' ') (rc $tests_rc)"
grep -E '^\[  FAILED  \]' "$out/tests.log" | head -20 | tee -a "$out/summary.txt"
grep -E '^\[ launches \]' "$out/tests.log" | tee -a "$out/summary.txt"
# The README's example and the mixed-precision training example, on the GPU.
(cd "$logs" && timeout 60 "$bin/readme_example" >"$logs/examples.log" 2>&1 &&
  timeout 90 "$bin/train_amp" --check 0.07 >>"$logs/examples.log" 2>&1)
log "examples (readme_example, train_amp --check 0.07): rc $? ($(tail -1 "$logs/examples.log"))"
# NOT YET RUN on a GPU (written 2026-12-01 without one): FusedAdam's 8-bit moments on CUDA in a
# training loop, against 32-bit moments from the same start (CI runs the same on the CPU).
(cd "$logs" && timeout 120 "$bin/train_amp" --compare-8bit 0.02 >"$logs/train_amp_8bit.log" 2>&1)
log "train_amp --compare-8bit 0.02: rc $? ($(tail -1 "$logs/train_amp_8bit.log"))"

# NOT YET RUN on a GPU (written 2026-12-01 without one): the next two steps.
# One tensor of 2^31 + 17 fp32 elements (tests/test_large.cpp: the check pass
# and a FusedAdam step, 32 GiB of device memory; it skips when less is free).
AMPFUSE_LARGE_TESTS=1 timeout 180 "$bin/ampfuse_tests" --gtest_filter='All/LargeTensor.*/cuda' >"$logs/large.log" 2>&1
log "2^31 + 17 elements, fp32 ($(elapsed) s): rc $? ($(grep -E '^\[  (PASSED|FAILED|SKIPPED) *\] [0-9]+ tests?|^\[ large' "$logs/large.log" | tr '\n' ' '))"
# A CUDA subset under compute-sanitizer, memcheck then racecheck: every
# kernel (the engine ops and each optimizer's contract conformance, all
# dtypes). PYTORCH_NO_CUDA_MEMORY_CACHING: one cudaMalloc per tensor, so that
# memcheck sees an access past a tensor's end instead of into the caching
# allocator's next block. AMPFUSE_GPU_SANITIZE_FILTER picks another subset.
sanitize_filter=${AMPFUSE_GPU_SANITIZE_FILTER:-'All/EngineOps.RandomListsVisitEveryElementOnce/cuda_*:All/EngineOps.UnscaleMatchesAtenBitwise/cuda_*:All/EngineOps.FiniteListLeavesFoundInfAndMatchesSumOfSquares/cuda_*:All/ConformanceTest.*/cuda'}
if command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 240 compute-sanitizer --tool "$tool" --error-exitcode 99 \
      "$bin/ampfuse_tests" --gtest_filter="$sanitize_filter" >"$logs/sanitize_$tool.log" 2>&1
    rc=$?
    log "compute-sanitizer $tool ($(elapsed) s): rc $rc (99: reports; 124: time limit) ($(grep -E '^========= (ERROR SUMMARY|RACECHECK SUMMARY)' "$logs/sanitize_$tool.log" | tr '\n' ' ')$(grep -E '^\[  (PASSED|FAILED) *\] [0-9]+ tests?' "$logs/sanitize_$tool.log" | tr '\n' ' '))"
  done
else
  log "compute-sanitizer not found: memcheck and racecheck not run"
fi

# AMPFUSE_GPU_BENCH_FILTER picks fewer (a rerun of what a timeout cut off).
# --benchmark_context splits its value at commas: the GPU's fields joined by ';'.
gpu_context=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1 |
  sed 's/, /; /g; s/,/;/g')
AMPFUSE_BENCH_MIN_TIME=${AMPFUSE_BENCH_MIN_TIME:-0.2} timeout "${AMPFUSE_GPU_BENCH_TIMEOUT:-420}" "$bin/ampfuse_bench" \
  --benchmark_filter="${AMPFUSE_GPU_BENCH_FILTER:-@cuda}" --benchmark_out="$out/bench_cuda.json" --benchmark_out_format=json \
  --benchmark_context=torch_version="$("$python" -c 'import torch; print(torch.__version__)')" \
  --benchmark_context=gpu="$gpu_context" >"$out/bench.log" 2>&1
bench_rc=$?
log "benchmarks ($(elapsed) s): rc $bench_rc"
if [ -s "$out/bench_cuda.json" ]; then
  "$python" "$root/bench/report.py" "$out/bench_cuda.json" --gpu-setup --title "ampfuse on ${gpu_name:-no GPU}" \
    --md "$out/RESULTS_cuda.md" >/dev/null 2>"$logs/report.err" || log "report failed: $(tail -3 "$logs/report.err")"
else
  log "no benchmark results"
fi

# Last, as it is the least needed: the third-party example (examples/lion)
# against the installed ampfuse, CUDA part included.
if [ "$prebuilt" = 1 ] && [ ! -x "$bin/test_lion" ]; then
  lion_rc=1
  lion_summary="skipped: .gpu-prebuilt has no test_lion (run scripts/gpu-prebuilt.sh again)"
  : >"$logs/lion.log"
elif [ "$prebuilt" = 1 ]; then
  timeout 120 "$bin/test_lion" >"$logs/lion.log" 2>&1
  lion_rc=$?
  lion_summary=$(grep -E '^\[  (PASSED|FAILED|SKIPPED) *\] [0-9]+ tests?' "$logs/lion.log" | tr '\n' ' ')
else
  timeout 60 cmake --install "$build" --prefix "$build/install" >"$logs/lion.log" 2>&1 &&
    timeout 60 cmake -S "$root/examples/lion" -B "$build/lion" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$build/install;$prefix" -DTORCH_CUDA_ARCH_LIST=9.0 >>"$logs/lion.log" 2>&1 &&
    timeout 150 cmake --build "$build/lion" --parallel "$(nproc)" >>"$logs/lion.log" 2>&1 &&
    timeout 90 ctest --test-dir "$build/lion" --output-on-failure >>"$logs/lion.log" 2>&1
  lion_rc=$?
  lion_summary=$(grep -E 'tests passed|tests failed' "$logs/lion.log" | tail -1)
fi
log "examples/lion ($(elapsed) s): rc $lion_rc ($lion_summary)"
log "total $(elapsed) s"
cat "$out/RESULTS_cuda.md" 2>/dev/null
exit $tests_rc
