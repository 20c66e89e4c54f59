#include "worker/model/command_order.h"

#include <cstdint>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "program/pass_layout.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;
using v1::Command;

Command Cmd(Command::Op op, Command::Part part, int pass = 0, int layer = 0,
            int mb = 0) {
  Command c;
  c.set_op(op);
  c.set_part(part);
  c.set_pass(pass);
  c.set_layer(layer);
  c.set_microbatch(mb);
  return c;
}

// Runs `c` through Check and, when it passes, Commit.
absl::Status Apply(ModelCommandOrder& order, const Command& c) {
  absl::Status status = order.Check(c, "TestModel");
  if (status.ok()) order.Commit(c);
  return status;
}

// Layers: 0 dense, 1 MoE.
ModelCommandOrder TwoLayers(bool per_microbatch, int passes = 1,
                            int no_grad = 0, int microbatches = 1) {
  return ModelCommandOrder(passes, no_grad, microbatches, {false, true},
                           per_microbatch);
}

void RunPass(ModelCommandOrder& order, int pass, int mb, bool backward) {
  SCOPED_TRACE(::testing::Message() << "pass " << pass << " mb " << mb);
  SHARDD_EXPECT_OK(
      Apply(order, Cmd(Command::FORWARD, Command::EMBED, pass, 0, mb)));
  SHARDD_EXPECT_OK(
      Apply(order, Cmd(Command::FORWARD, Command::LAYER, pass, 0, mb)));
  SHARDD_EXPECT_OK(
      Apply(order, Cmd(Command::FORWARD, Command::LAYER, pass, 1, mb)));
  SHARDD_EXPECT_OK(
      Apply(order, Cmd(Command::FORWARD, Command::EXPERTS, pass, 1, mb)));
  SHARDD_EXPECT_OK(
      Apply(order, Cmd(Command::FORWARD, Command::HEAD, pass, 0, mb)));
  if (!backward) return;
  SHARDD_EXPECT_OK(
      Apply(order, Cmd(Command::BACKWARD, Command::HEAD, pass, 0, mb)));
  SHARDD_EXPECT_OK(
      Apply(order, Cmd(Command::BACKWARD, Command::EXPERTS, pass, 1, mb)));
  SHARDD_EXPECT_OK(
      Apply(order, Cmd(Command::BACKWARD, Command::LAYER, pass, 1, mb)));
  SHARDD_EXPECT_OK(
      Apply(order, Cmd(Command::BACKWARD, Command::LAYER, pass, 0, mb)));
  SHARDD_EXPECT_OK(
      Apply(order, Cmd(Command::BACKWARD, Command::EMBED, pass, 0, mb)));
}

TEST(ModelCommandOrderTest, AcceptsTheScheduleAndRepeatsItAfterReset) {
  ModelCommandOrder order = TwoLayers(false, /*passes=*/2, /*no_grad=*/1);
  for (int step = 0; step < 2; ++step) {
    RunPass(order, 0, 0, /*backward=*/false);
    RunPass(order, 1, 0, /*backward=*/true);
    order.Reset();
  }
}

TEST(ModelCommandOrderTest, BlockDiffusionLayout) {
  // Encode (gradients), self-conditioning decode (no graph), decode
  // (gradients); the decode's backward first, then the encode's.
  ModelCommandOrder order(PassLayout::For(kBlockDiffusionArchitecture, 3, 1),
                          /*microbatches=*/1, {false, true},
                          /*per_microbatch=*/false);
  RunPass(order, 0, 0, /*backward=*/false);
  RunPass(order, 1, 0, /*backward=*/false);
  EXPECT_THAT(order.Check(Cmd(Command::BACKWARD, Command::HEAD, 1), "M"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("BACKWARD of pass 1, which has no gradients")));
  RunPass(order, 2, 0, /*backward=*/true);
  SHARDD_EXPECT_OK(Apply(order, Cmd(Command::BACKWARD, Command::HEAD, 0)));
}

TEST(ModelCommandOrderTest, RangesAndOps) {
  ModelCommandOrder order = TwoLayers(false, 2, 1, 2);
  EXPECT_THAT(order.Check(Cmd(Command::FORWARD, Command::EMBED, 2), "M"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("outside the step's 2 passes and 2")));
  EXPECT_THAT(
      order.Check(Cmd(Command::FORWARD, Command::EMBED, 0, 0, -1), "M"),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("microbatch -1")));
  EXPECT_THAT(order.Check(Cmd(Command::FORWARD, Command::LAYER, 0, 2), "M"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("command layer 2 outside [0, 2)")));
  EXPECT_THAT(order.Check(Cmd(Command::UNSHARD, Command::LAYER), "MyModel"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("MyModel runs FORWARD and BACKWARD")));
  EXPECT_THAT(order.Check(Cmd(Command::BACKWARD, Command::HEAD, 0), "M"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("which has no gradients")));
  EXPECT_THAT(
      order.Check(Cmd(Command::FORWARD, Command::EXPERTS, 0, 0), "M"),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("FORWARD EXPERTS of layer 0, which has none")));
}

