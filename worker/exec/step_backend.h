#ifndef SHARDD_WORKER_EXEC_STEP_BACKEND_H_
#define SHARDD_WORKER_EXEC_STEP_BACKEND_H_

// What a StepExecutor (step_executor.h) runs a step program on: the
// backend performs each command's effect on its shards, model and
// communicators (CpuBackend: host memory, Gloo, a communication thread;
// CudaBackend: device memory, NCCL, streams), while the executor owns the
// program's rules (StepState), validation, the optimizer step count and
// failure handling. docs/design.md ("Step execution") describes both
// backends. Also home of the options and results the executor reports.

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kernels/cpu/adamw.h"
#include "layout/initial_values.h"
#include "program/step_program.h"
#include "proto/worker.pb.h"
#include "worker/comm/communicator.h"
#include "worker/data/batch_sampler.h"
#include "worker/exec/lr_schedule.h"
#include "worker/exec/optimizer.h"
#include "worker/exec/optimizer_options.h"
#include "worker/exec/step_state.h"
#include "worker/memory/memory_tracker.h"
#include "worker/model/block_diffusion.h"
#include "worker/shards/shard_state_transfer.h"

namespace shardd {

class ShardStore;

struct StepExecutorOptions {
  // This rank's position in its shard group (dp_shard ranks) and in its
  // replicate group (dp_replicate ranks; used in messages only: replicas
  // hold the same shards, and the caller picks each rank's data).
  int shard_rank = 0;
  int replica_rank = 0;
  // Parameter initialisation seed (ShardStore, param_init.h).
  uint64_t seed = 0;
  // When set, the shards start from these values instead (ShardStoreOptions);
  // kept alive by the caller during Create.
  const InitialValues* initial_values = nullptr;
  // Bounds every collective (each wait for a peer).
  absl::Duration collective_timeout = absl::Seconds(60);
  // AdamW's hyper-parameters; adamw.lr is the peak rate, which lr_schedule
  // shapes per step (the default, constant, keeps adamw.lr).
  kernels::AdamWConfig adamw;
  LrSchedule lr_schedule;
  // Which optimizer OPTIMIZER_STEP applies (AdamW by default); Muon's lr is
  // shaped by lr_schedule like adamw.lr. Both backends run every optimizer.
  OptimizerOptions optimizer;
  // Global gradient-norm clipping threshold; 0 turns clipping off (the norm
  // is still computed and reported).
  double max_grad_norm = 0.0;
  // MoeModelOptions::self_conditioning_scale and ::diffusion.
  float self_conditioning_scale = 0.5f;
  DiffusionTrainingOptions diffusion;
  // ALLOC_GRAD waits for every free queued before it (see above). False
  // lets a reduce-scatter overlap the next backward, at the price of a
  // measured peak that can exceed the plan's by the gradients in flight.
  bool exact_memory_order = true;
};

// The learning rate of optimizer step `step` (0-based): lr_schedule's shape
// at the peak adamw.lr.
inline double StepLearningRate(const StepExecutorOptions& options,
                               int64_t step) {
  return options.lr_schedule.At(options.adamw.lr, step);
}

// The context of optimizer step `step` (1-based): its learning rate and the
// schedule's factor (lr / peak) that scales other optimizers' peaks.
inline OptimizerStepContext OptimizerContextFor(
    const StepExecutorOptions& options, int64_t step,
    const std::string& label) {
  OptimizerStepContext op;
  op.step = step;
  op.lr = StepLearningRate(options, step - 1);
  op.lr_factor = options.adamw.lr > 0.0 ? op.lr / options.adamw.lr : 1.0;
  op.label = label;
  return op;
}

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
  // Expert parallelism: the token exchanges (all-to-all, ep group); the
  // expert units' all-gathers and reduce-scatters over their ep_shard group
  // are among those above.
  int64_t all_to_alls = 0;
  int64_t all_to_all_bytes = 0;
  // Wall time inside successful collectives of both groups.
  double seconds = 0.0;
};

// A device step's host synchronizations and allocator traffic.
struct DeviceStepStats {
  // Host synchronizations during the step: the executor's own (1: EndStep)
  // + the model's (one per grouped-experts forward) + the communicators'
  // (0: only asynchronous collectives are used).
  int64_t host_synchronizations = 0;
  int64_t model_host_synchronizations = 0;
  // Calls into the allocator's backend (cudaMalloc / cudaFree) during the
  // step; 0 after the first step.
  int64_t backend_mallocs = 0;
  int64_t backend_frees = 0;
  int64_t reserved_bytes = 0;  // Held by the caching allocator at the end.
};

