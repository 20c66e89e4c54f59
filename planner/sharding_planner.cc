#include "planner/sharding_planner.h"

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"
#include "common/fingerprint.h"
#include "common/status_macros.h"
#include "layout/unit_layout.h"
#include "model/model_util.h"
#include "planner/activation_model.h"
#include "planner/sharding_strategy.h"
#include "program/step_model.h"

namespace shardd {
namespace {

using v1::FsdpUnit;
using v1::PlanOptions;
using v1::ShardingPlan;

constexpr char kDiffusionGemmaArchitecture[] =
    "DiffusionGemmaForBlockDiffusion";
constexpr int kDefaultForwardPrefetch = 1;
constexpr int kDefaultBackwardPrefetch = 2;

absl::Status OutOfRange(absl::string_view field, int64_t value, int64_t lo,
                        int64_t hi) {
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": must be between ", lo, " and ", hi, ", got ", value));
}

// options.mesh with defaults applied. An absent mesh is 1x1; in a given mesh
// dp_replicate, tp and cp default to 1 when 0, dp_shard must be set.
absl::StatusOr<v1::MeshSpec> NormalizeMesh(const PlanOptions& options) {
  v1::MeshSpec mesh;
  mesh.set_dp_shard(1);
  mesh.set_dp_replicate(1);
  mesh.set_tp(1);
  mesh.set_cp(1);
  if (!options.has_mesh()) return mesh;
  const v1::MeshSpec& in = options.mesh();
  if (in.dp_shard() < 1 || in.dp_shard() > kMaxWorldSize) {
    return OutOfRange("options.mesh.dp_shard", in.dp_shard(), 1, kMaxWorldSize);
  }
  mesh.set_dp_shard(in.dp_shard());
  if (in.dp_replicate() != 0) {
    if (in.dp_replicate() < 1 || in.dp_replicate() > kMaxWorldSize) {
      return OutOfRange("options.mesh.dp_replicate", in.dp_replicate(), 1,
                        kMaxWorldSize);
    }
    mesh.set_dp_replicate(in.dp_replicate());
  }
  // Tensor and context parallelism are recorded for later.
  if (in.tp() != 0 && in.tp() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.mesh.tp: must be 1 (tensor parallelism is recorded for "
        "later, not planned yet), got ",
        in.tp()));
  }
  if (in.cp() != 0 && in.cp() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.mesh.cp: must be 1 (context parallelism is recorded for "
        "later, not planned yet), got ",
        in.cp()));
  }
  if (in.ep() < 0 || in.ep() > kMaxWorldSize) {
    return OutOfRange("options.mesh.ep (--ep)", in.ep(), 1, kMaxWorldSize);
  }
  if (in.ep() > 1) {
    if (mesh.dp_shard() % in.ep() != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "options.mesh.ep (--ep): the expert-parallel degree must divide "
          "options.mesh.dp_shard (",
          mesh.dp_shard(), ", the ranks of one replica), got ", in.ep()));
    }
    mesh.set_ep(in.ep());
  }
  const int64_t world =
      static_cast<int64_t>(mesh.dp_shard()) * mesh.dp_replicate();
  if (world > kMaxWorldSize) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.mesh: world size dp_shard * dp_replicate * tp * cp = ",
        mesh.dp_shard(), " * ", mesh.dp_replicate(), " * 1 * 1 = ", world,
        " exceeds the maximum of ", kMaxWorldSize));
  }
  return mesh;
}

absl::Status ValidateReshard(const PlanOptions& options, int dp_shard) {
  const v1::ReshardPolicy& policy = options.reshard_after_forward();
  if (policy.policy_case() != v1::ReshardPolicy::kGroupSize) {
    return absl::OkStatus();
  }
  const int g = policy.group_size();
  if (g < 1 || dp_shard % g != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.reshard_after_forward.group_size: must be >= 1 and divide "
        "options.mesh.dp_shard (",
        dp_shard, "), got ", g));
  }
  return absl::OkStatus();
}

