#pragma once
// The RMSprop update (Hinton's lecture 6e; Graves 2013 for the centered
// form), written once for the CPU kernel (fp32 lane blocks), the CUDA kernel
// (one float per thread) and the tests. No LibTorch here.
//
// LibTorch's torch::optim::RMSprop order of operations:
//   g  = maximize ? -g : g;  g = g + wd * p
//   sa = sa * alpha + ((1 - alpha) * g) * g
//   ga = ga * alpha + (1 - alpha) * g                       (centered)
//   avg = sqrt(centered ? sa + (-ga) * ga : sa) + eps
//   buf = buf * momentum + g / avg;  p = p + (-lr) * buf     (momentum > 0)
//   p = p + ((-lr) * g) / avg                                (otherwise; addcdiv's order)

#include "ampfuse/config.h"
#include "ampfuse/multi_tensor.h"
#include "ampfuse/sdk/math.h"

namespace ampfuse::fused {

/// FusedRMSprop's tensor lists, numbered once for the CPU kernel, the CUDA
/// kernel and the adapter; a list the options do not use holds null pointers.
enum class RmspropList : int { kParam, kGrad, kSquareAvg, kMomentumBuffer, kGradAvg };
constexpr int kRmspropLists = 5;

/// Hyperparameters of one parameter group in opmath type T (made in double,
/// narrowed by a kernel with as<T>(), see AdamHyperT).
template <class T>
struct RmspropHyperT {
  T neg_lr = T(-1e-2);
  T alpha = T(0.99);
  T one_minus_alpha = T(0.01);
  T eps = T(1e-8);
  T weight_decay = T(0);
  T momentum = T(0);
  bool use_momentum = false;  ///< momentum > 0, decided on the fp64 option (LibTorch's test)
  bool centered = false;
  bool maximize = false;

  template <class U>
  AMPFUSE_HOST_DEVICE RmspropHyperT<U> as() const {
    return {static_cast<U>(neg_lr), static_cast<U>(alpha), static_cast<U>(one_minus_alpha), static_cast<U>(eps),
            static_cast<U>(weight_decay), static_cast<U>(momentum), use_momentum, centered, maximize};
  }
};
using RmspropHyper = RmspropHyperT<double>;

inline RmspropHyper make_rmsprop_hyper(double lr, double alpha, double eps, double weight_decay, double momentum,
                                       bool centered, bool maximize) {
  RmspropHyper h;
  h.neg_lr = -lr;
  h.alpha = alpha;
  h.one_minus_alpha = 1 - alpha;
  h.eps = eps;
  h.weight_decay = weight_decay;
  h.momentum = momentum;
  h.use_momentum = momentum > 0;
  h.centered = centered;
  h.maximize = maximize;
  return h;
}

/// One element (or one block of lanes): p and the state in place, g already
/// multiplied by the scaler's inv_scale * clip_coef. buf is read only with
/// use_momentum, grad_avg only when centered.
template <class V, class Ops, class T>
AMPFUSE_HOST_DEVICE void rmsprop_update(V& p, V g, V& square_avg, V* buf, V* grad_avg, const RmspropHyperT<T>& h) {
  if (h.maximize) g = -g;
  if (h.weight_decay != T(0)) g = g + Ops::splat(h.weight_decay) * p;
  square_avg = square_avg * Ops::splat(h.alpha) + (Ops::splat(h.one_minus_alpha) * g) * g;
  V second = square_avg;
  if (h.centered) {
    *grad_avg = *grad_avg * Ops::splat(h.alpha) + Ops::splat(h.one_minus_alpha) * g;
    second = square_avg + (-*grad_avg) * *grad_avg;
  }
  const V avg = Ops::sqrt(second) + Ops::splat(h.eps);
  if (h.use_momentum) {
    *buf = *buf * Ops::splat(h.momentum) + g / avg;
    p = p + Ops::splat(h.neg_lr) * *buf;
  } else {
    p = p + (Ops::splat(h.neg_lr) * g) / avg;
  }
}

}  // namespace ampfuse::fused
