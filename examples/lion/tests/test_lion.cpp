// FusedLion's tests:
//  - the scaler contract, with ampfuse's conformance checker (CPU: fp32, fp16,
//    bf16; CUDA: the same, skipped without a device);
//  - bitwise agreement with a mirror of the update written with fp32 ATen ops
//    (every dtype, every instruction-set build of the CPU kernel);
//  - a float64 reference over 50 steps, within a bound derived below;
//  - checkpoints, LR schedulers, GradScaler end to end, bad input.
// Every randomized test prints its seed; replay with LION_TEST_SEED=<seed>.

#include <ampfuse/grad_scaler.h>
#include <ampfuse/tensor_ops.h>  // ampfuse::to_scalar_type
#include <ampfuse/testing/conformance.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "lion.h"
#include "lion_cpu.h"

namespace {

using lion::FusedLion;
using lion::LionHyper;
using lion::LionOptions;
using lion::LionParamState;

// ------------------------------------------------------------------ helpers

/// A fresh seed per test (or LION_TEST_SEED), printed so that a failure replays.
std::uint64_t seed_for_test() {
  std::uint64_t seed;
  if (const char* env = std::getenv("LION_TEST_SEED")) {
    seed = std::strtoull(env, nullptr, 10);
  } else {
    seed = (static_cast<std::uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
  }
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::cout << "[ seed     ] " << info->test_suite_name() << "." << info->name() << ": " << seed
            << "  (replay: LION_TEST_SEED=" << seed << ")\n";
  ::testing::Test::RecordProperty("seed", std::to_string(seed));
  torch::manual_seed(seed);
  return seed;
}

std::string joined(const std::vector<std::string>& lines) {
  std::string out;
  for (const auto& l : lines) out += "\n  " + l;
  return out;
}

/// Bitwise equality (NaNs by position), with the first difference on failure.
::testing::AssertionResult bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type())
    return ::testing::AssertionFailure() << a.sizes() << " " << a.scalar_type() << " vs " << b.sizes() << " "
                                         << b.scalar_type();
  const at::Tensor x = a.detach().cpu().contiguous().reshape(-1), y = b.detach().cpu().contiguous().reshape(-1);
  const auto bits = x.element_size() == 4 ? at::kInt : at::kShort;
  const at::Tensor differ = x.view(bits).ne(y.view(bits)).logical_and(x.isnan().logical_and(y.isnan()).logical_not());
  const std::int64_t n = differ.sum().item<std::int64_t>();
  if (n == 0) return ::testing::AssertionSuccess();
  const std::int64_t i = differ.nonzero()[0][0].item<std::int64_t>();
  return ::testing::AssertionFailure() << n << " of " << x.numel() << " elements differ, first at " << i << " ("
                                       << x[i].item<double>() << " vs " << y[i].item<double>() << ")";
}

const at::Tensor& exp_avg_of(FusedLion& opt, const at::Tensor& p) {
  return static_cast<LionParamState&>(*opt.state().at(p.unsafeGetTensorImpl())).exp_avg();
}

/// Shapes with the edge cases (empty, one element, odd sizes, one past a
/// 64Ki-element chunk) and a few random ones.
std::vector<std::vector<std::int64_t>> random_shapes(std::mt19937_64& rng) {
  std::vector<std::vector<std::int64_t>> shapes = {{0}, {1}, {7, 3}, {65537}, {33, 17}};
  std::uniform_int_distribution<std::int64_t> dim(1, 301);
  for (int i = 0; i < 3; ++i) shapes.push_back({dim(rng), dim(rng) | 1});
  return shapes;
}

LionOptions random_options(std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(0, 1);
  LionOptions o(std::pow(10.0, -5 + 3 * u(rng)));  // lr in [1e-5, 1e-2]
  o.betas({0.8 + 0.19 * u(rng), 0.9 + 0.099 * u(rng)});
  o.weight_decay(u(rng) < 0.25 ? 0.0 : 0.5 * u(rng));
  return o;
}

LionHyper hyper_of(const LionOptions& o) {
  return lion::make_lion_hyper(o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.weight_decay());
}

std::string describe(const LionOptions& o) {
  std::ostringstream os;
  os.precision(17);
  os << "lr " << o.lr() << ", betas (" << std::get<0>(o.betas()) << ", " << std::get<1>(o.betas())
     << "), weight_decay " << o.weight_decay();
  return os.str();
}

