// float64 parameters: FusedAdam and FusedSGD on fp64 storage (opmath double)
// against torch::optim on the same data, and ATen's _fused_adam_ where it
// takes fp64. 8 tensors of 1M elements (64 MB of fp64 params).

#include <ampfuse/fused_adam.h>
#include <ampfuse/fused_sgd.h>
#include <ampfuse/tensor_ops.h>

#include "bench/ceilings.h"
#include "bench/common.h"

namespace ampfuse_bench {
namespace {

constexpr double kLr = 1e-4;

// fp64 parameters with grads, kept per device (and per user: each contender
// steps its own copy, so that none sees another's state).
std::vector<torch::Tensor> f64_params(const ParamSet& set, torch::Device device, const std::string& user) {
  static std::map<std::string, std::vector<torch::Tensor>> cache;
  const std::string key = set.name + device.str() + user;
  auto it = cache.find(key);
  if (it == cache.end()) {
    std::vector<torch::Tensor> params;
    const auto opts = torch::TensorOptions().dtype(torch::kDouble).device(device);
    for (std::int64_t n : set.numels) {
      auto p = (torch::rand({n}, opts) - 0.5).requires_grad_(true);
      p.mutable_grad() = torch::randn({n}, opts) * 1e-2;
      params.push_back(p);
    }
    it = cache.emplace(key, std::move(params)).first;
  }
  return it->second;
}

// A traffic twin's pointers over fp64 data: each array read as twice as many
// floats, with a plan of twice the elements in chunks of twice the size, so
// that the twin moves the same bytes in the same pieces as the fp64 step.
struct Twin64 {
  std::vector<torch::Tensor> keep;
  std::vector<float*> p, g, m, v;
  std::shared_ptr<ampfuse::Plan> plan;
};

std::shared_ptr<Twin64> twin64(const ParamSet& set, torch::Device device) {
  auto t = std::make_shared<Twin64>();
  std::vector<std::int64_t> floats;
  auto as_floats = [&t](const torch::Tensor& x) {
    t->keep.push_back(x);
    return reinterpret_cast<float*>(x.data_ptr<double>());
  };
  for (const auto& p : f64_params(set, device, "twin")) {
    t->p.push_back(as_floats(p.detach()));
    t->g.push_back(as_floats(p.grad()));
    t->m.push_back(as_floats(torch::zeros_like(p.detach())));
    t->v.push_back(as_floats(torch::zeros_like(p.detach())));
    floats.push_back(2 * p.numel());
  }
  t->plan = std::make_shared<ampfuse::Plan>(floats, 2 * ampfuse::cpu_chunk_size());
  return t;
}

}  // namespace

void register_float64(torch::Device device) {
  const std::string dev = device.is_cuda() ? "@cuda" : "";
  const ParamSet set{"8x1M", std::vector<std::int64_t>(8, 1ll << 20)};
  const std::string tail = "/" + set.name + dev;
  // Adam reads p, g, m, v and writes p, m, v: 56 bytes per fp64 parameter.
  const std::int64_t adam_bytes = 56 * total_numel(set);
  register_one("AdamF64/ours" + tail, device, [=] {
    auto opt = std::make_shared<ampfuse::FusedAdam>(f64_params(set, device, "ours"), torch::optim::AdamOptions(kLr));
    return Fn([=] { opt->step(); });
  }, adam_bytes);
  register_one("AdamF64/torch_optim_adam" + tail, device, [=] {
    auto opt = std::make_shared<torch::optim::Adam>(f64_params(set, device, "torch"), torch::optim::AdamOptions(kLr));
    return Fn([=] { opt->step(); });
  }, adam_bytes);
  register_one("AdamF64/aten_fused_adam" + tail, device, [=] {
    const auto params = f64_params(set, device, "aten");
    std::vector<torch::Tensor> detached, grads, m, v, steps;
    for (const auto& p : params) {
      detached.push_back(p.detach());
      grads.push_back(p.grad());
      m.push_back(torch::zeros_like(p));
      v.push_back(torch::zeros_like(p));
      steps.push_back(torch::zeros({}, p.options().dtype(torch::kFloat)));
    }
    return Fn([=]() mutable {
      at::_foreach_add_(steps, 1);
      at::_fused_adam_(detached, grads, m, v, {}, steps, kLr, 0.9, 0.999, 0.0, 1e-8, false, false);
    });
  }, adam_bytes);
  if (device.is_cpu()) {
    register_one("AdamF64/ceiling_twin" + tail, device, [=] {
      const auto t = twin64(set, device);
      return Fn([=] { adam_twin(t->p, t->g, t->m, t->v, *t->plan); });
    }, adam_bytes);
  }
  // SGD with momentum reads p, g, buf and writes p, buf: 40 bytes per fp64 parameter.
  const std::int64_t sgd_bytes = 40 * total_numel(set);
  const auto sgd_options = torch::optim::SGDOptions(kLr).momentum(0.9);
  register_one("SGDF64/ours" + tail, device, [=] {
    auto opt = std::make_shared<ampfuse::FusedSGD>(f64_params(set, device, "ours"), sgd_options);
    return Fn([=] { opt->step(); });
  }, sgd_bytes);
  register_one("SGDF64/torch_optim_sgd" + tail, device, [=] {
    auto opt = std::make_shared<torch::optim::SGD>(f64_params(set, device, "torch"), sgd_options);
    return Fn([=] { opt->step(); });
  }, sgd_bytes);
  if (device.is_cpu()) {
    register_one("SGDF64/ceiling_twin" + tail, device, [=] {
      const auto t = twin64(set, device);
      return Fn([=] { sgd_twin(t->p, t->g, t->m, *t->plan); });
    }, sgd_bytes);
  }
}

}  // namespace ampfuse_bench
