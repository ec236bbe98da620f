#pragma once
// GradScaler for LibTorch: loss scaling for mixed-precision training with the
// semantics and numbers of torch.amp.GradScaler, plus fused gradient clipping
// and the scaler contract (ampfuse/contract.h) for optimizers that implement it.
//
//   ampfuse::GradScaler scaler;                 // init_scale 65536, growth 2, backoff 0.5, interval 2000
//   scaler.scale(loss).backward();
//   scaler.clip_grad_norm_(optimizer, 1.0);     // optional, one read-only pass
//   scaler.step(optimizer);                     // skipped when a grad is inf/NaN
//   scaler.update();
//
// Differences from PyTorch, all deliberate: fp16 and bf16 grads are unscaled
// on every device (PyTorch refuses fp16 in unscale_ and lacks bf16 on some
// builds); clipping is fused (no unscale pass, grads not rewritten);
// last_step_skipped() tells a scheduler what happened.
//
// As in PyTorch: sparse grads (an Embedding with sparse=true, stepped by
// torch::optim::SGD) are unscaled through their values, fp16 ones coalesced
// first (coalescing sums duplicates, which may overflow); fused optimizers
// refuse them, as torch::optim::Adam does. Grads that are strided views with
// gaps are checked and unscaled in place run by run (on CPU, where their runs
// of adjacent elements are long), or through dense copies written back.

#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "ampfuse/contract.h"

namespace ampfuse {

struct GradScalerOptions {
  GradScalerOptions() = default;
  /// Scale used on the first scale() call.
  TORCH_ARG(double, init_scale) = 65536.0;
  /// Factor the scale grows by after growth_interval steps without inf/NaN (> 1).
  TORCH_ARG(double, growth_factor) = 2.0;
  /// Factor the scale shrinks by on a step with inf/NaN (< 1).
  TORCH_ARG(double, backoff_factor) = 0.5;
  /// Consecutive clean steps before growing (> 0).
  TORCH_ARG(std::int64_t, growth_interval) = 2000;
  /// When false, every call passes through: scale() returns its input, step() just steps.
  TORCH_ARG(bool, enabled) = true;
  /// Lower bound the scale never backs off below; 0 (the default) means none, as in PyTorch.
  TORCH_ARG(double, min_scale) = 0.0;
  /// The contract path (ScalerAware optimizers) reads grads and never writes
  /// them, so after step() they still hold the scaled gradients. With this
  /// option, step() leaves in them what the update used, g * inv_scale *
  /// clip_coef (rounded to the grads' dtype), bit for bit the grads of the
  /// classic path, as after PyTorch's
  /// fused optimizers; a skipped step leaves them scaled, as PyTorch's fused
  /// optimizers do. It costs one read and one write of the grads after the
  /// update (8 bytes per fp32 parameter), on the device, with no host sync.
  TORCH_ARG(bool, unscaled_grads_after_step) = false;
  /// The ranks whose grads one step covers together, each holding its own
  /// part of them (a sharded optimizer, or model parallelism): with a
  /// process group, found_inf and the grad norm's sum of squares are summed
  /// across it (ShardedGradScaler's and FSDP clip_grad_norm_'s rule), so
  /// every rank skips together and clips by the global norm. One all-reduce
  /// of two fp64 values on the scale's device per check pass (step() or
  /// unscale_()) and per clip_grad_norm_(): NCCL keeps it on the stream (no
  /// host sync), Gloo waits. Every rank of the group must make the same
  /// calls, for each optimizer in the same order, also a rank without grads
  /// (it joins with zeros). Null (the default): nothing is reduced, which is
  /// right for data parallelism, whose grads are the same on every rank
  /// after their all-reduce.
  TORCH_ARG(c10::intrusive_ptr<c10d::ProcessGroup>, process_group);
};

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  /// outputs * scale. The scale is created on the first call, on that
  /// tensor's device; later calls on other devices use a copy.
  at::Tensor scale(const at::Tensor& outputs);
  std::vector<at::Tensor> scale(const std::vector<at::Tensor>& outputs);

  /// Unscales the optimizer's grads in place (one pass that also finds
  /// inf/NaN), for code that inspects grads itself. At most once per
  /// optimizer between update()s, and not after step().
  void unscale_(torch::optim::Optimizer& optimizer);

  /// The 2-norm of the optimizer's unscaled grads, computed in the same
  /// read-only pass that finds inf/NaN and turned into a clip coefficient
  /// min(1, max_norm / (norm + 1e-6)) on the device; step() applies it. Grads
  /// are not rewritten. Returns the norm as a device tensor (no host sync).
  /// Only norm_type 2 is fused; for another norm, unscale_ and use
  /// torch::nn::utils::clip_grad_norm_. A disabled scaler clips as
  /// torch::nn::utils::clip_grad_norm_ does, in place (under a sharded
  /// optimizer: its reduced shard's grads, the squares summed across its ranks).
  at::Tensor clip_grad_norm_(torch::optim::Optimizer& optimizer, double max_norm, double norm_type = 2.0);

  /// Steps the optimizer unless its grads hold inf/NaN. A ScalerAware
  /// optimizer gets the ScaleSignals and skips by itself, on the device: no
  /// host sync. Any other optimizer takes PyTorch's path: unscale in place,
  /// one host read of found_inf, step or skip. LBFGS is refused (closures are
  /// not supported with scaling, as in PyTorch).
  void step(torch::optim::Optimizer& optimizer);

