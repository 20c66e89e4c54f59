#include "kernels/cuda/rms_norm.h"

#include <cstdint>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/cpu/rms_norm.h"
#include "kernels/cuda/ops_test_util.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

using ops_testing::DeviceBuffer;
using ops_testing::DeviceBytes;

// Tolerances against the CPU reference (rtol, and atol as a fraction of the
// tensor's largest magnitude). fp32: summation order only (the CPU sums in
// double). bf16: outputs stored in bf16 (relative step 2^-8), inputs exact.
template <typename T>
struct Tolerance;
template <>
struct Tolerance<float> {
  static constexpr double kStored = 1e-5;
};
template <>
struct Tolerance<uint16_t> {
  static constexpr double kStored = 1e-2;
};
constexpr double kFp32 = 1e-5;  // fp32 outputs (inv_rms, dweight)

template <typename T>
class RmsNormGpuTest : public ::testing::Test {};
using StorageTypes = ::testing::Types<float, uint16_t>;
TYPED_TEST_SUITE(RmsNormGpuTest, StorageTypes);

TYPED_TEST(RmsNormGpuTest, MatchesCpu) {
  using T = TypeParam;
  SHARDD_SKIP_WITHOUT_GPU();
  ops_testing::GpuContext gpu;
  struct Shape {
    int64_t rows, dim;
  };
  // 300 rows: several dweight chunks; dim 3: tiny rows; 4099: many per
  // thread and a ragged tail.
  for (const Shape s : {Shape{300, 256}, Shape{7, 3}, Shape{65, 4099}}) {
    for (const bool accumulate_dx : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "rows " << s.rows << " dim " << s.dim
                                        << " accumulate " << accumulate_dx);
      const int64_t n = s.rows * s.dim;
      const float eps = 1e-6f;
      const auto x = ops_testing::RoundedToBf16(
          ops_testing::RandomVector(n, -2.0f, 2.0f, 1));
      const auto w = ops_testing::RoundedToBf16(
          ops_testing::RandomVector(s.dim, 0.5f, 1.5f, 2));
      const auto dy = ops_testing::RoundedToBf16(
          ops_testing::RandomVector(n, -1.0f, 1.0f, 3));
      const auto dx0 = ops_testing::RoundedToBf16(
          ops_testing::RandomVector(n, -1.0f, 1.0f, 4));
      const auto dw0 = ops_testing::RandomVector(s.dim, -1.0f, 1.0f, 5);

      std::vector<float> y(n), inv(s.rows), dx = dx0, dw = dw0;
      SHARDD_ASSERT_OK(kernels::RmsNormForward(
          x.data(), w.data(), s.rows, s.dim, eps, y.data(), inv.data()));
      SHARDD_ASSERT_OK(kernels::RmsNormBackward(
          dy.data(), x.data(), w.data(), inv.data(), s.rows, s.dim, dx.data(),
          dw.data(), accumulate_dx));

      DeviceBuffer<T> d_x(ops_testing::ToStorage<T>(x));
      DeviceBuffer<T> d_w(ops_testing::ToStorage<T>(w));
      DeviceBuffer<T> d_y(n);
      DeviceBuffer<float> d_inv(s.rows);
      SHARDD_ASSERT_OK(RmsNormForward(d_x.get(), d_w.get(), s.rows, s.dim, eps,
                                      d_y.get(), d_inv.get(), gpu.stream()));
      DeviceBuffer<T> d_dy(ops_testing::ToStorage<T>(dy));
      DeviceBuffer<T> d_dx(ops_testing::ToStorage<T>(dx0));
      DeviceBuffer<float> d_dw(dw0);
      DeviceBytes workspace(RmsNormBackwardWorkspaceBytes(s.rows, s.dim));
      // The CPU's inv_rms feeds the GPU backward, so the backward is
      // compared on identical inputs.
      DeviceBuffer<float> d_cpu_inv(inv);
      SHARDD_ASSERT_OK(
          RmsNormBackward(d_dy.get(), d_x.get(), d_w.get(), d_cpu_inv.get(),
                          s.rows, s.dim, d_dx.get(), accumulate_dx, d_dw.get(),
                          workspace.get(), workspace.size(), gpu.stream()));
      gpu.Sync();
      constexpr double kStored = Tolerance<T>::kStored;
      ops_testing::ExpectAllClose(ops_testing::ToFloat(d_y.Download()), y,
                                  kStored, kStored, "y");
      ops_testing::ExpectAllClose(d_inv.Download(), inv, kFp32, 0.0, "inv_rms");
      ops_testing::ExpectAllClose(ops_testing::ToFloat(d_dx.Download()), dx,
                                  kStored, kStored, "dx");
      ops_testing::ExpectAllClose(d_dw.Download(), dw, kFp32, kFp32, "dweight");
    }
  }
}

TYPED_TEST(RmsNormGpuTest, NullDweightSkipsTheReduction) {
  using T = TypeParam;
  SHARDD_SKIP_WITHOUT_GPU();
  ops_testing::GpuContext gpu;
  const int64_t rows = 4, dim = 8;
  DeviceBuffer<T> d_x(ops_testing::ToStorage<T>(
      ops_testing::RandomVector(rows * dim, -1.0f, 1.0f, 1)));
  DeviceBuffer<T> d_w(ops_testing::ToStorage<T>(std::vector<float>(dim, 1.0f)));
  DeviceBuffer<T> d_y(rows * dim), d_dx(rows * dim);
  DeviceBuffer<float> d_inv(rows);
  SHARDD_ASSERT_OK(RmsNormForward(d_x.get(), d_w.get(), rows, dim, 1e-6f,
                                  d_y.get(), d_inv.get(), gpu.stream()));
  SHARDD_ASSERT_OK(RmsNormBackward(d_y.get(), d_x.get(), d_w.get(), d_inv.get(),
                                   rows, dim, d_dx.get(), false,
                                   /*dweight=*/nullptr, nullptr, 0,
                                   gpu.stream()));
  gpu.Sync();
}

}  // namespace
}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
