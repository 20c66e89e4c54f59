#ifndef SHARDD_WORKER_EXEC_STEP_EXECUTOR_H_
#define SHARDD_WORKER_EXEC_STEP_EXECUTOR_H_

// Runs step programs (proto/worker.proto, program/step_program.h) on one rank:
// the rank's ShardStore holds the shards, a MoeModel computes FORWARD and
// BACKWARD, a communication thread runs the collectives, and OPTIMIZER_STEP
// clips the global gradient norm and applies AdamW to the master shards.
//
// Threads. Every ShardStore operation that touches the collectives or frees
// an unsharded buffer -- UNSHARD (copy-in + all-gather), RESHARD,
// REDUCE_SCATTER (+ the HSDP replica all-reduce) -- and the gradient-norm
// all-reduce runs on one communication thread, fed by a FIFO queue in
// program order, so all ranks issue the collectives of each communicator in
// the same order from a single thread (communicator.h). The caller's thread
// runs the compute (MoeModel::Run, reading gathered parameters and writing
// unsharded gradients through the ShardStore) and ALLOC_GRAD. Command
// semantics on this rank:
//   UNSHARD        enqueues the all-gather. With `prefetch` it returns at
//                  once and the program's WAIT_UNSHARD waits for it; without,
//                  it completes before the command returns (as the validator
//                  assumes: "an UNSHARD without prefetch completes before the
//                  next command").
//   WAIT_UNSHARD   blocks until that unit's all-gather finished; its status.
//   RESHARD        enqueues the free; FIFO order puts it after the unit's
//                  gather and after any reduce-scatter issued before it.
//                  group_size G > 1 keeps this rank's 1/G slice and the
//                  next UNSHARD of the unit gathers it back over the slice
//                  group of G ranks (ShardStore::Reshard/Unshard).
//   ALLOC_GRAD     allocates the zeroed unsharded gradient on the caller
//                  thread, after the queued operations on the unit finished
//                  (and, with exact_memory_order, after every queued free).
//   FORWARD/BACKWARD  MoeModel::Run. Parameters are read only from units
//                  that are gathered and waited, gradients written only into
//                  allocated ones (the adapter checks; FAILED_PRECONDITION).
//   REDUCE_SCATTER enqueues the averaged reduce-scatter; the unsharded
//                  gradient is off limits from then on.
//   OPTIMIZER_STEP drains the queue, computes the global gradient norm (the
//                  sum of squares of this rank's trainable sharded elements,
//                  all-reduced (sum) over the shard group only: replicas hold
//                  identical gradients after the HSDP all-reduce), clips
//                  (torch.nn.utils.clip_grad_norm_ semantics), runs AdamW on
//                  the trainable, unpadded elements of every master shard
//                  (frozen parameters and padding are never touched, so no
//                  weight decay on them and padding stays exactly zero), then
//                  zeroes the sharded gradients.
//
// Memory. UNSHARD and REDUCE_SCATTER allocate and free on the communication
// thread, in program order with RESHARD; ALLOC_GRAD allocates on the caller
// thread only once every free issued before it has happened
// (exact_memory_order). So the live unsharded bytes never exceed the step
// model's replay (program/step_program.h: UNSHARD allocates when issued,
// RESHARD / REDUCE_SCATTER free when issued) and reach its peak: the measured
// peak_unsharded_bytes equals plan.memory().peak_unsharded_bytes().
//
// Failures. A step commits fully or not at all on this rank: OPTIMIZER_STEP
// changes the master shards and optimizer state only after every command
// before it, every queued collective and the norm all-reduce succeeded, and
// AdamW itself cannot fail (its config is checked by Create). When a command
// fails, the queued collectives are skipped, the one running finishes
// (bounded by collective_timeout), gathered buffers are freed, and the error
// names the step, the command index and the command. Collectives poison
// their communicator and leave the ranks out of step, so after a failure
// inside a step the executor refuses further steps (FAILED_PRECONDITION):
// re-create it with fresh communicators. Its master shards and optimizer
// state stay those of the last committed step.
//
// Two ways to drive it, with identical results (they share the code path):
//   Execute(program, batches)              one call per step;
//   BeginStep / ExecuteCommand... / EndStep one call per command (the
//                                          coordinator's fine-grained mode).
//
// Thread-safe: public methods serialize on an internal mutex.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kernels/cpu/adamw.h"
#include "proto/model.pb.h"
#include "proto/plan.pb.h"
#include "proto/worker.pb.h"
#include "worker/comm/communicator.h"
#include "worker/data/batch_sampler.h"
#include "worker/exec/step_state.h"
#include "worker/memory/memory_tracker.h"
#include "worker/model/moe_model.h"
#include "worker/shards/shard_store.h"

