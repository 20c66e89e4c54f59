#ifndef SHARDD_CHECKPOINT_HF_EXPORT_H_
#define SHARDD_CHECKPOINT_HF_EXPORT_H_

// A committed shardd checkpoint as a Hugging Face model directory
// (`shardctl checkpoint export --hf OUT`): the fp32 master parameters as
// safetensors under the architecture's Hugging Face names and layouts, and
// the config.json the model was read from. `shardctl train --model OUT
// --init-from OUT` starts from exactly these values (checkpoint/hf_weights.h
// reads them back bit for bit).

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "checkpoint/hf_interop.h"

namespace shardd {
namespace checkpoint {

// The Hugging Face naming of an architecture's MoE tensors: Mixtral ->
// kMixtral; Qwen3-MoE, DeepSeek-V3 -> kQwen3Moe; GPT-OSS -> kGptOss;
// DiffusionGemma -> kDiffusionGemma; Llama -> kNone. Errors: INVALID_ARGUMENT naming the architecture and those
// supported.
absl::StatusOr<HfMoeNaming> HfNamingOf(const std::string& architecture);

// Writes the parameters of the committed checkpoint `checkpoint_dir` (all
// files verified first) into `out_dir` (created if missing): model.safetensors,
// or shards of at most max_shard_bytes (> 0) with an index, plus config.json.
// Errors: FAILED_PRECONDITION (the checkpoint records no model, e.g. an
// import or a checkpoint of an older build: export with `checkpoint
// consolidate --hf NAMING` instead); INVALID_ARGUMENT (a model given as a
// native spec, which has no config.json; an architecture HfNamingOf does
// not name); those of ExportCheckpointToHf and of writing config.json.
absl::Status ExportHfModel(const std::string& checkpoint_dir,
                           const std::string& out_dir,
                           int64_t max_shard_bytes = 0);

}  // namespace checkpoint
}  // namespace shardd

#endif  // SHARDD_CHECKPOINT_HF_EXPORT_H_
