#include "kernels/cpu/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
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

using ::testing::AllOf;
using ::testing::HasSubstr;

std::vector<double> ToDouble(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

// Bounds for comparing two fp32 evaluations that sum in different orders
// (blocks of rows, micro-batches): any order of an n-term sum is within
// gamma(n) sum |x| of the exact one (Higham, Lemma 3.1), twice for two
// evaluations. A logit sums D products, the log-sum-exp V terms; dW sums
// over the T rows, dh over the V columns. The sums of |terms| are bounded
// from the inputs: |p - onehot| <= 1 for every logit, so
// sum |terms| <= |scale| sum_r |h[r, k]| for dW[j, k] and
// <= |scale| 2 max_j |w[j, k]| for dh[r, k] (sum_j |p_j - y_j| <= 2).
double Gamma(double n) {
  constexpr double u = 0x1p-24;
  return n * u / (1.0 - n * u);
}

// Naive double reference: full logits, mean over counted targets.
struct RefResult {
  double sum = 0;
  int64_t count = 0;
};
RefResult RefLoss(const std::vector<double>& h, const std::vector<double>& w,
                  const std::vector<int32_t>& targets, int64_t d, int64_t v,
                  int32_t ignore_index) {
  RefResult res;
  const int64_t t = targets.size();
  for (int64_t r = 0; r < t; ++r) {
    if (targets[r] == ignore_index) continue;
    std::vector<double> logits(v);
    for (int64_t j = 0; j < v; ++j) {
      double s = 0;
      for (int64_t k = 0; k < d; ++k) s += h[r * d + k] * w[j * d + k];
      logits[j] = s;
    }
    const double m = *std::max_element(logits.begin(), logits.end());
    double z = 0;
    for (double l : logits) z += std::exp(l - m);
    res.sum += m + std::log(z) - logits[targets[r]];
    ++res.count;
  }
  return res;
}

using testing_util::ExpectGradNear;
using testing_util::NumericGrad;
TEST(CrossEntropyTest, HandComputedTwoClass) {
  // D = 1, W rows [1] and [0]: logits = [x, 0]. -log softmax:
  //   target 0: log(1 + e^-x); target 1: log(1 + e^x).
  const std::vector<float> w = {1.0f, 0.0f};
  const std::vector<float> h = {2.0f, 2.0f, -1.0f};
  const std::vector<int32_t> targets = {0, 1, 1};
  SHARDD_ASSERT_OK_AND_ASSIGN(
      CrossEntropyResult res,
      LmHeadCrossEntropyForward(h.data(), w.data(), 3, 1, 2, targets.data()));
  const double expected = std::log1p(std::exp(-2.0)) +
                          std::log1p(std::exp(2.0)) +
                          std::log1p(std::exp(-1.0));
  EXPECT_EQ(res.count, 3);
  EXPECT_NEAR(res.loss_sum, expected, 1e-6);
  EXPECT_NEAR(res.mean_loss, expected / 3, 1e-6);
}

TEST(CrossEntropyTest, ZeroWeightsGiveLogV) {
  const int64_t t = 5, d = 3, v = 7;
  const std::vector<float> w(v * d, 0.0f);
  const auto h = RandomVector(t * d, 1);
  const std::vector<int32_t> targets = {0, 6, 3, 3, 1};
  SHARDD_ASSERT_OK_AND_ASSIGN(
      auto res,
      LmHeadCrossEntropyForward(h.data(), w.data(), t, d, v, targets.data()));
  EXPECT_NEAR(res.mean_loss, std::log(7.0), 1e-6);
  // Uniform softmax: dlogits = (1/V - onehot) * scale, so with h = e_k the
  // gradient is predictable; here check dh = dlogits @ W = 0 for W = 0 and
  // dW[j] = scale * sum_t (1/V - [j == t]) h[t].
  std::vector<float> dh(t * d, 5.0f), dw(v * d, 0.0f);
  const float scale = 0.5f;
  SHARDD_ASSERT_OK(LmHeadCrossEntropyBackward(h.data(), w.data(), t, d, v,
                                              targets.data(), scale, dh.data(),
                                              dw.data())
                       .status());
  for (float x : dh) EXPECT_EQ(x, 0.0f);
  for (int64_t j = 0; j < v; ++j)
    for (int64_t k = 0; k < d; ++k) {
      double want = 0;
      for (int64_t r = 0; r < t; ++r)
        want +=
            scale * ((1.0 / v) - (targets[r] == j ? 1.0 : 0.0)) * h[r * d + k];
      EXPECT_NEAR(dw[j * d + k], want, 1e-6);
    }
}

TEST(CrossEntropyTest, ForwardMatchesReferenceWithIgnoredTargets) {
  const int64_t t = 9, d = 6, v = 11;
  const auto h = RandomVector(t * d, 2, 2.0f);
  const auto w = RandomVector(v * d, 3, 2.0f);
  const std::vector<int32_t> targets = {3, -1, 10, 0, -1, 5, 5, 7, -1};
  SHARDD_ASSERT_OK_AND_ASSIGN(
      auto res,
      LmHeadCrossEntropyForward(h.data(), w.data(), t, d, v, targets.data()));
  const RefResult ref = RefLoss(ToDouble(h), ToDouble(w), targets, d, v, -1);
  EXPECT_EQ(res.count, 6);
  EXPECT_EQ(ref.count, 6);
  EXPECT_NEAR(res.loss_sum, ref.sum, 1e-5 * ref.sum);
  EXPECT_NEAR(res.mean_loss, ref.sum / 6, 1e-5 * ref.sum);

  // A custom ignore_index; -1 is then an error.
  std::vector<int32_t> t100 = targets;
  for (int32_t& x : t100)
    if (x == -1) x = -100;
  CrossEntropyOptions opts;
  opts.ignore_index = -100;
  SHARDD_ASSERT_OK_AND_ASSIGN(
      auto res100, LmHeadCrossEntropyForward(h.data(), w.data(), t, d, v,
                                             t100.data(), opts));
  EXPECT_EQ(res100.count, 6);
  EXPECT_DOUBLE_EQ(res100.loss_sum, res.loss_sum);
  EXPECT_THAT(
      LmHeadCrossEntropyForward(h.data(), w.data(), t, d, v, targets.data(),
                                opts),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("target -1")));
}

