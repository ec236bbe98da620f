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
  /// A plan of runs (Plan::begins, Plan::places): each slot's first element
  /// in its tensor's dense order, and where it lies in the parameter's
  /// memory (list 0 of the executor); both null in a plan of whole tensors.
  const std::int64_t* slot_begin = nullptr;
  const std::int64_t* slot_place = nullptr;
};

/// The view of `plan` a kernel takes; valid while `plan` lives.
PlanRef plan_ref(const Plan& plan);

/// Elements per CPU chunk (what ampfuse's own kernels use).
constexpr std::int64_t kChunkSize = 64 * 1024;

/// Below this much work (elements, plus kChunkWork per chunk for what a
/// kernel spends per tensor) a kernel's chunks run on the calling thread:
/// opening a parallel region costs more than it saves (ATen's GRAIN_SIZE),
/// and a step over many small groups opened one region per group, each of
/// which could wait a scheduler slice on a loaded machine. Many tiny
/// tensors in one list (10,000 of one element) still share the threads.
constexpr std::int64_t kInlineElements = 32 * 1024;
constexpr std::int64_t kChunkWork = 16;

/// The grain, in chunks, of at::parallel_for over `chunks` chunks that hold
/// `elements` elements: all of them (the calling thread runs them, no
/// region is opened) below kInlineElements of work, else 1.
inline std::int64_t chunks_grain(std::int64_t chunks, std::int64_t elements) {
  return elements + kChunkWork * chunks < kInlineElements ? (chunks > 1 ? chunks : 1) : 1;
}
/// The same for every chunk of `plan`.
std::int64_t chunks_grain(const Plan& plan);

/// The instruction sets a CPU kernel is built for (ampfuse_add_cpu_kernel
/// compiles one copy per set).
enum class Isa : std::uint8_t { kBaseline, kAvx2, kAvx512 };

/// "baseline", "avx2" or "avx512": the names AMPFUSE_CPU_ISA and force_isa take.
const char* to_string(Isa isa);

/// The instruction set CPU kernels use on this machine: the best one that is
/// compiled in and supported, unless AMPFUSE_CPU_ISA in the environment or
/// force_isa names another.
Isa current_isa();

/// Forces the instruction set current_isa() returns ("avx512", "avx2",
/// "baseline"), so that tests run every build of a kernel; "" restores the
/// automatic choice. Throws std::invalid_argument when the set is not
/// compiled in or this CPU lacks it.
void force_isa(const char* name);

/// Whether force_isa or AMPFUSE_CPU_ISA named the instruction set
/// current_isa() returns (false: chosen automatically).
bool isa_named();

/// The instruction set for one launch over `tensors` tensors of `elements`
/// elements in all: current_isa(), except that an automatic AVX-512 gives
/// way to AVX2 where the tensors average fewer elements than one AVX-512 block
/// of fp32 (16), such as many one-element parameters: their updates are
/// single blocks whose 512-bit divisions and square roots cost more than
/// 256-bit ones (measured here, one binary, three rounds: 10,000 one-element
/// FusedAdam parameters stepped in 36 to 53 ns each, against 50 to 65 with
/// AVX-512 forced). Every target writes the same bits, so only the time
/// changes. ampfuse's Adam, SGD, Adagrad and RMSprop use it; LAMB (whose
/// fp64 sums follow the block width) and 8-bit Adam keep current_isa().
Isa isa_for(std::int64_t elements, std::int64_t tensors);
/// isa_for of the tensors a plan covers (zero-element ones left out).
inline Isa isa_for(const Plan& plan) {
  return isa_for(plan.total_elements(), static_cast<std::int64_t>(plan.tensors().size()));
}

/// Subnormal numbers (below 2^-126 in fp32) make x86 arithmetic take a
/// microcode assist per operation: moments that decay into that range, or
/// tiny grads multiplied by a small inverse scale, made a step 6 to 16 times
/// slower. So CPU kernels run with them flushed: while a FlushSubnormals
/// lives, this thread's SSE/AVX arithmetic reads subnormal inputs as zero
/// (DAZ) and writes subnormal results as zero (FTZ), and on AArch64 its
/// fp32/fp64 arithmetic does the same (FPCR.FZ): only values below 2^-126
/// change (2^-1022 in fp64 kernels), and a normal result only by what such a
/// value would have added to it (fp16's subnormals are normal fp32 numbers
/// and are kept).
/// keep_subnormals(true), or AMPFUSE_KEEP_SUBNORMALS=1 in the environment,
/// keeps IEEE subnormals for exact parity with LibTorch, at that cost.
/// sdk::parallel_chunks and the engine ops hold one in every worker.
class FlushSubnormals {
 public:
  FlushSubnormals();
  ~FlushSubnormals();
  FlushSubnormals(const FlushSubnormals&) = delete;
  FlushSubnormals& operator=(const FlushSubnormals&) = delete;

 private:
  unsigned saved_ = 0;
  bool changed_ = false;
};

/// Keep IEEE subnormals in CPU kernels (true), or flush them (false, the default).
void keep_subnormals(bool keep);
bool subnormals_kept();

/// Of three builds of one kernel, the one for current_isa(): the one
/// dispatcher of ampfuse's kernels and third-party ones. On x86-64
/// ampfuse_add_cpu_kernel compiles all three; elsewhere only the baseline,
/// and the other two arguments are not used (pass the baseline thrice).
template <class Fn>
Fn pick_isa(Isa isa, Fn avx512, Fn avx2, Fn baseline) {
  switch (isa) {
    case Isa::kAvx512: return avx512;
    case Isa::kAvx2: return avx2;
    case Isa::kBaseline: break;
  }
  return baseline;
}
template <class Fn>
Fn pick_isa(Fn avx512, Fn avx2, Fn baseline) {
  return pick_isa(current_isa(), avx512, avx2, baseline);
}

}  // namespace ampfuse::sdk::cpu
