#pragma once
// The multi-tensor engine's framework-free vocabulary: views of tensor lists
// and the planner that cuts them into chunks for CPU threads or CUDA blocks.
// Nothing here includes LibTorch; kernels (CPU and CUDA) see only this.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "ampfuse/config.h"

namespace ampfuse {

/// Storage types the engine reads and writes. Math is in fp32 (opmath) for
/// Float32, Float16 and BFloat16, and in fp64 for Float64, as ATen's opmath_t.
enum class ScalarType : std::uint8_t { Float32, Float16, BFloat16, Float64 };
/// The number of ScalarType values (they are numbered from 0).
constexpr int kNumScalarTypes = 4;

constexpr std::size_t element_size(ScalarType t) {
  return t == ScalarType::Float64 ? 8 : t == ScalarType::Float32 ? 4 : 2;
}

const char* to_string(ScalarType t);

/// The position of a list in a TensorListsView and in a kernel's metadata,
/// from an optimizer's `enum class` of lists (one numbering shared by its CPU
/// kernel, CUDA kernel and adapter).
template <class List>
AMPFUSE_HOST_DEVICE constexpr int list_index(List list) {
  return static_cast<int>(list);
}

/// One tensor as a kernel sees it: contiguous storage of `numel` elements.
struct TensorView {
  void* data = nullptr;
  std::int64_t numel = 0;
  ScalarType dtype = ScalarType::Float32;
};

/// `depth` lists side by side (param, grad, exp_avg, ...): `lists[l][t]` is
/// tensor t of list l. Every list has the same length, the tensors at one
/// position the same numel, and each list a single dtype (the torch adapter
/// groups by dtype before building a view).
struct TensorListsView {
  std::vector<std::vector<TensorView>> lists;

  int depth() const { return static_cast<int>(lists.size()); }
  std::int64_t num_tensors() const {
    return lists.empty() ? 0 : static_cast<std::int64_t>(lists[0].size());
  }
  ScalarType dtype(int list) const {
    return lists[list].empty() ? ScalarType::Float32 : lists[list][0].dtype;
  }
};

/// A contiguous range of one tensor's elements, processed by one worker.
struct Chunk {
  std::int64_t tensor;  ///< index into the caller's list (empty tensors keep their index)
  std::int64_t begin;   ///< first element
  std::int64_t size;    ///< number of elements, 1 <= size <= chunk_size
  /// Where element `begin` lies in the memory of a parameter with gaps, in
  /// elements from its first (a Plan of runs); `begin` in any other plan.
  std::int64_t place = 0;
};

/// Elements [begin, begin + numel) of tensor `tensor`, counted in its dense
/// order, that lie adjacent in the memory of the tensor's parameter, the
/// first of them `place` elements from the parameter's first: a run of a
/// view with gaps (a row of a column slice), or a whole dense tensor
/// (begin 0, place 0). See Plan's constructor of runs.
struct PlanRun {
  std::int64_t tensor, begin, numel, place;
};

/// Maps chunks of all tensors of a list to workers. Zero-element tensors are
/// left out; sizes and offsets are 64-bit, so lists beyond 2^31 elements (and
/// single tensors beyond it) are planned exactly. Every element of every
/// tensor lies in exactly one chunk; chunks of one tensor are consecutive and
/// in order, and every chunk but a tensor's last (in a plan of runs, a run's
/// last) has chunk_size elements.
class Plan {
 public:
  Plan() = default;
  Plan(const std::int64_t* numels, std::int64_t num_tensors, std::int64_t chunk_size);
  explicit Plan(const std::vector<std::int64_t>& numels, std::int64_t chunk_size)
      : Plan(numels.data(), static_cast<std::int64_t>(numels.size()), chunk_size) {}
  /// A plan of runs: a slot per run (in the order given; a tensor's runs
  /// consecutive, its first at begin 0, each next one beginning where the
  /// one before ends, and its runs cover it), chunked as tensors are, so
  /// that no chunk crosses from one run into the next. A CPU kernel then
  /// walks a parameter with gaps where it is, run by run (list 0 of the SDK's
  /// executor at each chunk's place), and its dense lists (grads, states) at
  /// each chunk's begin. Zero-element runs are left out.
  Plan(const std::vector<PlanRun>& runs, std::int64_t chunk_size);

  std::int64_t chunk_size() const { return chunk_size_; }
  std::int64_t num_chunks() const { return chunk_offsets_.empty() ? 0 : chunk_offsets_.back(); }
  std::int64_t total_elements() const { return total_elements_; }
  /// Tensors with at least one element, in list order.
  const std::vector<std::int64_t>& tensors() const { return tensors_; }
  const std::vector<std::int64_t>& numels() const { return numels_; }
  /// chunk_offsets()[k] is the first chunk of tensors()[k]; one entry more than tensors().
  const std::vector<std::int64_t>& chunk_offsets() const { return chunk_offsets_; }
  /// In a plan of runs, each slot's first element (begins) and its place
  /// (PlanRun); empty in a plan of whole tensors (every slot begins at 0).
  const std::vector<std::int64_t>& begins() const { return begins_; }
  const std::vector<std::int64_t>& places() const { return places_; }
  /// Whether slot k holds its tensor's first element (each tensor has one such slot).
  bool first_of_tensor(std::size_t k) const { return begins_.empty() || begins_[k] == 0; }

  /// Chunk i, 0 <= i < num_chunks(); O(log num_tensors).
  Chunk chunk(std::int64_t i) const;
  /// Position in tensors() of the tensor holding chunk i.
  std::int64_t slot_of_chunk(std::int64_t i) const;

 private:
  std::int64_t chunk_size_ = 1;
  std::int64_t total_elements_ = 0;
  std::vector<std::int64_t> tensors_;
  std::vector<std::int64_t> numels_;
  std::vector<std::int64_t> chunk_offsets_;
  std::vector<std::int64_t> begins_, places_;
};

}  // namespace ampfuse
