#pragma once
// The scale update of GradScaler::update(), shared by the CPU path and the
// CUDA kernel. No LibTorch here.

#include <cmath>
#include <cstdint>

#include "ampfuse/config.h"

struct CUstream_st;

namespace ampfuse::scaler {

struct UpdateScaleParams {
  double growth_factor;
  double backoff_factor;
  std::int64_t growth_interval;
  double min_scale;  // 0: no lower bound
};

/// at::_amp_update_scale_'s arithmetic (float scale times double factor,
/// rounded to float; never grows to a non-finite scale), plus the optional
/// lower bound on back-off. A count of clean steps at or past the interval
/// (set_growth_interval lowered it) grows at the next clean step, where ATen
/// grows only when the count reaches the interval exactly (and never again
/// until an inf/NaN resets it); the same otherwise.
AMPFUSE_HOST_DEVICE void update_scale_math(float* scale, std::int32_t* growth_tracker, float found_inf,
                                           const UpdateScaleParams& p) {
  if (found_inf != 0.f) {
    float backed_off = static_cast<float>(static_cast<double>(*scale) * p.backoff_factor);
    if (p.min_scale > 0.0 && static_cast<double>(backed_off) < p.min_scale) backed_off = static_cast<float>(p.min_scale);
    *scale = backed_off;
    *growth_tracker = 0;
  } else {
    const std::int64_t successful = static_cast<std::int64_t>(*growth_tracker) + 1;
    if (successful >= p.growth_interval) {
      const float grown = static_cast<float>(static_cast<double>(*scale) * p.growth_factor);
#if defined(__CUDA_ARCH__)
      const bool finite = isfinite(grown);
#else
      const bool finite = std::isfinite(grown);
#endif
      if (finite) *scale = grown;
      *growth_tracker = 0;
    } else {
      *growth_tracker = static_cast<std::int32_t>(successful);
    }
  }
}

/// One thread on the device; no host sync.
void update_scale_cuda(float* scale, std::int32_t* growth_tracker, const float* found_inf,
                       const UpdateScaleParams& params, CUstream_st* stream);

}  // namespace ampfuse::scaler
