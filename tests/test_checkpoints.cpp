// Corrupted and mismatched checkpoints: every optimizer and the GradScaler
// refuse what does not fit with an error naming what is wrong, and a refused
// load changes nothing (state, options, step plan). A fuzz test mutates
// saved archives (their bytes, and their tensors and keys) and checks that
// each load is refused whole or accepted whole.

#include <ampfuse/ampfuse.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "tests/common.h"

namespace {

using ampfuse_test::bitwise_equal;
using ampfuse_test::seed_for_test;

enum class Kind { kAdam, kAdamWMaster, kSGD, kLAMB, kAdagrad, kRMSprop };
const Kind kKinds[] = {Kind::kAdam, Kind::kAdamWMaster, Kind::kSGD, Kind::kLAMB, Kind::kAdagrad, Kind::kRMSprop};

std::string kind_name(Kind k) {
  switch (k) {
    case Kind::kAdam: return "FusedAdam";
    case Kind::kAdamWMaster: return "FusedAdamW";
    case Kind::kSGD: return "FusedSGD";
    case Kind::kLAMB: return "FusedLAMB";
    case Kind::kAdagrad: return "FusedAdagrad";
    case Kind::kRMSprop: return "FusedRMSprop";
  }
  return "?";
}

// The state tensors and host step count of a state, by kind: what a refused
// load must leave bit-identical (the same objects holding the same bits).
struct StateView {
  std::vector<torch::Tensor> tensors;
  std::int64_t step = 0;
};

StateView view_of(Kind k, const torch::optim::OptimizerParamState& s) {
  switch (k) {
    case Kind::kAdam: {
      const auto& a = static_cast<const ampfuse::FusedAdamParamState&>(s);
      return {{a.exp_avg(), a.exp_avg_sq(), a.max_exp_avg_sq(), a.master(), a.device_step()}, a.step()};
    }
    case Kind::kAdamWMaster: {
      const auto& a = static_cast<const ampfuse::FusedAdamWParamState&>(s);
      return {{a.exp_avg(), a.exp_avg_sq(), a.max_exp_avg_sq(), a.master(), a.device_step()}, a.step()};
    }
    case Kind::kSGD: {
      const auto& a = static_cast<const ampfuse::FusedSGDParamState&>(s);
      return {{a.momentum_buffer(), a.momentum_initialized()}, 0};
    }
    case Kind::kLAMB: {
      const auto& a = static_cast<const ampfuse::FusedLAMBParamState&>(s);
      return {{a.step(), a.exp_avg(), a.exp_avg_sq(), a.master()}, 0};
    }
    case Kind::kAdagrad: {
      const auto& a = static_cast<const ampfuse::FusedAdagradParamState&>(s);
      return {{a.sum(), a.device_step()}, a.step()};
    }
    case Kind::kRMSprop: {
      const auto& a = static_cast<const ampfuse::FusedRMSpropParamState&>(s);
      return {{a.square_avg(), a.momentum_buffer(), a.grad_avg(), a.device_step()}, a.step()};
    }
  }
  return {};
}

// An optimizer of one kind over two groups (two parameters, then one), with
// grads written in place each step so that its step plan is reused.
struct Rig {
  Kind kind;
  std::vector<torch::Tensor> params;
  std::unique_ptr<torch::optim::Optimizer> opt;
  std::function<ampfuse::sdk::PlanMatch()> last_plan_match;

  Rig(Kind k, std::uint64_t seed) : kind(k) {
    torch::manual_seed(seed);
    const auto dtype = k == Kind::kAdamWMaster ? torch::kBFloat16 : torch::kFloat;
    for (const auto& shape : std::vector<std::vector<std::int64_t>>{{5}, {3, 4}, {7}})
      params.push_back(torch::randn(shape).to(dtype).requires_grad_());
    auto groups = [&](auto options) {
      using O = decltype(options);
      std::vector<torch::optim::OptimizerParamGroup> g;
      g.emplace_back(std::vector<torch::Tensor>{params[0], params[1]}, std::make_unique<O>(options));
      g.emplace_back(std::vector<torch::Tensor>{params[2]}, std::make_unique<O>(options));
      return g;
    };
    switch (k) {
      case Kind::kAdam:
        make<ampfuse::FusedAdam>(groups(torch::optim::AdamOptions(0.01).amsgrad(true)),
                                 torch::optim::AdamOptions(0.01));
        break;
      case Kind::kAdamWMaster:
        make<ampfuse::FusedAdamW>(groups(torch::optim::AdamWOptions(0.01)), torch::optim::AdamWOptions(0.01),
                                  ampfuse::FusedAdamOptions().master_weights(true));
        break;
      case Kind::kSGD:
        make<ampfuse::FusedSGD>(groups(torch::optim::SGDOptions(0.1).momentum(0.9)), torch::optim::SGDOptions(0.1));
        break;
      case Kind::kLAMB:
        make<ampfuse::FusedLAMB>(groups(ampfuse::FusedLAMBOptions(0.01)), ampfuse::FusedLAMBOptions(0.01));
        break;
      case Kind::kAdagrad:
        make<ampfuse::FusedAdagrad>(groups(torch::optim::AdagradOptions(0.05)), torch::optim::AdagradOptions(0.05));
        break;
      case Kind::kRMSprop:
        make<ampfuse::FusedRMSprop>(groups(torch::optim::RMSpropOptions(0.01).momentum(0.5).centered(true)),
                                    torch::optim::RMSpropOptions(0.01));
        break;
    }
    for (auto& p : params) p.mutable_grad() = torch::zeros_like(p);
  }

  template <class Opt, class... Args>
  void make(Args&&... args) {
    auto o = std::make_unique<Opt>(std::forward<Args>(args)...);
    Opt* raw = o.get();
    last_plan_match = [raw] { return raw->last_plan_match(); };
    opt = std::move(o);
  }

  // One step on grads drawn from `rng` (the same draws give the same grads).
  void step(std::mt19937_64& rng) {
    std::normal_distribution<float> normal;
    {
      torch::NoGradGuard no_grad;
      for (auto& p : params) {
        auto g = torch::empty(p.sizes());
        auto* d = g.data_ptr<float>();
        for (std::int64_t i = 0; i < g.numel(); ++i) d[i] = normal(rng);
        p.mutable_grad().copy_(g);
      }
    }
    opt->step();
  }

