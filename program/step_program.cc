#include "program/step_program.h"

// Structure: AnalyzePlan turns the plan into per-unit facts (sizes, policy,
// trainability) and the part owners; a Runner is the state machine of one
// rank executing commands (unit states, the expected order of
// computations), which validates every command and, when replaying, keeps
// the memory and communication accounts; the Compiler decides the schedule
// and emits each command through a Runner, so a compiled program is checked
// as it is built and a replay of it sees exactly what the compiler saw.

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status_macros.h"
#include "program/plan_info.h"
#include "program/unit_state.h"

namespace shardd {
namespace {

using program_internal::AnalyzePlan;
using program_internal::CheckRange;
using program_internal::ForwardPolicy;
using program_internal::LayerInfo;
using program_internal::PlanInfo;
using program_internal::UnitInfo;
using program_internal::ValidateStepShape;
using v1::Command;
using v1::FsdpUnit;
using v1::ShardingPlan;
using v1::StepProgram;

// ---- The state machine of one rank ------------------------------------------

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
  Runner(const PlanInfo& info, int microbatches, int passes, int no_grad_passes,
         const ReplayOutput* replay)
      : info_(info),
        microbatches_(microbatches),
        no_grad_passes_(no_grad_passes),
        states_(info.units.size()),
        replay_(replay) {
    // The computations of one micro-batch, in order.
    for (int p = 0; p < passes; ++p) {
      Add(Command::FORWARD, Command::EMBED, -1, p);
      for (const LayerInfo& layer : info.layers) {
        Add(Command::FORWARD, Command::LAYER, layer.layer, p);
        if (layer.has_experts) {
          Add(Command::FORWARD, Command::EXPERTS, layer.layer, p);
        }
      }
      Add(Command::FORWARD, Command::HEAD, -1, p);
    }
    for (int p = passes - 1; p >= no_grad_passes; --p) {
      Add(Command::BACKWARD, Command::HEAD, -1, p);
      for (auto it = info.layers.rbegin(); it != info.layers.rend(); ++it) {
        if (it->has_experts) {
          Add(Command::BACKWARD, Command::EXPERTS, it->layer, p);
        }
        Add(Command::BACKWARD, Command::LAYER, it->layer, p);
      }
      Add(Command::BACKWARD, Command::EMBED, -1, p);
    }
  }

  const UnitState& state(int unit) const { return states_[unit]; }
  int events() const { return events_; }

  absl::Status Apply(const Command& c) {
    const int index = count_++;
    if (done_) {
      return Fail(index, c, "nothing may follow OPTIMIZER_STEP");
    }
    switch (c.op()) {
      case Command::UNSHARD:
      case Command::RESHARD:
      case Command::WAIT_UNSHARD:
      case Command::ALLOC_GRAD:
      case Command::REDUCE_SCATTER:
        if (c.unit() < 0 || c.unit() >= static_cast<int>(states_.size())) {
          return Fail(index, c,
                      absl::StrCat("unit index out of range [0, ",
                                   states_.size(), ")"));
        }
        break;
      default:
        break;
    }
    switch (c.op()) {
      case Command::UNSHARD:
        return Unshard(index, c);
      case Command::WAIT_UNSHARD:
        return Wait(index, c);
      case Command::RESHARD:
        return Reshard(index, c);
      case Command::ALLOC_GRAD:
        return AllocGrad(index, c);
      case Command::REDUCE_SCATTER:
        return ReduceScatter(index, c);
      case Command::FORWARD:
      case Command::BACKWARD:
        return Run(index, c);
      case Command::OPTIMIZER_STEP:
        return OptimizerStep(index, c);
      default:
        return Fail(index, c, "op must be set to a known command");
    }
  }

  // The program has ended.
  absl::Status Finish() const {
    if (done_) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("commands[", count_,
                     "]: the program ends early: the next step of "
                     "the schedule is ",
                     Expected()));
  }

 private:
  void Add(Command::Op op, Command::Part part, int layer, int pass) {
    Computation c;
    c.op = op;
    c.part = part;
    c.layer = layer;
    c.pass = pass;
    schedule_.push_back(c);
  }

