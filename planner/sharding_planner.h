#ifndef SHARDD_PLANNER_SHARDING_PLANNER_H_
#define SHARDD_PLANNER_SHARDING_PLANNER_H_

// Model + options -> ShardingPlan: strategy grouping, per-unit layout,
// reshard flags, prefetch chains, mixed precision, and the step model.

#include "absl/status/statusor.h"
#include "proto/model.pb.h"
#include "proto/plan.pb.h"
#include "planner/strategy_registry.h"

namespace shardd {

// Largest world size a plan may name.
inline constexpr int kMaxWorldSize = 65536;

class ShardingPlanner {
 public:
  // `registry` must outlive the planner.
  explicit ShardingPlanner(const StrategyRegistry* registry);

  // Defaults: mesh 1x1, mixed precision on, reshard_after_forward true for
  // every layer unit but the last and false for the root, prefetch depths
  // 1/2, one micro-batch, one pass (DiffusionGemma: three passes, one of them
  // without gradients), deferred sync off, 40M-element buckets.
  // Errors: INVALID_ARGUMENT naming the field: mesh sizes < 1 or a world
  // above kMaxWorldSize, tp or cp != 1, a reshard group that does not divide
  // dp_shard, unknown strategy (listing the registered ones), step shape out
  // of range; mesh.ep (expert parallelism, docs/expert_parallel.md) that
  // does not divide dp_shard or a layer's routed experts, on a model without
  // grouped experts, or with a strategy that does not give the experts units
  // of their own (megatron_fsdp, deepseek_v4); ep_capacity_factor outside
  // [1, ep] or set without ep; plus the errors of ValidateModelSpec and the
  // strategy.
  absl::StatusOr<v1::ShardingPlan> Plan(const v1::ModelSpec& model,
                                        const v1::PlanOptions& options) const;

 private:
  const StrategyRegistry* registry_;
};

}  // namespace shardd

#endif  // SHARDD_PLANNER_SHARDING_PLANNER_H_
