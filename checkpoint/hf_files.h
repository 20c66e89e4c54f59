#ifndef SHARDD_CHECKPOINT_HF_FILES_H_
#define SHARDD_CHECKPOINT_HF_FILES_H_

// The files of a Hugging Face safetensors checkpoint, opened (headers only):
// a single model.safetensors, or model-0000K-of-0000N.safetensors files
// listed by model.safetensors.index.json ({"weight_map": {tensor: file}}).

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "checkpoint/safetensors.h"

namespace shardd {
namespace checkpoint {

inline constexpr char kHfIndexFileName[] = "model.safetensors.index.json";
inline constexpr char kHfSingleFileName[] = "model.safetensors";

struct HfTensorRef {
  const SafetensorsReader* file = nullptr;
  const SafetensorsEntry* entry = nullptr;
};

struct HfCheckpointFiles {
  std::string path;  // As given to OpenHfCheckpoint.
  std::vector<std::unique_ptr<SafetensorsReader>> files;
  std::map<std::string, HfTensorRef> tensors;  // By tensor name.
};

// Opens the checkpoint at `path`: a .safetensors file, an index .json, or a
// directory holding either (the index preferred). Errors: NOT_FOUND (no
// checkpoint at `path`); INVALID_ARGUMENT (a weight_map file name with "/"
// or ".."); DATA_LOSS (a malformed index or safetensors header, a tensor the
// weight_map puts in a file that lacks it, a tensor in a file the
// weight_map does not list there, a tensor in two files); the errors of
// SafetensorsReader::Open.
absl::StatusOr<HfCheckpointFiles> OpenHfCheckpoint(const std::string& path);

}  // namespace checkpoint
}  // namespace shardd

#endif  // SHARDD_CHECKPOINT_HF_FILES_H_
