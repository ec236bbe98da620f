#!/usr/bin/env bash
# Gathers GoogleTest/GoogleMock and Google Benchmark (headers, libraries,
# CMake packages) and Gloo's headers (for the distributed tests) from this machine's Debian packages into .gpu-deps/, for a
# GPU machine that has PyTorch but no network and no such packages.
# The tree mirrors /usr so that the packages' relocatable CMake files work.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dest="$root/.gpu-deps/usr"
rm -rf "$root/.gpu-deps"
mkdir -p "$dest/include" "$dest/lib/x86_64-linux-gnu/cmake"
cp -r /usr/include/gtest /usr/include/gmock /usr/include/benchmark /usr/include/gloo "$dest/include/"
cp -a /usr/lib/x86_64-linux-gnu/libgtest*.a /usr/lib/x86_64-linux-gnu/libgmock*.a \
      /usr/lib/x86_64-linux-gnu/libbenchmark* "$dest/lib/x86_64-linux-gnu/"
cp -r /usr/lib/x86_64-linux-gnu/cmake/GTest /usr/lib/x86_64-linux-gnu/cmake/benchmark \
      "$dest/lib/x86_64-linux-gnu/cmake/"
du -sh "$root/.gpu-deps"
