#pragma once
// Torch side of the SDK: the optimizer base that FusedAdam, FusedAdamW,
// FusedSGD, FusedAdagrad, FusedRMSprop and FusedLAMB are built on, and that a third-party optimizer
// derives from in the same way (docs/guide.md walks through Lion).
//
// FusedOptimizer<Base, Options, State> is a torch::optim::Optimizer (Base is
// torch::optim::Optimizer itself, or an existing LibTorch optimizer whose
// options, state and checkpoints should be shared, as FusedAdam shares
// torch::optim::Adam's). It implements step() and the scaler contract's
// step_with_signals() once for all, in three phases, so that a step that
// throws changes nothing:
//   1. validate every group, parameter, grad, existing state and scale
//      signal, throwing an error that names the optimizer, the group and the
//      parameter; on CPU, decide a skipped step on the host (reading a CPU
//      found_inf is no device sync), so a skipped step creates no state;
//   2. prepare: group the parameters with grads by (group, device, dtype), in
//      parameter order, and call prepare_list() once per list with the list's
//      ScaleSignal (null without a scaler). prepare_list() does everything
//      that can throw (state allocation, metadata, the refusals under CUDA
//      graph capture) and returns the list's Launch. If any list throws, the
//      state made so far (state_for, and whatever undo_on_failure registered)
//      is taken back and the error propagates: nothing was written;
//   3. launch: run every list's Launch, which writes (kernels, counters) and
//      throws nothing.
// A Launch runs one CPU parallel region (parallel_chunks) or one CUDA launch
// (make_launch_meta + the author's launcher). On CUDA the kernel itself must
// return early when *found_inf != 0 (contract rule 1), multiply grads by
// inv_scale and clip_coef (rule 2) and advance step counters only when it
// applies (rule 4), without reading anything on the host (rule 3); on CPU,
// prepare_list() is not called for a skipped step, and cpu_grad_factor()
// gives inv_scale * clip_coef.
//
// Step plans: a step keeps what it validated and grouped (its entries and
// lists) and what each list's prepare_list kept in its ListSlot (pointer
// arrays, a Plan, metadata). The next step compares every parameter with
// what was kept: the same TensorImpl, data address, dtype and numel, the
// same grad TensorImpl, data address, dtype and numel, the same state object
// holding the same tensors
// (state_stamp). When all match, validation and grouping are skipped and
// prepare_list finds its slot filled; when only grads moved (new grad
// tensors, as after zero_grad(set_to_none)), the moved grads are checked and
// prepare_list is told (ParamList::grads_moved); when parameters with state
// also gained or lost a grad, the new grads are checked as moved ones, the
// states of those that gained one validated, and the entries and lists made
// again with every slot empty; anything else (a parameter
// added or replaced, set_data, state cleared or loaded, a state tensor
// replaced) starts over. A tensor re-pointed in place to other memory, numel
// or dtype (set_, resize_) is seen, and so is a grad's shape and strides; a
// change of a parameter's shape or strides alone at the same address
// (as_strided_) is not, unless it leaves the parameter not dense.
//
// State: every per-parameter tensor lives in the State object in state(),
// so that save(), load() and state().clear() see it. Checkpoints are
// LibTorch's optimizer format (State and Options implement serialize(), as
// LibTorch's own do), written and read with State's serialize(): a State
// derived from LibTorch's (FusedAdam's from AdamParamState) loads into the
// LibTorch optimizer too.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/full.h>
#include <ATen/ops/where.h>
#include <c10/core/impl/COWDeleter.h>
#include <c10/util/Exception.h>
#include <c10/util/ParallelGuard.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/serialize.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>

#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <atomic>
#include <deque>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <tuple>
#include <typeinfo>
#include <type_traits>
#include <utility>
#include <vector>

#include "ampfuse/contract.h"
#include "ampfuse/multi_tensor.h"
#include "ampfuse/sdk/cpu.h"
#include "ampfuse/sdk/cuda.h"
#include "ampfuse/tensor_ops.h"

namespace ampfuse::sdk {

/// A parameter with a grad, by its place in the optimizer. param and grad
/// refer to the optimizer's parameter and its grad, valid for the step (no
/// reference count is taken: a step over 10,000 parameters would spend more
/// on the atomic increments than on some kernels). A parameter that is not
/// dense (a strided view with gaps) is stepped through a dense copy: then
/// param is that copy (what the kernels read and write, laid out as
/// at::empty_like lays out the parameter, as the state is), and `owner` the
/// optimizer's parameter, by which the state is keyed and whose version a
/// master copy follows; the copy is written back after the step. Except,
/// for an optimizer whose updates_runs_in_place() is true, a CPU view with
/// gaps between long runs: param is then the view itself (owner null),
/// which its kernels walk through a plan of runs (list_plan).
struct Entry {
  std::size_t group;
  std::size_t index;
  const at::Tensor& param;
  const at::Tensor& grad;
  c10::Device device;      ///< param.device(), read once
  c10::ScalarType dtype;   ///< param.scalar_type(), read once
  /// The parameter's state as validation found it (null when it had none);
  /// FusedOptimizer::state_for(entry, ...) uses it instead of a second lookup,
  /// so check_entries, begin_step and prepare_list must not replace or erase a
  /// stepped parameter's state (creating state for one that had none is fine).
  torch::optim::OptimizerParamState* state;
  const at::Tensor* owner = nullptr;  ///< the optimizer's parameter when param is its dense copy
  /// The optimizer's parameter: owner when staged, else param.
  const at::Tensor& user_param() const { return owner != nullptr ? *owner : param; }
  /// The grad's data, for the kernels' pointer arrays: kernels read grads,
  /// never write them, so a copy-on-write storage (at::_lazy_clone) is read
  /// where it is, not materialized (ATen forbids that inside at::parallel_for,
  /// where these arrays are filled, and a read does not need it).
  void* grad_data() const { return const_cast<void*>(grad.const_data_ptr()); }
};

/// The state stamp of an optimizer that does not stamp its states
/// (FusedOptimizer::state_stamp's default): its steps never reuse a plan.
constexpr std::size_t kNoStamp = 0;

/// Validates every parameter of every group of `opt` (and the signals) and
/// returns those with grads. Accepted: fp32, fp16 and bf16 (and fp64 when
/// `float64`: the optimizer's kernels have a Double path) strided parameters
/// on CPU or CUDA, in one group only, that do not overlap themselves or each
/// other (dense ones; with `staged_params`, strided views with gaps too),
/// with a grad of the same dtype, device and shape laid out as the
/// parameter's dense layout (kernel_strides; with `staged`, any layout).
/// check_state is called for each parameter with a grad, to validate its
/// existing state; it returns that state (null when
/// the parameter has none), kept in Entry::state. Throws c10::Error naming
/// `name`, the group and the parameter: of several bad parameters, the first
/// in group order. With many parameters the checks run on ATen's threads,
/// each over a contiguous range, so check_state must only read (it may run
/// for different parameters at once). Parameters whose memory overlaps (views
/// of one tensor) are refused, naming both: a step would write them at once.
using CheckState =
    std::function<torch::optim::OptimizerParamState*(const at::Tensor& param, std::size_t group, std::size_t index)>;

/// A grad laid out otherwise than its parameter (other strides, or a view
/// with gaps), which the kernels read through `buffer`, a copy in the
/// parameter's layout; refresh_staged_grads fills it before each step.
struct StagedGrad {
  const at::Tensor* param;
  at::Tensor buffer;
};

/// A parameter that is not dense (a strided view with gaps), which the
/// kernels update through `buffer`, a dense copy laid out as
/// at::empty_like(*param) (the state's layout): refresh_staged_params fills
/// it before each step, write_back_staged_params copies it back after,
/// through `alias` (the parameter's elements, with a version counter of its
/// own: a view shares its counter with its base and every other view of it,
/// which a write-back would move, and master copies follow those counters).
struct StagedParam {
  const at::Tensor* param;
  at::Tensor buffer;
  at::Tensor alias;
};

/// The strides the kernels walk a parameter's grad and state in: the
/// parameter's own when it is dense, else those at::empty_like gives it
/// (dense, in the order of its strides).
std::vector<std::int64_t> kernel_strides(const at::Tensor& p);

/// With `staged` (not null), a grad laid out otherwise than its parameter is
/// accepted, as torch::optim accepts it: a StagedGrad is appended for it and
/// its Entry's grad is the buffer. Without, such a grad is refused.
/// With `sparse` (not null), a sparse grad of the parameter's dtype, device
/// and shape is accepted without signals (the scaler steps such optimizers
/// on the classic path): its Entry goes into *sparse (replaced, in group
/// order), not into the returned entries. Without, sparse grads are refused.
/// With `staged_params` (not null), a parameter with gaps is accepted: a
/// StagedParam is appended for it and its Entry's param is the buffer
/// (Entry::owner the parameter). Without, it is refused.
/// With `runs_in_place` too, a parameter with gaps on CPU whose runs are
/// long (runs_of_param) is not staged: its Entry's param is the parameter,
/// for kernels that walk it in place (FusedOptimizer::updates_runs_in_place).
std::vector<Entry> validate_params(torch::optim::Optimizer& opt, const char* name, const StepSignals* signals,
                                   const CheckState& check_state, bool float64 = false,
                                   std::deque<StagedGrad>* staged = nullptr, std::vector<Entry>* sparse = nullptr,
                                   std::deque<StagedParam>* staged_params = nullptr, bool runs_in_place = false);

/// Appends the runs of parameter `p` (tensor `tensor` of a list) to *runs,
/// for a Plan of runs: one run for a dense parameter; for one with gaps on
/// CPU, one per run of at least 128 adjacent elements, in memory order,
/// where its elements are disjoint and its sign bit clear. False, appending
/// nothing, where p has gaps and no such runs (it is then staged).
bool runs_of_param(const at::Tensor& p, std::int64_t tensor, std::vector<PlanRun>* runs);

/// The chunk plan (cpu::kChunkSize) of a list's CPU kernels over numels[i]
/// elements of entries[i]'s parameter (0 leaves it out: a tensor another
/// kernel steps): a plan of whole tensors; where a parameter has gaps (taken
/// in place: FusedOptimizer::updates_runs_in_place), a plan of runs
/// (runs_of_param), whose kernels must walk the parameters as the executor's
/// list 0 (`param_list`, their index there, is checked to be 0).
std::shared_ptr<const Plan> list_plan(const std::vector<const Entry*>& entries, const std::vector<std::int64_t>& numels,
                                      int param_list);

/// Copies every staged grad's current values into its buffer (one copy per
/// such grad; grads laid out as their parameters cost nothing).
void refresh_staged_grads(std::deque<StagedGrad>& staged);

/// Copies every staged parameter into its buffer (before a step's kernels),
/// and the buffers back into the parameters (after them), those on CPU only
/// when `cpu` (a step skipped on CPU leaves them as they were).
void refresh_staged_params(std::deque<StagedParam>& staged, bool cpu);
void write_back_staged_params(std::deque<StagedParam>& staged, bool cpu);

/// Throws unless every signal's tensors are float32 one-element tensors on
/// the signal's device (contract rule 0), naming `name`.
void check_signals(const StepSignals& signals, const char* name);

/// What a step plan keeps of one parameter (in group order) to tell at the
/// next step whether it changed: identities and data addresses, never read
/// through (the objects may be gone).
struct PlanParam {
  const c10::TensorImpl* param = nullptr;
  const void* param_data = nullptr;
  std::int64_t numel = 0;
  const c10::TensorImpl* grad = nullptr;  ///< null without a grad
  const void* grad_data = nullptr;
  std::int64_t grad_numel = 0;
  const void* state = nullptr;  ///< its state object in state(); null without state
  std::size_t stamp = 0;        ///< StateStamp of that state
  std::size_t layout = 0;       ///< 0 for a dense parameter; else a hash of its sizes and strides (staged)
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  c10::ScalarType grad_dtype = c10::ScalarType::Undefined;
  bool grad_staged = false;     ///< the grad is read through a StagedGrad
  bool grad_sparse = false;     ///< the grad is sparse (a plan with one is never reused)
  /// What else a match reads, kept only to be prefetched (it may dangle):
  /// the storages, the autograd metadata and its grad field, the state map's entry.
  const void* param_storage = nullptr;
  const void* autograd_meta = nullptr;
  const void* grad_slot = nullptr;
  const void* grad_storage = nullptr;
  const void* state_entry = nullptr;
};

/// A fingerprint of a state object's tensors (their TensorImpl addresses),
/// so that a state tensor replaced from outside is seen: fn(self, state). A
/// plain function and its object, not a std::function: a plan's match calls
/// it once per parameter and step.
struct StateStamp {
  std::size_t (*fn)(const void* self, const torch::optim::OptimizerParamState& state);
  const void* self;
  std::size_t operator()(const torch::optim::OptimizerParamState& state) const { return fn(self, state); }
};

/// The parameters of an optimizer as a step plan recorded them.
struct PlanKeys {
  std::vector<PlanParam> params;
  std::vector<std::pair<const void*, std::size_t>> groups;  ///< each group's params(): data() and size()
  /// (group, index) of each parameter that gained a grad, in order, as the
  /// last match_plan found them (PlanMatch::kGradsCameOrWent).
  std::vector<std::pair<std::size_t, std::size_t>> came;
  /// Some parameter is an inference tensor (stepped only under InferenceMode).
  bool any_inference = false;
  /// The bytes the state tensors span ([begin, end), sorted by begin) and
  /// the furthest end up to each: a grad that moves into one of them (a
  /// state tensor given as a grad) is validated again, and refused.
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> state_bytes;
  std::vector<std::uintptr_t> state_furthest_end;
};

enum class PlanMatch {
  kChanged,     ///< a parameter, its storage, dtype, numel or state changed
  kSame,        ///< everything as recorded
  kGradsMoved,  ///< only some grads' TensorImpl or data address changed: they were checked and recorded
  /// Some parameters stepped in place gained a grad (PlanKeys::came: they
  /// have state, and their grads were checked as moved ones) or lost one
  /// read in place; everything else as recorded, or grads moved: the
  /// entries and lists are made again, and only the new grads' states
  /// validated. (A parameter without state that gains a grad: kChanged.)
  kGradsCameOrWent,
};

/// Records opt's parameters, grads and states into `keys`, with the memory
/// of `state_tensors` (the state tensors follow_param names).
void record_plan(torch::optim::Optimizer& opt, const StateStamp& stamp, PlanKeys& keys,
                 const std::vector<const at::Tensor*>& state_tensors = {});

/// Compares opt's parameters, grads and states with `keys`. A grad that
/// moved is checked against its parameter as validate_params would (throwing
/// its error, naming `name`) and recorded in `keys`. `state_bytes` is the
/// size of a state object (what the match prefetches of each).
PlanMatch match_plan(torch::optim::Optimizer& opt, const StateStamp& stamp, const char* name,
                     const StepSignals* signals, PlanKeys& keys, bool float64 = false, bool stage_grads = false,
                     std::size_t state_bytes = 64);

/// Throws unless state tensor `s` (when defined) fits parameter p: its
/// shape, strides and device, and the dtype the optimizer keeps it in.
void check_state_tensor(const at::Tensor& s, const at::Tensor& p, c10::ScalarType dtype, const char* name,
                        const char* what, std::size_t group, std::size_t index);

/// Throws unless `state` is non-null: a null entry in state() is what
/// `state()[key]` inserts when used as a lookup (torch::optim's step
/// crashes on one). `group` and `index` name the parameter.
void check_state_not_null(const torch::optim::OptimizerParamState* state, const char* name, std::size_t group,
                          std::size_t index);
/// The group and index of the parameter whose TensorImpl is `key` in
/// opt's groups; {kNoGroup, kNoGroup} when none is.
inline constexpr std::size_t kNoGroup = ~std::size_t{0};
std::pair<std::size_t, std::size_t> place_of(const torch::optim::Optimizer& opt, const void* key);

/// For FusedOptimizer::follow_param: state tensor `s` as the step keeps it
/// for parameter p, when `s` has p's shape and device and is a floating
/// tensor of another dtype than `dtype`, laid out otherwise than the
/// kernels walk p, or without memory (a ZeroTensor): a copy in `dtype`, in
/// p's kernel layout (a parameter
/// converted since its state was made: Module::to(dtype), set_data to
/// channels_last; a sparse `s` keeps its layout and takes `dtype`).
/// Undefined when `s` fits already, or differs in what no copy mends (shape,
/// device, an integer tensor: check_state refuses those).
at::Tensor followed_state_tensor(const at::Tensor& s, const at::Tensor& p, c10::ScalarType dtype);
/// Whether followed_state_tensor(s, p, dtype) makes a copy (reads metadata only).
bool state_tensor_follows(const at::Tensor& s, const at::Tensor& p, c10::ScalarType dtype);

/// What FusedOptimizer::follow_param is given for one parameter: replaces
/// state tensors, each put back if the step is refused.
class Follow {
 public:
  using Replace = std::function<void(at::Tensor& field, at::Tensor value)>;
  using Seen = std::function<void(const at::Tensor& field)>;
  /// For parameter `param`, param `index` of param group `group` (what an
  /// error names); a null `replace` records the fields only.
  Follow(const at::Tensor& param, std::size_t group, std::size_t index, std::function<void()> refuse_under_capture,
         Replace replace, Seen seen = nullptr)
      : param_(param),
        group_(group),
        index_(index),
        refuse_under_capture_(std::move(refuse_under_capture)),
        replace_(std::move(replace)),
        seen_(std::move(seen)) {}
  /// State tensor `field`, kept in `dtype` with the parameter's shape, in
  /// its kernel layout: replaced by followed_state_tensor's copy where it
  /// has one. (Every field given is also checked for memory shared with
  /// the parameters, their grads and the other state tensors given:
  /// check_state_memory.)
  void operator()(at::Tensor& field, c10::ScalarType dtype) const {
    if (seen_) seen_(field);
    if (records_only() || !state_tensor_follows(field, param_, dtype)) return;
    refuse_under_capture_();
    replace_(field, followed_state_tensor(field, param_, dtype));
  }
  /// A state tensor that follows otherwise than operator()'s fields (8-bit
  /// codes and their absmax, through replace()), or that the kernels write
  /// and that never follows (a step count or flag of one element): checked
  /// for shared memory as operator()'s fields are.
  void seen(const at::Tensor& field) const {
    if (seen_) seen_(field);
  }
  /// Whether this Follow only names the fields (made with a null Replace:
  /// nothing is replaced): follow_param may skip the work whose result
  /// replace() would take.
  bool records_only() const { return !replace_; }
  /// The parameter's group and its index in it, for errors.
  std::size_t group() const { return group_; }
  std::size_t index() const { return index_; }
  /// Throws under CUDA graph capture, naming the parameter: call it before
  /// the work whose result replace() takes.
  void refuse_under_capture() const { refuse_under_capture_(); }
  /// `field` set to `value` (state that follows otherwise than by a copy,
  /// such as 8-bit codes, blocked in memory order, coded again).
  void replace(at::Tensor& field, at::Tensor value) const {
    if (records_only()) return;
    refuse_under_capture_();
    replace_(field, std::move(value));
  }

