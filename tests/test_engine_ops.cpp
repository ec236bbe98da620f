// check_non_finite and scale_ against ATen (isfinite, mul_,
// _amp_foreach_non_finite_check_and_unscale_), on every compiled CPU
// instruction set and on CUDA (skipped without a device).

#include <ampfuse/fused_adam.h>
#include <ampfuse/grad_scaler.h>
#include <ampfuse/tensor_ops.h>
#include <sys/mman.h>

#include <cmath>
#include <limits>
#include <numeric>
#include <tuple>

#include "contract/cpu/kernels.h"
#include "contract/torch/tensor_ops_views.h"
#include "tests/common.h"

namespace {

using ampfuse_test::bitwise_equal;

struct EngineCase {
  std::string device;  // "cpu" or "cuda"
  torch::Dtype dtype;
  std::string isa;     // CPU instruction set, "" on CUDA
};

void PrintTo(const EngineCase& c, std::ostream* os) {
  *os << c.device << "/" << ampfuse_test::dtype_name(c.dtype) << (c.isa.empty() ? "" : "/" + c.isa);
}

std::string case_name(const ::testing::TestParamInfo<EngineCase>& info) {
  return info.param.device + "_" + ampfuse_test::dtype_name(info.param.dtype) +
         (info.param.isa.empty() ? "" : "_" + info.param.isa);
}

std::vector<EngineCase> engine_cases() {
  std::vector<EngineCase> cases;
  for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16, torch::kDouble}) {
    for (const char* isa : {"avx512", "avx2", "baseline"}) cases.push_back({"cpu", dtype, isa});
    cases.push_back({"cuda", dtype, ""});
  }
  return cases;
}

class EngineOps : public ampfuse_test::DeviceIsaTest<EngineCase> {
 protected:
  torch::TensorOptions opts() const { return torch::TensorOptions().dtype(this->GetParam().dtype).device(device_); }
  torch::Tensor scalar(float v) const {
    return torch::full({1}, v, torch::TensorOptions().dtype(torch::kFloat).device(device_));
  }

  // Sizes: 0, 1, odd, around the CPU vector widths (8, 16) and the chunk
  // size, plus a misaligned view (storage offset 1) and a random one.
  std::vector<torch::Tensor> make_list() {
    const std::int64_t chunk = ampfuse::sdk::cpu::kChunkSize;
    std::vector<std::int64_t> sizes = {0, 1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 0, chunk - 1, chunk, chunk + 1, 100003};
    std::shuffle(sizes.begin(), sizes.end(), rng_);
    sizes.push_back(static_cast<std::int64_t>(rng_() % 5000));
    std::vector<torch::Tensor> list;
    for (std::int64_t n : sizes) list.push_back(torch::randn({n}, opts()));
    list.push_back(torch::randn({4099}, opts()).narrow(0, 1, 4097));  // misaligned, odd
    list.push_back(torch::randn({5, 7, 3}, opts()));                     // n-d
    return list;
  }

  static std::vector<torch::Tensor> clone_all(const std::vector<torch::Tensor>& l) {
    std::vector<torch::Tensor> out;
    for (const auto& t : l) out.push_back(t.clone());
    return out;
  }

  float reference_sum_sq(const std::vector<torch::Tensor>& l) const {
    double s = 0;
    for (const auto& t : l) s += t.to(torch::kDouble).square().sum().item<double>();
    return static_cast<float>(s);
  }

  // at::_amp_foreach_non_finite_check_and_unscale_, the reference. Its CUDA
  // kernel has no bf16 instance (PyTorch 2.11: "not implemented for
  // 'BFloat16'"), so bf16 lists on CUDA go through its CPU kernel, which
  // rounds alike (one fp32 multiply per element, rounded to bf16).
  void aten_unscale_(std::vector<torch::Tensor>& list, torch::Tensor& found, const torch::Tensor& inv) const {
    if (!(device_.is_cuda() && GetParam().dtype == torch::kBFloat16)) {
      at::_amp_foreach_non_finite_check_and_unscale_(list, found, inv);
      return;
    }
    std::vector<torch::Tensor> on_cpu;
    for (const auto& t : list) on_cpu.push_back(t.cpu());
    auto found_cpu = found.cpu();
    at::_amp_foreach_non_finite_check_and_unscale_(on_cpu, found_cpu, inv.cpu());
    for (std::size_t i = 0; i < list.size(); ++i) list[i].copy_(on_cpu[i]);
    found.copy_(found_cpu);
  }
};

TEST_P(EngineOps, FiniteListLeavesFoundInfAndMatchesSumOfSquares) {
  auto list = make_list();
  const auto before = clone_all(list);
  auto found_inf = scalar(0.f);
  auto sum_sq = scalar(0.f);
  ampfuse::check_non_finite(list, found_inf, sum_sq);
  EXPECT_EQ(found_inf.item<float>(), 0.f);
  const float ref = reference_sum_sq(list);
  EXPECT_NEAR(sum_sq.item<float>(), ref, 1e-6 * std::abs(ref));
  for (std::size_t i = 0; i < list.size(); ++i) EXPECT_TRUE(bitwise_equal(list[i], before[i])) << "read-only pass wrote tensor " << i;

  // ATen agrees (its op multiplies by inv_scale, so it runs on copies).
  auto aten_list = clone_all(list);
  auto aten_found = scalar(0.f);
  aten_unscale_(aten_list, aten_found, scalar(1.f));
  EXPECT_EQ(aten_found.item<float>(), 0.f);

  // sum_sq accumulates: a second call adds the same amount.
  ampfuse::check_non_finite(list, found_inf, sum_sq);
  EXPECT_NEAR(sum_sq.item<float>(), 2 * ref, 2e-6 * std::abs(ref));
}

