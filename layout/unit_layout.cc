#include "layout/unit_layout.h"

#include <cstdint>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace shardd {
namespace {

// Bounds the per-parameter valid_rows list (one entry per rank) so that an
// absurd shard size is refused instead of exhausting memory.
constexpr int64_t kMaxShardSize = int64_t{1} << 20;

bool CheckedAdd(int64_t a, int64_t b, int64_t* out) {
  return !__builtin_add_overflow(a, b, out);
}

bool CheckedMul(int64_t a, int64_t b, int64_t* out) {
  return !__builtin_mul_overflow(a, b, out);
}

absl::Status Overflow(absl::string_view what, const ParamRef& param) {
  return absl::InvalidArgumentError(
      absl::StrCat(what, " of parameter '", param.fqn,
                   "' overflows int64; shapes must keep element counts "
                   "below 2^63"));
}

absl::Status CheckCommon(const std::vector<ParamRef>& params, int shard_size) {
  if (shard_size < 1 || shard_size > kMaxShardSize) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shard_size must be in [1, ", kMaxShardSize, "], got ", shard_size));
  }
  if (params.empty()) {
    return absl::InvalidArgumentError(
        "params: a unit needs at least one parameter, got none");
  }
  for (const ParamRef& param : params) {
    if (param.tensor == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter '", param.fqn, "' has no tensor"));
    }
    if (param.tensor->shape_size() < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape of parameter '", param.fqn,
                       "' must have at least one dimension"));
    }
    for (int64_t dim : param.tensor->shape()) {
      if (dim < 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("shape of parameter '", param.fqn,
                         "': every dimension must be >= 1, got ", dim));
      }
    }
  }
  return absl::OkStatus();
}

// Product of shape[first:], overflow-checked.
bool TrailingNumel(const v1::TensorSpec& tensor, int first, int64_t* out) {
  int64_t numel = 1;
  for (int i = first; i < tensor.shape_size(); ++i) {
    if (!CheckedMul(numel, tensor.shape(i), &numel)) return false;
  }
  *out = numel;
  return true;
}

void FillCommon(const ParamRef& param, v1::ParamLayout* layout) {
  layout->set_name(param.fqn);
  for (int64_t dim : param.tensor->shape()) layout->add_global_shape(dim);
  layout->set_dtype(param.tensor->dtype());
  layout->set_frozen(param.tensor->frozen());
}

}  // namespace

absl::Status LayoutDim0Shards(const std::vector<ParamRef>& params,
                              int shard_size, v1::FsdpUnit* unit) {
  if (unit == nullptr) return absl::InvalidArgumentError("unit is null");
  absl::Status status = CheckCommon(params, shard_size);
  if (!status.ok()) return status;

  const int64_t world = shard_size;
  google::protobuf::RepeatedPtrField<v1::ParamLayout> layouts;
  int64_t shard_numel = 0;
  int64_t numel_total = 0;
  int64_t trainable = 0;
  for (const ParamRef& param : params) {
    const v1::TensorSpec& tensor = *param.tensor;
    const int64_t dim0 = tensor.shape(0);
    int64_t row_numel = 0;
    if (!TrailingNumel(tensor, 1, &row_numel)) {
      return Overflow("element count", param);
    }
    int64_t numel = 0;
    if (!CheckedMul(dim0, row_numel, &numel)) {
      return Overflow("element count", param);
    }
    // ceil(dim0 / W) without forming dim0 + W - 1.
    const int64_t rows_per_rank = dim0 / world + (dim0 % world != 0 ? 1 : 0);
    int64_t padded_dim0 = 0;
    int64_t local_numel = 0;
    if (!CheckedMul(rows_per_rank, world, &padded_dim0)) {
      return Overflow("padded dim 0", param);
    }
    if (!CheckedMul(rows_per_rank, row_numel, &local_numel)) {
      return Overflow("local shard size", param);
    }

    v1::ParamLayout* layout = layouts.Add();
    FillCommon(param, layout);
    layout->set_shard_dim(0);
    layout->set_padded_dim0(padded_dim0);
    layout->set_rows_per_rank(rows_per_rank);
    layout->add_local_shape(rows_per_rank);
    for (int i = 1; i < tensor.shape_size(); ++i) {
      layout->add_local_shape(tensor.shape(i));
    }
    layout->set_local_numel(local_numel);
    layout->mutable_valid_rows()->Reserve(shard_size);
    for (int64_t r = 0; r < world; ++r) {
      // r * rows_per_rank <= padded_dim0, which did not overflow.
      const int64_t left = dim0 - r * rows_per_rank;
      layout->add_valid_rows(left <= 0              ? 0
                             : left < rows_per_rank ? left
                                                    : rows_per_rank);
    }
    layout->set_shard_offset(shard_numel);
    layout->set_unsharded_offset(numel_total);
    layout->set_numel(numel);

    if (!CheckedAdd(shard_numel, local_numel, &shard_numel)) {
      return Overflow("unit shard size at", param);
    }
    if (!CheckedAdd(numel_total, numel, &numel_total)) {
      return Overflow("unit element count at", param);
    }
    if (!tensor.frozen()) trainable += numel;  // <= numel_total: no overflow.
  }
  int64_t gathered = 0;
  if (!CheckedMul(shard_numel, world, &gathered)) {
    return absl::InvalidArgumentError(
        absl::StrCat("unit '", unit->name(),
                     "': all-gather buffer of shard_numel * shard_size "
                     "overflows int64"));
  }
  unit->mutable_params()->Swap(&layouts);
  unit->set_numel(numel_total);
  unit->set_shard_numel(shard_numel);
  unit->set_gathered_numel(gathered);
  unit->set_trainable_numel(trainable);
  return absl::OkStatus();
}

