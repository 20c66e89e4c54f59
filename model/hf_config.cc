#include "model/hf_config.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "model/config_reader.h"
#include "model/hf_attention.h"
#include "model/hf_builder.h"
#include "model/hf_diffusion_gemma.h"
#include "model/json_describe.h"
#include "model/model_util.h"
#include "nlohmann/json.hpp"

namespace shardd {
namespace {

using hf_internal::ActivationFromConfig;
using hf_internal::BuildDecoder;
using hf_internal::BuildDiffusionGemma;
using hf_internal::Builder;
using hf_internal::CommonConfig;
using hf_internal::ConfigReader;
using hf_internal::Heads;
using hf_internal::kMaxExperts;
using hf_internal::kMaxHeadDim;
using hf_internal::kMaxHeads;
using hf_internal::kMaxIntermediate;
using hf_internal::kMaxLayers;
using hf_internal::kMaxRank;
using hf_internal::ReadAttention;
using hf_internal::ReadCommon;
using hf_internal::ReadHeads;
using hf_internal::ReadTopK;
using hf_internal::SetHeadDims;
using hf_internal::SlidingLayers;
using nlohmann::json;

// ---- Architectures ----------------------------------------------------------

absl::StatusOr<v1::ModelSpec> BuildLlama(const ConfigReader& r,
                                         const std::string& arch) {
  SHARDD_ASSIGN_OR_RETURN(CommonConfig c, ReadCommon(r, arch, false));
  SHARDD_ASSIGN_OR_RETURN(c.activation,
                          ActivationFromConfig(r, "hidden_act", v1::SWIGLU));
  SHARDD_ASSIGN_OR_RETURN(Heads h, ReadHeads(r, c.hidden));
  SHARDD_ASSIGN_OR_RETURN(int64_t inter,
                          r.Int("intermediate_size", 1, kMaxIntermediate));
  SHARDD_ASSIGN_OR_RETURN(bool attn_bias, r.BoolOr("attention_bias", false));
  SHARDD_ASSIGN_OR_RETURN(bool mlp_bias, r.BoolOr("mlp_bias", false));
  Builder b(c.dtype);
  SHARDD_ASSIGN_OR_RETURN(
      v1::ModelSpec spec, BuildDecoder(c, b, [&](int, v1::ModuleSpec* layer) {
        b.Attention(layer, c.hidden, h.nh, h.nkv, h.hd, attn_bias);
        b.GatedMlp(layer, "mlp", c.hidden, inter, mlp_bias);
        b.Norm(layer, "input_layernorm", c.hidden);
        b.Norm(layer, "post_attention_layernorm", c.hidden);
        return absl::OkStatus();
      }));
  SetHeadDims(h, spec.mutable_dims());
  spec.mutable_dims()->set_dense_intermediate_size(inter);
  SHARDD_RETURN_IF_ERROR(
      ReadAttention(r, c.layers, SlidingLayers::kNone,
                    spec.mutable_dims()->mutable_attention()));
  spec.mutable_dims()->mutable_attention()->set_bias(attn_bias);
  return spec;
}

// dims.router_aux_loss_coef: Hugging Face adds coef * load-balancing loss to
// the loss only when output_router_logits is true (false by default in
// MixtralConfig, Qwen3MoeConfig and GptOssConfig); `default_coef` is the
// config class's router_aux_loss_coef (0.001, 0.001 and 0.9).
absl::Status ReadRouterAuxLoss(const ConfigReader& r, double default_coef,
                               v1::ModelDims* d) {
  SHARDD_ASSIGN_OR_RETURN(const bool on,
                          r.BoolOr("output_router_logits", false));
  SHARDD_ASSIGN_OR_RETURN(const double coef,
                          r.NonNegativeDoubleOr("router_aux_loss_coef",
                                                default_coef));
  d->set_router_aux_loss_coef(on ? coef : 0.0);
  return absl::OkStatus();
}

absl::StatusOr<v1::ModelSpec> BuildMixtral(const ConfigReader& r,
                                           const std::string& arch) {
  SHARDD_ASSIGN_OR_RETURN(CommonConfig c, ReadCommon(r, arch, false));
  SHARDD_ASSIGN_OR_RETURN(c.activation,
                          ActivationFromConfig(r, "hidden_act", v1::SWIGLU));
  SHARDD_ASSIGN_OR_RETURN(Heads h, ReadHeads(r, c.hidden));
  SHARDD_ASSIGN_OR_RETURN(int64_t inter,
                          r.Int("intermediate_size", 1, kMaxIntermediate));
  SHARDD_ASSIGN_OR_RETURN(int64_t e,
                          r.Int("num_local_experts", 1, kMaxExperts));
  SHARDD_ASSIGN_OR_RETURN(int64_t k, ReadTopK(r, "num_experts_per_tok", e));
  Builder b(c.dtype);
  SHARDD_ASSIGN_OR_RETURN(
      v1::ModelSpec spec, BuildDecoder(c, b, [&](int, v1::ModuleSpec* layer) {
        b.Attention(layer, c.hidden, h.nh, h.nkv, h.hd, false);
        // HF: block_sparse_moe.{gate, experts.N.w1/w2/w3}.
        v1::ModuleSpec* moe = Builder::Child(layer, "moe", v1::MODULE_MOE);
        v1::ModuleSpec* gate = Builder::Child(moe, "gate", v1::MODULE_ROUTER);
        b.Param(gate, "weight", {e, c.hidden});
        b.Experts(moe, e, c.hidden, inter, false);
        b.Norm(layer, "input_layernorm", c.hidden);
        b.Norm(layer, "post_attention_layernorm", c.hidden);
        return absl::OkStatus();
      }));
  v1::ModelDims* d = spec.mutable_dims();
  SetHeadDims(h, d);
  d->set_num_experts(static_cast<int32_t>(e));
  d->set_top_k(static_cast<int32_t>(k));
  d->set_moe_intermediate_size(inter);
  // HF Mixtral renormalises the top-k routing weights.
  d->set_norm_topk_prob(true);
  SHARDD_RETURN_IF_ERROR(ReadRouterAuxLoss(r, 0.001, d));
  SHARDD_RETURN_IF_ERROR(ReadAttention(r, c.layers, SlidingLayers::kAllWhenSet,
                                       d->mutable_attention()));
  return spec;
}

absl::StatusOr<v1::ModelSpec> BuildQwen3Moe(const ConfigReader& r,
                                            const std::string& arch) {
  SHARDD_ASSIGN_OR_RETURN(CommonConfig c, ReadCommon(r, arch, false));
  SHARDD_ASSIGN_OR_RETURN(c.activation,
                          ActivationFromConfig(r, "hidden_act", v1::SWIGLU));
  SHARDD_ASSIGN_OR_RETURN(Heads h, ReadHeads(r, c.hidden));
  SHARDD_ASSIGN_OR_RETURN(bool attn_bias, r.BoolOr("attention_bias", false));
  // The released configs say num_experts; transformers 5 writes
  // num_local_experts (Qwen3MoeConfig's attribute map).
  const bool released = r.Has("num_experts") || !r.Has("num_local_experts");
  SHARDD_ASSIGN_OR_RETURN(
      int64_t e,
      r.Int(released ? "num_experts" : "num_local_experts", 1, kMaxExperts));
  if (released && r.Has("num_local_experts")) {
    SHARDD_ASSIGN_OR_RETURN(int64_t local,
                            r.Int("num_local_experts", 1, kMaxExperts));
    if (local != e) {
      return absl::InvalidArgumentError(absl::StrCat(
          "num_local_experts: ", local, " differs from num_experts ", e,
          "; give one, or both equal"));
    }
  }
  SHARDD_ASSIGN_OR_RETURN(int64_t k, ReadTopK(r, "num_experts_per_tok", e));
  SHARDD_ASSIGN_OR_RETURN(int64_t moe_inter,
                          r.Int("moe_intermediate_size", 1, kMaxIntermediate));
  SHARDD_ASSIGN_OR_RETURN(int64_t step,
                          r.IntOr("decoder_sparse_step", 1, 1, kMaxLayers));
  // Layers listed in mlp_only_layers (and those off the sparse step) are
  // dense.
  std::set<int64_t> mlp_only;
  {
    std::string name;
    const json* v = r.Find("mlp_only_layers", &name);
    if (v != nullptr) {
      if (!v->is_array()) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, ": must be an array of layer indices in [0, ",
                         c.layers - 1, "], got ", DescribeJson(*v)));
      }
      for (size_t i = 0; i < v->size(); ++i) {
        const json& x = (*v)[i];
        if (!x.is_number_integer() || x.get<int64_t>() < 0 ||
            x.get<int64_t>() >= c.layers) {
          return absl::InvalidArgumentError(
              absl::StrCat(name, "[", i, "]: must be a layer index in [0, ",
                           c.layers - 1, "], got ", DescribeJson(x)));
        }
        mlp_only.insert(x.get<int64_t>());
      }
    }
  }
  auto is_sparse = [&](int64_t i) {
    return mlp_only.count(i) == 0 && (i + 1) % step == 0;
  };
  int64_t dense_inter = 0;
  for (int64_t i = 0; i < c.layers; ++i) {
    if (!is_sparse(i)) {
      SHARDD_ASSIGN_OR_RETURN(dense_inter,
                              r.Int("intermediate_size", 1, kMaxIntermediate));
      break;
    }
  }
  Builder b(c.dtype);
  SHARDD_ASSIGN_OR_RETURN(
      v1::ModelSpec spec, BuildDecoder(c, b, [&](int i, v1::ModuleSpec* layer) {
        v1::ModuleSpec* attn =
            b.Attention(layer, c.hidden, h.nh, h.nkv, h.hd, attn_bias);
        b.Norm(attn, "q_norm", h.hd);
        b.Norm(attn, "k_norm", h.hd);
        if (is_sparse(i)) {
          // HF: mlp.{gate, experts.N.gate_proj/up_proj/down_proj}.
          v1::ModuleSpec* moe = Builder::Child(layer, "moe", v1::MODULE_MOE);
          v1::ModuleSpec* gate = Builder::Child(moe, "gate", v1::MODULE_ROUTER);
          b.Param(gate, "weight", {e, c.hidden});
          b.Experts(moe, e, c.hidden, moe_inter, false);
        } else {
          b.GatedMlp(layer, "mlp", c.hidden, dense_inter);
        }
        b.Norm(layer, "input_layernorm", c.hidden);
        b.Norm(layer, "post_attention_layernorm", c.hidden);
        return absl::OkStatus();
      }));
  v1::ModelDims* d = spec.mutable_dims();
  SetHeadDims(h, d);
  d->set_num_experts(static_cast<int32_t>(e));
  d->set_top_k(static_cast<int32_t>(k));
  d->set_moe_intermediate_size(moe_inter);
  d->set_dense_intermediate_size(dense_inter);
  SHARDD_ASSIGN_OR_RETURN(const bool norm_topk,
                          r.BoolOr("norm_topk_prob", false));
  d->set_norm_topk_prob(norm_topk);
  SHARDD_RETURN_IF_ERROR(ReadRouterAuxLoss(r, 0.001, d));
  SHARDD_RETURN_IF_ERROR(
      ReadAttention(r, c.layers, SlidingLayers::kQwen, d->mutable_attention()));
  d->mutable_attention()->set_qk_norm(true);
  d->mutable_attention()->set_bias(attn_bias);
  return spec;
}