TEST_P(EngineOps, FindsInjectedNonFiniteEverywhere) {
  const float values[] = {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN()};
  enum Where { kFirst, kLast, kRandom, kTail, kLastTensor, kAfterEmpty, kCount };
  const char* where_names[] = {"first", "last", "random", "tail", "last tensor", "after empty tensor"};
  for (int where = 0; where < kCount; ++where) {
    for (float v : values) {
      auto list = make_list();
      // Indices of non-empty tensors, and the element to poison.
      std::vector<std::size_t> non_empty;
      for (std::size_t i = 0; i < list.size(); ++i)
        if (list[i].numel() > 0) non_empty.push_back(i);
      std::size_t t = 0;
      std::int64_t e = 0;
      switch (where) {
        case kFirst: t = non_empty.front(); e = 0; break;
        case kLast: t = non_empty.back(); e = list[t].numel() - 1; break;
        case kRandom:
          t = non_empty[rng_() % non_empty.size()];
          e = static_cast<std::int64_t>(rng_() % list[t].numel());
          break;
        case kTail: {  // the last element of a tensor whose size is not a multiple of 16
          std::vector<std::size_t> odd;
          for (std::size_t i : non_empty)
            if (list[i].numel() % 16 != 0 && list[i].numel() > 16) odd.push_back(i);
          t = odd[rng_() % odd.size()];
          e = list[t].numel() - 1 - static_cast<std::int64_t>(rng_() % (list[t].numel() % 16));
          break;
        }
        case kLastTensor: {
          t = list.size() - 1;
          e = static_cast<std::int64_t>(rng_() % list[t].numel());
          break;
        }
        case kAfterEmpty: {
          list.insert(list.begin() + 3, torch::empty({0}, opts()));
          t = 4;
          if (list[t].numel() == 0) list[t] = torch::randn({5}, opts());
          e = 0;
          break;
        }
      }
      list[t].view(-1)[e] = v;
      SCOPED_TRACE(std::string(where_names[where]) + ", value " + std::to_string(v) + ", tensor " +
                   std::to_string(t) + " element " + std::to_string(e));
      const auto before = clone_all(list);
      auto found_inf = scalar(0.f);
      auto sum_sq = scalar(0.f);
      ampfuse::check_non_finite(list, found_inf, sum_sq);
      EXPECT_NE(found_inf.item<float>(), 0.f);
      EXPECT_FALSE(std::isfinite(sum_sq.item<float>()));
      auto only_flag = scalar(0.f);
      ampfuse::check_non_finite(list, only_flag);
      EXPECT_NE(only_flag.item<float>(), 0.f);
      for (std::size_t i = 0; i < list.size(); ++i) EXPECT_TRUE(bitwise_equal(list[i], before[i]));

      auto aten_list = clone_all(list);
      auto aten_found = scalar(0.f);
      aten_unscale_(aten_list, aten_found, scalar(1.f));
      EXPECT_EQ(found_inf.item<float>(), aten_found.item<float>());
    }
  }
}

TEST_P(EngineOps, FindsNonFiniteAtEveryPosition) {
  // The CPU pass reads each chunk as interleaved streams over equal runs of
  // whole vector blocks, then the blocks left over, then a padded tail: an
  // inf at any element of sizes around those splits (vector widths 8 and 16,
  // four streams), with finite neighbours in the list, sets the flag, and the
  // sum of squares of the finite rest matches.
  // True when check_non_finite flags list with an inf at element e of list[0].
  const auto flags_inf_at = [&](std::vector<torch::Tensor>& list, std::int64_t e) {
    const auto saved = list[0].view(-1)[e].clone();
    list[0].view(-1)[e] = std::numeric_limits<float>::infinity();
    auto found_inf = scalar(0.f);
    ampfuse::check_non_finite(list, found_inf);
    list[0].view(-1)[e] = saved;
    return found_inf.item<float>() != 0.f;
  };
  for (std::int64_t n : {1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 191, 200, 1023, 1025}) {
    auto list = std::vector<torch::Tensor>{torch::randn({n}, opts()), torch::randn({300}, opts())};
    const double rest = reference_sum_sq(list);
    auto sum_sq = scalar(0.f);
    ampfuse::check_non_finite(list, scalar(0.f), sum_sq);
    EXPECT_NEAR(sum_sq.item<float>(), rest, 1e-5 * rest) << "n " << n;
    for (std::int64_t e = 0; e < n; ++e) ASSERT_TRUE(flags_inf_at(list, e)) << "n " << n << ", inf at element " << e;
  }
  // Streams longer than the prefetch distance (256 elements), up to a whole
  // chunk and one past it: an inf at both ends of every stream (for vector
  // widths 8 and 16), at the leftovers and at the tail.
  const std::int64_t chunk = ampfuse::sdk::cpu::kChunkSize;
  for (std::int64_t n : {std::int64_t{4097}, chunk - 1, chunk, chunk + 17}) {
    auto list = std::vector<torch::Tensor>{torch::randn({n}, opts()), torch::randn({300}, opts())};
    std::vector<std::int64_t> places = {n - 1, n - 2};
    for (std::int64_t width : {8, 16})
      for (std::int64_t from = 0; from < n; from += chunk) {
        const std::int64_t size = std::min(chunk, n - from), run = size / (4 * width) * width;
        for (std::int64_t u = 0; u <= 4; ++u)
          for (std::int64_t e : {from + u * run - 1, from + u * run, from + u * run + 1})
            if (e >= 0 && e < n) places.push_back(e);
      }
    for (std::int64_t e : places) ASSERT_TRUE(flags_inf_at(list, e)) << "n " << n << ", inf at element " << e;
  }
}

TEST_P(EngineOps, FoundInfIsNeverCleared) {
  auto list = make_list();
  auto found_inf = scalar(3.f);  // a sum from earlier calls: left as it is
  ampfuse::check_non_finite(list, found_inf);
  EXPECT_EQ(found_inf.item<float>(), 3.f);
}

