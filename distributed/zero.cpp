// ZeroOptimizer (ampfuse/zero.h): flat buckets per (dtype, device), grads
// reduce-scattered into this rank's shard, the wrapped optimizer stepping
// the rank's pieces, parameters all-gathered.

#include "ampfuse/zero.h"

#include "ampfuse/fused_adagrad.h"
#include "ampfuse/fused_adam.h"
#include "ampfuse/fused_lamb.h"
#include "ampfuse/fused_rmsprop.h"
#include "ampfuse/fused_sgd.h"
#include "ampfuse/sdk/optimizer.h"
#include "contract/torch/tensor_ops_views.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <c10/util/Type.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <string_view>
#include <typeindex>
#include <typeinfo>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace ampfuse::distributed {

namespace {

constexpr const char* kWhere = "ampfuse::distributed::ZeroOptimizer: ";
// Every parameter starts on a 64-byte boundary of its bucket, and shards are
// whole multiples of it, so that pieces start aligned wherever they can.
constexpr std::int64_t kAlignBytes = 64;
// A parameter of at least kBlockFrom elements starts on a kBlockElements
// boundary of its bucket, and a bucket holding one has shards of whole
// kBlockElements: its pieces then start at multiples of kBlockElements from
// the parameter's first element, so that blockwise state (FusedAdam's 8-bit
// moments, 256-element blocks for tensors of 4096 elements or more) is cut
// into the whole parameter's blocks at every world size.
constexpr std::int64_t kBlockFrom = 4096;
constexpr std::int64_t kBlockElements = 256;
// Folded into the layout hash when a parameter has kBlockFrom elements or
// more: sharded checkpoints of the earlier layout rule (no block alignment)
// are then refused rather than read at the wrong offsets.
constexpr std::int64_t kLayoutRule = 2;

std::int64_t round_up(std::int64_t n, std::int64_t m) { return (n + m - 1) / m * m; }

// Where a parameter of `numel` elements of `element_size` bytes starts in its bucket, after `end`.
std::int64_t start_of(std::int64_t end, std::int64_t numel, std::int64_t element_size) {
  return round_up(end, numel >= kBlockFrom ? kBlockElements : kAlignBytes / element_size);
}

// The elements of each of `world` shards of a bucket of `total` elements.
std::int64_t shard_of(std::int64_t total, int world, std::int64_t element_size, bool has_blocks) {
  return round_up((total + world - 1) / world, has_blocks ? kBlockElements : kAlignBytes / element_size);
}

std::uint64_t fnv(std::uint64_t h, std::int64_t v) {
  for (int i = 0; i < 8; ++i) {
    h ^= static_cast<std::uint64_t>(v >> (8 * i)) & 0xffu;
    h *= 1099511628211ull;
  }
  return h;
}

std::string describe(const at::Tensor& p) {
  std::ostringstream out;
  out << p.scalar_type() << " " << p.sizes() << " on " << p.device();
  return out.str();
}

// An error's message, without c10's backtrace.
std::string message_of(const std::exception& e) {
  const auto* c10 = dynamic_cast<const c10::Error*>(&e);
  return c10 ? c10->what_without_backtrace() : e.what();
}

// Runs a collective and waits for it; an error (a timeout, a rank that
// left) is rethrown naming what was being done and what every rank must do.
template <class F>
void collective(const c10d::ProcessGroup& group, const char* what, F&& start) {
  try {
    start()->wait();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, kWhere, what, ": rank ", group.getRank(), " of ", group.getSize(),
                ": the collective failed (every rank must construct the optimizer with the same parameters and "
                "call step(), reduce_grads() and each load together): ",
                message_of(e));
  }
}

}  // namespace

// One (dtype, device): the parameters' values and grads, flat, cut into
// `world` shards of `shard` elements each.
struct ZeroOptimizer::Bucket {
  std::int64_t shard = 0;
  bool all_reduce = false;  // ZeroCollectives::kAllReduceBroadcast for this bucket
  at::Tensor flat_param;   // world * shard elements; the parameters are views of it
  at::Tensor flat_grad;    // the grads, gathered here for the reduce-scatter; padding stays zero
  at::Tensor shard_param;  // flat_param's part of this rank
  at::Tensor shard_grad;   // the reduced grads of this rank's part (with all_reduce: flat_grad's part)
  std::vector<std::size_t> members;      // indices into params_
  std::vector<std::int64_t> offsets;     // each member's first element in the flat tensors
  std::vector<at::Tensor> param_views;   // flat_param's part of each member, in its shape
  std::vector<at::Tensor> grad_views;    // flat_grad's part of each member, in its shape
  at::Tensor divided;  // a reduce-scatter without AVG (Gloo): flat_grad / world, the collective's input
};

// One of this rank's pieces: the wrapped optimizer's param_groups()[group]
// .params()[index], part of params_[param]; `grad` is its part of the
// bucket's shard_grad.
struct ZeroOptimizer::Piece {
  std::size_t group;
  std::size_t index;
  std::size_t param;
  at::Tensor grad;
};

struct ZeroOptimizer::Layout {
  c10::intrusive_ptr<c10d::ProcessGroup> process_group;
  ZeroOptions options;
  CopyOptions copy_options;
  std::unique_ptr<torch::optim::Optimizer> inner;
  std::vector<at::Tensor> params;
  std::vector<Bucket> buckets;
  std::vector<Piece> pieces;
  std::int64_t layout_hash = 0;
  std::int64_t run_id = 0;
  std::vector<std::size_t> group_sizes;
  std::vector<std::size_t> param_bucket;
  std::vector<std::int64_t> param_offset;
};

// The part of parameter `param` in a rank's shard: elements [lo, hi) of it.
struct ZeroOptimizer::Span {
  std::size_t param;
  std::int64_t lo;
  std::int64_t hi;
};

namespace {

// Where each parameter came from, for error messages.
struct Place {
  std::size_t group;
  std::size_t index;
};

// Whether a bucket holds a parameter whose pieces are cut at block boundaries.
bool has_blocks(const ZeroOptimizer::Bucket& b, const std::vector<at::Tensor>& params) {
  return std::any_of(b.members.begin(), b.members.end(), [&](std::size_t i) { return params[i].numel() >= kBlockFrom; });
}

std::string name_of(const Place& place) {
  return "group " + std::to_string(place.group) + ", parameter " + std::to_string(place.index);
}

// "group g, parameter j" of the k-th parameter in group order.
std::string param_name(const std::vector<std::size_t>& group_sizes, std::size_t k) {
  std::size_t g = 0;
  while (g + 1 < group_sizes.size() && k >= group_sizes[g]) k -= group_sizes[g++];
  return name_of(Place{g, k});
}

// Every rank must have parameters of the same groups, shapes, dtypes and
// devices in the same order. Each rank hashes its own per parameter; the
// ranks all-gather [groups, parameters] and then the hashes, and every rank
// names the first one that differs.
std::int64_t check_same_parameters(c10d::ProcessGroup& group, const std::vector<std::vector<at::Tensor>>& groups,
                                   const std::vector<Place>& places, const std::vector<at::Tensor>& params,
                                   c10::Device device) {
  const int world = group.getSize();
  const auto i64 = at::TensorOptions().dtype(at::kLong).device(device);
  const std::vector<std::int64_t> my_counts = {static_cast<std::int64_t>(groups.size()),
                                               static_cast<std::int64_t>(params.size())};
  at::Tensor counts = at::tensor(my_counts, at::kLong).to(device);
  at::Tensor all_counts = at::empty({world * 2}, i64);
  collective(group, "checking that every rank has the same parameters",
             [&] { return group._allgather_base(all_counts, counts); });
  const at::Tensor counts_cpu = all_counts.cpu();
  for (int r = 0; r < world; ++r)
    TORCH_CHECK(counts_cpu[2 * r].item<std::int64_t>() == static_cast<std::int64_t>(groups.size()) &&
                    counts_cpu[2 * r + 1].item<std::int64_t>() == static_cast<std::int64_t>(params.size()),
                kWhere, "rank ", group.getRank(), " has ", groups.size(), " parameter groups and ", params.size(),
                " parameters, rank ", r, " has ", counts_cpu[2 * r].item<std::int64_t>(), " and ",
                counts_cpu[2 * r + 1].item<std::int64_t>(),
                ": every rank must pass parameters of the same shapes, dtypes and devices in the same order");
  std::vector<std::int64_t> hashes;
  std::uint64_t whole = 1469598103934665603ull;
  std::size_t k = 0;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    whole = fnv(whole, static_cast<std::int64_t>(groups[g].size()));
    for (std::size_t j = 0; j < groups[g].size(); ++j, ++k) {
      const at::Tensor& p = params[k];
      std::uint64_t h = fnv(1469598103934665603ull, static_cast<std::int64_t>(g));  // its group, too
      h = fnv(h, static_cast<std::int64_t>(p.scalar_type()));
      h = fnv(h, static_cast<std::int64_t>(p.device().type()));
      h = fnv(h, p.dim());
      for (const auto s : p.sizes()) h = fnv(h, s);
      hashes.push_back(static_cast<std::int64_t>(h));
      whole = fnv(whole, static_cast<std::int64_t>(h));
    }
  }
  if (hashes.empty()) return static_cast<std::int64_t>(whole);
  at::Tensor mine = at::tensor(hashes, at::kLong).to(device);
  at::Tensor all = at::empty({world * static_cast<std::int64_t>(hashes.size())}, i64);
  collective(group, "checking that every rank has the same parameters",
             [&] { return group._allgather_base(all, mine); });
  const at::Tensor all_cpu = all.cpu().view({world, static_cast<std::int64_t>(hashes.size())});
  const auto* a = all_cpu.data_ptr<std::int64_t>();
  for (std::size_t i = 0; i < hashes.size(); ++i)
    for (int r = 0; r < world; ++r)
      TORCH_CHECK(a[r * static_cast<std::int64_t>(hashes.size()) + static_cast<std::int64_t>(i)] == hashes[i], kWhere,
                  name_of(places[i]), " differs between rank ", group.getRank(), " (here: ", describe(params[i]),
                  ") and rank ", r,
                  ": every rank must pass parameters in the same groups, of the same shapes, dtypes and devices in "
                  "the same order");
  return static_cast<std::int64_t>(whole);
}

// A group's lr, or none where its options type has none (the base's get_lr,
// which throws: remembered per type, so that a step does not throw and catch
// once per group; a get_lr that throws is taken to throw for its type alone).
std::optional<double> lr_of(const torch::optim::OptimizerOptions& o) {
  thread_local std::unordered_set<std::type_index> without_lr;
  if (without_lr.count(std::type_index(typeid(o))) != 0) return std::nullopt;
  try {
    return o.get_lr();
  } catch (const std::exception&) {
    without_lr.insert(std::type_index(typeid(o)));
    return std::nullopt;
  }
}

