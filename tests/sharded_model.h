#pragma once
// The scenario of the distributed tests (tests/test_distributed.cpp with
// ranks as threads, tests/dist_rank.cpp with ranks as processes): one model,
// each rank holding every world-th parameter and its grads (as a sharded
// optimizer holds them), stepped under a GradScaler across the ranks; the
// ranks together must step as one process stepping the whole model. No
// GoogleTest here: mismatches come back as messages.

#include <ampfuse/ampfuse.h>
#include <ampfuse/zero.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace ampfuse_test::sharded {

/// The model's parameters and its grads for every step (the same on every
/// rank: drawn from one seed); an inf in parameter 5's grad at `inf_step`.
struct Model {
  std::vector<torch::Tensor> params;
  std::vector<std::vector<torch::Tensor>> grads;  // [step][param]
  int inf_step = -1;
};

inline Model make_model(std::uint64_t seed, int steps, int inf_step) {
  torch::manual_seed(seed);
  Model m;
  m.inf_step = inf_step;
  for (const std::int64_t n : {1000, 7, 65537, 1, 333, 4096}) m.params.push_back(torch::randn({n}));
  for (int s = 0; s < steps; ++s) {
    std::vector<torch::Tensor> g;
    for (const auto& p : m.params) g.push_back(torch::randn_like(p));
    if (s == inf_step) g[5][17] = std::numeric_limits<float>::infinity();
    m.grads.push_back(std::move(g));
  }
  return m;
}

/// What each step does: scale, unscale_ (classic: torch::optim::SGD) or not
/// (FusedAdam, the contract path), clip_grad_norm_ or not, step, update.
struct Flow {
  bool classic = false;
  bool clip = true;
};

/// After each step: every parameter, the scale and the returned norm.
struct Trace {
  std::vector<std::vector<torch::Tensor>> params;
  std::vector<double> scale, norm;
};

inline std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::vector<torch::Tensor>& p, const Flow& flow) {
  if (flow.classic) return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.01).momentum(0.9));
  return std::make_unique<ampfuse::FusedAdam>(p, torch::optim::AdamOptions(0.01).weight_decay(0.01));
}

inline ampfuse::GradScalerOptions scaler_options() {
  return ampfuse::GradScalerOptions().init_scale(1024.0).growth_interval(2);
}

/// Steps `held` (indices into the model) with `scaler`, recording a trace of them.
inline Trace run(const Model& model, const Flow& flow, const std::vector<std::size_t>& held,
                 ampfuse::GradScaler& scaler) {
  std::vector<torch::Tensor> params;
  for (const std::size_t k : held) params.push_back(model.params[k].detach().clone().requires_grad_());
  auto opt = make_optimizer(params, flow);
  Trace trace;
  for (std::size_t s = 0; s < model.grads.size(); ++s) {
    const float scale = static_cast<float>(scaler.get_scale());
    for (std::size_t j = 0; j < held.size(); ++j) params[j].mutable_grad() = model.grads[s][held[j]] * scale;
    scaler.scale(torch::ones({}));
    if (flow.classic) scaler.unscale_(*opt);
    trace.norm.push_back(flow.clip ? scaler.clip_grad_norm_(*opt, 50.0).item<double>() : 0.0);
    scaler.step(*opt);
    scaler.update();
    trace.scale.push_back(scaler.get_scale());
    std::vector<torch::Tensor> after;
    for (const auto& p : params) after.push_back(p.detach().clone());
    trace.params.push_back(std::move(after));
  }
  return trace;
}

/// The whole model in one process, one scaler without a group.
inline Trace whole(const Model& model, const Flow& flow) {
  std::vector<std::size_t> all(model.params.size());
  for (std::size_t k = 0; k < all.size(); ++k) all[k] = k;
  ampfuse::GradScaler scaler(scaler_options());
  return run(model, flow, all, scaler);
}

