// FusedAdam / FusedAdamW against torch::optim::Adam / AdamW and ATen's
// _fused_adam_ / _fused_adamw_, on every CPU instruction set and on CUDA
// (skipped without a device): numbers, skipped steps, checkpoints, bad input.

#include <ampfuse/fused_adam.h>
#include <ampfuse/grad_scaler.h>

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <limits>
#include <sstream>

#include "contract/cpu/kernels.h"
#include "tests/common.h"

namespace {

using ampfuse_test::bitwise_equal;
using ::testing::HasSubstr;

struct AdamCase {
  std::string device;
  std::string isa;  // "" on CUDA
  bool adamw;
};

void PrintTo(const AdamCase& c, std::ostream* os) {
  *os << c.device << (c.isa.empty() ? "" : "/" + c.isa) << (c.adamw ? "/adamw" : "/adam");
}

std::string adam_case_name(const ::testing::TestParamInfo<AdamCase>& info) {
  return info.param.device + (info.param.isa.empty() ? "" : "_" + info.param.isa) +
         (info.param.adamw ? "_adamw" : "_adam");
}

std::vector<AdamCase> adam_cases() {
  std::vector<AdamCase> cases;
  for (bool adamw : {false, true}) {
    for (const char* isa : {"avx512", "avx2", "baseline"}) cases.push_back({"cpu", isa, adamw});
    cases.push_back({"cuda", "", adamw});
  }
  return cases;
}

// Random hyperparameters of one group.
struct Hyper {
  double lr, beta1, beta2, eps, weight_decay;
  bool amsgrad;
};

Hyper random_hyper(std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(0, 1);
  return {std::pow(10.0, -4 + 2.5 * u(rng)), 0.5 + 0.49 * u(rng), 0.9 + 0.0999 * u(rng),
          std::pow(10.0, -10 + 4 * u(rng)), u(rng) < 0.5 ? 0.0 : 0.1 * u(rng), u(rng) < 0.5};
}

template <class Options>
Options to_options(const Hyper& h) {
  Options o(h.lr);
  o.betas(std::make_tuple(h.beta1, h.beta2)).eps(h.eps).weight_decay(h.weight_decay).amsgrad(h.amsgrad);
  return o;
}

class FusedAdamTest : public ampfuse_test::DeviceIsaTest<AdamCase> {
 protected:
  // Shapes with 0, 1, odd sizes, the vector widths and a chunk boundary.
  std::vector<std::vector<std::int64_t>> random_shapes(int n) {
    const std::vector<std::vector<std::int64_t>> pool = {{0}, {1}, {3}, {7, 5}, {16}, {17}, {33, 3}, {65537},
                                                         {4, 0, 3}, {129, 31}, {1000}};
    std::vector<std::vector<std::int64_t>> shapes;
    for (int i = 0; i < n; ++i) shapes.push_back(pool[rng_() % pool.size()]);
    return shapes;
  }

  std::vector<torch::Tensor> make_params(const std::vector<std::vector<std::int64_t>>& shapes,
                                         torch::Dtype dtype = torch::kFloat) {
    std::vector<torch::Tensor> out;
    for (const auto& s : shapes)
      out.push_back(torch::randn(s, torch::TensorOptions().dtype(dtype).device(device_)).requires_grad_(true));
    return out;
  }

  static std::vector<torch::Tensor> copies(const std::vector<torch::Tensor>& params, torch::Dtype dtype) {
    std::vector<torch::Tensor> out;
    for (const auto& p : params) out.push_back(p.detach().to(dtype).clone().requires_grad_(true));
    return out;
  }

  std::unique_ptr<torch::optim::Optimizer> make_ours(const std::vector<std::vector<torch::Tensor>>& groups,
                                                     const std::vector<Hyper>& hypers, bool maximize = false) {
    const auto fused = ampfuse::FusedAdamOptions().maximize(maximize);
    if (GetParam().adamw) {
      std::vector<torch::optim::OptimizerParamGroup> g;
      for (std::size_t i = 0; i < groups.size(); ++i)
        g.emplace_back(groups[i], std::make_unique<torch::optim::AdamWOptions>(to_options<torch::optim::AdamWOptions>(hypers[i])));
      return std::make_unique<ampfuse::FusedAdamW>(g, torch::optim::AdamWOptions(), fused);
    }
    std::vector<torch::optim::OptimizerParamGroup> g;
    for (std::size_t i = 0; i < groups.size(); ++i)
      g.emplace_back(groups[i], std::make_unique<torch::optim::AdamOptions>(to_options<torch::optim::AdamOptions>(hypers[i])));
    return std::make_unique<ampfuse::FusedAdam>(g, torch::optim::AdamOptions(), fused);
  }

  std::unique_ptr<torch::optim::Optimizer> make_reference(const std::vector<std::vector<torch::Tensor>>& groups,
                                                          const std::vector<Hyper>& hypers) {
    if (GetParam().adamw) {
      std::vector<torch::optim::OptimizerParamGroup> g;
      for (std::size_t i = 0; i < groups.size(); ++i)
        g.emplace_back(groups[i], std::make_unique<torch::optim::AdamWOptions>(to_options<torch::optim::AdamWOptions>(hypers[i])));
      return std::make_unique<torch::optim::AdamW>(g);
    }
    std::vector<torch::optim::OptimizerParamGroup> g;
    for (std::size_t i = 0; i < groups.size(); ++i)
      g.emplace_back(groups[i], std::make_unique<torch::optim::AdamOptions>(to_options<torch::optim::AdamOptions>(hypers[i])));
    return std::make_unique<torch::optim::Adam>(g);
  }

