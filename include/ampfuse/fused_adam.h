#pragma once
// FusedAdam and FusedAdamW: drop-in replacements for torch::optim::Adam and
// torch::optim::AdamW. They are those classes (same options, parameter
// groups, state and checkpoint format: torch::save of a FusedAdam loads into
// torch::optim::Adam and back) with a fused step: one parallel region per
// parameter group and dtype on CPU, one kernel launch on CUDA. They
// implement the scaler contract: under GradScaler::step the unscale, the
// clip and the skip on inf/NaN happen inside that same pass, with no host
// sync on CUDA.
//
// Parameters: fp32, fp16, bf16 or fp64 (state in the parameter's dtype, as
// in LibTorch, unless FusedAdamOptions asks for master weights or bf16
// moments; fp64 computes in fp64), dense, with grads of the same dtype,
// device and shape (a grad of another layout is read through a copy).
// Anything else is refused, naming the group and the parameter, before
// anything is written.
//
// State: LibTorch's AdamParamState (AdamWParamState), extended by
// FusedAdamParamState with what the fused step adds, all of it in state() so
// that save(), load() and state().clear() see it. Step counters: on CPU they
// are LibTorch's (step). On CUDA each parameter also has a device counter
// (so that a skipped step can be decided on the device), fp64 so that it is
// exact past 2^24 steps; it starts from step, and step catches up with it in
// save() (the checkpoint holds the device count) and sync_state().

#include <torch/arg.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ampfuse/contract.h"
#include "ampfuse/sdk/optimizer.h"

namespace ampfuse {

/// ampfuse's options beyond LibTorch's AdamOptions / AdamWOptions, which are
/// accepted unchanged. Apply to every parameter group.
struct FusedAdamOptions {
  FusedAdamOptions() = default;
  /// Maximize the objective (ascend the gradient), as PyTorch's maximize=True.
  TORCH_ARG(bool, maximize) = false;
  /// fp16/bf16 parameters only: keep an fp32 master copy and fp32 moments,
  /// update the master in fp32 and write it back, rounded, to the parameter.
  /// The master copy is part of the parameter's state (FusedAdamParamState),
  /// saved under the state key "master", which torch::optim::Adam ignores.
  TORCH_ARG(bool, master_weights) = false;
  /// Keep the moments in bf16 (half the state memory; ~3 significant digits).
  TORCH_ARG(bool, bf16_moments) = false;
  /// Keep the moments of parameters of at least 4096 elements in 8-bit
  /// blocks (bitsandbytes-style): a byte per moment and element, and one
  /// fp32 absmax per 256 elements, 2.03 bytes of state per parameter against
  /// 8 (see docs/optimizers.md, "8-bit moments", for the code down to the
  /// bit). Smaller parameters keep 32-bit moments. The block's moments are
  /// decoded, updated and coded again in the step's one pass. CPU and CUDA
  /// (the CUDA kernel has not run on a GPU yet), fp32 / fp16 / bf16
  /// parameters (with or without master_weights); amsgrad, bf16_moments
  /// and fp64 parameters are refused at the step, naming the group. The state keeps the codes under
  /// exp_avg_8bit / exp_avg_sq_8bit and the absmax under exp_avg_absmax /
  /// exp_avg_sq_absmax, in place of exp_avg / exp_avg_sq; a checkpoint of
  /// either kind loads into either optimizer (coded or decoded on load).
  TORCH_ARG(bool, moments_8bit) = false;
  /// CUDA: the kernels read lr from a device tensor per group and device
  /// (lr_tensor()), as they read the step counters, so that a step can be
  /// captured in a CUDA graph and replayed with a new lr. At an eager step
  /// the group's host lr is copied to that tensor when it changed (a fill
  /// kernel, not a sync); under capture it is not (the copy would replay),
  /// so for graph replay set the lr with lr_tensor(group).fill_(x) outside
  /// the graph. The lr is fp64 there, so results equal a non-capturable run.
  TORCH_ARG(bool, capturable) = false;
};

/// The per-parameter state of FusedAdam (BaseState = AdamParamState) and
/// FusedAdamW (AdamWParamState): LibTorch's, under the same checkpoint keys,
/// and the fused step's own tensors.
template <class BaseState>
struct FusedAdamParamStateT : BaseState, sdk::PooledState {
  /// CUDA: the step counter the kernel reads and advances on the device,
  /// fp64, one element. Not saved: the checkpoint's step is its value.
  TORCH_ARG(at::Tensor, device_step);
  /// master_weights: the fp32 master copy. Saved under the key "master",
  /// which torch::optim::Adam ignores when it loads the checkpoint.
  TORCH_ARG(at::Tensor, master);
  /// The parameter's version counter when master last matched it; when the
  /// parameter was written from outside since, the next step refreshes the
  /// master from it.
  TORCH_ARG(std::int64_t, master_version) = 0;
  /// The parameter's storage and its offset in it (sdk::MasterSource, the
  /// storage held weakly) when master last matched it: a parameter given
  /// other memory since (`p.set_data(t)`, which leaves its version counter
  /// alone) refreshes the master too. Not saved.
  TORCH_ARG(sdk::MasterSource, master_source);
  /// moments_8bit: the codes of exp_avg and exp_avg_sq (uint8, the
  /// parameter's shape and strides) and each one's absmax per block of 256
  /// elements in storage order (fp32, 1-D). Defined together, in place of
  /// exp_avg and exp_avg_sq.
  TORCH_ARG(at::Tensor, exp_avg_8bit);
  TORCH_ARG(at::Tensor, exp_avg_absmax);
  TORCH_ARG(at::Tensor, exp_avg_sq_8bit);
  TORCH_ARG(at::Tensor, exp_avg_sq_absmax);

