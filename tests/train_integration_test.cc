// End to end: the real shardd-coordinator, two shardd-worker processes and
// shardctl train, as subprocesses on loopback. Every wait is bounded and
// every process is killed in teardown.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/coordinator_client.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "proto/coordinator.pb.h"
#include "tests/local_cluster.h"
#include "tests/subprocess.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;

constexpr int kWorkers = 2;

using ::shardd::testing_util::LocalCluster;
using ProcessResult = LocalCluster::Result;

LocalCluster::Options ClusterOptions() {
  LocalCluster::Options options;
  options.name = "train";
  options.workers = kWorkers;
  return options;
}

class TrainIntegrationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SHARDD_ASSERT_OK(cluster_.StartCoordinator());
    SHARDD_ASSERT_OK(cluster_.StartWorkers(kWorkers));
    client_ = cluster_.client();
  }

  // Runs shardctl with `args`; killed after `timeout`.
  ProcessResult Shardctl(std::vector<std::string> args,
                         absl::Duration timeout = absl::Seconds(120)) {
    return cluster_.Shardctl(std::move(args), timeout);
  }

  std::vector<std::string> TrainArgs(
      int steps, const std::vector<std::string>& extra = {}) {
    return cluster_.TrainArgs(steps, /*seed=*/3, extra);
  }

  LocalCluster cluster_{ClusterOptions()};
  CoordinatorClient* client_ = nullptr;
};

TEST_F(TrainIntegrationTest, TrainsAndMeasuresThePlannedPeak) {
  ProcessResult run = Shardctl(TrainArgs(20));
  ASSERT_EQ(run.exit_code, 0) << run.err << "\n" << cluster_.CoordinatorLog();
  auto json = LocalCluster::ParseTrainOutput(run.out);
  ASSERT_FALSE(json.is_discarded()) << run.out;
  ASSERT_TRUE(json["losses"].is_array());
  ASSERT_EQ(json["losses"].size(), 20u);
  EXPECT_EQ(json["steps"], 20);
  EXPECT_EQ(json["world_size"], kWorkers);
  const double first = json["losses"][0];
  const double last = json["losses"][19];
  const double final_loss = json["final_loss"];
  // Learning: the loss falls well below its start, toward the floor.
  EXPECT_LT(last, first);
  EXPECT_LT(final_loss, 0.5 * first);
  const double entropy = json["data_entropy_rate"];
  EXPECT_GT(entropy, 0.0);
  EXPECT_GT(final_loss, entropy * 0.9);  // Nobody beats the floor.
  // Memory: the measured peak of unsharded bytes is the planner's.
  const int64_t measured = json["peak_unsharded_bytes"];
  const int64_t planned = json["planned_peak_unsharded_bytes"];
  EXPECT_GT(planned, 0);
  EXPECT_EQ(measured, planned);
  EXPECT_GT(json["all_gathers_per_step"].get<int64_t>(), 0);
  EXPECT_GT(json["reduce_scatters_per_step"].get<int64_t>(), 0);
  // One line per step came before the summary, as the steps ran.
  const nlohmann::json& lines = json["step_events"];
  ASSERT_EQ(lines.size(), 20u) << run.out;
  for (int i = 0; i < 20; ++i) {
    EXPECT_EQ(lines[i]["step"], i + 1);
    EXPECT_EQ(lines[i]["loss"], json["losses"][i]);
    EXPECT_GT(lines[i]["grad_norm"].get<double>(), 0.0);
    EXPECT_EQ(lines[i]["tokens"], 16 * 32);  // TrainArgs' batch x seq.
    EXPECT_GT(lines[i]["step_seconds"].get<double>(), 0.0);
  }

  // The job is listed as done.
  auto status = client_->GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  ASSERT_EQ(status->jobs_size(), 1);
  EXPECT_EQ(status->jobs(0).state(), v1::JOB_DONE);
  EXPECT_EQ(status->jobs(0).steps_done(), 20);
}