  std::string save() const {
    std::ostringstream out;
    torch::save(*opt, out);
    return out.str();
  }
};

// What a refused load must leave as it was: each parameter's state object,
// its tensors (objects and bits) and step count, and each group's options.
struct Snapshot {
  std::vector<const void*> states;
  std::vector<StateView> views;  // clones
  std::vector<const void*> impls;
  std::vector<std::string> options;
};

Snapshot snapshot(const Rig& rig) {
  Snapshot s;
  for (const auto& group : rig.opt->param_groups()) {
    for (const auto& p : group.params()) {
      const auto it = rig.opt->state().find(p.unsafeGetTensorImpl());
      s.states.push_back(it == rig.opt->state().end() ? nullptr : it->second.get());
      StateView v;
      if (it != rig.opt->state().end()) v = view_of(rig.kind, *it->second);
      for (auto& t : v.tensors) {
        s.impls.push_back(t.defined() ? t.unsafeGetTensorImpl() : nullptr);
        if (t.defined()) t = t.clone();
      }
      s.views.push_back(std::move(v));
    }
    torch::serialize::OutputArchive out;
    group.options().serialize(out);
    std::ostringstream bytes;
    out.save_to(bytes);
    s.options.push_back(bytes.str());
  }
  return s;
}

// The same options, steps and state tensors (bits), whichever objects hold them.
::testing::AssertionResult same_values(const Snapshot& a, const Snapshot& b) {
  if (a.options != b.options) return ::testing::AssertionFailure() << "a group's options changed";
  if (a.views.size() != b.views.size()) return ::testing::AssertionFailure() << "another count of parameters";
  for (std::size_t k = 0; k < a.views.size(); ++k) {
    if (a.views[k].step != b.views[k].step) return ::testing::AssertionFailure() << "param " << k << ": step changed";
    for (std::size_t t = 0; t < a.views[k].tensors.size(); ++t) {
      const auto& x = a.views[k].tensors[t];
      const auto& y = b.views[k].tensors[t];
      if (x.defined() != y.defined()) return ::testing::AssertionFailure() << "param " << k << ": tensor " << t;
      if (x.defined() && !bitwise_equal(x, y))
        return ::testing::AssertionFailure() << "param " << k << ": tensor " << t << " changed";
    }
  }
  return ::testing::AssertionSuccess();
}

// The same state objects and tensor objects too: what a refused load must leave.
::testing::AssertionResult same(const Snapshot& a, const Snapshot& b) {
  if (a.states != b.states) return ::testing::AssertionFailure() << "a state object was replaced";
  if (a.impls != b.impls) return ::testing::AssertionFailure() << "a state tensor was replaced";
  return same_values(a, b);
}

// torch::load from bytes; returns the error's message, or "" when accepted.
template <class T>
std::string load_error(T& target, const std::string& bytes) {
  std::istringstream in(bytes);
  try {
    torch::load(target, in);
    return "";
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
}

template <class T>
void expect_refused(T& target, const std::string& bytes, const std::vector<std::string>& parts) {
  const std::string message = load_error(target, bytes);
  ASSERT_FALSE(message.empty()) << "accepted; expected refused with: " << parts.front();
  for (const auto& part : parts) EXPECT_THAT(message, ::testing::HasSubstr(part));
}

// An archive as a tree of keys (sub-archives, tensors, other values), to be
// changed and written back.
struct Tree {
  struct Item {
    std::string key;
    std::shared_ptr<Tree> sub;
    torch::Tensor tensor;
    c10::IValue value;
    bool is_tensor = false;
  };
  std::vector<Item> items;

  Item* find(const std::string& key) {
    for (auto& item : items)
      if (item.key == key) return &item;
    return nullptr;
  }
};

Tree read_tree(torch::serialize::InputArchive& in) {
  Tree tree;
  for (const std::string& key : in.keys()) {
    Tree::Item item;
    item.key = key;
    torch::serialize::InputArchive sub;
    if (in.try_read(key, sub)) {
      item.sub = std::make_shared<Tree>(read_tree(sub));
    } else if (in.try_read(key, item.tensor)) {
      item.is_tensor = true;
    } else {
      in.read(key, item.value);
    }
    tree.items.push_back(std::move(item));
  }
  return tree;
}

Tree read_tree(const std::string& bytes) {
  std::istringstream in(bytes);
  torch::serialize::InputArchive archive;
  archive.load_from(in);
  return read_tree(archive);
}

void write_tree(const Tree& tree, torch::serialize::OutputArchive& out) {
  for (const auto& item : tree.items) {
    if (item.sub) {
      torch::serialize::OutputArchive sub(out.compilation_unit());
      write_tree(*item.sub, sub);
      out.write(item.key, sub);
    } else if (item.is_tensor) {
      out.write(item.key, item.tensor);
    } else {
      out.write(item.key, item.value);
    }
  }
}

std::string write_tree(const Tree& tree) {
  torch::serialize::OutputArchive out;
  write_tree(tree, out);
  std::ostringstream bytes;
  out.save_to(bytes);
  return bytes.str();
}

// The state tree of group g, param i of a saved optimizer, found through its key.
Tree& state_tree(Tree& root, std::size_t g, std::size_t i) {
  Tree& groups = *root.find("param_groups")->sub;
  Tree& group = *groups.find("param_groups/" + std::to_string(g))->sub;
  const std::string key = group.find("params/" + std::to_string(i))->value.toStringRef();
  return *root.find("state")->sub->find(key)->sub;
}

// The same checkpoint with the parameters' keys (their TensorImpl
// addresses, as LibTorch writes them) replaced by their places, "1" on, and
// the states in that order: the bytes no longer depend on where this run
// allocated the parameters, so that a mutation the seed draws lands on the
// same bytes in every run.
std::string canonical(const std::string& bytes) {
  Tree tree = read_tree(bytes);
  Tree& groups = *tree.find("param_groups")->sub;
  Tree& states = *tree.find("state")->sub;
  std::vector<Tree::Item> ordered;
  int place = 0;
  for (std::size_t g = 0; groups.find("param_groups/" + std::to_string(g)); ++g) {
    Tree& group = *groups.find("param_groups/" + std::to_string(g))->sub;
    for (std::size_t i = 0; group.find("params/" + std::to_string(i)); ++i) {
      Tree::Item& param = *group.find("params/" + std::to_string(i));
      const std::string key = std::to_string(++place);
      if (Tree::Item* state = states.find(param.value.toStringRef())) {
        ordered.push_back(*state);
        ordered.back().key = key;
      }
      param.value = c10::IValue(key);
    }
  }
  EXPECT_EQ(ordered.size(), states.items.size());
  states.items = std::move(ordered);
  return write_tree(tree);
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override { seed_ = seed_for_test(); }
  std::uint64_t seed_ = 0;
};

// A stepped optimizer of each kind, the optimizer that a refused load must leave as it was.
Rig stepped(Kind k, std::uint64_t seed, int steps) {
  Rig rig(k, seed);
  std::mt19937_64 rng(seed);
  for (int s = 0; s < steps; ++s) rig.step(rng);
  return rig;
}

TEST_F(CheckpointTest, TruncatedFilesAreRefusedAndChangeNothing) {
  for (Kind k : kKinds) {
    SCOPED_TRACE(kind_name(k));
    const std::string bytes = stepped(k, seed_ + 1, 3).save();
    Rig victim = stepped(k, seed_, 2);
    const Snapshot before = snapshot(victim);
    for (std::size_t cut : {std::size_t{0}, std::size_t{10}, bytes.size() / 2, bytes.size() - 1}) {
      EXPECT_FALSE(load_error(*victim.opt, bytes.substr(0, cut)).empty()) << "cut at " << cut;
      EXPECT_TRUE(same(before, snapshot(victim)));
    }
  }
}

TEST_F(CheckpointTest, AnotherOptimizersFileIsRefusedNamingTheOptimizer) {
  std::vector<std::string> files;
  for (Kind k : kKinds) files.push_back(stepped(k, seed_, 2).save());
  for (std::size_t a = 0; a < std::size(kKinds); ++a)
    for (std::size_t b = 0; b < std::size(kKinds); ++b) {
      const Kind from = kKinds[a], into = kKinds[b];
      // FusedAdam's and FusedAdamW's formats are the same (LibTorch's Adam
      // and AdamW share theirs): one loads the other's checkpoints.
      const bool adam_pair = (from == Kind::kAdam || from == Kind::kAdamWMaster) &&
                             (into == Kind::kAdam || into == Kind::kAdamWMaster);
      if (from == into || adam_pair) continue;
      SCOPED_TRACE(kind_name(from) + " into " + kind_name(into));
      Rig victim = stepped(into, seed_ + 7, 2);
      const Snapshot before = snapshot(victim);
      expect_refused(*victim.opt, files[a], {kind_name(into) + ": param group "});
      EXPECT_TRUE(same(before, snapshot(victim)));
    }
  // A GradScaler's file into an optimizer, and an optimizer's into a GradScaler.
  ampfuse::GradScaler scaler;
  scaler.scale(torch::ones({}));
  std::ostringstream scaler_file;
  torch::save(scaler, scaler_file);
  Rig victim = stepped(Kind::kAdam, seed_, 2);
  expect_refused(*victim.opt, scaler_file.str(), {"FusedAdam: the checkpoint holds a GradScaler's state"});
  ampfuse::GradScaler target;
  expect_refused(target, files[0], {"GradScaler::load: the archive holds an optimizer's checkpoint"});
  EXPECT_EQ(target.get_scale(), 65536.0);
}

TEST_F(CheckpointTest, StateTensorsOfAnotherShapeOrDtypeAreRefusedNamingTheKey) {
  const std::string bytes = stepped(Kind::kAdam, seed_, 2).save();
  for (int change = 0; change < 2; ++change) {
    SCOPED_TRACE(change);
    Tree tree = read_tree(bytes);
    Tree::Item* item = state_tree(tree, 1, 0).find("exp_avg_sq");
    ASSERT_NE(item, nullptr);
    item->tensor = change == 0 ? torch::zeros({8}) : item->tensor.to(torch::kInt);
    Rig victim = stepped(Kind::kAdam, seed_ + 3, 2);
    const Snapshot before = snapshot(victim);
    expect_refused(*victim.opt, write_tree(tree),
                   {change == 0 ? "FusedAdam: param group 1, param 0: state exp_avg_sq has shape [8], dtype Float"
                                : "FusedAdam: param group 1, param 0: state exp_avg_sq has shape [7], dtype Int"});
    EXPECT_TRUE(same(before, snapshot(victim)));
  }
  // Another floating dtype (a model converted since the checkpoint was
  // written; here the file's): read as a copy in the dtype kept for the
  // parameter, as a step's state follows a converted parameter.
  {
    Tree tree = read_tree(bytes);
    Tree::Item* item = state_tree(tree, 1, 0).find("exp_avg_sq");
    const torch::Tensor saved = item->tensor.clone();
    item->tensor = item->tensor.to(torch::kDouble);
    Rig victim = stepped(Kind::kAdam, seed_ + 3, 2);
    ASSERT_EQ(load_error(*victim.opt, write_tree(tree)), "");
    const torch::Tensor& p = victim.opt->param_groups()[1].params()[0];
    const auto& st = static_cast<const ampfuse::FusedAdamParamState&>(*victim.opt->state().at(p.unsafeGetTensorImpl()));
    EXPECT_EQ(st.exp_avg_sq().scalar_type(), torch::kFloat);
    EXPECT_TRUE(ampfuse_test::bitwise_equal(st.exp_avg_sq(), saved));
  }
  // Strides: a transposed state for a 3x4 parameter loads, as into LibTorch,
  // as a copy in the parameter's layout with the saved values.
  Tree tree = read_tree(bytes);
  Tree::Item* item = state_tree(tree, 0, 1).find("exp_avg");
  const torch::Tensor transposed = torch::randn({4, 3}).t();
  item->tensor = transposed;
  Rig victim = stepped(Kind::kAdam, seed_ + 3, 2);
  std::istringstream in(write_tree(tree));
  torch::load(*victim.opt, in);
  const auto& st =
      static_cast<const torch::optim::AdamParamState&>(*victim.opt->state().at(victim.params[1].unsafeGetTensorImpl()));
  EXPECT_TRUE(bitwise_equal(st.exp_avg(), transposed));
  EXPECT_EQ(st.exp_avg().strides(), victim.params[1].strides());
}

// Three steps of Ref over p0 with contiguous grads (whatever p0's layout),
// saved; loaded into a second Ref and into Ours over again(p0's values);
// three more steps of each on the same grads must agree.
template <class Ref, class Ours, class Options>
void expect_loads_and_steps_on(const torch::Tensor& p0, const Options& options,
                               const std::function<torch::Tensor(const torch::Tensor&)>& again, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const auto grad_of = [&](const torch::Tensor& p) {
    torch::manual_seed(rng());
    return torch::randn(p.sizes());
  };
  torch::Tensor pt = p0.detach().clone(torch::MemoryFormat::Preserve).requires_grad_();
  Ref first({pt}, options);
  for (int s = 0; s < 3; ++s) {
    pt.mutable_grad() = grad_of(pt);
    first.step();
  }
  std::ostringstream out;
  torch::save(first, out);
  torch::Tensor p_ref = again(pt).requires_grad_(), p_ours = again(pt).requires_grad_();
  Ref second({p_ref}, options);
  Ours fused({p_ours}, options);
  std::istringstream in_ref(out.str()), in_ours(out.str());
  torch::load(second, in_ref);
  torch::load(fused, in_ours);
  for (int s = 0; s < 3; ++s) {
    const torch::Tensor g = grad_of(p_ref);
    p_ref.mutable_grad() = g;
    p_ours.mutable_grad() = g.clone();
    second.step();
    fused.step();
  }
  EXPECT_TRUE(torch::allclose(p_ours, p_ref, 1e-5, 1e-7)) << (p_ours - p_ref).abs().max().item<double>();
}

// A checkpoint written before the model was converted (fp32 to fp64) loads
// into the converted model, its state read as copies in fp64, and steps on
// bit for bit as the optimizer converted with its model (whose state
// followed at its next step): resuming a converted run from its last
// checkpoint. A checkpoint of fp32 moments loads into bf16_moments as bf16.
// 8-bit codes saved for a parameter laid out otherwise than it is now (a
// model made channels_last or column-major since the checkpoint was
// written) are decoded in their saved memory order and coded again in the
// parameter's layout, as a step codes them again after such a conversion:
// the loaded optimizer steps bit for bit as one that followed by stepping,
// and a 32-bit FusedAdam decodes them once into the parameter's layout.
// Damaged codes are refused before anything decodes them.
TEST_F(CheckpointTest, EightBitCodesLoadIntoAParameterLaidOutOtherwise) {
  torch::manual_seed(seed_);
  const auto v = torch::randn({64, 80});  // (5,120 elements: 8-bit moments)
  auto resumed = v.clone().requires_grad_(), followed = v.clone().requires_grad_();
  const auto make = [](const torch::Tensor& p) {
    return std::make_unique<ampfuse::FusedAdam>(std::vector<torch::Tensor>{p}, torch::optim::AdamOptions(1e-2),
                                                ampfuse::FusedAdamOptions().moments_8bit(true));
  };
  const auto step_both = [&](torch::optim::Optimizer& a, torch::optim::Optimizer& b) {
    const auto g = torch::randn(resumed.sizes());
    resumed.mutable_grad() = g.clone();
    followed.mutable_grad() = g.clone();
    a.step();
    b.step();
  };
  auto before = make(resumed), converted = make(followed);
  for (int s = 0; s < 2; ++s) step_both(*before, *converted);
  std::ostringstream bytes, damaged;
  torch::save(*before, bytes);
  auto& kept = static_cast<ampfuse::FusedAdamParamState&>(*before->state().at(resumed.unsafeGetTensorImpl()));
  kept.exp_avg_8bit().view(-1)[5] = 127;  // (exp_avg's magnitudes run to 126)
  torch::save(*before, damaged);
  for (auto* p : {&resumed, &followed}) p->set_data(p->detach().t().contiguous().t());  // column-major
  auto after = make(resumed);
  EXPECT_THAT(load_error(*after, damaged.str()), ::testing::HasSubstr("exp_avg_8bit holds the byte 127"));
  EXPECT_TRUE(after->state().empty()) << "a refused load left state";
  ASSERT_EQ(load_error(*after, bytes.str()), "");
  const auto& loaded = static_cast<const ampfuse::FusedAdamParamState&>(*after->state().at(resumed.unsafeGetTensorImpl()));
  EXPECT_EQ(loaded.exp_avg_8bit().strides(), resumed.strides());
  EXPECT_EQ(loaded.exp_avg_sq_8bit().strides(), resumed.strides());
  for (int s = 0; s < 3; ++s) step_both(*after, *converted);
  EXPECT_TRUE(ampfuse_test::bitwise_equal(resumed.detach(), followed.detach()));
  // Into a 32-bit FusedAdam: decoded into the parameter's layout once (not coded again first), the
  // moments one laid out as saved decodes.
  auto as_saved = v.clone().requires_grad_();
  auto relaid = torch::empty_strided({64, 80}, {1, 64}).copy_(v).requires_grad_();
  ampfuse::FusedAdam into_saved({as_saved}, torch::optim::AdamOptions(1e-2)),
      into_relaid({relaid}, torch::optim::AdamOptions(1e-2));
  ASSERT_EQ(load_error(into_saved, bytes.str()), "");
  ASSERT_EQ(load_error(into_relaid, bytes.str()), "");
  const auto& a = static_cast<const ampfuse::FusedAdamParamState&>(*into_saved.state().at(as_saved.unsafeGetTensorImpl()));
  const auto& b = static_cast<const ampfuse::FusedAdamParamState&>(*into_relaid.state().at(relaid.unsafeGetTensorImpl()));
  EXPECT_FALSE(b.exp_avg_8bit().defined());
  EXPECT_EQ(b.exp_avg().strides(), relaid.strides());
  EXPECT_TRUE(ampfuse_test::bitwise_equal(a.exp_avg(), b.exp_avg()));
  EXPECT_TRUE(ampfuse_test::bitwise_equal(a.exp_avg_sq(), b.exp_avg_sq()));
}

TEST_F(CheckpointTest, ACheckpointLoadsIntoAConvertedModelAsItsStateWouldFollow) {
  for (const bool lamb : {false, true}) {
    SCOPED_TRACE(lamb ? "FusedLAMB" : "FusedAdam");
    torch::manual_seed(seed_);
    std::vector<torch::Tensor> resumed, followed;
    for (const std::vector<std::int64_t> shape : {std::vector<std::int64_t>{6}, std::vector<std::int64_t>{3, 5}}) {
      const auto v = torch::randn(shape);
      resumed.push_back(v.clone().requires_grad_());
      followed.push_back(v.clone().requires_grad_());
    }
    const auto make = [lamb](const std::vector<torch::Tensor>& ps) -> std::unique_ptr<torch::optim::Optimizer> {
      if (lamb) return std::make_unique<ampfuse::FusedLAMB>(ps, ampfuse::FusedLAMBOptions(1e-2).max_grad_norm(1.0));
      return std::make_unique<ampfuse::FusedAdam>(ps, torch::optim::AdamOptions(1e-2).amsgrad(true));
    };
    const auto step_both = [&](torch::optim::Optimizer& a, torch::optim::Optimizer& b) {
      for (std::size_t i = 0; i < resumed.size(); ++i) {
        const auto g = torch::randn(resumed[i].sizes(), resumed[i].options());
        resumed[i].mutable_grad() = g.clone();
        followed[i].mutable_grad() = g.clone();
      }
      a.step();
      b.step();
    };
    auto before = make(resumed), converted = make(followed);
    for (int s = 0; s < 2; ++s) step_both(*before, *converted);
    std::ostringstream bytes;
    torch::save(*before, bytes);
    for (auto* ps : {&resumed, &followed})
      for (auto& p : *ps) p.set_data(p.detach().to(torch::kDouble));
    auto after = make(resumed);
    ASSERT_EQ(load_error(*after, bytes.str()), "");
    for (const auto& [key, state] : after->state()) {
      const at::Tensor& exp_avg = lamb ? static_cast<const ampfuse::FusedLAMBParamState&>(*state).exp_avg()
                                       : static_cast<const ampfuse::FusedAdamParamState&>(*state).exp_avg();
      EXPECT_EQ(exp_avg.scalar_type(), torch::kDouble);
    }
    for (int s = 0; s < 3; ++s) step_both(*after, *converted);
    for (std::size_t i = 0; i < resumed.size(); ++i)
      EXPECT_TRUE(ampfuse_test::bitwise_equal(resumed[i].detach(), followed[i].detach())) << "param " << i;
  }
  // fp32 moments into bf16_moments: rounded to bf16 (and the reverse, widened).
  auto p = torch::randn({9}).requires_grad_();
  ampfuse::FusedAdam fp32({p}, torch::optim::AdamOptions(1e-2));
  p.mutable_grad() = torch::randn({9});
  fp32.step();
  std::ostringstream bytes;
  torch::save(fp32, bytes);
  ampfuse::FusedAdam bf16({p}, torch::optim::AdamOptions(1e-2), ampfuse::FusedAdamOptions().bf16_moments(true));
  ASSERT_EQ(load_error(bf16, bytes.str()), "");
  const auto& saved = static_cast<const ampfuse::FusedAdamParamState&>(*fp32.state().at(p.unsafeGetTensorImpl()));
  const auto& loaded = static_cast<const ampfuse::FusedAdamParamState&>(*bf16.state().at(p.unsafeGetTensorImpl()));
  EXPECT_TRUE(ampfuse_test::bitwise_equal(loaded.exp_avg(), saved.exp_avg().to(torch::kBFloat16)));
  EXPECT_TRUE(ampfuse_test::bitwise_equal(loaded.exp_avg_sq(), saved.exp_avg_sq().to(torch::kBFloat16)));
  std::ostringstream back;
  torch::save(bf16, back);
  ASSERT_EQ(load_error(fp32, back.str()), "");
  const auto& widened = static_cast<const ampfuse::FusedAdamParamState&>(*fp32.state().at(p.unsafeGetTensorImpl()));
  EXPECT_TRUE(ampfuse_test::bitwise_equal(widened.exp_avg(), loaded.exp_avg().to(torch::kFloat)));
}

// A checkpoint of torch::optim whose state is laid out otherwise than the
// parameter it loads for loads, as into torch::optim, and steps on with
// its numbers: torch::optim::SGD's momentum buffer is a clone of the grad
// (contiguous grads of a transposed parameter), and a model saved with
// channels_last weights keeps its Adam moments channels_last.
TEST_F(CheckpointTest, LibTorchStateInAnotherLayoutLoadsAndStepsOn) {
  const auto same_layout = [](const torch::Tensor& p) { return p.detach().clone(torch::MemoryFormat::Preserve); };
  expect_loads_and_steps_on<torch::optim::SGD, ampfuse::FusedSGD>(
      torch::randn({8, 6}).t(), torch::optim::SGDOptions(0.1).momentum(0.9), same_layout, seed_);
  expect_loads_and_steps_on<torch::optim::Adam, ampfuse::FusedAdam>(
      torch::randn({4, 3, 2, 2}).contiguous(torch::MemoryFormat::ChannelsLast), torch::optim::AdamOptions(0.01),
      [](const torch::Tensor& p) { return p.detach().contiguous(); }, seed_);
}

// A tensor whose sizes, strides and storage offset (as a damaged file
// gives them, which LibTorch's reader does not check) reach outside its
// storage of `elements` floats.
torch::Tensor reaching_outside(std::vector<std::int64_t> sizes, std::vector<std::int64_t> strides,
                               std::int64_t offset, std::int64_t elements) {
  torch::Tensor t = torch::zeros({elements});
  t.unsafeGetTensorImpl()->set_sizes_and_strides(c10::IntArrayRef(sizes), c10::IntArrayRef(strides), offset);
  return t;
}

TEST(FitsStorage, ReachIsCheckedAtBothEndsWithoutOverflow) {
  using ampfuse::sdk::fits_storage;
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  EXPECT_TRUE(fits_storage({3, 4}, {4, 1}, 0, 4, 48));
  EXPECT_FALSE(fits_storage({3, 4}, {4, 1}, 0, 4, 47));
  EXPECT_FALSE(fits_storage({3, 4}, {4, 1}, 98, 4, 48));  // the fuzz's damaged offset
  EXPECT_TRUE(fits_storage({3, 4}, {4, 1}, 1, 2, 26));
  EXPECT_TRUE(fits_storage({4, 3}, {1, 4}, 0, 4, 48));     // transposed
  EXPECT_TRUE(fits_storage({5}, {0}, 11, 4, 48));          // expanded
  EXPECT_TRUE(fits_storage({4}, {-1}, 3, 4, 16));          // backwards, from the last element
  EXPECT_FALSE(fits_storage({4}, {-1}, 2, 4, 16));         // ... reaching before the first
  EXPECT_FALSE(fits_storage({2}, {1}, -1, 4, 16));
  EXPECT_FALSE(fits_storage({-2}, {1}, 0, 4, 16));
  EXPECT_FALSE(fits_storage({0, -1}, {1, 1}, 0, 4, 16));  // a negative size beside a zero one
  EXPECT_FALSE(fits_storage({0}, {1}, -1, 4, 16));        // no element, but a negative offset
  EXPECT_FALSE(fits_storage({3, 3}, {kMax, kMax}, 0, kMax, ~std::size_t{0}));  // reach times itemsize past 2^127
  EXPECT_FALSE(fits_storage({2, 2}, {1}, 0, 4, 16));       // sizes and strides of other lengths
  EXPECT_TRUE(fits_storage({0, 5}, {kMax, kMax}, kMax, 4, 0));  // no element: nothing is read
  EXPECT_TRUE(fits_storage({}, {}, 3, 4, 16));             // a scalar
  EXPECT_FALSE(fits_storage({}, {}, 4, 4, 16));
  EXPECT_FALSE(fits_storage({kMax, kMax}, {kMax, kMax}, 0, 8, ~std::size_t{0}));
  EXPECT_FALSE(fits_storage({2, kMax}, {kMax, 1}, kMax, 8, ~std::size_t{0}));
  EXPECT_FALSE(fits_storage({2}, {kMax}, 0, 1, ~std::size_t{0} / 4));
  EXPECT_FALSE(fits_storage({1}, {1}, kMax, 2, ~std::size_t{0}));  // one element, its byte offset past 2^64
  EXPECT_TRUE(fits_storage({std::int64_t{1} << 31, 3}, {3, 1}, 0, 2, std::size_t{6} << 31));  // past 2^31 elements
}

// A damaged file can give a tensor a storage offset or strides that reach
// outside the storage it holds. Reading it (LibTorch's reader does not check)
// would read past the storage's end: every tensor of a checkpoint is checked
// before anything reads one, and the load is refused naming where it is.
TEST_F(CheckpointTest, TensorsReachingOutsideTheirStorageAreRefused) {
  const std::string bytes = stepped(Kind::kAdam, seed_, 2).save();
  const std::vector<std::string> in_state = {"FusedAdam: param group 0, param 1: the checkpoint's tensor 'state/",
                                             "/exp_avg' (sizes [3, 4]", "reaches outside its storage of 48 bytes"};
  struct Case {
    const char* what;
    std::function<void(Tree&)> damage;
    std::vector<std::string> expected;
  };
  auto exp_avg = [](torch::Tensor t) { return [t](Tree& tree) { state_tree(tree, 0, 1).find("exp_avg")->tensor = t; }; };
  const Case cases[] = {
      {"storage offset", exp_avg(reaching_outside({3, 4}, {4, 1}, 98, 12)), in_state},
      {"stride", exp_avg(reaching_outside({3, 4}, {40, 1}, 0, 12)), in_state},
      {"stride past 2^63", exp_avg(reaching_outside({3, 4}, {std::int64_t{1} << 62, 1}, 0, 12)), in_state},
      {"a count of the layout, read before any state",
       [](Tree& tree) {
         torch::Tensor count = torch::full({1}, 2, torch::kLong);
         count.unsafeGetTensorImpl()->set_sizes_and_strides(c10::IntArrayRef{}, c10::IntArrayRef{}, 5);
         tree.find("param_groups")->sub->find("param_groups/size")->tensor = count;
       },
       {"FusedAdam: the checkpoint's tensor 'param_groups/param_groups/size'", "storage offset 5",
        "reaches outside its storage of 8 bytes"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Tree tree = read_tree(bytes);
    c.damage(tree);
    Rig victim = stepped(Kind::kAdam, seed_ + 3, 2);
    const Snapshot before = snapshot(victim);
    expect_refused(*victim.opt, write_tree(tree), c.expected);
    EXPECT_TRUE(same(before, snapshot(victim)));
  }
}

// A file's records may put two tensors in one storage: a damaged pickle
// naming another tensor's storage (the fuzz found one), or a hand-made file
// of views. A step would refuse such state (they share memory); the load
// refuses it first, naming both, and changes nothing. Views of one storage
// that share no element load, and step as the intact file does.
TEST_F(CheckpointTest, StateTensorsSharingMemoryAreRefusedDisjointViewsLoad) {
  const std::string bytes = stepped(Kind::kAdam, seed_, 2).save();
  const Tree intact = read_tree(bytes);
  const auto saved = [&](std::size_t g, std::size_t i, const char* key) {
    Tree copy = intact;
    return state_tree(copy, g, i).find(key)->tensor;
  };
  // One storage of 24 floats for param 1's exp_avg and exp_avg_sq ([3, 4]), at these offsets.
  const auto in_one_storage = [&](std::int64_t avg_at, std::int64_t sq_at) {
    torch::Tensor storage = torch::zeros({24});
    storage.narrow(0, avg_at, 12).copy_(saved(0, 1, "exp_avg").reshape({-1}));
    storage.narrow(0, sq_at, 12).copy_(saved(0, 1, "exp_avg_sq").reshape({-1}));
    return [storage, avg_at, sq_at](Tree& tree) {
      Tree& st = state_tree(tree, 0, 1);
      st.find("exp_avg")->tensor = storage.narrow(0, avg_at, 12).view({3, 4});
      st.find("exp_avg_sq")->tensor = storage.narrow(0, sq_at, 12).view({3, 4});
    };
  };
  struct Case {
    const char* what;
    std::function<void(Tree&)> change;
    std::vector<std::string> expected;  // empty: accepted
  };
  const Case cases[] = {
      {"one tensor saved as two states of a parameter",
       [&](Tree& tree) {
         Tree& st = state_tree(tree, 0, 1);
         st.find("exp_avg_sq")->tensor = st.find("exp_avg")->tensor;
       },
       {"FusedAdam: param group 0, param 1: the checkpoint's state exp_avg", "shares memory with state exp_avg",
        "of param group 0, param 1", "a damaged or hand-made checkpoint?"}},
      {"states of two parameters",
       [&](Tree& tree) {
         Tree& a = state_tree(tree, 0, 0);  // [5]
         Tree& b = state_tree(tree, 1, 0);  // [7]
         torch::Tensor storage = torch::zeros({12});
         storage.narrow(0, 0, 5).copy_(a.find("exp_avg")->tensor);
         storage.narrow(0, 3, 7).copy_(b.find("max_exp_avg_sq")->tensor);
         a.find("exp_avg")->tensor = storage.narrow(0, 0, 5);
         b.find("max_exp_avg_sq")->tensor = storage.narrow(0, 3, 7);
       },
       {"FusedAdam: param group 1, param 0: the checkpoint's state max_exp_avg_sq shares memory with state exp_avg "
        "of param group 0, param 0"}},
      {"overlapping views of one storage", in_one_storage(0, 6),
       {"FusedAdam: param group 0, param 1: the checkpoint's state exp_avg", "shares memory with state exp_avg"}},
      {"views of one storage that share no element", in_one_storage(12, 0), {}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Tree tree = read_tree(bytes);
    c.change(tree);
    const std::string changed = write_tree(tree);
    Rig victim = stepped(Kind::kAdam, seed_ + 3, 2);
    const Snapshot before = snapshot(victim);
    if (!c.expected.empty()) {
      expect_refused(*victim.opt, changed, c.expected);
      EXPECT_TRUE(same(before, snapshot(victim)));
      continue;
    }
    Rig twin = stepped(Kind::kAdam, seed_ + 3, 2);
    ASSERT_EQ(load_error(*victim.opt, changed), "");
    ASSERT_EQ(load_error(*twin.opt, bytes), "");
    std::mt19937_64 grads_victim(seed_ + 1), grads_twin(seed_ + 1);
    for (int s = 0; s < 3; ++s) {
      victim.step(grads_victim);
      twin.step(grads_twin);
    }
    for (std::size_t i = 0; i < victim.params.size(); ++i)
      EXPECT_TRUE(bitwise_equal(victim.params[i], twin.params[i])) << "param " << i;
  }

  // Beyond the moments: FusedLAMB's step counts (no step checks their
  // memory: each would be written into the other), a step count of one
  // element under a negative stride (which moves nothing: still looked at),
  // and the master copy that FusedAdam reads from beside the state, where
  // checkpoints of its earlier format keep it.
  const auto refused = [&](Kind k, const std::function<void(Tree&)>& change, const std::vector<std::string>& expected) {
    Tree tree = read_tree(stepped(k, seed_, 2).save());
    change(tree);
    Rig victim = stepped(k, seed_ + 3, 2);
    const Snapshot before = snapshot(victim);
    expect_refused(*victim.opt, write_tree(tree), expected);
    EXPECT_TRUE(same(before, snapshot(victim)));
  };
  {
    SCOPED_TRACE("FusedLAMB's step counts");
    refused(
        Kind::kLAMB,
        [](Tree& tree) { state_tree(tree, 1, 0).find("step")->tensor = state_tree(tree, 0, 0).find("step")->tensor; },
        {"FusedLAMB: param group 1, param 0: the checkpoint's state step shares memory with state step of param "
         "group 0, param 0"});
    refused(
        Kind::kLAMB,
        [](Tree& tree) {
          const torch::Tensor step = state_tree(tree, 0, 0).find("step")->tensor;
          torch::Tensor reversed = step.detach();  // (as_strided refuses a negative stride; a damaged file has one)
          reversed.unsafeGetTensorImpl()->set_sizes_and_strides(c10::IntArrayRef{1}, c10::IntArrayRef{-1},
                                                               step.storage_offset());
          state_tree(tree, 1, 0).find("step")->tensor = reversed;
        },
        {"FusedLAMB: param group 1, param 0: the checkpoint's state step shares memory with state step of param "
         "group 0, param 0"});
  }
  {
    SCOPED_TRACE("a master copy of the earlier format");
    refused(
        Kind::kAdamWMaster,
        [](Tree& tree) {
          Tree& st = state_tree(tree, 0, 1);
          const torch::Tensor exp_avg = st.find("exp_avg")->tensor;
          st.items.erase(std::find_if(st.items.begin(), st.items.end(),
                                      [](const Tree::Item& item) { return item.key == "master"; }));
          tree.items.push_back({"ampfuse_master_weights_0_1", nullptr, exp_avg, {}, true});
        },
        {"FusedAdamW: param group 0, param 1: the checkpoint's state (a tensor read from beside the state: an "
         "earlier format's key) shares memory with state exp_avg of param group 0, param 1"});
  }
}

// What ampfuse::verify_checkpoint says of `bytes`: "" when it accepts them.
std::string verify_error(const std::string& bytes) {
  std::istringstream in(bytes);
  try {
    ampfuse::verify_checkpoint(in);
    return "";
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
}

// LibTorch's reader checks no CRC-32: bytes damaged inside a tensor load as
// they are, and a record marked as a directory loads as unwritten memory.
// verify_checkpoint, run before torch::load, refuses both.
TEST_F(CheckpointTest, VerifyCheckpointAcceptsWhatTorchSaveWritesAndRefusesDamage) {
  for (Kind k : kKinds) EXPECT_EQ(verify_error(stepped(k, seed_, 2).save()), "") << kind_name(k);
  ampfuse::GradScaler scaler;
  std::ostringstream scaler_file;
  torch::save(scaler, scaler_file);
  EXPECT_EQ(verify_error(scaler_file.str()), "");

  Rig rig = stepped(Kind::kAdam, seed_, 2);
  const std::string bytes = rig.save();
  // The whole stream, as torch::load reads it; the position is put back.
  std::istringstream in(bytes);
  in.seekg(7);
  EXPECT_NO_THROW(ampfuse::verify_checkpoint(in));
  EXPECT_EQ(in.tellg(), std::streampos(7));
  torch::load(*rig.opt, in);  // and the stream still loads
  // A stream at its end (end-of-file flag alone) is read whole; a failed one is refused.
  std::istringstream at_end(bytes);
  at_end.setstate(std::ios::eofbit);
  EXPECT_NO_THROW(ampfuse::verify_checkpoint(at_end));
  std::istringstream failed(bytes);
  failed.setstate(std::ios::failbit);
  EXPECT_THROW(ampfuse::verify_checkpoint(failed), c10::Error);

  // A byte inside param 1's exp_avg (found by its bits): LibTorch loads the damaged value.
  const auto& state = static_cast<const ampfuse::FusedAdamParamState&>(
      *rig.opt->state().at(rig.params[1].unsafeGetTensorImpl()));
  const torch::Tensor exp_avg = state.exp_avg().contiguous();
  const std::string bits(static_cast<const char*>(exp_avg.data_ptr()), exp_avg.nbytes());
  const std::size_t at = bytes.find(bits);
  ASSERT_NE(at, std::string::npos);
  std::string damaged = bytes;
  damaged[at + 5] = static_cast<char>(damaged[at + 5] ^ 0x10);
  Rig victim = stepped(Kind::kAdam, seed_ + 3, 2);
  EXPECT_EQ(load_error(*victim.opt, damaged), "") << "LibTorch's reader checks CRC-32s now: the docs need updating";
  EXPECT_THAT(verify_error(damaged), ::testing::AllOf(::testing::HasSubstr("verify_checkpoint: record 'archive/data/"),
                                                      ::testing::HasSubstr("its bytes are damaged")));
  // A record marked as a directory in the central directory.
  damaged = bytes;
  const std::size_t entry = damaged.find("PK\x01\x02");
  ASSERT_NE(entry, std::string::npos);
  damaged[entry + 38] = static_cast<char>(damaged[entry + 38] | 0x10);
  EXPECT_THAT(verify_error(damaged), ::testing::HasSubstr("is marked as a directory"));
  // CRC-32s not written (Python's compute_crc32 = False records 0 for every record): the layout is
  // checked; one record's CRC-32 zeroed in a file that has them is damage.
  std::string no_crcs = bytes, one_zeroed = bytes;
  bool zeroed = false;
  for (std::size_t e = bytes.find("PK\x01\x02"); e != std::string::npos; e = bytes.find("PK\x01\x02", e + 4)) {
    std::fill_n(no_crcs.begin() + static_cast<std::ptrdiff_t>(e + 16), 4, '\0');
    if (!zeroed && bytes.compare(e + 46, 13, "archive/data/") == 0) {
      std::fill_n(one_zeroed.begin() + static_cast<std::ptrdiff_t>(e + 16), 4, '\0');
      zeroed = true;
    }
  }
  ASSERT_TRUE(zeroed);
  EXPECT_EQ(verify_error(no_crcs), "");
  EXPECT_THAT(verify_error(one_zeroed), ::testing::HasSubstr("its bytes are damaged"));
  // A compressed record whose size says it inflates past what deflate can:
  // LibTorch's reader would allocate that size first.
  std::size_t compressed_entry = std::string::npos;
  for (std::size_t e = bytes.find("PK\x01\x02"); e != std::string::npos; e = bytes.find("PK\x01\x02", e + 4))
    if (bytes[e + 10] == 8 && bytes[e + 11] == 0) {
      compressed_entry = e;
      break;
    }
  ASSERT_NE(compressed_entry, std::string::npos) << "torch::save compressed no record";
  damaged = bytes;
  std::fill_n(damaged.begin() + static_cast<std::ptrdiff_t>(compressed_entry + 24), 3, '\xFF');
  EXPECT_THAT(verify_error(damaged), ::testing::HasSubstr("more than deflate can"));
  // Every byte of the central directory and the end records, flipped: each
  // file is refused with a c10::Error or accepted, never read out of bounds
  // (this test runs under AddressSanitizer too).
  const std::size_t directory = bytes.find("PK\x01\x02");
  int sweep_refused = 0;
  for (std::size_t at = directory; at < bytes.size(); ++at) {
    damaged = bytes;
    damaged[at] = static_cast<char>(~damaged[at]);
    sweep_refused += verify_error(damaged).empty() ? 0 : 1;
  }
  std::cout << "[ verify   ] " << sweep_refused << " of " << bytes.size() - directory
            << " flipped bytes of the central directory and end records refused\n";
  EXPECT_GT(sweep_refused, static_cast<int>(bytes.size() - directory) / 4);
  // Truncated, anywhere.
  for (const std::size_t n : {std::size_t{0}, std::size_t{10}, bytes.size() / 2, bytes.size() - 1})
    EXPECT_NE(verify_error(bytes.substr(0, n)), "") << "truncated to " << n << " bytes";
  // A file on disk, and a missing one.
  const std::string path = ::testing::TempDir() + "ampfuse_verify_checkpoint.pt";
  torch::save(*rig.opt, path);
  EXPECT_NO_THROW(ampfuse::verify_checkpoint(path));
  EXPECT_THROW(ampfuse::verify_checkpoint(path + ".missing"), c10::Error);
  std::remove(path.c_str());
}

TEST_F(CheckpointTest, LoadCheckpointLoadsAnIntactFileAndLeavesEverythingAsItWasForADamagedOne) {
  Rig saved = stepped(Kind::kAdam, seed_, 3);
  const std::string bytes = saved.save();
  const std::string path = ::testing::TempDir() + "ampfuse_load_checkpoint.pt";
  {
    std::ofstream out(path, std::ios::binary);
    out << bytes;
  }
  // Intact: the same state as torch::load gives, from a path and from a stream.
  Rig by_torch = stepped(Kind::kAdam, seed_ + 1, 1), by_path = stepped(Kind::kAdam, seed_ + 1, 1),
      by_stream = stepped(Kind::kAdam, seed_ + 1, 1);
  torch::load(*by_torch.opt, path);
  ampfuse::load_checkpoint(*by_path.opt, path);
  std::istringstream in(bytes);
  ampfuse::load_checkpoint(*by_stream.opt, in);
  const Snapshot want = snapshot(by_torch);
  EXPECT_TRUE(same_values(snapshot(by_path), want));
  EXPECT_TRUE(same_values(snapshot(by_stream), want));
  // The scaler too.
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(1024.0)), loaded;
  scaler.scale(torch::ones({1}));
  std::ostringstream scaler_file;
  torch::save(scaler, scaler_file);
  std::istringstream scaler_in(scaler_file.str());
  ampfuse::load_checkpoint(loaded, scaler_in);
  EXPECT_EQ(loaded.get_scale(), 1024.0);

  // One byte of a moment flipped: torch::load would take it; load_checkpoint refuses it and changes nothing.
  const auto& state = static_cast<const ampfuse::FusedAdamParamState&>(
      *saved.opt->state().at(saved.params[0].unsafeGetTensorImpl()));
  const torch::Tensor exp_avg_sq = state.exp_avg_sq().contiguous();
  const std::size_t at =
      bytes.find(std::string(static_cast<const char*>(exp_avg_sq.data_ptr()), exp_avg_sq.nbytes()));
  ASSERT_NE(at, std::string::npos);
  std::string damaged = bytes;
  damaged[at + 3] = static_cast<char>(damaged[at + 3] ^ 0x40);
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << damaged;
  }
  Rig victim = stepped(Kind::kAdam, seed_ + 2, 2);
  const Snapshot before = snapshot(victim);
  try {
    ampfuse::load_checkpoint(*victim.opt, path);
    ADD_FAILURE() << "a damaged file was loaded";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), ::testing::HasSubstr("its bytes are damaged"));
  }
  EXPECT_TRUE(same(before, snapshot(victim)));
  std::remove(path.c_str());
  try {
    ampfuse::load_checkpoint(*victim.opt, path);
    ADD_FAILURE() << "a missing file was loaded";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), ::testing::HasSubstr("cannot open " + path));
  }
  EXPECT_TRUE(same(before, snapshot(victim)));
}

