// FusedLAMB against an unfused LibTorch LAMB (the same algorithm with
// _foreach ops and per-tensor norms: what a LibTorch user would write, as no
// LAMB ships with LibTorch) and LAMB's minimum traffic (the two-pass twin,
// 40 bytes per fp32 parameter).

#include <ampfuse/fused_lamb.h>
#include <ampfuse/tensor_ops.h>

#include <ATen/ATen.h>

#include "bench/ceilings.h"
#include "bench/common.h"

namespace ampfuse_bench {
namespace {

constexpr double kLr = 1e-3, kBeta1 = 0.9, kBeta2 = 0.999, kEps = 1e-6, kWeightDecay = 0.01;

// LAMB (apex semantics, bias correction, trust ratio on every tensor) with
// LibTorch ops; no host sync (the ratios stay on the device).
struct UnfusedLamb {
  std::vector<torch::Tensor> params, exp_avg, exp_avg_sq;
  std::int64_t step = 0;

  void operator()() {
    torch::NoGradGuard no_grad;
    ++step;
    std::vector<torch::Tensor> grads;
    for (const auto& p : params) grads.push_back(p.grad());
    const double bc1 = 1 - std::pow(kBeta1, step), bc2 = 1 - std::pow(kBeta2, step);
    at::_foreach_mul_(exp_avg, kBeta1);
    at::_foreach_add_(exp_avg, grads, 1 - kBeta1);
    at::_foreach_mul_(exp_avg_sq, kBeta2);
    at::_foreach_addcmul_(exp_avg_sq, grads, grads, 1 - kBeta2);
    auto denom = at::_foreach_div(exp_avg_sq, bc2);
    at::_foreach_sqrt_(denom);
    at::_foreach_add_(denom, kEps);
    auto update = at::_foreach_div(exp_avg, bc1);
    at::_foreach_div_(update, denom);
    at::_foreach_add_(update, params, kWeightDecay);
    const auto p_norms = at::_foreach_norm(params), u_norms = at::_foreach_norm(update);
    for (std::size_t i = 0; i < params.size(); ++i) {
      const auto ratio = at::where((p_norms[i] > 0) & (u_norms[i] > 0), p_norms[i] / u_norms[i], 1.0);
      params[i].sub_(update[i] * (ratio * kLr));
    }
  }
};

}  // namespace

void register_lamb(torch::Device device) {
  const std::string dev = device.is_cuda() ? "@cuda" : "";
  const auto options = ampfuse::FusedLAMBOptions(kLr).betas({kBeta1, kBeta2}).eps(kEps).weight_decay(kWeightDecay);
  for (const ParamSet& set : optimizer_sets()) {
    const std::int64_t n = total_numel(set);
    const std::int64_t bytes = 40 * n;
    const std::string tail = "/" + set.name + dev;
    auto data = [set, device]() -> OptimizerData& { return optimizer_data(set, device); };
    register_one("LAMB/ours" + tail, device, [=] {
      auto opt = std::make_shared<ampfuse::FusedLAMB>(data().params, options);
      return Fn([=] { opt->step(); });
    }, bytes);
    register_one("LAMB/libtorch_unfused" + tail, device, [=] {
      auto lamb = std::make_shared<UnfusedLamb>();
      for (const auto& p : data().params) {
        lamb->params.push_back(p.detach());
        lamb->params.back().mutable_grad() = p.grad();
        lamb->exp_avg.push_back(torch::zeros_like(p));
        lamb->exp_avg_sq.push_back(torch::zeros_like(p));
      }
      return Fn([=] { (*lamb)(); });
    }, bytes);
    register_ceiling("LAMB", set, device, 40, [](const TwinPointers& t, const ampfuse::Plan& plan) {
      lamb_twin(t.p, t.g, t.m, t.v, plan);
    });
  }
}

}  // namespace ampfuse_bench
