#include "worker/exec/step_checks.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/error_info.h"
#include "model/model_util.h"
#include "program/step_program.h"

namespace shardd {
namespace {

int OrOne(int value) { return value < 1 ? 1 : value; }

}  // namespace

absl::Status CheckProgramHeader(const v1::StepProgram& program,
                                uint64_t plan_fingerprint) {
  if (program.plan_fingerprint() != plan_fingerprint) {
    return WithErrorReason(
        absl::FailedPreconditionError(absl::StrCat(
            "stale plan: program.plan_fingerprint ", program.plan_fingerprint(),
            " is not the fingerprint of the plan this worker holds (",
            plan_fingerprint, "); reload the plan")),
        kReasonPlanNotHeld);
  }
  if (program.microbatches() < 1 || program.microbatches() > kMaxMicrobatches) {
    return absl::InvalidArgumentError(
        absl::StrCat("program.microbatches: must be between 1 and ",
                     kMaxMicrobatches, ", got ", program.microbatches()));
  }
  if (program.passes() < 1 || program.passes() > kMaxPasses) {
    return absl::InvalidArgumentError(
        absl::StrCat("program.passes: must be between 1 and ", kMaxPasses,
                     ", got ", program.passes()));
  }
  if (program.no_grad_passes() < 0 ||
      program.no_grad_passes() >= program.passes()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "program.no_grad_passes: must be between 0 and passes - 1 (",
        program.passes() - 1, "), got ", program.no_grad_passes()));
  }
  return absl::OkStatus();
}

absl::Status CheckStepBatches(const v1::StepProgram& header,
                              absl::Span<const data::MicroBatch> batches) {
  if (static_cast<int64_t>(batches.size()) != header.microbatches()) {
    return absl::InvalidArgumentError(
        absl::StrCat("batches: the program has ", header.microbatches(),
                     " micro-batches, got ", batches.size()));
  }
  for (size_t m = 0; m < batches.size(); ++m) {
    const data::MicroBatch& b = batches[m];
    const int64_t n = b.rows * b.seq_len;
    if (b.rows < 1 || b.seq_len < 1 ||
        static_cast<int64_t>(b.inputs.size()) != n ||
        static_cast<int64_t>(b.targets.size()) != n) {
      return absl::InvalidArgumentError(absl::StrCat(
          "batches[", m, "]: need rows >= 1, seq_len >= 1 and rows * seq_len ",
          "inputs and targets, got rows ", b.rows, ", seq_len ", b.seq_len,
          ", ", b.inputs.size(), " inputs, ", b.targets.size(), " targets"));
    }
  }
  return absl::OkStatus();
}

MoeModelOptions ModelOptionsFor(int microbatches, int passes,
                                int no_grad_passes, float scale,
                                const DiffusionTrainingOptions& diffusion) {
  MoeModelOptions options;
  options.diffusion = diffusion;
  options.microbatches = OrOne(microbatches);
  options.passes = OrOne(passes);
  options.no_grad_passes = no_grad_passes;
  options.self_conditioning_scale = scale;
  return options;
}

bool SameStepShape(const MoeModelOptions& a, const MoeModelOptions& b) {
  return a.microbatches == b.microbatches && a.passes == b.passes &&
         a.no_grad_passes == b.no_grad_passes;
}

