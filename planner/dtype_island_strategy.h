#ifndef SHARDD_PLANNER_DTYPE_ISLAND_STRATEGY_H_
#define SHARDD_PLANNER_DTYPE_ISLAND_STRATEGY_H_

// "deepseek_v4": NeMo AutoModel's fully_shard_deepseek_v4 nesting. fp32 and
// bf16 parameters never share an FSDP unit: fp32 islands inside a layer (or
// the root) are wrapped first as their own units, gathered and reduced in
// fp32, then the rest of the layer with the usual mixed precision.

#include <string>

#include "absl/status/statusor.h"
#include "proto/model.pb.h"
#include "proto/plan.pb.h"
#include "planner/sharding_strategy.h"

namespace shardd {

// Starts from the "default" units (layers, root). Within a unit that holds
// both FLOAT32 and non-FLOAT32 parameters, the FLOAT32 ones move into
// UNIT_DTYPE_ISLAND units: one island per owning module (the module that
// declares the parameter, mirroring NeMo's per-submodule wrapping of
// attn_hc, ffn_hc, sinks, ...), in walk order, placed right before the
// parent unit. An island is named by its owning module's path
// ("model.layers.3.attn_hc"); fp32 parameters declared by the layer module
// itself (or by the tree root, for the root unit) form the island
// "<parent unit name>.<fp32>". Islands: parent = the layer (or root) unit,
// layer_index = the parent's, keep_param_dtype = true, prefetch_target =
// false. A unit that is entirely fp32 (or has no fp32 at all) is not split.
// Only FLOAT32 is split out: other dtype mixes (e.g. bf16 with fp8) stay
// together.
class DtypeIslandStrategy : public ShardingStrategy {
 public:
  static constexpr char kName[] = "deepseek_v4";
  static constexpr char kArchitecture[] = "DeepseekV4ForCausalLM";
  static constexpr char kOwnIslandSuffix[] = ".<fp32>";

  std::string name() const override { return kName; }
  std::string description() const override;
  // Errors: INVALID_ARGUMENT when the model has no non-tied parameter.
  absl::StatusOr<UnitGrouping> GroupParams(
      const v1::ModelSpec& model,
      const v1::PlanOptions& options) const override;
};

}  // namespace shardd

#endif  // SHARDD_PLANNER_DTYPE_ISLAND_STRATEGY_H_
