#pragma once
// FusedAdagrad's CUDA launcher. No LibTorch here.

#include "contract/cuda/launch.h"
#include "fused/adagrad/adagrad_math.h"

namespace ampfuse::fused::cuda {

struct AdagradCudaArgs {
  AdagradHyper hyper;
  const float* found_inf;  ///< skip when != 0; null: never skip
  const float* inv_scale;  ///< null: 1
  const float* clip_coef;  ///< null: 1
};

/// One launch over every chunk of every tensor (lists in AdagradList order):
/// skips on found_inf (writing nothing), else updates param and sum with
/// g * inv_scale * clip_coef and -clr from each tensor's device step counter
/// (the count before this step; the adapter advances it after the launch).
void adagrad(const sdk::cuda::LaunchMeta& meta, ScalarType dtype, const AdagradCudaArgs& args,
             sdk::cuda::Stream stream);

}  // namespace ampfuse::fused::cuda