// A Hugging Face config with attention (Qwen3-MoE: GQA, q/k norms, RoPE, then
// the MoE) trains through the same path: planned from its config.json,
// sharded over 2 workers on data of order 3: its loss falls below the floor
// of any model without attention (which sees one token back), and its peak
// is as planned.
TEST_F(TrainIntegrationTest, AHuggingFaceAttentionModelTrains) {
  std::vector<std::string> args = TrainArgs(200, {"--synthetic-order", "3"});
  auto model = std::find(args.begin(), args.end(), "--model");
  ASSERT_NE(model, args.end());
  *(model + 1) = "tests/data/tiny_qwen3_moe.json";
  ProcessResult run = Shardctl(args, absl::Seconds(240));
  ASSERT_EQ(run.exit_code, 0) << run.err << "\n" << cluster_.CoordinatorLog();
  auto json = LocalCluster::ParseTrainOutput(run.out);
  ASSERT_FALSE(json.is_discarded()) << run.out;
  ASSERT_EQ(json["losses"].size(), 200u);
  const double first = json["losses"][0];
  const double final_loss = json["final_loss"];
  const double best = json["data_entropy_rate"];
  const double one_token = json["data_one_token_loss"];
  // Near ln(64) at the start (random weights, 64 tokens).
  EXPECT_GT(first, 3.5);
  // The order-3 source: the attention-free floor is log 8 nats above the
  // chain's entropy rate, far above the best reachable loss.
  EXPECT_GT(one_token, best + 0.5);
  EXPECT_LT(final_loss, one_token - 0.25)
      << "final " << final_loss << ", best " << best << ", without attention "
      << one_token;
  EXPECT_GT(final_loss, 0.95 * best);
  EXPECT_EQ(json["peak_unsharded_bytes"].get<int64_t>(),
            json["planned_peak_unsharded_bytes"].get<int64_t>());
  // The coordinator planned the job's micro-batch activations; the workers
  // held exactly those.
  EXPECT_GT(json["planned_peak_activation_bytes"].get<int64_t>(), 0);
  EXPECT_EQ(json["peak_activation_bytes"].get<int64_t>(),
            json["planned_peak_activation_bytes"].get<int64_t>());
}

// Recomputing every layer in backward (through the coordinator, the plan
// and the workers) trains bit for bit as keeping the activations, with
// fewer of them.
TEST_F(TrainIntegrationTest, ActivationCheckpointingChangesNoLoss) {
  auto attention = [&](int steps, std::vector<std::string> extra) {
    std::vector<std::string> args = TrainArgs(steps, extra);
    auto model = std::find(args.begin(), args.end(), "--model");
    EXPECT_NE(model, args.end());
    if (model != args.end()) *(model + 1) = "tests/data/tiny_qwen3_moe.json";
    return args;
  };
  ProcessResult kept = Shardctl(attention(4, {}));
  ASSERT_EQ(kept.exit_code, 0) << kept.err;
  ProcessResult recomputed =
      Shardctl(attention(4, {"--activation-checkpointing", "all"}));
  ASSERT_EQ(recomputed.exit_code, 0) << recomputed.err;
  auto a = LocalCluster::ParseTrainOutput(kept.out);
  auto b = LocalCluster::ParseTrainOutput(recomputed.out);
  ASSERT_FALSE(a.is_discarded()) << kept.out;
  ASSERT_FALSE(b.is_discarded()) << recomputed.out;
  EXPECT_EQ(a["losses"], b["losses"]);
  EXPECT_EQ(b["peak_activation_bytes"].get<int64_t>(),
            b["planned_peak_activation_bytes"].get<int64_t>());
  EXPECT_LT(b["peak_activation_bytes"].get<int64_t>(),
            a["peak_activation_bytes"].get<int64_t>());
}

// Learning: 2 workers train the small MoE on synthetic Markov data until the
// loss (mean of the last 10% of steps) is within 5% of the data's entropy
// rate, the best any model can reach.
TEST_F(TrainIntegrationTest, LossComesWithinFivePercentOfTheEntropyRate) {
  std::vector<std::string> args = TrainArgs(300);
  // A larger batch than the smoke test's: 64 sequences of 64 tokens, as the
  // local launcher trains.
  for (size_t i = 0; i + 1 < args.size(); ++i) {
    if (args[i] == "--global-batch") args[i + 1] = "64";
    if (args[i] == "--seq") args[i + 1] = "64";
  }
  ProcessResult run = Shardctl(args, absl::Seconds(240));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  auto json = LocalCluster::ParseTrainOutput(run.out);
  ASSERT_FALSE(json.is_discarded()) << run.out;
  const double entropy = json["data_entropy_rate"];
  const double final_loss = json["final_loss"];
  ASSERT_GT(entropy, 0.0);
  EXPECT_LT(final_loss, 1.05 * entropy)
      << "final loss " << final_loss << " vs entropy rate " << entropy;
  EXPECT_GT(final_loss, 0.95 * entropy);
}

