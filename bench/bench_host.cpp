// The host path of a step: 10,000 one-element fp32 parameters, where the
// kernels cost next to nothing, so the time is what a step spends per tensor
// on the host (validation, state lookup, pointer lists, metadata). On a GPU
// this is what bounds a step over many small tensors.
//   Host        FusedAdam::step against at::_fused_adam_ on the same lists,
//               torch::optim::Adam and the two object ceilings (below)
//   HostMovedGrads  the same with new grad tensors at every step
//   HostGradsComeAndGo  new grads at every step, with a tenth of the
//               parameters without one, another tenth at each step (experts
//               of a mixture that no token was routed to), against
//               torch::optim::Adam on the same grads
//   HostLAMB    FusedLAMB::step (two passes and the trust ratios between them)
//   HostSGD, HostAdagrad, HostRMSprop  FusedSGD (momentum), FusedAdagrad and
//               FusedRMSprop against torch::optim's SGD, Adagrad and RMSprop
//   HostScaler  scaler.step(FusedAdam) + scaler.update() against PyTorch's
//               scaled fused path (_amp_foreach_non_finite_check_and_unscale_,
//               _fused_adam_ with found_inf, _foreach_sub_ of the steps,
//               _amp_update_scale_)
//   HostScalerMovedGrads  the same as ours with new grad tensors at every step
//   HostScalerGradsComeAndGo  the same as ours with HostGradsComeAndGo's grads
//   HostGroups  FusedAdam::step against torch::optim::Adam with the
//               parameters in 1,000 groups of 10 (a list per group: each
//               list's kernel runs on the calling thread, sdk::cpu::
//               chunks_grain, where it opened a parallel region)
// bench/report.py shows ampfuse's time per parameter beside the table.
//
// ceiling_objects bounds what any step can reach here that checks, every
// step, that each parameter's storage, grad and state are those it was
// prepared for: one pass, on the same threads, that reads exactly those
// objects (the parameter's and the grad's TensorImpl and storage, the state
// map's entry and the state) and updates the element through pointers kept
// from the first step. It validates nothing and makes no pointer lists. It is
// not all-or-nothing either (a change found at one parameter comes after the
// earlier ones were written); ceiling_objects_two_passes is: it checks every
// parameter, then updates every one, as a step that writes nothing before
// all is checked must.

#include <ampfuse/fused_adagrad.h>
#include <ampfuse/fused_adam.h>
#include <ampfuse/fused_lamb.h>
#include <ampfuse/fused_rmsprop.h>
#include <ampfuse/fused_sgd.h>
#include <ampfuse/grad_scaler.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <stdexcept>

#include "bench/common.h"
#include "contract/torch/data_address.h"

