#include "planner/default_strategy.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"

namespace shardd {
namespace {

using LayerNumbers = absl::flat_hash_map<const v1::ModuleSpec*, int>;

// Numbers the children of every outermost layer list in walk order.
void NumberLayers(const v1::ModuleSpec& module, LayerNumbers* numbers) {
  if (module.kind() == v1::MODULE_LAYER_LIST) {
    for (const v1::ModuleSpec& child : module.children()) {
      const int next = static_cast<int>(numbers->size());
      numbers->emplace(&child, next);
    }
    return;  // Lists nested inside a layer belong to that layer.
  }
  for (const v1::ModuleSpec& child : module.children()) {
    NumberLayers(child, numbers);
  }
}

}  // namespace

absl::StatusOr<LayerSplit> SplitByLayer(const v1::ModelSpec& model) {
  LayerNumbers numbers;
  NumberLayers(model.root(), &numbers);

  LayerSplit split;
  // Layer index -> position in split.layers.
  std::map<int, size_t> slot;
  bool any = false;
  for (ParamRef& param : ListParams(model)) {
    if (param.tensor == nullptr || !param.tensor->tied_to().empty()) continue;
    any = true;
    int depth = -1;
    int index = -1;
    for (size_t i = 0; i < param.path.size(); ++i) {
      auto it = numbers.find(param.path[i]);
      if (it != numbers.end()) {
        depth = static_cast<int>(i);
        index = it->second;
        break;
      }
    }
    if (index < 0) {
      split.root_params.push_back(std::move(param));
      continue;
    }
    auto [it, inserted] = slot.emplace(index, split.layers.size());
    if (inserted) {
      LayerSplit::Layer layer;
      layer.name = depth < static_cast<int>(param.path_names.size())
                       ? param.path_names[depth]
                       : absl::StrCat("layer", index);
      layer.layer_index = index;
      layer.depth = depth;
      split.layers.push_back(std::move(layer));
    }
    split.layers[it->second].params.push_back(std::move(param));
  }
  if (!any) {
    return absl::InvalidArgumentError(
        "model: has no (untied) parameters to shard");
  }
  // Walk order already is index order; keep it explicit.
  std::stable_sort(split.layers.begin(), split.layers.end(),
                   [](const LayerSplit::Layer& a, const LayerSplit::Layer& b) {
                     return a.layer_index < b.layer_index;
                   });
  return split;
}

void AddLayerUnit(LayerSplit::Layer layer, UnitGrouping* grouping) {
  UnitDraft unit;
  unit.name = std::move(layer.name);
  unit.kind = v1::UNIT_LAYER;
  unit.layer_index = layer.layer_index;
  unit.params = std::move(layer.params);
  unit.prefetch_target = true;
  grouping->units.push_back(std::move(unit));
}

void AddRootUnit(std::vector<ParamRef> params, UnitGrouping* grouping) {
  if (params.empty()) return;
  UnitDraft unit;
  unit.name = kRootUnitName;
  unit.kind = v1::UNIT_ROOT;
  unit.layer_index = -1;
  unit.params = std::move(params);
  grouping->units.push_back(std::move(unit));
}

std::string DefaultStrategy::description() const {
  return "One FSDP unit per decoder layer plus a root unit for everything "
         "else (embeddings, final norm, head).";
}

absl::StatusOr<UnitGrouping> DefaultStrategy::GroupParams(
    const v1::ModelSpec& model, const v1::PlanOptions& /*options*/) const {
  absl::StatusOr<LayerSplit> split = SplitByLayer(model);
  if (!split.ok()) return split.status();
  UnitGrouping grouping;
  for (LayerSplit::Layer& layer : split->layers) {
    AddLayerUnit(std::move(layer), &grouping);
  }
  AddRootUnit(std::move(split->root_params), &grouping);
  return grouping;
}

}  // namespace shardd
