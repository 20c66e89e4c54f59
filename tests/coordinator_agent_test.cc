#include "worker/grpc/coordinator_agent.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "grpc/grpc.h"
#include "gtest/gtest.h"
#include "planner/strategy_registry.h"
#include "server/coordinator_server.h"
#include "server/coordinator_service.h"
#include "testing/simulated_worker_service.h"
#include "worker/grpc/heartbeat_relay.h"

namespace shardd {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// Short enough for quick tests, long enough that a loaded 2-core machine
// does not miss three heartbeats (one every 166 ms) in a row.
constexpr absl::Duration kHeartbeatTimeout = absl::Milliseconds(500);

// Polls `done` every 5 ms until it holds or `limit` passes.
bool WaitFor(const std::function<bool()>& done, absl::Duration limit) {
  const absl::Time end = absl::Now() + limit;
  while (!done()) {
    if (absl::Now() > end) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

// A port nothing listens on (bound, then released).
int UnusedPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

// One coordinator (service + server) in this process.
struct Coordinator {
  std::unique_ptr<CoordinatorService> service;
  std::unique_ptr<CoordinatorServer> server;

  void Stop() {
    if (server != nullptr) server->Shutdown(absl::Seconds(1));
    server.reset();
    service.reset();
  }
};

class CoordinatorAgentTest : public ::testing::Test {
 protected:
  // One gRPC library reference for the whole test (see the integration
  // test: dropping the last one per test can stall teardown).
  static void SetUpTestSuite() { grpc_init(); }

  void SetUp() override { registry_ = StrategyRegistry::CreateWithBuiltins(); }

  void TearDown() override {
    agents_.clear();
    coordinator_.Stop();
  }

  // Starts a coordinator on `address` (port 0: any).
  void StartCoordinator(const std::string& address, int max_workers = 0,
                        uint64_t incarnation = 0, int relay_group = 1,
                        absl::Duration timeout = kHeartbeatTimeout) {
    CoordinatorServiceOptions options;
    options.heartbeat_timeout = timeout;
    options.heartbeat_relay_group = relay_group;
    options.max_workers = max_workers;
    options.incarnation = incarnation;
    coordinator_.service =
        std::make_unique<CoordinatorService>(registry_.get(), options);
    CoordinatorServerOptions server_options;
    server_options.listen_address = address;
    absl::StatusOr<std::unique_ptr<CoordinatorServer>> server =
        CoordinatorServer::Start(server_options, coordinator_.service.get());
    ASSERT_THAT(server, IsOk());
    coordinator_.server = *std::move(server);
  }

  CoordinatorAgentOptions AgentOptions(int worker_port) {
    CoordinatorAgentOptions options;
    options.coordinator = coordinator_.server->address();
    options.address = absl::StrCat("127.0.0.1:", worker_port);
    options.connect_timeout = absl::Seconds(5);
    options.rpc_timeout = absl::Seconds(2);
    options.wait_margin = absl::Milliseconds(500);
    options.max_backoff = absl::Milliseconds(200);
    return options;
  }

  v1::GetStatusResponse Status() {
    absl::StatusOr<v1::GetStatusResponse> status =
        coordinator_.service->GetStatus({});
    EXPECT_THAT(status, IsOk());
    return status.ok() ? *status : v1::GetStatusResponse();
  }

  std::unique_ptr<StrategyRegistry> registry_;
  Coordinator coordinator_;
  std::vector<std::unique_ptr<CoordinatorAgent>> agents_;
};

TEST_F(CoordinatorAgentTest, AgentsRendezvousThenAStoppedOneIsReportedDead) {
  StartCoordinator("127.0.0.1:0");
  constexpr int kWorkers = 4;
  agents_.resize(kWorkers);
  std::vector<absl::Status> results(kWorkers);
  std::vector<std::string> seen(kWorkers);
  std::vector<std::thread> threads;
  for (int i = 0; i < kWorkers; ++i) {
    threads.emplace_back([&, i] {
      absl::StatusOr<std::unique_ptr<CoordinatorAgent>> agent =
          CoordinatorAgent::Start(AgentOptions(20000 + i));
      if (!agent.ok()) {
        results[i] = agent.status();
        return;
      }
      CoordinatorAgent* a = agent->get();
      agents_[i] = *std::move(agent);
      const int rank = a->rank();
      // Publish this rank's value, then read every other rank's, waiting
      // for those not yet published.
      absl::Status status = a->Set(absl::StrCat("addr/", rank),
                                   absl::StrCat("worker-", 20000 + i));
      for (int r = 0; status.ok() && r < kWorkers; ++r) {
        absl::StatusOr<std::string> value =
            a->Get(absl::StrCat("addr/", r), absl::Seconds(5));
        if (!value.ok()) {
          status = value.status();
        } else {
          absl::StrAppend(&seen[i], *value, ";");
        }
      }
      if (status.ok()) status = a->Barrier("ready", kWorkers, absl::Seconds(5));
      results[i] = status;
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kWorkers; ++i) {
    ASSERT_THAT(results[i], IsOk()) << i;
  }

  // Distinct ranks 0..3, and every worker read every rank's value.
  std::set<int> ranks;
  std::vector<int> port_of_rank(kWorkers);
  for (int i = 0; i < kWorkers; ++i) {
    ranks.insert(agents_[i]->rank());
    port_of_rank[agents_[i]->rank()] = 20000 + i;
    EXPECT_EQ(agents_[i]->registrations(), 1);
    EXPECT_NE(agents_[i]->incarnation(), 0u);
  }
  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2, 3}));
  std::string expected;
  for (int r = 0; r < kWorkers; ++r) {
    absl::StrAppend(&expected, "worker-", port_of_rank[r], ";");
  }
  for (int i = 0; i < kWorkers; ++i) EXPECT_EQ(seen[i], expected) << i;
  EXPECT_EQ(agents_[0]->registration().heartbeat_interval,
            absl::Milliseconds(166));  // 500 ms / 3, truncated to ms.
  SHARDD_EXPECT_OK(coordinator_.service->CheckWorkersReady(kWorkers));

  // Two heartbeat timeouts later everyone is still alive (heartbeats work).
  absl::SleepFor(2 * kHeartbeatTimeout);
  SHARDD_EXPECT_OK(coordinator_.service->CheckWorkersReady(kWorkers));

  // The agent holding rank 2 stops heartbeating.
  CoordinatorAgent* victim = nullptr;
  for (auto& agent : agents_) {
    if (agent->rank() == 2) victim = agent.get();
  }
  ASSERT_NE(victim, nullptr);
  const absl::Time stopped_at = absl::Now();
  victim->Stop();
  EXPECT_TRUE(WaitFor(
      [&] {
        v1::GetStatusResponse status = Status();
        return status.workers_size() == kWorkers && !status.workers(2).alive();
      },
      absl::Seconds(5)));
  const absl::Duration detection = absl::Now() - stopped_at;
  // Dead no earlier than its last heartbeat + timeout (>= timeout minus one
  // period after Stop), and promptly after that.
  EXPECT_GE(detection, kHeartbeatTimeout - absl::Milliseconds(170));
  EXPECT_LT(detection, kHeartbeatTimeout + absl::Seconds(2));
  v1::GetStatusResponse status = Status();
  ASSERT_EQ(status.workers_size(), kWorkers);
  for (int r : {0, 1, 3}) EXPECT_TRUE(status.workers(r).alive()) << r;
  EXPECT_EQ(status.workers(2).address(),
            absl::StrCat("127.0.0.1:", port_of_rank[2]));
  EXPECT_GE(status.workers(2).last_heartbeat_ms_ago(),
            absl::ToInt64Milliseconds(kHeartbeatTimeout));
  EXPECT_THAT(coordinator_.service->CheckWorkersReady(kWorkers),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("rank 2 is dead"),
                             HasSubstr(status.workers(2).address()))));
  // A stopped agent refuses further calls.
  EXPECT_THAT(
      victim->Set("k", "v"),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("stopped")));
}

