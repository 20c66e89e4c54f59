#ifndef SHARDD_WORKER_EXEC_CUDA_BACKEND_H_
#define SHARDD_WORKER_EXEC_CUDA_BACKEND_H_

// The StepBackend of GPU ranks (CUDA builds only): a DeviceShardStore in
// device memory, a DeviceMoeModel and NCCL communicators. Everything is
// stream-ordered and issued from the caller's thread, and a step has one
// host synchronization (EndStep), where the update is committed: the
// gradient norm is computed on the device at OPTIMIZER_STEP and AdamW is
// enqueued only once EndStep has seen the step succeed, so a failed step
// leaves the last committed state without copies. docs/design.md ("Step
// execution") gives each command's semantics on the device.

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "model/lora.h"
#include "proto/model.pb.h"
#include "proto/plan.pb.h"
#include "proto/worker.pb.h"
#include "worker/comm/nccl_communicator.h"
#include "worker/data/batch_sampler.h"
#include "worker/exec/device_optimizer_shards.h"
#include "worker/exec/optimizer.h"
#include "worker/exec/step_backend.h"
#include "worker/exec/step_executor.h"
#include "worker/exec/step_state.h"
#include "worker/memory/device_allocator.h"
#include "worker/memory/memory_tracker.h"
#include "worker/model/device_moe_model.h"
#include "worker/shards/device_shard_store.h"

namespace shardd {

struct CudaBackendOptions {
  // As for the CPU (exact_memory_order is implied: frees are issued in
  // program order from the caller's thread).
  StepExecutorOptions step;
  int device = 0;
  // Expert parallelism (mesh.ep > 1): the NCCL groups of ExpertGroups
  // (worker/comm/communicator.h): this rank's block of dp_shard / ep ranks,
  // which gathers and reduces the expert units, and the ep ranks at its
  // place in every block, which exchange the routed rows. Not owned.
  NcclCommunicator* ep_shard = nullptr;
  NcclCommunicator* ep = nullptr;
};

class CudaBackend final : public StepBackend {
 public:
  // Creates the compute stream, the DeviceShardStore and the
  // DeviceMoeModel. The communicators, allocator and tracker must outlive
  // the backend; `allocator` must report to `tracker` (which should be the
  // device's own). Errors: as StepExecutor::Create (with NCCL
  // communicators), plus FAILED_PRECONDITION when the device is unusable
  // and the errors of DeviceShardStore::Create and DeviceMoeModel::Create.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(
      const v1::ShardingPlan& plan, const v1::ModelSpec& model,
      const CudaBackendOptions& options, NcclCommunicator* shard_group,
      NcclCommunicator* replicas, DeviceAllocator* allocator,
      MemoryTracker* tracker, const DeviceSliceGroups& slice_groups = {});
  // Waits for the device work it enqueued, then frees it all.
  ~CudaBackend() override;

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
  absl::Status CopyOwnedParamSlice(const std::string& name,
                                   float* out) const override;
  ShardState* shard_state() override { return store_.get(); }
  Communicator* replica_group() const override { return replicas_; }

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

  CudaBackend(const v1::ShardingPlan& plan, const CudaBackendOptions& options,
              NcclCommunicator* shard_group, NcclCommunicator* replicas,
              const DeviceSliceGroups& slice_groups, DeviceAllocator* allocator,
              MemoryTracker* tracker);

  absl::Status EnqueueGradNorm();
  // After a FORWARD(HEAD) with gradients: sums the pass's load-balancing
  // statistics (DeviceMoeModel::router_aux_stats) over the shard group and
  // the replicas with NCCL, ordered on the compute stream between that
  // forward and the BACKWARD(HEAD) that reads them (as CpuBackend does).
  // The step's result: its loss, tokens, gradient norm and clip
  // coefficient, with the collectives, memory peaks, activation trace and
  // device statistics since BeginStep.
  void FillResult(double loss, int64_t tokens, double norm,
                  double clip_coefficient, StepResult* result);
  absl::Status ReduceRouterAuxStats(const v1::Command& command);
  // The model for a step shape, with the job's recompute and exchange.
  absl::Status CreateModel(const MoeModelOptions& options);
  // Every communicator of the job (shard, replicas, expert, slice groups).
  std::vector<NcclCommunicator*> Groups() const;
  absl::Status CommunicatorHealth() const;
  int64_t CommunicatorSyncs() const;

  const v1::ShardingPlan plan_;
  const CudaBackendOptions options_;
  NcclCommunicator* const shard_group_;
  NcclCommunicator* const replicas_;
  const DeviceSliceGroups slice_groups_;
  // Expert parallelism's exchange over options_.ep (null without it).
  std::unique_ptr<ExpertExchange> exchange_;
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

  std::unique_ptr<DeviceMoeModel> model_;
  // LoRA-adapted weights by base name (empty without LoRA) and the cuBLAS
  // handle of their merges.
  absl::flat_hash_map<std::string, LoraTarget> lora_targets_;
  cublasHandle_t cublas_ = nullptr;
  // The job's optimizer over the device shards (optimizer_shards.h).
  std::unique_ptr<OptimizerShards> optimizer_shards_;
  std::unique_ptr<Optimizer> optimizer_;
  MoeModelOptions model_options_;
  int64_t host_syncs_ = 0;

  // The step in progress.
  CollectiveStatsSnapshot stats_start_;
  int64_t model_syncs_start_ = 0;
  int64_t comm_syncs_start_ = 0;
  int64_t host_syncs_start_ = 0;
  DeviceAllocatorStats allocator_start_;
  int64_t peak_activation_bytes_ = 0;
  // (command peak, live) after each FORWARD / BACKWARD of the step.
  std::vector<ActivationPoint> activation_trace_;
};

// A StepExecutor over a new CudaBackend (arguments and errors as
// CudaBackend::Create). `backend`, when not null, receives the backend the
// executor owns (for its device shards and stream).
absl::StatusOr<std::unique_ptr<StepExecutor>> CreateCudaStepExecutor(
    const v1::ShardingPlan& plan, const v1::ModelSpec& model,
    const CudaBackendOptions& options, NcclCommunicator* shard_group,
    NcclCommunicator* replicas, DeviceAllocator* allocator,
    MemoryTracker* tracker, const DeviceSliceGroups& slice_groups = {},
    CudaBackend** backend = nullptr);

}  // namespace shardd

#endif  // SHARDD_WORKER_EXEC_CUDA_BACKEND_H_
