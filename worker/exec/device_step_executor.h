#ifndef SHARDD_WORKER_EXEC_DEVICE_STEP_EXECUTOR_H_
#define SHARDD_WORKER_EXEC_DEVICE_STEP_EXECUTOR_H_

// Runs step programs on one GPU: the device counterpart of StepExecutor
// (worker/exec/step_executor.h; same validation, command semantics,
// fine-grained mode and StepResult), with a DeviceShardStore, a DeviceMoeModel
// and NCCL communicators. CUDA builds only.
//
// Everything is stream-ordered and issued from the caller's thread (no
// communication thread: NCCL enqueues do not block):
//   UNSHARD        enqueues copy-in + all-gather on the all-gather stream.
//                  Without prefetch the compute stream waits for it at
//                  once (an event: "completes before the next command" on
//                  the device).
//   WAIT_UNSHARD   makes the compute stream wait for the gather's event.
//                  Never a host wait.
//   RESHARD, ALLOC_GRAD, REDUCE_SCATTER  enqueued as DeviceShardStore
//                  describes; FORWARD/BACKWARD DeviceMoeModel::Run.
//   OPTIMIZER_STEP enqueues the gradient-norm computation: the compute
//                  stream waits for every collective, SumOfSquares over
//                  this rank's trainable ranges (device double, rounded to
//                  float like the CPU's), an all-reduce (sum) over the shard
//                  group, ClipCoefficientFromSumOfSquares, and an async copy
//                  of the norm and coefficient to pinned host memory.
//   EndStep        the step's ONE host synchronization: waits for the
//                  compute stream (DeviceMoeModel::ReadStepLoss, after the
//                  compute stream was made to wait for every stream), checks
//                  the communicators' health, reads the loss, norm and
//                  coefficient, and only then commits: enqueues the fused
//                  AdamW (grad_scale = the device clip coefficient, the bf16
//                  compute copy refreshed in the same kernel) and the
//                  zeroing of the sharded gradients. Those run after
//                  EndStep returns, ordered before the next step's work by
//                  the compute stream.
//
// Why the update waits for EndStep: it makes "a step commits fully or not at
// all" hold on the GPU without copies of the optimizer state and without a
// second host synchronization. A non-finite global norm (identical on every
// rank), a failed or timed-out collective (the watchdog aborted a
// communicator) or a device-side data error found at EndStep leaves the
// master shards and AdamW moments of the last committed step untouched.
// Non-finite norm and data errors: the gradients are dropped, the executor
// stays usable (INTERNAL / INVALID_ARGUMENT). Collective failures: the
// executor refuses further steps (FAILED_PRECONDITION), as on the CPU.
//
// Memory: allocations and frees are issued from the host in program order
// (UNSHARD / ALLOC_GRAD allocate, RESHARD / REDUCE_SCATTER free, the slice
// a re-gather consumed is freed at the WAIT_UNSHARD of the gather, as on the
// CPU), so the device MemoryTracker fed by the DeviceAllocator sees the
// plan's replay and peak_unsharded_bytes equals the planner's prediction.
// The caching allocator reuses blocks stream-ordered, so after the first
// step no cudaMalloc happens (DeviceStepResult::backend_mallocs).
//
// Thread-safe: public methods serialize on an internal mutex.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "proto/model.pb.h"
#include "proto/plan.pb.h"
#include "proto/worker.pb.h"
#include "worker/comm/nccl_communicator.h"
#include "worker/data/batch_sampler.h"
#include "worker/exec/step_executor.h"
#include "worker/exec/step_state.h"
#include "worker/memory/device_allocator.h"
#include "worker/memory/memory_tracker.h"
#include "worker/model/device_moe_model.h"
#include "worker/shards/device_shard_store.h"

