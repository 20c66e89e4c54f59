#ifndef SHARDD_WORKER_EXEC_CPU_BACKEND_H_
#define SHARDD_WORKER_EXEC_CPU_BACKEND_H_

// The StepBackend of CPU ranks: a ShardStore in host memory, a MoeModel,
// and one communication thread that runs every collective and every free
// of an unsharded buffer in program order (so all ranks issue each
// communicator's collectives in the same order from a single thread), while
// the caller's thread computes. OPTIMIZER_STEP clips and applies the
// optimizer at once (the one the options name the options name:
// optimizer_registry.h). docs/design.md ("Step execution") gives each command's
// semantics and why the measured memory equals the plan's replay.

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "proto/model.pb.h"
#include "proto/plan.pb.h"
#include "proto/worker.pb.h"
#include "worker/comm/communicator.h"
#include "worker/data/batch_sampler.h"
#include "worker/exec/host_optimizer_shards.h"
#include "worker/exec/optimizer.h"
#include "worker/exec/step_backend.h"
#include "worker/exec/step_state.h"
#include "worker/memory/memory_tracker.h"
#include "worker/model/expert_exchange.h"
#include "worker/model/moe_model.h"
#include "worker/shards/shard_store.h"

namespace shardd {

class CpuBackend final : public StepBackend {
 public:
  // Creates this rank's ShardStore (shards initialised from options.seed)
  // and MoeModel (step shape from plan.step()). Arguments and errors as
  // StepExecutor::Create's.
  static absl::StatusOr<std::unique_ptr<CpuBackend>> Create(
      const v1::ShardingPlan& plan, const v1::ModelSpec& model,
      const StepExecutorOptions& options, Communicator* shard_group,
      Communicator* replicas, MemoryTracker* tracker,
      const SliceGroups& slice_groups,
      const ExpertGroups& expert_groups = ExpertGroups());

  // Skips queued collectives and waits for the running one (at most about
  // collective_timeout).
  ~CpuBackend() override;

  absl::Status BeginStep(const v1::StepProgram& header,
                         absl::Span<const data::MicroBatch> batches) override;
  absl::Status PendingError(const std::string& label) override;
  bool HasSliceGroup(int group_size) const override {
    return slice_groups_.count(group_size) > 0;
  }
  absl::Status Run(const v1::Command& command, const std::string& label,
                   StepState* state, int64_t* optimizer_steps,
                   bool* clean) override;
  absl::Status EndStep(const StepState& state,
                       const std::string& optimizer_label,
                       int64_t* optimizer_steps, StepResult* result,
                       bool* clean) override;
  void Abort(bool* clean) override;
  ShardStore* host_shards() override { return store_.get(); }
  absl::Status CopyOwnedParamSlice(const std::string& name,
                                   float* out) const override {
    return store_->CopyOwnedParamSlice(name, out);
  }
  ShardState* shard_state() override { return store_.get(); }
  Communicator* replica_group() const override { return replicas_; }

 private:
  class CommThread;
  class Params;

  // The communication queue's view of a unit, and the trainable ranges the
  // optimizer updates (StepState holds the rest of the unit's state).
  struct UnitQueue {
    int64_t gather_ticket = -1;  // Queue ticket of the last UNSHARD.
    int64_t last_ticket = -1;    // Last queued operation on the unit.
    // This rank's trainable, unpadded elements of the master shard:
    // [begin, end) offsets into the unit's shard.
    std::vector<std::pair<int64_t, int64_t>> ranges;
  };

  CpuBackend(const v1::ShardingPlan& plan, const StepExecutorOptions& options,
             Communicator* shard_group, Communicator* replicas,
             const SliceGroups& slice_groups, const ExpertGroups& expert_groups,
             MemoryTracker* tracker);

  // The group unit `u` gathers and reduces over: its ep_shard group for an
  // expert-parallel unit, else the shard group.
  Communicator* GroupOf(int u) const {
    return plan_.units(u).ep() > 1 ? expert_groups_.ep_shard : shard_group_;
  }

  // OPTIMIZER_STEP: drains the queue, all-reduces the gradient norm, clips,
  // prepares every unit's update, then applies them all.
  absl::Status OptimizerStep(const std::string& label, int64_t* optimizer_steps,
                             bool* clean);
  // Queues the free of the slice a finished re-gather of `unit` consumed
  // (when it gathered from one) as a free: in program order with the other
  // frees, and waited for by the next ALLOC_GRAD, so the measured memory
  // follows the plan's replay.
  void DropSlice(int unit, const std::string& label, StepState* state);
  // After a FORWARD(HEAD) with gradients: sums the pass's load-balancing
  // statistics (MoeModel::router_aux_stats) over the shard group and the
  // replicas, so the loss and its gradient are the micro-batch's.
  absl::Status ReduceRouterAuxStats(int pass, const std::string& label);
  void ZeroShardGrads();

  // Creates model_ for `options` with the plan's recompute flags.
  absl::Status CreateModel(const MoeModelOptions& options);
  // Moves the tracker's kActivations to `peak`, then down to `live`.
  void SyncActivations(int64_t peak, int64_t live)
      ABSL_LOCKS_EXCLUDED(activations_mu_);

  const v1::ShardingPlan plan_;
  const StepExecutorOptions options_;
  Communicator* const shard_group_;
  Communicator* const replicas_;
  const SliceGroups slice_groups_;
  const ExpertGroups expert_groups_;
  // Expert parallelism's token exchange over expert_groups_.ep (null
  // without it); the model reads it.
  std::unique_ptr<ExpertExchange> exchange_;
  MemoryTracker* const tracker_;
  v1::ModelSpec model_spec_;
  // Used by the caller thread and the queued tasks (which the queue orders
  // with the caller).
  std::unique_ptr<ShardStore> store_;
  std::unique_ptr<MoeModel> model_;
  // The store's memory and arithmetic for the optimizer (its all-gathers
  // go through comm_).
  std::unique_ptr<HostOptimizerShards> optimizer_shards_;
  std::unique_ptr<Optimizer> optimizer_;
  MoeModelOptions model_options_;
  std::vector<UnitQueue> queue_units_;

  // The step in progress.
  int64_t last_free_ticket_ = -1;
  CollectiveStatsSnapshot stats_start_;
  int64_t peak_activation_bytes_ = 0;
  // The activation bytes the tracker holds as kActivations (updated on the
  // communication thread, in program order; see Run).
  absl::Mutex activations_mu_;
  int64_t tracked_activations_ ABSL_GUARDED_BY(activations_mu_) = 0;
  std::vector<ActivationPoint> activation_trace_;
  double grad_norm_ = 0.0;
  double clip_coefficient_ = 1.0;

  // Destroyed first (see the destructor): its tasks use store_.
  std::unique_ptr<CommThread> comm_;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_EXEC_CPU_BACKEND_H_
