#include "program/plan_info.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status_macros.h"
#include "program/step_bounds.h"

namespace shardd {
namespace program_internal {

using v1::FsdpUnit;
using v1::ShardingPlan;

absl::Status CheckRange(absl::string_view field, int64_t value, int64_t lo,
                        int64_t hi) {
  if (value < lo || value > hi) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": must be between ", lo, " and ", hi, ", got ", value));
  }
  return absl::OkStatus();
}

absl::Status ValidateStepShape(const v1::StepShape& step) {
  SHARDD_RETURN_IF_ERROR(CheckRange("step.microbatches", step.microbatches(), 1,
                                    kMaxMicrobatches));
  SHARDD_RETURN_IF_ERROR(
      CheckRange("step.passes", step.passes(), 1, kMaxPasses));
  SHARDD_RETURN_IF_ERROR(CheckRange(
      "step.no_grad_passes", step.no_grad_passes(), 0, step.passes() - 1));
  SHARDD_RETURN_IF_ERROR(CheckRange("step.forward_prefetch_depth",
                                    step.forward_prefetch_depth(), 0,
                                    kMaxPrefetchDepth));
  SHARDD_RETURN_IF_ERROR(CheckRange("step.backward_prefetch_depth",
                                    step.backward_prefetch_depth(), 0,
                                    kMaxPrefetchDepth));
  return absl::OkStatus();
}

namespace {

absl::Status InvalidUnit(int index, absl::string_view field,
                         absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat("units[", index, "].", field, ": ", what));
}

// a * b / c rounded up, without overflow for non-negative int64 inputs.
int64_t MulDivCeil(int64_t a, int64_t b, int64_t c) {
  const __int128 p = static_cast<__int128>(a) * b;
  return static_cast<int64_t>((p + c - 1) / c);
}

// Exact for dim-0 layouts (the padded local_numel of every non-frozen
// parameter); for flat ranges, where a rank's share of each parameter
// differs, shard_numel scaled by trainable_numel / numel (rounded up), which
// is exact when nothing is frozen.
int64_t TrainableShardNumel(const FsdpUnit& unit) {
  bool dim0 = unit.params_size() > 0;
  int64_t exact = 0;
  for (const v1::ParamLayout& param : unit.params()) {
    if (param.shard_dim() != 0) {
      dim0 = false;
      break;
    }
    if (!param.frozen()) exact += param.local_numel();
  }
  if (dim0) return exact;
  if (unit.numel() <= 0 || unit.trainable_numel() >= unit.numel()) {
    return unit.numel() <= 0 ? 0 : unit.shard_numel();
  }
  return MulDivCeil(unit.shard_numel(), unit.trainable_numel(), unit.numel());
}

// Checked a * b for non-negative values.
absl::Status MulBytes(int index, absl::string_view field, int64_t numel,
                      int64_t bytes, int64_t* out) {
  if (numel > 0 && bytes > INT64_MAX / numel) {
    return InvalidUnit(index, field, "byte count overflows int64");
  }
  *out = numel * bytes;
  return absl::OkStatus();
}

bool IsRootLike(const FsdpUnit& u) {
  return u.parent() < 0 &&
         (u.kind() == v1::UNIT_ROOT ||
          (u.kind() == v1::UNIT_FLAT_BUCKET && u.layer_index() < 0));
}

