#ifndef SHARDD_CHECKPOINT_PEFT_ADAPTERS_H_
#define SHARDD_CHECKPOINT_PEFT_ADAPTERS_H_

// LoRA adapters (model/lora.h) as Hugging Face PEFT saves them: a directory
// holding adapter_model.safetensors and adapter_config.json that
// `PeftModel.from_pretrained(base, DIR)` loads onto a transformers-5 model
// (verified with peft 0.21.2, transformers 5.17). `shardctl checkpoint
// export --hf OUT` writes one for a LoRA checkpoint; PeftAdapters reads one
// back as the initial values of a job's adapters.
//
// Names (PEFT's keys are "base_model.model." + the module path in the
// transformers-5 model; shardd's moe.* is transformers' mlp.*):
//
//   linear M (weight [out, in]):   M.lora_A.weight [R, in]
//                                  M.lora_B.weight [out, R]
//     as shardd's M.lora_{A,B}.weight, bytes unchanged.
//   experts, model.layers.L.moe.experts.{gate_and_up_projs,down_projs}
//   (transformers: mlp.experts.gate_up_proj [E, 2I, D], down_proj
//   [E, D, I], i.e. [E, out, in]): PEFT wraps each targeted nn.Parameter in
//   a ParamWrapper; two on one module nest in parameter order, so
//   gate_up_proj's wrapper is the inner one, the outer one's base_layer:
//     mlp.experts.base_layer.lora_A.weight [E*R, D]   (gate_up_proj)
//     mlp.experts.base_layer.lora_B.weight [2I, R*E]
//     mlp.experts.lora_A.weight            [E*R, I]   (down_proj)
//     mlp.experts.lora_B.weight            [D, R*E]
//   (without base_layer when only one of the two is targeted). PEFT's
//   ParamWrapper.get_delta_weight reads lora_A as (E, R, in): the bytes of
//   shardd's A [E, R, in]; and lora_B as (out, R, E): PEFT's B[o, r*E + e]
//   is shardd's B[e][o, r]. Per expert the delta is scale * B[e] @ A[e],
//   [out, in], added to transformers' weight [E, out, in].
//
// adapter_config.json: peft_type LORA, task_type CAUSAL_LM, r, lora_alpha,
// lora_dropout 0, bias "none", use_rslora / use_dora / fan_in_fan_out
// false, target_modules (the adapted linears' names) and target_parameters
// ("mlp.experts.gate_up_proj", "mlp.experts.down_proj" for "experts").
// On a model whose transformers type has a v4 -> v5 weight conversion
// (qwen3_moe, deepseek_v3, mixtral), PEFT rewrites target_modules entries
// that named v4's per-expert linears and router (gate_proj, up_proj,
// down_proj, gate; Mixtral w1, w2, w3, gate) into expert target_parameters
// (with a doubled rank for gate_up_proj) and then no longer adapts the
// dense MLPs or shared experts of those names. Such linears are therefore
// listed as target_parameters by their path in the layer plus ".weight"
// ("mlp.gate_proj.weight", "mlp.shared_experts.down_proj.weight",
// "mlp.gate.weight" for a router): PEFT adapts a 2-D parameter with the same
// lora_A / lora_B keys, shapes and delta as a targeted module.
//
// DiffusionGemmaForBlockDiffusion: transformers runs shardd's one stack as
// two module trees with tied weights, so every layer adapter is written
// under model.decoder.layers.L.* and model.encoder.language_model.layers.L.*
// (moe.experts -> experts, moe.gate -> router) with equal values (read
// back: both required and equal), the self-conditioning's under
// model.decoder.self_conditioning.*; target_modules is a regex over those
// paths (the vision tower has q_proj too) and task_type null. shardd's
// down_projs hold router.per_expert_scale folded in (as NeMo's); the
// adapter B of that folded weight is transformers' B[e] times
// scale[e]: divided on export (base_dir, the Hugging Face base), multiplied
// on import (Open's `scales`).
//
// Supported: LlamaForCausalLM, Qwen3MoeForCausalLM, DeepseekV3ForCausalLM,
// MixtralForCausalLM (transformers 5 names Mixtral's MoE mlp.* too),
// DiffusionGemmaForBlockDiffusion.

#include <cstdint>
#include <map>
#include <memory>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "checkpoint/safetensors.h"
#include "layout/initial_values.h"
#include "proto/model.pb.h"

