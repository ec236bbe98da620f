#pragma once
// Helpers shared by the test suites: reproducible seeds, devices, dtypes.

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <ampfuse/contract.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <memory>
#include <utility>

#include "contract/cpu/kernels.h"

#if defined(AMPFUSE_WITH_CUDA)
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace ampfuse_test {

/// A fresh seed per test, printed so that a failure can be replayed with
/// AMPFUSE_TEST_SEED=<seed>.
inline std::uint64_t seed_for_test() {
  std::uint64_t seed;
  if (const char* env = std::getenv("AMPFUSE_TEST_SEED")) {
    seed = std::strtoull(env, nullptr, 10);
  } else {
    seed = (static_cast<std::uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
  }
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::cout << "[ seed     ] " << (info ? std::string(info->test_suite_name()) + "." + info->name() : "?") << ": "
            << seed << "  (replay: AMPFUSE_TEST_SEED=" << seed << ")" << std::endl;  // flushed: a crash keeps it
  ::testing::Test::RecordProperty("seed", std::to_string(seed));
  torch::manual_seed(seed);
  return seed;
}

/// splitmix64's mix: the seeds of a randomized test's configurations, drawn
/// from its base seed (nearby bases give unrelated configurations).
inline std::uint64_t splitmix(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/// The seeds of a randomized test's configurations: `count` of them drawn
/// from `base` (the environment variable `count_env`, where set, says how
/// many), or the one `seed_env` names (a replay of one configuration).
inline std::vector<std::uint64_t> config_seeds(std::uint64_t base, int count, const char* count_env,
                                               const char* seed_env) {
  if (const char* env = std::getenv(seed_env)) return {std::strtoull(env, nullptr, 10)};
  if (const char* env = std::getenv(count_env)) count = std::atoi(env);
  std::vector<std::uint64_t> seeds;
  for (int c = 0; c < count; ++c) seeds.push_back(splitmix(splitmix(base) + static_cast<std::uint64_t>(c)));
  return seeds;
}

/// g's values in another layout: transposed (2-d, how 0), or a view whose
/// every stride is doubled (every other element of a wider tensor, from
/// element how % 2).
inline torch::Tensor odd_layout(const torch::Tensor& g, int how) {
  if (g.dim() == 2 && how == 0) return g.t().contiguous().t();
  auto view = torch::zeros({g.numel(), 2}, g.options()).select(1, how % 2).view(g.sizes());
  view.copy_(g);
  return view;
}

inline bool cuda_available() { return torch::cuda::is_available(); }

#define AMPFUSE_SKIP_WITHOUT(device)                                        \
  do {                                                                      \
    if ((device).is_cuda() && !::ampfuse_test::cuda_available())            \
      GTEST_SKIP() << "no CUDA device here; this test runs on a GPU machine"; \
  } while (0)

inline std::string dtype_name(torch::Dtype t) {
  return t == torch::kFloat ? "f32" : t == torch::kHalf ? "f16" : t == torch::kBFloat16 ? "bf16" : t == torch::kDouble ? "f64" : "other";
}

/// Bitwise equality, NaNs compared by position (payloads may differ between
/// conversions, e.g. bf16 NaN is 0x7FC0 on CPU and 0x7FFF on CUDA).
inline ::testing::AssertionResult bitwise_equal(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type())
    return ::testing::AssertionFailure() << "shape or dtype differ: " << a.sizes() << " " << a.scalar_type()
                                         << " vs " << b.sizes() << " " << b.scalar_type();
  auto ac = a.contiguous().cpu(), bc = b.contiguous().cpu();
  if (!ac.is_floating_point())  // integers, complex: plain equality
    return torch::equal(ac, bc) ? ::testing::AssertionSuccess() : ::testing::AssertionFailure() << "values differ";
  const auto nan_a = ac.isnan(), nan_b = bc.isnan();
  if (!torch::equal(nan_a, nan_b)) return ::testing::AssertionFailure() << "NaN positions differ";
  const auto int_type = a.element_size() == 8 ? torch::kInt64 : a.element_size() == 4 ? torch::kInt32 : torch::kInt16;
  auto ia = ac.view(int_type).masked_fill(nan_a, 0), ib = bc.view(int_type).masked_fill(nan_b, 0);
  const auto diff = (ia != ib).flatten();  // indices into the flattened tensors
  if (diff.any().item<bool>()) {
    const auto idx = diff.nonzero()[0][0].item<std::int64_t>();
    return ::testing::AssertionFailure() << diff.sum().item<std::int64_t>() << " elements differ, first at " << idx
                                         << ": " << ac.flatten()[idx].item<float>() << " vs " << bc.flatten()[idx].item<float>();
  }
  return ::testing::AssertionSuccess();
}

/// A file name in the temp folder, unique to this process.
/// Leaf copies of `v` (detached, cloned, requiring grad), in `dtype`.
inline std::vector<torch::Tensor> leaf_copies(const std::vector<torch::Tensor>& v,
                                              torch::Dtype dtype = torch::kFloat) {
  std::vector<torch::Tensor> out;
  for (const auto& p : v) out.push_back(p.detach().to(dtype).clone().requires_grad_());
  return out;
}

/// The distance from 1 to the next value of `dtype` (a floating type: 2^-52,
/// 2^-23, 2^-10 for fp16, 2^-7 for bf16), as std::numeric_limits says.
inline double ulp_of(torch::Dtype dtype) {
  double eps = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "ulp_of",
                                  [&] { eps = static_cast<double>(std::numeric_limits<scalar_t>::epsilon()); });
  return eps;
}

/// Every element of a[i] within tol * (1 + |b[i]|) of b[i] (compared in fp64
/// on the CPU), plus, where `spread` is given, twice spread[i] at that
/// element (how far the problem itself moves it: see
/// expect_matches_over_hundred_steps); `what` names the comparison in a failure.
inline void expect_close(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b, double tol,
                         const std::string& what, const std::vector<torch::Tensor>& spread = {}) {
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].numel() == 0) continue;
    const auto x = a[i].detach().to(torch::kDouble).cpu(), y = b[i].detach().to(torch::kDouble).cpu();
    auto bound = tol * (1 + y.abs());
    if (!spread.empty()) bound = bound + 2 * spread[i].detach().to(torch::kDouble).cpu();
    const auto excess = ((x - y).abs() - bound).max().item<double>();
    EXPECT_LE(excess, 0.0) << what << ", tensor " << i << ": max |diff| " << (x - y).abs().max().item<double>();
  }
}

