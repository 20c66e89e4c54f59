// ReadDiffusionGemmaArchitecture (declared in moe_architecture.h): the tree
// model/hf_diffusion_gemma.cc builds, read into MoeArchitecture for the
// causal pass of gemma_layer.h.

#include <cmath>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/lora.h"
#include "model/model_util.h"
#include "worker/model/moe_architecture.h"

namespace shardd {

absl::StatusOr<MoeArchitecture> ReadDiffusionGemmaArchitecture(
    const v1::ModelSpec& model) {
  MoeArchitecture arch;
  arch.gemma = true;
  SHARDD_ASSIGN_OR_RETURN(ArchTensors tensors, ArchTensorsOf(model));
  auto take = [&](const std::string& name,
                  std::vector<int64_t> shape) -> absl::StatusOr<ArchTensor> {
    auto it = tensors.find(name);
    if (it == tensors.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "DiffusionGemma: the CPU training path needs parameter '", name,
          "'"));
    }
    if (it->second.shape != shape) {
      std::string want, got;
      for (int64_t d : shape) absl::StrAppend(&want, want.empty() ? "" : ", ", d);
      for (int64_t d : it->second.shape) {
        absl::StrAppend(&got, got.empty() ? "" : ", ", d);
      }
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter '", name, "': expected shape [", want, "], got [", got,
          "]"));
    }
    ArchTensor t = it->second;
    tensors.erase(it);
    return t;
  };
  const v1::ModelDims& dims = model.dims();
  const v1::AttentionSpec& spec = dims.attention();
  arch.vocab = dims.vocab_size();
  arch.dim = dims.hidden_size();
  SHARDD_ASSIGN_OR_RETURN(arch.pad_id, PadIdOf(dims, arch.vocab));
  const int64_t d = arch.dim;
  arch.top_k = dims.top_k();
  arch.eps = dims.rms_norm_eps() > 0 ? static_cast<float>(dims.rms_norm_eps())
                                     : 1e-6f;
  if (dims.activation() != v1::GEGLU) {
    return absl::InvalidArgumentError(
        "dims.activation: DiffusionGemma's layers compute GEGLU "
        "(gelu_pytorch_tanh)");
  }
  arch.activation = kernels::GatedActivation::kGeGLU;
  if (dims.router_scoring() != v1::ROUTER_SOFTMAX_THEN_TOPK) {
    return absl::InvalidArgumentError(
        "dims.router_scoring: DiffusionGemma's router is softmax_then_topk");
  }
  arch.router_scoring = kernels::RouterScoring::kSoftmaxThenTopK;
  arch.norm_topk_prob = dims.norm_topk_prob();
  arch.renormalize_topk = dims.norm_topk_prob();
  if (spec.bidirectional()) {
    return absl::InvalidArgumentError(
        "dims.attention.bidirectional: the CPU model computes DiffusionGemma's "
        "causal pass only (use_bidirectional_attention \"vision\"); the "
        "bidirectional sliding window is not implemented");
  }
  if (!spec.qk_norm() || !spec.v_norm() || spec.bias() || spec.sinks()) {
    return absl::InvalidArgumentError(
        "dims.attention: DiffusionGemma's layers need qk_norm and v_norm, and "
        "no bias or sinks");
  }
  if (!std::isfinite(dims.embedding_scale()) || dims.embedding_scale() < 0 ||
      !std::isfinite(dims.final_logit_softcapping()) ||
      dims.final_logit_softcapping() < 0) {
    return absl::InvalidArgumentError(
        "dims.embedding_scale / final_logit_softcapping: must be finite and "
        ">= 0");
  }
  // HF multiplies by the scale cast to the parameter dtype (fp32 here).
  arch.embedding_scale = static_cast<float>(dims.embedding_scale());
  arch.final_logit_softcap = static_cast<float>(dims.final_logit_softcapping());

  const int64_t hq = dims.num_attention_heads();
  const int64_t slide_kv = dims.num_key_value_heads();
  const int64_t slide_hd = dims.head_dim();
  const int64_t full_kv = spec.num_global_key_value_heads() > 0
                              ? spec.num_global_key_value_heads()
                              : slide_kv;
  const int64_t full_hd =
      spec.global_head_dim() > 0 ? spec.global_head_dim() : slide_hd;
  for (int64_t kv : {slide_kv, full_kv}) {
    if (hq < 1 || kv < 1 || hq % kv != 0 || slide_hd < 1 || full_hd < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dims.num_attention_heads / num_key_value_heads / head_dim / "
          "attention.num_global_key_value_heads / global_head_dim: need "
          "heads >= 1 with the kv heads dividing the query heads; got ",
          hq, ", ", slide_kv, ", ", slide_hd, ", ", full_kv, ", ", full_hd));
    }
  }
  arch.q_heads = hq;
  arch.kv_heads = slide_kv;
  arch.head_dim = slide_hd;
  arch.softmax_scale = spec.softmax_scale();
  if (!(arch.softmax_scale >= 0) || !std::isfinite(arch.softmax_scale)) {
    return absl::InvalidArgumentError(
        "dims.attention.softmax_scale: must be finite and >= 0");
  }
  arch.sliding_window = spec.sliding_window();
  arch.max_positions = spec.max_position_embeddings() > 0
                           ? spec.max_position_embeddings()
                           : int64_t{1} << 16;
  SHARDD_ASSIGN_OR_RETURN(arch.rope, ComputeRopeFrequencies(spec.rope(), full_hd));
  bool any_sliding = false;
  for (bool s : spec.sliding_layers()) any_sliding = any_sliding || s;
  if (any_sliding) {
    SHARDD_ASSIGN_OR_RETURN(
        arch.sliding_rope,
        ComputeRopeFrequencies(
            spec.has_sliding_rope() ? spec.sliding_rope() : spec.rope(),
            slide_hd));
  }
  if (arch.rope.interleaved || arch.sliding_rope.interleaved) {
    return absl::InvalidArgumentError(
        "dims.attention.rope: DiffusionGemma rotates halves, not pairs");
  }

  SHARDD_ASSIGN_OR_RETURN(arch.embed, take("model.embed_tokens.weight",
                                           {arch.vocab, d}));
  SHARDD_ASSIGN_OR_RETURN(arch.final_norm, take("model.norm.weight", {d}));
  SHARDD_ASSIGN_OR_RETURN(arch.head, take("lm_head.weight", {arch.vocab, d}));
  for (int l = 0; l < dims.num_layers(); ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    MoeLayerSpec layer;
    layer.gemma = true;
    layer.has_attention = true;
    layer.qk_norm = true;
    layer.sliding = l < spec.sliding_layers_size() && spec.sliding_layers(l);
    if (layer.sliding && arch.sliding_window < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dims.attention.sliding_window: layer ", l,
          " slides, which needs a window >= 1"));
    }
    const int64_t hd = layer.sliding ? slide_hd : full_hd;
    const int64_t kv = layer.sliding ? slide_kv : full_kv;
    layer.layer_head_dim = hd;
    layer.layer_kv_heads = kv;
    const std::string a = p + "self_attn.";
    SHARDD_ASSIGN_OR_RETURN(layer.q_proj, take(a + "q_proj.weight", {hq * hd, d}));
    SHARDD_ASSIGN_OR_RETURN(layer.k_proj, take(a + "k_proj.weight", {kv * hd, d}));
    layer.values_from_keys =
        spec.values_from_keys() && tensors.count(a + "v_proj.weight") == 0;
    if (!layer.values_from_keys) {
      SHARDD_ASSIGN_OR_RETURN(layer.v_proj,
                              take(a + "v_proj.weight", {kv * hd, d}));
    }
    SHARDD_ASSIGN_OR_RETURN(layer.o_proj, take(a + "o_proj.weight", {d, hq * hd}));
    SHARDD_ASSIGN_OR_RETURN(layer.q_norm, take(a + "q_norm.weight", {hd}));
    SHARDD_ASSIGN_OR_RETURN(layer.k_norm, take(a + "k_norm.weight", {hd}));
    SHARDD_ASSIGN_OR_RETURN(layer.norm, take(p + "input_layernorm.weight", {d}));
    SHARDD_ASSIGN_OR_RETURN(layer.post_norm,
                            take(p + "post_attention_layernorm.weight", {d}));
    SHARDD_ASSIGN_OR_RETURN(layer.pre_ff_norm,
                            take(p + "pre_feedforward_layernorm.weight", {d}));
    SHARDD_ASSIGN_OR_RETURN(layer.post_ff_norm,
                            take(p + "post_feedforward_layernorm.weight", {d}));
    SHARDD_ASSIGN_OR_RETURN(
        layer.post_ff_norm_1,
        take(p + "post_feedforward_layernorm_1.weight", {d}));
    SHARDD_ASSIGN_OR_RETURN(
        layer.pre_ff_norm_2, take(p + "pre_feedforward_layernorm_2.weight", {d}));
    SHARDD_ASSIGN_OR_RETURN(
        layer.post_ff_norm_2,
        take(p + "post_feedforward_layernorm_2.weight", {d}));
    layer.has_mlp = true;
    layer.mlp_inter = dims.dense_intermediate_size();
    SHARDD_ASSIGN_OR_RETURN(layer.mlp_gate, take(p + "mlp.gate_proj.weight",
                                                 {layer.mlp_inter, d}));
    SHARDD_ASSIGN_OR_RETURN(layer.mlp_up,
                            take(p + "mlp.up_proj.weight", {layer.mlp_inter, d}));
    SHARDD_ASSIGN_OR_RETURN(layer.mlp_down, take(p + "mlp.down_proj.weight",
                                                 {d, layer.mlp_inter}));
    layer.has_moe = true;
    layer.experts = dims.num_experts();
    layer.moe_inter = dims.moe_intermediate_size();
    if (arch.top_k < 1 || arch.top_k > layer.experts) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dims.top_k: must be in [1, ", layer.experts, "], got ", arch.top_k));
    }
    SHARDD_ASSIGN_OR_RETURN(layer.router_scale, take(p + "moe.gate.scale", {d}));
    SHARDD_ASSIGN_OR_RETURN(layer.gate,
                            take(p + "moe.gate.proj.weight", {layer.experts, d}));
    SHARDD_ASSIGN_OR_RETURN(
        layer.w_gu, take(p + "moe.experts.gate_and_up_projs",
                         {layer.experts, d, 2 * layer.moe_inter}));
    SHARDD_ASSIGN_OR_RETURN(layer.w_d, take(p + "moe.experts.down_projs",
                                            {layer.experts, layer.moe_inter, d}));
    SHARDD_ASSIGN_OR_RETURN(layer.layer_scalar, take(p + "layer_scalar", {1}));
    if (!layer.layer_scalar.frozen) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter '", p,
          "layer_scalar': must be frozen (a buffer in Hugging Face's model)"));
    }
    arch.layers.push_back(std::move(layer));
  }
  if (arch.layers.empty()) {
    return absl::InvalidArgumentError("dims.num_layers: must be >= 1");
  }
  // The causal pass never reads the self-conditioning block.
  for (auto it = tensors.begin(); it != tensors.end();) {
    if (absl::StartsWith(it->first, "model.self_conditioning.")) {
      arch.unused.push_back(it->second);
      it = tensors.erase(it);
    } else {
      ++it;
    }
  }
  if (!tensors.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "parameter '", tensors.begin()->first,
        "' is not part of DiffusionGemma's CPU training model"));
  }
  return arch;
}

