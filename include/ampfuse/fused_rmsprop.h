#pragma once
// FusedRMSprop: a drop-in replacement for torch::optim::RMSprop (it is one:
// same RMSpropOptions, parameter groups, state and checkpoint format) with a
// fused step, one parallel region per parameter group and dtype on CPU and
// one kernel launch on CUDA (plus one for the step counters), and the scaler
// contract (ampfuse/contract.h).
//
// Every option is supported: lr, alpha, eps, weight_decay, momentum and
// centered, with LibTorch's order of operations. fp32, fp16, bf16 and fp64
// parameters; the state is kept in the parameter's dtype, as LibTorch keeps
// it, and made at a parameter's first step (square_avg, momentum_buffer when
// momentum > 0, grad_avg when centered), or when an option that needs it is
// switched on later.
//
// Step counters: on CPU LibTorch's (step). On CUDA each parameter also has a
// device counter (fp64), so that a step skipped on the device does not
// count; it starts from step, and the checkpoint holds its value.

#include <torch/arg.h>
#include <torch/optim/rmsprop.h>

#include <memory>
#include <string>
#include <vector>

#include "ampfuse/contract.h"
#include "ampfuse/sdk/optimizer.h"

namespace ampfuse {

/// ampfuse's options beyond LibTorch's RMSpropOptions (accepted unchanged).
struct FusedRMSpropOptions {
  FusedRMSpropOptions() = default;
  /// Maximize the objective, as PyTorch's maximize=True.
  TORCH_ARG(bool, maximize) = false;
};

/// FusedRMSprop's per-parameter state: torch::optim::RMSprop's, under the
/// same checkpoint keys, and on CUDA the device step counter.
struct FusedRMSpropParamState : torch::optim::RMSpropParamState, sdk::PooledState {
  /// CUDA: the step counter advanced on the device, fp64, one element. Not
  /// saved: the checkpoint's step is its value.
  TORCH_ARG(at::Tensor, device_step);

 public:
  std::unique_ptr<torch::optim::OptimizerParamState> clone() const override {
    return std::make_unique<FusedRMSpropParamState>(*this);
  }
  void serialize(torch::serialize::OutputArchive& archive) const override;
  void serialize(torch::serialize::InputArchive& archive) override {
    torch::optim::RMSpropParamState::serialize(archive);
  }
};

class FusedRMSprop
    : public sdk::FusedOptimizer<torch::optim::RMSprop, torch::optim::RMSpropOptions, FusedRMSpropParamState> {
 public:
  explicit FusedRMSprop(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                        torch::optim::RMSpropOptions defaults = {}, FusedRMSpropOptions fused = {});
  explicit FusedRMSprop(std::vector<at::Tensor> params, torch::optim::RMSpropOptions defaults = {},
                        FusedRMSpropOptions fused = {});

  const FusedRMSpropOptions& fused_options() const { return fused_; }

 protected:
  const char* name() const override { return "FusedRMSprop"; }
  bool takes_float64() const override { return true; }
  bool updates_runs_in_place() const override { return true; }  // a column slice stepped where it lies
  /// square_avg, momentum_buffer and grad_avg.
  void follow_param(const at::Tensor& param, FusedRMSpropParamState& state, const sdk::Follow& follow) override;
  void check_state(const at::Tensor& param, const FusedRMSpropParamState& state, std::size_t group,
                   std::size_t index) const override;
  sdk::Launch prepare_list(const sdk::ParamList& list) override;
  /// momentum (> 0, as LibTorch decides it) and centered, which add
  /// momentum_buffer and grad_avg to a group's state.
  std::uint64_t plan_key(std::size_t group) const final {
    return (options_of(group).momentum() > 0 ? 1 : 0) | (options_of(group).centered() ? 2 : 0);
  }
  std::vector<std::string> saved_state_keys() const override {
    return {"step", "square_avg", "momentum_buffer", "grad_avg"};
  }
  std::size_t state_stamp(const FusedRMSpropParamState& state) const override {
    return stamp_tensors({&state.square_avg(), &state.momentum_buffer(), &state.grad_avg(), &state.device_step()});
  }

 private:
  FusedRMSpropOptions fused_;
};

}  // namespace ampfuse
