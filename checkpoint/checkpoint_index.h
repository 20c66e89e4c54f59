#ifndef SHARDD_CHECKPOINT_CHECKPOINT_INDEX_H_
#define SHARDD_CHECKPOINT_CHECKPOINT_INDEX_H_

// index.json: what a checkpoint holds and where (DCP-style metadata).
//
// A checkpoint directory holds one safetensors file per saving rank and
// index.json, written last. For every tensor (a parameter, or its AdamW
// state under name + "/exp_avg" and name + "/exp_avg_sq") the index records
// the global shape and dtype and a list of chunks: each chunk is a tensor in
// one file holding the global flattened (row-major) element range
// [begin, end). A dim-0 row shard (rows [a, b) of the valid, unpadded rows)
// is the element range [a * row_numel, b * row_numel); a Megatron-FSDP flat
// range is an element range as it is. The chunks of a tensor are disjoint
// and cover it exactly, so a loader in any world size and strategy reads, for
// the range it owns, just the overlapping bytes of the overlapping chunks.
//
//   {
//     "format": "shardd-checkpoint", "format_version": 1,
//     "step": 123,
//     "data_position": {"samples": 7872, "step": 123},
//     "saved_by": {"strategy": "fsdp2", "world_size": 4,
//                  "mesh": {"dp_replicate": 1, "dp_shard": 4}},
//     "files": [{"name": "rank-00000.safetensors", "size": 4096,
//                "xxh64": "0123456789abcdef"}, ...],
//     "tensors": {
//       "model.norm.weight": {"dtype": "F32", "shape": [64], "chunks": [
//         {"file": "rank-00000.safetensors", "tensor": "model.norm.weight",
//          "begin": 0, "end": 16}, ...]}, ...}
//   }

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardd {
namespace checkpoint {

inline constexpr char kIndexFileName[] = "index.json";
inline constexpr char kIndexFormat[] = "shardd-checkpoint";
inline constexpr int kIndexFormatVersion = 1;
// Largest index.json read (bytes).
inline constexpr int64_t kMaxIndexBytes = int64_t{1} << 31;

// AdamW state of parameter `name` is stored as these tensors.
inline constexpr char kExpAvgSuffix[] = "/exp_avg";
inline constexpr char kExpAvgSqSuffix[] = "/exp_avg_sq";

// One file of the checkpoint.
struct FileRecord {
  std::string name;  // Plain file name inside the checkpoint directory.
  int64_t size_bytes = 0;
  uint64_t xxh64 = 0;  // XXH64, seed 0, of the whole file.
};

// One piece of a tensor: tensor `tensor` in file `file` holds the global
// flattened elements [begin, end) of it.
struct ChunkRecord {
  std::string file;
  std::string tensor;
  int64_t begin = 0;
  int64_t end = 0;
};

struct TensorRecord {
  std::string dtype;                // Safetensors tag ("F32", "BF16", ...).
  std::vector<int64_t> shape;       // Global shape.
  std::vector<ChunkRecord> chunks;  // Sorted by begin once validated.
};

// Who saved the checkpoint (informational: loading never depends on it).
struct SavedBy {
  std::string strategy;  // e.g. "fsdp2", "megatron_fsdp".
  int64_t world_size = 0;
  std::map<std::string, int64_t> mesh;  // e.g. {"dp_shard": 4}.
};

struct CheckpointIndex {
  int format_version = kIndexFormatVersion;
  // Completed optimizer steps (AdamW's bias-correction count).
  int64_t step = 0;
  // Where the data stream resumes; opaque to the checkpoint.
  std::map<std::string, int64_t> data_position;
  SavedBy saved_by;
  // The model the state belongs to (v1::ModelSpec as proto JSON, one
  // object); empty when unknown (an import, an older checkpoint).
  // `shardctl checkpoint export --hf` names tensors and writes config.json
  // from it.
  std::string model_spec_json;
  // The job's training config (v1::TrainConfig as proto JSON, one object):
  // a job resumed from the checkpoint continues its learning-rate schedule;
  // empty when unknown.
  std::string train_config_json;
  std::vector<FileRecord> files;
  std::map<std::string, TensorRecord> tensors;
};

// Checks an index: a supported format_version; step >= 0; file names plain
// (no "/" or "..", not index.json) and unique, sizes >= 0; every tensor with
// a non-empty name, a known dtype, a shape of non-negative dimensions; its
// chunks naming a listed file and a non-empty in-file tensor, ranges
// 0 <= begin < end <= numel, pairwise disjoint and together covering every
// element exactly once. Sorts each tensor's chunks by begin. Errors:
// INVALID_ARGUMENT naming the tensor / chunk / file and what is wrong.
absl::Status ValidateIndex(CheckpointIndex* index);

// Validates (as above) and serializes as pretty-printed JSON. Errors:
// those of ValidateIndex; INVALID_ARGUMENT for a name that is not UTF-8 or
// a model_spec_json or train_config_json that is not one JSON object.
absl::StatusOr<std::string> SerializeIndex(CheckpointIndex index);

// Parses and validates index.json text. Errors: DATA_LOSS for malformed
// JSON, a missing or mistyped field, an unknown field, or any ValidateIndex
// failure (message names the field); UNIMPLEMENTED for a format_version
// newer than this build reads.
absl::StatusOr<CheckpointIndex> ParseIndex(absl::string_view text);

// Global element range of rows [row_begin, row_end) of a tensor of `shape`
// (dim 0 rows, row-major). Errors: INVALID_ARGUMENT for a scalar shape or a
// row range outside [0, shape[0]].
struct ElementRange {
  int64_t begin = 0;
  int64_t end = 0;
};
absl::StatusOr<ElementRange> RowsToElements(const std::vector<int64_t>& shape,
                                            int64_t row_begin, int64_t row_end);

}  // namespace checkpoint
}  // namespace shardd

#endif  // SHARDD_CHECKPOINT_CHECKPOINT_INDEX_H_
