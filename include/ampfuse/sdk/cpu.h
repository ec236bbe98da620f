#pragma once
// CPU side of the SDK, the part that does not depend on an instruction set:
// the flattened plan a CPU kernel walks, and the choice among the kernels an
// author compiled once per instruction set (ampfuse_add_cpu_kernel in CMake,
// ampfuse/sdk/cpu_kernel.h in the kernel file). No LibTorch here.
//
// A CPU kernel is a plain function
//   void my_kernel(const MyArgs& args, std::int64_t chunk_begin, std::int64_t chunk_end);
// that processes chunks [chunk_begin, chunk_end) of a Plan; the torch adapter
// runs it over all chunks with ampfuse::sdk::parallel_chunks
// (ampfuse/sdk/optimizer.h), so one parallel region covers a whole list.

#include <cstdint>

#include "ampfuse/multi_tensor.h"

namespace ampfuse::sdk::cpu {

/// A Plan flattened to raw arrays, for kernels (see ampfuse::Plan).
struct PlanRef {
  const std::int64_t* slot_tensor;    ///< original tensor index of each non-empty tensor
  const std::int64_t* slot_numel;     ///< its numel
  const std::int64_t* chunk_offsets;  ///< first chunk of each slot, num_slots + 1 entries
  std::int64_t num_slots;
  std::int64_t chunk_size;
};

/// The view of `plan` a kernel takes; valid while `plan` lives.
PlanRef plan_ref(const Plan& plan);

/// Elements per CPU chunk (what ampfuse's own kernels use).
constexpr std::int64_t kChunkSize = 64 * 1024;

/// The instruction set ampfuse's CPU kernels use on this machine: "avx512",
/// "avx2" or "baseline" (AMPFUSE_CPU_ISA in the environment forces one).
const char* isa();

/// Forces the instruction set isa() returns ("avx512", "avx2", "baseline"),
/// so that tests run every build of a kernel; "" restores the automatic
/// choice. Throws std::invalid_argument when the set is not compiled in or
/// this CPU lacks it.
void force_isa(const char* name);

/// Of three builds of one kernel, the one for isa(). On x86-64
/// ampfuse_add_cpu_kernel compiles all three; elsewhere only the baseline,
/// and the other two arguments are not used (pass the baseline thrice).
template <class Fn>
Fn pick_isa(Fn avx512, Fn avx2, Fn baseline) {
  const char* name = isa();
  if (name[0] == 'a' && name[3] == '5') return avx512;  // "avx512"
  if (name[0] == 'a') return avx2;                      // "avx2"
  return baseline;
}

}  // namespace ampfuse::sdk::cpu
