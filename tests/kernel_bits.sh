#!/usr/bin/env bash
# kernel_bits.sh NATIVE                 every instruction set NATIVE runs gives the
#                                       baseline's "exact" lines (kernel_bits.cpp)
# kernel_bits.sh NATIVE RUNNER... CROSS  CROSS (run by RUNNER, e.g. qemu-aarch64-static)
#                                       gives every line of NATIVE's baseline
set -euo pipefail
native=$1
shift
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$native" baseline >"$dir/baseline"
cases=$(wc -l <"$dir/baseline")
[ "$cases" -gt 100 ] || { echo "kernel_bits: only $cases cases from the baseline"; exit 1; }
if [ $# -eq 0 ]; then
  grep '^exact ' "$dir/baseline" >"$dir/want"
  for isa in $("$native" --isas); do
    "$native" "$isa" | grep '^exact ' >"$dir/$isa"
    if ! diff "$dir/want" "$dir/$isa" >"$dir/diff"; then
      echo "kernel_bits: $isa differs from the baseline:"
      cat "$dir/diff"
      exit 1
    fi
    echo "kernel_bits: $isa gives the baseline's $(wc -l <"$dir/want") element-wise results"
  done
else
  "$@" >"$dir/cross"
  if ! diff "$dir/baseline" "$dir/cross" >"$dir/diff"; then
    echo "kernel_bits: $* differs from the x86-64 baseline:"
    cat "$dir/diff"
    exit 1
  fi
  echo "kernel_bits: $* gives the x86-64 baseline's $cases results"
fi