TEST_F(CoordinatorAgentTest, HeartbeatsGoThroughTheRelayAndAroundItOnceItStops) {
  // Relay groups of 2: rank 1 beats through rank 0. Rank 0's Worker
  // service is a simulated one holding the real HeartbeatRelay its agent
  // forwards from. A longer timeout than the other tests: a relayed beat
  // reaches the coordinator up to one interval late.
  constexpr absl::Duration kTimeout = absl::Milliseconds(1500);
  StartCoordinator("127.0.0.1:0", /*max_workers=*/0, /*incarnation=*/0,
                   /*relay_group=*/2, kTimeout);
  absl::StatusOr<std::unique_ptr<testing_util::SimulatedWorkerService>>
      service = testing_util::SimulatedWorkerService::Start(1);
  ASSERT_THAT(service, IsOk());
  HeartbeatRelay* relay = (*service)->relay(0);
  CoordinatorAgentOptions first = AgentOptions(0);
  first.address = (*service)->address(0);
  first.requested_rank = 0;
  first.relay = relay;
  SHARDD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CoordinatorAgent> leader,
                              CoordinatorAgent::Start(first));
  // Half an interval apart, so that each of the leader's heartbeats
  // carries one beat of the member: with coinciding phases a beat can land
  // just after a delivery and two share the next one, and the counts below
  // would depend on the scheduler.
  absl::SleepFor(kTimeout / 6);
  HeartbeatRelay own_relay;  // Relays for no one.
  CoordinatorAgentOptions second = AgentOptions(UnusedPort());
  second.requested_rank = 1;
  second.relay = &own_relay;
  SHARDD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CoordinatorAgent> member,
                              CoordinatorAgent::Start(second));
  ASSERT_EQ(leader->rank(), 0);
  ASSERT_EQ(member->rank(), 1);

  // The member's beats go through the leader (after its first, direct one
  // named the relay), and keep it alive past two timeouts.
  EXPECT_TRUE(WaitFor([&] { return relay->relayed() >= 3; }, absl::Seconds(5)));
  absl::SleepFor(2 * kTimeout);
  SHARDD_EXPECT_OK(coordinator_.service->CheckWorkersReady(2));
  const int64_t relayed = relay->relayed();
  // Two timeouts are six intervals: at least four more beats whatever the
  // phases of the two heartbeat loops (one may fall outside at each end).
  EXPECT_GE(relayed, 3 + 4);
  EXPECT_EQ(member->heartbeat_failures(), 0);
  EXPECT_EQ(own_relay.relayed(), 0);

  // The leader's agent stops (its Worker service still answers): its relay
  // turns the member away, which then beats the coordinator directly; the
  // leader is declared dead, the member never is.
  const absl::Time stopped_at = absl::Now();
  leader->Stop();
  bool member_always_alive = true;
  EXPECT_TRUE(WaitFor(
      [&] {
        v1::GetStatusResponse status = Status();
        if (status.workers_size() != 2) return false;
        member_always_alive &= status.workers(1).alive();
        return !status.workers(0).alive();
      },
      absl::Seconds(10)));
  EXPECT_GE(absl::Now() - stopped_at, kTimeout - absl::Milliseconds(510));
  const absl::Time watch_until = absl::Now() + 2 * kTimeout;
  while (absl::Now() < watch_until) {
    v1::GetStatusResponse status = Status();
    ASSERT_EQ(status.workers_size(), 2);
    member_always_alive &= status.workers(1).alive();
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_TRUE(member_always_alive);
  EXPECT_EQ(member->heartbeat_failures(), 0);
  EXPECT_LE(relay->relayed(), relayed + 2);
  EXPECT_EQ(member->registrations(), 1);
}

