#pragma once
// Torch side of the SDK: the optimizer base that FusedAdam, FusedAdamW,
// FusedSGD and FusedLAMB are built on, and that a third-party optimizer
// derives from in the same way (docs/guide.md walks through Lion).
//
// FusedOptimizer<Base, Options, State> is a torch::optim::Optimizer (Base is
// torch::optim::Optimizer itself, or an existing LibTorch optimizer whose
// options, state and checkpoints should be shared, as FusedAdam shares
// torch::optim::Adam's). It implements step() and the scaler contract's
// step_with_signals() once for all:
//   1. validates every group, parameter, grad, existing state and scale
//      signal, throwing an error that names the optimizer, the group and the
//      parameter, before anything is written;
//   2. on CPU, decides a skipped step on the host (reading a CPU found_inf is
//      no device sync), so a skipped step creates no state either;
//   3. groups the parameters with grads by (group, device, dtype), in
//      parameter order, and calls step_list() once per list with the list's
//      ScaleSignal (null without a scaler).
// step_list() gets or creates per-parameter state (state_for), builds the
// kernel's pointer lists and runs one CPU parallel region (parallel_chunks)
// or one CUDA launch (make_launch_meta + the author's launcher). On CUDA
// the kernel itself must return early when *found_inf != 0 (contract rule
// 1), multiply grads by inv_scale and clip_coef (rule 2) and advance step
// counters only when it applies (rule 4), without reading anything on the
// host (rule 3); on CPU, step_list() is not called for a skipped step, and
// cpu_grad_factor() gives inv_scale * clip_coef.
//
// Checkpoints: with Base = torch::optim::Optimizer, save()/load() write and
// read Options and State with LibTorch's optimizer serialization (State and
// Options implement serialize(), as LibTorch's own do).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>
#include <torch/serialize/archive.h>

#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "ampfuse/contract.h"
#include "ampfuse/multi_tensor.h"
#include "ampfuse/sdk/cuda.h"
#include "ampfuse/tensor_ops.h"

namespace ampfuse::sdk {

/// A parameter with a grad, by its place in the optimizer. param and grad
/// refer to the optimizer's parameter and its grad, valid for the step (no
/// reference count is taken: a step over 10,000 parameters would spend more
/// on the atomic increments than on some kernels).
struct Entry {
  std::size_t group;
  std::size_t index;
  const at::Tensor& param;
  const at::Tensor& grad;
  c10::Device device;      ///< param.device(), read once
  c10::ScalarType dtype;   ///< param.scalar_type(), read once
  /// The parameter's state as validation found it (null when it had none);
  /// FusedOptimizer::state_for(entry, ...) uses it instead of a second lookup,
  /// so check_entries, begin_step and step_list must not replace or erase a
  /// stepped parameter's state (creating state for one that had none is fine).
  torch::optim::OptimizerParamState* state;
};

/// Validates every parameter of every group of `opt` (and the signals) and
/// returns those with grads. Accepted: fp32, fp16 and bf16 dense parameters
/// on CPU or CUDA, in one group only, with a dense grad of the same dtype,
/// device, shape and strides. check_state is called for each parameter with
/// a grad, to validate its existing state; it returns that state (null when
/// the parameter has none), kept in Entry::state. Throws c10::Error naming
/// `name`, the group and the parameter: of several bad parameters, the first
/// in group order. With many parameters the checks run on ATen's threads,
/// each over a contiguous range, so check_state must only read (it may run
/// for different parameters at once).
using CheckState =
    std::function<torch::optim::OptimizerParamState*(const at::Tensor& param, std::size_t group, std::size_t index)>;
std::vector<Entry> validate_params(torch::optim::Optimizer& opt, const char* name, const StepSignals* signals,
                                   const CheckState& check_state);

/// Throws unless state tensor `s` (when defined) fits parameter p: its
/// shape, strides and device, and the dtype the optimizer keeps it in.
void check_state_tensor(const at::Tensor& s, const at::Tensor& p, c10::ScalarType dtype, const char* name,
                        const char* what, std::size_t group, std::size_t index);

/// True when a CPU signal's found_inf is set (reading a CPU tensor is no
/// device sync): the CPU part of the step is then skipped on the host.
bool cpu_step_skipped(const StepSignals* signals);

/// inv_scale * clip_coef read on the host (CPU signals only); 1 without a signal.
float cpu_grad_factor(const ScaleSignal* signal);

/// A signal's fields as device pointers for a CUDA kernel (null when absent).
struct SignalPointers {
  const float* found_inf = nullptr;  ///< skip the step when *found_inf != 0
  const float* inv_scale = nullptr;  ///< multiply grads by it; null means 1
  const float* clip_coef = nullptr;  ///< and by it; null means 1
};
SignalPointers signal_pointers(const ScaleSignal* signal);

using ListKey = std::tuple<std::size_t, c10::Device, c10::ScalarType>;
using Lists = std::vector<std::pair<ListKey, std::vector<const Entry*>>>;

/// items grouped by key(item): groups in order of first appearance, items in order.
template <class Key, class T, class KeyFn>
std::vector<std::pair<Key, std::vector<T>>> group_by(const std::vector<T>& items, KeyFn&& key) {
  std::vector<std::pair<Key, std::vector<T>>> groups;
  for (const T& item : items) {
    const Key k = key(item);
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == k; });
    if (it == groups.end()) {
      groups.emplace_back(k, std::vector<T>{});
      it = std::prev(groups.end());
    }
    it->second.push_back(item);
  }
  return groups;
}

