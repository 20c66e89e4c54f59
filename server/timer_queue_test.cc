#include "server/timer_queue.h"

#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace shardd {
namespace {

TEST(TimerQueueTest, RunsInDeadlineOrderNotScheduleOrder) {
  TimerQueue timers;
  absl::Mutex mu;
  std::vector<int> order;
  absl::Notification last;
  const absl::Time now = absl::Now();
  // Scheduled 3, 1, 2 by deadline; must run 1, 2, 3.
  timers.Schedule(now + absl::Milliseconds(60), [&] {
    absl::MutexLock lock(&mu);
    order.push_back(3);
    last.Notify();
  });
  timers.Schedule(now + absl::Milliseconds(20), [&] {
    absl::MutexLock lock(&mu);
    order.push_back(1);
  });
  timers.Schedule(now + absl::Milliseconds(40), [&] {
    absl::MutexLock lock(&mu);
    order.push_back(2);
  });
  ASSERT_TRUE(last.WaitForNotificationWithTimeout(absl::Seconds(5)));
  absl::MutexLock lock(&mu);
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3}));
}

TEST(TimerQueueTest, DoesNotRunBeforeItsTime) {
  TimerQueue timers;
  absl::Notification ran;
  const absl::Time start = absl::Now();
  absl::Time ran_at;
  timers.Schedule(start + absl::Milliseconds(50), [&] {
    ran_at = absl::Now();
    ran.Notify();
  });
  ASSERT_TRUE(ran.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_GE(ran_at - start, absl::Milliseconds(50));
}

TEST(TimerQueueTest, CancelledTimerNeverRuns) {
  TimerQueue timers;
  absl::Notification cancelled_ran;
  absl::Notification later_ran;
  const absl::Time now = absl::Now();
  const uint64_t id = timers.Schedule(now + absl::Milliseconds(20),
                                      [&] { cancelled_ran.Notify(); });
  timers.Schedule(now + absl::Milliseconds(60), [&] { later_ran.Notify(); });
  EXPECT_TRUE(timers.Cancel(id));
  EXPECT_FALSE(timers.Cancel(id));  // Already gone.
  ASSERT_TRUE(later_ran.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_FALSE(cancelled_ran.HasBeenNotified());
  EXPECT_EQ(timers.pending(), 0u);
}

TEST(TimerQueueTest, DestructorDropsPendingTimers) {
  bool ran = false;
  {
    TimerQueue timers;
    timers.Schedule(absl::Now() + absl::Hours(1), [&] { ran = true; });
    EXPECT_EQ(timers.pending(), 1u);
  }  // Must not wait an hour.
  EXPECT_FALSE(ran);
}

TEST(TimerQueueTest, CallbackMayScheduleAnother) {
  TimerQueue timers;
  absl::Notification second;
  timers.Schedule(absl::Now(), [&] {
    timers.Schedule(absl::Now() + absl::Milliseconds(5),
                    [&] { second.Notify(); });
  });
  EXPECT_TRUE(second.WaitForNotificationWithTimeout(absl::Seconds(5)));
}

}  // namespace
}  // namespace shardd