 private:
  const at::Tensor& param_;
  std::size_t group_, index_;
  std::function<void()> refuse_under_capture_;
  Replace replace_;
  Seen seen_;
};

/// A state tensor that FusedOptimizer::follow_param named, by its
/// parameter's group and index (its address: a field of a state in state()).
struct StateField {
  std::size_t group, index;
  const at::Tensor* tensor;
};

/// Throws, naming both, where a state tensor of `fields` shares memory with
/// another of them, with a parameter of opt or with a parameter's grad (a
/// state tensor put into state() as a view of another tensor, or as the
/// same tensor twice): the kernels read every tensor of an element before
/// they write, where torch::optim's ops run one after another, so such a
/// step would give other numbers (two parameters' step counts that are one
/// tensor would be one count, moved by either parameter's step, frozen or
/// not; on CUDA written by two blocks at once).
/// Run when a step plan is made.
void check_state_memory(const torch::optim::Optimizer& opt, const std::vector<StateField>& fields, const char* name);

/// check_state_tensor for a tensor that every state of the optimizer holds:
/// also throws when `s` is undefined (a state made by hand, or read from a
/// checkpoint that lacks the key).
void check_required_state_tensor(const at::Tensor& s, const at::Tensor& p, c10::ScalarType dtype, const char* name,
                                 const char* what, std::size_t group, std::size_t index);

/// Throws unless a state's host step count is not negative (a count below 0
/// would divide by a zero bias correction).
void check_state_step(std::int64_t step, const char* name, std::size_t group, std::size_t index);

/// Throws unless a state's device step counter (when defined) is an fp64
/// tensor of one element on p's device.
void check_device_step(const at::Tensor& step, const at::Tensor& p, const char* name, std::size_t group,
                       std::size_t index);

/// A base for State types (beside LibTorch's state type) whose objects are
/// made side by side. A step over many small parameters reads every state
/// object (its stamp, its step counter); made one by one with new, on a heap
/// that earlier work left fragmented, they lie scattered and each read waits
/// on a miss of its own, where objects side by side are read as a stream.
/// Objects of one size are carved in order from 64 KiB slabs, and a deleted
/// object's place is reused by the next one of its size. A slab goes back to
/// the system when its last object is deleted, except the one objects of that
/// size are carved from now, which starts over from its beginning.
/// Thread-safe. Used by every ampfuse state and by examples/lion: derive from it as
/// `struct MyState : torch::optim::OptimizerCloneableParamState<MyState>, sdk::PooledState`.
struct PooledState {
  static void* operator new(std::size_t bytes);
  static void* operator new(std::size_t bytes, std::align_val_t align);  ///< up to 64 bytes
  static void operator delete(void* p) noexcept;
  static void operator delete(void* p, std::align_val_t align) noexcept;
};

/// The slabs PooledState holds now, all sizes together (for tests).
std::size_t pooled_state_slabs();

/// State tensors for a list's small parameters, carved side by side from one
/// buffer, for the state a step makes. Made one by one, 10,000 moments of
/// one-element parameters land wherever the allocator has room: on a heap
/// that earlier work left fragmented, every later step reads each of them
/// from another cache line. Carved in order, they lie in the order the kernels
/// read them, and their first step makes one allocation (one fill on CUDA)
/// instead of one per tensor. Reserve every tensor the step may make, then
/// take them; a tensor that is large, not dense, or beyond what was reserved
/// gets memory of its own. Each tensor shares the buffer's storage (it is not
/// an autograd view of it) and keeps it alive: a state erased from the
/// optimizer frees its bytes only with the others.
class SmallStatePool {
 public:
  /// A tensor takes from the pool up to this many bytes.
  static constexpr std::int64_t kMaxBytes = 4096;

  /// Tensors of `options`' dtype and device, filled with `fill`.
  explicit SmallStatePool(at::TensorOptions options, double fill = 0) : options_(options), fill_(fill) {}

  /// Room for `count` tensors shaped as `like` (or contiguous of `sizes`).
  void reserve(const at::Tensor& like, int count = 1) { reserve(pooled_bytes(like), count); }
  void reserve(c10::IntArrayRef sizes, int count = 1) { reserve(pooled_bytes(sizes), count); }

  /// A tensor with like's sizes and strides (or contiguous of `sizes`), filled with `fill`.
  at::Tensor take(const at::Tensor& like);
  at::Tensor take(c10::IntArrayRef sizes);

 private:
  // Where a tensor of `bytes` starts (a multiple of 16, of 64 from 64 bytes up).
  static std::int64_t alignment(std::int64_t bytes) { return bytes >= 64 ? 64 : 16; }
  // The bytes a tensor takes from the pool; 0 when it gets its own memory.
  std::int64_t pooled_bytes(const at::Tensor& like) const;
  std::int64_t pooled_bytes(c10::IntArrayRef sizes) const;
  void reserve(std::int64_t bytes, int count);
  // A tensor over `bytes` of the buffer's storage with `sizes` and `strides`; undefined when not reserved.
  at::Tensor carve(std::int64_t bytes, c10::IntArrayRef sizes, c10::IntArrayRef strides);

