#include "kernels/cuda/cross_entropy.h"

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cross_entropy.h"
#include "kernels/cuda/ops_test_util.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

using ops_testing::DeviceBuffer;
using ops_testing::DeviceBytes;

// Loss: the logits differ from the CPU's only by summation order (both
// paths see the same, bf16-exact, inputs), so 2e-5 relative for either
// dtype. Gradients: fp32 1e-5; bf16 1e-2 (the logits gradient is rounded to
// bf16 before the backward GEMMs, and dhidden is stored in bf16).
constexpr double kLoss = 2e-5;
template <typename T>
struct Tolerance;
template <>
struct Tolerance<float> {
  static constexpr double kGrad = 1e-5;
};
template <>
struct Tolerance<uint16_t> {
  static constexpr double kGrad = 1e-2;
};

constexpr int32_t kIgnore = -100;

std::vector<int32_t> Targets(int64_t n, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> dist(0, vocab - 1);
  std::vector<int32_t> t(n);
  for (int64_t i = 0; i < n; ++i) t[i] = (i % 7 == 3) ? kIgnore : dist(rng);
  return t;
}

CrossEntropyDeviceResult Download(
    const DeviceBuffer<CrossEntropyDeviceResult>& result) {
  return result.Download()[0];
}

template <typename T>
class CrossEntropyGpuTest : public ::testing::Test {};
using StorageTypes = ::testing::Types<float, uint16_t>;
TYPED_TEST_SUITE(CrossEntropyGpuTest, StorageTypes);

TYPED_TEST(CrossEntropyGpuTest, MatchesCpu) {
  using T = TypeParam;
  SHARDD_SKIP_WITHOUT_GPU();
  ops_testing::GpuContext gpu;
  struct Case {
    CrossEntropyDims dims;
    int64_t block_rows;
  };
  // Several blocks with a ragged last one; one block larger than T; an odd
  // vocab.
  for (const Case c : {Case{{300, 64, 1000}, 128}, Case{{50, 32, 517}, 256},
                       Case{{129, 48, 4096}, 1}}) {
    for (const bool accumulate : {false, true}) {
      const CrossEntropyDims& dims = c.dims;
      SCOPED_TRACE(::testing::Message()
                   << "T " << dims.tokens << " D " << dims.dim << " V "
                   << dims.vocab << " block " << c.block_rows << " accumulate "
                   << accumulate);
      const int64_t t = dims.tokens, d = dims.dim, v = dims.vocab;
      const auto hidden = ops_testing::RoundedToBf16(
          ops_testing::RandomVector(t * d, -1.0f, 1.0f, 1));
      const auto weight = ops_testing::RoundedToBf16(
          ops_testing::RandomVector(v * d, -0.3f, 0.3f, 2));
      const auto targets = Targets(t, v, 3);
      const auto dh0 = ops_testing::RoundedToBf16(
          ops_testing::RandomVector(t * d, -1.0f, 1.0f, 4));
      const auto dw0 = ops_testing::RandomVector(v * d, -1.0f, 1.0f, 5);
      const float loss_scale = 1.0f / 200.0f;

      kernels::CrossEntropyOptions cpu_options;
      cpu_options.ignore_index = kIgnore;
      cpu_options.block_rows = c.block_rows;
      std::vector<float> dh = dh0, dw = dw0;
      SHARDD_ASSERT_OK_AND_ASSIGN(
          const kernels::CrossEntropyResult expected,
          kernels::LmHeadCrossEntropyBackward(
              hidden.data(), weight.data(), t, d, v, targets.data(), loss_scale,
              dh.data(), dw.data(), accumulate, cpu_options));

      CudaCrossEntropyOptions options;
      options.ignore_index = kIgnore;
      options.block_rows = c.block_rows;
      DeviceBuffer<T> d_hidden(ops_testing::ToStorage<T>(hidden));
      DeviceBuffer<T> d_weight(ops_testing::ToStorage<T>(weight));
      DeviceBuffer<int32_t> d_targets(targets);
      DeviceBuffer<CrossEntropyDeviceResult> d_forward(1), d_backward(1);
      DeviceBytes forward_ws(CrossEntropyWorkspaceBytes(
          dims, DTypeOf<T>::value, options, /*with_grad=*/false));
      SHARDD_ASSERT_OK(LmHeadCrossEntropyForward(
          dims, d_hidden.get(), d_weight.get(), d_targets.get(),
          d_forward.get(), forward_ws.get(), forward_ws.size(), options,
          gpu.handle(), gpu.stream()));
      DeviceBuffer<T> d_dh(ops_testing::ToStorage<T>(dh0));
      DeviceBuffer<float> d_dw(dw0);
      DeviceBytes backward_ws(CrossEntropyWorkspaceBytes(
          dims, DTypeOf<T>::value, options, /*with_grad=*/true));
      SHARDD_ASSERT_OK(LmHeadCrossEntropyBackward(
          dims, d_hidden.get(), d_weight.get(), d_targets.get(), loss_scale,
          d_dh.get(), d_dw.get(), accumulate, d_backward.get(),
          backward_ws.get(), backward_ws.size(), options, gpu.handle(),
          gpu.stream()));
      gpu.Sync();
      for (const CrossEntropyDeviceResult& r :
           {Download(d_forward), Download(d_backward)}) {
        EXPECT_EQ(r.count, expected.count);
        EXPECT_EQ(r.invalid_targets, 0);
        EXPECT_NEAR(r.loss_sum, expected.loss_sum,
                    kLoss * std::abs(expected.loss_sum));
        EXPECT_NEAR(r.mean_loss, expected.mean_loss,
                    kLoss * std::abs(expected.mean_loss));
      }
      constexpr double kGrad = Tolerance<T>::kGrad;
      ops_testing::ExpectAllClose(ops_testing::ToFloat(d_dh.Download()), dh,
                                  kGrad, kGrad, "dhidden");
      ops_testing::ExpectAllClose(d_dw.Download(), dw, kGrad, kGrad, "dweight");
    }
  }
}

