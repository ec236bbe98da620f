#pragma once
// Lion's CPU kernel: one function per instruction set, built from
// lion_cpu.inc by ampfuse_add_cpu_kernel. Raw pointers only, no LibTorch.

#include <ampfuse/multi_tensor.h>  // ampfuse::ScalarType
#include <ampfuse/sdk/cpu.h>       // PlanRef

#include <cstdint>

#include "lion_math.h"

namespace lion::cpu {

struct LionCpuArgs {
  ampfuse::sdk::cpu::PlanRef plan;
  void* const* param;  ///< by tensor index in the list
  void* const* grad;
  void* const* exp_avg;
  ampfuse::ScalarType dtype;  ///< of all three lists
  LionHyper hyper;
  double grad_factor;  ///< inv_scale * clip_coef (1 without a scaler), as sdk::cpu_grad_factor gives it
};

/// Updates chunks [chunk_begin, chunk_end) of args.plan.
using LionFn = void (*)(const LionCpuArgs& args, std::int64_t chunk_begin, std::int64_t chunk_end);

namespace avx512 { extern const LionFn kLion; }
namespace avx2 { extern const LionFn kLion; }
namespace baseline { extern const LionFn kLion; }

}  // namespace lion::cpu
