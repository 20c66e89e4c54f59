#ifndef SHARDD_CHECKPOINT_CONSOLIDATE_H_
#define SHARDD_CHECKPOINT_CONSOLIDATE_H_

// Consolidating a checkpoint saved by many ranks into one saved as if by a
// single rank: one file holding every tensor (parameters and AdamW state)
// whole, with the same step and data position. Any world size and strategy
// still loads it; tools read it more simply. Purely local: it reads and
// writes files on this machine (shardctl checkpoint consolidate).
//
// The tensors pass through memory one at a time while read, but the file is
// written at the end, so the whole checkpoint is held in memory once: a
// tool for models that fit in host memory.

#include <string>

#include "absl/status/statusor.h"

namespace shardd {
namespace checkpoint {

// Reads the committed checkpoint `checkpoint_dir` (after verifying every
// file's size and XXH64) and commits a single-rank copy of it under
// `out_root` (step-NNNNNNNN of the same step; saved_by "consolidated",
// world size 1, mesh {"dp_shard": 1}, data_position copied). Returns the
// new checkpoint's path. Errors: those of CheckpointReader (NOT_FOUND,
// DATA_LOSS naming the file, INTERNAL), RESOURCE_EXHAUSTED (a tensor too
// large to address in memory), and those of BeginCheckpoint /
// WriteRankFile / CommitCheckpoint (ALREADY_EXISTS when out_root already
// holds that step).
absl::StatusOr<std::string> ConsolidateCheckpoint(
    const std::string& checkpoint_dir, const std::string& out_root);

}  // namespace checkpoint
}  // namespace shardd

#endif  // SHARDD_CHECKPOINT_CONSOLIDATE_H_
