#include "model/hf_config.h"

#include <cmath>
#include <cstdint>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "model/model_util.h"

namespace shardd {
namespace {

using ::nlohmann::json;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

std::string ReadTestFile(const std::string& name) {
  // Tests run from the runfiles root of the workspace.
  std::ifstream in("tests/data/" + name);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

json LoadJson(const std::string& name) {
  json j = json::parse(ReadTestFile(name), nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << name;
  return j;
}

// FQN -> tensor for quick lookups.
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

// |actual / expected - 1| <= rel.
void ExpectNear(int64_t actual, double expected, double rel) {
  EXPECT_LE(std::fabs(static_cast<double>(actual) / expected - 1.0), rel)
      << "actual " << actual << " vs expected " << expected;
}

const v1::ModuleSpec& Layer(const v1::ModelSpec& spec, int i) {
  return spec.root().children(0).children(1).children(i);
}

bool HasChild(const v1::ModuleSpec& m, const std::string& name) {
  for (const auto& c : m.children()) {
    if (c.name() == name) return true;
  }
  return false;
}

absl::StatusOr<v1::ModelSpec> Parse(const json& j) {
  return ModelSpecFromHfConfig(j.dump());
}

TEST(SupportedArchitecturesTest, SortedList) {
  EXPECT_THAT(
      SupportedArchitectures(),
      ElementsAre("DeepseekV3ForCausalLM", "DiffusionGemmaForBlockDiffusion",
                  "GptOssForCausalLM", "LlamaForCausalLM", "MixtralForCausalLM",
                  "Qwen3MoeForCausalLM"));
}

TEST(HfConfigTest, Llama3_8B) {
  SHARDD_ASSERT_OK_AND_ASSIGN(
      v1::ModelSpec spec,
      ModelSpecFromHfConfig(ReadTestFile("llama3_8b.json")));
  const int64_t v = 128256, h = 4096, l = 32, nh = 32, nkv = 8, hd = 128,
                i = 14336;
  const int64_t per_layer =
      2 * h * nh * hd + 2 * h * nkv * hd + 3 * h * i + 2 * h;
  const v1::ModelSummary s = Summarize(spec);
  EXPECT_EQ(s.total_params(), 2 * v * h + l * per_layer + h);
  ExpectNear(s.total_params(), 8.03e9, 0.001);
  EXPECT_EQ(s.expert_params(), 0);
  EXPECT_EQ(s.active_params(), s.total_params());
  EXPECT_EQ(s.num_param_tensors(), 2 + l * 9 + 1);

  const auto m = ParamMap(spec);
  EXPECT_THAT(Shape(m, "model.embed_tokens.weight"), ElementsAre(v, h));
  EXPECT_THAT(Shape(m, "model.layers.0.self_attn.q_proj.weight"),
              ElementsAre(nh * hd, h));
  EXPECT_THAT(Shape(m, "model.layers.31.self_attn.k_proj.weight"),
              ElementsAre(nkv * hd, h));
  EXPECT_THAT(Shape(m, "model.layers.7.mlp.down_proj.weight"),
              ElementsAre(h, i));
  EXPECT_THAT(Shape(m, "model.layers.7.post_attention_layernorm.weight"),
              ElementsAre(h));
  EXPECT_THAT(Shape(m, "lm_head.weight"), ElementsAre(v, h));
  EXPECT_TRUE(m.at("lm_head.weight").tied_to().empty());
  EXPECT_EQ(m.at("model.norm.weight").dtype(), v1::BFLOAT16);

  EXPECT_EQ(spec.architecture(), "LlamaForCausalLM");
  EXPECT_EQ(spec.model_type(), "llama");
  EXPECT_EQ(spec.dtype(), v1::BFLOAT16);
  EXPECT_EQ(spec.root().kind(), v1::MODULE_MODEL);
  EXPECT_EQ(spec.root().name(), "");
  EXPECT_EQ(spec.root().children(0).children(1).kind(), v1::MODULE_LAYER_LIST);
  EXPECT_EQ(Layer(spec, 3).name(), "3");
  EXPECT_EQ(Layer(spec, 3).kind(), v1::MODULE_DECODER_LAYER);
  const v1::ModelDims& d = spec.dims();
  EXPECT_EQ(d.vocab_size(), v);
  EXPECT_EQ(d.hidden_size(), h);
  EXPECT_EQ(d.num_layers(), l);
  EXPECT_EQ(d.num_experts(), 0);
  EXPECT_EQ(d.dense_intermediate_size(), i);
  EXPECT_EQ(d.num_attention_heads(), nh);
  EXPECT_EQ(d.num_key_value_heads(), nkv);
  EXPECT_EQ(d.head_dim(), hd);
  EXPECT_EQ(d.activation(), v1::SWIGLU);
  EXPECT_DOUBLE_EQ(d.rms_norm_eps(), 1e-5);
  EXPECT_FALSE(d.tie_word_embeddings());
}

TEST(HfConfigTest, Mixtral8x7B) {
  SHARDD_ASSERT_OK_AND_ASSIGN(
      v1::ModelSpec spec,
      ModelSpecFromHfConfig(ReadTestFile("mixtral_8x7b.json")));
  const int64_t v = 32000, h = 4096, l = 32, nh = 32, nkv = 8, hd = 128,
                i = 14336, e = 8;
  const int64_t experts = e * 3 * h * i;
  const int64_t per_layer =
      2 * h * nh * hd + 2 * h * nkv * hd + experts + e * h + 2 * h;
  const v1::ModelSummary s = Summarize(spec);
  EXPECT_EQ(s.total_params(), 2 * v * h + l * per_layer + h);
  ExpectNear(s.total_params(), 46.70e9, 0.001);
  EXPECT_EQ(s.expert_params(), l * experts);
  // Two of eight experts per token: Mistral's published 12.9B active.
  EXPECT_EQ(s.active_params(), s.total_params() - l * experts * 6 / 8);
  ExpectNear(s.active_params(), 12.9e9, 0.01);

  const auto m = ParamMap(spec);
  EXPECT_THAT(Shape(m, "model.layers.0.moe.gate.weight"), ElementsAre(e, h));
  EXPECT_THAT(Shape(m, "model.layers.0.moe.experts.gate_and_up_projs"),
              ElementsAre(e, h, 2 * i));
  EXPECT_THAT(Shape(m, "model.layers.31.moe.experts.down_projs"),
              ElementsAre(e, i, h));
  const v1::ModuleSpec& moe = Layer(spec, 0).children(1);
  EXPECT_EQ(moe.name(), "moe");
  EXPECT_EQ(moe.kind(), v1::MODULE_MOE);
  EXPECT_EQ(moe.children(0).kind(), v1::MODULE_ROUTER);
  EXPECT_EQ(moe.children(1).kind(), v1::MODULE_GROUPED_EXPERTS);
  EXPECT_EQ(spec.dims().num_experts(), e);
  EXPECT_EQ(spec.dims().top_k(), 2);
  EXPECT_EQ(spec.dims().moe_intermediate_size(), i);
  EXPECT_EQ(spec.dims().dense_intermediate_size(), 0);
}

TEST(HfConfigTest, Qwen3_30B_A3B) {
  SHARDD_ASSERT_OK_AND_ASSIGN(
      v1::ModelSpec spec,
      ModelSpecFromHfConfig(ReadTestFile("qwen3_30b_a3b.json")));
  const int64_t v = 151936, h = 2048, l = 48, nh = 32, nkv = 4, hd = 128,
                i = 768, e = 128;
  const int64_t experts = e * 3 * h * i;
  const int64_t attn = 2 * h * nh * hd + 2 * h * nkv * hd + 2 * hd;
  const int64_t per_layer = attn + experts + e * h + 2 * h;
  const v1::ModelSummary s = Summarize(spec);
  EXPECT_EQ(s.total_params(), 2 * v * h + l * per_layer + h);
  ExpectNear(s.total_params(), 30.5e9, 0.005);
  EXPECT_EQ(s.expert_params(), l * experts);
  ExpectNear(s.active_params(), 3.3e9, 0.02);  // "A3B": 3.3B activated.

  const auto m = ParamMap(spec);
  EXPECT_THAT(Shape(m, "model.layers.5.self_attn.q_norm.weight"),
              ElementsAre(hd));
  EXPECT_THAT(Shape(m, "model.layers.5.self_attn.o_proj.weight"),
              ElementsAre(h, nh * hd));
  EXPECT_THAT(Shape(m, "model.layers.47.moe.experts.gate_and_up_projs"),
              ElementsAre(e, h, 2 * i));
  EXPECT_THAT(Shape(m, "model.layers.47.moe.experts.down_projs"),
              ElementsAre(e, i, h));
  EXPECT_EQ(spec.dims().head_dim(), hd);
  EXPECT_EQ(spec.dims().top_k(), 8);
  EXPECT_EQ(spec.dims().dense_intermediate_size(), 0);  // No dense layers.
}

TEST(HfConfigTest, Qwen3MlpOnlyLayersAndSparseStep) {
  json j = LoadJson("qwen3_30b_a3b.json");
  j["num_hidden_layers"] = 4;
  j["mlp_only_layers"] = {0};
  j["decoder_sparse_step"] = 2;
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ModelSpec spec, Parse(j));
  // Layer i is sparse iff i not in mlp_only_layers and (i + 1) % 2 == 0.
  EXPECT_TRUE(HasChild(Layer(spec, 0), "mlp"));
  EXPECT_TRUE(HasChild(Layer(spec, 1), "moe"));
  EXPECT_TRUE(HasChild(Layer(spec, 2), "mlp"));
  EXPECT_TRUE(HasChild(Layer(spec, 3), "moe"));
  const auto m = ParamMap(spec);
  EXPECT_THAT(Shape(m, "model.layers.2.mlp.up_proj.weight"),
              ElementsAre(6144, 2048));
  EXPECT_EQ(spec.dims().dense_intermediate_size(), 6144);
}

TEST(HfConfigTest, DeepseekV3) {
  SHARDD_ASSERT_OK_AND_ASSIGN(
      v1::ModelSpec spec,
      ModelSpecFromHfConfig(ReadTestFile("deepseek_v3.json")));
  const int64_t v = 129280, h = 7168, l = 61, nh = 128, q_lora = 1536,
                kv_lora = 512, nope = 128, rope = 64, vhd = 128, inter = 18432,
                mi = 2048, e = 256, dense = 3;
  const int64_t attn = h * q_lora + q_lora + q_lora * nh * (nope + rope) +
                       h * (kv_lora + rope) + kv_lora +
                       kv_lora * nh * (nope + vhd) + nh * vhd * h;
  const int64_t experts = e * 3 * h * mi;
  const int64_t moe = experts + 3 * h * mi + e * h + e;
  const int64_t total = 2 * v * h + h + l * (attn + 2 * h) +
                        dense * 3 * h * inter + (l - dense) * moe;
  const v1::ModelSummary s = Summarize(spec);
  EXPECT_EQ(s.total_params(), total);
  ExpectNear(s.total_params(), 671e9, 0.005);  // MTP layer left out.
  EXPECT_EQ(s.expert_params(), (l - dense) * experts);
  ExpectNear(s.active_params(), 37e9, 0.02);  // Published: 37B activated.

  const auto m = ParamMap(spec);
  const std::string a = "model.layers.10.self_attn.";
  EXPECT_THAT(Shape(m, a + "q_a_proj.weight"), ElementsAre(q_lora, h));
  EXPECT_THAT(Shape(m, a + "q_a_layernorm.weight"), ElementsAre(q_lora));
  EXPECT_THAT(Shape(m, a + "q_b_proj.weight"),
              ElementsAre(nh * (nope + rope), q_lora));
  EXPECT_THAT(Shape(m, a + "kv_a_proj_with_mqa.weight"),
              ElementsAre(kv_lora + rope, h));
  EXPECT_THAT(Shape(m, a + "kv_a_layernorm.weight"), ElementsAre(kv_lora));
  EXPECT_THAT(Shape(m, a + "kv_b_proj.weight"),
              ElementsAre(nh * (nope + vhd), kv_lora));
  EXPECT_THAT(Shape(m, a + "o_proj.weight"), ElementsAre(h, nh * vhd));
  EXPECT_EQ(m.count(a + "q_proj.weight"), 0u);
  // First three layers are dense, the rest MoE with one shared expert.
  EXPECT_THAT(Shape(m, "model.layers.2.mlp.gate_proj.weight"),
              ElementsAre(inter, h));
  EXPECT_EQ(m.count("model.layers.3.mlp.gate_proj.weight"), 0u);
  EXPECT_THAT(Shape(m, "model.layers.3.moe.gate.weight"), ElementsAre(e, h));
  const v1::TensorSpec& bias =
      m.at("model.layers.3.moe.gate.e_score_correction_bias");
  EXPECT_THAT(bias.shape(), ElementsAre(e));
  EXPECT_EQ(bias.dtype(), v1::FLOAT32);
  EXPECT_EQ(m.at("model.layers.3.moe.gate.weight").dtype(), v1::BFLOAT16);
  EXPECT_THAT(Shape(m, "model.layers.60.moe.experts.gate_and_up_projs"),
              ElementsAre(e, h, 2 * mi));
  EXPECT_THAT(Shape(m, "model.layers.60.moe.shared_experts.down_proj.weight"),
              ElementsAre(h, mi));
  EXPECT_EQ(m.count("model.layers.61.input_layernorm.weight"), 0u);
  EXPECT_EQ(Layer(spec, 3).children(1).children(2).kind(), v1::MODULE_MLP);

  const v1::ModelDims& d = spec.dims();
  EXPECT_EQ(d.num_layers(), l);
  EXPECT_EQ(d.first_k_dense_layers(), dense);
  EXPECT_EQ(d.num_shared_experts(), 1);
  EXPECT_EQ(d.dense_intermediate_size(), inter);
  EXPECT_EQ(d.moe_intermediate_size(), mi);
  EXPECT_EQ(d.head_dim(), nope + rope);

  // What the workers compute: DeepseekV3TopkRouter and MLA.
  EXPECT_TRUE(bias.frozen());  // A buffer in HF.
  EXPECT_FALSE(m.at("model.layers.3.moe.gate.weight").frozen());
  EXPECT_EQ(d.router_scoring(), v1::ROUTER_SIGMOID_GROUP_LIMITED);
  EXPECT_EQ(d.n_group(), 8);
  EXPECT_EQ(d.topk_group(), 4);
  EXPECT_EQ(d.routed_scaling_factor(), 2.5);
  EXPECT_TRUE(d.norm_topk_prob());
  const v1::AttentionSpec& at = d.attention();
  EXPECT_EQ(at.mla().q_lora_rank(), q_lora);
  EXPECT_EQ(at.mla().kv_lora_rank(), kv_lora);
  EXPECT_EQ(at.mla().qk_nope_head_dim(), nope);
  EXPECT_EQ(at.mla().qk_rope_head_dim(), rope);
  EXPECT_EQ(at.mla().v_head_dim(), vhd);
  EXPECT_EQ(at.rope().type(), "yarn");
  EXPECT_EQ(at.rope().factor(), 40.0);
  EXPECT_EQ(at.rope().mscale_all_dim(), 1.0);
  EXPECT_EQ(at.rope().original_max_position_embeddings(), 4096);
  EXPECT_TRUE(at.rope().interleaved());  // rope_interleave's default.
  EXPECT_EQ(at.max_position_embeddings(), 163840);
  EXPECT_FALSE(at.bias());
  // 192^-0.5 * (0.1 ln 40 + 1)^2, written out from the config's numbers.
  const double m_all = 0.1 * 1.0 * std::log(40.0) + 1.0;
  EXPECT_DOUBLE_EQ(at.softmax_scale(), m_all * m_all / std::sqrt(192.0));
}

TEST(HfConfigTest, DeepseekRouterAndRopeDefaults) {
  json j = LoadJson("deepseek_v3.json");
  for (const char* key : {"n_group", "topk_group", "routed_scaling_factor",
                          "norm_topk_prob", "rope_scaling"}) {
    j.erase(key);
  }
  j["rope_interleave"] = false;
  j["num_hidden_layers"] = 4;
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ModelSpec spec, Parse(j));
  const v1::ModelDims& d = spec.dims();
  // DeepseekV3Config's defaults.
  EXPECT_EQ(d.n_group(), 8);
  EXPECT_EQ(d.topk_group(), 4);
  EXPECT_EQ(d.routed_scaling_factor(), 2.5);
  EXPECT_TRUE(d.norm_topk_prob());
  EXPECT_FALSE(d.attention().rope().interleaved());
  EXPECT_EQ(d.attention().rope().type(), "default");
  // No rope scaling: the plain qk_head_dim^-0.5.
  EXPECT_DOUBLE_EQ(d.attention().softmax_scale(), 1.0 / std::sqrt(192.0));

  j["norm_topk_prob"] = false;
  j["n_group"] = 4;
  j["topk_group"] = 5;  // More groups kept than there are.
  EXPECT_THAT(Parse(j), StatusIs(absl::StatusCode::kInvalidArgument,
                                 HasSubstr("topk_group")));
  j["topk_group"] = 1;
  SHARDD_ASSERT_OK_AND_ASSIGN(spec, Parse(j));
  EXPECT_FALSE(spec.dims().norm_topk_prob());
  EXPECT_EQ(spec.dims().topk_group(), 1);
}

TEST(HfConfigTest, DeepseekWithoutQLora) {
  json j = LoadJson("deepseek_v3.json");
  j["q_lora_rank"] = nullptr;
  j["num_hidden_layers"] = 4;
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ModelSpec spec, Parse(j));
  const auto m = ParamMap(spec);
  EXPECT_THAT(Shape(m, "model.layers.0.self_attn.q_proj.weight"),
              ElementsAre(128 * 192, 7168));
  EXPECT_EQ(m.count("model.layers.0.self_attn.q_a_proj.weight"), 0u);
}

TEST(HfConfigTest, GptOss20B) {
  SHARDD_ASSERT_OK_AND_ASSIGN(
      v1::ModelSpec spec,
      ModelSpecFromHfConfig(ReadTestFile("gpt_oss_20b.json")));
  const int64_t v = 201088, h = 2880, l = 24, nh = 64, nkv = 8, hd = 64,
                i = 2880, e = 32;
  const int64_t attn = (h + 1) * nh * hd * 2 + (h + 1) * nkv * hd * 2 -
                       nh * hd + h + nh;  // o_proj bias is [H]; sinks [nh].
  const int64_t experts = e * h * 2 * i + e * 2 * i + e * i * h + e * h;
  const int64_t per_layer = attn + e * h + e + experts + 2 * h;
  const v1::ModelSummary s = Summarize(spec);
  EXPECT_EQ(s.total_params(), 2 * v * h + l * per_layer + h);
  ExpectNear(s.total_params(), 20.9e9, 0.015);
  EXPECT_EQ(s.expert_params(), l * experts);

  const auto m = ParamMap(spec);
  EXPECT_THAT(Shape(m, "model.layers.0.self_attn.sinks"), ElementsAre(nh));
  EXPECT_THAT(Shape(m, "model.layers.0.self_attn.q_proj.bias"),
              ElementsAre(nh * hd));
  EXPECT_THAT(Shape(m, "model.layers.0.self_attn.o_proj.bias"), ElementsAre(h));
  EXPECT_THAT(Shape(m, "model.layers.0.moe.gate.bias"), ElementsAre(e));
  EXPECT_THAT(Shape(m, "model.layers.0.moe.experts.gate_up_proj_bias"),
              ElementsAre(e, 2 * i));
  EXPECT_THAT(Shape(m, "model.layers.0.moe.experts.down_proj_bias"),
              ElementsAre(e, h));
  EXPECT_EQ(spec.dims().top_k(), 4);
  EXPECT_EQ(spec.dtype(), v1::BFLOAT16);  // No torch_dtype: the default.

  // What the workers compute.
  const v1::ModelDims& d = spec.dims();
  EXPECT_EQ(d.activation(), v1::SWIGLU_OAI);
  EXPECT_EQ(d.swiglu_limit(), 7.0);
  EXPECT_EQ(d.swiglu_alpha(), 1.702);
  EXPECT_EQ(d.router_scoring(), v1::ROUTER_TOPK_THEN_SOFTMAX);
  const v1::AttentionSpec& a = d.attention();
  EXPECT_TRUE(a.bias());
  EXPECT_TRUE(a.sinks());
  EXPECT_FALSE(a.qk_norm());
  EXPECT_EQ(a.rope().type(), "yarn");
  EXPECT_EQ(a.rope().theta(), 150000.0);
  EXPECT_EQ(a.rope().factor(), 32.0);
  EXPECT_EQ(a.rope().original_max_position_embeddings(), 4096);
  EXPECT_TRUE(a.rope().untruncated());  // "truncate": false
  EXPECT_EQ(a.max_position_embeddings(), 131072);
  EXPECT_EQ(a.sliding_window(), 128);
  ASSERT_EQ(a.sliding_layers_size(), l);
  for (int i = 0; i < l; ++i) EXPECT_EQ(a.sliding_layers(i), i % 2 == 0) << i;
}

TEST(HfConfigTest, GptOssDefaultsAreGptOssConfigs) {
  // Without rope_scaling, layer_types, sliding_window, swiglu_limit and
  // attention_bias, GptOssConfig's defaults apply.
  json o = LoadJson("gpt_oss_20b.json");
  for (const char* key : {"rope_scaling", "rope_theta", "layer_types",
                          "sliding_window", "swiglu_limit", "attention_bias"}) {
    o.erase(key);
  }
  o["swiglu_alpha"] = 1.5;
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ModelSpec spec, Parse(o));
  const v1::AttentionSpec& a = spec.dims().attention();
  EXPECT_EQ(a.rope().type(), "yarn");
  EXPECT_EQ(a.rope().theta(), 150000.0);
  EXPECT_EQ(a.rope().factor(), 32.0);
  EXPECT_EQ(a.rope().beta_fast(), 32.0);
  EXPECT_EQ(a.rope().beta_slow(), 1.0);
  EXPECT_EQ(a.rope().original_max_position_embeddings(), 4096);
  EXPECT_TRUE(a.rope().untruncated());
  EXPECT_EQ(a.sliding_window(), 128);
  ASSERT_EQ(a.sliding_layers_size(), 24);
  EXPECT_TRUE(a.sliding_layers(0));
  EXPECT_FALSE(a.sliding_layers(1));
  EXPECT_TRUE(a.bias());
  EXPECT_EQ(spec.dims().swiglu_limit(), 7.0);
  EXPECT_EQ(spec.dims().swiglu_alpha(), 1.5);

