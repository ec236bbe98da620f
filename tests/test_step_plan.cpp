// Step plans (ampfuse/sdk/optimizer.h): a step that reuses what the last
// one validated and prepared must give the bits of a step prepared from
// scratch, and every change that invalidates a kept pointer (new grads,
// set_data, a state tensor replaced, state cleared, an option that changes
// the state, a new group) must be seen. Each case runs the same events on
// two copies of the optimizer, one of which forgets its plan before every
// step, and compares parameters and state bit for bit; it also checks which
// way the plan was found (last_plan_match). CPU and CUDA (skipped without a
// device).

#include <ampfuse/fused_adagrad.h>
#include <ampfuse/fused_adam.h>
#include <ampfuse/fused_lamb.h>
#include <ampfuse/fused_rmsprop.h>
#include <ampfuse/fused_sgd.h>
#include <ampfuse/grad_scaler.h>

#include <ATen/ops/_lazy_clone.h>

#include <functional>
#include <limits>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "contract/torch/group_spans.h"
#include "tests/common.h"

namespace {

using ampfuse::sdk::PlanMatch;
using ampfuse_test::bitwise_equal;
using ::testing::HasSubstr;

// An optimizer that can be told to forget its step plan.
template <class Opt>
class Forgetful : public Opt {
 public:
  using Opt::Opt;
  void forget() { this->forget_plan(); }
};

using StepPlanTest = ampfuse_test::DeviceTest;

// Two optimizers over equal copies of the same parameters: `reused` keeps
// its plan, `fresh` forgets it before every step.
template <class Opt>
struct Twins {
  std::vector<torch::Tensor> a, b;
  std::unique_ptr<Forgetful<Opt>> reused, fresh;

