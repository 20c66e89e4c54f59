#include "worker/exec/step_checks.h"

#include "absl/strings/str_cat.h"
#include "common/error_info.h"
#include "program/step_program.h"

namespace shardd {
namespace {

int OrOne(int value) { return value < 1 ? 1 : value; }

}  // namespace

absl::Status CheckProgramHeader(const v1::StepProgram& program,
                                uint64_t plan_fingerprint) {
  if (program.plan_fingerprint() != plan_fingerprint) {
    return WithErrorReason(
        absl::FailedPreconditionError(absl::StrCat(
            "stale plan: program.plan_fingerprint ", program.plan_fingerprint(),
            " is not the fingerprint of the plan this worker holds (",
            plan_fingerprint, "); reload the plan")),
        kReasonPlanNotHeld);
  }
  if (program.microbatches() < 1 || program.microbatches() > kMaxMicrobatches) {
    return absl::InvalidArgumentError(
        absl::StrCat("program.microbatches: must be between 1 and ",
                     kMaxMicrobatches, ", got ", program.microbatches()));
  }
  if (program.passes() < 1 || program.passes() > kMaxPasses) {
    return absl::InvalidArgumentError(
        absl::StrCat("program.passes: must be between 1 and ", kMaxPasses,
                     ", got ", program.passes()));
  }
  if (program.no_grad_passes() < 0 ||
      program.no_grad_passes() >= program.passes()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "program.no_grad_passes: must be between 0 and passes - 1 (",
        program.passes() - 1, "), got ", program.no_grad_passes()));
  }
  return absl::OkStatus();
}

absl::Status CheckStepBatches(const v1::StepProgram& header,
                              absl::Span<const data::MicroBatch> batches) {
  if (static_cast<int64_t>(batches.size()) != header.microbatches()) {
    return absl::InvalidArgumentError(
        absl::StrCat("batches: the program has ", header.microbatches(),
                     " micro-batches, got ", batches.size()));
  }
  for (size_t m = 0; m < batches.size(); ++m) {
    const data::MicroBatch& b = batches[m];
    const int64_t n = b.rows * b.seq_len;
    if (b.rows < 1 || b.seq_len < 1 ||
        static_cast<int64_t>(b.inputs.size()) != n ||
        static_cast<int64_t>(b.targets.size()) != n) {
      return absl::InvalidArgumentError(absl::StrCat(
          "batches[", m, "]: need rows >= 1, seq_len >= 1 and rows * seq_len ",
          "inputs and targets, got rows ", b.rows, ", seq_len ", b.seq_len,
          ", ", b.inputs.size(), " inputs, ", b.targets.size(), " targets"));
    }
  }
  return absl::OkStatus();
}

MoeModelOptions ModelOptionsFor(int microbatches, int passes,
                                int no_grad_passes, float scale) {
  MoeModelOptions options;
  options.microbatches = OrOne(microbatches);
  options.passes = OrOne(passes);
  options.no_grad_passes = no_grad_passes;
  options.self_conditioning_scale = scale;
  return options;
}

bool SameStepShape(const MoeModelOptions& a, const MoeModelOptions& b) {
  return a.microbatches == b.microbatches && a.passes == b.passes &&
         a.no_grad_passes == b.no_grad_passes;
}

}  // namespace shardd
