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
#include "contract/meta_cache.h"
#include "fused/adam_cuda.h"
#endif

namespace ampfuse {
namespace detail {

struct FusedAdamState {
  // Device step counters of CUDA parameters (fp32, one element), by TensorImpl.
  std::unordered_map<const c10::TensorImpl*, at::Tensor> device_steps;
  // Zeroed ticket counters per launch list, by (group, device, dtype).
  std::map<std::tuple<std::size_t, std::string, int>, at::Tensor> counters;
};

}  // namespace detail

namespace {

struct Entry {
  std::size_t group;
  std::size_t index;
  at::Tensor param;
  at::Tensor grad;
};

bool supported_dtype(c10::ScalarType t) {
  return t == c10::ScalarType::Float || t == c10::ScalarType::Half || t == c10::ScalarType::BFloat16;
}

template <class State>
void check_state_tensor(const at::Tensor& s, const at::Tensor& p, const char* name, const char* what, std::size_t g,
                        std::size_t i) {
  if (!s.defined()) return;
  TORCH_CHECK(s.sizes() == p.sizes() && s.scalar_type() == p.scalar_type() && s.device() == p.device() &&
                  s.strides() == p.strides(),
              name, ": param group ", g, ", param ", i, ": state ", what, " has shape ", s.sizes(), ", dtype ",
              s.scalar_type(), " on ", s.device(), " but the parameter has shape ", p.sizes(), ", dtype ",
              p.scalar_type(), " on ", p.device(), " (a checkpoint of another model?)");
}

// Everything checked before the first write; returns the parameters with grads.
template <class Options, class State>
std::vector<Entry> validate(torch::optim::Optimizer& opt, const char* name, const StepSignals* signals) {
  std::vector<Entry> entries;
  std::unordered_map<const c10::TensorImpl*, std::pair<std::size_t, std::size_t>> seen;
  auto& groups = opt.param_groups();
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const auto& params = groups[g].params();
    for (std::size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& p = params[i];
      TORCH_CHECK(p.defined(), name, ": param group ", g, ", param ", i, " is undefined");
      const auto [it, inserted] = seen.emplace(p.unsafeGetTensorImpl(), std::make_pair(g, i));
      TORCH_CHECK(inserted, name, ": param group ", g, ", param ", i, " is also param ", it->second.second,
                  " of group ", it->second.first, "; a parameter may belong to one group only");
      TORCH_CHECK(supported_dtype(p.scalar_type()), name, ": param group ", g, ", param ", i, ": dtype ",
                  p.scalar_type(), " is not supported (expected Float, Half or BFloat16)");
      TORCH_CHECK(p.layout() == c10::kStrided && p.is_non_overlapping_and_dense(), name, ": param group ", g,
                  ", param ", i, " is not a dense tensor");
      const at::Tensor& grad = p.grad();
      if (!grad.defined()) continue;
      TORCH_CHECK(!grad.is_sparse(), name, ": param group ", g, ", param ", i,
                  ": the grad is sparse; sparse gradients are not supported");
      TORCH_CHECK(grad.scalar_type() == p.scalar_type(), name, ": param group ", g, ", param ", i, ": grad dtype ",
                  grad.scalar_type(), " differs from the parameter's ", p.scalar_type());
      TORCH_CHECK(grad.device() == p.device(), name, ": param group ", g, ", param ", i, ": grad is on ",
                  grad.device(), " but the parameter is on ", p.device());
      TORCH_CHECK(grad.sizes() == p.sizes(), name, ": param group ", g, ", param ", i, ": grad shape ", grad.sizes(),
                  " differs from the parameter's ", p.sizes());
      TORCH_CHECK(grad.strides() == p.strides(), name, ": param group ", g, ", param ", i, ": grad strides ",
                  grad.strides(), " differ from the parameter's ", p.strides());
      TORCH_CHECK(p.device().is_cpu() || p.device().is_cuda(), name, ": param group ", g, ", param ", i, " is on ",
                  p.device(), "; only CPU and CUDA are supported");
#if !defined(AMPFUSE_WITH_CUDA)
      TORCH_CHECK(p.device().is_cpu(), name, ": param group ", g, ", param ", i, " is on ", p.device(),
                  " but ampfuse was built without CUDA");
#endif
      TORCH_CHECK(!signals || signals->contains(p.device()), name, ": param group ", g, ", param ", i, " is on ",
                  p.device(), " but the scaler sent no signal for that device");
      auto state_it = opt.state().find(p.unsafeGetTensorImpl());
      if (state_it != opt.state().end()) {
        const auto& st = static_cast<const State&>(*state_it->second);
        check_state_tensor<State>(st.exp_avg(), p, name, "exp_avg", g, i);
        check_state_tensor<State>(st.exp_avg_sq(), p, name, "exp_avg_sq", g, i);
        check_state_tensor<State>(st.max_exp_avg_sq(), p, name, "max_exp_avg_sq", g, i);
      }
      entries.push_back({g, i, p, grad});
    }
  }
  return entries;
}

template <class State>
State& state_for(torch::optim::Optimizer& opt, const at::Tensor& p, bool amsgrad) {
  auto& slot = opt.state()[p.unsafeGetTensorImpl()];
  if (!slot) {
    auto st = std::make_unique<State>();
    st->step(0);
    st->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
    st->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    if (amsgrad) st->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    slot = std::move(st);
  }
  auto& st = static_cast<State&>(*slot);
  if (amsgrad && !st.max_exp_avg_sq().defined()) st.max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
  return st;
}

float host_value(const at::Tensor& t) { return t.defined() ? *t.to(at::kFloat).data_ptr<float>() : 1.f; }

template <class Options, class State>
void fused_adam_step(torch::optim::Optimizer& opt, detail::FusedAdamState& impl, const FusedAdamOptions& fused,
                     bool decoupled, const char* name, const StepSignals* signals) {
  at::NoGradGuard no_grad;
  const std::vector<Entry> entries = validate<Options, State>(opt, name, signals);

  // On CPU the skip is decided here (reading a CPU tensor is no device sync),
  // so a skipped step creates no state either. CUDA lists decide on the device.
  bool skip_cpu = false;
  if (signals)
    for (const auto& [device, s] : signals->all())
      if (device.is_cpu() && s.found_inf.defined() && s.found_inf.template item<float>() != 0.f) skip_cpu = true;

  // Lists by (group, device, dtype), in parameter order.
  std::vector<std::pair<std::tuple<std::size_t, c10::Device, c10::ScalarType>, std::vector<const Entry*>>> lists;
  for (const Entry& e : entries) {
    if (skip_cpu && e.param.device().is_cpu()) continue;
    const auto key = std::make_tuple(e.group, e.param.device(), e.param.scalar_type());
    auto it = std::find_if(lists.begin(), lists.end(), [&](const auto& l) { return l.first == key; });
    if (it == lists.end()) {
      lists.emplace_back(key, std::vector<const Entry*>{});
      it = std::prev(lists.end());
    }
    it->second.push_back(&e);
  }

  for (const auto& [key, list] : lists) {
    const auto& [g, device, dtype] = key;
    const auto& o = static_cast<const Options&>(opt.param_groups()[g].options());
    const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    const fused::AdamHyper hyper =
        fused::make_adam_hyper(o.lr(), beta1, beta2, o.eps(), o.weight_decay(), o.amsgrad(), fused.maximize(), decoupled);
    const ScaleSignal* signal = signals ? &signals->at(device) : nullptr;

    std::vector<State*> states;
    std::vector<std::int64_t> numels;
    for (const Entry* e : list) {
      states.push_back(&state_for<State>(opt, e->param, o.amsgrad()));
      numels.push_back(e->param.numel());
    }

    if (device.is_cpu()) {
      const std::size_t n = list.size();
      std::vector<void*> param(n), grad(n), m(n), v(n), vmax(n, nullptr);
      std::vector<fused::AdamStepScalars> scalars(n);
      for (std::size_t i = 0; i < n; ++i) {
        param[i] = list[i]->param.data_ptr();
        grad[i] = list[i]->grad.data_ptr();
        m[i] = states[i]->exp_avg().data_ptr();
        v[i] = states[i]->exp_avg_sq().data_ptr();
        if (o.amsgrad()) vmax[i] = states[i]->max_exp_avg_sq().data_ptr();
        // Parameters of a group usually share their step: two pow() per
        // distinct step, not per tensor.
        const std::int64_t step = states[i]->step() + 1;
        scalars[i] = i > 0 && states[i - 1]->step() + 1 == step
                         ? scalars[i - 1]
                         : fused::adam_step_scalars(o.lr(), beta1, beta2, static_cast<double>(step));
      }
      float grad_factor = 1.f;
      if (signal) grad_factor = host_value(signal->inv_scale) * host_value(signal->clip_coef);
      const Plan plan(numels, cpu::kChunkSize);
      const fused::cpu::AdamArgs args{cpu::plan_ref(plan), param.data(), grad.data(), m.data(), v.data(),
                                      vmax.data(), to_scalar_type(dtype), scalars.data(), hyper, grad_factor};
      const fused::cpu::AdamFn kernel = fused::cpu::adam_kernel();
      at::parallel_for(0, plan.num_chunks(), 1, [&](std::int64_t b, std::int64_t e) { kernel(args, b, e); });
      for (State* st : states) st->step(st->step() + 1);
      continue;
    }
#if defined(AMPFUSE_WITH_CUDA)
    const c10::cuda::CUDAGuard guard(device);
    const auto stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
    const std::size_t n = list.size();
    TensorListsView views;
    views.lists.resize(o.amsgrad() ? 6 : 5);
    std::vector<at::Tensor> empty_steps;
    for (std::size_t i = 0; i < n; ++i) {
      const at::Tensor& p = list[i]->param;
      at::Tensor& step = impl.device_steps[p.unsafeGetTensorImpl()];
      if (!step.defined()) step = at::full({1}, static_cast<double>(states[i]->step()), p.options().dtype(at::kFloat));
      if (p.numel() == 0) empty_steps.push_back(step);
      const ScalarType st = to_scalar_type(dtype);
      views.lists[fused::cuda::kParam].push_back({p.data_ptr(), p.numel(), st});
      views.lists[fused::cuda::kGrad].push_back({list[i]->grad.data_ptr(), p.numel(), st});
      views.lists[fused::cuda::kExpAvg].push_back({states[i]->exp_avg().data_ptr(), p.numel(), st});
      views.lists[fused::cuda::kExpAvgSq].push_back({states[i]->exp_avg_sq().data_ptr(), p.numel(), st});
      views.lists[fused::cuda::kStep].push_back({step.data_ptr(), 1, ScalarType::Float32});
      if (o.amsgrad())
        views.lists[fused::cuda::kMaxExpAvgSq].push_back({states[i]->max_exp_avg_sq().data_ptr(), p.numel(), st});
    }
    const Plan plan(numels, cuda::kChunkSize);
    const std::vector<std::int64_t> words = cuda::pack_meta(views, plan);
    cuda::LaunchMeta meta;
    meta.depth = views.depth();
    meta.num_tensors = static_cast<std::int64_t>(plan.tensors().size());
    meta.chunk_size = plan.chunk_size();
    meta.num_chunks = plan.num_chunks();
    meta.host = words.data();
    if (meta.num_tensors > cuda::inline_capacity(meta.depth)) meta.device = detail::device_meta(words, device);
    at::Tensor& counters = impl.counters[std::make_tuple(g, device.str(), static_cast<int>(dtype))];
    if (!counters.defined() || counters.numel() < meta.num_tensors)
      counters = at::zeros({std::max<std::int64_t>(meta.num_tensors, 1)}, at::TensorOptions().dtype(at::kInt).device(device));
    fused::cuda::AdamCudaArgs args{hyper,
                                   o.lr(),
                                   beta1,
                                   beta2,
                                   signal ? signal->found_inf.data_ptr<float>() : nullptr,
                                   signal && signal->inv_scale.defined() ? signal->inv_scale.data_ptr<float>() : nullptr,
                                   signal && signal->clip_coef.defined() ? signal->clip_coef.data_ptr<float>() : nullptr,
                                   reinterpret_cast<unsigned*>(counters.data_ptr<std::int32_t>())};
    fused::cuda::adam(meta, to_scalar_type(dtype), args, stream);
    // Zero-element parameters have no chunk: advance their counters here.
    for (at::Tensor& step : empty_steps) {
      if (signal) step.add_((signal->found_inf == 0).to(at::kFloat));
      else step.add_(1);
    }
#endif
  }
}

constexpr const char* optimizer_name(bool decoupled) { return decoupled ? "FusedAdamW" : "FusedAdam"; }

}  // namespace

