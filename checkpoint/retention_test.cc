#include "checkpoint/retention.h"

#include <stdlib.h>

#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "checkpoint/checkpoint_index.h"
#include "checkpoint/checkpoint_writer.h"

namespace shardd {
namespace checkpoint {
namespace {

namespace fs = std::filesystem;

std::string TestRoot() {
  const std::string root = absl::StrCat(
      getenv("TEST_TMPDIR"), "/",
      ::testing::UnitTest::GetInstance()->current_test_info()->name());
  fs::remove_all(root);
  return root;
}

// Commits a one-rank checkpoint of `step` under root (pinned when asked).
void Commit(const std::string& root, int64_t step, bool pinned = false) {
  const std::vector<float> values = {1, 2, 3, 4};
  absl::StatusOr<std::string> tmp = BeginCheckpoint(root, step);
  ASSERT_THAT(tmp, IsOk());
  const std::vector<RankTensor> tensors = {
      {"w", "F32", {4}, 0, 4,
       absl::Span<const uint8_t>(
           reinterpret_cast<const uint8_t*>(values.data()), 16)}};
  absl::StatusOr<RankFile> file = WriteRankFile(*tmp, 0, tensors);
  ASSERT_THAT(file, IsOk());
  CheckpointIndex index;
  index.step = step;
  index.saved_by = {"fsdp2", 1, {{"dp_shard", 1}}};
  ASSERT_THAT(AddRankFile(*file, &index), IsOk());
  if (pinned) {
    ASSERT_THAT(PinCheckpoint(*tmp), IsOk());
  }
  ASSERT_THAT(CommitCheckpoint(root, *tmp, index), IsOk());
}

std::vector<int64_t> Steps(const std::vector<CheckpointInfo>& list) {
  std::vector<int64_t> out;
  for (const CheckpointInfo& c : list) out.push_back(c.step);
  return out;
}

std::vector<int64_t> Listed(const std::string& root) {
  absl::StatusOr<std::vector<CheckpointInfo>> list = ListCheckpoints(root);
  EXPECT_THAT(list, IsOk());
  return list.ok() ? Steps(*list) : std::vector<int64_t>{};
}

TEST(RetentionTest, KeepsTheNewestPinnedProtectedAndEveryMth) {
  const std::string root = TestRoot();
  for (int64_t step : {2, 4, 6, 8, 10, 12}) Commit(root, step, step == 4);
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::vector<CheckpointInfo> all,
                              ListCheckpoints(root));
  ASSERT_EQ(Steps(all), (std::vector<int64_t>{12, 10, 8, 6, 4, 2}));
  EXPECT_TRUE(IsPinned(all[4].path));
  EXPECT_FALSE(IsPinned(all[0].path));

  RetentionPolicy keep_all;
  EXPECT_TRUE(RetentionVictims(all, keep_all).empty());
  RetentionPolicy keep2;
  keep2.keep_last = 2;
  // 4 is pinned; oldest first.
  EXPECT_EQ(Steps(RetentionVictims(all, keep2)),
            (std::vector<int64_t>{2, 6, 8}));
  keep2.keep_every = 3;  // keeps 6 (and 12)
  keep2.protect = {"step-00000002"};  // a job's --resume-from
  EXPECT_EQ(Steps(RetentionVictims(all, keep2)), (std::vector<int64_t>{8}));
  RetentionPolicy keep10;
  keep10.keep_last = 10;
  EXPECT_TRUE(RetentionVictims(all, keep10).empty());
}

TEST(RetentionTest, DeletesWithoutLeavingAListedRemnant) {
  const std::string root = TestRoot();
  for (int64_t step : {1, 2, 3}) Commit(root, step);
  SHARDD_ASSERT_OK_AND_ASSIGN(std::vector<CheckpointInfo> all,
                              ListCheckpoints(root));
  SHARDD_ASSERT_OK(DeleteCheckpoint(root, all[2]));  // step 1
  EXPECT_EQ(Listed(root), (std::vector<int64_t>{3, 2}));
  EXPECT_FALSE(fs::exists(all[2].path));
  for (const auto& entry : fs::directory_iterator(root)) {
    EXPECT_FALSE(absl::StartsWith(entry.path().filename().string(), ".tmp-"))
        << entry.path();
  }
  EXPECT_THAT(DeleteCheckpoint(root, {"../x", root + "/../x", 1}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  // Deleting one already gone is an error that changes nothing.
  EXPECT_FALSE(DeleteCheckpoint(root, all[2]).ok());
  EXPECT_EQ(Listed(root), (std::vector<int64_t>{3, 2}));
}

// A kill -9 between the rename and the removal (reproduced by doing only
// the rename DeleteCheckpoint starts with): the checkpoint no longer lists,
// the others are whole, and the leftover goes with the stale temporaries.
TEST(RetentionTest, ACrashMidDeleteLeavesOnlyWholeCheckpoints) {
  const std::string root = TestRoot();
  for (int64_t step : {1, 2}) Commit(root, step);
  fs::rename(root + "/step-00000001",
             root + "/.tmp-deleted-step-00000001-AbCdEf");
  // Half the files already gone.
  fs::remove(root + "/.tmp-deleted-step-00000001-AbCdEf/index.json");
  EXPECT_EQ(Listed(root), (std::vector<int64_t>{2}));
  SHARDD_ASSERT_OK_AND_ASSIGN(const int removed, RemoveStaleTemporaries(root));
  EXPECT_EQ(removed, 1);
  EXPECT_EQ(Listed(root), (std::vector<int64_t>{2}));
  EXPECT_FALSE(fs::exists(root + "/.tmp-deleted-step-00000001-AbCdEf"));
}

}  // namespace
}  // namespace checkpoint
}  // namespace shardd
