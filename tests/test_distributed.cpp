// GradScaler across ranks (GradScalerOptions::process_group), on CPU with
// Gloo, ranks as threads over one c10d::HashStore, world sizes 1 to 4. Each
// rank holds its own part of one model's parameters and grads (as a sharded
// optimizer does); the ranks together must step as one process stepping
// the whole model: the same skips, the same global clip norm, the same
// scale. A rank without grads, or without parameters, still joins; a rank
// that never arrives makes the others fail within the group's timeout,
// with an error that says what to check, instead of hanging.

#include <ampfuse/ampfuse.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
// The wheel's LibTorch is built with Gloo; its header declares the class only with this set.
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <chrono>
#include <functional>
#include <limits>
#include <mutex>
#include <thread>

#include "tests/common.h"

namespace {

using ampfuse_test::bitwise_equal;

// Runs fn(rank, group) on `world` threads, each with its own Gloo process
// group over one HashStore (loopback), with a bounded timeout on every
// collective. An exception on a rank is reported as a failure naming it.
void on_ranks(int world, const std::function<void(int, const c10::intrusive_ptr<c10d::ProcessGroup>&)>& fn,
              std::chrono::milliseconds timeout = std::chrono::milliseconds(20000)) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::thread> threads;
  std::mutex mutex;
  std::vector<std::string> errors;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        auto options = c10d::ProcessGroupGloo::Options::create();
        options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
        options->timeout = timeout;
        // A ProcessGroup over a Gloo backend for CPU tensors, as torch.distributed makes it.
        auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, options);
        auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, world);
        group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
        group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
        fn(rank, group);
      } catch (const std::exception& e) {
        const std::lock_guard<std::mutex> lock(mutex);
        errors.push_back("rank " + std::to_string(rank) + ": " + e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& e : errors) ADD_FAILURE() << e;
}

// One model's parameters, and its grads for `steps` steps (the same on
// every rank: drawn from one seed), parameter k held by rank k % world.
struct Model {
  std::vector<torch::Tensor> params;
  std::vector<std::vector<torch::Tensor>> grads;  // [step][param]
};

Model make_model(std::uint64_t seed, int steps, int inf_step) {
  torch::manual_seed(seed);
  Model m;
  for (const std::int64_t n : {1000, 7, 65537, 1, 333, 4096}) m.params.push_back(torch::randn({n}));
  for (int s = 0; s < steps; ++s) {
    std::vector<torch::Tensor> g;
    for (const auto& p : m.params) g.push_back(torch::randn_like(p));
    if (s == inf_step) g[5][17] = std::numeric_limits<float>::infinity();  // held by rank 5 % world
    m.grads.push_back(std::move(g));
  }
  return m;
}

std::vector<torch::Tensor> leaves(const std::vector<torch::Tensor>& v) {
  std::vector<torch::Tensor> out;
  for (const auto& t : v) out.push_back(t.detach().clone().requires_grad_());
  return out;
}

// What one optimizer does per step in these tests: scale, clip (on clip
// steps), step, update. `classic`: torch::optim::SGD with unscale_ first.
struct Flow {
  bool classic = false;
  bool clip = true;
};

// The single-process run of the whole model, and the ranks' runs of their
// parts; after every step each rank's parameters, its scale and its
// returned norm must be the single process's.
void expect_ranks_step_as_one_process(int world, const Flow& run, std::uint64_t seed) {
  const int steps = 8, inf_step = 3;
  const Model model = make_model(seed, steps, inf_step);
  const auto scaler_options = ampfuse::GradScalerOptions().init_scale(1024.0).growth_interval(2);
  auto make_opt = [&](const std::vector<torch::Tensor>& p) -> std::unique_ptr<torch::optim::Optimizer> {
    if (run.classic) return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.01).momentum(0.9));
    return std::make_unique<ampfuse::FusedAdam>(p, torch::optim::AdamOptions(0.01).weight_decay(0.01));
  };
  // The single process: every parameter, one scaler.
  std::vector<std::vector<torch::Tensor>> whole_after;  // [step][param]
  std::vector<double> whole_scale, whole_norm;
  {
    auto params = leaves(model.params);
    auto opt = make_opt(params);
    ampfuse::GradScaler scaler(scaler_options);
    for (int s = 0; s < steps; ++s) {
      const float scale = static_cast<float>(scaler.get_scale());
      for (std::size_t k = 0; k < params.size(); ++k) params[k].mutable_grad() = model.grads[s][k] * scale;
      scaler.scale(torch::ones({}));
      if (run.classic) scaler.unscale_(*opt);
      whole_norm.push_back(run.clip ? scaler.clip_grad_norm_(*opt, 50.0).item<double>() : 0.0);
      scaler.step(*opt);
      scaler.update();
      whole_scale.push_back(scaler.get_scale());
      std::vector<torch::Tensor> after;
      for (const auto& p : params) after.push_back(p.detach().clone());
      whole_after.push_back(std::move(after));
    }
  }
  on_ranks(world, [&](int rank, const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
    std::vector<std::size_t> mine;
    for (std::size_t k = 0; k < model.params.size(); ++k)
      if (static_cast<int>(k % world) == rank) mine.push_back(k);
    std::vector<torch::Tensor> params;
    for (const std::size_t k : mine) params.push_back(model.params[k].detach().clone().requires_grad_());
    auto opt = make_opt(params);
    ampfuse::GradScaler scaler(ampfuse::GradScalerOptions(scaler_options).process_group(group));
    for (int s = 0; s < steps; ++s) {
      const float scale = static_cast<float>(scaler.get_scale());
      for (std::size_t j = 0; j < mine.size(); ++j) params[j].mutable_grad() = model.grads[s][mine[j]] * scale;
      scaler.scale(torch::ones({}));
      if (run.classic) scaler.unscale_(*opt);
      const double norm = run.clip ? scaler.clip_grad_norm_(*opt, 50.0).item<double>() : 0.0;
      scaler.step(*opt);
      scaler.update();
      const std::string where = "rank " + std::to_string(rank) + " of " + std::to_string(world) + ", step " +
                                std::to_string(s);
      EXPECT_EQ(scaler.last_step_skipped(*opt), s == inf_step) << where;
      EXPECT_EQ(scaler.get_scale(), whole_scale[s]) << where;
      // The global norm: the same fp64 sum in another order, then fp32.
      if (s != inf_step) EXPECT_NEAR(norm, whole_norm[s], 1e-6 * whole_norm[s]) << where;
      for (std::size_t j = 0; j < mine.size(); ++j) {
        const auto diff = (params[j].detach() - whole_after[s][mine[j]]).abs().max().item<double>();
        EXPECT_LE(diff, 1e-6) << where << ", param " << mine[j];
      }
    }
  });
}

