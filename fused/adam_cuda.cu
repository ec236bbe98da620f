// FusedAdam on CUDA: one launch per parameter group and dtype.

#include "contract/cuda/multi_tensor.cuh"
#include "fused/adam_cuda.h"

namespace ampfuse::fused::cuda {
namespace {

using namespace ampfuse::cuda::detail;

template <class T, bool kAmsgrad, class Meta>
__global__ void __launch_bounds__(kBlockSize) adam_kernel(Meta meta, AdamCudaArgs args) {
  // Rule 1 of the contract: found_inf is final before this launch and the
  // same for every block, so a skipped step returns before any write.
  if (args.found_inf != nullptr && *args.found_inf != 0.f) return;
  const BlockChunk c = locate_chunk(meta, blockIdx.x);
  float* step_ptr = static_cast<float*>(meta.data(kStep, c.slot));
  __shared__ float old_step;
  if (threadIdx.x == 0) old_step = *step_ptr;
  __syncthreads();
  const float step = old_step + 1.f;
  const AdamStepScalars s = adam_step_scalars(args.lr, args.beta1, args.beta2, step);
  float grad_factor = 1.f;
  if (args.inv_scale != nullptr) grad_factor *= *args.inv_scale;
  if (args.clip_coef != nullptr) grad_factor *= *args.clip_coef;

  T* p = static_cast<T*>(meta.data(kParam, c.slot)) + c.begin;
  const T* g = static_cast<const T*>(meta.data(kGrad, c.slot)) + c.begin;
  T* m = static_cast<T*>(meta.data(kExpAvg, c.slot)) + c.begin;
  T* v = static_cast<T*>(meta.data(kExpAvgSq, c.slot)) + c.begin;
  T* vmax = kAmsgrad ? static_cast<T*>(meta.data(kMaxExpAvgSq, c.slot)) + c.begin : nullptr;

  auto update = [&](T& pe, T ge, T& me, T& ve, T* vmaxe) {
    float pf = to_float(pe), mf = to_float(me), vf = to_float(ve);
    float vmaxf = kAmsgrad ? to_float(*vmaxe) : 0.f;
    adam_update<float, ScalarOps>(pf, to_float(ge) * grad_factor, mf, vf, &vmaxf, args.hyper, s);
    pe = from_float<T>(pf);
    me = from_float<T>(mf);
    ve = from_float<T>(vf);
    if (kAmsgrad) *vmaxe = from_float<T>(vmaxf);
  };

  using V = Vec16<T>;
  std::int64_t i = threadIdx.x;
  const bool aligned = is_aligned16(p) && is_aligned16(g) && is_aligned16(m) && is_aligned16(v) &&
                       (!kAmsgrad || is_aligned16(vmax));
  if (aligned) {
    const std::int64_t num_vec = c.size / V::kSize;
    for (; i < num_vec; i += blockDim.x) {
      V pv = reinterpret_cast<V*>(p)[i], mv = reinterpret_cast<V*>(m)[i], vv = reinterpret_cast<V*>(v)[i];
      const V gv = reinterpret_cast<const V*>(g)[i];
      V xv;
      if (kAmsgrad) xv = reinterpret_cast<V*>(vmax)[i];
#pragma unroll
      for (int k = 0; k < V::kSize; ++k) update(pv.v[k], gv.v[k], mv.v[k], vv.v[k], &xv.v[k]);
      reinterpret_cast<V*>(p)[i] = pv;
      reinterpret_cast<V*>(m)[i] = mv;
      reinterpret_cast<V*>(v)[i] = vv;
      if (kAmsgrad) reinterpret_cast<V*>(vmax)[i] = xv;
    }
    i = num_vec * V::kSize + threadIdx.x;
  }
  for (; i < c.size; i += blockDim.x) update(p[i], g[i], m[i], v[i], kAmsgrad ? vmax + i : nullptr);

  // Rule 4: the step advances once per tensor, after all its blocks read it.
  once_per_tensor_after_reads(meta, c.slot, args.counters, [&] { *step_ptr = step; });
}

}  // namespace

void adam(const ampfuse::cuda::LaunchMeta& meta, ScalarType dtype, const AdamCudaArgs& args,
          ampfuse::cuda::Stream stream) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    if (args.hyper.amsgrad) {
      launch_with_meta<6>(meta, [&](auto m, dim3 grid) {
        adam_kernel<T, true><<<grid, kBlockSize, 0, stream>>>(m, args);
      });
    } else {
      launch_with_meta<5>(meta, [&](auto m, dim3 grid) {
        adam_kernel<T, false><<<grid, kBlockSize, 0, stream>>>(m, args);
      });
    }
  });
}

}  // namespace ampfuse::fused::cuda
