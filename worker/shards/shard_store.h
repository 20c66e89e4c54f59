#ifndef SHARDD_WORKER_SHARDS_SHARD_STORE_H_
#define SHARDD_WORKER_SHARDS_SHARD_STORE_H_

// A worker's shards of every FSDP unit of a plan, and the four operations the
// step program drives on them:
//
//   Unshard(u)        copy-in of the fp32 master shard into the compute dtype
//                     (bf16 under mixed precision), then one all-gather into
//                     the unit's flat buffer of gathered_numel elements;
//                     with keep_compute_shard the persistent compute-dtype
//                     copy of the shard is gathered as it is;
//   Reshard(u[, G])   frees the gathered buffer, or (G > 1, FSDP2's
//                     reshard_after_forward=int) keeps the 1/G slice of it
//                     this rank holds within its slice group, so the next
//                     Unshard all-gathers over G ranks instead of dp_shard;
//   AllocGrad(u)      a zeroed unsharded gradient buffer in the reduce dtype
//                     for the unit's trainable parameters only: each rank's
//                     chunk is its trainable parameter shards back to back
//                     (frozen ones take no room; a flat bucket keeps its
//                     flat layout);
//   ReduceScatter(u)  reduce-scatter (average) of that buffer into the
//                     sharded fp32 gradient (accumulating), an HSDP
//                     all-reduce (average) across replicas, then frees it.
//
// Compute reads parameters through ParamView and adds gradients through
// AccumulateGrad. A parameter is a zero-copy view into the gathered buffer
// when the buffer holds it contiguously in fp32 (a one-parameter unit, one
// shard rank, or a flat bucket); otherwise it is copied out (and widened from
// bf16) into a workspace tensor that lives until the unit reshards. Gathered
// and gradient buffers are accounted as kGatheredParams / kUnshardedGrads, so
// their measured peak is the planner's peak_unsharded_bytes for the same
// program; copy-outs are kWorkspace. Freed gathered and gradient blocks are
// kept for reuse (kCached) instead of going back to the system.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "model/lora.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "layout/shard_layout.h"
#include "proto/model.pb.h"
#include "proto/plan.pb.h"
#include "worker/comm/communicator.h"
#include "worker/memory/memory_tracker.h"
#include "worker/shards/shard_state.h"

namespace shardd {

// Slice groups by size G: this rank's group of G consecutive shard ranks
// (shard ranks q*G .. q*G+G-1, with this rank at shard_rank % G), used to
// re-gather units resharded to a slice.
using SliceGroups = std::map<int, Communicator*>;

// Which per-element buffer of a shard to read: the fp32 master parameters
// or AdamW's first / second moment.
enum class ShardBuffer { kParams, kExpAvg, kExpAvgSq };

struct ShardStoreOptions {
  // This rank's position in the shard group (dp_shard ranks).
  int shard_rank = 0;
  uint64_t seed = 0;
  // When set, the master shards start from these values instead of the
  // seeded initialisation (e.g. a Hugging Face checkpoint); the caller keeps
  // it alive during Create.
  const InitialValues* initial_values = nullptr;
  absl::Duration collective_timeout = absl::Seconds(60);
  // Hold each unit's sharded gradient and AdamW moments only up to the end
  // of its last trainable range (UnitShard::state_numel) instead of the
  // whole shard: frozen elements after it have none. For optimizers that
  // read these buffers only over the trainable ranges (AdamW; not Muon,
  // which uses exp_avg_sq as whole-shard scratch). LoRA units place their
  // trainable adapters first (layout/unit_layout.h), so this is what makes
  // their frozen base cost no optimizer memory.
  bool trim_frozen_state = false;
};

class ShardStore final : public ShardState {
 public:
  // Allocates and initialises this rank's master shards (InitParamRange of
  // param_init.h, so values do not depend on the layout), zeroed sharded
  // gradients and AdamW moments. `model` supplies the owner module kinds for
  // the initialisation rules; it must be the model the plan was made from.
  // Errors: INVALID_ARGUMENT (shard_rank outside [0, dp_shard), a plan
  // parameter missing from the model, a unit whose dtypes the CPU path cannot
  // hold).
  static absl::StatusOr<std::unique_ptr<ShardStore>> Create(
      const v1::ShardingPlan& plan, const v1::ModelSpec& model,
      const ShardStoreOptions& options, MemoryTracker* tracker);

