// FusedAdagrad and FusedRMSprop against torch::optim::Adagrad and
// torch::optim::RMSprop (every option, random hyperparameters, 100 steps),
// on every CPU instruction set and on CUDA (skipped without a device):
// checkpoints both ways, the scaler contract (conformance checker), state
// made as LibTorch makes it, and bad input refused.

#include <ampfuse/fused_adagrad.h>
#include <ampfuse/fused_rmsprop.h>
#include <ampfuse/grad_scaler.h>
#include <ampfuse/testing/conformance.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>

#include "tests/common.h"

namespace {

using ampfuse_test::bitwise_equal;
using ampfuse_test::expect_close;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

struct OptCase {
  std::string device;
  std::string isa;
};

void PrintTo(const OptCase& c, std::ostream* os) { *os << c.device << (c.isa.empty() ? "" : "/" + c.isa); }

torch::optim::AdagradOptions random_adagrad(std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(0, 1);
  torch::optim::AdagradOptions o(std::pow(10.0, -3 + 2 * u(rng)));
  if (u(rng) < 0.5) o.lr_decay(0.1 * u(rng));
  if (u(rng) < 0.5) o.weight_decay(0.05 * u(rng));
  if (u(rng) < 0.5) o.initial_accumulator_value(u(rng));
  if (u(rng) < 0.5) o.eps(1e-6 * u(rng) + 1e-10);
  return o;
}

torch::optim::RMSpropOptions random_rmsprop(std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(0, 1);
  torch::optim::RMSpropOptions o(std::pow(10.0, -4 + 2 * u(rng)));
  o.alpha(0.9 + 0.099 * u(rng));
  if (u(rng) < 0.5) o.momentum(0.5 + 0.45 * u(rng));
  if (u(rng) < 0.5) o.centered(true);
  if (u(rng) < 0.5) o.weight_decay(0.05 * u(rng));
  if (u(rng) < 0.5) o.eps(1e-6 * u(rng) + 1e-8);
  if (o.centered()) o.eps(std::max(o.eps(), 1e-6));  // see RmspropMatchesTorchOptimOverHundredSteps
  return o;
}

using AdagradRmspropTest = ampfuse_test::DeviceIsaTest<OptCase>;

TEST_P(AdagradRmspropTest, AdagradMatchesTorchOptimOverHundredSteps) {
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    const bool maximize = round == 2;
    ampfuse_test::expect_matches_over_hundred_steps<ampfuse::FusedAdagrad, torch::optim::Adagrad,
                                                    torch::optim::AdagradOptions>(
        device_, rng_, random_adagrad, ampfuse::FusedAdagradOptions().maximize(maximize), maximize, 1e-4);
  }
}

// RMSprop divides by sqrt(square_avg - grad_avg^2) when centered, which
// can be small: fp32 rounding differences with LibTorch's ops (ATen's add
// with alpha uses an FMA) grow with 1 / avg over 100 steps, so the bound is
// 1e-4 (2e-5 failed about once in 180 random draws; centered draws keep eps
// at 1e-6 or more). Adagrad takes the same bound.
TEST_P(AdagradRmspropTest, RmspropMatchesTorchOptimOverHundredSteps) {
  for (int round = 0; round < 4; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    const bool maximize = round == 3;
    ampfuse_test::expect_matches_over_hundred_steps<ampfuse::FusedRMSprop, torch::optim::RMSprop,
                                                    torch::optim::RMSpropOptions>(
        device_, rng_, random_rmsprop, ampfuse::FusedRMSpropOptions().maximize(maximize), maximize, 1e-4);
  }
}

