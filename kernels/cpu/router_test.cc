#include "kernels/cpu/router.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cpu/router_grad_element.h"
#include "kernels/cpu/test_vectors.h"

namespace shardd {
namespace kernels {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing_util::RandomVector;

// The router written plainly in double. With `fixed` non-null the selection
// is taken from it instead of being recomputed, which is the function whose
// gradient RouterBackward returns.
struct RefOut {
  std::vector<double> probs;     // [T, E]
  std::vector<int32_t> indices;  // [T, K]
  std::vector<double> weights;   // [T, K]
};

// The smallest gap, over tokens, between neighbours among the k + 1
// largest of x W^T (+ b) in double: a top-k selection (and its order) that
// a kernel must reproduce exactly is only defined by the data when this is
// far above the fp32 rounding of the scores, which differs with the BLAS
// kernel and so with the CPU.
double TopKMargin(const RouterDims& dm, const std::vector<double>& x,
                  const std::vector<double>& w, const std::vector<double>* b) {
  double margin = 1e300;
  for (int64_t t = 0; t < dm.tokens; ++t) {
    std::vector<double> logit(dm.experts);
    for (int64_t e = 0; e < dm.experts; ++e) {
      double s = b != nullptr ? (*b)[e] : 0.0;
      for (int64_t j = 0; j < dm.dim; ++j) {
        s += x[t * dm.dim + j] * w[e * dm.dim + j];
      }
      logit[e] = s;
    }
    std::sort(logit.begin(), logit.end(), std::greater<double>());
    const int64_t last = std::min<int64_t>(dm.top_k, dm.experts - 1);
    for (int64_t i = 0; i < last; ++i) {
      margin = std::min(margin, logit[i] - logit[i + 1]);
    }
  }
  return margin;
}

RefOut RefRouter(const RouterDims& dm, const std::vector<double>& x,
                 const std::vector<double>& w, const int32_t* fixed) {
  RefOut out;
  out.probs.assign(dm.tokens * dm.experts, 0.0);
  out.indices.assign(dm.tokens * dm.top_k, 0);
  out.weights.assign(dm.tokens * dm.top_k, 0.0);
  for (int64_t t = 0; t < dm.tokens; ++t) {
    std::vector<double> logit(dm.experts);
    for (int64_t e = 0; e < dm.experts; ++e) {
      double s = 0.0;
      for (int64_t j = 0; j < dm.dim; ++j) {
        s += x[t * dm.dim + j] * w[e * dm.dim + j];
      }
      logit[e] = s;
    }
    const double mx = *std::max_element(logit.begin(), logit.end());
    double z = 0.0;
    for (double l : logit) z += std::exp(l - mx);
    double* p = &out.probs[t * dm.experts];
    for (int64_t e = 0; e < dm.experts; ++e) p[e] = std::exp(logit[e] - mx) / z;
    // Selection: a full sort by (prob desc, index asc).
    std::vector<int32_t> order(dm.experts);
    for (int64_t e = 0; e < dm.experts; ++e) order[e] = e;
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return p[a] > p[b]; });
    double sum = 0.0;
    for (int64_t k = 0; k < dm.top_k; ++k) {
      const int32_t e = fixed ? fixed[t * dm.top_k + k] : order[k];
      out.indices[t * dm.top_k + k] = e;
      sum += p[e];
    }
    for (int64_t k = 0; k < dm.top_k; ++k) {
      out.weights[t * dm.top_k + k] =
          p[out.indices[t * dm.top_k + k]] /
          (dm.renormalize ? std::max(sum, 1e-20) : 1.0);
    }
  }
  return out;
}

std::vector<double> ToDouble(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

// L = sum_{t,k} r[t,k] * weights[t,k] with the selection fixed.
double RefLoss(const RouterDims& dm, const std::vector<double>& x,
               const std::vector<double>& w, const int32_t* fixed,
               const std::vector<float>& r) {
  const RefOut out = RefRouter(dm, x, w, fixed);
  double loss = 0.0;
  for (size_t i = 0; i < r.size(); ++i) loss += r[i] * out.weights[i];
  return loss;
}

// Central differences of RefLoss with respect to every entry of `param`.
std::vector<double> FiniteDiff(const RouterDims& dm, std::vector<double> x,
                               std::vector<double> w, bool wrt_x,
                               const int32_t* fixed,
                               const std::vector<float>& r) {
  constexpr double kEps = 1e-3;
  std::vector<double>& param = wrt_x ? x : w;
  std::vector<double> grad(param.size());
  for (size_t i = 0; i < param.size(); ++i) {
    const double saved = param[i];
    param[i] = saved + kEps;
    const double up = RefLoss(dm, x, w, fixed, r);
    param[i] = saved - kEps;
    const double down = RefLoss(dm, x, w, fixed, r);
    param[i] = saved;
    grad[i] = (up - down) / (2 * kEps);
  }
  return grad;
}

void ExpectClose(const std::vector<float>& got, const std::vector<double>& want,
                 double rel_tol, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 1e-3;  // absolute floor for all-zero gradients
  for (double v : want) scale = std::max(scale, std::abs(v));
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], rel_tol * scale) << what << "[" << i << "]";
  }
}

