#ifndef SHARDD_WORKER_SHARDS_SHARD_CHECKPOINT_H_
#define SHARDD_WORKER_SHARDS_SHARD_CHECKPOINT_H_

// Saving a rank's shards (any ShardState: a host ShardStore or a GPU
// DeviceShardStore, which goes through one host copy of its state) into a
// resharding checkpoint (checkpoint/) and loading one into shards of any
// world size and strategy.
//
// What is saved. For every parameter of the plan, the global elements this
// shard rank owns (checkpoint::OwnedElementRanges: the valid rows of a dim-0
// shard, the piece of a flat range; padding never) of the fp32 master, and,
// for trainable parameters, of AdamW's exp_avg and exp_avg_sq (tensors name +
// kExpAvgSuffix / kExpAvgSqSuffix). Frozen parameters have no optimizer
// state. All three are stored as "F32" with the parameter's global shape.
//
// Save protocol (the caller drives it):
//   1. one process calls checkpoint::BeginCheckpoint(root, step);
//   2. every shard rank of replica 0 calls SaveRankShards into that
//      directory. Under HSDP (dp_replicate > 1) the replicas hold identical
//      shards, so the other replicas write nothing: the caller picks replica
//      0 (two replicas writing the same RankFileName would collide);
//   3. the committer gathers the RankFiles, calls checkpoint::BuildIndex
//      (checkpoint/plan_index.h) and
//      checkpoint::CommitCheckpoint.
//
// Load: every rank (all replicas) opens the committed checkpoint,
// optionally checks it with CheckpointReader::VerifyAll, and calls
// LoadRankShards, which reads exactly the ranges the rank owns under its own
// plan, then restores the optimizer step count it returns
// (StepExecutor::RestoreOptimizerSteps) so AdamW's bias correction goes on.

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "checkpoint/checkpoint_index.h"
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/checkpoint_writer.h"
#include "proto/plan.pb.h"
#include "worker/shards/shard_state.h"

namespace shardd {

// Writes shard rank `shard_rank`'s owned elements of every parameter of
// `plan` (master, and AdamW moments of trainable parameters) from `shards`
// to tmp_dir/RankFileName(shard_rank), fsynced, and returns its record and
// chunks for checkpoint::BuildIndex. Not to be called while a step runs on
// `shards`. Errors: INVALID_ARGUMENT (shard_rank outside [0, dp_shard),
// `shards` not holding the plan's units or shard sizes, a malformed layout);
// the errors of checkpoint::WriteRankFile (file system errors).
absl::StatusOr<checkpoint::RankFile> SaveRankShards(
    const v1::ShardingPlan& plan, const ShardState& shards,
    const std::string& tmp_dir, int shard_rank);

// Fills shard rank `shard_rank`'s master shards, exp_avg and exp_avg_sq in
// `shards` (built from `plan`) from the checkpoint, reading exactly the
// global ranges the rank owns; padding, the moments of frozen parameters
// and the sharded gradients are zeroed; compute-dtype shard copies are
// refreshed. Returns the checkpoint's step (completed optimizer steps).
// Everything is checked before any shard changes: on INVALID_ARGUMENT,
// NOT_FOUND or FAILED_PRECONDITION `shards` is untouched. Not to be called
// while a step runs on `shards`.
// Errors: INVALID_ARGUMENT (shard_rank outside [0, dp_shard), `shards` not
// holding the plan's units; a tensor whose global shape or dtype differs
// from the plan's, naming the tensor and both); NOT_FOUND (a parameter of
// the plan missing from the checkpoint); FAILED_PRECONDITION (a trainable
// parameter without its exp_avg / exp_avg_sq in the checkpoint, e.g. saved
// frozen); then the errors of CheckpointReader::ReadElements (DATA_LOSS,
// INTERNAL), after which the shards are partly overwritten: verify files
// first (VerifyAll) and re-create the store on such an error.
absl::StatusOr<int64_t> LoadRankShards(const v1::ShardingPlan& plan,
                                       ShardState* shards,
                                       checkpoint::CheckpointReader* reader,
                                       int shard_rank);

}  // namespace shardd

#endif  // SHARDD_WORKER_SHARDS_SHARD_CHECKPOINT_H_
