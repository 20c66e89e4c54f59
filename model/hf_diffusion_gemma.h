#ifndef SHARDD_MODEL_HF_DIFFUSION_GEMMA_H_
#define SHARDD_MODEL_HF_DIFFUSION_GEMMA_H_

// DiffusionGemmaForBlockDiffusion from its Hugging Face config.json (internal
// to model/, used by hf_config).

#include <string>

#include "absl/status/statusor.h"
#include "model/config_reader.h"
#include "proto/model.pb.h"

namespace shardd {
namespace hf_internal {

// Reads a DiffusionGemmaConfig: the language model under text_config (a flat
// config is read the same way), canvas_length and tie_word_embeddings at the
// top; vision_config is accepted and left out (the tree is the text stack
// NeMo AutoModel trains: one shared stack, the tied LM head, the
// self-conditioning block). Absent fields take DiffusionGemmaTextConfig's
// defaults where it has one (layer_types every 6th layer full and the last
// always full, per-layer-type rope_parameters, sliding_window 512,
// global_head_dim 512, final_logit_softcapping 30, canvas_length 256).
// Errors: INVALID_ARGUMENT naming the field and what is allowed.
absl::StatusOr<v1::ModelSpec> BuildDiffusionGemma(const ConfigReader& r,
                                                  const std::string& arch);

}  // namespace hf_internal
}  // namespace shardd

#endif  // SHARDD_MODEL_HF_DIFFUSION_GEMMA_H_
