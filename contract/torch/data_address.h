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

}  // namespace ampfuse::sdk
