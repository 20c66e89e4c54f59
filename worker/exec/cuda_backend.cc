#include "worker/exec/cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"
#include "common/error_info.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/cuda/adamw.h"
#include "kernels/cuda/cuda_status.h"
#include "planner/activation_model.h"
#include "program/step_program.h"
#include "worker/exec/optimizer_registry.h"
#include "worker/exec/step_checks.h"
#include "worker/memory/cuda_memory_backend.h"
#include "worker/shards/device_lora_params.h"
#include "worker/shards/device_shard_kernels.h"

namespace shardd {

// Parameters only from gathered, waited units; gradients only into
// allocated ones (the checks StepExecutor's adapter makes).
class CudaBackend::Params : public DeviceParamSource {
 public:
  Params(DeviceShardStore* store, const StepState* state)
      : store_(store), state_(state) {}

  absl::StatusOr<DeviceTensor> Param(const std::string& name,
                                     void* stream) override {
    SHARDD_RETURN_IF_ERROR(state_->CheckParamReadable(name));
    return store_->Param(name, stream);
  }

  absl::StatusOr<float*> Grad(const std::string& name, void* stream) override {
    SHARDD_RETURN_IF_ERROR(state_->CheckGradWritable(name));
    return store_->Grad(name, stream);
  }

 private:
  DeviceShardStore* store_;
  const StepState* state_;
};

namespace {

DeviceDType ActivationDType(const v1::ShardingPlan& plan) {
  return ActivationsInBf16(plan) ? DeviceDType::kBFloat16
                                 : DeviceDType::kFloat32;
}

}  // namespace

CudaBackend::CudaBackend(const v1::ShardingPlan& plan,
                         const CudaBackendOptions& options,
                         NcclCommunicator* shard_group,
                         NcclCommunicator* replicas,
                         const DeviceSliceGroups& slice_groups,
                         DeviceAllocator* allocator, MemoryTracker* tracker)
    : plan_(plan),
      options_(options),
      shard_group_(shard_group),
      replicas_(replicas),
      slice_groups_(slice_groups),
      allocator_(allocator),
      tracker_(tracker) {}

CudaBackend::~CudaBackend() {
  if (compute_stream_ != nullptr) {
    if (store_ != nullptr) {
      store_->WaitForCollectives(compute_stream_).IgnoreError();
    }
    // Teardown, not a step: the buffers below must be idle before they go.
    cudaStreamSynchronize(compute_stream_);
  }
  model_.reset();
  if (cublas_ != nullptr) cublasDestroy(cublas_);
  norm_scratch_.Reset();
  norm_workspace_.Reset();
  store_.reset();
  if (host_norm_ != nullptr) cudaFreeHost(host_norm_);
  if (compute_stream_ != nullptr) cudaStreamDestroy(compute_stream_);
}

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(
    const v1::ShardingPlan& plan, const v1::ModelSpec& model,
    const CudaBackendOptions& options, NcclCommunicator* shard_group,
    NcclCommunicator* replicas, DeviceAllocator* allocator,
    MemoryTracker* tracker, const DeviceSliceGroups& slice_groups) {
  const StepExecutorOptions& step = options.step;
  if (shard_group == nullptr || allocator == nullptr || tracker == nullptr) {
    return absl::InvalidArgumentError(
        "shard_group, allocator and tracker: must not be null");
  }
  SHARDD_RETURN_IF_ERROR(CheckStepGroups(
      plan, step.shard_rank, step.replica_rank, *shard_group, replicas));
  // The CPU kernel's checks are the GPU kernel's (n = 0 launches nothing).
  SHARDD_RETURN_IF_ERROR(CheckStepOptions(step.collective_timeout,
                                          step.max_grad_norm, step.adamw));
  SHARDD_RETURN_IF_ERROR(CheckSliceGroups(plan, step.shard_rank, slice_groups));
  SHARDD_RETURN_IF_ERROR(CheckExpertGroups(
      plan, step.shard_rank, ExpertGroups{options.ep_shard, options.ep}));

  auto executor = absl::WrapUnique(new CudaBackend(
      plan, options, shard_group, replicas, slice_groups, allocator, tracker));
  SHARDD_ASSIGN_OR_RETURN(
      executor->exchange_,
      ExchangeFor(plan, model, options.ep, step.collective_timeout));
  executor->model_spec_ = model;
  SHARDD_RETURN_IF_ERROR(
      CudaStatus(cudaSetDevice(options.device), "cudaSetDevice"));
  SHARDD_RETURN_IF_ERROR(
      CudaStatus(cudaStreamCreateWithFlags(&executor->compute_stream_,
                                           cudaStreamNonBlocking),
                 "creating the compute stream"));
  DeviceShardStoreOptions store_options;
  store_options.shard_rank = step.shard_rank;
  store_options.seed = step.seed;
  store_options.initial_values = step.initial_values;
  store_options.collective_timeout = step.collective_timeout;
  store_options.trim_frozen_state =
      TrimsFrozenState(model.lora().rank() > 0, step.optimizer);
  SHARDD_ASSIGN_OR_RETURN(
      executor->store_,
      DeviceShardStore::Create(plan, model, store_options, allocator,
                               executor->compute_stream_, shard_group, replicas,
                               slice_groups, options.ep_shard));

  // Norm scratch: sized for the largest trainable range.
  int64_t largest = 1;
  for (int u = 0; u < executor->store_->num_units(); ++u) {
    for (const auto& range : executor->store_->layout(u).trainable_ranges) {
      largest = std::max(largest, range.second - range.first);
    }
  }
  executor->norm_workspace_bytes_ =
      kernels::cuda::SumOfSquaresWorkspaceBytes(largest);
  const DeviceStream stream = ToDeviceStream(executor->compute_stream_);
  SHARDD_ASSIGN_OR_RETURN(
      executor->norm_scratch_,
      DeviceBuffer::Allocate(allocator, sizeof(NormScratch),
                             MemoryKind::kWorkspace, stream));
  SHARDD_ASSIGN_OR_RETURN(
      executor->norm_workspace_,
      DeviceBuffer::Allocate(
          allocator, static_cast<int64_t>(executor->norm_workspace_bytes_),
          MemoryKind::kWorkspace, stream));
  void* pinned = nullptr;
  SHARDD_RETURN_IF_ERROR(
      CudaStatus(cudaMallocHost(&pinned, sizeof(NormScratch)),
                 "allocating pinned host memory"));
  executor->host_norm_ = static_cast<NormScratch*>(pinned);

  const v1::StepShape& shape = plan.step();
  SHARDD_RETURN_IF_ERROR(executor->CreateModel(ModelOptionsFor(
      shape.microbatches(), shape.passes(), shape.no_grad_passes(),
      step.self_conditioning_scale, step.diffusion)));
  // LoRA's adapted weights (docs/lora.md), merged per command.
  SHARDD_ASSIGN_OR_RETURN(const std::vector<LoraTarget> lora,
                          LoraTargetsOf(model));
  for (const LoraTarget& t : lora) executor->lora_targets_[t.base] = t;
  // cuBLAS on the compute stream: LoRA's merges, Muon's Newton-Schulz.
  SHARDD_RETURN_IF_ERROR(
      CublasStatus(cublasCreate(&executor->cublas_), "cublasCreate"));
  SHARDD_RETURN_IF_ERROR(CublasStatus(
      cublasSetStream(executor->cublas_, executor->compute_stream_),
      "cublasSetStream"));
  // The job's optimizer, the same code as the CPU backend's.
  executor->optimizer_shards_ = std::make_unique<DeviceOptimizerShards>(
      executor->store_.get(), allocator, executor->compute_stream_,
      executor->cublas_, shard_group, step.collective_timeout);
  SHARDD_ASSIGN_OR_RETURN(executor->optimizer_,
                          CreateOptimizer(step.optimizer, step.adamw, plan,
                                          model, *executor->optimizer_shards_));
  return executor;
}

absl::Status CudaBackend::CreateModel(const MoeModelOptions& options) {
  DeviceMoeModelOptions model_options;
  model_options.model = options;
  model_options.device = options_.device;
  model_options.stream = compute_stream_;
  model_options.activations = ActivationDType(plan_);
  SHARDD_ASSIGN_OR_RETURN(
      model_, DeviceMoeModel::Create(model_spec_, model_options, allocator_));
  SHARDD_RETURN_IF_ERROR(
      ApplyRecompute(plan_, model_->num_layers(), model_.get()));
  if (exchange_ != nullptr) {
    SHARDD_RETURN_IF_ERROR(model_->SetExpertExchange(
        exchange_.get(), EpCapacityBound(plan_), options_.ep,
        options_.step.collective_timeout));
  }
  model_options_ = options;
  return absl::OkStatus();
}

std::vector<NcclCommunicator*> CudaBackend::Groups() const {
  std::vector<NcclCommunicator*> groups = {shard_group_};
  for (NcclCommunicator* g : {replicas_, options_.ep_shard, options_.ep}) {
    if (g != nullptr) groups.push_back(g);
  }
  for (const auto& [size, group] : slice_groups_) groups.push_back(group);
  return groups;
}

absl::Status CudaBackend::CommunicatorHealth() const {
  for (NcclCommunicator* group : Groups()) {
    SHARDD_RETURN_IF_ERROR(group->health());
  }
  return absl::OkStatus();
}

int64_t CudaBackend::CommunicatorSyncs() const {
  int64_t syncs = 0;
  for (NcclCommunicator* group : Groups()) {
    syncs += group->host_synchronizations();
  }
  return syncs;
}

absl::Status CudaBackend::BeginStep(
    const v1::StepProgram& header, absl::Span<const data::MicroBatch> batches) {
  const MoeModelOptions wanted = ModelOptionsFor(
      header.microbatches(), header.passes(), header.no_grad_passes(),
      options_.step.self_conditioning_scale, options_.step.diffusion);
  if (!SameStepShape(wanted, model_options_)) {
    SHARDD_RETURN_IF_ERROR(CreateModel(wanted));
  }
  SHARDD_RETURN_IF_ERROR(SetStepBatches(model_.get(), batches));
  SHARDD_RETURN_IF_ERROR(
      SetStepExtras(header,
                    std::max(1, plan_.mesh().dp_shard()) *
                        std::max(1, plan_.mesh().dp_replicate()),
                    batches, model_.get()));
  allocator_->ResetPeaks();
  tracker_->ResetPeaks();
  allocator_start_ = allocator_->stats();
  stats_start_ =
      SnapshotCollectives(*shard_group_, replicas_, slice_groups_,
                          ExpertGroups{options_.ep_shard, options_.ep});
  model_syncs_start_ = model_->host_synchronizations();
  comm_syncs_start_ = CommunicatorSyncs();
  host_syncs_start_ = host_syncs_;
  peak_activation_bytes_ = 0;
  activation_trace_.clear();
  return absl::OkStatus();
}

absl::Status CudaBackend::PendingError(const std::string& label) {
  // A collective enqueued earlier may have failed meanwhile (the watchdog
  // aborted its communicator): no host wait needed to see it.
  const absl::Status async = CommunicatorHealth();
  if (async.ok()) return absl::OkStatus();
  return absl::AbortedError(
      absl::StrCat(label, " on shard rank ", options_.step.shard_rank,
                   ": collective failed: ", async.ToString()));
}

absl::Status CudaBackend::Run(const v1::Command& c, const std::string& label,
                              StepState* state, int64_t* optimizer_steps,
                              bool* clean) {
  const int u = c.unit();
  DeviceShardStore* store = store_.get();
  // The slice a finished re-gather consumed is freed once the gather is
  // waited for, in program order with the other frees.
  auto drop_slice = [&]() -> absl::Status {
    if (!state->TakeGatherFromSlice(u)) return absl::OkStatus();
    return store->DropSlice(u);
  };
  absl::Status status;
  switch (c.op()) {
    case v1::Command::UNSHARD:
      status = store->Unshard(u);
      // Without prefetch it "completes before the next command": on the
      // device.
      if (status.ok() && !c.prefetch()) {
        status = store->WaitForGather(u, compute_stream_);
        if (status.ok()) status = drop_slice();
      }
      break;
    case v1::Command::WAIT_UNSHARD:
      status = store->WaitForGather(u, compute_stream_);
      if (status.ok()) status = drop_slice();
      break;
    case v1::Command::RESHARD:
      status = store->Reshard(u, c.group_size());
      break;
    case v1::Command::ALLOC_GRAD:
      // Every earlier free was issued from this thread already: the
      // tracker sees the plan's order (exact_memory_order by construction).
      status = store->AllocGrad(u);
      break;
    case v1::Command::REDUCE_SCATTER:
      status = store->ReduceScatter(u);
      break;
    case v1::Command::FORWARD:
    case v1::Command::BACKWARD: {
      Params params(store, state);
      if (lora_targets_.empty()) {
        status = model_->Run(c, &params);
      } else {
        // LoRA: merged weights for this command, the adapters' gradients
        // split from the weights' at its end.
        DeviceLoraParams lora(&lora_targets_, &params, allocator_, cublas_,
                              compute_stream_);
        status = model_->Run(c, &lora);
        if (status.ok()) status = lora.Finish();
      }
      if (plan_.has_activations()) {
        // The step driver's ledger, command by command (the plan's
        // replay; step_executor_test's trace on the CPU).
        activation_trace_.push_back(
            {model_->command_activation_peak(), model_->activation_bytes()});
      }
      if (status.ok()) {
        peak_activation_bytes_ =
            std::max(peak_activation_bytes_, model_->command_activation_peak());
      }
      if (status.ok() && c.op() == v1::Command::FORWARD &&
          c.part() == v1::Command::HEAD && c.requires_grad()) {
        status = ReduceRouterAuxStats(c);
      }
      break;
    }
    case v1::Command::OPTIMIZER_STEP:
      // The update itself waits for EndStep (see the file comment).
      status = EnqueueGradNorm();
      break;
    default:
      // Unreachable: StepState::Check refuses unknown ops.
      status = absl::InternalError("unknown op");
      break;
  }
  if (status.ok()) return absl::OkStatus();
  return absl::Status(status.code(), absl::StrCat(label, " on shard rank ",
                                                  options_.step.shard_rank,
                                                  ": ", status.message()));
}

absl::Status CudaBackend::ReduceRouterAuxStats(const v1::Command& command) {
  const DeviceMoeModel::RouterAuxStats stats =
      model_->router_aux_stats(command.pass(), command.microbatch());
  if (stats.counts == nullptr) return absl::OkStatus();
  // In place on the compute stream's order: each all-reduce waits for the
  // work before it and the stream waits for its result. Every rank issues
  // them at the same command, so the collectives match.
  const cudaStream_t stream = compute_stream_;
  const absl::Duration timeout = options_.step.collective_timeout;
  for (NcclCommunicator* group : {shard_group_, replicas_}) {
    if (group == nullptr || group->world_size() == 1) continue;
    SHARDD_ASSIGN_OR_RETURN(
        NcclWork counts,
        group->AllReduceAsync(stats.counts, stats.num_counts, v1::INT64,
                              ReduceOp::kSum, NcclWaitFor::Stream(stream),
                              timeout));
    SHARDD_RETURN_IF_ERROR(counts.StreamWait(stream));
    SHARDD_ASSIGN_OR_RETURN(
        NcclWork sums,
        group->AllReduceAsync(stats.prob_sums, stats.num_prob_sums, v1::FLOAT32,
                              ReduceOp::kSum, NcclWaitFor::Stream(stream),
                              timeout));
    SHARDD_RETURN_IF_ERROR(sums.StreamWait(stream));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::EnqueueGradNorm() {
  const cudaStream_t stream = compute_stream_;
  SHARDD_RETURN_IF_ERROR(store_->WaitForCollectives(stream));
  NormScratch* scratch = norm_scratch_.as<NormScratch>();
  SHARDD_RETURN_IF_ERROR(
      CudaStatus(cudaMemsetAsync(scratch, 0, sizeof(NormScratch), stream),
                 "zeroing the norm scratch"));
  for (int u = 0; u < store_->num_units(); ++u) {
    const float* grads = store_->shard(u).grads;
    for (const auto& range : store_->layout(u).trainable_ranges) {
      SHARDD_RETURN_IF_ERROR(kernels::cuda::SumOfSquares(
          grads + range.first, range.second - range.first,
          &scratch->sum_of_squares, /*accumulate=*/true, norm_workspace_.data(),
          norm_workspace_bytes_, stream));
    }
  }
  // Summed over the shard group in float, like the CPU path (replicas hold
  // the same gradients after the HSDP all-reduce).
  SHARDD_RETURN_IF_ERROR(
      CudaStatus(device_kernels::LaunchDoubleToFloat(
                     &scratch->sum_of_squares, &scratch->local_sum, stream),
                 "rounding the local sum of squares"));
  SHARDD_ASSIGN_OR_RETURN(
      NcclWork reduced,
      shard_group_->AllReduceAsync(&scratch->local_sum, 1, v1::FLOAT32,
                                   ReduceOp::kSum, NcclWaitFor::Stream(stream),
                                   options_.step.collective_timeout));
  SHARDD_RETURN_IF_ERROR(reduced.StreamWait(stream));
  SHARDD_RETURN_IF_ERROR(
      CudaStatus(device_kernels::LaunchFloatToDouble(
                     &scratch->local_sum, &scratch->sum_of_squares, stream),
                 "widening the global sum of squares"));
  // With clipping off the coefficient is not used (any positive max_norm
  // keeps the kernel's arguments valid).
  const double max_norm =
      options_.step.max_grad_norm > 0.0 ? options_.step.max_grad_norm : 1.0;
  SHARDD_RETURN_IF_ERROR(kernels::cuda::ClipCoefficientFromSumOfSquares(
      &scratch->sum_of_squares, max_norm, &scratch->coefficient,
      &scratch->total_norm, stream));
  return CudaStatus(cudaMemcpyAsync(host_norm_, scratch, sizeof(NormScratch),
                                    cudaMemcpyDeviceToHost, stream),
                    "copying the gradient norm to the host");
}

absl::Status CudaBackend::EndStep(const StepState& state,
                                  const std::string& label,
                                  int64_t* optimizer_steps, StepResult* result,
                                  bool* clean) {
  // The one host synchronization: the compute stream waited for every
  // collective at OPTIMIZER_STEP, so this covers the whole step.
  ++host_syncs_;
  absl::StatusOr<DeviceMoeModel::StepLoss> loss = model_->ReadStepLoss();
  {
    const absl::Status comms = CommunicatorHealth();
    if (!comms.ok()) {
      const absl::Status error = absl::AbortedError(
          absl::StrCat(label, " on shard rank ", options_.step.shard_rank,
                       ": collective failed: ", comms.ToString(),
                       "; the update was not applied"));
      return error;
    }
  }
  if (!loss.ok()) {
    // A device-side data error (bad token id or target) or a CUDA error:
    // nothing was applied; only CUDA errors leave the device unusable.
    *clean = loss.status().code() == absl::StatusCode::kInvalidArgument;
    return absl::Status(
        loss.status().code(),
        absl::StrCat("step ", state.step(), " on shard rank ",
                     options_.step.shard_rank, ": ", loss.status().message(),
                     "; the update was not applied"));
  }
  if (state.eval()) {
    // An evaluation: no OPTIMIZER_STEP ran, nothing is updated.
    FillResult(loss->loss, loss->tokens, /*norm=*/0.0, /*clip=*/1.0, result);
    return absl::OkStatus();
  }
  const NormScratch host = *host_norm_;
  const double norm = host.total_norm;
  if (!std::isfinite(norm)) {
    const absl::Status error = absl::InternalError(
        absl::StrCat(label, ": the global gradient norm is not finite (", norm,
                     "); the update was skipped and the gradients dropped"));
    *clean = true;
    return error;
  }
  const bool clip =
      options_.step.max_grad_norm > 0.0 && host.coefficient < 1.0f;
  // Clip first, by the coefficient on the device: every optimizer sees the
  // clipped gradients (the same product the fused AdamW scale computed).
  if (clip) {
    const float* coefficient = &norm_scratch_.as<NormScratch>()->coefficient;
    for (int u = 0; u < store_->num_units(); ++u) {
      float* grads = store_->shard(u).grads;
      for (const auto& range : store_->layout(u).trainable_ranges) {
        SHARDD_RETURN_IF_ERROR(kernels::cuda::ScaleInPlace(
            grads + range.first, range.second - range.first, coefficient,
            compute_stream_));
      }
    }
  }
  const int64_t step = *optimizer_steps + 1;
  const OptimizerStepContext op =
      OptimizerContextFor(options_.step, step, label);
  bool partly_applied = false;
  const absl::Status stepped =
      StepOptimizer(*optimizer_, optimizer_shards_.get(), op, &partly_applied);
  if (!stepped.ok() && partly_applied) {
    // A launch failure: part of the update may be enqueued.
    return absl::InternalError(
        absl::StrCat(label,
                     ": the update failed after part of the shards "
                     "were updated: ",
                     stepped.message()));
  }
  SHARDD_RETURN_IF_ERROR(stepped);
  SHARDD_RETURN_IF_ERROR(store_->ZeroShardGrads());
  *optimizer_steps = step;

  FillResult(loss->loss, loss->tokens, norm,
             clip ? static_cast<double>(host.coefficient) : 1.0, result);
  return absl::OkStatus();
}

void CudaBackend::FillResult(double loss, int64_t tokens, double norm,
                             double clip_coefficient, StepResult* result) {
  result->loss = loss;
  result->tokens = tokens;
  result->grad_norm = norm;
  result->clip_coefficient = clip_coefficient;
  result->collectives = CollectivesBetween(
      stats_start_,
      SnapshotCollectives(*shard_group_, replicas_, slice_groups_,
                          ExpertGroups{options_.ep_shard, options_.ep}));
  SetMemoryPeaks(tracker_->Snapshot(), result);
  result->peak_activation_bytes = peak_activation_bytes_;
  result->activation_trace = activation_trace_;

  DeviceStepStats& device = result->device;
  device.model_host_synchronizations =
      model_->host_synchronizations() - model_syncs_start_;
  device.host_synchronizations = (host_syncs_ - host_syncs_start_) +
                                 device.model_host_synchronizations +
                                 (CommunicatorSyncs() - comm_syncs_start_);
  const DeviceAllocatorStats allocator = allocator_->stats();
  device.backend_mallocs =
      allocator.backend_mallocs - allocator_start_.backend_mallocs;
  device.backend_frees =
      allocator.backend_frees - allocator_start_.backend_frees;
  device.reserved_bytes = allocator.reserved_bytes;
}

absl::Status CudaBackend::CopyOwnedParamSlice(const std::string& name,
                                              float* out) const {
  return store_->CopyOwnedParamSlice(name, out);
}

void CudaBackend::Abort(bool* /*clean*/) {
  store_->ReleaseStepBuffers();
  store_->ZeroShardGrads().IgnoreError();
}

absl::StatusOr<std::unique_ptr<StepExecutor>> CreateCudaStepExecutor(
    const v1::ShardingPlan& plan, const v1::ModelSpec& model,
    const CudaBackendOptions& options, NcclCommunicator* shard_group,
    NcclCommunicator* replicas, DeviceAllocator* allocator,
    MemoryTracker* tracker, const DeviceSliceGroups& slice_groups,
    CudaBackend** backend) {
  SHARDD_ASSIGN_OR_RETURN(
      std::unique_ptr<CudaBackend> created,
      CudaBackend::Create(plan, model, options, shard_group, replicas,
                          allocator, tracker, slice_groups));
  if (backend != nullptr) *backend = created.get();
  return std::make_unique<StepExecutor>(plan, options.step, std::move(created));
}

}  // namespace shardd
