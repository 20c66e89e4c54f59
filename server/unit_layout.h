#ifndef SHARDD_SERVER_UNIT_LAYOUT_H_
#define SHARDD_SERVER_UNIT_LAYOUT_H_

// Layout math of one FSDP unit over a shard group of W ranks.
//
// Dim-0 layout (FSDP2): each parameter's dim 0 is padded to
// padded_dim0 = ceil(d0 / W) * W; rank r holds rows
// [r * rows_per_rank, (r + 1) * rows_per_rank) with rows_per_rank =
// padded_dim0 / W, and only the tail ranks hold padding (a rank may hold
// nothing but padding when d0 < W). Each rank's local shard is the
// concatenation of its padded per-parameter shards, so shard_offset of
// parameter p is the sum of the local_numel of the parameters before it and
// the unit's all-gather output of W * shard_numel elements holds parameter p
// of rank r at r * shard_numel + shard_offset(p).
//
// Flat layout (Megatron-FSDP buckets): the unit's parameters are
// concatenated unpadded, the total is padded to a multiple of W, and rank r
// owns the contiguous element range [r * S, (r + 1) * S), S = padded / W.
// A parameter may straddle ranks; flat_ranges lists its pieces. The gathered
// buffer is the parameters back to back: no copy-out is needed.

#include <vector>

#include "absl/status/status.h"
#include "proto/plan.pb.h"
#include "server/model_util.h"

namespace shardd {

// Fills unit->params, numel, shard_numel, gathered_numel and trainable_numel
// for the dim-0 layout. Errors: INVALID_ARGUMENT (shard_size < 1, an empty
// parameter list, element counts overflowing int64).
absl::Status LayoutDim0Shards(const std::vector<ParamRef>& params,
                              int shard_size, v1::FsdpUnit* unit);

// Same for the flat layout; sets shard_dim = -1 and flat_ranges.
absl::Status LayoutFlatRanges(const std::vector<ParamRef>& params,
                              int shard_size, v1::FsdpUnit* unit);

}  // namespace shardd

#endif  // SHARDD_SERVER_UNIT_LAYOUT_H_
