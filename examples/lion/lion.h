#pragma once
// FusedLion: Lion (Chen et al. 2023, Algorithm 2, decoupled weight decay) as
// a LibTorch optimizer with a fused step (one parallel region per parameter
// group and dtype on CPU, one kernel launch on CUDA) that implements
// ampfuse's scaler contract, built on ampfuse's public SDK only.
//
//   lion::FusedLion opt(model->parameters(), lion::LionOptions(1e-4).weight_decay(0.1));
//   scaler.scale(loss).backward();
//   scaler.step(opt);  // unscale, clip and skip-on-inf inside Lion's own pass
//
// Parameters: fp32, fp16 or bf16, on CPU or CUDA; exp_avg is kept in the
// parameter's dtype. Checkpoints: torch::save / torch::load, LibTorch's format.

#include <ampfuse/sdk/optimizer.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>

#include <tuple>
#include <vector>

namespace lion {

struct LionOptions : public torch::optim::OptimizerCloneableOptions<LionOptions> {
  LionOptions(double lr = 1e-4) : lr_(lr) {}
  TORCH_ARG(double, lr) = 1e-4;
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.99);
  TORCH_ARG(double, weight_decay) = 0;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  // What LR schedulers (torch::optim::StepLR, ...) read and write.
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

struct LionParamState : public torch::optim::OptimizerCloneableParamState<LionParamState>,
                        public ampfuse::sdk::PooledState {
  TORCH_ARG(torch::Tensor, exp_avg);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

class FusedLion : public ampfuse::sdk::FusedOptimizer<torch::optim::Optimizer, LionOptions, LionParamState> {
 public:
  explicit FusedLion(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, LionOptions defaults = {});
  explicit FusedLion(std::vector<torch::Tensor> params, LionOptions defaults = {});

 protected:
  const char* name() const override { return "FusedLion"; }
  void check_state(const torch::Tensor& param, const LionParamState& state, std::size_t group,
                   std::size_t index) const override;
  // exp_avg follows its parameter when the model is converted (model->to(dtype)).
  void follow_param(const torch::Tensor& param, LionParamState& state, const ampfuse::sdk::Follow& follow) override {
    follow(state.exp_avg(), param.scalar_type());
  }
  ampfuse::sdk::Launch prepare_list(const ampfuse::sdk::ParamList& list) override;
  std::size_t state_stamp(const LionParamState& s) const override { return stamp_tensors({&s.exp_avg()}); }
};

}  // namespace lion
