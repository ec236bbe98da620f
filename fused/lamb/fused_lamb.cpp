// Torch adapter of FusedLAMB, on the SDK's optimizer base: options and state
// serialization, the global grad norm for max_grad_norm, and per list the
// two CPU passes (trust ratios on the host in between: no device there) or
// the two CUDA launches.

#include "ampfuse/fused_lamb.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <torch/optim/serialize.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <memory>
#include <string>

#include "ampfuse/tensor_ops.h"
#include "fused/lamb/lamb_cpu.h"

#if defined(AMPFUSE_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include "fused/lamb/lamb_cuda.h"
#endif

namespace ampfuse {

FusedLAMBOptions::FusedLAMBOptions(double lr) : lr_(lr) {}

void FusedLAMBOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(bias_correction);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(grad_averaging);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(max_grad_norm);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(use_nvlamb);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(trust_ratio_min);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(trust_ratio_max);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(master_weights);
}

void FusedLAMBOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, bias_correction);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, grad_averaging);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, max_grad_norm);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, use_nvlamb);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, trust_ratio_min);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, trust_ratio_max);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, master_weights);
}

void FusedLAMBParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(master);
}

void FusedLAMBParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, step);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg_sq);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, master);
}

namespace detail {

struct FusedLambWorkspace {
  // Sum of squares of all grads of the step, per device (max_grad_norm).
  std::vector<std::pair<c10::Device, at::Tensor>> grad_sum_sq;
  // Per device, kept across steps: the fp64 sum and the check's (unused)
  // found_inf, zeroed by memset on CUDA (no fill kernel, so the norm pass is
  // the step's only extra launch).
  std::map<std::string, std::pair<at::Tensor, at::Tensor>> norm_buffers;
#if defined(AMPFUSE_WITH_CUDA)
  sdk::TicketCounters counters;
#endif
  // Sharded (a reducer set): each CPU list's per-tensor [param, update]
  // sums of squares, and what finishes the list once they are reduced.
  sdk::TensorSumsReducer reducer;
  std::vector<sdk::TensorSums> pending_sums;
  std::vector<std::function<void()>> pending_apply;
};

}  // namespace detail