  template <class Make>
  Twins(const std::vector<torch::Tensor>& params, Make&& make) {
    for (const auto& p : params) {
      a.push_back(p.detach().clone().requires_grad_());
      b.push_back(p.detach().clone().requires_grad_());
    }
    reused = make(a);
    fresh = make(b);
  }
  // The same change applied to both: f(optimizer, its params).
  void apply(const std::function<void(Forgetful<Opt>&, std::vector<torch::Tensor>&)>& f) {
    f(*reused, a);
    f(*fresh, b);
  }
  // New grads, equal in both, written in place (same tensors) or as new tensors.
  void grads(bool in_place) {
    for (std::size_t i = 0; i < a.size(); ++i) {
      const torch::Tensor g = torch::randn_like(a[i]);
      for (torch::Tensor* p : {&a[i], &b[i]}) {
        if (in_place && p->grad().defined()) p->mutable_grad().copy_(g);
        else p->mutable_grad() = g.clone();
      }
    }
  }
  ::testing::AssertionResult step(PlanMatch expected) {
    reused->step();
    fresh->forget();
    fresh->step();
    if (reused->last_plan_match() != expected)
      return ::testing::AssertionFailure() << "the plan was found as " << static_cast<int>(reused->last_plan_match())
                                           << ", expected " << static_cast<int>(expected);
    for (std::size_t i = 0; i < a.size(); ++i) {
      auto r = bitwise_equal(a[i].detach(), b[i].detach());
      if (!r) return r << " (parameter " << i << ")";
    }
    return ::testing::AssertionSuccess();
  }
};

template <class Opt, class Options>
auto maker(Options options) {
  return [options](std::vector<torch::Tensor>& params) {
    return std::make_unique<Forgetful<Opt>>(params, options);
  };
}

TEST_P(StepPlanTest, FusedAdamReusesItsPlanAndSeesEveryChange) {
  Twins<ampfuse::FusedAdam> t({param({33}, torch::kFloat), param({4, 5}, torch::kFloat), param({0}, torch::kFloat),
                               param({70000}, torch::kFloat)},
                              maker<ampfuse::FusedAdam>(torch::optim::AdamOptions(1e-2).weight_decay(0.1)));
  t.grads(false);
  EXPECT_TRUE(t.step(PlanMatch::kChanged));  // the first step
  t.grads(true);
  EXPECT_TRUE(t.step(PlanMatch::kSame));
  t.grads(true);
  EXPECT_TRUE(t.step(PlanMatch::kSame));
  t.grads(false);  // zero_grad(set_to_none) and a new backward
  EXPECT_TRUE(t.step(PlanMatch::kGradsMoved));
  t.apply([](auto& opt, auto&) { static_cast<torch::optim::AdamOptions&>(opt.param_groups()[0].options()).lr(3e-3); });
  t.grads(true);
  EXPECT_TRUE(t.step(PlanMatch::kSame));  // an lr schedule
  t.apply([](auto&, auto& params) {  // new storage for a parameter (as module.to() does)
    params[1].set_data(params[1].detach().clone() * 2);
  });
  t.grads(true);
  EXPECT_TRUE(t.step(PlanMatch::kChanged));
  t.apply([](auto&, auto& params) {  // weights loaded as torch::load loads them: set_ on the parameter itself
    torch::NoGradGuard no_grad;
    params[0].set_(params[0].detach().clone() - 1);
  });
  t.grads(true);
  EXPECT_TRUE(t.step(PlanMatch::kChanged));
  t.grads(true);
  EXPECT_TRUE(t.step(PlanMatch::kSame));
  t.apply([](auto& opt, auto& params) {  // a state tensor replaced from outside
    auto& s = static_cast<ampfuse::FusedAdamParamState&>(*opt.state().at(params[3].unsafeGetTensorImpl()));
    s.exp_avg(s.exp_avg().clone() * 0.5);
  });
  t.grads(true);
  EXPECT_TRUE(t.step(PlanMatch::kChanged));
  t.apply([](auto& opt, auto& params) {  // two state tensors swapped: the same TensorImpls, each in the other's place
    auto& s = static_cast<ampfuse::FusedAdamParamState&>(*opt.state().at(params[1].unsafeGetTensorImpl()));
    const torch::Tensor m = s.exp_avg(), v = s.exp_avg_sq();
    m.abs_();  // in place (the same tensor): a second moment is not negative
    s.exp_avg(v);
    s.exp_avg_sq(m);
  });
  t.grads(true);
  EXPECT_TRUE(t.step(PlanMatch::kChanged));  // the stamp depends on each tensor's place
  t.apply([](auto& opt, auto&) {
    static_cast<torch::optim::AdamOptions&>(opt.param_groups()[0].options()).amsgrad(true);
  });
  t.grads(true);
  EXPECT_TRUE(t.step(PlanMatch::kChanged));  // amsgrad is FusedAdam's plan_key: it makes max_exp_avg_sq
  t.grads(true);
  EXPECT_TRUE(t.step(PlanMatch::kSame));  // recorded with the plan
  t.apply([](auto& opt, auto&) { opt.state().clear(); });
  t.grads(true);
  EXPECT_TRUE(t.step(PlanMatch::kChanged));
  t.apply([this](auto& opt, auto& params) {
    params.push_back(torch::ones({7}, torch::TensorOptions().device(device_)).requires_grad_());
    params.back().mutable_grad() = torch::full({7}, 0.25, params.back().options());
    opt.add_param_group(torch::optim::OptimizerParamGroup({params.back()}, opt.param_groups()[0].options().clone()));
  });
  EXPECT_TRUE(t.step(PlanMatch::kChanged));
  t.grads(true);
  EXPECT_TRUE(t.step(PlanMatch::kSame));
}

// Master copies: a write into a half parameter from outside (loading
// weights) is seen at a step that reuses its plan.
TEST_P(StepPlanTest, FusedAdamMasterWeightsFollowWritesUnderAPlan) {
  Twins<ampfuse::FusedAdamW> t(
      {param({129}, torch::kHalf), param({3, 3}, torch::kBFloat16)}, [](std::vector<torch::Tensor>& params) {
        return std::make_unique<Forgetful<ampfuse::FusedAdamW>>(
            params, torch::optim::AdamWOptions(1e-2), ampfuse::FusedAdamOptions().master_weights(true));
      });
  t.grads(false);
  EXPECT_TRUE(t.step(PlanMatch::kChanged));
  t.grads(true);
  EXPECT_TRUE(t.step(PlanMatch::kSame));
  t.apply([](auto&, auto& params) {
    torch::NoGradGuard no_grad;
    params[0].fill_(0.5);
  });
  t.grads(true);
  EXPECT_TRUE(t.step(PlanMatch::kSame));
  EXPECT_LT((t.a[0].detach().to(torch::kFloat) - 0.5).abs().max().item<float>(), 0.05f)
      << "the step undid a write made from outside";
}

// FusedSGD keeps its pointer arrays and Plan on CPU: the momentum buffers
// its first step made (and filled) are not filled again at the steps that
// reuse them, and momentum switched on is seen at the step where it changes.
TEST_P(StepPlanTest, FusedSGDAndFusedLAMBReuseTheirPlans) {
  Twins<ampfuse::FusedSGD> sgd(
      {param({129}, torch::kFloat), param({5}, torch::kFloat), param({0}, torch::kFloat), param({70000}, torch::kFloat)},
      maker<ampfuse::FusedSGD>(torch::optim::SGDOptions(0.1).momentum(0.9).nesterov(true)));
  Twins<ampfuse::FusedSGD> plain({param({129}, torch::kFloat), param({70000}, torch::kFloat)},
                                 maker<ampfuse::FusedSGD>(torch::optim::SGDOptions(0.1).dampening(0.5)));
  Twins<ampfuse::FusedLAMB> lamb({param({129}, torch::kFloat), param({5}, torch::kFloat)},
                                 maker<ampfuse::FusedLAMB>(ampfuse::FusedLAMBOptions(1e-2)));
  for (int step = 0; step < 4; ++step) {
    const PlanMatch expected = step == 0 ? PlanMatch::kChanged : step == 2 ? PlanMatch::kGradsMoved : PlanMatch::kSame;
    sgd.grads(step != 2 && step != 0);
    lamb.grads(step != 2 && step != 0);
    EXPECT_TRUE(sgd.step(expected)) << "FusedSGD, step " << step;
    EXPECT_TRUE(lamb.step(expected)) << "FusedLAMB, step " << step;
    plain.grads(step != 2 && step != 0);
    EXPECT_TRUE(plain.step(expected)) << "FusedSGD without momentum, step " << step;
  }
  plain.apply([](auto& opt, auto&) {
    static_cast<torch::optim::SGDOptions&>(opt.param_groups()[0].options()).momentum(0.9);
  });
  // (momentum is FusedSGD's plan_key: the plan starts over at the step that
  // sees it, and holds from there, the buffers made in that step included)
  for (const PlanMatch expected : {PlanMatch::kChanged, PlanMatch::kSame, PlanMatch::kSame}) {
    plain.grads(true);
    EXPECT_TRUE(plain.step(expected)) << "FusedSGD with momentum switched on";
  }
  for (std::size_t i = 0; i < plain.a.size(); ++i)
    EXPECT_TRUE(plain.reused->state().count(plain.a[i].unsafeGetTensorImpl())) << "no momentum buffer for param " << i;
  sgd.apply([](auto& opt, auto& params) {
    auto& s = static_cast<ampfuse::FusedSGDParamState&>(*opt.state().at(params[0].unsafeGetTensorImpl()));
    s.momentum_buffer(s.momentum_buffer().clone().zero_());
  });
  sgd.grads(true);
  EXPECT_TRUE(sgd.step(PlanMatch::kChanged));
}

// FusedAdagrad and FusedRMSprop keep their pointer arrays and Plan on CPU
// too. An option that gives RMSprop's state another list (momentum switched
// on, its plan_key) starts the plan over at the step where it changes.
TEST_P(StepPlanTest, FusedAdagradAndFusedRMSpropReuseTheirPlans) {
  Twins<ampfuse::FusedAdagrad> adagrad(
      {param({129}, torch::kFloat), param({0}, torch::kFloat), param({70000}, torch::kFloat)},
      maker<ampfuse::FusedAdagrad>(torch::optim::AdagradOptions(0.1).lr_decay(0.01)));
  Twins<ampfuse::FusedRMSprop> rmsprop({param({129}, torch::kFloat), param({5}, torch::kFloat)},
                                       maker<ampfuse::FusedRMSprop>(torch::optim::RMSpropOptions(1e-2).centered(true)));
  for (int step = 0; step < 4; ++step) {
    const PlanMatch expected = step == 0 ? PlanMatch::kChanged : step == 2 ? PlanMatch::kGradsMoved : PlanMatch::kSame;
    adagrad.grads(step != 2 && step != 0);
    rmsprop.grads(step != 2 && step != 0);
    EXPECT_TRUE(adagrad.step(expected)) << "FusedAdagrad, step " << step;
    EXPECT_TRUE(rmsprop.step(expected)) << "FusedRMSprop, step " << step;
  }
  rmsprop.apply([](auto& opt, auto&) {
    static_cast<torch::optim::RMSpropOptions&>(opt.param_groups()[0].options()).momentum(0.9);
  });
  for (const PlanMatch expected : {PlanMatch::kChanged, PlanMatch::kSame, PlanMatch::kSame}) {
    rmsprop.grads(true);
    EXPECT_TRUE(rmsprop.step(expected)) << "FusedRMSprop with momentum switched on";
  }
}

// What a plan skips checking must be checked again when it changes: a new
// grad of the wrong shape, and a state tensor replaced by one of the wrong
// shape, are refused naming the group and the parameter, and change nothing.
// Parameters without grads (frozen layers passed to the optimizer) keep the
// plan; a grad appearing on one, or going away again, is seen.
TEST_P(StepPlanTest, FrozenParametersKeepThePlanAndAGradOnOneIsSeen) {
  Twins<ampfuse::FusedAdam> t({param({9}, torch::kFloat), param({5}, torch::kFloat), param({3000}, torch::kFloat)},
                              maker<ampfuse::FusedAdam>(torch::optim::AdamOptions(1e-2)));
  // New grads for the parameters in `with` (the same values in both twins), in place where there is one.
  auto grads = [&t](std::vector<std::size_t> with) {
    for (const std::size_t i : with) {
      const torch::Tensor g = torch::randn_like(t.a[i]);
      for (torch::Tensor* p : {&t.a[i], &t.b[i]}) {
        if (p->grad().defined()) p->mutable_grad().copy_(g);
        else p->mutable_grad() = g.clone();
      }
    }
  };
  grads({0, 2});
  EXPECT_TRUE(t.step(PlanMatch::kChanged));  // the first step
  for (int s = 0; s < 2; ++s) {
    grads({0, 2});
    EXPECT_TRUE(t.step(PlanMatch::kSame));
  }
  EXPECT_EQ(t.reused->state().count(t.a[1].unsafeGetTensorImpl()), 0u);
  grads({0, 1, 2});  // unfrozen
  EXPECT_TRUE(t.step(PlanMatch::kChanged));
  grads({0, 1, 2});
  EXPECT_TRUE(t.step(PlanMatch::kSame));
  // Frozen again, with state: the plan's entries and lists are made again, nothing else validated again.
  t.apply([](auto&, auto& params) { params[1].mutable_grad() = torch::Tensor(); });
  grads({0, 2});
  EXPECT_TRUE(t.step(PlanMatch::kGradsCameOrWent));
  grads({0, 2});
  EXPECT_TRUE(t.step(PlanMatch::kSame));
  grads({0, 1, 2});  // unfrozen, with its state
  EXPECT_TRUE(t.step(PlanMatch::kGradsCameOrWent));
  grads({0, 1, 2});
  EXPECT_TRUE(t.step(PlanMatch::kSame));
  // Param 2 frozen beside a grad that moved (param 0's: a new tensor).
  t.apply([](auto&, auto& params) {
    params[0].mutable_grad() = torch::Tensor();
    params[2].mutable_grad() = torch::Tensor();
  });
  grads({0, 1});
  EXPECT_TRUE(t.step(PlanMatch::kGradsCameOrWent));
  // Param 1 frozen and param 2 unfrozen at once, beside a grad that moved.
  t.apply([](auto&, auto& params) {
    params[0].mutable_grad() = torch::ones_like(params[0]);  // (a new tensor: moved)
    params[1].mutable_grad() = torch::Tensor();
  });
  grads({2});
  EXPECT_TRUE(t.step(PlanMatch::kGradsCameOrWent));
  t.apply([](auto&, auto& params) { params[2].mutable_grad() = torch::Tensor(); });
  grads({0, 1});
  EXPECT_TRUE(t.step(PlanMatch::kGradsCameOrWent));
  grads({0, 1, 2});
  EXPECT_TRUE(t.step(PlanMatch::kGradsCameOrWent));
  for (int s = 0; s < 2; ++s) {
    t.apply([](auto&, auto& params) { params[1].mutable_grad() = torch::Tensor(); });
    grads({0, 2});
    EXPECT_TRUE(t.step(s == 0 ? PlanMatch::kGradsCameOrWent : PlanMatch::kSame));
  }
  t.apply([](auto& opt, auto& params) { opt.state().erase(params[1].unsafeGetTensorImpl()); });  // its state dropped
  grads({0, 2});
  EXPECT_TRUE(t.step(PlanMatch::kChanged));
  grads({0, 2});
  EXPECT_TRUE(t.step(PlanMatch::kSame));
}

// A grad that a parameter gains under a kept plan is checked as a moved
// one, and the parameter's state follows it and is checked as at a step
// that makes the plan: what a step made from scratch refuses is refused
// alike, with the same error, and changes nothing; what it takes is taken
// alike; a grad that is read through a copy makes the plan again.
TEST_P(StepPlanTest, AGradGainedUnderAPlanIsValidatedAsAFreshStepValidatesIt) {
  Twins<ampfuse::FusedAdam> t({param({9}, torch::kFloat), param({4, 6}, torch::kFloat), param({3000}, torch::kFloat)},
                              maker<ampfuse::FusedAdam>(torch::optim::AdamOptions(1e-2)));
  // Param `i` without a grad in both twins.
  const auto freeze = [&t](std::size_t i) { t.apply([i](auto&, auto& params) { params[i].mutable_grad() = torch::Tensor(); }); };
  // Param `i`'s exp_avg restrided in place (the same tensor: the plan's stamp still matches).
  const auto restride_exp_avg = [&t](std::size_t i, std::vector<std::int64_t> sizes, std::vector<std::int64_t> strides) {
    t.apply([=](auto& opt, auto& params) {
      auto& s = static_cast<ampfuse::FusedAdamParamState&>(*opt.state().at(params[i].unsafeGetTensorImpl()));
      s.exp_avg().as_strided_(sizes, strides);
    });
  };
  const auto both_refuse = [&t](const char* what, const char* param, const char* message) {
    const std::vector<torch::Tensor> before = {t.a[0].detach().clone(), t.a[1].detach().clone(),
                                               t.a[2].detach().clone()};
    std::string errors[2];
    int k = 0;
    for (auto* opt : {static_cast<torch::optim::Optimizer*>(t.reused.get()),
                      static_cast<torch::optim::Optimizer*>(t.fresh.get())}) {
      if (k == 1) t.fresh->forget();
      try {
        opt->step();
      } catch (const c10::Error& e) {
        errors[k] = e.what_without_backtrace();
      }
      ++k;
    }
    EXPECT_THAT(errors[0], HasSubstr(param)) << what;
    EXPECT_THAT(errors[0], HasSubstr(message)) << what;
    EXPECT_EQ(errors[0], errors[1]) << what << ": the kept plan's error and a fresh step's differ";
    for (std::size_t i = 0; i < before.size(); ++i)
      EXPECT_TRUE(bitwise_equal(t.a[i].detach(), before[i])) << what << ": parameter " << i << " was written";
  };
  // New grads for the parameters that have one, in place (equal in both twins).
  const auto grads_kept = [&t] {
    for (std::size_t i = 0; i < t.a.size(); ++i) {
      if (!t.a[i].grad().defined()) continue;
      const torch::Tensor g = torch::randn_like(t.a[i]);
      t.a[i].mutable_grad().copy_(g);
      t.b[i].mutable_grad().copy_(g);
    }
  };
  // Param 1 frozen under a kept plan.
  const auto plan_with_1_frozen = [&](PlanMatch expected) {
    freeze(1);
    grads_kept();
    EXPECT_TRUE(t.step(expected));
  };
  t.grads(false);
  EXPECT_TRUE(t.step(PlanMatch::kChanged));
  plan_with_1_frozen(PlanMatch::kGradsCameOrWent);
  // A grad of another dtype gained: refused by both, naming the parameter.
  t.apply([](auto&, auto& params) {
    params[1].mutable_grad() = torch::ones(params[1].sizes(), params[1].options().dtype(torch::kDouble));
  });
  both_refuse("a Double grad", "param group 0, param 1:", "Double");
  plan_with_1_frozen(PlanMatch::kChanged);  // (a refused step forgets the plan)
  // A grad laid out otherwise (transposed): read through a copy, so the plan is made again.
  t.apply([](auto&, auto& params) { params[1].mutable_grad() = torch::ones({6, 4}, params[1].options()).t(); });
  grads_kept();
  EXPECT_TRUE(t.step(PlanMatch::kChanged));
  plan_with_1_frozen(PlanMatch::kChanged);  // (no grad read through a copy any more)
  // A state tensor restrided in place to the other order of its shape while its parameter was
  // frozen: it follows the parameter (a copy in its layout), as at a step that makes the plan.
  restride_exp_avg(1, {4, 6}, {1, 4});
  t.apply([](auto&, auto& params) { params[1].mutable_grad() = torch::ones_like(params[1]); });
  grads_kept();
  EXPECT_TRUE(t.step(PlanMatch::kGradsCameOrWent));
  EXPECT_TRUE(bitwise_equal(
      static_cast<ampfuse::FusedAdamParamState&>(*t.reused->state().at(t.a[1].unsafeGetTensorImpl())).exp_avg(),
      static_cast<ampfuse::FusedAdamParamState&>(*t.fresh->state().at(t.b[1].unsafeGetTensorImpl())).exp_avg()));
  grads_kept();
  EXPECT_TRUE(t.step(PlanMatch::kChanged));  // (the state tensor that followed is a new one)
  // Two parameters refused at once, param 0 for its state and param 1 for its grad: a fresh step
  // checks each parameter's grad and state in order, and names param 0; so must the kept plan.
  freeze(0);
  plan_with_1_frozen(PlanMatch::kGradsCameOrWent);
  restride_exp_avg(0, {3, 3}, {3, 1});
  t.apply([](auto&, auto& params) {
    params[0].mutable_grad() = torch::ones_like(params[0]);
    params[1].mutable_grad() = torch::ones(params[1].sizes(), params[1].options().dtype(torch::kDouble));
  });
  both_refuse("param 0's state and param 1's grad", "param group 0, param 0:", "exp_avg");
  restride_exp_avg(0, {9}, {1});
  freeze(0);
  plan_with_1_frozen(PlanMatch::kChanged);
  // A state tensor of another shape: refused alike.
  restride_exp_avg(1, {6, 4}, {4, 1});
  t.apply([](auto&, auto& params) { params[1].mutable_grad() = torch::ones_like(params[1]); });
  both_refuse("a state tensor of another shape", "param group 0, param 1:", "exp_avg");
}

// Many parameters (several ranges of the match's parallel loop), a few in
// every range gaining or losing a grad at each step, in two groups: the
// ranges' parameters that gained one are gathered in order.
TEST_P(StepPlanTest, ManyParametersGainAndLoseGradsAcrossTheMatchsRanges) {
  std::vector<torch::Tensor> init;
  for (int i = 0; i < 3000; ++i) init.push_back(param({1 + i % 3}, torch::kFloat));
  Twins<ampfuse::FusedAdamW> t(init, [](std::vector<torch::Tensor>& params) {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<torch::Tensor>(params.begin(), params.begin() + 1700));
    groups.emplace_back(std::vector<torch::Tensor>(params.begin() + 1700, params.end()),
                        std::make_unique<torch::optim::AdamWOptions>(3e-3));
    return std::make_unique<Forgetful<ampfuse::FusedAdamW>>(groups, torch::optim::AdamWOptions(1e-2));
  });
  for (int step = 0; step < 6; ++step) {
    // Param i has no grad at this step when i % 7 == step % 7 (from the second step on).
    for (std::size_t i = 0; i < t.a.size(); ++i) {
      const bool without = step > 0 && i % 7 == static_cast<std::size_t>(step % 7);
      const torch::Tensor g = torch::randn_like(t.a[i]);
      for (torch::Tensor* p : {&t.a[i], &t.b[i]}) p->mutable_grad() = without ? torch::Tensor() : g.clone();
    }
    EXPECT_TRUE(t.step(step == 0 ? PlanMatch::kChanged : PlanMatch::kGradsCameOrWent)) << "step " << step;
  }
}

