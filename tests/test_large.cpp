// Sizes past 2^31 (the 32-bit-size bugs that apex, DeepSpeed, TransformerEngine
// and PyTorch shipped in these kernels): the check pass (check_non_finite with
// the sum of squares, then unscale_) and one FusedAdam step over ONE tensor of
// 2^31 + 17 elements. On CPU in bf16 (param, grad and two moments: 16 GiB), on
// CUDA in fp32 (32 GiB).
//
// Each tensor repeats a random block of prime length, so that any element's
// input is known without a second copy, and an element read or written at the
// wrong offset (i - 2^31, i mod 2^32) takes another element's value. Checked:
// the sum of squares exactly (the grads are small integers times 16, whose
// squares add exactly in fp64), found_inf for a NaN at element 2^31 and an
// inf at the last one, the unscaled grads through their exact sum, and the
// step bit for bit against the same step on small tensors (a window at the
// start, one from before 2^31 to the last element, and sampled elements),
// which is also compared with torch::optim::Adam in fp32.
//
// Run only when AMPFUSE_LARGE_TESTS=1: ctest's test "large_tensor" (label
// "large", run alone) sets it, as does scripts/gpu-check.sh. Skipped when the
// machine has too little memory, and under AddressSanitizer (its shadow
// memory).

#include <ampfuse/fused_adam.h>
#include <ampfuse/tensor_ops.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <string>

#include "tests/common.h"

#if defined(__SANITIZE_ADDRESS__)
#define AMPFUSE_TEST_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define AMPFUSE_TEST_UNDER_ASAN 1
#endif
#endif

