#pragma once
// Shared set-up of the benchmarks: thread count, parameter sets, naming.
//
// Every contender runs with the same thread count, set explicitly
// (AMPFUSE_BENCH_THREADS, default: all cores), since ATen may default to 1.
// Names are <operation>/<contender>/<parameter set>; bench/report.py turns
// them into ratio tables. "ours" is ampfuse; "ceiling_*" are traffic twins.

#include <benchmark/benchmark.h>
#include <ampfuse/grad_scaler.h>
#include <ampfuse/multi_tensor.h>
#include <torch/torch.h>

#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

namespace ampfuse_bench {

using Fn = std::function<void()>;

/// Times fn (after one warm-up call) and reports `bytes` per call: CPU wall
/// time, or CUDA events around batches of calls on a CUDA device.
void run_timed(benchmark::State& state, torch::Device device, const Fn& fn, std::int64_t bytes);
/// Registers <name>, whose function is made by make() when it first runs.
void register_one(const std::string& name, torch::Device device, std::function<Fn()> make, std::int64_t bytes);
/// The same with make(state), which may set the benchmark's counters.
void register_one(const std::string& name, torch::Device device, std::function<Fn(benchmark::State&)> make,
                  std::int64_t bytes);

// Adds the fastest repetition as a statistic ("min"), beside the mean and
// median; bench/report.py reports it (bench_engine.cpp says why).
void add_fastest_statistic(benchmark::internal::Benchmark* b);

void register_engine(torch::Device device);
void register_scaler(torch::Device device);
void register_adam(torch::Device device);
void register_sgd(torch::Device device);
void register_lamb(torch::Device device);
void register_adagrad_rmsprop(torch::Device device);
void register_subnormal(torch::Device device);
void register_float64(torch::Device device);
void register_host(torch::Device device);
void register_zero(torch::Device device);
void register_adam8(torch::Device device);


inline int bench_threads() {
  if (const char* env = std::getenv("AMPFUSE_BENCH_THREADS")) return std::atoi(env);
  return static_cast<int>(std::thread::hardware_concurrency());
}

struct ParamSet {
  std::string name;
  std::vector<std::int64_t> numels;
};

/// The optimizer parameter sets: 64M in 8 tensors, 10,000 x 4,096, GPT-2 small (148 tensors, 124M).
const std::vector<ParamSet>& optimizer_sets();

/// fp32 parameters (grads attached) and state-sized buffers, made once per
/// set and device and shared by every contender.
struct OptimizerData {
  std::vector<torch::Tensor> params, grads, exp_avg, exp_avg_sq, steps;
  /// params without autograd (the same storage), as ATen's fused ops take
  /// them: made once, not in the timed loop (detaching 10,000 tensors took
  /// 3-4 ms, which ATen's contenders paid at every step).
  std::vector<torch::Tensor> detached_params;
};
OptimizerData& optimizer_data(const ParamSet& set, torch::Device device);

/// The float pointers of a set's data, for a traffic twin: params, grads and
/// the two state-sized buffers.
struct TwinPointers {
  std::vector<float*> p, g, m, v;
};
using TwinFn = std::function<void(const TwinPointers&, const ampfuse::Plan&)>;

/// Registers <op>/ceiling_twin/<set> on CPU (twin over the engine's chunks)
/// or <op>/ceiling_d2d_copy/<set>@cuda on CUDA (a copy moving the same
/// bytes), for an operation that moves bytes_per_param per fp32 parameter.
void register_ceiling(const std::string& op, const ParamSet& set, torch::Device device, std::int64_t bytes_per_param,
                      TwinFn twin);

/// 64M fp32 in one tensor (the large case) and 10,000 x 4,096 (many small).
inline const std::vector<ParamSet>& engine_sets() {
  static const std::vector<ParamSet> sets = {
      {"1x64M", {64ll << 20}},
      {"10000x4096", std::vector<std::int64_t>(10000, 4096)},
  };
  return sets;
}

/// Random tensors per set and dtype, made once and shared by all contenders.
inline std::vector<torch::Tensor>& tensors_for(const ParamSet& set, torch::Device device = torch::kCPU,
                                               torch::Dtype dtype = torch::kFloat, int which = 0) {
  static std::map<std::string, std::vector<torch::Tensor>> cache;
  const std::string key = set.name + "/" + device.str() + "/" + std::to_string(static_cast<int>(dtype)) + "/" +
                          std::to_string(which);
  auto it = cache.find(key);
  if (it == cache.end()) {
    std::vector<torch::Tensor> list;
    for (std::int64_t n : set.numels) list.push_back(torch::randn({n}, torch::TensorOptions().dtype(dtype).device(device)));
    it = cache.emplace(key, std::move(list)).first;
  }
  return it->second;
}

/// 4 column slices of 4096 x 4096 fp32 tensors, [4096, 2048] each (rows of
/// 8 KB with 8 KB gaps), made once per device and shared by all contenders:
/// grads (which = 0) or parameters (which = 1) that are views with gaps.
inline const ParamSet& gapped_set() {
  static const ParamSet set{"4x4096x2048gaps", std::vector<std::int64_t>(4, 4096ll * 2048)};
  return set;
}
inline std::vector<torch::Tensor>& gapped_tensors(torch::Device device, int which) {
  static std::map<std::string, std::vector<torch::Tensor>> cache;
  const std::string key = device.str() + "/" + std::to_string(which);
  auto it = cache.find(key);
  if (it == cache.end()) {
    std::vector<torch::Tensor> list;
    for (int i = 0; i < 4; ++i)
      list.push_back(torch::randn({4096, 4096}, torch::TensorOptions().device(device)).narrow(1, 0, 2048));
    it = cache.emplace(key, std::move(list)).first;
  }
  return it->second;
}

/// A step of `opt` under a GradScaler as a training loop makes it, for
/// timing: before() where given, clip_grad_norm_(clip_norm) where it is not
/// 0, scaler.step(opt), scaler.update(). The scale stays `scale` (its growth
/// interval outlasts any run).
inline Fn scaler_steps(std::shared_ptr<torch::optim::Optimizer> opt, torch::Device device, double scale = 1.0,
                       double clip_norm = 0.0, Fn before = nullptr) {
  auto scaler =
      std::make_shared<ampfuse::GradScaler>(ampfuse::GradScalerOptions().init_scale(scale).growth_interval(1 << 30));
  scaler->scale(torch::ones({}, torch::TensorOptions().device(device)));
  return [=] {
    if (before) before();
    if (clip_norm != 0.0) scaler->clip_grad_norm_(*opt, clip_norm);
    scaler->step(*opt);
    scaler->update();
  };
}

inline std::int64_t total_numel(const ParamSet& set) {
  std::int64_t n = 0;
  for (auto v : set.numels) n += v;
  return n;
}

}  // namespace ampfuse_bench
