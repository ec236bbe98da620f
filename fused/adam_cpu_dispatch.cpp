#include <cstring>

#include "fused/adam_cpu.h"

namespace ampfuse::fused::cpu {

AdamFn adam_kernel() {
  const char* isa = ampfuse::cpu::kernels().isa;
#if defined(AMPFUSE_CPU_HAS_AVX512)
  if (std::strcmp(isa, "avx512") == 0) return avx512::kAdam;
#endif
#if defined(AMPFUSE_CPU_HAS_AVX2)
  if (std::strcmp(isa, "avx2") == 0) return avx2::kAdam;
#endif
  return baseline::kAdam;
}

}  // namespace ampfuse::fused::cpu