namespace shardd {

struct DeviceStepExecutorOptions {
  // As StepExecutorOptions (exact_memory_order is implied: see above).
  StepExecutorOptions step;
  int device = 0;
};

// A device step's result: the CPU executor's fields plus what the GPU path
// promises about synchronization and allocation.
struct DeviceStepResult {
  StepResult step;
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

class DeviceStepExecutor {
 public:
  // Creates the compute stream, the DeviceShardStore and the
  // DeviceMoeModel. The communicators, allocator and tracker must outlive
  // the executor; `allocator` must report to `tracker` (which should be
  // the device's own). Errors: as StepExecutor::Create (with NCCL
  // communicators), plus FAILED_PRECONDITION when the device is unusable
  // and the errors of DeviceShardStore::Create and DeviceMoeModel::Create.
  static absl::StatusOr<std::unique_ptr<DeviceStepExecutor>> Create(
      const v1::ShardingPlan& plan, const v1::ModelSpec& model,
      const DeviceStepExecutorOptions& options, NcclCommunicator* shard_group,
      NcclCommunicator* replicas, DeviceAllocator* allocator,
      MemoryTracker* tracker, const DeviceSliceGroups& slice_groups = {});
  // Waits for the device work it enqueued, then frees it all.
  ~DeviceStepExecutor();

  DeviceStepExecutor(const DeviceStepExecutor&) = delete;
  DeviceStepExecutor& operator=(const DeviceStepExecutor&) = delete;

  // As StepExecutor's (same errors).
  absl::StatusOr<DeviceStepResult> Execute(
      const v1::StepProgram& program,
      absl::Span<const data::MicroBatch> batches);
  absl::Status BeginStep(const v1::StepProgram& header,
                         absl::Span<const data::MicroBatch> batches);
  absl::Status ExecuteCommand(const v1::Command& command);
  absl::StatusOr<DeviceStepResult> EndStep();

  int64_t optimizer_steps() const;
  absl::Status health() const;
  // Not to be used while a step runs.
  const DeviceShardStore& shards() const { return *store_; }
  cudaStream_t compute_stream() const { return compute_stream_; }

 private:
  class Params;

  // Device scratch of the norm computation, copied to the host in one go.
  struct NormScratch {
    double sum_of_squares;
    double total_norm;
    float local_sum;
    float coefficient;
  };

  DeviceStepExecutor(const v1::ShardingPlan& plan,
                     const DeviceStepExecutorOptions& options,
                     NcclCommunicator* shard_group, NcclCommunicator* replicas,
                     const DeviceSliceGroups& slice_groups,
                     DeviceAllocator* allocator, MemoryTracker* tracker);

  absl::Status BeginStepLocked(const v1::StepProgram& header,
                               absl::Span<const data::MicroBatch> batches)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status RunCommandLocked(const v1::Command& command, bool* rejected)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status EnqueueGradNormLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<DeviceStepResult> EndStepLocked()
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees the step's buffers, drops the gradients, and marks the executor
  // failed unless `clean`.
  void AbortStepLocked(const absl::Status& error, bool clean)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CommunicatorHealth() const;
  int64_t CommunicatorSyncs() const;

  const v1::ShardingPlan plan_;
  const DeviceStepExecutorOptions options_;
  NcclCommunicator* const shard_group_;
  NcclCommunicator* const replicas_;
  const DeviceSliceGroups slice_groups_;
  DeviceAllocator* const allocator_;
  MemoryTracker* const tracker_;
  v1::ModelSpec model_spec_;
  cudaStream_t compute_stream_ = nullptr;
  std::unique_ptr<DeviceShardStore> store_;
  // Device NormScratch, SumOfSquares workspace, pinned host NormScratch.
  DeviceBuffer norm_scratch_;
  DeviceBuffer norm_workspace_;
  size_t norm_workspace_bytes_ = 0;
  NormScratch* host_norm_ = nullptr;

  mutable absl::Mutex mu_;
  std::unique_ptr<DeviceMoeModel> model_ ABSL_GUARDED_BY(mu_);
  MoeModelOptions model_options_ ABSL_GUARDED_BY(mu_);
  StepState state_ ABSL_GUARDED_BY(mu_);
  int64_t optimizer_steps_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t host_syncs_ ABSL_GUARDED_BY(mu_) = 0;

  // The step in progress (StepState holds its commands and units).
  std::string optimizer_label_ ABSL_GUARDED_BY(mu_);
  CollectiveStatsSnapshot stats_start_ ABSL_GUARDED_BY(mu_);
  int64_t model_syncs_start_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t comm_syncs_start_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t host_syncs_start_ ABSL_GUARDED_BY(mu_) = 0;
  DeviceAllocatorStats allocator_start_ ABSL_GUARDED_BY(mu_);
  int64_t peak_activation_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_EXEC_DEVICE_STEP_EXECUTOR_H_