/// Normal grads with a random magnitude per tensor (1e-3 to 10), in p's dtype and on its device.
at::Tensor random_grad(const at::Tensor& p, std::mt19937_64& rng) {
  const double scale = std::pow(10.0, std::uniform_real_distribution<double>(-3, 1)(rng));
  return torch::randn(p.sizes()).mul(scale).to(p.options().requires_grad(false));
}

/// The update with ATen ops in fp32, rounded to the storage dtype after each
/// step, with the kernels' fp32 constants and order of operations: what the
/// kernels must match bit for bit.
void mirror_step(at::Tensor& p, at::Tensor& m, const at::Tensor& g, const LionHyper& h, float grad_factor = 1) {
  at::Tensor pf = p.detach().to(at::kFloat), mf = m.to(at::kFloat), gf = g.to(at::kFloat).mul(grad_factor);
  const at::Tensor c = mf.mul(h.beta1).add(gf.mul(h.one_minus_beta1));
  pf = pf.mul(h.decay).sub(c.sign().mul(h.lr));
  mf = mf.mul(h.beta2).add(gf.mul(h.one_minus_beta2));
  p = pf.to(p.scalar_type());
  m = mf.to(m.scalar_type());
}

// --------------------------------------------------------- scaler contract

class Contract : public ::testing::TestWithParam<std::string> {};

TEST_P(Contract, Conforms) {
  const torch::Device device(GetParam());
  if (device.is_cuda() && !torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device here";
  ampfuse::testing::ConformanceOptions o;
  o.device = device;
  o.dtypes = {torch::kFloat, torch::kHalf, torch::kBFloat16};
  o.seed = seed_for_test();
  // Defaults, and a large lr with weight decay so that every step shows in bf16 params too.
  for (const LionOptions& options : {LionOptions(), LionOptions(3e-2).weight_decay(0.1).betas({0.8, 0.95})}) {
    const auto failures = ampfuse::testing::check_contract(
        [&](std::vector<torch::Tensor> p) { return std::make_unique<FusedLion>(std::move(p), options); }, o);
    EXPECT_TRUE(failures.empty()) << describe(options) << joined(failures);
  }
}

INSTANTIATE_TEST_SUITE_P(Lion, Contract, ::testing::Values("cpu", "cuda"), [](const auto& i) { return i.param; });

// ------------------------------------------------------ bitwise vs mirror

class MirrorTest : public ::testing::TestWithParam<torch::Dtype> {};

// Two groups with their own random hyperparameters, 50 steps: params and
// exp_avg equal the fp32 mirror bit for bit after every step.
TEST_P(MirrorTest, FusedLionMatchesTheFp32MirrorBitwise) {
  const torch::Dtype dtype = GetParam();
  std::mt19937_64 rng(seed_for_test());
  const auto shapes = random_shapes(rng);
  std::vector<LionOptions> options = {random_options(rng), random_options(rng)};
  std::vector<std::vector<at::Tensor>> params(2);
  std::vector<at::Tensor> ref_p, ref_m;
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    params[i % 2].push_back(torch::randn(shapes[i]).to(dtype).requires_grad_());
    ref_p.push_back(params[i % 2].back().detach().clone());
    ref_m.push_back(torch::zeros(shapes[i], dtype));
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (int k = 0; k < 2; ++k) groups.emplace_back(params[k], std::make_unique<LionOptions>(options[k]));
  FusedLion opt(groups, LionOptions(0.5));  // defaults that no group uses
  SCOPED_TRACE("group 0: " + describe(options[0]) + "; group 1: " + describe(options[1]));

  for (int step = 1; step <= 50; ++step) {
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      at::Tensor& p = params[i % 2][i / 2];
      p.mutable_grad() = random_grad(p, rng);
      mirror_step(ref_p[i], ref_m[i], p.grad(), hyper_of(options[i % 2]));
    }
    opt.step();
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      const at::Tensor& p = params[i % 2][i / 2];
      ASSERT_TRUE(bitwise_equal(p, ref_p[i])) << "param " << i << " after step " << step;
      ASSERT_TRUE(bitwise_equal(exp_avg_of(opt, p), ref_m[i])) << "exp_avg " << i << " after step " << step;
    }
  }
}

