// The SDK's optimizer base (ampfuse/sdk/optimizer.h): validation, grouping
// and signal plumbing shared by every fused optimizer, ampfuse's and others'.

#include "ampfuse/sdk/optimizer.h"

#include <ATen/ExpandUtils.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/full.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/zeros.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/COW.h>
#include <c10/util/Exception.h>
#include <c10/util/strides.h>

#include <algorithm>
#include <functional>
#include <atomic>
#include <cstdint>
#include <exception>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#if defined(AMPFUSE_WITH_CUDA)
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "contract/torch/meta_cache.h"
#endif

#include "contract/torch/data_address.h"
#include "contract/torch/group_spans.h"
#include "contract/torch/tensor_ops_views.h"

namespace ampfuse::sdk {

namespace {

bool supported_dtype(c10::ScalarType t, bool float64) {
  return t == c10::ScalarType::Float || t == c10::ScalarType::Half || t == c10::ScalarType::BFloat16 ||
         (float64 && t == c10::ScalarType::Double);
}

}  // namespace

// Whether t (a grad or a state tensor of p) is laid out as the kernels walk
// p: p's strides when p is dense, else kernel_strides(p).
bool in_kernel_layout(const at::Tensor& t, const at::Tensor& p) {
  if (p.is_non_overlapping_and_dense()) return t.strides() == p.strides();
  return t.strides() == c10::IntArrayRef(kernel_strides(p));
}

void check_state_tensor(const at::Tensor& s, const at::Tensor& p, c10::ScalarType dtype, const char* name,
                        const char* what, std::size_t g, std::size_t i) {
  if (!s.defined()) return;
  TORCH_CHECK(!s.is_neg(), name, ": param group ", g, ", param ", i, ": state ", what,
              " has its negative bit set (a _neg_view()): its memory holds the values negated, and the kernels "
              "read memory; resolve it with resolve_neg()");
  TORCH_CHECK(s.sizes() == p.sizes() && s.scalar_type() == dtype && s.device() == p.device() &&
                  in_kernel_layout(s, p),
              name, ": param group ", g, ", param ", i, ": state ", what, " has shape ", s.sizes(), ", dtype ",
              s.scalar_type(), " on ", s.device(), ", strides ", s.strides(), " but ", name, " keeps it with shape ",
              p.sizes(), ", dtype ", dtype, " on ", p.device(), ", strides ", c10::IntArrayRef(kernel_strides(p)),
              s.sizes() == p.sizes() && s.device() != p.device()
                  ? " (was the parameter moved to another device after its state was made? torch::optim refuses "
                    "that too: move the model before making the optimizer)"
                  : " (a checkpoint of another model or of other options, or a parameter or state tensor given "
                    "memory of another shape since?)");
}

bool state_tensor_follows(const at::Tensor& s, const at::Tensor& p, c10::ScalarType dtype) {
  if (!s.defined() || p.layout() != at::kStrided || s.sizes() != p.sizes() || s.device() != p.device() ||
      !at::isFloatingType(s.scalar_type()) || !at::isFloatingType(dtype))
    return false;
  if (s.is_sparse()) return s.scalar_type() != dtype;  // kept sparse (FusedSGD)
  return s.layout() == at::kStrided &&
         !(s.scalar_type() == dtype && in_kernel_layout(s, p) && !s.is_neg() && !s._is_zerotensor());
}

at::Tensor followed_state_tensor(const at::Tensor& s, const at::Tensor& p, c10::ScalarType dtype) {
  if (!state_tensor_follows(s, p, dtype)) return {};
#if defined(AMPFUSE_WITH_CUDA)
  // Read on this stream, and freed after the step: not reused by the stream it was made on before then.
  if (s.is_cuda()) s.record_stream(c10::cuda::getCurrentCUDAStream(s.device().index()));
#endif
  if (s.is_sparse()) return s.to(dtype);
  return at::empty_strided(p.sizes(), kernel_strides(p), s.options().dtype(dtype)).copy_(s);
}

void check_state_not_null(const torch::optim::OptimizerParamState* state, const char* name, std::size_t g,
                          std::size_t i) {
  TORCH_CHECK(state != nullptr, name, ": param group ", g, ", param ", i, ": its state is null (state()[key] used as a lookup "
              "inserts one: use state().find(key)); erase it, and the next step makes its state afresh");
}

void check_state_memory(const torch::optim::Optimizer& opt, const std::vector<StateField>& fields, const char* name) {
  if (fields.empty()) return;
  // Each parameter and its grad, then the state tensors; what each is.
  struct Place {
    std::size_t group, index;
    const char* what;
  };
  std::vector<const at::Tensor*> tensors;
  std::vector<Place> places;
  const auto& groups = opt.param_groups();
  for (std::size_t g = 0; g < groups.size(); ++g)
    for (std::size_t i = 0; i < groups[g].params().size(); ++i) {
      const at::Tensor& p = groups[g].params()[i];
      if (!p.defined()) continue;
      tensors.push_back(&p);
      places.push_back({g, i, "the parameter"});
      if (!p.grad().defined()) continue;
      tensors.push_back(&p.grad());
      places.push_back({g, i, "the grad"});
    }
  const std::size_t first_state = tensors.size();
  for (const StateField& f : fields) {
    tensors.push_back(f.tensor);
    places.push_back({f.group, f.index, "a state tensor"});
  }
  find_shared_memory(tensors, [&](std::size_t x, std::size_t y) {
    // (x < y: y is a state tensor where either is. Parameters that share
    // memory, and a tensor that overlaps itself, are validate_params'.)
    if (x == y || y < first_state) return;
    const Place& s = places[y];
    const Place& o = places[x];
    TORCH_CHECK(false, name, ": param group ", s.group, ", param ", s.index, ": a state tensor shares memory with ",
                o.what, " of param group ", o.group, ", param ", o.index,
                "; a step reads both before writing either, where torch::optim's ops run one after the other: give "
                "each state tensor memory of its own (was one put into state() as a view of another tensor, or "
                "twice?)");
  });
}

std::pair<std::size_t, std::size_t> place_of(const torch::optim::Optimizer& opt, const void* key) {
  const auto& groups = opt.param_groups();
  for (std::size_t g = 0; g < groups.size(); ++g)
    for (std::size_t i = 0; i < groups[g].params().size(); ++i)
      if (groups[g].params()[i].unsafeGetTensorImpl() == key) return {g, i};
  return {kNoGroup, kNoGroup};
}

void check_required_state_tensor(const at::Tensor& s, const at::Tensor& p, c10::ScalarType dtype, const char* name,
                                 const char* what, std::size_t g, std::size_t i) {
  TORCH_CHECK(s.defined(), name, ": param group ", g, ", param ", i, ": state ", what,
              " is missing (a checkpoint of another optimizer, or a damaged one?)");
  check_state_tensor(s, p, dtype, name, what, g, i);
}

void check_state_step(std::int64_t step, const char* name, std::size_t g, std::size_t i) {
  TORCH_CHECK(step >= 0, name, ": param group ", g, ", param ", i, ": state step is ", step,
              "; a step count is never negative (a damaged checkpoint?)");
}

void check_device_step(const at::Tensor& step, const at::Tensor& p, const char* name, std::size_t g, std::size_t i) {
  TORCH_CHECK(!step.defined() || (step.numel() == 1 && step.scalar_type() == at::kDouble && step.device() == p.device()),
              name, ": param group ", g, ", param ", i,
              ": state device_step must be a Double tensor of one element on the parameter's device");
}

namespace {

// A signal's tensors are read by kernels on its device: check them as the
// engine checks found_inf (a host or peer pointer would fault on the GPU).
void check_signal(const ScaleSignal& s, c10::Device device, const char* name) {
  auto check = [&](const at::Tensor& t, const char* field, bool required) {
    if (!t.defined()) {
      TORCH_CHECK(!required, name, ": the scale signal for ", device, " has no ", field);
      return;
    }
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == 1 && t.device() == device, name, ": the scale signal's ",
                field, " for ", device, " must be a float32 tensor of one element on that device, got ",
                t.scalar_type(), " with ", t.numel(), " elements on ", t.device());
  };
  check(s.found_inf, "found_inf", true);
  check(s.inv_scale, "inv_scale", false);
  check(s.clip_coef, "clip_coef", false);
}

// The TensorImpls of a step's parameters, for the one-group-only check: an
// open-addressing set whose table is kept per thread, so that a step
// allocates nothing (std::unordered_map cost a malloc and a cache miss per
// parameter: a third of the host time of a 10,000-parameter step).
class ImplSet {
 public:
  void reset(std::size_t n) {
    std::size_t capacity = 64;
    while (capacity < 2 * n) capacity *= 2;
    slots_.assign(capacity, nullptr);
    mask_ = capacity - 1;
  }
  /// False when p was already inserted.
  bool insert(const void* p) {
    std::size_t h = (reinterpret_cast<std::uintptr_t>(p) >> 4) * 0x9E3779B97F4A7C15ull;
    for (std::size_t i = (h >> 32) & mask_;; i = (i + 1) & mask_) {
      if (slots_[i] == p) return false;
      if (slots_[i] == nullptr) {
        slots_[i] = p;
        return true;
      }
    }
  }