// Targets outside [0, V) are counted and contribute nothing, like ignored
// ones; the CPU reference sees them as ignore_index.
TYPED_TEST(CrossEntropyGpuTest, InvalidTargetsAreCountedAndSkipped) {
  using T = TypeParam;
  SHARDD_SKIP_WITHOUT_GPU();
  ops_testing::GpuContext gpu;
  const CrossEntropyDims dims{6, 16, 40};
  const auto hidden = ops_testing::RoundedToBf16(
      ops_testing::RandomVector(dims.tokens * dims.dim, -1.0f, 1.0f, 6));
  const auto weight = ops_testing::RoundedToBf16(
      ops_testing::RandomVector(dims.vocab * dims.dim, -0.3f, 0.3f, 7));
  const std::vector<int32_t> targets = {3, 40, kIgnore, -1, 39, 0};
  std::vector<int32_t> cpu_targets = targets;
  cpu_targets[1] = cpu_targets[3] = kIgnore;
  kernels::CrossEntropyOptions cpu_options;
  cpu_options.ignore_index = kIgnore;
  std::vector<float> dh(hidden.size()), dw(weight.size(), 0.0f);
  SHARDD_ASSERT_OK_AND_ASSIGN(
      const kernels::CrossEntropyResult expected,
      kernels::LmHeadCrossEntropyBackward(
          hidden.data(), weight.data(), dims.tokens, dims.dim, dims.vocab,
          cpu_targets.data(), 0.25f, dh.data(), dw.data(), false, cpu_options));

  CudaCrossEntropyOptions options;
  options.ignore_index = kIgnore;
  DeviceBuffer<T> d_hidden(ops_testing::ToStorage<T>(hidden));
  DeviceBuffer<T> d_weight(ops_testing::ToStorage<T>(weight));
  DeviceBuffer<int32_t> d_targets(targets);
  DeviceBuffer<CrossEntropyDeviceResult> d_result(1);
  DeviceBuffer<T> d_dh(hidden.size());
  DeviceBuffer<float> d_dw(std::vector<float>(weight.size(), 0.0f));
  DeviceBytes ws(
      CrossEntropyWorkspaceBytes(dims, DTypeOf<T>::value, options, true));
  SHARDD_ASSERT_OK(LmHeadCrossEntropyBackward(
      dims, d_hidden.get(), d_weight.get(), d_targets.get(), 0.25f, d_dh.get(),
      d_dw.get(), false, d_result.get(), ws.get(), ws.size(), options,
      gpu.handle(), gpu.stream()));
  gpu.Sync();
  const CrossEntropyDeviceResult r = Download(d_result);
  EXPECT_EQ(r.count, 3);
  EXPECT_EQ(r.count, expected.count);
  EXPECT_EQ(r.invalid_targets, 2);
  EXPECT_NEAR(r.loss_sum, expected.loss_sum,
              kLoss * std::abs(expected.loss_sum));
  constexpr double kGrad = Tolerance<T>::kGrad;
  ops_testing::ExpectAllClose(ops_testing::ToFloat(d_dh.Download()), dh, kGrad,
                              kGrad, "dhidden");
  ops_testing::ExpectAllClose(d_dw.Download(), dw, kGrad, kGrad, "dweight");
}

}  // namespace
}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
