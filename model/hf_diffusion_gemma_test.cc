// DiffusionGemmaForBlockDiffusion's config.json (model/hf_diffusion_gemma):
// the released google/diffusiongemma-26B-A4B-it config in
// tests/data/diffusion_gemma_26b.json and variations of it.

#include <cmath>
#include <cstdint>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/hf_config.h"
#include "model/model_util.h"
#include "model/rope_frequencies.h"
#include "nlohmann/json.hpp"

namespace shardd {
namespace {

using ::nlohmann::json;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

json Released() {
  std::ifstream in("tests/data/diffusion_gemma_26b.json");
  std::stringstream ss;
  ss << in.rdbuf();
  json j = json::parse(ss.str(), nullptr, false);
  EXPECT_FALSE(j.is_discarded());
  return j;
}

absl::StatusOr<v1::ModelSpec> Parse(const json& j) {
  return ModelSpecFromHfConfig(j.dump());
}

std::map<std::string, v1::TensorSpec> ParamMap(const v1::ModelSpec& spec) {
  std::map<std::string, v1::TensorSpec> out;
  for (const ParamRef& p : ListParams(spec)) out[p.fqn] = *p.tensor;
  return out;
}

std::vector<int64_t> Shape(const std::map<std::string, v1::TensorSpec>& m,
                           const std::string& fqn) {
  auto it = m.find(fqn);
  if (it == m.end()) return {-1};  // Makes the failing expectation readable.
  return {it->second.shape().begin(), it->second.shape().end()};
}

std::vector<std::string> ParamNames(const v1::ModelSpec& spec) {
  std::vector<std::string> out;
  for (const ParamRef& p : ListParams(spec)) out.push_back(p.fqn);
  return out;
}

// The released sizes (text_config of google/diffusiongemma-26B-A4B-it).
constexpr int64_t kV = 262144, kH = 2816, kL = 30, kE = 128, kMi = 704,
                  kDi = 2112, kNh = 16, kNkv = 8, kHd = 256, kGnkv = 2,
                  kGhd = 512;

TEST(HfDiffusionGemmaTest, ReleasedConfigShapes) {
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ModelSpec spec, Parse(Released()));
  EXPECT_EQ(spec.architecture(), "DiffusionGemmaForBlockDiffusion");
  EXPECT_EQ(spec.model_type(), "diffusion_gemma");
  EXPECT_EQ(spec.dtype(), v1::BFLOAT16);
  const auto m = ParamMap(spec);
  EXPECT_THAT(Shape(m, "model.embed_tokens.weight"), ElementsAre(kV, kH));
  EXPECT_EQ(m.at("lm_head.weight").tied_to(), "model.embed_tokens.weight");
  EXPECT_THAT(Shape(m, "model.layers.0.moe.experts.gate_and_up_projs"),
              ElementsAre(kE, kH, 2 * kMi));
  EXPECT_THAT(Shape(m, "model.layers.29.moe.experts.down_projs"),
              ElementsAre(kE, kMi, kH));
  EXPECT_THAT(Shape(m, "model.layers.0.moe.gate.proj.weight"),
              ElementsAre(kE, kH));
  EXPECT_THAT(Shape(m, "model.layers.0.moe.gate.scale"), ElementsAre(kH));
  EXPECT_TRUE(m.at("model.layers.0.moe.gate.proj.weight").frozen());
  EXPECT_TRUE(m.at("model.layers.0.moe.gate.scale").frozen());
  EXPECT_THAT(Shape(m, "model.layers.0.mlp.gate_proj.weight"),
              ElementsAre(kDi, kH));
  EXPECT_THAT(Shape(m, "model.layers.0.mlp.down_proj.weight"),
              ElementsAre(kH, kDi));
  EXPECT_THAT(Shape(m, "model.layers.0.layer_scalar"), ElementsAre(1));
  EXPECT_TRUE(m.at("model.layers.0.layer_scalar").frozen());
  // Sliding layer 4 vs the full-attention layers (every 6th).
  EXPECT_THAT(Shape(m, "model.layers.4.self_attn.q_proj.weight"),
              ElementsAre(kNh * kHd, kH));
  EXPECT_THAT(Shape(m, "model.layers.4.self_attn.v_proj.weight"),
              ElementsAre(kNkv * kHd, kH));
  EXPECT_THAT(Shape(m, "model.layers.4.self_attn.q_norm.weight"),
              ElementsAre(kHd));
  for (int full : {5, 11, 17, 23, 29}) {
    const std::string a = absl::StrCat("model.layers.", full, ".self_attn.");
    EXPECT_EQ(m.count(a + "v_proj.weight"), 0u) << full;
    EXPECT_THAT(Shape(m, a + "q_proj.weight"), ElementsAre(kNh * kGhd, kH));
    EXPECT_THAT(Shape(m, a + "k_proj.weight"), ElementsAre(kGnkv * kGhd, kH));
    EXPECT_THAT(Shape(m, a + "o_proj.weight"), ElementsAre(kH, kNh * kGhd));
    EXPECT_THAT(Shape(m, a + "k_norm.weight"), ElementsAre(kGhd));
  }
  // DiffusionGemmaSelfConditioning: pre_norm and a gated MLP of
  // intermediate_size (its post_norm has no weight).
  EXPECT_THAT(Shape(m, "model.self_conditioning.pre_norm.weight"),
              ElementsAre(kH));
  EXPECT_THAT(Shape(m, "model.self_conditioning.gate_proj.weight"),
              ElementsAre(kDi, kH));
  EXPECT_THAT(Shape(m, "model.self_conditioning.up_proj.weight"),
              ElementsAre(kDi, kH));
  EXPECT_THAT(Shape(m, "model.self_conditioning.down_proj.weight"),
              ElementsAre(kH, kDi));
  // Neither the vision tower nor the folded per_expert_scale.
  for (const std::string& name : ParamNames(spec)) {
    EXPECT_EQ(name.find("vision"), std::string::npos) << name;
    EXPECT_EQ(name.find("per_expert_scale"), std::string::npos) << name;
    EXPECT_EQ(name.find("decoder"), std::string::npos) << name;
  }
}

TEST(HfDiffusionGemmaTest, ReleasedConfigTotals) {
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ModelSpec spec, Parse(Released()));
  const int64_t experts = kE * kH * 2 * kMi + kE * kMi * kH;
  const int64_t router = kE * kH + kH;
  const int64_t common = experts + 3 * kH * kDi + router + 7 * kH + 1;
  const int64_t sliding = 2 * kH * kNh * kHd + 2 * kH * kNkv * kHd + 2 * kHd;
  const int64_t global = 2 * kH * kNh * kGhd + kH * kGnkv * kGhd + 2 * kGhd;
  const int64_t self_conditioning = kH + 3 * kH * kDi;
  const int64_t total = kV * kH + kH + self_conditioning + kL * common +
                        25 * sliding + 5 * global;
  const v1::ModelSummary s = Summarize(spec);
  EXPECT_EQ(s.total_params(), total);
  EXPECT_EQ(s.total_params(), 25'250'982'942);
  // The model card: 25.2B total, 3.8B active.
  EXPECT_NEAR(s.total_params() / 25.2e9, 1.0, 0.005);
  EXPECT_EQ(s.expert_params(), kL * experts);
  EXPECT_EQ(s.trainable_params(), total - kL * (router + 1));
  EXPECT_NEAR(s.active_params() / 3.8e9, 1.0, 0.01);
  // embed_tokens, lm_head, norm, self_conditioning's 4; 21 tensors in a
  // sliding layer, 20 (no v_proj) in a full one.
  EXPECT_EQ(s.num_param_tensors(), 2 + 1 + 4 + 25 * 21 + 5 * 20);
}

TEST(HfDiffusionGemmaTest, ReleasedConfigDims) {
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ModelSpec spec, Parse(Released()));
  const v1::ModelDims& d = spec.dims();
  EXPECT_EQ(d.num_layers(), kL);
  EXPECT_EQ(d.num_experts(), kE);
  EXPECT_EQ(d.top_k(), 8);
  EXPECT_EQ(d.activation(), v1::GEGLU);
  EXPECT_TRUE(d.tie_word_embeddings());
  EXPECT_EQ(d.dense_intermediate_size(), kDi);
  EXPECT_EQ(d.moe_intermediate_size(), kMi);
  EXPECT_EQ(d.num_attention_heads(), kNh);
  EXPECT_EQ(d.num_key_value_heads(), kNkv);
  EXPECT_EQ(d.head_dim(), kHd);
  EXPECT_EQ(d.router_scoring(), v1::ROUTER_SOFTMAX_THEN_TOPK);
  EXPECT_TRUE(d.norm_topk_prob());
  EXPECT_EQ(d.final_logit_softcapping(), 30.0);
  EXPECT_EQ(d.embedding_scale(), std::sqrt(2816.0));
  EXPECT_EQ(d.canvas_length(), 256);
  EXPECT_EQ(d.rms_norm_eps(), 1e-6);

