#include "model/native_spec.h"

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
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "model/hf_config.h"
#include "model/model_util.h"

namespace shardd {
namespace {

using ::google::protobuf::util::MessageDifferencer;
using ::nlohmann::json;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string ReadTestFile(const std::string& name) {
  std::ifstream in("tests/data/" + name);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A minimal valid spec the error cases mutate.
json MinimalSpec() {
  return json::parse(R"({
    "architecture": "TinyForCausalLM",
    "dtype": "bfloat16",
    "dims": {"vocab_size": 16, "hidden_size": 8, "num_layers": 1,
             "num_experts": 2, "top_k": 1, "moe_intermediate_size": 4},
    "root": {"kind": "model", "children": [
      {"name": "embed", "kind": "embedding",
       "params": [{"name": "weight", "shape": [16, 8]}]},
      {"name": "experts", "kind": "grouped_experts", "params": [
        {"name": "gate_and_up_projs", "shape": [2, 8, 8]},
        {"name": "down_projs", "shape": [2, 4, 8], "dtype": "fp32",
         "frozen": true}
      ]},
      {"name": "head", "kind": "lm_head",
       "params": [{"name": "weight", "shape": [16, 8],
                   "tied_to": "embed.weight"}]}
    ]}
  })");
}

absl::StatusOr<v1::ModelSpec> Parse(const json& j) {
  return ModelSpecFromNativeJson(j.dump());
}

TEST(NativeSpecTest, MinimalSpecFields) {
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ModelSpec spec, Parse(MinimalSpec()));
  EXPECT_EQ(spec.architecture(), "TinyForCausalLM");
  EXPECT_EQ(spec.dtype(), v1::BFLOAT16);
  EXPECT_EQ(spec.root().kind(), v1::MODULE_MODEL);
  const v1::ModuleSpec& experts = spec.root().children(1);
  EXPECT_EQ(experts.kind(), v1::MODULE_GROUPED_EXPERTS);
  EXPECT_EQ(experts.params(0).dtype(), v1::BFLOAT16);  // Model default.
  EXPECT_EQ(experts.params(1).dtype(), v1::FLOAT32);
  EXPECT_TRUE(experts.params(1).frozen());
  EXPECT_FALSE(experts.params(0).frozen());
  EXPECT_EQ(spec.root().children(2).params(0).tied_to(), "embed.weight");
  EXPECT_EQ(spec.dims().num_experts(), 2);
  EXPECT_EQ(spec.dims().moe_intermediate_size(), 4);
  EXPECT_EQ(spec.dims().dense_intermediate_size(), 0);
}

TEST(NativeSpecTest, DefaultsWhenOmitted) {
  json j = MinimalSpec();
  j.erase("dtype");
  j.erase("dims");
  j["root"].erase("kind");
  j["root"]["children"][0].erase("kind");
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ModelSpec spec, Parse(j));
  EXPECT_EQ(spec.dtype(), v1::FLOAT32);
  EXPECT_EQ(spec.root().kind(), v1::MODULE_MODEL);
  EXPECT_EQ(spec.root().children(0).kind(), v1::MODULE_GENERIC);
  EXPECT_EQ(spec.root().children(0).params(0).dtype(), v1::FLOAT32);
  EXPECT_EQ(spec.dims().hidden_size(), 0);
}

TEST(NativeSpecTest, TinyMoeFile) {
  SHARDD_ASSERT_OK_AND_ASSIGN(
      v1::ModelSpec spec,
      ModelSpecFromNativeJson(ReadTestFile("tiny_moe.json")));
  EXPECT_EQ(spec.architecture(), "ShardMoEForCausalLM");
  EXPECT_EQ(spec.dtype(), v1::FLOAT32);
  const v1::ModelDims& d = spec.dims();
  const int64_t v = d.vocab_size(), h = d.hidden_size(), e = d.num_experts(),
                i = d.moe_intermediate_size(), l = d.num_layers();
  EXPECT_EQ(v, 128);
  EXPECT_EQ(h, 64);
  EXPECT_EQ(l, 2);
  EXPECT_EQ(e, 8);
  EXPECT_EQ(d.top_k(), 2);
  EXPECT_EQ(i, 32);
  EXPECT_TRUE(d.tie_word_embeddings());
  // The tree must agree with the dims.
  const int64_t q = d.num_attention_heads() * d.head_dim();
  const int64_t kv = d.num_key_value_heads() * d.head_dim();
  const int64_t experts = e * h * 2 * i + e * i * h;
  const int64_t per_layer = 2 * h * q + 2 * h * kv + e * h + experts + 2 * h;
  const v1::ModelSummary s = Summarize(spec);
  EXPECT_EQ(s.total_params(), v * h + l * per_layer + h);
  EXPECT_EQ(s.expert_params(), l * experts);
  EXPECT_EQ(s.active_params(), s.total_params() - l * experts * 6 / 8);
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const ParamRef& p : ListParams(spec)) {
    shapes[p.fqn] = {p.tensor->shape().begin(), p.tensor->shape().end()};
  }
  EXPECT_THAT(shapes["model.layers.1.moe.experts.gate_and_up_projs"],
              ElementsAre(e, h, 2 * i));
  EXPECT_THAT(shapes["model.layers.1.moe.experts.down_projs"],
              ElementsAre(e, i, h));
  EXPECT_THAT(shapes["model.layers.0.moe.gate.weight"], ElementsAre(e, h));
  EXPECT_EQ(spec.root().children(1).params(0).tied_to(),
            "model.embed_tokens.weight");
}

