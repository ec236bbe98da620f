// Torch adapter of FusedAdagrad: state, lists by (group, device, dtype), and
// the CPU or CUDA kernel per list.

#include "ampfuse/fused_adagrad.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/sparse_coo_tensor.h>
#include <c10/util/Exception.h>

#include <typeinfo>

#include "ampfuse/tensor_ops.h"
#include "fused/adagrad/adagrad_cpu.h"

#if defined(AMPFUSE_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>

#include "fused/adagrad/adagrad_cuda.h"
#endif

namespace ampfuse {
namespace {

// A parameter's state as torch::optim::Adagrad makes it (made at the first
// step for a parameter added after construction: from its group's options).
auto made_state(const at::Tensor& p, const torch::optim::AdagradOptions& o) {
  return [&p, &o](FusedAdagradParamState& made) {
    made.step(0);
    made.sum(at::full_like(p, o.initial_accumulator_value(), at::MemoryFormat::Preserve));
  };
}

// What a list's steps reuse while the step plan holds (its ListSlot): on
// CPU, the SDK's KeptLists (states, pointer arrays by AdagradList, Plan) and
// each step's counters and -clr (reused: a step's launch ran before the next
// step prepares); on CUDA, the states, the views and launch metadata, and
// the device step counters that advance after the kernel.
struct AdagradKept : sdk::KeptLists<FusedAdagradParamState> {
  std::vector<std::int64_t> steps;
  std::vector<double> neg_clr;
#if defined(AMPFUSE_WITH_CUDA)
  sdk::KeptLaunch launch;
  std::vector<at::Tensor> device_steps;
#endif
};

}  // namespace

void FusedAdagradParamState::serialize(torch::serialize::OutputArchive& archive) const {
  sdk::save_counted<torch::optim::AdagradParamState>(*this, archive);
}

FusedAdagrad::FusedAdagrad(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                           torch::optim::AdagradOptions defaults, FusedAdagradOptions fused)
    : FusedOptimizer(param_groups, std::move(defaults)), fused_(fused) {
  // torch::optim::Adagrad's constructor made each parameter's state as its
  // own type: the same state as FusedAdagrad's.
  for (auto& [key, state] : this->state()) {
    if (typeid(*state) != typeid(torch::optim::AdagradParamState)) continue;
    const auto& made = static_cast<const torch::optim::AdagradParamState&>(*state);
    auto fused_state = std::make_unique<FusedAdagradParamState>();
    fused_state->sum(made.sum());
    fused_state->step(made.step());
    state = std::move(fused_state);
  }
}

FusedAdagrad::FusedAdagrad(std::vector<at::Tensor> params, torch::optim::AdagradOptions defaults,
                           FusedAdagradOptions fused)
    : FusedAdagrad({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults), fused) {}

void FusedAdagrad::follow_param(const at::Tensor& p, FusedAdagradParamState& st, const sdk::Follow& follow) {
  follow(st.sum(), p.scalar_type());
  follow.seen(st.device_step());  // (written by the kernels; never follows)
}

void FusedAdagrad::check_state(const at::Tensor& p, const FusedAdagradParamState& st, std::size_t g,
                               std::size_t i) const {
  sdk::check_state_step(st.step(), name(), g, i);
  sdk::check_required_state_tensor(st.sum(), p, p.scalar_type(), name(), "sum", g, i);
  sdk::check_device_step(st.device_step(), p, name(), g, i);
}

sdk::Launch FusedAdagrad::prepare_list(const sdk::ParamList& list) {
  using fused::AdagradList;
  const auto& entries = list.entries;
  const auto& o = options_of(list.group);
  const fused::AdagradHyper hyper =
      fused::make_adagrad_hyper(o.lr(), o.lr_decay(), o.weight_decay(), o.eps(), fused_.maximize());
  const ScalarType st = list.kernel_dtype();
  const bool on_cuda = list.device.is_cuda();
  const std::size_t n = entries.size();
  constexpr int kParam = list_index(AdagradList::kParam), kGrad = list_index(AdagradList::kGrad),
                kSum = list_index(AdagradList::kSum);
  std::shared_ptr<AdagradKept> kept = list.slot.get<AdagradKept>();
  const bool fresh = kept == nullptr;
  if (fresh) {
    kept = std::make_shared<AdagradKept>();
    kept->states.resize(n);
    for (std::size_t i = 0; i < n; ++i) {  // creates state (a parameter added after construction): on this thread
      const sdk::Entry& e = *entries[i];
      FusedAdagradParamState& s = state_for(e, made_state(e.param, o));
      prepare_device_step(e, s);
      kept->states[i] = &s;
    }
  }

  if (!on_cuda) {
    if (fresh) {
      kept->gather(list, kSum + 1, kParam, kGrad,
                   [&](std::size_t i, auto put) { put(kSum, kept->states[i]->sum()); });
    } else {
      kept->refresh_grads(list);
    }
    // One clr per run of equal steps (in each thread's range), not per tensor.
    advance_host_steps(kept, kept->neg_clr,
                       [&](std::int64_t step) { return fused::adagrad_neg_clr(hyper, static_cast<double>(step)); });
    const double grad_factor = sdk::cpu_grad_factor(list.signal);
    if (fresh) list.slot.keep(kept);
    return [=] {
      const fused::cpu::AdagradArgs args{sdk::cpu::plan_ref(*kept->plan), kept->list(kParam), kept->list(kGrad),
                                         kept->list(kSum), kept->neg_clr.data(), st, hyper, grad_factor};
      const fused::cpu::AdagradFn kernel = fused::cpu::adagrad_kernel(sdk::cpu::isa_for(*kept->plan));
      sdk::parallel_chunks(*kept->plan, [&](std::int64_t b, std::int64_t e) { kernel(args, b, e); });
    };
  }
#if defined(AMPFUSE_WITH_CUDA)
  const c10::cuda::CUDAGuard guard(list.device);
  if (fresh) {
    kept->launch.begin(list, fused::kAdagradLists, kParam, kGrad);
    for (std::size_t i = 0; i < n; ++i) {
      const FusedAdagradParamState& s = *kept->states[i];
      kept->launch.put(kSum, i, s.sum());
      // The fp64 counter travels as a pointer; its dtype tag is not read.
      kept->launch.put(list_index(AdagradList::kStep), i, s.device_step(), 1, ScalarType::Float32);
      kept->device_steps.push_back(s.device_step());
    }
  }
  const auto meta = kept->launch.meta_for(list, fresh, kGrad);  // held by the Launch
  const sdk::SignalPointers sig = sdk::signal_pointers(list.signal);
  const fused::cuda::AdagradCudaArgs args{hyper, sig.found_inf, sig.inv_scale, sig.clip_coef};
  const ScaleSignal* signal = list.signal;
  const c10::Device device = list.device;
  if (fresh) list.slot.keep(kept);
  return [=] {
    const c10::cuda::CUDAGuard launch_guard(device);
    fused::cuda::adagrad(meta->launch, st, args, sdk::current_stream(device));
    // After the kernel read them: every counter advances, by (found_inf == 0) under a scaler.
    sdk::advance_step_counters(kept->device_steps, signal);
  };
#else
  TORCH_CHECK(false, name(), ": ampfuse was built without CUDA");
#endif
}

// A parameter whose grad is sparse, stepped as torch::optim::Adagrad steps
// it: ATen's sparse ops over the coalesced grad's nonzeros, in LibTorch's
// order, so the numbers are LibTorch's bit for bit and the cost is the
// nonzeros', not the parameter's. Validated here, before any list launches.
sdk::Launch FusedAdagrad::prepare_sparse(const sdk::Entry& e) {
  const auto& o = options_of(e.group);
  TORCH_CHECK(o.weight_decay() == 0, name(), ": param group ", e.group, ", param ", e.index,
              ": the grad is sparse and the group's weight_decay is ", o.weight_decay(),
              "; weight decay is not compatible with sparse gradients (as in torch::optim::Adagrad)");
  FusedAdagradParamState& s = state_for(e, made_state(e.param, o));
  prepare_device_step(e, s);
  // On CUDA the device counter is the count (a skipped contract step did not
  // advance it); reading it waits for the device, as the classic path
  // GradScaler takes with sparse grads does anyway.
  const double step = (s.device_step().defined() ? s.device_step().item<double>() : static_cast<double>(s.step())) + 1;
  const fused::AdagradHyper hyper =
      fused::make_adagrad_hyper(o.lr(), o.lr_decay(), o.weight_decay(), o.eps(), fused_.maximize());
  const double clr = -fused::adagrad_neg_clr(hyper, step);
  const sdk::Entry* entry = &e;  // the step's entries outlive its launches
  return [entry, &s, step, clr, eps = o.eps(), maximize = fused_.maximize()] {
    const at::Tensor grad = (maximize ? entry->grad.neg() : entry->grad).coalesce();
    const at::Tensor indices = grad._indices(), values = grad._values();
    auto make_sparse = [&](const at::Tensor& v) {
      if (indices.dim() == 0 || v.dim() == 0) return at::empty({0}, grad.options()).resize_as_(grad);
      return at::sparse_coo_tensor(indices, v, grad.sizes(), grad.options());
    };
    s.sum().add_(make_sparse(values.pow(2)));
    const at::Tensor std_values = s.sum().sparse_mask(grad)._values().sqrt_().add_(eps);
    entry->param.add_(make_sparse(values / std_values), -clr);
    if (s.device_step().defined()) {
      s.device_step().add_(1);
    } else {
      s.step(static_cast<std::int64_t>(step));
    }
  };
}

}  // namespace ampfuse