TEST_P(EngineOps, ScaleMatchesAtenBitwise) {
  std::uniform_real_distribution<float> log_scale(-20.f, 20.f);
  for (float s : {1.f / 65536.f, 1.f, 3.f, std::exp2(log_scale(rng_)), 0.1f}) {
    SCOPED_TRACE("scale " + std::to_string(s));
    auto list = make_list();
    auto mul_ref = clone_all(list);
    auto unscale_ref = clone_all(list);
    ampfuse::scale_(list, scalar(s));
    for (auto& t : mul_ref) t.mul_(scalar(s));
    auto found = scalar(0.f);
    aten_unscale_(unscale_ref, found, scalar(s));
    for (std::size_t i = 0; i < list.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(list[i], mul_ref[i])) << "vs mul_, tensor " << i;
      EXPECT_TRUE(bitwise_equal(list[i], unscale_ref[i])) << "vs ATen unscale, tensor " << i;
    }
  }
}

TEST_P(EngineOps, UnscaleMatchesAtenBitwise) {
  // Values, found_inf and the sum-of-flags semantics of
  // at::_amp_foreach_non_finite_check_and_unscale_, with and without inf/NaN.
  for (int round = 0; round < 4; ++round) {
    auto list = make_list();
    if (round >= 2) {  // poison one element of a random non-empty tensor
      std::size_t t;
      do t = rng_() % list.size(); while (list[t].numel() == 0);
      list[t].view(-1)[static_cast<std::int64_t>(rng_() % list[t].numel())] =
          round == 2 ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
    }
    const float inv = 1.f / std::exp2(static_cast<float>(rng_() % 24));
    auto ref = clone_all(list);
    auto found = scalar(0.f), ref_found = scalar(0.f);
    ampfuse::unscale_(list, found, scalar(inv));
    aten_unscale_(ref, ref_found, scalar(inv));
    SCOPED_TRACE("round " + std::to_string(round));
    EXPECT_EQ(found.item<float>(), ref_found.item<float>());
    EXPECT_EQ(found.item<float>(), round >= 2 ? 1.f : 0.f);
    for (std::size_t i = 0; i < list.size(); ++i) EXPECT_TRUE(bitwise_equal(list[i], ref[i])) << "tensor " << i;
  }
}

// Views with gaps (a column slice, a strided step, a transposed slice) go
// through dense copies, or on CPU, where their runs of adjacent elements are
// long (a slice of wide rows, of a 3-d tensor, a permuted one), are read run
// by run: unscale_ gives ATen's bits, the elements between the view's are not
// touched, and check_non_finite reads the view's elements only.
TEST_P(EngineOps, ViewsWithGapsMatchAten) {
  for (int round = 0; round < 3; ++round) {
    std::vector<torch::Tensor> bases = {torch::randn({37, 9}, opts()),      torch::randn({2001}, opts()),
                                        torch::randn({6, 40}, opts()),      torch::randn({64}, opts()),
                                        torch::randn({30, 400}, opts()),    torch::randn({7, 4, 200}, opts()),
                                        torch::randn({6, 5, 300}, opts()), torch::randn({3, 130}, opts()),
                                        torch::randn({3, 4, 5, 300}, opts())};
    auto views = [](std::vector<torch::Tensor>& b) {
      return std::vector<torch::Tensor>{b[0].slice(1, 0, 5),     b[1].slice(0, 1, 2001, 3),
                                        b[2].t().slice(0, 2, 30), b[3],
                                        b[4].slice(1, 3, 303),    b[5].slice(0, 0, 7, 2),
                                        b[6].permute({1, 0, 2}).slice(2, 0, 260), b[7].slice(1, 1, 129),
                                        b[8].slice(3, 10, 210)};
    };
    if (round == 1) bases[1].view(-1)[4] = std::numeric_limits<float>::infinity();  // inside the view
    if (round == 1) bases[4][29][302] = std::numeric_limits<float>::infinity();     // a run's last element
    if (round == 2) {  // between the view's elements
      bases[0].view(-1)[7] = std::numeric_limits<float>::quiet_NaN();
      bases[4][0][303] = std::numeric_limits<float>::quiet_NaN();
      bases[4][29][2] = std::numeric_limits<float>::quiet_NaN();
      bases[5][1].fill_(std::numeric_limits<float>::quiet_NaN());
      bases[6].select(2, 260).fill_(std::numeric_limits<float>::quiet_NaN());
      bases[7][1][0] = std::numeric_limits<float>::quiet_NaN();
      bases[8].select(3, 5).fill_(std::numeric_limits<float>::quiet_NaN());
    }
    auto ref_bases = clone_all(bases);
    auto list = views(bases), ref = views(ref_bases);
    const float inv = 1.f / std::exp2(static_cast<float>(rng_() % 24));
    auto found = scalar(0.f), ref_found = scalar(0.f);
    ampfuse::unscale_(list, found, scalar(inv));
    aten_unscale_(ref, ref_found, scalar(inv));
    SCOPED_TRACE("round " + std::to_string(round));
    EXPECT_EQ(found.item<float>(), ref_found.item<float>());
    EXPECT_EQ(found.item<float>(), round == 1 ? 1.f : 0.f);
    for (std::size_t i = 0; i < bases.size(); ++i) EXPECT_TRUE(bitwise_equal(bases[i], ref_bases[i])) << "base " << i;
    auto check_found = scalar(0.f);
    auto sum_sq = torch::zeros({1}, torch::TensorOptions().dtype(torch::kDouble).device(device_));
    ampfuse::check_non_finite(views(bases), check_found, sum_sq);
    EXPECT_EQ(check_found.item<float>(), round == 1 ? 1.f : 0.f);
    if (round == 0) EXPECT_NEAR(sum_sq.item<double>(), reference_sum_sq(views(bases)), 1e-5 * reference_sum_sq(views(bases)));
  }
  // Read only: an expanded view (its runs over the same memory) counts each
  // of its elements, as a read of the tensor would.
  const torch::Tensor row = torch::randn({1, 300}, opts());
  const std::vector<torch::Tensor> expanded = {row.expand({5, 300}), row.t().expand({300, 4}).t().slice(1, 0, 290)};
  auto found = scalar(0.f);
  auto sum_sq = torch::zeros({1}, torch::TensorOptions().dtype(torch::kDouble).device(device_));
  ampfuse::check_non_finite(expanded, found, sum_sq);
  EXPECT_EQ(found.item<float>(), 0.f);
  EXPECT_NEAR(sum_sq.item<double>(), reference_sum_sq(expanded), 1e-5 * reference_sum_sq(expanded));
}

