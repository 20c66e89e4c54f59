#include "worker/comm/collective_watchdog.h"

#include <atomic>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
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

// A transport double: a health probe whose result the test sets, and an
// abort function that records every call.
class FakeTransport {
 public:
  absl::Status Health() {
    probes_.fetch_add(1);
    absl::MutexLock lock(&mu_);
    return health_;
  }
  void SetHealth(absl::Status status) {
    absl::MutexLock lock(&mu_);
    health_ = std::move(status);
  }
  void Abort(const absl::Status& cause) {
    absl::MutexLock lock(&mu_);
    ++aborts_;
    abort_cause_ = cause;
  }
  int aborts() const {
    absl::MutexLock lock(&mu_);
    return aborts_;
  }
  absl::Status abort_cause() const {
    absl::MutexLock lock(&mu_);
    return abort_cause_;
  }
  int64_t probes() const { return probes_.load(); }

  std::unique_ptr<CollectiveWatchdog> MakeWatchdog(
      absl::Duration poll = absl::Milliseconds(1)) {
    CollectiveWatchdog::Options options;
    options.name = "test group";
    options.poll_interval = poll;
    auto watchdog = CollectiveWatchdog::Create(
        [this] { return Health(); },
        [this](const absl::Status& cause) { Abort(cause); }, options);
    EXPECT_TRUE(watchdog.ok()) << watchdog.status();
    return std::move(watchdog).value();
  }

 private:
  mutable absl::Mutex mu_;
  absl::Status health_ ABSL_GUARDED_BY(mu_);
  int aborts_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status abort_cause_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> probes_{0};
};

// Completes once `delay` has passed since it was made.
CollectiveWatchdog::CompletionProbe DoneAfter(absl::Duration delay) {
  const absl::Time ready = absl::Now() + delay;
  return [ready]() -> absl::StatusOr<bool> { return absl::Now() >= ready; };
}

CollectiveWatchdog::CompletionProbe NeverDone() {
  return []() -> absl::StatusOr<bool> { return false; };
}

TEST(CollectiveWatchdogTest, CreateRejectsBadArguments) {
  FakeTransport fake;
  auto abort = [&](const absl::Status& s) { fake.Abort(s); };
  auto health = [&] { return fake.Health(); };
  EXPECT_THAT(
      CollectiveWatchdog::Create(nullptr, abort, {}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("health_probe")));
  EXPECT_THAT(CollectiveWatchdog::Create(health, nullptr, {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("abort_function")));
  CollectiveWatchdog::Options options;
  options.poll_interval = absl::ZeroDuration();
  EXPECT_THAT(
      CollectiveWatchdog::Create(health, abort, options),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("poll_interval")));
  options = {};
  options.wait_poll_interval = absl::InfiniteDuration();
  EXPECT_THAT(CollectiveWatchdog::Create(health, abort, options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("wait_poll_interval")));
}

TEST(CollectiveWatchdogTest, BeginRejectsBadTimeouts) {
  FakeTransport fake;
  auto watchdog = fake.MakeWatchdog();
  EXPECT_THAT(
      watchdog->Begin("op", absl::ZeroDuration(), NeverDone()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("timeout")));
  EXPECT_THAT(watchdog->Begin("op", absl::InfiniteDuration(), NeverDone()),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(watchdog->in_flight(), 0);
  EXPECT_FALSE(watchdog->aborted());
}

TEST(CollectiveWatchdogTest, OperationCompletingInTimeReturnsOk) {
  FakeTransport fake;
  auto watchdog = fake.MakeWatchdog();
  SHARDD_ASSERT_OK_AND_ASSIGN(
      const auto id, watchdog->Begin("all-gather #1", absl::Seconds(10),
                                     DoneAfter(absl::Milliseconds(30))));
  EXPECT_EQ(watchdog->in_flight(), 1);
  const absl::Time start = absl::Now();
  EXPECT_THAT(watchdog->Wait(id), IsOk());
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(25));
  EXPECT_EQ(watchdog->in_flight(), 0);
  EXPECT_EQ(fake.aborts(), 0);
  EXPECT_THAT(watchdog->first_error(), IsOk());
  // Waiting again on a completed operation is fine.
  EXPECT_THAT(watchdog->Wait(id), IsOk());
  // The health probe ran while the operation was in flight.
  EXPECT_GT(fake.probes(), 0);
}

