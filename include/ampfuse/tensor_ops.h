#pragma once
// Multi-tensor operations on lists of LibTorch tensors: the engine's first
// users, and what GradScaler builds on.
//
// Accepted tensors: strided, dtype float32, float16, bfloat16 or float64
// (computed in fp64), all on one device (CPU, or one CUDA device). Dense ones (contiguous, or any
// permutation of a contiguous layout, such as a transposed matrix or
// channels-last) are read and written where they are; a view with gaps
// (t.slice(1, 0, 5)), as ATen's foreach ops accept it, is read and written
// where it is on CPU when its runs of adjacent elements hold 128 elements or
// more (one kernel tensor per run), else through a dense copy, written back
// after an in-place op; an in-place op refuses a view
// whose elements share memory (an expanded view), as ATen does. A ZeroTensor
// is read as the zeros it stands for, and refused where it would be written
// (as ATen refuses it). Anything
// else is refused with an error naming the tensor and the problem, before
// anything is written. Zero-element tensors are allowed and skipped.
// make_list_views (the lists of an optimizer, updated together) takes dense
// tensors only.

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Optional.h>

#include <string>
#include <vector>

#include "ampfuse/multi_tensor.h"

namespace ampfuse {

/// Read-only pass over `tensors`: sets found_inf (fp32, one element, same
/// device) to 1 when any element is inf or NaN, and leaves it as it was
/// otherwise, so one found_inf can gather several calls. When `sum_sq` (fp32
/// or fp64, one element, same device) is given, adds the sum of the squares
/// of all elements to it, accumulated in fp64 and reduced in an order that
/// does not depend on the number of threads (fp64 avoids overflow when the
/// tensors are scaled gradients). No host synchronization on CUDA.
void check_non_finite(at::TensorList tensors, const at::Tensor& found_inf,
                      const c10::optional<at::Tensor>& sum_sq = c10::nullopt);

/// In place: every element x becomes x * scale, computed in fp32 and rounded
/// to the storage type (round to nearest even). `scale` is an fp32 tensor of
/// one element on the tensors' device; it is read on the device, never
/// copied to the host. Moves each tensor's version counter, as mul_ does, so
/// that autograd refuses a backward through a tensor it saved before.
void scale_(at::TensorList tensors, const at::Tensor& scale);

/// Checks `lists` (depth lists of equal length; the tensors at one position
/// with one shape) and returns their views. `names` names each list in errors
/// ("param", "grad", ...); `op` names the caller. Throws c10::Error naming the
/// list, position and problem.
TensorListsView make_list_views(const std::vector<at::TensorList>& lists, const std::vector<std::string>& names,
                                const char* op);

/// The CPU instruction set the kernels use here: "avx512", "avx2" or "baseline".
std::string cpu_isa();

/// Elements per CPU work chunk (the unit that threads share out).
std::int64_t cpu_chunk_size();

/// In place, in one pass: found_inf = 1 when any element is inf or NaN (left
/// alone otherwise), and every element x becomes x * inv_scale (fp32 math,
/// round to nearest even; fp64 math for fp64 tensors). The semantics, and
/// for the same inputs the bits, of
/// at::_amp_foreach_non_finite_check_and_unscale_, on CPU and CUDA, for
/// fp32, fp16 and bf16 alike, except two: on CPU subnormal inputs and
/// results (below 2^-126; fp16's are normal fp32 numbers) are read and written
/// as zero unless sdk::cpu::keep_subnormals(true) (docs/engine.md), and a
/// NaN's payload is not kept (a signalling NaN comes out quiet).
void unscale_(at::TensorList tensors, const at::Tensor& found_inf, const at::Tensor& inv_scale);

/// The dtype ampfuse uses for a torch dtype; throws for anything but fp32/fp16/bf16/fp64.
ScalarType to_scalar_type(c10::ScalarType t);

}  // namespace ampfuse