// Sizes, policy and prefetch lists of unit i.
absl::Status AnalyzeUnit(const ShardingPlan& plan, int i, int dp_shard,
                         UnitInfo* m) {
  const int n = plan.units_size();
  const FsdpUnit& u = plan.units(i);
  m->name = u.name();
  m->is_root = IsRootLike(u);
  if (u.shard_numel() < 0 || u.numel() < 0 || u.trainable_numel() < 0) {
    return InvalidUnit(i, "shard_numel", "sizes must be >= 0");
  }
  // Expert parallelism: the unit is gathered over its block's ep_shard
  // ranks.
  const int ep = u.ep() > 1 ? u.ep() : 1;
  if (u.ep() < 0 || dp_shard % ep != 0 ||
      (ep > 1 && (plan.flat_buckets() || u.kind() != v1::UNIT_EXPERTS ||
                  ep != plan.mesh().ep()))) {
    return InvalidUnit(
        i, "ep",
        absl::StrCat("must be 0, or mesh.ep (", plan.mesh().ep(),
                     ", dividing mesh.dp_shard ", dp_shard,
                     ") on an experts unit of a plan without flat buckets, "
                     "got ",
                     u.ep()));
  }
  const int group = dp_shard / ep;
  m->group = group;
  m->ep = ep;
  if (u.shard_numel() > INT64_MAX / group ||
      u.gathered_numel() != u.shard_numel() * group) {
    return InvalidUnit(
        i, "gathered_numel",
        absl::StrCat("must equal shard_numel * its shard group (mesh.dp_shard",
                     ep > 1 ? " / ep" : "", ": ", u.shard_numel(), " * ",
                     group, "), got ", u.gathered_numel()));
  }
  if (u.parent() != -1 && (u.parent() <= i || u.parent() >= n)) {
    return InvalidUnit(
        i, "parent",
        absl::StrCat("must be -1 or the index of a later unit (nested "
                     "units come before their parent), got ",
                     u.parent()));
  }
  if (u.kind() == v1::UNIT_ROOT && u.parent() != -1) {
    return InvalidUnit(i, "parent", "the root unit cannot be nested");
  }
  v1::MixedPrecision precision = u.precision();
  if (precision.param_dtype() == v1::DTYPE_UNSPECIFIED) {
    precision.set_param_dtype(plan.precision().param_dtype());
  }
  if (precision.compute_dtype() == v1::DTYPE_UNSPECIFIED) {
    precision.set_compute_dtype(plan.precision().compute_dtype());
  }
  if (precision.reduce_dtype() == v1::DTYPE_UNSPECIFIED) {
    precision.set_reduce_dtype(plan.precision().reduce_dtype());
  }
  const int64_t param_size = DTypeBytes(precision.param_dtype());
  const int64_t compute_size = DTypeBytes(precision.compute_dtype());
  const int64_t reduce_size = DTypeBytes(precision.reduce_dtype());
  if (param_size <= 0 || compute_size <= 0 || reduce_size <= 0) {
    return InvalidUnit(i, "precision",
                       "param, compute and reduce dtypes must be set (on "
                       "the unit or the plan)");
  }
  m->trainable_shard_numel = TrainableShardNumel(u);
  if (m->trainable_shard_numel > u.shard_numel()) {
    return InvalidUnit(i, "params",
                       "trainable local elements exceed shard_numel");
  }
  SHARDD_RETURN_IF_ERROR(MulBytes(i, "gathered_numel", u.gathered_numel(),
                                  compute_size, &m->gathered_bytes));
  SHARDD_RETURN_IF_ERROR(MulBytes(i, "trainable_numel",
                                  m->trainable_shard_numel * group,
                                  reduce_size, &m->grad_bytes));
  SHARDD_RETURN_IF_ERROR(MulBytes(i, "trainable_numel",
                                  m->trainable_shard_numel, reduce_size,
                                  &m->shard_grad_bytes));
  SHARDD_RETURN_IF_ERROR(MulBytes(i, "shard_numel", u.shard_numel(), param_size,
                                  &m->shard_param_bytes));
  if (u.precision().keep_compute_shard() &&
      u.precision().compute_dtype() != u.precision().param_dtype()) {
    SHARDD_RETURN_IF_ERROR(MulBytes(i, "shard_numel", u.shard_numel(),
                                    compute_size, &m->compute_shard_bytes));
  }

  const v1::ReshardPolicy& policy = u.reshard_after_forward();
  switch (policy.policy_case()) {
    case v1::ReshardPolicy::kGroupSize: {
      const int g = policy.group_size();
      if (g < 1 || dp_shard % g != 0) {
        return InvalidUnit(
            i, "reshard_after_forward.group_size",
            absl::StrCat("must be >= 1 and divide mesh.dp_shard (", dp_shard,
                         "), got ", g));
      }
      // As in FSDP2: 1 means keep everything, dp_shard means free. An
      // expert-parallel unit keeps a slice only where g divides its
      // smaller group, and frees the rest.
      if (g == 1) {
        m->policy = ForwardPolicy::kKeep;
      } else if (g >= group || group % g != 0) {
        m->policy = ForwardPolicy::kFree;
      } else {
        m->policy = ForwardPolicy::kPartial;
        m->group_size = g;
      }
      break;
    }
    case v1::ReshardPolicy::kReshard:
      m->policy =
          policy.reshard() ? ForwardPolicy::kFree : ForwardPolicy::kKeep;
      break;
    case v1::ReshardPolicy::POLICY_NOT_SET:
      // Unset means "do not reshard" (the proto3 zero value).
      m->policy = ForwardPolicy::kKeep;
      break;
  }
  // The root runs forward once per step around every pass: it never
  // reshards after forward.
  if (m->is_root) m->policy = ForwardPolicy::kKeep;

  for (int target : u.forward_prefetch()) {
    if (target < 0 || target >= n || target == i) {
      return InvalidUnit(i, "forward_prefetch",
                         absl::StrCat("unit index out of range: ", target));
    }
    m->forward_prefetch.push_back(target);
  }
  for (int target : u.backward_prefetch()) {
    if (target < 0 || target >= n || target == i) {
      return InvalidUnit(i, "backward_prefetch",
                         absl::StrCat("unit index out of range: ", target));
    }
    m->backward_prefetch.push_back(target);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status AnalyzePlan(const ShardingPlan& plan, PlanInfo* info) {
  const int dp_shard = plan.mesh().dp_shard();
  if (dp_shard < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("mesh.dp_shard: must be >= 1, got ", dp_shard));
  }
  info->dp_shard = dp_shard;
  info->activations = plan.has_activations() ? &plan.activations() : nullptr;
  info->hsdp = plan.mesh().dp_replicate() > 1;
  const int n = plan.units_size();
  info->units.assign(n, UnitInfo());
  for (int i = 0; i < n; ++i) {
    SHARDD_RETURN_IF_ERROR(AnalyzeUnit(plan, i, dp_shard, &info->units[i]));
  }

  // Parents come later in plan order, so walking backwards sees a unit's
  // parent first: top[i] is its top-level ancestor, in_experts[i] whether it
  // is (inside) an experts unit.
  std::vector<int> top(n, -1);
  std::vector<bool> in_experts(n, false);
  for (int i = n - 1; i >= 0; --i) {
    const FsdpUnit& u = plan.units(i);
    if (u.parent() < 0) {
      top[i] = i;
      if (u.kind() == v1::UNIT_EXPERTS) {
        return InvalidUnit(i, "parent",
                           "an experts unit must be nested in its layer's "
                           "unit, got -1");
      }
      if (!info->units[i].is_root && u.layer_index() < 0) {
        return InvalidUnit(
            i, "layer_index",
            absl::StrCat("a top-level unit other than a root belongs to a "
                         "decoder layer and needs layer_index >= 0, got ",
                         u.layer_index()));
      }
      continue;
    }
    top[i] = top[u.parent()];
    in_experts[i] = u.kind() == v1::UNIT_EXPERTS || in_experts[u.parent()];
    if (in_experts[i] && info->units[top[i]].is_root) {
      return InvalidUnit(i, "parent",
                         "an experts unit must be nested in a layer unit, "
                         "not in a root");
    }
  }

  // Roots and their nested units.
  for (int i = 0; i < n; ++i) {
    if (info->units[i].is_root) {
      info->roots.push_back(i);
      info->root_owners.push_back(i);
      for (int j = 0; j < i; ++j) {
        if (top[j] == i) info->root_owners.push_back(j);
      }
    } else if (info->units[top[i]].is_root) {
      info->root_nested.push_back(i);
    }
  }

  // Layers: runs of top-level units with the same layer_index, in order.
  for (int i = 0; i < n; ++i) {
    const FsdpUnit& u = plan.units(i);
    if (u.parent() >= 0 || info->units[i].is_root) continue;
    if (info->layers.empty() || info->layers.back().layer != u.layer_index()) {
      if (!info->layers.empty() &&
          info->layers.back().layer > u.layer_index()) {
        return InvalidUnit(
            i, "layer_index",
            absl::StrCat("top-level units must come in layer order: layer ",
                         u.layer_index(), " after layer ",
                         info->layers.back().layer));
      }
      info->layer_pos[u.layer_index()] = static_cast<int>(info->layers.size());
      info->layers.emplace_back();
      info->layers.back().layer = u.layer_index();
    }
    info->layers.back().units.push_back(i);
  }
  for (int i = 0; i < n; ++i) {
    if (plan.units(i).parent() < 0 || info->units[top[i]].is_root) continue;
    LayerInfo& layer =
        info->layers[info->layer_pos.at(plan.units(top[i]).layer_index())];
    (in_experts[i] ? layer.experts : layer.nested).push_back(i);
  }
  for (LayerInfo& layer : info->layers) {
    layer.layer_owners = layer.units;
    layer.layer_owners.insert(layer.layer_owners.end(), layer.nested.begin(),
                              layer.nested.end());
    layer.has_experts = !layer.experts.empty();
    for (int u : layer.experts) {
      if (info->units[u].ep > 1) layer.exchanged = true;
    }
    if (plan.has_activations()) {
      for (const v1::LayerActivations& l : plan.activations().layers()) {
        if (l.layer() == layer.layer) {
          layer.recomputes_experts = l.recompute() || l.recompute_experts();
        }
      }
    }
    for (int u : layer.layer_owners) {
      for (const v1::ParamLayout& param : plan.units(u).params()) {
        if (absl::StrContains(param.name(), ".experts.")) {
          layer.has_experts = true;
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace program_internal
}  // namespace shardd
