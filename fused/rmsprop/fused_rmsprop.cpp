// Torch adapter of FusedRMSprop: state, lists by (group, device, dtype), and
// the CPU or CUDA kernel per list.

#include "ampfuse/fused_rmsprop.h"

#include <ATen/ops/full.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>

#include "ampfuse/tensor_ops.h"
#include "fused/rmsprop/rmsprop_cpu.h"

#if defined(AMPFUSE_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>

#include "fused/rmsprop/rmsprop_cuda.h"
#endif

namespace ampfuse {
namespace {

// What a list's steps reuse while the step plan holds (its ListSlot), for
// the options it was made for: the SDK's KeptLists (states; on CPU, pointer
// arrays by RmspropList and Plan) and, on CUDA, the views and launch
// metadata, and the device step counters that advance after the kernel.
struct RmspropKept : sdk::KeptLists<FusedRMSpropParamState> {
#if defined(AMPFUSE_WITH_CUDA)
  sdk::KeptLaunch launch;
  std::vector<at::Tensor> device_steps;
#endif
};

}  // namespace

void FusedRMSpropParamState::serialize(torch::serialize::OutputArchive& archive) const {
  sdk::save_counted<torch::optim::RMSpropParamState>(*this, archive);
}

FusedRMSprop::FusedRMSprop(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                           torch::optim::RMSpropOptions defaults, FusedRMSpropOptions fused)
    : FusedOptimizer(param_groups, std::move(defaults)), fused_(fused) {}

FusedRMSprop::FusedRMSprop(std::vector<at::Tensor> params, torch::optim::RMSpropOptions defaults,
                           FusedRMSpropOptions fused)
    : FusedRMSprop({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults), fused) {}

void FusedRMSprop::follow_param(const at::Tensor& p, FusedRMSpropParamState& st, const sdk::Follow& follow) {
  follow(st.square_avg(), p.scalar_type());
  follow(st.momentum_buffer(), p.scalar_type());
  follow(st.grad_avg(), p.scalar_type());
  follow.seen(st.device_step());  // (written by the kernels; never follows)
}

void FusedRMSprop::check_state(const at::Tensor& p, const FusedRMSpropParamState& st, std::size_t g,
                               std::size_t i) const {
  sdk::check_state_step(st.step(), name(), g, i);
  sdk::check_required_state_tensor(st.square_avg(), p, p.scalar_type(), name(), "square_avg", g, i);
  sdk::check_state_tensor(st.momentum_buffer(), p, p.scalar_type(), name(), "momentum_buffer", g, i);
  sdk::check_state_tensor(st.grad_avg(), p, p.scalar_type(), name(), "grad_avg", g, i);
  sdk::check_device_step(st.device_step(), p, name(), g, i);
}

sdk::Launch FusedRMSprop::prepare_list(const sdk::ParamList& list) {
  using fused::RmspropList;
  const auto& entries = list.entries;
  const auto& o = options_of(list.group);
  const fused::RmspropHyper hyper = fused::make_rmsprop_hyper(o.lr(), o.alpha(), o.eps(), o.weight_decay(),
                                                              o.momentum(), o.centered(), fused_.maximize());
  const bool momentum = hyper.use_momentum, centered = o.centered();
  const ScalarType st = list.kernel_dtype();
  const bool on_cuda = list.device.is_cuda();
  const std::size_t n = entries.size();
  std::shared_ptr<RmspropKept> kept = list.slot.get<RmspropKept>();
  // (A slot is also fresh after momentum or centered was switched: plan_key.)
  const bool fresh = kept == nullptr;
  if (fresh) {
    kept = std::make_shared<RmspropKept>();
    kept->states.resize(n);
    sdk::SmallStatePool pool(entries.front()->param.options());
    for (const sdk::Entry* e : entries)
      if (e->state == nullptr) pool.reserve(e->param, 1 + (momentum ? 1 : 0) + (centered ? 1 : 0));
    for (std::size_t i = 0; i < n; ++i) {  // creates state (first step): on this thread
      const sdk::Entry& e = *entries[i];
      const at::Tensor& p = e.param;
      const auto zeros = [&] { return pool.take(p); };
      FusedRMSpropParamState& s = state_for(e, [&](FusedRMSpropParamState& made) {
        made.step(0);
        made.square_avg(zeros());
      });
      if (momentum && !s.momentum_buffer().defined()) {
        undo_on_failure([&s] { s.momentum_buffer(at::Tensor()); });
        s.momentum_buffer(zeros());
      }
      if (centered && !s.grad_avg().defined()) {
        undo_on_failure([&s] { s.grad_avg(at::Tensor()); });
        s.grad_avg(zeros());
      }
      prepare_device_step(e, s);
      kept->states[i] = &s;
    }
  }
  // The state tensors the kernel takes, put(list, tensor) by RmspropList.
  const auto state_lists = [&](const FusedRMSpropParamState& s, auto put) {
    put(list_index(RmspropList::kSquareAvg), s.square_avg());
    if (momentum) put(list_index(RmspropList::kMomentumBuffer), s.momentum_buffer());
    if (centered) put(list_index(RmspropList::kGradAvg), s.grad_avg());
  };
  constexpr int kParam = list_index(RmspropList::kParam), kGrad = list_index(RmspropList::kGrad);

  if (!on_cuda) {
    if (fresh) {
      kept->gather(list, fused::kRmspropLists, kParam, kGrad,
                   [&](std::size_t i, auto put) { state_lists(*kept->states[i], put); });
    } else {
      kept->refresh_grads(list);
    }
    const double grad_factor = sdk::cpu_grad_factor(list.signal);
    if (fresh) list.slot.keep(kept);
    return [=] {
      fused::cpu::RmspropArgs args{sdk::cpu::plan_ref(*kept->plan), {}, st, hyper, grad_factor};
      for (int l = 0; l < fused::kRmspropLists; ++l) args.lists[l] = kept->list(l);
      const fused::cpu::RmspropFn kernel = fused::cpu::rmsprop_kernel(sdk::cpu::isa_for(*kept->plan));
      sdk::parallel_chunks(
          *kept->plan, [&](std::int64_t b, std::int64_t e) { kernel(args, b, e); },
          [&](std::size_t t) { kept->states[t]->step(kept->states[t]->step() + 1); }, kept->empty);
    };
  }
#if defined(AMPFUSE_WITH_CUDA)
  const c10::cuda::CUDAGuard guard(list.device);
  if (fresh) {
    kept->launch.begin(list, fused::kRmspropLists, kParam, kGrad);
    for (std::size_t i = 0; i < n; ++i) {
      state_lists(*kept->states[i], [&](int l, const at::Tensor& t) { kept->launch.put(l, i, t); });
      kept->device_steps.push_back(kept->states[i]->device_step());
    }
  }
  const auto meta = kept->launch.meta_for(list, fresh, kGrad);  // held by the Launch
  const sdk::SignalPointers sig = sdk::signal_pointers(list.signal);
  const fused::cuda::RmspropCudaArgs args{hyper, sig.found_inf, sig.inv_scale, sig.clip_coef};
  const ScaleSignal* signal = list.signal;
  const c10::Device device = list.device;
  if (fresh) list.slot.keep(kept);
  return [=] {
    const c10::cuda::CUDAGuard launch_guard(device);
    fused::cuda::rmsprop(meta->launch, st, args, sdk::current_stream(device));
    // Every counter advances, by (found_inf == 0) under a scaler.
    sdk::advance_step_counters(kept->device_steps, signal);
  };
#else
  TORCH_CHECK(false, name(), ": ampfuse was built without CUDA");
#endif
}

}  // namespace ampfuse