absl::StatusOr<v1::ModelSpec> BuildDeepseekV3(const ConfigReader& r,
                                              const std::string& arch) {
  SHARDD_ASSIGN_OR_RETURN(CommonConfig c, ReadCommon(r, arch, false));
  SHARDD_ASSIGN_OR_RETURN(c.activation,
                          ActivationFromConfig(r, "hidden_act", v1::SWIGLU));
  SHARDD_ASSIGN_OR_RETURN(int64_t nh,
                          r.Int("num_attention_heads", 1, kMaxHeads));
  SHARDD_ASSIGN_OR_RETURN(int64_t nkv,
                          r.IntOr("num_key_value_heads", nh, 1, kMaxHeads));
  // q_lora_rank null means a plain q_proj (DeepSeek-V2-Lite style).
  SHARDD_ASSIGN_OR_RETURN(int64_t q_lora,
                          r.IntOr("q_lora_rank", 0, 1, kMaxRank));
  SHARDD_ASSIGN_OR_RETURN(int64_t kv_lora, r.Int("kv_lora_rank", 1, kMaxRank));
  SHARDD_ASSIGN_OR_RETURN(int64_t nope,
                          r.Int("qk_nope_head_dim", 1, kMaxHeadDim));
  SHARDD_ASSIGN_OR_RETURN(int64_t rope,
                          r.Int("qk_rope_head_dim", 1, kMaxHeadDim));
  SHARDD_ASSIGN_OR_RETURN(int64_t v_hd, r.Int("v_head_dim", 1, kMaxHeadDim));
  SHARDD_ASSIGN_OR_RETURN(bool attn_bias, r.BoolOr("attention_bias", false));
  SHARDD_ASSIGN_OR_RETURN(int64_t inter,
                          r.Int("intermediate_size", 1, kMaxIntermediate));
  SHARDD_ASSIGN_OR_RETURN(int64_t moe_inter,
                          r.Int("moe_intermediate_size", 1, kMaxIntermediate));
  SHARDD_ASSIGN_OR_RETURN(int64_t e, r.Int("n_routed_experts", 1, kMaxExperts));
  SHARDD_ASSIGN_OR_RETURN(int64_t k, ReadTopK(r, "num_experts_per_tok", e));
  SHARDD_ASSIGN_OR_RETURN(int64_t shared,
                          r.IntOr("n_shared_experts", 0, 0, 1024));
  SHARDD_ASSIGN_OR_RETURN(int64_t first_dense,
                          r.IntOr("first_k_dense_replace", 0, 0, c.layers));
  SHARDD_ASSIGN_OR_RETURN(int64_t freq,
                          r.IntOr("moe_layer_freq", 1, 1, kMaxLayers));
  // Multi-token-prediction layers (num_nextn_predict_layers) are not part of
  // the trained model here; they are left out on purpose.
  auto is_moe = [&](int64_t i) { return i >= first_dense && i % freq == 0; };
  const int64_t qk_hd = nope + rope;
  Builder b(c.dtype);
  SHARDD_ASSIGN_OR_RETURN(
      v1::ModelSpec spec, BuildDecoder(c, b, [&](int i, v1::ModuleSpec* layer) {
        // Multi-head latent attention.
        v1::ModuleSpec* a =
            Builder::Child(layer, "self_attn", v1::MODULE_ATTENTION);
        if (q_lora > 0) {
          b.Linear(a, "q_a_proj", c.hidden, q_lora, attn_bias);
          b.Norm(a, "q_a_layernorm", q_lora);
          b.Linear(a, "q_b_proj", q_lora, nh * qk_hd, false);
        } else {
          b.Linear(a, "q_proj", c.hidden, nh * qk_hd, false);
        }
        b.Linear(a, "kv_a_proj_with_mqa", c.hidden, kv_lora + rope, attn_bias);
        b.Norm(a, "kv_a_layernorm", kv_lora);
        b.Linear(a, "kv_b_proj", kv_lora, nh * (nope + v_hd), false);
        b.Linear(a, "o_proj", nh * v_hd, c.hidden, attn_bias);
        if (is_moe(i)) {
          v1::ModuleSpec* moe = Builder::Child(layer, "moe", v1::MODULE_MOE);
          v1::ModuleSpec* gate = Builder::Child(moe, "gate", v1::MODULE_ROUTER);
          b.Param(gate, "weight", {e, c.hidden});
          // The aux-loss-free balancing bias stays fp32 (an fp32 island). A
          // buffer in HF: it steers the selection only, is never trained.
          Builder::ParamOf(gate, "e_score_correction_bias", {e}, v1::FLOAT32)
              ->set_frozen(true);
          b.Experts(moe, e, c.hidden, moe_inter, false);
          if (shared > 0) {
            b.GatedMlp(moe, "shared_experts", c.hidden, moe_inter * shared);
          }
        } else {
          b.GatedMlp(layer, "mlp", c.hidden, inter);
        }
        b.Norm(layer, "input_layernorm", c.hidden);
        b.Norm(layer, "post_attention_layernorm", c.hidden);
        return absl::OkStatus();
      }));
  v1::ModelDims* d = spec.mutable_dims();
  d->set_num_attention_heads(static_cast<int32_t>(nh));
  d->set_num_key_value_heads(static_cast<int32_t>(nkv));
  d->set_head_dim(qk_hd);
  d->set_num_experts(static_cast<int32_t>(e));
  d->set_top_k(static_cast<int32_t>(k));
  d->set_moe_intermediate_size(moe_inter);
  bool any_dense = false;
  for (int64_t i = 0; i < c.layers; ++i) any_dense |= !is_moe(i);
  d->set_dense_intermediate_size(any_dense ? inter : 0);
  d->set_num_shared_experts(static_cast<int32_t>(shared));
  d->set_first_k_dense_layers(static_cast<int32_t>(first_dense));
  // DeepseekV3TopkRouter; absent fields take DeepseekV3Config's defaults.
  // Whether the groups fit the experts is the workers' check (planning a
  // config does not need it).
  d->set_router_scoring(v1::ROUTER_SIGMOID_GROUP_LIMITED);
  SHARDD_ASSIGN_OR_RETURN(const int64_t n_group,
                          r.IntOr("n_group", 8, 1, kMaxExperts));
  SHARDD_ASSIGN_OR_RETURN(const int64_t topk_group,
                          r.IntOr("topk_group", std::min<int64_t>(4, n_group),
                                  1, n_group));
  SHARDD_ASSIGN_OR_RETURN(const double routed_scale,
                          r.NonNegativeDoubleOr("routed_scaling_factor", 2.5));
  SHARDD_ASSIGN_OR_RETURN(const bool norm_topk,
                          r.BoolOr("norm_topk_prob", true));
  d->set_n_group(static_cast<int32_t>(n_group));
  d->set_topk_group(static_cast<int32_t>(topk_group));
  d->set_routed_scaling_factor(routed_scale);
  d->set_norm_topk_prob(norm_topk);

  v1::AttentionSpec* attention = d->mutable_attention();
  SHARDD_RETURN_IF_ERROR(
      ReadAttention(r, c.layers, SlidingLayers::kNone, attention));
  attention->set_bias(attn_bias);
  // rope_interleave (default true): pairs (2i, 2i + 1) of the rope dims
  // rotate. HF de-interleaves q and k alike before rotate_half, which
  // permutes the same dims of both and leaves every score as it is.
  SHARDD_ASSIGN_OR_RETURN(const bool interleave,
                          r.BoolOr("rope_interleave", true));
  attention->mutable_rope()->set_interleaved(interleave);
  v1::MlaSpec* mla = attention->mutable_mla();
  mla->set_q_lora_rank(q_lora);
  mla->set_kv_lora_rank(kv_lora);
  mla->set_qk_nope_head_dim(nope);
  mla->set_qk_rope_head_dim(rope);
  mla->set_v_head_dim(v_hd);
  // DeepseekV3Attention.scaling: qk_head_dim^-0.5, times mscale^2 when the
  // rope scaling names mscale_all_dim (whatever its type).
  double scale = 1.0 / std::sqrt(static_cast<double>(qk_hd));
  const v1::RopeSpec& rope_spec = attention->rope();
  if (rope_spec.mscale_all_dim() != 0 && rope_spec.factor() > 1.0) {
    const double m =
        0.1 * rope_spec.mscale_all_dim() * std::log(rope_spec.factor()) + 1.0;
    scale *= m * m;
  }
  attention->set_softmax_scale(scale);
  return spec;
}

