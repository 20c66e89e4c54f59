#include "worker/exec/device_step_executor.h"

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
#include "program/step_program.h"
#include "worker/memory/cuda_memory_backend.h"
#include "worker/shards/device_shard_kernels.h"
#include "worker/exec/step_checks.h"

namespace shardd {

// Parameters only from gathered, waited units; gradients only into
// allocated ones (the checks StepExecutor's adapter makes).
class DeviceStepExecutor::Params : public DeviceParamSource {
 public:
  Params(DeviceShardStore* store, const v1::ShardingPlan* plan,
         const absl::flat_hash_map<std::string, int>* param_unit,
         const std::vector<UnitRun>* units)
      : store_(store), plan_(plan), param_unit_(param_unit), units_(units) {}

  absl::StatusOr<DeviceTensor> Param(const std::string& name,
                                     void* stream) override {
    SHARDD_ASSIGN_OR_RETURN(const int unit, UnitOf(name));
    const UnitRun& run = (*units_)[unit];
    if (!run.gathered) {
      return absl::FailedPreconditionError(
          absl::StrCat("parameter '", name, "' needs unit ", unit, " (",
                       plan_->units(unit).name(), ") gathered (UNSHARD)"));
    }
    if (run.pending) {
      return absl::FailedPreconditionError(absl::StrCat(
          "parameter '", name, "' needs unit ", unit, " (",
          plan_->units(unit).name(),
          ") waited: its prefetched all-gather is pending (WAIT_UNSHARD)"));
    }
    return store_->Param(name, stream);
  }

  absl::StatusOr<float*> Grad(const std::string& name, void* stream) override {
    SHARDD_ASSIGN_OR_RETURN(const int unit, UnitOf(name));
    if (!(*units_)[unit].grad) {
      return absl::FailedPreconditionError(
          absl::StrCat("the gradient of parameter '", name, "' needs unit ",
                       unit, " (", plan_->units(unit).name(),
                       ") to hold an allocated unsharded "
                       "gradient (ALLOC_GRAD, and no REDUCE_SCATTER since)"));
    }
    return store_->Grad(name, stream);
  }

 private:
  absl::StatusOr<int> UnitOf(const std::string& name) const {
    auto it = param_unit_->find(name);
    if (it == param_unit_->end()) {
      return absl::NotFoundError(
          absl::StrCat("parameter '", name, "' is not in the plan"));
    }
    return it->second;
  }

