#ifndef SHARDD_WORKER_EXEC_STEP_EXECUTOR_H_
#define SHARDD_WORKER_EXEC_STEP_EXECUTOR_H_

// Runs step programs (proto/worker.proto, program/step_program.h) on one
// rank over a StepBackend (step_backend.h): CpuBackend (cpu_backend.h) or
// CudaBackend (cuda_backend.h, CUDA builds). The executor validates each
// distinct program once, applies the program's rules to every command
// before the backend sees it (StepState), counts optimizer steps and turns
// failures into the executor's state; docs/design.md ("Step execution")
// describes what each backend does per command.
//
// A step commits fully or not at all on this rank. A command that does not
// fit is rejected without effect; a failure after a command started aborts
// the step, and a failure that leaves the collectives or shards unusable
// (a failed or timed-out collective) makes the executor refuse further
// steps (FAILED_PRECONDITION): re-create it with fresh communicators. Its
// master shards and optimizer state stay those of the last committed step.
//
// Two ways to drive it, with identical results (they share the code path):
//   Execute(program, batches)              one call per step;
//   BeginStep / ExecuteCommand... / EndStep one call per command (the
//                                          coordinator's fine-grained mode).
//
// Thread-safe: public methods serialize on an internal mutex.

#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "proto/model.pb.h"
#include "proto/plan.pb.h"
#include "proto/worker.pb.h"
#include "worker/comm/communicator.h"
#include "worker/data/batch_sampler.h"
#include "worker/exec/step_backend.h"
#include "worker/exec/step_state.h"
#include "worker/memory/memory_tracker.h"
#include "worker/shards/shard_store.h"

namespace shardd {

class StepExecutor {
 public:
  // An executor over `backend` for `plan` (options: the ranks, for
  // messages).
  StepExecutor(const v1::ShardingPlan& plan, const StepExecutorOptions& options,
               std::unique_ptr<StepBackend> backend);

  // A CPU executor (CpuBackend::Create: its ShardStore initialised from
  // options.seed and its MoeModel). `shard_group` has plan.mesh().dp_shard()
  // ranks with this rank at options.shard_rank; `replicas` (may be null
  // when dp_replicate is 1) has dp_replicate ranks; `slice_groups` (see
  // SliceGroups in shard_store.h) a group for every G in (1, dp_shard) a
  // unit's reshard_after_forward names; `expert_groups` the groups of
  // expert parallelism when plan.mesh.ep > 1 (communicator.h). The
  // communicators and the tracker must outlive the executor.
  // Errors: INVALID_ARGUMENT (null shard_group or tracker, communicator
  // size or rank not matching the plan's mesh, a missing replicate or slice
  // group, an AdamW hyper-parameter out of range, max_grad_norm < 0 or not
  // finite, collective_timeout not positive) and the errors of
  // ShardStore::Create, MoeModel::Create and CreateOptimizer
  // (optimizer_registry.h: an unknown optimizer, Muon on a flat unit; the
  // CUDA backend refuses every optimizer but adamw).
  static absl::StatusOr<std::unique_ptr<StepExecutor>> Create(
      const v1::ShardingPlan& plan, const v1::ModelSpec& model,
      const StepExecutorOptions& options, Communicator* shard_group,
      Communicator* replicas, MemoryTracker* tracker,
      const SliceGroups& slice_groups = {},
      const ExpertGroups& expert_groups = ExpertGroups());

  // Lets the backend stop outstanding work first (its destructor).
  ~StepExecutor();

  StepExecutor(const StepExecutor&) = delete;
  StepExecutor& operator=(const StepExecutor&) = delete;

  // Runs a whole program: BeginStep, every command, EndStep. `batches` are
  // this rank's micro-batches (program.microbatches() of them). A program
  // is validated (ValidateStepProgram) the first time it is seen; later
  // steps of the same program (differing only in `step`) skip it.
  // Errors: FAILED_PRECONDITION ("stale plan": program.plan_fingerprint is
  // not the plan's; a step already in progress; the executor failed
  // earlier); INVALID_ARGUMENT (malformed program, batches that do not fit);
  // then, naming the step and "commands[i] (OP ...)": ABORTED when a
  // collective failed or timed out (the collective's own code and message
  // follow), INTERNAL for a non-finite gradient norm (the update is skipped;
  // the executor stays usable), or the model's error.
  absl::StatusOr<StepResult> Execute(
      const v1::StepProgram& program,
      absl::Span<const data::MicroBatch> batches);