  const v1::AttentionSpec& a = d.attention();
  EXPECT_EQ(a.max_position_embeddings(), 262144);
  EXPECT_EQ(a.sliding_window(), 1024);
  ASSERT_EQ(a.sliding_layers_size(), kL);
  for (int i = 0; i < kL; ++i) EXPECT_EQ(a.sliding_layers(i), i % 6 != 5) << i;
  EXPECT_EQ(a.global_head_dim(), kGhd);
  EXPECT_EQ(a.num_global_key_value_heads(), kGnkv);
  EXPECT_TRUE(a.values_from_keys());
  EXPECT_TRUE(a.qk_norm());
  EXPECT_TRUE(a.v_norm());
  EXPECT_FALSE(a.bias());
  EXPECT_FALSE(a.bidirectional());
  EXPECT_EQ(a.softmax_scale(), 1.0);
  EXPECT_EQ(a.rope().type(), "proportional");
  EXPECT_EQ(a.rope().theta(), 1e6);
  EXPECT_EQ(a.rope().partial_rotary_factor(), 0.25);
  EXPECT_EQ(a.sliding_rope().type(), "default");
  EXPECT_EQ(a.sliding_rope().theta(), 1e4);
  EXPECT_EQ(a.sliding_rope().partial_rotary_factor(), 1.0);
}

