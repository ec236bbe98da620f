// Sparse grads (an Embedding with sparse=true) in FusedAdagrad and FusedSGD
// (with a sparse momentum buffer), as torch::optim::Adagrad and SGD take them: alone and beside dense parameters in one
// optimizer, with duplicate indices, empty grads and grads that turn dense,
// without a scaler and under GradScaler (which steps such an optimizer on
// PyTorch's path), on CPU and CUDA (skipped without a device). Sparse rows
// must equal LibTorch's bit for bit (the same ATen ops, in its order).
// Weight decay with a sparse grad, and sparse grads where the contract
// path would read them, are refused before anything is written.

#include <ampfuse/ampfuse.h>

#include <limits>
#include <sstream>

#include "tests/common.h"

namespace {

using ampfuse_test::bitwise_equal;
using ampfuse_test::expect_close;

struct SparseCase {
  std::string device;
  std::string isa;  // empty: the default instruction set
};

void PrintTo(const SparseCase& c, std::ostream* os) { *os << c.device; }

template <class F>
void expect_refused(F&& f, const std::string& message) {
  try {
    f();
    ADD_FAILURE() << "not refused; expected: " << message;
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), ::testing::HasSubstr(message));
  }
}

class SparseGradTest : public ampfuse_test::DeviceIsaTest<SparseCase> {
 protected:
  // An embedding's grad: `rows` random row indices (with repeats, left
  // uncoalesced, as an embedding's backward makes them) of a [n, d] table.
  torch::Tensor sparse_grad(const torch::Tensor& table, std::int64_t rows, torch::Dtype dtype) {
    const auto opts = torch::TensorOptions().device(device_);
    const auto indices = torch::randint(table.size(0), {1, rows}, opts.dtype(torch::kLong));
    const auto values = torch::randn({rows, table.size(1)}, opts).to(dtype);
    return torch::sparse_coo_tensor(indices, values, table.sizes(), opts.dtype(dtype));
  }
  // Two groups: `dense` (9 elements, a dense grad) and `table` ([10, 2], a
  // sparse grad) with `table_options`.
  std::vector<torch::optim::OptimizerParamGroup> dense_and_sparse(
      torch::Tensor& dense, torch::Tensor& table, std::unique_ptr<torch::optim::OptimizerOptions> table_options) {
    const auto opts = torch::TensorOptions().device(device_);
    dense = torch::randn({9}, opts).requires_grad_();
    table = torch::randn({10, 2}, opts).requires_grad_();
    dense.mutable_grad() = torch::randn_like(dense);
    table.mutable_grad() = sparse_grad(table, 4, torch::kFloat);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<torch::Tensor>{dense});
    groups.emplace_back(std::vector<torch::Tensor>{table}, std::move(table_options));
    return groups;
  }
};

