// Torch adapter of the multi-tensor engine: validates at::Tensors, groups them
// by dtype, turns them into views and runs the CPU or CUDA kernels.

#include "ampfuse/tensor_ops.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "contract/cpu/kernels.h"
#include "contract/torch/tensor_ops_views.h"

#if defined(AMPFUSE_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "contract/cuda/launch.h"
#include "contract/torch/meta_cache.h"
#endif

namespace ampfuse {

ScalarType to_scalar_type(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return ScalarType::Float32;
    case c10::ScalarType::Half: return ScalarType::Float16;
    case c10::ScalarType::BFloat16: return ScalarType::BFloat16;
    case c10::ScalarType::Double: return ScalarType::Float64;
    default:
      TORCH_CHECK(false, "ampfuse: dtype ", t, " is not supported (expected Float, Half, BFloat16 or Double)");
  }
}

std::string cpu_isa() { return sdk::cpu::to_string(sdk::cpu::current_isa()); }

std::int64_t cpu_chunk_size() { return sdk::cpu::kChunkSize; }

namespace {

bool supported_dtype(c10::ScalarType t) {
  return t == c10::ScalarType::Float || t == c10::ScalarType::Half || t == c10::ScalarType::BFloat16 ||
         t == c10::ScalarType::Double;
}

// What a list's tensors must be: dense (the optimizers' lists, whose tensors
// are updated together), or any strided tensor, a view with gaps being read
// run by run or staged through a dense copy (the engine ops on one list);
// kStagedWrite for the in-place ones, which refuse views whose elements
// share memory.
enum class Layout { kDense, kStagedRead, kStagedWrite };

void check_tensor(const at::Tensor& t, const char* op, const std::string& name, std::size_t i,
                  const c10::optional<c10::Device>& device, Layout layout = Layout::kDense) {
  TORCH_CHECK(t.defined(), op, ": ", name, "[", i, "] is undefined");
  TORCH_CHECK(!t.is_nested(), op, ": ", name, "[", i, "] is a nested tensor; only dense (strided) tensors are supported");
  // A ZeroTensor (at::_efficientzerotensor) has no memory: read as zeros
  // through a dense copy; refused where it would be written, as ATen refuses it.
  TORCH_CHECK(layout == Layout::kStagedRead || !t._is_zerotensor(), op, ": ", name, "[", i,
              "] is a ZeroTensor, which has no memory to write; materialize it with .clone()");
  TORCH_CHECK(t.layout() == c10::kStrided, op, ": ", name, "[", i, "] has layout ", t.layout(),
              "; only dense (strided) tensors are supported");
  TORCH_CHECK(supported_dtype(t.scalar_type()), op, ": ", name, "[", i, "] has dtype ", t.scalar_type(),
              ", which is not supported (expected Float, Half, BFloat16 or Double)");
  TORCH_CHECK(!device || t.device() == *device, op, ": ", name, "[", i, "] is on ", t.device(),
              " but ", name, "[0] is on ", *device, "; one list must be on one device");
  TORCH_CHECK(layout != Layout::kDense || t.is_non_overlapping_and_dense(), op, ": ", name, "[", i,
              "] is not dense (a strided view with gaps or overlaps); tensors updated together must be dense, so "
              "that their elements fill one block of memory in one order");
  TORCH_CHECK(layout != Layout::kStagedWrite || at::has_internal_overlap(t) != at::MemOverlap::Yes, op, ": ", name,
              "[", i, "] has elements that share memory (an expanded view); writing it in place is refused, as ATen "
              "refuses it");
#if !defined(AMPFUSE_WITH_CUDA)
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, "[", i, "] is on ", t.device(),
              " but ampfuse was built without CUDA");
#else
  TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), op, ": ", name, "[", i, "] is on ", t.device(),
              "; only CPU and CUDA are supported");
#endif
}

