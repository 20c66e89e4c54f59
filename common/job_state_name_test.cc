#include "common/job_state_name.h"

#include "gtest/gtest.h"

namespace shardd {
namespace {

TEST(JobStateNameTest, EveryStateHasItsShortName) {
  EXPECT_EQ(JobStateName(v1::JOB_QUEUED), "queued");
  EXPECT_EQ(JobStateName(v1::JOB_RUNNING), "running");
  EXPECT_EQ(JobStateName(v1::JOB_RECOVERING), "recovering");
  EXPECT_EQ(JobStateName(v1::JOB_DONE), "done");
  EXPECT_EQ(JobStateName(v1::JOB_FAILED), "failed");
  EXPECT_EQ(JobStateName(v1::JOB_STATE_UNSPECIFIED), "unknown");
  EXPECT_EQ(JobStateName(static_cast<v1::JobState>(99)), "unknown");
}

}  // namespace
}  // namespace shardd
