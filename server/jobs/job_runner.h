#ifndef SHARDD_SERVER_JOBS_JOB_RUNNER_H_
#define SHARDD_SERVER_JOBS_JOB_RUNNER_H_

// Runs training jobs (SubmitStep / WatchStep) against the workers, free of
// any transport: workers are reached through WorkerClient (worker_client.h)
// and membership comes from the WorkerRegistry.
//
// A job is a plan laid out for W ranks, its compiled step program and a
// TrainConfig. Jobs run one at a time, in submission order (they share the
// workers, and a worker holds one plan). A job's thread:
//   1. checks that ranks 0..W-1 are registered and alive and snapshots
//      their addresses and incarnations (registry rank r is plan rank r);
//   2. LoadPlan on every rank concurrently (plan, model, train config, job
//      id and membership epoch for the rendezvous keys);
//   3. for each step s (0-based; the event reports s + 1 steps done):
//      Execute(program with step s) on every rank concurrently, or, in the
//      fine-grained mode, RunCommand for each command in program order on
//      every rank concurrently (a command waits for all ranks before the
//      next one: its collectives need every rank);
//   3a. with config.resume_from, before the first step: LoadShards on every
//      rank (each reads what it owns under its own plan, any saved world
//      size or strategy); the steps then run from the checkpoint's step on;
//   3b. with config.checkpoint_every N, after every step k with k % N == 0:
//      BeginCheckpoint under <checkpoint_dir>/<job-id>, SaveShards on the
//      ranks of replica 0, BuildIndex and CommitCheckpoint (atomic: a crash
//      leaves the previous checkpoints valid). The step's event names the
//      checkpoint. A failed save fails the job (training on without the
//      checkpoints asked for would hide the failure until it is needed);
//      the half-written save directory is removed;
//   4. aggregates each step (token-weighted mean loss over ranks, global
//      tokens, max measured peak and collectives over ranks, rank 0's
//      gradient norm) into a StepEvent.
// Every call carries a deadline (collective_timeout + rpc_margin). While
// calls are in flight the runner polls the registry: a worker declared dead
// (no heartbeat for the registry's timeout) or restarted fails the step
// without waiting for its hung call. A failure names the step, the rank, its
// address and the error, e.g. "step 3/100: rank 2 (127.0.0.1:4567):
// ABORTED: ...".
//
// Recovery. A step either commits on every rank or on none (workers apply
// AdamW only after the step's last collective). When a step fails for a
// reason that may pass (a worker died, restarted or left; a collective or
// RPC aborted, timed out or found its peer unreachable) and the job has
// recoveries left (TrainConfig.max_recoveries), the runner publishes an
// event with `interruption` set (the stream goes on), the job turns
// JOB_RECOVERING and waits up to recovery_timeout for ranks 0..W-1 to be
// alive again, then asks every worker what it holds (GetStats) and picks the
// cheapest way back, announced by an event with `recovery` set:
//   - every rank still holds the job at the same step k: LoadPlan with
//     keep_state (new collective groups, same shards) and go on from k;
//   - HSDP (dp_replicate >= 2): for every shard rank some replica still
//     holds step k = the highest step held: the others LoadPlan fresh, the
//     holders keep their state, HealReplicas copies it to the rest, go on
//     from k (no checkpoint, no lost step);
//   - otherwise reload the job's last checkpoint (one it committed, or its
//     resume_from; steps after it run again and, the data being indexed by
//     step, give the same results), or, without one, start over from the
//     job's first step.
// Bad input (INVALID_ARGUMENT, NOT_FOUND, DATA_LOSS, ...) and a state store
// that cannot record progress fail the job at once: one event whose `error`
// says why ends the stream.
//
// Durability (with a JobJournal). Submit answers once the job is durable;
// each step's progress (steps done, last checkpoint) is durable before its
// event is published. A runner created on the same journal after a crash
// lists the finished jobs and carries the unfinished ones on as recovering
// jobs: workers that kept running still hold their shards, so a job whose
// coordinator was killed loses no committed step. Shutdown leaves the
// journal saying "running", so a restart also carries jobs on.
//
// Events are kept in memory (the last max_events_per_job of each job; the
// last max_finished_jobs finished jobs) and can be watched from any step.
//
// Thread-safe.

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/coordinator.pb.h"
#include "proto/model.pb.h"
#include "proto/plan.pb.h"
#include "proto/worker.pb.h"
#include "server/jobs/job_checkpoints.h"
#include "server/jobs/job_event_log.h"
#include "server/jobs/job_journal.h"
#include "server/jobs/worker_client.h"
#include "server/worker_registry.h"

