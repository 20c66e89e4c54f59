#ifndef SHARDD_WORKER_EXEC_ADAMW_OPTIMIZER_H_
#define SHARDD_WORKER_EXEC_ADAMW_OPTIMIZER_H_

// "adamw": torch.optim.AdamW (kernels/cpu/adamw.h) on every trainable,
// unpadded element of a rank's master shards. Element-wise, so Prepare has
// nothing to do and any sharding gives the same bits.

#include <cstdint>
#include <utility>
#include <vector>

#include "kernels/cpu/adamw.h"
#include "worker/exec/optimizer.h"

namespace shardd {

class AdamWOptimizer final : public Optimizer {
 public:
  explicit AdamWOptimizer(const kernels::AdamWConfig& config)
      : config_(config) {}

  absl::string_view name() const override { return "adamw"; }
  absl::Status Prepare(OptimizerShards*, int,
                       const OptimizerStepContext&) override {
    return absl::OkStatus();
  }
  absl::Status Apply(OptimizerShards* shards, int unit,
                     const OptimizerStepContext& step) override;
  void Discard(OptimizerShards*) override {}

 private:
  const kernels::AdamWConfig config_;
};

// AdamW over the shard ranges [begin, end) of `unit` (the caller's
// trainable ranges), refreshing their compute-dtype copy. The step's lr
// replaces config.lr. Shared with Muon's non-matrix parameters.
absl::Status ApplyAdamWRanges(
    OptimizerShards* shards, int unit,
    const std::vector<std::pair<int64_t, int64_t>>& ranges,
    const kernels::AdamWConfig& config, const OptimizerStepContext& step);

}  // namespace shardd

#endif  // SHARDD_WORKER_EXEC_ADAMW_OPTIMIZER_H_
