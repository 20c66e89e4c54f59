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
    // Expert modules of this layer in order of first appearance.
    std::vector<UnitDraft> experts;
    std::vector<const v1::ModuleSpec*> expert_modules;
    std::vector<ParamRef> rest;
    for (ParamRef& param : layer.params) {
      int found = -1;
      for (size_t i = layer.depth + 1; i < param.path.size(); ++i) {
        if (param.path[i]->kind() == v1::MODULE_GROUPED_EXPERTS) {
          found = static_cast<int>(i);
          break;
        }
      }
      if (found < 0) {
        rest.push_back(std::move(param));
        continue;
      }
      size_t slot = 0;
      while (slot < expert_modules.size() &&
             expert_modules[slot] != param.path[found]) {
        ++slot;
      }
      if (slot == expert_modules.size()) {
        expert_modules.push_back(param.path[found]);
        UnitDraft unit;
        unit.name = param.path_names[found];
        unit.kind = v1::UNIT_EXPERTS;
        unit.layer_index = layer.layer_index;
        unit.prefetch_target = false;
        experts.push_back(std::move(unit));
      }
      experts[slot].params.push_back(std::move(param));
    }
    if (rest.empty()) {
      // Nothing but experts: nothing to nest them in, keep one layer unit.
      for (UnitDraft& unit : experts) {
        for (ParamRef& param : unit.params) rest.push_back(std::move(param));
      }
      experts.clear();
    }
    const int layer_unit =
        static_cast<int>(grouping.units.size() + experts.size());
    for (UnitDraft& unit : experts) {
      unit.parent = layer_unit;
      grouping.units.push_back(std::move(unit));
    }
    layer.params = std::move(rest);
    AddLayerUnit(std::move(layer), &grouping);
  }
  AddRootUnit(std::move(split->root_params), &grouping);
  return grouping;
}

}  // namespace shardd