TEST(CrossEntropyTest, LargeLogitsAreStable) {
  // Logits around +-1000: exp() without the max shift would overflow.
  const int64_t d = 2, v = 3;
  const std::vector<float> w = {1, 0, 0, 1, -1, -1};
  const std::vector<float> h = {1000.0f, 999.0f, -1000.0f, 1000.5f};
  const std::vector<int32_t> targets = {1, 0};
  SHARDD_ASSERT_OK_AND_ASSIGN(
      auto res,
      LmHeadCrossEntropyForward(h.data(), w.data(), 2, d, v, targets.data()));
  // Row 0 logits [1000, 999, -1999], target 1:
  //   1000 + log(1 + e^-1 + e^-2999) - 999 = log(1 + e).
  // Row 1 logits [-1000, 1000.5, -0.5], target 0:
  //   1000.5 + log(1 + e^-2000.5 + e^-1001) + 1000 = 2000.5.
  const double expected = std::log1p(std::exp(1.0)) + 2000.5;
  ASSERT_TRUE(std::isfinite(res.loss_sum));
  EXPECT_NEAR(res.loss_sum, expected, 1e-3);
  std::vector<float> dh(2 * d), dw(v * d, 0.0f);
  SHARDD_ASSERT_OK(LmHeadCrossEntropyBackward(h.data(), w.data(), 2, d, v,
                                              targets.data(), 1.0f, dh.data(),
                                              dw.data())
                       .status());
  for (float x : dh) EXPECT_TRUE(std::isfinite(x));
  for (float x : dw) EXPECT_TRUE(std::isfinite(x));
}