// Proportional RoPE on the 512-dim full heads: 256 frequencies, the first
// int(0.25 * 512 / 2) = 64 are 1e6^(-2i/512) (the exponent over the whole
// head, not the rotated part), the other 192 are 0 and leave their dims
// as they are.
TEST(HfDiffusionGemmaTest, RopeTablesPerLayerType) {
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ModelSpec spec, Parse(Released()));
  const v1::AttentionSpec& a = spec.dims().attention();
  SHARDD_ASSERT_OK_AND_ASSIGN(
      RopeFrequencies full,
      ComputeRopeFrequencies(a.rope(), a.global_head_dim()));
  ASSERT_EQ(full.inv_freq.size(), 256u);
  EXPECT_EQ(full.inv_freq[0], 1.0f);
  EXPECT_EQ(full.inv_freq[1], static_cast<float>(std::pow(1e6, -2.0 / 512)));
  EXPECT_EQ(full.inv_freq[63], static_cast<float>(std::pow(1e6, -126.0 / 512)));
  for (size_t i = 64; i < 256; ++i) EXPECT_EQ(full.inv_freq[i], 0.0f) << i;
  SHARDD_ASSERT_OK_AND_ASSIGN(
      RopeFrequencies sliding,
      ComputeRopeFrequencies(a.sliding_rope(), spec.dims().head_dim()));
  ASSERT_EQ(sliding.inv_freq.size(), 128u);
  EXPECT_EQ(sliding.inv_freq[1], static_cast<float>(std::pow(1e4, -2.0 / 256)));
  EXPECT_GT(sliding.inv_freq[127], 0.0f);
}

TEST(HfDiffusionGemmaTest, FlatConfigReadsTheSame) {
  json released = Released();
  json flat = released["text_config"];
  flat["architectures"] = released["architectures"];
  flat["canvas_length"] = 256;
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ModelSpec nested, Parse(released));
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ModelSpec from_flat, Parse(flat));
  EXPECT_EQ(from_flat.model_type(), "diffusion_gemma_text");
  from_flat.set_model_type(nested.model_type());
  EXPECT_EQ(from_flat.SerializeAsString(), nested.SerializeAsString());
}

TEST(HfDiffusionGemmaTest, VisionConfigIsNeverRead) {
  json c = Released();
  c["vision_config"] = {{"hidden_size", -1}, {"num_hidden_layers", "x"}};
  SHARDD_EXPECT_OK(Parse(c).status());
  c.erase("vision_config");
  SHARDD_EXPECT_OK(Parse(c).status());
}