  at::TensorOptions options_;
  double fill_;
  std::int64_t reserved_ = 0;  // bytes
  std::int64_t used_ = 0;      // bytes
  at::Tensor buffer_;          // made at the first take()
};

/// Writes state `s` (a BaseState, LibTorch's, extended with a device step
/// counter `device_step`) as a BaseState whose step is the device count
/// when there is one (reading it: a sync, as any save from a GPU), so that
/// the checkpoint holds the count the kernels kept and LibTorch's optimizer
/// loads it.
template <class BaseState, class S>
void save_counted(const S& s, torch::serialize::OutputArchive& archive) {
  if (!s.device_step().defined()) return s.BaseState::serialize(archive);
  BaseState counted(s);
  counted.step(static_cast<std::int64_t>(s.device_step().template item<double>()));
  counted.BaseState::serialize(archive);
}

/// What FusedOptimizer::load reads of a checkpoint (LibTorch's optimizer
/// format) before it reads any state or options: its layout, checked
/// against the optimizer's parameter groups and against itself.
struct CheckpointLayout {
  /// Each group's "options" archive, for Options::serialize.
  std::vector<torch::serialize::InputArchive> options;
  /// A state the checkpoint holds, with the parameter it belongs to.
  struct SavedState {
    std::size_t group;
    std::size_t index;
    torch::serialize::InputArchive archive;
  };
  /// In group order.
  std::vector<SavedState> states;
};

/// Throws, naming `name` and the key, unless every tensor in `archive` (its
/// nested archives and values included) fits its storage (fits_storage).
/// LibTorch's archive reader does not check the sizes, strides and offset
/// a file gives: a damaged one would have the first read of such a tensor
/// read outside its storage. read_checkpoint_layout calls it; an archive
/// handed to code that reads tensors without it (LibTorch's optimizers'
/// load) should pass through it first.
void check_saved_tensors(torch::serialize::InputArchive& archive, const char* name);

/// True when a strided tensor of these sizes, strides, storage offset and
/// element size reaches only bytes [0, nbytes) of its storage (always when
/// it has no element). Overflow-safe for any 64-bit values.
bool fits_storage(c10::IntArrayRef sizes, c10::IntArrayRef strides, std::int64_t storage_offset,
                  std::int64_t itemsize, std::size_t nbytes);

/// Calls found(x, y), x <= y, for tensors x and y of `tensors` that share an
/// element's memory, and found(x, x) for a tensor whose own elements share
/// memory (an expanded view, unfold windows). Exact for strided views:
/// interleaved ones (the even and odd columns of one matrix) share nothing.
/// found may throw to stop at the first pair. If it returns, the search goes
/// on: where two different tensors share memory, some pair of different
/// tensors is reported (not every such pair: a dense tensor is paired with
/// the one reaching furthest before it, an element with its neighbours by
/// address), and a pair may be reported more than once. O(n log n) in the tensors where their byte
/// ranges do not meet; where they meet, by their strides or else element by
/// element. `tensors`: none null, strided (strides are never negative);
/// undefined and empty ones, and ones without memory (no storage, or meta)
/// are skipped. found must not call find_shared_memory (its buffers are per
/// thread).
void find_shared_memory(const std::vector<const at::Tensor*>& tensors,
                        const std::function<void(std::size_t, std::size_t)>& found);

/// Reads the layout of `archive`: throws, naming `name` and what is wrong,
/// unless it holds LibTorch's optimizer format with group_sizes.size()
/// groups of group_sizes[g] parameters each, every parameter's key a number
/// that no other parameter has, and every state under a key that some
/// parameter has.
/// Every tensor in it (a state's naming its group and parameter) must fit
/// its storage (check_saved_tensors).
CheckpointLayout read_checkpoint_layout(torch::serialize::InputArchive& archive, const char* name,
                                        const std::vector<std::size_t>& group_sizes);

/// A floating-point state tensor saved in `archive` (one parameter's state)
/// with p's shape and device but laid out otherwise than the kernels walk p
/// (torch::optim::SGD's momentum buffer takes its grad's strides; a model
/// saved with channels_last weights) is read as a copy in that layout, with
/// the same values: LibTorch's load takes any strides. Byte tensors (8-bit
/// codes, whose blocks follow the saved memory order) are left as saved,
/// for follow_param to code again or check_state to refuse.
void lay_out_saved_state(torch::serialize::InputArchive& archive, const at::Tensor& p);

/// Throws, naming both states and keys, where two tensors of the saved
/// states (after lay_out_saved_state), or of `held` (the state tensors the
/// loaded states hold, as follow_param names them: those read from outside
/// the states' archives by load_extra), share an element's memory: a file
/// whose records put two state tensors in one storage (a damaged pickle can
/// name another tensor's storage, and a hand-made file can save views of
/// one tensor). A step refuses such state where check_state_memory looks,
/// and elsewhere (a step count) writes one into the other; load() refuses
/// it before anything changes. Views of one storage that share no element
/// pass. Also throws on a negative stride of a dimension of more than one
/// element, which no state has.
void check_saved_state_memory(std::vector<CheckpointLayout::SavedState>& states, const std::vector<StateField>& held,
                              const char* name);

/// A master copy (fp32) loaded for `param`, with every element that `param`
/// does not round to taken from `param`: the parameter was written after
/// the step that saved the master (weights loaded, a layer re-initialized),
/// or holds weights of another point of the run than the optimizer's
/// checkpoint. `master` itself where the parameter rounds from all of it.
at::Tensor master_following(const at::Tensor& master, const at::Tensor& param);

/// Runs read(), which reads part of a checkpoint (a State's or an Options'
/// serialize()), and turns what it throws into a c10::Error that names
/// `name`, the group, the parameter (none when index is kNoIndex), `what`
/// was read and the keys `archive` holds.
constexpr std::size_t kNoIndex = ~std::size_t{0};
void read_checkpoint_part(torch::serialize::InputArchive& archive, const char* name, std::size_t group,
                          std::size_t index, const char* what, const std::function<void()>& read);

/// Throws, naming `name`, the group and the option, when options read from
/// a checkpoint hold a NaN (no step can use it: the parameters would all
/// turn NaN). Other values LibTorch's constructors refuse in their defaults
/// (a negative lr, nesterov with dampening) are accepted, as LibTorch
/// accepts them in a group and loads them. Options of other types (an SDK
/// user's) are not checked here: their optimizer checks them in
/// check_entries, which load() calls.
void check_loaded_options(const torch::optim::AdamOptions& o, const char* name, std::size_t group);
void check_loaded_options(const torch::optim::AdamWOptions& o, const char* name, std::size_t group);
void check_loaded_options(const torch::optim::SGDOptions& o, const char* name, std::size_t group);
void check_loaded_options(const torch::optim::AdagradOptions& o, const char* name, std::size_t group);
void check_loaded_options(const torch::optim::RMSpropOptions& o, const char* name, std::size_t group);
template <class Options>
void check_loaded_options(const Options& /*options*/, const char* /*name*/, std::size_t /*group*/) {}

/// What `archive` holds, as an InputArchive to read: a round trip through
/// bytes (LibTorch reads an archive only from its bytes).
torch::serialize::InputArchive read_back(torch::serialize::OutputArchive& archive);

/// The (key, value) pairs that options.serialize() writes, in the order
/// read_back gives them.
std::vector<std::pair<std::string, c10::IValue>> saved_fields(const torch::optim::OptimizerOptions& options);

/// Throws, naming `name`, the group and the key, when a checkpoint's
/// options archive holds a key that `read` (the options read from it) does
/// not write back: a key its serialize() ignored.
void check_saved_option_keys(torch::serialize::InputArchive& archive, const torch::optim::OptimizerOptions& read,
                             const char* name, std::size_t group);

/// Throws, naming `name`, the group, the parameter and the key, when a
/// checkpoint's state archive holds a key that is not in `known`.
void check_saved_state_keys(torch::serialize::InputArchive& archive, const std::vector<std::string>& known,
                            const char* name, std::size_t group, std::size_t index);

/// Per-tensor partial sums of one list, for an optimizer whose update needs
/// a reduction over each whole tensor (FusedLAMB's parameter and update
/// norms): row i of `sums` (fp64, [n, k], on the list's device) belongs to
/// `params[i]`.
struct TensorSums {
  std::vector<at::Tensor> params;
  at::Tensor sums;
};
/// Adds up, in place, the rows of tensors that are parts of one larger
/// tensor, across the ranks of a sharded optimizer: after it, every row holds
/// the sums over the whole tensor it is part of.
/// `columns` is k, the same on every rank (a rank without lists still calls).
using TensorSumsReducer = std::function<void(std::vector<TensorSums>& lists, std::int64_t columns)>;

/// Implemented by an optimizer whose math needs per-tensor reductions, so
/// that a sharded optimizer (distributed::ZeroOptimizer) can wrap it: with a
/// reducer set, each step hands the reducer its per-tensor partial sums
/// exactly once, on every rank (also one with no parameters or grads;
/// except in a step that a CPU found_inf skips, which every rank skips),
/// before any update that uses them.
class ReducesTensorSums {
 public:
  virtual ~ReducesTensorSums() = default;
  virtual void set_tensor_sums_reducer(TensorSumsReducer reducer) = 0;
};

/// Implemented by an optimizer whose state depends on the whole tensor a
/// parameter belongs to: its form decided on the tensor's numel, or kept in
/// blocks counted from the tensor's first element (FusedAdam's 8-bit
/// moments: tensors of 4096 elements or more, 256-element blocks). A sharded
/// optimizer (distributed::ZeroOptimizer) cuts such tensors at multiples of
/// 256 elements from their start (see zero.h) and, right after making the
/// optimizer over its pieces, tells it which tensor each piece is part of,
/// so that it steps and saves each piece exactly as that part of the whole.
class KnowsWholeTensors {
 public:
  virtual ~KnowsWholeTensors() = default;
  /// `piece`, one of this optimizer's parameters without state yet, is
  /// elements [offset, offset + piece.numel()) of a tensor of `whole_numel`
  /// elements (flattened). Throws, changing nothing, when the optimizer
  /// cannot step it so (a block that would straddle the piece's start).
  virtual void set_whole_tensor(const at::Tensor& piece, std::int64_t whole_numel, std::int64_t offset) = 0;
  /// A saved state tensor under `key` holds one entry per this many
  /// elements of its parameter (per block, concatenated in element order
  /// across the pieces), or 0 when it does not (per element, or per tensor).
  virtual std::int64_t saved_elements_per_entry(const std::string& key) const = 0;
};

/// True when a CPU signal's found_inf is set (reading a CPU tensor is no
/// device sync): the CPU part of the step is then skipped on the host.
bool cpu_step_skipped(const StepSignals* signals);

/// inv_scale * clip_coef read on the host (CPU signals only); 1 without a
/// signal. Exact in double: rounded to float it is the fp32 product.
double cpu_grad_factor(const ScaleSignal* signal);

/// A signal's fields as device pointers for a CUDA kernel (null when absent).
struct SignalPointers {
  const float* found_inf = nullptr;  ///< skip the step when *found_inf != 0
  const float* inv_scale = nullptr;  ///< multiply grads by it; null means 1
  const float* clip_coef = nullptr;  ///< and by it; null means 1
};
SignalPointers signal_pointers(const ScaleSignal* signal);

using ListKey = std::tuple<std::size_t, c10::Device, c10::ScalarType>;
using Lists = std::vector<std::pair<ListKey, std::vector<const Entry*>>>;

/// items grouped by key(item): groups in order of first appearance, items in order.
template <class Key, class T, class KeyFn>
std::vector<std::pair<Key, std::vector<T>>> group_by(const std::vector<T>& items, KeyFn&& key) {
  std::vector<std::pair<Key, std::vector<T>>> groups;
  for (const T& item : items) {
    const Key k = key(item);
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == k; });
    if (it == groups.end()) {
      groups.emplace_back(k, std::vector<T>{});
      it = std::prev(groups.end());
    }
    it->second.push_back(item);
  }
  return groups;
}

/// Entries by (group, device, dtype), in parameter order.
Lists group_lists(const std::vector<const Entry*>& entries);

/// Per-tensor scalars of a list are often all equal: out[i] = f(keys[i]),
/// computed once per run of equal keys (out is reused, not reallocated).
template <class Key, class Value, class F>
void per_tensor(const std::vector<Key>& keys, std::vector<Value>& out, F&& f) {
  out.resize(keys.size());
  for (std::size_t i = 0; i < keys.size(); ++i) out[i] = i > 0 && keys[i] == keys[i - 1] ? out[i - 1] : f(keys[i]);
}