// Half and bf16 parameters: opmath fp32, state in the parameter's dtype,
// close to an fp32 run of torch::optim over 20 steps. Grads between 0.5 and
// 1.5 in magnitude keep the squared averages in fp16's normal range (a tiny
// grad's square underflows in fp16 state, and its element then steps by
// lr * g / eps, as LibTorch's fp16 state would).
TEST_P(AdagradRmspropTest, HalfAndBf16FollowFp32) {
  for (auto dtype : {torch::kHalf, torch::kBFloat16}) {
    SCOPED_TRACE(ampfuse_test::dtype_name(dtype));
    auto low = make_params({{129}, {7, 5}}, dtype);
    auto ref = copies(low, torch::kFloat);
    auto low2 = copies(low, dtype), ref2 = copies(low, torch::kFloat);
    ampfuse::FusedAdagrad adagrad(low, torch::optim::AdagradOptions(0.01).weight_decay(0.01));
    torch::optim::Adagrad ref_adagrad(ref, torch::optim::AdagradOptions(0.01).weight_decay(0.01));
    ampfuse::FusedRMSprop rmsprop(low2, torch::optim::RMSpropOptions(0.001).momentum(0.9).centered(true));
    torch::optim::RMSprop ref_rmsprop(ref2, torch::optim::RMSpropOptions(0.001).momentum(0.9).centered(true));
    for (int step = 0; step < 20; ++step) {
      for (std::size_t i = 0; i < low.size(); ++i) {
        const auto g = ((torch::rand_like(ref[i]) + 0.5) * torch::randn_like(ref[i]).sign()).to(dtype);
        low[i].mutable_grad() = g.clone();
        low2[i].mutable_grad() = g.clone();
        ref[i].mutable_grad() = g.to(torch::kFloat);
        ref2[i].mutable_grad() = g.to(torch::kFloat);
      }
      adagrad.step();
      ref_adagrad.step();
      rmsprop.step();
      ref_rmsprop.step();
    }
    const double tol = dtype == torch::kHalf ? 5e-3 : 4e-2;
    expect_close(low, ref, tol, "FusedAdagrad");
    expect_close(low2, ref2, tol, "FusedRMSprop");
    const auto& s = static_cast<const ampfuse::FusedAdagradParamState&>(*adagrad.state().at(low[0].unsafeGetTensorImpl()));
    EXPECT_EQ(s.sum().scalar_type(), dtype);
    EXPECT_EQ(s.step(), 20);
  }
}

// As torch::optim::Adagrad, the constructor makes every parameter's state
// (sum = initial_accumulator_value); a parameter added later gets its
// group's value at its first step.
TEST_P(AdagradRmspropTest, AdagradStateIsMadeAsLibTorchMakesIt) {
  auto a = make_params({{5}});
  ampfuse::FusedAdagrad opt(a, torch::optim::AdagradOptions(0.1).initial_accumulator_value(0.25));
  ASSERT_EQ(opt.state().size(), 1u);
  const auto& s = *opt.state().at(a[0].unsafeGetTensorImpl());
  ASSERT_EQ(typeid(s), typeid(ampfuse::FusedAdagradParamState));
  EXPECT_TRUE(torch::equal(static_cast<const ampfuse::FusedAdagradParamState&>(s).sum(), torch::full_like(a[0], 0.25)));
  auto b = make_params({{3}});
  opt.add_param_group(torch::optim::OptimizerParamGroup(b, std::make_unique<torch::optim::AdagradOptions>(
                                                               torch::optim::AdagradOptions(0.1).initial_accumulator_value(2.0))));
  a[0].mutable_grad() = torch::zeros_like(a[0]);
  b[0].mutable_grad() = torch::zeros_like(b[0]);
  opt.step();
  const auto& sb = static_cast<const ampfuse::FusedAdagradParamState&>(*opt.state().at(b[0].unsafeGetTensorImpl()));
  EXPECT_TRUE(torch::equal(sb.sum().cpu(), torch::full({3}, 2.f)));  // zero grads: the sum is its start value
  EXPECT_EQ(sb.step(), 1);
}

