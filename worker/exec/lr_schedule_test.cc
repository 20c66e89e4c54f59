#include "worker/exec/lr_schedule.h"

#include <cmath>

#include "common/status_matchers.h"
#include "gtest/gtest.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;

TEST(LrScheduleTest, WarmupThenCosineToTheFloorThenHeld) {
  const double lr = 1.0;
  LrSchedule s;
  s.kind = LrSchedule::Kind::kCosine;
  s.warmup_steps = 4;
  s.decay_steps = 14;
  s.min_lr = 0.1;
  // Warmup: (i + 1) / 4 of the peak.
  EXPECT_DOUBLE_EQ(s.At(lr, 0), 0.25);
  EXPECT_DOUBLE_EQ(s.At(lr, 3), 1.0);
  // The decay starts at the peak, halves its span at the midpoint and ends
  // on the floor, where it stays.
  EXPECT_DOUBLE_EQ(s.At(lr, 4), 1.0);
  EXPECT_NEAR(s.At(lr, 9), 0.55, 1e-15);
  EXPECT_NEAR(s.At(lr, 14), 0.1, 1e-15);
  EXPECT_NEAR(s.At(lr, 1000), 0.1, 1e-15);
  for (int64_t i = 4; i < 14; ++i) EXPECT_GT(s.At(lr, i), s.At(lr, i + 1)) << i;
}

TEST(LrScheduleTest, LinearAndConstant) {
  const double lr = 2.0;
  LrSchedule s;
  s.kind = LrSchedule::Kind::kLinear;
  s.decay_steps = 10;
  s.min_lr = 0.0;
  EXPECT_DOUBLE_EQ(s.At(lr, 0), 2.0);
  EXPECT_DOUBLE_EQ(s.At(lr, 5), 1.0);
  EXPECT_DOUBLE_EQ(s.At(lr, 10), 0.0);
  EXPECT_DOUBLE_EQ(s.At(lr, 11), 0.0);
  s.kind = LrSchedule::Kind::kConstant;
  EXPECT_DOUBLE_EQ(s.At(lr, 7), 2.0);
  s.warmup_steps = 2;
  EXPECT_DOUBLE_EQ(s.At(lr, 0), 1.0);
  EXPECT_DOUBLE_EQ(s.At(lr, 1), 2.0);
  EXPECT_DOUBLE_EQ(s.At(lr, 100), 2.0);
}

TEST(LrScheduleTest, NamesAndChecks) {
  LrSchedule::Kind kind;
  SHARDD_ASSERT_OK(ParseLrScheduleKind("", &kind));
  EXPECT_EQ(kind, LrSchedule::Kind::kConstant);
  SHARDD_ASSERT_OK(ParseLrScheduleKind("cosine", &kind));
  EXPECT_STREQ(LrScheduleKindName(kind), "cosine");
  EXPECT_THAT(ParseLrScheduleKind("step", &kind),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("train.lr_schedule: must be constant, "
                                 "cosine or linear")));
  LrSchedule s;
  s.kind = LrSchedule::Kind::kLinear;
  s.warmup_steps = 5;
  s.decay_steps = 3;
  EXPECT_THAT(ValidateLrSchedule(s, 1.0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("train.decay_steps")));
  s.decay_steps = 5;
  SHARDD_EXPECT_OK(ValidateLrSchedule(s, 1.0));
  s.min_lr = 2.0;
  EXPECT_THAT(
      ValidateLrSchedule(s, 1.0),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("train.min_lr")));
  s.min_lr = 0;
  s.warmup_steps = -1;
  EXPECT_THAT(ValidateLrSchedule(s, 1.0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("train.warmup_steps")));
  s.warmup_steps = 0;
  EXPECT_THAT(
      ValidateLrSchedule(s, std::nan("")),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("train.lr")));
}

}  // namespace
}  // namespace shardd
