#include "model/hf_config.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"
#include "common/status_macros.h"
#include "model/config_reader.h"
#include "model/hf_attention.h"
#include "model/json_describe.h"
#include "model/model_util.h"
#include "nlohmann/json.hpp"

namespace shardd {
namespace {

using hf_internal::ConfigReader;
using hf_internal::ReadAttention;
using hf_internal::SlidingLayers;
using nlohmann::json;

// Upper bounds well above any published model; they keep every shape product
// inside int64 (ValidateModelSpec then enforces the 2^53 element limit).
constexpr int64_t kMaxVocab = int64_t{1} << 24;
constexpr int64_t kMaxHidden = int64_t{1} << 20;
constexpr int64_t kMaxIntermediate = int64_t{1} << 22;
constexpr int64_t kMaxLayers = 4096;
constexpr int64_t kMaxHeads = int64_t{1} << 16;
constexpr int64_t kMaxHeadDim = int64_t{1} << 16;
constexpr int64_t kMaxExperts = int64_t{1} << 16;
constexpr int64_t kMaxRank = int64_t{1} << 20;

// ---- Tree building ----------------------------------------------------------

class Builder {
 public:
  explicit Builder(v1::DType dtype) : dtype_(dtype) {}

  v1::DType dtype() const { return dtype_; }

  static v1::ModuleSpec* Child(v1::ModuleSpec* parent, const std::string& name,
                               v1::ModuleKind kind) {
    v1::ModuleSpec* m = parent->add_children();
    m->set_name(name);
    m->set_kind(kind);
    return m;
  }

  v1::TensorSpec* Param(v1::ModuleSpec* m, const std::string& name,
                        std::initializer_list<int64_t> shape) const {
    return ParamOf(m, name, shape, dtype_);
  }

  static v1::TensorSpec* ParamOf(v1::ModuleSpec* m, const std::string& name,
                                 std::initializer_list<int64_t> shape,
                                 v1::DType dtype) {
    v1::TensorSpec* t = m->add_params();
    t->set_name(name);
    for (int64_t d : shape) t->add_shape(d);
    t->set_dtype(dtype);
    return t;
  }

  // nn.Linear(in, out): weight [out, in], optional bias [out].
  v1::ModuleSpec* Linear(v1::ModuleSpec* parent, const std::string& name,
                         int64_t in, int64_t out, bool bias) const {
    v1::ModuleSpec* m = Child(parent, name, v1::MODULE_GENERIC);
    Param(m, "weight", {out, in});
    if (bias) Param(m, "bias", {out});
    return m;
  }

  v1::ModuleSpec* Norm(v1::ModuleSpec* parent, const std::string& name,
                       int64_t dim) const {
    v1::ModuleSpec* m = Child(parent, name, v1::MODULE_NORM);
    Param(m, "weight", {dim});
    return m;
  }

  // Dense gated MLP: gate_proj, up_proj [I, H], down_proj [H, I].
  v1::ModuleSpec* GatedMlp(v1::ModuleSpec* parent, const std::string& name,
                           int64_t hidden, int64_t inter,
                           bool bias = false) const {
    v1::ModuleSpec* m = Child(parent, name, v1::MODULE_MLP);
    Linear(m, "gate_proj", hidden, inter, bias);
    Linear(m, "up_proj", hidden, inter, bias);
    Linear(m, "down_proj", inter, hidden, bias);
    return m;
  }

  // Stacked routed experts [E, H, 2I] / [E, I, H], optional biases.
  v1::ModuleSpec* Experts(v1::ModuleSpec* moe, int64_t e, int64_t hidden,
                          int64_t inter, bool bias) const {
    v1::ModuleSpec* m = Child(moe, "experts", v1::MODULE_GROUPED_EXPERTS);
    Param(m, "gate_and_up_projs", {e, hidden, 2 * inter});
    if (bias) Param(m, "gate_up_proj_bias", {e, 2 * inter});
    Param(m, "down_projs", {e, inter, hidden});
    if (bias) Param(m, "down_proj_bias", {e, hidden});
    return m;
  }

  // Standard multi-head / grouped-query attention projections.
  v1::ModuleSpec* Attention(v1::ModuleSpec* layer, int64_t hidden, int64_t nh,
                            int64_t nkv, int64_t hd, bool bias) const {
    v1::ModuleSpec* a = Child(layer, "self_attn", v1::MODULE_ATTENTION);
    Linear(a, "q_proj", hidden, nh * hd, bias);
    Linear(a, "k_proj", hidden, nkv * hd, bias);
    Linear(a, "v_proj", hidden, nkv * hd, bias);
    Linear(a, "o_proj", nh * hd, hidden, bias);
    return a;
  }