namespace {

// A count of steps: a whole number from 0 to 2^53 (NaN, a negative, a
// fraction or an infinite count made every parameter NaN at the next step).
bool is_step_count(double step) { return step >= 0 && step <= 9007199254740992.0 && step == std::floor(step); }
void check_step_count(double step, const char* name, std::size_t g, std::size_t i) {
  TORCH_CHECK(is_step_count(step), name, ": param group ", g, ", param ", i, ": state step is ", step,
              "; it counts steps: a whole number from 0 to 2^53");
}

fused::LambHyper make_hyper(const FusedLAMBOptions& o) {
  fused::LambHyper h;
  h.lr = o.lr();
  h.beta1 = std::get<0>(o.betas());
  h.beta2 = std::get<1>(o.betas());
  h.beta1_f64 = std::get<0>(o.betas());
  h.beta2_f64 = std::get<1>(o.betas());
  h.beta3 = o.grad_averaging() ? 1.0 - std::get<0>(o.betas()) : 1.0;
  h.one_minus_beta2 = 1.0 - std::get<1>(o.betas());
  h.eps = o.eps();
  h.weight_decay = o.weight_decay();
  h.bias_correction = o.bias_correction();
  h.use_trust_ratio = o.weight_decay() != 0.0 || o.use_nvlamb();
  h.trust_ratio_min = o.trust_ratio_min();
  h.trust_ratio_max = o.trust_ratio_max();
  h.max_grad_norm = o.max_grad_norm();
  return h;
}

// The moments' dtype: fp32 (apex), fp64 for fp64 parameters.
c10::ScalarType lamb_state_dtype(const at::Tensor& p) {
  return p.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

void check_options(const FusedLAMBOptions& o, std::size_t g) {
  const double b1 = std::get<0>(o.betas()), b2 = std::get<1>(o.betas());
  TORCH_CHECK(o.lr() >= 0, "FusedLAMB: param group ", g, ": invalid lr ", o.lr());
  TORCH_CHECK(b1 >= 0 && b1 < 1 && b2 >= 0 && b2 < 1, "FusedLAMB: param group ", g, ": betas must be in [0, 1), got (",
              b1, ", ", b2, ")");
  // eps > 0: u = m_hat / (sqrt(v_hat) + eps) must be finite where m = v = 0.
  TORCH_CHECK(o.eps() > 0, "FusedLAMB: param group ", g, ": eps must be > 0, got ", o.eps());
  TORCH_CHECK(o.weight_decay() >= 0, "FusedLAMB: param group ", g, ": invalid weight_decay ", o.weight_decay());
  TORCH_CHECK(o.max_grad_norm() >= 0, "FusedLAMB: param group ", g, ": invalid max_grad_norm ", o.max_grad_norm());
  TORCH_CHECK(o.trust_ratio_min() >= 0 && o.trust_ratio_min() <= o.trust_ratio_max(), "FusedLAMB: param group ", g,
              ": trust ratio clamp [", o.trust_ratio_min(), ", ", o.trust_ratio_max(), "] is empty or negative");
}

}  // namespace

FusedLAMB::FusedLAMB(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, FusedLAMBOptions defaults)
    : FusedOptimizer(param_groups, std::make_unique<FusedLAMBOptions>(defaults)),
      workspace_(std::make_unique<detail::FusedLambWorkspace>()) {}

FusedLAMB::FusedLAMB(std::vector<at::Tensor> params, FusedLAMBOptions defaults)
    : FusedLAMB({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

FusedLAMB::~FusedLAMB() = default;

void FusedLAMB::follow_param(const at::Tensor& p, FusedLAMBParamState& st, const sdk::Follow& follow) {
  follow(st.exp_avg(), lamb_state_dtype(p));
  follow(st.exp_avg_sq(), lamb_state_dtype(p));
  follow(st.master(), at::kFloat);
  follow.seen(st.step());  // (advanced by every step; never follows)
}

void FusedLAMB::check_state(const at::Tensor& p, const FusedLAMBParamState& st, std::size_t g, std::size_t i) const {
  sdk::check_required_state_tensor(st.exp_avg(), p, lamb_state_dtype(p), name(), "exp_avg", g, i);
  sdk::check_required_state_tensor(st.exp_avg_sq(), p, lamb_state_dtype(p), name(), "exp_avg_sq", g, i);
  sdk::check_state_tensor(st.master(), p, at::kFloat, name(), "master", g, i);
  TORCH_CHECK(st.step().defined() && st.step().numel() == 1 && st.step().scalar_type() == at::kDouble &&
                  st.step().device() == p.device(),
              name(), ": param group ", g, ", param ", i,
              ": state step must be a Double tensor of one element on the parameter's device");
}

void FusedLAMB::check_loaded_state(const at::Tensor& p, const FusedLAMBParamState& st, std::size_t g,
                                   std::size_t i) const {
  check_state(p, st, g, i);
  // Read here on CUDA too (the read waits for the device); on CPU every step reads it (prepare_list).
  check_step_count(st.step().item<double>(), name(), g, i);
}

void FusedLAMB::check_entries(const std::vector<sdk::Entry>& entries) const {
  for (std::size_t g = 0; g < param_groups().size(); ++g) check_options(options_of(g), g);
  for (const sdk::Entry& e : entries)
    TORCH_CHECK(!options_of(e.group).master_weights() || (e.dtype != at::kFloat && e.dtype != at::kDouble), name(),
                ": param group ", e.group, ", param ", e.index, ": master_weights asked for on a ", e.dtype,
                " parameter; it is for Half and BFloat16 parameters");
}

// master_weights decides which state a group's step keeps: switching it
// starts the step plan over (check_entries sees it, prepare_list starts
// from a fresh slot).
std::uint64_t FusedLAMB::plan_key(std::size_t group) const {
  return options_of(group).master_weights() ? 1 : 0;
}

void FusedLAMB::set_tensor_sums_reducer(sdk::TensorSumsReducer reducer) {
  workspace_->reducer = std::move(reducer);
}

void FusedLAMB::begin_step(const std::vector<const sdk::Entry*>& entries, const StepSignals*) {
  // Options set since the step plan was made (check_entries ran then) are
  // checked at every step, before anything is written: an eps of 0 set
  // mid-run made NaN where m = v = 0 instead of being refused.
  for (std::size_t g = 0; g < param_groups().size(); ++g) check_options(options_of(g), g);
  auto& sums = workspace_->grad_sum_sq;
  sums.clear();
  workspace_->pending_sums.clear();
  workspace_->pending_apply.clear();
  bool clip = false;
  for (std::size_t g = 0; g < param_groups().size(); ++g) {
    clip |= options_of(g).max_grad_norm() > 0;
    TORCH_CHECK(!(workspace_->reducer && options_of(g).max_grad_norm() > 0), "FusedLAMB: param group ", g,
                ": max_grad_norm under a sharded optimizer would clip by this rank's shard only; clip with "
                "GradScaler::clip_grad_norm_, which sums across the ranks");
  }
  if (workspace_->reducer)
    for (const sdk::Entry* e : entries)
      TORCH_CHECK(e->device.is_cpu(), "FusedLAMB: param group ", e->group, ", param ", e->index, " is on ",
                  e->device, ": under a sharded optimizer FusedLAMB runs on CPU only so far");
  if (!clip) return;
  // One read-only pass per device (and dtype) over every grad of the step:
  // the global norm, summed in fp64 on each device.
  for (const auto& [device, on_device] :
       sdk::group_by<c10::Device>(entries, [](const sdk::Entry* e) { return e->device; })) {
    std::vector<at::Tensor> grads;
    for (const sdk::Entry* e : on_device) grads.push_back(e->grad);
    auto& [sum, unused_found_inf] = workspace_->norm_buffers[device.str()];
    if (!sum.defined()) {
      const auto opts = at::TensorOptions().device(device);
      sum = at::empty({1}, opts.dtype(at::kDouble));
      unused_found_inf = at::empty({1}, opts.dtype(at::kFloat));
    }
#if defined(AMPFUSE_WITH_CUDA)
    if (device.is_cuda()) {
      const c10::cuda::CUDAGuard guard(device);
      const cudaStream_t stream = sdk::current_stream(device);
      TORCH_CHECK(cudaMemsetAsync(sum.data_ptr(), 0, sizeof(double), stream) == cudaSuccess &&
                      cudaMemsetAsync(unused_found_inf.data_ptr(), 0, sizeof(float), stream) == cudaSuccess,
                  "FusedLAMB: cudaMemsetAsync failed");
    } else
#endif
    {
      sum.zero_();
      unused_found_inf.zero_();
    }
    check_non_finite(grads, unused_found_inf, sum);
    sums.emplace_back(device, sum);
  }
  if (sums.size() > 1) {
    // Grads on several devices: every device gets the total (device copies;
    // a CPU total read from a CUDA sum waits for it).
    std::vector<at::Tensor> totals;
    for (const auto& [device, sum] : sums) {
      at::Tensor total = sum.clone();
      for (const auto& other : sums)
        if (other.first != device) total.add_(other.second.to(device));
      totals.push_back(total);
    }
    for (std::size_t i = 0; i < sums.size(); ++i) sums[i].second = totals[i];
  }
}

// Sharded: every rank hands its lists' per-tensor sums to the reducer once
// (also with none, so that the collective matches), then finishes them.
void FusedLAMB::end_step(const StepSignals* signals) {
  detail::FusedLambWorkspace& ws = *workspace_;
  if (!ws.reducer || sdk::cpu_step_skipped(signals)) return;
  ws.reducer(ws.pending_sums, /*columns=*/2);
  for (auto& apply : ws.pending_apply) apply();
  ws.pending_sums.clear();
  ws.pending_apply.clear();
}

namespace {

// What a list's step keeps while the step plan holds (sdk::ListSlot): its
// states and what was gathered from them, made on the list's first step;
// grads that moved are gathered again.
struct LambKept {
  std::vector<FusedLAMBParamState*> states;
  // The state tensors pointed to, held so that none is freed (and another
  // made at its address, which its state stamp would not tell apart) while
  // kept, with their storages (sdk::HeldState).
  sdk::HeldState held;
  std::vector<std::int64_t> numels;
  // CPU: the pointer arrays, the plan, and each step's counters and scalars.
  std::vector<void*> param, grad, m, v, masters;
  std::shared_ptr<const Plan> plan;
  std::vector<double> steps;
  std::vector<fused::LambStepScalars> scalars;
#if defined(AMPFUSE_WITH_CUDA)
  sdk::KeptLaunch launch;
  std::vector<at::Tensor> empty_steps;  // counters of zero-element parameters
#endif
};

}  // namespace

sdk::Launch FusedLAMB::prepare_list(const sdk::ParamList& pl) {
  const FusedLAMBOptions& o = options_of(pl.group);
  const fused::LambHyper hyper = make_hyper(o);
  const c10::Device device = pl.device;
  const ScalarType st = pl.kernel_dtype();
  const bool master = o.master_weights();
  const auto& list = pl.entries;
  const std::size_t n = list.size();

  std::shared_ptr<LambKept> kept = pl.slot.get<LambKept>();
  const bool fresh = kept == nullptr;  // (and after master_weights was switched: plan_key)
  if (fresh) {
    kept = std::make_shared<LambKept>();
    const at::Tensor& first = list.front()->param;
    sdk::SmallStatePool steps(first.options().dtype(at::kDouble));
    sdk::SmallStatePool moments(first.options().dtype(lamb_state_dtype(first)));
    for (const sdk::Entry* e : list)
      if (e->state == nullptr) {
        steps.reserve({1});
        moments.reserve(e->param, 2);
      }
    for (std::size_t i = 0; i < n; ++i) {
      const sdk::Entry& e = *list[i];
      const at::Tensor& p = e.param;
      FusedLAMBParamState& s = state_for(e, [&](FusedLAMBParamState& made) {
        made.step(steps.take({1}));
        made.exp_avg(moments.take(p));
        made.exp_avg_sq(moments.take(p));
      });
      // A master kept from steps with master_weights on is dropped while it
      // is off: the kernel writes the parameter alone, which leaves its
      // version counter as it was, so the master would look current when the
      // option comes back and put the parameter back where it was then.
      if (!master && s.master().defined()) {
        undo_on_failure([&s, kept_master = s.master()] { s.master(kept_master); });
        s.master(at::Tensor());
      }
      kept->states.push_back(&s);
      kept->numels.push_back(p.numel());
    }
  }
  // Masters made here are fresh; an existing one is refreshed when the
  // parameter was written from outside (its version is read every step).
  if (master)
    for (std::size_t i = 0; i < n; ++i) prepare_master(*list[i], *kept->states[i]);
  if (fresh)
    for (const FusedLAMBParamState* s : kept->states)
      for (const at::Tensor* t : {&s->step(), &s->exp_avg(), &s->exp_avg_sq(), &s->master()})
        if (t->defined()) kept->held.hold(*t);
  const std::vector<FusedLAMBParamState*>& states = kept->states;
  at::Tensor grad_sum_sq;
  for (const auto& [d, sum] : workspace_->grad_sum_sq)
    if (d == device) grad_sum_sq = sum;

  if (device.is_cpu()) {
    if (fresh) {
      for (auto* ptrs : {&kept->param, &kept->grad, &kept->m, &kept->v, &kept->masters}) ptrs->assign(n, nullptr);
      sdk::fill_entries(n, [&](std::size_t i) {
        kept->param[i] = sdk::writable_data(list[i]->param);
        kept->grad[i] = list[i]->grad_data();
        kept->m[i] = sdk::writable_data(states[i]->exp_avg());
        kept->v[i] = sdk::writable_data(states[i]->exp_avg_sq());
        if (master) kept->masters[i] = sdk::writable_data(states[i]->master());
      });
      kept->plan = std::make_shared<const Plan>(kept->numels, sdk::cpu::kChunkSize);
    } else if (pl.grads_moved) {
      sdk::parallel_entries(n, [&](std::size_t i) { kept->grad[i] = list[i]->grad_data(); });
    }
    std::vector<double>& steps = kept->steps;
    steps.resize(n);
    std::atomic<bool> bad_count{false};
    sdk::parallel_entries(n, [&](std::size_t i) {
      const double step = *states[i]->step().const_data_ptr<double>();
      if (!is_step_count(step)) bad_count.store(true, std::memory_order_relaxed);
      steps[i] = step + 1.0;
    });
    // A count set from outside since load() (which checks it) is refused as load() refuses it, before any write.
    if (bad_count.load())
      for (std::size_t i = 0; i < n; ++i)
        check_step_count(*states[i]->step().const_data_ptr<double>(), name(), list[i]->group, list[i]->index);
    sdk::per_tensor(steps, kept->scalars, [&](double step) { return fused::lamb_step_scalars<double>(hyper, step); });
    const double grad_factor = sdk::cpu_grad_factor(pl.signal);
    const bool f64 = st == ScalarType::Float64;
    const std::shared_ptr<const Plan> plan = kept->plan;
    detail::FusedLambWorkspace* workspace = workspace_.get();
    if (fresh) pl.slot.keep(kept);
    return [=] {
      const std::vector<FusedLAMBParamState*>& states = kept->states;
      // inv_scale * clip_coef * the max_grad_norm factor (lamb_math.h), as the CUDA kernels compute it.
      const double* sum_sq = grad_sum_sq.defined() ? grad_sum_sq.const_data_ptr<double>() : nullptr;
      const double factor = f64 ? fused::lamb_total_grad_factor(hyper, grad_factor, sum_sq)
                                : fused::lamb_total_grad_factor(hyper.as<float>(), grad_factor, sum_sq);
      std::vector<double> chunk_param_sq(static_cast<std::size_t>(plan->num_chunks()));
      std::vector<double> chunk_update_sq(chunk_param_sq.size());
      std::vector<double> neg_step(states.size(), 0.0);
      const fused::cpu::LambArgs args{sdk::cpu::plan_ref(*plan), kept->param.data(), kept->grad.data(), kept->m.data(),
                                      kept->v.data(), master ? kept->masters.data() : nullptr, st,
                                      kept->scalars.data(), hyper, factor, chunk_param_sq.data(),
                                      chunk_update_sq.data(), neg_step.data()};
      const fused::cpu::LambFn moments = fused::cpu::lamb_moments_kernel();
      sdk::parallel_chunks(*plan, [&](std::int64_t b, std::int64_t e) { moments(args, b, e); });
      // Per-tensor sums of squares from the chunks' sums, in chunk order (deterministic).
      at::Tensor sums = at::zeros({static_cast<std::int64_t>(states.size()), 2}, at::kDouble);
      double* s = sums.data_ptr<double>();
      for (std::size_t k = 0; k < plan->tensors().size(); ++k) {
        double ps = 0.0, us = 0.0;
        for (std::int64_t c = plan->chunk_offsets()[k]; c < plan->chunk_offsets()[k + 1]; ++c) {
          ps += chunk_param_sq[c];
          us += chunk_update_sq[c];
        }
        s[2 * plan->tensors()[k]] = ps;
        s[2 * plan->tensors()[k] + 1] = us;
      }
      // The update, from the sums: now, or (sharded) once every list's sums
      // are reduced over the whole tensors, in end_step.
      auto apply_from_sums = [=]() mutable {
        const std::vector<FusedLAMBParamState*>& states = kept->states;
        const double* r = sums.data_ptr<double>();
        for (std::size_t i = 0; i < states.size(); ++i)
          neg_step[i] = f64 ? fused::lamb_neg_step(hyper, std::sqrt(r[2 * i]), std::sqrt(r[2 * i + 1]))
                            : fused::lamb_neg_step(hyper.as<float>(), static_cast<float>(std::sqrt(r[2 * i])),
                                                   static_cast<float>(std::sqrt(r[2 * i + 1])));
        fused::cpu::LambArgs a = args;
        a.neg_step = neg_step.data();
        a.chunk_param_sq = a.chunk_update_sq = nullptr;  // pass 1's, gone when this runs later
        const fused::cpu::LambFn apply = fused::cpu::lamb_apply_kernel();
        sdk::parallel_chunks(*plan, [&](std::int64_t b, std::int64_t e) { apply(a, b, e); });
        sdk::fill_entries(states.size(), [&](std::size_t i) {
          *static_cast<double*>(sdk::writable_data(states[i]->step())) = kept->steps[i];
        });
      };
      if (!workspace->reducer) {
        apply_from_sums();
        return;
      }
      std::vector<at::Tensor> params;
      for (const sdk::Entry* e : list) params.push_back(e->user_param());
      workspace->pending_sums.push_back({std::move(params), sums});
      workspace->pending_apply.push_back(std::move(apply_from_sums));
    };
  }
#if defined(AMPFUSE_WITH_CUDA)
  const c10::cuda::CUDAGuard guard(device);
  if (fresh) {
    TensorListsView& views = kept->launch.views;
    kept->launch.numels = kept->numels;
    views.lists.assign(fused::kLambLists, std::vector<TensorView>(n));
    auto set = [&](fused::LambList l, std::size_t i, void* data, std::int64_t numel, ScalarType t) {
      views.lists[list_index(l)][i] = {data, numel, t};
    };
    for (std::size_t i = 0; i < n; ++i) {
      const at::Tensor& p = list[i]->param;
      FusedLAMBParamState& s = *states[i];
      const std::int64_t numel = p.numel();
      if (numel == 0) kept->empty_steps.push_back(s.step());
      set(fused::LambList::kParam, i, p.data_ptr(), numel, st);
      set(fused::LambList::kGrad, i, list[i]->grad_data(), numel, st);
      const ScalarType state_st = to_scalar_type(lamb_state_dtype(p));
      set(fused::LambList::kExpAvg, i, s.exp_avg().data_ptr(), numel, state_st);
      set(fused::LambList::kExpAvgSq, i, s.exp_avg_sq().data_ptr(), numel, state_st);
      // The fp64 step travels as a pointer; its dtype tag is not read.
      set(fused::LambList::kStep, i, s.step().data_ptr(), 1, ScalarType::Float32);
      set(fused::LambList::kMaster, i, master ? s.master().data_ptr() : nullptr, numel, ScalarType::Float32);
    }
  }
  // Held by the Launch.
  const std::shared_ptr<const sdk::ListMeta> meta =
      kept->launch.meta_for(pl, fresh, list_index(fused::LambList::kGrad));
  const auto opts = at::TensorOptions().device(device);
  at::Tensor chunk_sums =
      at::empty({std::max<std::int64_t>(2 * meta->launch.num_chunks, 1)}, opts.dtype(at::kDouble));
  at::Tensor norms = at::empty({std::max<std::int64_t>(2 * meta->launch.num_tensors, 1)}, opts.dtype(at::kDouble));
  const sdk::SignalPointers sig = sdk::signal_pointers(pl.signal);
  const fused::cuda::LambCudaArgs args{master,
                                      hyper,
                                      sig.found_inf,
                                      sig.inv_scale,
                                      sig.clip_coef,
                                      grad_sum_sq.defined() ? grad_sum_sq.data_ptr<double>() : nullptr,
                                      chunk_sums.data_ptr<double>(),
                                      norms.data_ptr<double>(),
                                      workspace_->counters.get({pl.group, device, pl.dtype}, meta->launch.num_tensors)};
  const ScaleSignal* signal = pl.signal;
  if (fresh) pl.slot.keep(kept);
  return [=] {
    const c10::cuda::CUDAGuard launch_guard(device);
    fused::cuda::lamb(meta->launch, st, args, sdk::current_stream(device));
    (void)chunk_sums, (void)norms;  // the launch's workspaces: kept alive until here
    // Zero-element parameters have no chunk: advance their counters here.
    sdk::advance_step_counters(kept->empty_steps, signal);
  };
#else
  TORCH_CHECK(false, name(), ": ampfuse was built without CUDA");
#endif
}

}  // namespace ampfuse
