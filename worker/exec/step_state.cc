#include "worker/exec/step_state.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "program/step_program.h"
#include "worker/exec/step_checks.h"

namespace shardd {

StepState::StepState(const v1::ShardingPlan* plan) : plan_(plan) {
  units_.resize(plan->units_size());
  trainable_.resize(plan->units_size(), false);
  for (int u = 0; u < plan->units_size(); ++u) {
    for (const v1::ParamLayout& param : plan->units(u).params()) {
      param_unit_[param.name()] = u;
      if (!param.frozen() && param.numel() > 0) trainable_[u] = true;
    }
  }
}

absl::Status StepState::CheckHeader(const v1::StepProgram& program) const {
  if (!failed_.ok()) return failed_;
  if (in_step_) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", header_.step(),
                     " is still in progress (fine-grained mode: EndStep it "
                     "first)"));
  }
  return CheckProgramHeader(program, plan_->fingerprint());
}

absl::Status StepState::ValidateOnce(const v1::StepProgram& program) {
  v1::StepProgram key_program = program;
  key_program.set_step(0);
  std::string key = key_program.SerializeAsString();
  if (validated_.contains(key)) return absl::OkStatus();
  SHARDD_RETURN_IF_ERROR(ValidateStepProgram(*plan_, program));
  if (validated_.size() >= 8) validated_.clear();
  validated_.insert(std::move(key));
  return absl::OkStatus();
}

void StepState::Begin(const v1::StepProgram& header) {
  step_start_ = absl::Now();
  header_.Clear();
  header_.set_plan_fingerprint(header.plan_fingerprint());
  header_.set_step(header.step());
  header_.set_microbatches(header.microbatches());
  header_.set_passes(header.passes());
  header_.set_no_grad_passes(header.no_grad_passes());
  header_.set_defer_grad_sync(header.defer_grad_sync());
  header_.set_eval(header.eval());
  in_step_ = true;
  stepped_ = false;
  touched_ = false;
  command_index_ = 0;
  head_forwards_ = 0;
  embed_backwards_ = 0;
  for (UnitState& run : units_) {
    run.gathered = false;
    run.pending = false;
    run.grad = false;
  }
}

void StepState::End() {
  in_step_ = false;
  stepped_ = false;
}

absl::Status StepState::CheckEndStep() const {
  if (!in_step_) return absl::FailedPreconditionError("no step in progress");
  return absl::OkStatus();
}

absl::Status StepState::EndedEarly() const {
  return absl::FailedPreconditionError(
      absl::StrCat("step ", header_.step(), " ended after ", command_index_,
                   " commands, before OPTIMIZER_STEP; the step was aborted"));
}

absl::Status StepState::CheckEvalDone() const {
  const int forwards = header_.microbatches() * header_.passes();
  if (head_forwards_ != forwards) {
    return absl::FailedPreconditionError(absl::StrCat(
        "eval step ", header_.step(), " ended after ", head_forwards_, " of ",
        forwards, " forward passes; the step was aborted"));
  }
  for (size_t i = 0; i < units_.size(); ++i) {
    const UnitState& s = units_[i];
    if (s.gathered || s.pending || s.slice_group != 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "eval step ", header_.step(), " ended with unit ", i, " (",
          plan_->units(i).name(), ") still gathered; the step was aborted"));
    }
  }
  return absl::OkStatus();
}

void StepState::ClearUnits() {
  for (UnitState& run : units_) run = UnitState();
}

absl::Status StepState::NoSliceGroup(int g) {
  return absl::FailedPreconditionError(
      absl::StrCat("group_size ", g,
                   ": this worker has no slice group of that size (the plan "
                   "reshards no unit to ",
                   g, " ranks)"));
}