// Evaluations run between steps on the same workers and leave the
// training trajectory bit for bit as it was; a missing eval file fails the
// job at its start, naming the field.
TEST_F(TrainIntegrationTest, EvaluationsChangeNoTrainingLoss) {
  const std::string eval_data =
      absl::StrCat(testing_util::TempDir(), "/train_eval_", getpid(), ".bin");
  {
    std::string bytes;
    for (int i = 0; i < 2048; ++i) {
      const uint16_t id = static_cast<uint16_t>((i * 11 + i / 5) % 64);
      bytes.push_back(static_cast<char>(id & 0xff));
      bytes.push_back(static_cast<char>(id >> 8));
    }
    std::ofstream(eval_data, std::ios::binary) << bytes;
  }
  ProcessResult plain = Shardctl(TrainArgs(4));
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  ProcessResult evaluated =
      Shardctl(TrainArgs(4, {"--eval-data", eval_data, "--eval-every", "1",
                             "--eval-batches", "2"}));
  ASSERT_EQ(evaluated.exit_code, 0) << evaluated.err;
  auto a = LocalCluster::ParseTrainOutput(plain.out);
  auto b = LocalCluster::ParseTrainOutput(evaluated.out);
  ASSERT_FALSE(a.is_discarded()) << plain.out;
  ASSERT_FALSE(b.is_discarded()) << evaluated.out;
  EXPECT_EQ(a["losses"], b["losses"]);
  EXPECT_EQ(b["eval_step_numbers"], nlohmann::json::array({1, 2, 3, 4}));
  ASSERT_EQ(b["eval_losses"].size(), 4u);
  for (const auto& loss : b["eval_losses"]) {
    EXPECT_TRUE(std::isfinite(loss.get<double>()));
    EXPECT_GT(loss.get<double>(), 0.0);
  }
  EXPECT_EQ(a["eval_losses"], nlohmann::json::array());

  ProcessResult missing =
      Shardctl(TrainArgs(2, {"--eval-data", eval_data + ".missing"}));
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_THAT(missing.err, HasSubstr("train.eval_data_path"));
  std::remove(eval_data.c_str());
}

TEST_F(TrainIntegrationTest, FineGrainedModeGivesTheSameLosses) {
  ProcessResult whole = Shardctl(TrainArgs(4));
  ASSERT_EQ(whole.exit_code, 0) << whole.err;
  std::vector<std::string> args = TrainArgs(4);
  args.push_back("--fine-grained");
  ProcessResult fine = Shardctl(args);
  ASSERT_EQ(fine.exit_code, 0) << fine.err;
  auto a = LocalCluster::ParseTrainOutput(whole.out);
  auto b = LocalCluster::ParseTrainOutput(fine.out);
  ASSERT_FALSE(a.is_discarded());
  ASSERT_FALSE(b.is_discarded());
  EXPECT_EQ(a["losses"], b["losses"]);
  EXPECT_EQ(a["peak_unsharded_bytes"], b["peak_unsharded_bytes"]);
}

