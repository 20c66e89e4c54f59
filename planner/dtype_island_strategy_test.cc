#include "planner/dtype_island_strategy.h"

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
using testing_util::UnitNames;

constexpr v1::DType kF32 = v1::FLOAT32;
constexpr int64_t kD = 8;

// A DeepSeek-V4-like layer: fp32 hyper-connection holders (attn_hc, ffn_hc),
// an fp32 attention sink next to bf16 projections, and an fp32 scalar owned
// by the layer itself.
v1::ModuleSpec MixedLayer(const std::string& name) {
  return Module(
      name, v1::MODULE_DECODER_LAYER, {Tensor("layer_scalar", {1}, kF32)},
      {Module("attn_norm", v1::MODULE_NORM, {Tensor("weight", {kD})}),
       Module("attn_hc", v1::MODULE_GENERIC,
              {Tensor("fn", {4, kD}, kF32), Tensor("base", {4}, kF32)}),
       Module("self_attn", v1::MODULE_ATTENTION,
              {Tensor("wq", {kD, kD}), Tensor("sinks", {2}, kF32)}),
       Module("ffn_hc", v1::MODULE_GENERIC, {Tensor("fn", {4, kD}, kF32)}),
       Module("mlp", v1::MODULE_MLP, {Tensor("w1", {6, kD})})});
}

v1::ModelSpec Dsv4LikeModel() {
  v1::ModelSpec model;
  model.set_architecture("DeepseekV4ForCausalLM");
  model.set_dtype(v1::BFLOAT16);
  *model.mutable_root() = Module(
      "", v1::MODULE_MODEL, {},
      {Module(
          "model", v1::MODULE_GENERIC, {},
          {Module("embed", v1::MODULE_EMBEDDING, {Tensor("weight", {16, kD})}),
           Module(
               "layers", v1::MODULE_LAYER_LIST, {},
               {MixedLayer("0"),
                // Entirely fp32: the layer itself is fp32, no island.
                Module("1", v1::MODULE_DECODER_LAYER,
                       {Tensor("a", {kD}, kF32), Tensor("b", {2, kD}, kF32)}),
                // Entirely bf16: nothing to split.
                Module("2", v1::MODULE_DECODER_LAYER,
                       {Tensor("a", {kD}), Tensor("b", {2, kD})})}),
           Module("hc_head", v1::MODULE_GENERIC, {Tensor("fn", {4, kD}, kF32)}),
           Module("norm", v1::MODULE_NORM, {Tensor("weight", {kD})})})});
  return model;
}

