// FusedAdam against torch::optim::Adam, ATen's _fused_adam_ and the traffic
// twin (read p, g, m, v; write p, m, v: 28 bytes per fp32 parameter).
//   Adam        unscaled step (on 8x8M also ours_baseline: the baseline kernels)
//   AdamScaled  a GradScaler step: ours = check pass + fused step (contract);
//               PyTorch's = _amp_foreach_non_finite_check_and_unscale_ with
//               inv_scale 1 (its check pass, which writes grads back) +
//               _fused_adam_ with grad_scale and found_inf, then the
//               _foreach_sub_(steps, found_inf) torch.optim's _fused_adam
//               runs after it
//   AdamClip    the same with clipping to a global 2-norm; PyTorch's =
//               unscale_, clip_grad_norm_ (_foreach_norm, _foreach_mul_), fused
//               step with found_inf only, _foreach_sub_
// Parameter sets: 64M in 8 tensors, 10,000 x 4,096, GPT-2 small (148 tensors,
// 124M), and on CUDA 1B in 16 tensors.
// The scale is 1 and max_norm huge, so repeated steps keep their values.

#include <ampfuse/fused_adam.h>
#include <ampfuse/grad_scaler.h>
#include <ampfuse/sdk/cpu.h>
#include <ampfuse/tensor_ops.h>

#include <ATen/Parallel.h>

#include "bench/ceilings.h"
#include "bench/common.h"