  o["swiglu_limit"] = 0;
  EXPECT_THAT(Parse(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                 HasSubstr("swiglu_limit")));
  o = LoadJson("gpt_oss_20b.json");
  o["rope_scaling"]["truncate"] = "no";
  EXPECT_THAT(Parse(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                 HasSubstr("rope_scaling.truncate")));
}

// The load-balancing loss is on only with output_router_logits: true, at
// router_aux_loss_coef or the config class's default (MixtralConfig and
// Qwen3MoeConfig 0.001, GptOssConfig 0.9). DeepSeek-V3 has no such loss.
TEST(HfConfigTest, RouterAuxLossFollowsOutputRouterLogits) {
  struct Case {
    const char* file;
    double published_coef;  // As the file says.
    double default_coef;    // The config class's.
  };
  for (const Case& c : {Case{"mixtral_8x7b.json", 0.02, 0.001},
                        Case{"qwen3_30b_a3b.json", 0.001, 0.001},
                        Case{"gpt_oss_20b.json", 0.9, 0.9}}) {
    SCOPED_TRACE(c.file);
    json j = LoadJson(c.file);
    ASSERT_EQ(j["output_router_logits"], false);
    SHARDD_ASSERT_OK_AND_ASSIGN(v1::ModelSpec spec, Parse(j));
    EXPECT_EQ(spec.dims().router_aux_loss_coef(), 0.0);
    j["output_router_logits"] = true;
    SHARDD_ASSERT_OK_AND_ASSIGN(spec, Parse(j));
    EXPECT_EQ(spec.dims().router_aux_loss_coef(), c.published_coef);
    j.erase("router_aux_loss_coef");
    SHARDD_ASSERT_OK_AND_ASSIGN(spec, Parse(j));
    EXPECT_EQ(spec.dims().router_aux_loss_coef(), c.default_coef);
    j.erase("output_router_logits");
    SHARDD_ASSERT_OK_AND_ASSIGN(spec, Parse(j));
    EXPECT_EQ(spec.dims().router_aux_loss_coef(), 0.0);
    j["output_router_logits"] = "yes";
    EXPECT_THAT(Parse(j), StatusIs(absl::StatusCode::kInvalidArgument,
                                   HasSubstr("output_router_logits")));
    j["output_router_logits"] = true;
    j["router_aux_loss_coef"] = -0.1;
    EXPECT_THAT(Parse(j), StatusIs(absl::StatusCode::kInvalidArgument,
                                   HasSubstr("router_aux_loss_coef")));
  }
  json d = LoadJson("deepseek_v3.json");
  d["output_router_logits"] = true;
  d["router_aux_loss_coef"] = 0.01;
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ModelSpec spec, Parse(d));
  EXPECT_EQ(spec.dims().router_aux_loss_coef(), 0.0);
}

