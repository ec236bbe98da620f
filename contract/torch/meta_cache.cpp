#include "contract/torch/meta_cache.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <iterator>
#include <list>
#include <mutex>

namespace ampfuse::detail {
namespace {

struct Entry {
  c10::Device device;
  c10::StreamId stream;  // the stream the upload was ordered on
  std::vector<std::int64_t> words;
  at::Tensor on_device;
  c10::cuda::CUDAEvent uploaded;  // recorded on `stream` after the upload
  bool captured = false;          // a CUDA graph holds the pointer: never evicted
};

// Small LRU: a training loop has a few lists (grads of each optimizer, each
// param group); 32 covers them without holding stale copies for long.
// Entries that a CUDA graph captured are kept beyond it, for as long as the
// process runs: a replay reads them.
constexpr std::size_t kCapacity = 32;
// Never destroyed: at exit the CUDA runtime may be unloaded before static
// destructors run, and ~CUDAEvent's device guard then throws ("driver
// shutting down"), which terminates the process. The process's end frees it.
std::mutex g_mutex;
std::list<Entry>& g_entries = *new std::list<Entry>();
std::int64_t g_uploads = 0;

// InlineMeta is about 32 KB of kernel arguments whatever the list's length,
// which a driver older than CUDA 12.1 refuses (its limit is 4 KB): there,
// every list's metadata goes to the device instead.
bool large_kernel_arguments() {
  static const bool supported = [] {
    int version = 0;
    return cudaDriverGetVersion(&version) == cudaSuccess && version >= 12010;
  }();
  return supported;
}

}  // namespace

at::Tensor device_meta(const std::vector<std::int64_t>& words, c10::Device device, const at::Tensor& kept) {
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device.index());
  const bool capturing = c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
  std::lock_guard<std::mutex> lock(g_mutex);
  for (auto it = g_entries.begin(); it != g_entries.end(); ++it) {
    if (it->device != device || it->words != words) continue;
    if (it->stream != current.id()) {
      // Uploaded on another stream (a graph is captured on a side stream):
      // usable once the upload is done. Eagerly, this stream waits for it on
      // the device; under capture it must be done already (no wait on an
      // event from outside the graph), which a synchronize after the
      // warm-up step guarantees.
      if (capturing) {
        // cudaEventQuery is refused in the global capture mode PyTorch
        // captures in (and would invalidate the capture); the event is from
        // outside the graph, so querying it is safe in relaxed mode.
        bool done = false;
        {
          const c10::cuda::CUDAStreamCaptureModeGuard relaxed{cudaStreamCaptureModeRelaxed};
          done = it->uploaded.query();
        }
        TORCH_CHECK(done, "ampfuse: launch metadata uploaded on another stream is still in flight; "
                          "synchronize after the warm-up step, before capturing a CUDA graph");
      } else {
        it->uploaded.block(current);
        it->on_device.record_stream(current.unwrap());  // not reused while this stream may read it
      }
    }
    if (capturing) it->captured = true;
    g_entries.splice(g_entries.begin(), g_entries, it);
    return g_entries.front().on_device;
  }
  // The caller's copy from an eager step, evicted from the cache since: a
  // graph may hold it (finished, as the warm-up's synchronize guarantees;
  // its event is not recorded, so a later lookup from another stream does
  // not wait for it).
  if (capturing && kept.defined()) {
    g_entries.push_front(Entry{device, current.id(), words, kept, c10::cuda::CUDAEvent()});
    g_entries.front().captured = true;
    return kept;
  }
  // An upload inside a capture would cache graph-pool memory that only a
  // replay fills: refuse it, and ask for the warm-up step that uploads eagerly.
  TORCH_CHECK(!capturing, "ampfuse: a list of ", words.size(), " metadata words is too long for kernel arguments and "
              "is not on the device yet; run one step outside the CUDA graph capture (a warm-up step) first");
  const auto n = static_cast<std::int64_t>(words.size());
  at::Tensor host = at::empty({n}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::copy(words.begin(), words.end(), host.data_ptr<std::int64_t>());
  // Pinned source and non_blocking: the copy is ordered on the current
  // stream and the host buffer is kept until it completes.
  at::Tensor on_device = host.to(device, /*non_blocking=*/true);
  g_entries.push_front(Entry{device, current.id(), words, on_device, c10::cuda::CUDAEvent()});
  g_entries.front().uploaded.record(current);
  std::size_t evictable = 0;
  for (const Entry& e : g_entries) evictable += e.captured ? 0 : 1;
  if (evictable > kCapacity) {  // the least recently used entry no graph holds
    auto victim = std::find_if(g_entries.rbegin(), g_entries.rend(), [](const Entry& e) { return !e.captured; });
    g_entries.erase(std::next(victim).base());
  }
  ++g_uploads;
  return on_device;
}

void make_launch_meta(const TensorListsView& views, const Plan& plan, c10::Device device, sdk::ListMeta& out) {
  // Runs are walked by the CPU executor only: a CUDA kernel's chunks begin at element 0 of each slot.
  TORCH_INTERNAL_ASSERT(plan.begins().empty(), "make_launch_meta: a Plan of runs (CPU kernels only)");
  out.words = sdk::cuda::pack_meta(views, plan);
  sdk::cuda::LaunchMeta& m = out.launch;
  m.depth = views.depth();
  m.num_tensors = static_cast<std::int64_t>(plan.tensors().size());
  m.chunk_size = plan.chunk_size();
  m.num_chunks = plan.num_chunks();
  m.host = out.words.data();
  m.device = nullptr;
  out.on_device = at::Tensor();
  if (!large_kernel_arguments() || m.num_tensors > sdk::cuda::inline_capacity(m.depth)) {
    out.on_device = device_meta(out.words, device);
    m.device = out.on_device.data_ptr<std::int64_t>();
  }
}

std::int64_t device_meta_uploads() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_uploads;
}

}  // namespace ampfuse::detail
