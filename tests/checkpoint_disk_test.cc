// Checkpoints on a disk that fills up (issue 30), end to end: the real
// coordinator, two workers and shardctl as subprocesses on loopback, their
// checkpoint directory a small tmpfs mounted in a private mount namespace
// of this test (the processes it starts inherit it). Sizes come from the
// plan's own checkpoint size (`shardctl plan --json`):
//   - a save that does not fit is not started: the job fails, or with
//     --on-checkpoint-failure skip trains on, and says so in its events and
//     in `shardctl status`; the previous checkpoints stay valid;
//   - retention (--keep-checkpoints) frees the room a save needs and keeps
//     the newest;
//   - with the space check off, the disk fills in the middle of the rank
//     files' writes: the save fails with "No space left on device", its
//     temporary directory goes, the earlier checkpoint lists and resumes.
// Every wait is bounded and every process is killed in teardown.

#include <sched.h>
#include <sys/mount.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <httplib.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/local_cluster.h"

namespace shardd {
namespace {

using ::shardd::testing_util::LocalCluster;
using ::testing::HasSubstr;
using ProcessResult = LocalCluster::Result;

constexpr int kWorkers = 2;

// The test's own mount namespace, once per process, so that its tmpfs
// mounts are private and vanish with it.
bool PrivateMounts(std::string* why) {
  static bool done = false;
  static std::string error;
  if (!done) {
    done = true;
    if (unshare(CLONE_NEWNS) != 0) {
      error = absl::StrCat("unshare(CLONE_NEWNS): ", std::strerror(errno));
    } else if (mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr) !=
               0) {
      error = absl::StrCat("making / private: ", std::strerror(errno));
    }
  }
  *why = error;
  return error.empty();
}

class CheckpointDiskTest : public ::testing::Test {
 protected:
  // A cluster whose checkpoint directory is a tmpfs with room for `room`
  // times what the coordinator asks to be free for one save of the
  // training job (its checkpoint plus margin; with `bare`, times the
  // checkpoint alone), with `flags` added to the coordinator's.
  void StartCluster(double room, bool bare = false,
                    std::vector<std::string> flags = {}) {
    flags.push_back("--metrics-listen=127.0.0.1:0");
    std::string why;
    ASSERT_TRUE(PrivateMounts(&why))
        << why << " (this test needs to mount a tmpfs: run it as root)";
    LocalCluster::Options options;
    options.name = "disk";
    options.workers = kWorkers;
    options.checkpoints = true;
    for (std::string& f : flags) options.coordinator_flags.push_back(f);
    cluster_ = std::make_unique<LocalCluster>(options);
    // One checkpoint of the job, as the plan says.
    ProcessResult plan = cluster_->Shardctl(
        {"plan", "--model", "tests/data/small_moe.json", "--dp",
         absl::StrCat(kWorkers), "--json"});
    ASSERT_EQ(plan.exit_code, 0) << plan.err;
    const nlohmann::json json = nlohmann::json::parse(plan.out, nullptr, false);
    ASSERT_FALSE(json.is_discarded()) << plan.out;
    checkpoint_bytes_ = json["checkpoint"]["total_bytes"].get<int64_t>();
    ASSERT_GT(checkpoint_bytes_, 0);
    // What the coordinator asks to be free for one save.
    const int64_t need = checkpoint_bytes_ + checkpoint_bytes_ / 50 + (1 << 20);
    const int64_t size =
        static_cast<int64_t>(room * (bare ? checkpoint_bytes_ : need));
    const std::string dir = cluster_->checkpoint_dir();
    std::filesystem::create_directories(dir);
    ASSERT_EQ(mount("tmpfs", dir.c_str(), "tmpfs", 0,
                    absl::StrCat("size=", size).c_str()),
              0)
        << "mount tmpfs at " << dir << ": " << std::strerror(errno);
    mounted_ = dir;
    SHARDD_ASSERT_OK(cluster_->StartCoordinator());
    SHARDD_ASSERT_OK(cluster_->StartWorkers(kWorkers));
  }