namespace shardd {

struct JobRunnerOptions {
  // Queued plus running jobs; more are refused with RESOURCE_EXHAUSTED.
  int max_pending_jobs = 16;
  // Finished jobs kept for WatchStep and status (oldest dropped first).
  int max_finished_jobs = 256;
  // Events kept per job (oldest dropped first).
  size_t max_events_per_job = 100000;
  // Sent to the workers (LoadPlanRequest.collective_timeout_ms): bounds each
  // wait for a peer inside a collective.
  absl::Duration collective_timeout = absl::Seconds(60);
  // Added to collective_timeout for every RPC's deadline: a worker reports
  // a collective timeout itself before the coordinator gives up on it.
  absl::Duration rpc_margin = absl::Seconds(30);
  // How often a waiting job checks the workers' liveness and shutdown.
  absl::Duration poll_interval = absl::Milliseconds(100);
  // After the first failed call of a round, how long the others may still
  // answer before they are cancelled, so that the error reported is the
  // cause (e.g. the dead worker) rather than a peer's aborted collective.
  absl::Duration failure_grace = absl::Milliseconds(300);
  // Durable jobs (job_journal.h; not owned, may be null: jobs do not survive
  // a restart).
  JobJournal* journal = nullptr;
  // How long a recovering job waits for ranks 0..W-1 to be alive again.
  absl::Duration recovery_timeout = absl::Minutes(5);
  // What TrainConfig.max_recoveries = 0 means.
  int default_max_recoveries = 3;
  // Where jobs' checkpoints live: <checkpoint_dir>/<job-id>/step-NNNNNNNN
  // (checkpoint/checkpoint_writer.h). Workers resolve the same
  // relative paths under their --checkpoint-root, so both must name one
  // directory on a file system they share (one machine, or a network file
  // system). Empty: jobs asking for checkpoint_every or resume_from are
  // refused with FAILED_PRECONDITION. Job ids continue after the highest
  // j-<n> directory found here, so a restarted coordinator does not reuse
  // a job's checkpoint directory.
  std::string checkpoint_dir;
  // Whether a save first checks the free space (TrainConfig
  // on_checkpoint_failure says what a shortage does).
  bool check_checkpoint_space = true;
};

// What SubmitStep hands the runner: everything a job needs, checked.
struct JobSpec {
  std::string model_id;
  v1::ModelSpec model;
  // Laid out for plan.world_size() ranks; plan.step() is the job's step
  // shape (microbatches, passes, defer_grad_sync).
  v1::ShardingPlan plan;
  // The options `plan` was planned with from `model` (ShardingPlanner, no
  // timeline). Set: LoadPlan sends them instead of the plan and each worker
  // derives it (a rank whose planning disagrees gets the plan). Unset: the
  // plan is sent.
  std::optional<v1::PlanOptions> plan_options;
  // CompileStepProgram(plan).
  v1::StepProgram program;
  // CompileEvalProgram(plan) when the job evaluates (config.eval_data_path
  // set), else empty.
  v1::StepProgram eval_program;
  // Normalized: defaults filled in, steps >= 1.
  v1::TrainConfig config;
};

// A job as GetStatus shows it.
struct JobSummary {
  std::string job_id;
  std::string model_id;
  v1::JobState state = v1::JOB_STATE_UNSPECIFIED;
  int32_t world_size = 0;
  int64_t steps_done = 0;
  int32_t total_steps = 0;
  double last_loss = 0.0;
  double tokens_per_second = 0.0;
  double last_lr = 0.0;
  // The last evaluation's held-out loss; none before the first.
  std::optional<double> last_eval_loss;
  std::string error;
  int32_t recoveries = 0;
  std::string last_checkpoint;
  int32_t checkpoint_failures = 0;
  std::string last_checkpoint_error;
};

// Checkpoint outcomes since the coordinator started.
struct CheckpointCounters {
  int64_t failures = 0;  // Periodic saves that failed or were skipped.
  int64_t deleted = 0;   // Checkpoints retention deleted.
};

// What an on-demand save or rollback did: the checkpoint (relative to the
// checkpoint dir) and the step it holds.
struct CheckpointResult {
  std::string checkpoint;
  int64_t step = 0;
};
using CheckpointCallback =
    std::function<void(absl::StatusOr<CheckpointResult>)>;

class JobRunner {
 public:
  // `workers` is not owned and must outlive the runner; `factory` makes a
  // client per worker address for each job.
  JobRunner(WorkerRegistry* workers, WorkerClientFactory factory,
            JobRunnerOptions options = {});
  // Shutdown().
  ~JobRunner();