  std::string Expected() const {
    if (microbatch_ >= microbatches_) return "OPTIMIZER_STEP";
    const Computation& next = schedule_[position_];
    Command c;
    c.set_op(next.op);
    c.set_part(next.part);
    c.set_layer(next.layer);
    c.set_pass(next.pass);
    c.set_microbatch(microbatch_);
    c.set_requires_grad(next.pass >= no_grad_passes_);
    return CommandToString(c);
  }

  absl::Status Fail(int index, const Command& c, absl::string_view rule) const {
    return absl::InvalidArgumentError(absl::StrCat(
        "commands[", index, "] (", CommandToString(c), "): ", rule));
  }

  std::string UnitName(int u) const {
    return absl::StrCat("unit ", u, " (", info_.units[u].name, ")");
  }

  // The unit rules every rank applies (unit_state.h), as this program's
  // error.
  absl::Status CheckUnit(int index, const Command& c) const {
    const absl::Status fits =
        CheckUnitCommand(states_[c.unit()], c.unit(), c,
                         info_.units[c.unit()].trainable(), info_.dp_shard);
    return fits.ok() ? fits : Fail(index, c, fits.message());
  }

  absl::Status Unshard(int index, const Command& c) {
    SHARDD_RETURN_IF_ERROR(CheckUnit(index, c));
    UnitState& s = states_[c.unit()];
    const UnitInfo& m = info_.units[c.unit()];
    if (replay_ != nullptr) {
      live_params_ += m.gathered_bytes;
      v1::CommReport* comm = replay_->comm;
      comm->set_all_gathers(comm->all_gathers() + 1);
      comm->set_all_gather_bytes(comm->all_gather_bytes() + m.gathered_bytes);
    }
    ApplyUnitCommand(c, &s);
    // A slice is the re-gather's input: the worker frees it once the gather
    // is waited for (here, or at the WAIT_UNSHARD of a prefetch), so until
    // then both count.
    Emit(index, c.prefetch() ? "prefetch" : "unshard", c.unit(), Prepare());
    if (s.gather_slice_group != 0 && !c.prefetch()) {
      if (replay_ != nullptr) {
        live_params_ -= m.gathered_bytes / s.gather_slice_group;
      }
      s.gather_slice_group = 0;
    }
    return absl::OkStatus();
  }

  absl::Status Wait(int index, const Command& c) {
    SHARDD_RETURN_IF_ERROR(CheckUnit(index, c));
    UnitState& s = states_[c.unit()];
    ApplyUnitCommand(c, &s);
    if (s.gather_slice_group != 0 && replay_ != nullptr) {
      live_params_ -=
          info_.units[c.unit()].gathered_bytes / s.gather_slice_group;
    }
    s.gather_slice_group = 0;
    return absl::OkStatus();
  }

  absl::Status Reshard(int index, const Command& c) {
    SHARDD_RETURN_IF_ERROR(CheckUnit(index, c));
    UnitState& s = states_[c.unit()];
    const int g = c.group_size();
    const UnitInfo& m = info_.units[c.unit()];
    if (replay_ != nullptr) {
      if (g != 0) {
        // The slice is copied out of the gathered buffer before that is
        // freed: both are live for a moment.
        live_params_ += m.gathered_bytes / g;
        ObservePeak(index, "reshard", c.unit(), Cleanup());
      }
      live_params_ -= m.gathered_bytes;
    }
    ApplyUnitCommand(c, &s);
    Emit(index, "reshard", c.unit(), Cleanup());
    return absl::OkStatus();
  }

  absl::Status AllocGrad(int index, const Command& c) {
    SHARDD_RETURN_IF_ERROR(CheckUnit(index, c));
    const UnitInfo& m = info_.units[c.unit()];
    ApplyUnitCommand(c, &states_[c.unit()]);
    live_grads_ += m.grad_bytes;
    Emit(index, "grad", c.unit(), Prepare());
    return absl::OkStatus();
  }

