#include "worker/train_config.h"

#include <cmath>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardd {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(ResolveTrainConfigTest, FillsDefaultsAndChecksTheBatchShape) {
  v1::TrainConfig train;
  train.set_global_batch(12);
  train.set_seq_len(4);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::TrainConfig resolved,
                              ResolveTrainConfig(train, 2, 3));
  EXPECT_EQ(resolved.microbatches(), 3);
  EXPECT_DOUBLE_EQ(resolved.lr(), 3e-3);
  EXPECT_DOUBLE_EQ(resolved.beta1(), 0.9);
  EXPECT_DOUBLE_EQ(resolved.beta2(), 0.95);
  EXPECT_DOUBLE_EQ(resolved.eps(), 1e-8);
  EXPECT_DOUBLE_EQ(resolved.weight_decay(), 0.0);
  EXPECT_DOUBLE_EQ(resolved.grad_clip(), 1.0);
  EXPECT_EQ(resolved.data_order(), "random");

  train.set_lr(0.5);
  train.set_grad_clip(-1);  // Off: stays negative.
  SHARDD_ASSERT_OK_AND_ASSIGN(resolved, ResolveTrainConfig(train, 2, 3));
  EXPECT_DOUBLE_EQ(resolved.lr(), 0.5);
  EXPECT_LT(resolved.grad_clip(), 0);

  // 12 sequences over 4 ranks x 2 micro-batches: 12 % 8 != 0.
  EXPECT_THAT(
      ResolveTrainConfig(train, 4, 2).status(),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("global_batch"), HasSubstr("world size (4)"),
                     HasSubstr("microbatches (2)"))));
  v1::TrainConfig bad = train;
  bad.set_seq_len(0);
  EXPECT_THAT(
      ResolveTrainConfig(bad, 1, 1).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("seq_len")));
  bad = train;
  bad.set_microbatches(2);
  EXPECT_THAT(
      ResolveTrainConfig(bad, 1, 3).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("microbatches")));
  bad = train;
  bad.set_data_order("sorted");
  EXPECT_THAT(ResolveTrainConfig(bad, 1, 1).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("train.data_order: must be \"random\" or "
                                 "\"strided\"")));
  bad = train;
  bad.set_beta2(1.0);
  EXPECT_THAT(ResolveTrainConfig(bad, 1, 1).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("beta2")));
  bad = train;
  bad.set_lr(-1);
  EXPECT_THAT(ResolveTrainConfig(bad, 1, 1).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lr")));
  bad = train;
  bad.set_weight_decay(std::nan(""));
  EXPECT_THAT(
      ResolveTrainConfig(bad, 1, 1).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("weight_decay")));
}

TEST(ResolveTrainConfigTest, DiffusionKnobsTakeDefaultsAndAreChecked) {
  v1::TrainConfig train;
  train.set_global_batch(4);
  train.set_seq_len(4);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::TrainConfig resolved,
                              ResolveTrainConfig(train, 1, 1));
  // NeMo AutoModel's defaults, every field set.
  EXPECT_DOUBLE_EQ(resolved.diffusion().noise_eps(), 1e-3);
  EXPECT_DOUBLE_EQ(resolved.diffusion().self_conditioning_p(), 0.5);
  EXPECT_DOUBLE_EQ(resolved.diffusion().encoder_loss_weight(), 1.0);
  EXPECT_DOUBLE_EQ(resolved.diffusion().diffusion_loss_weight(), 1.0);
  // A set 0 is a value: no encoder loss.
  train.mutable_diffusion()->set_encoder_loss_weight(0.0);
  SHARDD_ASSERT_OK_AND_ASSIGN(resolved, ResolveTrainConfig(train, 1, 1));
  EXPECT_DOUBLE_EQ(resolved.diffusion().encoder_loss_weight(), 0.0);
  EXPECT_DOUBLE_EQ(DiffusionOptionsOf(resolved).encoder_loss_weight, 0.0);
  EXPECT_DOUBLE_EQ(DiffusionOptionsOf(resolved).self_conditioning_p, 0.5);
  train.mutable_diffusion()->set_self_conditioning_p(2.0);
  EXPECT_THAT(ResolveTrainConfig(train, 1, 1).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("train.diffusion.self_conditioning_p")));
  train.mutable_diffusion()->set_self_conditioning_p(0.5);
  train.mutable_diffusion()->set_response_length(4);  // == seq_len
  EXPECT_THAT(ResolveTrainConfig(train, 1, 1).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("train.diffusion.response_length")));
  train.mutable_diffusion()->set_response_length(3);
  SHARDD_ASSERT_OK_AND_ASSIGN(resolved, ResolveTrainConfig(train, 1, 1));
  EXPECT_EQ(DiffusionOptionsOf(resolved).response_length, 3);
  train.mutable_diffusion()->set_noise_eps(-0.5);
  EXPECT_THAT(ResolveTrainConfig(train, 1, 1).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("train.diffusion.noise_eps")));
}

TEST(AdamWConfigOfTest, CopiesTheResolvedHyperParameters) {
  v1::TrainConfig train;
  train.set_global_batch(2);
  train.set_seq_len(4);
  train.set_lr(0.25);
  train.set_weight_decay(0.1);
  SHARDD_ASSERT_OK_AND_ASSIGN(const v1::TrainConfig resolved,
                              ResolveTrainConfig(train, 1, 1));
  const kernels::AdamWConfig adamw = AdamWConfigOf(resolved);
  EXPECT_EQ(adamw.lr, 0.25);
  EXPECT_EQ(adamw.beta1, kDefaultBeta1);
  EXPECT_EQ(adamw.beta2, kDefaultBeta2);
  EXPECT_EQ(adamw.eps, kDefaultEps);
  EXPECT_EQ(adamw.weight_decay, 0.1);
}

TEST(OptimizerOptionsOfTest, DefaultsAndChecks) {
  v1::TrainConfig train;
  train.set_global_batch(2);
  train.set_seq_len(4);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::TrainConfig resolved,
                              ResolveTrainConfig(train, 1, 1));
  EXPECT_EQ(resolved.optimizer(), "adamw");
  EXPECT_EQ(OptimizerOptionsOf(resolved).name, kAdamWOptimizer);
  train.set_optimizer("muon");
  SHARDD_ASSERT_OK_AND_ASSIGN(resolved, ResolveTrainConfig(train, 1, 1));
  const OptimizerOptions muon = OptimizerOptionsOf(resolved);
  EXPECT_EQ(muon.name, kMuonOptimizer);
  EXPECT_EQ(muon.muon.lr, kDefaultMuonLr);
  EXPECT_EQ(muon.muon.momentum, kDefaultMuonMomentum);
  EXPECT_EQ(muon.muon.ns_steps, kDefaultMuonNsSteps);
  train.set_optimizer("lion");
  EXPECT_THAT(ResolveTrainConfig(train, 1, 1).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("train.optimizer: must be one of adamw, "
                                 "muon, got \"lion\"")));
  train.set_optimizer("muon");
  train.set_muon_momentum(1.5);
  EXPECT_THAT(ResolveTrainConfig(train, 1, 1).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("train.muon_momentum: must be in [0, 1)")));
  train.set_muon_momentum(0);
  train.set_muon_lr(-1);
  EXPECT_THAT(ResolveTrainConfig(train, 1, 1).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("train.muon_lr: must be finite and > 0")));
}

}  // namespace
}  // namespace shardd