// Random strided views (1-4 dimensions, permuted, sliced with steps, some
// expanded) of bases whose other elements are NaN: unscale_ gives ATen's
// bits and leaves the NaN alone, check_non_finite finds nothing and ATen's
// sum of squares, and on CPU copy_by_runs copies as copy_ does both ways
// (into a dense copy, and back). Runs long and short, so that both the
// run-by-run path and the staged one are taken.
TEST_P(EngineOps, RandomStridedViewsMatchAten) {
  const auto nan = std::numeric_limits<float>::quiet_NaN();
  for (int round = 0; round < 100; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    const auto dims = static_cast<std::int64_t>(1 + rng_() % 4);
    std::vector<std::int64_t> sizes;
    for (std::int64_t d = 0; d < dims; ++d)
      sizes.push_back(d + 1 == dims && rng_() % 3 != 0 ? 130 + static_cast<std::int64_t>(rng_() % 300)
                                                        : 1 + static_cast<std::int64_t>(rng_() % 7));
    torch::Tensor base = torch::full(sizes, nan, opts());
    // A permutation, then per dimension a slice [start, stop) with a step.
    torch::Tensor view = base;
    if (dims > 1 && rng_() % 2 == 0) {
      std::vector<std::int64_t> order(static_cast<std::size_t>(dims));
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng_);
      view = view.permute(order);
    }
    for (std::int64_t d = 0; d < dims; ++d) {
      const std::int64_t n = view.size(d);
      const std::int64_t start = rng_() % 3 == 0 ? static_cast<std::int64_t>(rng_() % n) : 0;
      const std::int64_t step = rng_() % 4 == 0 ? 2 : 1;
      const std::int64_t stop = std::max(start + 1, n - (rng_() % 2 == 0 ? static_cast<std::int64_t>(rng_() % 3) : 0));
      view = view.slice(d, start, std::min(stop, n), step);
    }
    view.copy_(torch::randn(view.sizes(), opts()) * 100.0);
    const torch::Tensor expected_base = base.clone();
    auto ref = std::vector<torch::Tensor>{expected_base.as_strided(view.sizes(), view.strides(), view.storage_offset())};
    auto list = std::vector<torch::Tensor>{view};
    const float inv = 1.f / std::exp2(static_cast<float>(rng_() % 12));
    auto found = scalar(0.f), ref_found = scalar(0.f);
    ampfuse::unscale_(list, found, scalar(inv));
    aten_unscale_(ref, ref_found, scalar(inv));
    EXPECT_EQ(found.item<float>(), 0.f);
    EXPECT_EQ(ref_found.item<float>(), 0.f);
    ASSERT_TRUE(bitwise_equal(base, expected_base)) << "view sizes " << view.sizes() << " strides " << view.strides();
    // Read: the view, and the view repeated along a new outer dimension of stride 0.
    std::vector<std::int64_t> expanded_sizes = {3};
    for (const auto n : view.sizes()) expanded_sizes.push_back(n);
    const std::vector<torch::Tensor> reads = {view, view.unsqueeze(0).expand(expanded_sizes)};
    auto check_found = scalar(0.f);
    auto sum_sq = torch::zeros({1}, torch::TensorOptions().dtype(torch::kDouble).device(device_));
    ampfuse::check_non_finite(reads, check_found, sum_sq);
    EXPECT_EQ(check_found.item<float>(), 0.f) << "a NaN between the view's elements was read";
    const double reference = reference_sum_sq(reads);
    EXPECT_NEAR(sum_sq.item<double>(), reference, 1e-6 * reference + 1e-30);
    if (!device_.is_cpu()) continue;
    // copy_by_runs, into a dense copy laid out as empty_like lays it out, and back.
    const torch::Tensor dense = at::empty_like(view, at::MemoryFormat::Preserve);
    if (!ampfuse::detail::copy_by_runs(dense, view)) dense.copy_(view);
    ASSERT_TRUE(bitwise_equal(dense, view));
    const torch::Tensor values = torch::randn(view.sizes(), opts());
    dense.copy_(values);
    const torch::Tensor written = base.clone();
    written.as_strided(view.sizes(), view.strides(), view.storage_offset()).copy_(dense);
    if (!ampfuse::detail::copy_by_runs(view, dense)) view.copy_(dense);
    ASSERT_TRUE(bitwise_equal(base, written)) << "view sizes " << view.sizes() << " strides " << view.strides();
  }
}

// Entries that share memory (one tensor twice, overlapping views, views of
// one buffer with gaps) are updated one after the other, in list order, as
// ATen's foreach ops update them on CPU: the reference applies mul_ entry by
// entry. Together, they raced (x * 3 or x * 9 by the threads' timing), and a
// view with gaps staged twice kept one update.
TEST_P(EngineOps, EntriesSharingMemoryAreUpdatedInListOrder) {
  const std::int64_t chunk = ampfuse::sdk::cpu::kChunkSize;
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    std::vector<torch::Tensor> bases = {torch::randn({3 * chunk + 5}, opts()), torch::randn({40, 9}, opts()),
                                        torch::randn({777}, opts())};
    if (round == 2) bases[1][3][4] = std::numeric_limits<float>::infinity();  // read twice: still found
    auto entries = [chunk](std::vector<torch::Tensor>& b) {
      return std::vector<torch::Tensor>{b[0], b[2], b[0], b[0].slice(0, chunk - 3, 2 * chunk + 1),
                                        b[1].slice(1, 0, 5), b[1].slice(1, 2, 9), b[1].slice(1, 0, 5),
                                        b[0].slice(0, 1, 3 * chunk, 2)};
    };
    auto ref_bases = clone_all(bases);
    auto list = entries(bases), ref = entries(ref_bases);
    const float s = round == 0 ? 3.f : 1.f / 3.f;
    auto found = scalar(0.f);
    float ref_found = 0.f;
    if (round == 0) {
      ampfuse::scale_(list, scalar(s));
    } else {
      ampfuse::unscale_(list, found, scalar(s));
    }
    for (auto& t : ref) {
      if (!torch::isfinite(t).all().item<bool>()) ref_found = 1.f;
      t.mul_(scalar(s));
    }
    if (round > 0) EXPECT_EQ(found.item<float>(), ref_found);
    EXPECT_EQ(ref_found, round == 2 ? 1.f : 0.f);
    for (std::size_t i = 0; i < bases.size(); ++i) EXPECT_TRUE(bitwise_equal(bases[i], ref_bases[i])) << "base " << i;
  }
}

