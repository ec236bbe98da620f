// Where each param group's params() lies, as a step plan keeps it, and a walk
// over the parameters of every group by flat index (their order in a step):
// how a kept plan's per-step comparison (an optimizer's match_plan, the
// GradScaler's grads_plan) reaches parameter k of its range without a list
// of every parameter made per step.
#pragma once

#include <torch/optim/optimizer.h>

#include <cstddef>
#include <utility>
#include <vector>

namespace ampfuse::sdk {

/// Each group's params(): data() and size() (PlanKeys::groups).
using GroupSpans = std::vector<std::pair<const void*, std::size_t>>;

inline GroupSpans group_spans(const torch::optim::Optimizer& opt) {
  GroupSpans spans;
  spans.reserve(opt.param_groups().size());
  for (const auto& group : opt.param_groups()) spans.emplace_back(group.params().data(), group.params().size());
  return spans;
}

/// Whether opt's groups are as many as `spans` and each group's params() is
/// where and as long as it was: then `spans` reaches every parameter.
inline bool same_spans(const torch::optim::Optimizer& opt, const GroupSpans& spans) {
  const auto& groups = opt.param_groups();
  if (groups.size() != spans.size()) return false;
  for (std::size_t g = 0; g < groups.size(); ++g)
    if (groups[g].params().data() != spans[g].first || groups[g].params().size() != spans[g].second) return false;
  return true;
}

inline std::size_t span_total(const GroupSpans& spans) {
  std::size_t total = 0;
  for (const auto& span : spans) total += span.second;
  return total;
}

/// The parameters of `spans` from flat index k on (k below span_total, or
/// equal to it for an empty walk that never reads), group by group, empty
/// groups skipped. Valid while same_spans holds.
class FlatParams {
 public:
  FlatParams(const GroupSpans& spans, std::size_t k) : spans_(&spans) {
    while (g_ < spans.size() && k >= spans[g_].second) k -= spans[g_++].second;
    i_ = k;
  }
  const at::Tensor& operator*() const { return static_cast<const at::Tensor*>((*spans_)[g_].first)[i_]; }
  /// To the next flat index.
  void advance() {
    if (++i_ < (*spans_)[g_].second) return;
    i_ = 0;
    do ++g_;
    while (g_ < spans_->size() && (*spans_)[g_].second == 0);
  }
  /// The current parameter's group, and its index in the group.
  std::size_t group() const { return g_; }
  std::size_t index() const { return i_; }

 private:
  const GroupSpans* spans_;
  std::size_t g_ = 0, i_ = 0;
};

}  // namespace ampfuse::sdk
