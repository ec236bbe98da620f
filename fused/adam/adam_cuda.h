#pragma once
// FusedAdam's CUDA launcher. No LibTorch here.

#include "contract/cuda/launch.h"
#include "fused/adam/adam_math.h"

namespace ampfuse::fused::cuda {


struct AdamCudaArgs {
  ScalarType state_dtype;      ///< of the moments (the param's, fp32 with master weights, or bf16)
  bool master;                 ///< update an fp32 master copy (list AdamList::kMaster), write it back rounded
  AdamHyper hyper;
  double lr, beta1, beta2;     ///< for the bias corrections, from each tensor's device step
  double weight_decay;         ///< for AdamW's decay factor when lr comes from the device
  const double* lr_device;     ///< capturable: lr read here (overrides lr and hyper.lr); null: lr
  const float* found_inf;      ///< skip when != 0; null: never skip
  const float* inv_scale;      ///< null: 1
  const float* clip_coef;      ///< null: 1
  unsigned* counters;          ///< one per tensor of the launch, zero between launches
};

/// One launch over every chunk of every tensor: skips on found_inf (writing
/// nothing), else updates param and state with g * inv_scale * clip_coef and
/// advances each tensor's fp64 step counter (list AdamList::kStep) by one, after every
/// block of that tensor has read it (ticket in `counters`).
/// dtype: of param and grad.
void adam(const sdk::cuda::LaunchMeta& meta, ScalarType dtype, const AdamCudaArgs& args,
          sdk::cuda::Stream stream);

}  // namespace ampfuse::fused::cuda