namespace ampfuse_bench {

const std::vector<ParamSet>& optimizer_sets() {
  static const std::vector<ParamSet> sets = [] {
    std::vector<ParamSet> s;
    s.push_back({"8x8M", std::vector<std::int64_t>(8, 8ll << 20)});
    s.push_back({"10000x4096", std::vector<std::int64_t>(10000, 4096)});
    // GPT-2 small (Radford et al. 2019; the 124M checkpoint): token and
    // position embeddings, 12 blocks of (ln_1, c_attn, c_proj, ln_2, c_fc,
    // mlp c_proj), final layer norm.
    std::vector<std::int64_t> gpt2 = {50257ll * 768, 1024ll * 768};
    for (int layer = 0; layer < 12; ++layer) {
      const std::vector<std::int64_t> block = {768, 768, 768ll * 2304, 2304, 768ll * 768, 768,
                                               768, 768, 768ll * 3072, 3072, 3072ll * 768, 768};
      gpt2.insert(gpt2.end(), block.begin(), block.end());
    }
    gpt2.push_back(768);
    gpt2.push_back(768);
    s.push_back({"gpt2-124M", gpt2});
    return s;
  }();
  return sets;
}

OptimizerData& optimizer_data(const ParamSet& set, torch::Device device) {
  static std::map<std::string, OptimizerData> cache;
  const std::string key = set.name + device.str();
  auto it = cache.find(key);
  if (it == cache.end()) {
    OptimizerData d;
    auto opts = torch::TensorOptions().dtype(torch::kFloat).device(device);
    for (std::int64_t n : set.numels) {
      auto p = (torch::rand({n}, opts) - 0.5).requires_grad_(true);
      auto g = torch::randn({n}, opts) * 1e-2;
      p.mutable_grad() = g;
      d.params.push_back(p);
      d.detached_params.push_back(p.detach());
      d.grads.push_back(g);
      d.exp_avg.push_back(torch::zeros({n}, opts));
      d.exp_avg_sq.push_back(torch::zeros({n}, opts));
      d.steps.push_back(torch::zeros({}, opts));
    }
    it = cache.emplace(key, std::move(d)).first;
  }
  return it->second;
}

void register_ceiling(const std::string& op, const ParamSet& set, torch::Device device, std::int64_t bytes_per_param,
                      TwinFn twin) {
  const std::int64_t n = total_numel(set);
  if (device.is_cpu()) {
    register_one(op + "/ceiling_twin/" + set.name, device, [=] {
      OptimizerData& d = optimizer_data(set, device);
      auto plan = std::make_shared<ampfuse::Plan>(set.numels, ampfuse::cpu_chunk_size());
      TwinPointers t;
      for (std::size_t i = 0; i < d.params.size(); ++i) {
        t.p.push_back(d.params[i].data_ptr<float>());
        t.g.push_back(d.grads[i].data_ptr<float>());
        t.m.push_back(d.exp_avg[i].data_ptr<float>());
        t.v.push_back(d.exp_avg_sq[i].data_ptr<float>());
      }
      return Fn([=] { twin(t, *plan); });
    }, bytes_per_param * n);
  } else {
    register_one(op + "/ceiling_d2d_copy/" + set.name + "@cuda", device, [=] {
      const auto fopts = torch::TensorOptions().dtype(torch::kFloat).device(device);
      auto src = torch::empty({n * bytes_per_param / 8}, fopts);  // half the bytes read, half written
      auto dst = torch::empty({n * bytes_per_param / 8}, fopts);
      return Fn([=]() mutable { dst.copy_(src); });
    }, bytes_per_param * n);
  }
}

void register_adam(torch::Device device) {
  const std::string dev = device.is_cuda() ? "@cuda" : "";
  auto fopts = torch::TensorOptions().dtype(torch::kFloat).device(device);
  constexpr double kLr = 1e-4, kMaxNorm = 1e30;
  std::vector<ParamSet> sets = optimizer_sets();
  // On a GPU also 1B fp32 parameters (16 x 64M; about 80 GB with every
  // contender's state and the copy ceiling's buffers).
  if (device.is_cuda()) sets.push_back({"1B", std::vector<std::int64_t>(16, 64ll << 20)});
  for (const ParamSet& set : sets) {
    const std::int64_t n = total_numel(set);
    const std::int64_t bytes = 28 * n;
    const std::string tail = "/" + set.name + dev;
    auto data = [set, device]() -> OptimizerData& { return optimizer_data(set, device); };

    for (const char* op : {"Adam", "AdamScaled", "AdamClip"}) {
      const std::string o = op;
      const bool scaled = o != "Adam", clip = o == "AdamClip";
      register_one(o + "/ours" + tail, device, [=] {
        auto opt = std::make_shared<ampfuse::FusedAdam>(data().params, torch::optim::AdamOptions(kLr));
        if (!scaled) return Fn([=] { opt->step(); });
        return scaler_steps(opt, device, 1.0, clip ? kMaxNorm : 0.0);
      }, bytes);
      register_one(o + "/aten_fused_adam" + tail, device, [=] {
        auto found = torch::zeros({}, fopts);
        auto one = torch::ones({}, fopts);
        auto scale = torch::ones({}, fopts);
        auto tracker = torch::zeros({}, fopts.dtype(torch::kInt));
        return Fn([=]() mutable {
          OptimizerData& d = data();
          const auto& params = d.detached_params;
          at::_foreach_add_(d.steps, 1);
          if (!scaled) {
            at::_fused_adam_(params, d.grads, d.exp_avg, d.exp_avg_sq, {}, d.steps, kLr, 0.9, 0.999, 0.0, 1e-8,
                             false, false);
            return;
          }
          found.zero_();
          at::_amp_foreach_non_finite_check_and_unscale_(d.grads, found, one);
          c10::optional<at::Tensor> grad_scale = one;
          if (clip) {  // unscale_ came first: the step gets found_inf but no grad_scale
            const auto total = at::linalg_vector_norm(at::stack(at::_foreach_norm(d.grads, 2)), 2);
            at::_foreach_mul_(d.grads, at::clamp(kMaxNorm / (total + 1e-6), c10::nullopt, 1.0));
            grad_scale = c10::nullopt;
          }
          at::_fused_adam_(params, d.grads, d.exp_avg, d.exp_avg_sq, {}, d.steps, kLr, 0.9, 0.999, 0.0, 1e-8, false,
                           false, grad_scale, found);
          // torch.optim's _fused_adam takes the step back on a skipped step.
          at::_foreach_sub_(d.steps, std::vector<at::Tensor>(d.steps.size(), found));
          // GradScaler.update(): on the device, no host read (the fused path never reads found_inf).
          at::_amp_update_scale_(scale, tracker, found, 2.0, 0.5, 1 << 30);
        });
      }, bytes);
    }
    // The same step on the baseline kernels (SSE2 here; NEON on AArch64,
    // where no other build exists): the speed a processor without AVX2 gets.
    if (device.is_cpu() && set.name == "8x8M")
      register_one("Adam/ours_baseline" + tail, device, [=] {
        auto opt = std::make_shared<ampfuse::FusedAdam>(data().params, torch::optim::AdamOptions(kLr));
        return Fn([=] {
          ampfuse::sdk::cpu::force_isa("baseline");
          opt->step();
          ampfuse::sdk::cpu::force_isa("");
        });
      }, bytes);
    register_one("Adam/torch_optim_adam" + tail, device, [=] {
      auto opt = std::make_shared<torch::optim::Adam>(data().params, torch::optim::AdamOptions(kLr));
      return Fn([=] { opt->step(); });
    }, bytes);
    register_ceiling("Adam", set, device, 28, [](const TwinPointers& t, const ampfuse::Plan& plan) {
      adam_twin(t.p, t.g, t.m, t.v, plan);
    });
  }
}

}  // namespace ampfuse_bench
