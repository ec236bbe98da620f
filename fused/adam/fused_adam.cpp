// Torch adapter of FusedAdam / FusedAdamW: validation, state, grouping by
// (group, device, dtype), and the CPU or CUDA kernel per list.

#include "ampfuse/fused_adam.h"

#include <ATen/Parallel.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>

#include <memory>
#include <tuple>

#include "ampfuse/tensor_ops.h"
#include "contract/cpu/kernels.h"
#include "fused/adam/adam_cpu.h"

#if defined(AMPFUSE_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "contract/cuda/launch.h"
#include "fused/adam/adam_cuda.h"
#endif

namespace ampfuse {

template <class BaseState>
void FusedAdamParamStateT<BaseState>::serialize(torch::serialize::OutputArchive& archive) const {
  if (this->device_step().defined()) {  // the device counts: a sync, as any save from a GPU
    BaseState counted(*this);
    counted.step(static_cast<std::int64_t>(this->device_step().template item<double>()));
    counted.BaseState::serialize(archive);
  } else {
    BaseState::serialize(archive);
  }
  if (master().defined()) archive.write("master", master());
}

template <class BaseState>
void FusedAdamParamStateT<BaseState>::serialize(torch::serialize::InputArchive& archive) {
  BaseState::serialize(archive);
  at::Tensor saved;
  if (archive.try_read("master", saved)) master(saved);
}

template struct FusedAdamParamStateT<torch::optim::AdamParamState>;
template struct FusedAdamParamStateT<torch::optim::AdamWParamState>;

namespace detail {

struct FusedAdamWorkspace {
#if defined(AMPFUSE_WITH_CUDA)
  sdk::TicketCounters counters;
#endif
  sdk::DeviceScalars lr;  ///< capturable: the fp64 device lr per (group, device)
};

}  // namespace detail

namespace {

// The moments' dtype: the param's (as LibTorch), fp32 with master weights, or bf16.
c10::ScalarType state_dtype(const at::Tensor& p, const FusedAdamOptions& fused) {
  if (fused.bf16_moments()) return at::kBFloat16;
  return fused.master_weights() ? at::kFloat : p.scalar_type();
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
  sdk::check_state_tensor(st.master(), p, at::kFloat, name(), "master", g, i);
  const at::Tensor& step = st.device_step();
  TORCH_CHECK(!step.defined() || (step.numel() == 1 && step.scalar_type() == at::kDouble && step.device() == p.device()),
              name(), ": param group ", g, ", param ", i,
              ": state device_step must be a Double tensor of one element on the parameter's device");
}

template <class Base, class Options, class State, bool kDecoupled>
void FusedAdamImpl<Base, Options, State, kDecoupled>::check_entries(const std::vector<sdk::Entry>& entries) const {
  if (!fused_.master_weights()) return;
  for (const sdk::Entry& e : entries)
    TORCH_CHECK(e.dtype != at::kFloat, name(), ": param group ", e.group, ", param ", e.index,
                ": master_weights asked for on a Float parameter; it is for Half and BFloat16 parameters");
}

template <class Base, class Options, class State, bool kDecoupled>
void FusedAdamImpl<Base, Options, State, kDecoupled>::load(torch::serialize::InputArchive& archive) {
  sdk::FusedOptimizer<Base, Options, State>::load(archive);
  // Checkpoints written before the master copy moved into the state keep it
  // under a top-level key per parameter.
  const auto& groups = this->param_groups();
  for (std::size_t g = 0; g < groups.size(); ++g)
    for (std::size_t i = 0; i < groups[g].params().size(); ++i) {
      const at::Tensor& p = groups[g].params()[i];
      State* s = this->find_state(p);
      at::Tensor saved;
      if (s == nullptr || s->master().defined() ||
          !archive.try_read("ampfuse_master_weights_" + std::to_string(g) + "_" + std::to_string(i), saved))
        continue;
      TORCH_CHECK(saved.sizes() == p.sizes() && saved.scalar_type() == at::kFloat, name(), ": param group ", g,
                  ", param ", i, ": the checkpoint's master copy has shape ", saved.sizes(), " and dtype ",
                  saved.scalar_type(), "; expected ", p.sizes(), " and Float");
      s->master(saved.to(p.device()));
      s->master_version(p._version());
    }
}

template <class Base, class Options, class State, bool kDecoupled>
void FusedAdamImpl<Base, Options, State, kDecoupled>::after_load(const at::Tensor& param, State& state) {
  // The loaded master stands for the parameter as it is now: a write into
  // the parameter after this load (weights loaded next) refreshes it.
  state.master_version(param._version());
}

template <class Base, class Options, class State, bool kDecoupled>
sdk::Launch FusedAdamImpl<Base, Options, State, kDecoupled>::prepare_list(const sdk::ParamList& pl) {
  const auto& list = pl.entries;
  const c10::Device device = pl.device;
  const Options& o = this->options_of(pl.group);
  const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
  const fused::AdamHyper hyper = fused::make_adam_hyper(o.lr(), beta1, beta2, o.eps(), o.weight_decay(),
                                                        o.amsgrad(), fused_.maximize(), kDecoupled);
  const ScalarType st = pl.kernel_dtype();
  const c10::ScalarType state_st_torch = state_dtype(list.front()->param, fused_);
  const ScalarType state_st = to_scalar_type(state_st_torch);
  const bool master = fused_.master_weights();
  const bool on_cuda = device.is_cuda();

  const std::size_t n = list.size();
  std::vector<State*> states(n);
  for (std::size_t i = 0; i < n; ++i) {  // creates state (first step): on this thread
    const sdk::Entry& e = *list[i];
    const at::Tensor& p = e.param;
    const auto zeros = [&] { return at::zeros_like(p, p.options().dtype(state_st_torch), at::MemoryFormat::Preserve); };
    State& state = this->state_for(e, [&](State& s) {
      s.step(0);
      s.exp_avg(zeros());
      s.exp_avg_sq(zeros());
    });
    if (o.amsgrad() && !state.max_exp_avg_sq().defined()) {
      this->undo_on_failure([&state] { state.max_exp_avg_sq(at::Tensor()); });
      state.max_exp_avg_sq(zeros());
    }
    if (master) this->prepare_master(e, state);
    if (on_cuda && !state.device_step().defined()) {
      sdk::refuse_under_capture(e, name(), "its device step counter (made at the first step, and again at the "
                                           "first after load())");
      this->undo_on_failure([&state] { state.device_step(at::Tensor()); });
      state.device_step(at::full({1}, static_cast<double>(state.step()), p.options().dtype(at::kDouble)));
    }
    states[i] = &state;
  }
  // The launch starts by refreshing stale masters (a copy, no throw).

  std::vector<std::int64_t> numels(n);
  if (!on_cuda) {
    std::vector<void*> param(n), grad(n), m(n), v(n), vmax(n, nullptr), masters(n, nullptr);
    std::vector<std::int64_t> steps(n);
    sdk::parallel_entries(n, [&](std::size_t i) {
      numels[i] = list[i]->param.numel();
      param[i] = list[i]->param.data_ptr();
      grad[i] = list[i]->grad.data_ptr();
      m[i] = states[i]->exp_avg().data_ptr();
      v[i] = states[i]->exp_avg_sq().data_ptr();
      if (o.amsgrad()) vmax[i] = states[i]->max_exp_avg_sq().data_ptr();
      if (master) masters[i] = states[i]->master().data_ptr();
      steps[i] = states[i]->step() + 1;
    });
    // Two pow() per distinct step, not per tensor.
    auto scalars = sdk::per_tensor<std::int64_t, fused::AdamStepScalars>(steps, [&](std::int64_t step) {
      return fused::adam_step_scalars(o.lr(), beta1, beta2, static_cast<double>(step));
    });
    auto plan = std::make_shared<const Plan>(numels, sdk::cpu::kChunkSize);
    const float grad_factor = sdk::cpu_grad_factor(pl.signal);
    return [=, states = std::move(states), param = std::move(param),
            grad = std::move(grad), m = std::move(m), v = std::move(v),
            vmax = std::move(vmax), masters = std::move(masters), steps = std::move(steps),
            scalars = std::move(scalars)] {
      const fused::cpu::AdamArgs args{sdk::cpu::plan_ref(*plan), param.data(), grad.data(), m.data(), v.data(),
                                      vmax.data(), master ? masters.data() : nullptr, st, state_st,
                                      scalars.data(), hyper, grad_factor};
      const fused::cpu::AdamFn kernel = fused::cpu::adam_kernel();
      sdk::parallel_chunks(*plan, [&](std::int64_t b, std::int64_t e) { kernel(args, b, e); });
      sdk::parallel_entries(states.size(), [&](std::size_t i) { states[i]->step(steps[i]); });
    };
  }
#if defined(AMPFUSE_WITH_CUDA)
  const c10::cuda::CUDAGuard guard(device);
  TensorListsView views;
  views.lists.resize(fused::kAdamLists);
  std::vector<at::Tensor> empty_steps;
  for (std::size_t i = 0; i < n; ++i) {
    const at::Tensor& p = list[i]->param;
    State& s = *states[i];
    numels[i] = p.numel();
    if (p.numel() == 0) empty_steps.push_back(s.device_step());
    views.lists[list_index(fused::AdamList::kParam)].push_back({p.data_ptr(), p.numel(), st});
    views.lists[list_index(fused::AdamList::kGrad)].push_back({list[i]->grad.data_ptr(), p.numel(), st});
    views.lists[list_index(fused::AdamList::kExpAvg)].push_back({s.exp_avg().data_ptr(), p.numel(), state_st});
    views.lists[list_index(fused::AdamList::kExpAvgSq)].push_back({s.exp_avg_sq().data_ptr(), p.numel(), state_st});
    // The fp64 counter travels as a pointer; its dtype tag is not read.
    views.lists[list_index(fused::AdamList::kStep)].push_back({s.device_step().data_ptr(), 1, ScalarType::Float32});
    views.lists[list_index(fused::AdamList::kMaxExpAvgSq)].push_back(
        {o.amsgrad() ? s.max_exp_avg_sq().data_ptr() : nullptr, p.numel(), state_st});
    views.lists[list_index(fused::AdamList::kMaster)].push_back(
        {master ? s.master().data_ptr() : nullptr, p.numel(), ScalarType::Float32});
  }
  const Plan plan(numels, sdk::cuda::kChunkSize);
  const auto meta = sdk::make_launch_meta(views, plan, device);  // held by the Launch
  const double* lr_device = nullptr;
  if (fused_.capturable()) {
    bool created = false;
    lr_device = workspace_->lr.prepare(pl.group, device, o.lr(), name(), &created).template data_ptr<double>();
    if (created) this->undo_on_failure([this, g = pl.group, device] { workspace_->lr.erase(g, device); });
  }
  const sdk::SignalPointers sig = sdk::signal_pointers(pl.signal);
  const fused::cuda::AdamCudaArgs args{state_st, master, hyper, o.lr(), beta1, beta2, o.weight_decay(), lr_device,
                                       sig.found_inf, sig.inv_scale, sig.clip_coef,
                                       workspace_->counters.get({pl.group, device, pl.dtype}, meta->launch.num_tensors)};
  const ScaleSignal* signal = pl.signal;
  const bool capturable = fused_.capturable();
  const double lr = o.lr();
  const std::size_t group = pl.group;
  return [=, empty_steps = std::move(empty_steps)] {
    const c10::cuda::CUDAGuard launch_guard(device);
    if (capturable) workspace_->lr.refresh(group, device, lr);
    fused::cuda::adam(meta->launch, st, args, sdk::current_stream(device));
    // Zero-element parameters have no chunk: advance their counters here.
    sdk::advance_step_counters(empty_steps, signal);
  };
#else
  TORCH_CHECK(false, name(), ": ampfuse was built without CUDA");
#endif
}

template <class Base, class Options, class State, bool kDecoupled>
FusedAdamImpl<Base, Options, State, kDecoupled>::FusedAdamImpl(
    const std::vector<torch::optim::OptimizerParamGroup>& param_groups, Options defaults, FusedAdamOptions fused)
    : sdk::FusedOptimizer<Base, Options, State>(param_groups, std::move(defaults)),
      fused_(fused),
      workspace_(std::make_unique<FusedAdamWorkspace>()) {}

template <class Base, class Options, class State, bool kDecoupled>
FusedAdamImpl<Base, Options, State, kDecoupled>::FusedAdamImpl(std::vector<at::Tensor> params, Options defaults,
                                                               FusedAdamOptions fused)
    : FusedAdamImpl({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults), fused) {}

template <class Base, class Options, class State, bool kDecoupled>
FusedAdamImpl<Base, Options, State, kDecoupled>::~FusedAdamImpl() = default;

template <class Base, class Options, class State, bool kDecoupled>
at::Tensor FusedAdamImpl<Base, Options, State, kDecoupled>::lr_tensor(std::size_t group, c10::Device device) const {
  return workspace_->lr.find(group, device);
}

template <class Base, class Options, class State, bool kDecoupled>
void FusedAdamImpl<Base, Options, State, kDecoupled>::sync_state() {
  for (auto& entry : this->state()) {
    State& s = static_cast<State&>(*entry.second);
    if (s.device_step().defined()) s.step(static_cast<std::int64_t>(s.device_step().template item<double>()));
  }
}

template class FusedAdamImpl<torch::optim::Adam, torch::optim::AdamOptions, FusedAdamParamState, false>;
template class FusedAdamImpl<torch::optim::AdamW, torch::optim::AdamWOptions, FusedAdamWParamState, true>;

}  // namespace detail
}  // namespace ampfuse
