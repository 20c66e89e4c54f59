#include "kernels/cuda_probe.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace shardd {
namespace {

TEST(CudaProbeTest, NcclLinks) { EXPECT_GT(NcclVersion(), 20000); }

TEST(CudaProbeTest, AxpyOnDevice) {
  std::string reason;
  if (CudaDeviceCount(&reason) == 0) {
    GTEST_SKIP() << "no GPU: " << reason;
  }
  std::vector<float> x(1000), y(1000);
  for (int i = 0; i < 1000; ++i) {
    x[i] = static_cast<float>(i);
    y[i] = 1.0f;
  }
  ASSERT_EQ(CudaAxpy(2.0f, x.data(), y.data(), 1000), "");
  for (int i = 0; i < 1000; ++i) EXPECT_FLOAT_EQ(y[i], 1.0f + 2.0f * i);
}

}  // namespace
}  // namespace shardd
