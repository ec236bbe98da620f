// FusedSGD on CUDA: one launch per parameter group and dtype.

#include "contract/cuda/multi_tensor.cuh"
#include "fused/sgd/sgd_cuda.h"

namespace ampfuse::fused::cuda {
namespace {

using namespace ampfuse::cuda::detail;

template <class T, bool kMomentum, class Meta>
__global__ void __launch_bounds__(kBlockSize) sgd_kernel(Meta meta, SgdCudaArgs args) {
  using Op = opmath_t<T>;
  if (step_skipped(args.found_inf)) return;  // contract rule 1: before any write
  const BlockChunk c = locate_chunk(meta, blockIdx.x);
  float* flag = kMomentum ? static_cast<float*>(meta.data(kSgdInitialized, c.slot)) : nullptr;
  const bool is_first = kMomentum && block_broadcast(flag) == 0.f;
  const auto grad_factor = signal_factor<Op>(args.inv_scale, args.clip_coef);
  const SgdHyperT<Op> hyper = args.hyper.as<Op>();

  T* p = static_cast<T*>(meta.data(kSgdParam, c.slot)) + c.begin;
  const T* g = static_cast<const T*>(meta.data(kSgdGrad, c.slot)) + c.begin;
  T* buf = kMomentum ? static_cast<T*>(meta.data(kSgdMomentumBuffer, c.slot)) + c.begin : nullptr;

  auto update = [&](T& pe, T ge, T* bufe) {
    Op pf = to_opmath(pe);
    Op bf = kMomentum && !is_first ? to_opmath(*bufe) : Op(0);
    sgd_update<Op, ScalarOpsT<Op>>(pf, grad_factor(to_opmath(ge)), &bf, is_first, hyper);
    pe = from_opmath<T>(pf);
    if (kMomentum) *bufe = from_opmath<T>(bf);
  };

  using V = Vec16<T>;
  std::int64_t i = threadIdx.x;
  const bool aligned = is_aligned16(p) && is_aligned16(g) && (!kMomentum || is_aligned16(buf));
  if (aligned) {
    const VectorSplit split = vector_split(c.size, V::kSize);
    for (; i < split.num_vec; i += blockDim.x) {
      V pv = reinterpret_cast<V*>(p)[i];
      const V gv = reinterpret_cast<const V*>(g)[i];
      V bv;
      if (kMomentum) bv = reinterpret_cast<V*>(buf)[i];
#pragma unroll
      for (int k = 0; k < V::kSize; ++k) update(pv.v[k], gv.v[k], &bv.v[k]);
      reinterpret_cast<V*>(p)[i] = pv;
      if (kMomentum) reinterpret_cast<V*>(buf)[i] = bv;
    }
    i = split.tail_begin + threadIdx.x;
  }
  for (; i < c.size; i += blockDim.x) update(p[i], g[i], kMomentum ? buf + i : nullptr);

  if (kMomentum && is_first) once_per_tensor_after_reads(meta, c.slot, args.counters, [&] { *flag = 1.f; });
}

}  // namespace

void sgd(const sdk::cuda::LaunchMeta& meta, ScalarType dtype, const SgdCudaArgs& args,
         sdk::cuda::Stream stream) {
  dispatch_dtype<true>(dtype, [&](auto tag) {
    using T = decltype(tag);
    if (args.hyper.momentum != 0) {
      launch_with_meta<4>(meta, [&](auto m, dim3 grid) {
        sgd_kernel<T, true><<<grid, kBlockSize, 0, stream>>>(m, args);
      });
    } else {
      launch_with_meta<2>(meta, [&](auto m, dim3 grid) {
        sgd_kernel<T, false><<<grid, kBlockSize, 0, stream>>>(m, args);
      });
    }
  });
}

}  // namespace ampfuse::fused::cuda
