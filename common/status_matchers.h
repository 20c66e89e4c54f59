#ifndef SHARDD_COMMON_STATUS_MATCHERS_H_
#define SHARDD_COMMON_STATUS_MATCHERS_H_

// gMock matchers for absl::Status / absl::StatusOr (not in this Abseil).
//   EXPECT_THAT(Foo(), IsOk());
//   EXPECT_THAT(Bar(), StatusIs(absl::StatusCode::kInvalidArgument,
//                               HasSubstr("world_size")));
//   SHARDD_ASSERT_OK_AND_ASSIGN(auto plan, Plan(...));

#include <ostream>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"

namespace shardd {
namespace testing_internal {

inline const absl::Status& GetStatus(const absl::Status& status) {
  return status;
}
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}

}  // namespace testing_internal

MATCHER(IsOk, "is OK") {
  const absl::Status& status = testing_internal::GetStatus(arg);
  if (!status.ok()) *result_listener << "status is " << status.ToString();
  return status.ok();
}

MATCHER_P2(StatusIs, code, message_matcher,
           "has code " + testing::PrintToString(code)) {
  const absl::Status& status = testing_internal::GetStatus(arg);
  *result_listener << "status is " << status.ToString();
  return status.code() == code &&
         testing::ExplainMatchResult(
             message_matcher, std::string(status.message()), result_listener);
}

// Code only, any message.
MATCHER_P(StatusIs, code, "has code " + testing::PrintToString(code)) {
  const absl::Status& status = testing_internal::GetStatus(arg);
  *result_listener << "status is " << status.ToString();
  return status.code() == code;
}

// A StatusOr that is OK and whose value matches `value_matcher`.
MATCHER_P(IsOkAndHolds, value_matcher, "is OK and holds a matching value") {
  if (!arg.ok()) {
    *result_listener << "status " << arg.status().ToString();
    return false;
  }
  return testing::ExplainMatchResult(value_matcher, *arg, result_listener);
}

}  // namespace shardd

#define SHARDD_ASSERT_OK(expr) ASSERT_THAT((expr), ::shardd::IsOk())
#define SHARDD_EXPECT_OK(expr) EXPECT_THAT((expr), ::shardd::IsOk())

#define SHARDD_ASSERT_OK_AND_ASSIGN(lhs, expr) \
  SHARDD_ASSERT_OK_AND_ASSIGN_IMPL_(           \
      SHARDD_MATCHERS_CONCAT_(shardd_assert_or_, __LINE__), lhs, expr)
#define SHARDD_MATCHERS_CONCAT_INNER_(a, b) a##b
#define SHARDD_MATCHERS_CONCAT_(a, b) SHARDD_MATCHERS_CONCAT_INNER_(a, b)
#define SHARDD_ASSERT_OK_AND_ASSIGN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                      \
  ASSERT_TRUE(statusor.ok()) << statusor.status().ToString();  \
  lhs = std::move(statusor).value()

#endif  // SHARDD_COMMON_STATUS_MATCHERS_H_
