#pragma once
// The Adam / AdamW update, written once for the CPU kernel (fp32 lane
// blocks), the CUDA kernel (one float per thread) and the tests' reference.
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

/// FusedAdam's tensor lists, numbered once for the CPU kernel, the CUDA
/// kernel and the adapter. The CPU kernel takes the first kAdamCpuLists (its
/// step counters are LibTorch's host integers); the CUDA kernel takes all of
/// them, the device step counters (fp64, one element each) last. A list a
/// configuration does not use holds null pointers.
enum class AdamList : int { kParam, kGrad, kExpAvg, kExpAvgSq, kMaxExpAvgSq, kMaster, kStep };
constexpr int kAdamCpuLists = 6;
constexpr int kAdamLists = 7;

/// Hyperparameters of one parameter group, by name (swapping two does not compile silently).
struct AdamHyper {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.f;
  float one_minus_beta1 = 0.1f;       ///< 1 - beta1, rounded once from fp64 as LibTorch does
  float one_minus_beta2 = 0.001f;
  float decay_factor = 1.f;           ///< AdamW: 1 - lr * weight_decay, from fp64
  bool amsgrad = false;
  bool maximize = false;
  bool decoupled_weight_decay = false;  ///< AdamW
};

/// Per tensor and step: -lr / bc1 and sqrt(bc2), in fp64 then rounded, as LibTorch.
struct AdamStepScalars {
  float neg_step_size;
  float bias_correction2_sqrt;
};

AMPFUSE_HOST_DEVICE AdamStepScalars adam_step_scalars(double lr, double beta1, double beta2, double step) {
#if defined(__CUDA_ARCH__)
  const double bc1 = 1.0 - pow(beta1, step), bc2 = 1.0 - pow(beta2, step);
  return {static_cast<float>(-(lr / bc1)), static_cast<float>(sqrt(bc2))};
#else
  const double bc1 = 1.0 - std::pow(beta1, step), bc2 = 1.0 - std::pow(beta2, step);
  return {static_cast<float>(-(lr / bc1)), static_cast<float>(std::sqrt(bc2))};
#endif
}

/// Element math on V (float, or a block of fp32 lanes on the CPU). Ops
/// supplies sqrt, max and splat for V.
template <class V, class Ops>
AMPFUSE_HOST_DEVICE void adam_update(V& p, V g, V& m, V& v, V* vmax, const AdamHyper& h, const AdamStepScalars& s) {
  if (h.maximize) g = -g;
  if (h.weight_decay != 0.f) {
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
  const V denom = Ops::sqrt(second) / Ops::splat(s.bias_correction2_sqrt) + Ops::splat(h.eps);
  p = p + Ops::splat(s.neg_step_size) * (m / denom);
}

/// Hyperparameters from LibTorch's options (doubles), rounded as LibTorch rounds them.
inline AdamHyper make_adam_hyper(double lr, double beta1, double beta2, double eps, double weight_decay,
                                 bool amsgrad, bool maximize, bool decoupled) {
  AdamHyper h;
  h.lr = static_cast<float>(lr);
  h.beta1 = static_cast<float>(beta1);
  h.beta2 = static_cast<float>(beta2);
  h.eps = static_cast<float>(eps);
  h.weight_decay = static_cast<float>(weight_decay);
  h.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  h.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  h.decay_factor = static_cast<float>(1.0 - lr * weight_decay);
  h.amsgrad = amsgrad;
  h.maximize = maximize;
  h.decoupled_weight_decay = decoupled;
  return h;
}

}  // namespace ampfuse::fused