// 20 steps of two groups: an embedding with sparse grads beside a dense
// parameter, and a second embedding, with lr_decay and eps; some steps'
// sparse grads are empty, and one step gives the first embedding a dense
// grad (the step plan changes both ways). Maximize against LibTorch on
// negated grads.
TEST_P(SparseGradTest, AdagradStepsSparseGradsAsTorchOptim) {
  for (const auto dtype : {torch::kFloat, torch::kDouble}) {
    for (const bool maximize : {false, true}) {
      SCOPED_TRACE(ampfuse_test::dtype_name(dtype) + (maximize ? ", maximize" : ""));
      const auto opts = torch::TensorOptions().device(device_).dtype(dtype);
      std::vector<torch::Tensor> ours = {torch::randn({50, 4}, opts).requires_grad_(),
                                         torch::randn({7}, opts).requires_grad_(),
                                         torch::randn({20, 3}, opts).requires_grad_()};
      const auto ref = copies(ours, dtype);
      auto groups = [](const std::vector<torch::Tensor>& p) {
        std::vector<torch::optim::OptimizerParamGroup> g;
        g.emplace_back(std::vector<torch::Tensor>{p[0], p[1]},
                       std::make_unique<torch::optim::AdagradOptions>(torch::optim::AdagradOptions(0.1).lr_decay(0.05)));
        g.emplace_back(std::vector<torch::Tensor>{p[2]},
                       std::make_unique<torch::optim::AdagradOptions>(torch::optim::AdagradOptions(0.03).eps(1e-6)));
        return g;
      };
      ampfuse::FusedAdagrad opt(groups(ours), torch::optim::AdagradOptions(0.1).initial_accumulator_value(0.2),
                                ampfuse::FusedAdagradOptions().maximize(maximize));
      torch::optim::Adagrad ref_opt(groups(ref), torch::optim::AdagradOptions(0.1).initial_accumulator_value(0.2));
      for (int step = 0; step < 20; ++step) {
        for (std::size_t i = 0; i < ours.size(); ++i) {
          torch::Tensor g;
          if (i == 1 || (i == 0 && step == 9)) g = torch::randn_like(ours[i]);
          else g = sparse_grad(ours[i], step % 7 == 3 ? 0 : 1 + static_cast<std::int64_t>(rng_() % 30), dtype);
          ours[i].mutable_grad() = g;
          ref[i].mutable_grad() = maximize ? -g : g.clone();
        }
        opt.step();
        ref_opt.step();
        SCOPED_TRACE("step " + std::to_string(step));
        ASSERT_TRUE(bitwise_equal(ours[2].detach(), ref[2].detach()));
        if (step < 9) ASSERT_TRUE(bitwise_equal(ours[0].detach(), ref[0].detach()));
      }
      // The dense steps (the fused kernel, rounding as one formula) follow LibTorch's ops closely.
      expect_close(ours, ref, dtype == torch::kDouble ? 1e-12 : 1e-5, "after 20 steps");
      for (std::size_t i = 0; i < ours.size(); ++i) {
        const auto& s = static_cast<const ampfuse::FusedAdagradParamState&>(*opt.state().at(ours[i].unsafeGetTensorImpl()));
        const auto& r = static_cast<const torch::optim::AdagradParamState&>(*ref_opt.state().at(ref[i].unsafeGetTensorImpl()));
        EXPECT_EQ(s.device_step().defined() ? s.device_step().item<double>() : static_cast<double>(s.step()), static_cast<double>(r.step()));
        expect_close({s.sum()}, {r.sum()}, dtype == torch::kDouble ? 1e-12 : 1e-5, "sum " + std::to_string(i));
      }
    }
  }
}

// Under GradScaler: an optimizer with a sparse grad takes PyTorch's path
// (unscale in place, then step() or skip), as torch::optim::Adagrad does
// under it; clip_grad_norm_ on some steps and an inf on one.
TEST_P(SparseGradTest, UnderGradScalerAsTorchOptimAdagrad) {
  const auto opts = torch::TensorOptions().device(device_);
  std::vector<torch::Tensor> ours = {torch::randn({40, 8}, opts).requires_grad_(),
                                     torch::randn({33}, opts).requires_grad_()};
  const auto ref = copies(ours);
  ampfuse::FusedAdagrad opt(ours, torch::optim::AdagradOptions(0.05));
  torch::optim::Adagrad ref_opt(ref, torch::optim::AdagradOptions(0.05));
  const auto scaler_options = ampfuse::GradScalerOptions().init_scale(1024.0).growth_interval(3);
  ampfuse::GradScaler scaler(scaler_options), ref_scaler(scaler_options);
  for (int step = 0; step < 10; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const bool poison = step == 4, clip = step % 3 == 1;
    const float scale = static_cast<float>(scaler.get_scale());
    auto sparse = sparse_grad(ours[0], 12, torch::kFloat);
    sparse = torch::sparse_coo_tensor(sparse._indices(), sparse._values() * scale, sparse.sizes());
    if (poison) sparse._values()[3][1] = std::numeric_limits<float>::infinity();
    const auto dense = torch::randn_like(ours[1]) * scale;
    ours[0].mutable_grad() = sparse;
    ref[0].mutable_grad() = sparse.clone();
    ours[1].mutable_grad() = dense.clone();
    ref[1].mutable_grad() = dense.clone();
    scaler.scale(torch::ones({}, opts));
    ref_scaler.scale(torch::ones({}, opts));
    if (clip) {
      const auto norm = scaler.clip_grad_norm_(opt, 3.0), ref_norm = ref_scaler.clip_grad_norm_(ref_opt, 3.0);
      if (!poison) EXPECT_TRUE(bitwise_equal(norm, ref_norm));
    }
    scaler.step(opt);
    ref_scaler.step(ref_opt);
    scaler.update();
    ref_scaler.update();
    EXPECT_EQ(scaler.last_step_skipped(opt), poison);
    EXPECT_EQ(scaler.get_scale(), ref_scaler.get_scale());
    ASSERT_TRUE(bitwise_equal(ours[0].detach(), ref[0].detach()));
  }
  expect_close(ours, ref, 1e-5, "after 10 steps, 1 skipped");
}