  void TearDown() override {
    cluster_.reset();  // Processes first, then the mount.
    if (!mounted_.empty()) umount2(mounted_.c_str(), MNT_DETACH);
  }

  // Trains `steps` steps saving after every one; the summary, or a
  // discarded value with the run in *run.
  nlohmann::json Train(int steps, std::vector<std::string> extra,
                       ProcessResult* run) {
    extra.insert(extra.begin(), {"--dp", absl::StrCat(kWorkers),
                                 "--checkpoint-every", "1"});
    *run = cluster_->Shardctl(cluster_->TrainArgs(steps, /*seed=*/5, extra));
    if (run->exit_code != 0) return nlohmann::json::value_t::discarded;
    return LocalCluster::ParseTrainOutput(run->out);
  }

  // The committed checkpoints `shardctl checkpoint list` shows.
  std::vector<std::string> Listed() {
    ProcessResult list = cluster_->Shardctl(
        {"checkpoint", "list", "--coordinator", cluster_->address(), "--json"});
    EXPECT_EQ(list.exit_code, 0) << list.err;
    std::vector<std::string> out;
    const nlohmann::json json = nlohmann::json::parse(list.out, nullptr, false);
    if (json.is_discarded()) return out;
    for (const auto& c : json["checkpoints"]) out.push_back(c["name"]);
    return out;
  }

  // No save in progress or half-deleted checkpoint left in the job's dir.
  void ExpectNoTemporaries(const std::string& job) {
    const std::string dir = cluster_->checkpoint_dir() + "/" + job;
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
      EXPECT_FALSE(absl::StartsWith(entry.path().filename().string(), ".tmp-"))
          << entry.path();
    }
  }

  // The coordinator's /metrics value of an unlabelled series (-1: none).
  double Metric(const std::string& name) {
    const std::string log = cluster_->CoordinatorLog();
    constexpr absl::string_view kMarker = "metrics listening on ";
    const size_t at = log.find(std::string(kMarker));
    if (at == std::string::npos) return -1;
    const size_t end = log.find_first_of("\"\n", at);
    const std::string address =
        log.substr(at + kMarker.size(), end - at - kMarker.size());
    int port = 0;
    if (!absl::SimpleAtoi(address.substr(address.rfind(':') + 1), &port)) {
      return -1;
    }
    httplib::Client client("127.0.0.1", port);
    client.set_connection_timeout(5);
    client.set_read_timeout(10);
    httplib::Result result = client.Get("/metrics");
    if (!result || result->status != 200) return -1;
    for (absl::string_view line : absl::StrSplit(result->body, '\n')) {
      if (absl::ConsumePrefix(&line, name + " ")) {
        double value = 0;
        if (absl::SimpleAtod(line, &value)) return value;
      }
    }
    return -1;
  }

  std::string Status() {
    ProcessResult status =
        cluster_->Shardctl({"status", "--coordinator", cluster_->address()});
    EXPECT_EQ(status.exit_code, 0) << status.err;
    return status.out;
  }

  std::unique_ptr<LocalCluster> cluster_;
  std::string mounted_;
  int64_t checkpoint_bytes_ = 0;
};