  DeviceShardStore* store_;
  const v1::ShardingPlan* plan_;
  const absl::flat_hash_map<std::string, int>* param_unit_;
  const std::vector<UnitRun>* units_;
};

namespace {

int OrOne(int value) { return value < 1 ? 1 : value; }

DeviceDType ActivationDType(const v1::ShardingPlan& plan) {
  for (const v1::FsdpUnit& unit : plan.units()) {
    if (unit.precision().compute_dtype() == v1::BFLOAT16) {
      return DeviceDType::kBFloat16;
    }
  }
  return DeviceDType::kFloat32;
}

}  // namespace

DeviceStepExecutor::DeviceStepExecutor(const v1::ShardingPlan& plan,
                                       const DeviceStepExecutorOptions& options,
                                       NcclCommunicator* shard_group,
                                       NcclCommunicator* replicas,
                                       const DeviceSliceGroups& slice_groups,
                                       DeviceAllocator* allocator,
                                       MemoryTracker* tracker)
    : plan_(plan),
      options_(options),
      shard_group_(shard_group),
      replicas_(replicas),
      slice_groups_(slice_groups),
      allocator_(allocator),
      tracker_(tracker) {}

DeviceStepExecutor::~DeviceStepExecutor() {
  if (compute_stream_ != nullptr) {
    if (store_ != nullptr) {
      store_->WaitForCollectives(compute_stream_).IgnoreError();
    }
    // Teardown, not a step: the buffers below must be idle before they go.
    cudaStreamSynchronize(compute_stream_);
  }
  {
    absl::MutexLock lock(&mu_);
    model_.reset();
  }
  norm_scratch_.Reset();
  norm_workspace_.Reset();
  store_.reset();
  if (host_norm_ != nullptr) cudaFreeHost(host_norm_);
  if (compute_stream_ != nullptr) cudaStreamDestroy(compute_stream_);
}

absl::StatusOr<std::unique_ptr<DeviceStepExecutor>> DeviceStepExecutor::Create(
    const v1::ShardingPlan& plan, const v1::ModelSpec& model,
    const DeviceStepExecutorOptions& options, NcclCommunicator* shard_group,
    NcclCommunicator* replicas, DeviceAllocator* allocator,
    MemoryTracker* tracker, const DeviceSliceGroups& slice_groups) {
  const StepExecutorOptions& step = options.step;
  if (shard_group == nullptr || allocator == nullptr || tracker == nullptr) {
    return absl::InvalidArgumentError(
        "shard_group, allocator and tracker: must not be null");
  }
  const int dp_shard = plan.mesh().dp_shard();
  const int dp_replicate = OrOne(plan.mesh().dp_replicate());
  if (shard_group->world_size() != dp_shard ||
      shard_group->rank() != step.shard_rank) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard_group: must have mesh.dp_shard (", dp_shard,
                     ") ranks with this rank at options.shard_rank (",
                     step.shard_rank, "), got rank ", shard_group->rank(),
                     " of ", shard_group->world_size()));
  }
  if (dp_replicate > 1 &&
      (replicas == nullptr || replicas->world_size() != dp_replicate ||
       replicas->rank() != step.replica_rank)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "replicas: HSDP (mesh.dp_replicate ", dp_replicate,
        ") needs a replicate group of that many ranks with this rank at "
        "options.replica_rank (",
        step.replica_rank, ")"));
  }
  if (dp_replicate == 1 && replicas != nullptr && replicas->world_size() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("replicas: mesh.dp_replicate is 1 but the replicate "
                     "group has ",
                     replicas->world_size(), " ranks"));
  }
  if (!(step.collective_timeout > absl::ZeroDuration()) ||
      step.collective_timeout == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(
        "collective_timeout: must be positive and finite");
  }
  if (!(step.max_grad_norm >= 0.0) || !std::isfinite(step.max_grad_norm)) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_grad_norm: must be >= 0 and finite (0 turns "
                     "clipping off), got ",
                     step.max_grad_norm));
  }
  {
    // The CPU kernel's checks are the GPU kernel's (n = 0 launches nothing).
    const absl::Status adamw = kernels::AdamWStep(nullptr, nullptr, nullptr,
                                                  nullptr, 0, 1, step.adamw);
    if (!adamw.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("adamw: ", adamw.message()));
    }
  }
  for (const v1::FsdpUnit& unit : plan.units()) {
    const v1::ReshardPolicy& policy = unit.reshard_after_forward();
    if (policy.policy_case() != v1::ReshardPolicy::kGroupSize) continue;
    const int g = policy.group_size();
    if (g <= 1 || g >= dp_shard) continue;
    auto it = slice_groups.find(g);
    if (it == slice_groups.end() || it->second == nullptr ||
        it->second->world_size() != g ||
        it->second->rank() != step.shard_rank % g) {
      return absl::InvalidArgumentError(
          absl::StrCat("slice_groups: unit '", unit.name(),
                       "' reshards after forward to groups of ", g,
                       " ranks, which needs a slice group of ", g,
                       " ranks with this rank at shard_rank % ", g, " (",
                       step.shard_rank % g, ")"));
    }
  }

  auto executor = absl::WrapUnique(new DeviceStepExecutor(
      plan, options, shard_group, replicas, slice_groups, allocator, tracker));
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
  store_options.collective_timeout = step.collective_timeout;
  SHARDD_ASSIGN_OR_RETURN(
      executor->store_,
      DeviceShardStore::Create(plan, model, store_options, allocator,
                               executor->compute_stream_, shard_group, replicas,
                               slice_groups));

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

  absl::MutexLock lock(&executor->mu_);
  const v1::StepShape& shape = plan.step();
  executor->model_options_ =
      ModelOptionsFor(shape.microbatches(), shape.passes(),
                      shape.no_grad_passes(), step.self_conditioning_scale);
  DeviceMoeModelOptions model_options;
  model_options.model = executor->model_options_;
  model_options.device = options.device;
  model_options.stream = executor->compute_stream_;
  model_options.activations = ActivationDType(plan);
  SHARDD_ASSIGN_OR_RETURN(
      executor->model_,
      DeviceMoeModel::Create(model, model_options, allocator));

  executor->units_.resize(plan.units_size());
  for (int u = 0; u < plan.units_size(); ++u) {
    for (const v1::ParamLayout& param : plan.units(u).params()) {
      executor->param_unit_[param.name()] = u;
      if (!param.frozen() && param.numel() > 0) {
        executor->units_[u].trainable = true;
      }
    }
  }
  return executor;
}