namespace shardd {

struct StepExecutorOptions {
  // This rank's position in its shard group (dp_shard ranks) and in its
  // replicate group (dp_replicate ranks; used in messages only: replicas
  // hold the same shards, and the caller picks each rank's data).
  int shard_rank = 0;
  int replica_rank = 0;
  // Parameter initialisation seed (ShardStore, param_init.h).
  uint64_t seed = 0;
  // Bounds every collective (each wait for a peer).
  absl::Duration collective_timeout = absl::Seconds(60);
  kernels::AdamWConfig adamw;
  // Global gradient-norm clipping threshold; 0 turns clipping off (the norm
  // is still computed and reported).
  double max_grad_norm = 0.0;
  // MoeModelOptions::self_conditioning_scale.
  float self_conditioning_scale = 0.5f;
  // ALLOC_GRAD waits for every free queued before it (see above). False
  // lets a reduce-scatter overlap the next backward, at the price of a
  // measured peak that can exceed the plan's by the gradients in flight.
  bool exact_memory_order = true;
};

// Collectives this rank issued during one step (communicator stats deltas;
// calls include failed ones, bytes count successful ones, sized as
// CollectiveStats::bytes: the full unsharded buffer).
struct StepCollectives {
  int64_t all_gathers = 0;  // Shard group: UNSHARD.
  int64_t all_gather_bytes = 0;
  int64_t reduce_scatters = 0;  // Shard group: REDUCE_SCATTER.
  int64_t reduce_scatter_bytes = 0;
  int64_t replica_all_reduces = 0;  // Replicate group: HSDP gradients.
  int64_t replica_all_reduce_bytes = 0;
  int64_t norm_all_reduces = 0;  // Shard group: the gradient norm.
  int64_t norm_all_reduce_bytes = 0;
  // Of all_gathers: re-gathers from post-forward slices over a slice group.
  int64_t slice_all_gathers = 0;
  // Wall time inside successful collectives of both groups.
  double seconds = 0.0;
};

struct StepResult {
  int64_t step = 0;  // program.step().
  // MoeModel::step_loss / step_tokens of this rank's micro-batches.
  double loss = 0.0;
  int64_t tokens = 0;
  double seconds = 0.0;  // BeginStep to EndStep.
  // Global gradient norm before clipping, and the factor the gradients were
  // multiplied by (1 when not clipped).
  double grad_norm = 0.0;
  double clip_coefficient = 1.0;
  // Optimizer steps applied so far (after this one).
  int64_t optimizer_steps = 0;
  int commands = 0;
  StepCollectives collectives;
  // Measured this step (MemoryTracker peaks since BeginStep): gathered
  // parameters + unsharded gradients (the plan's peak_unsharded_bytes), and
  // each kind's own peak.
  int64_t peak_unsharded_bytes = 0;
  int64_t peak_gathered_param_bytes = 0;
  int64_t peak_unsharded_grad_bytes = 0;
  // Tracked compute workspace (parameter copy-outs) and the largest
  // MoeModel::activation_bytes() seen after a computation.
  int64_t peak_workspace_bytes = 0;
  int64_t peak_activation_bytes = 0;
};

// Communicator counters at one moment: the shard group, the replicate group
// (zeros without HSDP) and each slice group by size.
struct CollectiveStatsSnapshot {
  CommunicatorStats shard;
  CommunicatorStats replicas;
  std::map<int, CommunicatorStats> slices;
};

// Takes a snapshot. `replicas` may be null. Works for any communicator
// backend (the GPU executor passes its NCCL groups).
template <typename Group>
CollectiveStatsSnapshot SnapshotCollectives(
    const Communicator& shard, const Communicator* replicas,
    const std::map<int, Group*>& slices) {
  CollectiveStatsSnapshot snapshot;
  snapshot.shard = shard.stats();
  if (replicas != nullptr) snapshot.replicas = replicas->stats();
  for (const auto& [size, group] : slices)
    snapshot.slices[size] = group->stats();
  return snapshot;
}

// The collectives issued between two snapshots of the same groups. Slice
// groups' all-gathers (re-gathers from post-forward slices) count among the
// all-gathers too, as the plan counts them.
StepCollectives CollectivesBetween(const CollectiveStatsSnapshot& start,
                                   const CollectiveStatsSnapshot& end);

// Copies a tracker's peaks into a step result (peak_unsharded_bytes and the
// per-kind peaks of gathered parameters, unsharded gradients, workspace).
void SetMemoryPeaks(const MemorySnapshot& memory, StepResult* result);

// The fields of a step result every executor fills the same way: the step,
// its seconds and commands (from `state`), `optimizer_steps`, the
// collectives between the two snapshots, the memory peaks and
// `peak_activation_bytes`.
void FillStepResult(const StepState& state, int64_t optimizer_steps,
                    const CollectiveStatsSnapshot& start,
                    const CollectiveStatsSnapshot& end,
                    const MemorySnapshot& memory, int64_t peak_activation_bytes,
                    StepResult* result);

class StepExecutor {
 public:
  // Creates this rank's ShardStore (shards initialised from options.seed)
  // and MoeModel (step shape from plan.step()). `shard_group` has
  // plan.mesh().dp_shard() ranks with this rank at options.shard_rank;
  // `replicas` (may be null when dp_replicate is 1) has dp_replicate ranks.
  // The communicators and the tracker must outlive the executor.
  // Errors: INVALID_ARGUMENT (null shard_group or tracker, communicator
  // size or rank not matching the plan's mesh, a missing replicate group
  // under HSDP, an AdamW hyper-parameter out of range, max_grad_norm < 0 or
  // not finite, collective_timeout not positive) and the errors of
  // ShardStore::Create and MoeModel::Create.
  //
  // `slice_groups` (see SliceGroups in shard_store.h) must hold a group for
  // every G in (1, dp_shard) a unit's reshard_after_forward names;
  // INVALID_ARGUMENT otherwise.
  static absl::StatusOr<std::unique_ptr<StepExecutor>> Create(
      const v1::ShardingPlan& plan, const v1::ModelSpec& model,
      const StepExecutorOptions& options, Communicator* shard_group,
      Communicator* replicas, MemoryTracker* tracker,
      const SliceGroups& slice_groups = {});

