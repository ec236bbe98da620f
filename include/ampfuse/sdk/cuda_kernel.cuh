#pragma once
// CUDA side of the SDK, device part: what ampfuse's own CUDA kernels are
// made of, and what a third-party optimizer's kernel uses. Include it in .cu
// files only (no LibTorch here).
//
// The scheme: one launch per list, one block per chunk (LaunchMeta, from
// ampfuse/sdk/cuda.h). launch_with_meta picks how the metadata travels (in
// the kernel's arguments up to 32 KB, else from device memory) and calls
// your launch lambda with it; in the kernel, locate_chunk gives the block's
// tensor and range, meta.data(list, slot) each list's pointer, and
// for_each_element runs a per-element functor over the range (one element
// per thread and iteration; Vec16, is_aligned16 and vector_split are there
// for a kernel that wants 16-byte loads, as FusedAdam's does; the index math
// lives in ampfuse/sdk/chunk_math.h, host-and-device, so that tests can run
// it on the CPU); block_broadcast hands a per-tensor value read once to the
// whole block; step_skipped and signal_factor apply the scaler contract.
// to_float / from_float convert storage to opmath and back; block_sum reduces
// across a block (CUB); once_per_tensor_after_reads updates per-tensor
// values (step counters) after every block of the tensor has read them.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cub/block/block_reduce.cuh>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "ampfuse/sdk/chunk_math.h"
#include "ampfuse/sdk/cuda.h"
#include "ampfuse/sdk/math.h"

namespace ampfuse::sdk::cuda {

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("ampfuse: ") + what + " failed: " + cudaGetErrorString(err));
}

constexpr int kBlockSize = 512;

/// Metadata carried by value in the kernel's arguments.
template <int Depth>
struct InlineMeta {
  static constexpr std::int64_t kCapacity =
      static_cast<std::int64_t>((kMaxKernelArgBytes - 24) / (8 * Depth + 16));
  std::int64_t num_tensors;
  std::int64_t chunk_size;
  std::int64_t ptr[Depth][kCapacity];
  std::int64_t numel_[kCapacity];
  std::int64_t chunk_offset_[kCapacity + 1];

  __device__ __forceinline__ void* data(int list, std::int64_t t) const {
    return reinterpret_cast<void*>(static_cast<std::intptr_t>(ptr[list][t]));
  }
  __device__ __forceinline__ std::int64_t numel(std::int64_t t) const { return numel_[t]; }
  __device__ __forceinline__ std::int64_t chunk_offset(std::int64_t t) const { return chunk_offset_[t]; }
};

/// Metadata in device memory, uploaded once and reused while the list is unchanged.
template <int Depth>
struct GlobalMeta {
  std::int64_t num_tensors;
  std::int64_t chunk_size;
  const std::int64_t* words;

  __device__ __forceinline__ void* data(int list, std::int64_t t) const {
    return reinterpret_cast<void*>(static_cast<std::intptr_t>(words[list * num_tensors + t]));
  }
  __device__ __forceinline__ std::int64_t numel(std::int64_t t) const { return words[Depth * num_tensors + t]; }
  __device__ __forceinline__ std::int64_t chunk_offset(std::int64_t t) const {
    return words[(Depth + 1) * num_tensors + t];
  }
};

template <int Depth>
InlineMeta<Depth> make_inline_meta(const LaunchMeta& m) {
  static_assert(sizeof(InlineMeta<Depth>) <= 32764, "kernel arguments over 32 KB");
  InlineMeta<Depth> im;
  im.num_tensors = m.num_tensors;
  im.chunk_size = m.chunk_size;
  const std::int64_t n = m.num_tensors;
  for (int l = 0; l < Depth; ++l)
    for (std::int64_t t = 0; t < n; ++t) im.ptr[l][t] = m.host[l * n + t];
  for (std::int64_t t = 0; t < n; ++t) im.numel_[t] = m.host[Depth * n + t];
  for (std::int64_t t = 0; t <= n; ++t) im.chunk_offset_[t] = m.host[(Depth + 1) * n + t];
  return im;
}

