#pragma once
// CPU kernels of FusedRMSprop, one per instruction set. Raw pointers only.

#include <cstdint>

#include "ampfuse/sdk/cpu.h"
#include "fused/rmsprop/rmsprop_math.h"

namespace ampfuse::fused::cpu {

struct RmspropArgs {
  sdk::cpu::PlanRef plan;
  void* const* lists[kRmspropLists];  ///< by RmspropList, each by tensor index (null when unused)
  ScalarType dtype;                   ///< of param, grad and state
  RmspropHyper hyper;  ///< in fp64 (the kernel rounds it to its opmath)
  double grad_factor;  ///< inv_scale * clip_coef, exact
};

using RmspropFn = void (*)(const RmspropArgs&, std::int64_t chunk_begin, std::int64_t chunk_end);

/// The kernel's build for `isa`: sdk::cpu::isa_for(plan) per launch, or
/// current_isa() by default.
RmspropFn rmsprop_kernel(sdk::cpu::Isa isa = sdk::cpu::current_isa());

namespace avx512 { extern const RmspropFn kRmsprop; }
namespace avx2 { extern const RmspropFn kRmsprop; }
namespace baseline { extern const RmspropFn kRmsprop; }

}  // namespace ampfuse::fused::cpu
