// Cross-entropy's per-element arithmetic (cross_entropy_element.h), which the
// CUDA kernels share: the CPU kernel computes exactly these functions, and
// the GPU's one-read online softmax, replayed here with the CUDA kernel's
// thread layout and merge tree, agrees with the CPU's two-pass sum within a
// bound counted from its roundings.

#include "kernels/cpu/cross_entropy_element.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/softcap.h"

namespace shardd {
namespace kernels {
namespace {

constexpr double kU = 0x1p-24;  // unit roundoff of fp32
// kernels/cuda/cross_entropy_kernels.cu: one block of 512 threads per row.
constexpr int kThreads = 512;

std::vector<float> RandomWeights(int64_t vocab, int64_t dim, float spread,
                                 uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, spread);
  std::vector<float> w(vocab * dim);
  for (float& v : w) v = dist(rng);
  return w;
}

// The CPU kernel on one-hot hidden rows: token t's logits are exactly column
// t of the weight, and dweight's column t is exactly token t's logit
// gradient (every product is by 1 or 0 and lands on a zero).
struct Case {
  int64_t tokens = 6, dim = 8, vocab = 1000;
  std::vector<float> weight;
  std::vector<int32_t> targets;
  float softcap = 0.0f;
  float loss_scale = 0.37f;
};

float Logit(const Case& c, int64_t t, int64_t v) {
  return c.weight[v * c.dim + t];
}

void ExpectKernelIsTheElementFunctions(const Case& c) {
  std::vector<float> hidden(c.tokens * c.dim, 0.0f);
  for (int64_t t = 0; t < c.tokens; ++t) hidden[t * c.dim + t] = 1.0f;
  std::vector<float> dhidden(c.tokens * c.dim), dweight(c.vocab * c.dim, 0.0f);
  CrossEntropyOptions options;
  options.softcap = c.softcap;
  SHARDD_ASSERT_OK_AND_ASSIGN(
      CrossEntropyResult got,
      LmHeadCrossEntropyBackward(hidden.data(), c.weight.data(), c.tokens,
                                 c.dim, c.vocab, c.targets.data(),
                                 c.loss_scale, dhidden.data(), dweight.data(),
                                 false, options));
  const float inv = c.softcap > 0 ? SoftcapInverse(c.softcap) : 0.0f;
  double loss_sum = 0.0;
  int64_t count = 0;
  for (int64_t t = 0; t < c.tokens; ++t) {
    const int32_t target = c.targets[t];
    std::vector<float> y(c.vocab);
    for (int64_t v = 0; v < c.vocab; ++v) {
      y[v] = c.softcap > 0 ? SoftcapValue(Logit(c, t, v), c.softcap, inv)
                           : Logit(c, t, v);
    }
    if (target == options.ignore_index) {
      for (int64_t v = 0; v < c.vocab; ++v) {
        ASSERT_EQ(dweight[v * c.dim + t], 0.0f) << t << " " << v;
      }
      continue;
    }
    const float max = *std::max_element(y.begin(), y.end());
    double sum = 0.0;
    for (float yv : y) sum += SoftmaxTerm(yv, max);
    loss_sum += CrossEntropyRowLoss(max, sum, y[target]);
    ++count;
    const float scale = CrossEntropyGradScale(c.loss_scale, sum);
    for (int64_t v = 0; v < c.vocab; ++v) {
      float g = CrossEntropyLogitGrad(SoftmaxTerm(y[v], max), scale,
                                      v == target, c.loss_scale);
      if (c.softcap > 0) g = RnMul(g, SoftcapSlope(y[v], inv));
      // Bit for bit: the test fails if the kernel's library contracts any
      // of these steps into an FMA or computes them in another order.
      ASSERT_EQ(dweight[v * c.dim + t], g) << "token " << t << " logit " << v;
    }
  }
  EXPECT_EQ(got.count, count);
  EXPECT_EQ(got.loss_sum, loss_sum);
}

TEST(CrossEntropyElementTest, TheSharedElementFunctionsAreTheKernel) {
  Case c;
  c.weight = RandomWeights(c.vocab, c.dim, 3.0f, 11);
  c.targets = {3, 999, -1, 0, 512, 77};
  ExpectKernelIsTheElementFunctions(c);
}

TEST(CrossEntropyElementTest, TheSharedElementFunctionsAreTheCappedKernel) {
  Case c;
  c.weight = RandomWeights(c.vocab, c.dim, 40.0f, 12);  // beyond the cap
  c.targets = {3, 999, -1, 0, 512, 77};
  c.softcap = 30.0f;
  ExpectKernelIsTheElementFunctions(c);
}

TEST(CrossEntropyElementTest, SoftcapKernelIsTheElementFunctions) {
  std::vector<float> x = RandomWeights(4096, 1, 50.0f, 13);
  std::vector<float> y = x, dy(x.size(), 1.25f);
  SoftcapForward(y.data(), static_cast<int64_t>(y.size()), 30.0f);
  SoftcapBackward(y.data(), dy.data(), static_cast<int64_t>(y.size()), 30.0f);
  const float inv = SoftcapInverse(30.0f);
  for (size_t i = 0; i < x.size(); ++i) {
    const float want = SoftcapValue(x[i], 30.0f, inv);
    ASSERT_EQ(y[i], want) << i;
    ASSERT_EQ(dy[i], RnMul(1.25f, SoftcapSlope(want, inv))) << i;
    ASSERT_LE(std::abs(y[i]), 30.0f);
  }
}

// The CUDA row kernel's reduction replayed: thread i adds elements i,
// i + 512, ... in order; each warp merges by xor butterfly (offsets 16..1);
// warp 0 then merges the 16 warps' pairs the same way (lanes 16..31 empty).
// Every lane of a butterfly ends with the same pair; lane 0's is returned.
OnlineSoftmax ReplayGpuRow(const std::vector<float>& y) {
  std::vector<OnlineSoftmax> acc(kThreads, OnlineSoftmaxEmpty());
  for (size_t j = 0; j < y.size(); ++j) OnlineSoftmaxAdd(y[j], acc[j % kThreads]);
  auto butterfly = [](std::vector<OnlineSoftmax> lanes) {
    for (int offset = 16; offset > 0; offset >>= 1) {
      std::vector<OnlineSoftmax> next(32);
      for (int lane = 0; lane < 32; ++lane) {
        next[lane] = OnlineSoftmaxMerge(lanes[lane], lanes[lane ^ offset]);
      }
      lanes = next;
    }
    return lanes[0];
  };
  std::vector<OnlineSoftmax> warps(32, OnlineSoftmaxEmpty());
  for (int w = 0; w < kThreads / 32; ++w) {
    warps[w] = butterfly(std::vector<OnlineSoftmax>(acc.begin() + 32 * w,
                                                    acc.begin() + 32 * w + 32));
  }
  return butterfly(warps);
}

// Relative error of the online fp32 sum against the exact sum of the exact
// exponentials. A term's path: its exp (glibc's and CUDA's expf are within
// 2 ulp = 4u), then per step either a rescale by exp(max_old - max_new)
// (one exp, one multiply, one add: <= 6u) or an add (<= u). A thread takes
// ceil(V / 512) steps, the two butterflies 10 merges (each two exps, two
// multiplies and an add: <= 7u). Each bound is a relative bound on every
// term's contribution, so the sum's relative error is at most their total.
double OnlineSumBound(int64_t vocab) {
  const double steps = static_cast<double>((vocab + kThreads - 1) / kThreads);
  return (4.0 + 6.0 * steps + 7.0 * 10.0) * kU;
}

TEST(CrossEntropyElementTest, GpuOnlineSoftmaxAgreesWithTheTwoPassSum) {
  for (int64_t vocab : {1, 7, 512, 1000, 32000, 151936}) {
    for (float spread : {0.5f, 4.0f, 30.0f}) {
      std::vector<float> y = RandomWeights(vocab, 1, spread, 7 + vocab);
      const float max = *std::max_element(y.begin(), y.end());
      double exact = 0.0, two_pass = 0.0;
      for (float v : y) {
        exact += std::exp(static_cast<double>(v) - max);
        two_pass += SoftmaxTerm(v, max);
      }
      const OnlineSoftmax online = ReplayGpuRow(y);
      ASSERT_EQ(online.max, max) << vocab;
      const double bound = OnlineSumBound(vocab);
      EXPECT_LE(std::abs(online.sum - exact), bound * exact)
          << "vocab " << vocab << " spread " << spread;
      // The CPU's double sum: each term's exp within 4u, the double
      // additions negligible against it.
      EXPECT_LE(std::abs(two_pass - exact), 4.0 * kU * exact + 1e-12 * exact);
      // The row losses then differ by log(1 + rel) <= rel.
      const float target_logit = y[vocab / 2];
      EXPECT_NEAR(CrossEntropyRowLoss(online.max, online.sum, target_logit),
                  CrossEntropyRowLoss(max, two_pass, target_logit),
                  bound + 4.0 * kU + 1e-12);
    }
  }
}

TEST(CrossEntropyElementTest, OnlineSoftmaxSpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  // -inf logits add nothing; an all -inf row keeps an empty pair.
  OnlineSoftmax acc = OnlineSoftmaxEmpty();
  OnlineSoftmaxAdd(-inf, acc);
  EXPECT_EQ(acc.max, -inf);
  EXPECT_EQ(acc.sum, 0.0f);
  OnlineSoftmaxAdd(2.0f, acc);
  OnlineSoftmaxAdd(-inf, acc);
  OnlineSoftmaxAdd(2.0f, acc);
  EXPECT_EQ(acc.max, 2.0f);
  EXPECT_EQ(acc.sum, 2.0f);
  // Merging with an empty pair changes nothing.
  const OnlineSoftmax merged = OnlineSoftmaxMerge(acc, OnlineSoftmaxEmpty());
  EXPECT_EQ(merged.max, 2.0f);
  EXPECT_EQ(merged.sum, 2.0f);
  const OnlineSoftmax empty =
      OnlineSoftmaxMerge(OnlineSoftmaxEmpty(), OnlineSoftmaxEmpty());
  EXPECT_EQ(empty.max, -inf);
  EXPECT_EQ(empty.sum, 0.0f);
  // A NaN logit makes the row's sum, and so its loss, NaN (a diverged run
  // must show in the loss), wherever it falls relative to the max.
  for (float before : {-5.0f, 5.0f}) {
    OnlineSoftmax nan_acc = OnlineSoftmaxEmpty();
    OnlineSoftmaxAdd(before, nan_acc);
    OnlineSoftmaxAdd(std::numeric_limits<float>::quiet_NaN(), nan_acc);
    OnlineSoftmaxAdd(1.0f, nan_acc);
    EXPECT_TRUE(std::isnan(nan_acc.sum)) << before;
    EXPECT_TRUE(std::isnan(CrossEntropyRowLoss(nan_acc.max, nan_acc.sum, 0.0f)));
  }
  // The gradient of a confident correct row is ~0 at the target and the
  // softmax elsewhere.
  const float scale = CrossEntropyGradScale(1.0f, 1.0);
  EXPECT_EQ(CrossEntropyLogitGrad(1.0f, scale, true, 1.0f), 0.0f);
  EXPECT_EQ(CrossEntropyLogitGrad(0.25f, scale, false, 1.0f), 0.25f);
  // The softmax of a row sums to 1 within its roundings.
  const std::vector<float> y = RandomWeights(3000, 1, 3.0f, 99);
  const float max = *std::max_element(y.begin(), y.end());
  double total = 0.0, probs = 0.0;
  for (float v : y) total += SoftmaxTerm(v, max);
  for (float v : y) probs += SoftmaxProb(SoftmaxTerm(v, max), total);
  EXPECT_NEAR(probs, 1.0, 3000 * kU);
}

TEST(CrossEntropyElementTest, SoftcapSlopeIsTheDerivative) {
  const float cap = 30.0f, inv = SoftcapInverse(cap);
  for (int i = -200; i <= 200; ++i) {
    const double x = 0.5 * i;
    const float y = SoftcapValue(static_cast<float>(x), cap, inv);
    const double ref_y = cap * std::tanh(x / cap);
    // inv and x * inv each rounded (u): tanh's argument within 2u, which
    // moves tanh by at most 2u relative (z sech^2 z <= tanh z); tanh itself
    // within 2 ulp (4u); the product by cap u: 7u.
    EXPECT_NEAR(y, ref_y, 7.0 * kU * std::abs(ref_y) + 1e-30) << x;
    // t = y * inv within 7u + 2u, t^2 within 19u relative, t^2 <= 1, and
    // the subtraction's rounding u/2 of a result <= 1: 20u absolute.
    const double t = std::tanh(x / cap);
    EXPECT_NEAR(SoftcapSlope(y, inv), 1.0 - t * t, 20.0 * kU) << x;
  }
}

}  // namespace
}  // namespace kernels
}  // namespace shardd
