#!/usr/bin/env bash
# The CPU test suite under AddressSanitizer + UndefinedBehaviorSanitizer, in
# its own build tree (default <repo>/build-asan), without CUDA or benchmarks.
# The tests force every compiled instruction set (avx512, avx2, baseline)
# through their parameters, so each kernel runs in all three. Any report
# fails the run. Called by scripts/test.sh; runs alone too. Extra arguments
# go to the test binary (a --gtest_filter of your own, for instance).
# Honours AMPFUSE_SANITIZE_BUILD_DIR and what scripts/env.sh honours.
set -euo pipefail
AMPFUSE_BUILD_DIR=${AMPFUSE_SANITIZE_BUILD_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/build-asan}
AMPFUSE_CUDA=OFF
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

# -fno-sanitize-recover=undefined: a UBSan report aborts, as an ASan one does.
# -O1 -g1: line numbers in reports, at less compile time than -O3.
sanitize="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
# detect_leaks=0: LibTorch (not instrumented) leaks, and LeakSanitizer reports
# it at exit: 12 allocations of its zip reader (mz_zip_reader_init) after the
# checkpoint tests' refused loads of damaged archives (docs/testing.md).
# halt_on_error=1 (ASan's default, stated) and UBSan's: the first report ends
# the run with a non-zero status; print_stacktrace=1: it says where.
export ASAN_OPTIONS=detect_leaks=0:halt_on_error=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
# The shards run side by side, each with ATen's OpenMP pool of one thread per core: libgomp's
# default spin-wait of idle threads would take the cores from the working ones (docs/testing.md).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
# The soak's numeric coverage is the plain run's; here 30 of its random
# configurations look for memory errors (each runs 3 torch::optim twins).
export AMPFUSE_SOAK_CONFIGS=${AMPFUSE_SOAK_CONFIGS:-30}
# The step-plan fuzz likewise: 30 of its configurations per device (300 in the plain run).
export AMPFUSE_PLAN_FUZZ_CONFIGS=${AMPFUSE_PLAN_FUZZ_CONFIGS:-30}

log "AddressSanitizer + UndefinedBehaviorSanitizer: build ($AMPFUSE_BUILD_DIR)"
t0=$(date +%s)
configure_build RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
  -DCMAKE_CXX_FLAGS="$sanitize" -DCMAKE_EXE_LINKER_FLAGS="$sanitize" -DCMAKE_SHARED_LINKER_FLAGS="$sanitize" \
  -DAMPFUSE_BUILD_TESTS=ON -DAMPFUSE_BUILD_BENCH=OFF >/dev/null
# Only the test binary (its build lists the tests, so it runs under ASan already).
build --target ampfuse_tests
t1=$(date +%s)

# The whole CPU suite (docs/testing.md has its cost); AMPFUSE_SANITIZE_FILTER
# (a --gtest_filter) runs less. CUDA cases skip without a device; the 2^31
# test skips under ASan (its shadow memory would not fit).
filter=${AMPFUSE_SANITIZE_FILTER:-*}
jobs=${AMPFUSE_JOBS:-$(nproc)}
log "AddressSanitizer + UndefinedBehaviorSanitizer: run, $jobs shards (built in $((t1 - t0)) s)"
# Shards in parallel: the test code is mostly one thread.
pids=()
for ((i = 0; i < jobs; ++i)); do
  GTEST_TOTAL_SHARDS=$jobs GTEST_SHARD_INDEX=$i "$AMPFUSE_BUILD_DIR/tests/ampfuse_tests" --gtest_brief=1 \
    --gtest_filter="$filter" "$@" >"$AMPFUSE_BUILD_DIR/sanitize_shard_$i.log" 2>&1 &
  pids+=($!)
done
failed=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || {
    failed=1
    # --gtest_brief prints a failure where it happens and no list at the end:
    # each failed test (the first 5) with its seed line (printed once, when it
    # started) and the 30 lines before its end, then the log's tail.
    shard_log="$AMPFUSE_BUILD_DIR/sanitize_shard_$i.log"
    log "shard $i failed; its failed tests:"
    names=$({ grep -E '^\[  FAILED  \] ' "$shard_log" || true; } | sed -E 's/^\[  FAILED  \] ([^ ,]+).*/\1/' | sort -u | head -5) || true
    for name in $names; do
      { grep -F "] $name: " "$shard_log" || true; } | head -1 >&2 || true
      { grep -B30 -F "[  FAILED  ] $name" "$shard_log" || true; } | tail -31 >&2 || true
    done
    log "shard $i: the last 40 lines of its log:"
    tail -40 "$AMPFUSE_BUILD_DIR/sanitize_shard_$i.log" >&2
  }
done
# A report always ends its process with a non-zero status; this is the belt to those braces.
if grep -l -E "ERROR: AddressSanitizer|runtime error:" "$AMPFUSE_BUILD_DIR"/sanitize_shard_*.log >&2; then failed=1; fi
[ "$failed" = 0 ] || { log "AddressSanitizer + UndefinedBehaviorSanitizer: FAILED"; exit 1; }
passed=$(grep -hoE '^\[  PASSED  \] [0-9]+' "$AMPFUSE_BUILD_DIR"/sanitize_shard_*.log | awk '{n += $NF} END {print n + 0}')
log "AddressSanitizer + UndefinedBehaviorSanitizer: clean, $passed tests (built in $((t1 - t0)) s, ran in $(($(date +%s) - t1)) s)"