namespace detail {

template <class Base, class Options, class State, bool kDecoupled>
FusedAdamImpl<Base, Options, State, kDecoupled>::FusedAdamImpl(
    const std::vector<torch::optim::OptimizerParamGroup>& param_groups, Options defaults, FusedAdamOptions fused)
    : Base(param_groups, std::move(defaults)), fused_(fused), impl_(std::make_unique<FusedAdamState>()) {}

template <class Base, class Options, class State, bool kDecoupled>
FusedAdamImpl<Base, Options, State, kDecoupled>::FusedAdamImpl(std::vector<at::Tensor> params, Options defaults,
                                                               FusedAdamOptions fused)
    : FusedAdamImpl({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults), fused) {}

template <class Base, class Options, class State, bool kDecoupled>
FusedAdamImpl<Base, Options, State, kDecoupled>::~FusedAdamImpl() = default;

template <class Base, class Options, class State, bool kDecoupled>
at::Tensor FusedAdamImpl<Base, Options, State, kDecoupled>::step(typename Base::LossClosure closure) {
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  fused_adam_step<Options, State>(*this, *impl_, fused_, kDecoupled, optimizer_name(kDecoupled), nullptr);
  return loss;
}

template <class Base, class Options, class State, bool kDecoupled>
void FusedAdamImpl<Base, Options, State, kDecoupled>::step_with_signals(const StepSignals& signals) {
  fused_adam_step<Options, State>(*this, *impl_, fused_, kDecoupled, optimizer_name(kDecoupled), &signals);
}

template <class Base, class Options, class State, bool kDecoupled>
void FusedAdamImpl<Base, Options, State, kDecoupled>::sync_state() {
  for (const auto& entry : impl_->device_steps) {
    auto it = this->state().find(const_cast<c10::TensorImpl*>(entry.first));
    if (it != this->state().end())
      static_cast<State&>(*it->second).step(static_cast<std::int64_t>(entry.second.template item<float>()));
  }
}

template <class Base, class Options, class State, bool kDecoupled>
void FusedAdamImpl<Base, Options, State, kDecoupled>::save(torch::serialize::OutputArchive& archive) const {
  const_cast<FusedAdamImpl*>(this)->sync_state();
  Base::save(archive);
}

template <class Base, class Options, class State, bool kDecoupled>
void FusedAdamImpl<Base, Options, State, kDecoupled>::load(torch::serialize::InputArchive& archive) {
  Base::load(archive);
  impl_->device_steps.clear();  // restart from the loaded state's step
}

template class FusedAdamImpl<torch::optim::Adam, torch::optim::AdamOptions, torch::optim::AdamParamState, false>;
template class FusedAdamImpl<torch::optim::AdamW, torch::optim::AdamWOptions, torch::optim::AdamWParamState, true>;

}  // namespace detail
}  // namespace ampfuse