/// The same into a new vector.
template <class Key, class Value, class F>
std::vector<Value> per_tensor(const std::vector<Key>& keys, F&& f) {
  std::vector<Value> out;
  per_tensor(keys, out, std::forward<F>(f));
  return out;
}

/// Parameters per thread below which host-side per-parameter work (validation,
/// parallel_entries) stays on the calling thread.
constexpr std::int64_t kEntriesGrain = 512;

/// Runs fn(i) for every i in [0, n) on ATen's threads when n is large
/// (contiguous ranges per thread), in order on this thread otherwise: for the
/// host-side work of a step over many parameters (reading data pointers),
/// which is mostly waiting on cache misses. fn must only read shared objects.
template <class F>
void parallel_entries(std::size_t n, F&& fn) {
  at::parallel_for(0, static_cast<std::int64_t>(n), kEntriesGrain, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e; ++i) fn(static_cast<std::size_t>(i));
  });
}

/// Whether t's storage is copy-on-write (at::_lazy_clone made it, or made a
/// lazy clone of it): a write must give it a copy of its own first, as ATen's
/// in-place ops do, and ATen forbids that copy inside at::parallel_for; a
/// read need not. Reads the storage's deleter, beside its data pointer.
inline bool copy_on_write(const c10::TensorImpl* t) {
  const c10::StorageImpl* storage = t->unsafe_storage().unsafeGetStorageImpl();
  return storage != nullptr && storage->data_ptr().get_deleter() == &c10::impl::cow::cow_deleter;
}

/// What writable_data throws inside at::parallel_for for a copy-on-write
/// tensor, for fill_entries to catch.
struct CopyOnWriteInParallel {};

/// t's data for a kernel that writes it (a parameter, a state tensor), as
/// t.data_ptr() gives it: a copy-on-write storage gets its copy first. Inside
/// at::parallel_for, where ATen forbids that copy, a copy-on-write t throws
/// CopyOnWriteInParallel instead: fill pointer arrays with fill_entries.
inline void* writable_data(const at::Tensor& t) {
  if (copy_on_write(t.unsafeGetTensorImpl()) && c10::ParallelGuard::is_enabled()) throw CopyOnWriteInParallel{};
  return t.data_ptr();
}

/// The state tensors whose data a step plan keeps pointers to (KeptLists,
/// KeptLaunch, an optimizer's own kept pointers), held while it holds, with
/// their storages: a tensor set_ to other memory (torch::load into a state
/// tensor does that) leaves the kept memory alive, stepped and not seen (see
/// "Step plans" above), and each storage is made non-resizable, so that a
/// resize_ past its bytes throws (LibTorch's "Trying to resize storage that
/// is not resizable") instead of freeing memory the plan writes. hold() on
/// the calling thread only.
class HeldState {
 public:
  void hold(const at::Tensor& t) {
    if (!t.defined()) return;
    tensors_.push_back(t);
    if (!t.has_storage()) return;
    c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
    if (!storages_.empty() && storages_.back().unsafeGetStorageImpl() == storage) return;  // side by side (pooled)
    storage->set_resizable(false);
    storages_.push_back(t.storage());
  }
  void clear() {
    tensors_.clear();
    storages_.clear();
  }

 private:
  std::vector<at::Tensor> tensors_;
  std::vector<c10::Storage> storages_;
};

/// parallel_entries for an fn that fills pointer arrays through
/// writable_data: when some tensor is copy-on-write (a lazy clone of a state
/// tensor, say), fn runs again for every entry on the calling thread, where
/// the copies are made. fn must give the same result when run twice.
template <class F>
void fill_entries(std::size_t n, F&& fn) {
  try {
    parallel_entries(n, fn);
  } catch (const CopyOnWriteInParallel&) {
    for (std::size_t i = 0; i < n; ++i) fn(i);
  }
}

/// per_tensor over keys read on ATen's threads: keys[i] = key(i), out[i] =
/// f(keys[i]) computed once per run of equal keys within each thread's
/// contiguous range. For per-tensor scalars of a step over many parameters,
/// where reading each key (a state's step counter) is a cache miss: one
/// parallel pass reads the keys and fills the scalars.
template <class Key, class Value, class KeyOf, class F>
void parallel_per_tensor(std::size_t n, KeyOf&& key, std::vector<Key>& keys, std::vector<Value>& out, F&& f) {
  keys.resize(n);
  out.resize(n);
  at::parallel_for(0, static_cast<std::int64_t>(n), kEntriesGrain, [&](std::int64_t b, std::int64_t e) {
    for (auto i = static_cast<std::size_t>(b); i < static_cast<std::size_t>(e); ++i) {
      keys[i] = key(i);
      out[i] = i > static_cast<std::size_t>(b) && keys[i] == keys[i - 1] ? out[i - 1] : f(keys[i]);
    }
  });
}

/// Runs a CPU kernel fn(chunk_begin, chunk_end) over every chunk of `plan`
/// in one parallel region (ATen's thread pool, at::get_num_threads()), with
/// subnormals flushed in every worker (cpu::FlushSubnormals); on the calling
/// thread when the plan is small (cpu::chunks_grain).
template <class F>
void parallel_chunks(const Plan& plan, F&& fn) {
  at::parallel_for(0, plan.num_chunks(), cpu::chunks_grain(plan), [&](std::int64_t b, std::int64_t e) {
    const cpu::FlushSubnormals flush;
    fn(b, e);
  });
}

/// parallel_chunks, and in the same parallel region done(t), after a
/// worker's chunks ran, for each tensor t (its index among the Plan's
/// numels) whose first chunk was among them; after the region, done(t) for
/// each t of `empty`, the zero-element tensors (no chunk covers them). Each
/// tensor's done runs once: for step counters, when the kernel took its
/// per-tensor scalars before the launch (done may run while another worker
/// still updates the tensor's later chunks).
template <class F, class Done>
void parallel_chunks(const Plan& plan, F&& fn, Done&& done, const std::vector<std::size_t>& empty) {
  const std::vector<std::int64_t>& first = plan.chunk_offsets();
  const std::vector<std::int64_t>& tensors = plan.tensors();
  at::parallel_for(0, plan.num_chunks(), cpu::chunks_grain(plan), [&](std::int64_t b, std::int64_t e) {
    const cpu::FlushSubnormals flush;
    fn(b, e);
    for (auto k = static_cast<std::size_t>(std::lower_bound(first.begin(), first.end() - 1, b) - first.begin());
         k < tensors.size() && first[k] < e; ++k)
      if (plan.first_of_tensor(k)) done(static_cast<std::size_t>(tensors[k]));  // (a plan of runs: once per tensor)
  });
  for (const std::size_t t : empty) done(t);
}

/// Advances the step counters of zero-element parameters (which no kernel
/// chunk covers) by one, or on the device by (found_inf == 0) under a
/// scaler: contract rule 4 without a host sync.
void advance_step_counters(const std::vector<at::Tensor>& steps, const ScaleSignal* signal);

#if defined(AMPFUSE_WITH_CUDA)
/// A list's launch metadata and the memory it points into: the packed words
/// and, for a list too long for kernel arguments, the device copy. A Launch
/// holds it (make_launch_meta's shared_ptr) until its kernel is queued: the
/// device copy comes from a cache that preparing later lists may evict.
struct ListMeta {
  cuda::LaunchMeta launch;  ///< what the launcher takes; points into the two below
  std::vector<std::int64_t> words;
  at::Tensor on_device;     ///< the uploaded copy, undefined when the words travel as kernel arguments
  ListMeta() = default;
  ListMeta(const ListMeta&) = delete;  // launch points into this object's own members
  ListMeta& operator=(const ListMeta&) = delete;
};

/// Launch metadata of `views` over `plan` for a kernel on `device`, packed
/// and, when too long for kernel arguments (or when the driver takes only
/// small ones), uploaded once and cached while the list is unchanged.
std::shared_ptr<const ListMeta> make_launch_meta(const TensorListsView& views, const Plan& plan, c10::Device device);

/// `meta` (kept from an earlier step, in a ListSlot) for this step's launch:
/// its device copy looked up again in the cache, which orders it on the
/// current stream, marks it as held by a CUDA graph under capture, or
/// uploads it again when it was evicted. Cheap when the words travel as
/// kernel arguments (returned as is).
std::shared_ptr<const ListMeta> reuse_launch_meta(const std::shared_ptr<const ListMeta>& meta, c10::Device device);

/// The current CUDA stream of `device`, for a launcher.
cuda::Stream current_stream(c10::Device device);

/// Zeroed int32 counters, one per tensor of a list, for
/// once_per_tensor_after_reads; kept across steps (kernels leave them zeroed).
class TicketCounters {
 public:
  /// The counters of list `key`, at least num_tensors of them.
  unsigned* get(const ListKey& key, std::int64_t num_tensors);

 private:
  std::map<std::tuple<std::size_t, std::string, int>, at::Tensor> counters_;
};
#endif

/// True while the current CUDA stream of `device` is being captured in a
/// CUDA graph (false on CPU, and without CUDA). Host-side work that must not
/// be recorded into a graph (creating state, copying a host value to the
/// device) checks it.
bool stream_capturing(c10::Device device);

/// Throws, naming the optimizer, e's group and index and `what` (device-side
/// state a step keeps: a counter, a master copy, a buffer), when that state
/// is about to be made while e's stream is being captured in a CUDA graph:
/// made inside the graph, it would be made again at every replay. Call it
/// where the state is made; a warm-up step outside the capture makes it.
void refuse_under_capture(const Entry& e, const char* optimizer, const char* what);

/// A list's second phase (see the top of this file): writes, throws nothing.
using Launch = std::function<void()>;

/// fp64 one-element tensors per (group, device) that kernels read on the
/// device in place of a host value (FusedAdam's capturable lr), so that a
/// captured CUDA graph replays with whatever was written into them. Devices
/// are keyed as tensors name them (canonical_device).
class DeviceScalars {
 public:
  /// The tensor of (group, device); undefined before the group's first step there.
  at::Tensor find(std::size_t group, c10::Device device) const;

  /// Prepare phase: the tensor of (group, device), made holding `value` when
  /// missing (then *created is true). Throws, naming `optimizer` and the
  /// group, when it is missing under CUDA graph capture: made inside the
  /// graph, it would be made again at every replay.
  at::Tensor prepare(std::size_t group, c10::Device device, double value, const char* optimizer, bool* created);
  /// Launch phase: writes `value` into the tensor of (group, device) when it
  /// differs from the value last written (a fill kernel, no sync), except
  /// under capture, where the tensor is authoritative (a recorded fill would
  /// overwrite it at every replay).
  void refresh(std::size_t group, c10::Device device, double value);
  /// Forgets (group, device) (undoes a prepare that created it).
  void erase(std::size_t group, c10::Device device);

 private:
  struct Slot {
    std::size_t group;
    c10::Device device;
    at::Tensor value;
    double written;
  };
  Slot* slot(std::size_t group, c10::Device device);
  std::vector<Slot> slots_;
};

/// What prepare_list keeps of one list from one step to the next (pointer
/// arrays, a Plan, launch metadata), in the step plan (see "Step plans" at
/// the top of this file). Empty at a list's first step, and emptied by the
/// SDK whenever anything but the grads' storage changed since it was filled.
class ListSlot {
 public:
  /// What was kept, or null (nothing kept, or a T of another type).
  template <class T>
  std::shared_ptr<T> get() const {
    return type_ != nullptr && *type_ == typeid(T) ? std::static_pointer_cast<T>(data_) : nullptr;
  }
  /// Keeps `value`, replacing what was kept. A Launch may hold it too.
  template <class T>
  void keep(std::shared_ptr<T> value) {
    data_ = std::move(value);
    type_ = &typeid(T);
  }
  void reset() {
    data_.reset();
    type_ = nullptr;
  }

 private:
  std::shared_ptr<void> data_;
  const std::type_info* type_ = nullptr;
};