// The three builds of the CPU kernel (what pick_isa chooses from), called
// directly, each on the instruction sets this CPU has, with a grad factor.
TEST_P(MirrorTest, EveryInstructionSetBuildMatchesTheMirror) {
  const torch::Dtype dtype = GetParam();
  std::mt19937_64 rng(seed_for_test());
  struct Isa {
    const char* name;
    lion::cpu::LionFn fn;
    bool supported;
  };
#if defined(__x86_64__)
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  const bool avx512 = true, avx2 = true;  // all three are baseline builds off x86-64
#endif
  const Isa isas[] = {{"avx512", lion::cpu::avx512::kLion, avx512},
                      {"avx2", lion::cpu::avx2::kLion, avx2},
                      {"baseline", lion::cpu::baseline::kLion, true}};
  const auto shapes = random_shapes(rng);
  const LionOptions options = random_options(rng);
  const LionHyper h = hyper_of(options);
  const float grad_factor = 0.25f;
  std::vector<at::Tensor> init, grads;
  std::vector<std::int64_t> numel;
  for (const auto& s : shapes) {
    init.push_back(torch::randn(s).to(dtype));
    numel.push_back(init.back().numel());
  }
  const ampfuse::Plan plan(numel, ampfuse::sdk::cpu::kChunkSize);
  for (const Isa& isa : isas) {
    if (!isa.supported) {
      std::cout << "[ skipped  ] " << isa.name << ": this CPU lacks it\n";
      continue;
    }
    SCOPED_TRACE(std::string(isa.name) + ", " + describe(options));
    std::vector<at::Tensor> p, m, ref_p, ref_m;
    std::vector<void*> pp, gp, mp;
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      p.push_back(init[i].clone());
      m.push_back(torch::zeros(shapes[i], dtype));
      ref_p.push_back(init[i].clone());
      ref_m.push_back(m.back().clone());
    }
    for (int step = 1; step <= 3; ++step) {
      std::vector<at::Tensor> g;
      pp.clear(), gp.clear(), mp.clear();
      for (std::size_t i = 0; i < shapes.size(); ++i) {
        g.push_back(random_grad(p[i], rng));
        pp.push_back(p[i].data_ptr()), gp.push_back(g[i].data_ptr()), mp.push_back(m[i].data_ptr());
        mirror_step(ref_p[i], ref_m[i], g[i], h, grad_factor);
      }
      const std::vector<at::Tensor> g_before = [&] {
        std::vector<at::Tensor> out;
        for (const auto& t : g) out.push_back(t.clone());
        return out;
      }();
      const lion::cpu::LionCpuArgs args{ampfuse::sdk::cpu::plan_ref(plan), pp.data(), gp.data(), mp.data(),
                                        ampfuse::to_scalar_type(dtype), h, grad_factor};
      isa.fn(args, 0, plan.num_chunks());
      for (std::size_t i = 0; i < shapes.size(); ++i) {
        ASSERT_TRUE(bitwise_equal(p[i], ref_p[i])) << "param " << i << " after step " << step;
        ASSERT_TRUE(bitwise_equal(m[i], ref_m[i])) << "exp_avg " << i << " after step " << step;
        ASSERT_TRUE(bitwise_equal(g[i], g_before[i])) << "grad " << i << " was written";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Lion, MirrorTest, ::testing::Values(torch::kFloat, torch::kHalf, torch::kBFloat16),
                         [](const auto& i) {
                           return std::string(i.param == torch::kFloat  ? "f32"
                                              : i.param == torch::kHalf ? "f16"
                                                                        : "bf16");
                         });

// ------------------------------------------------------ float64 reference

// fp32 FusedLion against Lion in float64 (ATen ops on double tensors), 50
// steps. The tolerance is a running per-element bound, with u = 2^-24 (the
// unit roundoff of fp32):
//   m: each step rounds beta2 and 1 - beta2 to fp32, two products and a sum,
//      so |m32 - m64| grows by at most 4u (beta2 |m| + (1 - beta2) |g|) on top
//      of beta2 times the old error: e_m = beta2 e_m + 4u (beta2 |m| + (1 - beta2) |g|).
//   c: likewise e_c = beta1 e_m + 4u (beta1 |m| + (1 - beta1) |g|). Where
//      |c64| <= 2 e_c the fp32 sign may differ from the exact one (a "flip"):
//      the fp32 step then moves p by up to 2 lr away from the exact one.
//   p: decay, lr, a product and a difference round: e_p = d e_p +
//      4u (d |p| + lr), plus 2 lr on a possible flip (d = 1 - lr wd).
// Elements are checked against 2 e_p and 2 e_m (a factor 2 for the slack in
// "4u"). Flips are rare (|c| near 0 within ~1e-5 relative); the test also
// checks that at most 1% of elements ever had one, so that the bound stays
// tight almost everywhere instead of being a 2 lr allowance.
TEST(Float64Reference, Fp32WithinTheDerivedBoundOver50Steps) {
  std::mt19937_64 rng(seed_for_test());
  const auto shapes = random_shapes(rng);
  const LionOptions options = random_options(rng);
  SCOPED_TRACE(describe(options));
  const double lr = options.lr(), b1 = std::get<0>(options.betas()), b2 = std::get<1>(options.betas());
  const double d = 1 - lr * options.weight_decay(), u = std::ldexp(1.0, -24);
  std::vector<at::Tensor> params, p64, m64, e_p, e_m, flipped;
  for (const auto& s : shapes) {
    params.push_back(torch::randn(s).requires_grad_());
    p64.push_back(params.back().detach().to(at::kDouble));
    m64.push_back(torch::zeros(s, at::kDouble));
    e_p.push_back(torch::zeros(s, at::kDouble));
    e_m.push_back(torch::zeros(s, at::kDouble));
    flipped.push_back(torch::zeros(s, at::kBool));
  }
  FusedLion opt(params, options);
  for (int step = 1; step <= 50; ++step) {
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      params[i].mutable_grad() = random_grad(params[i], rng);
      const at::Tensor g = params[i].grad().to(at::kDouble), ag = g.abs(), am = m64[i].abs();
      const at::Tensor c = m64[i].mul(b1).add(g.mul(1 - b1));
      const at::Tensor e_c = e_m[i].mul(b1).add(am.mul(b1).add(ag.mul(1 - b1)).mul(4 * u));
      const at::Tensor flip = c.abs().le(e_c.mul(2));
      flipped[i].logical_or_(flip);
      e_p[i] = e_p[i].mul(d).add(p64[i].abs().mul(d).add(lr).mul(4 * u)).add(flip.to(at::kDouble).mul(2 * lr));
      p64[i] = p64[i].mul(d).sub(c.sign().mul(lr));
      e_m[i] = e_m[i].mul(b2).add(am.mul(b2).add(ag.mul(1 - b2)).mul(4 * u));
      m64[i] = m64[i].mul(b2).add(g.mul(1 - b2));
    }
    opt.step();
  }
  std::int64_t total = 0, flips = 0;
  double worst = 0;  // the largest error as a fraction of its bound
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    const at::Tensor p_err = params[i].detach().to(at::kDouble).sub(p64[i]).abs();
    const at::Tensor m_err = exp_avg_of(opt, params[i]).to(at::kDouble).sub(m64[i]).abs();
    const at::Tensor p_bad = p_err.gt(e_p[i].mul(2)), m_bad = m_err.gt(e_m[i].mul(2));
    EXPECT_EQ(p_bad.sum().item<std::int64_t>(), 0)
        << "param " << i << ": worst error " << p_err.max().item<double>() << " with bound "
        << e_p[i].mul(2).max().item<double>();
    EXPECT_EQ(m_bad.sum().item<std::int64_t>(), 0)
        << "exp_avg " << i << ": worst error " << m_err.max().item<double>() << " with bound "
        << e_m[i].mul(2).max().item<double>();
    if (params[i].numel() > 0) worst = std::max(worst, p_err.div(e_p[i].mul(2)).nan_to_num(0).max().item<double>());
    total += params[i].numel();
    flips += flipped[i].sum().item<std::int64_t>();
  }
  std::cout << "[ info     ] " << flips << " of " << total << " elements had a step with |c| within its rounding bound;"
            << " largest param error " << worst << " of its bound\n";
  EXPECT_LE(flips, total / 100);
}

