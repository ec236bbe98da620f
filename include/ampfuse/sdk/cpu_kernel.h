#pragma once
// CPU kernel building blocks for one instruction set: what ampfuse's own CPU
// kernels are made of, and what a third-party optimizer's kernel uses.
//
// Include it in a kernel file compiled once per instruction set, after
// defining AMPFUSE_CPU_ISA to avx512, avx2 or baseline (CMake's
// ampfuse_add_cpu_kernel does both: see docs/guide.md). Everything lives in
// namespace ampfuse::sdk::cpu::<isa> with internal linkage, so no inline
// function built for AVX-512 can be merged into code that runs on a machine
// without it. Use no LibTorch and no std containers in such a file, for the
// same reason.
//
// Memory access is kept apart from the math: load_block / store_block move
// kWidth elements between storage (fp32, fp16, bf16) and a VecF of fp32
// lanes, or fp64 storage and a VecD of fp64 lanes (Lanes<ST> names the
// type); the update works on VecF through VecOps, on VecD through VecOpsD
// (the CPU twins of ampfuse::sdk::ScalarOpsT; OpsOf<ST> names them). A tensor's tail is copied into a zero-padded
// block and run through the same code, so body and tail round identically.
// for_each_chunk_block is the executor: it walks chunks of a plan and hands
// the per-block functor the blocks of every list side by side.

#ifndef AMPFUSE_CPU_ISA
#error "define AMPFUSE_CPU_ISA (avx512, avx2 or baseline) before including ampfuse/sdk/cpu_kernel.h"
#endif

#include <cassert>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__SSE2__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

#include "ampfuse/multi_tensor.h"
#include "ampfuse/sdk/cpu.h"
#include "ampfuse/sdk/math.h"

namespace ampfuse::sdk::cpu::AMPFUSE_CPU_ISA {
namespace {

using ::ampfuse::ScalarType;
using ::ampfuse::sdk::cpu::PlanRef;

// A block is one register of the target: GCC compiles the lane operations
// of a wider vector piecewise (a square root becomes a scalar call per lane,
// a comparison a branch per lane), several times slower.
// With GCC it is warned about (-Wvector-operation-performance), an error in
// ampfuse's own kernels (cmake/ampfuseKernels.cmake).
#if defined(__AVX512F__)
constexpr int kWidth = 16;
#elif defined(__AVX2__)
constexpr int kWidth = 8;
#else
constexpr int kWidth = 4;
#endif

using u16 = std::uint16_t;
using u32 = std::uint32_t;

inline u32 float_bits(float f) {
  u32 u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float bits_float(u32 u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Scalar conversions with c10's rounding (round to nearest even; bf16 NaN is
// 0x7FC0). fp16 follows the branch-free algorithm of the FP16 library
// (M. Dukhan), which c10::Half uses too, but for NaN payloads (kept, as F16C keeps them).
[[maybe_unused]] inline float half_to_float(u16 h) {
  const u32 w = static_cast<u32>(h) << 16;
  const u32 sign = w & 0x80000000u;
  const u32 two_w = w + w;
  const float normalized = bits_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = bits_float((two_w >> 17) | (126u << 23)) - 0.5f;
  return bits_float(sign | (two_w < (1u << 27) ? float_bits(denormalized) : float_bits(normalized)));
}
[[maybe_unused]] inline u16 float_to_half(float f) {
  float base = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const u32 w = float_bits(f);
  const u32 shl1_w = w + w;
  const u32 sign = w & 0x80000000u;
  u32 bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = bits_float((bias >> 1) + 0x07800000u) + base;
  const u32 bits = float_bits(base);
  const u32 nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  // NaN: quiet, with the top 10 bits of its payload, as F16C's conversion
  // (the avx2 and avx512 stores) keeps them, so that every target writes the
  // same bits (c10::Half writes 0x7E00 for any NaN).
  return static_cast<u16>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u | ((w >> 13) & 0x03FFu) : nonsign));
}
[[maybe_unused]] inline float bf16_to_float(u16 h) { return bits_float(static_cast<u32>(h) << 16); }
[[maybe_unused]] inline u16 float_to_bf16(float f) {
  if (f != f) return 0x7FC0;
  const u32 u = float_bits(f);
  return static_cast<u16>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// One block of kWidth fp32 lanes. GCC vector extensions: the compiler emits
// the target's SIMD instructions (zmm, ymm, or for the baseline one xmm or
// NEON register).
typedef float VecF __attribute__((vector_size(kWidth * sizeof(float))));
typedef float HalfVecF __attribute__((vector_size(kWidth / 2 * sizeof(float))));
typedef double HalfVecD __attribute__((vector_size(kWidth / 2 * sizeof(double))));
typedef long long HalfMaskD __attribute__((vector_size(kWidth / 2 * sizeof(long long))));

// One block of kWidth fp64 lanes, as two registers of kWidth / 2: fp64
// storage computes in fp64. Not a GCC vector of kWidth doubles: that is
// wider than any register of the target, and GCC keeps such a vector in
// memory and copies it through general registers in 16-byte pieces at every
// operation (an fp64 step ran at a third of ATen's speed with AVX2).
struct VecD {
  HalfVecD lo, hi;
  double operator[](int j) const { return j < kWidth / 2 ? lo[j] : hi[j - kWidth / 2]; }
  VecD& operator+=(VecD b) { return lo += b.lo, hi += b.hi, *this; }
  VecD& operator-=(VecD b) { return lo -= b.lo, hi -= b.hi, *this; }
  VecD& operator*=(VecD b) { return lo *= b.lo, hi *= b.hi, *this; }
  VecD& operator/=(VecD b) { return lo /= b.lo, hi /= b.hi, *this; }
};
inline VecD operator+(VecD a, VecD b) { return {a.lo + b.lo, a.hi + b.hi}; }
inline VecD operator-(VecD a, VecD b) { return {a.lo - b.lo, a.hi - b.hi}; }
inline VecD operator*(VecD a, VecD b) { return {a.lo * b.lo, a.hi * b.hi}; }
inline VecD operator/(VecD a, VecD b) { return {a.lo / b.lo, a.hi / b.hi}; }
inline VecD operator-(VecD a) { return {-a.lo, -a.hi}; }
// With a double on either side, as a GCC vector takes one (in every lane).
inline VecD operator+(VecD a, double b) { return {a.lo + b, a.hi + b}; }
inline VecD operator-(VecD a, double b) { return {a.lo - b, a.hi - b}; }
inline VecD operator*(VecD a, double b) { return {a.lo * b, a.hi * b}; }
inline VecD operator/(VecD a, double b) { return {a.lo / b, a.hi / b}; }
inline VecD operator+(double a, VecD b) { return {a + b.lo, a + b.hi}; }
inline VecD operator-(double a, VecD b) { return {a - b.lo, a - b.hi}; }
inline VecD operator*(double a, VecD b) { return {a * b.lo, a * b.hi}; }
inline VecD operator/(double a, VecD b) { return {a / b.lo, a / b.hi}; }
/// Lane masks of a comparison of two VecD, for select_d.
struct MaskD {
  HalfMaskD lo, hi;
};
inline MaskD operator<(VecD a, VecD b) { return {a.lo < b.lo, a.hi < b.hi}; }
inline MaskD operator>(VecD a, VecD b) { return {a.lo > b.lo, a.hi > b.hi}; }
/// a where m is set, else b (a lane-wise m ? a : b).
inline VecD select_d(MaskD m, VecD a, VecD b) { return {m.lo ? a.lo : b.lo, m.hi ? a.hi : b.hi}; }

/// The lanes a block of storage type ST is loaded into: VecF, or VecD for Float64.
template <ScalarType ST>
struct LanesOf {
  using type = VecF;
};
template <>
struct LanesOf<ScalarType::Float64> {
  using type = VecD;
};
template <ScalarType ST>
using Lanes = typename LanesOf<ST>::type;

inline VecF load_f32(const void* src) {
  VecF v;
  std::memcpy(&v, src, sizeof v);
  return v;
}
inline void store_f32(VecF v, void* dst) { std::memcpy(dst, &v, sizeof v); }

template <ScalarType ST>
inline Lanes<ST> load_block(const void* src);
template <ScalarType ST>
inline void store_block(Lanes<ST> v, void* dst);

template <>
inline VecD load_block<ScalarType::Float64>(const void* src) {
  VecD v;
  std::memcpy(&v.lo, src, sizeof v.lo);
  std::memcpy(&v.hi, static_cast<const char*>(src) + sizeof v.lo, sizeof v.hi);
  return v;
}
template <>
inline void store_block<ScalarType::Float64>(VecD v, void* dst) {
  std::memcpy(dst, &v.lo, sizeof v.lo);
  std::memcpy(static_cast<char*>(dst) + sizeof v.lo, &v.hi, sizeof v.hi);
}

template <>
inline VecF load_block<ScalarType::Float32>(const void* src) { return load_f32(src); }
template <>
inline void store_block<ScalarType::Float32>(VecF v, void* dst) { store_f32(v, dst); }

#if defined(__AVX512F__)
template <>
inline VecF load_block<ScalarType::Float16>(const void* src) {
  return (VecF)_mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(src)));
}
template <>
inline void store_block<ScalarType::Float16>(VecF v, void* dst) {
  _mm256_storeu_si256(static_cast<__m256i*>(dst),
                      _mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
template <>
inline VecF load_block<ScalarType::BFloat16>(const void* src) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(src)));
  return (VecF)_mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
template <>
inline void store_block<ScalarType::BFloat16>(VecF vf, void* dst) {
  const __m512 v = (__m512)vf;
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(static_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(r));
}
#elif defined(__AVX2__)
template <>
inline VecF load_block<ScalarType::Float16>(const void* src) {
  return (VecF)_mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(src)));
}
template <>
inline void store_block<ScalarType::Float16>(VecF v, void* dst) {
  _mm_storeu_si128(static_cast<__m128i*>(dst), _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT));
}
template <>
inline VecF load_block<ScalarType::BFloat16>(const void* src) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(src)));
  return (VecF)_mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
