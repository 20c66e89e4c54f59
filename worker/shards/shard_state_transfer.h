#ifndef SHARDD_WORKER_SHARDS_SHARD_STATE_TRANSFER_H_
#define SHARDD_WORKER_SHARDS_SHARD_STATE_TRANSFER_H_

// Moving a rank's training state (fp32 master shards, AdamW moments and the
// optimizer step count) without a checkpoint, for jobs that recover from a
// fault. Written once over ShardState (shard_state.h), so host stores
// (ShardStore) and GPU stores (DeviceShardStore) take the same paths:
//   - within one worker, from the executor of a failed collective
//     membership to the executor of the next one (LoadPlan keep_state):
//     CaptureShardState / RestoreShardState, or CopyShardState between two
//     live stores;
//   - across HSDP replicas, from a replica that kept its state to one that
//     lost it (HealReplicas): BroadcastShardState over the replicate group.
// Sharded gradients are never transferred: between steps they are zero, and
// every destination ends with zeroed gradients. Compute-dtype shard copies
// (MixedPrecision.keep_compute_shard) are refreshed from the new masters.
//
// All stores involved must come from the same plan for the same shard rank;
// the functions check the number of units and each unit's shard size.
// Not to be used while a step runs on a store.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/comm/communicator.h"
#include "worker/shards/shard_state.h"

namespace shardd {

// Copies `from`'s master shards and AdamW moments into `to`, zeroes `to`'s
// sharded gradients and refreshes its compute-dtype shards. A moment buffer
// missing on one side (a unit without room for it) must be missing on the
// other. Nothing changes unless every unit matches.
// Errors: INVALID_ARGUMENT (null `to`); FAILED_PRECONDITION (different unit
// counts, or a unit whose shard numel or moment buffers differ, naming it);
// device errors of either side (after which `to` may be partly written).
absl::Status CopyShardState(const ShardState& from, ShardState* to);

// A host copy of a store's master shards and moments (no gradients), to
// carry the state across the moment a store is destroyed and its successor
// created (LoadPlan keeps at most this copy while the new collective groups
// form, instead of the whole old job).
struct ShardStateSnapshot {
  struct Unit {
    std::vector<float> params;
    std::vector<float> exp_avg;
    std::vector<float> exp_avg_sq;
    bool has_exp_avg = false;
    bool has_exp_avg_sq = false;
  };
  std::vector<Unit> units;

  // Bytes held (master shards and moments).
  int64_t bytes() const;
};

// Errors: device errors of the store's copies.
absl::StatusOr<ShardStateSnapshot> CaptureShardState(const ShardState& store);

// Writes a snapshot into `to` as CopyShardState does. Errors: as
// CopyShardState (nothing changes unless every unit matches).
absl::Status RestoreShardState(const ShardStateSnapshot& snapshot,
                               ShardState* to);

// A snapshot seen as a ShardState in host memory (no gradients), e.g. to
// load a checkpoint into before it goes to a device. The snapshot must
// outlive the view.
class SnapshotState final : public ShardState {
 public:
  explicit SnapshotState(ShardStateSnapshot* snapshot) : snapshot_(snapshot) {}
  int num_units() const override {
    return static_cast<int>(snapshot_->units.size());
  }
  ShardBuffers buffers(int unit) const override;
  bool host_memory() const override { return true; }
  absl::Status CopyToHost(const float* from, int64_t n,
                          float* to) const override;
  absl::Status CopyFromHost(const float* from, int64_t n, float* to) override;
  absl::Status Synchronize() override { return absl::OkStatus(); }
  absl::Status ResetUnit(int unit) override;

 private:
  ShardStateSnapshot* snapshot_;
};

// An empty snapshot with `store`'s geometry (zeroed masters and the moments
// the store holds), to be filled and restored into it.
ShardStateSnapshot ZeroSnapshotLike(const ShardState& store);

// Every member of the replicate group `replicas` ends with the master
// shards, AdamW moments and optimizer step count (`*optimizer_steps`) of
// the member whose rank in the group is `root`; receivers zero their
// sharded gradients and refresh their compute-dtype shards. A collective:
// every member calls it with the same root. `replicas` must address the
// store's memory (Gloo for a ShardStore, NCCL for a DeviceShardStore): the
// buffers are broadcast in place. First the members compare
// their layouts (unit count and shard sizes; one small broadcast and one
// all-reduce) so that a mismatch fails on every member before any state
// moves. Returns the bytes of state this rank received (master shards and
// moments; 0 on the root).
// Errors: INVALID_ARGUMENT (null argument, root outside [0, group size));
// FAILED_PRECONDITION (the members' layouts differ, on every member); the
// communicator's codes (DEADLINE_EXCEEDED, ABORTED, ...). After a
// communicator error a receiver's shards may be partly overwritten and its
// step count is unchanged: its state is unusable. The root's state never
// changes.
absl::StatusOr<int64_t> BroadcastShardState(ShardState* store,
                                            int64_t* optimizer_steps,
                                            Communicator* replicas, int root,
                                            absl::Duration timeout);

}  // namespace shardd

#endif  // SHARDD_WORKER_SHARDS_SHARD_STATE_TRANSFER_H_
