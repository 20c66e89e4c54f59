#ifndef SHARDD_WORKER_EXEC_STEP_STATE_H_
#define SHARDD_WORKER_EXEC_STEP_STATE_H_

// The backend-free side of running step programs on one rank (the
// StepExecutor's): the state of every unit (program/unit_state.h, whose
// rules the program validator applies too), the step's progress (commands
// run, passes counted, OPTIMIZER_STEP), the checks that reject a command
// that does not fit before it has any effect, the checks the model's
// parameter reads and gradient writes pass, and the executor's failed state.
// The executor asks Check() before a command, Accept()s it, and then the
// backend performs its effect. Not thread-safe: the executor holds its
// mutex around every call.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "program/unit_state.h"
#include "proto/plan.pb.h"
#include "proto/worker.pb.h"

namespace shardd {

class StepState {
 public:
  // `plan` must outlive the state.
  explicit StepState(const v1::ShardingPlan* plan);

  // Before a step starts: the executor's failure, a step still open, then
  // CheckProgramHeader (step_checks.h).
  absl::Status CheckHeader(const v1::StepProgram& program) const;
  // ValidateStepProgram once per distinct program (programs of later steps
  // differ only in `step`); its errors.
  absl::Status ValidateOnce(const v1::StepProgram& program);
  // Opens a step of `header` (its commands are not kept): resets every
  // unit's per-step state and the counters.
  void Begin(const v1::StepProgram& header);
  // Closes the step (after EndStep or an abort).
  void End();
  // At EndStep: FAILED_PRECONDITION when no step is open.
  absl::Status CheckEndStep() const;
  // The error of an EndStep before OPTIMIZER_STEP (FAILED_PRECONDITION).
  absl::Status EndedEarly() const;
  // Whether the open step runs an eval program (header.eval).
  bool eval() const { return header_.eval(); }
  // At the EndStep of an eval program: FAILED_PRECONDITION unless every
  // forward ran and every unit is resharded.
  absl::Status CheckEvalDone() const;
  // The units' per-step state cleared (an abort frees every buffer).
  void ClearUnits();

  // Whether command `c` fits the current state, without any effect:
  // FAILED_PRECONDITION (unit not in the state the op needs, a gradient op,
  // BACKWARD or OPTIMIZER_STEP in an eval step, OPTIMIZER_STEP
  // before every unit is resharded and reduced and every computation ran,
  // anything after OPTIMIZER_STEP, a slice size without a group),
  // NOT_FOUND (unit out of range), INVALID_ARGUMENT (unknown op, bad
  // group_size). `has_slice_group(g)`: this worker holds a slice group of g.
  template <typename HasSliceGroup>
  absl::Status Check(const v1::Command& c,
                     const HasSliceGroup& has_slice_group) const {
    const absl::Status status = CheckRules(c);
    if (!status.ok()) return status;
    if (c.op() == v1::Command::RESHARD && c.group_size() != 0 &&
        !has_slice_group(c.group_size())) {
      return NoSliceGroup(c.group_size());
    }
    return absl::OkStatus();
  }
  // Applies a checked command to the state: it counts as run (`touched`),
  // the unit's flags move, and forward/backward passes are counted. For
  // UNSHARD the unit remembers whether it gathers from a slice.
  void Accept(const v1::Command& c);
  // Whether the gather of `unit` read a slice that is still to be freed;
  // clears the mark.
  bool TakeGatherFromSlice(int unit);

  // The checks the model's reads and writes pass, naming the parameter:
  // NOT_FOUND (not in the plan), FAILED_PRECONDITION (unit not gathered and
  // waited; no allocated unsharded gradient).
  absl::Status CheckParamReadable(const std::string& name) const;
  absl::Status CheckGradWritable(const std::string& name) const;

  // "step S commands[i] (OP ...)" of the command about to run.
  std::string Label(const v1::Command& c) const;

  // Marks the executor failed unless `clean`; logs the error once.
  void Fail(const absl::Status& error, bool clean, int shard_rank,
            int replica_rank);
  const absl::Status& failed() const { return failed_; }
  // FAILED_PRECONDITION while a step is open.
  absl::Status CheckBetweenSteps(const std::string& what) const;

  bool in_step() const { return in_step_; }
  bool stepped() const { return stepped_; }
  void set_stepped() { stepped_ = true; }
  bool touched() const { return touched_; }
  int commands() const { return command_index_; }
  int64_t step() const { return header_.step(); }
  const v1::StepProgram& header() const { return header_; }
  absl::Time step_start() const { return step_start_; }
  int num_units() const { return static_cast<int>(units_.size()); }
  const UnitState& unit(int u) const { return units_[u]; }

 private:
  absl::StatusOr<int> UnitOf(const std::string& name) const;
  // Every rule of Check but the slice group's.
  absl::Status CheckRules(const v1::Command& c) const;
  static absl::Status NoSliceGroup(int g);

  const v1::ShardingPlan* const plan_;
  // Parameter name -> unit index.
  absl::flat_hash_map<std::string, int> param_unit_;
  // program/unit_state.h: the rules the validator applies too.
  std::vector<UnitState> units_;
  std::vector<bool> trainable_;
  // Serialized programs (step cleared) that passed ValidateStepProgram.
  absl::flat_hash_set<std::string> validated_;
  absl::Status failed_;

  bool in_step_ = false;
  bool stepped_ = false;  // OPTIMIZER_STEP ran.
  bool touched_ = false;  // A command had an effect.
  v1::StepProgram header_;
  int command_index_ = 0;
  int head_forwards_ = 0;
  int embed_backwards_ = 0;
  absl::Time step_start_;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_EXEC_STEP_STATE_H_
