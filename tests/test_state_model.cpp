// The SDK's state model and step phases, for every built-in optimizer on CPU
// and CUDA (skipped without a device): all-or-nothing steps (a failure while
// preparing the last list leaves every parameter, grad and state
// bit-identical), state that lives in state() (so clear() and checkpoints
// see it), master copies that follow writes made from outside, exact device
// step counters, and the per-(group, device) device scalars.

#include <ATen/ops/_lazy_clone.h>
#include <ampfuse/fused_adagrad.h>
#include <ampfuse/fused_adam.h>
#include <ampfuse/fused_lamb.h>
#include <ampfuse/fused_rmsprop.h>
#include <ampfuse/fused_sgd.h>
#include <ampfuse/grad_scaler.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tests/common.h"

namespace {

using ampfuse_test::bitwise_equal;
using ampfuse_test::error_of;
using ampfuse_test::expect_step_refused;
using ::testing::HasSubstr;

using StateModelTest = ampfuse_test::DeviceTest;

/// Throws from prepare_list of the `fail_at`-th list of a step (1-based;
/// 0: never), after the optimizer prepared it: what a failure in the last
/// list's preparation (an allocation, a refusal under capture) does.
template <class Opt>
class FailingPrepare : public Opt {
 public:
  using Opt::Opt;
  int fail_at = 0;

 protected:
  ampfuse::sdk::Launch prepare_list(const ampfuse::sdk::ParamList& list) override {
    ampfuse::sdk::Launch launch = Opt::prepare_list(list);
    if (++seen_ == fail_at) throw std::runtime_error("injected failure while preparing list " + std::to_string(seen_));
    return launch;
  }

 public:
  void reset() { seen_ = 0; }

 private:
  int seen_ = 0;
};

// Every tensor of every state, in parameter order, cloned (undefined kept).
template <class Base>
std::vector<torch::Tensor> state_tensors(const ampfuse::FusedAdamParamStateT<Base>& s) {
  return {torch::tensor(s.step()), s.exp_avg(), s.exp_avg_sq(), s.max_exp_avg_sq(), s.master(), s.device_step()};
}
std::vector<torch::Tensor> state_tensors(const ampfuse::FusedSGDParamState& s) {
  return {s.momentum_buffer(), s.momentum_initialized()};
}
std::vector<torch::Tensor> state_tensors(const ampfuse::FusedLAMBParamState& s) {
  return {s.step(), s.exp_avg(), s.exp_avg_sq(), s.master()};
}
std::vector<torch::Tensor> state_tensors(const ampfuse::FusedAdagradParamState& s) {
  return {torch::tensor(s.step()), s.sum(), s.device_step()};
}
std::vector<torch::Tensor> state_tensors(const ampfuse::FusedRMSpropParamState& s) {
  return {torch::tensor(s.step()), s.square_avg(), s.momentum_buffer(), s.grad_avg(), s.device_step()};
}

template <class State>
std::vector<torch::Tensor> snapshot(torch::optim::Optimizer& opt) {
  std::vector<torch::Tensor> out;
  for (auto& group : opt.param_groups())
    for (auto& p : group.params()) {
      out.push_back(p.detach().clone());
      out.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
      auto it = opt.state().find(p.unsafeGetTensorImpl());
      if (it == opt.state().end()) {
        out.emplace_back();  // no state: a marker that differs from any state
        continue;
      }
      out.push_back(torch::ones({1}));
      for (const auto& t : state_tensors(static_cast<const State&>(*it->second)))
        out.push_back(t.defined() ? t.clone() : t);
    }
  return out;
}

::testing::AssertionResult same_snapshots(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "snapshot sizes " << a.size() << " vs " << b.size();
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].defined() != b[i].defined())
      return ::testing::AssertionFailure() << "tensor " << i << " is " << (a[i].defined() ? "" : "un")
                                           << "defined before and " << (b[i].defined() ? "" : "un")
                                           << "defined after";
    if (a[i].defined()) {
      auto r = bitwise_equal(a[i], b[i]);
      if (!r) return r << " (tensor " << i << " of the snapshot)";
    }
  }
  return ::testing::AssertionSuccess();
}

void fill_grads(torch::optim::Optimizer& opt) {
  for (auto& group : opt.param_groups())
    for (auto& p : group.params()) p.mutable_grad() = torch::randn_like(p);
}

// A warm-up step, then a group whose parameters have no state yet, then a
// step whose last list fails while being prepared: nothing may change, not
// even the state made for the lists prepared before it. The step after it
// runs as if the failed one never happened.
template <class Opt, class State>
void expect_all_or_nothing(Opt& opt, std::vector<torch::Tensor> new_group) {
  fill_grads(opt);
  opt.step();
  opt.add_param_group(torch::optim::OptimizerParamGroup(new_group, opt.param_groups()[0].options().clone()));
  fill_grads(opt);
  const std::size_t states_before = opt.state().size();
  const auto before = snapshot<State>(opt);
  opt.fail_at = static_cast<int>(opt.param_groups().size());  // one dtype per group: the last list
  opt.reset();
  try {
    opt.step();
    ADD_FAILURE() << "the injected failure did not propagate";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("injected failure"));
  }
  EXPECT_EQ(opt.state().size(), states_before) << "state made by the failed step was left behind";
  EXPECT_TRUE(same_snapshots(before, snapshot<State>(opt)));
  opt.fail_at = 0;
  opt.step();
  EXPECT_EQ(opt.state().size(), states_before + new_group.size());
}

TEST_P(StateModelTest, FusedAdamFailureWhilePreparingTheLastListChangesNothing) {
  FailingPrepare<ampfuse::FusedAdam> opt(
      std::vector<torch::optim::OptimizerParamGroup>{
          torch::optim::OptimizerParamGroup({param({33}, torch::kHalf), param({4, 5}, torch::kHalf)}),
          torch::optim::OptimizerParamGroup({param({70000}, torch::kBFloat16), param({0}, torch::kBFloat16)})},
      torch::optim::AdamOptions(1e-2).amsgrad(true), ampfuse::FusedAdamOptions().master_weights(true));
  expect_all_or_nothing<decltype(opt), ampfuse::FusedAdamParamState>(
      opt, {param({17}, torch::kHalf), param({3, 3}, torch::kHalf)});
}

