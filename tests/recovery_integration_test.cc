// End to end recovery: the real shardd-coordinator, shardd-worker processes
// and shardctl on loopback, with faults made by kill -9:
//   - the coordinator killed in the middle of a job and restarted on the
//     same --data-dir and port: workers re-register, shardctl reconnects,
//     and the job goes on from the step the workers hold;
//   - a worker killed in the middle of a job and started again: the job
//     reloads its last checkpoint by itself;
//   - under HSDP (2 x 2) a worker killed and started again: it heals from
//     its replica peer, with no checkpoint;
//   - a worker killed while it writes a checkpoint: the half-written save
//     is discarded and the job resumes from the previous checkpoint;
//   - on-demand save and rollback of a running job.
// In every case the job's losses equal an uninterrupted run's (the data is
// indexed by step and every recovery path restores exact fp32 state), which
// shows that no acknowledged step was lost and nothing half-applied stayed.
// Every wait is bounded and every process is killed in teardown.

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/coordinator_client.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "proto/coordinator.pb.h"
#include "tests/local_cluster.h"

namespace shardd {
namespace {

using ::shardd::testing_util::LocalCluster;
using ::testing::HasSubstr;

class RecoveryIntegrationTest : public ::testing::Test {
 protected:
  // Makes the cluster (for `workers` workers) and starts its coordinator.
  void StartCluster(int workers) {
    LocalCluster::Options options;
    options.name = "recovery";
    options.workers = workers;
    options.checkpoints = true;
    options.coordinator_flags = {"--heartbeat-timeout=2s",
                                 "--collective-timeout=15s",
                                 "--recovery-timeout=60s"};
    options.call_timeout = absl::Seconds(5);
    cluster_ = std::make_unique<LocalCluster>(options);
    SHARDD_ASSERT_OK(cluster_->StartCoordinator());
    client_ = cluster_->client();
    address_ = cluster_->address();
    checkpoint_dir_ = cluster_->checkpoint_dir();
  }

  std::string CoordinatorLog() { return cluster_->CoordinatorLog(); }

  // The job's state as GetStatus shows it (empty job_id: not listed).
  v1::JobInfo Job(const std::string& job_id) {
    // A restarted coordinator takes a moment to be reachable again.
    const absl::Time deadline = absl::Now() + absl::Seconds(15);
    auto status = client_->GetStatus();
    while (!status.ok() && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(100));
      status = client_->GetStatus();
    }
    if (status.ok()) {
      for (const v1::JobInfo& job : status->jobs()) {
        if (job.job_id() == job_id) return job;
      }
    }
    return v1::JobInfo();
  }

  // Waits until `job_id` has done at least `steps` steps.
  void WaitForSteps(const std::string& job_id, int64_t steps) {
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (absl::Now() < deadline) {
      if (Job(job_id).steps_done() >= steps) return;
      absl::SleepFor(absl::Milliseconds(20));
    }
    FAIL() << job_id << " did not reach step " << steps << "\n"
           << CoordinatorLog();
  }

  std::vector<std::string> TrainArgs(int steps,
                                     std::vector<std::string> extra) {
    extra.insert(extra.begin(), "--no-mixed-precision");
    return cluster_->TrainArgs(steps, /*seed=*/5, extra);
  }

  // Starts shardctl train in the background.
  void StartTraining(int steps, std::vector<std::string> extra) {
    SHARDD_ASSERT_OK(
        cluster_->StartShardctl(TrainArgs(steps, std::move(extra))));
  }

  // Waits for the background shardctl; its JSON summary.
  nlohmann::json FinishTraining() {
    const LocalCluster::Result run =
        cluster_->FinishShardctl(absl::Seconds(240));
    EXPECT_EQ(run.exit_code, 0) << run.err << "\n" << CoordinatorLog();
    if (run.exit_code != 0) return nlohmann::json::value_t::discarded;
    nlohmann::json json = LocalCluster::ParseTrainOutput(run.out);
    EXPECT_FALSE(json.is_discarded()) << "not JSON:\n" << run.out;
    return json;
  }

  nlohmann::json Train(int steps, std::vector<std::string> extra) {
    StartTraining(steps, std::move(extra));
    return FinishTraining();
  }

