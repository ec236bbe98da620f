// FusedLAMB against a float64 LAMB written with ATen ops here (no LibTorch
// LAMB exists), on random shapes and hyperparameters over 50 steps; the
// scaler contract through the conformance checker; checkpoints; bad input.

#include <ampfuse/fused_lamb.h>
#include <ampfuse/testing/conformance.h>

#include <cmath>
#include <limits>
#include <vector>

#include "tests/common.h"

namespace {

using ampfuse::FusedLAMB;
using ampfuse::FusedLAMBOptions;

struct LambCase {
  std::string device;
  std::string isa;
};

void PrintTo(const LambCase& c, std::ostream* os) { *os << c.device << (c.isa.empty() ? "" : "/" + c.isa); }

std::string case_name(const ::testing::TestParamInfo<LambCase>& info) {
  return info.param.device + (info.param.isa.empty() ? "" : "_" + info.param.isa);
}

class FusedLambTest : public ampfuse_test::DeviceIsaTest<LambCase> {
 public:
  double uniform(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng_); }
  bool coin() { return std::bernoulli_distribution(0.5)(rng_); }

  FusedLAMBOptions random_options() {
    FusedLAMBOptions o(uniform(1e-2, 5e-2));
    o.betas({uniform(0.8, 0.95), uniform(0.99, 0.9999)});
    o.eps(std::pow(10.0, uniform(-8, -5)));
    o.weight_decay(coin() ? 0.0 : uniform(0.0, 0.1));
    o.bias_correction(coin());
    o.grad_averaging(coin());
    o.use_nvlamb(coin());
    if (coin()) o.trust_ratio_min(0.01).trust_ratio_max(10.0);
    return o;
  }

  // Shapes with 0, 1, odd, vector width +- 1, a multi-chunk tensor and an all-zero parameter.
  // Runs of one-element tensors in both groups: the CPU executor walks them
  // slot by slot (for_each_chunk_ahead), and each one's norms must stay its own.
  std::vector<std::vector<std::int64_t>> shapes() const {
    return {{0}, {1}, {1}, {1}, {1}, {1}, {1}, {1}, {7, 3}, {15}, {17}, {65537 * 2 + 3}, {33, 17}, {300}};
  }
};

// LAMB in float64 (apex FusedLAMB semantics, see fused/lamb/lamb_math.h).
struct ReferenceLamb {
  std::vector<torch::Tensor> p, m, v;
  /// Per element, the largest |p| along the run: fp32 rounding accumulates
  /// in proportion to the magnitudes a parameter went through, so one that
  /// climbs to 40 and ends near 0 carries an absolute error of the size of
  /// 40 ulps, not of its final value's.
  std::vector<torch::Tensor> peak;
  std::vector<std::size_t> group;
  std::vector<FusedLAMBOptions> options;
  double step = 0;

  void update(const std::vector<torch::Tensor>& grads) {
    step += 1;
    double sum_sq = 0;
    for (const auto& g : grads) sum_sq += g.to(torch::kDouble).pow(2).sum().item<double>();
    const double global_norm = std::sqrt(sum_sq);
    for (std::size_t i = 0; i < p.size(); ++i) {
      const FusedLAMBOptions& o = options[group[i]];
      const double b1 = std::get<0>(o.betas()), b2 = std::get<1>(o.betas());
      const double clip = o.max_grad_norm() > 0 && global_norm > o.max_grad_norm() ? o.max_grad_norm() / global_norm : 1;
      const torch::Tensor g = grads[i].to(torch::kDouble) * clip;
      m[i] = m[i] * b1 + (o.grad_averaging() ? 1 - b1 : 1.0) * g;
      v[i] = v[i] * b2 + (1 - b2) * g * g;
      const double bc1 = o.bias_correction() ? 1 - std::pow(b1, step) : 1;
      const double bc2 = o.bias_correction() ? 1 - std::pow(b2, step) : 1;
      const torch::Tensor u = (m[i] / bc1) / ((v[i] / bc2).sqrt() + o.eps()) + o.weight_decay() * p[i];
      double ratio = 1;
      if (o.weight_decay() != 0 || o.use_nvlamb()) {
        const double pn = p[i].norm().item<double>(), un = u.norm().item<double>();
        if (pn > 0 && un > 0) ratio = pn / un;
        ratio = std::min(std::max(ratio, o.trust_ratio_min()), o.trust_ratio_max());
      }
      p[i] = p[i] - o.lr() * ratio * u;
      peak[i] = torch::maximum(peak[i], p[i].abs());
    }
  }
};