TEST(HfDiffusionGemmaTest, DiffusionGemmaTextConfigDefaults) {
  json c = Released();
  json& t = c["text_config"];
  for (const char* key :
       {"rope_parameters", "layer_types", "global_head_dim", "sliding_window",
        "num_global_key_value_heads", "final_logit_softcapping",
        "max_position_embeddings", "head_dim"}) {
    t.erase(key);
  }
  c.erase("canvas_length");
  t["num_hidden_layers"] = 14;
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ModelSpec spec, Parse(c));
  const auto m = ParamMap(spec);
  // Every 6th layer is full, and the last always is.
  for (int i = 0; i < 14; ++i) {
    const bool full = i == 5 || i == 11 || i == 13;
    EXPECT_EQ(
        m.count(absl::StrCat("model.layers.", i, ".self_attn.v_proj.weight")),
        full ? 0u : 1u)
        << i;
  }
  // global_head_dim 512 with the sliding layers' KV heads.
  EXPECT_THAT(Shape(m, "model.layers.13.self_attn.k_proj.weight"),
              ElementsAre(kNkv * 512, kH));
  EXPECT_THAT(Shape(m, "model.layers.0.self_attn.k_proj.weight"),
              ElementsAre(kNkv * 256, kH));
  const v1::ModelDims& d = spec.dims();
  EXPECT_EQ(d.final_logit_softcapping(), 30.0);
  EXPECT_EQ(d.canvas_length(), 256);
  EXPECT_EQ(d.attention().sliding_window(), 512);
  EXPECT_EQ(d.attention().max_position_embeddings(), 131072);
  EXPECT_EQ(d.attention().rope().type(), "proportional");
  EXPECT_EQ(d.attention().rope().partial_rotary_factor(), 0.25);
  EXPECT_EQ(d.attention().rope().theta(), 1e6);
  EXPECT_EQ(d.attention().sliding_rope().type(), "default");
  EXPECT_EQ(d.attention().sliding_rope().theta(), 1e4);

  // A layer_types list whose last layer slides is forced full, as the
  // config class does.
  c = Released();
  c["text_config"]["layer_types"][29] = "sliding_attention";
  SHARDD_ASSERT_OK_AND_ASSIGN(spec, Parse(c));
  EXPECT_EQ(ParamMap(spec).count("model.layers.29.self_attn.v_proj.weight"),
            0u);
  EXPECT_FALSE(spec.dims().attention().sliding_layers(29));

  // null: no cap; a null global_head_dim falls back to head_dim.
  c = Released();
  c["text_config"]["final_logit_softcapping"] = nullptr;
  c["text_config"]["global_head_dim"] = nullptr;
  c["text_config"]["rope_parameters"]["full_attention"] = {
      {"rope_type", "default"}, {"rope_theta", 1e6}};
  SHARDD_ASSERT_OK_AND_ASSIGN(spec, Parse(c));
  EXPECT_EQ(spec.dims().final_logit_softcapping(), 0.0);
  EXPECT_THAT(Shape(ParamMap(spec), "model.layers.5.self_attn.q_proj.weight"),
              ElementsAre(kNh * kHd, kH));
}

// transformers >= 5.15 writes per_layer_config instead of global_head_dim /
// num_global_key_value_heads.
TEST(HfDiffusionGemmaTest, PerLayerConfigForm) {
  json c = Released();
  json& t = c["text_config"];
  t.erase("global_head_dim");
  t.erase("num_global_key_value_heads");
  json per_layer = json::object();
  for (const char* layer : {"05", "11", "17", "23", "29"}) {
    per_layer[layer] = {{"head_dim", 512}, {"num_key_value_heads", 2}};
  }
  t["per_layer_config"] = per_layer;
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ModelSpec spec, Parse(c));
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ModelSpec released, Parse(Released()));
  EXPECT_EQ(spec.SerializeAsString(), released.SerializeAsString());

  json bad = c;
  bad["text_config"]["per_layer_config"]["11"]["head_dim"] = 256;
  EXPECT_THAT(Parse(bad),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("text_config.per_layer_config: layer 11 has "
                                 "head_dim 256")));
  bad = c;
  bad["text_config"]["per_layer_config"]["30"] = {{"head_dim", 512}};
  EXPECT_THAT(Parse(bad), StatusIs(absl::StatusCode::kInvalidArgument,
                                   HasSubstr("the key must be a layer index "
                                             "in [0, 29]")));
  bad = c;
  bad["text_config"]["per_layer_config"]["05"]["sliding_window"] = 4;
  EXPECT_THAT(Parse(bad),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("[\"05\"].sliding_window: not read; allowed: "
                                 "head_dim, num_key_value_heads")));
  bad = c;
  bad["text_config"]["per_layer_config"]["05"]["head_dim"] = 0;
  EXPECT_THAT(Parse(bad), StatusIs(absl::StatusCode::kInvalidArgument,
                                   HasSubstr("[\"05\"].head_dim: must be an "
                                             "integer in [1, 65536], got 0")));
}

