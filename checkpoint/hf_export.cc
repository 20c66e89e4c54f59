#include "checkpoint/hf_export.h"

#include <filesystem>
#include <memory>
#include <string>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/file_util.h"
#include "common/status_macros.h"
#include "google/protobuf/util/json_util.h"
#include "proto/model.pb.h"

namespace shardd {
namespace checkpoint {

absl::StatusOr<HfMoeNaming> HfNamingOf(const std::string& architecture) {
  if (architecture == "MixtralForCausalLM") return HfMoeNaming::kMixtral;
  if (architecture == "Qwen3MoeForCausalLM" ||
      architecture == "DeepseekV3ForCausalLM") {
    return HfMoeNaming::kQwen3Moe;
  }
  if (architecture == "GptOssForCausalLM") return HfMoeNaming::kGptOss;
  if (architecture == "DiffusionGemmaForBlockDiffusion") {
    return HfMoeNaming::kDiffusionGemma;
  }
  if (architecture == "LlamaForCausalLM") return HfMoeNaming::kNone;
  return absl::InvalidArgumentError(absl::StrCat(
      "architecture \"", architecture,
      "\": no Hugging Face export naming; supported: LlamaForCausalLM, "
      "MixtralForCausalLM, Qwen3MoeForCausalLM, DeepseekV3ForCausalLM, "
      "GptOssForCausalLM, DiffusionGemmaForBlockDiffusion"));
}

absl::Status ExportHfModel(const std::string& checkpoint_dir,
                           const std::string& out_dir,
                           int64_t max_shard_bytes) {
  SHARDD_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader,
                          CheckpointReader::Open(checkpoint_dir));
  const std::string& model_json = reader->index().model_spec_json;
  if (model_json.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        checkpoint_dir,
        ": the checkpoint records no model (an import or an older build's); "
        "export it with `shardctl checkpoint consolidate --hf NAMING`"));
  }
  v1::ModelSpec model;
  const auto parsed =
      google::protobuf::util::JsonStringToMessage(model_json, &model);
  if (!parsed.ok()) {
    return absl::DataLossError(absl::StrCat(checkpoint_dir,
                                            ": index.json.model: ",
                                            std::string(parsed.message())));
  }
  if (model.hf_config_json().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        checkpoint_dir, ": the model (", model.architecture(),
        ") was given as a native spec, so there is no config.json to export "
        "with it; use `shardctl checkpoint consolidate`"));
  }
  SHARDD_ASSIGN_OR_RETURN(const HfMoeNaming naming,
                          HfNamingOf(model.architecture()));
  reader.reset();
  SHARDD_RETURN_IF_ERROR(
      ExportCheckpointToHf(checkpoint_dir, naming, out_dir, max_shard_bytes));
  SHARDD_RETURN_IF_ERROR(WriteStringToFile(
      absl::StrCat(out_dir, "/config.json"), model.hf_config_json()));
  return SyncDir(out_dir);
}

}  // namespace checkpoint
}  // namespace shardd
