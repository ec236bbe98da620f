// The CUDA kernels' index math on the CPU, over a simulated grid: one block per chunk, each of its threads walking
// the chunk as adam_kernel, sgd_kernel and scale_kernel do (16-byte vectors, then a scalar tail, when every list's
// chunk start is aligned; element by element otherwise). Every element of every tensor must be visited exactly once,
// nothing outside, and every vector load must be on a 16-byte boundary. locate_chunk, vector_split and is_aligned16
// are the kernels' own (ampfuse/sdk/chunk_math.h); the metadata is pack_meta's, read as GlobalMeta reads it. Nothing
// is allocated: tensors live at simulated addresses, so sizes past 2^31 cost only the chunks checked.

#include <ampfuse/multi_tensor.h>
#include <ampfuse/sdk/chunk_math.h>
#include <ampfuse/sdk/cuda.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "tests/common.h"

namespace {

using ampfuse::Plan;
using ampfuse::sdk::cuda::BlockChunk;
using ampfuse::sdk::cuda::is_aligned16;
using ampfuse::sdk::cuda::locate_chunk;
using ampfuse::sdk::cuda::vector_split;
using ampfuse::sdk::cuda::VectorSplit;

// Two lists (say param and grad) aligned independently: a block takes the vector path only when both are.
constexpr int kDepth = 2;
constexpr int kBlockSize = 512;  // cuda_kernel.cuh's kBlockSize (not includable here: it needs the CUDA headers)

// A list of tensors at simulated addresses, base[l][t] for list l and tensor t (the caller's index).
struct SimList {
  std::vector<std::int64_t> numels;
  int elem_size = 4;
  std::vector<std::uintptr_t> base[kDepth];
};

// Lays the tensors out one after another from a 16-byte boundary (one region per list, far apart), tensor t of list
// l starting misalign[l][t] bytes past its own boundary.
SimList make_list(const std::vector<std::int64_t>& numels, int elem_size,
                  const std::vector<std::uintptr_t> (&misalign)[kDepth]) {
  SimList s;
  s.numels = numels;
  s.elem_size = elem_size;
  for (int l = 0; l < kDepth; ++l) {
    std::uintptr_t cursor = (static_cast<std::uintptr_t>(l) + 1) << 44;
    for (std::size_t t = 0; t < numels.size(); ++t) {
      s.base[l].push_back(cursor + misalign[l][t]);
      const auto bytes = static_cast<std::uintptr_t>(numels[t]) * static_cast<std::uintptr_t>(elem_size);
      cursor += (bytes + misalign[l][t] + 255) / 256 * 256;
    }
  }
  return s;
}

// pack_meta's words, read through GlobalMeta's accessors (InlineMeta copies the same words into arrays in the same
// order: make_inline_meta).
struct HostMeta {
  std::int64_t num_tensors = 0;
  std::int64_t chunk_size = 0;
  std::vector<std::int64_t> words;

  std::uintptr_t data(int list, std::int64_t t) const {
    return static_cast<std::uintptr_t>(words[static_cast<std::size_t>(list * num_tensors + t)]);
  }
  std::int64_t numel(std::int64_t t) const { return words[static_cast<std::size_t>(kDepth * num_tensors + t)]; }
  std::int64_t chunk_offset(std::int64_t t) const {
    return words[static_cast<std::size_t>((kDepth + 1) * num_tensors + t)];
  }
};

HostMeta make_meta(const SimList& s, const Plan& plan) {
  const auto dtype = s.elem_size == 4 ? ampfuse::ScalarType::Float32 : ampfuse::ScalarType::BFloat16;
  ampfuse::TensorListsView view;
  view.lists.resize(kDepth);
  for (int l = 0; l < kDepth; ++l)
    for (std::size_t t = 0; t < s.numels.size(); ++t)
      view.lists[l].push_back({reinterpret_cast<void*>(s.base[l][t]), s.numels[t], dtype});
  HostMeta m;
  m.num_tensors = static_cast<std::int64_t>(plan.tensors().size());
  m.chunk_size = plan.chunk_size();
  m.words = ampfuse::sdk::cuda::pack_meta(view, plan);
  EXPECT_EQ(m.words.size(), static_cast<std::size_t>((kDepth + 2) * m.num_tensors + 1));
  return m;
}

// The first failures of a simulation, and how many there were: a broken walk fails on most elements.
struct Errors {
  std::int64_t count = 0;
  std::string first;

