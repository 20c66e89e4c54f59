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
#include "gtest/gtest.h"
#include "server/coordinator_service.h"
#include "planner/strategy_registry.h"

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

}  // namespace
}  // namespace shardd
