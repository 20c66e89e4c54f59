// The gated MLPs' per-element arithmetic (gate_element.h), which the CUDA
// kernels share: accurate against double-precision references within bounds
// derived from its roundings, right at the special values, and exactly what
// the CPU kernels compute at every SIMD level.

#include "kernels/cpu/gate_element.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/cpu/dense_mlp.h"
#include "kernels/cpu/grouped_experts.h"
#include "kernels/cpu/simd_level.h"
#include "kernels/cpu/vec_exp.h"

namespace shardd {
namespace kernels {
namespace {

constexpr double kU = 0x1p-24;  // unit roundoff of fp32
constexpr double kExpRel = 8.2e-8;  // VecExp's bound (vec_exp.h), ~1.4 u
constexpr double kSqrt2OverPi = 0.79788456080286535588;
constexpr double kGeluA = 0.044715;

// g values over the range the gates see: a dense sweep of [-45, 45], the
// clamp edges and tiny magnitudes.
std::vector<float> Samples() {
  std::vector<float> g;
  for (int i = -4500; i <= 4500; ++i) g.push_back(0.01f * i + 0.0037f);
  for (float v : {0.0f, -0.0f, 1e-30f, -1e-30f, 1e-6f, -1e-6f, 40.0f, -40.0f,
                  39.99f, -39.99f, 10.0f, -10.0f, 7.0f, -7.0f}) {
    g.push_back(v);
  }
  return g;
}

double Sigmoid(double g) { return 1.0 / (1.0 + std::exp(-g)); }

TEST(VecExpTest, WithinItsStatedBoundOnTheClampedRange) {
  for (int i = -40000; i <= 40000; ++i) {
    const float x = 0.001f * i;
    const double ref = std::exp(static_cast<double>(x));
    ASSERT_LE(std::abs(VecExp(x) - ref), kExpRel * ref) << x;
  }
  EXPECT_EQ(VecExp(-100.0f), VecExp(-40.0f));
  EXPECT_EQ(VecExp(100.0f), VecExp(40.0f));
  EXPECT_EQ(VecExp(std::numeric_limits<float>::quiet_NaN()), VecExp(-40.0f));
}

TEST(GateElementTest, SiluAndItsSlopeMatchDoublePrecision) {
  for (float gf : Samples()) {
    const double g = gf;
    float f, df;
    SiluGate::ValueAndGrad(gf, &f, &df);
    EXPECT_EQ(f, SiluGate::Value(gf));
    if (gf <= -40.0f) {
      // Cut to exactly 0; the true values are below 2e-16 in magnitude.
      EXPECT_EQ(f, 0.0f) << g;
      EXPECT_LT(std::abs(g * Sigmoid(g)), 2e-16);
      continue;
    }
    const double s = Sigmoid(g);
    // s = 1 / (1 + e): the exp's error scaled by e / (1 + e) <= 1, then two
    // roundings; f = g s one more.
    const double s_rel = kExpRel + 2 * kU;
    EXPECT_LE(std::abs(f - g * s), (s_rel + kU) * std::abs(g * s) + 1e-45)
        << g;
    // f' = s (1 + g (1 - s)): error bounded by s's relative error carried
    // through the expression evaluated in absolute values, plus its four
    // roundings.
    const double ref = s * (1 + g * (1 - s));
    const double scale = s * (1 + std::abs(g) * (1 + s));
    EXPECT_LE(std::abs(df - ref), (2 * s_rel + 4 * kU) * scale + 1e-45) << g;
  }
}

TEST(GateElementTest, GeluTanhAndItsSlopeMatchDoublePrecision) {
  for (float gf : Samples()) {
    const double g = gf;
    const double z = kSqrt2OverPi * (g + kGeluA * g * g * g);
    const double th = std::tanh(z);
    float f, df;
    GeluTanhGate::ValueAndGrad(gf, &f, &df);
    EXPECT_EQ(f, GeluTanhGate::Value(gf));
    // z carries 6 roundings (and the fp32 constants, 1 each); e^(2z) then
    // has relative error 2|z| that much plus the exp's own; tanh = 1 - 2 /
    // (1 + E) moves by at most half E's relative error, plus 3 roundings of
    // at most 2 in magnitude. Beyond |z| = 9 the fp32 exp saturates (the
    // clamp at 40 on 2z only makes E larger), and tanh is +-1 to fp32.
    const double z_rel = 8 * kU;
    double th_err = 0.5 * (kExpRel + 2 * std::abs(z) * z_rel) + 6 * kU;
    if (std::abs(z) > 9) th_err = std::max(th_err, std::abs(std::abs(th) - 1));
    const double f_ref = 0.5 * g * (1 + th);
    EXPECT_LE(std::abs(f - f_ref),
              0.5 * std::abs(g) * th_err + 3 * kU * std::abs(f_ref) + 1e-45)
        << g;
    const double gc = std::min(10.0, std::max(-10.0, g));
    const double poly = kSqrt2OverPi * (1 + 3 * kGeluA * gc * gc);
    const double df_ref = 0.5 * (1 + th) + 0.5 * gc * (1 - th * th) * poly;
    const double scale = 0.5 * (1 + std::abs(th)) +
                         0.5 * std::abs(gc) * (1 + th * th) * poly;
    EXPECT_LE(std::abs(df - df_ref),
              th_err * (0.5 + std::abs(gc) * std::abs(th) * poly) +
                  10 * kU * scale + 1e-45)
        << g;
  }
}

TEST(GateElementTest, SpecialValues) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  float f, df;
  // NaN in, NaN out (a diverged step must not look finite).
  SiluGate::ValueAndGrad(nan, &f, &df);
  EXPECT_TRUE(std::isnan(f));
  GeluTanhGate::ValueAndGrad(nan, &f, &df);
  EXPECT_TRUE(std::isnan(f));
  // Huge inputs: the limits, and finite slopes where they exist.
  SiluGate::ValueAndGrad(1e30f, &f, &df);
  EXPECT_EQ(f, 1e30f);
  EXPECT_EQ(df, 1.0f);
  GeluTanhGate::ValueAndGrad(1e30f, &f, &df);
  EXPECT_EQ(f, 1e30f);
  EXPECT_EQ(df, 1.0f);
  GeluTanhGate::ValueAndGrad(-1e30f, &f, &df);
  EXPECT_EQ(f, 0.0f);
  EXPECT_EQ(df, 0.0f);
  SiluGate::ValueAndGrad(-1e30f, &f, &df);
  EXPECT_EQ(f, 0.0f);
  EXPECT_EQ(df, 0.0f);
  // An infinite input is a diverged step: not finite out (torch's
  // x * sigmoid(x) also gives NaN at -inf).
  SiluGate::ValueAndGrad(-inf, &f, &df);
  EXPECT_FALSE(std::isfinite(f));
  GeluTanhGate::ValueAndGrad(inf, &f, &df);
  EXPECT_FALSE(std::isfinite(f));
}

TEST(GateElementTest, ClampedSwiGluClampsAndPassesGradientAtTheBounds) {
  const ClampedSwiGluGate gate{1.702f, 7.0f};
  const float w = 0.75f, da = 1.5f;
  float w_term, dg, du;
  // Inside and on the bounds: gradient flows (torch.clamp).
  for (float g : {-3.0f, 0.5f, 7.0f}) {
    for (float u : {-7.0f, 0.0f, 7.0f}) {
      gate.Backward(g, u, da, w, &w_term, &dg, &du);
      const double s = Sigmoid(1.702 * g);
      const double glu = g * s;
      EXPECT_NEAR(gate.Forward(g, u, w), glu * (u + 1) * w,
                  1e-6 * std::abs(glu * (u + 1)) + 1e-30);
      EXPECT_NEAR(du, da * w * glu, 1e-6 * std::abs(glu) + 1e-30);
      EXPECT_NEAR(dg, da * w * (u + 1) * (s + 1.702 * g * s * (1 - s)),
                  1e-5 * std::abs(u + 1) + 1e-30);
      EXPECT_NEAR(w_term, da * glu * (u + 1), 1e-6 * std::abs(glu * (u + 1)));
    }
  }
  // Beyond: the value is the bound's, the gradient 0.
  EXPECT_EQ(gate.Forward(9.0f, 2.0f, w), gate.Forward(7.0f, 2.0f, w));
  EXPECT_EQ(gate.Forward(1.0f, -9.0f, w), gate.Forward(1.0f, -7.0f, w));
  gate.Backward(9.0f, 2.0f, da, w, &w_term, &dg, &du);
  EXPECT_EQ(dg, 0.0f);
  EXPECT_NE(du, 0.0f);
  gate.Backward(1.0f, 9.0f, da, w, &w_term, &dg, &du);
  EXPECT_EQ(du, 0.0f);
  EXPECT_NE(dg, 0.0f);
}

std::vector<SimdLevel> Levels() {
  std::vector<SimdLevel> levels;
  for (SimdLevel level :
       {SimdLevel::kBaseline, SimdLevel::kX86_64_V3, SimdLevel::kX86_64_V4}) {
    if (level <= SupportedSimdLevel()) levels.push_back(level);
  }
  return levels;
}

// D = 1 and a down projection of ones make dA = dy exactly, so every input
// of the element functions can be read back from the workspace.
TEST(GateElementTest, TheDenseMlpKernelComputesExactlyTheElementFunctions) {
  const int64_t t = 37, in = 29;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> x(t), gate_proj(in), up_proj(in), down(in, 1.0f), dy(t);
  for (float& v : x) v = normal(rng);
  for (float& v : gate_proj) v = normal(rng);
  for (float& v : up_proj) v = normal(rng);
  for (float& v : dy) v = normal(rng);
  const DenseMlpDims dims{t, 1, in};
  for (GatedActivation act : {GatedActivation::kSwiGLU,
                              GatedActivation::kGeGLU}) {
    for (SimdLevel level : Levels()) {
      SCOPED_TRACE(SimdLevelName(level));
      SHARDD_ASSERT_OK(OverrideSimdLevel(level));
      DenseMlpWorkspace ws;
      std::vector<float> y(t), dx(t);
      SHARDD_ASSERT_OK(DenseMlpForward(dims, act, x.data(), gate_proj.data(),
                                       up_proj.data(), down.data(), y.data(),
                                       &ws));
      const std::vector<float> gate = ws.gate, up = ws.up;
      SHARDD_ASSERT_OK(DenseMlpBackward(
          dims, act, gate_proj.data(), up_proj.data(), down.data(), dy.data(),
          dx.data(), false, nullptr, nullptr, nullptr, &ws));
      int checked = 0;
      auto check = [&](const auto& element) {
        for (int64_t r = 0; r < t; ++r) {
          for (int64_t i = 0; i < in; ++i) {
            const int64_t k = r * in + i;
            ASSERT_EQ(ws.hidden[k], element.Forward(gate[k], up[k], 1.0f));
            float w_term, dg, du;
            element.Backward(gate[k], up[k], dy[r], 1.0f, &w_term, &dg, &du);
            ASSERT_EQ(ws.d_gate[k], dg) << r << "," << i;
            ASSERT_EQ(ws.d_hidden[k], du) << r << "," << i;
            ++checked;
          }
        }
      };
      if (act == GatedActivation::kSwiGLU) {
        check(ProductGate<SiluGate>{});
      } else {
        check(ProductGate<GeluTanhGate>{});
      }
      EXPECT_EQ(checked, t * in);
    }
  }
  SHARDD_ASSERT_OK(OverrideSimdLevel(SimdLevel::kBaseline));
}

TEST(GateElementTest, TheGroupedExpertsKernelComputesExactlyTheElementFunctions) {
  const ExpertDims dims{/*tokens=*/23, /*dim=*/8, /*intermediate=*/19,
                        /*experts=*/3, /*top_k=*/2};
  const int64_t inter = dims.intermediate;
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> unit(0.1f, 1.0f);
  std::vector<float> x(dims.tokens * dims.dim), weights(dims.tokens * 2),
      w_gu(dims.experts * dims.dim * 2 * inter),
      w_d(dims.experts * inter * dims.dim), dy(dims.tokens * dims.dim);
  std::vector<int32_t> indices(dims.tokens * 2);
  for (float& v : x) v = 2.0f * normal(rng);
  for (float& v : w_gu) v = 2.0f * normal(rng);  // some past the clamp
  for (float& v : w_d) v = normal(rng);
  for (float& v : dy) v = normal(rng);
  for (float& v : weights) v = unit(rng);
  for (int64_t tk = 0; tk < dims.tokens; ++tk) {
    indices[2 * tk] = static_cast<int32_t>(tk % 3);
    indices[2 * tk + 1] = static_cast<int32_t>((tk + 1 + tk / 3) % 3);
    if (indices[2 * tk + 1] == indices[2 * tk]) {
      indices[2 * tk + 1] = (indices[2 * tk] + 1) % 3;
    }
  }
  ExpertOptions options;  // GPT-OSS's alpha and limit
  for (GatedActivation act :
       {GatedActivation::kSwiGLU, GatedActivation::kGeGLU,
        GatedActivation::kClampedSwiGLU}) {
    for (SimdLevel level : Levels()) {
      SCOPED_TRACE(::testing::Message()
                   << SimdLevelName(level) << " activation "
                   << static_cast<int>(act));
      SHARDD_ASSERT_OK(OverrideSimdLevel(level));
      GroupedExpertsWorkspace ws;
      std::vector<float> y(x.size()), dx(x.size()), dwt(weights.size());
      SHARDD_ASSERT_OK(GroupedExpertsForward(
          dims, act, options, x.data(), indices.data(), weights.data(),
          nullptr, w_gu.data(), w_d.data(), y.data(), &ws));
      SHARDD_ASSERT_OK(GroupedExpertsBackward(
          dims, act, options, w_gu.data(), w_d.data(), dy.data(), dx.data(),
          false, dwt.data(), nullptr, nullptr, ExpertBiasGrads{}, &ws));
      ASSERT_EQ(ws.rows, dims.tokens * 2);
      auto check = [&](const auto& element) {
        for (int64_t r = 0; r < ws.rows; ++r) {
          const float* h = ws.h.data() + r * 2 * inter;
          const float* da = ws.da.data() + r * inter;
          const float w = ws.row_weight[r];
          float lanes[8] = {};
          for (int64_t i = 0; i < inter; ++i) {
            ASSERT_EQ(ws.a[r * inter + i], element.Forward(h[i], h[inter + i], w))
                << r << "," << i;
            float w_term, dg, du;
            element.Backward(h[i], h[inter + i], da[i], w, &w_term, &dg, &du);
            ASSERT_EQ(ws.dh[r * 2 * inter + i], dg) << r << "," << i;
            ASSERT_EQ(ws.dh[r * 2 * inter + inter + i], du) << r << "," << i;
            lanes[i % 8] += w_term;
          }
          float sum = 0.0f;
          for (float lane : lanes) sum += lane;
          ASSERT_EQ(ws.row_dweight[r], sum) << r;
        }
      };
      switch (act) {
        case GatedActivation::kSwiGLU:
          check(ProductGate<SiluGate>{});
          break;
        case GatedActivation::kGeGLU:
          check(ProductGate<GeluTanhGate>{});
          break;
        case GatedActivation::kClampedSwiGLU:
          check(ClampedSwiGluGate{options.alpha, options.limit});
          break;
      }
    }
  }
  SHARDD_ASSERT_OK(OverrideSimdLevel(SimdLevel::kBaseline));
}

}  // namespace
}  // namespace kernels
}  // namespace shardd