template <>
inline void store_block<ScalarType::BFloat16>(VecF vf, void* dst) {
  const __m256 v = (__m256)vf;
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  // Every lane is <= 0xFFFF, so the saturating pack only narrows.
  _mm_storeu_si128(static_cast<__m128i*>(dst),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
#else
template <>
inline VecF load_block<ScalarType::Float16>(const void* src) {
  u16 h[kWidth];
  std::memcpy(h, src, sizeof h);
  VecF v;
  for (int j = 0; j < kWidth; ++j) v[j] = half_to_float(h[j]);
  return v;
}
template <>
inline void store_block<ScalarType::Float16>(VecF v, void* dst) {
  u16 h[kWidth];
  for (int j = 0; j < kWidth; ++j) h[j] = float_to_half(v[j]);
  std::memcpy(dst, h, sizeof h);
}
template <>
inline VecF load_block<ScalarType::BFloat16>(const void* src) {
  u16 h[kWidth];
  std::memcpy(h, src, sizeof h);
  VecF v;
  for (int j = 0; j < kWidth; ++j) v[j] = bf16_to_float(h[j]);
  return v;
}
template <>
inline void store_block<ScalarType::BFloat16>(VecF v, void* dst) {
  u16 h[kWidth];
  for (int j = 0; j < kWidth; ++j) h[j] = float_to_bf16(v[j]);
  std::memcpy(dst, h, sizeof h);
}
#endif

// The two halves of a block widened to fp64.
// acc + x * x, fused where the target has FMA (one rounding: more accurate).
#if defined(__AVX512F__)
inline HalfVecD add_square(HalfVecD acc, HalfVecD x) {
  return (HalfVecD)_mm512_fmadd_pd((__m512d)x, (__m512d)x, (__m512d)acc);
}
#elif defined(__AVX2__)
inline HalfVecD add_square(HalfVecD acc, HalfVecD x) {
  return (HalfVecD)_mm256_fmadd_pd((__m256d)x, (__m256d)x, (__m256d)acc);
}
#else
inline HalfVecD add_square(HalfVecD acc, HalfVecD x) { return acc + x * x; }
#endif

#if defined(__AVX512F__)
inline HalfVecD low_f64(VecF v) { return (HalfVecD)_mm512_cvtps_pd(_mm512_castps512_ps256((__m512)v)); }
inline HalfVecD high_f64(VecF v) {
  return (HalfVecD)_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd((__m512)v), 1)));
}
#elif defined(__AVX2__)
inline HalfVecD low_f64(VecF v) { return (HalfVecD)_mm256_cvtps_pd(_mm256_castps256_ps128((__m256)v)); }
inline HalfVecD high_f64(VecF v) { return (HalfVecD)_mm256_cvtps_pd(_mm256_extractf128_ps((__m256)v, 1)); }
#elif defined(__SSE2__)
inline HalfVecD low_f64(VecF v) { return (HalfVecD)_mm_cvtps_pd((__m128)v); }
inline HalfVecD high_f64(VecF v) { return (HalfVecD)_mm_cvtps_pd(_mm_movehl_ps((__m128)v, (__m128)v)); }
#elif defined(__aarch64__)
inline HalfVecD low_f64(VecF v) { return (HalfVecD)vcvt_f64_f32(vget_low_f32((float32x4_t)v)); }
inline HalfVecD high_f64(VecF v) { return (HalfVecD)vcvt_high_f64_f32((float32x4_t)v); }
#else
inline HalfVecD low_f64(VecF v) {
  HalfVecF h;
  std::memcpy(&h, &v, sizeof h);
  return __builtin_convertvector(h, HalfVecD);
}
inline HalfVecD high_f64(VecF v) {
  HalfVecF h;
  std::memcpy(&h, reinterpret_cast<const char*>(&v) + sizeof h, sizeof h);
  return __builtin_convertvector(h, HalfVecD);
}
#endif

// The two halves of a block of fp64 lanes.
inline HalfVecD low_f64(VecD v) { return v.lo; }
inline HalfVecD high_f64(VecD v) { return v.hi; }

constexpr std::size_t size_of(ScalarType st) { return element_size(st); }

// The largest storage element (fp64): a tail block holds kWidth of them.
constexpr std::size_t kMaxElementSize = 8;

