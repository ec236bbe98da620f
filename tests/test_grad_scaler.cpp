// GradScaler against ATen, the reference: scale trajectories against
// at::_amp_update_scale_, unscale_ against
// at::_amp_foreach_non_finite_check_and_unscale_, clipping against
// torch::nn::utils::clip_grad_norm_, a training run against PyTorch's
// algorithm written by hand, misuse errors by message, and the contract path.

#include <ampfuse/fused_adagrad.h>
#include <ampfuse/fused_adam.h>
#include <ampfuse/fused_lamb.h>
#include <ampfuse/fused_rmsprop.h>
#include <ampfuse/fused_sgd.h>
#include <ampfuse/grad_scaler.h>
#include <ampfuse/tensor_ops.h>

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <limits>

#include "scaler/update_scale.h"
#include "tests/common.h"

#if defined(AMPFUSE_WITH_CUDA)
#include <c10/cuda/CUDAStream.h>
#endif

namespace {

using ampfuse_test::bitwise_equal;
using ::testing::HasSubstr;

constexpr float kInf = std::numeric_limits<float>::infinity();

// A minimal optimizer that implements the contract with ATen ops (no host
// sync): p -= lr * g * inv_scale * clip_coef unless found_inf != 0, and a
// device step counter that advances only on applied steps.
class ContractSGD : public torch::optim::Optimizer, public ampfuse::ScalerAware {
 public:
  ContractSGD(std::vector<torch::Tensor> params, double lr)
      : Optimizer({torch::optim::OptimizerParamGroup(std::move(params))},
                  std::make_unique<torch::optim::SGDOptions>(lr)),
        lr_(lr) {}

  torch::Tensor step(LossClosure = nullptr) override {
    torch::NoGradGuard no_grad;
    for (auto& p : param_groups()[0].params())
      if (p.grad().defined()) p.sub_(p.grad() * lr_);
    return {};
  }

  void step_with_signals(const ampfuse::StepSignals& signals) override {
    torch::NoGradGuard no_grad;
    ++calls;
    for (auto& p : param_groups()[0].params()) {
      if (!p.grad().defined()) continue;
      const ampfuse::ScaleSignal& s = signals.at(p.device());
      auto g = p.grad().to(torch::kFloat);
      if (s.inv_scale.defined()) g = g * s.inv_scale;
      if (s.clip_coef.defined()) g = g * s.clip_coef;
      const auto updated = (p.to(torch::kFloat) - g * lr_).to(p.scalar_type());
      p.copy_(torch::where(s.found_inf != 0, p, updated));
      if (!applied_steps.defined()) applied_steps = torch::zeros({}, torch::TensorOptions().dtype(torch::kLong).device(p.device()));
    }
    applied_steps.add_((signals.all().front().second.found_inf == 0).to(torch::kLong));
  }

  int calls = 0;
  torch::Tensor applied_steps;

 private:
  double lr_;
};

torch::Tensor leaf(torch::Tensor t) { return t.detach().requires_grad_(true); }

// ---------------------------------------------------------------- scale update

TEST(ScaleUpdate, TrajectoryMatchesAtenOverTenThousandSteps) {
  const auto seed = ampfuse_test::seed_for_test();
  std::mt19937_64 rng(seed);
  std::vector<torch::Device> devices = {torch::kCPU};
  if (ampfuse_test::cuda_available()) devices.push_back(torch::kCUDA);
  for (const auto device : devices) {
    for (int config = 0; config < 4; ++config) {
      const double growth = config == 0 ? 2.0 : 1.0 + std::uniform_real_distribution<double>(1e-3, 3.0)(rng);
      const double backoff = config == 0 ? 0.5 : std::uniform_real_distribution<double>(0.05, 0.99)(rng);
      const std::int64_t interval = config == 0 ? 2000 : 1 + static_cast<std::int64_t>(rng() % 40);
      // Start near fp32's top on one config, so that "never grow to inf" is exercised.
      const float start = config == 3 ? 1e38f : 65536.f;
      const double p_inf = std::uniform_real_distribution<double>(0.0, 0.3)(rng);
      SCOPED_TRACE("device " + device.str() + ", growth " + std::to_string(growth) + ", backoff " +
                   std::to_string(backoff) + ", interval " + std::to_string(interval));

      auto f32 = torch::TensorOptions().dtype(torch::kFloat).device(device);
      auto ref_scale = torch::full({}, start, f32);
      auto ref_tracker = torch::zeros({}, f32.dtype(torch::kInt));
      auto our_scale = ref_scale.clone();
      auto our_tracker = ref_tracker.clone();
      auto found = torch::zeros({}, f32);
      const ampfuse::scaler::UpdateScaleParams params{growth, backoff, interval, 0.0};
      for (int step = 0; step < 10000; ++step) {
        // found_inf may be a sum (several optimizers): 0, 1, 2 or 3.
        const float f = std::bernoulli_distribution(p_inf)(rng) ? static_cast<float>(1 + rng() % 3) : 0.f;
        found.fill_(f);
        at::_amp_update_scale_(ref_scale, ref_tracker, found, growth, backoff, interval);
        if (device.is_cpu()) {
          ampfuse::scaler::update_scale_math(our_scale.data_ptr<float>(), our_tracker.data_ptr<std::int32_t>(), f,
                                             params);
        } else {
#if defined(AMPFUSE_WITH_CUDA)
          ampfuse::scaler::update_scale_cuda(our_scale.data_ptr<float>(), our_tracker.data_ptr<std::int32_t>(),
                                             found.data_ptr<float>(), params,
                                             c10::cuda::getCurrentCUDAStream().stream());
#endif
        }
        if (step % 500 == 499 || step < 50) {
          ASSERT_TRUE(bitwise_equal(our_scale, ref_scale)) << "step " << step;
          ASSERT_TRUE(torch::equal(our_tracker, ref_tracker)) << "step " << step;
        }
      }
      EXPECT_TRUE(bitwise_equal(our_scale, ref_scale));
      EXPECT_TRUE(torch::isfinite(our_scale).item<bool>());
    }
  }
}

TEST(ScaleUpdate, MinScaleBoundsTheBackOff) {
  const ampfuse::scaler::UpdateScaleParams params{2.0, 0.5, 100, 4.0};
  float scale = 16.f;
  std::int32_t tracker = 7;
  for (int i = 0; i < 5; ++i) ampfuse::scaler::update_scale_math(&scale, &tracker, 1.f, params);
  EXPECT_EQ(scale, 4.f);
  EXPECT_EQ(tracker, 0);
}

// ---------------------------------------------------------------- helpers

struct Model {
  std::vector<torch::Tensor> params;
};

Model make_params(const std::vector<std::vector<std::int64_t>>& shapes, torch::Dtype dtype, std::uint64_t seed) {
  torch::manual_seed(seed);
  Model m;
  for (const auto& s : shapes) m.params.push_back(leaf(torch::randn(s).to(dtype)));
  return m;
}

void set_grads(std::vector<torch::Tensor>& params, float magnitude) {
  for (auto& p : params) p.mutable_grad() = torch::randn_like(p) * magnitude;
}

std::vector<torch::Tensor> clone_grads(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> g;
  for (const auto& p : params) g.push_back(p.grad().clone());
  return g;
}

// ---------------------------------------------------------------- unscale_

// PyTorch's set_growth_factor, set_backoff_factor and set_growth_interval:
// the next updates follow the new values (against at::_amp_update_scale_
// with them), as do factors the constructor refuses (1, which freezes the
// scale, and past 1) as PyTorch's setters take them, a factor that would
// make the scale 0, inf or NaN is refused and changes nothing, and an
// interval lowered below the clean steps counted so far
// grows the scale at the next clean update (ATen's count would pass the
// interval and never grow again), as does a loaded count past the interval.
TEST(GradScaler, GrowthSettersTakeEffectAtTheNextUpdate) {
  auto p = torch::randn({8}).requires_grad_();
  ampfuse::FusedSGD opt({p}, torch::optim::SGDOptions(0.0));
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(1024.0).growth_interval(10));
  auto ref_scale = torch::full({}, 1024.f), ref_tracker = torch::zeros({}, torch::kInt);
  double growth = 2.0, backoff = 0.5;
  std::int64_t interval = 10;
  auto iteration = [&](bool inf) {
    p.mutable_grad() = scaler.scale(torch::full({8}, inf ? INFINITY : 1.f));
    scaler.step(opt);
    scaler.update();
    at::_amp_update_scale_(ref_scale, ref_tracker, torch::full({}, inf ? 1.f : 0.f), growth, backoff, interval);
  };
  for (int i = 0; i < 3; ++i) iteration(false);
  scaler.set_growth_factor(3.5);
  scaler.set_backoff_factor(0.25);
  scaler.set_growth_interval(4);
  growth = 3.5, backoff = 0.25, interval = 4;
  EXPECT_EQ(scaler.get_growth_factor(), 3.5);
  EXPECT_EQ(scaler.get_backoff_factor(), 0.25);
  EXPECT_EQ(scaler.get_growth_interval(), 4);
  for (const bool inf : {false, false, true, false, false, false, false, false, true}) {
    iteration(inf);
    ASSERT_EQ(scaler.get_scale(), ref_scale.item<double>());
    ASSERT_EQ(scaler.get_growth_tracker(), ref_tracker.item<std::int64_t>());
  }
  EXPECT_THAT(ampfuse_test::error_of([&] { scaler.set_growth_factor(0.0); }),
              ::testing::HasSubstr("growth_factor is 0; a scale grows by a finite factor > 0"));
  EXPECT_THAT(ampfuse_test::error_of([&] { scaler.set_growth_factor(INFINITY); }),
              ::testing::HasSubstr("growth_factor is inf"));
  EXPECT_THAT(ampfuse_test::error_of([&] { scaler.set_backoff_factor(NAN); }),
              ::testing::HasSubstr("backoff_factor is nan; a scale backs off by a finite factor > 0"));
  EXPECT_THAT(ampfuse_test::error_of([&] { scaler.set_backoff_factor(-0.5); }),
              ::testing::HasSubstr("backoff_factor is -0.5"));
  EXPECT_THAT(ampfuse_test::error_of([&] { scaler.set_growth_interval(0); }),
              ::testing::HasSubstr("growth_interval is 0; it is at least 1 clean step"));
  EXPECT_EQ(scaler.get_growth_factor(), 3.5);
  EXPECT_EQ(scaler.get_backoff_factor(), 0.25);
  EXPECT_EQ(scaler.get_growth_interval(), 4);
  // A growth factor of 1 and a backoff factor of 1 freeze the scale; 0.5 shrinks it on clean steps. As ATen's.
  for (const auto& [g, b] : {std::pair{1.0, 1.0}, std::pair{0.5, 1.5}}) {
    scaler.set_growth_factor(g);
    scaler.set_backoff_factor(b);
    growth = g, backoff = b;
    for (const bool inf : {false, false, false, false, true, false, false, false, false}) {
      iteration(inf);
      ASSERT_EQ(scaler.get_scale(), ref_scale.item<double>());
      ASSERT_EQ(scaler.get_growth_tracker(), ref_tracker.item<std::int64_t>());
    }
  }
  scaler.set_growth_factor(3.5);
  scaler.set_backoff_factor(0.25);
  growth = 3.5, backoff = 0.25;

