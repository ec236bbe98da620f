// The scaler-contract conformance checker (ampfuse/testing/conformance.h):
// ampfuse's optimizers conform on CPU and CUDA (skipped without a device),
// and deliberately broken optimizers are caught under the rule they break.

#include <ampfuse/fused_adam.h>
#include <ampfuse/fused_sgd.h>
#include <ampfuse/testing/conformance.h>

#include "tests/common.h"

namespace {

namespace conf = ampfuse::testing;
using ::testing::AllOf;
using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using ::testing::SizeIs;

std::string joined(const std::vector<std::string>& failures) {
  std::string out;
  for (const auto& f : failures) out += "\n  " + f;
  return out;
}

// ------------------------------------------------ ampfuse's optimizers conform

class ConformanceTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    device_ = torch::Device(GetParam());
    AMPFUSE_SKIP_WITHOUT(device_);
    seed_ = ampfuse_test::seed_for_test();
  }

  conf::ConformanceOptions options(std::vector<torch::Dtype> dtypes) const {
    conf::ConformanceOptions o;
    o.device = device_;
    o.dtypes = std::move(dtypes);
    o.seed = seed_;
    return o;
  }

  torch::Device device_{torch::kCPU};
  std::uint64_t seed_ = 0;
};

INSTANTIATE_TEST_SUITE_P(All, ConformanceTest, ::testing::Values("cpu", "cuda"),
                         [](const auto& info) { return info.param; });

TEST_P(ConformanceTest, FusedAdam) {
  const auto failures = conf::check_contract(
      [](std::vector<torch::Tensor> p) { return std::make_unique<ampfuse::FusedAdam>(std::move(p)); },
      options({torch::kFloat, torch::kHalf, torch::kBFloat16, torch::kDouble}));
  EXPECT_THAT(failures, IsEmpty()) << joined(failures);
}

TEST_P(ConformanceTest, FusedAdamMasterWeights) {
  const auto failures = conf::check_contract(
      [](std::vector<torch::Tensor> p) {
        return std::make_unique<ampfuse::FusedAdam>(std::move(p), torch::optim::AdamOptions(1e-2),
                                                    ampfuse::FusedAdamOptions().master_weights(true));
      },
      options({torch::kHalf, torch::kBFloat16}));
  EXPECT_THAT(failures, IsEmpty()) << joined(failures);
}

TEST_P(ConformanceTest, FusedAdamWAmsgrad) {
  const auto failures = conf::check_contract(
      [](std::vector<torch::Tensor> p) {
        return std::make_unique<ampfuse::FusedAdamW>(std::move(p),
                                                     torch::optim::AdamWOptions(1e-2).weight_decay(0.05).amsgrad(true));
      },
      options({torch::kFloat, torch::kBFloat16, torch::kDouble}));
  EXPECT_THAT(failures, IsEmpty()) << joined(failures);
}

TEST_P(ConformanceTest, FusedSGDMomentum) {
  const auto failures = conf::check_contract(
      [](std::vector<torch::Tensor> p) {
        return std::make_unique<ampfuse::FusedSGD>(std::move(p),
                                                   torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(1e-4));
      },
      options({torch::kFloat, torch::kHalf, torch::kBFloat16, torch::kDouble}));
  EXPECT_THAT(failures, IsEmpty()) << joined(failures);
}

TEST_P(ConformanceTest, FusedSGDNesterovAndPlain) {
  for (const double momentum : {0.9, 0.0}) {
    const auto failures = conf::check_contract(
        [momentum](std::vector<torch::Tensor> p) {
          const auto o = torch::optim::SGDOptions(0.1).momentum(momentum).nesterov(momentum > 0);
          return std::make_unique<ampfuse::FusedSGD>(std::move(p), o);
        },
        options({torch::kFloat}));
    EXPECT_THAT(failures, IsEmpty()) << "momentum " << momentum << joined(failures);
  }
}

// ------------------------------------------ StepSignals keys

// Tensors carry "cpu" and "cuda:N": a device named otherwise ("cpu:0", or
// "cuda" for the current one) finds the same signal, and asking for a device
// that cannot be resolved (no GPU here) answers "absent" instead of throwing.
TEST(StepSignalsKeys, DevicesAsTensorsNameThem) {
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat);
  ampfuse::StepSignals signals;
  signals.set(torch::Device("cpu:0"), {torch::Tensor(), torch::zeros({}, f32), torch::Tensor()});
  ASSERT_EQ(signals.all().size(), 1u);
  EXPECT_EQ(signals.all()[0].first, torch::Device(torch::kCPU));
  EXPECT_TRUE(signals.contains(torch::kCPU));
  EXPECT_TRUE(signals.at(torch::Device("cpu:0")).found_inf.defined());
  if (!ampfuse_test::cuda_available()) {
    EXPECT_FALSE(signals.contains(torch::kCUDA));
    return;
  }
  const auto on_cuda = torch::zeros({}, f32.device(torch::kCUDA));  // on the current device
  signals.set(torch::kCUDA, {torch::Tensor(), on_cuda, torch::Tensor()});
  const torch::Device current = on_cuda.device();
  EXPECT_TRUE(signals.contains(current)) << "\"cuda\" is the current device, " << current;
  EXPECT_TRUE(signals.at(current).found_inf.device() == current);
}

