#ifndef SHARDD_WORKER_EXEC_STEP_RUNNER_H_
#define SHARDD_WORKER_EXEC_STEP_RUNNER_H_

// What WorkerRuntime drives a job's steps through, whatever runs them: the
// CPU StepExecutor (CpuStepRunner, here) or the GPU DeviceStepExecutor
// (CreateDeviceStepRunner in device_step_runner.h, CUDA builds only), so
// the default build needs no CUDA. Semantics and errors are
// StepExecutor's (step_executor.h).

#include <cstdint>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "proto/worker.pb.h"
#include "worker/comm/communicator.h"
#include "worker/data/batch_sampler.h"
#include "worker/memory/memory_tracker.h"
#include "worker/exec/step_executor.h"

namespace shardd {

class StepRunner {
 public:
  virtual ~StepRunner() = default;

  virtual absl::StatusOr<StepResult> Execute(
      const v1::StepProgram& program,
      absl::Span<const data::MicroBatch> batches) = 0;
  virtual absl::Status BeginStep(
      const v1::StepProgram& header,
      absl::Span<const data::MicroBatch> batches) = 0;
  virtual absl::Status ExecuteCommand(const v1::Command& command) = 0;
  virtual absl::StatusOr<StepResult> EndStep() = 0;
  virtual absl::Status health() const = 0;
  virtual int64_t optimizer_steps() const = 0;

  // The CPU executor (tests, checkpoints); null when the steps run on a
  // device.
  virtual const StepExecutor* cpu_executor() const { return nullptr; }
  // The same, mutable (loading a checkpoint into its shards).
  virtual StepExecutor* mutable_cpu_executor() { return nullptr; }
  // For statistics: the shard group whose collectives count, and the
  // tracker of the memory holding the shards (host or device).
  virtual const Communicator* shard_group() const = 0;
  virtual const MemoryTracker* memory() const = 0;
};

// StepRunner over a StepExecutor (which it owns); the communicators and
// tracker belong to the caller and must outlive it.
class CpuStepRunner final : public StepRunner {
 public:
  CpuStepRunner(std::unique_ptr<StepExecutor> executor,
                const Communicator* shard_group, const MemoryTracker* tracker)
      : executor_(std::move(executor)),
        shard_group_(shard_group),
        tracker_(tracker) {}

  absl::StatusOr<StepResult> Execute(
      const v1::StepProgram& program,
      absl::Span<const data::MicroBatch> batches) override {
    return executor_->Execute(program, batches);
  }
  absl::Status BeginStep(const v1::StepProgram& header,
                         absl::Span<const data::MicroBatch> batches) override {
    return executor_->BeginStep(header, batches);
  }
  absl::Status ExecuteCommand(const v1::Command& command) override {
    return executor_->ExecuteCommand(command);
  }
  absl::StatusOr<StepResult> EndStep() override { return executor_->EndStep(); }
  absl::Status health() const override { return executor_->health(); }
  int64_t optimizer_steps() const override {
    return executor_->optimizer_steps();
  }
  const StepExecutor* cpu_executor() const override { return executor_.get(); }
  StepExecutor* mutable_cpu_executor() override { return executor_.get(); }
  const Communicator* shard_group() const override { return shard_group_; }
  const MemoryTracker* memory() const override { return tracker_; }

 private:
  std::unique_ptr<StepExecutor> executor_;
  const Communicator* shard_group_;
  const MemoryTracker* tracker_;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_EXEC_STEP_RUNNER_H_