void check_scalar(const at::Tensor& s, const char* op, const char* name, const c10::optional<c10::Device>& device,
                  bool allow_double = false) {
  TORCH_CHECK(s.defined(), op, ": ", name, " is undefined");
  const bool dtype_ok = s.scalar_type() == c10::ScalarType::Float ||
                        (allow_double && s.scalar_type() == c10::ScalarType::Double);
  TORCH_CHECK(s.layout() == c10::kStrided && dtype_ok && s.numel() == 1, op, ": ", name, " must be a dense ",
              allow_double ? "float32 or float64" : "float32", " tensor of one element, got a ", s.layout(), " ",
              s.scalar_type(), " tensor with ", s.numel(), " elements");
  TORCH_CHECK(!device || s.device() == *device, op, ": ", name, " is on ", s.device(), " but the tensors are on ",
              *device);
}

std::vector<const at::Tensor*> pointers(at::TensorList tensors) {
  std::vector<const at::Tensor*> out;
  out.reserve(tensors.size());
  for (const at::Tensor& t : tensors) out.push_back(&t);
  return out;
}

c10::optional<c10::Device> common_device(at::TensorList tensors) {
  if (tensors.empty() || !tensors[0].defined()) return c10::nullopt;
  return tensors[0].device();
}

/// One dtype group of a depth-1 list: its view and plan. A list of one dtype
/// (the usual case) is its own group, not copied: `view` points at it.
struct Group {
  ScalarType dtype;
  const TensorListsView* view;
  Plan plan;
  TensorListsView owned;  // the group's own view when the list mixes dtypes

  Group(ScalarType d, const TensorListsView* v, Plan p) : dtype(d), view(v), plan(std::move(p)) {}
  Group(Group&&) = default;
  Group(const Group&) = delete;  // a copy would point at the original's `owned`
};

std::vector<Group> make_groups(const TensorListsView& views, std::int64_t chunk_size) {
  TORCH_INTERNAL_ASSERT(views.lists.size() == 1, "ampfuse: the engine ops take one list, got ", views.lists.size());
  std::vector<Group> out;
  const std::vector<TensorView>& list = views.lists[0];
  const auto mixed = std::find_if(list.begin(), list.end(), [&](const TensorView& v) {
    return v.dtype != list.front().dtype;
  });
  if (mixed == list.end()) {
    if (list.empty()) return out;
    std::vector<std::int64_t> numels;
    numels.reserve(list.size());
    for (const TensorView& v : list) numels.push_back(v.numel);
    Plan plan(numels, chunk_size);
    if (plan.num_chunks() > 0) out.emplace_back(list.front().dtype, &views, std::move(plan));
    return out;
  }
  for (int d = 0; d < kNumScalarTypes; ++d) {
    Group group(static_cast<ScalarType>(d), nullptr, Plan());
    group.owned.lists.resize(1);
    std::vector<std::int64_t> numels;
    for (const TensorView& v : list) {
      if (static_cast<int>(v.dtype) != d) continue;
      group.owned.lists[0].push_back(v);
      numels.push_back(v.numel);
    }
    if (numels.empty()) continue;
    group.plan = Plan(numels, chunk_size);
    if (group.plan.num_chunks() > 0) out.push_back(std::move(group));
  }
  for (Group& g : out) g.view = &g.owned;  // after the moves
  return out;
}

std::vector<void*> data_pointers(const TensorListsView& view) {
  std::vector<void*> ptrs;
  ptrs.reserve(view.lists[0].size());
  for (const TensorView& v : view.lists[0]) ptrs.push_back(v.data);
  return ptrs;
}

#if defined(AMPFUSE_WITH_CUDA)
// Calls launch(group, meta, stream) for each dtype group of `views` on
// `device`, with the device guard set and the current stream.
template <class Launch>
void for_each_cuda_group(const TensorListsView& views, c10::Device device, Launch&& launch) {
  const c10::cuda::CUDAGuard guard(device);
  const auto stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  for (const Group& g : make_groups(views, sdk::cuda::kChunkSize)) {
    sdk::ListMeta meta;
    detail::make_launch_meta(*g.view, g.plan, device, meta);
    launch(g, meta.launch, stream);
  }
}
#endif

}  // namespace

