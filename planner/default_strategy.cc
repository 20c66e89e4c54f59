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

void AddLayerUnitWithExperts(LayerSplit::Layer layer, UnitGrouping* grouping) {
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
      static_cast<int>(grouping->units.size() + experts.size());
  for (UnitDraft& unit : experts) {
    unit.parent = layer_unit;
    grouping->units.push_back(std::move(unit));
  }
  layer.params = std::move(rest);
  AddLayerUnit(std::move(layer), grouping);
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
    const v1::ModelSpec& model, const v1::PlanOptions& options) const {
  absl::StatusOr<LayerSplit> split = SplitByLayer(model);
  if (!split.ok()) return split.status();
  UnitGrouping grouping;
  // Expert parallelism places each layer's experts by block: they need a
  // unit of their own.
  const bool ep = options.mesh().ep() > 1;
  for (LayerSplit::Layer& layer : split->layers) {
    if (ep) {
      AddLayerUnitWithExperts(std::move(layer), &grouping);
    } else {
      AddLayerUnit(std::move(layer), &grouping);
    }
  }
  AddRootUnit(std::move(split->root_params), &grouping);
  return grouping;
}

}  // namespace shardd
