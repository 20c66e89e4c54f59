#include "worker/model/block_diffusion.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace shardd {
namespace {

std::vector<int32_t> Ramp(int64_t rows, int64_t seq) {
  std::vector<int32_t> v(rows * seq);
  for (int64_t i = 0; i < rows * seq; ++i) v[i] = static_cast<int32_t>(i % 7);
  return v;
}

TEST(BlockDiffusionTest, CanvasIsTheLastTokensAndNoiseFollowsTheGlobalIndex) {
  const int64_t seq = 12, canvas = 5, vocab = 1000;
  const std::vector<int32_t> inputs = Ramp(4, seq);
  const std::vector<int64_t> all = {10, 11, 12, 13};
  DiffusionCanvas whole;
  ASSERT_TRUE(BuildDiffusionCanvas(inputs.data(), 4, seq, canvas, vocab, 3,
                                   all.data(), {}, &whole)
                  .ok());
  // The same sequences split over two ranks: rows 2..3 alone.
  DiffusionCanvas half;
  ASSERT_TRUE(BuildDiffusionCanvas(inputs.data() + 2 * seq, 2, seq, canvas,
                                   vocab, 3, all.data() + 2, {}, &half)
                  .ok());
  for (int64_t j = 0; j < 2 * canvas; ++j) {
    EXPECT_EQ(half.noised[j], whole.noised[2 * canvas + j]);
    EXPECT_EQ(half.clean[j], whole.clean[2 * canvas + j]);
  }
  EXPECT_EQ(half.self_cond[0], whole.self_cond[2]);
  for (int64_t b = 0; b < 4; ++b) {
    for (int64_t j = 0; j < canvas; ++j) {
      EXPECT_EQ(whole.clean[b * canvas + j], inputs[b * seq + seq - canvas + j]);
    }
  }
  // Another step draws other noise somewhere (a 1000-token vocabulary makes
  // an accidental match of all 20 positions negligible).
  DiffusionCanvas other;
  ASSERT_TRUE(BuildDiffusionCanvas(inputs.data(), 4, seq, canvas, vocab, 4,
                                   all.data(), {}, &other)
                  .ok());
  EXPECT_NE(other.noised, whole.noised);
}

TEST(BlockDiffusionTest, NoiseLevelsCoverTheRangeAndCoinsAreFair) {
  // Over many sequences the replaced fraction averages E[t] ~ 0.5 and the
  // coin ~ 0.5 (binomial sd of 4000 draws: 0.008; bound 0.03).
  const int64_t rows = 4000, seq = 3, canvas = 2, vocab = 1 << 20;
  std::vector<int32_t> inputs(rows * seq, 0);
  std::vector<int64_t> index(rows);
  for (int64_t i = 0; i < rows; ++i) index[i] = i;
  DiffusionCanvas c;
  ASSERT_TRUE(BuildDiffusionCanvas(inputs.data(), rows, seq, canvas, vocab, 0,
                                   index.data(), {}, &c)
                  .ok());
  double replaced = 0, coins = 0;
  for (int32_t t : c.noised) replaced += t != 0;
  for (uint8_t s : c.self_cond) coins += s;
  EXPECT_NEAR(replaced / (rows * canvas), 0.5, 0.03);
  EXPECT_NEAR(coins / rows, 0.5, 0.03);
}

TEST(BlockDiffusionTest, NeedsEncoderKeysBeforeTheCanvas) {
  const std::vector<int32_t> inputs = Ramp(1, 4);
  const int64_t index = 0;
  DiffusionCanvas c;
  EXPECT_FALSE(
      BuildDiffusionCanvas(inputs.data(), 1, 4, 4, 10, 0, &index, {}, &c).ok());
  EXPECT_FALSE(
      BuildDiffusionCanvas(inputs.data(), 1, 4, 0, 10, 0, &index, {}, &c).ok());
}

TEST(BlockDiffusionTest, OptionsSetTheNoiseFloorAndTheCoin) {
  // p = 0 and 1 fix the coin; eps = 0.999 replaces nearly every token (the
  // level is at least eps: the expected kept fraction is under 0.001 times
  // (1 - 1/vocab); over 2000 positions, 0.02 leaves margin).
  const int64_t rows = 1000, seq = 3, canvas = 2, vocab = 1 << 20;
  std::vector<int32_t> inputs(rows * seq, 0);
  std::vector<int64_t> index(rows);
  for (int64_t i = 0; i < rows; ++i) index[i] = i;
  for (const double p : {0.0, 1.0}) {
    DiffusionTrainingOptions options;
    options.self_conditioning_p = p;
    options.noise_eps = 0.999;
    DiffusionCanvas c;
    ASSERT_TRUE(BuildDiffusionCanvas(inputs.data(), rows, seq, canvas, vocab, 0,
                                     index.data(), options, &c)
                    .ok());
    double replaced = 0;
    for (int32_t t : c.noised) replaced += t != 0;
    EXPECT_GT(replaced / (rows * canvas), 0.98);
    for (uint8_t s : c.self_cond) ASSERT_EQ(s, p == 1.0 ? 1 : 0);
  }
}

TEST(BlockDiffusionTest, RejectsOptionsOutOfRangeNamingTheField) {
  const std::vector<int32_t> inputs = Ramp(1, 4);
  const int64_t index = 0;
  DiffusionCanvas c;
  struct Bad {
    DiffusionTrainingOptions options;
    const char* field;
  };
  std::vector<Bad> bad(5);
  bad[0].options.noise_eps = 1.0;
  bad[0].field = "train.diffusion.noise_eps";
  bad[1].options.self_conditioning_p = -0.1;
  bad[1].field = "train.diffusion.self_conditioning_p";
  bad[2].options.encoder_loss_weight = -1;
  bad[2].field = "train.diffusion.encoder_loss_weight";
  bad[3].options.diffusion_loss_weight = std::nan("");
  bad[3].field = "train.diffusion.diffusion_loss_weight";
  bad[4].options.noise_eps = std::nan("");
  bad[4].field = "train.diffusion.noise_eps";
  for (const Bad& b : bad) {
    const absl::Status s = BuildDiffusionCanvas(inputs.data(), 1, 4, 2, 10, 0,
                                                &index, b.options, &c);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << b.field;
    EXPECT_NE(s.message().find(b.field), std::string::npos) << s;
  }
  EXPECT_TRUE(ValidateDiffusionTraining({}).ok());
}

// SFT rows: each row's canvas from its own start (pad past the row), the
// same draws as without rows, only the scored positions noised.
TEST(BlockDiffusionTest, CanvasRowsStartPerRowAndNoiseOnlyTheScored) {
  const int64_t seq = 10, canvas = 6, vocab = 1000;
  const std::vector<int32_t> inputs = Ramp(2, seq);
  const std::vector<int64_t> index = {4, 9};
  const std::vector<int32_t> starts = {2, 7};
  std::vector<int32_t> targets(2 * canvas, -1);
  for (int64_t j = 0; j < 4; ++j) targets[j] = 100 + j;  // Row 0: 4 scored.
  targets[canvas + 1] = 200;                             // Row 1: one.
  CanvasRows rows;
  rows.starts = starts.data();
  rows.targets = targets.data();
  rows.pad_id = 999;
  DiffusionTrainingOptions all_noised;
  all_noised.noise_eps = 0.999999;  // Every scored position replaced.
  DiffusionCanvas c, plain;
  ASSERT_TRUE(BuildDiffusionCanvas(inputs.data(), 2, seq, canvas, vocab, 3,
                                   index.data(), all_noised, &c, &rows)
                  .ok());
  ASSERT_TRUE(BuildDiffusionCanvas(inputs.data(), 2, seq, canvas, vocab, 3,
                                   index.data(), all_noised, &plain)
                  .ok());
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t j = 0; j < canvas; ++j) {
      const int64_t i = b * canvas + j;
      const int64_t p = starts[b] + j;
      const int32_t clean = targets[i] >= 0 ? targets[i]
                            : p < seq       ? inputs[b * seq + p]
                                            : 999;
      EXPECT_EQ(c.clean[i], clean) << b << " " << j;
      EXPECT_EQ(c.targets[i], targets[i]) << b << " " << j;
      // The same stream: a scored position takes the token drawn for it.
      EXPECT_EQ(c.noised[i], targets[i] >= 0 ? plain.noised[i] : clean)
          << b << " " << j;
    }
  }
  EXPECT_EQ(c.self_cond, plain.self_cond);
  // Without rows, every position is scored against the clean tokens.
  for (int64_t i = 0; i < 2 * canvas; ++i) {
    EXPECT_EQ(plain.targets[i], plain.clean[i]);
  }
  const std::vector<int32_t> bad = {2, 10};
  rows.starts = bad.data();
  EXPECT_FALSE(BuildDiffusionCanvas(inputs.data(), 2, seq, canvas, vocab, 3,
                                    index.data(), all_noised, &c, &rows)
                   .ok());
}

}  // namespace
}  // namespace shardd
