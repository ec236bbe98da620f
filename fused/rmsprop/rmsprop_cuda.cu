// FusedRMSprop on CUDA: one launch per parameter group and dtype.

#include "contract/cuda/multi_tensor.cuh"
#include "fused/rmsprop/rmsprop_cuda.h"

namespace ampfuse::fused::cuda {
namespace {

using namespace ampfuse::cuda::detail;

template <class T, bool kMomentum, bool kCentered, class Meta>
__global__ void __launch_bounds__(kBlockSize) rmsprop_kernel(Meta meta, RmspropCudaArgs args) {
  using Op = opmath_t<T>;
  if (step_skipped(args.found_inf)) return;  // contract rule 1: before any write
  const auto grad_factor = signal_factor<Op>(args.inv_scale, args.clip_coef);
  const RmspropHyperT<Op> hyper = args.hyper.as<Op>();
  const BlockChunk c = locate_chunk(meta, blockIdx.x);
  auto at = [&](RmspropList l) { return static_cast<T*>(meta.data(list_index(l), c.slot)) + c.begin; };
  T* p = at(RmspropList::kParam);
  const T* g = at(RmspropList::kGrad);
  T* square_avg = at(RmspropList::kSquareAvg);
  T* buf = kMomentum ? at(RmspropList::kMomentumBuffer) : nullptr;
  T* grad_avg = kCentered ? at(RmspropList::kGradAvg) : nullptr;
  for_each_element(c, [&](std::int64_t i) {
    Op pf = to_opmath(p[i]), sf = to_opmath(square_avg[i]);
    Op bf = kMomentum ? to_opmath(buf[i]) : Op(0), af = kCentered ? to_opmath(grad_avg[i]) : Op(0);
    rmsprop_update<Op, sdk::ScalarOpsT<Op>>(pf, grad_factor(to_opmath(g[i])), sf, &bf, &af, hyper);
    p[i] = from_opmath<T>(pf);
    square_avg[i] = from_opmath<T>(sf);
    if (kMomentum) buf[i] = from_opmath<T>(bf);
    if (kCentered) grad_avg[i] = from_opmath<T>(af);
  });
}

}  // namespace

void rmsprop(const sdk::cuda::LaunchMeta& meta, ScalarType dtype, const RmspropCudaArgs& args,
             sdk::cuda::Stream stream) {
  dispatch_dtype<true>(dtype, [&](auto tag) {
    using T = decltype(tag);
    launch_with_meta<kRmspropLists>(meta, [&](auto m, dim3 grid) {
      const bool momentum = args.hyper.use_momentum;
      if (args.hyper.centered) {
        if (momentum) rmsprop_kernel<T, true, true><<<grid, kBlockSize, 0, stream>>>(m, args);
        else rmsprop_kernel<T, false, true><<<grid, kBlockSize, 0, stream>>>(m, args);
      } else {
        if (momentum) rmsprop_kernel<T, true, false><<<grid, kBlockSize, 0, stream>>>(m, args);
        else rmsprop_kernel<T, false, false><<<grid, kBlockSize, 0, stream>>>(m, args);
      }
    });
  });
}

}  // namespace ampfuse::fused::cuda