bool UnderGroupedExperts(const ParamRef& param) {
  for (const v1::ModuleSpec* module : param.path) {
    if (module->kind() == v1::MODULE_GROUPED_EXPERTS) return true;
  }
  return false;
}

// Expert parallelism needs every routed expert in an experts unit of its
// own (so that it can be placed by block) and E divisible by ep.
absl::Status CheckExpertParallel(const std::string& strategy,
                                 const UnitGrouping& grouping, int ep) {
  const std::string field = "options.mesh.ep (--ep)";
  if (grouping.flat_buckets) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": strategy '", strategy,
        "' packs parameters into flat buckets that cut experts anywhere, so "
        "it cannot place whole experts on ranks; expert parallelism works "
        "with the strategies 'default' and 'diffusion_gemma'"));
  }
  int64_t experts = 0;
  for (const UnitDraft& draft : grouping.units) {
    for (const ParamRef& param : draft.params) {
      if (!UnderGroupedExperts(param)) continue;
      ++experts;
      if (draft.kind != v1::UNIT_EXPERTS) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ": strategy '", strategy, "' keeps the routed expert "
            "parameter '", param.fqn, "' in unit '", draft.name,
            "' with other parameters, so it cannot place experts by block; "
            "expert parallelism works with the strategies 'default' and "
            "'diffusion_gemma'"));
      }
      const int64_t e = param.tensor->shape_size() > 0
                            ? param.tensor->shape(0)
                            : 0;
      if (e % ep != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ": ", ep, " does not divide the ", e,
            " routed experts of '", param.fqn,
            "'; allowed: divisors of the expert count that also divide "
            "options.mesh.dp_shard"));
      }
    }
  }
  if (experts == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": the model has no routed (grouped) experts to place; "
        "expert parallelism needs a mixture-of-experts model (leave ep at "
        "1)"));
  }
  return absl::OkStatus();
}

absl::Status CheckCapacityFactor(const PlanOptions& options, int ep) {
  const double c = options.ep_capacity_factor();
  if (c == 0) return absl::OkStatus();
  if (ep <= 1) {
    return absl::InvalidArgumentError(
        "options.ep_capacity_factor: applies with expert parallelism "
        "(options.mesh.ep > 1) only; leave it 0");
  }
  if (!(c >= 1.0 && c <= ep)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.ep_capacity_factor: must be between 1 (balanced routing) "
        "and options.mesh.ep (",
        ep, ": every row to one rank), got ", c));
  }
  return absl::OkStatus();
}

// The step the model replays, from the options and the architecture.
absl::StatusOr<v1::StepShape> MakeStep(const PlanOptions& options,
                                       const std::string& architecture) {
  v1::StepShape step;
  if (options.microbatches() < 0 || options.microbatches() > kMaxMicrobatches) {
    return OutOfRange("options.microbatches", options.microbatches(), 0,
                      kMaxMicrobatches);
  }
  step.set_microbatches(options.microbatches() == 0 ? 1
                                                    : options.microbatches());
  if (options.passes() < 0 || options.passes() > kMaxPasses) {
    return OutOfRange("options.passes", options.passes(), 0, kMaxPasses);
  }
  if (options.passes() == 0) {
    // DiffusionGemma runs its layers three times per step: causal encode, a
    // no-grad self-conditioning pass, bidirectional decode.
    const bool diffusion = architecture == kDiffusionGemmaArchitecture;
    step.set_passes(diffusion ? 3 : 1);
    step.set_no_grad_passes(diffusion ? 1 : 0);
  } else {
    step.set_passes(options.passes());
  }
  if (options.has_no_grad_passes()) {
    if (options.no_grad_passes() < 0 ||
        options.no_grad_passes() >= step.passes()) {
      return OutOfRange("options.no_grad_passes", options.no_grad_passes(), 0,
                        step.passes() - 1);
    }
    step.set_no_grad_passes(options.no_grad_passes());
  }
  step.set_defer_grad_sync(options.has_defer_grad_sync() &&
                           options.defer_grad_sync());
  const int fwd = options.has_forward_prefetch_depth()
                      ? options.forward_prefetch_depth()
                      : kDefaultForwardPrefetch;
  const int bwd = options.has_backward_prefetch_depth()
                      ? options.backward_prefetch_depth()
                      : kDefaultBackwardPrefetch;
  if (fwd < 0 || fwd > kMaxPrefetchDepth) {
    return OutOfRange("options.forward_prefetch_depth", fwd, 0,
                      kMaxPrefetchDepth);
  }
  if (bwd < 0 || bwd > kMaxPrefetchDepth) {
    return OutOfRange("options.backward_prefetch_depth", bwd, 0,
                      kMaxPrefetchDepth);
  }
  // NeMo and FSDP2: explicit prefetch only when the reshard override is not
  // false (with nothing resharded there is nothing to prefetch).
  const v1::ReshardPolicy& policy = options.reshard_after_forward();
  const bool prefetch = !(policy.policy_case() == v1::ReshardPolicy::kReshard &&
                          !policy.reshard());
  step.set_forward_prefetch_depth(prefetch ? fwd : 0);
  step.set_backward_prefetch_depth(prefetch ? bwd : 0);
  return step;
}