 private:
  std::vector<const void*> slots_;
  std::size_t mask_ = 0;
};

// A grad the kernels cannot read in place: laid out otherwise than its
// parameter's dense layout (other strides, or a view with gaps), read
// through a copy in that layout.
// A grad laid out otherwise than its parameter, a ZeroTensor (no memory:
// its dense copy holds the zeros it stands for, as torch::optim reads it),
// or one whose negative bit is set (x._neg_view(), at::imag(z.conj()): its
// memory holds the values negated; the copy holds them).
bool grad_needs_staging(const at::Tensor& p, const at::Tensor& grad) {
  return grad.defined() && (!in_kernel_layout(grad, p) || grad._is_zerotensor() || grad.is_neg());
}

// A parameter the kernels cannot update in place: a view with gaps, or one
// whose negative bit is set; stepped through a dense copy written back.
bool param_needs_staging(const at::Tensor& p) { return !p.is_non_overlapping_and_dense() || p.is_neg(); }

enum class GradKind { kNone, kInPlace, kStaged, kSparse };

// The checks of one parameter (the group-membership check aside). Reads
// only, so that parameters can be checked on several threads. A grad laid
// out otherwise than its parameter is kStaged when `stage_grads`, else
// refused; a sparse grad is kSparse when `sparse_grads`, else refused.
GradKind check_param(const at::Tensor& p, std::size_t g, std::size_t i, const char* name,
                     const StepSignals* signals, bool float64, bool stage_grads, bool sparse_grads = false,
                     bool stage_params = false, bool inference_mode = false) {
  TORCH_CHECK(p.defined(), name, ": param group ", g, ", param ", i, " is undefined");
  TORCH_CHECK(supported_dtype(p.scalar_type(), float64), name, ": param group ", g, ", param ", i, ": dtype ",
              p.scalar_type(), " is not supported (expected Float, Half, BFloat16",
              float64 ? " or Double)" : "; this optimizer's kernels have no Double path)");
  TORCH_CHECK(p.layout() == c10::kStrided && !p.is_nested(), name, ": param group ", g, ", param ", i,
              " has layout ", p.layout(), p.is_nested() ? " (nested)" : "", "; parameters are strided tensors");
  TORCH_CHECK(!p._is_zerotensor(), name, ": param group ", g, ", param ", i,
              " is a ZeroTensor, which has no memory to update; materialize it with .clone()");
  if (!p.is_non_overlapping_and_dense()) {
    TORCH_CHECK(at::has_internal_overlap(p) != at::MemOverlap::Yes, name, ": param group ", g, ", param ", i,
                " overlaps itself (an expanded or broadcast view, strides ", p.strides(),
                "): a step would write one element several times");
    TORCH_CHECK(stage_params, name, ": param group ", g, ", param ", i, " is not dense (a view with gaps, strides ",
                p.strides(), "); this optimizer updates dense parameters only");
  }
  TORCH_CHECK(!p.is_inference() || inference_mode, name, ": param group ", g, ", param ", i,
              " is an inference tensor (made under InferenceMode), which ATen's in-place ops, and so torch::optim, "
              "do not update outside InferenceMode; clone() it outside InferenceMode");
  TORCH_CHECK(!p.is_neg() || stage_params, name, ": param group ", g, ", param ", i,
              " has its negative bit set (a _neg_view()); this optimizer updates parameters in place only: "
              "resolve it with resolve_neg()");
  const at::Tensor& grad = p.grad();
  if (!grad.defined()) return GradKind::kNone;
  TORCH_CHECK((grad.layout() == c10::kStrided && !grad.is_nested()) || grad.layout() == c10::kSparse, name,
              ": param group ", g, ", param ", i, ": the grad has layout ", grad.layout(),
              grad.is_nested() ? " (nested)" : "", "; optimizers take strided grads, and sparse COO ones where they "
              "step them (FusedSGD, FusedAdagrad): convert it with .to_dense() or .to_sparse()");
  TORCH_CHECK(!grad.is_sparse() || sparse_grads, name, ": param group ", g, ", param ", i,
              ": the grad is sparse; sparse gradients are not supported by this optimizer (as by "
              "torch::optim::Adam); FusedSGD and FusedAdagrad take them");
  TORCH_CHECK(grad.scalar_type() == p.scalar_type(), name, ": param group ", g, ", param ", i, ": grad dtype ",
              grad.scalar_type(), " differs from the parameter's ", p.scalar_type());
  TORCH_CHECK(grad.device() == p.device(), name, ": param group ", g, ", param ", i, ": grad is on ", grad.device(),
              " but the parameter is on ", p.device());
  TORCH_CHECK(grad.sizes() == p.sizes(), name, ": param group ", g, ", param ", i, ": grad shape ", grad.sizes(),
              " differs from the parameter's ", p.sizes());
  if (grad.is_sparse()) {
    TORCH_CHECK(!signals, name, ": param group ", g, ", param ", i,
                ": the grad is sparse, and a step under the scaler contract reads dense grads only (GradScaler::step "
                "steps an optimizer with sparse grads on the classic path: unscale in place, then step() or skip)");
    return GradKind::kSparse;
  }
  TORCH_CHECK(stage_grads || !grad_needs_staging(p, grad), name, ": param group ", g, ", param ", i,
              ": grad strides ", grad.strides(), " differ from the parameter's dense layout ",
              c10::IntArrayRef(kernel_strides(p)));
  TORCH_CHECK(p.device().is_cpu() || p.device().is_cuda(), name, ": param group ", g, ", param ", i, " is on ",
              p.device(), "; only CPU and CUDA are supported");
#if !defined(AMPFUSE_WITH_CUDA)
  TORCH_CHECK(p.device().is_cpu(), name, ": param group ", g, ", param ", i, " is on ", p.device(),
              " but ampfuse was built without CUDA");
#endif
  TORCH_CHECK(!signals || signals->contains(p.device()), name, ": param group ", g, ", param ", i, " is on ",
              p.device(), " but the scaler sent no signal for that device");
  return grad_needs_staging(p, grad) ? GradKind::kStaged : GradKind::kInPlace;
}

struct Place {
  const at::Tensor* param;
  std::size_t group, index;
};

// The byte addresses of every element of a strided tensor (its start, in
// the tensor's own order), on the CPU for a tensor on any device (from its
// data pointer and strides; no element is read), for telling whether two
// views with gaps share an element. O(numel); only for views whose extents
// meet.
at::Tensor element_addresses(const at::Tensor& t) {
  const auto opts = at::TensorOptions().dtype(at::kLong);
  at::Tensor at = at::full({}, static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(t.const_data_ptr())), opts);
  for (std::int64_t d = 0; d < t.dim(); ++d) {
    std::vector<std::int64_t> shape(static_cast<std::size_t>(t.dim()), 1);
    shape[static_cast<std::size_t>(d)] = t.size(d);
    at = at + (at::arange(t.size(d), opts) * (t.stride(d) * static_cast<std::int64_t>(t.itemsize()))).view(shape);
  }
  return at.reshape({-1});
}

// Floor and ceiling of a / b for b > 0.
std::int64_t floor_div(std::int64_t a, std::int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }
std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return -floor_div(-a, b); }

// Whether views with gaps share an element, decided from their strides and
// offsets alone where that is exact, so that the column or row blocks of a
// large matrix are not compared element by element. It is exact when the
// views have one element size, per stride at most one dimension of more
// than one element, and offsets that are whole elements apart: element x of
// view A meets element y of view B when the sum over the strides s_d of
// (i_d - j_d) s_d is B's offset minus A's. Taken from the largest stride
// down, each stride s_d must leave a residue that the smaller strides can
// reach (both views' sizes): the step counts i_d - j_d that do form an
// interval. None: the two share nothing. One: it is the only candidate, and
// the pass goes on. More (possible only where s_d does not exceed the span
// below it), or a view that overlaps itself: the answer is left to the
// element-by-element comparison (kUnknown). O(dims) per pair, for up to
// kMaxLatticeViews views.
struct LatticeVerdict {
  enum Kind { kUnknown, kDisjoint, kShared } kind = kUnknown;
  std::size_t a = 0, b = 0;  ///< kShared: two views (indices into the list) that share an element
};
constexpr std::size_t kMaxLatticeViews = 256;

LatticeVerdict compare_on_one_lattice(const std::vector<const at::Tensor*>& views) {
  if (views.size() < 2 || views.size() > kMaxLatticeViews) return {};
  const auto item = static_cast<std::int64_t>(views[0]->itemsize());
  std::vector<std::int64_t> strides;  // every stride of a dimension of more than one element, largest first
  for (const at::Tensor* t : views) {
    if (static_cast<std::int64_t>(t->itemsize()) != item ||
        !ampfuse::detail::strides_never_overlap(t->sizes(), t->strides()))
      return {};
    for (std::int64_t d = 0; d < t->dim(); ++d)
      if (t->size(d) > 1) strides.push_back(t->stride(d));
  }
  std::sort(strides.begin(), strides.end(), std::greater<>());
  strides.erase(std::unique(strides.begin(), strides.end()), strides.end());
  const std::size_t nd = strides.size();
  std::vector<std::int64_t> sizes(views.size() * nd, 1), offsets(views.size());
  const auto origin = reinterpret_cast<std::intptr_t>(views[0]->const_data_ptr());
  for (std::size_t v = 0; v < views.size(); ++v) {
    const at::Tensor& t = *views[v];
    const std::int64_t bytes = reinterpret_cast<std::intptr_t>(t.const_data_ptr()) - origin;
    if (bytes % item != 0) return {};
    offsets[v] = bytes / item;
    for (std::int64_t d = 0; d < t.dim(); ++d) {
      if (t.size(d) == 1) continue;
      const auto at = static_cast<std::size_t>(std::find(strides.begin(), strides.end(), t.stride(d)) - strides.begin());
      if (sizes[v * nd + at] != 1) return {};  // two dimensions of one stride
      sizes[v * nd + at] = t.size(d);
    }
  }
  std::vector<std::int64_t> reach_a(nd + 1), reach_b(nd + 1);  // what the strides below d reach, up and down
  bool unknown = false;
  for (std::size_t x = 0; x < views.size() && !unknown; ++x)
    for (std::size_t y = x + 1; y < views.size() && !unknown; ++y) {
      const std::int64_t* na = &sizes[x * nd];
      const std::int64_t* nb = &sizes[y * nd];
      reach_a[nd] = reach_b[nd] = 0;
      for (std::size_t d = nd; d-- > 0;) {
        reach_a[d] = reach_a[d + 1] + (na[d] - 1) * strides[d];
        reach_b[d] = reach_b[d + 1] + (nb[d] - 1) * strides[d];
      }
      // Steps k_d = i_d - j_d in [-(nb_d - 1), na_d - 1] with sum k_d s_d = r.
      std::int64_t r = offsets[y] - offsets[x];
      bool met = true;
      for (std::size_t d = 0; d < nd; ++d) {
        const std::int64_t s = strides[d], up = reach_a[d + 1], down = reach_b[d + 1];
        const std::int64_t lo = std::max(ceil_div(r - up, s), -(nb[d] - 1));
        const std::int64_t hi = std::min(floor_div(r + down, s), na[d] - 1);
        if (lo > hi) {
          met = false;  // no step count of this stride leaves a residue the rest can reach
          break;
        }
        if (lo < hi) {
          unknown = true;  // two could: this pair needs the element-by-element comparison
          break;
        }
        r -= lo * s;
      }
      if (!unknown && met && r == 0) return {LatticeVerdict::kShared, x, y};
    }
  if (unknown) return {};
  return {LatticeVerdict::kDisjoint};
}

// The bytes tensor `impl` spans from its first element to its last, [begin,
// end); {0, 0} without memory.
std::pair<std::uintptr_t, std::uintptr_t> bytes_spanned(const c10::TensorImpl& impl, const void* data) {
  if (data == nullptr || impl.numel() == 0) return {0, 0};
  std::int64_t last = 0;  // (strides are not negative)
  for (std::int64_t d = 0; d < impl.dim(); ++d) last += (impl.size(d) - 1) * impl.stride(d);
  const auto begin = reinterpret_cast<std::uintptr_t>(data);
  return {begin, begin + static_cast<std::uintptr_t>(last + 1) * impl.itemsize()};
}

}  // namespace

