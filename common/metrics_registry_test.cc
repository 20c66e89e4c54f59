#include "common/metrics_registry.h"

#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "common/metrics_text_parser.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;
using ::testing::Optional;

TEST(MetricsRegistryTest, RendersCountersAndGaugesThatParseBack) {
  MetricsRegistry registry;
  SHARDD_ASSERT_OK_AND_ASSIGN(
      CounterFamily * steps,
      registry.AddCounter("shardd_steps_total", "Steps run.", {}));
  SHARDD_ASSERT_OK_AND_ASSIGN(
      GaugeFamily * live,
      registry.AddGauge("shardd_live_bytes", "Live bytes.", {"kind"}));
  steps->Increment({});
  steps->Add({}, 2.5);
  live->Set({"params"}, 1024);
  live->Set({"grads"}, -3);
  live->Add({"grads"}, 1);

  const std::string text = registry.Render();
  SHARDD_ASSERT_OK_AND_ASSIGN(ParsedMetrics parsed, ParseMetricsText(text));
  EXPECT_EQ(parsed.type["shardd_steps_total"], "counter");
  EXPECT_EQ(parsed.type["shardd_live_bytes"], "gauge");
  EXPECT_EQ(parsed.help["shardd_steps_total"], "Steps run.");
  EXPECT_THAT(parsed.Find("shardd_steps_total"), Optional(3.5));
  EXPECT_THAT(parsed.Find("shardd_live_bytes", {{"kind", "params"}}),
              Optional(1024.0));
  EXPECT_THAT(parsed.Find("shardd_live_bytes", {{"kind", "grads"}}),
              Optional(-2.0));
  EXPECT_EQ(parsed.samples.size(), 3u);
  // Families in registration order, HELP before TYPE before samples.
  EXPECT_LT(text.find("# HELP shardd_steps_total"),
            text.find("# TYPE shardd_steps_total counter"));
  EXPECT_LT(text.find("# TYPE shardd_steps_total counter"),
            text.find("shardd_steps_total 3.5"));
  EXPECT_LT(text.find("shardd_steps_total 3.5"),
            text.find("# HELP shardd_live_bytes"));
  EXPECT_THAT(text, HasSubstr("shardd_live_bytes{kind=\"params\"} 1024\n"));
}

TEST(MetricsRegistryTest, EscapesHelpAndLabelValues) {
  MetricsRegistry registry;
  SHARDD_ASSERT_OK_AND_ASSIGN(
      GaugeFamily * gauge,
      registry.AddGauge("odd", "Back\\slash and\nnewline \"quoted\".",
                        {"a", "b"}));
  const std::string nasty = "x\"y\\z\nw";
  gauge->Set({nasty, ""}, 1);
  const std::string text = registry.Render();
  EXPECT_THAT(
      text, HasSubstr("# HELP odd Back\\\\slash and\\nnewline \"quoted\".\n"));
  EXPECT_THAT(text, HasSubstr("odd{a=\"x\\\"y\\\\z\\nw\",b=\"\"} 1\n"));
  SHARDD_ASSERT_OK_AND_ASSIGN(ParsedMetrics parsed, ParseMetricsText(text));
  EXPECT_EQ(parsed.help["odd"], "Back\\slash and\nnewline \"quoted\".");
  EXPECT_THAT(parsed.Find("odd", {{"a", nasty}, {"b", ""}}), Optional(1.0));
}

TEST(MetricsRegistryTest, HistogramBucketsAreCumulative) {
  MetricsRegistry registry;
  SHARDD_ASSERT_OK_AND_ASSIGN(
      HistogramFamily * seconds,
      registry.AddHistogram("step_seconds", "Step time.", {"job"},
                            {0.1, 1, 10}));
  for (double v : {0.05, 0.1, 0.5, 2.0, 20.0, 30.0}) {
    seconds->Observe({"j1"}, v);
  }
  const HistogramFamily::Snapshot snapshot = seconds->Get({"j1"});
  EXPECT_THAT(snapshot.bucket_counts, ::testing::ElementsAre(2, 1, 1, 2));
  SHARDD_ASSERT_OK_AND_ASSIGN(ParsedMetrics parsed,
                              ParseMetricsText(registry.Render()));
  EXPECT_EQ(parsed.type["step_seconds"], "histogram");
  EXPECT_THAT(
      parsed.Find("step_seconds_bucket", {{"job", "j1"}, {"le", "0.1"}}),
      Optional(2.0));
  EXPECT_THAT(parsed.Find("step_seconds_bucket", {{"job", "j1"}, {"le", "1"}}),
              Optional(3.0));
  EXPECT_THAT(parsed.Find("step_seconds_bucket", {{"job", "j1"}, {"le", "10"}}),
              Optional(4.0));
  EXPECT_THAT(
      parsed.Find("step_seconds_bucket", {{"job", "j1"}, {"le", "+Inf"}}),
      Optional(6.0));
  EXPECT_THAT(parsed.Find("step_seconds_count", {{"job", "j1"}}),
              Optional(6.0));
  EXPECT_THAT(parsed.Find("step_seconds_sum", {{"job", "j1"}}),
              Optional(::testing::DoubleNear(52.65, 1e-9)));
}