  static void expect_close(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b, double rtol,
                           double atol, const std::string& what) {
    for (std::size_t i = 0; i < a.size(); ++i) {
      const auto x = a[i].detach().to(torch::kDouble).cpu(), y = b[i].detach().to(torch::kDouble).cpu();
      if (x.numel() == 0) continue;
      const auto excess = ((x - y).abs() - (atol + rtol * y.abs())).max().item<double>();
      EXPECT_LE(excess, 0.0) << what << ", tensor " << i << ": max |diff| " << (x - y).abs().max().item<double>();
    }
  }

};

// Against torch::optim in float64, the reference: after 100 steps ours is
// at least as accurate as torch::optim in fp32 (within twice its error, plus
// 1e-6). A direct fp32-to-fp32 comparison cannot have a fixed tolerance:
// two correct fp32 runs drift apart in proportion to how far the parameters
// travel (lr 1e-2 over 100 steps with amsgrad moved them 6e-6 apart, ours
// being the closer of the two to float64). An ill-conditioned element (at a
// first step, a weight decay nearly cancelling g: the rounding of g + wd * p
// decides the sign of lr * g / (|g| + eps)) may also differ by twice how far
// it moves between two float64 twins whose grads are multiplied by 1 +- 8
// fp32 ulps (ampfuse_test::expect_matches_over_hundred_steps says more).
TEST_P(FusedAdamTest, MatchesTorchOptimOverHundredSteps) {
  for (int round = 0; round < 3; ++round) {
    const int num_groups = 1 + static_cast<int>(rng_() % 3);
    std::vector<std::vector<torch::Tensor>> ours, ref32, ref64, twin[2];
    std::vector<Hyper> hypers;
    for (int g = 0; g < num_groups; ++g) {
      ours.push_back(make_params(random_shapes(1 + static_cast<int>(rng_() % 4))));
      ref32.push_back(copies(ours.back(), torch::kFloat));
      ref64.push_back(copies(ours.back(), torch::kDouble));
      for (auto& t : twin) t.push_back(copies(ours.back(), torch::kDouble));
      hypers.push_back(random_hyper(rng_));
    }
    const bool maximize = round == 2;
    auto opt = make_ours(ours, hypers, maximize);
    auto opt32 = make_reference(ref32, hypers);
    auto opt64 = make_reference(ref64, hypers);
    std::unique_ptr<torch::optim::Optimizer> twin_opt[2] = {make_reference(twin[0], hypers), make_reference(twin[1], hypers)};
    const double perturb[2] = {8 * ampfuse_test::ulp_of(torch::kFloat), -8 * ampfuse_test::ulp_of(torch::kFloat)};
    for (int step = 0; step < 100; ++step) {
      for (int g = 0; g < num_groups; ++g)
        for (std::size_t i = 0; i < ours[g].size(); ++i) {
          auto grad = torch::randn_like(ours[g][i]);
          ours[g][i].mutable_grad() = grad.clone();
          // LibTorch has no maximize: the references descend on -g.
          ref32[g][i].mutable_grad() = maximize ? -grad : grad.clone();
          ref64[g][i].mutable_grad() = (maximize ? -grad : grad).to(torch::kDouble);
          for (int t = 0; t < 2; ++t) twin[t][g][i].mutable_grad() = ref64[g][i].grad() * (1 + perturb[t]);
        }
      opt->step();
      opt32->step();
      opt64->step();
      for (auto& t : twin_opt) t->step();
    }
    SCOPED_TRACE("round " + std::to_string(round) + (maximize ? " (maximize)" : ""));
    for (int g = 0; g < num_groups; ++g) {
      const Hyper& h = hypers[g];
      for (std::size_t i = 0; i < ours[g].size(); ++i) {
        if (ours[g][i].numel() == 0) continue;
        const auto exact = ref64[g][i].detach();
        const auto ours_errors = (ours[g][i].detach().to(torch::kDouble) - exact).abs();
        const double ours_error = ours_errors.max().item<double>();
        const double fp32_error = (ref32[g][i].detach().to(torch::kDouble) - exact).abs().max().item<double>();
        const auto spread = (twin[0][g][i] - twin[1][g][i]).abs().detach();
        EXPECT_LE((ours_errors - 2 * spread).max().item<double>(), 1e-6 + 2 * fp32_error)
            << "group " << g << " (lr " << h.lr << ", betas " << h.beta1 << " " << h.beta2 << ", eps " << h.eps
            << ", weight_decay " << h.weight_decay << (h.amsgrad ? ", amsgrad" : "") << "), tensor " << i
            << ": max error against float64 " << ours_error << ", torch::optim in fp32 " << fp32_error;
      }
    }
  }
}

TEST_P(FusedAdamTest, LowPrecisionParamsTrackAnFp32Reference) {
  // fp16/bf16 parameters and state, fp32 math: within a few storage ulps of
  // an fp32 run after 20 steps. Grads between 0.5 and 1.5 in magnitude keep
  // exp_avg_sq (0.001 * g^2 at the first step) in fp16's normal range: a
  // smaller one (|g| below 0.0055, about twice per run with randn grads)
  // underflows to zero in fp16 state, and its element then takes a step of
  // lr * g / eps, far from the fp32 run, as LibTorch's fp16 state would.
  for (auto dtype : {torch::kHalf, torch::kBFloat16}) {
    SCOPED_TRACE(ampfuse_test::dtype_name(dtype));
    const Hyper h{1e-2, 0.9, 0.999, 1e-6, 0.0, false};
    auto low = make_params({{257}, {64, 3}}, dtype);
    auto ref = copies(low, torch::kFloat);
    auto opt = make_ours({low}, {h});
    auto ref_opt = make_reference({ref}, {h});
    for (int step = 0; step < 20; ++step) {
      for (std::size_t i = 0; i < low.size(); ++i) {
        auto grad = (torch::rand_like(ref[i]) + 0.5) * torch::randn_like(ref[i]).sign();
        low[i].mutable_grad() = grad.to(dtype);
        ref[i].mutable_grad() = grad.to(dtype).to(torch::kFloat);
      }
      opt->step();
      ref_opt->step();
    }
    // Each step rounds p to the storage type once (half an ulp); over 20
    // steps the error walks a few ulps: allow 6 ulps, relative.
    const double ulp = dtype == torch::kHalf ? std::ldexp(1.0, -10) : std::ldexp(1.0, -7);
    expect_close(low, ref, 6 * ulp, 6 * ulp, "vs fp32");
  }
}

TEST_P(FusedAdamTest, ScaledStepMatchesUnscaledAndSkipsBitwise) {
  const Hyper h = random_hyper(rng_);
  auto ours = make_params({{33, 5}, {0}, {1000}});
  auto ref = copies(ours, torch::kFloat);
  auto opt = make_ours({ours}, {h});
  auto ref_opt = make_reference({ref}, {h});
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(1024.0).growth_interval(1000));
  const float inf = std::numeric_limits<float>::infinity();
  for (int step = 0; step < 12; ++step) {
    // Steps 0 (the very first: no state yet) and 5 carry an inf.
    const bool poison = step == 0 || step == 5;
    for (std::size_t i = 0; i < ours.size(); ++i) {
      auto grad = torch::randn_like(ref[i]);
      ref[i].mutable_grad() = grad.clone();
      ours[i].mutable_grad() = grad * static_cast<float>(scaler.get_scale());
    }
    if (poison) ours[2].mutable_grad()[7] = inf;
    std::vector<torch::Tensor> params_before, grads_before;
    for (const auto& p : ours) {
      params_before.push_back(p.detach().clone());
      grads_before.push_back(p.grad().clone());
    }
    scaler.scale(torch::ones({}, torch::TensorOptions().device(device_)));
    scaler.step(*opt);
    scaler.update();
    for (std::size_t i = 0; i < ours.size(); ++i)
      EXPECT_TRUE(bitwise_equal(ours[i].grad(), grads_before[i])) << "step " << step << ": grad " << i << " written";
    EXPECT_EQ(scaler.last_step_skipped(*opt), poison);
    if (poison) {
      for (std::size_t i = 0; i < ours.size(); ++i)
        EXPECT_TRUE(bitwise_equal(ours[i].detach(), params_before[i])) << "step " << step << ": skipped step wrote";
      if (step == 0 && device_.is_cpu()) EXPECT_TRUE(opt->state().empty()) << "a skipped first step made state";
      continue;
    }
    ref_opt->step();
  }
  expect_close(ours, ref, 1e-5, 1e-6, "after 12 steps, 2 skipped");
  // Step counters advanced on the 10 applied steps only.
  if (auto* a = dynamic_cast<ampfuse::FusedAdam*>(opt.get())) a->sync_state();
  if (auto* a = dynamic_cast<ampfuse::FusedAdamW*>(opt.get())) a->sync_state();
  for (const auto& [key, st] : opt->state()) {
    const auto* s = dynamic_cast<const torch::optim::AdamParamState*>(st.get());
    const auto* sw = dynamic_cast<const torch::optim::AdamWParamState*>(st.get());
    EXPECT_EQ(s ? s->step() : sw->step(), 10);
  }
}

