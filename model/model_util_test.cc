#include "model/model_util.h"

#include <cstdint>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardd {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

v1::TensorSpec* AddParam(v1::ModuleSpec* m, const std::string& name,
                         std::vector<int64_t> shape,
                         v1::DType dtype = v1::BFLOAT16) {
  v1::TensorSpec* t = m->add_params();
  t->set_name(name);
  for (int64_t d : shape) t->add_shape(d);
  t->set_dtype(dtype);
  return t;
}

v1::ModuleSpec* AddChild(v1::ModuleSpec* m, const std::string& name,
                         v1::ModuleKind kind) {
  v1::ModuleSpec* c = m->add_children();
  c->set_name(name);
  c->set_kind(kind);
  return c;
}

// A two-layer MoE model: V=10, H=4, E=4 experts of I=3, top-2, tied head.
v1::ModelSpec TinyModel() {
  v1::ModelSpec spec;
  spec.set_architecture("TinyForCausalLM");
  spec.set_dtype(v1::BFLOAT16);
  spec.mutable_dims()->set_num_experts(4);
  spec.mutable_dims()->set_top_k(2);
  v1::ModuleSpec* root = spec.mutable_root();
  root->set_kind(v1::MODULE_MODEL);
  v1::ModuleSpec* model = AddChild(root, "model", v1::MODULE_GENERIC);
  AddParam(AddChild(model, "embed_tokens", v1::MODULE_EMBEDDING), "weight",
           {10, 4});
  v1::ModuleSpec* layers = AddChild(model, "layers", v1::MODULE_LAYER_LIST);
  for (const char* i : {"0", "1"}) {
    v1::ModuleSpec* layer = AddChild(layers, i, v1::MODULE_DECODER_LAYER);
    AddParam(AddChild(layer, "q_proj", v1::MODULE_GENERIC), "weight", {4, 4});
    v1::ModuleSpec* moe = AddChild(layer, "moe", v1::MODULE_MOE);
    v1::ModuleSpec* gate = AddChild(moe, "gate", v1::MODULE_ROUTER);
    AddParam(gate, "weight", {4, 4})->set_frozen(true);
    AddParam(gate, "e_score_correction_bias", {4}, v1::FLOAT32);
    v1::ModuleSpec* experts =
        AddChild(moe, "experts", v1::MODULE_GROUPED_EXPERTS);
    AddParam(experts, "gate_and_up_projs", {4, 4, 6});
    AddParam(experts, "down_projs", {4, 3, 4});
  }
  AddParam(AddChild(model, "norm", v1::MODULE_NORM), "weight", {4});
  AddParam(AddChild(root, "lm_head", v1::MODULE_LM_HEAD), "weight", {10, 4})
      ->set_tied_to("model.embed_tokens.weight");
  return spec;
}

TEST(NumelTest, ProductOfDims) {
  v1::TensorSpec t;
  EXPECT_EQ(Numel(t), 1);  // Scalar.
  t.add_shape(3);
  t.add_shape(5);
  t.add_shape(7);
  EXPECT_EQ(Numel(t), 105);
}

TEST(NumelTest, SaturatesInsteadOfOverflowing) {
  v1::TensorSpec t;
  for (int i = 0; i < 4; ++i) t.add_shape(int64_t{1} << 20);
  EXPECT_EQ(Numel(t), INT64_MAX);
}

TEST(ForEachParamTest, DepthFirstDeclarationOrderWithPaths) {
  const v1::ModelSpec spec = TinyModel();
  std::vector<std::string> names;
  for (const ParamRef& p : ListParams(spec)) names.push_back(p.fqn);
  EXPECT_THAT(
      names,
      ElementsAre("model.embed_tokens.weight", "model.layers.0.q_proj.weight",
                  "model.layers.0.moe.gate.weight",
                  "model.layers.0.moe.gate.e_score_correction_bias",
                  "model.layers.0.moe.experts.gate_and_up_projs",
                  "model.layers.0.moe.experts.down_projs",
                  "model.layers.1.q_proj.weight",
                  "model.layers.1.moe.gate.weight",
                  "model.layers.1.moe.gate.e_score_correction_bias",
                  "model.layers.1.moe.experts.gate_and_up_projs",
                  "model.layers.1.moe.experts.down_projs", "model.norm.weight",
                  "lm_head.weight"));

  const std::vector<ParamRef> params = ListParams(spec);
  const ParamRef& down = params[5];
  EXPECT_THAT(down.path_names,
              ElementsAre("", "model", "model.layers", "model.layers.0",
                          "model.layers.0.moe", "model.layers.0.moe.experts"));
  ASSERT_EQ(down.path.size(), 6u);
  EXPECT_EQ(down.path.front(), &spec.root());
  EXPECT_EQ(down.path.back()->kind(), v1::MODULE_GROUPED_EXPERTS);
  EXPECT_EQ(down.tensor->name(), "down_projs");
}

TEST(SummarizeTest, CountsTiedOnceFrozenAndExperts) {
  const v1::ModelSummary s = Summarize(TinyModel());
  // Per layer: q 16, gate 16 (frozen), bias 4, experts 4*4*6 + 4*3*4 = 144.
  const int64_t experts = 2 * (96 + 48);
  const int64_t total = 40 + 2 * (16 + 16 + 4) + experts + 4;
  EXPECT_EQ(s.total_params(), total);
  EXPECT_EQ(s.trainable_params(), total - 2 * 16);
  EXPECT_EQ(s.expert_params(), experts);
  EXPECT_EQ(s.num_param_tensors(), 13);
  // Non-expert trainable + top_k/E of the experts.
  EXPECT_EQ(s.active_params(), (total - 2 * 16 - experts) + experts * 2 / 4);
}

