#pragma once
// CPU kernels of FusedLAMB, one per instruction set (see
// ampfuse/sdk/cpu_kernel.h). Raw pointers only. State is fp32, fp64 for fp64
// parameters.

#include <cstdint>

#include "ampfuse/sdk/cpu.h"
#include "fused/lamb/lamb_math.h"

namespace ampfuse::fused::cpu {

struct LambArgs {
  sdk::cpu::PlanRef plan;
  // By the caller's tensor index.
  void* const* param;
  void* const* grad;
  void* const* exp_avg;
  void* const* exp_avg_sq;
  void* const* master;             ///< fp32 master copies, or null (then param is updated directly)
  ScalarType dtype;                ///< of param and grad
  const LambStepScalars* scalars;  ///< by tensor index, in fp64 (the kernels round them to their opmath)
  LambHyper hyper;                 ///< in fp64, likewise
  double grad_factor;              ///< inv_scale * clip_coef * the max_grad_norm factor, in the opmath
  double* chunk_param_sq;          ///< pass 1 out, by chunk: sum of p^2 (fp64)
  double* chunk_update_sq;         ///< pass 1 out, by chunk: sum of u^2 (fp64)
  const double* neg_step;          ///< pass 2 in, by tensor index: -(lr * trust ratio), in the opmath
};

using LambFn = void (*)(const LambArgs&, std::int64_t chunk_begin, std::int64_t chunk_end);

/// Pass 1: m and v updated, per-chunk sums of squares of p and u.
LambFn lamb_moments_kernel();
/// Pass 2: p updated with u recomputed from the new m and v.
LambFn lamb_apply_kernel();

namespace avx512 { extern const LambFn kLambMoments, kLambApply; }
namespace avx2 { extern const LambFn kLambMoments, kLambApply; }
namespace baseline { extern const LambFn kLambMoments, kLambApply; }

}  // namespace ampfuse::fused::cpu
