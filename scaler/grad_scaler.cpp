// GradScaler: torch.amp.GradScaler's semantics on LibTorch, plus the
// contract path (ScalerAware optimizers) and fused clipping.

#include "ampfuse/grad_scaler.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/lbfgs.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <iterator>
#include <cmath>
#include <limits>
#include <regex>
#include <string>

#include "ampfuse/sdk/optimizer.h"
#include "ampfuse/tensor_ops.h"
#include "contract/torch/data_address.h"
#include "contract/torch/group_spans.h"
#include "contract/torch/tensor_ops_views.h"
#include "scaler/update_scale.h"

#if defined(AMPFUSE_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace ampfuse {
namespace {

// Pointers to the grads (p.grad()), not copies: at 10,000 parameters the
// reference counting alone was a third of the scaler's host time.
using DeviceGrads = std::vector<std::pair<c10::Device, std::vector<const at::Tensor*>>>;

// Which sparse grads are coalesced before their values are checked: none
// (the contract path's read-only check; fused optimizers refuse sparse
// grads), fp16 ones (unscaling, as torch.amp: coalescing sums duplicate
// indices, which may overflow in fp16, so the coalesced values are checked),
// or all (the norm of clip_grad_norm_, which duplicates would change).
enum class Coalesce { kNone, kHalf, kAll };

// The optimizer's defined grads, by device in order of first appearance. A
// sparse grad stands for its values (_values(), held in `values`), taken
// from its coalesced copy when `coalesce` asks for it; the copies are put
// in place of the grads by commit(), after every grad was checked.
struct CollectedGrads {
  DeviceGrads grads;
  std::deque<at::Tensor> values;                                  // of sparse grads; pointers in grads point here
  std::vector<std::pair<const at::Tensor*, at::Tensor>> coalesced;  // (param, its coalesced grad)
  bool any_sparse = false;

  void commit() const {
    for (const auto& [param, grad] : coalesced) const_cast<at::Tensor&>(*param).mutable_grad() = grad;
  }
};

CollectedGrads grads_by_device(torch::optim::Optimizer& optimizer, Coalesce coalesce) {
  std::size_t total = 0;
  for (const auto& group : optimizer.param_groups()) total += group.params().size();
  CollectedGrads out;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      const at::Tensor* g = &p.grad();
      if (!g->defined()) continue;
      if (g->is_sparse()) {
        out.any_sparse = true;
        at::Tensor sparse = *g;
        if (coalesce == Coalesce::kAll || (coalesce == Coalesce::kHalf && sparse.scalar_type() == at::kHalf)) {
          sparse = sparse.coalesce();
          out.coalesced.emplace_back(&p, sparse);
        }
        out.values.push_back(sparse._values());
        g = &out.values.back();
      }
      auto it = out.grads.begin();
      while (it != out.grads.end() && it->first != g->device()) ++it;
      if (it == out.grads.end()) {
        out.grads.emplace_back(g->device(), std::vector<const at::Tensor*>{});
        it = std::prev(out.grads.end());
        it->second.reserve(total);
      }
      it->second.push_back(g);
    }
  }
  return out;
}

// The grads of every device checked before anything is written, as views
// that the engine ops then take without checking again (views with gaps
// read run by run, or staged through dense copies: write_back() after an
// in-place op).
// The engine's errors name a grad by its place in its device's list
// ("grad[3]", counting the grads on that device): the error names the
// optimizer's parameter it belongs to instead.
std::vector<detail::CheckedList> checked_views(const torch::optim::Optimizer& optimizer, const DeviceGrads& grads,
                                               const char* op, bool in_place) {
  std::vector<detail::CheckedList> views;
  views.reserve(grads.size());
  for (const auto& [device, list] : grads) {
    try {
      views.push_back(detail::make_views(list, "grad", op, in_place));
    } catch (const c10::Error& e) {
      const std::string message = e.msg();
      static const std::regex place("grad\\[([0-9]+)\\]");
      std::smatch m;
      if (!std::regex_search(message, m, place)) throw;
      const auto wanted = static_cast<std::int64_t>(std::stoll(m[1].str()));
      std::int64_t seen = 0;
      const auto& groups = optimizer.param_groups();
      for (std::size_t g = 0; g < groups.size(); ++g)
        for (std::size_t i = 0; i < groups[g].params().size(); ++i) {
          const at::Tensor& grad = groups[g].params()[i].grad();
          if (!grad.defined() || grad.device() != device || seen++ != wanted) continue;
          TORCH_CHECK(false, m.prefix().str(), "param group ", g, ", param ", i, "'s grad",
                      grad.is_sparse() ? " (its values: the grad is sparse)" : "", m.suffix().str());
        }
      throw;
    }
  }
  return views;
}

// One parameter's grad as a GradsPlan records it: identities and the data
// address (a new grad may be allocated where a freed one was), not read
// through.
struct GradKey {
  const c10::TensorImpl* grad = nullptr;  // null: no grad
  const void* data = nullptr;
  std::int64_t numel = 0;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  // What else a comparison reads, kept only to be prefetched (it may dangle).
  const void* param = nullptr;
  const void* autograd_meta = nullptr;
  const void* grad_slot = nullptr;
  const void* storage = nullptr;
  // Where the grad's view is in a reusable plan: views[list], element pos (-1: not kept there).
  std::int32_t list = -1;
  std::int64_t pos = -1;
};

