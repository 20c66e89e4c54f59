#include "kernels/cuda/router.h"

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/cpu/router.h"
#include "kernels/cuda/ops_test_util.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

using ops_testing::DeviceBuffer;
using ops_testing::DeviceBytes;

// Inputs whose logits every summation order computes exactly: x in
// {-1, 0, 1} and w in multiples of 1/64 (also exact in bf16 and TF32). The
// top-k selection then sees identical logits on CPU and GPU; equal logits are
// real ties (testing the lower-index rule) and unequal ones differ by >= 1/64,
// far beyond the softmax's rounding, so no selection can flip.
std::vector<float> TernaryX(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> dist(-1, 1);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(dist(rng));
  return v;
}
std::vector<float> QuantizedW(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> dist(-32, 32);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(dist(rng)) / 64.0f;
  return v;
}

// fp32: rounding of exp/sum order only. bf16: d_logits are rounded to bf16
// before the backward GEMMs (and dx is stored in bf16).
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
constexpr double kProb = 1e-5;

template <typename T>
class RouterGpuTest : public ::testing::Test {};
using StorageTypes = ::testing::Types<float, uint16_t>;
TYPED_TEST_SUITE(RouterGpuTest, StorageTypes);

TYPED_TEST(RouterGpuTest, MatchesCpu) {
  using T = TypeParam;
  SHARDD_SKIP_WITHOUT_GPU();
  ops_testing::GpuContext gpu;
  for (const RouterDims dims :
       {RouterDims{200, 32, 8, 2}, RouterDims{333, 48, 64, 6},
        RouterDims{64, 32, 256, 16}, RouterDims{40, 16, 1000, 32},
        // Qwen3 with norm_topk_prob false: the weights are the
        // probabilities.
        RouterDims{200, 32, 8, 2, /*renormalize=*/false},
        RouterDims{64, 32, 128, 8, /*renormalize=*/false}}) {
    for (const bool accumulate_dx : {false, true}) {
      SCOPED_TRACE(::testing::Message()
                   << "T " << dims.tokens << " D " << dims.dim << " E "
                   << dims.experts << " K " << dims.top_k << " accumulate "
                   << accumulate_dx << " renormalize " << dims.renormalize);
      const int64_t t = dims.tokens, d = dims.dim, e = dims.experts,
                    k = dims.top_k;
      const auto x = TernaryX(t * d, 1);
      const auto w = QuantizedW(e * d, 2);
      const auto d_weights = ops_testing::RandomVector(t * k, -1.0f, 1.0f, 3);
      const auto dx0 = ops_testing::RoundedToBf16(
          ops_testing::RandomVector(t * d, -1.0f, 1.0f, 4));
      const auto dw0 = ops_testing::RandomVector(e * d, -1.0f, 1.0f, 5);

      kernels::RouterDims cpu_dims{t, d, e, k, dims.renormalize};
      kernels::RouterCache cache;
      std::vector<int32_t> indices(t * k);
      std::vector<float> weights(t * k), dx = dx0, dw = dw0;
      SHARDD_ASSERT_OK(kernels::RouterForward(cpu_dims, x.data(), w.data(),
                                              indices.data(), weights.data(),
                                              &cache));
      SHARDD_ASSERT_OK(kernels::RouterBackward(
          cpu_dims, x.data(), w.data(), d_weights.data(), dx.data(),
          accumulate_dx, dw.data(), &cache));

      DeviceBuffer<T> d_x(ops_testing::ToStorage<T>(x));
      DeviceBuffer<T> d_w(ops_testing::ToStorage<T>(w));
      DeviceBuffer<int32_t> d_indices(t * k);
      DeviceBuffer<float> d_weights_out(t * k);
      DeviceBytes saved(RouterSavedBytes(dims));
      SHARDD_ASSERT_OK(RouterForward(
          dims, d_x.get(), d_w.get(), d_indices.get(), d_weights_out.get(),
          saved.get(), saved.size(), gpu.handle(), gpu.stream()));
      DeviceBuffer<float> d_dweights(d_weights);
      DeviceBuffer<T> d_dx(ops_testing::ToStorage<T>(dx0));
      DeviceBuffer<float> d_dw(dw0);
      DeviceBytes workspace(
          RouterBackwardWorkspaceBytes(dims, DTypeOf<T>::value));
      SHARDD_ASSERT_OK(RouterBackward(
          dims, d_x.get(), d_w.get(), d_dweights.get(), saved.get(),
          saved.size(), d_dx.get(), accumulate_dx, d_dw.get(), workspace.get(),
          workspace.size(), gpu.handle(), gpu.stream()));
      gpu.Sync();
      EXPECT_EQ(d_indices.Download(), indices);
      ops_testing::ExpectAllClose(d_weights_out.Download(), weights, kProb, 0.0,
                                  "weights");
      constexpr double kGrad = Tolerance<T>::kGrad;
      ops_testing::ExpectAllClose(ops_testing::ToFloat(d_dx.Download()), dx,
                                  kGrad, kGrad, "dx");
      ops_testing::ExpectAllClose(d_dw.Download(), dw, kGrad, kGrad, "dw");
    }
  }
}

// A NaN logit row: the CPU picks experts 0..K-1 and clamps the denominator;
// the GPU must do the same, leaving the other rows alone.
TYPED_TEST(RouterGpuTest, NanRowPicksTheFirstExperts) {
  using T = TypeParam;
  SHARDD_SKIP_WITHOUT_GPU();
  ops_testing::GpuContext gpu;
  const RouterDims dims{3, 8, 16, 4};
  auto x = TernaryX(dims.tokens * dims.dim, 6);
  x[1 * dims.dim + 2] = std::nanf("");
  const auto w = QuantizedW(dims.experts * dims.dim, 7);
  kernels::RouterDims cpu_dims{dims.tokens, dims.dim, dims.experts, dims.top_k};
  kernels::RouterCache cache;
  std::vector<int32_t> indices(dims.tokens * dims.top_k);
  std::vector<float> weights(dims.tokens * dims.top_k);
  SHARDD_ASSERT_OK(kernels::RouterForward(
      cpu_dims, x.data(), w.data(), indices.data(), weights.data(), &cache));
  for (int k = 0; k < dims.top_k; ++k) {
    ASSERT_EQ(indices[dims.top_k + k], k);
  }

  DeviceBuffer<T> d_x(ops_testing::ToStorage<T>(x));
  DeviceBuffer<T> d_w(ops_testing::ToStorage<T>(w));
  DeviceBuffer<int32_t> d_indices(indices.size());
  DeviceBuffer<float> d_weights(weights.size());
  DeviceBytes saved(RouterSavedBytes(dims));
  SHARDD_ASSERT_OK(RouterForward(dims, d_x.get(), d_w.get(), d_indices.get(),
                                 d_weights.get(), saved.get(), saved.size(),
                                 gpu.handle(), gpu.stream()));
  gpu.Sync();
  EXPECT_EQ(d_indices.Download(), indices);
  ops_testing::ExpectAllClose(d_weights.Download(), weights, kProb, 0.0,
                              "weights");
}

}  // namespace
}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