TEST_P(EngineOps, SumOfSquaresInDoubleDoesNotOverflow) {
  // Scaled fp32 gradients can square past fp32's range; an fp64 sum_sq holds them.
  auto list = make_list();
  if (GetParam().dtype == torch::kFloat) list.push_back(torch::full({1000}, 1e30f, opts()));
  auto found = scalar(0.f);
  auto sum_sq = torch::zeros({1}, torch::TensorOptions().dtype(torch::kDouble).device(device_));
  ampfuse::check_non_finite(list, found, sum_sq);
  double ref = 0;
  for (const auto& t : list) ref += t.to(torch::kDouble).square().sum().item<double>();
  EXPECT_EQ(found.item<float>(), 0.f);
  EXPECT_NEAR(sum_sq.item<double>(), ref, 1e-12 * ref);
}

TEST_P(EngineOps, ScaleKeepsNonFiniteAndOverflows) {
  auto t = torch::tensor({1.f, -2.f, 60000.f, 0.f, -0.f, 1e-8f}, torch::kFloat).to(opts());
  t = torch::cat({t, torch::full({3}, std::numeric_limits<float>::infinity(), opts()),
                  torch::full({2}, std::numeric_limits<float>::quiet_NaN(), opts())});
  auto ref = t.clone().mul_(scalar(4.f));
  ampfuse::scale_({t}, scalar(4.f));
  EXPECT_TRUE(bitwise_equal(t, ref));
}

TEST_P(EngineOps, RandomListsVisitEveryElementOnce) {
  // Scaling by 2 visits each element exactly once iff every element doubles.
  for (int round = 0; round < 4; ++round) {
    const std::size_t n = rng_() % (round == 0 ? 2001 : 300);
    std::vector<torch::Tensor> list;
    for (std::size_t i = 0; i < n; ++i) list.push_back(torch::ones({static_cast<std::int64_t>(rng_() % 300)}, opts()));
    ampfuse::scale_(list, scalar(2.f));
    for (std::size_t i = 0; i < n; ++i)
      ASSERT_TRUE(torch::all(list[i] == 2).item<bool>()) << "round " << round << ", tensor " << i;
  }
}

TEST_P(EngineOps, MixedDtypesInOneList) {
  auto list = make_list();
  list.push_back(torch::randn({100}, opts().dtype(torch::kFloat)));
  list.push_back(torch::randn({101}, opts().dtype(torch::kHalf)));
  list.push_back(torch::randn({102}, opts().dtype(torch::kBFloat16)));
  auto ref = clone_all(list);
  ampfuse::scale_(list, scalar(0.25f));
  for (std::size_t i = 0; i < list.size(); ++i) EXPECT_TRUE(bitwise_equal(list[i], ref[i].mul_(0.25)));
  auto found_inf = scalar(0.f);
  auto sum_sq = scalar(0.f);
  ampfuse::check_non_finite(list, found_inf, sum_sq);
  EXPECT_EQ(found_inf.item<float>(), 0.f);
  const float r = reference_sum_sq(list);
  EXPECT_NEAR(sum_sq.item<float>(), r, 1e-6 * r);

  // An fp32 sum_sq over several dtypes is summed in fp64 and rounded once, on
  // every device: 1 + 2^-24 + 2^-24 is 1 + 2^-23, where rounding after each
  // dtype (1 + 2^-24 rounds to 1, twice) would give 1.
  const float tiny = std::ldexp(1.f, -12);  // squares to 2^-24
  const std::vector<torch::Tensor> ties{torch::tensor({1.f, 0.f}, opts().dtype(torch::kFloat)),
                                        torch::tensor({tiny}, opts().dtype(torch::kFloat)).to(torch::kHalf),
                                        torch::tensor({tiny}, opts().dtype(torch::kFloat)).to(torch::kBFloat16)};
  auto once = scalar(0.f);
  ampfuse::check_non_finite(ties, scalar(0.f), once);
  EXPECT_EQ(once.item<float>(), 1.f + std::ldexp(1.f, -23));
}

// A tensor whose last byte is the last one before an unmapped page, or a
// few bytes before it: a tail (the elements after the last whole block) that
// read or wrote one byte past those within its page would fault (AVX2 tails
// are read with masked 32-byte loads, which AMD lets fault on masked-off
// lanes). Two such pages hold a parameter and its grad.
class GuardedPages {
 public:
  GuardedPages() {
    page_ = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    base_ = ::mmap(nullptr, 4 * page_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base_ == MAP_FAILED) base_ = nullptr;
    if (base_ != nullptr &&
        (::mprotect(static_cast<char*>(base_) + page_, page_, PROT_NONE) != 0 ||
         ::mprotect(static_cast<char*>(base_) + 3 * page_, page_, PROT_NONE) != 0)) {
      ::munmap(base_, 4 * page_);
      base_ = nullptr;
    }
  }
  ~GuardedPages() {
    if (base_ != nullptr) ::munmap(base_, 4 * page_);
  }
  GuardedPages(const GuardedPages&) = delete;
  GuardedPages& operator=(const GuardedPages&) = delete;
  bool ok() const { return base_ != nullptr; }
  /// `like`'s values in a tensor ending `gap` bytes before guarded page
  /// `which` (0 or 1).
  torch::Tensor ending_at_guard(const torch::Tensor& like, int which, std::size_t gap = 0) const {
    const std::size_t bytes = static_cast<std::size_t>(like.numel()) * like.element_size();
    char* end = static_cast<char*>(base_) + (2 * which + 1) * page_ - gap;
    auto t = torch::from_blob(end - bytes, like.sizes(), like.options());
    t.copy_(like);
    return t;
  }