/// One list of a step: the parameters with grads of one group on one
/// device with one dtype, and that device's scale signal.
struct ParamList {
  std::size_t group;
  c10::Device device;
  c10::ScalarType dtype;  ///< the torch dtype; kernel_dtype() is the kernels' ScalarType
  const std::vector<const Entry*>& entries;
  const ScaleSignal* signal;  ///< null when stepped without a scaler
  /// The list's slot in the step plan: what this list's prepare_list kept
  /// at an earlier step, valid while the list's parameters, their storage
  /// and their state are the same objects as then.
  ListSlot& slot;
  /// Some grad's storage changed since the slot was filled (a new grad
  /// tensor, as after zero_grad(set_to_none)): pointers to grads kept in the
  /// slot must be read again.
  bool grads_moved;

  /// The storage type the kernels take (Float32, Float16, BFloat16, or
  /// Float64 when the optimizer takes_float64()).
  ScalarType kernel_dtype() const { return to_scalar_type(dtype); }
};

/// What a list's CPU steps reuse while the step plan holds, kept in its
/// ListSlot: the states, one pointer array per kernel list (by tensor
/// index), the Plan over the parameters' numels, the zero-element
/// parameters (no chunk covers them: parallel_chunks' `empty`), and the
/// state tensors the arrays point into, held so that their memory stays
/// while kept. Derive from it to keep more (the options the lists were
/// gathered for, each step's scalars). FusedAdagrad, FusedRMSprop and
/// FusedSGD keep one.
template <class State>
struct KeptLists {
  std::vector<State*> states;          ///< by tensor index; set before gather()
  std::vector<std::vector<void*>> ptrs;  ///< by kernel list, then tensor index
  std::shared_ptr<const Plan> plan;
  std::vector<std::size_t> empty;

  /// Kernel list l's pointer array, for the kernel's arguments.
  void* const* list(int l) const { return ptrs[static_cast<std::size_t>(l)].data(); }

  /// Fills the pointer arrays (`lists` of them, null where nothing is put)
  /// on ATen's threads (parallel_entries): tensor i's parameter into list
  /// `param`, its grad into list `grad`, and each state tensor t that
  /// state_tensors(i, put) puts into list l (a list other than those two)
  /// by put(l, t); then plans the numels (cpu::kChunkSize chunks), or where
  /// a parameter has gaps (taken in place: updates_runs_in_place) the runs
  /// of every parameter (runs_of_param; the kernel's list 0 must be `param`).
  /// state_tensors runs on several threads at once: it must only read (the
  /// states are made before, on the calling thread).
  template <class StateTensors>
  void gather(const ParamList& pl, int lists, int param, int grad, StateTensors&& state_tensors) {
    const std::vector<const Entry*>& entries = pl.entries;
    const std::size_t n = entries.size();
    grad_ = grad;
    ptrs.assign(static_cast<std::size_t>(lists), std::vector<void*>(n, nullptr));
    // Filled on several threads, then held on this one (HeldState::hold).
    std::vector<std::vector<at::Tensor>> put_tensors(static_cast<std::size_t>(lists));
    std::vector<std::int64_t> numels(n);
    for (int l = 0; l < lists; ++l)
      if (l != param && l != grad) put_tensors[static_cast<std::size_t>(l)].resize(n);
    fill_entries(n, [&](std::size_t i) {
      numels[i] = entries[i]->param.numel();
      ptrs[static_cast<std::size_t>(param)][i] = writable_data(entries[i]->param);
      ptrs[static_cast<std::size_t>(grad)][i] = entries[i]->grad_data();
      state_tensors(i, [&](int l, const at::Tensor& t) {
        TORCH_INTERNAL_ASSERT(l >= 0 && l < lists && l != param && l != grad, "KeptLists: put into list ", l);
        ptrs[static_cast<std::size_t>(l)][i] = writable_data(t);
        put_tensors[static_cast<std::size_t>(l)][i] = t;
      });
    });
    held_.clear();
    for (const std::vector<at::Tensor>& list : put_tensors)
      for (const at::Tensor& t : list) held_.hold(t);
    empty.clear();
    for (std::size_t i = 0; i < n; ++i)
      if (numels[i] == 0) empty.push_back(i);
    plan = list_plan(entries, numels, param);
  }

  /// For a step that reuses what was kept: the grads' pointers read again
  /// when they moved (ParamList::grads_moved).
  void refresh_grads(const ParamList& pl) {
    if (!pl.grads_moved) return;
    TORCH_INTERNAL_ASSERT(grad_ >= 0, "KeptLists: refresh_grads before gather");
    std::vector<void*>& grads = ptrs[static_cast<std::size_t>(grad_)];
    parallel_entries(pl.entries.size(), [&](std::size_t i) { grads[i] = pl.entries[i]->grad_data(); });
  }

 private:
  int grad_ = -1;
  HeldState held_;  ///< the state tensors put, with their storages
};

#if defined(AMPFUSE_WITH_CUDA)
/// What a list's CUDA steps reuse while the step plan holds, kept in its
/// ListSlot (beside the states): each kernel list's views, the numels they
/// were planned for, their launch metadata, and the state tensors the views
/// point into (held, so that their memory stays while kept). Fill them at
/// the list's first step (begin(), then put() or views of your own);
/// meta_for() gives every step's metadata.
struct KeptLaunch {
  TensorListsView views;
  std::vector<std::int64_t> numels;
  std::shared_ptr<const ListMeta> meta;
  HeldState held;

  /// `lists` lists of views, tensor i's each {null, its numel, the list's
  /// kernel dtype}, with the parameters' and grads' data in lists `param`
  /// and `grad`, and the numels.
  void begin(const ParamList& pl, int lists, int param, int grad) {
    const std::size_t n = pl.entries.size();
    const ScalarType st = pl.kernel_dtype();
    views.lists.assign(static_cast<std::size_t>(lists), std::vector<TensorView>(n));
    numels.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      numels[i] = pl.entries[i]->param.numel();
      for (std::vector<TensorView>& l : views.lists) l[i] = {nullptr, numels[i], st};
      views.lists[static_cast<std::size_t>(param)][i].data = pl.entries[i]->param.data_ptr();
      views.lists[static_cast<std::size_t>(grad)][i].data = pl.entries[i]->grad_data();
    }
  }
  /// Tensor i's view in list l points into state tensor t, held while kept.
  void put(int l, std::size_t i, const at::Tensor& t) {
    views.lists[static_cast<std::size_t>(l)][i].data = t.data_ptr();
    held.hold(t);
  }
  /// The same with a numel and dtype of its own (a per-tensor counter or
  /// flag that travels as a pointer: {data, 1, Float32}, its tag not read).
  void put(int l, std::size_t i, const at::Tensor& t, std::int64_t numel, ScalarType dtype) {
    views.lists[static_cast<std::size_t>(l)][i] = {t.data_ptr(), numel, dtype};
    held.hold(t);
  }

  /// This step's metadata (for the Launch to hold): packed from `views` at
  /// the list's first step (`fresh`) and when grads moved (list `grad`'s
  /// views read again from the entries first: the pointers travel in the
  /// metadata), otherwise the kept one through reuse_launch_meta.
  std::shared_ptr<const ListMeta> meta_for(const ParamList& pl, bool fresh, int grad) {
    if (!fresh && pl.grads_moved) {
      std::vector<TensorView>& grads = views.lists[static_cast<std::size_t>(grad)];
      for (std::size_t i = 0; i < grads.size(); ++i) grads[i].data = pl.entries[i]->grad_data();
    }
    meta = fresh || pl.grads_moved ? make_launch_meta(views, Plan(numels, cuda::kChunkSize), pl.device)
                                   : reuse_launch_meta(meta, pl.device);
    return meta;
  }
};
#endif

/// What master_source records of a parameter: its storage and its offset in
/// it. `set_data` gives it another storage, or another place in the same one
/// (a parameter re-pointed into another part of a flat buffer); a
/// copy-on-write storage materialized by a step keeps both and changes only
/// the address of its data. The storage is held weakly: its memory is freed
/// as usual, but its StorageImpl object, whose address is compared, cannot be
/// reused by another storage while recorded (a parameter given empty memory
/// and then loaded weights, `p.set_data(empty)` then `p.set_data(loaded)`,
/// most often gets the freed object's address). Not known until recorded
/// (prepare_master records it when it makes or checks the master, an
/// optimizer's after_load when it loads one).
class MasterSource {
 public:
  /// Whether param is where this was recorded (false where not known).
  bool matches(const at::Tensor& param) const {
    const c10::TensorImpl* impl = param.unsafeGetTensorImpl();
    const c10::StorageImpl* storage = impl->has_storage() ? impl->storage().unsafeGetStorageImpl() : nullptr;
    return known_ && storage_._unsafe_get_target() == storage &&
           (storage == nullptr || offset_ == impl->storage_offset());
  }
  bool known() const { return known_; }
  /// Records param's storage and offset (nothing to do where they match).
  void record(const at::Tensor& param) {
    if (matches(param)) return;
    const c10::TensorImpl* impl = param.unsafeGetTensorImpl();
    storage_ = impl->has_storage() ? impl->storage().getWeakStorageImpl()
                                   : c10::weak_intrusive_ptr<c10::StorageImpl>(c10::intrusive_ptr<c10::StorageImpl>());
    offset_ = impl->has_storage() ? impl->storage_offset() : 0;
    known_ = true;
  }

 private:
  c10::weak_intrusive_ptr<c10::StorageImpl> storage_{c10::intrusive_ptr<c10::StorageImpl>()};
  std::int64_t offset_ = 0;
  bool known_ = false;
};

/// Whether State keeps `master_source` (FusedOptimizer::prepare_master); it
/// must be a MasterSource (an integer of an earlier ampfuse would be ignored).
template <class S, class = void>
struct HasMasterSource : std::false_type {};
template <class S>
struct HasMasterSource<S, std::void_t<decltype(std::declval<const S&>().master_source())>> : std::true_type {
  static_assert(std::is_same_v<std::decay_t<decltype(std::declval<const S&>().master_source())>, MasterSource>,
                "State::master_source must be an sdk::MasterSource: TORCH_ARG(sdk::MasterSource, master_source)");
};
/// Records the parameter the master now matches.
template <class S>
void set_master_source(S& state, const at::Tensor& param) {
  if constexpr (HasMasterSource<S>::value) state.master_source().record(param);
}
/// Whether the parameter's storage, or its place in it, is another than when
/// the master last matched it (false where that is not known).
template <class S>
bool master_source_moved(const S& state, const at::Tensor& param) {
  if constexpr (HasMasterSource<S>::value) {
    return state.master_source().known() && !state.master_source().matches(param);
  } else {
    return false;
  }
}

/// Whether State keeps an fp32 master copy (fields `master` and
/// `master_version`: FusedOptimizer::prepare_master).
template <class S, class = void>
struct HasMaster : std::false_type {};
template <class S>
struct HasMaster<S, std::void_t<decltype(std::declval<const S&>().master()),
                                decltype(std::declval<const S&>().master_version())>> : std::true_type {};

/// What load() does for a loaded State with a master copy, before
/// after_load(): the master stands for the parameter as it is now (where
/// the parameter does not round to it, the parameter's values, as a master
/// made from it), and a write into the parameter after the load (weights
/// loaded next) refreshes it. Without it, the loaded master would be taken
/// for stale at the next step and replaced by the rounded parameter.
/// The version counter a master copy follows: 0 for an inference tensor,
/// which has none (a write into it from outside goes unseen by its master).
inline std::int64_t version_of(const at::Tensor& param) { return param.is_inference() ? 0 : param._version(); }

template <class S>
void follow_loaded_master(const at::Tensor& param, S& state) {
  if constexpr (HasMaster<S>::value) {
    if (state.master().defined()) state.master(master_following(state.master(), param));
    state.master_version(version_of(param));
    set_master_source(state, param);
  }
}

/// What an fp32 master copy takes from its parameter when the parameter was
/// written from outside (FusedOptimizer::prepare_master makes it, and the
/// launch phase copies it in): where the parameter still holds the master's
/// rounding (a parameter given other memory with the same values: a layout
/// conversion), the master's fp32 bits; elsewhere the parameter's value.
inline at::Tensor refreshed_master(const at::Tensor& param, const at::Tensor& master) {
  return at::where(master.to(param.scalar_type()).eq(param), master, param.to(at::kFloat));
}

/// The optimizer base (see the top of this file).
template <class Base, class Options, class State>
class FusedOptimizer : public Base, public ScalerAware {
 public:
  using Base::Base;
  using LossClosure = typename Base::LossClosure;