  // Runs shardctl to completion; exit code, and stdout then stderr.
  int Shardctl(std::vector<std::string> args, std::string* out) {
    const LocalCluster::Result run =
        cluster_->Shardctl(std::move(args), absl::Seconds(60));
    *out = run.out + run.err;
    return run.exit_code;
  }

  // step -> loss of a summary's committed trajectory.
  static std::map<int64_t, double> LossByStep(const nlohmann::json& json) {
    std::map<int64_t, double> out;
    if (json.is_discarded()) return out;
    for (size_t i = 0; i < json["losses"].size(); ++i) {
      out[json["step_numbers"][i].get<int64_t>()] = json["losses"][i];
    }
    return out;
  }

  // Every step `got` reports has the reference's loss, and it ends at
  // `steps`. The recovered job runs the reference's world size, plan and
  // data on restored shards, so its fp32 arithmetic is the reference's;
  // 1e-6 only leaves room for the order in which the coordinator adds the
  // ranks' double losses (a few 2^-53), not for numerical drift.
  static void ExpectSameLosses(const nlohmann::json& got,
                               const std::map<int64_t, double>& reference,
                               int64_t steps) {
    const std::map<int64_t, double> losses = LossByStep(got);
    ASSERT_FALSE(losses.empty());
    EXPECT_EQ(losses.rbegin()->first, steps);
    for (const auto& [step, loss] : losses) {
      ASSERT_EQ(reference.count(step), 1u) << "step " << step;
      EXPECT_NEAR(loss, reference.at(step), 1e-6 * reference.at(step))
          << "step " << step;
    }
  }

  static std::string Incidents(const nlohmann::json& json) {
    std::string out;
    if (json.is_discarded()) return out;
    for (const auto& line : json["incidents"]) {
      out += line.get<std::string>() + "\n";
    }
    return out;
  }

  std::unique_ptr<LocalCluster> cluster_;
  CoordinatorClient* client_ = nullptr;
  std::string address_;
  std::string checkpoint_dir_;
};

TEST_F(RecoveryIntegrationTest, CoordinatorKilledMidJobCarriesOnAfterRestart) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(2));
  SHARDD_ASSERT_OK(cluster_->StartWorkers(2));
  const nlohmann::json reference = Train(30, {"--dp", "2"});
  ASSERT_FALSE(reference.is_discarded());

  StartTraining(30, {"--dp", "2"});
  ASSERT_NO_FATAL_FAILURE(WaitForSteps("j-2", 5));
  SHARDD_ASSERT_OK(cluster_->KillCoordinator());
  SHARDD_ASSERT_OK(cluster_->StartCoordinator());
  const nlohmann::json resumed = FinishTraining();
  ASSERT_FALSE(resumed.is_discarded());
  ExpectSameLosses(resumed, LossByStep(reference), 30);
  EXPECT_THAT(CoordinatorLog(), HasSubstr("every worker still held step"));
  const v1::JobInfo job = Job("j-2");
  EXPECT_EQ(job.state(), v1::JOB_DONE);
  EXPECT_EQ(job.steps_done(), 30);
  // The finished first job is still known, and ids go on.
  EXPECT_EQ(Job("j-1").state(), v1::JOB_DONE);
}

TEST_F(RecoveryIntegrationTest,
       KilledWorkerRestartsAndTheJobReloadsItsCheckpoint) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(2));
  SHARDD_ASSERT_OK(cluster_->StartWorkers(2));
  const nlohmann::json reference = Train(24, {"--dp", "2"});
  ASSERT_FALSE(reference.is_discarded());

  StartTraining(24, {"--dp", "2", "--checkpoint-every", "4"});
  ASSERT_NO_FATAL_FAILURE(WaitForSteps("j-2", 6));
  SHARDD_ASSERT_OK(cluster_->KillWorker(1));
  SHARDD_ASSERT_OK(cluster_->StartWorker(1));
  const nlohmann::json resumed = FinishTraining();
  ASSERT_FALSE(resumed.is_discarded());
  ExpectSameLosses(resumed, LossByStep(reference), 24);
  EXPECT_THAT(Incidents(resumed), HasSubstr("reloaded checkpoint j-2/step-"));
  EXPECT_EQ(Job("j-2").recoveries(), 1);
}