 private:
  v1::DType dtype_;
};

// Fields every supported architecture shares.
struct CommonConfig {
  std::string architecture;
  std::string model_type;
  v1::DType dtype = v1::BFLOAT16;
  int64_t vocab = 0;
  int64_t hidden = 0;
  int64_t layers = 0;
  bool tie = false;
  double eps = 1e-6;
  v1::Activation activation = v1::SWIGLU;
};

// The usual decoder skeleton: root {model {embed_tokens, layers, norm},
// lm_head}. `fill_layer` builds decoder layer i.
absl::StatusOr<v1::ModelSpec> BuildDecoder(
    const CommonConfig& c, const Builder& b,
    const std::function<absl::Status(int, v1::ModuleSpec*)>& fill_layer,
    const std::function<void(v1::ModuleSpec*)>& extra_backbone = nullptr) {
  v1::ModelSpec spec;
  spec.set_architecture(c.architecture);
  spec.set_model_type(c.model_type);
  spec.set_dtype(c.dtype);
  v1::ModuleSpec* root = spec.mutable_root();
  root->set_kind(v1::MODULE_MODEL);
  v1::ModuleSpec* model = Builder::Child(root, "model", v1::MODULE_GENERIC);
  v1::ModuleSpec* embed =
      Builder::Child(model, "embed_tokens", v1::MODULE_EMBEDDING);
  b.Param(embed, "weight", {c.vocab, c.hidden});
  v1::ModuleSpec* layers =
      Builder::Child(model, "layers", v1::MODULE_LAYER_LIST);
  for (int i = 0; i < c.layers; ++i) {
    v1::ModuleSpec* layer =
        Builder::Child(layers, absl::StrCat(i), v1::MODULE_DECODER_LAYER);
    SHARDD_RETURN_IF_ERROR(fill_layer(i, layer));
  }
  b.Norm(model, "norm", c.hidden);
  if (extra_backbone) extra_backbone(model);
  v1::ModuleSpec* head = Builder::Child(root, "lm_head", v1::MODULE_LM_HEAD);
  v1::TensorSpec* w = b.Param(head, "weight", {c.vocab, c.hidden});
  if (c.tie) w->set_tied_to("model.embed_tokens.weight");

  v1::ModelDims* d = spec.mutable_dims();
  d->set_vocab_size(c.vocab);
  d->set_hidden_size(c.hidden);
  d->set_num_layers(static_cast<int32_t>(c.layers));
  d->set_activation(c.activation);
  d->set_tie_word_embeddings(c.tie);
  d->set_rms_norm_eps(c.eps);
  return spec;
}

absl::StatusOr<v1::Activation> ActivationFromConfig(const ConfigReader& r,
                                                    const std::string& key,
                                                    v1::Activation def) {
  SHARDD_ASSIGN_OR_RETURN(std::string act, r.StringOr(key, ""));
  if (act.empty()) return def;
  if (act == "silu" || act == "swish" || act == "swiglu") return v1::SWIGLU;
  if (act == "gelu" || act == "gelu_pytorch_tanh" || act == "gelu_new" ||
      act == "gelu_fast" || act == "geglu") {
    return v1::GEGLU;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      key, ": unsupported activation \"", act,
      "\"; allowed: silu, swish (SwiGLU), gelu, gelu_pytorch_tanh, gelu_new "
      "(GeGLU)"));
}

absl::StatusOr<CommonConfig> ReadCommon(const ConfigReader& r,
                                        const std::string& architecture,
                                        bool default_tie) {
  CommonConfig c;
  c.architecture = architecture;
  SHARDD_ASSIGN_OR_RETURN(c.model_type, r.StringOr("model_type", ""));
  // Newer transformers write "dtype", older ones "torch_dtype".
  std::string dtype_key = r.Has("torch_dtype") ? "torch_dtype" : "dtype";
  SHARDD_ASSIGN_OR_RETURN(std::string dtype_name,
                          r.StringOr(dtype_key, "bfloat16"));
  if (dtype_name == "auto") dtype_name = "bfloat16";
  auto dtype = ParseDType(dtype_name);
  if (!dtype.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(dtype_key, ": ", dtype.status().message()));
  }
  if (*dtype != v1::FLOAT32 && *dtype != v1::BFLOAT16 &&
      *dtype != v1::FLOAT16) {
    return absl::InvalidArgumentError(
        absl::StrCat(dtype_key, ": parameter dtype \"", dtype_name,
                     "\" is not supported; allowed: float32, bfloat16, "
                     "float16"));
  }
  c.dtype = *dtype;
  SHARDD_ASSIGN_OR_RETURN(c.vocab, r.Int("vocab_size", 1, kMaxVocab));
  SHARDD_ASSIGN_OR_RETURN(c.hidden, r.Int("hidden_size", 1, kMaxHidden));
  SHARDD_ASSIGN_OR_RETURN(c.layers, r.Int("num_hidden_layers", 1, kMaxLayers));
  SHARDD_ASSIGN_OR_RETURN(c.tie, r.BoolOr("tie_word_embeddings", default_tie));
  SHARDD_ASSIGN_OR_RETURN(c.eps, r.NonNegativeDoubleOr("rms_norm_eps", 1e-6));
  return c;
}

