#ifndef SHARDD_PLANNER_MEGATRON_FSDP_STRATEGY_H_
#define SHARDD_PLANNER_MEGATRON_FSDP_STRATEGY_H_

// "megatron_fsdp": Megatron-FSDP style contiguous flat buckets. The planner
// shards each bucket as flat ranges (a parameter may straddle ranks), and
// optimizer state follows the same ranges.

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "proto/model.pb.h"
#include "proto/plan.pb.h"
#include "planner/sharding_strategy.h"

namespace shardd {

// Buckets follow the layer structure (Megatron-FSDP's unit modules are the
// decoder layers): each layer's parameters are split by dtype (dtype groups
// in order of first appearance) and each group is packed greedily in walk
// order into UNIT_FLAT_BUCKET units of at most bucket_elements elements. A
// parameter is never split; one larger than a bucket gets a bucket of its
// own. Root parameters are packed the same way, root buckets last. Buckets
// are named "<layer path>#<n>" / "<root>#<n>" (n counts from 0 per layer),
// carry their layer_index (-1 for root), and layer buckets are prefetch
// targets. Sets UnitGrouping::flat_buckets.
class MegatronFsdpStrategy : public ShardingStrategy {
 public:
  static constexpr char kName[] = "megatron_fsdp";

  std::string name() const override { return kName; }
  std::string description() const override;
  // options.bucket_elements: 0 means kDefaultBucketElements.
  // Errors: INVALID_ARGUMENT for a negative bucket_elements, or when the
  // model has no non-tied parameter.
  absl::StatusOr<UnitGrouping> GroupParams(
      const v1::ModelSpec& model,
      const v1::PlanOptions& options) const override;
};

}  // namespace shardd

#endif  // SHARDD_PLANNER_MEGATRON_FSDP_STRATEGY_H_