/// Runs fn() once per tensor, after every block of that tensor has passed
/// this point; blocks call it after reading a per-tensor value (a step
/// counter, an "initialized" flag) that fn() then updates. Each block takes a
/// ticket after its read (the fence orders the two); the last ticket runs
/// fn() and re-arms the tensor's counter (zero between launches) for the
/// next launch. Call from every thread of the block.
template <class Meta, class F>
__device__ __forceinline__ void once_per_tensor_after_reads(const Meta& meta, std::int64_t slot, unsigned* counters,
                                                            F&& fn) {
  if (threadIdx.x == 0) {
    __threadfence();
    const auto chunks = static_cast<unsigned>(meta.chunk_offset(slot + 1) - meta.chunk_offset(slot));
    if (atomicAdd(&counters[slot], 1u) == chunks - 1) {
      fn();
      counters[slot] = 0;
    }
  }
}

// Storage <-> fp32 (opmath) conversions, round to nearest even.
template <class T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <class T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

/// The type a kernel computes in for storage T: float, or double for double
/// storage (ATen's opmath_t).
template <class T> struct OpmathOf { using type = float; };
template <> struct OpmathOf<double> { using type = double; };
template <class T> using opmath_t = typename OpmathOf<T>::type;

/// Storage <-> opmath conversions (to_float / from_float, or none for double).
template <class T>
__device__ __forceinline__ opmath_t<T> to_opmath(T v) {
  if constexpr (std::is_same<T, double>::value) return v;
  else return to_float(v);
}
template <class T>
__device__ __forceinline__ T from_opmath(opmath_t<T> v) {
  if constexpr (std::is_same<T, double>::value) return v;
  else return from_float<T>(v);
}

