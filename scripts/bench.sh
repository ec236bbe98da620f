#!/usr/bin/env bash
# Sets up a fresh machine as scripts/test.sh does, builds the benchmarks, runs
# the comparison, prints the ratio table and regenerates bench/RESULTS.md,
# bench/results.png and the ratios block of README.md (with the CUDA results
# of the last GPU check, bench/gpu/*.json, as their second part). Extra arguments go to the benchmark binary
# (e.g. --benchmark_filter=Check: then the table goes to build/bench-filtered.md only). AMPFUSE_BENCH_THREADS sets the thread
# count for every contender (default: all cores).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

install_system_packages
configure_build Release -DAMPFUSE_BUILD_TESTS=ON -DAMPFUSE_BUILD_BENCH=ON
build --target ampfuse_bench
python=${AMPFUSE_PYTHON:-$AMPFUSE_VENV/bin/python}
torch_version=$("$python" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo unknown)
# The CPU's model, for the record's set-up line (VMs of one name have come
# with other CPUs, and the subnormal penalty, for one, moves with it).
cpu_model=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo 2>/dev/null | head -n 1)
cpu_model=${cpu_model//[,=]/;}  # (the context flag is key=value pairs split at commas)
out="$AMPFUSE_BUILD_DIR/bench.json"
# Five repetitions in random interleaved order, the fastest of each
# contender's reported (bench/report.py): a shared 2-core VM is noisy, its
# memory bandwidth bimodal (Adam 8x8M took 17-19 or 27-29 ms, every contender
# alike), so a median moved with how many of a contender's repetitions met
# the slow state (torch::optim's times by 2x between runs); interleaving
# spreads the noise over all contenders, and slowdowns only add.
run_bench() {
  "$AMPFUSE_BUILD_DIR/bench/ampfuse_bench" --benchmark_out_format=json \
    --benchmark_repetitions="${AMPFUSE_BENCH_REPETITIONS:-5}" --benchmark_enable_random_interleaving=true \
    --benchmark_report_aggregates_only=true --benchmark_context=torch_version="$torch_version" \
    --benchmark_context=cpu_model="${cpu_model:-unknown}" "$@"
}
# The host rows (Host*: 10,000 one-element parameters) run in a process of
# their own. After the large rows, the objects they allocate at every
# repetition (optimizer states, plans) land on the heap those rows left,
# scattered, and their times measured that heap's history as much as the
# step (docs/optimizers.md). A filter of the caller's runs in one process.
outs=("$out")
if [[ " $* " == *" --benchmark_filter="* ]]; then
  run_bench --benchmark_out="$out" "$@"
else
  outs+=("$AMPFUSE_BUILD_DIR/bench-host.json")
  run_bench --benchmark_out="$out" --benchmark_filter='-^Host' "$@"
  run_bench --benchmark_out="${outs[1]}" --benchmark_filter='^Host' "$@"
fi
# The CUDA part comes from the last GPU check (scripts/gpu-check.sh on a lent
# GPU machine), committed under bench/gpu/: this machine has no GPU.
gpu_json=("$AMPFUSE_ROOT"/bench/gpu/*.json)
[ -e "${gpu_json[0]}" ] || gpu_json=()
# A filtered run is a part of the record: its table goes to the build
# folder, and the committed record (RESULTS.md, results.png, README) stays.
if [ ${#outs[@]} -eq 1 ]; then
  "$python" "$AMPFUSE_ROOT/bench/report.py" "${outs[@]}" --md "$AMPFUSE_BUILD_DIR/bench-filtered.md" \
    ${gpu_json[@]:+--gpu "${gpu_json[@]}"}
  log "a filtered run: its table is in $AMPFUSE_BUILD_DIR/bench-filtered.md; bench/RESULTS.md and README.md are left as they were"
else
  "$python" "$AMPFUSE_ROOT/bench/report.py" "${outs[@]}" --md "$AMPFUSE_ROOT/bench/RESULTS.md" \
    --png "$AMPFUSE_ROOT/bench/results.png" --readme "$AMPFUSE_ROOT/README.md" ${gpu_json[@]:+--gpu "${gpu_json[@]}"}
fi
