#include "testing/numerics.h"

#include <cmath>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "testing/model_builder.h"
#include "gmock/gmock.h"
#include "gtest/gtest-spi.h"
#include "gtest/gtest.h"
#include "kernels/cpu/adamw.h"

namespace shardd {
namespace testing_util {
namespace {

TEST(NumericsTest, TolerancesOfTheTinyMoe) {
  EXPECT_DOUBLE_EQ(Gamma(0), 0.0);
  EXPECT_DOUBLE_EQ(Gamma(100), 100 * 0x1p-24 / (1 - 100 * 0x1p-24));
  // D 16, E 4, I 8, M 12, top-2, V 30, 2 layers: n_fwd = 2 * (4 * 16 + 4 +
  // 8 + 12 + 2 + 2) + 2 * 16 + 30 = 246; 64 tokens on 4 ranks: n_bwd =
  // 246 + 64 + 4 + 1 = 315.
  const v1::ModelSpec spec = TinyMoeSpec(TinyMoeShape());
  const StepTolerances tol = MoeStepTolerances(spec.dims(), 64, 4);
  EXPECT_DOUBLE_EQ(tol.loss, 2 * Gamma(246));
  EXPECT_DOUBLE_EQ(tol.grad, 2 * Gamma(246 + 315) * 8);
}

// One AdamW step of every tensor in `grads` from `before`.
struct Stepped {
  ParamMap params, exp_avg, exp_avg_sq;
  TrainingState state() const { return {&params, &exp_avg, &exp_avg_sq}; }
};

Stepped Step(const ParamMap& params, const ParamMap& grads, int step,
             const kernels::AdamWConfig& adamw) {
  Stepped out;
  out.params = params;
  for (const auto& [name, g] : grads) {
    out.exp_avg[name].assign(g.size(), 0.0f);
    out.exp_avg_sq[name].assign(g.size(), 0.0f);
    EXPECT_TRUE(kernels::AdamWStep(
                    out.params[name].data(), g.data(), out.exp_avg[name].data(),
                    out.exp_avg_sq[name].data(), static_cast<int64_t>(g.size()),
                    step + 1, adamw)
                    .ok());
  }
  return out;
}

class StepWithinRoundingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    adamw_.lr = 1e-2;
    adamw_.weight_decay = 0.1;
    // Gradients over 12 decades, down to well below eps = 1e-8, where AdamW
    // amplifies differences most.
    std::mt19937 rng(3);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<double> decade(-15.0, -3.0);
    std::vector<float>& p = params_["w"];
    std::vector<float>& g = grads_["w"];
    for (int i = 0; i < 4000; ++i) {
      p.push_back(0.02f * normal(rng));
      g.push_back(static_cast<float>(std::pow(10.0, decade(rng))) *
                  (normal(rng) < 0 ? -1.0f : 1.0f));
    }
    zeros_["w"].assign(p.size(), 0.0f);
    tol_.loss = 1e-5;
    tol_.grad = 1e-4;
  }

  // The gradient with a normwise error of `share` * tol.grad * ||g||.
  ParamMap Perturbed(double share, uint32_t seed) const {
    const std::vector<float>& g = grads_.at("w");
    std::mt19937 rng(seed);
    std::normal_distribution<double> normal(0.0, 1.0);
    std::vector<double> e(g.size());
    double e_norm = 0.0, g_norm = 0.0;
    for (size_t i = 0; i < g.size(); ++i) {
      e[i] = normal(rng);
      e_norm += e[i] * e[i];
      g_norm += static_cast<double>(g[i]) * g[i];
    }
    const double scale = share * tol_.grad * std::sqrt(g_norm / e_norm);
    ParamMap out = grads_;
    for (size_t i = 0; i < g.size(); ++i) out["w"][i] += scale * e[i];
    return out;
  }

