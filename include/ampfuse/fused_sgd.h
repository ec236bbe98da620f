#pragma once
// FusedSGD: a drop-in replacement for torch::optim::SGD (it is one: same
// SGDOptions, parameter groups, state and checkpoint format) with a fused
// step, one parallel region per parameter group and dtype on CPU and one
// kernel launch on CUDA, and the scaler contract (ampfuse/contract.h).
//
// The momentum buffer is created by the first step that is applied: a
// skipped first step leaves no buffer (on CPU no state at all; on CUDA the
// buffer's memory is reserved but only published to the state, by save() or
// sync_state(), once a step has filled it).

#include <torch/arg.h>
#include <torch/optim/sgd.h>

#include <memory>

#include "ampfuse/contract.h"
#include "ampfuse/sdk/optimizer.h"

namespace ampfuse {

/// ampfuse's options beyond LibTorch's SGDOptions (accepted unchanged).
struct FusedSGDOptions {
  FusedSGDOptions() = default;
  /// Maximize the objective, as PyTorch's maximize=True.
  TORCH_ARG(bool, maximize) = false;
};

namespace detail {
struct FusedSgdState;
}

class FusedSGD : public sdk::FusedOptimizer<torch::optim::SGD, torch::optim::SGDOptions, torch::optim::SGDParamState> {
 public:
  explicit FusedSGD(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                    torch::optim::SGDOptions defaults, FusedSGDOptions fused = {});
  explicit FusedSGD(std::vector<at::Tensor> params, torch::optim::SGDOptions defaults, FusedSGDOptions fused = {});
  ~FusedSGD() override;

  /// Publishes momentum buffers filled on the device into the state (syncs on CUDA).
  void sync_state();
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  const FusedSGDOptions& fused_options() const { return fused_; }

 protected:
  const char* name() const override { return "FusedSGD"; }
  void check_state(const at::Tensor& param, const torch::optim::SGDParamState& state, std::size_t group,
                   std::size_t index) const override;
  void step_list(const sdk::ParamList& list) override;

 private:
  FusedSGDOptions fused_;
  std::unique_ptr<detail::FusedSgdState> impl_;
};

}  // namespace ampfuse
