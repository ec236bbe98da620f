// FusedLion's torch adapter: options, state and checkpoints, and per list
// (group, device, dtype) the raw pointers for the CPU or CUDA kernel. The
// base (ampfuse/sdk/optimizer.h) has validated everything and, on CPU,
// already left out a step that the scaler skips.

#include "lion.h"

#include <ampfuse/sdk/cpu.h>
#include <c10/util/Exception.h>

#include <memory>

#include "lion_cpu.h"

#if defined(AMPFUSE_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>

#include "lion_cuda.h"
#endif

namespace lion {

void LionOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
}

void LionOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
}

void LionParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg);
}

void LionParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg);
}

FusedLion::FusedLion(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, LionOptions defaults)
    : FusedOptimizer(param_groups, std::make_unique<LionOptions>(defaults)) {
  const auto [beta1, beta2] = defaults.betas();
  TORCH_CHECK(defaults.lr() >= 0, "FusedLion: invalid learning rate: ", defaults.lr());
  TORCH_CHECK(0 <= beta1 && beta1 <= 1, "FusedLion: invalid beta1: ", beta1);
  TORCH_CHECK(0 <= beta2 && beta2 <= 1, "FusedLion: invalid beta2: ", beta2);
  TORCH_CHECK(defaults.weight_decay() >= 0, "FusedLion: invalid weight_decay: ", defaults.weight_decay());
}

FusedLion::FusedLion(std::vector<torch::Tensor> params, LionOptions defaults)
    : FusedLion({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

void FusedLion::check_state(const torch::Tensor& p, const LionParamState& s, std::size_t group,
                            std::size_t index) const {
  TORCH_CHECK(s.exp_avg().defined(), name(), ": group ", group, " parameter ", index, ": state without exp_avg");
  ampfuse::sdk::check_state_tensor(s.exp_avg(), p, p.scalar_type(), name(), "exp_avg", group, index);
}

ampfuse::sdk::Launch FusedLion::prepare_list(const ampfuse::sdk::ParamList& list) {
  const LionOptions& o = options_of(list.group);
  const LionHyper hyper = make_lion_hyper(o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.weight_decay());
  const ampfuse::ScalarType dtype = list.kernel_dtype();
  const std::size_t n = list.entries.size();
  std::vector<void*> param(n), grad(n), exp_avg(n);
  std::vector<std::int64_t> numel(n);
  // exp_avg starts at zero, in the parameter's dtype and layout. On CUDA a
  // first step that the scaler skips (found_inf is only known on the device)
  // still creates it: zero is where a fresh optimizer starts. Small
  // parameters' exp_avg are carved from one buffer, in the order kernels read them.
  ampfuse::sdk::SmallStatePool pool(list.entries.front()->param.options());
  for (const ampfuse::sdk::Entry* e : list.entries)
    if (e->state == nullptr) pool.reserve(e->param);
  for (std::size_t i = 0; i < n; ++i) {
    const torch::Tensor& p = list.entries[i]->param;
    LionParamState& s = state_for(*list.entries[i], [&](LionParamState& st) { st.exp_avg(pool.take(p)); });
    param[i] = p.data_ptr();
    grad[i] = list.entries[i]->grad_data();
    exp_avg[i] = s.exp_avg().data_ptr();
    numel[i] = p.numel();
  }

  if (list.device.is_cpu()) {
    auto plan = std::make_shared<const ampfuse::Plan>(numel, ampfuse::sdk::cpu::kChunkSize);
    const double grad_factor = ampfuse::sdk::cpu_grad_factor(list.signal);
    // The launch: everything that could throw is done; it only writes.
    return [=] {
      const cpu::LionCpuArgs args{ampfuse::sdk::cpu::plan_ref(*plan), param.data(), grad.data(), exp_avg.data(),
                                  dtype, hyper, grad_factor};
      const cpu::LionFn kernel =
          ampfuse::sdk::cpu::pick_isa(cpu::avx512::kLion, cpu::avx2::kLion, cpu::baseline::kLion);
      ampfuse::sdk::parallel_chunks(*plan, [&](std::int64_t begin, std::int64_t end) { kernel(args, begin, end); });
    };
  }
#if defined(AMPFUSE_WITH_CUDA)
  const c10::cuda::CUDAGuard guard(list.device);
  ampfuse::TensorListsView views;
  views.lists.resize(cuda::kDepth);
  for (std::size_t i = 0; i < n; ++i) {
    views.lists[cuda::kParam].push_back({param[i], numel[i], dtype});
    views.lists[cuda::kGrad].push_back({grad[i], numel[i], dtype});
    views.lists[cuda::kExpAvg].push_back({exp_avg[i], numel[i], dtype});
  }
  const ampfuse::Plan plan(numel, ampfuse::sdk::cuda::kChunkSize);
  // The packed metadata, held by the Launch until the kernel is queued.
  const auto meta = ampfuse::sdk::make_launch_meta(views, plan, list.device);
  const ampfuse::sdk::SignalPointers sig = ampfuse::sdk::signal_pointers(list.signal);
  const c10::Device device = list.device;
  return [=] {
    const c10::cuda::CUDAGuard launch_guard(device);
    cuda::lion_step(meta->launch, dtype, {hyper, sig.found_inf, sig.inv_scale, sig.clip_coef},
                    ampfuse::sdk::current_stream(device));
  };
#else
  TORCH_CHECK(false, name(), ": ampfuse was built without CUDA");
#endif
}

}  // namespace lion
