// Grads laid out otherwise than their parameters (transposed strides, views
// with gaps, expanded views), which torch::optim takes: every fused optimizer
// reads them through a copy in the parameter's layout, and steps bit for bit
// as it does on contiguous grads of the same values, also across steps that
// reuse the step plan, change a grad's values in place, or switch between
// layouts. CPU (every instruction set) and CUDA.

#include <ampfuse/ampfuse.h>

#include <array>
#include <functional>
#include <limits>
#include <regex>
#include <set>

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
// (p's layout), 1 transposed strides, 2 a view with gaps, 3 expanded rows,
// 4 the leading columns of a wider tensor (long rows with gaps: copied row
// by row where the rows are long).
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
    case 4: {
      auto wide = torch::full({rows, cols + 5}, 7.0, values.options());
      return wide.slice(1, 0, cols).copy_(values);
    }
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

// f(typed) of the one of optimizers() that opt is, as a long (-1: not one of them).
template <class F>
long of_fused(const torch::optim::Optimizer& opt, F&& f) {
  auto as = [&](auto* typed) { return typed ? static_cast<long>(f(*typed)) : -1L; };
  for (const long m : {as(dynamic_cast<const ampfuse::FusedAdam*>(&opt)), as(dynamic_cast<const ampfuse::FusedAdamW*>(&opt)),
                       as(dynamic_cast<const ampfuse::FusedSGD*>(&opt)), as(dynamic_cast<const ampfuse::FusedLAMB*>(&opt)),
                       as(dynamic_cast<const ampfuse::FusedAdagrad*>(&opt)),
                       as(dynamic_cast<const ampfuse::FusedRMSprop*>(&opt))})
    if (m >= 0) return m;
  return -1;
}

// How the last step of one of optimizers() found its plan (-1: not one of them).
int plan_match(const torch::optim::Optimizer& opt) {
  return static_cast<int>(of_fused(opt, [](const auto& o) { return static_cast<int>(o.last_plan_match()); }));
}

// How many parameters one of optimizers()' plan steps through dense copies (-1: not one of them).
long staged_of(const torch::optim::Optimizer& opt) {
  return of_fused(opt, [](const auto& o) { return o.staged_params(); });
}