  // Three clean steps counted, then the interval lowered to 2: the next clean update grows.
  for (int i = 0; i < 3; ++i) iteration(false);
  ASSERT_EQ(scaler.get_growth_tracker(), 3);
  const double before = scaler.get_scale();
  scaler.set_growth_interval(2);
  p.mutable_grad() = scaler.scale(torch::ones({8}));
  scaler.step(opt);
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), static_cast<double>(static_cast<float>(before * 3.5)));
  EXPECT_EQ(scaler.get_growth_tracker(), 0);

  // A checkpoint whose count is past its interval (PyTorch's set_growth_interval leaves such) loads, and grows next;
  // so does one of a scaler that never backs off (set_backoff_factor(1.0)).
  torch::serialize::OutputArchive out;
  out.write("scale", c10::IValue(64.0));
  out.write("growth_factor", c10::IValue(2.0));
  out.write("backoff_factor", c10::IValue(1.0));
  out.write("growth_interval", c10::IValue(std::int64_t{3}));
  out.write("_growth_tracker", c10::IValue(std::int64_t{7}));
  std::ostringstream bytes;
  out.save_to(bytes);
  std::istringstream in_bytes(bytes.str());
  torch::serialize::InputArchive in;
  in.load_from(in_bytes);
  scaler.load(in);
  EXPECT_EQ(scaler.get_growth_tracker(), 7);
  EXPECT_EQ(scaler.get_backoff_factor(), 1.0);
  p.mutable_grad() = scaler.scale(torch::ones({8}));
  scaler.step(opt);
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 128.0);
  EXPECT_EQ(scaler.get_growth_tracker(), 0);
}

TEST(GradScaler, UnscaleIsBitIdenticalToAten) {
  const auto seed = ampfuse_test::seed_for_test();
  for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16}) {
    for (bool poison : {false, true}) {
      SCOPED_TRACE(ampfuse_test::dtype_name(dtype) + (poison ? ", with inf" : ""));
      Model m = make_params({{7, 13}, {0}, {1}, {4097}, {64, 64}}, dtype, seed);
      set_grads(m.params, 1000.f);
      if (poison) m.params[3].mutable_grad()[5] = kInf;
      auto ref = clone_grads(m.params);
      torch::optim::SGD opt(m.params, 0.1);
      ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(1024.0 * 3));
      scaler.scale(torch::ones({}));
      scaler.unscale_(opt);
      auto found = torch::zeros({});
      auto inv = torch::full({}, 1024.0 * 3, torch::kFloat).to(torch::kDouble).reciprocal().to(torch::kFloat);
      at::_amp_foreach_non_finite_check_and_unscale_(ref, found, inv);
      for (std::size_t i = 0; i < ref.size(); ++i) EXPECT_TRUE(bitwise_equal(m.params[i].grad(), ref[i])) << i;
      // The host read of step() agrees with ATen's found_inf.
      const auto before = m.params[0].detach().clone();
      scaler.step(opt);
      EXPECT_EQ(scaler.last_step_skipped(opt), found.item<float>() != 0.f);
      EXPECT_EQ(torch::equal(before, m.params[0].detach()), poison);
    }
  }
}

// ---------------------------------------------------------------- clipping

// Reference: grads unscaled by ATen, then torch::nn::utils::clip_grad_norm_, then SGD.
void expect_clip_matches(bool contract, bool unscale_first, bool poison, std::uint64_t seed) {
  SCOPED_TRACE(std::string(contract ? "contract" : "classic") + (unscale_first ? ", unscale_ first" : "") +
               (poison ? ", with NaN" : ""));
  const float scale = 4096.f, lr = 0.01f, max_norm = 0.5f;
  Model m = make_params({{33, 17}, {5}, {1000}}, torch::kFloat, seed);
  Model r = make_params({{33, 17}, {5}, {1000}}, torch::kFloat, seed);
  set_grads(m.params, scale);
  if (poison) m.params[1].mutable_grad()[2] = std::numeric_limits<float>::quiet_NaN();
  for (std::size_t i = 0; i < r.params.size(); ++i) r.params[i].mutable_grad() = m.params[i].grad().clone();
  const auto grads_before = clone_grads(m.params);

  std::unique_ptr<torch::optim::Optimizer> opt;
  if (contract) opt = std::make_unique<ContractSGD>(m.params, lr);
  else opt = std::make_unique<torch::optim::SGD>(m.params, lr);
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(scale));
  scaler.scale(torch::ones({}));
  if (unscale_first) scaler.unscale_(*opt);
  const auto norm = scaler.clip_grad_norm_(*opt, max_norm);
  scaler.step(*opt);

  // Reference.
  auto ref_grads = clone_grads(r.params);
  auto found = torch::zeros({});
  at::_amp_foreach_non_finite_check_and_unscale_(ref_grads, found, torch::full({}, 1.f / scale));
  for (std::size_t i = 0; i < r.params.size(); ++i) r.params[i].mutable_grad() = ref_grads[i];
  const double ref_norm = torch::nn::utils::clip_grad_norm_(r.params, max_norm);
  if (poison) {
    EXPECT_FALSE(std::isfinite(norm.item<float>()));
    EXPECT_TRUE(scaler.last_step_skipped(*opt));
    for (std::size_t i = 0; i < m.params.size(); ++i) EXPECT_TRUE(bitwise_equal(m.params[i], r.params[i]));
    return;
  }
  EXPECT_NEAR(norm.item<float>(), ref_norm, 1e-6 * ref_norm);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : r.params) p.sub_(p.grad() * lr);
  }
  for (std::size_t i = 0; i < m.params.size(); ++i) {
    const auto diff = (m.params[i] - r.params[i]).abs().max().item<float>();
    const auto mag = r.params[i].abs().max().item<float>();
    EXPECT_LE(diff, 1e-6f * mag + 1e-7f) << "param " << i;
  }
  if (contract && !unscale_first)  // the contract path never writes grads
    for (std::size_t i = 0; i < m.params.size(); ++i) EXPECT_TRUE(bitwise_equal(m.params[i].grad(), grads_before[i]));
}