TEST_F(CheckpointTest, MissingOrUnknownKeysAreRefusedNamingTheKey) {
  struct Case {
    Kind kind;
    std::string remove, add;  // in the state of group 0, param 1
    std::string expected;
  };
  const std::vector<Case> cases = {
      {Kind::kAdam, "exp_avg", "", "FusedAdam: param group 0, param 1: state exp_avg is missing"},
      {Kind::kAdam, "step", "", "FusedAdam: param group 0, param 1: the checkpoint's state could not be read"},
      {Kind::kAdam, "", "momentum_buffer", "FusedAdam: param group 0, param 1: the checkpoint's state has the key "
                                           "'momentum_buffer'"},
      {Kind::kLAMB, "exp_avg_sq", "", "FusedLAMB: param group 0, param 1: state exp_avg_sq is missing"},
      {Kind::kLAMB, "step", "", "FusedLAMB: param group 0, param 1: state step must be"},
      {Kind::kAdagrad, "sum", "", "FusedAdagrad: param group 0, param 1: state sum is missing"},
      {Kind::kRMSprop, "square_avg", "", "FusedRMSprop: param group 0, param 1: state square_avg is missing"},
      {Kind::kSGD, "", "exp_avg", "FusedSGD: param group 0, param 1: the checkpoint's state has the key 'exp_avg'"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.expected);
    Tree tree = read_tree(stepped(c.kind, seed_, 2).save());
    Tree& st = state_tree(tree, 0, 1);
    if (!c.remove.empty()) {
      auto& items = st.items;
      items.erase(std::remove_if(items.begin(), items.end(), [&](const auto& i) { return i.key == c.remove; }),
                  items.end());
    }
    if (!c.add.empty()) st.items.push_back({c.add, nullptr, torch::zeros({3, 4}), {}, true});
    Rig victim = stepped(c.kind, seed_ + 5, 2);
    const Snapshot before = snapshot(victim);
    expect_refused(*victim.opt, write_tree(tree), {c.expected});
    EXPECT_TRUE(same(before, snapshot(victim)));
  }
  // An option missing: the group is named, and the keys the checkpoint has.
  Tree tree = read_tree(stepped(Kind::kSGD, seed_, 2).save());
  Tree& group1 = *tree.find("param_groups")->sub->find("param_groups/1")->sub;
  auto& options = group1.find("options")->sub->items;
  options.erase(std::remove_if(options.begin(), options.end(), [](const auto& i) { return i.key == "momentum"; }),
                options.end());
  Rig victim = stepped(Kind::kSGD, seed_ + 5, 2);
  const Snapshot before = snapshot(victim);
  expect_refused(*victim.opt, write_tree(tree),
                 {"FusedSGD: param group 1: the checkpoint's options could not be read as FusedSGD's", "its keys: lr"});
  EXPECT_TRUE(same(before, snapshot(victim)));
}

