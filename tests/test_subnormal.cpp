// Subnormals in CPU kernels (ampfuse/sdk/cpu.h, FlushSubnormals): flushed by
// default, which changes only values below 2^-126 (normal values keep
// ATen's bits); kept as IEEE subnormals, bit for bit ATen's, with
// keep_subnormals(true); and the caller's floating-point mode is restored.

#include <ampfuse/fused_adam.h>
#include <ampfuse/fused_sgd.h>
#include <ampfuse/tensor_ops.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <random>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include <ampfuse/sdk/math.h>

#include "contract/cpu/kernels.h"
#include "tests/common.h"

namespace {

using ampfuse_test::bitwise_equal;

constexpr float kSubnormal = 2e-39f;  // below FLT_MIN = 2^-126

// Sets whether subnormals are kept, and restores what was set before (which
// AMPFUSE_KEEP_SUBNORMALS=1 in the environment makes "kept") when a test ends.
struct KeptSubnormals {
  explicit KeptSubnormals(bool keep) : before(ampfuse::sdk::cpu::subnormals_kept()) {
    ampfuse::sdk::cpu::keep_subnormals(keep);
  }
  ~KeptSubnormals() { ampfuse::sdk::cpu::keep_subnormals(before); }
  KeptSubnormals(const KeptSubnormals&) = delete;
  KeptSubnormals& operator=(const KeptSubnormals&) = delete;
  bool before;
};

class Subnormals : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    ampfuse::sdk::cpu::force_isa(GetParam().c_str());
    ampfuse_test::seed_for_test();
  }
  void TearDown() override { ampfuse::sdk::cpu::force_isa(""); }
};

// Subnormal inputs, and normal inputs whose product is subnormal, scaled.
std::vector<torch::Tensor> mixed_list() {
  auto normal = torch::randn({1000});
  auto sub = torch::full({77}, kSubnormal);
  sub[3] = -kSubnormal;
  auto tiny = torch::full({33}, 1e-30f);  // times 1e-10: 1e-40, subnormal
  return {normal, sub, tiny};
}

TEST_P(Subnormals, FlushedByDefaultOnlyBelowTwoToTheMinus126) {
  const KeptSubnormals flush(false);  // the default, also under AMPFUSE_KEEP_SUBNORMALS=1
  auto list = mixed_list();
  auto ref = std::vector<torch::Tensor>{list[0].clone(), list[1].clone(), list[2].clone()};
  const auto factor = torch::full({1}, 1e-10f);
#if defined(__SSE__)
  const unsigned before = _mm_getcsr();
#endif
  ampfuse::scale_(list, factor);
#if defined(__SSE__)
  EXPECT_EQ(_mm_getcsr(), before) << "the caller's floating-point mode was not restored";
#endif
  for (auto& t : ref) t.mul_(factor);
  EXPECT_TRUE(bitwise_equal(list[0], ref[0])) << "normal values must keep ATen's bits";
  EXPECT_TRUE(torch::all(list[1] == 0).item<bool>()) << "subnormal inputs read as zero";
  EXPECT_TRUE(torch::all(list[2] == 0).item<bool>()) << "subnormal results written as zero";
  // What was flushed is below 2^-126 in ATen's result.
  EXPECT_LT(ref[2].abs().max().item<float>(), FLT_MIN);
}

TEST_P(Subnormals, KeptOnRequestAsAtenComputesThem) {
  const KeptSubnormals keep(true);
  auto list = mixed_list();
  auto ref = std::vector<torch::Tensor>{list[0].clone(), list[1].clone(), list[2].clone()};
  const auto factor = torch::full({1}, 1e-10f);
  ampfuse::scale_(list, factor);
  for (auto& t : ref) t.mul_(factor);
  for (std::size_t i = 0; i < list.size(); ++i) EXPECT_TRUE(bitwise_equal(list[i], ref[i])) << "tensor " << i;
  EXPECT_GT(list[2].abs().max().item<float>(), 0.f);
}

// An fp64 list's scale is an fp32 tensor: a scale below 2^-126 (subnormal
// in fp32) is a normal fp64 number, by which ATen multiplies exactly; the
// flush applies to fp64 values below 2^-1022 only (it read as 0: every
// element became 0). Unscale alike, with found_inf left alone.
TEST_P(Subnormals, Fp64ListsTakeASubnormalFp32ScaleAsItsFp64Value) {
  const KeptSubnormals flush(false);
  for (const float s : {std::ldexp(1.0f, -130), std::ldexp(1.0f, -149), -std::ldexp(3.0f, -140)}) {
    SCOPED_TRACE("scale " + std::to_string(std::log2(std::fabs(s))));
    auto list = std::vector<torch::Tensor>{torch::randn({1000}, torch::kDouble) * 1e30, torch::full({3}, 0x1p100)};
    auto ref = std::vector<torch::Tensor>{list[0].clone(), list[1].clone()};
    auto unscaled = std::vector<torch::Tensor>{list[0].clone(), list[1].clone()};
    const auto factor = torch::full({1}, s);
    ampfuse::scale_(list, factor);
    for (auto& t : ref) t.mul_(factor);
    auto found = torch::zeros({1});
    ampfuse::unscale_(unscaled, found, factor);
    EXPECT_EQ(found.item<float>(), 0.f);
    for (std::size_t i = 0; i < list.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(list[i], ref[i])) << "scale_, tensor " << i;
      EXPECT_TRUE(bitwise_equal(unscaled[i], ref[i])) << "unscale_, tensor " << i;
    }
    EXPECT_EQ(list[1][0].item<double>(), 0x1p100 * static_cast<double>(s));
  }
}

