#include "program/pass_layout.h"

#include <vector>

#include "gtest/gtest.h"

namespace shardd {
namespace {

TEST(PassLayoutTest, FirstPassesBuildNoGraph) {
  const PassLayout layout = PassLayout::For("MixtralForCausalLM", 3, 1);
  EXPECT_FALSE(layout.block_diffusion());
  EXPECT_FALSE(layout.requires_grad(0));
  EXPECT_TRUE(layout.requires_grad(1));
  EXPECT_TRUE(layout.requires_grad(2));
  EXPECT_EQ(layout.backward_order(), (std::vector<int>{2, 1}));
}

TEST(PassLayoutTest, BlockDiffusionEncodeSelfConditioningDecode) {
  const PassLayout layout =
      PassLayout::For(kBlockDiffusionArchitecture, 3, 1);
  EXPECT_TRUE(layout.block_diffusion());
  EXPECT_TRUE(layout.requires_grad(0));   // Causal encode.
  EXPECT_FALSE(layout.requires_grad(1));  // Self-conditioning decode.
  EXPECT_TRUE(layout.requires_grad(2));   // Decode.
  EXPECT_EQ(layout.backward_order(), (std::vector<int>{2, 0}));
}

TEST(PassLayoutTest, OtherDiffusionGemmaShapesKeepTheDefaultRule) {
  const PassLayout one = PassLayout::For(kBlockDiffusionArchitecture, 1, 0);
  EXPECT_FALSE(one.block_diffusion());
  EXPECT_TRUE(one.requires_grad(0));
  EXPECT_EQ(one.backward_order(), (std::vector<int>{0}));
  const PassLayout two = PassLayout::For(kBlockDiffusionArchitecture, 3, 2);
  EXPECT_FALSE(two.block_diffusion());
  EXPECT_EQ(two.backward_order(), (std::vector<int>{2}));
}

TEST(PassLayoutTest, OutOfRangePassHasNoGradients) {
  const PassLayout layout = PassLayout::For("X", 2, 0);
  EXPECT_FALSE(layout.requires_grad(-1));
  EXPECT_FALSE(layout.requires_grad(2));
}

}  // namespace
}  // namespace shardd