TEST(HfConfigTest, TextConfigNesting) {
  json inner = LoadJson("llama3_8b.json");
  inner.erase("architectures");
  inner["num_hidden_layers"] = 2;
  json outer = {{"architectures", {"LlamaForCausalLM"}},
                {"text_config", inner}};
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ModelSpec spec, Parse(outer));
  EXPECT_EQ(spec.dims().num_layers(), 2);
  EXPECT_EQ(spec.dims().hidden_size(), 4096);

  outer["text_config"]["hidden_size"] = -1;
  EXPECT_THAT(Parse(outer), StatusIs(absl::StatusCode::kInvalidArgument,
                                     HasSubstr("text_config.hidden_size")));
}

TEST(HfConfigTest, DtypeFromConfig) {
  json j = LoadJson("llama3_8b.json");
  j["num_hidden_layers"] = 1;
  j["torch_dtype"] = "float32";
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ModelSpec spec, Parse(j));
  EXPECT_EQ(spec.dtype(), v1::FLOAT32);
  for (const ParamRef& p : ListParams(spec)) {
    EXPECT_EQ(p.tensor->dtype(), v1::FLOAT32) << p.fqn;
  }
  j.erase("torch_dtype");
  j["dtype"] = "float16";
  SHARDD_ASSERT_OK_AND_ASSIGN(spec, Parse(j));
  EXPECT_EQ(spec.dtype(), v1::FLOAT16);
}