// ------------------------------------------------------------ checkpoints

// Save after 5 steps, load into a fresh optimizer built with other options
// (as after a restart), and both take the same next 5 steps bit for bit.
TEST(Checkpoint, SaveLoadRoundTrip) {
  std::mt19937_64 rng(seed_for_test());
  const std::vector<LionOptions> options = {random_options(rng), random_options(rng).lr(3e-2)};
  std::vector<at::Tensor> a0 = {torch::randn({300}).requires_grad_(), torch::randn({65537}).requires_grad_()};
  std::vector<at::Tensor> a1 = {torch::randn({7, 3}).to(torch::kBFloat16).requires_grad_()};
  std::vector<torch::optim::OptimizerParamGroup> ga;
  ga.emplace_back(a0, std::make_unique<LionOptions>(options[0]));
  ga.emplace_back(a1, std::make_unique<LionOptions>(options[1]));
  FusedLion a(ga);
  const std::vector<at::Tensor> all_a = {a0[0], a0[1], a1[0]};
  auto step_with_grads = [](FusedLion& opt, const std::vector<at::Tensor>& ps, const std::vector<at::Tensor>& gs) {
    for (std::size_t i = 0; i < ps.size(); ++i) ps[i].mutable_grad() = gs[i].clone();
    opt.step();
  };
  auto grads = [&] {
    std::vector<at::Tensor> gs;
    for (const auto& p : all_a) gs.push_back(random_grad(p, rng));
    return gs;
  };
  for (int k = 0; k < 5; ++k) step_with_grads(a, all_a, grads());

  std::stringstream bytes;
  torch::save(a, bytes);

  std::vector<at::Tensor> b0 = {a0[0].detach().clone().requires_grad_(), a0[1].detach().clone().requires_grad_()};
  std::vector<at::Tensor> b1 = {a1[0].detach().clone().requires_grad_()};
  std::vector<torch::optim::OptimizerParamGroup> gb;
  gb.emplace_back(b0, std::make_unique<LionOptions>(LionOptions(0.5).betas({0.5, 0.5})));
  gb.emplace_back(b1, std::make_unique<LionOptions>(LionOptions(0.25).weight_decay(0.75)));
  FusedLion b(gb);
  torch::load(b, bytes);
  const std::vector<at::Tensor> all_b = {b0[0], b0[1], b1[0]};

  for (std::size_t g = 0; g < 2; ++g) {
    const auto& oa = static_cast<const LionOptions&>(a.param_groups()[g].options());
    const auto& ob = static_cast<const LionOptions&>(b.param_groups()[g].options());
    EXPECT_EQ(ob.lr(), oa.lr()) << "group " << g;
    EXPECT_EQ(ob.betas(), oa.betas()) << "group " << g;
    EXPECT_EQ(ob.weight_decay(), oa.weight_decay()) << "group " << g;
  }
  for (std::size_t i = 0; i < all_a.size(); ++i)
    ASSERT_TRUE(bitwise_equal(exp_avg_of(b, all_b[i]), exp_avg_of(a, all_a[i]))) << "exp_avg " << i;
  for (int k = 1; k <= 5; ++k) {
    const auto gs = grads();
    step_with_grads(a, all_a, gs);
    step_with_grads(b, all_b, gs);
    for (std::size_t i = 0; i < all_a.size(); ++i)
      ASSERT_TRUE(bitwise_equal(all_b[i], all_a[i])) << "param " << i << " after resumed step " << k;
  }
}