TEST(DistributedGradScaler, ShardedRanksStepAsOneProcessFusedAdamClipped) {
  const auto seed = ampfuse_test::seed_for_test();
  for (int world = 1; world <= 4; ++world) {
    SCOPED_TRACE("world " + std::to_string(world));
    expect_ranks_step_as_one_process(world, Flow{false, true}, seed);
  }
}

TEST(DistributedGradScaler, ShardedRanksStepAsOneProcessClassicPath) {
  const auto seed = ampfuse_test::seed_for_test();
  for (int world : {2, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    expect_ranks_step_as_one_process(world, Flow{true, true}, seed);
    expect_ranks_step_as_one_process(world, Flow{true, false}, seed);
  }
}

// A rank whose parameters have no grads this step, and a rank whose
// optimizer has no parameters, join the all-reduce: an inf on rank 0 skips
// every rank, and nothing hangs or is refused for lack of grads.
TEST(DistributedGradScaler, RanksWithoutGradsOrParametersJoin) {
  on_ranks(3, [&](int rank, const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
    std::vector<torch::Tensor> params;
    if (rank != 2) params.push_back(torch::randn({64}).requires_grad_());
    ampfuse::FusedAdam opt(params, torch::optim::AdamOptions(0.1));
    ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(8.0).process_group(group));
    for (int s = 0; s < 3; ++s) {
      if (rank == 0) {
        params[0].mutable_grad() = torch::randn({64});
        if (s == 1) params[0].mutable_grad()[5] = std::numeric_limits<float>::quiet_NaN();
      }
      const auto before = params.empty() ? torch::Tensor() : params[0].detach().clone();
      scaler.scale(torch::ones({}));
      if (s == 2) scaler.clip_grad_norm_(opt, 1.0);
      scaler.step(opt);
      scaler.update();
      EXPECT_EQ(scaler.last_step_skipped(opt), s == 1) << "rank " << rank << ", step " << s;
      EXPECT_EQ(scaler.get_scale(), s >= 1 ? 4.0 : 8.0) << "rank " << rank << ", step " << s;
      if (rank == 0 && s == 1) EXPECT_TRUE(bitwise_equal(params[0].detach(), before));
    }
  });
}

// A rank that never calls step(): the others fail within the group's
// timeout with an error naming the call and what every rank must do.
TEST(DistributedGradScaler, ARankThatNeverArrivesFailsTheOthersWithinTheTimeout) {
  const auto start = std::chrono::steady_clock::now();
  std::string error;
  std::mutex mutex;
  on_ranks(
      2,
      [&](int rank, const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
        if (rank == 1) return;  // joins the group, never the step
        auto p = torch::randn({8}).requires_grad_();
        p.mutable_grad() = torch::randn({8});
        ampfuse::FusedAdam opt({p}, torch::optim::AdamOptions(0.1));
        ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().process_group(group));
        scaler.scale(torch::ones({}));
        try {
          scaler.step(opt);
        } catch (const c10::Error& e) {
          const std::lock_guard<std::mutex> lock(mutex);
          error = e.what_without_backtrace();
        }
      },
      std::chrono::milliseconds(1500));
  EXPECT_THAT(error, ::testing::HasSubstr("GradScaler::step: rank 0 of 2: the all-reduce of found_inf"));
  EXPECT_THAT(error, ::testing::HasSubstr("every rank must call step()"));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(15));
}

}  // namespace
