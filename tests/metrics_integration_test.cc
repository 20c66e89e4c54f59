// End to end: a real shardd-coordinator and two shardd-worker processes with
// --metrics-listen on loopback (and --log-json), trained a few steps by
// shardctl; both /metrics endpoints are scraped over HTTP and their values
// checked against what was trained and against each other. Every wait is
// bounded and every process is stopped in teardown.

#include <httplib.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/metrics_text_parser.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/local_cluster.h"
#include "tests/subprocess.h"

namespace shardd {
namespace {

using ::shardd::testing_util::ReadFile;
using ::shardd::testing_util::RunCommand;
using ::shardd::testing_util::Spawn;
using ::shardd::testing_util::Stop;
using ::shardd::testing_util::TempDir;
using ::shardd::testing_util::WaitFor;
using ::shardd::testing_util::WaitForPortFile;
using ::testing::HasSubstr;
using ::testing::Optional;

constexpr char kCoordinatorBinary[] = "server/shardd-coordinator";
constexpr char kWorkerBinary[] = "worker/shardd-worker";
constexpr char kShardctlBinary[] = "client/shardctl";
constexpr char kSmallMoe[] = "tests/data/small_moe.json";
constexpr int kWorkers = 2;
constexpr int kSteps = 6;

// The port of the first "<what> metrics listening on HOST:PORT" in the file
// at `path`, waiting up to 30 s while `pid` runs; 0 when none appeared.
int WaitForMetricsPort(const std::string& path, pid_t pid) {
  constexpr absl::string_view kMarker = "metrics listening on ";
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline) {
    const std::string text = ReadFile(path);
    const size_t at = text.find(std::string(kMarker));
    if (at != std::string::npos) {
      const size_t host_end = text.find_first_of("\"\n", at);
      const std::string address =
          text.substr(at + kMarker.size(), host_end - at - kMarker.size());
      int port = 0;
      const size_t colon = address.rfind(':');
      if (colon != std::string::npos &&
          absl::SimpleAtoi(address.substr(colon + 1), &port)) {
        return port;
      }
    }
    if (waitpid(pid, nullptr, WNOHANG) != 0) return 0;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return 0;
}

struct Scrape {
  int status = 0;
  std::string content_type;
  std::string body;
};

Scrape Get(int port, const std::string& path) {
  httplib::Client client("127.0.0.1", port);
  client.set_connection_timeout(5);
  client.set_read_timeout(10);
  Scrape scrape;
  httplib::Result result = client.Get(path.c_str());
  if (!result) return scrape;
  scrape.status = result->status;
  scrape.content_type = result->get_header_value("Content-Type");
  scrape.body = result->body;
  return scrape;
}

// Every non-empty line of `text` is a JSON object with the log fields.
void ExpectJsonLines(const std::string& text, const std::string& who) {
  int lines = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty()) continue;
    ++lines;
    auto json = nlohmann::json::parse(line, nullptr, false);
    ASSERT_TRUE(!json.is_discarded() && json.is_object())
        << who << " logged a line that is not a JSON object: " << line;
    EXPECT_TRUE(json.contains("ts") && json.contains("level") &&
                json.contains("msg"))
        << who << ": " << line;
  }
  EXPECT_GT(lines, 0) << who << " logged nothing";
}

class MetricsIntegrationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(TempDir(), "/metrics_", getpid());
    const std::string data_dir = dir_ + "/data";
    coordinator_ = Spawn({kCoordinatorBinary, "--listen=127.0.0.1:0",
                          absl::StrCat("--data-dir=", data_dir),
                          absl::StrCat("--workers=", kWorkers),
                          "--heartbeat-timeout=2s", "--collective-timeout=20s",
                          "--metrics-listen=127.0.0.1:0", "--log-json"},
                         dir_ + "_coordinator.out", dir_ + "_coordinator.err");
    ASSERT_GT(coordinator_, 0);
    const int port = WaitForPortFile(data_dir, coordinator_, absl::Seconds(30));
    ASSERT_GT(port, 0) << ReadFile(dir_ + "_coordinator.err");
    address_ = absl::StrCat("127.0.0.1:", port);
    coordinator_metrics_ =
        WaitForMetricsPort(dir_ + "_coordinator.err", coordinator_);
    ASSERT_GT(coordinator_metrics_, 0) << ReadFile(dir_ + "_coordinator.err");

    for (int rank = 0; rank < kWorkers; ++rank) {
      const std::string err = absl::StrCat(dir_, "_worker", rank, ".err");
      const pid_t pid =
          Spawn({kWorkerBinary, absl::StrCat("--coordinator=", address_),
                 "--listen=127.0.0.1:0", "--device=cpu",
                 absl::StrCat("--requested-rank=", rank),
                 "--metrics-listen=127.0.0.1:0", "--log-json",
                 absl::StrCat("--port-file=", dir_, "_worker", rank, ".port")},
                absl::StrCat(dir_, "_worker", rank, ".out"), err);
      ASSERT_GT(pid, 0);
      workers_.push_back(pid);
      const int metrics_port = WaitForMetricsPort(err, pid);
      ASSERT_GT(metrics_port, 0) << ReadFile(err);
      worker_metrics_.push_back(metrics_port);
    }
    // Bounded wait until both workers registered (the port file is written
    // after registration).
    for (int rank = 0; rank < kWorkers; ++rank) {
      const std::string port_file =
          absl::StrCat(dir_, "_worker", rank, ".port");
      const absl::Time deadline = absl::Now() + absl::Seconds(30);
      while (ReadFile(port_file).empty() && absl::Now() < deadline) {
        absl::SleepFor(absl::Milliseconds(20));
      }
      ASSERT_FALSE(ReadFile(port_file).empty())
          << ReadFile(absl::StrCat(dir_, "_worker", rank, ".err"));
    }
  }

  void TearDown() override {
    for (pid_t pid : workers_) Stop(pid);
    Stop(coordinator_);
  }

  ParsedMetrics ScrapeParsed(int port) {
    const Scrape scrape = Get(port, "/metrics");
    EXPECT_EQ(scrape.status, 200);
    EXPECT_EQ(scrape.content_type, "text/plain; version=0.0.4; charset=utf-8");
    absl::StatusOr<ParsedMetrics> parsed = ParseMetricsText(scrape.body);
    EXPECT_TRUE(parsed.ok()) << parsed.status() << "\n" << scrape.body;
    return parsed.ok() ? *std::move(parsed) : ParsedMetrics();
  }

  std::string dir_;
  std::string address_;
  pid_t coordinator_ = -1;
  int coordinator_metrics_ = 0;
  std::vector<pid_t> workers_;
  std::vector<int> worker_metrics_;
};

