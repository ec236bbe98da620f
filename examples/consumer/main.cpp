// Uses the installed headers and library: a GradScaler step with FusedAdam.
#include <ampfuse/ampfuse.h>
#include <torch/torch.h>

#include <iostream>

int main() {
  auto w = torch::randn({8, 8}, torch::requires_grad());
  ampfuse::FusedAdam adam(std::vector<torch::Tensor>{w}, torch::optim::AdamOptions(1e-2));
  ampfuse::GradScaler scaler;
  const auto before = w.detach().clone();
  scaler.scale(w.square().sum()).backward();
  scaler.step(adam);
  scaler.update();
  const bool moved = !torch::equal(before, w.detach());
  std::cout << "consumer: installed ampfuse stepped: " << (moved ? "yes" : "no") << ", cpu isa "
            << ampfuse::cpu_isa() << "\n";
  return moved ? 0 : 1;
}
