#pragma once
// CUDA side of the SDK, host part: the launch metadata a CUDA kernel of the
// multi-tensor engine receives. Torch-free, so a launcher in a .cu file can
// include it; the torch adapter builds a LaunchMeta with
// ampfuse::sdk::make_launch_meta (ampfuse/sdk/optimizer.h) and hands it, with
// raw pointers and a stream, to the launcher, which uses
// ampfuse/sdk/cuda_kernel.cuh on the device side.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "ampfuse/multi_tensor.h"

struct CUstream_st;

namespace ampfuse::sdk::cuda {

using Stream = CUstream_st*;  // == cudaStream_t

/// Elements per CUDA block (one chunk per block).
constexpr std::int64_t kChunkSize = 64 * 1024;

/// Metadata of a list for one launch, packed as int64 words:
///   [data pointers: depth x num_tensors][numel: num_tensors][chunk offsets: num_tensors + 1]
/// over the non-empty tensors of the plan. `device` is the same words on the
/// device, or null when the list fits in kernel arguments (see inline_capacity).
struct LaunchMeta {
  int depth = 1;
  std::int64_t num_tensors = 0;
  std::int64_t chunk_size = kChunkSize;
  std::int64_t num_chunks = 0;
  const std::int64_t* host = nullptr;
  const std::int64_t* device = nullptr;
};

/// Packs `lists` (already grouped: one dtype per list) per `plan`.
std::vector<std::int64_t> pack_meta(const TensorListsView& lists, const Plan& plan);

/// Kernel arguments may take 32764 bytes since CUDA 12.1 (Volta and newer).
constexpr std::size_t kMaxKernelArgBytes = 32000;

/// Most tensors a list of this depth may hold and still travel in kernel
/// arguments (InlineMeta<depth>::kCapacity).
constexpr std::int64_t inline_capacity(int depth) {
  return static_cast<std::int64_t>((kMaxKernelArgBytes - 24) / (8 * static_cast<std::size_t>(depth) + 16));
}

}  // namespace ampfuse::sdk::cuda
