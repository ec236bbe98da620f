// Mixed-precision (fp16) training with ampfuse, as a program to start from.
//
// An MLP learns a fixed random "teacher" network from generated data. On
// CUDA the model stays fp32 and runs its forward under LibTorch's autocast
// (fp16 matmuls); on CPU, where LibTorch has no fp16 autocast, the model
// itself is fp16 and FusedAdam keeps fp32 master weights and moments. GradScaler
// scales the loss so that small fp16 grads do not underflow, clips the grad
// norm, and skips steps whose grads overflowed. Halfway through, everything
// is checkpointed, rebuilt from scratch, loaded and resumed.
//
// With --moments-8bit, FusedAdam keeps the moments of the two larger weight
// matrices in 8-bit blocks (FusedAdamOptions::moments_8bit); --compare-8bit
// trains twice, 32-bit moments then 8-bit, from the same start, and checks
// that the 8-bit run's final loss is at most MAX_REL (relative) above the
// 32-bit run's (lower passes: on this task 8-bit moments ended 1-10% lower
// over 600-1500 steps).
//
//   train_amp [--steps N] [--check MAX_FINAL_LOSS] [--moments-8bit | --compare-8bit MAX_REL]
#include <ATen/autocast_mode.h>
#include <ampfuse/ampfuse.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "examples/flags.h"