// Expert parallelism (issue 31 item 4): 4 workers, experts in 2 blocks
// over 2 ranks each; a worker killed with SIGKILL mid-job comes back and
// the job reloads its last checkpoint, with the losses of an uninterrupted
// run.
TEST_F(RecoveryIntegrationTest, ExpertParallelJobRecoversFromAKilledWorker) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(4));
  SHARDD_ASSERT_OK(cluster_->StartWorkers(4));
  const nlohmann::json reference = Train(16, {"--dp", "4", "--ep", "2"});
  ASSERT_FALSE(reference.is_discarded());
  EXPECT_GT(reference["all_to_alls_per_step"].get<int64_t>(), 0);

  StartTraining(16, {"--dp", "4", "--ep", "2", "--checkpoint-every", "4"});
  ASSERT_NO_FATAL_FAILURE(WaitForSteps("j-2", 6));
  SHARDD_ASSERT_OK(cluster_->KillWorker(2));
  SHARDD_ASSERT_OK(cluster_->StartWorker(2));
  const nlohmann::json resumed = FinishTraining();
  ASSERT_FALSE(resumed.is_discarded());
  ExpectSameLosses(resumed, LossByStep(reference), 16);
  EXPECT_THAT(Incidents(resumed), HasSubstr("reloaded checkpoint j-2/step-"));
}

TEST_F(RecoveryIntegrationTest, LostHsdpReplicaHealsFromItsPeer) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(4));
  SHARDD_ASSERT_OK(cluster_->StartWorkers(4));
  const nlohmann::json reference = Train(16, {"--dp", "2", "--replicate", "2"});
  ASSERT_FALSE(reference.is_discarded());

  StartTraining(16, {"--dp", "2", "--replicate", "2"});
  ASSERT_NO_FATAL_FAILURE(WaitForSteps("j-2", 4));
  SHARDD_ASSERT_OK(cluster_->KillWorker(3));
  SHARDD_ASSERT_OK(cluster_->StartWorker(3));
  const nlohmann::json resumed = FinishTraining();
  ASSERT_FALSE(resumed.is_discarded());
  ExpectSameLosses(resumed, LossByStep(reference), 16);
  const std::string incidents = Incidents(resumed);
  // Rank 3's shard-group peer (rank 2) heals too when the kill caught it
  // inside a collective with rank 3 (its shards are then half-updated);
  // replica 0 (ranks 0-1) never does.
  EXPECT_THAT(incidents, ::testing::ContainsRegex(
                             "healed ranks (2-)?3 from their replica peers"));
  EXPECT_THAT(incidents, ::testing::Not(HasSubstr("reloaded checkpoint")));
}

TEST_F(RecoveryIntegrationTest, WorkerKilledWhileWritingACheckpoint) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(2));
  SHARDD_ASSERT_OK(cluster_->StartWorker(0));
  SHARDD_ASSERT_OK(cluster_->StartWorker(1, {"--debug-save-delay=4s"}));
  SHARDD_ASSERT_OK(cluster_->WaitForWorkers(2));
  StartTraining(8, {"--dp", "2", "--checkpoint-every", "2"});
  // The first save (after step 2) commits; kill rank 1 inside the second.
  const std::string job_dir = checkpoint_dir_ + "/j-1";
  const absl::Time deadline = absl::Now() + absl::Seconds(90);
  bool killed = false;
  while (!killed && absl::Now() < deadline) {
    std::error_code error;
    bool committed_first =
        std::filesystem::exists(job_dir + "/step-00000002/index.json", error);
    if (committed_first) {
      for (const auto& entry :
           std::filesystem::directory_iterator(job_dir, error)) {
        const std::string name = entry.path().filename().string();
        // checkpoint::BeginCheckpoint's temporary directory for step 4.
        if (absl::StartsWith(name, ".tmp") &&
            absl::StrContains(name, "step-4-")) {
          SHARDD_ASSERT_OK(cluster_->KillWorker(1));
          killed = true;
          break;
        }
      }
    }
    if (!killed) absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(killed) << CoordinatorLog();
  EXPECT_FALSE(std::filesystem::exists(job_dir + "/step-00000004"));
  SHARDD_ASSERT_OK(cluster_->StartWorker(1));
  const nlohmann::json resumed = FinishTraining();
  ASSERT_FALSE(resumed.is_discarded());
  EXPECT_THAT(Incidents(resumed),
              HasSubstr("reloaded checkpoint j-1/step-00000002"));
  EXPECT_EQ(resumed["step_numbers"].back(), 8);
  // No half-written save is left, and every committed one is whole.
  for (const auto& entry : std::filesystem::directory_iterator(job_dir)) {
    const std::string name = entry.path().filename().string();
    EXPECT_FALSE(absl::StartsWith(name, ".tmp")) << name;
    EXPECT_TRUE(std::filesystem::exists(entry.path() / "index.json")) << name;
  }
  EXPECT_TRUE(std::filesystem::exists(job_dir + "/step-00000008/index.json"));
}