TEST(GradScaler, ClipGradNormMatchesLibTorch) {
  const auto seed = ampfuse_test::seed_for_test();
  for (bool contract : {false, true})
    for (bool unscale_first : {false, true})
      for (bool poison : {false, true}) expect_clip_matches(contract, unscale_first, poison, seed);
}

TEST(GradScaler, ClipGradNormOnlyTwoNorm) {
  Model m = make_params({{4}}, torch::kFloat, 1);
  set_grads(m.params, 1.f);
  torch::optim::SGD opt(m.params, 0.1);
  ampfuse::GradScaler scaler;
  scaler.scale(torch::ones({}));
  try {
    scaler.clip_grad_norm_(opt, 1.0, 1.0);
    FAIL() << "accepted norm_type 1";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("only norm_type 2 is fused"));
  }
}

// ---------------------------------------------------------------- misuse

template <class F>
void expect_error(F&& f, const std::string& message) {
  try {
    f();
    ADD_FAILURE() << "no error; expected: " << message;
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr(message));
  }
}

TEST(GradScalerMisuse, ErrorsByMessage) {
  Model m = make_params({{3, 3}}, torch::kFloat, 2);
  torch::optim::SGD opt(m.params, 0.1);
  set_grads(m.params, 1.f);
  {
    ampfuse::GradScaler scaler;
    expect_error([&] { scaler.step(opt); }, "Attempted step but _scale is None.");
    expect_error([&] { scaler.unscale_(opt); }, "Attempted unscale_ but _scale is None.");
    expect_error([&] { scaler.update(); }, "Attempted update but _scale is None.");
    scaler.scale(torch::ones({}));
    expect_error([&] { scaler.update(); }, "No inf checks were recorded prior to update.");
    scaler.unscale_(opt);
    expect_error([&] { scaler.unscale_(opt); },
                 "unscale_() has already been called on this optimizer since the last update().");
    scaler.step(opt);
    expect_error([&] { scaler.step(opt); }, "step() has already been called since the last update().");
    expect_error([&] { scaler.unscale_(opt); }, "unscale_() is being called after step().");
    expect_error([&] { scaler.clip_grad_norm_(opt, 1.0); }, "clip_grad_norm_() is being called after step().");
    scaler.update();
    scaler.clip_grad_norm_(opt, 1.0);
    expect_error([&] { scaler.clip_grad_norm_(opt, 1.0); },
                 "clip_grad_norm_() has already been called on this optimizer since the last update().");
    expect_error([&] { scaler.update(torch::ones({2})); }, "new_scale should be a float or a 1-element");
    expect_error([&] { scaler.update(torch::ones({}, torch::kFloat).requires_grad_()); },
                 "new_scale should be a float or a 1-element");
  }
  expect_error([] { ampfuse::GradScaler s(ampfuse::GradScalerOptions().growth_factor(1.0)); },
               "The growth factor must be > 1.0.");
  expect_error([] { ampfuse::GradScaler s(ampfuse::GradScalerOptions().backoff_factor(1.0)); },
               "The backoff factor must be < 1.0.");
  {
    torch::optim::LBFGS lbfgs(m.params);
    ampfuse::GradScaler scaler;
    scaler.scale(torch::ones({}));
    expect_error([&] { scaler.step(lbfgs); }, "closure use is not supported if GradScaler is enabled");
  }
  {
    // An optimizer without grads records no inf check (PyTorch asserts the same).
    Model empty = make_params({{3}}, torch::kFloat, 3);
    torch::optim::SGD opt2(empty.params, 0.1);
    ampfuse::GradScaler scaler;
    scaler.scale(torch::ones({}));
    expect_error([&] { scaler.step(opt2); }, "No inf checks were recorded for this optimizer.");
  }
}

// A torch::optim optimizer whose step throws once.
struct SgdThatThrowsOnce : torch::optim::SGD {
  using torch::optim::SGD::SGD;
  bool armed = true;
  at::Tensor step(LossClosure closure = nullptr) override {
    if (armed) {
      armed = false;
      TORCH_CHECK(false, "injected failure");
    }
    return torch::optim::SGD::step(closure);
  }
};

// PyTorch's step() unscales the grads through unscale_ before the
// optimizer's step: when that throws, the grads stay unscaled once, unscale_
// is refused until update(), and a retried step takes the grads as they
// are. The inverse scale (and a clip coefficient) were applied again.
TEST(GradScalerMisuse, AClassicStepThatThrowsLeavesTheGradsUnscaledOnce) {
  for (const bool clip : {false, true}) {
    SCOPED_TRACE(clip ? "clip_grad_norm_ first" : "step");
    Model m = make_params({{1}}, torch::kFloat, 5);
    SgdThatThrowsOnce opt(m.params, torch::optim::SGDOptions(1.0));
    m.params[0].mutable_grad() = torch::full({1}, 64.f);
    ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(8.0));
    scaler.scale(torch::ones({}));
    if (clip) scaler.clip_grad_norm_(opt, 1000.0);  // norm 8: coefficient 1
    const torch::Tensor before = m.params[0].detach().clone();
    expect_error([&] { scaler.step(opt); }, "injected failure");
    EXPECT_TRUE(bitwise_equal(m.params[0].grad(), torch::full({1}, 8.f)));
    if (!clip)
      expect_error([&] { scaler.unscale_(opt); },
                   "unscale_() has already been called on this optimizer since the last update().");
    EXPECT_TRUE(bitwise_equal(m.params[0].grad(), torch::full({1}, 8.f)));
    scaler.step(opt);
    EXPECT_TRUE(bitwise_equal(m.params[0].detach(), before - 8.f));
    scaler.update();
  }
}

