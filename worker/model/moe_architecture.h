#ifndef SHARDD_WORKER_MODEL_MOE_ARCHITECTURE_H_
#define SHARDD_WORKER_MODEL_MOE_ARCHITECTURE_H_

// The training models' description of a native MoE spec, read once and
// shared by the CPU model (moe_model.h) and the GPU model
// (device_moe_model.h): the embedding, each decoder layer's norm, router,
// grouped experts and dense MLP, the final norm and the LM head, with the
// parameter names the shards know them by and their shapes.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cpu/grouped_experts.h"
#include "kernels/cpu/router.h"
#include "model/rope_frequencies.h"
#include "proto/model.pb.h"

namespace shardd {

// DeepseekV3RMSNorm(q_lora_rank) / (kv_lora_rank): HF's default eps, not
// rms_norm_eps (the CPU and GPU MLA blocks both use it).
inline constexpr float kMlaLatentNormEps = 1e-6f;

struct ArchTensor {
  std::string name;  // The tied target's name for a tied parameter.
  std::vector<int64_t> shape;
  bool frozen = false;
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

struct MoeLayerSpec {
  ArchTensor norm;  // input_layernorm
  // Self-attention, when the layer has one: x += o_proj(attn(rope(q), rope(k),
  // v)) of the normed input, then post_attention_layernorm normalises the
  // MoE / MLP input. q_proj [Hq * hd, D], k_proj and v_proj [Hkv * hd, D],
  // o_proj [D, Hq * hd]; q_norm / k_norm [hd] per head when qk_norm.
  bool has_attention = false;
  ArchTensor q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, post_norm;
  bool qk_norm = false;
  // attention_bias: q/k/v/o_proj.bias [out] (GPT-OSS, Llama with it).
  bool attention_bias = false;
  ArchTensor q_bias, k_bias, v_bias, o_bias;
  // GPT-OSS: self_attn.sinks [Hq], one learned sink logit per head.
  bool has_sinks = false;
  ArchTensor sinks;
  bool sliding = false;  // Sliding-window mask (else causal).
  // DeepSeek-V3's multi-head latent attention (MoeArchitecture's mla dims)
  // instead of q/k/v_proj: q_a_proj [Rq, D], q_a_layernorm [Rq], q_b_proj
  // [Hq * (nope + rope), Rq] (or q_proj [Hq * (nope + rope), D] when Rq is
  // 0), kv_a_proj_with_mqa [Rkv + rope, D], kv_a_layernorm [Rkv], kv_b_proj
  // [Hq * (nope + Dv), Rkv], o_proj [D, Hq * Dv]; q_a / kv_a biases and
  // o_proj's with attention_bias.
  bool mla = false;
  ArchTensor q_a_proj, q_a_norm, q_b_proj, kv_a_proj, kv_a_norm, kv_b_proj;
  ArchTensor q_a_bias, kv_a_bias;
  bool has_moe = false;
  ArchTensor gate;  // [E, D]
  ArchTensor w_gu;  // [E, D, 2I]
  ArchTensor w_d;   // [E, I, D]
  // GPT-OSS: moe.gate.bias [E]; moe.experts.gate_up_proj_bias [E, 2I] and
  // down_proj_bias [E, D].
  bool router_bias = false;
  ArchTensor gate_bias;
  // DeepSeek-V3: moe.gate.e_score_correction_bias [E], the frozen
  // selection-only bias of the sigmoid group-limited router.
  bool selection_bias = false;
  ArchTensor gate_selection_bias;
  bool expert_bias = false;
  ArchTensor b_gu, b_d;
  int64_t experts = 0;
  int64_t moe_inter = 0;
  // A dense SwiGLU branch beside the experts or alone: mlp, or DeepSeek-V3's
  // moe.shared_experts (added to the routed output the same way).
  bool has_mlp = false;
  ArchTensor mlp_gate;  // [Im, D]
  ArchTensor mlp_up;    // [Im, D]
  ArchTensor mlp_down;  // [D, Im]
  int64_t mlp_inter = 0;
  // DiffusionGemma (Gemma 4's layer, worker/model/gemma_layer.h): the
  // sandwich norms around the dense MLP (pre_feedforward_layernorm,
  // post_feedforward_layernorm_1), the experts (pre_feedforward_layernorm_2,
  // post_feedforward_layernorm_2) and their sum (post_feedforward_layernorm);
  // the router's moe.gate.scale [D] (moe.gate.proj.weight is `gate`); the
  // frozen layer_scalar [1]. Full-attention layers have no v_proj
  // (values_from_keys) and their own head geometry.
  bool gemma = false;
  ArchTensor pre_ff_norm, post_ff_norm_1, pre_ff_norm_2, post_ff_norm_2,
      post_ff_norm, router_scale, layer_scalar;
  bool values_from_keys = false;
  int64_t layer_kv_heads = 0, layer_head_dim = 0;
};

struct MoeArchitecture {
  int64_t vocab = 0;
  int64_t dim = 0;
  // dims.pad_token_id: the embedding row that lookups pass no gradient to
  // (torch.nn.Embedding's padding_idx); -1: none.
  int64_t pad_id = -1;
  int top_k = 0;
  float eps = 1e-6f;
  kernels::GatedActivation activation = kernels::GatedActivation::kSwiGLU;
  // kClampedSwiGLU's limit and alpha (dims.swiglu_limit / swiglu_alpha).
  float swiglu_limit = 7.0f;
  float swiglu_alpha = 1.702f;
  // dims.router_scoring.
  kernels::RouterScoring router_scoring =
      kernels::RouterScoring::kSoftmaxThenTopK;
  ArchTensor embed;
  ArchTensor final_norm;
  ArchTensor head;  // May name the embedding when tied.
  std::vector<MoeLayerSpec> layers;
  // Attention geometry (when any layer has attention).
  int64_t q_heads = 0, kv_heads = 0, head_dim = 0;
  int64_t sliding_window = 0;
  int64_t max_positions = 0;
  RopeFrequencies rope;  // Over rope_head_dim for MLA.
  // dims.attention.softmax_scale (0: head_dim^-0.5).
  double softmax_scale = 0.0;
  // MLA (dims.attention.mla): head_dim = nope + rope for q and k, v_head_dim
  // for v; kv_heads = q_heads.
  bool mla = false;
  int64_t q_lora_rank = 0, kv_lora_rank = 0, nope_head_dim = 0,
          rope_head_dim = 0, v_head_dim = 0;
  // kSigmoidGroupLimited's groups, kept groups and weight scale.
  int64_t router_groups = 1, router_top_groups = 1;
  float routed_scaling_factor = 1.0f;
  // dims.norm_topk_prob, and what the routers do: divide the top-k weights
  // by their sum.
  bool norm_topk_prob = false;
  bool renormalize_topk = true;
  // dims.router_aux_loss_coef (0: no load-balancing loss); when > 0, every
  // MoE layer has aux_experts experts and a softmax router.
  double router_aux_loss_coef = 0.0;
  int64_t aux_experts = 0;
  // DiffusionGemma's causal pass (gemma_layer.h): the embedding times
  // embedding_scale (0: none), the logits soft-capped (0: none), the
  // sliding layers' rope (`rope` is the full layers'), and the parameters
  // that pass leaves unused (model.self_conditioning: no gradient).
  bool gemma = false;
  float embedding_scale = 0.0f;
  float final_logit_softcap = 0.0f;
  RopeFrequencies sliding_rope;
  std::vector<ArchTensor> unused;

