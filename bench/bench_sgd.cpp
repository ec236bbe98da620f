// FusedSGD (momentum 0.9) against torch::optim::SGD, ATen's _fused_sgd_ and
// the traffic twin (read p, g, buf; write p, buf: 20 bytes per fp32 parameter).

#include <ampfuse/fused_sgd.h>
#include <ampfuse/tensor_ops.h>

#include <ATen/Parallel.h>

#include "bench/ceilings.h"
#include "bench/common.h"

namespace ampfuse_bench {

void register_sgd(torch::Device device) {
  const std::string dev = device.is_cuda() ? "@cuda" : "";
  constexpr double kLr = 1e-4, kMomentum = 0.9;
  for (const ParamSet& set : optimizer_sets()) {
    const std::int64_t n = total_numel(set);
    const std::int64_t bytes = 20 * n;
    const std::string tail = "/" + set.name + dev;
    auto data = [set, device]() -> OptimizerData& { return optimizer_data(set, device); };
    register_one("SGD/ours" + tail, device, [=] {
      auto opt = std::make_shared<ampfuse::FusedSGD>(data().params, torch::optim::SGDOptions(kLr).momentum(kMomentum));
      return Fn([=] { opt->step(); });
    }, bytes);
    register_one("SGD/torch_optim_sgd" + tail, device, [=] {
      auto opt = std::make_shared<torch::optim::SGD>(data().params, torch::optim::SGDOptions(kLr).momentum(kMomentum));
      return Fn([=] { opt->step(); });
    }, bytes);
    register_one("SGD/aten_fused_sgd" + tail, device, [=] {
      return Fn([=] {
        OptimizerData& d = data();
        at::_fused_sgd_(d.detached_params, d.grads, d.exp_avg, 0.0, kMomentum, kLr, 0.0, false, false, false);
      });
    }, bytes);
    register_ceiling("SGD", set, device, 20, [](const TwinPointers& t, const ampfuse::Plan& plan) {
      sgd_twin(t.p, t.g, t.m, plan);  // (not v: its buffer goes negative, and v is Adam's sqrt input)
    });
  }
}

}  // namespace ampfuse_bench