// p's grad as the plan keeps it. Through the TensorImpl: Tensor::grad() also
// asks autograd whether p is a leaf (to warn), calls per parameter that a
// comparison does not need.
const c10::TensorImpl* grad_of(const at::Tensor& p) {
  if (!p.defined()) return nullptr;
  const at::Tensor& g = p.unsafeGetTensorImpl()->grad();
  return g.defined() ? g.unsafeGetTensorImpl() : nullptr;
}

GradKey grad_key(const at::Tensor& p) {
  GradKey k;
  k.grad = grad_of(p);
  if (p.defined()) {
    k.param = p.unsafeGetTensorImpl();
    k.autograd_meta = p.unsafeGetTensorImpl()->autograd_meta();
    k.grad_slot = &p.unsafeGetTensorImpl()->grad();
  }
  if (k.grad == nullptr) return k;
  k.storage = k.grad->unsafe_storage().unsafeGetStorageImpl();
  k.numel = k.grad->numel();
  k.dtype = k.grad->dtype().toScalarType();
  k.data = sdk::data_address(k.grad);
  return k;
}

// Whether p's grad is the one `kept` recorded, each field compared as soon
// as it is read.
bool same_grad(const at::Tensor& p, const GradKey& kept) {
  const c10::TensorImpl* grad = grad_of(p);
  if (grad != kept.grad) return false;
  return grad == nullptr || (grad->numel() == kept.numel && grad->dtype().toScalarType() == kept.dtype &&
                             sdk::data_address(grad) == kept.data);
}

// Whether p's grad, no longer the one `key` recorded, is a tensor whose view
// in a reusable plan (on `device`) differs only by its data pointer: strided,
// without gaps or overlaps, of the same numel, dtype and device, with memory
// (not a ZeroTensor). It then passes every check the plan's views were made with.
bool moved_alike(const at::Tensor& p, const GradKey& key, c10::Device device) {
  const c10::TensorImpl* grad = grad_of(p);
  if (grad == nullptr || key.grad == nullptr || grad->layout() != c10::kStrided || grad->numel() != key.numel ||
      grad->dtype().toScalarType() != key.dtype || grad->device() != device || !grad->is_non_overlapping_and_dense() ||
      grad->_is_zerotensor())  // (no memory: read through a copy of its zeros, refused where written)
    return false;
  // A copy-on-write storage (at::_lazy_clone) is materialized by the view's
  // data pointer, which ATen forbids on the walk's threads: such a grad is
  // collected anew, on the calling thread.
  return !sdk::copy_on_write(grad);
}

bool has_sparse_grad(torch::optim::Optimizer& optimizer) {
  for (const auto& group : optimizer.param_groups())
    for (const auto& p : group.params())
      if (p.grad().defined() && p.grad().is_sparse()) return true;
  return false;
}

at::TensorOptions f32_on(c10::Device device) { return at::TensorOptions().dtype(at::kFloat).device(device); }

// A one-element fp32 CPU tensor holding `value`, written directly: per step,
// where the ops that make one cost more than the scaler's other work.
at::Tensor cpu_scalar(float value) {
  at::Tensor t = at::empty({}, f32_on(c10::kCPU));
  *t.data_ptr<float>() = value;
  return t;
}

// A found_inf of `device`, zero.
at::Tensor zero_found_inf(c10::Device device) {
  return device.is_cpu() ? cpu_scalar(0.f) : at::zeros({}, f32_on(device));
}

// t on `device`, asynchronously where that is safe: a copy to a CUDA device
// is stream-ordered, but a non-blocking copy to the CPU may be read by the
// host before it lands, so copies to the CPU block (PyTorch's own advice).
at::Tensor to_device(const at::Tensor& t, c10::Device device) {
  return t.to(device, /*non_blocking=*/device.is_cuda());
}

constexpr const char* kScaleFix =
    "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration.";

}  // namespace

// An optimizer's grads by device, checked, with their views, kept while
// every parameter has the same grad (same TensorImpl, data address, element
// count and dtype). A change of a grad's shape or strides alone is not
// looked for.
// Not kept when a grad is sparse, staged through a dense copy or read run by
// run (views that follow strides, which the keys do not): those are
// collected again at every step.
struct GradScaler::GradsPlan {
  sdk::GroupSpans groups;                                   // each group's params(): data() and size()
  std::vector<GradKey> keys;                                // per parameter, in group order
  CollectedGrads collected;
  std::vector<detail::CheckedList> views;
  bool reusable = false;
  /// The optimizer's ScalerAware::grads_id when it last stepped on exactly
  /// these grads, checked just before (0: unknown). While the optimizer
  /// reports the same id, the plan holds without a walk.
  std::uint64_t grads_id = 0;

  const DeviceGrads& grads() const { return collected.grads; }
  void write_back() const {
    for (const auto& list : views) list.write_back();
  }
};

