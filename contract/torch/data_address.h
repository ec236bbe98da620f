// The address of a tensor's first element, read through its TensorImpl and
// storage without checks: what step plans compare to tell a tensor re-pointed
// to other memory.
#pragma once

#include <c10/core/TensorImpl.h>

#include <cstdint>

namespace ampfuse::sdk {

/// Null for a tensor without storage (sparse).
inline const void* data_address(const c10::TensorImpl* t) {
  const c10::StorageImpl* storage = t->unsafe_storage().unsafeGetStorageImpl();
  if (storage == nullptr) return nullptr;
  return static_cast<const char*>(storage->data()) + t->storage_offset() * static_cast<std::int64_t>(t->itemsize());
}

/// How far ahead (in parameters) a pass over many parameters' objects
/// prefetches the ones it will read: a pass over thousands of small
/// parameters waits on a cache miss per object, on a heap that earlier work
/// left fragmented, unless the misses overlap.
constexpr std::int64_t kPrefetchAhead = 8;

/// Starts loading the line at p. A pointer kept from a tensor since freed is
/// harmless here: a prefetch does not fault.
inline void prefetch(const void* p) { __builtin_prefetch(p); }

/// Prefetches every line of the `bytes` at p (an object whose fields a pass
/// reads: a TensorImpl's are two lines apart).
inline void prefetch_object(const void* p, std::size_t bytes) {
  const auto first = reinterpret_cast<std::uintptr_t>(p) & ~std::uintptr_t{63};
  const auto last = (reinterpret_cast<std::uintptr_t>(p) + bytes - 1) & ~std::uintptr_t{63};
  for (std::uintptr_t a = first; a <= last; a += 64) __builtin_prefetch(reinterpret_cast<const void*>(a));
}

/// Prefetches the lines of a TensorImpl that a plan's check reads: its
/// first 32 bytes (after the vtable pointer and the reference counts, the
/// storage and the autograd metadata) and its last 32 (storage offset,
/// numel, dtype, device and the layout bits), not the sizes and strides
/// between them. A check of many small parameters is bound by the lines in
/// flight: lines it never reads slow the others. Address arithmetic only
/// (t may be gone).
inline void prefetch_impl(const c10::TensorImpl* t) {
  const auto* p = reinterpret_cast<const char*>(t);
  prefetch(p);
  prefetch(p + 31);
  prefetch(p + sizeof(c10::TensorImpl) - 32);
  prefetch(p + sizeof(c10::TensorImpl) - 1);
}

/// Prefetches a StorageImpl's first 32 bytes, where its data pointer
/// follows the vtable pointer and the reference counts (all a check reads).
inline void prefetch_storage(const void* s) {
  prefetch(s);
  prefetch(static_cast<const char*>(s) + 31);
}

/// What reading a parameter's grad and its data address touches, from
/// addresses kept at an earlier step: the autograd metadata, its grad field,
/// and (null without a grad) the grad's TensorImpl and storage.
inline void prefetch_grad(const void* autograd_meta, const void* grad_slot, const c10::TensorImpl* grad,
                          const void* grad_storage) {
  prefetch(autograd_meta);
  prefetch(grad_slot);
  if (grad == nullptr) return;
  prefetch_impl(grad);
  prefetch_storage(grad_storage);
}

}  // namespace ampfuse::sdk