// |actual - expected| <= atol + rtol * |expected| + path_rtol * peak, elementwise.
::testing::AssertionResult close(const torch::Tensor& actual, const torch::Tensor& expected, double atol, double rtol,
                                 const torch::Tensor& peak = {}, double path_rtol = 0) {
  const auto a = actual.to(torch::kDouble).cpu(), e = expected.to(torch::kDouble).cpu();
  auto tolerance = atol + rtol * e.abs();
  if (peak.defined()) tolerance = tolerance + path_rtol * peak.to(torch::kDouble);
  const auto excess = (a - e).abs() - tolerance;
  if (a.numel() == 0 || excess.max().item<double>() <= 0) return ::testing::AssertionSuccess();
  const auto idx = excess.argmax().item<std::int64_t>();
  return ::testing::AssertionFailure() << "element " << idx << ": " << a.flatten()[idx].item<double>() << " vs "
                                       << e.flatten()[idx].item<double>() << " (atol " << atol << ", rtol " << rtol
                                       << ", path_rtol " << path_rtol << " of a peak of "
                                       << (peak.defined() ? peak.flatten()[idx].item<double>() : 0.0) << ")";
}

// FusedLAMB on `dtype` params in two groups with random options, against
// the float64 reference from the same (rounded) start and grads, 50 steps.
void run_against_reference(FusedLambTest& t, torch::Device device, torch::Dtype dtype, bool master, bool clip,
                           double atol, double rtol, double path_rtol) {
  std::vector<FusedLAMBOptions> options = {t.random_options(), t.random_options()};
  // The first group always applies the trust ratio, so that it is always tested.
  options[0].weight_decay(std::max(options[0].weight_decay(), 0.01));
  for (auto& o : options) {
    o.master_weights(master);
    if (clip) o.max_grad_norm(1.0);  // grads below have a global norm of ~300: clipping is active
  }
  ReferenceLamb ref;
  std::vector<torch::optim::OptimizerParamGroup> groups;
  std::vector<torch::Tensor> params;
  std::vector<std::vector<torch::Tensor>> group_params(2);
  const auto shapes = t.shapes();
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    const std::size_t g = i % 2;
    torch::Tensor p = i == shapes.size() - 1 ? torch::zeros(shapes[i]) : torch::randn(shapes[i]);
    p = p.to(dtype).to(device);
    params.push_back(p);
    group_params[g].push_back(p);
    ref.p.push_back(p.to(torch::kDouble).cpu().clone());  // a copy, also when p is fp64 on the CPU
    ref.peak.push_back(ref.p.back().abs());
    ref.m.push_back(torch::zeros(shapes[i], torch::kDouble));
    ref.v.push_back(torch::zeros(shapes[i], torch::kDouble));
    ref.group.push_back(g);
  }
  ref.options = options;
  for (int g = 0; g < 2; ++g)
    groups.emplace_back(group_params[g], std::make_unique<FusedLAMBOptions>(options[g]));
  FusedLAMB opt(groups, options[0]);
  for (int step = 0; step < 50; ++step) {
    std::vector<torch::Tensor> grads;
    for (auto& p : params) {
      p.mutable_grad() = torch::randn(p.sizes()).to(dtype).to(device);
      grads.push_back(p.grad().cpu());
    }
    opt.step();
    ref.update(grads);
  }
  for (std::size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(close(params[i], ref.p[i], atol, rtol, ref.peak[i], path_rtol))
        << "param " << i << " of shape " << params[i].sizes();
  }
}

TEST_P(FusedLambTest, Fp32MatchesFloat64ReferenceOverFiftySteps) {
  run_against_reference(*this, device_, torch::kFloat, false, false, 1e-5, 1e-4, 2e-5);
}

