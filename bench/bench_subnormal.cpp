// Hostile data: Adam steps whose arithmetic meets subnormal numbers, beside
// the same step on normal data in the same run (bench/report.py: the
// subnormal step should take at most 1.3x the normal one).
//   AdamSubnormal   moments that decayed into the subnormal range and grads
//                   there too (embedding rows that get almost no gradient):
//                   FusedAdam::step, and torch::optim::Adam on the same data
//   AdamScaledTiny  grads of 1e-33 under a scale of 65,536 (g * inv_scale
//                   and its square are subnormal): scaler.step(FusedAdam)
// ours_normal is the same call on OptimizerData's normal values;
// ours_keep_subnormals the subnormal step with IEEE subnormals kept.

#include <ampfuse/fused_adam.h>
#include <ampfuse/grad_scaler.h>

#include "bench/common.h"

namespace ampfuse_bench {
namespace {

// Parameters of `set` whose grads all hold `grad`, kept per (set, device, grad).
std::vector<torch::Tensor> params_with_grads(const ParamSet& set, torch::Device device, float grad) {
  static std::map<std::string, std::vector<torch::Tensor>> cache;
  const std::string key = set.name + device.str() + std::to_string(grad);
  auto it = cache.find(key);
  if (it == cache.end()) {
    std::vector<torch::Tensor> params;
    const auto opts = torch::TensorOptions().dtype(torch::kFloat).device(device);
    for (std::int64_t n : set.numels) {
      auto p = (torch::rand({n}, opts) - 0.5).requires_grad_(true);
      p.mutable_grad() = torch::full({n}, grad, opts);
      params.push_back(p);
    }
    it = cache.emplace(key, std::move(params)).first;
  }
  return it->second;
}

// One step to make the state, then both moments set to `moment`.
template <class Opt, class State>
void fill_moments(Opt& opt, float moment) {
  opt.step();
  for (auto& [key, state] : opt.state()) {
    auto& s = static_cast<State&>(*state);
    s.exp_avg().fill_(moment);
    s.exp_avg_sq().fill_(moment);
  }
}

}  // namespace

void register_subnormal(torch::Device device) {
  const std::string dev = device.is_cuda() ? "@cuda" : "";
  constexpr double kLr = 1e-4;
  constexpr float kSubnormal = 2e-39f;  // below 2^-126 = 1.18e-38
  constexpr double kScale = 65536.0;
  for (const ParamSet& set : optimizer_sets()) {
    if (set.name != "8x8M") continue;
    const std::int64_t bytes = 28 * total_numel(set);
    const std::string tail = "/" + set.name + dev;
    register_one("AdamSubnormal/ours" + tail, device, [=] {
      auto opt = std::make_shared<ampfuse::FusedAdam>(params_with_grads(set, device, kSubnormal),
                                                      torch::optim::AdamOptions(kLr));
      fill_moments<ampfuse::FusedAdam, ampfuse::FusedAdamParamState>(*opt, kSubnormal);
      return Fn([=] { opt->step(); });
    }, bytes);
    if (device.is_cpu()) {  // the same step keeping IEEE subnormals (ampfuse::sdk::cpu::keep_subnormals)
      register_one("AdamSubnormal/ours_keep_subnormals" + tail, device, [=] {
        auto opt = std::make_shared<ampfuse::FusedAdam>(params_with_grads(set, device, kSubnormal),
                                                        torch::optim::AdamOptions(kLr));
        fill_moments<ampfuse::FusedAdam, ampfuse::FusedAdamParamState>(*opt, kSubnormal);
        return Fn([=] {
          ampfuse::sdk::cpu::keep_subnormals(true);
          opt->step();
          ampfuse::sdk::cpu::keep_subnormals(false);
        });
      }, bytes);
    }
    register_one("AdamSubnormal/torch_optim_adam" + tail, device, [=] {
      auto opt = std::make_shared<torch::optim::Adam>(params_with_grads(set, device, kSubnormal),
                                                      torch::optim::AdamOptions(kLr));
      fill_moments<torch::optim::Adam, torch::optim::AdamParamState>(*opt, kSubnormal);
      return Fn([=] { opt->step(); });
    }, bytes);
    register_one("AdamSubnormal/ours_normal" + tail, device, [=] {
      auto opt = std::make_shared<ampfuse::FusedAdam>(optimizer_data(set, device).params,
                                                      torch::optim::AdamOptions(kLr));
      return Fn([=] { opt->step(); });
    }, bytes);
    for (const bool tiny : {true, false}) {
      register_one(std::string("AdamScaledTiny/") + (tiny ? "ours" : "ours_normal") + tail, device, [=] {
        auto params = tiny ? params_with_grads(set, device, 1e-33f) : optimizer_data(set, device).params;
        return scaler_steps(std::make_shared<ampfuse::FusedAdam>(params, torch::optim::AdamOptions(kLr)), device,
                            kScale);
      }, bytes);
    }
  }
}

}  // namespace ampfuse_bench