TEST_F(CheckpointTest, OtherCountsOfGroupsOrParamsAreRefused) {
  Rig source = stepped(Kind::kRMSprop, seed_, 2);
  const std::string bytes = source.save();
  // One group of three parameters.
  {
    auto params = ampfuse_test::leaf_copies(source.params);
    ampfuse::FusedRMSprop one(params, torch::optim::RMSpropOptions(0.01));
    expect_refused(one, bytes, {"FusedRMSprop: the checkpoint has 2 param groups but the optimizer has 1"});
    EXPECT_TRUE(one.state().empty());
  }
  // Two groups, the first with one parameter fewer.
  {
    auto params = ampfuse_test::leaf_copies(source.params);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<torch::Tensor>{params[0]});
    groups.emplace_back(std::vector<torch::Tensor>{params[2]});
    ampfuse::FusedRMSprop two(groups, torch::optim::RMSpropOptions(0.01));
    expect_refused(two, bytes, {"FusedRMSprop: param group 0: the checkpoint has 2 params but the optimizer's group "
                                "has 1"});
  }
  // A checkpoint whose two parameters have one key; a state that no parameter names.
  Tree tree = read_tree(bytes);
  Tree& group0 = *tree.find("param_groups")->sub->find("param_groups/0")->sub;
  group0.find("params/1")->value = group0.find("params/0")->value;
  Rig victim = stepped(Kind::kRMSprop, seed_ + 1, 2);
  const Snapshot before = snapshot(victim);
  expect_refused(*victim.opt, write_tree(tree),
                 {"FusedRMSprop: param group 0, param 1 has the same key in the checkpoint as param group 0, param 0"});
  Tree orphan = read_tree(bytes);
  Tree& states = *orphan.find("state")->sub;
  states.items.push_back(states.items.front());
  states.items.back().key = "12345";
  expect_refused(*victim.opt, write_tree(orphan),
                 {"FusedRMSprop: the checkpoint has a state under the key 12345 that none of its param groups names"});
  EXPECT_TRUE(same(before, snapshot(victim)));
}

