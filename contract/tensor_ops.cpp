// Torch adapter of the multi-tensor engine: validates at::Tensors, groups them
// by dtype, turns them into views and runs the CPU or CUDA kernels.

#include "ampfuse/tensor_ops.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <array>
#include <cstring>

#include "contract/cpu/kernels.h"
#include "contract/meta_cache.h"

#if defined(AMPFUSE_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "contract/cuda/launch.h"
#endif

namespace ampfuse {

ScalarType to_scalar_type(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return ScalarType::Float32;
    case c10::ScalarType::Half: return ScalarType::Float16;
    case c10::ScalarType::BFloat16: return ScalarType::BFloat16;
    default:
      TORCH_CHECK(false, "ampfuse: dtype ", t, " is not supported (expected Float, Half or BFloat16)");
  }
}

std::string cpu_isa() { return cpu::kernels().isa; }

std::int64_t cpu_chunk_size() { return cpu::kChunkSize; }

namespace {

bool supported_dtype(c10::ScalarType t) {
  return t == c10::ScalarType::Float || t == c10::ScalarType::Half || t == c10::ScalarType::BFloat16;
}

void check_tensor(const at::Tensor& t, const char* op, const std::string& name, std::size_t i,
                  const c10::optional<c10::Device>& device) {
  TORCH_CHECK(t.defined(), op, ": ", name, "[", i, "] is undefined");
  TORCH_CHECK(t.layout() == c10::kStrided, op, ": ", name, "[", i, "] has layout ", t.layout(),
              "; only dense (strided) tensors are supported");
  TORCH_CHECK(supported_dtype(t.scalar_type()), op, ": ", name, "[", i, "] has dtype ", t.scalar_type(),
              ", which is not supported (expected Float, Half or BFloat16)");
  TORCH_CHECK(!device || t.device() == *device, op, ": ", name, "[", i, "] is on ", t.device(),
              " but ", name, "[0] is on ", *device, "; one list must be on one device");
  TORCH_CHECK(t.is_non_overlapping_and_dense(), op, ": ", name, "[", i,
              "] is not dense (a strided view with gaps or overlaps); ampfuse works in place on tensors whose "
              "elements fill one block of memory");
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
              allow_double ? "float32 or float64" : "float32", " tensor of one element, got ", s.scalar_type(),
              " with ", s.numel(), " elements");
  TORCH_CHECK(!device || s.device() == *device, op, ": ", name, " is on ", s.device(), " but the tensors are on ",
              *device);
}

c10::optional<c10::Device> common_device(at::TensorList tensors) {
  if (tensors.empty() || !tensors[0].defined()) return c10::nullopt;
  return tensors[0].device();
}

/// Tensor indices of each dtype, in the order Float32, Float16, BFloat16.
std::array<std::vector<std::int64_t>, 3> group_by_dtype(const TensorListsView& views) {
  std::array<std::vector<std::int64_t>, 3> groups;
  for (std::int64_t t = 0; t < views.num_tensors(); ++t)
    groups[static_cast<int>(views.lists[0][t].dtype)].push_back(t);
  return groups;
}

/// One dtype group of a depth-1 list: its view and plan.
struct Group {
  ScalarType dtype;
  TensorListsView view;
  Plan plan;
};

std::vector<Group> make_groups(const TensorListsView& views, std::int64_t chunk_size) {
  std::vector<Group> out;
  const auto groups = group_by_dtype(views);
  for (std::size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].empty()) continue;
    Group group{static_cast<ScalarType>(g), {}, {}};
    group.view.lists.resize(1);
    std::vector<std::int64_t> numels;
    for (std::int64_t t : groups[g]) {
      group.view.lists[0].push_back(views.lists[0][t]);
      numels.push_back(views.lists[0][t].numel);
    }
    group.plan = Plan(numels, chunk_size);
    if (group.plan.num_chunks() > 0) out.push_back(std::move(group));
  }
  return out;
}

std::vector<void*> data_pointers(const TensorListsView& view) {
  std::vector<void*> ptrs;
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
  for (const Group& g : make_groups(views, cuda::kChunkSize)) {
    std::vector<std::int64_t> words;
    launch(g, detail::make_launch_meta(g.view, g.plan, device, words), stream);
  }
}
#endif

}  // namespace

TensorListsView make_list_views(const std::vector<at::TensorList>& lists, const std::vector<std::string>& names,
                                const char* op) {
  TORCH_CHECK(lists.size() == names.size(), op, ": internal error: ", lists.size(), " lists but ", names.size(),
              " names");
  TensorListsView views;
  if (lists.empty()) return views;
  const c10::optional<c10::Device> device = common_device(lists[0]);
  for (std::size_t l = 0; l < lists.size(); ++l) {
    TORCH_CHECK(lists[l].size() == lists[0].size(), op, ": ", names[l], " has ", lists[l].size(), " tensors but ",
                names[0], " has ", lists[0].size());
    for (std::size_t i = 0; i < lists[l].size(); ++i) {
      const at::Tensor& t = lists[l][i];
      check_tensor(t, op, names[l], i, device);
      TORCH_CHECK(t.sizes() == lists[0][i].sizes(), op, ": ", names[l], "[", i, "] has shape ", t.sizes(), " but ",
                  names[0], "[", i, "] has shape ", lists[0][i].sizes());
      TORCH_CHECK(t.strides() == lists[0][i].strides(), op, ": ", names[l], "[", i, "] has strides ", t.strides(),
                  " but ", names[0], "[", i, "] has strides ", lists[0][i].strides(),
                  "; tensors updated together must share one memory layout");
    }
  }
  views.lists.resize(lists.size());
  for (std::size_t l = 0; l < lists.size(); ++l)
    for (const at::Tensor& t : lists[l])
      views.lists[l].push_back({t.data_ptr(), t.numel(), to_scalar_type(t.scalar_type())});
  return views;
}