/// The message of the c10::Error fn() throws, or "(no error)".
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "(no error)";
}

/// opt.step() refuses, with a c10::Error whose message contains `message`.
inline void expect_step_refused(torch::optim::Optimizer& opt, const std::string& message) {
  try {
    opt.step();
    ADD_FAILURE() << "the step was taken; expected it refused with: " << message;
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), ::testing::HasSubstr(message));
  }
}

/// The differential test of an optimizer against LibTorch's: one to three
/// groups of three parameters (shapes 0, 1, odd, multi-chunk, 2-d) with
/// options drawn by random(rng) per group, 100 steps of random grads (negated
/// for the reference when `maximize`), then every parameter within tol; the
/// parameters (and so the state and the math) in `dtype`.
///
/// How close is close: two correct runs in the same precision round some
/// operations differently (ATen's add with alpha is a fused multiply-add,
/// ours two roundings, as at::_fused_adam_'s are), and an ill-conditioned
/// element amplifies that. At a first step, lr * g / (|g| + eps) with small
/// eps is a step function of g's sign: where a weight decay nearly cancels g,
/// the rounding decides the sign and moves the element by about lr; momentum
/// integrates such differences over the steps. A tolerance relative to the
/// final value holds for most seeds only. So each element may also differ by
/// twice how far it moves between two float64 twins of the reference whose
/// grads are multiplied by 1 +- 8 ulps of `dtype`: the problem's own
/// conditioning, measured in the run (as the soak does). Well-conditioned
/// elements, nearly all, get tol alone.
template <class Ours, class Ref, class Options, class Fused, class Random>
void expect_matches_over_hundred_steps(torch::Device device, std::mt19937_64& rng, Random&& random, Fused fused,
                                       bool maximize, double tol, torch::Dtype dtype = torch::kFloat) {
  const std::vector<std::vector<std::int64_t>> pool = {{0}, {1}, {3}, {17}, {33, 3}, {65537}, {129, 31}};
  const double perturb[2] = {8 * ulp_of(dtype), -8 * ulp_of(dtype)};
  std::vector<std::vector<torch::Tensor>> ours, ref, twin[2];
  std::vector<torch::optim::OptimizerParamGroup> og, rg, tg[2];
  const int groups = 1 + static_cast<int>(rng() % 3);
  for (int g = 0; g < groups; ++g) {
    ours.emplace_back();
    for (int i = 0; i < 3; ++i)
      ours.back().push_back(
          torch::randn(pool[rng() % pool.size()], torch::TensorOptions().device(device).dtype(dtype)).requires_grad_());
    ref.push_back(leaf_copies(ours.back(), dtype));
    const Options o = random(rng);
    og.emplace_back(ours.back(), std::make_unique<Options>(o));
    rg.emplace_back(ref.back(), std::make_unique<Options>(o));
    for (int t = 0; t < 2; ++t) {
      twin[t].push_back(leaf_copies(ours.back(), torch::kDouble));
      tg[t].emplace_back(twin[t].back(), std::make_unique<Options>(o));
    }
  }
  Ours opt(og, Options(0.01), fused);
  Ref ref_opt(rg, Options(0.01));
  Ref twin_opt[2] = {Ref(tg[0], Options(0.01)), Ref(tg[1], Options(0.01))};
  for (int step = 0; step < 100; ++step) {
    for (int g = 0; g < groups; ++g)
      for (std::size_t i = 0; i < ours[g].size(); ++i) {
        auto grad = torch::randn_like(ours[g][i]);
        ours[g][i].mutable_grad() = grad.clone();
        ref[g][i].mutable_grad() = maximize ? -grad : grad.clone();
        for (int t = 0; t < 2; ++t) twin[t][g][i].mutable_grad() = (maximize ? -grad : grad).to(torch::kDouble) * (1 + perturb[t]);
      }
    opt.step();
    ref_opt.step();
    for (auto& t : twin_opt) t.step();
  }
  for (int g = 0; g < groups; ++g) {
    std::vector<torch::Tensor> spread;
    for (std::size_t i = 0; i < ours[g].size(); ++i) spread.push_back((twin[0][g][i] - twin[1][g][i]).abs().detach());
    expect_close(ours[g], ref[g], tol, "group " + std::to_string(g), spread);
  }
}