// The options a step reads from a group, as (name, value), appended to
// `out`: every option of LibTorch's Adam, AdamW, SGD, Adagrad and RMSprop
// options and of FusedLAMB's (an LR scheduler sets the lr; a one-cycle
// schedule also cycles momentum or betas, a weight-decay schedule the
// decay); the lr alone for other types (no serialization per step), or
// where only the lr reaches the wrapped optimizer (`every` false: a factory
// without CopyOptions).
using StepFields = std::vector<std::pair<const char*, c10::IValue>>;
void step_fields(const torch::optim::OptimizerOptions& o, bool every, StepFields& out) {
  using namespace torch::optim;
  if (!every) {
    if (const auto lr = lr_of(o)) out.emplace_back("lr", *lr);
    return;
  }
  const auto pair = [](const std::tuple<double, double>& b) { return c10::IValue(b); };
  const auto adam = [&](const auto& a) {  // (AdamOptions and AdamWOptions: the same fields, unrelated types)
    out.insert(out.end(), {{"lr", a.lr()}, {"betas", pair(a.betas())}, {"eps", a.eps()},
                           {"weight_decay", a.weight_decay()}, {"amsgrad", a.amsgrad()}});
  };
  if (const auto* a = dynamic_cast<const AdamOptions*>(&o)) {
    adam(*a);
  } else if (const auto* w = dynamic_cast<const AdamWOptions*>(&o)) {
    adam(*w);
  } else if (const auto* g = dynamic_cast<const SGDOptions*>(&o)) {
    out.insert(out.end(), {{"lr", g->lr()}, {"momentum", g->momentum()}, {"dampening", g->dampening()},
                           {"weight_decay", g->weight_decay()}, {"nesterov", g->nesterov()}});
  } else if (const auto* d = dynamic_cast<const AdagradOptions*>(&o)) {
    out.insert(out.end(), {{"lr", d->lr()}, {"lr_decay", d->lr_decay()}, {"weight_decay", d->weight_decay()},
                           {"initial_accumulator_value", d->initial_accumulator_value()}, {"eps", d->eps()}});
  } else if (const auto* r = dynamic_cast<const RMSpropOptions*>(&o)) {
    out.insert(out.end(), {{"lr", r->lr()}, {"alpha", r->alpha()}, {"eps", r->eps()},
                           {"weight_decay", r->weight_decay()}, {"momentum", r->momentum()},
                           {"centered", r->centered()}});
  } else if (const auto* l = dynamic_cast<const FusedLAMBOptions*>(&o)) {
    out.insert(out.end(), {{"lr", l->lr()}, {"betas", pair(l->betas())}, {"eps", l->eps()},
                           {"weight_decay", l->weight_decay()}, {"bias_correction", l->bias_correction()},
                           {"grad_averaging", l->grad_averaging()}, {"max_grad_norm", l->max_grad_norm()},
                           {"use_nvlamb", l->use_nvlamb()}, {"trust_ratio_min", l->trust_ratio_min()},
                           {"trust_ratio_max", l->trust_ratio_max()}, {"master_weights", l->master_weights()}});
  } else if (const auto lr = lr_of(o)) {
    out.emplace_back("lr", *lr);
  }
}

// A group's options as LibTorch serializes them (OptimizerOptions::
// serialize, which LibTorch's options types and ampfuse's implement), read
// back as (key, value) pairs; where a type does not serialize (a third
// party's may not), its lr alone (get_lr), if it has one.
std::vector<std::pair<std::string, c10::IValue>> options_fields(const torch::optim::OptimizerOptions& o) {
  std::vector<std::pair<std::string, c10::IValue>> fields;
  try {
    fields = sdk::saved_fields(o);
  } catch (const std::exception&) {
  }
  if (!fields.empty()) return fields;
  if (const auto lr = lr_of(o)) fields.emplace_back("lr", *lr);
  return fields;
}

// The options ampfuse's optimizers take beside their groups' (maximize,
// master weights, the moments' format), which change how every shard steps.
std::vector<std::pair<std::string, c10::IValue>> fused_fields(const torch::optim::Optimizer& opt) {
  const auto adam = [](const FusedAdamOptions& f) -> std::vector<std::pair<std::string, c10::IValue>> {
    return {{"maximize", f.maximize()},
            {"master_weights", f.master_weights()},
            {"bf16_moments", f.bf16_moments()},
            {"moments_8bit", f.moments_8bit()},
            {"capturable", f.capturable()}};
  };
  if (const auto* o = dynamic_cast<const FusedAdam*>(&opt)) return adam(o->fused_options());
  if (const auto* o = dynamic_cast<const FusedAdamW*>(&opt)) return adam(o->fused_options());
  if (const auto* o = dynamic_cast<const FusedSGD*>(&opt)) return {{"maximize", o->fused_options().maximize()}};
  if (const auto* o = dynamic_cast<const FusedAdagrad*>(&opt)) return {{"maximize", o->fused_options().maximize()}};
  if (const auto* o = dynamic_cast<const FusedRMSprop*>(&opt)) return {{"maximize", o->fused_options().maximize()}};
  return {};
}

std::uint64_t fnv_string(std::uint64_t h, std::string_view s) {
  for (const char c : s) h = fnv(h, static_cast<unsigned char>(c));
  return fnv(h, static_cast<std::int64_t>(s.size()));
}

// A value's hash: numbers by their bits, tuples and lists by their
// elements, tensors by their bytes; other kinds by their kind alone.
std::uint64_t hash_value(std::uint64_t h, const c10::IValue& v) {
  h = fnv_string(h, v.tagKind());
  if (v.isDouble()) {
    double x = v.toDouble() == 0.0 ? 0.0 : v.toDouble();  // -0 as 0: the same step
    if (std::isnan(x)) x = std::numeric_limits<double>::quiet_NaN();  // one NaN, whatever its payload
    std::int64_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    return fnv(h, bits);
  }
  if (v.isInt()) return fnv(h, v.toInt());
  if (v.isBool()) return fnv(h, v.toBool() ? 1 : 0);
  if (v.isString()) return fnv_string(h, v.toStringRef());
  if (v.isTuple())
    for (const c10::IValue& e : v.toTupleRef().elements()) h = hash_value(h, e);
  if (v.isList())
    for (const c10::IValue& e : v.toListRef()) h = hash_value(h, e);
  if (v.isTensor() && v.toTensor().defined()) {
    const at::Tensor t = v.toTensor().cpu().contiguous();
    h = fnv(h, static_cast<std::int64_t>(t.scalar_type()));
    for (const auto d : t.sizes()) h = fnv(h, d);
    const auto* b = static_cast<const unsigned char*>(t.const_data_ptr());
    for (std::size_t i = 0; i < t.nbytes(); ++i) h = fnv(h, b[i]);
  }
  return h;
}

// A value as a message shows it: numbers (a one-element tensor's too) as
// they read back exactly (the shortest such digits), tuples and lists by
// their elements.
std::string value_text(const c10::IValue& v) {
  if (v.isTensor() && v.toTensor().defined() && v.toTensor().numel() == 1)
    return value_text(v.toTensor().cpu().to(at::kDouble).item<double>());
  if (v.isDouble()) {
    char digits[32];
    const auto end = std::to_chars(digits, digits + sizeof digits, v.toDouble()).ptr;
    return std::string(digits, end);
  }
  if (v.isInt()) return std::to_string(v.toInt());
  if (v.isBool()) return v.toBool() ? "true" : "false";
  if (v.isNone()) return "None";
  if (v.isString()) return v.toStringRef();
  if (v.isTuple() || v.isList()) {
    std::string text = v.isTuple() ? "(" : "[";
    const auto elements = v.isTuple() ? v.toTupleRef().elements().vec() : v.toListRef().vec();
    for (std::size_t i = 0; i < elements.size(); ++i) text += (i ? ", " : "") + value_text(elements[i]);
    return text + (v.isTuple() ? ")" : "]");
  }
  return "a " + v.tagKind();
}

std::string options_text(const std::vector<std::pair<std::string, c10::IValue>>& fields) {
  if (fields.empty()) return "options that do not serialize";
  std::string text;
  for (std::size_t i = 0; i < fields.size(); ++i)
    text += (i ? ", " : "") + fields[i].first + "=" + value_text(fields[i].second);
  return text;
}

// Every rank's wrapped optimizer must step its shards with the same options
// (an lr given to the factory on one rank alone would otherwise make the
// ranks' shards of one parameter take different steps, silently): each rank
// hashes its optimizer's type and the options ampfuse's optimizers take
// beside the groups' (fused_fields), then each group's options; the ranks
// all-gather the hashes, and every rank names the first that differs, with
// its own values.
void check_same_options(c10d::ProcessGroup& group, const torch::optim::Optimizer& inner, c10::Device device) {
  const int world = group.getSize();
  const auto& groups = inner.param_groups();
  if (world == 1) return;
  std::vector<std::vector<std::pair<std::string, c10::IValue>>> fields;
  fields.push_back(fused_fields(inner));
  fields.front().emplace_back("type", c10::demangle(typeid(inner).name()));
  for (const auto& g : groups) fields.push_back(options_fields(g.options()));
  std::vector<std::int64_t> hashes;
  for (const auto& f : fields) {
    std::uint64_t h = 1469598103934665603ull;
    for (const auto& [key, value] : f) h = hash_value(fnv_string(h, key), value);
    hashes.push_back(static_cast<std::int64_t>(h));
  }
  const auto n = static_cast<std::int64_t>(hashes.size());
  at::Tensor mine = at::tensor(hashes, at::kLong).to(device);
  at::Tensor all = at::empty({world * n}, mine.options());
  collective(group, "checking that every rank has the same options",
             [&] { return group._allgather_base(all, mine); });
  const at::Tensor all_cpu = all.cpu();
  const auto* a = all_cpu.data_ptr<std::int64_t>();
  for (std::int64_t i = 0; i < n; ++i)
    for (int r = 0; r < world; ++r)
      TORCH_CHECK(a[r * n + i] == a[i], kWhere,
                  i == 0 ? std::string("the wrapped optimizers differ") : c10::str("group ", i - 1, "'s options differ"),
                  " between rank 0 and rank ", r, " (rank ", group.getRank(), " has ",
                  options_text(fields[static_cast<std::size_t>(i)]),
                  "): every rank must make its wrapped optimizer of the same type with the same options; nothing "
                  "was changed on any rank");
}

}  // namespace