absl::Status StepState::CheckRules(const v1::Command& c) const {
  if (stepped_) {
    return absl::FailedPreconditionError(
        "OPTIMIZER_STEP already ran: the step is over (EndStep)");
  }
  switch (c.op()) {
    case v1::Command::UNSHARD:
    case v1::Command::RESHARD:
    case v1::Command::WAIT_UNSHARD:
    case v1::Command::ALLOC_GRAD:
    case v1::Command::REDUCE_SCATTER:
      if (c.unit() < 0 || c.unit() >= static_cast<int>(units_.size())) {
        return absl::NotFoundError(absl::StrCat(
            "unit ", c.unit(), ": the plan has ", units_.size(), " units"));
      }
      break;
    default:
      break;
  }
  if (header_.eval() &&
      (c.op() == v1::Command::ALLOC_GRAD ||
       c.op() == v1::Command::REDUCE_SCATTER ||
       c.op() == v1::Command::BACKWARD ||
       c.op() == v1::Command::OPTIMIZER_STEP ||
       (c.op() == v1::Command::FORWARD && c.requires_grad()))) {
    return absl::FailedPreconditionError(
        "an eval step computes no gradients and takes no optimizer step");
  }
  const int u = c.unit();
  switch (c.op()) {
    case v1::Command::UNSHARD:
    case v1::Command::WAIT_UNSHARD:
    case v1::Command::RESHARD:
    case v1::Command::ALLOC_GRAD:
    case v1::Command::REDUCE_SCATTER:
      return CheckUnitCommand(units_[u], u, c, trainable_[u],
                              plan_->mesh().dp_shard());
    case v1::Command::FORWARD:
    case v1::Command::BACKWARD:
      return absl::OkStatus();
    case v1::Command::OPTIMIZER_STEP: {
      for (size_t i = 0; i < units_.size(); ++i) {
        SHARDD_RETURN_IF_ERROR(CheckUnitDoneForOptimizer(
            units_[i],
            absl::StrCat("unit ", i, " (", plan_->units(i).name(), ")")));
      }
      const int microbatches = header_.microbatches();
      const int grad_passes = header_.passes() - header_.no_grad_passes();
      if (head_forwards_ != microbatches * header_.passes() ||
          embed_backwards_ != microbatches * grad_passes) {
        return absl::FailedPreconditionError(absl::StrCat(
            "the step's computations have not all run (", head_forwards_,
            " of ", microbatches * header_.passes(), " forward passes, ",
            embed_backwards_, " of ", microbatches * grad_passes,
            " backward passes)"));
      }
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("op: must be a known command, got ", c.op()));
  }
}

void StepState::Accept(const v1::Command& c) {
  touched_ = true;
  ++command_index_;
  switch (c.op()) {
    case v1::Command::FORWARD:
      if (c.part() == v1::Command::HEAD) ++head_forwards_;
      break;
    case v1::Command::BACKWARD:
      if (c.part() == v1::Command::EMBED) ++embed_backwards_;
      break;
    case v1::Command::OPTIMIZER_STEP:
      break;
    default:
      ApplyUnitCommand(c, &units_[c.unit()]);
      break;
  }
}

bool StepState::TakeGatherFromSlice(int unit) {
  const bool from_slice = units_[unit].gather_slice_group != 0;
  units_[unit].gather_slice_group = 0;
  return from_slice;
}

absl::StatusOr<int> StepState::UnitOf(const std::string& name) const {
  auto it = param_unit_.find(name);
  if (it == param_unit_.end()) {
    return absl::NotFoundError(
        absl::StrCat("parameter '", name, "' is not in the plan"));
  }
  return it->second;
}

// Parameters come only from gathered, waited units and gradients go only
// into allocated buffers: the checks the validator makes per part, made
// per parameter, so a fine-grained caller cannot read a buffer a collective
// is still filling.
absl::Status StepState::CheckParamReadable(const std::string& name) const {
  SHARDD_ASSIGN_OR_RETURN(const int unit, UnitOf(name));
  const UnitState& run = units_[unit];
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
  return absl::OkStatus();
}

absl::Status StepState::CheckGradWritable(const std::string& name) const {
  SHARDD_ASSIGN_OR_RETURN(const int unit, UnitOf(name));
  if (!units_[unit].grad) {
    return absl::FailedPreconditionError(
        absl::StrCat("the gradient of parameter '", name, "' needs unit ", unit,
                     " (", plan_->units(unit).name(),
                     ") to hold an allocated unsharded "
                     "gradient (ALLOC_GRAD, and no REDUCE_SCATTER since)"));
  }
  return absl::OkStatus();
}

std::string StepState::Label(const v1::Command& c) const {
  return absl::StrCat("step ", header_.step(), " commands[", command_index_,
                      "] (", CommandToString(c), ")");
}

void StepState::Fail(const absl::Status& error, bool clean, int shard_rank,
                     int replica_rank) {
  End();
  if (clean || !failed_.ok()) return;
  failed_ = absl::FailedPreconditionError(absl::StrCat(
      "the executor is unusable after a failed step (", error.ToString(),
      "); re-create it with fresh communicators"));
  SHARDD_LOG(WARNING) << "shard rank " << shard_rank << ", replica rank "
                      << replica_rank << ": step aborted: " << error.ToString();
}

absl::Status StepState::CheckBetweenSteps(const std::string& what) const {
  if (!failed_.ok()) return failed_;
  if (in_step_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", header_.step(), " is in progress: ", what, " between steps"));
  }
  return absl::OkStatus();
}

}  // namespace shardd
