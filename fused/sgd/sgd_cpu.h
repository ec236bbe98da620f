#pragma once
// CPU kernels of FusedSGD, one per instruction set. Raw pointers only.

#include <cstdint>

#include "contract/cpu/kernels.h"
#include "fused/sgd/sgd_math.h"

namespace ampfuse::fused::cpu {

struct SgdArgs {
  sdk::cpu::PlanRef plan;
  void* const* param;  ///< by tensor index
  void* const* grad;
  void* const* momentum_buffer;  ///< null when momentum is 0
  const unsigned char* first;    ///< by tensor index: 1 when this step creates the buffer
  ScalarType dtype;
  SgdHyper hyper;      ///< in fp64 (the kernel rounds it to its opmath)
  double grad_factor;  ///< inv_scale * clip_coef, exact
};

using SgdFn = void (*)(const SgdArgs&, std::int64_t chunk_begin, std::int64_t chunk_end);

/// The kernel's build for `isa`: sdk::cpu::isa_for(plan) per launch, or
/// current_isa() by default.
SgdFn sgd_kernel(sdk::cpu::Isa isa = sdk::cpu::current_isa());

namespace avx512 { extern const SgdFn kSgd; }
namespace avx2 { extern const SgdFn kSgd; }
namespace baseline { extern const SgdFn kSgd; }

}  // namespace ampfuse::fused::cpu