namespace {

/// A tensor that is not dense is read in place, one view per run of
/// elements adjacent in memory, when its runs hold at least this many
/// elements; shorter runs are staged through a dense copy, which then costs
/// less than a view per run.
constexpr std::int64_t kMinRunElements = 128;

// The runs of adjacent elements a strided tensor is made of: their common
// length and number, and the dimensions outside a run that place them.
struct Runs {
  std::int64_t length = 0;
  std::int64_t count = 0;
  std::vector<std::int64_t> sizes, strides;  // the outer dimensions, outermost in memory first
  std::vector<std::int64_t> dims;            // their places in the tensor's sizes
  std::vector<std::int64_t> inner;           // the dimensions of more than one element inside a run

  // The offset of run r's first element in a tensor of these sizes whose
  // outer dimensions have `strides_of` strides (indexed by dimension).
  std::int64_t offset_of(std::int64_t r, c10::IntArrayRef strides_of) const {
    std::int64_t offset = 0;
    for (std::size_t k = sizes.size(); k-- > 0;) {
      offset += (r % sizes[k]) * strides_of[dims[k]];
      r /= sizes[k];
    }
    return offset;
  }

  // emit(offset) for each run, offset (in elements) of its first element, in
  // memory order.
  template <class Emit>
  void for_each(Emit&& emit) const {
    const std::size_t inner = sizes.size() - 1;  // the outer dimension stepped fastest
    std::vector<std::int64_t> index(inner, 0);
    std::int64_t offset = 0;
    for (std::int64_t r = 0; r < count; r += sizes[inner]) {
      for (std::int64_t j = 0; j < sizes[inner]; ++j) emit(offset + j * strides[inner]);
      for (std::size_t k = inner; k-- > 0;) {  // the next index of the dimensions outside it
        if (++index[k] < sizes[k]) {
          offset += strides[k];
          break;
        }
        offset -= (sizes[k] - 1) * strides[k];
        index[k] = 0;
      }
    }
  }
};

// The runs of a strided tensor of `sizes` and `strides`, into *runs; false
// when its elements in the innermost place in memory are not adjacent
// (stride 1) or its runs are shorter than `min_run`. Each element is in
// exactly one run; runs may share memory (a dimension of stride 0, an
// expanded one, repeats its runs: read once per element, as a read of the
// tensor would) unless `disjoint`, where runs that may share memory give
// false. Host math, tested on shapes.
bool contiguous_runs(c10::IntArrayRef sizes, c10::IntArrayRef strides, std::int64_t min_run, bool disjoint,
                     Runs* runs) {
  // The dimensions of more than one element, outermost in memory first (a
  // stride-0 dimension is outermost: it repeats whatever is inside it).
  std::vector<std::int64_t> dims;
  for (std::int64_t d = 0; d < static_cast<std::int64_t>(sizes.size()); ++d)
    if (sizes[d] > 1) dims.push_back(d);
  if (dims.empty()) return false;
  const auto key = [&](std::int64_t d) {
    return strides[d] == 0 ? std::numeric_limits<std::int64_t>::max() : strides[d];
  };
  std::stable_sort(dims.begin(), dims.end(), [&](std::int64_t a, std::int64_t b) { return key(a) > key(b); });
  if (strides[dims.back()] != 1) return false;
  // The inner dimensions that continue one another in memory make one run.
  std::int64_t length = 1;
  std::size_t outer = dims.size();
  while (outer > 0 && strides[dims[outer - 1]] == length) {
    length *= sizes[dims[outer - 1]];
    --outer;
  }
  if (length < min_run || outer == 0) return false;
  if (disjoint && !detail::strides_never_overlap(sizes, strides)) return false;
  runs->length = length;
  runs->count = 1;
  runs->sizes.clear();
  runs->strides.clear();
  runs->dims.assign(dims.begin(), dims.begin() + static_cast<std::ptrdiff_t>(outer));
  runs->inner.assign(dims.begin() + static_cast<std::ptrdiff_t>(outer), dims.end());
  for (std::size_t k = 0; k < outer; ++k) {
    runs->count *= sizes[dims[k]];
    runs->sizes.push_back(sizes[dims[k]]);
    runs->strides.push_back(strides[dims[k]]);
  }
  return true;
}

// Checks tensor i of a list (at(i), n of them; the first one's device is the
// list's) against `first` (the tensors at the same positions of the first
// list, or null) and appends its view: one pass, checks and views together.
// With `staged` (the engine ops on one list), a tensor that is not dense is
// appended as a view per run where its runs are long, on CPU (*split set),
// else copied into a dense one, which its view points to, recorded in `staged`.
template <class At, class First>
void check_and_append(At at, std::size_t n, First first, const char* op, const std::string& name,
                      const std::string& first_name, std::vector<TensorView>& out,
                      std::vector<std::pair<at::Tensor, at::Tensor>>* staged = nullptr, bool in_place = false,
                      bool* split = nullptr) {
  const c10::optional<c10::Device> device =
      n > 0 && at(0).defined() ? c10::optional<c10::Device>(at(0).device()) : c10::nullopt;
  const Layout layout = staged == nullptr ? Layout::kDense : in_place ? Layout::kStagedWrite : Layout::kStagedRead;
  out.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    const at::Tensor& t = at(i);
    check_tensor(t, op, name, i, device, layout);
    if (const at::Tensor* f = first(i)) {
      TORCH_CHECK(t.sizes() == f->sizes(), op, ": ", name, "[", i, "] has shape ", t.sizes(), " but ", first_name,
                  "[", i, "] has shape ", f->sizes());
      TORCH_CHECK(t.strides() == f->strides(), op, ": ", name, "[", i, "] has strides ", t.strides(), " but ",
                  first_name, "[", i, "] has strides ", f->strides(),
                  "; tensors updated together must share one memory layout");
    }
    if (staged != nullptr && (!t.is_non_overlapping_and_dense() || t._is_zerotensor())) {
      // On CPU, long runs are read and written where they are: a dense copy
      // and its write-back cost four passes over the tensor more (and fresh
      // memory at every call), up to 6x ATen's in-place unscale.
      Runs runs;
      if (t.is_cpu() && !t._is_zerotensor() && t.numel() > 0 &&
          contiguous_runs(t.sizes(), t.strides(), kMinRunElements, in_place, &runs)) {
        char* const base = static_cast<char*>(t.data_ptr());
        const auto item = static_cast<std::int64_t>(t.element_size());
        const ScalarType dtype = to_scalar_type(t.scalar_type());
        const std::size_t needed = out.size() + static_cast<std::size_t>(runs.count) + (n - i - 1);
        if (needed > out.capacity()) out.reserve(std::max(needed, 2 * out.capacity()));
        runs.for_each([&](std::int64_t offset) { out.push_back({base + offset * item, runs.length, dtype}); });
        if (split != nullptr) *split = true;
        continue;
      }
      staged->emplace_back(t, t._is_zerotensor() ? at::zeros(t.sizes(), t.options()) : t.contiguous());
      out.push_back({staged->back().second.data_ptr(), t.numel(), to_scalar_type(t.scalar_type())});
      continue;
    }
    out.push_back({t.data_ptr(), t.numel(), to_scalar_type(t.scalar_type())});
  }
}

}  // namespace

