#include "worker/exec/device_step_runner.h"

#include <algorithm>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/memory/cuda_memory_backend.h"
#include "worker/memory/device_allocator.h"
#include "worker/exec/device_step_executor.h"
#include "worker/comm/in_memory_kv_client.h"
#include "worker/memory/memory_tracker.h"
#include "worker/comm/nccl_communicator.h"

namespace shardd {
namespace {

class DeviceStepRunner final : public StepRunner {
 public:
  explicit DeviceStepRunner(int device)
      : backend_(device), allocator_(&backend_, &tracker_) {}

  ~DeviceStepRunner() override {
    // The executor's buffers go back to the allocator before the
    // communicators finalize.
    executor_.reset();
  }

  absl::StatusOr<StepResult> Execute(
      const v1::StepProgram& program,
      absl::Span<const data::MicroBatch> batches) override {
    SHARDD_ASSIGN_OR_RETURN(DeviceStepResult result,
                            executor_->Execute(program, batches));
    return result.step;
  }
  absl::Status BeginStep(const v1::StepProgram& header,
                         absl::Span<const data::MicroBatch> batches) override {
    return executor_->BeginStep(header, batches);
  }
  absl::Status ExecuteCommand(const v1::Command& command) override {
    return executor_->ExecuteCommand(command);
  }
  absl::StatusOr<StepResult> EndStep() override {
    SHARDD_ASSIGN_OR_RETURN(DeviceStepResult result, executor_->EndStep());
    return result.step;
  }
  absl::Status health() const override { return executor_->health(); }
  int64_t optimizer_steps() const override {
    return executor_->optimizer_steps();
  }
  const Communicator* shard_group() const override {
    return shard_group_.get();
  }
  const MemoryTracker* memory() const override { return &tracker_; }

  // Declaration order is destruction order in reverse: the allocator
  // outlives the executor, the communicators outlive both.
  std::unique_ptr<NcclCommunicator> shard_group_;
  std::unique_ptr<NcclCommunicator> replicas_;
  std::vector<std::unique_ptr<NcclCommunicator>> slice_groups_;
  MemoryTracker tracker_;
  CudaMemoryBackend backend_;
  DeviceAllocator allocator_;
  std::unique_ptr<DeviceStepExecutor> executor_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<StepRunner>> CreateDeviceStepRunner(
    const v1::ShardingPlan& plan, const v1::ModelSpec& model,
    const DeviceStepRunnerOptions& options, KeyValueClient* kv) {
  if (options.group_prefix.empty()) {
    return absl::InvalidArgumentError("group_prefix: must be non-empty");
  }
  const int dp_shard = plan.mesh().dp_shard();
  const int dp_replicate = std::max(1, plan.mesh().dp_replicate());
  InMemoryKeyValueClient local_kv;
  if (kv == nullptr) {
    if (dp_shard * dp_replicate > 1) {
      return absl::InvalidArgumentError(
          "kv: a world above one rank needs the coordinator's key-value "
          "store for the NCCL unique ids");
    }
    kv = &local_kv;
  }
  auto runner = std::make_unique<DeviceStepRunner>(options.device);
  NcclCommunicatorOptions comm_options;
  comm_options.device = options.device;
  comm_options.init_timeout = options.timeout;
  const std::string base = absl::StrCat(options.group_prefix, "nccl/");
  auto join =
      [&](const std::string& name, int rank,
          int size) -> absl::StatusOr<std::unique_ptr<NcclCommunicator>> {
    absl::StatusOr<std::unique_ptr<NcclCommunicator>> comm =
        NcclCommunicator::Create(kv, base + name, rank, size, comm_options);
    if (!comm.ok()) {
      return absl::Status(comm.status().code(),
                          absl::StrCat("joining NCCL group ", base, name, ": ",
                                       comm.status().message()));
    }
    return comm;
  };
  SHARDD_ASSIGN_OR_RETURN(runner->shard_group_,
                          join(absl::StrCat("shard", options.replica_rank),
                               options.shard_rank, dp_shard));
  if (dp_replicate > 1) {
    SHARDD_ASSIGN_OR_RETURN(runner->replicas_,
                            join(absl::StrCat("replica", options.shard_rank),
                                 options.replica_rank, dp_replicate));
  }
  DeviceSliceGroups slices;
  for (const v1::FsdpUnit& unit : plan.units()) {
    const v1::ReshardPolicy& policy = unit.reshard_after_forward();
    if (policy.policy_case() != v1::ReshardPolicy::kGroupSize) continue;
    const int g = policy.group_size();
    if (g <= 1 || g >= dp_shard || dp_shard % g != 0 || slices.count(g) != 0) {
      continue;
    }
    SHARDD_ASSIGN_OR_RETURN(
        std::unique_ptr<NcclCommunicator> group,
        join(absl::StrCat("slice", options.replica_rank, "/g", g, "/q",
                          options.shard_rank / g),
             options.shard_rank % g, g));
    slices[g] = group.get();
    runner->slice_groups_.push_back(std::move(group));
  }
  DeviceStepExecutorOptions executor_options;
  executor_options.step = options.executor;
  executor_options.step.shard_rank = options.shard_rank;
  executor_options.step.replica_rank = options.replica_rank;
  executor_options.device = options.device;
  SHARDD_ASSIGN_OR_RETURN(
      runner->executor_,
      DeviceStepExecutor::Create(plan, model, executor_options,
                                 runner->shard_group_.get(),
                                 runner->replicas_.get(), &runner->allocator_,
                                 &runner->tracker_, slices));
  return std::unique_ptr<StepRunner>(std::move(runner));
}

}  // namespace shardd