TEST_P(FusedAdamTest, ClipThroughTheScalerMatchesLibTorchClipping) {
  const Hyper h{1e-2, 0.9, 0.99, 1e-8, 0.0, false};
  auto ours = make_params({{100}, {7, 7}});
  auto ref = copies(ours, torch::kFloat);
  auto opt = make_ours({ours}, {h});
  auto ref_opt = make_reference({ref}, {h});
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(256.0));
  for (int step = 0; step < 5; ++step) {
    for (std::size_t i = 0; i < ours.size(); ++i) {
      auto grad = torch::randn_like(ref[i]) * 3;
      ref[i].mutable_grad() = grad.clone();
      ours[i].mutable_grad() = grad * 256.f;
    }
    scaler.scale(torch::ones({}, torch::TensorOptions().device(device_)));
    scaler.clip_grad_norm_(*opt, 1.0);
    scaler.step(*opt);
    scaler.update();
    torch::nn::utils::clip_grad_norm_(ref, 1.0);
    ref_opt->step();
  }
  expect_close(ours, ref, 1e-5, 1e-6, "clipped");
}

TEST_P(FusedAdamTest, HostLrChangeTakesEffect) {
  const Hyper h{1e-2, 0.9, 0.999, 1e-8, 0.0, false};
  auto ours = make_params({{50}});
  auto opt = make_ours({ours}, {h});
  ours[0].mutable_grad() = torch::randn_like(ours[0]);
  opt->step();
  const auto before = ours[0].detach().clone();
  opt->param_groups()[0].options().set_lr(0.0);  // what LibTorch's schedulers do
  ours[0].mutable_grad() = torch::randn_like(ours[0]);
  opt->step();
  EXPECT_TRUE(bitwise_equal(ours[0].detach(), before));
}

