// A randomized differential soak: many random configurations, each an
// ampfuse optimizer against its torch::optim twin over a few steps, with
// random options per group, fp32 or fp64, shapes including 0, 1 and odd
// sizes, one to three groups, GradScaler on or off (with random scales, inf
// injected into some steps, and clipping through clip_grad_norm_ against
// unscale_ and clip_grad_norm_'s arithmetic on the classic path), and a
// save/load into a fresh optimizer mid-run. Parameters and the scale must
// agree at the end, and each returned norm with the fp64 norm of the grads.
// Between steps, what training code does to a model under a kept step plan
// happens to ours and the twins alike (Event): a parameter frozen for a step
// (no grad), grads written in place into the last step's tensors, a grad in
// another layout (transposed, or a view with gaps; ours only), a parameter
// written from outside or given new memory (set_data), a group's lr
// changed, a parameter's state erased (made afresh at its next step), a
// parameter group added.
//
// Every configuration has its own seed, printed on failure; replay one with
// AMPFUSE_SOAK_CONFIG_SEED=<seed>. AMPFUSE_SOAK_CONFIGS sets how many run
// (CI runs a short soak; scripts/soak.sh runs a long one).

#include <ampfuse/ampfuse.h>

#include <cstdlib>
#include <iterator>
#include <limits>
#include <numeric>
#include <sstream>
#include <type_traits>

#include "tests/common.h"
#include "tests/random_options.h"

