#ifndef SHARDD_PROGRAM_STEP_REPLAY_H_
#define SHARDD_PROGRAM_STEP_REPLAY_H_

// One rank executing a step program's commands (internal to program/): a
// Runner holds every unit's state and the expected order of computations,
// validates each command, and, given a ReplayOutput, keeps the memory and
// communication accounts and the timeline. The compiler (step_program.cc)
// emits every command through one, so a compiled program is checked as it
// is built and a replay sees exactly what the compiler saw.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "program/activation_ledger.h"
#include "program/pass_layout.h"
#include "program/plan_info.h"
#include "program/unit_state.h"
#include "proto/plan.pb.h"
#include "proto/worker.pb.h"

namespace shardd {
namespace program_internal {

using ::shardd::v1::Command;

// One computation of the step (FORWARD/BACKWARD of a part).
struct Computation {
  Command::Op op = Command::OP_UNSPECIFIED;
  Command::Part part = Command::PART_UNSPECIFIED;
  int layer = -1;
  int pass = 0;
};

// Where the replay is, for timeline events and the peak's description.
struct Context {
  const char* phase = "forward";
  int microbatch = 0;
  int pass = 0;
};

struct ReplayOutput {
  bool include_timeline = false;
  v1::MemoryReport* memory = nullptr;
  v1::CommReport* comm = nullptr;
};

class Runner {
 public:
  // `replay` null: validate only.
  Runner(const PlanInfo& info, int microbatches, const PassLayout& passes,
         const ReplayOutput* replay);

  const UnitState& state(int unit) const { return states_[unit]; }
  int events() const { return events_; }

  absl::Status Apply(const Command& c);

  // The program has ended.
  absl::Status Finish() const;

 private:
  void Add(Command::Op op, Command::Part part, int layer, int pass);

  std::string Expected() const;

  absl::Status Fail(int index, const Command& c, absl::string_view rule) const;

  std::string UnitName(int u) const;

  // The unit rules every rank applies (unit_state.h), as this program's
  // error.
  absl::Status CheckUnit(int index, const Command& c) const;

  absl::Status Unshard(int index, const Command& c);

  absl::Status Wait(int index, const Command& c);

  absl::Status Reshard(int index, const Command& c);

  absl::Status AllocGrad(int index, const Command& c);

  absl::Status ReduceScatter(int index, const Command& c);

  // The units a computation reads (gathered and waited; with BACKWARD,
  // their gradients allocated).
  const std::vector<int>& Owners(Command::Op op, Command::Part part,
                                 int layer) const;

  absl::Status Run(int index, const Command& c);

  absl::Status OptimizerStep(int index, const Command& c);

  // A command that prepares the next computation (gather, gradient).
  Context Prepare() const;

  // A command that cleans up after the last computation.
  Context Cleanup() const { return has_last_ ? last_ : Prepare(); }

  void Emit(int command, const char* op, int unit, const Context& context);

  // Records a new peak without a timeline event of its own (a transient
  // inside one command); `event` is the timeline event the peak belongs to,
  // by default the command's own, emitted next.
  void ObservePeak(int command, const char* op, int unit,
                   const Context& context, int event = -1);

  // "backward, micro-batch 0, pass 1, unit U, WHEN OP (command N)".
  std::string PeakWhere(int command, const char* op, int unit,
                        const Context& context, const char* when) const;

  // The step's peak (unsharded bytes plus `activations` live now).
  void ObserveStepPeak(int command, const char* op, int unit,
                       const Context& context, int64_t activations);

  const PlanInfo& info_;
  const int microbatches_;
  const PassLayout passes_;
  std::vector<Computation> schedule_;  // One micro-batch.
  std::vector<UnitState> states_;
  const ReplayOutput* replay_;

  int count_ = 0;
  int microbatch_ = 0;  // Cursor into the computations.
  int position_ = 0;
  bool done_ = false;
  Context last_;
  bool has_last_ = false;
  int64_t live_params_ = 0;
  int64_t live_grads_ = 0;
  ActivationLedger activations_;
  int events_ = 0;
};

}  // namespace program_internal
}  // namespace shardd

#endif  // SHARDD_PROGRAM_STEP_REPLAY_H_