namespace {

using ampfuse_test::bitwise_equal;

constexpr std::int64_t kTwo31 = std::int64_t{1} << 31;
constexpr std::int64_t kNumel = kTwo31 + 17;
constexpr std::int64_t kParamPeriod = 1000003;  // primes: no period divides 2^31 or 2^32
constexpr std::int64_t kGradPeriod = 999983;
constexpr float kScale = 16;  // the grads are k * kScale, k in [-3, 3]
constexpr std::int64_t kHeadroom = std::int64_t{1} << 30;  // the process, the blocks, the sampled copies

// Bytes free for a new allocation on `device`: MemAvailable on CPU.
std::int64_t free_bytes(const torch::Device& device) {
#if defined(AMPFUSE_WITH_CUDA)
  if (device.is_cuda()) {
    std::size_t free = 0, total = 0;
    if (cudaMemGetInfo(&free, &total) != cudaSuccess) return 0;
    return static_cast<std::int64_t>(free);
  }
#endif
  (void)device;
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  std::int64_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return 0;
}

// big[i] = block[i % block.numel()], in copies of the block's size.
void fill_periodic(torch::Tensor& big, const torch::Tensor& block) {
  const std::int64_t period = block.numel();
  for (std::int64_t off = 0; off < big.numel(); off += period) {
    const std::int64_t n = std::min(period, big.numel() - off);
    big.narrow(0, off, n).copy_(block.narrow(0, 0, n));
  }
}

// What fill_periodic put at `positions` (int64, on block's device).
torch::Tensor periodic_at(const torch::Tensor& block, const torch::Tensor& positions) {
  return block.index_select(0, positions.remainder(block.numel()));
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

class LargeTensor : public ampfuse_test::DeviceTest {
 protected:
  void SetUp() override {
    ampfuse_test::DeviceTest::SetUp();
    if (IsSkipped()) return;
#if defined(AMPFUSE_TEST_UNDER_ASAN)
    GTEST_SKIP() << "not under AddressSanitizer: 16 GiB of tensors and their shadow do not fit";
#endif
    const char* env = std::getenv("AMPFUSE_LARGE_TESTS");
    if (env == nullptr || std::string(env) != "1")
      GTEST_SKIP() << "set AMPFUSE_LARGE_TESTS=1 to run it (ctest's test large_tensor, label \"large\", does)";
    dtype_ = device_.is_cuda() ? torch::kFloat : torch::kBFloat16;
    const std::int64_t need = 4 * kNumel * static_cast<std::int64_t>(c10::elementSize(dtype_)) + kHeadroom;
    const std::int64_t have = free_bytes(device_);
    if (have < need)
      GTEST_SKIP() << "needs " << (need >> 20) << " MiB free on " << device_ << " (4 tensors of 2^31 + 17 "
                   << dtype_ << " and 1 GiB spare), has " << (have >> 20) << " MiB";
    std::cout << "[ large    ] " << device_ << ", " << dtype_ << ", " << (have >> 20) << " MiB free, needs "
              << (need >> 20) << " MiB\n";
  }

  torch::TensorOptions opts() const { return torch::TensorOptions().device(device_).dtype(dtype_); }

  torch::Tensor positions(std::int64_t begin, std::int64_t n) const {
    return torch::arange(begin, begin + n, torch::TensorOptions().device(device_).dtype(torch::kLong));
  }

  torch::Dtype dtype_ = torch::kBFloat16;
};

TEST_P(LargeTensor, CheckPassAndAdamStepPastTwoToThe31) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto param_block = torch::randn({kParamPeriod}, torch::TensorOptions().device(device_)).to(dtype_);
  const auto grad_block =
      (torch::randint(-3, 4, {kGradPeriod}, torch::TensorOptions().device(device_)) * kScale).to(dtype_);
  auto grad = torch::empty({kNumel}, opts());
  fill_periodic(grad, grad_block);

  // The sum of squares, exact: integers below 2^53 (k^2 * 256 per element).
  const auto block_sq = grad_block.to(torch::kDouble).square();
  const std::int64_t whole = kNumel / kGradPeriod, rest = kNumel % kGradPeriod;
  const double want_sum_sq =
      static_cast<double>(whole) * block_sq.sum().item<double>() + block_sq.narrow(0, 0, rest).sum().item<double>();
  const auto fp32 = torch::TensorOptions().device(device_).dtype(torch::kFloat);
  auto found_inf = torch::zeros({1}, fp32);
  auto sum_sq = torch::zeros({1}, fp32.dtype(torch::kDouble));
  auto t1 = std::chrono::steady_clock::now();
  ampfuse::check_non_finite({grad}, found_inf, sum_sq);
  std::cout << "[ large    ] check_non_finite with sum_sq: " << seconds_since(t1) << " s\n";
  EXPECT_EQ(found_inf.item<float>(), 0.0f);
  EXPECT_EQ(sum_sq.item<double>(), want_sum_sq);

  // One non-finite element at 2^31 (the first offset past int32), then at the last one.
  for (const std::int64_t at : {kTwo31, kNumel - 1}) {
    auto element = grad.narrow(0, at, 1);
    const auto saved = element.clone();
    element.fill_(at == kTwo31 ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity());
    auto found = torch::zeros({1}, fp32);
    ampfuse::check_non_finite({grad}, found);
    EXPECT_EQ(found.item<float>(), 1.0f) << "non-finite element " << at << " not seen";
    element.copy_(saved);
  }

  // unscale_: every element becomes k, so the sum of squares is exact again.
  t1 = std::chrono::steady_clock::now();
  ampfuse::unscale_({grad}, found_inf, torch::full({1}, 1 / kScale, fp32));
  std::cout << "[ large    ] unscale_: " << seconds_since(t1) << " s\n";
  EXPECT_EQ(found_inf.item<float>(), 0.0f);
  sum_sq.zero_();
  ampfuse::check_non_finite({grad}, found_inf, sum_sq);
  EXPECT_EQ(sum_sq.item<double>(), want_sum_sq / (kScale * kScale)) << "some elements not unscaled";
  const auto unscaled_block = grad_block / kScale;
  const auto last = positions(kNumel - 4099, 4099);
  EXPECT_TRUE(bitwise_equal(grad.narrow(0, kNumel - 4099, 4099), periodic_at(unscaled_block, last)));

  // One Adam step (L2 weight decay; lr large enough to show in bf16).
  auto param = torch::empty({kNumel}, opts());
  fill_periodic(param, param_block);
  param.requires_grad_();
  param.mutable_grad() = grad;
  const auto options = torch::optim::AdamOptions(0.1).weight_decay(0.01);
  ampfuse::FusedAdam opt({param}, options);
  t1 = std::chrono::steady_clock::now();
  opt.step();
  std::cout << "[ large    ] FusedAdam step (state allocated in it): " << seconds_since(t1) << " s\n";
  const auto& state =
      static_cast<const torch::optim::AdamParamState&>(*opt.state().at(param.unsafeGetTensorImpl()));

  // The same step on small tensors holding the inputs of chosen elements: a window at the start, one from a
  // misaligned element before 2^31 to the last, and sampled elements. Elementwise math, so bit for bit.
  const auto longs = torch::TensorOptions().device(device_).dtype(torch::kLong);
  const std::int64_t before = kTwo31 - 4097;
  const std::vector<torch::Tensor> picks = {positions(0, 4099), positions(before, kNumel - before),
                                            torch::randint(0, kNumel, {4096}, longs)};
  for (const auto& at : picks) {
    auto p = periodic_at(param_block, at).requires_grad_();
    p.mutable_grad() = periodic_at(unscaled_block, at);
    ampfuse::FusedAdam small({p}, options);
    small.step();
    const auto& small_state =
        static_cast<const torch::optim::AdamParamState&>(*small.state().at(p.unsafeGetTensorImpl()));
    const std::string where = "elements from " + std::to_string(at[0].item<std::int64_t>());
    EXPECT_TRUE(bitwise_equal(param.detach().index_select(0, at), p.detach())) << "param, " << where;
    EXPECT_TRUE(bitwise_equal(state.exp_avg().index_select(0, at), small_state.exp_avg())) << "exp_avg, " << where;
    EXPECT_TRUE(bitwise_equal(state.exp_avg_sq().index_select(0, at), small_state.exp_avg_sq()))
        << "exp_avg_sq, " << where;

    // And LibTorch's Adam in fp32 on the same inputs, within the storage's rounding.
    auto ref = periodic_at(param_block, at).to(torch::kFloat).requires_grad_();
    ref.mutable_grad() = periodic_at(unscaled_block, at).to(torch::kFloat);
    torch::optim::Adam ref_opt({ref}, options);
    ref_opt.step();
    ampfuse_test::expect_close({p}, {ref}, dtype_ == torch::kFloat ? 1e-6 : 1.0 / 128,
                               "against torch::optim::Adam, " + where);
  }
  std::cout << "[ large    ] total " << seconds_since(t0) << " s\n";
}

INSTANTIATE_TEST_SUITE_P(All, LargeTensor, ::testing::Values("cpu", "cuda"),
                         [](const auto& info) { return info.param; });

}  // namespace
