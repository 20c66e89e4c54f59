#include "server/worker_registry.h"

#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardd {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

class WorkerRegistryTest : public ::testing::Test {
 protected:
  WorkerRegistryOptions Options(int max_workers = 0) {
    WorkerRegistryOptions options;
    options.max_workers = max_workers;
    options.heartbeat_timeout = absl::Seconds(10);
    options.clock = [this] { return now_; };
    return options;
  }

  static WorkerRegistration Worker(int port, uint64_t incarnation,
                                   int requested_rank = -1) {
    WorkerRegistration worker;
    worker.address = absl::StrCat("127.0.0.1:", port);
    worker.incarnation = incarnation;
    worker.device = "cpu";
    worker.hostname = "host";
    worker.requested_rank = requested_rank;
    return worker;
  }

  void Advance(absl::Duration d) { now_ += d; }

  absl::Time now_ = absl::FromUnixSeconds(1000000);
};

TEST_F(WorkerRegistryTest, AssignsLowestFreeRanksInJoinOrder) {
  WorkerRegistry registry(Options());
  for (int i = 0; i < 3; ++i) {
    SHARDD_ASSERT_OK_AND_ASSIGN(RegisterResult r,
                                registry.Register(Worker(5000 + i, 100 + i)));
    EXPECT_EQ(r.rank, i);
    EXPECT_EQ(r.world_size, i + 1);  // No limit: the live workers.
    EXPECT_EQ(r.membership_epoch, static_cast<uint64_t>(i + 1));
    EXPECT_FALSE(r.retry);
  }
  // Removing rank 1 frees it; the next newcomer fills the hole first.
  SHARDD_ASSERT_OK(registry.Remove(1));
  EXPECT_EQ(registry.membership_epoch(), 4u);
  SHARDD_ASSERT_OK_AND_ASSIGN(RegisterResult r,
                              registry.Register(Worker(6000, 7)));
  EXPECT_EQ(r.rank, 1);
  EXPECT_EQ(r.membership_epoch, 5u);
  EXPECT_THAT(registry.Remove(9),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("rank 9")));
}

TEST_F(WorkerRegistryTest, RequestedRankIsHonouredWhenFree) {
  WorkerRegistry registry(Options(4));
  SHARDD_ASSERT_OK_AND_ASSIGN(RegisterResult a,
                              registry.Register(Worker(5000, 1, 2)));
  EXPECT_EQ(a.rank, 2);
  EXPECT_EQ(a.world_size, 4);  // The --workers limit.
  // Rank 2 is taken by a live worker: the lowest free rank instead.
  SHARDD_ASSERT_OK_AND_ASSIGN(RegisterResult b,
                              registry.Register(Worker(5001, 2, 2)));
  EXPECT_EQ(b.rank, 0);
  EXPECT_THAT(registry.Register(Worker(5002, 3, 4)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("requested_rank"), HasSubstr("0..3"))));
  EXPECT_THAT(registry.Register(Worker(5002, 3, -2)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("requested_rank")));
}

TEST_F(WorkerRegistryTest, RejectsMissingAddressAndIncarnation) {
  WorkerRegistry registry(Options());
  WorkerRegistration no_address = Worker(5000, 1);
  no_address.address.clear();
  EXPECT_THAT(
      registry.Register(no_address),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("address")));
  EXPECT_THAT(
      registry.Register(Worker(5000, 0)),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("incarnation")));
  WorkerRegistration long_device = Worker(5000, 1);
  long_device.device = std::string(WorkerRegistry::kMaxFieldBytes + 1, 'x');
  EXPECT_THAT(
      registry.Register(long_device),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("device")));
  EXPECT_EQ(registry.membership_epoch(), 0u);
}

TEST_F(WorkerRegistryTest, SameIncarnationIsAnIdempotentRetry) {
  WorkerRegistry registry(Options());
  SHARDD_ASSERT_OK_AND_ASSIGN(RegisterResult first,
                              registry.Register(Worker(5000, 42)));
  SHARDD_ASSERT_OK_AND_ASSIGN(RegisterResult again,
                              registry.Register(Worker(5000, 42, 7)));
  EXPECT_EQ(again.rank, first.rank);
  EXPECT_TRUE(again.retry);
  EXPECT_EQ(again.membership_epoch, first.membership_epoch);
  EXPECT_EQ(registry.List().size(), 1u);
}