// RMSprop's momentum buffer and grad average are made when an option that
// needs them is switched on after the first steps.
TEST_P(AdagradRmspropTest, RmspropMakesStateWhenOptionsAreSwitchedOn) {
  auto ours = make_params({{40}});
  auto ref = copies(ours);
  ampfuse::FusedRMSprop opt(ours, torch::optim::RMSpropOptions(0.01));
  torch::optim::RMSprop ref_opt(ref, torch::optim::RMSpropOptions(0.01));
  for (int step = 0; step < 6; ++step) {
    if (step == 3) {
      static_cast<torch::optim::RMSpropOptions&>(opt.param_groups()[0].options()).momentum(0.9);
      static_cast<torch::optim::RMSpropOptions&>(ref_opt.param_groups()[0].options()).momentum(0.9);
      // torch::optim::RMSprop makes the buffer only with the state: make it as ours does.
      auto& rs = static_cast<torch::optim::RMSpropParamState&>(*ref_opt.state().at(ref[0].unsafeGetTensorImpl()));
      rs.momentum_buffer(torch::zeros_like(ref[0]));
    }
    const auto g = torch::randn_like(ours[0]);
    ours[0].mutable_grad() = g.clone();
    ref[0].mutable_grad() = g.clone();
    opt.step();
    ref_opt.step();
  }
  expect_close(ours, ref, 1e-5, "momentum switched on at step 3");
}

TEST_P(AdagradRmspropTest, CheckpointsInteroperateWithTorchOptimBothWays) {
  for (bool adagrad : {true, false}) {
    for (bool ours_first : {true, false}) {
      SCOPED_TRACE(std::string(adagrad ? "Adagrad" : "RMSprop") + (ours_first ? ", ours first" : ", LibTorch first"));
      auto a = make_params({{31}, {5, 5}});
      auto b = copies(a);
      std::vector<std::vector<torch::Tensor>> grads(20);
      for (auto& g : grads)
        for (const auto& p : a) g.push_back(torch::randn_like(p));
      auto run = [&](torch::optim::Optimizer& opt, std::vector<torch::Tensor>& params, int from, int to) {
        for (int s = from; s < to; ++s) {
          for (std::size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grads[s][i].clone();
          opt.step();
        }
      };
      auto make = [&](bool fused, std::vector<torch::Tensor>& params) -> std::unique_ptr<torch::optim::Optimizer> {
        const auto ao = torch::optim::AdagradOptions(0.05).lr_decay(0.01).initial_accumulator_value(0.1);
        const auto ro = torch::optim::RMSpropOptions(0.01).momentum(0.5).centered(true);
        if (adagrad && fused) return std::make_unique<ampfuse::FusedAdagrad>(params, ao);
        if (adagrad) return std::make_unique<torch::optim::Adagrad>(params, ao);
        if (fused) return std::make_unique<ampfuse::FusedRMSprop>(params, ro);
        return std::make_unique<torch::optim::RMSprop>(params, ro);
      };
      auto first = make(ours_first, a);
      run(*first, a, 0, 10);
      std::stringstream archive;
      torch::save(*first, archive);
      for (std::size_t i = 0; i < a.size(); ++i) {
        torch::NoGradGuard no_grad;
        b[i].copy_(a[i]);
      }
      auto second = make(!ours_first, b);
      torch::load(*second, archive);
      run(*first, a, 10, 20);
      run(*second, b, 10, 20);
      expect_close(b, a, 1e-5, "after a checkpoint at step 10");
    }
  }
}

// Under GradScaler (the contract path): scaled grads, one step skipped on an
// inf, the same as LibTorch's optimizer on unscaled grads without that step.
TEST_P(AdagradRmspropTest, UnderTheScalerAsLibTorchOnUnscaledGrads) {
  for (bool adagrad : {true, false}) {
    SCOPED_TRACE(adagrad ? "Adagrad" : "RMSprop");
    auto ours = make_params({{100}, {7, 3}});
    auto ref = copies(ours);
    std::unique_ptr<torch::optim::Optimizer> opt, ref_opt;
    if (adagrad) {
      opt = std::make_unique<ampfuse::FusedAdagrad>(ours, torch::optim::AdagradOptions(0.05).lr_decay(0.1));
      ref_opt = std::make_unique<torch::optim::Adagrad>(ref, torch::optim::AdagradOptions(0.05).lr_decay(0.1));
    } else {
      opt = std::make_unique<ampfuse::FusedRMSprop>(ours, torch::optim::RMSpropOptions(0.01).momentum(0.9));
      ref_opt = std::make_unique<torch::optim::RMSprop>(ref, torch::optim::RMSpropOptions(0.01).momentum(0.9));
    }
    ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(256.0).growth_interval(1000));
    for (int step = 0; step < 8; ++step) {
      const bool poison = step == 3;
      for (std::size_t i = 0; i < ours.size(); ++i) {
        auto grad = torch::randn_like(ref[i]);
        ref[i].mutable_grad() = grad.clone();
        ours[i].mutable_grad() = grad * static_cast<float>(scaler.get_scale());
      }
      if (poison) ours[1].mutable_grad()[0][0] = std::numeric_limits<float>::infinity();
      scaler.scale(torch::ones({}, torch::TensorOptions().device(device_)));
      scaler.step(*opt);
      scaler.update();
      EXPECT_EQ(scaler.last_step_skipped(*opt), poison);
      if (!poison) ref_opt->step();
    }
    expect_close(ours, ref, 1e-5, "after 8 steps, 1 skipped");
    // The step count does not count the skipped step (the checkpoint's step).
    std::stringstream archive;
    torch::save(*opt, archive);
    auto probe = copies(ours);
    if (adagrad) {
      torch::optim::Adagrad loaded(probe);
      torch::load(loaded, archive);
      EXPECT_EQ(static_cast<torch::optim::AdagradParamState&>(*loaded.state().at(probe[0].unsafeGetTensorImpl())).step(), 7);
    } else {
      torch::optim::RMSprop loaded(probe);
      torch::load(loaded, archive);
      EXPECT_EQ(static_cast<torch::optim::RMSpropParamState&>(*loaded.state().at(probe[0].unsafeGetTensorImpl())).step(), 7);
    }
  }
}

