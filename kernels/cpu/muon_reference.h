#ifndef SHARDD_KERNELS_CPU_MUON_REFERENCE_H_
#define SHARDD_KERNELS_CPU_MUON_REFERENCE_H_

// Test-only: Newton-Schulz in float64 with a bound, derived from the
// arithmetic, on how far an fp32 implementation may land from it. Shared by
// the CPU kernel's test (muon_test) and the CUDA one (kernels/cuda).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

namespace shardd {
namespace kernels {
namespace muon_testing {

inline constexpr double kU = 0x1p-24;  // fp32 unit roundoff.
inline constexpr double kA = 3.4445, kB = -4.7750, kC = 2.0315;

inline std::vector<float> RandomMatrix(int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(rows * cols);
  for (float& v : x) v = dist(gen);
  return x;
}

inline double Frobenius(const std::vector<double>& x) {
  double s = 0;
  for (double v : x) s += v * v;
  return std::sqrt(s);
}

// C = A B for row-major doubles: A is n x k, B is k x m.
inline std::vector<double> MatMul(const std::vector<double>& a,
                           const std::vector<double>& b, int64_t n, int64_t k,
                           int64_t m) {
  std::vector<double> c(n * m, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t p = 0; p < k; ++p) {
      for (int64_t j = 0; j < m; ++j)
        c[i * m + j] += a[i * k + p] * b[p * m + j];
    }
  }
  return c;
}

inline std::vector<double> Transpose(const std::vector<double>& x, int64_t rows,
                              int64_t cols) {
  std::vector<double> t(x.size());
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) t[j * rows + i] = x[i * cols + j];
  }
  return t;
}

struct Reference {
  std::vector<double> x;  // The float64 result, rows x cols.
  // First-order bound on ||fp32 result - x||_F (see ExpectNearReference).
  double bound = 0;
};

// Newton-Schulz in float64 with the same steps, plus a running bound on the
// fp32 kernel's deviation from it, derived from the arithmetic:
//  - a GEMM of inner dimension k rounds each element by at most
//    gamma_k |row| . |col| <= k u |row| |col|, so over the matrix
//    ||fl(P Q) - P Q||_F <= k u ||P||_F ||Q||_F (Cauchy-Schwarz), and the
//    scalings and additions add u per operation;
//  - an error E already in X moves the next iterate, to first order, by the
//    Frechet derivative of X -> p(X) = aX + b XX^T X + c (XX^T)^2 X, whose
//    Frobenius gain is at most max |p'(s)| over the singular values s in
//    [0, 1.21] (its divided differences, mean value theorem): 4.24.
// The bound grows as E' = 4.24 E + (the step's own rounding).
inline Reference NewtonSchulz64(const std::vector<float>& in, int64_t rows,
                         int64_t cols, int steps) {
  std::vector<double> x(in.begin(), in.end());
  const bool transpose = rows > cols;
  const int64_t r = std::min(rows, cols), c = std::max(rows, cols);
  if (transpose) x = Transpose(x, rows, cols);
  const double norm = Frobenius(x);
  for (double& v : x) v /= norm + 1e-7;
  constexpr double kSlope = 4.24;
  // Normalising: the fp32 input's norm (summed in double) and one division
  // round each element by about 2u relative: ||E_0||_F <= 2u.
  double bound = 2 * kU;
  for (int s = 0; s < steps; ++s) {
    const double fx = Frobenius(x);
    const std::vector<double> a = MatMul(x, Transpose(x, r, c), r, c, r);
    const double fa = Frobenius(a);
    const std::vector<double> aa = MatMul(a, a, r, r, r);
    std::vector<double> b(a.size());
    for (size_t i = 0; i < b.size(); ++i) b[i] = kB * a[i] + kC * aa[i];
    const double fb = Frobenius(b);
    std::vector<double> next = MatMul(b, x, r, r, c);
    for (size_t i = 0; i < next.size(); ++i) next[i] += kA * x[i];
    const double d_a = c * kU * fx * fx;
    const double d_b = std::abs(kC) * (r * kU * fa * fa + 2 * fa * d_a) +
                       std::abs(kB) * d_a +
                       2 * kU * (std::abs(kB) * fa + std::abs(kC) * fa * fa);
    const double d_x = r * kU * fb * fx + d_b * fx +
                       kU * (std::abs(kA) * fx + Frobenius(next));
    bound = kSlope * bound + d_x;
    x = std::move(next);
  }
  if (transpose) x = Transpose(x, r, c);
  return {x, bound};
}

inline double DiffFrobenius(const std::vector<float>& got,
                     const std::vector<double>& want) {
  double s = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = got[i] - want[i];
    s += d * d;
  }
  return std::sqrt(s);
}

}  // namespace muon_testing
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_MUON_REFERENCE_H_
