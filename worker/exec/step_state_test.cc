#include "worker/exec/step_state.h"

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kFingerprint = 42;

// Two units over 4 shard ranks: "a" trainable in unit 0, "b" frozen in
// unit 1.
v1::ShardingPlan TwoUnitPlan() {
  v1::ShardingPlan plan;
  plan.set_fingerprint(kFingerprint);
  plan.mutable_mesh()->set_dp_shard(4);
  v1::FsdpUnit* u0 = plan.add_units();
  u0->set_name("layer0");
  v1::ParamLayout* a = u0->add_params();
  a->set_name("a");
  a->set_numel(8);
  v1::FsdpUnit* u1 = plan.add_units();
  u1->set_name("root");
  v1::ParamLayout* b = u1->add_params();
  b->set_name("b");
  b->set_numel(4);
  b->set_frozen(true);
  return plan;
}

v1::StepProgram Header(int step) {
  v1::StepProgram header;
  header.set_plan_fingerprint(kFingerprint);
  header.set_step(step);
  header.set_microbatches(1);
  header.set_passes(1);
  return header;
}

v1::Command Cmd(v1::Command::Op op, int unit = 0) {
  v1::Command c;
  c.set_op(op);
  c.set_unit(unit);
  return c;
}

v1::Command Compute(v1::Command::Op op, v1::Command::Part part) {
  v1::Command c;
  c.set_op(op);
  c.set_part(part);
  return c;
}

auto NoSlices = [](int) { return false; };

// Checks `c`, and accepts it when it fits.
absl::Status Apply(StepState& state, const v1::Command& c) {
  const absl::Status status = state.Check(c, NoSlices);
  if (status.ok()) state.Accept(c);
  return status;
}

TEST(StepStateTest, RejectsCommandsThatDoNotFitTheUnitState) {
  const v1::ShardingPlan plan = TwoUnitPlan();
  StepState state(&plan);
  state.Begin(Header(3));
  EXPECT_EQ(
      state.Label(Cmd(v1::Command::UNSHARD)).rfind("step 3 commands[0]", 0),
      0u);
  EXPECT_THAT(Apply(state, Cmd(v1::Command::UNSHARD, 5)),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("2 units")));
  EXPECT_THAT(Apply(state, Cmd(v1::Command::WAIT_UNSHARD)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("no pending prefetched UNSHARD")));
  EXPECT_THAT(Apply(state, Cmd(v1::Command::RESHARD)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("is not gathered")));
  EXPECT_FALSE(state.touched());
  SHARDD_EXPECT_OK(Apply(state, Cmd(v1::Command::UNSHARD)));
  EXPECT_TRUE(state.touched());
  EXPECT_EQ(state.commands(), 1);
  EXPECT_THAT(Apply(state, Cmd(v1::Command::UNSHARD)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("already gathered")));
  EXPECT_THAT(Apply(state, Cmd(v1::Command::ALLOC_GRAD, 1)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("no trainable parameters")));
  EXPECT_THAT(Apply(state, Cmd(v1::Command::REDUCE_SCATTER)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("no unsharded gradient")));
  v1::Command bad_group = Cmd(v1::Command::RESHARD);
  bad_group.set_group_size(3);  // Not a divisor of dp_shard 4.
  EXPECT_THAT(
      Apply(state, bad_group),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("group_size")));
  v1::Command slice = Cmd(v1::Command::RESHARD);
  slice.set_group_size(2);
  EXPECT_THAT(state.Check(slice, NoSlices),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("no slice group of that size")));
  EXPECT_THAT(
      Apply(state, Cmd(static_cast<v1::Command::Op>(99))),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("known command")));
  // Rejections had no effect.
  EXPECT_EQ(state.commands(), 1);
  EXPECT_TRUE(state.unit(0).gathered);
}

