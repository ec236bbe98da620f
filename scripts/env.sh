#!/usr/bin/env bash
# Shared set-up for scripts/test.sh and scripts/bench.sh: system packages, the
# LibTorch venv outside the checkout, and a configured build tree.
# Sourced, not run. Honours:
#   AMPFUSE_VENV      venv path (default ~/.cache/ampfuse/venv-torch-$AMPFUSE_TORCH_VERSION)
#   AMPFUSE_BUILD_DIR build tree (default <repo>/build)
#   Torch_DIR         a LibTorch of your own: no venv is made, torch is not installed
#   AMPFUSE_CUDA      AUTO|ON|OFF, passed to CMake (default AUTO)
set -euo pipefail

AMPFUSE_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
AMPFUSE_TORCH_VERSION=${AMPFUSE_TORCH_VERSION:-2.11.0}
AMPFUSE_VENV=${AMPFUSE_VENV:-$HOME/.cache/ampfuse/venv-torch-$AMPFUSE_TORCH_VERSION}
AMPFUSE_BUILD_DIR=${AMPFUSE_BUILD_DIR:-$AMPFUSE_ROOT/build}
export PATH=/usr/local/cuda/bin:$PATH

log() { printf '[ampfuse] %s\n' "$*" >&2; }

install_system_packages() {
  local missing=()
  dpkg -s libgtest-dev >/dev/null 2>&1 || missing+=(libgtest-dev)
  dpkg -s libgmock-dev >/dev/null 2>&1 || missing+=(libgmock-dev)
  dpkg -s libbenchmark-dev >/dev/null 2>&1 || missing+=(libbenchmark-dev)
  # Gloo's headers only (c10d::ProcessGroupGloo in the distributed tests; the wheel has its code).
  dpkg -s libgloo-dev >/dev/null 2>&1 || missing+=(libgloo-dev)
  dpkg -s ccache >/dev/null 2>&1 || missing+=(ccache)
  # A cross compiler and qemu's user-mode emulator, so that the tests build the baseline kernels'
  # NEON paths as AArch64 does and run them (tests/kernel_bits.cpp).
  if [ "$(uname -m)" = x86_64 ]; then
    dpkg -s g++-aarch64-linux-gnu >/dev/null 2>&1 || missing+=(g++-aarch64-linux-gnu)
    dpkg -s qemu-user-static >/dev/null 2>&1 || missing+=(qemu-user-static)
  fi
  command -v g++ >/dev/null 2>&1 || missing+=(g++)
  command -v python3 >/dev/null 2>&1 || missing+=(python3 python3-venv)
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]}"
    local sudo=""; [ "$(id -u)" -ne 0 ] && sudo=sudo
    $sudo apt-get update -q
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q "${missing[@]}"
  fi
}

# The venv holds torch (pinned), a CMake new enough for CUDA 13, and numpy +
# matplotlib for the benchmark plot. A stamp file makes a warm run skip pip.
ensure_venv() {
  local stamp="$AMPFUSE_VENV/.ampfuse-stamp"
  local want="torch==$AMPFUSE_TORCH_VERSION cmake==3.31.6 numpy matplotlib"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return; fi
  log "creating venv $AMPFUSE_VENV ($want)"
  mkdir -p "$(dirname "$AMPFUSE_VENV")"
  [ -x "$AMPFUSE_VENV/bin/python" ] || python3 -m venv "$AMPFUSE_VENV"
  "$AMPFUSE_VENV/bin/pip" install -q --disable-pip-version-check $want
  echo "$want" > "$stamp"
}

configure_build() {
  local build_type=${1:-Release}; shift || true
  local cmake=cmake prefix_args=()
  AMPFUSE_PREFIX_PATH=""
  if [ -n "${Torch_DIR:-}" ]; then
    prefix_args+=(-DTorch_DIR="$Torch_DIR")
    AMPFUSE_PREFIX_PATH="$Torch_DIR"
  else
    ensure_venv
    cmake="$AMPFUSE_VENV/bin/cmake"
    AMPFUSE_PREFIX_PATH=$("$AMPFUSE_VENV/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)')
    prefix_args+=(-DCMAKE_PREFIX_PATH="$AMPFUSE_PREFIX_PATH")
  fi
  local launcher=()
  if command -v ccache >/dev/null 2>&1; then
    # Precompiled headers and ccache: see the ccache manual, "Precompiled headers".
    export CCACHE_SLOPPINESS=${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}
    launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  fi
  AMPFUSE_LAUNCHER_ARGS="${launcher[*]:-}"
  local cuda_args=(-DAMPFUSE_CUDA="${AMPFUSE_CUDA:-AUTO}")
  [ -x /usr/local/cuda/bin/nvcc ] && cuda_args+=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
  "$cmake" -S "$AMPFUSE_ROOT" -B "$AMPFUSE_BUILD_DIR" -DCMAKE_BUILD_TYPE="$build_type" \
    "${prefix_args[@]}" "${launcher[@]}" "${cuda_args[@]}" "$@" >&2
  AMPFUSE_CMAKE=$cmake
  AMPFUSE_CTEST=$(dirname "$(command -v "$cmake")")/ctest
}

build() {
  "$AMPFUSE_CMAKE" --build "$AMPFUSE_BUILD_DIR" --parallel "${AMPFUSE_JOBS:-$(nproc)}" "$@"
}