 public:
  std::unique_ptr<torch::optim::OptimizerParamState> clone() const override {
    return std::make_unique<FusedAdamParamStateT>(*this);
  }
  void serialize(torch::serialize::OutputArchive& archive) const override;
  void serialize(torch::serialize::InputArchive& archive) override;
};
using FusedAdamParamState = FusedAdamParamStateT<torch::optim::AdamParamState>;
using FusedAdamWParamState = FusedAdamParamStateT<torch::optim::AdamWParamState>;

/// Which of moments_8bit's two codes: exp_avg's is signed (magnitudes down
/// to 2^-22 of the block's absmax), exp_avg_sq's unsigned (down to 2^-58).
enum class Moment8 { kExpAvg, kExpAvgSq };

/// moments_8bit's code of a tensor of any floating dtype, layout and device:
/// the codes (uint8, x's shape; its strides when x is dense) and one fp32
/// absmax per 256 elements in the codes' storage order. The step codes its
/// moments exactly so.
struct Coded8 {
  at::Tensor codes;
  at::Tensor absmax;
};
Coded8 quantize_8bit(const at::Tensor& x, Moment8 which);
/// The fp32 values of codes and absmax made by quantize_8bit (or kept by the
/// step), on the codes' device.
at::Tensor dequantize_8bit(const at::Tensor& codes, const at::Tensor& absmax, Moment8 which);

namespace detail {

struct FusedAdamWorkspace;

/// What FusedAdam and FusedAdamW share; Base is torch::optim::Adam or AdamW.
/// Built on the SDK's optimizer base, as any third-party optimizer is.
template <class Base, class Options, class State, bool kDecoupledWeightDecay>
class FusedAdamImpl : public sdk::FusedOptimizer<Base, Options, State>, public sdk::KnowsWholeTensors {
 public:
  explicit FusedAdamImpl(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, Options defaults = {},
                         FusedAdamOptions fused = {});
  explicit FusedAdamImpl(std::vector<at::Tensor> params, Options defaults = {}, FusedAdamOptions fused = {});
  ~FusedAdamImpl() override;

