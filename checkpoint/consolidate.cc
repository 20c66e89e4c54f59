#include "checkpoint/consolidate.h"

#include <cstdint>
#include <filesystem>
#include <limits>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "checkpoint/checkpoint_index.h"
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/checkpoint_writer.h"
#include "checkpoint/safetensors.h"

namespace shardd {
namespace checkpoint {

absl::StatusOr<std::string> ConsolidateCheckpoint(
    const std::string& checkpoint_dir, const std::string& out_root) {
  SHARDD_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader,
                          CheckpointReader::Open(checkpoint_dir));
  SHARDD_RETURN_IF_ERROR(reader->VerifyAll());
  const CheckpointIndex& source = reader->index();

  // Whole tensors, in index (name) order.
  std::vector<std::vector<uint8_t>> data;
  data.reserve(source.tensors.size());
  std::vector<RankTensor> pieces;
  pieces.reserve(source.tensors.size());
  for (const auto& [name, record] : source.tensors) {
    const int64_t element_bytes = SafetensorsDTypeBytes(record.dtype);
    // ShapeNumel checks that numel * element_bytes does not overflow.
    SHARDD_ASSIGN_OR_RETURN(const int64_t numel,
                            ShapeNumel(record.shape, element_bytes));
    const int64_t bytes = numel * element_bytes;
    if (static_cast<uint64_t>(bytes) > std::numeric_limits<size_t>::max()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("tensor ", name, ": ", bytes, " bytes do not fit"));
    }
    data.emplace_back(static_cast<size_t>(bytes));
    SHARDD_RETURN_IF_ERROR(
        reader->ReadElements(name, 0, numel, data.back().data()));
    RankTensor piece;
    piece.name = name;
    piece.dtype = record.dtype;
    piece.global_shape = record.shape;
    piece.begin = 0;
    piece.end = numel;
    piece.bytes = absl::Span<const uint8_t>(data.back());
    pieces.push_back(std::move(piece));
  }

  SHARDD_ASSIGN_OR_RETURN(const std::string tmp,
                          BeginCheckpoint(out_root, source.step));
  CheckpointIndex index;
  index.step = source.step;
  index.data_position = source.data_position;
  index.saved_by.strategy = "consolidated";
  index.saved_by.world_size = 1;
  index.saved_by.mesh = {{"dp_shard", 1}};
  absl::StatusOr<std::string> committed = [&]() -> absl::StatusOr<std::string> {
    SHARDD_ASSIGN_OR_RETURN(const RankFile file,
                            WriteRankFile(tmp, /*rank=*/0, pieces));
    SHARDD_RETURN_IF_ERROR(AddRankFile(file, &index));
    return CommitCheckpoint(out_root, tmp, index);
  }();
  if (!committed.ok()) {
    std::error_code ignored;
    std::filesystem::remove_all(tmp, ignored);
  }
  return committed;
}

}  // namespace checkpoint
}  // namespace shardd
