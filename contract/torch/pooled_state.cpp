// sdk::PooledState's allocator. Objects of one size are carved in order from
// slabs of kSlabBytes, each aligned to its size, so that the slab of an object
// is its address with the low bits cleared and a delete needs no lookup.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <new>

#include "ampfuse/sdk/optimizer.h"

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define AMPFUSE_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(AMPFUSE_ASAN)
#include <sanitizer/asan_interface.h>
// A deleted object's bytes are poisoned until its place is reused, so that
// AddressSanitizer reports a use after delete as it would with new.
#define AMPFUSE_POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define AMPFUSE_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define AMPFUSE_POISON(p, n) ((void)(p), (void)(n))
#define AMPFUSE_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

namespace ampfuse::sdk {
namespace {

constexpr std::size_t kSlabBytes = 64 * 1024;
constexpr std::size_t kHeaderBytes = 64;  // objects start one line into their slab
constexpr std::size_t kSlotAlign = 16;    // as ::operator new aligns
constexpr std::size_t kMaxSlot = 4096;    // larger objects get a region of their own

struct Slab {
  std::size_t slot;       // bytes per object; 0 for a region holding one large object
  std::size_t bytes;      // of the slab, header included
  std::size_t live = 0;   // objects made and not deleted
  char* bump = nullptr;   // the first place never used
  void* free = nullptr;   // places deleted since, linked through their first bytes
  Slab* prev = nullptr;   // in its size's list of slabs with room (not the current one)
  Slab* next = nullptr;
};
static_assert(sizeof(Slab) <= kHeaderBytes, "a slab's header fits before its first object");

char* begin_of(Slab* s) { return reinterpret_cast<char*>(s) + kHeaderBytes; }
Slab* slab_of(void* p) {
  return reinterpret_cast<Slab*>(reinterpret_cast<std::uintptr_t>(p) & ~std::uintptr_t{kSlabBytes - 1});
}

// The slabs of one object size: the one objects are carved from, and the
// others that have a deleted object's place to reuse (a list through their
// headers: taking one out allocates nothing, as a delete must not).
struct SizeClass {
  Slab* current = nullptr;
  Slab* with_room = nullptr;

  void add(Slab* s) {
    s->prev = nullptr;
    s->next = with_room;
    if (with_room != nullptr) with_room->prev = s;
    with_room = s;
  }
  void remove(Slab* s) {
    (s->prev != nullptr ? s->prev->next : with_room) = s->next;
    if (s->next != nullptr) s->next->prev = s->prev;
    s->prev = s->next = nullptr;
  }
};

struct Pool {
  std::mutex mutex;
  std::map<std::size_t, SizeClass> classes;
  std::size_t slabs = 0;
};

Pool& pool() {
  static Pool* p = new Pool;  // never destroyed: states may be deleted during static destruction
  return *p;
}

void* take_memory(std::size_t bytes) {
  void* m = std::aligned_alloc(kSlabBytes, bytes);
  if (m == nullptr) throw std::bad_alloc();
  return m;
}

Slab* new_slab(Pool& pool, std::size_t slot, std::size_t bytes) {
  Slab* s = new (take_memory(bytes)) Slab{slot, bytes};
  s->bump = begin_of(s);
  ++pool.slabs;
  AMPFUSE_POISON(begin_of(s), bytes - kHeaderBytes);
  return s;
}

void free_slab(Pool& pool, Slab* s) {
  --pool.slabs;
  AMPFUSE_UNPOISON(s, s->bytes);
  s->~Slab();
  std::free(s);
}

bool has_room(const Slab* s) {
  const char* end = reinterpret_cast<const char*>(s) + kSlabBytes;
  return s->free != nullptr || s->slot <= static_cast<std::size_t>(end - s->bump);
}

void* allocate(std::size_t bytes, std::size_t align) {
  if (align > kHeaderBytes) throw std::bad_alloc();  // no state type asks for more than a line
  if (bytes == 0) bytes = 1;
  std::size_t slot = (bytes + kSlotAlign - 1) / kSlotAlign * kSlotAlign;
  slot = (slot + align - 1) / align * align;
  Pool& p = pool();
  const std::lock_guard<std::mutex> lock(p.mutex);
  if (slot > kMaxSlot) {
    const std::size_t region = (kHeaderBytes + slot + kSlabBytes - 1) / kSlabBytes * kSlabBytes;
    Slab* s = new_slab(p, 0, region);
    s->live = 1;
    AMPFUSE_UNPOISON(begin_of(s), bytes);
    return begin_of(s);
  }
  SizeClass& c = p.classes[slot];
  if (c.current == nullptr || !has_room(c.current)) {
    if (c.with_room != nullptr) {
      c.current = c.with_room;
      c.remove(c.current);
    } else {
      c.current = new_slab(p, slot, kSlabBytes);
    }
  }
  Slab* s = c.current;
  void* obj;
  if (s->free != nullptr) {
    obj = s->free;
    AMPFUSE_UNPOISON(obj, sizeof(void*));
    s->free = *static_cast<void**>(obj);
  } else {
    obj = s->bump;
    s->bump += slot;
  }
  ++s->live;
  AMPFUSE_UNPOISON(obj, bytes);
  return obj;
}

void deallocate(void* obj) noexcept {
  if (obj == nullptr) return;
  Slab* s = slab_of(obj);
  Pool& p = pool();
  const std::lock_guard<std::mutex> lock(p.mutex);
  if (s->slot == 0) {
    free_slab(p, s);
    return;
  }
  SizeClass& c = p.classes.find(s->slot)->second;  // made with the slab; find allocates nothing
  AMPFUSE_UNPOISON(obj, sizeof(void*));
  const bool was_full = !has_room(s);
  *static_cast<void**>(obj) = s->free;
  s->free = obj;
  AMPFUSE_POISON(obj, s->slot);
  --s->live;
  if (s == c.current) {
    // Kept: the next object of this size goes there. Emptied, it carves
    // from its start again, in order, rather than in the order of deletion.
    if (s->live == 0) {
      s->free = nullptr;
      s->bump = begin_of(s);
    }
    return;
  }
  if (s->live == 0) {
    if (!was_full) c.remove(s);
    free_slab(p, s);
    return;
  }
  if (was_full) c.add(s);
}

}  // namespace

void* PooledState::operator new(std::size_t bytes) { return allocate(bytes, kSlotAlign); }
void* PooledState::operator new(std::size_t bytes, std::align_val_t align) {
  return allocate(bytes, static_cast<std::size_t>(align));
}
void PooledState::operator delete(void* p) noexcept { deallocate(p); }
void PooledState::operator delete(void* p, std::align_val_t) noexcept { deallocate(p); }

std::size_t pooled_state_slabs() {
  Pool& p = pool();
  const std::lock_guard<std::mutex> lock(p.mutex);
  return p.slabs;
}

}  // namespace ampfuse::sdk
