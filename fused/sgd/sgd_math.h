#pragma once
// The SGD (momentum, dampening, Nesterov, weight decay) update, written once
// for the CPU kernel, the CUDA kernel and the tests. No LibTorch here.
//
// LibTorch's torch::optim::SGD order of operations (Sutskever et al. 2013 for
// the Nesterov form PyTorch uses):
//   g = maximize ? -g : g;  g = g + wd * p
//   buf = first ? g : buf * momentum + (1 - dampening) * g     (momentum != 0)
//   g = nesterov ? g + momentum * buf : buf
//   p = p + (-lr) * g

#include "ampfuse/config.h"
#include "ampfuse/sdk/math.h"

namespace ampfuse::fused {

using sdk::ScalarOps;
using sdk::ScalarOpsT;

/// In opmath type T; made in double as LibTorch computes them, narrowed by a
/// kernel with as<T>() (see AdamHyperT).
template <class T>
struct SgdHyperT {
  T neg_lr = T(-1e-2);
  T momentum = T(0);
  T one_minus_dampening = T(1);  ///< 1 - dampening
  T weight_decay = T(0);
  bool nesterov = false;
  bool maximize = false;
  /// momentum != 0 in double, as LibTorch decides it: a momentum that
  /// narrows to 0 in T still keeps (and fills) the buffer.
  bool use_momentum = false;

  template <class U>
  AMPFUSE_HOST_DEVICE SgdHyperT<U> as() const {
    return {static_cast<U>(neg_lr), static_cast<U>(momentum), static_cast<U>(one_minus_dampening),
            static_cast<U>(weight_decay), nesterov, maximize, use_momentum};
  }
};
using SgdHyper = SgdHyperT<double>;

inline SgdHyper make_sgd_hyper(double lr, double momentum, double dampening, double weight_decay, bool nesterov,
                               bool maximize) {
  SgdHyper h;
  h.neg_lr = -1 * lr;
  h.momentum = momentum;
  h.use_momentum = momentum != 0;
  h.one_minus_dampening = 1 - dampening;
  h.weight_decay = weight_decay;
  h.nesterov = nesterov;
  h.maximize = maximize;
  return h;
}

template <class V, class Ops, class T>
AMPFUSE_HOST_DEVICE void sgd_update(V& p, V g, V* buf, bool first, const SgdHyperT<T>& h) {
  if (h.maximize) g = -g;
  if (h.weight_decay != T(0)) g = g + Ops::splat(h.weight_decay) * p;
  if (h.use_momentum) {
    *buf = first ? g : *buf * Ops::splat(h.momentum) + Ops::splat(h.one_minus_dampening) * g;
    g = h.nesterov ? g + Ops::splat(h.momentum) * *buf : *buf;
  }
  p = p + Ops::splat(h.neg_lr) * g;
}

}  // namespace ampfuse::fused
