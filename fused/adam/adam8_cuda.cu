// FusedAdam's moments_8bit on CUDA: one block per quantization block of 256
// elements, the element code of adam8_math.h (what the CPU lanes compute).

#include <stdexcept>

#include "contract/cuda/multi_tensor.cuh"
#include "fused/adam/adam8_cuda.h"

namespace ampfuse::fused::cuda {
namespace {

using namespace ampfuse::cuda::detail;

constexpr int kThreads = static_cast<int>(kQuantBlock);

struct MaxBits {
  __device__ __forceinline__ std::uint32_t operator()(std::uint32_t a, std::uint32_t b) const { return a > b ? a : b; }
};

template <class P, bool kWithMaster, class Meta>
__global__ void __launch_bounds__(kThreads) adam8_kernel(Meta meta, Adam8CudaArgs args) {
  if (step_skipped(args.found_inf)) return;  // contract rule 1: before any write
  const BlockChunk c = locate_chunk(meta, blockIdx.x);  // chunk_size kQuantBlock: one quantization block
  auto list = [&](Adam8List l) { return meta.data(list_index(l), c.slot); };
  double* step_ptr = static_cast<double*>(list(Adam8List::kStep));
  const double step = block_broadcast(step_ptr) + 1.0;
  const double lr = args.lr_device != nullptr ? *args.lr_device : args.lr;
  AdamHyperT<float> hyper = args.hyper.as<float>();
  if (args.lr_device != nullptr) set_device_lr(hyper, lr, args.weight_decay);
  const AdamStepScalars s = adam_step_scalars<double>(lr, args.beta1, args.beta2, step);
  const float neg_step_size = static_cast<float>(s.neg_step_size);
  const float inv_bc2_sqrt = adam8_inv_bc2_sqrt(s.bias_correction2_sqrt);
  const auto grad_factor = signal_factor<float>(args.inv_scale, args.clip_coef);

  P* p = static_cast<P*>(list(Adam8List::kParam)) + c.begin;
  const P* g = static_cast<const P*>(list(Adam8List::kGrad)) + c.begin;
  float* master = kWithMaster ? static_cast<float*>(list(Adam8List::kMaster)) + c.begin : nullptr;
  std::uint8_t* m_codes = static_cast<std::uint8_t*>(list(Adam8List::kExpAvg)) + c.begin;
  std::uint8_t* v_codes = static_cast<std::uint8_t*>(list(Adam8List::kExpAvgSq)) + c.begin;
  float* m_absmax = static_cast<float*>(list(Adam8List::kExpAvgAbsmax)) + c.begin / kQuantBlock;
  float* v_absmax = static_cast<float*>(list(Adam8List::kExpAvgSqAbsmax)) + c.begin / kQuantBlock;
  // Read by every thread before the reductions' barriers, after which thread 0 overwrites them.
  const float m_old = *m_absmax, v_old = *v_absmax;

  const int t = static_cast<int>(threadIdx.x);
  const bool live = t < c.size;
  float m = 0.0f, v = 0.0f;
  if (live) {
    float pf;
    if constexpr (kWithMaster) pf = master[t];
    else pf = to_float(p[t]);
    m = decode8<SignedMap8>(m_codes[t], m_old);
    v = decode8<UnsignedMap8>(v_codes[t], v_old);
    adam8_update<float, ScalarOpsT<float>>(pf, grad_factor(to_float(g[t])), m, v, hyper, neg_step_size,
                                           inv_bc2_sqrt);
    if constexpr (kWithMaster) master[t] = pf;
    p[t] = from_float<P>(pf);
  }
  using Reduce = cub::BlockReduce<std::uint32_t, kThreads>;
  __shared__ typename Reduce::TempStorage storage;
  __shared__ float absmax[2];
  const std::uint32_t m_bits = live ? quant_float_bits(m) & 0x7FFFFFFFu : 0u;
  const std::uint32_t v_bits = live ? quant_float_bits(v) & 0x7FFFFFFFu : 0u;
  const std::uint32_t m_max = Reduce(storage).Reduce(m_bits, MaxBits());
  __syncthreads();  // storage reused
  const std::uint32_t v_max = Reduce(storage).Reduce(v_bits, MaxBits());
  if (t == 0) {
    absmax[0] = absmax_from_bits(m_max);
    absmax[1] = absmax_from_bits(v_max);
    *m_absmax = absmax[0];
    *v_absmax = absmax[1];
  }
  __syncthreads();
  if (live) {
    m_codes[t] = encode8<SignedMap8>(m, absmax[0]);
    v_codes[t] = encode8<UnsignedMap8>(v, absmax[1]);
  }
  // Rule 4: the step advances once per tensor, after all its blocks read it.
  once_per_tensor_after_reads(meta, c.slot, args.counters, [&] { *step_ptr = step; });
}

}  // namespace

void adam8(const sdk::cuda::LaunchMeta& meta, ScalarType dtype, const Adam8CudaArgs& args, sdk::cuda::Stream stream) {
  if (meta.chunk_size != kQuantBlock)
    throw std::runtime_error("ampfuse: internal error: the 8-bit Adam launch must be planned in 256-element chunks");
  dispatch_dtype(dtype, [&](auto param_tag) {
    using P = decltype(param_tag);
    launch_with_meta<kAdam8Lists>(meta, [&](auto m, dim3 grid) {
      if (args.master) adam8_kernel<P, true><<<grid, kThreads, 0, stream>>>(m, args);
      else adam8_kernel<P, false><<<grid, kThreads, 0, stream>>>(m, args);
    });
  });
}

}  // namespace ampfuse::fused::cuda