// The CUDA router shares router_grad_element.h; the CPU router's d_logits
// must be exactly those functions (each fp32 operation rounded once) for
// every scoring, with and without renormalisation and extra_d_logits.
TEST(RouterTest, TheSharedGradientFunctionsAreTheKernel) {
  struct Scoring {
    RouterScoring scoring;
    bool renormalize;
    int64_t groups, top_groups;
    float scale;
  };
  for (const Scoring& sc :
       {Scoring{RouterScoring::kSoftmaxThenTopK, true, 1, 1, 1.0f},
        Scoring{RouterScoring::kSoftmaxThenTopK, false, 1, 1, 1.0f},
        Scoring{RouterScoring::kTopKThenSoftmax, true, 1, 1, 1.0f},
        Scoring{RouterScoring::kSigmoidGroupLimited, true, 4, 2, 2.5f},
        Scoring{RouterScoring::kSigmoidGroupLimited, false, 4, 2, 2.5f}}) {
    RouterDims dm;
    dm.tokens = 23;
    dm.dim = 12;
    dm.experts = 16;
    dm.top_k = 4;
    dm.renormalize = sc.renormalize;
    dm.scoring = sc.scoring;
    dm.groups = sc.groups;
    dm.top_groups = sc.top_groups;
    dm.scale = sc.scale;
    const std::vector<float> x = RandomVector(dm.tokens * dm.dim, 31);
    const std::vector<float> w = RandomVector(dm.experts * dm.dim, 32);
    const std::vector<float> dwt = RandomVector(dm.tokens * dm.top_k, 33);
    const std::vector<float> extra = RandomVector(dm.tokens * dm.experts, 34);
    std::vector<int32_t> idx(dm.tokens * dm.top_k);
    std::vector<float> wt(dm.tokens * dm.top_k), dx(dm.tokens * dm.dim);
    RouterCache cache;
    SHARDD_ASSERT_OK(RouterForward(dm, x.data(), w.data(), nullptr, idx.data(),
                                   wt.data(), &cache));
    SHARDD_ASSERT_OK(RouterBackward(dm, x.data(), w.data(), dwt.data(),
                                    extra.data(), dx.data(), false, nullptr,
                                    nullptr, &cache));
    const int64_t k = dm.top_k, e_count = dm.experts;
    for (int64_t t = 0; t < dm.tokens; ++t) {
      const int32_t* id = cache.indices.data() + t * k;
      const float* dw = dwt.data() + t * k;
      std::vector<float> want(e_count, 0.0f);
      if (sc.scoring == RouterScoring::kTopKThenSoftmax) {
        const float* pw = cache.probs.data() + t * k;
        const float dot = RouterPickedSoftmaxDot(pw, dw, k);
        for (int64_t j = 0; j < k; ++j) {
          want[id[j]] = RouterPickedSoftmaxGrad(pw[j], dw[j], dot);
        }
      } else if (sc.scoring == RouterScoring::kSigmoidGroupLimited) {
        const float* ps = cache.probs.data() + t * k;
        const float denom = cache.denom[t];
        const float dot = RouterSigmoidDot(ps, dw, k, denom);
        const float mult = RouterSigmoidMult(dm.scale, denom);
        for (int64_t j = 0; j < k; ++j) {
          want[id[j]] = RouterSigmoidGrad(mult, dw[j], dot, ps[j]);
        }
      } else {
        const float* p = cache.probs.data() + t * e_count;
        const float denom = cache.denom[t];
        const float inv = RouterRenormInverse(denom);
        const bool varies =
            denom > 0.0f && RouterPickedSum(p, id, k) > kRouterMinDenominator;
        const float dot = RouterRenormDot(p, id, dw, k, inv, varies);
        const float inner = RouterRenormInner(p, id, dw, k, dot, inv);
        for (int64_t e = 0; e < e_count; ++e) want[e] = -p[e] * inner;
        for (int64_t j = 0; j < k; ++j) {
          want[id[j]] += RouterRenormPickGrad(p[id[j]], dw[j], dot, inv);
        }
      }
      for (int64_t e = 0; e < e_count; ++e) {
        ASSERT_EQ(cache.d_logits[t * e_count + e],
                  want[e] + extra[t * e_count + e])
            << static_cast<int>(sc.scoring) << " renorm " << sc.renormalize
            << " token " << t << " expert " << e;
      }
    }
  }
}

TEST(RouterTest, ZeroWeightsSelectFirstExpertsWithEqualWeights) {
  // All logits 0 => probs 1/E everywhere; ties go to the lowest indices.
  const RouterDims dm{3, 4, 5, 3};
  std::vector<float> x = RandomVector(3 * 4, 1);
  std::vector<float> w(5 * 4, 0.0f);
  std::vector<int32_t> idx(3 * 3, -7);
  std::vector<float> wt(3 * 3, -7.0f);
  RouterCache cache;
  SHARDD_ASSERT_OK(
      RouterForward(dm, x.data(), w.data(), idx.data(), wt.data(), &cache));
  for (int t = 0; t < 3; ++t) {
    EXPECT_THAT(
        std::vector<int32_t>(idx.begin() + 3 * t, idx.begin() + 3 * t + 3),
        ElementsAre(0, 1, 2));
    for (int k = 0; k < 3; ++k) EXPECT_FLOAT_EQ(wt[3 * t + k], 1.0f / 3.0f);
    for (int e = 0; e < 5; ++e) EXPECT_FLOAT_EQ(cache.probs[5 * t + e], 0.2f);
  }
}

