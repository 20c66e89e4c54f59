#ifndef SHARDD_PROGRAM_UNIT_STATE_H_
#define SHARDD_PROGRAM_UNIT_STATE_H_

// The state of one FSDP unit on a rank as a step program moves it, and the
// rules of the unit commands (UNSHARD, WAIT_UNSHARD, RESHARD, ALLOC_GRAD,
// REDUCE_SCATTER): one copy for the program validator and replay
// (step_program.h) and for the workers' step executors, so a program the
// validator accepts is one the workers run, and both refuse a bad command
// with the same words.

#include <string>

#include "absl/status/status.h"
#include "proto/worker.pb.h"

namespace shardd {

struct UnitState {
  bool gathered = false;
  bool pending = false;  // A prefetched all-gather not waited for yet.
  bool grad = false;     // The unsharded gradient is allocated.
  // Not gathered: holds a 1/G slice of the unit (RESHARD with group_size G).
  int slice_group = 0;
  // Gathered from a slice of G ranks: the slice is freed once the gather is
  // waited for (at once without prefetch, else at its WAIT_UNSHARD).
  int gather_slice_group = 0;
};

// Whether unit command `c` fits unit `unit` in state `s` (`trainable`: the
// unit has trainable parameters; `dp_shard`: the shard group's size), with
// no effect. Errors: INVALID_ARGUMENT (a group_size that is not 0 or a
// divisor of dp_shard between 2 and dp_shard - 1), FAILED_PRECONDITION
// (the unit is not in the state the op needs), each naming the unit.
absl::Status CheckUnitCommand(const UnitState& s, int unit,
                              const v1::Command& c, bool trainable,
                              int dp_shard);

// Moves `s` by unit command `c` (checked by CheckUnitCommand).
void ApplyUnitCommand(const v1::Command& c, UnitState* s);

// Why OPTIMIZER_STEP cannot run while unit `unit` (described as `name`) is
// in state `s`: FAILED_PRECONDITION when it is still gathered (or holds a
// post-forward slice) or still holds an unsharded gradient.
absl::Status CheckUnitDoneForOptimizer(const UnitState& s,
                                       const std::string& name);

}  // namespace shardd

#endif  // SHARDD_PROGRAM_UNIT_STATE_H_