  /// One step on unscaled grads.
  at::Tensor step(LossClosure closure = nullptr) override {
    at::Tensor loss;
    if (closure) {
      at::AutoGradMode enable_grad(true);
      loss = closure();
    }
    run_step(nullptr);
    return loss;
  }

  /// The contract step (GradScaler::step calls it, or step_with_grads_check).
  /// Final: GradScaler may take the step through step_with_grads_check
  /// instead, which an override of this one would not see.
  void step_with_signals(const StepSignals& signals) final { run_step(&signals); }
  /// The contract step with the scaler's check between validation and
  /// update (ScalerAware::step_with_grads_check).
  bool step_with_grads_check(const StepSignals& signals, const std::function<void()>& check_grads) override {
    run_step(&signals, &check_grads);
    return true;
  }
  /// step() or step_with_signals() with a check after every list is
  /// prepared and before the first write (ScalerAware::step_checked).
  bool step_checked(const StepSignals* signals, const std::function<void()>& check) override {
    run_step(signals, nullptr, &check);
    return true;
  }
  /// The grads of the step plan (ScalerAware::grads_id): a new id whenever
  /// a step finds its plan's grads or parameters changed.
  std::uint64_t grads_id() const override { return grads_id_; }
  /// takes_sparse_grads(), for GradScaler (ScalerAware::steps_sparse_grads).
  bool steps_sparse_grads() const override { return takes_sparse_grads(); }

  /// How the last step found its step plan (see "Step plans" above):
  /// kChanged when it validated and prepared from scratch.
  PlanMatch last_plan_match() const { return last_match_; }
  /// How many parameters the step plan steps through dense copies written
  /// back (views with gaps; see updates_runs_in_place): each costs about
  /// four passes over its elements more than a dense one.
  std::size_t staged_params() const { return staged_params_.size(); }

  /// LibTorch's optimizer format, each state written by State::serialize;
  /// a parameter whose state has_saved_state() refuses is left out.
  void save(torch::serialize::OutputArchive& archive) const override {
    archive.write("pytorch_version", c10::IValue("1.5.0"));
    torch::serialize::OutputArchive state_archive(archive.compilation_unit());
    for (const auto& [key, state] : this->state()) {
      if (!state) {  // refused for a parameter; left out for a tensor that is none (as a step leaves it)
        const auto [g, i] = place_of(*this, key);
        if (g == kNoGroup) continue;
        check_state_not_null(nullptr, name(), g, i);
      }
      TORCH_CHECK(typeid(*state) == typeid(State), name(), ": a state is not a ", name(),
                  " state (was it put into state() by hand?)");
      const State& s = static_cast<const State&>(*state);
      if (!has_saved_state(s)) continue;
      torch::serialize::OutputArchive one(archive.compilation_unit());
      s.serialize(one);
      state_archive.write(std::to_string(reinterpret_cast<std::size_t>(key)), one);
    }
    archive.write("state", state_archive);
    torch::serialize::OutputArchive groups_archive(archive.compilation_unit());
    torch::optim::detail::serialize<Options>(groups_archive, this->param_groups());
    archive.write("param_groups", groups_archive);
  }
  /// Reads LibTorch's optimizer format into fresh State and Options
  /// objects, puts them in place of state() and of every group's options,
  /// validates them as a step would (check_state for every loaded state,
  /// check_entries with no entries), and calls after_load() for every
  /// loaded state. A checkpoint that does not fit this optimizer (another
  /// optimizer's, other counts of groups or parameters, a state tensor of
  /// another shape, dtype or device, a key missing or unknown, a damaged
  /// layout) is refused with a c10::Error naming the group, the parameter
  /// and the key, and changes nothing: the state, the options and the step
  /// plan stay as they were. As in PyTorch's load_state_dict, the state
  /// after a load is the checkpoint's: a parameter it holds no state for
  /// has none (LibTorch's load would keep that parameter's earlier state).
  void load(torch::serialize::InputArchive& archive) override {
    auto& groups = this->param_groups();
    std::vector<std::size_t> sizes;
    for (const auto& group : groups) sizes.push_back(group.params().size());
    CheckpointLayout layout = read_checkpoint_layout(archive, name(), sizes);
    std::vector<Options> options;
    options.reserve(groups.size());
    for (std::size_t g = 0; g < groups.size(); ++g) {
      options.emplace_back(0);  // as LibTorch's load: what the checkpoint lacks takes Options(0)'s values
      read_checkpoint_part(layout.options[g], name(), g, kNoIndex, "options",
                           [&] { options[g].serialize(layout.options[g]); });
      check_saved_option_keys(layout.options[g], options[g], name(), g);
      check_loaded_options(options[g], name(), g);
    }
    const std::vector<std::string> known = saved_state_keys();
    std::remove_reference_t<decltype(this->state())> states;
    std::vector<std::pair<const CheckpointLayout::SavedState*, State*>> loaded;
    for (CheckpointLayout::SavedState& saved : layout.states) {
      const at::Tensor& p = groups[saved.group].params()[saved.index];
      auto st = std::make_unique<State>();
      lay_out_saved_state(saved.archive, p);
      read_checkpoint_part(saved.archive, name(), saved.group, saved.index, "state",
                           [&] { st->serialize(saved.archive); });
      if (!known.empty()) check_saved_state_keys(saved.archive, known, name(), saved.group, saved.index);
      load_extra(archive, p, saved.group, saved.index, *st);
      TORCH_CHECK(states.count(p.unsafeGetTensorImpl()) == 0, name(), ": param group ", saved.group, ", param ",
                  saved.index, " is in the optimizer twice; a parameter may belong to one group only");
      loaded.emplace_back(&saved, st.get());
      states[p.unsafeGetTensorImpl()] = std::move(st);
    }
    // In place, validated with the options they come with, and swapped back
    // when refused: the same objects as before the load, so the step plan
    // still holds.
    auto swap_in = [&] {
      std::swap(this->state(), states);
      for (std::size_t g = 0; g < groups.size(); ++g) std::swap(static_cast<Options&>(groups[g].options()), options[g]);
    };
    swap_in();
    try {
      std::vector<StateField> held;
      for (const auto& [saved, st] : loaded) {
        const at::Tensor& p = groups[saved->group].params()[saved->index];
        const std::size_t g = saved->group, i = saved->index;
        // A state tensor of the parameter's shape in another floating dtype
        // or layout than the optimizer keeps for it now (a model converted
        // since the checkpoint was written: Module::to(dtype), channels_last
        // weights) is read as a step's state follows its parameter (a copy,
        // 8-bit codes coded again), where torch::optim takes any dtype and
        // strides; what does not follow is left to check_loaded_state. (The
        // states are the checkpoint's, not yet in use: nothing to undo.)
        follow_param(p, *st,
                     Follow(
                         p, g, i, [&] { refuse_follow_under_capture(p, g, i); },
                         [](at::Tensor& field, at::Tensor value) { field = std::move(value); },
                         [&](const at::Tensor& field) { held.push_back({g, i, &field}); }));
        check_loaded_state(p, *st, g, i);
      }
      check_saved_state_memory(layout.states, held, name());
      check_entries({});
    } catch (...) {
      swap_in();
      throw;
    }
    forget_plan();
    for (const auto& [saved, st] : loaded) {
      const at::Tensor& p = groups[saved->group].params()[saved->index];
      follow_loaded_master(p, *st);
      after_load(p, *st);
    }
  }

 protected:
  /// The optimizer's name in error messages.
  virtual const char* name() const = 0;
  /// True when the kernels take Double parameters (ScalarType::Float64,
  /// computing in fp64); otherwise such parameters are refused.
  virtual bool takes_float64() const { return false; }
  /// True when the optimizer steps parameters whose grads are sparse, as
  /// its LibTorch counterpart does (prepare_sparse() prepares each such
  /// step, after every list was prepared); otherwise sparse grads are
  /// refused. Sparse grads are refused under signals: GradScaler::step
  /// steps an optimizer that has any on the classic path.
  virtual bool takes_sparse_grads() const { return false; }
  /// True when the optimizer's CPU kernels update a parameter with gaps (a
  /// column slice of a wider tensor) where it lies, run by run: its lists
  /// are gathered by KeptLists::gather, its kernels walk them with the SDK's
  /// executor (for_each_chunk_block, the parameter list 0) and read what is
  /// per tensor by tensor index, and its per-tensor `done` runs through
  /// parallel_chunks. Such a parameter whose runs of adjacent elements are
  /// long (at least 128 elements) then costs what a dense one costs; others,
  /// and every one on CUDA, are stepped through a dense copy written back.
  /// Otherwise (the default) every parameter with gaps takes the copy. A
  /// subclass whose kernels address chunks otherwise (for_each_chunk, a
  /// ChunkRef's begin for the parameter) must return false.
  virtual bool updates_runs_in_place() const { return false; }
  /// Prepares the step of one parameter whose grad is sparse (only when
  /// takes_sparse_grads()): validates, makes state with state_for(), and
  /// returns what steps it, as prepare_list() does for a list.
  virtual Launch prepare_sparse(const Entry& entry) {
    TORCH_CHECK(false, name(), ": param group ", entry.group, ", param ", entry.index,
                ": the grad is sparse, and this optimizer has no sparse step");
    return {};
  }
  /// Validates a parameter's existing state (use check_state_tensor and
  /// check_required_state_tensor); throw to refuse. Runs when the step plan
  /// is made (the first step, and any step that finds a parameter, its state
  /// or a group's plan_key() changed; new grad tensors alone do not make it
  /// again), and for a parameter with state that gains a grad under a kept
  /// plan, not at every step. load()
  /// calls it for every state a checkpoint holds, so that what a step would
  /// refuse is refused when loaded. May run on several threads at once, for
  /// different parameters: read only.
  virtual void check_state(const at::Tensor& /*param*/, const State& /*state*/, std::size_t /*group*/,
                           std::size_t /*index*/) const {}
  /// Names the state tensors that follow their parameter: call follow(field,
  /// dtype) for each tensor of `state` kept with the parameter's shape, in
  /// `dtype` (what check_state asks of it), or follow.replace(field, value)
  /// for state that follows otherwise; and follow.seen(field) for every
  /// other tensor the kernels write (a step count, a flag), so that one
  /// sharing memory with another is refused (check_state_memory). When the step plan is made, a step
  /// calls it for every parameter that has a state, before any validation;
  /// a field whose dtype or layout is no longer what the parameter asks for
  /// (the parameter was converted since: Module::to(dtype), set_data to
  /// channels_last) is replaced by a converted copy (followed_state_tensor),
  /// put back if the step is refused, as torch::optim steps on such state.
  /// Refused under CUDA graph capture. The default names none: check_state
  /// then refuses such state. A parameter with state that gains a grad
  /// under a kept plan has its state followed too, before check_state.
  /// load() calls it for every state it reads, before check_loaded_state: a
  /// checkpoint's state of another floating dtype or layout (a model
  /// converted since it was written) follows as a step's would (FusedAdam's
  /// 8-bit codes in another layout are coded again), so check what is read
  /// before work whose result replace() takes; every field named goes to
  /// the memory check. follow.records_only(): name the fields, do no work.
  virtual void follow_param(const at::Tensor& /*param*/, State& /*state*/, const Follow& /*follow*/) {}
  /// What load() calls for every state a checkpoint holds: check_state,
  /// unless overridden to check more, such as values a step reads on the
  /// device, which check_state must not wait for (a loaded step count).
  virtual void check_loaded_state(const at::Tensor& param, const State& state, std::size_t group,
                                  std::size_t index) const {
    check_state(param, state, group, index);
  }
  /// No hook below may replace a parameter's grad: the step plan and
  /// grads_id() name the grads validated, and GradScaler checks through them.
  ///
  /// Validates anything else about the step's parameters, and the groups'
  /// options; throw to refuse. load() calls it with no entries, with the
  /// checkpoint's options in place. It runs when the step plan is made, and
  /// when parameters gained or lost a grad under a kept plan (over all the
  /// entries), not at every step (see "Step plans" above): an option set
  /// between steps reaches it only where plan_key() changes with it; one
  /// whose every value must be checked is checked in prepare_list.
  virtual void check_entries(const std::vector<Entry>& /*entries*/) const {}
  /// What in group `group`'s options decides the layout of its state (which
  /// tensors, of which dtypes: an option of your own such as a per-group
  /// master_weights or 8-bit moments) or how check_state or check_entries
  /// judge it. A step that finds a group's key other than when the step
  /// plan was made starts the plan over: check_state and check_entries see
  /// the new options before anything is written. The default, 0 for every
  /// group, says no option does (the built-in optimizers' per-group options
  /// are lr, betas, eps and the like, read at every step). Called once per
  /// group at the start of every step: keep it cheap. The built-in
  /// optimizers' plan_key is final (their state depends on it: a subclass
  /// that dropped their key would step state of the old layout).
  virtual std::uint64_t plan_key(std::size_t /*group*/) const { return 0; }
  /// Called once per step after validation, before the first prepare_list():
  /// for optimizer-wide work such as a global gradient norm (it may launch
  /// into workspaces, not into parameters or state). `signals` is null
  /// without a scaler; CPU entries are left out when the CPU step is skipped.
  virtual void begin_step(const std::vector<const Entry*>& /*entries*/, const StepSignals* /*signals*/) {}
  /// After every list's Launch ran (also when there was none); nothing in it
  /// may throw once a Launch wrote. FusedLAMB finishes a sharded step here.
  virtual void end_step(const StepSignals* /*signals*/) {}
  /// Prepares one list and returns what launches it (see the top of this file).
  virtual Launch prepare_list(const ParamList& list) = 0;
  /// save() leaves out a parameter whose state this refuses (state that a
  /// step made but has not filled yet, such as a CUDA momentum buffer before
  /// its first applied step).
  virtual bool has_saved_state(const State& /*state*/) const { return true; }
  /// Called by load() for every parameter whose state it read from the
  /// checkpoint, once the checkpoint was accepted; must not throw. A master
  /// copy (prepare_master's fields) is already made to follow the parameter
  /// (follow_loaded_master).
  virtual void after_load(const at::Tensor& /*param*/, State& /*state*/) {}
  /// Called by load() for every state it read, before validation: for what a
  /// checkpoint keeps of a parameter outside its state (an earlier format).
  /// Writes only into `state`, which the optimizer does not hold yet.
  virtual void load_extra(torch::serialize::InputArchive& /*archive*/, const at::Tensor& /*param*/,
                          std::size_t /*group*/, std::size_t /*index*/, State& /*state*/) {}
  /// Every key State::serialize reads from a checkpoint's state: load()
  /// refuses a state that holds any other (a checkpoint of another optimizer
  /// or of a later version, whose key would be dropped). Empty (the default):
  /// not checked.
  virtual std::vector<std::string> saved_state_keys() const { return {}; }
  /// A fingerprint of every tensor a state holds (stamp_tensors over them),
  /// so that the step plan sees a state tensor replaced from outside: its
  /// steps then validate the state again. Read only; may run on several
  /// threads at once. The default, kNoStamp, makes every step validate and
  /// prepare from scratch.
  virtual std::size_t state_stamp(const State& /*state*/) const { return kNoStamp; }

