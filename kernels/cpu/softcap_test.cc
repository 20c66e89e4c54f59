#include "kernels/cpu/softcap.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/grad_check.h"

namespace shardd {
namespace kernels {
namespace {

TEST(SoftcapTest, ForwardMatchesDoubleTanh) {
  const float cap = 5.0f;
  std::vector<float> x = {-40.0f, -5.0f, -0.3f, 0.0f, 0.7f, 5.0f, 12.0f};
  std::vector<float> y = x;
  SoftcapForward(y.data(), static_cast<int64_t>(y.size()), cap);
  for (size_t i = 0; i < x.size(); ++i) {
    const double want = 5.0 * std::tanh(double{x[i]} / 5.0);
    // x / cap and tanh each round once (tanh within 1 ulp), the product
    // once: |y| <= cap, so 4 u cap bounds the difference.
    EXPECT_NEAR(y[i], want, 4 * 0x1p-24 * 5.0) << i;
  }
}

TEST(SoftcapTest, BackwardMatchesFiniteDifferences) {
  const float cap = 3.0f;
  std::mt19937 gen(7);
  std::uniform_real_distribution<double> uni(-8.0, 8.0);
  std::vector<double> x(32), w(32);
  for (double& v : x) v = uni(gen);
  for (double& v : w) v = uni(gen);
  // L = sum w * softcap(x), in double for the differences.
  auto loss = [&] {
    double l = 0;
    for (size_t i = 0; i < x.size(); ++i) l += w[i] * cap * std::tanh(x[i] / cap);
    return l;
  };
  const std::vector<double> want =
      testing_util::NumericGrad(x, 1e-6, loss);
  std::vector<float> y(x.begin(), x.end());
  SoftcapForward(y.data(), 32, cap);
  std::vector<float> dy(w.begin(), w.end());
  SoftcapBackward(y.data(), dy.data(), 32, cap);
  // fp32: t = y / cap carries about 3 u relative error (x / cap, tanh,
  // the product, the division), so 1 - t^2 is within 7 u absolute and
  // dy = w (1 - t^2) within |w| 8 u <= 3.9e-6 (|w| <= 8). The central
  // differences in double are within 1e-16 |L| / eps < 1e-7 (|L| < 800)
  // plus eps^2 |f'''| < 1e-11. 1e-5 of max(1, |want|) covers both.
  testing_util::ExpectGradNear(dy, want, 1e-5, "dx");
}

}  // namespace
}  // namespace kernels
}  // namespace shardd
