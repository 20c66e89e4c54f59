#include "model/hf_diffusion_gemma.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/hf_attention.h"
#include "model/hf_builder.h"
#include "model/json_describe.h"

namespace shardd {
namespace hf_internal {
namespace {

constexpr char kSliding[] = "sliding_attention";
constexpr char kFull[] = "full_attention";
constexpr int64_t kMaxPositions = int64_t{1} << 26;
constexpr int64_t kMaxCanvas = int64_t{1} << 20;

// One layer's attention geometry.
struct LayerHeads {
  int64_t head_dim = 0;
  int64_t kv_heads = 0;
  bool operator==(const LayerHeads& o) const {
    return head_dim == o.head_dim && kv_heads == o.kv_heads;
  }
};

// layer_types, else DiffusionGemmaTextConfig's default (every 6th layer
// full); the last layer is always full, as the config class forces it.
absl::StatusOr<std::vector<bool>> ReadFullLayers(const ConfigReader& r,
                                                 int64_t layers) {
  std::vector<bool> full(layers, false);
  std::string name;
  const json* v = r.Find("layer_types", &name);
  if (v == nullptr) {
    for (int64_t i = 0; i < layers; ++i) full[i] = (i + 1) % 6 == 0;
  } else {
    if (!v->is_array() || static_cast<int64_t>(v->size()) != layers) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": must be an array of num_hidden_layers (",
                       layers, ") strings \"", kSliding, "\" or \"", kFull,
                       "\", got ", DescribeJson(*v)));
    }
    for (int64_t i = 0; i < layers; ++i) {
      const json& x = (*v)[i];
      const bool is_full = x.is_string() && x.get<std::string>() == kFull;
      if (!is_full && !(x.is_string() && x.get<std::string>() == kSliding)) {
        return absl::InvalidArgumentError(absl::StrCat(
            name, "[", i, "]: must be \"", kSliding, "\" or \"", kFull,
            "\", got ",
            x.is_string() ? absl::StrCat("\"", x.get<std::string>(), "\"")
                          : DescribeJson(x)));
      }
      full[i] = is_full;
    }
  }
  full[layers - 1] = true;
  return full;
}

// Head dim and KV heads per layer: full layers take global_head_dim (512
// when absent, head_dim when null) and num_global_key_value_heads (else
// num_key_value_heads); transformers >= 5.15 writes per_layer_config
// {"05": {"head_dim": 512, "num_key_value_heads": 2}, ...} instead, which
// then replaces both.
absl::StatusOr<std::vector<LayerHeads>> ReadLayerHeads(
    const ConfigReader& r, const std::vector<bool>& full, int64_t nh,
    const LayerHeads& sliding) {
  const int64_t layers = static_cast<int64_t>(full.size());
  std::vector<LayerHeads> out(layers, sliding);
  std::string name;
  const json* per_layer = r.Find("per_layer_config", &name);
  if (per_layer == nullptr) {
    LayerHeads global;
    SHARDD_ASSIGN_OR_RETURN(
        global.head_dim, r.IsNull("global_head_dim")
                             ? absl::StatusOr<int64_t>(sliding.head_dim)
                             : r.IntOr("global_head_dim", 512, 1, kMaxHeadDim));
    SHARDD_ASSIGN_OR_RETURN(
        global.kv_heads,
        r.IntOr("num_global_key_value_heads", sliding.kv_heads, 1, kMaxHeads));
    for (int64_t i = 0; i < layers; ++i) {
      if (full[i]) out[i] = global;
    }
  } else {
    if (!per_layer->is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(name,
                       ": must be an object of layer index -> {head_dim, "
                       "num_key_value_heads}, got ",
                       DescribeJson(*per_layer)));
    }
    for (const auto& [key, value] : per_layer->items()) {
      const std::string where = absl::StrCat(name, "[\"", key, "\"]");
      int64_t i = -1;
      if (!absl::SimpleAtoi(key, &i) || i < 0 || i >= layers) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": the key must be a layer index in [0, ", layers - 1, "]"));
      }
      if (!value.is_object()) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": must be an object, got ", DescribeJson(value)));
      }
      for (const auto& [field, x] : value.items()) {
        int64_t* target = nullptr;
        int64_t hi = 0;
        if (field == "head_dim") {
          target = &out[i].head_dim;
          hi = kMaxHeadDim;
        } else if (field == "num_key_value_heads") {
          target = &out[i].kv_heads;
          hi = kMaxHeads;
        } else {
          return absl::InvalidArgumentError(absl::StrCat(
              where, ".", field,
              ": not read; allowed: head_dim, num_key_value_heads"));
        }
        if (!x.is_number_integer() || x.get<int64_t>() < 1 ||
            x.get<int64_t>() > hi) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ".", field, ": must be an integer in [1, ",
                           hi, "], got ", DescribeJson(x)));
        }
        *target = x.get<int64_t>();
      }
    }
  }
  // The spec records one geometry per layer type.
  const int64_t first_full = layers - 1;  // Always full.
  for (int64_t i = 0; i < layers; ++i) {
    const LayerHeads& want = full[i] ? out[first_full] : sliding;
    if (!(out[i] == want)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": layer ", i, " has head_dim ", out[i].head_dim,
                       " and num_key_value_heads ", out[i].kv_heads, "; every ",
                       full[i] ? kFull : kSliding, " layer must have ",
                       want.head_dim, " and ", want.kv_heads));
    }
    if (nh % out[i].kv_heads != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          full[i] ? "num_global_key_value_heads" : "num_key_value_heads",
          ": must divide num_attention_heads (", nh, "), got ", out[i].kv_heads,
          " (layer ", i, ")"));
    }
  }
  return out;
}

