// The cost GradScaler adds to a step, the optimizer's own update left out
// (no-op optimizers), against what PyTorch's GradScaler does:
//   Scaler      find inf/NaN, unscale, decide to skip, update the scale
//   ScalerClip  the same with gradient clipping by the global 2-norm
// Contenders:
//   ours             GradScaler + a ScalerAware optimizer: one read-only pass
//                    (the unscale happens inside the optimizer's own pass), no host sync
//   ours_classic     GradScaler + a plain torch::optim::Optimizer: unscale in
//                    place in one pass, one host read of found_inf
//   pytorch_path     _amp_foreach_non_finite_check_and_unscale_, found_inf.item(),
//                    [_foreach_norm, clip coefficient, _foreach_mul_], _amp_update_scale_
// ScalerGaps: Scaler's classic path ("ours" there) on grads that are column
// slices of wider tensors (views with gaps between rows of 2048), which ATen
// unscales in place.
// The scale is 1 (inv_scale 1) so repeated runs keep the values (no denormals).
// Bytes counted: 4 per grad element, the read every contender must do.

#include <ampfuse/grad_scaler.h>

#include "bench/common.h"

namespace ampfuse_bench {
namespace {

class NoopOptimizer : public torch::optim::Optimizer {
 public:
  explicit NoopOptimizer(std::vector<torch::Tensor> params)
      : Optimizer({torch::optim::OptimizerParamGroup(std::move(params))},
                  std::make_unique<torch::optim::SGDOptions>(0.0)) {}
  torch::Tensor step(LossClosure = nullptr) override { return {}; }
};

class NoopScalerAware : public NoopOptimizer, public ampfuse::ScalerAware {
 public:
  using NoopOptimizer::NoopOptimizer;
  void step_with_signals(const ampfuse::StepSignals&) override {}
};

std::vector<torch::Tensor> params_with_grads(std::vector<torch::Tensor>& grads) {
  std::vector<torch::Tensor> params;
  for (auto& g : grads) {
    auto p = torch::empty({0}, g.options()).set_requires_grad(true);
    p.mutable_grad() = g;
    params.push_back(p);
  }
  return params;
}

// PyTorch's path on grads(): unscale and check, read found_inf, [clip by the
// global 2-norm], update the scale.
Fn pytorch_path(std::function<std::vector<torch::Tensor>&()> grads, torch::TensorOptions fopts, bool clip,
                double max_norm) {
  auto scale = torch::ones({}, fopts);
  auto tracker = torch::zeros({}, fopts.dtype(torch::kInt));
  auto found = torch::zeros({}, fopts);
  return Fn([=]() mutable {
    found.zero_();
    const auto inv = scale.to(torch::kDouble).reciprocal().to(torch::kFloat);
    at::_amp_foreach_non_finite_check_and_unscale_(grads(), found, inv);
    if (clip) {
      const auto norms = at::_foreach_norm(grads(), 2);
      const auto total = at::linalg_vector_norm(at::stack(norms), 2);
      const auto coef = at::clamp(max_norm / (total + 1e-6), c10::nullopt, 1.0);
      at::_foreach_mul_(grads(), coef);
    }
    benchmark::DoNotOptimize(found.item<float>());
    at::_amp_update_scale_(scale, tracker, found, 2.0, 0.5, 1 << 30);
  });
}

}  // namespace

void register_scaler(torch::Device device) {
  const std::string dev = device.is_cuda() ? "@cuda" : "";
  auto fopts = torch::TensorOptions().dtype(torch::kFloat).device(device);
  constexpr double kMaxNorm = 1e30;  // all the work of clipping, coefficient 1
  for (const ParamSet& set : engine_sets()) {
    const std::int64_t n = total_numel(set);
    const std::string tail = "/" + set.name + dev;
    auto grads = [set, device]() -> std::vector<torch::Tensor>& { return tensors_for(set, device); };
    for (bool clip : {false, true}) {
      const std::string op = clip ? "ScalerClip" : "Scaler";
      for (bool contract : {true, false}) {
        register_one(op + (contract ? "/ours" : "/ours_classic") + tail, device, [=] {
          auto params = params_with_grads(grads());
          std::shared_ptr<torch::optim::Optimizer> opt;
          if (contract) opt = std::make_shared<NoopScalerAware>(params);
          else opt = std::make_shared<NoopOptimizer>(params);
          return scaler_steps(opt, device, 1.0, clip ? kMaxNorm : 0.0);
        }, 4 * n);
      }
      register_one(op + "/pytorch_path" + tail, device, [=] { return pytorch_path(grads, fopts, clip, kMaxNorm); },
                   4 * n);
    }
  }
  // Grads with gaps: the classic path against PyTorch's unscale, no clipping.
  const std::int64_t n = total_numel(gapped_set());
  const std::string tail = "/" + gapped_set().name + dev;
  auto grads = [device]() -> std::vector<torch::Tensor>& { return gapped_tensors(device, 0); };
  register_one("ScalerGaps/ours" + tail, device, [=] {  // (the classic path: its only ampfuse contender)
    return scaler_steps(std::make_shared<NoopOptimizer>(params_with_grads(grads())), device);
  }, 4 * n);
  register_one("ScalerGaps/pytorch_path" + tail, device, [=] { return pytorch_path(grads, fopts, false, 0.0); },
               4 * n);
}

}  // namespace ampfuse_bench