namespace {

bool has_cpu_backend(const c10d::ProcessGroup& group) {
  const auto types = group.getDeviceTypes();
  return std::any_of(types.begin(), types.end(), [](const c10::Device& d) { return d.is_cpu(); });
}

// Every rank learns whether any rank refused (one flag per rank) and the
// sum of `flags` (may be null) over the ranks, in one all-reduce: on the CPU
// where the group has a CPU backend (Gloo beside NCCL, as
// init_process_group makes it: the flags are the host's, and reading back a
// CUDA all-reduce would be a host sync), else on `device`. Throws on every
// rank when one refused: its own refusal on that rank, naming the first
// rank that refused (followed by `refused_what`) on the others.
void agree_across(c10d::ProcessGroup& group, bool on_cpu, c10::Device device, const std::string& refusal,
                  std::vector<std::int32_t>* flags, const char* doing, const std::string& refused_what) {
  const int world = group.getSize(), rank = group.getRank();
  const std::size_t n = flags ? flags->size() : 0;
  std::vector<std::int32_t> all(n + static_cast<std::size_t>(world), 0);
  if (flags) std::copy(flags->begin(), flags->end(), all.begin());
  all[n + static_cast<std::size_t>(rank)] = refusal.empty() ? 0 : 1;
  if (world > 1) {
    std::vector<at::Tensor> buffer{at::tensor(all, at::kInt).to(on_cpu ? c10::Device(c10::kCPU) : device)};
    collective(group, doing, [&] { return group.allreduce(buffer); });
    const at::Tensor summed = buffer[0].cpu();
    std::copy_n(summed.data_ptr<std::int32_t>(), all.size(), all.begin());
  }
  TORCH_CHECK(refusal.empty(), refusal);
  for (int r = 0; r < world; ++r)
    TORCH_CHECK(all[n + static_cast<std::size_t>(r)] == 0, kWhere, "rank ", r, " of ", world, " ", refused_what);
  if (flags) std::copy_n(all.begin(), n, flags->begin());
}

}  // namespace

namespace {

// A run id as two 31-bit halves, the high one odd (a stamp is never 0).
void new_run_id(std::int32_t* halves) {
  std::random_device device;
  std::mt19937_64 bits((static_cast<std::uint64_t>(device()) << 32) ^ device() ^
                       static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  halves[0] = static_cast<std::int32_t>(bits() & 0x7FFFFFFFu) | 1;
  halves[1] = static_cast<std::int32_t>(bits() & 0x7FFFFFFFu);
}
std::int64_t run_id_of(const std::int32_t* halves) { return (static_cast<std::int64_t>(halves[0]) << 32) | halves[1]; }

}  // namespace

std::shared_ptr<ZeroOptimizer::Layout> ZeroOptimizer::build(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                                                            c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                                                            const Factory& make_inner, CopyOptions copy_options,
                                                            ZeroOptions options) {
  TORCH_CHECK(process_group, kWhere, "the process group is null");
  TORCH_CHECK(make_inner, kWhere, "no factory for the wrapped optimizer");
  auto layout = std::make_shared<Layout>();
  layout->process_group = process_group;
  layout->options = options;
  layout->copy_options = std::move(copy_options);
  const int world = process_group->getSize();
  const int rank = process_group->getRank();

  // Validate every parameter before anything moves.
  std::vector<std::vector<at::Tensor>> groups;
  std::vector<Place> places;
  std::vector<std::string> sharing;  // parameters whose memory another tensor holds too
  std::unordered_map<const c10::TensorImpl*, std::size_t> first_place;  // each parameter's first place
  std::vector<at::Tensor>& params = layout->params;
  for (std::size_t g = 0; g < param_groups.size(); ++g) {
    groups.push_back(param_groups[g].params());
    for (std::size_t j = 0; j < groups.back().size(); ++j) {
      const at::Tensor& p = groups.back()[j];
      const Place place{g, j};
      TORCH_CHECK(p.defined(), kWhere, name_of(place), " is undefined");
      TORCH_CHECK(p.layout() == at::kStrided, kWhere, name_of(place), " is ", p.layout(),
                  ": only dense (strided) parameters can be moved into a bucket");
      TORCH_CHECK(p.is_leaf(), kWhere, name_of(place), " is not a leaf tensor (can't optimize a non-leaf Tensor)");
      TORCH_CHECK(at::isFloatingType(p.scalar_type()), kWhere, name_of(place), " is ", p.scalar_type(),
                  ": parameters must be floating point");
      const auto [first, fresh] = first_place.emplace(p.unsafeGetTensorImpl(), places.size());
      TORCH_CHECK(fresh, kWhere, name_of(place), " is the same tensor as ", name_of(places[first->second]));
      // Another tensor on this memory (the larger tensor a slice was taken
      // from, or a view of the parameter) keeps today's values once the
      // parameter moves: nothing to refuse (the parameter itself steps as
      // it would in place), but worth saying once everything has passed.
      if (p.numel() > 0 && p.has_storage() && p.storage().use_count() > 1) sharing.push_back(name_of(place));
      params.push_back(p);
      places.push_back(place);
    }
  }
  // Parameters that share memory (tied or overlapping views) would be untied
  // by moving each into its bucket. A parameter whose own elements share
  // memory (an expanded view) moves as a dense copy: nothing to refuse.
  std::vector<const at::Tensor*> tensors;
  for (const at::Tensor& p : params) tensors.push_back(&p);
  sdk::find_shared_memory(tensors, [&](std::size_t x, std::size_t y) {
    TORCH_CHECK(x == y, kWhere, name_of(places[y]), " shares memory with ", name_of(places[x]),
                " (tied or overlapping views): moving each into its bucket would untie them; pass the tied tensor "
                "once");
  });
  const c10::Device check_device = params.empty() ? c10::Device(c10::kCPU) : params.front().device();
  layout->layout_hash = check_same_parameters(*process_group, groups, places, params, check_device);
  // Layouts that the block rule moved are not those of earlier sharded checkpoints.
  if (std::any_of(params.begin(), params.end(), [](const at::Tensor& p) { return p.numel() >= kBlockFrom; }))
    layout->layout_hash = static_cast<std::int64_t>(fnv(static_cast<std::uint64_t>(layout->layout_hash), kLayoutRule));

  // Buckets per (dtype, device), in the order of first appearance.
  std::map<std::pair<int, std::string>, std::size_t> bucket_of;
  std::vector<std::size_t> param_bucket(params.size());
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto key = std::make_pair(static_cast<int>(params[i].scalar_type()), params[i].device().str());
    auto it = bucket_of.find(key);
    if (it == bucket_of.end()) {
      it = bucket_of.emplace(key, layout->buckets.size()).first;
      layout->buckets.emplace_back();
    }
    Bucket& b = layout->buckets[it->second];
    const std::int64_t end = b.members.empty() ? 0 : b.offsets.back() + params[b.members.back()].numel();
    b.offsets.push_back(start_of(end, params[i].numel(), static_cast<std::int64_t>(params[i].element_size())));
    b.members.push_back(i);
    param_bucket[i] = it->second;
  }

  // Each parameter's values into its bucket; the parameters themselves move
  // there (set_data, below) once the wrapped optimizer has been made.
  const at::NoGradGuard no_grad;
  for (Bucket& b : layout->buckets) {
    const at::Tensor& first = params[b.members.front()];
    b.shard = shard_of(b.offsets.back() + params[b.members.back()].numel(), world,
                       static_cast<std::int64_t>(first.element_size()), has_blocks(b, params));
    const auto opts = first.options();
    b.flat_param = at::zeros({b.shard * world}, opts);
    b.flat_grad = at::zeros({b.shard * world}, opts);
    b.all_reduce = options.collectives() == ZeroCollectives::kAllReduceBroadcast ||
                   (options.collectives() == ZeroCollectives::kAuto && first.device().is_cpu());
    b.shard_grad = b.all_reduce ? b.flat_grad.narrow(0, rank * b.shard, b.shard) : at::zeros({b.shard}, opts);
    b.shard_param = b.flat_param.narrow(0, rank * b.shard, b.shard);
    for (std::size_t m = 0; m < b.members.size(); ++m) {
      at::Tensor& p = params[b.members[m]];
      at::Tensor dst = b.flat_param.narrow(0, b.offsets[m], p.numel()).view(p.sizes());
      dst.copy_(p);
      b.param_views.push_back(dst);
      b.grad_views.push_back(b.flat_grad.narrow(0, b.offsets[m], p.numel()).view(p.sizes()));
    }
  }
  // Rank 0's values everywhere, as DDP's constructor broadcasts them (the
  // parameters themselves take them when they move into the buckets, below).
  if (options.init_sync() && world > 1)
    for (Bucket& b : layout->buckets) {
      std::vector<at::Tensor> buffer{b.flat_param};
      c10d::BroadcastOptions opts;
      opts.rootRank = 0;
      collective(*process_group, "taking rank 0's parameters (ZeroOptions::init_sync)",
                 [&] { return process_group->broadcast(buffer, opts); });
    }

  for (const auto& g : groups) layout->group_sizes.push_back(g.size());
  layout->param_bucket = param_bucket;
  layout->param_offset.resize(params.size());
  for (const Bucket& b : layout->buckets)
    for (std::size_t m = 0; m < b.members.size(); ++m) layout->param_offset[b.members[m]] = b.offsets[m];