// Attention head geometry shared by the GQA architectures.
struct Heads {
  int64_t nh = 0;
  int64_t nkv = 0;
  int64_t hd = 0;
};

absl::StatusOr<Heads> ReadHeads(const ConfigReader& r, int64_t hidden) {
  Heads h;
  SHARDD_ASSIGN_OR_RETURN(h.nh, r.Int("num_attention_heads", 1, kMaxHeads));
  SHARDD_ASSIGN_OR_RETURN(h.nkv,
                          r.IntOr("num_key_value_heads", h.nh, 1, kMaxHeads));
  if (h.nh % h.nkv != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_key_value_heads: must divide num_attention_heads (",
                     h.nh, "), got ", h.nkv));
  }
  if (r.Has("head_dim")) {
    SHARDD_ASSIGN_OR_RETURN(h.hd, r.Int("head_dim", 1, kMaxHeadDim));
  } else {
    if (hidden % h.nh != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "head_dim: missing, and hidden_size (", hidden,
          ") is not a multiple of num_attention_heads (", h.nh,
          "); set head_dim to an integer in [1, ", kMaxHeadDim, "]"));
    }
    h.hd = hidden / h.nh;
  }
  return h;
}

void SetHeadDims(const Heads& h, v1::ModelDims* d) {
  d->set_num_attention_heads(static_cast<int32_t>(h.nh));
  d->set_num_key_value_heads(static_cast<int32_t>(h.nkv));
  d->set_head_dim(h.hd);
}

absl::StatusOr<int64_t> ReadTopK(const ConfigReader& r, const std::string& key,
                                 int64_t experts) {
  std::string name;
  if (r.Find(key, &name) == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(key, ": missing; must be an integer in [1, ", experts,
                     "] (at most the number of experts)"));
  }
  return r.Int(key, 1, experts);
}

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
  SHARDD_ASSIGN_OR_RETURN(int64_t e, r.Int("num_experts", 1, kMaxExperts));
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

