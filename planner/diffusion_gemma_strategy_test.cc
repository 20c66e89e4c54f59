#include "planner/diffusion_gemma_strategy.h"

#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/default_strategy.h"
#include "model/model_util.h"
#include "testing/strategy_test_util.h"

namespace shardd {
namespace {

using ::testing::ElementsAre;
using testing_util::EveryParamOnce;
using testing_util::Module;
using testing_util::ParamNames;
using testing_util::Tensor;
using testing_util::ToyDims;
using testing_util::ToyModel;
using testing_util::UnitNames;

TEST(DiffusionGemmaStrategyTest, ExpertsUnitBeforeEachLayer) {
  const v1::ModelSpec model = ToyModel();
  SHARDD_ASSERT_OK(ValidateModelSpec(model));
  DiffusionGemmaStrategy strategy;
  EXPECT_EQ(strategy.name(), "diffusion_gemma");
  SHARDD_ASSERT_OK_AND_ASSIGN(UnitGrouping grouping,
                              strategy.GroupParams(model, v1::PlanOptions()));
  EXPECT_THAT(
      UnitNames(grouping),
      ElementsAre("model.layers.0.moe.experts", "model.layers.0",
                  "model.layers.1.moe.experts", "model.layers.1",
                  "model.layers.2.moe.experts", "model.layers.2", "<root>"));
  for (int layer = 0; layer < 3; ++layer) {
    const UnitDraft& experts = grouping.units[2 * layer];
    const UnitDraft& rest = grouping.units[2 * layer + 1];
    EXPECT_EQ(experts.kind, v1::UNIT_EXPERTS);
    EXPECT_EQ(experts.layer_index, layer);
    EXPECT_EQ(experts.parent, 2 * layer + 1);
    EXPECT_FALSE(experts.prefetch_target);
    EXPECT_EQ(rest.kind, v1::UNIT_LAYER);
    EXPECT_EQ(rest.layer_index, layer);
    EXPECT_EQ(rest.parent, -1);
    EXPECT_TRUE(rest.prefetch_target);
  }
  const std::string l1 = "model.layers.1.";
  EXPECT_THAT(ParamNames(grouping.units[2]),
              ElementsAre(l1 + "moe.experts.gate_and_up_projs",
                          l1 + "moe.experts.down_projs"));
  // The router stays with the layer, as in NeMo's fully_shard_diffusion_gemma.
  EXPECT_THAT(ParamNames(grouping.units[3]),
              ElementsAre(l1 + "input_layernorm.weight", l1 + "self_attn.qkv",
                          l1 + "self_attn.o", l1 + "mlp.gate_up",
                          l1 + "mlp.down", l1 + "moe.router.weight"));
  EXPECT_EQ(grouping.units[6].kind, v1::UNIT_ROOT);
  EXPECT_THAT(ParamNames(grouping.units[6]),
              ElementsAre("model.embed_tokens.weight", "model.norm.weight"));
  EXPECT_TRUE(EveryParamOnce(model, grouping));
}

TEST(DiffusionGemmaStrategyTest, DenseLeadingLayersHaveNoExpertsUnit) {
  ToyDims dims;
  dims.first_dense = 1;
  const v1::ModelSpec model = ToyModel(dims);
  SHARDD_ASSERT_OK(ValidateModelSpec(model));
  SHARDD_ASSERT_OK_AND_ASSIGN(
      UnitGrouping grouping,
      DiffusionGemmaStrategy().GroupParams(model, v1::PlanOptions()));
  EXPECT_THAT(UnitNames(grouping),
              ElementsAre("model.layers.0", "model.layers.1.moe.experts",
                          "model.layers.1", "model.layers.2.moe.experts",
                          "model.layers.2", "<root>"));
  EXPECT_EQ(grouping.units[1].parent, 2);
  EXPECT_EQ(grouping.units[3].parent, 4);
  EXPECT_TRUE(EveryParamOnce(model, grouping));
}

TEST(DiffusionGemmaStrategyTest, DenseModelMatchesDefault) {
  ToyDims dims;
  dims.experts = 0;
  const v1::ModelSpec model = ToyModel(dims);
  SHARDD_ASSERT_OK_AND_ASSIGN(
      UnitGrouping gemma,
      DiffusionGemmaStrategy().GroupParams(model, v1::PlanOptions()));
  SHARDD_ASSERT_OK_AND_ASSIGN(
      UnitGrouping plain,
      DefaultStrategy().GroupParams(model, v1::PlanOptions()));
  EXPECT_EQ(UnitNames(gemma), UnitNames(plain));
  ASSERT_EQ(gemma.units.size(), plain.units.size());
  for (size_t i = 0; i < gemma.units.size(); ++i) {
    EXPECT_EQ(ParamNames(gemma.units[i]), ParamNames(plain.units[i]));
    EXPECT_EQ(gemma.units[i].kind, plain.units[i].kind);
  }
}

TEST(DiffusionGemmaStrategyTest, LayerOfOnlyExpertsKeepsOneUnit) {
  v1::ModelSpec model;
  model.set_architecture("DiffusionGemmaForBlockDiffusion");
  *model.mutable_root() =
      Module("", v1::MODULE_MODEL, {},
             {Module("layers", v1::MODULE_LAYER_LIST, {},
                     {Module("0", v1::MODULE_DECODER_LAYER, {},
                             {Module("experts", v1::MODULE_GROUPED_EXPERTS,
                                     {Tensor("gate_and_up_projs", {2, 4, 6}),
                                      Tensor("down_projs", {2, 3, 4})})})})});
  SHARDD_ASSERT_OK(ValidateModelSpec(model));
  SHARDD_ASSERT_OK_AND_ASSIGN(
      UnitGrouping grouping,
      DiffusionGemmaStrategy().GroupParams(model, v1::PlanOptions()));
  ASSERT_EQ(grouping.units.size(), 1u);
  EXPECT_EQ(grouping.units[0].name, "layers.0");
  EXPECT_EQ(grouping.units[0].kind, v1::UNIT_LAYER);
  EXPECT_THAT(ParamNames(grouping.units[0]),
              ElementsAre("layers.0.experts.gate_and_up_projs",
                          "layers.0.experts.down_projs"));
}

}  // namespace
}  // namespace shardd