const GradScaler::GradsPlan& GradScaler::grads_plan(torch::optim::Optimizer& optimizer, const char* op,
                                                    bool in_place, bool for_norm) {
  // One entry per optimizer stepped; a scaler that outlives many optimizers
  // starts over rather than keeping theirs.
  if (grads_plans_.plans.size() > 64 && grads_plans_.plans.count(&optimizer) == 0) grads_plans_.plans.clear();
  std::shared_ptr<GradsPlan>& kept = grads_plans_.plans[&optimizer];
  // A reusable plan has no staged or split grads: its checks hold for in-place ops too.
  // Each group's params() is where and as long as the plan recorded: the
  // parameters are walked there, by flat index, with no list made per step.
  if (kept && kept->reusable && sdk::same_spans(optimizer, kept->groups)) {
    // A grad replaced by another dense tensor of the same numel, dtype and
    // device (new grads at every step, as after zero_grad() and a backward)
    // would pass the same checks and make the same view but for its data
    // pointer: the view and the key are updated in place (each thread
    // writes only its parameters' entries). Anything else starts over.
    std::atomic<bool> same{true}, moved{false};
    const auto total = static_cast<std::int64_t>(kept->keys.size());  // span_total(kept->groups)
    const auto walk = [&](std::int64_t b, std::int64_t e) {
      sdk::FlatParams cursor(kept->groups, static_cast<std::size_t>(b));
      bool any_moved = false;
      for (std::int64_t k = b; k < e && same.load(std::memory_order_relaxed); ++k, cursor.advance()) {
        if (k + sdk::kPrefetchAhead < e) {
          const GradKey& ahead = kept->keys[static_cast<std::size_t>(k + sdk::kPrefetchAhead)];
          sdk::prefetch(ahead.param);
          sdk::prefetch_grad(ahead.autograd_meta, ahead.grad_slot, ahead.grad, ahead.storage);
        }
        GradKey& key = kept->keys[static_cast<std::size_t>(k)];
        // An op that writes the grads must not write a copy-on-write storage
        // through the kept view (the tensor it shares it with would change):
        // such a grad is collected anew, its storage copied on this thread.
        if (same_grad(*cursor, key) && !(in_place && key.grad != nullptr && sdk::copy_on_write(key.grad))) continue;
        if (key.list < 0 || !moved_alike(*cursor, key, kept->grads()[static_cast<std::size_t>(key.list)].first)) {
          same = false;
          break;
        }
        // As the view's data_ptr() (not a copy-on-write storage: moved_alike).
        void* const data = const_cast<c10::TensorImpl*>(grad_of(*cursor))->mutable_data();
        const std::int32_t list = key.list;
        const std::int64_t pos = key.pos;
        key = grad_key(*cursor);
        key.list = list;
        key.pos = pos;
        kept->views[static_cast<std::size_t>(list)].views.lists[0][static_cast<std::size_t>(pos)].data = data;
        any_moved = true;
      }
      if (any_moved) moved.store(true, std::memory_order_relaxed);
    };
    // Should the walk throw, some threads may have updated keys and views
    // that the pointer arrays do not follow yet: the plan is dropped.
    try {
      at::parallel_for(0, total, sdk::kEntriesGrain, walk);
    } catch (...) {
      kept.reset();
      throw;
    }
    // Also when the walk stopped at a change: the plan stays in the map
    // should the collection below throw, and its pointer arrays must then
    // follow the views already updated.
    if (moved) {
      for (const auto& list : kept->views) detail::views_moved(list);
      kept->grads_id = 0;  // not the grads the optimizer's id named
    }
    if (same) return *kept;
  }
  auto plan = std::make_shared<GradsPlan>();
  plan->collected =
      grads_by_device(optimizer, for_norm ? Coalesce::kAll : in_place ? Coalesce::kHalf : Coalesce::kNone);
  plan->views = checked_views(optimizer, plan->collected.grads, op, in_place);  // throws before anything is written
  plan->collected.commit();  // coalesced sparse grads take their places
  plan->reusable = !plan->collected.any_sparse &&
                   std::all_of(plan->views.begin(), plan->views.end(),
                               [](const detail::CheckedList& l) { return l.staged.empty() && !l.split; });
  plan->groups = sdk::group_spans(optimizer);
  plan->keys.reserve(sdk::span_total(plan->groups));
  // Each grad's place among the views, as grads_by_device made them: by
  // device in order of first appearance, in parameter order within one.
  std::vector<std::int64_t> filled(plan->views.size(), 0);
  for (const auto& group : optimizer.param_groups()) {
    for (const at::Tensor& p : group.params()) {
      GradKey key = grad_key(p);
      if (plan->reusable && key.grad != nullptr) {
        const auto& grads = plan->grads();
        for (std::size_t l = 0; l < grads.size(); ++l) {
          if (grads[l].first != key.grad->device()) continue;
          key.list = static_cast<std::int32_t>(l);
          key.pos = filled[l]++;
          break;
        }
      }
      plan->keys.push_back(key);
    }
  }
  kept = std::move(plan);
  return *kept;
}