// ------------------------------------------ broken optimizers are caught

// torch::optim::SGD behind the contract, fed the effective grads
// g * inv_scale * clip_coef; `bug` breaks one part of the contract. With
// kNone it conforms (on CPU, where its host read of found_inf is not seen).
enum class Bug { kNone, kIgnoreFoundInf, kFoundInfEqualsOne, kUnscaleInPlace, kIgnoreInvScale, kIgnoreClip };

class BrokenSGD : public torch::optim::SGD, public ampfuse::ScalerAware {
 public:
  BrokenSGD(std::vector<torch::Tensor> params, Bug bug)
      : SGD(std::move(params), torch::optim::SGDOptions(0.1).momentum(0.9)), bug_(bug) {}

  void step_with_signals(const ampfuse::StepSignals& signals) override {
    torch::NoGradGuard no_grad;
    const ampfuse::ScaleSignal& s = signals.all().front().second;
    const float found_inf = s.found_inf.item<float>();  // a host sync: rule 3, seen on CUDA only
    const bool skip = bug_ == Bug::kFoundInfEqualsOne ? found_inf == 1 : found_inf != 0;
    if (skip && bug_ != Bug::kIgnoreFoundInf) return;
    std::vector<torch::Tensor> grads;
    for (auto& p : param_groups()[0].params()) {
      grads.push_back(p.grad());
      torch::Tensor g = bug_ == Bug::kUnscaleInPlace ? p.grad() : p.grad().clone();
      if (s.inv_scale.defined() && bug_ != Bug::kIgnoreInvScale) g.mul_(s.inv_scale);
      if (s.clip_coef.defined() && bug_ != Bug::kIgnoreClip) g.mul_(s.clip_coef);
      p.mutable_grad() = g;
    }
    SGD::step();
    for (std::size_t i = 0; i < grads.size(); ++i) param_groups()[0].params()[i].mutable_grad() = grads[i];
  }

 private:
  Bug bug_;
};

std::vector<std::string> check_broken(Bug bug, std::uint64_t seed) {
  conf::ConformanceOptions o;
  o.seed = seed;
  return conf::check_contract(
      [bug](std::vector<torch::Tensor> p) { return std::make_unique<BrokenSGD>(std::move(p), bug); }, o);
}

TEST(ConformanceChecker, ControlSGDWithoutBugConforms) {
  const auto failures = check_broken(Bug::kNone, ampfuse_test::seed_for_test());
  EXPECT_THAT(failures, IsEmpty()) << joined(failures);
}

TEST(ConformanceChecker, CatchesIgnoredFoundInf) {
  const auto failures = check_broken(Bug::kIgnoreFoundInf, ampfuse_test::seed_for_test());
  EXPECT_THAT(failures, Contains(HasSubstr(conf::kRuleSkip))) << joined(failures);
  EXPECT_THAT(failures, Contains(HasSubstr(conf::kRuleCounters))) << joined(failures);
  EXPECT_THAT(failures, Not(Contains(HasSubstr("rule 2")))) << joined(failures);
}

TEST(ConformanceChecker, CatchesFoundInfTestedAgainstOne) {
  const auto failures = check_broken(Bug::kFoundInfEqualsOne, ampfuse_test::seed_for_test());
  EXPECT_THAT(failures, Contains(AllOf(HasSubstr(conf::kRuleSkip), HasSubstr("found_inf = 2")))) << joined(failures);
  EXPECT_THAT(failures, Not(Contains(HasSubstr("found_inf = 1")))) << joined(failures);
}

TEST(ConformanceChecker, CatchesGradsUnscaledInPlace) {
  const auto failures = check_broken(Bug::kUnscaleInPlace, ampfuse_test::seed_for_test());
  EXPECT_THAT(failures, Contains(HasSubstr(conf::kRuleGradsRead))) << joined(failures);
  EXPECT_THAT(failures, Not(Contains(HasSubstr(conf::kRuleSkip)))) << joined(failures);
}

TEST(ConformanceChecker, CatchesIgnoredInvScale) {
  const auto failures = check_broken(Bug::kIgnoreInvScale, ampfuse_test::seed_for_test());
  EXPECT_THAT(failures, Contains(HasSubstr(conf::kRuleUnscale))) << joined(failures);
}