TensorListsView make_list_views(const std::vector<at::TensorList>& lists, const std::vector<std::string>& names,
                                const char* op) {
  if (op == nullptr) op = "make_list_views";  // (a null const char* streamed into a message is undefined)
  TORCH_CHECK(lists.size() == names.size(), op, ": internal error: ", lists.size(), " lists but ", names.size(),
              " names");
  TensorListsView views;
  if (lists.empty()) return views;
  views.lists.resize(lists.size());
  // At 10,000 tensors this host work is what a step costs on a GPU.
  for (std::size_t l = 0; l < lists.size(); ++l) {
    TORCH_CHECK(lists[l].size() == lists[0].size(), op, ": ", names[l], " has ", lists[l].size(), " tensors but ",
                names[0], " has ", lists[0].size());
    const at::TensorList list = lists[l], first = lists[0];
    check_and_append([&](std::size_t i) -> const at::Tensor& { return list[i]; }, list.size(),
                     [&](std::size_t i) { return l > 0 ? &first[i] : nullptr; }, op, names[l], names[0],
                     views.lists[l]);
  }
  // The first list's device is every list's.
  for (std::size_t l = 1; l < lists.size(); ++l)
    if (!lists[l].empty() && lists[0][0].defined())
      TORCH_CHECK(lists[l][0].device() == lists[0][0].device(), op, ": ", names[l], "[0] is on ",
                  lists[l][0].device(), " but ", names[0], "[0] is on ", lists[0][0].device(),
                  "; one list must be on one device");
  return views;
}

