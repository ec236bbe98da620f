#pragma once
// Build-wide macros shared by host code, CPU kernels and CUDA kernels.
// This header includes nothing from LibTorch so that .cu files can use it.

#if defined(__CUDACC__)
#define AMPFUSE_HOST_DEVICE __host__ __device__ __forceinline__
#else
// Forced, as nvcc's __forceinline__: the element math is called once per
// block of lanes in the CPU kernels' inner loops, and GCC's heuristics left
// adam_update out of line (a call per 16 elements, its branches re-tested
// and its vectors passed through memory).
#if defined(__GNUC__)
#define AMPFUSE_HOST_DEVICE inline __attribute__((always_inline))
#else
#define AMPFUSE_HOST_DEVICE inline
#endif
#endif

#define AMPFUSE_VERSION_MAJOR 0
#define AMPFUSE_VERSION_MINOR 1
#define AMPFUSE_VERSION_PATCH 0