/// Entries by (group, device, dtype), in parameter order.
Lists group_lists(const std::vector<const Entry*>& entries);

/// Per-tensor scalars of a list are often all equal: compute f(key) once per run of equal keys.
template <class Key, class Value, class F>
std::vector<Value> per_tensor(const std::vector<Key>& keys, F&& f) {
  std::vector<Value> out;
  out.reserve(keys.size());
  for (std::size_t i = 0; i < keys.size(); ++i) out.push_back(i > 0 && keys[i] == keys[i - 1] ? out.back() : f(keys[i]));
  return out;
}

/// Parameters per thread below which host-side per-parameter work (validation,
/// parallel_entries) stays on the calling thread.
constexpr std::int64_t kEntriesGrain = 512;

/// Runs fn(i) for every i in [0, n) on ATen's threads when n is large
/// (contiguous ranges per thread), in order on this thread otherwise: for the
/// host-side work of a step over many parameters (reading data pointers),
/// which is mostly waiting on cache misses. fn must only read shared objects.
template <class F>
void parallel_entries(std::size_t n, F&& fn) {
  at::parallel_for(0, static_cast<std::int64_t>(n), kEntriesGrain, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e; ++i) fn(static_cast<std::size_t>(i));
  });
}

/// Runs a CPU kernel fn(chunk_begin, chunk_end) over every chunk of `plan`
/// in one parallel region (ATen's thread pool, at::get_num_threads()).
template <class F>
void parallel_chunks(const Plan& plan, F&& fn) {
  at::parallel_for(0, plan.num_chunks(), 1, [&](std::int64_t b, std::int64_t e) { fn(b, e); });
}

/// Advances the step counters of zero-element parameters (which no kernel
/// chunk covers) by one, or on the device by (found_inf == 0) under a
/// scaler: contract rule 4 without a host sync.
void advance_step_counters(const std::vector<at::Tensor>& steps, const ScaleSignal* signal);

#if defined(AMPFUSE_WITH_CUDA)
/// Launch metadata of `views` over `plan` for a kernel on `device`: packed
/// into `words` (which must outlive the launch call) and, when too long for
/// kernel arguments, uploaded once and cached while the list is unchanged.
cuda::LaunchMeta make_launch_meta(const TensorListsView& views, const Plan& plan, c10::Device device,
                                  std::vector<std::int64_t>& words);

/// The current CUDA stream of `device`, for a launcher.
cuda::Stream current_stream(c10::Device device);

/// Zeroed int32 counters, one per tensor of a list, for
/// once_per_tensor_after_reads; kept across steps (kernels leave them zeroed).
class TicketCounters {
 public:
  /// The counters of list `key`, at least num_tensors of them.
  unsigned* get(const ListKey& key, std::int64_t num_tensors);

 private:
  std::map<std::tuple<std::size_t, std::string, int>, at::Tensor> counters_;
};
#endif

/// True while the current CUDA stream of `device` is being captured in a
/// CUDA graph (false on CPU, and without CUDA). Host-side work that must not
/// be recorded into a graph (creating state, copying a host value to the
/// device) checks it.
bool stream_capturing(c10::Device device);

/// Throws, naming the optimizer, e's group and index and `what` (device-side
/// state a step keeps: a counter, a master copy, a buffer), when that state
/// is about to be made while e's stream is being captured in a CUDA graph:
/// made inside the graph, it would be made again at every replay. Call it
/// where the state is made; a warm-up step outside the capture makes it.
void refuse_under_capture(const Entry& e, const char* optimizer, const char* what);

/// One list of a step: the parameters with grads of one group on one
/// device with one dtype, and that device's scale signal.
struct ParamList {
  std::size_t group;
  c10::Device device;
  c10::ScalarType dtype;  ///< the torch dtype; kernel_dtype() is the kernels' ScalarType
  std::vector<const Entry*> entries;
  const ScaleSignal* signal;  ///< null when stepped without a scaler

  /// The storage type the kernels take (Float32, Float16 or BFloat16).
  ScalarType kernel_dtype() const { return to_scalar_type(dtype); }
};