TEST(CrossEntropyTest, BackwardMatchesFiniteDifferences) {
  const int64_t t = 5, d = 4, v = 6;
  auto h = RandomVector(t * d, 4, 1.5f);
  auto w = RandomVector(v * d, 5, 1.5f);
  const std::vector<int32_t> targets = {2, -1, 0, 5, 2};
  const int64_t count = 4;
  const float scale = 1.0f / count;  // gradient of the mean
  std::vector<float> dh(t * d, 77.0f), dw(v * d, 0.0f);
  SHARDD_ASSERT_OK_AND_ASSIGN(
      auto res,
      LmHeadCrossEntropyBackward(h.data(), w.data(), t, d, v, targets.data(),
                                 scale, dh.data(), dw.data()));
  EXPECT_EQ(res.count, count);
  // The ignored token's row is overwritten with zeros.
  for (int64_t k = 0; k < d; ++k) EXPECT_EQ(dh[1 * d + k], 0.0f);

  auto hd = ToDouble(h), wd = ToDouble(w);
  auto ref_mean = [&] {
    const RefResult r = RefLoss(hd, wd, targets, d, v, -1);
    return r.sum / r.count;
  };
  ExpectGradNear(dh, NumericGrad(hd, 1e-6, ref_mean), 1e-4, "dh");
  ExpectGradNear(dw, NumericGrad(wd, 1e-6, ref_mean), 1e-4, "dW");

  auto kernel_mean = [&] {
    auto r =
        LmHeadCrossEntropyForward(h.data(), w.data(), t, d, v, targets.data());
    EXPECT_TRUE(r.ok());
    return r->mean_loss;
  };
  ExpectGradNear(dh, NumericGrad(h, 1e-3, kernel_mean), 1e-2, "dh fp32");
  ExpectGradNear(dw, NumericGrad(w, 1e-3, kernel_mean), 1e-2, "dW fp32");
}

// Gemma's final_logit_softcapping: loss and gradients of the capped
// logits against a double reference; the inputs give logits of up to about
// 9, so a cap of 2 changes them a lot (an uncapped kernel fails).
TEST(CrossEntropyTest, SoftcapMatchesReferenceAndFiniteDifferences) {
  const int64_t t = 5, d = 4, v = 6;
  const double cap = 2.0;
  auto h = RandomVector(t * d, 14, 1.5f);
  auto w = RandomVector(v * d, 15, 1.5f);
  const std::vector<int32_t> targets = {2, -1, 0, 5, 3};
  CrossEntropyOptions options;
  options.softcap = static_cast<float>(cap);
  options.block_rows = 2;  // Rows in several blocks.
  std::vector<float> dh(t * d), dw(v * d, 0.0f);
  SHARDD_ASSERT_OK_AND_ASSIGN(
      auto res, LmHeadCrossEntropyBackward(h.data(), w.data(), t, d, v,
                                           targets.data(), 0.25f, dh.data(),
                                           dw.data(), false, options));
  ASSERT_EQ(res.count, 4);
  auto hd = ToDouble(h), wd = ToDouble(w);
  auto ref_mean = [&] {
    double sum = 0;
    for (int64_t r = 0; r < t; ++r) {
      if (targets[r] < 0) continue;
      std::vector<double> logits(v);
      double max = -1e300;
      for (int64_t j = 0; j < v; ++j) {
        double z = 0;
        for (int64_t k = 0; k < d; ++k) z += hd[r * d + k] * wd[j * d + k];
        logits[j] = cap * std::tanh(z / cap);
        max = std::max(max, logits[j]);
      }
      double e = 0;
      for (double z : logits) e += std::exp(z - max);
      sum += max + std::log(e) - logits[targets[r]];
    }
    return sum / 4;
  };
  // The loss: 4 terms of a log-sum-exp over V = 6 capped logits of D = 4
  // products; each within (D + V + 4) u of its magnitude (<= 2 cap + log V),
  // so within 1e-5 together.
  EXPECT_NEAR(res.mean_loss, ref_mean(), 1e-5);
  // As the uncapped test: double differences, fp32 gradients within 1e-4.
  ExpectGradNear(dh, NumericGrad(hd, 1e-6, ref_mean), 1e-4, "dh");
  ExpectGradNear(dw, NumericGrad(wd, 1e-6, ref_mean), 1e-4, "dW");
  options.softcap = -1.0f;
  EXPECT_FALSE(LmHeadCrossEntropyForward(h.data(), w.data(), t, d, v,
                                         targets.data(), options)
                   .ok());
}

