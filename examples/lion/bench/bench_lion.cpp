// FusedLion against Lion written with LibTorch's foreach ops (the five
// passes of lion-pytorch's foreach path, with a temporary for c), fp32, on
// CPU (and CUDA when a device is present). Both run on the same thread count
// (LION_BENCH_THREADS, default: all cores), printed in the context.
//
// bytes_per_second counts one Lion step's minimum traffic, the same for both:
// read p, g, m and write p, m (20 bytes per fp32 parameter).
//
//   bench_lion [--benchmark_filter=...]     LION_BENCH_SMOKE=1: small sets (ctest)

#include <ATen/Parallel.h>
#include <ampfuse/sdk/cpu.h>  // isa()
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "lion.h"

namespace {

constexpr double kLr = 1e-4, kBeta1 = 0.9, kBeta2 = 0.99, kWeightDecay = 0.1;

struct ParamSet {
  std::string name;
  std::vector<std::int64_t> numels;
};

std::vector<ParamSet> param_sets() {
  if (std::getenv("LION_BENCH_SMOKE") != nullptr)
    return {{"8x64K", std::vector<std::int64_t>(8, 64 << 10)}, {"100x4096", std::vector<std::int64_t>(100, 4096)}};
  return {{"8x8M", std::vector<std::int64_t>(8, 8 << 20)}, {"10000x4096", std::vector<std::int64_t>(10000, 4096)}};
}

// One set of tensors per contender, made on first use and kept for the
// repeated runs Google Benchmark makes while it settles the iteration count.
struct Fused {
  std::vector<torch::Tensor> params;
  std::unique_ptr<lion::FusedLion> opt;
};
struct Unfused {
  std::vector<torch::Tensor> params, grads, exp_avgs;
};

std::vector<torch::Tensor> randn_list(const ParamSet& set, torch::Device device) {
  std::vector<torch::Tensor> out;
  for (std::int64_t n : set.numels) out.push_back(torch::randn({n}, torch::TensorOptions(device)));
  return out;
}

Fused& fused_for(const ParamSet& set, torch::Device device) {
  static std::map<std::string, Fused> cache;
  Fused& f = cache[set.name + device.str()];
  if (!f.opt) {
    f.params = randn_list(set, device);
    const auto grads = randn_list(set, device);
    for (std::size_t i = 0; i < f.params.size(); ++i) f.params[i].mutable_grad() = grads[i];
    f.opt = std::make_unique<lion::FusedLion>(
        f.params, lion::LionOptions(kLr).betas({kBeta1, kBeta2}).weight_decay(kWeightDecay));
  }
  return f;
}

Unfused& unfused_for(const ParamSet& set, torch::Device device) {
  static std::map<std::string, Unfused> cache;
  Unfused& u = cache[set.name + device.str()];
  if (u.params.empty()) {
    u.params = randn_list(set, device);
    u.grads = randn_list(set, device);
    for (const auto& p : u.params) u.exp_avgs.push_back(torch::zeros_like(p));
  }
  return u;
}

// Lion with LibTorch's foreach ops, as lion-pytorch's foreach path does.
void unfused_lion_step(Unfused& u) {
  at::_foreach_mul_(u.params, 1 - kLr * kWeightDecay);
  std::vector<torch::Tensor> c = at::_foreach_lerp(u.exp_avgs, u.grads, 1 - kBeta1);  // beta1 m + (1 - beta1) g
  at::_foreach_sign_(c);
  at::_foreach_add_(u.params, c, -kLr);
  at::_foreach_lerp_(u.exp_avgs, u.grads, 1 - kBeta2);
}

template <class Step>
void run(benchmark::State& state, torch::Device device, std::int64_t numel, Step&& step) {
  step();  // warm-up: state creation, allocator
  if (device.is_cuda()) torch::cuda::synchronize();
  for (auto _ : state) {
    step();
    if (device.is_cuda()) torch::cuda::synchronize();
  }
  state.SetBytesProcessed(state.iterations() * 20 * numel);
}

void register_all(torch::Device device) {
  const std::string dev = device.is_cuda() ? "@cuda" : "";
  for (const ParamSet& set : param_sets()) {
    std::int64_t numel = 0;
    for (std::int64_t n : set.numels) numel += n;
    benchmark::RegisterBenchmark(("Lion/ours/" + set.name + dev).c_str(), [=](benchmark::State& state) {
      Fused& f = fused_for(set, device);
      run(state, device, numel, [&] { f.opt->step(); });
    })->UseRealTime()->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("Lion/torch_foreach/" + set.name + dev).c_str(), [=](benchmark::State& state) {
      Unfused& u = unfused_for(set, device);
      run(state, device, numel, [&] { unfused_lion_step(u); });
    })->UseRealTime()->Unit(benchmark::kMillisecond);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int threads = static_cast<int>(std::thread::hardware_concurrency());
  if (const char* env = std::getenv("LION_BENCH_THREADS")) threads = std::atoi(env);
  at::set_num_threads(threads);  // for both contenders
  std::cout << "threads: " << at::get_num_threads() << " (both contenders), cpu isa: " << ampfuse::sdk::cpu::to_string(ampfuse::sdk::cpu::current_isa())
            << "\n";
  benchmark::AddCustomContext("threads", std::to_string(at::get_num_threads()));
  benchmark::AddCustomContext("cpu_isa", ampfuse::sdk::cpu::to_string(ampfuse::sdk::cpu::current_isa()));
  register_all(torch::kCPU);
  if (torch::cuda::is_available()) register_all(torch::kCUDA);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