TEST_P(FusedAdamTest, CheckpointsInteroperateWithTorchOptimBothWays) {
  const Hyper h{3e-3, 0.8, 0.95, 1e-8, 0.01, true};
  for (bool ours_first : {true, false}) {
    SCOPED_TRACE(ours_first ? "FusedAdam -> torch::optim" : "torch::optim -> FusedAdam");
    auto a = make_params({{31}, {5, 5}});
    auto b = copies(a, torch::kFloat);
    auto first = ours_first ? make_ours({a}, {h}) : make_reference({a}, {h});
    std::vector<std::vector<torch::Tensor>> grads;
    for (int step = 0; step < 20; ++step) {
      std::vector<torch::Tensor> g;
      for (const auto& p : a) g.push_back(torch::randn_like(p));
      grads.push_back(g);
    }
    auto run = [&](torch::optim::Optimizer& opt, std::vector<torch::Tensor>& params, int from, int to) {
      for (int step = from; step < to; ++step) {
        for (std::size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grads[step][i].clone();
        opt.step();
      }
    };
    run(*first, a, 0, 10);
    const std::string file = ampfuse_test::temp_path("adam_interop.pt");
    torch::save(*first, file);
    // Copy the parameters at the cut, then finish both runs.
    for (std::size_t i = 0; i < a.size(); ++i) {
      torch::NoGradGuard no_grad;
      b[i].copy_(a[i]);
    }
    auto second = ours_first ? make_reference({b}, {h}) : make_ours({b}, {h});
    torch::load(*second, file);
    run(*first, a, 10, 20);
    run(*second, b, 10, 20);
    expect_close(b, a, 1e-5, 1e-6, "continued after the checkpoint");
    std::remove(file.c_str());
  }
}

TEST_P(FusedAdamTest, BadInputNamesGroupAndParamAndChangesNothing) {
  const Hyper h{1e-2, 0.9, 0.999, 1e-8, 0.0, false};
  auto expect_refused = [&](std::vector<std::vector<torch::Tensor>> groups, const std::string& message) {
    std::vector<torch::Tensor> before;
    for (auto& g : groups)
      for (auto& p : g) before.push_back(p.detach().clone());
    std::unique_ptr<torch::optim::Optimizer> opt;
    try {
      opt = make_ours(groups, std::vector<Hyper>(groups.size(), h));
      opt->step();
      ADD_FAILURE() << "accepted: " << message;
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr(message));
    }
    std::size_t k = 0;
    for (auto& g : groups)
      for (auto& p : g) EXPECT_TRUE(bitwise_equal(p.detach(), before[k++])) << message;
    if (opt) EXPECT_TRUE(opt->state().empty()) << message;
  };
  const char* name = GetParam().adamw ? "FusedAdamW" : "FusedAdam";
  auto good = [&] {
    auto p = make_params({{6}})[0];
    p.mutable_grad() = torch::randn_like(p);
    return p;
  };
  {
    auto p = make_params({{6}})[0];
    p.mutable_grad() = torch::randn({6}, torch::TensorOptions().dtype(torch::kHalf).device(device_));
    expect_refused({{good()}, {good(), p}}, std::string(name) + ": param group 1, param 1: grad dtype Half differs");
  }
  {
    auto p = make_params({{6}})[0];
    p.mutable_grad() = torch::randn({3, 2}, torch::TensorOptions().device(device_));
    expect_refused({{good(), p}}, "param group 0, param 1: grad shape [3, 2] differs");
  }
  {
    auto p = make_params({{6}})[0];
    p.mutable_grad() = torch::empty({6}, torch::TensorOptions().device(torch::kMeta));
    expect_refused({{p}}, "param group 0, param 0: grad is on meta");
  }
  {
    auto p = make_params({{4, 4}})[0];
    p.mutable_grad() = torch::randn({4, 4}).to_sparse().to(device_);
    expect_refused({{good(), p}}, "param group 0, param 1: the grad is sparse");
  }
  {
    auto p = torch::randn({4}, torch::TensorOptions().dtype(torch::kComplexFloat).device(device_)).requires_grad_();
    p.mutable_grad() = torch::randn_like(p);
    expect_refused({{good(), p}}, "param group 0, param 1: dtype ComplexFloat is not supported");
  }
  {
    auto p = torch::ones({4}, torch::TensorOptions().dtype(torch::kInt).device(device_));
    expect_refused({{good()}, {p}}, "param group 1, param 0: dtype Int is not supported");
  }
  {
    auto p = good();
    expect_refused({{good(), p}, {p}}, "param group 1, param 0 is also param 1 of group 0");
    expect_refused({{p, good(), p}},
                   "param group 0, param 2 is also param 0 of group 0; a parameter is listed once (twice, a step");
  }
  // Thousands of parameters are checked on several threads: still the first
  // bad parameter in group order is named, whichever thread saw it.
  {
    std::vector<torch::Tensor> first, second;
    for (int i = 0; i < 1500; ++i) first.push_back(good());
    for (int i = 0; i < 1500; ++i) second.push_back(good());
    auto bad_grad = [&] {
      auto p = make_params({{6}})[0];
      p.mutable_grad() = torch::randn({6}, torch::TensorOptions().dtype(torch::kHalf).device(device_));
      return p;
    };
    // 3,000 parameters on two threads: group 0 on one, group 1 on the other.
    // The later parameter's thread meets its error first.
    second[1300] = bad_grad();
    first[100] = bad_grad();
    expect_refused({first, second}, std::string(name) + ": param group 0, param 100: grad dtype Half differs");
    first[100] = good();
    second[1300] = good();
    second[1200] = bad_grad();
    second[900] = first[5];
    expect_refused({first, second}, "param group 1, param 900 is also param 5 of group 0");
    second[100] = bad_grad();
    expect_refused({first, second}, "param group 1, param 100: grad dtype Half differs");
  }
}

INSTANTIATE_TEST_SUITE_P(All, FusedAdamTest, ::testing::ValuesIn(adam_cases()), adam_case_name);

