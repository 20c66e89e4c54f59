#ifndef SHARDD_WORKER_WORKER_RUNTIME_H_
#define SHARDD_WORKER_WORKER_RUNTIME_H_

// The worker's training job, independent of any transport: what the Worker
// service's LoadPlan, Execute, RunCommand and GetStats do (the gRPC adapter,
// grpc_worker_service.h, only moves messages and threads).
//
// LoadPlan installs one job: it validates the request, joins the job's Gloo
// groups through the coordinator's key-value store, opens the data and
// creates a StepExecutor (step_executor.h) holding this rank's shards.
// Execute and RunCommand then run step programs on it.
//
// Ranks. The request's `rank` r in [0, world_size) of the plan's mesh
// (dp_shard x dp_replicate) gives
//   shard rank   s = r % dp_shard    (position in its shard group),
//   replica rank q = r / dp_shard    (position in its replicate group),
//   data rank        q * dp_shard + s (= r) among R = dp_shard * dp_replicate
//                    BatchSampler ranks: each rank reads its own rows of
//                    every micro-batch (batch_sampler.h), replicas included.
// Collective groups (GlooCommunicator, rendezvous keys in the KV store):
//   "<job_id>/<membership_epoch>/shard<q>"    the dp_shard ranks with replica
//                                             rank q, at rank s;
//   "<job_id>/<membership_epoch>/replica<s>"  (dp_replicate > 1 only) the
//                                             dp_replicate ranks with shard
//                                             rank s, at rank q.
// Every LoadPlan of a world above 1 needs a fresh (job_id, membership_epoch)
// pair: a group's keys are written once and only deleted after every rank
// has joined, so a retry under the same names could read a dead peer's
// endpoint.
//
// Recovery without a checkpoint. LoadPlan with keep_state, for
// the job and plan fingerprint this worker holds, keeps the shards' training
// state (fp32 masters, AdamW moments, optimizer step count) and only
// rebuilds the collective groups for the new membership epoch; this works
// after a failed step too, because a step commits on this rank fully or not
// at all (step_executor.h). The state is carried across the rebuild as a
// host snapshot (shard_state_transfer.h), taken before the old job and its
// communicators are dropped, so peers still blocked on them fail at once
// and the worker holds about one extra copy of masters and moments (3x the
// shard bytes) only while the new groups form. If that LoadPlan then fails
// (a peer missing from the rendezvous), the snapshot is retained and a
// later keep_state LoadPlan of the same job and fingerprint still finds it.
// A GPU job's snapshot is copied from and back to device memory (the
// executor's ShardState; not run on a GPU yet).
// HealReplicas then lets HSDP replicas that lost their state (a restarted
// worker) copy it from a replica that kept it (GPU jobs broadcast over
// NCCL in device memory; not run on a GPU yet).
//
// Training config: ResolveTrainConfig (train_config.h).
//
// Failures. A step that fails (a collective timed out or a peer died:
// ABORTED / DEADLINE_EXCEEDED, naming the rank, step and command) leaves the
// job unusable when the executor says so; later steps answer
// FAILED_PRECONDITION with the original error, and a new LoadPlan (fresh
// membership epoch) starts over. Nothing crashes and every wait is bounded
// by the collective timeout.
//
// Thread-safe. LoadPlan, Execute, RunCommand and Reset serialize on one
// mutex for as long as they run (a step can block in collectives for up to
// the collective timeout); GetStats never waits for them.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/coordinator.pb.h"
#include "proto/plan.pb.h"
#include "proto/worker.pb.h"
#include "worker/comm/communicator.h"
#include "worker/comm/kv_client.h"
#include "worker/data/batch_sampler.h"
#include "worker/exec/step_executor.h"
#include "worker/exec/step_runner.h"
#include "worker/memory/memory_timeline.h"
#include "worker/memory/memory_tracker.h"
#include "worker/train_config.h"