namespace {

using namespace ampfuse_test::random_options;

struct Config {
  std::uint64_t seed;
  std::string description;
};

// torch::nn::utils::clip_grad_norm_'s arithmetic (fp32) from a given total
// norm: the reference twins clip with the norm that ampfuse's scaler returned,
// so that they see the coefficient the scaler contract carries (the norm is
// checked on its own against an fp64 norm). Computing it again would let one
// ulp of the coefficient decide the sign of a grad that a weight decay nearly
// cancels, which is not what this soak is about.
void clip_with_norm(const std::vector<torch::Tensor>& params, const at::Tensor& norm, double max_norm) {
  const auto coef = at::clamp(max_norm / (norm.to(torch::kFloat) + 1e-6), c10::nullopt, 1.0);
  for (const auto& p : params)
    if (p.grad().defined()) p.grad().mul_(coef.to(p.grad().scalar_type()));
}

double norm_fp64(const std::vector<torch::Tensor>& params) {
  double sum_sq = 0;
  for (const auto& p : params)
    if (p.grad().defined()) sum_sq += p.grad().to(torch::kDouble).pow(2).sum().item<double>();
  return std::sqrt(sum_sq);
}

// Reloads `opt` through a checkpoint into a fresh optimizer over the same
// groups (as a resumed run does) and returns it.
template <class Ours, class Options, class Fused>
std::unique_ptr<Ours> reloaded(Ours& opt, const Fused& fused) {
  torch::serialize::OutputArchive out;
  opt.save(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (const auto& g : opt.param_groups())
    groups.emplace_back(g.params(), std::make_unique<Options>(static_cast<const Options&>(g.options())));
  auto fresh = std::make_unique<Ours>(groups, Options(0.01), fused);
  std::istringstream in_bytes(bytes.str());
  torch::serialize::InputArchive in;
  in.load_from(in_bytes);
  fresh->load(in);
  return fresh;
}

// Elements compared, and those whose bound the twins' spread widened past
// tol (printed: the soak says how much of it rests on the wider bound).
std::int64_t g_compared = 0, g_widened = 0;

enum class Event { kNone, kFreeze, kGradsInPlace, kOddLayoutGrad, kParamWritten, kParamSetData, kLrHalved,
                   kStateErased, kGroupAdded };
constexpr const char* kEventNames[] = {"",           "a parameter frozen", "grads written in place (most)",
                                       "a grad in another layout", "a parameter written", "a parameter's set_data",
                                       "an lr halved", "a state erased", "a group added"};

// How many of each event the soak applied (printed with its summary).
std::int64_t g_events[std::size(kEventNames)] = {};

// A torch::optim twin of the run: its own copies of the parameters and its
// own GradScaler (the classic path). The perturbed twins run in fp64 with
// every grad multiplied by 1 + perturb before the step.
template <class Ref>
struct Twin {
  std::vector<torch::Tensor> params;
  std::unique_ptr<Ref> opt;
  std::unique_ptr<ampfuse::GradScaler> scaler;
  double perturb = 0;
};

// One configuration: returns an empty string when ours and the reference
// agree, else what differs.
//
// How close is close: the first steps of Adam, Adagrad (with LibTorch's
// initial sum of 0) and RMSprop move an element by about lr * g / (|g| + eps),
// a step function of g's sign when eps is small. Where a weight decay nearly
// cancels a grad, g's sign is decided by its rounding, and two correct fp32
// implementations may move that element by lr in opposite directions. So
// each element may differ from torch::optim by tol * (1 + |ref|) plus twice
// how far it moves between two fp64 twins whose grads are perturbed by
// +-8 ulps of the dtype: the problem's own conditioning, measured in the run.
// A well-conditioned element (nearly all of them) gets tol alone.
template <class Ours, class Ref, class Options, class Fused, class Random>
std::string run_config(std::mt19937_64& rng, Random&& random, const Fused& fused, bool maximize, torch::Dtype dtype,
                       std::string& description) {
  const std::vector<std::vector<std::int64_t>> pool = {{0}, {1}, {3}, {17}, {5, 7}, {1000}, {65537}, {129, 31}};
  const int groups = 1 + static_cast<int>(rng() % 3);
  const int steps = 2 + static_cast<int>(rng() % 9);
  const bool scaled = rng() % 2 == 0;
  const bool clip = scaled && rng() % 2 == 0;
  const int inf_step = scaled && rng() % 2 == 0 ? static_cast<int>(rng() % steps) : -1;
  const int reload_step = rng() % 2 == 0 ? static_cast<int>(rng() % steps) : -1;
  const double max_norm = clip ? 0.1 + 10.0 * uniform(rng) : 0.0;
  const double init_scale = std::pow(2.0, static_cast<int>(rng() % 20));
  const double ulp = ampfuse_test::ulp_of(dtype);
  std::vector<torch::Tensor> ours;
  std::vector<Twin<Ref>> twins(3);  // [0]: torch::optim in the run's dtype; [1], [2]: perturbed, fp64
  twins[1].perturb = 8 * ulp;
  twins[2].perturb = -8 * ulp;
  std::vector<torch::optim::OptimizerParamGroup> og;
  std::vector<std::vector<torch::optim::OptimizerParamGroup>> tg(twins.size());
  for (int g = 0; g < groups; ++g) {
    std::vector<torch::Tensor> mine;
    const int n = 1 + static_cast<int>(rng() % 3);
    for (int i = 0; i < n; ++i) mine.push_back(torch::randn(pool[rng() % pool.size()], dtype).requires_grad_());
    Options o = random(rng);
    if constexpr (std::is_same<Options, torch::optim::RMSpropOptions>::value)
      if (dtype == torch::kFloat && o.centered()) o.eps(std::max(o.eps(), 1e-6));  // see test_fused_adagrad_rmsprop
    og.emplace_back(mine, std::make_unique<Options>(o));
    ours.insert(ours.end(), mine.begin(), mine.end());
    for (std::size_t k = 0; k < twins.size(); ++k) {
      const auto theirs = ampfuse_test::leaf_copies(mine, k == 0 ? dtype : torch::kDouble);
      tg[k].emplace_back(theirs, std::make_unique<Options>(o));
      twins[k].params.insert(twins[k].params.end(), theirs.begin(), theirs.end());
    }
  }
  std::ostringstream what;
  what << ampfuse_test::dtype_name(dtype) << ", " << groups << " groups, " << ours.size() << " params, " << steps
       << " steps" << (maximize ? ", maximize" : "") << (scaled ? ", scaled from " + std::to_string(init_scale) : "")
       << (clip ? ", clipped to " + std::to_string(max_norm) : "")
       << (inf_step >= 0 ? ", inf at step " + std::to_string(inf_step) : "")
       << (reload_step >= 0 ? ", reloaded after step " + std::to_string(reload_step) : "");
  description = what.str();

  auto opt = std::make_unique<Ours>(og, Options(0.01), fused);
  const auto scaler_options = ampfuse::GradScalerOptions().init_scale(init_scale).growth_interval(2);
  ampfuse::GradScaler scaler(scaler_options);
  for (std::size_t k = 0; k < twins.size(); ++k) {
    twins[k].opt = std::make_unique<Ref>(tg[k], Options(0.01));
    twins[k].scaler = std::make_unique<ampfuse::GradScaler>(scaler_options);
  }
  const auto perturb = [](Twin<Ref>& t) {
    if (t.perturb == 0) return;
    for (const auto& p : t.params)
      if (p.grad().defined()) p.grad().mul_(1 + t.perturb);
  };
  for (int step = 0; step < steps; ++step) {
    Event event = step > 0 && rng() % 2 == 0 ? static_cast<Event>(1 + rng() % 8) : Event::kNone;
    // (LibTorch's Adagrad makes its state in its constructor and asserts it at every step.)
    if (std::is_same<Ref, torch::optim::Adagrad>::value &&
        (event == Event::kStateErased || event == Event::kGroupAdded))
      event = Event::kParamWritten;
    // (A step with no grad at all is refused under a scaler, as PyTorch's: "No inf checks were recorded".)
    if (event == Event::kFreeze && ours.size() == 1) event = Event::kGradsInPlace;
    const std::size_t target = rng() % ours.size();
    ++g_events[static_cast<int>(event)];
    if (event != Event::kNone)
      description += std::string(", ") + kEventNames[static_cast<int>(event)] + " (" + std::to_string(target) +
                     ") before step " + std::to_string(step);
    switch (event) {
      case Event::kParamWritten: {
        torch::NoGradGuard no_grad;
        ours[target].mul_(0.5);
        for (auto& t : twins) t.params[target].mul_(0.5);
        break;
      }
      case Event::kParamSetData:
        ours[target].set_data(ours[target].detach().clone());
        for (auto& t : twins) t.params[target].set_data(t.params[target].detach().clone());
        break;
      case Event::kLrHalved: {
        const std::size_t g = rng() % opt->param_groups().size();
        const auto halve = [g](torch::optim::Optimizer& o) {
          auto& options = static_cast<Options&>(o.param_groups()[g].options());
          options.lr(options.lr() * 0.5);
        };
        halve(*opt);
        for (auto& t : twins) halve(*t.opt);
        break;
      }
      case Event::kStateErased:
        opt->state().erase(ours[target].unsafeGetTensorImpl());
        for (auto& t : twins) t.opt->state().erase(t.params[target].unsafeGetTensorImpl());
        break;
      case Event::kGroupAdded: {
        std::vector<torch::Tensor> mine;
        const int n = 1 + static_cast<int>(rng() % 2);
        for (int i = 0; i < n; ++i) mine.push_back(torch::randn(pool[rng() % pool.size()], dtype).requires_grad_());
        Options o = random(rng);
        if constexpr (std::is_same<Options, torch::optim::RMSpropOptions>::value)
          if (dtype == torch::kFloat && o.centered()) o.eps(std::max(o.eps(), 1e-6));
        opt->add_param_group(torch::optim::OptimizerParamGroup(mine, std::make_unique<Options>(o)));
        ours.insert(ours.end(), mine.begin(), mine.end());
        for (std::size_t k = 0; k < twins.size(); ++k) {
          const auto theirs = ampfuse_test::leaf_copies(mine, k == 0 ? dtype : torch::kDouble);
          twins[k].opt->add_param_group(torch::optim::OptimizerParamGroup(theirs, std::make_unique<Options>(o)));
          twins[k].params.insert(twins[k].params.end(), theirs.begin(), theirs.end());
        }
        break;
      }
      default:
        break;
    }
    const double scale = scaled ? scaler.get_scale() : 1.0;
    if (scaled) {
      scaler.scale(torch::ones({}));
      for (auto& t : twins) t.scaler->scale(torch::ones({}));
    }
    // A new grad tensor, or (kGradsInPlace: most grads, so that the others
    // move under the kept plan) written into the last step's.
    bool in_place = false;
    const auto give = [&](torch::Tensor& p, const torch::Tensor& g) {
      const at::Tensor& had = p.grad();
      if (in_place && had.defined() && had.sizes() == g.sizes() && had.scalar_type() == g.scalar_type())
        p.mutable_grad().copy_(g);
      else
        p.mutable_grad() = g.clone();
    };
    for (std::size_t i = 0; i < ours.size(); ++i) {
      auto g = torch::randn_like(ours[i]) * scale;
      if (step == inf_step && i == ours.size() - 1 && g.numel() > 0)
        g.view(-1)[rng() % g.numel()] = std::numeric_limits<double>::infinity();
      in_place = event == Event::kGradsInPlace && rng() % 4 != 0;
      if (event == Event::kFreeze && i == target) {
        ours[i].mutable_grad() = torch::Tensor();
        for (auto& t : twins) t.params[i].mutable_grad() = torch::Tensor();
        continue;
      }
      if (event == Event::kOddLayoutGrad && i == target)
        ours[i].mutable_grad() = ampfuse_test::odd_layout(g, static_cast<int>(rng() % 3));
      else
        give(ours[i], g);
      for (auto& t : twins) give(t.params[i], (maximize ? -g : g).to(t.params[i].scalar_type()));
    }
    if (!scaled) {
      opt->step();
      for (auto& t : twins) {
        perturb(t);
        t.opt->step();
      }
      continue;
    }
    at::Tensor norm;
    if (clip) norm = scaler.clip_grad_norm_(*opt, max_norm);
    for (auto& t : twins) {
      if (clip || t.perturb != 0) t.scaler->unscale_(*t.opt);
      if (clip && &t == &twins[0] && step != inf_step) {
        // The norm ampfuse computed (fp32, from an fp64 sum of squares)
        // against the fp64 norm of the same unscaled grads.
        const double exact = norm_fp64(t.params), got = norm.item<double>();
        if (!(std::abs(got - exact) <= 1e-6 * exact))
          return "clip_grad_norm_ returned " + std::to_string(got) + ", the grads' norm is " +
                 std::to_string(exact) + " (step " + std::to_string(step) + ")";
      }
      if (clip) clip_with_norm(t.params, norm, max_norm);
      perturb(t);
    }
    scaler.step(*opt);
    scaler.update();
    for (auto& t : twins) {
      t.scaler->step(*t.opt);
      t.scaler->update();
      if (scaler.get_scale() != t.scaler->get_scale())
        return "scale " + std::to_string(scaler.get_scale()) + " vs " + std::to_string(t.scaler->get_scale()) +
               " after step " + std::to_string(step);
    }
    if (step == reload_step) opt = reloaded<Ours, Options>(*opt, fused);
  }
  // fp32: the two runs round differently (LibTorch's ops against one fused
  // formula); fp64: to rounding.
  const double tol = dtype == torch::kDouble ? 1e-10 : 2e-4;
  for (std::size_t i = 0; i < ours.size(); ++i) {
    if (ours[i].numel() == 0) continue;
    const at::Tensor x = ours[i].detach().to(torch::kDouble);
    const at::Tensor y = twins[0].params[i].detach().to(torch::kDouble);
    const at::Tensor spread = (twins[1].params[i].detach() - twins[2].params[i].detach()).abs();
    const at::Tensor excess = (x - y).abs() - tol * (1 + y.abs()) - 2 * spread;
    g_compared += x.numel();
    g_widened += (2 * spread > tol * (1 + y.abs())).sum().item<std::int64_t>();
    if (!(excess.max().item<double>() <= 0)) {
      std::ostringstream diff;
      diff << "param " << i << ": max |diff| " << (x - y).abs().max().item<double>() << ", beyond the bound at "
           << (excess > 0).sum().item<std::int64_t>() << " elements";
      return diff.str();
    }
  }
  return "";
}

std::string run_one(std::uint64_t seed, std::string& description) {
  std::mt19937_64 rng(seed);
  torch::manual_seed(seed);
  const int which = static_cast<int>(rng() % 5);
  const bool maximize = rng() % 4 == 0;
  const torch::Dtype dtype = rng() % 2 == 0 ? torch::kFloat : torch::kDouble;
  std::string result;
  switch (which) {
    case 0:
      result = run_config<ampfuse::FusedAdam, torch::optim::Adam, torch::optim::AdamOptions>(
          rng, random_adam<torch::optim::AdamOptions>, ampfuse::FusedAdamOptions().maximize(maximize), maximize,
          dtype, description);
      description = "FusedAdam, " + description;
      return result;
    case 1:
      result = run_config<ampfuse::FusedAdamW, torch::optim::AdamW, torch::optim::AdamWOptions>(
          rng, random_adam<torch::optim::AdamWOptions>, ampfuse::FusedAdamOptions().maximize(maximize), maximize,
          dtype, description);
      description = "FusedAdamW, " + description;
      return result;
    case 2:
      result = run_config<ampfuse::FusedSGD, torch::optim::SGD, torch::optim::SGDOptions>(
          rng, random_sgd, ampfuse::FusedSGDOptions().maximize(maximize), maximize, dtype, description);
      description = "FusedSGD, " + description;
      return result;
    case 3:
      result = run_config<ampfuse::FusedAdagrad, torch::optim::Adagrad, torch::optim::AdagradOptions>(
          rng, random_adagrad, ampfuse::FusedAdagradOptions().maximize(maximize), maximize, dtype, description);
      description = "FusedAdagrad, " + description;
      return result;
    default:
      result = run_config<ampfuse::FusedRMSprop, torch::optim::RMSprop, torch::optim::RMSpropOptions>(
          rng, random_rmsprop, ampfuse::FusedRMSpropOptions().maximize(maximize), maximize, dtype, description);
      description = "FusedRMSprop, " + description;
      return result;
  }
}

TEST(Soak, RandomConfigurationsMatchTorchOptim) {
  const std::uint64_t base = ampfuse_test::seed_for_test();
  const std::vector<std::uint64_t> seeds =
      ampfuse_test::config_seeds(base, 120, "AMPFUSE_SOAK_CONFIGS", "AMPFUSE_SOAK_CONFIG_SEED");
  int failures = 0;
  for (const std::uint64_t seed : seeds) {
    std::string description;
    const std::string error = run_one(seed, description);
    if (error.empty()) continue;
    ++failures;
    ADD_FAILURE() << description << ": " << error << " (replay: AMPFUSE_SOAK_CONFIG_SEED=" << seed << ")";
    if (failures >= 5) break;
  }
  std::cout << "[ soak     ] " << seeds.size() << " configurations, " << failures << " failed; " << g_compared
            << " elements compared, " << g_widened << " of them ill-conditioned (bound widened by the twins' spread)\n";
  std::cout << "[ soak     ] between steps:";
  for (std::size_t e = 1; e < std::size(kEventNames); ++e)
    std::cout << (e > 1 ? ", " : " ") << kEventNames[e] << " " << g_events[e];
  std::cout << " (in " << std::accumulate(std::begin(g_events), std::end(g_events), std::int64_t{0}) << " steps)\n";
}

}  // namespace
