#ifndef SHARDD_PROGRAM_STEP_PROGRAM_H_
#define SHARDD_PROGRAM_STEP_PROGRAM_H_

// Step programs: the schedule of one training step as a list of commands
// (v1::StepProgram, proto/worker.proto). The coordinator compiles a laid-out
// plan into one program that every rank runs on its own shards; a worker
// validates it on receipt; the planner's memory and communication model
// (program/step_model.h) is a replay of the same commands, so the peak a
// worker measures is the predicted one by construction.
//
// Parts and the units that own them (a FORWARD/BACKWARD of a part needs its
// owners gathered, and a BACKWARD needs their gradients allocated):
//   - EMBED and HEAD: the root group: every root (UNIT_ROOT, and
//     Megatron-FSDP buckets outside any layer: UNIT_FLAT_BUCKET with
//     layer_index < 0) and every unit nested in a root (dtype islands).
//   - LAYER of layer l: the layer units of l (the top-level non-root units
//     with layer_index l: a UNIT_LAYER, or all flat buckets of l) and the
//     units nested in them that are not experts (dtype islands).
//   - EXPERTS of layer l: the UNIT_EXPERTS units nested in l's layer units
//     and the units nested in those; when l has none, the LAYER owners (the
//     experts sit inside the layer unit, the "default" strategy).
// A layer has an EXPERTS part, and its FORWARD/BACKWARD(EXPERTS) commands
// exist, when it has a UNIT_EXPERTS unit or when one of the parameter names
// of its LAYER owners contains ".experts." (grouped experts folded into the
// layer or its buckets). Dense layers have no EXPERTS commands.
//
// The compiled schedule, per micro-batch m (sync = !defer_grad_sync or m is
// the last micro-batch; "gather u" = UNSHARD u unless it is gathered,
// "prefetch" = UNSHARD with prefetch = true of each target of the unit's
// forward_prefetch (forward) or backward_prefetch (backward) list that is
// not gathered; policy reshard = RESHARD when the unit is gathered and its
// reshard_after_forward frees it (group_size G, 1 < G < dp_shard, keeps a
// 1/G slice; roots never reshard after forward)):
//   Forward, pass p = 0..P-1 (requires_grad = p >= no_grad_passes):
//     root group: gather + prefetch each (each root in plan order, followed
//     by the units nested in it);
//     FORWARD EMBED; then each layer l in order:
//       gather + prefetch each layer unit, then each nested LAYER owner;
//       WAIT_UNSHARD; FORWARD LAYER l;
//       if l has experts: gather + prefetch the experts units (lazily, here);
//       WAIT_UNSHARD; FORWARD EXPERTS l; policy reshard of the experts
//       units; then policy reshard of the nested LAYER owners and the layer
//       units;
//     gather the root group (normally a no-op); FORWARD HEAD; policy reshard
//     of the root group's nested units.
//   Backward, grad passes p = P-1 down to no_grad_passes:
//     root group: gather + prefetch + ALLOC_GRAD each; BACKWARD HEAD;
//     each layer l in reverse: gather + prefetch the layer units (in
//     reverse); then
//       experts units (when l has some): gather + prefetch, WAIT_UNSHARD,
//       ALLOC_GRAD, BACKWARD EXPERTS l, post-backward of the experts units;
//       experts folded in the layer: gather the nested LAYER owners,
//       WAIT_UNSHARD, ALLOC_GRAD of the nested owners and layer units
//       (before the experts' backward writes them), BACKWARD EXPERTS l;
//       gather + prefetch the nested LAYER owners; WAIT_UNSHARD; ALLOC_GRAD
//       (nested owners, then layer units); BACKWARD LAYER l; post-backward
//       of the nested owners, then of the layer units (in reverse);
//     BACKWARD EMBED; post-backward of the root group's nested units.
//   After the grad passes: post-backward of the roots (once per step, as the
//   root's forward runs once).
//   After the last micro-batch: OPTIMIZER_STEP.
// ALLOC_GRAD is emitted only for units with trainable parameters whose
// unsharded gradient is not allocated yet. Post-backward runs once per grad
// pass (FSDP2 fires it per forward call): when syncing, REDUCE_SCATTER (if
// a gradient is allocated) then RESHARD (reshard_after_backward); on a
// deferred micro-batch nothing: gradients keep accumulating unsharded and
// parameters stay gathered (the next micro-batch's forward gathers nothing
// for them; its policy reshards still apply).
//
// WAIT_UNSHARD is emitted only for units with a pending prefetched
// all-gather, right before the first command that needs the unit; an
// UNSHARD without `prefetch` completes before the next command. The
// validator enforces exactly that: WAIT_UNSHARD needs a pending prefetch.

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/plan.pb.h"
#include "proto/worker.pb.h"

