#pragma once
// The 8-bit blockwise code of FusedAdam's moments_8bit, written once as
// scalar functions (host and device: the rule, the CUDA kernel's element
// code, and what the CPU kernel's lanes must equal bit for bit). No LibTorch
// here.
//
// A tensor's elements are cut into blocks of kQuantBlock consecutive
// elements (the last one may be shorter). A block keeps one fp32 absmax, the
// largest |x| in it, and one byte per element:
//   r    = 1 / absmax rounded to 24 significant bits (as if fp32 had an
//          unbounded exponent: the kernels compute 2^64 / absmax instead when
//          absmax >= 2^64, and scale y back by 2^-64)
//   y    = fl32(|x| * r)                           (a multiply, not a divide
//          per element; y may exceed 1 by an ulp, and codes as 1)
//   code = the map value nearest y, ties to the even code (the map is a
//          minifloat: 3 mantissa bits, kExpBits exponent bits, subnormals,
//          largest value used 1.0), NaN to the largest code;
//   x'   = value(code) * absmax                    (one fp32 rounding)
// exp_avg uses the signed map (sign bit, then a 4-bit exponent: magnitudes
// down to 2^-17 of absmax, 1/16 relative precision); exp_avg_sq the unsigned
// one (5-bit exponent: down to 2^-33 of absmax, the range of a squared grad),
// where a nonzero y never codes to 0 (it takes the smallest nonzero code: a
// second moment rounded to zero would turn its element's update into m / eps).
// A block whose absmax is 0, or below 2^-126 (an fp32 subnormal; only when
// subnormals are kept) codes every element as 0 and keeps absmax 0.

#include <cstdint>
#include <cstring>

#include "ampfuse/config.h"
#include "fused/adam/adam_math.h"

namespace ampfuse::fused {

/// Elements per quantization block (one fp32 absmax each), as bitsandbytes'.
constexpr std::int64_t kQuantBlock = 256;
/// Tensors with fewer elements keep 32-bit moments (as bitsandbytes'
/// min_8bit_size): decided on the whole parameter's numel.
constexpr std::int64_t kMin8bitNumel = 4096;

constexpr std::int64_t quant_blocks(std::int64_t numel) { return (numel + kQuantBlock - 1) / kQuantBlock; }

/// 2^-126, fp32's smallest normal number: a block whose absmax is below it codes as 0.
constexpr float kMinNormal32 = 1.1754943508222875e-38f;

/// True when every code of a block of this absmax is 0 (absmax 0, or subnormal; not NaN).
AMPFUSE_HOST_DEVICE bool codes_all_zero(float absmax) { return !(absmax >= kMinNormal32) && absmax == absmax; }

/// One of the two maps. Magnitude codes: e = code >> 3, f = code & 7;
/// value = e == 0 ? f * 2^(-bias-2) : (1 + f/8) * 2^(e - bias), bias = 2^kExpBits - 1.
template <int kExpBits, bool kSigned>
struct Map8 {
  static constexpr int kBias = (1 << kExpBits) - 1;
  static constexpr std::uint32_t kOne = static_cast<std::uint32_t>(kBias) << 3;  ///< the code of 1.0 (largest used)
  static constexpr std::uint32_t kFloatOffset = static_cast<std::uint32_t>(127 - kBias) << 3;
  static constexpr bool kSignedMap = kSigned;
  /// Below it a magnitude lies in the subnormal codes (f * 2^(-bias-2)).
  static constexpr float min_normal() { return pow2(1 - kBias); }
  static constexpr float subnormal_step() { return pow2(-kBias - 2); }
  static constexpr float inv_subnormal_step() { return pow2(kBias + 2); }

