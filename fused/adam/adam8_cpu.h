#pragma once
// CPU kernels of FusedAdam's moments_8bit (the code in adam8_math.h), one
// per instruction set, as adam_cpu.h's. Raw pointers only.

#include <cstdint>

#include "contract/cpu/kernels.h"
#include "fused/adam/adam8_math.h"
#include "fused/adam/adam_math.h"

namespace ampfuse::fused::cpu {

/// One step of the tensors whose moments are 8-bit: per block of
/// kQuantBlock elements, decode both moments, update (adam_update, fp32),
/// store the parameter, then the new absmax and codes. The plan's chunks are
/// multiples of kQuantBlock, so no block straddles two chunks.
struct Adam8Args {
  sdk::cpu::PlanRef plan;
  // By the caller's tensor index (tensors of the other kind hold nulls).
  void* const* param;
  void* const* grad;
  void* const* master;  ///< fp32 master copies, or null
  std::uint8_t* const* exp_avg;
  float* const* exp_avg_absmax;
  std::uint8_t* const* exp_avg_sq;
  float* const* exp_avg_sq_absmax;
  ScalarType dtype;  ///< of param and grad: Float32, Float16 or BFloat16
  const AdamStepScalars* scalars;
  AdamHyper hyper;  ///< amsgrad false
  double grad_factor;
};

/// Codes fp32 values block by block (a checkpoint's fp32 moments, quantize_8bit).
struct Quant8Args {
  const float* src;
  std::uint8_t* codes;
  float* absmax;  ///< one per block
  std::int64_t numel;
  bool is_signed;  ///< SignedMap8 (exp_avg), else UnsignedMap8 (exp_avg_sq)
};

using Adam8Fn = void (*)(const Adam8Args&, std::int64_t chunk_begin, std::int64_t chunk_end);
using Quant8Fn = void (*)(const Quant8Args&, std::int64_t block_begin, std::int64_t block_end);

Adam8Fn adam8_kernel();
Quant8Fn quant8_kernel();

namespace avx512 { extern const Adam8Fn kAdam8; extern const Quant8Fn kQuant8; }
namespace avx2 { extern const Adam8Fn kAdam8; extern const Quant8Fn kQuant8; }
namespace baseline { extern const Adam8Fn kAdam8; extern const Quant8Fn kQuant8; }
/// AVX-512 with VBMI: the codes decoded with byte permutes instead of
/// gathers, the same results bit for bit. adam8_kernel() takes it where the
/// instruction set is AVX-512 and the processor has VBMI.
namespace avx512vbmi { extern const Adam8Fn kAdam8; extern const Quant8Fn kQuant8; }

/// Whether adam8_kernel() may take the VBMI build (true by default; tests
/// turn it off to compare the two). Returns the previous setting.
bool allow_adam8_vbmi(bool allow);
/// Whether adam8_kernel() takes the VBMI build now.
bool adam8_vbmi_in_use();

}  // namespace ampfuse::fused::cpu
