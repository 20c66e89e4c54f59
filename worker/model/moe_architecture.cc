#include "worker/model/moe_architecture.h"

#include <cmath>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "model/lora.h"
#include "model/model_util.h"

namespace shardd {
namespace {

absl::Status Expect(bool ok, absl::string_view what) {
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(what);
}

using TakeFn = std::function<absl::StatusOr<ArchTensor>(
    const std::string&, std::vector<int64_t>)>;

// DeepSeek-V3's multi-head latent attention of layer l, with the geometry
// from dims.attention.mla.
absl::Status ReadMlaLayer(const v1::ModelDims& dims, int l, const TakeFn& take,
                          MoeArchitecture* arch, MoeLayerSpec* layer) {
  const v1::MlaSpec& mla = dims.attention().mla();
  const int64_t hq = dims.num_attention_heads(), d = arch->dim;
  const int64_t rq = mla.q_lora_rank(), rkv = mla.kv_lora_rank();
  const int64_t nope = mla.qk_nope_head_dim(), rope = mla.qk_rope_head_dim();
  const int64_t dv = mla.v_head_dim();
  if (hq < 1 || rq < 0 || rkv < 1 || nope < 1 || rope < 2 || rope % 2 != 0 ||
      dv < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dims.attention.mla: layer ", l,
        " has latent attention (kv_a_proj_with_mqa), which needs "
        "num_attention_heads >= 1, q_lora_rank >= 0, kv_lora_rank >= 1, "
        "qk_nope_head_dim >= 1, an even qk_rope_head_dim >= 2 and "
        "v_head_dim >= 1; got ",
        hq, ", ", rq, ", ", rkv, ", ", nope, ", ", rope, ", ", dv));
  }
  arch->mla = true;
  arch->q_heads = hq;
  arch->kv_heads = hq;  // k_rope is broadcast to every head.
  arch->head_dim = nope + rope;
  arch->q_lora_rank = rq;
  arch->kv_lora_rank = rkv;
  arch->nope_head_dim = nope;
  arch->rope_head_dim = rope;
  arch->v_head_dim = dv;
  layer->has_attention = true;
  layer->mla = true;
  const std::string p = absl::StrCat("model.layers.", l, ".self_attn.");
  const int64_t qk = nope + rope;
  const bool bias = dims.attention().bias();
  if (rq > 0) {
    SHARDD_ASSIGN_OR_RETURN(layer->q_a_proj, take(p + "q_a_proj.weight", {rq, d}));
    SHARDD_ASSIGN_OR_RETURN(layer->q_a_norm, take(p + "q_a_layernorm.weight", {rq}));
    SHARDD_ASSIGN_OR_RETURN(layer->q_b_proj,
                            take(p + "q_b_proj.weight", {hq * qk, rq}));
    if (bias) {
      SHARDD_ASSIGN_OR_RETURN(layer->q_a_bias, take(p + "q_a_proj.bias", {rq}));
    }
  } else {
    SHARDD_ASSIGN_OR_RETURN(layer->q_proj, take(p + "q_proj.weight", {hq * qk, d}));
  }
  SHARDD_ASSIGN_OR_RETURN(layer->kv_a_proj,
                          take(p + "kv_a_proj_with_mqa.weight", {rkv + rope, d}));
  SHARDD_ASSIGN_OR_RETURN(layer->kv_a_norm,
                          take(p + "kv_a_layernorm.weight", {rkv}));
  SHARDD_ASSIGN_OR_RETURN(layer->kv_b_proj,
                          take(p + "kv_b_proj.weight", {hq * (nope + dv), rkv}));
  SHARDD_ASSIGN_OR_RETURN(layer->o_proj, take(p + "o_proj.weight", {d, hq * dv}));
  layer->attention_bias = bias;
  if (bias) {
    SHARDD_ASSIGN_OR_RETURN(layer->kv_a_bias,
                            take(p + "kv_a_proj_with_mqa.bias", {rkv + rope}));
    SHARDD_ASSIGN_OR_RETURN(layer->o_bias, take(p + "o_proj.bias", {d}));
  }
  SHARDD_ASSIGN_OR_RETURN(
      layer->post_norm,
      take(absl::StrCat("model.layers.", l, ".post_attention_layernorm.weight"),
           {d}));
  return absl::OkStatus();
}