// ATen's fused kernels on CPU, with and without grad_scale / found_inf.
TEST(FusedAdamAten, MatchesAtenFusedAdamOnCpu) {
  const auto seed = ampfuse_test::seed_for_test();
  for (bool adamw : {false, true}) {
    for (bool scaled : {false, true}) {
      SCOPED_TRACE(std::string(adamw ? "adamw" : "adam") + (scaled ? ", grad_scale" : ""));
      torch::manual_seed(seed);
      const double lr = 2e-3, b1 = 0.85, b2 = 0.98, wd = 0.05, eps = 1e-7;
      std::vector<torch::Tensor> p = {torch::randn({129}).requires_grad_(), torch::randn({17, 3}).requires_grad_()};
      std::vector<torch::Tensor> q, m, v, vmax, steps;
      for (auto& t : p) {
        q.push_back(t.detach().clone());
        m.push_back(torch::zeros_like(t));
        v.push_back(torch::zeros_like(t));
        vmax.push_back(torch::zeros_like(t));
        steps.push_back(torch::zeros({}));
      }
      std::unique_ptr<torch::optim::Optimizer> opt;
      auto fused = ampfuse::FusedAdamOptions();
      if (adamw)
        opt = std::make_unique<ampfuse::FusedAdamW>(p, torch::optim::AdamWOptions(lr).betas({b1, b2}).eps(eps).weight_decay(wd).amsgrad(true), fused);
      else
        opt = std::make_unique<ampfuse::FusedAdam>(p, torch::optim::AdamOptions(lr).betas({b1, b2}).eps(eps).weight_decay(wd).amsgrad(true), fused);
      auto* aware = dynamic_cast<ampfuse::ScalerAware*>(opt.get());
      const float scale = 512.f;
      for (int step = 0; step < 30; ++step) {
        const bool skip = scaled && step % 7 == 3;
        std::vector<torch::Tensor> grads;
        for (auto& t : p) grads.push_back(torch::randn_like(t) * (scaled ? scale : 1.f));
        for (std::size_t i = 0; i < p.size(); ++i) p[i].mutable_grad() = grads[i].clone();
        auto found = torch::full({}, skip ? 1.f : 0.f);
        if (scaled) {
          ampfuse_test::step_with_cpu_signal(*aware, 1.f / scale, found);
        } else {
          opt->step();
        }
        // PyTorch's _fused_adam: steps are incremented by the caller, and
        // decremented again when found_inf says the step was skipped.
        for (auto& s : steps) s.add_(1);
        c10::optional<at::Tensor> gs, fi;
        if (scaled) {
          gs = torch::full({}, scale);
          fi = found;
        }
        if (adamw)
          at::_fused_adamw_(q, grads, m, v, vmax, steps, lr, b1, b2, wd, eps, true, false, gs, fi);
        else
          at::_fused_adam_(q, grads, m, v, vmax, steps, lr, b1, b2, wd, eps, true, false, gs, fi);
        if (skip)
          for (auto& s : steps) s.sub_(1);
      }
      for (std::size_t i = 0; i < p.size(); ++i) {
        const auto diff = (p[i].detach() - q[i]).abs().max().item<float>();
        EXPECT_LE(diff, 1e-5 * q[i].abs().max().item<float>()) << "tensor " << i;
      }
    }
  }
}

}  // namespace

namespace {

// A skip right after a checkpoint reload writes nothing either.
TEST(FusedAdamCheckpoint, SkipAfterReloadIsBitIdentical) {
  const auto seed = ampfuse_test::seed_for_test();
  torch::manual_seed(seed);
  std::vector<torch::Tensor> p = {torch::randn({40}).requires_grad_(), torch::randn({3, 5}).requires_grad_()};
  ampfuse::FusedAdam first(p, torch::optim::AdamOptions(1e-2).amsgrad(true));
  for (int step = 0; step < 5; ++step) {
    for (auto& t : p) t.mutable_grad() = torch::randn_like(t);
    first.step();
  }
  const std::string file = ampfuse_test::temp_path("reload_skip.pt");
  torch::save(first, file);
  ampfuse::FusedAdam reloaded(p, torch::optim::AdamOptions(1e-2).amsgrad(true));
  torch::load(reloaded, file);
  std::remove(file.c_str());

  std::vector<torch::Tensor> params_before, state_before;
  for (auto& t : p) {
    t.mutable_grad() = torch::randn_like(t);
    params_before.push_back(t.detach().clone());
    const auto& st = static_cast<const torch::optim::AdamParamState&>(*reloaded.state().at(t.unsafeGetTensorImpl()));
    state_before.push_back(torch::cat({st.exp_avg().view(-1), st.exp_avg_sq().view(-1), st.max_exp_avg_sq().view(-1)}));
  }
  p[1].mutable_grad()[1][2] = std::numeric_limits<float>::infinity();
  ampfuse::StepSignals signals;
  signals.set(torch::kCPU, {torch::ones({}), torch::full({}, 1.f), {}});
  reloaded.step_with_signals(signals);
  for (std::size_t i = 0; i < p.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(p[i].detach(), params_before[i]));
    const auto& st = static_cast<const torch::optim::AdamParamState&>(*reloaded.state().at(p[i].unsafeGetTensorImpl()));
    EXPECT_TRUE(bitwise_equal(torch::cat({st.exp_avg().view(-1), st.exp_avg_sq().view(-1), st.max_exp_avg_sq().view(-1)}),
                              state_before[i]));
    EXPECT_EQ(st.step(), 5);
  }
}

}  // namespace