// A step that the optimizer refuses (a sparse grad here), retried in the
// same iteration with new grads: the new grads are checked, as PyTorch's
// stage stays READY when optimizer.step() throws. The retried step used the
// refused one's found_inf: an inf in the new grads was stepped on (and a
// refused step's inf skipped clean ones). Both of GradScaler::step's paths:
// its first step (two passes) and after a clean one (one pass).
TEST(GradScalerMisuse, AStepRetriedAfterTheOptimizerRefusedItChecksTheNewGrads) {
  for (const bool after_a_clean_step : {false, true}) {
    for (const bool inf_in_refused : {false, true}) {
      SCOPED_TRACE(std::string(after_a_clean_step ? "after a clean step" : "first step") +
                   (inf_in_refused ? ", inf in the refused step's grads" : ", inf in the retried step's grads"));
      auto p = torch::tensor({1.f, 2.f, 3.f, 4.f}).requires_grad_();
      ampfuse::FusedAdam opt({p}, torch::optim::AdamOptions(0.1));
      ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(256.0));
      const torch::Tensor clean = torch::full({4}, 256.f), poisoned = torch::tensor({256.f, INFINITY, 256.f, 256.f});
      if (after_a_clean_step) {
        scaler.scale(torch::ones({}));
        p.mutable_grad() = clean.clone();
        scaler.step(opt);
        scaler.update();
      }
      scaler.scale(torch::ones({}));
      // Refused by the optimizer after the scaler's check (an inf values tensor: found_inf set).
      const torch::Tensor refused_values = inf_in_refused ? poisoned : clean;
      p.mutable_grad() = at::sparse_coo_tensor(torch::tensor({{0, 1, 2, 3}}), refused_values, {4});
      const torch::Tensor before = p.detach().clone();
      expect_error([&] { scaler.step(opt); }, "sparse");
      EXPECT_TRUE(bitwise_equal(p.detach(), before));
      p.mutable_grad() = (inf_in_refused ? clean : poisoned).clone();
      scaler.step(opt);
      scaler.update();
      EXPECT_EQ(scaler.last_step_skipped(opt), !inf_in_refused);
      EXPECT_EQ(bitwise_equal(p.detach(), before), !inf_in_refused);
      EXPECT_EQ(scaler.get_scale(), inf_in_refused ? 256.0 : 128.0);
    }
  }
}

// An optimizer that takes the scale (as PyTorch's fused=True ones) and has
// no grads this iteration (frozen) steps nothing, with found_inf 0, beside
// one that has grads; it threw "No inf checks were recorded", which PyTorch
// raises on the path of optimizers that do not take the scale only.
TEST(GradScaler, AFusedOptimizerWithoutGradsStepsNothing) {
  Model frozen = make_params({{3}}, torch::kFloat, 6), m = make_params({{3}}, torch::kFloat, 7);
  set_grads(m.params, 1.f);
  ampfuse::FusedAdam fused(frozen.params, torch::optim::AdamOptions(0.1));
  torch::optim::SGD sgd(m.params, 0.1);
  const torch::Tensor before = frozen.params[0].detach().clone();
  ampfuse::GradScaler scaler;
  scaler.scale(torch::ones({}));
  scaler.step(fused);
  scaler.step(sgd);
  scaler.update();
  EXPECT_TRUE(bitwise_equal(frozen.params[0].detach(), before));
  EXPECT_TRUE(fused.state().empty());
  EXPECT_FALSE(scaler.last_step_skipped(fused));
  EXPECT_EQ(scaler.get_scale(), 65536.0);
  // The next iteration, with grads: stepped as usual.
  set_grads(frozen.params, 1.f);
  scaler.scale(torch::ones({}));
  scaler.step(fused);
  scaler.update();
  EXPECT_FALSE(bitwise_equal(frozen.params[0].detach(), before));
}

// The error names the parameter by group and index (it named the grad's
// place among the grads on its device, "grad[1]", which skips parameters
// without grads and runs across groups), and the call that was made.
TEST(GradScalerMisuse, BadGradsAreRefusedAndNothingIsWritten) {
  Model m = make_params({{3}, {4}, {6}}, torch::kFloat, 4);
  torch::optim::SGD opt({torch::optim::OptimizerParamGroup({m.params[0], m.params[1]}),
                         torch::optim::OptimizerParamGroup({m.params[2]})},
                        torch::optim::SGDOptions(0.1));
  m.params[1].mutable_grad() = torch::randn({4});  // (param 0 has no grad)
  m.params[2].mutable_grad() = torch::ones({6}, torch::kInt);
  const auto g1 = m.params[1].grad().clone();
  ampfuse::GradScaler scaler;
  scaler.scale(torch::ones({}));
  expect_error([&] { scaler.unscale_(opt); }, "GradScaler::unscale_: param group 1, param 0's grad has dtype Int");
  EXPECT_TRUE(bitwise_equal(m.params[1].grad(), g1));
  expect_error([&] { scaler.step(opt); }, "GradScaler::step: param group 1, param 0's grad has dtype Int");
  EXPECT_TRUE(bitwise_equal(m.params[1].grad(), g1));
  // Still READY: the refused calls did not count.
  m.params[2].mutable_grad() = torch::randn({6});
  scaler.unscale_(opt);
}

// Grads that are views with gaps: unscaled through dense copies, with
// ATen's bits, and stepped by the classic path.
TEST(GradScaler, GradsWithGapsAreUnscaledAsAtenDoes) {
  const auto seed = ampfuse_test::seed_for_test();
  Model m = make_params({{5, 4}, {7}}, torch::kFloat, seed);
  torch::Tensor base0 = torch::randn({5, 9}) * 1000.f, base1 = torch::randn({21}) * 1000.f;
  m.params[0].mutable_grad() = base0.slice(1, 2, 6);
  m.params[1].mutable_grad() = base1.slice(0, 0, 21, 3);
  std::vector<torch::Tensor> ref = {base0.slice(1, 2, 6).clone(), base1.slice(0, 0, 21, 3).clone()};
  const torch::Tensor base0_before = base0.clone();
  torch::optim::SGD opt(m.params, 0.1);
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(1024.0));
  scaler.scale(torch::ones({}));
  scaler.unscale_(opt);
  auto found = torch::zeros({1}), inv = torch::full({1}, 1.f / 1024.f);
  at::_amp_foreach_non_finite_check_and_unscale_(ref, found, inv);
  for (std::size_t i = 0; i < ref.size(); ++i) EXPECT_TRUE(bitwise_equal(m.params[i].grad(), ref[i])) << i;
  // Elements of the base outside the view are left alone.
  EXPECT_TRUE(bitwise_equal(base0.slice(1, 0, 2), base0_before.slice(1, 0, 2)));
  EXPECT_TRUE(bitwise_equal(base0.slice(1, 6, 9), base0_before.slice(1, 6, 9)));
  scaler.step(opt);
  scaler.update();
  EXPECT_FALSE(scaler.last_step_skipped(opt));
}

// Grads with gaps between long runs (a column slice of a wide buffer) are
// read and written in place, run by run: ATen's bits, the gaps (NaN here)
// neither read nor written. Such a grad restrided in place at its data
// address (same TensorImpl, same element count) is read in its new layout:
// the runs of the last step are not kept.
TEST(GradScaler, GradsWithLongRunsAreUnscaledInPlaceAndFollowARestride) {
  const auto seed = ampfuse_test::seed_for_test();
  Model m = make_params({{50, 300}, {4, 3, 200}}, torch::kFloat, seed);
  torch::Tensor base0 = torch::randn({50, 400}) * 1000.f, base1 = torch::randn({8, 3, 200}) * 1000.f;
  base0.slice(1, 303, 400).fill_(std::numeric_limits<float>::quiet_NaN());
  base1.slice(0, 1, 8, 2).fill_(std::numeric_limits<float>::quiet_NaN());
  m.params[0].mutable_grad() = base0.slice(1, 3, 303);
  m.params[1].mutable_grad() = base1.slice(0, 0, 8, 2);  // runs of 600 across two dimensions
  torch::Tensor ref0 = base0.clone(), ref1 = base1.clone();
  torch::optim::SGD opt(m.params, 0.1);
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(1024.0));
  auto found = torch::zeros({1}), inv = torch::full({1}, 1.f / 1024.f);
  for (int iteration = 0; iteration < 2; ++iteration) {
    SCOPED_TRACE("iteration " + std::to_string(iteration));
    if (iteration == 1) {
      // Rows of 300 at a stride of 350 (the old gaps are read now, finite).
      ref0.normal_().mul_(1000.f);
      base0.copy_(ref0);
      m.params[0].mutable_grad().as_strided_({50, 300}, {350, 1}, 3);
    }
    std::vector<torch::Tensor> ref = {iteration == 0 ? ref0.slice(1, 3, 303) : ref0.as_strided({50, 300}, {350, 1}, 3),
                                      ref1.slice(0, 0, 8, 2)};
    scaler.scale(torch::ones({}));
    scaler.unscale_(opt);
    found.zero_();
    at::_amp_foreach_non_finite_check_and_unscale_(ref, found, inv);
    EXPECT_EQ(found.item<float>(), 0.f);
    EXPECT_TRUE(bitwise_equal(base0, ref0));
    EXPECT_TRUE(bitwise_equal(base1, ref1));
    scaler.step(opt);
    scaler.update();
    EXPECT_FALSE(scaler.last_step_skipped(opt));
  }
}