// ------------------------------------------------- LR schedulers, GradScaler

TEST(Scheduler, StepLRSetsTheLrTheKernelUses) {
  seed_for_test();
  auto p = torch::randn({1000}).requires_grad_();
  FusedLion opt(std::vector<at::Tensor>{p}, LionOptions(0.1));
  torch::optim::StepLR schedule(opt, /*step_size=*/1, /*gamma=*/0.5);
  schedule.step();  // LibTorch's StepLR counts its first step() as epoch 0: lr stays
  EXPECT_EQ(opt.param_groups()[0].options().get_lr(), 0.1);
  schedule.step();
  EXPECT_EQ(opt.param_groups()[0].options().get_lr(), 0.05);
  const at::Tensor before = p.detach().clone(), g = torch::randn({1000});
  p.mutable_grad() = g;
  opt.step();
  // First step: m = 0, so c = (1 - beta1) g and p moves by lr against sign(g).
  EXPECT_TRUE(bitwise_equal(p, before.sub(g.sign().mul(0.05f))));
}

TEST(GradScaler, StepsAndSkipsThroughTheContract) {
  torch::manual_seed(seed_for_test());
  auto w = torch::randn({4099}).requires_grad_();
  FusedLion opt(std::vector<at::Tensor>{w}, LionOptions(1e-2).weight_decay(0.1));
  ampfuse::GradScaler scaler;

  // Applied: the kernel sees the scaled grads times inv_scale (2^-16: exact).
  at::Tensor ref_p = w.detach().clone(), ref_m = torch::zeros_like(ref_p);
  opt.zero_grad();
  scaler.scale(w.square().sum()).backward();
  const at::Tensor scaled_grad = w.grad().clone();
  scaler.step(opt);
  scaler.update();
  EXPECT_FALSE(scaler.last_step_skipped(opt));
  EXPECT_TRUE(bitwise_equal(w.grad(), scaled_grad)) << "grads are read, never written";
  mirror_step(ref_p, ref_m, scaled_grad, hyper_of(LionOptions(1e-2).weight_decay(0.1)), 1.f / 65536);
  EXPECT_TRUE(bitwise_equal(w, ref_p));
  EXPECT_TRUE(bitwise_equal(exp_avg_of(opt, w), ref_m));

  // Skipped: inf grads leave params and state untouched, and the scale backs off.
  opt.zero_grad();
  scaler.scale(w.mul(std::numeric_limits<float>::infinity()).sum()).backward();
  scaler.step(opt);
  scaler.update();
  EXPECT_TRUE(scaler.last_step_skipped(opt));
  EXPECT_TRUE(bitwise_equal(w, ref_p));
  EXPECT_TRUE(bitwise_equal(exp_avg_of(opt, w), ref_m));
  EXPECT_EQ(scaler.get_scale(), 32768.0);
}