TEST(RouterTest, TiesGoToTheLowerExpertIndex) {
  // D = 1, x = 1: logits are W itself = [0, 2, 2, 1]; experts 1 and 2 tie.
  std::vector<float> x = {1.0f};
  std::vector<float> w = {0.0f, 2.0f, 2.0f, 1.0f};
  RouterCache cache;
  {
    std::vector<int32_t> idx(1);
    std::vector<float> wt(1);
    SHARDD_ASSERT_OK(RouterForward({1, 1, 4, 1}, x.data(), w.data(), idx.data(),
                                   wt.data(), &cache));
    EXPECT_EQ(idx[0], 1);
    EXPECT_FLOAT_EQ(wt[0], 1.0f);
  }
  {
    std::vector<int32_t> idx(3);
    std::vector<float> wt(3);
    SHARDD_ASSERT_OK(RouterForward({1, 1, 4, 3}, x.data(), w.data(), idx.data(),
                                   wt.data(), &cache));
    EXPECT_THAT(idx, ElementsAre(1, 2, 3));
    // Renormalized over the selection: e^2, e^2, e^1 over 2 e^2 + e.
    const double e1 = std::exp(1.0), e2 = std::exp(2.0);
    EXPECT_NEAR(wt[0], e2 / (2 * e2 + e1), 1e-6);
    EXPECT_NEAR(wt[1], e2 / (2 * e2 + e1), 1e-6);
    EXPECT_NEAR(wt[2], e1 / (2 * e2 + e1), 1e-6);
  }
}

TEST(RouterTest, ForwardMatchesReference) {
  for (int64_t k : {1, 2, 4}) {
    const RouterDims dm{7, 6, 4, k};
    std::vector<float> x = RandomVector(7 * 6, 11);
    std::vector<float> w = RandomVector(4 * 6, 12);
    std::vector<int32_t> idx(7 * k);
    std::vector<float> wt(7 * k);
    RouterCache cache;
    SHARDD_ASSERT_OK(
        RouterForward(dm, x.data(), w.data(), idx.data(), wt.data(), &cache));
    const RefOut ref = RefRouter(dm, ToDouble(x), ToDouble(w), nullptr);
    // Logits are 6-term dot products of values in [-1, 1]: within
    // 6 u 6 = 2e-6 in fp32 on any kernel, so a 1e-4 margin decides the
    // selection.
    ASSERT_GT(TopKMargin(dm, ToDouble(x), ToDouble(w), nullptr), 1e-4)
        << "k=" << k;
    EXPECT_EQ(idx, ref.indices) << "k=" << k;
    for (size_t i = 0; i < wt.size(); ++i) {
      EXPECT_NEAR(wt[i], ref.weights[i], 1e-6) << "k=" << k << " i=" << i;
    }
    for (int64_t t = 0; t < 7; ++t) {
      double sum = 0.0;
      for (int64_t j = 0; j < k; ++j) sum += wt[t * k + j];
      EXPECT_NEAR(sum, 1.0, 1e-6);
    }
    for (size_t i = 0; i < ref.probs.size(); ++i) {
      EXPECT_NEAR(cache.probs[i], ref.probs[i], 1e-6);
    }
  }
}

TEST(RouterTest, BackwardMatchesFiniteDifferences) {
  for (bool renormalize : {true, false})
    for (int64_t k : {1, 2, 3, 4}) {
      SCOPED_TRACE(::testing::Message()
                   << "k " << k << " renormalize " << renormalize);
      const RouterDims dm{7, 6, 4, k, renormalize};
      // Scale 2 makes the routing peaked enough to exercise the softmax.
      std::vector<float> x = RandomVector(7 * 6, 21, 2.0f);
      std::vector<float> w = RandomVector(4 * 6, 22);
      std::vector<float> r = RandomVector(7 * k, 23);  // = dL/dweights
      std::vector<int32_t> idx(7 * k);
      std::vector<float> wt(7 * k);
      RouterCache cache;
      SHARDD_ASSERT_OK(
          RouterForward(dm, x.data(), w.data(), idx.data(), wt.data(), &cache));
      std::vector<float> dx(7 * 6, 123.0f);  // overwritten
      std::vector<float> dw(4 * 6, 0.0f);
      SHARDD_ASSERT_OK(RouterBackward(dm, x.data(), w.data(), r.data(),
                                      dx.data(), false, dw.data(), &cache));
      const std::vector<double> fd_x =
          FiniteDiff(dm, ToDouble(x), ToDouble(w), true, idx.data(), r);
      const std::vector<double> fd_w =
          FiniteDiff(dm, ToDouble(x), ToDouble(w), false, idx.data(), r);
      ExpectClose(dx, fd_x, 1e-3, "dx");
      ExpectClose(dw, fd_w, 1e-3, "dw");
      if (k == 1 && renormalize) {
        // A single selected weight is always 1: nothing flows back (up to
        // rounding).
        for (float v : dx) EXPECT_NEAR(v, 0.0f, 1e-6);
      } else {
        double norm = 0.0;
        for (double v : fd_x) norm += v * v;
        EXPECT_GT(norm, 1e-4);  // the check above was not vacuous
      }
    }
}

