#include "program/step_replay.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status_macros.h"
#include "program/command_text.h"
#include "program/step_bounds.h"

namespace shardd {
namespace program_internal {

Runner::Runner(const PlanInfo& info, int microbatches, const PassLayout& passes,
               const ReplayOutput* replay)
    : info_(info),
      microbatches_(microbatches),
      passes_(passes),
      states_(info.units.size()),
      replay_(replay),
      activations_(info.activations, passes) {
  // The computations of one micro-batch, in order.
  for (int p = 0; p < passes.passes(); ++p) {
    Add(Command::FORWARD, Command::EMBED, -1, p);
    for (const LayerInfo& layer : info.layers) {
      Add(Command::FORWARD, Command::LAYER, layer.layer, p);
      if (layer.has_experts) {
        if (layer.exchanged) {
          Add(Command::FORWARD, Command::DISPATCH, layer.layer, p);
        }
        Add(Command::FORWARD, Command::EXPERTS, layer.layer, p);
        if (layer.exchanged) {
          Add(Command::FORWARD, Command::COMBINE, layer.layer, p);
        }
      }
    }
    Add(Command::FORWARD, Command::HEAD, -1, p);
  }
  for (int p : passes.backward_order()) {
    Add(Command::BACKWARD, Command::HEAD, -1, p);
    for (auto it = info.layers.rbegin(); it != info.layers.rend(); ++it) {
      if (it->has_experts) {
        if (it->exchanged) {
          Add(Command::BACKWARD, Command::COMBINE, it->layer, p);
        }
        Add(Command::BACKWARD, Command::EXPERTS, it->layer, p);
        if (it->exchanged) {
          Add(Command::BACKWARD, Command::DISPATCH, it->layer, p);
        }
      }
      Add(Command::BACKWARD, Command::LAYER, it->layer, p);
    }
    Add(Command::BACKWARD, Command::EMBED, -1, p);
  }
}

absl::Status Runner::Apply(const Command& c) {
  const int index = count_++;
  if (done_) {
    return Fail(index, c, "nothing may follow OPTIMIZER_STEP");
  }
  if (passes_.eval() &&
      (c.op() == Command::ALLOC_GRAD || c.op() == Command::REDUCE_SCATTER ||
       c.op() == Command::BACKWARD || c.op() == Command::OPTIMIZER_STEP)) {
    return Fail(index, c,
                "an eval program computes no gradients and takes no "
                "optimizer step");
  }
  switch (c.op()) {
    case Command::UNSHARD:
    case Command::RESHARD:
    case Command::WAIT_UNSHARD:
    case Command::ALLOC_GRAD:
    case Command::REDUCE_SCATTER:
      if (c.unit() < 0 || c.unit() >= static_cast<int>(states_.size())) {
        return Fail(
            index, c,
            absl::StrCat("unit index out of range [0, ", states_.size(), ")"));
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

absl::Status Runner::Finish() const {
  if (done_) return absl::OkStatus();
  if (passes_.eval() && microbatch_ >= microbatches_) {
    // Nothing of the evaluation may stay gathered into the next step.
    for (size_t u = 0; u < states_.size(); ++u) {
      const UnitState& s = states_[u];
      if (s.gathered || s.pending || s.slice_group != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "commands[", count_, "]: the eval program ends with ",
            UnitName(static_cast<int>(u)),
            " still gathered (RESHARD every unit, with group_size 0, "
            "before the end)"));
      }
    }
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("commands[", count_,
                   "]: the program ends early: the next step of "
                   "the schedule is ",
                   Expected()));
}

void Runner::Add(Command::Op op, Command::Part part, int layer, int pass) {
  Computation c;
  c.op = op;
  c.part = part;
  c.layer = layer;
  c.pass = pass;
  schedule_.push_back(c);
}

std::string Runner::Expected() const {
  if (microbatch_ >= microbatches_) {
    return passes_.eval() ? "the end of the program" : "OPTIMIZER_STEP";
  }
  const Computation& next = schedule_[position_];
  Command c;
  c.set_op(next.op);
  c.set_part(next.part);
  c.set_layer(next.layer);
  c.set_pass(next.pass);
  c.set_microbatch(microbatch_);
  c.set_requires_grad(passes_.requires_grad(next.pass));
  return CommandToString(c);
}

absl::Status Runner::Fail(int index, const Command& c,
                          absl::string_view rule) const {
  return absl::InvalidArgumentError(
      absl::StrCat("commands[", index, "] (", CommandToString(c), "): ", rule));
}

std::string Runner::UnitName(int u) const {
  return absl::StrCat("unit ", u, " (", info_.units[u].name, ")");
}

absl::Status Runner::CheckUnit(int index, const Command& c) const {
  const absl::Status fits =
      CheckUnitCommand(states_[c.unit()], c.unit(), c,
                       info_.units[c.unit()].trainable(), info_.dp_shard);
  return fits.ok() ? fits : Fail(index, c, fits.message());
}

absl::Status Runner::Unshard(int index, const Command& c) {
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

absl::Status Runner::Wait(int index, const Command& c) {
  SHARDD_RETURN_IF_ERROR(CheckUnit(index, c));
  UnitState& s = states_[c.unit()];
  ApplyUnitCommand(c, &s);
  if (s.gather_slice_group != 0 && replay_ != nullptr) {
    live_params_ -= info_.units[c.unit()].gathered_bytes / s.gather_slice_group;
  }
  s.gather_slice_group = 0;
  return absl::OkStatus();
}

absl::Status Runner::Reshard(int index, const Command& c) {
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

absl::Status Runner::AllocGrad(int index, const Command& c) {
  SHARDD_RETURN_IF_ERROR(CheckUnit(index, c));
  const UnitInfo& m = info_.units[c.unit()];
  ApplyUnitCommand(c, &states_[c.unit()]);
  live_grads_ += m.grad_bytes;
  Emit(index, "grad", c.unit(), Prepare());
  return absl::OkStatus();
}

absl::Status Runner::ReduceScatter(int index, const Command& c) {
  SHARDD_RETURN_IF_ERROR(CheckUnit(index, c));
  const UnitInfo& m = info_.units[c.unit()];
  ApplyUnitCommand(c, &states_[c.unit()]);
  live_grads_ -= m.grad_bytes;
  if (replay_ != nullptr) {
    v1::CommReport* comm = replay_->comm;
    comm->set_reduce_scatters(comm->reduce_scatters() + 1);
    comm->set_reduce_scatter_bytes(comm->reduce_scatter_bytes() + m.grad_bytes);
    if (info_.hsdp) {
      comm->set_all_reduces(comm->all_reduces() + 1);
      comm->set_all_reduce_bytes(comm->all_reduce_bytes() + m.shard_grad_bytes);
    }
  }
  Emit(index, "reduce_scatter", c.unit(), Cleanup());
  return absl::OkStatus();
}

const std::vector<int>& Runner::Owners(Command::Op op, Command::Part part,
                                       int layer) const {
  static const std::vector<int>* none = new std::vector<int>();
  if (part == Command::EMBED || part == Command::HEAD) {
    return info_.root_owners;
  }
  const LayerInfo& l = info_.layers[info_.layer_pos.at(layer)];
  switch (part) {
    case Command::LAYER:
      return l.layer_owners;
    case Command::DISPATCH:
      // Moves rows only: the experts' gather can run under it.
      return *none;
    case Command::COMBINE:
      // BACKWARD COMBINE runs the experts' forward again when they are
      // recomputed, so it needs them then; otherwise it moves rows only.
      return op == Command::BACKWARD && l.recomputes_experts
                 ? l.experts_owners()
                 : *none;
    default:
      return l.experts_owners();
  }
}

absl::Status Runner::Run(int index, const Command& c) {
  if (microbatch_ >= microbatches_) {
    return Fail(index, c,
                passes_.eval()
                    ? "out of order: every computation of the eval program "
                      "has run"
                    : "out of order: every computation of the step has run; "
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
      c.requires_grad() != passes_.requires_grad(c.pass())) {
    return Fail(index, c,
                absl::StrCat("requires_grad must be ",
                             passes_.requires_grad(c.pass()) ? "true" : "false",
                             " in pass ", c.pass(),
                             passes_.eval() ? " (an eval program builds no "
                                              "graph)"
                             : passes_.block_diffusion()
                                 ? " (block diffusion: encode, "
                                   "self-conditioning decode without "
                                   "gradients, decode)"
                                 : " (the first no_grad_passes passes build "
                                   "no graph)"));
  }
  for (int u : Owners(c.op(), c.part(), c.layer())) {
    const UnitState& s = states_[u];
    if (!s.gathered) {
      return Fail(
          index, c,
          absl::StrCat("needs ", UnitName(u), " gathered (UNSHARD it first)"));
    }
    if (s.pending) {
      return Fail(index, c,
                  absl::StrCat("needs ", UnitName(u),
                               " waited (its prefetched all-gather is "
                               "pending: WAIT_UNSHARD first)"));
    }
    if (c.op() == Command::BACKWARD && info_.units[u].trainable() && !s.grad) {
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
  if (replay_ != nullptr) {
    const int64_t during =
        activations_.Apply(c.op(), c.part(), c.layer(), c.pass());
    ObserveStepPeak(index, Command::Op_Name(c.op()).c_str(), -1, last_, during);
    v1::MemoryReport* memory = replay_->memory;
    memory->set_peak_activation_bytes(
        std::max(memory->peak_activation_bytes(), during));
    const ActivationLedger::Exchanges exchanges =
        activations_.AllToAll(c.op(), c.part(), c.layer(), c.pass());
    if (exchanges.count > 0) {
      // fp32 rows, as the workers exchange them.
      v1::CommReport* comm = replay_->comm;
      comm->set_all_to_alls(comm->all_to_alls() + exchanges.count);
      comm->set_all_to_all_bytes(comm->all_to_all_bytes() +
                                 exchanges.rows * exchanges.floats * 4);
    }
  }
  if (++position_ == static_cast<int>(schedule_.size())) {
    position_ = 0;
    ++microbatch_;
  }
  return absl::OkStatus();
}

absl::Status Runner::OptimizerStep(int index, const Command& c) {
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

Context Runner::Prepare() const {
  Context context;
  if (microbatch_ >= microbatches_) {
    context.phase = passes_.eval() ? "forward" : "optimizer";
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

void Runner::Emit(int command, const char* op, int unit,
                  const Context& context) {
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
    event->set_live_activation_bytes(activations_.live());
    event->set_command(command);
  }
}

std::string Runner::PeakWhere(int command, const char* op, int unit,
                              const Context& context, const char* when) const {
  std::string where =
      absl::StrCat(context.phase, ", micro-batch ", context.microbatch);
  if (context.pass >= 0) absl::StrAppend(&where, ", pass ", context.pass);
  if (unit >= 0) absl::StrAppend(&where, ", unit ", info_.units[unit].name);
  absl::StrAppend(&where, ", ", when, " ", op, " (command ", command, ")");
  return where;
}

void Runner::ObservePeak(int command, const char* op, int unit,
                         const Context& context, int event) {
  if (replay_ == nullptr) return;
  v1::MemoryReport* memory = replay_->memory;
  const int index = event >= 0 ? event : events_;
  const int64_t total = live_params_ + live_grads_;
  if (total > memory->peak_unsharded_bytes()) {
    memory->set_peak_unsharded_bytes(total);
    memory->set_peak_param_bytes(live_params_);
    memory->set_peak_grad_bytes(live_grads_);
    memory->set_peak_event(index);
    memory->set_peak_where(PeakWhere(command, op, unit, context, "after"));
  }
  ObserveStepPeak(command, op, unit, context, activations_.live());
}

void Runner::ObserveStepPeak(int command, const char* op, int unit,
                             const Context& context, int64_t activations) {
  v1::MemoryReport* memory = replay_->memory;
  const int64_t total = live_params_ + live_grads_ + activations;
  if (total > memory->peak_step_bytes()) {
    memory->set_peak_step_bytes(total);
    memory->set_peak_step_activation_bytes(activations);
    // A unit's command changed memory; a computation (no unit) holds it.
    memory->set_peak_step_where(PeakWhere(command, op, unit, context,
                                          unit >= 0 ? "after" : "during"));
  }
}

}  // namespace program_internal
}  // namespace shardd
