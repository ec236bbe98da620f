#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "scaler/update_scale.h"

namespace ampfuse::scaler {
namespace {

__global__ void update_scale_kernel(float* scale, std::int32_t* growth_tracker, const float* found_inf,
                                    UpdateScaleParams params) {
  update_scale_math(scale, growth_tracker, *found_inf, params);
}

}  // namespace

void update_scale_cuda(float* scale, std::int32_t* growth_tracker, const float* found_inf,
                       const UpdateScaleParams& params, CUstream_st* stream) {
  update_scale_kernel<<<1, 1, 0, stream>>>(scale, growth_tracker, found_inf, params);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("ampfuse: GradScaler::update kernel launch failed: ") + cudaGetErrorString(err));
}

}  // namespace ampfuse::scaler