  absl::Status ReduceScatter(int index, const Command& c) {
    SHARDD_RETURN_IF_ERROR(CheckUnit(index, c));
    const UnitInfo& m = info_.units[c.unit()];
    ApplyUnitCommand(c, &states_[c.unit()]);
    live_grads_ -= m.grad_bytes;
    if (replay_ != nullptr) {
      v1::CommReport* comm = replay_->comm;
      comm->set_reduce_scatters(comm->reduce_scatters() + 1);
      comm->set_reduce_scatter_bytes(comm->reduce_scatter_bytes() +
                                     m.grad_bytes);
      if (info_.hsdp) {
        comm->set_all_reduces(comm->all_reduces() + 1);
        comm->set_all_reduce_bytes(comm->all_reduce_bytes() +
                                   m.shard_grad_bytes);
      }
    }
    Emit(index, "reduce_scatter", c.unit(), Cleanup());
    return absl::OkStatus();
  }

  const std::vector<int>& Owners(Command::Part part, int layer) const {
    if (part == Command::EMBED || part == Command::HEAD) {
      return info_.root_owners;
    }
    const LayerInfo& l = info_.layers[info_.layer_pos.at(layer)];
    return part == Command::LAYER ? l.layer_owners : l.experts_owners();
  }

  absl::Status Run(int index, const Command& c) {
    if (microbatch_ >= microbatches_) {
      return Fail(index, c,
                  "out of order: every computation of the step has run; "
                  "the next command must be OPTIMIZER_STEP");
    }
    const Computation& next = schedule_[position_];
    if (c.op() != next.op || c.part() != next.part || c.layer() != next.layer ||
        c.pass() != next.pass || c.microbatch() != microbatch_) {
      return Fail(index, c,
                  absl::StrCat("out of order: the next computation of the "
                               "step is ",
                               Expected()));
    }
    if (c.op() == Command::FORWARD &&
        c.requires_grad() != (c.pass() >= no_grad_passes_)) {
      return Fail(index, c,
                  absl::StrCat("requires_grad must be pass >= "
                               "no_grad_passes (",
                               no_grad_passes_, ")"));
    }
    for (int u : Owners(c.part(), c.layer())) {
      const UnitState& s = states_[u];
      if (!s.gathered) {
        return Fail(index, c,
                    absl::StrCat("needs ", UnitName(u),
                                 " gathered (UNSHARD it first)"));
      }
      if (s.pending) {
        return Fail(index, c,
                    absl::StrCat("needs ", UnitName(u),
                                 " waited (its prefetched all-gather is "
                                 "pending: WAIT_UNSHARD first)"));
      }
      if (c.op() == Command::BACKWARD && info_.units[u].trainable() &&
          !s.grad) {
        return Fail(index, c,
                    absl::StrCat("writes the gradient of ", UnitName(u),
                                 ", which is not allocated (ALLOC_GRAD "
                                 "before BACKWARD)"));
      }
    }
    last_.phase = c.op() == Command::FORWARD ? "forward" : "backward";
    last_.microbatch = microbatch_;
    last_.pass = c.pass();
    has_last_ = true;
    if (++position_ == static_cast<int>(schedule_.size())) {
      position_ = 0;
      ++microbatch_;
    }
    return absl::OkStatus();
  }

  absl::Status OptimizerStep(int index, const Command& c) {
    if (microbatch_ < microbatches_) {
      return Fail(index, c,
                  absl::StrCat("out of order: the next computation of the "
                               "step is ",
                               Expected()));
    }
    for (size_t u = 0; u < states_.size(); ++u) {
      const absl::Status done =
          CheckUnitDoneForOptimizer(states_[u], UnitName(u));
      if (!done.ok()) return Fail(index, c, done.message());
    }
    done_ = true;
    Context context;
    context.phase = "optimizer";
    context.microbatch = microbatches_ - 1;
    context.pass = -1;
    Emit(index, "step", -1, context);
    return absl::OkStatus();
  }

  // A command that prepares the next computation (gather, gradient).
  Context Prepare() const {
    Context context;
    if (microbatch_ >= microbatches_) {
      context.phase = "optimizer";
      context.microbatch = microbatches_ - 1;
      context.pass = -1;
      return context;
    }
    const Computation& next = schedule_[position_];
    context.phase = next.op == Command::FORWARD ? "forward" : "backward";
    context.microbatch = microbatch_;
    context.pass = next.pass;
    return context;
  }

