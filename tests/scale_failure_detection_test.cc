// Failure detection at scale: a real shardd-coordinator with 2048 simulated
// workers (testing/simulated_workers.h) heartbeating at the interval it
// hands out. One worker goes silent: it must be declared dead within the
// heartbeat timeout, and no worker that keeps beating may be (no false
// positives), before or after. Loopback only; every wait is bounded.

#include <unistd.h>

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/coordinator_client.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "tests/subprocess.h"
#include "testing/simulated_workers.h"

namespace shardd {
namespace {

using ::shardd::testing_util::ReadFile;
using ::shardd::testing_util::SimulatedWorkers;
using ::shardd::testing_util::Spawn;
using ::shardd::testing_util::Stop;
using ::shardd::testing_util::TempDir;
using ::shardd::testing_util::WaitForPortFile;

constexpr int kWorkers = 2048;
constexpr int kSilent = 777;
// Workers beat every timeout / 3: a false positive needs three beats in a
// row late by the whole timeout.
constexpr absl::Duration kTimeout = absl::Seconds(5);

class ScaleFailureDetectionTest : public ::testing::Test {
 protected:
  void TearDown() override {
    workers_.reset();
    if (coordinator_ > 0) Stop(coordinator_);
  }

  // Polls GetStatus until `until`; returns the first time `silent_rank` is
  // dead (absl::InfiniteFuture() if never) and counts other dead workers.
  absl::Time Watch(absl::Time until, int silent_rank, int* false_dead) {
    while (absl::Now() < until) {
      absl::StatusOr<v1::GetStatusResponse> status = client_->GetStatus();
      EXPECT_TRUE(status.ok()) << status.status();
      if (status.ok()) {
        EXPECT_EQ(status->workers_size(), kWorkers);
        for (const v1::WorkerInfo& worker : status->workers()) {
          if (worker.alive()) continue;
          if (worker.rank() == silent_rank) return absl::Now();
          ++*false_dead;
        }
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
    return absl::InfiniteFuture();
  }

  pid_t coordinator_ = -1;
  std::unique_ptr<CoordinatorClient> client_;
  std::unique_ptr<SimulatedWorkers> workers_;
};

TEST_F(ScaleFailureDetectionTest, OneSilentWorkerOfTwoThousandIsDeclaredDead) {
  const std::string dir = absl::StrCat(TempDir(), "/scale_fd_", getpid());
  coordinator_ = Spawn(
      {"server/shardd-coordinator", "--listen=127.0.0.1:0",
       absl::StrCat("--data-dir=", dir, "/data"),
       absl::StrCat("--heartbeat-timeout=", absl::FormatDuration(kTimeout))},
      dir + ".out", dir + ".err");
  ASSERT_GT(coordinator_, 0);
  const int port = WaitForPortFile(dir + "/data", coordinator_,
                                   absl::Seconds(30));
  ASSERT_GT(port, 0) << ReadFile(dir + ".err");
  const std::string address = absl::StrCat("127.0.0.1:", port);
  SHARDD_ASSERT_OK_AND_ASSIGN(client_, CoordinatorClient::Connect(address));

  SimulatedWorkers::Options options;
  options.coordinator = address;
  options.workers = kWorkers;
  SHARDD_ASSERT_OK_AND_ASSIGN(workers_, SimulatedWorkers::Create(options));
  SHARDD_ASSERT_OK_AND_ASSIGN(const testing_util::Latencies registered,
                              workers_->RegisterAll());
  EXPECT_EQ(registered.errors, 0);
  // A third of the timeout, in whole milliseconds.
  ASSERT_LE(absl::AbsDuration(workers_->heartbeat_interval() - kTimeout / 3),
            absl::Milliseconds(1));
  workers_->StartHeartbeats(workers_->heartbeat_interval());

  // A whole timeout of beating: nobody dies.
  int false_dead = 0;
  EXPECT_EQ(Watch(absl::Now() + kTimeout + absl::Seconds(1), -1, &false_dead),
            absl::InfiniteFuture());
  EXPECT_EQ(false_dead, 0);

  const int silent_rank = workers_->rank(kSilent);
  const absl::Time silenced = absl::Now();
  workers_->Silence(kSilent);
  // Its last beat was at most now: dead by then + the timeout, seen by the
  // next poll (100 ms) after that.
  const absl::Time dead = Watch(silenced + kTimeout + absl::Seconds(2),
                                silent_rank, &false_dead);
  ASSERT_NE(dead, absl::InfiniteFuture()) << "rank " << silent_rank
                                          << " never declared dead";
  const double after = absl::ToDoubleSeconds(dead - silenced);
  EXPECT_LE(after, absl::ToDoubleSeconds(kTimeout) + 0.5);
  std::printf("[failure detection] %d workers: rank %d declared dead %.2f s "
              "after it went silent (timeout %s)\n",
              kWorkers, silent_rank, after,
              absl::FormatDuration(kTimeout).c_str());
  // And the others keep living.
  Watch(absl::Now() + absl::Seconds(3), silent_rank, &false_dead);
  EXPECT_EQ(false_dead, 0);

  const testing_util::Latencies beats = workers_->StopHeartbeats();
  EXPECT_EQ(beats.errors, 0) << beats.first_error;
  EXPECT_GT(beats.calls, kWorkers * 3);
  std::printf("[failure detection] %lld heartbeats, p50 %.2f ms, p99 %.2f ms\n",
              static_cast<long long>(beats.calls), beats.p50 * 1e3,
              beats.p99 * 1e3);
}

}  // namespace
}  // namespace shardd