namespace {

// One group holding fp32, fp16 and bf16 parameters runs one list per dtype;
// each must match the same parameters stepped alone.
TEST(FusedAdamMixed, DtypesInOneGroupMatchSeparateRuns) {
  const auto seed = ampfuse_test::seed_for_test();
  torch::manual_seed(seed);
  const auto o = torch::optim::AdamOptions(1e-2).weight_decay(1e-3);
  std::vector<torch::Tensor> mixed = {torch::randn({33}).requires_grad_(),
                                      torch::randn({17}).to(torch::kHalf).requires_grad_(),
                                      torch::randn({65}).to(torch::kBFloat16).requires_grad_()};
  std::vector<torch::Tensor> alone;
  for (const auto& p : mixed) alone.push_back(p.detach().clone().requires_grad_());
  ampfuse::FusedAdam together(mixed, o);
  std::vector<std::unique_ptr<ampfuse::FusedAdam>> separate;
  for (auto& p : alone) separate.push_back(std::make_unique<ampfuse::FusedAdam>(std::vector<torch::Tensor>{p}, o));
  for (int step = 0; step < 10; ++step) {
    for (std::size_t i = 0; i < mixed.size(); ++i) {
      auto g = torch::randn_like(mixed[i]);
      mixed[i].mutable_grad() = g;
      alone[i].mutable_grad() = g.clone();
      separate[i]->step();
    }
    together.step();
  }
  for (std::size_t i = 0; i < mixed.size(); ++i) EXPECT_TRUE(bitwise_equal(mixed[i].detach(), alone[i].detach())) << i;
}

}  // namespace

namespace {

// master_weights: fp16/bf16 parameters updated through an fp32 master copy
// with fp32 moments: the master tracks an all-fp32 torch::optim::Adam run (the
// grads being the same low-precision values), and the parameter is the
// master rounded.
// On CPU and CUDA (the reference runs on the CPU).
class FusedAdamMasterTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { AMPFUSE_SKIP_WITHOUT(device_); }
  const torch::Device device_{GetParam()};
};

INSTANTIATE_TEST_SUITE_P(All, FusedAdamMasterTest, ::testing::Values("cpu", "cuda"),
                         [](const auto& info) { return info.param; });

TEST_P(FusedAdamMasterTest, MasterWeightsTrackAnFp32Run) {
  const auto seed = ampfuse_test::seed_for_test();
  for (auto dtype : {torch::kHalf, torch::kBFloat16}) {
    SCOPED_TRACE(ampfuse_test::dtype_name(dtype));
    torch::manual_seed(seed);
    auto ref = std::vector<torch::Tensor>{torch::randn({257}).requires_grad_(), torch::randn({9, 7}).requires_grad_()};
    std::vector<torch::Tensor> low;
    for (auto& r : ref) {
      {
        torch::NoGradGuard no_grad;
        r.copy_(r.to(dtype).to(torch::kFloat));  // start from representable values
      }
      low.push_back(r.detach().to(device_, dtype).requires_grad_());
    }
    std::vector<torch::Tensor> initial;
    for (const auto& t : low) initial.push_back(t.detach().cpu().to(torch::kFloat));
    const auto o = torch::optim::AdamOptions(1e-3).weight_decay(1e-2);
    ampfuse::FusedAdam opt(low, o, ampfuse::FusedAdamOptions().master_weights(true));
    torch::optim::Adam ref_opt(ref, o);
    for (int step = 0; step < 30; ++step) {
      for (std::size_t i = 0; i < low.size(); ++i) {
        auto g = torch::randn_like(ref[i]).to(dtype);
        low[i].mutable_grad() = g.to(device_);
        ref[i].mutable_grad() = g.to(torch::kFloat);
      }
      opt.step();
      ref_opt.step();
      for (std::size_t i = 0; i < low.size(); ++i)  // grads are read, never written
        ASSERT_TRUE(bitwise_equal(low[i].grad(), ref[i].grad().to(dtype))) << "step " << step << ", grad " << i;
    }
    for (std::size_t i = 0; i < low.size(); ++i) {
      // The parameter is the fp32 result rounded once (small updates are not
      // lost to rounding): within one unit in the last place of each element
      // (ties may round either way after fp32 sums that differ in the last bit).
      const auto expected = ref[i].detach().to(dtype).to(torch::kFloat);
      const int mantissa = dtype == torch::kHalf ? 10 : 7;
      const auto ulp = torch::exp2(torch::floor(torch::log2(expected.abs().clamp_min(1e-4))) - mantissa);
      const auto err = (low[i].detach().cpu().to(torch::kFloat) - expected).abs();
      EXPECT_TRUE((err <= ulp).all().item<bool>())
          << "param " << i << ": " << (err > ulp).sum().item<std::int64_t>() << " elements off by more than 1 ulp";
      EXPECT_GT((low[i].detach().cpu().to(torch::kFloat) - initial[i]).abs().max().item<float>(), 0.f)
          << "param " << i << " never moved";
      const auto& st = static_cast<const torch::optim::AdamParamState&>(*opt.state().at(low[i].unsafeGetTensorImpl()));
      EXPECT_EQ(st.exp_avg().scalar_type(), torch::kFloat);
    }
  }
}