TEST(RouterTest, BackwardMatchesFloatFiniteDifferencesOfTheKernel) {
  // The kernel differentiated against itself (fp32), skipping perturbations
  // that change the selection.
  const RouterDims dm{5, 4, 6, 2};
  std::vector<float> x = RandomVector(5 * 4, 31, 2.0f);
  std::vector<float> w = RandomVector(6 * 4, 32);
  std::vector<float> r = RandomVector(5 * 2, 33);
  std::vector<int32_t> idx(10), idx2(10);
  std::vector<float> wt(10), wt2(10);
  RouterCache cache, scratch;
  SHARDD_ASSERT_OK(
      RouterForward(dm, x.data(), w.data(), idx.data(), wt.data(), &cache));
  std::vector<float> dx(5 * 4);
  SHARDD_ASSERT_OK(RouterBackward(dm, x.data(), w.data(), r.data(), dx.data(),
                                  false, nullptr, &cache));
  auto loss = [&](bool* same) {
    EXPECT_THAT(RouterForward(dm, x.data(), w.data(), idx2.data(), wt2.data(),
                              &scratch),
                IsOk());
    *same = idx2 == idx;
    double l = 0.0;
    for (int i = 0; i < 10; ++i) l += static_cast<double>(r[i]) * wt2[i];
    return l;
  };
  int checked = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const float saved = x[i];
    bool same_up, same_down;
    x[i] = saved + 1e-2f;
    const double up = loss(&same_up);
    x[i] = saved - 1e-2f;
    const double down = loss(&same_down);
    x[i] = saved;
    if (!same_up || !same_down) continue;
    EXPECT_NEAR(dx[i], (up - down) / 2e-2, 2e-2) << i;
    ++checked;
  }
  EXPECT_GE(checked, 15);
}

// GPT-OSS's router in double: logits = x W^T + b, top-k of the logits
// (largest first, ties to the lower index; `fixed` non-null takes the
// selection from it), softmax over the k selected logits.
std::vector<double> RefTopKSoftmax(const RouterDims& dm,
                                   const std::vector<double>& x,
                                   const std::vector<double>& w,
                                   const std::vector<double>& b,
                                   const int32_t* fixed,
                                   std::vector<int32_t>* chosen) {
  std::vector<double> weights(dm.tokens * dm.top_k);
  if (chosen != nullptr) chosen->assign(dm.tokens * dm.top_k, 0);
  for (int64_t t = 0; t < dm.tokens; ++t) {
    std::vector<double> logit(dm.experts);
    for (int64_t e = 0; e < dm.experts; ++e) {
      double s = b[e];
      for (int64_t j = 0; j < dm.dim; ++j) {
        s += x[t * dm.dim + j] * w[e * dm.dim + j];
      }
      logit[e] = s;
    }
    std::vector<int32_t> order(dm.experts);
    for (int64_t e = 0; e < dm.experts; ++e) order[e] = e;
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t c) { return logit[a] > logit[c]; });
    std::vector<int32_t> sel(dm.top_k);
    double mx = -1e300, z = 0.0;
    for (int64_t k = 0; k < dm.top_k; ++k) {
      sel[k] = fixed ? fixed[t * dm.top_k + k] : order[k];
      if (chosen != nullptr) (*chosen)[t * dm.top_k + k] = sel[k];
      mx = std::max(mx, logit[sel[k]]);
    }
    for (int64_t k = 0; k < dm.top_k; ++k) z += std::exp(logit[sel[k]] - mx);
    for (int64_t k = 0; k < dm.top_k; ++k) {
      weights[t * dm.top_k + k] = std::exp(logit[sel[k]] - mx) / z;
    }
  }
  return weights;
}

// fp32 storage, or bf16 storage (every input rounded to bf16; the kernel
// still accumulates in fp32).
class TopKSoftmaxRouterTest : public ::testing::TestWithParam<bool> {};

