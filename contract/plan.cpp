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

Plan::Plan(const std::vector<PlanRun>& runs, std::int64_t chunk_size) : chunk_size_(chunk_size) {
  if (chunk_size <= 0) throw std::invalid_argument("ampfuse::Plan: chunk_size must be positive");
  tensors_.reserve(runs.size());
  numels_.reserve(runs.size());
  begins_.reserve(runs.size());
  places_.reserve(runs.size());
  chunk_offsets_.reserve(runs.size() + 1);
  chunk_offsets_.push_back(0);
  std::int64_t tensor = -1, next_begin = 0;  // the tensor of the run before, and where its next run begins
  for (std::size_t k = 0; k < runs.size(); ++k) {
    const PlanRun& r = runs[k];
    if (r.numel < 0 || r.begin < 0 || r.place < 0)
      throw std::invalid_argument("ampfuse::Plan: run " + std::to_string(k) + " has a negative numel, begin or place");
    if (r.numel == 0) continue;
    const bool continues = r.tensor == tensor && r.begin == next_begin;
    if (!continues && r.begin != 0)
      throw std::invalid_argument("ampfuse::Plan: run " + std::to_string(k) + " of tensor " + std::to_string(r.tensor) +
                                  " begins at " + std::to_string(r.begin) + ", not where the run before ended (" +
                                  std::to_string(r.tensor == tensor ? next_begin : 0) + ")");
    tensor = r.tensor;
    next_begin = r.begin + r.numel;
    tensors_.push_back(r.tensor);
    numels_.push_back(r.numel);
    begins_.push_back(r.begin);
    places_.push_back(r.place);
    total_elements_ += r.numel;
    chunk_offsets_.push_back(chunk_offsets_.back() + (r.numel + chunk_size - 1) / chunk_size);
  }
}

std::int64_t Plan::slot_of_chunk(std::int64_t i) const {
  // Last offset <= i; offsets are strictly increasing since empty tensors are dropped.
  auto it = std::upper_bound(chunk_offsets_.begin(), chunk_offsets_.end(), i);
  return static_cast<std::int64_t>(it - chunk_offsets_.begin()) - 1;
}

Chunk Plan::chunk(std::int64_t i) const {
  const std::int64_t slot = slot_of_chunk(i);
  const std::int64_t into = (i - chunk_offsets_[slot]) * chunk_size_;  // elements into the slot
  const auto k = static_cast<std::size_t>(slot);
  const std::int64_t begin = begins_.empty() ? into : begins_[k] + into;
  return {tensors_[slot], begin, std::min(chunk_size_, numels_[slot] - into), begins_.empty() ? into : places_[k] + into};
}

}  // namespace ampfuse
