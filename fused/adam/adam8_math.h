#pragma once
// The 8-bit blockwise code of FusedAdam's moments_8bit, written once as
// scalar functions (host and device: the rule, the CUDA kernel's element
// code, and what the CPU kernel's lanes must equal bit for bit). The CPU
// kernel flushes subnormals by default (sdk::cpu::keep_subnormals turns it off):
// a subnormal moment codes as 0 there and as the smallest code on CUDA, so
// CPU and CUDA codes agree bit for bit only with subnormals kept. No
// LibTorch here.
//
// A tensor's elements are cut into blocks of kQuantBlock consecutive
// elements (the last one may be shorter). A block keeps one fp32 absmax, the
// largest |x| in it, and one byte per element:
//   r    = 1 / absmax rounded to 24 significant bits (as if fp32 had an
//          unbounded exponent: the kernels compute 2^64 / absmax instead when
//          absmax >= 2^64, and scale y back by 2^-64)
//   y    = fl32(|x| * r)                           (a multiply, not a divide
//          per element; y may exceed 1 by an ulp, and codes as 1)
//   code = the map value nearest y, ties to the even code; NaN to the
//          largest code;
//   x'   = value(code) * absmax                    (one fp32 rounding)
// The maps are tapered floats: counted from the top binade [1/2, 1) down,
// each run of binades has its own number of mantissa bits, most where most
// moments lie (within a decade of their block's absmax) and none in the
// tail, which only has to keep small values from vanishing:
//   exp_avg (signed: a sign bit and 7 bits of magnitude)
//     [2^-1, 1): 5 bits   [2^-4, 2^-1): 4 bits   [2^-13, 2^-4): 2 bits
//     [2^-22, 2^-13): 0 bits (powers of two)      codes 0 .. 126
//   exp_avg_sq (unsigned, 8 bits)
//     [2^-4, 1): 5 bits   [2^-12, 2^-4): 3 bits  [2^-27, 2^-12): 1 bit
//     [2^-58, 2^-27): 0 bits                      codes 0 .. 254
// Code 0 is 0; codes rise with the value, the largest used (126, 254) is
// 1.0; a value below the smallest nonzero one rounds to it or to 0 (ties to
// 0), except that for exp_avg_sq a nonzero y never codes to 0 (it takes the
// smallest nonzero code: a second moment rounded to zero would turn its
// element's update into m / eps). Half a step is the largest error: 2^-6 of
// the value at most in the top binade, 2^-5, 2^-3, 1/2 (1/3 of the value)
// in the runs below it (exp_avg_sq: 2^-6, 2^-4, 2^-2, 1/2). On the Adam
// moments of a trained MLP, the update's error is smaller than with
// bitsandbytes' dynamic maps for the same bytes, and on heavy-tailed blocks
// it stays bounded where theirs codes small second moments to 0
// (tests/test_adam8bit.cpp, MapIsMoreAccurateThanTheDynamicMap).
// The layouts are chosen so that every run starts at an even code and
// rounding its fp32 bits to the run's mantissa width, ties to even, is
// rounding to the nearest code, ties to the even code.
// A block whose absmax is 0, or below 2^-126 (an fp32 subnormal; only when
// subnormals are kept) codes every element as 0 and keeps absmax 0.
// A block holding an inf (a second moment that overflowed fp32) keeps the
// largest finite fp32 value as absmax: the inf codes as 1.0 of it
// (stored_absmax). A block holding a NaN keeps absmax NaN.

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

