#pragma once
// Lion's update (Chen et al. 2023, "Symbolic Discovery of Optimization
// Algorithms", Algorithm 2: decoupled weight decay), written once. The CPU
// kernel calls it with V = VecF (kWidth fp32 lanes), the CUDA kernel and the
// tests with V = float. No LibTorch here: .cu and CPU kernel files include it.
//
//   c = beta1 * m + (1 - beta1) * g
//   p = p * (1 - lr * weight_decay) - lr * sign(c)
//   m = beta2 * m + (1 - beta2) * g

#include <ampfuse/config.h>    // AMPFUSE_HOST_DEVICE
#include <ampfuse/sdk/math.h>  // ampfuse::sdk::ScalarOps

namespace lion {

/// The hyperparameters in fp32, each rounded once from the fp64 options.
struct LionHyper {
  float lr = 1e-4f;
  float decay = 1.f;  ///< 1 - lr * weight_decay
  float beta1 = 0.9f, one_minus_beta1 = 0.1f;
  float beta2 = 0.99f, one_minus_beta2 = 0.01f;
};

inline LionHyper make_lion_hyper(double lr, double beta1, double beta2, double weight_decay) {
  LionHyper h;
  h.lr = static_cast<float>(lr);
  h.decay = static_cast<float>(1 - lr * weight_decay);
  h.beta1 = static_cast<float>(beta1);
  h.one_minus_beta1 = static_cast<float>(1 - beta1);
  h.beta2 = static_cast<float>(beta2);
  h.one_minus_beta2 = static_cast<float>(1 - beta2);
  return h;
}

/// One element (or one block of lanes): p and m in place, g already
/// multiplied by the scaler's inv_scale * clip_coef.
template <class V, class Ops>
AMPFUSE_HOST_DEVICE void lion_update(V& p, V g, V& m, const LionHyper& h) {
  const V c = Ops::splat(h.beta1) * m + Ops::splat(h.one_minus_beta1) * g;
  p = p * Ops::splat(h.decay) - Ops::splat(h.lr) * Ops::sign(c);
  m = Ops::splat(h.beta2) * m + Ops::splat(h.one_minus_beta2) * g;
}

}  // namespace lion
