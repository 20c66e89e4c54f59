#include "server/coordinator_metrics.h"

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/metrics_registry.h"
#include "common/metrics_text_parser.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "planner/strategy_registry.h"
#include "proto/coordinator.grpc.pb.h"
#include "server/coordinator_server.h"
#include "server/coordinator_service.h"
#include "server/rpc_latencies.h"

namespace shardd {
namespace {

using ::testing::Optional;

v1::RegisterWorkerRequest WorkerRequest(int port, uint64_t incarnation) {
  v1::RegisterWorkerRequest request;
  request.set_address(absl::StrCat("127.0.0.1:", port));
  request.set_incarnation(incarnation);
  request.set_device("cpu");
  request.set_requested_rank(-1);
  return request;
}

TEST(CoordinatorMetricsTest, ReflectsMembershipAtScrapeTime) {
  absl::Mutex mu;
  absl::Time now = absl::FromUnixSeconds(1000);
  CoordinatorServiceOptions options;
  options.heartbeat_timeout = absl::Seconds(3);
  options.clock = [&] {
    absl::MutexLock lock(&mu);
    return now;
  };
  std::unique_ptr<StrategyRegistry> strategies =
      StrategyRegistry::CreateWithBuiltins();
  CoordinatorService service(strategies.get(), options);
  MetricsRegistry registry;
  SHARDD_ASSERT_OK(RegisterCoordinatorMetrics(&service, &registry));
  EXPECT_THAT(RegisterCoordinatorMetrics(&service, &registry),
              StatusIs(absl::StatusCode::kAlreadyExists));

  SHARDD_ASSERT_OK_AND_ASSIGN(ParsedMetrics empty,
                              ParseMetricsText(registry.Render()));
  EXPECT_THAT(empty.Find("shardd_coordinator_workers", {{"state", "alive"}}),
              Optional(0.0));
  EXPECT_THAT(empty.Find("shardd_coordinator_jobs", {{"state", "running"}}),
              Optional(0.0));
  EXPECT_EQ(empty.Count("shardd_coordinator_jobs"), 5);
  EXPECT_EQ(empty.Count("shardd_coordinator_job_steps_done"), 0);
  EXPECT_EQ(empty.type["shardd_coordinator_workers_declared_dead_total"],
            "counter");
  // Checkpoint outcomes (their values: tests/checkpoint_disk_test through
  // shardctl status, which reads the same GetStatus fields).
  EXPECT_EQ(empty.type["shardd_coordinator_checkpoint_failures_total"],
            "counter");
  EXPECT_THAT(empty.Find("shardd_coordinator_checkpoint_failures_total"),
              Optional(0.0));
  EXPECT_EQ(empty.type["shardd_coordinator_checkpoints_deleted_total"],
            "counter");
  EXPECT_THAT(empty.Find("shardd_coordinator_insecure"), Optional(0.0));
  EXPECT_THAT(empty.Find("shardd_coordinator_insecure_workers"), Optional(0.0));

  SHARDD_ASSERT_OK(service.RegisterWorker(WorkerRequest(5000, 1)).status());
  SHARDD_ASSERT_OK(service.RegisterWorker(WorkerRequest(5001, 2)).status());
  {
    absl::MutexLock lock(&mu);
    now += absl::Seconds(2);
  }
  v1::HeartbeatRequest beat;
  beat.set_rank(0);
  beat.set_incarnation(1);
  SHARDD_ASSERT_OK(service.Heartbeat(beat).status());
  {
    absl::MutexLock lock(&mu);
    now += absl::Seconds(2);  // Rank 1 silent for 4 s > 3 s.
  }
  SHARDD_ASSERT_OK_AND_ASSIGN(ParsedMetrics parsed,
                              ParseMetricsText(registry.Render()));
  EXPECT_THAT(parsed.Find("shardd_coordinator_workers", {{"state", "alive"}}),
              Optional(1.0));
  EXPECT_THAT(parsed.Find("shardd_coordinator_workers", {{"state", "dead"}}),
              Optional(1.0));
  // Two joins and one death.
  EXPECT_THAT(parsed.Find("shardd_coordinator_membership_epoch"),
              Optional(3.0));
  EXPECT_THAT(parsed.Find("shardd_coordinator_workers_declared_dead_total"),
              Optional(1.0));
  EXPECT_THAT(parsed.Find("shardd_coordinator_uptime_seconds"), Optional(4.0));
  EXPECT_THAT(parsed.Find("shardd_coordinator_models"), Optional(0.0));
}

TEST(CoordinatorMetricsTest, InsecureListenersAreReported) {
  CoordinatorServiceOptions options;
  options.insecure_warning = "shardd-coordinator serves 0.0.0.0:7070 ...";
  std::unique_ptr<StrategyRegistry> strategies =
      StrategyRegistry::CreateWithBuiltins();
  CoordinatorService service(strategies.get(), options);
  MetricsRegistry registry;
  SHARDD_ASSERT_OK(RegisterCoordinatorMetrics(&service, &registry));
  v1::RegisterWorkerRequest exposed = WorkerRequest(5000, 1);
  exposed.set_insecure(true);
  SHARDD_ASSERT_OK(service.RegisterWorker(exposed).status());
  SHARDD_ASSERT_OK(service.RegisterWorker(WorkerRequest(5001, 2)).status());
  SHARDD_ASSERT_OK_AND_ASSIGN(ParsedMetrics parsed,
                              ParseMetricsText(registry.Render()));
  EXPECT_THAT(parsed.Find("shardd_coordinator_insecure"), Optional(1.0));
  EXPECT_THAT(parsed.Find("shardd_coordinator_insecure_workers"),
              Optional(1.0));
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::GetStatusResponse status,
                              service.GetStatus({}));
  EXPECT_EQ(status.insecure(), options.insecure_warning);
  ASSERT_EQ(status.workers_size(), 2);
  EXPECT_NE(status.workers(0).insecure(), status.workers(1).insecure());
}

TEST(CoordinatorMetricsTest, ServerSideRpcLatenciesByMethod) {
  std::unique_ptr<StrategyRegistry> strategies =
      StrategyRegistry::CreateWithBuiltins();
  CoordinatorService service(strategies.get(), CoordinatorServiceOptions());
  RpcLatencies latencies;
  CoordinatorServerOptions server_options;
  server_options.listen_address = "127.0.0.1:0";
  server_options.latencies = &latencies;
  SHARDD_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<CoordinatorServer> server,
      CoordinatorServer::Start(server_options, &service));
  MetricsRegistry registry;
  SHARDD_ASSERT_OK(RegisterCoordinatorMetrics(&service, &registry, &latencies));
  auto stub = v1::Coordinator::NewStub(grpc::CreateChannel(
      server->address(), grpc::InsecureChannelCredentials()));
  auto context = [] {
    auto c = std::make_unique<grpc::ClientContext>();
    c->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::seconds(10));
    return c;
  };
  v1::RegisterWorkerResponse registered;
  ASSERT_TRUE(
      stub->RegisterWorker(context().get(), WorkerRequest(5000, 1), &registered)
          .ok());
  v1::HeartbeatRequest beat;
  beat.set_rank(registered.rank());
  beat.set_incarnation(1);
  v1::HeartbeatResponse answer;
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(stub->Heartbeat(context().get(), beat, &answer).ok());
  }
  // A Get that waits 50 ms for a key nobody writes: its latency is the wait.
  v1::GetRequest get;
  get.set_key("absent");
  get.set_wait_ms(50);
  v1::GetResponse got;
  EXPECT_EQ(stub->Get(context().get(), get, &got).error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);

  SHARDD_ASSERT_OK_AND_ASSIGN(ParsedMetrics parsed,
                              ParseMetricsText(registry.Render()));
  EXPECT_EQ(parsed.type["shardd_coordinator_rpc_seconds"], "histogram");
  EXPECT_THAT(parsed.Find("shardd_coordinator_rpc_seconds_count",
                          {{"method", "Heartbeat"}}),
              Optional(3.0));
  EXPECT_THAT(parsed.Find("shardd_coordinator_rpc_seconds_count",
                          {{"method", "RegisterWorker"}}),
              Optional(1.0));
  EXPECT_THAT(parsed.Find("shardd_coordinator_rpc_seconds_count",
                          {{"method", "Barrier"}}),
              Optional(0.0));
  // The Get's latency is its 50 ms wait.
  EXPECT_THAT(
      parsed.Find("shardd_coordinator_rpc_seconds_count", {{"method", "Get"}}),
      Optional(1.0));
  const std::optional<double> get_seconds =
      parsed.Find("shardd_coordinator_rpc_seconds_sum", {{"method", "Get"}});
  ASSERT_TRUE(get_seconds.has_value());
  EXPECT_GE(*get_seconds, 0.05);
  EXPECT_LT(*get_seconds, 5.0);
  EXPECT_GE(RpcLatencies::Quantile(latencies.Get(RpcLatencies::kGet), {}, 0.5),
            0.05);
  server->Shutdown(absl::Seconds(1));
}

}  // namespace
}  // namespace shardd
