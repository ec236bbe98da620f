#pragma once
// Build-wide macros shared by host code, CPU kernels and CUDA kernels.
// This header includes nothing from LibTorch so that .cu files can use it.

#if defined(__CUDACC__)
#define AMPFUSE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define AMPFUSE_HOST_DEVICE inline
#endif

#define AMPFUSE_VERSION_MAJOR 0
#define AMPFUSE_VERSION_MINOR 1
#define AMPFUSE_VERSION_PATCH 0