  // This rank's pieces, grouped as the parameters were.
  std::vector<torch::optim::OptimizerParamGroup> piece_groups;
  std::size_t k = 0;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    std::vector<at::Tensor> pieces;
    for (std::size_t j = 0; j < groups[g].size(); ++j, ++k) {
      const Bucket& b = layout->buckets[param_bucket[k]];
      const std::int64_t offset = layout->param_offset[k];
      const std::int64_t lo = std::max(offset, rank * b.shard);
      const std::int64_t hi = std::min(offset + params[k].numel(), (rank + 1) * b.shard);
      if (hi <= lo) continue;
      layout->pieces.push_back({g, pieces.size(), k, b.shard_grad.narrow(0, lo - rank * b.shard, hi - lo)});
      // The bucket's memory, but a version counter of its own (a view would
      // share the bucket's): the all-gather writes the bucket, and an
      // optimizer that keeps a master copy must not take that for a write
      // from outside. Real writes from outside are passed on at each step
      // (note_writes_from_outside).
      pieces.push_back(at::empty({0}, b.flat_param.options())
                           .set_(b.flat_param.storage(), b.flat_param.storage_offset() + lo, {hi - lo}, {1}));
    }
    // A group none of whose elements is on this rank keeps its place (and
    // its options) with one empty tensor, which every optimizer skips.
    if (pieces.empty() && !groups[g].empty()) pieces.push_back(at::empty({0}, groups[g].front().options()));
    if (param_groups[g].has_options())
      piece_groups.emplace_back(std::move(pieces), param_groups[g].options().clone());
    else
      piece_groups.emplace_back(std::move(pieces));
  }
  // The wrapped optimizer, agreed with the other ranks: a factory that
  // throws on one rank alone (its options refused on this rank's pieces, out
  // of memory) fails every rank's construction, instead of leaving the others
  // to wait in their first step until the timeout.
  std::string refused;
  try {
    layout->inner = make_inner(std::move(piece_groups));
    TORCH_CHECK(layout->inner, kWhere, "the factory returned no optimizer");
    TORCH_CHECK(layout->inner->param_groups().size() == groups.size(), kWhere, "the wrapped optimizer has ",
                layout->inner->param_groups().size(), " parameter groups, expected ", groups.size());
    // State that depends on the whole tensor (FusedAdam's 8-bit moments: the
    // 4096 rule on the whole numel, blocks counted from its first element).
    if (auto* knows = dynamic_cast<sdk::KnowsWholeTensors*>(layout->inner.get())) {
      const auto& inner_groups = layout->inner->param_groups();
      for (const Piece& piece : layout->pieces) {
        const std::int64_t offset = layout->param_offset[piece.param];
        const std::int64_t lo = std::max(offset, rank * layout->buckets[param_bucket[piece.param]].shard);
        knows->set_whole_tensor(inner_groups.at(piece.group).params().at(piece.index),
                                params[piece.param].numel(), lo - offset);
      }
    }
  } catch (const std::exception& e) {
    refused = message_of(e);
  }
  // (A failed construction on every rank, before any parameter moves.) The
  // same all-reduce hands every rank rank 0's run id (the others add 0),
  // which stamps this run's sharded checkpoints: two 31-bit halves, the
  // high one odd, so that a stamp is never 0.
  std::vector<std::int32_t> run(2, 0);
  if (rank == 0) new_run_id(run.data());
  agree_across(*process_group, has_cpu_backend(*process_group), check_device, refused, &run,
               "agreeing that every rank has made its optimizer",
               "could not make its optimizer (its error says why); the parameters were not moved on any rank");
  layout->run_id = run_id_of(run.data());
  check_same_options(*process_group, *layout->inner, check_device);
  // Nothing can fail from here: each parameter becomes a view of its bucket
  // (same TensorImpl, autograd identity and version counter).
  if (!sharing.empty())
    TORCH_WARN(kWhere, c10::Join(", ", sharing), sharing.size() == 1 ? " shares its" : " share their",
               " memory with another tensor (a view of a larger tensor, or one of which a view exists, or one "
               "that autograd keeps): moved into its bucket, a parameter steps as it would in place, but that "
               "tensor keeps the values it has now and no longer follows the parameter");
  for (Bucket& b : layout->buckets)
    for (std::size_t m = 0; m < b.members.size(); ++m) params[b.members[m]].set_data(b.param_views[m]);
  return layout;
}

namespace {
std::vector<torch::optim::OptimizerParamGroup> groups_like(const torch::optim::Optimizer& inner) {
  std::vector<torch::optim::OptimizerParamGroup> out;
  for (const auto& g : inner.param_groups()) out.emplace_back(g.params(), g.options().clone());
  return out;
}
}  // namespace

ZeroOptimizer::ZeroOptimizer(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                             c10::intrusive_ptr<c10d::ProcessGroup> process_group, const Factory& make_inner,
                             CopyOptions copy_options, ZeroOptions options)
    : ZeroOptimizer(build(std::move(param_groups), std::move(process_group), make_inner, std::move(copy_options),
                          options)) {}

ZeroOptimizer::ZeroOptimizer(std::shared_ptr<Layout> layout)
    : torch::optim::Optimizer(groups_like(*layout->inner), layout->inner->defaults().clone()),
      process_group_(std::move(layout->process_group)),
      options_(layout->options),
      copy_options_(std::move(layout->copy_options)),
      inner_(std::move(layout->inner)),
      params_(std::move(layout->params)),
      buckets_(std::move(layout->buckets)),
      pieces_(std::move(layout->pieces)),
      layout_hash_(layout->layout_hash),
      run_id_(layout->run_id),
      group_sizes_(std::move(layout->group_sizes)),
      param_bucket_(std::move(layout->param_bucket)),
      param_offset_(std::move(layout->param_offset)) {
  agree_on_cpu_ = has_cpu_backend(*process_group_);
  record_versions();
  connect_tensor_sums();
}

ZeroOptimizer::~ZeroOptimizer() = default;

// An optimizer whose update needs sums over each whole tensor (FusedLAMB's
// norms) gets them through this: every piece's row is added into its
// parameter's, across the ranks, in one all-reduce per step.
void ZeroOptimizer::connect_tensor_sums() {
  auto* reduces = dynamic_cast<sdk::ReducesTensorSums*>(inner_.get());
  if (!reduces) return;
  auto& groups = inner_->param_groups();
  for (const Piece& piece : pieces_)
    piece_param_[groups.at(piece.group).params().at(piece.index).unsafeGetTensorImpl()] = piece.param;
  reduces->set_tensor_sums_reducer([this](std::vector<sdk::TensorSums>& lists, std::int64_t columns) {
    at::Tensor total = at::zeros({static_cast<std::int64_t>(params_.size()), columns}, at::kDouble);
    std::vector<std::vector<std::int64_t>> rows(lists.size());
    for (std::size_t l = 0; l < lists.size(); ++l) {
      TORCH_CHECK(lists[l].sums.device().is_cpu() && lists[l].sums.size(1) == columns, kWhere,
                  "per-tensor sums must be fp64 [n, ", columns, "] on CPU");
      for (const at::Tensor& p : lists[l].params) {
        const auto it = piece_param_.find(p.unsafeGetTensorImpl());
        TORCH_CHECK(it != piece_param_.end(), kWhere, "per-tensor sums of a tensor that is not one of its pieces");
        rows[l].push_back(static_cast<std::int64_t>(it->second));
      }
      total.index_add_(0, at::tensor(rows[l], at::kLong), lists[l].sums);
    }
    std::vector<at::Tensor> buffer{total};
    collective(*process_group_, "summing per-tensor norms across the shards",
               [&] { return process_group_->allreduce(buffer); });
    for (std::size_t l = 0; l < lists.size(); ++l)
      lists[l].sums.copy_(buffer[0].index_select(0, at::tensor(rows[l], at::kLong)));
  });
}

std::int64_t ZeroOptimizer::shard_numel() const {
  std::int64_t n = 0;
  for (const Bucket& b : buckets_) n += b.shard;
  return n;
}

std::int64_t ZeroOptimizer::bytes_sent_per_step() const {
  std::int64_t n = 0;
  const std::int64_t world = process_group_->getSize();
  for (const Bucket& b : buckets_) {
    const std::int64_t bytes = b.flat_grad.numel() * static_cast<std::int64_t>(b.flat_grad.element_size());
    // Ring reduce-scatter + all-gather: 2 (w-1)/w; ring all-reduce 2 (w-1)/w
    // + w pipelined broadcasts of a shard, about (w-1)/w.
    n += (b.all_reduce ? 3 : 2) * (world - 1) * bytes / world;
  }
  return n;
}

void ZeroOptimizer::zero_grad(bool set_to_none) {
  const at::NoGradGuard no_grad;
  grads_reduced_ = false;  // the grads reduced before are gone: the next step reduces the new ones
  for (const Bucket& b : buckets_)
    for (std::size_t m = 0; m < b.members.size(); ++m) {
      at::Tensor& grad = params_[b.members[m]].mutable_grad();
      if (!grad.defined()) continue;
      if (set_to_none) {
        grad.reset();
      } else if (grad.data_ptr() == b.grad_views[m].data_ptr()) {
        grad.zero_();
      } else {
        b.grad_views[m].zero_();
        grad = b.grad_views[m];  // backward accumulates into the bucket from now on
      }
    }
}

void ZeroOptimizer::add_param_group(const torch::optim::OptimizerParamGroup&) {
  TORCH_CHECK(false, kWhere,
              "add_param_group is not supported: the shards are laid out for the groups given at construction; "
              "make a new ZeroOptimizer with every group (load_consolidated takes a consolidated checkpoint of "
              "this one's state)");
}

// Why this rank cannot step now, found without writing anything (empty: it
// can): a group added since construction (through the base class's
// add_param_group), or a parameter given memory of another shape, dtype or
// device.
std::string ZeroOptimizer::refusal() const {
  if (param_groups().size() != inner_->param_groups().size())
    return c10::str(kWhere, "it has ", param_groups().size(), " parameter groups but was made with ",
                    inner_->param_groups().size(),
                    ": add_param_group is not supported (make a new ZeroOptimizer with every group)");
  for (const Bucket& b : buckets_)
    for (std::size_t m = 0; m < b.members.size(); ++m) {
      const at::Tensor& p = params_[b.members[m]];
      if (p.numel() == 0 || p.data_ptr() == b.param_views[m].data_ptr()) continue;
      if (p.sizes() != b.param_views[m].sizes() || p.scalar_type() != b.param_views[m].scalar_type() ||
          p.device() != b.param_views[m].device())
        return c10::str(kWhere, param_name(group_sizes_, b.members[m]), " was ", describe(b.param_views[m]), " and is now ",
                        describe(p), ": a parameter may get new values, not another shape, dtype or device");
    }
  return {};
}

// Every rank learns whether any rank refused, before any rank writes or
// enters the collectives of the step: a refusal on one rank alone would
// otherwise leave the others waiting in them until the timeout, or pair
// their collectives with that rank's next step (agree_across).
void ZeroOptimizer::agree(const std::string& refusal, std::vector<std::int32_t>* flags, const char* what,
                          const char* doing) const {
  // No bucket (no parameter on any rank: they have the same parameters):
  // nothing to agree with the others about but this rank's own refusal.
  if (buckets_.empty()) {
    TORCH_CHECK(refusal.empty(), refusal);
    return;
  }
  agree_across(*process_group_, agree_on_cpu_, buckets_.front().flat_grad.device(), refusal, flags, doing,
               std::string("refused ") + (what ? what : "the step (its error says why); nothing was written on any rank"));
}

