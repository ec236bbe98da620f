#pragma once
// The LAMB update, written once for the CPU kernels (fp32 or fp64 lane
// blocks), the CUDA kernels (one float or double per thread) and the tests.
// No LibTorch here. State is fp32 (apex), fp64 for fp64 parameters.
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

/// Hyperparameters in opmath type T (made in double on the host, narrowed
/// by a kernel with as<T>(), see AdamHyperT).
template <class T>
struct LambHyperT {
  T lr = T(1e-3);
  T beta1 = T(0.9);
  T beta2 = T(0.999);
  T beta3 = T(0.1);              ///< weight of the new gradient in m: 1 - beta1, or 1 without grad_averaging
  T one_minus_beta2 = T(0.001);
  T eps = T(1e-6);
  T weight_decay = T(0.01);
  bool bias_correction = true;
  bool use_trust_ratio = true;   ///< weight_decay != 0 or use_nvlamb
  T trust_ratio_min = T(0);
  T trust_ratio_max = T(INFINITY);
  T max_grad_norm = T(0);        ///< clip by the global norm of the unscaled grads; 0: off
  /// The betas as given (fp64), for the bias corrections: 1 - beta2^step from
  /// an fp32-rounded beta2 = 0.999 is off by up to ~1e-4 relative in the
  /// first steps, a bias of the whole update that apex (which computes the
  /// corrections on the host in double) does not have.
  double beta1_f64 = 0.9;
  double beta2_f64 = 0.999;

  template <class U>
  AMPFUSE_HOST_DEVICE LambHyperT<U> as() const {
    return {static_cast<U>(lr),           static_cast<U>(beta1),           static_cast<U>(beta2),
            static_cast<U>(beta3),        static_cast<U>(one_minus_beta2), static_cast<U>(eps),
            static_cast<U>(weight_decay), bias_correction,                 use_trust_ratio,
            static_cast<U>(trust_ratio_min), static_cast<U>(trust_ratio_max), static_cast<U>(max_grad_norm),
            beta1_f64,                    beta2_f64};
  }
};
using LambHyper = LambHyperT<double>;

/// Per tensor and step: the bias corrections, in fp64 then rounded to T.
template <class T>
struct LambStepScalarsT {
  T bias_correction1;
  T bias_correction2;

  template <class U>
  AMPFUSE_HOST_DEVICE LambStepScalarsT<U> as() const {
    return {static_cast<U>(bias_correction1), static_cast<U>(bias_correction2)};
  }
};
using LambStepScalars = LambStepScalarsT<double>;

template <class T, class H>
AMPFUSE_HOST_DEVICE LambStepScalarsT<T> lamb_step_scalars(const H& h, double step) {
  if (!h.bias_correction) return {T(1), T(1)};
#if defined(__CUDA_ARCH__)
  return {static_cast<T>(1.0 - pow(h.beta1_f64, step)), static_cast<T>(1.0 - pow(h.beta2_f64, step))};
#else
  return {static_cast<T>(1.0 - std::pow(h.beta1_f64, step)), static_cast<T>(1.0 - std::pow(h.beta2_f64, step))};
#endif
}

/// The factor max_grad_norm applies, given the global norm of the unscaled
/// grads (apex divides by norm / max_grad_norm when the norm exceeds it).
template <class T>
AMPFUSE_HOST_DEVICE T lamb_clip_factor(const LambHyperT<T>& h, T global_norm) {
  return h.max_grad_norm > T(0) && global_norm > h.max_grad_norm ? h.max_grad_norm / global_norm : T(1);
}

/// What LAMB's grads are multiplied by, in double (the kernels apply it as
/// sdk::ScalarGradFactor<T> / sdk::cpu::GradFactor: rounded once to T):
/// grad_factor (inv_scale * clip_coef, exact in double) rounded to T, times
/// the max_grad_norm factor of the global norm of the unscaled grads, where
/// grad_sum_sq (the scaled grads' sum of squares; null: no max_grad_norm
/// pass) gives it: that norm is unscaled in double and rounded once (the
/// scaled norm alone overflows fp32 under a large scale: above 2 at 2^127).
/// A float grad_factor below 2^-126 (sdk::grad_factor_is_split) stays in
/// double, where fp32 would keep fewer than 24 bits.
template <class T>
AMPFUSE_HOST_DEVICE double lamb_total_grad_factor(const LambHyperT<T>& h, double grad_factor,
                                                  const double* grad_sum_sq) {
  const bool split = sizeof(T) == sizeof(float) && sdk::grad_factor_is_split(grad_factor);
  const double factor = split ? grad_factor : static_cast<double>(static_cast<T>(grad_factor));
  if (grad_sum_sq == nullptr) return factor;
  const T global_norm = static_cast<T>(sdk::ScalarOpsT<double>::sqrt(*grad_sum_sq) * factor);
  return factor * static_cast<double>(lamb_clip_factor(h, global_norm));
}

/// First pass: the moments.
template <class V, class Ops, class T>
AMPFUSE_HOST_DEVICE void lamb_moments(V g, V& m, V& v, const LambHyperT<T>& h) {
  m = m * Ops::splat(h.beta1) + Ops::splat(h.beta3) * g;
  v = v * Ops::splat(h.beta2) + (Ops::splat(h.one_minus_beta2) * g) * g;
}

/// The update direction u from the new moments (both passes compute it the same way).
template <class V, class Ops, class T>
AMPFUSE_HOST_DEVICE V lamb_direction(V p, V m, V v, const LambHyperT<T>& h, const LambStepScalarsT<T>& s) {
  const V denom = Ops::sqrt(v / Ops::splat(s.bias_correction2)) + Ops::splat(h.eps);
  return (m / Ops::splat(s.bias_correction1)) / denom + Ops::splat(h.weight_decay) * p;
}

/// Second pass: p - lr * ratio * u, with neg_step = -(lr * ratio).
template <class V, class Ops, class T>
AMPFUSE_HOST_DEVICE void lamb_apply(V& p, V u, T neg_step) {
  p = p + Ops::splat(neg_step) * u;
}

/// -(lr * ratio) from the tensor's norms (summed in fp64, rounded to T).
template <class T>
AMPFUSE_HOST_DEVICE T lamb_neg_step(const LambHyperT<T>& h, T param_norm, T update_norm) {
  T ratio = T(1);
  if (h.use_trust_ratio) {
    if (param_norm > T(0) && update_norm > T(0)) ratio = param_norm / update_norm;
    ratio = ratio < h.trust_ratio_min ? h.trust_ratio_min : ratio;
    ratio = ratio > h.trust_ratio_max ? h.trust_ratio_max : ratio;
  }
  return -(h.lr * ratio);
}

}  // namespace ampfuse::fused
