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
// Placement (ShardPlacement): FSDP2's Shard(0) pads dim 0, which costs a
// rank up to a whole row of dim 0; for stacked experts [E, out, in] with E
// not dividing W that is most of the parameter (8 experts on 32 ranks: each
// rank holds a whole expert, 4x the even share). Under kAuto such a
// parameter is sharded as a flat range of its elements instead: the same
// layout with rows of one element (row_numel 1, rows = numel), so it pads
// less than one element per rank, stays contiguous in memory and in a
// checkpoint, and the worker copies it out exactly like a dim-0 parameter.
// The rule is DimZeroPadsTooMuch; 1-D and 2-D parameters never trigger it.
//
// Flat layout (Megatron-FSDP buckets): the unit's parameters are
// concatenated unpadded, the total is padded to a multiple of W, and rank r
// owns the contiguous element range [r * S, (r + 1) * S), S = padded / W.
// A parameter may straddle ranks; flat_ranges lists its pieces. The gathered
// buffer is the parameters back to back: no copy-out is needed.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "model/model_util.h"
#include "proto/plan.pb.h"

namespace shardd {

enum class ShardPlacement {
  kAuto,  // Dim 0 unless DimZeroPadsTooMuch; then a flat element range.
  kDim0,  // Always dim 0 (FSDP2-identical layouts).
};

// PlanOptions.shard_placement: "" or "auto" -> kAuto, "dim0" -> kDim0.
// Errors: INVALID_ARGUMENT naming the field and the allowed values.
absl::StatusOr<ShardPlacement> ParseShardPlacement(absl::string_view name);

// Whether sharding a parameter of `shape` on dim 0 over `world` ranks gives
// a rank more than 1.01 x its even share (numel / world) plus one innermost
// row (shape's last dimension) of elements. Never for 1-D and 2-D shapes
// (ceil(d0 / W) rows exceed d0 / W by less than one row). Expects a
// non-empty shape of dimensions >= 1 whose element count fits int64, and
// world >= 1.
bool DimZeroPadsTooMuch(const std::vector<int64_t>& shape, int64_t world);

// How a dim-0 layout shards one parameter over `world` ranks: its rows
// (dim 0's, or its elements when `placement` splits it by elements), the
// elements per row, and the rows and elements per rank (padding included).
// LayoutDim0Shards lays every parameter out by it.
struct ParamRows {
  int64_t rows = 0;
  int64_t row_numel = 0;
  int64_t rows_per_rank = 0;
  int64_t local_numel = 0;
  bool elements = false;  // Split by elements.
};
// Errors: INVALID_ARGUMENT for an empty shape, a dimension < 1, world < 1,
// or counts overflowing int64.
absl::StatusOr<ParamRows> PlaceParamRows(const std::vector<int64_t>& shape,
                                         int64_t world,
                                         ShardPlacement placement);

// Fills unit->params (replacing any), numel, shard_numel, gathered_numel and
// trainable_numel for the dim-0 layout, each parameter placed by
// `placement`. ParamLayout.dtype is the tensor's own dtype (the planner may
// override it with the master dtype). With `ep_blocks` > 1 (expert
// parallelism) every parameter's dim 0 is split into that many blocks and
// the layout is one block's over `shard_size` ranks (ep_shard): the
// per-rank fields, shard_numel and gathered_numel are a block's, numel and
// trainable_numel the tensors' own; ParamLayout.ep_blocks and FsdpUnit.ep
// say so. On error `unit` is left unchanged.
// Errors: INVALID_ARGUMENT (shard_size or ep_blocks outside [1, 2^20], an
// empty parameter list, a null tensor, a shape with no dimensions or a
// dimension < 1, a dim 0 that ep_blocks does not divide, element counts
// overflowing int64).
absl::Status LayoutDim0Shards(const std::vector<ParamRef>& params,
                              int shard_size, v1::FsdpUnit* unit,
                              ShardPlacement placement = ShardPlacement::kAuto,
                              int ep_blocks = 1);

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