 private:
  void* base_ = nullptr;
  std::size_t page_ = 0;
};

TEST_P(EngineOps, TailsEndingAtAnUnmappedPageTouchOnlyTheirBytes) {
  if (device_.is_cuda()) GTEST_SKIP() << "CPU tails only";
  GuardedPages pages;
  ASSERT_TRUE(pages.ok()) << "mmap or mprotect failed";
  // Every tail length of every block width (4, 8 and 16 lanes), alone and after
  // whole blocks, ending at the guard or up to 28 bytes (a masked load's
  // window, less a dword) before it.
  for (std::int64_t n = 1; n <= 40; ++n) {
    for (std::size_t gap = 0; gap < 32; gap += 4) {
      SCOPED_TRACE("numel " + std::to_string(n) + ", " + std::to_string(gap) + " bytes before the guard");
      const auto values = torch::randn({n}, opts());
      auto guarded = pages.ending_at_guard(values, 0, gap);
      auto plain = values.clone();
      auto found = scalar(0.f), plain_found = scalar(0.f);
      ampfuse::unscale_(std::vector<torch::Tensor>{guarded}, found, scalar(0.5f));
      ampfuse::unscale_(std::vector<torch::Tensor>{plain}, plain_found, scalar(0.5f));
      ASSERT_TRUE(bitwise_equal(guarded, plain));
      auto sum_sq = scalar(0.f), plain_sum_sq = scalar(0.f);
      ampfuse::check_non_finite(std::vector<torch::Tensor>{guarded}, found, sum_sq);
      ampfuse::check_non_finite(std::vector<torch::Tensor>{plain}, plain_found, plain_sum_sq);
      ASSERT_EQ(found.item<float>(), 0.f);
      ASSERT_EQ(sum_sq.item<float>(), plain_sum_sq.item<float>());

      // Adam reads the grad and writes the parameter through tails (the
      // moments, which it also moves through tails, are ordinary allocations).
      auto p = guarded.detach().requires_grad_();
      auto q = plain.detach().clone().requires_grad_();
      const auto grad = torch::randn({n}, opts());
      p.mutable_grad() = pages.ending_at_guard(grad, 1, gap);
      q.mutable_grad() = grad.clone();
      ampfuse::FusedAdam ours({p}, torch::optim::AdamOptions(1e-2)), twin({q}, torch::optim::AdamOptions(1e-2));
      for (int step = 0; step < 2; ++step) {
        ours.step();
        twin.step();
      }
      ASSERT_TRUE(bitwise_equal(p.detach(), q.detach()));
      ASSERT_TRUE(bitwise_equal(p.grad(), q.grad()));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, EngineOps, ::testing::ValuesIn(engine_cases()), case_name);

TEST(EngineDeterminism, SumOfSquaresDoesNotDependOnThreads) {
  ampfuse_test::seed_for_test();
  std::vector<torch::Tensor> list;
  for (int i = 0; i < 50; ++i) list.push_back(torch::randn({1 + i * 7919}));
  const int threads = torch::get_num_threads();
  std::vector<float> results;
  for (int n : {1, 2, 3}) {
    torch::set_num_threads(n);
    auto found = torch::zeros({1});
    auto s = torch::zeros({1});
    ampfuse::check_non_finite(list, found, s);
    results.push_back(s.item<float>());
  }
  torch::set_num_threads(threads);
  EXPECT_EQ(results[0], results[1]);
  EXPECT_EQ(results[0], results[2]);
}

// Runs of one-element tensors, which the CPU walk takes slot by slot
// (for_each_chunk_ahead), split between 1, 2 and 3 threads at different
// places: the check finds a non-finite value in every tensor of a run,
// the sum of squares does not depend on the split, and FusedAdam steps every
// tensor as torch::optim::Adam does. Two larger tensors interrupt the runs,
// one of them ending in a chunk of one element (not a one-element tensor).
TEST(EngineOneElementRuns, CheckAndStepSeeEveryTensorOfARun) {
  ampfuse_test::seed_for_test();
  std::vector<std::int64_t> sizes(40, 1);
  sizes[13] = 5000;
  sizes[14] = 65536 + 1;
  std::vector<torch::Tensor> list;
  for (const std::int64_t n : sizes) list.push_back(torch::randn({n}));
  const int threads = torch::get_num_threads();
  std::vector<float> sums;
  for (const int n : {1, 2, 3}) {
    torch::set_num_threads(n);
    SCOPED_TRACE(std::to_string(n) + " threads");
    auto found = torch::zeros({1});
    auto sum_sq = torch::zeros({1});
    ampfuse::check_non_finite(list, found, sum_sq);
    EXPECT_EQ(found.item<float>(), 0.0f);
    sums.push_back(sum_sq.item<float>());
    for (std::size_t i = 0; i < list.size(); ++i) {
      auto last = list[i].view({-1}).narrow(0, list[i].numel() - 1, 1);
      const auto saved = last.clone();
      last.fill_(i % 2 == 0 ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN());
      found.zero_();
      ampfuse::check_non_finite(list, found);
      EXPECT_NE(found.item<float>(), 0.0f) << "the non-finite last element of tensor " << i << " was not found";
      last.copy_(saved);
    }
  }
  EXPECT_EQ(sums[0], sums[1]);
  EXPECT_EQ(sums[0], sums[2]);
  for (const int n : {1, 2, 3}) {
    torch::set_num_threads(n);
    SCOPED_TRACE(std::to_string(n) + " threads");
    std::vector<torch::Tensor> ours, theirs;
    for (const auto& t : list) {
      ours.push_back(t.clone().requires_grad_());
      theirs.push_back(t.clone().requires_grad_());
    }
    ampfuse::FusedAdam fused(ours, torch::optim::AdamOptions(1e-2));
    torch::optim::Adam reference(theirs, torch::optim::AdamOptions(1e-2));
    for (int step = 0; step < 3; ++step) {
      for (std::size_t i = 0; i < ours.size(); ++i) {
        const auto g = torch::randn_like(ours[i]);
        ours[i].mutable_grad() = g;
        theirs[i].mutable_grad() = g.clone();
      }
      fused.step();
      reference.step();
    }
    for (std::size_t i = 0; i < ours.size(); ++i)
      EXPECT_TRUE(torch::allclose(ours[i], theirs[i], 1e-5, 1e-6)) << "tensor " << i << " of " << ours[i].numel();
  }
  torch::set_num_threads(threads);
}

}  // namespace

#if defined(AMPFUSE_WITH_CUDA)
#include "contract/torch/meta_cache.h"

namespace {

// A list too long for kernel arguments has its metadata uploaded once and
// reused while the list is unchanged; a changed list is uploaded again.
TEST(EngineCudaMetadata, UploadedOnceWhileTheListIsUnchanged) {
  if (!ampfuse_test::cuda_available()) GTEST_SKIP() << "no CUDA device here; this test runs on a GPU machine";
  ampfuse_test::seed_for_test();
  std::vector<torch::Tensor> list;
  for (int i = 0; i < 3000; ++i) list.push_back(torch::randn({1 + i % 7}, torch::kCUDA));
  auto found = torch::zeros({1}, torch::kCUDA);
  const auto before = ampfuse::detail::device_meta_uploads();
  for (int call = 0; call < 5; ++call) ampfuse::check_non_finite(list, found);
  EXPECT_EQ(ampfuse::detail::device_meta_uploads() - before, 1);
  list[17] = torch::randn({3}, torch::kCUDA);
  ampfuse::check_non_finite(list, found);
  EXPECT_EQ(ampfuse::detail::device_meta_uploads() - before, 2);
  EXPECT_EQ(found.item<float>(), 0.f);
  list[2999].view(-1)[0] = std::numeric_limits<float>::infinity();
  ampfuse::check_non_finite(list, found);
  EXPECT_EQ(found.item<float>(), 1.f);
}

// A CUDA graph keeps the device pointer of the metadata it captured: that
// entry must outlive the cache's LRU eviction, however many other long lists
// run between replays.
TEST(EngineCudaMetadata, CapturedEntrySurvivesEviction) {
  if (!ampfuse_test::cuda_available()) GTEST_SKIP() << "no CUDA device here; this test runs on a GPU machine";
  ampfuse_test::seed_for_test();
  std::vector<torch::Tensor> list;
  for (int i = 0; i < 3000; ++i) list.push_back(torch::randn({1 + i % 5}, torch::kCUDA));
  auto found = torch::zeros({1}, torch::kCUDA);
  ampfuse::check_non_finite(list, found);  // warm-up: uploads the metadata eagerly
  auto captured = ampfuse_test::capture([&] { ampfuse::check_non_finite(list, found); });
  ASSERT_GE(captured.second, 1u);
  // 40 other long lists (more than the cache holds), each uploaded and evicting.
  for (int other = 0; other < 40; ++other) {
    std::vector<torch::Tensor> l;
    for (int i = 0; i < 2500 + other; ++i) l.push_back(torch::ones({2}, torch::kCUDA));
    auto f = torch::zeros({1}, torch::kCUDA);
    ampfuse::check_non_finite(l, f);
    ASSERT_EQ(f.item<float>(), 0.f);
  }
  found.zero_();
  list[2999].view(-1)[0] = std::numeric_limits<float>::infinity();
  captured.first->replay();
  torch::cuda::synchronize();
  EXPECT_EQ(found.item<float>(), 1.f) << "the replay read metadata that was evicted and reused";
}

}  // namespace
#endif

// A ZeroTensor (at::_efficientzerotensor, no memory) crashed the check and
// unscale_ (a null data pointer); a nested tensor reached an internal error.
// The check reads a ZeroTensor as its zeros; unscale_ refuses it, as ATen
// does; both refuse a nested tensor; an optimizer steps a ZeroTensor grad
// as torch::optim::Adam steps the zeros it stands for.
TEST(EngineOddTensors, ZeroTensorsAreZerosWhereReadAndRefusedWhereWritten) {
  const at::Tensor zero = at::_efficientzerotensor({3});
  auto other = torch::tensor({1.0f, std::numeric_limits<float>::infinity()});
  auto found = torch::zeros({1});
  auto sum_sq = torch::zeros({1}, torch::kDouble);
  ampfuse::check_non_finite({zero}, found, sum_sq);
  EXPECT_EQ(found.item<float>(), 0.0f);
  EXPECT_EQ(sum_sq.item<double>(), 0.0);
  ampfuse::check_non_finite({zero, other}, found);
  EXPECT_EQ(found.item<float>(), 1.0f);
  found.zero_();
  const auto before = other.clone();
  EXPECT_THAT([&] { ampfuse::unscale_({other, zero}, found, torch::ones({1})); },
              ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr("tensors[1] is a ZeroTensor")));
  EXPECT_TRUE(bitwise_equal(other, before));
  EXPECT_EQ(found.item<float>(), 0.0f);

  const auto nested = at::_nested_tensor_from_tensor_list({torch::ones({2}), torch::ones({3})});
  EXPECT_THAT([&] { ampfuse::check_non_finite({nested}, found); },
              ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr("is a nested tensor")));
  EXPECT_THAT([&] { ampfuse::unscale_({nested}, found, torch::ones({1})); },
              ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr("is a nested tensor")));

  auto p = torch::randn({3}).requires_grad_();
  auto q = p.detach().clone().requires_grad_();
  const auto initial = q.detach().clone();
  p.mutable_grad() = at::_efficientzerotensor({3});
  q.mutable_grad() = torch::zeros({3});
  ampfuse::FusedAdam fused({p}, torch::optim::AdamOptions(0.1).weight_decay(0.1));
  torch::optim::Adam reference({q}, torch::optim::AdamOptions(0.1).weight_decay(0.1));
  for (int i = 0; i < 2; ++i) {
    fused.step();
    reference.step();
  }
  EXPECT_TRUE(torch::allclose(p.detach(), q.detach(), 1e-6, 1e-7));
  EXPECT_FALSE(torch::equal(p.detach(), initial));  // (weight decay moves it)
}

