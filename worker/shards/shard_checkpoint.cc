#include "worker/shards/shard_checkpoint.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "layout/shard_ranges.h"
#include "model/model_util.h"
#include "worker/shards/shard_state_transfer.h"

namespace shardd {
namespace {

// The store keeps masters and moments in fp32 whatever the plan's dtypes.
constexpr char kStoredDType[] = "F32";

// `shards` holds the plan's units for shard rank `shard_rank`.
absl::Status CheckStore(const v1::ShardingPlan& plan, const ShardState& shards,
                        int shard_rank) {
  const int dp_shard = std::max(1, plan.mesh().dp_shard());
  if (shard_rank < 0 || shard_rank >= dp_shard) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard_rank ", shard_rank, " outside [0, ", dp_shard,
                     ") (the plan's mesh.dp_shard)"));
  }
  if (shards.num_units() != plan.units_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the shard store holds ", shards.num_units(), " units, the plan ",
        plan.units_size(), " (a store of another plan?)"));
  }
  for (int u = 0; u < plan.units_size(); ++u) {
    if (shards.buffers(u).numel != plan.units(u).shard_numel()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "units[", u, "] (", plan.units(u).name(), "): the store's shard has ",
          shards.buffers(u).numel, " elements, the plan's shard_numel is ",
          plan.units(u).shard_numel()));
    }
  }
  return absl::OkStatus();
}

// One owned range of one parameter: where it sits in the unit's shard.
struct OwnedPiece {
  int unit = 0;
  const v1::ParamLayout* param = nullptr;
  checkpoint::OwnedRange range;
};

absl::StatusOr<std::vector<OwnedPiece>> OwnedPieces(
    const v1::ShardingPlan& plan, int shard_rank) {
  std::vector<OwnedPiece> pieces;
  for (int u = 0; u < plan.units_size(); ++u) {
    const v1::FsdpUnit& unit = plan.units(u);
    for (const v1::ParamLayout& param : unit.params()) {
      SHARDD_ASSIGN_OR_RETURN(const std::vector<checkpoint::OwnedRange> ranges,
                              checkpoint::OwnedElementRanges(
                                  param, unit.shard_numel(), shard_rank));
      for (const checkpoint::OwnedRange& r : ranges) {
        if (r.begin < 0 || r.end > param.numel() || r.shard_offset < 0 ||
            r.shard_offset + (r.end - r.begin) > unit.shard_numel()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "parameter \"", param.name(), "\": owned elements [", r.begin,
              ", ", r.end, ") at shard offset ", r.shard_offset,
              " fall outside the parameter (", param.numel(),
              ") or the unit's shard (", unit.shard_numel(), ")"));
        }
        pieces.push_back({u, &param, r});
      }
    }
  }
  return pieces;
}

// The checkpoint's record of `tensor` (parameter `param` or one of its
// moments), checked against the plan.
absl::StatusOr<const checkpoint::TensorRecord*> CheckTensor(
    const checkpoint::CheckpointReader& reader, const v1::ParamLayout& param,
    const std::string& tensor, bool moment) {
  const checkpoint::TensorRecord* record = reader.FindTensor(tensor);
  if (record == nullptr) {
    if (moment) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint ", reader.dir(), " has parameter \"", param.name(),
          "\" but not its optimizer state \"", tensor,
          "\" (saved while frozen?); the parameter is trainable in this plan"));
    }
    return absl::NotFoundError(absl::StrCat("checkpoint ", reader.dir(),
                                            " has no parameter \"", tensor,
                                            "\" of the plan"));
  }
  const std::vector<int64_t> shape = checkpoint::GlobalShape(param);
  if (record->shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor \"", tensor, "\": global shape ", ShapeText(record->shape),
        " in checkpoint ", reader.dir(), " vs ", ShapeText(shape),
        " in the plan (a checkpoint of another model?)"));
  }
  if (record->dtype != kStoredDType) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor \"", tensor, "\": dtype ", record->dtype, " in checkpoint ",
        reader.dir(), " vs ", kStoredDType, " expected (fp32 master state)"));
  }
  return record;
}

}  // namespace