int64_t DeviceStepExecutor::optimizer_steps() const {
  absl::MutexLock lock(&mu_);
  return optimizer_steps_;
}

absl::Status DeviceStepExecutor::health() const {
  absl::MutexLock lock(&mu_);
  return failed_;
}

absl::Status DeviceStepExecutor::CommunicatorHealth() const {
  SHARDD_RETURN_IF_ERROR(shard_group_->health());
  if (replicas_ != nullptr) SHARDD_RETURN_IF_ERROR(replicas_->health());
  for (const auto& [g, group] : slice_groups_) {
    SHARDD_RETURN_IF_ERROR(group->health());
  }
  return absl::OkStatus();
}

int64_t DeviceStepExecutor::CommunicatorSyncs() const {
  int64_t syncs = shard_group_->host_synchronizations();
  if (replicas_ != nullptr) syncs += replicas_->host_synchronizations();
  for (const auto& [g, group] : slice_groups_) {
    syncs += group->host_synchronizations();
  }
  return syncs;
}

absl::Status DeviceStepExecutor::CheckHeaderLocked(
    const v1::StepProgram& program) const {
  if (!failed_.ok()) return failed_;
  if (in_step_) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", header_.step(),
                     " is still in progress (fine-grained mode: EndStep it "
                     "first)"));
  }
  return CheckProgramHeader(program, plan_.fingerprint());
}

absl::Status DeviceStepExecutor::BeginStep(
    const v1::StepProgram& header, absl::Span<const data::MicroBatch> batches) {
  absl::MutexLock lock(&mu_);
  SHARDD_RETURN_IF_ERROR(CheckHeaderLocked(header));
  return BeginStepLocked(header, batches);
}

absl::Status DeviceStepExecutor::BeginStepLocked(
    const v1::StepProgram& header, absl::Span<const data::MicroBatch> batches) {
  SHARDD_RETURN_IF_ERROR(CheckStepBatches(header, batches));
  const MoeModelOptions wanted = ModelOptionsFor(
      header.microbatches(), header.passes(), header.no_grad_passes(),
      options_.step.self_conditioning_scale);
  if (!SameStepShape(wanted, model_options_)) {
    DeviceMoeModelOptions model_options;
    model_options.model = wanted;
    model_options.device = options_.device;
    model_options.stream = compute_stream_;
    model_options.activations = ActivationDType(plan_);
    SHARDD_ASSIGN_OR_RETURN(
        model_, DeviceMoeModel::Create(model_spec_, model_options, allocator_));
    model_options_ = wanted;
  }
  model_->ResetStep();
  for (size_t m = 0; m < batches.size(); ++m) {
    const data::MicroBatch& b = batches[m];
    const absl::Status set =
        model_->SetBatch(static_cast<int>(m), b.inputs.data(), b.targets.data(),
                         b.rows, b.seq_len);
    if (!set.ok()) {
      return absl::Status(set.code(),
                          absl::StrCat("batches[", m, "]: ", set.message()));
    }
  }
  allocator_->ResetPeaks();
  tracker_->ResetPeaks();
  allocator_start_ = allocator_->stats();
  stats_start_ = SnapshotCollectives(*shard_group_, replicas_, slice_groups_);
  model_syncs_start_ = model_->host_synchronizations();
  comm_syncs_start_ = CommunicatorSyncs();
  host_syncs_start_ = host_syncs_;
  step_start_ = absl::Now();
  header_.Clear();
  header_.set_plan_fingerprint(header.plan_fingerprint());
  header_.set_step(header.step());
  header_.set_microbatches(header.microbatches());
  header_.set_passes(header.passes());
  header_.set_no_grad_passes(header.no_grad_passes());
  header_.set_defer_grad_sync(header.defer_grad_sync());
  in_step_ = true;
  stepped_ = false;
  touched_ = false;
  command_index_ = 0;
  head_forwards_ = 0;
  embed_backwards_ = 0;
  peak_activation_bytes_ = 0;
  for (UnitRun& run : units_) {
    run.gathered = false;
    run.pending = false;
    run.grad = false;
  }
  return absl::OkStatus();
}

