#include "kernels/cpu/dense_mlp.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/grad_check.h"
#include "kernels/cpu/test_vectors.h"

namespace shardd {
namespace kernels {
namespace {

using testing_util::RandomVector;

using ::testing::HasSubstr;

std::vector<double> ToDouble(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

double RefAct(GatedActivation act, double g) {
  if (act == GatedActivation::kSwiGLU) return g / (1.0 + std::exp(-g));
  const double k = std::sqrt(2.0 / M_PI);
  return 0.5 * g * (1.0 + std::tanh(k * (g + 0.044715 * g * g * g)));
}

// Naive double reference of the whole MLP; returns y [T, D].
std::vector<double> RefForward(GatedActivation act,
                               const std::vector<double>& x,
                               const std::vector<double>& wg,
                               const std::vector<double>& wu,
                               const std::vector<double>& wd, int64_t t,
                               int64_t d, int64_t in) {
  std::vector<double> y(t * d, 0.0);
  for (int64_t r = 0; r < t; ++r) {
    std::vector<double> a(in);
    for (int64_t j = 0; j < in; ++j) {
      double g = 0, u = 0;
      for (int64_t k = 0; k < d; ++k) {
        g += x[r * d + k] * wg[j * d + k];
        u += x[r * d + k] * wu[j * d + k];
      }
      a[j] = RefAct(act, g) * u;
    }
    for (int64_t o = 0; o < d; ++o)
      for (int64_t j = 0; j < in; ++j) y[r * d + o] += a[j] * wd[o * in + j];
  }
  return y;
}

using testing_util::ExpectGradNear;
using testing_util::NumericGrad;
TEST(DenseMlpTest, HandComputedScalar) {
  // D = I = 1, all weights 1, x = 2: y = act(2) * 2.
  const DenseMlpDims dims{1, 1, 1};
  const float x = 2.0f, one = 1.0f;
  DenseMlpWorkspace ws;
  float y = 0.0f;
  SHARDD_ASSERT_OK(DenseMlpForward(dims, GatedActivation::kSwiGLU, &x, &one,
                                   &one, &one, &y, &ws));
  EXPECT_NEAR(y, 2.0 / (1.0 + std::exp(-2.0)) * 2.0, 1e-6);
  SHARDD_ASSERT_OK(DenseMlpForward(dims, GatedActivation::kGeGLU, &x, &one,
                                   &one, &one, &y, &ws));
  // gelu_tanh(2) = 0.5 * 2 * (1 + tanh(sqrt(2/pi) * (2 + 0.044715 * 8))).
  EXPECT_NEAR(y, (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * 2.35772)) * 2.0,
              1e-6);
}

class DenseMlpActTest : public ::testing::TestWithParam<GatedActivation> {};

TEST_P(DenseMlpActTest, ForwardMatchesReference) {
  const int64_t t = 6, d = 8, in = 12;
  const DenseMlpDims dims{t, d, in};
  const auto x = RandomVector(t * d, 1, 2.0f);
  const auto wg = RandomVector(in * d, 2, 0.5f);
  const auto wu = RandomVector(in * d, 3, 0.5f);
  const auto wd = RandomVector(d * in, 4, 0.5f);
  std::vector<float> y(t * d, 99.0f);
  DenseMlpWorkspace ws;
  SHARDD_ASSERT_OK(DenseMlpForward(dims, GetParam(), x.data(), wg.data(),
                                   wu.data(), wd.data(), y.data(), &ws));
  const auto ref = RefForward(GetParam(), ToDouble(x), ToDouble(wg),
                              ToDouble(wu), ToDouble(wd), t, d, in);
  ExpectGradNear(y, ref, 1e-5, "y");
  EXPECT_GE(ws.bytes(), sizeof(float) * (t * d + 3 * t * in));

  // accumulate_y adds onto what y holds.
  std::vector<float> y2(t * d, 1.5f);
  SHARDD_ASSERT_OK(DenseMlpForward(dims, GetParam(), x.data(), wg.data(),
                                   wu.data(), wd.data(), y2.data(), &ws,
                                   /*accumulate_y=*/true));
  for (size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(y2[i], y[i] + 1.5f, 1e-5);
}

TEST_P(DenseMlpActTest, BackwardMatchesFiniteDifferences) {
  const GatedActivation act = GetParam();
  const int64_t t = 3, d = 4, in = 5;
  const DenseMlpDims dims{t, d, in};
  auto x = RandomVector(t * d, 11, 1.5f);
  auto wg = RandomVector(in * d, 12, 0.8f);
  auto wu = RandomVector(in * d, 13, 0.8f);
  auto wd = RandomVector(d * in, 14, 0.8f);
  const auto r = RandomVector(t * d, 15);  // L = sum(y * r)

  DenseMlpWorkspace ws;
  std::vector<float> y(t * d);
  SHARDD_ASSERT_OK(DenseMlpForward(dims, act, x.data(), wg.data(), wu.data(),
                                   wd.data(), y.data(), &ws));
  std::vector<float> dx(t * d, 42.0f);  // overwritten
  std::vector<float> dwg(in * d, 0.0f), dwu(in * d, 0.0f), dwd(d * in, 0.0f);
  SHARDD_ASSERT_OK(DenseMlpBackward(
      dims, act, wg.data(), wu.data(), wd.data(), r.data(), dx.data(),
      /*accumulate_dx=*/false, dwg.data(), dwu.data(), dwd.data(), &ws));

  // Double reference, fine differences, tight tolerance.
  auto xd = ToDouble(x), wgd = ToDouble(wg), wud = ToDouble(wu),
       wdd = ToDouble(wd);
  auto ref_loss = [&] {
    const auto yy = RefForward(act, xd, wgd, wud, wdd, t, d, in);
    double l = 0;
    for (size_t i = 0; i < yy.size(); ++i) l += yy[i] * r[i];
    return l;
  };
  ExpectGradNear(dx, NumericGrad(xd, 1e-6, ref_loss), 1e-4, "dx");
  ExpectGradNear(dwg, NumericGrad(wgd, 1e-6, ref_loss), 1e-4, "dW_gate");
  ExpectGradNear(dwu, NumericGrad(wud, 1e-6, ref_loss), 1e-4, "dW_up");
  ExpectGradNear(dwd, NumericGrad(wdd, 1e-6, ref_loss), 1e-4, "dW_down");

  // The fp32 kernel's own forward, eps 1e-3, loose tolerance.
  auto kernel_loss = [&] {
    DenseMlpWorkspace w2;
    std::vector<float> yy(t * d);
    EXPECT_TRUE(DenseMlpForward(dims, act, x.data(), wg.data(), wu.data(),
                                wd.data(), yy.data(), &w2)
                    .ok());
    double l = 0;
    for (size_t i = 0; i < yy.size(); ++i) l += double{yy[i]} * r[i];
    return l;
  };
  ExpectGradNear(dx, NumericGrad(x, 1e-3, kernel_loss), 1e-2, "dx fp32");
  ExpectGradNear(dwg, NumericGrad(wg, 1e-3, kernel_loss), 1e-2, "dWg fp32");
  ExpectGradNear(dwu, NumericGrad(wu, 1e-3, kernel_loss), 1e-2, "dWu fp32");
  ExpectGradNear(dwd, NumericGrad(wd, 1e-3, kernel_loss), 1e-2, "dWd fp32");
}

TEST_P(DenseMlpActTest, BackwardAccumulatesAndSkips) {
  const GatedActivation act = GetParam();
  const int64_t t = 4, d = 3, in = 6;
  const DenseMlpDims dims{t, d, in};
  const auto x = RandomVector(t * d, 21);
  const auto wg = RandomVector(in * d, 22);
  const auto wu = RandomVector(in * d, 23);
  const auto wd = RandomVector(d * in, 24);
  const auto dy = RandomVector(t * d, 25);
  DenseMlpWorkspace ws;
  std::vector<float> y(t * d);
  SHARDD_ASSERT_OK(DenseMlpForward(dims, act, x.data(), wg.data(), wu.data(),
                                   wd.data(), y.data(), &ws));
  std::vector<float> dx1(t * d), dwg1(in * d, 0.0f), dwu1(in * d, 0.0f),
      dwd1(d * in, 0.0f);
  SHARDD_ASSERT_OK(DenseMlpBackward(dims, act, wg.data(), wu.data(), wd.data(),
                                    dy.data(), dx1.data(), false, dwg1.data(),
                                    dwu1.data(), dwd1.data(), &ws));
  // Second backward on the same workspace: dx accumulates onto 0.25 and the
  // parameter gradients add onto the first call's.
  std::vector<float> dx2(t * d, 0.25f);
  std::vector<float> dwg2 = dwg1, dwu2 = dwu1, dwd2 = dwd1;
  SHARDD_ASSERT_OK(DenseMlpBackward(dims, act, wg.data(), wu.data(), wd.data(),
                                    dy.data(), dx2.data(), true, dwg2.data(),
                                    dwu2.data(), dwd2.data(), &ws));
  for (size_t i = 0; i < dx1.size(); ++i)
    EXPECT_NEAR(dx2[i], dx1[i] + 0.25f, 1e-6);
  for (size_t i = 0; i < dwg1.size(); ++i) {
    EXPECT_NEAR(dwg2[i], 2 * dwg1[i], 1e-6);
    EXPECT_NEAR(dwu2[i], 2 * dwu1[i], 1e-6);
  }
  for (size_t i = 0; i < dwd1.size(); ++i)
    EXPECT_NEAR(dwd2[i], 2 * dwd1[i], 1e-6);

  // Null outputs are skipped; the rest match.
  std::vector<float> dx3(t * d);
  SHARDD_ASSERT_OK(DenseMlpBackward(dims, act, wg.data(), wu.data(), wd.data(),
                                    dy.data(), dx3.data(), false, nullptr,
                                    nullptr, nullptr, &ws));
  EXPECT_EQ(dx3, dx1);
  std::vector<float> dwd3(d * in, 0.0f);
  SHARDD_ASSERT_OK(DenseMlpBackward(dims, act, nullptr, nullptr, nullptr,
                                    dy.data(), nullptr, false, nullptr, nullptr,
                                    dwd3.data(), &ws));
  EXPECT_EQ(dwd3, dwd1);
}

INSTANTIATE_TEST_SUITE_P(Activations, DenseMlpActTest,
                         ::testing::Values(GatedActivation::kSwiGLU,
                                           GatedActivation::kGeGLU));

TEST(DenseMlpTest, LargePreActivationsStayFinite) {
  // |G| = 100: a naive sigmoid would overflow exp().
  const DenseMlpDims dims{2, 1, 1};
  const std::vector<float> x = {100.0f, -100.0f};
  const float one = 1.0f;
  for (GatedActivation act :
       {GatedActivation::kSwiGLU, GatedActivation::kGeGLU}) {
    DenseMlpWorkspace ws;
    std::vector<float> y(2), dx(2);
    SHARDD_ASSERT_OK(
        DenseMlpForward(dims, act, x.data(), &one, &one, &one, y.data(), &ws));
    // act(100) ~ 100, act(-100) ~ 0 (times u = x).
    EXPECT_NEAR(y[0], 100.0f * 100.0f, 1e-2);
    EXPECT_NEAR(y[1], 0.0f, 1e-6);
    const std::vector<float> dy = {1.0f, 1.0f};
    float dw[3] = {0, 0, 0};
    SHARDD_ASSERT_OK(DenseMlpBackward(dims, act, &one, &one, &one, dy.data(),
                                      dx.data(), false, &dw[0], &dw[1], &dw[2],
                                      &ws));
    for (float v : dx) EXPECT_TRUE(std::isfinite(v));
    for (float v : dw) EXPECT_TRUE(std::isfinite(v));
    // d/dx [act(x) * x] at x = 100 is ~ 2 x = 200.
    EXPECT_NEAR(dx[0], 200.0f, 1e-2);
  }
}

TEST(DenseMlpTest, ErrorsAndPreconditions) {
  DenseMlpWorkspace ws;
  std::vector<float> buf(64, 0.1f);
  float* p = buf.data();
  EXPECT_THAT(
      DenseMlpForward({2, 0, 3}, GatedActivation::kSwiGLU, p, p, p, p, p, &ws),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dim")));
  EXPECT_THAT(
      DenseMlpForward({-1, 2, 3}, GatedActivation::kSwiGLU, p, p, p, p, p, &ws),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tokens")));
  EXPECT_THAT(
      DenseMlpForward({2, 2, 2}, static_cast<GatedActivation>(7), p, p, p, p, p,
                      &ws),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("activation")));
  EXPECT_THAT(DenseMlpForward({2, 2, 2}, GatedActivation::kSwiGLU, p, nullptr,
                              p, p, p, &ws),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("null")));
  // No successful forward yet.
  EXPECT_THAT(
      DenseMlpBackward({2, 2, 2}, GatedActivation::kSwiGLU, p, p, p, p, p,
                       false, p, p, p, &ws),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("forward")));
  SHARDD_ASSERT_OK(
      DenseMlpForward({2, 2, 2}, GatedActivation::kSwiGLU, p, p, p, p, p, &ws));
  EXPECT_THAT(
      DenseMlpBackward({3, 2, 2}, GatedActivation::kSwiGLU, p, p, p, p, p,
                       false, p, p, p, &ws),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("differ")));
  EXPECT_THAT(
      DenseMlpBackward({2, 2, 2}, GatedActivation::kGeGLU, p, p, p, p, p, false,
                       p, p, p, &ws),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("differ")));
  EXPECT_THAT(DenseMlpBackward({2, 2, 2}, GatedActivation::kSwiGLU, p, p, p,
                               nullptr, p, false, p, p, p, &ws),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dy")));
  // Zero tokens is a valid no-op.
  DenseMlpWorkspace empty;
  SHARDD_EXPECT_OK(DenseMlpForward({0, 2, 2}, GatedActivation::kGeGLU, nullptr,
                                   nullptr, nullptr, nullptr, nullptr, &empty));
}

}  // namespace
}  // namespace kernels
}  // namespace shardd
