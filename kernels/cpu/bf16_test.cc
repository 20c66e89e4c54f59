#include "kernels/cpu/bf16.h"

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace shardd {
namespace kernels {
namespace {

float FromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

TEST(Bf16Test, ExactValues) {
  EXPECT_EQ(Fp32ToBf16(1.0f), 0x3F80);
  EXPECT_EQ(Fp32ToBf16(-1.0f), 0xBF80);
  EXPECT_EQ(Fp32ToBf16(0.0f), 0x0000);
  EXPECT_EQ(Fp32ToBf16(-0.0f), 0x8000);
  EXPECT_EQ(Fp32ToBf16(2.0f), 0x4000);
  EXPECT_EQ(Fp32ToBf16(0.5f), 0x3F00);
  // 3.140625 = 1.5703125 * 2, mantissa 73/128 -> 0x49.
  EXPECT_EQ(Fp32ToBf16(3.140625f), 0x4049);
  EXPECT_EQ(Bf16ToFp32(0x4049), 3.140625f);
  EXPECT_EQ(Bf16ToFp32(0x3F80), 1.0f);
  EXPECT_EQ(Bf16ToFp32(0xC000), -2.0f);
}

TEST(Bf16Test, TiesRoundToEven) {
  // bf16 has 7 explicit mantissa bits: the spacing near 1 is 2^-7.
  const float ulp = std::ldexp(1.0f, -7);
  // 1 + ulp/2 lies halfway between 1 (even mantissa) and 1 + ulp (odd).
  EXPECT_EQ(RoundToBf16(1.0f + ulp / 2), 1.0f);
  // 1 + 1.5 ulp lies between 1 + ulp (odd) and 1 + 2 ulp (even).
  EXPECT_EQ(RoundToBf16(1.0f + 1.5f * ulp), 1.0f + 2 * ulp);
  // Just off the tie rounds to the nearer neighbour.
  EXPECT_EQ(RoundToBf16(std::nextafter(1.0f + ulp / 2, 2.0f)), 1.0f + ulp);
  EXPECT_EQ(RoundToBf16(std::nextafter(1.0f + ulp / 2, 0.0f)), 1.0f);
  // Negative ties mirror positive ones.
  EXPECT_EQ(RoundToBf16(-(1.0f + ulp / 2)), -1.0f);
  EXPECT_EQ(RoundToBf16(-(1.0f + 1.5f * ulp)), -(1.0f + 2 * ulp));
  // Bit-level ties.
  EXPECT_EQ(Fp32ToBf16(FromBits(0x3F808000u)), 0x3F80);
  EXPECT_EQ(Fp32ToBf16(FromBits(0x3F818000u)), 0x3F82);
  // Subnormal ties.
  EXPECT_EQ(Fp32ToBf16(FromBits(0x00008000u)), 0x0000);
  EXPECT_EQ(Fp32ToBf16(FromBits(0x00018000u)), 0x0002);
  EXPECT_EQ(Fp32ToBf16(FromBits(0x00000001u)), 0x0000);
}

TEST(Bf16Test, RangeEdges) {
  // Largest finite bf16: (2 - 2^-7) * 2^127, bits 0x7F7F.
  const float bf16_max = std::ldexp(2.0f - std::ldexp(1.0f, -7), 127);
  EXPECT_EQ(Fp32ToBf16(bf16_max), 0x7F7F);
  EXPECT_EQ(Bf16ToFp32(0x7F7F), bf16_max);
  EXPECT_EQ(Fp32ToBf16(-bf16_max), 0xFF7F);
  // FLT_MAX is above the halfway point to 2^128, so it rounds to Inf.
  EXPECT_EQ(Fp32ToBf16(FLT_MAX), 0x7F80);
  // Exactly halfway between bf16_max (odd mantissa) and 2^128: ties to
  // even, which is the overflow to Inf; one float below stays finite.
  const float halfway = std::ldexp(2.0f - std::ldexp(1.0f, -8), 127);
  EXPECT_EQ(Fp32ToBf16(halfway), 0x7F80);
  EXPECT_EQ(Fp32ToBf16(std::nextafter(halfway, 0.0f)), 0x7F7F);
  // Smallest normal float is exactly representable.
  EXPECT_EQ(Bf16ToFp32(Fp32ToBf16(FLT_MIN)), FLT_MIN);
}

TEST(Bf16Test, InfAndNan) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(Fp32ToBf16(inf), 0x7F80);
  EXPECT_EQ(Fp32ToBf16(-inf), 0xFF80);
  EXPECT_EQ(Bf16ToFp32(0x7F80), inf);
  EXPECT_EQ(Bf16ToFp32(0xFF80), -inf);

  EXPECT_TRUE(std::isnan(RoundToBf16(std::numeric_limits<float>::quiet_NaN())));
  // A NaN whose payload sits only in the low 16 bits must not become Inf.
  const float low_payload_nan = FromBits(0x7F800001u);
  ASSERT_TRUE(std::isnan(low_payload_nan));
  EXPECT_TRUE(std::isnan(Bf16ToFp32(Fp32ToBf16(low_payload_nan))));
  // A NaN near the carry boundary must not wrap into the sign or to zero.
  EXPECT_TRUE(std::isnan(Bf16ToFp32(Fp32ToBf16(FromBits(0x7FFFFFFFu)))));
  const uint16_t neg_nan = Fp32ToBf16(FromBits(0xFF800001u));
  EXPECT_TRUE(std::isnan(Bf16ToFp32(neg_nan)));
  EXPECT_EQ(neg_nan & 0x8000, 0x8000);  // sign kept
}

TEST(Bf16Test, EveryBf16RoundTrips) {
  for (uint32_t b = 0; b <= 0xFFFF; ++b) {
    const uint16_t bits = static_cast<uint16_t>(b);
    const float f = Bf16ToFp32(bits);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(Bf16ToFp32(Fp32ToBf16(f)))) << b;
    } else {
      ASSERT_EQ(Fp32ToBf16(f), bits) << b;
    }
  }
}