// unscaled_grads_after_step: after scaler.step(FusedAdam) the grads hold what
// the update used, bit for bit the grads of the classic path (torch::optim::Adam
// under the same scaler), with and without clip_grad_norm_; a skipped step
// leaves them scaled. The updates themselves are the option's twin's.
TEST(GradScaler, UnscaledGradsAfterStepMatchTheClassicPath) {
  const auto seed = ampfuse_test::seed_for_test();
  for (bool clip : {false, true}) {
    for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16}) {
      SCOPED_TRACE(ampfuse_test::dtype_name(dtype) + (clip ? " with clip_grad_norm_" : ""));
      Model fused = make_params({{33, 7}, {0}, {4097}}, dtype, seed);
      Model plain = make_params({{33, 7}, {0}, {4097}}, dtype, seed);
      Model classic = make_params({{33, 7}, {0}, {4097}}, dtype, seed);
      ampfuse::FusedAdam opt(fused.params, torch::optim::AdamOptions(1e-3));
      ampfuse::FusedAdam plain_opt(plain.params, torch::optim::AdamOptions(1e-3));
      torch::optim::Adam classic_opt(classic.params, torch::optim::AdamOptions(1e-3));
      const auto options = ampfuse::GradScalerOptions().init_scale(1024.0);
      ampfuse::GradScaler scaler(ampfuse::GradScalerOptions(options).unscaled_grads_after_step(true));
      ampfuse::GradScaler plain_scaler(options), classic_scaler(options);
      for (int step = 0; step < 4; ++step) {
        const bool poison = step == 2;
        set_grads(fused.params, 1000.f);
        for (std::size_t i = 0; i < fused.params.size(); ++i) {
          plain.params[i].mutable_grad() = fused.params[i].grad().clone();
          classic.params[i].mutable_grad() = fused.params[i].grad().clone();
        }
        if (poison)
          for (Model* m : {&fused, &plain, &classic}) m->params[2].mutable_grad()[5] = kInf;
        const auto scaled = clone_grads(fused.params);
        for (auto* s : {&scaler, &plain_scaler, &classic_scaler}) s->scale(torch::ones({}));
        if (clip) {
          scaler.clip_grad_norm_(opt, 1.0);
          plain_scaler.clip_grad_norm_(plain_opt, 1.0);
          classic_scaler.clip_grad_norm_(classic_opt, 1.0);
        }
        scaler.step(opt);
        plain_scaler.step(plain_opt);
        classic_scaler.step(classic_opt);
        for (auto* s : {&scaler, &plain_scaler, &classic_scaler}) s->update();
        EXPECT_EQ(scaler.last_step_skipped(opt), poison);
        for (std::size_t i = 0; i < fused.params.size(); ++i) {
          EXPECT_TRUE(bitwise_equal(fused.params[i], plain.params[i])) << "param " << i << ", step " << step;
          if (poison) EXPECT_TRUE(bitwise_equal(fused.params[i].grad(), scaled[i])) << "grad " << i << ", step " << step;
          else EXPECT_TRUE(bitwise_equal(fused.params[i].grad(), classic.params[i].grad())) << "grad " << i << ", step " << step;
        }
      }
    }
  }
}

// Sparse grads (Embedding with sparse=true, then SGD) on the classic path,
// as torch.amp: the values are checked and unscaled (fp16 ones after
// coalescing); an inf skips the step; the step equals ATen's unscale of the
// values followed by torch::optim::SGD.
TEST(GradScaler, SparseGradsOnTheClassicPath) {
  const auto seed = ampfuse_test::seed_for_test();
  for (auto dtype : {torch::kFloat, torch::kHalf}) {
    for (bool poison : {false, true}) {
      torch::manual_seed(seed);
      auto weight = leaf(torch::randn({10, 3}).to(dtype));
      auto ref_weight = leaf(weight.detach().clone());
      // Rows 2 and 7, row 2 twice (uncoalesced, as an embedding's backward makes them).
      const auto indices = torch::tensor({{2, 7, 2}}, torch::kLong);
      auto values = (torch::randn({3, 3}) * 512.f).to(dtype);
      if (poison) values[1][2] = std::numeric_limits<float>::infinity();
      weight.mutable_grad() = torch::sparse_coo_tensor(indices, values, {10, 3});
      ref_weight.mutable_grad() = torch::sparse_coo_tensor(indices, values.clone(), {10, 3});
      torch::optim::SGD opt({weight}, 0.1), ref_opt({ref_weight}, 0.1);
      ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(512.0));
      scaler.scale(torch::ones({}));
      scaler.step(opt);
      scaler.update();
      SCOPED_TRACE(ampfuse_test::dtype_name(dtype) + (poison ? " with inf" : ""));
      EXPECT_EQ(scaler.last_step_skipped(opt), poison);
      EXPECT_EQ(weight.grad().is_coalesced(), dtype == torch::kHalf);
      // The reference: PyTorch's _unscale_grads_ on the same grad, then the step.
      if (dtype == torch::kHalf) ref_weight.mutable_grad() = ref_weight.grad().coalesce();
      auto found = torch::zeros({1});
      std::vector<torch::Tensor> ref_values = {ref_weight.grad()._values()};
      at::_amp_foreach_non_finite_check_and_unscale_(ref_values, found, torch::full({1}, 1.f / 512.f));
      EXPECT_EQ(found.item<float>() != 0.f, poison);
      if (!poison) ref_opt.step();
      EXPECT_TRUE(bitwise_equal(weight.detach(), ref_weight.detach()));
      EXPECT_TRUE(bitwise_equal(weight.grad()._values(), ref_weight.grad()._values()));
    }
  }
}

// clip_grad_norm_ coalesces sparse grads: duplicate indices add up, as in
// the dense grad whose norm LibTorch's clip_grad_norm_ takes.
TEST(GradScaler, ClipGradNormOfSparseGrads) {
  auto weight = leaf(torch::randn({6, 2}));
  const auto indices = torch::tensor({{1, 4, 1}}, torch::kLong);
  const auto values = torch::tensor({{3.f, 0.f}, {0.f, 1.f}, {1.f, 0.f}}) * 4.f;
  weight.mutable_grad() = torch::sparse_coo_tensor(indices, values, {6, 2});
  torch::optim::SGD opt({weight}, 0.1);
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(4.0));
  scaler.scale(torch::ones({}));
  const float norm = scaler.clip_grad_norm_(opt, 100.0).item<float>();
  EXPECT_FLOAT_EQ(norm, std::sqrt(16.f + 1.f));  // row 1 is (4, 0), row 4 is (0, 1), unscaled
}

// A fused optimizer refuses sparse grads under the scaler, naming the
// parameter, as torch::optim::Adam refuses them; nothing is written.
TEST(GradScalerMisuse, FusedOptimizersRefuseSparseGrads) {
  auto dense = leaf(torch::randn({4})), weight = leaf(torch::randn({6, 2}));
  dense.mutable_grad() = torch::randn({4});
  weight.mutable_grad() = torch::sparse_coo_tensor(torch::tensor({{1, 4}}, torch::kLong), torch::randn({2, 2}), {6, 2});
  ampfuse::FusedAdam opt({dense, weight}, torch::optim::AdamOptions(1e-2));
  const auto before = weight.detach().clone();
  ampfuse::GradScaler scaler;
  scaler.scale(torch::ones({}));
  expect_error([&] { scaler.step(opt); }, "param group 0, param 1: the grad is sparse");
  EXPECT_TRUE(bitwise_equal(weight.detach(), before));
  EXPECT_TRUE(opt.state().empty());
}