// Dense grads for some steps (GradScaler steps them in one pass from the
// second on), then a sparse one, then dense again: the sparse step fails the
// single pass before its check and takes PyTorch's path, as
// torch::optim::Adagrad's under the same scaler.
TEST_P(SparseGradTest, SparseGradAfterDenseStepsUnderGradScaler) {
  const auto opts = torch::TensorOptions().device(device_);
  std::vector<torch::Tensor> ours = {torch::randn({40, 8}, opts).requires_grad_(),
                                     torch::randn({33}, opts).requires_grad_()};
  const auto ref = copies(ours);
  ampfuse::FusedAdagrad opt(ours, torch::optim::AdagradOptions(0.05));
  torch::optim::Adagrad ref_opt(ref, torch::optim::AdagradOptions(0.05));
  const auto scaler_options = ampfuse::GradScalerOptions().init_scale(1024.0).growth_interval(3);
  ampfuse::GradScaler scaler(scaler_options), ref_scaler(scaler_options);
  for (int step = 0; step < 8; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const float scale = static_cast<float>(scaler.get_scale());
    if (step == 4 || step == 5) {
      auto sparse = sparse_grad(ours[0], 12, torch::kFloat);
      sparse = torch::sparse_coo_tensor(sparse._indices(), sparse._values() * scale, sparse.sizes());
      ours[0].mutable_grad() = sparse;
      ref[0].mutable_grad() = sparse.clone();
    } else {
      const auto dense = torch::randn_like(ours[0]) * scale;
      ours[0].mutable_grad() = dense.clone();
      ref[0].mutable_grad() = dense.clone();
    }
    const auto dense = torch::randn_like(ours[1]) * scale;
    ours[1].mutable_grad() = dense.clone();
    ref[1].mutable_grad() = dense.clone();
    scaler.scale(torch::ones({}, opts));
    ref_scaler.scale(torch::ones({}, opts));
    scaler.step(opt);
    ref_scaler.step(ref_opt);
    scaler.update();
    ref_scaler.update();
    EXPECT_FALSE(scaler.last_step_skipped(opt));
    EXPECT_EQ(scaler.get_scale(), ref_scaler.get_scale());
  }
  expect_close(ours, ref, 1e-5, "after 8 steps, 2 of them with a sparse grad");
}

// Weight decay with a sparse grad is refused, as torch::optim::Adagrad
// refuses it, naming the group and the parameter, before anything is
// written: the dense parameter stepped in the same call and its state stay
// as they were.
TEST_P(SparseGradTest, WeightDecayWithASparseGradIsRefusedAndChangesNothing) {
  torch::Tensor dense, table;
  const auto groups = dense_and_sparse(
      dense, table, std::make_unique<torch::optim::AdagradOptions>(torch::optim::AdagradOptions(0.1).weight_decay(0.01)));
  ampfuse::FusedAdagrad opt(groups, torch::optim::AdagradOptions(0.1));
  const auto before = dense.detach().clone(), table_before = table.detach().clone();
  ampfuse_test::expect_step_refused(
      opt, "FusedAdagrad: param group 1, param 0: the grad is sparse and the group's weight_decay is 0.01");
  EXPECT_TRUE(bitwise_equal(dense.detach(), before));
  EXPECT_TRUE(bitwise_equal(table.detach(), table_before));
  for (const auto& [key, state] : opt.state())
    EXPECT_EQ(static_cast<const ampfuse::FusedAdagradParamState&>(*state).step(), 0);
  // Without weight decay the same step goes through.
  static_cast<torch::optim::AdagradOptions&>(opt.param_groups()[1].options()).weight_decay(0);
  opt.step();
  EXPECT_FALSE(bitwise_equal(dense.detach(), before));
}

