// Data-parallel mixed-precision training on several processes, with the
// optimizer state sharded across them (ZeRO stage 2), as a program to start
// from. Start it with launch.sh (or torchrun's variables):
//
//   examples/train_ddp/launch.sh 2 build/tests/train_ddp [--steps N] [--check MAX_FINAL_LOSS]
//
// Every rank holds the whole fp16 model (an MLP learning a fixed random
// teacher, as examples/train_amp) and a different slice of each batch. The
// ZeroOptimizer reduce-scatters the grads (averaged: data parallelism) into
// each rank's shard, FusedAdam updates the shard (fp32 master weights and
// moments for 1/world of the parameters per rank), and the parameters are
// all-gathered. GradScaler scales the loss, clips by the global norm and
// skips a step on every rank when any rank's grads overflow. Halfway,
// everything is checkpointed (the model once, each rank its optimizer shard),
// rebuilt from scratch and resumed.
#include <ampfuse/ampfuse.h>
#include <ampfuse/zero.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "examples/flags.h"

namespace {

constexpr int64_t kIn = 32, kHidden = 256, kOut = 8;
constexpr int64_t kTrainSize = 8192, kTestSize = 1024, kBatch = 128;  // the global batch, split across ranks
constexpr double kLr = 2e-3, kMaxGradNorm = 1.0;

using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

torch::nn::Sequential make_model() {
  torch::nn::Sequential model(torch::nn::Linear(kIn, kHidden), torch::nn::GELU(),
                              torch::nn::Linear(kHidden, kHidden), torch::nn::GELU(),
                              torch::nn::Linear(kHidden, kOut));
  model->to(torch::kHalf);  // CPU: no fp16 autocast in LibTorch, so the model itself is fp16
  return model;
}

struct Trainer {
  Trainer(const Group& group, uint64_t seed) : model((torch::manual_seed(seed), make_model())) {
    // Every rank starts from rank 0's weights: the ZeroOptimizer broadcasts
    // them as it moves the parameters into its buckets (ZeroOptions::init_sync).
    optimizer = ampfuse::distributed::ZeroOptimizer::make<ampfuse::FusedAdam>(
        model->parameters(), torch::optim::AdamOptions(kLr), group, ampfuse::distributed::ZeroOptions(),
        ampfuse::FusedAdamOptions().master_weights(true));
  }
  torch::nn::Sequential model;
  std::unique_ptr<ampfuse::distributed::ZeroOptimizer> optimizer;
  // No process group needed: the ZeroOptimizer names its own, and the scaler sums across it.
  ampfuse::GradScaler scaler{ampfuse::GradScalerOptions().growth_interval(100)};
  int64_t step = 0, skipped = 0;
};

// Each rank's checkpoint file, named by the launch's port as well: two
// launches in one directory at once (ctest -j) write files of their own.
std::string checkpoint(int rank) {
  static const std::string launch = std::to_string(ampfuse::distributed::launch_env().master_port);
  return "train_ddp_" + launch + "_rank" + std::to_string(rank) + ".pt";
}

void save_checkpoint(Trainer& t, int rank) {
  torch::serialize::OutputArchive all, model, optimizer, scaler;
  if (rank == 0) t.model->save(model);  // the same on every rank: saved once
  t.optimizer->save(optimizer);         // this rank's shard: moments, steps, master weights
  t.scaler.save(scaler);
  all.write("model", model);
  all.write("optimizer", optimizer);
  all.write("scaler", scaler);
  all.write("counters", torch::tensor({t.step, t.skipped}));
  all.save_to(checkpoint(rank));
}

void load_checkpoint(Trainer& t, int rank) {
  torch::serialize::InputArchive mine, first, model, optimizer, scaler;
  mine.load_from(checkpoint(rank));
  first.load_from(checkpoint(0));
  first.read("model", model);
  t.model->load(model);  // into the parameters the optimizer holds (views of its buckets)
  mine.read("optimizer", optimizer);
  t.optimizer->load(optimizer);
  mine.read("scaler", scaler);
  t.scaler.load(scaler);
  torch::Tensor counters;
  mine.read("counters", counters);
  t.step = counters[0].item<int64_t>();
  t.skipped = counters[1].item<int64_t>();
}

struct Data {
  torch::Tensor x_train, y_train, x_test, y_test;
};

Data make_data() {
  torch::manual_seed(0);
  torch::nn::Sequential teacher(torch::nn::Linear(kIn, 64), torch::nn::Tanh(), torch::nn::Linear(64, kOut));
  torch::NoGradGuard no_grad;
  auto x = torch::randn({kTrainSize + kTestSize, kIn});
  auto y = teacher->forward(x);
  y = (y - y.mean(0)) / y.std(0);
  x = x.to(torch::kHalf);
  return {x.slice(0, 0, kTrainSize), y.slice(0, 0, kTrainSize), x.slice(0, kTrainSize), y.slice(0, kTrainSize)};
}

double evaluate(Trainer& t, const Data& d) {
  torch::NoGradGuard no_grad;
  return torch::mse_loss(t.model->forward(d.x_test).to(torch::kFloat), d.y_test).item<double>();
}

void train(Trainer& t, const Data& d, int64_t until, int rank, int world) {
  constexpr int64_t kPerEpoch = kTrainSize / kBatch;
  const int64_t local = kBatch / world;
  for (; t.step < until; ++t.step) {
    // The same shuffle on every rank (from the epoch number); each takes its slice of the batch.
    auto rng = at::make_generator<at::CPUGeneratorImpl>(/*seed=*/t.step / kPerEpoch);
    auto order = torch::randperm(kTrainSize, rng, torch::kLong);
    const int64_t first = t.step % kPerEpoch * kBatch + rank * local;
    auto idx = order.slice(0, first, first + local);

    t.optimizer->zero_grad();
    auto out = t.model->forward(d.x_train.index_select(0, idx));
    auto loss = torch::mse_loss(out.to(torch::kFloat), d.y_train.index_select(0, idx));
    t.scaler.scale(loss).backward();
    t.scaler.clip_grad_norm_(*t.optimizer, kMaxGradNorm);  // reduce-scatter, then the global norm
    t.scaler.step(*t.optimizer);  // the shard's update, then the all-gather; skipped on every rank together
    t.scaler.update();
    if (t.scaler.last_step_skipped(*t.optimizer)) ++t.skipped;
    if (rank == 0 && ((t.step + 1) % 50 == 0 || t.step + 1 == until))
      std::printf("step %4lld  rank 0 batch loss %.4f  scale %-8g skipped %lld\n", (long long)(t.step + 1),
                  loss.item<double>(), t.scaler.get_scale(), (long long)t.skipped);
  }
}

// Every rank must hold the same parameters: each rank's checksum, all-gathered.
bool ranks_agree(Trainer& t, const Group& group) {
  double sum = 0;
  for (const auto& p : t.model->parameters()) sum += p.detach().to(torch::kDouble).abs().sum().item<double>();
  auto mine = torch::tensor({sum}, torch::kDouble);
  auto all = torch::empty({group->getSize()}, torch::kDouble);
  group->_allgather_base(all, mine)->wait();
  return (all == sum).all().item<bool>();
}

}  // namespace