TEST(NativeSpecTest, RoundTripsEveryConfig) {
  for (const char* name :
       {"mixtral_8x7b.json", "qwen3_30b_a3b.json", "deepseek_v3.json",
        "gpt_oss_20b.json", "llama3_8b.json", "diffusion_gemma_26b.json"}) {
    SHARDD_ASSERT_OK_AND_ASSIGN(v1::ModelSpec hf,
                                ModelSpecFromHfConfig(ReadTestFile(name)));
    const std::string native = ModelSpecToNativeJson(hf);
    SHARDD_ASSERT_OK_AND_ASSIGN(v1::ModelSpec back,
                                ModelSpecFromNativeJson(native));
    std::string diff;
    MessageDifferencer differ;
    differ.ReportDifferencesToString(&diff);
    EXPECT_TRUE(differ.Compare(hf, back)) << name << ": " << diff;
    // And the writer is deterministic.
    EXPECT_EQ(ModelSpecToNativeJson(back), native) << name;
  }
  SHARDD_ASSERT_OK_AND_ASSIGN(
      v1::ModelSpec tiny,
      ModelSpecFromNativeJson(ReadTestFile("tiny_moe.json")));
  SHARDD_ASSERT_OK_AND_ASSIGN(
      v1::ModelSpec back, ModelSpecFromNativeJson(ModelSpecToNativeJson(tiny)));
  EXPECT_TRUE(MessageDifferencer::Equals(tiny, back));
  // The load-balancing loss's coefficient (off in every published config).
  SHARDD_ASSERT_OK_AND_ASSIGN(
      v1::ModelSpec aux, ModelSpecFromHfConfig(ReadTestFile("tiny_mixtral_aux.json")));
  ASSERT_EQ(aux.dims().router_aux_loss_coef(), 0.02);
  const std::string aux_native = ModelSpecToNativeJson(aux);
  EXPECT_EQ(json::parse(aux_native)["dims"]["router_aux_loss_coef"], 0.02);
  SHARDD_ASSERT_OK_AND_ASSIGN(back, ModelSpecFromNativeJson(aux_native));
  EXPECT_TRUE(MessageDifferencer::Equals(aux, back));
}

TEST(NativeSpecTest, WriterOmitsDefaultsItCanRestore) {
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ModelSpec spec, Parse(MinimalSpec()));
  const json out = json::parse(ModelSpecToNativeJson(spec));
  EXPECT_EQ(out["dtype"], "bfloat16");
  EXPECT_FALSE(out["root"].contains("name"));
  const json& experts = out["root"]["children"][1];
  EXPECT_EQ(experts["kind"], "grouped_experts");
  EXPECT_FALSE(experts["params"][0].contains("dtype"));
  EXPECT_EQ(experts["params"][1]["dtype"], "float32");
  EXPECT_EQ(experts["params"][1]["frozen"], true);
  EXPECT_FALSE(experts["params"][0].contains("frozen"));
}

TEST(NativeSpecTest, FromJsonDispatchesOnRoot) {
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ModelSpec native,
                              ModelSpecFromJson(ReadTestFile("tiny_moe.json")));
  EXPECT_EQ(native.architecture(), "ShardMoEForCausalLM");
  SHARDD_ASSERT_OK_AND_ASSIGN(
      v1::ModelSpec hf, ModelSpecFromJson(ReadTestFile("llama3_8b.json")));
  EXPECT_EQ(hf.architecture(), "LlamaForCausalLM");
  EXPECT_THAT(ModelSpecFromJson("{\"root\": 3, \"architecture\": \"X\"}"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("root: must be an object")));
  EXPECT_THAT(ModelSpecFromJson("{\"hidden_size\": 3}"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("architectures: missing")));
  EXPECT_THAT(ModelSpecFromJson("{]"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("malformed JSON")));
}

