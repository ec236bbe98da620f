// The fused optimizers' CPU kernels follow the instruction set that
// ampfuse::cpu::kernels() chose (or that AMPFUSE_CPU_ISA / force_isa named),
// through the SDK's pick_isa, as a third-party optimizer's do. Adam, SGD,
// Adagrad and RMSprop take the set per launch (sdk::cpu::isa_for: AVX2 for
// lists of tiny tensors on AVX-512).

#include <atomic>

#include "ampfuse/sdk/cpu.h"
#include "fused/adagrad/adagrad_cpu.h"
#include "fused/adam/adam8_cpu.h"
#include "fused/adam/adam_cpu.h"
#include "fused/lamb/lamb_cpu.h"
#include "fused/rmsprop/rmsprop_cpu.h"
#include "fused/sgd/sgd_cpu.h"

namespace ampfuse::fused::cpu {
using sdk::cpu::pick_isa;

AdagradFn adagrad_kernel(sdk::cpu::Isa isa) { return pick_isa(isa, avx512::kAdagrad, avx2::kAdagrad, baseline::kAdagrad); }
AdamFn adam_kernel(sdk::cpu::Isa isa) { return pick_isa(isa, avx512::kAdam, avx2::kAdam, baseline::kAdam); }
namespace {
std::atomic<bool> g_allow_vbmi{true};
}  // namespace

bool allow_adam8_vbmi(bool allow) { return g_allow_vbmi.exchange(allow); }

bool adam8_vbmi_in_use() {
#if defined(AMPFUSE_CPU_HAS_AVX512VBMI)
  static const bool has_vbmi = __builtin_cpu_supports("avx512vbmi");
  return has_vbmi && g_allow_vbmi.load(std::memory_order_relaxed) &&
         sdk::cpu::current_isa() == sdk::cpu::Isa::kAvx512;
#else
  return false;
#endif
}

Adam8Fn adam8_kernel() {
#if defined(AMPFUSE_CPU_HAS_AVX512VBMI)
  if (adam8_vbmi_in_use()) return avx512vbmi::kAdam8;
#endif
  return pick_isa(avx512::kAdam8, avx2::kAdam8, baseline::kAdam8);
}
Quant8Fn quant8_kernel() { return pick_isa(avx512::kQuant8, avx2::kQuant8, baseline::kQuant8); }
LambFn lamb_moments_kernel() { return pick_isa(avx512::kLambMoments, avx2::kLambMoments, baseline::kLambMoments); }
LambFn lamb_apply_kernel() { return pick_isa(avx512::kLambApply, avx2::kLambApply, baseline::kLambApply); }
RmspropFn rmsprop_kernel(sdk::cpu::Isa isa) { return pick_isa(isa, avx512::kRmsprop, avx2::kRmsprop, baseline::kRmsprop); }
SgdFn sgd_kernel(sdk::cpu::Isa isa) { return pick_isa(isa, avx512::kSgd, avx2::kSgd, baseline::kSgd); }

}  // namespace ampfuse::fused::cpu