TEST(ConformanceChecker, CatchesIgnoredClip) {
  const auto failures = check_broken(Bug::kIgnoreClip, ampfuse_test::seed_for_test());
  EXPECT_THAT(failures, Contains(HasSubstr(conf::kRuleClip))) << joined(failures);
  EXPECT_THAT(failures, Not(Contains(HasSubstr(conf::kRuleUnscale)))) << joined(failures);
}

// torch::optim::Adam behind the contract that, on a skipped step, leaves the
// parameters alone but still advances its step counters.
class CountsSkippedStepsAdam : public torch::optim::Adam, public ampfuse::ScalerAware {
 public:
  explicit CountsSkippedStepsAdam(std::vector<torch::Tensor> params) : Adam(std::move(params)) {}

  void step_with_signals(const ampfuse::StepSignals& signals) override {
    torch::NoGradGuard no_grad;
    const ampfuse::ScaleSignal& s = signals.all().front().second;
    if (s.found_inf.item<float>() != 0) {
      for (auto& entry : state()) {
        auto& st = static_cast<torch::optim::AdamParamState&>(*entry.second);
        st.step(st.step() + 1);
      }
      return;
    }
    std::vector<torch::Tensor> grads;
    for (auto& p : param_groups()[0].params()) {
      grads.push_back(p.grad());
      torch::Tensor g = p.grad().clone();
      if (s.inv_scale.defined()) g.mul_(s.inv_scale);
      if (s.clip_coef.defined()) g.mul_(s.clip_coef);
      p.mutable_grad() = g;
    }
    Adam::step();
    for (std::size_t i = 0; i < grads.size(); ++i) param_groups()[0].params()[i].mutable_grad() = grads[i];
  }
};

TEST(ConformanceChecker, CatchesCountersAdvancedOnSkippedSteps) {
  conf::ConformanceOptions o;
  o.seed = ampfuse_test::seed_for_test();
  const auto failures = conf::check_contract(
      [](std::vector<torch::Tensor> p) { return std::make_unique<CountsSkippedStepsAdam>(std::move(p)); }, o);
  EXPECT_THAT(failures, Contains(HasSubstr(conf::kRuleCounters))) << joined(failures);
  // The skip check sees the counter in the saved state, too.
  EXPECT_THAT(failures, Contains(AllOf(HasSubstr(conf::kRuleSkip), HasSubstr("step")))) << joined(failures);
}

TEST(ConformanceChecker, RejectsAnOptimizerThatIsNotScalerAware) {
  conf::ConformanceOptions o;
  o.seed = ampfuse_test::seed_for_test();
  const auto failures = conf::check_contract(
      [](std::vector<torch::Tensor> p) {
        return std::make_unique<torch::optim::SGD>(std::move(p), torch::optim::SGDOptions(0.1));
      },
      o);
  ASSERT_THAT(failures, SizeIs(1));
  EXPECT_THAT(failures[0], HasSubstr(conf::kNotScalerAware));
  EXPECT_THAT(failures[0], HasSubstr(std::to_string(o.seed)));
}

TEST(ConformanceChecker, FailuresNameTheDtypeAndSeed) {
  const std::uint64_t seed = ampfuse_test::seed_for_test();
  conf::ConformanceOptions o;
  o.seed = seed;
  o.dtypes = {torch::kFloat, torch::kHalf};
  const auto failures = conf::check_contract(
      [](std::vector<torch::Tensor> p) { return std::make_unique<BrokenSGD>(std::move(p), Bug::kIgnoreFoundInf); }, o);
  ASSERT_THAT(failures, Not(IsEmpty()));
  for (const auto& f : failures) EXPECT_THAT(f, HasSubstr("seed " + std::to_string(seed))) << f;
  EXPECT_THAT(failures, Contains(HasSubstr("Float params on cpu")));
  EXPECT_THAT(failures, Contains(HasSubstr("Half params on cpu")));
}

// On CUDA the host read of found_inf in BrokenSGD is a sync the checker sees.
TEST(ConformanceChecker, CatchesHostSyncOnCuda) {
  AMPFUSE_SKIP_WITHOUT(torch::Device(torch::kCUDA));
  conf::ConformanceOptions o;
  o.device = torch::kCUDA;
  o.seed = ampfuse_test::seed_for_test();
  const auto failures = conf::check_contract(
      [](std::vector<torch::Tensor> p) { return std::make_unique<BrokenSGD>(std::move(p), Bug::kNone); }, o);
#if defined(AMPFUSE_WITH_CUDA)
  EXPECT_THAT(failures, ElementsAre(HasSubstr(conf::kRuleNoSync))) << joined(failures);
#else
  EXPECT_THAT(failures, IsEmpty()) << joined(failures);
#endif
}

}  // namespace
