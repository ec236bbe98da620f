#pragma once
// ampfuse's CUDA kernels use the SDK's device building blocks, as a
// third-party optimizer's kernels do.

#include "ampfuse/sdk/cuda_kernel.cuh"
#include "contract/cuda/launch.h"

namespace ampfuse::cuda::detail {
using namespace ::ampfuse::sdk::cuda;
}  // namespace ampfuse::cuda::detail