// Extents sorted by address, O(n log n), and where
// extents meet (a cluster), exact: a dense tensor covers its extent, so two
// dense ones overlap when their extents meet; views with gaps are compared
// element by element, their element addresses sorted once per cluster
// (interleaved views, such as the even and odd columns of one matrix, or
// the column blocks of one, do not overlap), unless their strides and
// offsets decide it (compare_on_one_lattice).
void find_shared_memory(const std::vector<const at::Tensor*>& tensors,
                        const std::function<void(std::size_t, std::size_t)>& found) {
  struct Extent {
    c10::Device device;
    std::uintptr_t begin, end;
    std::size_t place;
  };
  thread_local std::vector<Extent> kept_extents;
  std::vector<Extent>& extents = kept_extents;
  extents.clear();
  const auto shared = [&](std::size_t x, std::size_t y) { found(std::min(x, y), std::max(x, y)); };
  // An expanded tensor (a dimension of more than one element and stride 0)
  // overlaps itself, reported at once; against the others it stands for the
  // same addresses with those dimensions of one element (collapsed), so that
  // no address is built per repeated element.
  std::vector<std::pair<std::size_t, at::Tensor>> collapsed;
  for (std::size_t k = 0; k < tensors.size(); ++k) {
    const at::Tensor& p = *tensors[k];
    // (No memory to share: no element, no storage, or none allocated: meta.)
    if (!p.defined() || p.numel() == 0 || !p.has_storage() || p.const_data_ptr() == nullptr) continue;
    bool expanded = false;
    for (std::int64_t d = 0; d < p.dim(); ++d) expanded |= p.size(d) > 1 && p.stride(d) == 0;
    if (expanded) {
      shared(k, k);
      std::vector<std::int64_t> sizes = p.sizes().vec();
      for (std::int64_t d = 0; d < p.dim(); ++d)
        if (p.stride(d) == 0) sizes[static_cast<std::size_t>(d)] = 1;
      const at::NoGradGuard no_grad;  // (read for its addresses alone: no autograd view)
      collapsed.emplace_back(k, p.as_strided(sizes, p.strides()));
    }
    const auto [begin, end] = bytes_spanned(*p.unsafeGetTensorImpl(), p.const_data_ptr());
    extents.push_back({p.device(), begin, end, k});
  }
  // (kept_looked points into `collapsed`: read only while this call runs,
  // and written anew before any later call reads it.)
  thread_local std::vector<const at::Tensor*> kept_looked;
  const std::vector<const at::Tensor*>* looked = &tensors;  // what each tensor is compared as
  if (!collapsed.empty()) {
    kept_looked = tensors;
    for (const auto& [k, t] : collapsed) kept_looked[k] = &t;
    looked = &kept_looked;
  }
  const auto tensor_at = [&](std::size_t i) -> const at::Tensor& { return *(*looked)[extents[i].place]; };
  auto key = [](const Extent& e) {
    return std::make_tuple(static_cast<int>(e.device.type()), static_cast<int>(e.device.index()), e.begin, e.place);
  };
  std::sort(extents.begin(), extents.end(), [&](const Extent& a, const Extent& b) { return key(a) < key(b); });
  for (std::size_t j = 0; j < extents.size();) {
    // The cluster [j, k): extents on one device, each beginning before the furthest end so far.
    std::size_t k = j + 1;
    std::uintptr_t end = extents[j].end;
    while (k < extents.size() && extents[k].device == extents[j].device && extents[k].begin < end)
      end = std::max(end, extents[k++].end);
    // Dense against dense: their extents are their bytes.
    std::size_t furthest = extents.size();
    std::vector<std::size_t> views, dense;
    for (std::size_t i = j; i < k; ++i) {
      if (!tensor_at(i).is_non_overlapping_and_dense()) {
        views.push_back(i);
        continue;
      }
      dense.push_back(i);
      if (furthest != extents.size() && extents[i].begin < extents[furthest].end)
        shared(extents[i].place, extents[furthest].place);
      if (furthest == extents.size() || extents[i].end > extents[furthest].end) furthest = i;
    }
    // A view alone in its extent: only whether it overlaps itself, which its
    // strides tell where they show no overlap.
    if (views.size() == 1 && k - j == 1 &&
        ampfuse::detail::strides_never_overlap(tensor_at(j).sizes(), tensor_at(j).strides()))
      views.clear();
    if (dense.empty() && views.size() > 1) {
      // Views on one lattice (the column blocks of one matrix): by their strides.
      std::vector<const at::Tensor*> lattice;
      for (const std::size_t i : views) lattice.push_back(&tensor_at(i));
      const LatticeVerdict verdict = compare_on_one_lattice(lattice);
      if (verdict.kind == LatticeVerdict::kShared) shared(extents[views[verdict.a]].place, extents[views[verdict.b]].place);
      if (verdict.kind == LatticeVerdict::kDisjoint) views.clear();
    }
    if (!views.empty()) {
      // Every element of the cluster's views, by address: an element that
      // ends past the next one's start shares memory with it.
      std::vector<at::Tensor> addresses, owners;
      for (const std::size_t i : views) {
        addresses.push_back(element_addresses(tensor_at(i)));
        owners.push_back(at::full({addresses.back().numel()}, static_cast<std::int64_t>(i), at::kLong));
      }
      const auto [unsorted_order, order] = at::sort(at::cat(addresses));
      const at::Tensor sorted = unsorted_order.contiguous();
      const at::Tensor owner = at::cat(owners).index_select(0, order).contiguous();
      const std::int64_t* a = sorted.const_data_ptr<std::int64_t>();
      const std::int64_t* o = owner.const_data_ptr<std::int64_t>();
      const std::int64_t n = sorted.numel();
      const auto size_of = [&](std::int64_t e) {
        return static_cast<std::int64_t>(tensor_at(static_cast<std::size_t>(o[e])).itemsize());
      };
      std::int64_t widest = 1;  // the views' largest element, in bytes
      for (const std::size_t i : views)
        widest = std::max(widest, static_cast<std::int64_t>(tensor_at(i).itemsize()));
      for (std::int64_t e = 0; e + 1 < n; ++e)
        if (a[e + 1] < a[e] + size_of(e))
          shared(extents[static_cast<std::size_t>(o[e])].place, extents[static_cast<std::size_t>(o[e + 1])].place);
      // Views against dense parameters: any view element within a dense extent.
      for (const std::size_t i : dense) {
        const auto lo = static_cast<std::int64_t>(extents[i].begin), hi = static_cast<std::int64_t>(extents[i].end);
        // The first element starting at or past lo - widest (no element is wider), then those before hi.
        std::int64_t e = std::lower_bound(a, a + n, lo - widest) - a;
        for (; e < n && a[e] < hi; ++e)
          if (a[e] + size_of(e) > lo) shared(extents[i].place, extents[static_cast<std::size_t>(o[e])].place);
      }
    }
    j = k;
  }
}



void check_signals(const StepSignals& signals, const char* name) {
  for (const auto& [device, signal] : signals.all()) check_signal(signal, device, name);
}