// kSigmoidGroupLimited's groups, named by their dims fields.
absl::Status ReadGroupLimitedRouter(const v1::ModelDims& dims,
                                    MoeArchitecture* arch) {
  arch->router_groups = dims.n_group();
  arch->router_top_groups = dims.topk_group();
  arch->routed_scaling_factor = static_cast<float>(dims.routed_scaling_factor());
  for (size_t l = 0; l < arch->layers.size(); ++l) {
    const MoeLayerSpec& layer = arch->layers[l];
    if (!layer.has_moe) continue;
    const int64_t e = layer.experts, g = arch->router_groups;
    if (g < 1 || e % g != 0 || e / g < 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dims.n_group: the sigmoid group-limited router needs it to split "
          "the ",
          e, " experts of layer ", l,
          " into equal groups of at least 2 (each group is ranked by its two "
          "best), got ",
          g));
    }
    if (arch->router_top_groups < 1 || arch->router_top_groups > g) {
      return absl::InvalidArgumentError(
          absl::StrCat("dims.topk_group: must be in [1, n_group=", g, "], got ",
                       arch->router_top_groups));
    }
    if (arch->top_k > arch->router_top_groups * (e / g)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dims.top_k: ", arch->top_k, " exceeds the ",
          arch->router_top_groups * (e / g), " experts of the topk_group=",
          arch->router_top_groups, " groups searched"));
    }
  }
  if (!(arch->routed_scaling_factor > 0) ||
      !std::isfinite(arch->routed_scaling_factor)) {
    return absl::InvalidArgumentError(
        absl::StrCat("dims.routed_scaling_factor: must be > 0, got ",
                     dims.routed_scaling_factor()));
  }
  return absl::OkStatus();
}

