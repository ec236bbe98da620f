#pragma once
// CPU kernels of the multi-tensor engine, compiled once per instruction set
// (contract/cpu/kernels_<isa>.cpp) and chosen at run time. The per-ISA
// translation units see only raw pointers: no LibTorch, no std containers, so
// no inline function compiled for AVX-512 can leak into code that runs on a
// machine without it (the linker keeps one copy of each inline function).

#include <cstdint>
#include <string>
#include <vector>

#include "ampfuse/multi_tensor.h"
#include "ampfuse/sdk/cpu.h"

namespace ampfuse::cpu {

struct CheckArgs {
  sdk::cpu::PlanRef plan;
  void* const* data;  ///< by original tensor index
  ScalarType dtype;
  /// out: set to 1 (an atomic store) when a chunk holds inf or NaN, left alone otherwise
  unsigned char* non_finite;
  double* chunk_sum_sq;             ///< out, one per chunk, or null: sum of squares in fp64
};

struct ScaleArgs {
  sdk::cpu::PlanRef plan;
  void* const* data;
  ScalarType dtype;
  /// The scale tensor's value (fp32, or fp64 from the GradScaler), widened to fp64 on the caller's thread:
  /// widened inside a kernel (subnormals read as zero there) a scale below
  /// 2^-126 would read as 0, where ATen multiplies by its exact value (fp32
  /// lists: sdk::cpu::GradFactor; fp64 lists multiply by it in fp64).
  double scale;
  unsigned char* non_finite;  ///< out, or null: as in CheckArgs, of the values before scaling
};

using CheckFn = void (*)(const CheckArgs&, std::int64_t chunk_begin, std::int64_t chunk_end);
using ScaleFn = void (*)(const ScaleArgs&, std::int64_t chunk_begin, std::int64_t chunk_end);

struct Kernels {
  int vector_width;  ///< fp32 lanes per block
  CheckFn check;
  ScaleFn scale;
};

/// The engine's kernels for sdk::cpu::current_isa() (chosen by pick_isa).
const Kernels& kernels();
/// Names of the instruction sets compiled in and supported here, best first
/// (what sdk::cpu::force_isa accepts).
std::vector<std::string> available_isas();

namespace avx512 { extern const Kernels kKernels; }
namespace avx2 { extern const Kernels kKernels; }
namespace baseline { extern const Kernels kKernels; }

}  // namespace ampfuse::cpu