absl::StatusOr<v1::ModelSpec> BuildDiffusionGemma(const ConfigReader& r,
                                                  const std::string& arch) {
  SHARDD_ASSIGN_OR_RETURN(CommonConfig c, ReadCommon(r, arch, true));
  if (!c.tie) {
    return absl::InvalidArgumentError(
        "tie_word_embeddings: DiffusionGemmaForBlockDiffusion always ties "
        "lm_head to the embedding; must be true or absent");
  }
  SHARDD_ASSIGN_OR_RETURN(
      c.activation, ActivationFromConfig(r, "hidden_activation", v1::GEGLU));
  SHARDD_ASSIGN_OR_RETURN(Heads h, ReadHeads(r, c.hidden));
  SHARDD_ASSIGN_OR_RETURN(int64_t global_hd,
                          r.IntOr("global_head_dim", h.hd, 1, kMaxHeadDim));
  SHARDD_ASSIGN_OR_RETURN(
      int64_t global_nkv,
      r.IntOr("num_global_key_value_heads", h.nkv, 1, kMaxHeads));
  SHARDD_ASSIGN_OR_RETURN(bool attn_bias, r.BoolOr("attention_bias", false));
  SHARDD_ASSIGN_OR_RETURN(int64_t inter,
                          r.Int("intermediate_size", 1, kMaxIntermediate));
  SHARDD_ASSIGN_OR_RETURN(int64_t moe_inter,
                          r.Int("moe_intermediate_size", 1, kMaxIntermediate));
  SHARDD_ASSIGN_OR_RETURN(int64_t e, r.Int("num_experts", 1, kMaxExperts));
  SHARDD_ASSIGN_OR_RETURN(int64_t k, ReadTopK(r, "top_k_experts", e));
  SHARDD_ASSIGN_OR_RETURN(int64_t pattern,
                          r.IntOr("sliding_window_pattern", 6, 1, kMaxLayers));
  // Full-attention layers come from layer_types, else every pattern-th layer.
  std::vector<bool> full(c.layers, false);
  {
    std::string name;
    const json* v = r.Find("layer_types", &name);
    if (v != nullptr) {
      if (!v->is_array() || static_cast<int64_t>(v->size()) != c.layers) {
        return absl::InvalidArgumentError(absl::StrCat(
            name, ": must be an array of num_hidden_layers (", c.layers,
            ") strings \"sliding_attention\" or \"full_attention\""));
      }
      for (int64_t i = 0; i < c.layers; ++i) {
        const json& x = (*v)[i];
        if (x.is_string() && x.get<std::string>() == "full_attention") {
          full[i] = true;
        } else if (!x.is_string() ||
                   x.get<std::string>() != "sliding_attention") {
          return absl::InvalidArgumentError(absl::StrCat(
              name, "[", i,
              "]: must be \"sliding_attention\" or \"full_attention\""));
        }
      }
    } else {
      for (int64_t i = 0; i < c.layers; ++i) full[i] = (i + 1) % pattern == 0;
    }
  }
  Builder b(c.dtype);
  SHARDD_ASSIGN_OR_RETURN(
      v1::ModelSpec spec,
      BuildDecoder(
          c, b,
          [&](int i, v1::ModuleSpec* layer) {
            // Full-attention layers: wider heads, fewer KV heads and no v_proj
            // (V is the pre-norm K).
            const int64_t hd = full[i] ? global_hd : h.hd;
            const int64_t nkv = full[i] ? global_nkv : h.nkv;
            v1::ModuleSpec* a =
                Builder::Child(layer, "self_attn", v1::MODULE_ATTENTION);
            b.Linear(a, "q_proj", c.hidden, h.nh * hd, attn_bias);
            b.Linear(a, "k_proj", c.hidden, nkv * hd, attn_bias);
            if (!full[i]) b.Linear(a, "v_proj", c.hidden, nkv * hd, attn_bias);
            b.Linear(a, "o_proj", h.nh * hd, c.hidden, attn_bias);
            b.Norm(a, "q_norm", hd);
            b.Norm(a, "k_norm", hd);
            b.GatedMlp(layer, "mlp", c.hidden, inter);
            v1::ModuleSpec* moe = Builder::Child(layer, "moe", v1::MODULE_MOE);
            // Gemma4Gate: proj [E, H] and a per-channel scale [H]. NeMo
            // freezes the router by default (freeze_router=True).
            v1::ModuleSpec* gate =
                Builder::Child(moe, "gate", v1::MODULE_ROUTER);
            b.Param(gate, "scale", {c.hidden})->set_frozen(true);
            v1::ModuleSpec* proj =
                Builder::Child(gate, "proj", v1::MODULE_GENERIC);
            b.Param(proj, "weight", {e, c.hidden})->set_frozen(true);
            b.Experts(moe, e, c.hidden, moe_inter, false);
            for (const char* norm :
                 {"input_layernorm", "post_attention_layernorm",
                  "pre_feedforward_layernorm", "post_feedforward_layernorm_1",
                  "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2",
                  "post_feedforward_layernorm"}) {
              b.Norm(layer, norm, c.hidden);
            }
            // A buffer in the reference model: sharded with the layer, never
            // trained.
            b.Param(layer, "layer_scalar", {1})->set_frozen(true);
            return absl::OkStatus();
          },
          [&](v1::ModuleSpec* model) {
            // Mixes the token embeddings with the softmax-weighted embeddings
            // of the previous pass: Linear(2H -> H), no bias (see
            // docs/model-spec.md).
            v1::ModuleSpec* sc =
                Builder::Child(model, "self_conditioning", v1::MODULE_GENERIC);
            b.Linear(sc, "proj", 2 * c.hidden, c.hidden, false);
          }));
  v1::ModelDims* d = spec.mutable_dims();
  SetHeadDims(h, d);
  d->set_num_experts(static_cast<int32_t>(e));
  d->set_top_k(static_cast<int32_t>(k));
  d->set_moe_intermediate_size(moe_inter);
  d->set_dense_intermediate_size(inter);
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