TEST_P(AdagradRmspropTest, BadInputNamesGroupAndParamAndChangesNothing) {
  auto good = make_params({{6}})[0];
  good.mutable_grad() = torch::randn_like(good);
  auto bad = make_params({{6}})[0];
  bad.mutable_grad() = torch::randn({5}, torch::TensorOptions().device(device_));
  const auto before = good.detach().clone();
  ampfuse::FusedRMSprop opt({torch::optim::OptimizerParamGroup({good}), torch::optim::OptimizerParamGroup({bad})},
                            torch::optim::RMSpropOptions(0.1).momentum(0.9));
  ampfuse_test::expect_step_refused(opt, "FusedRMSprop: param group 1, param 0: grad shape");
  EXPECT_TRUE(bitwise_equal(good.detach(), before));
  EXPECT_TRUE(opt.state().empty());
  ampfuse::FusedAdagrad adagrad({torch::optim::OptimizerParamGroup({good}), torch::optim::OptimizerParamGroup({bad})});
  ampfuse_test::expect_step_refused(adagrad, "FusedAdagrad: param group 1, param 0: grad shape");
  EXPECT_TRUE(bitwise_equal(good.detach(), before));
}

TEST_P(AdagradRmspropTest, ConformToTheScalerContract) {
  if (!GetParam().isa.empty() && GetParam().isa != "avx512" && GetParam().isa != "baseline") GTEST_SKIP();
  ampfuse::testing::ConformanceOptions o;
  o.device = device_;
  o.dtypes = {torch::kFloat, torch::kHalf, torch::kBFloat16, torch::kDouble};
  o.seed = seed_;
  auto failures = ampfuse::testing::check_contract(
      [](std::vector<torch::Tensor> p) {
        return std::make_unique<ampfuse::FusedAdagrad>(std::move(p), torch::optim::AdagradOptions(0.1).lr_decay(0.01));
      },
      o);
  EXPECT_THAT(failures, IsEmpty());
  failures = ampfuse::testing::check_contract(
      [](std::vector<torch::Tensor> p) {
        return std::make_unique<ampfuse::FusedRMSprop>(
            std::move(p), torch::optim::RMSpropOptions(0.01).momentum(0.9).centered(true));
      },
      o);
  EXPECT_THAT(failures, IsEmpty());
}

INSTANTIATE_TEST_SUITE_P(All, AdagradRmspropTest,
                         ::testing::Values(OptCase{"cpu", "avx512"}, OptCase{"cpu", "avx2"},
                                           OptCase{"cpu", "baseline"}, OptCase{"cuda", ""}),
                         [](const ::testing::TestParamInfo<OptCase>& info) {
                           return info.param.device + (info.param.isa.empty() ? "" : "_" + info.param.isa);
                         });

}  // namespace