namespace ampfuse_bench {
namespace {

const ParamSet& host_set() {
  static const ParamSet set{"10000x1", std::vector<std::int64_t>(10000, 1)};
  return set;
}

// What the ceilings keep from the first step of their own FusedAdam.
struct KeptObjects {
  std::shared_ptr<ampfuse::FusedAdam> opt;
  std::vector<const void*> param, grad;  // the addresses each step compares
  std::vector<ampfuse::FusedAdamParamState*> state;
  std::vector<float*> p, g, m, v;  // the element each step updates
};

std::shared_ptr<KeptObjects> keep_objects(const std::vector<torch::Tensor>& params, double lr) {
  auto k = std::make_shared<KeptObjects>();
  k->opt = std::make_shared<ampfuse::FusedAdam>(params, torch::optim::AdamOptions(lr));
  k->opt->step();  // makes the states
  for (const auto& p : k->opt->param_groups()[0].params()) {
    auto& s = static_cast<ampfuse::FusedAdamParamState&>(*k->opt->state().at(p.unsafeGetTensorImpl()));
    k->param.push_back(ampfuse::sdk::data_address(p.unsafeGetTensorImpl()));
    k->grad.push_back(ampfuse::sdk::data_address(p.grad().unsafeGetTensorImpl()));
    k->state.push_back(&s);
    k->p.push_back(p.data_ptr<float>());
    k->g.push_back(p.grad().data_ptr<float>());
    k->m.push_back(s.exp_avg().data_ptr<float>());
    k->v.push_back(s.exp_avg_sq().data_ptr<float>());
  }
  return k;
}

// Whether parameter i, its grad or its state is not what `k` kept.
bool objects_changed(const KeptObjects& k, std::size_t i) {
  const c10::TensorImpl* impl = k.opt->param_groups()[0].params()[i].unsafeGetTensorImpl();
  const auto& states = k.opt->state();
  const auto it = states.find(const_cast<c10::TensorImpl*>(impl));
  using ampfuse::sdk::data_address;
  return data_address(impl) != k.param[i] || data_address(impl->grad().unsafeGetTensorImpl()) != k.grad[i] ||
         it == states.end() || it->second.get() != k.state[i];
}

// Adam on element i with FusedAdam's step counter; c1 and c2 are the bias
// corrections of *step_of_scalars, computed again when the step differs
// (two pow() per distinct step, as FusedAdam).
void update_element(const KeptObjects& k, std::size_t i, double lr, std::int64_t* step_of_scalars, float* c1,
                    float* c2) {
  ampfuse::FusedAdamParamState& s = *k.state[i];
  const std::int64_t step = s.step() + 1;
  if (step != *step_of_scalars) {
    *c1 = 1.f - std::pow(0.9f, static_cast<float>(step));
    *c2 = 1.f - std::pow(0.999f, static_cast<float>(step));
    *step_of_scalars = step;
  }
  const float g = *k.g[i], m = 0.9f * *k.m[i] + 0.1f * g, v = 0.999f * *k.v[i] + 0.001f * g * g;
  *k.m[i] = m;
  *k.v[i] = v;
  *k.p[i] -= static_cast<float>(lr) / *c1 * m / (std::sqrt(v / *c2) + 1e-8f);
  s.step(step);
}

// One pass (check, then update, per parameter) or two (check every
// parameter, then update every one: what an all-or-nothing step needs).
void objects_ceiling_step(const KeptObjects& k, double lr, bool two_passes) {
  const auto n = static_cast<std::int64_t>(k.state.size());
  std::atomic<bool> changed{false};
  auto pass = [&](bool check, bool update) {
    at::parallel_for(0, n, ampfuse::sdk::kEntriesGrain, [&](std::int64_t b, std::int64_t e) {
      bool moved = false;
      std::int64_t step_of_scalars = -1;
      float c1 = 1.f, c2 = 1.f;
      for (auto i = static_cast<std::size_t>(b); i < static_cast<std::size_t>(e); ++i) {
        if (check) moved = objects_changed(k, i) || moved;
        if (update) update_element(k, i, lr, &step_of_scalars, &c1, &c2);
      }
      if (moved) changed = true;
    });
  };
  if (two_passes) {
    pass(true, false);
    if (!changed) pass(false, true);
  } else {
    pass(true, true);
  }
  if (changed) throw std::runtime_error("ceiling_objects: a parameter, grad or state changed");
}

template <class T>
struct Tag {
  using type = T;
};

}  // namespace

// Copies of `params` whose grads are new tensors at every next(), as after
// zero_grad() (which sets them to none) and a backward: two sets of grads
// take turns (swapping them costs a reference each).
struct GradsTakingTurns {
  std::vector<torch::Tensor> params;
  std::array<std::vector<torch::Tensor>, 2> sets;
  int turn = 0;

