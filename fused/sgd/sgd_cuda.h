#pragma once
// FusedSGD's CUDA launcher. No LibTorch here.

#include "contract/cuda/launch.h"
#include "fused/sgd/sgd_math.h"

namespace ampfuse::fused::cuda {

/// Lists of the launch metadata, in this order (the last two only with momentum).
enum SgdList : int { kSgdParam = 0, kSgdGrad = 1, kSgdMomentumBuffer = 2, kSgdInitialized = 3 };

struct SgdCudaArgs {
  SgdHyper hyper;
  const float* found_inf;  ///< skip when != 0; null: never skip
  const float* inv_scale;  ///< null: 1
  const float* clip_coef;  ///< null: 1
  unsigned* counters;      ///< one per tensor, zero between launches (momentum only)
};

/// One launch: skips on found_inf (writing nothing), else updates param and
/// momentum buffer. A buffer whose fp32 flag (list kSgdInitialized) is 0 is
/// created by this step as a copy of the gradient, and the flag set to 1 once
/// every block of the tensor has read it: a skipped first step leaves no
/// buffer contents behind (PyTorch's fused SGD leaves uninitialized memory).
void sgd(const sdk::cuda::LaunchMeta& meta, ScalarType dtype, const SgdCudaArgs& args,
         sdk::cuda::Stream stream);

}  // namespace ampfuse::fused::cuda
