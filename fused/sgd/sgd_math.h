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

struct SgdHyper {
  float neg_lr = -1e-2f;
  float momentum = 0.f;
  float one_minus_dampening = 1.f;  ///< 1 - dampening, rounded once from fp64
  float weight_decay = 0.f;
  bool nesterov = false;
  bool maximize = false;
};

inline SgdHyper make_sgd_hyper(double lr, double momentum, double dampening, double weight_decay, bool nesterov,
                               bool maximize) {
  SgdHyper h;
  h.neg_lr = static_cast<float>(-1 * lr);
  h.momentum = static_cast<float>(momentum);
  h.one_minus_dampening = static_cast<float>(1 - dampening);
  h.weight_decay = static_cast<float>(weight_decay);
  h.nesterov = nesterov;
  h.maximize = maximize;
  return h;
}

/// buf is ignored when momentum is 0. first: the buffer is created by this
/// step (the first one applied), as a copy of the gradient.
template <class V, class Ops>
AMPFUSE_HOST_DEVICE void sgd_update(V& p, V g, V* buf, bool first, const SgdHyper& h) {
  if (h.maximize) g = -g;
  if (h.weight_decay != 0.f) g = g + Ops::splat(h.weight_decay) * p;
  if (h.momentum != 0.f) {
    *buf = first ? g : *buf * Ops::splat(h.momentum) + Ops::splat(h.one_minus_dampening) * g;
    g = h.nesterov ? g + Ops::splat(h.momentum) * *buf : *buf;
  }
  p = p + Ops::splat(h.neg_lr) * g;
}

}  // namespace ampfuse::fused