namespace {

// What the setters and load() take: PyTorch's setters and load_state_dict
// take any value; refused are only those that would make the scale 0,
// negative, inf or NaN, and an interval that never comes (a growth factor of
// 1 never grows).
void check_factors(const GradScalerOptions& o) {
  TORCH_CHECK(std::isfinite(o.growth_factor()) && o.growth_factor() > 0.0, "ampfuse::GradScaler: growth_factor is ",
              o.growth_factor(), "; a scale grows by a finite factor > 0 (1 never grows)");
  TORCH_CHECK(std::isfinite(o.backoff_factor()) && o.backoff_factor() > 0.0, "ampfuse::GradScaler: backoff_factor is ",
              o.backoff_factor(), "; a scale backs off by a finite factor > 0 (1 never backs off)");
  TORCH_CHECK(o.growth_interval() > 0, "ampfuse::GradScaler: growth_interval is ", o.growth_interval(),
              "; it is at least 1 clean step (a growth_factor of 1 never grows)");
  TORCH_CHECK(o.min_scale() >= 0.0, "ampfuse::GradScaler: min_scale must be >= 0, got ", o.min_scale());
}

// What the constructor takes: PyTorch's constructor asserts these too.
void check_options(const GradScalerOptions& o) {
  TORCH_CHECK(o.growth_factor() > 1.0, "The growth factor must be > 1.0.");
  TORCH_CHECK(o.backoff_factor() < 1.0, "The backoff factor must be < 1.0.");
  check_factors(o);
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions options) : options_(options), init_scale_(options.init_scale()) {
  check_options(options_);
}

void GradScaler::set_growth_factor(double growth_factor) {
  GradScalerOptions options = options_;
  check_factors(options.growth_factor(growth_factor));
  options_ = options;
}

void GradScaler::set_backoff_factor(double backoff_factor) {
  GradScalerOptions options = options_;
  check_factors(options.backoff_factor(backoff_factor));
  options_ = options;
}

void GradScaler::set_growth_interval(std::int64_t growth_interval) {
  GradScalerOptions options = options_;
  check_factors(options.growth_interval(growth_interval));
  options_ = options;
}

at::Tensor GradScaler::scale(const at::Tensor& outputs) {
  if (!options_.enabled()) return outputs;
  if (!scale_.defined()) {
    scale_ = at::full({}, init_scale_, f32_on(outputs.device()));
    growth_tracker_ = at::full({}, init_growth_tracker_, at::TensorOptions().dtype(at::kInt).device(outputs.device()));
  }
  return outputs * to_device(scale_, outputs.device());
}

std::vector<at::Tensor> GradScaler::scale(const std::vector<at::Tensor>& outputs) {
  std::vector<at::Tensor> out;
  out.reserve(outputs.size());
  for (const auto& t : outputs) out.push_back(scale(t));
  return out;
}

void GradScaler::require_scale(const char* what) const {
  TORCH_CHECK(scale_.defined(), "Attempted ", what, " but _scale is None.  ", kScaleFix);
}

GradScaler::OptimizerState& GradScaler::state_of(const torch::optim::Optimizer& optimizer) {
  return per_optimizer_[&optimizer];
}

// Once per iteration and optimizer, before its grads are first read: a
// ScalerAware optimizer's prepare_grads (a sharded optimizer reduces its
// grads here) and the process group to reduce found_inf and norms over.
void GradScaler::prepare(torch::optim::Optimizer& optimizer, OptimizerState& state) {
  if (state.prepared) return;
  state.group = options_.process_group().get();
  if (auto* aware = dynamic_cast<ScalerAware*>(&optimizer)) {
    aware->prepare_grads();
    if (c10d::ProcessGroup* sharded = aware->grads_sharded_over()) state.group = sharded;
  }
  state.prepared = true;
}

at::Tensor GradScaler::inv_scale_on(c10::Device device) const {
  // PyTorch: self._scale.double().reciprocal().float()
  if (scale_.is_cpu() && device.is_cpu()) return cpu_scalar(static_cast<float>(1.0 / static_cast<double>(*scale_.data_ptr<float>())));
  return to_device(scale_.to(at::kDouble).reciprocal().to(at::kFloat), device);
}

void GradScaler::check_grads(torch::optim::Optimizer& optimizer, OptimizerState& state, bool unscale_in_place,
                             const char* op) {
  // Validate every device's grads before the first write (ampfuse::unscale_
  // validates its own list first; this covers the lists after it).
  const GradsPlan& plan = grads_plan(optimizer, op, unscale_in_place, /*for_norm=*/false);
  const DeviceGrads& grads = plan.grads();
  std::vector<DeviceState> devices;
  for (const auto& [device, list] : grads)
    devices.push_back({device, zero_found_inf(device), inv_scale_on(device), {}});
  for (std::size_t i = 0; i < devices.size(); ++i) {
    DeviceState& ds = devices[i];
    if (unscale_in_place) {
      detail::scale(plan.views[i], ds.device, ds.inv_scale, &ds.found_inf);
      ds.inv_scale = at::Tensor();  // grads are unscaled now
    } else {
      detail::check_non_finite(plan.views[i], ds.device, ds.found_inf);
    }
  }
  if (unscale_in_place) plan.write_back();
  state.devices = std::move(devices);
  state.checked = true;
  reduce_across_ranks(state, /*found=*/true, nullptr, unscale_in_place ? "unscale_" : "step");
}

// With a process group (GradScalerOptions::process_group): this rank's
// findings summed with the other ranks', in one all-reduce of [found_inf,
// sum of squares] in fp64 on the scale's device. Every device's found_inf
// becomes the ranks' total, so every rank and device skips together; a rank
// without grads joins with zeros and gets a found_inf on the scale's device.
// `found`: found_inf was just checked here (not by an earlier unscale_).
void GradScaler::reduce_across_ranks(OptimizerState& state, bool found, at::Tensor* sum_sq, const char* op) {
  c10d::ProcessGroup* group = state.group;
  if (!group) return;
  const c10::Device device = scale_.device();
  const auto f64 = at::TensorOptions().dtype(at::kDouble).device(device);
  at::Tensor found_total = at::zeros({}, f64);
  if (found)
    for (const DeviceState& ds : state.devices) found_total.add_(to_device(ds.found_inf, device));
  const at::Tensor sq = sum_sq && sum_sq->defined() ? to_device(*sum_sq, device).to(at::kDouble) : at::zeros({}, f64);
  std::vector<at::Tensor> buffer = {at::stack({found_total, sq})};
  try {
    group->allreduce(buffer)->wait();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "GradScaler::", op, ": rank ", group->getRank(), " of ", group->getSize(),
                ": the all-reduce of found_inf and the grads' sum of squares across the process group failed (every "
                "rank must call step(), unscale_() and clip_grad_norm_() for the same optimizers in the same order, "
                "also a rank without grads): ",
                e.what());
  }
  if (found) {
    if (state.devices.empty()) state.devices.push_back({device, at::zeros({}, f32_on(device)), inv_scale_on(device), {}});
    const at::Tensor total = buffer[0][0].to(at::kFloat);
    for (DeviceState& ds : state.devices) ds.found_inf = to_device(total, ds.device);
  }
  if (sum_sq) *sum_sq = buffer[0][1];
}