namespace shardd {

// Bounds on a step shape; they keep programs (and timelines) bounded.
inline constexpr int kMaxMicrobatches = 1024;
inline constexpr int kMaxPasses = 16;
inline constexpr int kMaxPrefetchDepth = 64;
// At most this many events are stored when the timeline is requested; all
// of them are still counted in timeline_events and searched for the peak.
inline constexpr int kMaxTimelineEvents = 1 << 20;
// Largest program CompileStepProgram materializes (a huge step shape times
// a deep model). ModelStep streams instead and has no such limit.
inline constexpr int kMaxProgramCommands = 1 << 23;

// Compiles `plan` (laid out: units with parents, kinds, layer indices,
// prefetch lists and reshard policies; plan.step() is the step shape) into
// the step program every rank runs. Sets plan_fingerprint, microbatches,
// passes, no_grad_passes and defer_grad_sync; `step` stays 0 (the caller
// numbers steps). The result passes ValidateStepProgram.
// Errors: INVALID_ARGUMENT naming the field: step shape out of range
// (microbatches outside [1, kMaxMicrobatches], passes outside
// [1, kMaxPasses], no_grad_passes outside [0, passes), prefetch depths
// outside [0, kMaxPrefetchDepth]), mesh.dp_shard < 1, a unit whose parent,
// kind, layer_index, prefetch indices, sizes, dtypes or reshard group are
// inconsistent, or a program longer than kMaxProgramCommands.
absl::StatusOr<v1::StepProgram> CompileStepProgram(
    const v1::ShardingPlan& plan);

// Checks that `program` is executable on `plan` by every rank: the header
// (microbatches in [1, kMaxMicrobatches], passes in [1, kMaxPasses],
// no_grad_passes in [0, passes)), and the commands in order against the unit
// states they produce:
//   - op set; unit in range for UNSHARD/RESHARD/WAIT_UNSHARD/ALLOC_GRAD/
//     REDUCE_SCATTER;
//   - UNSHARD only on a unit that is not gathered (sharded, or holding a
//     post-forward slice); prefetch = true leaves it pending;
//   - WAIT_UNSHARD only on a unit with a pending prefetched UNSHARD;
//   - RESHARD only on a gathered, waited unit; group_size 0 (free all) or
//     1 < group_size < dp_shard dividing dp_shard (keep a slice);
//   - ALLOC_GRAD only on a unit with trainable parameters and no allocated
//     unsharded gradient; REDUCE_SCATTER only with an allocated one;
//   - FORWARD/BACKWARD: exactly the next computation of the step in order
//     (per micro-batch: the forward passes, each EMBED, then LAYER and, for
//     layers with experts, EXPERTS of every layer, then HEAD; then the
//     grad passes in reverse, each HEAD, then every layer in reverse
//     [EXPERTS,] LAYER, then EMBED), FORWARD's requires_grad equal to
//     pass >= no_grad_passes, every owner of the part gathered and waited,
//     and for BACKWARD the gradient of every trainable owner allocated;
//   - OPTIMIZER_STEP once, last, after every computation, with every unit
//     resharded and every unsharded gradient reduce-scattered.
// Errors: FAILED_PRECONDITION when program.plan_fingerprint is not
// plan.fingerprint(); INVALID_ARGUMENT naming the header field, or the
// command index ("commands[12]") and the rule it breaks; INVALID_ARGUMENT
// for an inconsistent plan (as CompileStepProgram).
absl::Status ValidateStepProgram(const v1::ShardingPlan& plan,
                                 const v1::StepProgram& program);

// Validates `program` (as ValidateStepProgram, same errors) and replays it
// on one rank: UNSHARD allocates the gathered buffer (gathered_numel x
// compute dtype) when issued and counts one all-gather of that size (from a
// post-forward slice it frees the slice); RESHARD frees it or keeps a
// 1/group_size slice; ALLOC_GRAD allocates the unsharded gradient (trainable
// gathered numel x reduce dtype); REDUCE_SCATTER frees it and counts one
// reduce-scatter of its size, plus, when mesh.dp_replicate > 1, one
// all-reduce of the sharded gradient; OPTIMIZER_STEP changes nothing.
// A timeline event follows every memory-changing command and the
// OPTIMIZER_STEP. Fills every field of *memory (persistent bytes from the
// plan's units, peak, timeline when `include_timeline`) and *comm, both
// cleared first. memory and comm must not be null.
absl::Status ReplayStepProgram(const v1::ShardingPlan& plan,
                               const v1::StepProgram& program,
                               bool include_timeline, v1::MemoryReport* memory,
                               v1::CommReport* comm);

// CompileStepProgram then ReplayStepProgram, streaming the commands from
// the compiler into the replay without holding the program (a step of many
// micro-batches and passes can have millions of commands). Same errors as
// CompileStepProgram, except that there is no length limit.
absl::Status ReplayCompiledStep(const v1::ShardingPlan& plan,
                                bool include_timeline, v1::MemoryReport* memory,
                                v1::CommReport* comm);

// One line per command, e.g. "UNSHARD u3", "UNSHARD u5 prefetch",
// "WAIT_UNSHARD u5", "RESHARD u1 group 2", "FORWARD LAYER l2 p0 m1",
// "FORWARD EMBED p0 m0 no_grad", "BACKWARD EXPERTS l1 p2 m0",
// "OPTIMIZER_STEP".
std::string CommandToString(const v1::Command& command);

}  // namespace shardd

#endif  // SHARDD_PROGRAM_STEP_PROGRAM_H_
