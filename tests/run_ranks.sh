#!/usr/bin/env bash
# Starts N processes of a rank program (tests/dist_rank.cpp) on this machine
# as torchrun would (examples/train_ddp/launch.sh), all with one seed.
# Usage: run_ranks.sh <program> <N>
set -uo pipefail
seed=${AMPFUSE_TEST_SEED:-$(( (RANDOM << 15) | RANDOM ))}
echo "[ ranks    ] seed $seed (replay: AMPFUSE_TEST_SEED=$seed)"
AMPFUSE_TEST_SEED=$seed exec bash "$(dirname "${BASH_SOURCE[0]}")/../examples/train_ddp/launch.sh" "$2" "$1"
