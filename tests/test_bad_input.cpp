// Bad input: a clear error naming the tensor and the problem, and nothing
// written (found_inf, sum_sq and every tensor of the list unchanged).

#include <ampfuse/tensor_ops.h>

#include "tests/common.h"

namespace {

using ::testing::HasSubstr;

// Runs scale_ and check_non_finite on `list` and expects both to throw a
// message containing `what`, with nothing written.
void expect_refused(std::vector<torch::Tensor> list, const std::string& what) {
  std::vector<torch::Tensor> before;
  for (const auto& t : list) before.push_back(t.defined() && t.layout() == torch::kStrided && t.device().is_cpu() ? t.clone() : t);
  auto found_inf = torch::zeros({1});
  auto sum_sq = torch::full({1}, 5.f);
  try {
    ampfuse::scale_(list, torch::full({1}, 2.f));
    ADD_FAILURE() << "scale_ accepted a list with: " << what;
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr(what));
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("ampfuse::scale_"));
  }
  try {
    ampfuse::check_non_finite(list, found_inf, sum_sq);
    ADD_FAILURE() << "check_non_finite accepted a list with: " << what;
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr(what));
  }
  try {
    ampfuse::unscale_(list, found_inf, torch::full({1}, 0.5f));
    ADD_FAILURE() << "unscale_ accepted a list with: " << what;
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr(what));
  }
  EXPECT_EQ(found_inf.item<float>(), 0.f);
  EXPECT_EQ(sum_sq.item<float>(), 5.f);
  for (std::size_t i = 0; i < list.size(); ++i)
    if (before[i].defined() && before[i].layout() == torch::kStrided && before[i].device().is_cpu() &&
        before[i].is_floating_point())
      EXPECT_TRUE(torch::equal(list[i], before[i])) << "tensor " << i << " was written";
}

TEST(BadInput, IntegerDtype) {
  expect_refused({torch::randn({4}), torch::ones({3}, torch::kInt64)}, "tensors[1] has dtype Long");
}

TEST(BadInput, ComplexDtype) {
  expect_refused({torch::randn({4}), torch::randn({3}, torch::kComplexFloat)}, "tensors[1] has dtype ComplexFloat");
}

TEST(BadInput, SparseTensor) {
  auto sparse = torch::randn({4, 4}).to_sparse();
  expect_refused({torch::randn({4}), sparse}, "tensors[1] has layout Sparse");
}

// A view whose elements share memory cannot be written in place (ATen
// refuses it too); it can be read.
TEST(BadInput, ExpandedViewIsNotWrittenInPlace) {
  const auto expanded = torch::randn({1, 4}).expand({3, 4});
  for (bool unscale : {false, true}) {
    auto found_inf = torch::zeros({1});
    try {
      if (unscale) ampfuse::unscale_({torch::randn({4}), expanded}, found_inf, torch::full({1}, 0.5f));
      else ampfuse::scale_({torch::randn({4}), expanded}, torch::full({1}, 2.f));
      ADD_FAILURE() << "an expanded view was written in place";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr("tensors[1] has elements that share memory"));
    }
    EXPECT_EQ(found_inf.item<float>(), 0.f);
  }
  auto found_inf = torch::zeros({1});
  ampfuse::check_non_finite({expanded}, found_inf);
  EXPECT_EQ(found_inf.item<float>(), 0.f);
}

TEST(BadInput, DenseNonContiguousLayoutsAreAccepted) {
  // A transposed matrix and a channels-last tensor fill one block of memory.
  auto t = torch::randn({5, 6}).t();
  auto cl = torch::randn({2, 3, 4, 5}).contiguous(torch::MemoryFormat::ChannelsLast);
  auto t_ref = t * 2, cl_ref = cl * 2;
  ampfuse::scale_({t, cl}, torch::full({1}, 2.f));
  EXPECT_TRUE(torch::equal(t, t_ref));
  EXPECT_TRUE(torch::equal(cl, cl_ref));
}

TEST(BadInput, UndefinedTensor) {
  expect_refused({torch::randn({4}), torch::Tensor()}, "tensors[1] is undefined");
}

TEST(BadInput, DifferentDevices) {
  // The meta device stands in for a second device on a machine without a GPU.
  expect_refused({torch::randn({4}), torch::empty({3}, torch::Device(torch::kMeta))}, "tensors[1] is on meta");
  if (ampfuse_test::cuda_available())
    expect_refused({torch::randn({4}), torch::randn({3}, torch::kCUDA)}, "tensors[1] is on cuda");
}

TEST(BadInput, ScalarsMustBeOneFloatOnTheDevice) {
  std::vector<torch::Tensor> list = {torch::randn({4})};
  const auto before = list[0].clone();
  EXPECT_THROW(
      {
        try {
          ampfuse::check_non_finite(list, torch::zeros({1}, torch::kDouble));
        } catch (const c10::Error& e) {
          EXPECT_THAT(e.what_without_backtrace(), HasSubstr("found_inf must be a dense float32 tensor of one element"));
          throw;
        }
      },
      c10::Error);
  EXPECT_THROW(ampfuse::check_non_finite(list, torch::zeros({2})), c10::Error);
  EXPECT_THROW(ampfuse::check_non_finite(list, torch::zeros({1}), torch::zeros({1}, torch::kHalf)), c10::Error);
  EXPECT_THROW(ampfuse::unscale_(list, torch::zeros({1}, torch::kDouble), torch::ones({1})), c10::Error);
  EXPECT_THROW(ampfuse::scale_(list, torch::ones({1}, torch::kHalf)), c10::Error);
  EXPECT_THROW(ampfuse::scale_(list, torch::Tensor()), c10::Error);
  EXPECT_TRUE(torch::equal(list[0], before));
}

TEST(BadInput, ListsOfDifferentLengthsOrShapes) {
  std::vector<torch::Tensor> params = {torch::randn({4}), torch::randn({2, 3})};
  std::vector<torch::Tensor> grads_short = {torch::randn({4})};
  std::vector<torch::Tensor> grads_shape = {torch::randn({4}), torch::randn({3, 2})};
  try {
    ampfuse::make_list_views({params, grads_short}, {"param", "grad"}, "test_op");
    ADD_FAILURE() << "accepted lists of different lengths";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("test_op: grad has 1 tensors but param has 2"));
  }
  try {
    ampfuse::make_list_views({params, grads_shape}, {"param", "grad"}, "test_op");
    ADD_FAILURE() << "accepted lists of different shapes";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("test_op: grad[1] has shape [3, 2] but param[1] has shape [2, 3]"));
  }
  std::vector<torch::Tensor> grads_layout = {torch::randn({4}), torch::randn({3, 2}).t()};
  try {
    ampfuse::make_list_views({params, grads_layout}, {"param", "grad"}, "test_op");
    ADD_FAILURE() << "accepted lists of different memory layouts";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("test_op: grad[1] has strides [1, 2] but param[1] has strides [3, 1]"));
  }
  const auto views = ampfuse::make_list_views({params, params}, {"param", "grad"}, "test_op");
  EXPECT_EQ(views.depth(), 2);
  EXPECT_EQ(views.num_tensors(), 2);
  EXPECT_EQ(views.lists[1][1].numel, 6);
}

TEST(BadInput, EmptyListIsANoOp) {
  auto found_inf = torch::zeros({1});
  ampfuse::check_non_finite({}, found_inf);
  ampfuse::scale_({}, torch::ones({1}));
  EXPECT_EQ(found_inf.item<float>(), 0.f);
}

}  // namespace
