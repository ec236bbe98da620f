#pragma once
// Helpers shared by the test suites: reproducible seeds, devices, dtypes.

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <iostream>
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
            << seed << "  (replay: AMPFUSE_TEST_SEED=" << seed << ")\n";
  ::testing::Test::RecordProperty("seed", std::to_string(seed));
  torch::manual_seed(seed);
  return seed;
}

inline bool cuda_available() { return torch::cuda::is_available(); }

#define AMPFUSE_SKIP_WITHOUT(device)                                        \
  do {                                                                      \
    if ((device).is_cuda() && !::ampfuse_test::cuda_available())            \
      GTEST_SKIP() << "no CUDA device here; this test runs on a GPU machine"; \
  } while (0)

inline std::string dtype_name(torch::Dtype t) {
  return t == torch::kFloat ? "f32" : t == torch::kHalf ? "f16" : t == torch::kBFloat16 ? "bf16" : "other";
}

/// Bitwise equality, NaNs compared by position (payloads may differ between
/// conversions, e.g. bf16 NaN is 0x7FC0 on CPU and 0x7FFF on CUDA).
inline ::testing::AssertionResult bitwise_equal(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type())
    return ::testing::AssertionFailure() << "shape or dtype differ: " << a.sizes() << " " << a.scalar_type()
                                         << " vs " << b.sizes() << " " << b.scalar_type();
  auto ac = a.contiguous().cpu(), bc = b.contiguous().cpu();
  if (!ac.is_floating_point() || ac.element_size() == 8)  // integers, complex, fp64: plain equality
    return torch::equal(ac, bc) ? ::testing::AssertionSuccess() : ::testing::AssertionFailure() << "values differ";
  const auto nan_a = ac.isnan(), nan_b = bc.isnan();
  if (!torch::equal(nan_a, nan_b)) return ::testing::AssertionFailure() << "NaN positions differ";
  const auto int_type = a.element_size() == 4 ? torch::kInt32 : torch::kInt16;
  auto ia = ac.view(int_type).masked_fill(nan_a, 0), ib = bc.view(int_type).masked_fill(nan_b, 0);
  const auto diff = (ia != ib);
  if (diff.any().item<bool>()) {
    const auto idx = diff.nonzero()[0][0].item<std::int64_t>();
    return ::testing::AssertionFailure() << diff.sum().item<std::int64_t>() << " elements differ, first at " << idx
                                         << ": " << ac[idx].item<float>() << " vs " << bc[idx].item<float>();
  }
  return ::testing::AssertionSuccess();
}

/// A file name in the temp folder, unique to this process.
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
