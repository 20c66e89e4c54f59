#include "kernels/cuda/dense_mlp.h"

#include <cstdint>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/cpu/dense_mlp.h"
#include "kernels/cuda/ops_test_util.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

using ops_testing::DeviceBuffer;
using ops_testing::DeviceBytes;

// fp32: summation order and 1-2 ulp of expf/tanhf. bf16: G, U, A and the
// intermediate gradients are stored in bf16 (2^-8 relative each, compounding
// through two GEMMs), which the fp32 CPU reference does not round.
template <typename T>
struct Tolerance;
template <>
struct Tolerance<float> {
  static constexpr double kValue = 1e-5;
};
template <>
struct Tolerance<uint16_t> {
  static constexpr double kValue = 3e-2;
};

template <typename T>
class DenseMlpGpuTest : public ::testing::Test {};
using StorageTypes = ::testing::Types<float, uint16_t>;
TYPED_TEST_SUITE(DenseMlpGpuTest, StorageTypes);

TYPED_TEST(DenseMlpGpuTest, MatchesCpu) {
  using T = TypeParam;
  SHARDD_SKIP_WITHOUT_GPU();
  ops_testing::GpuContext gpu;
  const DenseMlpDims dims{70, 48, 96};
  const int64_t t = dims.tokens, d = dims.dim, in = dims.intermediate;
  for (const GatedActivation activation :
       {GatedActivation::kSwiGLU, GatedActivation::kGeGLU}) {
    for (const bool accumulate : {false, true}) {
      SCOPED_TRACE(::testing::Message()
                   << "activation " << static_cast<int>(activation)
                   << " accumulate " << accumulate);
      const auto x = ops_testing::RoundedToBf16(
          ops_testing::RandomVector(t * d, -1.0f, 1.0f, 1));
      const auto gate = ops_testing::RoundedToBf16(
          ops_testing::RandomVector(in * d, -0.3f, 0.3f, 2));
      const auto up = ops_testing::RoundedToBf16(
          ops_testing::RandomVector(in * d, -0.3f, 0.3f, 3));
      const auto down = ops_testing::RoundedToBf16(
          ops_testing::RandomVector(d * in, -0.3f, 0.3f, 4));
      const auto dy = ops_testing::RoundedToBf16(
          ops_testing::RandomVector(t * d, -1.0f, 1.0f, 5));
      const auto y0 = ops_testing::RoundedToBf16(
          ops_testing::RandomVector(t * d, -1.0f, 1.0f, 6));
      const auto dx0 = ops_testing::RoundedToBf16(
          ops_testing::RandomVector(t * d, -1.0f, 1.0f, 7));
      const auto dgate0 = ops_testing::RandomVector(in * d, -1.0f, 1.0f, 8);
      const auto dup0 = ops_testing::RandomVector(in * d, -1.0f, 1.0f, 9);
      const auto ddown0 = ops_testing::RandomVector(d * in, -1.0f, 1.0f, 10);

      kernels::DenseMlpDims cpu_dims{t, d, in};
      kernels::DenseMlpWorkspace cpu_ws;
      std::vector<float> y = y0, dx = dx0, dgate = dgate0, dup = dup0,
                         ddown = ddown0;
      SHARDD_ASSERT_OK(kernels::DenseMlpForward(
          cpu_dims, activation, x.data(), gate.data(), up.data(), down.data(),
          y.data(), &cpu_ws, accumulate));
      SHARDD_ASSERT_OK(kernels::DenseMlpBackward(
          cpu_dims, activation, gate.data(), up.data(), down.data(), dy.data(),
          dx.data(), accumulate, dgate.data(), dup.data(), ddown.data(),
          &cpu_ws));

      constexpr DType kType = DTypeOf<T>::value;
      DeviceBuffer<T> d_x(ops_testing::ToStorage<T>(x));
      DeviceBuffer<T> d_gate(ops_testing::ToStorage<T>(gate));
      DeviceBuffer<T> d_up(ops_testing::ToStorage<T>(up));
      DeviceBuffer<T> d_down(ops_testing::ToStorage<T>(down));
      DeviceBuffer<T> d_y(ops_testing::ToStorage<T>(y0));
      DeviceBytes saved(DenseMlpSavedBytes(dims, kType));
      DeviceBytes forward_ws(DenseMlpForwardWorkspaceBytes(dims, kType));
      SHARDD_ASSERT_OK(DenseMlpForward(
          dims, activation, d_x.get(), d_gate.get(), d_up.get(), d_down.get(),
          d_y.get(), accumulate, saved.get(), saved.size(), forward_ws.get(),
          forward_ws.size(), gpu.handle(), gpu.stream()));
      DeviceBuffer<T> d_dy(ops_testing::ToStorage<T>(dy));
      DeviceBuffer<T> d_dx(ops_testing::ToStorage<T>(dx0));
      DeviceBuffer<float> d_dgate(dgate0), d_dup(dup0), d_ddown(ddown0);
      DeviceBytes backward_ws(DenseMlpBackwardWorkspaceBytes(dims, kType));
      SHARDD_ASSERT_OK(DenseMlpBackward(
          dims, activation, d_x.get(), d_gate.get(), d_up.get(), d_down.get(),
          d_dy.get(), saved.get(), saved.size(), d_dx.get(), accumulate,
          d_dgate.get(), d_dup.get(), d_ddown.get(), backward_ws.get(),
          backward_ws.size(), gpu.handle(), gpu.stream()));
      gpu.Sync();
      constexpr double kTol = Tolerance<T>::kValue;
      ops_testing::ExpectAllClose(ops_testing::ToFloat(d_y.Download()), y, kTol,
                                  kTol, "y");
      ops_testing::ExpectAllClose(ops_testing::ToFloat(d_dx.Download()), dx,
                                  kTol, kTol, "dx");
      ops_testing::ExpectAllClose(d_dgate.Download(), dgate, kTol, kTol,
                                  "d_gate_proj");
      ops_testing::ExpectAllClose(d_dup.Download(), dup, kTol, kTol,
                                  "d_up_proj");
      ops_testing::ExpectAllClose(d_ddown.Download(), ddown, kTol, kTol,
                                  "d_down_proj");
    }
  }
}

}  // namespace
}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
