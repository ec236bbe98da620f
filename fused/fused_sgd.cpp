// Torch adapter of FusedSGD: validation, momentum buffers, lists by (group,
// device, dtype), and the CPU or CUDA kernel per list.

#include "ampfuse/fused_sgd.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <unordered_map>

#include "ampfuse/tensor_ops.h"
#include "fused/sgd_cpu.h"

#if defined(AMPFUSE_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "contract/cuda/launch.h"
#include "fused/sgd_cuda.h"
#endif

namespace ampfuse {
namespace detail {

struct FusedSgdState {
  // CUDA parameters: the momentum buffer and its fp32 "initialized" flag on
  // the device; published to the state by sync_state() once initialized.
  struct DeviceBuffer {
    at::Tensor buffer;
    at::Tensor initialized;
  };
  std::unordered_map<const c10::TensorImpl*, DeviceBuffer> device_buffers;
#if defined(AMPFUSE_WITH_CUDA)
  sdk::TicketCounters counters;
#endif
};

}  // namespace detail

FusedSGD::FusedSGD(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                   torch::optim::SGDOptions defaults, FusedSGDOptions fused)
    : FusedOptimizer(param_groups, std::move(defaults)), fused_(fused), impl_(std::make_unique<detail::FusedSgdState>()) {}

FusedSGD::FusedSGD(std::vector<at::Tensor> params, torch::optim::SGDOptions defaults, FusedSGDOptions fused)
    : FusedSGD({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults), fused) {}

FusedSGD::~FusedSGD() = default;

void FusedSGD::check_state(const at::Tensor& p, const torch::optim::SGDParamState& st, std::size_t g,
                           std::size_t i) const {
  sdk::check_state_tensor(st.momentum_buffer(), p, p.scalar_type(), name(), "momentum_buffer", g, i);
}

void FusedSGD::step_list(const sdk::ParamList& pl) {
    const auto& list = pl.entries;
    const c10::Device device = pl.device;
    const auto& o = options_of(pl.group);
    const fused::SgdHyper hyper =
        fused::make_sgd_hyper(o.lr(), o.momentum(), o.dampening(), o.weight_decay(), o.nesterov(), fused_.maximize());
    const bool momentum = o.momentum() != 0;
    const ScaleSignal* signal = pl.signal;
    const ScalarType st = pl.kernel_dtype();
    std::vector<std::int64_t> numels;
    for (const sdk::Entry* e : list) numels.push_back(e->param.numel());

    if (device.is_cpu()) {
      // On CPU the skip was decided on the host: this step is applied, so
      // missing buffers are created now (filled by the kernel).
      const std::size_t n = list.size();
      std::vector<void*> param(n), grad(n), buf(n, nullptr);
      std::vector<unsigned char> first(n, 0);
      std::vector<torch::optim::SGDParamState*> states(n, nullptr);
      if (momentum) {
        for (std::size_t i = 0; i < n; ++i) {  // creates missing buffers: on this thread
          states[i] = static_cast<torch::optim::SGDParamState*>(list[i]->state);  // found by validation
          if (states[i] != nullptr && states[i]->momentum_buffer().defined()) continue;
          const at::Tensor& p = list[i]->param;
          if (states[i] == nullptr) {
            auto fresh = std::make_unique<torch::optim::SGDParamState>();
            states[i] = fresh.get();
            this->state()[p.unsafeGetTensorImpl()] = std::move(fresh);
          }
          states[i]->momentum_buffer(at::empty_like(p, at::MemoryFormat::Preserve));
          first[i] = 1;
        }
      }
      sdk::parallel_entries(n, [&](std::size_t i) {
        param[i] = list[i]->param.data_ptr();
        grad[i] = list[i]->grad.data_ptr();
        if (momentum) buf[i] = states[i]->momentum_buffer().data_ptr();
      });
      const Plan plan(numels, cpu::kChunkSize);
      const fused::cpu::SgdArgs args{cpu::plan_ref(plan), param.data(), grad.data(), buf.data(), first.data(), st,
                                     hyper, sdk::cpu_grad_factor(signal)};
      const fused::cpu::SgdFn kernel = fused::cpu::sgd_kernel();
      sdk::parallel_chunks(plan, [&](std::int64_t b, std::int64_t e) { kernel(args, b, e); });
      return;
    }
#if defined(AMPFUSE_WITH_CUDA)
    const c10::cuda::CUDAGuard guard(device);
    const auto stream = sdk::current_stream(device);
    TensorListsView views;
    views.lists.resize(momentum ? 4 : 2);
    for (const sdk::Entry* e : list) {
      const at::Tensor& p = e->param;
      views.lists[fused::cuda::kSgdParam].push_back({p.data_ptr(), p.numel(), st});
      views.lists[fused::cuda::kSgdGrad].push_back({e->grad.data_ptr(), p.numel(), st});
      if (!momentum) continue;
      auto& record = impl_->device_buffers[p.unsafeGetTensorImpl()];
      // Made on first use, or again when the one kept belongs to a freed
      // parameter that had the same address; never inside a CUDA graph (its
      // flag would be reset at every replay).
      if (!record.buffer.defined() || record.buffer.sizes() != p.sizes() || record.buffer.device() != p.device() ||
          record.buffer.scalar_type() != p.scalar_type()) {
        sdk::refuse_under_capture(*e, name(), "its momentum buffer (made at the first step, and again at the first "
                                              "after load())");
        const auto* state = find_state(p);
        const bool loaded = state != nullptr && state->momentum_buffer().defined();
        record.buffer = loaded ? state->momentum_buffer() : at::empty_like(p, at::MemoryFormat::Preserve);
        record.initialized = at::full({1}, loaded ? 1.0 : 0.0, p.options().dtype(at::kFloat));
      }
      views.lists[fused::cuda::kSgdMomentumBuffer].push_back({record.buffer.data_ptr(), p.numel(), st});
      views.lists[fused::cuda::kSgdInitialized].push_back({record.initialized.data_ptr(), 1, ScalarType::Float32});
    }
    const Plan plan(numels, cuda::kChunkSize);
    std::vector<std::int64_t> words;
    const cuda::LaunchMeta meta = sdk::make_launch_meta(views, plan, device, words);
    unsigned* counters = momentum ? impl_->counters.get({pl.group, device, pl.dtype}, meta.num_tensors) : nullptr;
    const sdk::SignalPointers sig = sdk::signal_pointers(signal);
    const fused::cuda::SgdCudaArgs args{hyper, sig.found_inf, sig.inv_scale, sig.clip_coef, counters};
    fused::cuda::sgd(meta, st, args, stream);
#endif
}

void FusedSGD::sync_state() {
  for (auto& group : param_groups()) {
    for (auto& p : group.params()) {
      auto it = impl_->device_buffers.find(p.unsafeGetTensorImpl());
      if (it == impl_->device_buffers.end() || find_state(p) != nullptr) continue;
      if (it->second.initialized.item<float>() == 0.f) continue;  // no step filled it yet
      auto st = std::make_unique<torch::optim::SGDParamState>();
      st->momentum_buffer(it->second.buffer);
      state()[p.unsafeGetTensorImpl()] = std::move(st);
    }
  }
}

void FusedSGD::save(torch::serialize::OutputArchive& archive) const {
  const_cast<FusedSGD*>(this)->sync_state();
  SGD::save(archive);
}

void FusedSGD::load(torch::serialize::InputArchive& archive) {
  SGD::load(archive);
  impl_->device_buffers.clear();  // rebuilt from the loaded buffers at the next step
}

}  // namespace ampfuse