  // A command that cleans up after the last computation.
  Context Cleanup() const { return has_last_ ? last_ : Prepare(); }

  void Emit(int command, const char* op, int unit, const Context& context) {
    if (replay_ == nullptr) return;
    const int index = events_++;
    ObservePeak(command, op, unit, context, index);
    v1::MemoryReport* memory = replay_->memory;
    const bool forward = absl::string_view(context.phase) == "forward";
    if (replay_->include_timeline && index < kMaxTimelineEvents) {
      v1::TimelineEvent* event = memory->add_timeline();
      event->set_microbatch(context.microbatch);
      event->set_pass(forward ? context.pass : -1);
      event->set_phase(context.phase);
      event->set_op(op);
      event->set_unit(unit);
      event->set_live_param_bytes(live_params_);
      event->set_live_grad_bytes(live_grads_);
      event->set_command(command);
    }
  }

  // Records a new peak without a timeline event of its own (a transient
  // inside one command); `event` is the timeline event the peak belongs to,
  // by default the command's own, emitted next.
  void ObservePeak(int command, const char* op, int unit,
                   const Context& context, int event = -1) {
    if (replay_ == nullptr) return;
    v1::MemoryReport* memory = replay_->memory;
    const int index = event >= 0 ? event : events_;
    const int64_t total = live_params_ + live_grads_;
    if (total > memory->peak_unsharded_bytes()) {
      memory->set_peak_unsharded_bytes(total);
      memory->set_peak_param_bytes(live_params_);
      memory->set_peak_grad_bytes(live_grads_);
      memory->set_peak_event(index);
      std::string where =
          absl::StrCat(context.phase, ", micro-batch ", context.microbatch);
      if (context.pass >= 0) absl::StrAppend(&where, ", pass ", context.pass);
      if (unit >= 0) absl::StrAppend(&where, ", unit ", info_.units[unit].name);
      absl::StrAppend(&where, ", after ", op, " (command ", command, ")");
      memory->set_peak_where(std::move(where));
    }
  }

  const PlanInfo& info_;
  const int microbatches_;
  const int no_grad_passes_;
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
  int events_ = 0;
};

// ---- The compiler -----------------------------------------------------------

class Compiler {
 public:
  // Every command goes through `runner`; with `out` it is also appended.
  Compiler(const PlanInfo& info, const v1::StepShape& step, Runner* runner,
           StepProgram* out)
      : info_(info), step_(step), runner_(runner), out_(out) {}

  absl::Status Run() {
    const int microbatches = step_.microbatches();
    for (int m = 0; m < microbatches; ++m) {
      microbatch_ = m;
      sync_ = !step_.defer_grad_sync() || m == microbatches - 1;
      for (int p = 0; p < step_.passes(); ++p) {
        SHARDD_RETURN_IF_ERROR(ForwardPass(p));
      }
      for (int p = step_.passes() - 1; p >= step_.no_grad_passes(); --p) {
        SHARDD_RETURN_IF_ERROR(BackwardPass(p));
      }
      for (auto r = info_.roots.rbegin(); r != info_.roots.rend(); ++r) {
        SHARDD_RETURN_IF_ERROR(PostBackward(*r));
      }
    }
    Command step;
    step.set_op(Command::OPTIMIZER_STEP);
    SHARDD_RETURN_IF_ERROR(Emit(step));
    const absl::Status finished = runner_->Finish();
    if (!finished.ok()) {
      return absl::InternalError(
          absl::StrCat("step program compiler produced an invalid program: ",
                       finished.message()));
    }
    return absl::OkStatus();
  }