// Widest dtype among `params` (an upper bound when a unit mixes dtypes,
// which FSDP2 gathers as raw bytes).
v1::DType WidestDType(const std::vector<ParamRef>& params) {
  v1::DType best = v1::DTYPE_UNSPECIFIED;
  for (const ParamRef& param : params) {
    const v1::DType dtype = param.tensor->dtype();
    if (DTypeBytes(dtype) > DTypeBytes(best)) best = dtype;
  }
  return best;
}

v1::MixedPrecision Uniform(v1::DType dtype) {
  v1::MixedPrecision precision;
  precision.set_param_dtype(dtype);
  precision.set_compute_dtype(dtype);
  precision.set_reduce_dtype(dtype);
  return precision;
}

v1::MixedPrecision DefaultMixed() {
  v1::MixedPrecision precision;
  precision.set_param_dtype(v1::FLOAT32);
  precision.set_compute_dtype(v1::BFLOAT16);
  precision.set_reduce_dtype(v1::FLOAT32);
  return precision;
}

// Root-like units: the root, and Megatron-FSDP buckets outside any layer.
bool IsRootLike(const FsdpUnit& unit) {
  if (unit.parent() >= 0) return false;
  return unit.kind() == v1::UNIT_ROOT ||
         (unit.kind() == v1::UNIT_FLAT_BUCKET && unit.layer_index() < 0);
}

// Checks what the planner relies on from a strategy's grouping.
absl::Status CheckGrouping(const std::string& strategy,
                           const UnitGrouping& grouping) {
  const int n = static_cast<int>(grouping.units.size());
  if (n == 0) {
    return absl::InternalError(
        absl::StrCat("strategy '", strategy, "' produced no units"));
  }
  for (int i = 0; i < n; ++i) {
    const UnitDraft& draft = grouping.units[i];
    if (draft.parent != -1 && (draft.parent <= i || draft.parent >= n)) {
      return absl::InternalError(
          absl::StrCat("strategy '", strategy, "': unit ", i, " ('", draft.name,
                       "') has parent ", draft.parent,
                       "; nested units must come before their parent"));
    }
    if (draft.params.empty()) {
      return absl::InternalError(absl::StrCat("strategy '", strategy,
                                              "': unit ", i, " ('", draft.name,
                                              "') has no parameters"));
    }
  }
  return absl::OkStatus();
}

