#pragma once
// A ZeRO stage 2 optimizer: any optimizer, stepping only this rank's shard.
//
//   auto opt = ampfuse::distributed::ZeroOptimizer::make<ampfuse::FusedAdam>(
//       model->parameters(), torch::optim::AdamOptions(1e-3), group);
//   ampfuse::GradScaler scaler;                 // no process group needed: the optimizer names its own
//   ...
//   scaler.scale(loss).backward();
//   scaler.step(*opt);                          // reduce-scatter, check, update the shard, all-gather
//   scaler.update();
//   opt->zero_grad();
//
// The parameters are moved into flat buckets, one per (dtype, device), that
// the optimizer owns (each parameter becomes a view of its bucket: the
// model's parameters keep their identity, values and autograd, and are
// contiguous from then on). A bucket is cut into `world` equal shards; rank r
// owns shard r, and every rank starts from rank 0's values (as DDP does). At
// a step, each bucket's grads are reduced to their mean (each rank's divided
// by the world size before the sum, as DDP does; the sum where told so) into
// the rank's shard; the wrapped optimizer, built over this rank's pieces of the
// parameters (1-D views of its shard, in the same groups), updates them with
// the rank's ScaleSignal in its own fused pass; then each bucket is
// all-gathered, so that every rank holds every parameter again. Optimizer
// state exists for the rank's pieces only: about 1/world of the whole.
//
// Elementwise optimizers (FusedAdam, FusedAdamW, FusedSGD, FusedAdagrad,
// FusedRMSprop, third-party ones like Lion, and torch::optim's Adam, AdamW,
// SGD, Adagrad, RMSprop) step a piece exactly as they would step the whole
// parameter; FusedLAMB's per-tensor norms are summed across the shards (CPU).
// FusedAdam's 8-bit moments too: a parameter of 4096 elements or more starts
// on a 256-element boundary of its bucket, and a bucket holding one has
// shards of whole 256-element multiples, so that each piece's 8-bit blocks
// are the parameter's own (sdk::KnowsWholeTensors tells the optimizer the
// whole parameter's numel, on which the 4096 rule is decided).
// docs/distributed.md has the rules: which ranks call what, what is refused,
// checkpoints (sharded, and consolidated for any world size).

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "ampfuse/contract.h"

namespace ampfuse::distributed {

/// How a bucket's grads are reduced and its parameters gathered.
enum class ZeroCollectives {
  /// kAllReduceBroadcast for CPU buckets, kReduceScatter for CUDA buckets.
  /// Gloo's all-reduce and broadcast are its fast collectives (its
  /// reduce-scatter and all-gather took about twice as long on the same
  /// bytes: docs/distributed.md). NCCL's reduce-scatter and all-gather each
  /// move half an all-reduce's bytes.
  kAuto,
  /// Reduce-scatter the grads into a shard buffer (the parameters' grads
  /// stay as backward made them) and all-gather the parameters.
  kReduceScatter,
  /// All-reduce the grads in the bucket (afterwards every parameter's grad
  /// holds the ranks' mean, as after DDP's all-reduce) and read the shard
  /// from it; then each rank broadcasts its shard of the parameters.
  kAllReduceBroadcast,
};
struct ZeroOptions {
  ZeroOptions() = default;
  TORCH_ARG(ZeroCollectives, collectives) = ZeroCollectives::kAuto;
  /// Average the grads across ranks: each rank's grad is divided by the
  /// world size before the sum, as DDP takes the mean (fp16 grads whose sum
  /// would overflow average without inf); false keeps the sum.
  TORCH_ARG(bool, average_grads) = true;
  /// A parameter that has no grad on any rank is left out of the update, as
  /// torch::optim leaves it out. Deciding it takes a flag per parameter in
  /// the all-reduce that agrees on refusals at each step (on the group's CPU
  /// backend where it has one; on a CUDA-only group, a host sync). False: a
  /// missing grad is zeros everywhere, and the optimizer steps the parameter
  /// with them (as DeepSpeed does), except a parameter with requires_grad
  /// false, which is left out (DeepSpeed leaves frozen parameters out); the
  /// flags then say which parameters require grad, and one frozen on some
  /// ranks only is refused on every rank.
  TORCH_ARG(bool, skip_params_without_grads) = true;
  /// At construction, every rank's parameters take rank 0's values (one
  /// broadcast per bucket), as DDP's constructor makes every replica start
  /// from rank 0's weights (its init_sync); each rank's shard of the
  /// optimizer would otherwise step its own rank's initial values, and the
  /// gather would hand every rank a patchwork of them. False: the
  /// parameters keep each rank's values (the caller has made them equal).
  TORCH_ARG(bool, init_sync) = true;
};

class ZeroOptimizer : public torch::optim::Optimizer, public ScalerAware {
 public:
  /// Builds the wrapped optimizer over this rank's pieces, grouped as the
  /// parameters were (a group's options are cloned onto its pieces; a group
  /// without options gets the wrapped optimizer's defaults).
  using Factory =
      std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::optim::OptimizerParamGroup>)>;
  /// Copies one group's options from this optimizer's param_groups() (where
  /// an LR scheduler or the user changes them) onto the wrapped optimizer's,
  /// before every step. Null: the learning rate only (get_lr/set_lr).
  using CopyOptions =
      std::function<void(const torch::optim::OptimizerOptions& from, torch::optim::OptimizerOptions& to)>;

