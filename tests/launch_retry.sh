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
# The first try's port: rank 0 records it and fails; the others of that try wait.
first="$MARKER"
if [ "$RANK" -eq 0 ] && [ ! -e "$first" ]; then
  echo "$MASTER_PORT" > "$first"
  echo "bind: address already in use" >&2
  exit 1
fi
for _ in $(seq 50); do [ -e "$first" ] && break; sleep 0.1; done
if [ "$(cat "$first")" = "$MASTER_PORT" ]; then exec sleep 1000; fi
echo "rank $RANK on port $MASTER_PORT"
RANK
chmod +x "$dir/rank"
MARKER="$dir/first_port" AMPFUSE_RANK_TIMEOUT=1000 \
  bash "$(dirname "${BASH_SOURCE[0]}")/../examples/train_ddp/launch.sh" 3 "$dir/rank"