TEST(GradScaler, DisabledIsAPassThrough) {
  Model m = make_params({{4}}, torch::kFloat, 5);
  set_grads(m.params, 1.f);
  m.params[0].mutable_grad()[0] = kInf;  // not checked when disabled, as in PyTorch
  torch::optim::SGD opt(m.params, 0.1);
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().enabled(false));
  auto loss = torch::full({}, 3.f);
  EXPECT_TRUE(scaler.scale(loss).is_same(loss));
  scaler.unscale_(opt);
  scaler.step(opt);
  scaler.update();
  EXPECT_FALSE(torch::isfinite(m.params[0]).all().item<bool>());
  EXPECT_EQ(scaler.get_scale(), 1.0);
  torch::serialize::OutputArchive archive;
  archive << scaler;  // writes nothing
}

// A disabled scaler's clip_grad_norm_ is torch::nn::utils::clip_grad_norm_,
// for any norm_type (only the enabled scaler's fused pass is norm 2); it
// refused every norm but 2.
TEST(GradScaler, DisabledClipsByAnyNormAsLibTorch) {
  for (const double norm_type : {1.0, 2.0, 3.5, std::numeric_limits<double>::infinity()}) {
    SCOPED_TRACE(norm_type);
    Model ours = make_params({{4, 3}, {5}}, torch::kFloat, 8), ref = make_params({{4, 3}, {5}}, torch::kFloat, 8);
    set_grads(ours.params, 2.f);
    for (std::size_t i = 0; i < ours.params.size(); ++i) ref.params[i].mutable_grad() = ours.params[i].grad().clone();
    torch::optim::SGD opt(ours.params, 0.1);
    ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().enabled(false));
    const double norm = scaler.clip_grad_norm_(opt, 1.5, norm_type).item<double>();
    const double want = torch::nn::utils::clip_grad_norm_(ref.params, 1.5, norm_type);
    EXPECT_EQ(norm, static_cast<double>(static_cast<float>(want)));
    for (std::size_t i = 0; i < ours.params.size(); ++i)
      EXPECT_TRUE(bitwise_equal(ours.params[i].grad(), ref.params[i].grad()));
  }
}

// ---------------------------------------------------------------- several optimizers

TEST(GradScaler, TwoOptimizersOnlyTheInfOneSkipsAndScaleBacksOffOnce) {
  Model a = make_params({{5, 5}}, torch::kFloat, 6), b = make_params({{7}}, torch::kFloat, 7);
  torch::optim::SGD opt_a(a.params, 0.1);
  ContractSGD opt_b(b.params, 0.1);
  for (bool contract_inf : {true, false}) {
    SCOPED_TRACE(contract_inf ? "inf in the contract optimizer" : "inf in the classic optimizer");
    set_grads(a.params, 100.f);
    set_grads(b.params, 100.f);
    (contract_inf ? b : a).params[0].mutable_grad().view(-1)[1] = kInf;
    const auto a_before = a.params[0].detach().clone(), b_before = b.params[0].detach().clone();
    const auto b_grad = b.params[0].grad().clone();
    ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(1024.0));
    scaler.scale(torch::ones({}));
    scaler.step(opt_a);
    scaler.step(opt_b);
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), 512.0);
    EXPECT_EQ(scaler.last_step_skipped(opt_a), !contract_inf);
    EXPECT_EQ(scaler.last_step_skipped(opt_b), contract_inf);
    EXPECT_EQ(torch::equal(a_before, a.params[0].detach()), !contract_inf);
    EXPECT_EQ(torch::equal(b_before, b.params[0].detach()), contract_inf);
    EXPECT_TRUE(bitwise_equal(b.params[0].grad(), b_grad)) << "the contract path wrote a grad";
  }
  EXPECT_EQ(opt_b.applied_steps.item<std::int64_t>(), 1);
  EXPECT_EQ(opt_b.calls, 2);
}

TEST(GradScaler, ContractPathMatchesClassicPathAndSkipsBitwise) {
  const auto seed = ampfuse_test::seed_for_test();
  for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16}) {
    SCOPED_TRACE(ampfuse_test::dtype_name(dtype));
    Model c = make_params({{9, 9}, {3}}, dtype, seed), k = make_params({{9, 9}, {3}}, dtype, seed);
    ContractSGD contract(c.params, 0.05);
    torch::optim::SGD classic(k.params, 0.05);
    ampfuse::GradScaler s1(ampfuse::GradScalerOptions().init_scale(256.0).growth_interval(3));
    ampfuse::GradScaler s2(ampfuse::GradScalerOptions().init_scale(256.0).growth_interval(3));
    std::mt19937_64 rng(seed);
    // The classic path rounds the unscaled grad to the storage type and ATen's
    // add may fuse its multiply-add; the contract path does neither. Both
    // subtract the same grad (unscaling by a power of two is exact), so a
    // difference carried in moves on unchanged but for each step's two
    // roundings to storage, half an ulp each: after n applied steps the two
    // are at most n ulps of the largest magnitude either has held apart, plus
    // the float intermediates' rounding (2^-24 of at most 4x that magnitude,
    // per path and step: the 2^-22 term). The bound is absolute because a
    // difference made at a large magnitude survives a later step to near zero
    // (seed 15869861216920761446 in f16: 35.8 rounded apart, then -0.105 and -0.110).
    const double eps = ampfuse_test::ulp_of(dtype);
    std::vector<double> largest(c.params.size());
    const auto note_magnitudes = [&] {
      for (std::size_t i = 0; i < c.params.size(); ++i)
        largest[i] = std::max({largest[i], c.params[i].abs().max().item<double>(), k.params[i].abs().max().item<double>()});
    };
    note_magnitudes();
    int applied = 0;
    for (int step = 0; step < 12; ++step) {
      set_grads(c.params, 256.f);
      if (rng() % 3 == 0) c.params[1].mutable_grad()[0] = kInf;
      for (std::size_t i = 0; i < c.params.size(); ++i) k.params[i].mutable_grad() = c.params[i].grad().clone();
      const auto before = c.params[0].detach().clone();
      s1.scale(torch::ones({}));
      s2.scale(torch::ones({}));
      s1.step(contract);
      s2.step(classic);
      s1.update();
      s2.update();
      EXPECT_EQ(s1.get_scale(), s2.get_scale()) << "step " << step;
      EXPECT_EQ(s1.last_step_skipped(contract), s2.last_step_skipped(classic));
      if (s1.last_step_skipped(contract)) EXPECT_TRUE(bitwise_equal(c.params[0].detach(), before));
      else ++applied;
      note_magnitudes();
      for (std::size_t i = 0; i < c.params.size(); ++i) {
        const double diff = (c.params[i].to(torch::kDouble) - k.params[i].to(torch::kDouble)).abs().max().item<double>();
        EXPECT_LE(diff, applied * (eps + 0x1p-22) * largest[i])
            << "step " << step << ", parameter " << i << ", " << applied << " steps applied, largest magnitude " << largest[i];
      }
    }
  }
}

// ---------------------------------------------------------------- training runs

// A small MLP with fp32 master parameters whose forward runs in fp16 (what
// autocast does), so that scaled gradients really overflow.
struct Mlp {
  std::vector<torch::Tensor> params;
  explicit Mlp(std::uint64_t seed) {
    torch::manual_seed(seed);
    params = {leaf(torch::randn({16, 32}) * 0.3), leaf(torch::zeros({32})), leaf(torch::randn({32, 1}) * 0.3),
              leaf(torch::zeros({1}))};
  }
  Mlp(const Mlp& other) {
    for (const auto& p : other.params) params.push_back(leaf(p.detach().clone()));
  }
  torch::Tensor loss(const torch::Tensor& x, const torch::Tensor& y) const {
    auto h = torch::relu(torch::matmul(x.to(torch::kHalf), params[0].to(torch::kHalf)) + params[1].to(torch::kHalf));
    auto out = torch::matmul(h, params[2].to(torch::kHalf)) + params[3].to(torch::kHalf);
    return torch::mse_loss(out.to(torch::kFloat), y);
  }
};

struct Batch {
  torch::Tensor x, y;
};

