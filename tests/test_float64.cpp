// float64 parameters, as torch::optim and torch.amp take them: the fused
// optimizers compute in fp64 (opmath double) and follow torch::optim over 100
// steps of random hyperparameters within 1e-12 (|ours - ref| <= 1e-12 *
// (1 + |ref|)), on every CPU instruction set and on CUDA; GradScaler takes
// fp64 grads (classic and contract paths); what fp64 cannot have is refused.
// The engine ops' fp64 cases are in test_engine_ops.cpp, LAMB's in
// test_fused_lamb.cpp.

#include <ampfuse/ampfuse.h>

#include <cmath>
#include <limits>

#include "tests/common.h"
#include "tests/random_options.h"

namespace {

using namespace ampfuse_test::random_options;
using ampfuse_test::expect_close;
using ::testing::HasSubstr;

struct F64Case {
  std::string device;
  std::string isa;
};

void PrintTo(const F64Case& c, std::ostream* os) { *os << c.device << (c.isa.empty() ? "" : "/" + c.isa); }

constexpr double kTol = 1e-12;

using Float64Test = ampfuse_test::DeviceIsaTest<F64Case>;

// One step of both optimizers on the same random grads.
void step_both(std::vector<torch::Tensor>& ours, torch::optim::Optimizer& opt, std::vector<torch::Tensor>& ref,
               torch::optim::Optimizer& ref_opt) {
  for (std::size_t i = 0; i < ours.size(); ++i) {
    const auto g = torch::randn_like(ours[i]);
    ours[i].mutable_grad() = g.clone();
    ref[i].mutable_grad() = g.clone();
  }
  opt.step();
  ref_opt.step();
}

// Each optimizer against its torch::optim twin on fp64 parameters (the
// second round with maximize).
TEST_P(Float64Test, EveryOptimizerMatchesTorchOptimOverHundredSteps) {
  using ampfuse_test::expect_matches_over_hundred_steps;
  for (const bool maximize : {false, true}) {
    SCOPED_TRACE(maximize ? "maximize" : "minimize");
    {
      SCOPED_TRACE("FusedAdam");
      expect_matches_over_hundred_steps<ampfuse::FusedAdam, torch::optim::Adam, torch::optim::AdamOptions>(
          device_, rng_, random_adam<torch::optim::AdamOptions>, ampfuse::FusedAdamOptions().maximize(maximize),
          maximize, kTol, torch::kDouble);
    }
    {
      SCOPED_TRACE("FusedAdamW");
      expect_matches_over_hundred_steps<ampfuse::FusedAdamW, torch::optim::AdamW, torch::optim::AdamWOptions>(
          device_, rng_, random_adam<torch::optim::AdamWOptions>, ampfuse::FusedAdamOptions().maximize(maximize),
          maximize, kTol, torch::kDouble);
    }
    {
      SCOPED_TRACE("FusedSGD");
      expect_matches_over_hundred_steps<ampfuse::FusedSGD, torch::optim::SGD, torch::optim::SGDOptions>(
          device_, rng_, random_sgd, ampfuse::FusedSGDOptions().maximize(maximize), maximize, kTol, torch::kDouble);
    }
    {
      SCOPED_TRACE("FusedAdagrad");
      expect_matches_over_hundred_steps<ampfuse::FusedAdagrad, torch::optim::Adagrad, torch::optim::AdagradOptions>(
          device_, rng_, random_adagrad, ampfuse::FusedAdagradOptions().maximize(maximize), maximize, kTol,
          torch::kDouble);
    }
    {
      SCOPED_TRACE("FusedRMSprop");
      expect_matches_over_hundred_steps<ampfuse::FusedRMSprop, torch::optim::RMSprop, torch::optim::RMSpropOptions>(
          device_, rng_, random_rmsprop, ampfuse::FusedRMSpropOptions().maximize(maximize), maximize, kTol,
          torch::kDouble);
    }
  }
}

// fp64 and fp32 parameters in one group: two lists, each in its own opmath,
// each as torch::optim steps it (the fp32 one within the fp32 bound).
TEST_P(Float64Test, MixedWithFloatInOneGroup) {
  auto f64 = make_params({{129}, {7, 3}}, torch::kDouble), f32 = make_params({{65}, {5}});
  std::vector<torch::Tensor> ours = {f64[0], f32[0], f64[1], f32[1]};
  std::vector<torch::Tensor> ref;
  for (const auto& p : ours) ref.push_back(p.detach().clone().requires_grad_());
  const auto o = torch::optim::AdamOptions(1e-2).weight_decay(0.01).amsgrad(true);
  ampfuse::FusedAdam opt(ours, o);
  torch::optim::Adam ref_opt(ref, o);
  for (int step = 0; step < 20; ++step) {
    step_both(ours, opt, ref, ref_opt);
  }
  expect_close({ours[0], ours[2]}, {ref[0], ref[2]}, kTol, "fp64 params");
  expect_close({ours[1], ours[3]}, {ref[1], ref[3]}, 1e-5, "fp32 params");
  for (std::size_t i = 0; i < ours.size(); ++i) {
    const auto& st = static_cast<const torch::optim::AdamParamState&>(*opt.state().at(ours[i].unsafeGetTensorImpl()));
    EXPECT_EQ(st.exp_avg().scalar_type(), ours[i].scalar_type()) << "param " << i;
  }
}

// GradScaler with fp64 grads: the classic path (torch::optim::Adam, grads
// unscaled in place) and the contract path (FusedAdam, grads read with the
// inverse scale) reach the same parameters; a step with an inf is skipped by
// both, writing nothing.
TEST_P(Float64Test, GradScalerClassicAndContractPathsAgree) {
  auto ours = make_params({{1000}, {33, 3}, {1}}, torch::kDouble);
  auto ref = copies(ours, torch::kDouble);
  const auto o = torch::optim::AdamOptions(1e-3).weight_decay(0.01);
  ampfuse::FusedAdam opt(ours, o);
  torch::optim::Adam ref_opt(ref, o);
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(65536.0).growth_interval(3));
  ampfuse::GradScaler ref_scaler(ampfuse::GradScalerOptions().init_scale(65536.0).growth_interval(3));
  for (int step = 0; step < 12; ++step) {
    const bool poison = step == 4;
    scaler.scale(torch::ones({}, torch::kDouble));  // as scaler.scale(loss) does
    ref_scaler.scale(torch::ones({}, torch::kDouble));
    for (std::size_t i = 0; i < ours.size(); ++i) {
      const auto g = torch::randn_like(ours[i]) * scaler.get_scale();
      ours[i].mutable_grad() = g.clone();
      ref[i].mutable_grad() = g.clone();
    }
    if (poison) {
      ours[1].mutable_grad()[2][1] = std::numeric_limits<double>::infinity();
      ref[1].mutable_grad()[2][1] = std::numeric_limits<double>::infinity();
    }
    std::vector<torch::Tensor> before;
    for (const auto& p : ours) before.push_back(p.detach().clone());
    scaler.step(opt);
    ref_scaler.step(ref_opt);
    scaler.update();
    ref_scaler.update();
    if (poison)
      for (std::size_t i = 0; i < ours.size(); ++i)
        EXPECT_TRUE(ampfuse_test::bitwise_equal(ours[i], before[i])) << "skipped step wrote param " << i;
    EXPECT_EQ(scaler.get_scale(), ref_scaler.get_scale()) << "step " << step;
  }
  expect_close(ours, ref, kTol, "after 12 scaled steps");
}