// The step's agreement, which every rank reaches once per step whether it
// refuses or not: each rank's refusal, and a hash of the options set on its
// groups since construction (step_fields: by the user or a scheduler), so
// that ranks whose schedules went apart are refused on every rank before
// anything is written, rather than stepping their shards of one parameter
// with different options. (Construction compared every option it could
// read: all where the options serialize, else the lr.)
void ZeroOptimizer::agree_step(const std::string& refused) const {
  const int world = process_group_->getSize(), rank = process_group_->getRank();
  thread_local StepFields fields;
  thread_local std::vector<std::size_t> group_ends;  // group g's fields end at group_ends[g]
  fields.clear();
  group_ends.clear();
  for (const auto& group : param_groups()) {
    step_fields(group.options(), static_cast<bool>(copy_options_), fields);
    group_ends.push_back(fields.size());
  }
  std::uint64_t h = 1469598103934665603ull;
  for (const auto& [name, value] : fields) h = hash_value(fnv_string(h, name), value);  // (-0 as 0)
  std::vector<std::int32_t> hashes(static_cast<std::size_t>(world), 0);  // rank r's in slot r, the others 0
  hashes[static_cast<std::size_t>(rank)] = static_cast<std::int32_t>((h ^ (h >> 32)) & 0x7FFFFFFFu) | 1;
  agree(refused, &hashes);
  if (buckets_.empty()) return;  // (agreed with no one: no parameters, nothing to step apart)
  for (int r = 1; r < world; ++r)
    if (hashes[static_cast<std::size_t>(r)] != hashes[0]) {
      std::string text;
      for (std::size_t g = 0, f = 0; g < group_ends.size(); ++g) {
        text += (g ? "; group " : "group ") + std::to_string(g) + ":";
        for (const std::size_t first = f; f < group_ends[g]; ++f)
          text += (f == first ? " " : ", ") + std::string(fields[f].first) + "=" + value_text(fields[f].second);
      }
      TORCH_CHECK(false, kWhere, "step: the options set on the parameter groups differ between rank 0 and rank ", r,
                  " (rank ", rank, "'s: ", text,
                  "): set them alike on every rank (an LR scheduler stepped on some ranks only, or given other "
                  "settings?); the step is refused on every rank, and nothing was written");
    }
}

// Whether a parameter's grad is another tensor than when the grads were
// last reduced (set anew without zero_grad): those are reduced again.
bool ZeroOptimizer::grads_replaced_since_reduced() const {
  if (reduced_grads_.size() != params_.size()) return true;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& g = params_[i].grad();
    if (g.unsafeGetTensorImpl() != reduced_grads_[i]._unsafe_get_target()) return true;  // (undefined: the singleton)
  }
  return false;
}

// A parameter given new memory since (torch::nn::Module::load does
// set_(loaded) on each parameter; set_data does the same) is moved back into
// its bucket with its new values, as a write from outside. refusal() has
// checked that each has its bucket's shape, dtype and device.
void ZeroOptimizer::adopt_moved_params() {
  const at::NoGradGuard no_grad;
  for (const Bucket& b : buckets_)
    for (std::size_t m = 0; m < b.members.size(); ++m) {
      at::Tensor& p = params_[b.members[m]];
      if (p.numel() == 0 || p.data_ptr() == b.param_views[m].data_ptr()) continue;
      b.param_views[m].copy_(p);
      p.set_data(b.param_views[m]);
      p.unsafeGetTensorImpl()->bump_version();
    }
}

namespace {

// Whether the group's CUDA collectives run on NCCL, which averages as it
// reduces (ReduceOp::AVG); Gloo refuses AVG.
bool reduces_with_nccl(c10d::ProcessGroup& group) {
  try {
    const auto backend = group.getBackend(c10::DeviceType::CUDA);
    return backend && backend->getBackendName() == "nccl";
  } catch (const c10::Error&) {
    return false;  // no backend for CUDA tensors
  }
}

}  // namespace

void ZeroOptimizer::reduce_grads() {
  const at::NoGradGuard no_grad;
  // Validate every grad, and agree with the other ranks, before the first write.
  std::string refused = refusal();
  std::vector<std::int32_t> has_grad(params_.size(), 0);
  for (const Bucket& b : buckets_)
    for (std::size_t m = 0; m < b.members.size() && refused.empty(); ++m) {
      const std::size_t i = b.members[m];
      const at::Tensor& p = params_[i];
      const at::Tensor& g = p.grad();
      if (!g.defined()) continue;
      if (g.layout() != at::kStrided)
        refused = c10::str(kWhere, param_name(group_sizes_, i), ": its grad is ", g.layout(),
                           "; a sharded optimizer reduces dense grads only");
      else if (g.sizes() != p.sizes() || g.scalar_type() != p.scalar_type() || g.device() != p.device())
        refused = c10::str(kWhere, param_name(group_sizes_, i), " is ", describe(p), " but its grad is ", describe(g));
      has_grad[i] = 1;
    }
  // Which parameters have a grad on any rank: the others are skipped. Or,
  // with skip_params_without_grads(false), which require grad: those on
  // every rank step, those on none are left out, and one frozen on some
  // ranks only is refused on every rank (its shards would part).
  const bool skip = options_.skip_params_without_grads();
  if (!skip)
    for (std::size_t i = 0; i < params_.size(); ++i) has_grad[i] = params_[i].requires_grad() ? 1 : 0;
  agree(refused, &has_grad);
  if (!skip) {
    const int ranks = process_group_->getSize();
    for (std::size_t i = 0; i < params_.size(); ++i)
      TORCH_CHECK(has_grad[i] == 0 || has_grad[i] == ranks, kWhere, param_name(group_sizes_, i),
                  " requires grad on ", has_grad[i], " of ", ranks,
                  " ranks: freeze a parameter on every rank or on none (as DDP requires); nothing was written on "
                  "any rank");
  }
  adopt_moved_params();
  // The mean as DDP takes it, each rank's grad divided by the world size
  // before the sum, so that a sum the grads' dtype cannot hold (fp16 grads
  // above 32768 on two ranks) does not overflow where the mean would not.
  // All-reduce buckets divide while copying a grad in, or in place where the
  // grad already is the bucket's view (every grad then is the bucket's view,
  // holding the ranks' mean, as after DDP); reduce-scatter buckets leave the grads as backward
  // made them: NCCL averages as it reduces (ReduceOp::AVG, which
  // pre-multiplies each rank's part), and Gloo, which has no AVG, reduces a
  // divided copy of the bucket.
  const bool average = options_.average_grads() && process_group_->getSize() > 1;
  const at::Scalar world = static_cast<std::int64_t>(process_group_->getSize());
  for (const Bucket& b : buckets_)
    for (std::size_t m = 0; m < b.members.size(); ++m) {
      const at::Tensor& g = params_[b.members[m]].grad();
      at::Tensor view = b.grad_views[m];  // the same tensor (div_out takes a non-const reference)
      const bool divide = average && b.all_reduce;
      if (!g.defined()) {
        view.zero_();
      } else if (g.data_ptr() == view.data_ptr() && g.is_contiguous()) {
        if (divide) view.div_(world);
      } else if (divide) {
        at::div_out(view, g, world);
      } else {
        view.copy_(g);
      }
    }
  for (Bucket& b : buckets_) {
    if (b.all_reduce) {
      std::vector<at::Tensor> buffer{b.flat_grad};
      collective(*process_group_, "reduce_grads", [&] { return process_group_->allreduce(buffer); });
      // Every grad holds the ranks' mean, as after DDP: a grad that was
      // copied in becomes the bucket's view (as DDP's gradient_as_bucket_view
      // makes it), and so does a missing one where another rank had a grad.
      for (std::size_t m = 0; m < b.members.size(); ++m) {
        at::Tensor& p = params_[b.members[m]];
        if (has_grad[b.members[m]] && !p.grad().is_same(b.grad_views[m])) p.mutable_grad() = b.grad_views[m];
      }
      continue;
    }
    const bool nccl_average = average && b.flat_grad.is_cuda() && reduces_with_nccl(*process_group_);
    // Without AVG, the ranks' parts are divided into a copy kept with the
    // bucket (the grads that are the bucket's views stay as backward made
    // them; kept, so that a backend that only orders streams at wait() does
    // not see it freed).
    at::Tensor* input = &b.flat_grad;
    if (average && !nccl_average) {
      if (!b.divided.defined()) b.divided = at::empty_like(b.flat_grad);
      at::div_out(b.divided, b.flat_grad, world);
      input = &b.divided;
    }
    collective(*process_group_, "reduce_grads", [&] {
      c10d::ReduceScatterOptions opts;
      opts.reduceOp = nccl_average ? c10d::ReduceOp::AVG : c10d::ReduceOp::SUM;
      return process_group_->_reduce_scatter_base(b.shard_grad, *input, opts);
    });
  }
  set_piece_grads(has_grad);
  // Held weakly: a grad freed since (zero_grad) cannot hand its address to
  // the next one, which would then be taken for the grad reduced here.
  reduced_grads_.clear();
  for (const at::Tensor& p : params_) reduced_grads_.emplace_back(p.grad().getIntrusivePtr());
  grads_reduced_ = true;
}

// Each piece's grad is its part of the shard's reduced grads, or none when
// its parameter has no grad on any rank.
void ZeroOptimizer::set_piece_grads(const std::vector<std::int32_t>& has_grad) {
  auto& groups = inner_->param_groups();
  for (const Piece& piece : pieces_) {
    at::Tensor& grad = groups.at(piece.group).params().at(piece.index).mutable_grad();
    if (!has_grad[piece.param]) grad.reset();
    else if (!grad.is_same(piece.grad)) grad = piece.grad;
  }
}

// A parameter written since the last step (weights loaded, a layer
// re-initialized: its version counter moved) has its pieces' versions
// bumped, so that an optimizer keeping a master copy refreshes it from them,
// as it would on one process.
void ZeroOptimizer::note_writes_from_outside() {
  auto& groups = inner_->param_groups();
  for (const Piece& piece : pieces_)
    if (static_cast<std::int64_t>(params_[piece.param]._version()) != versions_[piece.param])
      groups.at(piece.group).params().at(piece.index).unsafeGetTensorImpl()->bump_version();
  record_versions();
}

void ZeroOptimizer::record_versions() {
  versions_.resize(params_.size());
  for (std::size_t i = 0; i < params_.size(); ++i) versions_[i] = static_cast<std::int64_t>(params_[i]._version());
}

void ZeroOptimizer::copy_options_to_inner() const {
  const auto& mine = param_groups();
  auto& theirs = inner_->param_groups();
  for (std::size_t g = 0; g < mine.size(); ++g) {
    if (copy_options_) copy_options_(mine[g].options(), theirs[g].options());
    else if (const auto lr = lr_of(mine[g].options())) theirs[g].options().set_lr(*lr);
  }
}

void ZeroOptimizer::gather_params() {
  const at::NoGradGuard no_grad;
  const int world = process_group_->getSize();
  for (Bucket& b : buckets_) {
    if (!b.all_reduce) {
      collective(*process_group_, "all-gathering the parameters",
                 [&] { return process_group_->_allgather_base(b.flat_param, b.shard_param); });
      continue;
    }
    // Each rank's shard from it, in place.
    for (int r = 0; r < world; ++r) {
      std::vector<at::Tensor> buffer{b.flat_param.narrow(0, r * b.shard, b.shard)};
      c10d::BroadcastOptions opts;
      opts.rootRank = r;
      collective(*process_group_, "gathering the parameters", [&] { return process_group_->broadcast(buffer, opts); });
    }
  }
  record_versions();
  grads_reduced_ = false;
  ++steps_;  // (every step ends here, on every rank: a skipped one too)
}