/// One chunk of a plan: elements [begin, begin + n) of tensor `tensor`, in
/// its dense order; in a plan of runs (ampfuse::Plan's constructor of runs)
/// the first of them lies `place` elements into the memory of list 0 (a
/// parameter with gaps, walked where it is), elsewhere place is begin.
struct ChunkRef {
  std::int64_t chunk, tensor, begin, n, place;
};

// How far ahead, in elements, for_each_block_lists prefetches each list:
// 1 KiB of fp32. The hardware prefetchers restart at every 4 KiB page and at
// every tensor; with many small tensors (10,000 x 4,096) a kernel that does
// real math per element (sqrt, two divisions for Adam) then waits on memory
// a third of the time, while a software prefetch keeps every stream ahead.
constexpr std::int64_t kPrefetchElements = 256;

// How many bytes ahead, summed over the lists, for_each_block_lists keeps in
// flight: each list is prefetched kPrefetchBytes / (the bytes of one element
// of every used list) elements ahead, at least kPrefetchElements. A kernel of
// few lists (plain SGD: parameter and grad) then reaches further ahead: 256
// elements (1 KiB of fp32) left one thread of FusedSGD at 0.72x
// torch::optim::SGD's speed on 4 dense tensors of 8M fp32, waiting on
// memory; 1024 elements reached 0.94-0.97x (AMD EPYC, docs/engine.md).
constexpr std::int64_t kPrefetchBytes = 8 * 1024;

// The same for for_each_block_read, twice as far: a read-only pass does so
// little per line that its four streams, 1 KiB ahead, still waited on memory;
// 2 KiB ahead it reads as fast as a plain read of the same bytes.
constexpr std::int64_t kReadPrefetchElements = 2 * kPrefetchElements;

// In a plan of runs, how much of the next run of list 0 the executor
// prefetches when it starts a run (see for_each_chunk_block).
constexpr std::int64_t kRunLeadBytes = 1024;

// How far ahead, in chunks, kernels prefetch chunks smaller than
// kPrefetchElements (ChunkLookahead).
constexpr std::int64_t kChunksAhead = 8;

// Whether slot s of `plan` is a whole tensor of one element (begin and place
// 0): the one-element walks below read such slots off the plan without a
// cursor. (A plan of runs may hold a run of one element elsewhere in a tensor.)
[[gnu::always_inline]] inline bool whole_one_element(const PlanRef& plan, std::int64_t s) {
  return plan.slot_numel[s] == 1 && (plan.slot_begin == nullptr || (plan.slot_begin[s] == 0 && plan.slot_place[s] == 0));
}

// Finds chunks of a plan in increasing order: at(c) for c at or past the
// chunk asked before (and past `first`) walks the slots forward from there.
class ChunkCursor {
 public:
  ChunkCursor(const PlanRef& plan, std::int64_t first) : plan_(plan) {
    std::int64_t lo = 0, hi = plan.num_slots;  // last slot whose first chunk <= first
    while (hi - lo > 1) {
      const std::int64_t mid = lo + (hi - lo) / 2;
      if (plan.chunk_offsets[mid] <= first) lo = mid; else hi = mid;
    }
    slot_ = lo;
  }
  ChunkRef at(std::int64_t c) {
    while (plan_.chunk_offsets[slot_ + 1] <= c) ++slot_;
    const std::int64_t into = (c - plan_.chunk_offsets[slot_]) * plan_.chunk_size;  // elements into the slot
    const std::int64_t rest = plan_.slot_numel[slot_] - into;
    const std::int64_t n = rest < plan_.chunk_size ? rest : plan_.chunk_size;
    if (plan_.slot_begin == nullptr) return ChunkRef{c, plan_.slot_tensor[slot_], into, n, into};
    return ChunkRef{c, plan_.slot_tensor[slot_], plan_.slot_begin[slot_] + into, n, plan_.slot_place[slot_] + into};
  }
  /// The slot of the chunk asked last.
  std::int64_t slot() const { return slot_; }

 private:
  PlanRef plan_;  // a copy: a few pointers, and no reference to a temporary
  std::int64_t slot_;
};

// Calls f(chunk, tensor, begin, size) for chunks [chunk_begin, chunk_end).
// Dense lists only: in a plan of runs a parameter with gaps lies at each
// chunk's place, which this leaves out (the executor, for_each_chunk_block,
// and ChunkCursor's ChunkRef carry it).
template <class F>
inline void for_each_chunk(const PlanRef& plan, std::int64_t chunk_begin, std::int64_t chunk_end, F&& f) {
  if (chunk_begin >= chunk_end) return;
  ChunkCursor cursor(plan, chunk_begin);
  for (std::int64_t c = chunk_begin; c < chunk_end; ++c) {
    const ChunkRef ch = cursor.at(c);
    f(c, ch.tensor, ch.begin, ch.n);
  }
}

// For chunks too small for the block loops' prefetch to run ahead of them
// (many small tensors, each its own allocation): the chunk kChunksAhead
// further in the range, whose first lines a kernel prefetches so that the
// misses of consecutive chunks overlap instead of coming one after another.
class ChunkLookahead {
 public:
  ChunkLookahead(const PlanRef& plan, std::int64_t chunk_begin, std::int64_t chunk_end)
      : cursor_(plan, chunk_begin), end_(chunk_end) {}
  /// The chunk to prefetch while running ch; null when ch is large or none is that far.
  [[gnu::always_inline]] const ChunkRef* far(const ChunkRef& ch) {
    if (ch.n >= kPrefetchElements || ch.chunk + kChunksAhead >= end_) return nullptr;
    far_ = cursor_.at(ch.chunk + kChunksAhead);
    return &far_;
  }

 private:
  ChunkCursor cursor_;
  std::int64_t end_;
  ChunkRef far_{};
};

// Calls f(chunk, next) for chunks [chunk_begin, chunk_end), next pointing at
// the chunk that follows in the range (null for the last one): each chunk
// runs once the next one is known, so that its last blocks can prefetch the
// next chunk's first lines (tensors are separate allocations: no hardware
// prefetcher follows from one to the next).
template <class F>
inline void for_each_chunk_with_next(const PlanRef& plan, std::int64_t chunk_begin, std::int64_t chunk_end, F&& f) {
  if (chunk_begin >= chunk_end) return;
  ChunkCursor cursor(plan, chunk_begin);
  ChunkRef pending = cursor.at(chunk_begin);
  for (std::int64_t c = chunk_begin + 1; c < chunk_end; ++c) {
    const ChunkRef current = cursor.at(c);
    f(pending, &current);
    pending = current;
  }
  f(pending, static_cast<const ChunkRef*>(nullptr));
}

