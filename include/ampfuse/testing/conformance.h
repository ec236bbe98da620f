#pragma once
// A conformance checker for the scaler contract (ampfuse/contract.h,
// docs/contract.md). Point check_contract at a factory of your optimizer; it
// returns the rules broken, each as a sentence naming the rule, dtype, device,
// seed and what differed. Empty: the optimizer conforms.
//
//   ampfuse::testing::ConformanceOptions o;
//   o.dtypes = {at::kFloat, at::kHalf};
//   auto failures = ampfuse::testing::check_contract(
//       [](std::vector<at::Tensor> p) { return std::make_unique<MyOptimizer>(std::move(p)); }, o);
//
// Free of any test framework, so it runs under any runner. State is compared
// through the optimizer's own save(); state kept elsewhere is seen only through
// the parameters of later steps. A host sync is seen on CUDA only.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "ampfuse/contract.h"
#include "ampfuse/sdk/optimizer.h"

#if defined(AMPFUSE_WITH_CUDA)
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace ampfuse::testing {

struct ConformanceOptions {
  c10::Device device = c10::kCPU;
  /// Parameter (and grad) dtypes, each checked in full.
  std::vector<c10::ScalarType> dtypes = {at::kFloat};
  /// Seeds every random tensor; quoted in each failure so that it replays.
  std::uint64_t seed = 0;
  /// Tolerance of the unscale and clip checks, for an optimizer whose contract
  /// step legitimately rounds differently from its step(). Default: bitwise.
  double rtol = 0, atol = 0;
  /// Applied steps in the counter check (enough for bias corrections to differ).
  int counter_steps = 3;
};

using OptimizerFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor> params)>;

/// Every failure starts with one of these labels.
inline constexpr const char* kNotScalerAware = "[not ScalerAware]";
inline constexpr const char* kRuleSkip = "[rule 1: skip writes nothing]";
inline constexpr const char* kRuleGradsRead = "[rule 2: grads are read, never written]";
inline constexpr const char* kRuleUnscale = "[rule 2: unscale honoured]";
inline constexpr const char* kRuleClip = "[rule 2: clip honoured]";
inline constexpr const char* kRuleNoSync = "[rule 3: no host sync]";
inline constexpr const char* kRuleCounters = "[rule 4: counters advance only on applied steps]";

namespace detail {

/// "" when a and b are bitwise equal (NaNs compared by position only: their
/// payloads may change in conversions), or within rtol/atol when given.
inline std::string tensor_diff(const at::Tensor& a, const at::Tensor& b, double rtol = 0, double atol = 0) {
  if (a.defined() != b.defined()) return a.defined() ? "defined vs undefined" : "undefined vs defined";
  if (!a.defined()) return "";
  std::ostringstream os;
  os.precision(std::numeric_limits<double>::max_digits10);
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) {
    os << a.sizes() << " " << a.scalar_type() << " vs " << b.sizes() << " " << b.scalar_type();
    return os.str();
  }
  const at::Tensor x = a.detach().cpu().contiguous().reshape(-1), y = b.detach().cpu().contiguous().reshape(-1);
  at::Tensor differ;
  if (x.is_floating_point() && (rtol > 0 || atol > 0)) {
    differ = at::isclose(x.to(at::kDouble), y.to(at::kDouble), rtol, atol, /*equal_nan=*/true).logical_not();
  } else if (x.is_floating_point()) {
    const auto bits = x.element_size() == 8 ? at::kLong : x.element_size() == 4 ? at::kInt : at::kShort;
    differ = x.view(bits).ne(y.view(bits)).logical_and(x.isnan().logical_and(y.isnan()).logical_not());
  } else {
    differ = x.ne(y);
  }
  const std::int64_t n = differ.sum().item<std::int64_t>();
  if (n == 0) return "";
  const std::int64_t i = differ.nonzero()[0][0].item<std::int64_t>();
  os << n << " of " << x.numel() << " elements differ, first at flat index " << i << " (" << x[i].item<double>()
     << " vs " << y[i].item<double>() << ")";
  return os.str();
}