  /// Backs off on inf/NaN seen by any optimizer since the last update, grows
  /// after growth_interval clean steps (never to a non-finite scale), on the
  /// device, with at::_amp_update_scale_'s arithmetic.
  void update();
  /// Sets the scale instead: a float, or a one-element float tensor on the scale's device type.
  void update(double new_scale);
  void update(const at::Tensor& new_scale);

  /// The scale as a one-element fp32 tensor on its device (no sync);
  /// undefined before the first scale() or when disabled.
  at::Tensor scale_tensor() const { return scale_; }
  /// The scale as a number. Synchronizes with the device.
  double get_scale() const;
  std::int64_t get_growth_tracker() const;
  /// Whether the last step() of this optimizer was skipped for inf/NaN.
  /// Synchronizes with the device. False when it never stepped.
  bool last_step_skipped(const torch::optim::Optimizer& optimizer) const;

  bool is_enabled() const { return options_.enabled(); }
  const GradScalerOptions& options() const { return options_; }

  /// PyTorch's getters and setters of the growth options, for the next
  /// update() on. As PyTorch's, the setters (and load()) take factors the
  /// constructor refuses: a growth factor of 1 never grows the scale, a
  /// backoff factor of 1 never backs off. Refused, changing nothing: a factor
  /// <= 0, inf or NaN (the scale would leave the positive finite numbers;
  /// PyTorch takes it) and an interval <= 0.
  /// A growth interval lowered to or below the clean steps counted so far
  /// grows the scale at the next clean update() (PyTorch's scaler stops
  /// growing until an inf/NaN resets its count).
  double get_growth_factor() const { return options_.growth_factor(); }
  void set_growth_factor(double growth_factor);
  double get_backoff_factor() const { return options_.backoff_factor(); }
  void set_backoff_factor(double backoff_factor);
  std::int64_t get_growth_interval() const { return options_.growth_interval(); }
  void set_growth_interval(std::int64_t growth_interval);

  /// PyTorch's state_dict keys: scale, growth_factor, backoff_factor,
  /// growth_interval, _growth_tracker (nothing when disabled).
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);

 private:
  enum class Stage { kReady, kUnscaled, kStepped };
  struct DeviceState {
    c10::Device device;
    at::Tensor found_inf;  // this device's own finding
    at::Tensor inv_scale;  // on the device; undefined once grads are unscaled in place
    at::Tensor clip_coef;  // undefined: no clipping
  };
  struct OptimizerState {
    Stage stage = Stage::kReady;
    bool checked = false;  // found_inf of every device is known
    bool clipped = false;
    bool prepared = false;                 // ScalerAware::prepare_grads ran this iteration
    c10d::ProcessGroup* group = nullptr;  // reduce across it (the optimizer's, else the options')
    std::vector<DeviceState> devices;
  };

  OptimizerState& state_of(const torch::optim::Optimizer& optimizer);
  void require_scale(const char* what) const;
  void prepare(torch::optim::Optimizer& optimizer, OptimizerState& state);
  void check_grads(torch::optim::Optimizer& optimizer, OptimizerState& state, bool unscale_in_place, const char* op);
  bool step_in_one_pass(torch::optim::Optimizer& optimizer, ScalerAware& aware, OptimizerState& state);
  void remember_grads_id(const torch::optim::Optimizer& optimizer, const ScalerAware& aware);
  at::Tensor inv_scale_on(c10::Device device) const;
  at::Tensor combined_found_inf(const OptimizerState& state, c10::Device device) const;
  void reduce_across_ranks(OptimizerState& state, bool found, at::Tensor* sum_sq, const char* op);
  void apply_deferred_factors(torch::optim::Optimizer& optimizer, const OptimizerState& state, bool unless_found);
  void end_iteration();

  GradScalerOptions options_;
  at::Tensor scale_;           // fp32, 0-dim
  at::Tensor growth_tracker_;  // int32, 0-dim
  double init_scale_;
  std::int64_t init_growth_tracker_ = 0;
  std::unordered_map<const torch::optim::Optimizer*, OptimizerState> per_optimizer_;
  std::unordered_map<const torch::optim::Optimizer*, at::Tensor> last_found_inf_;

  // What the scaler kept of each optimizer's grads, checked, so that a step
  // over the same grads does not check them again (grad_scaler.cpp). A copy
  // of the scaler starts without any.
  struct GradsPlan;
  struct GradsPlans {
    GradsPlans() = default;
    GradsPlans(const GradsPlans&) {}
    GradsPlans& operator=(const GradsPlans&) {
      plans.clear();
      return *this;
    }
    std::unordered_map<const torch::optim::Optimizer*, std::shared_ptr<GradsPlan>> plans;
  };
  const GradsPlan& grads_plan(torch::optim::Optimizer& optimizer, const char* op, bool in_place, bool for_norm);
  GradsPlans grads_plans_;
};

/// torch::save(scaler, path) / torch::load(scaler, path).
torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive, const GradScaler& scaler);
torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive, GradScaler& scaler);

}  // namespace ampfuse
