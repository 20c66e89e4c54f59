#include "program/step_program.h"

// Structure: AnalyzePlan (plan_info.h) turns the plan into per-unit facts
// and the part owners; a Runner (step_replay.h) is one rank executing
// commands, validating and replaying them; the Compiler here decides the
// schedule and emits each command through a Runner.

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
#include "program/activation_ledger.h"
#include "program/pass_layout.h"
#include "program/plan_info.h"
#include "program/step_replay.h"
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

using program_internal::Computation;
using program_internal::Context;
using program_internal::ReplayOutput;
using program_internal::Runner;

// ---- The compiler -----------------------------------------------------------

class Compiler {
 public:
  // Every command goes through `runner`; with `out` it is also appended.
  Compiler(const PlanInfo& info, const v1::StepShape& step,
           const PassLayout& passes, Runner* runner, StepProgram* out)
      : info_(info), step_(step), passes_(passes), runner_(runner), out_(out) {}

  absl::Status Run() {
    const int microbatches = step_.microbatches();
    if (passes_.eval()) return RunEval();
    for (int m = 0; m < microbatches; ++m) {
      microbatch_ = m;
      sync_ = !step_.defer_grad_sync() || m == microbatches - 1;
      for (int p = 0; p < step_.passes(); ++p) {
        SHARDD_RETURN_IF_ERROR(ForwardPass(p));
      }
      for (int p : passes_.backward_order()) {
        SHARDD_RETURN_IF_ERROR(BackwardPass(p));
      }
      for (auto r = info_.roots.rbegin(); r != info_.roots.rend(); ++r) {
        SHARDD_RETURN_IF_ERROR(PostBackward(*r));
      }
    }
    Command step;
    step.set_op(Command::OPTIMIZER_STEP);
    SHARDD_RETURN_IF_ERROR(Emit(step));
    return Finish();
  }

 private:
  // Forward only: each micro-batch's passes, then every unit resharded (no
  // slice kept: no backward will re-gather it).
  absl::Status RunEval() {
    for (int m = 0; m < step_.microbatches(); ++m) {
      microbatch_ = m;
      for (int p = 0; p < step_.passes(); ++p) {
        SHARDD_RETURN_IF_ERROR(ForwardPass(p));
      }
      for (int u = 0; u < static_cast<int>(info_.units.size()); ++u) {
        SHARDD_RETURN_IF_ERROR(WaitIfPending(u));
        if (runner_->state(u).gathered) {
          SHARDD_RETURN_IF_ERROR(UnitCommand(Command::RESHARD, u));
        }
      }
    }
    return Finish();
  }