TEST_P(TopKSoftmaxRouterTest, ForwardAndBackwardMatchTheReference) {
  const bool bf16 = GetParam();
  for (int64_t k : {1, 2, 4}) {
    SCOPED_TRACE(::testing::Message() << "k " << k << " bf16 " << bf16);
    RouterDims dm{9, 6, 5, k};
    dm.scoring = RouterScoring::kTopKThenSoftmax;
    dm.renormalize = false;  // Ignored by this scoring.
    std::vector<float> x = RandomVector(9 * 6, 51, 2.0f);
    std::vector<float> w = RandomVector(5 * 6, 52);
    std::vector<float> b = RandomVector(5, 53);
    if (bf16) {
      for (std::vector<float>* v : {&x, &w, &b}) {
        for (float& f : *v) f = RoundToBf16(f);
      }
    }
    std::vector<float> r = RandomVector(9 * k, 54);  // = dL/dweights
    std::vector<int32_t> idx(9 * k);
    std::vector<float> wt(9 * k);
    RouterCache cache;
    SHARDD_ASSERT_OK(RouterForward(dm, x.data(), w.data(), b.data(), idx.data(),
                                   wt.data(), &cache));
    std::vector<int32_t> want_idx;
    const std::vector<double> want = RefTopKSoftmax(
        dm, ToDouble(x), ToDouble(w), ToDouble(b), nullptr, &want_idx);
    // 7-term logits of size <= 13: within 7 u 13 = 5e-6 on any kernel.
    const std::vector<double> bd = ToDouble(b);
    ASSERT_GT(TopKMargin(dm, ToDouble(x), ToDouble(w), &bd), 1e-4);
    EXPECT_EQ(idx, want_idx);
    // Logits are sums of D + 1 = 7 terms of size <= 2 (a few ulp of 10),
    // the softmax adds a few ulp more: 1e-6 absolute on weights <= 1.
    for (size_t i = 0; i < wt.size(); ++i) {
      EXPECT_NEAR(wt[i], want[i], 1e-6) << i;
    }
    for (int64_t t = 0; t < 9; ++t) {
      double sum = 0.0;
      for (int64_t j = 0; j < k; ++j) sum += wt[t * k + j];
      EXPECT_NEAR(sum, 1.0, 1e-6);
    }

    std::vector<float> dx(9 * 6, 123.0f);  // Overwritten.
    std::vector<float> dw(5 * 6, 0.0f), db(5, 0.0f);
    SHARDD_ASSERT_OK(RouterBackward(dm, x.data(), w.data(), r.data(), dx.data(),
                                    false, dw.data(), db.data(), &cache));
    // Central differences of L = sum r * weights with the selection fixed,
    // in double: truncation error about eps^2 |f'''| ~ 1e-6, far below
    // the 1e-3 relative bound the fp32 kernel is held to (as the softmax
    // router is).
    auto fd = [&](int which) {
      std::vector<double> xs = ToDouble(x), ws = ToDouble(w), bs = ToDouble(b);
      std::vector<double>& v = which == 0 ? xs : (which == 1 ? ws : bs);
      std::vector<double> g(v.size());
      for (size_t i = 0; i < v.size(); ++i) {
        const double saved = v[i];
        double l[2];
        for (int side = 0; side < 2; ++side) {
          v[i] = saved + (side == 0 ? 1e-3 : -1e-3);
          const std::vector<double> out =
              RefTopKSoftmax(dm, xs, ws, bs, idx.data(), nullptr);
          l[side] = 0.0;
          for (size_t j = 0; j < out.size(); ++j) l[side] += r[j] * out[j];
        }
        v[i] = saved;
        g[i] = (l[0] - l[1]) / 2e-3;
      }
      return g;
    };
    const std::vector<double> fd_x = fd(0), fd_w = fd(1), fd_b = fd(2);
    ExpectClose(dx, fd_x, 1e-3, "dx");
    ExpectClose(dw, fd_w, 1e-3, "dw");
    ExpectClose(db, fd_b, 1e-3, "db");
    if (k == 1) {
      // One selected weight is the softmax of one logit: always 1.
      for (float v : dx) EXPECT_EQ(v, 0.0f);
      for (float v : db) EXPECT_EQ(v, 0.0f);
    } else {
      double norm = 0.0;
      for (double v : fd_b) norm += v * v;
      EXPECT_GT(norm, 1e-4);  // Not vacuous.
      // The softmax is shift-invariant, so each token's logit gradients
      // sum to zero, and so does db.
      double sum = 0.0;
      for (float v : db) sum += v;
      EXPECT_NEAR(sum, 0.0, 1e-5);
    }
  }
}

TEST_P(TopKSoftmaxRouterTest, SelectsOnLogitsNotOnAllExpertProbabilities) {
  // The bias alone decides: experts 3 then 1; the weights are the softmax
  // of those two logits only.
  RouterDims dm{1, 2, 4, 2};
  dm.scoring = RouterScoring::kTopKThenSoftmax;
  const std::vector<float> x = {0.0f, 0.0f}, w(8, 0.5f);
  const std::vector<float> b = {-1.0f, 1.0f, 0.0f, 2.0f};
  std::vector<int32_t> idx(2);
  std::vector<float> wt(2);
  RouterCache cache;
  SHARDD_ASSERT_OK(RouterForward(dm, x.data(), w.data(), b.data(), idx.data(),
                                 wt.data(), &cache));
  EXPECT_THAT(idx, ElementsAre(3, 1));
  EXPECT_NEAR(wt[0], 1.0 / (1.0 + std::exp(-1.0)), 1e-7);
  EXPECT_NEAR(wt[1], 1.0 / (1.0 + std::exp(1.0)), 1e-7);
  // The backward refuses a cache of the other scoring.
  dm.scoring = RouterScoring::kSoftmaxThenTopK;
  std::vector<float> r(2, 1.0f), dx(2);
  EXPECT_THAT(RouterBackward(dm, x.data(), w.data(), r.data(), dx.data(), false,
                             nullptr, &cache),
              StatusIs(absl::StatusCode::kFailedPrecondition));
}

INSTANTIATE_TEST_SUITE_P(Storage, TopKSoftmaxRouterTest,
                         ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Bf16" : "Fp32";
                         });

