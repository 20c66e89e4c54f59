#ifndef SHARDD_LAYOUT_UNIT_LAYOUT_H_
#define SHARDD_LAYOUT_UNIT_LAYOUT_H_

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

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "proto/plan.pb.h"
#include "model/model_util.h"

namespace shardd {

// Fills unit->params (replacing any), numel, shard_numel, gathered_numel and
// trainable_numel for the dim-0 layout. ParamLayout.dtype is the tensor's own
// dtype (the planner may override it with the master dtype). On error `unit`
// is left unchanged. Errors: INVALID_ARGUMENT (shard_size outside
// [1, 2^20], an empty parameter list, a null tensor, a shape with no
// dimensions or a dimension < 1, element counts overflowing int64).
absl::Status LayoutDim0Shards(const std::vector<ParamRef>& params,
                              int shard_size, v1::FsdpUnit* unit);

// Same for the flat layout; sets shard_dim = -1, unsharded_offset, numel and
// first_shard_rank / last_shard_rank. The per-rank fields of the dim-0 layout
// (padded_dim0, rows_per_rank, local_shape, local_numel, valid_rows,
// shard_offset) stay 0/empty: a flat parameter's per-rank share varies and is
// given by FlatRangesOf. Same errors.
absl::Status LayoutFlatRanges(const std::vector<ParamRef>& params,
                              int shard_size, v1::FsdpUnit* unit);

// The pieces of a flat-layout parameter, one per rank from first_shard_rank
// to last_shard_rank in order (shard_offset relative to that rank's shard),
// derived from unsharded_offset, numel and the unit's shard_numel. Empty for
// a parameter without elements or a shard_numel < 1.
std::vector<v1::FlatRange> FlatRangesOf(const v1::ParamLayout& param,
                                        int64_t shard_numel);

}  // namespace shardd

#endif  // SHARDD_LAYOUT_UNIT_LAYOUT_H_