  bool aux_on() const { return router_aux_loss_coef > 0; }

  // The router of `layer` over t tokens, as both models configure it.
  kernels::RouterDims RouterDimsOf(const MoeLayerSpec& layer,
                                   int64_t t) const {
    kernels::RouterDims dims{t, dim, layer.experts, top_k, renormalize_topk};
    dims.scoring = router_scoring;
    dims.groups = router_groups;
    dims.top_groups = router_top_groups;
    dims.scale = routed_scaling_factor;
    dims.keep_softmax = aux_on();
    return dims;
  }
  // The clamped activation's constants (no biases).
  kernels::ExpertOptions ExpertOptions() const {
    kernels::ExpertOptions options;
    options.alpha = swiglu_alpha;
    options.limit = swiglu_limit;
    return options;
  }

  // layers[l].has_moe for every l (the command order's layer table).
  std::vector<bool> LayersWithExperts() const {
    std::vector<bool> out;
    for (const MoeLayerSpec& layer : layers) out.push_back(layer.has_moe);
    return out;
  }
};

// Reads the spec's architecture: model.embed_tokens.weight [V, D],
// model.layers.N.{input_layernorm, moe.gate, moe.experts, mlp}, model.norm,
// lm_head, of a spec that passed ValidateModelSpec, with GPT-OSS's
// attention biases and sinks, router bias and expert biases where the spec
// has them (or dims.attention says so), and DeepSeek-V3's MLA, sigmoid
// group-limited router with its frozen selection bias and shared experts.
// Errors: INVALID_ARGUMENT for a
// missing or misshapen parameter (naming it and the expected shape), a
// layer without experts or an MLP, dims.top_k outside [1, experts],
// SWIGLU_OAI without a positive swiglu_limit / swiglu_alpha, a
// dims.router_aux_loss_coef that is negative or not finite, or > 0 on a
// model without MoE layers, with layers of different expert counts or with
// the sigmoid router (Hugging Face's loss softmaxes the logits), or a
// parameter the model does not use.
absl::StatusOr<MoeArchitecture> ReadMoeArchitecture(const v1::ModelSpec& model);

// dims.pad_token_id as MoeArchitecture::pad_id (-1 when unset). Errors:
// INVALID_ARGUMENT naming dims.pad_token_id when it is outside [0, vocab).
absl::StatusOr<int64_t> PadIdOf(const v1::ModelDims& dims, int64_t vocab);

// Every parameter of `model` as the architecture readers take them, by
// name: tied names resolved, LoRA adapters left out (they enter through
// their weight's merged view), and a LoRA-adapted weight not frozen (its
// gradient is computed; the parameter source turns it into the adapters',
// worker/shards/lora_merge.h). Errors: LoraTargetsOf's.
using ArchTensors = std::map<std::string, ArchTensor>;
absl::StatusOr<ArchTensors> ArchTensorsOf(const v1::ModelSpec& model);

// DiffusionGemmaForBlockDiffusion's shared stack (model/hf_diffusion_gemma's
// tree), read by ReadMoeArchitecture: every layer `gemma`, with attention
// (per-layer-type geometry from dims.attention), the dense mlp and the MoE.
// Errors: INVALID_ARGUMENT for a missing or misshapen parameter, an
// unfrozen layer_scalar, dims.attention.bidirectional (the bidirectional
// sliding window is not computed), or attention fields it needs unset.
absl::StatusOr<MoeArchitecture> ReadDiffusionGemmaArchitecture(
    const v1::ModelSpec& model);

// DiffusionGemma's block-diffusion step (docs/model-spec.md), for the CPU
// and the GPU model alike: the self-conditioning block's parameters
// (model.self_conditioning.*, which the causal pass leaves in `unused`) and
// the canvas geometry.
struct BlockDiffusionSpec {
  ArchTensor pre_norm, gate, up, down;
  int64_t inter = 0;   // The self-conditioning MLP's width.
  int64_t canvas = 0;  // Canvas rows per sequence (the response).
  int64_t block = 0;   // Rows per decode block (canvas_length).
};

// The canvas rows per sequence of DiffusionGemma's block-diffusion step:
// `response_length`, or one block of `canvas_length` when it is 0.
inline int64_t DiffusionCanvasRows(int64_t canvas_length,
                                   int64_t response_length) {
  return response_length > 0 ? response_length : canvas_length;
}

// The response is the last `response_length` tokens (0: canvas_length),
// cut into blocks of canvas_length. Errors: INVALID_ARGUMENT for
// canvas_length < 1 (naming dims.canvas_length), a negative response_length
// (naming train.diffusion.response_length), or a missing or misshapen
// self-conditioning parameter (naming the module and the shapes it needs).
absl::StatusOr<BlockDiffusionSpec> ReadBlockDiffusionSpec(
    const MoeArchitecture& arch, int64_t canvas_length,
    int64_t response_length);

// INVALID_ARGUMENT (naming seq) unless a sequence of `seq` tokens holds the
// canvas of `canvas` rows and at least one encoder key before it.
absl::Status CheckBlockDiffusionSeq(int64_t seq, int64_t canvas);

// INVALID_ARGUMENT unless passes >= 1, 0 <= no_grad_passes < passes and
// microbatches >= 1.
absl::Status CheckModelStepShape(int passes, int no_grad_passes,
                                 int microbatches);

}  // namespace shardd

#endif  // SHARDD_WORKER_MODEL_MOE_ARCHITECTURE_H_