TEST_F(CheckpointDiskTest, ASaveThatDoesNotFitFailsOrIsSkipped) {
  StartCluster(/*room=*/1.5);
  // The default policy: the second save cannot fit, the job fails before
  // writing it, the first stays.
  ProcessResult run;
  Train(3, {}, &run);
  EXPECT_NE(run.exit_code, 0);
  EXPECT_THAT(run.err + run.out, HasSubstr("bytes free"));
  EXPECT_EQ(Listed(), std::vector<std::string>({"j-1/step-00000001"}));
  ExpectNoTemporaries("j-1");

  // skip: the job trains on, reporting each save it could not make.
  std::filesystem::remove_all(cluster_->checkpoint_dir() + "/j-1");
  const nlohmann::json json = Train(3, {"--on-checkpoint-failure", "skip"},
                                    &run);
  ASSERT_FALSE(json.is_discarded()) << run.err;
  EXPECT_EQ(json["losses"].size(), 3u);
  EXPECT_EQ(json["checkpoints"], nlohmann::json({"j-2/step-00000001"}));
  ASSERT_EQ(json["checkpoint_failures"].size(), 2u) << json.dump();
  EXPECT_THAT(json["checkpoint_failures"][0]["error"].get<std::string>(),
              HasSubstr("bytes free"));
  EXPECT_EQ(Listed(), std::vector<std::string>({"j-2/step-00000001"}));
  ExpectNoTemporaries("j-2");
  const std::string status = Status();
  EXPECT_THAT(status, HasSubstr("2 checkpoint save(s) failed"));
  EXPECT_THAT(status, HasSubstr("3 save(s) failed"));  // coordinator total
  EXPECT_EQ(Metric("shardd_coordinator_checkpoint_failures_total"), 3.0);
  // The one checkpoint is whole: a job resumes from it.
  ProcessResult resumed = cluster_->Shardctl(cluster_->TrainArgs(
      1, 5, {"--dp", "2", "--resume-from", "j-2/step-00000001"}));
  EXPECT_EQ(resumed.exit_code, 0) << resumed.err;
}

TEST_F(CheckpointDiskTest, RetentionMakesRoomAndKeepsTheNewest) {
  StartCluster(/*room=*/2.6);
  // What a coordinator killed mid-deletion leaves in the job's directory
  // (the job ids continue from 1 here): the job's start removes it.
  const std::string stale =
      cluster_->checkpoint_dir() + "/j-1/.tmp-deleted-step-00000009-AbCdEf";
  std::filesystem::create_directories(stale);
  { std::ofstream(stale + "/rank-00000.safetensors") << "partial"; }
  ProcessResult run;
  const nlohmann::json json =
      Train(5, {"--keep-checkpoints", "2"}, &run);
  ASSERT_FALSE(json.is_discarded()) << run.err;
  // Every save made it; the older ones went as newer ones committed (or,
  // short of room, just before the save that needed it).
  EXPECT_EQ(json["checkpoints"].size(), 5u) << json.dump();
  EXPECT_EQ(json["checkpoint_failures"].size(), 0u) << json.dump();
  EXPECT_EQ(json["checkpoints_deleted"],
            nlohmann::json({"j-1/step-00000001", "j-1/step-00000002",
                            "j-1/step-00000003"}));
  EXPECT_EQ(Listed(), std::vector<std::string>(
                          {"j-1/step-00000005", "j-1/step-00000004"}));
  ExpectNoTemporaries("j-1");
  EXPECT_THAT(Status(), HasSubstr("3 deleted by retention"));
  EXPECT_EQ(Metric("shardd_coordinator_checkpoints_deleted_total"), 3.0);
}

TEST_F(CheckpointDiskTest, AFullDiskMidSaveLeavesThePreviousCheckpoint) {
  // Room for one checkpoint and a half: the second's files cannot fit.
  StartCluster(/*room=*/1.5, /*bare=*/true,
               {"--checkpoint-space-check=false"});
  ProcessResult run;
  const nlohmann::json json =
      Train(2, {"--on-checkpoint-failure", "skip"}, &run);
  ASSERT_FALSE(json.is_discarded()) << run.err;
  EXPECT_EQ(json["checkpoints"], nlohmann::json({"j-1/step-00000001"}));
  ASSERT_EQ(json["checkpoint_failures"].size(), 1u) << json.dump();
  // The write itself ran out of room (nothing refused it beforehand).
  EXPECT_THAT(json["checkpoint_failures"][0]["error"].get<std::string>(),
              HasSubstr("No space left on device"));
  EXPECT_EQ(Listed(), std::vector<std::string>({"j-1/step-00000001"}));
  ExpectNoTemporaries("j-1");
  ProcessResult resumed = cluster_->Shardctl(cluster_->TrainArgs(
      1, 5, {"--dp", "2", "--resume-from", "j-1/step-00000001"}));
  EXPECT_EQ(resumed.exit_code, 0) << resumed.err;
}

}  // namespace
}  // namespace shardd
