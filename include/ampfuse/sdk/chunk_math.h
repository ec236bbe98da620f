#pragma once
// Index math of the CUDA kernels (one block per chunk): which tensor and range
// a block works on, and how its threads split that range into 16-byte vectors
// and a scalar tail. Free of LibTorch and CUDA headers, and host-and-device
// (AMPFUSE_HOST_DEVICE), so that tests/test_grid_sim.cpp runs the very same
// functions on the CPU over a simulated grid.

#include <cstdint>

#include "ampfuse/config.h"

namespace ampfuse::sdk::cuda {

/// The part of one tensor a block works on.
struct BlockChunk {
  std::int64_t slot;   ///< index among the launch's (non-empty) tensors
  std::int64_t begin;  ///< first element
  std::int64_t size;
};

/// The range of chunk `chunk` (a block index). Meta is InlineMeta, GlobalMeta
/// or any type with members num_tensors, chunk_size and accessors numel(t),
/// chunk_offset(t) (t's first chunk; increasing, as empty tensors are left
/// out of a launch).
template <class Meta>
AMPFUSE_HOST_DEVICE BlockChunk locate_chunk(const Meta& meta, std::int64_t chunk) {
  std::int64_t lo = 0, hi = meta.num_tensors;  // last slot whose first chunk <= chunk
  while (hi - lo > 1) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    if (meta.chunk_offset(mid) <= chunk) lo = mid; else hi = mid;
  }
  const std::int64_t begin = (chunk - meta.chunk_offset(lo)) * meta.chunk_size;
  const std::int64_t rest = meta.numel(lo) - begin;
  return {lo, begin, rest < meta.chunk_size ? rest : meta.chunk_size};
}

/// True when p may be read as 16-byte vectors. A chunk's start is aligned
/// when its tensor's is and chunk_size * sizeof(T) is a multiple of 16, but a
/// kernel tests each block's pointers: tensors (views) may start anywhere.
AMPFUSE_HOST_DEVICE bool is_aligned16(const void* p) {
  return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0;
}

/// How a block walks a chunk of `size` elements starting at a 16-byte
/// boundary: thread t takes vectors t, t + blockDim.x, ... below num_vec
/// (elements [k * vec_elems, (k + 1) * vec_elems) of vector k), then the
/// elements tail_begin + t, tail_begin + t + blockDim.x, ... below size. A
/// block whose start is not aligned skips the vectors and walks
/// 0 + t, t + blockDim.x, ... below size instead.
struct VectorSplit {
  std::int64_t num_vec;     ///< whole vectors in the chunk
  std::int64_t tail_begin;  ///< first element after them: num_vec * vec_elems (size minus fewer than vec_elems)
};

/// vec_elems: elements per 16-byte vector (Vec16<T>::kSize, 16 / sizeof(T)).
AMPFUSE_HOST_DEVICE VectorSplit vector_split(std::int64_t size, int vec_elems) {
  const std::int64_t num_vec = size / vec_elems;
  return {num_vec, num_vec * vec_elems};
}

}  // namespace ampfuse::sdk::cuda