  // Errors (all four): NOT_FOUND (unit index out of range),
  // FAILED_PRECONDITION (the unit is not in the state the op needs: already
  // gathered, not gathered, gradient already or not allocated), and the
  // communicator's codes (DEADLINE_EXCEEDED, ABORTED, ...).
  //
  // A unit holding a slice is gathered from `slice_groups` (the group of the
  // slice's size); INVALID_ARGUMENT when that group is missing or does not
  // have G ranks with this rank at shard_rank % G. The slice stays
  // allocated (and counted) until DropSlice(u): the caller frees it when it
  // has waited for the gather, the point the plan's replay assumes.
  absl::Status Unshard(int unit, Communicator* shard_group,
                       const SliceGroups* slice_groups = nullptr);
  // `group_size` 0 frees everything; G in [2, dp_shard) with dp_shard % G == 0
  // keeps this rank's 1/G slice (copied out before the gathered buffer is
  // freed). INVALID_ARGUMENT for any other G.
  absl::Status Reshard(int unit, int group_size = 0);
  absl::Status AllocGrad(int unit);
  // `replicas` may be null (no HSDP).
  absl::Status ReduceScatter(int unit, Communicator* shard_group,
                             Communicator* replicas);

  bool gathered(int unit) const;
  // The G of the slice a unit holds after Reshard(u, G); 0 when none.
  int slice_group_size(int unit) const;
  // Rewrites elements [begin, begin + count) of a unit's compute-dtype shard
  // copy from the master (after the optimizer updated them); a no-op for
  // units without one (MixedPrecision.keep_compute_shard off, or fp32
  // compute). The caller keeps the range inside the shard.
  void RefreshComputeShard(int unit, int64_t begin, int64_t count);

  // Frees a unit's slice: after the re-gather that consumed it, or after an
  // aborted step; a no-op without one.
  void DropSlice(int unit);
  bool grad_allocated(int unit) const;

  // The unsharded fp32 values of a parameter whose unit is gathered; valid
  // until the unit reshards. Errors: NOT_FOUND (unknown name),
  // FAILED_PRECONDITION (unit not gathered).
  absl::StatusOr<const float*> ParamView(const std::string& name);

  // grad[name] += values (numel elements of the unsharded parameter).
  // Errors: NOT_FOUND, FAILED_PRECONDITION (gradient not allocated, or the
  // parameter is frozen).
  absl::Status AccumulateGrad(const std::string& name, const float* values);

  // Master shards, sharded gradients and AdamW state, one entry per unit
  // (all fp32, shard_numel elements each), for the optimizer and tests.
  // (state_numel: fewer than numel with ShardStoreOptions::trim_frozen_state,
  // every trainable range inside.)
  using UnitShard = ShardBuffers;
  UnitShard shard(int unit) const;

  // ShardState: host memory, read and written in place.
  int num_units() const override { return static_cast<int>(units_.size()); }
  ShardBuffers buffers(int unit) const override { return shard(unit); }
  bool host_memory() const override { return true; }
  absl::Status CopyToHost(const float* from, int64_t n,
                          float* to) const override;
  absl::Status CopyFromHost(const float* from, int64_t n, float* to) override;
  absl::Status Synchronize() override { return absl::OkStatus(); }
  // Zeroes the unit's sharded gradient and refreshes its compute shard.
  absl::Status ResetUnit(int unit) override;
  // Where unit `unit`'s parameters live (0 <= unit < num_units()).
  const UnitLayout& layout(int unit) const { return layouts_[unit]; }

  // The unsharded value of a parameter assembled from this rank's shard only
  // (other ranks' rows are left untouched in `out`): used by tests and
  // checkpoints to compare against an unsharded run. Writes the rows/elements
  // this rank holds into `out` (numel elements of the full parameter), taken
  // from the master parameters or from one of AdamW's moments.
  // Errors: NOT_FOUND; FAILED_PRECONDITION for a moment not held
  // (trim_frozen_state).
  absl::Status CopyOwnedParamSlice(
      const std::string& name, float* out,
      ShardBuffer buffer = ShardBuffer::kParams) const;
  // The inverse: overwrites this rank's elements of `buffer` from the
  // unsharded values `in` (numel elements), refreshing a kept compute shard.
  // Padding is left as it is. Not to be used while a step runs.
  // Errors: NOT_FOUND; FAILED_PRECONDITION as CopyOwnedParamSlice.
  absl::Status WriteOwnedParamSlice(const std::string& name, const float* in,
                                    ShardBuffer buffer = ShardBuffer::kParams);