  JobRunner(const JobRunner&) = delete;
  JobRunner& operator=(const JobRunner&) = delete;

  // Queues a job and returns its id ("j-<n>", n counting from 1).
  // Errors: INVALID_ARGUMENT (plan.world_size() < 1, config.steps < 1, an
  // empty program, config.checkpoint_every < 0, config.resume_from not a
  // plain relative path), NOT_FOUND (resume_from is not a committed
  // checkpoint), DATA_LOSS (its index.json is malformed),
  // FAILED_PRECONDITION (checkpoints asked for without a checkpoint_dir),
  // FAILED_PRECONDITION (ranks 0..W-1 are not all registered and alive: the
  // message names the missing and dead ranks), RESOURCE_EXHAUSTED
  // (max_pending_jobs queued or running), UNAVAILABLE (shutting down).
  absl::StatusOr<std::string> Submit(JobSpec spec) ABSL_LOCKS_EXCLUDED(mu_);

  // The event log of a job. Errors: NOT_FOUND (unknown or forgotten job).
  absl::StatusOr<std::shared_ptr<JobEventLog>> Events(
      const std::string& job_id) const ABSL_LOCKS_EXCLUDED(mu_);

  // Every kept job in submission order.
  std::vector<JobSummary> ListJobs() const ABSL_LOCKS_EXCLUDED(mu_);
  // Checkpoint failures and retention deletions since the start.
  CheckpointCounters checkpoint_counters() const ABSL_LOCKS_EXCLUDED(mu_);

  // Asks running job `job_id` to commit a checkpoint after the step in
  // progress. `done` runs exactly once: on the job's thread once committed,
  // or at once for a refusal. Errors: NOT_FOUND (unknown job),
  // FAILED_PRECONDITION (no checkpoint_dir; the job is queued, recovering
  // or finished), ABORTED (the job stopped before it saved), the save's
  // own errors.
  void RequestSave(const std::string& job_id, CheckpointCallback done)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Asks running job `job_id` to roll back to committed checkpoint
  // `checkpoint` (any job's, any world size or strategy) after the step in
  // progress and to train on from its step. `done` as RequestSave.
  // Errors: as RequestSave, plus INVALID_ARGUMENT (not a plain relative
  // path; the checkpoint's step is not before the job's last step),
  // NOT_FOUND (no such committed checkpoint), DATA_LOSS (a malformed
  // index.json), the workers' LoadShards errors.
  void RequestLoad(const std::string& job_id, const std::string& checkpoint,
                   CheckpointCallback done) ABSL_LOCKS_EXCLUDED(mu_);

