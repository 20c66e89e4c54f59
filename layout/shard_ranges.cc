#include "layout/shard_ranges.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace shardd {

std::vector<int64_t> GlobalShape(const v1::ParamLayout& param) {
  return std::vector<int64_t>(param.global_shape().begin(),
                              param.global_shape().end());
}

int64_t RowNumel(const v1::ParamLayout& param) {
  if (param.row_numel() > 0) return param.row_numel();
  if (param.global_shape_size() == 0 || param.global_shape(0) <= 0) return 0;
  return param.numel() / param.global_shape(0);
}

int64_t ShardedRows(const v1::ParamLayout& param) {
  const int64_t row = RowNumel(param);
  return row > 0 ? param.numel() / row : 0;
}

int EpBlocks(const v1::ParamLayout& param) {
  return param.ep_blocks() > 1 ? param.ep_blocks() : 1;
}

int64_t EpShardGroup(const v1::ParamLayout& param) {
  return param.rows_per_rank() > 0
             ? param.padded_dim0() / param.rows_per_rank()
             : 0;
}

bool SplitByElements(const v1::ParamLayout& param) {
  return param.global_shape_size() > 0 && param.row_numel() > 0 &&
         ShardedRows(param) != param.global_shape(0);
}

int ElementSplitParams(const v1::ShardingPlan& plan) {
  if (plan.flat_buckets()) return 0;
  int split = 0;
  for (const v1::FsdpUnit& unit : plan.units()) {
    for (const v1::ParamLayout& param : unit.params()) {
      split += SplitByElements(param) ? 1 : 0;
    }
  }
  return split;
}

std::vector<OwnedRange> OwnedRuns(const v1::ParamLayout& param, bool flat,
                                  int64_t unit_shard_numel, int shard_rank) {
  std::vector<OwnedRange> out;
  if (flat) {
    const int64_t own = shard_rank * unit_shard_numel;
    const int64_t offset = param.unsharded_offset();
    const int64_t begin = std::max(own, offset);
    const int64_t end =
        std::min(own + unit_shard_numel, offset + param.numel());
    if (begin < end) out.push_back({begin - offset, end - offset, begin - own});
    return out;
  }
  if (param.global_shape_size() == 0 || param.global_shape(0) <= 0) return out;
  const int64_t blocks = EpBlocks(param);
  // Rows of one block (the whole parameter without expert parallelism).
  const int64_t dim0 = ShardedRows(param) / blocks;
  const int64_t row_numel = RowNumel(param);
  int64_t block = 0;
  int64_t local_rank = shard_rank;
  if (blocks > 1) {
    const int64_t group = EpShardGroup(param);
    if (group < 1) return out;
    block = shard_rank / group;
    local_rank = shard_rank % group;
    if (block >= blocks) return out;
  }
  const int64_t base = block * dim0 * row_numel;
  const int64_t first_row = local_rank * param.rows_per_rank();
  const int64_t rows = std::min(param.rows_per_rank(), dim0 - first_row);
  if (rows > 0 && row_numel > 0) {
    out.push_back({base + first_row * row_numel,
                   base + (first_row + rows) * row_numel,
                   param.shard_offset()});
  }
  return out;
}

namespace checkpoint {

absl::StatusOr<std::vector<OwnedRange>> OwnedElementRanges(
    const v1::ParamLayout& param, int64_t unit_shard_numel, int shard_rank) {
  const std::string where = absl::StrCat("parameter \"", param.name(), "\"");
  if (shard_rank < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": shard_rank ", shard_rank, " must be >= 0"));
  }
  if (unit_shard_numel < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": unit_shard_numel ", unit_shard_numel, " must be >= 1"));
  }
  if (param.global_shape_size() == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": global_shape has no dimensions"));
  }
  const bool flat = param.shard_dim() < 0;
  const int64_t ranks =
      static_cast<int64_t>(param.valid_rows_size()) * EpBlocks(param);
  if (!flat && shard_rank >= ranks) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": shard_rank ", shard_rank, " outside the ",
                     ranks, " ranks of its dim-0 layout"));
  }
  if (!flat && EpBlocks(param) > 1 &&
      (param.ep_blocks() > param.global_shape(0) ||
       param.global_shape(0) % param.ep_blocks() != 0 ||
       EpShardGroup(param) != param.valid_rows_size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": ep_blocks ", param.ep_blocks(),
        " must divide dim 0 (", param.global_shape(0),
        ") and padded_dim0 / rows_per_rank must equal its ",
        param.valid_rows_size(), " valid_rows entries"));
  }
  return OwnedRuns(param, flat, unit_shard_numel, shard_rank);
}

}  // namespace checkpoint
}  // namespace shardd
