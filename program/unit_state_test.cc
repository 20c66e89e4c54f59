#include "program/unit_state.h"

#include "common/status_macros.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;

v1::Command Cmd(v1::Command::Op op, int group_size = 0, bool prefetch = false) {
  v1::Command c;
  c.set_op(op);
  c.set_unit(3);
  c.set_group_size(group_size);
  c.set_prefetch(prefetch);
  return c;
}

// Checks and applies, as the validator and the executor do.
absl::Status Step(UnitState* s, const v1::Command& c, bool trainable = true) {
  SHARDD_RETURN_IF_ERROR(CheckUnitCommand(*s, 3, c, trainable, 4));
  ApplyUnitCommand(c, s);
  return absl::OkStatus();
}

TEST(UnitStateTest, APostForwardSliceIsGatheredBackAndFreedAtTheWait) {
  UnitState s;
  SHARDD_ASSERT_OK(Step(&s, Cmd(v1::Command::UNSHARD)));
  SHARDD_ASSERT_OK(Step(&s, Cmd(v1::Command::RESHARD, /*group_size=*/2)));
  EXPECT_FALSE(s.gathered);
  EXPECT_EQ(s.slice_group, 2);
  // A slice is not a resharded unit: the update must wait.
  EXPECT_THAT(CheckUnitDoneForOptimizer(s, "unit 3"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("unit 3 is still gathered")));
  SHARDD_ASSERT_OK(Step(&s, Cmd(v1::Command::UNSHARD, 0, /*prefetch=*/true)));
  EXPECT_TRUE(s.gathered && s.pending);
  EXPECT_EQ(s.slice_group, 0);
  EXPECT_EQ(s.gather_slice_group, 2);
  EXPECT_THAT(Step(&s, Cmd(v1::Command::RESHARD)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("WAIT_UNSHARD it first")));
  SHARDD_ASSERT_OK(Step(&s, Cmd(v1::Command::WAIT_UNSHARD)));
  EXPECT_FALSE(s.pending);
  SHARDD_ASSERT_OK(Step(&s, Cmd(v1::Command::RESHARD)));
  SHARDD_EXPECT_OK(CheckUnitDoneForOptimizer(s, "unit 3"));
}

TEST(UnitStateTest, EachRuleNamesTheUnitAndWhatTheOpNeeds) {
  UnitState s;
  EXPECT_THAT(Step(&s, Cmd(v1::Command::RESHARD)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("unit 3 is not gathered")));
  EXPECT_THAT(Step(&s, Cmd(v1::Command::WAIT_UNSHARD)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("no pending prefetched UNSHARD")));
  EXPECT_THAT(Step(&s, Cmd(v1::Command::REDUCE_SCATTER)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("needs an allocated unsharded gradient")));
  EXPECT_THAT(Step(&s, Cmd(v1::Command::ALLOC_GRAD), /*trainable=*/false),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("without trainable parameters")));
  SHARDD_ASSERT_OK(Step(&s, Cmd(v1::Command::ALLOC_GRAD)));
  EXPECT_THAT(Step(&s, Cmd(v1::Command::ALLOC_GRAD)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("already allocated")));
  EXPECT_THAT(CheckUnitDoneForOptimizer(s, "unit 3"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("still holds an unsharded gradient")));
  SHARDD_ASSERT_OK(Step(&s, Cmd(v1::Command::UNSHARD)));
  EXPECT_THAT(Step(&s, Cmd(v1::Command::UNSHARD)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("already gathered")));
  EXPECT_THAT(
      Step(&s, Cmd(v1::Command::RESHARD, /*group_size=*/3)),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("group_size")));
}

}  // namespace
}  // namespace shardd
