#include "server/barrier.h"

#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardd {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

struct Arrival {
  absl::Notification done;
  absl::Status status;
  BarrierTable::Callback Callback() {
    return [this](absl::Status s) {
      status = std::move(s);
      done.Notify();
    };
  }
};

TEST(BarrierTest, CompletesWhenTheLastParticipantArrives) {
  BarrierTable table;
  Arrival a;
  Arrival b;
  EXPECT_NE(
      table.ArriveAsync("step", 3, "rank0", absl::Seconds(10), a.Callback()),
      0u);
  EXPECT_NE(
      table.ArriveAsync("step", 3, "rank1", absl::Seconds(10), b.Callback()),
      0u);
  EXPECT_FALSE(a.done.HasBeenNotified());
  EXPECT_EQ(table.waiting(), 2u);
  Arrival c;
  // The last arrival completes everyone inline.
  EXPECT_EQ(
      table.ArriveAsync("step", 3, "rank2", absl::Seconds(10), c.Callback()),
      0u);
  for (Arrival* arrival : {&a, &b, &c}) {
    ASSERT_TRUE(arrival->done.HasBeenNotified());
    SHARDD_EXPECT_OK(arrival->status);
  }
  EXPECT_EQ(table.waiting(), 0u);
}

TEST(BarrierTest, IdIsReusableRightAfterCompletion) {
  BarrierTable table;
  constexpr int kThreads = 4;
  constexpr int kRounds = 20;
  std::vector<std::thread> threads;
  std::vector<int> passed(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < kRounds; ++round) {
        if (table
                .Arrive("loop", kThreads, absl::StrCat("t", t),
                        absl::Seconds(10))
                .ok()) {
          ++passed[t];
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(passed[t], kRounds) << t;
  EXPECT_EQ(table.waiting(), 0u);
}

TEST(BarrierTest, TimeoutFailsEveryWaitingParticipant) {
  BarrierTable table;
  Arrival patient;
  table.ArriveAsync("b", 3, "rank0", absl::Seconds(30), patient.Callback());
  const absl::Time start = absl::Now();
  const absl::Status status =
      table.Arrive("b", 3, "rank1", absl::Milliseconds(50));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(50));
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kDeadlineExceeded,
                               AllOf(HasSubstr("2 of 3"), HasSubstr("rank0"),
                                     HasSubstr("rank1"))));
  // The patient one is released by the short timeout too.
  ASSERT_TRUE(patient.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_THAT(patient.status,
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("b")));
  EXPECT_EQ(table.waiting(), 0u);
}

TEST(BarrierTest, DisagreeingCountsFailEveryone) {
  BarrierTable table;
  Arrival first;
  table.ArriveAsync("b", 4, "rank0", absl::Seconds(30), first.Callback());
  EXPECT_THAT(table.Arrive("b", 3, "rank1", absl::Seconds(30)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("participants"), HasSubstr("4"),
                             HasSubstr("3"), HasSubstr("rank0"))));
  ASSERT_TRUE(first.done.HasBeenNotified());
  EXPECT_THAT(first.status, StatusIs(absl::StatusCode::kInvalidArgument,
                                     HasSubstr("participants")));
  // The id starts afresh afterwards.
  SHARDD_EXPECT_OK(table.Arrive("b", 1, "rank1", absl::Seconds(1)));
}

TEST(BarrierTest, BadArgumentsAreRejectedAtOnce) {
  BarrierTable table;
  EXPECT_THAT(
      table.Arrive("", 2, "x", absl::Seconds(1)),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("barrier_id")));
  EXPECT_THAT(
      table.Arrive("b", 0, "x", absl::Seconds(1)),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("participants")));
  EXPECT_EQ(table.waiting(), 0u);
}

TEST(BarrierTest, SameCallerAgainReplacesItsArrival) {
  BarrierTable table;
  Arrival old;
  table.ArriveAsync("b", 2, "rank0", absl::Seconds(30), old.Callback());
  Arrival retry;
  table.ArriveAsync("b", 2, "rank0", absl::Seconds(30), retry.Callback());
  ASSERT_TRUE(old.done.HasBeenNotified());
  EXPECT_THAT(old.status,
              StatusIs(absl::StatusCode::kAborted, HasSubstr("superseded")));
  // Still one of two: the retry did not count twice.
  EXPECT_FALSE(retry.done.HasBeenNotified());
  EXPECT_EQ(table.waiting(), 1u);
  SHARDD_EXPECT_OK(table.Arrive("b", 2, "rank1", absl::Seconds(1)));
  ASSERT_TRUE(retry.done.HasBeenNotified());
  SHARDD_EXPECT_OK(retry.status);
}

TEST(BarrierTest, CancelWithdrawsAnArrival) {
  BarrierTable table;
  Arrival gone;
  const uint64_t handle =
      table.ArriveAsync("b", 2, "rank0", absl::Seconds(30), gone.Callback());
  EXPECT_TRUE(table.Cancel(handle));
  EXPECT_THAT(gone.status,
              StatusIs(absl::StatusCode::kCancelled, ::testing::_));
  EXPECT_FALSE(table.Cancel(handle));
  // The withdrawn arrival does not count: one more is not enough.
  Arrival a;
  table.ArriveAsync("b", 2, "rank1", absl::Seconds(30), a.Callback());
  EXPECT_FALSE(a.done.HasBeenNotified());
  SHARDD_EXPECT_OK(table.Arrive("b", 2, "rank2", absl::Seconds(1)));
  SHARDD_EXPECT_OK(a.status);
}

TEST(BarrierTest, DestructorEndsWaitsWithUnavailable) {
  Arrival a;
  {
    BarrierTable table;
    table.ArriveAsync("b", 2, "rank0", absl::Hours(1), a.Callback());
  }
  ASSERT_TRUE(a.done.HasBeenNotified());
  EXPECT_THAT(a.status, StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
}

}  // namespace
}  // namespace shardd