// A refused load leaves the step plan as it was (the next step reuses it),
// and the load that follows it and is accepted replaces the whole state:
// a parameter the checkpoint holds no state for has none.
TEST_F(CheckpointTest, RefusedLoadKeepsTheStepPlanAcceptedLoadReplacesTheWholeState) {
  Rig victim = stepped(Kind::kAdam, seed_, 3);
  Rig twin = stepped(Kind::kAdam, seed_, 3);
  Tree tree = read_tree(stepped(Kind::kAdam, seed_ + 1, 2).save());
  state_tree(tree, 1, 0).find("exp_avg")->tensor = torch::zeros({3});
  expect_refused(*victim.opt, write_tree(tree), {"FusedAdam: param group 1, param 0: state exp_avg has shape [3]"});
  std::mt19937_64 a(seed_ + 9), b(seed_ + 9);
  victim.step(a);
  twin.step(b);
  EXPECT_EQ(victim.last_plan_match(), ampfuse::sdk::PlanMatch::kSame) << "a refused load changed the step plan";
  for (std::size_t i = 0; i < victim.params.size(); ++i) EXPECT_TRUE(bitwise_equal(victim.params[i], twin.params[i]));

  // Accepted: the checkpoint without the state of group 1's parameter.
  Tree partial = read_tree(stepped(Kind::kAdam, seed_ + 1, 2).save());
  Tree& states = *partial.find("state")->sub;
  const std::string key = partial.find("param_groups")->sub->find("param_groups/1")->sub->find("params/0")->value
                              .toStringRef();
  states.items.erase(std::remove_if(states.items.begin(), states.items.end(), [&](const auto& i) { return i.key == key; }),
                     states.items.end());
  ASSERT_EQ(load_error(*victim.opt, write_tree(partial)), "");
  EXPECT_EQ(victim.opt->state().count(victim.params[2].unsafeGetTensorImpl()), 0u);
  EXPECT_EQ(victim.opt->state().size(), 2u);
  victim.step(a);
  EXPECT_EQ(victim.last_plan_match(), ampfuse::sdk::PlanMatch::kChanged);
}

