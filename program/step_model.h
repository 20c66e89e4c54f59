#ifndef SHARDD_PROGRAM_STEP_MODEL_H_
#define SHARDD_PROGRAM_STEP_MODEL_H_

// Memory and communication model of one training step on one rank (every
// rank of the FSDP layout is symmetric). It compiles the plan into the step
// program the workers run (program/step_program.h) and replays it, recording
// the live unsharded bytes after every unshard, reshard, gradient allocation
// and reduce-scatter; a worker executing the same program measures the same
// peak. See docs/design.md, "Memory model".

#include "absl/status/status.h"
#include "program/step_program.h"  // kMaxMicrobatches and the other bounds.
#include "proto/plan.pb.h"

namespace shardd {

// Reads plan->units (laid out, with prefetch lists and reshard policies),
// plan->step, plan->precision and plan->mesh; fills plan->memory and
// plan->comm with the replay of CompileStepProgram(*plan) (streamed: the
// program is not held, so there is no length limit). The timeline is kept
// only when `include_timeline`.
// Errors: INVALID_ARGUMENT naming the field (step shape out of range:
// microbatches outside [1, kMaxMicrobatches], passes outside [1, kMaxPasses],
// no_grad_passes outside [0, passes), prefetch depths outside
// [0, kMaxPrefetchDepth]; mesh.dp_shard < 1; a unit whose parent, kind,
// layer_index, prefetch indices, sizes, dtypes or reshard group are
// inconsistent).
absl::Status ModelStep(bool include_timeline, v1::ShardingPlan* plan);

}  // namespace shardd

#endif  // SHARDD_PROGRAM_STEP_MODEL_H_