  // Fine-grained mode. BeginStep takes the program's header (its commands
  // are not used and may be empty) and installs the micro-batches.
  // Errors: as Execute's checks before the first command (not the program
  // validation).
  absl::Status BeginStep(const v1::StepProgram& header,
                         absl::Span<const data::MicroBatch> batches);
  // Runs the next command. A command that does not fit the current state
  // is rejected without any effect and the step stays open:
  // FAILED_PRECONDITION (no step in progress, unit not in the state the op
  // needs, OPTIMIZER_STEP before every unit is resharded and reduced and
  // every computation ran, anything after OPTIMIZER_STEP), NOT_FOUND (unit
  // out of range), INVALID_ARGUMENT (unknown op, bad group_size). Any
  // failure after the command started (collective, model) aborts the step
  // as described above.
  absl::Status ExecuteCommand(const v1::Command& command);
  // Ends the step and reports it. Errors: FAILED_PRECONDITION when no step
  // is in progress, or OPTIMIZER_STEP has not run (the step is aborted);
  // the backend's completion errors (the step is aborted).
  absl::StatusOr<StepResult> EndStep();

  int64_t optimizer_steps() const;
  // OK, or why the executor refuses new steps.
  absl::Status health() const;
  // After loading a checkpoint: sets the completed optimizer steps to the
  // checkpoint's step, so AdamW's bias correction goes on from there
  // (StepResult::optimizer_steps counts from it too). Errors:
  // INVALID_ARGUMENT (steps < 0); FAILED_PRECONDITION (a step in progress,
  // or the executor failed earlier).
  absl::Status RestoreOptimizerSteps(int64_t steps);

  // The host shards of a CPU executor, for tests and checkpoints (loading
  // one: LoadRankShards of shard_checkpoint.h); null on a device. Not to be
  // used while a step runs.
  const ShardStore* host_shards() const { return backend_->host_shards(); }
  ShardStore* mutable_host_shards() { return backend_->host_shards(); }
  // CPU executors only (host_shards() dereferenced).
  const ShardStore& shards() const { return *host_shards(); }
  ShardStore* mutable_shards() { return mutable_host_shards(); }
  // On any device, not while a step runs: StepBackend's.
  absl::Status CopyOwnedParamSlice(const std::string& name, float* out) const {
    return backend_->CopyOwnedParamSlice(name, out);
  }
  // The training state wherever it lives (host or device memory), and the
  // replicate group that can broadcast it in place (null without HSDP).
  ShardState* shard_state() { return backend_->shard_state(); }
  const ShardState* shard_state() const { return backend_->shard_state(); }
  Communicator* replica_group() const { return backend_->replica_group(); }

 private:
  absl::Status BeginStepLocked(const v1::StepProgram& header,
                               absl::Span<const data::MicroBatch> batches)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `rejected` is set when the command failed before having any effect.
  absl::Status RunCommandLocked(const v1::Command& command, bool* rejected)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<StepResult> EndStepLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Stops the step after a failure (the backend frees its buffers) and
  // marks the executor failed unless `clean`.
  void AbortStepLocked(const absl::Status& error, bool clean)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const v1::ShardingPlan plan_;
  const StepExecutorOptions options_;

  mutable absl::Mutex mu_;
  StepState state_ ABSL_GUARDED_BY(mu_);
  int64_t optimizer_steps_ ABSL_GUARDED_BY(mu_) = 0;
  // The label of the step's OPTIMIZER_STEP (for EndStep's errors).
  std::string optimizer_label_ ABSL_GUARDED_BY(mu_);
  // Fixed after construction; calls are serialized by mu_.
  const std::unique_ptr<StepBackend> backend_;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_EXEC_STEP_EXECUTOR_H_
