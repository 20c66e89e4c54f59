#include "planner/diffusion_gemma_strategy.h"

#include <utility>
#include <vector>

#include "planner/default_strategy.h"

namespace shardd {

std::string DiffusionGemmaStrategy::description() const {
  return "Like default, but each layer's grouped experts (moe.experts) form "
         "their own unit, wrapped before the rest of the layer and not "
         "prefetched (order [experts, layer]).";
}

absl::StatusOr<UnitGrouping> DiffusionGemmaStrategy::GroupParams(
    const v1::ModelSpec& model, const v1::PlanOptions& /*options*/) const {
  absl::StatusOr<LayerSplit> split = SplitByLayer(model);
  if (!split.ok()) return split.status();
  UnitGrouping grouping;
  for (LayerSplit::Layer& layer : split->layers) {
    AddLayerUnitWithExperts(std::move(layer), &grouping);
  }
  AddRootUnit(std::move(split->root_params), &grouping);
  return grouping;
}

}  // namespace shardd
