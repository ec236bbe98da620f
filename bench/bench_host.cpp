// The host path of a step: 10,000 one-element fp32 parameters, where the
// kernels cost next to nothing, so the time is what a step spends per tensor
// on the host (validation, state lookup, pointer lists, metadata). On a GPU
// this is what bounds a step over many small tensors.
//   Host        FusedAdam::step against at::_fused_adam_ on the same lists and
//               torch::optim::Adam
//   HostMovedGrads  the same with new grad tensors at every step
//   HostLAMB    FusedLAMB::step (two passes and the trust ratios between them)
//               and ceiling_objects (below)
//   HostScaler  scaler.step(FusedAdam) + scaler.update() against PyTorch's
//               scaled fused path (_amp_foreach_non_finite_check_and_unscale_,
//               _fused_adam_ with found_inf, _foreach_sub_ of the steps,
//               _amp_update_scale_)
// bench/report.py shows ampfuse's time per parameter beside the table.
//
// ceiling_objects bounds what any step can reach here that checks, every
// step, that each parameter's storage, grad and state are those it was
// prepared for: one pass, on the same threads, that reads exactly those
// objects (the parameter's and the grad's TensorImpl and storage, the state
// map's entry and the state) and updates the element through pointers kept
// from the first step. It validates nothing, makes no pointer lists and is
// not all-or-nothing (a change found at one parameter comes after the
// earlier ones were written), so no real step reaches it.

#include <ampfuse/fused_adam.h>
#include <ampfuse/fused_lamb.h>
#include <ampfuse/grad_scaler.h>

#include <array>
#include <atomic>
#include <cmath>
#include <stdexcept>

#include "bench/common.h"