TEST(HfConfigTest, SingleExpertParses) {
  json j = LoadJson("mixtral_8x7b.json");
  j["num_local_experts"] = 1;
  j["num_experts_per_tok"] = 1;
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ModelSpec spec, Parse(j));
  const auto m = ParamMap(spec);
  EXPECT_THAT(Shape(m, "model.layers.0.moe.experts.gate_and_up_projs"),
              ElementsAre(1, 4096, 2 * 14336));
  EXPECT_THAT(Shape(m, "model.layers.0.moe.gate.weight"), ElementsAre(1, 4096));
  const v1::ModelSummary s = Summarize(spec);
  EXPECT_EQ(s.active_params(), s.total_params());
}

TEST(HfConfigTest, UnknownArchitectureListsSupported) {
  json j = LoadJson("llama3_8b.json");
  j["architectures"] = {"BertForMaskedLM"};
  std::vector<::testing::Matcher<std::string>> all = {
      HasSubstr("architectures[0]"), HasSubstr("BertForMaskedLM")};
  for (const std::string& a : SupportedArchitectures()) {
    all.push_back(HasSubstr(a));
  }
  EXPECT_THAT(Parse(j), StatusIs(absl::StatusCode::kInvalidArgument,
                                 ::testing::AllOfArray(all)));
}

