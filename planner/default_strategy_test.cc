#include "planner/default_strategy.h"

#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/model_util.h"
#include "testing/strategy_test_util.h"

namespace shardd {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing_util::EveryParamOnce;
using testing_util::Module;
using testing_util::ParamNames;
using testing_util::Tensor;
using testing_util::ToyDims;
using testing_util::ToyModel;
using testing_util::UnitNames;

TEST(DefaultStrategyTest, OneUnitPerLayerPlusRoot) {
  const v1::ModelSpec model = ToyModel();
  SHARDD_ASSERT_OK(ValidateModelSpec(model));
  DefaultStrategy strategy;
  EXPECT_EQ(strategy.name(), "default");
  SHARDD_ASSERT_OK_AND_ASSIGN(UnitGrouping grouping,
                              strategy.GroupParams(model, v1::PlanOptions()));
  EXPECT_FALSE(grouping.flat_buckets);
  EXPECT_THAT(UnitNames(grouping),
              ElementsAre("model.layers.0", "model.layers.1", "model.layers.2",
                          "<root>"));
  for (int i = 0; i < 3; ++i) {
    const UnitDraft& unit = grouping.units[i];
    EXPECT_EQ(unit.kind, v1::UNIT_LAYER);
    EXPECT_EQ(unit.layer_index, i);
    EXPECT_TRUE(unit.prefetch_target);
    EXPECT_EQ(unit.parent, -1);
    EXPECT_FALSE(unit.keep_param_dtype);
  }
  EXPECT_THAT(
      ParamNames(grouping.units[1]),
      ElementsAre("model.layers.1.input_layernorm.weight",
                  "model.layers.1.self_attn.qkv", "model.layers.1.self_attn.o",
                  "model.layers.1.mlp.gate_up", "model.layers.1.mlp.down",
                  "model.layers.1.moe.router.weight",
                  "model.layers.1.moe.experts.gate_and_up_projs",
                  "model.layers.1.moe.experts.down_projs"));
  const UnitDraft& root = grouping.units[3];
  EXPECT_EQ(root.kind, v1::UNIT_ROOT);
  EXPECT_EQ(root.layer_index, -1);
  EXPECT_FALSE(root.prefetch_target);
  EXPECT_EQ(root.parent, -1);
  // lm_head.weight is tied to the embedding: not listed.
  EXPECT_THAT(ParamNames(root),
              ElementsAre("model.embed_tokens.weight", "model.norm.weight"));
  EXPECT_TRUE(EveryParamOnce(model, grouping));
}

TEST(DefaultStrategyTest, UntiedHeadGoesToRoot) {
  ToyDims dims;
  dims.tie_embeddings = false;
  const v1::ModelSpec model = ToyModel(dims);
  SHARDD_ASSERT_OK_AND_ASSIGN(
      UnitGrouping grouping,
      DefaultStrategy().GroupParams(model, v1::PlanOptions()));
  EXPECT_THAT(ParamNames(grouping.units.back()),
              ElementsAre("model.embed_tokens.weight", "model.norm.weight",
                          "lm_head.weight"));
  EXPECT_TRUE(EveryParamOnce(model, grouping));
}

TEST(DefaultStrategyTest, ModelWithoutLayerListIsAllRoot) {
  v1::ModelSpec model;
  model.set_architecture("TinyCustom");
  *model.mutable_root() =
      Module("", v1::MODULE_MODEL, {Tensor("bias", {4})},
             {Module("proj", v1::MODULE_GENERIC, {Tensor("weight", {4, 4})})});
  SHARDD_ASSERT_OK(ValidateModelSpec(model));
  SHARDD_ASSERT_OK_AND_ASSIGN(
      UnitGrouping grouping,
      DefaultStrategy().GroupParams(model, v1::PlanOptions()));
  ASSERT_EQ(grouping.units.size(), 1u);
  EXPECT_EQ(grouping.units[0].name, "<root>");
  EXPECT_EQ(grouping.units[0].kind, v1::UNIT_ROOT);
  EXPECT_THAT(ParamNames(grouping.units[0]),
              ElementsAre("bias", "proj.weight"));
}

TEST(DefaultStrategyTest, LayersOnlyModelHasNoRootUnit) {
  v1::ModelSpec model;
  model.set_architecture("LayersOnly");
  *model.mutable_root() = Module(
      "", v1::MODULE_MODEL, {},
      {Module("layers", v1::MODULE_LAYER_LIST, {},
              {Module("0", v1::MODULE_DECODER_LAYER, {Tensor("w", {2, 2})}),
               Module("1", v1::MODULE_DECODER_LAYER, {Tensor("w", {2, 2})})})});
  SHARDD_ASSERT_OK_AND_ASSIGN(
      UnitGrouping grouping,
      DefaultStrategy().GroupParams(model, v1::PlanOptions()));
  EXPECT_THAT(UnitNames(grouping), ElementsAre("layers.0", "layers.1"));
}

TEST(DefaultStrategyTest, EmptyLayerSkippedAndNestedListStaysInLayer) {
  v1::ModelSpec model;
  model.set_architecture("Odd");
  *model.mutable_root() = Module(
      "", v1::MODULE_MODEL, {},
      {Module(
          "layers", v1::MODULE_LAYER_LIST, {},
          {Module("0", v1::MODULE_DECODER_LAYER, {Tensor("w", {2})}),
           Module("1", v1::MODULE_DECODER_LAYER),  // No parameters.
           Module("2", v1::MODULE_DECODER_LAYER, {},
                  {Module("blocks", v1::MODULE_LAYER_LIST, {},
                          {Module("0", v1::MODULE_GENERIC, {Tensor("w", {2})}),
                           Module("1", v1::MODULE_GENERIC,
                                  {Tensor("w", {2})})})})})});
  SHARDD_ASSERT_OK_AND_ASSIGN(
      UnitGrouping grouping,
      DefaultStrategy().GroupParams(model, v1::PlanOptions()));
  EXPECT_THAT(UnitNames(grouping), ElementsAre("layers.0", "layers.2"));
  EXPECT_EQ(grouping.units[0].layer_index, 0);
  EXPECT_EQ(grouping.units[1].layer_index, 2);
  EXPECT_THAT(ParamNames(grouping.units[1]),
              ElementsAre("layers.2.blocks.0.w", "layers.2.blocks.1.w"));
}

TEST(DefaultStrategyTest, RejectsModelWithoutParameters) {
  v1::ModelSpec model;
  model.set_architecture("Empty");
  *model.mutable_root() = Module("", v1::MODULE_MODEL);
  EXPECT_THAT(DefaultStrategy().GroupParams(model, v1::PlanOptions()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("no (untied) parameters")));
}

}  // namespace
}  // namespace shardd