TEST_F(CoordinatorAgentTest, KeyValueErrorsComeFromTheCoordinator) {
  StartCoordinator("127.0.0.1:0");
  SHARDD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CoordinatorAgent> agent,
                              CoordinatorAgent::Start(AgentOptions(21000)));
  const absl::Time start = absl::Now();
  EXPECT_THAT(
      agent->Get("absent", absl::Milliseconds(50)),
      StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("absent")));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(50));
  // A zero timeout still means "absent -> DEADLINE_EXCEEDED".
  EXPECT_THAT(agent->Get("absent", absl::ZeroDuration()),
              StatusIs(absl::StatusCode::kDeadlineExceeded, ::testing::_));
  SHARDD_ASSERT_OK(agent->Set("p/a", "1"));
  SHARDD_ASSERT_OK(agent->Set("p/a", "2"));  // Set overwrites.
  EXPECT_THAT(agent->Add("p/a", "3"),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("p/a")));
  SHARDD_ASSERT_OK(agent->Add("p/b", "4"));
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string value,
                              agent->Get("p/a", absl::Seconds(1)));
  EXPECT_EQ(value, "2");
  EXPECT_THAT(agent->Set("", "x"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("key")));
  SHARDD_ASSERT_OK(agent->Delete("p/", /*prefix=*/true));
  EXPECT_THAT(agent->Get("p/b", absl::Milliseconds(1)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, ::testing::_));
  EXPECT_THAT(
      agent->Barrier("b", 2, absl::Milliseconds(30)),
      StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("1 of 2")));
}

TEST_F(CoordinatorAgentTest, StopCancelsAWaitingGet) {
  StartCoordinator("127.0.0.1:0");
  SHARDD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CoordinatorAgent> agent,
                              CoordinatorAgent::Start(AgentOptions(21001)));
  absl::Status result;
  absl::Notification finished;
  std::thread waiter([&] {
    result = agent->Get("never", absl::Seconds(30)).status();
    finished.Notify();
  });
  ASSERT_TRUE(WaitFor([&] { return coordinator_.server->waiting_calls() == 1; },
                      absl::Seconds(5)));
  const absl::Time start = absl::Now();
  agent->Stop();
  EXPECT_TRUE(finished.WaitForNotificationWithTimeout(absl::Seconds(5)));
  waiter.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  EXPECT_THAT(result, StatusIs(absl::StatusCode::kCancelled, ::testing::_));
  // The coordinator withdraws the wait once the client has gone.
  EXPECT_TRUE(WaitFor([&] { return coordinator_.server->waiting_calls() == 0; },
                      absl::Seconds(5)));
}

