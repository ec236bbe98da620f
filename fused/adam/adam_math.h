#pragma once
// The Adam / AdamW update, written once for the CPU kernel (blocks of fp32
// or fp64 lanes), the CUDA kernel (one float or double per thread) and the
// tests' reference.
// No LibTorch here.
//
// The order of operations follows LibTorch's torch::optim::Adam / AdamW step
// (Kingma & Ba 2015, Algorithm 1; Loshchilov & Hutter 2019 for the decoupled
// weight decay), so that fp32 results agree to rounding:
//   g  = maximize ? -g : g;  g = g + wd * p                 (Adam, L2 penalty)
//   p  = p * (1 - lr * wd)                                    (AdamW, decoupled)
//   m  = m * beta1 + (1 - beta1) * g
//   v  = v * beta2 + ((1 - beta2) * g) * g
//   vmax = max(vmax, v)                                        (amsgrad)
//   p  = p + (-lr / bc1) * (m / (sqrt(v or vmax) / sqrt(bc2) + eps))
// with bc1 = 1 - beta1^step, bc2 = 1 - beta2^step for the step being taken.

#include <cmath>
#include <cstdint>

#include "ampfuse/config.h"
#include "ampfuse/multi_tensor.h"
#include "ampfuse/sdk/math.h"

namespace ampfuse::fused {

using sdk::ScalarOps;
using sdk::ScalarOpsT;

/// FusedAdam's tensor lists, numbered once for the CPU kernel, the CUDA
/// kernel and the adapter. The CPU kernel takes the first kAdamCpuLists (its
/// step counters are LibTorch's host integers); the CUDA kernel takes all of
/// them, the device step counters (fp64, one element each) last. A list a
/// configuration does not use holds null pointers.
enum class AdamList : int { kParam, kGrad, kExpAvg, kExpAvgSq, kMaxExpAvgSq, kMaster, kStep };
constexpr int kAdamCpuLists = 6;
constexpr int kAdamLists = 7;

/// Hyperparameters of one parameter group, by name (swapping two does not
/// compile silently), in opmath type T. The adapter makes them in double, as
/// LibTorch computes them; a kernel narrows them with as<T>() to the type it
/// computes in (float for fp32/fp16/bf16 storage: LibTorch rounds each once
/// from double too; double for fp64 storage).
template <class T>
struct AdamHyperT {
  T lr = T(1e-3);
  T beta1 = T(0.9);
  T beta2 = T(0.999);
  T eps = T(1e-8);
  T weight_decay = T(0);
  T one_minus_beta1 = T(0.1);  ///< 1 - beta1
  T one_minus_beta2 = T(0.001);
  T decay_factor = T(1);       ///< AdamW: 1 - lr * weight_decay
  bool amsgrad = false;
  bool maximize = false;
  bool decoupled_weight_decay = false;  ///< AdamW

  template <class U>
  AMPFUSE_HOST_DEVICE AdamHyperT<U> as() const {
    return {static_cast<U>(lr), static_cast<U>(beta1), static_cast<U>(beta2), static_cast<U>(eps),
            static_cast<U>(weight_decay), static_cast<U>(one_minus_beta1), static_cast<U>(one_minus_beta2),
            static_cast<U>(decay_factor), amsgrad, maximize, decoupled_weight_decay};
  }
};
using AdamHyper = AdamHyperT<double>;

/// Per tensor and step: -lr / bc1, sqrt(bc2) and 1 / sqrt(bc2), computed in
/// fp64 (the first two as LibTorch does), then rounded to T.
template <class T>
struct AdamStepScalarsT {
  T neg_step_size;
  T bias_correction2_sqrt;
  T inv_bias_correction2_sqrt;  ///< fp64 steps multiply by it (adam_update)

  template <class U>
  AMPFUSE_HOST_DEVICE AdamStepScalarsT<U> as() const {
    return {static_cast<U>(neg_step_size), static_cast<U>(bias_correction2_sqrt),
            static_cast<U>(inv_bias_correction2_sqrt)};
  }
};
using AdamStepScalars = AdamStepScalarsT<double>;

template <class T = double>
AMPFUSE_HOST_DEVICE AdamStepScalarsT<T> adam_step_scalars(double lr, double beta1, double beta2, double step) {
#if defined(__CUDA_ARCH__)
  const double bc1 = 1.0 - pow(beta1, step), bc2_sqrt = sqrt(1.0 - pow(beta2, step));
#else
  const double bc1 = 1.0 - std::pow(beta1, step), bc2_sqrt = std::sqrt(1.0 - std::pow(beta2, step));
#endif
  return {static_cast<T>(-(lr / bc1)), static_cast<T>(bc2_sqrt), static_cast<T>(1.0 / bc2_sqrt)};
}

/// Element math on V (float or double, or a block of lanes on the CPU) with
/// hyperparameters in its opmath type T. Ops supplies sqrt, max and splat for V.
template <class V, class Ops, class T>
AMPFUSE_HOST_DEVICE void adam_update(V& p, V g, V& m, V& v, V* vmax, const AdamHyperT<T>& h,
                                     const AdamStepScalarsT<T>& s) {
  if (h.maximize) g = -g;
  if (h.weight_decay != T(0)) {
    if (h.decoupled_weight_decay) p = p * Ops::splat(h.decay_factor);
    else g = g + Ops::splat(h.weight_decay) * p;
  }
  m = m * Ops::splat(h.beta1) + Ops::splat(h.one_minus_beta1) * g;
  v = v * Ops::splat(h.beta2) + (Ops::splat(h.one_minus_beta2) * g) * g;
  V second = v;
  if (h.amsgrad) {
    *vmax = Ops::max(*vmax, v);
    second = *vmax;
  }
  // fp64 multiplies by 1 / sqrt(bc2) where LibTorch divides by sqrt(bc2):
  // one division per element instead of two (the step is bound by the
  // divider there), about an ulp of fp64 off LibTorch's update. fp32 divides
  // as LibTorch does, and agrees with it to rounding.
  V denom;
  if constexpr (sizeof(T) == sizeof(double)) denom = Ops::sqrt(second) * Ops::splat(s.inv_bias_correction2_sqrt);
  else denom = Ops::sqrt(second) / Ops::splat(s.bias_correction2_sqrt);
  denom = denom + Ops::splat(h.eps);
  p = p + Ops::splat(s.neg_step_size) * (m / denom);
}

/// capturable: a group's lr read on the device, and what depends on it.
template <class T>
AMPFUSE_HOST_DEVICE void set_device_lr(AdamHyperT<T>& h, double lr, double weight_decay) {
  h.lr = static_cast<T>(lr);
  h.decay_factor = static_cast<T>(1.0 - lr * weight_decay);
}

/// Hyperparameters from LibTorch's options (doubles), computed as LibTorch computes them.
inline AdamHyper make_adam_hyper(double lr, double beta1, double beta2, double eps, double weight_decay,
                                 bool amsgrad, bool maximize, bool decoupled) {
  AdamHyper h;
  h.lr = lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.eps = eps;
  h.weight_decay = weight_decay;
  h.one_minus_beta1 = 1.0 - beta1;
  h.one_minus_beta2 = 1.0 - beta2;
  h.decay_factor = 1.0 - lr * weight_decay;
  h.amsgrad = amsgrad;
  h.maximize = maximize;
  h.decoupled_weight_decay = decoupled;
  return h;
}

}  // namespace ampfuse::fused