// Each case: a mutation of the Mixtral config and the field the error must
// name.
struct BadCase {
  const char* label;
  std::function<void(json*)> mutate;
  std::vector<std::string> needles;
};

TEST(HfConfigTest, BadInputNamesTheField) {
  const std::vector<BadCase> cases = {
      {"missing hidden_size",
       [](json* j) { j->erase("hidden_size"); },
       {"hidden_size: missing", "integer in [1,"}},
      {"null hidden_size",
       [](json* j) { (*j)["hidden_size"] = nullptr; },
       {"hidden_size: missing"}},
      {"negative",
       [](json* j) { (*j)["hidden_size"] = -4096; },
       {"hidden_size", "got -4096"}},
      {"zero",
       [](json* j) { (*j)["num_hidden_layers"] = 0; },
       {"num_hidden_layers", "got 0"}},
      {"zero experts",
       [](json* j) { (*j)["num_local_experts"] = 0; },
       {"num_local_experts", "got 0"}},
      {"fractional",
       [](json* j) { (*j)["intermediate_size"] = 14336.5; },
       {"intermediate_size", "must be an integer", "14336.5"}},
      {"integral float",
       [](json* j) { (*j)["vocab_size"] = 32000.0; },
       {"vocab_size", "must be an integer"}},
      {"string size",
       [](json* j) { (*j)["hidden_size"] = "4096"; },
       {"hidden_size", "got a string"}},
      {"absurd size",
       [](json* j) { (*j)["hidden_size"] = int64_t{1000000000000}; },
       {"hidden_size", "got 1000000000000"}},
      {"beyond int64",
       [](json* j) { (*j)["vocab_size"] = uint64_t{18000000000000000000u}; },
       {"vocab_size", "got 18000000000000000000"}},
      {"top_k > experts",
       [](json* j) { (*j)["num_experts_per_tok"] = 9; },
       {"num_experts_per_tok", "[1, 8]"}},
      {"missing top_k",
       [](json* j) { j->erase("num_experts_per_tok"); },
       {"num_experts_per_tok: missing"}},
      {"architectures not array",
       [](json* j) { (*j)["architectures"] = "MixtralForCausalLM"; },
       {"architectures: must be a non-empty array"}},
      {"architectures empty",
       [](json* j) { (*j)["architectures"] = json::array(); },
       {"architectures: must be a non-empty array"}},
      {"architectures of numbers",
       [](json* j) { (*j)["architectures"] = {1}; },
       {"architectures: must be a non-empty array"}},
      {"no architectures",
       [](json* j) { j->erase("architectures"); },
       {"architectures: missing", "MixtralForCausalLM"}},
      {"bad dtype",
       [](json* j) { (*j)["torch_dtype"] = "float128"; },
       {"torch_dtype", "float128"}},
      {"int dtype",
       [](json* j) { (*j)["torch_dtype"] = "int32"; },
       {"torch_dtype", "not supported"}},
      {"bool as number",
       [](json* j) { (*j)["tie_word_embeddings"] = 1; },
       {"tie_word_embeddings", "true or false"}},
      {"kv heads do not divide",
       [](json* j) { (*j)["num_key_value_heads"] = 5; },
       {"num_key_value_heads", "divide"}},
      {"bad eps", [](json* j) { (*j)["rms_norm_eps"] = -1; }, {"rms_norm_eps"}},
      {"bad activation",
       [](json* j) { (*j)["hidden_act"] = "tanh"; },
       {"hidden_act", "tanh"}},
      // Every field in range, the product is not: 2^16 * 2^20 * 2^23.
      {"overflowing product",
       [](json* j) {
         (*j)["num_local_experts"] = 65536;
         (*j)["hidden_size"] = 1048576;
         (*j)["intermediate_size"] = 4194304;
         (*j)["num_attention_heads"] = 32;
         (*j)["num_hidden_layers"] = 1;
       },
       {"gate_and_up_projs", "2^53"}},
  };
  const json base = LoadJson("mixtral_8x7b.json");
  for (const BadCase& c : cases) {
    json j = base;
    c.mutate(&j);
    std::vector<::testing::Matcher<std::string>> all;
    for (const std::string& n : c.needles) all.push_back(HasSubstr(n));
    EXPECT_THAT(Parse(j), StatusIs(absl::StatusCode::kInvalidArgument,
                                   ::testing::AllOfArray(all)))
        << c.label;
  }
}