absl::StatusOr<v1::ModelSpec> BuildGptOss(const ConfigReader& r,
                                          const std::string& arch) {
  SHARDD_ASSIGN_OR_RETURN(CommonConfig c, ReadCommon(r, arch, false));
  // The clamped "swigluoai"; the checkpoint's interleaved gate/up columns
  // are de-interleaved on import into the concatenated halves.
  c.activation = v1::SWIGLU_OAI;
  SHARDD_ASSIGN_OR_RETURN(const double limit,
                          r.NonNegativeDoubleOr("swiglu_limit", 7.0));
  SHARDD_ASSIGN_OR_RETURN(const double alpha,
                          r.NonNegativeDoubleOr("swiglu_alpha", 1.702));
  if (!(limit > 0) || !(alpha > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "swiglu_limit / swiglu_alpha: must be > 0, got ", limit, " / ", alpha));
  }
  SHARDD_ASSIGN_OR_RETURN(Heads h, ReadHeads(r, c.hidden));
  SHARDD_ASSIGN_OR_RETURN(bool attn_bias, r.BoolOr("attention_bias", true));
  SHARDD_ASSIGN_OR_RETURN(int64_t inter,
                          r.Int("intermediate_size", 1, kMaxIntermediate));
  SHARDD_ASSIGN_OR_RETURN(int64_t e,
                          r.Int("num_local_experts", 1, kMaxExperts));
  const std::string topk_key = r.Has("num_experts_per_tok")
                                   ? "num_experts_per_tok"
                                   : "experts_per_token";
  SHARDD_ASSIGN_OR_RETURN(int64_t k, ReadTopK(r, topk_key, e));
  Builder b(c.dtype);
  SHARDD_ASSIGN_OR_RETURN(
      v1::ModelSpec spec, BuildDecoder(c, b, [&](int, v1::ModuleSpec* layer) {
        v1::ModuleSpec* a =
            b.Attention(layer, c.hidden, h.nh, h.nkv, h.hd, attn_bias);
        b.Param(a, "sinks", {h.nh});  // One learned attention sink per head.
        // HF: mlp.router.{weight,bias}, mlp.experts.{gate_up_proj,down_proj}
        // (+ _bias); the checkpoint interleaves gate/up columns.
        v1::ModuleSpec* moe = Builder::Child(layer, "moe", v1::MODULE_MOE);
        v1::ModuleSpec* gate = Builder::Child(moe, "gate", v1::MODULE_ROUTER);
        b.Param(gate, "weight", {e, c.hidden});
        b.Param(gate, "bias", {e});
        b.Experts(moe, e, c.hidden, inter, true);
        b.Norm(layer, "input_layernorm", c.hidden);
        b.Norm(layer, "post_attention_layernorm", c.hidden);
        return absl::OkStatus();
      }));
  v1::ModelDims* d = spec.mutable_dims();
  SetHeadDims(h, d);
  d->set_num_experts(static_cast<int32_t>(e));
  d->set_top_k(static_cast<int32_t>(k));
  d->set_moe_intermediate_size(inter);
  d->set_router_scoring(v1::ROUTER_TOPK_THEN_SOFTMAX);
  d->set_swiglu_limit(limit);
  d->set_swiglu_alpha(alpha);
  SHARDD_RETURN_IF_ERROR(ReadRouterAuxLoss(r, 0.9, d));
  v1::AttentionSpec* attention = d->mutable_attention();
  SHARDD_RETURN_IF_ERROR(
      ReadAttention(r, c.layers, SlidingLayers::kAlternate, attention));
  if (!r.Has("rope_parameters") && !r.Has("rope_scaling")) {
    // GptOssConfig's default rope: yarn, factor 32 over 4096 positions,
    // untruncated, theta 150000.
    v1::RopeSpec* rope = attention->mutable_rope();
    rope->set_type("yarn");
    rope->set_factor(32.0);
    rope->set_beta_fast(32.0);
    rope->set_beta_slow(1.0);
    rope->set_original_max_position_embeddings(4096);
    rope->set_untruncated(true);
  }
  std::string where;
  const json* params = r.Find("rope_parameters", &where);
  if (!r.Has("rope_theta") && !(params != nullptr && params->is_object() &&
                                params->contains("rope_theta"))) {
    attention->mutable_rope()->set_theta(150000.0);  // GptOssConfig's.
  }
  attention->set_bias(attn_bias);
  attention->set_sinks(true);
  return spec;
}