/// What save() wrote, flattened to "path -> value", with each parameter's
/// TensorImpl address (LibTorch's key of its state) renamed "param<group>.<i>",
/// so that optimizers over different tensors compare. A round trip through
/// bytes: the InputArchive walks the state without knowing its classes.
using FlatState = std::map<std::string, c10::IValue>;

inline FlatState saved_state(const torch::optim::Optimizer& opt) {
  torch::serialize::OutputArchive out;
  opt.save(out);
  torch::serialize::InputArchive in = ampfuse::sdk::read_back(out);
  std::map<std::string, std::string> names;
  for (std::size_t g = 0; g < opt.param_groups().size(); ++g)
    for (std::size_t i = 0; i < opt.param_groups()[g].params().size(); ++i)
      names[std::to_string(reinterpret_cast<std::size_t>(opt.param_groups()[g].params()[i].unsafeGetTensorImpl()))] =
          "param" + std::to_string(g) + "." + std::to_string(i);
  const auto rename = [&](const std::string& s) { return names.count(s) ? names.at(s) : s; };
  FlatState flat;
  std::function<void(torch::serialize::InputArchive&, const std::string&)> walk = [&](auto& archive, auto& prefix) {
    for (const std::string& key : archive.keys()) {
      c10::IValue value;
      archive.read(key, value);
      torch::serialize::InputArchive nested;
      if (value.isModule() && archive.try_read(key, nested)) walk(nested, prefix + rename(key) + "/");
      else flat[prefix + rename(key)] = value.isString() ? c10::IValue(rename(value.toStringRef())) : value;
    }
  };
  walk(in, "");
  return flat;
}

/// "" when equal; else the first three differences.
inline std::string state_diff(const FlatState& a, const FlatState& b, double rtol = 0, double atol = 0) {
  std::vector<std::string> diffs;
  for (const auto& [path, va] : a) {
    const auto it = b.find(path);
    std::string d = it == b.end() ? "only in the first" : "";
    if (it != b.end() && va.isTensor() && it->second.isTensor()) {
      d = tensor_diff(va.toTensor(), it->second.toTensor(), rtol, atol);
    } else if (it != b.end() && (va.isTensor() || it->second.isTensor() || !(va == it->second))) {
      std::ostringstream os;
      os << va << " vs " << it->second;
      d = os.str();
    }
    if (!d.empty()) diffs.push_back(path + ": " + d);
  }
  for (const auto& entry : b)
    if (!a.count(entry.first)) diffs.push_back(entry.first + ": only in the second");
  std::string out;
  for (std::size_t i = 0; i < diffs.size() && i < 3; ++i) out += (i ? "; " : "") + diffs[i];
  if (diffs.size() > 3) out += "; and " + std::to_string(diffs.size() - 3) + " more";
  return out;
}

/// The checks on one dtype. The optimizers of a check all start from the
/// same parameter values, so that any two of them compare bitwise.
class Checker {
 public:
  using Tensors = std::vector<at::Tensor>;

  Checker(const OptimizerFactory& make, const ConformanceOptions& options, c10::ScalarType dtype,
          std::vector<std::string>& failures)
      : make_(make), o_(options), dtype_(dtype), failures_(failures) {
    for (const auto& s : shapes_) init_.push_back(random(s, 1 + init_.size()));
  }

  void run_all() {
    guarded(kRuleSkip, [&] { check_skip(); });
    guarded(kRuleGradsRead, [&] { check_grads_read(); });
    guarded(kRuleCounters, [&] { check_counters(); });
    const std::string s = std::to_string(static_cast<int>(scale_));
    guarded(kRuleUnscale, [&] {
      check_like_step(kRuleUnscale, 70, "grads * " + s + " and inv_scale 1/" + s + " (vs step() on the grads)",
                      scale_, signals(1 / scale_, 0, std::nullopt), 1);
    });
    guarded(kRuleClip, [&] {  // without inv_scale, as after GradScaler::unscale_
      check_like_step(kRuleClip, 90, "clip_coef 0.5 (vs step() on grads * 0.5)", 1,
                      signals(std::nullopt, 0, 0.5), 0.5);
    });
    guarded(kRuleNoSync, [&] { check_no_sync(); });
  }

