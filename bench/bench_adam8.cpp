// FusedAdam with moments_8bit against 32-bit FusedAdam and against its own
// traffic twin (read p, g and a byte of each moment; write p and both bytes:
// 16 bytes per fp32 parameter, plus an fp32 absmax per moment and 256
// elements read and written). Every tensor of the sets has at least 4096
// elements, so every moment is 8-bit. Each row also reports the optimizer
// state it keeps, in bytes per parameter.

#include <ampfuse/fused_adam.h>
#include <ampfuse/tensor_ops.h>

#include <memory>

#include "bench/ceilings.h"
#include "bench/common.h"

namespace ampfuse_bench {
namespace {

double state_bytes_per_param(const ampfuse::FusedAdam& opt, std::int64_t n) {
  std::int64_t bytes = 0;
  for (const auto& [key, state] : opt.state()) {
    const auto& s = static_cast<const ampfuse::FusedAdamParamState&>(*state);
    for (const at::Tensor* t : {&s.exp_avg(), &s.exp_avg_sq(), &s.exp_avg_8bit(), &s.exp_avg_absmax(),
                                &s.exp_avg_sq_8bit(), &s.exp_avg_sq_absmax()})
      if (t->defined()) bytes += static_cast<std::int64_t>(t->nbytes());
  }
  return static_cast<double>(bytes) / static_cast<double>(n);
}

void register_row(const std::string& name, const ParamSet& set, torch::Device device, std::int64_t bytes,
                  bool moments_8bit) {
  register_one(name, device, std::function<Fn(benchmark::State&)>([set, device, moments_8bit](benchmark::State& state) {
    OptimizerData& d = optimizer_data(set, device);
    auto opt = std::make_shared<ampfuse::FusedAdam>(d.params, torch::optim::AdamOptions(1e-4),
                                                    ampfuse::FusedAdamOptions().moments_8bit(moments_8bit));
    opt->step();  // makes the state
    state.counters["state_bytes_per_param"] = state_bytes_per_param(*opt, total_numel(set));
    return Fn([opt] { opt->step(); });
  }), bytes);
}

}  // namespace

void register_adam8(torch::Device device) {
  for (const ParamSet& set : optimizer_sets()) {
    if (set.name == "gpt2-124M") continue;  // has tensors under 4096 elements (32-bit moments)
    const std::int64_t n = total_numel(set), blocks = n / 256;
    const std::int64_t bytes = 16 * n + 2 * 8 * blocks;  // + each absmax read and written
    const std::string tail = "/" + set.name + (device.is_cuda() ? "@cuda" : "");
    register_row("Adam8/ours" + tail, set, device, bytes, true);
    register_row("Adam8/fused_adam_32bit" + tail, set, device, 28 * n, false);  // its own traffic: GB/s comparable
    if (device.is_cuda()) {
      register_ceiling("Adam8", set, device, 16, nullptr);  // a device-to-device copy of 16 bytes per parameter
      continue;
    }
    register_one("Adam8/ceiling_twin/" + set.name, device, [set] {
      OptimizerData& d = optimizer_data(set, torch::kCPU);
      auto plan = std::make_shared<ampfuse::Plan>(set.numels, ampfuse::cpu_chunk_size());
      auto codes = std::make_shared<std::vector<torch::Tensor>>();
      auto pointers = std::make_shared<Twin8Pointers>();
      for (std::size_t i = 0; i < d.params.size(); ++i) {
        codes->push_back(torch::zeros({set.numels[i]}, torch::kByte));
        codes->push_back(torch::zeros({set.numels[i]}, torch::kByte));
        pointers->p.push_back(d.params[i].data_ptr<float>());
        pointers->g.push_back(d.grads[i].data_ptr<float>());
        pointers->m.push_back((*codes)[2 * i].data_ptr<std::uint8_t>());
        pointers->v.push_back((*codes)[2 * i + 1].data_ptr<std::uint8_t>());
      }
      return Fn([plan, codes, pointers] { adam8_twin(*pointers, *plan); });
    }, bytes);
  }
}

}  // namespace ampfuse_bench
