// Prefetching the objects a step reads per parameter. With thousands of
// parameters, each of their objects (TensorImpl, storage, autograd metadata,
// state) is a cache miss, reached through the one before it; prefetching, a
// few parameters ahead, the addresses a previous step recorded lets the
// misses of several parameters overlap. A prefetch never faults, so a
// recorded address whose object has since been freed costs nothing.
#pragma once

#include <c10/core/TensorImpl.h>

#include <cstddef>
#include <cstdint>

namespace ampfuse::sdk {

/// How many parameters ahead the recorded objects are prefetched.
constexpr std::int64_t kObjectsAhead = 3;

/// Prefetches the cache lines of [object, object + bytes); null does nothing.
inline void prefetch_object(const void* object, std::size_t bytes = 64) {
  if (object == nullptr) return;
  for (std::size_t at = 0; at < bytes; at += 64) __builtin_prefetch(static_cast<const char*>(object) + at);
}

inline void prefetch_tensor_impl(const c10::TensorImpl* impl) { prefetch_object(impl, sizeof(c10::TensorImpl)); }

}  // namespace ampfuse::sdk