TEST_P(StateModelTest, FusedAdamWFailureWhilePreparingTheLastListChangesNothing) {
  FailingPrepare<ampfuse::FusedAdamW> opt(
      std::vector<torch::optim::OptimizerParamGroup>{
          torch::optim::OptimizerParamGroup({param({129}, torch::kFloat)}),
          torch::optim::OptimizerParamGroup({param({5}, torch::kFloat), param({65537}, torch::kFloat)})},
      torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
  expect_all_or_nothing<decltype(opt), ampfuse::FusedAdamWParamState>(opt, {param({8}, torch::kFloat)});
}

// Fields a step adds to state that existed before it (amsgrad switched on,
// a master copy that is missing) are taken back too, not only new states.
TEST_P(StateModelTest, FusedAdamFailureTakesBackFieldsAddedToExistingState) {
  auto a = param({33}, torch::kHalf), b = param({70000}, torch::kHalf);
  FailingPrepare<ampfuse::FusedAdam> opt(
      std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup({a}),
                                                     torch::optim::OptimizerParamGroup({b})},
      torch::optim::AdamOptions(1e-2), ampfuse::FusedAdamOptions().master_weights(true));
  fill_grads(opt);
  opt.step();
  for (auto& group : opt.param_groups()) static_cast<torch::optim::AdamOptions&>(group.options()).amsgrad(true);
  static_cast<ampfuse::FusedAdamParamState&>(*opt.state().at(a.unsafeGetTensorImpl())).master(torch::Tensor());
  fill_grads(opt);
  const auto before = snapshot<ampfuse::FusedAdamParamState>(opt);
  opt.fail_at = 2;
  opt.reset();
  EXPECT_THROW(opt.step(), std::runtime_error);
  EXPECT_TRUE(same_snapshots(before, snapshot<ampfuse::FusedAdamParamState>(opt)));
  opt.fail_at = 0;
  opt.step();
  for (const auto& [key, state] : opt.state()) {
    const auto& st = static_cast<const ampfuse::FusedAdamParamState&>(*state);
    EXPECT_TRUE(st.max_exp_avg_sq().defined() && st.master().defined());
  }
}

TEST_P(StateModelTest, FusedSGDFailureWhilePreparingTheLastListChangesNothing) {
  FailingPrepare<ampfuse::FusedSGD> opt(
      std::vector<torch::optim::OptimizerParamGroup>{
          torch::optim::OptimizerParamGroup({param({129}, torch::kFloat), param({3}, torch::kFloat)}),
          torch::optim::OptimizerParamGroup({param({1000}, torch::kFloat)})},
      torch::optim::SGDOptions(0.1).momentum(0.9).nesterov(true));
  expect_all_or_nothing<decltype(opt), ampfuse::FusedSGDParamState>(opt, {param({31}, torch::kFloat)});
}

TEST_P(StateModelTest, FusedLAMBFailureWhilePreparingTheLastListChangesNothing) {
  FailingPrepare<ampfuse::FusedLAMB> opt(
      std::vector<torch::optim::OptimizerParamGroup>{
          torch::optim::OptimizerParamGroup({param({129}, torch::kHalf)}),
          torch::optim::OptimizerParamGroup({param({66000}, torch::kHalf), param({2, 2}, torch::kHalf)})},
      ampfuse::FusedLAMBOptions(1e-2).weight_decay(0.01).master_weights(true).max_grad_norm(1.0));
  expect_all_or_nothing<decltype(opt), ampfuse::FusedLAMBParamState>(opt, {param({9}, torch::kHalf)});
}

TEST_P(StateModelTest, FusedAdagradFailureWhilePreparingTheLastListChangesNothing) {
  FailingPrepare<ampfuse::FusedAdagrad> opt(
      std::vector<torch::optim::OptimizerParamGroup>{
          torch::optim::OptimizerParamGroup({param({129}, torch::kFloat), param({1}, torch::kFloat)}),
          torch::optim::OptimizerParamGroup({param({70000}, torch::kFloat), param({0}, torch::kFloat)})},
      torch::optim::AdagradOptions(0.1).lr_decay(0.01).weight_decay(0.1));
  expect_all_or_nothing<decltype(opt), ampfuse::FusedAdagradParamState>(opt, {param({31}, torch::kFloat)});
}

TEST_P(StateModelTest, FusedRMSpropFailureWhilePreparingTheLastListChangesNothing) {
  FailingPrepare<ampfuse::FusedRMSprop> opt(
      std::vector<torch::optim::OptimizerParamGroup>{
          torch::optim::OptimizerParamGroup({param({129}, torch::kFloat), param({1}, torch::kFloat)}),
          torch::optim::OptimizerParamGroup({param({70000}, torch::kFloat)})},
      torch::optim::RMSpropOptions(0.01).momentum(0.9).centered(true));
  expect_all_or_nothing<decltype(opt), ampfuse::FusedRMSpropParamState>(opt, {param({31}, torch::kFloat)});
}

// With master_weights, a value written into the parameter from outside
// (weights loaded, a layer re-initialized) must survive the next step: the
// master is refreshed from it, not written back over it. With lr 0 the
// step leaves the master as it is, so the parameter must keep the new value.
template <class Opt>
void expect_master_follows_external_writes(Opt& opt, torch::Tensor p) {
  fill_grads(opt);
  opt.step();
  const torch::Tensor written = torch::randn_like(p) * 3;
  {
    torch::NoGradGuard no_grad;
    p.copy_(written);  // moves p's version counter, as torch::load and nn::init do
  }
  opt.param_groups()[0].options().set_lr(0.0);
  fill_grads(opt);
  opt.step();
  EXPECT_TRUE(bitwise_equal(p.detach(), written)) << "the master copy undid a write made from outside";

  // p.set_data(t) gives the parameter other memory and leaves its version
  // counter alone (as a model's weights swapped for loaded ones): the master
  // follows it too, on this step and on the next one after a second swap.
  for (int swap = 0; swap < 2; ++swap) {
    const torch::Tensor swapped = torch::randn_like(p) * 2;
    {
      torch::NoGradGuard no_grad;
      p.set_data(swapped.clone());
    }
    fill_grads(opt);
    opt.step();
    EXPECT_TRUE(bitwise_equal(p.detach(), swapped)) << "the master copy undid p.set_data(), swap " << swap;
  }
  // Memory freed before the new weights are made (p.set_data(empty), then
  // p.set_data(loaded)): the new storage object most often takes the freed
  // one's address, which the master must not take for the storage it last
  // matched (it keeps that storage object alive, weakly).
  for (int swap = 0; swap < 3; ++swap) {
    const torch::Tensor loaded = torch::randn_like(p) * 2;
    {
      torch::NoGradGuard no_grad;
      p.set_data(torch::empty({0}, p.options()));
      p.set_data(loaded.clone());
    }
    fill_grads(opt);
    opt.step();
    EXPECT_TRUE(bitwise_equal(p.detach(), loaded)) << "the master copy undid weights loaded into freed memory, swap "
                                                   << swap;
  }
  // The same storage at another offset: a parameter re-pointed from one
  // half of a flat buffer to the other (new values there, written through
  // the buffer, which leaves p's version counter alone).
  {
    const std::int64_t n = p.numel();
    const torch::Tensor flat = torch::randn({2 * n}).to(p.scalar_type()) * 2;
    torch::NoGradGuard no_grad;
    p.set_data(flat.narrow(0, 0, n).view(p.sizes()));
    fill_grads(opt);
    opt.step();
    EXPECT_TRUE(bitwise_equal(p.detach(), flat.narrow(0, 0, n).view(p.sizes())));
    const torch::Tensor second = flat.narrow(0, n, n).view(p.sizes());
    const torch::Tensor values = second.clone();
    p.set_data(second);
    fill_grads(opt);
    opt.step();
    EXPECT_TRUE(bitwise_equal(p.detach(), values)) << "the master copy undid a move within one storage";
  }

  // A copy-on-write snapshot taken between steps (at::_lazy_clone) writes
  // nothing: the step that materializes the parameter's storage (new data,
  // the same storage object) keeps the master's extra bits. It refreshed the
  // master from the rounded parameter when the master followed data addresses.
  {
    const torch::Tensor master_before = [&] {
      for (const auto& [key, st] : opt.state()) {
        (void)key;
        if (const auto* a = dynamic_cast<const ampfuse::FusedAdamParamState*>(st.get())) return a->master().clone();
        if (const auto* l = dynamic_cast<const ampfuse::FusedLAMBParamState*>(st.get())) return l->master().clone();
      }
      return torch::Tensor();
    }();
    ASSERT_TRUE(master_before.defined());
    const torch::Tensor snapshot = at::_lazy_clone(p.detach());
    opt.param_groups()[0].options().set_lr(0.0);
    fill_grads(opt);
    opt.step();
    for (const auto& [key, st] : opt.state()) {
      (void)key;
      const auto* a = dynamic_cast<const ampfuse::FusedAdamParamState*>(st.get());
      const auto* l = dynamic_cast<const ampfuse::FusedLAMBParamState*>(st.get());
      EXPECT_TRUE(bitwise_equal(a ? a->master() : l->master(), master_before))
          << "a copy-on-write snapshot refreshed the master";
    }
    EXPECT_TRUE(bitwise_equal(snapshot, p.detach()));
  }

  // state().clear() starts over: a fresh master from the parameter, even for
  // a write the version counter cannot show (through .data()).
  const torch::Tensor unseen = torch::randn_like(p);
  p.data().copy_(unseen);
  opt.state().clear();
  fill_grads(opt);
  opt.step();
  EXPECT_TRUE(bitwise_equal(p.detach(), unseen)) << "state().clear() kept the old master copies";
}

