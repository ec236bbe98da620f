#pragma once
// FusedLAMB's CUDA launchers. No LibTorch here.

#include "ampfuse/sdk/cuda.h"
#include "fused/lamb/lamb_math.h"

namespace ampfuse::fused::cuda {

// The launch metadata's lists are LambList's (fused/lamb/lamb_math.h). State is
// fp32 (fp64 for fp64 params); step counters fp64.

struct LambCudaArgs {
  bool master;               ///< update an fp32 master copy (list LambList::kMaster), write it back rounded
  LambHyper hyper;
  const float* found_inf;    ///< skip when != 0; null: never skip
  const float* inv_scale;    ///< null: 1
  const float* clip_coef;    ///< null: 1
  const double* grad_sum_sq; ///< sum of squares of the (scaled) grads of the whole optimizer, for max_grad_norm; null: no clipping
  double* chunk_sums;        ///< workspace, 2 per chunk
  double* norms;             ///< workspace, 2 per tensor of the launch: ||p||, ||u||
  unsigned* counters;        ///< one per tensor of the launch, zero between launches
};

/// Two launches over every chunk of every tensor, both returning before any
/// write when *found_inf != 0. The first updates m and v and reduces ||p||
/// and ||u|| per tensor (CUB block sums, then the tensor's last block adds
/// the chunks' sums in chunk order: deterministic). The second recomputes u,
/// applies the trust ratio and advances each tensor's step counter once.
/// dtype: of param and grad.
void lamb(const sdk::cuda::LaunchMeta& meta, ScalarType dtype, const LambCudaArgs& args, sdk::cuda::Stream stream);

}  // namespace ampfuse::fused::cuda
