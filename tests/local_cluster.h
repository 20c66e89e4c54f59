#ifndef SHARDD_TESTS_LOCAL_CLUSTER_H_
#define SHARDD_TESTS_LOCAL_CLUSTER_H_

// A shardd cluster of real processes on loopback for multi-process tests:
// one shardd-coordinator, shardd-worker processes by rank and shardctl
// runs, each logging to files in a scratch directory. Every wait is bounded;
// the destructor stops whatever is still running (background shardctl and
// workers first, the coordinator last). Errors carry the tails of the
// relevant logs so a failed assertion on them explains itself.
//
// Binaries are found at their runfiles paths, so the test target needs
// //server:shardd-coordinator, //worker:shardd-worker and //client:shardctl
// in its data.

#include <sys/types.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/coordinator_client.h"
#include "nlohmann/json.hpp"

namespace shardd {
namespace testing_util {

class LocalCluster {
 public:
  struct Options {
    // Prefix of the scratch directory (made under TempDir()).
    std::string name = "cluster";
    // The coordinator's --workers.
    int workers = 2;
    // Further coordinator flags.
    std::vector<std::string> coordinator_flags = {"--heartbeat-timeout=2s",
                                                  "--collective-timeout=20s"};
    // Gives the coordinator --checkpoint-dir=checkpoint_dir() and every
    // worker --checkpoint-root=checkpoint_dir() (one machine's shared disk).
    bool checkpoints = false;
    // The coordinator's first port; 0 picks a free one. Restarts always
    // reuse the port of the first start, where the workers look for it.
    int port = 0;
    // Deadline of the client's calls.
    absl::Duration call_timeout = absl::Seconds(30);
  };

  // A finished shardctl run. exit_code: -1 when it could not start or died
  // of a signal, -2 when it was killed at its timeout (err says so).
  struct Result {
    int exit_code = -1;
    std::string out;
    std::string err;
  };

  // Creates the scratch directory and calls grpc_init; starts nothing.
  explicit LocalCluster(Options options);
  // Kills a background shardctl, stops every worker and then the
  // coordinator (SIGTERM, then SIGKILL after 10 s), and calls grpc_shutdown.
  ~LocalCluster();

  LocalCluster(const LocalCluster&) = delete;
  LocalCluster& operator=(const LocalCluster&) = delete;

  // Starts the coordinator (again, after KillCoordinator, on the same port
  // and data dir), waits up to 30 s for its port file and connects client()
  // on the first start. Errors: FAILED_PRECONDITION (already running),
  // INTERNAL (cannot start, or it exited or wrote no port file in time),
  // UNAVAILABLE (the client could not connect).
  absl::Status StartCoordinator();

  // SIGKILLs the coordinator and reaps it. Errors: FAILED_PRECONDITION (not
  // running).
  absl::Status KillCoordinator();

  // Starts a worker asking for `rank`, with `extra` flags after the usual
  // ones (loopback, cpu, the coordinator's address). Errors:
  // FAILED_PRECONDITION (no coordinator started yet, or `rank` is running),
  // INTERNAL (cannot start).
  absl::Status StartWorker(int rank, std::vector<std::string> extra = {});

  // StartWorker for ranks 0..n-1, then WaitForWorkers(n).
  absl::Status StartWorkers(int n);

  // SIGKILLs the worker of `rank` and reaps it. Errors: NOT_FOUND (no such
  // worker running).
  absl::Status KillWorker(int rank);

  // Waits until the coordinator lists `n` alive workers. Errors:
  // DEADLINE_EXCEEDED (not within `timeout`; the message has the count and
  // the logs' tails).
  absl::Status WaitForWorkers(int n,
                              absl::Duration timeout = absl::Seconds(40));

  // Runs shardctl with `args` (no argv[0]) to completion, killing it after
  // `timeout`.
  Result Shardctl(std::vector<std::string> args,
                  absl::Duration timeout = absl::Seconds(120));

  // Starts shardctl with `args` in the background (one at a time). Errors:
  // FAILED_PRECONDITION (one is running), INTERNAL (cannot start).
  absl::Status StartShardctl(std::vector<std::string> args);

  // Waits for the background shardctl, killing it after `timeout`; an
  // exit_code of -1 and empty output when none was started.
  Result FinishShardctl(absl::Duration timeout);

  // shardctl arguments that train tests/data/small_moe.json on this
  // cluster for `steps` steps (global batch 16 x 32 tokens, lr 0.01, data
  // seed `seed`, a JSON summary on stdout), then `extra`. The test target
  // needs //tests/data:configs in its data.
  std::vector<std::string> TrainArgs(
      int steps, int seed, const std::vector<std::string>& extra = {}) const;

  // The output of `shardctl train --json`: one {"event": "step"} object
  // per line per step (or "interruption" / "recovery"), then the
  // {"event": "summary"} object. Returns the summary with the step lines
  // added as "step_events" (in order); a discarded value when a line is not
  // JSON or the summary is not last.
  static nlohmann::json ParseTrainOutput(const std::string& out);

  // The tolerance on the mean loss after `updates` optimizer steps when
  // jobs of TrainArgs at other world sizes or strategies are compared:
  // testing/numerics.h's FreeRunningLossTolerance for that model, batch and
  // train config, with `world` the larger world. Errors: reading or parsing
  // the model file, the train config's.
  static absl::StatusOr<double> TrainArgsLossTolerance(int updates, double loss,
                                                       int world);

  // Connected by the first StartCoordinator; null before.
  CoordinatorClient* client() { return client_.get(); }
  // "127.0.0.1:PORT" of the coordinator ("" before it started).
  const std::string& address() const { return address_; }
  // The scratch directory (its own per cluster; logs go there too).
  const std::string& dir() const { return dir_; }
  const std::string& checkpoint_dir() const { return checkpoint_dir_; }
  // -1 when not running.
  pid_t coordinator_pid() const { return coordinator_; }
  pid_t worker_pid(int rank) const;

  // Paths and contents of the latest run's stderr.
  std::string CoordinatorLogPath() const;
  std::string CoordinatorLog() const;
  std::string WorkerLogPath(int rank) const;
  std::string WorkerLog(int rank) const;

 private:
  // Log paths without the .out/.err suffix.
  std::string CoordinatorBase() const;
  std::string WorkerBase(int rank) const;
  // The last few KiB of the coordinator's and every started worker's
  // stderr, for error messages.
  std::string LogTails() const;
  Result Collect(pid_t pid, const std::string& base, absl::Duration timeout);

  const Options options_;
  std::string dir_;
  std::string checkpoint_dir_;
  std::string address_;
  int port_ = 0;
  pid_t coordinator_ = -1;
  int coordinator_runs_ = 0;
  std::map<int, pid_t> workers_;
  std::map<int, int> worker_runs_;
  pid_t background_ = -1;
  std::string background_base_;
  int shardctl_runs_ = 0;
  std::unique_ptr<CoordinatorClient> client_;
};

}  // namespace testing_util
}  // namespace shardd

#endif  // SHARDD_TESTS_LOCAL_CLUSTER_H_