TEST_F(CoordinatorAgentTest,
       ReregistersWithTheSameRanksAfterACoordinatorRestart) {
  StartCoordinator("127.0.0.1:0", /*max_workers=*/0, /*incarnation=*/111);
  const std::string address = coordinator_.server->address();
  // Rank 0 is held by a registration that will not come back, so the agents
  // get ranks 1 and 2; after the restart, "lowest free rank" would give
  // them 0 and 1, and only asking for the old rank keeps 1 and 2.
  v1::RegisterWorkerRequest placeholder;
  placeholder.set_address("127.0.0.1:1");
  placeholder.set_incarnation(1);
  placeholder.set_requested_rank(-1);
  ASSERT_THAT(coordinator_.service->RegisterWorker(placeholder), IsOk());

  absl::Mutex mu;
  int reregistered = 0;
  std::vector<std::unique_ptr<CoordinatorAgent>> agents;
  for (int i = 0; i < 2; ++i) {
    CoordinatorAgentOptions options = AgentOptions(22000 + i);
    options.on_reregistered = [&](const AgentRegistration&) {
      absl::MutexLock lock(&mu);
      ++reregistered;
    };
    SHARDD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CoordinatorAgent> agent,
                                CoordinatorAgent::Start(options));
    EXPECT_EQ(agent->rank(), i + 1);
    agents.push_back(std::move(agent));
  }

  coordinator_.Stop();
  StartCoordinator(address, /*max_workers=*/0, /*incarnation=*/222);
  ASSERT_TRUE(WaitFor(
      [&] {
        v1::GetStatusResponse status = Status();
        // The coordinator sees a registration before the agent has counted
        // its reply, so wait for both sides.
        return status.workers_size() == 2 && status.workers(0).alive() &&
               status.workers(1).alive() && agents[0]->registrations() == 2 &&
               agents[1]->registrations() == 2;
      },
      absl::Seconds(10)));
  v1::GetStatusResponse status = Status();
  EXPECT_EQ(status.workers(0).rank(), 1);
  EXPECT_EQ(status.workers(0).address(), "127.0.0.1:22000");
  EXPECT_EQ(status.workers(1).rank(), 2);
  EXPECT_EQ(status.workers(1).address(), "127.0.0.1:22001");
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(agents[i]->rank(), i + 1);
    EXPECT_EQ(agents[i]->registrations(), 2);
    EXPECT_EQ(agents[i]->registration().coordinator_incarnation, 222u);
  }
  {
    absl::MutexLock lock(&mu);
    EXPECT_EQ(reregistered, 2);
  }
  // The KV store works against the new coordinator too.
  SHARDD_EXPECT_OK(agents[0]->Set("after", "restart"));
  EXPECT_THAT(agents[1]->Get("after", absl::Seconds(1)), IsOk());
  agents.clear();
}

TEST_F(CoordinatorAgentTest, UnreachableCoordinatorFailsWithinTheDeadline) {
  CoordinatorAgentOptions options;
  options.coordinator = absl::StrCat("127.0.0.1:", UnusedPort());
  options.address = "127.0.0.1:1";
  options.connect_timeout = absl::Milliseconds(300);
  options.max_backoff = absl::Milliseconds(50);
  const absl::Time start = absl::Now();
  EXPECT_THAT(CoordinatorAgent::Start(options),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       AllOf(HasSubstr(options.coordinator),
                             HasSubstr("could not register"))));
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
}

TEST_F(CoordinatorAgentTest, RefusedRegistrationFailsAtOnce) {
  StartCoordinator("127.0.0.1:0", /*max_workers=*/1);
  SHARDD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CoordinatorAgent> first,
                              CoordinatorAgent::Start(AgentOptions(23000)));
  // Every rank held: retried (a dead worker's rank frees up once its
  // heartbeat times out) until connect_timeout, naming the cause.
  CoordinatorAgentOptions full = AgentOptions(23001);
  full.connect_timeout = absl::Milliseconds(600);
  full.max_backoff = absl::Milliseconds(50);
  absl::Time start = absl::Now();
  EXPECT_THAT(CoordinatorAgent::Start(full),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       HasSubstr("RESOURCE_EXHAUSTED")));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(500));
  start = absl::Now();
  CoordinatorAgentOptions bad = AgentOptions(23002);
  bad.address.clear();
  EXPECT_THAT(
      CoordinatorAgent::Start(bad),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("address")));
  // A malformed registration is not retried.
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
}

}  // namespace
}  // namespace shardd