absl::StatusOr<BlockDiffusionSpec> ReadBlockDiffusionSpec(
    const MoeArchitecture& arch, int64_t canvas_length,
    int64_t response_length) {
  if (canvas_length < 1) {
    return absl::InvalidArgumentError(
        "dims.canvas_length: DiffusionGemma's 3-pass step needs >= 1");
  }
  if (response_length < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "train.diffusion.response_length: must be >= 1 (0: canvas_length), "
        "got ",
        response_length));
  }
  BlockDiffusionSpec out;
  out.block = canvas_length;
  out.canvas = DiffusionCanvasRows(canvas_length, response_length);
  const std::string p = "model.self_conditioning.";
  int found = 0;
  for (const ArchTensor& t : arch.unused) {
    if (t.name == p + "pre_norm.weight") out.pre_norm = t, ++found;
    if (t.name == p + "gate_proj.weight") out.gate = t, ++found;
    if (t.name == p + "up_proj.weight") out.up = t, ++found;
    if (t.name == p + "down_proj.weight") out.down = t, ++found;
  }
  if (found != 4 || out.gate.shape.size() != 2 ||
      out.gate.shape[1] != arch.dim || out.pre_norm.numel() != arch.dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "module '", p,
        "': the 3-pass step needs pre_norm.weight [D] and gate_proj, up_proj "
        "[I, D], down_proj [D, I]"));
  }
  out.inter = out.gate.shape[0];
  return out;
}

absl::Status CheckBlockDiffusionSeq(int64_t seq, int64_t canvas) {
  if (seq > canvas) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "seq: DiffusionGemma's 3-pass step needs more than ", canvas,
      " tokens per sequence (the response: train.diffusion."
      "response_length, else canvas_length; the encoder keys before it), "
      "got ",
      seq));
}

}  // namespace shardd