// New grads at every step take the plan's fast path for moved grads, which
// reads each new grad without rebuilding the parameter's record: a new grad
// of another layout, dtype or kind, or one beside a changed state, must still
// be seen as such.
TEST_P(StepPlanTest, NewGradsOfAnotherKindAreSeen) {
  Twins<ampfuse::FusedAdam> t({param({4, 5}, torch::kFloat), param({33}, torch::kFloat)},
                              maker<ampfuse::FusedAdam>(torch::optim::AdamOptions(1e-2)));
  t.grads(false);
  EXPECT_TRUE(t.step(PlanMatch::kChanged));
  t.grads(false);
  EXPECT_TRUE(t.step(PlanMatch::kGradsMoved));
  const torch::Tensor g0 = torch::randn({5, 4}, t.a[0].options()), g1 = torch::randn_like(t.a[1]);
  t.apply([&](auto&, auto& params) {  // a transposed grad: read through a copy from now on
    params[0].mutable_grad() = g0.clone().t();
    params[1].mutable_grad() = g1.clone();
  });
  EXPECT_TRUE(t.step(PlanMatch::kChanged));
  t.grads(false);  // dense again
  EXPECT_TRUE(t.step(PlanMatch::kChanged));
  t.grads(false);
  EXPECT_TRUE(t.step(PlanMatch::kGradsMoved));
  t.apply([&](auto& opt, auto& params) {  // a new grad and a state tensor replaced at once
    params[1].mutable_grad() = g1.clone();
    auto& s = static_cast<ampfuse::FusedAdamParamState&>(*opt.state().at(params[1].unsafeGetTensorImpl()));
    s.exp_avg(s.exp_avg().clone());
  });
  EXPECT_TRUE(t.step(PlanMatch::kChanged));
  t.grads(false);
  EXPECT_TRUE(t.step(PlanMatch::kGradsMoved));
  // A new grad of another dtype, then a sparse one: refused, naming the parameter, nothing written.
  for (const bool sparse : {false, true}) {
    const torch::Tensor before = t.a[1].detach().clone();
    t.a[1].mutable_grad() = sparse ? torch::randn_like(t.a[1]).to_sparse() : torch::randn_like(t.a[1]).to(torch::kDouble);
    try {
      t.reused->step();
      ADD_FAILURE() << "a new grad " << (sparse ? "that is sparse" : "of another dtype") << " was taken";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("param group 0, param 1"));
      EXPECT_THAT(e.what(), HasSubstr(sparse ? "sparse" : "grad dtype"));
    }
    EXPECT_TRUE(bitwise_equal(t.a[1].detach(), before));
    t.a[1].mutable_grad() = torch::randn_like(t.a[1]);
    t.reused->step();  // a failed step forgets the plan: this one builds it again
    EXPECT_EQ(t.reused->last_plan_match(), PlanMatch::kChanged);
    t.a[1].mutable_grad() = torch::randn_like(t.a[1]);
    t.reused->step();
    EXPECT_EQ(t.reused->last_plan_match(), PlanMatch::kGradsMoved);
  }
}

TEST_P(StepPlanTest, ChangesUnderAPlanAreValidated) {
  auto a = param({8}, torch::kFloat), b = param({9}, torch::kFloat);
  ampfuse::FusedAdam opt({a, b}, torch::optim::AdamOptions(1e-2));
  for (auto* p : {&a, &b}) p->mutable_grad() = torch::randn_like(*p);
  opt.step();
  b.mutable_grad() = torch::randn({10}, b.options());
  const torch::Tensor a_before = a.detach().clone();
  try {
    opt.step();
    ADD_FAILURE() << "a grad of the wrong shape was taken";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("param group 0, param 1"));
    EXPECT_THAT(e.what(), HasSubstr("grad shape"));
  }
  EXPECT_TRUE(bitwise_equal(a.detach(), a_before));
  b.mutable_grad() = torch::randn_like(b);
  opt.step();
  EXPECT_EQ(opt.last_plan_match(), PlanMatch::kChanged);  // a failed step forgets the plan
  auto& s = static_cast<ampfuse::FusedAdamParamState&>(*opt.state().at(a.unsafeGetTensorImpl()));
  s.exp_avg_sq(torch::zeros({3}, a.options()));
  try {
    opt.step();
    ADD_FAILURE() << "a state tensor of the wrong shape was taken";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("param group 0, param 0"));
    EXPECT_THAT(e.what(), HasSubstr("exp_avg_sq"));
  }
}

// A plan compares state tensors by address and holds them meanwhile: a
// state tensor dropped and another of the wrong size set in its place (which
// the allocator could put at the same address were the first one freed) is
// seen, validated and refused.
TEST_P(StepPlanTest, AStateTensorDroppedAndReplacedIsValidatedAgain) {
  auto p = param({64}, torch::kFloat);
  ampfuse::FusedSGD opt({p}, torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < 2; ++step) {
    p.mutable_grad() = torch::randn_like(p);
    opt.step();
  }
  auto& s = static_cast<ampfuse::FusedSGDParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
  const at::TensorImpl* kept = s.momentum_buffer().unsafeGetTensorImpl();
  s.momentum_buffer(torch::Tensor());
  s.momentum_buffer(torch::zeros({3}, p.options()));
  EXPECT_NE(s.momentum_buffer().unsafeGetTensorImpl(), kept) << "the plan no longer holds the dropped tensor";
  const torch::Tensor before = p.detach().clone();
  ampfuse_test::expect_step_refused(opt, "param group 0, param 0: state momentum_buffer has shape [3]");
  EXPECT_TRUE(bitwise_equal(p.detach(), before));
}

// Tensors whose negative bit is set (x._neg_view(); at::imag(z.conj()) makes
// one) hold their values negated in memory: a grad, a parameter and a state
// tensor of that kind are stepped as their values, as torch::optim steps
// them (a grad through a copy, a parameter through a dense copy written
// back, a state tensor replaced by a copy of its values), on the first step
// and under a plan, for FusedSGD and FusedAdam.
TEST_P(StepPlanTest, NegativeBitTensorsAreSteppedAsTheirValues) {
  auto neg_of = [](const torch::Tensor& values) { return values.neg()._neg_view(); };  // same values, negated memory
  for (const bool adam : {false, true}) {
    SCOPED_TRACE(adam ? "FusedAdam" : "FusedSGD");
    auto values = torch::randn({7}, torch::TensorOptions().device(device_));
    auto ours = neg_of(values).detach().requires_grad_(), ref = values.clone().requires_grad_();
    ASSERT_TRUE(ours.is_neg());
    std::unique_ptr<torch::optim::Optimizer> opt, reference;
    if (adam) {
      opt = std::make_unique<ampfuse::FusedAdam>(std::vector<torch::Tensor>{ours}, torch::optim::AdamOptions(0.1));
      reference = std::make_unique<torch::optim::Adam>(std::vector<torch::Tensor>{ref}, torch::optim::AdamOptions(0.1));
    } else {
      const auto o = torch::optim::SGDOptions(0.1).momentum(0.9);
      opt = std::make_unique<ampfuse::FusedSGD>(std::vector<torch::Tensor>{ours}, o);
      reference = std::make_unique<torch::optim::SGD>(std::vector<torch::Tensor>{ref}, o);
    }
    for (int step = 0; step < 4; ++step) {
      const auto g = torch::randn_like(values);
      ours.mutable_grad() = neg_of(g);
      ref.mutable_grad() = g.clone();
      if (step == 2 && adam) {  // a state tensor replaced by hand with one of the same values, negated in memory
        auto& st = static_cast<ampfuse::FusedAdamParamState&>(*opt->state().at(ours.unsafeGetTensorImpl()));
        st.exp_avg(neg_of(st.exp_avg().clone()));
      }
      opt->step();
      reference->step();
      ampfuse_test::expect_close({ours.detach().resolve_neg()}, {ref.detach()}, 1e-6, "step " + std::to_string(step));
    }
  }
}

// A parameter made under InferenceMode is refused outside it, naming it,
// as ATen's in-place ops (and so torch::optim) refuse to update it; nothing
// is written.
TEST(ParamKinds, AnInferenceTensorParameterIsRefusedAsTorchOptimRefusesIt) {
  torch::Tensor p;
  {
    c10::InferenceMode guard;
    p = torch::randn({5});
  }
  p.mutable_grad() = torch::randn({5});
  const torch::Tensor before = p.clone();
  ampfuse::FusedAdam opt({p}, torch::optim::AdamOptions(0.1));
  ampfuse_test::expect_step_refused(opt, "param group 0, param 0 is an inference tensor");
  EXPECT_TRUE(torch::equal(p, before));
  EXPECT_TRUE(opt.state().empty());
  torch::optim::Adam reference({p}, torch::optim::AdamOptions(0.1));
  EXPECT_THROW(reference.step(), c10::Error);

  // Inside InferenceMode they are taken, also where ATen's threads check them (past 512 parameters),
  // which do not see the calling thread's InferenceMode.
  std::vector<torch::Tensor> many;
  {
    c10::InferenceMode guard;
    for (int i = 0; i < 1500; ++i) many.push_back(torch::randn({2}));
  }
  for (auto& q : many) q.mutable_grad() = torch::randn({2});
  ampfuse::FusedAdam inside(many, torch::optim::AdamOptions(0.1));
  {
    c10::InferenceMode guard;
    EXPECT_NO_THROW(inside.step());
  }
}

// A state tensor given other memory in place under a plan: set_ (which
// torch::load into a tensor does) is not seen, the step writing the memory
// the plan keeps pointers to, which the plan holds (it was freed, and the
// step wrote freed memory: a crash at 1M elements, their pages unmapped);
// resize_ past its bytes is refused by LibTorch, the storage being made
// non-resizable (it reallocated, freeing the kept memory alike). Each
// optimizer's way of keeping pointers: FusedAdam's and FusedLAMB's own,
// FusedSGD's KeptLists.
TEST_P(StepPlanTest, StateTensorsGivenOtherMemoryInPlaceAreNeverFreedUnderAPlan) {
  constexpr std::int64_t kN = 1 << 20;
  auto run = [&](torch::optim::Optimizer& opt, torch::Tensor& p, const std::function<torch::Tensor&()>& state) {
    for (int step = 0; step < 4; ++step) {
      if (step == 2) {
        EXPECT_THAT(ampfuse_test::error_of([&] { state().resize_({4 * kN}); }), HasSubstr("not resizable"));
        state().set_(torch::zeros({kN}, p.options()));
      }
      p.mutable_grad() = torch::randn_like(p);
      opt.step();
    }
    EXPECT_EQ(state().abs().sum().item<double>(), 0.0) << "set_ is not seen under a plan";
  };
  {
    auto p = param({kN}, torch::kFloat);
    ampfuse::FusedAdam opt({p}, torch::optim::AdamOptions(1e-3));
    run(opt, p, [&]() -> torch::Tensor& {
      return static_cast<ampfuse::FusedAdamParamState&>(*opt.state().at(p.unsafeGetTensorImpl())).exp_avg();
    });
  }
  {
    auto p = param({kN}, torch::kFloat);
    ampfuse::FusedLAMB opt({p}, ampfuse::FusedLAMBOptions(1e-3));
    run(opt, p, [&]() -> torch::Tensor& {
      return static_cast<ampfuse::FusedLAMBParamState&>(*opt.state().at(p.unsafeGetTensorImpl())).exp_avg_sq();
    });
  }
  {
    auto p = param({kN}, torch::kFloat);
    ampfuse::FusedSGD opt({p}, torch::optim::SGDOptions(1e-3).momentum(0.9));
    run(opt, p, [&]() -> torch::Tensor& {
      return static_cast<ampfuse::FusedSGDParamState&>(*opt.state().at(p.unsafeGetTensorImpl())).momentum_buffer();
    });
  }
}

// A model converted after its optimizer made state (Module::to(dtype) and
// set_data to channels_last give its parameters other memory): torch::optim
// steps on with the old state, and so does every fused optimizer, whose
// state follows the parameter (follow_param: a copy in the parameter's
// dtype and layout). Checked against torch::optim over the steps after the
// conversion (its state stays fp32 and contiguous: within fp32 rounding),
// and the state's dtype and strides are the parameter's.
template <class Ours, class Ref, class St, class Options, class TensorsOf>
void expect_conversion_followed(const std::vector<torch::Tensor>& params, const Options& options,
                                const std::function<void(torch::Tensor&)>& convert, const char* what,
                                TensorsOf tensors_of) {
  SCOPED_TRACE(what);
  auto ours = ampfuse_test::leaf_copies(params), ref = ampfuse_test::leaf_copies(params);
  Ours opt(ours, options);
  Ref reference(ref, options);
  auto step = [&](bool grads_like_params) {
    for (std::size_t i = 0; i < ours.size(); ++i) {
      const torch::Tensor g = torch::randn(ours[i].sizes(), ours[i].options());
      // A backward gives grads laid out as the parameters (channels_last ones too).
      ours[i].mutable_grad() = grads_like_params ? torch::empty_like(ours[i]).copy_(g) : g;
      ref[i].mutable_grad() = ours[i].grad().clone();
    }
    opt.step();
    reference.step();
  };
  for (int s = 0; s < 2; ++s) step(false);
  for (auto* list : {&ours, &ref})
    for (torch::Tensor& p : *list) convert(p);
  for (int s = 0; s < 3; ++s) step(true);
  ampfuse_test::expect_close(ours, ref, 1e-5, "after the conversion");
  for (const torch::Tensor& p : ours) {  // every state tensor has the parameter's dtype and strides now
    const auto& st = static_cast<const St&>(*opt.state().at(p.unsafeGetTensorImpl()));
    for (const torch::Tensor& t : tensors_of(st)) {
      if (!t.defined()) continue;
      EXPECT_EQ(t.scalar_type(), p.scalar_type());
      EXPECT_EQ(t.strides(), p.strides());
    }
  }
}

