#include "tests/local_cluster.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "grpc/grpc.h"
#include "proto/coordinator.pb.h"
#include "model/native_spec.h"
#include "testing/numerics.h"
#include "tests/subprocess.h"
#include "worker/worker_runtime.h"

namespace shardd {
namespace testing_util {
namespace {

constexpr char kCoordinatorBinary[] = "server/shardd-coordinator";
constexpr char kWorkerBinary[] = "worker/shardd-worker";
constexpr char kShardctlBinary[] = "client/shardctl";
constexpr char kSmallMoe[] = "tests/data/small_moe.json";
constexpr size_t kTailBytes = 4096;

void KillNow(pid_t pid) {
  if (pid <= 0) return;
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
}

std::string Tail(const std::string& text) {
  if (text.size() <= kTailBytes) return text;
  return "..." + text.substr(text.size() - kTailBytes);
}

}  // namespace

LocalCluster::LocalCluster(Options options) : options_(std::move(options)) {
  grpc_init();
  static int counter = 0;
  dir_ = absl::StrCat(TempDir(), "/", options_.name, "_", getpid(), "_",
                      ++counter);
  checkpoint_dir_ = dir_ + "/checkpoints";
  std::error_code ignored;
  std::filesystem::create_directories(dir_, ignored);
  port_ = options_.port;
}

LocalCluster::~LocalCluster() {
  client_.reset();
  KillNow(background_);
  for (const auto& [rank, pid] : workers_) Stop(pid);
  Stop(coordinator_);
  grpc_shutdown();
}

std::string LocalCluster::CoordinatorBase() const {
  return absl::StrCat(dir_, "/coordinator", coordinator_runs_);
}

std::string LocalCluster::WorkerBase(int rank) const {
  const auto it = worker_runs_.find(rank);
  return absl::StrCat(dir_, "/worker", rank, "_",
                      it == worker_runs_.end() ? 0 : it->second);
}

std::string LocalCluster::CoordinatorLogPath() const {
  return CoordinatorBase() + ".err";
}

std::string LocalCluster::CoordinatorLog() const {
  return ReadFile(CoordinatorLogPath());
}

std::string LocalCluster::WorkerLogPath(int rank) const {
  return WorkerBase(rank) + ".err";
}

std::string LocalCluster::WorkerLog(int rank) const {
  return ReadFile(WorkerLogPath(rank));
}

pid_t LocalCluster::worker_pid(int rank) const {
  const auto it = workers_.find(rank);
  return it == workers_.end() ? -1 : it->second;
}

std::string LocalCluster::LogTails() const {
  std::string out =
      absl::StrCat("\n--- coordinator log tail ---\n", Tail(CoordinatorLog()));
  for (const auto& [rank, runs] : worker_runs_) {
    absl::StrAppend(&out, "\n--- worker ", rank, " log tail ---\n",
                    Tail(WorkerLog(rank)));
  }
  return out;
}

absl::Status LocalCluster::StartCoordinator() {
  if (coordinator_ > 0) {
    return absl::FailedPreconditionError("the coordinator is running");
  }
  const std::string data_dir = dir_ + "/data";
  // A restart must not read the previous run's port.
  std::error_code ignored;
  std::filesystem::remove(data_dir + "/coordinator.port", ignored);
  std::vector<std::string> argv = {
      kCoordinatorBinary, absl::StrCat("--listen=127.0.0.1:", port_),
      absl::StrCat("--data-dir=", data_dir),
      absl::StrCat("--workers=", options_.workers)};
  if (options_.checkpoints) {
    argv.push_back(absl::StrCat("--checkpoint-dir=", checkpoint_dir_));
  }
  argv.insert(argv.end(), options_.coordinator_flags.begin(),
              options_.coordinator_flags.end());
  ++coordinator_runs_;
  const std::string base = CoordinatorBase();
  coordinator_ = Spawn(argv, base + ".out", base + ".err");
  if (coordinator_ <= 0) {
    return absl::InternalError(absl::StrCat("cannot start ", argv[0]));
  }
  const int port = WaitForPortFile(data_dir, coordinator_, absl::Seconds(30));
  if (port <= 0) {
    return absl::InternalError(absl::StrCat(
        "the coordinator wrote no port file within 30 s (or exited)",
        LogTails()));
  }
  if (port_ != 0 && port != port_) {
    return absl::InternalError(
        absl::StrCat("the coordinator listens on ", port, ", not ", port_));
  }
  port_ = port;
  address_ = absl::StrCat("127.0.0.1:", port_);
  if (client_ == nullptr) {
    auto client = CoordinatorClient::Connect(address_, absl::Seconds(10));
    if (!client.ok()) return client.status();
    client_ = *std::move(client);
    client_->set_call_timeout(options_.call_timeout);
  }
  return absl::OkStatus();
}

absl::Status LocalCluster::KillCoordinator() {
  if (coordinator_ <= 0) {
    return absl::FailedPreconditionError("the coordinator is not running");
  }
  KillNow(coordinator_);
  coordinator_ = -1;
  return absl::OkStatus();
}

absl::Status LocalCluster::StartWorker(int rank,
                                       std::vector<std::string> extra) {
  if (address_.empty()) {
    return absl::FailedPreconditionError("no coordinator started yet");
  }
  if (workers_.count(rank) > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("worker ", rank, " is running"));
  }
  std::vector<std::string> argv = {kWorkerBinary,
                                   absl::StrCat("--coordinator=", address_),
                                   "--listen=127.0.0.1:0", "--device=cpu",
                                   absl::StrCat("--requested-rank=", rank)};
  if (options_.checkpoints) {
    argv.push_back(absl::StrCat("--checkpoint-root=", checkpoint_dir_));
  }
  argv.insert(argv.end(), extra.begin(), extra.end());
  ++worker_runs_[rank];
  const std::string base = WorkerBase(rank);
  const pid_t pid = Spawn(argv, base + ".out", base + ".err");
  if (pid <= 0) {
    return absl::InternalError(absl::StrCat("cannot start ", argv[0]));
  }
  workers_[rank] = pid;
  return absl::OkStatus();
}

absl::Status LocalCluster::StartWorkers(int n) {
  for (int rank = 0; rank < n; ++rank) {
    absl::Status started = StartWorker(rank);
    if (!started.ok()) return started;
  }
  return WaitForWorkers(n);
}

absl::Status LocalCluster::KillWorker(int rank) {
  const auto it = workers_.find(rank);
  if (it == workers_.end()) {
    return absl::NotFoundError(absl::StrCat("no worker ", rank, " running"));
  }
  KillNow(it->second);
  workers_.erase(it);
  return absl::OkStatus();
}

absl::Status LocalCluster::WaitForWorkers(int n, absl::Duration timeout) {
  if (client_ == nullptr) {
    return absl::FailedPreconditionError("no coordinator started yet");
  }
  const absl::Time deadline = absl::Now() + timeout;
  int alive = 0;
  while (true) {
    auto status = client_->GetStatus();
    alive = 0;
    if (status.ok()) {
      for (const v1::WorkerInfo& worker : status->workers()) {
        if (worker.alive()) ++alive;
      }
    }
    if (alive == n) return absl::OkStatus();
    if (absl::Now() >= deadline) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return absl::DeadlineExceededError(
      absl::StrCat(alive, " of ", n, " workers alive after ",
                   absl::FormatDuration(timeout), LogTails()));
}

LocalCluster::Result LocalCluster::Collect(pid_t pid, const std::string& base,
                                           absl::Duration timeout) {
  Result result;
  result.exit_code = WaitFor(pid, timeout);
  if (result.exit_code == -2) KillNow(pid);
  result.out = ReadFile(base + ".out");
  result.err = ReadFile(base + ".err");
  if (result.exit_code == -2) {
    absl::StrAppend(&result.err, "\nshardctl did not finish within ",
                    absl::FormatDuration(timeout), "; killed");
  }
  return result;
}

LocalCluster::Result LocalCluster::Shardctl(std::vector<std::string> args,
                                            absl::Duration timeout) {
  args.insert(args.begin(), kShardctlBinary);
  const std::string base = absl::StrCat(dir_, "/shardctl", ++shardctl_runs_);
  const pid_t pid = Spawn(args, base + ".out", base + ".err");
  if (pid <= 0) {
    Result result;
    result.err = absl::StrCat("cannot start ", kShardctlBinary);
    return result;
  }
  return Collect(pid, base, timeout);
}

absl::Status LocalCluster::StartShardctl(std::vector<std::string> args) {
  if (background_ > 0) {
    return absl::FailedPreconditionError("a background shardctl is running");
  }
  args.insert(args.begin(), kShardctlBinary);
  background_base_ = absl::StrCat(dir_, "/shardctl", ++shardctl_runs_);
  background_ =
      Spawn(args, background_base_ + ".out", background_base_ + ".err");
  if (background_ <= 0) {
    background_ = -1;
    return absl::InternalError(absl::StrCat("cannot start ", kShardctlBinary));
  }
  return absl::OkStatus();
}

LocalCluster::Result LocalCluster::FinishShardctl(absl::Duration timeout) {
  if (background_ <= 0) return Result();
  const pid_t pid = background_;
  background_ = -1;
  return Collect(pid, background_base_, timeout);
}

std::vector<std::string> LocalCluster::TrainArgs(
    int steps, int seed, const std::vector<std::string>& extra) const {
  std::vector<std::string> args = {"train",
                                   "--coordinator",
                                   address_,
                                   "--model",
                                   kSmallMoe,
                                   "--steps",
                                   absl::StrCat(steps),
                                   "--global-batch",
                                   "16",
                                   "--seq",
                                   "32",
                                   "--lr",
                                   "0.01",
                                   "--seed",
                                   absl::StrCat(seed),
                                   "--json"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

nlohmann::json LocalCluster::ParseTrainOutput(const std::string& out) {
  nlohmann::json steps = nlohmann::json::array();
  nlohmann::json summary(nlohmann::json::value_t::discarded);
  for (absl::string_view line : absl::StrSplit(out, '\n', absl::SkipEmpty())) {
    if (!summary.is_discarded()) {  // A line after the summary.
      return nlohmann::json(nlohmann::json::value_t::discarded);
    }
    nlohmann::json json = nlohmann::json::parse(line, nullptr, false);
    if (json.is_discarded() || !json.is_object() || !json.contains("event")) {
      return nlohmann::json(nlohmann::json::value_t::discarded);
    }
    if (json["event"] == "summary") {
      summary = std::move(json);
    } else if (json["event"] == "step") {
      steps.push_back(std::move(json));
    }
  }
  if (!summary.is_discarded()) summary["step_events"] = std::move(steps);
  return summary;
}

absl::StatusOr<double> LocalCluster::TrainArgsLossTolerance(int updates,
                                                            double loss,
                                                            int world) {
  std::ifstream in(kSmallMoe);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", kSmallMoe));
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<v1::ModelSpec> model = ModelSpecFromJson(text.str());
  if (!model.ok()) return model.status();
  // TrainArgs' config, with the worker's defaults for what it leaves out.
  v1::TrainConfig train;
  train.set_global_batch(16);
  train.set_seq_len(32);
  train.set_lr(0.01);
  absl::StatusOr<v1::TrainConfig> resolved =
      ResolveTrainConfig(train, world, 1);
  if (!resolved.ok()) return resolved.status();
  // The drift bound needs the clipping threshold as a bound on ||g||.
  if (resolved->grad_clip() <= 0) {
    return absl::FailedPreconditionError(
        "TrainArgsLossTolerance needs gradient clipping on");
  }
  const StepTolerances tol = MoeStepTolerances(
      model->dims(), train.global_batch() * train.seq_len(), world);
  return FreeRunningLossTolerance(updates, loss, AdamWConfigOf(*resolved),
                                  resolved->grad_clip(), tol);
}

}  // namespace testing_util
}  // namespace shardd