TEST(MetricsRegistryTest, AHistogramCanBeSetFromACollectorsCounts) {
  MetricsRegistry registry;
  SHARDD_ASSERT_OK_AND_ASSIGN(
      HistogramFamily * seconds,
      registry.AddHistogram("rpc_seconds", "RPC time.", {"method"}, {0.1, 1}));
  HistogramFamily::Snapshot counts;
  counts.bucket_counts = {3, 0, 1};
  counts.count = 4;
  counts.sum = 2.5;
  seconds->Set({"Get"}, counts);
  SHARDD_ASSERT_OK_AND_ASSIGN(ParsedMetrics parsed,
                              ParseMetricsText(registry.Render()));
  EXPECT_THAT(
      parsed.Find("rpc_seconds_bucket", {{"method", "Get"}, {"le", "1"}}),
      Optional(3.0));
  EXPECT_THAT(
      parsed.Find("rpc_seconds_bucket", {{"method", "Get"}, {"le", "+Inf"}}),
      Optional(4.0));
  EXPECT_THAT(parsed.Find("rpc_seconds_sum", {{"method", "Get"}}),
              Optional(2.5));
  // A snapshot with other buckets is refused.
  counts.bucket_counts = {1, 1};
  seconds->Set({"Put"}, counts);
  EXPECT_EQ(seconds->Get({"Put"}).count, 0u);
}

TEST(MetricsRegistryTest, CollectorsRunAtRenderAndClearDropsLabels) {
  MetricsRegistry registry;
  SHARDD_ASSERT_OK_AND_ASSIGN(GaugeFamily * jobs,
                              registry.AddGauge("jobs", "Jobs.", {"job_id"}));
  std::vector<std::string> current = {"a", "b"};
  int runs = 0;
  registry.AddCollector([&] {
    ++runs;
    jobs->Clear();
    for (const std::string& id : current) jobs->Set({id}, 1);
  });
  SHARDD_ASSERT_OK_AND_ASSIGN(ParsedMetrics first,
                              ParseMetricsText(registry.Render()));
  EXPECT_EQ(first.Count("jobs"), 2);
  current = {"c"};
  SHARDD_ASSERT_OK_AND_ASSIGN(ParsedMetrics second,
                              ParseMetricsText(registry.Render()));
  EXPECT_EQ(second.Count("jobs"), 1);
  EXPECT_THAT(second.Find("jobs", {{"job_id", "c"}}), Optional(1.0));
  EXPECT_EQ(runs, 2);
}