TEST_F(RecoveryIntegrationTest, OnDemandSaveAndRollbackOfARunningJob) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(2));
  SHARDD_ASSERT_OK(cluster_->StartWorkers(2));
  const nlohmann::json reference = Train(40, {"--dp", "2"});
  ASSERT_FALSE(reference.is_discarded());

  // Periodic saves too: the steps the rollback runs again save again.
  StartTraining(40, {"--dp", "2", "--checkpoint-every", "5"});
  ASSERT_NO_FATAL_FAILURE(WaitForSteps("j-2", 3));
  std::string out;
  ASSERT_EQ(Shardctl({"checkpoint", "save", "--coordinator", address_, "--job",
                      "j-2", "--json"},
                     &out),
            0)
      << out;
  auto saved = nlohmann::json::parse(out, nullptr, false);
  ASSERT_FALSE(saved.is_discarded()) << out;
  const std::string name = saved["checkpoint"];
  EXPECT_THAT(name, HasSubstr("j-2/step-"));
  ASSERT_NO_FATAL_FAILURE(WaitForSteps("j-2", 10));
  ASSERT_EQ(Shardctl({"checkpoint", "load", "--coordinator", address_, "--job",
                      "j-2", "--checkpoint", name},
                     &out),
            0)
      << out;
  EXPECT_THAT(out, HasSubstr("rolled back to " + name));
  const nlohmann::json rolled = FinishTraining();
  ASSERT_FALSE(rolled.is_discarded());
  ExpectSameLosses(rolled, LossByStep(reference), 40);
  EXPECT_THAT(Incidents(rolled),
              HasSubstr("rolled back to checkpoint " + name));
  // A finished job takes no more requests.
  EXPECT_EQ(Shardctl({"checkpoint", "save", "--coordinator", address_, "--job",
                      "j-2"},
                     &out),
            1);
  EXPECT_THAT(out, HasSubstr("FAILED_PRECONDITION"));
}

// Retention never deletes a save asked for on demand: a job saving every 2
// steps and keeping 1 ends with its last periodic checkpoint and the
// on-demand one (pinned), nothing else.
TEST_F(RecoveryIntegrationTest, RetentionKeepsOnDemandSaves) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(2));
  SHARDD_ASSERT_OK(cluster_->StartWorkers(2));
  StartTraining(20, {"--dp", "2", "--checkpoint-every", "2",
                     "--keep-checkpoints", "1"});
  ASSERT_NO_FATAL_FAILURE(WaitForSteps("j-1", 3));
  std::string out;
  ASSERT_EQ(Shardctl({"checkpoint", "save", "--coordinator", address_, "--job",
                      "j-1", "--json"},
                     &out),
            0)
      << out;
  auto saved = nlohmann::json::parse(out, nullptr, false);
  ASSERT_FALSE(saved.is_discarded()) << out;
  const std::string pinned = saved["checkpoint"];
  const nlohmann::json done = FinishTraining();
  ASSERT_FALSE(done.is_discarded());
  EXPECT_FALSE(done["checkpoints_deleted"].empty());
  ASSERT_EQ(Shardctl({"checkpoint", "list", "--coordinator", address_,
                      "--json"},
                     &out),
            0)
      << out;
  auto listed = nlohmann::json::parse(out, nullptr, false);
  ASSERT_FALSE(listed.is_discarded()) << out;
  std::vector<std::string> names;
  for (const auto& c : listed["checkpoints"]) names.push_back(c["name"]);
  if (pinned == "j-1/step-00000020") {
    EXPECT_EQ(names, std::vector<std::string>({pinned}));
  } else {
    EXPECT_EQ(names, std::vector<std::string>({"j-1/step-00000020", pinned}));
  }
}

}  // namespace
}  // namespace shardd
