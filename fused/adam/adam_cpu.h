#pragma once
// CPU kernels of FusedAdam / FusedAdamW, one per instruction set (see
// contract/cpu/kernels.h for the scheme). Raw pointers only.

#include <cstdint>

#include "contract/cpu/kernels.h"
#include "fused/adam/adam_math.h"

namespace ampfuse::fused::cpu {

struct AdamArgs {
  sdk::cpu::PlanRef plan;
  // By the caller's tensor index; max_exp_avg_sq is null unless amsgrad.
  void* const* param;
  void* const* grad;
  void* const* exp_avg;
  void* const* exp_avg_sq;
  void* const* max_exp_avg_sq;
  void* const* master;             ///< fp32 master copies, or null (then param is updated directly)
  ScalarType dtype;                ///< of param and grad
  ScalarType state_dtype;          ///< of exp_avg, exp_avg_sq, max_exp_avg_sq (Float64 with Float64 params)
  const AdamStepScalars* scalars;  ///< by tensor index, in fp64 (the kernel rounds them to its opmath)
  AdamHyper hyper;                 ///< in fp64, likewise
  double grad_factor;              ///< inv_scale * clip_coef (1 when unscaled and unclipped), exact
};

using AdamFn = void (*)(const AdamArgs&, std::int64_t chunk_begin, std::int64_t chunk_end);

/// The kernel's build for `isa`: sdk::cpu::isa_for(plan) per launch, or
/// current_isa() by default.
AdamFn adam_kernel(sdk::cpu::Isa isa = sdk::cpu::current_isa());

namespace avx512 { extern const AdamFn kAdam; }
namespace avx2 { extern const AdamFn kAdam; }
namespace baseline { extern const AdamFn kAdam; }

}  // namespace ampfuse::fused::cpu
