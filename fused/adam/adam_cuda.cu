// FusedAdam on CUDA: one launch per parameter group and dtype.

#include <type_traits>

#include "contract/cuda/multi_tensor.cuh"
#include "fused/adam/adam_cuda.h"

namespace ampfuse::fused::cuda {
namespace {

using namespace ampfuse::cuda::detail;

// P: param and grad storage; S: moment storage; kWithMaster: the update runs
// on an fp32 master copy (list AdamList::kMaster), written back to the param
// rounded to P. The math is in opmath_t<P>: float, or double for double
// params (whose moments are double too).
template <class P, class S, bool kAmsgrad, bool kWithMaster, class Meta>
__global__ void __launch_bounds__(kBlockSize) adam_kernel(Meta meta, AdamCudaArgs args) {
  using Op = opmath_t<P>;
  if (step_skipped(args.found_inf)) return;  // contract rule 1: before any write
  const BlockChunk c = locate_chunk(meta, blockIdx.x);
  double* step_ptr = static_cast<double*>(meta.data(list_index(AdamList::kStep), c.slot));  // fp64: exact past 2^24
  const double step = block_broadcast(step_ptr) + 1.0;
  // capturable: lr, and what depends on it, from the device.
  const double lr = args.lr_device != nullptr ? *args.lr_device : args.lr;
  AdamHyperT<Op> hyper = args.hyper.as<Op>();
  if (args.lr_device != nullptr) set_device_lr(hyper, lr, args.weight_decay);
  const AdamStepScalarsT<Op> s = adam_step_scalars<Op>(lr, args.beta1, args.beta2, step);
  const auto grad_factor = signal_factor<Op>(args.inv_scale, args.clip_coef);

  P* p = static_cast<P*>(meta.data(list_index(AdamList::kParam), c.slot)) + c.begin;
  const P* g = static_cast<const P*>(meta.data(list_index(AdamList::kGrad), c.slot)) + c.begin;
  S* m = static_cast<S*>(meta.data(list_index(AdamList::kExpAvg), c.slot)) + c.begin;
  S* v = static_cast<S*>(meta.data(list_index(AdamList::kExpAvgSq), c.slot)) + c.begin;
  S* vmax = kAmsgrad ? static_cast<S*>(meta.data(list_index(AdamList::kMaxExpAvgSq), c.slot)) + c.begin : nullptr;
  float* master =
      kWithMaster ? static_cast<float*>(meta.data(list_index(AdamList::kMaster), c.slot)) + c.begin : nullptr;

  auto update = [&](std::int64_t i, P& pe, P ge, S& me, S& ve, S* vmaxe) {
    Op pf;
    if constexpr (kWithMaster) pf = master[i];
    else pf = to_opmath(pe);
    Op mf = to_opmath(me), vf = to_opmath(ve);
    Op vmaxf = kAmsgrad ? to_opmath(*vmaxe) : Op(0);
    adam_update<Op, ScalarOpsT<Op>>(pf, grad_factor(to_opmath(ge)), mf, vf, &vmaxf, hyper, s);
    if constexpr (kWithMaster) master[i] = pf;
    pe = from_opmath<P>(pf);
    me = from_opmath<S>(mf);
    ve = from_opmath<S>(vf);
    if (kAmsgrad) *vmaxe = from_opmath<S>(vmaxf);
  };

  std::int64_t i = threadIdx.x;
  // 16-byte vectors when every list has one storage type and is aligned.
  if constexpr (std::is_same<P, S>::value && !kWithMaster) {
    using V = Vec16<P>;
    const bool aligned = is_aligned16(p) && is_aligned16(g) && is_aligned16(m) && is_aligned16(v) &&
                         (!kAmsgrad || is_aligned16(vmax));
    if (aligned) {
      const VectorSplit split = vector_split(c.size, V::kSize);
      for (; i < split.num_vec; i += blockDim.x) {
        V pv = reinterpret_cast<V*>(p)[i], mv = reinterpret_cast<V*>(m)[i], vv = reinterpret_cast<V*>(v)[i];
        const V gv = reinterpret_cast<const V*>(g)[i];
        V xv;
        if (kAmsgrad) xv = reinterpret_cast<V*>(vmax)[i];
#pragma unroll
        for (int k = 0; k < V::kSize; ++k) update(i * V::kSize + k, pv.v[k], gv.v[k], mv.v[k], vv.v[k], &xv.v[k]);
        reinterpret_cast<V*>(p)[i] = pv;
        reinterpret_cast<V*>(m)[i] = mv;
        reinterpret_cast<V*>(v)[i] = vv;
        if (kAmsgrad) reinterpret_cast<V*>(vmax)[i] = xv;
      }
      i = split.tail_begin + threadIdx.x;
    }
  }
  for (; i < c.size; i += blockDim.x) update(i, p[i], g[i], m[i], v[i], kAmsgrad ? vmax + i : nullptr);

  // Rule 4: the step advances once per tensor, after all its blocks read it.
  once_per_tensor_after_reads(meta, c.slot, args.counters, [&] { *step_ptr = step; });
}

}  // namespace

void adam(const sdk::cuda::LaunchMeta& meta, ScalarType dtype, const AdamCudaArgs& args,
          sdk::cuda::Stream stream) {
  dispatch_dtype<true>(dtype, [&](auto param_tag) {
    using P = decltype(param_tag);
    if constexpr (std::is_same<P, double>::value) {
      // fp64 params: fp64 moments, no master copy (the adapter refuses both others).
      launch_with_meta<kAdamLists>(meta, [&](auto m, dim3 grid) {
        if (args.hyper.amsgrad) adam_kernel<P, P, true, false><<<grid, kBlockSize, 0, stream>>>(m, args);
        else adam_kernel<P, P, false, false><<<grid, kBlockSize, 0, stream>>>(m, args);
      });
    } else {
      dispatch_dtype(args.state_dtype, [&](auto state_tag) {
        using S = decltype(state_tag);
        launch_with_meta<kAdamLists>(meta, [&](auto m, dim3 grid) {
          if (args.hyper.amsgrad) {
            if (args.master) adam_kernel<P, S, true, true><<<grid, kBlockSize, 0, stream>>>(m, args);
            else adam_kernel<P, S, true, false><<<grid, kBlockSize, 0, stream>>>(m, args);
          } else {
            if (args.master) adam_kernel<P, S, false, true><<<grid, kBlockSize, 0, stream>>>(m, args);
            else adam_kernel<P, S, false, false><<<grid, kBlockSize, 0, stream>>>(m, args);
          }
        });
      });
    }
  });
}

}  // namespace ampfuse::fused::cuda