TEST_P(StateModelTest, FusedAdamMasterCopiesFollowExternalWrites) {
  for (auto dtype : {torch::kHalf, torch::kBFloat16}) {
    SCOPED_TRACE(ampfuse_test::dtype_name(dtype));
    auto p = param({1000}, dtype);
    ampfuse::FusedAdam opt({p}, torch::optim::AdamOptions(1e-2), ampfuse::FusedAdamOptions().master_weights(true));
    expect_master_follows_external_writes(opt, p);
  }
}

TEST_P(StateModelTest, FusedLAMBMasterCopiesFollowExternalWrites) {
  for (auto dtype : {torch::kHalf, torch::kBFloat16}) {
    SCOPED_TRACE(ampfuse_test::dtype_name(dtype));
    auto p = param({1000}, dtype);
    ampfuse::FusedLAMB opt({p}, ampfuse::FusedLAMBOptions(1e-2).master_weights(true));
    expect_master_follows_external_writes(opt, p);
  }
}

// Loading the optimizer after the weights keeps the checkpoint's master (it
// stands for the weights as loaded); writing the weights after loading the
// optimizer refreshes it.
template <class Opt, class State, class... Args>
void expect_loaded_master_stands_for_the_parameter(torch::Tensor p, torch::Tensor q, const Args&... args) {
  Opt opt({p}, args...);
  for (int i = 0; i < 3; ++i) {
    fill_grads(opt);
    opt.step();
  }
  std::stringstream archive;
  torch::save(opt, archive);
  const torch::Tensor saved_master = static_cast<State&>(*opt.state().begin()->second).master().clone();

  Opt resumed({q}, args...);
  {
    torch::NoGradGuard no_grad;
    q.copy_(p);  // the weights first, then the optimizer
  }
  torch::load(resumed, archive);
  auto& st = static_cast<State&>(*resumed.state().begin()->second);
  EXPECT_TRUE(bitwise_equal(st.master().cpu(), saved_master.cpu()));
  resumed.param_groups()[0].options().set_lr(0.0);
  fill_grads(resumed);
  resumed.step();
  EXPECT_TRUE(bitwise_equal(st.master().cpu(), saved_master.cpu())) << "a loaded master was refreshed from the weights";

  // Weights written after the optimizer was loaded win over its master.
  torch::load(resumed, archive);
  const torch::Tensor written = torch::randn_like(q);
  {
    torch::NoGradGuard no_grad;
    q.copy_(written);
  }
  resumed.param_groups()[0].options().set_lr(0.0);
  fill_grads(resumed);
  resumed.step();
  EXPECT_TRUE(bitwise_equal(q.detach(), written)) << "a loaded master undid weights written after the load";
}

// FusedAdam and FusedLAMB alike: the SDK's load() makes a loaded master
// follow its parameter (sdk::follow_loaded_master), so an optimizer of the
// SDK need not do it in after_load (FusedLAMB has none).
TEST_P(StateModelTest, ALoadedMasterStandsForTheParameterAsItIsAtLoad) {
  expect_loaded_master_stands_for_the_parameter<ampfuse::FusedAdam, ampfuse::FusedAdamParamState>(
      param({257}, torch::kHalf), param({257}, torch::kHalf), torch::optim::AdamOptions(1e-2),
      ampfuse::FusedAdamOptions().master_weights(true));
  expect_loaded_master_stands_for_the_parameter<ampfuse::FusedLAMB, ampfuse::FusedLAMBParamState>(
      param({257}, torch::kBFloat16), param({257}, torch::kBFloat16),
      ampfuse::FusedLAMBOptions(1e-2).master_weights(true));
}

// A master that its parameter does not round to (weights written after the
// step that saved it, or weights of another point of the run than the
// optimizer's checkpoint) gives way to the parameter at load, element by
// element: with lr 0 the next step leaves the weights as they are. It was
// kept, and the step wrote the old weights back.
template <class Opt, class State, class... Args>
void expect_loaded_master_follows_the_weights(torch::Tensor p, const Args&... args) {
  Opt opt({p}, args...);
  fill_grads(opt);
  opt.step();
  const torch::Tensor written = torch::randn_like(p) * 3;
  {
    torch::NoGradGuard no_grad;
    p.copy_(written);
  }
  std::stringstream archive;
  torch::save(opt, archive);  // its master is from before the write
  Opt resumed({p}, args...);
  torch::load(resumed, archive);
  const auto& st = static_cast<const State&>(*resumed.state().begin()->second);
  EXPECT_TRUE(bitwise_equal(st.master().to(p.scalar_type()), written));
  resumed.param_groups()[0].options().set_lr(0.0);
  fill_grads(resumed);
  resumed.step();
  EXPECT_TRUE(bitwise_equal(p.detach(), written)) << "a loaded master undid weights written before the save";
}

TEST_P(StateModelTest, ALoadedMasterGivesWayToWeightsItDoesNotRoundTo) {
  for (auto dtype : {torch::kHalf, torch::kBFloat16}) {
    SCOPED_TRACE(ampfuse_test::dtype_name(dtype));
    expect_loaded_master_follows_the_weights<ampfuse::FusedAdam, ampfuse::FusedAdamParamState>(
        param({300}, dtype), torch::optim::AdamOptions(1e-2), ampfuse::FusedAdamOptions().master_weights(true));
    expect_loaded_master_follows_the_weights<ampfuse::FusedLAMB, ampfuse::FusedLAMBParamState>(
        param({300}, dtype), ampfuse::FusedLAMBOptions(1e-2).master_weights(true));
  }
}