// DeepSeek-V3's router in double: s = sigmoid(x W^T), choice = s + c,
// groups ranked by the sum of their two best choices, the top_groups kept,
// others' choices set to 0, top-k of the choices (largest first, ties to
// the lower index, every sort stable); weights = scale * s / (sum + 1e-20)
// or scale * s. `fixed` non-null takes the selection from it. `margin`
// gets the smallest gap between a kept and a dropped group score or a
// chosen and an unchosen choice (how far the selection is from a tie).
std::vector<double> RefSigmoidGroup(const RouterDims& dm,
                                    const std::vector<double>& x,
                                    const std::vector<double>& w,
                                    const std::vector<double>& c,
                                    const int32_t* fixed,
                                    std::vector<int32_t>* chosen,
                                    double* margin = nullptr) {
  const int64_t e_count = dm.experts, size = e_count / dm.groups;
  std::vector<double> weights(dm.tokens * dm.top_k);
  if (chosen != nullptr) chosen->assign(dm.tokens * dm.top_k, 0);
  if (margin != nullptr) *margin = 1e300;
  auto ranked = [](const std::vector<double>& v) {
    std::vector<int32_t> order(v.size());
    for (size_t i = 0; i < v.size(); ++i) order[i] = static_cast<int32_t>(i);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return v[a] > v[b]; });
    return order;
  };
  for (int64_t t = 0; t < dm.tokens; ++t) {
    std::vector<double> score(e_count), choice(e_count);
    for (int64_t e = 0; e < e_count; ++e) {
      double l = 0.0;
      for (int64_t j = 0; j < dm.dim; ++j) {
        l += x[t * dm.dim + j] * w[e * dm.dim + j];
      }
      score[e] = 1.0 / (1.0 + std::exp(-l));
      choice[e] = score[e] + c[e];
    }
    std::vector<double> group(dm.groups);
    for (int64_t g = 0; g < dm.groups; ++g) {
      std::vector<double> members(choice.begin() + g * size,
                                  choice.begin() + (g + 1) * size);
      const std::vector<int32_t> order = ranked(members);
      group[g] = members[order[0]] + members[order[1]];
    }
    const std::vector<int32_t> group_order = ranked(group);
    std::vector<bool> keep(dm.groups, false);
    for (int64_t j = 0; j < dm.top_groups; ++j) keep[group_order[j]] = true;
    if (margin != nullptr && dm.top_groups < dm.groups) {
      *margin = std::min(*margin, group[group_order[dm.top_groups - 1]] -
                                      group[group_order[dm.top_groups]]);
    }
    for (int64_t e = 0; e < e_count; ++e) {
      if (!keep[e / size]) choice[e] = 0.0;
    }
    const std::vector<int32_t> order = ranked(choice);
    if (margin != nullptr && dm.top_k < e_count) {
      *margin = std::min(
          *margin, choice[order[dm.top_k - 1]] - choice[order[dm.top_k]]);
    }
    double sum = 0.0;
    for (int64_t k = 0; k < dm.top_k; ++k) {
      const int32_t e = fixed ? fixed[t * dm.top_k + k] : order[k];
      if (chosen != nullptr) (*chosen)[t * dm.top_k + k] = e;
      sum += score[e];
    }
    for (int64_t k = 0; k < dm.top_k; ++k) {
      const int32_t e = fixed ? fixed[t * dm.top_k + k] : order[k];
      weights[t * dm.top_k + k] =
          dm.scale * score[e] / (dm.renormalize ? sum + 1e-20 : 1.0);
    }
  }
  return weights;
}

// Parameter: bf16 storage (inputs rounded to bf16, fp32 arithmetic).
class SigmoidGroupRouterTest : public ::testing::TestWithParam<bool> {};

TEST_P(SigmoidGroupRouterTest, ForwardAndBackwardMatchTheReference) {
  const bool bf16 = GetParam();
  for (const bool renormalize : {true, false}) {
    for (const int64_t k : {1, 2, 3}) {
      SCOPED_TRACE(::testing::Message() << "k " << k << " renormalize "
                                        << renormalize << " bf16 " << bf16);
      // 8 experts in 4 groups of 2, 2 groups kept (the test config's).
      RouterDims dm{9, 6, 8, k, renormalize};
      dm.scoring = RouterScoring::kSigmoidGroupLimited;
      dm.groups = 4;
      dm.top_groups = 2;
      dm.scale = 2.5f;
      std::vector<float> x = RandomVector(9 * 6, 61, 2.0f);
      std::vector<float> w = RandomVector(8 * 6, 62);
      std::vector<float> c = RandomVector(8, 63, 0.3f);
      if (bf16) {
        for (std::vector<float>* v : {&x, &w, &c}) {
          for (float& f : *v) f = RoundToBf16(f);
        }
      }
      std::vector<float> r = RandomVector(9 * k, 64);  // = dL/dweights
      std::vector<int32_t> idx(9 * k);
      std::vector<float> wt(9 * k);
      RouterCache cache;
      SHARDD_ASSERT_OK(RouterForward(dm, x.data(), w.data(), nullptr,
                                     c.data(), idx.data(), wt.data(), &cache));
      std::vector<int32_t> want_idx;
      double margin = 0.0;
      const std::vector<double> want =
          RefSigmoidGroup(dm, ToDouble(x), ToDouble(w), ToDouble(c), nullptr,
                          &want_idx, &margin);
      // The selection is discrete: this data keeps every decision at least
      // 1e-4 from a tie, far above the fp32 rounding of the scores (a few
      // ulp of 1), so the kernel must choose exactly as the reference.
      ASSERT_GT(margin, 1e-4);
      EXPECT_EQ(idx, want_idx);
      // Scores are sigmoids of 6-term dot products (a few ulp of 1), the
      // weights a quotient of them times 2.5: 1e-6 absolute on weights
      // <= 2.5 leaves room for ~10 ulp.
      for (size_t i = 0; i < wt.size(); ++i) {
        EXPECT_NEAR(wt[i], want[i], 1e-6) << i;
      }
      std::vector<float> dx(9 * 6, 7.0f);  // Overwritten.
      std::vector<float> dw(8 * 6, 0.0f);
      SHARDD_ASSERT_OK(RouterBackward(dm, x.data(), w.data(), r.data(),
                                      dx.data(), false, dw.data(), &cache));
      // Central differences with the selection fixed, in double: step 1e-3
      // truncates about 1e-6 |f'''|, far below the 1e-3 relative bound the
      // fp32 kernel is held to, as the other scorings are.
      auto fd = [&](bool wrt_x) {
        std::vector<double> xs = ToDouble(x), ws = ToDouble(w);
        std::vector<double>& v = wrt_x ? xs : ws;
        std::vector<double> g(v.size());
        for (size_t i = 0; i < v.size(); ++i) {
          const double saved = v[i];
          double l[2];
          for (int side = 0; side < 2; ++side) {
            v[i] = saved + (side == 0 ? 1e-3 : -1e-3);
            const std::vector<double> out = RefSigmoidGroup(
                dm, xs, ws, ToDouble(c), idx.data(), nullptr);
            l[side] = 0.0;
            for (size_t j = 0; j < out.size(); ++j) l[side] += r[j] * out[j];
          }
          v[i] = saved;
          g[i] = (l[0] - l[1]) / 2e-3;
        }
        return g;
      };
      const std::vector<double> fd_x = fd(true), fd_w = fd(false);
      double norm = 0.0;
      for (double v : fd_w) norm += v * v;
      if (k == 1 && renormalize) {
        EXPECT_LT(norm, 1e-12);  // One renormalised weight is always 2.5.
      } else {
        EXPECT_GT(norm, 1e-4);  // Not vacuous.
      }
      ExpectClose(dx, fd_x, 1e-3, "dx");
      ExpectClose(dw, fd_w, 1e-3, "dw");
    }
  }
}