 private:
  static constexpr float pow2(int e) {
    float r = 1.0f;
    for (; e > 0; --e) r *= 2.0f;
    for (; e < 0; ++e) r *= 0.5f;
    return r;
  }
};
using SignedMap8 = Map8<4, true>;     ///< exp_avg: sign, 4-bit exponent, 3-bit mantissa
using UnsignedMap8 = Map8<5, false>;  ///< exp_avg_sq: 5-bit exponent, 3-bit mantissa

AMPFUSE_HOST_DEVICE std::uint32_t quant_float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
AMPFUSE_HOST_DEVICE float quant_bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

/// The magnitude code of y (0 <= y <= 1, or NaN), by the rule above.
template <class Map>
AMPFUSE_HOST_DEVICE std::uint32_t encode_magnitude(float y) {
  std::uint32_t code;
  if (y < Map::min_normal()) {
    // y * 2^(bias+2) < 8 is exact; adding 1.5 * 2^23 rounds it to an integer, ties to even.
    code = quant_float_bits(y * Map::inv_subnormal_step() + 12582912.0f) - 0x4B400000u;
  } else {
    // Drop 20 of fp32's 23 mantissa bits, rounding to nearest even; a carry
    // into the exponent is the next binade's first code. NaN lands far above kOne.
    const std::uint32_t bits = quant_float_bits(y);
    code = ((bits + 0x7FFFFu + ((bits >> 20) & 1u)) >> 20) - Map::kFloatOffset;
  }
  if (code > Map::kOne) code = Map::kOne;
  if (!Map::kSignedMap && code == 0 && y > 0.0f) code = 1;
  return code;
}

/// value(code) for a magnitude code, exact.
template <class Map>
AMPFUSE_HOST_DEVICE float decode_magnitude(std::uint32_t code) {
  if (code < 8) return static_cast<float>(code) * Map::subnormal_step();
  return quant_bits_float((code << 20) + (Map::kFloatOffset << 20));
}

/// The byte of x in a block of absmax `absmax` (as the block's rule computes it).
/// A block's r and whether y must be scaled back by 2^-64 (absmax >= 2^64,
/// where 1 / absmax would fall below fp32's normal range).
struct Reciprocal8 {
  float r;
  bool scaled;
};
AMPFUSE_HOST_DEVICE Reciprocal8 block_reciprocal(float absmax) {
  const bool scaled = absmax >= 18446744073709551616.0f;  // 2^64
  return {(scaled ? 18446744073709551616.0f : 1.0f) / absmax, scaled};
}

/// y of |x| in a block of reciprocal rc.
AMPFUSE_HOST_DEVICE float scaled_magnitude(float x, Reciprocal8 rc) {
  const float y = quant_bits_float(quant_float_bits(x) & 0x7FFFFFFFu) * rc.r;
  return rc.scaled ? y * 5.421010862427522e-20f : y;  // 2^-64, exact
}

template <class Map>
AMPFUSE_HOST_DEVICE std::uint8_t encode8(float x, float absmax) {
  if (codes_all_zero(absmax)) return 0;
  const std::uint32_t sign = Map::kSignedMap ? (quant_float_bits(x) >> 24) & 0x80u : 0u;
  return static_cast<std::uint8_t>(sign | encode_magnitude<Map>(scaled_magnitude(x, block_reciprocal(absmax))));
}

template <class Map>
AMPFUSE_HOST_DEVICE float decode8(std::uint8_t byte, float absmax) {
  const std::uint32_t mag = Map::kSignedMap ? byte & 0x7Fu : byte;
  const float v = decode_magnitude<Map>(mag) * absmax;
  return Map::kSignedMap && (byte & 0x80u) != 0 ? -v : v;
}

/// The absmax a block keeps, from the largest |x| in it (NaN when any is NaN).
AMPFUSE_HOST_DEVICE float stored_absmax(float max_abs) {
  return codes_all_zero(max_abs) ? 0.0f : max_abs;
}

/// The same from the largest bits of |x| over the block (the kernels reduce
/// bits: for non-negative floats the integer order is the float order, and
/// inf / NaN, 0x7F800000 and above, come after every finite value): NaN when
/// any value is not finite.
AMPFUSE_HOST_DEVICE float absmax_from_bits(std::uint32_t max_abs_bits) {
  if (max_abs_bits >= 0x7F800000u) return quant_bits_float(0x7FC00000u);
  return stored_absmax(quant_bits_float(max_abs_bits));
}

/// The 8-bit step's update: adam_update (adam_math.h) without amsgrad,
/// multiplying sqrt(v) by 1 / sqrt(bc2) where adam_update divides by
/// sqrt(bc2): one division per element instead of two (the 8-bit step is
/// bound by arithmetic, not memory). V: float, or a block of fp32 lanes.
template <class V, class Ops>
AMPFUSE_HOST_DEVICE void adam8_update(V& p, V g, V& m, V& v, const AdamHyperT<float>& h, float neg_step_size,
                                      float inv_bc2_sqrt) {
  if (h.maximize) g = -g;
  if (h.weight_decay != 0.0f) {
    if (h.decoupled_weight_decay) p = p * Ops::splat(h.decay_factor);
    else g = g + Ops::splat(h.weight_decay) * p;
  }
  m = m * Ops::splat(h.beta1) + Ops::splat(h.one_minus_beta1) * g;
  v = v * Ops::splat(h.beta2) + (Ops::splat(h.one_minus_beta2) * g) * g;
  const V denom = Ops::sqrt(v) * Ops::splat(inv_bc2_sqrt) + Ops::splat(h.eps);
  p = p + Ops::splat(neg_step_size) * (m / denom);
}

/// 1 / sqrt(bc2) as the 8-bit step uses it, from adam_step_scalars' fp64 sqrt(bc2).
AMPFUSE_HOST_DEVICE float adam8_inv_bc2_sqrt(double bias_correction2_sqrt) {
  return static_cast<float>(1.0 / bias_correction2_sqrt);
}

}  // namespace ampfuse::fused