TEST(ModelCommandOrderTest, OutOfOrderCommandsNameWhatComesFirst) {
  ModelCommandOrder order = TwoLayers(false, 2, 0);
  EXPECT_THAT(Apply(order, Cmd(Command::FORWARD, Command::LAYER, 0, 0)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("FORWARD LAYER 0 out of order in pass 0")));
  EXPECT_THAT(Apply(order, Cmd(Command::FORWARD, Command::EMBED, 1)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("before pass 0's HEAD")));
  SHARDD_EXPECT_OK(Apply(order, Cmd(Command::FORWARD, Command::EMBED, 0)));
  SHARDD_EXPECT_OK(Apply(order, Cmd(Command::FORWARD, Command::LAYER, 0, 0)));
  EXPECT_THAT(Apply(order, Cmd(Command::FORWARD, Command::EXPERTS, 0, 1)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("must follow FORWARD LAYER 1")));
  SHARDD_EXPECT_OK(Apply(order, Cmd(Command::FORWARD, Command::LAYER, 0, 1)));
  EXPECT_THAT(Apply(order, Cmd(Command::FORWARD, Command::HEAD, 0)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("FORWARD HEAD before the last layer")));
  SHARDD_EXPECT_OK(Apply(order, Cmd(Command::FORWARD, Command::EXPERTS, 0, 1)));
  EXPECT_THAT(
      Apply(order, Cmd(Command::BACKWARD, Command::HEAD, 0)),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               HasSubstr("BACKWARD HEAD of pass 0 without its forward")));
  SHARDD_EXPECT_OK(Apply(order, Cmd(Command::FORWARD, Command::HEAD, 0)));
  SHARDD_EXPECT_OK(Apply(order, Cmd(Command::BACKWARD, Command::HEAD, 0)));
  EXPECT_THAT(Apply(order, Cmd(Command::BACKWARD, Command::HEAD, 0)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("without its forward")));
  EXPECT_THAT(Apply(order, Cmd(Command::BACKWARD, Command::LAYER, 0, 1)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("(BACKWARD EXPERTS comes first)")));
  EXPECT_THAT(Apply(order, Cmd(Command::BACKWARD, Command::EXPERTS, 0, 0)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("BACKWARD EXPERTS 0 out of order")));
  EXPECT_THAT(Apply(order, Cmd(Command::BACKWARD, Command::EMBED, 0)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("before every layer's backward")));
  SHARDD_EXPECT_OK(
      Apply(order, Cmd(Command::BACKWARD, Command::EXPERTS, 0, 1)));
  EXPECT_THAT(Apply(order, Cmd(Command::BACKWARD, Command::LAYER, 0, 0)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("BACKWARD LAYER 0 out of order")));
  SHARDD_EXPECT_OK(Apply(order, Cmd(Command::BACKWARD, Command::LAYER, 0, 1)));
  SHARDD_EXPECT_OK(Apply(order, Cmd(Command::BACKWARD, Command::LAYER, 0, 0)));
  SHARDD_EXPECT_OK(Apply(order, Cmd(Command::BACKWARD, Command::EMBED, 0)));
  // The pass's backward is consumed.
  EXPECT_THAT(Apply(order, Cmd(Command::BACKWARD, Command::EMBED, 0)),
              StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST(ModelCommandOrderTest, MicroBatchesInterleaveOnlyWithTheirOwnPlaces) {
  // Per micro-batch: micro-batch 1's forward leaves micro-batch 0's intact.
  ModelCommandOrder separate = TwoLayers(true, 1, 0, 2);
  RunPass(separate, 0, 0, /*backward=*/false);
  RunPass(separate, 0, 1, /*backward=*/false);
  SHARDD_EXPECT_OK(
      Apply(separate, Cmd(Command::BACKWARD, Command::HEAD, 0, 0, 0)));

  // Per pass: micro-batch 1's EMBED starts the pass over, so micro-batch
  // 0's HEAD is gone.
  ModelCommandOrder shared = TwoLayers(false, 1, 0, 2);
  RunPass(shared, 0, 0, /*backward=*/false);
  SHARDD_EXPECT_OK(
      Apply(shared, Cmd(Command::FORWARD, Command::EMBED, 0, 0, 1)));
  EXPECT_THAT(Apply(shared, Cmd(Command::BACKWARD, Command::HEAD, 0, 0, 0)),
              StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST(CheckMicroBatchTest, CountsTargetsAndNamesBadFields) {
  const std::vector<int32_t> in = {0, 1, 2, 3};
  const std::vector<int32_t> tgt = {1, -1, 3, 0};
  SHARDD_ASSERT_OK_AND_ASSIGN(
      int64_t counted, CheckMicroBatch(1, 2, in.data(), tgt.data(), 2, 2, 4));
  EXPECT_EQ(counted, 3);
  EXPECT_THAT(CheckMicroBatch(2, 2, in.data(), tgt.data(), 2, 2, 4),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("microbatch: must be in [0, 2)")));
  EXPECT_THAT(
      CheckMicroBatch(0, 2, in.data(), tgt.data(), 0, 2, 4),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("batch and seq")));
  EXPECT_THAT(CheckMicroBatch(0, 2, nullptr, tgt.data(), 2, 2, 4),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("must not be null")));
  EXPECT_THAT(CheckMicroBatch(0, 2, in.data(), in.data(), 2, 2, 3),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("inputs[3]: token id 3 outside [0, 3)")));
  const std::vector<int32_t> bad = {1, -2, 0, 0};
  EXPECT_THAT(
      CheckMicroBatch(0, 2, in.data(), bad.data(), 2, 2, 4),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("targets[1]")));
}

