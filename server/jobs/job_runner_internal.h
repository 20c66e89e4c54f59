#ifndef SHARDD_SERVER_JOBS_JOB_RUNNER_INTERNAL_H_
#define SHARDD_SERVER_JOBS_JOB_RUNNER_INTERNAL_H_

// JobRunner's internals shared by job_runner.cc (queueing, membership,
// recovery policy, rank fan-out) and job_attempt.cc (one attempt at a job's
// steps). Not for other code.

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "checkpoint/checkpoint_writer.h"
#include "proto/worker.pb.h"
#include "server/jobs/job_runner.h"

namespace shardd {

struct JobRunner::Job {
  std::string id;
  std::string model_id;
  int32_t world_size = 0;
  int32_t total_steps = 0;
  // The step the job starts from (the checkpoint's, with resume_from).
  int64_t first_step = 0;
  // Read without the lock by the job's thread while it runs; cleared (under
  // JobRunner::mu_) when it ends, since plans of large worlds are big.
  JobSpec spec;
  std::shared_ptr<JobEventLog> events;
  std::thread thread;
  // Restored from the journal: the first attempt recovers.
  bool restored = false;
  // The fields below are guarded by JobRunner::mu_.
  v1::JobState state = v1::JOB_QUEUED;
  int64_t steps_done = 0;
  double last_loss = 0.0;
  double tokens_per_second = 0.0;
  double last_lr = 0.0;
  std::optional<double> last_eval_loss;
  // The steps done at the last evaluation (-1: none yet).
  int64_t last_eval_step = -1;
  std::string error;
  int32_t recoveries = 0;
  // The checkpoint a recovery reloads: the last one committed or loaded.
  std::string last_checkpoint;
  // Periodic saves that failed or were skipped, and the last reason.
  int32_t checkpoint_failures = 0;
  std::string last_checkpoint_error;
  // On-demand saves and rollbacks, served between steps.
  std::deque<Control> controls;
};

struct JobRunner::Control {
  bool save = false;
  std::string checkpoint;  // Rollback target.
  CheckpointCallback done;
};

// One thread per rank, so that every rank's blocking call of a round is in
// flight at the same time (a collective needs all of them), started on the
// round that first needs it (the step's and the job start's rounds use
// asynchronous calls and none). Each rank has its own lock and condition:
// one shared by thousands of waiting threads made every hand-out re-check
// all of their conditions. Run is called from one thread at a time.
class JobRunner::RankPool {
 public:
  explicit RankPool(int ranks) : threads_(ranks) {
    slots_.reserve(ranks);
    for (int rank = 0; rank < ranks; ++rank) {
      slots_.push_back(std::make_unique<Slot>());
    }
  }

  ~RankPool() {
    for (std::unique_ptr<Slot>& slot : slots_) {
      absl::MutexLock lock(&slot->mu);
      slot->stop = true;
    }
    for (std::thread& thread : threads_) {
      if (thread.joinable()) thread.join();
    }
  }

  RankPool(const RankPool&) = delete;
  RankPool& operator=(const RankPool&) = delete;

  // Runs `task` on `rank`'s thread; the rank must be idle.
  void Run(int rank, std::function<void()> task) {
    Slot& slot = *slots_[rank];
    {
      absl::MutexLock lock(&slot.mu);
      slot.task = std::move(task);
    }
    if (!threads_[rank].joinable()) {
      threads_[rank] = std::thread([&slot] { Loop(&slot); });
    }
  }

 private:
  struct Slot {
    absl::Mutex mu;
    bool stop ABSL_GUARDED_BY(mu) = false;
    std::function<void()> task ABSL_GUARDED_BY(mu);
  };

  static void Loop(Slot* slot) {
    while (true) {
      std::function<void()> task;
      {
        absl::MutexLock lock(&slot->mu);
        auto ready = [slot]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(slot->mu) {
          return slot->stop || slot->task != nullptr;
        };
        slot->mu.Await(absl::Condition(&ready));
        if (slot->task == nullptr) return;  // Stopping, nothing left.
        task = std::move(slot->task);
        slot->task = nullptr;
      }
      task();
    }
  }

  std::vector<std::unique_ptr<Slot>> slots_;
  std::vector<std::thread> threads_;
};

namespace job_internal {

// "rank 2 (ADDR)".
std::string RankLabel(int rank, const std::string& address);
// "CODE: message".
std::string Describe(const absl::Status& status);
// "step S/T".
std::string StepLabel(int64_t step, int32_t total);
// The same status (code and reason) with `prefix` before its message.
absl::Status Prefixed(absl::string_view prefix, const absl::Status& status);

}  // namespace job_internal
}  // namespace shardd

#endif  // SHARDD_SERVER_JOBS_JOB_RUNNER_INTERNAL_H_