 private:
  struct Run {
    Tensors params;
    std::unique_ptr<torch::optim::Optimizer> opt;
    ScalerAware* aware = nullptr;
  };

  Run make() {
    Run r;
    for (const auto& t : init_) r.params.push_back(t.clone().requires_grad_(true));
    r.opt = make_(r.params);
    r.aware = dynamic_cast<ScalerAware*>(r.opt.get());
    TORCH_CHECK(r.aware != nullptr, "the factory returned an optimizer that is not ScalerAware");
    return r;
  }

  // Normal values from a generator seeded by (seed, salt): each tensor replays
  // on its own, with the same values on every device.
  at::Tensor random(const std::vector<std::int64_t>& shape, std::uint64_t salt) const {
    at::Generator gen = at::detail::createCPUGenerator(o_.seed * 1000003u + salt);
    return at::randn(shape, gen, at::kFloat).to(dtype_).to(o_.device);
  }

  // Grads g with g * 0.5 exact in the parameter dtype (a subnormal would lose
  // its last bit), so that clip_coef 0.5 and a step on g * 0.5 see one gradient.
  Tensors grads(std::uint64_t salt) const {
    Tensors g;
    for (const auto& s : shapes_) g.push_back(random(s, salt * 64 + g.size()).mul(0.5).mul(2));
    return g;
  }

  // Grads as backward leaves them when the scaler skips: with inf and NaN. An
  // optimizer that "skips" by multiplying its update by 0 makes NaN of them.
  Tensors non_finite_grads(std::uint64_t salt) const {
    Tensors g = grads(salt);
    g[1].view(-1)[0].fill_(std::numeric_limits<double>::infinity());
    g[2].view(-1)[4].fill_(-std::numeric_limits<double>::infinity());
    g[3].view(-1)[40000].fill_(std::numeric_limits<double>::quiet_NaN());
    return g;
  }

  static Tensors times(const Tensors& ts, double factor) {
    Tensors out;
    for (const auto& t : ts) out.push_back(t.detach().mul(factor));
    return out;
  }
  static Tensors grads_of(const Run& r) {
    Tensors out;
    for (const auto& p : r.params) out.push_back(p.grad());
    return out;
  }

  // What a GradScaler hands over: 0-dim fp32 tensors on the device; nullopt
  // leaves inv_scale (grads already unscaled) or clip_coef (no clip) undefined.
  StepSignals signals(std::optional<double> inv_scale, double found_inf, std::optional<double> clip_coef) const {
    const auto scalar = [&](double v) { return at::full({}, v, at::TensorOptions(at::kFloat).device(o_.device)); };
    StepSignals out;
    out.set(o_.device, {inv_scale ? scalar(*inv_scale) : at::Tensor(), scalar(found_inf),
                        clip_coef ? scalar(*clip_coef) : at::Tensor()});
    return out;
  }
  // Each step gets its own copies of the grads, so that a write to them shows.
  static void step(Run& r, const Tensors& g, const StepSignals& s) {
    for (std::size_t i = 0; i < g.size(); ++i) r.params[i].mutable_grad() = g[i].clone();
    r.aware->step_with_signals(s);
  }
  void apply(Run& r, const Tensors& g) const { step(r, g, signals(1.0, 0, std::nullopt)); }
  void skip(Run& r, const Tensors& g, double found_inf = 1) const { step(r, g, signals(1 / scale_, found_inf, 0.5)); }

  void fail(const char* rule, const std::string& what) {
    std::ostringstream os;
    os << rule << " " << c10::toString(dtype_) << " params on " << o_.device << ", seed " << o_.seed << ": " << what;
    failures_.push_back(os.str());
  }