// Bias corrections from the betas as given (fp64), as apex computes them on
// the host: with beta2 = 0.99999, fp32 rounding makes 1 - beta2 off by
// 1.4e-3 relative, which 1 - beta2^step in the first steps inherits. The
// first steps' updates (trust ratio 1: no weight decay, no NVLAMB) must match
// the float64 reference to 1e-5 of the update.
TEST_P(FusedLambTest, BiasCorrectionsUseTheBetasAsGiven) {
  for (const double beta2 : {0.99999, 0.9999, 0.999}) {
    SCOPED_TRACE("beta2 " + std::to_string(beta2));
    const auto o = FusedLAMBOptions(1e-2).betas({0.9, beta2}).eps(1e-12).weight_decay(0.0);
    // From zero, so that the params stay ~lr in size and their fp32 rounding
    // stays far below the update (the update does not depend on p here).
    auto p = torch::zeros({1000}).to(device_);
    ReferenceLamb ref;
    ref.p = {p.to(torch::kDouble).cpu()};
    ref.peak = {ref.p[0].abs()};
    ref.m = {torch::zeros({1000}, torch::kDouble)};
    ref.v = {torch::zeros({1000}, torch::kDouble)};
    ref.group = {0};
    ref.options = {o};
    FusedLAMB opt({p}, o);
    for (int step = 0; step < 3; ++step) {
      const auto before = p.to(torch::kDouble).cpu();
      const auto ref_before = ref.p[0].clone();
      const auto g = torch::randn({1000});
      p.mutable_grad() = g.to(device_);
      opt.step();
      ref.update({g});
      const auto ours = p.to(torch::kDouble).cpu() - before, expected = ref.p[0] - ref_before;
      EXPECT_TRUE(close(ours, expected, 1e-8, 1e-5)) << "step " << step + 1;
      ref.p[0] = p.to(torch::kDouble).cpu();  // the next step from the same start
    }
  }
}

// fp64 params compute in fp64 with fp64 moments: the float64 reference's
// numbers to rounding, with and without max_grad_norm.
TEST_P(FusedLambTest, Fp64MatchesFloat64ReferenceOverFiftySteps) {
  run_against_reference(*this, device_, torch::kDouble, false, false, 1e-12, 1e-12, 0);
  run_against_reference(*this, device_, torch::kDouble, false, true, 1e-12, 1e-12, 0);
}

TEST_P(FusedLambTest, MaxGradNormClipsByTheGlobalNorm) {
  run_against_reference(*this, device_, torch::kFloat, false, true, 1e-5, 1e-4, 2e-5);
}

// fp16/bf16 params with fp32 master weights: the params are the master
// copies rounded, so they stay within a couple of storage ulps of the
// float64 run (fp16 ulp 2^-10, bf16 2^-7 relative).
TEST_P(FusedLambTest, LowPrecisionWithMasterWeightsTracksTheReference) {
  run_against_reference(*this, device_, torch::kHalf, true, false, 2e-3, 2e-3, 2e-5);
  run_against_reference(*this, device_, torch::kBFloat16, true, true, 1.6e-2, 1.6e-2, 2e-5);
}

TEST_P(FusedLambTest, ConformsToTheScalerContract) {
  ampfuse::testing::ConformanceOptions c;
  c.device = device_;
  c.dtypes = {torch::kFloat, torch::kHalf, torch::kBFloat16, torch::kDouble};
  c.seed = seed_;
  for (const bool clip : {false, true}) {
    const auto failures = ampfuse::testing::check_contract(
        [clip](std::vector<torch::Tensor> p) {
          return std::make_unique<FusedLAMB>(std::move(p),
                                             FusedLAMBOptions(1e-2).weight_decay(0.01).max_grad_norm(clip ? 0.5 : 0));
        },
        c);
    std::string all;
    for (const auto& f : failures) all += "\n  " + f;
    EXPECT_TRUE(failures.empty()) << "max_grad_norm " << clip << all;
  }
}