// A scale that backed off to 0 (below fp32's range) or was set to inf by
// update(new_scale) is what update() makes: saved and loaded, as PyTorch's
// state_dict does. It was refused at load.
TEST_F(CheckpointTest, GradScalerLoadsTheScalesUpdateCanMake) {
  for (const double value : {0.0, std::numeric_limits<double>::infinity()}) {
    SCOPED_TRACE(value);
    ampfuse::GradScaler source;
    source.scale(torch::ones({}));
    source.update(value);
    std::stringstream file;
    torch::save(source, file);
    ampfuse::GradScaler loaded;
    torch::load(loaded, file);
    EXPECT_EQ(loaded.get_scale(), value);
  }
}

// A NaN option is refused at load, naming the group and the option (LAMB's
// own checks refuse it too), and changes nothing: loaded, a NaN lr made every
// parameter NaN at the next step. Values that LibTorch's constructors refuse
// only in their defaults (nesterov with dampening in a group, a negative lr)
// can be stepped and saved, and load, as into LibTorch.
TEST_F(CheckpointTest, NanOptionsAreRefusedAtLoadOtherValuesLoadAsIntoLibTorch) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  struct Case {
    Kind kind;
    std::string key;
    c10::IValue value;
    std::string expected;  // empty: accepted
  };
  const std::vector<Case> cases = {
      {Kind::kAdam, "lr", c10::IValue(nan), "FusedAdam: param group 1 of the checkpoint: lr is nan"},
      {Kind::kAdam, "betas", c10::IValue(std::make_tuple(0.9, nan)), "FusedAdam: param group 1 of the checkpoint: betas[1] is nan"},
      {Kind::kAdamWMaster, "weight_decay", c10::IValue(nan), "FusedAdamW: param group 1 of the checkpoint: weight_decay is nan"},
      {Kind::kSGD, "dampening", c10::IValue(nan), "FusedSGD: param group 1 of the checkpoint: dampening is nan"},
      {Kind::kAdagrad, "lr_decay", c10::IValue(nan), "FusedAdagrad: param group 1 of the checkpoint: lr_decay is nan"},
      {Kind::kRMSprop, "alpha", c10::IValue(nan), "FusedRMSprop: param group 1 of the checkpoint: alpha is nan"},
      {Kind::kLAMB, "lr", c10::IValue(nan), "FusedLAMB: param group 1: invalid lr nan"},
      {Kind::kAdam, "lr", c10::IValue(-0.01), ""},
      {Kind::kSGD, "nesterov", c10::IValue(true), ""},  // with the saved momentum 0.9 and a dampening set below
      {Kind::kRMSprop, "momentum", c10::IValue(0.0), ""},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(kind_name(c.kind) + " " + c.key);
    const std::string bytes = stepped(c.kind, seed_, 2).save();
    Tree tree = read_tree(bytes);
    Tree& options = *tree.find("param_groups")->sub->find("param_groups/1")->sub->find("options")->sub;
    Tree::Item* item = options.find(c.key);
    ASSERT_NE(item, nullptr);
    item->value = c.value;
    if (c.key == "nesterov") options.find("dampening")->value = c10::IValue(0.1);
    Rig victim = stepped(c.kind, seed_ + 3, 2);
    const Snapshot before = snapshot(victim);
    if (c.expected.empty()) {
      EXPECT_EQ(load_error(*victim.opt, write_tree(tree)), "");
      std::mt19937_64 rng(seed_);
      victim.step(rng);  // and steps
    } else {
      expect_refused(*victim.opt, write_tree(tree), {c.expected});
      EXPECT_TRUE(same(before, snapshot(victim)));
    }
  }
}