// Each step gives every parameter a grad in a random layout (sometimes the
// same grad tensor again, its values changed in place), the twin the same
// values contiguous; the parameters stay bitwise equal.
TEST_P(GradLayoutTest, EveryOptimizerStepsAsOnContiguousGrads) {
  for (const auto& [name, make] : optimizers()) {
    SCOPED_TRACE(name);
    for (const auto dtype : {torch::kFloat, torch::kDouble, torch::kBFloat16}) {
      SCOPED_TRACE(ampfuse_test::dtype_name(dtype));
      auto ours = make_params({{33, 17}, {8, 65}, {1, 5}, {4, 4}, {5, 260}}, dtype);
      auto twin = copies(ours, dtype);
      auto opt = make(ours);
      auto twin_opt = make(twin);
      std::vector<int> layouts(ours.size(), 0);
      for (int step = 0; step < 12; ++step) {
        for (std::size_t i = 0; i < ours.size(); ++i) {
          const bool same_tensor = step > 0 && rng_() % 3 == 0;
          if (!same_tensor) layouts[i] = static_cast<int>(rng_() % 5);
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

// A parameter that is a view with gaps of a wider tensor `base`: 0 every
// other column, 1 the leading columns, 2 a transposed view of every other
// row (a permuted stride order). Its values are those of `values`; base's
// other elements are 7.
torch::Tensor view_of(const torch::Tensor& base, int kind, std::int64_t cols) {
  switch (kind) {
    case 0: return base.slice(1, 0, 2 * cols, 2);
    case 1: return base.slice(1, 0, cols);
    default: return base.slice(0, 0, 2 * cols, 2).t();
  }
}

torch::Tensor view_with_gaps(const torch::Tensor& values, int kind, torch::Tensor& base) {
  const auto rows = values.size(0), cols = values.size(1);
  torch::NoGradGuard no_grad;
  const std::vector<std::int64_t> shape =
      kind == 0 ? std::vector<std::int64_t>{rows, 2 * cols}
                : kind == 1 ? std::vector<std::int64_t>{rows, cols + 3} : std::vector<std::int64_t>{2 * cols, rows};
  base = torch::full(shape, 7.0, values.options());
  return view_of(base, kind, cols).copy_(values);
}

// Whether every element of `base` outside its view (the gaps) still holds 7.
bool gaps_untouched(const torch::Tensor& base, int kind, std::int64_t cols) {
  torch::NoGradGuard no_grad;
  auto probe = base.detach().clone();
  view_of(probe, kind, cols).fill_(7);
  return (probe == 7).all().item<bool>();
}

// Parameters that are views with gaps (which torch::optim updates in place)
// step through dense copies: bit for bit as dense parameters of the same
// values, leaving the gaps untouched, across steps that reuse the plan and
// grads of any layout. Master copies of bf16 views follow the views' own
// versions: not refreshed by the write-back (the twin would differ), but by
// a write from outside.
TEST_P(GradLayoutTest, ParametersWithGapsStepAsDenseParameters) {
  for (const auto& [name, make] : optimizers()) {
    SCOPED_TRACE(name);
    for (const auto dtype : {torch::kFloat, torch::kDouble, torch::kBFloat16}) {
      SCOPED_TRACE(ampfuse_test::dtype_name(dtype));
      // Params 4 and 5: long runs (300 elements), copied in and back run by
      // run. Param 5's dense copy is laid out as its view (column-major):
      // its twin too, for LAMB's norms summed in memory order.
      auto twin = make_params({{33, 17}, {8, 65}, {1, 5}, {4, 4}, {6, 300}, {300, 6}}, dtype);
      twin[5] = twin[5].detach().t().contiguous().t().requires_grad_();
      std::vector<torch::Tensor> bases(twin.size()), ours;
      for (std::size_t i = 0; i < twin.size(); ++i) {
        ours.push_back(view_with_gaps(twin[i].detach(), static_cast<int>(i % 3), bases[i]).requires_grad_());
        ASSERT_FALSE(ours[i].is_non_overlapping_and_dense());
      }
      auto opt = make(ours);
      auto twin_opt = make(twin);
      for (int step = 0; step < 8; ++step) {
        if (step == 5) {  // a write from outside into a view, under a reused plan
          torch::NoGradGuard no_grad;
          ours[1].mul_(0.5);
          twin[1].mul_(0.5);
        }
        for (std::size_t i = 0; i < ours.size(); ++i) {
          const auto values = torch::randn_like(twin[i]);
          twin[i].mutable_grad() = values.clone();
          if (step % 3 == 2) ours[i].mutable_grad().copy_(values);  // same grads: the plan is reused
          else ours[i].mutable_grad() = laid_out(values, std::array<int, 4>{0, 1, 2, 4}[rng_() % 4]);
        }
        opt->step();
        twin_opt->step();
        if (step % 3 == 2)
          ASSERT_EQ(plan_match(*opt), static_cast<int>(ampfuse::sdk::PlanMatch::kSame)) << "step " << step;
        for (std::size_t i = 0; i < ours.size(); ++i) {
          ASSERT_TRUE(bitwise_equal(ours[i].detach(), twin[i].detach())) << "step " << step << ", param " << i;
          ASSERT_TRUE(gaps_untouched(bases[i], static_cast<int>(i % 3), twin[i].size(1)))
              << "a step wrote into the gaps of param " << i;
        }
      }
    }
  }
}

// Views with gaps between long runs (at least 128 adjacent elements) are
// stepped where they lie, run by run, by the optimizers whose kernels walk
// runs (all but LAMB: no dense copy), and through copies by LAMB: bit for bit as dense twins laid out as the views'
// states are, the gaps (NaN) never written, one step counted per parameter,
// across steps that reuse the plan or take new grads. The views: runs longer
// than a chunk (65,537 elements: a last chunk of one element, whose place in
// memory is not its dense index; 70,000), the shortest runs taken (128) in
// three dimensions, a transposed slice (runs down its columns), beside a
// dense parameter, a one-element one and a view of short runs (staged).
TEST_P(GradLayoutTest, ViewsWithLongRunsAreSteppedWhereTheyLie) {
  if (!device_.is_cpu()) GTEST_SKIP() << "runs are walked in place by the CPU kernels (CUDA stages views with gaps)";
  auto extra = optimizers();
  extra.push_back({"FusedSGD (plain)", [](std::vector<torch::Tensor> p) {
                     return std::make_unique<ampfuse::FusedSGD>(p, torch::optim::SGDOptions(1e-2).weight_decay(0.1));
                   }});
  extra.push_back({"FusedAdam (master_weights)", [](std::vector<torch::Tensor> p) {
                     return std::make_unique<ampfuse::FusedAdam>(p, torch::optim::AdamOptions(1e-2),
                                                                 ampfuse::FusedAdamOptions().master_weights(true));
                   }});
  extra.push_back({"FusedRMSprop (momentum)", [](std::vector<torch::Tensor> p) {
                     return std::make_unique<ampfuse::FusedRMSprop>(
                         p, torch::optim::RMSpropOptions(1e-2).momentum(0.9).weight_decay(0.1));
                   }});
  const auto steps_of = [](torch::optim::Optimizer& opt, const torch::Tensor& p) -> std::int64_t {
    const auto it = opt.state().find(p.unsafeGetTensorImpl());
    if (it == opt.state().end()) return -1;
    if (auto* s = dynamic_cast<ampfuse::FusedRMSpropParamState*>(it->second.get())) return s->step();
    if (auto* s = dynamic_cast<ampfuse::FusedAdagradParamState*>(it->second.get())) return s->step();
    return -2;  // counted elsewhere (or not at all)
  };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (const auto& [name, make] : extra) {
    SCOPED_TRACE(name);
    const bool in_place = name.find("LAMB") == std::string::npos;  // LAMB's norms are summed per tensor
    for (const auto dtype : {torch::kFloat, torch::kDouble, torch::kBFloat16}) {
      if (name.find("master") != std::string::npos && dtype != torch::kBFloat16) continue;  // (fp16/bf16 only)
      SCOPED_TRACE(ampfuse_test::dtype_name(dtype));
      const auto opts = torch::TensorOptions().device(device_).dtype(dtype);
      std::vector<torch::Tensor> bases = {
          torch::full({3, 65540}, nan, opts), torch::full({2, 70003}, nan, opts), torch::full({4, 5, 150}, nan, opts),
          torch::full({10, 300}, nan, opts),  torch::randn({7, 9}, opts),         torch::randn({1}, opts),
          torch::full({6, 40}, nan, opts)};
      std::vector<torch::Tensor> ours = {
          bases[0].slice(1, 0, 65537), bases[1].slice(1, 0, 70000),    bases[2].slice(2, 0, 128),
          bases[3].slice(0, 0, 8).slice(1, 0, 260).t(), bases[4],        bases[5],
          bases[6].slice(1, 0, 30)};  // runs of 30: staged
      std::vector<torch::Tensor> twin;
      for (auto& v : ours) {
        {
          torch::NoGradGuard no_grad;
          v.copy_(torch::randn(v.sizes(), opts));
        }
        twin.push_back(at::empty_like(v).copy_(v).requires_grad_());  // dense, laid out as the view's state
        v.requires_grad_();
      }
      const std::vector<bool> gapped = {true, true, true, true, false, false, true};
      auto opt = make(ours);
      auto twin_opt = make(twin);
      for (int step = 0; step < 4; ++step) {
        for (std::size_t i = 0; i < ours.size(); ++i) {
          const auto values = torch::randn_like(twin[i]);
          twin[i].mutable_grad() = values.clone();
          if (step == 2) ours[i].mutable_grad().copy_(values);  // same grads: the plan is reused
          else ours[i].mutable_grad() = at::empty_like(twin[i]).copy_(values);
        }
        opt->step();
        twin_opt->step();
        if (step == 2) ASSERT_EQ(plan_match(*opt), static_cast<int>(ampfuse::sdk::PlanMatch::kSame));
        // In place: only the view of short runs is copied; otherwise all five views with gaps.
        ASSERT_EQ(staged_of(*opt), in_place ? 1 : 5) << "step " << step;
        for (std::size_t i = 0; i < ours.size(); ++i) {
          ASSERT_TRUE(bitwise_equal(ours[i].detach(), twin[i].detach())) << "step " << step << ", param " << i;
          ASSERT_EQ(steps_of(*opt, ours[i]), steps_of(*twin_opt, twin[i])) << "step " << step << ", param " << i;
          if (!gapped[i]) continue;
          torch::NoGradGuard no_grad;
          auto probe = bases[i].clone();
          const auto view = i == 0   ? probe.slice(1, 0, 65537)
                            : i == 1 ? probe.slice(1, 0, 70000)
                            : i == 2 ? probe.slice(2, 0, 128)
                            : i == 3 ? probe.slice(0, 0, 8).slice(1, 0, 260)
                                     : probe.slice(1, 0, 30);
          view.fill_(nan);
          ASSERT_TRUE(probe.isnan().all().item<bool>()) << "a step wrote into the gaps of param " << i;
        }
      }
    }
  }
}

TEST_P(GradLayoutTest, MasterCopiesOfViewsWithGapsFollowTheirParameters) {
  const auto twin = make_params({{33, 17}, {8, 65}, {3}}, torch::kBFloat16);
  std::vector<torch::Tensor> bases(2), ours;
  for (std::size_t i = 0; i < 2; ++i)
    ours.push_back(view_with_gaps(twin[i].detach(), static_cast<int>(i), bases[i]).requires_grad_());
  {
    // A dense parameter of the same base as a view with gaps (row 0 past the
    // view's 65 columns): views share their version counter with their base,
    // and the view's write-back must not make this one's master stale.
    torch::NoGradGuard no_grad;
    ours.push_back(bases[1][0].slice(0, 65, 68).copy_(twin[2].detach()).requires_grad_());
  }
  ASSERT_TRUE(ours[2].is_non_overlapping_and_dense());
  const auto options = ampfuse::FusedAdamOptions().master_weights(true);
  ampfuse::FusedAdamW opt(ours, torch::optim::AdamWOptions(1e-3), options);
  ampfuse::FusedAdamW twin_opt(twin, torch::optim::AdamWOptions(1e-3), options);
  for (int step = 0; step < 6; ++step) {
    if (step == 4) {  // a write from outside, into both
      torch::NoGradGuard no_grad;
      ours[0].fill_(0.5);
      twin[0].fill_(0.5);
    }
    for (std::size_t i = 0; i < ours.size(); ++i) {
      const auto values = torch::randn_like(twin[i]);
      twin[i].mutable_grad() = values.clone();
      ours[i].mutable_grad() = values.clone();
    }
    opt.step();
    twin_opt.step();
    for (std::size_t i = 0; i < ours.size(); ++i)
      ASSERT_TRUE(bitwise_equal(ours[i].detach(), twin[i].detach())) << "step " << step << ", param " << i;
  }
  EXPECT_LT((ours[0].detach().to(torch::kFloat) - 0.5).abs().max().item<float>(), 0.05f);
}

// Against torch::optim::Adam on the same views, under GradScaler (contract
// path against classic path), and checkpoints both ways: the state of a view
// is laid out as torch::optim lays it out (zeros_like, Preserve).
TEST_P(GradLayoutTest, ViewsWithGapsMatchTorchOptimAndShareItsCheckpoints) {
  const auto values = make_params({{33, 17}, {8, 65}, {6, 5}}, torch::kDouble);
  std::vector<torch::Tensor> bases(values.size()), ref_bases(values.size()), ours, ref;
  for (std::size_t i = 0; i < values.size(); ++i) {
    ours.push_back(view_with_gaps(values[i].detach(), static_cast<int>(i), bases[i]).requires_grad_());
    ref.push_back(view_with_gaps(values[i].detach(), static_cast<int>(i), ref_bases[i]).requires_grad_());
  }
  const auto options = torch::optim::AdamOptions(1e-2).weight_decay(0.01);
  ampfuse::FusedAdam opt(ours, options);
  torch::optim::Adam ref_opt(ref, options);
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(1024.0));
  ampfuse::GradScaler ref_scaler(ampfuse::GradScalerOptions().init_scale(1024.0));
  for (int step = 0; step < 10; ++step) {
    scaler.scale(torch::ones({}, torch::TensorOptions().device(device_)));
    ref_scaler.scale(torch::ones({}, torch::TensorOptions().device(device_)));
    for (std::size_t i = 0; i < ours.size(); ++i) {
      auto g = torch::randn_like(values[i]) * 1024.0;
      if (step == 3 && i == 1) g[0][0] = std::numeric_limits<double>::infinity();  // a skipped step
      ref[i].mutable_grad() = g.clone();
      ours[i].mutable_grad() = g.clone();
    }
    scaler.step(opt);
    ref_scaler.step(ref_opt);
    scaler.update();
    ref_scaler.update();
  }
  ampfuse_test::expect_close(ours, ref, 1e-12, "after 10 scaled steps");
  for (std::size_t i = 0; i < values.size(); ++i)
    EXPECT_TRUE(gaps_untouched(bases[i], static_cast<int>(i), values[i].size(1))) << "the gaps of param " << i;

  // Ours into torch::optim::Adam, and torch::optim's into ours: the next
  // steps agree.
  const std::string path = ampfuse_test::temp_path("gaps_ours.pt"), ref_path = ampfuse_test::temp_path("gaps_ref.pt");
  torch::save(opt, path);
  torch::save(ref_opt, ref_path);
  std::vector<torch::Tensor> b2(values.size()), b3(values.size()), from_ours, from_ref;
  for (std::size_t i = 0; i < values.size(); ++i) {
    from_ours.push_back(view_with_gaps(ours[i].detach(), static_cast<int>(i), b2[i]).requires_grad_());
    from_ref.push_back(view_with_gaps(ref[i].detach(), static_cast<int>(i), b3[i]).requires_grad_());
  }
  torch::optim::Adam ref_loaded(from_ours, options);
  ampfuse::FusedAdam ours_loaded(from_ref, options);
  torch::load(ref_loaded, path);
  torch::load(ours_loaded, ref_path);
  for (int step = 0; step < 3; ++step) {
    for (std::size_t i = 0; i < values.size(); ++i) {
      const auto g = torch::randn_like(values[i]);
      from_ours[i].mutable_grad() = g.clone();
      from_ref[i].mutable_grad() = g.clone();
    }
    ref_loaded.step();
    ours_loaded.step();
  }
  ampfuse_test::expect_close(from_ref, from_ours, 1e-12, "3 steps after loading each other's checkpoints");
  std::remove(path.c_str());
  std::remove(ref_path.c_str());
}

// A view with gaps re-pointed in place to another layout of the same
// elements (set_data to its transpose: same storage, offset and numel) is
// validated again under a plan: its state, laid out for the old strides,
// follows it (a copy in its new kernel layout, element (i, j) still paired
// with element (i, j), as torch::optim pairs them), and its copy and
// write-back follow the new strides.
TEST_P(GradLayoutTest, AViewRePointedToAnotherLayoutIsPreparedAgain) {
  auto w = torch::randn({8, 8}, torch::TensorOptions().device(device_));
  auto p = w.slice(0, 0, 8, 2).slice(1, 0, 8, 2).requires_grad_();  // 4 x 4, strides [16, 2]
  auto twin = p.detach().clone().requires_grad_();
  ampfuse::FusedSGD opt({p}, torch::optim::SGDOptions(0.1).momentum(0.9));
  ampfuse::FusedSGD twin_opt({twin}, torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < 4; ++step) {
    if (step == 2) {
      p.set_data(p.detach().t());  // strides [2, 16]
      twin.set_data(twin.detach().t().contiguous());
    }
    const auto g = torch::randn_like(twin);
    p.mutable_grad() = g.clone();
    twin.mutable_grad() = g.clone();
    opt.step();
    twin_opt.step();
    ASSERT_TRUE(bitwise_equal(p.detach(), twin.detach())) << "step " << step;
  }
  // The momentum buffer was laid out as the view is now (dense, in its order of strides).
  const auto& buf =
      static_cast<ampfuse::FusedSGDParamState&>(*opt.state().at(p.unsafeGetTensorImpl())).momentum_buffer();
  EXPECT_EQ(buf.strides(), c10::IntArrayRef({1, 4}));
}

// Views that overlap are refused, naming them, and nothing is written: a
// view overlapping itself (expanded), and two views with gaps sharing
// elements. Interleaved views (even and odd columns of one matrix) do not
// overlap: taken, and stepped as dense parameters.
TEST_P(GradLayoutTest, OverlappingViewsAreRefusedAndInterleavedOnesTaken) {
  const auto opts = torch::TensorOptions().device(device_);
  {
    auto row = torch::randn({1, 6}, opts);
    auto expanded = row.expand({4, 6}).requires_grad_();
    expanded.mutable_grad() = torch::ones({4, 6}, opts);
    ampfuse::FusedAdam opt({expanded}, torch::optim::AdamOptions(1e-2));
    const auto before = row.clone();
    ampfuse_test::expect_step_refused(opt, "FusedAdam: param group 0, param 0 overlaps itself");
    EXPECT_TRUE(bitwise_equal(row, before));
  }
  {
    // Windows that share elements (unfold: strides pass no dense test, and
    // ATen cannot tell), refused as the overlap they are.
    auto flat = torch::randn({10}, opts);
    auto windows = flat.unfold(0, 4, 2).requires_grad_();  // [4, 4], strides [2, 1]
    windows.mutable_grad() = torch::ones_like(windows);
    ampfuse::FusedAdam opt({windows}, torch::optim::AdamOptions(1e-2));
    const auto before = flat.clone();
    ampfuse_test::expect_step_refused(opt, "FusedAdam: param group 0, param 0 overlaps itself");
    EXPECT_TRUE(bitwise_equal(flat, before));
  }
  {
    // Column blocks of one matrix (attention heads): every extent meets every
    // other, no element is shared.
    auto w = torch::randn({6, 32}, opts);
    std::vector<torch::Tensor> heads, twins;
    for (int h = 0; h < 4; ++h) {
      heads.push_back(w.slice(1, 8 * h, 8 * h + 8).requires_grad_());
      twins.push_back(heads.back().detach().clone().requires_grad_());
      heads.back().mutable_grad() = torch::randn_like(twins.back());
      twins.back().mutable_grad() = heads.back().grad().clone();
    }
    ampfuse::FusedAdam opt(heads, torch::optim::AdamOptions(1e-2));
    ampfuse::FusedAdam twin_opt(twins, torch::optim::AdamOptions(1e-2));
    opt.step();
    twin_opt.step();
    for (int h = 0; h < 4; ++h) EXPECT_TRUE(bitwise_equal(heads[h].detach(), twins[h].detach())) << "head " << h;
  }
  auto base = torch::randn({5, 12}, opts);
  const auto before = base.clone();
  auto a = base.slice(1, 0, 6, 2).requires_grad_();  // columns 0 2 4
  auto b = base.slice(1, 4, 12, 2).requires_grad_();  // columns 4 6 8 10
  auto c = base.slice(1, 1, 12, 2).requires_grad_();  // columns 1 3 5 7 9 11
  for (auto* p : {&a, &b, &c}) p->mutable_grad() = torch::randn_like(*p);
  {
    ampfuse::FusedSGD opt({a, c, b}, torch::optim::SGDOptions(0.1));
    ampfuse_test::expect_step_refused(opt, "FusedSGD: param group 0, param 2 shares memory with param group 0, param 0");
    EXPECT_TRUE(bitwise_equal(base, before));
  }
  auto d = base.slice(1, 8, 12, 2).requires_grad_();  // columns 8 10: meets a's extent, shares nothing
  d.mutable_grad() = torch::randn_like(d);
  ampfuse::FusedSGD opt({a, c, d}, torch::optim::SGDOptions(0.1));
  opt.step();
  torch::NoGradGuard no_grad;
  ampfuse_test::expect_close({a, c, d},
                             {before.slice(1, 0, 6, 2) - 0.1 * a.grad(), before.slice(1, 1, 12, 2) - 0.1 * c.grad(),
                              before.slice(1, 8, 12, 2) - 0.1 * d.grad()},
                             1e-6, "interleaved views after one SGD step");
  EXPECT_TRUE(bitwise_equal(base.slice(1, 6, 7), before.slice(1, 6, 7))) << "column 6 belongs to no parameter";
}

// Random boxes (and some strided slices) of one 2-d or 3-d tensor, two to
// four per case, against a count of the elements they share: the optimizer
// refuses exactly the cases where two share one, naming two that do, and
// steps the rest. Clusters of views only are mostly decided by their
// strides and offsets (compare_on_one_lattice), the others element by
// element.
TEST(ParamOverlap, BoxesOfOneTensorAreRefusedExactlyWhenTheyShareAnElement) {
  const auto seed = ampfuse_test::seed_for_test();
  std::mt19937_64 rng(seed);
  auto pick = [&](std::int64_t lo, std::int64_t hi) {  // uniform in [lo, hi]
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
  };
  int refused = 0, taken = 0;
  for (int c = 0; c < 300; ++c) {
    const bool three = pick(0, 1) == 1;
    const std::vector<std::int64_t> shape = three ? std::vector<std::int64_t>{pick(2, 5), pick(2, 6), pick(4, 12)}
                                                  : std::vector<std::int64_t>{pick(2, 8), pick(4, 24)};
    auto base = torch::zeros(shape);
    std::vector<torch::Tensor> views;
    const int count = static_cast<int>(pick(2, 4));
    for (int v = 0; v < count; ++v) {
      torch::Tensor t = base;
      for (std::int64_t d = 0; d < base.dim(); ++d) {
        const std::int64_t n = shape[static_cast<std::size_t>(d)];
        // Mostly narrow in the last dimension, so that the box has gaps.
        const std::int64_t begin = pick(0, n - 1), end = d + 1 == base.dim() ? pick(begin + 1, std::min(n, begin + n / 2))
                                                                               : pick(begin + 1, n);
        const std::int64_t step = pick(0, 5) == 0 ? 2 : 1;
        t = t.slice(d, begin, end, step);
      }
      views.push_back(t);
    }
    // The truth: element offsets counted per view.
    std::vector<int> owner(static_cast<std::size_t>(base.numel()), -1);
    std::vector<std::set<std::int64_t>> elements(static_cast<std::size_t>(count));
    bool shares = false;
    for (int v = 0; v < count; ++v) {
      const auto offsets = torch::arange(base.numel())
                               .as_strided(views[v].sizes(), views[v].strides(), views[v].storage_offset())
                               .contiguous();
      const std::int64_t* first = offsets.data_ptr<std::int64_t>();
      for (std::int64_t e : std::vector<std::int64_t>(first, first + offsets.numel())) {
        elements[static_cast<std::size_t>(v)].insert(e);
        if (owner[static_cast<std::size_t>(e)] >= 0 && owner[static_cast<std::size_t>(e)] != v) shares = true;
        owner[static_cast<std::size_t>(e)] = v;
      }
    }
    std::vector<torch::Tensor> params;
    for (auto& t : views) {
      params.push_back(t.requires_grad_());
      params.back().mutable_grad() = torch::ones_like(t);
    }
    ampfuse::FusedSGD opt(params, torch::optim::SGDOptions(1.0));
    SCOPED_TRACE("case " + std::to_string(c) + " (seed " + std::to_string(seed) + ")");
    const std::string error = ampfuse_test::error_of([&] { opt.step(); });
    if (shares) {
      ++refused;
      EXPECT_THAT(error, ::testing::HasSubstr("shares memory with param group 0"));
      // The two it names share an element.
      std::smatch named;
      ASSERT_TRUE(std::regex_search(error, named, std::regex("param (\\d+) shares memory with param group 0, param (\\d+)")))
          << error;
      const auto& x = elements.at(std::stoul(named[1].str()));
      const auto& y = elements.at(std::stoul(named[2].str()));
      EXPECT_TRUE(std::any_of(x.begin(), x.end(), [&](std::int64_t e) { return y.count(e) != 0; })) << error;
    } else {
      ++taken;
      EXPECT_EQ(error, "(no error)");
    }
  }
  std::cout << "[ overlap  ] " << refused << " cases refused, " << taken << " taken" << std::endl;
  EXPECT_GT(refused, 20);
  EXPECT_GT(taken, 20);
}

INSTANTIATE_TEST_SUITE_P(All, GradLayoutTest,
                         ::testing::Values(LayoutCase{"cpu", "avx512"}, LayoutCase{"cpu", "avx2"},
                                           LayoutCase{"cpu", "baseline"}, LayoutCase{"cuda", ""}),
                         [](const ::testing::TestParamInfo<LayoutCase>& info) {
                           return info.param.device + (info.param.isa.empty() ? "" : "_" + info.param.isa);
                         });

}  // namespace
