#include "planner/megatron_fsdp_strategy.h"

#include <cstdint>
#include <random>
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

int64_t UnitNumel(const UnitDraft& unit) {
  int64_t total = 0;
  for (const ParamRef& param : unit.params) total += Numel(*param.tensor);
  return total;
}

v1::PlanOptions Buckets(int64_t elements) {
  v1::PlanOptions options;
  options.set_bucket_elements(elements);
  return options;
}

TEST(MegatronFsdpStrategyTest, GreedyBucketsPerLayer) {
  ToyDims dims;
  dims.layers = 2;
  const v1::ModelSpec model = ToyModel(dims);
  SHARDD_ASSERT_OK(ValidateModelSpec(model));
  MegatronFsdpStrategy strategy;
  EXPECT_EQ(strategy.name(), "megatron_fsdp");
  // Layer params (D=8, Id=6, I=4, E=3) in walk order:
  //   ln 8, qkv 24*8=192, o 64, gate_up 12*8=96, down 48, router 24,
  //   gate_and_up 3*8*8=192, down_projs 3*4*8=96.
  // Greedy with 200: [8+192=200] [64+96=160] [48+24=72] [192] [96].
  // Root: embed 32*8=256 (> 200, alone), norm 8.
  SHARDD_ASSERT_OK_AND_ASSIGN(UnitGrouping grouping,
                              strategy.GroupParams(model, Buckets(200)));
  EXPECT_TRUE(grouping.flat_buckets);
  EXPECT_THAT(
      UnitNames(grouping),
      ElementsAre("model.layers.0#0", "model.layers.0#1", "model.layers.0#2",
                  "model.layers.0#3", "model.layers.0#4", "model.layers.1#0",
                  "model.layers.1#1", "model.layers.1#2", "model.layers.1#3",
                  "model.layers.1#4", "<root>#0", "<root>#1"));
  const int64_t expected_numel[] = {200, 160, 72, 192, 96};
  for (int layer = 0; layer < 2; ++layer) {
    for (int b = 0; b < 5; ++b) {
      const UnitDraft& unit = grouping.units[5 * layer + b];
      EXPECT_EQ(unit.kind, v1::UNIT_FLAT_BUCKET);
      EXPECT_EQ(unit.layer_index, layer);
      EXPECT_TRUE(unit.prefetch_target);
      EXPECT_EQ(unit.parent, -1);
      EXPECT_EQ(UnitNumel(unit), expected_numel[b]) << unit.name;
    }
  }
  const std::string l1 = "model.layers.1.";
  EXPECT_THAT(ParamNames(grouping.units[5]),
              ElementsAre(l1 + "input_layernorm.weight", l1 + "self_attn.qkv"));
  EXPECT_THAT(ParamNames(grouping.units[7]),
              ElementsAre(l1 + "mlp.down", l1 + "moe.router.weight"));
  EXPECT_THAT(ParamNames(grouping.units[10]),
              ElementsAre("model.embed_tokens.weight"));
  EXPECT_THAT(ParamNames(grouping.units[11]), ElementsAre("model.norm.weight"));
  for (int i = 10; i < 12; ++i) {
    EXPECT_EQ(grouping.units[i].layer_index, -1);
    EXPECT_FALSE(grouping.units[i].prefetch_target);
  }
  EXPECT_TRUE(EveryParamOnce(model, grouping));
}

TEST(MegatronFsdpStrategyTest, DefaultBucketHoldsAWholeToyLayer) {
  const v1::ModelSpec model = ToyModel();
  SHARDD_ASSERT_OK_AND_ASSIGN(
      UnitGrouping grouping,
      MegatronFsdpStrategy().GroupParams(model, v1::PlanOptions()));
  EXPECT_THAT(UnitNames(grouping),
              ElementsAre("model.layers.0#0", "model.layers.1#0",
                          "model.layers.2#0", "<root>#0"));
  EXPECT_EQ(UnitNumel(grouping.units[0]), 720);
  EXPECT_EQ(kDefaultBucketElements, 40'000'000);
}

TEST(MegatronFsdpStrategyTest, DtypesNeverShareABucket) {
  v1::ModelSpec model;
  model.set_architecture("Mixed");
  *model.mutable_root() = Module(
      "", v1::MODULE_MODEL, {},
      {Module("layers", v1::MODULE_LAYER_LIST, {},
              {Module("0", v1::MODULE_DECODER_LAYER,
                      {Tensor("a", {10}), Tensor("b", {10}, v1::FLOAT32),
                       Tensor("c", {10}), Tensor("d", {5}, v1::FLOAT32)})})});
  SHARDD_ASSERT_OK_AND_ASSIGN(
      UnitGrouping grouping,
      MegatronFsdpStrategy().GroupParams(model, Buckets(100)));
  EXPECT_THAT(UnitNames(grouping), ElementsAre("layers.0#0", "layers.0#1"));
  EXPECT_THAT(ParamNames(grouping.units[0]),
              ElementsAre("layers.0.a", "layers.0.c"));
  EXPECT_THAT(ParamNames(grouping.units[1]),
              ElementsAre("layers.0.b", "layers.0.d"));
}

TEST(MegatronFsdpStrategyTest, RejectsNegativeBucketElements) {
  EXPECT_THAT(MegatronFsdpStrategy().GroupParams(ToyModel(), Buckets(-5)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("bucket_elements")));
}

// Any bucket size: buckets stay under the limit unless they hold one
// oversized parameter, hold one dtype, never split a parameter, and are
// greedy (the next bucket's first parameter would not have fit).
TEST(MegatronFsdpStrategyTest, BucketInvariantsForRandomLimits) {
  ToyDims dims;
  dims.tie_embeddings = false;
  const v1::ModelSpec model = ToyModel(dims);
  std::mt19937 rng(7);
  for (int iter = 0; iter < 200; ++iter) {
    const int64_t limit = std::uniform_int_distribution<int64_t>(1, 900)(rng);
    SCOPED_TRACE(limit);
    SHARDD_ASSERT_OK_AND_ASSIGN(
        UnitGrouping grouping,
        MegatronFsdpStrategy().GroupParams(model, Buckets(limit)));
    ASSERT_TRUE(EveryParamOnce(model, grouping));
    for (size_t i = 0; i < grouping.units.size(); ++i) {
      const UnitDraft& unit = grouping.units[i];
      ASSERT_FALSE(unit.params.empty());
      const int64_t numel = UnitNumel(unit);
      EXPECT_TRUE(numel <= limit || unit.params.size() == 1) << unit.name;
      for (const ParamRef& param : unit.params) {
        EXPECT_EQ(param.tensor->dtype(), unit.params[0].tensor->dtype());
      }
      if (i + 1 < grouping.units.size() &&
          grouping.units[i + 1].layer_index == unit.layer_index) {
        EXPECT_GT(numel + Numel(*grouping.units[i + 1].params[0].tensor), limit)
            << unit.name << " could have taken the next parameter";
      }
    }
  }
}

}  // namespace
}  // namespace shardd