TEST_F(WorkerRegistryTest, RestartTakesTheOldRankBackAndBumpsTheEpoch) {
  WorkerRegistry registry(Options());
  SHARDD_ASSERT_OK(registry.Register(Worker(5000, 1)).status());
  SHARDD_ASSERT_OK(registry.Register(Worker(5001, 2)).status());
  SHARDD_ASSERT_OK(registry.Register(Worker(5002, 3)).status());
  const uint64_t before = registry.membership_epoch();
  // The process on port 5001 restarted with a fresh incarnation.
  SHARDD_ASSERT_OK_AND_ASSIGN(RegisterResult r,
                              registry.Register(Worker(5001, 99)));
  EXPECT_EQ(r.rank, 1);
  EXPECT_FALSE(r.retry);
  EXPECT_EQ(r.membership_epoch, before + 1);
  // The old incarnation is told to re-register; the new one heartbeats.
  EXPECT_THAT(
      registry.Heartbeat(1, 2),
      StatusIs(absl::StatusCode::kAborted,
               AllOf(HasSubstr("incarnation"), HasSubstr("register again"))));
  SHARDD_EXPECT_OK(registry.Heartbeat(1, 99).status());
  EXPECT_EQ(registry.List().size(), 3u);
}

TEST_F(WorkerRegistryTest, HeartbeatErrors) {
  WorkerRegistry registry(Options());
  EXPECT_THAT(registry.Heartbeat(0, 1),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(HasSubstr("rank 0"), HasSubstr("register"))));
  SHARDD_ASSERT_OK(registry.Register(Worker(5000, 1)).status());
  SHARDD_ASSERT_OK_AND_ASSIGN(uint64_t epoch, registry.Heartbeat(0, 1));
  EXPECT_EQ(epoch, 1u);
  EXPECT_THAT(registry.Heartbeat(0, 2),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("incarnation")));
}

TEST_F(WorkerRegistryTest, WorkerDiesExactlyAtTheTimeoutAndHeartbeatsDelayIt) {
  WorkerRegistry registry(Options());
  SHARDD_ASSERT_OK(registry.Register(Worker(5000, 1)).status());
  SHARDD_ASSERT_OK(registry.Register(Worker(5001, 2)).status());
  EXPECT_EQ(registry.membership_epoch(), 2u);
  // Rank 0 heartbeats at 9 s; rank 1 stays silent.
  Advance(absl::Seconds(9));
  SHARDD_ASSERT_OK(registry.Heartbeat(0, 1).status());
  Advance(absl::Seconds(1) - absl::Milliseconds(1));
  EXPECT_EQ(registry.live_workers(), 2);  // 9.999 s < 10 s.
  EXPECT_EQ(registry.declared_dead(), 0);
  Advance(absl::Milliseconds(1));
  // Rank 1: 10 s since registration -> dead; rank 0: 1 s since heartbeat.
  std::vector<WorkerState> workers = registry.List();
  ASSERT_EQ(workers.size(), 2u);
  EXPECT_TRUE(workers[0].alive);
  EXPECT_FALSE(workers[1].alive);
  EXPECT_EQ(workers[1].last_heartbeat, now_ - absl::Seconds(10));
  EXPECT_EQ(registry.membership_epoch(), 3u);  // One bump for the death.
  EXPECT_EQ(registry.membership_epoch(), 3u);  // Noticed only once.
  EXPECT_EQ(registry.declared_dead(), 1);      // Counted only once.
  // The dead worker's heartbeat is refused: it must register again.
  EXPECT_THAT(registry.Heartbeat(1, 2),
              StatusIs(absl::StatusCode::kAborted,
                       AllOf(HasSubstr("dead"), HasSubstr("register again"))));
  // Re-registering with the same incarnation revives it on the same rank.
  SHARDD_ASSERT_OK_AND_ASSIGN(RegisterResult r,
                              registry.Register(Worker(5001, 2)));
  EXPECT_EQ(r.rank, 1);
  EXPECT_FALSE(r.retry);
  EXPECT_EQ(r.membership_epoch, 4u);
  EXPECT_EQ(registry.live_workers(), 2);
}