namespace shardd {

// The model's vocabulary: dim 0 of its embedding parameter (the first
// parameter of a MODULE_EMBEDDING module), else dims.vocab_size.
// Errors: INVALID_ARGUMENT when neither is set.
absl::StatusOr<int64_t> ModelVocabSize(const v1::ModelSpec& model);

struct WorkerRuntimeOptions {
  // Where this worker's Gloo endpoints listen (an IP address or host name of
  // this machine, reachable by the peers).
  std::string bind_address = "127.0.0.1";
  // Used when LoadPlanRequest.collective_timeout_ms is 0.
  absl::Duration default_collective_timeout =
      absl::Milliseconds(kDefaultCollectiveTimeoutMs);
  // CUDA device ordinal the steps run on (a StepExecutor over a CudaBackend and
  // NCCL groups, see device_step_runner.h); -1 runs them on the CPU over Gloo.
  // A device needs a CUDA build (DeviceStepsSupported()).
  int device = -1;
  // Directory every checkpoint path of SaveShards / LoadShards is resolved
  // under (the coordinator's --checkpoint-dir, on a file system shared with
  // it). Empty: checkpoints are refused with FAILED_PRECONDITION.
  std::string checkpoint_root;
  // When set, a job's train.init_from (Hugging Face weights) must lie under
  // this directory once symlinks and ".." are resolved; empty: any path this
  // process can read (clients are authenticated, but may name any file).
  std::string weights_root;
  // Fault-injection aid for tests (worker flag --debug-save-delay): after
  // SaveShards wrote and fsynced this rank's checkpoint file it sleeps this
  // long before answering, so a test can kill the worker in the middle of a
  // checkpoint. Zero (the default) in production.
  absl::Duration debug_save_delay = absl::ZeroDuration();
  // Where to draw the measured memory timeline of the first step this
  // worker runs on the CPU (worker/memory/memory_timeline.h); empty: none.
  std::string memory_timeline_svg;
  // Runs after every successful step (Execute, or RunCommand's end_step),
  // on the calling thread under the runtime's mutex: it must be quick and
  // must not call back into the runtime. Unset: nothing runs. (Metrics.)
  std::function<void(const StepResult&)> on_step;
};

// `root`/`relative` for a path a request names: `relative` must be
// non-empty, not absolute, without empty, "." or ".." components.
// Errors: INVALID_ARGUMENT naming `field` and what is allowed.
absl::StatusOr<std::string> ResolveUnderRoot(const std::string& root,
                                             const std::string& relative,
                                             absl::string_view field);

// OK when `path`, with symlinks and ".." resolved as far as it exists, lies
// under `root` (resolved the same way) or is `root`. Errors:
// PERMISSION_DENIED naming `field`, the path and the root.
absl::Status CheckUnderRoot(const std::string& root, const std::string& path,
                            absl::string_view field);

// True when this binary was built with the GPU step path (--config=cuda).
bool DeviceStepsSupported();

// Whether CUDA device `device` can run steps on this machine, checked once at
// startup so that a worker without its GPU exits with the reason instead of
// registering and failing every job. Errors: FAILED_PRECONDITION (a build
// without CUDA, no driver, no device visible), INVALID_ARGUMENT (no such
// device ordinal).
absl::Status CheckDeviceUsable(int device);

class WorkerRuntime {
 public:
  explicit WorkerRuntime(WorkerRuntimeOptions options = {});
  // Drops the job (bounded by the collective timeout when a collective is
  // still running on the executor's communication thread).
  ~WorkerRuntime();

  WorkerRuntime(const WorkerRuntime&) = delete;
  WorkerRuntime& operator=(const WorkerRuntime&) = delete;

  // Installs the job `request` describes and returns this rank's master
  // shard bytes, the data's entropy rate and kept_step. `kv` (not owned;
  // used only during the call) is the rendezvous store; null is allowed only
  // for a world of one rank. A request that fails validation leaves the
  // current job in place; any later failure leaves no job (but keeps a
  // keep_state snapshot, see the file comment).
  //
  // keep_state: when the worker holds (or retained from a failed LoadPlan)
  // a job (CPU or GPU) with request.job_id and the plan's fingerprint whose
  // state is intact, the new job starts from its masters, moments and
  // optimizer step count, and kept_step is that step count; the old job's
  // last step may have failed. Otherwise (another job or plan, keep_state
  // false, a device that cannot copy its shards out, or state lost by a
  // failed HealReplicas or LoadShards) the shards
  // are freshly initialized from `seed` and kept_step is -1.
  // Errors: INVALID_ARGUMENT (rank outside [0, world_size); a plan whose
  // mesh, world size or units do not match its model (missing parameter,
  // other shape, other total); an invalid model; bad train config, see
  // ResolveTrainConfig; empty job_id; negative collective_timeout_ms; a
  // data file that cannot be used); FAILED_PRECONDITION (world size > 1 and
  // no `kv`); DEADLINE_EXCEEDED / ABORTED (a peer did not join the
  // collective groups in time); and the errors of StepExecutor::Create.
  absl::StatusOr<v1::LoadPlanResponse> LoadPlan(
      const v1::LoadPlanRequest& request, KeyValueClient* kv)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Runs one whole step program on this rank's micro-batches of
  // program.step(). Errors: FAILED_PRECONDITION ("no plan loaded: call
  // LoadPlan first"; "stale plan: worker holds fingerprint X, program names
  // Y"; the job failed in an earlier step; a fine-grained step is open);
  // INVALID_ARGUMENT (program.microbatches differs from the job's, negative
  // step, a malformed program); ABORTED / DEADLINE_EXCEEDED (a collective
  // failed; the message names this rank); INTERNAL (non-finite gradient
  // norm: the update was skipped, the job stays usable).
  absl::StatusOr<v1::ExecuteResponse> Execute(const v1::ExecuteRequest& request)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Fine-grained mode: one request does, in this order, what it asks of
  // begin_step (fetch step `step`'s micro-batches and start it with the
  // plan's step shape), the command (when command.op is set; `index` must
  // be the step's next position, 0 after begin_step, and `step` the open
  // step's), end_step (finish the step; the response is filled as
  // Execute's). Requests without end_step return an empty response.
  // Errors: as Execute, plus FAILED_PRECONDITION for a command or end_step
  // outside a step, a step other than the open one, an index out of
  // program order, and the executor's command checks (NOT_FOUND for a unit
  // out of range, INVALID_ARGUMENT for an unknown op).
  absl::StatusOr<v1::ExecuteResponse> RunCommand(
      const v1::RunCommandRequest& request) ABSL_LOCKS_EXCLUDED(mu_);

