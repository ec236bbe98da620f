#include "ampfuse/contract.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

namespace ampfuse {
namespace {

// A device named without an index ("cuda") means the current one, as for
// tensor options; tensors always carry the index, so the signals are keyed by
// it (and CPU tensors by "cpu", never "cpu:0"). Where the current device
// cannot be asked (no such backend, or no GPU), the device stays as named: a
// query then answers "absent" instead of throwing.
c10::Device concrete(c10::Device device) {
  if (device.is_cpu()) return c10::Device(c10::kCPU);
  if (device.has_index() || !c10::impl::hasDeviceGuardImpl(device.type())) return device;
  try {
    return {device.type(), c10::impl::getDeviceGuardImpl(device.type())->getDevice().index()};
  } catch (const c10::Error&) {
    return device;
  }
}

}  // namespace

void StepSignals::set(c10::Device device, ScaleSignal signal) {
  device = concrete(device);
  for (auto& [d, s] : signals_) {
    if (d == device) {
      s = std::move(signal);
      return;
    }
  }
  signals_.emplace_back(device, std::move(signal));
}

const ScaleSignal& StepSignals::at(c10::Device device) const {
  device = concrete(device);
  for (const auto& [d, s] : signals_)
    if (d == device) return s;
  TORCH_CHECK(false, "ampfuse::StepSignals: no scale signal for device ", device,
              "; the scaler saw no grads there (were the grads moved after scaler.scale()?)");
}

bool StepSignals::contains(c10::Device device) const {
  device = concrete(device);
  for (const auto& entry : signals_)
    if (entry.first == device) return true;
  return false;
}

}  // namespace ampfuse