// pad_token_id becomes dims.pad_token_id (transformers' padding_idx): set
// when the config names one, unset when absent or null, refused outside the
// vocabulary.
TEST(HfConfigTest, PadTokenId) {
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ModelSpec oss,
                              Parse(LoadJson("gpt_oss_20b.json")));
  ASSERT_TRUE(oss.dims().has_pad_token_id());
  EXPECT_EQ(oss.dims().pad_token_id(), 199999);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ModelSpec gemma,
                              Parse(LoadJson("diffusion_gemma_26b.json")));
  ASSERT_TRUE(gemma.dims().has_pad_token_id());  // text_config's.
  EXPECT_EQ(gemma.dims().pad_token_id(), 0);
  json l = LoadJson("llama3_8b.json");
  l.erase("pad_token_id");
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ModelSpec none, Parse(l));
  EXPECT_FALSE(none.dims().has_pad_token_id());
  l["pad_token_id"] = nullptr;
  SHARDD_ASSERT_OK_AND_ASSIGN(none, Parse(l));
  EXPECT_FALSE(none.dims().has_pad_token_id());
  l["pad_token_id"] = l["vocab_size"];
  EXPECT_THAT(Parse(l), StatusIs(absl::StatusCode::kInvalidArgument,
                                 HasSubstr("pad_token_id")));
}