std::vector<Batch> make_data(int steps, std::uint64_t seed) {
  torch::manual_seed(seed);
  std::vector<Batch> data;
  const auto w = torch::randn({16, 1});
  for (int i = 0; i < steps; ++i) {
    auto x = torch::randn({64, 16});
    data.push_back({x, torch::matmul(x, w) + 0.1 * torch::randn({64, 1})});
  }
  return data;
}

TEST(GradScalerTraining, MatchesPyTorchsAlgorithmWrittenByHand) {
  const auto seed = ampfuse_test::seed_for_test();
  const int steps = 200;
  const auto data = make_data(steps, seed);
  Mlp ours(seed), ref(ours);
  torch::optim::Adam opt(ours.params, torch::optim::AdamOptions(1e-3));
  torch::optim::Adam ref_opt(ref.params, torch::optim::AdamOptions(1e-3));
  // A scale high enough to overflow fp16 at first; growth every 10 clean steps.
  const double init = 1 << 24;
  const std::int64_t interval = 10;
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(init).growth_interval(interval));
  auto ref_scale = torch::full({}, init, torch::kFloat);
  auto ref_tracker = torch::zeros({}, torch::kInt);

  int skipped = 0, grown = 0;
  double last_scale = init;
  for (int step = 0; step < steps; ++step) {
    opt.zero_grad();
    scaler.scale(ours.loss(data[step].x, data[step].y)).backward();
    scaler.step(opt);
    scaler.update();

    // PyTorch's GradScaler, by hand with ATen ops.
    ref_opt.zero_grad();
    (ref.loss(data[step].x, data[step].y) * ref_scale).backward();
    std::vector<torch::Tensor> grads;
    for (auto& p : ref.params) grads.push_back(p.grad());
    auto found = torch::zeros({});
    at::_amp_foreach_non_finite_check_and_unscale_(grads, found, ref_scale.to(torch::kDouble).reciprocal().to(torch::kFloat));
    if (found.item<float>() == 0.f) ref_opt.step();
    at::_amp_update_scale_(ref_scale, ref_tracker, found, 2.0, 0.5, interval);

    ASSERT_EQ(scaler.last_step_skipped(opt), found.item<float>() != 0.f) << "step " << step;
    ASSERT_EQ(scaler.get_scale(), ref_scale.item<double>()) << "step " << step;
    for (std::size_t i = 0; i < ours.params.size(); ++i)
      ASSERT_TRUE(bitwise_equal(ours.params[i].detach(), ref.params[i].detach())) << "step " << step << " param " << i;
    skipped += scaler.last_step_skipped(opt);
    grown += scaler.get_scale() > last_scale;
    last_scale = scaler.get_scale();
  }
  // The run exercised both directions.
  EXPECT_GT(skipped, 5);
  EXPECT_GT(grown, 2);
  std::cout << "[ info     ] " << skipped << " of " << steps << " steps skipped, scale grew " << grown
            << " times, final scale " << scaler.get_scale() << "\n";
}

TEST(GradScalerTraining, StateDictRoundTripContinuesBitIdentically) {
  const auto seed = ampfuse_test::seed_for_test();
  const int steps = 60, cut = 30;
  const auto data = make_data(steps, seed);
  const double init = 1 << 22;
  auto opts = ampfuse::GradScalerOptions().init_scale(init).growth_interval(7);
  auto train = [&](Mlp& m, torch::optim::Adam& opt, ampfuse::GradScaler& scaler, int from, int to) {
    for (int step = from; step < to; ++step) {
      opt.zero_grad();
      scaler.scale(m.loss(data[step].x, data[step].y)).backward();
      scaler.step(opt);
      scaler.update();
    }
  };
  Mlp full(seed);
  torch::optim::Adam full_opt(full.params, torch::optim::AdamOptions(1e-3));
  ampfuse::GradScaler full_scaler(opts);
  train(full, full_opt, full_scaler, 0, cut);
  const std::string scaler_file = ampfuse_test::temp_path("scaler.pt"), opt_file = ampfuse_test::temp_path("adam.pt");
  torch::save(full_scaler, scaler_file);
  torch::save(full_opt, opt_file);
  Mlp resumed(full);  // parameters at the cut
  train(full, full_opt, full_scaler, cut, steps);

  torch::optim::Adam resumed_opt(resumed.params, torch::optim::AdamOptions(1e-3));
  torch::load(resumed_opt, opt_file);
  ampfuse::GradScaler resumed_scaler(ampfuse::GradScalerOptions().init_scale(1.0));  // overwritten by load
  torch::load(resumed_scaler, scaler_file);
  EXPECT_EQ(resumed_scaler.get_growth_tracker(), [&] {
    torch::serialize::InputArchive a;
    a.load_from(scaler_file);
    c10::IValue v;
    a.read("_growth_tracker", v);
    return v.toInt();
  }());
  EXPECT_EQ(resumed_scaler.options().growth_interval(), 7);
  train(resumed, resumed_opt, resumed_scaler, cut, steps);
  EXPECT_EQ(resumed_scaler.get_scale(), full_scaler.get_scale());
  EXPECT_EQ(resumed_scaler.get_growth_tracker(), full_scaler.get_growth_tracker());
  for (std::size_t i = 0; i < full.params.size(); ++i)
    EXPECT_TRUE(bitwise_equal(resumed.params[i].detach(), full.params[i].detach())) << "param " << i;
  std::remove(scaler_file.c_str());
  std::remove(opt_file.c_str());
}

TEST(GradScalerSerialization, StateDictKeysAndBadArchives) {
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(8.0).growth_interval(3));
  torch::serialize::OutputArchive out;
  out << scaler;
  const std::string file = ampfuse_test::temp_path("keys.pt");
  out.save_to(file);
  torch::serialize::InputArchive in;
  in.load_from(file);
  c10::IValue v;
  for (const char* key : {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"})
    EXPECT_TRUE(in.try_read(key, v)) << key;
  in.read("scale", v);
  EXPECT_EQ(v.toDouble(), 8.0);

  // An empty archive, as a disabled scaler writes.
  torch::serialize::OutputArchive empty;
  empty.write("unrelated", c10::IValue(1.0));
  empty.save_to(file);
  ampfuse::GradScaler target;
  target.scale(torch::ones({}));
  expect_error([&] { torch::load(target, file); }, "The source state dict is empty");
  // A mismatched one: keys missing, or of the wrong type.
  torch::serialize::OutputArchive partial;
  partial.write("scale", c10::IValue(4.0));
  partial.save_to(file);
  expect_error([&] { torch::load(target, file); }, "the archive has no 'growth_factor'");
  torch::serialize::OutputArchive wrong;
  wrong.write("scale", c10::IValue(4.0));
  wrong.write("growth_factor", c10::IValue(2.0));
  wrong.write("backoff_factor", c10::IValue(0.5));
  wrong.write("growth_interval", c10::IValue(2.5));
  wrong.write("_growth_tracker", c10::IValue(std::int64_t{0}));
  wrong.save_to(file);
  expect_error([&] { torch::load(target, file); }, "'growth_interval' is a Double, expected an int");
  EXPECT_EQ(target.get_scale(), 65536.0) << "a rejected archive changed the scaler";
  std::remove(file.c_str());
}

TEST(GradScaler, LowPrecisionGradsAreUnscaledEverywhere) {
  // PyTorch refuses fp16 grads in unscale_; ampfuse unscales fp16 and bf16 alike.
  for (auto dtype : {torch::kHalf, torch::kBFloat16}) {
    Model m = make_params({{10}}, dtype, 9);
    m.params[0].mutable_grad() = torch::full({10}, 64.f, dtype);
    torch::optim::SGD opt(m.params, 0.1);
    ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(32.0));
    scaler.scale(torch::ones({}));
    scaler.unscale_(opt);
    EXPECT_TRUE(torch::equal(m.params[0].grad(), torch::full({10}, 2.f, dtype)));
  }
}