at::Tensor GradScaler::combined_found_inf(const OptimizerState& state, c10::Device device) const {
  if (state.devices.size() == 1 && state.devices[0].device == device) return state.devices[0].found_inf;
  at::Tensor sum = at::zeros({}, f32_on(device));
  for (const DeviceState& ds : state.devices) sum.add_(to_device(ds.found_inf, device));
  return sum;
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) return;
  require_scale("unscale_");
  OptimizerState& state = state_of(optimizer);
  TORCH_CHECK(state.stage != Stage::kUnscaled,
              "unscale_() has already been called on this optimizer since the last update().");
  TORCH_CHECK(state.stage != Stage::kStepped, "unscale_() is being called after step().");
  TORCH_CHECK(!state.clipped, "unscale_() is being called after clip_grad_norm_(); call it before, or not at all "
                              "(clip_grad_norm_ does not need it)");
  prepare(optimizer, state);
  check_grads(optimizer, state, /*unscale_in_place=*/true, "GradScaler::unscale_");
  state.stage = Stage::kUnscaled;
}

namespace {

// A disabled scaler's clip_grad_norm_ under a sharded optimizer: each rank's
// sum of squares (fp64) of its pieces' grads, all-reduced over the
// optimizer's group; the grads multiplied by torch::nn::utils::
// clip_grad_norm_'s coefficient, clamp(max_norm / (norm + 1e-6), max 1).
at::Tensor clip_sharded_grads(const std::vector<at::Tensor>& params, double max_norm, c10d::ProcessGroup& group) {
  const at::NoGradGuard no_grad;
  const c10::Device device = params.empty() ? c10::Device(c10::kCPU) : params.front().device();
  at::Tensor sum_sq = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device));
  for (const at::Tensor& p : params)
    if (p.grad().defined() && p.grad().numel() > 0) sum_sq.add_(p.grad().to(at::kDouble).square().sum().to(device));
  std::vector<at::Tensor> buffer{sum_sq};
  try {
    group.allreduce(buffer)->wait();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "GradScaler::clip_grad_norm_: rank ", group.getRank(), " of ", group.getSize(),
                ": the all-reduce of the grads' sum of squares across the sharded optimizer's group failed (every "
                "rank must call clip_grad_norm_() for the same optimizers in the same order): ",
                e.what());
  }
  // In fp64, as LibTorch's stacked norms are once an fp64 grad is among them.
  const at::Tensor norm = buffer[0].sqrt().reshape({});
  const at::Tensor clip_coef = at::clamp(max_norm / (norm + 1e-6), c10::nullopt, 1.0);
  for (const at::Tensor& p : params)
    if (p.grad().defined()) p.grad().mul_(to_device(clip_coef, p.grad().device()));
  return norm.to(at::kFloat);
}

}  // namespace

at::Tensor GradScaler::clip_grad_norm_(torch::optim::Optimizer& optimizer, double max_norm, double norm_type) {
  const auto only_norm_2 = [&] {
    TORCH_CHECK(norm_type == 2.0, "GradScaler::clip_grad_norm_: only norm_type 2 is fused, got ", norm_type,
                "; for other norms call unscale_(optimizer) and then torch::nn::utils::clip_grad_norm_");
  };
  if (!options_.enabled()) {
    // torch::nn::utils::clip_grad_norm_ over the grads the step reads (any
    // norm_type): a sharded optimizer's reduced shard (prepare_grads), with
    // the squares summed across its ranks (norm 2 only).
    auto* aware = dynamic_cast<ScalerAware*>(&optimizer);
    c10d::ProcessGroup* sharded = aware ? aware->grads_sharded_over() : nullptr;
    if (sharded) only_norm_2();
    if (aware) aware->prepare_grads();
    std::vector<at::Tensor> params;
    for (auto& group : optimizer.param_groups())
      for (auto& p : group.params()) params.push_back(p);
    if (!sharded) return at::full({}, torch::nn::utils::clip_grad_norm_(params, max_norm, norm_type), at::kFloat);
    return clip_sharded_grads(params, max_norm, *sharded);
  }
  only_norm_2();
  require_scale("clip_grad_norm_");
  OptimizerState& state = state_of(optimizer);
  TORCH_CHECK(state.stage != Stage::kStepped, "clip_grad_norm_() is being called after step().");
  TORCH_CHECK(!state.clipped, "clip_grad_norm_() has already been called on this optimizer since the last update().");
  prepare(optimizer, state);

  const GradsPlan& plan = grads_plan(optimizer, "GradScaler::clip_grad_norm_", /*in_place=*/false, /*for_norm=*/true);
  const DeviceGrads& grads = plan.grads();
  const bool across_ranks = state.group != nullptr;
  if (grads.empty() && !across_ranks) return at::zeros({}, f32_on(scale_.device()));

  // One read-only pass per device: inf/NaN (unless unscale_ found them
  // already) and the sum of squares, in fp64 so scaled grads cannot overflow.
  const bool scaled = !state.checked;
  std::vector<DeviceState> devices;
  at::Tensor total_sq;
  for (std::size_t i = 0; i < grads.size(); ++i) {
    const c10::Device device = grads[i].first;
    DeviceState ds{device, zero_found_inf(device), scaled ? inv_scale_on(device) : at::Tensor(), {}};
    at::Tensor sum_sq = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device));
    detail::check_non_finite(plan.views[i], device, ds.found_inf, sum_sq);
    total_sq = total_sq.defined() ? total_sq.add_(to_device(sum_sq, total_sq.device())) : sum_sq;
    devices.push_back(std::move(ds));
  }
  if (scaled) {
    state.devices = std::move(devices);
    state.checked = true;
  }
  // With a process group: the global sum of squares (and found_inf).
  reduce_across_ranks(state, /*found=*/scaled, &total_sq, "clip_grad_norm_");
  at::Tensor norm = total_sq.sqrt();
  if (scaled) norm.mul_(inv_scale_on(norm.device()).to(at::kDouble));
  norm = norm.to(at::kFloat);
  // torch::nn::utils::clip_grad_norm_'s arithmetic, on the device.
  const at::Tensor clip_coef = at::clamp(max_norm / (norm + 1e-6), c10::nullopt, 1.0);

  for (DeviceState& ds : state.devices) ds.clip_coef = to_device(clip_coef, ds.device);
  state.clipped = true;
  return norm;
}

