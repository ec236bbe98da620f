// FusedAdagrad on CUDA: one launch per parameter group and dtype.

#include "contract/cuda/multi_tensor.cuh"
#include "fused/adagrad/adagrad_cuda.h"

namespace ampfuse::fused::cuda {
namespace {

using namespace ampfuse::cuda::detail;

template <class T, class Meta>
__global__ void __launch_bounds__(kBlockSize) adagrad_kernel(Meta meta, AdagradCudaArgs args) {
  using Op = opmath_t<T>;
  if (step_skipped(args.found_inf)) return;  // contract rule 1: before any write
  const auto grad_factor = signal_factor<Op>(args.inv_scale, args.clip_coef);
  const AdagradHyperT<Op> hyper = args.hyper.as<Op>();
  const BlockChunk c = locate_chunk(meta, blockIdx.x);
  const double* step = static_cast<const double*>(meta.data(list_index(AdagradList::kStep), c.slot));
  const Op neg_clr = static_cast<Op>(adagrad_neg_clr(args.hyper, block_broadcast(step) + 1.0));
  T* p = static_cast<T*>(meta.data(list_index(AdagradList::kParam), c.slot)) + c.begin;
  const T* g = static_cast<const T*>(meta.data(list_index(AdagradList::kGrad), c.slot)) + c.begin;
  T* sum = static_cast<T*>(meta.data(list_index(AdagradList::kSum), c.slot)) + c.begin;
  for_each_element(c, [&](std::int64_t i) {
    Op pf = to_opmath(p[i]), sf = to_opmath(sum[i]);
    adagrad_update<Op, sdk::ScalarOpsT<Op>>(pf, grad_factor(to_opmath(g[i])), sf, neg_clr, hyper);
    p[i] = from_opmath<T>(pf);
    sum[i] = from_opmath<T>(sf);
  });
}

}  // namespace

void adagrad(const sdk::cuda::LaunchMeta& meta, ScalarType dtype, const AdagradCudaArgs& args,
             sdk::cuda::Stream stream) {
  dispatch_dtype<true>(dtype, [&](auto tag) {
    using T = decltype(tag);
    launch_with_meta<kAdagradLists>(meta, [&](auto m, dim3 grid) {
      adagrad_kernel<T><<<grid, kBlockSize, 0, stream>>>(m, args);
    });
  });
}

}  // namespace ampfuse::fused::cuda
