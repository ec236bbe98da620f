// FusedLAMB on CUDA: two launches per parameter group and dtype, on the
// SDK's device building blocks.

#include <cmath>
#include <type_traits>

#include "ampfuse/sdk/cuda_kernel.cuh"
#include "fused/lamb/lamb_cuda.h"

namespace ampfuse::fused::cuda {
namespace {

using namespace ampfuse::sdk::cuda;
using sdk::ScalarGradFactor;
using sdk::ScalarOpsT;

// inv_scale * clip_coef * the max_grad_norm factor, read on the device and
// applied in opmath T, as the CPU computes it (lamb_total_grad_factor).
template <class T>
__device__ __forceinline__ ScalarGradFactor<T> lamb_grad_factor(const LambCudaArgs& args, const LambHyperT<T>& h) {
  return ScalarGradFactor<T>(
      lamb_total_grad_factor(h, signal_factor_value(args.inv_scale, args.clip_coef), args.grad_sum_sq));
}

// The state's storage type: float, or double for double params.
template <class P>
using StateOf = typename std::conditional<std::is_same<P, double>::value, double, float>::type;

template <class P, bool kMaster, class Meta>
__global__ void __launch_bounds__(kBlockSize) lamb_moments_kernel(Meta meta, LambCudaArgs args) {
  using Op = opmath_t<P>;
  using S = StateOf<P>;
  if (step_skipped(args.found_inf)) return;  // contract rule 1: before any write
  const BlockChunk c = locate_chunk(meta, blockIdx.x);
  const LambHyperT<Op> hyper = args.hyper.as<Op>();
  const auto* step = static_cast<const double*>(meta.data(list_index(LambList::kStep), c.slot));
  const LambStepScalarsT<Op> s = lamb_step_scalars<Op>(args.hyper, block_broadcast(step) + 1.0);
  const ScalarGradFactor<Op> factor = lamb_grad_factor(args, hyper);
  const P* p = static_cast<const P*>(meta.data(list_index(LambList::kParam), c.slot)) + c.begin;
  const P* g = static_cast<const P*>(meta.data(list_index(LambList::kGrad), c.slot)) + c.begin;
  S* m = static_cast<S*>(meta.data(list_index(LambList::kExpAvg), c.slot)) + c.begin;
  S* v = static_cast<S*>(meta.data(list_index(LambList::kExpAvgSq), c.slot)) + c.begin;
  const float* master =
      kMaster ? static_cast<const float*>(meta.data(list_index(LambList::kMaster), c.slot)) + c.begin : nullptr;
  // fp64 sums, as on the CPU: p^2 of a large |p| stays finite, and the norms match.
  double p_sq = 0.0, u_sq = 0.0;
  for_each_element(c, [&](std::int64_t i) {
    Op pf;
    if constexpr (kMaster) pf = master[i];
    else pf = to_opmath(p[i]);
    Op mf = m[i], vf = v[i];
    lamb_moments<Op, ScalarOpsT<Op>>(factor(to_opmath(g[i])), mf, vf, hyper);
    const Op u = lamb_direction<Op, ScalarOpsT<Op>>(pf, mf, vf, hyper, s);
    m[i] = mf;
    v[i] = vf;
    p_sq += static_cast<double>(pf) * pf;
    u_sq += static_cast<double>(u) * u;
  });
  const double block_p = block_sum(p_sq), block_u = block_sum(u_sq);
  if (threadIdx.x == 0) {
    const std::int64_t chunk = blockIdx.x;
    args.chunk_sums[2 * chunk] = block_p;
    args.chunk_sums[2 * chunk + 1] = block_u;
  }
  // The tensor's last block to finish adds its chunks' sums: each thread a
  // fixed stride of chunks, then the block's fixed reduction tree, so the
  // norms do not depend on scheduling, and a tensor of thousands of chunks
  // (16,384 for 1B elements) is not added up by one thread.
  __shared__ bool last;
  if (threadIdx.x == 0) {
    __threadfence();
    const auto chunks = static_cast<unsigned>(meta.chunk_offset(c.slot + 1) - meta.chunk_offset(c.slot));
    last = atomicAdd(&args.counters[c.slot], 1u) == chunks - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  double ps = 0.0, us = 0.0;
  for (std::int64_t k = meta.chunk_offset(c.slot) + threadIdx.x; k < meta.chunk_offset(c.slot + 1); k += blockDim.x) {
    ps += __ldcg(args.chunk_sums + 2 * k);
    us += __ldcg(args.chunk_sums + 2 * k + 1);
  }
  ps = block_sum(ps);
  us = block_sum(us);
  if (threadIdx.x == 0) {
    args.norms[2 * c.slot] = sqrt(ps);
    args.norms[2 * c.slot + 1] = sqrt(us);
    args.counters[c.slot] = 0;  // re-armed for the next launch
  }
}

template <class P, bool kMaster, class Meta>
__global__ void __launch_bounds__(kBlockSize) lamb_apply_kernel(Meta meta, LambCudaArgs args) {
  using Op = opmath_t<P>;
  using S = StateOf<P>;
  if (step_skipped(args.found_inf)) return;
  const BlockChunk c = locate_chunk(meta, blockIdx.x);
  const LambHyperT<Op> hyper = args.hyper.as<Op>();
  double* step_ptr = static_cast<double*>(meta.data(list_index(LambList::kStep), c.slot));
  const double old_step = block_broadcast(step_ptr);
  const LambStepScalarsT<Op> s = lamb_step_scalars<Op>(args.hyper, old_step + 1.0);
  // The norms in fp64, rounded to the opmath as the CPU adapter rounds them.
  const Op neg_step =
      lamb_neg_step(hyper, static_cast<Op>(args.norms[2 * c.slot]), static_cast<Op>(args.norms[2 * c.slot + 1]));
  P* p = static_cast<P*>(meta.data(list_index(LambList::kParam), c.slot)) + c.begin;
  const S* m = static_cast<const S*>(meta.data(list_index(LambList::kExpAvg), c.slot)) + c.begin;
  const S* v = static_cast<const S*>(meta.data(list_index(LambList::kExpAvgSq), c.slot)) + c.begin;
  float* master = kMaster ? static_cast<float*>(meta.data(list_index(LambList::kMaster), c.slot)) + c.begin : nullptr;
  for_each_element(c, [&](std::int64_t i) {
    Op pf;
    if constexpr (kMaster) pf = master[i];
    else pf = to_opmath(p[i]);
    const Op u = lamb_direction<Op, ScalarOpsT<Op>>(pf, Op(m[i]), Op(v[i]), hyper, s);
    lamb_apply<Op, ScalarOpsT<Op>>(pf, u, neg_step);
    if constexpr (kMaster) master[i] = pf;
    p[i] = from_opmath<P>(pf);
  });
  // Contract rule 4: the step advances once per tensor, after all its blocks read it.
  once_per_tensor_after_reads(meta, c.slot, args.counters, [&] { *step_ptr = old_step + 1.0; });
}

}  // namespace

void lamb(const sdk::cuda::LaunchMeta& meta, ScalarType dtype, const LambCudaArgs& args, sdk::cuda::Stream stream) {
  dispatch_dtype<true>(dtype, [&](auto param_tag) {
    using P = decltype(param_tag);
    launch_with_meta<kLambLists>(meta, [&](auto m, dim3 grid) {
      if (args.master && !std::is_same<P, double>::value) {
        lamb_moments_kernel<P, true><<<grid, kBlockSize, 0, stream>>>(m, args);
        lamb_apply_kernel<P, true><<<grid, kBlockSize, 0, stream>>>(m, args);
      } else {
        lamb_moments_kernel<P, false><<<grid, kBlockSize, 0, stream>>>(m, args);
        lamb_apply_kernel<P, false><<<grid, kBlockSize, 0, stream>>>(m, args);
      }
    });
  });
}

}  // namespace ampfuse::fused::cuda
