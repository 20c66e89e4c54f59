#ifndef SHARDD_PLANNER_SHARDING_STRATEGY_H_
#define SHARDD_PLANNER_SHARDING_STRATEGY_H_

// A sharding strategy decides which parameters form which FSDP unit. The
// planner then computes layouts, prefetch chains, reshard flags and the
// memory model, so every strategy gets those for free.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/model.pb.h"
#include "proto/plan.pb.h"
#include "model/model_util.h"

namespace shardd {

// Megatron-FSDP's flat bucket size (its suggested bucket size) when
// PlanOptions.bucket_elements is 0.
inline constexpr int64_t kDefaultBucketElements = 40'000'000;

// One FSDP unit before layout.
struct UnitDraft {
  std::string name;  // Module path; "<root>" for the root unit.
  v1::UnitKind kind = v1::UNIT_KIND_UNSPECIFIED;
  int layer_index = -1;  // Decoder layer this unit belongs to, -1 for root.
  // Parameters in model walk order. Tied parameters (tensor->tied_to() set)
  // are never listed: they share storage with their target.
  std::vector<ParamRef> params;
  // Index (into UnitGrouping::units) of the unit this one is nested in, or -1.
  // Nested units (experts, dtype islands) inherit the parent's
  // reshard_after_forward.
  int parent = -1;
  // Layer units form the prefetch chain; nested units unshard lazily.
  bool prefetch_target = false;
  // fp32 islands: gather, compute and reduce in the parameters' own fp32
  // even when mixed precision is on.
  bool keep_param_dtype = false;
};

struct UnitGrouping {
  // Wrap order: within a layer nested units come before the layer, layers in
  // index order, the root last. Every non-tied parameter appears in exactly
  // one unit.
  std::vector<UnitDraft> units;
  // megatron_fsdp: units are flat buckets sharded as contiguous flat ranges.
  bool flat_buckets = false;
};

class ShardingStrategy {
 public:
  virtual ~ShardingStrategy() = default;

  // Registry name ("default", "diffusion_gemma", ...). Two strategy objects
  // with the same name are the same strategy.
  virtual std::string name() const = 0;
  virtual std::string description() const = 0;

  // Groups the (validated) model's parameters into units.
  // Errors: INVALID_ARGUMENT when the model lacks what the strategy needs
  // (the message says what), e.g. no decoder layers.
  virtual absl::StatusOr<UnitGrouping> GroupParams(
      const v1::ModelSpec& model, const v1::PlanOptions& options) const = 0;
};

}  // namespace shardd

#endif  // SHARDD_PLANNER_SHARDING_STRATEGY_H_
