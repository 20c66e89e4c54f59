#include "kernels/cpu/rope.h"

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/grad_check.h"
#include "kernels/cpu/rope_element.h"
#include "kernels/cpu/test_vectors.h"

namespace shardd {
namespace kernels {
namespace {

using ::testing::HasSubstr;
using testing_util::ExpectGradNear;
using testing_util::NumericGrad;
using testing_util::RandomVector;

// Frequencies as the default RoPE of Hugging Face: theta^(-2i / R).
std::vector<float> DefaultFrequencies(int64_t rotary_dim, double theta) {
  std::vector<float> f(rotary_dim / 2);
  for (int64_t i = 0; i < rotary_dim / 2; ++i) {
    f[i] = static_cast<float>(
        1.0 / std::pow(theta, static_cast<double>(2 * i) / rotary_dim));
  }
  return f;
}

// Double reference: the rotation with the table's angles (the fp32 product
// p * f, as the kernel), over heads of `head_dim` with rotary dims starting
// at `offset`.
template <typename T>
std::vector<double> RefRotate(const std::vector<T>& x,
                              const std::vector<float>& freq, double factor,
                              RopeLayout layout,
                              const std::vector<int32_t>& pos, int64_t heads,
                              int64_t head_dim, int64_t offset) {
  std::vector<double> y(x.begin(), x.end());
  const int64_t half = static_cast<int64_t>(freq.size());
  for (size_t t = 0; t < pos.size(); ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t base = (t * heads + h) * head_dim + offset;
      for (int64_t i = 0; i < half; ++i) {
        const double a = static_cast<float>(pos[t]) * freq[i];
        const double c = std::cos(a) * factor, s = std::sin(a) * factor;
        const int64_t i1 = layout == RopeLayout::kHalf ? i : 2 * i;
        const int64_t i2 = layout == RopeLayout::kHalf ? i + half : 2 * i + 1;
        const double x1 = x[base + i1], x2 = x[base + i2];
        y[base + i1] = x1 * c - x2 * s;
        y[base + i2] = x2 * c + x1 * s;
      }
    }
  }
  return y;
}

void CheckLayout(RopeLayout layout) {
  // 3 heads of 10 dims whose dims [2, 8) rotate (MLA-like: a no-rope part
  // first, a pass-through tail), yarn-like attention factor.
  const int64_t tokens = 5, heads = 3, head_dim = 10, offset = 2, rotary = 6;
  const float factor = 1.25f;
  const std::vector<float> freq = DefaultFrequencies(rotary, 10000.0);
  SHARDD_ASSERT_OK_AND_ASSIGN(RopeTable table,
                              BuildRopeTable(freq, 64, factor));
  const std::vector<int32_t> pos = {0, 3, 17, 63, 40};
  std::vector<float> x = RandomVector(tokens * heads * head_dim, 1);
  RopeShape shape;
  shape.tokens = tokens;
  shape.heads = heads;
  shape.token_stride = heads * head_dim;
  shape.head_stride = head_dim;
  shape.dim_offset = offset;

  std::vector<float> y = x;
  SHARDD_ASSERT_OK(RopeRotate(table, layout, shape, pos.data(), y.data()));
  const std::vector<double> want =
      RefRotate(x, freq, factor, layout, pos, heads, head_dim, offset);
  // Each output is two fp32 products and a sum of table values rounded once
  // (|c|, |s| <= factor): within 4 * 2^-24 * factor * 2 of the exact value.
  const double tol = 8.0 * factor * std::ldexp(1.0, -24);
  for (size_t i = 0; i < y.size(); ++i) {
    ASSERT_NEAR(y[i], want[i], tol) << i;
  }
  // Dims outside [offset, offset + R) are untouched, bit for bit.
  for (int64_t t = 0; t < tokens * heads; ++t) {
    for (int64_t d : {0, 1, 8, 9}) {
      EXPECT_EQ(y[t * head_dim + d], x[t * head_dim + d]);
    }
  }

  // Backward: the gradient of sum(w * rope(x)) by central differences of
  // the double reference equals the inverse rotation of w.
  const std::vector<float> w = RandomVector(x.size(), 2);
  std::vector<float> dx = w;
  SHARDD_ASSERT_OK(RopeRotate(table, layout, shape, pos.data(), dx.data(),
                              /*inverse=*/true));
  std::vector<double> xd(x.begin(), x.end());
  auto loss = [&]() {
    const std::vector<double> r =
        RefRotate(xd, freq, factor, layout, pos, heads, head_dim, offset);
    double sum = 0;
    for (size_t i = 0; i < r.size(); ++i) sum += r[i] * w[i];
    return sum;
  };
  // A linear map: the differences are exact up to double rounding; the
  // kernel's fp32 rounding is the forward's.
  ExpectGradNear(dx, NumericGrad(xd, 1e-6, loss), 1e-5, "dx");
}

TEST(RopeTest, HalfLayoutMatchesRotateHalf) { CheckLayout(RopeLayout::kHalf); }

TEST(RopeTest, InterleavedLayoutRotatesAdjacentPairs) {
  CheckLayout(RopeLayout::kInterleaved);
}

TEST(RopeTest, InverseUndoesTheRotation) {
  const std::vector<float> freq = DefaultFrequencies(8, 500000.0);
  SHARDD_ASSERT_OK_AND_ASSIGN(RopeTable table, BuildRopeTable(freq, 32, 1.0f));
  std::vector<int32_t> pos(6);
  for (int i = 0; i < 6; ++i) pos[i] = 5 * i;
  const std::vector<float> x = RandomVector(6 * 2 * 8, 3);
  std::vector<float> y = x;
  RopeShape shape{6, 2, 16, 8, 0};
  SHARDD_ASSERT_OK(
      RopeRotate(table, RopeLayout::kHalf, shape, pos.data(), y.data()));
  SHARDD_ASSERT_OK(RopeRotate(table, RopeLayout::kHalf, shape, pos.data(),
                              y.data(), /*inverse=*/true));
  // cos^2 + sin^2 = 1 to fp32 rounding: a few ulps of |x| <= 1.
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(y[i], x[i], 1e-6) << i;
}

// The kernel is the shared per-pair functions (rope_element.h), which the
// CUDA kernel calls too, bit for bit.
TEST(RopeTest, TheSharedElementFunctionsAreTheKernel) {
  const std::vector<float> freq = DefaultFrequencies(8, 10000.0);
  SHARDD_ASSERT_OK_AND_ASSIGN(RopeTable table,
                              BuildRopeTable(freq, 32, 1.25f));
  const int64_t tokens = 5, heads = 3, head_dim = 12, offset = 2, half = 4;
  const std::vector<int32_t> pos = {0, 7, 3, 31, 12};
  const std::vector<float> x = RandomVector(tokens * heads * head_dim, 11);
  for (RopeLayout layout : {RopeLayout::kHalf, RopeLayout::kInterleaved}) {
    for (bool inverse : {false, true}) {
      std::vector<float> got = x, want = x;
      RopeShape shape{tokens, heads, heads * head_dim, head_dim, offset};
      SHARDD_ASSERT_OK(
          RopeRotate(table, layout, shape, pos.data(), got.data(), inverse));
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t h = 0; h < heads; ++h) {
          float* head = want.data() + (t * heads + h) * head_dim + offset;
          for (int64_t i = 0; i < half; ++i) {
            int64_t first, second;
            RopePairOffsets(layout == RopeLayout::kInterleaved, i, half,
                            &first, &second);
            const float s = table.sin[pos[t] * half + i];
            RopeRotatePair(table.cos[pos[t] * half + i], inverse ? -s : s,
                           head + first, head + second);
          }
        }
      }
      EXPECT_EQ(got, want) << static_cast<int>(layout) << " " << inverse;
      EXPECT_NE(got, x);
    }
  }
}

TEST(RopeTest, BadInputNamesTheField) {
  const std::vector<float> freq = DefaultFrequencies(4, 10000.0);
  SHARDD_ASSERT_OK_AND_ASSIGN(RopeTable table, BuildRopeTable(freq, 8, 1.0f));
  std::vector<float> x(4, 0.0f);
  const int32_t pos[] = {8};
  RopeShape shape{1, 1, 4, 4, 0};
  EXPECT_THAT(
      RopeRotate(table, RopeLayout::kHalf, shape, pos, x.data()),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("positions[0]: 8 outside the table's [0, 8)")));
  EXPECT_THAT(
      BuildRopeTable({}, 8, 1.0f),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("inv_freq")));
  EXPECT_THAT(
      BuildRopeTable(freq, 0, 1.0f),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("positions")));
  EXPECT_THAT(BuildRopeTable(freq, 8, std::nanf("")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("attention_factor")));
}

}  // namespace
}  // namespace kernels
}  // namespace shardd
