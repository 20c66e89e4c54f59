#include "checkpoint/plan_index.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "layout/shard_ranges.h"
#include "model/model_util.h"

namespace shardd {
namespace checkpoint {

absl::StatusOr<CheckpointIndex> BuildIndex(
    const v1::ShardingPlan& plan, int64_t step,
    absl::Span<const RankFile> rank_files) {
  if (step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("step ", step, " must be >= 0"));
  }
  CheckpointIndex index;
  index.step = step;
  index.data_position["step"] = step;
  index.saved_by.strategy = plan.strategy();
  index.saved_by.world_size = plan.world_size();
  index.saved_by.mesh["dp_shard"] = plan.mesh().dp_shard();
  index.saved_by.mesh["dp_replicate"] = std::max(1, plan.mesh().dp_replicate());
  for (const RankFile& rank_file : rank_files) {
    SHARDD_RETURN_IF_ERROR(AddRankFile(rank_file, &index));
  }
  for (const v1::FsdpUnit& unit : plan.units()) {
    for (const v1::ParamLayout& param : unit.params()) {
      if (param.numel() == 0) continue;
      std::vector<std::string> names = {param.name()};
      if (!param.frozen()) {
        names.push_back(param.name() + kExpAvgSuffix);
        names.push_back(param.name() + kExpAvgSqSuffix);
      }
      for (const std::string& name : names) {
        auto it = index.tensors.find(name);
        if (it == index.tensors.end()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "tensor \"", name, "\" of the plan is in none of the ",
              rank_files.size(), " rank files"));
        }
        if (it->second.shape != GlobalShape(param)) {
          return absl::InvalidArgumentError(
              absl::StrCat("tensor \"", name, "\": the rank files say ",
                           ShapeText(it->second.shape), ", the plan ",
                           ShapeText(GlobalShape(param))));
        }
      }
    }
  }
  SHARDD_RETURN_IF_ERROR(ValidateIndex(&index));
  return index;
}

}  // namespace checkpoint
}  // namespace shardd