// A checkpoint of an earlier ampfuse kept the master copies under top-level
// keys, one per parameter: they are still read.
TEST_P(StateModelTest, FusedAdamReadsMasterCopiesOfEarlierCheckpoints) {
  auto p = param({129}, torch::kBFloat16);
  const auto fused = ampfuse::FusedAdamOptions().master_weights(true);
  ampfuse::FusedAdam opt({p}, torch::optim::AdamOptions(1e-2), fused);
  fill_grads(opt);
  opt.step();
  auto& st = static_cast<ampfuse::FusedAdamParamState&>(*opt.state().begin()->second);
  const torch::Tensor master = st.master().clone();
  st.master(torch::Tensor());  // the earlier format: nothing in the state
  torch::serialize::OutputArchive out;
  opt.save(out);
  out.write("ampfuse_master_weights_0_0", master);
  std::stringstream archive;
  out.save_to(archive);

  auto q = param({129}, torch::kBFloat16);
  {
    torch::NoGradGuard no_grad;
    q.copy_(p);  // the weights the master stands for (otherwise the weights win, element by element)
  }
  ampfuse::FusedAdam resumed({q}, torch::optim::AdamOptions(1e-2), fused);
  torch::serialize::InputArchive in;
  in.load_from(archive);
  resumed.load(in);
  const auto& loaded = static_cast<const ampfuse::FusedAdamParamState&>(*resumed.state().begin()->second);
  ASSERT_TRUE(loaded.master().defined()) << "the earlier checkpoint's master copy was not read";
  EXPECT_TRUE(bitwise_equal(loaded.master().cpu(), master.cpu()));
}

TEST_P(StateModelTest, StateOfAnotherTypeIsRefusedNamingTheParameter) {
  auto p = param({10}, torch::kFloat);
  ampfuse::FusedAdam opt({p}, torch::optim::AdamOptions(1e-2));
  opt.state()[p.unsafeGetTensorImpl()] = std::make_unique<torch::optim::AdamParamState>();
  fill_grads(opt);
  const auto before = p.detach().clone();
  expect_step_refused(opt, "FusedAdam: param group 0, param 0: its state is not a");
  EXPECT_TRUE(bitwise_equal(p.detach(), before));
  torch::serialize::OutputArchive archive;
  EXPECT_THROW(opt.save(archive), c10::Error) << "save() read a torch::optim::AdamParamState as a FusedAdam state";
}

// A null entry in state(), as `state()[key]` used as a lookup inserts one:
// refused naming the parameter, at a step that reuses its plan too (it
// crashed: the plan's stamp read the null state), and by save(), nothing
// changed; a null entry for a tensor that is no parameter is passed over.
// Erased, the parameter's state is made afresh. (torch::optim crashes.)
TEST_P(StateModelTest, ANullStateIsRefusedNamingTheParameter) {
  auto p = param({10}, torch::kFloat), q = param({3}, torch::kFloat), other = param({2}, torch::kFloat);
  ampfuse::FusedAdam opt({p, q}, torch::optim::AdamOptions(1e-2));
  fill_grads(opt);
  opt.step();
  opt.step();  // the plan is kept
  auto* const q_key = q.unsafeGetTensorImpl();
  const auto before = p.detach().clone();
  const auto q_before = q.detach().clone();
  opt.state()[q_key].reset();
  opt.state()[other.unsafeGetTensorImpl()];  // a null entry for a tensor of no group
  for (int attempt = 0; attempt < 2; ++attempt) {
    expect_step_refused(opt, "FusedAdam: param group 0, param 1: its state is null");
    EXPECT_TRUE(bitwise_equal(p.detach(), before));
    EXPECT_TRUE(bitwise_equal(q.detach(), q_before));
  }
  torch::serialize::OutputArchive archive;
  EXPECT_THAT(error_of([&] { opt.save(archive); }), HasSubstr("param group 0, param 1: its state is null"));
  opt.state().erase(q_key);
  opt.step();
  EXPECT_FALSE(bitwise_equal(p.detach(), before));
  EXPECT_FALSE(bitwise_equal(q.detach(), q_before));
  EXPECT_EQ(static_cast<const ampfuse::FusedAdamParamState&>(*opt.state().at(q_key)).step(), 1);
  torch::serialize::OutputArchive saved;
  opt.save(saved);
}

// A state tensor that shares memory with another state tensor, a parameter
// or a grad (put into state() as a view of it) is refused, naming both, and
// nothing is written: the kernels read every tensor of an element before
// writing, where torch::optim's ops run one after the other, so the step
// gave other numbers (finite where torch::optim's are NaN). Found by
// helper-77. Put back, the step goes on.
TEST_P(StateModelTest, AStateTensorSharingMemoryIsRefusedNamingBoth) {
  auto p = param({6}, torch::kFloat), q = param({6}, torch::kFloat);
  ampfuse::FusedAdam adam({p, q}, torch::optim::AdamOptions(1e-2));
  fill_grads(adam);
  adam.step();
  auto& sp = static_cast<ampfuse::FusedAdamParamState&>(*adam.state().at(p.unsafeGetTensorImpl()));
  auto& sq = static_cast<ampfuse::FusedAdamParamState&>(*adam.state().at(q.unsafeGetTensorImpl()));
  const torch::Tensor exp_avg = sq.exp_avg();
  struct Case {
    const char* name;
    torch::Tensor value;
    const char* expected;
  };
  const std::vector<Case> cases = {
      {"its exp_avg_sq", sq.exp_avg_sq(),
       "param group 0, param 1: a state tensor shares memory with a state tensor of param group 0, param 1"},
      {"the parameter", q.detach(), "param group 0, param 1: a state tensor shares memory with the parameter of param "
                                    "group 0, param 1"},
      {"another parameter's grad", p.grad(),
       "param group 0, param 1: a state tensor shares memory with the grad of param group 0, param 0"},
      {"another parameter's exp_avg", sp.exp_avg(),
       "a state tensor shares memory with a state tensor of param group 0, param"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    sq.exp_avg(c.value);
    const auto p_before = p.detach().clone(), q_before = q.detach().clone();
    const auto exp_avg_sq = sq.exp_avg_sq().clone();
    try {
      adam.step();
      ADD_FAILURE() << "a state tensor sharing memory was stepped";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr(c.expected));
    }
    EXPECT_TRUE(bitwise_equal(p.detach(), p_before));
    EXPECT_TRUE(bitwise_equal(q.detach(), q_before));
    EXPECT_TRUE(bitwise_equal(sq.exp_avg_sq(), exp_avg_sq));
  }
  sq.exp_avg(exp_avg);
  const auto before = q.detach().clone();
  adam.step();
  EXPECT_FALSE(bitwise_equal(q.detach(), before));
  // FusedSGD's momentum buffer given its own grad.
  ampfuse::FusedSGD sgd({p}, torch::optim::SGDOptions(0.1).momentum(0.9));
  sgd.step();
  static_cast<ampfuse::FusedSGDParamState&>(*sgd.state().at(p.unsafeGetTensorImpl())).momentum_buffer(p.grad());
  try {
    sgd.step();
    ADD_FAILURE() << "a momentum buffer that is its grad was stepped";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(),
                HasSubstr("FusedSGD: param group 0, param 0: a state tensor shares memory with the grad of param "
                          "group 0, param 0"));
  }
}

