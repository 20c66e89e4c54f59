#include "layout/shard_ranges.h"

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "layout/unit_layout.h"

namespace shardd {
namespace checkpoint {

std::vector<int64_t> GlobalShape(const v1::ParamLayout& param) {
  return std::vector<int64_t>(param.global_shape().begin(),
                              param.global_shape().end());
}

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
  std::vector<OwnedRange> out;
  if (param.shard_dim() < 0) {
    for (const v1::FlatRange& r : FlatRangesOf(param, unit_shard_numel)) {
      if (r.shard_rank() == shard_rank) {
        out.push_back({r.param_begin(), r.param_end(), r.shard_offset()});
      }
    }
    return out;
  }
  if (shard_rank >= param.valid_rows_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": shard_rank ", shard_rank, " outside the ",
                     param.valid_rows_size(), " ranks of its dim-0 layout"));
  }
  const int64_t dim0 = param.global_shape(0);
  const int64_t row_numel = dim0 > 0 ? param.numel() / dim0 : 0;
  const int64_t rows = param.valid_rows(shard_rank);
  if (rows > 0 && row_numel > 0) {
    const int64_t first_row = shard_rank * param.rows_per_rank();
    out.push_back({first_row * row_numel, (first_row + rows) * row_numel,
                   param.shard_offset()});
  }
  return out;
}

}  // namespace checkpoint
}  // namespace shardd
