// FusedAdagrad on CUDA: one launch per parameter group and dtype.

#include "contract/cuda/multi_tensor.cuh"
#include "fused/adagrad/adagrad_cuda.h"

namespace ampfuse::fused::cuda {
namespace {

using namespace ampfuse::cuda::detail;

template <class T, class Meta>
__global__ void __launch_bounds__(kBlockSize) adagrad_kernel(Meta meta, AdagradCudaArgs args) {
  if (step_skipped(args.found_inf)) return;  // contract rule 1: before any write
  const float grad_factor = signal_grad_factor(args.inv_scale, args.clip_coef);
  const BlockChunk c = locate_chunk(meta, blockIdx.x);
  const double* step = static_cast<const double*>(meta.data(list_index(AdagradList::kStep), c.slot));
  const float neg_clr = adagrad_neg_clr(args.hyper, block_broadcast(step) + 1.0);
  T* p = static_cast<T*>(meta.data(list_index(AdagradList::kParam), c.slot)) + c.begin;
  const T* g = static_cast<const T*>(meta.data(list_index(AdagradList::kGrad), c.slot)) + c.begin;
  T* sum = static_cast<T*>(meta.data(list_index(AdagradList::kSum), c.slot)) + c.begin;
  for_each_element(c, [&](std::int64_t i) {
    float pf = to_float(p[i]), sf = to_float(sum[i]);
    adagrad_update<float, sdk::ScalarOps>(pf, to_float(g[i]) * grad_factor, sf, neg_clr, args.hyper);
    p[i] = from_float<T>(pf);
    sum[i] = from_float<T>(sf);
  });
}

}  // namespace

void adagrad(const sdk::cuda::LaunchMeta& meta, ScalarType dtype, const AdagradCudaArgs& args,
             sdk::cuda::Stream stream) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    launch_with_meta<kAdagradLists>(meta, [&](auto m, dim3 grid) {
      adagrad_kernel<T><<<grid, kBlockSize, 0, stream>>>(m, args);
    });
  });
}

}  // namespace ampfuse::fused::cuda
