#include "kernels/cpu/adamw.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <utility>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/simd_level.h"

namespace shardd {
namespace kernels {
namespace {

using ::testing::HasSubstr;

TEST(AdamWTest, HandComputedFirstStep) {
  // At t = 1 with zero state: m_hat = g, v_hat = g^2, so
  //   p1 = p0 (1 - lr wd) - lr g / (|g| + eps).
  AdamWConfig cfg;
  cfg.lr = 0.1;
  cfg.beta1 = 0.9;
  cfg.beta2 = 0.999;
  cfg.eps = 1e-8;
  cfg.weight_decay = 0.01;
  std::vector<float> p = {1.0f, -2.0f, 3.0f};
  const std::vector<float> g = {0.5f, -0.25f, 0.0f};
  std::vector<float> m(3, 0.0f), v(3, 0.0f);
  SHARDD_ASSERT_OK(
      AdamWStep(p.data(), g.data(), m.data(), v.data(), 3, 1, cfg));
  EXPECT_NEAR(p[0], 1.0 * 0.999 - 0.1 * 0.5 / (0.5 + 1e-8), 1e-6);
  EXPECT_NEAR(p[1], -2.0 * 0.999 + 0.1 * 0.25 / (0.25 + 1e-8), 1e-6);
  EXPECT_NEAR(p[2], 3.0 * 0.999, 1e-6);  // zero grad: decay only
  EXPECT_NEAR(m[0], 0.1 * 0.5, 1e-8);
  EXPECT_NEAR(v[0], 0.001 * 0.25, 1e-9);
  EXPECT_NEAR(m[1], 0.1 * -0.25, 1e-8);
  EXPECT_NEAR(v[1], 0.001 * 0.0625, 1e-10);
  EXPECT_EQ(m[2], 0.0f);
  EXPECT_EQ(v[2], 0.0f);
}

// The update loop is cloned per SimdLevel and must give the same bits at
// each: a length that is no multiple of any vector width, gradients from
// far below eps to large, weight decay, three steps; the gradient norm and
// scaling too.
TEST(AdamWTest, EverySimdLevelGivesTheSameBits) {
  const SimdLevel supported = SupportedSimdLevel();
  const int64_t n = 1003;
  std::mt19937 rng(31);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::vector<float> p0(n), g(n);
  for (int64_t i = 0; i < n; ++i) {
    p0[i] = unit(rng);
    g[i] = unit(rng) * std::ldexp(1.0f, static_cast<int>(i % 40) - 32);
  }
  AdamWConfig cfg;
  cfg.lr = 0.01;
  cfg.weight_decay = 0.1;
  auto run = [&] {
    std::vector<float> p = p0, m(n, 0.0f), v(n, 0.0f);
    for (int64_t step = 1; step <= 3; ++step) {
      EXPECT_TRUE(
          AdamWStep(p.data(), g.data(), m.data(), v.data(), n, step, cfg)
              .ok());
    }
    ScaleInPlace(p.data(), n, 0.75f);
    const double norm = SumOfSquares(p.data(), n);
    p.insert(p.end(), m.begin(), m.end());
    p.insert(p.end(), v.begin(), v.end());
    p.push_back(static_cast<float>(norm));
    p.push_back(static_cast<float>(norm - static_cast<float>(norm)));
    return p;
  };
  SHARDD_ASSERT_OK(OverrideSimdLevel(SimdLevel::kBaseline));
  const std::vector<float> base = run();
  int compared = 0;
  for (SimdLevel level : {SimdLevel::kX86_64_V3, SimdLevel::kX86_64_V4}) {
    if (level > supported) continue;
    SCOPED_TRACE(SimdLevelName(level));
    SHARDD_ASSERT_OK(OverrideSimdLevel(level));
    EXPECT_EQ(run(), base);
    ++compared;
  }
  SHARDD_ASSERT_OK(OverrideSimdLevel(supported));
  std::printf("[simd] compared x86-64 with %d higher level(s), up to %s\n",
              compared, SimdLevelName(supported));
}

// The per-element function the CUDA kernel shares (adamw_element.h),
// called one element at a time here, is the CPU kernel bit for bit at every
// SIMD level, so the device's arithmetic is this arithmetic.
TEST(AdamWTest, TheSharedElementFunctionIsTheKernel) {
  const int64_t n = 517;
  std::mt19937 rng(41);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::vector<float> p0(n), g(n), m0(n), v0(n);
  for (int64_t i = 0; i < n; ++i) {
    p0[i] = unit(rng);
    g[i] = unit(rng) * std::ldexp(1.0f, static_cast<int>(i % 30) - 24);
    m0[i] = 0.1f * unit(rng);
    v0[i] = 0.01f * std::abs(unit(rng));
  }
  AdamWConfig cfg;
  cfg.lr = 3e-3;
  cfg.weight_decay = 0.05;
  const int64_t step = 4;
  absl::StatusOr<AdamWScalars> s = AdamWScalarsFor(cfg, step, "test");
  SHARDD_ASSERT_OK(s.status());
  std::vector<float> p = p0, m = m0, v = v0;
  for (int64_t i = 0; i < n; ++i) AdamWElement(p[i], g[i], m[i], v[i], *s);
  const SimdLevel supported = SupportedSimdLevel();
  for (SimdLevel level :
       {SimdLevel::kBaseline, SimdLevel::kX86_64_V3, SimdLevel::kX86_64_V4}) {
    if (level > supported) continue;
    SCOPED_TRACE(SimdLevelName(level));
    SHARDD_ASSERT_OK(OverrideSimdLevel(level));
    std::vector<float> kp = p0, km = m0, kv = v0;
    SHARDD_ASSERT_OK(
        AdamWStep(kp.data(), g.data(), km.data(), kv.data(), n, step, cfg));
    EXPECT_EQ(kp, p);
    EXPECT_EQ(km, m);
    EXPECT_EQ(kv, v);
  }
  SHARDD_ASSERT_OK(OverrideSimdLevel(supported));
  // The scalars' checks name the caller.
  cfg.beta2 = 1.0;
  EXPECT_THAT(AdamWScalarsFor(cfg, 1, "cuda AdamWStep").status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("cuda AdamWStep: beta2 must be finite")));
  cfg.beta2 = 0.999;
  EXPECT_THAT(AdamWScalarsFor(cfg, 0, "op").status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("op: step must be >= 1")));
}

// Textbook AdamW in double precision.
void RefStep(std::vector<double>* p, const std::vector<double>& g,
             std::vector<double>* m, std::vector<double>* v, int64_t t,
             const AdamWConfig& c) {
  for (size_t i = 0; i < p->size(); ++i) {
    (*p)[i] -= c.lr * c.weight_decay * (*p)[i];
    (*m)[i] = c.beta1 * (*m)[i] + (1 - c.beta1) * g[i];
    (*v)[i] = c.beta2 * (*v)[i] + (1 - c.beta2) * g[i] * g[i];
    const double m_hat = (*m)[i] / (1 - std::pow(c.beta1, t));
    const double v_hat = (*v)[i] / (1 - std::pow(c.beta2, t));
    (*p)[i] -= c.lr * m_hat / (std::sqrt(v_hat) + c.eps);
  }
}

TEST(AdamWTest, MatchesDoubleReferenceOverSeveralSteps) {
  const int64_t n = 257;
  AdamWConfig cfg;
  cfg.lr = 3e-3;
  cfg.beta1 = 0.8;
  cfg.beta2 = 0.95;
  cfg.eps = 1e-6;
  cfg.weight_decay = 0.1;
  std::mt19937 rng(3);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f);
  for (float& x : p) x = dist(rng);
  std::vector<double> pd(p.begin(), p.end()), md(n, 0.0), vd(n, 0.0);
  for (int64_t t = 1; t <= 12; ++t) {
    std::vector<float> g(n);
    for (float& x : g) x = 0.1f * dist(rng);
    SHARDD_ASSERT_OK(
        AdamWStep(p.data(), g.data(), m.data(), v.data(), n, t, cfg));
    RefStep(&pd, std::vector<double>(g.begin(), g.end()), &md, &vd, t, cfg);
  }
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_NEAR(p[i], pd[i], 1e-5 * std::max(1.0, std::abs(pd[i]))) << i;
    EXPECT_NEAR(m[i], md[i], 1e-6) << i;
    EXPECT_NEAR(v[i], vd[i], 1e-7) << i;
  }
}