// Calls f(ch, next, far) for chunks [chunk_begin, chunk_end) in order: next
// as for_each_chunk_with_next passes it, far as ChunkLookahead::far returns
// it for ch. A run of tensors of one element each (a slot and a chunk per
// tensor, such as 10,000 one-element parameters) is walked slot by slot: the
// chunk that follows and the one kChunksAhead further are read off the
// slots, without the cursors' search, as long as they lie in the run.
template <class F>
inline void for_each_chunk_ahead(const PlanRef& plan, std::int64_t chunk_begin, std::int64_t chunk_end, F&& f) {
  if (chunk_begin >= chunk_end) return;
  ChunkCursor cursor(plan, chunk_begin);
  ChunkLookahead lookahead(plan, chunk_begin, chunk_end);
  ChunkRef ch = cursor.at(chunk_begin);
  for (;;) {
    const std::int64_t c = ch.chunk;
    ChunkRef next{};
    // A one-element tensor: the run starts here.
    if (ch.n == 1 && whole_one_element(plan, cursor.slot())) {
      const std::int64_t s = cursor.slot();
      std::int64_t run = 1;  // chunk c + k is slot s + k for k < run
      while (c + run < chunk_end && whole_one_element(plan, s + run)) ++run;
      for (std::int64_t k = 0; k < run; ++k) {
        const ChunkRef one{c + k, plan.slot_tensor[s + k], 0, 1, 0};
        const bool last = k + 1 == run;
        if (!last) next = ChunkRef{c + k + 1, plan.slot_tensor[s + k + 1], 0, 1, 0};
        else if (c + run < chunk_end) next = cursor.at(c + run);
        ChunkRef far_in_run;
        const ChunkRef* far = nullptr;
        if (k + kChunksAhead < run) {
          far_in_run = ChunkRef{c + k + kChunksAhead, plan.slot_tensor[s + k + kChunksAhead], 0, 1, 0};
          far = &far_in_run;
        } else {
          far = lookahead.far(one);
        }
        f(one, last && c + run >= chunk_end ? nullptr : &next, far);
      }
      if (c + run >= chunk_end) return;
    } else {
      const bool more = c + 1 < chunk_end;
      if (more) next = cursor.at(c + 1);
      f(ch, more ? &next : nullptr, lookahead.far(ch));
      if (!more) return;
    }
    ch = next;
  }
}

// As for_each_chunk_ahead, but a run of one-element tensors goes to
// run(first_chunk, tensors, count) in one call: chunks first_chunk + k,
// k < count, are element 0 of original tensors tensors[k]. For a pass whose
// work per element is a few instructions (a check for inf and NaN), so that
// the walk does not cost more than the work.
template <class F, class Run>
inline void for_each_chunk_or_run(const PlanRef& plan, std::int64_t chunk_begin, std::int64_t chunk_end, F&& f,
                                  Run&& run) {
  if (chunk_begin >= chunk_end) return;
  ChunkCursor cursor(plan, chunk_begin);
  ChunkLookahead lookahead(plan, chunk_begin, chunk_end);
  ChunkRef ch = cursor.at(chunk_begin);
  for (;;) {
    const std::int64_t c = ch.chunk;
    std::int64_t after = c + 1;
    if (ch.n == 1 && whole_one_element(plan, cursor.slot())) {
      const std::int64_t s = cursor.slot();
      std::int64_t count = 1;
      while (c + count < chunk_end && whole_one_element(plan, s + count)) ++count;
      run(c, plan.slot_tensor + s, count);
      after = c + count;
      if (after >= chunk_end) return;
      ch = cursor.at(after);
      continue;
    }
    const bool more = after < chunk_end;
    ChunkRef next{};
    if (more) next = cursor.at(after);
    f(ch, more ? &next : nullptr, lookahead.far(ch));
    if (!more) return;
    ch = next;
  }
}

// Independent accumulators per reduction: enough to hide the latency of the
// adds that carry a sum from one block to the next.
constexpr int kUnroll = 4;

// A tail (fewer elements than a block) runs through a block of its own,
// zero past the tail's bytes. On AVX-512 a tail is moved with byte-masked
// loads and stores: copied in narrow pieces instead, it would be read back by
// the block's wide load, which the store buffer cannot forward from narrow
// stores, and the block would have to be zeroed first; for a one-element
// tensor that cost more than its update.
#if defined(__AVX512BW__) && defined(__AVX512VL__)
// The low `bytes` bits (bytes < 64).
inline __mmask64 low_bytes(std::size_t bytes) { return (__mmask64{1} << bytes) - 1; }
#else
#if defined(__AVX2__)
// AVX2 masks whole dwords only: a tail of whole dwords (every fp32 and fp64
// tail) is loaded with dword-masked loads, others by the copies below. AMD
// allows a masked-off lane to fault, so a masked load is used only while its
// 32-byte windows stay on the page of the tail's first byte (tested for a
// whole block, one compare: a tail that starts less than a block before a
// page's end takes the copies). Tails are stored by the copies: the
// block's wide store forwards to their narrow loads, and a masked store costs
// more than they do on AMD (Zen 3).
template <std::size_t kBlockBytes>
inline bool masked_tail_fits(const void* p, std::size_t bytes) {
  return (bytes & 3) == 0 && (reinterpret_cast<std::uintptr_t>(p) & 4095) <= 4096 - kBlockBytes;
}

// Lanes below `dwords` set (all eight from 8 on): eight lanes of a table
// of eight set lanes followed by eight clear ones.
inline __m256i first_dwords(std::size_t dwords) {
  alignas(64) static constexpr std::int32_t kLanes[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kLanes + 8 - (dwords < 8 ? dwords : 8)));
}
#endif
// Copies the tail's bytes (0 <= bytes < kBlockBytes) as two copies of the
// largest power of two kBytes not above them, the second one ending at the
// tail's end (they overlap unless bytes is kBytes): below twice their size,
// two copies of one size cover any length, with one compare per size tried.
// Fixed sizes compile to moves; a memcpy of a run-time size is a call.
template <std::size_t kBlockBytes, std::size_t kBytes = kBlockBytes / 2>
[[gnu::always_inline]] inline void copy_tail(void* dst, const void* src, std::size_t bytes) {
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  if constexpr (kBytes <= 1) {
    if (bytes != 0) *d = *s;
  } else {
    if (bytes >= kBytes) {
      std::memcpy(d, s, kBytes);
      std::memcpy(d + bytes - kBytes, s + bytes - kBytes, kBytes);
      return;
    }
    copy_tail<kBlockBytes, kBytes / 2>(dst, src, bytes);
  }
}
#endif

/// Fills block (kBlockBytes, 64-byte aligned) with the `bytes` at src
/// (bytes < kBlockBytes) and zeros after them.
template <std::size_t kBlockBytes>
[[gnu::always_inline]] inline void load_tail(unsigned char* block, const void* src, std::size_t bytes) {
#if defined(__AVX2__) || defined(__AVX512F__)
  static_assert(kBlockBytes == 16 || kBlockBytes == 32 || kBlockBytes == 64 || kBlockBytes == 128,
                "a block is 16, 32, 64 or 128 bytes");
#else
  static_assert(kBlockBytes >= 4 && kBlockBytes <= 128 && (kBlockBytes & (kBlockBytes - 1)) == 0,
                "a block is a power of two from 4 to 128 bytes");  // the baseline's fp16 and 8-bit blocks are 8 and 4
#endif
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  const auto* s = static_cast<const char*>(src);
  if constexpr (kBlockBytes == 128) {
    _mm512_store_si512(block, _mm512_maskz_loadu_epi8(bytes >= 64 ? ~__mmask64{0} : low_bytes(bytes), s));
    _mm512_store_si512(block + 64, bytes > 64 ? _mm512_maskz_loadu_epi8(low_bytes(bytes - 64), s + 64)
                                              : _mm512_setzero_si512());
  } else if constexpr (kBlockBytes == 64) {
    _mm512_store_si512(block, _mm512_maskz_loadu_epi8(low_bytes(bytes), s));
  } else if constexpr (kBlockBytes == 32) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(block),
                       _mm256_maskz_loadu_epi8(static_cast<__mmask32>(low_bytes(bytes)), s));
  } else {
    _mm_store_si128(reinterpret_cast<__m128i*>(block),
                    _mm_maskz_loadu_epi8(static_cast<__mmask16>(low_bytes(bytes)), s));
  }