// A LAMB step count that is not a whole number from 0 (NaN, negative,
// fractional, infinite) is refused at load, naming the parameter: NaN and
// negative counts made every parameter NaN at the next step.
TEST_F(CheckpointTest, LambStepCountsThatAreNotWholeNumbersAreRefused) {
  const std::string bytes = stepped(Kind::kLAMB, seed_, 2).save();
  for (double step : {std::numeric_limits<double>::quiet_NaN(), -3.0, 2.5, std::numeric_limits<double>::infinity()}) {
    SCOPED_TRACE(step);
    Tree tree = read_tree(bytes);
    Tree::Item* item = state_tree(tree, 1, 0).find("step");
    ASSERT_NE(item, nullptr);
    item->tensor = torch::full({1}, step, torch::kDouble);
    Rig victim = stepped(Kind::kLAMB, seed_ + 3, 2);
    const Snapshot before = snapshot(victim);
    expect_refused(*victim.opt, write_tree(tree),
                   {"FusedLAMB: param group 1, param 0: state step is", "it counts steps: a whole number from 0"});
    EXPECT_TRUE(same(before, snapshot(victim)));
  }
}

TEST_F(CheckpointTest, GradScalerRefusesWhatDoesNotFitAndChangesNothing) {
  ampfuse::GradScaler source(ampfuse::GradScalerOptions().init_scale(1024.0).growth_interval(4));
  source.scale(torch::ones({}));
  std::ostringstream file;
  torch::save(source, file);
  const std::string bytes = file.str();
  struct Case {
    std::string key;
    c10::IValue value;  // None: remove the key
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"scale", c10::IValue(-2.0), "GradScaler::load: 'scale' is -2"},
      {"scale", c10::IValue(std::numeric_limits<double>::quiet_NaN()), "GradScaler::load: 'scale' is nan"},
      {"_growth_tracker", c10::IValue(std::int64_t{1} << 31), "'_growth_tracker' is 2147483648"},
      {"_growth_tracker", c10::IValue(std::int64_t{-1}), "'_growth_tracker' is -1"},
      {"backoff_factor", c10::IValue(0.0), "GradScaler::load: ampfuse::GradScaler: backoff_factor is 0"},
      {"growth_factor", c10::IValue(std::numeric_limits<double>::infinity()),
       "GradScaler::load: ampfuse::GradScaler: growth_factor is inf"},
      {"growth_interval", c10::IValue(std::int64_t{0}), "GradScaler::load: ampfuse::GradScaler: growth_interval is 0"},
      {"growth_interval", c10::IValue(), "GradScaler::load: the archive has no 'growth_interval'"},
      {"extra", c10::IValue(1.0), "GradScaler::load: the archive has the key 'extra'"},
      {"scale", c10::IValue(std::int64_t{8}), "GradScaler::load: 'scale' is a Int, expected a float"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.expected);
    Tree tree = read_tree(bytes);
    Tree::Item* item = tree.find(c.key);
    if (c.value.isNone()) {
      tree.items.erase(tree.items.begin() + (item - tree.items.data()));
    } else if (item == nullptr) {
      tree.items.push_back({c.key, nullptr, {}, c.value, false});
    } else {
      item->value = c.value;
    }
    ampfuse::GradScaler target(ampfuse::GradScalerOptions().init_scale(8.0));
    target.scale(torch::ones({}));
    expect_refused(target, write_tree(tree), {c.expected});
    EXPECT_EQ(target.get_scale(), 8.0);
    EXPECT_EQ(target.get_growth_tracker(), 0);
    EXPECT_EQ(target.options().growth_interval(), 2000);
  }
  // Truncated.
  ampfuse::GradScaler target;
  EXPECT_FALSE(load_error(target, bytes.substr(0, bytes.size() / 2)).empty());
  EXPECT_EQ(target.get_scale(), 65536.0);
}

#if defined(AMPFUSE_WITH_CUDA)
// State saved on CPU and loaded into an optimizer of CUDA parameters without
// a device to map it to: refused at load, naming the device.
TEST_F(CheckpointTest, StateOnAnotherDeviceIsRefused) {
  if (!ampfuse_test::cuda_available()) GTEST_SKIP() << "no CUDA device here; this test runs on a GPU machine";
  Rig source = stepped(Kind::kAdam, seed_, 2);
  std::vector<torch::Tensor> params;
  for (const auto& p : source.params) params.push_back(p.detach().cuda().requires_grad_());
  ampfuse::FusedAdam target(params, torch::optim::AdamOptions(0.01));
  expect_refused(target, source.save(), {"FusedAdam: param group 0, param 0: state exp_avg", "on cpu, strides"});
  EXPECT_TRUE(target.state().empty());
}
#endif

// ---------------------------------------------------------------------------
// The fuzz test.

// Whether a central-directory entry of a zip file (found by its signature,
// a superset of those the reader walks) has the directory attribute (bit 4
// of its external attributes). LibTorch's zip reader (miniz) reads such a
// record as empty without writing the buffer it allocated for its bytes, so
// a file damaged there loads tensors of unwritten memory: no load() can tell
// those from data (docs/optimizers.md, "Checkpoints"), and the fuzz counts
// such files instead of loading them.
bool marks_a_directory(const std::string& bytes) {
  constexpr std::size_t kExternalAttributes = 38;
  for (std::size_t at = bytes.find("PK\x01\x02"); at != std::string::npos; at = bytes.find("PK\x01\x02", at + 1))
    if (at + kExternalAttributes < bytes.size() && (static_cast<unsigned char>(bytes[at + kExternalAttributes]) & 0x10))
      return true;
  return false;
}

// Whether a byte-damaged file is kept from torch::load in this build: under
// AddressSanitizer, those verify_checkpoint refuses. A damaged size field can
// make LibTorch's zip reader allocate tens of GiB (49 GiB seen), which a plain
// build refuses with std::bad_alloc (the load throws, as this test expects)
// but ASan reports as a fatal out-of-memory: its operator new cannot throw.
// The reader is LibTorch's code; the damaged files verify_checkpoint accepts,
// which reach the optimizers' own load, are still loaded.
bool kept_from_load(const std::string& bytes) {
#if defined(__SANITIZE_ADDRESS__)
  return !verify_error(bytes).empty();
#else
  (void)bytes;
  return false;
#endif
}

// Byte mutations of a saved file: truncation, flipped bytes, a run of random bytes.
std::string mutate_bytes(std::string bytes, std::mt19937_64& rng) {
  const auto n = bytes.size();
  switch (rng() % 3) {
    case 0: return bytes.substr(0, rng() % n);
    case 1:
      for (int k = 1 + static_cast<int>(rng() % 4); k > 0; --k) bytes[rng() % n] ^= static_cast<char>(1 + rng() % 255);
      return bytes;
    default: {
      const std::size_t at = rng() % n, len = 1 + rng() % 64;
      for (std::size_t i = at; i < std::min(n, at + len); ++i) bytes[i] = static_cast<char>(rng());
      return bytes;
    }
  }
}

// Every item of a tree, with the tree that holds it.
void collect(Tree& tree, std::vector<std::pair<Tree*, std::size_t>>& out) {
  for (std::size_t i = 0; i < tree.items.size(); ++i) {
    out.emplace_back(&tree, i);
    if (tree.items[i].sub) collect(*tree.items[i].sub, out);
  }
}

// One structural mutation: a tensor's shape or dtype, a value's type or a
// count, a key removed, renamed or added, or a tensor made another's (one
// tensor under two keys, as a damaged pickle can name another's storage).
void mutate_tree(Tree& root, std::mt19937_64& rng) {
  std::vector<std::pair<Tree*, std::size_t>> all;
  collect(root, all);
  auto [tree, index] = all[rng() % all.size()];
  Tree::Item& item = tree->items[index];
  const bool ends_in_size = item.key.size() >= 4 && item.key.compare(item.key.size() - 4, 4, "size") == 0;
  switch (rng() % 7) {
    case 6: {  // another tensor's (of the same shape where one has it)
      std::vector<const Tree::Item*> same, any;
      for (const auto& [t, i] : all) {
        const Tree::Item& other = t->items[i];
        if (!other.is_tensor || &other == &item) continue;
        any.push_back(&other);
        if (item.is_tensor && other.tensor.sizes() == item.tensor.sizes()) same.push_back(&other);
      }
      const std::vector<const Tree::Item*>& pick = same.empty() ? any : same;
      if (!pick.empty()) {
        item.tensor = pick[rng() % pick.size()]->tensor;
        item.is_tensor = true;
        item.sub = nullptr;
        return;
      }
      [[fallthrough]];
    }
    case 0:  // shape
      if (item.is_tensor) {
        item.tensor = item.tensor.numel() > 1 && rng() % 2 ? item.tensor.reshape({-1}).narrow(0, 0, item.tensor.numel() - 1)
                                                           : torch::zeros({item.tensor.numel() + 1}).to(item.tensor.dtype());
        return;
      }
      [[fallthrough]];
    case 1:  // dtype, or a count off by one
      if (item.is_tensor) {
        if (ends_in_size) {
          item.tensor = item.tensor + (rng() % 2 ? 1 : -1);
        } else {
          const torch::Dtype types[] = {torch::kDouble, torch::kHalf, torch::kInt, torch::kFloat};
          item.tensor = item.tensor.to(types[rng() % 4]);
        }
        return;
      }
      [[fallthrough]];
    case 2:  // a value of another type
      if (item.is_tensor) {
        item.is_tensor = false;
        item.tensor = torch::Tensor();
        item.value = c10::IValue(std::int64_t{3});
      } else if (!item.sub) {
        item.is_tensor = rng() % 2 == 0;
        if (item.is_tensor)
          item.tensor = torch::ones({2});
        else
          item.value = item.value.isString() ? c10::IValue(1.5) : c10::IValue(std::string("17"));
      }
      return;
    case 3:  // removed
      tree->items.erase(tree->items.begin() + static_cast<std::ptrdiff_t>(index));
      return;
    case 4:  // renamed
      item.key = rng() % 2 ? std::to_string(rng() % 1000000) : item.key + "_x";
      return;
    default:  // added
      tree->items.push_back({"extra_" + std::to_string(rng() % 100), nullptr, torch::zeros({2}), {}, true});
      return;
  }
}