// The one-element tensors a step writes (FusedLAMB's step; on CUDA the
// device step counters and FusedSGD's momentum flag) are looked at too: two
// parameters' counters made one tensor by hand were one count, moved by
// either one's step, a frozen parameter's too (on CUDA written by two
// blocks at once), and a counter that is an element of a
// moment was written as both. Refused naming the parameter, nothing
// written; put back, the step goes on.
template <class State, class Opt, class Field, class Set>
void expect_counter_sharing_refused(Opt& opt, const std::string& name, Field field, Set set) {
  fill_grads(opt);
  opt.step();
  auto& groups = opt.param_groups();
  auto& s0 = static_cast<State&>(*opt.state().at(groups[0].params()[0].unsafeGetTensorImpl()));
  auto& s1 = static_cast<State&>(*opt.state().at(groups[0].params()[1].unsafeGetTensorImpl()));
  const torch::Tensor own = field(s1);
  ASSERT_TRUE(own.defined()) << name;
  set(s1, field(s0));
  const auto before = snapshot<State>(opt);
  ampfuse_test::expect_step_refused(
      opt,
      name + ": param group 0, param 1: a state tensor shares memory with a state tensor of param group 0, param 0");
  EXPECT_TRUE(same_snapshots(before, snapshot<State>(opt))) << name;
  set(s1, own);
  const auto p1 = groups[0].params()[1].detach().clone();
  opt.step();
  EXPECT_FALSE(bitwise_equal(groups[0].params()[1].detach(), p1)) << name;
}

TEST_P(StateModelTest, StepCountersSharingMemoryAreRefused) {
  const auto params = [&](torch::ScalarType dtype) {
    return std::vector<torch::Tensor>{param({40}, dtype), param({7}, dtype)};
  };
  {
    ampfuse::FusedLAMB lamb(params(torch::kFloat), ampfuse::FusedLAMBOptions(1e-2));
    expect_counter_sharing_refused<ampfuse::FusedLAMBParamState>(
        lamb, "FusedLAMB", [](auto& s) { return s.step(); }, [](auto& s, torch::Tensor t) { s.step(t); });
  }
  {
    // A Double parameter's step made an element of its own exp_avg: one
    // element, Double, on its device, so check_state takes it.
    auto p = param({5}, torch::kDouble);
    ampfuse::FusedLAMB lamb({p}, ampfuse::FusedLAMBOptions(1e-2));
    fill_grads(lamb);
    lamb.step();
    auto& s = static_cast<ampfuse::FusedLAMBParamState&>(*lamb.state().at(p.unsafeGetTensorImpl()));
    const torch::Tensor step = s.step();
    s.step(s.exp_avg().narrow(0, 2, 1));
    const auto before = snapshot<ampfuse::FusedLAMBParamState>(lamb);
    ampfuse_test::expect_step_refused(
        lamb, "FusedLAMB: param group 0, param 0: a state tensor shares memory with a state tensor of param group 0, "
              "param 0");
    EXPECT_TRUE(same_snapshots(before, snapshot<ampfuse::FusedLAMBParamState>(lamb)));
    s.step(step);
    lamb.step();
  }
  if (!device_.is_cuda()) return;  // the device counters and the flag are CUDA's
  {
    ampfuse::FusedAdam adam(params(torch::kFloat), torch::optim::AdamOptions(1e-2));
    expect_counter_sharing_refused<ampfuse::FusedAdamParamState>(
        adam, "FusedAdam", [](auto& s) { return s.device_step(); },
        [](auto& s, torch::Tensor t) { s.device_step(t); });
  }
  {
    ampfuse::FusedAdagrad adagrad(params(torch::kFloat), torch::optim::AdagradOptions(0.1));
    expect_counter_sharing_refused<ampfuse::FusedAdagradParamState>(
        adagrad, "FusedAdagrad", [](auto& s) { return s.device_step(); },
        [](auto& s, torch::Tensor t) { s.device_step(t); });
  }
  {
    ampfuse::FusedRMSprop rmsprop(params(torch::kFloat), torch::optim::RMSpropOptions(0.01));
    expect_counter_sharing_refused<ampfuse::FusedRMSpropParamState>(
        rmsprop, "FusedRMSprop", [](auto& s) { return s.device_step(); },
        [](auto& s, torch::Tensor t) { s.device_step(t); });
  }
  {
    ampfuse::FusedSGD sgd(params(torch::kFloat), torch::optim::SGDOptions(0.1).momentum(0.9));
    expect_counter_sharing_refused<ampfuse::FusedSGDParamState>(
        sgd, "FusedSGD", [](auto& s) { return s.momentum_initialized(); },
        [](auto& s, torch::Tensor t) { s.momentum_initialized(t); });
  }
}

#if defined(AMPFUSE_WITH_CUDA)
// The device step counter is fp64: exact past 2^24, where fp32 stops counting.
TEST_P(StateModelTest, DeviceStepCountersAreExactPast2To24) {
  if (!device_.is_cuda()) GTEST_SKIP() << "CPU counters are LibTorch's int64 step";
  auto p = param({100}, torch::kFloat);
  ampfuse::FusedAdam opt({p}, torch::optim::AdamOptions(1e-3));
  fill_grads(opt);
  opt.step();
  const std::int64_t start = (std::int64_t{1} << 24) + 1;
  auto& st = static_cast<ampfuse::FusedAdamParamState&>(*opt.state().begin()->second);
  st.device_step().fill_(static_cast<double>(start));
  for (int i = 0; i < 3; ++i) {
    fill_grads(opt);
    opt.step();
  }
  opt.sync_state();
  EXPECT_EQ(st.step(), start + 3);
}

TEST_P(StateModelTest, CapturableLrIsFoundByAnIndexlessDevice) {
  if (!device_.is_cuda()) GTEST_SKIP() << "capturable is for CUDA";
  auto p = param({100}, torch::kFloat);
  ampfuse::FusedAdam opt({p}, torch::optim::AdamOptions(1e-3), ampfuse::FusedAdamOptions().capturable(true));
  fill_grads(opt);
  opt.step();
  ASSERT_TRUE(opt.lr_tensor(0, torch::kCUDA).defined());
  EXPECT_TRUE(opt.lr_tensor(0, torch::Device(torch::kCUDA, 0)).defined());
}
#endif

// The per-(group, device) device scalars, on whatever device this is.
TEST_P(StateModelTest, DeviceScalarsAreKeyedAsTensorsNameDevices) {
  ampfuse::sdk::DeviceScalars scalars;
  bool created = false;
  torch::Tensor t = scalars.prepare(1, device_, 0.5, "Test", &created);
  EXPECT_TRUE(created);
  EXPECT_EQ(t.scalar_type(), torch::kDouble);
  EXPECT_EQ(t.item<double>(), 0.5);
  const torch::Device indexless(device_.type());
  EXPECT_TRUE(scalars.find(1, indexless).defined());
  EXPECT_FALSE(scalars.find(0, device_).defined());
  scalars.prepare(1, indexless, 0.5, "Test", &created);
  EXPECT_FALSE(created) << "an index-less device was taken for another one";
  scalars.refresh(1, device_, 0.25);
  EXPECT_EQ(scalars.find(1, device_).item<double>(), 0.25);
  scalars.erase(1, indexless);
  EXPECT_FALSE(scalars.find(1, device_).defined());
}