/// One of the two maps: four runs of binades from the top binade [1/2, 1)
/// down, run i of kB<i> binades with kM<i> mantissa bits each. Codes rise
/// with the value: 0 is zero, run 3 (the lowest) starts at code 1, run 0
/// ends at kOne, the code of 1.0. In run i a magnitude y with fp32 bits b
/// codes as round_to_nearest_even(b >> kShift<i>) - kOff<i>, and decodes as
/// the bits (code + kOff<i>) << kShift<i>.
template <bool kSigned, int kB0, int kM0, int kB1, int kM1, int kB2, int kM2, int kB3, int kM3>
struct Map8 {
  static constexpr bool kSignedMap = kSigned;
  /// The fp32 exponent field of each run's lowest binade.
  static constexpr std::uint32_t kElo0 = 127 - kB0, kElo1 = kElo0 - kB1, kElo2 = kElo1 - kB2, kElo3 = kElo2 - kB3;
  /// Each run's first code.
  static constexpr std::uint32_t kBase3 = 1, kBase2 = kBase3 + (kB3 << kM3), kBase1 = kBase2 + (kB2 << kM2),
                                 kBase0 = kBase1 + (kB1 << kM1);
  static constexpr std::uint32_t kOne = kBase0 + (kB0 << kM0);  ///< the code of 1.0 (the largest used)
  static constexpr std::uint32_t kShift0 = 23 - kM0, kShift1 = 23 - kM1, kShift2 = 23 - kM2, kShift3 = 23 - kM3;
  static constexpr std::uint32_t kOff0 = (kElo0 << kM0) - kBase0, kOff1 = (kElo1 << kM1) - kBase1,
                                 kOff2 = (kElo2 << kM2) - kBase2, kOff3 = (kElo3 << kM3) - kBase3;
  /// The fp32 bits of half the smallest nonzero value: below the lowest run,
  /// y codes as 1 above it and as 0 at or below it.
  static constexpr std::uint32_t kHalfLowestBits = (kElo3 - 1) << 23;
  static_assert(kOne <= (kSigned ? 127u : 255u), "a map has 128 (signed) or 256 codes");
  static_assert(kOff0 % 2 == 0 && kOff1 % 2 == 0 && kOff2 % 2 == 0 && kOff3 % 2 == 0,
                "ties to the even mantissa must be ties to the even code");
  static_assert(kElo3 > 1, "the smallest value is an fp32 normal");
};
using SignedMap8 = Map8<true, 1, 5, 3, 4, 9, 2, 9, 0>;      ///< exp_avg: down to 2^-22 of absmax
using UnsignedMap8 = Map8<false, 4, 5, 8, 3, 15, 1, 31, 0>;  ///< exp_avg_sq: down to 2^-58 of absmax

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
  const std::uint32_t bits = quant_float_bits(y), e = bits >> 23;
  std::uint32_t code;
  if (e < Map::kElo3) {
    code = bits > Map::kHalfLowestBits ? 1u : 0u;
  } else {
    // Drop kShift of fp32's mantissa bits, rounding to nearest even; a carry
    // into the exponent is the next binade's first code. NaN lands far above kOne.
    const bool r0 = e >= Map::kElo0, r1 = e >= Map::kElo1, r2 = e >= Map::kElo2;
    const std::uint32_t s = r0 ? Map::kShift0 : r1 ? Map::kShift1 : r2 ? Map::kShift2 : Map::kShift3;
    const std::uint32_t off = r0 ? Map::kOff0 : r1 ? Map::kOff1 : r2 ? Map::kOff2 : Map::kOff3;
    code = ((bits + (1u << (s - 1)) - 1u + ((bits >> s) & 1u)) >> s) - off;
  }
  if (code > Map::kOne) code = Map::kOne;
  if (!Map::kSignedMap && code == 0 && bits != 0) code = 1;  // by bits: the same under DAZ
  return code;
}

/// The fp32 bits of value(code) for a magnitude code, exact.
template <class Map>
AMPFUSE_HOST_DEVICE constexpr std::uint32_t decode_magnitude_bits(std::uint32_t code) {
  if (code == 0) return 0u;
  const bool r0 = code >= Map::kBase0, r1 = code >= Map::kBase1, r2 = code >= Map::kBase2;
  const std::uint32_t s = r0 ? Map::kShift0 : r1 ? Map::kShift1 : r2 ? Map::kShift2 : Map::kShift3;
  const std::uint32_t off = r0 ? Map::kOff0 : r1 ? Map::kOff1 : r2 ? Map::kOff2 : Map::kOff3;
  return (code + off) << s;
}

/// value(code) for a magnitude code, exact.
template <class Map>
AMPFUSE_HOST_DEVICE float decode_magnitude(std::uint32_t code) {
  return quant_bits_float(decode_magnitude_bits<Map>(code));
}