void GradScaler::step(torch::optim::Optimizer& optimizer) {
  TORCH_CHECK(dynamic_cast<torch::optim::LBFGS*>(&optimizer) == nullptr,
              "GradScaler::step: LBFGS needs a closure, and closure use is not supported if GradScaler is enabled "
              "(as in PyTorch)");
  if (!options_.enabled()) {
    optimizer.step();
    return;
  }
  require_scale("step");
  OptimizerState& state = state_of(optimizer);
  TORCH_CHECK(state.stage != Stage::kStepped, "step() has already been called since the last update().");
  prepare(optimizer, state);

  auto* aware = dynamic_cast<ScalerAware*>(&optimizer);
  // A sparse grad fails the single pass before its check (the optimizer
  // refuses it under the contract), so only a step that takes two passes
  // asks whether one is sparse: an optimizer that steps them (as
  // torch::optim::Adagrad's does) then takes PyTorch's path.
  const bool one_pass = aware != nullptr && !state.checked && step_in_one_pass(optimizer, *aware, state);
  if (!one_pass && aware && aware->steps_sparse_grads() && has_sparse_grad(optimizer)) aware = nullptr;
  if (aware) {
    if (!one_pass) {
      const bool checked_here = !state.checked;
      try {
        if (checked_here) check_grads(optimizer, state, /*unscale_in_place=*/false, "GradScaler::step");
        if (state.devices.empty()) {
          // No grads at all (every parameter frozen for now): as PyTorch's
          // path for optimizers that take the scale (fused=True), found_inf
          // is 0 and the step has nothing to update.
          aware->step_with_signals(StepSignals{});
          last_found_inf_.erase(&optimizer);
          state.stage = Stage::kStepped;
          return;
        }
        // The grads will be written after the step: check them for that before it.
        if (options_.unscaled_grads_after_step())
          grads_plan(optimizer, "GradScaler::step", /*in_place=*/true, /*for_norm=*/false);
        StepSignals signals;
        for (const DeviceState& ds : state.devices)
          signals.set(ds.device, {ds.inv_scale, combined_found_inf(state, ds.device), ds.clip_coef});
        aware->step_with_signals(signals);
      } catch (...) {
        // The step was refused: as PyTorch's stage stays READY, a step
        // retried in this iteration checks its grads again (update() reads
        // this check's found_inf meanwhile). A check made by unscale_ or
        // clip_grad_norm_ stands, as PyTorch's UNSCALED does.
        if (checked_here) state.checked = false;
        throw;
      }
      // (After unscale_ or clip_grad_norm_, the grads may have been replaced since they were checked.)
      if (checked_here) remember_grads_id(optimizer, *aware);
    }
    if (options_.unscaled_grads_after_step()) apply_deferred_factors(optimizer, state, /*unless_found=*/true);
  } else {
    if (!state.checked) check_grads(optimizer, state, /*unscale_in_place=*/true, "GradScaler::step");
    TORCH_CHECK(!state.devices.empty(), "No inf checks were recorded for this optimizer.");
    // The grads are unscaled now, as PyTorch's step() marks them (through
    // unscale_): should the optimizer throw, unscale_ is refused until update().
    state.stage = Stage::kUnscaled;
    // PyTorch's path: one host read of found_inf, then step or skip.
    double found = 0.0;
    for (const DeviceState& ds : state.devices) found += ds.found_inf.item<float>();
    if (found == 0.0) {
      apply_deferred_factors(optimizer, state, /*unless_found=*/false);
      // Applied: a step retried after the optimizer threw takes the grads as they are.
      for (DeviceState& ds : state.devices) ds.inv_scale = ds.clip_coef = at::Tensor();
      optimizer.step();
    }
  }
  last_found_inf_[&optimizer] = combined_found_inf(state, state.devices.front().device);
  state.stage = Stage::kStepped;
}