at::Tensor ZeroOptimizer::step(LossClosure closure) {
  TORCH_CHECK(!closure, kWhere, "step() takes no closure");
  bool reduce = !grads_reduced_;
  if (!reduce) {
    // Reduced since the last step (clip_grad_norm_, say): a grad set anew
    // since then on any rank has every rank reduce again.
    std::vector<std::int32_t> replaced{grads_replaced_since_reduced() ? 1 : 0};
    agree(refusal(), &replaced);
    reduce = replaced[0] != 0;
  }
  if (reduce) reduce_grads();  // which adopts moved parameters first
  else adopt_moved_params();
  copy_options_to_inner();
  note_writes_from_outside();
  step_inner(nullptr);
  gather_params();
  return {};
}

// The wrapped optimizer's step, agreed with the other ranks after it has
// prepared everything and before its first write: what it refuses on this rank's pieces
// alone (a parameter that only this shard holds) every rank refuses,
// before any rank writes or waits in the gather. A wrapped optimizer that
// does not offer ScalerAware::step_checked steps after an agreement that
// only covers what refusal() checks.
void ZeroOptimizer::step_inner(const StepSignals* signals) {
  auto* aware = dynamic_cast<ScalerAware*>(inner_.get());
  bool agreed = false;
  try {
    if (aware && aware->step_checked(signals, [&] {
          agreed = true;
          agree_step({});
        }))
      return;
  } catch (const std::exception& e) {
    if (agreed) throw;  // every rank refuses (or this one failed after the agreement)
    agree_step(message_of(e));
  }
  agree_step({});
  if (signals) aware->step_with_signals(*signals);
  else inner_->step();
}

void ZeroOptimizer::step_with_signals(const StepSignals& signals) {
  TORCH_CHECK(grads_reduced_, kWhere,
              "step_with_signals before reduce_grads(): GradScaler calls prepare_grads() first; "
              "anything else must call reduce_grads()");
  // Agreed once on every rank: here where this rank refuses, else in step_inner.
  const std::string refused = refusal();
  if (!refused.empty()) agree_step(refused);
  adopt_moved_params();
  copy_options_to_inner();
  note_writes_from_outside();
  if (dynamic_cast<ScalerAware*>(inner_.get()) != nullptr) {
    step_inner(&signals);
  } else {
    agree_step({});
    // PyTorch's classic path on the shard: one host read, unscale, step.
    // The GradScaler takes this optimizer for a ScalerAware one, which
    // leaves the grads it read as they were (and unscales them after the
    // step itself, with unscaled_grads_after_step): the shard's grads are
    // unscaled for the wrapped optimizer's step and given back after it.
    double found = 0.0;
    for (const auto& [device, signal] : signals.all()) found += signal.found_inf.item<float>();
    if (found == 0.0) {
      const at::NoGradGuard no_grad;
      std::vector<std::pair<at::Tensor*, at::Tensor>> scaled;  // (shard grad, its values before)
      try {
        for (Bucket& b : buckets_) {
          if (!signals.contains(b.shard_grad.device())) continue;
          const ScaleSignal& s = signals.at(b.shard_grad.device());
          // As GradScaler's classic path applies it.
          const at::Tensor factor = detail::grad_factor_f64(s.inv_scale, s.clip_coef);
          if (!factor.defined()) continue;
          scaled.emplace_back(&b.shard_grad, b.shard_grad.clone());
          const detail::CheckedList list =
              detail::make_views({&b.shard_grad}, "grad", "ZeroOptimizer::step_with_signals", /*in_place=*/true);
          detail::scale(list, b.shard_grad.device(), factor.reshape({1}), nullptr);
          list.write_back();
        }
        inner_->step();
      } catch (...) {
        for (auto& [grad, before] : scaled) grad->copy_(before);
        throw;
      }
      for (auto& [grad, before] : scaled) grad->copy_(before);
    }
  }
  gather_params();
}

void ZeroOptimizer::save(torch::serialize::OutputArchive& archive) const {
  archive.write("ampfuse_zero/world_size", c10::IValue(static_cast<std::int64_t>(process_group_->getSize())));
  archive.write("ampfuse_zero/rank", c10::IValue(static_cast<std::int64_t>(process_group_->getRank())));
  archive.write("ampfuse_zero/layout", c10::IValue(layout_hash_));
  archive.write("ampfuse_zero/run", c10::IValue(run_id_));
  archive.write("ampfuse_zero/steps", c10::IValue(steps_));
  // The options as set on this optimizer's groups since the last step (an
  // lr scheduler's), which the wrapped optimizer takes at the next step.
  copy_options_to_inner();
  torch::serialize::OutputArchive inner;
  inner_->save(inner);
  archive.write("ampfuse_zero/inner", inner);
}

namespace {

// A sharded checkpoint part's stamp ({run, steps}; empty for a part saved
// before parts were stamped), and how errors name it.
std::vector<std::int64_t> read_stamp(torch::serialize::InputArchive& archive, const std::string& which) {
  c10::IValue run, steps;
  const bool has_run = archive.try_read("ampfuse_zero/run", run), has_steps = archive.try_read("ampfuse_zero/steps", steps);
  if (!has_run && !has_steps) return {};
  TORCH_CHECK(has_run && has_steps && run.isInt() && steps.isInt() && run.toInt() != 0 && steps.toInt() >= 0, kWhere,
              which, ": its save stamp (ampfuse_zero/run, ampfuse_zero/steps) is damaged");
  return {run.toInt(), steps.toInt()};
}
std::string stamp_name(const std::vector<std::int64_t>& stamp) {
  if (stamp.empty()) return "has no save stamp (saved by an older ampfuse)";
  std::ostringstream run;
  run << std::hex << stamp[0];
  return c10::str("was saved after step ", stamp[1], " of run ", run.str());
}

}  // namespace

// Runs `load` (into the wrapped optimizer; it returns the stamp of the part
// it read, or none where it compares stamps itself, or has one file) and
// agrees with the other ranks:
// where any rank refused, every rank throws (its own error, or naming the
// rank that refused), and every rank takes back the state it had before,
// from a copy made here (a rank that loaded, and a wrapped optimizer that is
// not built on the SDK, which may have loaded part before refusing). Every
// rank reaches the agreement whatever this rank's load throws. The options
// follow the wrapped optimizer's.
void ZeroOptimizer::load_agreed(const std::function<std::vector<std::int64_t>()>& load) {
  std::stringstream before;
  bool saved = false;
  std::string refused;
  std::vector<std::int64_t> loaded_stamp;  // the save of the part load read: {run, steps}, or empty
  try {
    torch::serialize::OutputArchive archive;
    inner_->save(archive);
    archive.save_to(before);
    saved = true;
    loaded_stamp = load();
  } catch (const std::exception& e) {
    refused = message_of(e);
    if (refused.empty()) refused = "the load failed";
  } catch (...) {
    refused = "the load failed";
  }
  // Every rank's part's stamp (load_here's; load_sharded compares its parts
  // itself), in the same all-reduce: rank r's in values 3r to 3r + 2; and
  // rank 0's new run id in the last two. A loaded optimizer saves under a new
  // run id, so that a save after a load (going back to an earlier step, say)
  // and one before it never carry the same stamp.
  const int world = process_group_->getSize(), rank = process_group_->getRank();
  std::vector<std::int32_t> stamps(3 * static_cast<std::size_t>(world) + 2, 0);
  if (rank == 0) new_run_id(stamps.data() + 3 * world);
  if (loaded_stamp.size() == 2) {
    stamps[3 * rank] = static_cast<std::int32_t>(loaded_stamp[0] >> 32);
    stamps[3 * rank + 1] = static_cast<std::int32_t>(loaded_stamp[0] & 0xFFFFFFFF);
    stamps[3 * rank + 2] = static_cast<std::int32_t>(loaded_stamp[1] & 0x7FFFFFFF);
  }
  try {
    agree(refused, &stamps, "the load (its error says why); every rank keeps the optimizer state it had",
          "agreeing that every rank could load");
    // (Every rank sees the same stamps, and refuses together.)
    const auto stamp_of = [&](int r) -> std::vector<std::int64_t> {
      if (stamps[3 * r] == 0) return {};
      return {(static_cast<std::int64_t>(stamps[3 * r]) << 32) | static_cast<std::uint32_t>(stamps[3 * r + 1]),
              stamps[3 * r + 2]};
    };
    for (int r = 1; r < world && !buckets_.empty(); ++r)
      TORCH_CHECK(std::equal(stamps.begin() + 3 * r, stamps.begin() + 3 * r + 3, stamps.begin()), kWhere,
                  "load: the ranks' parts are of different saves: rank 0's ", stamp_name(stamp_of(0)), ", rank ", r,
                  "'s ", stamp_name(stamp_of(r)),
                  " (load every rank's part of one save: a part left from an earlier save, where a save failed on "
                  "some ranks, or from another run, is refused); every rank keeps the optimizer state it had");
  } catch (const std::exception& e) {
    if (!saved) throw;
    try {
      // LibTorch's own load adds to state() and never clears it.
      inner_->state().clear();
      torch::serialize::InputArchive archive;
      archive.load_from(before);
      inner_->load(archive);
    } catch (const std::exception& again) {
      TORCH_CHECK(false, kWhere, message_of(e), "; and taking back the state this rank had before failed too: ",
                  message_of(again), " (this rank's optimizer state is not what it was; reload it)");
    }
    throw;
  }
  auto& own = param_groups();
  for (std::size_t g = 0; g < own.size(); ++g) own[g].set_options(inner_->param_groups()[g].options().clone());
  // (Without buckets nothing was reduced: each rank keeps its own id, as its parts hold no state.)
  if (!buckets_.empty() || world == 1) run_id_ = run_id_of(stamps.data() + 3 * world);
}

// The wrapped optimizer's load: its errors name its own group and parameter
// ("param group G, param I": this rank's pieces, numbered within each
// group), to which the model's parameter that piece belongs is added.
void ZeroOptimizer::load_inner(torch::serialize::InputArchive& archive) {
  try {
    inner_->load(archive);
  } catch (c10::Error& e) {
    const std::string message = e.msg();
    static const std::regex where("param group ([0-9]+), param ([0-9]+)");
    std::smatch m;
    if (std::regex_search(message, m, where)) {
      const std::size_t g = std::stoul(m[1].str()), i = std::stoul(m[2].str());
      for (const Piece& piece : pieces_)
        if (piece.group == g && piece.index == i)
          e.add_context(c10::str("the wrapped optimizer's ", m[0].str(), " is rank ", process_group_->getRank(),
                                 "'s piece of ", param_name(group_sizes_, piece.param)));
    }
    throw;  // (its type kept)
  }
}

