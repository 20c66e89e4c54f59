#ifndef SHARDD_PLANNER_DEFAULT_STRATEGY_H_
#define SHARDD_PLANNER_DEFAULT_STRATEGY_H_

// The "default" strategy (NeMo AutoModel's DefaultParallelizationStrategy on
// the pure-FSDP path): one unit per decoder layer plus a root unit for the
// rest. Also home of the layer split every built-in strategy starts from.

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/model.pb.h"
#include "proto/plan.pb.h"
#include "model/model_util.h"
#include "planner/sharding_strategy.h"

namespace shardd {

// Name of the root unit.
inline constexpr char kRootUnitName[] = "<root>";

// A model's non-tied parameters split along its decoder layers.
//
// Decoder layers are the children of the outermost MODULE_LAYER_LIST modules
// (a layer list nested inside a layer stays part of that layer). Layers are
// numbered in walk order across all such lists, which for the usual single
// "model.layers" list is the list index. Parameters owned by a layer list
// itself, and all others outside a layer, belong to the root. A model without
// any layer list has no layers: everything is root (valid, e.g. a tiny custom
// model).
struct LayerSplit {
  struct Layer {
    std::string name;  // Module path, "model.layers.3".
    int layer_index = -1;
    // Position of the layer module in ParamRef::path of its parameters.
    int depth = 0;
    std::vector<ParamRef> params;  // Walk order, never empty.
  };
  // Index order. Layers without any non-tied parameter are left out (a unit
  // needs at least one parameter).
  std::vector<Layer> layers;
  std::vector<ParamRef> root_params;  // Walk order.
};

// Errors: INVALID_ARGUMENT when the model has no non-tied parameter.
absl::StatusOr<LayerSplit> SplitByLayer(const v1::ModelSpec& model);

// Appends a UNIT_LAYER unit for `layer` (a prefetch target).
void AddLayerUnit(LayerSplit::Layer layer, UnitGrouping* grouping);

// Appends `layer` with each of its grouped-experts modules as a UNIT_EXPERTS
// unit nested before it (not a prefetch target), then the rest of the layer
// as its UNIT_LAYER unit; a layer of nothing but experts stays one layer
// unit.
void AddLayerUnitWithExperts(LayerSplit::Layer layer, UnitGrouping* grouping);

// Appends the UNIT_ROOT unit when `params` is non-empty.
void AddRootUnit(std::vector<ParamRef> params, UnitGrouping* grouping);

// One UNIT_LAYER unit per decoder layer (layer units are prefetch targets),
// then one UNIT_ROOT unit "<root>" with every other parameter (embeddings,
// final norm, head, layer-less models). Tied parameters are skipped. A model
// whose parameters all sit in layers gets no root unit. With expert
// parallelism (options.mesh.ep > 1) each layer's experts form their own
// nested unit, as in diffusion_gemma.
class DefaultStrategy : public ShardingStrategy {
 public:
  static constexpr char kName[] = "default";

  std::string name() const override { return kName; }
  std::string description() const override;
  // Errors: INVALID_ARGUMENT when the model has no non-tied parameter.
  absl::StatusOr<UnitGrouping> GroupParams(
      const v1::ModelSpec& model,
      const v1::PlanOptions& options) const override;
};

}  // namespace shardd

#endif  // SHARDD_PLANNER_DEFAULT_STRATEGY_H_