absl::StatusOr<checkpoint::RankFile> SaveRankShards(
    const v1::ShardingPlan& plan, const ShardState& shards,
    const std::string& tmp_dir, int shard_rank) {
  SHARDD_RETURN_IF_ERROR(CheckStore(plan, shards, shard_rank));
  if (!shards.host_memory()) {
    // A device store is written from one host copy of its state.
    SHARDD_ASSIGN_OR_RETURN(ShardStateSnapshot snapshot,
                            CaptureShardState(shards));
    return SaveRankShards(plan, SnapshotState(&snapshot), tmp_dir, shard_rank);
  }
  SHARDD_ASSIGN_OR_RETURN(const std::vector<OwnedPiece> pieces,
                          OwnedPieces(plan, shard_rank));
  std::vector<checkpoint::RankTensor> tensors;
  tensors.reserve(pieces.size() * 3);
  for (const OwnedPiece& piece : pieces) {
    const ShardBuffers shard = shards.buffers(piece.unit);
    const int64_t n = piece.range.end - piece.range.begin;
    auto add = [&](const std::string& name, const float* base) {
      checkpoint::RankTensor t;
      t.name = name;
      t.dtype = kStoredDType;
      t.global_shape = checkpoint::GlobalShape(*piece.param);
      t.begin = piece.range.begin;
      t.end = piece.range.end;
      t.bytes = absl::Span<const uint8_t>(
          reinterpret_cast<const uint8_t*>(base + piece.range.shard_offset),
          static_cast<size_t>(n) * sizeof(float));
      tensors.push_back(std::move(t));
    };
    const std::string& name = piece.param->name();
    add(name, shard.params);
    if (!piece.param->frozen()) {
      add(name + checkpoint::kExpAvgSuffix, shard.exp_avg);
      add(name + checkpoint::kExpAvgSqSuffix, shard.exp_avg_sq);
    }
  }
  return checkpoint::WriteRankFile(tmp_dir, shard_rank, tensors);
}

absl::StatusOr<int64_t> LoadRankShards(const v1::ShardingPlan& plan,
                                       ShardState* shards,
                                       checkpoint::CheckpointReader* reader,
                                       int shard_rank) {
  if (shards == nullptr || reader == nullptr) {
    return absl::InvalidArgumentError("shards and reader must not be null");
  }
  SHARDD_RETURN_IF_ERROR(CheckStore(plan, *shards, shard_rank));
  if (!shards->host_memory()) {
    // A device store: read into a host copy of its geometry, then restore
    // it in one go (the store is untouched until every read succeeded).
    ShardStateSnapshot snapshot = ZeroSnapshotLike(*shards);
    SnapshotState host(&snapshot);
    SHARDD_ASSIGN_OR_RETURN(const int64_t step,
                            LoadRankShards(plan, &host, reader, shard_rank));
    SHARDD_RETURN_IF_ERROR(RestoreShardState(snapshot, shards));
    return step;
  }
  // Every parameter (not only the owned pieces) must be in the checkpoint
  // with the plan's shape: a rank owning none of a parameter still refuses a
  // checkpoint of another model.
  for (const v1::FsdpUnit& unit : plan.units()) {
    for (const v1::ParamLayout& param : unit.params()) {
      SHARDD_RETURN_IF_ERROR(
          CheckTensor(*reader, param, param.name(), /*moment=*/false).status());
      if (param.frozen()) continue;
      for (const char* suffix :
           {checkpoint::kExpAvgSuffix, checkpoint::kExpAvgSqSuffix}) {
        SHARDD_RETURN_IF_ERROR(CheckTensor(*reader, param,
                                           param.name() + suffix,
                                           /*moment=*/true)
                                   .status());
      }
    }
  }
  SHARDD_ASSIGN_OR_RETURN(const std::vector<OwnedPiece> pieces,
                          OwnedPieces(plan, shard_rank));
  // Padding and frozen moments end up exactly zero, and no gradient of the
  // previous run survives.
  for (int u = 0; u < shards->num_units(); ++u) {
    const ShardBuffers shard = shards->buffers(u);
    const size_t bytes = static_cast<size_t>(shard.numel) * sizeof(float);
    const size_t state_bytes =
        static_cast<size_t>(shard.state_numel) * sizeof(float);
    std::memset(shard.params, 0, bytes);
    for (float* buffer : {shard.grads, shard.exp_avg, shard.exp_avg_sq}) {
      if (buffer != nullptr) std::memset(buffer, 0, state_bytes);
    }
  }
  for (const OwnedPiece& piece : pieces) {
    const ShardBuffers shard = shards->buffers(piece.unit);
    const checkpoint::OwnedRange& r = piece.range;
    const std::string& name = piece.param->name();
    SHARDD_RETURN_IF_ERROR(reader->ReadElements(name, r.begin, r.end,
                                                shard.params + r.shard_offset));
    if (piece.param->frozen()) continue;
    SHARDD_RETURN_IF_ERROR(
        reader->ReadElements(name + checkpoint::kExpAvgSuffix, r.begin, r.end,
                             shard.exp_avg + r.shard_offset));
    SHARDD_RETURN_IF_ERROR(
        reader->ReadElements(name + checkpoint::kExpAvgSqSuffix, r.begin, r.end,
                             shard.exp_avg_sq + r.shard_offset));
  }
  for (int u = 0; u < shards->num_units(); ++u) {
    SHARDD_RETURN_IF_ERROR(shards->ResetUnit(u));
  }
  return reader->index().step;
}

}  // namespace shardd
