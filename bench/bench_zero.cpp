// ZeroOptimizer(FusedAdam) against replicated data parallelism (an all-reduce
// of the grads, averaged, then FusedAdam over every parameter on every
// rank), at 2 and 4 ranks on CPU with Gloo. Ranks are threads of this
// process, each with its own process group over one HashStore (loopback),
// and each computes with one intra-op thread (this machine has 2 cores; the
// row says so). Timed: one step of every rank, from the main thread's
// signal until the last rank is done. Counters: bytes each rank sends per
// step (ring algorithms; ZeroOptimizer::bytes_sent_per_step for ours) and
// optimizer-state bytes per rank.

#include <ampfuse/fused_adam.h>
#include <ampfuse/zero.h>

#include <ATen/Parallel.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "bench/common.h"

namespace ampfuse_bench {
namespace {

// c10d's flight recorder (a process-wide trace of collectives) is not safe
// when several process groups of one process issue collectives at once, as
// ranks as threads do (its map insert crashed here; docs/distributed.md):
// off, before main() and before anything reads the variable.
const bool kFlightRecorderOff = [] { return setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/0) == 0; }();

// `world` threads, each holding one rank's optimizer; run() makes every
// rank call its step once and returns when all have.
class Ranks {
 public:
  using Make = std::function<Fn(int rank, const c10::intrusive_ptr<c10d::ProcessGroup>& group)>;
  Ranks(int world, const Make& make) : world_(world) {
    TORCH_CHECK(kFlightRecorderOff, "could not turn c10d's flight recorder off");
    std::signal(SIGPIPE, SIG_IGN);
    auto store = c10::make_intrusive<c10d::HashStore>();
    for (int rank = 0; rank < world; ++rank)
      threads_.emplace_back([this, rank, store, make] {
        // One intra-op thread for this rank: initialize this thread's count, then set it.
        at::parallel_for(0, 1, 1, [](std::int64_t, std::int64_t) {});
        at::set_num_threads(1);
        auto options = c10d::ProcessGroupGloo::Options::create();
        options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
        options->timeout = std::chrono::seconds(120);
        auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world_, options);
        auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, world_);
        group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
        group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
        Fn step = make(rank, group);
        report_done();
        for (std::uint64_t seen = 0;;) {
          {
            std::unique_lock<std::mutex> lock(mutex_);
            wake_.wait(lock, [&] { return generation_ != seen || stop_; });
            if (stop_) return;
            seen = generation_;
          }
          step();
          report_done();
        }
      });
    wait_all();
    // The main thread's (and later benchmarks') thread count, as main() set it.
    at::set_num_threads(bench_threads());
  }
  ~Ranks() {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }
  void run() {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      ++generation_;
    }
    wake_.notify_all();
    wait_all();
  }

 private:
  void report_done() {
    const std::lock_guard<std::mutex> lock(mutex_);
    ++done_;
    done_cv_.notify_all();
  }
  void wait_all() {
    std::unique_lock<std::mutex> lock(mutex_);
    done_cv_.wait(lock, [&] { return done_ == world_; });
    done_ = 0;
  }

  int world_;
  std::vector<std::thread> threads_;
  std::mutex mutex_;
  std::condition_variable wake_, done_cv_;
  std::uint64_t generation_ = 0;
  int done_ = 0;
  bool stop_ = false;
};

constexpr std::int64_t kTensors = 8, kNumel = 1 << 20;  // 8 x 1M fp32 per rank

std::vector<torch::Tensor> make_params(int rank) {
  torch::manual_seed(rank);
  std::vector<torch::Tensor> params;
  for (std::int64_t i = 0; i < kTensors; ++i) {
    auto p = (torch::rand({kNumel}) - 0.5).requires_grad_();
    p.mutable_grad() = torch::randn({kNumel}) * 1e-2;
    params.push_back(p);
  }
  return params;
}

std::int64_t state_bytes(const torch::optim::Optimizer& opt) {
  std::int64_t n = 0;
  for (const auto& [key, state] : opt.state()) {
    const auto& s = static_cast<const ampfuse::FusedAdamParamState&>(*state);
    for (const at::Tensor* t : {&s.exp_avg(), &s.exp_avg_sq(), &s.exp_avg_8bit(), &s.exp_avg_absmax(),
                                &s.exp_avg_sq_8bit(), &s.exp_avg_sq_absmax()})
      if (t->defined()) n += static_cast<std::int64_t>(t->nbytes());
  }
  return n;
}