// Zero-element parameters' counters, which no kernel chunk covers: advanced
// by one, or on the device by (found_inf == 0), in one foreach launch.
TEST_P(StateModelTest, AdvanceStepCountersOfZeroElementParameters) {
  const auto opts = torch::TensorOptions().dtype(torch::kDouble).device(device_);
  std::vector<torch::Tensor> steps = {torch::full({1}, 3.0, opts), torch::full({1}, 16777216.0, opts)};
  ampfuse::sdk::advance_step_counters(steps, nullptr);
  EXPECT_EQ(steps[0].item<double>(), 4.0);
  EXPECT_EQ(steps[1].item<double>(), 16777217.0);
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat).device(device_);
  ampfuse::ScaleSignal skipped{torch::ones({1}, f32), torch::full({1}, 2.0f, f32), {}};
  ampfuse::sdk::advance_step_counters(steps, &skipped);
  EXPECT_EQ(steps[0].item<double>(), 4.0) << "a skipped step advanced a counter";
  ampfuse::ScaleSignal applied{torch::ones({1}, f32), torch::zeros({1}, f32), {}};
  ampfuse::sdk::advance_step_counters(steps, &applied);
  EXPECT_EQ(steps[0].item<double>(), 5.0);
  EXPECT_EQ(steps[1].item<double>(), 16777218.0);
}

// The pool carves what was reserved side by side, in the order taken, each
// tensor at a multiple of 16 bytes (64 from 64 bytes up) with the sizes and
// strides of the tensor it stands for; a large or non-dense tensor, or one
// beyond what was reserved, gets memory of its own.
TEST_P(StateModelTest, SmallStatePoolCarvesAlignedViewsInOrder) {
  const auto opts = torch::TensorOptions().dtype(torch::kFloat).device(device_);
  const torch::Tensor one = torch::empty({1}, opts), row = torch::empty({3, 5}, opts),
                      channels_last = torch::empty({2, 3, 2, 2}, opts).contiguous(torch::MemoryFormat::ChannelsLast),
                      large = torch::empty({2048}, opts), gaps = torch::empty({4, 4}, opts).slice(1, 0, 2);
  ampfuse::sdk::SmallStatePool pool(opts, 0.5);
  for (const auto* t : {&one, &row, &channels_last, &large, &gaps}) pool.reserve(*t);
  std::vector<torch::Tensor> taken;
  for (const auto* t : {&one, &row, &channels_last, &large, &gaps, &row}) taken.push_back(pool.take(*t));
  const auto address = [](const torch::Tensor& t) { return reinterpret_cast<std::uintptr_t>(t.data_ptr()); };
  for (int k = 0; k < 3; ++k) {
    EXPECT_TRUE(taken[k].storage().is_alias_of(taken[0].storage())) << "tensor " << k;
    EXPECT_EQ(address(taken[k]) % (k == 2 ? 64 : 16), 0u) << "tensor " << k;
  }
  EXPECT_EQ(taken[0].storage_offset(), 0);
  EXPECT_EQ(taken[1].storage_offset(), 4);   // after one's 16 bytes
  EXPECT_EQ(taken[2].storage_offset(), 32);  // row's 60 bytes end at 76: the next multiple of 64
  // The reservation (256 bytes, padding included) ends before a second row fits after channels_last's 96 bytes.
  for (int k : {3, 4, 5}) EXPECT_FALSE(taken[k].storage().is_alias_of(taken[0].storage())) << "tensor " << k;
  const torch::Tensor* like[] = {&one, &row, &channels_last, &large, &gaps, &row};
  for (std::size_t k = 0; k < taken.size(); ++k) {
    EXPECT_EQ(taken[k].sizes(), like[k]->sizes()) << "tensor " << k;
    if (like[k]->is_non_overlapping_and_dense()) EXPECT_EQ(taken[k].strides(), like[k]->strides()) << "tensor " << k;
    EXPECT_TRUE(taken[k].eq(0.5).all().item<bool>()) << "tensor " << k;
    taken[k].fill_(static_cast<double>(k));
  }
  for (std::size_t k = 0; k < taken.size(); ++k)
    EXPECT_TRUE(taken[k].eq(static_cast<double>(k)).all().item<bool>()) << "tensor " << k << " overlaps another";
  // Tensors of their own over one storage, as LibTorch's states are tensors of
  // their own: not autograd views, each with its own version counter.
  const auto version = taken[1]._version();
  taken[0].add_(1);
  EXPECT_EQ(taken[1]._version(), version) << "a write into one state moved another's version counter";
  for (std::size_t k = 0; k < taken.size(); ++k) EXPECT_FALSE(taken[k].is_view()) << "tensor " << k;
}

// FusedAdam's and FusedLAMB's first step carve the moments (and LAMB's
// counters) of small parameters from one buffer per list. A checkpoint
// writes that buffer once, not once per tensor, and loads into LibTorch's
// Adam and into a fresh FusedAdam with the same values; the loaded
// optimizer steps as the saved one does.
TEST_P(StateModelTest, SmallParametersShareOneStateBufferThatCheckpointsWriteOnce) {
  const auto opts = torch::TensorOptions().dtype(torch::kFloat).device(device_);
  auto make_params = [&] {
    std::vector<torch::Tensor> params;
    for (int i = 0; i < 50; ++i) params.push_back(torch::randn({3}, opts).requires_grad_());
    params.push_back(torch::randn({4096}, opts).requires_grad_());
    for (auto& p : params) p.mutable_grad() = torch::randn_like(p);
    return params;
  };
  const std::vector<torch::Tensor> params = make_params();
  ampfuse::FusedAdam adam(params, torch::optim::AdamOptions(1e-2));
  for (int i = 0; i < 3; ++i) adam.step();
  auto adam_state = [](torch::optim::Optimizer& opt, const torch::Tensor& p) -> ampfuse::FusedAdamParamState& {
    return static_cast<ampfuse::FusedAdamParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
  };
  const c10::Storage& buffer = adam_state(adam, params[0]).exp_avg().storage();
  EXPECT_TRUE(adam_state(adam, params[49]).exp_avg_sq().storage().is_alias_of(buffer));
  EXPECT_FALSE(adam_state(adam, params[50]).exp_avg().storage().is_alias_of(buffer));

  ampfuse::FusedLAMB lamb(make_params(), ampfuse::FusedLAMBOptions(1e-2));
  lamb.step();
  const auto& lamb_params = lamb.param_groups()[0].params();
  auto lamb_state = [&](std::size_t i) -> ampfuse::FusedLAMBParamState& {
    return static_cast<ampfuse::FusedLAMBParamState&>(*lamb.state().at(lamb_params[i].unsafeGetTensorImpl()));
  };
  EXPECT_TRUE(lamb_state(49).exp_avg().storage().is_alias_of(lamb_state(0).exp_avg_sq().storage()));
  EXPECT_TRUE(lamb_state(50).step().storage().is_alias_of(lamb_state(0).step().storage()));
  EXPECT_FALSE(lamb_state(50).exp_avg().storage().is_alias_of(lamb_state(0).exp_avg().storage()));

  // The same states, each tensor in memory of its own, as LibTorch's Adam keeps them.
  torch::optim::Adam separate(params, torch::optim::AdamOptions(1e-2));
  for (const auto& p : params) {
    const auto& s = adam_state(adam, p);
    auto own = std::make_unique<torch::optim::AdamParamState>();
    own->step(s.step());
    own->exp_avg(s.exp_avg().clone());
    own->exp_avg_sq(s.exp_avg_sq().clone());
    separate.state()[p.unsafeGetTensorImpl()] = std::move(own);
  }
  std::stringstream pooled_archive, separate_archive;
  torch::save(adam, pooled_archive);
  torch::save(separate, separate_archive);
  EXPECT_LE(pooled_archive.str().size(), separate_archive.str().size() + 4096)
      << "the shared buffer was written once per tensor";

  const std::vector<torch::Tensor> copies = [&] {
    std::vector<torch::Tensor> out;
    for (const auto& p : params) {
      out.push_back(p.detach().clone().requires_grad_());
      out.back().mutable_grad() = p.grad().clone();
    }
    return out;
  }();
  torch::optim::Adam libtorch(copies, torch::optim::AdamOptions(1e-2));
  ampfuse::FusedAdam loaded(copies, torch::optim::AdamOptions(1e-2));
  pooled_archive.seekg(0);
  torch::load(libtorch, pooled_archive);
  pooled_archive.seekg(0);
  torch::load(loaded, pooled_archive);
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto& want = adam_state(adam, params[i]);
    const auto& got = static_cast<const torch::optim::AdamParamState&>(*libtorch.state().at(copies[i].unsafeGetTensorImpl()));
    EXPECT_EQ(got.step(), want.step()) << "param " << i;
    EXPECT_TRUE(bitwise_equal(got.exp_avg(), want.exp_avg())) << "param " << i;
    EXPECT_TRUE(bitwise_equal(got.exp_avg_sq(), want.exp_avg_sq())) << "param " << i;
  }
  adam.step();
  loaded.step();
  for (std::size_t i = 0; i < params.size(); ++i)
    EXPECT_TRUE(bitwise_equal(copies[i], params[i])) << "param " << i;
}

