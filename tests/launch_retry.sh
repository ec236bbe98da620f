#!/usr/bin/env bash
# examples/train_ddp/launch.sh when rank 0's port is taken before it binds:
# a stand-in program whose rank 0 fails once with "address already in use"
# while the other ranks wait (as for a store that never comes) must have
# those ranks ended and the launch run again on another port, where every
# rank exits 0. The ranks' own timeout is set far past ctest's, so a launch
# that waits for them fails by ctest's TIMEOUT instead of passing late.
set -uo pipefail
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cat > "$dir/rank" <<'RANK'
#!/usr/bin/env bash
# The first try's port: rank 0 records it (written whole, then renamed) and
# fails; the other ranks of that try wait. (A second try given the same port
# would wait too, and the test time out: one chance in tens of thousands.)
first="$MARKER"
if [ "$RANK" -eq 0 ] && [ ! -e "$first" ]; then
  echo "$MASTER_PORT" > "$first.tmp" && mv "$first.tmp" "$first"
  echo "bind: address already in use" >&2
  exit 1
fi
until [ -e "$first" ]; do sleep 0.05; done
if [ "$(cat "$first")" = "$MASTER_PORT" ]; then exec sleep 1000; fi
echo "rank $RANK on port $MASTER_PORT"
RANK
chmod +x "$dir/rank"
out=$(MARKER="$dir/first_port" AMPFUSE_RANK_TIMEOUT=1000 \
      bash "$(dirname "${BASH_SOURCE[0]}")/../examples/train_ddp/launch.sh" 3 "$dir/rank" 2>&1)
status=$?
echo "$out"
[ "$status" -eq 0 ] || { echo "FAIL: launch.sh exited with $status" >&2; exit 1; }
for expected in "was taken before rank 0 bound it (try 1 of 3)" "rank 1 exited with" "rank 2 exited with" \
                "rank 0 on port" "rank 1 on port" "rank 2 on port"; do
  grep -qF "$expected" <<< "$out" || { echo "FAIL: no '$expected' in launch.sh's output" >&2; exit 1; }
done
echo "launch_retry: the first try's ranks were ended and the second try passed"
