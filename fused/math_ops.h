#pragma once
// Element operations the optimizer math is written against: ScalarOps for
// plain floats (CUDA kernels, test references); the CPU kernels bring their
// own for blocks of fp32 lanes (contract/cpu/simd.inc).

#include <cmath>

#include "ampfuse/config.h"

namespace ampfuse::fused {

/// Ops for plain floats (CUDA kernel, test reference).
struct ScalarOps {
  static AMPFUSE_HOST_DEVICE float splat(float x) { return x; }
  static AMPFUSE_HOST_DEVICE float max(float a, float b) { return a > b ? a : b; }
  static AMPFUSE_HOST_DEVICE float sqrt(float x) {
#if defined(__CUDA_ARCH__)
    return ::sqrtf(x);
#else
    return std::sqrt(x);
#endif
  }
};

}  // namespace ampfuse::fused
