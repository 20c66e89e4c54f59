#include "server/jobs/job_journal.h"

#include <filesystem>
#include <memory>
#include <string>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/coordinator.pb.h"
#include "server/state_store.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;

std::string TempDb(const std::string& name) {
  const std::string dir =
      std::string(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR")
                                             : "/tmp") +
      "/" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir + "/state.db";
}

v1::StoredJobRecord Record(const std::string& id) {
  v1::StoredJobRecord record;
  record.set_job_id(id);
  record.set_model_id("m-1");
  record.set_total_steps(10);
  record.mutable_config()->set_steps(10);
  return record;
}

TEST(JobJournalTest, JobsAndProgressSurviveReopening) {
  const std::string path = TempDb("reopen");
  {
    auto store = StateStore::Open(path);
    SHARDD_ASSERT_OK(store.status());
    JobJournal journal(store->get());
    v1::StoredJobProgress progress;
    progress.set_state(v1::JOB_QUEUED);
    SHARDD_ASSERT_OK(journal.Create(Record("j-1"), progress, 2));
    SHARDD_ASSERT_OK(journal.Create(Record("j-2"), progress, 3));
    progress.set_state(v1::JOB_RUNNING);
    progress.set_steps_done(4);
    progress.set_last_checkpoint("j-1/step-00000004");
    SHARDD_ASSERT_OK(journal.Update("j-1", progress));
  }
  auto store = StateStore::Open(path);
  SHARDD_ASSERT_OK(store.status());
  JobJournal journal(store->get());
  auto jobs = journal.LoadAll();
  SHARDD_ASSERT_OK(jobs.status());
  ASSERT_EQ(jobs->size(), 2u);
  EXPECT_EQ((*jobs)[0].record.job_id(), "j-1");
  EXPECT_EQ((*jobs)[0].progress.steps_done(), 4);
  EXPECT_EQ((*jobs)[0].progress.state(), v1::JOB_RUNNING);
  EXPECT_EQ((*jobs)[0].progress.last_checkpoint(), "j-1/step-00000004");
  EXPECT_EQ((*jobs)[1].record.job_id(), "j-2");
  EXPECT_EQ((*jobs)[1].progress.state(), v1::JOB_QUEUED);
  EXPECT_THAT(journal.NextJob(), IsOkAndHolds(3));

  SHARDD_ASSERT_OK(journal.Erase("j-1"));
  jobs = journal.LoadAll();
  SHARDD_ASSERT_OK(jobs.status());
  ASSERT_EQ(jobs->size(), 1u);
  EXPECT_EQ((*jobs)[0].record.job_id(), "j-2");
}

TEST(JobJournalTest, GenerationGrowsAcrossOpens) {
  const std::string path = TempDb("generation");
  for (uint64_t expected = 1; expected <= 3; ++expected) {
    auto store = StateStore::Open(path);
    SHARDD_ASSERT_OK(store.status());
    JobJournal journal(store->get());
    EXPECT_THAT(journal.BumpGeneration(), IsOkAndHolds(expected));
  }
}

TEST(JobJournalTest, FreshStoreStartsAtJobOne) {
  auto store = StateStore::Open(TempDb("fresh"));
  SHARDD_ASSERT_OK(store.status());
  JobJournal journal(store->get());
  EXPECT_THAT(journal.NextJob(), IsOkAndHolds(1));
  auto jobs = journal.LoadAll();
  SHARDD_ASSERT_OK(jobs.status());
  EXPECT_TRUE(jobs->empty());
}

TEST(JobJournalTest, MalformedRecordIsDataLoss) {
  auto store = StateStore::Open(TempDb("malformed"));
  SHARDD_ASSERT_OK(store.status());
  SHARDD_ASSERT_OK((*store)->Put("jobs", "j-7", "\xff\xff not a proto"));
  JobJournal journal(store->get());
  EXPECT_THAT(journal.LoadAll(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("j-7")));
  SHARDD_ASSERT_OK((*store)->Put("meta", "next_job", "zero"));
  EXPECT_THAT(journal.NextJob(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("next_job")));
}

}  // namespace
}  // namespace shardd
