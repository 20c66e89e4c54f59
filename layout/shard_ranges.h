#ifndef SHARDD_LAYOUT_SHARD_RANGES_H_
#define SHARDD_LAYOUT_SHARD_RANGES_H_

// Which global elements of a parameter a shard rank holds, and where they sit
// in its local shard, for both layouts: the one place of that arithmetic
// (ComputeUnitLayouts, master-shard initialisation, ShardStore's owned
// slices and the checkpoint chunks all use it):
//
//   dim-0 (FSDP2)        rank r holds rows [r * rows_per_rank,
//                        r * rows_per_rank + valid_rows[r]): one element
//                        range at the parameter's shard_offset; the padding
//                        rows after it are never saved or read (rows of
//                        RowNumel elements: dim 0's, or single elements);
//   flat (Megatron-FSDP) the piece of the parameter's flat range
//                        [unsharded_offset, + numel) that falls in rank r's
//                        bucket elements [r * S, (r + 1) * S): at most one.

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/plan.pb.h"

namespace shardd {

struct OwnedRange {
  int64_t begin = 0;  // Global flattened elements [begin, end).
  int64_t end = 0;
  int64_t shard_offset = 0;  // Element offset in the rank's local shard.
};

// The parameter's global (unsharded) shape.
std::vector<int64_t> GlobalShape(const v1::ParamLayout& param);

// Elements per sharded row of a dim-0 layout parameter: row_numel when set
// (1 for a flat element range), else numel / global_shape[0]; 0 without a
// shape. The rows are numel / RowNumel of them.
int64_t RowNumel(const v1::ParamLayout& param);
int64_t ShardedRows(const v1::ParamLayout& param);

// Expert parallelism: the blocks a dim-0 parameter is split into (1 without
// it), and the ranks each block is laid out over (padded_dim0 /
// rows_per_rank; 0 without rows). Shard rank r then holds block
// r / EpShardGroup's share of its rank r % EpShardGroup.
int EpBlocks(const v1::ParamLayout& param);
int64_t EpShardGroup(const v1::ParamLayout& param);

// Whether the placement split a dim-0 layout parameter by elements (its
// rows are not its dim 0's), and how many parameters of `plan` it split
// that way (0 for flat buckets).
bool SplitByElements(const v1::ParamLayout& param);
int ElementSplitParams(const v1::ShardingPlan& plan);

// The ranges of `param` that shard rank `shard_rank` holds in a unit whose
// local shard has `unit_shard_numel` elements, for a plan whose units are
// flat buckets when `flat`, else dim-0 sharded (valid rows computed from
// rows_per_rank and the global dim 0). Empty when the rank holds only
// padding of it, or the parameter has no shape (dim-0). For an
// expert-parallel parameter `shard_rank` is the rank among all dp_shard
// ranks (its block's ranks hold that block's rows; the ranges are global).
// Unchecked: the caller has validated the plan.
std::vector<OwnedRange> OwnedRuns(const v1::ParamLayout& param, bool flat,
                                  int64_t unit_shard_numel, int shard_rank);

namespace checkpoint {

using ::shardd::GlobalShape;
using ::shardd::OwnedRange;

// OwnedRuns for a parameter read from a checkpoint index or plan that has
// not been validated (flat when shard_dim < 0). Errors: INVALID_ARGUMENT for
// a negative rank, a dim-0 layout without an entry in valid_rows for the
// rank, a global_shape without dimensions, or a unit_shard_numel < 1.
absl::StatusOr<std::vector<OwnedRange>> OwnedElementRanges(
    const v1::ParamLayout& param, int64_t unit_shard_numel, int shard_rank);

}  // namespace checkpoint
}  // namespace shardd

#endif  // SHARDD_LAYOUT_SHARD_RANGES_H_