// Adam on moments that decayed into the subnormal range: the parameters
// take torch::optim::Adam's values, the moments differ from its only below
// 2^-126.
TEST_P(Subnormals, AdamOnSubnormalMomentsDiffersOnlyBelowFltMin) {
  auto p = torch::rand({4099}).requires_grad_();
  auto r = p.detach().clone().requires_grad_();
  ampfuse::FusedAdam opt({p}, torch::optim::AdamOptions(1e-3));
  torch::optim::Adam ref({r}, torch::optim::AdamOptions(1e-3));
  for (int step = 0; step < 5; ++step) {
    p.mutable_grad() = torch::full_like(p, step == 0 ? 1e-3f : kSubnormal);
    r.mutable_grad() = p.grad().clone();
    opt.step();
    ref.step();
    if (step == 0) {  // moments into the subnormal range
      for (auto* o : std::initializer_list<torch::optim::Optimizer*>{&opt, &ref})
        for (auto& [key, state] : o->state()) {
          auto& s = static_cast<torch::optim::AdamParamState&>(*state);
          s.exp_avg().fill_(kSubnormal);
          s.exp_avg_sq().fill_(kSubnormal);
        }
    }
  }
  EXPECT_LE((p.detach() - r.detach()).abs().max().item<float>(), 1e-6f);
  const auto& s = static_cast<const torch::optim::AdamParamState&>(*opt.state().begin()->second);
  const auto& rs = static_cast<const torch::optim::AdamParamState&>(*ref.state().begin()->second);
  EXPECT_LT((s.exp_avg() - rs.exp_avg()).abs().max().item<float>(), FLT_MIN);
  EXPECT_LT((s.exp_avg_sq() - rs.exp_avg_sq()).abs().max().item<float>(), FLT_MIN);
}

// fp16 NaNs with payloads in the grads (quiet and signaling, either sign):
// every target writes the same bits into parameters and moments. The
// baseline's fp16 store wrote 0x7E00 for any NaN where F16C's (avx2, avx512)
// keeps the payload's top bits.
TEST(SpecialValues, Fp16NaNPayloadsAreWrittenTheSameByEveryTarget) {
  ampfuse_test::seed_for_test();
  const std::vector<std::int16_t> nans = {0x7E01, static_cast<std::int16_t>(0xFE55), 0x7D01, 0x7C01, 0x7FFF};
  auto run = [&](const std::string& isa) {
    ampfuse::sdk::cpu::force_isa(isa.c_str());
    torch::manual_seed(7);
    auto p = torch::randn({37}).to(torch::kHalf).requires_grad_();
    auto grad = torch::randn({37}).to(torch::kHalf);
    auto bits = grad.view(torch::kShort);
    for (std::size_t k = 0; k < nans.size(); ++k) bits[static_cast<std::int64_t>(5 * k + 1)] = nans[k];
    auto q = p.detach().clone().requires_grad_();
    p.mutable_grad() = grad;
    q.mutable_grad() = grad.clone();
    ampfuse::FusedAdam adam({p}, torch::optim::AdamOptions(1e-2));
    ampfuse::FusedSGD sgd({q}, torch::optim::SGDOptions(1e-2).momentum(0.9));
    adam.step();
    sgd.step();
    const auto& st = static_cast<const torch::optim::AdamParamState&>(*adam.state().begin()->second);
    const auto& buf = static_cast<const ampfuse::FusedSGDParamState&>(*sgd.state().begin()->second).momentum_buffer();
    ampfuse::sdk::cpu::force_isa("");
    return std::vector<torch::Tensor>{p.detach().clone(), st.exp_avg().clone(), st.exp_avg_sq().clone(),
                                      q.detach().clone(), buf.clone()};
  };
  const auto want = run("baseline");
  EXPECT_TRUE(torch::isnan(want[0]).any().item<bool>());
  for (const std::string& isa : ampfuse::cpu::available_isas())
    for (std::size_t t = 0; t < want.size(); ++t)
      EXPECT_TRUE(torch::equal(run(isa)[t].view(torch::kShort), want[t].view(torch::kShort)))  // NaN bits too
          << isa << ", tensor " << t;
}

