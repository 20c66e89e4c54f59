#ifndef SHARDD_PROGRAM_STEP_PROGRAM_H_
#define SHARDD_PROGRAM_STEP_PROGRAM_H_

// Step programs: the schedule of one training step as a list of commands
// (v1::StepProgram, proto/worker.proto). The coordinator compiles a laid-out
// plan into one program that every rank runs on its own shards; a worker
// validates it on receipt; the planner's memory and communication model
// (program/step_model.h) is a replay of the same commands, so the peak a
// worker measures is the predicted one by construction.
//
// The parts and the units that own them, and the compiled schedule command
// by command: docs/design.md ("Step programs").

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "program/command_text.h"  // CommandToString
#include "program/step_bounds.h"   // kMaxMicrobatches and the other bounds.
#include "proto/plan.pb.h"
#include "proto/worker.pb.h"

namespace shardd {

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

// The forward-only program of the same plan and step shape (eval = true):
// per micro-batch every pass's forward without a graph, gathering and
// resharding as the training step does (a unit resharded after forward to a
// smaller group is freed instead: nothing re-gathers it), then every unit
// still gathered resharded; no gradient, no optimizer step. Its replay's
// peak is at most the training step's. Same errors as CompileStepProgram.
absl::StatusOr<v1::StepProgram> CompileEvalProgram(
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
//     grad passes in the pass layout's backward order (pass_layout.h; the
//     last first), each HEAD, then every layer in reverse [EXPERTS,] LAYER,
//     then EMBED), FORWARD's requires_grad as the pass layout says (pass >=
//     no_grad_passes, or DiffusionGemma's 3-pass step: only pass 1 builds no
//     graph), every owner of the part gathered and waited,
//     and for BACKWARD the gradient of every trainable owner allocated;
//   - OPTIMIZER_STEP once, last, after every computation, with every unit
//     resharded and every unsharded gradient reduce-scattered;
//   - an eval program (program.eval): the forwards only, none with
//     requires_grad, no ALLOC_GRAD, BACKWARD, REDUCE_SCATTER or
//     OPTIMIZER_STEP, and every unit resharded (no slice kept) at the end.
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

// The activations one rank holds through a program's computations, from
// plan.activations() (planner/activation_model.h): for every FORWARD and
// BACKWARD in program order, the most bytes live during it and the bytes
// live after it (what MoeModel::command_activation_peak and
// activation_bytes measure). Empty when the plan has no activation model.
// Errors: ValidateStepProgram's.
struct ActivationPoint {
  int64_t during = 0;
  int64_t after = 0;
  bool operator==(const ActivationPoint& o) const {
    return during == o.during && after == o.after;
  }
};
absl::StatusOr<std::vector<ActivationPoint>> ReplayActivations(
    const v1::ShardingPlan& plan, const v1::StepProgram& program);

// CompileStepProgram then ReplayStepProgram, streaming the commands from
// the compiler into the replay without holding the program (a step of many
// micro-batches and passes can have millions of commands). Same errors as
// CompileStepProgram, except that there is no length limit.
absl::Status ReplayCompiledStep(const v1::ShardingPlan& plan,
                                bool include_timeline, v1::MemoryReport* memory,
                                v1::CommReport* comm);

}  // namespace shardd

#endif  // SHARDD_PROGRAM_STEP_PROGRAM_H_