  // Records the first tensor that differs, if any; returns whether none did.
  bool same(const char* rule, const std::string& ctx, const char* what, const Tensors& a, const Tensors& b,
            double rtol = 0, double atol = 0) {
    for (std::size_t i = 0; i < a.size(); ++i) {
      const std::string d = tensor_diff(a[i], b[i], rtol, atol);
      if (d.empty()) continue;
      std::ostringstream os;
      os << ctx << ": " << what << " " << i << " (shape " << init_[i].sizes() << "): " << d;
      fail(rule, os.str());
      return false;
    }
    return true;
  }
  bool same_state(const char* rule, const std::string& ctx, const FlatState& a, const FlatState& b, double rtol = 0,
                  double atol = 0) {
    const std::string d = state_diff(a, b, rtol, atol);
    if (!d.empty()) fail(rule, ctx + ": saved state differs: " + d);
    return d.empty();
  }
  // Parameters, then (when they agree: one cause, one report) saved state.
  bool same(const char* rule, const std::string& ctx, const Run& a, const Run& b, double rtol = 0, double atol = 0) {
    return same(rule, ctx, "param", a.params, b.params, rtol, atol) &&
           same_state(rule, ctx, saved_state(*a.opt), saved_state(*b.opt), rtol, atol);
  }

  // A check that throws (the optimizer refused the input, or crashed) fails.
  template <class F>
  void guarded(const char* rule, F&& check) {
    try {
      check();
    } catch (const c10::Error& e) {
      fail(rule, std::string("the check threw: ") + e.what_without_backtrace());
    } catch (const std::exception& e) {
      fail(rule, std::string("the check threw: ") + e.what());
    }
  }

  // Rule 1: a skipped step leaves parameters, grads and state bit-identical,
  // for any non-zero found_inf (it is a sum across devices).
  void check_skip() {
    Run r = make();
    apply(r, grads(10));  // so that state exists
    for (const int found_inf : {1, 2}) {
      const Tensors g = found_inf == 1 ? non_finite_grads(11) : times(grads(12), scale_);
      const Tensors params = times(r.params, 1);  // a copy
      const FlatState state = saved_state(*r.opt);
      skip(r, g, found_inf);
      const std::string ctx = "a step with found_inf = " + std::to_string(found_inf) +
                              (found_inf == 1 ? " and grads holding inf and NaN" : "") +
                              ", after an applied step (after vs before)";
      same(kRuleSkip, ctx, "param", r.params, params);
      same(kRuleSkip, ctx, "grad", grads_of(r), g);
      same_state(kRuleSkip, ctx, saved_state(*r.opt), state);
    }
    // A skip as the very first step (no state yet), then an applied step: as
    // if only the applied step had been taken.
    Run first = make(), fresh = make();
    const Tensors g = non_finite_grads(13);
    skip(first, g);
    same(kRuleSkip, "a skipped first step (after vs before)", "param", first.params, init_);
    same(kRuleSkip, "a skipped first step (after vs before)", "grad", grads_of(first), g);
    apply(first, grads(14));
    apply(fresh, grads(14));
    same(kRuleSkip, "a skipped first step, then an applied one (vs the applied one alone)", first, fresh);
  }

  // Rule 2: grads are bit-identical after applied steps that unscale and clip.
  void check_grads_read() {
    Run r = make();
    for (int k = 1; k <= 2; ++k) {
      const Tensors g = times(grads(20 + k), scale_);
      step(r, g, signals(1 / scale_, 0, 0.5));
      const std::string ctx = "applied step " + std::to_string(k) + " with inv_scale and clip_coef (after vs before)";
      if (!same(kRuleGradsRead, ctx, "grad", grads_of(r), g)) return;
    }
  }

  // Rule 4: "skip, apply" repeated equals "apply" repeated, in parameters and
  // in saved state (Adam's bias corrections depend on the counters).
  void check_counters() {
    Run a = make(), b = make();
    for (int k = 1; k <= o_.counter_steps; ++k) {
      const Tensors g = grads(30 + k);
      apply(a, g);
      skip(b, non_finite_grads(50 + k));
      apply(b, g);
      const std::string ctx = "applied step " + std::to_string(k) +
                              ", each applied step preceded by a skipped one (vs the applied steps alone)";
      if (!same(kRuleCounters, ctx, b, a)) return;
    }
  }

