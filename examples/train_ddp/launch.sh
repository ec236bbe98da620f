#!/usr/bin/env bash
# Starts N processes of a program on this machine as torchrun would: RANK,
# WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1 and a free MASTER_PORT, the
# program's own arguments passed on. Fails unless every rank exits 0; each is
# killed after AMPFUSE_RANK_TIMEOUT seconds (default 120), so nothing hangs.
# The port is found free, then released for rank 0 to bind: another process
# can take it in between. A launch whose rank 0 failed on a port in use runs
# again on another port (three tries). The other ranks of that try, which wait
# for a store that never comes (or reached whoever took the port), are ended
# then, not waited for.
# Usage: launch.sh <N> <program> [arguments...]
set -uo pipefail
if [ $# -lt 2 ] || ! [[ $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: launch.sh <N >= 1> <program> [arguments...]" >&2
  exit 2
fi
world=$1
program=$2
shift 2
limit=${AMPFUSE_RANK_TIMEOUT:-120}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

# Whether rank 0 of the last try failed on a port in use.
port_taken() { grep -qiE 'EADDRINUSE|address already in use' "$logs/rank0.err"; }

# Ends a rank's job: the subshell whose children are its `timeout` (which
# passes the signal on to the program) and its `tee` (which ends with the
# program's output, its last lines kept). Again every 0.1 s while the job
# runs, up to 5 s: its `timeout` may not have started yet.
end_rank() {
  local child tries
  for ((tries = 0; tries < 50; ++tries)); do
    kill -0 "$1" 2>/dev/null || return 0
    for child in $(cat "/proc/$1/task/$1/children" 2>/dev/null); do
      [ "$(cat "/proc/$child/comm" 2>/dev/null)" = timeout ] && kill -TERM "$child" 2>/dev/null
    done
    sleep 0.1
  done
}

# Runs the ranks once on port $1, the program's arguments after it; returns
# 0 when every rank exited 0.
launch() {
  local port=$1 rank other status failed=0
  shift
  local -a pids=()
  echo "[ ranks    ] $world processes of $(basename "$program"), MASTER_ADDR=127.0.0.1 MASTER_PORT=$port"
  for ((rank = 0; rank < world; ++rank)); do
    # Each rank's stderr is shown as it comes and kept, to tell a port in use;
    # waiting for the group waits for its tee too, and pipefail gives the
    # rank's status.
    { RANK=$rank LOCAL_RANK=$rank WORLD_SIZE=$world MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
        timeout "$limit" "$program" "$@" 2>&1 1>&3 | tee "$logs/rank$rank.err" >&2; } 3>&1 &
    pids+=($!)
  done
  for rank in "${!pids[@]}"; do
    wait "${pids[$rank]}"
    status=$?
    if [ "$status" -ne 0 ]; then
      echo "[ ranks    ] rank $rank exited with $status" >&2
      failed=1
      if [ "$rank" -eq 0 ] && port_taken; then
        for ((other = 1; other < world; ++other)); do end_rank "${pids[$other]}"; done
      fi
    fi
  done
  return $failed
}

for try in 1 2 3; do
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  launch "$port" "$@" && exit 0
  port_taken || exit 1
  echo "[ ranks    ] port $port was taken before rank 0 bound it (try $try of 3): again on another port" >&2
done
exit 1
