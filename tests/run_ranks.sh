#!/usr/bin/env bash
# Starts N processes of a rank program (tests/dist_rank.cpp) on this machine
# as torchrun would: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1 and
# a free MASTER_PORT. Fails unless every rank exits 0; each is killed after
# AMPFUSE_RANK_TIMEOUT seconds (default 120), so nothing hangs CI.
# Usage: run_ranks.sh <program> <N>
set -uo pipefail
program=$1
world=$2
limit=${AMPFUSE_RANK_TIMEOUT:-120}
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
seed=${AMPFUSE_TEST_SEED:-$(( (RANDOM << 15) | RANDOM ))}
echo "[ ranks    ] $world processes, MASTER_PORT=$port, seed $seed (replay: AMPFUSE_TEST_SEED=$seed)"
pids=()
for ((rank = 0; rank < world; ++rank)); do
  RANK=$rank LOCAL_RANK=$rank WORLD_SIZE=$world MASTER_ADDR=127.0.0.1 MASTER_PORT=$port AMPFUSE_TEST_SEED=$seed \
    timeout "$limit" "$program" &
  pids+=($!)
done
failed=0
for rank in "${!pids[@]}"; do
  wait "${pids[$rank]}"
  status=$?
  if [ "$status" -ne 0 ]; then
    echo "[ ranks    ] rank $rank exited with $status" >&2
    failed=1
  fi
done
exit $failed
