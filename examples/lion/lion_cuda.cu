// Lion's CUDA kernel: one launch per list (group, device, dtype), one block
// per chunk.

#include <ampfuse/sdk/cuda_kernel.cuh>

#include "lion_cuda.h"

namespace lion::cuda {
namespace {

using namespace ampfuse::sdk::cuda;  // locate_chunk, for_each_element, to_float, ...

template <class T, class Meta>
__global__ void __launch_bounds__(kBlockSize) lion_kernel(Meta meta, LionCudaArgs args) {
  // Contract rule 1: found_inf is final before the launch and the same for
  // every block, so a skipped step returns before any write.
  if (step_skipped(args.found_inf)) return;
  // Rule 2: the gradient is g * inv_scale * clip_coef, in fp32 (a factor
  // below 2^-126 applied as two, so that it keeps 24 bits).
  const auto grad_factor = signal_factor(args.inv_scale, args.clip_coef);

  const BlockChunk c = locate_chunk(meta, blockIdx.x);
  T* p = static_cast<T*>(meta.data(kParam, c.slot)) + c.begin;
  const T* g = static_cast<const T*>(meta.data(kGrad, c.slot)) + c.begin;
  T* m = static_cast<T*>(meta.data(kExpAvg, c.slot)) + c.begin;
  for_each_element(c, [&](std::int64_t i) {
    float pf = to_float(p[i]), mf = to_float(m[i]);
    lion_update<float, ampfuse::sdk::ScalarOps>(pf, grad_factor(to_float(g[i])), mf, args.hyper);
    p[i] = from_float<T>(pf);
    m[i] = from_float<T>(mf);
  });
}

}  // namespace

void lion_step(const LaunchMeta& meta, ampfuse::ScalarType dtype, const LionCudaArgs& args, Stream stream) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    launch_with_meta<kDepth>(meta, [&](auto m, dim3 grid) {
      lion_kernel<T><<<grid, kBlockSize, 0, stream>>>(m, args);
    });
  });
}

}  // namespace lion::cuda