// ZeroAdam (32-bit moments) or ZeroAdam8 (moments_8bit, sharded on whole
// 256-element blocks) at `world` ranks.
void register_world(int world, bool eight_bit) {
  const std::string set = "8x1M-" + std::to_string(world) + "ranks";
  const std::string op = eight_bit ? "ZeroAdam8" : "ZeroAdam";
  const auto fused = ampfuse::FusedAdamOptions().moments_8bit(eight_bit);
  const std::int64_t grad_bytes = kTensors * kNumel * 4;
  const double sent = 2.0 * (world - 1) / world * static_cast<double>(grad_bytes);  // ring all-reduce
  const auto torch_opts = torch::optim::AdamOptions(1e-4);

  auto* zero = benchmark::RegisterBenchmark((op + "/ours/" + set).c_str(), [=](benchmark::State& state) {
    std::vector<std::int64_t> state_per_rank(world), sent_per_rank(world);
    Ranks ranks(world, [&](int rank, const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
      auto params = std::make_shared<std::vector<torch::Tensor>>(make_params(rank));
      std::shared_ptr<ampfuse::distributed::ZeroOptimizer> opt =
          ampfuse::distributed::ZeroOptimizer::make<ampfuse::FusedAdam>(*params, torch_opts, group, {}, fused);
      // The grads become views of the optimizer's bucket (as after
      // zero_grad(false) and a backward): nothing to copy at each step.
      std::vector<torch::Tensor> values;
      for (auto& p : *params) values.push_back(p.grad().clone());
      opt->zero_grad(/*set_to_none=*/false);
      for (std::size_t i = 0; i < params->size(); ++i) (*params)[i].mutable_grad().copy_(values[i]);
      opt->step();  // warm-up: state allocated
      state_per_rank[rank] = state_bytes(opt->inner());
      sent_per_rank[rank] = opt->bytes_sent_per_step();
      return Fn([opt, params] { opt->step(); });
    });
    for (auto _ : state) ranks.run();
    state.counters["sent_bytes_per_rank"] = static_cast<double>(sent_per_rank[0]);
    state.counters["state_bytes_per_rank"] = static_cast<double>(state_per_rank[0]);
  });
  auto* replicated = benchmark::RegisterBenchmark((op + "/replicated/" + set).c_str(), [=](benchmark::State& state) {
    std::vector<std::int64_t> state_per_rank(world);
    Ranks ranks(world, [&](int rank, const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
      auto params = std::make_shared<std::vector<torch::Tensor>>(make_params(rank));
      // The grads as views of one flat buffer, all-reduced at once (DDP's best case: one bucket).
      auto flat = std::make_shared<torch::Tensor>(torch::empty({kTensors * kNumel}));
      for (std::int64_t i = 0; i < kTensors; ++i) {
        auto view = flat->narrow(0, i * kNumel, kNumel);
        view.copy_((*params)[i].grad());
        (*params)[i].mutable_grad() = view;
      }
      auto opt = std::make_shared<ampfuse::FusedAdam>(*params, torch_opts, fused);
      opt->step();
      state_per_rank[rank] = state_bytes(*opt);
      return Fn([opt, params, flat, group, world] {
        std::vector<torch::Tensor> buffer{*flat};
        group->allreduce(buffer)->wait();
        flat->div_(world);
        opt->step();
      });
    });
    for (auto _ : state) ranks.run();
    state.counters["sent_bytes_per_rank"] = sent;
    state.counters["state_bytes_per_rank"] = static_cast<double>(state_per_rank[0]);
  });
  for (auto* b : {zero, replicated}) {
    b->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(0.5);
    add_fastest_statistic(b);  // as register_one does
  }
}

}  // namespace

void register_zero(torch::Device device) {
  if (!device.is_cpu()) return;  // Gloo on CPU; NCCL rows belong to a GPU check
  for (const bool eight_bit : {false, true})
    for (int world : {2, 4}) register_world(world, eight_bit);
}

}  // namespace ampfuse_bench
