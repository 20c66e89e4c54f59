#include "model/lora.h"

#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <set>
#include <string>

#include "common/status_matchers.h"
#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/hf_config.h"
#include "model/model_util.h"

namespace shardd {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

v1::ModelSpec Load(const std::string& name) {
  std::ifstream in("tests/data/" + name);
  std::stringstream ss;
  ss << in.rdbuf();
  absl::StatusOr<v1::ModelSpec> spec = ModelSpecFromHfConfig(ss.str());
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

std::map<std::string, v1::TensorSpec> Params(const v1::ModelSpec& spec) {
  std::map<std::string, v1::TensorSpec> out;
  for (const ParamRef& p : ListParams(spec)) out[p.fqn] = *p.tensor;
  return out;
}

v1::LoraConfig Config(int rank, double alpha,
                      std::initializer_list<const char*> targets) {
  v1::LoraConfig c;
  c.set_rank(rank);
  c.set_alpha(alpha);
  for (const char* t : targets) c.add_targets(t);
  return c;
}

std::vector<int64_t> Shape(const v1::TensorSpec& t) {
  return {t.shape().begin(), t.shape().end()};
}

TEST(LoraTest, AdaptsLinearsAndExpertsAndFreezesTheRest) {
  v1::ModelSpec spec = Load("tiny_qwen3_moe.json");
  const v1::ModelSummary before = Summarize(spec);
  SHARDD_ASSERT_OK(
      ApplyLora(Config(4, 8, {"q_proj", "o_proj", "experts"}), &spec));
  SHARDD_ASSERT_OK(ValidateModelSpec(spec));
  const auto m = Params(spec);
  // q_proj [4 * 16, 64], o_proj [64, 64]; experts [8, 64, 64], [8, 32, 64].
  EXPECT_THAT(Shape(m.at("model.layers.0.self_attn.q_proj.lora_A.weight")),
              ElementsAre(4, 64));
  EXPECT_THAT(Shape(m.at("model.layers.0.self_attn.q_proj.lora_B.weight")),
              ElementsAre(64, 4));
  EXPECT_THAT(Shape(m.at("model.layers.1.moe.experts.gate_and_up_projs_lora_A")),
              ElementsAre(8, 4, 64));
  EXPECT_THAT(Shape(m.at("model.layers.1.moe.experts.gate_and_up_projs_lora_B")),
              ElementsAre(8, 64, 4));
  EXPECT_THAT(Shape(m.at("model.layers.1.moe.experts.down_projs_lora_A")),
              ElementsAre(8, 4, 32));
  EXPECT_THAT(Shape(m.at("model.layers.1.moe.experts.down_projs_lora_B")),
              ElementsAre(8, 64, 4));
  EXPECT_FALSE(m.count("model.layers.0.self_attn.k_proj.lora_A.weight"));
  int64_t adapters = 0;
  for (const auto& [name, t] : m) {
    EXPECT_EQ(t.frozen(), !IsLoraAdapter(name)) << name;
    if (IsLoraAdapter(name)) adapters += Numel(t);
  }
  // Per layer: q 4*64 + 64*4, o the same, experts 8*4*(64+64) + 8*4*(32+64).
  EXPECT_EQ(adapters, 2 * (2 * 512 + 8 * 4 * 128 + 8 * 4 * 96));
  const v1::ModelSummary after = Summarize(spec);
  EXPECT_EQ(after.trainable_params(), adapters);
  EXPECT_EQ(after.total_params(), before.total_params() + adapters);
  EXPECT_EQ(spec.lora().rank(), 4);

  SHARDD_ASSERT_OK_AND_ASSIGN(std::vector<LoraTarget> targets,
                              LoraTargetsOf(spec));
  ASSERT_EQ(targets.size(), 2u * 4);
  EXPECT_EQ(targets[0].base, "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(targets[0].experts, 0);
  EXPECT_EQ(targets[0].in, 64);
  EXPECT_EQ(targets[0].out, 64);
  EXPECT_DOUBLE_EQ(targets[0].scale, 2.0);
  const LoraTarget& down = targets[3];
  EXPECT_EQ(down.base, "model.layers.0.moe.experts.down_projs");
  EXPECT_EQ(down.experts, 8);
  EXPECT_EQ(down.in, 32);
  EXPECT_EQ(down.out, 64);

  // Without the adapters: the base model's parameters again.
  const auto base = Params(WithoutLoraAdapters(spec));
  EXPECT_EQ(base.size(), Params(Load("tiny_qwen3_moe.json")).size());
  EXPECT_FALSE(base.count("model.layers.0.self_attn.q_proj.lora_A.weight"));
}

TEST(LoraTest, LatentAttentionProjections) {
  v1::ModelSpec spec = Load("tiny_deepseek_v3.json");
  SHARDD_ASSERT_OK(ApplyLora(Config(2, 4, {"kv_b_proj", "gate_proj"}), &spec));
  SHARDD_ASSERT_OK_AND_ASSIGN(std::vector<LoraTarget> targets,
                              LoraTargetsOf(spec));
  EXPECT_FALSE(targets.empty());
  for (const LoraTarget& t : targets) {
    EXPECT_TRUE(absl::StrContains(t.base, "kv_b_proj") ||
                absl::StrContains(t.base, "gate_proj"))
        << t.base;
  }
}

TEST(LoraTest, BadInputNamesTheField) {
  const v1::ModelSpec spec = Load("tiny_qwen3_moe.json");
  struct Case {
    v1::LoraConfig config;
    std::string message;
  };
  const Case cases[] = {
      {Config(0, 8, {"q_proj"}), "lora.rank: must be >= 1, got 0"},
      {Config(4, 0, {"q_proj"}), "lora.alpha: must be a finite number > 0"},
      {Config(4, -1, {"q_proj"}), "lora.alpha"},
      {Config(4, 8, {}), "lora.targets: name at least one"},
      {Config(4, 8, {"q_proj", "q_proj"}), "'q_proj' is named twice"},
      {Config(4, 8, {"qproj"}),
       "lora.targets: 'qproj' matches no linear module of Qwen3MoeForCausalLM; "
       "its targets are experts, gate, k_proj, lm_head, o_proj, q_proj, "
       "v_proj"},
      {Config(4, 8, {"embed_tokens"}), "'embed_tokens' matches no linear"},
  };
  for (const Case& c : cases) {
    v1::ModelSpec copy = spec;
    const absl::Status status = ApplyLora(c.config, &copy);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(status.message(), HasSubstr(c.message));
  }
  v1::ModelSpec twice = spec;
  SHARDD_ASSERT_OK(ApplyLora(Config(4, 8, {"q_proj"}), &twice));
  EXPECT_THAT(ApplyLora(Config(4, 8, {"q_proj"}), &twice).message(),
              HasSubstr("already has LoRA adapters"));
}

// DiffusionGemma's one stack (encode and decodes alike): its attention,
// dense MLP, self-conditioning MLP (gate_proj matches both, as PEFT's
// module names do) and stacked experts.
TEST(LoraTest, DiffusionGemmaAdaptsItsStack) {
  v1::ModelSpec dg = Load("tiny_diffusion_gemma.json");
  SHARDD_ASSERT_OK(ApplyLora(Config(4, 8, {"q_proj", "gate_proj", "experts"}),
                             &dg));
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::vector<LoraTarget> targets,
                              LoraTargetsOf(dg));
  std::set<std::string> bases;
  for (const LoraTarget& t : targets) bases.insert(t.base);
  // 3 layers x (q_proj, mlp.gate_proj, 2 expert tensors) + self_conditioning.
  EXPECT_EQ(targets.size(), 13u);
  EXPECT_EQ(bases.count("model.self_conditioning.gate_proj.weight"), 1u);
  EXPECT_EQ(bases.count("model.layers.2.moe.experts.down_projs"), 1u);
  EXPECT_EQ(bases.count("model.layers.0.self_attn.q_proj.weight"), 1u);
}

TEST(LoraTest, MissingAdapterIsRefused) {
  v1::ModelSpec spec = Load("tiny_qwen3_moe.json");
  SHARDD_ASSERT_OK(ApplyLora(Config(4, 8, {"experts"}), &spec));
  // Drop one expert adapter.
  v1::ModuleSpec* experts = nullptr;
  std::function<void(v1::ModuleSpec*)> find = [&](v1::ModuleSpec* m) {
    if (m->kind() == v1::MODULE_GROUPED_EXPERTS && experts == nullptr) {
      experts = m;
    }
    for (v1::ModuleSpec& c : *m->mutable_children()) find(&c);
  };
  find(spec.mutable_root());
  ASSERT_NE(experts, nullptr);
  for (int i = 0; i < experts->params_size(); ++i) {
    if (experts->params(i).name() == "down_projs_lora_B") {
      experts->mutable_params(i)->set_shape(1, 3);
    }
  }
  EXPECT_THAT(LoraTargetsOf(spec).status().message(),
              HasSubstr("down_projs_lora_B' must have shape [8, 64, 4], got "
                        "[8, 3, 4]"));
}

}  // namespace
}  // namespace shardd
