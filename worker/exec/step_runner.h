#ifndef SHARDD_WORKER_EXEC_STEP_RUNNER_H_
#define SHARDD_WORKER_EXEC_STEP_RUNNER_H_

// A job's steps on this rank: one StepExecutor, over a CpuBackend (built by
// WorkerRuntime) or a CudaBackend (CreateDeviceStepRunner in
// device_step_runner.h, CUDA builds only, so the default build needs no
// CUDA), together with what its backend uses and must outlive it, and what
// the worker's statistics read.

#include <cstdint>
#include <memory>
#include <utility>

#include "worker/comm/communicator.h"
#include "worker/exec/step_executor.h"
#include "worker/memory/memory_tracker.h"

namespace shardd {

class StepRunner {
 public:
  // What a backend uses that the runner owns (a device's communicators,
  // allocator and tracker); destroyed after the executor.
  class Resources {
   public:
    virtual ~Resources() = default;
  };

  // `shard_group` and `memory` (for statistics: the shard group whose
  // collectives count, and the tracker of the memory holding the shards,
  // host or device) belong to the caller or to `resources`.
  StepRunner(std::unique_ptr<StepExecutor> executor,
             const Communicator* shard_group, const MemoryTracker* memory,
             std::unique_ptr<Resources> resources = nullptr)
      : resources_(std::move(resources)),
        executor_(std::move(executor)),
        shard_group_(shard_group),
        memory_(memory) {}

  StepExecutor& executor() const { return *executor_; }
  const Communicator* shard_group() const { return shard_group_; }
  const MemoryTracker* memory() const { return memory_; }

 private:
  // Declaration order: the executor goes before what its backend uses.
  std::unique_ptr<Resources> resources_;
  std::unique_ptr<StepExecutor> executor_;
  const Communicator* shard_group_;
  const MemoryTracker* memory_;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_EXEC_STEP_RUNNER_H_
