#pragma once
// The LAMB update, written once for the CPU kernels (fp32 lane blocks), the
// CUDA kernels (one float per thread) and the tests. No LibTorch here.
//
// LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning:
// Training BERT in 76 minutes", Algorithm 2) as NVIDIA apex's FusedLAMB
// computes it (adam_w_mode, the decoupled weight decay):
//   g = g * grad_factor * clip            (unscale, scaler clip, max_grad_norm clip)
//   m = beta1 * m + beta3 * g             (beta3 = 1 - beta1 with grad_averaging, else 1)
//   v = beta2 * v + (1 - beta2) * g * g
//   u = (m / bc1) / (sqrt(v / bc2) + eps) + weight_decay * p
//   p = p - lr * ratio * u
// with bc1 = 1 - beta1^step, bc2 = 1 - beta2^step (1 without bias_correction)
// and the per-tensor trust ratio ratio = ||p|| / ||u|| (1 when either norm
// is 0), applied where weight_decay != 0 or use_nvlamb is set (apex), and
// clamped to [trust_ratio_min, trust_ratio_max] (DeepSpeed clamps to
// [0.01, 10]). The ratio needs ||u|| over the whole tensor before any of p
// is written: hence two passes, the first writing m and v and reducing the
// norms, the second recomputing u from the new m and v and writing p.

#include <cmath>

#include "ampfuse/config.h"
#include "ampfuse/multi_tensor.h"
#include "ampfuse/sdk/math.h"

namespace ampfuse::fused {

/// FusedLAMB's tensor lists, numbered once for the CPU kernels, the CUDA
/// kernels and the adapter. The CPU kernels take the first kLambCpuLists
/// (their step counters are read on the host); the CUDA kernels take all of
/// them, the fp64 step counters last. kMaster holds null pointers without
/// master weights.
enum class LambList : int { kParam, kGrad, kExpAvg, kExpAvgSq, kMaster, kStep };
constexpr int kLambCpuLists = 5;
constexpr int kLambLists = 6;

struct LambHyper {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float beta3 = 0.1f;            ///< weight of the new gradient in m: 1 - beta1, or 1 without grad_averaging
  float one_minus_beta2 = 0.001f;
  float eps = 1e-6f;
  float weight_decay = 0.01f;
  bool bias_correction = true;
  bool use_trust_ratio = true;   ///< weight_decay != 0 or use_nvlamb
  float trust_ratio_min = 0.f;
  float trust_ratio_max = INFINITY;
  float max_grad_norm = 0.f;     ///< clip by the global norm of the unscaled grads; 0: off
  /// The betas as given (fp64), for the bias corrections: 1 - beta2^step from
  /// an fp32-rounded beta2 = 0.999 is off by up to ~1e-4 relative in the
  /// first steps, a bias of the whole update that apex (which computes the
  /// corrections on the host in double) does not have.
  double beta1_f64 = 0.9;
  double beta2_f64 = 0.999;
};

/// Per tensor and step: the bias corrections, in fp64 then rounded.
struct LambStepScalars {
  float bias_correction1;
  float bias_correction2;
};

AMPFUSE_HOST_DEVICE LambStepScalars lamb_step_scalars(const LambHyper& h, double step) {
  if (!h.bias_correction) return {1.f, 1.f};
#if defined(__CUDA_ARCH__)
  return {static_cast<float>(1.0 - pow(h.beta1_f64, step)), static_cast<float>(1.0 - pow(h.beta2_f64, step))};
#else
  return {static_cast<float>(1.0 - std::pow(h.beta1_f64, step)), static_cast<float>(1.0 - std::pow(h.beta2_f64, step))};
#endif
}

/// The factor max_grad_norm applies, given the global norm of the unscaled
/// grads (apex divides by norm / max_grad_norm when the norm exceeds it).
AMPFUSE_HOST_DEVICE float lamb_clip_factor(const LambHyper& h, float global_norm) {
  return h.max_grad_norm > 0.f && global_norm > h.max_grad_norm ? h.max_grad_norm / global_norm : 1.f;
}

/// First pass: the moments.
template <class V, class Ops>
AMPFUSE_HOST_DEVICE void lamb_moments(V g, V& m, V& v, const LambHyper& h) {
  m = m * Ops::splat(h.beta1) + Ops::splat(h.beta3) * g;
  v = v * Ops::splat(h.beta2) + (Ops::splat(h.one_minus_beta2) * g) * g;
}

/// The update direction u from the new moments (both passes compute it the same way).
template <class V, class Ops>
AMPFUSE_HOST_DEVICE V lamb_direction(V p, V m, V v, const LambHyper& h, const LambStepScalars& s) {
  const V denom = Ops::sqrt(v / Ops::splat(s.bias_correction2)) + Ops::splat(h.eps);
  return (m / Ops::splat(s.bias_correction1)) / denom + Ops::splat(h.weight_decay) * p;
}

/// Second pass: p - lr * ratio * u, with neg_step = -(lr * ratio).
template <class V, class Ops>
AMPFUSE_HOST_DEVICE void lamb_apply(V& p, V u, float neg_step) {
  p = p + Ops::splat(neg_step) * u;
}

/// -(lr * ratio) from the tensor's norms (computed in fp64 or fp32, passed as float).
AMPFUSE_HOST_DEVICE float lamb_neg_step(const LambHyper& h, float param_norm, float update_norm) {
  float ratio = 1.f;
  if (h.use_trust_ratio) {
    if (param_norm > 0.f && update_norm > 0.f) ratio = param_norm / update_norm;
    ratio = ratio < h.trust_ratio_min ? h.trust_ratio_min : ratio;
    ratio = ratio > h.trust_ratio_max ? h.trust_ratio_max : ratio;
  }
  return -(h.lr * ratio);
}

}  // namespace ampfuse::fused
