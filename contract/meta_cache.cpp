#include "contract/meta_cache.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <c10/cuda/CUDAStream.h>

#include <list>
#include <mutex>

namespace ampfuse::detail {
namespace {

struct Entry {
  c10::Device device;
  c10::StreamId stream;  // entries are per stream: an upload is ordered on its own stream only
  std::vector<std::int64_t> words;
  at::Tensor on_device;
};

// Small LRU: a training loop has a few lists (grads of each optimizer, each
// param group); 32 covers them without holding stale copies for long.
constexpr std::size_t kCapacity = 32;
std::mutex g_mutex;
std::list<Entry> g_entries;
std::int64_t g_uploads = 0;

}  // namespace

const std::int64_t* device_meta(const std::vector<std::int64_t>& words, c10::Device device) {
  const c10::StreamId stream = c10::cuda::getCurrentCUDAStream(device.index()).id();
  std::lock_guard<std::mutex> lock(g_mutex);
  for (auto it = g_entries.begin(); it != g_entries.end(); ++it) {
    if (it->device == device && it->stream == stream && it->words == words) {
      g_entries.splice(g_entries.begin(), g_entries, it);
      return g_entries.front().on_device.data_ptr<std::int64_t>();
    }
  }
  const auto n = static_cast<std::int64_t>(words.size());
  at::Tensor host = at::empty({n}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::copy(words.begin(), words.end(), host.data_ptr<std::int64_t>());
  // Pinned source and non_blocking: the copy is ordered on the current
  // stream and the host buffer is kept until it completes.
  at::Tensor on_device = host.to(device, /*non_blocking=*/true);
  g_entries.push_front({device, stream, words, on_device});
  if (g_entries.size() > kCapacity) g_entries.pop_back();
  ++g_uploads;
  return g_entries.front().on_device.data_ptr<std::int64_t>();
}

cuda::LaunchMeta make_launch_meta(const TensorListsView& views, const Plan& plan, c10::Device device,
                                  std::vector<std::int64_t>& words) {
  words = cuda::pack_meta(views, plan);
  cuda::LaunchMeta m;
  m.depth = views.depth();
  m.num_tensors = static_cast<std::int64_t>(plan.tensors().size());
  m.chunk_size = plan.chunk_size();
  m.num_chunks = plan.num_chunks();
  m.host = words.data();
  if (m.num_tensors > cuda::inline_capacity(m.depth)) m.device = device_meta(words, device);
  return m;
}

std::int64_t device_meta_uploads() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_uploads;
}

}  // namespace ampfuse::detail
