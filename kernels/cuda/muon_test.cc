// The device Muon against the CPU's (kernels/cpu/muon.h): the element-wise
// steps bit for bit (both run kernels/cpu/muon_element.h), Newton-Schulz
// within the bound derived for any fp32 implementation of the iteration
// (kernels/cpu/muon_reference.h) of the float64 result. Skips without a GPU
// (muon_args_test has the argument checks).

#include "kernels/cuda/muon.h"

#include <cstdint>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/muon.h"
#include "kernels/cpu/muon_reference.h"
#include "kernels/cuda/ops_test_util.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

using ops_testing::DeviceBuffer;

TEST(MuonGpuTest, ElementStepsAreTheCpusBits) {
  SHARDD_SKIP_WITHOUT_GPU();
  ops_testing::GpuContext gpu;
  const int64_t n = 100003;
  const auto g = ops_testing::RandomVector(n, -1.0f, 1.0f, 1);
  const auto m0 = ops_testing::RandomVector(n, -1.0f, 1.0f, 2);
  const auto p0 = ops_testing::RandomVector(n, -1.0f, 1.0f, 3);
  std::vector<float> m = m0, update(n), p = p0;
  kernels::MuonNesterovUpdate(g.data(), m0.data(), n, 0.95f, update.data());
  kernels::MuonMomentumStep(g.data(), m.data(), n, 0.95f);
  kernels::MuonApply(p.data(), update.data(), n, 0.02, 0.1);
  std::vector<float> scaled = update;
  kernels::ScaleInPlace(scaled.data(), n, 1.4142135f);

  DeviceBuffer<float> d_g(g), d_m(m0), d_u(n), d_p(p0);
  SHARDD_ASSERT_OK(MuonNesterovUpdate(d_g.get(), d_m.get(), n, 0.95f,
                                      d_u.get(), gpu.stream()));
  SHARDD_ASSERT_OK(MuonMomentumStep(d_g.get(), d_m.get(), n, 0.95f,
                                    gpu.stream()));
  SHARDD_ASSERT_OK(
      MuonApply(d_p.get(), d_u.get(), n, 0.02, 0.1, gpu.stream()));
  gpu.Sync();
  EXPECT_EQ(d_u.Download(), update);
  EXPECT_EQ(d_m.Download(), m);
  EXPECT_EQ(d_p.Download(), p);
  SHARDD_ASSERT_OK(MuonScale(d_u.get(), n, 1.4142135f, gpu.stream()));
  gpu.Sync();
  EXPECT_EQ(d_u.Download(), scaled);
}

TEST(MuonGpuTest, NewtonSchulzWithinTheDerivedBound) {
  SHARDD_SKIP_WITHOUT_GPU();
  ops_testing::GpuContext gpu;
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{32, 96},
                                   {96, 32},
                                   {64, 64},
                                   {7, 300},
                                   {257, 65}}) {
    SCOPED_TRACE(::testing::Message() << rows << " x " << cols);
    const std::vector<float> in = muon_testing::RandomMatrix(rows, cols, 11);
    const muon_testing::Reference ref =
        muon_testing::NewtonSchulz64(in, rows, cols, 5);
    DeviceBuffer<float> d_x(in);
    const size_t bytes = NewtonSchulzWorkspaceBytes(rows, cols);
    ops_testing::DeviceBytes ws(bytes);
    SHARDD_ASSERT_OK(NewtonSchulz(gpu.handle(), d_x.get(), rows, cols, 5,
                                  ws.get(), bytes, gpu.stream()));
    gpu.Sync();
    const std::vector<float> got = d_x.Download();
    EXPECT_LE(muon_testing::DiffFrobenius(got, ref.x), ref.bound);
    // And against the CPU kernel: both within the bound of the same
    // float64 result, so within twice it of each other.
    std::vector<float> cpu = in;
    std::vector<float> cpu_ws(kernels::NewtonSchulzWorkspace(rows, cols));
    SHARDD_ASSERT_OK(
        kernels::NewtonSchulz(cpu.data(), rows, cols, 5, cpu_ws.data()));
    std::vector<double> cpu64(cpu.begin(), cpu.end());
    EXPECT_LE(muon_testing::DiffFrobenius(got, cpu64), 2 * ref.bound);
  }
}

}  // namespace
}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