TEST(AdamWTest, ShardedUpdateIsBitIdenticalToWhole) {
  const int64_t n = 100;
  AdamWConfig cfg;
  std::mt19937 rng(4);
  std::normal_distribution<float> dist;
  std::vector<float> p(n), g(n), m(n), v(n);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = dist(rng);
    g[i] = dist(rng);
    m[i] = 0.1f * dist(rng);
    v[i] = std::abs(0.1f * dist(rng));
  }
  auto p2 = p, m2 = m, v2 = v;
  SHARDD_ASSERT_OK(
      AdamWStep(p.data(), g.data(), m.data(), v.data(), n, 5, cfg));
  // Three uneven shards.
  for (auto [lo, hi] :
       {std::pair<int64_t, int64_t>{0, 33}, {33, 34}, {34, n}}) {
    SHARDD_ASSERT_OK(AdamWStep(p2.data() + lo, g.data() + lo, m2.data() + lo,
                               v2.data() + lo, hi - lo, 5, cfg));
  }
  EXPECT_EQ(p, p2);
  EXPECT_EQ(m, m2);
  EXPECT_EQ(v, v2);
}

TEST(AdamWTest, InvalidArgumentsWriteNothing) {
  std::vector<float> p = {1.0f}, g = {1.0f}, m = {0.0f}, v = {0.0f};
  AdamWConfig cfg;
  auto expect_invalid = [&](const AdamWConfig& c, int64_t step,
                            const char* what) {
    EXPECT_THAT(AdamWStep(p.data(), g.data(), m.data(), v.data(), 1, step, c),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(what)));
    EXPECT_EQ(p[0], 1.0f);
    EXPECT_EQ(m[0], 0.0f);
  };
  expect_invalid(cfg, 0, "step");
  AdamWConfig c = cfg;
  c.beta1 = 1.0;
  expect_invalid(c, 1, "beta1");
  c = cfg;
  c.beta2 = -0.1;
  expect_invalid(c, 1, "beta2");
  c = cfg;
  c.lr = -1;
  expect_invalid(c, 1, "lr");
  c = cfg;
  c.eps = NAN;
  expect_invalid(c, 1, "eps");
  c = cfg;
  c.weight_decay = -0.5;
  expect_invalid(c, 1, "weight_decay");
  EXPECT_THAT(AdamWStep(p.data(), g.data(), m.data(), v.data(), -1, 1, cfg),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("n")));
  EXPECT_THAT(AdamWStep(p.data(), nullptr, m.data(), v.data(), 1, 1, cfg),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("null")));
  SHARDD_EXPECT_OK(AdamWStep(nullptr, nullptr, nullptr, nullptr, 0, 1, cfg));
}