std::vector<Entry> validate_params(torch::optim::Optimizer& opt, const char* name, const StepSignals* signals,
                                   const CheckState& check_state, bool float64, std::deque<StagedGrad>* staged,
                                   std::vector<Entry>* sparse, std::deque<StagedParam>* staged_params,
                                   bool runs_in_place) {
  if (signals) check_signals(*signals, name);
  auto& groups = opt.param_groups();
  // Kept per thread between steps (no allocation); a plain reference for the
  // worker threads below (a thread_local named in the lambda would be theirs).
  thread_local std::vector<Place> kept_places;
  std::vector<Place>& places = kept_places;
  places.clear();
  for (std::size_t g = 0; g < groups.size(); ++g)
    for (std::size_t i = 0; i < groups[g].params().size(); ++i) places.push_back({&groups[g].params()[i], g, i});
  const auto n = static_cast<std::int64_t>(places.size());

  // One group per parameter: a pass over TensorImpl addresses, reading no object.
  thread_local ImplSet seen;
  seen.reset(places.size());
  std::int64_t first_duplicate = n;
  for (std::int64_t k = 0; k < n && first_duplicate == n; ++k)
    if (places[k].param->defined() && !seen.insert(places[k].param->unsafeGetTensorImpl())) first_duplicate = k;

  // The per-parameter checks read scattered heap objects (TensorImpls,
  // autograd metadata, state), mostly cache misses after a kernel streamed
  // the parameters through: they run on ATen's threads, each over a
  // contiguous range, and the error reported is the one of the first
  // failing parameter in order, as a sequential pass would report it.
  std::mutex mutex;
  std::vector<std::pair<std::int64_t, std::vector<Entry>>> parts, sparse_parts;
  std::atomic<bool> any_staged{false}, any_copy_on_write{false};
  std::int64_t first_error = n;
  std::exception_ptr error;
  const bool inference_mode = c10::InferenceMode::is_enabled();  // thread-local: read here, not on ATen's threads
  at::parallel_for(0, n, kEntriesGrain, [&](std::int64_t begin, std::int64_t end) {
    std::vector<Entry> local, local_sparse;
    local.reserve(static_cast<std::size_t>(end - begin));
    for (std::int64_t k = begin; k < end && k < first_duplicate; ++k) {
      const Place& place = places[k];
      const at::Tensor& p = *place.param;
      try {
        const GradKind kind =
            check_param(p, place.group, place.index, name, signals, float64, staged != nullptr, sparse != nullptr,
                        staged_params != nullptr, inference_mode);
        if (kind == GradKind::kNone) continue;
        if (kind == GradKind::kStaged || (kind != GradKind::kSparse && param_needs_staging(p)))
          any_staged.store(true, std::memory_order_relaxed);
        if (copy_on_write(p.unsafeGetTensorImpl())) any_copy_on_write.store(true, std::memory_order_relaxed);
        torch::optim::OptimizerParamState* state = check_state(p, place.group, place.index);
        (kind == GradKind::kSparse ? local_sparse : local)
            .push_back({place.group, place.index, p, p.grad(), p.device(), p.scalar_type(), state});
      } catch (...) {
        const std::lock_guard<std::mutex> lock(mutex);
        if (k < first_error) {
          first_error = k;
          error = std::current_exception();
        }
        break;
      }
    }
    const std::lock_guard<std::mutex> lock(mutex);
    parts.emplace_back(begin, std::move(local));
    if (!local_sparse.empty()) sparse_parts.emplace_back(begin, std::move(local_sparse));
  });
  if (first_duplicate < first_error) {
    const Place& dup = places[first_duplicate];
    const Place& first = *std::find_if(places.begin(), places.end(), [&](const Place& q) {
      return q.param->unsafeGetTensorImpl() == dup.param->unsafeGetTensorImpl();
    });
    TORCH_CHECK(false, name, ": param group ", dup.group, ", param ", dup.index, " is also param ", first.index,
                " of group ", first.group,
                first.group == dup.group ? "; a parameter is listed once (twice, a step would update it twice)"
                                         : "; a parameter may belong to one group only");
  }
  if (error) std::rethrow_exception(error);
  // A parameter the step writes whose storage is copy-on-write gets its own
  // copy here, on the calling thread, as an in-place op would make it: the
  // tensor it shares its storage with keeps its values, and ATen forbids
  // the copy on the threads that fill the kernels' pointer arrays.
  if (any_copy_on_write.load())
    for (const auto& part : parts)
      for (const Entry& e : part.second)
        if (copy_on_write(e.param.unsafeGetTensorImpl()))
          c10::impl::cow::materialize_cow_storage(*e.param.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl());
  // Parameters whose memory overlaps (views of one tensor, or tensors made
  // over one buffer) would be written by two threads or blocks of a step at
  // once, and twice per step; a parameter whose elements share memory
  // (as_strided, unfold windows) would have elements written twice. Only
  // when a step validates from scratch (a reused step plan compares the
  // parameters' data addresses instead).
  thread_local std::vector<const at::Tensor*> kept_tensors;
  std::vector<const at::Tensor*>& tensors = kept_tensors;
  tensors.clear();
  for (const Place& place : places) tensors.push_back(place.param);
  find_shared_memory(tensors, [&](std::size_t x, std::size_t y) {
    const Place& a = places[x];
    const Place& b = places[y];
    if (x == y)
      TORCH_CHECK(false, name, ": param group ", a.group, ", param ", a.index, " overlaps itself (strides ",
                  a.param->strides(), "): a step would write one element several times");
    TORCH_CHECK(false, name, ": param group ", b.group, ", param ", b.index, " shares memory with param group ", a.group,
                ", param ", a.index,
                " (overlapping views of one tensor): a step would write both at once; give the optimizer tensors "
                "that do not overlap");
  });
  const auto by_begin = [](const auto& a, const auto& b) { return a.first < b.first; };
  if (sparse) {
    sparse->clear();
    std::sort(sparse_parts.begin(), sparse_parts.end(), by_begin);
    for (const auto& part : sparse_parts)
      for (const Entry& e : part.second) sparse->push_back(e);
  }
  std::sort(parts.begin(), parts.end(), by_begin);
  if (parts.size() == 1 && !any_staged.load()) return std::move(parts.front().second);
  std::vector<Entry> entries;
  entries.reserve(places.size());
  std::vector<PlanRun> runs;
  for (const auto& part : parts)
    for (const Entry& e : part.second) {  // Entry holds references: not assignable
      const bool stage_grad = grad_needs_staging(e.param, e.grad);
      // A parameter with gaps between long runs, for kernels that walk it in place: not staged.
      runs.clear();
      const bool stage_param = param_needs_staging(e.param) && !(runs_in_place && runs_of_param(e.param, 0, &runs));
      if (!stage_grad && !stage_param) {
        entries.push_back(e);
        continue;
      }
      // Allocated here, not on the checking threads; filled by
      // refresh_staged_grads and refresh_staged_params.
      const at::Tensor* grad = &e.grad;
      if (stage_grad) {
        staged->push_back({&e.param, at::empty_like(e.param, at::MemoryFormat::Preserve)});
        grad = &staged->back().buffer;
      }
      const at::Tensor* param = &e.param;
      const at::Tensor* owner = nullptr;
      if (stage_param) {
        at::Tensor alias = at::empty({0}, e.param.options());
        alias.set_(e.param.storage(), e.param.storage_offset(), e.param.sizes(), e.param.strides());
        if (e.param.is_neg()) alias = alias._neg_view();  // written back negated, as the parameter reads it
        staged_params->push_back({&e.param, at::empty_like(e.param, at::MemoryFormat::Preserve), std::move(alias)});
        param = &staged_params->back().buffer;
        owner = &e.param;
      }
      entries.push_back({e.group, e.index, *param, *grad, e.device, e.dtype, e.state, owner});
    }
  return entries;
}

namespace {

std::string joined(const std::vector<std::string>& keys) {
  std::string out;
  for (const std::string& k : keys) out += (out.empty() ? "" : ", ") + k;
  return out.empty() ? "none" : out;
}

// A checkpoint's key of a parameter (the address of its TensorImpl when
// saved, in decimal), strictly: std::stoull would take "12abc" and throw
// std::invalid_argument on "abc".
bool parse_key(const std::string& text, std::uint64_t& key) {
  if (text.empty() || text.size() > 20) return false;
  std::uint64_t value = 0;
  for (const char c : text) {
    if (c < '0' || c > '9') return false;
    const auto digit = static_cast<std::uint64_t>(c - '0');
    if (value > (~std::uint64_t{0} - digit) / 10) return false;
    value = value * 10 + digit;
  }
  key = value;
  return true;
}

// A count LibTorch writes as a one-element integer tensor.
std::int64_t read_count(torch::serialize::InputArchive& archive, const std::string& key, const char* name,
                        const std::string& where) {
  at::Tensor t;
  TORCH_CHECK(archive.try_read(key, t), name, ": ", where, "the checkpoint has no ", key,
              " (not an optimizer's checkpoint, or a damaged one?)");
  TORCH_CHECK(t.defined() && t.numel() == 1 && c10::isIntegralType(t.scalar_type(), /*includeBool=*/false), name,
              ": ", where, "the checkpoint's ", key, " is not an integer (a damaged checkpoint?)");
  const std::int64_t n = t.item<std::int64_t>();
  TORCH_CHECK(n >= 0, name, ": ", where, "the checkpoint's ", key, " is ", n, " (a damaged checkpoint?)");
  return n;
}

// A tensor of a checkpoint, checked against its storage before anything
// reads it: LibTorch's archive reader sets the sizes, strides and storage
// offset the file gives without checking them against the storage it read,
// so a damaged file would make the first read of the tensor (a count's
// item(), a state's copy) read past the storage's end. `where` starts the
// message (a group and parameter, or nothing); `path` names the key. Other
// layouts than strided and sparse COO (whose parts are strided) have no
// storage of their own to check, nor do sub-byte quantized dtypes (two or
// four elements a byte): no state holds them, and check_state refuses them
// in a state.
void check_saved_tensor(const at::Tensor& t, const char* name, const std::string& where, const std::string& path) {
  if (!t.defined()) return;
  if (t.layout() == c10::kSparse) {
    check_saved_tensor(t._indices(), name, where, path + " (indices)");
    check_saved_tensor(t._values(), name, where, path + " (values)");
    return;
  }
  if (t.layout() != c10::kStrided || t.scalar_type() == at::kQUInt4x2 || t.scalar_type() == at::kQUInt2x4) return;
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  const c10::Storage& storage = impl->unsafe_storage();
  TORCH_CHECK(fits_storage(impl->sizes(), impl->strides(), impl->storage_offset(),
                           static_cast<std::int64_t>(impl->itemsize()), storage ? storage.nbytes() : 0),
              name, ": ", where, "the checkpoint's tensor '", path, "' (sizes ", impl->sizes(), ", strides ",
              impl->strides(), ", storage offset ", impl->storage_offset(), ", ", impl->itemsize(),
              " bytes an element) reaches outside its storage of ", storage ? storage.nbytes() : 0,
              " bytes (a damaged checkpoint?)");
}

// How deep the walk of a checkpoint goes, in nested archives and in the
// containers of one value (a damaged file's pickle could make a list that
// holds itself).
constexpr int kMaxSavedDepth = 32;

// The tensors in a value: containers and objects are walked to a bounded depth.
void check_saved_value(const c10::IValue& v, const char* name, const std::string& where, const std::string& path,
                       int depth) {
  TORCH_CHECK(depth < kMaxSavedDepth, name, ": ", where, "the checkpoint's value '", path, "' nests deeper than ",
              kMaxSavedDepth, " levels (a damaged checkpoint?)");
  const auto each = [&](const c10::IValue& x) { check_saved_value(x, name, where, path, depth + 1); };
  if (v.isTensor()) {
    check_saved_tensor(v.toTensor(), name, where, path);
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList().vec()) check_saved_tensor(t, name, where, path);
  } else if (v.isList()) {
    for (const c10::IValue& x : v.toListRef()) each(x);
  } else if (v.isTuple()) {
    for (const c10::IValue& x : v.toTupleRef().elements()) each(x);
  } else if (v.isGenericDict()) {
    for (const auto& entry : v.toGenericDict()) {
      each(entry.key());
      each(entry.value());
    }
  } else if (v.isObject()) {
    const auto object = v.toObject();
    for (std::size_t k = 0; k < object->slots().size(); ++k) each(object->getSlot(k));
  }
}

void check_saved_tensors(torch::serialize::InputArchive& archive, const char* name, const std::string& where,
                         const std::string& prefix, const char* skip, int depth) {
  for (const std::string& key : archive.keys()) {
    if (skip && key == skip) continue;
    c10::IValue value;
    archive.read(key, value);
    torch::serialize::InputArchive nested;
    if (value.isModule() && archive.try_read(key, nested)) {
      TORCH_CHECK(depth < kMaxSavedDepth, name, ": ", where, "the checkpoint's archive '", prefix + key,
                  "' nests deeper than ", kMaxSavedDepth, " levels (a damaged checkpoint?)");
      check_saved_tensors(nested, name, where, prefix + key + "/", nullptr, depth + 1);
    } else {
      check_saved_value(value, name, where, prefix + key, 0);
    }
  }
}

}  // namespace

void check_saved_tensors(torch::serialize::InputArchive& archive, const char* name) {
  check_saved_tensors(archive, name, "", "", nullptr, 0);
}