// The state objects a first step makes lie in a few slabs (what a step over
// many small parameters then reads as a stream), and the slabs go back once
// every state is deleted.
TEST(PooledStateTest, StatesOfAFirstStepShareFewSlabsThatGoBackWhenCleared) {
  const std::size_t slabs_before = ampfuse::sdk::pooled_state_slabs();
  std::vector<torch::Tensor> params;
  for (int i = 0; i < 3000; ++i) {
    params.push_back(torch::randn({1}).requires_grad_());
    params.back().mutable_grad() = torch::randn({1});
  }
  ampfuse::FusedAdam opt(params, torch::optim::AdamOptions(1e-3));
  constexpr std::size_t kSlot = (sizeof(ampfuse::FusedAdamParamState) + 15) / 16 * 16;
  for (int round = 0; round < 2; ++round) {
    opt.step();
    std::vector<std::uintptr_t> at;
    for (const auto& p : params)
      at.push_back(reinterpret_cast<std::uintptr_t>(opt.state().at(p.unsafeGetTensorImpl()).get()));
    const std::size_t per_slab = (64 * 1024 - 64) / kSlot;
    std::set<std::uintptr_t> slabs;
    for (std::size_t i = 0; i < at.size(); ++i) {
      EXPECT_EQ(at[i] % 16, 0u) << "state " << i;
      slabs.insert(at[i] / (64 * 1024));
    }
    // A few may fill places that earlier tests' states left in a slab.
    EXPECT_LE(slabs.size(), at.size() / per_slab + 3) << "round " << round << ": states spread over many slabs";
    EXPECT_GE(ampfuse::sdk::pooled_state_slabs(), slabs_before + at.size() / per_slab) << "round " << round;
    opt.state().clear();  // the next step makes them again, side by side again
    EXPECT_LE(ampfuse::sdk::pooled_state_slabs(), slabs_before + 1) << "round " << round << ": slabs kept";
  }
}

template <std::size_t kBytes>
struct PooledThing : ampfuse::sdk::PooledState {
  explicit PooledThing(std::uint64_t tag) { std::fill(std::begin(words), std::end(words), tag); }
  bool intact(std::uint64_t tag) const {
    return std::all_of(std::begin(words), std::end(words), [tag](std::uint64_t w) { return w == tag; });
  }
  std::uint64_t words[kBytes / 8];
};
struct alignas(64) AlignedThing : ampfuse::sdk::PooledState {
  double x = 1;
};

// Objects of one size come side by side in the order they are made, from
// fresh slabs and again once all of them were deleted (in any order).
TEST(PooledStateTest, ObjectsComeSideBySideInTheOrderTheyAreMade) {
  const std::uint64_t seed = ampfuse_test::seed_for_test();
  std::mt19937_64 rng(seed);
  using Thing = PooledThing<72>;  // a size no other test makes
  constexpr std::size_t kSlot = 80, kCount = 2000, kPerSlab = (64 * 1024 - 64) / kSlot;
  for (int round = 0; round < 2; ++round) {
    std::vector<Thing*> made;
    for (std::size_t i = 0; i < kCount; ++i) made.push_back(new Thing(i));
    std::size_t apart = 0;
    for (std::size_t i = 0; i + 1 < kCount; ++i)
      apart += reinterpret_cast<std::uintptr_t>(made[i + 1]) - reinterpret_cast<std::uintptr_t>(made[i]) != kSlot;
    EXPECT_LE(apart, kCount / kPerSlab + 1) << "round " << round;
    std::shuffle(made.begin(), made.end(), rng);
    for (Thing* t : made) delete t;
  }
}

// Threads making and deleting objects of three sizes (one too large for a
// slab) in a random order: no object overlaps another (each keeps its tag),
// deleted places are reused, and every slab goes back at the end.
TEST(PooledStateTest, ThreadsMakeAndDeleteObjectsOfSeveralSizesWithoutOverlap) {
  const std::uint64_t seed = ampfuse_test::seed_for_test();
  const std::size_t slabs_before = ampfuse::sdk::pooled_state_slabs();
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(seed + static_cast<std::uint64_t>(t));
      std::vector<std::pair<std::uint64_t, PooledThing<40>*>> small;
      std::vector<std::pair<std::uint64_t, PooledThing<200>*>> medium;
      std::vector<std::pair<std::uint64_t, PooledThing<6000>*>> large;
      std::uint64_t next_tag = static_cast<std::uint64_t>(t) << 40;
      auto step = [&](auto& live, auto make) {
        if (!live.empty() && rng() % 2 == 0) {
          const std::size_t k = rng() % live.size();
          if (!live[k].second->intact(live[k].first)) ++bad;
          delete live[k].second;
          live[k] = live.back();
          live.pop_back();
        } else {
          const std::uint64_t tag = ++next_tag;
          live.emplace_back(tag, make(tag));
          if (reinterpret_cast<std::uintptr_t>(live.back().second) % 16 != 0) ++bad;
        }
      };
      for (int i = 0; i < 20000; ++i) {
        const auto pick = rng() % 16;
        if (pick < 10) step(small, [](std::uint64_t tag) { return new PooledThing<40>(tag); });
        else if (pick < 15) step(medium, [](std::uint64_t tag) { return new PooledThing<200>(tag); });
        else step(large, [](std::uint64_t tag) { return new PooledThing<6000>(tag); });
        auto* aligned = new AlignedThing;
        if (reinterpret_cast<std::uintptr_t>(aligned) % 64 != 0) ++bad;
        delete aligned;
      }
      const auto drop = [&](auto& live) {
        for (auto& [tag, p] : live) {
          if (!p->intact(tag)) ++bad;
          delete p;
        }
      };
      drop(small);
      drop(medium);
      drop(large);
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0) << "an object was overwritten by another, or misaligned";
  // What stays: at most the slab each size last carved from (three sizes and the aligned one).
  EXPECT_LE(ampfuse::sdk::pooled_state_slabs(), slabs_before + 4);
}