// The contract path reads dense grads only: a sparse grad given to
// step_with_signals is refused before anything is written (GradScaler never
// sends one there), and so is a sparse grad of the wrong shape.
TEST_P(SparseGradTest, SparseGradsWhereTheyCannotBeReadAreRefused) {
  const auto opts = torch::TensorOptions().device(device_);
  auto dense = torch::randn({5}, opts).requires_grad_(), table = torch::randn({8, 3}, opts).requires_grad_();
  dense.mutable_grad() = torch::randn_like(dense);
  table.mutable_grad() = sparse_grad(table, 3, torch::kFloat);
  ampfuse::FusedAdagrad opt({dense, table}, torch::optim::AdagradOptions(0.1));
  const auto before = dense.detach().clone();
  ampfuse::StepSignals signals;
  signals.set(device_, {torch::ones({}, opts), torch::zeros({}, opts), torch::Tensor()});
  expect_refused([&] { opt.step_with_signals(signals); },
                 "FusedAdagrad: param group 0, param 1: the grad is sparse, and a step under the scaler "
                 "contract reads dense grads only");
  EXPECT_TRUE(bitwise_equal(dense.detach(), before));
  table.mutable_grad() = torch::sparse_coo_tensor(torch::tensor({{1}}, torch::kLong).to(device_),
                                                  torch::randn({1, 3}, opts), {9, 3});
  ampfuse_test::expect_step_refused(opt, "FusedAdagrad: param group 0, param 1: grad shape");
  EXPECT_TRUE(bitwise_equal(dense.detach(), before));
  // Other fused optimizers refuse sparse grads, as torch::optim::Adam does.
  ampfuse::FusedAdam adam({table}, torch::optim::AdamOptions(0.1));
  ampfuse_test::expect_step_refused(adam, "FusedAdam: param group 0, param 0: the grad is sparse");
}

// FusedSGD without momentum: an embedding's sparse grads as
// torch::optim::SGD steps them (p += -lr * grad at the nonzeros), bit for
// bit, beside a dense parameter, maximize against negated grads, and under
// GradScaler (PyTorch's path) with an inf on one step.
TEST_P(SparseGradTest, SgdStepsSparseGradsAsTorchOptim) {
  for (const bool scaled : {false, true}) {
    for (const bool maximize : {false, true}) {
      SCOPED_TRACE(std::string(scaled ? "scaled" : "unscaled") + (maximize ? ", maximize" : ""));
      const auto opts = torch::TensorOptions().device(device_);
      std::vector<torch::Tensor> ours = {torch::randn({30, 5}, opts).requires_grad_(),
                                         torch::randn({11}, opts).requires_grad_()};
      const auto ref = copies(ours);
      ampfuse::FusedSGD opt(ours, torch::optim::SGDOptions(0.1), ampfuse::FusedSGDOptions().maximize(maximize));
      torch::optim::SGD ref_opt(ref, torch::optim::SGDOptions(0.1));
      ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(64.0)),
          ref_scaler(ampfuse::GradScalerOptions().init_scale(64.0));
      for (int step = 0; step < 6; ++step) {
        SCOPED_TRACE("step " + std::to_string(step));
        const float scale = scaled ? static_cast<float>(scaler.get_scale()) : 1.f;
        auto sparse = sparse_grad(ours[0], 9, torch::kFloat);
        sparse = torch::sparse_coo_tensor(sparse._indices(), sparse._values() * scale, sparse.sizes());
        if (scaled && step == 2) sparse._values()[0][0] = std::numeric_limits<float>::infinity();
        const auto dense = torch::randn_like(ours[1]) * scale;
        ours[0].mutable_grad() = sparse;
        ours[1].mutable_grad() = dense.clone();
        ref[0].mutable_grad() = maximize ? -sparse : sparse.clone();
        ref[1].mutable_grad() = maximize ? -dense : dense.clone();
        if (scaled) {
          scaler.scale(torch::ones({}, opts));
          ref_scaler.scale(torch::ones({}, opts));
          scaler.step(opt);
          ref_scaler.step(ref_opt);
          scaler.update();
          ref_scaler.update();
          EXPECT_EQ(scaler.last_step_skipped(opt), step == 2);
        } else {
          opt.step();
          ref_opt.step();
        }
        ASSERT_TRUE(bitwise_equal(ours[0].detach(), ref[0].detach()));
      }
      expect_close(ours, ref, 1e-6, "after 6 steps");
    }
  }
}

