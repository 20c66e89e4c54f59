#include "kernels/cpu/gemm.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <tuple>
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
      {700, 40, 96, CblasNoTrans, CblasNoTrans},
      {700, 40, 96, CblasTrans, CblasNoTrans},
      {610, 37, 120, CblasNoTrans, CblasTrans},
      {610, 37, 120, CblasTrans, CblasTrans},
      {1100, 129, 64, CblasNoTrans, CblasTrans},
      // Few rows, many columns (an LM head's block): cut by columns.
      {128, 1500, 40, CblasNoTrans, CblasTrans},
      {100, 1300, 48, CblasTrans, CblasNoTrans},
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

// A BLAS whose arithmetic depends on the call's size, as OpenBLAS's does on
// AVX-512 CPUs (its SkylakeX kernels send products of at most 1e6
// multiply-adds to a small-matrix kernel that rounds otherwise; the fake
// draws its line at 2e6 so that Sgemm's pieces fall under it): small calls
// sum k upwards and apply alpha and beta at the end, large ones scale C by
// beta first and sum k downwards. Row-major, any transposes.
void SizeDependentSgemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int m, int n,
                        int k, float alpha, const float* a, int lda,
                        const float* b, int ldb, float beta, float* c,
                        int ldc) {
  const bool small = int64_t{m} * n * k <= 2000000;
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      float acc = 0.0f;
      for (int q = 0; q < k; ++q) {
        const int p = small ? q : k - 1 - q;
        const float x = ta == CblasNoTrans ? a[i * lda + p] : a[p * lda + i];
        const float y = tb == CblasNoTrans ? b[p * ldb + j] : b[j * ldb + p];
        acc += x * y;
      }
      float& out = c[i * ldc + j];
      out = small ? alpha * acc + beta * out : beta * out + alpha * acc;
    }
  }
}

// With that BLAS the cuts decide the bits, and Sgemm's cuts are the same at
// every thread count: this is what fails on a Xeon if the cuts depend on
// the threads (issue 40), checked here on any CPU.
TEST(SgemmPiecesTest, SameBitsAtEveryThreadCountOnASizeDependentBlas) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> dist(-1, 1);
  const Shape shapes[] = {
      {700, 40, 96, CblasNoTrans, CblasNoTrans},
      {610, 37, 120, CblasTrans, CblasTrans},
      {1100, 129, 64, CblasNoTrans, CblasTrans},
      {1500, 33, 200, CblasTrans, CblasNoTrans},
      {128, 1500, 40, CblasNoTrans, CblasTrans},
      {100, 1300, 48, CblasTrans, CblasNoTrans},
  };
  for (const Shape& s : shapes) {
    const int rows_a = s.ta == CblasNoTrans ? s.m : s.k;
    const int cols_a = s.ta == CblasNoTrans ? s.k : s.m;
    const int rows_b = s.tb == CblasNoTrans ? s.k : s.n;
    const int cols_b = s.tb == CblasNoTrans ? s.n : s.k;
    const int lda = cols_a + 1, ldb = cols_b + 2, ldc = s.n + 3;
    std::vector<float> a(rows_a * lda), b(rows_b * ldb), c0(s.m * ldc);
    for (float& x : a) x = dist(rng);
    for (float& x : b) x = dist(rng);
    for (float& x : c0) x = dist(rng);
    const float alpha = 0.75f, beta = 0.5f;
    auto run = [&](int threads) {
      EXPECT_TRUE(SetComputeThreads(threads).ok());
      std::vector<float> c = c0;
      internal::SgemmWith(&SizeDependentSgemm, s.ta, s.tb, s.m, s.n, s.k,
                          alpha, a.data(), lda, b.data(), ldb, beta, c.data(),
                          ldc);
      return c;
    };
    const std::vector<float> serial = run(1);
    for (int threads : {2, 3, 4}) {
      ASSERT_EQ(run(threads), serial)
          << s.m << "x" << s.n << "x" << s.k << " at " << threads
          << " threads";
    }
    // The fake tells cuts apart: one unsplit call differs from the pieces.
    std::vector<float> whole = c0;
    SizeDependentSgemm(s.ta, s.tb, s.m, s.n, s.k, alpha, a.data(), lda,
                       b.data(), ldb, beta, whole.data(), ldc);
    const SgemmPieces pieces = SgemmPiecesFor(s.m, s.n, s.k);
    ASSERT_TRUE(pieces.rows < s.m || pieces.cols < s.n)
        << s.m << "x" << s.n << "x" << s.k;
    EXPECT_NE(whole, serial) << s.m << "x" << s.n << "x" << s.k;
  }
  ASSERT_TRUE(SetComputeThreads(1).ok());
}

TEST(SgemmPiecesTest, PiecesFollowTheShapeAlone) {
  // Too small to cut: one call.
  for (const auto& [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{5, 6, 7},
                                {300, 40, 96},
                                {255, 8, 8},
                                {0, 8, 8},
                                {8, 0, 8},
                                {128, 200, 512}}) {
    const SgemmPieces p = SgemmPiecesFor(m, n, k);
    EXPECT_EQ(p.rows, std::max<int64_t>(m, 1)) << m << "x" << n << "x" << k;
    EXPECT_EQ(p.cols, std::max<int64_t>(n, 1)) << m << "x" << n << "x" << k;
  }
  for (int64_t m : {64, 128, 300, 1000, 4096, 100000}) {
    for (int64_t n : {40, 512, 4096, 32000}) {
      for (int64_t k : {64, 512, 4096}) {
        SCOPED_TRACE(::testing::Message() << m << "x" << n << "x" << k);
        const SgemmPieces p = SgemmPiecesFor(m, n, k);
        ASSERT_GE(p.rows, 1);
        ASSERT_GE(p.cols, 1);
        // One dimension is cut at most; rows first.
        ASSERT_TRUE(p.rows == m || p.cols == n);
        const bool by_rows = p.rows < m, by_cols = p.cols < n;
        if (by_cols) {
          EXPECT_EQ(p.rows, m);
        }
        const int64_t length = by_rows ? p.rows : p.cols;
        const int64_t other = by_rows ? n * k : m * k;
        if (!by_rows && !by_cols) {
          // One call only where neither side has two pieces' worth.
          for (int64_t extent : {m, n}) {
            const int64_t across = extent == m ? n * k : m * k;
            const int64_t min_len =
                std::max<int64_t>((int64_t{1} << 20) / across + 1,
                                  across >= (int64_t{1} << 20) ? 256 : 128);
            EXPECT_LT(extent, 2 * min_len);
          }
          continue;
        }
        // Whole register blocks, at least 128 (256 where the operand each
        // call packs is 4 MiB or more) and 2^20 multiply-adds, >= 2 pieces.
        EXPECT_EQ(length % 16, 0);
        EXPECT_GE(length, other >= (int64_t{1} << 20) ? 256 : 128);
        EXPECT_GE(length * other, int64_t{1} << 20);
        EXPECT_LT(length, by_rows ? m : n);
      }
    }
  }
  // The thread count does not enter.
  for (int threads : {1, 2, 3}) {
    ASSERT_TRUE(SetComputeThreads(threads).ok());
    EXPECT_EQ(SgemmPiecesFor(700, 40, 96).rows, 352);
    EXPECT_EQ(SgemmPiecesFor(1100, 129, 64).rows, 144);
    EXPECT_EQ(SgemmPiecesFor(128, 1500, 40).cols, 224);
  }
  ASSERT_TRUE(SetComputeThreads(1).ok());
}

}  // namespace
}  // namespace kernels
}  // namespace shardd