// Expert parallelism: EXPERTS between DISPATCH and COMBINE, forward and
// backward (COMBINE, EXPERTS, DISPATCH); without it neither is taken.
TEST(ModelCommandOrderTest, ExpertParallelLayersExchangeAroundExperts) {
  ModelCommandOrder plain = TwoLayers(false);
  SHARDD_EXPECT_OK(Apply(plain, Cmd(Command::FORWARD, Command::EMBED)));
  SHARDD_EXPECT_OK(Apply(plain, Cmd(Command::FORWARD, Command::LAYER, 0, 0)));
  SHARDD_EXPECT_OK(Apply(plain, Cmd(Command::FORWARD, Command::LAYER, 0, 1)));
  EXPECT_THAT(Apply(plain, Cmd(Command::FORWARD, Command::DISPATCH, 0, 1)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("only a MoE layer under expert parallelism")));

  ModelCommandOrder order = TwoLayers(false);
  order.SetExchanged(true);
  auto fwd = [](Command::Part part, int layer) {
    return Cmd(Command::FORWARD, part, 0, layer);
  };
  auto bwd = [](Command::Part part, int layer) {
    return Cmd(Command::BACKWARD, part, 0, layer);
  };
  SHARDD_EXPECT_OK(Apply(order, fwd(Command::EMBED, 0)));
  SHARDD_EXPECT_OK(Apply(order, fwd(Command::LAYER, 0)));
  // The dense layer exchanges nothing.
  EXPECT_THAT(Apply(order, fwd(Command::DISPATCH, 0)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  SHARDD_EXPECT_OK(Apply(order, fwd(Command::LAYER, 1)));
  EXPECT_THAT(Apply(order, fwd(Command::EXPERTS, 1)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("must follow FORWARD DISPATCH 1")));
  EXPECT_THAT(Apply(order, fwd(Command::COMBINE, 1)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("must follow FORWARD EXPERTS 1")));
  SHARDD_EXPECT_OK(Apply(order, fwd(Command::DISPATCH, 1)));
  EXPECT_THAT(Apply(order, fwd(Command::HEAD, 0)),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  SHARDD_EXPECT_OK(Apply(order, fwd(Command::EXPERTS, 1)));
  EXPECT_THAT(Apply(order, fwd(Command::HEAD, 0)),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  SHARDD_EXPECT_OK(Apply(order, fwd(Command::COMBINE, 1)));
  SHARDD_EXPECT_OK(Apply(order, fwd(Command::HEAD, 0)));
  SHARDD_EXPECT_OK(Apply(order, bwd(Command::HEAD, 0)));
  EXPECT_THAT(Apply(order, bwd(Command::EXPERTS, 1)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("BACKWARD COMBINE comes first")));
  EXPECT_THAT(Apply(order, bwd(Command::DISPATCH, 1)),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  SHARDD_EXPECT_OK(Apply(order, bwd(Command::COMBINE, 1)));
  EXPECT_THAT(Apply(order, bwd(Command::LAYER, 1)),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  SHARDD_EXPECT_OK(Apply(order, bwd(Command::EXPERTS, 1)));
  EXPECT_THAT(Apply(order, bwd(Command::LAYER, 1)),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  SHARDD_EXPECT_OK(Apply(order, bwd(Command::DISPATCH, 1)));
  SHARDD_EXPECT_OK(Apply(order, bwd(Command::LAYER, 1)));
  SHARDD_EXPECT_OK(Apply(order, bwd(Command::LAYER, 0)));
  SHARDD_EXPECT_OK(Apply(order, bwd(Command::EMBED, 0)));
}

}  // namespace
}  // namespace shardd