TEST(FusedAdamMaster, CheckpointKeepsTheMasterAndRefusesFp32) {
  const auto seed = ampfuse_test::seed_for_test();
  torch::manual_seed(seed);
  std::vector<torch::Tensor> a = {torch::randn({100}).to(torch::kBFloat16).requires_grad_()};
  std::vector<torch::Tensor> b = {a[0].detach().clone().requires_grad_()};
  const auto fused = ampfuse::FusedAdamOptions().master_weights(true);
  ampfuse::FusedAdam first(a, torch::optim::AdamOptions(1e-3), fused);
  std::vector<torch::Tensor> grads;
  for (int s = 0; s < 10; ++s) grads.push_back(torch::randn({100}).to(torch::kBFloat16));
  for (int s = 0; s < 5; ++s) {
    a[0].mutable_grad() = grads[s];
    first.step();
  }
  const std::string file = ampfuse_test::temp_path("master.pt");
  torch::save(first, file);
  {
    torch::NoGradGuard no_grad;
    b[0].copy_(a[0]);
  }
  ampfuse::FusedAdam second(b, torch::optim::AdamOptions(1e-3), fused);
  torch::load(second, file);
  // Without master_weights the master is dropped: it would be neither stepped nor refreshed, and saved stale.
  std::vector<torch::Tensor> c = {a[0].detach().clone().requires_grad_()};
  ampfuse::FusedAdam without(c, torch::optim::AdamOptions(1e-3));
  torch::load(without, file);
  EXPECT_FALSE(static_cast<ampfuse::FusedAdamParamState&>(*without.state().at(c[0].unsafeGetTensorImpl()))
                   .master()
                   .defined());
  std::remove(file.c_str());
  for (int s = 5; s < 10; ++s) {
    a[0].mutable_grad() = grads[s];
    b[0].mutable_grad() = grads[s].clone();
    first.step();
    second.step();
  }
  EXPECT_TRUE(bitwise_equal(a[0].detach(), b[0].detach())) << "the master copy did not survive the checkpoint";

  std::vector<torch::Tensor> f32 = {torch::randn({4}).requires_grad_()};
  f32[0].mutable_grad() = torch::randn({4});
  ampfuse::FusedAdam bad(f32, torch::optim::AdamOptions(1e-3), fused);
  try {
    bad.step();
    ADD_FAILURE() << "master_weights accepted on a Float parameter";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("param group 0, param 0: master_weights asked for on a Float parameter"));
  }
  EXPECT_TRUE(bad.state().empty());
}

// A torch::optim::AdamW checkpoint of bf16 parameters keeps bf16 moments;
// loaded with master_weights (fp32 moments) they are converted, as
// torch::optim steps moments of any dtype, and a checkpoint of those fp32
// moments loads back into torch::optim::AdamW. Both were refused.
TEST(FusedAdamMaster, LibTorchCheckpointsOfBf16ParametersLoadBothWays) {
  const auto seed = ampfuse_test::seed_for_test();
  torch::manual_seed(seed);
  torch::Tensor a = torch::randn({100}).to(torch::kBFloat16).requires_grad_();
  torch::optim::AdamW ref({a}, torch::optim::AdamWOptions(1e-3));
  for (int s = 0; s < 3; ++s) {
    a.mutable_grad() = torch::randn({100}).to(torch::kBFloat16);
    ref.step();
  }
  std::stringstream file;
  torch::save(ref, file);
  torch::Tensor b = a.detach().clone().requires_grad_();
  ampfuse::FusedAdamW fused({b}, torch::optim::AdamWOptions(1e-3), ampfuse::FusedAdamOptions().master_weights(true));
  torch::load(fused, file);
  const auto& want = static_cast<const torch::optim::AdamWParamState&>(*ref.state().at(a.unsafeGetTensorImpl()));
  const auto& got = static_cast<const torch::optim::AdamWParamState&>(*fused.state().at(b.unsafeGetTensorImpl()));
  EXPECT_EQ(got.exp_avg().scalar_type(), torch::kFloat);
  EXPECT_TRUE(bitwise_equal(got.exp_avg(), want.exp_avg().to(torch::kFloat)));
  EXPECT_TRUE(bitwise_equal(got.exp_avg_sq(), want.exp_avg_sq().to(torch::kFloat)));
  b.mutable_grad() = torch::randn({100}).to(torch::kBFloat16);
  fused.step();
  std::stringstream back;
  torch::save(fused, back);
  torch::Tensor c = b.detach().clone().requires_grad_();
  torch::optim::AdamW again({c}, torch::optim::AdamWOptions(1e-3));
  torch::load(again, back);
  c.mutable_grad() = torch::randn({100}).to(torch::kBFloat16);
  again.step();
  EXPECT_TRUE(torch::isfinite(c.detach().to(torch::kFloat)).all().item<bool>());
}

TEST_P(FusedAdamMasterTest, Bf16MomentsStayCloseToFp32) {
  const auto seed = ampfuse_test::seed_for_test();
  torch::manual_seed(seed);
  // a: bf16 moments, f: fp32 moments, both on the device; r: torch::optim::Adam on the CPU.
  std::vector<torch::Tensor> r = {torch::randn({513}).requires_grad_()};
  const auto copy = [&] { return r[0].detach().to(device_, /*non_blocking=*/false, /*copy=*/true).requires_grad_(); };
  std::vector<torch::Tensor> a = {copy()}, f = {copy()};
  const auto o = torch::optim::AdamOptions(1e-3);
  ampfuse::FusedAdam opt(a, o, ampfuse::FusedAdamOptions().bf16_moments(true));
  ampfuse::FusedAdam fp32(f, o);
  torch::optim::Adam ref(r, o);
  for (int s = 0; s < 50; ++s) {
    auto g = torch::randn({513});
    a[0].mutable_grad() = g.to(device_);
    f[0].mutable_grad() = g.to(device_);
    r[0].mutable_grad() = g.clone();
    opt.step();
    fp32.step();
    ref.step();
  }
  const auto& st = static_cast<const torch::optim::AdamParamState&>(*opt.state().at(a[0].unsafeGetTensorImpl()));
  EXPECT_EQ(st.exp_avg().scalar_type(), torch::kBFloat16);
  EXPECT_EQ(st.exp_avg_sq().scalar_type(), torch::kBFloat16);
  // Each step moves a parameter by about lr; bf16 moments (8 bits of
  // mantissa) change a step by a few percent: after 50 steps, well under 0.1 lr * steps.
  const auto diff = (a[0].detach().cpu() - r[0].detach()).abs().max().item<float>();
  EXPECT_LE(diff, 0.1f * 1e-3f * 50);
  EXPECT_GT((a[0].detach() - f[0].detach()).abs().max().item<float>(), 1e-6f)
      << "bf16 moments not in use (same result as fp32 moments on the same device)";
}

