// The host path of a step: 10,000 one-element fp32 parameters, where the
// kernels cost next to nothing, so the time is what a step spends per tensor
// on the host (validation, state lookup, pointer lists, metadata). On a GPU
// this is what bounds a step over many small tensors.
//   Host        FusedAdam::step against at::_fused_adam_ on the same lists and
//               torch::optim::Adam
//   HostMovedGrads  the same with new grad tensors at every step
//   HostLAMB    FusedLAMB::step (two passes and the trust ratios between them)
//   HostScaler  scaler.step(FusedAdam) + scaler.update() against PyTorch's
//               scaled fused path (_amp_foreach_non_finite_check_and_unscale_,
//               _fused_adam_ with found_inf, _foreach_sub_ of the steps,
//               _amp_update_scale_)
// bench/report.py shows ampfuse's time per parameter beside the table.

#include <ampfuse/fused_adam.h>
#include <ampfuse/fused_lamb.h>
#include <ampfuse/grad_scaler.h>

#include <array>

#include "bench/common.h"

namespace ampfuse_bench {
namespace {

const ParamSet& host_set() {
  static const ParamSet set{"10000x1", std::vector<std::int64_t>(10000, 1)};
  return set;
}

}  // namespace

void register_host(torch::Device device) {
  const std::string tail = "/" + host_set().name + (device.is_cuda() ? "@cuda" : "");
  auto fopts = torch::TensorOptions().dtype(torch::kFloat).device(device);
  constexpr double kLr = 1e-4;
  auto data = [device]() -> OptimizerData& { return optimizer_data(host_set(), device); };
  const std::int64_t bytes = 28 * total_numel(host_set());
  register_one("Host/ours" + tail, device, [=] {
    auto opt = std::make_shared<ampfuse::FusedAdam>(data().params, torch::optim::AdamOptions(kLr));
    return Fn([=] { opt->step(); });
  }, bytes);
  // New grad tensors at every step, as after zero_grad() (which sets them to
  // none) and a backward: the plan sees every grad moved and checks each. Two
  // sets of grads take turns (swapping them costs a reference each).
  register_one("HostMovedGrads/ours" + tail, device, [=] {
    std::vector<torch::Tensor> params;
    for (const auto& p : data().params) params.push_back(p.detach().clone().requires_grad_());
    auto opt = std::make_shared<ampfuse::FusedAdam>(params, torch::optim::AdamOptions(kLr));
    auto sets = std::make_shared<std::array<std::vector<torch::Tensor>, 2>>();
    for (auto& set : *sets)
      for (const auto& p : params) set.push_back(torch::randn_like(p));
    auto turn = std::make_shared<int>(0);
    return Fn([=] {
      const auto& grads = (*sets)[static_cast<std::size_t>((*turn)++ & 1)];
      for (std::size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grads[i];
      opt->step();
    });
  }, bytes);
  register_one("HostLAMB/ours" + tail, device, [=] {
    auto opt = std::make_shared<ampfuse::FusedLAMB>(data().params, ampfuse::FusedLAMBOptions(kLr));
    return Fn([=] { opt->step(); });
  }, bytes);
  register_one("Host/torch_optim_adam" + tail, device, [=] {
    auto opt = std::make_shared<torch::optim::Adam>(data().params, torch::optim::AdamOptions(kLr));
    return Fn([=] { opt->step(); });
  }, bytes);
  register_one("Host/aten_fused_adam" + tail, device, [=] {
    return Fn([=] {
      OptimizerData& d = data();
      at::_foreach_add_(d.steps, 1);
      at::_fused_adam_(detached(d.params), d.grads, d.exp_avg, d.exp_avg_sq, {}, d.steps, kLr, 0.9, 0.999, 0.0, 1e-8,
                       false, false);
    });
  }, bytes);
  register_one("HostScaler/ours" + tail, device, [=] {
    auto opt = std::make_shared<ampfuse::FusedAdam>(data().params, torch::optim::AdamOptions(kLr));
    auto scaler =
        std::make_shared<ampfuse::GradScaler>(ampfuse::GradScalerOptions().init_scale(1.0).growth_interval(1 << 30));
    scaler->scale(torch::ones({}, fopts));
    return Fn([=] {
      scaler->step(*opt);
      scaler->update();
    });
  }, bytes);
  register_one("HostScaler/aten_fused_adam" + tail, device, [=] {
    auto found = torch::zeros({}, fopts);
    auto scale = torch::ones({}, fopts);
    auto tracker = torch::zeros({}, fopts.dtype(torch::kInt));
    return Fn([=]() mutable {
      OptimizerData& d = data();
      found.zero_();
      at::_amp_foreach_non_finite_check_and_unscale_(d.grads, found, scale);
      at::_foreach_add_(d.steps, 1);
      at::_fused_adam_(detached(d.params), d.grads, d.exp_avg, d.exp_avg_sq, {}, d.steps, kLr, 0.9, 0.999, 0.0, 1e-8,
                       false, false, scale, found);
      at::_foreach_sub_(d.steps, std::vector<at::Tensor>(d.steps.size(), found));
      at::_amp_update_scale_(scale, tracker, found, 2.0, 0.5, 1 << 30);
    });
  }, bytes);
}

}  // namespace ampfuse_bench