TEST(DtypeIslandStrategyTest, Fp32IslandsNestedBeforeTheirParent) {
  const v1::ModelSpec model = Dsv4LikeModel();
  SHARDD_ASSERT_OK(ValidateModelSpec(model));
  DtypeIslandStrategy strategy;
  EXPECT_EQ(strategy.name(), "deepseek_v4");
  SHARDD_ASSERT_OK_AND_ASSIGN(UnitGrouping grouping,
                              strategy.GroupParams(model, v1::PlanOptions()));
  // Layer 0: islands per owning module, in walk order (the layer's own
  // params come before its children's), then the layer.
  EXPECT_THAT(UnitNames(grouping),
              ElementsAre("model.layers.0.<fp32>", "model.layers.0.attn_hc",
                          "model.layers.0.self_attn", "model.layers.0.ffn_hc",
                          "model.layers.0", "model.layers.1", "model.layers.2",
                          "model.hc_head", "<root>"));
  const std::string l0 = "model.layers.0.";
  EXPECT_THAT(ParamNames(grouping.units[0]), ElementsAre(l0 + "layer_scalar"));
  EXPECT_THAT(ParamNames(grouping.units[1]),
              ElementsAre(l0 + "attn_hc.fn", l0 + "attn_hc.base"));
  EXPECT_THAT(ParamNames(grouping.units[2]),
              ElementsAre(l0 + "self_attn.sinks"));
  EXPECT_THAT(ParamNames(grouping.units[3]), ElementsAre(l0 + "ffn_hc.fn"));
  EXPECT_THAT(
      ParamNames(grouping.units[4]),
      ElementsAre(l0 + "attn_norm.weight", l0 + "self_attn.wq", l0 + "mlp.w1"));
  for (int i = 0; i < 4; ++i) {
    const UnitDraft& island = grouping.units[i];
    EXPECT_EQ(island.kind, v1::UNIT_DTYPE_ISLAND);
    EXPECT_EQ(island.parent, 4);
    EXPECT_EQ(island.layer_index, 0);
    EXPECT_TRUE(island.keep_param_dtype);
    EXPECT_FALSE(island.prefetch_target);
  }
  for (int i = 4; i < 7; ++i) {
    EXPECT_EQ(grouping.units[i].kind, v1::UNIT_LAYER);
    EXPECT_EQ(grouping.units[i].layer_index, i - 4);
    EXPECT_EQ(grouping.units[i].parent, -1);
    EXPECT_TRUE(grouping.units[i].prefetch_target);
    EXPECT_FALSE(grouping.units[i].keep_param_dtype);
  }
  // All-fp32 layer 1 stays whole.
  EXPECT_THAT(ParamNames(grouping.units[5]),
              ElementsAre("model.layers.1.a", "model.layers.1.b"));
  // Root island.
  EXPECT_EQ(grouping.units[7].kind, v1::UNIT_DTYPE_ISLAND);
  EXPECT_EQ(grouping.units[7].parent, 8);
  EXPECT_EQ(grouping.units[7].layer_index, -1);
  EXPECT_TRUE(grouping.units[7].keep_param_dtype);
  EXPECT_EQ(grouping.units[8].kind, v1::UNIT_ROOT);
  EXPECT_THAT(ParamNames(grouping.units[8]),
              ElementsAre("model.embed.weight", "model.norm.weight"));
  EXPECT_TRUE(EveryParamOnce(model, grouping));
}

TEST(DtypeIslandStrategyTest, Fp32NeverSharesAUnitWithOtherDtypes) {
  const v1::ModelSpec model = Dsv4LikeModel();
  SHARDD_ASSERT_OK_AND_ASSIGN(
      UnitGrouping grouping,
      DtypeIslandStrategy().GroupParams(model, v1::PlanOptions()));
  for (const UnitDraft& unit : grouping.units) {
    int fp32 = 0;
    for (const ParamRef& param : unit.params) {
      fp32 += param.tensor->dtype() == v1::FLOAT32;
    }
    EXPECT_TRUE(fp32 == 0 || fp32 == static_cast<int>(unit.params.size()))
        << unit.name << " mixes fp32 with other dtypes";
  }
  // The default strategy, by contrast, mixes them in layer 0.
  SHARDD_ASSERT_OK_AND_ASSIGN(
      UnitGrouping plain,
      DefaultStrategy().GroupParams(model, v1::PlanOptions()));
  int fp32 = 0;
  for (const ParamRef& param : plain.units[0].params) {
    fp32 += param.tensor->dtype() == v1::FLOAT32;
  }
  EXPECT_EQ(fp32, 5);
  EXPECT_EQ(plain.units[0].params.size(), 8u);
}

TEST(DtypeIslandStrategyTest, RootOwnFp32ParamIsland) {
  v1::ModelSpec model;
  model.set_architecture("DeepseekV4ForCausalLM");
  *model.mutable_root() =
      Module("", v1::MODULE_MODEL, {Tensor("scale", {1}, kF32)},
             {Module("proj", v1::MODULE_GENERIC, {Tensor("weight", {4, 4})})});
  SHARDD_ASSERT_OK_AND_ASSIGN(
      UnitGrouping grouping,
      DtypeIslandStrategy().GroupParams(model, v1::PlanOptions()));
  EXPECT_THAT(UnitNames(grouping), ElementsAre("<root>.<fp32>", "<root>"));
  EXPECT_EQ(grouping.units[0].parent, 1);
  EXPECT_THAT(ParamNames(grouping.units[0]), ElementsAre("scale"));
}

}  // namespace
}  // namespace shardd
