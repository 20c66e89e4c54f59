#ifndef SHARDD_PLANNER_DIFFUSION_GEMMA_STRATEGY_H_
#define SHARDD_PLANNER_DIFFUSION_GEMMA_STRATEGY_H_

// "diffusion_gemma": NeMo AutoModel's fully_shard_diffusion_gemma on the
// pure-FSDP path. Each layer's grouped experts (moe.experts) are wrapped
// first as their own unit, then the rest of the layer, so the layer's
// all-gather (and its prefetch) no longer carries the expert stack.

#include <string>

#include "absl/status/statusor.h"
#include "proto/model.pb.h"
#include "proto/plan.pb.h"
#include "planner/sharding_strategy.h"

namespace shardd {

// Units, in order: for each layer one UNIT_EXPERTS unit per
// MODULE_GROUPED_EXPERTS module inside it (outermost ones, walk order; named
// by module path, e.g. "model.layers.3.moe.experts"), then the UNIT_LAYER
// unit with the rest of the layer; the root last. Expert units have
// parent = index of their layer unit, prefetch_target = false (they unshard
// lazily) and inherit the layer's reshard_after_forward through `parent`.
// Layers without experts (dense first layers, dense models) get a plain
// layer unit, as in "default". A layer holding nothing but experts keeps
// them in its layer unit: there is no rest of the layer to nest them in.
class DiffusionGemmaStrategy : public ShardingStrategy {
 public:
  static constexpr char kName[] = "diffusion_gemma";
  static constexpr char kArchitecture[] = "DiffusionGemmaForBlockDiffusion";

  std::string name() const override { return kName; }
  std::string description() const override;
  // Errors: INVALID_ARGUMENT when the model has no non-tied parameter.
  absl::StatusOr<UnitGrouping> GroupParams(
      const v1::ModelSpec& model,
      const v1::PlanOptions& options) const override;
};

}  // namespace shardd

#endif  // SHARDD_PLANNER_DIFFUSION_GEMMA_STRATEGY_H_