// FusedSGD with momentum (Nesterov, dampening) and sparse grads: the buffer
// is kept sparse as torch::optim::SGD keeps it, and every step of the sparse
// parameter is LibTorch's bit for bit, under GradScaler with an inf at step 2 (the first applied
// step makes the buffer); a checkpoint with the sparse buffer resumes bit for
// bit and loads into torch::optim::SGD.
TEST_P(SparseGradTest, SgdWithMomentumKeepsASparseBufferAsTorchOptim) {
  for (const bool nesterov : {false, true}) {
    for (const bool maximize : {false, true}) {
      SCOPED_TRACE(std::string(nesterov ? "nesterov" : "dampening 0.1") + (maximize ? ", maximize" : ""));
      const auto opts = torch::TensorOptions().device(device_);
      std::vector<torch::Tensor> ours = {torch::randn({30, 5}, opts).requires_grad_(),
                                         torch::randn({11}, opts).requires_grad_()};
      const auto ref = copies(ours);
      const auto options = nesterov ? torch::optim::SGDOptions(0.1).momentum(0.9).nesterov(true)
                                    : torch::optim::SGDOptions(0.1).momentum(0.8).dampening(0.1);
      ampfuse::FusedSGD opt(ours, options, ampfuse::FusedSGDOptions().maximize(maximize));
      torch::optim::SGD ref_opt(ref, options);
      ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(64.0)),
          ref_scaler(ampfuse::GradScalerOptions().init_scale(64.0));
      ampfuse::FusedSGD* active = &opt;
      const auto run = [&](int from, int to) {
        for (int step = from; step < to; ++step) {
          SCOPED_TRACE("step " + std::to_string(step));
          const float scale = static_cast<float>(scaler.get_scale());
          auto sparse = sparse_grad(ours[0], 9, torch::kFloat);
          sparse = torch::sparse_coo_tensor(sparse._indices(), sparse._values() * scale, sparse.sizes());
          if (step == 0) sparse._values()[0][0] = std::numeric_limits<float>::infinity();
          const auto dense = torch::randn_like(ours[1]) * scale;
          ours[0].mutable_grad() = sparse;
          ours[1].mutable_grad() = dense.clone();
          ref[0].mutable_grad() = maximize ? -sparse : sparse.clone();
          ref[1].mutable_grad() = maximize ? -dense : dense.clone();
          scaler.scale(torch::ones({}, opts));
          ref_scaler.scale(torch::ones({}, opts));
          scaler.step(*active);
          ref_scaler.step(ref_opt);
          scaler.update();
          ref_scaler.update();
          EXPECT_EQ(scaler.last_step_skipped(*active), step == 0);
          ASSERT_TRUE(bitwise_equal(ours[0].detach(), ref[0].detach()));
        }
      };
      run(0, 4);
      const auto& buf = static_cast<const ampfuse::FusedSGDParamState&>(*opt.state().at(ours[0].unsafeGetTensorImpl()))
                            .momentum_buffer();
      ASSERT_TRUE(buf.is_sparse());
      // Saved with its sparse buffer, loaded into a fresh FusedSGD and into torch::optim::SGD.
      std::stringstream bytes;
      {
        torch::serialize::OutputArchive archive;
        opt.save(archive);
        archive.save_to(bytes);
      }
      const std::string saved = bytes.str();
      ampfuse::FusedSGD resumed(ours, options, ampfuse::FusedSGDOptions().maximize(maximize));
      {
        std::istringstream in(saved);
        torch::serialize::InputArchive archive;
        archive.load_from(in);
        resumed.load(archive);
      }
      auto plain = copies(ours);
      torch::optim::SGD plain_opt(plain, options);
      {
        std::istringstream in(saved);
        torch::serialize::InputArchive archive;
        archive.load_from(in);
        plain_opt.load(archive);
      }
      const auto& plain_buf = static_cast<const torch::optim::SGDParamState&>(
                                  *plain_opt.state().at(plain[0].unsafeGetTensorImpl()))
                                  .momentum_buffer();
      EXPECT_TRUE(bitwise_equal(plain_buf.to_dense(), buf.to_dense()));
      active = &resumed;
      run(4, 8);
      expect_close(ours, ref, 1e-6, "after 8 steps");  // the dense parameter: the fused kernel's rounding
    }
  }
}