namespace detail {

CheckedList make_views(const std::vector<const at::Tensor*>& tensors, const std::string& name, const char* op,
                       bool in_place) {
  CheckedList list;
  list.views.lists.resize(1);
  check_and_append([&](std::size_t i) -> const at::Tensor& { return *tensors[i]; }, tensors.size(),
                   [](std::size_t) -> const at::Tensor* { return nullptr; }, op, name, name, list.views.lists[0],
                   &list.staged, in_place, &list.split);
  return list;
}

bool strides_never_overlap(c10::IntArrayRef sizes, c10::IntArrayRef strides) {
  std::vector<std::pair<std::int64_t, std::int64_t>> dims;  // (stride, size) with size > 1
  for (std::size_t d = 0; d < sizes.size(); ++d)
    if (sizes[d] > 1) dims.emplace_back(strides[d], sizes[d]);
  std::sort(dims.begin(), dims.end());
  std::int64_t reach = 0;  // the furthest offset of the dims so far, in elements
  for (const auto& [stride, size] : dims) {
    if (stride <= reach) return false;
    reach += (size - 1) * stride;
  }
  return true;
}

bool runs_of_param(const at::Tensor& p, std::int64_t tensor, std::vector<PlanRun>* out) {
  if (p.is_neg()) return false;  // its memory holds the values negated: stepped through a copy
  if (p.is_non_overlapping_and_dense()) {
    out->push_back({tensor, 0, p.numel(), 0});
    return true;
  }
  Runs runs;
  if (!p.is_cpu() || p.layout() != c10::kStrided || p.numel() == 0 ||
      !contiguous_runs(p.sizes(), p.strides(), kMinRunElements, /*disjoint=*/true, &runs))
    return false;
  // Run r holds dense elements [r * length, (r + 1) * length): the runs in
  // memory order are the dense layout's order (strides sorted, as
  // at::empty_like lays out the state and a staged grad).
  std::int64_t begin = 0;
  runs.for_each([&](std::int64_t offset) {
    out->push_back({tensor, begin, runs.length, offset});
    begin += runs.length;
  });
  return true;
}

bool copy_by_runs(const at::Tensor& dst, const at::Tensor& src) {
  if (!dst.is_cpu() || !src.is_cpu() || dst.sizes() != src.sizes() || dst.scalar_type() != src.scalar_type() ||
      dst.layout() != c10::kStrided || src.layout() != c10::kStrided || dst.is_neg() || src.is_neg() ||
      dst.is_conj() || src.is_conj() || src._is_zerotensor() || dst.numel() == 0 ||
      (dst.is_non_overlapping_and_dense() && src.is_non_overlapping_and_dense()))
    return false;
  // The runs of the one with gaps (the destination's if both have them,
  // disjoint: each element is written once; a source's may repeat, as an
  // expanded view's do); the other must hold each run as adjacent elements
  // too, in the same order.
  const bool by_dst = !dst.is_non_overlapping_and_dense();
  const at::Tensor& lead = by_dst ? dst : src;
  const at::Tensor& other = by_dst ? src : dst;
  Runs runs;
  if (!contiguous_runs(lead.sizes(), lead.strides(), kMinRunElements, /*disjoint=*/by_dst, &runs)) return false;
  for (const std::int64_t d : runs.inner)
    if (other.stride(d) != lead.stride(d)) return false;
  char* const dst_base = static_cast<char*>(dst.data_ptr());
  const char* const src_base = static_cast<const char*>(src.const_data_ptr());
  const auto item = static_cast<std::int64_t>(dst.element_size());
  const std::size_t bytes = static_cast<std::size_t>(runs.length * item);
  const std::int64_t grain = std::max<std::int64_t>(1, sdk::cpu::kInlineElements / runs.length);
  at::parallel_for(0, runs.count, grain, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t r = b; r < e; ++r)
      std::memcpy(dst_base + runs.offset_of(r, dst.strides()) * item, src_base + runs.offset_of(r, src.strides()) * item,
                  bytes);
  });
  return true;
}