TEST_P(StepPlanTest, ConvertedParametersTakeTheirStateAlong) {
  const std::vector<torch::Tensor> params{param({3, 4, 2, 2}, torch::kFloat), param({129}, torch::kFloat),
                                          param({0}, torch::kFloat), param({5}, torch::kFloat)};
  const auto to_double = [](torch::Tensor& p) { p.set_data(p.detach().to(torch::kDouble)); };
  const auto channels_last = [](torch::Tensor& p) {
    if (p.dim() == 4) p.set_data(p.detach().contiguous(torch::MemoryFormat::ChannelsLast));
  };
  for (const auto& [convert, what] : {std::pair<std::function<void(torch::Tensor&)>, const char*>{to_double, "to Double"},
                                      {channels_last, "to channels_last"}}) {
    const auto moments = [](const auto& st) {
      return std::vector<torch::Tensor>{st.exp_avg(), st.exp_avg_sq(), st.max_exp_avg_sq()};
    };
    expect_conversion_followed<ampfuse::FusedAdam, torch::optim::Adam, ampfuse::FusedAdamParamState>(
        params, torch::optim::AdamOptions(1e-2).amsgrad(true).weight_decay(0.1), convert, what, moments);
    expect_conversion_followed<ampfuse::FusedAdamW, torch::optim::AdamW, ampfuse::FusedAdamWParamState>(
        params, torch::optim::AdamWOptions(1e-2), convert, what, moments);
    expect_conversion_followed<ampfuse::FusedSGD, torch::optim::SGD, ampfuse::FusedSGDParamState>(
        params, torch::optim::SGDOptions(1e-2).momentum(0.9).nesterov(true), convert, what,
        [](const auto& st) { return std::vector<torch::Tensor>{st.momentum_buffer()}; });
    // FusedAdagrad makes its state in its constructor (as torch::optim::Adagrad).
    expect_conversion_followed<ampfuse::FusedAdagrad, torch::optim::Adagrad, ampfuse::FusedAdagradParamState>(
        params, torch::optim::AdagradOptions(1e-2).lr_decay(0.01), convert, what,
        [](const auto& st) { return std::vector<torch::Tensor>{st.sum()}; });
    expect_conversion_followed<ampfuse::FusedRMSprop, torch::optim::RMSprop, ampfuse::FusedRMSpropParamState>(
        params, torch::optim::RMSpropOptions(1e-2).centered(true).momentum(0.5), convert, what,
        [](const auto& st) { return std::vector<torch::Tensor>{st.square_avg(), st.momentum_buffer(), st.grad_avg()}; });
  }
}

// Converted before the first step: FusedAdagrad's state, made by its
// constructor, follows. A step refused after a conversion (a grad of the
// wrong shape) puts every converted state tensor back: the same tensors, in
// the old dtype; FusedLAMB's state follows as a copy made by hand would.
TEST_P(StepPlanTest, AStepRefusedAfterAConversionPutsTheStateBack) {
  auto a = param({6}, torch::kFloat), b = param({7}, torch::kFloat);
  ampfuse::FusedAdagrad adagrad({a, b}, torch::optim::AdagradOptions(0.1));
  auto sum_of = [&](const torch::Tensor& p) -> const torch::Tensor& {
    return static_cast<ampfuse::FusedAdagradParamState&>(*adagrad.state().at(p.unsafeGetTensorImpl())).sum();
  };
  const at::TensorImpl* kept = sum_of(a).unsafeGetTensorImpl();
  for (auto* p : {&a, &b}) p->set_data(p->detach().to(torch::kDouble));
  a.mutable_grad() = torch::randn_like(a);
  b.mutable_grad() = torch::randn({8}, b.options());
  const torch::Tensor a_before = a.detach().clone();
  ampfuse_test::expect_step_refused(adagrad, "param group 0, param 1");
  EXPECT_EQ(sum_of(a).unsafeGetTensorImpl(), kept) << "the refused step put the converted sum back";
  EXPECT_EQ(sum_of(a).scalar_type(), torch::kFloat);
  EXPECT_TRUE(bitwise_equal(a.detach(), a_before));
  b.mutable_grad() = torch::randn_like(b);
  adagrad.step();
  EXPECT_EQ(sum_of(a).scalar_type(), torch::kDouble);
  EXPECT_EQ(sum_of(b).scalar_type(), torch::kDouble);

  // FusedLAMB: the followed state against a twin whose state is converted by hand.
  auto p = param({33}, torch::kFloat), q = p.detach().clone().requires_grad_();
  ampfuse::FusedLAMB followed({p}, ampfuse::FusedLAMBOptions(1e-2)), by_hand({q}, ampfuse::FusedLAMBOptions(1e-2));
  auto step_both = [&] {
    p.mutable_grad() = torch::randn_like(p);
    q.mutable_grad() = p.grad().clone();
    followed.step();
    by_hand.step();
  };
  step_both();
  for (auto* t : {&p, &q}) t->set_data(t->detach().to(torch::kDouble));
  auto& st = static_cast<ampfuse::FusedLAMBParamState&>(*by_hand.state().at(q.unsafeGetTensorImpl()));
  st.exp_avg(st.exp_avg().to(torch::kDouble));
  st.exp_avg_sq(st.exp_avg_sq().to(torch::kDouble));
  for (int s = 0; s < 2; ++s) step_both();
  EXPECT_TRUE(bitwise_equal(p.detach(), q.detach()));
}

// The state kinds that follow otherwise than by a plain copy: 8-bit moments
// of a parameter given channels_last are decoded and coded again in its
// layout (against a twin left contiguous: one more rounding to the map); a
// sparse momentum buffer converted to Double stays sparse (against
// torch::optim::SGD); a bf16 parameter's master copy keeps its fp32 bits
// across a change of layout (bit for bit the twin's steps).
TEST_P(StepPlanTest, EightBitSparseAndMasterStateFollowAConversion) {
  // Five steps of w and its twin on the same grads, w given channels_last before the third.
  const auto channels_last_at_third_step = [](torch::Tensor& w, torch::Tensor& twin, torch::optim::Optimizer& opt,
                                              torch::optim::Optimizer& twin_opt,
                                              const std::function<void(int)>& after_step) {
    for (int step = 0; step < 5; ++step) {
      if (step == 2) w.set_data(w.detach().contiguous(torch::MemoryFormat::ChannelsLast));
      const torch::Tensor g = torch::randn_like(twin);
      w.mutable_grad() = torch::empty_like(w).copy_(g);  // laid out as w, as a backward makes it
      twin.mutable_grad() = g;
      opt.step();
      twin_opt.step();
      after_step(step);
    }
  };
  {
    auto w = param({64, 16, 3, 3}, torch::kFloat);  // 9,216 elements: 8-bit moments
    auto twin = w.detach().clone().requires_grad_();
    const auto options = torch::optim::AdamOptions(1e-3);
    ampfuse::FusedAdam coded({w}, options, ampfuse::FusedAdamOptions().moments_8bit(true));
    ampfuse::FusedAdam coded_twin({twin}, options, ampfuse::FusedAdamOptions().moments_8bit(true));
    channels_last_at_third_step(w, twin, coded, coded_twin, [](int) {});
    const auto& st = static_cast<ampfuse::FusedAdamParamState&>(*coded.state().at(w.unsafeGetTensorImpl()));
    EXPECT_EQ(st.exp_avg_8bit().strides(), w.strides());
    EXPECT_EQ(st.exp_avg_sq_8bit().strides(), w.strides());
    // Each step moves an element by up to about lr (1e-3). Coded once more in other blocks, the moments
    // differ by the map's resolution at their new block's absmax: a fraction of a step (1.4e-4 seen).
    // Moments paired with the wrong elements would move elements by whole steps the other way (2e-3 each).
    // The bound: 4x the largest seen (the recoding error adds up over the last three steps; helper-86).
    EXPECT_LT((w.detach() - twin.detach()).abs().max().item<double>(), 6e-4);
  }
  {
    auto options = torch::TensorOptions().device(device_);
    auto ours = torch::randn({10, 4}, options).requires_grad_(), ref = ours.detach().clone().requires_grad_();
    const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9);
    ampfuse::FusedSGD opt({ours}, sgd);
    torch::optim::SGD reference({ref}, sgd);
    for (int step = 0; step < 4; ++step) {
      if (step == 2)
        for (auto* p : {&ours, &ref}) p->set_data(p->detach().to(torch::kDouble));
      const auto indices = torch::tensor({{1, 3, 3, 7}}, options.dtype(torch::kLong));
      const auto grad = torch::sparse_coo_tensor(indices, torch::randn({4, 4}, ours.options()), {10, 4});
      ours.mutable_grad() = grad;
      ref.mutable_grad() = grad.clone();
      opt.step();
      reference.step();
    }
    const auto& buf = static_cast<ampfuse::FusedSGDParamState&>(*opt.state().at(ours.unsafeGetTensorImpl()))
                          .momentum_buffer();
    EXPECT_TRUE(buf.is_sparse());
    EXPECT_EQ(buf.scalar_type(), torch::kDouble);
    ampfuse_test::expect_close({ours}, {ref}, 1e-6, "sparse momentum after to(Double)");
  }
  {
    auto w = param({4, 3, 2, 2}, torch::kBFloat16), twin = w.detach().clone().requires_grad_();
    const auto master = ampfuse::FusedAdamOptions().master_weights(true);
    ampfuse::FusedAdam opt({w}, torch::optim::AdamOptions(1e-3), master);
    ampfuse::FusedAdam twin_opt({twin}, torch::optim::AdamOptions(1e-3), master);
    channels_last_at_third_step(w, twin, opt, twin_opt, [&](int step) {
      EXPECT_TRUE(bitwise_equal(w.detach().contiguous(), twin.detach())) << "step " << step;
    });
    const auto master_of = [](ampfuse::FusedAdam& o, const torch::Tensor& p) {
      return static_cast<ampfuse::FusedAdamParamState&>(*o.state().at(p.unsafeGetTensorImpl())).master();
    };
    EXPECT_TRUE(bitwise_equal(master_of(opt, w).contiguous(), master_of(twin_opt, twin)));
  }
}

// The scaler's check pass keeps its checked grads too: a grad replaced by a
// new tensor holding an inf is still found, and the step is skipped.
TEST_P(StepPlanTest, GradScalerSeesNewGrads) {
  auto p = param({100}, torch::kFloat);
  ampfuse::FusedAdam opt({p}, torch::optim::AdamOptions(1e-2));
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(4.0));
  scaler.scale(torch::ones({}, p.options()));
  for (int step = 0; step < 3; ++step) {
    p.mutable_grad() = torch::randn_like(p);
    scaler.step(opt);
    scaler.update();
    EXPECT_FALSE(scaler.last_step_skipped(opt));
  }
  const torch::Tensor before = p.detach().clone();
  torch::Tensor g = torch::randn_like(p);
  g[17] = std::numeric_limits<float>::infinity();
  p.mutable_grad() = g;
  scaler.step(opt);
  scaler.update();
  EXPECT_TRUE(scaler.last_step_skipped(opt));
  EXPECT_TRUE(bitwise_equal(p.detach(), before));
  p.mutable_grad().copy_(torch::randn_like(p));  // in place: the same grad, finite again
  scaler.step(opt);
  scaler.update();
  EXPECT_FALSE(scaler.last_step_skipped(opt));
  p.mutable_grad()[3] = std::numeric_limits<float>::quiet_NaN();  // in place, not finite
  scaler.step(opt);
  scaler.update();
  EXPECT_TRUE(scaler.last_step_skipped(opt));
}

// The scaler compares its kept grads group by group, split over threads
// (more parameters than one thread's range): a new grad at any place (first
// or last of a group, where the threads' ranges meet) is seen and read, not
// the one it replaced. 3 threads, so that a range starts inside a group;
// empty groups first, between the others and last.
TEST_P(StepPlanTest, GradScalerSeesANewGradAnywhereInManyGroups) {
  const int threads = torch::get_num_threads();
  torch::set_num_threads(3);
  const std::vector<std::size_t> sizes = {0, 700, 0, 1, 0, 0, 900, 0};
  std::vector<torch::optim::OptimizerParamGroup> groups;
  std::vector<torch::Tensor> params;
  for (std::size_t n : sizes) {
    std::vector<torch::Tensor> group;
    for (std::size_t i = 0; i < n; ++i) {
      params.push_back(param({2}, torch::kFloat));
      group.push_back(params.back());
    }
    groups.emplace_back(group, std::make_unique<torch::optim::AdamOptions>(1e-2));
  }
  ampfuse::FusedAdam opt(std::move(groups), torch::optim::AdamOptions(1e-2));
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(4.0));
  scaler.scale(torch::ones({}, params[0].options()));
  for (auto& p : params) p.mutable_grad() = torch::randn_like(p);
  // 1,601 parameters over 3 threads: ranges [0, 534), [534, 1068), [1068, 1601).
  for (std::size_t k : {std::size_t{0}, std::size_t{533}, std::size_t{534}, std::size_t{699}, std::size_t{700},
                        std::size_t{701}, std::size_t{1067}, std::size_t{1068}, std::size_t{1600}}) {
    scaler.step(opt);  // the grads as kept: finite
    scaler.update();
    EXPECT_FALSE(scaler.last_step_skipped(opt)) << "before parameter " << k;
    const torch::Tensor before = params[k].detach().clone();
    torch::Tensor g = torch::randn_like(params[k]);
    g[1] = std::numeric_limits<float>::infinity();
    params[k].mutable_grad() = g;  // a new tensor
    scaler.step(opt);
    scaler.update();
    EXPECT_TRUE(scaler.last_step_skipped(opt)) << "parameter " << k;
    EXPECT_TRUE(bitwise_equal(params[k].detach(), before)) << "parameter " << k;
    params[k].mutable_grad() = torch::randn_like(params[k]);
  }
  torch::set_num_threads(threads);
}

