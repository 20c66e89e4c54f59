#include "kernels/cuda/adamw.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cuda/ops_test_util.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

using ops_testing::DeviceBuffer;
using ops_testing::DeviceBytes;

// The update is the CPU expression with one rounding per operation, so it
// is expected to be bit-identical; 1e-6 relative leaves room only for a CPU
// build that contracts FMAs.
constexpr double kAdamW = 1e-6;

// Three steps, with and without a device gradient scale, over a size that
// has a vector body and a tail; the offset-1 views take the scalar path.
TEST(AdamWGpuTest, MatchesCpu) {
  SHARDD_SKIP_WITHOUT_GPU();
  ops_testing::GpuContext gpu;
  const int64_t n = 10007;
  AdamWConfig config;
  config.lr = 3e-3;
  config.weight_decay = 0.1;
  for (const bool scaled : {false, true}) {
    for (const int offset : {0, 1}) {
      SCOPED_TRACE(::testing::Message()
                   << "scaled " << scaled << " offset " << offset);
      std::vector<float> param = ops_testing::RandomVector(n, -1.0f, 1.0f, 1);
      std::vector<float> m(n, 0.0f), v(n, 0.0f);
      const float scale = scaled ? 0.37f : 1.0f;
      auto padded = [&](const std::vector<float>& x) {
        std::vector<float> p(n + 1, 0.0f);
        std::copy(x.begin(), x.end(), p.begin() + offset);
        return p;
      };
      DeviceBuffer<float> d_param(padded(param)), d_m(padded(m)),
          d_v(padded(v)), d_grad(n + 1);
      DeviceBuffer<float> d_scale(std::vector<float>{scale});
      DeviceBuffer<uint16_t> d_bf16(n + 1);
      for (int64_t step = 1; step <= 3; ++step) {
        std::vector<float> grad =
            ops_testing::RandomVector(n, -2.0f, 2.0f, 10 + step);
        d_grad.Upload(padded(grad));
        kernels::ScaleInPlace(grad.data(), n, scale);
        SHARDD_ASSERT_OK(kernels::AdamWStep(param.data(), grad.data(), m.data(),
                                            v.data(), n, step, config));
        SHARDD_ASSERT_OK(AdamWStep(d_param.get() + offset,
                                   d_grad.get() + offset, d_m.get() + offset,
                                   d_v.get() + offset, n, step, config,
                                   scaled ? d_scale.get() : nullptr,
                                   d_bf16.get() + offset, gpu.stream()));
      }
      gpu.Sync();
      auto unpad = [&](std::vector<float> x) {
        return std::vector<float>(x.begin() + offset, x.begin() + offset + n);
      };
      const std::vector<float> got = unpad(d_param.Download());
      ops_testing::ExpectAllClose(got, param, kAdamW, 0.0, "param");
      ops_testing::ExpectAllClose(unpad(d_m.Download()), m, kAdamW, 0.0,
                                  "exp_avg");
      ops_testing::ExpectAllClose(unpad(d_v.Download()), v, kAdamW, 0.0,
                                  "exp_avg_sq");
      const std::vector<uint16_t> bf16 = d_bf16.Download();
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(bf16[i + offset], Fp32ToBf16(got[i])) << "element " << i;
      }
    }
  }
}

TEST(AdamWGpuTest, ClippingPiecesMatchCpu) {
  SHARDD_SKIP_WITHOUT_GPU();
  ops_testing::GpuContext gpu;
  for (const int64_t n : {1, 2047, 2048, 100003, 5000000}) {
    SCOPED_TRACE(::testing::Message() << "n " << n);
    const std::vector<float> x = ops_testing::RandomVector(n, -3.0f, 3.0f, 5);
    const double expected = kernels::SumOfSquares(x.data(), n);
    DeviceBuffer<float> d_x(x);
    DeviceBuffer<double> d_sum(std::vector<double>{1.5});
    DeviceBytes ws(SumOfSquaresWorkspaceBytes(n));
    SHARDD_ASSERT_OK(SumOfSquares(d_x.get(), n, d_sum.get(), false, ws.get(),
                                  ws.size(), gpu.stream()));
    gpu.Sync();
    const double sum = d_sum.Download()[0];
    // Every square of a float is exact in double and every term is
    // positive, so each side's sum is within (additions) * u * sum of the
    // exact one (recursive summation, u = 2^-53): n - 1 additions on the
    // CPU, at most n - 1 on the GPU (per-thread runs, then two block trees
    // whose depths add under 64). Their difference is bounded by the two
    // together; a lost or doubled block would be off by ~n^-1 or more.
    const double u = std::ldexp(1.0, -53);
    const double bound = (2.0 * n + 64.0) * u * expected;
    EXPECT_NEAR(sum, expected, bound);
    // Accumulating adds a second buffer's sum (one more addition).
    SHARDD_ASSERT_OK(SumOfSquares(d_x.get(), n, d_sum.get(), true, ws.get(),
                                  ws.size(), gpu.stream()));
    EXPECT_NEAR(d_sum.Download()[0], 2 * expected, 2.0 * bound + u * expected);
  }

  // The coefficient from the CPU's exact sum equals the CPU's, cast to fp32.
  for (const double sum_sq : {0.0, 0.25, 4.0, 1e6, HUGE_VAL, std::nan("")}) {
    for (const double max_norm : {0.0, 1.0, 5.0}) {
      SCOPED_TRACE(::testing::Message()
                   << "sum_sq " << sum_sq << " max_norm " << max_norm);
      DeviceBuffer<double> d_sum(std::vector<double>{sum_sq});
      DeviceBuffer<float> d_coef(1);
      DeviceBuffer<double> d_norm(1);
      SHARDD_ASSERT_OK(ClipCoefficientFromSumOfSquares(
          d_sum.get(), max_norm, d_coef.get(), d_norm.get(), gpu.stream()));
      gpu.Sync();
      const double norm = std::sqrt(sum_sq);
      const float expected =
          static_cast<float>(kernels::ClipCoefficient(norm, max_norm));
      const float got = d_coef.Download()[0];
      if (std::isnan(expected)) {
        EXPECT_TRUE(std::isnan(got));
      } else {
        EXPECT_EQ(got, expected);
      }
      const double got_norm = d_norm.Download()[0];
      if (std::isnan(norm)) {
        EXPECT_TRUE(std::isnan(got_norm));
      } else {
        EXPECT_EQ(got_norm, norm);
      }
    }
  }

  // ScaleInPlace by a device coefficient equals the CPU's in-place scale.
  std::vector<float> x = ops_testing::RandomVector(777, -1.0f, 1.0f, 8);
  DeviceBuffer<float> d_x(x);
  DeviceBuffer<float> d_scale(std::vector<float>{0.123f});
  SHARDD_ASSERT_OK(
      ScaleInPlace(d_x.get(), x.size(), d_scale.get(), gpu.stream()));
  kernels::ScaleInPlace(x.data(), x.size(), 0.123f);
  gpu.Sync();
  EXPECT_EQ(d_x.Download(), x);
}

}  // namespace
}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