  // every_nth > 0: in each set, one parameter in every_nth has no grad (a
  // different one in each set), as experts of a mixture that no token was
  // routed to in that step: the parameters with a grad change every step.
  explicit GradsTakingTurns(const std::vector<torch::Tensor>& of, std::size_t every_nth = 0) {
    for (const auto& p : of) params.push_back(p.detach().clone().requires_grad_());
    for (std::size_t s = 0; s < sets.size(); ++s)
      for (std::size_t i = 0; i < params.size(); ++i)
        sets[s].push_back(every_nth > 0 && i % every_nth == s * every_nth / 2 ? torch::Tensor()
                                                                             : torch::randn_like(params[i]));
  }
  void next() {
    const auto& grads = sets[static_cast<std::size_t>(turn++ & 1)];
    for (std::size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grads[i];
  }
};

void register_host(torch::Device device) {
  const std::string tail = "/" + host_set().name + (device.is_cuda() ? "@cuda" : "");
  auto fopts = torch::TensorOptions().dtype(torch::kFloat).device(device);
  constexpr double kLr = 1e-4;
  auto data = [device]() -> OptimizerData& { return optimizer_data(host_set(), device); };
  // The parameters and grads every Host contender shares are made now,
  // before any benchmark runs, as a model's are made before training. Made
  // at the first Host run, after the large sets had come and gone, their
  // 10,000 TensorImpls, storages and elements would lie scattered over the
  // heap those left, and every contender's time per parameter would depend
  // on which benchmarks happened to run first.
  data();
  const std::int64_t bytes = 28 * total_numel(host_set());
  register_one("Host/ours" + tail, device, [=] {
    auto opt = std::make_shared<ampfuse::FusedAdam>(data().params, torch::optim::AdamOptions(kLr));
    return Fn([=] { opt->step(); });
  }, bytes);
  // New grad tensors at every step: the plan sees every grad moved and checks each.
  register_one("HostMovedGrads/ours" + tail, device, [=] {
    auto turns = std::make_shared<GradsTakingTurns>(data().params);
    auto opt = std::make_shared<ampfuse::FusedAdam>(turns->params, torch::optim::AdamOptions(kLr));
    return Fn([=] {
      turns->next();
      opt->step();
    });
  }, bytes);
  // A tenth of the parameters without a grad, a different tenth at each step.
  for (const bool ours : {true, false})
    register_one(std::string("HostGradsComeAndGo/") + (ours ? "ours" : "torch_optim_adam") + tail, device, [=] {
      auto turns = std::make_shared<GradsTakingTurns>(data().params, 10);
      std::shared_ptr<torch::optim::Optimizer> opt;
      if (ours)
        opt = std::make_shared<ampfuse::FusedAdam>(turns->params, torch::optim::AdamOptions(kLr));
      else
        opt = std::make_shared<torch::optim::Adam>(turns->params, torch::optim::AdamOptions(kLr));
      return Fn([=] {
        turns->next();
        opt->step();
      });
    }, bytes);
  register_one("HostLAMB/ours" + tail, device, [=] {
    auto opt = std::make_shared<ampfuse::FusedLAMB>(data().params, ampfuse::FusedLAMBOptions(kLr));
    return Fn([=] { opt->step(); });
  }, bytes);
  // The other optimizers and their torch::optim counterparts: param, grad and
  // one state tensor each (SGD's momentum buffer, Adagrad's sum, RMSprop's
  // square_avg), read and written but the grad.
  const auto steps_of = [&](const std::string& op, auto make) {
    register_one(op + tail, device, [=] {
      auto opt = make(data().params);
      return Fn([=] { opt->step(); });
    }, 20 * total_numel(host_set()));
  };
  const auto both = [&](const std::string& op, const std::string& theirs, auto options, auto ours_tag, auto theirs_tag) {
    using Ours = typename decltype(ours_tag)::type;
    using Theirs = typename decltype(theirs_tag)::type;
    steps_of(op + "/ours", [options](const auto& params) { return std::make_shared<Ours>(params, options); });
    steps_of(op + "/" + theirs, [options](const auto& params) { return std::make_shared<Theirs>(params, options); });
  };
  both("HostSGD", "torch_optim_sgd", torch::optim::SGDOptions(kLr).momentum(0.9), Tag<ampfuse::FusedSGD>{},
       Tag<torch::optim::SGD>{});
  both("HostAdagrad", "torch_optim_adagrad", torch::optim::AdagradOptions(kLr), Tag<ampfuse::FusedAdagrad>{},
       Tag<torch::optim::Adagrad>{});
  both("HostRMSprop", "torch_optim_rmsprop", torch::optim::RMSpropOptions(kLr), Tag<ampfuse::FusedRMSprop>{},
       Tag<torch::optim::RMSprop>{});
  if (!device.is_cuda())
    for (const bool two_passes : {false, true})
      register_one(std::string("Host/") + (two_passes ? "ceiling_objects_two_passes" : "ceiling_objects") + tail,
                   device, [=] {
        auto k = keep_objects(data().params, kLr);
        return Fn([=] { objects_ceiling_step(*k, kLr, two_passes); });
      }, bytes);
  // 1,000 groups of 10: what each list costs beside the per-parameter work.
  const auto in_groups = [](const std::vector<torch::Tensor>& params) {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    for (std::size_t i = 0; i < params.size(); i += 10)
      groups.emplace_back(std::vector<torch::Tensor>(params.begin() + static_cast<std::ptrdiff_t>(i),
                                                     params.begin() + static_cast<std::ptrdiff_t>(std::min(i + 10, params.size()))));
    return groups;
  };
  register_one("HostGroups/ours" + tail, device, [=] {
    auto opt = std::make_shared<ampfuse::FusedAdam>(in_groups(data().params), torch::optim::AdamOptions(kLr));
    return Fn([=] { opt->step(); });
  }, bytes);
  register_one("HostGroups/torch_optim_adam" + tail, device, [=] {
    auto opt = std::make_shared<torch::optim::Adam>(in_groups(data().params), torch::optim::AdamOptions(kLr));
    return Fn([=] { opt->step(); });
  }, bytes);
  register_one("Host/torch_optim_adam" + tail, device, [=] {
    auto opt = std::make_shared<torch::optim::Adam>(data().params, torch::optim::AdamOptions(kLr));
    return Fn([=] { opt->step(); });
  }, bytes);
  register_one("Host/aten_fused_adam" + tail, device, [=] {
    return Fn([=] {
      OptimizerData& d = data();
      at::_foreach_add_(d.steps, 1);
      at::_fused_adam_(d.detached_params, d.grads, d.exp_avg, d.exp_avg_sq, {}, d.steps, kLr, 0.9, 0.999, 0.0, 1e-8,
                       false, false);
    });
  }, bytes);
  register_one("HostScaler/ours" + tail, device, [=] {
    return scaler_steps(std::make_shared<ampfuse::FusedAdam>(data().params, torch::optim::AdamOptions(kLr)), device);
  }, bytes);
  register_one("HostScalerMovedGrads/ours" + tail, device, [=] {
    auto turns = std::make_shared<GradsTakingTurns>(data().params);
    auto opt = std::make_shared<ampfuse::FusedAdam>(turns->params, torch::optim::AdamOptions(kLr));
    return scaler_steps(opt, device, 1.0, 0.0, [turns] { turns->next(); });
  }, bytes);
  register_one("HostScalerGradsComeAndGo/ours" + tail, device, [=] {
    auto turns = std::make_shared<GradsTakingTurns>(data().params, 10);
    auto opt = std::make_shared<ampfuse::FusedAdam>(turns->params, torch::optim::AdamOptions(kLr));
    return scaler_steps(opt, device, 1.0, 0.0, [turns] { turns->next(); });
  }, bytes);
  register_one("HostScaler/aten_fused_adam" + tail, device, [=] {
    auto found = torch::zeros({}, fopts);
    auto scale = torch::ones({}, fopts);
    auto tracker = torch::zeros({}, fopts.dtype(torch::kInt));
    return Fn([=]() mutable {
      OptimizerData& d = data();
      found.zero_();
      at::_amp_foreach_non_finite_check_and_unscale_(d.grads, found, scale);
      at::_foreach_add_(d.steps, 1);
      at::_fused_adam_(d.detached_params, d.grads, d.exp_avg, d.exp_avg_sq, {}, d.steps, kLr, 0.9, 0.999, 0.0, 1e-8,
                       false, false, scale, found);
      at::_foreach_sub_(d.steps, std::vector<at::Tensor>(d.steps.size(), found));
      at::_amp_update_scale_(scale, tracker, found, 2.0, 0.5, 1 << 30);
    });
  }, bytes);
}

}  // namespace ampfuse_bench