  // Fails queued and running jobs ("the coordinator is shutting down"),
  // cancels their calls, and joins their threads; later Submits answer
  // UNAVAILABLE. Idempotent.
  void Shutdown() ABSL_LOCKS_EXCLUDED(mu_, shutdown_mu_);

 private:
  struct Job;
  struct Control;
  class RankPool;
  class Attempt;
  struct WorkerSnapshot {
    std::string address;
    uint64_t incarnation = 0;
  };

  // Starts the journal's jobs (constructor).
  void RestoreJobs() ABSL_LOCKS_EXCLUDED(mu_);
  void RunJob(Job* job) ABSL_LOCKS_EXCLUDED(mu_);
  // One attempt at the job's steps after its turn came (`recovering`: after
  // a fault or a restart); returns the failure, if any.
  absl::Status RunSteps(Job* job, bool recovering) ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until ranks 0..W-1 are alive (recovery_timeout).
  absl::Status WaitForWorkers(Job* job) ABSL_LOCKS_EXCLUDED(mu_);
  // Whether a failed attempt may be recovered from.
  bool Recoverable(Job* job, const absl::Status& status)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Queues a save or rollback; `done` answers a refusal at once.
  void RequestControl(const std::string& job_id, bool save,
                      const std::string& checkpoint, CheckpointCallback done)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Answers every queued control of `job` with `status`.
  void FailControls(Job* job, const absl::Status& status)
      ABSL_LOCKS_EXCLUDED(mu_);
  v1::StoredJobProgress ProgressLocked(const Job& job) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs `call(rank, options)` on every rank concurrently until all
  // returned, one failed, the deadline passed, a worker died or the runner
  // stops. Errors name the rank: "rank 2 (ADDR): CODE: message".
  absl::Status RunOnAllRanks(
      const std::vector<WorkerSnapshot>& workers, RankPool* pool,
      const std::function<absl::Status(int, const WorkerCallOptions&)>& call,
      absl::string_view what) ABSL_LOCKS_EXCLUDED(mu_);
  // The same with calls that do not block: `start(rank, options, finish)`
  // issues rank's call and returns; the call runs finish(status) once when
  // it ends (WorkerClient's *Async). No thread per rank.
  using AsyncRankCall = std::function<void(int, const WorkerCallOptions&,
                                           std::function<void(absl::Status)>)>;
  absl::Status RunOnAllRanksAsync(const std::vector<WorkerSnapshot>& workers,
                                  const AsyncRankCall& start,
                                  absl::string_view what)
      ABSL_LOCKS_EXCLUDED(mu_);
  // OK while ranks 0..W-1 are alive with the snapshot's incarnations.
  absl::Status CheckMembership(
      const std::vector<WorkerSnapshot>& snapshot) const;
  // Records `event` in the job (steps done, state, last checkpoint), makes
  // the progress durable (with a journal) and then appends the event.
  // Errors: INTERNAL (the journal failed; nothing was appended).
  absl::Status Publish(Job* job, v1::StepEvent event) ABSL_LOCKS_EXCLUDED(mu_);
  bool stopping() const ABSL_LOCKS_EXCLUDED(mu_);

  WorkerRegistry* const workers_;  // Not owned.
  const WorkerClientFactory factory_;
  const JobRunnerOptions options_;

  // Held by Shutdown (never with mu_ inside a job thread's wait).
  absl::Mutex shutdown_mu_;
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int64_t next_job_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t checkpoint_failures_total_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t checkpoints_deleted_total_ ABSL_GUARDED_BY(mu_) = 0;
  // Job id -> job; order_ lists ids in submission order.
  std::map<std::string, std::unique_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> order_ ABSL_GUARDED_BY(mu_);
  // Jobs not finished, in submission order; the front one runs.
  std::deque<Job*> queue_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardd

#endif  // SHARDD_SERVER_JOBS_JOB_RUNNER_H_