// What fp64 parameters cannot have is refused, naming the parameter, before
// anything is written.
TEST_P(Float64Test, MasterWeightsAndBf16MomentsAreRefused) {
  auto params = make_params({{4}, {3}}, torch::kDouble);
  for (auto& p : params) p.mutable_grad() = torch::ones_like(p);
  const auto before = copies(params, torch::kDouble);
  ampfuse::FusedAdam master(params, torch::optim::AdamOptions(0.1), ampfuse::FusedAdamOptions().master_weights(true));
  ampfuse_test::expect_step_refused(master, "param group 0, param 0: master_weights asked for on a Double parameter");
  ampfuse::FusedAdam bf16(params, torch::optim::AdamOptions(0.1), ampfuse::FusedAdamOptions().bf16_moments(true));
  ampfuse_test::expect_step_refused(bf16, "param group 0, param 0: bf16_moments asked for on a Double parameter");
  ampfuse::FusedLAMB lamb(params, ampfuse::FusedLAMBOptions(0.1).master_weights(true));
  ampfuse_test::expect_step_refused(lamb, "param group 0, param 0: master_weights asked for on a Double parameter");
  expect_close(params, before, 0.0, "nothing written");
  EXPECT_TRUE(master.state().empty() && bf16.state().empty() && lamb.state().empty());
}

// A checkpoint of fp64 FusedAdam loads into torch::optim::Adam and both
// continue alike.
TEST_P(Float64Test, CheckpointLoadsIntoTorchOptim) {
  auto ours = make_params({{77}, {3, 5}}, torch::kDouble);
  const auto o = torch::optim::AdamOptions(1e-2).amsgrad(true);
  ampfuse::FusedAdam opt(ours, o);
  for (int step = 0; step < 3; ++step) {
    for (auto& p : ours) p.mutable_grad() = torch::randn_like(p);
    opt.step();
  }
  const std::string path = ampfuse_test::temp_path("f64_adam.pt");
  torch::save(opt, path);
  auto ref = copies(ours, torch::kDouble);
  torch::optim::Adam ref_opt(ref, o);
  torch::load(ref_opt, path);
  std::remove(path.c_str());
  for (int step = 0; step < 5; ++step) {
    step_both(ours, opt, ref, ref_opt);
  }
  expect_close(ours, ref, kTol, "after loading into torch::optim::Adam");
}

INSTANTIATE_TEST_SUITE_P(All, Float64Test,
                         ::testing::Values(F64Case{"cpu", "avx512"}, F64Case{"cpu", "avx2"},
                                           F64Case{"cpu", "baseline"}, F64Case{"cuda", ""}),
                         [](const ::testing::TestParamInfo<F64Case>& info) {
                           return info.param.device + (info.param.isa.empty() ? "" : "_" + info.param.isa);
                         });

}  // namespace