// Equivalence across processes: fp32 all the way, the same global batch
// trained by one worker process and sharded over two (also with two
// micro-batches and deferred sync, and with reshard-after-forward) gives the
// same loss at every step within what fp32 rounding allows the free-running
// jobs (LocalCluster::TrainArgsLossTolerance; the first loss, from the same
// parameters, within one step's rounding). Every step's update is compared
// from a shared state in step_executor_test.
TEST_F(TrainIntegrationTest, OneAndTwoWorkerProcessesGiveTheSameLosses) {
  auto run = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = TrainArgs(5);
    args.push_back("--no-mixed-precision");
    args.insert(args.end(), extra.begin(), extra.end());
    ProcessResult result = Shardctl(args);
    EXPECT_EQ(result.exit_code, 0) << result.err;
    auto json = LocalCluster::ParseTrainOutput(result.out);
    EXPECT_FALSE(json.is_discarded()) << result.out;
    std::vector<double> losses;
    if (!json.is_discarded() && json["losses"].is_array()) {
      for (const auto& loss : json["losses"]) losses.push_back(loss);
    }
    return losses;
  };
  const std::vector<double> one = run({"--dp", "1"});
  ASSERT_EQ(one.size(), 5u);
  const std::vector<std::vector<std::string>> variants = {
      {"--dp", "2"},
      {"--dp", "2", "--microbatches", "2", "--defer-grad-sync"},
      {"--dp", "2", "--strategy", "megatron_fsdp"},
  };
  for (const std::vector<std::string>& variant : variants) {
    const std::vector<double> got = run(variant);
    ASSERT_EQ(got.size(), one.size()) << absl::StrJoin(variant, " ");
    for (size_t s = 0; s < one.size(); ++s) {
      SHARDD_ASSERT_OK_AND_ASSIGN(
          const double allowed,
          LocalCluster::TrainArgsLossTolerance(static_cast<int>(s), one[s], 2));
      EXPECT_NEAR(got[s], one[s], allowed)
          << "step " << s + 1 << " with " << absl::StrJoin(variant, " ");
      std::printf("[loss] step %zu, %s: |%.9g - %.9g| = %.3g, allowed %.3g\n",
                  s + 1, absl::StrJoin(variant, " ").c_str(), got[s], one[s],
                  std::fabs(got[s] - one[s]), allowed);
    }
  }
}

TEST_F(TrainIntegrationTest, AWorkerKilledMidJobFailsItNamingTheRank) {
  std::vector<std::string> args = TrainArgs(100000);
  // Fail on the first fault (recovery is recovery_integration_test's).
  args.push_back("--max-recoveries");
  args.push_back("0");
  SHARDD_ASSERT_OK(cluster_.StartShardctl(args));
  // Wait (bounded) until the job made progress, then kill rank 1.
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  bool running = false;
  while (absl::Now() < deadline && !running) {
    auto status = client_->GetStatus();
    running = status.ok() && status->jobs_size() == 1 &&
              status->jobs(0).steps_done() >= 2;
    if (!running) absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(running);
  const absl::Time killed_at = absl::Now();
  SHARDD_ASSERT_OK(cluster_.KillWorker(1));
  const ProcessResult train = cluster_.FinishShardctl(absl::Seconds(30));
  EXPECT_EQ(train.exit_code, 1);
  // Within the heartbeat timeout (2 s) plus slack, not the 20 s collective
  // timeout or a hang.
  EXPECT_LT(absl::Now() - killed_at, absl::Seconds(10));
  const std::string& err = train.err;
  EXPECT_THAT(err, HasSubstr("job j-1 failed: step "));
  EXPECT_THAT(err, HasSubstr("rank 1 (127.0.0.1:"));
  auto status = client_->GetStatus();
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->jobs(0).state(), v1::JOB_FAILED);
  // Once the coordinator declared rank 1 dead (heartbeat timeout), a new
  // job is refused at once, naming it.
  const absl::Time dead_by = absl::Now() + absl::Seconds(20);
  bool dead = false;
  while (absl::Now() < dead_by && !dead) {
    auto workers = client_->GetStatus();
    ASSERT_TRUE(workers.ok());
    for (const v1::WorkerInfo& worker : workers->workers()) {
      if (worker.rank() == 1 && !worker.alive()) dead = true;
    }
    if (!dead) absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_TRUE(dead);
  // (Without --dp, shardctl would plan for the one live worker and train.)
  std::vector<std::string> two = TrainArgs(2);
  two.push_back("--dp");
  two.push_back(absl::StrCat(kWorkers));
  ProcessResult refused = Shardctl(two, absl::Seconds(30));
  EXPECT_EQ(refused.exit_code, 1);
  EXPECT_THAT(refused.err, HasSubstr("FAILED_PRECONDITION"));
  EXPECT_THAT(refused.err, HasSubstr("rank 1 is dead"));
}

}  // namespace
}  // namespace shardd
