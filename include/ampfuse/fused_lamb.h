#pragma once
// FusedLAMB: LAMB for large-batch training (You et al. 2019), as NVIDIA
// apex's FusedLAMB computes it, which PyTorch does not ship. A
// torch::optim::Optimizer with parameter groups, checkpoints (torch::save /
// torch::load) and the scaler contract, built on the SDK's optimizer base.
//
// Per tensor, the update u = m_hat / (sqrt(v_hat) + eps) + weight_decay * p
// is scaled by the trust ratio ||p|| / ||u|| (1 when either norm is 0),
// where weight_decay != 0 or use_nvlamb is set, and clamped to
// [trust_ratio_min, trust_ratio_max]. max_grad_norm clips by the global norm
// of the unscaled grads of the whole optimizer first. All norms are computed
// on the device: no host sync.
//
// Cost per step: on CPU two parallel regions per group and dtype; on CUDA
// two kernel launches per group and dtype (the first updates the moments
// and reduces the norms, the second applies the ratio), plus, with
// max_grad_norm, one read-only norm pass per device and dtype (three in all
// for one group; apex launches six or more). Memory: 40 bytes per fp32
// parameter (read p, g, m, v, write m, v; read p, m, v, write p), plus 4 with
// max_grad_norm.
//
// Parameters: fp32, fp16, bf16 or fp64; the moments are fp32 (fp64 for fp64 parameters). With
// master_weights, fp16/bf16 parameters also get an fp32 master copy (saved
// in the state) that the update runs on.

#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "ampfuse/contract.h"
#include "ampfuse/sdk/optimizer.h"

namespace ampfuse {

struct FusedLAMBOptions : public torch::optim::OptimizerCloneableOptions<FusedLAMBOptions> {
  FusedLAMBOptions(double lr = 1e-3);
  TORCH_ARG(double, lr) = 1e-3;
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-6;
  /// Decoupled weight decay, added to the update before the trust ratio.
  TORCH_ARG(double, weight_decay) = 0.01;
  /// Divide the moments by 1 - beta^step.
  TORCH_ARG(bool, bias_correction) = true;
  /// m = beta1 * m + (1 - beta1) * g; without it, m = beta1 * m + g.
  TORCH_ARG(bool, grad_averaging) = true;
  /// Clip by the global norm of the unscaled grads of all groups; 0: off.
  TORCH_ARG(double, max_grad_norm) = 0.0;
  /// Apply the trust ratio also where weight_decay is 0 (NVLAMB).
  TORCH_ARG(bool, use_nvlamb) = false;
  /// Clamp of the trust ratio (DeepSpeed uses 0.01 and 10).
  TORCH_ARG(double, trust_ratio_min) = 0.0;
  TORCH_ARG(double, trust_ratio_max) = std::numeric_limits<double>::infinity();
  /// fp16/bf16 parameters only: keep and update an fp32 master copy.
  TORCH_ARG(bool, master_weights) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

struct FusedLAMBParamState : public torch::optim::OptimizerCloneableParamState<FusedLAMBParamState>,
                             public sdk::PooledState {
  /// Steps applied: an fp64 tensor of one element on the parameter's device
  /// (advanced by the kernel on CUDA, so a skipped step is decided there); a
  /// whole number from 0 to 2^53, checked by load() and, on CPU, by every
  /// step (a step refuses a count set otherwise from outside, naming it).
  TORCH_ARG(torch::Tensor, step);
  TORCH_ARG(torch::Tensor, exp_avg);
  TORCH_ARG(torch::Tensor, exp_avg_sq);
  /// fp32 master copy (master_weights only).
  TORCH_ARG(torch::Tensor, master);
  /// The parameter's version counter when master last matched it (see
  /// FusedOptimizer::prepare_master). Not saved.
  TORCH_ARG(std::int64_t, master_version) = 0;
  /// The parameter's storage and offset when master last matched it (recorded
  /// when the master is made, at each step and by load()); see
  /// FusedAdamParamStateT::master_source. Not saved.
  TORCH_ARG(sdk::MasterSource, master_source);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

namespace detail {
struct FusedLambWorkspace;
}

class FusedLAMB : public sdk::FusedOptimizer<torch::optim::Optimizer, FusedLAMBOptions, FusedLAMBParamState>,
                  public sdk::ReducesTensorSums {
 public:
  explicit FusedLAMB(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                     FusedLAMBOptions defaults = {});
  explicit FusedLAMB(std::vector<at::Tensor> params, FusedLAMBOptions defaults = {});
  ~FusedLAMB() override;
  /// Under distributed::ZeroOptimizer: each parameter's and update's norm
  /// is summed over the pieces of the whole tensor across the ranks before
  /// its trust ratio is taken (CPU; refused on CUDA so far, and with
  /// max_grad_norm: clip with GradScaler::clip_grad_norm_, which is global).
  void set_tensor_sums_reducer(sdk::TensorSumsReducer reducer) override;

 protected:
  const char* name() const override { return "FusedLAMB"; }
  bool takes_float64() const override { return true; }
  /// The moments and the master copy.
  void follow_param(const at::Tensor& param, FusedLAMBParamState& state, const sdk::Follow& follow) override;
  void check_state(const at::Tensor& param, const FusedLAMBParamState& state, std::size_t group,
                   std::size_t index) const override;
  /// check_state, and a step count that is a whole number from 0.
  void check_loaded_state(const at::Tensor& param, const FusedLAMBParamState& state, std::size_t group,
                          std::size_t index) const override;
  void check_entries(const std::vector<sdk::Entry>& entries) const override;
  std::uint64_t plan_key(std::size_t group) const final;
  void begin_step(const std::vector<const sdk::Entry*>& entries, const StepSignals* signals) override;
  sdk::Launch prepare_list(const sdk::ParamList& list) override;
  void end_step(const StepSignals* signals) override;
  std::vector<std::string> saved_state_keys() const override { return {"step", "exp_avg", "exp_avg_sq", "master"}; }
  std::size_t state_stamp(const FusedLAMBParamState& state) const override {
    return stamp_tensors({&state.step(), &state.exp_avg(), &state.exp_avg_sq(), &state.master()});
  }

 private:
  std::unique_ptr<detail::FusedLambWorkspace> workspace_;
};

}  // namespace ampfuse