// dims.router_aux_loss_coef and the one expert count the loss sums over.
absl::Status ReadRouterAuxLoss(const v1::ModelDims& dims,
                               MoeArchitecture* arch) {
  const double coef = dims.router_aux_loss_coef();
  if (!std::isfinite(coef) || coef < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dims.router_aux_loss_coef: must be a finite number >= 0, got ",
        coef));
  }
  arch->router_aux_loss_coef = coef;
  if (coef == 0) return absl::OkStatus();
  if (arch->router_scoring == kernels::RouterScoring::kSigmoidGroupLimited) {
    return absl::InvalidArgumentError(
        "dims.router_aux_loss_coef: the load-balancing loss needs a softmax "
        "router; the sigmoid group-limited router (DeepSeek-V3) has none");
  }
  for (size_t l = 0; l < arch->layers.size(); ++l) {
    const MoeLayerSpec& layer = arch->layers[l];
    if (!layer.has_moe) continue;
    if (arch->aux_experts == 0) arch->aux_experts = layer.experts;
    if (layer.experts != arch->aux_experts) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dims.router_aux_loss_coef: the load-balancing loss concatenates "
          "every MoE layer's router logits and needs one expert count; layer ",
          l, " has ", layer.experts, ", an earlier one ", arch->aux_experts));
    }
  }
  if (arch->aux_experts == 0) {
    return absl::InvalidArgumentError(
        "dims.router_aux_loss_coef: > 0 on a model without MoE layers");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckModelStepShape(int passes, int no_grad_passes,
                                 int microbatches) {
  if (passes < 1 || no_grad_passes < 0 || no_grad_passes >= passes ||
      microbatches < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step shape: need passes >= 1, 0 <= no_grad_passes < passes and "
        "microbatches >= 1, got passes ",
        passes, ", no_grad_passes ", no_grad_passes, ", microbatches ",
        microbatches));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> PadIdOf(const v1::ModelDims& dims, int64_t vocab) {
  if (!dims.has_pad_token_id()) return -1;
  if (dims.pad_token_id() < 0 || dims.pad_token_id() >= vocab) {
    return absl::InvalidArgumentError(
        absl::StrCat("dims.pad_token_id: ", dims.pad_token_id(),
                     " is not a token id; allowed: [0, ", vocab, ")"));
  }
  return dims.pad_token_id();
}

absl::StatusOr<ArchTensors> ArchTensorsOf(const v1::ModelSpec& model) {
  ArchTensors tensors;
  SHARDD_ASSIGN_OR_RETURN(const std::vector<LoraTarget> lora,
                          LoraTargetsOf(model));
  std::set<std::string> adapted;
  for (const LoraTarget& t : lora) adapted.insert(t.base);
  for (const ParamRef& ref : ListParams(model)) {
    if (!lora.empty() && IsLoraAdapter(ref.fqn)) continue;
    ArchTensor t;
    t.name = ref.tensor->tied_to().empty() ? ref.fqn : ref.tensor->tied_to();
    t.shape.assign(ref.tensor->shape().begin(), ref.tensor->shape().end());
    t.frozen = ref.tensor->frozen() && !adapted.count(ref.fqn);
    tensors[ref.fqn] = t;
  }
  return tensors;
}

absl::StatusOr<MoeArchitecture> ReadMoeArchitecture(
    const v1::ModelSpec& model) {
  if (model.architecture() == "DiffusionGemmaForBlockDiffusion") {
    return ReadDiffusionGemmaArchitecture(model);
  }
  MoeArchitecture arch;
  SHARDD_ASSIGN_OR_RETURN(ArchTensors tensors, ArchTensorsOf(model));
  auto take = [&](const std::string& name,
                  std::vector<int64_t> shape) -> absl::StatusOr<ArchTensor> {
    auto it = tensors.find(name);
    if (it == tensors.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("the CPU training path needs parameter '", name, "'"));
    }
    if (!shape.empty() && it->second.shape != shape) {
      std::string want, got;
      for (int64_t d : shape)
        absl::StrAppend(&want, want.empty() ? "" : ", ", d);
      for (int64_t d : it->second.shape) {
        absl::StrAppend(&got, got.empty() ? "" : ", ", d);
      }
      return absl::InvalidArgumentError(
          absl::StrCat("parameter '", name, "': expected shape [", want,
                       "], got [", got, "]"));
    }
    ArchTensor t = it->second;
    tensors.erase(it);
    return t;
  };

  SHARDD_ASSIGN_OR_RETURN(arch.embed, take("model.embed_tokens.weight", {}));
  if (arch.embed.shape.size() != 2) {
    return absl::InvalidArgumentError(
        "model.embed_tokens.weight: expected [vocab, hidden]");
  }
  arch.vocab = arch.embed.shape[0];
  arch.dim = arch.embed.shape[1];
  SHARDD_ASSIGN_OR_RETURN(arch.pad_id, PadIdOf(model.dims(), arch.vocab));
  const int64_t d = arch.dim;
  arch.top_k = model.dims().top_k();
  arch.eps = model.dims().rms_norm_eps() > 0
                 ? static_cast<float>(model.dims().rms_norm_eps())
                 : 1e-6f;
  switch (model.dims().activation()) {
    case v1::GEGLU:
      arch.activation = kernels::GatedActivation::kGeGLU;
      break;
    case v1::SWIGLU_OAI:
      arch.activation = kernels::GatedActivation::kClampedSwiGLU;
      if (!(model.dims().swiglu_limit() > 0) ||
          !(model.dims().swiglu_alpha() > 0)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "dims.swiglu_limit / swiglu_alpha: the swiglu_oai activation "
            "needs both > 0, got ",
            model.dims().swiglu_limit(), " / ", model.dims().swiglu_alpha()));
      }
      arch.swiglu_limit = static_cast<float>(model.dims().swiglu_limit());
      arch.swiglu_alpha = static_cast<float>(model.dims().swiglu_alpha());
      break;
    default:
      arch.activation = kernels::GatedActivation::kSwiGLU;
      break;
  }
  switch (model.dims().router_scoring()) {
    case v1::ROUTER_TOPK_THEN_SOFTMAX:
      arch.router_scoring = kernels::RouterScoring::kTopKThenSoftmax;
      break;
    case v1::ROUTER_SIGMOID_GROUP_LIMITED:
      arch.router_scoring = kernels::RouterScoring::kSigmoidGroupLimited;
      break;
    default:
      arch.router_scoring = kernels::RouterScoring::kSoftmaxThenTopK;
      break;
  }
  SHARDD_ASSIGN_OR_RETURN(arch.final_norm, take("model.norm.weight", {d}));
  SHARDD_ASSIGN_OR_RETURN(arch.head, take("lm_head.weight", {arch.vocab, d}));

  for (int l = 0;; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    if (tensors.count(p + "input_layernorm.weight") == 0) break;
    MoeLayerSpec layer;
    SHARDD_ASSIGN_OR_RETURN(layer.norm,
                            take(p + "input_layernorm.weight", {d}));
    if (tensors.count(p + "self_attn.kv_a_proj_with_mqa.weight") > 0) {
      SHARDD_RETURN_IF_ERROR(ReadMlaLayer(model.dims(), l, take, &arch, &layer));
    } else if (tensors.count(p + "self_attn.q_proj.weight") > 0) {
      const v1::ModelDims& dims = model.dims();
      const AttentionHeads heads = AttentionHeadsOf(dims, d);
      const int64_t hq = heads.q, hkv = heads.kv, hd = heads.dim;
      if (hq < 1 || hkv < 1 || hq % hkv != 0 || hd < 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            "dims.num_attention_heads / num_key_value_heads / head_dim: "
            "layer ",
            l,
            " has attention, which needs heads >= 1 with "
            "num_key_value_heads dividing num_attention_heads; got ",
            hq, ", ", hkv, ", ", hd));
      }
      arch.q_heads = hq;
      arch.kv_heads = hkv;
      arch.head_dim = hd;
      layer.has_attention = true;
      SHARDD_ASSIGN_OR_RETURN(
          layer.q_proj, take(p + "self_attn.q_proj.weight", {hq * hd, d}));
      SHARDD_ASSIGN_OR_RETURN(
          layer.k_proj, take(p + "self_attn.k_proj.weight", {hkv * hd, d}));
      SHARDD_ASSIGN_OR_RETURN(
          layer.v_proj, take(p + "self_attn.v_proj.weight", {hkv * hd, d}));
      SHARDD_ASSIGN_OR_RETURN(
          layer.o_proj, take(p + "self_attn.o_proj.weight", {d, hq * hd}));
      if (tensors.count(p + "self_attn.q_norm.weight") > 0) {
        layer.qk_norm = true;
        SHARDD_ASSIGN_OR_RETURN(layer.q_norm,
                                take(p + "self_attn.q_norm.weight", {hd}));
        SHARDD_ASSIGN_OR_RETURN(layer.k_norm,
                                take(p + "self_attn.k_norm.weight", {hd}));
      }
      const v1::AttentionSpec& attention = dims.attention();
      // Biases and sinks when the spec says so or holds them (a missing
      // one is then named by take()).
      layer.attention_bias =
          attention.bias() || tensors.count(p + "self_attn.q_proj.bias") > 0;
      if (layer.attention_bias) {
        SHARDD_ASSIGN_OR_RETURN(layer.q_bias,
                                take(p + "self_attn.q_proj.bias", {hq * hd}));
        SHARDD_ASSIGN_OR_RETURN(layer.k_bias,
                                take(p + "self_attn.k_proj.bias", {hkv * hd}));
        SHARDD_ASSIGN_OR_RETURN(layer.v_bias,
                                take(p + "self_attn.v_proj.bias", {hkv * hd}));
        SHARDD_ASSIGN_OR_RETURN(layer.o_bias,
                                take(p + "self_attn.o_proj.bias", {d}));
      }
      layer.has_sinks =
          attention.sinks() || tensors.count(p + "self_attn.sinks") > 0;
      if (layer.has_sinks) {
        SHARDD_ASSIGN_OR_RETURN(layer.sinks, take(p + "self_attn.sinks", {hq}));
      }
      SHARDD_ASSIGN_OR_RETURN(layer.post_norm,
                              take(p + "post_attention_layernorm.weight", {d}));
      layer.sliding =
          l < attention.sliding_layers_size() && attention.sliding_layers(l);
      if (layer.sliding && attention.sliding_window() < 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("dims.attention.sliding_window: layer ", l,
                         " slides, which needs a window >= 1"));
      }
    }
    if (tensors.count(p + "moe.experts.gate_and_up_projs") > 0) {
      layer.has_moe = true;
      SHARDD_ASSIGN_OR_RETURN(layer.w_gu,
                              take(p + "moe.experts.gate_and_up_projs", {}));
      SHARDD_RETURN_IF_ERROR(
          Expect(layer.w_gu.shape.size() == 3 && layer.w_gu.shape[1] == d &&
                     layer.w_gu.shape[2] % 2 == 0,
                 absl::StrCat(p, "moe.experts.gate_and_up_projs: expected [E, ",
                              d, ", 2I]")));
      layer.experts = layer.w_gu.shape[0];
      layer.moe_inter = layer.w_gu.shape[2] / 2;
      SHARDD_ASSIGN_OR_RETURN(layer.w_d,
                              take(p + "moe.experts.down_projs",
                                   {layer.experts, layer.moe_inter, d}));
      SHARDD_ASSIGN_OR_RETURN(layer.gate,
                              take(p + "moe.gate.weight", {layer.experts, d}));
      if (tensors.count(p + "moe.gate.e_score_correction_bias") > 0) {
        layer.selection_bias = true;
        SHARDD_ASSIGN_OR_RETURN(
            layer.gate_selection_bias,
            take(p + "moe.gate.e_score_correction_bias", {layer.experts}));
      }
      if (tensors.count(p + "moe.shared_experts.gate_proj.weight") > 0) {
        // Added to the routed output like a dense branch.
        layer.has_mlp = true;
        SHARDD_ASSIGN_OR_RETURN(
            layer.mlp_gate, take(p + "moe.shared_experts.gate_proj.weight", {}));
        SHARDD_RETURN_IF_ERROR(Expect(
            layer.mlp_gate.shape.size() == 2 && layer.mlp_gate.shape[1] == d,
            absl::StrCat(p, "moe.shared_experts.gate_proj.weight: expected [I, ",
                         d, "]")));
        layer.mlp_inter = layer.mlp_gate.shape[0];
        SHARDD_ASSIGN_OR_RETURN(
            layer.mlp_up, take(p + "moe.shared_experts.up_proj.weight",
                               {layer.mlp_inter, d}));
        SHARDD_ASSIGN_OR_RETURN(
            layer.mlp_down, take(p + "moe.shared_experts.down_proj.weight",
                                 {d, layer.mlp_inter}));
      }
      if (tensors.count(p + "moe.gate.bias") > 0) {
        layer.router_bias = true;
        SHARDD_ASSIGN_OR_RETURN(layer.gate_bias,
                                take(p + "moe.gate.bias", {layer.experts}));
      }
      if (tensors.count(p + "moe.experts.gate_up_proj_bias") > 0 ||
          tensors.count(p + "moe.experts.down_proj_bias") > 0) {
        layer.expert_bias = true;
        SHARDD_ASSIGN_OR_RETURN(layer.b_gu,
                                take(p + "moe.experts.gate_up_proj_bias",
                                     {layer.experts, 2 * layer.moe_inter}));
        SHARDD_ASSIGN_OR_RETURN(
            layer.b_d,
            take(p + "moe.experts.down_proj_bias", {layer.experts, d}));
      }
      if (arch.top_k < 1 || arch.top_k > layer.experts) {
        return absl::InvalidArgumentError(
            absl::StrCat("dims.top_k: must be in [1, ", layer.experts,
                         "] for layer ", l, ", got ", arch.top_k));
      }
    }
    if (tensors.count(p + "mlp.gate_proj.weight") > 0) {
      if (layer.has_mlp) {
        return absl::InvalidArgumentError(absl::StrCat(
            "layer ", l, ": has both moe.shared_experts and an mlp"));
      }
      layer.has_mlp = true;
      SHARDD_ASSIGN_OR_RETURN(layer.mlp_gate,
                              take(p + "mlp.gate_proj.weight", {}));
      SHARDD_RETURN_IF_ERROR(Expect(
          layer.mlp_gate.shape.size() == 2 && layer.mlp_gate.shape[1] == d,
          absl::StrCat(p, "mlp.gate_proj.weight: expected [I, ", d, "]")));
      layer.mlp_inter = layer.mlp_gate.shape[0];
      SHARDD_ASSIGN_OR_RETURN(
          layer.mlp_up, take(p + "mlp.up_proj.weight", {layer.mlp_inter, d}));
      SHARDD_ASSIGN_OR_RETURN(layer.mlp_down, take(p + "mlp.down_proj.weight",
                                                   {d, layer.mlp_inter}));
    }
    if (!layer.has_moe && !layer.has_mlp) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer ", l, ": needs moe.experts or an mlp for the CPU path"));
    }
    arch.layers.push_back(std::move(layer));
  }
  bool attention = false;
  for (const MoeLayerSpec& layer : arch.layers) {
    attention = attention || layer.has_attention;
  }
  if (attention) {
    const v1::AttentionSpec& spec = model.dims().attention();
    // MLA rotates only the rope part of each head (HF's config.head_dim is
    // qk_rope_head_dim there).
    const int64_t rotary = arch.mla ? arch.rope_head_dim : arch.head_dim;
    SHARDD_ASSIGN_OR_RETURN(arch.rope,
                            ComputeRopeFrequencies(spec.rope(), rotary));
    if (static_cast<int64_t>(arch.rope.inv_freq.size()) * 2 > rotary) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dims.attention.rope: rotates more dims than ",
          arch.mla ? "mla.qk_rope_head_dim" : "head_dim"));
    }
    arch.softmax_scale = spec.softmax_scale();
    if (!(arch.softmax_scale >= 0) || !std::isfinite(arch.softmax_scale)) {
      return absl::InvalidArgumentError(
          absl::StrCat("dims.attention.softmax_scale: must be >= 0 (0: "
                       "head_dim^-0.5), got ",
                       arch.softmax_scale));
    }
    arch.sliding_window = spec.sliding_window();
    arch.max_positions = spec.max_position_embeddings() > 0
                             ? spec.max_position_embeddings()
                             : int64_t{1} << 16;
  }
  arch.norm_topk_prob = model.dims().norm_topk_prob();
  // Native specs (no attention) always renormalise, as NeMo's router; a
  // Hugging Face model as its config says (Mixtral always, Qwen3 with
  // norm_topk_prob).
  arch.renormalize_topk = !attention || arch.norm_topk_prob;
  if (arch.router_scoring == kernels::RouterScoring::kSigmoidGroupLimited) {
    SHARDD_RETURN_IF_ERROR(ReadGroupLimitedRouter(model.dims(), &arch));
  }
  if (arch.layers.empty()) {
    return absl::InvalidArgumentError(
        "the CPU training path needs decoder layers model.layers.N with an "
        "input_layernorm");
  }
  SHARDD_RETURN_IF_ERROR(ReadRouterAuxLoss(model.dims(), &arch));
  if (!tensors.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "parameter '", tensors.begin()->first,
        "' is not part of the CPU training model (embedding, per-layer "
        "input_layernorm / self_attn (with biases and sinks, or latent "
        "attention) / post_attention_layernorm / moe.gate (with bias or "
        "e_score_correction_bias) / moe.experts (with biases) / "
        "moe.shared_experts / mlp, model.norm, lm_head)"));
  }
  return arch;
}

}  // namespace shardd