// Covers everything a worker executes: mesh, units, their parameters'
// layouts, precision, reshard policies and prefetch lists. The step shape
// and the memory report are not part of it. Per-rank lists (valid_rows)
// follow from the hashed shapes, offsets, shard_numel and mesh, so they are
// left out: hashing them would cost O(params * ranks).
uint64_t Fingerprint(const ShardingPlan& plan) {
  Fingerprint64 f;
  f.AddString("shardd.plan.v1");
  f.AddString(plan.strategy());
  f.AddInt(plan.mesh().dp_shard());
  f.AddInt(plan.mesh().dp_replicate());
  f.AddInt(plan.mesh().tp());
  f.AddInt(plan.mesh().cp());
  // Plans without expert parallelism keep their fingerprints.
  if (plan.mesh().ep() > 1) {
    f.AddString("ep");
    f.AddInt(plan.mesh().ep());
  }
  f.AddInt(plan.flat_buckets() ? 1 : 0);
  f.AddInt(plan.bucket_elements());
  f.AddInt(plan.units_size());
  for (const FsdpUnit& unit : plan.units()) {
    f.AddString(unit.name());
    f.AddInt(unit.kind());
    f.AddInt(unit.layer_index());
    f.AddInt(unit.parent());
    f.AddInt(unit.prefetch_target() ? 1 : 0);
    f.AddInt(unit.shard_numel());
    f.AddInt(unit.precision().param_dtype());
    f.AddInt(unit.precision().compute_dtype());
    f.AddInt(unit.precision().reduce_dtype());
    f.AddInt(unit.precision().keep_compute_shard() ? 1 : 0);
    const v1::ReshardPolicy& policy = unit.reshard_after_forward();
    f.AddInt(policy.policy_case());
    f.AddInt(policy.policy_case() == v1::ReshardPolicy::kGroupSize
                 ? policy.group_size()
                 : (policy.reshard() ? 1 : 0));
    f.AddInt(unit.forward_prefetch_size());
    for (int target : unit.forward_prefetch()) f.AddInt(target);
    f.AddInt(unit.backward_prefetch_size());
    for (int target : unit.backward_prefetch()) f.AddInt(target);
    f.AddInt(unit.params_size());
    for (const v1::ParamLayout& param : unit.params()) {
      f.AddString(param.name());
      f.AddInt(param.global_shape_size());
      for (int64_t dim : param.global_shape()) f.AddInt(dim);
      f.AddInt(param.dtype());
      f.AddInt(param.shard_dim());
      f.AddInt(param.padded_dim0());
      f.AddInt(param.row_numel());
      f.AddInt(param.local_numel());
      f.AddInt(param.shard_offset());
      f.AddInt(param.unsharded_offset());
      f.AddInt(param.frozen() ? 1 : 0);
      if (param.ep_blocks() > 1) f.AddInt(param.ep_blocks());
    }
  }
  // Which layers recompute changes what the workers run (plans without
  // activations keep their fingerprints).
  if (plan.has_activations()) {
    const v1::ActivationModel& a = plan.activations();
    f.AddString("activations");
    f.AddInt(a.micro_batch_size());
    f.AddInt(a.seq_len());
    f.AddString(a.checkpointing());
    if (a.ep() > 1) {
      f.AddInt(static_cast<int64_t>(a.ep_capacity_factor() * 1000));
      f.AddInt(a.ep_capacity_enforced() ? 1 : 0);
    }
  }
  return f.value();
}

}  // namespace

ShardingPlanner::ShardingPlanner(const StrategyRegistry* registry)
    : registry_(registry) {}