  // Rule 2: step_with_signals on g * grad_factor with `signal` equals step()
  // on g * step_factor, in parameters and state, over two steps.
  void check_like_step(const char* rule, std::uint64_t salt, const std::string& what, double grad_factor,
                       const StepSignals& signal, double step_factor) {
    Run a = make(), b = make();
    for (int k = 1; k <= 2; ++k) {
      const Tensors g = grads(salt + k);
      step(a, times(g, grad_factor), signal);
      for (std::size_t i = 0; i < g.size(); ++i) b.params[i].mutable_grad() = g[i].mul(step_factor);
      b.opt->step();
      if (!same(rule, "step " + std::to_string(k) + " with " + what, a, b, o_.rtol, o_.atol)) return;
    }
  }

  // Rule 3, CUDA only: under sync debug mode L_ERROR, a synchronizing call
  // made through c10 (item(), a blocking copy, a stream sync) throws.
  void check_no_sync() {
#if defined(AMPFUSE_WITH_CUDA)
    if (!o_.device.is_cuda()) return;
    Run r = make();
    // Everything the steps take is made first: making it may sync.
    const Tensors g1 = grads(110), g2 = non_finite_grads(111), g3 = times(grads(112), scale_);
    const StepSignals first = signals(1.0, 0, std::nullopt), skipped = signals(1 / scale_, 2, 0.5),
                      then = signals(1 / scale_, 0, 0.5);
    struct Restore {  // the caller's mode, also when a step throws
      c10::cuda::SyncDebugMode previous = c10::cuda::warning_state().get_sync_debug_mode();
      ~Restore() { c10::cuda::warning_state().set_sync_debug_mode(previous); }
    } restore;
    const char* stage = "the first (state-creating) applied step";
    try {
      c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
      step(r, g1, first);
      stage = "a skipped step";
      step(r, g2, skipped);
      stage = "an applied step with inv_scale and clip_coef";
      step(r, g3, then);
    } catch (const c10::Error& e) {
      fail(kRuleNoSync, std::string(stage) + " synchronized with the host (caught by CUDA's sync debug mode): " +
                            e.what_without_backtrace());
    }
#endif
  }

  // In one parameter group: empty, one element, odd sizes, and one past 65536
  // elements (a 64Ki-element chunk).
  const std::vector<std::vector<std::int64_t>> shapes_ = {{0}, {1}, {7, 3}, {65537}, {33, 17}};
  const OptimizerFactory& make_;
  const ConformanceOptions& o_;
  const c10::ScalarType dtype_;
  std::vector<std::string>& failures_;
  // A power of two, so that g * S * (1 / S) == g exactly; small for fp16,
  // whose range ends at 65504.
  const double scale_ = dtype_ == at::kHalf ? 8.0 : 1024.0;
  Tensors init_;
};

}  // namespace detail

/// Returns the failures (empty when the optimizer conforms), each a sentence
/// naming the rule, dtype, device, seed and what differed.
inline std::vector<std::string> check_contract(const OptimizerFactory& make, const ConformanceOptions& options = {}) {
  const auto dtype = options.dtypes.empty() ? at::kFloat : options.dtypes.front();
  const auto probe = make({at::zeros({1}, at::TensorOptions(dtype).device(options.device)).requires_grad_()});
  if (dynamic_cast<const ScalerAware*>(probe.get()) == nullptr)
    return {std::string(kNotScalerAware) + " the optimizer does not implement ampfuse::ScalerAware (GradScaler " +
            "would unscale its grads in place and sync); no rule was checked (seed " + std::to_string(options.seed) +
            ")"};
  std::vector<std::string> failures;
  for (const c10::ScalarType t : options.dtypes) detail::Checker(make, options, t, failures).run_all();
  return failures;
}

}  // namespace ampfuse::testing
