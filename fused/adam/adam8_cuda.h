#pragma once
// FusedAdam's moments_8bit on CUDA: the launcher. No LibTorch here.

#include "contract/cuda/launch.h"
#include "fused/adam/adam8_math.h"

namespace ampfuse::fused::cuda {

/// The lists of the 8-bit launch (the CPU kernel's, and the device step counters last).
enum class Adam8List : int { kParam, kGrad, kMaster, kExpAvg, kExpAvgAbsmax, kExpAvgSq, kExpAvgSqAbsmax, kStep };
constexpr int kAdam8Lists = 8;

struct Adam8CudaArgs {
  bool master;                 ///< update an fp32 master copy (list kMaster), write it back rounded
  AdamHyper hyper;             ///< amsgrad false
  double lr, beta1, beta2;     ///< for the bias corrections, from each tensor's device step
  double weight_decay;         ///< for AdamW's decay factor when lr comes from the device
  const double* lr_device;     ///< capturable: lr read here; null: lr
  const float* found_inf;      ///< skip when != 0; null: never skip
  const float* inv_scale;      ///< null: 1
  const float* clip_coef;      ///< null: 1
  unsigned* counters;          ///< one per tensor of the launch, zero between launches
};

/// One launch over the coded tensors of a list, planned in chunks of
/// kQuantBlock elements: one block of kQuantBlock threads per quantization
/// block, one element per thread (decode, update, store the parameter;
/// the block's absmax by a block reduction; code). Skips on found_inf
/// (writing nothing); advances each tensor's fp64 step counter once, after
/// every block of that tensor read it. dtype: of param and grad (not Float64).
void adam8(const sdk::cuda::LaunchMeta& meta, ScalarType dtype, const Adam8CudaArgs& args, sdk::cuda::Stream stream);

}  // namespace ampfuse::fused::cuda
