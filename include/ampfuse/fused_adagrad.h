#pragma once
// FusedAdagrad: a drop-in replacement for torch::optim::Adagrad (it is one:
// same AdagradOptions, parameter groups, state and checkpoint format) with a
// fused step, one parallel region per parameter group and dtype on CPU and
// one kernel launch on CUDA (plus one for the step counters), and the scaler
// contract (ampfuse/contract.h).
//
// Every option is supported: lr, lr_decay, weight_decay,
// initial_accumulator_value and eps, with LibTorch's order of operations.
// fp32, fp16, bf16 and fp64 parameters (fp64 computes in fp64); the sum is
// kept in the parameter's dtype,
// as LibTorch keeps it. Like torch::optim::Adagrad, the constructor makes
// every parameter's state (sum = initial_accumulator_value); a parameter
// added later gets it at its first step, from its group's options.
//
// Sparse grads (an Embedding with sparse=true) are stepped as
// torch::optim::Adagrad steps them: with ATen's sparse ops over the grad's
// nonzeros (no weight decay, as in LibTorch), the same numbers bit for bit,
// on the classic path under GradScaler (one host read of found_inf).
//
// Step counters: on CPU LibTorch's (step). On CUDA each parameter also has a
// device counter (fp64), so that a step skipped on the device does not
// count; it starts from step, and the checkpoint holds its value.

#include <torch/arg.h>
#include <torch/optim/adagrad.h>

#include <memory>
#include <string>
#include <vector>

#include "ampfuse/contract.h"
#include "ampfuse/sdk/optimizer.h"

namespace ampfuse {

/// ampfuse's options beyond LibTorch's AdagradOptions (accepted unchanged).
struct FusedAdagradOptions {
  FusedAdagradOptions() = default;
  /// Maximize the objective, as PyTorch's maximize=True.
  TORCH_ARG(bool, maximize) = false;
};

/// FusedAdagrad's per-parameter state: torch::optim::Adagrad's, under the
/// same checkpoint keys, and on CUDA the device step counter.
struct FusedAdagradParamState : torch::optim::AdagradParamState, sdk::PooledState {
  /// CUDA: the step counter the kernels read on the device, fp64, one
  /// element. Not saved: the checkpoint's step is its value.
  TORCH_ARG(at::Tensor, device_step);

 public:
  std::unique_ptr<torch::optim::OptimizerParamState> clone() const override {
    return std::make_unique<FusedAdagradParamState>(*this);
  }
  void serialize(torch::serialize::OutputArchive& archive) const override;
  void serialize(torch::serialize::InputArchive& archive) override {
    torch::optim::AdagradParamState::serialize(archive);
  }
};

class FusedAdagrad
    : public sdk::FusedOptimizer<torch::optim::Adagrad, torch::optim::AdagradOptions, FusedAdagradParamState> {
 public:
  explicit FusedAdagrad(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                        torch::optim::AdagradOptions defaults = {}, FusedAdagradOptions fused = {});
  explicit FusedAdagrad(std::vector<at::Tensor> params, torch::optim::AdagradOptions defaults = {},
                        FusedAdagradOptions fused = {});

  const FusedAdagradOptions& fused_options() const { return fused_; }

 protected:
  const char* name() const override { return "FusedAdagrad"; }
  bool takes_float64() const override { return true; }
  bool updates_runs_in_place() const override { return true; }  // a column slice stepped where it lies
  /// The sum.
  void follow_param(const at::Tensor& param, FusedAdagradParamState& state, const sdk::Follow& follow) override;
  void check_state(const at::Tensor& param, const FusedAdagradParamState& state, std::size_t group,
                   std::size_t index) const override;
  sdk::Launch prepare_list(const sdk::ParamList& list) override;
  bool takes_sparse_grads() const override { return true; }
  sdk::Launch prepare_sparse(const sdk::Entry& entry) override;
  std::vector<std::string> saved_state_keys() const override { return {"step", "sum"}; }
  std::size_t state_stamp(const FusedAdagradParamState& state) const override {
    return stamp_tensors({&state.sum(), &state.device_step()});
  }

 private:
  FusedAdagradOptions fused_;
};

}  // namespace ampfuse