TEST(CrossEntropyTest, BlockedEqualsUnblocked) {
  const int64_t t = 37, d = 8, v = 13;
  const auto h = RandomVector(t * d, 6);
  const auto w = RandomVector(v * d, 7);
  std::vector<int32_t> targets(t);
  for (int64_t i = 0; i < t; ++i) targets[i] = (i % 5 == 0) ? -1 : (i * 7) % v;
  const float scale = 1.0f / 29.0f;

  CrossEntropyOptions whole;
  whole.block_rows = t;  // one block: the unblocked computation
  std::vector<float> dh_ref(t * d), dw_ref(v * d, 0.0f);
  SHARDD_ASSERT_OK_AND_ASSIGN(
      auto ref, LmHeadCrossEntropyBackward(h.data(), w.data(), t, d, v,
                                           targets.data(), scale, dh_ref.data(),
                                           dw_ref.data(), false, whole));
  EXPECT_EQ(ref.count, 29);  // 37 tokens, positions 0, 5, ..., 35 ignored
  for (int64_t block : {1, 4, 16, 36, 1000}) {
    CrossEntropyOptions opts;
    opts.block_rows = block;
    SHARDD_ASSERT_OK_AND_ASSIGN(
        auto fwd, LmHeadCrossEntropyForward(h.data(), w.data(), t, d, v,
                                            targets.data(), opts));
    std::vector<float> dh(t * d), dw(v * d, 0.0f);
    SHARDD_ASSERT_OK_AND_ASSIGN(
        auto res,
        LmHeadCrossEntropyBackward(h.data(), w.data(), t, d, v, targets.data(),
                                   scale, dh.data(), dw.data(), false, opts));
    EXPECT_EQ(fwd.count, ref.count) << block;
    EXPECT_EQ(res.count, ref.count) << block;
    // Per-token losses are positive: relative to the sum, the logit and
    // log-sum-exp chains (D + V + a few) of both evaluations.
    const double loss_tol = 2 * Gamma(d + v + 4) * ref.loss_sum;
    EXPECT_NEAR(fwd.loss_sum, ref.loss_sum, loss_tol) << block;
    EXPECT_NEAR(res.loss_sum, ref.loss_sum, loss_tol) << block;
    for (int64_t r = 0; r < t; ++r) {
      for (int64_t k = 0; k < d; ++k) {
        double w_max = 0;
        for (int64_t j = 0; j < v; ++j)
          w_max = std::max(w_max, double{std::fabs(w[j * d + k])});
        const double tol = 2 * Gamma(d + 2 * v + 4) * scale * 2 * w_max;
        EXPECT_NEAR(dh[r * d + k], dh_ref[r * d + k], tol) << block;
      }
    }
    for (int64_t j = 0; j < v; ++j) {
      for (int64_t k = 0; k < d; ++k) {
        double h_sum = 0;
        for (int64_t r = 0; r < t; ++r) h_sum += std::fabs(h[r * d + k]);
        const double tol = 2 * Gamma(d + v + t + 4) * scale * h_sum;
        EXPECT_NEAR(dw[j * d + k], dw_ref[j * d + k], tol) << block;
      }
    }
  }
}

