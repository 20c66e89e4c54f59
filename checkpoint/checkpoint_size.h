#ifndef SHARDD_CHECKPOINT_CHECKPOINT_SIZE_H_
#define SHARDD_CHECKPOINT_CHECKPOINT_SIZE_H_

// How big a checkpoint of a plan is, before it is written: what each shard
// rank's file holds (its owned fp32 parameter elements and, for trainable
// parameters, the two fp32 optimizer moments) and a bound on the file's
// safetensors header. Replica 0 writes; other replicas write nothing. The
// coordinator checks free space with it before a save; `shardctl plan`
// prints it so users can size the disk.

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/plan.pb.h"

namespace shardd {
namespace checkpoint {

struct CheckpointBytes {
  int64_t params = 0;     // fp32 parameter elements * 4
  int64_t optimizer = 0;  // trainable elements * 8 (exp_avg, exp_avg_sq)
  // Upper bounds on the safetensors headers of the parameters' and the
  // moments' entries.
  int64_t param_headers = 0;
  int64_t optimizer_headers = 0;
  int64_t total() const {
    return params + optimizer + param_headers + optimizer_headers;
  }
  int64_t without_optimizer() const { return params + param_headers; }
};

// Per shard rank (index = shard rank), at most what SaveRankShards writes:
// exact data bytes, header bytes bounded above. Errors: INVALID_ARGUMENT
// for a plan whose layouts do not describe owned ranges (OwnedElementRanges).
absl::StatusOr<std::vector<CheckpointBytes>> PlanCheckpointBytes(
    const v1::ShardingPlan& plan);

// The sum over ranks.
CheckpointBytes SumCheckpointBytes(const std::vector<CheckpointBytes>& ranks);

}  // namespace checkpoint
}  // namespace shardd

#endif  // SHARDD_CHECKPOINT_CHECKPOINT_SIZE_H_