 private:
  absl::Status ForwardPass(int p) {
    for (int u : info_.root_owners) {
      SHARDD_RETURN_IF_ERROR(Gather(u));
      SHARDD_RETURN_IF_ERROR(Prefetch(info_.units[u].forward_prefetch));
    }
    SHARDD_RETURN_IF_ERROR(
        Compute(Command::FORWARD, Command::EMBED, -1, p, info_.root_owners));
    for (const LayerInfo& layer : info_.layers) {
      for (int u : layer.units) {
        SHARDD_RETURN_IF_ERROR(Gather(u));
        SHARDD_RETURN_IF_ERROR(Prefetch(info_.units[u].forward_prefetch));
      }
      for (int u : layer.nested) {
        SHARDD_RETURN_IF_ERROR(Gather(u));
        SHARDD_RETURN_IF_ERROR(Prefetch(info_.units[u].forward_prefetch));
      }
      SHARDD_RETURN_IF_ERROR(Compute(Command::FORWARD, Command::LAYER,
                                     layer.layer, p, layer.layer_owners));
      if (layer.has_experts) {
        // Experts units gather lazily, right before their forward.
        for (int u : layer.experts) {
          SHARDD_RETURN_IF_ERROR(Gather(u));
          SHARDD_RETURN_IF_ERROR(Prefetch(info_.units[u].forward_prefetch));
        }
        SHARDD_RETURN_IF_ERROR(Compute(Command::FORWARD, Command::EXPERTS,
                                       layer.layer, p, layer.experts_owners()));
        for (int u : layer.experts) {
          SHARDD_RETURN_IF_ERROR(PolicyReshard(u));
        }
      }
      for (int u : layer.nested) SHARDD_RETURN_IF_ERROR(PolicyReshard(u));
      for (int u : layer.units) SHARDD_RETURN_IF_ERROR(PolicyReshard(u));
    }
    for (int u : info_.root_owners) SHARDD_RETURN_IF_ERROR(Gather(u));
    SHARDD_RETURN_IF_ERROR(
        Compute(Command::FORWARD, Command::HEAD, -1, p, info_.root_owners));
    for (int u : info_.root_nested) SHARDD_RETURN_IF_ERROR(PolicyReshard(u));
    return absl::OkStatus();
  }

  absl::Status BackwardPass(int p) {
    // The head's backward produces the first gradients: the root group's
    // buffers come first.
    for (int u : info_.root_owners) {
      SHARDD_RETURN_IF_ERROR(Gather(u));
      SHARDD_RETURN_IF_ERROR(Prefetch(info_.units[u].backward_prefetch));
      SHARDD_RETURN_IF_ERROR(AllocGrad(u));
    }
    SHARDD_RETURN_IF_ERROR(
        Compute(Command::BACKWARD, Command::HEAD, -1, p, info_.root_owners));
    for (auto it = info_.layers.rbegin(); it != info_.layers.rend(); ++it) {
      const LayerInfo& layer = *it;
      for (auto u = layer.units.rbegin(); u != layer.units.rend(); ++u) {
        SHARDD_RETURN_IF_ERROR(Gather(*u));
        SHARDD_RETURN_IF_ERROR(Prefetch(info_.units[*u].backward_prefetch));
      }
      if (layer.has_experts && !layer.experts.empty()) {
        for (auto u = layer.experts.rbegin(); u != layer.experts.rend(); ++u) {
          SHARDD_RETURN_IF_ERROR(Gather(*u));
          SHARDD_RETURN_IF_ERROR(Prefetch(info_.units[*u].backward_prefetch));
        }
        for (int u : layer.experts) SHARDD_RETURN_IF_ERROR(AllocGrad(u));
        SHARDD_RETURN_IF_ERROR(Compute(Command::BACKWARD, Command::EXPERTS,
                                       layer.layer, p, layer.experts));
        for (int u : layer.experts) SHARDD_RETURN_IF_ERROR(PostBackward(u));
      }
      for (auto u = layer.nested.rbegin(); u != layer.nested.rend(); ++u) {
        SHARDD_RETURN_IF_ERROR(Gather(*u));
        SHARDD_RETURN_IF_ERROR(Prefetch(info_.units[*u].backward_prefetch));
      }
      // Every gradient a computation writes is allocated before it; with
      // the experts inside the layer's units that is before BACKWARD
      // EXPERTS.
      for (int u : layer.nested) SHARDD_RETURN_IF_ERROR(AllocGrad(u));
      for (auto u = layer.units.rbegin(); u != layer.units.rend(); ++u) {
        SHARDD_RETURN_IF_ERROR(AllocGrad(*u));
      }
      if (layer.has_experts && layer.experts.empty()) {
        SHARDD_RETURN_IF_ERROR(Compute(Command::BACKWARD, Command::EXPERTS,
                                       layer.layer, p, layer.layer_owners));
      }
      SHARDD_RETURN_IF_ERROR(Compute(Command::BACKWARD, Command::LAYER,
                                     layer.layer, p, layer.layer_owners));
      for (auto u = layer.nested.rbegin(); u != layer.nested.rend(); ++u) {
        SHARDD_RETURN_IF_ERROR(PostBackward(*u));
      }
      for (auto u = layer.units.rbegin(); u != layer.units.rend(); ++u) {
        SHARDD_RETURN_IF_ERROR(PostBackward(*u));
      }
    }
    for (int u : info_.root_owners) SHARDD_RETURN_IF_ERROR(Gather(u));
    SHARDD_RETURN_IF_ERROR(
        Compute(Command::BACKWARD, Command::EMBED, -1, p, info_.root_owners));
    // Nested root units (islands) run post-backward once per pass, the
    // roots themselves once per micro-batch (Run()).
    for (auto u = info_.root_nested.rbegin(); u != info_.root_nested.rend();
         ++u) {
      SHARDD_RETURN_IF_ERROR(PostBackward(*u));
    }
    return absl::OkStatus();
  }