TEST_F(WorkerRegistryTest, RelayIsTheGroupsFirstRankWhileItLives) {
  WorkerRegistryOptions options = Options();
  options.heartbeat_relay_group = 4;
  WorkerRegistry registry(options);
  for (int i = 0; i < 6; ++i) {
    SHARDD_ASSERT_OK(registry.Register(Worker(9000 + i, 100 + i, i)).status());
  }
  EXPECT_EQ(registry.RelayFor(0), std::nullopt);  // Rank 0 is the relay.
  EXPECT_EQ(registry.RelayFor(3), std::make_optional(std::make_pair(
                                      0, std::string("127.0.0.1:9000"))));
  EXPECT_EQ(registry.RelayFor(4), std::nullopt);
  EXPECT_EQ(registry.RelayFor(5), std::make_optional(std::make_pair(
                                      4, std::string("127.0.0.1:9004"))));
  EXPECT_EQ(registry.RelayFor(-1), std::nullopt);
  // Rank 4 dies (only the others beat): its group beats directly.
  Advance(absl::Seconds(6));
  for (int r : {0, 1, 2, 3, 5}) {
    SHARDD_ASSERT_OK(registry.Heartbeat(r, 100 + r).status());
  }
  Advance(absl::Seconds(5));
  EXPECT_EQ(registry.RelayFor(5), std::nullopt);
  EXPECT_EQ(registry.RelayFor(1), std::make_optional(std::make_pair(
                                      0, std::string("127.0.0.1:9000"))));
  // A group of one: no relays.
  WorkerRegistry direct(Options());
  SHARDD_ASSERT_OK(direct.Register(Worker(9000, 1, 0)).status());
  SHARDD_ASSERT_OK(direct.Register(Worker(9001, 2, 1)).status());
  EXPECT_EQ(direct.RelayFor(1), std::nullopt);
}

TEST_F(WorkerRegistryTest, NewcomerTakesOverADeadWorkersRank) {
  WorkerRegistry registry(Options(2));
  SHARDD_ASSERT_OK(registry.Register(Worker(5000, 1)).status());
  SHARDD_ASSERT_OK(registry.Register(Worker(5001, 2)).status());
  EXPECT_THAT(registry.Register(Worker(5002, 3)),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("2 ranks"), HasSubstr("--workers"))));
  Advance(absl::Seconds(6));
  SHARDD_ASSERT_OK(registry.Heartbeat(1, 2).status());
  Advance(absl::Seconds(5));  // Rank 0 silent for 11 s: dead.
  SHARDD_ASSERT_OK_AND_ASSIGN(RegisterResult r,
                              registry.Register(Worker(5002, 3)));
  EXPECT_EQ(r.rank, 0);
  std::vector<WorkerState> workers = registry.List();
  ASSERT_EQ(workers.size(), 2u);
  EXPECT_EQ(workers[0].address, "127.0.0.1:5002");
  EXPECT_TRUE(workers[0].alive);
  // The replaced worker is unknown now.
  EXPECT_THAT(registry.Heartbeat(0, 1),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("incarnation")));
}

TEST_F(WorkerRegistryTest, CapacityIsEnforcedOnlyWhenSet) {
  WorkerRegistry limited(Options(3));
  for (int i = 0; i < 3; ++i) {
    SHARDD_ASSERT_OK(limited.Register(Worker(5000 + i, 1 + i)).status());
  }
  EXPECT_THAT(limited.Register(Worker(6000, 9)),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("3")));
  // A retry of a member still succeeds when full.
  SHARDD_EXPECT_OK(limited.Register(Worker(5001, 2)).status());

  WorkerRegistry unlimited(Options(0));
  for (int i = 0; i < 50; ++i) {
    SHARDD_ASSERT_OK_AND_ASSIGN(RegisterResult r,
                                unlimited.Register(Worker(5000 + i, 1 + i)));
    EXPECT_EQ(r.rank, i);
  }
}