absl::Status LayoutFlatRanges(const std::vector<ParamRef>& params,
                              int shard_size, v1::FsdpUnit* unit) {
  if (unit == nullptr) return absl::InvalidArgumentError("unit is null");
  absl::Status status = CheckCommon(params, shard_size);
  if (!status.ok()) return status;

  const int64_t world = shard_size;
  // First pass: sizes and unpadded offsets, all overflow-checked.
  std::vector<int64_t> numels;
  numels.reserve(params.size());
  int64_t total = 0;
  int64_t trainable = 0;
  for (const ParamRef& param : params) {
    int64_t numel = 0;
    if (!TrailingNumel(*param.tensor, 0, &numel)) {
      return Overflow("element count", param);
    }
    numels.push_back(numel);
    if (!CheckedAdd(total, numel, &total)) {
      return Overflow("unit element count at", param);
    }
    if (!param.tensor->frozen()) trainable += numel;
  }
  // S = ceil(total / W); the padded total W * S is below total + W.
  const int64_t shard_numel = total / world + (total % world != 0 ? 1 : 0);
  int64_t gathered = 0;
  if (!CheckedMul(shard_numel, world, &gathered)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unit '", unit->name(), "': padded flat size overflows int64"));
  }

  google::protobuf::RepeatedPtrField<v1::ParamLayout> layouts;
  int64_t offset = 0;
  for (size_t p = 0; p < params.size(); ++p) {
    const ParamRef& param = params[p];
    const int64_t numel = numels[p];
    v1::ParamLayout* layout = layouts.Add();
    FillCommon(param, layout);
    layout->set_shard_dim(-1);
    layout->set_unsharded_offset(offset);
    layout->set_numel(numel);
    // The ranks whose ranges hold a piece of [offset, offset + numel); the
    // end is at most total, so none of this overflows.
    const int64_t end = offset + numel;
    layout->set_first_shard_rank(static_cast<int32_t>(offset / shard_numel));
    layout->set_last_shard_rank(static_cast<int32_t>((end - 1) / shard_numel));
    offset = end;
  }
  unit->mutable_params()->Swap(&layouts);
  unit->set_numel(total);
  unit->set_shard_numel(shard_numel);
  unit->set_gathered_numel(gathered);
  unit->set_trainable_numel(trainable);
  return absl::OkStatus();
}

std::vector<v1::FlatRange> FlatRangesOf(const v1::ParamLayout& param,
                                        int64_t shard_numel) {
  std::vector<v1::FlatRange> ranges;
  if (shard_numel < 1 || param.numel() < 1 || param.unsharded_offset() < 0) {
    return ranges;
  }
  const int64_t offset = param.unsharded_offset();
  const int64_t end = offset + param.numel();
  ranges.reserve(param.last_shard_rank() - param.first_shard_rank() + 1);
  // Pieces of [offset, end) cut at multiples of shard_numel.
  for (int64_t rank = offset / shard_numel; rank * shard_numel < end; ++rank) {
    const int64_t rank_begin = rank * shard_numel;
    const int64_t begin = offset > rank_begin ? offset : rank_begin;
    const int64_t stop =
        end < rank_begin + shard_numel ? end : rank_begin + shard_numel;
    v1::FlatRange& range = ranges.emplace_back();
    range.set_shard_rank(static_cast<int32_t>(rank));
    range.set_param_begin(begin - offset);
    range.set_param_end(stop - offset);
    range.set_shard_offset(begin - rank_begin);
  }
  return ranges;
}

}  // namespace shardd
