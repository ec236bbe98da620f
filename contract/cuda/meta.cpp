// Host-side packing of CUDA launch metadata (plain C++: built with or without CUDA).

#include "contract/cuda/launch.h"

namespace ampfuse::sdk::cuda {

std::vector<std::int64_t> pack_meta(const TensorListsView& lists, const Plan& plan) {
  const int depth = lists.depth();
  const auto n = static_cast<std::int64_t>(plan.tensors().size());
  std::vector<std::int64_t> words;
  words.reserve(static_cast<std::size_t>((depth + 2) * n + 1));
  for (int l = 0; l < depth; ++l)
    for (std::int64_t t : plan.tensors())
      words.push_back(static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(lists.lists[l][t].data)));
  words.insert(words.end(), plan.numels().begin(), plan.numels().end());
  words.insert(words.end(), plan.chunk_offsets().begin(), plan.chunk_offsets().end());
  return words;
}

}  // namespace ampfuse::sdk::cuda