/// encode_magnitude by one fp32 addition, as the CPU kernels compute it
/// (a table lookup by y's exponent field instead of a search of the runs).
/// In a binade whose codes are 2^k apart, the code of y is round(y / 2^k)
/// + D, D fixed for the binade (0 <= D < 2^10). C = (1.5 + D * 2^-23) *
/// 2^(k + 23) has ulp 2^k and every number of its binade is a multiple of
/// 2^k; y < 2^(k + 7) is far below C, so y + C lies in C's binade and is y
/// rounded to a multiple of 2^k, to nearest (the carry into the next binade
/// included): bits(y + C) = bits(C) + round(y / 2^k). With D in C's low 10
/// bits, code = bits(y + C) - (bits(C) with those bits cleared), and at a
/// tie that is even, because round to nearest even makes bits(y + C) even:
/// ties go to the even code, as the rule says. Below the lowest run, 2^k is
/// the smallest value and D = 0: y rounds to 0 or to it, ties to 0.
/// Exponent fields above 127 occur only for NaN, which takes the top
/// binade's C and codes far above kOne, clamped to it as the rule does.
/// The unsigned map's "a nonzero y never codes 0" is applied after.
constexpr std::uint32_t kAddendCodeBits = 0x3FFu;  ///< C's low bits that hold D

template <class Map>
AMPFUSE_HOST_DEVICE constexpr std::uint32_t encode_addend_bits(std::uint32_t exponent_field) {
  if (exponent_field < Map::kElo3) return ((Map::kElo3 + 23u) << 23) | 0x400000u;  // 2^k: the smallest value
  const std::uint32_t e = exponent_field > 127u ? 127u : exponent_field;
  const bool r0 = e >= Map::kElo0, r1 = e >= Map::kElo1, r2 = e >= Map::kElo2;
  const std::uint32_t m = 23u - (r0 ? Map::kShift0 : r1 ? Map::kShift1 : r2 ? Map::kShift2 : Map::kShift3);
  const std::uint32_t elo = r0 ? Map::kElo0 : r1 ? Map::kElo1 : r2 ? Map::kElo2 : Map::kElo3;
  const std::uint32_t base = r0 ? Map::kBase0 : r1 ? Map::kBase1 : r2 ? Map::kBase2 : Map::kBase3;
  // round(y / 2^k) runs from 2^m (y at the binade's bottom) to 2^(m + 1);
  // D is below kOne (e = 127 is y >= 1, which clamps to kOne).
  const std::uint32_t d = base + ((e - elo) << m) - (1u << m);
  return ((e + 23u - m) << 23) | 0x400000u | d;  // 2^k = 2^(e - 127 - m)
}

/// encode_magnitude through encode_addend_bits (what the CPU lanes
/// compute), for y as encode_magnitude takes it, on a processor that keeps
/// subnormals.
template <class Map>
AMPFUSE_HOST_DEVICE std::uint32_t encode_magnitude_by_addition(float y) {
  const std::uint32_t bits = quant_float_bits(y);
  const std::uint32_t c = encode_addend_bits<Map>(bits >> 23);
  std::uint32_t code = quant_float_bits(y + quant_bits_float(c)) - (c & ~kAddendCodeBits);
  if (code > Map::kOne) code = Map::kOne;
  if (!Map::kSignedMap && code == 0 && bits != 0) code = 1;
  return code;
}

/// The byte of x in a block of absmax `absmax` (as the block's rule computes it).
/// A block's r and whether y must be scaled back by 2^-64 (absmax >= 2^64,
/// where 1 / absmax would fall below fp32's normal range).
struct Reciprocal8 {
  float r;
  bool scaled;
  /// y of a magnitude a (|x|, or x where x is never negative): a * r, then
  /// times 2^-64 (exact) in a scaled block. T: float, or a SIMD vector of
  /// floats that multiplies by a float.
  template <class T>
  AMPFUSE_HOST_DEVICE T of(T a) const {
    T y = a * r;
    if (scaled) y = y * 5.421010862427522e-20f;  // 2^-64
    return y;
  }
};
AMPFUSE_HOST_DEVICE Reciprocal8 block_reciprocal(float absmax) {
  const bool scaled = absmax >= 18446744073709551616.0f;  // 2^64
  return {(scaled ? 18446744073709551616.0f : 1.0f) / absmax, scaled};
}