absl::StatusOr<DeviceStepResult> DeviceStepExecutor::Execute(
    const v1::StepProgram& program,
    absl::Span<const data::MicroBatch> batches) {
  absl::MutexLock lock(&mu_);
  SHARDD_RETURN_IF_ERROR(CheckHeaderLocked(program));
  v1::StepProgram key_program = program;
  key_program.set_step(0);
  std::string key = key_program.SerializeAsString();
  if (!validated_.contains(key)) {
    SHARDD_RETURN_IF_ERROR(ValidateStepProgram(plan_, program));
    if (validated_.size() >= 8) validated_.clear();
    validated_.insert(std::move(key));
  }
  SHARDD_RETURN_IF_ERROR(BeginStepLocked(program, batches));
  for (const v1::Command& command : program.commands()) {
    bool rejected = false;
    const absl::Status status = RunCommandLocked(command, &rejected);
    if (status.ok()) continue;
    if (rejected) AbortStepLocked(status, /*clean=*/!touched_);
    return status;
  }
  return EndStepLocked();
}

absl::Status DeviceStepExecutor::ExecuteCommand(const v1::Command& command) {
  absl::MutexLock lock(&mu_);
  if (!failed_.ok()) return failed_;
  if (!in_step_) {
    return absl::FailedPreconditionError(
        "no step in progress: BeginStep before ExecuteCommand");
  }
  bool rejected = false;
  return RunCommandLocked(command, &rejected);
}

absl::StatusOr<DeviceStepResult> DeviceStepExecutor::EndStep() {
  absl::MutexLock lock(&mu_);
  if (!failed_.ok()) return failed_;
  return EndStepLocked();
}

std::string DeviceStepExecutor::CommandLabelLocked(
    const v1::Command& command) const {
  return absl::StrCat("step ", header_.step(), " commands[", command_index_,
                      "] (", CommandToString(command), ")");
}