TEST_P(SigmoidGroupRouterTest, BiasSelectsWithinKeptGroupsWithoutWeighing) {
  // x = e_0 and W's first column gives the logits {2, 1.9, -3, -3, 0, 0.1,
  // -3, -3}: groups {0,1} {2,3} {4,5} {6,7}, one kept.
  RouterDims dm{1, 2, 8, 2};
  dm.scoring = RouterScoring::kSigmoidGroupLimited;
  dm.groups = 4;
  dm.top_groups = 1;
  dm.scale = 2.5f;
  const std::vector<float> logits = {2.0f, 1.9f, -3.0f, -3.0f,
                                     0.0f, 0.1f, -3.0f, -3.0f};
  std::vector<float> w(16, 0.0f);
  for (int e = 0; e < 8; ++e) w[e * 2] = logits[e];
  if (GetParam()) {
    for (float& f : w) f = RoundToBf16(f);
  }
  const std::vector<float> x = {1.0f, 0.0f};
  auto sigmoid = [&](int e) { return 1.0 / (1.0 + std::exp(-double(w[e * 2]))); };
  // Without a bias group 0 wins and both its experts are chosen.
  std::vector<int32_t> idx(2);
  std::vector<float> wt(2);
  RouterCache cache;
  SHARDD_ASSERT_OK(RouterForward(dm, x.data(), w.data(), nullptr, nullptr,
                                 idx.data(), wt.data(), &cache));
  EXPECT_THAT(idx, ElementsAre(0, 1));
  // A bias of 0.8 on expert 5 makes group 2 the best (0.5 + 0.525 + 0.8 >
  // 0.881 + 0.870): experts 5 then 4, weighed by their unbiased scores.
  std::vector<float> c(8, 0.0f);
  c[5] = 0.8f;
  SHARDD_ASSERT_OK(RouterForward(dm, x.data(), w.data(), nullptr, c.data(),
                                 idx.data(), wt.data(), &cache));
  EXPECT_THAT(idx, ElementsAre(5, 4));
  const double s5 = sigmoid(5), s4 = sigmoid(4);
  EXPECT_NEAR(wt[0], 2.5 * s5 / (s4 + s5), 1e-6);
  EXPECT_NEAR(wt[1], 2.5 * s4 / (s4 + s5), 1e-6);
  // Unnormalised: the scaled scores themselves.
  dm.renormalize = false;
  SHARDD_ASSERT_OK(RouterForward(dm, x.data(), w.data(), nullptr, c.data(),
                                 idx.data(), wt.data(), &cache));
  EXPECT_NEAR(wt[0], 2.5 * s5, 1e-6);
  EXPECT_NEAR(wt[1], 2.5 * s4, 1e-6);
  // Dropped groups' choices are 0, not -inf: with every choice of the kept
  // group 0 negative (bias -1: -0.119, -0.130), expert 2 of a dropped group
  // comes first at 0, as Hugging Face's masked_fill(~mask, 0.0) does.
  dm.renormalize = true;
  dm.top_k = 1;
  std::fill(c.begin(), c.end(), -1.0f);
  SHARDD_ASSERT_OK(RouterForward(dm, x.data(), w.data(), nullptr, c.data(),
                                 idx.data(), wt.data(), &cache));
  EXPECT_EQ(idx[0], 2);
}

INSTANTIATE_TEST_SUITE_P(Storage, SigmoidGroupRouterTest,
                         ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Bf16" : "Fp32";
                         });