 private:
  // Where a parameter's placement is: layouts_[unit].params[index].
  struct ParamRef {
    int unit = -1;
    int index = -1;
  };
  struct UnitState {
    int64_t shard_numel = 0;
    int64_t state_numel = 0;  // UnitShard::state_numel.
    int64_t gathered_numel = 0;
    // Elements per rank of the unsharded gradient buffer.
    int64_t grad_chunk_numel = 0;
    // The ranks the unit is gathered over (dp_shard, or an expert-parallel
    // unit's ep_shard), this rank's place among them, and the expert
    // parallelism degree (1: none).
    int world = 1;
    int group_rank = 0;
    int ep = 1;
    v1::DType compute = v1::FLOAT32;
    v1::DType reduce = v1::FLOAT32;
    bool flat = false;
    int num_params = 0;
    TrackedBuffer master;
    TrackedBuffer grads;
    TrackedBuffer exp_avg;
    TrackedBuffer exp_avg_sq;
    TrackedBuffer gathered;
    TrackedBuffer unsharded_grad;
    TrackedBuffer staging;  // Copy-in / reduce-scatter output scratch.
    // Reshard(u, G > 1): gathered elements [p*S, (p+1)*S), S =
    // gathered_numel / G, p = shard_rank % G; accounted as gathered
    // parameters (the plan's replay counts it so).
    TrackedBuffer slice;
    int slice_group = 0;
    // keep_compute_shard: the master shard in the compute dtype, accounted
    // as shard parameters.
    TrackedBuffer compute_shard;
    // Copy-outs of this unit's parameters, by param index.
    std::vector<TrackedBuffer> copies;
  };

  ShardStore(MemoryTracker* tracker, ShardStoreOptions options)
      : tracker_(tracker), options_(options), cache_(tracker) {}

  absl::StatusOr<UnitState*> Unit(int unit);
  static float* BufferOf(const UnitState& unit, ShardBuffer buffer);
  absl::StatusOr<const ParamRef*> Param(const std::string& name) const;
  bool ViewsInPlace(const UnitState& unit, const ParamPlacement& param) const;
  // The gathered values of `param` as fp32 into out[0..numel).
  void CopyOut(const UnitState& unit, const ParamPlacement& param,
               float* out) const;
  // A LoRA target's merged view.
  absl::StatusOr<const float*> LoraView(const LoraTarget& t,
                                        const ParamRef& ref);
  // A LoRA target's adapter views and the experts this rank holds of it (0
  // for a linear), what both its merge and its gradient split need.
  struct LoraFactors {
    int64_t experts = 0;
    const float* a = nullptr;
    const float* b = nullptr;
  };
  absl::StatusOr<LoraFactors> LoraFactorsOf(const LoraTarget& t,
                                            const ParamRef& ref);
  // FAILED_PRECONDITION when `buffer` (a moment) does not hold the
  // parameter's elements (trim_frozen_state).
  absl::Status CheckHeld(const std::string& name, const ParamRef& ref,
                         ShardBuffer buffer) const;

  MemoryTracker* tracker_;
  ShardStoreOptions options_;
  // Gathered buffers and unsharded gradients come and go every step; reusing
  // their blocks avoids faulting fresh pages in on every Unshard. Declared
  // before units_ so it outlives their buffers.
  BufferCache cache_;
  std::vector<std::unique_ptr<UnitState>> units_;
  // The arithmetic of where every parameter lives (layout/shard_layout).
  std::vector<UnitLayout> layouts_;
  absl::flat_hash_map<std::string, ParamRef> params_;
  // LoRA-adapted weights by name (model/lora.h): viewed merged with their
  // adapters, their gradients turned into the adapters' (lora_merge.h).
  absl::flat_hash_map<std::string, LoraTarget> lora_;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_SHARDS_SHARD_STORE_H_
