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

// Bounds on a step shape; they keep the replay (and its timeline) small.
inline constexpr int kMaxMicrobatches = 1024;
inline constexpr int kMaxPasses = 16;
inline constexpr int kMaxPrefetchDepth = 64;
// At most this many events are stored when the timeline is requested; all
// of them are still counted in timeline_events and searched for the peak.
inline constexpr int kMaxTimelineEvents = 1 << 20;

// Reads plan->units (laid out, with prefetch lists and reshard policies),
// plan->step, plan->precision and plan->mesh; fills plan->memory and
// plan->comm. The timeline is kept only when `include_timeline`.
// Errors: INVALID_ARGUMENT naming the field (step shape out of range:
// microbatches outside [1, kMaxMicrobatches], passes outside [1, kMaxPasses],
// no_grad_passes outside [0, passes), prefetch depths outside
// [0, kMaxPrefetchDepth]; mesh.dp_shard < 1; a unit whose parent, prefetch
// indices, sizes, dtypes or reshard group are inconsistent).
absl::Status ModelStep(bool include_timeline, v1::ShardingPlan* plan);

}  // namespace shardd

#endif  // SHARDD_SERVER_STEP_MODEL_H_