TEST(RouterTest, SigmoidGroupLimitedRejectsBadGroups) {
  std::vector<float> x(12, 0.0f), w(24, 0.0f), wt(6), c(8, 0.0f);
  std::vector<int32_t> idx(6);
  RouterCache cache;
  RouterDims dm{3, 4, 6, 2};
  dm.scoring = RouterScoring::kSigmoidGroupLimited;
  dm.groups = 4;  // 6 experts do not split into 4 groups.
  EXPECT_THAT(RouterForward(dm, x.data(), w.data(), nullptr, nullptr,
                            idx.data(), wt.data(), &cache),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("groups must split experts=6")));
  dm.groups = 6;  // Groups of one: no two best.
  EXPECT_THAT(RouterForward(dm, x.data(), w.data(), nullptr, nullptr,
                            idx.data(), wt.data(), &cache),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("groups of at least 2")));
  dm.groups = 3;
  dm.top_groups = 4;
  EXPECT_THAT(RouterForward(dm, x.data(), w.data(), nullptr, nullptr,
                            idx.data(), wt.data(), &cache),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("top_groups must be in [1, groups=3]")));
  dm.top_groups = 1;
  dm.top_k = 3;  // One kept group holds 2 experts.
  EXPECT_THAT(RouterForward(dm, x.data(), w.data(), nullptr, nullptr,
                            idx.data(), wt.data(), &cache),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("exceeds the 2 experts")));
  // A selection bias belongs to this scoring only.
  RouterDims softmax{3, 4, 6, 2};
  EXPECT_THAT(RouterForward(softmax, x.data(), w.data(), nullptr, c.data(),
                            idx.data(), wt.data(), &cache),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("selection_bias")));
}

TEST(RouterTest, AccumulateSemantics) {
  const RouterDims dm{7, 6, 4, 2};
  std::vector<float> x = RandomVector(7 * 6, 41);
  std::vector<float> w = RandomVector(4 * 6, 42);
  std::vector<float> r = RandomVector(7 * 2, 43);
  std::vector<int32_t> idx(14);
  std::vector<float> wt(14);
  RouterCache cache;
  SHARDD_ASSERT_OK(
      RouterForward(dm, x.data(), w.data(), idx.data(), wt.data(), &cache));
  std::vector<float> dx(42, 0.0f), dw(24, 0.0f);
  SHARDD_ASSERT_OK(RouterBackward(dm, x.data(), w.data(), r.data(), dx.data(),
                                  false, dw.data(), &cache));
  // Accumulating dx adds onto what is there; dw always accumulates.
  std::vector<float> dx2(42, 1.0f), dw2 = dw;
  SHARDD_ASSERT_OK(RouterBackward(dm, x.data(), w.data(), r.data(), dx2.data(),
                                  true, dw2.data(), &cache));
  for (int i = 0; i < 42; ++i) EXPECT_NEAR(dx2[i], 1.0f + dx[i], 1e-6);
  for (int i = 0; i < 24; ++i) EXPECT_NEAR(dw2[i], 2.0f * dw[i], 1e-6);

  // Frozen router: no dW, and x is not needed.
  std::vector<float> dx3(42, 5.0f);
  SHARDD_ASSERT_OK(RouterBackward(dm, nullptr, w.data(), r.data(), dx3.data(),
                                  false, nullptr, &cache));
  for (int i = 0; i < 42; ++i) EXPECT_FLOAT_EQ(dx3[i], dx[i]);
}

TEST(RouterTest, ZeroTokens) {
  RouterCache cache;
  SHARDD_ASSERT_OK(
      RouterForward({0, 6, 4, 2}, nullptr, nullptr, nullptr, nullptr, &cache));
  std::vector<float> dw(24, 3.0f);
  SHARDD_ASSERT_OK(RouterBackward({0, 6, 4, 2}, nullptr, nullptr, nullptr,
                                  nullptr, false, dw.data(), &cache));
  for (float v : dw) EXPECT_EQ(v, 3.0f);
}

TEST(RouterTest, RejectsBadArguments) {
  std::vector<float> x(12, 0.0f), w(8, 0.0f), wt(6);
  std::vector<int32_t> idx(6);
  RouterCache cache;
  EXPECT_THAT(RouterForward({3, 4, 2, 3}, x.data(), w.data(), idx.data(),
                            wt.data(), &cache),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("top_k must be in [1, experts=2]")));
  EXPECT_THAT(RouterForward({3, 4, 2, 0}, x.data(), w.data(), idx.data(),
                            wt.data(), &cache),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("top_k")));
  EXPECT_THAT(RouterForward({3, 0, 2, 1}, x.data(), w.data(), idx.data(),
                            wt.data(), &cache),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dim")));
  EXPECT_THAT(
      RouterForward({-1, 4, 2, 1}, x.data(), w.data(), idx.data(), wt.data(),
                    &cache),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tokens")));
  EXPECT_THAT(RouterForward({3, 4, 2, 1}, nullptr, w.data(), idx.data(),
                            wt.data(), &cache),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("null")));
  EXPECT_THAT(RouterForward({3, 4, 2, 1}, x.data(), w.data(), idx.data(),
                            wt.data(), nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cache")));
  // Backward before any forward, and with other dims than the forward's.
  std::vector<float> r(6), dx(12), dw(8);
  EXPECT_THAT(RouterBackward({3, 4, 2, 2}, x.data(), w.data(), r.data(),
                             dx.data(), false, dw.data(), &cache),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("")));
  SHARDD_ASSERT_OK(RouterForward({3, 4, 2, 2}, x.data(), w.data(), idx.data(),
                                 wt.data(), &cache));
  EXPECT_THAT(RouterBackward({3, 4, 2, 1}, x.data(), w.data(), r.data(),
                             dx.data(), false, dw.data(), &cache),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("dims differ")));
  EXPECT_THAT(
      RouterBackward({3, 4, 2, 2}, x.data(), w.data(), nullptr, dx.data(),
                     false, dw.data(), &cache),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("d_weights")));
}

}  // namespace
}  // namespace kernels
}  // namespace shardd