// FusedSGD refuses a sparse grad with weight decay (ATen cannot add a dense
// term to a sparse grad, nor can torch::optim::SGD), and a dense grad for a
// parameter whose momentum buffer sparse grads made (sparse += dense: it
// cannot either), naming the group and the parameter, before anything is
// written.
TEST_P(SparseGradTest, SgdRefusesSparseGradsWithWeightDecayAndDenseGradsOnASparseBuffer) {
  torch::Tensor dense, table;
  const auto groups = dense_and_sparse(
      dense, table, std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(0.1).weight_decay(0.01)));
  ampfuse::FusedSGD opt(groups, torch::optim::SGDOptions(0.1).momentum(0.9));
  auto before = dense.detach().clone(), table_before = table.detach().clone();
  ampfuse_test::expect_step_refused(opt, "FusedSGD: param group 1, param 0: the grad is sparse and the group's "
                                         "weight_decay is 0.01");
  EXPECT_TRUE(bitwise_equal(dense.detach(), before));
  EXPECT_TRUE(bitwise_equal(table.detach(), table_before));
  EXPECT_TRUE(opt.state().empty());
  // A sparse momentum buffer, then a dense grad for it.
  ampfuse::FusedSGD momentum({dense, table}, torch::optim::SGDOptions(0.1).momentum(0.9));
  momentum.step();
  table.mutable_grad() = torch::randn_like(table);
  before = dense.detach().clone();
  table_before = table.detach().clone();
  ampfuse_test::expect_step_refused(momentum, "FusedSGD: param group 0, param 1: the grad is dense but the momentum "
                                              "buffer is sparse");
  EXPECT_TRUE(bitwise_equal(dense.detach(), before));
  EXPECT_TRUE(bitwise_equal(table.detach(), table_before));
}

// With nesterov, a sparse grad on a dense momentum buffer (kept by earlier
// dense grads): torch::optim::SGD fails adding the dense buffer to the
// sparse grad; FusedSGD refuses the step before anything is written (it
// failed in the launch, after the other parameters had been updated).
TEST_P(SparseGradTest, SgdNesterovRefusesASparseGradOnADenseBufferAndChangesNothing) {
  const auto opts = torch::TensorOptions().device(device_);
  torch::Tensor dense = torch::randn({9}, opts).requires_grad_(), table = torch::randn({10, 2}, opts).requires_grad_();
  dense.mutable_grad() = torch::randn_like(dense);
  table.mutable_grad() = torch::randn_like(table);
  ampfuse::FusedSGD opt({dense, table}, torch::optim::SGDOptions(0.1).momentum(0.9).nesterov(true));
  opt.step();
  table.mutable_grad() = sparse_grad(table, 4, torch::kFloat);
  const auto before = dense.detach().clone(), table_before = table.detach().clone();
  const auto buffer = [&](const torch::Tensor& p) {
    return static_cast<const torch::optim::SGDParamState&>(*opt.state().at(p.unsafeGetTensorImpl()))
        .momentum_buffer()
        .clone();
  };
  const auto dense_buf = buffer(dense), table_buf = buffer(table);
  ampfuse_test::expect_step_refused(opt, "FusedSGD: param group 0, param 1: the grad is sparse, nesterov is on and "
                                         "the momentum buffer is dense");
  EXPECT_TRUE(bitwise_equal(dense.detach(), before));
  EXPECT_TRUE(bitwise_equal(table.detach(), table_before));
  EXPECT_TRUE(bitwise_equal(buffer(dense), dense_buf));
  EXPECT_TRUE(bitwise_equal(buffer(table), table_buf));
}