// capturable: a step captured in a CUDA graph is one kernel per group and
// dtype, and its replays equal eager steps bit for bit, also after the lr
// changes (through the device lr for the graph, the host lr for eager).
TEST(FusedAdamCapturable, GraphReplayMatchesEagerWithOneLaunchPerGroupAndDtype) {
#if !defined(AMPFUSE_WITH_CUDA)
  GTEST_SKIP() << "built without CUDA";
#else
  if (!ampfuse_test::cuda_available()) GTEST_SKIP() << "no CUDA device here; this test runs on a GPU machine";
  ampfuse_test::seed_for_test();
  const auto f32 = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat);
  // Group 0: two fp32 tensors; group 1: fp32 and bf16 (two dtypes): 3 lists.
  std::vector<torch::Tensor> start = {torch::randn({1000}, f32), torch::randn({65537}, f32), torch::randn({33}, f32),
                                      torch::randn({77}, f32).to(torch::kBFloat16)};
  auto make = [&](std::vector<torch::Tensor>& ps, bool capturable) {
    for (const auto& t : start) ps.push_back(t.clone());
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<torch::Tensor>{ps[0], ps[1]});
    groups.emplace_back(std::vector<torch::Tensor>{ps[2], ps[3]});
    return std::make_unique<ampfuse::FusedAdamW>(groups, torch::optim::AdamWOptions(1e-2).weight_decay(0.1),
                                                 ampfuse::FusedAdamOptions().capturable(capturable));
  };
  // a: capturable, eager; b: capturable, replayed from a graph; c: not capturable, eager.
  std::vector<torch::Tensor> a, b, c;
  auto eager = make(a, true), graphed = make(b, true), plain = make(c, false);
  auto set_grads = [&] {
    for (std::size_t i = 0; i < a.size(); ++i) {
      const auto g = torch::randn(a[i].sizes(), f32).to(a[i].scalar_type());
      a[i].mutable_grad() = g.clone();
      c[i].mutable_grad() = g.clone();
      if (!b[i].grad().defined()) b[i].mutable_grad() = g.clone();
      else b[i].mutable_grad().copy_(g);  // the graph reads the grads' storage it captured
    }
  };
  set_grads();
  eager->step();
  plain->step();
  graphed->step();  // warm-up: state, device lr and metadata exist before capture
  auto [graph, kernels] = ampfuse_test::capture([&] { graphed->step(); });
  EXPECT_EQ(kernels, 3u) << "one launch per (group, dtype) list";
  std::cout << "[ launches ] FusedAdamW capturable, 2 groups, 3 (group, dtype) lists: " << kernels
            << " kernel nodes per step\n";
  eager->step();  // capture does not run the step; a replay does
  plain->step();
  graph->replay();
  for (int s = 0; s < 5; ++s) {
    set_grads();
    const double lr = 1e-2 / (s + 2);  // not exact in fp32: the device lr is fp64
    for (auto* opt : {eager.get(), plain.get()})
      for (auto& group : opt->param_groups()) group.options().set_lr(lr);
    for (std::size_t g = 0; g < 2; ++g) graphed->lr_tensor(g).fill_(lr);
    eager->step();
    plain->step();
    graph->replay();
  }
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(ampfuse_test::bitwise_equal(a[i], b[i])) << "param " << i << ": eager vs graph replay";
    EXPECT_TRUE(ampfuse_test::bitwise_equal(a[i], c[i])) << "param " << i << ": capturable vs not";
  }
#endif
}

// After load(), the device step counters are made again from the loaded
// state at the next step: inside a CUDA graph capture that is refused with a
// clear error (a counter made in the graph would restart at every replay),
// the failed capture leaves the stream usable, and after one eager step the
// capture works.
TEST(FusedAdamCapturable, CaptureRightAfterLoadAsksForAWarmUpStep) {
#if !defined(AMPFUSE_WITH_CUDA)
  GTEST_SKIP() << "built without CUDA";
#else
  if (!ampfuse_test::cuda_available()) GTEST_SKIP() << "no CUDA device here; this test runs on a GPU machine";
  const auto seed = ampfuse_test::seed_for_test();
  torch::manual_seed(seed);
  const auto f32 = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat);
  std::vector<torch::Tensor> p = {torch::randn({1000}, f32), torch::randn({7, 3}, f32)};
  for (auto& t : p) t.mutable_grad() = torch::randn_like(t);
  ampfuse::FusedAdam opt(p, torch::optim::AdamOptions(1e-3), ampfuse::FusedAdamOptions().capturable(true));
  opt.step();
  const std::string file = ampfuse_test::temp_path("capture_after_load.pt");
  torch::save(opt, file);
  torch::load(opt, file);
  std::remove(file.c_str());
  try {
    ampfuse_test::capture([&] { opt.step(); });
    ADD_FAILURE() << "a capture right after load() was accepted";
  } catch (const c10::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("param group 0, param 0"), std::string::npos) << what;
    EXPECT_NE(what.find("warm-up step"), std::string::npos) << what;
  }
  opt.step();  // eager: the counters are made here
  auto [graph, kernels] = ampfuse_test::capture([&] { opt.step(); });
  EXPECT_EQ(kernels, 1u);
#endif
}

}  // namespace