absl::Status DeviceStepExecutor::RunCommandLocked(const v1::Command& c,
                                                  bool* rejected) {
  *rejected = false;
  const std::string label = CommandLabelLocked(c);
  auto reject = [&](const absl::Status& status) {
    *rejected = true;
    return WithMessage(status, absl::StrCat(label, ": ", status.message()));
  };
  auto fail = [&](const absl::Status& status) {
    const absl::Status error(
        status.code(),
        absl::StrCat(label, " on shard rank ", options_.step.shard_rank, ": ",
                     status.message()));
    AbortStepLocked(error, /*clean=*/false);
    return error;
  };
  // A collective enqueued earlier may have failed meanwhile (the watchdog
  // aborted its communicator): no host wait needed to see it.
  {
    const absl::Status async = CommunicatorHealth();
    if (!async.ok()) {
      return fail(absl::AbortedError(
          absl::StrCat("collective failed: ", async.ToString())));
    }
  }
  if (stepped_) {
    return reject(absl::FailedPreconditionError(
        "OPTIMIZER_STEP already ran: the step is over (EndStep)"));
  }
  switch (c.op()) {
    case v1::Command::UNSHARD:
    case v1::Command::RESHARD:
    case v1::Command::WAIT_UNSHARD:
    case v1::Command::ALLOC_GRAD:
    case v1::Command::REDUCE_SCATTER:
      if (c.unit() < 0 || c.unit() >= static_cast<int>(units_.size())) {
        return reject(absl::NotFoundError(absl::StrCat(
            "unit ", c.unit(), ": the plan has ", units_.size(), " units")));
      }
      break;
    default:
      break;
  }
  const int u = c.unit();
  DeviceShardStore* store = store_.get();
  switch (c.op()) {
    case v1::Command::UNSHARD: {
      UnitRun& run = units_[u];
      if (run.gathered) {
        return reject(absl::FailedPreconditionError(
            absl::StrCat("unit ", u, " is already gathered")));
      }
      touched_ = true;
      ++command_index_;
      absl::Status status = store->Unshard(u);
      if (!status.ok()) return fail(status);
      run.gathered = true;
      run.pending = c.prefetch();
      run.gather_from_slice = run.slice;
      run.slice = false;
      if (!c.prefetch()) {
        // "Completes before the next command": on the device.
        status = store->WaitForGather(u, compute_stream_);
        if (!status.ok()) return fail(status);
        if (run.gather_from_slice) {
          run.gather_from_slice = false;
          status = store->DropSlice(u);
          if (!status.ok()) return fail(status);
        }
      }
      return absl::OkStatus();
    }
    case v1::Command::WAIT_UNSHARD: {
      UnitRun& run = units_[u];
      if (!run.pending) {
        return reject(absl::FailedPreconditionError(absl::StrCat(
            "unit ", u, " has no pending prefetched UNSHARD to wait for")));
      }
      touched_ = true;
      ++command_index_;
      run.pending = false;
      absl::Status waited = store->WaitForGather(u, compute_stream_);
      if (!waited.ok()) return fail(waited);
      if (run.gather_from_slice) {
        run.gather_from_slice = false;
        const absl::Status status = store->DropSlice(u);
        if (!status.ok()) return fail(status);
      }
      return absl::OkStatus();
    }
    case v1::Command::RESHARD: {
      UnitRun& run = units_[u];
      if (!run.gathered) {
        return reject(absl::FailedPreconditionError(
            absl::StrCat("unit ", u, " is not gathered")));
      }
      if (run.pending) {
        return reject(absl::FailedPreconditionError(
            absl::StrCat("unit ", u,
                         " has a pending prefetched all-gather: "
                         "WAIT_UNSHARD it first")));
      }
      const int g = c.group_size();
      const int dp = plan_.mesh().dp_shard();
      if (g != 0 && (g <= 1 || g >= dp || dp % g != 0)) {
        return reject(absl::InvalidArgumentError(absl::StrCat(
            "group_size: must be 0 (free) or a divisor of mesh.dp_shard (", dp,
            ") between 2 and ", dp - 1, ", got ", g)));
      }
      if (g != 0 && slice_groups_.count(g) == 0) {
        return reject(absl::FailedPreconditionError(absl::StrCat(
            "group_size ", g,
            ": this worker has no slice group of that size (the plan "
            "reshards no unit to ",
            g, " ranks)")));
      }
      touched_ = true;
      ++command_index_;
      const absl::Status status = store->Reshard(u, g);
      if (!status.ok()) return fail(status);
      run.gathered = false;
      run.slice = g != 0;
      return absl::OkStatus();
    }
    case v1::Command::ALLOC_GRAD: {
      UnitRun& run = units_[u];
      if (!run.trainable) {
        return reject(absl::FailedPreconditionError(
            absl::StrCat("unit ", u, " has no trainable parameters")));
      }
      if (run.grad) {
        return reject(absl::FailedPreconditionError(
            absl::StrCat("unit ", u, " already holds an unsharded gradient")));
      }
      touched_ = true;
      ++command_index_;
      // Every earlier free was issued from this thread already: the
      // tracker sees the plan's order (exact_memory_order by construction).
      const absl::Status status = store->AllocGrad(u);
      if (!status.ok()) return fail(status);
      run.grad = true;
      return absl::OkStatus();
    }
    case v1::Command::REDUCE_SCATTER: {
      UnitRun& run = units_[u];
      if (!run.grad) {
        return reject(absl::FailedPreconditionError(absl::StrCat(
            "unit ", u, " holds no unsharded gradient (ALLOC_GRAD)")));
      }
      touched_ = true;
      ++command_index_;
      const absl::Status status = store->ReduceScatter(u);
      if (!status.ok()) return fail(status);
      run.grad = false;
      return absl::OkStatus();
    }
    case v1::Command::FORWARD:
    case v1::Command::BACKWARD: {
      touched_ = true;
      ++command_index_;
      Params params(store, &plan_, &param_unit_, &units_);
      const absl::Status status = model_->Run(c, &params);
      if (!status.ok()) return fail(status);
      peak_activation_bytes_ =
          std::max(peak_activation_bytes_, model_->activation_bytes());
      if (c.op() == v1::Command::FORWARD && c.part() == v1::Command::HEAD) {
        ++head_forwards_;
      }
      if (c.op() == v1::Command::BACKWARD && c.part() == v1::Command::EMBED) {
        ++embed_backwards_;
      }
      return absl::OkStatus();
    }
    case v1::Command::OPTIMIZER_STEP: {
      for (size_t i = 0; i < units_.size(); ++i) {
        if (units_[i].gathered || units_[i].grad) {
          return reject(absl::FailedPreconditionError(absl::StrCat(
              "unit ", i, " (", plan_.units(i).name(), ") is still ",
              units_[i].gathered ? "gathered" : "holding a gradient",
              ": every unit must be resharded and reduce-scattered first")));
        }
      }
      const int microbatches = header_.microbatches();
      const int grad_passes = header_.passes() - header_.no_grad_passes();
      if (head_forwards_ != microbatches * header_.passes() ||
          embed_backwards_ != microbatches * grad_passes) {
        return reject(absl::FailedPreconditionError(absl::StrCat(
            "the step's computations have not all run (", head_forwards_,
            " of ", microbatches * header_.passes(), " forward passes, ",
            embed_backwards_, " of ", microbatches * grad_passes,
            " backward passes)")));
      }
      touched_ = true;
      ++command_index_;
      optimizer_label_ = label;
      const absl::Status status = EnqueueGradNormLocked();
      if (!status.ok()) return fail(status);
      stepped_ = true;
      return absl::OkStatus();
    }
    default:
      return reject(absl::InvalidArgumentError(
          absl::StrCat("op: must be a known command, got ", c.op())));
  }
}