bool fits_storage(c10::IntArrayRef sizes, c10::IntArrayRef strides, std::int64_t storage_offset,
                  std::int64_t itemsize, std::size_t nbytes) {
  if (sizes.size() != strides.size() || itemsize <= 0 || storage_offset < 0) return false;
  for (const std::int64_t n : sizes)
    if (n < 0) return false;
  for (const std::int64_t n : sizes)
    if (n == 0) return true;  // no element: nothing is read
  // Each dimension's reach is below 2^126 (a size and a stride below 2^63)
  // and is refused past 2^64; one past 2^64 bytes is out of any storage:
  // low and high stay within 64 * 2^64 + 2^63, and the product is taken
  // only below 2^64 * 2^63.
  const __int128 limit = static_cast<__int128>(1) << 64;
  __int128 low = storage_offset, high = storage_offset;
  for (std::size_t d = 0; d < sizes.size(); ++d) {
    const __int128 reach = static_cast<__int128>(sizes[d] - 1) * strides[d];
    if (reach > limit || reach < -limit) return false;
    (reach > 0 ? high : low) += reach;
  }
  return low >= 0 && high < limit && (high + 1) * itemsize <= static_cast<__int128>(nbytes);
}

at::Tensor master_following(const at::Tensor& master, const at::Tensor& param) {
  if (!master.defined() || master.sizes() != param.sizes() || master.device() != param.device()) return master;
  const at::Tensor rounded = master.to(param.scalar_type());
  if (at::equal(rounded, param)) return master;
  at::Tensor fresh = at::empty_like(master);  // its layout (check_state took it)
  fresh.copy_(at::where(rounded == param, master, param.to(at::kFloat)));
  return fresh;
}

void lay_out_saved_state(torch::serialize::InputArchive& archive, const at::Tensor& p) {
  std::vector<std::pair<std::string, c10::IValue>> fields;
  bool changed = false;
  for (const std::string& key : archive.keys()) {
    c10::IValue v;
    // A nested archive (no LibTorch state has one) is left as it is, and the state with it.
    if (!archive.try_read(key, v) || v.isObject() || v.isModule()) return;
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (t.defined() && t.layout() == at::kStrided && at::isFloatingType(t.scalar_type()) &&
          t.sizes() == p.sizes() && t.device() == p.device() && !in_kernel_layout(t, p)) {
        v = at::empty_strided(p.sizes(), kernel_strides(p), t.options()).copy_(t);
        changed = true;
      }
    }
    fields.emplace_back(key, std::move(v));
  }
  if (!changed) return;
  // An InputArchive is read-only: the state's fields go through a new one.
  torch::serialize::OutputArchive out;
  for (const auto& [key, v] : fields) out.write(key, v);
  archive = read_back(out);
}

void check_saved_state_memory(std::vector<CheckpointLayout::SavedState>& states, const std::vector<StateField>& held,
                              const char* name) {
  // Every strided tensor each state's archive holds (a sparse one's parts),
  // then those the states hold that no archive does (read from elsewhere
  // by load_extra), with where each was read.
  struct Where {
    std::size_t group, index;
    std::string key;
  };
  std::vector<at::Tensor> tensors;
  std::vector<Where> places;
  const auto add = [&](const at::Tensor& t, std::size_t g, std::size_t i, const std::string& key) {
    if (!t.defined() || t.layout() != c10::kStrided || t.numel() == 0 || c10::isQIntType(t.scalar_type())) return;
    // A stride of a dimension of one element moves nothing: set to 1, the
    // view reaches the same bytes. One below 0 elsewhere no state has.
    std::vector<std::int64_t> strides(t.strides().begin(), t.strides().end());
    for (std::size_t d = 0; d < strides.size(); ++d) {
      if (t.size(static_cast<std::int64_t>(d)) == 1) strides[d] = 1;
      TORCH_CHECK(strides[d] >= 0, name, ": param group ", g, ", param ", i, ": the checkpoint's state ", key,
                  " has strides ", t.strides(), " (a negative stride: a damaged checkpoint?)");
    }
    tensors.push_back(strides == t.strides() ? t : t.as_strided(t.sizes(), strides, t.storage_offset()));
    places.push_back({g, i, key});
  };
  // Each tensor a state's keys read, once per key (a file that names one
  // tensor under two keys reads as one TensorImpl): what `held` matches.
  std::multiset<std::tuple<std::size_t, std::size_t, const c10::TensorImpl*>> read;
  for (CheckpointLayout::SavedState& s : states)
    for (const std::string& key : s.archive.keys()) {
      c10::IValue v;
      if (!s.archive.try_read(key, v) || !v.isTensor()) continue;
      const at::Tensor& t = v.toTensor();
      read.emplace(s.group, s.index, t.unsafeGetTensorImpl());
      if (t.defined() && t.layout() == c10::kSparse) {
        add(t._indices(), s.group, s.index, key + " (indices)");
        add(t._values(), s.group, s.index, key + " (values)");
      } else {
        add(t, s.group, s.index, key);
      }
    }
  for (const StateField& f : held) {
    const auto it = read.find({f.group, f.index, f.tensor->unsafeGetTensorImpl()});
    if (it != read.end()) {
      read.erase(it);  // one of its keys
      continue;
    }
    add(*f.tensor, f.group, f.index, "(a tensor read from beside the state: an earlier format's key)");
  }
  std::vector<const at::Tensor*> pointers;
  pointers.reserve(tensors.size());
  for (const at::Tensor& t : tensors) pointers.push_back(&t);
  find_shared_memory(pointers, [&](std::size_t x, std::size_t y) {
    if (x == y) return;  // a tensor overlapping itself: check_state's
    const Where& a = places[x];
    const Where& b = places[y];
    TORCH_CHECK(false, name, ": param group ", b.group, ", param ", b.index, ": the checkpoint's state ", b.key,
                " shares memory with state ", a.key, " of param group ", a.group, ", param ", a.index,
                " (the file puts both in one storage: a damaged or hand-made checkpoint?); each state tensor "
                "needs memory of its own, and the load changes nothing");
  });
}

CheckpointLayout read_checkpoint_layout(torch::serialize::InputArchive& archive, const char* name,
                                        const std::vector<std::size_t>& group_sizes) {
  c10::IValue version;
  if (!archive.try_read("pytorch_version", version)) {
    c10::IValue probe;
    TORCH_CHECK(!archive.try_read("scale", probe) && !archive.try_read("_growth_tracker", probe), name,
                ": the checkpoint holds a GradScaler's state, not an optimizer's");
    TORCH_CHECK(false, name,
                ": the checkpoint has no pytorch_version: it is not an optimizer's, or predates LibTorch 1.5's "
                "optimizer format (then load it into the LibTorch optimizer and save it again); its keys: ",
                joined(archive.keys()));
  }
  TORCH_CHECK(version.isString() && version.toStringRef() == "1.5.0", name,
              ": the checkpoint's pytorch_version is not \"1.5.0\", LibTorch's optimizer format");
  check_saved_tensors(archive, name, "", "", "state", 0);  // the states: below, with their parameters
  torch::serialize::InputArchive states, groups;
  TORCH_CHECK(archive.try_read("state", states) && archive.try_read("param_groups", groups), name,
              ": the checkpoint has no state or no param_groups (a damaged checkpoint?)");
  const std::int64_t num_groups = read_count(groups, "param_groups/size", name, "");
  TORCH_CHECK(static_cast<std::size_t>(num_groups) == group_sizes.size(), name, ": the checkpoint has ", num_groups,
              " param groups but the optimizer has ", group_sizes.size());
  CheckpointLayout layout;
  std::map<std::uint64_t, std::pair<std::size_t, std::size_t>> owner;  // key -> (group, index)
  for (std::size_t g = 0; g < group_sizes.size(); ++g) {
    const std::string where = "param group " + std::to_string(g) + ": ";
    torch::serialize::InputArchive group;
    TORCH_CHECK(groups.try_read("param_groups/" + std::to_string(g), group), name, ": ", where,
                "the checkpoint does not hold it (a damaged checkpoint?)");
    const std::int64_t size = read_count(group, "params/size", name, where);
    TORCH_CHECK(static_cast<std::size_t>(size) == group_sizes[g], name, ": ", where, "the checkpoint has ", size,
                " params but the optimizer's group has ", group_sizes[g]);
    for (std::size_t i = 0; i < group_sizes[g]; ++i) {
      c10::IValue text;
      std::uint64_t key = 0;
      TORCH_CHECK(group.try_read("params/" + std::to_string(i), text) && text.isString() &&
                      parse_key(text.toStringRef(), key),
                  name, ": param group ", g, ", param ", i,
                  ": the checkpoint has no key for it, or one that is not a number (a damaged checkpoint?)");
      const auto [it, inserted] = owner.emplace(key, std::make_pair(g, i));
      TORCH_CHECK(inserted, name, ": param group ", g, ", param ", i, " has the same key in the checkpoint as param group ",
                  it->second.first, ", param ", it->second.second, " (a damaged checkpoint?)");
    }
    torch::serialize::InputArchive options;
    TORCH_CHECK(group.try_read("options", options), name, ": ", where,
                "the checkpoint has no options (a damaged checkpoint?)");
    layout.options.push_back(std::move(options));
  }
  for (const std::string& text : states.keys()) {
    std::uint64_t key = 0;
    TORCH_CHECK(parse_key(text, key), name, ": the checkpoint has a state under the key '", text,
                "', which is not a number (a damaged checkpoint?)");
    const auto it = owner.find(key);
    TORCH_CHECK(it != owner.end(), name, ": the checkpoint has a state under the key ", text,
                " that none of its param groups names (a damaged checkpoint?)");
    const auto [g, i] = it->second;
    torch::serialize::InputArchive one;
    TORCH_CHECK(states.try_read(text, one), name, ": param group ", g, ", param ", i,
                ": the checkpoint's state is not an archive (a damaged checkpoint?)");
    check_saved_tensors(one, name, "param group " + std::to_string(g) + ", param " + std::to_string(i) + ": ",
                        "state/" + text + "/", nullptr, 0);
    layout.states.push_back({g, i, std::move(one)});
  }
  std::sort(layout.states.begin(), layout.states.end(), [](const auto& a, const auto& b) {
    return std::tie(a.group, a.index) < std::tie(b.group, b.index);
  });
  return layout;
}

void read_checkpoint_part(torch::serialize::InputArchive& archive, const char* name, std::size_t group,
                          std::size_t index, const char* what, const std::function<void()>& read) {
  std::string reason;
  try {
    read();
    return;
  } catch (const c10::Error& e) {
    // LibTorch's readers report a missing key as an internal assert ("please
    // report a bug to PyTorch"), which would mislead: that one is left out.
    const std::string message = e.what_without_backtrace();
    if (message.find("INTERNAL ASSERT") == std::string::npos) reason = ": " + message.substr(0, message.find('\n'));
  } catch (const std::exception& e) {
    reason = std::string(": ") + e.what();
  }
  const std::string place = index == kNoIndex ? "" : ", param " + std::to_string(index);
  TORCH_CHECK(false, name, ": param group ", group, place, ": the checkpoint's ", what, " could not be read as ", name,
              "'s: a key it needs is missing or holds a value of another type (a checkpoint of another optimizer, or "
              "a damaged one?); its keys: ",
              joined(archive.keys()), reason);
}

