#include "ampfuse/contract.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <atomic>

namespace ampfuse {

// Tensors always carry the index, so a device named without one is resolved
// to the current one; without a GPU a query then answers "absent" instead of
// throwing.
c10::Device canonical_device(c10::Device device) {
  if (device.is_cpu()) return c10::Device(c10::kCPU);
  if (device.has_index() || !c10::impl::hasDeviceGuardImpl(device.type())) return device;
  try {
    return {device.type(), c10::impl::getDeviceGuardImpl(device.type())->getDevice().index()};
  } catch (const c10::Error&) {
    return device;
  }
}

void StepSignals::set(c10::Device device, ScaleSignal signal) {
  device = canonical_device(device);
  for (auto& [d, s] : signals_) {
    if (d == device) {
      s = std::move(signal);
      return;
    }
  }
  signals_.emplace_back(device, std::move(signal));
}

const ScaleSignal& StepSignals::at(c10::Device device) const {
  device = canonical_device(device);
  for (const auto& [d, s] : signals_)
    if (d == device) return s;
  TORCH_CHECK(false, "ampfuse::StepSignals: no scale signal for device ", device,
              "; the scaler saw no grads there (were the grads moved after scaler.scale()?)");
}

bool StepSignals::contains(c10::Device device) const {
  device = canonical_device(device);
  for (const auto& entry : signals_)
    if (entry.first == device) return true;
  return false;
}

std::uint64_t new_grads_id() {
  static std::atomic<std::uint64_t> last{0};
  return last.fetch_add(1, std::memory_order_relaxed) + 1;
}

}  // namespace ampfuse