// transformers 5 saves Qwen3-MoE's expert count as num_local_experts.
TEST(HfConfigTest, Qwen3MoeTakesTransformers5ExpertCount) {
  json q = LoadJson("qwen3_30b_a3b.json");
  const int64_t experts = q["num_experts"];
  q.erase("num_experts");
  q["num_local_experts"] = experts;
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ModelSpec spec, Parse(q));
  EXPECT_EQ(spec.dims().num_experts(), experts);
  q["num_experts"] = experts;  // Both, equal.
  SHARDD_ASSERT_OK_AND_ASSIGN(spec, Parse(q));
  EXPECT_EQ(spec.dims().num_experts(), experts);
  q["num_experts"] = experts / 2;
  EXPECT_THAT(Parse(q),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("num_local_experts: 128 differs from "
                                 "num_experts 64")));
  q.erase("num_experts");
  q.erase("num_local_experts");
  EXPECT_THAT(Parse(q), StatusIs(absl::StatusCode::kInvalidArgument,
                                 HasSubstr("num_experts: missing")));
}

TEST(HfConfigTest, ArchitectureSpecificBadInput) {
  json q = LoadJson("qwen3_30b_a3b.json");
  q["mlp_only_layers"] = {99};
  EXPECT_THAT(Parse(q), StatusIs(absl::StatusCode::kInvalidArgument,
                                 HasSubstr("mlp_only_layers[0]")));
  q["mlp_only_layers"] = "none";
  EXPECT_THAT(Parse(q), StatusIs(absl::StatusCode::kInvalidArgument,
                                 HasSubstr("mlp_only_layers: must be")));

  json d = LoadJson("deepseek_v3.json");
  d["first_k_dense_replace"] = 62;
  EXPECT_THAT(Parse(d), StatusIs(absl::StatusCode::kInvalidArgument,
                                 HasSubstr("first_k_dense_replace")));
  d = LoadJson("deepseek_v3.json");
  d.erase("kv_lora_rank");
  EXPECT_THAT(Parse(d), StatusIs(absl::StatusCode::kInvalidArgument,
                                 HasSubstr("kv_lora_rank: missing")));

  // DiffusionGemma's: model/hf_diffusion_gemma_test.cc.

  json o = LoadJson("gpt_oss_20b.json");
  o["num_local_experts"] = 2;  // Fewer experts than top-k 4.
  EXPECT_THAT(Parse(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                 HasSubstr("num_experts_per_tok")));
}