  // Skips queued collectives and waits for the running one (at most about
  // collective_timeout).
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
  // is in progress, or OPTIMIZER_STEP has not run (the step is aborted).
  absl::StatusOr<StepResult> EndStep();

  int64_t optimizer_steps() const;
  // OK, or why the executor refuses new steps.
  absl::Status health() const;
  // The shards, for tests and checkpoints. Not to be used while a step runs.
  const ShardStore& shards() const { return *store_; }
  // For restoring a checkpoint into the shards (LoadRankShards of
  // shard_checkpoint.h). Not to be used while a step runs.
  ShardStore* mutable_shards() { return store_.get(); }

  // After loading a checkpoint: sets the completed optimizer steps to the
  // checkpoint's step, so AdamW's bias correction goes on from there
  // (StepResult::optimizer_steps counts from it too). Errors:
  // INVALID_ARGUMENT (steps < 0); FAILED_PRECONDITION (a step in progress,
  // or the executor failed earlier).
  absl::Status RestoreOptimizerSteps(int64_t steps);

 private:
  class CommThread;
  class Params;

  // The communication queue's view of a unit, and the trainable ranges
  // the optimizer updates (StepState holds the rest of the unit's state).
  struct UnitQueue {
    int64_t gather_ticket = -1;  // Queue ticket of the last UNSHARD.
    int64_t last_ticket = -1;    // Last queued operation on the unit.
    // This rank's trainable, unpadded elements of the master shard:
    // [begin, end) offsets into the unit's shard.
    std::vector<std::pair<int64_t, int64_t>> ranges;
  };

  StepExecutor(const v1::ShardingPlan& plan, const StepExecutorOptions& options,
               Communicator* shard_group, Communicator* replicas,
               const SliceGroups& slice_groups, MemoryTracker* tracker);

  absl::Status BeginStepLocked(const v1::StepProgram& header,
                               absl::Span<const data::MicroBatch> batches)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `rejected` is set when the command failed before having any effect.
  absl::Status RunCommandLocked(const v1::Command& command, bool* rejected)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status OptimizerStepLocked(const std::string& label)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<StepResult> EndStepLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Stops the step after a failure: skips the queue, frees gathered
  // buffers, zeroes the sharded gradients, and marks the executor failed
  // unless `clean` (nothing of the step left the rank's state unusable).
  void AbortStepLocked(const absl::Status& error, bool clean)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Queues the free of the slice a finished re-gather of `unit` consumed
  // (when it gathered from one) as a free: in program order with the other
  // frees, and waited for by the next ALLOC_GRAD, so the measured memory
  // follows the plan's replay.
  void DropSliceLocked(int unit, const std::string& label)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ZeroShardGrads();

  const v1::ShardingPlan plan_;
  const StepExecutorOptions options_;
  Communicator* const shard_group_;
  Communicator* const replicas_;
  const SliceGroups slice_groups_;
  MemoryTracker* const tracker_;
  v1::ModelSpec model_spec_;
  // Fixed after Create; used by the caller thread and the queued tasks
  // (which the queue orders with the caller: see the file comment).
  std::unique_ptr<ShardStore> store_;

  mutable absl::Mutex mu_;
  std::unique_ptr<MoeModel> model_ ABSL_GUARDED_BY(mu_);
  MoeModelOptions model_options_ ABSL_GUARDED_BY(mu_);
  StepState state_ ABSL_GUARDED_BY(mu_);
  std::vector<UnitQueue> queue_units_ ABSL_GUARDED_BY(mu_);
  int64_t optimizer_steps_ ABSL_GUARDED_BY(mu_) = 0;

  // The step in progress (StepState holds its commands and units).
  int64_t last_free_ticket_ ABSL_GUARDED_BY(mu_) = -1;
  CollectiveStatsSnapshot stats_start_ ABSL_GUARDED_BY(mu_);
  int64_t peak_activation_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  double grad_norm_ ABSL_GUARDED_BY(mu_) = 0.0;
  double clip_coefficient_ ABSL_GUARDED_BY(mu_) = 1.0;

  // Destroyed first (see the destructor): its tasks use store_.
  std::unique_ptr<CommThread> comm_;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_EXEC_STEP_EXECUTOR_H_
