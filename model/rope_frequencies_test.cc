#include "model/rope_frequencies.h"

#include <algorithm>
#include <cmath>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;

v1::RopeSpec Rope(const std::string& type, double theta) {
  v1::RopeSpec r;
  r.set_type(type);
  r.set_theta(theta);
  return r;
}

TEST(RopeFrequenciesTest, DefaultAndLinear) {
  SHARDD_ASSERT_OK_AND_ASSIGN(RopeFrequencies d,
                              ComputeRopeFrequencies(Rope("default", 1e4), 64));
  ASSERT_EQ(d.inv_freq.size(), 32u);
  EXPECT_FLOAT_EQ(d.inv_freq[0], 1.0f);
  EXPECT_FLOAT_EQ(d.inv_freq[5], static_cast<float>(std::pow(1e4, -10.0 / 64)));
  EXPECT_EQ(d.attention_factor, 1.0f);
  v1::RopeSpec lin = Rope("linear", 1e4);
  lin.set_factor(4.0);
  SHARDD_ASSERT_OK_AND_ASSIGN(RopeFrequencies l,
                              ComputeRopeFrequencies(lin, 64));
  for (size_t i = 0; i < l.inv_freq.size(); ++i) {
    EXPECT_FLOAT_EQ(l.inv_freq[i], d.inv_freq[i] / 4.0f) << i;
  }
  // Partial rotary: a quarter of 64 dims.
  v1::RopeSpec part = Rope("default", 1e4);
  part.set_partial_rotary_factor(0.25);
  SHARDD_ASSERT_OK_AND_ASSIGN(RopeFrequencies p,
                              ComputeRopeFrequencies(part, 64));
  ASSERT_EQ(p.inv_freq.size(), 8u);
  EXPECT_FLOAT_EQ(p.inv_freq[1], static_cast<float>(std::pow(1e4, -2.0 / 16)));
}

TEST(RopeFrequenciesTest, Llama3KeepsHighFrequenciesAndScalesLowOnes) {
  v1::RopeSpec r = Rope("llama3", 5e5);
  r.set_factor(8.0);
  r.set_low_freq_factor(1.0);
  r.set_high_freq_factor(4.0);
  r.set_original_max_position_embeddings(8192);
  SHARDD_ASSERT_OK_AND_ASSIGN(RopeFrequencies l,
                              ComputeRopeFrequencies(r, 128));
  SHARDD_ASSERT_OK_AND_ASSIGN(
      RopeFrequencies d, ComputeRopeFrequencies(Rope("default", 5e5), 128));
  int high = 0, low = 0, medium = 0;
  for (size_t i = 0; i < d.inv_freq.size(); ++i) {
    const double wavelen = 2 * M_PI / d.inv_freq[i];
    if (wavelen < 8192.0 / 4) {
      EXPECT_FLOAT_EQ(l.inv_freq[i], d.inv_freq[i]) << i;
      ++high;
    } else if (wavelen > 8192.0) {
      EXPECT_FLOAT_EQ(l.inv_freq[i], d.inv_freq[i] / 8.0f) << i;
      ++low;
    } else {
      EXPECT_LT(l.inv_freq[i], d.inv_freq[i]) << i;
      EXPECT_GT(l.inv_freq[i], d.inv_freq[i] / 8.0f) << i;
      ++medium;
    }
  }
  EXPECT_GT(high, 0);
  EXPECT_GT(low, 0);
  EXPECT_GT(medium, 0);
}