using ArchBuilder = absl::StatusOr<v1::ModelSpec> (*)(const ConfigReader&,
                                                      const std::string&);

const std::map<std::string, ArchBuilder>& Builders() {
  static const auto* builders = new std::map<std::string, ArchBuilder>{
      {"DeepseekV3ForCausalLM", &BuildDeepseekV3},
      {"DiffusionGemmaForBlockDiffusion", &BuildDiffusionGemma},
      {"GptOssForCausalLM", &BuildGptOss},
      {"LlamaForCausalLM", &BuildLlama},
      {"MixtralForCausalLM", &BuildMixtral},
      {"Qwen3MoeForCausalLM", &BuildQwen3Moe},
  };
  return *builders;
}

}  // namespace

std::vector<std::string> SupportedArchitectures() {
  std::vector<std::string> names;
  for (const auto& [name, builder] : Builders()) names.push_back(name);
  return names;  // std::map keeps them sorted.
}

absl::StatusOr<v1::ModelSpec> ModelSpecFromHfConfig(absl::string_view text) {
  const json doc = json::parse(text.begin(), text.end(), nullptr,
                               /*allow_exceptions=*/false);
  if (doc.is_discarded()) {
    return absl::InvalidArgumentError(
        "config.json: malformed JSON; expected one JSON object");
  }
  if (!doc.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: must be a JSON object, got ", DescribeJson(doc)));
  }
  const std::string supported = absl::StrCat(
      "supported: ", absl::StrJoin(SupportedArchitectures(), ", "));
  auto it = doc.find("architectures");
  if (it == doc.end() || it->is_null()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "architectures: missing; must be an array of class names (", supported,
        ")"));
  }
  if (!it->is_array() || it->empty() || !(*it)[0].is_string()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "architectures: must be a non-empty array of class name strings, got ",
        DescribeJson(*it), " (", supported, ")"));
  }
  const std::string arch = (*it)[0].get<std::string>();
  auto builder = Builders().find(arch);
  if (builder == Builders().end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "architectures[0]: unknown architecture \"", arch, "\"; ", supported));
  }
  ConfigReader reader(doc);
  SHARDD_ASSIGN_OR_RETURN(v1::ModelSpec spec, builder->second(reader, arch));
  absl::Status valid = ValidateModelSpec(spec);
  if (!valid.ok()) {
    // In-range sizes can still multiply past the element limit.
    return absl::InvalidArgumentError(
        absl::StrCat("config sizes give an invalid model: ", valid.message()));
  }
  return spec;
}

}  // namespace shardd