// Independent reference: pick the nearer of the two bf16 neighbours in
// double precision, ties to the even mantissa.
uint16_t ReferenceRound(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint16_t lo = static_cast<uint16_t>(bits >> 16);  // toward zero
  const uint16_t hi = static_cast<uint16_t>(lo + 1);      // away from zero
  const double dx = std::fabs(static_cast<double>(x));
  const double dlo = std::fabs(static_cast<double>(Bf16ToFp32(lo)));
  const double dhi = std::fabs(static_cast<double>(Bf16ToFp32(hi)));
  if (dx - dlo < dhi - dx) return lo;
  if (dx - dlo > dhi - dx) return hi;
  return (lo & 1) ? hi : lo;
}

TEST(Bf16Test, RandomValuesMatchReferenceAndArrays) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> dist;
  std::vector<float> in;
  while (in.size() < 20000) {
    const float f = FromBits(dist(rng));
    // Finite values that cannot overflow (the reference's hi neighbour of
    // the largest finite would be Inf; covered by RangeEdges).
    if (std::isfinite(f) && std::fabs(f) < 1e38f) in.push_back(f);
  }
  std::vector<uint16_t> out(in.size());
  Fp32ToBf16Array(in.data(), out.data(), static_cast<int64_t>(in.size()));
  std::vector<float> back(in.size());
  Bf16ToFp32Array(out.data(), back.data(), static_cast<int64_t>(in.size()));
  std::vector<float> inplace = in;
  RoundToBf16InPlace(inplace.data(), static_cast<int64_t>(inplace.size()));
  for (size_t i = 0; i < in.size(); ++i) {
    ASSERT_EQ(out[i], ReferenceRound(in[i])) << in[i];
    ASSERT_EQ(back[i], inplace[i]);
    // Relative error at most half a bf16 ulp (2^-8) for normal values.
    if (std::fabs(in[i]) >= FLT_MIN) {
      ASSERT_LE(std::fabs(back[i] - in[i]), std::ldexp(std::fabs(in[i]), -8));
    }
  }
}

}  // namespace
}  // namespace kernels
}  // namespace shardd

namespace shardd {
namespace kernels {
namespace {

// The vectorised array conversion is a branch-free rewrite of Fp32ToBf16; it
// must agree with it on every kind of input, NaNs and infinities included.
TEST(Bf16ArrayTest, ArrayConversionEqualsTheScalarOne) {
  std::vector<float> in;
  uint64_t state = 0x9E3779B97F4A7C15ULL;
  for (int i = 0; i < (1 << 20); ++i) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    const uint32_t bits = static_cast<uint32_t>(state >> 32);
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    in.push_back(f);
  }
  for (uint32_t bits :
       {0x7F800000u, 0xFF800000u, 0x7FC00000u, 0x7F800001u, 0xFFFFFFFFu,
        0x7F7FFFFFu, 0x00000001u, 0x3F808000u, 0x3F818000u}) {
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    in.push_back(f);
  }
  std::vector<uint16_t> out(in.size());
  Fp32ToBf16Array(in.data(), out.data(), static_cast<int64_t>(in.size()));
  for (size_t i = 0; i < in.size(); ++i) {
    ASSERT_EQ(out[i], Fp32ToBf16(in[i])) << i;
  }
}

}  // namespace
}  // namespace kernels
}  // namespace shardd