  // Writes this shard rank's master shards and AdamW state into the save
  // directory checkpoint_root/request.tmp_dir (SaveRankShards) and returns
  // the file's record and chunks for the committer. Only replica 0 of an
  // HSDP mesh saves (the replicas hold the same shards). A GPU job's
  // shards are written from one host copy of its state.
  // Errors: FAILED_PRECONDITION (no checkpoint root, no or stale plan, the
  // job failed, a fine-grained step open, a replica other than 0); INVALID_ARGUMENT (tmp_dir not a plain relative path); those of
  // SaveRankShards (file system errors).
  absl::StatusOr<v1::SaveShardsResponse> SaveShards(
      const v1::SaveShardsRequest& request) ABSL_LOCKS_EXCLUDED(mu_);

  // Verifies every file of the committed checkpoint
  // checkpoint_root/request.checkpoint_dir (size and XXH64), loads this
  // rank's shards from it (LoadRankShards, any saving world size and
  // strategy) and sets the optimizer step count to its step, which it
  // returns. Errors: FAILED_PRECONDITION as SaveShards (replicas load too);
  // INVALID_ARGUMENT (checkpoint_dir not a plain relative path, a tensor of
  // another shape); NOT_FOUND (no committed checkpoint there, a parameter
  // missing); DATA_LOSS (a file truncated or corrupted, naming it; a bad
  // index.json). After a DATA_LOSS or INTERNAL while reading shard data the
  // shards may be partly overwritten: LoadPlan again.
  absl::StatusOr<v1::LoadShardsResponse> LoadShards(
      const v1::LoadShardsRequest& request) ABSL_LOCKS_EXCLUDED(mu_);

  // Heals the HSDP replicas of this rank's shard rank s = rank % dp_shard:
  // when request.source_replica[s] >= 0, that replica broadcasts its master
  // shards, AdamW moments and optimizer step count over the replicate group
  // (BroadcastShardState) and this rank takes them; -1 leaves the group as
  // it is. Every rank of the job calls it with the same vector. Returns the
  // step count this rank holds afterwards and the bytes it received (0 on
  // the source and in an untouched group).
  // Errors: FAILED_PRECONDITION (no or stale plan, the job failed, a
  // fine-grained step open, dp_replicate 1); INVALID_ARGUMENT
  // (source_replica without one entry per shard rank, an entry outside
  // [-1, dp_replicate)); ABORTED (the broadcast failed or timed out: the
  // job is marked failed like a failed step, and a receiving rank's state
  // counts as lost, so a keep_state LoadPlan initializes it afresh; LoadPlan
  // again).
  absl::StatusOr<v1::HealReplicasResponse> HealReplicas(
      const v1::HealReplicasRequest& request) ABSL_LOCKS_EXCLUDED(mu_);

  // Live and peak bytes of every tracked buffer (peaks restart at LoadPlan
  // and at each step's start) and this process's collective totals on the
  // shard groups (all jobs so far). Never blocks on a running step.
  // The job fields describe the job as of its last finished call (LoadPlan,
  // step, command, checkpoint, heal): job_id, plan_fingerprint, completed
  // optimizer steps (-1 when its state was lost) and step_failed (the job
  // refuses steps until a LoadPlan). Without a job but with a retained
  // keep_state snapshot they describe the snapshot, with step_failed true.
  v1::GetStatsResponse GetStats() const ABSL_LOCKS_EXCLUDED(stats_mu_);

  // For metrics; like GetStats, never blocks on a running step. This
  // process's shard-group collective counters over all jobs (every kind,
  // failures included), and the per-kind live and peak bytes of the job's
  // memory tracker (peaks restart at LoadPlan and at each step's start).
  CommunicatorStats CollectiveTotals() const ABSL_LOCKS_EXCLUDED(stats_mu_);
  MemorySnapshot MemoryUsage() const ABSL_LOCKS_EXCLUDED(stats_mu_);