  /// For state_stamp: a stamp of `tensors` by their TensorImpls' addresses,
  /// nothing read through them, so that a step over many small parameters
  /// does not wait on a cache miss per state tensor. A state tensor is told
  /// apart by identity: one replaced (the state's setters, load(),
  /// state().clear()) is seen, one resized or re-pointed in place (resize_,
  /// set_) is not. A tensor made where a freed one was could have the same
  /// address, so when the step plan is recorded a weak reference to each
  /// tensor is kept with the plan: a state tensor dropped from the state
  /// frees its memory as before, but its TensorImpl, whose address the plan
  /// compares, is not reused while the plan holds. Never kNoStamp.
  std::size_t stamp_tensors(std::initializer_list<const at::Tensor*> tensors) const {
    // Each address times an odd constant of its position, summed: with the
    // others fixed, a bijection of each address (the stamp changes whenever
    // one tensor does), and the products do not wait on each other, where
    // each fold of a chain would wait on the one before (a match of the plan
    // stamps every parameter's state, at every step).
    std::size_t h = 1, odd = 0x9E3779B97F4A7C15ull;
    for (const at::Tensor* t : tensors) {
      h += reinterpret_cast<std::uintptr_t>(t->unsafeGetTensorImpl()) * odd;
      odd += 0x632BE59BD9B4E01Aull;  // an even step keeps it odd
    }
    if (h == kNoStamp) h = 1;
    if (holding_state_)
      for (const at::Tensor* t : tensors)
        if (t->defined()) held_state_.emplace_back(t->getIntrusivePtr());
    return h;
  }

  /// Forgets the step plan: the next step validates and prepares every list
  /// from scratch (load() calls it).
  void forget_plan() {
    plan_valid_ = false;
    plan_group_keys_.clear();
    grads_id_ = 0;
    plan_slots_.clear();
    plan_lists_.clear();
    plan_entries_.clear();  // they may refer to the staged grads' buffers
    plan_entry_ptrs_.clear();
    plan_sparse_.clear();
    staged_grads_.clear();
    staged_params_.clear();
    held_state_.clear();
  }

  /// In prepare_list: how to take back a change made to state that existed
  /// before the step (a field set on it), should a later list throw. State
  /// made by state_for is taken back without it. Undone in reverse order.
  void undo_on_failure(std::function<void()> undo) { undo_.push_back(std::move(undo)); }

  /// In prepare_list, on CPU, for host step counters (a state's step(), as
  /// LibTorch's Adam and Adagrad states keep them): advances each counter of
  /// kept->states by one in the pass that reads it, with kept->steps[i] the
  /// new count and out[i] = f(count) computed once per run of equal counts
  /// (parallel_per_tensor), and takes the counters back should a later list
  /// throw. One pass over the states, and no write after the kernel: the
  /// kernel takes the per-tensor values in `out`. Kept is what the list keeps
  /// in its ListSlot, with members `states` (pointers to State-like objects)
  /// and `steps` (std::vector<std::int64_t>); the undo holds it.
  /// A counter set negative since the plan was made (validation refuses one)
  /// is refused here, naming its parameter, and every counter taken back.
  template <class Kept, class Value, class F>
  void advance_host_steps(const std::shared_ptr<Kept>& kept, std::vector<Value>& out, F&& f) {
    std::atomic<bool> negative{false};
    parallel_per_tensor(
        kept->states.size(),
        [&](std::size_t i) {
          auto& s = *kept->states[i];
          const std::int64_t step = s.step() + 1;
          if (step <= 0) negative.store(true, std::memory_order_relaxed);
          s.step(step);
          return step;
        },
        kept->steps, out, std::forward<F>(f));
    undo_on_failure([kept] {
      for (std::size_t i = 0; i < kept->states.size(); ++i) kept->states[i]->step(kept->steps[i] - 1);
    });
    if (!negative.load()) return;
    for (std::size_t i = 0; i < kept->states.size(); ++i) {
      if (kept->steps[i] > 0) continue;
      std::pair<std::size_t, std::size_t> place{kNoGroup, kNoGroup};
      for (const auto& [key, state] : this->state())
        if (state.get() == static_cast<const void*>(kept->states[i])) place = place_of(*this, key);
      check_state_step(kept->steps[i] - 1, name(), place.first, place.second);
    }
  }

  const Options& options_of(std::size_t group) const {
    return static_cast<const Options&>(this->param_groups()[group].options());
  }
  /// The state of p, or null.
  State* find_state(const at::Tensor& p) {
    auto it = this->state().find(p.unsafeGetTensorImpl());
    return it == this->state().end() ? nullptr : static_cast<State*>(it->second.get());
  }
  /// In prepare_list: the state of p, made by init(State&) when p has none
  /// (then *created is true; a step that throws later erases it). Refuses to
  /// make state while p's stream is being captured in a CUDA graph: state
  /// created inside a graph would be re-created at every replay, so a
  /// warm-up step must come first.
  template <class Init>
  State& state_for(const at::Tensor& p, Init&& init, bool* created = nullptr) {
    auto it = this->state().find(p.unsafeGetTensorImpl());
    if (created) *created = it == this->state().end();
    if (it != this->state().end()) return static_cast<State&>(*it->second);
    return create_state(p, std::forward<Init>(init));
  }
  /// The same for a step's entry, without a second lookup when validation found its state.
  template <class Init>
  State& state_for(const Entry& e, Init&& init, bool* created = nullptr) {
    if (e.state != nullptr) {
      if (created) *created = false;
      return static_cast<State&>(*e.state);
    }
    return state_for(e.user_param(), std::forward<Init>(init), created);
  }

  /// In prepare_list, on CUDA: state.device_step (an fp64 counter of one
  /// element, which the kernels read and advance on the device, so that a
  /// skipped step does not count), made from the host count state.step()
  /// when missing (at the first step, and the first after load()). Refused
  /// under CUDA graph capture; taken back if a later list throws.
  template <class S>
  void prepare_device_step(const Entry& e, S& state) {
    if (!e.device.is_cuda() || state.device_step().defined()) return;
    refuse_under_capture(e, name(), "its device step counter (made at the first step, and again at the first after "
                                    "load())");
    undo_on_failure([&state] { state.device_step(at::Tensor()); });
    state.device_step(
        at::full({1}, static_cast<double>(state.step()), e.param.options().dtype(at::kDouble)));
  }

  /// In prepare_list, for an fp32 master copy of a half or bf16 parameter
  /// kept in State (fields `master`, and `master_version`: the parameter's
  /// version counter when the two last agreed). Makes the master from the
  /// parameter when missing. When the parameter was written from outside
  /// since (weights loaded, a layer re-initialized: its version moved), the
  /// step refreshes the master from it once every list is prepared, before the
  /// first launch; the master would otherwise undo that write. Refuses both
  /// under CUDA graph capture.
  /// Where State also has `master_source` (a MasterSource: the parameter's
  /// storage and offset when the two last agreed), a parameter given other
  /// memory since (`p.set_data(t)`, which leaves the version counter alone)
  /// refreshes the master too.
  template <class S>
  void prepare_master(const Entry& e, S& state) {
    const at::Tensor& followed = e.user_param();  // whose version counter the master follows
    if (!state.master().defined()) {
      refuse_under_capture(e, name(), "its fp32 master copy");
      undo_on_failure([&state] { state.master(at::Tensor()); });
      state.master(e.param.detach().to(at::kFloat, /*non_blocking=*/false, /*copy=*/true, at::MemoryFormat::Preserve));
      state.master_version(version_of(followed));
      set_master_source(state, followed);
      return;
    }
    if (state.master_version() == version_of(followed) && !master_source_moved(state, followed)) {
      set_master_source(state, followed);  // where it was not known (after load()): the master matches it
      return;
    }
    refuse_under_capture(e, name(), "the refresh of its fp32 master copy (the parameter was written from outside "
                                    "since the last step)");
    // Made now (a staged parameter's buffer holds this step's values), where
    // running out of memory still refuses the step; copied in at launch.
    at::Tensor refreshed = refreshed_master(e.param, state.master());
    stale_masters_.emplace_back([refreshed = std::move(refreshed), &followed, &state] {
      state.master().copy_(refreshed);
      state.master_version(version_of(followed));
      set_master_source(state, followed);
    });
  }

 private:
  template <class Init>
  State& create_state(const at::Tensor& p, Init&& init) {
    TORCH_CHECK(!stream_capturing(p.device()), name(),
                ": a parameter has no state yet under CUDA graph capture; run one step outside the capture "
                "(a warm-up step) first, so that state is created outside the graph");
    auto st = std::make_unique<State>();
    init(*st);  // before inserting: a throwing init leaves no empty state behind
    State& ref = *st;
    void* key = p.unsafeGetTensorImpl();
    this->state()[key] = std::move(st);
    undo_.push_back([this, key] { this->state().erase(key); });
    return ref;
  }

  // fn(g, i, p, state) for every parameter with a state of this optimizer's
  // type (one in no group, or of another type, is left to validation).
  template <class Fn>
  void for_each_own_state(Fn&& fn) {
    const auto& groups = this->param_groups();
    for (std::size_t g = 0; g < groups.size(); ++g)
      for (std::size_t i = 0; i < groups[g].params().size(); ++i) {
        const at::Tensor& p = groups[g].params()[i];
        if (!p.defined()) continue;
        const auto it = this->state().find(p.unsafeGetTensorImpl());
        if (it == this->state().end() || !it->second || typeid(*it->second) != typeid(State)) continue;
        fn(g, i, p, static_cast<State&>(*it->second));
      }
  }