void CheckedList::write_back() const {
  for (const auto& [original, copy] : staged) const_cast<at::Tensor&>(original).copy_(copy);
}

}  // namespace detail

void check_non_finite(at::TensorList tensors, const at::Tensor& found_inf, const c10::optional<at::Tensor>& sum_sq) {
  constexpr const char* op = "ampfuse::check_non_finite";
  const auto device = common_device(tensors);
  check_scalar(found_inf, op, "found_inf", device);
  if (sum_sq) check_scalar(*sum_sq, op, "sum_sq", device, /*allow_double=*/true);
  const detail::CheckedList list = detail::make_views(pointers(tensors), "tensors", op, /*in_place=*/false);
  if (device) detail::check_non_finite(list, *device, found_inf, sum_sq);
}

namespace detail {

struct CpuGroups {
  struct One {
    ScalarType dtype;
    Plan plan;
    std::vector<void*> ptrs;
  };
  std::vector<One> groups;
};

namespace {

const CpuGroups& cpu_groups(const CheckedList& list) {
  if (!list.cpu_groups) {
    auto made = std::make_shared<CpuGroups>();
    for (Group& g : make_groups(list.views, sdk::cpu::kChunkSize))
      made->groups.push_back({g.dtype, std::move(g.plan), data_pointers(*g.view)});
    list.cpu_groups = std::move(made);
  }
  return *list.cpu_groups;
}

}  // namespace

void views_moved(const CheckedList& list) {
  if (!list.cpu_groups) return;
  const std::vector<TensorView>& views = list.views.lists[0];
  // One dtype group (the common case) holds every view, in order.
  if (list.cpu_groups->groups.size() == 1 && list.cpu_groups->groups[0].ptrs.size() == views.size()) {
    std::vector<void*>& ptrs = const_cast<CpuGroups&>(*list.cpu_groups).groups[0].ptrs;
    for (std::size_t i = 0; i < views.size(); ++i) ptrs[i] = views[i].data;
    return;
  }
  list.cpu_groups.reset();
}

void check_non_finite(const CheckedList& list, c10::Device device, const at::Tensor& found_inf,
                      const c10::optional<at::Tensor>& sum_sq) {
  if (device.is_cpu()) {
    const cpu::Kernels& k = cpu::kernels();
    unsigned char any_non_finite = 0;  // written by the kernels' threads (atomic stores)
    double total = 0.0;
    for (const CpuGroups::One& g : cpu_groups(list).groups) {
      const std::int64_t num_chunks = g.plan.num_chunks();
      std::vector<double> chunk_sum_sq(sum_sq ? static_cast<std::size_t>(num_chunks) : 0);
      const cpu::CheckArgs args{sdk::cpu::plan_ref(g.plan), g.ptrs.data(), g.dtype, &any_non_finite,
                                sum_sq ? chunk_sum_sq.data() : nullptr};
      at::parallel_for(0, num_chunks, sdk::cpu::chunks_grain(g.plan), [&](std::int64_t b, std::int64_t e) {
        const sdk::cpu::FlushSubnormals flush;
        k.check(args, b, e);
      });
      for (double s : chunk_sum_sq) total += s;
    }
    if (any_non_finite != 0) *found_inf.data_ptr<float>() = 1.f;
    if (sum_sq) {
      if (sum_sq->scalar_type() == c10::ScalarType::Double) {
        *sum_sq->data_ptr<double>() += total;
      } else {
        float* out = sum_sq->data_ptr<float>();
        *out = static_cast<float>(static_cast<double>(*out) + total);
      }
    }
    return;
  }
#if defined(AMPFUSE_WITH_CUDA)
  // An fp32 sum_sq over several dtypes (one launch each): summed in fp64 and
  // rounded once, as on CPU, not once per launch.
  const std::vector<TensorView>& views = list.views.lists[0];
  at::Tensor sum_f64;
  if (sum_sq && sum_sq->scalar_type() != c10::ScalarType::Double &&
      std::any_of(views.begin(), views.end(), [&](const TensorView& v) { return v.dtype != views.front().dtype; }))
    sum_f64 = at::zeros_like(*sum_sq, sum_sq->options().dtype(at::kDouble));
  for_each_cuda_group(list.views, device, [&](const Group& g, const sdk::cuda::LaunchMeta& meta, sdk::cuda::Stream stream) {
    at::Tensor workspace;
    if (sum_sq)
      workspace = at::empty({static_cast<std::int64_t>(cuda::check_workspace_bytes(meta.num_chunks))},
                            found_inf.options().dtype(at::kByte));
    cuda::SumSq out{};
    if (sum_f64.defined()) out.f64 = sum_f64.data_ptr<double>();
    else if (sum_sq && sum_sq->scalar_type() == c10::ScalarType::Double) out.f64 = sum_sq->data_ptr<double>();
    else if (sum_sq) out.f32 = sum_sq->data_ptr<float>();
    cuda::check_non_finite(meta, g.dtype, found_inf.data_ptr<float>(), out, sum_sq ? workspace.data_ptr() : nullptr,
                           stream);
  });
  if (sum_f64.defined()) sum_sq->copy_(sum_sq->to(at::kDouble).add_(sum_f64));  // on the current stream
#endif
}

void scale(const CheckedList& list, c10::Device device, const at::Tensor& scale, const at::Tensor* found_inf) {
  if (device.is_cpu()) {
    const cpu::Kernels& k = cpu::kernels();
    // fp32 (the public ops), or fp64 (the GradScaler's deferred inv_scale * clip_coef).
    const double s = scale.scalar_type() == c10::ScalarType::Double ? *scale.data_ptr<double>()
                                                                     : static_cast<double>(*scale.data_ptr<float>());
    unsigned char any_non_finite = 0;  // written by the kernels' threads (atomic stores)
    for (const CpuGroups::One& g : cpu_groups(list).groups) {
      const cpu::ScaleArgs args{sdk::cpu::plan_ref(g.plan), g.ptrs.data(), g.dtype, s,
                                found_inf ? &any_non_finite : nullptr};
      at::parallel_for(0, g.plan.num_chunks(), sdk::cpu::chunks_grain(g.plan), [&](std::int64_t b, std::int64_t e) {
        const sdk::cpu::FlushSubnormals flush;
        k.scale(args, b, e);
      });
    }
    if (any_non_finite != 0) *found_inf->data_ptr<float>() = 1.f;
    return;
  }
#if defined(AMPFUSE_WITH_CUDA)
  for_each_cuda_group(list.views, device, [&](const Group& g, const sdk::cuda::LaunchMeta& meta, sdk::cuda::Stream stream) {
    const bool f64 = scale.scalar_type() == c10::ScalarType::Double;
    cuda::scale(meta, g.dtype, f64 ? nullptr : scale.data_ptr<float>(), f64 ? scale.data_ptr<double>() : nullptr,
                found_inf ? found_inf->data_ptr<float>() : nullptr, stream);
  });
#endif
}

at::Tensor grad_factor_f64(const at::Tensor& inv_scale, const at::Tensor& clip_coef) {
  if (!inv_scale.defined()) return clip_coef.defined() ? clip_coef.to(at::kDouble) : at::Tensor();
  const at::Tensor factor = inv_scale.to(at::kDouble);
  return clip_coef.defined() ? factor.mul(clip_coef.to(at::kDouble)) : factor;
}

}  // namespace detail

