#include "kernels/cpu/rms_norm.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/grad_check.h"
#include "kernels/cpu/rms_norm_element.h"

namespace shardd {
namespace kernels {
namespace {

using ::testing::HasSubstr;

std::vector<float> RandomVector(int64_t n, uint32_t seed, float lo = -1.0f,
                                float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Double-precision reference forward: L = sum(y * r).
double ReferenceLoss(const std::vector<double>& x, const std::vector<double>& w,
                     const std::vector<float>& r, int64_t rows, int64_t dim,
                     double eps, std::vector<double>* y = nullptr) {
  double loss = 0;
  if (y) y->assign(rows * dim, 0.0);
  for (int64_t i = 0; i < rows; ++i) {
    double ms = 0;
    for (int64_t d = 0; d < dim; ++d) ms += x[i * dim + d] * x[i * dim + d];
    const double inv = 1.0 / std::sqrt(ms / dim + eps);
    for (int64_t d = 0; d < dim; ++d) {
      const double yv = x[i * dim + d] * inv * w[d];
      if (y) (*y)[i * dim + d] = yv;
      loss += yv * r[i * dim + d];
    }
  }
  return loss;
}

// Central differences of `f` with respect to every entry of `v`.
using testing_util::NumericGrad;
std::vector<double> ToDouble(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

TEST(RmsNormTest, HandComputedRow) {
  // x = [3, 4]: mean(x^2) = 12.5, so y = x / sqrt(12.5) * w.
  const std::vector<float> x = {3, 4};
  const std::vector<float> w = {1, 2};
  std::vector<float> y(2), inv(1);
  SHARDD_ASSERT_OK(
      RmsNormForward(x.data(), w.data(), 1, 2, 0.0f, y.data(), inv.data()));
  const double rms = std::sqrt(12.5);
  EXPECT_NEAR(inv[0], 1 / rms, 1e-7);
  EXPECT_NEAR(y[0], 3 / rms, 1e-6);
  EXPECT_NEAR(y[1], 2 * 4 / rms, 1e-6);
}

TEST(RmsNormTest, ForwardMatchesDoubleReference) {
  const int64_t rows = 7, dim = 33;
  const double eps = 1e-5;
  const auto x = RandomVector(rows * dim, 1, -3, 3);
  const auto w = RandomVector(dim, 2, 0.5, 1.5);
  std::vector<float> y(rows * dim, 0.0f), inv(rows);
  SHARDD_ASSERT_OK(
      RmsNormForward(x.data(), w.data(), rows, dim, eps, y.data(), inv.data()));
  std::vector<double> ref;
  ReferenceLoss(ToDouble(x), ToDouble(w), std::vector<float>(rows * dim, 0.0f),
                rows, dim, eps, &ref);
  for (int64_t i = 0; i < rows * dim; ++i)
    EXPECT_NEAR(y[i], ref[i], 1e-5 * std::max(1.0, std::abs(ref[i])));
}

TEST(RmsNormTest, BackwardMatchesFiniteDifferences) {
  const int64_t rows = 4, dim = 9;
  const float eps = 1e-5f;
  auto x = RandomVector(rows * dim, 3, -2, 2);
  auto w = RandomVector(dim, 4, 0.5, 1.5);
  const auto r = RandomVector(rows * dim, 5);

  std::vector<float> y(rows * dim), inv(rows);
  SHARDD_ASSERT_OK(
      RmsNormForward(x.data(), w.data(), rows, dim, eps, y.data(), inv.data()));
  std::vector<float> dx(rows * dim, 123.0f);  // overwritten
  std::vector<float> dw(dim, 0.0f);
  SHARDD_ASSERT_OK(RmsNormBackward(r.data(), x.data(), w.data(), inv.data(),
                                   rows, dim, dx.data(), dw.data()));

  // Double reference with fine differences: tight tolerance.
  auto xd = ToDouble(x);
  auto wd = ToDouble(w);
  auto ref_loss = [&] { return ReferenceLoss(xd, wd, r, rows, dim, eps); };
  const auto ndx = NumericGrad(xd, 1e-6, ref_loss);
  const auto ndw = NumericGrad(wd, 1e-6, ref_loss);
  for (size_t i = 0; i < dx.size(); ++i)
    EXPECT_NEAR(dx[i], ndx[i], 1e-4 * std::max(1.0, std::abs(ndx[i]))) << i;
  for (size_t i = 0; i < dw.size(); ++i)
    EXPECT_NEAR(dw[i], ndw[i], 1e-4 * std::max(1.0, std::abs(ndw[i]))) << i;

  // fp32 kernel forward, eps 1e-3: loose tolerance.
  auto kernel_loss = [&] {
    std::vector<float> yy(rows * dim), ii(rows);
    EXPECT_TRUE(
        RmsNormForward(x.data(), w.data(), rows, dim, eps, yy.data(), ii.data())
            .ok());
    double l = 0;
    for (size_t i = 0; i < yy.size(); ++i) l += double{yy[i]} * r[i];
    return l;
  };
  const auto fdx = NumericGrad(x, 1e-3, kernel_loss);
  const auto fdw = NumericGrad(w, 1e-3, kernel_loss);
  for (size_t i = 0; i < dx.size(); ++i)
    EXPECT_NEAR(dx[i], fdx[i], 1e-2 * std::max(1.0, std::abs(fdx[i]))) << i;
  for (size_t i = 0; i < dw.size(); ++i)
    EXPECT_NEAR(dw[i], fdw[i], 1e-2 * std::max(1.0, std::abs(fdw[i]))) << i;
}

TEST(RmsNormTest, BackwardAccumulationFlags) {
  const int64_t rows = 3, dim = 5;
  const auto x = RandomVector(rows * dim, 6);
  const auto w = RandomVector(dim, 7);
  const auto dy = RandomVector(rows * dim, 8);
  std::vector<float> y(rows * dim), inv(rows);
  SHARDD_ASSERT_OK(RmsNormForward(x.data(), w.data(), rows, dim, 1e-6f,
                                  y.data(), inv.data()));
  std::vector<float> dx1(rows * dim), dw1(dim, 0.0f);
  SHARDD_ASSERT_OK(RmsNormBackward(dy.data(), x.data(), w.data(), inv.data(),
                                   rows, dim, dx1.data(), dw1.data()));
  // accumulate_dx adds onto the existing gradient; dweight always adds.
  std::vector<float> dx2(rows * dim, 1.0f), dw2(dim, 2.0f);
  SHARDD_ASSERT_OK(RmsNormBackward(dy.data(), x.data(), w.data(), inv.data(),
                                   rows, dim, dx2.data(), dw2.data(),
                                   /*accumulate_dx=*/true));
  for (size_t i = 0; i < dx1.size(); ++i)
    EXPECT_FLOAT_EQ(dx2[i], dx1[i] + 1.0f);
  for (size_t i = 0; i < dw1.size(); ++i)
    EXPECT_NEAR(dw2[i], dw1[i] + 2.0f, 1e-6);
  // Without the flag dx is overwritten.
  std::vector<float> dx3(rows * dim, 50.0f), dw3(dim, 0.0f);
  SHARDD_ASSERT_OK(RmsNormBackward(dy.data(), x.data(), w.data(), inv.data(),
                                   rows, dim, dx3.data(), dw3.data()));
  EXPECT_EQ(dx3, dx1);
}

// The kernel is the shared per-element functions (rms_norm_element.h), which
// the CUDA kernel calls too, with its own row reductions (here the CPU's:
// double sums in column order).
TEST(RmsNormTest, TheSharedElementFunctionsAreTheKernel) {
  const int64_t rows = 7, dim = 33;
  const std::vector<float> x = RandomVector(rows * dim, 21, -3.0f, 3.0f);
  const std::vector<float> w = RandomVector(dim, 22, 0.5f, 1.5f);
  const std::vector<float> dy = RandomVector(rows * dim, 23);
  std::vector<float> y(rows * dim), inv(rows), dx(rows * dim, 0.25f),
      dw(dim, 0.0f);
  SHARDD_ASSERT_OK(
      RmsNormForward(x.data(), w.data(), rows, dim, 1e-6f, y.data(), inv.data()));
  for (bool accumulate : {false, true}) {
    std::vector<float> got = dx;
    SHARDD_ASSERT_OK(RmsNormBackward(dy.data(), x.data(), w.data(), inv.data(),
                                     rows, dim, got.data(), dw.data(),
                                     accumulate));
    for (int64_t r = 0; r < rows; ++r) {
      double sum_sq = 0.0, dot = 0.0;
      for (int64_t d = 0; d < dim; ++d) {
        const int64_t k = r * dim + d;
        sum_sq += double{x[k]} * x[k];
        ASSERT_EQ(y[k], RmsNormOut(x[k], inv[r], w[d])) << k;
        dot += double{dy[k]} * w[d] * RmsNormHat(x[k], inv[r]);
      }
      ASSERT_EQ(inv[r], RmsNormInverse(sum_sq, dim, 1e-6f)) << r;
      const float mean_dot = RmsNormMeanDot(dot, dim);
      for (int64_t d = 0; d < dim; ++d) {
        const int64_t k = r * dim + d;
        const float grad = RmsNormInputGrad(dy[k], x[k], w[d], inv[r], mean_dot);
        ASSERT_EQ(got[k], accumulate ? dx[k] + grad : grad) << k;
      }
    }
  }
}

TEST(RmsNormTest, InvalidArguments) {
  std::vector<float> x(4), w(2), y(4), inv(2);
  EXPECT_THAT(
      RmsNormForward(x.data(), w.data(), 2, 0, 1e-6f, y.data(), inv.data()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dim")));
  EXPECT_THAT(
      RmsNormForward(x.data(), w.data(), -1, 2, 1e-6f, y.data(), inv.data()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rows")));
  EXPECT_THAT(
      RmsNormForward(x.data(), w.data(), 2, 2, -1.0f, y.data(), inv.data()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("eps")));
  EXPECT_THAT(
      RmsNormForward(x.data(), nullptr, 2, 2, 1e-6f, y.data(), inv.data()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("null")));
  EXPECT_THAT(RmsNormBackward(x.data(), x.data(), w.data(), inv.data(), 2, 2,
                              nullptr, w.data()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("null")));
}

}  // namespace
}  // namespace kernels
}  // namespace shardd