// rope_parameters keyed by layer type, else DiffusionGemmaTextConfig's
// default: sliding layers default RoPE theta 1e4, full layers proportional
// RoPE theta 1e6 rotating a quarter of each head.
absl::Status ReadLayerTypeRope(const ConfigReader& r, const char* type,
                               int64_t max_positions, v1::RopeSpec* rope) {
  std::string name;
  const json* params = r.Find("rope_parameters", &name);
  if (params == nullptr) {
    const bool sliding = std::string(type) == kSliding;
    rope->set_type(sliding ? "default" : "proportional");
    rope->set_theta(sliding ? 10000.0 : 1000000.0);
    rope->set_partial_rotary_factor(sliding ? 1.0 : 0.25);
    rope->set_original_max_position_embeddings(max_positions);
    return absl::OkStatus();
  }
  const std::string where = absl::StrCat(name, ".", type);
  if (!params->is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": must be an object keyed by layer type (\"", kSliding, "\", \"",
        kFull, "\"), got ", DescribeJson(*params)));
  }
  auto it = params->find(type);
  if (it == params->end() || !it->is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": must be an object (the rope of the ", type, " layers), got ",
        it == params->end() ? std::string("nothing") : DescribeJson(*it)));
  }
  return ReadRopeObject(*it, where, 10000.0, 1.0, max_positions, rope);
}

absl::Status ReadAttentionSpec(const ConfigReader& r,
                               const std::vector<bool>& full,
                               const LayerHeads& sliding,
                               const LayerHeads& global, bool bias,
                               v1::AttentionSpec* a) {
  SHARDD_ASSIGN_OR_RETURN(
      const int64_t max_positions,
      r.IntOr("max_position_embeddings", 131072, 1, kMaxPositions));
  a->set_max_position_embeddings(max_positions);
  bool any_sliding = false;
  for (bool f : full) any_sliding = any_sliding || !f;
  SHARDD_RETURN_IF_ERROR(
      ReadLayerTypeRope(r, kFull, max_positions, a->mutable_rope()));
  // Hugging Face sizes every rope type but proportional by head_dim.
  if (a->rope().type() != "proportional" &&
      global.head_dim != sliding.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("rope_parameters.", kFull,
                     ".rope_type: must be \"proportional\" when "
                     "the full-attention head dim (",
                     global.head_dim, ") differs from head_dim (",
                     sliding.head_dim, "), got \"", a->rope().type(), "\""));
  }
  if (any_sliding) {
    SHARDD_RETURN_IF_ERROR(ReadLayerTypeRope(r, kSliding, max_positions,
                                             a->mutable_sliding_rope()));
  }

  SHARDD_ASSIGN_OR_RETURN(const std::string bidirectional,
                          r.StringOr("use_bidirectional_attention", "vision"));
  if (bidirectional != "vision" && bidirectional != "all") {
    return absl::InvalidArgumentError(absl::StrCat(
        "use_bidirectional_attention: must be \"vision\", \"all\" or null, "
        "got \"",
        bidirectional, "\""));
  }
  SHARDD_ASSIGN_OR_RETURN(int64_t window,
                          r.IntOr("sliding_window", 512, 1, kMaxPositions));
  // The config class turns the window into flash attention's exclusive
  // bound when nothing is causal.
  if (bidirectional == "all") window = window / 2 + 1;
  a->set_bidirectional(bidirectional == "all");
  if (any_sliding) {
    a->set_sliding_window(window);
    for (bool f : full) a->add_sliding_layers(!f);
  }
  a->set_qk_norm(true);
  a->set_v_norm(true);
  a->set_values_from_keys(true);
  a->set_bias(bias);
  // q_norm / k_norm carry the per-head scale: the scores are not scaled.
  a->set_softmax_scale(1.0);
  a->set_global_head_dim(global.head_dim);
  a->set_num_global_key_value_heads(static_cast<int32_t>(global.kv_heads));
  return absl::OkStatus();
}

