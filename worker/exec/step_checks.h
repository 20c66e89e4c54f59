#ifndef SHARDD_WORKER_EXEC_STEP_CHECKS_H_
#define SHARDD_WORKER_EXEC_STEP_CHECKS_H_

// Checks and small helpers both step executors (CPU: step_executor.h, GPU:
// device_step_executor.h) apply to a step program before running it, so the
// two answer bad input with the same codes and words.

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "proto/worker.pb.h"
#include "worker/data/batch_sampler.h"
#include "worker/model/moe_model.h"

namespace shardd {

// The program header against the plan the worker holds: FAILED_PRECONDITION
// "stale plan" when plan_fingerprint differs; INVALID_ARGUMENT naming the
// field for microbatches outside [1, kMaxMicrobatches], passes outside
// [1, kMaxPasses] or no_grad_passes outside [0, passes).
absl::Status CheckProgramHeader(const v1::StepProgram& program,
                                uint64_t plan_fingerprint);

// INVALID_ARGUMENT unless there is one micro-batch per program micro-batch,
// each with rows >= 1, seq_len >= 1 and rows * seq_len inputs and targets.
absl::Status CheckStepBatches(const v1::StepProgram& header,
                              absl::Span<const data::MicroBatch> batches);

// The model options of a step shape (counts below 1 read as 1).
MoeModelOptions ModelOptionsFor(int microbatches, int passes,
                                int no_grad_passes, float scale);

// Whether two model options describe the same step shape.
bool SameStepShape(const MoeModelOptions& a, const MoeModelOptions& b);

}  // namespace shardd

#endif  // SHARDD_WORKER_EXEC_STEP_CHECKS_H_
