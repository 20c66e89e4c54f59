#include "layout/unit_layout.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "model/lora.h"

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

absl::StatusOr<ShardPlacement> ParseShardPlacement(absl::string_view name) {
  if (name.empty() || name == "auto") return ShardPlacement::kAuto;
  if (name == "dim0") return ShardPlacement::kDim0;
  return absl::InvalidArgumentError(absl::StrCat(
      "shard_placement: must be \"auto\" (dim 0 unless it pads, else a flat "
      "element range) or \"dim0\" (FSDP2's Shard(0)), got \"",
      name, "\""));
}

bool DimZeroPadsTooMuch(const std::vector<int64_t>& shape, int64_t world) {
  if (shape.size() < 3 || world <= 1) return false;
  __int128 numel = 1;
  for (int64_t dim : shape) numel *= dim;
  const __int128 row = numel / shape[0];
  const __int128 rows_per_rank = (shape[0] + world - 1) / world;
  // rows_per_rank * row > 1.01 * numel / W + inner, in integers (x 100 W).
  return rows_per_rank * row * 100 * world >
         numel * 101 + static_cast<__int128>(shape.back()) * 100 * world;
}

absl::StatusOr<ParamRows> PlaceParamRows(const std::vector<int64_t>& shape,
                                         int64_t world,
                                         ShardPlacement placement) {
  if (shape.empty() || world < 1) {
    return absl::InvalidArgumentError(
        "a parameter needs a shape and a shard group of >= 1 rank");
  }
  ParamRows out;
  out.rows = shape[0];
  out.row_numel = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("every dimension must be >= 1, got ", shape[i]));
    }
    if (i > 0 && !CheckedMul(out.row_numel, shape[i], &out.row_numel)) {
      return absl::InvalidArgumentError("the element count overflows int64");
    }
  }
  int64_t numel = 0;
  if (!CheckedMul(out.rows, out.row_numel, &numel)) {
    return absl::InvalidArgumentError("the element count overflows int64");
  }
  out.elements =
      placement == ShardPlacement::kAuto && DimZeroPadsTooMuch(shape, world);
  if (out.elements) {
    out.rows = numel;
    out.row_numel = 1;
  }
  // ceil(rows / W) without forming rows + W - 1.
  out.rows_per_rank = out.rows / world + (out.rows % world != 0 ? 1 : 0);
  int64_t padded = 0;
  if (!CheckedMul(out.rows_per_rank, world, &padded) ||
      !CheckedMul(out.rows_per_rank, out.row_numel, &out.local_numel)) {
    return absl::InvalidArgumentError("the padded shard size overflows int64");
  }
  return out;
}

namespace {

// A unit holding LoRA adapters (model/lora.h) lays its trainable parameters
// out first, so each rank's trainable elements are a prefix of its shard
// and the worker holds gradients and optimizer moments for that prefix only
// (ShardStoreOptions::trim_frozen_state). Other units keep the model's
// order.
std::vector<ParamRef> TrainableFirstIfAdapted(
    const std::vector<ParamRef>& params) {
  std::vector<ParamRef> out = params;
  bool adapted = false;
  for (const ParamRef& p : params) adapted = adapted || IsLoraAdapter(p.fqn);
  if (adapted) {
    std::stable_partition(out.begin(), out.end(), [](const ParamRef& p) {
      return !p.tensor->frozen();
    });
  }
  return out;
}

}  // namespace

absl::Status LayoutDim0Shards(const std::vector<ParamRef>& model_order,
                              int shard_size, v1::FsdpUnit* unit,
                              ShardPlacement placement, int ep_blocks) {
  if (unit == nullptr) return absl::InvalidArgumentError("unit is null");
  const std::vector<ParamRef> params = TrainableFirstIfAdapted(model_order);
  absl::Status status = CheckCommon(params, shard_size);
  if (!status.ok()) return status;
  if (ep_blocks < 1 || ep_blocks > kMaxShardSize) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ep_blocks must be in [1, ", kMaxShardSize, "], got ", ep_blocks));
  }

  const int64_t world = shard_size;
  google::protobuf::RepeatedPtrField<v1::ParamLayout> layouts;
  int64_t shard_numel = 0;
  int64_t numel_total = 0;   // One block's, for unsharded_offset.
  int64_t global_total = 0;
  int64_t trainable = 0;
  for (const ParamRef& param : params) {
    const v1::TensorSpec& tensor = *param.tensor;
    // With expert parallelism each block of dim 0 is laid out on its own.
    std::vector<int64_t> shape(tensor.shape().begin(), tensor.shape().end());
    if (shape[0] % ep_blocks != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter '", param.fqn, "': dim 0 (", shape[0],
          ") must be divisible by the ", ep_blocks,
          " expert-parallel blocks it is split into"));
    }
    shape[0] /= ep_blocks;
    absl::StatusOr<ParamRows> placed =
        PlaceParamRows(shape, world, placement);
    if (!placed.ok()) return Overflow("element count", param);
    const int64_t dim0 = placed->rows;
    const int64_t row_numel = placed->row_numel;
    const int64_t numel = dim0 * row_numel;
    const int64_t rows_per_rank = placed->rows_per_rank;
    const int64_t padded_dim0 = rows_per_rank * world;
    const int64_t local_numel = placed->local_numel;
    const bool elements = placed->elements;

    v1::ParamLayout* layout = layouts.Add();
    FillCommon(param, layout);
    layout->set_shard_dim(0);
    layout->set_padded_dim0(padded_dim0);
    layout->set_rows_per_rank(rows_per_rank);
    layout->set_row_numel(row_numel);
    layout->add_local_shape(rows_per_rank);
    for (int i = 1; i < tensor.shape_size() && !elements; ++i) {
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
    // numel * ep_blocks is the tensor's element count, checked above.
    const int64_t global_numel = numel * ep_blocks;
    layout->set_numel(global_numel);
    if (ep_blocks > 1) layout->set_ep_blocks(ep_blocks);

    if (!CheckedAdd(shard_numel, local_numel, &shard_numel)) {
      return Overflow("unit shard size at", param);
    }
    if (!CheckedAdd(numel_total, numel, &numel_total) ||
        !CheckedAdd(global_total, global_numel, &global_total)) {
      return Overflow("unit element count at", param);
    }
    // <= global_total: no overflow.
    if (!tensor.frozen()) trainable += global_numel;
  }
  int64_t gathered = 0;
  if (!CheckedMul(shard_numel, world, &gathered)) {
    return absl::InvalidArgumentError(
        absl::StrCat("unit '", unit->name(),
                     "': all-gather buffer of shard_numel * shard_size "
                     "overflows int64"));
  }
  unit->mutable_params()->Swap(&layouts);
  unit->set_numel(global_total);
  unit->set_shard_numel(shard_numel);
  unit->set_ep(ep_blocks > 1 ? ep_blocks : 0);
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
