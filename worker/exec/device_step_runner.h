#ifndef SHARDD_WORKER_EXEC_DEVICE_STEP_RUNNER_H_
#define SHARDD_WORKER_EXEC_DEVICE_STEP_RUNNER_H_

// The GPU StepRunner (step_runner.h): joins the job's NCCL groups and
// creates a StepExecutor over a CudaBackend on one CUDA device. CUDA builds
// only; WorkerRuntime reaches it through SHARDD_WITH_CUDA.
//
// Groups (NcclCommunicator::Create; the unique ids travel through the
// coordinator's key-value store), named like the Gloo groups of
// worker_runtime.h under "<base>nccl/":
//   shard<q>                 the dp_shard ranks of replica q, at rank s;
//   replica<s>               (dp_replicate > 1) at rank q;
//   slice<q>/g<G>/q<s / G>   per slice size G a unit reshards to.
// The runner owns the communicators, the device's caching allocator and
// its MemoryTracker.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/model.pb.h"
#include "proto/plan.pb.h"
#include "worker/comm/kv_client.h"
#include "worker/exec/step_executor.h"
#include "worker/exec/step_runner.h"

namespace shardd {

struct DeviceStepRunnerOptions {
  int device = 0;      // CUDA ordinal.
  int shard_rank = 0;  // As in worker_runtime.h.
  int replica_rank = 0;
  std::string group_prefix;  // "<job_id>/<membership_epoch>/".
  absl::Duration timeout = absl::Seconds(60);  // Group joins.
  StepExecutorOptions executor;  // shard_rank / replica_rank overwritten.
};

// `kv` is used only during the call; null is allowed for a world of one
// rank. Errors: INVALID_ARGUMENT (empty group_prefix, world > 1 without
// kv), NcclCommunicator::Create's (FAILED_PRECONDITION without a usable
// GPU, DEADLINE_EXCEEDED when a peer does not join), and
// CudaBackend::Create's.
absl::StatusOr<std::unique_ptr<StepRunner>> CreateDeviceStepRunner(
    const v1::ShardingPlan& plan, const v1::ModelSpec& model,
    const DeviceStepRunnerOptions& options, KeyValueClient* kv);

}  // namespace shardd

#endif  // SHARDD_WORKER_EXEC_DEVICE_STEP_RUNNER_H_