TEST(HfDiffusionGemmaTest, BidirectionalAll) {
  json c = Released();
  c["text_config"]["use_bidirectional_attention"] = "all";
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ModelSpec spec, Parse(c));
  EXPECT_TRUE(spec.dims().attention().bidirectional());
  EXPECT_EQ(spec.dims().attention().sliding_window(), 1024 / 2 + 1);
}

TEST(HfDiffusionGemmaTest, BadInputNamesTheField) {
  const auto expect_error = [](const json& c, const std::string& what) {
    EXPECT_THAT(Parse(c),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(what)))
        << what;
  };
  json c = Released();
  c["text_config"]["layer_types"][3] = "global";
  expect_error(c,
               "text_config.layer_types[3]: must be \"sliding_attention\" "
               "or \"full_attention\", got \"global\"");
  c = Released();
  c["text_config"]["layer_types"].erase(0);
  expect_error(c,
               "text_config.layer_types: must be an array of "
               "num_hidden_layers (30)");
  c = Released();
  c["tie_word_embeddings"] = false;
  expect_error(c, "tie_word_embeddings: DiffusionGemmaForBlockDiffusion ties");
  c = Released();
  c["text_config"]["tie_word_embeddings"] = false;
  expect_error(c,
               "text_config.tie_word_embeddings: "
               "DiffusionGemmaForBlockDiffusion ties");
  c = Released();
  c["text_config"]["rope_parameters"].erase("sliding_attention");
  expect_error(c,
               "text_config.rope_parameters.sliding_attention: must be an "
               "object");
  c = Released();
  c["text_config"]["rope_parameters"] = {{"rope_type", "default"},
                                         {"rope_theta", 1e4}};
  expect_error(c,
               "text_config.rope_parameters.full_attention: must be an "
               "object");
  c = Released();
  c["text_config"]["rope_parameters"]["full_attention"]["rope_type"] =
      "default";
  expect_error(c,
               "rope_parameters.full_attention.rope_type: must be "
               "\"proportional\" when the full-attention head dim (512) "
               "differs from head_dim (256)");
  c = Released();
  c["text_config"]["rope_parameters"]["sliding_attention"]["rope_type"] =
      "longrope";
  expect_error(c,
               "text_config.rope_parameters.sliding_attention.rope_type: "
               "\"longrope\" is not supported");
  c = Released();
  c["text_config"]["use_bidirectional_attention"] = "text";
  expect_error(c,
               "use_bidirectional_attention: must be \"vision\", \"all\" "
               "or null");
  c = Released();
  c["canvas_length"] = 0;
  expect_error(c, "canvas_length: must be an integer in [1, 1048576], got 0");
  c = Released();
  c["text_config"]["num_global_key_value_heads"] = 3;
  expect_error(c,
               "num_global_key_value_heads: must divide "
               "num_attention_heads (16), got 3");
  c = Released();
  c["text_config"]["final_logit_softcapping"] = -1;
  expect_error(c,
               "text_config.final_logit_softcapping: must be a "
               "non-negative number");
  c = Released();
  c["text_config"]["top_k_experts"] = 129;
  expect_error(c, "text_config.top_k_experts: must be an integer in [1, 128]");
  c = Released();
  c["text_config"].erase("num_experts");
  expect_error(c, "num_experts: missing");
}

}  // namespace
}  // namespace shardd