  kernels::AdamWConfig adamw_;
  StepTolerances tol_;
  ParamMap params_, grads_, zeros_;
};

TEST_F(StepWithinRoundingTest, AcceptsGradientErrorsWithinTheBound) {
  const TrainingState before{&params_, &zeros_, &zeros_};
  const Stepped want = Step(params_, grads_, 0, adamw_);
  for (uint32_t seed : {1u, 2u, 3u}) {
    const Stepped got = Step(params_, Perturbed(0.9, seed), 0, adamw_);
    BoundUse use;
    ExpectStepWithinRounding({}, adamw_, 0, tol_, before, want.state(),
                             got.state(), &use);
    EXPECT_GT(use.params, 0.0);
    EXPECT_LE(use.params, 1.0);
  }
}

// The messages of the non-fatal failures `fn` reports.
template <typename Fn>
std::string FailuresOf(Fn fn) {
  ::testing::TestPartResultArray results;
  {
    ::testing::ScopedFakeTestPartResultReporter reporter(
        ::testing::ScopedFakeTestPartResultReporter::
            INTERCEPT_ONLY_CURRENT_THREAD,
        &results);
    fn();
  }
  std::string all;
  for (int i = 0; i < results.size(); ++i) {
    all += results.GetTestPartResult(i).message();
    all += "\n";
  }
  return all;
}

TEST_F(StepWithinRoundingTest, RejectsWhatRoundingCannotExplain) {
  const TrainingState before{&params_, &zeros_, &zeros_};
  const Stepped want = Step(params_, grads_, 0, adamw_);
  auto check = [&](const Stepped& got, const std::set<std::string>& frozen) {
    return FailuresOf([&] {
      ExpectStepWithinRounding(frozen, adamw_, 0, tol_, before, want.state(),
                               got.state(), nullptr);
    });
  };
  using ::testing::HasSubstr;
  // A gradient 10x further off than allowed. (Spread over 4000 elements
  // that error stays under the per-element parameter bound, which allows
  // each element the whole normwise error: the moments catch it.)
  EXPECT_THAT(check(Step(params_, Perturbed(10.0, 1), 0, adamw_), {}),
              HasSubstr("first moment"));
  // One element's gradient with the wrong sign (a sum that lost a rank's
  // contribution there): its parameter moves the other way.
  ParamMap flipped = grads_;
  size_t largest = 0;
  for (size_t i = 0; i < flipped["w"].size(); ++i) {
    if (std::fabs(flipped["w"][i]) > std::fabs(flipped["w"][largest])) {
      largest = i;
    }
  }
  flipped["w"][largest] = -flipped["w"][largest];
  EXPECT_THAT(check(Step(params_, flipped, 0, adamw_), {}),
              HasSubstr("w[" + std::to_string(largest) + "]"));
  // An unreduced sum over 2 ranks (no average).
  ParamMap doubled = grads_;
  for (float& x : doubled["w"]) x *= 2;
  EXPECT_THAT(check(Step(params_, doubled, 0, adamw_), {}),
              HasSubstr("second moment"));
  // A frozen tensor that moved.
  EXPECT_THAT(check(want, {"w"}), HasSubstr("p_got"));
  // Within the bound: nothing.
  EXPECT_EQ(check(Step(params_, Perturbed(0.5, 2), 0, adamw_), {}), "");
}

TEST(FreeRunningLossToleranceTest, StartsAtTheLossBoundAndGrows) {
  kernels::AdamWConfig adamw;
  adamw.lr = 1e-2;
  StepTolerances tol;
  tol.loss = 1e-5;
  tol.grad = 1e-4;
  EXPECT_DOUBLE_EQ(FreeRunningLossTolerance(0, 3.0, adamw, 1.0, tol), 3e-5);
  // First update: kappa = 1 * 1 * (1 + 1) = 2, lambda = 7.
  EXPECT_NEAR(FreeRunningLossTolerance(1, 3.0, adamw, 1.0, tol),
              3e-5 + 1e-2 * 2 * 7 * 2 * 1e-4, 1e-15);
  EXPECT_GT(FreeRunningLossTolerance(5, 3.0, adamw, 1.0, tol),
            FreeRunningLossTolerance(4, 3.0, adamw, 1.0, tol));
}

}  // namespace
}  // namespace testing_util
}  // namespace shardd