TEST(CollectiveWatchdogTest, UnwaitedOperationsAreForgottenWhenDone) {
  FakeTransport fake;
  auto watchdog = fake.MakeWatchdog();
  for (int i = 0; i < 5; ++i) {
    SHARDD_ASSERT_OK_AND_ASSIGN(
        auto id, watchdog->Begin("op", absl::Seconds(10),
                                 DoneAfter(absl::Milliseconds(5))));
    (void)id;
  }
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (watchdog->in_flight() > 0 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(watchdog->in_flight(), 0);
  EXPECT_EQ(fake.aborts(), 0);
}

TEST(CollectiveWatchdogTest, OperationNeverCompletingExceedsItsDeadline) {
  FakeTransport fake;
  auto watchdog = fake.MakeWatchdog();
  SHARDD_ASSERT_OK_AND_ASSIGN(
      const auto id, watchdog->Begin("reduce-scatter of layer 7",
                                     absl::Milliseconds(60), NeverDone()));
  const absl::Time start = absl::Now();
  const absl::Status status = watchdog->Wait(id);
  const absl::Duration waited = absl::Now() - start;
  EXPECT_THAT(status,
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       AllOf(HasSubstr("test group"),
                             HasSubstr("reduce-scatter of layer 7"),
                             HasSubstr("within 60ms"), HasSubstr("waited"))));
  EXPECT_GE(waited, absl::Milliseconds(55));
  EXPECT_LT(waited, absl::Seconds(5));
  EXPECT_EQ(fake.aborts(), 1);
  EXPECT_EQ(fake.abort_cause(), status);
  EXPECT_TRUE(watchdog->aborted());
  EXPECT_EQ(watchdog->first_error(), status);

  // Everything later fails fast, naming the first error.
  EXPECT_THAT(watchdog->Begin("next", absl::Seconds(1), NeverDone()),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("communicator aborted: "),
                             HasSubstr("reduce-scatter of layer 7"))));
  EXPECT_THAT(watchdog->Wait(id),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("communicator aborted: ")));
  EXPECT_EQ(fake.aborts(), 1);
}

TEST(CollectiveWatchdogTest, FailingHealthProbeAbortsInFlightOperations) {
  FakeTransport fake;
  auto watchdog = fake.MakeWatchdog();
  SHARDD_ASSERT_OK_AND_ASSIGN(
      const auto a, watchdog->Begin("op a", absl::Seconds(30), NeverDone()));
  SHARDD_ASSERT_OK_AND_ASSIGN(
      const auto b, watchdog->Begin("op b", absl::Seconds(30), NeverDone()));
  std::thread failer([&] {
    absl::SleepFor(absl::Milliseconds(20));
    fake.SetHealth(absl::AbortedError("peer 3 closed the connection"));
  });
  const absl::Time start = absl::Now();
  const absl::Status status_a = watchdog->Wait(a);
  failer.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_THAT(status_a,
              StatusIs(absl::StatusCode::kAborted,
                       AllOf(HasSubstr("test group"),
                             HasSubstr("peer 3 closed the connection"))));
  // The other operation in flight reports the same first error.
  EXPECT_EQ(watchdog->Wait(b), status_a);
  EXPECT_EQ(fake.aborts(), 1);
  EXPECT_EQ(fake.abort_cause(), status_a);
}

TEST(CollectiveWatchdogTest, CompletionProbeErrorAborts) {
  FakeTransport fake;
  auto watchdog = fake.MakeWatchdog();
  SHARDD_ASSERT_OK_AND_ASSIGN(
      const auto id,
      watchdog->Begin("broadcast", absl::Seconds(30),
                      []() -> absl::StatusOr<bool> {
                        return absl::InternalError("illegal address");
                      }));
  EXPECT_THAT(
      watchdog->Wait(id),
      StatusIs(absl::StatusCode::kInternal,
               AllOf(HasSubstr("broadcast"), HasSubstr("illegal address"))));
  EXPECT_EQ(fake.aborts(), 1);
}

TEST(CollectiveWatchdogTest, OperationsWithoutProbeCompleteExplicitly) {
  FakeTransport fake;
  auto watchdog = fake.MakeWatchdog();
  SHARDD_ASSERT_OK_AND_ASSIGN(
      const auto id, watchdog->Begin("host op", absl::Seconds(30), nullptr));
  std::atomic<bool> completed{false};
  std::thread completer([&] {
    absl::SleepFor(absl::Milliseconds(20));
    completed = true;
    watchdog->Complete(id);
  });
  EXPECT_THAT(watchdog->Wait(id), IsOk());
  EXPECT_TRUE(completed.load());
  completer.join();
  watchdog->Complete(id);  // Twice is harmless.
  watchdog->Complete(12345);
  EXPECT_EQ(fake.aborts(), 0);
}