  /// Every rank of `process_group` constructs it, with parameters of the
  /// same shapes, dtypes and devices in the same order (checked: a
  /// difference is an error on every rank naming the first one that
  /// differs). Parameters are refused before anything is moved when one
  /// appears twice or shares storage with another (tied weights would come
  /// apart), is sparse, or is not a leaf. Then every rank's parameters take
  /// rank 0's values (ZeroOptions::init_sync). A factory that throws on one
  /// rank fails every rank's construction, and no parameter moves.
  ZeroOptimizer(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                c10::intrusive_ptr<c10d::ProcessGroup> process_group, const Factory& make_inner,
                CopyOptions copy_options = nullptr, ZeroOptions options = {});

  /// ZeroOptimizer over `Inner(pieces, defaults, extra...)` (extra: for
  /// instance FusedAdamOptions), copying every option of `Options` from
  /// param_groups() to the wrapped optimizer at each step.
  template <class Inner, class Options, class... Extra>
  static std::unique_ptr<ZeroOptimizer> make(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                                             const Options& defaults,
                                             c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                                             ZeroOptions options = {}, const Extra&... extra) {
    return std::make_unique<ZeroOptimizer>(
        std::move(param_groups), std::move(process_group),
        [defaults, extra...](std::vector<torch::optim::OptimizerParamGroup> groups) {
          return std::unique_ptr<torch::optim::Optimizer>(std::make_unique<Inner>(std::move(groups), defaults, extra...));
        },
        [](const torch::optim::OptimizerOptions& from, torch::optim::OptimizerOptions& to) {
          static_cast<Options&>(to) = static_cast<const Options&>(from);
        },
        options);
  }
  template <class Inner, class Options, class... Extra>
  static std::unique_ptr<ZeroOptimizer> make(std::vector<at::Tensor> params, const Options& defaults,
                                             c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                                             ZeroOptions options = {}, const Extra&... extra) {
    return make<Inner>(std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(std::move(params))},
                       defaults, std::move(process_group), options, extra...);
  }

  ~ZeroOptimizer() override;

  /// Reduces the grads (if not done since the last step), steps the wrapped
  /// optimizer on this rank's shard, all-gathers the parameters. No closure.
  at::Tensor step(LossClosure closure = nullptr) override;
  /// GradScaler's path: the wrapped optimizer's step_with_signals (or, for
  /// one that is not ScalerAware, PyTorch's classic path on the shard: one
  /// host read of found_inf, unscale in place, step), then the all-gather.
  void step_with_signals(const StepSignals& signals) override;
  /// Reduce-scatters every bucket's grads into this rank's shard: a
  /// parameter without a grad counts as zeros; one that has no grad on any
  /// rank is skipped by the update, as torch::optim skips it. GradScaler
  /// calls it (prepare_grads) before it reads the grads; step() calls it
  /// when nobody has since the last step. Every rank must call it.
  void reduce_grads();
  void prepare_grads() override { if (!grads_reduced_) reduce_grads(); }
  c10d::ProcessGroup* grads_sharded_over() const override { return process_group_.get(); }

  /// The parameters' grads (not the pieces'), as torch::optim's zero_grad.
  /// With set_to_none false, a grad becomes a zeroed view of this
  /// optimizer's grad bucket, and backward then accumulates into the bucket
  /// with no copy at the next reduce_grads.
  void zero_grad(bool set_to_none = true);

  /// Refused: the layout (which rank holds which elements) is made for the
  /// groups given at construction. Make a new ZeroOptimizer with every group
  /// (load_consolidated moves a checkpoint of the old one's state into it).
  /// A group added through torch::optim::Optimizer's own add_param_group
  /// (not virtual) is refused by the next step on every rank.
  void add_param_group(const torch::optim::OptimizerParamGroup& param_group);

  /// A sharded checkpoint: this rank's part (the wrapped optimizer's state
  /// of its pieces, with the options set on this optimizer's groups) and
  /// the layout it belongs to, stamped with the save it is part of (this
  /// run, and its steps so far). load() takes it into a ZeroOptimizer with
  /// the same world size, rank and parameters, where every rank's part is
  /// of the same save; anything else is refused, naming what differs,
  /// before anything changes (a part left from an earlier save, by a save
  /// that failed on some ranks, is refused). At
  /// another world size, load_sharded() takes every rank's part.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;
  /// Every rank's sharded checkpoint (save()) from a run at any world size,
  /// all of them, in any order: each rank of this one keeps its pieces' part
  /// (as load_consolidated does with the checkpoint they make together).
  /// Refused, naming the part, when a part is missing or given twice, was
  /// saved for other parameters, or comes from another save (another step,
  /// or another run) than the others: parts of one save() call on every
  /// rank load together, as load() takes them. Every rank calls it (one small all-reduce,
  /// as load() and load_consolidated()).
  void load_sharded(std::vector<torch::serialize::InputArchive>& parts);

  /// A consolidated checkpoint, gathered to rank `root`: the wrapped
  /// optimizer's own format (LibTorch's) over the whole parameters, as one
  /// process stepping them would save it, so that it loads into the wrapped
  /// optimizer's type over the model's parameters (FusedAdam's also into
  /// torch::optim::Adam) and, with load_consolidated, into a ZeroOptimizer
  /// of any world size. Every rank calls it; only root's archive is written.
  /// A state tensor with a piece's shape is per element and is concatenated
  /// across the pieces; any other state (a "step" always) is per parameter
  /// and is taken from the parameter's first piece.
  void save_consolidated(torch::serialize::OutputArchive& archive, int root = 0) const;
  /// Every rank calls it with the same one-process checkpoint (from
  /// save_consolidated at any world size, or saved by the wrapped
  /// optimizer's type over the whole parameters): each keeps its pieces'
  /// part (per-element state tensors sliced, the rest copied) and loads it
  /// through the wrapped optimizer's own load, which refuses a checkpoint
  /// that does not fit, changing nothing.
  ///
  /// load(), load_sharded() and load_consolidated() load on every rank or on
  /// none: what one rank refuses (its part damaged, a piece's state that does
  /// not fit its piece) every rank refuses, and the ranks that had loaded
  /// return to the state they had. Every rank calls them together (one small
  /// all-reduce, and a copy of this rank's state in memory while loading).
  void load_consolidated(torch::serialize::InputArchive& archive);

  /// The wrapped optimizer, over this rank's pieces.
  torch::optim::Optimizer& inner() { return *inner_; }
  const torch::optim::Optimizer& inner() const { return *inner_; }
  /// The model's parameters, as given (each now a view of its bucket).
  const std::vector<at::Tensor>& parameters() const { return params_; }
  /// Elements of this rank's shards (all buckets); the optimizer's state is for these only.
  std::int64_t shard_numel() const;
  /// Bytes this rank sends per step with ring algorithms (Gloo's and
  /// NCCL's), over all buckets: 2 (world - 1) / world of a bucket's bytes
  /// with kReduceScatter (what one all-reduce of the grads sends: ZeRO
  /// stage 2 communicates as much as plain data parallelism), about
  /// 3 (world - 1) / world with kAllReduceBroadcast. The per-parameter flag
  /// all-reduce (4 bytes per parameter) is not counted.
  std::int64_t bytes_sent_per_step() const;

  struct Bucket;
  struct Piece;
  struct Span;

 private:
  struct Layout;
  static std::shared_ptr<Layout> build(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                                       c10::intrusive_ptr<c10d::ProcessGroup> process_group, const Factory& make_inner,
                                       CopyOptions copy_options, ZeroOptions options);
  explicit ZeroOptimizer(std::shared_ptr<Layout> layout);
  void copy_options_to_inner() const;
  void gather_params();
  void set_piece_grads(const std::vector<std::int32_t>& has_grad);
  void note_writes_from_outside();
  void adopt_moved_params();
  std::string refusal() const;
  /// `what`: what was refused and what that leaves, for the other ranks'
  /// error (null: the step, which wrote nothing).
  void agree(const std::string& refusal, std::vector<std::int32_t>* flags, const char* what = nullptr,
             const char* doing = "agreeing that every rank can step") const;
  void agree_step(const std::string& refused) const;
  bool grads_replaced_since_reduced() const;
  void step_inner(const StepSignals* signals);
  void record_versions();
  void connect_tensor_sums();
  std::vector<std::vector<Span>> spans_of_rank(int rank, int world) const;
  void consolidate(std::vector<torch::serialize::InputArchive>& parts, torch::serialize::OutputArchive& archive) const;
  std::int64_t saved_per_block(const std::string& key, const c10::IValue& v) const;
  std::vector<std::int64_t> load_here(torch::serialize::InputArchive& archive);  // returns the part's stamp
  void load_consolidated_here(torch::serialize::InputArchive& archive);
  void load_agreed(const std::function<std::vector<std::int64_t>()>& load);
  void load_inner(torch::serialize::InputArchive& archive);

  c10::intrusive_ptr<c10d::ProcessGroup> process_group_;
  ZeroOptions options_;
  CopyOptions copy_options_;
  std::unique_ptr<torch::optim::Optimizer> inner_;
  std::vector<at::Tensor> params_;
  std::vector<Bucket> buckets_;
  std::vector<Piece> pieces_;
  std::vector<std::int64_t> versions_;  // each parameter's version counter after the last step
  std::unordered_map<const c10::TensorImpl*, std::size_t> piece_param_;  // piece -> params_ index
  std::int64_t layout_hash_ = 0;  // the parameters' groups, shapes, dtypes and devices
  /// Which save a sharded checkpoint part comes from: this run (an id agreed
  /// by the ranks at construction) and its steps so far. load() and
  /// load_sharded() take only parts of one save together.
  std::int64_t run_id_ = 0;
  std::int64_t steps_ = 0;
  std::vector<std::size_t> group_sizes_;    // parameters per group, as given
  std::vector<std::size_t> param_bucket_;   // params_ index -> bucket
  std::vector<std::int64_t> param_offset_;  // params_ index -> first element in its bucket
  bool grads_reduced_ = false;
  bool agree_on_cpu_ = false;  // the group has a CPU backend: agreements run there (no host sync on CUDA)
  /// Each parameter's grad when they were reduced (held weakly: not taken for a later grad at its address).
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> reduced_grads_;
};

}  // namespace ampfuse::distributed