int main(int argc, char** argv) {
  using ampfuse_examples::number;
  using ampfuse_examples::whole_number;
  int64_t steps = 600;
  double check = -1;  // < 0: no check
  bool usage = false;  // an unknown flag, a missing or malformed number
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--steps" && i + 1 < argc) usage |= !whole_number(argv[++i], steps);
    else if (arg == "--check" && i + 1 < argc) usage |= !number(argv[++i], check);
    else usage = true;
  }
  if (usage || steps < 2) {
    std::fprintf(stderr, "usage: launch.sh N %s [--steps N>=2] [--check MAX_FINAL_LOSS]\n", argv[0]);
    return 2;
  }
  try {
    const auto env = ampfuse::distributed::launch_env();
    const Group group = ampfuse::distributed::init_process_group(env, /*cuda=*/false, std::chrono::seconds(60));
    const int rank = env.rank, world = env.world_size;
    if (kBatch % world != 0) throw std::runtime_error("the world size must divide the batch of 128");
    torch::set_num_threads(1);  // small matrices, one process per core
    const Data data = make_data();

    auto trainer = std::make_unique<Trainer>(group, /*seed=*/1);
    const double initial = evaluate(*trainer, data);
    if (rank == 0)
      std::printf("%d ranks, %lld parameters, optimizer state for %lld per rank, %lld bytes sent per rank per step\n",
                  world, (long long)trainer->optimizer->parameters().size(),
                  (long long)trainer->optimizer->shard_numel(),
                  (long long)trainer->optimizer->bytes_sent_per_step());

    train(*trainer, data, steps / 2, rank, world);
    save_checkpoint(*trainer, rank);
    const double before = evaluate(*trainer, data);
    group->barrier()->wait();  // every file written before anyone reads rank 0's

    trainer = std::make_unique<Trainer>(group, /*seed=*/2);  // other weights: everything must come from the files
    load_checkpoint(*trainer, rank);
    group->barrier()->wait();
    std::filesystem::remove(checkpoint(rank));  // a test leaves nothing behind; a real run would keep them
    if (evaluate(*trainer, data) != before) throw std::runtime_error("the resumed model differs from the saved one");
    if (rank == 0) std::printf("resumed at step %lld\n", (long long)trainer->step);

    train(*trainer, data, steps, rank, world);
    const double final_loss = evaluate(*trainer, data);
    const bool agree = ranks_agree(*trainer, group);
    group->barrier()->wait();
    std::printf("rank %d: held-out loss %.4f -> %.4f, %lld skipped steps, ranks %s\n", rank, initial, final_loss,
                (long long)trainer->skipped, agree ? "agree" : "DIFFER");
    if (!agree) return 1;
    if (check >= 0 && !(std::isfinite(final_loss) && final_loss <= check)) {
      std::fprintf(stderr, "FAIL: final loss %g is not below --check %g\n", final_loss, check);
      return 1;
    }
    return 0;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s\n", e.what_without_backtrace());  // the message, not LibTorch's stack
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
