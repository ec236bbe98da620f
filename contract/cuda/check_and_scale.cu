// The engine's first users on CUDA: the read-only non-finite check (with an
// optional sum of squares for gradient clipping) and the in-place scale.

#include <cub/block/block_reduce.cuh>

#include "contract/cuda/multi_tensor.cuh"

namespace ampfuse::cuda {
namespace detail {
namespace {

struct CheckWorkspace {
  double* partials;    // one per block
  unsigned* counter;   // blocks done; zeroed before the launch
};

// Calls f(x) for each element of the block's chunk (in opmath), 16-byte loads
// when the chunk start is aligned, element loads otherwise and for the tail.
template <class T, class F>
__device__ __forceinline__ void for_each_element_read(const T* p, std::int64_t n, F&& f) {
  using V = Vec16<T>;
  std::int64_t i = threadIdx.x;
  std::int64_t tail = 0;
  if (is_aligned16(p)) {
    const VectorSplit split = vector_split(n, V::kSize);
    const V* pv = reinterpret_cast<const V*>(p);
    for (; i < split.num_vec; i += blockDim.x) {
      const V v = pv[i];
#pragma unroll
      for (int k = 0; k < V::kSize; ++k) f(to_opmath(v.v[k]));
    }
    tail = split.tail_begin;
    i = tail + threadIdx.x;
  }
  for (; i < n; i += blockDim.x) f(to_opmath(p[i]));
}

template <class T, bool kSumSq, class Meta>
__global__ void __launch_bounds__(kBlockSize)
    check_kernel(Meta meta, float* found_inf, SumSq sum_sq, CheckWorkspace ws) {
  const BlockChunk c = locate_chunk(meta, blockIdx.x);
  const T* p = static_cast<const T*>(meta.data(0, c.slot)) + c.begin;
  bool non_finite = false;
  double acc = 0.0;  // fp64, as on the CPU: the norm feeds clipping of every parameter
  for_each_element_read(p, c.size, [&](opmath_t<T> x) {
    non_finite |= !isfinite(x);
    if (kSumSq) acc += static_cast<double>(x) * static_cast<double>(x);
  });
  // A sum, never a flag compare, is what consumers test (found_inf != 0).
  if (__syncthreads_or(non_finite) && threadIdx.x == 0) *found_inf = 1.f;
  if constexpr (kSumSq) {
    using Reduce = cub::BlockReduce<double, kBlockSize>;
    __shared__ typename Reduce::TempStorage temp;
    __shared__ bool is_last;
    const double block_sum = Reduce(temp).Sum(acc);
    if (threadIdx.x == 0) {
      ws.partials[blockIdx.x] = block_sum;
      __threadfence();
      is_last = atomicAdd(ws.counter, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (is_last) {
      // The last block to finish reduces the partials in a fixed order, so the
      // result does not depend on block scheduling.
      __threadfence();
      double total = 0.0;
      for (unsigned b = threadIdx.x; b < gridDim.x; b += blockDim.x) total += __ldcg(ws.partials + b);
      __syncthreads();  // temp is reused
      total = Reduce(temp).Sum(total);
      if (threadIdx.x == 0) {
        if (sum_sq.f64 != nullptr) *sum_sq.f64 += total;
        else *sum_sq.f32 = static_cast<float>(static_cast<double>(*sum_sq.f32) + total);
      }
    }
  }
}

template <class T, bool kCheck, class Meta>
__global__ void __launch_bounds__(kBlockSize) scale_kernel(Meta meta, const float* scale, const double* scale_f64,
                                                           float* found_inf) {
  const BlockChunk c = locate_chunk(meta, blockIdx.x);
  T* p = static_cast<T*>(meta.data(0, c.slot)) + c.begin;
  // An fp32 scale as ATen applies it (for double storage, the float scale in
  // double). An fp64 one (the GradScaler's deferred inv_scale * clip_coef) as
  // the optimizers' kernels apply their grad factor (ScalarGradFactor: 24
  // bits also below 2^-126), so that the grads left after the step are what
  // the update used.
  const bool f32 = scale != nullptr;
  const opmath_t<T> s = f32 ? static_cast<opmath_t<T>>(*scale) : opmath_t<T>(1);
  const sdk::ScalarGradFactor<opmath_t<T>> factor(f32 ? 1.0 : *scale_f64);
  bool non_finite = false;
  auto scaled = [&](T v) {
    const opmath_t<T> x = to_opmath(v);
    if (kCheck) non_finite |= !isfinite(x);
    return from_opmath<T>(f32 ? x * s : factor(x));
  };
  using V = Vec16<T>;
  std::int64_t i = threadIdx.x;
  if (is_aligned16(p)) {
    const VectorSplit split = vector_split(c.size, V::kSize);
    V* pv = reinterpret_cast<V*>(p);
    for (; i < split.num_vec; i += blockDim.x) {
      V v = pv[i];
#pragma unroll
      for (int k = 0; k < V::kSize; ++k) v.v[k] = scaled(v.v[k]);
      pv[i] = v;
    }
    i = split.tail_begin + threadIdx.x;
  }
  for (; i < c.size; i += blockDim.x) p[i] = scaled(p[i]);
  if (kCheck && __syncthreads_or(non_finite) && threadIdx.x == 0) *found_inf = 1.f;
}

}  // namespace
}  // namespace detail

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return 0;
  }
  return n;
}

std::size_t check_workspace_bytes(std::int64_t num_chunks) {
  return static_cast<std::size_t>(num_chunks) * sizeof(double) + sizeof(unsigned);
}

void check_non_finite(const sdk::cuda::LaunchMeta& meta, ScalarType dtype, float* found_inf, SumSq sum_sq,
                      void* workspace, sdk::cuda::Stream stream) {
  using namespace detail;
  if (meta.num_chunks == 0) return;
  CheckWorkspace ws{nullptr, nullptr};
  if (sum_sq.wanted()) {
    ws.partials = static_cast<double*>(workspace);
    ws.counter = reinterpret_cast<unsigned*>(ws.partials + meta.num_chunks);
    check_cuda(cudaMemsetAsync(ws.counter, 0, sizeof(unsigned), stream), "cudaMemsetAsync");
  }
  dispatch_dtype<true>(dtype, [&](auto tag) {
    using T = decltype(tag);
    launch_with_meta<1>(meta, [&](auto m, dim3 grid) {
      if (sum_sq.wanted())
        check_kernel<T, true><<<grid, kBlockSize, 0, stream>>>(m, found_inf, sum_sq, ws);
      else
        check_kernel<T, false><<<grid, kBlockSize, 0, stream>>>(m, found_inf, sum_sq, ws);
    });
  });
}

void scale(const sdk::cuda::LaunchMeta& meta, ScalarType dtype, const float* scale, const double* scale_f64,
           float* found_inf, sdk::cuda::Stream stream) {
  using namespace detail;
  dispatch_dtype<true>(dtype, [&](auto tag) {
    using T = decltype(tag);
    launch_with_meta<1>(meta, [&](auto m, dim3 grid) {
      if (found_inf != nullptr)
        scale_kernel<T, true><<<grid, kBlockSize, 0, stream>>>(m, scale, scale_f64, found_inf);
      else
        scale_kernel<T, false><<<grid, kBlockSize, 0, stream>>>(m, scale, scale_f64, found_inf);
    });
  });
}

}  // namespace ampfuse::cuda