struct BadCase {
  const char* label;
  std::function<void(json*)> mutate;
  const char* needle;
};

TEST(NativeSpecTest, ErrorsNameTheJsonPath) {
  const std::vector<BadCase> cases = {
      {"zero dim",
       [](json* j) {
         (*j)["root"]["children"][1]["params"][1]["shape"][0] = 0;
       },
       "root.children[1].params[1].shape[0]: must be an integer in [1, "},
      {"negative dim",
       [](json* j) {
         (*j)["root"]["children"][0]["params"][0]["shape"][1] = -8;
       },
       "root.children[0].params[0].shape[1]: must be an integer"},
      {"fractional dim",
       [](json* j) {
         (*j)["root"]["children"][0]["params"][0]["shape"][1] = 8.5;
       },
       "root.children[0].params[0].shape[1]: must be an integer"},
      {"string dim",
       [](json* j) {
         (*j)["root"]["children"][0]["params"][0]["shape"][1] = "8";
       },
       "root.children[0].params[0].shape[1]"},
      {"huge dim",
       [](json* j) {
         (*j)["root"]["children"][0]["params"][0]["shape"][1] = uint64_t{1}
                                                                << 60;
       },
       "root.children[0].params[0].shape[1]"},
      {"empty shape",
       [](json* j) {
         (*j)["root"]["children"][0]["params"][0]["shape"] = json::array();
       },
       "root.children[0].params[0].shape: must be a non-empty array"},
      {"missing shape",
       [](json* j) { (*j)["root"]["children"][0]["params"][0].erase("shape"); },
       "root.children[0].params[0].shape: missing"},
      {"missing param name",
       [](json* j) { (*j)["root"]["children"][0]["params"][0].erase("name"); },
       "root.children[0].params[0].name: missing"},
      {"missing module name",
       [](json* j) { (*j)["root"]["children"][2].erase("name"); },
       "root.children[2].name: missing"},
      {"unknown kind",
       [](json* j) { (*j)["root"]["children"][2]["kind"] = "head"; },
       "root.children[2].kind: unknown module kind \"head\"; allowed: generic"},
      {"unknown member",
       [](json* j) { (*j)["root"]["children"][0]["params"][0]["shapes"] = 1; },
       "root.children[0].params[0].shapes: unknown member"},
      {"unknown top-level member", [](json* j) { (*j)["layers"] = 1; },
       "layers: unknown member"},
      {"bad dtype",
       [](json* j) {
         (*j)["root"]["children"][0]["params"][0]["dtype"] = "q4";
       },
       "root.children[0].params[0].dtype: unknown dtype"},
      {"bad model dtype", [](json* j) { (*j)["dtype"] = 32; },
       "dtype: must be a string"},
      {"frozen not bool",
       [](json* j) { (*j)["root"]["children"][0]["params"][0]["frozen"] = 1; },
       "root.children[0].params[0].frozen: must be true or false"},
      {"tied_to not string",
       [](json* j) { (*j)["root"]["children"][2]["params"][0]["tied_to"] = 1; },
       "root.children[2].params[0].tied_to: must be a string"},
      {"params not array",
       [](json* j) { (*j)["root"]["children"][0]["params"] = json::object(); },
       "root.children[0].params: must be an array"},
      {"children not array", [](json* j) { (*j)["root"]["children"] = 1; },
       "root.children: must be an array"},
      {"child not object", [](json* j) { (*j)["root"]["children"][1] = 7; },
       "root.children[1]: must be an object"},
      {"root named", [](json* j) { (*j)["root"]["name"] = "m"; },
       "root.name: the root module's name must be empty"},
      {"missing architecture", [](json* j) { j->erase("architecture"); },
       "architecture: missing"},
      {"empty architecture", [](json* j) { (*j)["architecture"] = ""; },
       "architecture: must be a non-empty string"},
      {"missing root", [](json* j) { j->erase("root"); }, "root: missing"},
      {"dims negative", [](json* j) { (*j)["dims"]["hidden_size"] = -1; },
       "dims.hidden_size: must be an integer in [0, "},
      {"dims top_k", [](json* j) { (*j)["dims"]["top_k"] = 3; },
       "dims.top_k: must be at most num_experts (2)"},
      {"dims activation", [](json* j) { (*j)["dims"]["activation"] = "relu"; },
       "dims.activation: unknown activation \"relu\""},
      {"dims unknown", [](json* j) { (*j)["dims"]["layers"] = 2; },
       "dims.layers: unknown member"},
      {"dims eps", [](json* j) { (*j)["dims"]["rms_norm_eps"] = "small"; },
       "dims.rms_norm_eps: must be a non-negative number"},
      {"dims aux coef",
       [](json* j) { (*j)["dims"]["router_aux_loss_coef"] = -0.5; },
       "dims.router_aux_loss_coef: must be a non-negative number"},
      // Structural errors found by ValidateModelSpec name the parameter.
      {"tied to nothing",
       [](json* j) {
         (*j)["root"]["children"][2]["params"][0]["tied_to"] = "embed.bias";
       },
       "head.weight: tied_to \"embed.bias\" names no parameter"},
      {"experts mismatch",
       [](json* j) {
         (*j)["root"]["children"][1]["params"][1]["shape"][1] = 5;
       },
       "experts.down_projs: shape [2, 5, 8] must be [E, I, D] = [2, 4, 8]"},
      {"duplicate names",
       [](json* j) { (*j)["root"]["children"][2]["name"] = "embed"; },
       "name \"embed\" is used twice"},
      {"dotted name",
       [](json* j) { (*j)["root"]["children"][2]["name"] = "lm.head"; },
       "contains '.'"},
      {"overflowing shape",
       [](json* j) {
         (*j)["root"]["children"][0]["params"][0]["shape"] = {int64_t{1} << 40,
                                                              int64_t{1} << 40};
         (*j)["root"]["children"][2]["params"][0].erase("tied_to");
       },
       "embed.weight: shape [1099511627776, 1099511627776] has 2^53"},
  };
  for (const BadCase& c : cases) {
    json j = MinimalSpec();
    c.mutate(&j);
    EXPECT_THAT(Parse(j), StatusIs(absl::StatusCode::kInvalidArgument,
                                   HasSubstr(c.needle)))
        << c.label;
  }
}

