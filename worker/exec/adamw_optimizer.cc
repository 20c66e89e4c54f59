#include "worker/exec/adamw_optimizer.h"

#include "common/logging.h"

namespace shardd {

void ApplyAdamWRanges(ShardStore* store, int unit,
                      const std::vector<std::pair<int64_t, int64_t>>& ranges,
                      const kernels::AdamWConfig& config,
                      const OptimizerStepContext& step) {
  kernels::AdamWConfig adamw = config;
  adamw.lr = step.lr;
  const ShardStore::UnitShard shard = store->shard(unit);
  for (const auto& [begin, end] : ranges) {
    const int64_t n = end - begin;
    // Cannot fail: the backend checked the configuration (CheckStepOptions)
    // and the ranges come from the store's layout.
    const absl::Status status = kernels::AdamWStep(
        shard.params + begin, shard.grads + begin, shard.exp_avg + begin,
        shard.exp_avg_sq + begin, n, step.step, adamw);
    SHARDD_CHECK(status.ok()) << step.label << ": " << status;
    // The range is still in cache: refresh its compute-dtype copy now.
    store->RefreshComputeShard(unit, begin, n);
  }
}

void AdamWOptimizer::Apply(ShardStore* store, int unit,
                           const OptimizerStepContext& step) {
  ApplyAdamWRanges(store, unit, store->layout(unit).trainable_ranges, config_,
                   step);
}

}  // namespace shardd
