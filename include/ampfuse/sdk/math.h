#pragma once
// The element operations an optimizer's update is written against, so that
// one formula serves every backend: write the update once as
//
//   template <class V, class Ops>
//   AMPFUSE_HOST_DEVICE void my_update(V& p, V g, V& m, const MyHyper& h);
//
// and call it with V = float, Ops = ScalarOps in CUDA kernels and test
// references, and with V = VecF, Ops = VecOps (ampfuse/sdk/cpu_kernel.h,
// kWidth fp32 lanes) in CPU kernels; for fp64 storage, V = double with
// ScalarOpsT<double>, or VecD with VecOpsD. Templating the hyperparameters
// on the opmath type too (MyHyper<T>) lets one formula serve both. Use +, -, *, / and unary - on V, and
// Ops for everything else; constants go through Ops::splat.
// No LibTorch here, so .cu files can include it.

#include <cmath>

#include "ampfuse/config.h"

namespace ampfuse::sdk {

/// Ops for plain scalars of type T (CUDA kernels, scalar references): T is
/// the opmath type, float for fp32/fp16/bf16 storage, double for fp64.
template <class T>
struct ScalarOpsT {
  static AMPFUSE_HOST_DEVICE T splat(T x) { return x; }
  static AMPFUSE_HOST_DEVICE T max(T a, T b) { return a > b ? a : b; }
  static AMPFUSE_HOST_DEVICE T min(T a, T b) { return a < b ? a : b; }
  /// -1, 0 or 1 (0 for +-0 and NaN), as torch.sign.
  static AMPFUSE_HOST_DEVICE T sign(T x) { return static_cast<T>((x > T(0)) - (x < T(0))); }
  static AMPFUSE_HOST_DEVICE T sqrt(T x) {
#if defined(__CUDA_ARCH__)
    if constexpr (sizeof(T) == sizeof(float)) return ::sqrtf(x);
    else return ::sqrt(x);
#else
    return std::sqrt(x);
#endif
  }
  /// a * b + c rounded once.
  static AMPFUSE_HOST_DEVICE T fma(T a, T b, T c) {
#if defined(__CUDA_ARCH__)
    if constexpr (sizeof(T) == sizeof(float)) return ::fmaf(a, b, c);
    else return ::fma(a, b, c);
#else
    return std::fma(a, b, c);
#endif
  }
};

/// Ops for plain floats.
using ScalarOps = ScalarOpsT<float>;

}  // namespace ampfuse::sdk