// Sparse grads that ATen cannot add to a sparse momentum buffer (fp16 on
// CPU: no sparse + sparse add; a grad whose sparse dims differ from the
// buffer's) made torch::optim::SGD, and FusedSGD, fail in the middle of the
// step, after the dense parameter beside them had moved and the buffer had
// been scaled (with nesterov, a first step also left a new buffer): refused
// now before anything is written, naming the group and parameter. A CSR
// grad is refused as clearly (it failed on "do not have strides").
TEST_P(SparseGradTest, SgdRefusesSparseGradsItCannotAddToItsBufferAndChangesNothing) {
  const auto opts = torch::TensorOptions().device(device_);
  const auto expect_nothing_changed = [&](ampfuse::FusedSGD& opt, const std::vector<torch::Tensor>& params,
                                          const std::string& error) {
    std::vector<torch::Tensor> before, buffers;
    for (const auto& p : params) before.push_back(p.detach().clone());
    const auto states = opt.state().size();
    for (const auto& p : params) {
      const auto it = opt.state().find(p.unsafeGetTensorImpl());
      buffers.push_back(it == opt.state().end()
                            ? torch::Tensor()
                            : static_cast<const torch::optim::SGDParamState&>(*it->second).momentum_buffer().clone());
    }
    ampfuse_test::expect_step_refused(opt, error);
    EXPECT_EQ(opt.state().size(), states);
    for (std::size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(params[i].detach(), before[i])) << "param " << i;
      if (!buffers[i].defined()) continue;
      const auto& now = static_cast<const torch::optim::SGDParamState&>(*opt.state().at(params[i].unsafeGetTensorImpl()))
                            .momentum_buffer();
      EXPECT_TRUE(bitwise_equal(now.is_sparse() ? now.to_dense() : now,
                                buffers[i].is_sparse() ? buffers[i].to_dense() : buffers[i]))
          << "buffer " << i;
    }
  };
  if (device_.is_cpu()) {
    for (const bool nesterov : {false, true}) {
      SCOPED_TRACE(nesterov ? "nesterov" : "momentum");
      auto dense = torch::randn({9}, opts.dtype(torch::kHalf)).requires_grad_();
      auto table = torch::randn({10, 2}, opts.dtype(torch::kHalf)).requires_grad_();
      auto ref_dense = dense.detach().clone().requires_grad_(), ref_table = table.detach().clone().requires_grad_();
      const auto options = torch::optim::SGDOptions(0.1).momentum(0.9).nesterov(nesterov);
      ampfuse::FusedSGD opt({dense, table}, options);
      torch::optim::SGD ref({ref_dense, ref_table}, options);
      const auto both_step = [&](const torch::Tensor& dense_grad, const torch::Tensor& table_grad) {
        dense.mutable_grad() = dense_grad;
        table.mutable_grad() = table_grad;
        ref_dense.mutable_grad() = dense_grad.clone();
        ref_table.mutable_grad() = table_grad.clone();
        opt.step();
        ref.step();
        // (The dense fp16 parameter: fp32 math against ATen's fp16 ops, an ulp apart at most.)
        EXPECT_TRUE(torch::allclose(dense.detach().to(torch::kFloat), ref_dense.detach().to(torch::kFloat), 2e-3, 1e-3));
        EXPECT_TRUE(bitwise_equal(table.detach(), ref_table.detach()));
      };
      // The first step keeps a clone of the grad: no add yet (without nesterov).
      if (!nesterov) both_step(torch::randn_like(dense), sparse_grad(table, 3, torch::kHalf));
      // A grad without nonzeros adds nothing, which ATen does without the kernel it lacks: stepped as torch::optim::SGD.
      const auto empty = torch::sparse_coo_tensor(torch::zeros({1, 0}, opts.dtype(torch::kLong)),
                                                  torch::zeros({0, 2}, opts.dtype(torch::kHalf)), {10, 2});
      both_step(torch::randn_like(dense), empty);
      dense.mutable_grad() = torch::randn_like(dense);
      table.mutable_grad() = sparse_grad(table, 3, torch::kHalf);
      expect_nothing_changed(opt, {dense, table},
                             "FusedSGD: param group 0, param 1: the grad is a sparse fp16 tensor on CPU, and momentum "
                             "adds it to a sparse buffer");
    }
  }
  // A buffer of 1 sparse dim, then a grad of 2.
  auto dense = torch::randn({9}, opts).requires_grad_(), table = torch::randn({10, 2}, opts).requires_grad_();
  ampfuse::FusedSGD opt({dense, table}, torch::optim::SGDOptions(0.1).momentum(0.9));
  dense.mutable_grad() = torch::randn_like(dense);
  table.mutable_grad() = sparse_grad(table, 3, torch::kFloat);
  opt.step();
  dense.mutable_grad() = torch::randn_like(dense);
  table.mutable_grad() = torch::randn({10, 2}, opts).to_sparse(2);
  expect_nothing_changed(opt, {dense, table},
                         "FusedSGD: param group 0, param 1: the grad is sparse with 2 sparse and 0 dense dims, but "
                         "the momentum buffer (kept from earlier sparse grads) has 1 and 1");
  // CSR.
  if (device_.is_cpu()) {
    table.mutable_grad() = torch::randn({10, 2}, opts).to_sparse_csr();
    expect_nothing_changed(opt, {dense, table},
                           "FusedSGD: param group 0, param 1: the grad has layout SparseCsr; optimizers take strided "
                           "grads, and sparse COO ones");
  }
}

INSTANTIATE_TEST_SUITE_P(All, SparseGradTest, ::testing::Values(SparseCase{"cpu", ""}, SparseCase{"cuda", ""}),
                         [](const ::testing::TestParamInfo<SparseCase>& info) { return info.param.device; });

}  // namespace