TEST(CrossEntropyTest, MicroBatchesWithGlobalScaleSumToGlobalMeanGradient) {
  // Two micro-batches with different counted-target counts: with loss_scale
  // = 1 / global_count, their summed dW equals the gradient of the global
  // mean; per-micro-batch means would not.
  const int64_t d = 3, v = 5;
  const auto h = RandomVector(6 * d, 8);
  const auto w = RandomVector(v * d, 9);
  const std::vector<int32_t> targets = {1, 4, -1, -1, -1, 0};  // 2 + 1
  const float scale = 1.0f / 3.0f;
  std::vector<float> dh_full(6 * d), dw_full(v * d, 0.0f);
  SHARDD_ASSERT_OK(LmHeadCrossEntropyBackward(h.data(), w.data(), 6, d, v,
                                              targets.data(), scale,
                                              dh_full.data(), dw_full.data())
                       .status());
  std::vector<float> dh_split(6 * d), dw_split(v * d, 0.0f);
  SHARDD_ASSERT_OK_AND_ASSIGN(
      auto r0,
      LmHeadCrossEntropyBackward(h.data(), w.data(), 3, d, v, targets.data(),
                                 scale, dh_split.data(), dw_split.data()));
  SHARDD_ASSERT_OK_AND_ASSIGN(
      auto r1, LmHeadCrossEntropyBackward(
                   h.data() + 3 * d, w.data(), 3, d, v, targets.data() + 3,
                   scale, dh_split.data() + 3 * d, dw_split.data()));
  EXPECT_EQ(r0.count, 2);
  EXPECT_EQ(r1.count, 1);
  // Split sums against whole ones (bounds at Gamma above); a row's dh does
  // not depend on the other rows but may be computed with another blocking.
  for (int64_t j = 0; j < v; ++j) {
    for (int64_t k = 0; k < d; ++k) {
      double h_sum = 0;
      for (int64_t r = 0; r < 6; ++r) h_sum += std::fabs(h[r * d + k]);
      EXPECT_NEAR(dw_split[j * d + k], dw_full[j * d + k],
                  2 * Gamma(d + v + 6 + 4) * scale * h_sum);
    }
  }
  for (int64_t r = 0; r < 6; ++r) {
    for (int64_t k = 0; k < d; ++k) {
      double w_max = 0;
      for (int64_t j = 0; j < v; ++j)
        w_max = std::max(w_max, double{std::fabs(w[j * d + k])});
      EXPECT_NEAR(dh_split[r * d + k], dh_full[r * d + k],
                  2 * Gamma(d + 2 * v + 4) * scale * 2 * w_max);
    }
  }
  // And dw_full is the gradient of the global mean (double reference).
  auto hd = ToDouble(h), wd = ToDouble(w);
  auto ref_mean = [&] {
    const RefResult r = RefLoss(hd, wd, targets, d, v, -1);
    return r.sum / r.count;
  };
  ExpectGradNear(dw_full, NumericGrad(wd, 1e-6, ref_mean), 1e-4, "dW");
}

