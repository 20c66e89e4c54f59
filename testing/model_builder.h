#ifndef SHARDD_TESTING_MODEL_BUILDER_H_
#define SHARDD_TESTING_MODEL_BUILDER_H_

// Test helpers for writing module trees by hand (test-only target).

#include <cstdint>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "proto/model.pb.h"

namespace shardd {
namespace testing_util {

// Appends an fp32 parameter `name` of `shape` to module `m`.
inline v1::TensorSpec* AddParam(v1::ModuleSpec* m, const std::string& name,
                                std::vector<int64_t> shape) {
  v1::TensorSpec* t = m->add_params();
  t->set_name(name);
  for (int64_t d : shape) t->add_shape(d);
  t->set_dtype(v1::FLOAT32);
  return t;
}

// Appends a child module `name` of `kind` to module `m`.
inline v1::ModuleSpec* AddChild(v1::ModuleSpec* m, const std::string& name,
                                v1::ModuleKind kind) {
  v1::ModuleSpec* c = m->add_children();
  c->set_name(name);
  c->set_kind(kind);
  return c;
}

// The worker tests' tiny MoE LM: embedding [vocab, dim]; `layers` decoder
// layers of [input_layernorm, moe (router [experts, dim], grouped experts
// [experts, dim, 2 * inter] / [experts, inter, dim], top-k SwiGLU or GeGLU)
// and a dense mlp of `mlp` units ({gate,up,down}_proj.weight)]; final norm;
// lm_head, tied to the embedding unless `tied` is false.
struct TinyMoeShape {
  int64_t vocab = 30;  // 30 pads dim 0 over 4 ranks (2 rows on rank 3).
  int64_t dim = 16;
  int64_t experts = 4;
  int64_t inter = 8;
  int64_t mlp = 12;
  int layers = 2;
  int top_k = 2;
  bool geglu = false;
  bool tied = true;
  // Per layer: whether it has the MoE block and the dense MLP (empty: every
  // layer has both).
  std::vector<bool> moe_layers;
  std::vector<bool> mlp_layers;
  // Parameters (full names) marked frozen; freeze_router0 adds
  // model.layers.0.moe.gate.weight.
  std::set<std::string> frozen;
  bool freeze_router0 = false;
  // Self-attention before the MoE / MLP branch (Llama / Qwen3 style):
  // q/k/v/o projections, post_attention_layernorm, optional per-head q/k
  // norms, default RoPE; layers listed in `sliding_layers` use a sliding
  // window of `window` keys.
  bool attention = false;
  int heads = 2;
  int kv_heads = 1;
  int head_dim = 4;
  bool qk_norm = false;
  std::vector<bool> sliding_layers;
  int64_t window = 0;
};

// Qwen3-style attention on `s`: GQA of 4 query heads on 2 kv heads of 4,
// q/k norms, RoPE, layer 1 (of 2) sliding over 3 keys.
inline void AddQwen3Attention(TinyMoeShape* s) {
  s->attention = true;
  s->heads = 4;
  s->kv_heads = 2;
  s->head_dim = 4;
  s->qk_norm = true;
  s->sliding_layers = {false, true};
  s->window = 3;
}

inline v1::ModelSpec TinyMoeSpec(const TinyMoeShape& s) {
  v1::ModelSpec spec;
  spec.set_architecture("ShardMoEForCausalLM");
  spec.set_dtype(v1::FLOAT32);
  v1::ModelDims* dims = spec.mutable_dims();
  dims->set_vocab_size(s.vocab);
  dims->set_hidden_size(s.dim);
  dims->set_num_layers(s.layers);
  dims->set_num_experts(s.experts);
  dims->set_top_k(s.top_k);
  dims->set_moe_intermediate_size(s.inter);
  dims->set_dense_intermediate_size(s.mlp);
  dims->set_activation(s.geglu ? v1::GEGLU : v1::SWIGLU);
  dims->set_tie_word_embeddings(s.tied);
  dims->set_rms_norm_eps(1e-6);
  if (s.attention) {
    dims->set_num_attention_heads(s.heads);
    dims->set_num_key_value_heads(s.kv_heads);
    dims->set_head_dim(s.head_dim);
    dims->set_norm_topk_prob(true);
    v1::AttentionSpec* a = dims->mutable_attention();
    a->mutable_rope()->set_type("default");
    a->mutable_rope()->set_theta(10000.0);
    a->set_max_position_embeddings(256);
    a->set_qk_norm(s.qk_norm);
    for (bool b : s.sliding_layers) a->add_sliding_layers(b);
    a->set_sliding_window(s.window);
  }
  std::set<std::string> frozen = s.frozen;
  if (s.freeze_router0) frozen.insert("model.layers.0.moe.gate.weight");
  // AddParam under the full name `fqn`, frozen when listed.
  auto param = [&](v1::ModuleSpec* m, const std::string& name,
                   std::vector<int64_t> shape, const std::string& fqn) {
    v1::TensorSpec* t = AddParam(m, name, std::move(shape));
    if (frozen.count(fqn) > 0) t->set_frozen(true);
    return t;
  };
  v1::ModuleSpec* root = spec.mutable_root();
  root->set_kind(v1::MODULE_MODEL);
  v1::ModuleSpec* model = AddChild(root, "model", v1::MODULE_GENERIC);
  param(AddChild(model, "embed_tokens", v1::MODULE_EMBEDDING), "weight",
        {s.vocab, s.dim}, "model.embed_tokens.weight");
  v1::ModuleSpec* layers = AddChild(model, "layers", v1::MODULE_LAYER_LIST);
  for (int i = 0; i < s.layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    v1::ModuleSpec* layer =
        AddChild(layers, std::to_string(i), v1::MODULE_DECODER_LAYER);
    param(AddChild(layer, "input_layernorm", v1::MODULE_NORM), "weight",
          {s.dim}, p + "input_layernorm.weight");
    if (s.attention) {
      v1::ModuleSpec* attn = AddChild(layer, "self_attn", v1::MODULE_ATTENTION);
      const int64_t q = int64_t{s.heads} * s.head_dim;
      const int64_t kv = int64_t{s.kv_heads} * s.head_dim;
      for (const auto& [proj, out, in] :
           {std::tuple<const char*, int64_t, int64_t>{"q_proj", q, s.dim},
            {"k_proj", kv, s.dim},
            {"v_proj", kv, s.dim},
            {"o_proj", s.dim, q}}) {
        param(AddChild(attn, proj, v1::MODULE_GENERIC), "weight", {out, in},
              p + "self_attn." + proj + ".weight");
      }
      if (s.qk_norm) {
        for (const char* norm : {"q_norm", "k_norm"}) {
          param(AddChild(attn, norm, v1::MODULE_NORM), "weight", {s.head_dim},
                p + "self_attn." + norm + ".weight");
        }
      }
      param(AddChild(layer, "post_attention_layernorm", v1::MODULE_NORM),
            "weight", {s.dim}, p + "post_attention_layernorm.weight");
    }
    if (s.moe_layers.empty() || s.moe_layers[i]) {
      v1::ModuleSpec* moe = AddChild(layer, "moe", v1::MODULE_MOE);
      param(AddChild(moe, "gate", v1::MODULE_ROUTER), "weight",
            {s.experts, s.dim}, p + "moe.gate.weight");
      v1::ModuleSpec* experts =
          AddChild(moe, "experts", v1::MODULE_GROUPED_EXPERTS);
      param(experts, "gate_and_up_projs", {s.experts, s.dim, 2 * s.inter},
            p + "moe.experts.gate_and_up_projs");
      param(experts, "down_projs", {s.experts, s.inter, s.dim},
            p + "moe.experts.down_projs");
    }
    if (s.mlp_layers.empty() || s.mlp_layers[i]) {
      v1::ModuleSpec* dense = AddChild(layer, "mlp", v1::MODULE_MLP);
      for (const char* proj : {"gate_proj", "up_proj"}) {
        param(AddChild(dense, proj, v1::MODULE_GENERIC), "weight",
              {s.mlp, s.dim}, p + "mlp." + proj + ".weight");
      }
      param(AddChild(dense, "down_proj", v1::MODULE_GENERIC), "weight",
            {s.dim, s.mlp}, p + "mlp.down_proj.weight");
    }
  }
  param(AddChild(model, "norm", v1::MODULE_NORM), "weight", {s.dim},
        "model.norm.weight");
  v1::TensorSpec* head = param(AddChild(root, "lm_head", v1::MODULE_LM_HEAD),
                               "weight", {s.vocab, s.dim}, "lm_head.weight");
  if (s.tied) head->set_tied_to("model.embed_tokens.weight");
  return spec;
}

}  // namespace testing_util
}  // namespace shardd

#endif  // SHARDD_TESTING_MODEL_BUILDER_H_
