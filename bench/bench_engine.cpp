// The multi-tensor engine's first users against ATen and the traffic twins:
//   Check      read-only non-finite check        (4 bytes per fp32 element)
//   CheckNorm  check + sum of squares for clipping (4 bytes; ATen: unscale + _foreach_norm)
//   Scale      in-place multiply by a device scalar (8 bytes)
// On CUDA (when a device is present) the same, timed with CUDA events, and
// the device-to-device copy ceiling.

#include <ampfuse/tensor_ops.h>

#if defined(AMPFUSE_WITH_CUDA)
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "bench/ceilings.h"
#include "bench/common.h"

#include <algorithm>
#include <vector>

namespace ampfuse_bench {

// Times fn on the device's own clock: CPU wall time, or CUDA events around a
// batch of launches (so that launch latency is not mistaken for bandwidth).
void run_timed(benchmark::State& state, torch::Device device, const Fn& fn, std::int64_t bytes) {
  // The bytes of one call, a constant (its min statistic is itself), from
  // which bench/report.py gives the fastest repetition's rate.
  state.counters["bytes_per_call"] = static_cast<double>(bytes);
  fn();  // warm-up: first-touch, metadata upload
#if defined(AMPFUSE_WITH_CUDA)
  if (device.is_cuda()) {
    constexpr int kBatch = 10;
    torch::cuda::synchronize();
    for (auto _ : state) {
      at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
      start.record();
      for (int i = 0; i < kBatch; ++i) fn();
      stop.record();
      stop.synchronize();
      state.SetIterationTime(start.elapsed_time(stop) / 1e3 / kBatch);
    }
    state.SetBytesProcessed(state.iterations() * bytes);
    return;
  }
#endif
  for (auto _ : state) fn();
  state.SetBytesProcessed(state.iterations() * bytes);
}

void register_one(const std::string& name, torch::Device device, std::function<Fn()> make, std::int64_t bytes) {
  register_one(name, device, std::function<Fn(benchmark::State&)>([make](benchmark::State&) { return make(); }), bytes);
}

void register_one(const std::string& name, torch::Device device, std::function<Fn(benchmark::State&)> make,
                  std::int64_t bytes) {
  auto* b = benchmark::RegisterBenchmark(name.c_str(), [device, make, bytes](benchmark::State& state) {
    const Fn fn = make(state);
    run_timed(state, device, fn, bytes);
  });
  // AMPFUSE_BENCH_MIN_TIME (seconds, default 0.5): shorter for a quick pass,
  // such as scripts/gpu-check.sh on a lent GPU.
  const char* env = std::getenv("AMPFUSE_BENCH_MIN_TIME");
  const double min_time = env != nullptr ? std::atof(env) : 0.0;
  b->Unit(benchmark::kMillisecond)->MinTime(min_time > 0.0 ? min_time : 0.5);
  if (device.is_cuda()) b->UseManualTime(); else b->UseRealTime();
  add_fastest_statistic(b);
}

void add_fastest_statistic(benchmark::internal::Benchmark* b) {
  // This VM's memory bandwidth is bimodal (an Adam 8x8M step took 17-19 or
  // 27-29 ms, every contender alike, 12 repetitions each), so a median of 5
  // moves with how many of a contender's repetitions met the slow state;
  // slowdowns only add, and the fastest is what the code costs.
  b->ComputeStatistics("min", [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); });
}

namespace {

std::vector<float*> float_pointers(std::vector<torch::Tensor>& list) {
  std::vector<float*> p;
  for (auto& t : list) p.push_back(t.data_ptr<float>());
  return p;
}

}  // namespace

void register_engine(torch::Device device) {
  const std::string dev = device.is_cuda() ? "@cuda" : "";
  auto fopts = torch::TensorOptions().dtype(torch::kFloat).device(device);
  for (const ParamSet& set : engine_sets()) {
    const std::int64_t n = total_numel(set);
    const std::string tail = "/" + set.name + dev;
    auto grads = [set, device]() -> std::vector<torch::Tensor>& { return tensors_for(set, device); };

    register_one("Check/ours" + tail, device, [=] {
      auto found = torch::zeros({1}, fopts);
      return Fn([=] { ampfuse::check_non_finite(grads(), found); });
    }, 4 * n);
    register_one("Check/aten_isfinite_all" + tail, device, [=] {
      return Fn([=] {
        for (const auto& t : grads()) benchmark::DoNotOptimize(at::isfinite(t).all());
      });
    }, 4 * n);
    register_one("Check/aten_amp_unscale" + tail, device, [=] {
      auto found = torch::zeros({1}, fopts);
      auto one = torch::ones({1}, fopts);
      return Fn([=]() mutable { at::_amp_foreach_non_finite_check_and_unscale_(grads(), found, one); });
    }, 4 * n);

    register_one("CheckNorm/ours" + tail, device, [=] {
      auto found = torch::zeros({1}, fopts);
      auto sum_sq = torch::zeros({1}, fopts);
      return Fn([=] { ampfuse::check_non_finite(grads(), found, sum_sq); });
    }, 4 * n);
    register_one("CheckNorm/aten_unscale_foreach_norm" + tail, device, [=] {
      auto found = torch::zeros({1}, fopts);
      auto one = torch::ones({1}, fopts);
      return Fn([=]() mutable {
        at::_amp_foreach_non_finite_check_and_unscale_(grads(), found, one);
        benchmark::DoNotOptimize(at::_foreach_norm(grads(), 2));
      });
    }, 4 * n);

    register_one("Scale/ours" + tail, device, [=] {
      auto s = torch::ones({1}, fopts);
      return Fn([=] { ampfuse::scale_(grads(), s); });
    }, 8 * n);
    register_one("Scale/aten_foreach_mul" + tail, device, [=] {
      auto s = torch::ones({}, fopts);  // ATen's foreach ops take a 0-dim tensor
      return Fn([=] { at::_foreach_mul_(grads(), s); });
    }, 8 * n);

    if (device.is_cpu()) {
      const ampfuse::Plan plan(set.numels, ampfuse::cpu_chunk_size());
      for (const char* op : {"Check", "CheckNorm"})
        register_one(std::string(op) + "/ceiling_read" + tail, device, [=] {
          const std::vector<float*> pointers = float_pointers(grads());  // once, not in the timed loop
          return Fn([=] { benchmark::DoNotOptimize(read_only_twin(pointers, plan)); });
        }, 4 * n);
      register_one("Scale/ceiling_read_write" + tail, device, [=] {
        const std::vector<float*> pointers = float_pointers(grads());
        return Fn([=] { read_write_twin(pointers, plan, 1.0f); });
      }, 8 * n);
    } else {
      for (const char* op : {"Check", "CheckNorm", "Scale"})
        register_one(std::string(op) + "/ceiling_d2d_copy" + tail, device, [=] {
          auto src = torch::empty({n}, fopts);
          auto dst = torch::empty({n}, fopts);
          return Fn([=]() mutable { dst.copy_(src); });
        }, 8 * n);
    }
  }
}

}  // namespace ampfuse_bench