// GradScaler::step's single pass, for a ScalerAware optimizer whose grads
// nothing read earlier in the iteration: the optimizer validates its
// parameters and grads and, before its update, calls back to have them
// checked. Where it names the grads that the kept plan was checked on at its
// last step (grads_id), they are checked through that plan, without the walk
// over every parameter that grads_plan would make again; otherwise
// grads_plan walks, or collects them anew. Taken for one device without a
// process group, where found_inf is the check's own tensor (with several,
// the signal is a sum made after the checks; across ranks, a collective
// result). False: not taken, nothing done. A step that fails before its
// check (a parameter moved to another device, say) is retried by the
// two-pass path, which validates from scratch and reports any error; the
// optimizer's steps are all-or-nothing, so the failed one wrote nothing.
bool GradScaler::step_in_one_pass(torch::optim::Optimizer& optimizer, ScalerAware& aware, OptimizerState& state) {
  if (state.group != nullptr) return false;
  const auto found = grads_plans_.plans.find(&optimizer);
  if (found == grads_plans_.plans.end() || !found->second || found->second->grads_id == 0 ||
      found->second->grads().size() != 1)
    return false;
  std::shared_ptr<GradsPlan> plan = found->second;  // grads_plan may replace it in the map
  const c10::Device device = plan->grads().front().first;
  DeviceState ds{device, zero_found_inf(device), inv_scale_on(device), {}};
  StepSignals signals;
  signals.set(device, {ds.inv_scale, ds.found_inf, {}});
  const bool writes_grads = options_.unscaled_grads_after_step();
  bool checked = false, taken = false;
  try {
    taken = aware.step_with_grads_check(signals, [&] {
      if (aware.grads_id() != plan->grads_id) {
        grads_plan(optimizer, "GradScaler::step", /*in_place=*/writes_grads, /*for_norm=*/false);
        plan = grads_plans_.plans.at(&optimizer);
      }
      // The optimizer found every parameter on `device`; a plan of no grads is the two-pass path's error.
      TORCH_CHECK(plan->grads().size() == 1 && plan->grads().front().first == device);
      detail::check_non_finite(plan->views.front(), device, ds.found_inf);
      checked = true;
    });
  } catch (...) {
    if (!checked) return false;
    // The optimizer's own error, after the check: retrying could step twice.
    // As the two passes' when the optimizer throws: update() reads this
    // check's found_inf (and backs off when it found an inf), and a step
    // retried in this iteration checks its grads again (PyTorch's READY).
    state.devices = {std::move(ds)};
    state.checked = false;
    throw;
  }
  if (!taken) return false;
  // (Outside the try: a step taken must not be retried.)
  TORCH_CHECK(checked, "GradScaler::step: the optimizer's step_with_grads_check returned true without calling "
                       "check_grads (ScalerAware: it must call it once, before reading found_inf or writing)");
  if (plan->reusable) plan->grads_id = aware.grads_id();
  state.devices = {std::move(ds)};
  state.checked = true;
  return true;
}

// After a step on grads that the kept plan was checked on just before.
void GradScaler::remember_grads_id(const torch::optim::Optimizer& optimizer, const ScalerAware& aware) {
  const auto found = grads_plans_.plans.find(&optimizer);
  if (found != grads_plans_.plans.end() && found->second && found->second->reusable)
    found->second->grads_id = aware.grads_id();
}

// Multiplies the optimizer's grads by the factors the step deferred: the
// inverse scale (unless unscale_ unscaled them in place) and the clip
// coefficient, computed as the contract path's kernels compute them
// (detail::grad_factor_f64: their product rounded once, in the kernel). With `unless_found`, by 1 where a device's
// found_inf is set, decided on the device (no sync).
void GradScaler::apply_deferred_factors(torch::optim::Optimizer& optimizer, const OptimizerState& state,
                                        bool unless_found) {
  const GradsPlan& plan = grads_plan(optimizer, "GradScaler::step", /*in_place=*/true, /*for_norm=*/false);
  const DeviceGrads& grads = plan.grads();
  for (std::size_t i = 0; i < grads.size(); ++i) {
    const auto ds = std::find_if(state.devices.begin(), state.devices.end(),
                                 [&](const DeviceState& d) { return d.device == grads[i].first; });
    if (ds == state.devices.end()) continue;
    at::Tensor factor = detail::grad_factor_f64(ds->inv_scale, ds->clip_coef);
    if (!factor.defined()) continue;
    if (unless_found) {
      const at::Tensor found = combined_found_inf(state, ds->device);
      if (ds->device.is_cpu()) {
        if (found.item<float>() != 0.f) continue;  // a host read of a CPU tensor: no sync
      } else {
        factor = at::where(found != 0, at::ones_like(factor), factor);
      }
    }
    detail::scale(plan.views[i], ds->device, factor.reshape({1}), nullptr);
  }
  plan.write_back();
}

void GradScaler::update() {
  if (!options_.enabled()) return;
  require_scale("update");
  std::vector<at::Tensor> found_infs;
  for (const auto& [opt, state] : per_optimizer_)
    for (const DeviceState& ds : state.devices) found_infs.push_back(ds.found_inf);
  TORCH_CHECK(!found_infs.empty(), "No inf checks were recorded prior to update.");
  at::Tensor combined = to_device(found_infs[0], scale_.device());  // only read, unless summed into
  if (found_infs.size() > 1) {
    combined = combined.clone();
    for (std::size_t i = 1; i < found_infs.size(); ++i) combined.add_(to_device(found_infs[i], scale_.device()));
  }

  const scaler::UpdateScaleParams params{options_.growth_factor(), options_.backoff_factor(),
                                         options_.growth_interval(), options_.min_scale()};
  if (scale_.device().is_cpu()) {
    scaler::update_scale_math(scale_.data_ptr<float>(), growth_tracker_.data_ptr<std::int32_t>(),
                              *combined.data_ptr<float>(), params);
  } else {
#if defined(AMPFUSE_WITH_CUDA)
    const c10::cuda::CUDAGuard guard(scale_.device());
    scaler::update_scale_cuda(scale_.data_ptr<float>(), growth_tracker_.data_ptr<std::int32_t>(),
                              combined.data_ptr<float>(), params,
                              c10::cuda::getCurrentCUDAStream(scale_.device().index()).stream());
#else
    TORCH_CHECK(false, "GradScaler::update: the scale is on ", scale_.device(), " but ampfuse was built without CUDA");
#endif
  }
  end_iteration();
}

