// Grads laid out otherwise than their parameters (transposed strides, views
// with gaps, expanded views), which torch::optim takes: every fused optimizer
// reads them through a copy in the parameter's layout, and steps bit for bit
// as it does on contiguous grads of the same values, also across steps that
// reuse the step plan, change a grad's values in place, or switch between
// layouts. CPU (every instruction set) and CUDA.

#include <ampfuse/ampfuse.h>

#include <functional>

#include "tests/common.h"

namespace {

using ampfuse_test::bitwise_equal;

struct LayoutCase {
  std::string device;
  std::string isa;
};

void PrintTo(const LayoutCase& c, std::ostream* os) { *os << c.device << (c.isa.empty() ? "" : "/" + c.isa); }

using GradLayoutTest = ampfuse_test::DeviceIsaTest<LayoutCase>;

// A grad for p holding `values`, laid out as `layout` says: 0 contiguous
// (p's layout), 1 transposed strides, 2 a view with gaps, 3 expanded rows.
torch::Tensor laid_out(const torch::Tensor& values, int layout) {
  const auto rows = values.size(0), cols = values.size(1);
  switch (layout) {
    case 1: return values.t().contiguous().t();
    case 2: {
      auto wide = torch::full({rows, 2 * cols}, 7.0, values.options());
      wide.slice(1, 0, 2 * cols, 2).copy_(values);
      return wide.slice(1, 0, 2 * cols, 2);
    }
    case 3: return values[0].unsqueeze(0).expand({rows, cols});
    default: return values.clone();
  }
}

// The values a grad of layout `layout` holds, made from fresh random ones.
torch::Tensor grad_values(const torch::Tensor& p, int layout) {
  auto g = torch::randn_like(p);
  if (layout == 3) g = g[0].unsqueeze(0).expand_as(p).contiguous();
  return g;
}

using MakeOpt = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>;

std::vector<std::pair<std::string, MakeOpt>> optimizers() {
  return {
      {"FusedAdam", [](std::vector<torch::Tensor> p) {
         return std::make_unique<ampfuse::FusedAdam>(p, torch::optim::AdamOptions(1e-2).amsgrad(true));
       }},
      {"FusedAdamW", [](std::vector<torch::Tensor> p) {
         return std::make_unique<ampfuse::FusedAdamW>(p, torch::optim::AdamWOptions(1e-2));
       }},
      {"FusedSGD", [](std::vector<torch::Tensor> p) {
         return std::make_unique<ampfuse::FusedSGD>(p, torch::optim::SGDOptions(1e-2).momentum(0.9).nesterov(true));
       }},
      {"FusedLAMB", [](std::vector<torch::Tensor> p) {
         return std::make_unique<ampfuse::FusedLAMB>(p, ampfuse::FusedLAMBOptions(1e-2).max_grad_norm(1.0));
       }},
      {"FusedAdagrad", [](std::vector<torch::Tensor> p) {
         return std::make_unique<ampfuse::FusedAdagrad>(p, torch::optim::AdagradOptions(1e-2));
       }},
      {"FusedRMSprop", [](std::vector<torch::Tensor> p) {
         return std::make_unique<ampfuse::FusedRMSprop>(p, torch::optim::RMSpropOptions(1e-2).centered(true));
       }},
  };
}

// Each step gives every parameter a grad in a random layout (sometimes the
// same grad tensor again, its values changed in place), the twin the same
// values contiguous; the parameters stay bitwise equal.
TEST_P(GradLayoutTest, EveryOptimizerStepsAsOnContiguousGrads) {
  for (const auto& [name, make] : optimizers()) {
    SCOPED_TRACE(name);
    for (const auto dtype : {torch::kFloat, torch::kDouble, torch::kBFloat16}) {
      SCOPED_TRACE(ampfuse_test::dtype_name(dtype));
      auto ours = make_params({{33, 17}, {8, 65}, {1, 5}, {4, 4}}, dtype);
      auto twin = copies(ours, dtype);
      auto opt = make(ours);
      auto twin_opt = make(twin);
      std::vector<int> layouts(ours.size(), 0);
      for (int step = 0; step < 12; ++step) {
        for (std::size_t i = 0; i < ours.size(); ++i) {
          const bool same_tensor = step > 0 && rng_() % 3 == 0;
          if (!same_tensor) layouts[i] = static_cast<int>(rng_() % 4);
          const auto values = grad_values(twin[i], layouts[i]);
          twin[i].mutable_grad() = values.clone();
          if (same_tensor && layouts[i] != 3) ours[i].mutable_grad().copy_(laid_out(values, layouts[i]));
          else ours[i].mutable_grad() = laid_out(values, layouts[i]);
        }
        opt->step();
        twin_opt->step();
        for (std::size_t i = 0; i < ours.size(); ++i)
          ASSERT_TRUE(bitwise_equal(ours[i], twin[i])) << "step " << step << ", param " << i << " (grad layout "
                                                       << layouts[i] << ")";
      }
    }
  }
}

// The same through GradScaler's contract path, against torch::optim::Adam
// on the classic path with contiguous grads.
TEST_P(GradLayoutTest, ScaledStepsWithStridedGradsFollowTheClassicPath) {
  auto ours = make_params({{33, 17}, {8, 65}});
  auto ref = copies(ours);
  ampfuse::FusedAdam opt(ours, torch::optim::AdamOptions(1e-2));
  torch::optim::Adam ref_opt(ref, torch::optim::AdamOptions(1e-2));
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(1024.0));
  ampfuse::GradScaler ref_scaler(ampfuse::GradScalerOptions().init_scale(1024.0));
  for (int step = 0; step < 10; ++step) {
    scaler.scale(torch::ones({}));
    ref_scaler.scale(torch::ones({}));
    for (std::size_t i = 0; i < ours.size(); ++i) {
      const auto values = torch::randn_like(ref[i]) * 1024.0;
      ref[i].mutable_grad() = values.clone();
      ours[i].mutable_grad() = laid_out(values, 1 + static_cast<int>(rng_() % 2));
    }
    scaler.step(opt);
    ref_scaler.step(ref_opt);
    scaler.update();
    ref_scaler.update();
  }
  ampfuse_test::expect_close(ours, ref, 1e-5, "after 10 scaled steps");
}

INSTANTIATE_TEST_SUITE_P(All, GradLayoutTest,
                         ::testing::Values(LayoutCase{"cpu", "avx512"}, LayoutCase{"cpu", "avx2"},
                                           LayoutCase{"cpu", "baseline"}, LayoutCase{"cuda", ""}),
                         [](const ::testing::TestParamInfo<LayoutCase>& info) {
                           return info.param.device + (info.param.isa.empty() ? "" : "_" + info.param.isa);
                         });

}  // namespace
