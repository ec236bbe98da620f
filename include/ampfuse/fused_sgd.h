#pragma once
// FusedSGD: a drop-in replacement for torch::optim::SGD (it is one: same
// SGDOptions, parameter groups, state and checkpoint format) with a fused
// step, one parallel region per parameter group and dtype on CPU and one
// kernel launch on CUDA, and the scaler contract (ampfuse/contract.h).
//
// The momentum buffer is filled by the first step that is applied: a skipped
// first step leaves no buffer contents behind. On CPU the skip is known on
// the host, so such a step makes no state at all; on CUDA the buffer is made
// with a device flag, momentum_initialized, that the first applied step sets,
// and save() leaves out a buffer whose flag is still 0 (a sync, as any save
// from a GPU), so a checkpoint never holds an unfilled buffer.
//
// Sparse grads (an Embedding with sparse=true) are stepped as
// torch::optim::SGD steps them, with the same ATen ops in its order (bit for
// bit), on the classic path under GradScaler: p += -lr * grad at the grad's
// nonzeros; with momentum the buffer is, as LibTorch keeps it, a sparse
// clone of the first grad, scaled and added to by the later ones. Weight
// decay with a sparse grad is refused (as LibTorch refuses it), and so is a
// dense grad after a sparse buffer (sparse += dense, which LibTorch cannot
// do either).

#include <torch/arg.h>
#include <torch/optim/sgd.h>

#include <memory>
#include <string>
#include <vector>

#include "ampfuse/contract.h"
#include "ampfuse/sdk/optimizer.h"

namespace ampfuse {

/// ampfuse's options beyond LibTorch's SGDOptions (accepted unchanged).
struct FusedSGDOptions {
  FusedSGDOptions() = default;
  /// Maximize the objective, as PyTorch's maximize=True.
  TORCH_ARG(bool, maximize) = false;
};

/// FusedSGD's per-parameter state: torch::optim::SGD's, under the same
/// checkpoint keys, and on CUDA the momentum buffer's device flag.
struct FusedSGDParamState : torch::optim::SGDParamState, sdk::PooledState {
  /// CUDA with momentum: fp32, one element, non-zero once a step has filled
  /// momentum_buffer. Not saved.
  TORCH_ARG(at::Tensor, momentum_initialized);

 public:
  std::unique_ptr<torch::optim::OptimizerParamState> clone() const override {
    return std::make_unique<FusedSGDParamState>(*this);
  }
};

namespace detail {
struct FusedSgdWorkspace;
}

class FusedSGD : public sdk::FusedOptimizer<torch::optim::SGD, torch::optim::SGDOptions, FusedSGDParamState> {
 public:
  explicit FusedSGD(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                    torch::optim::SGDOptions defaults, FusedSGDOptions fused = {});
  explicit FusedSGD(std::vector<at::Tensor> params, torch::optim::SGDOptions defaults, FusedSGDOptions fused = {});
  ~FusedSGD() override;

  const FusedSGDOptions& fused_options() const { return fused_; }

 protected:
  const char* name() const override { return "FusedSGD"; }
  bool takes_float64() const override { return true; }
  bool updates_runs_in_place() const override { return true; }  // a column slice stepped where it lies
  /// The momentum buffer (a sparse one, kept by sparse grads, stays sparse).
  void follow_param(const at::Tensor& param, FusedSGDParamState& state, const sdk::Follow& follow) override;
  void check_state(const at::Tensor& param, const FusedSGDParamState& state, std::size_t group,
                   std::size_t index) const override;
  sdk::Launch prepare_list(const sdk::ParamList& list) override;
  /// momentum (not 0), which adds momentum_buffer to a group's state.
  std::uint64_t plan_key(std::size_t group) const final { return options_of(group).momentum() != 0 ? 1 : 0; }
  bool takes_sparse_grads() const override { return true; }
  sdk::Launch prepare_sparse(const sdk::Entry& entry) override;
  bool has_saved_state(const FusedSGDParamState& state) const override;
  std::vector<std::string> saved_state_keys() const override { return {"momentum_buffer"}; }
  std::size_t state_stamp(const FusedSGDParamState& state) const override {
    return stamp_tensors({&state.momentum_buffer(), &state.momentum_initialized()});
  }

 private:
  FusedSGDOptions fused_;
  std::unique_ptr<detail::FusedSgdWorkspace> workspace_;
};

}  // namespace ampfuse