struct StepResult {
  int64_t step = 0;  // program.step().
  // An eval program ran: loss and tokens are the evaluation's (the
  // language-model cross-entropy, without gradients); nothing was updated.
  bool eval = false;
  // MoeModel::step_loss / step_tokens of this rank's micro-batches.
  double loss = 0.0;
  int64_t tokens = 0;
  double seconds = 0.0;  // BeginStep to EndStep.
  // Global gradient norm before clipping, and the factor the gradients were
  // multiplied by (1 when not clipped).
  double grad_norm = 0.0;
  double clip_coefficient = 1.0;
  double lr = 0.0;  // The learning rate of this step's update.
  // Optimizer steps applied so far (after this one).
  int64_t optimizer_steps = 0;
  int commands = 0;
  StepCollectives collectives;
  // Measured this step (MemoryTracker peaks since BeginStep): gathered
  // parameters + unsharded gradients (the plan's peak_unsharded_bytes), and
  // each kind's own peak.
  int64_t peak_unsharded_bytes = 0;
  // With the plan's activations: unsharded bytes plus activations (the
  // plan's peak_step_bytes); else peak_unsharded_bytes.
  int64_t peak_step_bytes = 0;
  int64_t peak_gathered_param_bytes = 0;
  int64_t peak_unsharded_grad_bytes = 0;
  // Tracked compute workspace (parameter copy-outs) and the largest
  // MoeModel::activation_bytes() seen after a computation.
  int64_t peak_workspace_bytes = 0;
  int64_t peak_activation_bytes = 0;
  // With the plan's activation model (CPU): per FORWARD / BACKWARD in
  // program order, the model's activation bytes during and after it
  // (program/step_program.h's ReplayActivations predicts them).
  std::vector<ActivationPoint> activation_trace;
  // What the GPU path promises about synchronization and allocation (zeros
  // on the CPU).
  DeviceStepStats device;
};

// Communicator counters at one moment: the shard group, the replicate group
// (zeros without HSDP) and each slice group by size.
struct CollectiveStatsSnapshot {
  CommunicatorStats shard;
  CommunicatorStats replicas;
  std::map<int, CommunicatorStats> slices;
  // Expert parallelism's groups (zeros without it).
  CommunicatorStats ep_shard;
  CommunicatorStats ep;
};


// Takes a snapshot. `replicas` may be null. Works for any communicator
// backend (the GPU executor passes its NCCL groups).
template <typename Group>
CollectiveStatsSnapshot SnapshotCollectives(
    const Communicator& shard, const Communicator* replicas,
    const std::map<int, Group*>& slices,
    const ExpertGroups& experts = ExpertGroups()) {
  CollectiveStatsSnapshot snapshot;
  snapshot.shard = shard.stats();
  if (replicas != nullptr) snapshot.replicas = replicas->stats();
  for (const auto& [size, group] : slices)
    snapshot.slices[size] = group->stats();
  if (experts.ep_shard != nullptr) snapshot.ep_shard = experts.ep_shard->stats();
  if (experts.ep != nullptr) snapshot.ep = experts.ep->stats();
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

class StepBackend {
 public:
  virtual ~StepBackend() = default;

  // Installs the step's micro-batches (re-creating the model when the step
  // shape differs from the last one) and resets the step's counters; with
  // header.eval, the model evaluates (the loss at FORWARD(HEAD), no
  // activations kept for a backward).
  // Errors: the model's; "batches[m]: ..." for a batch it refuses.
  virtual absl::Status BeginStep(
      const v1::StepProgram& header,
      absl::Span<const data::MicroBatch> batches) = 0;
  // The failure of an asynchronous operation issued earlier (a collective),
  // as the step's error; OK when there is none. Checked before each command
  // (`label` names it).
  virtual absl::Status PendingError(const std::string& label) = 0;
  // Whether this rank holds a slice group of `group_size` ranks.
  virtual bool HasSliceGroup(int group_size) const = 0;
  // Performs the effect of `command`, which `state` has checked and
  // accepted. `label` names the command in errors. A backend that commits
  // the optimizer update here (OPTIMIZER_STEP) advances `*optimizer_steps`
  // (completed updates; the update it applies is number *optimizer_steps +
  // 1). An error ends the step: the executor aborts it, keeping itself
  // usable only when `*clean` is set (it starts false).
  virtual absl::Status Run(const v1::Command& command, const std::string& label,
                           StepState* state, int64_t* optimizer_steps,
                           bool* clean) = 0;
  // Completes a step whose OPTIMIZER_STEP ran (or an eval step whose
  // forwards all ran: state.eval(); no update, gradient norm 0): whatever of
  // the update is still outstanding (advancing `*optimizer_steps` when it
  // commits it here), then the result's loss, tokens, gradient norm, clip
  // coefficient,
  // collectives, memory peaks and device statistics. `state` is the step's
  // (its number, for messages); `optimizer_label` names its OPTIMIZER_STEP.
  // Errors end the step as Run's.
  virtual absl::Status EndStep(const StepState& state,
                               const std::string& optimizer_label,
                               int64_t* optimizer_steps, StepResult* result,
                               bool* clean) = 0;
  // After a failure: stops outstanding work, frees the step's buffers and
  // drops its gradients. Clears `*clean` when the shards are left unusable.
  virtual void Abort(bool* clean) = 0;
  // The host shard store (checkpoints, tests); null for device backends.
  virtual ShardStore* host_shards() { return nullptr; }
  // Wherever the shards live (not while a step runs): the rank's owned
  // slice of a parameter, as ShardStore::CopyOwnedParamSlice. Errors:
  // NOT_FOUND (name), device errors.
  virtual absl::Status CopyOwnedParamSlice(const std::string& name,
                                           float* out) const = 0;
  // The rank's training state (shard_state.h), for keep-state recovery,
  // healing and checkpoints (not while a step runs), and the replicate
  // group that addresses its memory (null without HSDP).
  virtual ShardState* shard_state() = 0;
  virtual Communicator* replica_group() const = 0;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_EXEC_STEP_BACKEND_H_