  /// Copies device step counters into the state's step (syncs on CUDA).
  void sync_state();

  const FusedAdamOptions& fused_options() const { return fused_; }

  /// capturable on CUDA: the fp64 one-element tensor on `device` that the
  /// kernels read group `group`'s lr from (undefined before the group's first
  /// step on that device).
  /// An index-less device means the current one.
  at::Tensor lr_tensor(std::size_t group, c10::Device device = c10::Device(c10::kCUDA)) const;

  /// moments_8bit under a sharded optimizer: `piece` is part of a tensor of
  /// `whole_numel` elements, from element `offset` (a multiple of 256 when
  /// the whole tensor is coded): the 4096 rule is applied to the whole
  /// tensor, and the piece's blocks are the whole tensor's.
  void set_whole_tensor(const at::Tensor& piece, std::int64_t whole_numel, std::int64_t offset) override;
  /// exp_avg_absmax and exp_avg_sq_absmax: one entry per 256 elements.
  std::int64_t saved_elements_per_entry(const std::string& key) const override;

 protected:
  const char* name() const override;
  bool takes_float64() const override { return true; }
  /// A column slice stepped where it lies, but with moments_8bit (whose
  /// blocks of 256 follow a dense tensor's elements; such views are staged).
  bool updates_runs_in_place() const override { return !fused_.moments_8bit(); }
  void check_state(const at::Tensor& param, const State& state, std::size_t group, std::size_t index) const override;
  /// check_state, and 8-bit absmax values that are finite.
  void check_loaded_state(const at::Tensor& param, const State& state, std::size_t group,
                          std::size_t index) const override;
  void check_entries(const std::vector<sdk::Entry>& entries) const override;
  /// The moments and the master copy; 8-bit moments of a parameter given
  /// another layout are decoded and coded again in it (their blocks follow
  /// memory order: one more rounding to the 8-bit map).
  void follow_param(const at::Tensor& param, State& state, const sdk::Follow& follow) override;
  /// amsgrad, which adds max_exp_avg_sq to a group's state.
  std::uint64_t plan_key(std::size_t group) const final { return this->options_of(group).amsgrad() ? 1 : 0; }
  sdk::Launch prepare_list(const sdk::ParamList& list) override;
  void after_load(const at::Tensor& param, State& state) override;
  /// Master copies that a checkpoint of an earlier ampfuse kept under top-level keys.
  void load_extra(torch::serialize::InputArchive& archive, const at::Tensor& param, std::size_t group,
                  std::size_t index, State& state) override;
  std::vector<std::string> saved_state_keys() const override;
  std::size_t state_stamp(const State& state) const override;

 private:
  /// Whether a parameter's moments are 8-bit under these options (decided
  /// on its whole tensor's numel).
  bool coded_8bit(const at::Tensor& param) const;
  /// check_state's and check_loaded_state's checks.
  void check_adam_state(const at::Tensor& param, const State& state, std::size_t group, std::size_t index,
                        bool loading) const;

  FusedAdamOptions fused_;
  std::unique_ptr<FusedAdamWorkspace> workspace_;
  /// set_whole_tensor: a piece's whole tensor's numel.
  std::unordered_map<const c10::TensorImpl*, std::int64_t> whole_numel_;
  /// set_whole_tensor: each parameter's (group, index).
  std::unordered_map<const c10::TensorImpl*, std::pair<std::size_t, std::size_t>> place_of_;
};

}  // namespace detail

class FusedAdam : public detail::FusedAdamImpl<torch::optim::Adam, torch::optim::AdamOptions,
                                               FusedAdamParamState, false> {
 public:
  using FusedAdamImpl::FusedAdamImpl;
};

class FusedAdamW : public detail::FusedAdamImpl<torch::optim::AdamW, torch::optim::AdamWOptions,
                                                FusedAdamWParamState, true> {
 public:
  using FusedAdamImpl::FusedAdamImpl;
};

}  // namespace ampfuse