// A step the scaler skips on CPU prepares no list: grads that moved at that
// step must still be read again at the next one (which reads the new grad,
// not the freed one: compared with a twin that forgets its plan).
TEST_P(StepPlanTest, GradsThatMovedAtASkippedStepAreReadAtTheNext) {
  Twins<ampfuse::FusedAdam> t({param({33}, torch::kFloat), param({300}, torch::kFloat)},
                              maker<ampfuse::FusedAdam>(torch::optim::AdamOptions(1e-2)));
  ampfuse::GradScaler sa(ampfuse::GradScalerOptions().init_scale(2.0)), sb(ampfuse::GradScalerOptions().init_scale(2.0));
  sa.scale(torch::ones({}, t.a[0].options()));
  sb.scale(torch::ones({}, t.b[0].options()));
  auto step = [&](PlanMatch expected) {
    sa.step(*t.reused);
    sa.update();
    t.fresh->forget();
    sb.step(*t.fresh);
    sb.update();
    EXPECT_EQ(t.reused->last_plan_match(), expected);
    for (std::size_t i = 0; i < t.a.size(); ++i) EXPECT_TRUE(bitwise_equal(t.a[i].detach(), t.b[i].detach()));
  };
  t.grads(false);
  step(PlanMatch::kChanged);
  t.grads(false);  // new grads, one of them not finite: the step is skipped
  t.a[1].mutable_grad()[5] = std::numeric_limits<float>::infinity();
  t.b[1].mutable_grad()[5] = std::numeric_limits<float>::infinity();
  step(PlanMatch::kGradsMoved);
  EXPECT_TRUE(sa.last_step_skipped(*t.reused));
  t.grads(true);  // in place: the grads of the skipped step, finite again
  step(PlanMatch::kSame);
  EXPECT_FALSE(sa.last_step_skipped(*t.reused));
}

// A first step skipped on CPU made its plan before any state was made; the
// next step made the state under that plan without recording it, so a
// state().clear() after it went unseen: the steps went on with the old
// (hidden) state, and state() stayed empty (save() wrote none). Found by
// helper-75's differential fuzz.
TEST_P(StepPlanTest, StateClearedAfterASkippedFirstStepIsMadeAfresh) {
  const auto check = [&](auto& t) {
    ampfuse::GradScaler sa(ampfuse::GradScalerOptions().init_scale(4.0)),
        sb(ampfuse::GradScalerOptions().init_scale(4.0));
    const auto step = [&](bool inf) {
      t.grads(false);
      if (inf)
        for (torch::Tensor* p : {&t.a[0], &t.b[0]}) p->mutable_grad()[0] = std::numeric_limits<float>::infinity();
      sa.scale(torch::ones({}, t.a[0].options()));
      sb.scale(torch::ones({}, t.b[0].options()));
      sa.step(*t.reused);
      sa.update();
      t.fresh->forget();
      sb.step(*t.fresh);
      sb.update();
      EXPECT_EQ(sa.last_step_skipped(*t.reused), inf);
      for (std::size_t i = 0; i < t.a.size(); ++i) EXPECT_TRUE(bitwise_equal(t.a[i].detach(), t.b[i].detach()));
    };
    step(true);
    step(false);
    t.apply([](auto& opt, auto&) { opt.state().clear(); });
    step(false);
    step(false);
    EXPECT_EQ(t.reused->state().size(), t.a.size());
  };
  const std::vector<torch::Tensor> params = {param({7}, torch::kFloat), param({2, 3}, torch::kFloat)};
  {
    SCOPED_TRACE("FusedAdam");
    Twins<ampfuse::FusedAdam> t(params, maker<ampfuse::FusedAdam>(torch::optim::AdamOptions(0.1)));
    check(t);
  }
  {
    SCOPED_TRACE("FusedSGD");
    Twins<ampfuse::FusedSGD> t(params, maker<ampfuse::FusedSGD>(torch::optim::SGDOptions(0.1).momentum(0.9)));
    check(t);
  }
  {
    SCOPED_TRACE("FusedRMSprop");
    Twins<ampfuse::FusedRMSprop> t(params, maker<ampfuse::FusedRMSprop>(torch::optim::RMSpropOptions(0.1)));
    check(t);
  }
  {
    SCOPED_TRACE("FusedLAMB");
    Twins<ampfuse::FusedLAMB> t(params, maker<ampfuse::FusedLAMB>(ampfuse::FusedLAMBOptions(0.1)));
    check(t);
  }
}

// A grad read in place whose TensorImpl and data are the ones recorded, in
// another layout: what a new grad made where a freed one was is (a view of
// a gradient bucket after zero_grad(set_to_none), found by helper-75's
// fuzz), made here by as_strided_. The plan read it in the old layout; it
// is read through a copy now, as a fresh step reads it.
TEST_P(StepPlanTest, AGradInAnotherLayoutAtTheSameTensorIsReadInIt) {
  Twins<ampfuse::FusedSGD> t({param({4, 3}, torch::kFloat), param({5}, torch::kFloat)},
                             maker<ampfuse::FusedSGD>(torch::optim::SGDOptions(0.1).momentum(0.9)));
  t.grads(false);
  ASSERT_TRUE(t.step(PlanMatch::kChanged));
  t.grads(true);
  ASSERT_TRUE(t.step(PlanMatch::kSame));
  // Column-major: the plan is made again, the grad staged; row-major again
  // and back: read through the copy, which reads any layout.
  for (const auto& [column_major, expected] :
       {std::pair{true, PlanMatch::kChanged}, std::pair{false, PlanMatch::kSame}, std::pair{true, PlanMatch::kSame}}) {
    const torch::Tensor values = torch::randn({4, 3}, t.a[0].options());
    for (torch::Tensor* p : {&t.a[0], &t.b[0]}) {
      torch::Tensor g = p->mutable_grad();
      const void* before = g.unsafeGetTensorImpl();
      g.as_strided_({4, 3}, column_major ? std::vector<std::int64_t>{1, 4} : std::vector<std::int64_t>{3, 1});
      g.copy_(values);
      ASSERT_EQ(p->grad().unsafeGetTensorImpl(), before);
    }
    ASSERT_TRUE(t.step(expected)) << (column_major ? "column-major" : "row-major");
  }
  // A grad read through a copy, given a shape that only broadcasts to its parameter at the same
  // TensorImpl and data: refused as validation refuses it (the copy took it, broadcast).
  auto q = param({1, 4}, torch::kFloat);
  ampfuse::FusedSGD opt({q}, torch::optim::SGDOptions(0.1));
  q.mutable_grad() = torch::empty_strided({1, 4}, {1, 1}, q.options()).fill_(1.f);  // other strides: staged
  opt.step();
  torch::Tensor g = q.mutable_grad();
  g.as_strided_({4}, {1});
  const auto before = q.detach().clone();
  EXPECT_THAT(ampfuse_test::error_of([&] { opt.step(); }), HasSubstr("param group 0, param 0: grad shape [4]"));
  EXPECT_TRUE(bitwise_equal(q.detach(), before));
}

// A step that throws after its grads were compared (no signal for a
// device) forgets the plan, so the grads that moved are read at the next.
TEST_P(StepPlanTest, AStepThatThrowsForgetsItsPlan) {
  auto p = param({40}, torch::kFloat);
  ampfuse::FusedAdam opt({p}, torch::optim::AdamOptions(1e-2));
  p.mutable_grad() = torch::randn_like(p);
  opt.step();
  p.mutable_grad() = torch::randn_like(p);
  const ampfuse::StepSignals none;  // no signal for the parameter's device
  try {
    opt.step_with_signals(none);
    ADD_FAILURE() << "a step without a signal for its device ran";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("sent no signal"));
  }
  opt.step();
  EXPECT_EQ(opt.last_plan_match(), PlanMatch::kChanged);
}

// Empty param groups before, between and after the others: a reused plan
// walks past them (the optimizer's match and the scaler's grads compare), so
// a new grad in the group after one is seen, and the steps give the bits of
// steps prepared from scratch.
TEST_P(StepPlanTest, EmptyGroupsAnywhereKeepThePlanAndNewGradsAreSeen) {
  auto make = [](std::vector<torch::Tensor>& params) {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    const std::vector<std::vector<std::size_t>> members = {{}, {0, 1}, {}, {}, {2}, {3, 4}, {}};
    for (const auto& m : members) {
      std::vector<torch::Tensor> group;
      for (std::size_t i : m) group.push_back(params[i]);
      groups.emplace_back(group, std::make_unique<torch::optim::AdamOptions>(1e-2));
    }
    return std::make_unique<Forgetful<ampfuse::FusedAdam>>(std::move(groups), torch::optim::AdamOptions(1e-2));
  };
  Twins<ampfuse::FusedAdam> t({param({3}, torch::kFloat), param({1}, torch::kFloat), param({40}, torch::kFloat),
                               param({2}, torch::kFloat), param({5}, torch::kFloat)},
                              make);
  t.grads(false);
  EXPECT_TRUE(t.step(PlanMatch::kChanged));
  t.grads(true);
  EXPECT_TRUE(t.step(PlanMatch::kSame));
  t.grads(false);
  EXPECT_TRUE(t.step(PlanMatch::kGradsMoved));
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(4.0));
  scaler.scale(torch::ones({}, t.a[0].options()));
  for (std::size_t k = 0; k < t.a.size(); ++k) {
    scaler.step(*t.reused);  // the grads as kept: finite
    scaler.update();
    EXPECT_FALSE(scaler.last_step_skipped(*t.reused)) << "before parameter " << k;
    const torch::Tensor before = t.a[k].detach().clone();
    torch::Tensor g = torch::randn_like(t.a[k]);
    g[0] = std::numeric_limits<float>::quiet_NaN();
    t.a[k].mutable_grad() = g;  // a new tensor
    scaler.step(*t.reused);
    scaler.update();
    EXPECT_TRUE(scaler.last_step_skipped(*t.reused)) << "parameter " << k;
    EXPECT_TRUE(bitwise_equal(t.a[k].detach(), before)) << "parameter " << k;
    t.a[k].mutable_grad() = torch::randn_like(t.a[k]);
  }
}

// GradScaler::step in one pass (ScalerAware::step_with_grads_check): the
// optimizer validates, then calls back for the scaler's check, which reads
// the grads through what the scaler kept while the optimizer names the same
// grads (grads_id), and walks or collects them anew otherwise. `One` offers
// the single pass and counts what the scaler did with it; `Two` never
// offers it, so its scaler checks first and then steps.
template <class Opt>
class OnePass : public Forgetful<Opt> {
 public:
  using Forgetful<Opt>::Forgetful;
  bool step_with_grads_check(const ampfuse::StepSignals& signals, const std::function<void()>& check) override {
    ++offered;
    if (fail_before_check) {
      fail_before_check = false;
      TORCH_CHECK(false, "failed before the check");
    }
    return Opt::step_with_grads_check(signals, [&] {
      ++checked;
      check();
      TORCH_CHECK(!fail_after_check, "failed after the check");
    });
  }
  int offered = 0, checked = 0;
  bool fail_before_check = false, fail_after_check = false;
};
template <class Opt>
class TwoPasses : public Forgetful<Opt> {
 public:
  using Forgetful<Opt>::Forgetful;
  bool step_with_grads_check(const ampfuse::StepSignals&, const std::function<void()>&) override { return false; }
};