/// 16 bytes of T, for the aligned vector path.
template <class T>
struct alignas(16) Vec16 {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

template <ScalarType ST> struct StorageOf;
template <> struct StorageOf<ScalarType::Float32> { using type = float; };
template <> struct StorageOf<ScalarType::Float16> { using type = __half; };
template <> struct StorageOf<ScalarType::BFloat16> { using type = __nv_bfloat16; };
template <> struct StorageOf<ScalarType::Float64> { using type = double; };

/// Calls f(T{}) with T the storage type of dtype. Float64 is dispatched only
/// when kFloat64 (the kernel computes in opmath_t<T>); otherwise, as for any
/// dtype the kernel was not built for, it throws.
template <bool kFloat64 = false, class F>
void dispatch_dtype(ScalarType dtype, F&& f) {
  switch (dtype) {
    case ScalarType::Float32: return f(float{});
    case ScalarType::Float16: return f(__half{});
    case ScalarType::BFloat16: return f(__nv_bfloat16{});
    case ScalarType::Float64:
      if constexpr (kFloat64) return f(double{});
      break;
  }
  throw std::runtime_error("ampfuse: internal error: a CUDA kernel was given a dtype it was not built for");
}

/// Launches kernel<Meta> over every chunk once: metadata in the arguments when
/// it fits, else from device memory. `launch(meta_value, grid)` does the launch.
template <int Depth, class Launch>
void launch_with_meta(const LaunchMeta& m, Launch&& launch) {
  if (m.num_chunks == 0) return;
  if (m.depth != Depth)
    throw std::runtime_error("ampfuse: internal error: launch metadata packed for " + std::to_string(m.depth) +
                             " lists, kernel built for " + std::to_string(Depth));
  if (m.num_chunks > 0x7FFFFFFF) throw std::runtime_error("ampfuse: list has more than 2^31 - 1 chunks");
  const dim3 grid(static_cast<unsigned>(m.num_chunks));
  if (m.device == nullptr) {
    if (m.num_tensors > InlineMeta<Depth>::kCapacity)
      throw std::runtime_error("ampfuse: internal error: list too long for kernel arguments and no device metadata");
    launch(make_inline_meta<Depth>(m), grid);
  } else {
    launch(GlobalMeta<Depth>{m.num_tensors, m.chunk_size, m.device}, grid);
  }
  check_cuda(cudaGetLastError(), "kernel launch");
}

/// Sum of v over the block's threads (CUB BlockReduce, a fixed tree:
/// deterministic); the result is valid in thread 0. Call from every thread
/// of a block of exactly kBlockSize threads (launch_with_meta's launches).
template <class T>
__device__ __forceinline__ T block_sum(T v) {
  using Reduce = cub::BlockReduce<T, kBlockSize>;
  __shared__ typename Reduce::TempStorage storage;
  const T s = Reduce(storage).Sum(v);
  __syncthreads();  // storage may be reused by a following call
  return s;
}

/// Contract rule 1 on the device: true when the step is skipped
/// (*found_inf != 0; a sum, so never compare with 1). found_inf is final
/// before the launch and equal for every block, so a kernel that returns
/// when this is true, before its first write, writes nothing at all. Null:
/// no scaler, never skipped.
__device__ __forceinline__ bool step_skipped(const float* found_inf) {
  return found_inf != nullptr && *found_inf != 0.f;
}

/// inv_scale * clip_coef, each 1 when null, in double (exact: two fp32 values).
__device__ __forceinline__ double signal_factor_value(const float* inv_scale, const float* clip_coef) {
  double f = 1.0;
  if (inv_scale != nullptr) f *= static_cast<double>(*inv_scale);
  if (clip_coef != nullptr) f *= static_cast<double>(*clip_coef);
  return f;
}

/// Contract rule 2 on the device: what grads are multiplied by, inv_scale *
/// clip_coef (each 1 when null), applied in T (the kernel's opmath: fp32, or
/// fp64 for fp64 storage) with T's full precision (ScalarGradFactor,
/// ampfuse/sdk/math.h: below 2^-126, a scale near 2^127 times a clip
/// coefficient, an fp32 factor is split in two normal ones), the same bits
/// as the CPU kernels' sdk::cpu::GradFactor:
///   const ScalarGradFactor<float> factor = signal_factor<float>(args.inv_scale, args.clip_coef);
///   ... update(p[i], factor(to_float(g[i])), ...);
template <class T = float>
__device__ __forceinline__ ScalarGradFactor<T> signal_factor(const float* inv_scale, const float* clip_coef) {
  return ScalarGradFactor<T>(signal_factor_value(inv_scale, clip_coef));
}

/// The same factor as one T: fl(inv_scale * clip_coef). Kept for kernels
/// written against it; below 2^-126 an fp32 factor is subnormal and keeps
/// fewer than 24 significant bits, where signal_factor keeps them all.
template <class T = float>
__device__ __forceinline__ T signal_grad_factor(const float* inv_scale, const float* clip_coef) {
  return static_cast<T>(signal_factor_value(inv_scale, clip_coef));
}

/// *p read once by the block (thread 0) and handed to every thread: a
/// per-tensor value such as a step counter, which
/// once_per_tensor_after_reads may then update. Call from every thread; T
/// must be trivially constructible (it lives in shared memory).
template <class T>
__device__ __forceinline__ T block_broadcast(const T* p) {
  __shared__ T value;
  if (threadIdx.x == 0) value = *p;
  __syncthreads();
  const T v = value;
  __syncthreads();  // value may be reused by a following call
  return v;
}

/// Calls f(i) for every element i of the block's chunk [0, c.size), each
/// thread taking i = threadIdx.x, threadIdx.x + blockDim.x, ... The
/// per-element functor reads and writes its lists at i itself.
template <class F>
__device__ __forceinline__ void for_each_element(const BlockChunk& c, F&& f) {
  for (std::int64_t i = threadIdx.x; i < c.size; i += blockDim.x) f(i);
}

}  // namespace ampfuse::sdk::cuda
