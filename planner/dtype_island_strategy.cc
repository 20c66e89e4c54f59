#include "planner/dtype_island_strategy.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "planner/default_strategy.h"

namespace shardd {
namespace {

// Splits `params` (one layer's or the root's) into fp32 islands and the rest
// and appends [islands..., parent] to `grouping`. `parent_depth` is the
// position of the parent's own module in ParamRef::path.
void AddWithIslands(UnitDraft parent, int parent_depth,
                    UnitGrouping* grouping) {
  bool has_fp32 = false;
  bool has_other = false;
  for (const ParamRef& param : parent.params) {
    (param.tensor->dtype() == v1::FLOAT32 ? has_fp32 : has_other) = true;
  }
  if (!has_fp32 || !has_other) {
    grouping->units.push_back(std::move(parent));
    return;
  }
  std::vector<UnitDraft> islands;
  std::vector<const v1::ModuleSpec*> owners;
  std::vector<ParamRef> rest;
  for (ParamRef& param : parent.params) {
    if (param.tensor->dtype() != v1::FLOAT32) {
      rest.push_back(std::move(param));
      continue;
    }
    const v1::ModuleSpec* owner =
        param.path.empty() ? nullptr : param.path.back();
    size_t slot = 0;
    while (slot < owners.size() && owners[slot] != owner) ++slot;
    if (slot == owners.size()) {
      owners.push_back(owner);
      UnitDraft island;
      const int owner_depth = static_cast<int>(param.path.size()) - 1;
      island.name = owner_depth > parent_depth
                        ? param.path_names.back()
                        : absl::StrCat(parent.name,
                                       DtypeIslandStrategy::kOwnIslandSuffix);
      island.kind = v1::UNIT_DTYPE_ISLAND;
      island.layer_index = parent.layer_index;
      island.keep_param_dtype = true;
      island.prefetch_target = false;
      islands.push_back(std::move(island));
    }
    islands[slot].params.push_back(std::move(param));
  }
  const int parent_index =
      static_cast<int>(grouping->units.size() + islands.size());
  for (UnitDraft& island : islands) {
    island.parent = parent_index;
    grouping->units.push_back(std::move(island));
  }
  parent.params = std::move(rest);
  grouping->units.push_back(std::move(parent));
}

}  // namespace

std::string DtypeIslandStrategy::description() const {
  return "Like default, but fp32 parameters among bf16 ones form their own "
         "nested units (one per owning module) that gather and reduce in "
         "fp32; fp32 and bf16 never share a unit.";
}

absl::StatusOr<UnitGrouping> DtypeIslandStrategy::GroupParams(
    const v1::ModelSpec& model, const v1::PlanOptions& /*options*/) const {
  absl::StatusOr<LayerSplit> split = SplitByLayer(model);
  if (!split.ok()) return split.status();
  UnitGrouping grouping;
  for (LayerSplit::Layer& layer : split->layers) {
    const int depth = layer.depth;
    UnitGrouping one;
    AddLayerUnit(std::move(layer), &one);
    AddWithIslands(std::move(one.units.back()), depth, &grouping);
  }
  UnitGrouping root;
  AddRootUnit(std::move(split->root_params), &root);
  if (!root.units.empty()) {
    AddWithIslands(std::move(root.units.back()), /*parent_depth=*/0, &grouping);
  }
  return grouping;
}

}  // namespace shardd
