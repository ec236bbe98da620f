// A kept step plan against a plan made afresh at every step. Two copies of
// one model, each with its optimizer (and GradScaler), see the same random
// events between steps; one steps under its kept plan, the other after
// forget_plan() (validated and prepared from scratch), and the two must agree
// bit for bit after every step. test_soak.cpp checks ampfuse against
// torch::optim under such events; this checks the plan's shortcuts where
// torch::optim has no twin: FusedLAMB, 8-bit moments, half and bf16
// parameters with master weights, parameters that are views with gaps, and
// on CUDA. The events: a parameter frozen for a step (no grad), most grads
// written in place into the last step's tensors (the rest move), a grad in
// another layout, a parameter written from outside, given new memory
// (set_data), laid out otherwise (channels_last, transposed, a view with
// gaps) or converted to another dtype (where neither 8-bit moments nor master
// weights refuse it), a group's lr halved, a state erased, a group added, the
// kept copy's optimizer saved and loaded; under a GradScaler (half the
// configurations, clipping in half of those), an inf in some steps' grads.
// In unscaled configurations, some steps' grads are then made what no step
// takes (another dtype, a shape that only broadcasts, resized in place) or
// restrided in place: the kept plan must refuse, or take, what a fresh plan
// does, with the same error, and change nothing when it refuses.
//
// Each configuration has its own seed, printed on failure; replay one with
// AMPFUSE_PLAN_FUZZ_SEED=<seed>. AMPFUSE_PLAN_FUZZ_CONFIGS sets how many run.

#include <ampfuse/ampfuse.h>

#include <cmath>
#include <cstdlib>
#include <functional>
#include <iterator>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "tests/common.h"
#include "tests/random_options.h"

