// The README's example, compiled and run by CI (ctest: readme_example).
#include <ampfuse/ampfuse.h>
#include <torch/torch.h>

#include <iostream>

struct Batch {
  torch::Tensor x, y;
};

int main() {
  torch::manual_seed(0);
  std::vector<Batch> batches;
  for (int i = 0; i < 20; ++i) batches.push_back({torch::randn({32, 64}), torch::randn({32, 64})});

  // --- README example begins ---
  torch::nn::Linear model(64, 64);
  // Drop-in for torch::optim::Adam: same options, groups and checkpoints; one fused pass.
  ampfuse::FusedAdam optimizer(model->parameters(), torch::optim::AdamOptions(1e-3));
  ampfuse::GradScaler scaler;  // init_scale 65536, growth 2, backoff 0.5, interval 2000

  for (auto& [x, y] : batches) {
    optimizer.zero_grad();
    auto loss = torch::mse_loss(model->forward(x), y);  // forward in fp16/bf16 for mixed precision
    scaler.scale(loss).backward();           // scaled, so small fp16 grads do not underflow
    scaler.clip_grad_norm_(optimizer, 1.0);  // optional: one read-only pass, grads not rewritten
    scaler.step(optimizer);                  // unscale, clip, skip on inf/NaN: in the same pass, no sync
    scaler.update();                         // back off on inf, grow after 2000 clean steps
    if (scaler.last_step_skipped(optimizer)) { /* e.g. hold the lr scheduler */ }
  }
  torch::save(scaler, "scaler.pt");          // state_dict keys named as PyTorch names them
  torch::save(optimizer, "adam.pt");         // loads into torch::optim::Adam too
  // --- README example ends ---

  std::cout << "scale " << scaler.get_scale() << "\n";
  return scaler.get_scale() == 65536.0 ? 0 : 1;
}
