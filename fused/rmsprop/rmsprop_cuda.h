#pragma once
// FusedRMSprop's CUDA launcher. No LibTorch here.

#include "contract/cuda/launch.h"
#include "fused/rmsprop/rmsprop_math.h"

namespace ampfuse::fused::cuda {

struct RmspropCudaArgs {
  RmspropHyper hyper;
  const float* found_inf;  ///< skip when != 0; null: never skip
  const float* inv_scale;  ///< null: 1
  const float* clip_coef;  ///< null: 1
};

/// One launch over every chunk of every tensor (lists in RmspropList order):
/// skips on found_inf (writing nothing), else updates param and state with
/// g * inv_scale * clip_coef.
void rmsprop(const sdk::cuda::LaunchMeta& meta, ScalarType dtype, const RmspropCudaArgs& args,
             sdk::cuda::Stream stream);

}  // namespace ampfuse::fused::cuda
