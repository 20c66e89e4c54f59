#include "planner/megatron_fsdp_strategy.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "planner/default_strategy.h"

namespace shardd {
namespace {

// Packs one segment (a layer or the root) into buckets appended to
// `grouping`.
void PackSegment(const std::string& name, int layer_index, bool prefetch_target,
                 std::vector<ParamRef> params, int64_t bucket_elements,
                 UnitGrouping* grouping) {
  // Dtype groups in order of first appearance.
  std::vector<v1::DType> dtypes;
  std::vector<std::vector<ParamRef>> groups;
  for (ParamRef& param : params) {
    const v1::DType dtype = param.tensor->dtype();
    size_t slot = 0;
    while (slot < dtypes.size() && dtypes[slot] != dtype) ++slot;
    if (slot == dtypes.size()) {
      dtypes.push_back(dtype);
      groups.emplace_back();
    }
    groups[slot].push_back(std::move(param));
  }
  int bucket = 0;
  auto open_bucket = [&]() {
    UnitDraft unit;
    unit.name = absl::StrCat(name, "#", bucket++);
    unit.kind = v1::UNIT_FLAT_BUCKET;
    unit.layer_index = layer_index;
    unit.prefetch_target = prefetch_target;
    grouping->units.push_back(std::move(unit));
  };
  for (std::vector<ParamRef>& group : groups) {
    open_bucket();
    int64_t filled = 0;
    for (ParamRef& param : group) {
      const int64_t numel = Numel(*param.tensor);
      // Close a non-empty bucket the parameter would overflow; written as a
      // subtraction so it cannot overflow.
      if (filled > 0 && numel > bucket_elements - filled) {
        open_bucket();
        filled = 0;
      }
      grouping->units.back().params.push_back(std::move(param));
      // A lone oversized parameter fills its bucket; the next one closes it.
      filled =
          numel > bucket_elements - filled ? bucket_elements : filled + numel;
    }
  }
}

}  // namespace

std::string MegatronFsdpStrategy::description() const {
  return "Megatron-FSDP style: each layer's parameters packed into "
         "contiguous flat buckets (default 40M elements, one dtype per "
         "bucket) sharded as flat ranges; optimizer state follows the same "
         "ranges.";
}

absl::StatusOr<UnitGrouping> MegatronFsdpStrategy::GroupParams(
    const v1::ModelSpec& model, const v1::PlanOptions& options) const {
  if (options.bucket_elements() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bucket_elements must be >= 1 (or 0 for the default ",
        kDefaultBucketElements, "), got ", options.bucket_elements()));
  }
  const int64_t bucket_elements = options.bucket_elements() == 0
                                      ? kDefaultBucketElements
                                      : options.bucket_elements();
  absl::StatusOr<LayerSplit> split = SplitByLayer(model);
  if (!split.ok()) return split.status();
  UnitGrouping grouping;
  grouping.flat_buckets = true;
  for (LayerSplit::Layer& layer : split->layers) {
    PackSegment(layer.name, layer.layer_index, /*prefetch_target=*/true,
                std::move(layer.params), bucket_elements, &grouping);
  }
  if (!split->root_params.empty()) {
    PackSegment(kRootUnitName, -1, /*prefetch_target=*/false,
                std::move(split->root_params), bucket_elements, &grouping);
  }
  return grouping;
}

}  // namespace shardd
