// Concurrency: optimizers and GradScalers that share nothing can step at
// once from several threads, with the results of stepping one after the
// other; parameters that share memory are refused (they would race).

#include <ampfuse/ampfuse.h>

#include <atomic>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/common.h"

namespace {

using ampfuse_test::bitwise_equal;
using ampfuse_test::leaf_copies;

// Parameters of sizes that take every path: zero elements, a tail, several
// chunks, and enough tensors (more than 512) that validation runs on ATen's threads.
std::vector<torch::Tensor> make_params() {
  std::vector<torch::Tensor> out;
  for (std::int64_t n : {0, 1, 17, 65537, 140001}) out.push_back(torch::randn({n}).requires_grad_());
  for (int i = 0; i < 520; ++i) out.push_back(torch::randn({3 + i % 5}).requires_grad_());
  return out;
}

using Factory = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>;

struct Named {
  const char* name;
  Factory make;
};

std::vector<Named> factories() {
  return {
      {"FusedAdam", [](auto p) { return std::make_unique<ampfuse::FusedAdam>(p, torch::optim::AdamOptions(1e-2)); }},
      {"FusedAdamW",
       [](auto p) { return std::make_unique<ampfuse::FusedAdamW>(p, torch::optim::AdamWOptions(1e-2).amsgrad(true)); }},
      {"FusedSGD",
       [](auto p) { return std::make_unique<ampfuse::FusedSGD>(p, torch::optim::SGDOptions(0.1).momentum(0.9)); }},
      {"FusedLAMB",
       [](auto p) { return std::make_unique<ampfuse::FusedLAMB>(p, ampfuse::FusedLAMBOptions(1e-2).max_grad_norm(1)); }},
      {"FusedAdagrad", [](auto p) { return std::make_unique<ampfuse::FusedAdagrad>(p, torch::optim::AdagradOptions(0.1)); }},
      {"FusedRMSprop",
       [](auto p) {
         return std::make_unique<ampfuse::FusedRMSprop>(p, torch::optim::RMSpropOptions(1e-2).momentum(0.5).centered(true));
       }},
  };
}

// Grads for each step, drawn once, so that both runs see the same ones.
std::vector<std::vector<torch::Tensor>> draw_grads(const std::vector<torch::Tensor>& params, int steps) {
  std::vector<std::vector<torch::Tensor>> out(steps);
  for (auto& step : out)
    for (const auto& p : params) step.push_back(torch::randn_like(p));
  return out;
}

// Runs a(i) and b(i) for i in [0, steps) on two threads that start together.
void run_at_once(int steps, const std::function<void(int)>& a, const std::function<void(int)>& b) {
  std::atomic<int> ready{0};
  auto body = [&](const std::function<void(int)>& f) {
    ready.fetch_add(1);
    while (ready.load() < 2) std::this_thread::yield();
    for (int i = 0; i < steps; ++i) f(i);
  };
  std::exception_ptr error_a, error_b;
  std::thread ta([&] {
    try {
      body(a);
    } catch (...) {
      error_a = std::current_exception();
    }
  });
  std::thread tb([&] {
    try {
      body(b);
    } catch (...) {
      error_b = std::current_exception();
    }
  });
  ta.join();
  tb.join();
  if (error_a) std::rethrow_exception(error_a);
  if (error_b) std::rethrow_exception(error_b);
}

void set_grads(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads, float factor) {
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (!params[i].grad().defined()) params[i].mutable_grad() = torch::empty_like(params[i]);
    params[i].mutable_grad().copy_(grads[i] * factor);
  }
}

class ConcurrencyTest : public ::testing::Test {
 protected:
  void SetUp() override { ampfuse_test::seed_for_test(); }
};

TEST_F(ConcurrencyTest, TwoOptimizersSteppingAtOnceMatchSteppingInTurn) {
  constexpr int kSteps = 4;
  for (const Named& f : factories()) {
    SCOPED_TRACE(f.name);
    const auto a = make_params(), b = make_params();
    const auto ga = draw_grads(a, kSteps), gb = draw_grads(b, kSteps);
    const auto a_turn = leaf_copies(a), b_turn = leaf_copies(b);
    auto opt_a = f.make(a), opt_b = f.make(b);
    auto turn_a = f.make(a_turn), turn_b = f.make(b_turn);
    run_at_once(
        kSteps,
        [&](int s) {
          set_grads(a, ga[s], 1.f);
          opt_a->step();
        },
        [&](int s) {
          set_grads(b, gb[s], 1.f);
          opt_b->step();
        });
    for (int s = 0; s < kSteps; ++s) {
      set_grads(a_turn, ga[s], 1.f);
      turn_a->step();
    }
    for (int s = 0; s < kSteps; ++s) {
      set_grads(b_turn, gb[s], 1.f);
      turn_b->step();
    }
    for (std::size_t i = 0; i < a.size(); ++i) {
      ASSERT_TRUE(bitwise_equal(a[i], a_turn[i])) << "optimizer a, param " << i;
      ASSERT_TRUE(bitwise_equal(b[i], b_turn[i])) << "optimizer b, param " << i;
    }
  }
}

