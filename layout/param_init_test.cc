#include "layout/param_init.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace shardd {
namespace {

v1::TensorSpec Tensor(std::vector<int64_t> shape) {
  v1::TensorSpec t;
  for (int64_t d : shape) t.add_shape(d);
  t.set_dtype(v1::FLOAT32);
  return t;
}

TEST(ParamInitTest, RangesAgreeWithTheWholeTensor) {
  const v1::TensorSpec t = Tensor({10, 7});
  const InitRule rule =
      InitRuleFor(t, v1::MODULE_MLP, "model.layers.0.mlp.up_proj.weight");
  std::vector<float> whole(70);
  InitParamRange(42, "model.layers.0.mlp.up_proj.weight", rule, 0, 70,
                 whole.data());
  // Any split into ranges (as ranks would hold them) gives the same values.
  for (int64_t begin : {0, 1, 13, 35, 69}) {
    for (int64_t count : {int64_t{1}, int64_t{70} - begin}) {
      std::vector<float> part(count);
      InitParamRange(42, "model.layers.0.mlp.up_proj.weight", rule, begin,
                     count, part.data());
      for (int64_t i = 0; i < count; ++i) {
        ASSERT_EQ(part[i], whole[begin + i]) << begin << "+" << i;
      }
    }
  }
}

TEST(ParamInitTest, BoundsSeedsAndNamesMatter) {
  const v1::TensorSpec t = Tensor({64, 16});
  const InitRule rule = InitRuleFor(t, v1::MODULE_MLP, "a.weight");
  EXPECT_EQ(rule.kind, InitKind::kUniform);
  EXPECT_DOUBLE_EQ(rule.bound, 0.25);  // 1 / sqrt(16)
  std::vector<float> a(1024), b(1024), c(1024);
  InitParamRange(1, "a.weight", rule, 0, 1024, a.data());
  InitParamRange(2, "a.weight", rule, 0, 1024, b.data());
  InitParamRange(1, "b.weight", rule, 0, 1024, c.data());
  int same_seed = 0, same_name = 0;
  double sum = 0, sum_sq = 0;
  for (int i = 0; i < 1024; ++i) {
    ASSERT_LE(std::fabs(a[i]), 0.25f);
    same_seed += a[i] == b[i];
    same_name += a[i] == c[i];
    sum += a[i];
    sum_sq += a[i] * a[i];
  }
  EXPECT_LT(same_seed, 5);
  EXPECT_LT(same_name, 5);
  // Uniform(-a, a): mean 0, variance a^2 / 3 = 0.0208.
  EXPECT_NEAR(sum / 1024, 0.0, 0.02);
  EXPECT_NEAR(sum_sq / 1024, 0.25 * 0.25 / 3, 0.004);
}

// LoRA adapters as PEFT starts them: B zero, A with bound 1/sqrt(in).
TEST(ParamInitTest, LoraAdapters) {
  EXPECT_EQ(InitRuleFor(Tensor({64, 4}), v1::MODULE_GENERIC,
                        "model.layers.0.self_attn.q_proj.lora_B.weight")
                .kind,
            InitKind::kZeros);
  EXPECT_EQ(InitRuleFor(Tensor({8, 64, 4}), v1::MODULE_GROUPED_EXPERTS,
                        "model.layers.0.moe.experts.down_projs_lora_B")
                .kind,
            InitKind::kZeros);
  const InitRule a = InitRuleFor(Tensor({4, 16}), v1::MODULE_GENERIC,
                                 "model.layers.0.self_attn.q_proj.lora_A.weight");
  EXPECT_EQ(a.kind, InitKind::kUniform);
  EXPECT_DOUBLE_EQ(a.bound, 0.25);
  // Stacked: the in dim is the last, not dim 1 as for the experts' weights.
  const InitRule ea =
      InitRuleFor(Tensor({8, 4, 64}), v1::MODULE_GROUPED_EXPERTS,
                  "model.layers.0.moe.experts.gate_and_up_projs_lora_A");
  EXPECT_DOUBLE_EQ(ea.bound, 0.125);
}

TEST(ParamInitTest, RulesByKind) {
  EXPECT_EQ(InitRuleFor(Tensor({8}), v1::MODULE_NORM, "model.norm.weight").kind,
            InitKind::kOnes);
  EXPECT_EQ(InitRuleFor(Tensor({8}), v1::MODULE_ATTENTION,
                        "model.layers.0.self_attn.q_proj.bias")
                .kind,
            InitKind::kZeros);
  const InitRule experts =
      InitRuleFor(Tensor({4, 16, 10}), v1::MODULE_GROUPED_EXPERTS,
                  "model.layers.0.moe.experts.gate_and_up_projs");
  EXPECT_DOUBLE_EQ(experts.bound, 0.25);  // fan_in = D = 16
  const InitRule down =
      InitRuleFor(Tensor({4, 9, 16}), v1::MODULE_GROUPED_EXPERTS,
                  "model.layers.0.moe.experts.down_projs");
  EXPECT_DOUBLE_EQ(down.bound, 1.0 / 3.0);  // fan_in = I = 9
  std::vector<float> ones(5);
  InitParamRange(7, "model.norm.weight", InitRule{InitKind::kOnes, 0}, 3, 5,
                 ones.data());
  for (float v : ones) EXPECT_EQ(v, 1.0f);
}

}  // namespace
}  // namespace shardd