  absl::Status Finish() {
    const absl::Status finished = runner_->Finish();
    if (!finished.ok()) {
      return absl::InternalError(
          absl::StrCat("step program compiler produced an invalid program: ",
                       finished.message()));
    }
    return absl::OkStatus();
  }

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
      if (layer.exchanged) {
        // Expert parallelism: the experts' gather runs under the dispatch
        // of their rows; they are resharded before the outputs come back.
        SHARDD_RETURN_IF_ERROR(Prefetch(layer.experts));
        SHARDD_RETURN_IF_ERROR(
            Compute(Command::FORWARD, Command::DISPATCH, layer.layer, p, {}));
        for (int u : layer.experts) {
          SHARDD_RETURN_IF_ERROR(Prefetch(info_.units[u].forward_prefetch));
        }
        SHARDD_RETURN_IF_ERROR(Compute(Command::FORWARD, Command::EXPERTS,
                                       layer.layer, p, layer.experts));
        for (int u : layer.experts) {
          SHARDD_RETURN_IF_ERROR(PolicyReshard(u));
        }
        SHARDD_RETURN_IF_ERROR(
            Compute(Command::FORWARD, Command::COMBINE, layer.layer, p, {}));
      } else if (layer.has_experts) {
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
      if (layer.exchanged) {
        // The experts' gather runs under the output gradients' exchange
        // (unless BACKWARD COMBINE recomputes them), their reduce-scatter
        // under the input gradients' return.
        if (layer.recomputes_experts) {
          for (auto u = layer.experts.rbegin(); u != layer.experts.rend();
               ++u) {
            SHARDD_RETURN_IF_ERROR(Gather(*u));
          }
          for (int u : layer.experts) SHARDD_RETURN_IF_ERROR(AllocGrad(u));
        } else {
          std::vector<int> reversed(layer.experts.rbegin(),
                                    layer.experts.rend());
          SHARDD_RETURN_IF_ERROR(Prefetch(reversed));
        }
        SHARDD_RETURN_IF_ERROR(Compute(
            Command::BACKWARD, Command::COMBINE, layer.layer, p,
            layer.recomputes_experts ? layer.experts : std::vector<int>()));
        for (auto u = layer.experts.rbegin(); u != layer.experts.rend(); ++u) {
          SHARDD_RETURN_IF_ERROR(Prefetch(info_.units[*u].backward_prefetch));
        }
        for (int u : layer.experts) SHARDD_RETURN_IF_ERROR(AllocGrad(u));
        SHARDD_RETURN_IF_ERROR(Compute(Command::BACKWARD, Command::EXPERTS,
                                       layer.layer, p, layer.experts));
        for (int u : layer.experts) SHARDD_RETURN_IF_ERROR(PostBackward(u));
        SHARDD_RETURN_IF_ERROR(
            Compute(Command::BACKWARD, Command::DISPATCH, layer.layer, p, {}));
      } else if (layer.has_experts && !layer.experts.empty()) {
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
      c.set_requires_grad(passes_.requires_grad(p));
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
    if (m.policy == ForwardPolicy::kPartial && !passes_.eval()) {
      c.set_group_size(m.group_size);
    }
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
  const PassLayout& passes_;
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

PassLayout ProgramPasses(const ShardingPlan& plan, const StepProgram& program) {
  return program.eval()
             ? PassLayout::ForEval(plan.architecture(), program.passes(),
                                   program.no_grad_passes())
             : PassLayout::For(plan.architecture(), program.passes(),
                               program.no_grad_passes());
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
                               memory->peak_step_bytes());
}

absl::Status CheckOutputs(v1::MemoryReport* memory, v1::CommReport* comm) {
  if (memory == nullptr || comm == nullptr) {
    return absl::InvalidArgumentError("memory and comm: must not be null");
  }
  memory->Clear();
  comm->Clear();
  return absl::OkStatus();
}

absl::StatusOr<StepProgram> Compile(const ShardingPlan& plan, bool eval) {
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
  program.set_eval(eval);
  const PassLayout passes = ProgramPasses(plan, program);
  Runner runner(info, step.microbatches(), passes, /*replay=*/nullptr);
  Compiler compiler(info, step, passes, &runner, &program);
  SHARDD_RETURN_IF_ERROR(compiler.Run());
  return program;
}

}  // namespace

absl::StatusOr<StepProgram> CompileStepProgram(const ShardingPlan& plan) {
  return Compile(plan, /*eval=*/false);
}

absl::StatusOr<StepProgram> CompileEvalProgram(const ShardingPlan& plan) {
  return Compile(plan, /*eval=*/true);
}

absl::Status ValidateStepProgram(const ShardingPlan& plan,
                                 const StepProgram& program) {
  SHARDD_RETURN_IF_ERROR(CheckHeader(plan, program));
  PlanInfo info;
  SHARDD_RETURN_IF_ERROR(AnalyzePlan(plan, &info));
  Runner runner(info, program.microbatches(), ProgramPasses(plan, program),
                /*replay=*/nullptr);
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
  Runner runner(info, program.microbatches(), ProgramPasses(plan, program),
                &output);
  SHARDD_RETURN_IF_ERROR(RunProgram(program, &runner));
  FinishReport(runner, memory);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<ActivationPoint>> ReplayActivations(
    const ShardingPlan& plan, const StepProgram& program) {
  SHARDD_RETURN_IF_ERROR(ValidateStepProgram(plan, program));
  std::vector<ActivationPoint> points;
  if (!plan.has_activations()) return points;
  program_internal::ActivationLedger ledger(&plan.activations(),
                                            ProgramPasses(plan, program));
  for (const Command& c : program.commands()) {
    if (c.op() != Command::FORWARD && c.op() != Command::BACKWARD) continue;
    ActivationPoint point;
    point.during = ledger.Apply(c.op(), c.part(), c.layer(), c.pass());
    point.after = ledger.live();
    points.push_back(point);
  }
  return points;
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
  const PassLayout passes = PassLayout::For(plan.architecture(), step.passes(),
                                            step.no_grad_passes());
  Runner runner(info, step.microbatches(), passes, &output);
  Compiler compiler(info, step, passes, &runner, /*out=*/nullptr);
  SHARDD_RETURN_IF_ERROR(compiler.Run());
  FinishReport(runner, memory);
  return absl::OkStatus();
}

}  // namespace shardd