TEST(SummarizeTest, DenseModelIsFullyActive) {
  v1::ModelSpec spec = TinyModel();
  spec.mutable_dims()->set_num_experts(0);
  spec.mutable_dims()->set_top_k(0);
  const v1::ModelSummary s = Summarize(spec);
  EXPECT_EQ(s.active_params(), s.trainable_params());
}

TEST(ValidateModelSpecTest, AcceptsWellFormedModel) {
  SHARDD_EXPECT_OK(ValidateModelSpec(TinyModel()));
}

v1::ModuleSpec* Layer0(v1::ModelSpec* spec) {
  return spec->mutable_root()
      ->mutable_children(0)
      ->mutable_children(1)
      ->mutable_children(0);
}

TEST(ValidateModelSpecTest, RejectsStructuralErrors) {
  const auto invalid = [](const v1::ModelSpec& spec, const char* needle) {
    EXPECT_THAT(
        ValidateModelSpec(spec),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(needle)));
  };
  {
    v1::ModelSpec s = TinyModel();
    s.clear_architecture();
    invalid(s, "architecture");
  }
  {
    v1::ModelSpec s = TinyModel();
    s.clear_root();
    invalid(s, "root");
  }
  {
    v1::ModelSpec s = TinyModel();
    Layer0(&s)->mutable_children(0)->mutable_params(0)->set_shape(1, 0);
    invalid(s, "model.layers.0.q_proj.weight: shape[1] is 0");
  }
  {
    v1::ModelSpec s = TinyModel();
    Layer0(&s)->mutable_children(0)->mutable_params(0)->clear_shape();
    invalid(s, "model.layers.0.q_proj.weight: shape has no dimensions");
  }
  {
    v1::ModelSpec s = TinyModel();
    v1::TensorSpec* t = Layer0(&s)->mutable_children(0)->mutable_params(0);
    t->set_shape(0, int64_t{1} << 27);
    t->set_shape(1, int64_t{1} << 26);  // Exactly 2^53.
    invalid(s, "model.layers.0.q_proj.weight: shape [134217728, 67108864]");
  }
  {
    v1::ModelSpec s = TinyModel();
    Layer0(&s)->mutable_children(0)->mutable_params(0)->set_dtype(
        v1::DTYPE_UNSPECIFIED);
    invalid(s, "model.layers.0.q_proj.weight: dtype is not set");
  }
  {
    v1::ModelSpec s = TinyModel();
    Layer0(&s)->mutable_children(0)->set_name("q.proj");
    invalid(s, "contains '.'");
  }
  {
    v1::ModelSpec s = TinyModel();
    Layer0(&s)->mutable_children(0)->set_name("moe");
    invalid(s, "module model.layers.0: name \"moe\" is used twice");
  }
  {
    v1::ModelSpec s = TinyModel();
    Layer0(&s)->mutable_children(0)->mutable_params(0)->clear_name();
    invalid(s, "empty name");
  }
  {
    v1::ModelSpec s = TinyModel();
    s.mutable_root()->mutable_children(1)->mutable_params(0)->set_tied_to(
        "model.embed_tokens.bias");
    invalid(s, "lm_head.weight: tied_to \"model.embed_tokens.bias\" names no");
  }
  {
    v1::ModelSpec s = TinyModel();
    s.mutable_root()->mutable_children(1)->mutable_params(0)->set_shape(0, 11);
    invalid(s, "lm_head.weight: shape [11, 4] differs");
  }
  {
    v1::ModelSpec s = TinyModel();
    s.mutable_root()->mutable_children(1)->mutable_params(0)->set_tied_to(
        "lm_head.weight");
    invalid(s, "is itself tied");
  }
  {
    v1::ModelSpec s = TinyModel();
    v1::ModuleSpec* experts =
        Layer0(&s)->mutable_children(1)->mutable_children(1);
    experts->mutable_params(1)->set_shape(1, 2);  // I differs from 6 / 2.
    invalid(s,
            "model.layers.0.moe.experts.down_projs: shape [4, 2, 4] must "
            "be [E, I, D] = [4, 3, 4]");
  }
  {
    v1::ModelSpec s = TinyModel();
    v1::ModuleSpec* experts =
        Layer0(&s)->mutable_children(1)->mutable_children(1);
    experts->mutable_params()->RemoveLast();
    invalid(s, "grouped experts must hold");
  }
  {
    v1::ModelSpec s = TinyModel();
    s.mutable_root()->set_name("x");
    invalid(s, "root module's name must be empty");
  }
  {
    v1::ModelSpec s = TinyModel();
    v1::ModuleSpec* m = s.mutable_root();
    for (int i = 0; i < 70; ++i) m = AddChild(m, "c", v1::MODULE_GENERIC);
    invalid(s, "deeper than 64");
  }
}

TEST(ValidateModelSpecTest, RejectsModelTotalAtLimit) {
  v1::ModelSpec s = TinyModel();
  // Two tensors of 2^52 elements each: each is fine, the sum reaches 2^53.
  v1::ModuleSpec* m = AddChild(s.mutable_root(), "big", v1::MODULE_GENERIC);
  AddParam(m, "a", {int64_t{1} << 26, int64_t{1} << 26});
  AddParam(m, "b", {int64_t{1} << 26, int64_t{1} << 26});
  EXPECT_THAT(ValidateModelSpec(s),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("big.b: the model's total")));
}

}  // namespace
}  // namespace shardd