namespace {

// A NaN option read from a checkpoint (`x == x` is false only for NaN).
// LibTorch's constructors refuse NaN in their defaults; its groups are not
// checked, so other values a constructor would refuse (a negative lr, nesterov
// with dampening) can be stepped and saved, and load as LibTorch loads them.
void check_not_nan(double value, const char* name, std::size_t group, const char* what) {
  TORCH_CHECK(value == value, name, ": param group ", group, " of the checkpoint: ", what,
              " is nan (a damaged checkpoint? a step with a NaN lr, eps, beta, weight decay or momentum makes "
              "parameters NaN)");
}
template <class O>
void check_adam_options(const O& o, const char* name, std::size_t group) {
  check_not_nan(o.lr(), name, group, "lr");
  check_not_nan(o.eps(), name, group, "eps");
  check_not_nan(std::get<0>(o.betas()), name, group, "betas[0]");
  check_not_nan(std::get<1>(o.betas()), name, group, "betas[1]");
  check_not_nan(o.weight_decay(), name, group, "weight_decay");
}

}  // namespace

void check_loaded_options(const torch::optim::AdamOptions& o, const char* name, std::size_t group) {
  check_adam_options(o, name, group);
}
void check_loaded_options(const torch::optim::AdamWOptions& o, const char* name, std::size_t group) {
  check_adam_options(o, name, group);
}
void check_loaded_options(const torch::optim::SGDOptions& o, const char* name, std::size_t group) {
  check_not_nan(o.lr(), name, group, "lr");
  check_not_nan(o.momentum(), name, group, "momentum");
  check_not_nan(o.dampening(), name, group, "dampening");
  check_not_nan(o.weight_decay(), name, group, "weight_decay");
}
void check_loaded_options(const torch::optim::AdagradOptions& o, const char* name, std::size_t group) {
  check_not_nan(o.lr(), name, group, "lr");
  check_not_nan(o.lr_decay(), name, group, "lr_decay");
  check_not_nan(o.weight_decay(), name, group, "weight_decay");
  check_not_nan(o.initial_accumulator_value(), name, group, "initial_accumulator_value");
  check_not_nan(o.eps(), name, group, "eps");
}
void check_loaded_options(const torch::optim::RMSpropOptions& o, const char* name, std::size_t group) {
  check_not_nan(o.lr(), name, group, "lr");
  check_not_nan(o.alpha(), name, group, "alpha");
  check_not_nan(o.eps(), name, group, "eps");
  check_not_nan(o.weight_decay(), name, group, "weight_decay");
  check_not_nan(o.momentum(), name, group, "momentum");
}

torch::serialize::InputArchive read_back(torch::serialize::OutputArchive& archive) {
  std::stringstream bytes;
  archive.save_to(bytes);
  torch::serialize::InputArchive in;
  in.load_from(bytes);
  return in;
}

std::vector<std::pair<std::string, c10::IValue>> saved_fields(const torch::optim::OptimizerOptions& options) {
  torch::serialize::OutputArchive out;
  options.serialize(out);
  torch::serialize::InputArchive in = read_back(out);
  std::vector<std::pair<std::string, c10::IValue>> fields;
  for (const std::string& key : in.keys()) {
    c10::IValue v;
    in.read(key, v);
    fields.emplace_back(key, std::move(v));
  }
  return fields;
}

void check_saved_option_keys(torch::serialize::InputArchive& archive, const torch::optim::OptimizerOptions& read,
                             const char* name, std::size_t group) {
  // The keys the options write, read back from an archive of their own:
  // options hold a few numbers, so the round trip costs little.
  std::vector<std::string> known;
  for (auto& [key, value] : saved_fields(read)) known.push_back(key);
  for (const std::string& key : archive.keys())
    TORCH_CHECK(std::find(known.begin(), known.end(), key) != known.end(), name, ": param group ", group,
                ": the checkpoint's options have the key '", key, "', which ", name,
                "'s options do not have (a checkpoint of another optimizer, or of a later version?); they have ",
                joined(known));
}

void check_saved_state_keys(torch::serialize::InputArchive& archive, const std::vector<std::string>& known,
                            const char* name, std::size_t group, std::size_t index) {
  for (const std::string& key : archive.keys())
    TORCH_CHECK(std::find(known.begin(), known.end(), key) != known.end(), name, ": param group ", group, ", param ",
                index, ": the checkpoint's state has the key '", key, "', which ", name,
                " does not keep (a checkpoint of another optimizer, or of a later version?); it keeps ", joined(known));
}

namespace {

// One parameter as a plan records it. Reads the TensorImpl, its storage,
// the autograd metadata and the state map: a few cache misses, no checks.
PlanParam plan_param(const at::Tensor& p, const torch::optim::Optimizer& opt, const StateStamp& stamp) {
  PlanParam k;
  if (!p.defined()) return k;
  const c10::TensorImpl* impl = p.unsafeGetTensorImpl();
  k.param = impl;
  k.numel = impl->numel();
  k.dtype = p.scalar_type();
  k.param_data = data_address(impl);
  k.param_storage = impl->unsafe_storage().unsafeGetStorageImpl();
  k.autograd_meta = impl->autograd_meta();
  k.grad_slot = &impl->grad();
  if (!impl->is_non_overlapping_and_dense()) {
    // A staged parameter's copy and write-back follow its sizes and strides:
    // a view re-pointed in place to another layout must be prepared again.
    std::size_t h = 1;
    for (const auto v : {impl->sizes(), impl->strides()})
      for (const std::int64_t x : v) h = h * 0x9E3779B97F4A7C15ull + static_cast<std::size_t>(x);
    k.layout = h;
  }
  // A grad's TensorImpl alone could match a freed one's (a new grad
  // allocated where the last one was): its data address is compared too.
  const at::Tensor& g = p.grad();
  if (g.defined()) {
    k.grad = g.unsafeGetTensorImpl();
    k.grad_data = data_address(k.grad);
    k.grad_storage = k.grad->unsafe_storage().unsafeGetStorageImpl();
    k.grad_numel = k.grad->numel();
    k.grad_dtype = g.scalar_type();
  }
  const auto& states = opt.state();
  const auto it = states.find(const_cast<c10::TensorImpl*>(impl));
  if (it != states.end()) {
    k.state_entry = &*it;
    k.state = it->second.get();
    if (k.state != nullptr) k.stamp = stamp(*it->second);  // (null: validation refuses it)
  }
  return k;
}

std::vector<const at::Tensor*> all_params(torch::optim::Optimizer& opt) {
  std::vector<const at::Tensor*> out;
  for (const auto& group : opt.param_groups())
    for (const at::Tensor& p : group.params()) out.push_back(&p);
  return out;
}

}  // namespace

static_assert(std::is_same_v<decltype(PlanKeys::groups), GroupSpans>, "a plan keeps its groups as GroupSpans");

namespace {

// Whether [begin, end) meets the bytes of a state tensor the plan recorded.
bool meets_state(const PlanKeys& keys, std::pair<std::uintptr_t, std::uintptr_t> bytes) {
  if (bytes.first == bytes.second) return false;
  const auto after = std::lower_bound(keys.state_bytes.begin(), keys.state_bytes.end(),
                                      std::make_pair(bytes.second, std::uintptr_t{0}));
  const auto k = static_cast<std::size_t>(after - keys.state_bytes.begin());
  return k > 0 && keys.state_furthest_end[k - 1] > bytes.first;
}

}  // namespace

void record_plan(torch::optim::Optimizer& opt, const StateStamp& stamp, PlanKeys& keys,
                 const std::vector<const at::Tensor*>& state_tensors) {
  keys.groups = group_spans(opt);
  const std::vector<const at::Tensor*> params = all_params(opt);
  keys.params.resize(params.size());
  std::atomic<bool> any_inference{false};
  parallel_entries(params.size(), [&](std::size_t k) {
    keys.params[k] = plan_param(*params[k], opt, stamp);
    const at::Tensor& grad = params[k]->grad();
    keys.params[k].grad_sparse = grad.defined() && grad.is_sparse();
    keys.params[k].grad_staged = !keys.params[k].grad_sparse && grad_needs_staging(*params[k], grad);
    if (params[k]->defined() && params[k]->is_inference()) any_inference.store(true, std::memory_order_relaxed);
  });
  keys.any_inference = any_inference.load();
  keys.state_bytes.clear();
  for (const at::Tensor* t : state_tensors)
    if (t->defined() && t->layout() == c10::kStrided && t->has_storage()) {
      const auto bytes = bytes_spanned(*t->unsafeGetTensorImpl(), t->const_data_ptr());
      if (bytes.first != bytes.second) keys.state_bytes.push_back(bytes);
    }
  std::sort(keys.state_bytes.begin(), keys.state_bytes.end());
  keys.state_furthest_end.resize(keys.state_bytes.size());
  std::uintptr_t furthest = 0;
  for (std::size_t k = 0; k < keys.state_bytes.size(); ++k)
    keys.state_furthest_end[k] = furthest = std::max(furthest, keys.state_bytes[k].second);
}

namespace {

// dst.copy_(src) with both seen in dst's memory order, so that dst is
// contiguous where it is dense: ATen then copies a transposed src into it
// by blocks (its transpose path wants a contiguous destination), where
// writing a transposed dst element by element took 5x as long.
void copy_into_dense(const at::Tensor& dst, const at::Tensor& src) {
  if (ampfuse::detail::copy_by_runs(dst, src)) return;  // a slice of wide rows: a memcpy per row
  if (dst.dim() < 2 || dst.is_contiguous() || !dst.is_non_overlapping_and_dense() || src.sizes() != dst.sizes() ||
      src._is_zerotensor()) {
    dst.copy_(src);
    return;
  }
  std::vector<std::int64_t> order(static_cast<std::size_t>(dst.dim()));
  for (std::size_t d = 0; d < order.size(); ++d) order[d] = static_cast<std::int64_t>(d);
  std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) { return dst.stride(a) > dst.stride(b); });
  dst.permute(order).copy_(src.permute(order));
}

}  // namespace

bool runs_of_param(const at::Tensor& p, std::int64_t tensor, std::vector<PlanRun>* runs) {
  return ampfuse::detail::runs_of_param(p, tensor, runs);
}