// Both twins get the same grads, each through its own scaler; after every
// step their parameters, state and skips must be the same bits. The events
// change the grads under the kept plan every way the two checks could tell
// apart: in place (the kept plan, no walk), new tensors (the walk inside the
// callback), an inf or NaN in place or in a new tensor, a grad appearing on
// a frozen parameter or going away, steps after unscale_ or clip_grad_norm_
// (the two-pass path) with a grad replaced after the unscale_, a new group,
// and new storage for a parameter.
TEST_P(StepPlanTest, GradScalerInOnePassChecksWhatTwoPassesCheck) {
  const auto make_scaler = [] { return ampfuse::GradScaler(ampfuse::GradScalerOptions().init_scale(8.0)); };
  std::vector<torch::Tensor> a, b;
  for (const auto& p : {param({33}, torch::kFloat), param({1}, torch::kFloat), param({0}, torch::kFloat),
                        param({300}, torch::kFloat), param({7}, torch::kFloat)}) {
    a.push_back(p.detach().clone().requires_grad_());
    b.push_back(p.detach().clone().requires_grad_());
  }
  const torch::optim::AdamOptions options(1e-2);
  OnePass<ampfuse::FusedAdam> one(a, options);
  TwoPasses<ampfuse::FusedAdam> two(b, options);
  ampfuse::GradScaler sa = make_scaler(), sb = make_scaler();
  sa.scale(torch::ones({}, a[0].options()));
  sb.scale(torch::ones({}, b[0].options()));
  // new (true) or in place (false) grads for parameters 0..3 (4 stays frozen until it gets one). The
  // grads replaced stay alive, so that no new grad lands where one the scaler kept was (a stale read
  // would then see the new values).
  std::vector<torch::Tensor> replaced;
  const auto grads = [&](bool fresh, std::vector<std::size_t> which = {0, 1, 2, 3}) {
    for (std::size_t i : which) {
      const torch::Tensor g = torch::randn_like(a[i]) * 8;
      for (torch::Tensor* p : {&a[i], &b[i]}) {
        if (!fresh && p->grad().defined()) {
          p->mutable_grad().copy_(g);
        } else {
          if (p->grad().defined()) replaced.push_back(p->grad());
          p->mutable_grad() = g.clone();
        }
      }
    }
  };
  const auto poison = [&](std::size_t i, std::int64_t at, float value) {
    a[i].mutable_grad()[at] = value;
    b[i].mutable_grad()[at] = value;
  };
  int step = 0;
  // before_step runs on each twin with its scaler; expect: whether the scaler offered and checked in one pass.
  const auto run = [&](bool offered, bool checked, bool skipped,
                       const std::function<void(ampfuse::GradScaler&, torch::optim::Optimizer&)>& before_step = {}) {
    SCOPED_TRACE("step " + std::to_string(step++));
    const int offers = one.offered, checks = one.checked;
    if (before_step) {
      before_step(sa, one);
      before_step(sb, two);
    }
    sa.step(one);
    sa.update();
    sb.step(two);
    sb.update();
    EXPECT_EQ(one.offered - offers, offered ? 1 : 0);
    EXPECT_EQ(one.checked - checks, checked ? 1 : 0);
    EXPECT_EQ(sa.last_step_skipped(one), skipped);
    EXPECT_EQ(sb.last_step_skipped(two), skipped);
    EXPECT_EQ(sa.get_scale(), sb.get_scale());
    ASSERT_EQ(a.size(), b.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(a[i].detach(), b[i].detach())) << "parameter " << i;
      const auto sta = one.state().find(a[i].unsafeGetTensorImpl());
      const auto stb = two.state().find(b[i].unsafeGetTensorImpl());
      ASSERT_EQ(sta == one.state().end(), stb == two.state().end()) << "parameter " << i;
      if (sta == one.state().end()) continue;
      const auto& x = static_cast<const ampfuse::FusedAdamParamState&>(*sta->second);
      const auto& y = static_cast<const ampfuse::FusedAdamParamState&>(*stb->second);
      EXPECT_TRUE(bitwise_equal(x.exp_avg(), y.exp_avg())) << "parameter " << i;
      EXPECT_TRUE(bitwise_equal(x.exp_avg_sq(), y.exp_avg_sq())) << "parameter " << i;
      EXPECT_EQ(x.step(), y.step()) << "parameter " << i;
    }
  };
  grads(true);
  run(false, false, false);  // no plan kept yet: two passes, and the optimizer's grads_id is kept
  grads(false);
  run(true, true, false);  // the kept plan
  grads(false);
  poison(3, 299, std::numeric_limits<float>::infinity());
  run(true, true, true);
  grads(true);
  run(true, true, false);  // new grads: walked inside the callback
  grads(true);
  poison(0, 0, std::numeric_limits<float>::quiet_NaN());
  run(true, true, true);  // new grads, one with a NaN
  grads(false);
  run(true, true, false);
  grads(false);
  grads(true, {4});  // a grad for the frozen parameter
  run(true, true, false);
  grads(false, {0, 1, 2, 3, 4});
  poison(4, 6, -std::numeric_limits<float>::infinity());
  run(true, true, true);
  a[4].mutable_grad() = torch::Tensor();  // it goes away again
  b[4].mutable_grad() = torch::Tensor();
  grads(false);
  run(true, true, false);
  grads(false);
  run(false, false, false, [](auto& scaler, auto& opt) { scaler.unscale_(opt); });  // two passes
  grads(false);
  run(true, true, false);
  grads(false);
  run(false, false, false, [](auto& scaler, auto& opt) { scaler.clip_grad_norm_(opt, 0.5); });
  grads(false);
  // A grad replaced after unscale_ is read by the step as given (as in PyTorch), and the next step sees it.
  run(false, false, false, [&](auto& scaler, auto& opt) {
    scaler.unscale_(opt);
    auto& params = &opt == &one ? a : b;
    params[1].mutable_grad() = torch::full_like(params[1], 0.25);
  });
  grads(false);
  poison(1, 0, std::numeric_limits<float>::infinity());
  run(true, true, true);
  grads(false);
  run(true, true, false);
  for (auto* params : {&a, &b}) params->push_back(torch::full({5}, 0.5, a[0].options()).requires_grad_());
  one.add_param_group(torch::optim::OptimizerParamGroup({a.back()}, std::make_unique<torch::optim::AdamOptions>(1e-3)));
  two.add_param_group(torch::optim::OptimizerParamGroup({b.back()}, std::make_unique<torch::optim::AdamOptions>(1e-3)));
  grads(false);
  grads(true, {5});
  run(true, true, false);  // a new group: collected anew inside the callback
  grads(false, {0, 1, 2, 3, 5});
  run(true, true, false);
  torch::NoGradGuard no_grad;
  const torch::Tensor moved = a[3].detach().clone();
  a[3].set_data(moved);  // new storage, as module.to() makes
  b[3].set_data(moved.clone());
  grads(false, {0, 1, 2, 3, 5});
  run(true, true, false);
  grads(false, {0, 1, 2, 3, 5});
  poison(5, 4, std::numeric_limits<float>::infinity());
  run(true, true, true);
}

// A single pass that fails before its check is taken by the two passes
// (which validate from scratch and would report the error): the step is
// made once. One that fails after its check throws, retrying nothing, and
// writes nothing; the next step goes on as the twin's.
TEST_P(StepPlanTest, GradScalerInOnePassFailsBeforeOrAfterItsCheck) {
  std::vector<torch::Tensor> a, b;
  for (const auto& p : {param({20}, torch::kFloat), param({1}, torch::kFloat)}) {
    a.push_back(p.detach().clone().requires_grad_());
    b.push_back(p.detach().clone().requires_grad_());
  }
  OnePass<ampfuse::FusedAdam> one(a, torch::optim::AdamOptions(1e-2));
  TwoPasses<ampfuse::FusedAdam> two(b, torch::optim::AdamOptions(1e-2));
  ampfuse::GradScaler sa(ampfuse::GradScalerOptions().init_scale(4.0)), sb(ampfuse::GradScalerOptions().init_scale(4.0));
  sa.scale(torch::ones({}, a[0].options()));
  sb.scale(torch::ones({}, b[0].options()));
  const auto grads = [&] {
    for (std::size_t i = 0; i < a.size(); ++i) {
      const torch::Tensor g = torch::randn_like(a[i]);
      a[i].mutable_grad() = g.clone();
      b[i].mutable_grad() = g.clone();
    }
  };
  const auto same = [&](const char* when) {
    for (std::size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(bitwise_equal(a[i].detach(), b[i].detach())) << when << ", parameter " << i;
  };
  const auto both = [&] {
    sa.step(one);
    sa.update();
    sb.step(two);
    sb.update();
  };
  grads();
  both();
  grads();
  one.fail_before_check = true;
  both();  // taken by the two passes
  EXPECT_EQ(one.checked, 0);
  same("after a failure before the check");
  EXPECT_EQ(one.state().size(), 2u);
  for (const auto& p : a)
    EXPECT_EQ(static_cast<const ampfuse::FusedAdamParamState&>(*one.state().at(p.unsafeGetTensorImpl())).step(), 2);
  grads();
  // An inf the failed step's check finds: update() reads it (and backs off)
  // as after a failed step of the two passes, and as the twin's skip does.
  a[1].mutable_grad()[0] = std::numeric_limits<float>::infinity();
  b[1].mutable_grad()[0] = std::numeric_limits<float>::infinity();
  const std::vector<torch::Tensor> before = {a[0].detach().clone(), a[1].detach().clone()};
  one.fail_after_check = true;
  try {
    sa.step(one);
    ADD_FAILURE() << "a step that failed after its check returned";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("failed after the check"));
  }
  EXPECT_EQ(one.checked, 1);
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(a[i].detach(), before[i])) << "parameter " << i;
    EXPECT_EQ(static_cast<const ampfuse::FusedAdamParamState&>(*one.state().at(a[i].unsafeGetTensorImpl())).step(), 2);
  }
  sa.update();
  sb.step(two);
  sb.update();
  EXPECT_EQ(sa.get_scale(), 2.0) << "the failed step's inf backs the scale off";
  EXPECT_EQ(sa.get_scale(), sb.get_scale());
  same("after a failure after the check");
  one.fail_after_check = false;
  grads();
  both();
  same("after a failure after the check and a step");
  grads();
  one.fail_after_check = true;
  EXPECT_THROW(sa.step(one), c10::Error);
  EXPECT_NO_THROW(sa.update()) << "the check of a step that failed after it is recorded";
  EXPECT_EQ(sa.get_scale(), 2.0) << "no inf: the scale stays";
}

// An optimizer whose step_with_grads_check says it stepped without calling
// the check is refused (its found_inf was never computed), and not retried.
TEST_P(StepPlanTest, GradScalerRefusesAOnePassWithoutItsCheck) {
  struct NoCheck : Forgetful<ampfuse::FusedAdam> {
    using Forgetful<ampfuse::FusedAdam>::Forgetful;
    bool step_with_grads_check(const ampfuse::StepSignals&, const std::function<void()>&) override {
      ++calls;
      return true;
    }
    int calls = 0;
  };
  auto p = param({6}, torch::kFloat);
  NoCheck opt({p}, torch::optim::AdamOptions(1e-2));
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(2.0));
  scaler.scale(torch::ones({}, p.options()));
  p.mutable_grad() = torch::randn_like(p);
  scaler.step(opt);  // two passes: no id recorded yet
  scaler.update();
  EXPECT_EQ(opt.calls, 0);
  try {
    scaler.step(opt);
    ADD_FAILURE() << "a single pass without its check was accepted";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("without calling check_grads"));
  }
  EXPECT_EQ(opt.calls, 1);
}

// New grads at every step, of the shapes of those they replace: the scaler
// follows them in its kept views (and CPU pointer arrays) instead of
// collecting them anew. unscale_ must then write the new grads, bit for bit
// as ATen's unscale, and leave the replaced ones alone; a list that mixes
// dtypes (pointer arrays made again) and a zero-element grad included.
TEST_P(StepPlanTest, GradScalerFollowsNewGradsOfTheSameShapes) {
  std::vector<torch::Tensor> params = {param({5}, torch::kFloat), param({0}, torch::kFloat),
                                       param({1}, torch::kBFloat16), param({70000}, torch::kFloat),
                                       param({3}, torch::kHalf), param({1}, torch::kFloat)};
  ampfuse::FusedAdam opt(params, torch::optim::AdamOptions(1e-3));
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(4.0).growth_interval(1000));
  scaler.scale(torch::ones({}, params[0].options()));
  std::vector<torch::Tensor> replaced;
  for (int step = 0; step < 6; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    std::vector<torch::Tensor> expected;
    for (auto& p : params) {
      if (p.grad().defined()) replaced.push_back(p.grad());
      p.mutable_grad() = (torch::randn_like(p.detach(), p.options().dtype(torch::kFloat)) * 4).to(p.scalar_type());
      expected.push_back(p.grad().clone());
    }
    const bool poisoned = step == 3;
    if (poisoned) {
      params[5].mutable_grad()[0] = std::numeric_limits<float>::infinity();
      expected[5][0] = std::numeric_limits<float>::infinity();
    }
    std::vector<torch::Tensor> before_replaced;
    for (const auto& g : replaced) before_replaced.push_back(g.clone());
    if (step % 2 == 1) {
      scaler.unscale_(opt);
      auto found = torch::zeros({}, params[0].options().dtype(torch::kFloat));
      for (const auto& dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
        std::vector<torch::Tensor> same;
        for (auto& g : expected)
          if (g.scalar_type() == dtype) same.push_back(g);
        at::_amp_foreach_non_finite_check_and_unscale_(
            same, found, torch::full({}, static_cast<float>(1.0 / scaler.get_scale()), found.options()));
      }
      for (std::size_t i = 0; i < params.size(); ++i)
        EXPECT_TRUE(bitwise_equal(params[i].grad(), expected[i])) << "grad " << i;
      EXPECT_EQ(found.item<float>() != 0, poisoned);
    }
    for (std::size_t i = 0; i < replaced.size(); ++i)
      EXPECT_TRUE(bitwise_equal(replaced[i], before_replaced[i])) << "replaced grad " << i;
    const torch::Tensor before = params[0].detach().clone();
    scaler.step(opt);
    scaler.update();
    EXPECT_EQ(scaler.last_step_skipped(opt), poisoned);
    EXPECT_EQ(bitwise_equal(params[0].detach(), before), poisoned);
  }
}