// What a step that reuses its plan (no validation of what is as recorded)
// takes is what a fresh step takes (helper-81's audit). Each was stepped
// by a kept plan where validation refuses it:
// - parameters that are inference tensors, stepped under InferenceMode,
//   then outside it (torch::optim's in-place ops refuse that);
// - a new grad that is another parameter's state tensor (the step read and
//   wrote both; under GradScaler's unscaled_grads_after_step, the state
//   tensor was unscaled as a grad);
// - a step count set negative (the parameters became NaN).
// Each is refused, naming the parameter, and nothing changes.
TEST_P(StateModelTest, AKeptPlanTakesOnlyWhatValidationTakes) {
  const auto options = torch::TensorOptions().device(device_);
  const auto clones = [](const std::vector<torch::Tensor>& ts) {
    std::vector<torch::Tensor> out;
    for (const auto& t : ts) out.push_back(t.detach().clone());
    return out;
  };
  {
    SCOPED_TRACE("inference parameters");
    std::vector<torch::Tensor> ps;
    {
      c10::InferenceMode mode;
      ps = {torch::randn({100}, options), torch::randn({7}, options)};
    }
    ampfuse::FusedAdam opt(ps, torch::optim::AdamOptions(0.1));
    for (int step = 0; step < 2; ++step) {
      c10::InferenceMode mode;
      fill_grads(opt);
      opt.step();
    }
    const auto before = clones(ps);
    expect_step_refused(opt, "FusedAdam: param group 0, param 0 is an inference tensor");
    EXPECT_TRUE(same_snapshots(before, clones(ps)));
    c10::InferenceMode mode;
    opt.step();  // under InferenceMode still
    EXPECT_FALSE(bitwise_equal(ps[0], before[0]));
    // and a checkpoint loads (the load read their version counters, which inference tensors lack)
    std::stringstream saved;
    torch::save(opt, saved);
    torch::load(opt, saved);
  }
  for (const bool sgd : {false, true}) {
    SCOPED_TRACE(sgd ? "FusedSGD, a momentum buffer as a grad" : "FusedAdam, an exp_avg as a grad");
    auto p = param({50}, torch::kFloat), q = param({50}, torch::kFloat);
    std::unique_ptr<torch::optim::Optimizer> opt;
    if (sgd) opt = std::make_unique<ampfuse::FusedSGD>(std::vector<torch::Tensor>{p, q}, torch::optim::SGDOptions(0.1).momentum(0.9));
    else opt = std::make_unique<ampfuse::FusedAdam>(std::vector<torch::Tensor>{p, q}, torch::optim::AdamOptions(0.1));
    for (int step = 0; step < 3; ++step) {
      fill_grads(*opt);  // new grads at every step: the plan takes them as moved
      opt->step();
    }
    const auto& q_state = *opt->state().at(q.unsafeGetTensorImpl());
    const torch::Tensor shared = sgd ? static_cast<const torch::optim::SGDParamState&>(q_state).momentum_buffer()
                                     : static_cast<const torch::optim::AdamParamState&>(q_state).exp_avg();
    p.mutable_grad() = shared;
    const auto before = clones({p, q, shared});
    expect_step_refused(*opt, "param group 0, param 1: a state tensor shares memory with the grad of param group 0, param 0");
    EXPECT_TRUE(same_snapshots(before, clones({p, q, shared})));
    p.mutable_grad() = torch::randn_like(p);
    opt->step();
  }
  {
    SCOPED_TRACE("a negative step count");
    auto p = param({50}, torch::kFloat), q = param({3}, torch::kFloat);
    ampfuse::FusedAdam opt({p, q}, torch::optim::AdamOptions(0.1));
    for (int step = 0; step < 3; ++step) {
      fill_grads(opt);
      opt.step();
    }
    auto& state = static_cast<ampfuse::FusedAdamParamState&>(*opt.state().at(q.unsafeGetTensorImpl()));
    state.step(-5);
    const auto before = clones({p, q});
    for (int attempt = 0; attempt < 2; ++attempt)  // by the kept plan, then by validation
      expect_step_refused(opt, "FusedAdam: param group 0, param 1: state step is -5");
    EXPECT_TRUE(same_snapshots(before, clones({p, q})));
    EXPECT_EQ(state.step(), -5);
    EXPECT_EQ(static_cast<ampfuse::FusedAdamParamState&>(*opt.state().at(p.unsafeGetTensorImpl())).step(), 3);
    state.step(3);
    opt.step();
  }
  if (device_.is_cpu()) {
    // FusedLAMB keeps its count in a tensor, which a step reads on CPU: a
    // count set from outside (negative, a fraction, NaN) is refused there,
    // by the kept plan and by validation, as load() refuses it, naming it;
    // nothing is written. (On CUDA load() checks it; a step does not read it.)
    for (const double bad : {-3.0, 2.5, std::numeric_limits<double>::quiet_NaN()}) {
      SCOPED_TRACE("FusedLAMB, a step count of " + std::to_string(bad));
      auto p = param({50}, torch::kFloat), q = param({3}, torch::kFloat);
      ampfuse::FusedLAMB opt({p, q}, ampfuse::FusedLAMBOptions(0.1));
      for (int step = 0; step < 3; ++step) {
        fill_grads(opt);
        opt.step();
      }
      auto& state = static_cast<ampfuse::FusedLAMBParamState&>(*opt.state().at(q.unsafeGetTensorImpl()));
      state.step().fill_(bad);
      const auto before = clones({p, q});
      for (int attempt = 0; attempt < 2; ++attempt)  // by the kept plan, then by validation
        expect_step_refused(opt, "FusedLAMB: param group 0, param 1: state step is ");
      EXPECT_TRUE(same_snapshots(before, clones({p, q})));
      EXPECT_TRUE(std::isnan(bad) ? std::isnan(state.step().item<double>()) : state.step().item<double>() == bad);
      EXPECT_EQ(static_cast<ampfuse::FusedLAMBParamState&>(*opt.state().at(p.unsafeGetTensorImpl())).step().item<double>(),
                3.0);
      state.step().fill_(3.0);
      opt.step();
      EXPECT_EQ(state.step().item<double>(), 4.0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, StateModelTest, ::testing::Values("cpu", "cuda"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

}  // namespace
