#include "checkpoint/checkpoint_size.h"

#include "common/status_macros.h"
#include "layout/shard_ranges.h"

namespace shardd {
namespace checkpoint {
namespace {

// File-level header bytes: the 8-byte length, the braces, the padding to 8
// bytes and the metadata object.
constexpr int64_t kFileHeaderBytes = 8 + 2 + 7 + 1024;

// A bound on one JSON entry
// "name@begin":{"dtype":"F32","shape":[...],"data_offsets":[a,b]},
// (numbers of at most 20 digits).
int64_t EntryBound(const std::string& name, int dims) {
  return static_cast<int64_t>(name.size()) + 21 + 96 + 21 * int64_t{dims};
}

}  // namespace

absl::StatusOr<std::vector<CheckpointBytes>> PlanCheckpointBytes(
    const v1::ShardingPlan& plan) {
  const int ranks = plan.mesh().dp_shard();
  std::vector<CheckpointBytes> out(ranks > 0 ? ranks : 0);
  for (int r = 0; r < ranks; ++r) {
    CheckpointBytes& b = out[r];
    b.param_headers = kFileHeaderBytes;
    for (const v1::FsdpUnit& unit : plan.units()) {
      for (const v1::ParamLayout& param : unit.params()) {
        SHARDD_ASSIGN_OR_RETURN(
            const std::vector<OwnedRange> ranges,
            OwnedElementRanges(param, unit.shard_numel(), r));
        const int dims = param.global_shape_size();
        for (const OwnedRange& range : ranges) {
          const int64_t n = range.end - range.begin;
          if (n <= 0) continue;  // WriteRankFile skips empty pieces.
          b.params += n * 4;
          b.param_headers += EntryBound(param.name(), dims);
          if (param.frozen()) continue;
          b.optimizer += n * 8;
          b.optimizer_headers += EntryBound(param.name() + "/exp_avg_sq", dims) +
                                 EntryBound(param.name() + "/exp_avg", dims);
        }
      }
    }
  }
  return out;
}

CheckpointBytes SumCheckpointBytes(const std::vector<CheckpointBytes>& ranks) {
  CheckpointBytes sum;
  for (const CheckpointBytes& b : ranks) {
    sum.params += b.params;
    sum.optimizer += b.optimizer;
    sum.param_headers += b.param_headers;
    sum.optimizer_headers += b.optimizer_headers;
  }
  return sum;
}

}  // namespace checkpoint
}  // namespace shardd
