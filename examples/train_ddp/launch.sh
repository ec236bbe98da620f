#!/usr/bin/env bash
# Starts N processes of a program on this machine as torchrun would: RANK,
# WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1 and a free MASTER_PORT, the
# program's own arguments passed on. Fails unless every rank exits 0; each is
# killed after AMPFUSE_RANK_TIMEOUT seconds (default 120), so nothing hangs.
# Usage: launch.sh <N> <program> [arguments...]
set -uo pipefail
world=$1
program=$2
shift 2
limit=${AMPFUSE_RANK_TIMEOUT:-120}
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
echo "[ ranks    ] $world processes of $(basename "$program"), MASTER_ADDR=127.0.0.1 MASTER_PORT=$port"
pids=()
for ((rank = 0; rank < world; ++rank)); do
  RANK=$rank LOCAL_RANK=$rank WORLD_SIZE=$world MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    timeout "$limit" "$program" "$@" &
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
