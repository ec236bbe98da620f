// The fused optimizers' CPU kernels follow the instruction set that
// ampfuse::cpu::kernels() chose (or that AMPFUSE_CPU_ISA / force_isa named).

#include <cstring>

#include "fused/adam_cpu.h"
#include "fused/sgd_cpu.h"

namespace ampfuse::fused::cpu {
namespace {

template <class Fn>
Fn pick(Fn avx512, Fn avx2, Fn baseline) {
  const char* isa = ampfuse::cpu::kernels().isa;
#if defined(AMPFUSE_CPU_HAS_AVX512)
  if (std::strcmp(isa, "avx512") == 0) return avx512;
#endif
#if defined(AMPFUSE_CPU_HAS_AVX2)
  if (std::strcmp(isa, "avx2") == 0) return avx2;
#endif
  (void)isa;
  (void)avx512;
  (void)avx2;
  return baseline;
}

}  // namespace

AdamFn adam_kernel() { return pick(avx512::kAdam, avx2::kAdam, baseline::kAdam); }
SgdFn sgd_kernel() { return pick(avx512::kSgd, avx2::kSgd, baseline::kSgd); }

}  // namespace ampfuse::fused::cpu
