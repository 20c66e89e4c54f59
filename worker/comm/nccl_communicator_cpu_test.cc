// The parts of NcclCommunicator that need no GPU, for CUDA builds on any
// machine: the unique-id exchange through the key-value store
// (ncclGetUniqueId works without a device) and Create()'s argument checks.

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/gpu.h"
#include "worker/comm/in_memory_kv_client.h"
#include "worker/comm/nccl_communicator.h"

namespace shardd {
namespace {

using ::shardd::testing_util::GpuCount;

using ::testing::HasSubstr;

// --- Unique id exchange: no GPU needed. -------------------------------

TEST(NcclUniqueIdTest, RankZeroPublishesAndEveryRankGetsTheSameId) {
  InMemoryKeyValueClient kv;
  constexpr int kRanks = 4;
  std::vector<ncclUniqueId> ids(kRanks);
  std::vector<absl::Status> statuses(kRanks);
  std::vector<std::thread> threads;
  // The other ranks start waiting before rank 0 publishes.
  for (int rank = 1; rank < kRanks; ++rank) {
    threads.emplace_back([&, rank] {
      auto id =
          ExchangeNcclUniqueId(&kv, "job1/inc0/shard", rank, absl::Seconds(30));
      statuses[rank] = id.status();
      if (id.ok()) ids[rank] = *id;
    });
  }
  absl::SleepFor(absl::Milliseconds(20));
  auto id0 = ExchangeNcclUniqueId(&kv, "job1/inc0/shard", 0, absl::Seconds(1));
  ASSERT_THAT(id0, IsOk());
  ids[0] = *id0;
  for (std::thread& t : threads) t.join();
  for (int rank = 1; rank < kRanks; ++rank) {
    ASSERT_THAT(statuses[rank], IsOk()) << "rank " << rank;
    EXPECT_EQ(std::memcmp(ids[rank].internal, ids[0].internal,
                          sizeof(ids[0].internal)),
              0)
        << "rank " << rank;
  }
  SHARDD_ASSERT_OK_AND_ASSIGN(
      const std::string value,
      kv.Get(NcclUniqueIdKey("job1/inc0/shard"), absl::ZeroDuration()));
  EXPECT_EQ(value.size(), 2 * sizeof(ncclUniqueId));
  EXPECT_EQ(NcclUniqueIdKey("job1/inc0/shard"),
            "job1/inc0/shard/nccl_unique_id");

  // A new group gets a different id.
  SHARDD_ASSERT_OK_AND_ASSIGN(
      const ncclUniqueId other,
      ExchangeNcclUniqueId(&kv, "job1/inc1/shard", 0, absl::Seconds(1)));
  EXPECT_NE(
      std::memcmp(other.internal, ids[0].internal, sizeof(other.internal)), 0);
}

TEST(NcclUniqueIdTest, WaitingRankTimesOutWithoutRankZero) {
  InMemoryKeyValueClient kv;
  const absl::Time start = absl::Now();
  EXPECT_THAT(
      ExchangeNcclUniqueId(&kv, "job1/lonely", 2, absl::Milliseconds(50)),
      StatusIs(absl::StatusCode::kDeadlineExceeded,
               HasSubstr("job1/lonely/nccl_unique_id")));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(45));
}

TEST(NcclUniqueIdTest, RejectsMalformedValuesAndArguments) {
  InMemoryKeyValueClient kv;
  SHARDD_ASSERT_OK(kv.Set(NcclUniqueIdKey("bad"), "not hex"));
  EXPECT_THAT(ExchangeNcclUniqueId(&kv, "bad", 1, absl::Seconds(1)),
              StatusIs(absl::StatusCode::kInternal,
                       HasSubstr("not a hex-encoded NCCL unique id")));
  SHARDD_ASSERT_OK(kv.Set(NcclUniqueIdKey("bad2"),
                          std::string(2 * sizeof(ncclUniqueId), 'g')));
  EXPECT_THAT(ExchangeNcclUniqueId(&kv, "bad2", 1, absl::Seconds(1)),
              StatusIs(absl::StatusCode::kInternal));
  EXPECT_THAT(ExchangeNcclUniqueId(nullptr, "p", 0, absl::Seconds(1)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("kv")));
  EXPECT_THAT(
      ExchangeNcclUniqueId(&kv, "", 0, absl::Seconds(1)),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("prefix")));
  EXPECT_THAT(ExchangeNcclUniqueId(&kv, "p", -1, absl::Seconds(1)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank")));
}

// --- Creation checks that need no GPU. --------------------------------

TEST(NcclCommunicatorTest, CreateRejectsBadArguments) {
  InMemoryKeyValueClient kv;
  NcclCommunicatorOptions options;
  EXPECT_THAT(NcclCommunicator::Create(nullptr, "p", 0, 1, options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("kv")));
  EXPECT_THAT(
      NcclCommunicator::Create(&kv, "", 0, 1, options),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("prefix")));
  EXPECT_THAT(
      NcclCommunicator::Create(&kv, "p", 0, 0, options),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("world_size")));
  EXPECT_THAT(NcclCommunicator::Create(&kv, "p", 2, 2, options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank")));
  options.device = -1;
  EXPECT_THAT(NcclCommunicator::Create(&kv, "p", 0, 1, options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("options.device")));
  options = {};
  options.init_timeout = absl::ZeroDuration();
  EXPECT_THAT(NcclCommunicator::Create(&kv, "p", 0, 1, options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("options.init_timeout")));
  EXPECT_EQ(kv.size(), 0);  // Nothing published for rejected calls.
}

TEST(NcclCommunicatorTest, CreateWithoutGpuFailsCleanly) {
  std::string reason;
  if (GpuCount(&reason) > 0) GTEST_SKIP() << "a GPU is present";
  InMemoryKeyValueClient kv;
  EXPECT_THAT(NcclCommunicator::Create(&kv, "p", 0, 1, {}),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(kv.size(), 0);
}

}  // namespace
}  // namespace shardd