  // follow_param for every parameter with a state of this optimizer's type,
  // each replaced field recorded in undo_.
  void follow_params() {
    state_fields_.clear();
    for_each_own_state([&](std::size_t g, std::size_t i, const at::Tensor& p, State& state) {
      follow_param(p, state,
                   undoing_follow(p, g, i, [&](const at::Tensor& field) { state_fields_.push_back({g, i, &field}); }));
    });
  }

  // A step's Follow for parameter p (param i of group g): each field it
  // replaces is put back if the step is refused (undo_).
  Follow undoing_follow(const at::Tensor& p, std::size_t g, std::size_t i, Follow::Seen seen) {
    return Follow(
        p, g, i, [this, &p, g, i] { refuse_follow_under_capture(p, g, i); },
        [this](at::Tensor& field, at::Tensor value) {
          undo_.push_back([&field, before = field]() mutable { field = std::move(before); });
          field = std::move(value);
        },
        std::move(seen));
  }

  void refuse_follow_under_capture(const at::Tensor& p, std::size_t g, std::size_t i) const {
    TORCH_CHECK(!stream_capturing(p.device()), name(), ": param group ", g, ", param ", i,
                ": its state must follow the parameter (converted to another dtype or layout since the last "
                "step, or since its checkpoint was written) under CUDA graph capture; run one step outside the "
                "capture first");
  }

  // p's state (null when it has none), not null and of this optimizer's
  // type. The type is checked on the base: a static_cast to State of a
  // state of another type is undefined behaviour even before it is used
  // (UBSan's vptr check reports it).
  State* own_state(const at::Tensor& p, std::size_t g, std::size_t i) const {
    const auto it = this->state().find(p.unsafeGetTensorImpl());
    if (it == this->state().end()) return nullptr;
    check_state_not_null(it->second.get(), name(), g, i);
    torch::optim::OptimizerParamState& base = *it->second;
    TORCH_CHECK(typeid(base) == typeid(State), name(), ": param group ", g, ", param ", i, ": its state is not a ",
                name(), " state (was it put into state() by hand?)");
    return static_cast<State*>(&base);
  }

  // p's state, checked (null when it has none): what validate_params keeps
  // in Entry::state.
  State* validated_state(const at::Tensor& p, std::size_t g, std::size_t i) const {
    State* st = own_state(p, g, i);
    if (st != nullptr) check_state(p, *st, g, i);
    return st;
  }

  // The plan's entries without those of parameters that lost their grad,
  // with those that gained one (plan_keys_.came; match_plan checked their
  // grads), in group order as validate_params makes them: the parameters
  // and every other state are as the plan validated them. The state of one
  // that gained a grad follows its parameter first, as follow_params has
  // it follow (a state tensor restrided in place while the parameter was
  // frozen is copied into its layout, put back if the step is refused),
  // then is checked.
  void regather_entries() {
    const auto& groups = this->param_groups();
    const auto& came = plan_keys_.came;
    std::vector<Entry> entries;
    entries.reserve(plan_entries_.size() + came.size());
    auto next = came.begin();
    const auto add_came_before = [&](std::size_t g, std::size_t i) {
      for (; next != came.end() && *next < std::make_pair(g, i); ++next) {
        const auto [g, i] = *next;
        const at::Tensor& p = groups[g].params()[i];
        State* st = own_state(p, g, i);
        TORCH_INTERNAL_ASSERT(st != nullptr, name(), ": param group ", g, ", param ", i,
                              " gained a grad under a kept plan without state (match_plan makes the plan again)");
        follow_param(p, *st, undoing_follow(p, g, i, nullptr));
        check_state(p, *st, g, i);
        entries.push_back({g, i, p, p.grad(), p.device(), p.scalar_type(), st});
      }
    };
    for (const Entry& e : plan_entries_) {
      add_came_before(e.group, e.index);
      if (e.user_param().grad().defined()) entries.push_back(e);  // (else it lost its grad)
    }
    add_came_before(groups.size(), 0);
    plan_entries_ = std::move(entries);
  }

  // The plan's lists of plan_entries_, every slot empty.
  void group_entries() {
    check_entries(plan_entries_);
    plan_entry_ptrs_.clear();
    plan_entry_ptrs_.reserve(plan_entries_.size());
    for (const Entry& e : plan_entries_) plan_entry_ptrs_.push_back(&e);
    plan_lists_ = group_lists(plan_entry_ptrs_);
    plan_slots_.assign(plan_lists_.size(), ListSlot());
  }

  // The state tensors follow_param names, of every parameter's state of
  // this optimizer's type (what a plan records of their memory), nothing
  // replaced (a Follow that records only).
  std::vector<const at::Tensor*> state_tensors() {
    std::vector<const at::Tensor*> tensors;
    for_each_own_state([&](std::size_t g, std::size_t i, const at::Tensor& p, State& state) {
      follow_param(p, state, Follow(p, g, i, [] {}, nullptr, [&](const at::Tensor& field) { tensors.push_back(&field); }));
    });
    return tensors;
  }

  // check_grads: GradScaler's check, after validation and before found_inf
  // is read; before_writes: after everything that can refuse the step
  // (preparing every list included), before the first write.
  void run_step(const StepSignals* signals, const std::function<void()>* check_grads = nullptr,
                const std::function<void()>* before_writes = nullptr) {
    at::NoGradGuard no_grad;
    const StateStamp stamp{[](const void* self, const torch::optim::OptimizerParamState& st) {
                             return typeid(st) == typeid(State)
                                        ? static_cast<const FusedOptimizer*>(self)->state_stamp(static_cast<const State&>(st))
                                        : ~std::size_t{0};
                           },
                           this};
    std::vector<Launch> launches;
    undo_.clear();
    stale_masters_.clear();
    PlanMatch match = PlanMatch::kChanged;
    bool skip_cpu = false;  // found_inf set on CPU: no CPU list runs
    // Anything that throws from here on forgets the plan (match_plan may
    // have recorded moved grads that no list was prepared for) and takes
    // back the state made so far: nothing was written.
    try {
      // Every group's plan_key, read once: compared with the plan's, and
      // recorded with it (an option changed during the step, by a hook,
      // is seen at the next step, not recorded unvalidated).
      step_group_keys_.clear();
      for (std::size_t g = 0; g < this->param_groups().size(); ++g) step_group_keys_.push_back(plan_key(g));
      if (plan_valid_ && step_group_keys_ == plan_group_keys_) {
        if (signals) check_signals(*signals, name());
        match = match_plan(*this, stamp, name(), signals, plan_keys_, takes_float64(), /*stage_grads=*/true,
                           sizeof(State));
      }
      if (match == PlanMatch::kChanged) {
        forget_plan();
        follow_params();
        plan_entries_ = validate_params(
            *this, name(), signals,
            [&](const at::Tensor& p, std::size_t g, std::size_t i) -> torch::optim::OptimizerParamState* {
              return validated_state(p, g, i);
            },
            takes_float64(), &staged_grads_, takes_sparse_grads() ? &plan_sparse_ : nullptr, &staged_params_,
            updates_runs_in_place());
        check_state_memory(*this, state_fields_, name());
        group_entries();
      } else if (match == PlanMatch::kGradsCameOrWent) {
        regather_entries();
        group_entries();
      }
      if (match != PlanMatch::kChanged && signals) {
        for (const auto& [key, list] : plan_lists_)
          TORCH_CHECK(signals->contains(std::get<1>(key)), name(), ": param group ", list.front()->group,
                      ", param ", list.front()->index, " is on ", std::get<1>(key),
                      " but the scaler sent no signal for that device");
      }
      if (match != PlanMatch::kSame) grads_id_ = new_grads_id();
      if (check_grads) (*check_grads)();  // found_inf is final from here on
      // Grads laid out otherwise than their parameters: this step's values,
      // in the parameters' layout, before anything reads them.
      refresh_staged_grads(staged_grads_);
      skip_cpu = cpu_step_skipped(signals);
      refresh_staged_params(staged_params_, !skip_cpu);
      if (skip_cpu) {  // a step skipped on CPU (rare): the entries on other devices
        std::vector<const Entry*> stepped;
        for (const Entry* e : plan_entry_ptrs_)
          if (!e->device.is_cpu()) stepped.push_back(e);
        begin_step(stepped, signals);
      } else {
        begin_step(plan_entry_ptrs_, signals);  // kept with the plan, not gathered at every step
      }
      for (std::size_t l = 0; l < plan_lists_.size(); ++l) {
        const auto& [key, list] = plan_lists_[l];
        const auto& [group, device, dtype] = key;
        if (skip_cpu && device.is_cpu()) {
          // Not prepared: what its slot kept of grads that moved is stale.
          if (match == PlanMatch::kGradsMoved) plan_slots_[l].reset();
          continue;
        }
        launches.push_back(prepare_list(ParamList{group, device, dtype, list,
                                                  signals ? &signals->at(device) : nullptr, plan_slots_[l],
                                                  match == PlanMatch::kGradsMoved}));
      }
      for (const Entry& e : plan_sparse_) launches.push_back(prepare_sparse(e));
      if (before_writes) (*before_writes)();
    } catch (...) {
      for (auto it = undo_.rbegin(); it != undo_.rend(); ++it) (*it)();
      undo_.clear();
      stale_masters_.clear();
      forget_plan();
      throw;
    }
    undo_.clear();
    for (const auto& refresh : stale_masters_) refresh();
    stale_masters_.clear();
    for (const Launch& launch : launches)
      if (launch) launch();
    end_step(signals);
    write_back_staged_params(staged_params_, !skip_cpu);
    if (match == PlanMatch::kChanged) {
      record_plan(*this, stamp, plan_keys_, state_tensors());
      plan_group_keys_.swap(step_group_keys_);
      // What the plan's stamps compare by address stays alive while it holds.
      held_state_.clear();
      {
        struct Holding {  // set while recording only: match_plan's threads never write held_state_
          bool& flag;
          explicit Holding(bool& f) : flag(f) { flag = true; }
          ~Holding() { flag = false; }
        } holding(holding_state_);
        for (const auto& kept : this->state())
          if (kept.second && typeid(*kept.second) == typeid(State))
            state_stamp(static_cast<const State&>(*kept.second));
      }
      for (Entry& e : plan_entries_)
        if (e.state == nullptr) e.state = find_state(e.user_param());
    }
    // A plan made at a step skipped on CPU recorded its CPU parameters
    // before their lists made their state: the next step, which makes it,
    // makes the plan again (reused, it took the state made then for none,
    // and a state().clear() after it went unseen).
    plan_valid_ = !(skip_cpu && match == PlanMatch::kChanged);
    last_match_ = match;
  }

  std::vector<std::function<void()>> undo_;
  std::vector<StateField> state_fields_;  ///< what follow_params saw, for check_state_memory
  std::vector<std::function<void()>> stale_masters_;  ///< the refreshes prepare_master asked for
  // The step plan (see the top of this file).
  bool plan_valid_ = false;
  std::uint64_t grads_id_ = 0;  ///< grads_id(); 0 while there is no plan
  PlanMatch last_match_ = PlanMatch::kChanged;
  PlanKeys plan_keys_;
  std::vector<std::uint64_t> plan_group_keys_;  ///< plan_key(g) of every group when the plan was made
  std::vector<std::uint64_t> step_group_keys_;  ///< the same at the start of this step
  std::vector<Entry> plan_entries_;
  std::vector<const Entry*> plan_entry_ptrs_;  ///< one per plan_entries_ element, in order
  std::vector<Entry> plan_sparse_;  ///< parameters with sparse grads (prepare_sparse), rebuilt every step
  Lists plan_lists_;
  std::vector<ListSlot> plan_slots_;
  std::deque<StagedGrad> staged_grads_;  ///< grads read through copies (see validate_params)
  std::deque<StagedParam> staged_params_;  ///< parameters with gaps, stepped through dense copies
  mutable bool holding_state_ = false;          ///< stamp_tensors keeps references (while recording)
  /// The state tensors the plan's stamps compare (weakly: their memory is
  /// freed when dropped, their TensorImpl's address is not reused).
  mutable std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>> held_state_;
};

}  // namespace ampfuse::sdk