// A walk of the kept plan that follows moved grads and then stops at a grad
// it cannot take (here an integer one, refused by the collection that
// follows): the plan stays kept, its keys already name the moved grads, and
// once the refused grad is replaced by the one the plan knows, the next walk
// finds every key the same. The checks must then read the moved grads, not
// the ones they replaced.
TEST_P(StepPlanTest, GradScalerFollowsMovedGradsPastARefusedOne) {
  std::vector<torch::Tensor> params = {param({5}, torch::kFloat), param({300}, torch::kFloat),
                                       param({3}, torch::kFloat)};
  ampfuse::FusedAdam opt(params, torch::optim::AdamOptions(1e-3));
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(4.0).growth_interval(1000));
  scaler.scale(torch::ones({}, params[0].options()));
  for (auto& p : params) p.mutable_grad() = torch::randn_like(p.detach());
  scaler.step(opt);  // the plan is made and its checks run
  scaler.update();
  const std::vector<torch::Tensor> old = {params[0].grad(), params[1].grad(), params[2].grad()};
  const std::vector<torch::Tensor> old_values = {old[0].clone(), old[1].clone(), old[2].clone()};
  params[0].mutable_grad() = torch::randn_like(params[0].detach());
  params[1].mutable_grad() = torch::randn_like(params[1].detach());
  params[1].mutable_grad()[7] = std::numeric_limits<float>::infinity();
  params[2].mutable_grad() = torch::ones({3}, params[2].options().dtype(torch::kInt));
  EXPECT_THROW(scaler.unscale_(opt), c10::Error);
  params[2].mutable_grad() = old[2];
  const torch::Tensor moved0 = params[0].grad().clone(), moved1 = params[1].grad().clone();
  scaler.unscale_(opt);
  EXPECT_TRUE(bitwise_equal(params[0].grad(), moved0 * 0.25f)) << "the moved grad is unscaled";
  EXPECT_TRUE(bitwise_equal(params[1].grad(), moved1 * 0.25f));
  for (std::size_t i = 0; i < 2; ++i) EXPECT_TRUE(bitwise_equal(old[i], old_values[i])) << "replaced grad " << i;
  const torch::Tensor before = params[0].detach().clone();
  scaler.step(opt);
  scaler.update();
  EXPECT_TRUE(scaler.last_step_skipped(opt)) << "the inf is in a moved grad";
  EXPECT_TRUE(bitwise_equal(params[0].detach(), before));
}

// Copy-on-write grads (at::_lazy_clone), which torch::optim and PyTorch's
// GradScaler take: the fused step reads them where they are (a copy made on
// ATen's threads is an error there), the scaler collects them on the
// calling thread, and nothing writes the tensors they were cloned from.
// Steps equal a twin's on plain copies of the same grads, bit for bit: on a
// fresh plan, on a kept one whose grads move to copy-on-write ones (many
// parameters: the walks run on several threads), after unscale_ (which
// writes the grads), with an inf in a grad, and without a scaler.
TEST_P(StepPlanTest, StepsAndGradScalerTakeCopyOnWriteGrads) {
  constexpr int kParams = 1500;  // over two threads' ranges of a walk (kEntriesGrain)
  std::vector<torch::Tensor> a, b;
  for (int i = 0; i < kParams; ++i) {
    const torch::Tensor p = param({i % 3 == 0 ? 5 : 1}, torch::kFloat);
    a.push_back(p.detach().clone().requires_grad_());
    b.push_back(p.detach().clone().requires_grad_());
  }
  ampfuse::FusedAdam oa(a, torch::optim::AdamOptions(1e-2)), ob(b, torch::optim::AdamOptions(1e-2));
  ampfuse::GradScaler sa(ampfuse::GradScalerOptions().init_scale(4.0)), sb(ampfuse::GradScalerOptions().init_scale(4.0));
  sa.scale(torch::ones({}, a[0].options()));
  sb.scale(torch::ones({}, b[0].options()));
  std::vector<std::pair<torch::Tensor, torch::Tensor>> sources;  // cloned from, and a copy of its values
  // New grads for parameters [from, to): a's a copy-on-write clone where cow(i), b's a plain copy.
  const auto grads = [&](int from, int to, const std::function<bool(int)>& cow) {
    for (int i = from; i < to; ++i) {
      const torch::Tensor g = torch::randn_like(a[static_cast<std::size_t>(i)]);
      b[static_cast<std::size_t>(i)].mutable_grad() = g.clone();
      if (cow(i)) {
        a[static_cast<std::size_t>(i)].mutable_grad() = at::_lazy_clone(g);
        sources.emplace_back(g, g.clone());
      } else {
        a[static_cast<std::size_t>(i)].mutable_grad() = g.clone();
      }
    }
  };
  const auto same = [&](const std::string& when) {
    for (int i = 0; i < kParams; ++i)
      ASSERT_TRUE(bitwise_equal(a[static_cast<std::size_t>(i)].detach(), b[static_cast<std::size_t>(i)].detach()))
          << when << ", parameter " << i;
    for (const auto& [source, values] : sources) ASSERT_TRUE(bitwise_equal(source, values)) << when << ": a source was written";
  };
  const auto both = [&](bool unscale_first) {
    if (unscale_first) {
      sa.unscale_(oa);
      sb.unscale_(ob);
      for (int i = 0; i < kParams; ++i)
        ASSERT_TRUE(bitwise_equal(a[static_cast<std::size_t>(i)].grad(), b[static_cast<std::size_t>(i)].grad())) << "grad " << i;
    }
    sa.step(oa);
    sa.update();
    sb.step(ob);
    sb.update();
    EXPECT_EQ(sa.last_step_skipped(oa), sb.last_step_skipped(ob));
  };
  grads(0, kParams, [](int i) { return i % 2 == 0; });
  both(false);
  same("a fresh plan");
  for (int step = 1; step < 4; ++step) {
    grads(kParams / 2, kParams, [step](int i) { return (i + step) % 3 == 0; });  // moved, a third to copy-on-write
    both(false);
    same("moved grads, step " + std::to_string(step));
  }
  grads(0, kParams, [](int i) { return i % 5 != 0; });
  both(true);
  same("after unscale_");
  grads(kParams / 2, kParams, [](int i) { return i % 2 == 1; });
  a[kParams - 2].mutable_grad()[0] = std::numeric_limits<float>::infinity();  // a plain grad, moved
  b[kParams - 2].mutable_grad()[0] = std::numeric_limits<float>::infinity();
  both(false);
  EXPECT_TRUE(sa.last_step_skipped(oa)) << "the inf is in a grad moved beside copy-on-write ones";
  same("an inf");
  grads(0, kParams, [](int i) { return i % 4 == 1; });
  oa.step();
  ob.step();
  same("without a scaler");
}

// The other optimizers read copy-on-write grads where they are too: over
// many parameters (their pointer arrays are filled on ATen's threads), the
// first step and one whose grads moved equal a twin's on plain copies.
TEST_P(StepPlanTest, EveryOptimizerTakesCopyOnWriteGrads) {
  const auto check = [&](const char* name, auto make) {
    SCOPED_TRACE(name);
    std::vector<torch::Tensor> a, b;
    for (int i = 0; i < 1500; ++i) {
      // A few of 4096 elements: FusedAdam codes their moments in 8 bits.
      const torch::Tensor p = param({i % 500 == 0 ? 4096 : i % 4 == 0 ? 3 : 1}, torch::kFloat);
      a.push_back(p.detach().clone().requires_grad_());
      b.push_back(p.detach().clone().requires_grad_());
    }
    auto oa = make(a);
    auto ob = make(b);
    for (int step = 0; step < 3; ++step) {
      for (std::size_t i = 0; i < a.size(); ++i) {
        const torch::Tensor g = torch::randn_like(a[i]);
        a[i].mutable_grad() = (i + static_cast<std::size_t>(step)) % 2 == 0 ? at::_lazy_clone(g) : g.clone();
        b[i].mutable_grad() = g.clone();
      }
      oa.step();
      ob.step();
      for (std::size_t i = 0; i < a.size(); ++i)
        ASSERT_TRUE(bitwise_equal(a[i].detach(), b[i].detach())) << "step " << step << ", parameter " << i;
    }
  };
  check("FusedSGD", [](const std::vector<torch::Tensor>& ps) {
    return ampfuse::FusedSGD(ps, torch::optim::SGDOptions(0.1).momentum(0.9));
  });
  check("FusedAdagrad", [](const std::vector<torch::Tensor>& ps) {
    return ampfuse::FusedAdagrad(ps, torch::optim::AdagradOptions(0.1));
  });
  check("FusedRMSprop", [](const std::vector<torch::Tensor>& ps) {
    return ampfuse::FusedRMSprop(ps, torch::optim::RMSpropOptions(0.01).momentum(0.5));
  });
  check("FusedLAMB", [](const std::vector<torch::Tensor>& ps) {
    return ampfuse::FusedLAMB(ps, ampfuse::FusedLAMBOptions(1e-2));
  });
  check("FusedAdam 8-bit", [](const std::vector<torch::Tensor>& ps) {
    return ampfuse::FusedAdam(ps, torch::optim::AdamOptions(1e-2), ampfuse::FusedAdamOptions().moments_8bit(true));
  });
}

// Parameters and grads whose storage is copy-on-write (lazy clones, or
// tensors a lazy clone was taken of, as a snapshot might be): what a step or
// unscale_ writes goes to a copy of their own, as an in-place op's would, and
// the tensors sharing the storage keep their values. Steps equal a twin's on
// plain copies, bit for bit, on a fresh plan and on a kept one.
TEST_P(StepPlanTest, StepsWriteNoTensorThatSharesACopyOnWriteStorage) {
  constexpr int kParams = 1500;  // over two threads' ranges of the walks (kEntriesGrain)
  std::vector<torch::Tensor> a, b, sources;
  for (int i = 0; i < kParams; ++i) {
    const torch::Tensor p = param({i % 3 == 0 ? 4 : 1}, torch::kFloat);
    // Every other parameter of `a` a lazy clone of a tensor kept in `sources`.
    if (i % 2 == 0) sources.push_back(p.detach().clone());
    a.push_back((i % 2 == 0 ? at::_lazy_clone(sources.back()) : p.detach().clone()).requires_grad_());
    b.push_back(p.detach().clone().requires_grad_());
  }
  std::vector<torch::Tensor> source_values;
  for (const auto& t : sources) source_values.push_back(t.clone());
  ampfuse::FusedAdam oa(a, torch::optim::AdamOptions(1e-2)), ob(b, torch::optim::AdamOptions(1e-2));
  ampfuse::GradScaler sa(ampfuse::GradScalerOptions().init_scale(4.0)), sb(ampfuse::GradScalerOptions().init_scale(4.0));
  sa.scale(torch::ones({}, a[0].options()));
  sb.scale(torch::ones({}, b[0].options()));
  const auto grads = [&] {
    for (int i = 0; i < kParams; ++i) {
      const torch::Tensor g = torch::randn_like(b[static_cast<std::size_t>(i)]);
      a[static_cast<std::size_t>(i)].mutable_grad() = g.clone();
      b[static_cast<std::size_t>(i)].mutable_grad() = g.clone();
    }
  };
  const auto same = [&](const std::string& when) {
    for (int i = 0; i < kParams; ++i)
      ASSERT_TRUE(bitwise_equal(a[static_cast<std::size_t>(i)].detach(), b[static_cast<std::size_t>(i)].detach()))
          << when << ", parameter " << i;
    for (std::size_t i = 0; i < sources.size(); ++i)
      ASSERT_TRUE(bitwise_equal(sources[i], source_values[i])) << when << ": tensor " << i << " sharing a storage was written";
  };
  const auto both = [&] {
    sa.step(oa);
    sa.update();
    sb.step(ob);
    sb.update();
  };
  grads();
  both();
  same("a fresh plan");
  grads();
  both();
  same("a kept plan");
  // Snapshots taken between steps make the parameters' and grads' storages
  // copy-on-write in place (grads written in place: the kept plan's views
  // point there).
  for (int i = 0; i < kParams; ++i) {
    const torch::Tensor g = torch::randn_like(b[static_cast<std::size_t>(i)]);
    a[static_cast<std::size_t>(i)].mutable_grad().copy_(g);
    b[static_cast<std::size_t>(i)].mutable_grad().copy_(g);
  }
  for (int i = 0; i < kParams; i += 7) {
    sources.push_back(at::_lazy_clone(a[static_cast<std::size_t>(i)].detach()));
    sources.push_back(at::_lazy_clone(a[static_cast<std::size_t>(i)].grad()));
    source_values.push_back(sources[sources.size() - 2].clone());
    source_values.push_back(sources.back().clone());
  }
  sa.unscale_(oa);
  sb.unscale_(ob);
  both();
  same("snapshots of the parameters and grads, unscale_ and a step");
  grads();
  both();
  same("a step after");
  grads();
  oa.step();
  ob.step();
  same("a step without the scaler");
}