TEST_P(FusedLambTest, CheckpointContinuesBitwise) {
  auto make = [&] {
    std::vector<torch::Tensor> ps;
    for (const auto& shape : shapes()) ps.push_back(torch::randn(shape).to(torch::kHalf).to(device_));
    return ps;
  };
  const auto start = make();
  auto clone_all = [](const std::vector<torch::Tensor>& ps) {
    std::vector<torch::Tensor> out;
    for (const auto& p : ps) out.push_back(p.clone());
    return out;
  };
  std::vector<std::vector<torch::Tensor>> grads(10);
  for (auto& step : grads)
    for (const auto& p : start) step.push_back(torch::randn(p.sizes()).to(torch::kHalf).to(device_));
  const auto options = FusedLAMBOptions(1e-2).weight_decay(0.05).master_weights(true).max_grad_norm(2.0);
  auto a = clone_all(start), b = clone_all(start);
  FusedLAMB straight(a, options);
  auto first = std::make_unique<FusedLAMB>(b, options);
  const std::string path = ampfuse_test::temp_path("lamb.pt");
  for (int s = 0; s < 10; ++s) {
    for (std::size_t i = 0; i < a.size(); ++i) {
      a[i].mutable_grad() = grads[s][i];
      b[i].mutable_grad() = grads[s][i];
    }
    straight.step();
    first->step();
    if (s == 4) {
      torch::save(*first, path);
      first = std::make_unique<FusedLAMB>(b, FusedLAMBOptions(0.5));  // other options: the checkpoint restores them
      torch::load(*first, path);
    }
  }
  std::remove(path.c_str());
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(ampfuse_test::bitwise_equal(a[i], b[i])) << "param " << i;
}

TEST_P(FusedLambTest, BadInputNamesGroupAndParamAndChangesNothing) {
  auto p0 = torch::randn({5}).to(device_), p1 = torch::randn({3}).to(device_);
  const auto before0 = p0.clone(), before1 = p1.clone();
  p0.mutable_grad() = torch::randn({5}).to(device_);
  p1.mutable_grad() = torch::randn({3}).to(device_);
  {
    FusedLAMB opt({p0, p1}, FusedLAMBOptions().master_weights(true));
    EXPECT_THAT([&] { opt.step(); }, ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr(
                                         "FusedLAMB: param group 0, param 0: master_weights asked for on a Float")));
    EXPECT_TRUE(opt.state().empty());
  }
  {
    FusedLAMB opt({p0, p1}, FusedLAMBOptions().betas({0.9, 1.0}));
    EXPECT_THAT([&] { opt.step(); },
                ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr("FusedLAMB: param group 0: betas")));
  }
  {
    p1.mutable_grad() = torch::randn({3}, torch::kDouble).to(device_);
    FusedLAMB opt({p0, p1});
    EXPECT_THAT([&] { opt.step(); }, ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr(
                                         "FusedLAMB: param group 0, param 1: grad dtype Double")));
    EXPECT_TRUE(opt.state().empty());
  }
  EXPECT_TRUE(ampfuse_test::bitwise_equal(p0, before0));
  EXPECT_TRUE(ampfuse_test::bitwise_equal(p1, before1));
}

// Options set between steps are checked as at the first step, before
// anything is written (the step plan made before them held, and they were
// not: an eps of 0 made NaN where m = v = 0, master_weights on a Float
// parameter made a master that was then saved).
TEST_P(FusedLambTest, OptionsSetBetweenStepsAreRefusedAsAtTheFirstStep) {
  ampfuse_test::seed_for_test();
  auto p = torch::randn({300}).to(device_);
  p.mutable_grad() = torch::randn({300}).to(device_);
  p.mutable_grad()[0] = 0.0f;  // m = v = 0 there
  FusedLAMB opt({p}, FusedLAMBOptions(1e-2));
  opt.step();
  opt.step();
  auto& o = static_cast<FusedLAMBOptions&>(opt.param_groups()[0].options());
  auto& st = static_cast<ampfuse::FusedLAMBParamState&>(*opt.state().begin()->second);
  const torch::Tensor before = p.clone();
  const std::vector<torch::Tensor> state_before = {st.step().clone(), st.exp_avg().clone(), st.exp_avg_sq().clone()};
  o.eps(0.0);
  EXPECT_THAT([&] { opt.step(); }, ::testing::ThrowsMessage<c10::Error>(
                                       ::testing::HasSubstr("FusedLAMB: param group 0: eps must be > 0, got 0")));
  o.eps(1e-6);
  o.master_weights(true);
  EXPECT_THAT([&] { opt.step(); }, ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr(
                                       "FusedLAMB: param group 0, param 0: master_weights asked for on a Float")));
  EXPECT_TRUE(ampfuse_test::bitwise_equal(p, before));
  EXPECT_TRUE(ampfuse_test::bitwise_equal(st.step(), state_before[0]));
  EXPECT_TRUE(ampfuse_test::bitwise_equal(st.exp_avg(), state_before[1]));
  EXPECT_TRUE(ampfuse_test::bitwise_equal(st.exp_avg_sq(), state_before[2]));
  EXPECT_FALSE(st.master().defined());
  o.master_weights(false);
  opt.step();
  EXPECT_TRUE(torch::isfinite(p).all().item<bool>());
  EXPECT_FALSE(ampfuse_test::bitwise_equal(p, before));
}