std::shared_ptr<const Plan> list_plan(const std::vector<const Entry*>& entries, const std::vector<std::int64_t>& numels,
                                      int param_list) {
  TORCH_INTERNAL_ASSERT(entries.size() == numels.size(), "list_plan: ", entries.size(), " entries, ", numels.size(),
                        " numels");
  const auto gapped = [&](std::size_t i) { return numels[i] > 0 && !entries[i]->param.is_non_overlapping_and_dense(); };
  std::size_t i = 0;
  while (i < entries.size() && !gapped(i)) ++i;
  if (i == entries.size()) return std::make_shared<const Plan>(numels, cpu::kChunkSize);
  TORCH_INTERNAL_ASSERT(param_list == 0, "list_plan: a parameter with gaps is walked as the executor's list 0, not ",
                        param_list);
  std::vector<PlanRun> runs;
  runs.reserve(entries.size());
  for (i = 0; i < entries.size(); ++i) {
    if (numels[i] == 0) continue;
    TORCH_INTERNAL_ASSERT(numels[i] == entries[i]->param.numel() &&
                              runs_of_param(entries[i]->param, static_cast<std::int64_t>(i), &runs),
                          "list_plan: parameter ", i, " has gaps that no run covers (validate_params stages it)");
  }
  return std::make_shared<const Plan>(runs, cpu::kChunkSize);
}

void refresh_staged_grads(std::deque<StagedGrad>& staged) {
  for (StagedGrad& s : staged) copy_into_dense(s.buffer, s.param->grad());
}

void refresh_staged_params(std::deque<StagedParam>& staged, bool cpu) {
  for (StagedParam& s : staged)
    if (cpu || !s.buffer.is_cpu()) copy_into_dense(s.buffer, *s.param);
}

void write_back_staged_params(std::deque<StagedParam>& staged, bool cpu) {
  for (StagedParam& s : staged)
    if ((cpu || !s.buffer.is_cpu()) && !ampfuse::detail::copy_by_runs(s.alias, s.buffer)) s.alias.copy_(s.buffer);
}

std::vector<std::int64_t> kernel_strides(const at::Tensor& p) {
  if (p.is_non_overlapping_and_dense()) return p.strides().vec();
  return at::infer_dense_strides(p.sizes(), p.strides());
}

PlanMatch match_plan(torch::optim::Optimizer& opt, const StateStamp& stamp, const char* name,
                     const StepSignals* signals, PlanKeys& keys, bool float64, bool stage_grads,
                     std::size_t state_bytes) {
  // Each group's params() is where and as long as recorded: the kept spans reach every parameter.
  if (!same_spans(opt, keys.groups)) return PlanMatch::kChanged;
  // An inference tensor is stepped under InferenceMode only (validation says so).
  if (keys.any_inference && !c10::InferenceMode::is_enabled()) return PlanMatch::kChanged;
  const std::size_t total = span_total(keys.groups);
  const auto& states = opt.state();
  // Whether p, its grad and its state are those `kept` recorded (kAll: the
  // common case), or all but a dense grad that replaced a dense grad
  // (kAllButGrad: new grads at every step, as after zero_grad() and a
  // backward; *grad_now is the new one as a PlanParam records it), read
  // without building a PlanParam (fewer reads, no calls into autograd);
  // anything else (kNo) goes through plan_param's comparison below. A
  // parameter without a grad and without state (a frozen one) is the common
  // case too: it stays without both.
  enum class Same { kAll, kAllButGrad, kNo };
  // What compare() reads of a new grad (kAllButGrad): a few words, so that
  // a parameter that matches costs no PlanParam (120 bytes, zeroed).
  struct GradNow {
    const c10::TensorImpl* grad;
    const void* grad_data;
    std::int64_t grad_numel;
    c10::ScalarType grad_dtype;
    const void* grad_storage;
  };
  // A grad read where it is (not staged) whose TensorImpl and data are the
  // recorded ones may still be a new grad: made where a freed one was (a
  // view of a gradient bucket after zero_grad(set_to_none)), in another
  // layout. Read in place only while laid out as its parameter (a dense
  // one's strides here; below, grad_needs_staging's kernel layout); read
  // through a copy (staged) only while of its parameter's shape (a shape
  // that only broadcasts to it is refused by validation).
  // Whether a grad of a dense parameter is read where it is: laid out as
  // it, its values as stored (no negative bit), in memory (a ZeroTensor,
  // which has none, is read through a copy of its zeros).
  auto in_place = [](const c10::TensorImpl* grad, const c10::TensorImpl* param) {
    return !grad->is_neg() && !grad->_is_zerotensor() && grad->sizes() == param->sizes() &&
           grad->strides() == param->strides();
  };
  auto compare = [&](const at::Tensor& p, const PlanParam& kept, GradNow* grad_now) {
    const c10::TensorImpl* impl = p.unsafeGetTensorImpl();
    if (impl != kept.param || kept.layout != 0 || kept.grad_sparse ||
        (kept.state != nullptr && kept.stamp == kNoStamp))
      return Same::kNo;
    if (impl->numel() != kept.numel || impl->dtype().toScalarType() != kept.dtype ||
        !impl->is_non_overlapping_and_dense() || data_address(impl) != kept.param_data ||
        (kept.grad != nullptr && copy_on_write(impl)))  // (a frozen one is not written)
      return Same::kNo;
    const auto it = states.find(const_cast<c10::TensorImpl*>(impl));
    if (kept.state == nullptr ? it != states.end()
                              : it == states.end() || it->second.get() != kept.state || stamp(*it->second) != kept.stamp)
      return Same::kNo;
    const at::Tensor& grad_tensor = impl->grad();
    if (!grad_tensor.defined()) return kept.grad == nullptr ? Same::kAll : Same::kNo;
    const c10::TensorImpl* grad = grad_tensor.unsafeGetTensorImpl();
    if (kept.grad == nullptr || grad->is_sparse()) return Same::kNo;
    const void* const grad_data = data_address(grad);
    const c10::ScalarType grad_dtype = grad->dtype().toScalarType();
    if (grad == kept.grad && grad->numel() == kept.grad_numel && grad_dtype == kept.grad_dtype &&
        grad_data == kept.grad_data)
      return (kept.grad_staged ? grad->sizes() == impl->sizes() : in_place(grad, impl)) ? Same::kAll : Same::kNo;
    *grad_now = {grad, grad_data, grad->numel(), grad_dtype, grad->unsafe_storage().unsafeGetStorageImpl()};
    return Same::kAllButGrad;
  };
  // The kind of a new grad (check_param's). When compare() found all but
  // the grad as recorded (it passes the new grad's TensorImpl, else null),
  // the parameter passed check_param when the plan was recorded and is the
  // same dense tensor: only the grad's own checks are left. A grad that does
  // not pass them, or is laid out otherwise than its parameter, goes
  // through check_param, for its kind or its error.
  const bool inference_mode = c10::InferenceMode::is_enabled();  // thread-local: read here, not on ATen's threads
  auto moved_grad_kind = [&](const at::Tensor& p, const c10::TensorImpl* grad, std::size_t g, std::size_t i,
                             bool float64_ok, bool staged_ok) {
    if (grad != nullptr) {
      const c10::TensorImpl* impl = p.unsafeGetTensorImpl();
      if (grad->layout() == c10::kStrided && grad->dtype() == impl->dtype() && grad->device() == impl->device() &&
          in_place(grad, impl) && (signals == nullptr || signals->contains(impl->device())))
        return GradKind::kInPlace;
    }
    return check_param(p, g, i, name, signals, float64_ok, staged_ok, false, staged_ok, inference_mode);
  };
  std::atomic<bool> changed{false};
  std::atomic<bool> moved{false};
  std::atomic<bool> came_or_went{false};
  std::mutex mutex;
  std::size_t first_error = total;
  std::exception_ptr error;
  keys.came.clear();
  at::parallel_for(0, static_cast<std::int64_t>(total), kEntriesGrain, [&](std::int64_t begin, std::int64_t end) {
    // The flags shared between threads are written once per range, and what
    // the loop reads of this frame is copied: a store per parameter to a
    // line that other threads read (this frame's) made them wait on each other.
    const bool float64_ok = float64, staged_ok = stage_grads;
    bool any_moved = false, any_went = false;
    std::vector<std::pair<std::size_t, std::size_t>> came;  // this range's parameters that gained a grad
    FlatParams cursor(keys.groups, static_cast<std::size_t>(begin));
    for (std::int64_t k = begin; k < end && !changed.load(std::memory_order_relaxed); ++k, cursor.advance()) {
      const at::Tensor& p = *cursor;
      PlanParam& kept = keys.params[static_cast<std::size_t>(k)];
      if (k + kPrefetchAhead < end) {  // from the record: the loads overlap instead of waiting in turn
        const PlanParam& ahead = keys.params[static_cast<std::size_t>(k + kPrefetchAhead)];
        prefetch_impl(ahead.param);
        prefetch_storage(ahead.param_storage);
        prefetch_grad(ahead.autograd_meta, ahead.grad_slot, ahead.grad, ahead.grad_storage);
        prefetch(ahead.state_entry);
        prefetch_object(ahead.state, state_bytes);
      }
      GradNow now;
      const Same same = compare(p, kept, &now);
      if (same == Same::kAll) continue;
      bool gained = false;
      if (same == Same::kNo) {
        const PlanParam full = plan_param(p, opt, stamp);
        // A parameter stepped in place that gained a grad (read in place,
        // below) or lost one it read in place, all else as recorded: the step makes its
        // entries and lists again, and validates nothing else again (a
        // parameter that gains its first grad has no state yet: the step
        // makes it, so the plan is made again).
        gained = full.grad != nullptr && kept.grad == nullptr;
        const bool lost = full.grad == nullptr && kept.grad != nullptr;
        if (full.param != kept.param || full.param_data != kept.param_data || full.numel != kept.numel ||
            full.layout != kept.layout || full.dtype != kept.dtype || full.state != kept.state ||
            full.stamp != kept.stamp || (full.state != nullptr && full.stamp == kNoStamp) ||
            ((gained || lost) && (kept.layout != 0 || param_needs_staging(p))) || (gained && full.state == nullptr) ||
            (lost && kept.grad_staged) || kept.grad_sparse ||
            (full.grad != nullptr && (full.grad->is_sparse() || copy_on_write(p.unsafeGetTensorImpl()))) ||
            (full.grad != nullptr && full.grad == kept.grad &&
             (p.grad().sizes() != p.sizes() || (!kept.grad_staged && grad_needs_staging(p, p.grad()))))) {
          // A step with sparse grads validates from scratch (they are new tensors each step); a parameter
          // made copy-on-write since (a lazy clone of it was taken) gets its own copy in validate_params;
          // a grad read in place, now laid out otherwise, is read through a copy (or refused).
          changed = true;
          break;
        }
        if (lost) {
          kept = full;  // (its grad fields as a frozen parameter's: none)
          any_went = true;
          continue;
        }
        now = {full.grad, full.grad_data, full.grad_numel, full.grad_dtype, full.grad_storage};
      }
      if (now.grad != kept.grad || now.grad_data != kept.grad_data || now.grad_numel != kept.grad_numel ||
          now.grad_dtype != kept.grad_dtype) {
        try {
          if ((moved_grad_kind(p, same == Same::kAllButGrad ? now.grad : nullptr, cursor.group(),
                              cursor.index(), float64_ok, staged_ok) == GradKind::kStaged) !=
              kept.grad_staged) {
            changed = true;  // a grad now read through a copy, or no longer: its Entry changes
            break;
          }
          if (!keys.state_bytes.empty() && meets_state(keys, bytes_spanned(*now.grad, now.grad_data))) {
            changed = true;  // a state tensor given as a grad: validated again (check_state_memory refuses it)
            break;
          }
        } catch (...) {
          const std::lock_guard<std::mutex> lock(mutex);
          if (static_cast<std::size_t>(k) < first_error) {
            first_error = static_cast<std::size_t>(k);
            error = std::current_exception();
          }
          break;
        }
        kept.grad = now.grad;
        kept.grad_data = now.grad_data;
        kept.grad_numel = now.grad_numel;
        kept.grad_dtype = now.grad_dtype;
        kept.grad_storage = now.grad_storage;  // what the next match prefetches
        any_moved = true;
        if (gained) came.emplace_back(cursor.group(), cursor.index());
      }
    }
    if (any_moved) moved.store(true, std::memory_order_relaxed);
    if (any_went || !came.empty()) came_or_went.store(true, std::memory_order_relaxed);
    if (!came.empty()) {
      const std::lock_guard<std::mutex> lock(mutex);
      keys.came.insert(keys.came.end(), came.begin(), came.end());
    }
  });
  if (changed) return PlanMatch::kChanged;
  // A refused grad after a parameter that gained one: the plan is made
  // again, so that the error is the one a fresh step gives (it checks each
  // parameter's state where this match checks grads alone, in order).
  if (error && came_or_went) return PlanMatch::kChanged;
  if (error) std::rethrow_exception(error);
  if (came_or_went) {
    std::sort(keys.came.begin(), keys.came.end());  // (the ranges' parts in any order)
    return PlanMatch::kGradsCameOrWent;
  }
  return moved ? PlanMatch::kGradsMoved : PlanMatch::kSame;
}

