#include "worker/exec/adamw_optimizer.h"

#include "absl/strings/str_cat.h"

namespace shardd {

absl::Status ApplyAdamWRanges(
    OptimizerShards* shards, int unit,
    const std::vector<std::pair<int64_t, int64_t>>& ranges,
    const kernels::AdamWConfig& config, const OptimizerStepContext& step) {
  kernels::AdamWConfig adamw = config;
  adamw.lr = step.lr;
  for (const auto& [begin, end] : ranges) {
    // The backend checked the configuration (CheckStepOptions) and the
    // ranges come from the store's layout: only a device launch can fail.
    const absl::Status status =
        shards->AdamW(unit, begin, end - begin, step.step, adamw);
    if (!status.ok()) {
      return absl::Status(status.code(),
                          absl::StrCat(step.label, ": AdamW on unit ", unit,
                                       ": ", status.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status AdamWOptimizer::Apply(OptimizerShards* shards, int unit,
                                   const OptimizerStepContext& step) {
  return ApplyAdamWRanges(shards, unit, shards->layout(unit).trainable_ranges,
                          config_, step);
}

}  // namespace shardd