TEST(GradScaler, UpdateWithExplicitScale) {
  Model m = make_params({{4}}, torch::kFloat, 10);
  set_grads(m.params, 1.f);
  torch::optim::SGD opt(m.params, 0.1);
  ampfuse::GradScaler scaler;
  scaler.scale(torch::ones({}));
  scaler.step(opt);
  scaler.update(123.0);
  EXPECT_EQ(scaler.get_scale(), 123.0);
  scaler.update(torch::full({1}, 7.f));
  EXPECT_EQ(scaler.get_scale(), 7.0);
  EXPECT_EQ(scaler.scale_tensor().dim(), 0);
}

}  // namespace

namespace {

TEST(GradScaler, UndefinedGradsAreSkipped) {
  // A parameter without a grad (frozen, or unused this step) is left alone on both paths.
  for (bool contract : {false, true}) {
    std::vector<torch::Tensor> params = {torch::randn({5}).requires_grad_(), torch::randn({3}).requires_grad_()};
    params[0].mutable_grad() = torch::randn({5}) * 8;
    const auto frozen = params[1].detach().clone();
    std::unique_ptr<torch::optim::Optimizer> opt;
    if (contract) opt = std::make_unique<ContractSGD>(params, 0.1);
    else opt = std::make_unique<torch::optim::SGD>(params, 0.1);
    ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(8.0));
    scaler.scale(torch::ones({}));
    const auto before = params[0].detach().clone();
    scaler.step(*opt);
    scaler.update();
    EXPECT_FALSE(scaler.last_step_skipped(*opt));
    EXPECT_FALSE(torch::equal(before, params[0].detach()));
    EXPECT_TRUE(torch::equal(frozen, params[1].detach()));
    EXPECT_FALSE(params[1].grad().defined());
  }
}

// A scale of 2^127, which the scaler reaches when no grad overflows for long
// enough (bf16 or fp32 grads), has an fp32 inverse of 2^-127: subnormal. The
// CPU kernels run with subnormals flushed, where that factor read as 0: the
// step was taken (nothing was inf) on zero grads, and no parameter moved
// (PyTorch's GradScaler steps them). Each optimizer, on the contract path
// (FusedX) and the classic one (torch::optim::Adam, unscaled by the engine),
// on every instruction set, must step as on the unscaled grads: bit for bit,
// since unscaling by a power of two is exact.
// On CUDA, where subnormals are kept, an fp32 factor of 2^-127 times a clip
// coefficient was subnormal too, with fewer than 24 bits: the clipped step
// differed from the unscaled one (sdk::ScalarGradFactor splits it now).
void check_scale_of_two_to_the_127(const torch::Device& device, const std::string& where, std::uint64_t seed) {
  using Make = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>;
  ampfuse::FusedAdamOptions eight;
  eight.moments_8bit(true);
  const std::vector<std::pair<std::string, Make>> optimizers = {
      {"FusedAdam", [](auto p) { return std::make_unique<ampfuse::FusedAdam>(p, torch::optim::AdamOptions(1e-3)); }},
      {"FusedAdam 8-bit",
       [eight](auto p) { return std::make_unique<ampfuse::FusedAdam>(p, torch::optim::AdamOptions(1e-3), eight); }},
      {"FusedSGD", [](auto p) { return std::make_unique<ampfuse::FusedSGD>(p, torch::optim::SGDOptions(0.1).momentum(0.9)); }},
      {"FusedAdagrad", [](auto p) { return std::make_unique<ampfuse::FusedAdagrad>(p, torch::optim::AdagradOptions(0.1)); }},
      {"FusedRMSprop", [](auto p) { return std::make_unique<ampfuse::FusedRMSprop>(p, torch::optim::RMSpropOptions(0.01)); }},
      {"FusedLAMB", [](auto p) { return std::make_unique<ampfuse::FusedLAMB>(p, ampfuse::FusedLAMBOptions(0.01)); }},
      // The global norm of the scaled grads overflows fp32 at this scale (3.2e35 and more): it is unscaled in
      // double before its clip factor is taken (max_grad_norm / inf zeroed every grad).
      {"FusedLAMB max_grad_norm",
       [](auto p) { return std::make_unique<ampfuse::FusedLAMB>(p, ampfuse::FusedLAMBOptions(0.01).max_grad_norm(10.0)); }},
      {"FusedLAMB max_grad_norm clipping",
       [](auto p) { return std::make_unique<ampfuse::FusedLAMB>(p, ampfuse::FusedLAMBOptions(0.01).max_grad_norm(0.01)); }},
      {"torch::optim::Adam", [](auto p) { return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(1e-3)); }},
  };
  const double scale = 0x1p127;
  for (const auto& [name, make] : optimizers) {
    // clip: the scaler's clip_grad_norm_ as well (a clip coefficient of about 0.01, folded into a factor
    // of about 2^-134, rounded to 24 bits as a normal factor is: the same bits as the unscaled grads'
    // clip). The unscaled side steps under a scaler of scale 1, clipped alike.
    for (bool clip : {false, true}) {
      for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
        SCOPED_TRACE(where + ", " + name + ", " + ampfuse_test::dtype_name(dtype) + (clip ? ", clipped" : ""));
        torch::manual_seed(seed);
        std::vector<torch::Tensor> a, b, grads;
        for (std::int64_t n : {5000, 37}) {
          const auto w = torch::randn({n}).to(device, dtype);
          grads.push_back((torch::randn({n}) * 1e-3).to(device, dtype));
          a.push_back(w.clone().requires_grad_());
          b.push_back(w.clone().requires_grad_());
        }
        const auto before = a[0].detach().clone();
        auto scaled = make(a), plain = make(b);
        // unscaled_grads_after_step: the grads left after the step are what the update used, on both sides.
        ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(scale).unscaled_grads_after_step(true));
        ampfuse::GradScaler unit(ampfuse::GradScalerOptions().init_scale(1.0).unscaled_grads_after_step(true));
        for (int step = 0; step < 2; ++step) {
          for (std::size_t i = 0; i < grads.size(); ++i) {  // (the classic path unscales them in place)
            a[i].mutable_grad() = grads[i] * scale;  // exact, and finite
            b[i].mutable_grad() = grads[i].clone();
          }
          using Pair = std::pair<ampfuse::GradScaler*, torch::optim::Optimizer*>;
          for (const auto& [s, opt] : {Pair{&scaler, scaled.get()}, Pair{&unit, plain.get()}}) {
            s->scale(torch::ones({}, device));
            if (clip) s->clip_grad_norm_(*opt, 7e-4);
            s->step(*opt);
            s->update();  // (grows after 2000 steps: the scales stay)
          }
        }
        EXPECT_EQ(scaler.get_scale(), scale);
        EXPECT_FALSE(scaler.last_step_skipped(*scaled));
        // (bf16 parameters of about 1 do not move by a clipped SGD step of 1e-6.)
        if (dtype == torch::kFloat) EXPECT_FALSE(torch::equal(a[0].detach(), before)) << "the parameters did not move";
        for (std::size_t i = 0; i < a.size(); ++i) {
          EXPECT_TRUE(bitwise_equal(a[i].detach(), b[i].detach())) << "param " << i;
          EXPECT_TRUE(bitwise_equal(a[i].grad(), b[i].grad())) << "grad " << i;
        }
      }
    }
  }
}

TEST(GradScalerExtremes, AScaleOfTwoToThe127StepsAsTheUnscaledGrads) {
  const auto seed = ampfuse_test::seed_for_test();
  for (const std::string& isa : ampfuse::cpu::available_isas()) {
    ampfuse::sdk::cpu::force_isa(isa.c_str());
    check_scale_of_two_to_the_127(torch::kCPU, isa, seed);
  }
  ampfuse::sdk::cpu::force_isa("");
}

TEST(GradScalerExtremes, AScaleOfTwoToThe127StepsAsTheUnscaledGradsOnCuda) {
  if (!ampfuse_test::cuda_available()) GTEST_SKIP() << "no CUDA device here; this test runs on a GPU machine";
  check_scale_of_two_to_the_127(torch::kCUDA, "cuda", ampfuse_test::seed_for_test());
}

}  // namespace
