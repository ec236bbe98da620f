#pragma once
// CPU kernels of FusedAdagrad, one per instruction set. Raw pointers only.

#include <cstdint>

#include "ampfuse/sdk/cpu.h"
#include "fused/adagrad/adagrad_math.h"

namespace ampfuse::fused::cpu {

struct AdagradArgs {
  sdk::cpu::PlanRef plan;
  void* const* param;  ///< by tensor index
  void* const* grad;
  void* const* sum;
  const double* neg_clr;  ///< by tensor index: -clr of the step being taken (fp64; the kernel rounds it)
  ScalarType dtype;       ///< of param, grad and sum
  AdagradHyper hyper;     ///< in fp64, likewise
  double grad_factor;     ///< inv_scale * clip_coef, exact
};

using AdagradFn = void (*)(const AdagradArgs&, std::int64_t chunk_begin, std::int64_t chunk_end);

/// The kernel's build for `isa`: sdk::cpu::isa_for(plan) per launch, or
/// current_isa() by default.
AdagradFn adagrad_kernel(sdk::cpu::Isa isa = sdk::cpu::current_isa());

namespace avx512 { extern const AdagradFn kAdagrad; }
namespace avx2 { extern const AdagradFn kAdagrad; }
namespace baseline { extern const AdagradFn kAdagrad; }

}  // namespace ampfuse::fused::cpu