TEST(StepStateTest, ParametersNeedAGatheredWaitedUnitAndGradsAnAllocatedOne) {
  const v1::ShardingPlan plan = TwoUnitPlan();
  StepState state(&plan);
  state.Begin(Header(0));
  EXPECT_THAT(state.CheckParamReadable("nope"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("'nope'")));
  EXPECT_THAT(state.CheckParamReadable("a"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("gathered (UNSHARD)")));
  v1::Command prefetch = Cmd(v1::Command::UNSHARD);
  prefetch.set_prefetch(true);
  SHARDD_ASSERT_OK(Apply(state, prefetch));
  EXPECT_THAT(state.CheckParamReadable("a"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("WAIT_UNSHARD")));
  SHARDD_ASSERT_OK(Apply(state, Cmd(v1::Command::WAIT_UNSHARD)));
  SHARDD_EXPECT_OK(state.CheckParamReadable("a"));
  EXPECT_THAT(
      state.CheckGradWritable("a"),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("ALLOC_GRAD")));
  SHARDD_ASSERT_OK(Apply(state, Cmd(v1::Command::ALLOC_GRAD)));
  SHARDD_EXPECT_OK(state.CheckGradWritable("a"));
  SHARDD_ASSERT_OK(Apply(state, Cmd(v1::Command::REDUCE_SCATTER)));
  EXPECT_THAT(state.CheckGradWritable("a"),
              StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST(StepStateTest, OptimizerStepNeedsEveryUnitDoneAndEveryPassRun) {
  const v1::ShardingPlan plan = TwoUnitPlan();
  StepState state(&plan);
  state.Begin(Header(1));
  const v1::Command step = Cmd(v1::Command::OPTIMIZER_STEP);
  SHARDD_ASSERT_OK(Apply(state, Cmd(v1::Command::UNSHARD)));
  EXPECT_THAT(state.Check(step, NoSlices),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("still gathered")));
  SHARDD_ASSERT_OK(Apply(state, Cmd(v1::Command::RESHARD)));
  EXPECT_THAT(state.Check(step, NoSlices),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("0 of 1 forward passes")));
  SHARDD_ASSERT_OK(
      Apply(state, Compute(v1::Command::FORWARD, v1::Command::HEAD)));
  SHARDD_ASSERT_OK(
      Apply(state, Compute(v1::Command::BACKWARD, v1::Command::EMBED)));
  SHARDD_ASSERT_OK(Apply(state, step));
  state.set_stepped();
  EXPECT_THAT(state.Check(Cmd(v1::Command::UNSHARD), NoSlices),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("already ran")));
  SHARDD_EXPECT_OK(state.CheckEndStep());
  state.End();
  EXPECT_THAT(state.CheckEndStep(),
              StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST(StepStateTest, AReGatherFromASliceMarksTheSliceForFreeingOnce) {
  const v1::ShardingPlan plan = TwoUnitPlan();
  StepState state(&plan);
  state.Begin(Header(0));
  SHARDD_ASSERT_OK(Apply(state, Cmd(v1::Command::UNSHARD)));
  EXPECT_FALSE(state.TakeGatherFromSlice(0));
  v1::Command slice = Cmd(v1::Command::RESHARD);
  slice.set_group_size(2);
  SHARDD_ASSERT_OK(state.Check(slice, [](int g) { return g == 2; }));
  state.Accept(slice);
  EXPECT_EQ(state.unit(0).slice_group, 2);
  SHARDD_ASSERT_OK(Apply(state, Cmd(v1::Command::UNSHARD)));
  EXPECT_EQ(state.unit(0).slice_group, 0);
  EXPECT_TRUE(state.TakeGatherFromSlice(0));
  EXPECT_FALSE(state.TakeGatherFromSlice(0));
}

TEST(StepStateTest, AnUncleanFailureRefusesLaterStepsACleanOneDoesNot) {
  const v1::ShardingPlan plan = TwoUnitPlan();
  StepState state(&plan);
  SHARDD_ASSERT_OK(state.CheckHeader(Header(0)));
  v1::StepProgram stale = Header(0);
  stale.set_plan_fingerprint(kFingerprint + 1);
  EXPECT_THAT(
      state.CheckHeader(stale),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("stale plan")));
  state.Begin(Header(0));
  EXPECT_THAT(state.CheckHeader(Header(1)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("still in progress")));
  EXPECT_THAT(state.CheckBetweenSteps("restore"),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  state.Fail(absl::InternalError("norm"), /*clean=*/true, 0, 0);
  EXPECT_FALSE(state.in_step());
  SHARDD_EXPECT_OK(state.CheckHeader(Header(1)));
  state.Begin(Header(1));
  state.Fail(absl::AbortedError("link"), /*clean=*/false, 0, 0);
  EXPECT_THAT(state.CheckHeader(Header(2)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("unusable after a failed step")));
  EXPECT_THAT(
      state.CheckBetweenSteps("restore"),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("unusable")));
}

}  // namespace
}  // namespace shardd
