#ifndef SHARDD_KERNELS_CPU_GRAD_CHECK_H_
#define SHARDD_KERNELS_CPU_GRAD_CHECK_H_

// Finite-difference helpers shared by the kernel tests (test-only target).

#include <algorithm>
#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace shardd {
namespace kernels {
namespace testing_util {

// Central differences of f() with respect to every element of v (restored
// afterwards): g[i] = (f(v + eps e_i) - f(v - eps e_i)) / (2 eps).
template <typename T, typename F>
std::vector<double> NumericGrad(std::vector<T>& v, double eps, F f) {
  std::vector<double> g(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const T saved = v[i];
    v[i] = saved + static_cast<T>(eps);
    const double lp = f();
    v[i] = saved - static_cast<T>(eps);
    const double lm = f();
    v[i] = saved;
    g[i] = (lp - lm) / (2 * eps);
  }
  return g;
}

// Every got[i] within tol * max(1, |want[i]|) of want[i].
inline void ExpectGradNear(const std::vector<float>& got,
                           const std::vector<double>& want, double tol,
                           const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], tol * std::max(1.0, std::abs(want[i])))
        << what << "[" << i << "]";
  }
}

}  // namespace testing_util
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_GRAD_CHECK_H_
