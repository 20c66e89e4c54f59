#ifndef SHARDD_LAYOUT_SHARD_RANGES_H_
#define SHARDD_LAYOUT_SHARD_RANGES_H_

// Which global elements of a parameter a shard rank holds, and where they sit
// in its local shard: the bridge between a plan's ParamLayout (ShardStore's
// shards) and checkpoint chunks / reads, for both layouts:
//
//   dim-0 (FSDP2)        rank r holds rows [r * rows_per_rank,
//                        r * rows_per_rank + valid_rows[r]): one element
//                        range at the parameter's shard_offset; the padding
//                        rows after it are never saved or read;
//   flat (Megatron-FSDP) the piece of the parameter's flat range on rank r
//                        (FlatRangesOf), at most one per rank.

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/plan.pb.h"

namespace shardd {
namespace checkpoint {

struct OwnedRange {
  int64_t begin = 0;  // Global flattened elements [begin, end).
  int64_t end = 0;
  int64_t shard_offset = 0;  // Element offset in the rank's local shard.
};

// The parameter's global (unsharded) shape.
std::vector<int64_t> GlobalShape(const v1::ParamLayout& param);

// The ranges of `param` held by shard rank `shard_rank` of a unit whose
// local shard has `unit_shard_numel` elements; empty when the rank holds
// none of it (only padding). Errors: INVALID_ARGUMENT for a negative rank,
// a dim-0 layout without an entry in valid_rows for the rank, a
// global_shape without dimensions, or a unit_shard_numel < 1.
absl::StatusOr<std::vector<OwnedRange>> OwnedElementRanges(
    const v1::ParamLayout& param, int64_t unit_shard_numel, int shard_rank);

}  // namespace checkpoint
}  // namespace shardd

#endif  // SHARDD_LAYOUT_SHARD_RANGES_H_
