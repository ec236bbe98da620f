#pragma once
// The element operations an optimizer's update is written against, so that
// one formula serves every backend: write the update once as
//
//   template <class V, class Ops>
//   AMPFUSE_HOST_DEVICE void my_update(V& p, V g, V& m, const MyHyper& h);
//
// and call it with V = float, Ops = ScalarOps in CUDA kernels and test
// references, and with V = VecF, Ops = VecOps (ampfuse/sdk/cpu_kernel.h,
// kWidth fp32 lanes) in CPU kernels. Use +, -, *, / and unary - on V, and
// Ops for everything else; constants go through Ops::splat.
// No LibTorch here, so .cu files can include it.

#include <cmath>

#include "ampfuse/config.h"

namespace ampfuse::sdk {

/// Ops for plain floats (CUDA kernels, scalar references).
struct ScalarOps {
  static AMPFUSE_HOST_DEVICE float splat(float x) { return x; }
  static AMPFUSE_HOST_DEVICE float max(float a, float b) { return a > b ? a : b; }
  static AMPFUSE_HOST_DEVICE float min(float a, float b) { return a < b ? a : b; }
  /// -1, 0 or 1 (0 for +-0 and NaN), as torch.sign.
  static AMPFUSE_HOST_DEVICE float sign(float x) { return static_cast<float>((x > 0.f) - (x < 0.f)); }
  static AMPFUSE_HOST_DEVICE float sqrt(float x) {
#if defined(__CUDA_ARCH__)
    return ::sqrtf(x);
#else
    return std::sqrt(x);
#endif
  }
};

}  // namespace ampfuse::sdk