namespace {

using namespace ampfuse_test::random_options;
using Groups = std::vector<torch::optim::OptimizerParamGroup>;

struct Kind {
  std::string name;
  torch::Dtype dtype;
  std::function<std::unique_ptr<torch::optim::OptimizerOptions>(std::mt19937_64&)> options;
  /// The optimizer over `groups`; `replanned`: one whose forget_plan() the test calls.
  std::function<std::unique_ptr<torch::optim::Optimizer>(const Groups& groups, bool replanned)> make;
  std::function<void(torch::optim::Optimizer&)> forget_plan;  ///< of a replanned one
  /// How the last step of one that keeps its plan found it.
  std::function<ampfuse::sdk::PlanMatch(const torch::optim::Optimizer&)> plan_match;
  bool converts = true;  ///< whether a parameter may change dtype (not with 8-bit moments or master weights)
};

template <class Opt>
struct Replanned : Opt {
  using Opt::Opt;
  void forget() { this->forget_plan(); }
};

// Opt(groups, args...), its groups' options drawn by random.
template <class Opt, class Options, class... Args>
Kind kind(std::string name, torch::Dtype dtype, std::function<Options(std::mt19937_64&)> random, Args... args) {
  return {std::move(name), dtype, [random](std::mt19937_64& rng) { return std::make_unique<Options>(random(rng)); },
          [args...](const Groups& groups, bool replanned) -> std::unique_ptr<torch::optim::Optimizer> {
            if (replanned) return std::make_unique<Replanned<Opt>>(groups, args...);
            return std::make_unique<Opt>(groups, args...);
          },
          [](torch::optim::Optimizer& opt) { static_cast<Replanned<Opt>&>(opt).forget(); },
          [](const torch::optim::Optimizer& opt) { return static_cast<const Opt&>(opt).last_plan_match(); }};
}

ampfuse::FusedLAMBOptions random_lamb(std::mt19937_64& rng) {
  ampfuse::FusedLAMBOptions o(std::pow(10.0, -4 + 2 * uniform(rng)));
  o.betas({0.8 + 0.15 * uniform(rng), 0.99 + 0.0099 * uniform(rng)});
  o.weight_decay(uniform(rng) < 0.5 ? 0.0 : 0.05 * uniform(rng));
  if (uniform(rng) < 0.5) o.max_grad_norm(0.5 + uniform(rng));
  if (uniform(rng) < 0.3) o.trust_ratio_max(10.0);
  return o;
}

std::vector<Kind> kinds() {
  using namespace torch::optim;
  using ampfuse::FusedAdam;
  using ampfuse::FusedAdamOptions;
  using ampfuse::FusedAdamW;
  using ampfuse::FusedLAMB;
  using ampfuse::FusedLAMBOptions;
  const auto adam_8bit = [](std::mt19937_64& rng) { return random_adam<AdamOptions>(rng).amsgrad(false); };
  const auto adamw_8bit = [](std::mt19937_64& rng) { return random_adam<AdamWOptions>(rng).amsgrad(false); };
  const auto lamb_master = [](std::mt19937_64& rng) { return random_lamb(rng).master_weights(true); };
  std::vector<Kind> all = {
      kind<FusedAdam, AdamOptions>("FusedAdam", torch::kFloat, random_adam<AdamOptions>, AdamOptions(1e-3),
                                   FusedAdamOptions()),
      kind<FusedAdam, AdamOptions>("FusedAdam f64", torch::kDouble, random_adam<AdamOptions>, AdamOptions(1e-3),
                                   FusedAdamOptions()),
      kind<FusedAdamW, AdamWOptions>("FusedAdamW bf16, master weights", torch::kBFloat16, random_adam<AdamWOptions>,
                                     AdamWOptions(1e-3), FusedAdamOptions().master_weights(true)),
      kind<FusedAdam, AdamOptions>("FusedAdam f16, master weights", torch::kHalf, random_adam<AdamOptions>,
                                   AdamOptions(1e-3), FusedAdamOptions().master_weights(true)),
      kind<FusedAdam, AdamOptions>("FusedAdam 8-bit", torch::kFloat, adam_8bit, AdamOptions(1e-3),
                                   FusedAdamOptions().moments_8bit(true)),
      kind<FusedAdamW, AdamWOptions>("FusedAdamW 8-bit bf16, master weights", torch::kBFloat16, adamw_8bit,
                                     AdamWOptions(1e-3), FusedAdamOptions().moments_8bit(true).master_weights(true)),
      kind<ampfuse::FusedSGD, SGDOptions>("FusedSGD", torch::kFloat, random_sgd, SGDOptions(0.01)),
      kind<ampfuse::FusedSGD, SGDOptions>("FusedSGD bf16", torch::kBFloat16, random_sgd, SGDOptions(0.01)),
      kind<FusedLAMB, FusedLAMBOptions>("FusedLAMB", torch::kFloat, random_lamb, FusedLAMBOptions()),
      kind<FusedLAMB, FusedLAMBOptions>("FusedLAMB f16, master weights", torch::kHalf, lamb_master,
                                        FusedLAMBOptions()),
      kind<ampfuse::FusedAdagrad, AdagradOptions>("FusedAdagrad", torch::kFloat, random_adagrad, AdagradOptions(0.01)),
      kind<ampfuse::FusedRMSprop, RMSpropOptions>("FusedRMSprop", torch::kFloat, random_rmsprop, RMSpropOptions(0.01)),
  };
  for (Kind& k : all)
    k.converts = k.name.find("8-bit") == std::string::npos && k.name.find("master") == std::string::npos;
  return all;
}

enum class Event {
  kNone,
  kFreeze,
  kGradsInPlace,
  kOddLayoutGrad,
  kParamWritten,
  kParamSetData,
  kParamRelaidOut,
  kLrHalved,
  kConverted,
  kStateErased,
  kGroupAdded,
  kReloaded,
};
constexpr const char* kEventNames[] = {"",
                                       "a parameter frozen (or a third of them)",
                                       "grads written in place (most)",
                                       "a grad in another layout",
                                       "a parameter written",
                                       "a parameter's set_data",
                                       "a parameter laid out otherwise",
                                       "an lr halved",
                                       "a parameter converted to another dtype",
                                       "a state erased",
                                       "a group added",
                                       "the optimizer saved and loaded (the kept one)"};
std::int64_t g_events[std::size(kEventNames)] = {};

// What no step may take, done to a grad after it was given (in unscaled
// configurations): both copies must refuse it alike, the kept plan's as the
// fresh one's, and change nothing; or both take it alike.
enum class Hostile { kNone, kGradOtherDtype, kGradBroadcasts, kGradResizedInPlace, kGradRestridedInPlace };
constexpr const char* kHostileNames[] = {"", "a grad of another dtype", "a grad of a shape that only broadcasts",
                                         "a grad resized in place to another shape",
                                         "a grad restrided in place (column-major)"};
std::int64_t g_hostile[std::size(kHostileNames)] = {}, g_refused = 0;
// How the kept plan's steps found it (by ampfuse::sdk::PlanMatch), of the steps taken.
constexpr const char* kMatchNames[] = {"changed", "same", "grads moved", "grads came or went"};
std::int64_t g_matches[std::size(kMatchNames)] = {};

// A leaf parameter holding `values`: dense, or (gaps, two or more
// dimensions) every other element of its last dimension's runs in a tensor
// twice as wide.
torch::Tensor make_param(const torch::Tensor& values, bool gaps) {
  if (!gaps || values.dim() < 2) return values.clone().requires_grad_();
  auto sizes = values.sizes().vec();
  sizes.back() *= 2;
  auto view = torch::zeros(sizes, values.options()).narrow(-1, 0, values.size(-1));
  view.copy_(values);
  return view.requires_grad_();
}

struct Copy {
  std::vector<torch::Tensor> params;
  std::unique_ptr<torch::optim::Optimizer> opt;
  std::unique_ptr<ampfuse::GradScaler> scaler;
};

std::string run_config(const Kind& k, std::uint64_t seed, torch::Device device, std::string& description) {
  std::mt19937_64 rng(seed);
  torch::manual_seed(seed);
  // 4100, 70 x 70 and 33 x 130 have 4,096 elements or more: 8-bit moments in the 8-bit kinds.
  const std::vector<std::vector<std::int64_t>> pool = {{0}, {1}, {17}, {5, 7}, {4100}, {8, 3, 3, 3}, {70, 70},
                                                       {33, 130}};
  Copy kept, fresh;
  Copy* const copies[] = {&kept, &fresh};
  // Each copy's groups of parameters with the same values and layouts.
  const auto new_group = [&](Groups& kept_groups, Groups& fresh_groups) {
    std::vector<torch::Tensor> a, b;
    const int n = 1 + static_cast<int>(rng() % 3);
    for (int i = 0; i < n; ++i) {
      const auto& shape = pool[rng() % pool.size()];
      const bool gaps = shape.size() >= 2 && rng() % 3 == 0;
      const auto values = torch::randn(shape, torch::TensorOptions().device(device)).to(k.dtype);
      a.push_back(make_param(values, gaps));
      b.push_back(make_param(values, gaps));
    }
    const auto options = k.options(rng);
    kept_groups.emplace_back(a, options->clone());
    fresh_groups.emplace_back(b, options->clone());
    kept.params.insert(kept.params.end(), a.begin(), a.end());
    fresh.params.insert(fresh.params.end(), b.begin(), b.end());
  };
  Groups kept_groups, fresh_groups;
  const int groups = 1 + static_cast<int>(rng() % 2);
  for (int g = 0; g < groups; ++g) new_group(kept_groups, fresh_groups);
  kept.opt = k.make(kept_groups, false);
  fresh.opt = k.make(fresh_groups, true);
  const bool low = k.dtype == torch::kHalf || k.dtype == torch::kBFloat16;
  const bool scaled = rng() % 2 == 0;
  const bool clip = scaled && rng() % 2 == 0;
  const double max_norm = 0.1 + 10.0 * uniform(rng);
  const double init_scale = std::pow(2.0, static_cast<int>(rng() % (low ? 8 : 16)));
  for (Copy* c : copies)
    c->scaler = std::make_unique<ampfuse::GradScaler>(
        ampfuse::GradScalerOptions().init_scale(init_scale).growth_interval(2).enabled(scaled));
  const int steps = 4 + static_cast<int>(rng() % 8);
  std::ostringstream what;
  what << k.name << " on " << device << ", " << groups << " groups, " << kept.params.size() << " params, " << steps
       << " steps" << (scaled ? ", scaled from " + std::to_string(init_scale) : "")
       << (clip ? ", clipped to " + std::to_string(max_norm) : "");
  description = what.str();

  for (int step = 0; step < steps; ++step) {
    Event event = step > 0 && rng() % 2 == 0 ? static_cast<Event>(1 + rng() % 11) : Event::kNone;
    if (event == Event::kConverted && !k.converts) event = Event::kParamSetData;
    // (A step with no grad at all is refused under a scaler, as PyTorch's: "No inf checks were recorded".)
    if (event == Event::kFreeze && kept.params.size() == 1) event = Event::kGradsInPlace;
    const std::size_t target = rng() % kept.params.size();
    const int how = static_cast<int>(rng() % 3);
    const bool inf = scaled && rng() % 6 == 0;
    const Hostile hostile =
        !scaled && step > 0 && rng() % 4 == 0 ? static_cast<Hostile>(1 + rng() % 4) : Hostile::kNone;
    ++g_hostile[static_cast<int>(hostile)];
    if (hostile != Hostile::kNone)
      description += std::string(", ") + kHostileNames[static_cast<int>(hostile)] + " (" + std::to_string(target) +
                     ") at step " + std::to_string(step);
    ++g_events[static_cast<int>(event)];
    if (event != Event::kNone)
      description += std::string(", ") + kEventNames[static_cast<int>(event)] + " (" + std::to_string(target) +
                     ") before step " + std::to_string(step);
    if (inf) description += ", inf at step " + std::to_string(step);
    switch (event) {
      case Event::kParamWritten:
        for (Copy* c : copies) {
          torch::NoGradGuard no_grad;
          c->params[target].mul_(0.5);
        }
        break;
      case Event::kParamSetData:
        for (Copy* c : copies) c->params[target].set_data(c->params[target].detach().clone());
        break;
      case Event::kParamRelaidOut:
        for (Copy* c : copies) {
          const torch::Tensor p = c->params[target].detach();
          c->params[target].set_data(p.dim() >= 2 && how == 2 ? make_param(p, /*gaps=*/true).detach()
                                     : p.dim() == 4             ? p.contiguous(torch::MemoryFormat::ChannelsLast)
                                     : p.dim() == 2             ? p.t().contiguous().t()
                                                                : p.clone());
        }
        break;
      case Event::kLrHalved: {
        const std::size_t g = rng() % kept.opt->param_groups().size();
        for (Copy* c : copies) {
          auto& o = c->opt->param_groups()[g].options();
          o.set_lr(o.get_lr() * 0.5);
        }
        break;
      }
      case Event::kConverted:
        for (Copy* c : copies) {
          const torch::Tensor p = c->params[target].detach();
          c->params[target].set_data(p.to(p.scalar_type() == torch::kDouble ? torch::kFloat : torch::kDouble));
        }
        break;
      case Event::kStateErased:
        for (Copy* c : copies) c->opt->state().erase(c->params[target].unsafeGetTensorImpl());
        break;
      case Event::kGroupAdded: {
        Groups a, b;
        new_group(a, b);
        kept.opt->add_param_group(a.front());
        fresh.opt->add_param_group(b.front());
        break;
      }
      case Event::kReloaded: {
        torch::serialize::OutputArchive out;
        kept.opt->save(out);
        std::ostringstream bytes;
        out.save_to(bytes);
        std::istringstream in_bytes(bytes.str());
        torch::serialize::InputArchive in;
        in.load_from(in_bytes);
        kept.opt->load(in);
        break;
      }
      default:
        break;
    }
    // (Frozen with the target: a third of the parameters, never all.)
    const bool freeze_more = event == Event::kFreeze && rng() % 2 == 0;
    const double scale = kept.scaler->get_scale();
    for (std::size_t i = 0; i < kept.params.size(); ++i) {
      const torch::Tensor& p = kept.params[i];
      auto g = (torch::randn(p.sizes(), torch::TensorOptions().device(device)) * scale).to(p.scalar_type());
      if (inf && i == target && g.numel() > 0)
        g.view(-1)[static_cast<std::int64_t>(rng() % g.numel())] = std::numeric_limits<double>::infinity();
      const bool in_place = event == Event::kGradsInPlace && rng() % 4 != 0;
      for (Copy* c : copies) {
        torch::Tensor& q = c->params[i];
        if (event == Event::kFreeze && (i == target || (freeze_more && i % 3 == target % 3))) {
          q.mutable_grad() = torch::Tensor();
        } else if (event == Event::kOddLayoutGrad && i == target) {
          q.mutable_grad() = ampfuse_test::odd_layout(g, how);
        } else if (in_place && q.grad().defined() && q.grad().sizes() == g.sizes() &&
                   q.grad().scalar_type() == g.scalar_type()) {
          q.mutable_grad().copy_(g);
        } else {
          q.mutable_grad() = g.clone();
        }
      }
    }
    for (Copy* c : copies) {
      if (!c->params[target].grad().defined()) break;
      const at::Tensor g = c->params[target].grad();
      switch (hostile) {
        case Hostile::kGradOtherDtype:
          c->params[target].mutable_grad() = g.to(g.scalar_type() == torch::kDouble ? torch::kFloat : torch::kDouble);
          break;
        case Hostile::kGradBroadcasts:
          if (g.dim() >= 1 && g.size(0) > 1) c->params[target].mutable_grad() = g.narrow(0, 0, 1).clone();
          break;
        case Hostile::kGradResizedInPlace:
          if (g.dim() == 2 && g.size(0) != g.size(1) && g.is_contiguous()) g.resize_({g.size(1), g.size(0)});
          break;
        case Hostile::kGradRestridedInPlace:
          if (g.dim() == 2 && g.is_contiguous() && g.size(0) > 1 && g.size(1) > 1)
            g.as_strided_(g.sizes(), {1, g.size(0)});
          break;
        default:
          break;
      }
    }
    std::string errors[2];
    for (int n = 0; n < 2; ++n) {
      Copy* c = copies[n];
      if (c == &fresh) k.forget_plan(*c->opt);
      try {
        if (!scaled) {
          c->opt->step();
          continue;
        }
        c->scaler->scale(torch::ones({}, torch::TensorOptions().device(device)));
        if (clip) c->scaler->clip_grad_norm_(*c->opt, max_norm);
        c->scaler->step(*c->opt);
        c->scaler->update();
      } catch (const c10::Error& e) {
        errors[n] = e.what_without_backtrace();
      }
    }
    if (errors[0] != errors[1])
      return "step " + std::to_string(step) + ": the kept plan's step " +
             (errors[0].empty() ? std::string("was taken") : "was refused: " + errors[0]) + "; the fresh plan's " +
             (errors[1].empty() ? std::string("was taken") : "was refused: " + errors[1]);
    if (!errors[0].empty() && hostile == Hostile::kNone)
      return "step " + std::to_string(step) + " refused: " + errors[0];
    g_refused += errors[0].empty() ? 0 : 1;
    if (errors[0].empty()) ++g_matches[static_cast<int>(k.plan_match(*kept.opt))];
    for (std::size_t i = 0; i < kept.params.size(); ++i) {
      const auto same = ampfuse_test::bitwise_equal(kept.params[i].detach(), fresh.params[i].detach());
      if (!same) return "param " + std::to_string(i) + " after step " + std::to_string(step) + ": " + same.message();
    }
    if (kept.scaler->get_scale() != fresh.scaler->get_scale())
      return "scale " + std::to_string(kept.scaler->get_scale()) + " (kept plan) vs " +
             std::to_string(fresh.scaler->get_scale()) + " after step " + std::to_string(step);
  }
  return "";
}

class PlanFuzz : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    device_ = torch::Device(GetParam());
    AMPFUSE_SKIP_WITHOUT(device_);
  }
  torch::Device device_{torch::kCPU};
};

