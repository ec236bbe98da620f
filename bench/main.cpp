// One benchmark binary: engine ops, scaler overhead (and, as they land, the
// optimizers), on CPU and, when a device is present, on CUDA.

#include <ampfuse/tensor_ops.h>

#include "bench/common.h"

int main(int argc, char** argv) {
  const int threads = ampfuse_bench::bench_threads();
  torch::set_num_threads(threads);
  benchmark::AddCustomContext("threads", std::to_string(torch::get_num_threads()));
  benchmark::AddCustomContext("cpu_isa", ampfuse::cpu_isa());
  std::vector<torch::Device> devices = {torch::kCPU};
  if (torch::cuda::is_available()) devices.push_back(torch::kCUDA);
  for (const auto& device : devices) {
    ampfuse_bench::register_engine(device);
    ampfuse_bench::register_scaler(device);
    ampfuse_bench::register_adam(device);
    ampfuse_bench::register_adam8(device);
    ampfuse_bench::register_sgd(device);
    ampfuse_bench::register_lamb(device);
    ampfuse_bench::register_adagrad_rmsprop(device);
    ampfuse_bench::register_subnormal(device);
    ampfuse_bench::register_float64(device);
    ampfuse_bench::register_host(device);
    ampfuse_bench::register_zero(device);
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
