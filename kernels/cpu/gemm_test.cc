#include "kernels/cpu/gemm.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/compute_pool.h"

namespace shardd {
namespace kernels {
namespace {

struct Shape {
  int m, n, k;
  CBLAS_TRANSPOSE ta, tb;
};

// C = alpha op(A) op(B) + beta C in double, and sum |alpha op(A)||op(B)|
// + |beta C| per element for the error bound.
void Reference(const Shape& s, float alpha, const std::vector<float>& a,
               int lda, const std::vector<float>& b, int ldb, float beta,
               const std::vector<float>& c0, int ldc, std::vector<double>* c,
               std::vector<double>* mag) {
  c->assign(c0.size(), 0.0);
  mag->assign(c0.size(), 0.0);
  for (int i = 0; i < s.m; ++i) {
    for (int j = 0; j < s.n; ++j) {
      double sum = 0, abs_sum = 0;
      for (int p = 0; p < s.k; ++p) {
        const double x = s.ta == CblasNoTrans ? a[i * lda + p] : a[p * lda + i];
        const double y = s.tb == CblasNoTrans ? b[p * ldb + j] : b[j * ldb + p];
        sum += x * y;
        abs_sum += std::abs(x * y);
      }
      (*c)[i * ldc + j] = alpha * sum + beta * c0[i * ldc + j];
      (*mag)[i * ldc + j] =
          std::abs(alpha) * abs_sum + std::abs(beta * c0[i * ldc + j]);
    }
  }
}

class SgemmTest : public ::testing::TestWithParam<int> {};

TEST_P(SgemmTest, MatchesTheProductAtEveryTransposeAndSplit) {
  ASSERT_TRUE(SetComputeThreads(GetParam()).ok());
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1, 1);
  // Split by rows at every transpose, with a short last piece, and one
  // product too small to split.
  const Shape shapes[] = {
      {300, 40, 96, CblasNoTrans, CblasNoTrans},
      {300, 40, 96, CblasTrans, CblasNoTrans},
      {290, 37, 120, CblasNoTrans, CblasTrans},
      {290, 37, 120, CblasTrans, CblasTrans},
      {131, 129, 64, CblasNoTrans, CblasTrans},
      {5, 6, 7, CblasNoTrans, CblasNoTrans},
  };
  for (const Shape& s : shapes) {
    // Leading dimensions wider than the rows, as the kernels' strided views.
    const int rows_a = s.ta == CblasNoTrans ? s.m : s.k;
    const int cols_a = s.ta == CblasNoTrans ? s.k : s.m;
    const int rows_b = s.tb == CblasNoTrans ? s.k : s.n;
    const int cols_b = s.tb == CblasNoTrans ? s.n : s.k;
    const int lda = cols_a + 3, ldb = cols_b + 5, ldc = s.n + 2;
    std::vector<float> a(rows_a * lda), b(rows_b * ldb), c(s.m * ldc);
    for (float& x : a) x = dist(rng);
    for (float& x : b) x = dist(rng);
    for (float& x : c) x = dist(rng);
    const float alpha = 0.75f, beta = 0.5f;
    std::vector<double> want, mag;
    Reference(s, alpha, a, lda, b, ldb, beta, c, ldc, &want, &mag);
    const std::vector<float> before = c;
    // The same product on one thread: the split must not change a bit.
    std::vector<float> serial = c;
    ASSERT_TRUE(SetComputeThreads(1).ok());
    Sgemm(s.ta, s.tb, s.m, s.n, s.k, alpha, a.data(), lda, b.data(), ldb, beta,
          serial.data(), ldc);
    ASSERT_TRUE(SetComputeThreads(GetParam()).ok());
    Sgemm(s.ta, s.tb, s.m, s.n, s.k, alpha, a.data(), lda, b.data(), ldb, beta,
          c.data(), ldc);
    ASSERT_EQ(c, serial) << s.m << "x" << s.n << "x" << s.k;
    // fp32 products summed over k terms: |error| <= (k + 2) u sum|terms|.
    const double u = std::numeric_limits<float>::epsilon() / 2;
    for (int i = 0; i < s.m; ++i) {
      for (int j = 0; j < ldc; ++j) {
        const int at = i * ldc + j;
        if (j >= s.n) {
          ASSERT_EQ(c[at], before[at]) << "wrote past column n";
          continue;
        }
        ASSERT_NEAR(c[at], want[at], (s.k + 2) * u * mag[at])
            << s.m << "x" << s.n << "x" << s.k << " at " << i << "," << j;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Threads, SgemmTest, ::testing::Values(1, 2, 3));

}  // namespace
}  // namespace kernels
}  // namespace shardd