namespace ampfuse_bench {
namespace {

const ParamSet& host_set() {
  static const ParamSet set{"10000x1", std::vector<std::int64_t>(10000, 1)};
  return set;
}

// The address of t's first element, read through its storage.
const void* element_address(const c10::TensorImpl* t) {
  return static_cast<const char*>(t->unsafe_storage().unsafeGetStorageImpl()->data()) +
         t->storage_offset() * static_cast<std::int64_t>(t->itemsize());
}

// What ceiling_objects keeps from the first step of its own FusedAdam.
struct KeptObjects {
  std::shared_ptr<ampfuse::FusedAdam> opt;
  std::vector<const void*> param, grad;  // the addresses each step compares
  std::vector<ampfuse::FusedAdamParamState*> state;
  std::vector<float*> p, g, m, v;  // the element each step updates
};

void objects_ceiling_step(KeptObjects& k, double lr) {
  const auto& params = k.opt->param_groups()[0].params();
  const auto& states = k.opt->state();
  std::atomic<bool> changed{false};
  at::parallel_for(0, static_cast<std::int64_t>(params.size()), ampfuse::sdk::kEntriesGrain,
                   [&](std::int64_t b, std::int64_t e) {
    bool moved = false;
    std::int64_t scalars_step = -1;  // the step c1 and c2 are for: two pow() per distinct step, as FusedAdam
    float c1 = 1.f, c2 = 1.f;
    for (std::int64_t i = b; i < e; ++i) {
      const c10::TensorImpl* impl = params[static_cast<std::size_t>(i)].unsafeGetTensorImpl();
      const auto it = states.find(const_cast<c10::TensorImpl*>(impl));
      moved |= element_address(impl) != k.param[static_cast<std::size_t>(i)] ||
               element_address(impl->grad().unsafeGetTensorImpl()) != k.grad[static_cast<std::size_t>(i)] ||
               it == states.end() || it->second.get() != k.state[static_cast<std::size_t>(i)];
      ampfuse::FusedAdamParamState& s = *k.state[static_cast<std::size_t>(i)];
      const std::int64_t step = s.step() + 1;
      const float gr = *k.g[i], mi = 0.9f * *k.m[i] + 0.1f * gr, vi = 0.999f * *k.v[i] + 0.001f * gr * gr;
      if (step != scalars_step) {
        c1 = 1.f - std::pow(0.9f, static_cast<float>(step));
        c2 = 1.f - std::pow(0.999f, static_cast<float>(step));
        scalars_step = step;
      }
      *k.m[i] = mi;
      *k.v[i] = vi;
      *k.p[i] -= static_cast<float>(lr) / c1 * mi / (std::sqrt(vi / c2) + 1e-8f);
      s.step(step);
    }
    if (moved) changed = true;
  });
  if (changed) throw std::runtime_error("ceiling_objects: a parameter, grad or state changed");
}

}  // namespace

void register_host(torch::Device device) {
  const std::string tail = "/" + host_set().name + (device.is_cuda() ? "@cuda" : "");
  auto fopts = torch::TensorOptions().dtype(torch::kFloat).device(device);
  constexpr double kLr = 1e-4;
  auto data = [device]() -> OptimizerData& { return optimizer_data(host_set(), device); };
  const std::int64_t bytes = 28 * total_numel(host_set());
  register_one("Host/ours" + tail, device, [=] {
    auto opt = std::make_shared<ampfuse::FusedAdam>(data().params, torch::optim::AdamOptions(kLr));
    return Fn([=] { opt->step(); });
  }, bytes);
  // New grad tensors at every step, as after zero_grad() (which sets them to
  // none) and a backward: the plan sees every grad moved and checks each. Two
  // sets of grads take turns (swapping them costs a reference each).
  register_one("HostMovedGrads/ours" + tail, device, [=] {
    std::vector<torch::Tensor> params;
    for (const auto& p : data().params) params.push_back(p.detach().clone().requires_grad_());
    auto opt = std::make_shared<ampfuse::FusedAdam>(params, torch::optim::AdamOptions(kLr));
    auto sets = std::make_shared<std::array<std::vector<torch::Tensor>, 2>>();
    for (auto& set : *sets)
      for (const auto& p : params) set.push_back(torch::randn_like(p));
    auto turn = std::make_shared<int>(0);
    return Fn([=] {
      const auto& grads = (*sets)[static_cast<std::size_t>((*turn)++ & 1)];
      for (std::size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grads[i];
      opt->step();
    });
  }, bytes);
  register_one("HostLAMB/ours" + tail, device, [=] {
    auto opt = std::make_shared<ampfuse::FusedLAMB>(data().params, ampfuse::FusedLAMBOptions(kLr));
    return Fn([=] { opt->step(); });
  }, bytes);
  if (!device.is_cuda())
    register_one("Host/ceiling_objects" + tail, device, [=] {
      auto k = std::make_shared<KeptObjects>();
      k->opt = std::make_shared<ampfuse::FusedAdam>(data().params, torch::optim::AdamOptions(kLr));
      k->opt->step();  // makes the states
      for (const auto& p : k->opt->param_groups()[0].params()) {
        auto& s = static_cast<ampfuse::FusedAdamParamState&>(*k->opt->state().at(p.unsafeGetTensorImpl()));
        k->param.push_back(element_address(p.unsafeGetTensorImpl()));
        k->grad.push_back(element_address(p.grad().unsafeGetTensorImpl()));
        k->state.push_back(&s);
        k->p.push_back(p.data_ptr<float>());
        k->g.push_back(p.grad().data_ptr<float>());
        k->m.push_back(s.exp_avg().data_ptr<float>());
        k->v.push_back(s.exp_avg_sq().data_ptr<float>());
      }
      return Fn([=] { objects_ceiling_step(*k, kLr); });
    }, bytes);
  register_one("Host/torch_optim_adam" + tail, device, [=] {
    auto opt = std::make_shared<torch::optim::Adam>(data().params, torch::optim::AdamOptions(kLr));
    return Fn([=] { opt->step(); });
  }, bytes);
  register_one("Host/aten_fused_adam" + tail, device, [=] {
    return Fn([=] {
      OptimizerData& d = data();
      at::_foreach_add_(d.steps, 1);
      at::_fused_adam_(detached(d.params), d.grads, d.exp_avg, d.exp_avg_sq, {}, d.steps, kLr, 0.9, 0.999, 0.0, 1e-8,
                       false, false);
    });
  }, bytes);
  register_one("HostScaler/ours" + tail, device, [=] {
    auto opt = std::make_shared<ampfuse::FusedAdam>(data().params, torch::optim::AdamOptions(kLr));
    auto scaler =
        std::make_shared<ampfuse::GradScaler>(ampfuse::GradScalerOptions().init_scale(1.0).growth_interval(1 << 30));
    scaler->scale(torch::ones({}, fopts));
    return Fn([=] {
      scaler->step(*opt);
      scaler->update();
    });
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
      at::_fused_adam_(detached(d.params), d.grads, d.exp_avg, d.exp_avg_sq, {}, d.steps, kLr, 0.9, 0.999, 0.0, 1e-8,
                       false, false, scale, found);
      at::_foreach_sub_(d.steps, std::vector<at::Tensor>(d.steps.size(), found));
      at::_amp_update_scale_(scale, tracker, found, 2.0, 0.5, 1 << 30);
    });
  }, bytes);
}

}  // namespace ampfuse_bench