TEST(MetricsRegistryTest, RefusesBadNamesAndDuplicates) {
  MetricsRegistry registry;
  SHARDD_EXPECT_OK(registry.AddCounter("ok_name:total", "h", {"l"}));
  EXPECT_THAT(registry.AddCounter("ok_name:total", "h", {}),
              StatusIs(absl::StatusCode::kAlreadyExists));
  EXPECT_THAT(registry.AddGauge("9starts_with_digit", "h", {}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(registry.AddGauge("has-dash", "h", {}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(registry.AddGauge("g", "h", {"__reserved"}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(registry.AddGauge("g", "h", {"a:b"}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(registry.AddGauge("g", "h", {"x", "x"}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(registry.AddHistogram("h1", "h", {"le"}, {1}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(registry.AddHistogram("h2", "h", {}, {}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(registry.AddHistogram("h3", "h", {}, {1, 1}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(registry.AddHistogram("h4", "h", {}, {1, INFINITY}),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(MetricsRegistryTest, IgnoresAndCountsMalformedCalls) {
  MetricsRegistry registry;
  SHARDD_ASSERT_OK_AND_ASSIGN(CounterFamily * counter,
                              registry.AddCounter("c_total", "h", {"a"}));
  SHARDD_ASSERT_OK_AND_ASSIGN(
      HistogramFamily * histogram,
      registry.AddHistogram("h", "h", {}, ExponentialBuckets(1, 2, 3)));
  counter->Increment({});          // Too few labels.
  counter->Increment({"x", "y"});  // Too many.
  counter->Add({"x"}, -1);         // Counters never go down.
  counter->Add({"x"}, NAN);
  histogram->Observe({}, NAN);
  counter->Add({"x"}, 2);
  EXPECT_EQ(registry.invalid_calls(), 5);
  EXPECT_EQ(counter->Value({"x"}), 2);
  EXPECT_EQ(histogram->Get({}).count, 0u);
  EXPECT_EQ(histogram->bounds(), (std::vector<double>{1, 2, 4}));
}

TEST(MetricsRegistryTest, FormatsValues) {
  EXPECT_EQ(FormatMetricValue(0), "0");
  EXPECT_EQ(FormatMetricValue(-0.0), "0");
  EXPECT_EQ(FormatMetricValue(42), "42");
  EXPECT_EQ(FormatMetricValue(-7), "-7");
  EXPECT_EQ(FormatMetricValue(1e15), "1000000000000000");
  EXPECT_EQ(FormatMetricValue(0.1), "0.1");
  EXPECT_EQ(FormatMetricValue(1e300), "1e+300");
  EXPECT_EQ(FormatMetricValue(INFINITY), "+Inf");
  EXPECT_EQ(FormatMetricValue(-INFINITY), "-Inf");
  EXPECT_EQ(FormatMetricValue(NAN), "NaN");
  const double third = 1.0 / 3.0;
  EXPECT_EQ(std::strtod(FormatMetricValue(third).c_str(), nullptr), third);
}

TEST(MetricsRegistryTest, ConcurrentUpdatesAndRendersAgree) {
  MetricsRegistry registry;
  SHARDD_ASSERT_OK_AND_ASSIGN(CounterFamily * counter,
                              registry.AddCounter("c_total", "h", {"t"}));
  SHARDD_ASSERT_OK_AND_ASSIGN(HistogramFamily * histogram,
                              registry.AddHistogram("h", "h", {}, {0.5}));
  constexpr int kThreads = 4;
  constexpr int kPerThread = 2000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        counter->Increment({t % 2 == 0 ? "even" : "odd"});
        histogram->Observe({}, i % 2);
      }
    });
  }
  std::thread renderer([&] {
    for (int i = 0; i < 50; ++i) {
      EXPECT_TRUE(ParseMetricsText(registry.Render()).ok());
    }
  });
  for (std::thread& thread : threads) thread.join();
  renderer.join();
  SHARDD_ASSERT_OK_AND_ASSIGN(ParsedMetrics parsed,
                              ParseMetricsText(registry.Render()));
  EXPECT_THAT(parsed.Find("c_total", {{"t", "even"}}),
              Optional(2.0 * kPerThread));
  EXPECT_THAT(parsed.Find("c_total", {{"t", "odd"}}),
              Optional(2.0 * kPerThread));
  EXPECT_THAT(parsed.Find("h_count"), Optional(1.0 * kThreads * kPerThread));
  EXPECT_THAT(parsed.Find("h_bucket", {{"le", "0.5"}}),
              Optional(0.5 * kThreads * kPerThread));
}

TEST(MetricsTextParserTest, RejectsMalformedText) {
  EXPECT_FALSE(ParseMetricsText("x{a=\"1} 1\n").ok());
  EXPECT_FALSE(ParseMetricsText("x 1 2 3\n").ok());
  EXPECT_FALSE(ParseMetricsText("x one\n").ok());
  EXPECT_FALSE(ParseMetricsText("# TYPE x countr\n").ok());
  EXPECT_FALSE(ParseMetricsText("x 1\n# TYPE x gauge\n").ok());
  EXPECT_FALSE(ParseMetricsText("x{a=\"\\q\"} 1\n").ok());
  EXPECT_TRUE(ParseMetricsText("# a comment\nx{a=\"1\"} 1 1700000000\n").ok());
}

}  // namespace
}  // namespace shardd