  void add(const std::string& what) {
    if (count++ < 5) first += "\n  " + what;
  }
  ::testing::AssertionResult result() const {
    if (count == 0) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << count << " errors, the first:" << first;
  }
};

struct Stats {
  std::int64_t vector_elements = 0;  // visited through 16-byte vectors
  std::int64_t scalar_elements = 0;
  std::int64_t aligned_blocks = 0;
  std::int64_t misaligned_blocks = 0;
  std::int64_t max_begin = 0;
};

// locate_chunk(meta, chunk) against the planner's view of the same chunk.
void check_against_plan(const Plan& plan, std::int64_t chunk, const BlockChunk& c, Errors& errors) {
  const ampfuse::Chunk want = plan.chunk(chunk);
  const std::int64_t slot = plan.slot_of_chunk(chunk);
  if (c.slot != slot || c.begin != want.begin || c.size != want.size || plan.tensors()[slot] != want.tensor)
    errors.add("chunk " + std::to_string(chunk) + ": locate_chunk gives slot " + std::to_string(c.slot) + " [" +
               std::to_string(c.begin) + ", +" + std::to_string(c.size) + "), the plan slot " + std::to_string(slot) +
               " [" + std::to_string(want.begin) + ", +" + std::to_string(want.size) + ")");
}

// Runs every thread of the block for chunk c as the kernels do, calling visit(first, count) for each run of the
// chunk's elements [first, first + count) a thread takes: one 16-byte vector or one element.
template <class Visit>
void run_block(const HostMeta& meta, const BlockChunk& c, int elem_size, int block_dim, Stats& stats, Errors& errors,
               Visit&& visit) {
  const int vec_elems = 16 / elem_size;  // Vec16<T>::kSize
  std::uintptr_t start[kDepth];          // each list's pointer + c.begin
  bool aligned = true;
  for (int l = 0; l < kDepth; ++l) {
    start[l] = meta.data(l, c.slot) + static_cast<std::uintptr_t>(c.begin) * static_cast<std::uintptr_t>(elem_size);
    aligned = aligned && is_aligned16(reinterpret_cast<const void*>(start[l]));
  }
  ++(aligned ? stats.aligned_blocks : stats.misaligned_blocks);
  stats.max_begin = std::max(stats.max_begin, c.begin);
  auto take = [&](std::int64_t first, std::int64_t count, bool is_vector) {
    if (first < 0 || first + count > c.size) {
      errors.add("slot " + std::to_string(c.slot) + " chunk at " + std::to_string(c.begin) + " of size " +
                 std::to_string(c.size) + ": element " + std::to_string(first) + " (+" + std::to_string(count) +
                 ") outside the chunk");
      return;
    }
    if (is_vector) {
      for (int l = 0; l < kDepth; ++l)
        if ((start[l] + static_cast<std::uintptr_t>(first * elem_size)) % 16 != 0)
          errors.add("vector load off a 16-byte boundary in list " + std::to_string(l));
      stats.vector_elements += count;
    } else {
      stats.scalar_elements += count;
    }
    visit(first, count);
  };
  for (int thread = 0; thread < block_dim; ++thread) {
    // The kernels' loop, with threadIdx.x = thread and blockDim.x = block_dim.
    std::int64_t i = thread;
    if (aligned) {
      const VectorSplit split = vector_split(c.size, vec_elems);
      for (; i < split.num_vec; i += block_dim) take(i * vec_elems, vec_elems, true);
      i = split.tail_begin + thread;
    }
    for (; i < c.size; i += block_dim) take(i, 1, false);
  }
}

// Simulates the whole grid and checks, with a count per element, that every element of every tensor is visited
// exactly once.
::testing::AssertionResult simulate_grid(const SimList& s, std::int64_t chunk_size, int block_dim, Stats& stats) {
  const Plan plan(s.numels, chunk_size);
  const HostMeta meta = make_meta(s, plan);
  Errors errors;
  std::vector<std::vector<std::uint8_t>> visits(s.numels.size());
  for (std::size_t t = 0; t < s.numels.size(); ++t) visits[t].assign(static_cast<std::size_t>(s.numels[t]), 0);
  for (std::int64_t chunk = 0; chunk < plan.num_chunks(); ++chunk) {
    const BlockChunk c = locate_chunk(meta, chunk);
    check_against_plan(plan, chunk, c, errors);
    if (c.slot < 0 || c.slot >= meta.num_tensors || c.begin < 0 || c.size < 1 ||
        c.begin + c.size > meta.numel(c.slot)) {
      errors.add("chunk " + std::to_string(chunk) + " outside its tensor");
      continue;
    }
    std::vector<std::uint8_t>& v = visits[static_cast<std::size_t>(plan.tensors()[c.slot])];
    run_block(meta, c, s.elem_size, block_dim, stats, errors, [&](std::int64_t first, std::int64_t count) {
      for (std::int64_t e = c.begin + first; e < c.begin + first + count; ++e)
        if (v[static_cast<std::size_t>(e)] < 255) ++v[static_cast<std::size_t>(e)];
    });
  }
  for (std::size_t t = 0; t < visits.size(); ++t)
    for (std::size_t e = 0; e < visits[t].size(); ++e)
      if (visits[t][e] != 1)
        errors.add("tensor " + std::to_string(t) + " element " + std::to_string(e) + " visited " +
                   std::to_string(visits[t][e]) + " times");
  if (stats.vector_elements + stats.scalar_elements != plan.total_elements())
    errors.add(std::to_string(stats.vector_elements + stats.scalar_elements) + " visits for " +
               std::to_string(plan.total_elements()) + " elements");
  return errors.result();
}

std::string describe(const SimList& s, std::int64_t chunk_size, int block_dim) {
  std::string d = std::to_string(s.numels.size()) + " tensors, element size " + std::to_string(s.elem_size) +
                  ", chunk " + std::to_string(chunk_size) + ", block " + std::to_string(block_dim) + "; sizes";
  for (std::size_t t = 0; t < s.numels.size() && t < 40; ++t)
    d += " " + std::to_string(s.numels[t]) + "@+" + std::to_string(s.base[0][t] % 16) + "/+" +
         std::to_string(s.base[1][t] % 16);
  return d;
}

// Sizes at the edges of the walk: 0, 1, odd, a vector's width -1/0/+1, a chunk's -1/0/+1, two chunks +/-1.
std::vector<std::int64_t> edge_sizes(std::int64_t chunk_size, int vec_elems) {
  const std::int64_t v = vec_elems, c = chunk_size;
  return {0, 1, 2, 3, 5, 7, v - 1, v, v + 1, 2 * v - 1, 2 * v + 1, c - 1, c, c + 1, 2 * c - 1, 2 * c, 2 * c + 1,
          3 * c + v + 1, 0, 33};
}

TEST(GridSim, EdgeSizesEveryElementOnce) {
  // Chunk sizes: 64 and 1000 keep every chunk start of a tensor as aligned as the tensor (64 * 2 and 1000 * 2
  // bytes are multiples of 16); 100 alternates for 2-byte elements (200 bytes), 1001 for both sizes; 4096 gives each
  // thread of a 512-thread block two vectors of 4-byte elements.
  std::int64_t cases = 0, elements = 0;
  Stats total;
  for (const std::int64_t chunk_size : {64, 100, 1000, 1001, 4096}) {
    for (const int elem_size : {4, 2}) {
      const std::vector<std::int64_t> numels = edge_sizes(chunk_size, 16 / elem_size);
      // Starts: both lists aligned; list 0 two or four bytes past a boundary (a misaligned view); list 1 off.
      for (const std::uintptr_t off0 : {0, 2, 4}) {
        if (off0 % static_cast<std::uintptr_t>(elem_size) != 0) continue;  // no 4-byte element starts at +2
        for (const std::uintptr_t off1 : {0, 4}) {
          std::vector<std::uintptr_t> misalign[kDepth];
          // Every third tensor keeps an aligned start, so one list mixes both paths.
          for (std::size_t t = 0; t < numels.size(); ++t) {
            misalign[0].push_back(t % 3 == 0 ? 0 : off0);
            misalign[1].push_back(t % 3 == 1 ? 0 : off1);
          }
          const SimList s = make_list(numels, elem_size, misalign);
          for (const int block_dim : {kBlockSize, 128}) {
            Stats stats;
            EXPECT_TRUE(simulate_grid(s, chunk_size, block_dim, stats)) << describe(s, chunk_size, block_dim);
            ++cases;
            elements += stats.vector_elements + stats.scalar_elements;
            total.vector_elements += stats.vector_elements;
            total.scalar_elements += stats.scalar_elements;
            total.aligned_blocks += stats.aligned_blocks;
            total.misaligned_blocks += stats.misaligned_blocks;
          }
        }
      }
    }
  }
  // Both paths ran, and often: a walk that never took the vectors would pass the coverage checks.
  EXPECT_GT(total.vector_elements, elements / 4);
  EXPECT_GT(total.misaligned_blocks, total.aligned_blocks / 4);
  std::cout << "[ grid sim ] " << cases << " grids, " << elements << " elements (" << total.vector_elements
            << " through vectors), " << total.aligned_blocks << " aligned and " << total.misaligned_blocks
            << " misaligned blocks\n";
}

TEST(GridSim, RandomListsEveryElementOnce) {
  const auto seed = ampfuse_test::seed_for_test();
  std::mt19937_64 rng(seed);
  const std::vector<std::int64_t> chunk_sizes = {64, 100, 1000, 1001, 4096};
  std::int64_t elements = 0;
  for (int round = 0; round < 60; ++round) {
    const std::int64_t chunk_size = chunk_sizes[rng() % chunk_sizes.size()];
    const int elem_size = rng() % 2 ? 4 : 2;
    const int block_dim = rng() % 2 ? kBlockSize : 128;
    const std::vector<std::int64_t> edges = edge_sizes(chunk_size, 16 / elem_size);
    const auto n = static_cast<std::size_t>(round == 0 ? 0 : rng() % 41);
    std::vector<std::int64_t> numels(n);
    std::vector<std::uintptr_t> misalign[kDepth];
    for (std::size_t t = 0; t < n; ++t) {
      numels[t] = rng() % 2 ? edges[rng() % edges.size()] : static_cast<std::int64_t>(rng() % (3 * chunk_size + 2));
      // Half the starts aligned, the others any element boundary within 16 bytes.
      for (int l = 0; l < kDepth; ++l)
        misalign[l].push_back(rng() % 2 ? 0 : static_cast<std::uintptr_t>(elem_size) * (rng() % (16 / elem_size)));
    }
    const SimList s = make_list(numels, elem_size, misalign);
    Stats stats;
    EXPECT_TRUE(simulate_grid(s, chunk_size, block_dim, stats))
        << "round " << round << ": " << describe(s, chunk_size, block_dim);
    elements += stats.vector_elements + stats.scalar_elements;
  }
  std::cout << "[ grid sim ] 60 random lists, " << elements << " elements\n";
}

TEST(GridSim, LocateChunkMatchesPlanOnLongLists) {
  // Long lists, many of them empty tensors, so that the binary search takes many steps and meets runs of equal
  // tensors' first chunks in the caller's numbering (not in the launch's: empty tensors are left out).
  const auto seed = ampfuse_test::seed_for_test();
  std::mt19937_64 rng(seed);
  std::int64_t chunks = 0;
  for (int round = 0; round < 20; ++round) {
    const std::int64_t chunk_size = std::vector<std::int64_t>{1, 7, 64, 1000}[rng() % 4];
    const auto n = static_cast<std::size_t>(1 + rng() % 3000);
    std::vector<std::int64_t> numels(n);
    std::vector<std::uintptr_t> misalign[kDepth];
    for (std::size_t t = 0; t < n; ++t) {
      numels[t] = rng() % 3 == 0 ? 0 : 1 + static_cast<std::int64_t>(rng() % (3 * chunk_size));
      for (int l = 0; l < kDepth; ++l) misalign[l].push_back(0);
    }
    const SimList s = make_list(numels, 4, misalign);
    const Plan plan(numels, chunk_size);
    const HostMeta meta = make_meta(s, plan);
    Errors errors;
    for (std::int64_t chunk = 0; chunk < plan.num_chunks(); ++chunk)
      check_against_plan(plan, chunk, locate_chunk(meta, chunk), errors);
    EXPECT_TRUE(errors.result()) << "round " << round << ", " << n << " tensors, chunk " << chunk_size;
    chunks += plan.num_chunks();
  }
  std::cout << "[ grid sim ] " << chunks << " chunks located\n";
}

TEST(GridSim, ElementOffsetsBeyondTwoToThe31) {
  // Sizes only. Every chunk is located and checked against the plan and against its tensor's previous chunk (the
  // chunks tile each tensor); a tensor's first and last chunks, and those around elements 2^31 and 2^32, are also
  // walked thread by thread with a count per element.
  const std::int64_t two31 = std::int64_t{1} << 31, two32 = std::int64_t{1} << 32;
  const std::vector<std::int64_t> numels = {3, two31 + 5, 0, two32 + 3 * (std::int64_t{1} << 20) + 17, 7, two31 - 1};
  std::int64_t walked = 0, located = 0;
  for (const std::int64_t chunk_size : {std::int64_t{1} << 20, (std::int64_t{1} << 20) + 1}) {
    for (const int elem_size : {4, 2}) {
      std::vector<std::uintptr_t> misalign[kDepth];
      for (std::size_t t = 0; t < numels.size(); ++t) {
        misalign[0].push_back(t == 3 ? static_cast<std::uintptr_t>(elem_size) : 0);
        misalign[1].push_back(0);
      }
      const SimList s = make_list(numels, elem_size, misalign);
      const Plan plan(numels, chunk_size);
      const HostMeta meta = make_meta(s, plan);
      Errors errors;
      Stats stats;
      std::vector<std::int64_t> next(static_cast<std::size_t>(meta.num_tensors), 0);  // per slot
      for (std::int64_t chunk = 0; chunk < plan.num_chunks(); ++chunk) {
        const BlockChunk c = locate_chunk(meta, chunk);
        check_against_plan(plan, chunk, c, errors);
        ++located;
        if (c.slot < 0 || c.slot >= meta.num_tensors) {
          errors.add("chunk " + std::to_string(chunk) + ": slot " + std::to_string(c.slot));
          continue;
        }
        std::int64_t& expected_begin = next[static_cast<std::size_t>(c.slot)];
        if (c.begin != expected_begin || c.size < 1 || c.size > chunk_size ||
            (c.size < chunk_size && c.begin + c.size != meta.numel(c.slot)))
          errors.add("chunk " + std::to_string(chunk) + " [" + std::to_string(c.begin) + ", +" +
                     std::to_string(c.size) + ") does not follow " + std::to_string(expected_begin));
        expected_begin = c.begin + c.size;
        const VectorSplit split = vector_split(c.size, 16 / elem_size);
        if (split.tail_begin != split.num_vec * (16 / elem_size) || c.size - split.tail_begin < 0 ||
            c.size - split.tail_begin >= 16 / elem_size)
          errors.add("vector_split(" + std::to_string(c.size) + ") = " + std::to_string(split.num_vec) + ", " +
                     std::to_string(split.tail_begin));
        const std::int64_t numel = meta.numel(c.slot);
        auto holds = [&](std::int64_t e) { return c.begin <= e && e < c.begin + c.size; };
        const bool walk = c.begin == 0 || c.begin + c.size == numel || holds(two31 - 1) || holds(two31) ||
                          holds(two31 + 1) || holds(two32) || holds(numel - chunk_size);
        if (!walk) continue;
        std::vector<std::uint8_t> visits(static_cast<std::size_t>(c.size), 0);
        run_block(meta, c, elem_size, kBlockSize, stats, errors, [&](std::int64_t first, std::int64_t count) {
          for (std::int64_t e = first; e < first + count; ++e)
            if (visits[static_cast<std::size_t>(e)] < 255) ++visits[static_cast<std::size_t>(e)];
        });
        for (std::size_t e = 0; e < visits.size(); ++e)
          if (visits[e] != 1)
            errors.add("slot " + std::to_string(c.slot) + " element " + std::to_string(c.begin + std::int64_t(e)) +
                       " visited " + std::to_string(visits[e]) + " times");
        ++walked;
      }
      for (std::int64_t slot = 0; slot < meta.num_tensors; ++slot)
        if (next[static_cast<std::size_t>(slot)] != meta.numel(slot))
          errors.add("slot " + std::to_string(slot) + " covered up to " +
                     std::to_string(next[static_cast<std::size_t>(slot)]) + " of " + std::to_string(meta.numel(slot)));
      EXPECT_TRUE(errors.result()) << "chunk " << chunk_size << ", element size " << elem_size;
      EXPECT_GT(stats.max_begin, two32) << "a walked chunk starts past 2^32";
      EXPECT_GT(stats.vector_elements, 0);
      EXPECT_GT(stats.misaligned_blocks, 0);
    }
  }
  std::cout << "[ grid sim ] " << located << " chunks located, " << walked << " walked thread by thread\n";
}

// FusedAdam's 8-bit CUDA launch (fused/adam/adam8_cuda.cu): planned in chunks of kQuantBlock = 256, one block of 256
// threads per chunk, thread t on element c.begin + t when t < c.size, the block's absmax at c.begin / 256. Every
// quantization block of every tensor, the short last ones and those of a tensor past 2^31 elements included, must be
// one block's, whole, with its absmax index in range.
TEST(GridSim, Adam8BlocksAreTheQuantizationBlocks) {
  constexpr std::int64_t kQuantBlock = 256;  // fused/adam/adam8_math.h
  const std::vector<std::int64_t> numels = {4096, 4096 + 100, 0, 3 * 65536 + 1000, (std::int64_t{1} << 31) + 17};
  const SimList s = make_list(numels, 4, {std::vector<std::uintptr_t>(numels.size(), 0),
                                          std::vector<std::uintptr_t>(numels.size(), 0)});
  const Plan plan(numels, kQuantBlock);
  const HostMeta meta = make_meta(s, plan);
  std::vector<std::vector<std::uint8_t>> seen(numels.size());
  for (std::size_t t = 0; t < numels.size(); ++t) seen[t].assign(static_cast<std::size_t>((numels[t] + 255) / 256), 0);
  for (std::int64_t b = 0; b < plan.num_chunks(); ++b) {
    const BlockChunk c = locate_chunk(meta, b);
    const std::int64_t t = plan.tensors()[static_cast<std::size_t>(c.slot)];
    ASSERT_EQ(c.begin % kQuantBlock, 0) << "block " << b;
    ASSERT_TRUE(c.size >= 1 && c.size <= kQuantBlock) << "block " << b;
    ASSERT_LE(c.begin + c.size, numels[static_cast<std::size_t>(t)]) << "block " << b;
    // A short block is the tensor's last.
    if (c.size < kQuantBlock) ASSERT_EQ(c.begin + c.size, numels[static_cast<std::size_t>(t)]) << "block " << b;
    const std::int64_t absmax_index = c.begin / kQuantBlock;
    ASSERT_LT(absmax_index, static_cast<std::int64_t>(seen[static_cast<std::size_t>(t)].size()));
    ++seen[static_cast<std::size_t>(t)][static_cast<std::size_t>(absmax_index)];
  }
  for (std::size_t t = 0; t < numels.size(); ++t)
    EXPECT_TRUE(std::all_of(seen[t].begin(), seen[t].end(), [](std::uint8_t n) { return n == 1; }))
        << "tensor " << t << ": a quantization block taken by no block or by two";
}

}  // namespace