// A ZeroTensor arriving where a plan is kept (a step that reuses the plan
// of steps on dense grads, taking new grads by their data pointers) was
// read at its null data pointer: a crash. It is read as its zeros by the
// optimizers and by GradScaler's check, refused by GradScaler's unscale in
// place (as ATen refuses it) with nothing written; a ZeroTensor put in a
// state is replaced by a copy of its zeros.
TEST(EngineOddTensors, ZeroTensorsArrivingUnderAKeptPlanAreZeros) {
  const auto zero_grads = [](std::vector<torch::Tensor>& ps) {
    for (auto& p : ps) p.mutable_grad() = at::_efficientzerotensor(p.sizes(), p.options());
  };
  // FusedAdam against torch::optim::Adam stepping the zeros.
  std::vector<torch::Tensor> ours = {torch::randn({1000}).requires_grad_(), torch::randn({30}).requires_grad_()};
  std::vector<torch::Tensor> ref = {ours[0].detach().clone().requires_grad_(), ours[1].detach().clone().requires_grad_()};
  ampfuse::FusedAdam fused(ours, torch::optim::AdamOptions(0.1).weight_decay(0.1));
  torch::optim::Adam reference(ref, torch::optim::AdamOptions(0.1).weight_decay(0.1));
  for (int step = 0; step < 5; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    if (step < 3) {
      for (std::size_t i = 0; i < ours.size(); ++i) {
        ref[i].mutable_grad() = torch::randn_like(ref[i]);
        ours[i].mutable_grad() = ref[i].grad().clone();
      }
    } else {
      zero_grads(ours);
      for (auto& r : ref) r.mutable_grad() = torch::zeros_like(r);
    }
    if (step == 4) {  // and a ZeroTensor state
      auto& state = static_cast<torch::optim::AdamParamState&>(*fused.state().at(ours[1].unsafeGetTensorImpl()));
      state.exp_avg(at::_efficientzerotensor(ours[1].sizes(), ours[1].options()));
      static_cast<torch::optim::AdamParamState&>(*reference.state().at(ref[1].unsafeGetTensorImpl()))
          .exp_avg()
          .zero_();
    }
    fused.step();
    reference.step();
    for (std::size_t i = 0; i < ours.size(); ++i)
      EXPECT_TRUE(torch::allclose(ours[i].detach(), ref[i].detach(), 1e-5, 1e-6)) << "param " << i;
  }
  // GradScaler: the classic path refuses, the contract path reads zeros.
  for (const bool classic : {true, false}) {
    SCOPED_TRACE(classic ? "torch::optim::SGD" : "FusedAdam");
    std::vector<torch::Tensor> ps = {torch::randn({1000}).requires_grad_(), torch::randn({30}).requires_grad_()};
    std::unique_ptr<torch::optim::Optimizer> opt;
    if (classic) opt = std::make_unique<torch::optim::SGD>(ps, torch::optim::SGDOptions(0.1));
    else opt = std::make_unique<ampfuse::FusedAdam>(ps, torch::optim::AdamOptions(0.1));
    ampfuse::GradScaler scaler;
    for (int step = 0; step < 4; ++step) {
      scaler.scale(torch::ones({}));
      if (step < 3) {
        for (auto& p : ps) p.mutable_grad() = torch::randn_like(p);
      } else {
        ps[0].mutable_grad() = torch::randn_like(ps[0]);
        ps[1].mutable_grad() = at::_efficientzerotensor(ps[1].sizes(), ps[1].options());
      }
      const auto grad0 = ps[0].grad().clone();
      const auto before = ps[0].detach().clone();
      if (step == 3 && classic) {
        EXPECT_THAT([&] { scaler.step(*opt); },
                    ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr("is a ZeroTensor")));
        EXPECT_TRUE(bitwise_equal(ps[0].grad(), grad0));  // not unscaled
        EXPECT_TRUE(bitwise_equal(ps[0].detach(), before));
        break;
      }
      scaler.step(*opt);
      scaler.update();
      EXPECT_FALSE(scaler.last_step_skipped(*opt));
      EXPECT_FALSE(torch::equal(ps[0].detach(), before));
    }
  }
}

// scale_ changes its tensors as mul_ does, and says so as mul_ does: a
// tensor autograd saved, scaled since, is refused at backward (the gradient
// was silently computed from the scaled values: w.grad 30 instead of 3).
TEST(EngineOddTensors, ScaleMovesTheVersionCounterAsMulDoes) {
  auto w = torch::ones({2}).requires_grad_();
  auto x = torch::full({2}, 3.0f);
  auto y = (w * x).sum();
  const auto version = x._version();
  ampfuse::scale_({x}, torch::full({1}, 10.0f));
  EXPECT_GT(x._version(), version);
  EXPECT_THAT([&] { y.backward(); },
              ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr("modified by an inplace operation")));
  {
    c10::InferenceMode guard;
    auto z = torch::ones({2});
    ampfuse::scale_({z}, torch::full({1}, 2.0f));  // an inference tensor: no counter to move
    EXPECT_EQ(z[0].item<float>(), 2.0f);
  }
}