TEST_F(MetricsIntegrationTest, CountersMatchWhatWasTrained) {
  // Before training: endpoints answer, nothing counted yet.
  for (int port : worker_metrics_) {
    ParsedMetrics before = ScrapeParsed(port);
    EXPECT_THAT(before.Find("shardd_worker_steps_total"), Optional(0.0));
    EXPECT_EQ(Get(port, "/healthz").status, 200);
    EXPECT_EQ(Get(port, "/other").status, 404);
  }

  // A held-out token file (uint16 ids below small_moe's vocabulary of 64):
  // evaluations after steps 3 and 6 on 2 batches of 16 windows of 33.
  const std::string eval_data = dir_ + "_eval.bin";
  {
    std::string bytes;
    for (int i = 0; i < 4096; ++i) {
      const uint16_t id = static_cast<uint16_t>((i * 7 + i / 3) % 64);
      bytes.push_back(static_cast<char>(id & 0xff));
      bytes.push_back(static_cast<char>(id >> 8));
    }
    std::ofstream(eval_data, std::ios::binary) << bytes;
  }
  const pid_t shardctl = Spawn({kShardctlBinary,  "train",
                                "--coordinator",  address_,
                                "--model",        kSmallMoe,
                                "--steps",        absl::StrCat(kSteps),
                                "--global-batch", "16",
                                "--seq",          "32",
                                "--dp",           absl::StrCat(kWorkers),
                                "--seed",         "3",
                                "--lr",           "0.02",
                                "--eval-data",    eval_data,
                                "--eval-every",   "3",
                                "--eval-batches", "2",
                                "--json"},
                               dir_ + "_train.out", dir_ + "_train.err");
  ASSERT_GT(shardctl, 0);
  const int code = WaitFor(shardctl, absl::Seconds(120));
  if (code == -2) Stop(shardctl);
  const std::string out = ReadFile(dir_ + "_train.out");
  ASSERT_EQ(code, 0) << out << ReadFile(dir_ + "_train.err")
                     << ReadFile(dir_ + "_coordinator.err");
  auto train = testing_util::LocalCluster::ParseTrainOutput(out);
  ASSERT_FALSE(train.is_discarded()) << out;
  ASSERT_EQ(train["steps"], kSteps);
  const int64_t all_gathers_per_step = train["all_gathers_per_step"];
  const int64_t reduce_scatters_per_step = train["reduce_scatters_per_step"];
  ASSERT_GT(all_gathers_per_step, 0);
  ASSERT_GT(reduce_scatters_per_step, 0);

  // Coordinator: one finished job with every step, both workers alive.
  ParsedMetrics coordinator = ScrapeParsed(coordinator_metrics_);
  EXPECT_THAT(coordinator.Find("shardd_coordinator_jobs", {{"state", "done"}}),
              Optional(1.0));
  EXPECT_THAT(
      coordinator.Find("shardd_coordinator_jobs", {{"state", "failed"}}),
      Optional(0.0));
  EXPECT_THAT(coordinator.Find("shardd_coordinator_job_steps_done",
                               {{"job_id", "j-1"}}),
              Optional(double{kSteps}));
  EXPECT_THAT(coordinator.Find("shardd_coordinator_job_recoveries",
                               {{"job_id", "j-1"}}),
              Optional(0.0));
  const double loss =
      coordinator.Find("shardd_coordinator_job_loss", {{"job_id", "j-1"}})
          .value_or(-1);
  EXPECT_GT(loss, 0.0);
  EXPECT_TRUE(std::isfinite(loss));
  // The evaluations: after steps 3 and 6, over 2 x 16 x 32 targets; the
  // gauge holds the last one (the JSON prints it with 17 digits, the
  // metrics text with enough to round-trip).
  ASSERT_EQ(train["eval_step_numbers"], nlohmann::json::array({3, 6}));
  const double eval_loss = train["eval_losses"][1];
  // The eval programs' all-gathers count among the workers' collectives.
  int64_t eval_all_gathers = 0;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    const nlohmann::json json =
        nlohmann::json::parse(line.begin(), line.end(), nullptr, false);
    if (!json.is_discarded() && json.is_object() && json["event"] == "eval") {
      eval_all_gathers += json["all_gathers"].get<int64_t>();
    }
  }
  EXPECT_GT(eval_all_gathers, 0);
  EXPECT_GT(eval_loss, 0.0);
  EXPECT_TRUE(std::isfinite(eval_loss));
  EXPECT_THAT(
      coordinator.Find("shardd_coordinator_job_eval_loss", {{"job_id", "j-1"}}),
      Optional(::testing::DoubleNear(eval_loss, 1e-12 * eval_loss)));
  // The constant schedule at --lr.
  EXPECT_THAT(
      coordinator.Find("shardd_coordinator_job_lr", {{"job_id", "j-1"}}),
      Optional(0.02));
  EXPECT_GT(
      coordinator
          .Find("shardd_coordinator_job_tokens_per_second", {{"job_id", "j-1"}})
          .value_or(0),
      0.0);
  EXPECT_THAT(
      coordinator.Find("shardd_coordinator_workers", {{"state", "alive"}}),
      Optional(double{kWorkers}));
  EXPECT_THAT(
      coordinator.Find("shardd_coordinator_workers", {{"state", "dead"}}),
      Optional(0.0));
  EXPECT_GE(coordinator.Find("shardd_coordinator_membership_epoch").value_or(0),
            double{kWorkers});
  EXPECT_THAT(
      coordinator.Find("shardd_coordinator_workers_declared_dead_total"),
      Optional(0.0));

  // Workers: each ran every step once; the collectives of the steps are
  // counted, symmetric across the two ranks, and none failed.
  std::vector<ParsedMetrics> workers;
  for (int port : worker_metrics_) workers.push_back(ScrapeParsed(port));
  for (int rank = 0; rank < kWorkers; ++rank) {
    const ParsedMetrics& w = workers[rank];
    SCOPED_TRACE(absl::StrCat("rank ", rank));
    EXPECT_THAT(w.Find("shardd_worker_steps_total"), Optional(double{kSteps}));
    EXPECT_THAT(w.Find("shardd_worker_step_seconds_count"),
                Optional(double{kSteps}));
    EXPECT_GT(w.Find("shardd_worker_step_seconds_sum").value_or(0), 0.0);
    EXPECT_GT(w.Find("shardd_worker_tokens_total").value_or(0), 0.0);
    EXPECT_THAT(
        w.Find("shardd_worker_collective_calls_total", {{"op", "all_gather"}}),
        Optional(double(kSteps * all_gathers_per_step + eval_all_gathers)));
    EXPECT_THAT(w.Find("shardd_worker_collective_calls_total",
                       {{"op", "reduce_scatter"}}),
                Optional(double(kSteps * reduce_scatters_per_step)));
    EXPECT_GT(
        w.Find("shardd_worker_collective_bytes_total", {{"op", "all_gather"}})
            .value_or(0),
        0.0);
    EXPECT_GT(w.Find("shardd_worker_collective_bytes_total",
                     {{"op", "reduce_scatter"}})
                  .value_or(0),
              0.0);
    EXPECT_EQ(w.Sum("shardd_worker_collective_errors_total"), 0.0);
    EXPECT_THAT(w.Find("shardd_worker_heartbeat_failures_total"),
                Optional(0.0));
    EXPECT_THAT(w.Find("shardd_worker_rank"),
                Optional(static_cast<double>(rank)));
    EXPECT_THAT(w.Find("shardd_worker_optimizer_steps"),
                Optional(double{kSteps}));
    // One series per memory kind (activations included: every job's plan
    // models them, and the last step's peak is there).
    EXPECT_EQ(w.Count("shardd_worker_memory_live_bytes"), 8);
    EXPECT_GT(
        w.Find("shardd_worker_memory_peak_bytes", {{"kind", "activations"}})
            .value_or(0),
        0.0);
    EXPECT_GT(w.Sum("shardd_worker_memory_peak_bytes"), 0.0);
    EXPECT_EQ(w.type.at("shardd_worker_step_seconds"), "histogram");
  }
  for (const char* op : {"all_gather", "reduce_scatter"}) {
    EXPECT_EQ(
        workers[0].Find("shardd_worker_collective_bytes_total", {{"op", op}}),
        workers[1].Find("shardd_worker_collective_bytes_total", {{"op", op}}))
        << op;
  }
  EXPECT_EQ(workers[0].Find("shardd_worker_tokens_total"),
            workers[1].Find("shardd_worker_tokens_total"));

  // shardctl status shows the same at a glance.
  std::string status;
  ASSERT_EQ(RunCommand({kShardctlBinary, "status", "--coordinator", address_},
                       absl::Seconds(30), &status),
            0)
      << status;
  EXPECT_THAT(status, HasSubstr("Workers (2: 2 alive, 0 dead)"));
  EXPECT_THAT(status, HasSubstr("recov"));

  // SIGTERM: every process stops cleanly (the metrics servers included),
  // and every line each logged with --log-json is one JSON object.
  for (pid_t& pid : workers_) {
    ASSERT_EQ(kill(pid, SIGTERM), 0);
    EXPECT_EQ(WaitFor(pid, absl::Seconds(15)), 0);
    pid = -1;
  }
  ASSERT_EQ(kill(coordinator_, SIGTERM), 0);
  EXPECT_EQ(WaitFor(coordinator_, absl::Seconds(15)), 0);
  coordinator_ = -1;
  ExpectJsonLines(ReadFile(dir_ + "_coordinator.err"), "coordinator");
  for (int rank = 0; rank < kWorkers; ++rank) {
    ExpectJsonLines(ReadFile(absl::StrCat(dir_, "_worker", rank, ".err")),
                    absl::StrCat("worker ", rank));
  }
}

TEST(MetricsFlagsTest, BadMetricsAddressIsAUsageError) {
  const int code = RunCommand(
      {kWorkerBinary, "--listen=127.0.0.1:0", "--metrics-listen=nonsense"},
      absl::Seconds(30));
  EXPECT_EQ(code, 2);
  const int coordinator_code =
      RunCommand({kCoordinatorBinary, "--listen=127.0.0.1:0",
                  "--metrics-listen=127.0.0.1:99999"},
                 absl::Seconds(30));
  EXPECT_EQ(coordinator_code, 2);
}

}  // namespace
}  // namespace shardd
