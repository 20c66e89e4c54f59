#include "worker/exec/device_step_runner.h"

#include <algorithm>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/comm/in_memory_kv_client.h"
#include "worker/comm/nccl_communicator.h"
#include "worker/exec/cuda_backend.h"
#include "worker/memory/cuda_memory_backend.h"
#include "worker/memory/device_allocator.h"
#include "worker/memory/memory_tracker.h"

namespace shardd {
namespace {

// What a device executor's backend uses. Declaration order is destruction
// order in reverse: the communicators outlive the allocator.
struct DeviceResources final : StepRunner::Resources {
  explicit DeviceResources(int device)
      : backend(device), allocator(&backend, &tracker) {}

  std::unique_ptr<NcclCommunicator> shard_group;
  std::unique_ptr<NcclCommunicator> replicas;
  std::vector<std::unique_ptr<NcclCommunicator>> slice_groups;
  // Expert parallelism: this rank's block and the ranks at its place.
  std::unique_ptr<NcclCommunicator> ep_shard;
  std::unique_ptr<NcclCommunicator> ep;
  MemoryTracker tracker;
  CudaMemoryBackend backend;
  DeviceAllocator allocator;
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
  auto resources = std::make_unique<DeviceResources>(options.device);
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
  SHARDD_ASSIGN_OR_RETURN(resources->shard_group,
                          join(absl::StrCat("shard", options.replica_rank),
                               options.shard_rank, dp_shard));
  if (dp_replicate > 1) {
    SHARDD_ASSIGN_OR_RETURN(resources->replicas,
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
    resources->slice_groups.push_back(std::move(group));
  }
  // Expert parallelism (as the CPU worker's groups): each block of
  // dp_shard / ep consecutive shard ranks gathers its experts; the ranks
  // at the same place of every block exchange the tokens.
  const int ep = std::max(1, plan.mesh().ep());
  if (ep > 1) {
    const int g = dp_shard / ep;
    const int block = options.shard_rank / g;
    const int place = options.shard_rank % g;
    SHARDD_ASSIGN_OR_RETURN(
        resources->ep_shard,
        join(absl::StrCat("epshard", options.replica_rank, "/b", block), place,
             g));
    SHARDD_ASSIGN_OR_RETURN(
        resources->ep,
        join(absl::StrCat("ep", options.replica_rank, "/p", place), block, ep));
  }
  CudaBackendOptions executor_options;
  executor_options.step = options.executor;
  executor_options.ep_shard = resources->ep_shard.get();
  executor_options.ep = resources->ep.get();
  executor_options.step.shard_rank = options.shard_rank;
  executor_options.step.replica_rank = options.replica_rank;
  executor_options.device = options.device;
  SHARDD_ASSIGN_OR_RETURN(
      std::unique_ptr<StepExecutor> executor,
      CreateCudaStepExecutor(plan, model, executor_options,
                             resources->shard_group.get(),
                             resources->replicas.get(), &resources->allocator,
                             &resources->tracker, slices));
  const Communicator* shard_group = resources->shard_group.get();
  const MemoryTracker* memory = &resources->tracker;
  return std::make_unique<StepRunner>(std::move(executor), shard_group, memory,
                                      std::move(resources));
}

}  // namespace shardd