/// y of |x| in a block of reciprocal rc.
AMPFUSE_HOST_DEVICE float scaled_magnitude(float x, Reciprocal8 rc) {
  return rc.of(quant_bits_float(quant_float_bits(x) & 0x7FFFFFFFu));
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

/// The largest finite fp32 value: the absmax of a block whose largest |x| is
/// inf (a second moment past fp32's range, from a finite grad above about
/// 5.8e20: (1 - beta2) * g * g overflows). The inf codes as the largest code,
/// value(kOne) = 1, and decodes to this: the block stays finite, and its other
/// elements code against it as against any large absmax (NaN as absmax would
/// turn all 256 elements NaN for good, where fp32 Adam keeps one inf moment).
constexpr std::uint32_t kSaturatedAbsmaxBits = 0x7F7FFFFFu;

/// The absmax a block keeps, from the largest |x| in it (NaN when any is
/// NaN, the largest finite fp32 value when it is inf).
AMPFUSE_HOST_DEVICE float stored_absmax(float max_abs) {
  if (max_abs > 3.4028234663852886e38f) return quant_bits_float(kSaturatedAbsmaxBits);  // inf
  return codes_all_zero(max_abs) ? 0.0f : max_abs;
}

/// The same from the largest bits of |x| over the block (the kernels reduce
/// bits: for non-negative floats the integer order is the float order, and
/// inf (0x7F800000) and NaN (above it) come after every finite value).
AMPFUSE_HOST_DEVICE float absmax_from_bits(std::uint32_t max_abs_bits) {
  if (max_abs_bits > 0x7F800000u) return quant_bits_float(0x7FC00000u);
  if (max_abs_bits == 0x7F800000u) return quant_bits_float(kSaturatedAbsmaxBits);
  return stored_absmax(quant_bits_float(max_abs_bits));
}

/// The 8-bit step's update: adam_update (adam_math.h) without amsgrad,
/// with three changes that make it cheaper (the 8-bit step is bound by
/// arithmetic, not memory) and no less accurate:
///   - sqrt(v) is multiplied by 1 / sqrt(bc2) where adam_update divides by
///     sqrt(bc2): one division per element instead of two;
///   - each product followed by a sum is one fused multiply-add (Ops::fma,
///     rounded once), written out below;
///   - g unscaled by a grad factor of 1 is g itself (the caller skips the
///     product).
///   g = maximize ? -g : g;  p = p * decay_factor  (decoupled), or
///   g = fma(weight_decay, p, g)  (coupled)
///   m = fma(m, beta1, (1 - beta1) * g)
///   v = fma(v, beta2, ((1 - beta2) * g) * g)
///   p = fma(neg_step_size, m / fma(sqrt(v), 1 / sqrt(bc2), eps), p)
/// V: float, or a block of fp32 lanes.
/// The rule is written in two halves, for the CPU lanes, which test the
/// options once per block (adam8_has_prologue) rather than once per lane
/// block: the first two lines (adam8_prologue), then the rest
/// (adam8_moments). adam8_update, after them, is the whole rule.
AMPFUSE_HOST_DEVICE bool adam8_has_prologue(const AdamHyperT<float>& h) {
  return h.maximize || h.weight_decay != 0.0f;
}
template <class V, class Ops>
AMPFUSE_HOST_DEVICE void adam8_prologue(V& p, V& g, const AdamHyperT<float>& h) {
  if (h.maximize) g = -g;
  if (h.weight_decay != 0.0f) {
    if (h.decoupled_weight_decay) p = p * Ops::splat(h.decay_factor);
    else g = Ops::fma(Ops::splat(h.weight_decay), p, g);
  }
}
template <class V, class Ops>
AMPFUSE_HOST_DEVICE void adam8_moments(V& p, V g, V& m, V& v, const AdamHyperT<float>& h, float neg_step_size,
                                       float inv_bc2_sqrt) {
  m = Ops::fma(m, Ops::splat(h.beta1), Ops::splat(h.one_minus_beta1) * g);
  v = Ops::fma(v, Ops::splat(h.beta2), (Ops::splat(h.one_minus_beta2) * g) * g);
  const V denom = Ops::fma(Ops::sqrt(v), Ops::splat(inv_bc2_sqrt), Ops::splat(h.eps));
  p = Ops::fma(Ops::splat(neg_step_size), m / denom, p);
}
/// The 8-bit step's update, the rule above: both halves in a row.
template <class V, class Ops>
AMPFUSE_HOST_DEVICE void adam8_update(V& p, V g, V& m, V& v, const AdamHyperT<float>& h, float neg_step_size,
                                      float inv_bc2_sqrt) {
  adam8_prologue<V, Ops>(p, g, h);
  adam8_moments<V, Ops>(p, g, m, v, h, neg_step_size, inv_bc2_sqrt);
}

/// 1 / sqrt(bc2) as the 8-bit step uses it, from adam_step_scalars' fp64 sqrt(bc2).
AMPFUSE_HOST_DEVICE float adam8_inv_bc2_sqrt(double bias_correction2_sqrt) {
  return static_cast<float>(1.0 / bias_correction2_sqrt);
}

}  // namespace ampfuse::fused
