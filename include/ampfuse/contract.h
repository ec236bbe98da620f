#pragma once
// The scaler contract (docs/contract.md): what GradScaler hands an optimizer
// at step(), and the interface an optimizer implements to receive it. Any
// optimizer, ampfuse's or a third party's, that implements ScalerAware gets
// unscale, clip and skip-on-inf in its own update pass, with no host sync.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

namespace c10d {
class ProcessGroup;
}

namespace ampfuse {

/// `device` as tensors name it: an index-less device (torch::kCUDA) is the
/// current one of its type, and CPU is "cpu", never "cpu:0". Where the
/// current device cannot be asked (no such backend, or no GPU), the device
/// stays as named. Everything ampfuse keys by device (scale signals, an
/// optimizer's per-device tensors) is keyed by this.
c10::Device canonical_device(c10::Device device);

/// The scaler's word for the grads of one optimizer on one device. Every
/// defined field is an fp32 tensor of one element on that device.
struct ScaleSignal {
  /// Multiply grads by it (in opmath) before use. Undefined when the grads are
  /// already unscaled, because GradScaler::unscale_ was called.
  at::Tensor inv_scale;
  /// Non-zero when any grad of this optimizer (any group, any device) is inf
  /// or NaN. Final before step_with_signals is called. It may be a sum:
  /// test != 0, never == 1.
  at::Tensor found_inf;
  /// Multiply the unscaled grads by it (fused gradient clipping). Undefined means 1.
  at::Tensor clip_coef;
};

/// The signals of one step: one per device that holds grads of the optimizer.
class StepSignals {
 public:
  /// Sets the signal of `device` (replacing an earlier one). A device without
  /// an index (torch::kCUDA) means the current one of its type, here and below.
  void set(c10::Device device, ScaleSignal signal);
  /// The signal of `device`; throws c10::Error naming the device when absent.
  const ScaleSignal& at(c10::Device device) const;
  bool contains(c10::Device device) const;
  const std::vector<std::pair<c10::Device, ScaleSignal>>& all() const { return signals_; }

 private:
  std::vector<std::pair<c10::Device, ScaleSignal>> signals_;
};

/// Implemented by optimizers that follow the contract. GradScaler::step calls
/// step_with_signals instead of unscaling the grads in place and reading
/// found_inf on the host. An implementation must, on every backend:
///  1. when found_inf != 0 (tested on the device), write nothing at all:
///     parameters, state, step counters and grads stay bit-identical;
///  2. otherwise use g * inv_scale * clip_coef, in opmath, as the gradient,
///     reading grads and never writing them;
///  3. never synchronize with the host (no .item(), no device-to-host copy);
///  4. advance step counters only on steps that were not skipped.
class ScalerAware {
 public:
  virtual ~ScalerAware() = default;
  virtual void step_with_signals(const StepSignals& signals) = 0;
  /// True when the optimizer's step() takes sparse grads, as its LibTorch
  /// counterpart's does (torch::optim::Adagrad's). In a step where any of
  /// its grads is sparse, GradScaler::step then takes PyTorch's path for it
  /// (unscale in place, one host read of found_inf, step() or skip): the
  /// contract path reads dense grads only. Default false: such a step goes
  /// to step_with_signals, which refuses sparse grads before writing.
  virtual bool steps_sparse_grads() const { return false; }
  /// Called by GradScaler once per iteration, before it first reads this
  /// optimizer's grads (in unscale_, clip_grad_norm_ or step, whichever
  /// comes first). A sharded optimizer reduces its grads into its shard
  /// here (distributed::ZeroOptimizer). Default: nothing.
  virtual void prepare_grads() {}
  /// The process group across which this optimizer's grads are sharded, or
  /// null. GradScaler then sums found_inf and the grads' sum of squares
  /// across it (as with GradScalerOptions::process_group, which it takes
  /// precedence over for this optimizer), so every rank skips and clips
  /// together. Default: null.
  virtual c10d::ProcessGroup* grads_sharded_over() const { return nullptr; }
  /// Optional, for one pass over the grads where two would walk them
  /// (GradScaler::step when nothing read them earlier in the iteration):
  /// steps as step_with_signals does, but calls `check_grads` once, after
  /// validating the parameters, grads and state (against the signals'
  /// devices) and before anything reads found_inf or writes. There the
  /// scaler fills the signals' found_inf; should it throw, the step writes
  /// nothing and rethrows. Returns false, having done nothing, where the
  /// optimizer does not offer this (the default): the scaler then checks
  /// first and calls step_with_signals.
  virtual bool step_with_grads_check(const StepSignals& /*signals*/, const std::function<void()>& /*check_grads*/) {
    return false;
  }
  /// Optional: step() (signals null) or step_with_signals(*signals), calling
  /// `check` once after everything that can refuse the step (validating the
  /// parameters, grads, state and options, making state) and before anything
  /// is written; should it throw, the step writes nothing and rethrows. A sharded optimizer agrees
  /// there with the other ranks that every rank can step
  /// (distributed::ZeroOptimizer). Returns false, having done nothing, where
  /// the optimizer does not offer this (the default).
  virtual bool step_checked(const StepSignals* /*signals*/, const std::function<void()>& /*check*/) { return false; }
  /// Names the grads that the optimizer's last step read, or the one in
  /// progress once it has validated them: while it stays the same (and not
  /// 0), the optimizer has the same parameters in the same order, each with
  /// the same grad tensor (same TensorImpl, data, size and dtype). Ids are
  /// never reused, not even by another optimizer. 0: none known (the
  /// default). With step_with_grads_check, it lets the scaler check through
  /// what it kept instead of walking the parameters again.
  virtual std::uint64_t grads_id() const { return 0; }
};

/// A new id for ScalerAware::grads_id, never returned before in this process.
std::uint64_t new_grads_id();

}  // namespace ampfuse
