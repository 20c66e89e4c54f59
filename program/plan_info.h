#ifndef SHARDD_PROGRAM_PLAN_INFO_H_
#define SHARDD_PROGRAM_PLAN_INFO_H_

// A laid-out plan as the step schedule sees it: per-unit sizes, reshard
// policy and prefetch targets, the root group, and each layer's units and
// part owners (docs/design.md, "Step programs"). Internal to program/: the
// compiler, the validator and the replay of step_program.cc read it.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "proto/plan.pb.h"

namespace shardd {
namespace program_internal {

enum class ForwardPolicy { kKeep, kFree, kPartial };

struct UnitInfo {
  std::string name;
  bool is_root = false;
  ForwardPolicy policy = ForwardPolicy::kFree;
  int group_size = 0;               // kPartial: the smaller shard group.
  // The ranks it is gathered over: dp_shard, or dp_shard / ep for an
  // expert-parallel unit (ep > 1).
  int group = 1;
  int ep = 1;
  int64_t gathered_bytes = 0;       // Unsharded params, compute dtype.
  int64_t grad_bytes = 0;           // Unsharded grads, reduce dtype.
  int64_t shard_grad_bytes = 0;     // Sharded grads, reduce dtype.
  int64_t shard_param_bytes = 0;    // Master shard, param dtype.
  int64_t compute_shard_bytes = 0;  // keep_compute_shard's copy.
  int64_t trainable_shard_numel = 0;
  std::vector<int> forward_prefetch;
  std::vector<int> backward_prefetch;

  bool trainable() const { return trainable_shard_numel > 0; }
};

struct LayerInfo {
  int layer = 0;             // layer_index.
  std::vector<int> units;    // Layer units (top level), plan order.
  std::vector<int> nested;   // Nested non-expert units (LAYER owners).
  std::vector<int> experts;  // Experts units and units nested in them.
  bool has_experts = false;
  // Its experts run expert-parallel (an experts unit with ep > 1): DISPATCH
  // and COMBINE commands surround EXPERTS.
  bool exchanged = false;
  // The plan's activation model recomputes its experts (or the whole
  // layer) in backward.
  bool recomputes_experts = false;
  std::vector<int> layer_owners;  // units, then nested.

  const std::vector<int>& experts_owners() const {
    return experts.empty() ? layer_owners : experts;
  }
};

struct PlanInfo {
  int dp_shard = 1;
  bool hsdp = false;
  std::vector<UnitInfo> units;
  std::vector<int> roots;         // Plan order.
  std::vector<int> root_nested;   // Units nested in a root, plan order.
  std::vector<int> root_owners;   // Each root followed by its nested units.
  std::vector<LayerInfo> layers;  // Layer order.
  std::map<int, int> layer_pos;   // layer_index -> position in `layers`.
  // The plan's activation model (points into the plan), or null.
  const v1::ActivationModel* activations = nullptr;
};

// INVALID_ARGUMENT naming `field` unless lo <= value <= hi.
absl::Status CheckRange(absl::string_view field, int64_t value, int64_t lo,
                        int64_t hi);

// The step shape's bounds (step_program.h): INVALID_ARGUMENT naming the
// field of plan.step() out of range.
absl::Status ValidateStepShape(const v1::StepShape& step);

// Analyzes `plan` into `info`. Errors: INVALID_ARGUMENT naming the unit
// field (parents, kinds, layer indices, prefetch targets, sizes) that
// does not fit.
absl::Status AnalyzePlan(const v1::ShardingPlan& plan, PlanInfo* info);

}  // namespace program_internal
}  // namespace shardd

#endif  // SHARDD_PROGRAM_PLAN_INFO_H_
