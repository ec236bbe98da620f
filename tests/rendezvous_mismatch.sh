#!/usr/bin/env bash
# Two processes of a rank program (tests/dist_rank.cpp) given different
# WORLD_SIZEs (2 and 3) on one port: both must fail at once, before Gloo's
# rendezvous (which has no timeout), naming the mismatch.
# Usage: rendezvous_mismatch.sh <program>
set -uo pipefail
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout 60 "$1" >"$logs/0" 2>&1 &
rank0=$!
RANK=1 WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout 60 "$1" >"$logs/1" 2>&1 &
rank1=$!
wait "$rank0"; rc0=$?
wait "$rank1"; rc1=$?
status=0
for r in 0 1; do
  rc=$([ "$r" = 0 ] && echo "$rc0" || echo "$rc1")
  if [ "$rc" = 0 ] || [ "$rc" = 124 ] || ! grep -q "rank 1 was started with WORLD_SIZE=3, rank 0 with 2" "$logs/$r"; then
    echo "rank $r: exit $rc, expected a refusal naming the world sizes; its log:"
    sed -n 1,20p "$logs/$r"
    status=1
  fi
done
[ "$status" = 0 ] && echo "both ranks refused the mismatched WORLD_SIZE"
exit "$status"