void GradScaler::end_iteration() {
  per_optimizer_.clear();
  // Plans that cannot serve the next step (staged or sparse grads) would
  // only keep this step's grads and their copies alive.
  for (auto it = grads_plans_.plans.begin(); it != grads_plans_.plans.end();)
    it = it->second && !it->second->reusable ? grads_plans_.plans.erase(it) : std::next(it);
}

void GradScaler::update(double new_scale) {
  if (!options_.enabled()) return;
  require_scale("update");
  scale_.fill_(new_scale);
  end_iteration();
}

void GradScaler::update(const at::Tensor& new_scale) {
  if (!options_.enabled()) return;
  require_scale("update");
  const char* reason =
      "new_scale should be a float or a 1-element torch.cuda.FloatTensor or torch.FloatTensor with "
      "requires_grad=False.";
  TORCH_CHECK(new_scale.defined() && new_scale.device().type() == scale_.device().type(), reason);
  TORCH_CHECK(new_scale.numel() == 1, reason);
  TORCH_CHECK(!new_scale.requires_grad(), reason);
  scale_.copy_(new_scale.reshape({}));
  end_iteration();
}

double GradScaler::get_scale() const {
  if (!options_.enabled()) return 1.0;
  return scale_.defined() ? scale_.item<double>() : init_scale_;
}

std::int64_t GradScaler::get_growth_tracker() const {
  if (!options_.enabled()) return 0;
  return growth_tracker_.defined() ? growth_tracker_.item<std::int64_t>() : init_growth_tracker_;
}

bool GradScaler::last_step_skipped(const torch::optim::Optimizer& optimizer) const {
  const auto it = last_found_inf_.find(&optimizer);
  return it != last_found_inf_.end() && it->second.item<float>() != 0.f;
}

void GradScaler::save(torch::serialize::OutputArchive& archive) const {
  if (!options_.enabled()) return;
  archive.write("scale", c10::IValue(get_scale()));
  archive.write("growth_factor", c10::IValue(options_.growth_factor()));
  archive.write("backoff_factor", c10::IValue(options_.backoff_factor()));
  archive.write("growth_interval", c10::IValue(options_.growth_interval()));
  archive.write("_growth_tracker", c10::IValue(get_growth_tracker()));
}

void GradScaler::load(torch::serialize::InputArchive& archive) {
  if (!options_.enabled()) return;
  const char* keys[] = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"};
  c10::IValue values[5];
  int present = 0;
  for (int i = 0; i < 5; ++i) present += archive.try_read(keys[i], values[i]) ? 1 : 0;
  c10::IValue probe;
  TORCH_CHECK(present > 0 || !archive.try_read("pytorch_version", probe),
              "GradScaler::load: the archive holds an optimizer's checkpoint, not a GradScaler's");
  TORCH_CHECK(present > 0,
              "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler.");
  for (int i = 0; i < 5; ++i) {
    TORCH_CHECK(!values[i].isNone(), "GradScaler::load: the archive has no '", keys[i],
                "'; it does not hold a GradScaler state");
    const bool is_int_key = i >= 3;
    TORCH_CHECK(is_int_key ? values[i].isInt() : values[i].isDouble(), "GradScaler::load: '", keys[i], "' is a ",
                values[i].tagKind(), ", expected ", is_int_key ? "an int" : "a float");
  }
  for (const std::string& key : archive.keys())
    TORCH_CHECK(std::find(std::begin(keys), std::end(keys), key) != std::end(keys), "GradScaler::load: the archive has "
                "the key '", key, "', which a GradScaler does not save (a damaged or foreign checkpoint?)");
  // Validate before the first write: a rejected archive changes nothing.
  const double new_scale = values[0].toDouble();
  // 0 and inf are what update() can make (a scale backed off below fp32's
  // range, update(inf)); PyTorch saves and loads them.
  TORCH_CHECK(new_scale >= 0, "GradScaler::load: 'scale' is ", new_scale, "; a scale is >= 0 (0 and inf included)");
  GradScalerOptions options = options_;
  options.growth_factor(values[1].toDouble()).backoff_factor(values[2].toDouble()).growth_interval(values[3].toInt());
  try {
    check_factors(options);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "GradScaler::load: ", e.what_without_backtrace());
  }
  const std::int64_t tracker = values[4].toInt();
  // The tracker counts clean steps since the last growth, an int32 on the
  // device; at or past the interval (PyTorch's set_growth_interval can leave
  // it there) it grows the scale at the next clean update().
  TORCH_CHECK(tracker >= 0 && tracker <= std::numeric_limits<std::int32_t>::max(), "GradScaler::load: '_growth_tracker' is ",
              tracker, "; a count of clean steps is from 0 to 2^31 - 1");
  options_ = options;
  init_scale_ = new_scale;
  if (scale_.defined()) scale_.fill_(new_scale);
  init_growth_tracker_ = tracker;
  if (growth_tracker_.defined()) growth_tracker_.fill_(init_growth_tracker_);
}

torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive, const GradScaler& scaler) {
  scaler.save(archive);
  return archive;
}

torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive, GradScaler& scaler) {
  scaler.load(archive);
  return archive;
}

}  // namespace ampfuse