TEST(CrossEntropyTest, AccumulationSemantics) {
  const int64_t t = 4, d = 3, v = 5;
  const auto h = RandomVector(t * d, 10);
  const auto w = RandomVector(v * d, 11);
  const std::vector<int32_t> targets = {0, -1, 4, 2};
  std::vector<float> dh1(t * d), dw1(v * d, 0.0f);
  SHARDD_ASSERT_OK(LmHeadCrossEntropyBackward(h.data(), w.data(), t, d, v,
                                              targets.data(), 0.25f, dh1.data(),
                                              dw1.data())
                       .status());
  std::vector<float> dh2(t * d, 1.0f), dw2(v * d, 3.0f);
  SHARDD_ASSERT_OK(LmHeadCrossEntropyBackward(
                       h.data(), w.data(), t, d, v, targets.data(), 0.25f,
                       dh2.data(), dw2.data(), /*accumulate_dhidden=*/true)
                       .status());
  for (size_t i = 0; i < dh1.size(); ++i)
    EXPECT_NEAR(dh2[i], dh1[i] + 1.0f, 1e-6);
  for (size_t i = 0; i < dw1.size(); ++i)
    EXPECT_NEAR(dw2[i], dw1[i] + 3.0f, 1e-6);
  // The ignored token's row is left as it was when accumulating.
  for (int64_t k = 0; k < d; ++k) EXPECT_EQ(dh2[d + k], 1.0f);
  // Null outputs are skipped.
  std::vector<float> dw3(v * d, 0.0f);
  SHARDD_ASSERT_OK(LmHeadCrossEntropyBackward(h.data(), w.data(), t, d, v,
                                              targets.data(), 0.25f, nullptr,
                                              dw3.data())
                       .status());
  EXPECT_EQ(dw3, dw1);
}

TEST(CrossEntropyTest, AllIgnored) {
  const int64_t t = 3, d = 2, v = 4;
  const auto h = RandomVector(t * d, 12);
  const auto w = RandomVector(v * d, 13);
  const std::vector<int32_t> targets = {-1, -1, -1};
  std::vector<float> dh(t * d, 9.0f), dw(v * d, 2.0f);
  SHARDD_ASSERT_OK_AND_ASSIGN(
      auto res,
      LmHeadCrossEntropyBackward(h.data(), w.data(), t, d, v, targets.data(),
                                 1.0f, dh.data(), dw.data()));
  EXPECT_EQ(res.count, 0);
  EXPECT_EQ(res.loss_sum, 0.0);
  EXPECT_EQ(res.mean_loss, 0.0);
  for (float x : dh) EXPECT_EQ(x, 0.0f);
  for (float x : dw) EXPECT_EQ(x, 2.0f);
}

TEST(CrossEntropyTest, InvalidArgumentsLeaveOutputsUntouched) {
  const int64_t t = 3, d = 2, v = 4;
  const auto h = RandomVector(t * d, 14);
  const auto w = RandomVector(v * d, 15);
  std::vector<float> dh(t * d, 9.0f), dw(v * d, 2.0f);
  for (int32_t bad : {4, -2}) {
    const std::vector<int32_t> targets = {0, 1, bad};
    EXPECT_THAT(
        LmHeadCrossEntropyBackward(h.data(), w.data(), t, d, v, targets.data(),
                                   1.0f, dh.data(), dw.data()),
        StatusIs(absl::StatusCode::kInvalidArgument,
                 AllOf(HasSubstr("target " + std::to_string(bad)),
                       HasSubstr("vocab=4"))));
  }
  for (float x : dh) EXPECT_EQ(x, 9.0f);
  for (float x : dw) EXPECT_EQ(x, 2.0f);

  const std::vector<int32_t> ok = {0, 1, 2};
  CrossEntropyOptions opts;
  opts.block_rows = 0;
  EXPECT_THAT(
      LmHeadCrossEntropyForward(h.data(), w.data(), t, d, v, ok.data(), opts),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("block_rows")));
  EXPECT_THAT(LmHeadCrossEntropyForward(h.data(), w.data(), t, d, 0, ok.data()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("vocab")));
  EXPECT_THAT(LmHeadCrossEntropyForward(h.data(), nullptr, t, d, v, ok.data()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("null")));
  EXPECT_THAT(
      LmHeadCrossEntropyBackward(h.data(), w.data(), t, d, v, ok.data(), NAN,
                                 dh.data(), dw.data()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("loss_scale")));
  // No tokens: nothing to do.
  SHARDD_ASSERT_OK_AND_ASSIGN(
      auto empty,
      LmHeadCrossEntropyForward(nullptr, nullptr, 0, d, v, nullptr));
  EXPECT_EQ(empty.count, 0);
}

}  // namespace
}  // namespace kernels
}  // namespace shardd
