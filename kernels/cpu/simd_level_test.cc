#include "kernels/cpu/simd_level.h"

#include "common/status_matchers.h"
#include "gtest/gtest.h"

namespace shardd {
namespace kernels {
namespace {

using ::testing::HasSubstr;

constexpr SimdLevel kAll[] = {SimdLevel::kBaseline, SimdLevel::kX86_64_V3,
                              SimdLevel::kX86_64_V4};

TEST(SimdLevelTest, NamesRoundTrip) {
  for (SimdLevel level : kAll) {
    SHARDD_ASSERT_OK_AND_ASSIGN(SimdLevel parsed,
                                ParseSimdLevel(SimdLevelName(level)));
    EXPECT_EQ(parsed, level);
  }
  EXPECT_THAT(ParseSimdLevel("avx2"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("x86-64, x86-64-v3, x86-64-v4")));
  EXPECT_THAT(ParseSimdLevel(""), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(SimdLevelTest, SupportedLevelFollowsTheCpu) {
  const SimdLevel supported = SupportedSimdLevel();
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
  __builtin_cpu_init();
  EXPECT_EQ(supported == SimdLevel::kX86_64_V4,
            __builtin_cpu_supports("x86-64-v4") != 0);
  EXPECT_EQ(supported >= SimdLevel::kX86_64_V3,
            __builtin_cpu_supports("x86-64-v3") != 0);
#else
  EXPECT_EQ(supported, SimdLevel::kBaseline);
#endif
}

TEST(SimdLevelTest, EnvironmentValues) {
  SHARDD_ASSERT_OK_AND_ASSIGN(SimdLevel unset, ResolveSimdLevel(nullptr));
  EXPECT_EQ(unset, SupportedSimdLevel());
  SHARDD_ASSERT_OK_AND_ASSIGN(SimdLevel empty, ResolveSimdLevel(""));
  EXPECT_EQ(empty, SupportedSimdLevel());
  SHARDD_ASSERT_OK_AND_ASSIGN(SimdLevel base, ResolveSimdLevel("x86-64"));
  EXPECT_EQ(base, SimdLevel::kBaseline);
  EXPECT_THAT(ResolveSimdLevel("sse2"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("SHARDD_CPU_ISA")));
  for (SimdLevel level : kAll) {
    absl::StatusOr<SimdLevel> got = ResolveSimdLevel(SimdLevelName(level));
    if (level <= SupportedSimdLevel()) {
      SHARDD_ASSERT_OK(got.status());
      EXPECT_EQ(*got, level);
    } else {
      EXPECT_THAT(got, StatusIs(absl::StatusCode::kFailedPrecondition,
                                HasSubstr("SHARDD_CPU_ISA=")));
    }
  }
}

TEST(SimdLevelTest, OverrideWithinWhatTheCpuRuns) {
  for (SimdLevel level : kAll) {
    const absl::Status status = OverrideSimdLevel(level);
    if (level <= SupportedSimdLevel()) {
      SHARDD_ASSERT_OK(status);
      SHARDD_ASSERT_OK_AND_ASSIGN(SimdLevel active, ActiveSimdLevel());
      EXPECT_EQ(active, level);
    } else {
      EXPECT_THAT(status, StatusIs(absl::StatusCode::kFailedPrecondition));
    }
  }
}

}  // namespace
}  // namespace kernels
}  // namespace shardd