bool cpu_step_skipped(const StepSignals* signals) {
  if (!signals) return false;
  for (const auto& entry : signals->all())
    if (entry.first.is_cpu() && entry.second.found_inf.defined() && entry.second.found_inf.item<float>() != 0.f)
      return true;
  return false;
}

Lists group_lists(const std::vector<const Entry*>& entries) {
  return group_by<ListKey>(entries, [](const Entry* e) {
    return ListKey{e->group, e->device, e->dtype};
  });
}

double cpu_grad_factor(const ScaleSignal* signal) {
  if (!signal) return 1.0;
  auto value = [](const at::Tensor& t) {
    return t.defined() ? static_cast<double>(*t.to(at::kFloat).data_ptr<float>()) : 1.0;
  };
  // Exact: a product of two floats fits a double, so rounding it to float
  // gives the fp32 product bit for bit.
  return value(signal->inv_scale) * value(signal->clip_coef);
}

bool stream_capturing(c10::Device device) {
#if defined(AMPFUSE_WITH_CUDA)
  if (!device.is_cuda()) return false;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  TORCH_CHECK(cudaStreamIsCapturing(current_stream(device), &status) == cudaSuccess,
              "ampfuse: cudaStreamIsCapturing failed");
  return status != cudaStreamCaptureStatusNone;
#else
  (void)device;
  return false;
#endif
}

std::int64_t SmallStatePool::pooled_bytes(c10::IntArrayRef sizes) const {
  const std::int64_t bytes =
      c10::multiply_integers(sizes) * static_cast<std::int64_t>(c10::elementSize(options_.dtype().toScalarType()));
  return bytes <= kMaxBytes ? bytes : 0;
}

std::int64_t SmallStatePool::pooled_bytes(const at::Tensor& like) const {
  return like.is_non_overlapping_and_dense() ? pooled_bytes(like.sizes()) : 0;
}

void SmallStatePool::reserve(std::int64_t bytes, int count) {
  if (bytes == 0) return;
  const std::int64_t a = alignment(bytes);
  // Every slot ends on a multiple of 16: the padding before one is at most a - 16.
  reserved_ += count * ((bytes + a - 1) / a * a + a - 16);
}

at::Tensor SmallStatePool::carve(std::int64_t bytes, c10::IntArrayRef sizes, c10::IntArrayRef strides) {
  if (bytes == 0) return {};
  const std::int64_t a = alignment(bytes);
  const std::int64_t start = (used_ + a - 1) / a * a;
  if (start + bytes > reserved_) return {};
  const auto itemsize = static_cast<std::int64_t>(c10::elementSize(options_.dtype().toScalarType()));
  if (!buffer_.defined()) buffer_ = at::full({reserved_ / itemsize}, fill_, options_);
  used_ = (start + bytes + 15) / 16 * 16;
  // A tensor over the buffer's storage, not a view of it: as a tensor of
  // its own, it has its own version counter and no autograd view history
  // (an in-place write under grad mode is not refused as one into a view
  // made without grad).
  return at::empty({0}, options_).set_(buffer_.storage(), start / itemsize, sizes, strides);
}

at::Tensor SmallStatePool::take(const at::Tensor& like) {
  at::Tensor t = carve(pooled_bytes(like), like.sizes(), like.strides());
  return t.defined() ? t : at::full_like(like, fill_, options_, at::MemoryFormat::Preserve);
}

at::Tensor SmallStatePool::take(c10::IntArrayRef sizes) {
  at::Tensor t = carve(pooled_bytes(sizes), sizes, c10::contiguous_strides(sizes));
  return t.defined() ? t : at::full(sizes, fill_, options_);
}

void refuse_under_capture(const Entry& e, const char* optimizer, const char* what) {
  TORCH_CHECK(!stream_capturing(e.device), optimizer, ": param group ", e.group, ", param ", e.index, ": ", what,
              " does not exist yet under CUDA graph capture; run one step outside the capture (a warm-up step) "
              "first");
}

DeviceScalars::Slot* DeviceScalars::slot(std::size_t group, c10::Device device) {
  device = canonical_device(device);
  for (Slot& s : slots_)
    if (s.group == group && s.device == device) return &s;
  return nullptr;
}

at::Tensor DeviceScalars::find(std::size_t group, c10::Device device) const {
  Slot* s = const_cast<DeviceScalars*>(this)->slot(group, device);
  return s == nullptr ? at::Tensor() : s->value;
}

at::Tensor DeviceScalars::prepare(std::size_t group, c10::Device device, double value, const char* optimizer,
                                  bool* created) {
  *created = false;
  if (Slot* s = slot(group, device)) return s->value;
  TORCH_CHECK(!stream_capturing(device), optimizer, ": param group ", group,
              ": capturable needs one step outside the CUDA graph capture (a warm-up step) first");
  slots_.push_back({group, canonical_device(device),
                    at::full({1}, value, at::TensorOptions().dtype(at::kDouble).device(device)), value});
  *created = true;
  return slots_.back().value;
}

void DeviceScalars::refresh(std::size_t group, c10::Device device, double value) {
  Slot* s = slot(group, device);
  if (s == nullptr || s->written == value || stream_capturing(device)) return;
  s->value.fill_(value);
  s->written = value;
}

void DeviceScalars::erase(std::size_t group, c10::Device device) {
  device = canonical_device(device);
  slots_.erase(std::remove_if(slots_.begin(), slots_.end(),
                              [&](const Slot& s) { return s.group == group && s.device == device; }),
               slots_.end());
}

void advance_step_counters(const std::vector<at::Tensor>& steps, const ScaleSignal* signal) {
  if (steps.empty()) return;
  // One foreach launch for all of them, not one per parameter.
  if (!signal) {
    at::_foreach_add_(steps, at::Scalar(1));
    return;
  }
  // found_inf has one element; the foreach overload takes a 0-dim tensor.
  at::_foreach_add_(steps, (signal->found_inf == 0).to(steps.front().scalar_type()).reshape({}));
}

SignalPointers signal_pointers(const ScaleSignal* signal) {
  SignalPointers ptrs;
  if (!signal) return ptrs;
  ptrs.found_inf = signal->found_inf.data_ptr<float>();
  if (signal->inv_scale.defined()) ptrs.inv_scale = signal->inv_scale.data_ptr<float>();
  if (signal->clip_coef.defined()) ptrs.clip_coef = signal->clip_coef.data_ptr<float>();
  return ptrs;
}

#if defined(AMPFUSE_WITH_CUDA)
std::shared_ptr<const ListMeta> make_launch_meta(const TensorListsView& views, const Plan& plan, c10::Device device) {
  auto meta = std::make_shared<ListMeta>();
  detail::make_launch_meta(views, plan, device, *meta);
  return meta;
}

std::shared_ptr<const ListMeta> reuse_launch_meta(const std::shared_ptr<const ListMeta>& meta, c10::Device device) {
  if (!meta || !meta->on_device.defined()) return meta;
  at::Tensor on_device = detail::device_meta(meta->words, device, meta->on_device);
  if (on_device.is_same(meta->on_device)) return meta;
  auto fresh = std::make_shared<ListMeta>();  // evicted and uploaded again
  fresh->words = meta->words;
  fresh->launch = meta->launch;
  fresh->launch.host = fresh->words.data();
  fresh->on_device = std::move(on_device);
  fresh->launch.device = fresh->on_device.data_ptr<std::int64_t>();
  return fresh;
}

cuda::Stream current_stream(c10::Device device) { return c10::cuda::getCurrentCUDAStream(device.index()).stream(); }

unsigned* TicketCounters::get(const ListKey& key, std::int64_t num_tensors) {
  const auto& [group, device, dtype] = key;
  at::Tensor& counters = counters_[std::make_tuple(group, device.str(), static_cast<int>(dtype))];
  if (!counters.defined() || counters.numel() < num_tensors)
    counters = at::zeros({std::max<std::int64_t>(num_tensors, 1)}, at::TensorOptions().dtype(at::kInt).device(device));
  return reinterpret_cast<unsigned*>(counters.data_ptr<std::int32_t>());
}
#endif

}  // namespace ampfuse::sdk
