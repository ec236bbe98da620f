// The planner: every element of every tensor in exactly one chunk, empty
// tensors left out, 64-bit sizes.

#include <ampfuse/multi_tensor.h>
#include <ampfuse/sdk/cpu.h>
// The SDK's CPU executor, built here for the baseline instruction set (its
// contents are local to this file), to walk plans of runs directly.
#define AMPFUSE_CPU_ISA baseline
#include <ampfuse/sdk/cpu_kernel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include "tests/common.h"

namespace {

using ampfuse::Plan;

// Checks the plan against the sizes: chunks of each tensor tile [0, numel)
// exactly once, in order, and only the last chunk of a tensor is short.
void expect_exact_cover(const std::vector<std::int64_t>& numels, const Plan& plan) {
  std::vector<std::int64_t> next(numels.size(), 0);  // next uncovered element per tensor
  std::int64_t last_tensor = -1;
  for (std::int64_t c = 0; c < plan.num_chunks(); ++c) {
    const ampfuse::Chunk ch = plan.chunk(c);
    ASSERT_GE(ch.tensor, 0);
    ASSERT_LT(ch.tensor, static_cast<std::int64_t>(numels.size()));
    ASSERT_GE(ch.tensor, last_tensor) << "chunks out of tensor order at chunk " << c;
    last_tensor = ch.tensor;
    ASSERT_EQ(ch.begin, next[ch.tensor]) << "gap or overlap in tensor " << ch.tensor << " at chunk " << c;
    ASSERT_GE(ch.size, 1);
    ASSERT_LE(ch.size, plan.chunk_size());
    if (ch.begin + ch.size < numels[ch.tensor]) ASSERT_EQ(ch.size, plan.chunk_size());
    next[ch.tensor] += ch.size;
  }
  std::int64_t total = 0, non_empty = 0;
  for (std::size_t t = 0; t < numels.size(); ++t) {
    ASSERT_EQ(next[t], numels[t]) << "tensor " << t << " not fully covered";
    total += numels[t];
    non_empty += numels[t] > 0;
  }
  EXPECT_EQ(plan.total_elements(), total);
  EXPECT_EQ(static_cast<std::int64_t>(plan.tensors().size()), non_empty);
}

TEST(Plan, RandomListsCoverEveryElementOnce) {
  const auto seed = ampfuse_test::seed_for_test();
  std::mt19937_64 rng(seed);
  const std::vector<std::int64_t> chunk_sizes = {1, 7, 16, 1024, 65536};
  for (int round = 0; round < 40; ++round) {
    const std::int64_t chunk = chunk_sizes[rng() % chunk_sizes.size()];
    const std::int64_t n = round == 0 ? 0 : round == 1 ? 2000 : static_cast<std::int64_t>(rng() % 2001);
    // Sizes: 0, 1, odd, around the vector width (8, 16) and the chunk size.
    const std::vector<std::int64_t> special = {0, 1, 3, 7, 8, 9, 15, 16, 17, chunk - 1, chunk, chunk + 1,
                                               2 * chunk + 1};
    std::vector<std::int64_t> numels(static_cast<std::size_t>(n));
    for (auto& v : numels)
      v = rng() % 2 ? std::max<std::int64_t>(0, special[rng() % special.size()])
                    : static_cast<std::int64_t>(rng() % (3 * std::min<std::int64_t>(chunk, 5000) + 2));
    SCOPED_TRACE("round " + std::to_string(round) + ", " + std::to_string(n) + " tensors, chunk " +
                 std::to_string(chunk));
    expect_exact_cover(numels, Plan(numels, chunk));
  }
}

TEST(Plan, EmptyTensorsAreLeftOut) {
  const Plan plan(std::vector<std::int64_t>{0, 5, 0, 0, 3, 0}, 4);
  EXPECT_EQ(plan.tensors(), (std::vector<std::int64_t>{1, 4}));
  EXPECT_EQ(plan.num_chunks(), 3);
  EXPECT_EQ(plan.chunk(2).tensor, 4);
  expect_exact_cover({0, 5, 0, 0, 3, 0}, plan);
  EXPECT_EQ(Plan(std::vector<std::int64_t>{0, 0}, 4).num_chunks(), 0);
  EXPECT_EQ(Plan(std::vector<std::int64_t>{}, 4).num_chunks(), 0);
}

TEST(Plan, BeyondTwoToThe31Elements) {
  // Sizes only: nothing is allocated.
  const std::int64_t big = (std::int64_t{1} << 31) + 12345;  // one tensor past int32
  const std::vector<std::int64_t> numels = {big, 0, (std::int64_t{1} << 31) - 1, big * 2 + 1, 17};
  const std::int64_t chunk = 65536;
  const Plan plan(numels, chunk);
  expect_exact_cover(numels, plan);
  EXPECT_GT(plan.total_elements(), std::int64_t{1} << 33);
  const ampfuse::Chunk last = plan.chunk(plan.num_chunks() - 1);
  EXPECT_EQ(last.tensor, 4);
  EXPECT_EQ(last.size, 17);
  const ampfuse::Chunk tail_of_big = plan.chunk((big + chunk - 1) / chunk - 1);
  EXPECT_EQ(tail_of_big.tensor, 0);
  EXPECT_EQ(tail_of_big.begin + tail_of_big.size, big);
}

// A plan of runs (a view with gaps walked where it lies): each run is
// chunked as a tensor is, no chunk crosses from one run into the next, the
// tensor's dense elements are covered once in order, each chunk's place is
// its run's place plus its offset into the run, and one slot per tensor is
// its first. Random runs, past 2^31 places too.
TEST(Plan, RunsAreChunkedOneByOne) {
  const auto seed = ampfuse_test::seed_for_test();
  std::mt19937_64 rng(seed);
  for (int round = 0; round < 40; ++round) {
    SCOPED_TRACE("round " + std::to_string(round) + " (seed " + std::to_string(seed) + ")");
    const std::int64_t chunk = std::vector<std::int64_t>{1, 16, 1024, 65536}[rng() % 4];
    std::vector<ampfuse::PlanRun> runs;
    std::vector<std::int64_t> numels;
    const int tensors = static_cast<int>(rng() % 12);
    for (int t = 0; t < tensors; ++t) {
      const int count = 1 + static_cast<int>(rng() % 5);
      const std::int64_t length = rng() % 4 == 0 ? 0 : static_cast<std::int64_t>(rng() % (3 * chunk + 2));
      const std::int64_t stride = length + static_cast<std::int64_t>(rng() % 1000) + (rng() % 2 ? (std::int64_t{1} << 31) : 0);
      for (int r = 0; r < count; ++r) runs.push_back({t, r * length, length, r * stride});
      numels.push_back(count * length);
    }
    const Plan plan(runs, chunk);
    std::vector<std::int64_t> next(numels.size(), 0);
    std::int64_t firsts = 0;
    for (std::size_t k = 0; k < plan.tensors().size(); ++k) firsts += plan.first_of_tensor(k);
    EXPECT_EQ(firsts, std::count_if(numels.begin(), numels.end(), [](std::int64_t n) { return n > 0; }));
    for (std::int64_t c = 0; c < plan.num_chunks(); ++c) {
      const ampfuse::Chunk ch = plan.chunk(c);
      ASSERT_EQ(ch.begin, next[static_cast<std::size_t>(ch.tensor)]) << "chunk " << c;
      const std::int64_t length = numels[static_cast<std::size_t>(ch.tensor)] /
                                  static_cast<std::int64_t>(std::count_if(runs.begin(), runs.end(), [&](const auto& r) {
                                    return r.tensor == ch.tensor;
                                  }));
      const std::int64_t run = ch.begin / length, into = ch.begin % length;
      ASSERT_LE(into + ch.size, length) << "chunk " << c << " crosses from run " << run << " into the next";
      ASSERT_TRUE(ch.size == chunk || into + ch.size == length) << "chunk " << c << " is short inside its run";
      ASSERT_EQ(ch.place, runs[static_cast<std::size_t>(std::find_if(runs.begin(), runs.end(), [&](const auto& r) {
                                                            return r.tensor == ch.tensor;
                                                          }) - runs.begin()) + static_cast<std::size_t>(run)]
                                  .place +
                              into)
          << "chunk " << c;
      next[static_cast<std::size_t>(ch.tensor)] += ch.size;
    }
    EXPECT_EQ(next, numels);
  }
  // A tensor's runs must follow one another from its element 0.
  using R = ampfuse::PlanRun;
  EXPECT_THROW(Plan(std::vector<R>{{0, 5, 5, 0}}, 4), std::invalid_argument);
  EXPECT_THROW(Plan(std::vector<R>{{0, 0, 5, 0}, {0, 6, 5, 10}}, 4), std::invalid_argument);
  EXPECT_THROW(Plan(std::vector<R>{{0, 0, 5, -1}}, 4), std::invalid_argument);
  EXPECT_NO_THROW(Plan(std::vector<R>{{0, 0, 5, 0}, {0, 5, 5, 10}, {1, 0, 3, 0}}, 4));
  EXPECT_TRUE(Plan(std::vector<std::int64_t>{3, 4}, 4).begins().empty());
}

// The executor on plans of runs: list 0 (a "parameter" with gaps, spread
// through a larger buffer) at each chunk's place, list 1 (dense) at its
// begin; each element of list 0 gains its dense twin exactly once, and
// nothing between the runs is written. Runs of one element (a whole tensor,
// or one piece of a split one, which the one-element walks must not take
// for a whole tensor), a first run away from the buffer's start, runs longer
// than a chunk (a last chunk of one element), random runs; every range of
// chunks a worker may get.
TEST(Plan, TheExecutorWalksRunsWhereTheyLie) {
  namespace ex = ampfuse::sdk::cpu::baseline;
  const auto seed = ampfuse_test::seed_for_test();
  std::mt19937_64 rng(seed);
  using R = ampfuse::PlanRun;
  std::vector<std::pair<std::vector<R>, std::int64_t>> cases = {
      {{{0, 0, 1, 0}, {0, 1, 1, 5}}, 64},                 // split into runs of one element
      {{{0, 0, 1, 7}}, 64},                               // a one-element run away from the start
      {{{0, 0, 1, 0}, {1, 0, 1, 0}, {1, 1, 1, 3}, {2, 0, 1, 0}}, 64},
      {{{0, 0, 65537, 0}, {0, 65537, 65537, 70000}, {1, 0, 3, 0}}, 65536},
      {{{0, 0, 17, 40}, {0, 17, 17, 90}, {1, 0, 1, 0}, {2, 0, 33, 0}}, 16},
  };
  for (int round = 0; round < 30; ++round) {
    std::vector<R> runs;
    const std::int64_t chunk = std::vector<std::int64_t>{1, 7, 16, 64}[rng() % 4];
    for (std::int64_t t = 0, n = static_cast<std::int64_t>(rng() % 6); t < n; ++t) {
      const std::int64_t length = static_cast<std::int64_t>(rng() % 40), count = 1 + static_cast<std::int64_t>(rng() % 4);
      const std::int64_t first = static_cast<std::int64_t>(rng() % 3), gap = static_cast<std::int64_t>(rng() % 5);
      for (std::int64_t r = 0; r < count; ++r) runs.push_back({t, r * length, length, first + r * (length + gap)});
    }
    cases.emplace_back(runs, chunk);
  }
  for (std::size_t k = 0; k < cases.size(); ++k) {
    SCOPED_TRACE("case " + std::to_string(k) + " (seed " + std::to_string(seed) + ")");
    const auto& [runs, chunk] = cases[k];
    const Plan plan(runs, chunk);
    // Per tensor: a buffer the runs lie in (NaN between them) and its dense twin.
    std::map<std::int64_t, std::int64_t> extent, numel;
    for (const R& r : runs) {
      extent[r.tensor] = std::max(extent[r.tensor], r.place + r.numel);
      numel[r.tensor] = std::max(numel[r.tensor], r.begin + r.numel);
    }
    const std::int64_t tensors = runs.empty() ? 0 : runs.back().tensor + 1;
    std::vector<std::vector<float>> param(static_cast<std::size_t>(tensors)), dense(param.size());
    std::vector<void*> param_ptrs(param.size()), dense_ptrs(param.size());
    for (std::int64_t t = 0; t < tensors; ++t) {
      param[t].assign(static_cast<std::size_t>(extent[t]) + 1, std::numeric_limits<float>::quiet_NaN());
      dense[t].resize(static_cast<std::size_t>(numel[t]) + 1);
      for (std::size_t e = 0; e < dense[t].size(); ++e) dense[t][e] = static_cast<float>(1000 * t + e + 1);
      for (const R& r : runs)
        if (r.tensor == t)
          for (std::int64_t e = 0; e < r.numel; ++e) param[t][r.place + e] = 0.f;
      param_ptrs[t] = param[t].data();
      dense_ptrs[t] = dense[t].data();
    }
    const ampfuse::sdk::cpu::PlanRef ref = ampfuse::sdk::cpu::plan_ref(plan);
    void* const* const lists[2] = {param_ptrs.data(), dense_ptrs.data()};
    static constexpr std::size_t sizes[2] = {4, 4};
    const std::int64_t chunks = plan.num_chunks();
    const std::int64_t split = chunks == 0 ? 0 : static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(chunks + 1));
    for (const auto& [b, e] : {std::make_pair(std::int64_t{0}, split), std::make_pair(split, chunks)})
      ex::for_each_chunk_block<2, 0b11u, 0b01u>(ref, b, e, lists, sizes, [](std::int64_t, void* const (&blk)[2]) {
        using V = ex::Lanes<ampfuse::ScalarType::Float32>;
        const V p = ex::load_block<ampfuse::ScalarType::Float32>(blk[0]);
        ex::store_block<ampfuse::ScalarType::Float32>(p + ex::load_block<ampfuse::ScalarType::Float32>(blk[1]), blk[0]);
      });
    for (const R& r : runs)
      for (std::int64_t e = 0; e < r.numel; ++e)
        ASSERT_EQ(param[r.tensor][r.place + e], dense[r.tensor][r.begin + e])
            << "tensor " << r.tensor << ", element " << r.begin + e << " (place " << r.place + e << ")";
    for (std::int64_t t = 0; t < tensors; ++t) {
      std::int64_t in_runs = 0;
      for (const float v : param[t]) in_runs += !std::isnan(v);
      std::int64_t want = 0;
      for (const R& r : runs) want += r.tensor == t ? r.numel : 0;
      ASSERT_EQ(in_runs, want) << "tensor " << t << ": an element between the runs was written";
    }
  }
}

TEST(Plan, RejectsBadSizes) {
  EXPECT_THROW(Plan(std::vector<std::int64_t>{1}, 0), std::invalid_argument);
  EXPECT_THROW(Plan(std::vector<std::int64_t>{4, -1}, 8), std::invalid_argument);
}

}  // namespace