void check_non_finite(at::TensorList tensors, const at::Tensor& found_inf, const c10::optional<at::Tensor>& sum_sq) {
  constexpr const char* op = "ampfuse::check_non_finite";
  const auto device = common_device(tensors);
  check_scalar(found_inf, op, "found_inf", device);
  if (sum_sq) check_scalar(*sum_sq, op, "sum_sq", device, /*allow_double=*/true);
  const TensorListsView views = make_list_views({tensors}, {"tensors"}, op);
  if (!device) return;

  if (device->is_cpu()) {
    const cpu::Kernels& k = cpu::kernels();
    bool any_non_finite = false;
    double total = 0.0;
    for (const Group& g : make_groups(views, cpu::kChunkSize)) {
      const std::vector<void*> ptrs = data_pointers(g.view);
      const std::int64_t num_chunks = g.plan.num_chunks();
      std::vector<unsigned char> chunk_non_finite(static_cast<std::size_t>(num_chunks));
      std::vector<double> chunk_sum_sq(sum_sq ? static_cast<std::size_t>(num_chunks) : 0);
      const cpu::CheckArgs args{cpu::plan_ref(g.plan), ptrs.data(), g.dtype, chunk_non_finite.data(),
                                sum_sq ? chunk_sum_sq.data() : nullptr};
      at::parallel_for(0, num_chunks, 1, [&](std::int64_t b, std::int64_t e) { k.check(args, b, e); });
      for (unsigned char f : chunk_non_finite) any_non_finite |= f != 0;
      for (double s : chunk_sum_sq) total += s;
    }
    if (any_non_finite) *found_inf.data_ptr<float>() = 1.f;
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
  for_each_cuda_group(views, *device, [&](const Group& g, const cuda::LaunchMeta& meta, cuda::Stream stream) {
    at::Tensor workspace;
    if (sum_sq)
      workspace = at::empty({static_cast<std::int64_t>(cuda::check_workspace_bytes(meta.num_chunks))},
                            found_inf.options().dtype(at::kByte));
    cuda::SumSq out{};
    if (sum_sq && sum_sq->scalar_type() == c10::ScalarType::Double) out.f64 = sum_sq->data_ptr<double>();
    else if (sum_sq) out.f32 = sum_sq->data_ptr<float>();
    cuda::check_non_finite(meta, g.dtype, found_inf.data_ptr<float>(), out, sum_sq ? workspace.data_ptr() : nullptr,
                           stream);
  });
#endif
}

namespace {

void scale_impl(const char* op, at::TensorList tensors, const at::Tensor& scale, const at::Tensor* found_inf) {
  const auto device = common_device(tensors);
  check_scalar(scale, op, "scale", device);
  if (found_inf) check_scalar(*found_inf, op, "found_inf", device);
  const TensorListsView views = make_list_views({tensors}, {"tensors"}, op);
  if (!device) return;

  if (device->is_cpu()) {
    const cpu::Kernels& k = cpu::kernels();
    const float s = *scale.data_ptr<float>();
    bool any_non_finite = false;
    for (const Group& g : make_groups(views, cpu::kChunkSize)) {
      const std::vector<void*> ptrs = data_pointers(g.view);
      std::vector<unsigned char> chunk_non_finite(found_inf ? static_cast<std::size_t>(g.plan.num_chunks()) : 0);
      const cpu::ScaleArgs args{cpu::plan_ref(g.plan), ptrs.data(), g.dtype, s,
                                found_inf ? chunk_non_finite.data() : nullptr};
      at::parallel_for(0, g.plan.num_chunks(), 1, [&](std::int64_t b, std::int64_t e) { k.scale(args, b, e); });
      for (unsigned char f : chunk_non_finite) any_non_finite |= f != 0;
    }
    if (any_non_finite) *found_inf->data_ptr<float>() = 1.f;
    return;
  }
#if defined(AMPFUSE_WITH_CUDA)
  for_each_cuda_group(views, *device, [&](const Group& g, const cuda::LaunchMeta& meta, cuda::Stream stream) {
    cuda::scale(meta, g.dtype, scale.data_ptr<float>(), found_inf ? found_inf->data_ptr<float>() : nullptr, stream);
  });
#endif
}

}  // namespace

void scale_(at::TensorList tensors, const at::Tensor& scale) { scale_impl("ampfuse::scale_", tensors, scale, nullptr); }

void unscale_(at::TensorList tensors, const at::Tensor& found_inf, const at::Tensor& inv_scale) {
  scale_impl("ampfuse::unscale_", tensors, inv_scale, &found_inf);
}

}  // namespace ampfuse