void ZeroOptimizer::load(torch::serialize::InputArchive& archive) {
  load_agreed([&] { return load_here(archive); });
}

std::vector<std::int64_t> ZeroOptimizer::load_here(torch::serialize::InputArchive& archive) {
  const auto read_int = [&](const char* key) {
    c10::IValue v;
    TORCH_CHECK(archive.try_read(key, v) && v.isInt(), kWhere, "load: the archive has no ", key,
                " (it is not a ZeroOptimizer checkpoint)");
    return v.toInt();
  };
  const std::int64_t world = read_int("ampfuse_zero/world_size");
  const std::int64_t rank = read_int("ampfuse_zero/rank");
  const std::int64_t hash = read_int("ampfuse_zero/layout");
  TORCH_CHECK(world == process_group_->getSize() && rank == process_group_->getRank(), kWhere,
              "load: the checkpoint is rank ", rank, " of ", world, ", this optimizer is rank ",
              process_group_->getRank(), " of ", process_group_->getSize(),
              " (load() takes a sharded checkpoint at the same world size and rank; load_sharded() takes every "
              "rank's part at another world size, load_consolidated() a consolidated one)");
  TORCH_CHECK(hash == layout_hash_, kWhere,
              "load: the checkpoint was saved for other parameters (groups, shapes, dtypes or devices differ)");
  std::vector<std::int64_t> stamp = read_stamp(archive, "load: the checkpoint");
  torch::serialize::InputArchive inner;
  TORCH_CHECK(archive.try_read("ampfuse_zero/inner", inner), kWhere, "load: the archive has no ampfuse_zero/inner");
  sdk::check_saved_tensors(inner, "ZeroOptimizer::load");  // the wrapped optimizer may be LibTorch's, which does not
  load_inner(inner);
  return stamp;
}

// The pieces rank `rank` holds, per group in order, as build() cut them (a
// group with none holds one empty tensor there, which has no state).
std::vector<std::vector<ZeroOptimizer::Span>> ZeroOptimizer::spans_of_rank(int rank, int world) const {
  // Each bucket's shard at that world size, as build() computes it.
  std::vector<std::int64_t> shards;
  for (const Bucket& b : buckets_)
    shards.push_back(shard_of(b.offsets.back() + params_[b.members.back()].numel(), world,
                              static_cast<std::int64_t>(b.flat_param.element_size()), has_blocks(b, params_)));
  std::vector<std::vector<Span>> spans(group_sizes_.size());
  std::size_t k = 0;
  for (std::size_t g = 0; g < group_sizes_.size(); ++g)
    for (std::size_t j = 0; j < group_sizes_[g]; ++j, ++k) {
      const std::int64_t shard = shards[param_bucket_[k]], off = param_offset_[k];
      const std::int64_t lo = std::max(off, rank * shard), hi = std::min(off + params_[k].numel(), (rank + 1) * shard);
      if (hi > lo) spans[g].push_back({k, lo - off, hi - off});
    }
  return spans;
}

namespace {

// The wrapped optimizer's group sizes on a rank of these spans: a group with
// no piece there holds one empty tensor, unless it was given empty (build()).
std::vector<std::size_t> sizes_of(const std::vector<std::vector<ZeroOptimizer::Span>>& spans,
                                  const std::vector<std::size_t>& group_sizes) {
  std::vector<std::size_t> sizes;
  for (std::size_t g = 0; g < spans.size(); ++g)
    sizes.push_back(group_sizes[g] == 0 ? 0 : std::max<std::size_t>(spans[g].size(), 1));
  return sizes;
}

// Copies a flat archive of values (a state's or options' fields).
void copy_fields(torch::serialize::InputArchive& from, torch::serialize::OutputArchive& to,
                 const std::function<c10::IValue(const std::string&, c10::IValue)>& map = nullptr) {
  for (const std::string& key : from.keys()) {
    c10::IValue v;
    from.read(key, v);
    to.write(key, map ? map(key, std::move(v)) : v);
  }
}

bool per_element(const std::string& key, const c10::IValue& v, std::int64_t numel) {
  return key != "step" && v.isTensor() && v.toTensor().defined() && v.toTensor().numel() == numel;
}

std::string key_of(const void* p) { return std::to_string(reinterpret_cast<std::size_t>(p)); }

// Whether two saved values are the same, bit for bit (a NaN equals itself);
// values of other kinds than tensors and numbers are not compared.
bool same_value(const c10::IValue& a, const c10::IValue& b) {
  if (a.isTensor() && b.isTensor()) {
    const at::Tensor x = a.toTensor(), y = b.toTensor();
    if (!x.defined() || !y.defined()) return x.defined() == y.defined();
    if (x.scalar_type() != y.scalar_type() || x.sizes() != y.sizes()) return false;
    const at::Tensor cx = x.cpu().contiguous(), cy = y.cpu().contiguous();
    return std::memcmp(cx.const_data_ptr(), cy.const_data_ptr(), cx.nbytes()) == 0;
  }
  if (a.isInt() && b.isInt()) return a.toInt() == b.toInt();
  if (a.isDouble() && b.isDouble()) {
    const double x = a.toDouble(), y = b.toDouble();
    return std::memcmp(&x, &y, sizeof x) == 0;
  }
  if (a.isBool() && b.isBool()) return a.toBool() == b.toBool();
  return a.tagKind() == b.tagKind();
}

// LibTorch's optimizer format around `states` (key -> archive) and groups of
// `keys` with their options.
void write_optimizer_archive(torch::serialize::OutputArchive& archive,
                             std::vector<std::pair<std::string, torch::serialize::OutputArchive>>& states,
                             const std::vector<std::vector<std::string>>& keys,
                             std::vector<torch::serialize::InputArchive>& options) {
  archive.write("pytorch_version", c10::IValue("1.5.0"));
  torch::serialize::OutputArchive state_archive(archive.compilation_unit());
  for (auto& [key, one] : states) state_archive.write(key, one);
  archive.write("state", state_archive);
  torch::serialize::OutputArchive groups(archive.compilation_unit());
  groups.write("param_groups/size", at::tensor(static_cast<std::int64_t>(keys.size())));
  for (std::size_t g = 0; g < keys.size(); ++g) {
    torch::serialize::OutputArchive group(archive.compilation_unit());
    group.write("params/size", at::tensor(static_cast<std::int64_t>(keys[g].size())));
    for (std::size_t i = 0; i < keys[g].size(); ++i) group.write("params/" + std::to_string(i), c10::IValue(keys[g][i]));
    torch::serialize::OutputArchive opts(archive.compilation_unit());
    copy_fields(options[g], opts);
    group.write("options", opts);
    groups.write("param_groups/" + std::to_string(g), group);
  }
  archive.write("param_groups", groups);
}

}  // namespace

void ZeroOptimizer::save_consolidated(torch::serialize::OutputArchive& archive, int root) const {
  const int world = process_group_->getSize(), rank = process_group_->getRank();
  TORCH_CHECK(root >= 0 && root < world, kWhere, "save_consolidated: root ", root, " is not a rank of ", world);
  // Every rank's own checkpoint of its pieces, as bytes, gathered to root.
  copy_options_to_inner();  // (as save())
  std::string bytes;
  {
    torch::serialize::OutputArchive mine;
    inner_->save(mine);
    std::ostringstream out;
    mine.save_to(out);
    bytes = out.str();
  }
  at::Tensor size = at::tensor(std::vector<std::int64_t>{static_cast<std::int64_t>(bytes.size())}, at::kLong);
  at::Tensor sizes = at::empty({world}, at::kLong);
  collective(*process_group_, "save_consolidated", [&] { return process_group_->_allgather_base(sizes, size); });
  const std::int64_t longest = sizes.max().item<std::int64_t>();
  at::Tensor padded = at::zeros({longest}, at::kByte);
  std::memcpy(padded.data_ptr(), bytes.data(), bytes.size());
  std::vector<std::vector<at::Tensor>> outputs;
  if (rank == root) {
    outputs.emplace_back();
    for (int r = 0; r < world; ++r) outputs.back().push_back(at::empty({longest}, at::kByte));
  }
  std::vector<at::Tensor> inputs{padded};
  c10d::GatherOptions gather;
  gather.rootRank = root;
  collective(*process_group_, "save_consolidated", [&] { return process_group_->gather(outputs, inputs, gather); });
  // Root consolidates; every rank learns whether that failed, and throws with it.
  std::string refused;
  if (rank == root) {
    try {
      std::vector<torch::serialize::InputArchive> parts(world);
      for (int r = 0; r < world; ++r) {
        std::istringstream in(std::string(static_cast<const char*>(outputs[0][r].data_ptr()),
                                          static_cast<std::size_t>(sizes[r].item<std::int64_t>())));
        parts[r].load_from(in);
      }
      consolidate(parts, archive);
    } catch (const std::exception& e) {
      refused = message_of(e);
      if (refused.empty()) refused = "save_consolidated failed";
    }
  }
  agree(refused, nullptr, "save_consolidated (its error says why); nothing was saved",
        "agreeing that the consolidated checkpoint was made");
}

// Elements per entry of a saved per-block state tensor (the wrapped
// optimizer says which keys are), 0 for anything else.
std::int64_t ZeroOptimizer::saved_per_block(const std::string& key, const c10::IValue& v) const {
  const auto* knows = dynamic_cast<const sdk::KnowsWholeTensors*>(inner_.get());
  if (knows == nullptr || !v.isTensor() || !v.toTensor().defined()) return 0;
  return knows->saved_elements_per_entry(key);
}