absl::StatusOr<ShardingPlan> ShardingPlanner::Plan(
    const v1::ModelSpec& model, const PlanOptions& options) const {
  if (registry_ == nullptr) {
    return absl::FailedPreconditionError(
        "ShardingPlanner: constructed without a strategy registry");
  }
  // Options first: they are cheap to check and their errors name the field.
  SHARDD_ASSIGN_OR_RETURN(v1::MeshSpec mesh, NormalizeMesh(options));
  const int dp_shard = mesh.dp_shard();
  SHARDD_RETURN_IF_ERROR(ValidateReshard(options, dp_shard));
  SHARDD_RETURN_IF_ERROR(CheckCapacityFactor(options, mesh.ep()));
  if (mesh.ep() > 1 && options.reshard_after_forward().policy_case() ==
                           v1::ReshardPolicy::kGroupSize) {
    const int g = options.reshard_after_forward().group_size();
    if (g > 1 && g < dp_shard) {
      return absl::InvalidArgumentError(absl::StrCat(
          "options.reshard_after_forward.group_size: resharding to a group "
          "of ", g, " ranks is not supported with expert parallelism "
          "(options.mesh.ep, --ep) yet; use true or false"));
    }
  }
  SHARDD_ASSIGN_OR_RETURN(v1::StepShape step,
                          MakeStep(options, model.architecture()));
  if (options.bucket_elements() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.bucket_elements: must be >= 0 (0 means the "
        "default of ",
        kDefaultBucketElements, "), got ", options.bucket_elements()));
  }
  SHARDD_RETURN_IF_ERROR(ValidateModelSpec(model));

  std::shared_ptr<const ShardingStrategy> strategy;
  if (!options.strategy().empty()) {
    absl::StatusOr<std::shared_ptr<const ShardingStrategy>> named =
        registry_->ByName(options.strategy());
    if (!named.ok()) {
      std::vector<std::string> names;
      for (const v1::StrategyInfo& info : registry_->List()) {
        names.push_back(info.name());
      }
      return absl::InvalidArgumentError(absl::StrCat(
          "options.strategy: unknown strategy '", options.strategy(),
          "'; registered strategies: ", absl::StrJoin(names, ", ")));
    }
    strategy = *std::move(named);
  } else {
    strategy = registry_->ForArchitecture(model.architecture());
  }
  if (strategy == nullptr) {
    return absl::InternalError("strategy registry returned no strategy");
  }
  const std::string strategy_name = strategy->name();
  v1::PlanOptions normalized = options;
  *normalized.mutable_mesh() = mesh;
  SHARDD_ASSIGN_OR_RETURN(UnitGrouping grouping,
                          strategy->GroupParams(model, normalized));
  SHARDD_RETURN_IF_ERROR(CheckGrouping(strategy_name, grouping));
  const int ep = mesh.ep() > 1 ? mesh.ep() : 1;
  if (ep > 1) {
    SHARDD_RETURN_IF_ERROR(CheckExpertParallel(strategy_name, grouping, ep));
  }

  const bool mixed =
      !options.has_mixed_precision() || options.mixed_precision();
  ShardingPlan plan;
  plan.set_architecture(model.architecture());
  plan.set_strategy(strategy_name);
  *plan.mutable_mesh() = mesh;
  plan.set_world_size(mesh.dp_shard() * mesh.dp_replicate() * mesh.tp() *
                      mesh.cp());
  plan.set_total_params(Summarize(model).total_params());
  plan.set_flat_buckets(grouping.flat_buckets);
  SHARDD_ASSIGN_OR_RETURN(const ShardPlacement placement,
                          ParseShardPlacement(options.shard_placement()));
  if (!grouping.flat_buckets) {
    plan.set_shard_placement(placement == ShardPlacement::kDim0 ? "dim0"
                                                                : "auto");
  }
  if (grouping.flat_buckets) {
    plan.set_bucket_elements(options.bucket_elements() > 0
                                 ? options.bucket_elements()
                                 : kDefaultBucketElements);
  }

  // Layout and precision of every unit.
  const int n = static_cast<int>(grouping.units.size());
  plan.mutable_units()->Reserve(n);
  v1::DType widest = v1::DTYPE_UNSPECIFIED;
  for (int i = 0; i < n; ++i) {
    const UnitDraft& draft = grouping.units[i];
    FsdpUnit* unit = plan.add_units();
    unit->set_name(draft.name);
    unit->set_kind(draft.kind);
    unit->set_layer_index(draft.layer_index);
    unit->set_index(i);
    unit->set_parent(draft.parent);
    unit->set_prefetch_target(draft.prefetch_target);
    // Routed experts under expert parallelism: one block per ep rank
    // group, laid out over its ep_shard ranks.
    const bool ep_unit = ep > 1 && draft.kind == v1::UNIT_EXPERTS;
    const absl::Status laid_out =
        grouping.flat_buckets
            ? LayoutFlatRanges(draft.params, dp_shard, unit)
        : ep_unit ? LayoutDim0Shards(draft.params, dp_shard / ep, unit,
                                     placement, ep)
                  : LayoutDim0Shards(draft.params, dp_shard, unit, placement);
    if (!laid_out.ok()) {
      return absl::Status(
          laid_out.code(),
          absl::StrCat("unit '", draft.name, "': ", laid_out.message()));
    }
    const v1::DType own = WidestDType(draft.params);
    if (DTypeBytes(own) > DTypeBytes(widest)) widest = own;
    if (mixed && !draft.keep_param_dtype) {
      *unit->mutable_precision() = DefaultMixed();
      unit->mutable_precision()->set_keep_compute_shard(
          options.keep_compute_shard());
      // ParamLayout.dtype is the master (sharded) dtype.
      for (v1::ParamLayout& param : *unit->mutable_params()) {
        param.set_dtype(v1::FLOAT32);
      }
    } else {
      *unit->mutable_precision() = Uniform(own);
    }
  }
  // Without mixed precision the plan-level policy is the model's dtype (the
  // widest parameter dtype when the spec names none); units may differ.
  *plan.mutable_precision() =
      mixed ? DefaultMixed()
            : Uniform(model.dtype() != v1::DTYPE_UNSPECIFIED ? model.dtype()
                                                             : widest);

  // reshard_after_forward: the override (every layer unit), else the
  // heuristic (every layer unit but the last layer's). The root never
  // reshards; nested units inherit their parent's policy.
  const v1::ReshardPolicy& override_policy = options.reshard_after_forward();
  const bool has_override =
      override_policy.policy_case() != v1::ReshardPolicy::POLICY_NOT_SET;
  int last_layer = -1;
  int last_chain = -1;
  for (int i = 0; i < n; ++i) {
    const FsdpUnit& unit = plan.units(i);
    if (unit.parent() >= 0 || IsRootLike(unit)) continue;
    last_chain = i;
    if (unit.layer_index() > last_layer) last_layer = unit.layer_index();
  }
  // Nested units come before their parent, so walk backwards.
  for (int i = n - 1; i >= 0; --i) {
    FsdpUnit* unit = plan.mutable_units(i);
    v1::ReshardPolicy* policy = unit->mutable_reshard_after_forward();
    if (unit->parent() >= 0) {
      *policy = plan.units(unit->parent()).reshard_after_forward();
    } else if (IsRootLike(*unit)) {
      policy->set_reshard(false);
    } else if (has_override) {
      *policy = override_policy;
    } else {
      const bool last =
          last_layer >= 0 ? unit->layer_index() == last_layer : i == last_chain;
      policy->set_reshard(!last);
    }
  }

  // Prefetch chains over the prefetch targets, in unit order.
  std::vector<int> chain;
  for (int i = 0; i < n; ++i) {
    if (plan.units(i).prefetch_target()) chain.push_back(i);
  }
  const int fwd = step.forward_prefetch_depth();
  const int bwd = step.backward_prefetch_depth();
  const int c = static_cast<int>(chain.size());
  for (int k = 0; k < c; ++k) {
    FsdpUnit* unit = plan.mutable_units(chain[k]);
    for (int j = k + 1; j <= k + fwd && j < c; ++j) {
      unit->add_forward_prefetch(chain[j]);
    }
    for (int j = k - 1; j >= k - bwd && j >= 0; --j) {
      unit->add_backward_prefetch(chain[j]);
    }
  }

  *plan.mutable_step() = step;
  // Without a micro-batch there are no activations to count; a job's plan
  // always has one (the coordinator sets it), so activation_checkpointing
  // takes effect there. Its spelling is checked either way.
  if (options.micro_batch_size() != 0 || options.seq_len() != 0) {
    v1::PlanOptions shaped = options;
    shaped.set_passes(step.passes());
    shaped.set_no_grad_passes(step.no_grad_passes());
    SHARDD_ASSIGN_OR_RETURN(
        *plan.mutable_activations(),
        ModelActivations(model, shaped, ActivationsInBf16(plan)));
  } else {
    SHARDD_RETURN_IF_ERROR(
        ParseCheckpointPolicy(options.activation_checkpointing()).status());
  }
  plan.set_fingerprint(Fingerprint(plan));
  SHARDD_RETURN_IF_ERROR(ModelStep(options.include_timeline(), &plan));
  return plan;
}

}  // namespace shardd
