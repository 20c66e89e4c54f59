#ifndef SHARDD_LAYOUT_SHARD_LAYOUT_H_
#define SHARDD_LAYOUT_SHARD_LAYOUT_H_

// Where each parameter of an FSDP unit lives in the unit's buffers, as
// element ranges (transport- and device-free): what ShardStore copies on the
// host and DeviceShardStore enqueues on the device. Offsets count elements of
// the buffer's own dtype.
//
//   gathered buffer  [world * shard_numel]   rank r's shard at r * shard_numel
//   gradient buffer  [world * grad_chunk]    rank r's chunk at r * grad_chunk:
//                    its trainable parameters' shards back to back (dim-0), or
//                    the flat bucket's layout (flat buckets)
//   shard            [shard_numel]           this rank's master shard

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "layout/shard_ranges.h"
#include "proto/model.pb.h"
#include "layout/initial_values.h"
#include "proto/plan.pb.h"

namespace shardd {

// `count` elements from offset `src` of one buffer to offset `dst` of
// another.
struct CopySegment {
  int64_t src = 0;
  int64_t dst = 0;
  int64_t count = 0;
};

struct ParamPlacement {
  std::string name;
  int index = 0;  // In the unit's params.
  bool frozen = false;
  int64_t numel = 0;
  // Gathered buffer -> the contiguous unsharded parameter [numel]. A single
  // segment with dst 0 and count numel means the parameter is contiguous in
  // the gathered buffer (a zero-copy view is possible).
  std::vector<CopySegment> gathered;
  // The contiguous unsharded parameter -> gradient buffer; empty when
  // frozen. A single full segment means the gradient is contiguous there.
  std::vector<CopySegment> grad;
  // The elements this rank holds in its shard (OwnedRuns).
  std::vector<OwnedRange> owned;
};

struct UnitLayout {
  // The ranks the unit is gathered and reduce-scattered over: dp_shard, or
  // with expert parallelism (ep > 1) the ep_shard ranks of this rank's
  // block, which the gathered buffer and the parameters below are one
  // block of (OwnedRange stays global).
  int world = 1;
  int ep = 1;
  int block = 0;
  bool flat = false;
  int64_t shard_numel = 0;
  int64_t gathered_numel = 0;
  // Elements per rank of the unsharded gradient buffer (0: nothing
  // trainable).
  int64_t grad_chunk_numel = 0;
  std::vector<ParamPlacement> params;
  // This rank's reduced gradient chunk -> its sharded fp32 gradient.
  std::vector<CopySegment> shard_grad;
  // This rank's trainable, unpadded elements of the shard: sorted, merged
  // [begin, end) ranges (what the optimizer updates).
  std::vector<std::pair<int64_t, int64_t>> trainable_ranges;
};

// The end of the unit's last trainable range (0 without one): how much of
// the shard a store that trims frozen state (ShardStoreOptions::
// trim_frozen_state) holds gradients and moments for.
inline int64_t TrainableEnd(const UnitLayout& layout) {
  int64_t end = 0;
  for (const auto& range : layout.trainable_ranges) {
    end = range.second > end ? range.second : end;
  }
  return end;
}

// One layout per unit of `plan` for shard rank `shard_rank`.
// Errors: INVALID_ARGUMENT (shard_rank outside [0, dp_shard), a dim-0
// parameter without a shape, a parameter falling outside its unit's shard
// or gathered buffer).
absl::StatusOr<std::vector<UnitLayout>> ComputeUnitLayouts(
    const v1::ShardingPlan& plan, int shard_rank);

// Whether a post-forward reshard may keep a 1/group_size slice of a unit
// gathered over `world` ranks: group_size 0 (free everything) or a divisor
// of world in [2, world). INVALID_ARGUMENT otherwise, naming the rule.
absl::Status CheckSliceGroupSize(int group_size, int world);

// True when the placement is a single segment covering the whole
// parameter (`segments` as in ParamPlacement).
bool IsContiguous(const std::vector<CopySegment>& segments, int64_t numel);

// Writes shard rank `shard_rank`'s fp32 master shard of every unit (padding
// zero): each owned range from `values` when given, else from
// InitParamRange of param_init.h with `seed`, so every layout and world size
// starts from the same global values. `shards[u]` must hold shard_numel
// elements of unit u. Errors: INVALID_ARGUMENT (a plan parameter missing
// from `model`, shard_rank out of range, wrong number of shards); those of
// values->Read.
absl::Status InitMasterShards(const v1::ShardingPlan& plan,
                              const v1::ModelSpec& model, int shard_rank,
                              uint64_t seed, const std::vector<float*>& shards,
                              const InitialValues* values = nullptr);

}  // namespace shardd

#endif  // SHARDD_LAYOUT_SHARD_LAYOUT_H_