// The one-process checkpoint of the whole parameters, from every rank's own
// checkpoint of its pieces at a world size of parts.size().
void ZeroOptimizer::consolidate(std::vector<torch::serialize::InputArchive>& parts,
                                torch::serialize::OutputArchive& archive) const {
  const int world = static_cast<int>(parts.size());
  // Each parameter's pieces' states, in element order (rank order).
  struct PieceState {
    std::int64_t lo, hi;
    torch::serialize::InputArchive archive;
  };
  std::vector<std::vector<PieceState>> of_param(params_.size());
  std::vector<torch::serialize::InputArchive> options;
  for (int r = 0; r < world; ++r) {
    torch::serialize::InputArchive& theirs = parts[r];
    const auto spans = spans_of_rank(r, world);
    sdk::CheckpointLayout layout = sdk::read_checkpoint_layout(theirs, "ZeroOptimizer: consolidating", sizes_of(spans, group_sizes_));
    if (r == 0) {
      options = std::move(layout.options);
    } else {
      // Every part holds the same options (one save writes them on every
      // rank alike): another is a part of another save, or damaged.
      for (std::size_t g = 0; g < options.size() && g < layout.options.size(); ++g)
        for (const std::string& key : options[g].keys()) {
          c10::IValue first, theirs;
          options[g].read(key, first);
          TORCH_CHECK(layout.options[g].try_read(key, theirs) && same_value(first, theirs), kWhere,
                      "consolidating: param group ", g, ": part ", r, "'s option ", key, " is ",
                      layout.options[g].try_read(key, theirs) ? value_text(theirs) : std::string("missing"),
                      ", part 0's ", value_text(first),
                      ": the parts are of different saves, or damaged; in a save, the ranks' options differ (an LR "
                      "scheduler stepped on some ranks only?)");
        }
    }
    for (auto& saved : layout.states) {
      if (spans[saved.group].empty()) continue;  // the empty tensor's (it has none)
      const Span& span = spans[saved.group].at(saved.index);
      of_param[span.param].push_back({span.lo, span.hi, std::move(saved.archive)});
    }
  }
  std::vector<std::pair<std::string, torch::serialize::OutputArchive>> states;
  for (std::size_t k = 0; k < params_.size(); ++k) {
    auto& pieces = of_param[k];
    if (pieces.empty()) continue;
    std::sort(pieces.begin(), pieces.end(), [](const PieceState& a, const PieceState& b) { return a.lo < b.lo; });
    const std::string name = param_name(group_sizes_, k);
    TORCH_CHECK(pieces.front().lo == 0 && pieces.back().hi == params_[k].numel(), kWhere, "consolidating: ", name,
                " has state on some of its pieces only");
    torch::serialize::OutputArchive whole(archive.compilation_unit());
    copy_fields(pieces.front().archive, whole, [&](const std::string& key, c10::IValue v) -> c10::IValue {
      const std::int64_t block = saved_per_block(key, v);
      const bool per_block = block > 0;
      if (!per_block && !per_element(key, v, pieces.front().hi - pieces.front().lo)) {
        // Per parameter (its "step"): every piece holds the same, unless the
        // parts are of different saves (or damaged).
        for (auto& piece : pieces) {
          c10::IValue other;
          TORCH_CHECK(piece.archive.try_read(key, other), kWhere, "consolidating: ", name, ": a piece has no ", key);
          TORCH_CHECK(same_value(v, other), kWhere, "consolidating: ", name, ": its pieces hold different ", key, " (",
                      value_text(v), " on elements [", pieces.front().lo, ", ", pieces.front().hi, "), ",
                      value_text(other), " on [", piece.lo, ", ", piece.hi,
                      ")): the parts are of different saves, or damaged");
        }
        return v;
      }
      std::vector<at::Tensor> parts;
      for (auto& piece : pieces) {
        c10::IValue part;
        TORCH_CHECK(piece.archive.try_read(key, part) && part.isTensor(), kWhere, "consolidating: ", name,
                    ": a piece has no ", key);
        TORCH_CHECK(part.toTensor().scalar_type() == v.toTensor().scalar_type(), kWhere, "consolidating: ", name,
                    ": the piece of elements [", piece.lo, ", ", piece.hi, ") holds ", key, " as ",
                    part.toTensor().scalar_type(), ", the first piece as ", v.toTensor().scalar_type(),
                    " (a damaged part?)");
        const std::int64_t entries = per_block ? (piece.hi - piece.lo + block - 1) / block : piece.hi - piece.lo;
        TORCH_CHECK(part.toTensor().numel() == entries, kWhere, "consolidating: ", name, ": the piece of elements [",
                    piece.lo, ", ", piece.hi, ") holds ", part.toTensor().numel(), " entries of ", key, ", expected ",
                    entries, " (a damaged part?)");
        parts.push_back(part.toTensor().reshape({-1}));
      }
      // Blocks: every piece but the last holds whole blocks (pieces start at block boundaries).
      return per_block ? at::cat(parts) : at::cat(parts).view(params_[k].sizes());
    });
    states.emplace_back(key_of(params_[k].unsafeGetTensorImpl()), std::move(whole));
  }
  std::vector<std::vector<std::string>> keys(group_sizes_.size());
  for (std::size_t g = 0, k = 0; g < group_sizes_.size(); ++g)
    for (std::size_t j = 0; j < group_sizes_[g]; ++j, ++k) keys[g].push_back(key_of(params_[k].unsafeGetTensorImpl()));
  write_optimizer_archive(archive, states, keys, options);
}

void ZeroOptimizer::load_consolidated(torch::serialize::InputArchive& archive) {
  load_agreed([&] {
    load_consolidated_here(archive);
    return std::vector<std::int64_t>{};  // (a consolidated checkpoint is one file: no parts to match)
  });
}

void ZeroOptimizer::load_consolidated_here(torch::serialize::InputArchive& archive) {
  sdk::CheckpointLayout layout =
      sdk::read_checkpoint_layout(archive, "ZeroOptimizer::load_consolidated", group_sizes_);
  // (group, index) -> parameter
  std::vector<std::size_t> first_of_group(group_sizes_.size() + 1, 0);
  for (std::size_t g = 0; g < group_sizes_.size(); ++g) first_of_group[g + 1] = first_of_group[g] + group_sizes_[g];
  std::vector<torch::serialize::InputArchive*> state_of(params_.size(), nullptr);
  for (auto& saved : layout.states) state_of[first_of_group[saved.group] + saved.index] = &saved.archive;

  // This rank's pieces' part, in the wrapped optimizer's own format.
  const auto spans = spans_of_rank(process_group_->getRank(), process_group_->getSize());
  const auto& groups = inner_->param_groups();
  std::vector<std::pair<std::string, torch::serialize::OutputArchive>> states;
  std::vector<std::vector<std::string>> keys(groups.size());
  for (std::size_t g = 0; g < groups.size(); ++g) {
    for (const at::Tensor& piece : groups[g].params()) keys[g].push_back(key_of(piece.unsafeGetTensorImpl()));
    for (std::size_t i = 0; i < spans[g].size(); ++i) {
      const Span& span = spans[g][i];
      torch::serialize::InputArchive* whole = state_of[span.param];
      if (!whole) continue;
      const std::string name = param_name(group_sizes_, span.param);
      // Per-block state counts its blocks in the storage order of the per-element state beside it.
      bool has_blocks = false;
      for (const std::string& key : whole->keys()) {
        c10::IValue v;
        whole->read(key, v);
        has_blocks = has_blocks || saved_per_block(key, v) > 0;
      }
      torch::serialize::OutputArchive part;
      copy_fields(*whole, part, [&](const std::string& key, c10::IValue v) -> c10::IValue {
        const std::int64_t numel = params_[span.param].numel();
        if (const std::int64_t block = saved_per_block(key, v)) {
          const at::Tensor t = v.toTensor();
          const std::int64_t blocks = (numel + block - 1) / block;
          TORCH_CHECK(t.dim() == 1 && t.numel() == blocks, kWhere, "load_consolidated: ", name, ": state ", key,
                      " has shape ", t.sizes(), ", expected [", blocks, "] (one entry per ", block, " of its ", numel,
                      " elements; a damaged checkpoint?)");
          TORCH_CHECK(span.lo % block == 0, kWhere, "load_consolidated: ", name, " (", numel, " elements): state ",
                      key, " holds one entry per ", block, " elements, but this rank's piece starts at element ",
                      span.lo, "; ZeroOptimizer cuts parameters at block boundaries from ", kBlockFrom,
                      " elements on");
          return t.narrow(0, span.lo / block, (span.hi + block - 1) / block - span.lo / block).clone();
        }
        if (!per_element(key, v, numel)) return v;
        TORCH_CHECK(!has_blocks || v.toTensor().is_contiguous(), kWhere, "load_consolidated: ", name, ": state ", key,
                    " has strides ", v.toTensor().strides(),
                    " (saved from a parameter of another memory format, such as channels_last) and blockwise state "
                    "beside it counts its blocks in that order; load the checkpoint into the optimizer over a "
                    "contiguous copy of the parameter and save it again");
        return v.toTensor().reshape({-1}).narrow(0, span.lo, span.hi - span.lo).clone();
      });
      states.emplace_back(keys[g][i], std::move(part));
    }
  }
  torch::serialize::OutputArchive mine;
  write_optimizer_archive(mine, states, keys, layout.options);
  torch::serialize::InputArchive in = sdk::read_back(mine);
  load_inner(in);
}

void ZeroOptimizer::load_sharded(std::vector<torch::serialize::InputArchive>& parts) {
  load_agreed([&] {
    const auto read_int = [&](torch::serialize::InputArchive& a, const char* key, std::size_t i) {
      c10::IValue v;
      TORCH_CHECK(a.try_read(key, v) && v.isInt(), kWhere, "load_sharded: part ", i, " has no ", key,
                  " (it is not a ZeroOptimizer checkpoint)");
      return v.toInt();
    };
    const auto world = static_cast<std::int64_t>(parts.size());
    TORCH_CHECK(world > 0, kWhere, "load_sharded: no parts");
    std::vector<torch::serialize::InputArchive> inner(parts.size());
    std::vector<bool> seen(parts.size(), false);
    std::vector<std::int64_t> first_stamp;
    for (std::size_t i = 0; i < parts.size(); ++i) {
      const std::vector<std::int64_t> stamp = read_stamp(parts[i], c10::str("load_sharded: part ", i));
      if (i == 0) first_stamp = stamp;
      TORCH_CHECK(stamp == first_stamp, kWhere, "load_sharded: the parts are of different saves: part 0 ",
                  stamp_name(first_stamp), ", part ", i, " ", stamp_name(stamp),
                  " (pass every rank's part of one save: a part left from an earlier save, where a save failed on "
                  "some ranks, or from another run, is refused)");
      const std::int64_t their_world = read_int(parts[i], "ampfuse_zero/world_size", i);
      const std::int64_t rank = read_int(parts[i], "ampfuse_zero/rank", i);
      TORCH_CHECK(their_world == world, kWhere, "load_sharded: part ", i, " is one of ", their_world,
                  " ranks' parts, but ", world, " parts were given (pass every rank's part)");
      TORCH_CHECK(rank >= 0 && rank < world && !seen[rank], kWhere, "load_sharded: rank ", rank,
                  "'s part is given twice, or is out of range");
      seen[rank] = true;
      TORCH_CHECK(read_int(parts[i], "ampfuse_zero/layout", i) == layout_hash_, kWhere, "load_sharded: part ", i,
                  " was saved for other parameters (groups, shapes, dtypes or devices differ)");
      TORCH_CHECK(parts[i].try_read("ampfuse_zero/inner", inner[rank]), kWhere, "load_sharded: part ", i,
                  " has no ampfuse_zero/inner");
    }
    torch::serialize::OutputArchive whole;
    consolidate(inner, whole);
    torch::serialize::InputArchive in = sdk::read_back(whole);
    load_consolidated_here(in);
    return std::vector<std::int64_t>{};  // (its parts' stamps compared above)
  });
}

}  // namespace ampfuse::distributed