TEST(AdamWTest, SumOfSquaresAccumulatesInDouble) {
  const std::vector<float> small = {1.0f, 2.0f, 3.0f, -4.0f};
  EXPECT_EQ(SumOfSquares(small.data(), 4), 30.0);
  EXPECT_EQ(SumOfSquares(small.data(), 0), 0.0);
  // 2^22 copies of 0.1f: a float accumulator stalls far below the true sum
  // (whose fractional part also needs more than 24 bits).
  const int64_t n = int64_t{1} << 22;
  const std::vector<float> many(n, 0.1f);
  const double x = static_cast<double>(0.1f);
  EXPECT_NEAR(SumOfSquares(many.data(), n), n * x * x, 1e-9 * n * x * x);
}

TEST(AdamWTest, ScaleAndClipCoefficient) {
  std::vector<float> x = {1.0f, -2.0f, 4.0f};
  ScaleInPlace(x.data(), 3, 0.5f);
  EXPECT_EQ(x, (std::vector<float>{0.5f, -1.0f, 2.0f}));
  EXPECT_DOUBLE_EQ(ClipCoefficient(10.0, 1.0), 1.0 / (10.0 + 1e-6));
  EXPECT_EQ(ClipCoefficient(0.5, 1.0), 1.0);
  EXPECT_EQ(ClipCoefficient(10.0, 0.0), 1.0);
  EXPECT_EQ(ClipCoefficient(HUGE_VAL, 1.0), 0.0);
  EXPECT_TRUE(std::isnan(ClipCoefficient(NAN, 1.0)));
  // Clipping through the helpers brings the norm to max_norm.
  std::vector<float> g = {3.0f, 4.0f};  // norm 5
  const double coef =
      ClipCoefficient(std::sqrt(SumOfSquares(g.data(), 2)), 1.0);
  ScaleInPlace(g.data(), 2, static_cast<float>(coef));
  EXPECT_NEAR(std::sqrt(SumOfSquares(g.data(), 2)), 1.0, 1e-6);
}

}  // namespace
}  // namespace kernels
}  // namespace shardd