  absl::Status Emit(const Command& c) {
    if (out_ != nullptr && out_->commands_size() >= kMaxProgramCommands) {
      return absl::InvalidArgumentError(
          absl::StrCat("step: the program would exceed ", kMaxProgramCommands,
                       " commands (micro-batches x passes x units); use fewer "
                       "micro-batches or passes"));
    }
    const absl::Status applied = runner_->Apply(c);
    if (!applied.ok()) {
      return absl::InternalError(
          absl::StrCat("step program compiler produced an invalid program: ",
                       applied.message()));
    }
    if (out_ != nullptr) *out_->add_commands() = c;
    return absl::OkStatus();
  }

  absl::Status UnitCommand(Command::Op op, int unit) {
    Command c;
    c.set_op(op);
    c.set_unit(unit);
    return Emit(c);
  }

  absl::Status Gather(int u) {
    if (runner_->state(u).gathered) {
      return absl::OkStatus();
    }
    return UnitCommand(Command::UNSHARD, u);
  }

  absl::Status Prefetch(const std::vector<int>& targets) {
    for (int t : targets) {
      if (runner_->state(t).gathered) continue;
      Command c;
      c.set_op(Command::UNSHARD);
      c.set_unit(t);
      c.set_prefetch(true);
      SHARDD_RETURN_IF_ERROR(Emit(c));
    }
    return absl::OkStatus();
  }

  absl::Status WaitIfPending(int u) {
    if (!runner_->state(u).pending) return absl::OkStatus();
    return UnitCommand(Command::WAIT_UNSHARD, u);
  }

  absl::Status Compute(Command::Op op, Command::Part part, int layer, int p,
                       const std::vector<int>& owners) {
    for (int u : owners) SHARDD_RETURN_IF_ERROR(WaitIfPending(u));
    Command c;
    c.set_op(op);
    c.set_part(part);
    c.set_layer(layer);
    c.set_pass(p);
    c.set_microbatch(microbatch_);
    if (op == Command::FORWARD) {
      c.set_requires_grad(p >= step_.no_grad_passes());
    }
    return Emit(c);
  }

  // reshard_after_forward.
  absl::Status PolicyReshard(int u) {
    const UnitInfo& m = info_.units[u];
    if (!runner_->state(u).gathered || m.policy == ForwardPolicy::kKeep) {
      return absl::OkStatus();
    }
    SHARDD_RETURN_IF_ERROR(WaitIfPending(u));
    Command c;
    c.set_op(Command::RESHARD);
    c.set_unit(u);
    if (m.policy == ForwardPolicy::kPartial) c.set_group_size(m.group_size);
    return Emit(c);
  }