  // Drops the job (its communicators close, so peers blocked on this rank
  // fail with ABORTED). Idempotent.
  void Reset() ABSL_LOCKS_EXCLUDED(mu_);

  bool has_plan() const ABSL_LOCKS_EXCLUDED(mu_);
  // The loaded plan's fingerprint (0 without a plan).
  uint64_t plan_fingerprint() const ABSL_LOCKS_EXCLUDED(mu_);

  // Runs `fn` on the job's executor under the runtime's mutex (tests,
  // checkpoints). Errors: FAILED_PRECONDITION without a plan, or when the
  // job's steps run on a device (no CPU executor).
  absl::Status WithExecutor(absl::FunctionRef<void(const StepExecutor&)> fn)
      const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Job;
  // Training state carried from a job to its keep_state successor.
  struct KeptState;
  // GetStats' view of the job.
  struct JobInfo {
    std::string job_id;
    uint64_t plan_fingerprint = 0;
    int64_t optimizer_steps = 0;
    bool step_failed = false;
  };

  // The part of LoadPlan after the old job is dropped: joins the groups,
  // creates the executor, restores `kept` into it (then frees it) and
  // installs the job.
  absl::StatusOr<v1::LoadPlanResponse> BuildJobLocked(
      const v1::LoadPlanRequest& request, KeyValueClient* kv,
      std::unique_ptr<Job> job, std::unique_ptr<KeptState>* kept)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The state a keep_state LoadPlan of (job_id, fingerprint) keeps: a
  // snapshot of the held job's, or the retained one; null when none fits.
  // Writes the kept state (if any) into `executor`'s shards and optimizer
  // step count and frees it: the kept step, or -1 without one. Errors:
  // INTERNAL (the kept state does not fit: a bug).
  static absl::StatusOr<int64_t> RestoreKeptState(
      const Job& job, StepExecutor* executor,
      std::unique_ptr<KeptState>* kept);
  std::unique_ptr<KeptState> TakeKeptStateLocked(const std::string& job_id,
                                                 uint64_t fingerprint)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Publishes a created job (after LoadPlan dropped the old one) and
  // answers LoadPlan.
  absl::StatusOr<v1::LoadPlanResponse> InstallJobLocked(
      std::unique_ptr<Job> job, int64_t kept_step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OK, or why the job refuses steps (its executor failed, or a heal did).
  absl::Status JobHealthLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Copies the job's (or retained snapshot's) JobInfo for GetStats.
  void PublishJobLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the job; its communicators' stats move into the retired totals.
  void DropJobLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FAILED_PRECONDITION unless a healthy job holds `fingerprint`.
  absl::Status CheckJobLocked(uint64_t fingerprint) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // CheckJobLocked, plus a checkpoint root and no open step; returns the
  // executor.
  absl::StatusOr<StepExecutor*> CheckpointExecutorLocked(uint64_t fingerprint)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The micro-batches of `step`, or of eval batch `step` with `eval`.
  absl::Status FetchBatchesLocked(int64_t step, int microbatches, bool eval,
                                  std::vector<data::MicroBatch>* batches) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds the rank and job to a step failure, keeping its code.
  absl::Status StepError(const absl::Status& status) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::ExecuteResponse ToResponse(const StepResult& result) const;
  // Ends timeline_capture_'s step (drawing it once); failures are logged.
  void DrawTimelineLocked(int64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const WorkerRuntimeOptions options_;
  // Outlives every job: buffers of a dropped job are freed into it.
  MemoryTracker tracker_;
  // Records one step of tracker_ for options_.memory_timeline_svg.
  StepTimelineCapture timeline_capture_ ABSL_GUARDED_BY(mu_){
      options_.memory_timeline_svg, &tracker_};

  mutable absl::Mutex mu_;
  std::unique_ptr<Job> job_ ABSL_GUARDED_BY(mu_);
  // Only without a job: the state of a keep_state LoadPlan that failed.
  std::unique_ptr<KeptState> retained_ ABSL_GUARDED_BY(mu_);

  // What GetStats reads without mu_: the job's shard group (replaced only
  // under both mutexes) and the totals of dropped groups.
  mutable absl::Mutex stats_mu_ ABSL_ACQUIRED_AFTER(mu_);
  const Communicator* live_shard_group_ ABSL_GUARDED_BY(stats_mu_) = nullptr;
  // The tracker of the job's shard memory (tracker_, or a device's).
  const MemoryTracker* live_memory_ ABSL_GUARDED_BY(stats_mu_) = nullptr;
  CommunicatorStats retired_ ABSL_GUARDED_BY(stats_mu_);
  JobInfo live_job_ ABSL_GUARDED_BY(stats_mu_);
};

}  // namespace shardd

#endif  // SHARDD_WORKER_WORKER_RUNTIME_H_
