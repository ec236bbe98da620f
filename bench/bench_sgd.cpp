// FusedSGD (momentum 0.9) against torch::optim::SGD, ATen's _fused_sgd_ and
// the traffic twin (read p, g, buf; write p, buf: 20 bytes per fp32 parameter).

#include <ampfuse/fused_sgd.h>
#include <ampfuse/tensor_ops.h>

#include <ATen/Parallel.h>

#include "bench/common.h"

namespace ampfuse_bench {
namespace {

// SGD-with-momentum traffic with trivial arithmetic, split like the engine.
void sgd_twin(const std::vector<float*>& p, const std::vector<float*>& g, const std::vector<float*>& b,
              const ampfuse::Plan& plan) {
  at::parallel_for(0, plan.num_chunks(), 1, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t c = begin; c < end; ++c) {
      const ampfuse::Chunk ch = plan.chunk(c);
      float* pp = p[ch.tensor] + ch.begin;
      const float* gg = g[ch.tensor] + ch.begin;
      float* bb = b[ch.tensor] + ch.begin;
      for (std::int64_t i = 0; i < ch.size; ++i) {
        bb[i] = bb[i] + gg[i];
        pp[i] = pp[i] - bb[i];
      }
    }
  });
}

}  // namespace

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
        std::vector<torch::Tensor> params;
        for (const auto& p : d.params) params.push_back(p.detach());
        at::_fused_sgd_(params, d.grads, d.exp_avg, 0.0, kMomentum, kLr, 0.0, false, false, false);
      });
    }, bytes);
    register_ceiling("SGD", set, device, 20, [](const TwinPointers& t, const ampfuse::Plan& plan) {
      sgd_twin(t.p, t.g, t.v, plan);
    });
  }
}

}  // namespace ampfuse_bench
