#include "kernels/cuda/bf16_cast.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cuda/ops_test_util.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

using ops_testing::DeviceBuffer;

float FromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Inputs that exercise every rounding case: ties to even (both ways), NaNs
// whose payload sits only in the dropped bits, signed zeros, infinities,
// denormals, values that round up to Inf, and random values.
std::vector<float> CastInputs(size_t n) {
  std::vector<float> v = {0.0f,
                          -0.0f,
                          1.0f,
                          FromBits(0x3F808000u),  // tie, rounds down (even)
                          FromBits(0x3F818000u),  // tie, rounds up (even)
                          FromBits(0x3F808001u),  // above tie
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          FromBits(0x7F800001u),  // NaN, payload in low bits
                          FromBits(0xFF800001u),  // negative NaN
                          FromBits(0x7FC00000u),  // quiet NaN
                          FromBits(0x00000001u),  // smallest denormal
                          FromBits(0x807FFFFFu),  // largest negative denormal
                          std::numeric_limits<float>::max(),  // rounds to Inf
                          FromBits(0x7F7F7FFFu)};             // stays finite
  const std::vector<float> random =
      ops_testing::RandomVector(n, -1e4f, 1e4f, 7);
  for (size_t i = v.size(); i < n; ++i) v.push_back(random[i]);
  v.resize(n);
  return v;
}

// Sizes that cover the vector body, a tail, and tails only.
class Bf16CastGpuTest : public ::testing::TestWithParam<int64_t> {};

TEST_P(Bf16CastGpuTest, Fp32ToBf16MatchesCpuBitForBit) {
  SHARDD_SKIP_WITHOUT_GPU();
  const int64_t n = GetParam();
  const std::vector<float> in = CastInputs(n);
  std::vector<uint16_t> expected(n);
  Fp32ToBf16Array(in.data(), expected.data(), n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(expected[i], Fp32ToBf16(in[i]));

  ops_testing::GpuContext gpu;
  // Offset 1 misaligns both pointers: the scalar path.
  for (int offset = 0; offset < 2; ++offset) {
    std::vector<float> padded(n + 1, 0.0f);
    std::copy(in.begin(), in.end(), padded.begin() + offset);
    DeviceBuffer<float> d_in(padded);
    DeviceBuffer<uint16_t> d_out(n + 1);
    SHARDD_ASSERT_OK(CastFp32ToBf16(d_in.get() + offset, d_out.get() + offset,
                                    n, gpu.stream()));
    gpu.Sync();
    const std::vector<uint16_t> out = d_out.Download();
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(out[i + offset], expected[i])
          << "element " << i << " offset " << offset << " input " << in[i];
    }
  }
}

TEST_P(Bf16CastGpuTest, Bf16ToFp32IsExact) {
  SHARDD_SKIP_WITHOUT_GPU();
  const int64_t n = GetParam();
  std::vector<uint16_t> in(n);
  for (int64_t i = 0; i < n; ++i) {
    in[i] = static_cast<uint16_t>((i * 2654435761u) >> 7);
  }
  ops_testing::GpuContext gpu;
  for (int offset = 0; offset < 2; ++offset) {
    std::vector<uint16_t> padded(n + 1, 0);
    std::copy(in.begin(), in.end(), padded.begin() + offset);
    DeviceBuffer<uint16_t> d_in(padded);
    DeviceBuffer<float> d_out(n + 1);
    SHARDD_ASSERT_OK(CastBf16ToFp32(d_in.get() + offset, d_out.get() + offset,
                                    n, gpu.stream()));
    gpu.Sync();
    const std::vector<float> out = d_out.Download();
    for (int64_t i = 0; i < n; ++i) {
      const float expected = Bf16ToFp32(in[i]);
      ASSERT_EQ(std::memcmp(&out[i + offset], &expected, 4), 0)
          << "element " << i << " offset " << offset;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, Bf16CastGpuTest,
                         ::testing::Values(1, 7, 8, 15, 16, 17, 1000, 4099,
                                           1 << 20));

}  // namespace
}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