absl::Status DeviceStepExecutor::EnqueueGradNormLocked() {
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

absl::StatusOr<DeviceStepResult> DeviceStepExecutor::EndStepLocked() {
  if (!in_step_) {
    return absl::FailedPreconditionError("no step in progress");
  }
  if (!stepped_) {
    const absl::Status error = absl::FailedPreconditionError(
        absl::StrCat("step ", header_.step(), " ended after ", command_index_,
                     " commands, before OPTIMIZER_STEP; the step was aborted"));
    AbortStepLocked(error, /*clean=*/!touched_);
    return error;
  }
  const std::string& label = optimizer_label_;
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
      AbortStepLocked(error, /*clean=*/false);
      return error;
    }
  }
  if (!loss.ok()) {
    // A device-side data error (bad token id or target) or a CUDA error:
    // nothing was applied; only CUDA errors leave the device unusable.
    const bool clean =
        loss.status().code() == absl::StatusCode::kInvalidArgument;
    const absl::Status error(
        loss.status().code(),
        absl::StrCat("step ", header_.step(), " on shard rank ",
                     options_.step.shard_rank, ": ", loss.status().message(),
                     "; the update was not applied"));
    AbortStepLocked(error, clean);
    return error;
  }
  const NormScratch host = *host_norm_;
  const double norm = host.total_norm;
  if (!std::isfinite(norm)) {
    const absl::Status error = absl::InternalError(
        absl::StrCat(label, ": the global gradient norm is not finite (", norm,
                     "); the update was skipped and the gradients dropped"));
    AbortStepLocked(error, /*clean=*/true);
    return error;
  }
  const bool clip =
      options_.step.max_grad_norm > 0.0 && host.coefficient < 1.0f;
  const float* grad_scale =
      clip ? &norm_scratch_.as<NormScratch>()->coefficient : nullptr;
  const int64_t step = optimizer_steps_ + 1;
  for (int u = 0; u < store_->num_units(); ++u) {
    const DeviceShardStore::UnitShard shard = store_->shard(u);
    for (const auto& range : store_->layout(u).trainable_ranges) {
      const int64_t b = range.first;
      const absl::Status status = kernels::cuda::AdamWStep(
          shard.params + b, shard.grads + b, shard.exp_avg + b,
          shard.exp_avg_sq + b, range.second - range.first, step,
          options_.step.adamw, grad_scale,
          shard.compute_bf16 == nullptr ? nullptr : shard.compute_bf16 + b,
          compute_stream_);
      if (!status.ok()) {
        // A launch failure: part of the update may be enqueued.
        const absl::Status error = absl::InternalError(absl::StrCat(
            label, ": AdamW failed after part of the shards were updated: ",
            status.message()));
        AbortStepLocked(error, /*clean=*/false);
        return error;
      }
    }
  }
  {
    const absl::Status zeroed = store_->ZeroShardGrads();
    if (!zeroed.ok()) {
      AbortStepLocked(zeroed, /*clean=*/false);
      return zeroed;
    }
  }
  optimizer_steps_ = step;

  DeviceStepResult out;
  StepResult& result = out.step;
  result.step = header_.step();
  result.loss = loss->loss;
  result.tokens = loss->tokens;
  result.seconds = absl::ToDoubleSeconds(absl::Now() - step_start_);
  result.grad_norm = norm;
  result.clip_coefficient = clip ? static_cast<double>(host.coefficient) : 1.0;
  result.optimizer_steps = optimizer_steps_;
  result.commands = command_index_;

  result.collectives = CollectivesBetween(
      stats_start_,
      SnapshotCollectives(*shard_group_, replicas_, slice_groups_));

  SetMemoryPeaks(tracker_->Snapshot(), &result);
  result.peak_activation_bytes = peak_activation_bytes_;

  out.model_host_synchronizations =
      model_->host_synchronizations() - model_syncs_start_;
  out.host_synchronizations = (host_syncs_ - host_syncs_start_) +
                              out.model_host_synchronizations +
                              (CommunicatorSyncs() - comm_syncs_start_);
  const DeviceAllocatorStats allocator = allocator_->stats();
  out.backend_mallocs =
      allocator.backend_mallocs - allocator_start_.backend_mallocs;
  out.backend_frees = allocator.backend_frees - allocator_start_.backend_frees;
  out.reserved_bytes = allocator.reserved_bytes;
  in_step_ = false;
  stepped_ = false;
  return out;
}

void DeviceStepExecutor::AbortStepLocked(const absl::Status& error,
                                         bool clean) {
  store_->ReleaseStepBuffers();
  store_->ZeroShardGrads().IgnoreError();
  for (UnitRun& run : units_) {
    run.gathered = false;
    run.pending = false;
    run.grad = false;
    run.slice = false;
    run.gather_from_slice = false;
  }
  in_step_ = false;
  stepped_ = false;
  if (!clean && failed_.ok()) {
    failed_ = absl::FailedPreconditionError(absl::StrCat(
        "the executor is unusable after a failed step (", error.ToString(),
        "); re-create it with fresh communicators"));
    SHARDD_LOG(WARNING) << "shard rank " << options_.step.shard_rank
                        << ", replica rank " << options_.step.replica_rank
                        << ": step aborted: " << error.ToString();
  }
}

}  // namespace shardd