// The fuzz: archives of every optimizer (and of the GradScaler) after a few
// steps, mutated in bytes and in structure, loaded into a stepped
// optimizer. Each load is refused (a c10::Error; the optimizer bit-identical,
// its step plan kept: the next step equals its twin's, which never saw the
// load) or accepted whole (then the twin loads it too, and both step alike).
TEST_F(CheckpointTest, FuzzedArchivesAreRefusedWholeOrAcceptedWhole) {
  std::mt19937_64 rng(seed_);
  constexpr int kBytesPerKind = 25, kTreesPerKind = 40, kScaler = 50;
  int iterations = 0, refused = 0, accepted = 0, bytes_refused = 0, reader_refused = 0, directories = 0;
  int bytes_accepted = 0, verify_refused = 0, kept_from_loading = 0, shared_refused = 0;
  std::vector<std::string> files;
  for (Kind k : kKinds) files.push_back(canonical(stepped(k, seed_ + 100, 3).save()));
  for (std::size_t a = 0; a < std::size(kKinds); ++a) {
    const Kind k = kKinds[a];
    SCOPED_TRACE(kind_name(k));
    Rig victim = stepped(k, seed_, 2), twin = stepped(k, seed_, 2);
    std::mt19937_64 grads_victim(seed_ + 1), grads_twin(seed_ + 1);
    for (int it = 0; it < kBytesPerKind + kTreesPerKind; ++it) {
      std::string bytes;
      if (it < kBytesPerKind) {
        // Mostly this kind's file; sometimes another optimizer's, damaged or not.
        const std::size_t from = rng() % 4 == 0 ? rng() % files.size() : a;
        bytes = rng() % 8 == 0 ? files[from] : mutate_bytes(files[from], rng);
        if (marks_a_directory(bytes)) {
          ++directories;
          EXPECT_NE(verify_error(bytes), "") << "iteration " << it << ": verify_checkpoint took a directory record";
          continue;
        }
        if (kept_from_load(bytes)) {
          ++kept_from_loading;
          continue;
        }
      } else {
        Tree tree = read_tree(files[a]);
        for (int m = 1 + static_cast<int>(rng() % 2); m > 0; --m) mutate_tree(tree, rng);
        try {
          bytes = write_tree(tree);
        } catch (const c10::Error&) {
          continue;  // a tree the archive writer refuses: not a file anyone can load
        }
      }
      ++iterations;
      const Snapshot before = snapshot(victim);
      std::string message;
      bool threw_other = false;
      {
        std::istringstream in(bytes);
        try {
          torch::load(*victim.opt, in);
        } catch (const c10::Error& e) {
          message = e.what_without_backtrace();
          if (message.empty()) message = "?";
        } catch (const std::exception& e) {
          // Only the archive reader (before any optimizer code runs) may throw other types.
          message = e.what();
          threw_other = true;
        }
      }
      if (!message.empty()) {
        ++refused;
        shared_refused += message.find("shares memory with") != std::string::npos ? 1 : 0;
        ASSERT_TRUE(same(before, snapshot(victim))) << "iteration " << it << ": a refused load changed the optimizer: "
                                                    << message;
        if (threw_other || it < kBytesPerKind) {
          torch::serialize::InputArchive archive;
          std::istringstream in(bytes);
          bool read = true;
          try {
            archive.load_from(in);
          } catch (...) {
            read = false;
          }
          bytes_refused += it < kBytesPerKind ? 1 : 0;
          reader_refused += read || it >= kBytesPerKind ? 0 : 1;
          // The optimizer's own load throws c10::Error only: a file the archive reader accepted must not get here.
          EXPECT_FALSE(read && threw_other) << "iteration " << it << ": load() threw a non-c10 error: " << message;
        }
      } else {
        ++accepted;
        ASSERT_EQ(load_error(*twin.opt, bytes), "") << "iteration " << it;
        if (it < kBytesPerKind && bytes != files[a]) {
          ++bytes_accepted;
          verify_refused += verify_error(bytes).empty() ? 0 : 1;
        }
      }
      victim.step(grads_victim);
      twin.step(grads_twin);
      if (!message.empty())
        EXPECT_NE(victim.last_plan_match(), ampfuse::sdk::PlanMatch::kChanged)
            << "iteration " << it << ": a refused load changed the step plan";
      for (std::size_t i = 0; i < victim.params.size(); ++i)
        ASSERT_TRUE(bitwise_equal(victim.params[i], twin.params[i])) << "iteration " << it << ", param " << i;
    }
  }

  // The GradScaler: its file after a few steps, mutated alike; after each
  // load, a scaled step of an optimizer and an update() by the scaler and
  // by its twin.
  auto make_scaler = [] { return ampfuse::GradScaler(ampfuse::GradScalerOptions().init_scale(256.0).growth_interval(3)); };
  auto run = [](ampfuse::GradScaler& scaler, Rig& rig, std::mt19937_64& grads) {
    scaler.scale(torch::ones({}));
    std::normal_distribution<float> normal;
    {
      torch::NoGradGuard no_grad;
      for (auto& p : rig.params) p.mutable_grad().fill_(normal(grads) * static_cast<float>(scaler.get_scale()));
    }
    scaler.step(*rig.opt);
    scaler.update();
  };
  Rig source_rig(Kind::kSGD, seed_ + 2), victim_rig(Kind::kSGD, seed_ + 3), twin_rig(Kind::kSGD, seed_ + 3);
  auto source = make_scaler(), victim = make_scaler(), twin = make_scaler();
  std::mt19937_64 g0(seed_), g1(seed_ + 4), g2(seed_ + 4);
  for (int s = 0; s < 5; ++s) run(source, source_rig, g0);
  std::ostringstream file;
  torch::save(source, file);
  for (int it = 0; it < kScaler; ++it) {
    std::string bytes;
    if (it % 2 == 0) {
      bytes = mutate_bytes(file.str(), rng);
      if (marks_a_directory(bytes)) {
        ++directories;
        continue;
      }
      if (kept_from_load(bytes)) {
        ++kept_from_loading;
        continue;
      }
    } else {
      Tree tree = read_tree(file.str());
      mutate_tree(tree, rng);
      if (rng() % 3 == 0 && !tree.items.empty()) {  // a value out of range
        Tree::Item& item = tree.items[rng() % tree.items.size()];
        if (item.value.isDouble()) item.value = c10::IValue(rng() % 2 ? -1.0 : std::numeric_limits<double>::infinity());
        if (item.value.isInt()) item.value = c10::IValue(std::int64_t{-5});
      }
      try {
        bytes = write_tree(tree);
      } catch (const c10::Error&) {
        continue;
      }
    }
    ++iterations;
    const double scale = victim.get_scale();
    const std::int64_t tracker = victim.get_growth_tracker();
    const auto options = victim.options();
    const std::string message = [&] {
      std::istringstream in(bytes);
      try {
        torch::load(victim, in);
        return std::string();
      } catch (const std::exception& e) {
        return std::string("refused: ") + e.what();
      }
    }();
    if (!message.empty()) {
      ++refused;
      ASSERT_EQ(victim.get_scale(), scale) << message;
      ASSERT_EQ(victim.get_growth_tracker(), tracker) << message;
      ASSERT_EQ(victim.options().growth_interval(), options.growth_interval()) << message;
      ASSERT_EQ(victim.options().growth_factor(), options.growth_factor()) << message;
      ASSERT_EQ(victim.options().backoff_factor(), options.backoff_factor()) << message;
    } else {
      ++accepted;
      ASSERT_EQ(load_error(twin, bytes), "") << "iteration " << it;
    }
    run(victim, victim_rig, g1);
    run(twin, twin_rig, g2);
    ASSERT_EQ(victim.get_scale(), twin.get_scale()) << "iteration " << it;
    ASSERT_EQ(victim.get_growth_tracker(), twin.get_growth_tracker()) << "iteration " << it;
    for (std::size_t i = 0; i < victim_rig.params.size(); ++i)
      ASSERT_TRUE(bitwise_equal(victim_rig.params[i], twin_rig.params[i])) << "iteration " << it;
  }
  std::cout << "[ fuzz     ] " << iterations << " loads of mutated archives (seed " << seed_ << "): " << refused
            << " refused, " << accepted << " accepted whole; of the " << bytes_refused
            << " optimizer files refused after byte mutations, " << reader_refused
            << " by LibTorch's archive reader; " << directories
            << " files not loaded: damaged so that a record reads as a directory (verify_checkpoint refused each); "
            << "of the " << bytes_accepted << " byte-damaged optimizer files load() accepted, verify_checkpoint refused "
            << verify_refused << "; " << kept_from_loading
            << " byte-damaged files verify_checkpoint refused not loaded (AddressSanitizer build only); "
            << shared_refused << " refused for state tensors sharing memory\n";
  ::testing::Test::RecordProperty("fuzz_iterations", std::to_string(iterations));
  EXPECT_GT(refused, iterations / 2);
  // (shared_refused is 3-6 a run, and may be 0 for some seed: the class is
  // covered for certain by StateTensorsSharingMemoryAreRefusedDisjointViewsLoad.)
}

}  // namespace
