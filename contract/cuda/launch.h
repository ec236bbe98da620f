#pragma once
// Torch-free host entry points of the CUDA multi-tensor engine. The torch
// adapter (contract/torch/tensor_ops.cpp) validates tensors, builds the metadata and
// calls these with raw pointers and a stream. Every CUDA call is checked;
// failures throw std::runtime_error naming the call.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "ampfuse/multi_tensor.h"
#include "ampfuse/sdk/cuda.h"

namespace ampfuse::cuda {

/// Number of CUDA devices; 0 when the runtime reports any error (no driver here).
int device_count();

/// Workspace for check_non_finite with sum_sq: one fp64 partial per chunk and a counter.
std::size_t check_workspace_bytes(std::int64_t num_chunks);

/// Where the sum of squares goes: at most one of the two is set.
struct SumSq {
  float* f32 = nullptr;
  double* f64 = nullptr;
  bool wanted() const { return f32 != nullptr || f64 != nullptr; }
};

/// Read-only pass: *found_inf = 1 when any element is inf or NaN (left alone
/// otherwise); when sum_sq is wanted, adds the sum of squares to it, reduced
/// in a fixed order (deterministic). One launch, plus a 4-byte memset of the
/// workspace counter when the sum is asked for.
void check_non_finite(const sdk::cuda::LaunchMeta& meta, ScalarType dtype, float* found_inf, SumSq sum_sq,
                      void* workspace, sdk::cuda::Stream stream);

/// In place: x = x * (*scale), computed in fp32, rounded to the storage type;
/// or, where scale is null, x times *scale_f64 as the optimizers' kernels
/// apply a grad factor (sdk::ScalarGradFactor). When found_inf is not null,
/// also *found_inf = 1 if any value (before scaling) is inf or NaN, in the
/// same pass.
void scale(const sdk::cuda::LaunchMeta& meta, ScalarType dtype, const float* scale, const double* scale_f64,
           float* found_inf, sdk::cuda::Stream stream);

}  // namespace ampfuse::cuda
