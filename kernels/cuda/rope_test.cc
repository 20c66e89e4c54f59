// The CUDA RoPE against kernels/cpu/rope.h, bit for bit: both round each
// product and the sum once in fp32 (no contraction on either side). Skips
// without a GPU.

#include "kernels/cuda/rope.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/cpu/rope.h"
#include "kernels/cuda/ops_test_util.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

using ops_testing::DeviceBuffer;
using ops_testing::GpuContext;
using ops_testing::RandomVector;
using ops_testing::ToFloat;
using ops_testing::ToStorage;

template <typename T>
void CheckAgainstCpu(RopeLayout layout, bool inverse) {
  SCOPED_TRACE(::testing::Message()
               << (layout == RopeLayout::kHalf ? "half" : "interleaved")
               << (inverse ? " inverse" : "")
               << (sizeof(T) == 2 ? " bf16" : ""));
  GpuContext gpu;
  // MLA-like heads: 24 dims of which [8, 24) rotate; 3 heads; 37 tokens.
  const int64_t tokens = 37, heads = 3, head_dim = 24, offset = 8;
  std::vector<float> freq(8);
  for (int i = 0; i < 8; ++i) freq[i] = std::pow(10000.0f, -2.0f * i / 16);
  SHARDD_ASSERT_OK_AND_ASSIGN(RopeTable table, BuildRopeTable(freq, 100, 1.3f));
  std::vector<int32_t> pos(tokens);
  for (int64_t t = 0; t < tokens; ++t)
    pos[t] = static_cast<int32_t>((t * 7) % 100);
  const std::vector<T> x =
      ToStorage<T>(RandomVector(tokens * heads * head_dim, -2.0f, 2.0f, 5));
  RopeShape shape{tokens, heads, heads * head_dim, head_dim, offset};

  std::vector<float> want = ToFloat(x);
  SHARDD_ASSERT_OK(kernels::RopeRotate(table, layout, shape, pos.data(),
                                       want.data(), inverse));
  DeviceBuffer<float> d_cos(table.cos), d_sin(table.sin);
  DeviceBuffer<int32_t> d_pos(pos);
  DeviceBuffer<T> d_x(x);
  DeviceRopeTable device{d_cos.get(), d_sin.get(), table.rotary_dim,
                         table.positions};
  SHARDD_ASSERT_OK(RopeRotate(device, layout, shape, d_pos.get(), d_x.get(),
                              inverse, gpu.stream()));
  gpu.Sync();
  const std::vector<float> got = ToFloat(d_x.Download());
  const std::vector<float> expected = ToFloat(ToStorage<T>(want));
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i], expected[i]) << i;
  }
}

TEST(RopeGpuTest, EqualsTheCpuKernelBitForBit) {
  SHARDD_SKIP_WITHOUT_GPU();
  for (RopeLayout layout : {RopeLayout::kHalf, RopeLayout::kInterleaved}) {
    for (bool inverse : {false, true}) {
      CheckAgainstCpu<float>(layout, inverse);
      CheckAgainstCpu<uint16_t>(layout, inverse);
    }
  }
}

TEST(RopeGpuTest, RefusesBadTables) {
  DeviceRopeTable table;
  table.rotary_dim = 3;
  table.positions = 4;
  EXPECT_THAT(RopeRotate(table, RopeLayout::kHalf, RopeShape{1, 1, 4, 4, 0},
                         nullptr, static_cast<float*>(nullptr), false,
                         static_cast<cudaStream_t>(nullptr)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::HasSubstr("rotary_dim")));
}

}  // namespace
}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
