#include "worker/comm/in_memory_kv_client.h"

#include <string>
#include <thread>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;

TEST(InMemoryKeyValueClientTest, GetWaitsForALaterSet) {
  InMemoryKeyValueClient kv;
  const absl::Time start = absl::Now();
  std::thread setter([&kv] {
    absl::SleepFor(absl::Milliseconds(50));
    ASSERT_TRUE(kv.Set("k", "v").ok());
  });
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string value,
                              kv.Get("k", absl::Seconds(5)));
  EXPECT_EQ(value, "v");
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(45));
  setter.join();
}

TEST(InMemoryKeyValueClientTest, GetTimesOut) {
  InMemoryKeyValueClient kv;
  const absl::Time start = absl::Now();
  EXPECT_THAT(kv.Get("k", absl::Milliseconds(60)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("'k'")));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(55));
  EXPECT_THAT(kv.Get("k", absl::ZeroDuration()),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("'k'")));
}

TEST(InMemoryKeyValueClientTest, DeleteKeyAndPrefix) {
  InMemoryKeyValueClient kv;
  ASSERT_THAT(kv.Set("a/1", "x"), IsOk());
  ASSERT_THAT(kv.Set("a/2", "x"), IsOk());
  ASSERT_THAT(kv.Set("ab", "x"), IsOk());
  ASSERT_THAT(kv.Set("b", "x"), IsOk());
  EXPECT_THAT(kv.Delete("b", /*prefix=*/false), IsOk());
  EXPECT_EQ(kv.size(), 3);
  EXPECT_THAT(kv.Delete("a/", /*prefix=*/true), IsOk());
  EXPECT_EQ(kv.size(), 1);
  EXPECT_THAT(kv.Get("ab", absl::ZeroDuration()), IsOk());
  EXPECT_THAT(kv.Delete("missing", /*prefix=*/false), IsOk());
  EXPECT_EQ(kv.set_calls(), 4);
}

TEST(InMemoryKeyValueClientTest, EmptyKeyIsInvalid) {
  InMemoryKeyValueClient kv;
  EXPECT_THAT(kv.Set("", "x"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("key")));
  EXPECT_THAT(kv.Get("", absl::ZeroDuration()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("key")));
}

}  // namespace
}  // namespace shardd