#else
#if defined(__AVX2__)
  if (masked_tail_fits<kBlockBytes>(src, bytes)) {
    const auto* s = static_cast<const int*>(src);
    if constexpr (kBlockBytes == 16) {
      _mm_store_si128(reinterpret_cast<__m128i*>(block),
                      _mm_maskload_epi32(s, _mm256_castsi256_si128(first_dwords(bytes / 4))));
    } else {
      for (std::size_t off = 0; off < kBlockBytes; off += 32)
        _mm256_store_si256(reinterpret_cast<__m256i*>(block + off),
                           off < bytes ? _mm256_maskload_epi32(s + off / 4, first_dwords((bytes - off) / 4))
                                       : _mm256_setzero_si256());
    }
    return;
  }
#endif
  std::memset(block, 0, kBlockBytes);
  copy_tail<kBlockBytes>(block, src, bytes);
#endif
}

/// Writes the first `bytes` of block (as load_tail filled it) to dst.
template <std::size_t kBlockBytes>
[[gnu::always_inline]] inline void store_tail(void* dst, const unsigned char* block, std::size_t bytes) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  auto* d = static_cast<char*>(dst);
  if constexpr (kBlockBytes == 128) {
    _mm512_mask_storeu_epi8(d, bytes >= 64 ? ~__mmask64{0} : low_bytes(bytes), _mm512_load_si512(block));
    if (bytes > 64) _mm512_mask_storeu_epi8(d + 64, low_bytes(bytes - 64), _mm512_load_si512(block + 64));
  } else if constexpr (kBlockBytes == 64) {
    _mm512_mask_storeu_epi8(d, low_bytes(bytes), _mm512_load_si512(block));
  } else if constexpr (kBlockBytes == 32) {
    _mm256_mask_storeu_epi8(d, static_cast<__mmask32>(low_bytes(bytes)),
                            _mm256_load_si256(reinterpret_cast<const __m256i*>(block)));
  } else {
    _mm_mask_storeu_epi8(d, static_cast<__mmask16>(low_bytes(bytes)),
                         _mm_load_si128(reinterpret_cast<const __m128i*>(block)));
  }
#else
  copy_tail<kBlockBytes>(dst, block, bytes);
#endif
}

/// Whether a tail of one element takes load_one and store_one: not with
/// AVX-512, whose byte-masked moves already take a few instructions for any tail.
#if defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr bool kOneElementTails = false;
#else
constexpr bool kOneElementTails = true;
#endif

/// Fills block (kBlockBytes, 64-byte aligned) with the one element of
/// `es` bytes (1, 2, 4 or 8) at src and zeros after it: load_tail for a tail
/// of one element, the tail of every one-element tensor. The element is read
/// into a register and the block written with whole-register stores, which
/// the block function's wide loads read back from the store buffer; no page
/// test and no copy are needed, since nothing past the element is read.
template <std::size_t kBlockBytes>
[[gnu::always_inline]] inline void load_one(unsigned char* block, const void* src, std::size_t es) {
#if defined(__SSE2__)
  if constexpr (kBlockBytes >= 16) {
    // The element's bytes, zero-extended, in moves of fixed size (a memcpy
    // of es bytes is a call where es is not a constant).
    std::uint64_t x;
    if (es == 4) {
      std::uint32_t y;
      std::memcpy(&y, src, 4);
      x = y;
    } else if (es == 8) {
      std::memcpy(&x, src, 8);
    } else if (es == 2) {
      std::uint16_t y;
      std::memcpy(&y, src, 2);
      x = y;
    } else {
      x = *static_cast<const unsigned char*>(src);
    }
    const __m128i first = _mm_cvtsi64_si128(static_cast<long long>(x));
#if defined(__AVX__)
    if constexpr (kBlockBytes >= 32) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(block), _mm256_zextsi128_si256(first));
      for (std::size_t off = 32; off < kBlockBytes; off += 32)
        _mm256_store_si256(reinterpret_cast<__m256i*>(block + off), _mm256_setzero_si256());
      return;
    }
#endif
    _mm_store_si128(reinterpret_cast<__m128i*>(block), first);
    for (std::size_t off = 16; off < kBlockBytes; off += 16)
      _mm_store_si128(reinterpret_cast<__m128i*>(block + off), _mm_setzero_si128());
    return;
  }
#endif
  std::memset(block, 0, kBlockBytes);  // the baseline's 4- and 8-byte blocks, and targets without SSE2
  std::memcpy(block, src, es);
}

/// Writes the one element of `es` bytes at the start of block to dst
/// (store_tail of a tail of one element).
[[gnu::always_inline]] inline void store_one(void* dst, const unsigned char* block, std::size_t es) {
  if (es == 4) std::memcpy(dst, block, 4);
  else if (es == 8) std::memcpy(dst, block, 8);
  else if (es == 2) std::memcpy(dst, block, 2);
  else *static_cast<unsigned char*>(dst) = *block;
}

template <ScalarType ST, class BlockFn>
inline void for_each_block_rw(char* data, std::int64_t n, BlockFn&& block_fn) {
  constexpr std::size_t es = size_of(ST);
  std::int64_t i = 0;
  for (; i + kUnroll * kWidth <= n; i += kUnroll * kWidth)
    for (int u = 0; u < kUnroll; ++u) block_fn(data + (i + u * kWidth) * es, u);
  for (; i + kWidth <= n; i += kWidth) block_fn(data + i * es, 0);
  if (i < n) {
    alignas(64) unsigned char tail[kWidth * size_of(ST)];
    const std::size_t bytes = static_cast<std::size_t>(n - i) * es;
    if (kOneElementTails && bytes == es) {
      load_one<sizeof tail>(tail, data + i * es, es);
      block_fn(tail, 0);
      store_one(data + i * es, tail, es);
      return;
    }
    load_tail<sizeof tail>(tail, data + i * es, bytes);
    block_fn(tail, 0);
    store_tail<sizeof tail>(data + i * es, tail, bytes);
  }
}

// Whether any lane is NaN: one unordered compare of the register with
// itself. Lane by lane, GCC extracts and compares each lane, which cost a
// one-element grad's check more than its load.
inline bool any_nan(VecF v) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask((__m512)v, (__m512)v, _CMP_UNORD_Q) != 0;
#elif defined(__AVX2__)
  return _mm256_movemask_ps(_mm256_cmp_ps((__m256)v, (__m256)v, _CMP_UNORD_Q)) != 0;
#elif defined(__SSE2__)
  return _mm_movemask_ps(_mm_cmpunord_ps((__m128)v, (__m128)v)) != 0;
#else
  bool any = false;
  for (int j = 0; j < kWidth; ++j) any |= v[j] != v[j];
  return any;