TEST(BadInput, RefusedWithTheOptimizersName) {
  auto p = torch::randn({10}).requires_grad_();
  EXPECT_THROW(FusedLion(std::vector<at::Tensor>{p}, LionOptions(-1)), c10::Error);
  EXPECT_THROW(FusedLion(std::vector<at::Tensor>{p}, LionOptions().betas({0.9, 1.5})), c10::Error);
  auto d = torch::randn({10}, torch::kDouble).requires_grad_();
  FusedLion opt(std::vector<at::Tensor>{d});
  d.mutable_grad() = torch::randn({10}, torch::kDouble);
  try {
    opt.step();
    FAIL() << "an fp64 parameter was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("FusedLion"), std::string::npos)
        << e.what_without_backtrace();
  }
}

// ------------------------------------------------------------------- CUDA

// The CUDA kernel (built with -fmad=false) rounds as the CPU kernel does.
TEST(Cuda, MatchesCpuBitwise) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device here";
  std::mt19937_64 rng(seed_for_test());
  for (const torch::Dtype dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16}) {
    const auto shapes = random_shapes(rng);
    const LionOptions options = random_options(rng);
    std::vector<at::Tensor> cpu, cuda;
    for (const auto& s : shapes) {
      cpu.push_back(torch::randn(s).to(dtype).requires_grad_());
      cuda.push_back(cpu.back().detach().to(torch::kCUDA).requires_grad_());
    }
    FusedLion on_cpu(cpu, options), on_cuda(cuda, options);
    for (int step = 1; step <= 10; ++step) {
      for (std::size_t i = 0; i < shapes.size(); ++i) {
        cpu[i].mutable_grad() = random_grad(cpu[i], rng);
        cuda[i].mutable_grad() = cpu[i].grad().to(torch::kCUDA);
      }
      on_cpu.step();
      on_cuda.step();
    }
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(cuda[i], cpu[i])) << "param " << i << " " << dtype << ", " << describe(options);
      EXPECT_TRUE(bitwise_equal(exp_avg_of(on_cuda, cuda[i]), exp_avg_of(on_cpu, cpu[i])))
          << "exp_avg " << i << " " << dtype;
    }
  }
}

}  // namespace
