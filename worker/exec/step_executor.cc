#include "worker/exec/step_executor.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/error_info.h"
#include "common/status_macros.h"
#include "worker/exec/cpu_backend.h"
#include "worker/exec/step_checks.h"

namespace shardd {

StepExecutor::StepExecutor(const v1::ShardingPlan& plan,
                           const StepExecutorOptions& options,
                           std::unique_ptr<StepBackend> backend)
    : plan_(plan),
      options_(options),
      state_(&plan_),
      backend_(std::move(backend)) {}

StepExecutor::~StepExecutor() = default;

absl::StatusOr<std::unique_ptr<StepExecutor>> StepExecutor::Create(
    const v1::ShardingPlan& plan, const v1::ModelSpec& model,
    const StepExecutorOptions& options, Communicator* shard_group,
    Communicator* replicas, MemoryTracker* tracker,
    const SliceGroups& slice_groups, const ExpertGroups& expert_groups) {
  SHARDD_ASSIGN_OR_RETURN(
      std::unique_ptr<CpuBackend> backend,
      CpuBackend::Create(plan, model, options, shard_group, replicas, tracker,
                         slice_groups, expert_groups));
  return std::make_unique<StepExecutor>(plan, options, std::move(backend));
}

int64_t StepExecutor::optimizer_steps() const {
  absl::MutexLock lock(&mu_);
  return optimizer_steps_;
}

absl::Status StepExecutor::RestoreOptimizerSteps(int64_t steps) {
  if (steps < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer steps ", steps, " must be >= 0"));
  }
  absl::MutexLock lock(&mu_);
  SHARDD_RETURN_IF_ERROR(state_.CheckBetweenSteps("restore optimizer steps"));
  optimizer_steps_ = steps;
  return absl::OkStatus();
}

absl::Status StepExecutor::health() const {
  absl::MutexLock lock(&mu_);
  return state_.failed();
}

absl::Status StepExecutor::BeginStep(
    const v1::StepProgram& header, absl::Span<const data::MicroBatch> batches) {
  absl::MutexLock lock(&mu_);
  SHARDD_RETURN_IF_ERROR(state_.CheckHeader(header));
  return BeginStepLocked(header, batches);
}

absl::Status StepExecutor::BeginStepLocked(
    const v1::StepProgram& header, absl::Span<const data::MicroBatch> batches) {
  SHARDD_RETURN_IF_ERROR(CheckStepBatches(header, batches));
  SHARDD_RETURN_IF_ERROR(backend_->BeginStep(header, batches));
  state_.Begin(header);
  optimizer_label_.clear();
  return absl::OkStatus();
}

absl::StatusOr<StepResult> StepExecutor::Execute(
    const v1::StepProgram& program,
    absl::Span<const data::MicroBatch> batches) {
  absl::MutexLock lock(&mu_);
  SHARDD_RETURN_IF_ERROR(state_.CheckHeader(program));
  SHARDD_RETURN_IF_ERROR(state_.ValidateOnce(program));
  SHARDD_RETURN_IF_ERROR(BeginStepLocked(program, batches));
  for (const v1::Command& command : program.commands()) {
    bool rejected = false;
    const absl::Status status = RunCommandLocked(command, &rejected);
    if (status.ok()) continue;
    // A validated program is never rejected; if it is, stop the step.
    if (rejected) AbortStepLocked(status, /*clean=*/!state_.touched());
    return status;
  }
  return EndStepLocked();
}

absl::Status StepExecutor::ExecuteCommand(const v1::Command& command) {
  absl::MutexLock lock(&mu_);
  if (!state_.failed().ok()) return state_.failed();
  if (!state_.in_step()) {
    return absl::FailedPreconditionError(
        "no step in progress: BeginStep before ExecuteCommand");
  }
  bool rejected = false;
  return RunCommandLocked(command, &rejected);
}

absl::StatusOr<StepResult> StepExecutor::EndStep() {
  absl::MutexLock lock(&mu_);
  if (!state_.failed().ok()) return state_.failed();
  return EndStepLocked();
}

absl::Status StepExecutor::RunCommandLocked(const v1::Command& c,
                                            bool* rejected) {
  *rejected = false;
  const std::string label = state_.Label(c);
  // A collective issued earlier may have failed meanwhile.
  {
    const absl::Status pending = backend_->PendingError(label);
    if (!pending.ok()) {
      AbortStepLocked(pending, /*clean=*/false);
      return pending;
    }
  }
  {
    const absl::Status fits =
        state_.Check(c, [this](int g) { return backend_->HasSliceGroup(g); });
    if (!fits.ok()) {
      *rejected = true;
      return WithMessage(fits, absl::StrCat(label, ": ", fits.message()));
    }
  }
  state_.Accept(c);
  if (c.op() == v1::Command::OPTIMIZER_STEP) optimizer_label_ = label;
  bool clean = false;
  const absl::Status status =
      backend_->Run(c, label, &state_, &optimizer_steps_, &clean);
  if (!status.ok()) {
    AbortStepLocked(status, clean);
    return status;
  }
  if (c.op() == v1::Command::OPTIMIZER_STEP) state_.set_stepped();
  return absl::OkStatus();
}

absl::StatusOr<StepResult> StepExecutor::EndStepLocked() {
  SHARDD_RETURN_IF_ERROR(state_.CheckEndStep());
  const absl::Status complete =
      state_.eval()
          ? state_.CheckEvalDone()
          : (state_.stepped() ? absl::OkStatus() : state_.EndedEarly());
  if (!complete.ok()) {
    AbortStepLocked(complete, /*clean=*/!state_.touched());
    return complete;
  }
  StepResult result;
  bool clean = false;
  const absl::Status status = backend_->EndStep(
      state_, optimizer_label_, &optimizer_steps_, &result, &clean);
  if (!status.ok()) {
    AbortStepLocked(status, clean);
    return status;
  }
  result.step = state_.step();
  result.seconds = absl::ToDoubleSeconds(absl::Now() - state_.step_start());
  result.optimizer_steps = optimizer_steps_;
  result.eval = state_.eval();
  // The rate the backend's update used (its step optimizer_steps_ - 1); an
  // evaluation reports the rate of the last update.
  result.lr = StepLearningRate(options_, optimizer_steps_ - 1);
  result.commands = state_.commands();
  state_.End();
  return result;
}

void StepExecutor::AbortStepLocked(const absl::Status& error, bool clean) {
  backend_->Abort(&clean);
  state_.ClearUnits();
  state_.Fail(error, clean, options_.shard_rank, options_.replica_rank);
}

}  // namespace shardd
