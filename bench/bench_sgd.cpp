// FusedSGD (momentum 0.9) against torch::optim::SGD, ATen's _fused_sgd_ and
// the traffic twin (read p, g, buf; write p, buf: 20 bytes per fp32 parameter).
// SGDGaps: without momentum, on parameters that are column slices of wider
// tensors, which both update in place (FusedSGD run by run): 12 bytes per
// parameter counted, what an update in place moves.

#include <ampfuse/fused_sgd.h>
#include <ampfuse/tensor_ops.h>

#include <ATen/Parallel.h>

#include <map>

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
  const std::string tail = "/" + gapped_set().name + dev;
  const std::int64_t bytes = 12 * total_numel(gapped_set());
  // The parameters: views with gaps, made leaves; their grads contiguous, as autograd makes them.
  auto params = [device]() -> std::vector<torch::Tensor>& {
    static std::map<std::string, std::vector<torch::Tensor>> cache;
    auto& list = cache[device.str()];
    if (list.empty())
      for (const torch::Tensor& view : gapped_tensors(device, 1)) {
        auto p = view.detach().requires_grad_();
        p.mutable_grad() = torch::randn(view.sizes(), view.options());
        list.push_back(p);
      }
    return list;
  };
  register_one("SGDGaps/ours" + tail, device, [=] {
    auto opt = std::make_shared<ampfuse::FusedSGD>(params(), torch::optim::SGDOptions(kLr));
    return Fn([=] { opt->step(); });
  }, bytes);
  register_one("SGDGaps/torch_optim_sgd" + tail, device, [=] {
    auto opt = std::make_shared<torch::optim::SGD>(params(), torch::optim::SGDOptions(kLr));
    return Fn([=] { opt->step(); });
  }, bytes);
}

}  // namespace ampfuse_bench
