#pragma once
// The engine ops on lists that make_list_views has already checked (the
// GradScaler checks every device's grads before its first write, then runs
// these, so that a list is checked once per step, not twice).

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/Optional.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ampfuse/multi_tensor.h"

namespace ampfuse::detail {

struct CpuGroups;

/// One checked list: its views, and the tensors that are not dense (views
/// with gaps) and whose runs of adjacent elements are short, each with the
/// dense copy its view points to. On CPU a tensor with gaps between long
/// runs has a view per run instead (`split`): views are then not one per tensor.
struct CheckedList {
  TensorListsView views;
  std::vector<std::pair<at::Tensor, at::Tensor>> staged;  ///< (original, dense copy)
  bool split = false;                                     ///< some tensor has a view per run
  /// On CPU: the list's dtype groups, each with its chunk plan and pointer
  /// array, made by the first op on the list and reused by the next ones
  /// (the GradScaler keeps a checked list while its grads are unchanged).
  mutable std::shared_ptr<const CpuGroups> cpu_groups;

  /// After an in-place op: copies each dense copy back into its original.
  void write_back() const;
};

/// Checks one list given by pointers (the grads of an optimizer's
/// parameters, not copied into a TensorList), named `name` in errors, and
/// returns its views. A strided tensor that is not dense is staged through a
/// dense copy (for in_place ops, one whose elements share memory is refused).
CheckedList make_views(const std::vector<const at::Tensor*>& tensors, const std::string& name, const char* op,
                       bool in_place);

/// Whether a strided tensor's strides alone show that no two of its
/// elements share memory: ordered by stride, each stride passes the furthest
/// offset the smaller ones reach (so every slice, transpose and permutation
/// passes; a dimension of stride 0 and more than one element fails).
bool strides_never_overlap(c10::IntArrayRef sizes, c10::IntArrayRef strides);

/// ampfuse::sdk::runs_of_param (ampfuse/sdk/optimizer.h).
bool runs_of_param(const at::Tensor& p, std::int64_t tensor, std::vector<PlanRun>* runs);

/// dst.copy_(src) on CPU, where one of them has gaps between long runs of
/// adjacent elements that the other holds adjacent too (a column slice and a
/// dense copy of it): a memcpy per run, on ATen's threads. Same sizes and
/// dtype, no negative or conjugate bit, dst not overlapping itself. False,
/// copying nothing, where that does not hold (copy_ then).
bool copy_by_runs(const at::Tensor& dst, const at::Tensor& src);

/// After the data pointers of some of `list`'s views were changed (tensors
/// replaced by others that pass the same checks): the CPU pointer array kept
/// with the list follows them, or is dropped to be made again.
void views_moved(const CheckedList& list);

/// ampfuse::check_non_finite on a checked list of one device.
void check_non_finite(const CheckedList& list, c10::Device device, const at::Tensor& found_inf,
                      const c10::optional<at::Tensor>& sum_sq = c10::nullopt);

/// ampfuse::scale_ (found_inf null) or ampfuse::unscale_ on a checked list of one device. `scale`
/// is fp32 of one element, or on CPU fp64 too (the GradScaler's deferred factors).
void scale(const CheckedList& list, c10::Device device, const at::Tensor& scale, const at::Tensor* found_inf);

/// The factor a signal's grads are multiplied by, for `scale`: inv_scale *
/// clip_coef in fp64 (exact), rounded once by the kernel as the contract
/// path's kernels round it (24 bits also below 2^-126, where an fp32 product
/// would keep fewer); the one of them that is defined, in fp64; undefined
/// when neither is. On their device: no host sync.
at::Tensor grad_factor_f64(const at::Tensor& inv_scale, const at::Tensor& clip_coef);

}  // namespace ampfuse::detail
