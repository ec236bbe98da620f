#!/usr/bin/env bash
# The long randomized differential soak (tests/test_soak.cpp): N random
# configurations (default 5000) of every fused optimizer against its
# torch::optim twin. CI runs a short one (120) as part of scripts/test.sh.
# Needs a build (scripts/test.sh makes one). Replay a failing configuration
# with AMPFUSE_SOAK_CONFIG_SEED=<seed> scripts/soak.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
AMPFUSE_SOAK_CONFIGS="${1:-5000}" "$AMPFUSE_BUILD_DIR/tests/ampfuse_tests" --gtest_filter='Soak.*'
