#pragma once
// Device copies of CUDA launch metadata too large for kernel arguments.
// Uploaded once per distinct list and reused while the list is unchanged (its
// pointers and sizes compared each step), so a training loop pays the upload
// on its first step only, and a step captured in a CUDA graph after a warm-up
// step contains no host-to-device copy.

#include <c10/core/Device.h>

#include <cstdint>
#include <vector>

#include "ampfuse/sdk/optimizer.h"
#include "contract/cuda/launch.h"

namespace ampfuse::detail {

/// Device pointer to `words` on `device`: cached per device, or uploaded
/// (without a host sync) on the current stream. Another stream that uses an
/// entry waits for the upload on the device (an event) and is recorded on
/// the memory, so an evicted entry is not reused while it may still read it.
/// Under CUDA graph capture nothing is uploaded: an entry must exist (made
/// by an eager warm-up step, finished before the capture), else this throws.
/// Valid as long as the entry stays in the cache, which holds the 32 most
/// recently used lists, and for the life of the process every entry a CUDA
/// graph captured (a replay reads it, however many other lists ran since).
/// The returned tensor holds the memory: a caller that launches later (after
/// other lists were prepared, which may evict the entry) keeps it until then.
/// `kept`: the copy of these words that the caller kept from an earlier
/// step (undefined if none); under capture, where the cache has evicted the
/// entry since (more than 32 other lists uploaded after the warm-up), that
/// copy is taken back into the cache as captured instead of refused.
at::Tensor device_meta(const std::vector<std::int64_t>& words, c10::Device device, const at::Tensor& kept = {});

/// Launch metadata of `views` over `plan`: packed into out.words and, when
/// too long for kernel arguments (or for the driver's), on the device through
/// device_meta(), held in out.on_device. out.launch points into both.
void make_launch_meta(const TensorListsView& views, const Plan& plan, c10::Device device, sdk::ListMeta& out);

/// Number of uploads so far (for tests and benchmarks).
std::int64_t device_meta_uploads();

}  // namespace ampfuse::detail