/// A test on one device ("cpu" or "cuda", skipped without one), with a seed.
class DeviceTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    device_ = torch::Device(GetParam());
    AMPFUSE_SKIP_WITHOUT(device_);
    seed_for_test();
  }
  /// A random leaf parameter of `shape` and `dtype` on the test's device.
  torch::Tensor param(std::vector<std::int64_t> shape, torch::Dtype dtype) const {
    return torch::randn(shape, torch::TensorOptions().device(device_)).to(dtype).requires_grad_();
  }
  torch::Device device_{torch::kCPU};
};

inline std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("ampfuse_" + std::to_string(::getpid()) + "_" + name)).string();
}

/// The contract step a GradScaler would take on CPU grads scaled by 1/inv_scale.
inline void step_with_cpu_signal(ampfuse::ScalerAware& opt, float inv_scale, const torch::Tensor& found_inf) {
  ampfuse::StepSignals signals;
  signals.set(torch::kCPU, {torch::full({}, inv_scale), found_inf, {}});
  opt.step_with_signals(signals);
}

/// Fixture for tests parameterized by a device ("cpu", "cuda") and, on CPU,
/// an instruction set ("avx512", "avx2", "baseline"; "" on CUDA): skips what
/// this machine lacks, forces the instruction set, and seeds (printed).
/// Param needs string members `device` and `isa`.
template <class Param>
class DeviceIsaTest : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    const Param& c = this->GetParam();
    device_ = torch::Device(c.device);
    AMPFUSE_SKIP_WITHOUT(device_);
    if (!c.isa.empty()) {
      const auto isas = ampfuse::cpu::available_isas();
      if (std::find(isas.begin(), isas.end(), c.isa) == isas.end()) GTEST_SKIP() << "this CPU lacks " << c.isa;
      ampfuse::sdk::cpu::force_isa(c.isa.c_str());
    }
    seed_ = seed_for_test();
    rng_.seed(seed_);
  }
  void TearDown() override { ampfuse::sdk::cpu::force_isa(""); }

  /// Random leaf parameters of these shapes on the test's device.
  std::vector<torch::Tensor> make_params(const std::vector<std::vector<std::int64_t>>& shapes,
                                         torch::Dtype dtype = torch::kFloat) const {
    std::vector<torch::Tensor> out;
    for (const auto& s : shapes)
      out.push_back(torch::randn(s, torch::TensorOptions().device(device_)).to(dtype).requires_grad_());
    return out;
  }
  static std::vector<torch::Tensor> copies(const std::vector<torch::Tensor>& v, torch::Dtype dtype = torch::kFloat) {
    return leaf_copies(v, dtype);
  }

  torch::Device device_{torch::kCPU};
  std::uint64_t seed_ = 0;
  std::mt19937_64 rng_;
};

#if defined(AMPFUSE_WITH_CUDA)
/// Captures fn() in a CUDA graph on a side stream (kept, so it can be
/// inspected) and returns it with the number of its kernel nodes: the
/// launches a step costs.
inline std::pair<std::unique_ptr<at::cuda::CUDAGraph>, std::size_t> capture(const std::function<void()>& fn) {
  auto graph = std::make_unique<at::cuda::CUDAGraph>(/*keep_graph=*/true);
  torch::cuda::synchronize();
  {
    const c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromPool());
    graph->capture_begin();
    try {
      fn();
    } catch (...) {
      // End the (invalidated) capture, so that the CUDA tests after this one
      // do not run on a stream still capturing into the graph's pool.
      try {
        graph->capture_end();
      } catch (...) {
      }
      throw;
    }
    graph->capture_end();
  }
  torch::cuda::synchronize();
  cudaGraph_t g = graph->raw_cuda_graph();
  std::size_t num_nodes = 0;
  if (cudaGraphGetNodes(g, nullptr, &num_nodes) != cudaSuccess) return {std::move(graph), 0};
  std::vector<cudaGraphNode_t> nodes(num_nodes);
  cudaGraphGetNodes(g, nodes.data(), &num_nodes);
  std::size_t kernels = 0;
  for (cudaGraphNode_t n : nodes) {
    cudaGraphNodeType type;
    if (cudaGraphNodeGetType(n, &type) == cudaSuccess && type == cudaGraphNodeTypeKernel) ++kernels;
  }
  return {std::move(graph), kernels};
}
#endif

}  // namespace ampfuse_test
