#include "model/hf_builder.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status_macros.h"

namespace shardd {
namespace hf_internal {

absl::StatusOr<v1::ModelSpec> BuildDecoder(
    const CommonConfig& c, const Builder& b,
    const std::function<absl::Status(int, v1::ModuleSpec*)>& fill_layer,
    const std::function<void(v1::ModuleSpec*)>& extra_backbone) {
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
  if (c.pad >= 0) d->set_pad_token_id(c.pad);
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
  // transformers builds the embedding with padding_idx = pad_token_id.
  SHARDD_ASSIGN_OR_RETURN(c.pad, r.IntOr("pad_token_id", -1, 0, c.vocab - 1));
  return c;
}

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

}  // namespace hf_internal
}  // namespace shardd