// master_weights switched off and on again: the master of the first steps
// is dropped while the option is off (the kernel writes the parameter
// alone, which leaves its version as it was, so the old master looked
// current when the option came back, and an lr-0 step put the parameter
// back where it was 20 steps before: helper-44's reproducer).
TEST_P(FusedLambTest, MasterWeightsSwitchedOffAndOnDoNotUndoTheStepsBetween) {
  ampfuse_test::seed_for_test();
  for (auto dtype : {torch::kHalf, torch::kBFloat16}) {
    SCOPED_TRACE(ampfuse_test::dtype_name(dtype));
    auto p = torch::randn({1000}).to(dtype).to(device_);
    FusedLAMB opt({p}, FusedLAMBOptions(1e-1).weight_decay(0.01).master_weights(true));
    auto& o = static_cast<FusedLAMBOptions&>(opt.param_groups()[0].options());
    const auto step = [&] {
      p.mutable_grad() = torch::randn({1000}).to(dtype).to(device_);
      opt.step();
    };
    for (int i = 0; i < 3; ++i) step();
    o.master_weights(false);
    for (int i = 0; i < 5; ++i) step();
    EXPECT_FALSE(static_cast<ampfuse::FusedLAMBParamState&>(*opt.state().begin()->second).master().defined());
    const torch::Tensor before = p.clone();
    o.master_weights(true);
    o.lr(0.0);
    step();
    EXPECT_TRUE(ampfuse_test::bitwise_equal(p, before));
  }
}

// Launches per step, counted in a CUDA graph: two per group and dtype, one
// more per device and dtype with max_grad_norm (the global norm pass).
TEST(FusedLambCuda, LaunchesPerStep) {
#if !defined(AMPFUSE_WITH_CUDA)
  GTEST_SKIP() << "built without CUDA";
#else
  if (!ampfuse_test::cuda_available()) GTEST_SKIP() << "no CUDA device here; this test runs on a GPU machine";
  ampfuse_test::seed_for_test();
  for (const double max_grad_norm : {0.0, 1.0}) {
    const std::vector<torch::Tensor> start = {torch::randn({1000}, torch::kCUDA), torch::randn({70000}, torch::kCUDA),
                                              torch::randn({0}, torch::kCUDA)};
    std::vector<torch::Tensor> a, b;  // a: eager, b: replayed from a graph
    for (const auto& t : start) {
      a.push_back(t.clone());
      b.push_back(t.clone());
      const auto g = torch::randn_like(t);
      a.back().mutable_grad() = g.clone();
      b.back().mutable_grad() = g.clone();
    }
    const auto options = FusedLAMBOptions(1e-2).weight_decay(0.01).max_grad_norm(max_grad_norm);
    FusedLAMB eager(a, options), graphed(b, options);
    eager.step();
    graphed.step();  // warm-up: state exists before capture
    auto [graph, kernels] = ampfuse_test::capture([&] { graphed.step(); });
    // The zero-element tensor's step counter is advanced by one host-side add (a kernel of its own).
    EXPECT_EQ(kernels, (max_grad_norm > 0 ? 3u : 2u) + 1u) << "max_grad_norm " << max_grad_norm;
    std::cout << "[ launches ] FusedLAMB, one group, max_grad_norm " << max_grad_norm << ": " << kernels
              << " kernel nodes per step (one of them for a zero-element tensor's step counter)\n";
    for (int s = 0; s < 3; ++s) {
      eager.step();
      graph->replay();
    }
    for (std::size_t i = 0; i < a.size(); ++i)
      EXPECT_TRUE(ampfuse_test::bitwise_equal(a[i], b[i])) << "param " << i << ": eager vs graph replay";
  }
#endif
}

INSTANTIATE_TEST_SUITE_P(All, FusedLambTest,
                         ::testing::Values(LambCase{"cpu", "avx512"}, LambCase{"cpu", "avx2"},
                                           LambCase{"cpu", "baseline"}, LambCase{"cuda", ""}),
                         case_name);

}  // namespace
