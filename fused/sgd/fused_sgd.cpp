// Torch adapter of FusedSGD: validation, momentum buffers, lists by (group,
// device, dtype), and the CPU or CUDA kernel per list.

#include "ampfuse/fused_sgd.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <memory>

#include "ampfuse/tensor_ops.h"
#include "fused/sgd/sgd_cpu.h"

#if defined(AMPFUSE_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "contract/cuda/launch.h"
#include "fused/sgd/sgd_cuda.h"
#endif

namespace ampfuse {
namespace detail {

struct FusedSgdWorkspace {
#if defined(AMPFUSE_WITH_CUDA)
  sdk::TicketCounters counters;
#endif
};

}  // namespace detail

namespace {

// What a list's steps reuse while the step plan holds (its ListSlot), for
// the momentum it was made for: the SDK's KeptLists (states; on CPU,
// pointer arrays by CpuList and Plan) and which buffers the next CPU step
// fills first (those its first step made; none after that step ran), and on
// CUDA the views and launch metadata.
enum CpuList : int { kCpuParam, kCpuGrad, kCpuBuffer, kCpuLists };
struct SgdKept : sdk::KeptLists<FusedSGDParamState> {
  std::vector<unsigned char> first;
#if defined(AMPFUSE_WITH_CUDA)
  sdk::KeptLaunch launch;
#endif
};

}  // namespace

FusedSGD::FusedSGD(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                   torch::optim::SGDOptions defaults, FusedSGDOptions fused)
    : FusedOptimizer(param_groups, std::move(defaults)),
      fused_(fused),
      workspace_(std::make_unique<detail::FusedSgdWorkspace>()) {}

FusedSGD::FusedSGD(std::vector<at::Tensor> params, torch::optim::SGDOptions defaults, FusedSGDOptions fused)
    : FusedSGD({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults), fused) {}

FusedSGD::~FusedSGD() = default;

void FusedSGD::follow_param(const at::Tensor& p, FusedSGDParamState& st, const sdk::Follow& follow) {
  follow(st.momentum_buffer(), p.scalar_type());
  follow.seen(st.momentum_initialized());  // (written by the kernels; never follows)
}

void FusedSGD::check_state(const at::Tensor& p, const FusedSGDParamState& st, std::size_t g, std::size_t i) const {
  const at::Tensor& buf = st.momentum_buffer();
  if (buf.defined() && buf.is_sparse()) {
    // Kept by sparse grads, as torch::optim::SGD keeps it (a sparse grad's clone, updated by sparse ops).
    TORCH_CHECK(buf.sizes() == p.sizes() && buf.scalar_type() == p.scalar_type() && buf.device() == p.device(), name(),
                ": param group ", g, ", param ", i, ": state momentum_buffer (sparse) has shape ", buf.sizes(),
                ", dtype ", buf.scalar_type(), " on ", buf.device(), " but the parameter is ", p.sizes(), ", ",
                p.scalar_type(), " on ", p.device(), " (a checkpoint of another model?)");
  } else {
    sdk::check_state_tensor(buf, p, p.scalar_type(), name(), "momentum_buffer", g, i);
  }
  const at::Tensor& flag = st.momentum_initialized();
  TORCH_CHECK(!flag.defined() || (flag.numel() == 1 && flag.scalar_type() == at::kFloat && flag.device() == p.device()),
              name(), ": param group ", g, ", param ", i,
              ": state momentum_initialized must be a Float tensor of one element on the parameter's device");
}

bool FusedSGD::has_saved_state(const FusedSGDParamState& st) const {
  return !st.momentum_initialized().defined() || st.momentum_initialized().item<float>() != 0.f;
}

sdk::Launch FusedSGD::prepare_list(const sdk::ParamList& pl) {
  const auto& list = pl.entries;
  const c10::Device device = pl.device;
  const auto& o = options_of(pl.group);
  const fused::SgdHyper hyper =
      fused::make_sgd_hyper(o.lr(), o.momentum(), o.dampening(), o.weight_decay(), o.nesterov(), fused_.maximize());
  const bool momentum = o.momentum() != 0;
  const ScalarType st = pl.kernel_dtype();
  const std::size_t n = list.size();
  std::shared_ptr<SgdKept> kept = pl.slot.get<SgdKept>();
  const bool fresh = kept == nullptr;  // (and after momentum was switched: plan_key)
  if (fresh) {
    // The states and their momentum buffers, made where missing (on this
    // thread), and which buffers a step has not filled yet: on CPU (the
    // skip was decided on the host, so this step is applied) the kernel
    // fills them; on CUDA their device flag says so.
    kept = std::make_shared<SgdKept>();
    kept->states.assign(n, nullptr);
    kept->first.assign(n, 0);
    for (std::size_t i = 0; i < n && momentum; ++i) {
      const sdk::Entry& e = *list[i];
      const at::Tensor& p = e.param;
      FusedSGDParamState& s = state_for(e, [](FusedSGDParamState&) {});
      TORCH_CHECK(!s.momentum_buffer().defined() || !s.momentum_buffer().is_sparse(), name(), ": param group ", e.group,
                  ", param ", e.index,
                  ": the grad is dense but the momentum buffer is sparse (kept by earlier sparse grads); "
                  "torch::optim::SGD cannot add a dense grad to it either (sparse += dense)");
      const bool made = !s.momentum_buffer().defined();
      if (made) {
        sdk::refuse_under_capture(e, name(), "its momentum buffer");
        undo_on_failure([&s] { s.momentum_buffer(at::Tensor()); });
        // On CPU this step fills it; on CUDA it may be skipped on the device,
        // and a state never shows uninitialized memory.
        s.momentum_buffer(device.is_cpu() ? at::empty_like(p, at::MemoryFormat::Preserve)
                                          : at::zeros_like(p, at::MemoryFormat::Preserve));
        kept->first[i] = 1;
      }
      if (device.is_cuda() && !s.momentum_initialized().defined()) {
        // A loaded buffer is filled; a fresh one waits for its first applied step.
        sdk::refuse_under_capture(e, name(), "its momentum buffer's flag (made at the first step, and again at "
                                             "the first after load())");
        undo_on_failure([&s] { s.momentum_initialized(at::Tensor()); });
        s.momentum_initialized(at::full({1}, made ? 0.0 : 1.0, p.options().dtype(at::kFloat)));
      }
      kept->states[i] = &s;
    }
  }

  if (device.is_cpu()) {
    if (fresh) {
      kept->gather(pl, kCpuLists, kCpuParam, kCpuGrad, [&](std::size_t i, auto put) {
        if (momentum) put(kCpuBuffer, kept->states[i]->momentum_buffer());
      });
    } else {
      kept->refresh_grads(pl);
      // The buffers its first step made are filled: that step's launch ran.
      std::fill(kept->first.begin(), kept->first.end(), 0);
    }
    const double grad_factor = sdk::cpu_grad_factor(pl.signal);
    if (fresh) pl.slot.keep(kept);
    return [=] {
      const fused::cpu::SgdArgs args{sdk::cpu::plan_ref(*kept->plan), kept->list(kCpuParam), kept->list(kCpuGrad),
                                     momentum ? kept->list(kCpuBuffer) : nullptr, kept->first.data(), st, hyper,
                                     grad_factor};
      const fused::cpu::SgdFn kernel = fused::cpu::sgd_kernel(sdk::cpu::isa_for(*kept->plan));
      sdk::parallel_chunks(*kept->plan, [&](std::int64_t b, std::int64_t e) { kernel(args, b, e); });
    };
  }
#if defined(AMPFUSE_WITH_CUDA)
  const c10::cuda::CUDAGuard guard(device);
  if (fresh) {
    kept->launch.begin(pl, momentum ? 4 : 2, fused::cuda::kSgdParam, fused::cuda::kSgdGrad);
    for (std::size_t i = 0; i < n && momentum; ++i) {
      const FusedSGDParamState& s = *kept->states[i];
      kept->launch.put(fused::cuda::kSgdMomentumBuffer, i, s.momentum_buffer());
      kept->launch.put(fused::cuda::kSgdInitialized, i, s.momentum_initialized(), 1, ScalarType::Float32);
    }
  }
  const auto meta = kept->launch.meta_for(pl, fresh, fused::cuda::kSgdGrad);  // held by the Launch
  unsigned* counters = momentum ? workspace_->counters.get({pl.group, device, pl.dtype}, meta->launch.num_tensors) : nullptr;
  const sdk::SignalPointers sig = sdk::signal_pointers(pl.signal);
  const fused::cuda::SgdCudaArgs args{hyper, sig.found_inf, sig.inv_scale, sig.clip_coef, counters};
  if (fresh) pl.slot.keep(kept);
  return [=] {
    const c10::cuda::CUDAGuard launch_guard(device);
    fused::cuda::sgd(meta->launch, st, args, sdk::current_stream(device));
  };
#else
  TORCH_CHECK(false, name(), ": ampfuse was built without CUDA");
#endif
}

// A parameter whose grad is sparse, stepped with the ATen ops
// torch::optim::SGD runs, in its order, so its numbers bit for bit: the
// parameter gains -lr times the grad at its nonzeros (dense += sparse);
// with momentum, the first applied step keeps a clone of the (sparse) grad
// as the buffer and later ones scale it and add the grad (sparse ops, or
// dense += sparse on a dense buffer). Weight decay cannot add a dense term
// to a sparse grad (ATen refuses it, and so does LibTorch's SGD).
sdk::Launch FusedSGD::prepare_sparse(const sdk::Entry& e) {
  const auto& o = options_of(e.group);
  TORCH_CHECK(o.weight_decay() == 0, name(), ": param group ", e.group, ", param ", e.index,
              ": the grad is sparse and the group's weight_decay is ", o.weight_decay(),
              "; weight decay is not compatible with sparse gradients (as in torch::optim::SGD)");
  FusedSGDParamState* state = nullptr;
  bool first = false;
  if (o.momentum() != 0) {
    state = &state_for(e, [](FusedSGDParamState&) {});
    const at::Tensor& flag = state->momentum_initialized();
    // A dense buffer that no step has filled yet (CUDA) counts as none: this step makes it.
    first = !state->momentum_buffer().defined() || (flag.defined() && flag.item<float>() == 0.f);
    TORCH_CHECK(first || !o.nesterov() || state->momentum_buffer().is_sparse(), name(), ": param group ", e.group,
                ", param ", e.index,
                ": the grad is sparse, nesterov is on and the momentum buffer is dense (kept by earlier dense "
                "grads); torch::optim::SGD cannot add a dense buffer to a sparse grad either (sparse + dense)");
    // The launch adds sparse tensors to each other: the grad to a sparse
    // buffer (kept from earlier sparse grads), and with nesterov the buffer
    // to the grad. Where ATen cannot, torch::optim::SGD fails in the middle
    // of its step; refused here, before anything is written.
    const at::Tensor& buf = state->momentum_buffer();
    const bool sparse_buffer = !first && buf.is_sparse();
    TORCH_CHECK(!sparse_buffer || (buf.sparse_dim() == e.grad.sparse_dim() && buf.dense_dim() == e.grad.dense_dim()),
                name(), ": param group ", e.group, ", param ", e.index, ": the grad is sparse with ",
                e.grad.sparse_dim(), " sparse and ", e.grad.dense_dim(),
                " dense dims, but the momentum buffer (kept from earlier sparse grads) has ", buf.sparse_dim(),
                " and ", buf.dense_dim(), "; ATen cannot add the two (torch::optim::SGD fails on them too)");
    // ATen adds without its kernel where either side has no nonzeros: with
    // nesterov, the grad is added to a buffer that holds its nonzeros.
    const bool adds_nonzeros = e.grad._nnz() > 0 && (o.nesterov() || (sparse_buffer && buf._nnz() > 0));
    TORCH_CHECK(!adds_nonzeros || !e.grad.device().is_cpu() || e.grad.scalar_type() != at::kHalf,
                name(), ": param group ", e.group, ", param ", e.index,
                ": the grad is a sparse fp16 tensor on CPU, and momentum adds it to a sparse buffer",
                o.nesterov() ? " (nesterov)" : "",
                "; ATen has no sparse + sparse add for fp16 on CPU (torch::optim::SGD fails on it too): use "
                "bf16 or fp32, or a dense grad");
  }
  const sdk::Entry* entry = &e;  // the step's entries outlive its launches
  return [entry, state, first, lr = o.lr(), momentum = o.momentum(), dampening = o.dampening(),
          nesterov = o.nesterov(), maximize = fused_.maximize()] {
    at::Tensor d_p = maximize ? entry->grad.neg() : entry->grad;
    if (state != nullptr) {
      at::Tensor buf;
      if (first) {
        buf = d_p.clone().detach();
        state->momentum_buffer(buf);
        state->momentum_initialized(at::Tensor());
      } else {
        buf = state->momentum_buffer();
        buf.mul_(momentum).add_(d_p, 1 - dampening);
      }
      d_p = nesterov ? d_p.add(buf, momentum) : buf;
    }
    entry->param.add_(d_p, -1 * lr);
  };
}

}  // namespace ampfuse
