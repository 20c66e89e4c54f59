#include "absl/status/status.h"

#include <string>

#include "absl/status/statusor.h"
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

}  // namespace
}  // namespace shardd