/// The optimizer base (see the top of this file).
template <class Base, class Options, class State>
class FusedOptimizer : public Base, public ScalerAware {
 public:
  using Base::Base;
  using LossClosure = typename Base::LossClosure;

  /// One step on unscaled grads.
  at::Tensor step(LossClosure closure = nullptr) override {
    at::Tensor loss;
    if (closure) {
      at::AutoGradMode enable_grad(true);
      loss = closure();
    }
    run_step(nullptr);
    return loss;
  }

  /// The contract step (GradScaler::step calls it).
  void step_with_signals(const StepSignals& signals) override { run_step(&signals); }

  void save(torch::serialize::OutputArchive& archive) const override {
    if constexpr (std::is_same_v<Base, torch::optim::Optimizer>)
      torch::optim::serialize<State, Options>(archive, *this);
    else
      Base::save(archive);
  }
  void load(torch::serialize::InputArchive& archive) override {
    if constexpr (std::is_same_v<Base, torch::optim::Optimizer>)
      torch::optim::serialize<State, Options>(archive, *this);
    else
      Base::load(archive);
  }

 protected:
  /// The optimizer's name in error messages.
  virtual const char* name() const = 0;
  /// Validates a parameter's existing state (use check_state_tensor); throw to
  /// refuse. May run on several threads at once, for different parameters:
  /// read only.
  virtual void check_state(const at::Tensor& /*param*/, const State& /*state*/, std::size_t /*group*/,
                           std::size_t /*index*/) const {}
  /// Validates anything else about the step's parameters; throw to refuse.
  virtual void check_entries(const std::vector<Entry>& /*entries*/) const {}
  /// Called once per step after validation, before the first step_list():
  /// for optimizer-wide work such as a global gradient norm. `signals` is
  /// null without a scaler; CPU entries are left out when the CPU step is
  /// skipped.
  virtual void begin_step(const std::vector<const Entry*>& /*entries*/, const StepSignals* /*signals*/) {}
  /// Updates one list (see the top of this file). Called after validation.
  virtual void step_list(const ParamList& list) = 0;

  const Options& options_of(std::size_t group) const {
    return static_cast<const Options&>(this->param_groups()[group].options());
  }
  /// The state of p, or null.
  State* find_state(const at::Tensor& p) {
    auto it = this->state().find(p.unsafeGetTensorImpl());
    return it == this->state().end() ? nullptr : static_cast<State*>(it->second.get());
  }
  /// The state of p, made by init(State&) when p has none (then *created is
  /// true). Refuses to make state while p's stream is being captured in a
  /// CUDA graph: state created inside a graph would be re-created at every
  /// replay, so a warm-up step must come first.
  template <class Init>
  State& state_for(const at::Tensor& p, Init&& init, bool* created = nullptr) {
    auto it = this->state().find(p.unsafeGetTensorImpl());
    if (created) *created = it == this->state().end();
    if (it != this->state().end()) return static_cast<State&>(*it->second);
    return create_state(p, std::forward<Init>(init));
  }
  /// The same for a step's entry, without a second lookup when validation found its state.
  template <class Init>
  State& state_for(const Entry& e, Init&& init, bool* created = nullptr) {
    if (e.state != nullptr) {
      if (created) *created = false;
      return static_cast<State&>(*e.state);
    }
    return state_for(e.param, std::forward<Init>(init), created);
  }

 private:
  template <class Init>
  State& create_state(const at::Tensor& p, Init&& init) {
    TORCH_CHECK(!stream_capturing(p.device()), name(),
                ": a parameter has no state yet under CUDA graph capture; run one step outside the capture "
                "(a warm-up step) first, so that state is created outside the graph");
    auto st = std::make_unique<State>();
    init(*st);  // before inserting: a throwing init leaves no empty state behind
    State& ref = *st;
    this->state()[p.unsafeGetTensorImpl()] = std::move(st);
    return ref;
  }

  void run_step(const StepSignals* signals) {
    at::NoGradGuard no_grad;
    const std::vector<Entry> entries = validate_params(
        *this, name(), signals, [&](const at::Tensor& p, std::size_t g, std::size_t i) -> torch::optim::OptimizerParamState* {
          State* st = find_state(p);
          if (st != nullptr) check_state(p, *st, g, i);
          return st;
        });
    check_entries(entries);
    const bool skip_cpu = cpu_step_skipped(signals);
    std::vector<const Entry*> stepped;
    for (const Entry& e : entries)
      if (!(skip_cpu && e.device.is_cpu())) stepped.push_back(&e);
    begin_step(stepped, signals);
    for (auto& [key, list] : group_lists(stepped)) {
      const auto& [group, device, dtype] = key;
      step_list(ParamList{group, device, dtype, std::move(list), signals ? &signals->at(device) : nullptr});
    }
  }
};

}  // namespace ampfuse::sdk