  absl::Status AllocGrad(int u) {
    if (!info_.units[u].trainable() || runner_->state(u).grad) {
      return absl::OkStatus();
    }
    return UnitCommand(Command::ALLOC_GRAD, u);
  }

  // FSDP2's post-backward hook; nothing on a deferred micro-batch.
  absl::Status PostBackward(int u) {
    if (!sync_) return absl::OkStatus();
    if (runner_->state(u).grad) {
      SHARDD_RETURN_IF_ERROR(UnitCommand(Command::REDUCE_SCATTER, u));
    }
    SHARDD_RETURN_IF_ERROR(WaitIfPending(u));
    if (runner_->state(u).gathered) {
      SHARDD_RETURN_IF_ERROR(UnitCommand(Command::RESHARD, u));
    }
    return absl::OkStatus();
  }

  const PlanInfo& info_;
  const v1::StepShape& step_;
  Runner* runner_;
  StepProgram* out_;
  int microbatch_ = 0;
  bool sync_ = true;
};

// ---- Shared pieces of the entry points --------------------------------------

absl::Status CheckHeader(const ShardingPlan& plan, const StepProgram& program) {
  if (program.plan_fingerprint() != plan.fingerprint()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "program.plan_fingerprint: ", program.plan_fingerprint(),
        " does not match the plan's fingerprint ", plan.fingerprint()));
  }
  SHARDD_RETURN_IF_ERROR(CheckRange(
      "program.microbatches", program.microbatches(), 1, kMaxMicrobatches));
  SHARDD_RETURN_IF_ERROR(
      CheckRange("program.passes", program.passes(), 1, kMaxPasses));
  SHARDD_RETURN_IF_ERROR(CheckRange("program.no_grad_passes",
                                    program.no_grad_passes(), 0,
                                    program.passes() - 1));
  return absl::OkStatus();
}

absl::Status RunProgram(const StepProgram& program, Runner* runner) {
  for (const Command& c : program.commands()) {
    SHARDD_RETURN_IF_ERROR(runner->Apply(c));
  }
  return runner->Finish();
}

void FillPersistent(const PlanInfo& info, v1::MemoryReport* memory) {
  for (const UnitInfo& m : info.units) {
    memory->set_sharded_param_bytes(memory->sharded_param_bytes() +
                                    m.shard_param_bytes);
    memory->set_grad_bytes(memory->grad_bytes() + m.shard_grad_bytes);
    // AdamW: exp_avg and exp_avg_sq in fp32 for every trainable element.
    memory->set_optimizer_bytes(memory->optimizer_bytes() +
                                2 * m.trainable_shard_numel * 4);
    memory->set_compute_shard_bytes(memory->compute_shard_bytes() +
                                    m.compute_shard_bytes);
  }
  memory->set_persistent_bytes(
      memory->sharded_param_bytes() + memory->grad_bytes() +
      memory->optimizer_bytes() + memory->compute_shard_bytes());
}

void FinishReport(const Runner& runner, v1::MemoryReport* memory) {
  memory->set_timeline_events(runner.events());
  memory->set_peak_total_bytes(memory->persistent_bytes() +
                               memory->peak_unsharded_bytes());
}

