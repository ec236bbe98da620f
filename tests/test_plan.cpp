// The planner: every element of every tensor in exactly one chunk, empty
// tensors left out, 64-bit sizes.

#include <ampfuse/multi_tensor.h>

#include <algorithm>

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

TEST(Plan, RejectsBadSizes) {
  EXPECT_THROW(Plan(std::vector<std::int64_t>{1}, 0), std::invalid_argument);
  EXPECT_THROW(Plan(std::vector<std::int64_t>{4, -1}, 8), std::invalid_argument);
}

}  // namespace