TEST(RopeFrequenciesTest, YarnRampAndAttentionFactor) {
  v1::RopeSpec r = Rope("yarn", 1e4);
  r.set_factor(40.0);
  r.set_original_max_position_embeddings(4096);
  r.set_mscale(1.0);
  r.set_mscale_all_dim(1.0);
  SHARDD_ASSERT_OK_AND_ASSIGN(RopeFrequencies y, ComputeRopeFrequencies(r, 64));
  SHARDD_ASSERT_OK_AND_ASSIGN(RopeFrequencies d,
                              ComputeRopeFrequencies(Rope("default", 1e4), 64));
  // Fast dims extrapolate (unchanged), slow dims interpolate (/ factor).
  EXPECT_FLOAT_EQ(y.inv_freq.front(), d.inv_freq.front());
  EXPECT_FLOAT_EQ(y.inv_freq.back(), d.inv_freq.back() / 40.0f);
  for (size_t i = 0; i < y.inv_freq.size(); ++i) {
    EXPECT_LE(y.inv_freq[i], d.inv_freq[i] * (1 + 1e-7)) << i;
    EXPECT_GE(y.inv_freq[i], d.inv_freq[i] / 40.0f * (1 - 1e-7)) << i;
  }
  // mscale == mscale_all_dim: the factors cancel (DeepSeek-V3 applies
  // its own softmax scale instead).
  EXPECT_FLOAT_EQ(y.attention_factor, 1.0f);
  r.clear_mscale();
  r.clear_mscale_all_dim();
  SHARDD_ASSERT_OK_AND_ASSIGN(y, ComputeRopeFrequencies(r, 64));
  EXPECT_FLOAT_EQ(y.attention_factor,
                  static_cast<float>(0.1 * std::log(40.0) + 1.0));
  r.set_attention_factor(0.5);
  SHARDD_ASSERT_OK_AND_ASSIGN(y, ComputeRopeFrequencies(r, 64));
  EXPECT_FLOAT_EQ(y.attention_factor, 0.5f);
}

TEST(RopeFrequenciesTest, YarnUntruncatedRampsOverTheExactCorrectionRange) {
  // GPT-OSS: theta 150000, factor 32, original 4096, head_dim 64. The
  // correction range is dims [8.09, 17.40] instead of [8, 18].
  v1::RopeSpec r = Rope("yarn", 150000.0);
  r.set_factor(32.0);
  r.set_original_max_position_embeddings(4096);
  const int64_t dim = 64;
  auto correction = [&](double rotations) {
    return dim * std::log(4096 / (rotations * 2 * M_PI)) /
           (2 * std::log(150000.0));
  };
  const double lo = correction(32.0), hi = correction(1.0);
  SHARDD_ASSERT_OK_AND_ASSIGN(RopeFrequencies truncated,
                              ComputeRopeFrequencies(r, dim));
  r.set_untruncated(true);
  SHARDD_ASSERT_OK_AND_ASSIGN(RopeFrequencies exact,
                              ComputeRopeFrequencies(r, dim));
  ASSERT_EQ(exact.inv_freq.size(), 32u);
  for (int64_t i = 0; i < dim / 2; ++i) {
    const double base = std::pow(150000.0, -2.0 * i / dim);
    const double ramp = std::clamp((i - lo) / (hi - lo), 0.0, 1.0);
    const double want = base / 32.0 * ramp + base * (1.0 - ramp);
    EXPECT_FLOAT_EQ(exact.inv_freq[i], static_cast<float>(want)) << i;
  }
  // Dim 9 sits inside both ramps but at different places.
  EXPECT_NE(exact.inv_freq[9], truncated.inv_freq[9]);
  EXPECT_FLOAT_EQ(exact.attention_factor,
                  static_cast<float>(0.1 * std::log(32.0) + 1.0));
}

TEST(RopeFrequenciesTest, ProportionalRotatesAFractionOverTheWholeHead) {
  v1::RopeSpec r = Rope("proportional", 1e6);
  r.set_partial_rotary_factor(0.25);
  SHARDD_ASSERT_OK_AND_ASSIGN(RopeFrequencies p, ComputeRopeFrequencies(r, 64));
  ASSERT_EQ(p.inv_freq.size(), 32u);
  EXPECT_FLOAT_EQ(p.inv_freq[3], static_cast<float>(std::pow(1e6, -6.0 / 64)));
  for (size_t i = 8; i < 32; ++i) EXPECT_EQ(p.inv_freq[i], 0.0f) << i;
}

TEST(RopeFrequenciesTest, BadSpecsNameTheField) {
  EXPECT_THAT(
      ComputeRopeFrequencies(Rope("longrope", 1e4), 64),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rope.type")));
  EXPECT_THAT(
      ComputeRopeFrequencies(Rope("default", 0), 64),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rope.theta")));
  EXPECT_THAT(
      ComputeRopeFrequencies(Rope("linear", 1e4), 64),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rope.factor")));
  v1::RopeSpec tiny = Rope("default", 1e4);
  tiny.set_partial_rotary_factor(0.01);
  EXPECT_THAT(ComputeRopeFrequencies(tiny, 64),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("partial_rotary_factor")));
}

}  // namespace
}  // namespace shardd