absl::Status CheckOutputs(v1::MemoryReport* memory, v1::CommReport* comm) {
  if (memory == nullptr || comm == nullptr) {
    return absl::InvalidArgumentError("memory and comm: must not be null");
  }
  memory->Clear();
  comm->Clear();
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<StepProgram> CompileStepProgram(const ShardingPlan& plan) {
  SHARDD_RETURN_IF_ERROR(ValidateStepShape(plan.step()));
  PlanInfo info;
  SHARDD_RETURN_IF_ERROR(AnalyzePlan(plan, &info));
  const v1::StepShape& step = plan.step();
  StepProgram program;
  program.set_plan_fingerprint(plan.fingerprint());
  program.set_microbatches(step.microbatches());
  program.set_passes(step.passes());
  program.set_no_grad_passes(step.no_grad_passes());
  program.set_defer_grad_sync(step.defer_grad_sync());
  Runner runner(info, step.microbatches(), step.passes(), step.no_grad_passes(),
                /*replay=*/nullptr);
  Compiler compiler(info, step, &runner, &program);
  SHARDD_RETURN_IF_ERROR(compiler.Run());
  return program;
}

absl::Status ValidateStepProgram(const ShardingPlan& plan,
                                 const StepProgram& program) {
  SHARDD_RETURN_IF_ERROR(CheckHeader(plan, program));
  PlanInfo info;
  SHARDD_RETURN_IF_ERROR(AnalyzePlan(plan, &info));
  Runner runner(info, program.microbatches(), program.passes(),
                program.no_grad_passes(), /*replay=*/nullptr);
  return RunProgram(program, &runner);
}

absl::Status ReplayStepProgram(const ShardingPlan& plan,
                               const StepProgram& program,
                               bool include_timeline, v1::MemoryReport* memory,
                               v1::CommReport* comm) {
  SHARDD_RETURN_IF_ERROR(CheckOutputs(memory, comm));
  SHARDD_RETURN_IF_ERROR(CheckHeader(plan, program));
  PlanInfo info;
  SHARDD_RETURN_IF_ERROR(AnalyzePlan(plan, &info));
  FillPersistent(info, memory);
  ReplayOutput output;
  output.include_timeline = include_timeline;
  output.memory = memory;
  output.comm = comm;
  Runner runner(info, program.microbatches(), program.passes(),
                program.no_grad_passes(), &output);
  SHARDD_RETURN_IF_ERROR(RunProgram(program, &runner));
  FinishReport(runner, memory);
  return absl::OkStatus();
}

absl::Status ReplayCompiledStep(const ShardingPlan& plan, bool include_timeline,
                                v1::MemoryReport* memory,
                                v1::CommReport* comm) {
  SHARDD_RETURN_IF_ERROR(CheckOutputs(memory, comm));
  SHARDD_RETURN_IF_ERROR(ValidateStepShape(plan.step()));
  PlanInfo info;
  SHARDD_RETURN_IF_ERROR(AnalyzePlan(plan, &info));
  FillPersistent(info, memory);
  ReplayOutput output;
  output.include_timeline = include_timeline;
  output.memory = memory;
  output.comm = comm;
  const v1::StepShape& step = plan.step();
  Runner runner(info, step.microbatches(), step.passes(), step.no_grad_passes(),
                &output);
  Compiler compiler(info, step, &runner, /*out=*/nullptr);
  SHARDD_RETURN_IF_ERROR(compiler.Run());
  FinishReport(runner, memory);
  return absl::OkStatus();
}

std::string CommandToString(const Command& command) {
  const std::string op_name = Command::Op_IsValid(command.op())
                                  ? Command::Op_Name(command.op())
                                  : absl::StrCat("OP(", command.op(), ")");
  switch (command.op()) {
    case Command::UNSHARD:
      return absl::StrCat(op_name, " u", command.unit(),
                          command.prefetch() ? " prefetch" : "");
    case Command::RESHARD:
      return command.group_size() != 0
                 ? absl::StrCat(op_name, " u", command.unit(), " group ",
                                command.group_size())
                 : absl::StrCat(op_name, " u", command.unit());
    case Command::WAIT_UNSHARD:
    case Command::ALLOC_GRAD:
    case Command::REDUCE_SCATTER:
      return absl::StrCat(op_name, " u", command.unit());
    case Command::FORWARD:
    case Command::BACKWARD: {
      const std::string part = Command::Part_IsValid(command.part())
                                   ? Command::Part_Name(command.part())
                                   : absl::StrCat("PART(", command.part(), ")");
      std::string out = absl::StrCat(op_name, " ", part);
      if (command.part() == Command::LAYER ||
          command.part() == Command::EXPERTS || command.layer() != -1) {
        absl::StrAppend(&out, " l", command.layer());
      }
      absl::StrAppend(&out, " p", command.pass(), " m", command.microbatch());
      if (command.op() == Command::FORWARD && !command.requires_grad()) {
        absl::StrAppend(&out, " no_grad");
      }
      return out;
    }
    default:
      return op_name;
  }
}

}  // namespace shardd
