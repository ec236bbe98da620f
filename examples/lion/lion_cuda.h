#pragma once
// Lion's CUDA launcher (lion_cuda.cu). No LibTorch here.

#include <ampfuse/multi_tensor.h>  // ampfuse::ScalarType
#include <ampfuse/sdk/cuda.h>      // LaunchMeta, Stream

#include "lion_math.h"

namespace lion::cuda {

/// The lists of the launch metadata, in this order.
enum LionList : int { kParam = 0, kGrad = 1, kExpAvg = 2, kDepth = 3 };

struct LionCudaArgs {
  LionHyper hyper;
  const float* found_inf;  ///< on the device: skip the step when != 0; null: never skip
  const float* inv_scale;  ///< on the device: multiply grads by it; null: 1
  const float* clip_coef;  ///< on the device: and by it; null: 1
};

/// One launch over every chunk of the list; writes nothing when *found_inf != 0.
void lion_step(const ampfuse::sdk::cuda::LaunchMeta& meta, ampfuse::ScalarType dtype, const LionCudaArgs& args,
               ampfuse::sdk::cuda::Stream stream);

}  // namespace lion::cuda
