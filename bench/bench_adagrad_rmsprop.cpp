// FusedAdagrad against torch::optim::Adagrad, ATen's _fused_adagrad_ (CPU)
// and the traffic twin (read p, g, sum; write p, sum: 20 bytes per fp32
// parameter); FusedRMSprop (plain) against torch::optim::RMSprop and the same
// twin (square_avg in place of sum).

#include <ampfuse/fused_adagrad.h>
#include <ampfuse/fused_rmsprop.h>

#include "bench/ceilings.h"
#include "bench/common.h"

namespace ampfuse_bench {

void register_adagrad_rmsprop(torch::Device device) {
  const std::string dev = device.is_cuda() ? "@cuda" : "";
  const auto adagrad_options = torch::optim::AdagradOptions(1e-3).lr_decay(1e-4);
  const auto rmsprop_options = torch::optim::RMSpropOptions(1e-4);
  for (const ParamSet& set : optimizer_sets()) {
    const std::int64_t bytes = 20 * total_numel(set);
    const std::string tail = "/" + set.name + dev;
    auto data = [set, device]() -> OptimizerData& { return optimizer_data(set, device); };
    register_one("Adagrad/ours" + tail, device, [=] {
      auto opt = std::make_shared<ampfuse::FusedAdagrad>(data().params, adagrad_options);
      return Fn([=] { opt->step(); });
    }, bytes);
    register_one("Adagrad/torch_optim_adagrad" + tail, device, [=] {
      auto opt = std::make_shared<torch::optim::Adagrad>(data().params, adagrad_options);
      return Fn([=] { opt->step(); });
    }, bytes);
    if (device.is_cpu()) {  // ATen's fused Adagrad has a CPU kernel only
      register_one("Adagrad/aten_fused_adagrad" + tail, device, [=] {
        return Fn([=] {
          OptimizerData& d = data();
          at::_foreach_add_(d.steps, 1);
          at::_fused_adagrad_(d.detached_params, d.grads, d.exp_avg_sq, d.steps, adagrad_options.lr(),
                              adagrad_options.lr_decay(), 0.0, adagrad_options.eps(), false);
        });
      }, bytes);
    }
    register_ceiling("Adagrad", set, device, 20, [](const TwinPointers& t, const ampfuse::Plan& plan) {
      sgd_twin(t.p, t.g, t.m, plan);  // (not v: its buffer goes negative, and v is Adam's sqrt input)
    });
    register_one("RMSprop/ours" + tail, device, [=] {
      auto opt = std::make_shared<ampfuse::FusedRMSprop>(data().params, rmsprop_options);
      return Fn([=] { opt->step(); });
    }, bytes);
    register_one("RMSprop/torch_optim_rmsprop" + tail, device, [=] {
      auto opt = std::make_shared<torch::optim::RMSprop>(data().params, rmsprop_options);
      return Fn([=] { opt->step(); });
    }, bytes);
    register_ceiling("RMSprop", set, device, 20, [](const TwinPointers& t, const ampfuse::Plan& plan) {
      sgd_twin(t.p, t.g, t.m, plan);  // (not v: its buffer goes negative, and v is Adam's sqrt input)
    });
  }
}

}  // namespace ampfuse_bench
