#include <algorithm>
#include <stdexcept>
#include <string>

#include "ampfuse/multi_tensor.h"

namespace ampfuse {

const char* to_string(ScalarType t) {
  switch (t) {
    case ScalarType::Float32: return "Float";
    case ScalarType::Float16: return "Half";
    case ScalarType::BFloat16: return "BFloat16";
    case ScalarType::Float64: return "Double";
  }
  return "?";
}

Plan::Plan(const std::int64_t* numels, std::int64_t num_tensors, std::int64_t chunk_size)
    : chunk_size_(chunk_size) {
  if (chunk_size <= 0) throw std::invalid_argument("ampfuse::Plan: chunk_size must be positive");
  tensors_.reserve(static_cast<std::size_t>(num_tensors));
  numels_.reserve(static_cast<std::size_t>(num_tensors));
  chunk_offsets_.reserve(static_cast<std::size_t>(num_tensors) + 1);
  chunk_offsets_.push_back(0);
  for (std::int64_t t = 0; t < num_tensors; ++t) {
    const std::int64_t n = numels[t];
    if (n < 0) throw std::invalid_argument("ampfuse::Plan: tensor " + std::to_string(t) + " has negative numel");
    if (n == 0) continue;
    tensors_.push_back(t);
    numels_.push_back(n);
    total_elements_ += n;
    chunk_offsets_.push_back(chunk_offsets_.back() + (n + chunk_size - 1) / chunk_size);
  }
}

std::int64_t Plan::slot_of_chunk(std::int64_t i) const {
  // Last offset <= i; offsets are strictly increasing since empty tensors are dropped.
  auto it = std::upper_bound(chunk_offsets_.begin(), chunk_offsets_.end(), i);
  return static_cast<std::int64_t>(it - chunk_offsets_.begin()) - 1;
}

Chunk Plan::chunk(std::int64_t i) const {
  const std::int64_t slot = slot_of_chunk(i);
  const std::int64_t begin = (i - chunk_offsets_[slot]) * chunk_size_;
  return {tensors_[slot], begin, std::min(chunk_size_, numels_[slot] - begin)};
}

}  // namespace ampfuse