namespace {

constexpr int64_t kIn = 32, kHidden = 256, kOut = 8;
constexpr int64_t kTrainSize = 8192, kTestSize = 1024, kBatch = 128;
constexpr int64_t kWarmup = 50;  // updates of linear lr warmup, then cosine decay
constexpr double kPeakLr = 2e-3, kMaxGradNorm = 1.0;
const std::string kCheckpoint = "train_amp_checkpoint.pt";

// fp16 autocast where LibTorch has it (CUDA); elsewhere a half model with fp32 master weights.
bool use_autocast(torch::Device device) { return device.is_cuda(); }

// The forward pass in fp16: autocast casts matmul inputs to fp16 on CUDA, for this scope.
struct Fp16Forward {
  explicit Fp16Forward(torch::Device device) : on(use_autocast(device)) {
    if (!on) return;
    at::autocast::set_autocast_dtype(at::kCUDA, at::kHalf);
    at::autocast::set_autocast_enabled(at::kCUDA, true);
  }
  ~Fp16Forward() {
    if (!on) return;
    at::autocast::set_autocast_enabled(at::kCUDA, false);
    at::autocast::clear_cache();  // the fp16 copies of the weights made in this forward
  }
  bool on;
};

torch::nn::Sequential make_model(torch::Device device) {
  torch::nn::Sequential model(torch::nn::Linear(kIn, kHidden), torch::nn::GELU(),
                              torch::nn::Linear(kHidden, kHidden), torch::nn::GELU(),
                              torch::nn::Linear(kHidden, kOut));
  model->to(device, use_autocast(device) ? torch::kFloat : torch::kHalf);
  return model;
}

// Everything training state consists of; built from scratch again on resume.
struct Trainer {
  Trainer(torch::Device device, bool moments_8bit)
      : model(make_model(device)),
        // fp16 params get fp32 master weights and moments: in fp16, updates smaller than half an
        // ulp would be rounded away. (Under autocast the params are fp32 already.)
        optimizer(model->parameters(), torch::optim::AdamOptions(kPeakLr),
                  ampfuse::FusedAdamOptions().master_weights(!use_autocast(device)).moments_8bit(moments_8bit)),
        // Short growth interval so that the scale probes upward and an overflow now and then shows.
        scaler(ampfuse::GradScalerOptions().growth_interval(100)) {}
  torch::nn::Sequential model;
  ampfuse::FusedAdam optimizer;
  ampfuse::GradScaler scaler;
  int64_t step = 0;     // batches consumed: decides the data order
  int64_t updates = 0;  // steps actually applied: decides the lr
  int64_t skipped = 0;
};

// The lr schedule is a function of applied updates, so it resumes from one saved number.
double lr_at(int64_t updates, int64_t total) {
  if (updates < kWarmup) return kPeakLr * (updates + 1) / kWarmup;
  double progress = std::min(1.0, double(updates - kWarmup) / std::max<int64_t>(1, total - kWarmup));
  return kPeakLr * (0.05 + 0.95 * 0.5 * (1.0 + std::cos(std::acos(-1.0) * progress)));
}

void save_checkpoint(Trainer& t, const std::string& path) {
  torch::serialize::OutputArchive all, model, optimizer, scaler;
  t.model->save(model);
  t.optimizer.save(optimizer);  // moments, step counters and the fp32 master weights
  t.scaler.save(scaler);        // scale and growth tracker: without them a resume restarts at 65536
  all.write("model", model);
  all.write("optimizer", optimizer);
  all.write("scaler", scaler);
  all.write("counters", torch::tensor({t.step, t.updates, t.skipped}));
  all.save_to(path);
}

void load_checkpoint(Trainer& t, const std::string& path, torch::Device device) {
  torch::serialize::InputArchive all, model, optimizer, scaler;
  all.load_from(path, device);
  all.read("model", model);
  all.read("optimizer", optimizer);
  all.read("scaler", scaler);
  t.model->load(model);  // into the existing parameters, which the optimizer already holds
  t.optimizer.load(optimizer);
  t.scaler.load(scaler);
  torch::Tensor counters;
  all.read("counters", counters);
  t.step = counters[0].item<int64_t>();
  t.updates = counters[1].item<int64_t>();
  t.skipped = counters[2].item<int64_t>();
}

struct Data {
  torch::Tensor x_train, y_train, x_test, y_test;
};

// Inputs and the outputs of a fixed random teacher net, normalized so that predicting 0 scores ~1.
Data make_data(torch::Device device) {
  torch::manual_seed(0);
  torch::nn::Sequential teacher(torch::nn::Linear(kIn, 64), torch::nn::Tanh(), torch::nn::Linear(64, kOut));
  torch::NoGradGuard no_grad;
  auto x = torch::randn({kTrainSize + kTestSize, kIn});
  auto y = teacher->forward(x);
  y = (y - y.mean(0)) / y.std(0);
  // Inputs in the model's dtype (autocast casts them itself); targets stay fp32: the loss is fp32.
  x = x.to(device, use_autocast(device) ? torch::kFloat : torch::kHalf), y = y.to(device);
  return {x.slice(0, 0, kTrainSize), y.slice(0, 0, kTrainSize), x.slice(0, kTrainSize), y.slice(0, kTrainSize)};
}

double evaluate(Trainer& t, const Data& d) {
  torch::NoGradGuard no_grad;
  torch::Tensor out;
  {
    const Fp16Forward fp16(d.x_test.device());
    out = t.model->forward(d.x_test);
  }
  return torch::mse_loss(out.to(torch::kFloat), d.y_test).item<double>();
}

// Trains until t.step == until, drawing a one-line progress bar.
void train(Trainer& t, const Data& d, int64_t until, int64_t total) {
  constexpr int64_t kPerEpoch = kTrainSize / kBatch;
  for (; t.step < until; ++t.step) {
    // The epoch's shuffle comes from the epoch number, so a resumed run sees the same batches.
    auto epoch_rng = at::make_generator<at::CPUGeneratorImpl>(/*seed=*/t.step / kPerEpoch);
    auto order = torch::randperm(kTrainSize, epoch_rng, torch::kLong);
    auto idx = order.slice(0, t.step % kPerEpoch * kBatch, (t.step % kPerEpoch + 1) * kBatch).to(d.x_train.device());

    for (auto& group : t.optimizer.param_groups()) group.options().set_lr(lr_at(t.updates, total));
    t.optimizer.zero_grad();
    torch::Tensor out;
    {
      const Fp16Forward fp16(d.x_train.device());
      out = t.model->forward(d.x_train.index_select(0, idx));
    }
    auto loss = torch::mse_loss(out.to(torch::kFloat), d.y_train.index_select(0, idx));  // fp32 loss
    t.scaler.scale(loss).backward();  // scaled, so that small fp16 grads do not flush to zero
    t.scaler.clip_grad_norm_(t.optimizer, kMaxGradNorm);  // on the unscaled norm; applied inside step
    t.scaler.step(t.optimizer);  // skipped (weights untouched) when a grad is inf/NaN
    t.scaler.update();           // halve the scale on inf/NaN, double it after 100 clean steps
    // Advance the lr only on applied steps: a skipped step changed nothing; counting it would cut warmup short.
    if (t.scaler.last_step_skipped(t.optimizer)) ++t.skipped; else ++t.updates;

    if ((t.step + 1) % 10 == 0 || t.step + 1 == until) {  // item() syncs with the device: not every step
      constexpr int kWidth = 24;
      int filled = int(kWidth * (t.step + 1) / total);
      std::printf("\repoch %2lld step %4lld/%lld [%s%s] loss %.4f  scale %-11g skipped %lld ",
                  (long long)(t.step / kPerEpoch + 1), (long long)(t.step + 1), (long long)total,
                  std::string(filled, '#').c_str(), std::string(kWidth - filled, '.').c_str(),
                  loss.item<double>(), t.scaler.get_scale(), (long long)t.skipped);
      std::fflush(stdout);
    }
  }
  std::printf("\n");
}

// Trains `steps` steps with a checkpoint and resume halfway; the final held-out loss, or NaN on failure.
double train_and_resume(torch::Device device, const Data& data, int64_t steps, bool moments_8bit) {
  auto start = std::chrono::steady_clock::now();
  torch::manual_seed(1);
  auto trainer = std::make_unique<Trainer>(device, moments_8bit);
  double initial = evaluate(*trainer, data);
  std::printf("training on %s, held-out loss %.4f\n", device.str().c_str(), initial);

  // First half, then a checkpoint, as if the job were preempted here.
  train(*trainer, data, steps / 2, steps);
  save_checkpoint(*trainer, kCheckpoint);
  double before = evaluate(*trainer, data), scale_before = trainer->scaler.get_scale();

  // Fresh objects (another seed: their initial weights differ), then everything comes from the checkpoint.
  torch::manual_seed(2);
  trainer = std::make_unique<Trainer>(device, moments_8bit);
  load_checkpoint(*trainer, kCheckpoint, device);
  std::filesystem::remove(kCheckpoint);  // a test leaves nothing behind; a real run would keep it
  if (evaluate(*trainer, data) != before || trainer->scaler.get_scale() != scale_before) {
    std::fprintf(stderr, "FAIL: the resumed model or scaler differs from the saved one\n");
    return std::nan("");
  }
  std::printf("resumed at step %lld (%lld updates applied, scale %g)\n", (long long)trainer->step,
              (long long)trainer->updates, trainer->scaler.get_scale());

  train(*trainer, data, steps, steps);
  double final_loss = evaluate(*trainer, data);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("done (%s moments): %lld steps in %.1f s, held-out loss %.4f -> %.4f, %lld skipped steps, final scale %g\n",
              moments_8bit ? "8-bit" : "32-bit", (long long)steps, seconds, initial, final_loss,
              (long long)trainer->skipped, trainer->scaler.get_scale());
  return final_loss;
}

}  // namespace