namespace {

// Whether two entries of a checked list may share memory: the byte ranges
// their elements span (from the lowest to the highest element), compared by
// address, so that views of one storage and tensors made over one buffer
// alike are seen. Interleaved views (t[::2], t[1::2]) count as overlapping:
// a false alarm costs only the order below.
bool entries_may_overlap(at::TensorList tensors) {
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> ranges;
  ranges.reserve(tensors.size());
  for (const at::Tensor& t : tensors) {
    if (t.numel() == 0) continue;
    std::int64_t low = 0, high = 0;  // in elements, from data_ptr()
    for (std::int64_t d = 0; d < t.dim(); ++d) {
      const std::int64_t extent = (t.size(d) - 1) * t.stride(d);
      (extent < 0 ? low : high) += extent;
    }
    const auto base = reinterpret_cast<std::uintptr_t>(t.data_ptr());
    const auto item = static_cast<std::intptr_t>(t.element_size());
    ranges.emplace_back(base + static_cast<std::uintptr_t>(low * item), base + static_cast<std::uintptr_t>((high + 1) * item));
  }
  std::sort(ranges.begin(), ranges.end());
  for (std::size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) return true;
    ranges[i].second = std::max(ranges[i].second, ranges[i - 1].second);  // the furthest end so far
  }
  return false;
}