// DiffusionGemmaConfig.tie_word_embeddings and the text config's: false
// would undo every tie, which NeMo's model (lm_head = embed_tokens) cannot.
absl::Status CheckTied(const ConfigReader& r) {
  for (const ConfigReader& reader : {r.TopLevel(), r}) {
    SHARDD_ASSIGN_OR_RETURN(const bool tie,
                            reader.BoolOr("tie_word_embeddings", true));
    if (!tie) {
      std::string name;
      reader.Find("tie_word_embeddings", &name);
      return absl::InvalidArgumentError(absl::StrCat(
          name,
          ": DiffusionGemmaForBlockDiffusion ties lm_head to the "
          "embedding (and the encoder to the decoder); must be true "
          "or absent"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::ModelSpec> BuildDiffusionGemma(const ConfigReader& r,
                                                  const std::string& arch) {
  const ConfigReader top = r.TopLevel();
  SHARDD_RETURN_IF_ERROR(CheckTied(r));
  SHARDD_ASSIGN_OR_RETURN(CommonConfig c, ReadCommon(r, arch, true));
  SHARDD_ASSIGN_OR_RETURN(c.model_type, top.StringOr("model_type", ""));
  SHARDD_ASSIGN_OR_RETURN(
      c.activation, ActivationFromConfig(r, "hidden_activation", v1::GEGLU));
  SHARDD_ASSIGN_OR_RETURN(const int64_t nh,
                          r.Int("num_attention_heads", 1, kMaxHeads));
  LayerHeads sliding;
  SHARDD_ASSIGN_OR_RETURN(sliding.kv_heads,
                          r.IntOr("num_key_value_heads", nh, 1, kMaxHeads));
  SHARDD_ASSIGN_OR_RETURN(sliding.head_dim,
                          r.IntOr("head_dim", 256, 1, kMaxHeadDim));
  SHARDD_ASSIGN_OR_RETURN(const bool attn_bias,
                          r.BoolOr("attention_bias", false));
  SHARDD_ASSIGN_OR_RETURN(const int64_t inter,
                          r.Int("intermediate_size", 1, kMaxIntermediate));
  SHARDD_ASSIGN_OR_RETURN(const int64_t moe_inter,
                          r.Int("moe_intermediate_size", 1, kMaxIntermediate));
  SHARDD_ASSIGN_OR_RETURN(const int64_t e,
                          r.Int("num_experts", 1, kMaxExperts));
  SHARDD_ASSIGN_OR_RETURN(const int64_t k, ReadTopK(r, "top_k_experts", e));
  SHARDD_ASSIGN_OR_RETURN(const std::vector<bool> full,
                          ReadFullLayers(r, c.layers));
  SHARDD_ASSIGN_OR_RETURN(const std::vector<LayerHeads> heads,
                          ReadLayerHeads(r, full, nh, sliding));
  const LayerHeads global = heads[c.layers - 1];
  double softcap = 0;
  if (!r.IsNull("final_logit_softcapping")) {
    SHARDD_ASSIGN_OR_RETURN(
        softcap, r.NonNegativeDoubleOr("final_logit_softcapping", 30.0));
  }
  SHARDD_ASSIGN_OR_RETURN(const int64_t canvas,
                          top.IntOr("canvas_length", 256, 1, kMaxCanvas));

  Builder b(c.dtype);
  SHARDD_ASSIGN_OR_RETURN(
      v1::ModelSpec spec,
      BuildDecoder(
          c, b,
          [&](int i, v1::ModuleSpec* layer) {
            // Declaration order of NeMo's DiffusionGemmaMoEDecoderLayer.
            const int64_t hd = heads[i].head_dim;
            const int64_t nkv = heads[i].kv_heads;
            v1::ModuleSpec* a =
                Builder::Child(layer, "self_attn", v1::MODULE_ATTENTION);
            b.Linear(a, "q_proj", c.hidden, nh * hd, attn_bias);
            b.Linear(a, "k_proj", c.hidden, nkv * hd, attn_bias);
            // Full-attention layers take their values from k_proj.
            if (!full[i]) b.Linear(a, "v_proj", c.hidden, nkv * hd, attn_bias);
            b.Linear(a, "o_proj", nh * hd, c.hidden, attn_bias);
            b.Norm(a, "q_norm", hd);
            b.Norm(a, "k_norm", hd);  // v_norm has no weight.
            b.GatedMlp(layer, "mlp", c.hidden, inter);
            for (const char* norm :
                 {"input_layernorm", "post_attention_layernorm",
                  "pre_feedforward_layernorm", "post_feedforward_layernorm",
                  "post_feedforward_layernorm_1",
                  "post_feedforward_layernorm_2",
                  "pre_feedforward_layernorm_2"}) {
              b.Norm(layer, norm, c.hidden);
            }
            // HF router.{scale, proj} as NeMo's Gemma4Gate, frozen as NeMo's
            // freeze_router=True default leaves it; router.per_expert_scale
            // is folded into down_projs on import (NeMo's adapter), so it
            // has no parameter here.
            v1::ModuleSpec* moe = Builder::Child(layer, "moe", v1::MODULE_MOE);
            v1::ModuleSpec* gate =
                Builder::Child(moe, "gate", v1::MODULE_ROUTER);
            b.Param(gate, "scale", {c.hidden})->set_frozen(true);
            v1::ModuleSpec* proj =
                Builder::Child(gate, "proj", v1::MODULE_GENERIC);
            b.Param(proj, "weight", {e, c.hidden})->set_frozen(true);
            b.Experts(moe, e, c.hidden, moe_inter, false);
            // A persistent buffer in the checkpoint: sharded with the layer,
            // never trained.
            b.Param(layer, "layer_scalar", {1})->set_frozen(true);
            return absl::OkStatus();
          },
          [&](v1::ModuleSpec* model) {
            // DiffusionGemmaSelfConditioning: the previous pass's soft
            // embeddings through pre_norm and a gated MLP of
            // intermediate_size, added to the canvas embeddings, then an
            // RMSNorm without weight.
            v1::ModuleSpec* sc =
                Builder::Child(model, "self_conditioning", v1::MODULE_GENERIC);
            b.Norm(sc, "pre_norm", c.hidden);
            b.Linear(sc, "gate_proj", c.hidden, inter, false);
            b.Linear(sc, "up_proj", c.hidden, inter, false);
            b.Linear(sc, "down_proj", inter, c.hidden, false);
          }));
  v1::ModelDims* d = spec.mutable_dims();
  d->set_num_attention_heads(static_cast<int32_t>(nh));
  d->set_num_key_value_heads(static_cast<int32_t>(sliding.kv_heads));
  d->set_head_dim(sliding.head_dim);
  d->set_num_experts(static_cast<int32_t>(e));
  d->set_top_k(static_cast<int32_t>(k));
  d->set_moe_intermediate_size(moe_inter);
  d->set_dense_intermediate_size(inter);
  // Softmax over all experts, top-k, renormalised (then per_expert_scale,
  // folded into the experts).
  d->set_router_scoring(v1::ROUTER_SOFTMAX_THEN_TOPK);
  d->set_norm_topk_prob(true);
  d->set_final_logit_softcapping(softcap);
  d->set_embedding_scale(std::sqrt(static_cast<double>(c.hidden)));
  d->set_canvas_length(canvas);
  SHARDD_RETURN_IF_ERROR(ReadAttentionSpec(r, full, sliding, global, attn_bias,
                                           d->mutable_attention()));
  return spec;
}

}  // namespace hf_internal
}  // namespace shardd
