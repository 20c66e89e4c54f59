#include "kernels/cpu/muon.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <random>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/cpu/muon_element.h"
#include "kernels/cpu/muon_reference.h"

namespace shardd {
namespace kernels {
namespace {

using muon_testing::DiffFrobenius;
using muon_testing::Frobenius;
using muon_testing::kA;
using muon_testing::kB;
using muon_testing::kC;
using muon_testing::kU;
using muon_testing::MatMul;
using muon_testing::NewtonSchulz64;
using muon_testing::RandomMatrix;
using muon_testing::Reference;
using muon_testing::Transpose;

// Eigenvalues of a symmetric n x n matrix (cyclic Jacobi, float64).
std::vector<double> SymmetricEigenvalues(std::vector<double> m, int n) {
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0;
    for (int i = 0; i < n; ++i) {
      for (int j = i + 1; j < n; ++j) off += m[i * n + j] * m[i * n + j];
    }
    if (off < 1e-30) break;
    for (int p = 0; p < n; ++p) {
      for (int q = p + 1; q < n; ++q) {
        if (std::abs(m[p * n + q]) < 1e-300) continue;
        const double theta = (m[q * n + q] - m[p * n + p]) / (2 * m[p * n + q]);
        const double t = (theta >= 0 ? 1.0 : -1.0) /
                         (std::abs(theta) + std::sqrt(theta * theta + 1));
        const double cs = 1 / std::sqrt(t * t + 1), sn = t * cs;
        for (int k = 0; k < n; ++k) {
          const double mkp = m[k * n + p], mkq = m[k * n + q];
          m[k * n + p] = cs * mkp - sn * mkq;
          m[k * n + q] = sn * mkp + cs * mkq;
        }
        for (int k = 0; k < n; ++k) {
          const double mpk = m[p * n + k], mqk = m[q * n + k];
          m[p * n + k] = cs * mpk - sn * mqk;
          m[q * n + k] = sn * mpk + cs * mqk;
        }
      }
    }
  }
  std::vector<double> eig(n);
  for (int i = 0; i < n; ++i) eig[i] = m[i * n + i];
  return eig;
}

// Singular values of a rows x cols matrix: sqrt of the eigenvalues of the
// smaller Gram matrix.
std::vector<double> SingularValues(const std::vector<double>& x, int64_t rows,
                                   int64_t cols) {
  const bool wide = rows <= cols;
  const std::vector<double> t = Transpose(x, rows, cols);
  const std::vector<double> gram =
      wide ? MatMul(x, t, rows, cols, rows) : MatMul(t, x, cols, rows, cols);
  std::vector<double> s =
      SymmetricEigenvalues(gram, static_cast<int>(std::min(rows, cols)));
  for (double& v : s) v = std::sqrt(std::max(0.0, v));
  return s;
}

std::vector<float> RunNewtonSchulz(std::vector<float> x, int64_t rows,
                                   int64_t cols, int steps) {
  std::vector<float> ws(NewtonSchulzWorkspace(rows, cols));
  EXPECT_THAT(NewtonSchulz(x.data(), rows, cols, steps, ws.data()), IsOk());
  return x;
}

struct NsCase {
  int64_t rows, cols;
};

class NewtonSchulzTest : public ::testing::TestWithParam<NsCase> {};

TEST_P(NewtonSchulzTest, MatchesFloat64WithinTheDerivedBound) {
  const NsCase c = GetParam();
  const std::vector<float> in = RandomMatrix(c.rows, c.cols, 11);
  const std::vector<float> got = RunNewtonSchulz(in, c.rows, c.cols, 5);
  const Reference ref = NewtonSchulz64(in, c.rows, c.cols, 5);
  const double diff = DiffFrobenius(got, ref.x);
  EXPECT_LE(diff, ref.bound) << c.rows << " x " << c.cols;
  // The worst-case bound (measured: 0.07 for ||X||_F ~ 2.5, while the
  // actual deviation is ~1e-6) still tells a missing step or a wrong
  // coefficient apart: 4 steps land further than it from the 5-step result.
  const std::vector<float> four = RunNewtonSchulz(in, c.rows, c.cols, 4);
  EXPECT_GT(DiffFrobenius(four, ref.x), ref.bound);
  std::cout << c.rows << " x " << c.cols << ": ||fp32 - fp64||_F = " << diff
            << ", bound " << ref.bound << ", 4 steps away by "
            << DiffFrobenius(four, ref.x) << "\n";
}

TEST_P(NewtonSchulzTest, SingularValuesEndInTheQuinticsBand) {
  // The tuned quintic does not converge to 1: after 5 steps a normalised
  // singular value s0 >= 0.002 lands in [0.68, 1.21] (iterating
  // p(s) = 3.4445 s - 4.775 s^3 + 2.0315 s^5 on a fine grid in float64:
  // min 0.6818, max 1.2024). A random Gaussian matrix, normalised, has
  // its singular values well above 0.002 for these shapes (checked).
  const NsCase c = GetParam();
  const std::vector<float> in = RandomMatrix(c.rows, c.cols, 5);
  std::vector<double> in64(in.begin(), in.end());
  const double norm = Frobenius(in64);
  for (double& v : in64) v /= norm;
  const std::vector<double> s_in = SingularValues(in64, c.rows, c.cols);
  ASSERT_GE(*std::min_element(s_in.begin(), s_in.end()), 0.002);
  const std::vector<float> got = RunNewtonSchulz(in, c.rows, c.cols, 5);
  const std::vector<double> s = SingularValues(
      std::vector<double>(got.begin(), got.end()), c.rows, c.cols);
  for (double v : s) {
    EXPECT_GE(v, 0.68);
    EXPECT_LE(v, 1.21);
  }
}

TEST_P(NewtonSchulzTest, TransposedInputGivesTheTransposedResultBitwise) {
  // rows > cols runs on the transpose: the same GEMMs on the same numbers.
  const NsCase c = GetParam();
  const std::vector<float> in = RandomMatrix(c.rows, c.cols, 3);
  std::vector<float> t(in.size());
  for (int64_t i = 0; i < c.rows; ++i) {
    for (int64_t j = 0; j < c.cols; ++j) t[j * c.rows + i] = in[i * c.cols + j];
  }
  const std::vector<float> got = RunNewtonSchulz(in, c.rows, c.cols, 5);
  const std::vector<float> got_t = RunNewtonSchulz(t, c.cols, c.rows, 5);
  for (int64_t i = 0; i < c.rows; ++i) {
    for (int64_t j = 0; j < c.cols; ++j) {
      ASSERT_EQ(got[i * c.cols + j], got_t[j * c.rows + i]) << i << "," << j;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, NewtonSchulzTest,
                         ::testing::Values(NsCase{8, 32}, NsCase{32, 8},
                                           NsCase{24, 40}, NsCase{64, 16}));

TEST(NewtonSchulzTest, ZeroStaysZeroAndArgumentsAreChecked) {
  std::vector<float> x(12, 0.0f);
  std::vector<float> ws(NewtonSchulzWorkspace(3, 4));
  ASSERT_THAT(NewtonSchulz(x.data(), 3, 4, 5, ws.data()), IsOk());
  for (float v : x) EXPECT_EQ(v, 0.0f);
  EXPECT_THAT(NewtonSchulz(x.data(), 0, 4, 5, ws.data()),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(NewtonSchulz(x.data(), 3, 4, 0, ws.data()),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(NewtonSchulz(nullptr, 3, 4, 5, ws.data()),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(MuonMomentumTest, NesterovUpdateAndMomentumAreTheFormulaInFp32) {
  const std::vector<float> g = RandomMatrix(1, 257, 1);
  const std::vector<float> m0 = RandomMatrix(1, 257, 2);
  const float beta = 0.95f;
  std::vector<float> update(g.size());
  MuonNesterovUpdate(g.data(), m0.data(), g.size(), beta, update.data());
  std::vector<float> m = m0;
  MuonMomentumStep(g.data(), m.data(), g.size(), beta);
  for (size_t i = 0; i < g.size(); ++i) {
    // The same fp32 operations, in the published order: exact equality.
    const float want_m = beta * m0[i] + (1.0f - beta) * g[i];
    const float want_u = (1.0f - beta) * g[i] + beta * want_m;
    ASSERT_EQ(m[i], want_m) << i;
    ASSERT_EQ(update[i], want_u) << i;
    // torch's lerp_ computes the same value in another order: within a
    // few ulps (|m|, |g| ~ 1; 3 roundings of terms <= 2 in magnitude).
    const float lerp_m = m0[i] + (1.0f - beta) * (g[i] - m0[i]);
    EXPECT_NEAR(m[i], lerp_m, 6 * kU * 2);
  }
}

TEST(MuonApplyTest, DecoupledDecayThenStep) {
  std::vector<float> p = {1.0f, -2.0f, 0.5f};
  const std::vector<float> u = {0.25f, 1.0f, -4.0f};
  MuonApply(p.data(), u.data(), 3, 0.02, 0.1);
  const float decay = static_cast<float>(1.0 - 0.02 * 0.1);
  const float lr = 0.02f;
  EXPECT_EQ(p[0], 1.0f * decay - lr * 0.25f);
  EXPECT_EQ(p[1], -2.0f * decay - lr * 1.0f);
  EXPECT_EQ(p[2], 0.5f * decay - lr * -4.0f);
  EXPECT_DOUBLE_EQ(MuonShapeScale(64, 16), 2.0);
  EXPECT_DOUBLE_EQ(MuonShapeScale(16, 64), 1.0);
}

// The device shares muon_element.h; the CPU kernels must compute exactly
// those functions (vectorised loops included), or a GPU and a CPU replica
// would drift apart. Fails if muon.cc contracts a step into an FMA.
TEST(MuonElementTest, TheSharedElementFunctionsAreTheKernel) {
  const int64_t n = 4099;
  const std::vector<float> g = RandomMatrix(1, n, 3);
  const std::vector<float> m0 = RandomMatrix(1, n, 4);
  const std::vector<float> p0 = RandomMatrix(1, n, 5);
  const float beta = 0.95f, one_minus_beta = 1.0f - beta;
  std::vector<float> update(n), m = m0, p = p0;
  MuonNesterovUpdate(g.data(), m0.data(), n, beta, update.data());
  MuonMomentumStep(g.data(), m.data(), n, beta);
  MuonApply(p.data(), update.data(), n, 0.02, 0.1);
  const MuonApplyScalars s = MuonApplyScalarsFor(0.02, 0.1);
  for (int64_t i = 0; i < n; ++i) {
    const float want_m = MuonMomentum(m0[i], g[i], beta, one_minus_beta);
    ASSERT_EQ(m[i], want_m) << i;
    ASSERT_EQ(update[i], MuonNesterov(g[i], want_m, beta, one_minus_beta))
        << i;
    ASSERT_EQ(p[i], MuonParamUpdate(p0[i], update[i], s)) << i;
  }
}

// Newton-Schulz's first step divides by MuonNormDenominator: a matrix
// scaled by 2^k gives the same normalised iterate, and a zero matrix the
// eps-guarded zero.
TEST(MuonElementTest, NormDenominatorIsTheRoundedNormPlusEps) {
  EXPECT_EQ(MuonNormDenominator(0.0, kNewtonSchulzEps), kNewtonSchulzEps);
  EXPECT_EQ(MuonNormDenominator(4.0, 0.0f), 2.0f);
  EXPECT_EQ(MuonNormDenominator(4.0, kNewtonSchulzEps), 2.0f);  // eps < ulp
  const double sum = 1.0 / 3.0;
  EXPECT_EQ(MuonNormDenominator(sum, 1e-3f),
            static_cast<float>(std::sqrt(sum)) + 1e-3f);
  std::vector<float> x = RandomMatrix(5, 7, 6), y = x;
  for (float& v : y) v *= 1024.0f;
  std::vector<float> ws(NewtonSchulzWorkspace(5, 7));
  double squares = 0.0;
  for (float v : x) squares += double{v} * v;
  ASSERT_GE(std::sqrt(squares), 4.0);  // the ulp bound below holds from 4 up
  SHARDD_ASSERT_OK(NewtonSchulz(x.data(), 5, 7, 5, ws.data()));
  SHARDD_ASSERT_OK(NewtonSchulz(y.data(), 5, 7, 5, ws.data()));
  // Scaling by 2^10 is exact through the double sum, the square root and
  // the rounding to fp32, and eps (1e-7) is under half an ulp of either
  // norm (~5.9 and ~6000), so the denominators are exactly 2^10 apart and
  // the normalised matrices, and with them the iterates, are the same bits.
  ASSERT_LT(kNewtonSchulzEps, 0.5f * (std::nextafter(4.0f, 8.0f) - 4.0f));
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(x[i], y[i]) << i;
}

}  // namespace
}  // namespace kernels
}  // namespace shardd
