// GradScaler across ranks (GradScalerOptions::process_group), on CPU with
// Gloo, ranks as threads over one c10d::HashStore, world sizes 1 to 4. Each
// rank holds its own part of one model's parameters and grads (as a sharded
// optimizer does); the ranks together must step as one process stepping
// the whole model: the same skips, the same global clip norm, the same
// scale. A rank without grads, or without parameters, still joins; a rank
// that never arrives makes the others fail within the group's timeout,
// with an error that says what to check, instead of hanging.

#include <ampfuse/ampfuse.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <functional>
#include <limits>
#include <mutex>
#include <map>
#include <tuple>
#include <thread>

#include "tests/common.h"
#include "tests/ranks.h"
#include "tests/sharded_model.h"

namespace {

using ampfuse_test::bitwise_equal;
using ampfuse_test::on_ranks;
namespace sharded = ampfuse_test::sharded;

void expect_ranks_step_as_one_process(int world, const sharded::Flow& flow, std::uint64_t seed) {
  const sharded::Model model = sharded::make_model(seed, /*steps=*/8, /*inf_step=*/3);
  const sharded::Trace expected = sharded::whole(model, flow);
  on_ranks(world, [&](int rank, const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
    for (const std::string& e : sharded::check_rank(model, flow, expected, rank, world, group)) ADD_FAILURE() << e;
  });
}

// Each rank holds every world-th parameter of one model; over 8 steps, with
// an inf in one rank's grads at step 3, the ranks step as one process
// stepping the whole model: FusedAdam with clipping (the contract path),
// torch::optim::SGD with unscale_ (the classic path), with and without clipping.
TEST(DistributedGradScaler, ShardedRanksStepAsOneProcessFusedAdamClipped) {
  const auto seed = ampfuse_test::seed_for_test();
  for (int world = 1; world <= 4; ++world) {
    SCOPED_TRACE("world " + std::to_string(world));
    expect_ranks_step_as_one_process(world, sharded::Flow{false, true}, seed);
  }
}

TEST(DistributedGradScaler, ShardedRanksStepAsOneProcessClassicPath) {
  const auto seed = ampfuse_test::seed_for_test();
  for (int world : {2, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    expect_ranks_step_as_one_process(world, sharded::Flow{true, true}, seed);
    expect_ranks_step_as_one_process(world, sharded::Flow{true, false}, seed);
  }
}

// The same model data parallel with ZeroOptimizer(FusedAdam) (the scenario
// tests/dist_rank.cpp runs as processes): every rank as one process.
TEST(DistributedGradScaler, ZeroOptimizerDataParallelStepsAsOneProcess) {
  const auto seed = ampfuse_test::seed_for_test();
  const sharded::Model model = sharded::make_model(seed, /*steps=*/8, /*inf_step=*/3);
  for (int world = 1; world <= 4; ++world) {
    SCOPED_TRACE("world " + std::to_string(world));
    on_ranks(world, [&](int rank, const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
      for (const std::string& e : sharded::check_zero_rank(model, rank, world, group)) ADD_FAILURE() << e;
    });
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
// timeout with an error naming the call and what every rank must do. The
// absent rank stays in the group (it waits, bounded, for rank 0 to give up)
// so that rank 0 sees a rank that does not come, not one that left.
TEST(DistributedGradScaler, ARankThatNeverArrivesFailsTheOthersWithinTheTimeout) {
  std::string error;
  std::mutex mutex;
  std::atomic<bool> gave_up{false};
  std::chrono::steady_clock::duration waited{};
  on_ranks(
      2,
      [&](int rank, const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
        if (rank == 1) {  // joins the group, never the step (bounded: 60 s, far past rank 0's timeout)
          for (int i = 0; i < 6000 && !gave_up.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
          return;
        }
        auto p = torch::randn({8}).requires_grad_();
        p.mutable_grad() = torch::randn({8});
        ampfuse::FusedAdam opt({p}, torch::optim::AdamOptions(0.1));
        ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().process_group(group));
        scaler.scale(torch::ones({}));
        const auto start = std::chrono::steady_clock::now();  // (not the group's set-up, which a loaded machine slows)
        try {
          scaler.step(opt);
        } catch (const c10::Error& e) {
          const std::lock_guard<std::mutex> lock(mutex);
          error = e.what_without_backtrace();
        }
        waited = std::chrono::steady_clock::now() - start;
        gave_up = true;
      },
      std::chrono::milliseconds(1500));
  EXPECT_THAT(error, ::testing::HasSubstr("GradScaler::step: rank 0 of 2: the all-reduce of found_inf"));
  EXPECT_THAT(error, ::testing::HasSubstr("every rank must call step()"));
  // A bound on hanging, not a timing: the group's timeout is 1.5 s.
  EXPECT_LT(waited, std::chrono::seconds(15));
}

}  // namespace

namespace {

// Variables as a launcher would set them, read through launch_env's lookup
// (setenv would race with the getenv of c10d's threads left by other tests).
class Vars {
 public:
  Vars(std::map<std::string, std::string> vars) : vars_(std::move(vars)) {}
  Vars& set(const char* name, const char* value) {
    if (value) vars_[name] = value;
    else vars_.erase(name);
    return *this;
  }
  ampfuse::distributed::LaunchEnv read() const {
    return ampfuse::distributed::launch_env([this](const char* name) -> const char* {
      const auto it = vars_.find(name);
      return it == vars_.end() ? nullptr : it->second.c_str();
    });
  }

 private:
  std::map<std::string, std::string> vars_;
};

// torchrun's variables are read as torchrun sets them; a missing or
// malformed one is refused, naming it.
TEST(DistributedLaunch, LaunchEnvReadsTorchrunsVariablesAndNamesABadOne) {
  const Vars good({{"RANK", "2"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "10.1.2.3"}, {"MASTER_PORT", "29511"}});
  const auto e = good.read();
  EXPECT_EQ(e.rank, 2);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 2);  // RANK when LOCAL_RANK is unset
  EXPECT_EQ(e.master_addr, "10.1.2.3");
  EXPECT_EQ(e.master_port, 29511);
  EXPECT_EQ(Vars(good).set("LOCAL_RANK", "0").read().local_rank, 0);
  const std::vector<std::tuple<const char*, const char*, std::string>> bad = {
      {"RANK", nullptr, "RANK is not set"},
      {"WORLD_SIZE", "0", "WORLD_SIZE=0 is not a whole number from 1"},
      {"RANK", "4", "RANK=4 is not a whole number from 0 to 3"},
      {"MASTER_PORT", "80x", "MASTER_PORT=80x is not a whole number"},
      {"MASTER_ADDR", "", "MASTER_ADDR is not set"},
      {"LOCAL_RANK", "-1", "LOCAL_RANK=-1 is not a whole number"},
  };
  for (const auto& [name, value, message] : bad) {
    try {
      Vars(good).set(name, value).read();
      ADD_FAILURE() << "accepted; expected: " << message;
    } catch (const c10::Error& err) {
      EXPECT_THAT(err.what_without_backtrace(), ::testing::HasSubstr(message));
    }
  }
}

}  // namespace