// Two GradScalers, each with its own optimizer, at once: scaled grads, fused
// clipping, a step skipped on an inf (a different one in each), a scale
// that grows and backs off.
TEST_F(ConcurrencyTest, TwoGradScalersAtOnceMatchInTurn) {
  constexpr int kSteps = 6;
  for (const Named& f : factories()) {
    SCOPED_TRACE(f.name);
    const auto a = make_params(), b = make_params();
    const auto ga = draw_grads(a, kSteps), gb = draw_grads(b, kSteps);
    const auto a_turn = leaf_copies(a), b_turn = leaf_copies(b);
    auto opt_a = f.make(a), opt_b = f.make(b), turn_a = f.make(a_turn), turn_b = f.make(b_turn);
    const auto options = ampfuse::GradScalerOptions().init_scale(1024.0).growth_interval(3);
    ampfuse::GradScaler sa(options), sb(options), turn_sa(options), turn_sb(options);
    auto iteration = [](ampfuse::GradScaler& scaler, torch::optim::Optimizer& opt,
                        const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
                        bool poison) {
      scaler.scale(torch::ones({}));
      set_grads(params, grads, static_cast<float>(scaler.get_scale()));
      if (poison) params[2].mutable_grad()[3] = std::numeric_limits<float>::infinity();
      scaler.clip_grad_norm_(opt, 5.0);
      scaler.step(opt);
      scaler.update();
    };
    run_at_once(
        kSteps, [&](int s) { iteration(sa, *opt_a, a, ga[s], s == 2); },
        [&](int s) { iteration(sb, *opt_b, b, gb[s], s == 4); });
    for (int s = 0; s < kSteps; ++s) iteration(turn_sa, *turn_a, a_turn, ga[s], s == 2);
    for (int s = 0; s < kSteps; ++s) iteration(turn_sb, *turn_b, b_turn, gb[s], s == 4);
    EXPECT_EQ(sa.get_scale(), turn_sa.get_scale());
    EXPECT_EQ(sb.get_scale(), turn_sb.get_scale());
    EXPECT_EQ(sa.get_growth_tracker(), turn_sa.get_growth_tracker());
    for (std::size_t i = 0; i < a.size(); ++i) {
      ASSERT_TRUE(bitwise_equal(a[i], a_turn[i])) << "optimizer a, param " << i;
      ASSERT_TRUE(bitwise_equal(b[i], b_turn[i])) << "optimizer b, param " << i;
    }
  }
}

// Views of one buffer as parameters (made leaves with detach()).
torch::Tensor view_param(const torch::Tensor& base, std::int64_t start, std::int64_t length) {
  auto p = base.narrow(0, start, length).detach().requires_grad_();
  p.mutable_grad() = torch::randn_like(p);
  return p;
}

TEST_F(ConcurrencyTest, ParametersThatShareMemoryAreRefusedNamingBoth) {
  for (const Named& f : factories()) {
    SCOPED_TRACE(f.name);
    const std::string name = f.name;
    const auto base = torch::randn({100});
    const auto before = base.clone();
    // Overlapping slices in one group.
    {
      auto p = view_param(base, 0, 60), q = view_param(base, 50, 50);
      auto opt = f.make({p, q});
      ampfuse_test::expect_step_refused(*opt, name + ": param group 0, param 1 shares memory with param group 0, param 0");
      EXPECT_TRUE(bitwise_equal(base, before)) << "a refused step wrote";
    }
    // One inside another, in other groups, with a disjoint one between them in order.
    {
      auto whole = view_param(base, 0, 100), other = torch::randn({5}).requires_grad_(), inner = view_param(base, 10, 3);
      other.mutable_grad() = torch::randn_like(other);
      std::vector<torch::optim::OptimizerParamGroup> groups;
      groups.emplace_back(std::vector<torch::Tensor>{other, inner});
      groups.emplace_back(std::vector<torch::Tensor>{whole});
      auto opt = f.make({});
      opt->param_groups().clear();
      for (auto& g : groups) opt->add_param_group(g);
      ampfuse_test::expect_step_refused(*opt, name + ": param group 1, param 0 shares memory with param group 0, param 1");
      EXPECT_TRUE(bitwise_equal(base, before)) << "a refused step wrote";
    }
  }
}

TEST_F(ConcurrencyTest, DisjointViewsOfOneBufferStepAsSeparateTensors) {
  for (const Named& f : factories()) {
    SCOPED_TRACE(f.name);
    const auto base = torch::randn({100});
    // Adjacent and apart, and a zero-element view inside another's range.
    auto p = view_param(base, 0, 40), q = view_param(base, 40, 30), r = view_param(base, 80, 20);
    auto empty = view_param(base, 10, 0);
    const std::vector<torch::Tensor> params = {p, q, r, empty};
    auto separate = leaf_copies(params);
    for (std::size_t i = 0; i < params.size(); ++i) separate[i].mutable_grad() = params[i].grad().clone();
    const auto gap = base.narrow(0, 70, 10).clone();
    auto opt = f.make(params), ref = f.make(separate);
    for (int s = 0; s < 3; ++s) {
      opt->step();
      ref->step();
    }
    for (std::size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(bitwise_equal(params[i], separate[i])) << i;
    EXPECT_TRUE(bitwise_equal(base.narrow(0, 70, 10), gap)) << "a step wrote between the views";
  }
}

// The same tensor in two groups is refused too, before anything is written.
TEST_F(ConcurrencyTest, TheSameTensorInTwoGroupsIsRefused) {
  auto p = torch::randn({8}).requires_grad_();
  p.mutable_grad() = torch::randn_like(p);
  const auto before = p.detach().clone();
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{p});
  groups.emplace_back(std::vector<torch::Tensor>{p});
  ampfuse::FusedAdam opt(groups, torch::optim::AdamOptions(0.1));
  ampfuse_test::expect_step_refused(opt, "FusedAdam: param group 1, param 0 is also param 0 of group 0");
  EXPECT_TRUE(bitwise_equal(p.detach(), before));
}

}  // namespace
