#pragma once
// The engine ops on lists that make_list_views has already checked (the
// GradScaler checks every device's grads before its first write, then runs
// these, so that a list is checked once per step, not twice).

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/Optional.h>

#include <string>
#include <vector>

#include "ampfuse/multi_tensor.h"

namespace ampfuse::detail {

/// make_list_views of one list given by pointers (the grads of an optimizer's
/// parameters, not copied into a TensorList), named `name` in errors.
TensorListsView make_views(const std::vector<const at::Tensor*>& tensors, const std::string& name, const char* op);

/// ampfuse::check_non_finite on checked views of one device.
void check_non_finite(const TensorListsView& views, c10::Device device, const at::Tensor& found_inf,
                      const c10::optional<at::Tensor>& sum_sq = c10::nullopt);

/// ampfuse::scale_ (found_inf null) or ampfuse::unscale_ on checked views of one device.
void scale(const TensorListsView& views, c10::Device device, const at::Tensor& scale, const at::Tensor* found_inf);

}  // namespace ampfuse::detail
