#include "absl/status/status.h"

#include <string>

#include "absl/status/statusor.h"
#include "common/error_info.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;

absl::StatusOr<int> Half(int x) {
  if (x % 2 != 0) return absl::InvalidArgumentError("x must be even");
  return x / 2;
}

absl::StatusOr<int> Quarter(int x) {
  SHARDD_ASSIGN_OR_RETURN(int half, Half(x));
  SHARDD_ASSIGN_OR_RETURN(int quarter, Half(half));
  return quarter;
}

absl::Status CheckEven(int x) {
  SHARDD_RETURN_IF_ERROR(Half(x).status());
  return absl::OkStatus();
}

TEST(StatusMacrosTest, AssignOrReturnPropagatesErrors) {
  EXPECT_THAT(Quarter(8), IsOk());
  EXPECT_EQ(*Quarter(8), 2);
  EXPECT_THAT(Quarter(6),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("even")));
  EXPECT_THAT(CheckEven(3),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("even")));
  EXPECT_THAT(CheckEven(4), IsOk());
}

TEST(GrpcStatusTest, RoundTripKeepsCodeAndMessage) {
  for (int code = 0; code <= 16; ++code) {
    absl::Status status(static_cast<absl::StatusCode>(code),
                        code == 0 ? "" : "message " + std::to_string(code));
    grpc::Status grpc_status = ToGrpcStatus(status);
    EXPECT_EQ(static_cast<int>(grpc_status.error_code()), code);
    EXPECT_EQ(FromGrpcStatus(grpc_status), status);
  }
  EXPECT_EQ(ToGrpcStatus(absl::NotFoundError("model m1")).error_message(),
            "model m1");
}

TEST(ErrorInfoTest, ReasonIsAttachedReadAndReplaced) {
  absl::Status status = absl::FailedPreconditionError("no plan loaded");
  EXPECT_EQ(ErrorReasonOf(status), "");
  status = WithErrorReason(status, kReasonPlanNotHeld);
  EXPECT_EQ(ErrorReasonOf(status), kReasonPlanNotHeld);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(status.message(), "no plan loaded");
  status = WithErrorReason(status, kReasonStepFailedEarlier);
  EXPECT_EQ(ErrorReasonOf(status), kReasonStepFailedEarlier);
  // Reasons belong to errors.
  EXPECT_TRUE(WithErrorReason(absl::OkStatus(), kReasonPlanNotHeld).ok());
  // Another domain's ErrorInfo is not ours.
  absl::Status foreign = absl::AbortedError("x");
  foreign.SetPayload(kErrorInfoTypeUrl, absl::Cord("\x0a\x01R\x12\x01d"));
  EXPECT_EQ(ErrorReasonOf(foreign), "");
  foreign.SetPayload(kErrorInfoTypeUrl, absl::Cord("\xff\xff garbage"));
  EXPECT_EQ(ErrorReasonOf(foreign), "");
}

TEST(ErrorInfoTest, WithMessageKeepsCodeAndReason) {
  const absl::Status cause = WithErrorReason(
      absl::FailedPreconditionError("stale plan"), kReasonPlanNotHeld);
  const absl::Status wrapped = WithMessage(cause, "rank 2: stale plan");
  EXPECT_EQ(wrapped.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(wrapped.message(), "rank 2: stale plan");
  EXPECT_EQ(ErrorReasonOf(wrapped), kReasonPlanNotHeld);
  EXPECT_TRUE(WithMessage(absl::OkStatus(), "ignored").ok());
}

TEST(GrpcStatusTest, ReasonCrossesGrpc) {
  const absl::Status status = WithErrorReason(
      absl::FailedPreconditionError("failed in an earlier step"),
      kReasonStepFailedEarlier);
  const grpc::Status grpc_status = ToGrpcStatus(status);
  EXPECT_EQ(grpc_status.error_message(), "failed in an earlier step");
  EXPECT_FALSE(grpc_status.error_details().empty());
  const absl::Status back = FromGrpcStatus(grpc_status);
  EXPECT_EQ(back, status);
  EXPECT_EQ(ErrorReasonOf(back), kReasonStepFailedEarlier);
  // Without payloads there are no details, and details that do not parse
  // are dropped rather than failing the conversion.
  EXPECT_TRUE(ToGrpcStatus(absl::AbortedError("x")).error_details().empty());
  const absl::Status odd = FromGrpcStatus(
      grpc::Status(grpc::StatusCode::ABORTED, "peer", "\xff\xff"));
  EXPECT_EQ(odd, absl::AbortedError("peer"));
  EXPECT_EQ(ErrorReasonOf(odd), "");
}

}  // namespace
}  // namespace shardd