int main(int argc, char** argv) {
  using ampfuse_examples::number;
  using ampfuse_examples::whole_number;
  int64_t steps = 1000;
  double check = -1;        // < 0: no check
  double compare_8bit = -1;  // < 0: train once
  bool moments_8bit = false;
  bool usage = false;  // an unknown flag, a missing or malformed number
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--steps" && i + 1 < argc) usage |= !whole_number(argv[++i], steps);
    else if (arg == "--check" && i + 1 < argc) usage |= !number(argv[++i], check);
    else if (arg == "--moments-8bit") moments_8bit = true;
    else if (arg == "--compare-8bit" && i + 1 < argc) usage |= !number(argv[++i], compare_8bit);
    else usage = true;
  }
  if (usage || steps < 2) {
    std::fprintf(stderr, "usage: %s [--steps N>=2] [--check MAX_FINAL_LOSS] [--moments-8bit | --compare-8bit MAX_REL]\n",
                 argv[0]);
    return 2;
  }

  torch::Device device = torch::cuda::is_available() ? torch::kCUDA : torch::kCPU;
  // Matrices this small gain nothing from intra-op threads, and on a busy machine threads that
  // wait for each other cost far more than they share out: one thread.
  if (device.is_cpu()) torch::set_num_threads(1);
  Data data = make_data(device);

  double final_loss = train_and_resume(device, data, steps, moments_8bit && compare_8bit < 0);
  if (compare_8bit >= 0) {
    const double loss_32 = final_loss;
    final_loss = train_and_resume(device, data, steps, /*moments_8bit=*/true);
    const double rel = (final_loss - loss_32) / loss_32;
    std::printf("8-bit moments: final loss %.5f against %.5f with 32-bit moments (%+.2f%%)\n", final_loss, loss_32,
                100.0 * (final_loss - loss_32) / loss_32);
    if (!(rel <= compare_8bit)) {
      std::fprintf(stderr, "FAIL: 8-bit moments end %.2f%% above 32-bit ones; at most %.2f%% allowed\n", 100 * rel,
                   100 * compare_8bit);
      return 1;
    }
  }
  if (check >= 0 && !(std::isfinite(final_loss) && final_loss <= check)) {
    std::fprintf(stderr, "FAIL: final loss %g is not below --check %g\n", final_loss, check);
    return 1;
  }
  return 0;
}