TEST(HfConfigTest, MalformedDocuments) {
  for (const char* text : {"", "{", "{\"architectures\": [}", "nul", "[1, 2",
                           "{\"a\": 1} trailing", "\xff\xfe"}) {
    EXPECT_THAT(ModelSpecFromHfConfig(text),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("malformed JSON")))
        << text;
  }
  EXPECT_THAT(ModelSpecFromHfConfig("[1, 2]"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("must be a JSON object")));
  EXPECT_THAT(ModelSpecFromHfConfig("42"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("must be a JSON object")));
}

}  // namespace
}  // namespace shardd

namespace shardd {
namespace {

v1::AttentionSpec AttentionOf(const nlohmann::json& config) {
  absl::StatusOr<v1::ModelSpec> spec = ModelSpecFromHfConfig(config.dump());
  EXPECT_TRUE(spec.ok()) << spec.status();
  return spec.ok() ? spec->dims().attention() : v1::AttentionSpec();
}

nlohmann::json TinyQwen3() {
  return nlohmann::json::parse(R"({
    "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64,
    "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48,
    "moe_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2,
    "max_position_embeddings": 512, "rope_theta": 1000000.0,
    "norm_topk_prob": true})");
}

TEST(HfAttentionTest, RopeAndRouterFlagsFromTheConfig) {
  nlohmann::json c = TinyQwen3();
  absl::StatusOr<v1::ModelSpec> spec = ModelSpecFromHfConfig(c.dump());
  ASSERT_TRUE(spec.ok()) << spec.status();
  const v1::AttentionSpec& a = spec->dims().attention();
  EXPECT_EQ(a.rope().type(), "default");
  EXPECT_EQ(a.rope().theta(), 1000000.0);
  EXPECT_EQ(a.rope().partial_rotary_factor(), 1.0);
  EXPECT_EQ(a.max_position_embeddings(), 512);
  EXPECT_TRUE(a.qk_norm());
  EXPECT_EQ(a.sliding_layers_size(), 0);
  EXPECT_TRUE(spec->dims().norm_topk_prob());

  // transformers 4.x rope_scaling, and 5.x rope_parameters.
  c["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0},
                       {"original_max_position_embeddings", 128},
                       {"mscale", 1.0}, {"mscale_all_dim", 1.0}};
  v1::AttentionSpec yarn = AttentionOf(c);
  EXPECT_EQ(yarn.rope().type(), "yarn");
  EXPECT_EQ(yarn.rope().factor(), 4.0);
  EXPECT_EQ(yarn.rope().original_max_position_embeddings(), 128);
  EXPECT_EQ(yarn.rope().mscale_all_dim(), 1.0);
  c.erase("rope_scaling");
  c["rope_parameters"] = {{"rope_type", "llama3"}, {"rope_theta", 5e5},
                          {"factor", 8.0}, {"low_freq_factor", 1.0},
                          {"high_freq_factor", 4.0},
                          {"original_max_position_embeddings", 256}};
  v1::AttentionSpec llama3 = AttentionOf(c);
  EXPECT_EQ(llama3.rope().type(), "llama3");
  EXPECT_EQ(llama3.rope().theta(), 5e5);
  EXPECT_EQ(llama3.rope().high_freq_factor(), 4.0);
}

TEST(HfAttentionTest, SlidingWindowLayers) {
  nlohmann::json c = TinyQwen3();
  c["sliding_window"] = 64;
  c["use_sliding_window"] = true;
  c["max_window_layers"] = 2;
  v1::AttentionSpec a = AttentionOf(c);
  EXPECT_EQ(a.sliding_window(), 64);
  ASSERT_EQ(a.sliding_layers_size(), 4);
  EXPECT_FALSE(a.sliding_layers(1));
  EXPECT_TRUE(a.sliding_layers(2));
  // Off unless use_sliding_window.
  c["use_sliding_window"] = false;
  EXPECT_EQ(AttentionOf(c).sliding_layers_size(), 0);
  // An explicit layer_types list wins.
  c["layer_types"] = {"sliding_attention", "full_attention",
                      "sliding_attention", "full_attention"};
  a = AttentionOf(c);
  ASSERT_EQ(a.sliding_layers_size(), 4);
  EXPECT_TRUE(a.sliding_layers(0));
  EXPECT_FALSE(a.sliding_layers(3));
}

TEST(HfAttentionTest, BadRopeNamesTheField) {
  nlohmann::json c = TinyQwen3();
  c["rope_scaling"] = {{"rope_type", "longrope"}};
  EXPECT_THAT(ModelSpecFromHfConfig(c.dump()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::HasSubstr("rope_scaling.rope_type: "
                                            "\"longrope\" is not supported")));
  c["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0},
                       {"low_freq_factor", 4.0}, {"high_freq_factor", 1.0}};
  EXPECT_THAT(ModelSpecFromHfConfig(c.dump()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::HasSubstr("high_freq_factor")));
  c.erase("rope_scaling");
  c["layer_types"] = {"sliding_attention"};
  EXPECT_THAT(ModelSpecFromHfConfig(c.dump()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::HasSubstr("layer_types")));
}

}  // namespace
}  // namespace shardd