void scale_impl(const char* op, at::TensorList tensors, const at::Tensor& scale, const at::Tensor* found_inf) {
  const auto device = common_device(tensors);
  check_scalar(scale, op, "scale", device);
  if (found_inf) check_scalar(*found_inf, op, "found_inf", device);
  const detail::CheckedList list = detail::make_views(pointers(tensors), "tensors", op, /*in_place=*/true);
  if (!device) return;
  if (tensors.size() > 1 && entries_may_overlap(tensors)) {
    // Entries that share memory (the same tensor twice, overlapping views)
    // are updated one after the other, in list order, as ATen's foreach ops
    // update them on CPU: updated together, two threads would read and
    // write the same elements, and a view with gaps staged twice would keep
    // one update of the two. Each entry is staged and written back in turn.
    for (const at::Tensor& t : tensors) {
      const detail::CheckedList one = detail::make_views({&t}, "tensors", op, /*in_place=*/true);
      detail::scale(one, *device, scale, found_inf);
      one.write_back();
    }
    return;
  }
  detail::scale(list, *device, scale, found_inf);
  list.write_back();
}

}  // namespace

void scale_(at::TensorList tensors, const at::Tensor& scale) {
  scale_impl("ampfuse::scale_", tensors, scale, nullptr);
  // As mul_ would: autograd then sees a tensor it saved changed in place
  // (an inference tensor has no version counter; mul_ keeps it as it is).
  for (const at::Tensor& t : tensors)
    if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
}

void unscale_(at::TensorList tensors, const at::Tensor& found_inf, const at::Tensor& inv_scale) {
  scale_impl("ampfuse::unscale_", tensors, inv_scale, &found_inf);
}

}  // namespace ampfuse