TEST(CollectiveWatchdogTest, WaitOnUnknownIdIsInvalid) {
  FakeTransport fake;
  auto watchdog = fake.MakeWatchdog();
  EXPECT_THAT(watchdog->Wait(0), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(watchdog->Wait(-1), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(CollectiveWatchdogTest, WaitReturnsOnlyAfterTheAbortFunctionReturned) {
  std::atomic<bool> abort_finished{false};
  std::atomic<int> aborts{0};
  CollectiveWatchdog::Options options;
  options.poll_interval = absl::Milliseconds(1);
  SHARDD_ASSERT_OK_AND_ASSIGN(
      auto watchdog,
      CollectiveWatchdog::Create([] { return absl::OkStatus(); },
                                 [&](const absl::Status&) {
                                   ++aborts;
                                   // A slow teardown (ncclCommAbort can take a
                                   // while).
                                   absl::SleepFor(absl::Milliseconds(50));
                                   abort_finished = true;
                                 },
                                 options));
  SHARDD_ASSERT_OK_AND_ASSIGN(
      const auto id,
      watchdog->Begin("op", absl::Milliseconds(10), NeverDone()));
  EXPECT_THAT(watchdog->Wait(id),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_TRUE(abort_finished.load());
  EXPECT_EQ(aborts.load(), 1);
}

TEST(CollectiveWatchdogTest, AbortRunsExactlyOnceUnderConcurrentFailures) {
  FakeTransport fake;
  auto watchdog = fake.MakeWatchdog();
  std::vector<CollectiveWatchdog::OperationId> ids;
  for (int i = 0; i < 8; ++i) {
    SHARDD_ASSERT_OK_AND_ASSIGN(
        auto id, watchdog->Begin("op", absl::Milliseconds(20), NeverDone()));
    ids.push_back(id);
  }
  std::atomic<int> performed{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] {
      if (i % 2 == 0) {
        if (watchdog->Abort(absl::UnavailableError("manual"))) ++performed;
      }
      EXPECT_FALSE(watchdog->Wait(ids[i]).ok());
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(fake.aborts(), 1);
  EXPECT_LE(performed.load(), 1);
  EXPECT_EQ(fake.abort_cause(), watchdog->first_error());
  EXPECT_FALSE(watchdog->Abort(absl::InternalError("again")));
  EXPECT_EQ(fake.aborts(), 1);
}

TEST(CollectiveWatchdogTest, ManyOperationsFromManyThreads) {
  FakeTransport fake;
  auto watchdog = fake.MakeWatchdog();
  constexpr int kThreads = 8;
  constexpr int kOpsPerThread = 100;
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kOpsPerThread; ++i) {
        // A mix of immediate, short and explicitly completed operations.
        CollectiveWatchdog::CompletionProbe done;
        if (i % 3 != 2) done = DoneAfter(absl::Microseconds((i + t) % 4 * 200));
        auto id = watchdog->Begin("op", absl::Seconds(30), std::move(done));
        ASSERT_TRUE(id.ok()) << id.status();
        if (i % 3 == 2) watchdog->Complete(*id);
        if (watchdog->Wait(*id).ok()) ++ok;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(ok.load(), kThreads * kOpsPerThread);
  EXPECT_EQ(watchdog->in_flight(), 0);
  EXPECT_EQ(fake.aborts(), 0);
}

TEST(CollectiveWatchdogTest, IdleWatchdogDoesNotProbe) {
  FakeTransport fake;
  fake.SetHealth(absl::AbortedError("would abort if probed"));
  auto watchdog = fake.MakeWatchdog();
  absl::SleepFor(absl::Milliseconds(30));
  EXPECT_EQ(fake.probes(), 0);
  EXPECT_FALSE(watchdog->aborted());
}

TEST(CollectiveWatchdogTest, DestructionWithOperationsInFlightDoesNotAbort) {
  FakeTransport fake;
  {
    auto watchdog = fake.MakeWatchdog();
    SHARDD_ASSERT_OK_AND_ASSIGN(
        auto id, watchdog->Begin("op", absl::Seconds(30), NeverDone()));
    (void)id;
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(fake.aborts(), 0);
}

}  // namespace
}  // namespace shardd
