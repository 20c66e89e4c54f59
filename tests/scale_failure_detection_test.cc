// Failure detection at scale: a real shardd-coordinator with 2048 simulated
// workers (testing/simulated_workers.h) heartbeating at the interval it
// hands out. One worker goes silent: it must be declared dead within the
// heartbeat timeout, and no worker that keeps beating may be (no false
// positives), before or after. And a job over 2048 simulated workers
// (testing/simulated_worker_service.h answers its calls) fails, naming the
// rank, when one of them crashes, as a job over 4 real workers does.
// Loopback only; every wait is bounded.

#include <unistd.h>

#include <memory>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/coordinator_client.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/simulated_worker_service.h"
#include "testing/simulated_workers.h"
#include "tests/subprocess.h"

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
  // Ranks in `known_dead` are not counted.
  absl::Time Watch(absl::Time until, int silent_rank, int* false_dead,
                   const std::set<int>& known_dead = {}) {
    while (absl::Now() < until) {
      absl::StatusOr<v1::GetStatusResponse> status = client_->GetStatus();
      EXPECT_TRUE(status.ok()) << status.status();
      if (status.ok()) {
        EXPECT_EQ(status->workers_size(), kWorkers);
        for (const v1::WorkerInfo& worker : status->workers()) {
          if (worker.alive()) continue;
          if (worker.rank() == silent_rank) return absl::Now();
          if (known_dead.count(worker.rank()) > 0) continue;
          ++*false_dead;
        }
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
    return absl::InfiniteFuture();
  }

  // Starts the coordinator; its address.
  std::string StartCoordinator(const std::string& name, int relay_group = 1) {
    const std::string dir =
        absl::StrCat(TempDir(), "/scale_", name, "_", getpid());
    coordinator_ = Spawn(
        {"server/shardd-coordinator", "--listen=127.0.0.1:0",
         absl::StrCat("--data-dir=", dir, "/data"),
         absl::StrCat("--heartbeat-timeout=", absl::FormatDuration(kTimeout)),
         absl::StrCat("--heartbeat-relay-group=", relay_group)},
        dir + ".out", dir + ".err");
    EXPECT_GT(coordinator_, 0);
    const int port =
        WaitForPortFile(dir + "/data", coordinator_, absl::Seconds(30));
    EXPECT_GT(port, 0) << ReadFile(dir + ".err");
    if (port <= 0) return "";
    const std::string address = absl::StrCat("127.0.0.1:", port);
    absl::StatusOr<std::unique_ptr<CoordinatorClient>> client =
        CoordinatorClient::Connect(address);
    EXPECT_TRUE(client.ok()) << client.status();
    if (client.ok()) client_ = *std::move(client);
    return address;
  }

  // kWorkers simulated workers of `address`, registering `service`'s
  // addresses.
  static SimulatedWorkers::Options Workers(
      const std::string& address, testing_util::SimulatedWorkerService* service) {
    SimulatedWorkers::Options options;
    options.coordinator = address;
    options.workers = kWorkers;
    for (int i = 0; i < kWorkers; ++i) {
      options.addresses.push_back(service->address(i));
    }
    return options;
  }

  pid_t coordinator_ = -1;
  std::unique_ptr<CoordinatorClient> client_;
  std::unique_ptr<SimulatedWorkers> workers_;
};

TEST_F(ScaleFailureDetectionTest, OneSilentWorkerOfTwoThousandIsDeclaredDead) {
  const std::string address = StartCoordinator("fd");
  ASSERT_FALSE(address.empty());

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
  const absl::Time dead =
      Watch(silenced + kTimeout + absl::Seconds(2), silent_rank, &false_dead);
  ASSERT_NE(dead, absl::InfiniteFuture())
      << "rank " << silent_rank << " never declared dead";
  const double after = absl::ToDoubleSeconds(dead - silenced);
  EXPECT_LE(after, absl::ToDoubleSeconds(kTimeout) + 0.5);
  std::printf(
      "[failure detection] %d workers: rank %d declared dead %.2f s "
      "after it went silent (timeout %s)\n",
      kWorkers, silent_rank, after, absl::FormatDuration(kTimeout).c_str());
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

// The same with relay groups of 8 (--heartbeat-relay-group): the workers
// beat through their group's first rank (SimulatedWorkers follows the
// relays as CoordinatorAgent does, through the real HeartbeatRelay behind
// each simulated Worker service). A silent member is declared dead one
// relay interval later at most; a silent relay is declared dead within the
// timeout, and its group, turned away by its stale relay, beats the
// coordinator directly without one false positive.
TEST_F(ScaleFailureDetectionTest, SilentMemberAndSilentRelayOfRelayGroups) {
  constexpr int kGroup = 8;
  constexpr int kSilentRelay = 1024;  // Ranks 1025-1031 beat through it.
  const std::string address = StartCoordinator("relay", kGroup);
  ASSERT_FALSE(address.empty());
  SHARDD_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<testing_util::SimulatedWorkerService> service,
      testing_util::SimulatedWorkerService::Start(kWorkers));
  SimulatedWorkers::Options options = Workers(address, service.get());
  options.service = service.get();
  SHARDD_ASSERT_OK_AND_ASSIGN(workers_, SimulatedWorkers::Create(options));
  SHARDD_ASSERT_OK(workers_->RegisterAll().status());
  ASSERT_EQ(workers_->rank(kSilent), kSilent);
  ASSERT_EQ(workers_->rank(kSilentRelay), kSilentRelay);
  const absl::Duration interval = workers_->heartbeat_interval();
  workers_->StartHeartbeats(interval);
  auto relayed = [&] {
    int64_t n = 0;
    for (int i = 0; i < kWorkers; i += kGroup)
      n += service->relay(i)->relayed();
    return n;
  };

  int false_dead = 0;
  EXPECT_EQ(Watch(absl::Now() + kTimeout + absl::Seconds(1), -1, &false_dead),
            absl::InfiniteFuture());
  EXPECT_EQ(false_dead, 0);
  // Seven of every eight workers' beats went through relays: after the
  // first, direct round, about 7/8 of 2048 per interval.
  const int64_t relayed_before = relayed();
  EXPECT_GT(relayed_before, kWorkers / 2);

  // A member: its last beat reaches the coordinator with its relay's next
  // heartbeat, up to one interval later.
  absl::Time silenced = absl::Now();
  workers_->Silence(kSilent);
  absl::Time dead = Watch(silenced + kTimeout + interval + absl::Seconds(2),
                          kSilent, &false_dead);
  ASSERT_NE(dead, absl::InfiniteFuture()) << "member never declared dead";
  const double member_after = absl::ToDoubleSeconds(dead - silenced);
  EXPECT_LE(member_after, absl::ToDoubleSeconds(kTimeout + interval) + 0.5);
  EXPECT_EQ(false_dead, 0);

  // A relay: declared dead within the timeout; its members keep living.
  silenced = absl::Now();
  workers_->Silence(kSilentRelay);
  dead = Watch(silenced + kTimeout + absl::Seconds(2), kSilentRelay,
               &false_dead, {kSilent});
  ASSERT_NE(dead, absl::InfiniteFuture()) << "relay never declared dead";
  const double relay_after = absl::ToDoubleSeconds(dead - silenced);
  EXPECT_LE(relay_after, absl::ToDoubleSeconds(kTimeout) + 0.5);
  // Its members, turned away, beat directly: none dies in the next two
  // timeouts.
  Watch(absl::Now() + 2 * kTimeout, -1, &false_dead, {kSilent, kSilentRelay});
  EXPECT_EQ(false_dead, 0);
  std::printf(
      "[failure detection, relay groups of %d] member declared dead %.2f s "
      "after it went silent, relay %.2f s (timeout %s, interval %s); %lld "
      "beats relayed\n",
      kGroup, member_after, relay_after, absl::FormatDuration(kTimeout).c_str(),
      absl::FormatDuration(interval).c_str(),
      static_cast<long long>(relayed()));
  const testing_util::Latencies beats = workers_->StopHeartbeats();
  EXPECT_EQ(beats.errors, 0) << beats.first_error;
}

// A job over 2048 simulated workers: each gets a LoadPlan of the plan's
// options (a few kilobytes, not the 2048-rank plan), the steps run, and when
// one worker crashes (no more heartbeats, every call UNAVAILABLE) the job
// fails naming its rank, with recoveries off, as at 4 workers.
TEST_F(ScaleFailureDetectionTest,
       AJobOverTwoThousandWorkersFailsNamingTheCrashedRank) {
  const std::string address = StartCoordinator("job");
  ASSERT_FALSE(address.empty());
  SHARDD_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<testing_util::SimulatedWorkerService> service,
      testing_util::SimulatedWorkerService::Start(kWorkers));
  SimulatedWorkers::Options options = Workers(address, service.get());
  SHARDD_ASSERT_OK_AND_ASSIGN(workers_, SimulatedWorkers::Create(options));
  SHARDD_ASSERT_OK(workers_->RegisterAll().status());
  workers_->StartHeartbeats(workers_->heartbeat_interval());

  v1::SubmitModelRequest model;
  model.set_native_spec_json(ReadFile("tests/data/tiny_moe.json"));
  model.mutable_options()->mutable_mesh()->set_dp_shard(kWorkers);
  model.mutable_options()->mutable_mesh()->set_dp_replicate(1);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::SubmitModelResponse submitted,
                              client_->SubmitModel(model));
  v1::SubmitStepRequest step;
  step.set_model_id(submitted.model_id());
  step.mutable_config()->set_steps(1000000);
  step.mutable_config()->set_global_batch(kWorkers);
  step.mutable_config()->set_seq_len(16);
  step.mutable_config()->set_max_recoveries(-1);
  const absl::Time submitted_at = absl::Now();
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::SubmitStepResponse job,
                              client_->SubmitStep(step));
  EXPECT_EQ(job.world_size(), kWorkers);

  absl::Time first_step = absl::InfiniteFuture();
  absl::Time crashed = absl::InfiniteFuture();
  std::string error;
  v1::WatchStepRequest watch;
  watch.set_job_id(job.job_id());
  const int crash_rank = workers_->rank(kSilent);
  const absl::Status watched = client_->WatchStep(
      watch, absl::Seconds(60), [&](const v1::StepEvent& event) {
        if (!event.error().empty()) {
          error = event.error();
          return true;
        }
        if (event.step() == 1) first_step = absl::Now();
        if (event.step() == 3 && crashed == absl::InfiniteFuture()) {
          crashed = absl::Now();
          workers_->Silence(kSilent);
          service->Crash(kSilent);
        }
        return true;
      });
  EXPECT_TRUE(watched.ok()) << watched;
  const absl::Time failed = absl::Now();
  EXPECT_THAT(
      error,
      ::testing::AllOf(::testing::HasSubstr(absl::StrCat("rank ", crash_rank)),
                       ::testing::HasSubstr(service->address(kSilent))));
  // The next step's call fails at once (UNAVAILABLE); the job fails then.
  EXPECT_LE(failed - crashed, kTimeout + absl::Seconds(2));
  const testing_util::SimulatedWorkerService::Received received =
      service->received();
  EXPECT_EQ(received.load_plans, kWorkers);
  EXPECT_EQ(received.plans_sent, 0);
  EXPECT_LT(received.largest_load_plan, 64 * 1024);
  std::printf(
      "[job at scale] %d workers: first step %.2f s after SubmitStep; "
      "LoadPlan %lld B each at most (%lld B in all); failed %.2f s "
      "after rank %d crashed: %s\n",
      kWorkers, absl::ToDoubleSeconds(first_step - submitted_at),
      static_cast<long long>(received.largest_load_plan),
      static_cast<long long>(received.load_plan_bytes),
      absl::ToDoubleSeconds(failed - crashed), crash_rank, error.c_str());
  workers_->StopHeartbeats();
}

}  // namespace
}  // namespace shardd
