// Torch adapter of FusedAdam / FusedAdamW: validation, state, grouping by
// (group, device, dtype), and the CPU or CUDA kernel per list.

#include "ampfuse/fused_adam.h"

#include <ATen/Parallel.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>

#include <map>
#include <tuple>

#include "ampfuse/tensor_ops.h"
#include "contract/cpu/kernels.h"
#include "fused/adam_cpu.h"

#if defined(AMPFUSE_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "contract/cuda/launch.h"
#include "fused/adam_cuda.h"
#endif

namespace ampfuse {
namespace detail {

struct FusedAdamState {
  // Device step counters of CUDA parameters (fp32, one element), by TensorImpl.
  std::unordered_map<const c10::TensorImpl*, at::Tensor> device_steps;
  // fp32 master copies (master_weights), by TensorImpl.
  std::unordered_map<const c10::TensorImpl*, at::Tensor> master;
#if defined(AMPFUSE_WITH_CUDA)
  sdk::TicketCounters counters;
#endif
  // capturable: per (group, device), the fp64 device lr and the host lr last copied into it.
  std::map<std::pair<std::size_t, std::string>, std::pair<at::Tensor, double>> lr_device;
};

}  // namespace detail

namespace {

// The moments' dtype: the param's (as LibTorch), fp32 with master weights, or bf16.
c10::ScalarType state_dtype(const at::Tensor& p, const FusedAdamOptions& fused) {
  if (fused.bf16_moments()) return at::kBFloat16;
  return fused.master_weights() ? at::kFloat : p.scalar_type();
}

// The fp32 master copy of p, made from p on first use (or when the one kept
// belongs to a freed parameter that had the same address). Not under CUDA
// graph capture (sdk::refuse_under_capture).
at::Tensor& master_for(detail::FusedAdamState& impl, const sdk::Entry& e, const char* name) {
  const at::Tensor& p = e.param;
  at::Tensor& m = impl.master[p.unsafeGetTensorImpl()];
  if (!m.defined() || m.sizes() != p.sizes() || m.device() != p.device()) {
    sdk::refuse_under_capture(e, name, "its fp32 master copy");
    m = p.detach().to(at::kFloat, /*non_blocking=*/false, /*copy=*/true, at::MemoryFormat::Preserve);
  }
  return m;
}

constexpr const char* optimizer_name(bool decoupled) { return decoupled ? "FusedAdamW" : "FusedAdam"; }

}  // namespace

namespace detail {

template <class Base, class Options, class State, bool kDecoupled>
const char* FusedAdamImpl<Base, Options, State, kDecoupled>::name() const {
  return optimizer_name(kDecoupled);
}

template <class Base, class Options, class State, bool kDecoupled>
void FusedAdamImpl<Base, Options, State, kDecoupled>::check_state(const at::Tensor& p, const State& st,
                                                                  std::size_t g, std::size_t i) const {
  const c10::ScalarType dtype = state_dtype(p, fused_);
  sdk::check_state_tensor(st.exp_avg(), p, dtype, name(), "exp_avg", g, i);
  sdk::check_state_tensor(st.exp_avg_sq(), p, dtype, name(), "exp_avg_sq", g, i);
  sdk::check_state_tensor(st.max_exp_avg_sq(), p, dtype, name(), "max_exp_avg_sq", g, i);
}

template <class Base, class Options, class State, bool kDecoupled>
void FusedAdamImpl<Base, Options, State, kDecoupled>::check_entries(const std::vector<sdk::Entry>& entries) const {
  if (!fused_.master_weights()) return;
  for (const sdk::Entry& e : entries)
    TORCH_CHECK(e.dtype != at::kFloat, name(), ": param group ", e.group, ", param ", e.index,
                ": master_weights asked for on a Float parameter; it is for Half and BFloat16 parameters");
}

template <class Base, class Options, class State, bool kDecoupled>
void FusedAdamImpl<Base, Options, State, kDecoupled>::step_list(const sdk::ParamList& pl) {
    const FusedAdamOptions& fused = fused_;
    detail::FusedAdamState& impl = *impl_;
    const auto& list = pl.entries;
    const c10::Device device = pl.device;
    const c10::ScalarType dtype = pl.dtype;
    const Options& o = this->options_of(pl.group);
    const bool decoupled = kDecoupled;
    const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    const fused::AdamHyper hyper =
        fused::make_adam_hyper(o.lr(), beta1, beta2, o.eps(), o.weight_decay(), o.amsgrad(), fused.maximize(), decoupled);
    const ScaleSignal* signal = pl.signal;
    const ScalarType st = pl.kernel_dtype();
    const c10::ScalarType state_st_torch = state_dtype(list.front()->param, fused);
    const ScalarType state_st = to_scalar_type(state_st_torch);
    const bool master = fused.master_weights();

    const std::size_t n = list.size();
    std::vector<State*> states(n);
    std::vector<bool> created(n);
    for (std::size_t i = 0; i < n; ++i) {  // creates state (first step): on this thread
      const at::Tensor& p = list[i]->param;
      const auto zeros = [&] { return at::zeros_like(p, p.options().dtype(state_st_torch), at::MemoryFormat::Preserve); };
      bool fresh = false;
      State& state = this->state_for(*list[i], [&](State& s) {
        s.step(0);
        s.exp_avg(zeros());
        s.exp_avg_sq(zeros());
      }, &fresh);
      if (o.amsgrad() && !state.max_exp_avg_sq().defined()) state.max_exp_avg_sq(zeros());
      states[i] = &state;
      created[i] = fresh;
    }
    std::vector<std::int64_t> numels(n);

    if (device.is_cpu()) {
      std::vector<void*> param(n), grad(n), m(n), v(n), vmax(n, nullptr), masters(n, nullptr);
      std::vector<std::int64_t> steps(n);
      if (master)  // may create the master copies: on this thread
        for (std::size_t i = 0; i < n; ++i) masters[i] = master_for(impl, *list[i], name()).data_ptr();
      sdk::parallel_entries(n, [&](std::size_t i) {
        numels[i] = list[i]->param.numel();
        param[i] = list[i]->param.data_ptr();
        grad[i] = list[i]->grad.data_ptr();
        m[i] = states[i]->exp_avg().data_ptr();
        v[i] = states[i]->exp_avg_sq().data_ptr();
        if (o.amsgrad()) vmax[i] = states[i]->max_exp_avg_sq().data_ptr();
        steps[i] = states[i]->step() + 1;
      });
      // Two pow() per distinct step, not per tensor.
      const auto scalars = sdk::per_tensor<std::int64_t, fused::AdamStepScalars>(steps, [&](std::int64_t step) {
        return fused::adam_step_scalars(o.lr(), beta1, beta2, static_cast<double>(step));
      });
      const Plan plan(numels, cpu::kChunkSize);
      const fused::cpu::AdamArgs args{cpu::plan_ref(plan), param.data(), grad.data(), m.data(), v.data(),
                                      vmax.data(), master ? masters.data() : nullptr, st, state_st,
                                      scalars.data(), hyper, sdk::cpu_grad_factor(signal)};
      const fused::cpu::AdamFn kernel = fused::cpu::adam_kernel();
      sdk::parallel_chunks(plan, [&](std::int64_t b, std::int64_t e) { kernel(args, b, e); });
      sdk::parallel_entries(n, [&](std::size_t i) { states[i]->step(steps[i]); });
      return;
    }
#if defined(AMPFUSE_WITH_CUDA)
    const c10::cuda::CUDAGuard guard(device);
    const auto stream = sdk::current_stream(device);
    TensorListsView views;
    views.lists.resize(fused::cuda::kAdamDepth);
    std::vector<at::Tensor> empty_steps;
    for (std::size_t i = 0; i < list.size(); ++i) {
      const at::Tensor& p = list[i]->param;
      at::Tensor& step = impl.device_steps[p.unsafeGetTensorImpl()];
      // New state, or a counter left by a freed parameter at the same
      // address: start from the state's step.
      if (!step.defined() || created[i] || step.device() != p.device()) {
        sdk::refuse_under_capture(*list[i], name(), "its device step counter (made at the first step, and again "
                                                    "at the first after load())");
        step = at::full({1}, static_cast<double>(states[i]->step()), p.options().dtype(at::kFloat));
      }
      numels[i] = p.numel();
      if (p.numel() == 0) empty_steps.push_back(step);
      views.lists[fused::cuda::kParam].push_back({p.data_ptr(), p.numel(), st});
      views.lists[fused::cuda::kGrad].push_back({list[i]->grad.data_ptr(), p.numel(), st});
      views.lists[fused::cuda::kExpAvg].push_back({states[i]->exp_avg().data_ptr(), p.numel(), state_st});
      views.lists[fused::cuda::kExpAvgSq].push_back({states[i]->exp_avg_sq().data_ptr(), p.numel(), state_st});
      views.lists[fused::cuda::kStep].push_back({step.data_ptr(), 1, ScalarType::Float32});
      views.lists[fused::cuda::kMaxExpAvgSq].push_back(
          {o.amsgrad() ? states[i]->max_exp_avg_sq().data_ptr() : nullptr, p.numel(), state_st});
      views.lists[fused::cuda::kMaster].push_back(
          {master ? master_for(impl, *list[i], name()).data_ptr() : nullptr, p.numel(), ScalarType::Float32});
    }
    const Plan plan(numels, cuda::kChunkSize);
    std::vector<std::int64_t> words;
    const cuda::LaunchMeta meta = sdk::make_launch_meta(views, plan, device, words);
    const double* lr_device = nullptr;
    if (fused.capturable()) {
      auto& [lr_tensor, copied] = impl.lr_device[{pl.group, device.str()}];
      if (sdk::stream_capturing(device)) {
        // Under capture the device lr is authoritative: a copy of the host lr
        // recorded here would overwrite lr_tensor() at every replay.
        TORCH_CHECK(lr_tensor.defined(), name(), ": param group ", pl.group,
                    ": capturable needs one step outside the CUDA graph capture (a warm-up step) first");
      } else if (!lr_tensor.defined()) {
        lr_tensor = at::full({1}, o.lr(), at::TensorOptions().dtype(at::kDouble).device(device));
        copied = o.lr();
      } else if (copied != o.lr()) {  // a scheduler changed the host lr: a fill kernel, no sync
        lr_tensor.fill_(o.lr());
        copied = o.lr();
      }
      lr_device = lr_tensor.data_ptr<double>();
    }
    const sdk::SignalPointers sig = sdk::signal_pointers(signal);
    const fused::cuda::AdamCudaArgs args{state_st, master, hyper, o.lr(), beta1, beta2, o.weight_decay(), lr_device,
                                         sig.found_inf, sig.inv_scale, sig.clip_coef,
                                         impl.counters.get({pl.group, device, dtype}, meta.num_tensors)};
    fused::cuda::adam(meta, st, args, stream);
    // Zero-element parameters have no chunk: advance their counters here.
    sdk::advance_step_counters(empty_steps, signal);
#endif
}

template <class Base, class Options, class State, bool kDecoupled>
FusedAdamImpl<Base, Options, State, kDecoupled>::FusedAdamImpl(
    const std::vector<torch::optim::OptimizerParamGroup>& param_groups, Options defaults, FusedAdamOptions fused)
    : sdk::FusedOptimizer<Base, Options, State>(param_groups, std::move(defaults)), fused_(fused), impl_(std::make_unique<FusedAdamState>()) {}

template <class Base, class Options, class State, bool kDecoupled>
FusedAdamImpl<Base, Options, State, kDecoupled>::FusedAdamImpl(std::vector<at::Tensor> params, Options defaults,
                                                               FusedAdamOptions fused)
    : FusedAdamImpl({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults), fused) {}

template <class Base, class Options, class State, bool kDecoupled>
FusedAdamImpl<Base, Options, State, kDecoupled>::~FusedAdamImpl() = default;

template <class Base, class Options, class State, bool kDecoupled>
at::Tensor FusedAdamImpl<Base, Options, State, kDecoupled>::lr_tensor(std::size_t group, c10::Device device) const {
  const auto it = impl_->lr_device.find({group, device.str()});
  return it == impl_->lr_device.end() ? at::Tensor() : it->second.first;
}

template <class Base, class Options, class State, bool kDecoupled>
void FusedAdamImpl<Base, Options, State, kDecoupled>::sync_state() {
  for (const auto& entry : impl_->device_steps) {
    auto it = this->state().find(const_cast<c10::TensorImpl*>(entry.first));
    if (it != this->state().end())
      static_cast<State&>(*it->second).step(static_cast<std::int64_t>(entry.second.template item<float>()));
  }
}

namespace {

// Archive key of a parameter's fp32 master copy (ignored by torch::optim::Adam).
std::string master_key(std::size_t group, std::size_t index) {
  return "ampfuse_master_weights_" + std::to_string(group) + "_" + std::to_string(index);
}

}  // namespace

template <class Base, class Options, class State, bool kDecoupled>
void FusedAdamImpl<Base, Options, State, kDecoupled>::save(torch::serialize::OutputArchive& archive) const {
  const_cast<FusedAdamImpl*>(this)->sync_state();
  Base::save(archive);
  const auto& groups = this->param_groups();
  for (std::size_t g = 0; g < groups.size(); ++g)
    for (std::size_t i = 0; i < groups[g].params().size(); ++i) {
      const auto it = impl_->master.find(groups[g].params()[i].unsafeGetTensorImpl());
      if (it != impl_->master.end()) archive.write(master_key(g, i), it->second);
    }
}

template <class Base, class Options, class State, bool kDecoupled>
void FusedAdamImpl<Base, Options, State, kDecoupled>::load(torch::serialize::InputArchive& archive) {
  Base::load(archive);
  impl_->device_steps.clear();  // restart from the loaded state's step
  impl_->master.clear();        // restart from the loaded masters, or from the parameters
  const auto& groups = this->param_groups();
  for (std::size_t g = 0; g < groups.size(); ++g)
    for (std::size_t i = 0; i < groups[g].params().size(); ++i) {
      const at::Tensor& p = groups[g].params()[i];
      at::Tensor saved;
      if (!archive.try_read(master_key(g, i), saved)) continue;
      TORCH_CHECK(saved.sizes() == p.sizes() && saved.scalar_type() == at::kFloat, optimizer_name(kDecoupled),
                  ": param group ", g, ", param ", i, ": the checkpoint's master copy has shape ", saved.sizes(),
                  " and dtype ", saved.scalar_type(), "; expected ", p.sizes(), " and Float");
      impl_->master[p.unsafeGetTensorImpl()] = saved.to(p.device());
    }
}

template class FusedAdamImpl<torch::optim::Adam, torch::optim::AdamOptions, torch::optim::AdamParamState, false>;
template class FusedAdamImpl<torch::optim::AdamW, torch::optim::AdamWOptions, torch::optim::AdamWParamState, true>;

}  // namespace detail
}  // namespace ampfuse