TEST_F(WorkerRegistryTest, RanksAliveCheckNamesMissingAndDeadRanks) {
  WorkerRegistry registry(Options());
  EXPECT_THAT(
      registry.CheckRanksAlive(0),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("world_size")));
  EXPECT_THAT(registry.CheckRanksAlive(2),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("ranks 0-1 have not registered")));
  // Ranks 0, 1, 2, 4 registered (4 requested); 3 and 5 missing.
  for (int i = 0; i < 3; ++i) {
    SHARDD_ASSERT_OK(registry.Register(Worker(5000 + i, 1 + i)).status());
  }
  SHARDD_ASSERT_OK(registry.Register(Worker(5004, 5, 4)).status());
  SHARDD_EXPECT_OK(registry.CheckRanksAlive(3));
  // Everyone but rank 1 heartbeats past the timeout.
  Advance(absl::Seconds(8));
  for (int rank : {0, 2}) {
    SHARDD_ASSERT_OK(registry.Heartbeat(rank, rank + 1).status());
  }
  SHARDD_ASSERT_OK(registry.Heartbeat(4, 5).status());
  Advance(absl::Seconds(4));
  const absl::Status status = registry.CheckRanksAlive(6);
  EXPECT_THAT(
      status,
      StatusIs(absl::StatusCode::kFailedPrecondition,
               AllOf(HasSubstr("ranks 0-5"),
                     HasSubstr("ranks 3, 5 have not registered"),
                     HasSubstr("rank 1 is dead"), HasSubstr("127.0.0.1:5001"),
                     HasSubstr("last heartbeat 12s ago"))));
  // A world that excludes the bad ranks is fine.
  EXPECT_THAT(registry.CheckRanksAlive(1), IsOk());
  EXPECT_THAT(registry.CheckRanksAlive(2), Not(IsOk()));
}

TEST(FormatRankListTest, FoldsRuns) {
  EXPECT_EQ(FormatRankList({}), "");
  EXPECT_EQ(FormatRankList({4}), "4");
  EXPECT_EQ(FormatRankList({0, 1, 2, 3, 5, 7, 8}), "0-3, 5, 7-8");
}

// The liveness index against the rule it implements: random registrations,
// restarts, heartbeats, removals and clock steps, checked after each against
// "alive iff registered and its last heartbeat is under the timeout old"
// (deaths are final until a registration), computed by brute force.
TEST_F(WorkerRegistryTest, LivenessMatchesTheRuleUnderRandomTraffic) {
  WorkerRegistry registry(Options());
  std::mt19937 rng(17);
  constexpr int kAddresses = 40;
  struct Model {
    bool registered = false;
    bool alive = false;
    int rank = -1;
    uint64_t incarnation = 0;
    absl::Time last;
  };
  std::vector<Model> model(kAddresses);
  int64_t deaths = 0;
  for (int op = 0; op < 4000; ++op) {
    const int a = static_cast<int>(rng() % kAddresses);
    Model& m = model[a];
    switch (rng() % 5) {
      case 0: {  // Register (same incarnation) or restart (a new one).
        const uint64_t incarnation =
            m.registered && rng() % 2 == 0 ? m.incarnation : 1000 + op;
        absl::StatusOr<RegisterResult> r =
            registry.Register(Worker(7000 + a, incarnation));
        if (!r.ok()) break;
        for (Model& other : model) {
          // A dead worker's rank may go to the newcomer.
          if (&other != &m && other.registered && other.rank == r->rank) {
            other.registered = false;
          }
        }
        m = {true, true, r->rank, incarnation, now_};
        break;
      }
      case 1:
      case 2:  // Heartbeat.
        if (m.registered && registry.Heartbeat(m.rank, m.incarnation).ok()) {
          ASSERT_TRUE(m.alive) << "a dead worker's heartbeat was accepted";
          m.last = now_;
        }
        break;
      case 3:  // Time passes.
        Advance(absl::Milliseconds(rng() % 4000));
        break;
      case 4:  // Removal.
        if (m.registered && rng() % 4 == 0 && registry.Remove(m.rank).ok()) {
          m.registered = false;
        }
        break;
    }
    // The rule, by brute force; deaths once seen stay.
    for (Model& other : model) {
      if (other.registered && other.alive &&
          now_ - other.last >= absl::Seconds(10)) {
        other.alive = false;
        ++deaths;
      }
    }
    std::map<int, bool> want;
    for (const Model& other : model) {
      if (other.registered) want[other.rank] = other.alive;
    }
    std::map<int, bool> got;
    for (const WorkerState& w : registry.List()) got[w.rank] = w.alive;
    ASSERT_EQ(got, want) << "after operation " << op;
  }
  EXPECT_GT(deaths, 50);
}

}  // namespace
}  // namespace shardd
