#pragma once
// What every fused optimizer's torch adapter shares: validation of groups,
// params, grads and state before the first write; the skip decision on CPU;
// lists by (group, device, dtype); CUDA launch metadata and ticket counters.

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ampfuse/contract.h"
#include "ampfuse/multi_tensor.h"

namespace ampfuse::fused {

/// A parameter with a grad, by its place in the optimizer.
struct Entry {
  std::size_t group;
  std::size_t index;
  at::Tensor param;
  at::Tensor grad;
};

/// Validates every parameter of every group and returns those with grads.
/// Throws c10::Error naming `name`, the group and the parameter. check_state
/// is called for each parameter with a grad, to validate its existing state.
std::vector<Entry> validate_params(
    torch::optim::Optimizer& opt, const char* name, const StepSignals* signals,
    const std::function<void(const at::Tensor& param, std::size_t group, std::size_t index)>& check_state);

/// Throws unless state tensor `s` (when defined) fits parameter p: its
/// shape, layout and device, and the dtype the optimizer keeps it in.
void check_state_tensor(const at::Tensor& s, const at::Tensor& p, c10::ScalarType dtype, const char* name,
                        const char* what, std::size_t group, std::size_t index);

/// True when a CPU signal's found_inf is set (reading a CPU tensor is no
/// device sync): the CPU part of the step is then skipped on the host, so a
/// skipped step creates no state either.
bool cpu_step_skipped(const StepSignals* signals);

using ListKey = std::tuple<std::size_t, c10::Device, c10::ScalarType>;
using Lists = std::vector<std::pair<ListKey, std::vector<const Entry*>>>;

/// Entries by (group, device, dtype), in parameter order; CPU ones left out when skip_cpu.
Lists group_lists(const std::vector<Entry>& entries, bool skip_cpu);

/// inv_scale * clip_coef read on the host (CPU signals only); 1 without a signal.
float cpu_grad_factor(const ScaleSignal* signal);

/// Per-tensor scalars of a list are often all equal: compute f(key) once per run of equal keys.
template <class Key, class Value, class F>
std::vector<Value> per_tensor(const std::vector<Key>& keys, F&& f) {
  std::vector<Value> out;
  out.reserve(keys.size());
  for (std::size_t i = 0; i < keys.size(); ++i) out.push_back(i > 0 && keys[i] == keys[i - 1] ? out.back() : f(keys[i]));
  return out;
}

#if defined(AMPFUSE_WITH_CUDA)
/// Zeroed int32 counters, one per tensor of a list, kept across steps (the
/// kernels leave them zeroed). Grown when the list grows.
at::Tensor& ticket_counters(std::map<std::tuple<std::size_t, std::string, int>, at::Tensor>& cache, const ListKey& key,
                            std::int64_t num_tensors);
#endif

}  // namespace ampfuse::fused
