#ifndef SHARDD_MODEL_HF_BUILDER_H_
#define SHARDD_MODEL_HF_BUILDER_H_

// The tree-building helpers the Hugging Face architecture builders share
// (internal to model/: hf_config and the builders in their own files).

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/config_reader.h"
#include "proto/model.pb.h"

namespace shardd {
namespace hf_internal {

// Upper bounds well above any published model; they keep every shape product
// inside int64 (ValidateModelSpec then enforces the 2^53 element limit).
inline constexpr int64_t kMaxVocab = int64_t{1} << 24;
inline constexpr int64_t kMaxHidden = int64_t{1} << 20;
inline constexpr int64_t kMaxIntermediate = int64_t{1} << 22;
inline constexpr int64_t kMaxLayers = 4096;
inline constexpr int64_t kMaxHeads = int64_t{1} << 16;
inline constexpr int64_t kMaxHeadDim = int64_t{1} << 16;
inline constexpr int64_t kMaxExperts = int64_t{1} << 16;
inline constexpr int64_t kMaxRank = int64_t{1} << 20;

// Creates modules and parameters of one dtype.
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
  int64_t pad = -1;  // pad_token_id; -1: none.
};

// The usual decoder skeleton: root {model {embed_tokens, layers, norm,
// extra_backbone}, lm_head}. `fill_layer` builds decoder layer i.
absl::StatusOr<v1::ModelSpec> BuildDecoder(
    const CommonConfig& c, const Builder& b,
    const std::function<absl::Status(int, v1::ModuleSpec*)>& fill_layer,
    const std::function<void(v1::ModuleSpec*)>& extra_backbone = nullptr);

// hidden_act / hidden_activation: silu, swish -> SWIGLU; gelu and its tanh
// variants -> GEGLU; absent -> `def`. Anything else is INVALID_ARGUMENT.
absl::StatusOr<v1::Activation> ActivationFromConfig(const ConfigReader& r,
                                                    const std::string& key,
                                                    v1::Activation def);

// dtype, vocab_size, hidden_size, num_hidden_layers, tie_word_embeddings
// (else `default_tie`), rms_norm_eps.
absl::StatusOr<CommonConfig> ReadCommon(const ConfigReader& r,
                                        const std::string& architecture,
                                        bool default_tie);

// Attention head geometry shared by the GQA architectures.
struct Heads {
  int64_t nh = 0;
  int64_t nkv = 0;
  int64_t hd = 0;
};

// num_attention_heads, num_key_value_heads (default: all), head_dim
// (default hidden / heads).
absl::StatusOr<Heads> ReadHeads(const ConfigReader& r, int64_t hidden);

void SetHeadDims(const Heads& h, v1::ModelDims* d);

// A required top-k in [1, experts].
absl::StatusOr<int64_t> ReadTopK(const ConfigReader& r, const std::string& key,
                                 int64_t experts);

}  // namespace hf_internal
}  // namespace shardd

#endif  // SHARDD_MODEL_HF_BUILDER_H_
