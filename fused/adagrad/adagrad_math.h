#pragma once
// The Adagrad update (Duchi et al. 2011), written once for the CPU kernel
// (fp32 lane blocks), the CUDA kernel (one float per thread) and the tests.
// No LibTorch here.
//
// LibTorch's torch::optim::Adagrad order of operations, step being the
// count after this step (so that the first step decays by nothing):
//   clr = lr / (1 + (step - 1) * lr_decay)                  (fp64, per tensor)
//   g   = maximize ? -g : g;  g = g + wd * p
//   sum = sum + g * g
//   p   = p + ((-clr) * g) / (sqrt(sum) + eps)            (addcdiv's order)

#include "ampfuse/config.h"
#include "ampfuse/multi_tensor.h"
#include "ampfuse/sdk/math.h"

namespace ampfuse::fused {

/// FusedAdagrad's tensor lists, numbered once for the CPU kernel, the CUDA
/// kernel and the adapter. The CPU kernel takes the first kAdagradCpuLists
/// (its step counters are LibTorch's host integers); the CUDA kernel also
/// reads the device step counters (fp64, one element each).
enum class AdagradList : int { kParam, kGrad, kSum, kStep };
constexpr int kAdagradCpuLists = 3;
constexpr int kAdagradLists = 4;

/// Hyperparameters of one parameter group in opmath type T (made in double,
/// narrowed by a kernel with as<T>(), see AdamHyperT).
template <class T>
struct AdagradHyperT {
  T weight_decay = T(0);
  T eps = T(1e-10);
  bool maximize = false;
  double lr = 1e-2;  ///< for clr, computed in fp64 per tensor and step
  double lr_decay = 0.0;

  template <class U>
  AMPFUSE_HOST_DEVICE AdagradHyperT<U> as() const {
    return {static_cast<U>(weight_decay), static_cast<U>(eps), maximize, lr, lr_decay};
  }
};
using AdagradHyper = AdagradHyperT<double>;

inline AdagradHyper make_adagrad_hyper(double lr, double lr_decay, double weight_decay, double eps, bool maximize) {
  AdagradHyper h;
  h.weight_decay = weight_decay;
  h.eps = eps;
  h.maximize = maximize;
  h.lr = lr;
  h.lr_decay = lr_decay;
  return h;
}

/// -clr for the step numbered `step` (1 for the first), in fp64 as LibTorch
/// (a kernel rounds it to its opmath).
template <class T>
AMPFUSE_HOST_DEVICE double adagrad_neg_clr(const AdagradHyperT<T>& h, double step) {
  return -(h.lr / (1.0 + (step - 1.0) * h.lr_decay));
}

/// One element (or one block of lanes): p and sum in place, g already
/// multiplied by the scaler's inv_scale * clip_coef.
template <class V, class Ops, class T>
AMPFUSE_HOST_DEVICE void adagrad_update(V& p, V g, V& sum, T neg_clr, const AdagradHyperT<T>& h) {
  if (h.maximize) g = -g;
  if (h.weight_decay != T(0)) g = g + Ops::splat(h.weight_decay) * p;
  sum = sum + g * g;
  p = p + (Ops::splat(neg_clr) * g) / (Ops::sqrt(sum) + Ops::splat(h.eps));
}

}  // namespace ampfuse::fused