TEST_P(PlanFuzz, AKeptPlanStepsAsAFreshOneUnderRandomEvents) {
  const std::uint64_t base = ampfuse_test::seed_for_test();  // (printed once: the configurations' seeds come from it)
  const std::vector<std::uint64_t> seeds =
      ampfuse_test::config_seeds(base, 300, "AMPFUSE_PLAN_FUZZ_CONFIGS", "AMPFUSE_PLAN_FUZZ_SEED");
  const std::vector<Kind> all = kinds();
  std::fill(std::begin(g_events), std::end(g_events), 0);
  std::fill(std::begin(g_hostile), std::end(g_hostile), 0);
  g_refused = 0;
  int failures = 0;
  for (const std::uint64_t seed : seeds) {
    const Kind& k = all[seed % all.size()];
    std::string description;
    std::string error;
    try {
      error = run_config(k, seed, device_, description);
    } catch (const std::exception& e) {  // (outside a step: an event, or the set-up)
      error = std::string("threw outside a step: ") + e.what();
    }
    if (error.empty()) continue;
    ++failures;
    ADD_FAILURE() << description << ": " << error << " (replay: AMPFUSE_PLAN_FUZZ_SEED=" << seed << ")";
    if (failures >= 5) break;
  }
  std::cout << "[ fuzz     ] " << seeds.size() << " configurations, " << failures << " failed; between steps:";
  for (std::size_t e = 1; e < std::size(kEventNames); ++e)
    std::cout << (e > 1 ? ", " : " ") << kEventNames[e] << " " << g_events[e];
  std::cout << "; after the grads:";
  for (std::size_t e = 1; e < std::size(kHostileNames); ++e)
    std::cout << (e > 1 ? ", " : " ") << kHostileNames[e] << " " << g_hostile[e];
  std::cout << "; steps refused alike " << g_refused << "; the kept plan found";
  for (std::size_t m = 0; m < std::size(kMatchNames); ++m)
    std::cout << (m > 0 ? ", " : " ") << kMatchNames[m] << " " << g_matches[m];
  std::cout << "\n";
}

INSTANTIATE_TEST_SUITE_P(All, PlanFuzz, ::testing::Values("cpu", "cuda"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

}  // namespace