namespace shardd {
namespace checkpoint {

inline constexpr char kPeftWeightsFileName[] = "adapter_model.safetensors";
inline constexpr char kPeftConfigFileName[] = "adapter_config.json";

// Whether the committed checkpoint `checkpoint_dir` records a model with
// LoRA adapters (false when it records no model). Errors: those of
// CheckpointReader::Open; DATA_LOSS for a recorded model that does not
// parse.
absl::StatusOr<bool> CheckpointHasLora(const std::string& checkpoint_dir);

// Writes the LoRA adapters of the committed checkpoint `checkpoint_dir`
// (their fp32 master values; the files holding them verified first) as a
// PEFT adapter directory `out_dir`: adapter_model.safetensors (F32) and
// adapter_config.json. The files are written into a temporary directory
// beside out_dir, which is then renamed to out_dir, so out_dir appears
// complete or not at all. `base_dir`: the Hugging Face base the job
// started from, read for DiffusionGemma's per-expert scales when its
// experts' down_projs are adapted (INVALID_ARGUMENT naming --base without
// it; INVALID_ARGUMENT for a zero scale under a trained B). Errors:
// FAILED_PRECONDITION (the checkpoint
// records no model, or a model without LoRA: export it with ExportHfModel);
// UNIMPLEMENTED naming the architecture when PEFT export is not supported
// for it; INVALID_ARGUMENT (the recorded model's adapters disagree with its
// lora, as LoraTargetsOf checks); ALREADY_EXISTS (out_dir exists and is not
// an empty directory); DATA_LOSS (the recorded model does not parse, an
// adapter missing from the checkpoint or of another shape, a file failing
// verification); those of CheckpointReader and of writing the files.
absl::Status ExportPeftAdapters(const std::string& checkpoint_dir,
                                const std::string& out_dir,
                                const std::string& base_dir = "");

// A PEFT adapter directory as the initial values of the adapters of
// `model`, a spec rewritten by ApplyLora. Reads only the ranges asked for,
// converting F32, BF16 or F16 to fp32 and PEFT's expert layouts back to
// shardd's. Parameters other than the adapters are not provided (they come
// from the base model's source).
class PeftAdapters final : public InitialValues {
 public:
  // Opens `dir`'s adapter_config.json and adapter_model.safetensors (the
  // header only) and binds every adapter of `model`. Errors: NOT_FOUND (a
  // file missing); DATA_LOSS (adapter_config.json is not a JSON object; a
  // malformed safetensors file); UNIMPLEMENTED (the model's architecture,
  // as ExportPeftAdapters); INVALID_ARGUMENT: `model` has no LoRA adapters;
  // adapter_config.json's field that disagrees with the job's LoRA, named
  // with both values (peft_type, r, lora_alpha, target_modules,
  // target_parameters) or that shardd does not implement (use_rslora,
  // use_dora, lora_bias, fan_in_fan_out, rank_pattern, alpha_pattern);
  // an adapter tensor missing from adapter_model.safetensors, of another
  // shape (both given) or of a dtype other than F32, BF16, F16, or a tensor
  // no adapter of the model reads, each named.
  // `scales` gives the per-expert factors the base folded into a stacked
  // expert parameter (HfWeights::ExpertScales); DiffusionGemma's down_projs
  // adapters need it (FAILED_PRECONDITION without).
  using ExpertScaleFn = std::function<absl::StatusOr<std::vector<float>>(
      const std::string& base_param)>;
  static absl::StatusOr<std::unique_ptr<PeftAdapters>> Open(
      const std::string& dir, const v1::ModelSpec& model,
      const ExpertScaleFn& scales = nullptr);

  // True exactly for the adapter parameters of the model Open bound.
  bool Provides(const std::string& name) const override;

  // Elements [begin, end) of adapter `name` in shardd's layout. Errors:
  // NOT_FOUND (not an adapter of the model, see Provides); OUT_OF_RANGE
  // (begin/end outside the tensor); DATA_LOSS / INTERNAL (the file shrank,
  // an I/O error), each naming the parameter.
  absl::Status Read(const std::string& name, const v1::TensorSpec& tensor,
                    int64_t begin, int64_t end, float* out) const override;

  const std::string& dir() const { return dir_; }

 private:
  struct Binding {
    const SafetensorsEntry* entry = nullptr;
    int64_t numel = 0;
    // An expert lora_B: shardd [E, out, R] from PEFT's [out, R*E].
    bool experts_b = false;
    int64_t experts = 0;
    int64_t out = 0;
    int64_t rank = 0;
    std::vector<float> scale;  // Per expert, for a scaled lora_B.
  };

  PeftAdapters() = default;
  absl::Status ReadExpertsB(const Binding& b, int64_t begin, int64_t end,
                            float* out) const;

  std::string dir_;
  std::unique_ptr<SafetensorsReader> file_;
  std::map<std::string, Binding> bindings_;  // By shardd name.
};

}  // namespace checkpoint
}  // namespace shardd

#endif  // SHARDD_CHECKPOINT_PEFT_ADAPTERS_H_