// On AVX-512, a launch whose tensors average fewer than 16 elements takes
// the AVX2 build (the same bits, measured faster), unless a set is named.
TEST(SpecialValues, TinyTensorLaunchesTakeAvx2OnAvx512UnlessASetIsNamed) {
  using ampfuse::sdk::cpu::Isa;
  namespace sc = ampfuse::sdk::cpu;
  sc::force_isa("");
  if (sc::current_isa() != Isa::kAvx512 || sc::isa_named())
    GTEST_SKIP() << "the automatic choice here is " << sc::to_string(sc::current_isa())
                 << (sc::isa_named() ? ", named by AMPFUSE_CPU_ISA" : "") << ", not avx512";
  EXPECT_EQ(sc::isa_for(10000, 10000), Isa::kAvx2);
  EXPECT_EQ(sc::isa_for(15 * 4 + 3, 4), Isa::kAvx2);
  EXPECT_EQ(sc::isa_for(16 * 4, 4), Isa::kAvx512);
  EXPECT_EQ(sc::isa_for(0, 0), Isa::kAvx512);
  EXPECT_EQ(sc::isa_for(ampfuse::Plan(std::vector<std::int64_t>{1, 0, 2}, sc::kChunkSize)), Isa::kAvx2);
  sc::force_isa("avx512");
  EXPECT_TRUE(sc::isa_named());
  EXPECT_EQ(sc::isa_for(1, 1), Isa::kAvx512);
  sc::force_isa("");
  EXPECT_FALSE(sc::isa_named());
}

INSTANTIATE_TEST_SUITE_P(All, Subnormals, ::testing::ValuesIn(ampfuse::cpu::available_isas()),
                         [](const auto& info) { return info.param; });

}  // namespace

namespace {

// f rounded to 24 significant bits, ties to even, with an unbounded exponent
// (what an fp32 factor would be if fp32 had no subnormals), in double.
double round_to_24_bits(double f) {
  if (f == 0.0) return f;
  int e = 0;
  const double m = std::frexp(f, &e);  // [0.5, 1)
  return std::ldexp(std::nearbyint(std::ldexp(m, 24)), e - 24);
}

// sdk::ScalarGradFactor (the CUDA kernels' grad factor, host and device
// code): a factor below 2^-126, an inverse scale of 2^127 times a clip
// coefficient, keeps 24 significant bits as a normal one does, so g times it
// is g times f rounded to 24 bits, rounded once; fl32(f), subnormal, keeps
// fewer (13 at 2^-137) and misses that by up to 2^-14 of the product.
TEST(ScalarGradFactor, KeepsTwentyFourBitsBelowTwoToTheMinus126) {
  const auto seed = ampfuse_test::seed_for_test();
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> unit(0.5, 1.0);
  // Down to 2^-190 (ScalarGradFactor's range: a scale of 2^127 times a clip coefficient of 2^-63).
  std::uniform_int_distribution<int> exponent(-189, 20);
  int split = 0, fp32_off = 0;
  for (int k = 0; k < 20000; ++k) {
    const double f = std::ldexp(unit(rng), exponent(rng)) * (k % 7 == 0 ? -1.0 : 1.0);
    const double q = round_to_24_bits(f);
    const ampfuse::sdk::ScalarGradFactor<float> factor(f);
    EXPECT_EQ(ampfuse::sdk::grad_factor_is_split(f), std::fabs(f) < 0x1p-126) << "f " << f;
    split += ampfuse::sdk::grad_factor_is_split(f) ? 1 : 0;
    // g such that g * f is normal and finite in fp32.
    const int ge = std::max(-100, -126 - std::ilogb(f) + 2);
    const float g = static_cast<float>(std::ldexp(unit(rng), std::min(ge, 100)));
    const double exact = static_cast<double>(g) * q;  // exact in double (24 x 24 bits)
    if (!(std::fabs(exact) >= 0x1p-126 && std::fabs(exact) < 0x1p127)) continue;
    const float expected = static_cast<float>(exact);
    const float got = factor(g);
    ASSERT_EQ(got, expected) << "f " << f << ", g " << g << ", seed " << seed;
    if (static_cast<float>(g * static_cast<float>(f)) != expected) ++fp32_off;
    // fp64: the factor as it is.
    EXPECT_EQ(ampfuse::sdk::ScalarGradFactor<double>(f)(static_cast<double>(g)), static_cast<double>(g) * f);
  }
  EXPECT_GT(split, 1000);
  EXPECT_GT(fp32_off, 100) << "the case this guards is not exercised: fl32(f) would have passed";
  // The edges: 0 and 1 stay one factor; 2^-127 alone gives g * 2^-127's bits; NaN passes through.
  EXPECT_FALSE(ampfuse::sdk::grad_factor_is_split(0.0));
  EXPECT_FALSE(ampfuse::sdk::grad_factor_is_split(std::nan("")));
  EXPECT_EQ(ampfuse::sdk::ScalarGradFactor<float>(1.0)(3.5f), 3.5f);
  EXPECT_EQ(ampfuse::sdk::ScalarGradFactor<float>(0x1p-127)(0x1p127f), 1.0f);
  EXPECT_TRUE(std::isnan(ampfuse::sdk::ScalarGradFactor<float>(std::nan(""))(1.0f)));
}

}  // namespace
