#ifndef SHARDD_CHECKPOINT_PLAN_INDEX_H_
#define SHARDD_CHECKPOINT_PLAN_INDEX_H_

// The index that commits a save of a sharding plan's training state: the
// step between the rank files the ranks wrote
// (worker/shards/shard_checkpoint.h) and CommitCheckpoint. Needs only the plan,
// so the coordinator builds it without the worker's shard store.

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "checkpoint/checkpoint_index.h"
#include "checkpoint/checkpoint_writer.h"
#include "proto/plan.pb.h"

namespace shardd {
namespace checkpoint {

// The index of a save: every rank's file and chunks, `step` (completed
// optimizer steps), data_position {"step": step} (the batch sampler is
// indexed by step), saved_by from the plan (strategy, world_size, mesh
// dp_shard / dp_replicate). Checks that the files hold every tensor of the
// plan with the plan's global shape, each element exactly once.
// Errors: INVALID_ARGUMENT (step < 0, a file added twice, ranks disagreeing
// on a tensor's shape or dtype, a tensor of the plan missing or with
// another shape, chunks overlapping or leaving elements uncovered, e.g. a
// rank's file left out).
absl::StatusOr<CheckpointIndex> BuildIndex(
    const v1::ShardingPlan& plan, int64_t step,
    absl::Span<const RankFile> rank_files);

}  // namespace checkpoint
}  // namespace shardd

#endif  // SHARDD_CHECKPOINT_PLAN_INDEX_H_
