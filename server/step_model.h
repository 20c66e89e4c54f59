#ifndef SHARDD_SERVER_STEP_MODEL_H_
#define SHARDD_SERVER_STEP_MODEL_H_

// Memory and communication model of one training step on one rank (every
// rank of the FSDP layout is symmetric). It replays the schedule a shardd
// worker runs -- the same schedule the worker's step program follows, so the
// worker's measured peak equals this prediction -- and records the live
// unsharded bytes after every unshard, reshard, gradient allocation and
// reduce-scatter. See docs/design.md, "Memory model".

#include "absl/status/status.h"
#include "proto/plan.pb.h"

namespace shardd {

// Reads plan->units (laid out, with prefetch lists and reshard policies),
// plan->step, plan->precision and plan->mesh; fills plan->memory and
// plan->comm. The timeline is kept only when `include_timeline`.
// Errors: INVALID_ARGUMENT (step shape out of range: microbatches < 1,
// passes < 1, no_grad_passes >= passes, negative prefetch depths).
absl::Status ModelStep(bool include_timeline, v1::ShardingPlan* plan);

}  // namespace shardd

#endif  // SHARDD_SERVER_STEP_MODEL_H_