/// This rank's part, under a scaler across `group`, against the whole run:
/// the same skips and scales, the norm to 1e-6 (the same fp64 sum in another
/// order), every parameter to 1e-6. Returns what differs.
inline std::vector<std::string> check_rank(const Model& model, const Flow& flow, const Trace& expected, int rank,
                                           int world, const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  std::vector<std::size_t> held;
  for (std::size_t k = 0; k < model.params.size(); ++k)
    if (static_cast<int>(k % static_cast<std::size_t>(world)) == rank) held.push_back(k);
  ampfuse::GradScaler scaler(scaler_options().process_group(group));
  const Trace got = run(model, flow, held, scaler);
  std::vector<std::string> errors;
  const std::string who = "rank " + std::to_string(rank) + " of " + std::to_string(world);
  for (std::size_t s = 0; s < got.scale.size(); ++s) {
    const std::string where = who + ", step " + std::to_string(s) + ": ";
    if (got.scale[s] != expected.scale[s])
      errors.push_back(where + "scale " + std::to_string(got.scale[s]) + ", one process " +
                       std::to_string(expected.scale[s]));
    if (static_cast<int>(s) != model.inf_step && !(std::abs(got.norm[s] - expected.norm[s]) <= 1e-6 * expected.norm[s]))
      errors.push_back(where + "norm " + std::to_string(got.norm[s]) + ", one process " +
                       std::to_string(expected.norm[s]));
    for (std::size_t j = 0; j < held.size(); ++j) {
      const double diff = (got.params[s][j] - expected.params[s][held[j]]).abs().max().item<double>();
      if (!(diff <= 1e-6)) errors.push_back(where + "param " + std::to_string(held[j]) + " differs by " + std::to_string(diff));
    }
  }
  return errors;
}

/// Data parallelism with ZeroOptimizer(FusedAdam): every rank holds the
/// whole model and the same grads (so their mean is the grads, up to the
/// rounding of the sum); each step of every rank, under a GradScaler with
/// clipping, must match one process stepping FusedAdam on those grads, to
/// 1e-6. Returns what differs.
inline std::vector<std::string> check_zero_rank(const Model& model, int rank, int world,
                                                const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  const auto options = torch::optim::AdamOptions(0.01).weight_decay(0.01);
  const auto step_all = [&](std::vector<torch::Tensor>& params, torch::optim::Optimizer& opt,
                            ampfuse::GradScaler& scaler, std::size_t s, bool mean_here) {
    const float scale = static_cast<float>(scaler.get_scale());
    for (std::size_t k = 0; k < params.size(); ++k) {
      torch::Tensor g = model.grads[s][k] * scale;
      if (mean_here && world > 1) {  // what the ranks' mean makes of `world` copies: each divided, then summed
        const torch::Tensor part = g / world;
        torch::Tensor sum = part.clone();
        for (int r = 1; r < world; ++r) sum += part;
        g = sum;
      }
      params[k].mutable_grad() = g;
    }
    scaler.scale(torch::ones({}));
    scaler.clip_grad_norm_(opt, 50.0);
    scaler.step(opt);
    scaler.update();
  };
  std::vector<torch::Tensor> whole, mine;
  for (const auto& p : model.params) {
    whole.push_back(p.detach().clone().requires_grad_());
    mine.push_back(p.detach().clone().requires_grad_());
  }
  ampfuse::FusedAdam ref(whole, options);
  auto zero = ampfuse::distributed::ZeroOptimizer::make<ampfuse::FusedAdam>(mine, options, group);
  ampfuse::GradScaler ref_scaler(scaler_options()), scaler(scaler_options());
  std::vector<std::string> errors;
  const std::string who = "ZeroOptimizer, rank " + std::to_string(rank) + " of " + std::to_string(world);
  for (std::size_t s = 0; s < model.grads.size(); ++s) {
    step_all(whole, ref, ref_scaler, s, /*mean_here=*/true);
    step_all(mine, *zero, scaler, s, /*mean_here=*/false);
    const std::string where = who + ", step " + std::to_string(s) + ": ";
    if (scaler.get_scale() != ref_scaler.get_scale())
      errors.push_back(where + "scale " + std::to_string(scaler.get_scale()) + ", one process " +
                       std::to_string(ref_scaler.get_scale()));
    for (std::size_t k = 0; k < whole.size(); ++k) {
      const double diff = (mine[k].detach() - whole[k].detach()).abs().max().item<double>();
      if (!(diff <= 1e-6)) errors.push_back(where + "param " + std::to_string(k) + " differs by " + std::to_string(diff));
    }
  }
  return errors;
}

}  // namespace ampfuse_test::sharded
