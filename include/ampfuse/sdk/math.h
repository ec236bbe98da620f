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

/// Whether a grad factor f (inv_scale * clip_coef, in double) is applied to
/// fp32 grads as two factors: f is not 0 and |f| is below 2^-126, where fp32
/// is subnormal (an inverse scale of 2^127, which GradScaler reaches when no
/// grad overflows for long enough, times a clip coefficient; or 2^-127
/// itself). There fl32(f) keeps fewer than 24 significant bits, and reads as
/// 0 where subnormals are flushed (CPU kernels). NaN compares false.
AMPFUSE_HOST_DEVICE constexpr bool grad_factor_is_split(double f) {
  return f != 0.0 && (f < 0.0 ? -f : f) < 0x1p-126;
}

/// Grads times a factor f given in double, in opmath T, with T's full
/// precision: f rounded once to T, and for T = float and an f below 2^-126
/// (grad_factor_is_split) applied as two normal factors, (g * fl(f * 2^64))
/// * 2^-64, rounded to 24 bits as a normal factor is. For an f that is an
/// fp32 value (an inverse scale alone), that is the bits of g * f wherever
/// g * f is normal (or flushed, as on CPU); a subnormal product, which CUDA
/// keeps, is rounded twice and can differ from fl32(g * f) by one subnormal
/// ulp (a loss scale above 2^126). Below
/// 2^-190 (a scale of 2^127 times a clip coefficient below 2^-63) fl(f *
/// 2^64) is subnormal in turn, and keeps fewer bits. The CPU
/// lanes' sdk::cpu::GradFactor computes the same, and CUDA kernels take it
/// from sdk::cuda::signal_factor.
///   const ScalarGradFactor<float> factor(f);  ...  g = factor(g);
template <class T>
struct ScalarGradFactor {
  T hi = T(1), lo = T(1);  ///< g * hi * lo; lo is 1 or 2^-64
  AMPFUSE_HOST_DEVICE explicit ScalarGradFactor(double f) {
    if (sizeof(T) == sizeof(float) && grad_factor_is_split(f)) {
      hi = static_cast<T>(f * 0x1p64);  // normal down to f = 2^-190 (smaller: 0)
      lo = static_cast<T>(0x1p-64);
    } else {
      hi = static_cast<T>(f);
    }
  }
  /// (g * hi) * lo: lo = 1 leaves g * hi as it is.
  AMPFUSE_HOST_DEVICE T operator()(T g) const { return (g * hi) * lo; }
};

}  // namespace ampfuse::sdk