// State tensors made copy-on-write by a lazy clone (a snapshot): a step
// that makes its plan again, or writes them at every step (LAMB's step
// counters), gives them copies of their own on the calling thread instead
// of throwing ATen's "materializing in parallel_for" assert, and the
// snapshot keeps its values. The small parameters' state shares one storage
// (SmallStatePool): a lazy clone of one makes the whole list's storage
// copy-on-write. A frozen copy-on-write parameter keeps the plan.
TEST_P(StepPlanTest, CopyOnWriteStateTensorsGetCopiesOfTheirOwn) {
  const auto check = [&](const char* name, auto make, auto state_tensor) {
    SCOPED_TRACE(name);
    std::vector<torch::Tensor> a, b;
    for (int i = 0; i < 1500; ++i) {  // over two threads' ranges of the pointer fills (kEntriesGrain)
      const torch::Tensor p = param({i % 500 == 0 ? 4096 : i % 4 == 0 ? 3 : 1}, torch::kFloat);
      a.push_back(p.detach().clone().requires_grad_());
      b.push_back(p.detach().clone().requires_grad_());
    }
    auto oa = make(a);
    auto ob = make(b);
    const auto step = [&](const std::string& when) {
      for (std::size_t i = 0; i < a.size(); ++i) {
        const torch::Tensor g = torch::randn_like(a[i]);
        a[i].mutable_grad() = g.clone();
        b[i].mutable_grad() = g.clone();
      }
      oa.step();
      ob.step();
      for (std::size_t i = 0; i < a.size(); ++i)
        ASSERT_TRUE(bitwise_equal(a[i].detach(), b[i].detach())) << when << ", parameter " << i;
    };
    step("the first step");
    std::vector<std::pair<torch::Tensor, torch::Tensor>> snapshots;  // and their values
    for (const std::size_t i : {std::size_t{1}, std::size_t{500}}) {
      const torch::Tensor snap = at::_lazy_clone(state_tensor(oa, a[i]));
      snapshots.emplace_back(snap, snap.clone());
    }
    // A parameter made copy-on-write too: the plan is made again.
    const torch::Tensor param_snapshot = at::_lazy_clone(a[2].detach());
    snapshots.emplace_back(param_snapshot, param_snapshot.clone());
    step("after snapshots of state and a parameter");
    step("a step after");
    for (const auto& [snap, values] : snapshots) EXPECT_TRUE(bitwise_equal(snap, values)) << "a snapshot was written";
  };
  check(
      "FusedAdam",
      [](const std::vector<torch::Tensor>& ps) { return ampfuse::FusedAdam(ps, torch::optim::AdamOptions(1e-2)); },
      [](ampfuse::FusedAdam& o, const torch::Tensor& p) {
        return static_cast<ampfuse::FusedAdamParamState&>(*o.state().at(p.unsafeGetTensorImpl())).exp_avg();
      });
  check(
      "FusedAdam 8-bit",
      [](const std::vector<torch::Tensor>& ps) {
        return ampfuse::FusedAdam(ps, torch::optim::AdamOptions(1e-2), ampfuse::FusedAdamOptions().moments_8bit(true));
      },
      [](ampfuse::FusedAdam& o, const torch::Tensor& p) {
        const auto& s = static_cast<ampfuse::FusedAdamParamState&>(*o.state().at(p.unsafeGetTensorImpl()));
        return p.numel() >= 4096 ? s.exp_avg_8bit() : s.exp_avg();
      });
  check(
      "FusedSGD",
      [](const std::vector<torch::Tensor>& ps) {
        return ampfuse::FusedSGD(ps, torch::optim::SGDOptions(0.1).momentum(0.9));
      },
      [](ampfuse::FusedSGD& o, const torch::Tensor& p) {
        return static_cast<ampfuse::FusedSGDParamState&>(*o.state().at(p.unsafeGetTensorImpl())).momentum_buffer();
      });
  check(
      "FusedLAMB",
      [](const std::vector<torch::Tensor>& ps) { return ampfuse::FusedLAMB(ps, ampfuse::FusedLAMBOptions(1e-2)); },
      [](ampfuse::FusedLAMB& o, const torch::Tensor& p) {
        return static_cast<ampfuse::FusedLAMBParamState&>(*o.state().at(p.unsafeGetTensorImpl())).step();
      });

  // A frozen parameter whose storage is copy-on-write is never written: the plan holds.
  auto p = param({12}, torch::kFloat), frozen = param({3}, torch::kFloat);
  Forgetful<ampfuse::FusedAdam> opt({p, frozen}, torch::optim::AdamOptions(1e-2));
  const torch::Tensor frozen_snapshot = at::_lazy_clone(frozen.detach());
  p.mutable_grad() = torch::randn_like(p);
  opt.step();
  const std::uint64_t id = opt.grads_id();
  p.mutable_grad().copy_(torch::randn_like(p));
  opt.step();
  EXPECT_EQ(opt.grads_id(), id) << "the plan was made again for a frozen copy-on-write parameter";
}

// ScalerAware::grads_id as FusedOptimizer keeps it: 0 without a plan, the
// same while the plan's grads are the same tensors, new (never seen before,
// in any optimizer) when they change or the plan is made again, 0 after a
// step that failed.
TEST_P(StepPlanTest, GradsIdNamesThePlansGrads) {
  auto p = param({12}, torch::kFloat), q = param({3}, torch::kFloat);
  Forgetful<ampfuse::FusedAdam> opt({p}, torch::optim::AdamOptions(1e-2)), other({q}, torch::optim::AdamOptions(1e-2));
  EXPECT_EQ(opt.grads_id(), 0u);
  std::set<std::uint64_t> seen;
  const auto fresh_id = [&](const ampfuse::ScalerAware& o) {
    EXPECT_NE(o.grads_id(), 0u);
    EXPECT_TRUE(seen.insert(o.grads_id()).second) << "grads_id " << o.grads_id() << " was given before";
  };
  p.mutable_grad() = torch::randn_like(p);
  q.mutable_grad() = torch::randn_like(q);
  opt.step();
  fresh_id(opt);
  other.step();
  fresh_id(other);
  p.mutable_grad().copy_(torch::randn_like(p));
  const std::uint64_t kept = opt.grads_id();
  opt.step();
  EXPECT_EQ(opt.grads_id(), kept) << "grads written in place are the same grads";
  p.mutable_grad() = torch::randn_like(p);
  opt.step();
  fresh_id(opt);
  opt.forget();
  EXPECT_EQ(opt.grads_id(), 0u);
  opt.step();
  fresh_id(opt);
  const ampfuse::StepSignals none;  // no signal for the parameter's device: the step throws
  EXPECT_THROW(opt.step_with_signals(none), c10::Error);
  EXPECT_EQ(opt.grads_id(), 0u);
  opt.step();
  fresh_id(opt);
}

INSTANTIATE_TEST_SUITE_P(All, StepPlanTest, ::testing::Values("cpu", "cuda"),
                         [](const auto& info) { return info.param; });

}  // namespace

namespace {

// Every parameter's step counter advances once per step under a reused plan:
// each is set by the range of chunks holding the tensor's first chunk (a
// tensor of several chunks spans ranges), a zero-element one, which has no
// chunk, apart.
template <class Opt, class State, class Options>
void expect_counters_advance_once(const char* name, Options options) {
  std::vector<torch::Tensor> params;
  for (const std::int64_t n : {0, 1, 300000, 0, 5, 70000, 1})
    params.push_back(torch::randn({n}).requires_grad_());
  Opt opt(params, options);
  for (int step = 1; step <= 4; ++step) {
    for (auto& p : params) p.mutable_grad() = torch::randn_like(p);
    opt.step();
    for (std::size_t i = 0; i < params.size(); ++i) {
      const auto& s = static_cast<const State&>(*opt.state().at(params[i].unsafeGetTensorImpl()));
      EXPECT_EQ(s.step(), step) << name << ", param " << i << " (" << params[i].numel() << " elements)";
    }
  }
}

TEST(StepPlanCounters, EveryCounterAdvancesOncePerStep) {
  ampfuse_test::seed_for_test();
  expect_counters_advance_once<ampfuse::FusedAdam, ampfuse::FusedAdamParamState>(
      "FusedAdam", torch::optim::AdamOptions(1e-3));
  expect_counters_advance_once<ampfuse::FusedAdagrad, ampfuse::FusedAdagradParamState>(
      "FusedAdagrad", torch::optim::AdagradOptions(1e-3));
  expect_counters_advance_once<ampfuse::FusedRMSprop, ampfuse::FusedRMSpropParamState>(
      "FusedRMSprop", torch::optim::RMSpropOptions(1e-3));
}

}  // namespace

namespace {

// The walk by flat index that kept plans compare with (contract/torch/
// group_spans.h): from every start, empty groups anywhere, it reaches each
// later parameter once, in order, with its group and index.
TEST(GroupSpans, FlatParamsWalksEveryParameterFromAnyIndex) {
  const std::vector<std::size_t> sizes = {0, 3, 0, 0, 1, 2, 0};
  std::vector<std::vector<torch::Tensor>> groups;
  std::vector<std::tuple<std::size_t, std::size_t, const c10::TensorImpl*>> flat;  // (group, index, tensor)
  for (std::size_t g = 0; g < sizes.size(); ++g) {
    groups.emplace_back();
    for (std::size_t i = 0; i < sizes[g]; ++i) groups.back().push_back(torch::zeros({1}));
  }
  ampfuse::sdk::GroupSpans spans;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    spans.emplace_back(groups[g].data(), groups[g].size());
    for (std::size_t i = 0; i < groups[g].size(); ++i) flat.emplace_back(g, i, groups[g][i].unsafeGetTensorImpl());
  }
  ASSERT_EQ(ampfuse::sdk::span_total(spans), flat.size());
  for (std::size_t k = 0; k <= flat.size(); ++k) {
    ampfuse::sdk::FlatParams cursor(spans, k);
    for (std::size_t j = k; j < flat.size(); ++j, cursor.advance()) {
      EXPECT_EQ(cursor.group(), std::get<0>(flat[j])) << "from " << k << ", parameter " << j;
      EXPECT_EQ(cursor.index(), std::get<1>(flat[j])) << "from " << k << ", parameter " << j;
      EXPECT_EQ((*cursor).unsafeGetTensorImpl(), std::get<2>(flat[j])) << "from " << k << ", parameter " << j;
    }
  }
}

}  // namespace

// An optimizer with an option of its own that decides how check_entries
// judges the step (as a per-group master_weights would decide its state's
// dtypes) says so with plan_key() (FusedAdagrad's is the SDK's default; the
// optimizers whose state depends on theirs have it final): a step that finds the key changed starts
// the plan over, and validation sees the new option before anything is
// written. Without it, the plan made before the change was reused and the
// option was never checked (a third-party author's optimizer stepped state
// of the old layout as the new one).
class Keyed : public ampfuse::FusedAdagrad {
 public:
  using ampfuse::FusedAdagrad::FusedAdagrad;
  std::uint64_t key = 0;
  bool refuse = false;
  bool key_changes_in_end_step = false;  // a hook that changes the option during a step
  mutable int checks = 0;

 protected:
  std::uint64_t plan_key(std::size_t /*group*/) const override { return key; }
  void check_entries(const std::vector<ampfuse::sdk::Entry>& entries) const override {
    ++checks;
    TORCH_CHECK(!refuse, "Keyed: the option refuses this step");
    ampfuse::FusedAdagrad::check_entries(entries);
  }
  void end_step(const ampfuse::StepSignals* /*signals*/) override {
    if (key_changes_in_end_step) key += 1;
  }
};

TEST(StepPlanKey, AChangedPlanKeyStartsThePlanOverAndValidatesAgain) {
  auto p = torch::randn({100}).requires_grad_();
  Keyed opt({p}, torch::optim::AdagradOptions(1e-2));
  p.mutable_grad() = torch::ones({100});
  opt.step();
  EXPECT_EQ(opt.last_plan_match(), PlanMatch::kChanged);
  opt.step();
  EXPECT_EQ(opt.last_plan_match(), PlanMatch::kSame);
  EXPECT_EQ(opt.checks, 1);
  opt.refuse = true;  // the key is the same: the plan holds, and validation does not run
  opt.step();
  EXPECT_EQ(opt.last_plan_match(), PlanMatch::kSame);
  EXPECT_EQ(opt.checks, 1);
  opt.key = 1;
  const torch::Tensor before = p.detach().clone();
  EXPECT_THAT([&] { opt.step(); }, ::testing::ThrowsMessage<c10::Error>(HasSubstr("the option refuses this step")));
  EXPECT_TRUE(bitwise_equal(p.detach(), before));
  EXPECT_EQ(opt.checks, 2);
  opt.refuse = false;
  opt.step();
  EXPECT_EQ(opt.last_plan_match(), PlanMatch::kChanged);
  opt.step();
  EXPECT_EQ(opt.last_plan_match(), PlanMatch::kSame);
  EXPECT_EQ(opt.checks, 3);
  // Changed during a step (by a hook, after validation): the plan is kept
  // with the key it was validated with, so the next step sees the change.
  opt.key_changes_in_end_step = true;
  opt.step();
  opt.key_changes_in_end_step = false;
  EXPECT_EQ(opt.last_plan_match(), PlanMatch::kSame);
  EXPECT_EQ(opt.checks, 3);
  opt.step();
  EXPECT_EQ(opt.last_plan_match(), PlanMatch::kChanged);
  EXPECT_EQ(opt.checks, 4);
}