TEST(NativeSpecTest, DiffusionGemmaDimsByName) {
  SHARDD_ASSERT_OK_AND_ASSIGN(
      v1::ModelSpec hf,
      ModelSpecFromHfConfig(ReadTestFile("diffusion_gemma_26b.json")));
  const json native = json::parse(ModelSpecToNativeJson(hf));
  const json& dims = native["dims"];
  EXPECT_EQ(dims["final_logit_softcapping"], 30.0);
  EXPECT_EQ(dims["embedding_scale"], std::sqrt(2816.0));
  EXPECT_EQ(dims["canvas_length"], 256);
  const json& attention = dims["attention"];
  EXPECT_EQ(attention["sliding_rope"]["type"], "default");
  EXPECT_EQ(attention["rope"]["type"], "proportional");
  EXPECT_EQ(attention["global_head_dim"], "512");  // int64: a JSON string.
  EXPECT_EQ(attention["num_global_key_value_heads"], 2);
  EXPECT_EQ(attention["values_from_keys"], true);
  EXPECT_EQ(attention["v_norm"], true);

  json bad = native;
  bad["dims"]["canvas_length"] = -1;
  EXPECT_THAT(ModelSpecFromNativeJson(bad.dump()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("dims.canvas_length: must be an integer")));
  bad = native;
  bad["dims"]["final_logit_softcapping"] = "30";
  EXPECT_THAT(ModelSpecFromNativeJson(bad.dump()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("dims.final_logit_softcapping: must be a "
                                 "non-negative number")));
}

TEST(NativeSpecTest, DeepNestingIsRejectedNotCrashing) {
  std::string text = R"({"architecture": "X", "root": {"children": [)";
  const int depth = 10000;
  for (int i = 0; i < depth; ++i) text += R"({"name": "m", "children": [)";
  for (int i = 0; i < depth; ++i) text += "]}";
  text += "]}}";
  EXPECT_THAT(ModelSpecFromNativeJson(text),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("nested deeper than 64")));
}

TEST(NativeSpecTest, MalformedJson) {
  for (const char* text : {"", "{", "[1,", "{\"root\": }", "nan"}) {
    EXPECT_THAT(ModelSpecFromNativeJson(text),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("malformed JSON")))
        << text;
  }
  EXPECT_THAT(ModelSpecFromNativeJson("[]"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("must be a JSON object")));
}

}  // namespace
}  // namespace shardd