absl::Status CheckExpertGroups(const v1::ShardingPlan& plan, int shard_rank,
                               const ExpertGroups& groups) {
  const int ep = plan.mesh().ep();
  if (ep <= 1) {
    if (groups.ep_shard != nullptr || groups.ep != nullptr) {
      return absl::InvalidArgumentError(
          "expert_groups: the plan has no expert parallelism (mesh.ep <= 1)");
    }
    return absl::OkStatus();
  }
  const int dp_shard = plan.mesh().dp_shard();
  const int g = dp_shard / ep;
  if (groups.ep_shard == nullptr || groups.ep_shard->world_size() != g ||
      groups.ep_shard->rank() != shard_rank % g) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expert_groups.ep_shard: mesh.ep ", ep, " needs a group of dp_shard / "
        "ep = ", g, " ranks with this rank at ", shard_rank % g));
  }
  if (groups.ep == nullptr || groups.ep->world_size() != ep ||
      groups.ep->rank() != shard_rank / g) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expert_groups.ep: mesh.ep ", ep, " needs a group of ", ep,
        " ranks with this rank at ", shard_rank / g));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ExpertExchange>> ExchangeFor(
    const v1::ShardingPlan& plan, const v1::ModelSpec& model, Communicator* ep,
    absl::Duration timeout) {
  if (plan.mesh().ep() <= 1) return nullptr;
  SHARDD_ASSIGN_OR_RETURN(const int64_t experts, RoutedExperts(model));
  SHARDD_ASSIGN_OR_RETURN(ExpertExchange exchange,
                          ExpertExchange::Create(ep, experts, timeout));
  return std::make_unique<ExpertExchange>(exchange);
}

double EpCapacityBound(const v1::ShardingPlan& plan) {
  // The plan's skew bound, when the job set one.
  const v1::ActivationModel& a = plan.activations();
  return a.ep_capacity_enforced() ? a.ep_capacity_factor() : 0.0;
}

absl::StatusOr<int64_t> RoutedExperts(const v1::ModelSpec& model) {
  int64_t experts = 0;
  for (const ParamRef& ref : ListParams(model)) {
    bool routed = false;
    for (const v1::ModuleSpec* m : ref.path) {
      routed |= m->kind() == v1::MODULE_GROUPED_EXPERTS;
    }
    if (!routed || ref.tensor->shape_size() == 0) continue;
    const int64_t e = ref.tensor->shape(0);
    if (experts != 0 && e != experts) {
      return absl::InvalidArgumentError(absl::StrCat(
          "expert parallelism: the model's MoE layers differ in their expert "
          "counts (", experts, " and ", e, " at '", ref.fqn, "')"));
    }
    experts = e;
  }
  if (experts == 0) {
    return absl::InvalidArgumentError(
        "expert parallelism: the model has no routed experts");
  }
  return experts;
}

absl::Status CheckStepGroups(const v1::ShardingPlan& plan, int shard_rank,
                             int replica_rank, const Communicator& shard_group,
                             const Communicator* replicas) {
  const int dp_shard = plan.mesh().dp_shard();
  const int dp_replicate = std::max(1, plan.mesh().dp_replicate());
  if (shard_group.world_size() != dp_shard ||
      shard_group.rank() != shard_rank) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shard_group: must have mesh.dp_shard (", dp_shard,
        ") ranks with this rank at options.shard_rank (", shard_rank,
        "), got rank ", shard_group.rank(), " of ", shard_group.world_size()));
  }
  if (dp_replicate > 1 &&
      (replicas == nullptr || replicas->world_size() != dp_replicate ||
       replicas->rank() != replica_rank)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "replicas: HSDP (mesh.dp_replicate ", dp_replicate,
        ") needs a replicate group of that many ranks with this rank at "
        "options.replica_rank (",
        replica_rank, ")"));
  }
  if (dp_replicate == 1 && replicas != nullptr && replicas->world_size() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("replicas: mesh.dp_replicate is 1 but the replicate "
                     "group has ",
                     replicas->world_size(), " ranks"));
  }
  return absl::OkStatus();
}

absl::Status CheckStepOptions(absl::Duration collective_timeout,
                              double max_grad_norm,
                              const kernels::AdamWConfig& adamw) {
  if (!(collective_timeout > absl::ZeroDuration()) ||
      collective_timeout == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(
        "collective_timeout: must be positive and finite");
  }
  if (!(max_grad_norm >= 0.0) || !std::isfinite(max_grad_norm)) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_grad_norm: must be >= 0 and finite (0 turns "
                     "clipping off), got ",
                     max_grad_norm));
  }
  const absl::Status step =
      kernels::AdamWStep(nullptr, nullptr, nullptr, nullptr, 0, 1, adamw);
  if (!step.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("adamw: ", step.message()));
  }
  return absl::OkStatus();
}

}  // namespace shardd
