#include "worker/worker_metrics.h"

#include <memory>

#include "common/metrics_registry.h"
#include "common/metrics_text_parser.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/exec/step_executor.h"
#include "worker/worker_runtime.h"

namespace shardd {
namespace {

using ::testing::Optional;

TEST(WorkerMetricsTest, CountsStepsAndReadsTheRuntimeAtScrapeTime) {
  MetricsRegistry registry;
  SHARDD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<WorkerMetrics> metrics,
                              WorkerMetrics::Create(&registry));
  EXPECT_THAT(WorkerMetrics::Create(&registry),
              StatusIs(absl::StatusCode::kAlreadyExists));

  // Without a runtime: only the step counters, at zero.
  SHARDD_ASSERT_OK_AND_ASSIGN(ParsedMetrics before,
                              ParseMetricsText(registry.Render()));
  EXPECT_THAT(before.Find("shardd_worker_steps_total"), Optional(0.0));
  EXPECT_EQ(before.Count("shardd_worker_memory_live_bytes"), 0);
  EXPECT_THAT(before.Find("shardd_worker_insecure"), Optional(0.0));
  metrics->set_insecure(true);
  SHARDD_ASSERT_OK_AND_ASSIGN(ParsedMetrics exposed,
                              ParseMetricsText(registry.Render()));
  EXPECT_THAT(exposed.Find("shardd_worker_insecure"), Optional(1.0));
  metrics->set_insecure(false);

  WorkerRuntimeOptions options;
  options.on_step = [m = metrics.get()](const StepResult& r) {
    m->RecordStep(r);
  };
  WorkerRuntime runtime(options);
  metrics->set_runtime(&runtime);
  StepResult step;
  step.tokens = 128;
  step.seconds = 0.003;
  metrics->RecordStep(step);
  step.seconds = 10;
  metrics->RecordStep(step);

  SHARDD_ASSERT_OK_AND_ASSIGN(ParsedMetrics parsed,
                              ParseMetricsText(registry.Render()));
  EXPECT_THAT(parsed.Find("shardd_worker_steps_total"), Optional(2.0));
  EXPECT_THAT(parsed.Find("shardd_worker_tokens_total"), Optional(256.0));
  EXPECT_THAT(parsed.Find("shardd_worker_step_seconds_count"), Optional(2.0));
  EXPECT_THAT(
      parsed.Find("shardd_worker_step_seconds_bucket", {{"le", "0.004"}}),
      Optional(1.0));
  EXPECT_THAT(
      parsed.Find("shardd_worker_step_seconds_bucket", {{"le", "+Inf"}}),
      Optional(2.0));
  // One series per memory kind and collective op, all zero without a job.
  EXPECT_EQ(parsed.Count("shardd_worker_memory_live_bytes"),
            static_cast<int>(MemoryKind::kNumKinds));
  EXPECT_EQ(parsed.Count("shardd_worker_memory_peak_bytes"),
            static_cast<int>(MemoryKind::kNumKinds));
  EXPECT_THAT(
      parsed.Find("shardd_worker_memory_live_bytes", {{"kind", "activations"}}),
      Optional(0.0));
  EXPECT_THAT(parsed.Find("shardd_worker_memory_live_bytes",
                          {{"kind", "shard_params"}}),
              Optional(0.0));
  EXPECT_EQ(parsed.Count("shardd_worker_collective_calls_total"), 5);
  EXPECT_EQ(parsed.Sum("shardd_worker_collective_calls_total"), 0);
  EXPECT_THAT(parsed.Find("shardd_worker_step_failed"), Optional(0.0));
  // No agent: no heartbeat series.
  EXPECT_EQ(parsed.Count("shardd_worker_heartbeat_failures_total"), 0);
  metrics->set_runtime(nullptr);
}

}  // namespace
}  // namespace shardd
