#include "ampfuse/contract.h"

#include <c10/util/Exception.h>

namespace ampfuse {

void StepSignals::set(c10::Device device, ScaleSignal signal) {
  for (auto& [d, s] : signals_) {
    if (d == device) {
      s = std::move(signal);
      return;
    }
  }
  signals_.emplace_back(device, std::move(signal));
}

const ScaleSignal& StepSignals::at(c10::Device device) const {
  for (const auto& [d, s] : signals_)
    if (d == device) return s;
  TORCH_CHECK(false, "ampfuse::StepSignals: no scale signal for device ", device,
              "; the scaler saw no grads there (were the grads moved after scaler.scale()?)");
}

bool StepSignals::contains(c10::Device device) const {
  for (const auto& entry : signals_)
    if (entry.first == device) return true;
  return false;
}

}  // namespace ampfuse