#endif
}
inline bool any_nan(HalfVecD v) {
#if defined(__AVX512F__)
  return _mm512_cmp_pd_mask((__m512d)v, (__m512d)v, _CMP_UNORD_Q) != 0;
#elif defined(__AVX2__)
  return _mm256_movemask_pd(_mm256_cmp_pd((__m256d)v, (__m256d)v, _CMP_UNORD_Q)) != 0;
#elif defined(__SSE2__)
  return _mm_movemask_pd(_mm_cmpunord_pd((__m128d)v, (__m128d)v)) != 0;
#else
  bool any = false;
  for (int j = 0; j < kWidth / 2; ++j) any |= v[j] != v[j];
  return any;
#endif
}
inline bool any_nan(VecD v) { return any_nan(v.lo) || any_nan(v.hi); }

// True when any lane of the accumulators is NaN (see check_chunks).
template <class V>
inline bool any_poisoned(V (&poison)[kUnroll]) {
  for (int u = 1; u < kUnroll; ++u) poison[0] += poison[u];
  return any_nan(poison[0]);
}

#if defined(__AVX512F__)
inline VecF vsqrt(VecF v) { return (VecF)_mm512_sqrt_ps((__m512)v); }
#elif defined(__AVX2__)
inline VecF vsqrt(VecF v) { return (VecF)_mm256_sqrt_ps((__m256)v); }
#elif defined(__SSE2__)
inline VecF vsqrt(VecF v) { return (VecF)_mm_sqrt_ps((__m128)v); }
#elif defined(__aarch64__)
inline VecF vsqrt(VecF v) { return (VecF)vsqrtq_f32((float32x4_t)v); }
#else
inline VecF vsqrt(VecF v) {
  for (int j = 0; j < kWidth; ++j) v[j] = __builtin_sqrtf(v[j]);
  return v;
}
#endif
/// a * b + c rounded once, per lane (fmaf's result): one instruction with
/// AVX-512, AVX2 and FMA, or NEON; a call per lane on x86-64 without FMA.
#if defined(__AVX512F__)
inline VecF vfma(VecF a, VecF b, VecF c) { return (VecF)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
#elif defined(__AVX2__) && defined(__FMA__)
inline VecF vfma(VecF a, VecF b, VecF c) { return (VecF)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#elif defined(__aarch64__)
inline VecF vfma(VecF a, VecF b, VecF c) {
  return (VecF)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b);  // c + a * b, rounded once
}
#else
inline VecF vfma(VecF a, VecF b, VecF c) {
  for (int j = 0; j < kWidth; ++j) a[j] = __builtin_fmaf(a[j], b[j], c[j]);
  return a;
}
#endif
#if defined(__AVX512F__)
inline HalfVecD vsqrt_half(HalfVecD v) { return (HalfVecD)_mm512_sqrt_pd((__m512d)v); }
#elif defined(__AVX2__)
inline HalfVecD vsqrt_half(HalfVecD v) { return (HalfVecD)_mm256_sqrt_pd((__m256d)v); }
#elif defined(__SSE2__)
inline HalfVecD vsqrt_half(HalfVecD v) { return (HalfVecD)_mm_sqrt_pd((__m128d)v); }
#elif defined(__aarch64__)
inline HalfVecD vsqrt_half(HalfVecD v) { return (HalfVecD)vsqrtq_f64((float64x2_t)v); }
#else
inline HalfVecD vsqrt_half(HalfVecD v) {
  for (int j = 0; j < kWidth / 2; ++j) v[j] = __builtin_sqrt(v[j]);
  return v;
}
#endif
inline VecD vsqrt(VecD v) { return {vsqrt_half(v.lo), vsqrt_half(v.hi)}; }
inline VecF vmax(VecF a, VecF b) { return a > b ? a : b; }
// x in every lane, as x itself (-0 stays -0, as ScalarOps::splat keeps it):
// x - 0 is x, so the compiler broadcasts x (from memory, without an ALU
// instruction) where 0 + x, which turns -0 into +0, had to be computed.
inline VecF splat(float x) { return x - VecF{}; }

// Prefetches the element `ahead` of a walk over n elements at base, or, past
// the end, element ahead - n of the next_n that follow at next.
inline void prefetch_ahead(const char* base, const char* next, std::int64_t next_n, std::size_t elem_size,
                           std::int64_t n, std::int64_t ahead) {
  if (ahead < n) __builtin_prefetch(base + ahead * elem_size);
  else if (ahead - n < next_n) __builtin_prefetch(next + (ahead - n) * elem_size);
}

// Runs block_fn(block, u) over n elements at src in blocks of kWidth, as
// kUnroll interleaved streams: stream u covers the u-th of kUnroll equal runs
// of whole blocks and feeds accumulator u; the blocks left over feed
// accumulator 0, the tail through a zero-padded copy. The assignment of
// blocks to accumulators depends on n alone, so reductions are
// deterministic. A read-only pass is bound by the cache-line misses a core
// keeps in flight, not by the memory system: four streams per core keep more
// of them in flight than one (docs/engine.md). Every stream is
// prefetched kReadPrefetchElements ahead and, near its end, on into the same
// stream of the next_n elements at next (the following chunk; next_n = 0
// when none), so that small chunks (one 4,096-element tensor each) do not
// start three of their four streams on cold misses.
template <ScalarType ST, class BlockFn>
inline void for_each_block_read(const char* src, const char* next, std::int64_t next_n, std::int64_t n,
                                BlockFn&& block_fn) {
  constexpr std::size_t es = size_of(ST);
  if (kOneElementTails && n == 1) {  // a chunk of one element (a one-element tensor's): no streams to set up
    alignas(64) unsigned char one[kWidth * size_of(ST)];
    load_one<sizeof one>(one, src, es);
    block_fn(one, 0);
    return;
  }
  const auto run_of = [](std::int64_t count) { return count / (kUnroll * kWidth) * kWidth; };
  const std::int64_t run = run_of(n), next_run = run_of(next_n);
  for (std::int64_t i = 0; i < run; i += kWidth)
    for (int u = 0; u < kUnroll; ++u) {
      // Stream u: run elements at src + u * run, continued by the next chunk's stream u.
      prefetch_ahead(src + u * run * es, next + u * next_run * es, next_run, es, run, i + kReadPrefetchElements);
      if constexpr (kWidth * es > 64)  // fp64 with AVX-512: a block's second cache line, as for_each_block_lists
        prefetch_ahead(src + u * run * es, next + u * next_run * es, next_run, es, run,
                       i + kReadPrefetchElements + static_cast<std::int64_t>(64 / es));
      block_fn(src + (u * run + i) * es, u);
    }
  std::int64_t i = kUnroll * run;
  for (; i + kWidth <= n; i += kWidth) {
    prefetch_ahead(src, next, next_n, es, n, i + kReadPrefetchElements);
    if constexpr (kWidth * es > 64)
      prefetch_ahead(src, next, next_n, es, n, i + kReadPrefetchElements + static_cast<std::int64_t>(64 / es));
    block_fn(src + i * es, 0);
  }
  if (i < n) {
    alignas(64) unsigned char tail[kWidth * size_of(ST)];
    if (kOneElementTails && n - i == 1) load_one<sizeof tail>(tail, src + i * es, es);
    else load_tail<sizeof tail>(tail, src + i * es, static_cast<std::size_t>(n - i) * es);
    block_fn(tail, 0);
  }
}

// Several lists side by side (param, grad, moments): calls
// block_fn(blocks) with blocks[l] the storage of kWidth elements of list l.
// kUsed has bit l set for each list the kernel uses (the others may have a
// null base and get a null block). The tail goes through zero-padded copies;
// only lists in kWritten are copied back (grads are never written, not even
// with their own bytes). Each used list is prefetched
// max(kPrefetchElements, kPrefetchBytes / the bytes of an element of every
// used list) elements ahead, continuing near the end into the first next_n
// elements at `next` (the following chunk's bases; next_n = 0 when none).
template <int Depth, unsigned kUsed, unsigned kWritten, class BlockFn>
inline void for_each_block_lists(char* const (&base)[Depth], char* const* next, std::int64_t next_n,
                                 const std::size_t (&elem_size)[Depth], std::int64_t n, BlockFn&& block_fn) {
  constexpr auto used = [](int l) { return ((kUsed >> l) & 1u) != 0; };
  constexpr auto written = [](int l) { return ((kWritten >> l) & 1u) != 0; };
  void* blocks[Depth] = {};
  std::size_t element_bytes = 0;
  #pragma GCC unroll 16
  for (int l = 0; l < Depth; ++l) element_bytes += used(l) ? elem_size[l] : 0;
  const std::int64_t by_bytes = kPrefetchBytes / static_cast<std::int64_t>(element_bytes > 0 ? element_bytes : 1);
  const std::int64_t distance = by_bytes > kPrefetchElements ? by_bytes : kPrefetchElements;
  std::int64_t i = 0;
  for (; i + kWidth <= n; i += kWidth) {
    const std::int64_t ahead = i + distance;
    #pragma GCC unroll 16  // a list left out of kUsed then costs nothing
    for (int l = 0; l < Depth; ++l) {
      if (!used(l)) continue;
      blocks[l] = base[l] + i * elem_size[l];
      prefetch_ahead(base[l], next ? next[l] : nullptr, next_n, elem_size[l], n, ahead);
      // A block of fp64 lanes with AVX-512 spans two cache lines: one
      // prefetch per block left every other line to the hardware, which
      // fell behind (docs/engine.md).
      // Here, not inside prefetch_ahead: written there, the extra branch
      // made GCC 12 emit no prefetch at all in several kernels.
      if (kWidth * elem_size[l] > 64)
        prefetch_ahead(base[l], next ? next[l] : nullptr, next_n, elem_size[l], n,
                       ahead + static_cast<std::int64_t>(64 / elem_size[l]));
    }
    block_fn(blocks);
  }
  if (i < n) {
    constexpr std::size_t kBlockBytes = kWidth * kMaxElementSize;
    alignas(64) unsigned char tail[Depth][kBlockBytes];
    // A tail of one element (a chunk of kWidth * k + 1 elements; a chunk of
    // one element does not get here, see for_one_element_lists) is moved as one
    // scalar per list: no page test, no lane mask, no copies (load_one).
    const bool one = kOneElementTails && n - i == 1;
    #pragma GCC unroll 16  // a list left out of kUsed then costs nothing
    for (int l = 0; l < Depth; ++l) {
      if (!used(l)) continue;
      assert(elem_size[l] <= kMaxElementSize && "an element is at most 8 bytes");
      if (one) load_one<kBlockBytes>(tail[l], base[l] + i * elem_size[l], elem_size[l]);
      else load_tail<kBlockBytes>(tail[l], base[l] + i * elem_size[l], static_cast<std::size_t>(n - i) * elem_size[l]);
      blocks[l] = tail[l];
    }
    block_fn(blocks);
    #pragma GCC unroll 16  // a list left out of kUsed then costs nothing
    for (int l = 0; l < Depth; ++l) {
      if (!used(l) || !written(l)) continue;
      if (one) store_one(base[l] + i * elem_size[l], tail[l], elem_size[l]);
      else store_tail<kBlockBytes>(base[l] + i * elem_size[l], tail[l], static_cast<std::size_t>(n - i) * elem_size[l]);
    }
  }
}

// The first element of chunk ch in list l: list 0 (the parameter) at the
// chunk's place, the others at its begin (the same but in a plan of runs).
template <int Depth>
[[gnu::always_inline]] inline char* element_of(void* const* const (&lists)[Depth], int l, const ChunkRef& ch,
                                               const std::size_t (&elem_size)[Depth]) {
  return static_cast<char*>(lists[l][ch.tensor]) +
         (l == 0 ? ch.place : ch.begin) * static_cast<std::int64_t>(elem_size[l]);
}

// for_each_block_lists over chunk ch of one element (n == 1,
// kOneElementTails): one block through zero-padded copies made by load_one,
// the written lists stored back by store_one.
template <int Depth, unsigned kUsed, unsigned kWritten, class BlockFn>
[[gnu::always_inline]] inline void for_one_element_lists(void* const* const (&lists)[Depth], const ChunkRef& ch,
                                                         const std::size_t (&elem_size)[Depth], BlockFn&& block_fn) {
  constexpr std::size_t kBlockBytes = kWidth * kMaxElementSize;
  alignas(64) unsigned char tail[Depth][kBlockBytes];
  char* at[Depth] = {};
  void* blocks[Depth] = {};
  #pragma GCC unroll 16  // a list left out of kUsed then costs nothing
  for (int l = 0; l < Depth; ++l) {
    if (((kUsed >> l) & 1u) == 0) continue;
    assert(elem_size[l] <= kMaxElementSize && "an element is at most 8 bytes");
    at[l] = element_of(lists, l, ch, elem_size);
    load_one<kBlockBytes>(tail[l], at[l], elem_size[l]);
    blocks[l] = tail[l];
  }
  block_fn(blocks);
  #pragma GCC unroll 16
  for (int l = 0; l < Depth; ++l)
    if (((kUsed >> l) & 1u) != 0 && ((kWritten >> l) & 1u) != 0) store_one(at[l], tail[l], elem_size[l]);
}

struct VecOps {
  static VecF splat(float x) { return ::ampfuse::sdk::cpu::AMPFUSE_CPU_ISA::splat(x); }
  static VecF max(VecF a, VecF b) { return vmax(a, b); }
  static VecF min(VecF a, VecF b) { return a < b ? a : b; }
  static VecF sqrt(VecF x) { return vsqrt(x); }
  static VecF fma(VecF a, VecF b, VecF c) { return vfma(a, b, c); }
  /// -1, 0 or 1 per lane (0 for +-0 and NaN), as torch.sign.
  static VecF sign(VecF x) {
    const VecF one = splat(1.f), zero = {};
    return (x > zero ? one : zero) - (x < zero ? one : zero);
  }
};

/// VecOps for blocks of fp64 lanes (fp64 storage).
struct VecOpsD {
  static VecD splat(double x) { return {x - HalfVecD{}, x - HalfVecD{}}; }  // as splat(float)
  static VecD max(VecD a, VecD b) { return select_d(a > b, a, b); }
  static VecD min(VecD a, VecD b) { return select_d(a < b, a, b); }
  static VecD sqrt(VecD x) { return vsqrt(x); }
  static VecD sign(VecD x) {
    const VecD one = splat(1.0), zero = {};
    return select_d(x > zero, one, zero) - select_d(x < zero, one, zero);
  }
};

/// The ops and the opmath scalar of storage type ST's lanes.
template <ScalarType ST>
struct OpmathOf {
  using Ops = VecOps;
  using scalar = float;
};
template <>
struct OpmathOf<ScalarType::Float64> {
  using Ops = VecOpsD;
  using scalar = double;
};
template <ScalarType ST>
using OpsOf = typename OpmathOf<ST>::Ops;
/// float, or double for Float64: the type hyperparameters are narrowed to.
template <ScalarType ST>
using opmath_t = typename OpmathOf<ST>::scalar;

/// Grads times a factor (inv_scale * clip_coef, sdk::cpu_grad_factor(), in
/// double): the factor rounded once to opmath_t<ST> (24 significant bits for
/// fp32), and each block of grads multiplied by it. Made and used inside the
/// kernel, under FlushSubnormals: there a float factor below 2^-126 (the
/// inverse of a scale of 2^127, which GradScaler reaches when no grad
/// overflows for long enough; or a smaller scale's inverse times a clip
/// coefficient) would read as 0 and zero every grad. Such a factor f is
/// applied as two normal ones, (g * fl(f * 2^64)) * 2^-64: rounded to 24 bits
/// as a normal factor is (not to fp32's subnormal grid), and the product
/// rounded once, wherever it is normal (a subnormal product is flushed, as
/// every subnormal result is). For an f that is an fp32 value (an inverse
/// scale alone), that is the bits of g * f. Take the factor as the adapter's
/// double: a float argument rounded on the host keeps a subnormal, but the
/// kernel's first use of it reads 0.
///   const GradFactor<ST> factor(a.grad_factor);  ...  g = factor(load_block<ST>(grad));
template <ScalarType ST>
class GradFactor {
 public:
  using V = Lanes<ST>;
  explicit GradFactor(double f) {
    using T = opmath_t<ST>;
    const ScalarGradFactor<T> s(f);  // ampfuse/sdk/math.h: the rule, once for CPU and CUDA
    hi_ = OpsOf<ST>::splat(s.hi);
    lo_ = OpsOf<ST>::splat(s.lo);
    split_ = s.lo != T(1);
    one_ = !split_ && s.hi == T(1);
  }
  V operator()(V g) const { return split_ ? (g * hi_) * lo_ : g * hi_; }
  /// Whether the factor is 1 (g * 1 is g: a kernel may skip the multiply).
  bool is_one() const { return one_; }

 private:
  V hi_{}, lo_{};
  bool split_ = false;
  bool one_ = false;
};

/// Sum of the lanes, in a fixed order (deterministic).
inline float horizontal_sum(VecF v) {
  float s = 0.f;
  for (int j = 0; j < kWidth; ++j) s += v[j];
  return s;
}

/// The executor: for every chunk in [chunk_begin, chunk_end) of `plan`, runs
/// block_fn(tensor, blocks) over the chunk's elements kWidth at a
/// time, blocks[l] pointing at the storage of list l (lists[l][tensor],
/// offset to the block; elem_size[l] bytes per element). kUsed has bit l set
/// for each list the kernel touches (others may be null); kWritten for each
/// list the kernel stores to: only those are copied back from the
/// zero-padded tail block (grads are never written, not even with their own
/// bytes). chunk_fn(tensor, chunk) runs after each chunk's last block, for
/// per-chunk results such as partial sums.
/// List 0 is the parameter: in a plan of runs (a parameter with gaps, taken
/// in place by KeptLists::gather for an optimizer whose
/// updates_runs_in_place() is true) it is walked run by run where it lies,
/// the other lists densely; block_fn sees the same blocks either way.
template <int Depth, unsigned kUsed, unsigned kWritten, class BlockFn, class ChunkFn>
inline void for_each_chunk_block(const PlanRef& plan, std::int64_t chunk_begin, std::int64_t chunk_end,
                                 void* const* const (&lists)[Depth], const std::size_t (&elem_size)[Depth],
                                 BlockFn&& block_fn, ChunkFn&& chunk_fn) {
  const auto bases = [&](const ChunkRef& ch, char* (&base)[Depth]) {
    #pragma GCC unroll 16  // a list left out of kUsed then costs nothing
    for (int l = 0; l < Depth; ++l)
      base[l] = ((kUsed >> l) & 1u) != 0 ? element_of(lists, l, ch, elem_size) : nullptr;
  };
  for_each_chunk_ahead(plan, chunk_begin, chunk_end, [&](const ChunkRef& ch, const ChunkRef* next, const ChunkRef* far) {
    if (far != nullptr) {
      #pragma GCC unroll 16  // a list left out of kUsed then costs nothing
      for (int l = 0; l < Depth; ++l)
        if (((kUsed >> l) & 1u) != 0)
          __builtin_prefetch(element_of(lists, l, *far, elem_size));
    }
    if (kOneElementTails && ch.n == 1) {
      for_one_element_lists<Depth, kUsed, kWritten>(lists, ch, elem_size,
                                                    [&](void* const (&blocks)[Depth]) { block_fn(ch.tensor, blocks); });
    } else {
      char* base[Depth];
      char* next_base[Depth] = {};
      bases(ch, base);
      if (next != nullptr && ch.n >= kWidth) bases(*next, next_base);  // read by the block loop only
      if (plan.slot_begin != nullptr && next != nullptr && ((kUsed & 1u) != 0)) {
        // A plan of runs: the next run of list 0 lies elsewhere, where no
        // hardware prefetcher follows; its first lines are asked for now, a
        // whole run ahead (the block loop's prefetch reaches them only
        // kPrefetchElements before they are read, less than a miss takes).
        const char* const first = element_of(lists, 0, *next, elem_size);
        const std::int64_t bytes = next->n * static_cast<std::int64_t>(elem_size[0]);
        for (std::int64_t b = 0; b < bytes && b < kRunLeadBytes; b += 64) __builtin_prefetch(first + b);
      }
      for_each_block_lists<Depth, kUsed, kWritten>(base, next_base, next ? next->n : 0, elem_size, ch.n,
                                                   [&](void* const (&blocks)[Depth]) { block_fn(ch.tensor, blocks); });
    }
    chunk_fn(ch.tensor, ch.chunk);
  });
}

/// The same without a per-chunk function.
template <int Depth, unsigned kUsed, unsigned kWritten, class BlockFn>
inline void for_each_chunk_block(const PlanRef& plan, std::int64_t chunk_begin, std::int64_t chunk_end,
                                 void* const* const (&lists)[Depth], const std::size_t (&elem_size)[Depth],
                                 BlockFn&& block_fn) {
  for_each_chunk_block<Depth, kUsed, kWritten>(plan, chunk_begin, chunk_end, lists, elem_size,
                                               std::forward<BlockFn>(block_fn), [](std::int64_t, std::int64_t) {});
}

}  // namespace
}  // namespace ampfuse::sdk::cpu::AMPFUSE_CPU_ISA
